"""``plan_training``: the fastest Megatron/DeepSpeed plan for a model, a global
batch and a pool of GPUs, with the proof and the flags to launch it.

The search (:mod:`pipedejavu.search.megatron.planner`) compiles every (GPU type, mbs,
dp, TP, GPUs) configuration into the project's planning model
(:class:`pipedejavu.Problem` with ``stage_tail_cost``) and solves it with the
exact DP (or the differentiable engine); the chosen plan is re-scored by the
predictor (:func:`pipedejavu.costmodel.megatron.predictor.predict_plan`), whose time is
the plan's ``iteration_time_s``. Heavy modules load inside the call.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH, MAX_SEARCH_GPUS, Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.sailor_data import SailorData, load_sailor_data
from pipedejavu.search.megatron.planner import search_megatron
from pipedejavu.search.megatron.settings import (
    MegatronSearchConfig,
    MegatronSearchResult,
)
from pipedejavu.search.megatron.transfers import BoundCache

__all__ = [
    "TrainingPlan",
    "check_global_batch",
    "check_mbs_values",
    "expected_slow",
    "headroom_of",
    "parse_gpu_pool",
    "plan_cost_source",
    "plan_training",
    "finite_or_none",
    "search_config",
]

_POOL = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.\-]{0,63})\s*:\s*(\d{1,12})\s*$")


def parse_gpu_pool(
    items: Sequence[str] | Mapping[str, int], *, most: int = MAX_SEARCH_GPUS
) -> dict[str, int]:
    """``["GH-96:64", "RTX-3090:8"]`` (or ``["GH-96:64,RTX-3090:8"]``) ->
    ``{"GH-96": 64, "RTX-3090": 8}``.

    Each type appears once; counts are integers in ``[1, most]`` and add up to
    at most ``most``: by default a pool to search,
    :data:`~pipedejavu.core.plan3d.MAX_SEARCH_GPUS` (131,072, as many as
    :data:`~pipedejavu.core.layout.MAX_GPUS`, which a prediction passes). A
    mapping is checked the same way.

    Raises:
        ProblemError: an item not of the form TYPE:COUNT, a type given twice, a
            count out of range.
    """
    pool: dict[str, int] = {}
    pairs: list[tuple[str, Any, str]] = []
    if isinstance(items, Mapping):
        pairs = [(k, v, f"{k}:{v}") for k, v in items.items()]
    else:
        if isinstance(items, str):
            items = [items]
        # A comma separates types within one item, as repeating the flag does.
        items = [
            part
            for item in items
            for part in (item.split(",") if isinstance(item, str) else [item])
        ]
        for item in items:
            match = _POOL.match(item) if isinstance(item, str) else None
            if not match:
                raise ProblemError(
                    f"--gpus must look like TYPE:COUNT with COUNT in [1, {most}], "
                    f"e.g. GH-96:64; got {item!r:.60}"
                )
            pairs.append((match.group(1), int(match.group(2)), item))
    for name, count, item in pairs:
        if not isinstance(name, str) or not name:
            raise ProblemError(f"a GPU type must be a non-empty string, got {name!r}")
        if isinstance(count, bool) or not isinstance(count, int):
            raise ProblemError(
                f"{name}: the GPU count must be an integer, got {count!r}"
            )
        if not 1 <= count <= most:
            raise ProblemError(
                f"--gpus {name}: COUNT must be in [1, {most}], got {count}"
            )
        if name in pool:
            raise ProblemError(
                f"--gpus names {name} twice ({name}:{pool[name]} and {item.strip()}); "
                "give each type once with its total count"
            )
        pool[name] = count
    if not pool:
        raise ProblemError("give at least one --gpus TYPE:COUNT")
    total = sum(pool.values())
    if total > most:
        raise ProblemError(f"--gpus: at most {most} GPUs in all, got {total} ({pool})")
    return pool


def check_global_batch(global_batch: Any, name: str = "global batch") -> int:
    """``global_batch`` as an int in ``[1, MAX_GLOBAL_BATCH]`` (65,536 samples).

    Raises:
        ProblemError: not an integer, or out of range.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int):
        raise ProblemError(f"{name} must be an integer, got {global_batch!r:.40}")
    if not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise ProblemError(
            f"{name} must be in [1, {MAX_GLOBAL_BATCH}] samples, got {global_batch}"
        )
    return global_batch


