"""Alpa's liveness-based memory estimate for pipeline stages.

Re-written from Alpa's ``get_merged_stages_memory_stats`` (training mode) in
``alpa/pipeline_parallel/stage_profiling.py``: how many stages may follow a stage
before the activations its in-flight micro-batches stash overflow device memory.
Also the consistency checks that stage-profile records from untrusted files must
pass before any arithmetic is done on them. Units: bytes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from pipedejavu.core.problem import UNLIMITED_SUCCEEDING_STAGES, ProblemError
from pipedejavu.io.alpa_records import ModuleProfileResult, StageProfileResult

__all__ = ["StageMemoryStats", "stage_memory_stats"]


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_MAX_BYTES = 2**62  # far above any device memory; keeps the arithmetic exact


def _number(value: Any, where: str, *, allow_inf: bool = False) -> int | float:
    """A finite real number (bytes or seconds) as a Python int or float."""
    if is_int(value):
        number: int | float = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if math.isnan(number) or (math.isinf(number) and not allow_inf):
            raise ProblemError(f"{where} must be finite, got {number}")
    else:
        raise ProblemError(f"{where} must be a number, got {type(value).__name__}")
    if math.isfinite(number) and abs(number) >= _MAX_BYTES:
        raise ProblemError(f"{where} is implausibly large: {number}")
    return number


def _items(value: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)):
        raise ProblemError(f"{where} must be a tuple, got {type(value).__name__}")
    return tuple(value)


def _names(value: Any, where: str) -> tuple[str, ...]:
    names = _items(value, where)
    if not all(isinstance(name, str) for name in names):
        raise ProblemError(f"{where} must hold variable names (str)")
    return names


def _check_module(result: Any, where: str) -> ModuleProfileResult:
    """Check one module profile's consistency; returns a copy with plain numbers."""
    if not isinstance(result, ModuleProfileResult):
        raise ProblemError(f"{where} is a {type(result).__name__}, not a profile")
    invar_names = _names(result.invar_names, f"{where} invar_names")
    outvar_names = _names(result.outvar_names, f"{where} outvar_names")
    invar_sizes = _items(result.invar_sizes, f"{where} invar_sizes")
    outvar_sizes = _items(result.outvar_sizes, f"{where} outvar_sizes")
    donated = _items(result.donated_invars, f"{where} donated_invars")
    num_in, num_out = len(invar_names), len(outvar_names)
    if len(invar_sizes) != num_in or len(donated) != num_in:
        raise ProblemError(
            f"{where} has {num_in} input names but {len(invar_sizes)} sizes "
            f"and {len(donated)} donation flags"
        )
    if len(outvar_sizes) != num_out:
        raise ProblemError(
            f"{where} has {num_out} output names but {len(outvar_sizes)} sizes"
        )
    if not all(isinstance(flag, (bool, np.bool_)) for flag in donated):
        raise ProblemError(f"{where} donated_invars must hold booleans")
    acc_in = _items(result.acc_grad_invars_indices, f"{where} acc_grad_invars_indices")
    acc_out = _items(
        result.acc_grad_outvars_indices, f"{where} acc_grad_outvars_indices"
    )
    for name, indices, bound in (
        # Alpa assumes donated input i reuses the buffer of output i.
        ("donated input", [i for i, flag in enumerate(donated) if flag], num_out),
        ("acc_grad_invars_indices", acc_in, num_in),
        ("acc_grad_outvars_indices", acc_out, num_out),
    ):
        bad = [i for i in indices if not (is_int(i) and 0 <= i < bound)]
        if bad:
            raise ProblemError(f"{where}: {name} {bad[0]!r} is not in [0, {bound})")
    cost = _number(result.compute_cost, f"{where} compute_cost", allow_inf=True)
    if cost < 0:
        raise ProblemError(f"{where} has a negative compute_cost {cost}")
    return ModuleProfileResult(
        compute_cost=cost,
        peak_memory=result.peak_memory,
        temp_buffer_size=_number(result.temp_buffer_size, f"{where} temp_buffer_size"),
        invar_names=invar_names,
        outvar_names=outvar_names,
        invar_sizes=tuple(_number(x, f"{where} input size") for x in invar_sizes),
        outvar_sizes=tuple(_number(x, f"{where} output size") for x in outvar_sizes),
        donated_invars=tuple(bool(flag) for flag in donated),
        acc_grad_invars_indices=tuple(int(i) for i in acc_in),
        acc_grad_outvars_indices=tuple(int(i) for i in acc_out),
        available_memory=result.available_memory,
    )


