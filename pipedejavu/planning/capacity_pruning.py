"""Which candidates of a capacity question need not be planned to the end.

A pool ``P`` is neither the choice nor on the Pareto frontier when a
planned pool ``Q`` trains no slower than any plan of ``P`` can and costs
less than any plan of ``P`` can (the choice, with a deadline the least cost
among the pools that meet it, and with a budget the least time within it,
is a frontier point). Two certified facts bound the plans of ``P``:

* **cost**: every GPU of a plan is busy at least its layers' forward and
  backward passes, so a plan costs at least the least GPU-seconds of the
  model's layers in one iteration (``tp x cp x global batch / mbs`` times a
  layer's time on one GPU, the least over every TP degree, micro-batch,
  context parallelism and knob choice the search prices, without
  recomputation, which only adds to the backward: the busy-time rule of the
  pipeline proofs, :func:`~pipedejavu.search.megatron.certify.least_work`)
  times the iterations and the price of the GPU type doing it (a pool of
  several types: each layer on its cheapest type). This floor does not
  depend on the GPU count.
* **time**: the search of ``P`` with a cutoff ``c``
  (:func:`~pipedejavu.planning.plan_model.plan_model`'s ``cutoff_s``)
  certifies a lower bound on every plan's time; once it reaches ``c`` the
  search stops.

The cutoff of ``P`` is the least time to train of a planned pool whose cost
is below ``P``'s floor (:func:`cutoff_of`); the pools are planned cheapest
floor first, so the pools that cut the others are planned early. A pool
whose bound reaches its cutoff is *dominated*. At the end every outcome is
judged against the final frontier alone (:func:`settle`): a pool is
dominated when its certified bound reaches the least time of a frontier pool
costing less than its floor, whichever cutoff its search was given, so the
answer is the same in any order, on any number of workers (for every pool
proven: a search that ran out of its budget keeps the bound it reached).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.planning.any_model import CostChoice, choose_cost_source
from pipedejavu.planning.plan_model import default_space
from pipedejavu.planning.pool_planning import planning_options, tokens_per_sample
from pipedejavu.planning.sharded_search import least_sharded_work

__all__ = [
    "Floors",
    "TypeWork",
    "cutoff_of",
    "dominates",
    "least_pipeline_work",
    "least_work_by_type",
    "pool_floors",
]


def least_pipeline_work(
    model: str, first: CostChoice, gpu: str, global_batch: int, **options
) -> NDArray[np.float64]:
    """Per layer, the least GPU-seconds of one iteration of any pipeline plan
    on ``gpu`` (module docstring): over every knob choice of the default
    space of ``first`` (``model``'s source on ``gpu``, priced with
    ``options``; their zero-bubble forms too), every ``(mbs, tp)`` its
    source prices with ``mbs`` dividing ``global_batch``."""
    knobs = default_space(first).choices(first.options)
    knobs += [dataclasses.replace(k, zero_bubble=True) for k in knobs]
    fixed = {k: v for k, v in options.items() if k != "precision"}
    best = None
    for chosen in knobs:
        choice = choose_cost_source(model, [gpu], options=chosen, **fixed)
        name = choice.gpu_types[gpu]
        for mbs, tp in choice.data.profile(choice.model, name):
            if global_batch % mbs:
                continue
            times = choice.data.layer_times(
                choice.model, name, mbs, tp, smooth=FITTED_CONSTANTS.smooth_profiles
            )
            work = tp * (global_batch // mbs) * (times.forward + times.backward)
            best = work if best is None else np.minimum(best, work)
    if best is None:
        raise ProblemError(f"{model}: no micro-batch divides the global batch")
    return best


@dataclasses.dataclass(frozen=True)
class TypeWork:
    """A GPU type's least GPU-seconds per iteration, per layer: of any
    pipeline plan, and of any sharded plan (``None``: none is searched)."""

    pipeline: NDArray[np.float64]
    sharded: NDArray[np.float64] | None


def least_work_by_type(
    model: str, types: Sequence[str], global_batch: int, **options
) -> dict[str, TypeWork] | None:
    """:class:`TypeWork` of each type ``model`` is priced on (``options`` as
    :func:`~pipedejavu.planning.pool_planning.plan_pool` takes them); ``None``
    for a mixture of experts (its expert layouts are searched to the end)."""
    out = {}
    for gpu in types:
        try:
            choice = choose_cost_source(model, [gpu], **options)
            if choice.spec is not None and choice.spec.moe is not None:
                return None
            sharded = None
            if choice.analytical and not choice.measured:
                sharded = least_sharded_work(choice, global_batch)
            pipeline = least_pipeline_work(model, choice, gpu, global_batch, **options)
        except ProblemError:
            continue  # (not priced: bounds nothing)
        out[gpu] = TypeWork(pipeline, sharded)
    return out


@dataclasses.dataclass(frozen=True)
class Floors:
    """The floors of a question's pools.

    Attributes:
        cost: per pool, the least any of its plans costs (module docstring;
            0: not bounded).
        iterations: the iterations of the training.
    """

    cost: tuple[float, ...]
    iterations: int


def pool_floors(question: Any, pools: Sequence[Mapping[str, int]]) -> Floors:
    """Each pool's cost floor for a capacity ``question`` (module docstring):
    a pool of one type, the lesser of its pipeline and sharded floors; of
    several types (pipelines only), each layer on the type where its
    GPU-seconds cost least. A type the model cannot be priced on bounds
    nothing (its pools are refused before planning)."""
    options = planning_options(question)
    types = list(dict.fromkeys(gpu for pool in pools for gpu in pool))
    choice = None
    for gpu in types:
        try:
            choice = choose_cost_source(question.model, [gpu], **options)
            break
        except ProblemError:
            continue
    if choice is None:
        return Floors((0.0,) * len(pools), 1)
    samples = question.global_batch * tokens_per_sample(question.seq_length, choice)
    iterations = math.ceil(question.tokens / samples)
    work = least_work_by_type(question.model, types, question.global_batch, **options)
    cost = []
    for pool in pools:
        if work is None or any(gpu not in work for gpu in pool):
            cost.append(0.0)
            continue
        hourly = {gpu: question.prices.price(gpu) / 3600.0 for gpu in pool}
        per_layer = np.min([work[g].pipeline * hourly[g] for g in pool], axis=0)
        floor = float(per_layer.sum())
        if len(pool) == 1:
            ((gpu, _),) = pool.items()
            if work[gpu].sharded is not None:
                floor = min(floor, float((work[gpu].sharded * hourly[gpu]).sum()))
        cost.append(floor * iterations)
    return Floors(tuple(cost), iterations)


def cutoff_of(
    floor: float, known: Sequence[tuple[float, float, int]]
) -> tuple[float, int]:
    """``(time, index)`` of the fastest of ``known`` ``(time to train, cost,
    index)`` points costing less than ``floor`` (ties: the first index;
    ``(inf, -1)``: none): a pool none of whose plans trains faster, and all
    of whose plans cost at least ``floor``, is dominated by it."""
    best = (math.inf, -1)
    for time_s, cost, index in known:
        if cost < floor and (time_s, index) < best:
            best = (time_s, index)
    return best


def dominates(lower_train_s: float, cutoff_s: float) -> bool:
    """A pool's certified least time to train reaches the cutoff (exactly,
    no tolerance: the pool trains no sooner than the one that beats it)."""
    return math.isfinite(cutoff_s) and lower_train_s >= cutoff_s
