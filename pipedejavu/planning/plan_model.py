"""Plan any model as ``pipedejavu plan --model`` does: :func:`plan_model`.

One call with the command line's defaults and search, for the Python API and
the command line alike:

* the cost source of :func:`~pipedejavu.planning.any_model.choose_cost_source`
  (a model of the profiles trained as profiled: its profiles; any other model
  or training: the analytical model, bf16 by default);
* the knobs of :func:`default_space`: every schedule, recomputation, sequence
  parallelism, the distributed optimizer and both rank orders for a model
  priced analytically; for a model priced by its profiles, the training they
  measured in both rank orders;
* with an export target, only what that target launches as planned
  (:func:`launched_space`), and data parallelism alone where the target's
  data parallelism runs only without TP or PP
  (:data:`~pipedejavu.io.exports.DATA_PARALLEL_ALONE`);
* the plan proven optimal under the predictor over that space
  (:func:`~pipedejavu.planning.knobs.plan_with_knobs`), with the memory
  headroom kept free on every GPU if one is given;
* for a mixture of experts, that search for every expert layout of
  :func:`expert_layouts` (each EP degree dividing the experts), the fastest
  plan proven when the least bound over all of them reaches its time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.core.training_options import TrainingOptions, TrainingPrecision
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.calibration_file import ClusterCalibration
from pipedejavu.costmodel.analytical.torchtitan_constants import (
    TORCHTITAN_ANALYTICAL,
)
from pipedejavu.io.exports import (
    DATA_PARALLEL_ALONE,
    EXPORTS,
    LAUNCHED_TRAINING,
    SWITCH_FLAGS,
    precision_refusal,
)
from pipedejavu.planning.any_model import CostChoice, choose_cost_source
from pipedejavu.planning.expert_search import (
    DISPATCHERS_SEARCHED,
    MAX_EXPERT_TP,
    ExpertSearch,
    expert_layouts,
    layout_search,
)
from pipedejavu.planning.knob_order import CutoffReached
from pipedejavu.planning.knob_space import MEGATRON_SCHEDULES, KnobSpace
from pipedejavu.planning.knobs import KnobPlan, plan_with_knobs
from pipedejavu.planning.sharded_search import (
    TORCHTITAN_RECOMPUTE,
    best_sharded,
    join_sharded,
)
from pipedejavu.planning.training import parse_gpu_pool
from pipedejavu.search.megatron.interleaved import InterleavedMemo
from pipedejavu.search.megatron.settings import bound_reaches

__all__ = [
    "KEPT_OPTIONS",
    "default_space",
    "launched_space",
    "plan_model",
    "sharded_alone",
    "target_space",
]

#: Training options the search keeps as given (not knobs), which an export
#: target may not launch: refused before the search.
KEPT_OPTIONS = (
    "overlap_grad_reduce",
    "overlap_param_gather",
    "grad_reduce_in_bf16",
    "tp_comm_overlap",
)


def default_space(choice: CostChoice, export: str | None = None) -> KnobSpace:
    """The knobs searched when none are given: every knob for a model priced
    by the analytical model alone; the profiled training (in both rank
    orders, a placement at the same costs) where profiles price some layers,
    but with sequence parallelism where ``export``'s target runs it with every
    TP > 1 plan (torchtitan's; such plans are then priced analytically, the
    profiles having measured none; TP 1 plans, where it changes nothing, by
    the profiles still). A mixture of experts is searched with Megatron-LM's
    schedules, the one launcher that runs its experts as priced."""
    space = KnobSpace.fixed(choice.options) if choice.measured else KnobSpace()
    if choice.spec is not None and choice.spec.moe is not None:
        # only Megatron-LM launches the experts as priced: its schedules
        space = dataclasses.replace(space, schedules=MEGATRON_SCHEDULES)
    launched = LAUNCHED_TRAINING.get(export or "", {})
    if launched.get("sequence_parallel") == (True,):
        space = dataclasses.replace(space, sequence_parallel=(True,))
    return space


def launched_space(
    target: str, space: KnobSpace, options: TrainingOptions
) -> KnobSpace:
    """``space`` cut to what ``target`` launches as planned; a precision, a
    kept option (:data:`KEPT_OPTIONS`) or a knob it does not launch at all is
    refused before the search.

    Raises:
        ProblemError: an unknown target, or what it never launches (one line:
            the reason and what to change).
    """
    if target not in EXPORTS:
        raise ProblemError(
            f"export must be one of {', '.join(EXPORTS)}, got {target!r}"
        )
    launched = LAUNCHED_TRAINING[target]
    refusal = precision_refusal(target, options.precision)
    if refusal is not None:  # (the reason, and the targets that run it)
        raise ProblemError(refusal)
    for name in KEPT_OPTIONS:
        if getattr(options, name) not in launched[name]:
            flag = SWITCH_FLAGS[name]
            raise ProblemError(
                f"--export {target} does not launch {flag} as planned: "
                f"drop {flag} or give another --export"
            )
    try:
        return space.for_target(target)
    except ValueError as error:
        raise ProblemError(f"--export {target}: {error}") from None


def plan_model(
    model: str,
    gpus: Mapping[str, int] | Sequence[str],
    global_batch: int,
    *,
    seq_length: int | None = None,
    precision: TrainingPrecision | None = None,
    space: KnobSpace | None = None,
    options: TrainingOptions | None = None,
    export: str | None = None,
    memory_headroom: MemoryHeadroom | float | str | None = None,
    calibration: ClusterCalibration | None = None,
    gpu_sheet: str | os.PathLike | None = None,
    profiles: str | os.PathLike | None = None,
    method: str = "dp",
    uniform_tp: bool = True,
    allow_fewer_gpus: bool = True,
    mixed_types: bool = False,
    mbs_values: Sequence[int] | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    dispatchers: Sequence[str] = DISPATCHERS_SEARCHED,
    dispatch_overlap: Sequence[bool] = (False, True),
    expert_tp: Sequence[int] = (1,),
    sharded: bool | None = None,
    cutoff_s: float = math.inf,
) -> KnobPlan:
    """The fastest plan of ``model`` on ``gpus``, as ``pipedejavu plan``
    finds it (module docstring), proven optimal under the predictor.

    Args:
        model: a model of the profiles (``OPT-350``), a bundled preset
            (``Llama-3-8B``; ``pipedejavu data models/README.md`` lists them) or
            a Hugging Face ``config.json``.
        gpus: ``{type: count}`` or ``["H100:64", ...]``; GPU sheet names or
            their aliases, in any case.
        global_batch: samples per iteration.
        seq_length: tokens per sample (``None``: a preset's recorded training
            length, a profiled model's profiled length; a ``config.json``
            with a context over
            :data:`~pipedejavu.planning.any_model.LONG_CONTEXT` tokens must
            be given one).
        precision: ``fp32``, ``fp16``, ``bf16`` or ``fp8`` (``None``: fp32
            for a profiled model, bf16 for any other).
        space: the knobs to search (``None``: :func:`default_space`).
        options: the other training options (overlaps, the attention kernel,
            ...); ``None``: the defaults.
        export: keep to what this target (:data:`~pipedejavu.io.exports.
            EXPORTS`) launches as planned (``None``: every plan).
        memory_headroom: memory every GPU keeps free: a fraction (``0.1``),
            a string (``"10%"``, ``"8GB"``) or a
            :class:`~pipedejavu.core.memory_headroom.MemoryHeadroom`.
        gpu_sheet: a JSON file extending the bundled GPU sheet.
        profiles: a folder laid out like Sailor's data (``None``: bundled).
        calibration: the analytical model's constants fitted to the cluster
            (as for :func:`~pipedejavu.planning.any_model.choose_cost_source`).
        method, uniform_tp, allow_fewer_gpus, mixed_types, mbs_values: as for
            :func:`~pipedejavu.planning.training.plan_training`.
        progress_fn: called with a dict as the search goes.
        dispatchers, dispatch_overlap, expert_tp: a mixture of experts'
            token dispatchers, all-to-all overlaps and expert TP degrees
            searched (:func:`~pipedejavu.planning.expert_search.
            expert_layouts`; each expert TP degree adds as many layouts).
        sharded: also search every single-stage plan of sharded data
            parallelism (FSDP2/HSDP) with TP and context parallelism
            (:mod:`~pipedejavu.planning.sharded_search`) and keep the faster
            (``None``: where it applies; ``False``: never).
        cutoff_s: seconds per iteration below which plans are wanted (a
            capacity question's, :mod:`~pipedejavu.planning.capacity_pruning`):
            the proofs settle every choice against the lesser of it and the
            best plan found, so where no plan is faster the search stops once
            its certified bound (``result.predicted_lower_bound_s``) reaches
            it, with the best plan found, not proven, or, where the
            pipelines' proofs settle every choice against it before any plan
            is needed (and no sharded plan is found),
            :class:`~pipedejavu.planning.knob_order.CutoffReached` with the
            certified bound; below it, the same optimum. A mixture of
            experts is searched to the end.

    Returns:
        A :class:`~pipedejavu.planning.knobs.KnobPlan`: ``.result`` the plan
        (``.plan``, ``.prediction``, ``.options``, ``.proven``), ``.choice``
        its cost source, ``.space`` and ``.outcomes`` the knobs searched.

    Raises:
        ProblemError: bad arguments, an unknown model or GPU type, what the
            export target never launches.
        InfeasibleProblemError: no plan fits.

    Example:
        >>> from pipedejavu.planning.plan_model import plan_model
        >>> best = plan_model("Llama-3-8B", {"H100": 8}, 256)  # doctest: +SKIP
        >>> best.result.prediction.iteration_time_s  # doctest: +SKIP
    """
    pool = parse_gpu_pool(gpus)
    shared: dict[str, Any] = {
        "options": options,
        "precision": precision,
        "seq_length": seq_length,
        "gpu_sheet": gpu_sheet,
        "profiles": profiles,
        "memory_headroom": memory_headroom,
        "calibration": calibration,
    }
    if calibration is not None and export == "torchtitan":
        raise ProblemError(
            "--calibration with --export torchtitan: its plans are priced with "
            "torchtitan's own fitted kernel constants"
        )
    choice = choose_cost_source(model, pool, **shared)
    space = default_space(choice, export) if space is None else space
    alone = sharded_alone(choice, export, sharded)
    space = target_space(export, space, choice, sharded)
    search = dict(
        space=space,
        method=method,
        uniform_tp=uniform_tp,
        allow_fewer_gpus=allow_fewer_gpus,
        mixed_types=mixed_types,
        mbs_values=mbs_values,
        progress_fn=progress_fn,
        dp_alone=export in DATA_PARALLEL_ALONE,
    )
    spec = choice.spec
    if spec is None or spec.moe is None:
        started = time.perf_counter()
        joined = _sharding(choice, pool, export, True if alone else sharded, search)
        first = math.isfinite(cutoff_s)  # (a capacity question's: bounds first)
        if not joined:
            return _cut(model, pool, global_batch, search, shared, cutoff_s, first)
        # the sharded plans first: their best time is a cutoff for the
        # pipelines' proofs (a pipeline no faster cannot be the optimum)
        found, refused = None, None
        try:
            found = best_sharded(
                choice, pool, global_batch, search["space"],
                progress_fn=progress_fn, eager=alone,  # (no torch.compile)
                **_torchtitan_sharded(choice, export, alone, search["space"]),
            )  # fmt: skip
        except InfeasibleProblemError as error:
            refused = error
        regular, lower = None, math.inf
        outside = math.inf if found is None else found.prediction.iteration_time_s
        try:
            if not alone:
                regular = _cut(model, pool, global_batch, search, shared,
                               min(outside, cutoff_s), first)  # fmt: skip
        except CutoffReached as reached:
            if found is None:
                raise
            lower = reached.lower_s
        except InfeasibleProblemError:
            if found is None:
                raise
        if found is None:
            if regular is None:
                raise refused
            return regular
        return join_sharded(
            regular, found, choice, pool, search["space"], started=started,
            pipelines_lower=lower,
        )  # fmt: skip
    if sharded:
        raise ProblemError(
            "sharded data parallelism is not searched for a mixture of experts "
            "(its expert layouts are searched with the pipelines)"
        )
    per_node = min(choice.data.gpu_spec(gpu).gpus_per_node for gpu in choice.pool(pool))
    layouts = expert_layouts(
        spec,
        sum(pool.values()),
        dispatchers=_checked(dispatchers, DISPATCHERS_SEARCHED, "dispatchers"),
        overlap=_checked(dispatch_overlap, (False, True), "dispatch_overlap"),
        expert_tp=_checked(expert_tp, range(1, MAX_EXPERT_TP + 1), "expert_tp"),
    )
    searches = [
        found
        for layers in layouts
        if (
            found := layout_search(
                layers,
                search["space"],
                precision=choice.options.precision,
                mtp_layers=spec.mtp_layers,
            )
        )
        is not None
    ]
    return _plan_experts(
        model, pool, global_batch, spec, searches, search, shared, per_node
    )


def _cut(
    model: str,
    pool: Mapping[str, int],
    global_batch: int,
    search: Mapping[str, Any],
    shared: Mapping[str, Any],
    cutoff_s: float,
    bound_first: bool,
) -> KnobPlan:
    """The pipelines' search (:func:`plan_with_knobs`) with ``cutoff_s``;
    with ``bound_first``, its proofs first: where no plan beats the cutoff,
    :class:`~pipedejavu.planning.knob_order.CutoffReached` with the bound;
    where a proof ran out of its budget below the cutoff, the ordinary
    search with the same cutoff (its planning DP first)."""
    try:
        return plan_with_knobs(model, pool, global_batch, **search, **shared,
                               outside_s=cutoff_s, bound_first=bound_first)  # fmt: skip
    except CutoffReached as reached:
        if bound_reaches(reached.lower_s, cutoff_s):
            raise
    return plan_with_knobs(
        model, pool, global_batch, **search, **shared, outside_s=cutoff_s
    )


def _torchtitan_sharded(
    choice: CostChoice, export: str | None, alone: bool, space: KnobSpace
) -> dict[str, Any]:
    """How the sharded plans are priced for ``export``: for torchtitan (its
    per-op policy saves no fp8 product), its recomputations, its split of
    each sequence over ``tp x 2 cp`` and, the sharded space alone, the
    kernels the exported job runs (its loss, eager); else as they are.

    Raises:
        ProblemError: torchtitan's per-op recomputation asked with fp8 alone.
    """
    if export != "torchtitan":
        return {}
    fp8 = choice.options.precision == "fp8"
    recompute = [
        r
        for r in TORCHTITAN_RECOMPUTE
        if (r if isinstance(r, str) else "selective") in space.recompute
        and not (fp8 and not isinstance(r, str))
    ]
    if not recompute:
        raise ProblemError(
            "--export torchtitan: torchtitan's per-op recomputation does "
            "not run with fp8 (its float8 linears are not in the policy's "
            "saved products): give --recompute none or full"
        )
    return {
        "recompute": recompute,
        "tp_splits_sequence": True,
        "constants": TORCHTITAN_ANALYTICAL if alone else None,
    }


def sharded_alone(choice: CostChoice, export: str | None, sharded: bool | None) -> bool:
    """Whether only the sharded space is searched: for torchtitan, which
    trains 16-bit and fp8 only with FSDP, a dense model priced analytically
    (unless ``sharded`` is ``False``)."""
    dense = choice.spec is not None and choice.spec.moe is None
    return (
        export == "torchtitan"
        and choice.options.precision != "fp32"
        and sharded is not False
        and dense
        and choice.analytical
    )


def target_space(
    export: str | None, space: KnobSpace, choice: CostChoice, sharded: bool | None
) -> KnobSpace:
    """``space`` cut to what ``export`` launches (:func:`launched_space`),
    where the pipeline search runs for it (not :func:`sharded_alone`)."""
    if export is None or sharded_alone(choice, export, sharded):
        return space
    return launched_space(export, space, choice.options)


def _sharding(
    choice: CostChoice,
    pool: Mapping[str, int],
    export: str | None,
    sharded: bool | None,
    search: Mapping[str, Any],
) -> bool:
    """Whether the sharded single-stage space joins the search
    (:func:`~pipedejavu.planning.sharded_search.join_sharded`): ``sharded``
    ``None`` (auto) where it applies: a dense model priced analytically, one
    GPU type, no export or torchtitan's (the target that launches FSDP2 as
    planned), none of :data:`KEPT_OPTIONS` on.

    Raises:
        ProblemError: ``sharded=True`` where it does not apply (one line).
    """
    if sharded is False:
        return False
    why = None
    kept = [name for name in KEPT_OPTIONS if getattr(choice.options, name)]
    if not choice.analytical or choice.measured:
        why = "the model is priced by its profiles"
    elif len(pool) != 1:
        why = "the pool has several GPU types"
    elif search.get("mixed_types") or not search.get("uniform_tp", True):
        why = "--mixed-types and --per-stage-tp search pipelines only"
    elif export not in (None, "torchtitan"):
        why = f"--export {export} runs no FSDP as planned"
    elif kept:
        why = f"the switches kept as given ({', '.join(kept)}) are Megatron-LM's"
    if why is not None and sharded:
        raise ProblemError(f"sharded data parallelism is not searched: {why}")
    return why is None


def _checked(values: Sequence[Any], allowed: Sequence[Any], name: str) -> tuple:
    """``values``, distinct and from ``allowed``, as a tuple.

    Raises:
        ProblemError: one that is not (one line).
    """
    given = tuple(values)[:65]
    bad = [v for v in given if isinstance(v, bool) != isinstance(allowed[0], bool)]
    bad += [v for v in given if v not in allowed]
    if not given or len(set(given)) != len(given) or bad:
        shown = (
            f"{allowed[0]} to {allowed[-1]}"
            if isinstance(allowed, range)
            else ", ".join(map(str, allowed))
        )
        raise ProblemError(
            f"{name}: give distinct values from {shown}; got "
            f"{', '.join(f'{v!r:.20}' for v in given) or 'none'}"
        )
    return given


def _plan_experts(
    model: str,
    pool: Mapping[str, int],
    global_batch: int,
    spec: TransformerSpec,
    searches: Sequence[ExpertSearch],
    search: Mapping[str, Any],
    shared: Mapping[str, Any],
    gpus_per_node: int,
) -> KnobPlan:
    """The fastest plan over every expert layout searched (``searches``:
    :func:`~pipedejavu.planning.expert_search.layout_search`), proven when
    the least bound over all of them reaches its time. The layouts are
    searched as one branch and bound: the first fully, every later one
    against the best plan so far (its choices settled by the proof with that
    time as their cutoff: a layout that cannot beat it costs its bounds
    only). The order only decides how soon a good incumbent is known: EP
    groups inside a node first, the largest first (the published recipes'
    choice), then those across nodes, the smallest first; at one EP, the
    flex dispatcher before alltoall (the faster where the prediction prices
    the published runs), without the overlap first (its space is the
    smaller: no full recomputation, pipelines interleaved)."""
    started = time.perf_counter()
    found: list[KnobPlan] = []
    lower = math.inf

    def first(found: ExpertSearch) -> tuple[int, int, bool, bool]:
        experts = found.layers.experts
        ep = experts.ep
        near = (1, ep) if ep > gpus_per_node else (0, -ep)
        flex = experts.dispatcher == "flex"
        return (*near, not flex, found.layers.overlap_dispatch)

    searches = sorted(searches, key=first)
    best: KnobPlan | None = None
    memo = InterleavedMemo()  # (sources of equal sizes share memory tests)
    for found_layout in searches:
        incumbent = None if best is None else (best.result, best.choice)
        try:
            plan = plan_with_knobs(
                model,
                pool,
                global_batch,
                **{**search, "space": found_layout.space},
                **shared,
                experts=found_layout.layers,
                incumbent=incumbent,
                one_stage_1f1b=found_layout.one_stage_1f1b,
                interleaved_memo=memo,
                interleaved_first=True,
            )
        except InfeasibleProblemError:
            continue  # no plan with this layout fits: it bounds nothing
        found.append(plan)
        lower = min(lower, plan.result.predicted_lower_bound_s)
        if best is None or (
            plan.result.prediction.iteration_time_s
            < best.result.prediction.iteration_time_s
        ):
            best = plan
    if best is None:
        raise InfeasibleProblemError(
            f"no plan of {spec.name} fits {dict(pool)} with global batch "
            f"{global_batch} under any expert-parallel degree dividing its "
            f"{spec.moe.num_experts} experts"
        )
    best_s = best.result.prediction.iteration_time_s
    note = _searched_note(searches, best.choice.data.experts)
    result = dataclasses.replace(
        best.result,
        proven=bound_reaches(lower, best_s),
        predicted_lower_bound_s=min(lower, best_s),
        search_time_s=time.perf_counter() - started,  # (the layouts that fit none too)
    )
    choice = dataclasses.replace(best.choice, notes=(*best.choice.notes, note))
    return dataclasses.replace(best, result=result, choice=choice)


def _searched_note(searches: Sequence[ExpertSearch], best: Any) -> str:
    """What expert layouts were searched and which won, one line."""
    degrees = sorted({x.layers.experts.ep for x in searches})
    etps = sorted({x.layers.experts.etp for x in searches})
    dispatchers = sorted({x.layers.experts.dispatcher for x in searches})
    overlaps = {x.layers.overlap_dispatch for x in searches}
    beside = {
        frozenset({False}): "without",
        frozenset({True}): "with",
        frozenset({False, True}): "with and without",
    }[frozenset(overlaps)]
    won = best.experts
    won_text = f"EP {won.ep}" + (f", expert TP {won.etp}" if len(etps) > 1 else "")
    won_text += f", {won.dispatcher}"
    won_text += ", overlapped" if best.overlap_dispatch else ""
    plural = "s" if len(dispatchers) > 1 else ""
    return (
        f"expert layouts searched: EP {', '.join(map(str, degrees))} (expert TP "
        f"{', '.join(map(str, etps))}), "
        f"the {' and '.join(dispatchers)} dispatcher{plural}"
        f", {beside} the all-to-all overlap (Megatron-LM's schedules; routing "
        f"priced balanced): {won_text} is fastest"
    )