def check_mbs_values(mbs_values: Sequence[int] | None) -> tuple[int, ...] | None:
    """Micro-batch sizes: integers in ``[1, MAX_GLOBAL_BATCH]``, at most 64 of
    them (``None``: every profiled one)."""
    if mbs_values is None:
        return None
    values = tuple(mbs_values)
    if not 1 <= len(values) <= 64 or not all(
        not isinstance(v, bool) and isinstance(v, int) and 1 <= v <= MAX_GLOBAL_BATCH
        for v in values
    ):
        raise ProblemError(
            f"mbs_values must be 1 to 64 integers in [1, {MAX_GLOBAL_BATCH}], got "
            f"{values!r:.80}"
        )
    return values


def expected_slow(pool: Mapping[str, int], method: str, mixed_types: bool) -> bool:
    """Whether a search may take more than ~10 s (big pool, the differentiable
    engine, or GPU types mixed), so the CLI says so up front."""
    return (
        sum(pool.values()) > 1024 or method == "diff" or (mixed_types and len(pool) > 1)
    )


@dataclasses.dataclass(frozen=True, eq=False)
class TrainingPlan:
    """A planned training run (see :func:`plan_training`).

    Attributes:
        plan: the plan (names its model; GPUs placed in Megatron's rank order).
        prediction: the predictor's view
            (:class:`~pipedejavu.costmodel.megatron.predictor.Prediction`);
            ``prediction.iteration_time_s`` is the plan's time.
        objective_s: the plan's planning objective (closed-form pipeline;
            ``nan`` for a plan mixing GPU types).
        optimum_s: the least planning objective over the search space
            (``nan`` for a plan of Megatron-LM's interleaved schedule, which
            the closed form does not describe).
        lower_bound_s: certified lower bound on it (equal for ``method="dp"``).
        gap: ``optimum_s / lower_bound_s - 1``.
        gpus_available: the pool.
        search_time_s: wall-clock seconds of the search.
        method: ``"dp"`` or ``"diff"``.
        configurations, solved: search-space size and configurations solved.
        predicted_lower_bound_s: certified lower bound on the predicted
            iteration time of every plan of the search space that fits in
            memory.
        proven: the plan is the predictor's optimum over the search space
            (brute-force agreement is tested on small settings).
        mixed_types: the search space held plans whose stages run on
            different GPU types (else one type per plan).
        cost_source: what priced the plan's layers: ``"profiles"``,
            ``"analytical"`` or ``"mixed"``.
        options: the training options the plan was priced for.
    """

    plan: Plan3D
    prediction: Any
    objective_s: float
    optimum_s: float
    lower_bound_s: float
    gap: float
    gpus_available: dict[str, int]
    search_time_s: float
    method: str
    configurations: int
    solved: int
    predicted_lower_bound_s: float = float("nan")
    proven: bool = False
    mixed_types: bool = False
    cost_source: str = "profiles"
    options: TrainingOptions = TrainingOptions()

    def __post_init__(self) -> None:
        # per-stage recomputation: the options say which counts the plan's
        # stages run (the predictor picked them)
        counts = getattr(self.prediction, "recompute_stage_layers", None)
        if self.options.recompute_choices is not None and counts is not None:
            options = dataclasses.replace(self.options, recompute_stage_layers=counts)
            object.__setattr__(self, "options", options)

    @property
    def predicted_gap(self) -> float:
        """Certified relative gap of the predicted time (``nan``: none)."""
        if not self.predicted_lower_bound_s > 0:
            return float("nan")
        return self.iteration_time_s / self.predicted_lower_bound_s - 1.0

    @property
    def iteration_time_s(self) -> float:
        return self.prediction.iteration_time_s

    @property
    def gpus_used(self) -> dict[str, int]:
        return self.plan.gpus_by_type()

    def to_json(self) -> dict[str, Any]:
        """The plan JSON (readable by ``pipedejavu predict`` as it is) plus the
        prediction and the search's certificate."""
        out = self.plan.to_json()
        predicted = self.prediction.to_json()
        used, available = self.gpus_used, self.gpus_available
        out.update(
            iteration_time_s=predicted["iteration_time_s"],
            peak_memory_bytes=predicted["peak_memory_bytes"],
            fits_memory=predicted["fits_memory"],
            memory_per_stage_bytes=predicted["memory_per_stage_bytes"],
            memory_limit_per_stage_bytes=predicted["memory_limit_per_stage_bytes"],
            memory_capacity_per_stage_bytes=predicted[
                "memory_capacity_per_stage_bytes"
            ],
            breakdown=predicted["breakdown"],
            objective_s=finite_or_none(self.objective_s),
            optimum_s=finite_or_none(self.optimum_s),
            lower_bound_s=finite_or_none(self.lower_bound_s),
            gap=finite_or_none(self.gap),
            predicted_lower_bound_s=finite_or_none(self.predicted_lower_bound_s),
            predicted_gap=finite_or_none(self.predicted_gap),
            proven_optimal=self.proven,
            mixed_types_searched=self.mixed_types,
            method=self.method,
            search_time_s=self.search_time_s,
            configurations=self.configurations,
            configurations_solved=self.solved,
            gpus_available=available,
            gpus_used=used,
            fewer_gpus=sum(used.values()) < sum(available.values()),
            cost_source=self.cost_source,
            options=self.options.to_json(),
        )
        return out


