"""Prove a Megatron-style plan optimal under the predictor itself.

The search (:mod:`pipedejavu.search.megatron.planner`) proves the optimum of the
planning objective (the closed-form pipeline) and re-scores its best plans with the
predictor (:func:`pipedejavu.costmodel.megatron.predictor.predict_plan`, a simulation).
The two can disagree, so the plan with the least *predicted* time might lie
elsewhere. This module closes that gap by a branch and bound on the predictor:

**A lower bound per plan.** For a plan with stages ``s`` over layers
``[a_s, b_s)``, ``B`` micro-batches and the predictor's quantities (module
docstring of :mod:`pipedejavu.costmodel.megatron.predictor`):

* a stage starts its first forward no earlier than the forwards of the stages
  before it took, ``F(a_s)`` (their layers' forward times plus one instruction
  overhead at least; transfers only add), and is then busy ``B x busy_s``
  (its layers' forward and backward plus two overheads per micro-batch, and
  its blocking transfers) but for the last gradient it sends back, after its
  last backward: that backward ends at ``>= F(a_s) + B busy_s - r_s`` (``r_s``:
  the least blocking pair over the boundary before it);
* the last backward of stage ``s - 1`` follows the gradient of the micro-batch
  whose backward ends last on stage ``s``, so stage 0 ends ``>= F(a_s) + B
  busy_s + G(a_s)`` (``G``: the backward times of the layers before, plus an
  overhead);
* a stage's optimizer step (exact: it depends on its parameters only) and its
  data-parallel all-reduce (at least its least value over every offset the
  stage's replicas can have within a node in Megatron's rank order) follow its
  last backward; the tied-embedding all-reduce only adds.

So ``predicted(plan) >= max_s w(a_s, b_s, tp_s)`` with ``w = F + B busy - r +
max(tail, G)``; and as stage 0's own all-reduce and optimizer step follow its
last backward, ``predicted(plan) >= F + B busy - r + G + tail_0`` for every
later stage, with ``tail_0`` the tail of the plan's first stage (the
enumeration below adds it once that stage is chosen: on GPT-3 175B with 1F1B
the stage-0 all-reduce of a data-parallel group of 16 is 4% of the
iteration, and without it ~1,700 plans of one configuration were predicted
to settle it). Under the ZB-H1 schedule (the source's
``options.zero_bubble``) a stage's backward is split in ``B`` and ``W``, its
sends do not block and its last command may be a ``W`` that no stage waits
for: ``w = F + B busy + tail`` with ``busy`` its forward, backward and three
overheads (no transfer bound; the warm-up's way back is input gradients);
with one TP degree a configuration's least bound is also at least that of
paths through several stages
(:mod:`~pipedejavu.search.megatron.zero_bubble_paths`, read per pipeline size
by :meth:`~pipedejavu.search.megatron.chains.StageBounds.least`).
Memory: DeepSpeed's 1F1B warm-up keeps at least
``min(stages after + 1, B)`` micro-batches in flight on a stage at its peak (the
simulator's ``peak_in_flight``; ``tests/test_megatron_certify.py`` checks it),
ZB-H1 ``min(P, B)`` on every stage (the predictor's count; with one TP degree
the bounds of ``P``-stage pipelines ask it of every stage, a bottleneck per
size), so a stage whose model state (a mixture of experts': theirs sharded
over expert data parallelism, as the predictor's), largest bucket, reserve and
that many stashes exceed its GPU is in no plan that fits.

**Per configuration** (GPU type, mbs, dp, TP, GPUs: the search's space), the
least ``max_s w`` over its chains of stages is a bottleneck path, solved exactly
by a DP over (GPUs used, layers covered). Before any table is built, a
configuration is dropped where ``B`` times its least work per GPU
(:func:`least_work`) reaches the incumbent, or (one TP degree) where no chain
of its stages meets the memory rule
(:func:`~pipedejavu.search.megatron.bounds.memory_counts`: the stages'
capacities alone, by reachability; its bound would be infinite). A
configuration whose least bound
reaches the incumbent's predicted time holds no better plan. The others are
settled by enumerating their chains whose every stage has ``w`` below the
incumbent (depth first, pruned by the DP's bound on the rest, and by a
second bottleneck DP over the rest's gradient chains plus the least reach
of the tails already chosen) and predicting each; a better plan that fits
in memory becomes the incumbent. Before any is enumerated, each
configuration whose bound is below the incumbent has its least-bound chain
predicted (a probe: an incumbent from a configuration taken later can
settle one taken earlier). Configurations are taken in increasing order of
bound. When every configuration is settled the
incumbent is the predictor's optimum over the search space (``proven``);
otherwise (``max_plans`` predictions spent) the least bound of the unsettled
configurations is a certified lower bound on every plan's predicted time, and
the best plan met is polished (:mod:`~pipedejavu.search.megatron.polish`).

**Mixed GPU types** (``mixed_types``: one mbs, dp and TP degree, a type per
stage). Per (mbs, dp, TP) a coarse DP over (layers covered, stages left per
type, the next stage's type) bounds every vector of stage counts per type
(placements and the previous neighbour taken at their cheapest). A vector
taken off the queue for the first time gets an exact-placement bound
(:class:`~pipedejavu.search.megatron.mixed.PlacedMix`: with the counts
fixed, every stage's ranks follow from its type and the stages of its type
before it) and goes back at that bound;
taken again, its chains are enumerated least bound first and predicted.

Modules: the search space (:mod:`~pipedejavu.search.megatron.space`), the
transfer tables (:mod:`~pipedejavu.search.megatron.transfers`), the stage
bounds of every span (:mod:`~pipedejavu.search.megatron.bounds`), read at each
position and enumerated for one type (:mod:`~pipedejavu.search.megatron.chains`),
mixed types (:mod:`~pipedejavu.search.megatron.mixed`); this module drives them.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import RANK_ORDERS, Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.predictor import Prediction, predict_plan
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.search.megatron.bounds import (
    EITHER_ORDER,
    kind_bounds,
    memory_counts,
    stage_bounds,
)
from pipedejavu.search.megatron.chains import Incumbent, StageBounds, single_plans
from pipedejavu.search.megatron.mixed import (
    PlacedMix,
    PlanSource,
    coarse_mixed_bound,
    mixed_bottleneck,
    refine,
)
from pipedejavu.search.megatron.polish import polish_cuts
from pipedejavu.search.megatron.settings import check_plan_size
from pipedejavu.search.megatron.space import (
    EVERY_CONFIGURATION,
    ConfigGroup,
    SearchScope,
    config_groups,
    mixes,
)
from pipedejavu.search.megatron.transfers import BoundCache, send_rows

__all__ = [
    "PredictedCertificate",
    "any_plan_fits",
    "certify_predicted",
    "either_order_bounds",
    "fitting_sizes",
    "group_bounds",
    "least_work",
]


def least_work(
    data: SailorData, model: str, constants: PredictorConstants, group: ConfigGroup
) -> float:
    """The least GPU-seconds of one micro-batch through every layer, forward
    and backward, over the group's TP degrees (a layer on ``t`` GPUs costs
    ``t`` times its time). A pipeline of ``n`` GPUs has a stage busy at least
    ``work / n`` per micro-batch (the stages' GPU-seconds add up to at least
    ``work`` over ``n`` GPUs), so every plan of the group with ``B``
    micro-batches takes at least ``B work / n``: the busy-time part of the
    per-stage bound below, before any table is built."""
    per_tp = []
    for tp in group.tps:
        times = data.layer_times(
            model, group.gpu, group.mbs, tp, smooth=constants.smooth_profiles
        )
        per_tp.append(tp * (times.forward + times.backward))
    return float(np.minimum.reduce(per_tp).sum())


def any_plan_fits(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    scope: SearchScope = EVERY_CONFIGURATION,
    *,
    cache: BoundCache | None = None,
) -> bool:
    """``False`` when no one-type plan of the search space can fit in memory
    (or be priced): every configuration's least bound is infinite, the
    proof's memory rule (a relaxation, module docstring) leaving no chain of
    stages. A quick test before a full search that would otherwise solve every
    configuration to find nothing; ``True`` promises nothing."""
    check_plan_size(data, model)
    groups = config_groups(data, model, gpus, global_batch, scope)
    for group in groups:
        sizes = fitting_sizes(data, model, constants, group, group.sizes, cache)
        if sizes:
            per_size = group_bounds(data, model, constants, group, cache, sizes=sizes)
            if any(np.isfinite(g[n, 0]) for n, (_, g) in per_size.items()):
                return True
    return False


def fitting_sizes(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    group: ConfigGroup,
    sizes: Sequence[int],
    cache: BoundCache | None = None,
) -> list[int]:
    """The ``sizes`` (GPUs of a pipeline) of a group left after the memory
    rule of its stage bounds alone
    (:func:`~pipedejavu.search.megatron.bounds.memory_counts`, ZB-H1's per
    stage count; all of them with several TP degrees): on the others the
    group's bound is infinite."""
    counts = memory_counts(data, model, constants, group, cache)
    if counts is None:
        return list(sizes)
    (t,) = group.tps
    return [n for n in sizes if n // t < len(counts) and counts[n // t]]


def group_bounds(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    group: ConfigGroup,
    cache: BoundCache | None = None,
    rank_order: str = RANK_ORDERS[0],
    sizes: Sequence[int] | None = None,
) -> dict[int, tuple[StageBounds, NDArray[np.float64]]]:
    """``{size: (bounds, g)}``: for each of ``sizes`` (default: the group's)
    the stage bounds of its pipelines of that many GPUs and their bottleneck
    ``g[u, p]`` (:meth:`~pipedejavu.search.megatron.chains.StageBounds.
    bottleneck`; one for all sizes but under ZB-H1 with one TP degree:
    :meth:`~pipedejavu.search.megatron.chains.StageBounds.pipeline`)."""
    bounds = StageBounds(
        group,
        stage_bounds(data, model, constants, group, cache, rank_order),
        constants.op_overhead_s,
        zero_bubble=bool(data.options.zero_bubble),
    )
    sizes = group.sizes if sizes is None else sizes
    most = max(sizes)
    out = {}
    for size in sizes:
        one = bounds.pipeline(size)
        out[size] = (one, one.bottleneck(most if one is bounds else size))
    return out


def either_order_bounds(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    group: ConfigGroup,
    cache: BoundCache,
) -> dict[int, float]:
    """``{size: least bound}`` of a group's pipelines in either rank order
    (:data:`~pipedejavu.search.megatron.bounds.EITHER_ORDER`), computed once
    per source, constants and group of a ``cache``."""
    key = (id(data), model, id(constants), group)
    if key not in cache.either:
        per_size = group_bounds(data, model, constants, group, cache, EITHER_ORDER)
        values = {n: float(g[n, 0]) for n, (_, g) in per_size.items()}
        cache.either[key] = (data, constants, values)  # kept: ids not reused
    return cache.either[key][2]


@dataclasses.dataclass(frozen=True, eq=False)
class PredictedCertificate:
    """What the branch and bound on the predictor established.

    Attributes:
        plan: the best plan known (the incumbent, or a better one found).
        prediction: its prediction.
        lower_bound_s: certified lower bound on the predicted iteration time of
            every plan of the search space that fits in memory.
        proven: every configuration settled: ``plan`` is the predictor's
            optimum (``lower_bound_s == prediction.iteration_time_s``).
        configurations: configurations of the search space.
        pruned: configurations settled by their bound alone.
        enumerated: configurations settled by predicting their remaining plans.
        open: configurations left unsettled (prediction budget spent).
        plans_predicted: predictor calls.
        improved: the incumbent was beaten.
        time_s: wall-clock seconds.
    """

    plan: Plan3D
    prediction: Prediction
    lower_bound_s: float
    proven: bool
    configurations: int
    pruned: int
    enumerated: int
    open: int
    plans_predicted: int
    improved: bool
    time_s: float

    @property
    def gap(self) -> float:
        """Certified relative gap of the plan's predicted time."""
        best = self.prediction.iteration_time_s
        return best / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else math.inf


@dataclasses.dataclass(frozen=True, order=True)
class _Item:
    """A configuration in the proof's queue, least bound first (``order``:
    first come first). ``plans``: its plans left to predict (``None``: too
    many count vectors to enumerate); ``refine``, a mixed item at its coarse
    bound: its exact-placement bound and plans, computed when first taken;
    ``probe``, a one-type item: its plans least bound first (the first is
    predicted before any configuration is enumerated)."""

    bound: float
    order: int
    plans: PlanSource | None = dataclasses.field(default=None, compare=False)
    refine: Callable[[], tuple[float, PlanSource | None]] | None = dataclasses.field(
        default=None, compare=False
    )
    probe: PlanSource | None = dataclasses.field(default=None, compare=False)


def certify_predicted(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    incumbent: Plan3D,
    scope: SearchScope = EVERY_CONFIGURATION,
    *,
    max_plans: int = 3000,
    mixed_types: bool = True,
    mixed_state_limit: int = 4000,
    cutoff_s: float = math.inf,
    rank_order: str = RANK_ORDERS[0],
    cache: BoundCache | None = None,
    either_order: bool = False,
    polish_max_plans: int = 0,
    own_incumbent: bool = False,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
) -> PredictedCertificate:
    """Prove ``incumbent`` (or a better plan found) the predictor's optimum over
    the search space of :func:`~pipedejavu.search.megatron.planner.search_megatron` with
    the same settings, or certify a lower bound (module docstring).

    Args:
        data, model, gpus, global_batch, constants: as for the search.
        incumbent: the plan to prove (it must fit in memory, unless
            ``cutoff_s`` is finite).
        scope: the configurations of the search space.
        max_plans: most predictor calls in the enumeration.
        mixed_types: with several GPU types (and ``uniform_tp``), also plans
            whose stages run on different types (module docstring).
        mixed_state_limit: most stage-count vectors a mixed configuration's
            DP may visit; a configuration over it stays open at a coarser
            bound.
        cutoff_s: a predicted time already reached elsewhere (by a plan of
            another cost source: other training options over the same plans):
            configurations whose bound reaches it are settled. Then the
            certificate's plan is a plan of this space faster than the cutoff
            (or the incumbent, which may not fit, when none is): with
            ``proven``, no plan of this space that fits is faster than
            ``min(cutoff_s, prediction)``.
        rank_order: the placement of the plans searched
            (:data:`~pipedejavu.core.plan3d.RANK_ORDERS`; ``tp-pp-dp``, one GPU
            type per plan: its bounds take the transfers and all-reduces least
            over that order's placements).
        cache: bound tables to reuse and fill (proofs over sources that price
            links alike may share one: its keys say what each value read).
        either_order: the proofs of one source in both rank orders share
            ``cache``: a configuration is first bounded least over both
            orders' placements (kept in ``cache``), and where that settles it,
            it is settled in both proofs with one set of tables.
        polish_max_plans, own_incumbent: a proof that spends ``max_plans``
            polishes the best plan of this space it met with up to this many
            more predictions (:func:`~pipedejavu.search.megatron.polish.
            polish_cuts`): a better plan it found, or ``incumbent`` where it is
            one (``own_incumbent``: the search's).
        progress_fn: called with ``{"phase": "proof", "settled", "open",
            "predicted", "best", "bound"}`` after each configuration settled
            and at least every second while one is enumerated (``bound``: the
            least bound of the configurations not settled, so ``min(bound,
            best)`` is a lower bound on every plan at that moment).
    """
    started = time.perf_counter()
    check_plan_size(data, model)
    if rank_order not in RANK_ORDERS:
        raise ProblemError(
            f"rank order must be one of {RANK_ORDERS}, got {rank_order!r}"
        )
    mixing = mixed_types and scope.uniform_tp and len(gpus) > 1
    if rank_order != RANK_ORDERS[0] and mixing:
        raise ProblemError(
            f"the {rank_order} rank order's bounds cover plans on one GPU type; "
            "search mixed GPU types in the default order"
        )
    if data.options.zero_bubble and mixing:
        raise ProblemError(
            "the zero-bubble schedule's bounds cover plans on one GPU type; "
            "search mixed GPU types with the 1F1B schedule"
        )
    best_prediction = None  # not a plan of these costs' space: the cutoff alone
    try:  # (more stages than it allows, or a mixture of experts' TP without SP)
        if scope.max_stages is None or incumbent.num_stages <= scope.max_stages:
            best_prediction = predict_plan(incumbent, data, constants=constants)
    except ProblemError:
        pass
    best_plan = incumbent
    best = math.inf
    if best_prediction is not None and best_prediction.fits_memory:
        best = best_prediction.iteration_time_s
    best = min(best, cutoff_s)
    groups = config_groups(data, model, gpus, global_batch, scope)
    items: list[_Item] = []
    cache = BoundCache() if cache is None else cache
    early = 0  # configurations settled by the work bound alone
    for group in groups:
        work = least_work(data, model, constants, group)
        sizes = [n for n in group.sizes if group.steps * work / n < best]
        early += len(group.sizes) - len(sizes)
        if not sizes:
            continue
        # a size whose chains cannot fit has an infinite bound: no item
        sizes = fitting_sizes(data, model, constants, group, sizes, cache)
        if not sizes:
            continue
        if either_order:
            least = either_order_bounds(data, model, constants, group, cache)
            early += sum(1 for n in sizes if best <= least[n] < math.inf)
            sizes = [n for n in sizes if least[n] < best]
            if not sizes:
                continue
        per_size = group_bounds(data, model, constants, group, cache, rank_order, sizes)
        for size, (bounds, g) in per_size.items():
            value = bounds.least(g, size, best)
            if math.isfinite(value):
                plans = functools.partial(
                    single_plans,
                    data,
                    model,
                    global_batch,
                    group,
                    bounds,
                    g,
                    size,
                    rank_order=rank_order,
                )
                probe = functools.partial(plans, least_first=True)
                items.append(_Item(value, len(items), plans=plans, probe=probe))
    skipped_mixes = 0
    lower = math.inf
    if mixing:
        spread = mixes(data, model, gpus, global_batch, scope)
        for mix in spread:
            kinds = [(gpu, mix.tp) for gpu, _ in mix.caps]
            tables = kind_bounds(
                data,
                model,
                constants,
                kinds,
                mix.mbs,
                mix.dp,
                mix.steps,
                cache,
                with_sends=False,
            )
            sends = send_rows(
                data, model, constants, kinds, mix.mbs, mix.dp, mix.steps, cache
            )
            bounds = {
                gpu: StageBounds(
                    ConfigGroup(gpu, mix.mbs, mix.dp, mix.steps, (mix.tp,), ()),
                    {mix.tp: tables[(gpu, mix.tp)]},
                    constants.op_overhead_s,
                )
                for gpu, _ in mix.caps
            }
            g = mixed_bottleneck(mix, bounds, sends, limit=mixed_state_limit)
            if g is None:  # too many count vectors: a coarser bound, left open
                value = coarse_mixed_bound(mix, bounds)
                if value < best:
                    skipped_mixes += 1
                    lower = min(lower, value)
                continue
            placed = PlacedMix(data, model, constants, mix, cache)
            least: dict = {}  # counts -> least bound over the first stage's type
            for (counts, _), row in g.items():
                if sum(1 for c in counts if c) >= 2:  # one type: see above
                    least[counts] = min(least.get(counts, math.inf), float(row[0]))
            for counts, value in least.items():
                if math.isfinite(value):
                    later = functools.partial(
                        refine, placed, gpus, global_batch, counts, mixed_state_limit
                    )
                    items.append(_Item(value, len(items), refine=later))
    # Least bound first; a mixed item carries a coarse bound until it is first
    # taken, then its exact-placement bound (PlacedMix) and goes back.
    configurations = len(items) + early
    heapq.heapify(items)
    pruned, enumerated, predicted = early, 0, 0
    left_open = skipped_mixes
    improved = False
    reported = time.perf_counter()

    def report(bound: float) -> None:
        nonlocal reported
        reported = time.perf_counter()
        if progress_fn is not None:
            progress_fn(
                {
                    "phase": "proof",
                    "settled": pruned + enumerated,
                    "open": left_open,
                    "predicted": predicted,
                    "best": best,
                    "bound": min(bound, lower, best),
                }
            )

    # Probes: the first plan of each configuration (its bottleneck DP's
    # chain), least bound first, predicted before any is enumerated, so that a
    # configuration of lower bound but slower plans is not enumerated against
    # a poor incumbent (found on Llama-3-70B with full recomputation: the
    # budget was spent on TP 1 plans while a TP 2 plan was faster than all).
    def consider(plan: Plan3D) -> float:
        """Predict ``plan``: faster, and fitting, it becomes the incumbent.
        Its time (``inf``: it does not fit, or a link is not priced)."""
        nonlocal best, best_plan, best_prediction, improved, predicted
        predicted += 1
        try:
            prediction = predict_plan(plan, data, constants=constants)
        except ProblemError:  # a link the network tables do not price
            return math.inf
        if not prediction.fits_memory:
            return math.inf
        if prediction.iteration_time_s < best:
            best, best_plan = prediction.iteration_time_s, plan
            best_prediction, improved = prediction, True
        return prediction.iteration_time_s

    probed: dict[int, Plan3D] = {}
    for item in sorted(items):
        if item.bound >= best or predicted >= max_plans // 10:
            break
        if item.probe is None:
            continue
        plan = next(iter(item.probe(Incumbent(best))), None)
        if plan is not None:
            probed[item.order] = plan
            consider(plan)
    while items:
        item = heapq.heappop(items)
        value, plans = item.bound, item.plans
        if value >= best:
            pruned += 1
            continue
        if item.refine is not None:
            refined, plans = item.refine()
            heapq.heappush(items, _Item(max(value, refined), item.order, plans=plans))
            continue
        if predicted >= max_plans or plans is None:
            left_open += 1
            lower = min(lower, value)
            continue
        complete = True
        incumbent_time = Incumbent(best)
        for plan in plans(incumbent_time):
            if plan == probed.get(item.order):  # predicted by its probe
                continue
            if predicted >= max_plans:
                complete = False
                break
            if time.perf_counter() - reported > 1.0:
                report(value)
            consider(plan)
            incumbent_time.time_s = best
        if complete:
            enumerated += 1
        else:
            left_open += 1
            lower = min(lower, value)
        report(items[0].bound if items else math.inf)
    start = best_prediction if improved or own_incumbent else None
    if polish_max_plans and predicted >= max_plans and start and start.fits_memory:
        tick = functools.partial(report, lower)  # (progress every second)
        polish_cuts(best_plan, start.iteration_time_s, consider, polish_max_plans, tick)
        report(lower)
    if not math.isfinite(best):
        raise ValueError("the incumbent does not fit in memory (and no cutoff)")
    return PredictedCertificate(
        plan=best_plan,
        prediction=best_prediction,
        lower_bound_s=min(lower, best),
        proven=left_open == 0,
        configurations=configurations,
        pruned=pruned,
        enumerated=enumerated,
        open=left_open,
        plans_predicted=predicted,
        improved=improved,
        time_s=time.perf_counter() - started,
    )
