"""Plans over the training knobs: the pipeline schedule (1F1B, interleaved
1F1B, ZB-H1), activation recomputation, sequence parallelism and the
distributed optimizer, searched with the plan and proven.

Each choice of knobs is a :class:`~pipedejavu.core.training_options.TrainingOptions`
that compiles into its own cost source (the same problem, objective, predictor and
proof; only the layer times, activation and model-state bytes differ), over the
same plans (stages, TP, DP, mbs, GPUs). The search takes the choices in order
(the fastest per plan first: no recomputation before selective before full;
sequence parallelism and the distributed optimizer on before off):

1. the first choice with a plan that fits: the full search and its proof
   (:func:`~pipedejavu.planning.training.plan_training`). With both 1F1B and
   ZB-H1 in the space, the planning DP alone (no proof) of each schedule
   decides which is searched first: the faster plan's (the later proofs are
   the quicker, the sooner the best plan is known); a ZB-H1 choice whose DP
   finds no plan is settled by it
   (:func:`~pipedejavu.planning.knob_order.first_order`, whose DP the full
   search then reuses);
2. Megatron-LM's interleaved schedule for every choice, in each rank order
   of the space
   (:func:`~pipedejavu.search.megatron.interleaved.search_interleaved`: a
   branch and bound on the predictor over its few equal-chunk plans) with the
   best predicted time so far as its cutoff; a faster plan becomes the
   incumbent;
3. every choice step 1 did not search, ZB-H1's then 1F1B's: the proof's
   branch and bound alone
   (:func:`~pipedejavu.search.megatron.certify.certify_predicted`, on the
   choice's own predictor and bounds), with the best predicted time so far as
   its cutoff. Its configurations whose lower bound reaches the cutoff are
   settled at once; a plan it finds below the cutoff becomes the incumbent
   (step 2 first: an interleaved incumbent is often faster, which settles more
   configurations here); then the same for the ``tp-pp-dp`` rank order;
4. if the winning choice was settled by the proof alone, its full search runs
   once more so that the report holds its planning objective (its proof finds
   the same predicted optimum).

Given an incumbent found before (``incumbent``: another expert layout's best
plan, :func:`~pipedejavu.planning.plan_model.plan_model`), step 1 is skipped:
every choice goes to steps 2 and 3 with its time as the first cutoff.

Each step certifies a lower bound on every plan of its space that fits (a
proven step: the incumbent of its time); when the least of them reaches the
plan's time, the plan is the predictor's optimum over the union of the
choices' spaces (``proven``), else that least bound is reported.

The distributed optimizer dominates: it lowers only the model-state bytes
(:func:`~pipedejavu.costmodel.megatron.rules.model_state_bytes`), the
optimizer step (:func:`~pipedejavu.costmodel.megatron.rules.optimizer_time`)
and the data-parallel traffic
(:func:`~pipedejavu.costmodel.megatron.rules.gradient_sync`), which the
predictor only adds, so no plan is slower or larger with it; the choices
without it are settled by that rule (``how == "dominated"``, checked on random
plans by ``tests/test_knobs.py``), except when the gradient reduction overlaps
the backward pass (:meth:`~pipedejavu.planning.knob_space.KnobSpace.
is_dominated`). Sequence parallelism is searched both
ways (its two collectives can cost more than one all-reduce on small messages).
Neither changes anything at TP 1 (DP 1); such a plan reports it off.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipedejavu.core.layout import LEGACY_ORDERS
from pipedejavu.core.memory_headroom import MemoryHeadroom, kept_free
from pipedejavu.core.plan3d import RANK_ORDERS, rank_order_of
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.core.training_options import (
    TrainingOptions,
    TrainingPrecision,
)
from pipedejavu.costmodel.analytical.calibration_file import ClusterCalibration
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.planning.any_model import CostChoice, choose_cost_source
from pipedejavu.planning.expert_search import moe_options_of
from pipedejavu.planning.knob_order import (
    CutoffReached,
    KnobIncumbent,
    cutoff_state,
    first_order,
    interleaved_choices,
    objective_free_plan,
    tagged_progress,
)
from pipedejavu.planning.knob_space import KnobOutcome, KnobSpace
from pipedejavu.planning.training import (
    TrainingPlan,
    check_global_batch,
    parse_gpu_pool,
    plan_training,
    search_config,
)
from pipedejavu.search.megatron.certify import any_plan_fits, certify_predicted
from pipedejavu.search.megatron.interleaved import (
    InterleavedMemo,
)
from pipedejavu.search.megatron.settings import (
    MegatronSearchResult,
    bound_reaches,
    check_plan_size,
)
from pipedejavu.search.megatron.transfers import BoundCache

__all__ = ["KnobPlan", "plan_with_knobs", "search_knobs"]


@dataclasses.dataclass(frozen=True)
class KnobPlan:
    """The best plan over a :class:`KnobSpace`.

    Attributes:
        result: the plan, priced for its knobs (``result.options``); its
            ``proven`` holds when the least bound certified over every choice
            reaches its time (``predicted_lower_bound_s``);
            ``search_time_s`` is the whole search's.
        choice: the winning choice's cost source.
        space: the knobs searched.
        outcomes: how each choice was settled, in search order.
    """

    result: TrainingPlan
    choice: CostChoice
    space: KnobSpace
    outcomes: tuple[KnobOutcome, ...]

    @property
    def rank_order(self) -> str | None:
        """The plan's rank order (:func:`~pipedejavu.core.plan3d.rank_order_of`;
        the default where both place it alike)."""
        plan = self.result.plan
        if plan.layout.cp > 1:  # (its nodes are its sequences' first GPUs')
            return {new: old for old, new in LEGACY_ORDERS.items()}[plan.layout.order]
        gpu = plan.stages[0].replicas[0].gpu_type
        return rank_order_of(plan, self.choice.data.gpu_spec(gpu).gpus_per_node)

    def to_json(self) -> dict[str, Any]:
        out = self.result.to_json()
        out["rank_order"] = self.rank_order
        out["knobs"] = {
            "space": self.space.to_json(),
            "choices": [o.to_json() for o in self.outcomes],
        }
        layers = getattr(self.choice.data, "experts", None)
        if layers is not None:  # what the experts were priced with
            out["experts"] = moe_options_of(layers).to_json()
        return out


def _normalized(options: TrainingOptions, result: TrainingPlan) -> TrainingOptions:
    """Knobs that change nothing on this plan, off (module docstring)."""
    stages = result.plan.stages
    if options.sequence_parallel and all(r.tp == 1 for s in stages for r in s.replicas):
        options = dataclasses.replace(
            options, sequence_parallel=False, tp_comm_overlap=False
        )
    if options.distributed_optimizer and all(len(s.replicas) == 1 for s in stages):
        options = dataclasses.replace(
            options, distributed_optimizer=False, zero_stage=0
        )
    return options


def plan_with_knobs(
    model: str,
    gpus: Mapping[str, int] | Sequence[str],
    global_batch: int,
    *,
    space: KnobSpace | None = None,
    options: TrainingOptions | None = None,
    precision: TrainingPrecision | None = None,
    seq_length: int | None = None,
    gpu_sheet: str | os.PathLike | None = None,
    profiles: str | os.PathLike | None = None,
    method: str = "dp",
    uniform_tp: bool = True,
    allow_fewer_gpus: bool = True,
    mixed_types: bool = False,
    mbs_values: Sequence[int] | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    dp_alone: bool = False,
    memory_headroom: MemoryHeadroom | float | str | None = None,
    experts: ExpertLayers | None = None,
    incumbent: tuple[TrainingPlan, CostChoice] | None = None,
    one_stage_1f1b: bool = False,
    interleaved_memo: InterleavedMemo | None = None,
    interleaved_first: bool = False,
    calibration: ClusterCalibration | None = None,
    outside_s: float = math.inf,
    bound_first: bool = False,
) -> KnobPlan:
    """The fastest plan of ``model`` over the plans and the knobs of ``space``
    (module docstring), proven under the predictor.

    Args:
        model, gpus, global_batch: as for
            :func:`~pipedejavu.planning.any_model.plan_any_model`.
        space: the knobs to search (``None``: all of :class:`KnobSpace`).
        options: the other training options (precision, flash attention...;
            ``None``: the model's defaults, see
            :func:`~pipedejavu.planning.any_model.choose_cost_source`).
        precision: replaces the precision of ``options``.
        seq_length, gpu_sheet, profiles, memory_headroom, experts: as for
            ``choose_cost_source``.
        calibration: as for ``choose_cost_source``.
        method: how the first feasible choice is searched (``dp`` or
            ``diff``, as for :func:`~pipedejavu.planning.training.plan_training`;
            the later ones are settled by the proof either way).
        uniform_tp, allow_fewer_gpus, mixed_types, mbs_values, dp_alone: the
            plan space, as for
            :func:`~pipedejavu.planning.training.plan_training`; plans mixing
            GPU types (``mixed_types``) are searched with the 1F1B schedule in
            the default rank order (the other schedules' and order's bounds
            cover plans on one GPU type; with them, a plan takes one type).
        progress_fn: called as the searches go (each dict gets ``"knobs"``:
            the choice's index).
        incumbent: a plan found before (another expert layout's) and its
            choice: every choice is settled by the proof with its time as the
            cutoff (no step 1); the result is it unless a choice beats it.
        interleaved_memo: the interleaved searches' memo
            (:class:`~pipedejavu.search.megatron.interleaved.InterleavedMemo`;
            ``None``: one for this call), kept by a caller that searches again
            (each expert layout: their memory tests shared).
        interleaved_first: search the interleaved schedules before the
            first full search, so that a plan they find settles every other
            choice by its proof (the same optimum where proven; fewer planning
            DPs: ``plan`` of a mixture of experts, whose best plans are often
            interleaved).
        outside_s: the time of a plan outside this space (the sharded
            search's): the proofs of step 3 settle the choices against the
            lesser of it and the best plan found, so that a choice none of
            whose plans beats it is settled at once; the result is then no
            more than this space's best plan found, proven optimal where its
            bound reaches its time (``predicted_lower_bound_s`` is certified
            either way).
        bound_first: with a finite ``outside_s``, settle every choice by its
            proof against it before any planning DP
            (:func:`~pipedejavu.planning.knob_order.cutoff_state`): where no
            plan beats it, :class:`~pipedejavu.planning.knob_order.
            CutoffReached` is raised with the certified bound; else the same
            search.

    Raises:
        ProblemError: bad arguments.
        InfeasibleProblemError: no choice has a plan that fits (never with an
            incumbent).
    """
    pool = parse_gpu_pool(gpus)
    fixed: dict[str, Any] = {
        "seq_length": seq_length,
        "gpu_sheet": gpu_sheet,
        "profiles": profiles,
        "memory_headroom": memory_headroom,
        "experts": experts,
        "calibration": calibration,
    }
    first = choose_cost_source(
        model, pool, options=options, precision=precision, **fixed
    )

    def make_choice(knobs: TrainingOptions) -> CostChoice:
        return choose_cost_source(model, pool, options=knobs, **fixed)

    return search_knobs(
        make_choice,
        first.options,
        pool,
        global_batch,
        space=space,
        method=method,
        uniform_tp=uniform_tp,
        allow_fewer_gpus=allow_fewer_gpus,
        mixed_types=mixed_types,
        mbs_values=mbs_values,
        progress_fn=progress_fn,
        dp_alone=dp_alone,
        incumbent=incumbent,
        one_stage_1f1b=one_stage_1f1b,
        interleaved_memo=interleaved_memo,
        interleaved_first=interleaved_first,
        outside_s=outside_s,
        bound_first=bound_first,
    )


def search_knobs(
    make_choice: Callable[[TrainingOptions], CostChoice],
    base: TrainingOptions,
    gpus: Mapping[str, int],
    global_batch: int,
    *,
    space: KnobSpace | None = None,
    method: str = "dp",
    uniform_tp: bool = True,
    allow_fewer_gpus: bool = True,
    mixed_types: bool = False,
    mbs_values: Sequence[int] | None = None,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    dp_alone: bool = False,
    incumbent: tuple[TrainingPlan, CostChoice] | None = None,
    one_stage_1f1b: bool = False,
    interleaved_memo: InterleavedMemo | None = None,
    interleaved_first: bool = False,
    outside_s: float = math.inf,
    bound_first: bool = False,
) -> KnobPlan:
    """:func:`plan_with_knobs` for any cost source: ``make_choice`` prices a
    choice of knobs (``base`` gives the other options; ``gpus`` as the
    choices' sources name them, before :meth:`CostChoice.pool`)."""
    started = time.perf_counter()
    space = space or KnobSpace()
    pool = parse_gpu_pool(gpus)
    check_global_batch(global_batch)
    knobs = space.choices(base)
    one_f = [make_choice(k) for k in knobs] if "1f1b" in space.schedules else []
    choices = one_f or [make_choice(k) for k in knobs]
    split = [dataclasses.replace(k, zero_bubble=True) for k in knobs]
    chunked = [k for k in split if k.recompute_choices is None]  # (one chunk)
    zero = [make_choice(k) for k in split] if "zb-h1" in space.schedules else []
    if "interleaved-zb" in space.schedules:
        shared = [c for c in zero if c.options.recompute_choices is None]
        zero_v = shared or [make_choice(k) for k in chunked]
    else:
        zero_v = []
    shaped = [dataclasses.replace(k, virtual_stages=2, v_shape=True) for k in chunked]
    zbv = [make_choice(k) for k in shaped] if "zbv" in space.schedules else []
    first = choices[0]
    check_plan_size(first.data, first.model)
    max_stages = 1 if one_stage_1f1b else None
    config = search_config(
        method,
        uniform_tp,
        allow_fewer_gpus,
        mixed_types,
        mbs_values,
        dp_alone,
        max_stages,
    )

    def mixes_types(choice: CostChoice, order: str = RANK_ORDERS[0]) -> bool:
        """Search plans mixing GPU types for ``choice`` in ``order``: only
        1F1B's in the default order (the other bounds cover one type)."""
        return (
            mixed_types and order == RANK_ORDERS[0] and not choice.options.zero_bubble
        )

    shared = BoundCache()  # the choices' links are priced alike
    # plans on one GPU type only: the quick infeasibility test covers those
    one_type = len(pool) == 1 or not (mixed_types and uniform_tp)

    probes: dict[int, MegatronSearchResult] = {}  # step 1's DP, by id(choice)

    def search(choice: CostChoice, index: int) -> TrainingPlan:
        return plan_training(
            choice.model,
            choice.pool(pool),
            global_batch,
            profiles=choice.data,
            method=method,
            uniform_tp=uniform_tp,
            allow_fewer_gpus=allow_fewer_gpus,
            mbs_values=mbs_values,
            mixed_types=mixes_types(choice),
            progress_fn=tagged_progress(progress_fn, index),
            bound_cache=shared,
            solved=probes.get(id(choice)),
            dp_alone=dp_alone,
            max_stages=max_stages,
            cutoff_s=outside_s,
        )

    outcomes: list[KnobOutcome] = []
    if any(c.measured for c in zero + zero_v + zbv):
        raise ProblemError(
            f"the zero-bubble schedules need each layer's weight-gradient time, "
            f"which {first.model}'s profiles do not give: price them analytically "
            "(another --precision) or leave zb-h1, interleaved-zb and zbv out of "
            "--schedule"
        )
    if len(choices) > 1 and any(c.measured for c in choices):
        raise ProblemError(
            f"{first.model}'s profiles measured one training ("
            f"{first.options.precision}, recompute {first.options.recompute}, "
            "no sequence parallelism, no distributed optimizer), and plans "
            "priced by them are not compared with plans priced by the analytical "
            "model: give one value of each knob (or another --precision, which "
            "prices every choice analytically)"
        )
    state = KnobIncumbent(best=None, best_s=math.inf, searched=False, lower=math.inf)
    if incumbent is not None:  # every choice settled against it (step 3)
        state.take(incumbent, searched=True)
    elif bound_first and math.isfinite(outside_s):  # (a placeholder at it)
        state = cutoff_state(first, pool, global_batch, outside_s)
    placeholder = state.best
    # 1. the first choice with a plan: the full search (order: first_order)
    pending = list(enumerate(one_f)) + list(enumerate(zero, 2 * len(knobs)))

    fitting: dict[int, bool] = {}  # asked of a choice once (step 1, its probe)

    def could_fit(choice: CostChoice) -> bool:
        if id(choice) in fitting:
            return fitting[id(choice)]
        fitting[id(choice)] = not one_type or any_plan_fits(
            choice.data,
            choice.model,
            choice.pool(pool),
            global_batch,
            FITTED_CONSTANTS,
            config,
            cache=shared,
        )
        return fitting[id(choice)]

    def interleaved_step() -> None:
        # 2. the interleaved schedule per choice (its cutoff is the best so
        # far; it often beats 1F1B, which tightens the proofs of step 3)
        interleaved = choices if "interleaved" in space.schedules else []
        interleaved = [c for c in interleaved if c.options.recompute_choices is None]
        runs = [
            (index + o * 5 * len(knobs), choice, order)
            for first, kind in ((1, interleaved), (3, zero_v), (11, zbv))
            for o, order in enumerate(space.rank_orders)
            for index, choice in enumerate(kind, start=first * len(knobs))
        ]
        # the candidates and memory, either order (and, kept by the caller,
        # the memory tests of every expert layout)
        memo = InterleavedMemo() if interleaved_memo is None else interleaved_memo
        outcomes.extend(
            interleaved_choices(
                runs,
                pool,
                global_batch,
                config,
                state,
                memo,
                method=method,
                progress_fn=progress_fn,
            )
        )

    # with interleaved_first, step 2 before step 1: a plan it finds is the
    # cutoff of every other choice (step 3), and no planning DP runs unless a
    # 1F1B or ZB-H1 plan wins (its objective, searched at the end)
    early = interleaved_first and incumbent is None
    if early:
        interleaved_step()
    if one_f and zero and state.best is None:
        order = first_order(one_f, zero, pool, global_batch, config, could_fit)
        pending, probes = order.pending, order.probes
        outcomes += order.settled
    while pending and state.best is None:
        index, choice = pending.pop(0)
        tick = time.perf_counter()
        try:
            if not could_fit(choice):
                raise InfeasibleProblemError("no chain of stages fits")
            result = search(choice, index)
        except InfeasibleProblemError:
            outcomes.append(
                KnobOutcome.infeasible(choice.options, time.perf_counter() - tick)
            )
            continue
        state.take((result, choice), searched=True)
        state.lower = min(state.lower, result.predicted_lower_bound_s)
        outcomes.append(
            KnobOutcome(
                choice.options,
                "searched",
                state.best_s,
                math.inf,
                result.proven,
                time.perf_counter() - tick,
            )
        )
    if not early:
        interleaved_step()
    # 3. the choices step 1 left: the proof with the cutoff; then the tp-pp-dp
    # order's proofs of the 1F1B and ZB-H1 choices (not of plans mixing GPU
    # types; step 2 placed the interleaved plans in either order)
    sequence = [
        (i, c, "zero-bubble" if c.options.zero_bubble else "proof", RANK_ORDERS[0])
        for i, c in pending
    ]
    both_orders = RANK_ORDERS[1] in space.rank_orders
    if both_orders:  # (no plan fits: in no order)
        infeasible = [o.options for o in outcomes if o.how == "infeasible"]
        fits = [c for c in zero + one_f if c.options not in infeasible]
        placed = [
            (c, "zero-bubble" if c.options.zero_bubble else "proof") for c in fits
        ]
        sequence += [
            (i, c, how, RANK_ORDERS[1])
            for i, (c, how) in enumerate(placed, 4 * len(knobs))
        ]
    for index, choice, how, order in sequence:
        tick = time.perf_counter()
        if state.best is None:
            # Every choice was searched and none fits; in another order the
            # same plans hold as much.
            outcomes.append(KnobOutcome.infeasible(choice.options, 0.0, order))
            continue
        certificate = certify_predicted(
            choice.data,
            choice.model,
            choice.pool(pool),
            global_batch,
            FITTED_CONSTANTS,
            state.best[0].plan,
            config,
            max_plans=config.proof_budget,
            polish_max_plans=config.polish_budget,
            mixed_types=mixes_types(choice, order),
            cutoff_s=min(state.best_s, outside_s),
            rank_order=order,
            cache=shared,
            either_order=both_orders,
            progress_fn=tagged_progress(progress_fn, index),
        )
        found = certificate.prediction  # None: nothing of its own beat the cutoff
        beats = found is not None and found.fits_memory
        beats = beats and found.iteration_time_s < state.best_s
        cutoff = min(state.best_s, outside_s)
        state.lower = min(state.lower, certificate.lower_bound_s)
        if beats and order == RANK_ORDERS[0]:
            plan = dataclasses.replace(
                state.best[0],
                plan=certificate.plan,
                prediction=found,
                options=choice.options,
            )
            state.take((plan, choice), searched=False)
        elif beats:  # its own placement: no objective to search again
            proof = (
                certificate.lower_bound_s,
                certificate.proven,
                certificate.configurations,
                certificate.enumerated,
                certificate.time_s,
            )
            plan = objective_free_plan(
                certificate.plan, found, proof, choice, choice.options, pool, method
            )
            state.take((plan, choice), searched=True)
        outcomes.append(
            KnobOutcome(
                choice.options,
                how,
                found.iteration_time_s if beats else math.nan,
                cutoff,
                certificate.proven,
                time.perf_counter() - tick,
                order,
            )
        )
    outcomes += [
        KnobOutcome(knobs, "dominated", math.nan, math.nan, True, 0.0)
        for knobs in space.dominated(base)
    ]
    if state.best is None:
        raise InfeasibleProblemError(
            f"no plan of {first.model} fits {dict(pool)}"
            f"{kept_free(first.data.memory_headroom)} with global batch "
            f"{global_batch} under any of: {space.describe()}"
        )
    (result, choice), lower = state.best, state.lower
    if state.best is placeholder and incumbent is None:
        raise CutoffReached(lower)
    if not state.searched:
        # The report's planning objective comes from the winning choice's own
        # search; its proof reaches the same predicted optimum.
        result = search(choice, len(outcomes))
    # Each step certified that no plan of its space is faster than its bound
    # (a proven step: than the incumbent of its time): the plan is optimal
    # over the union when the least bound reaches its time, even where a step
    # ran out of its prediction budget below a bound a later plan undercut.
    lower = min(lower, result.predicted_lower_bound_s)
    best_s = result.prediction.iteration_time_s
    proven = bound_reaches(lower, best_s)
    result = dataclasses.replace(
        result,
        proven=proven,
        predicted_lower_bound_s=min(lower, best_s),
        search_time_s=time.perf_counter() - started,
        options=_normalized(result.options, result),
    )
    return KnobPlan(result, choice, space, tuple(outcomes))