def plan_training(
    model: str,
    gpus: Mapping[str, int] | Sequence[str],
    global_batch: int,
    *,
    profiles: str | os.PathLike | SailorData | AnalyticalSource | None = None,
    method: str = "dp",
    uniform_tp: bool = True,
    allow_fewer_gpus: bool = True,
    mbs_values: Sequence[int] | None = None,
    constants: Any = None,
    mixed_types: bool = False,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    bound_cache: BoundCache | None = None,
    solved: MegatronSearchResult | None = None,
    dp_alone: bool = False,
    memory_headroom: MemoryHeadroom | float | str | None = None,
    max_stages: int | None = None,
    cutoff_s: float = math.inf,
) -> TrainingPlan:
    """The fastest plan under the planning model, re-scored by the predictor.

    Args:
        model: the model's profile folder name, e.g. ``"OPT-350"`` (with an
            :class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource`:
            its spec's name).
        gpus: ``{type: count}`` or ``["GH-96:64", ...]``; each type once,
            at most 131,072 GPUs in all (:func:`parse_gpu_pool`).
        global_batch: samples per iteration, in ``[1, 65536]``
            (:data:`~pipedejavu.core.plan3d.MAX_GLOBAL_BATCH`).
        profiles: a folder laid out like Sailor's data (``None``: bundled), or
            the cost source itself: a
            :class:`~pipedejavu.costmodel.megatron.sailor_data.SailorData` or an
            :class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource`
            (any model on any GPU of its sheet, for its training options;
            :func:`~pipedejavu.planning.any_model.choose_cost_source` picks
            one).
        method: ``"dp"`` (exact) or ``"diff"`` (differentiable engine, with a
            certified gap).
        uniform_tp: one TP degree for all stages (what Megatron-LM, DeepSpeed and
            torchtitan run); ``False`` allows a degree per stage.
        allow_fewer_gpus: plans may leave GPUs idle when that is faster.
        mbs_values: micro-batch sizes to consider (``None``: all profiled).
        constants: predictor constants (``None``: the fitted ones).
        mixed_types: plans may run stages on different GPU types of the pool
            (searched by the proof under the predictor).
        progress_fn: called with a dict as the search goes
            (:func:`~pipedejavu.search.megatron.planner.search_megatron`).
        bound_cache: the proof's bound tables, shared with other proofs over
            sources that price links alike (``search_megatron``).
        solved: this search's result with the proof off
            (``search_megatron``'s ``solved``): only the proof runs.
        dp_alone: data parallelism only without TP or PP beside it (what
            torchtitan's DDP runs; ``MegatronSearchConfig.dp_alone``).
        memory_headroom: memory every GPU keeps free (a fraction of its
            memory, a string such as ``"8GB"`` or a
            :class:`~pipedejavu.core.memory_headroom.MemoryHeadroom`); the
            search, its proof and the prediction all honour it. ``None``: the
            cost source's own (none unless it was given one).
        max_stages: most pipeline stages (``None``: the model's layers).
        cutoff_s: the time of a plan outside this space (``search_megatron``'s
            ``cutoff_s``: the proof settles against it where it is less).

    Raises:
        ProblemError: bad arguments, unknown model or GPU type.
        InfeasibleProblemError: no plan fits; the message says why.
    """

    pool = parse_gpu_pool(gpus)
    check_global_batch(global_batch)
    config = search_config(
        method,
        uniform_tp,
        allow_fewer_gpus,
        mixed_types,
        mbs_values,
        dp_alone,
        max_stages,
    )
    if profiles is None or isinstance(profiles, (str, os.PathLike)):
        data = load_sailor_data(profiles)
    else:
        data = profiles
    if isinstance(data, SailorData) and model not in data.models():
        raise ProblemError(
            f"plan_training prices a model of the profiles ({', '.join(data.models())}"
            f" in {data.root}) or of the cost source it is given, not {model!r}: "
            "plan any model as `pipedejavu plan` does with "
            "pipedejavu.plan_model(model, gpus, global_batch)"
        )
    headroom = headroom_of(memory_headroom)
    if headroom is not None:
        data = data.with_memory_headroom(headroom)
    result = search_megatron(
        data,
        model,
        pool,
        global_batch,
        constants or FITTED_CONSTANTS,
        config,
        progress_fn=progress_fn,
        bound_cache=bound_cache,
        solved=solved,
        cutoff_s=cutoff_s,
    )
    return TrainingPlan(
        plan=result.plan,
        prediction=result.prediction,
        objective_s=result.objective_s,
        optimum_s=result.optimum_s,
        lower_bound_s=result.lower_bound_s,
        gap=result.gap,
        gpus_available=pool,
        search_time_s=result.search_time_s,
        method=result.method,
        configurations=result.configurations,
        solved=result.solved,
        predicted_lower_bound_s=result.predicted_lower_bound_s,
        proven=result.proven,
        mixed_types=mixed_types and len(pool) > 1,
        cost_source=plan_cost_source(result.plan, data),
        options=data.options,
    )


