"""Links priced from the GPU sheet, for GPU types nobody measured.

:class:`SheetNetwork` answers the same questions as
:class:`~pipedejavu.costmodel.megatron.sailor_data.NetworkTables` (``inter`` and
``intra``, each an *aggregate* :class:`BandwidthFit` for ``n`` GPUs sending at
once; see :mod:`pipedejavu.costmodel.megatron.comm`), with flat bandwidths read
from :class:`~pipedejavu.core.gpu_sheet.GpuSheetEntry` values:

* **Inside a node**, ``n`` GPUs form ``n / 2`` pairs and every GPU sends at its
  own NVLink (or PCIe) bandwidth ``intra_node_bytes_per_s``, scaled by
  ``efficiency``: aggregate ``max(n / 2, 1) * efficiency * intra``. A
  switched fabric (NVSwitch, Infinity Fabric) is assumed, so pairs do not share
  links.
* **Between nodes**, a node's ``inter_node_bytes_per_s`` is split evenly over its
  GPUs (one NIC per GPU or per pair of GPUs, as DGX-style nodes are built), so
  ``n`` streams get ``min(n, gpus_per_node) / gpus_per_node`` of it; between two
  types the slower side limits.

Where ``measured`` tables are given and hold a fit for the link, the measured
fit wins (profiled clusters keep their measured network).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.sailor_data import BandwidthFit, NetworkTables

__all__ = ["SheetNetwork", "flat_fit", "sheet_entry", "tp_bandwidth"]


def sheet_entry(
    sheet: Mapping[str, GpuSheetEntry], gpu: str, hint: str = ""
) -> GpuSheetEntry:
    """``sheet[gpu]``.

    Raises:
        ProblemError: ``gpu`` is not on the sheet (the message lists the types
            that are, then ``hint``).
    """
    if gpu not in sheet:
        raise ProblemError(
            f"GPU type {gpu!r} is not on the GPU sheet (known: "
            f"{', '.join(sorted(sheet))}{hint})"
        )
    return sheet[gpu]


def tp_bandwidth(
    network: NetworkTables, gpu: str, tp: int, message_bytes: float
) -> float:
    """Bytes/s per GPU of a TP group of ``tp`` on a ``gpu`` node of a measured
    cluster, for messages of ``message_bytes``: the aggregate fit of ``tp``
    GPUs (``intra``) shared by ``min(tp, widest) / 2`` pairs, ``widest`` the
    most GPUs of a node measured (a wider TP group gets the widest fit,
    shared by as many pairs as it was measured with). The analytical model's
    TP link on a profiled machine, in its calibration and its predictions.

    Raises:
        ProblemError: the tables hold no intra-node fit for ``gpu``.
    """
    sizes = network.intra_sizes(gpu)
    fit = network.intra(gpu, tp)  # (raises without a fit for gpu)
    return fit.bandwidth(message_bytes) / (min(tp, max(sizes)) / 2)


def flat_fit(bytes_per_s: float) -> BandwidthFit:
    """A :class:`BandwidthFit` of the same bandwidth for every message size."""
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
    return BandwidthFit((0.0, 0.0, bytes_per_s / 1e9), bytes_per_s)


class SheetNetwork:
    """Links of a cluster of sheet GPU types (module docstring).

    Args:
        sheet: GPU types by name.
        measured: fitted links that take precedence where they exist.
        efficiency: the share of the sheet's bandwidth a collective reaches
            (``(0, 1]``).
        inter_node_bytes_per_s: ``{gpu_type: bytes/s}`` per node, overriding the
            sheet's default network (a cluster file's network).
    """

    def __init__(
        self,
        sheet: Mapping[str, GpuSheetEntry],
        *,
        measured: NetworkTables | None = None,
        efficiency: float = 1.0,
        inter_node_bytes_per_s: Mapping[str, float] | None = None,
    ) -> None:
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        self.sheet = dict(sheet)
        self.measured = measured
        self.efficiency = float(efficiency)
        self.inter_override = dict(inter_node_bytes_per_s or {})

    def _entry(self, gpu: str) -> GpuSheetEntry:
        return sheet_entry(self.sheet, gpu)

    def _node_bandwidth(self, gpu: str) -> float:
        if gpu in self.inter_override:
            return float(self.inter_override[gpu])
        return self._entry(gpu).inter_node_bytes_per_s

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - lives as long as self
    def inter(
        self, zone_a: str, gpu_a: str, zone_b: str, gpu_b: str, n: int
    ) -> BandwidthFit:
        """Aggregate fit of ``n`` streams between a ``gpu_a`` and a ``gpu_b`` node."""
        if self.measured is not None and not (
            gpu_a in self.inter_override or gpu_b in self.inter_override
        ):
            try:
                return self.measured.inter(zone_a, gpu_a, zone_b, gpu_b, n)
            except ProblemError:
                pass
        sides = []
        for gpu in (gpu_a, gpu_b):
            per_node = self._entry(gpu).gpus_per_node
            share = min(max(n, 1), per_node) / per_node
            sides.append(share * self._node_bandwidth(gpu))
        return flat_fit(self.efficiency * min(sides))

    @functools.lru_cache(maxsize=1024)  # noqa: B019
    def intra(self, gpu: str, n: int) -> BandwidthFit:
        """Aggregate fit of ``n`` GPUs of one ``gpu`` node (``n / 2`` pairs)."""
        if self.measured is not None:
            try:
                return self.measured.intra(gpu, n)
            except ProblemError:
                pass
        entry = self._entry(gpu)
        pairs = max(n / 2.0, 1.0)
        return flat_fit(self.efficiency * pairs * entry.intra_node_bytes_per_s)
