"""Brute force over every Megatron-style plan of a small setting.

Independent of the DP on purpose: plain enumeration of (mbs, dp, GPUs, a TP
degree per stage, every contiguous split), each plan scored on the same stage
tables as the search (:func:`pipedejavu.costmodel.megatron.tables.compile_tables`)
by ``sum c + (B - 1) max c + max tail`` with the memory rule, or by the full
predictor (``score="predictor"``). Only for a few GPUs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping

from pipedejavu.core.layout import experts_fit
from pipedejavu.core.plan3d import DEFAULT_ZONE, RANK_ORDERS, Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import (
    compile_tables,
    plan_from_stages,
    stage_entry,
)

__all__ = ["brute_force_megatron", "enumerate_plans"]


def _splits(num_layers: int, num_stages: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        yield (0, *cuts, num_layers)


def _tables(cache, data, model, constants, gpu, mbs, dp, steps, tps, pipeline_gpus):
    """The stage tables with the search's placement rule: one node, or
    boundaries priced as crossing nodes."""
    one = dp * pipeline_gpus <= data.gpu_spec(gpu).gpus_per_node
    key = (gpu, mbs, dp, one)
    if key not in cache:
        cache[key] = compile_tables(
            data,
            model,
            constants,
            gpu_type=gpu,
            mbs=mbs,
            dp=dp,
            num_microbatches=steps,
            tps=tps,
            zone=DEFAULT_ZONE,
            pipeline_gpus=pipeline_gpus if one else None,
        )
    return cache[key]


def enumerate_plans(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    *,
    uniform_tp: bool = True,
    max_plans: int = 200_000,
    max_stages: int | None = None,
    rank_order: str = RANK_ORDERS[0],
) -> Iterator[tuple[Plan3D, float]]:
    """Every plan of the search space (at most ``max_stages`` stages) with its
    planning objective (``inf`` when a stage breaks the memory rule), placed
    in ``rank_order`` (the objective is the default order's)."""
    info = data.model_info(model)
    layers = info.num_layers
    count = 0
    cache: dict = {}
    for gpu, available in gpus.items():
        spec = data.gpu_spec(gpu)
        table = data.profile(model, gpu)
        for mbs in sorted({m for m, _ in table}):
            if global_batch % mbs:
                continue
            tps = [
                t
                for t in info.tp_values
                if (mbs, t) in table and spec.gpus_per_node % t == 0
            ]
            for dp in range(1, available + 1):
                if (global_batch // mbs) % dp or not tps:
                    continue
                fitting = [t for t in tps if experts_fit(t, 1, dp, *info.expert_axes)]
                steps = global_batch // (mbs * dp)
                budget = available // dp
                most = min(layers, budget, max_stages or layers)
                for num_stages in range(1, most + 1):
                    degree_sets = (
                        [(t,) * num_stages for t in fitting]
                        if uniform_tp
                        else itertools.product(fitting, repeat=num_stages)
                    )
                    for degrees in degree_sets:
                        if sum(degrees) > budget:
                            continue
                        tables = _tables(
                            cache,
                            data,
                            model,
                            constants,
                            gpu,
                            mbs,
                            dp,
                            steps,
                            tps,
                            sum(degrees),
                        )
                        for split in _splits(layers, num_stages):
                            count += 1
                            if count > max_plans:
                                raise ProblemError(
                                    f"more than {max_plans} plans: too large for "
                                    "brute force"
                                )
                            yield _score(
                                tables,
                                split,
                                degrees,
                                steps,
                                gpu,
                                dp,
                                mbs,
                                global_batch,
                                model,
                                spec.gpus_per_node,
                                rank_order,
                                info.expert_axes,
                            )


def _score(
    tables, split, degrees, steps, gpu, dp, mbs, gbs, model, gpn, order, experts
):
    num_stages = len(degrees)
    costs, tails = [], []
    feasible = True
    for s, (start, stop, tp) in enumerate(zip(split, split[1:], degrees, strict=False)):
        m = tables.tps.index(tp)
        after = num_stages - 1 - s
        cost, tail, fits = stage_entry(tables, start, stop - 1, m, after)
        costs.append(cost)
        tails.append(tail)
        feasible = feasible and fits
    value = (
        math.fsum(costs) + (steps - 1) * max(costs) + max(tails)
        if feasible
        else math.inf
    )
    plan = plan_from_stages(
        [(a, b, t) for a, b, t in zip(split, split[1:], degrees, strict=False)],
        gpu_type=gpu,
        dp=dp,
        mbs=mbs,
        gbs=gbs,
        model=model,
        gpus_per_node=gpn,
        zone=DEFAULT_ZONE,
        experts=experts,
        rank_order=order,
    )
    return plan, value


def brute_force_megatron(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    *,
    uniform_tp: bool = True,
    score: str = "objective",
    max_plans: int = 200_000,
) -> tuple[Plan3D, float]:
    """The best plan and its score (``"objective"`` or ``"predictor"``; the
    predictor scores only plans that fit in memory)."""
    best: tuple[Plan3D | None, float] = (None, math.inf)
    for plan, value in enumerate_plans(
        data,
        model,
        gpus,
        global_batch,
        constants,
        uniform_tp=uniform_tp,
        max_plans=max_plans,
    ):
        if not math.isfinite(value):
            continue
        if score == "predictor":
            prediction = predict_plan(plan, data, constants=constants)
            value = prediction.iteration_time_s if prediction.fits_memory else math.inf
        if value < best[1]:
            best = (plan, value)
    if best[0] is None:
        raise ProblemError("no plan fits")
    return best[0], best[1]