def checked_modules(record: Any, where: str) -> tuple[ModuleProfileResult, ...]:
    """The (forward, backward) profiles of a complete training record, checked."""
    if not isinstance(record, StageProfileResult):
        raise ProblemError(f"{where} is a {type(record).__name__}, not a record")
    if (
        not is_int(record.n_modules)
        or record.n_modules != 2
        or len(record.module_profile_results) != 2
    ):
        raise ProblemError(
            f"{where}: only training profiles (2 modules: forward, backward) are "
            f"supported, got n_modules={record.n_modules!r}"
        )
    if not record.fully_profiled:
        raise ProblemError(f"{where}: a module was not profiled")
    return tuple(
        _check_module(result, f"{where} module {index}")
        for index, result in enumerate(record.module_profile_results)
    )


class StageMemoryStats(NamedTuple):
    """Alpa's liveness-based memory estimate for stages run as one pipeline.

    Attributes:
        available_memory: bytes per device (minimum over the stages).
        peak_memory: bytes, the largest live set plus temporaries over the walk.
        initial_size: bytes of the apply-gradient inputs (deduplicated by name).
        intermediate_size: bytes still live after the forward pass, i.e. the
            activations one in-flight micro-batch stashes.
        max_n_succ_stages: ``(available - peak - initial) // intermediate - 1``,
            clipped to ``[-1, UNLIMITED_SUCCEEDING_STAGES]``.
    """

    available_memory: float
    peak_memory: float
    initial_size: float
    intermediate_size: float
    max_n_succ_stages: int


def _drop_dead(
    env: dict[str, Any],
    keep: Iterable[Mapping[str, Any]],
    last_use: dict[str, int],
    step: int,
) -> None:
    """Free every variable not in ``keep`` whose last reader ran at or before step."""
    keep = tuple(keep)
    for name in [
        name
        for name in env
        if not any(name in group for group in keep) and last_use.get(name, -1) <= step
    ]:
        del env[name]


