"""Plain stand-ins for the Alpa classes found in Alpa's profile files.

Alpa pickles three classes into its profiling outputs. We never import Alpa: the
restricted unpickler (:mod:`pipedejavu.io.alpa_pickle`) maps exactly these
names to the classes below, which hold data and nothing else.

* ``alpa.mesh_profiling.MeshProfilingResult`` -> :class:`MeshProfilingResult`
  (values of ``prof_database.pkl``; built with ``NEWOBJ`` + ``BUILD`` from a state
  dict).
* ``alpa.pipeline_parallel.stage_profiling.StageProfileResult`` ->
  :class:`StageProfileResult` (values of ``profile-results-*.npy``; ``NEWOBJ`` +
  ``BUILD`` from a state dict).
* ``alpa.pipeline_parallel.stage_profiling.ModuleProfileResult`` ->
  :class:`ModuleProfileResult` (a namedtuple, rebuilt by ``NEWOBJ`` from its 11
  fields in order).

The classes are *sealed*: their class attributes cannot be set or deleted after
creation, so a crafted pickle (``BUILD`` applied to the class object itself)
cannot patch methods of the classes the rest of the project relies on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["MeshProfilingResult", "ModuleProfileResult", "StageProfileResult"]

#: Collective-cost fields of Alpa's ``MeshProfilingResult``.
COLLECTIVE_FIELDS = (
    "all_gather_cost_dict",
    "all_reduce_cost_dict",
    "reduce_scatter_cost_dict",
    "all_to_all_cost_dict",
)
_MESH_DICT_FIELDS = (
    *COLLECTIVE_FIELDS,
    "dot_cost_dict",
    "conv_cost_dict",
    "op_cost_dict",
)


class SealedClass(type):
    """A metaclass whose classes refuse attribute changes once created."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"{cls.__name__} is sealed; cannot set {name!r}")

    def __delattr__(cls, name: str) -> None:
        raise AttributeError(f"{cls.__name__} is sealed; cannot delete {name!r}")


def _state_dict(cls: type, state: Any) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{cls.__name__} state must be a dict, got {type(state).__name__}"
        )
    return state


class MeshProfilingResult(metaclass=SealedClass):
    """Alpa's mesh-profiling result for one ``(num_hosts, devices_per_host)`` mesh.

    Attributes:
        all_gather_cost_dict: ``{(replica_groups, dtype): [(size, seconds), ...]}``
            where ``replica_groups`` is a tuple of tuples of device ids and
            ``dtype`` a string such as ``"f16"``. Same layout for
            ``all_reduce_cost_dict``, ``reduce_scatter_cost_dict`` and
            ``all_to_all_cost_dict``.
        dot_cost_dict: ``{(dtype, ...): [(size key, seconds), ...]}`` matmul
            timings.
        conv_cost_dict: convolution timings (empty in the known files).
        op_cost_dict: other op timings (empty in the known files).
        available_memory_per_device: bytes, or ``None`` if not recorded.

    Alpa stores the cost dicts as ``defaultdict(list)``; they are kept here as
    plain dicts so a missing key raises ``KeyError`` instead of inserting.
    """

    __slots__ = (*_MESH_DICT_FIELDS, "available_memory_per_device")

    all_gather_cost_dict: dict[Any, list[tuple[int, float]]]
    all_reduce_cost_dict: dict[Any, list[tuple[int, float]]]
    reduce_scatter_cost_dict: dict[Any, list[tuple[int, float]]]
    all_to_all_cost_dict: dict[Any, list[tuple[int, float]]]
    dot_cost_dict: dict[Any, list[tuple[int, float]]]
    conv_cost_dict: dict[Any, Any]
    op_cost_dict: dict[Any, Any]
    available_memory_per_device: int | None

    def __init__(self, **fields: Any) -> None:
        self.__setstate__(fields)

    def __setstate__(self, state: Any) -> None:
        state = _state_dict(type(self), state)
        for name in _MESH_DICT_FIELDS:
            value = state.get(name)
            setattr(self, name, {} if value is None else dict(value))
        self.available_memory_per_device = state.get("available_memory_per_device")

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{name}=<{len(getattr(self, name))} keys>" for name in _MESH_DICT_FIELDS
        )
        return (
            f"MeshProfilingResult({sizes}, available_memory_per_device="
            f"{self.available_memory_per_device})"
        )


