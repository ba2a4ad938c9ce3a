"""Which choice of knobs the knob search (:mod:`pipedejavu.planning.knobs`)
searches in full first, when both 1F1B and ZB-H1 are in its space: the planning
DP alone (no proof) of each schedule's first choice decides. The later proofs
are the quicker, the sooner the best plan is known, and which schedule finds
it depends on the setting (ZB-H1 on GPT-3 175B, 1F1B on Llama-3-70B in
``benchmarks/plan_knobs.py``): either fixed order made one of them much
slower. The probes' results are kept: the full search of a probed choice runs
only its proof on them. :func:`objective_free_plan` wraps a plan that a branch
and bound found (not the planning objective) for the search's report;
:func:`interleaved_choices` is the search's interleaved step, which takes its
incumbent (:class:`KnobIncumbent`).
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.predictor import Prediction
from pipedejavu.planning.any_model import CostChoice
from pipedejavu.planning.knob_space import KnobOutcome
from pipedejavu.planning.training import TrainingPlan, plan_cost_source
from pipedejavu.search.megatron.interleaved import InterleavedMemo, search_interleaved
from pipedejavu.search.megatron.planner import search_megatron
from pipedejavu.search.megatron.settings import (
    MegatronSearchConfig,
    MegatronSearchResult,
)
from pipedejavu.search.megatron.space import type_plan

__all__ = [
    "CutoffReached",
    "FirstOrder",
    "KnobIncumbent",
    "first_order",
    "interleaved_choices",
    "cutoff_state",
    "objective_free_plan",
    "tagged_progress",
]


@dataclasses.dataclass(frozen=True)
class FirstOrder:
    """Step 1's order.

    Attributes:
        pending: ``(index, choice)`` left to search, in order.
        settled: the ZB-H1 choices whose DP found no plan (infeasible).
        probes: the DP's result (``certify`` off) of each probed choice that
            found a plan, by the choice's ``id``.
    """

    pending: list[tuple[int, CostChoice]]
    settled: list[KnobOutcome]
    probes: dict[int, MegatronSearchResult]  # by id(choice)


def first_order(
    one_f: list[CostChoice],
    zero: list[CostChoice],
    pool: Mapping[str, int],
    global_batch: int,
    config: MegatronSearchConfig,
    could_fit: Callable[[CostChoice], bool],
) -> FirstOrder:
    """Step 1's order with both 1F1B and ZB-H1 (``one_f[k]`` and ``zero[k]``
    share their other knobs; indices: ``k`` and ``2 len(one_f) + k``): per knob
    values in turn, the planning DP alone (no proof) of the ZB-H1 choice, after
    ``could_fit`` (the quick test); where they find no plan, that choice is
    settled (its full search would end there); else the DP of the 1F1B choice
    too, and the schedule of the faster plan is searched first."""
    # The DP does not read mixed_types (only the proof searches such plans),
    # which needs certify: off in the probe, as certify.
    probe = dataclasses.replace(config, certify=False, mixed_types=False)
    settled: list[KnobOutcome] = []
    probes: dict[int, MegatronSearchResult] = {}

    def fastest(choice: CostChoice) -> float:
        if not could_fit(choice):
            raise InfeasibleProblemError("no chain of stages fits")
        found = search_megatron(
            choice.data,
            choice.model,
            choice.pool(pool),
            global_batch,
            FITTED_CONSTANTS,
            probe,
        )
        probes[id(choice)] = found
        fits = found.prediction.fits_memory
        return found.prediction.iteration_time_s if fits else math.inf

    n = len(one_f)
    for k in range(n):
        tick = time.perf_counter()
        try:
            zero_s = fastest(zero[k])
        except InfeasibleProblemError:
            seconds = time.perf_counter() - tick
            settled.append(KnobOutcome.infeasible(zero[k].options, seconds))
            continue
        try:
            one_s = fastest(one_f[k])
        except InfeasibleProblemError:
            one_s = math.inf
        pair = [(2 * n + k, zero[k]), (k, one_f[k])]
        if one_s < zero_s:
            pair.reverse()
        rest = [(2 * n + i, zero[i]) for i in range(k + 1, n)]
        pending = pair + rest + [(i, one_f[i]) for i in range(n) if i != k]
        return FirstOrder(pending, settled, probes)
    return FirstOrder(list(enumerate(one_f)), settled, probes)


def objective_free_plan(
    plan: Plan3D,
    prediction: Prediction,
    proof: tuple[float, bool, int, int, float],
    choice: CostChoice,
    options: TrainingOptions,
    pool: Mapping[str, int],
    method: str,
) -> TrainingPlan:
    """A :class:`TrainingPlan` for a plan the planning objective does not
    price (interleaved: the closed form is the non-interleaved pipeline's;
    ``tp-pp-dp``: it prices the default placement), found and proven by a
    branch and bound on the predictor; ``proof``: its lower bound, proven,
    configurations, those settled, seconds."""
    lower, proven, configurations, solved, seconds = proof
    return TrainingPlan(
        plan=plan,
        prediction=prediction,
        objective_s=math.nan,
        optimum_s=math.nan,
        lower_bound_s=math.nan,
        gap=math.nan,
        gpus_available=dict(pool),
        search_time_s=seconds,
        method=method,
        configurations=configurations,
        solved=solved,
        predicted_lower_bound_s=lower,
        proven=proven,
        mixed_types=False,
        cost_source=plan_cost_source(plan, choice.data),
        options=options,
    )


class CutoffReached(ProblemError):
    """No plan of the space is faster than the search's cutoff: its
    certified lower bound on every plan (``lower_s``) reaches it, and no
    plan was needed to show it (:func:`cutoff_state`)."""

    def __init__(self, lower_s: float) -> None:
        super().__init__(f"no plan is faster than {lower_s:.6g} s per iteration")
        self.lower_s = lower_s


def cutoff_state(choice: CostChoice, pool: Mapping[str, int], global_batch: int,
                 cutoff_s: float) -> KnobIncumbent:  # fmt: skip
    """The knob search's incumbent before any search, for a search that
    wants only plans faster than ``cutoff_s`` (a capacity question's): a
    placeholder at that time (one GPU holding every layer, which need not
    fit), so that every choice is settled by its proof against the cutoff
    and no planning DP runs unless a plan beats it (the winner's objective
    is then searched at the end, as for any plan a proof found)."""
    gpu = next(iter(choice.pool(pool)))
    layers = choice.data.model_info(choice.model).num_layers
    one = types.SimpleNamespace(gpu=gpu, mbs=1, dp=1)  # (a one-type config)
    plan = type_plan(choice.data, choice.model, [(0, layers, 1)], one, global_batch)
    placeholder = TrainingPlan(
        plan=plan, prediction=None, objective_s=math.nan, optimum_s=math.nan,
        lower_bound_s=math.nan, gap=math.nan, gpus_available=dict(pool),
        search_time_s=0.0, method="dp", configurations=0, solved=0,
        predicted_lower_bound_s=math.nan, proven=False, mixed_types=False,
        cost_source="analytical", options=choice.options,
    )  # fmt: skip
    return KnobIncumbent((placeholder, choice), cutoff_s, False, math.inf)


@dataclasses.dataclass
class KnobIncumbent:
    """The knob search's incumbent: ``best`` (plan, its choice), its time,
    whether it came from a full search (else its planning objective is
    searched again at the end), and the least certified lower bound over the
    choices settled."""

    best: tuple[TrainingPlan, CostChoice] | None
    best_s: float
    searched: bool
    lower: float

    def take(self, best: tuple[TrainingPlan, CostChoice], *, searched: bool) -> None:
        self.best, self.searched = best, searched
        self.best_s = best[0].prediction.iteration_time_s


def interleaved_choices(
    runs: Sequence[tuple[int, CostChoice, str]],
    pool: Mapping[str, int],
    global_batch: int,
    config: MegatronSearchConfig,
    state: KnobIncumbent,
    memo: InterleavedMemo,
    *,
    method: str,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
) -> list[KnobOutcome]:
    """The knob search's interleaved step: each ``(index, choice, rank
    order)`` of ``runs`` searched with the incumbent's time as its cutoff
    (:func:`~pipedejavu.search.megatron.interleaved.search_interleaved`,
    ``memo`` kept over them), ``state`` taking each plan that beats it and
    each search's lower bound; one outcome per run."""
    outcomes = []
    for index, choice, order in runs:
        tick = time.perf_counter()
        found = search_interleaved(
            choice.data,
            choice.model,
            choice.pool(pool),
            global_batch,
            FITTED_CONSTANTS,
            cutoff_s=state.best_s,
            allow_fewer_gpus=config.allow_fewer_gpus,
            mbs_values=config.mbs_values,
            max_plans=config.proof_budget,
            rank_order=order,
            memo=memo,
            progress_fn=tagged_progress(progress_fn, index),
            dp_alone=config.dp_alone,
        )
        state.lower = min(state.lower, found.lower_bound_s)
        cutoff = state.best_s
        options = choice.options
        if found.plan is not None:
            options = dataclasses.replace(options, virtual_stages=found.chunks)
            assert found.prediction is not None
            proof = (
                found.lower_bound_s,
                found.proven,
                found.candidates,
                found.predicted,
                found.time_s,
            )
            plan = objective_free_plan(
                found.plan, found.prediction, proof, choice, options, pool, method
            )
            state.take((plan, choice), searched=True)  # no objective to search
        outcomes.append(
            KnobOutcome(
                options,
                "interleaved",
                math.nan if found.plan is None else state.best_s,
                cutoff,
                found.proven,
                time.perf_counter() - tick,
                order,
            )
        )
    return outcomes


def tagged_progress(
    progress_fn: Callable[[dict[str, Any]], None] | None, index: int
) -> Callable[[dict[str, Any]], None] | None:
    """``progress_fn`` with ``"knobs": index`` added to each report."""
    if progress_fn is None:
        return None

    def tagged(state: dict[str, Any]) -> None:
        progress_fn({**state, "knobs": index})

    return tagged