def headroom_of(value: MemoryHeadroom | float | str | None) -> MemoryHeadroom | None:
    """``value`` as a :class:`~pipedejavu.core.memory_headroom.MemoryHeadroom`
    (:meth:`~pipedejavu.core.memory_headroom.MemoryHeadroom.of`).

    Raises:
        ProblemError: a value it refuses, one line.
    """
    try:
        return MemoryHeadroom.of(value)
    except ValueError as error:
        raise ProblemError(f"memory headroom: {error}") from None


def search_config(
    method: str,
    uniform_tp: bool,
    allow_fewer_gpus: bool,
    mixed_types: bool,
    mbs_values: Sequence[int] | None,
    dp_alone: bool = False,
    max_stages: int | None = None,
) -> MegatronSearchConfig:
    """The search's settings from :func:`plan_training`'s arguments.

    Raises:
        ProblemError: a bad method or micro-batch sizes.
    """
    try:
        return MegatronSearchConfig(
            uniform_tp=uniform_tp,
            allow_fewer_gpus=allow_fewer_gpus,
            mbs_values=check_mbs_values(mbs_values),
            method=method,
            mixed_types=mixed_types,
            dp_alone=dp_alone,
            max_stages=max_stages,
        )
    except ValueError as error:
        raise ProblemError(str(error)) from None


def plan_cost_source(plan: Plan3D, data: Any) -> str:
    """What priced ``plan`` on ``data``: ``"profiles"`` for a
    :class:`~pipedejavu.costmodel.megatron.sailor_data.SailorData`, else the
    source's own answer (``"analytical"``, ``"profiles"`` or ``"mixed"``)."""
    if isinstance(data, AnalyticalSource):
        return data.cost_source(plan)
    return "profiles"


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN or infinity: ``None`` for a value that is not finite."""
    return value if math.isfinite(value) else None