def stage_memory_stats(
    records: Sequence[StageProfileResult], *, where: str = "stage-profile records"
) -> StageMemoryStats:
    """Alpa's ``get_merged_stages_memory_stats`` (training) for complete records.

    The walk runs the forward modules of the stages in order, then the backward
    modules in reverse, tracking the live variables: a module's inputs and
    outputs join the live set, a donated input is freed when the output at its
    position appears, variables are freed after their last reader (variables
    that came from outside the current module pass are freed only when the pass
    ends), and gradient accumulators live throughout.

    Args:
        records: the stages, in pipeline order; every one fully profiled with
            2 modules (forward, backward).
        where: how error messages name the records.

    Returns:
        :class:`StageMemoryStats`, all in bytes except the stage count.

    Raises:
        ProblemError: an incomplete or internally inconsistent record.
    """
    if not records:
        raise ProblemError(f"{where}: need at least one stage-profile record")
    checked = [
        checked_modules(record, f"{where}, stage {index}")
        for index, record in enumerate(records)
    ]
    initial: dict[str, int | float] = {}
    for record in records:
        names = _names(record.initial_var_names, f"{where} initial_var_names")
        sizes = _items(record.initial_var_sizes, f"{where} initial_var_sizes")
        if len(names) != len(sizes):
            raise ProblemError(f"{where}: initial var names and sizes differ in length")
        for name, size in zip(names, sizes, strict=True):
            size = _number(size, f"{where} initial var {name!r}")
            if initial.setdefault(name, size) != size:
                raise ProblemError(
                    f"{where}: initial var {name!r} has two sizes, "
                    f"{initial[name]} and {size}"
                )
    initial_size = sum(initial.values())
    available = min(
        _number(record.available_memory, f"{where}, stage {index} available_memory")
        for index, record in enumerate(records)
    )

    num_stages = len(records)
    schedule = [(0, s) for s in range(num_stages)]
    schedule += [(1, s) for s in reversed(range(num_stages))]
    modules = [checked[stage][module] for module, stage in schedule]

    # A reverse scan finds each variable's last reader, the donations (output
    # name -> the input whose buffer it takes) and the gradient accumulators.
    last_use: dict[str, int] = {}
    donor_of: dict[str, str] = {}
    donated: set[str] = set()
    accumulators_in: dict[str, None] = {}
    accumulators_out: dict[str, None] = {}
    for step in reversed(range(len(schedule))):
        module = modules[step]
        for name in module.invar_names:
            last_use.setdefault(name, step)
        for position, (name, flag) in enumerate(
            zip(module.invar_names, module.donated_invars, strict=True)
        ):
            if flag:
                donated.add(name)
                donor_of[module.outvar_names[position]] = name
        accumulators_in.update(
            dict.fromkeys(module.invar_names[i] for i in module.acc_grad_invars_indices)
        )
        accumulators_out.update(
            dict.fromkeys(
                module.outvar_names[i] for i in module.acc_grad_outvars_indices
            )
        )

    # Per pass (forward, backward): inputs not produced earlier in the same pass.
    steps_of = [[s for s, (m, _) in enumerate(schedule) if m == p] for p in (0, 1)]
    pass_inputs: list[dict[str, Any]] = []
    for steps in steps_of:
        inputs: dict[str, Any] = {}
        produced: set[str] = set()
        for step in steps:
            module = modules[step]
            for name, size in zip(module.invar_names, module.invar_sizes, strict=True):
                if name not in produced:
                    inputs[name] = max(inputs[name], size) if name in inputs else size
            produced.update(module.outvar_names)
        pass_inputs.append(inputs)

    live: dict[str, Any] = {}
    peak: int | float = 0
    intermediate_size: int | float = 0
    for pass_index, steps in enumerate(steps_of):
        live.update(pass_inputs[pass_index])
        for step in steps:
            module = modules[step]
            for name, size in zip(module.invar_names, module.invar_sizes, strict=True):
                live[name] = max(live[name], size) if name in live else size
            for name, size in zip(
                module.outvar_names, module.outvar_sizes, strict=True
            ):
                if name in live:
                    raise ProblemError(f"{where}: variable {name!r} is produced twice")
                live[name] = size
                if name in donor_of:
                    if donor_of[name] not in live:
                        raise ProblemError(
                            f"{where}: {name!r} reuses the buffer of "
                            f"{donor_of[name]!r}, which is not live"
                        )
                    del live[donor_of[name]]
            peak = max(peak, sum(live.values()) + module.temp_buffer_size)
            keep = (pass_inputs[pass_index], accumulators_in, accumulators_out)
            _drop_dead(live, keep, last_use, step)
        _drop_dead(live, (accumulators_in, accumulators_out), last_use, steps[-1])
        if pass_index == 0:
            intermediate_size = sum(live.values())

    leftover = [
        name
        for name in live
        if name not in accumulators_out
        and not (name in accumulators_in and name not in donated)
    ]
    if leftover:
        raise ProblemError(f"{where}: variables {leftover[:5]} are never freed")

    free = available - peak - initial_size
    limit = int(free // max(intermediate_size, 1e-8) - 1)
    limit = min(max(-1, limit), UNLIMITED_SUCCEEDING_STAGES)
    return StageMemoryStats(available, peak, initial_size, intermediate_size, limit)
