"""What the stage records of :mod:`~pipedejavu.core.problem` (``Stage``) and
:mod:`~pipedejavu.core.hetero` (``HeteroStage``) share: the device count of
their submesh and their JSON form."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SubmeshStage"]


class SubmeshStage:
    """Base of a stage dataclass with a ``submesh`` field ``(hosts, devices
    per host)``: its :attr:`num_devices` and :meth:`to_json`.

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Placed(SubmeshStage):
        ...     submesh: tuple[int, int]
        ...     hosts: tuple[int, ...]
        ...     latency: float
        >>> stage = Placed((2, 4), (0, 1), 0.5)
        >>> stage.num_devices, stage.to_json()
        (8, {'submesh': [2, 4], 'hosts': [0, 1], 'latency': 0.5})
    """

    __slots__ = ()
    submesh: tuple[int, int]

    @property
    def num_devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    def to_json(self) -> dict[str, Any]:
        """Every field by name, in the dataclass's order; the tuple-typed
        ones (``submesh``, ``hosts``) as lists."""
        return {
            field.name: (
                list(getattr(self, field.name))
                if str(field.type).startswith("tuple")
                else getattr(self, field.name)
            )
            for field in dataclasses.fields(self)
        }