class _ModuleProfileFields(NamedTuple):
    compute_cost: float
    peak_memory: int
    temp_buffer_size: int
    invar_names: tuple[str, ...]
    outvar_names: tuple[str, ...]
    invar_sizes: tuple[int, ...]
    outvar_sizes: tuple[int, ...]
    donated_invars: tuple[bool, ...]
    acc_grad_invars_indices: tuple[int, ...]
    acc_grad_outvars_indices: tuple[int, ...]
    available_memory: int


class ModuleProfileResult(_ModuleProfileFields, metaclass=SealedClass):
    """Alpa's profile of one module (forward or backward) of one stage.

    Fields, in Alpa's pickled order:
        compute_cost: seconds per micro-batch.
        peak_memory: bytes, as measured (or estimated) for the module alone.
        temp_buffer_size: bytes of temporaries beyond the module's inputs and
            outputs (``peak - inputs - outputs + donated inputs``).
        invar_names / outvar_names: variable names of the inputs / outputs.
        invar_sizes / outvar_sizes: their sharded sizes in bytes (per device).
        donated_invars: per input, whether its buffer is donated to the output
            at the same position.
        acc_grad_invars_indices: positions in ``invar_names`` of gradient
            accumulators read by the module.
        acc_grad_outvars_indices: positions in ``outvar_names`` of accumulated
            gradients written by the module.
        available_memory: bytes available per device when profiled.
    """

    __slots__ = ()


class StageProfileResult(metaclass=SealedClass):
    """Alpa's profile of one stage: layers ``start..end`` (inclusive) on a submesh.

    Attributes:
        n_modules: 2 for training (forward, backward).
        module_profile_results: list of length ``n_modules``; an entry is
            :class:`ModuleProfileResult`, or ``None`` where profiling did not
            finish.
        available_memory: bytes per device (the minimum over the profiled
            modules), ``None`` if no module was profiled.
        initial_var_names: names of the apply-gradient inputs (parameters and
            optimizer state) that live for the whole run.
        initial_var_sizes: their sizes in bytes.
    """

    __slots__ = (
        "n_modules",
        "module_profile_results",
        "available_memory",
        "initial_var_names",
        "initial_var_sizes",
    )

    n_modules: int
    module_profile_results: list[ModuleProfileResult | None]
    available_memory: int | None
    initial_var_names: tuple[str, ...]
    initial_var_sizes: tuple[float, ...]

    def __init__(
        self,
        n_modules: int = 2,
        module_profile_results: Sequence[ModuleProfileResult | None] | None = None,
        available_memory: int | None = None,
        initial_var_names: Sequence[str] = (),
        initial_var_sizes: Sequence[float] = (),
    ) -> None:
        if module_profile_results is None:
            module_profile_results = [None] * n_modules
        self.__setstate__(
            {
                "n_modules": n_modules,
                "module_profile_results": module_profile_results,
                "available_memory": available_memory,
                "initial_var_names": initial_var_names,
                "initial_var_sizes": initial_var_sizes,
            }
        )

    def __setstate__(self, state: Any) -> None:
        state = _state_dict(type(self), state)
        self.n_modules = state.get("n_modules")
        self.module_profile_results = list(state.get("module_profile_results", ()))
        self.available_memory = state.get("available_memory")
        self.initial_var_names = tuple(state.get("initial_var_names", ()))
        self.initial_var_sizes = tuple(state.get("initial_var_sizes", ()))

    @property
    def fully_profiled(self) -> bool:
        """Whether every module has a profile (no ``None`` entry)."""
        return all(result is not None for result in self.module_profile_results)

    def __repr__(self) -> str:
        done = sum(result is not None for result in self.module_profile_results)
        return (
            f"StageProfileResult(n_modules={self.n_modules}, profiled_modules={done}, "
            f"available_memory={self.available_memory}, "
            f"initial_vars={len(self.initial_var_names)})"
        )
