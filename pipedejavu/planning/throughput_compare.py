"""Pollux's data-parallel throughput model fitted to our predictor's step times.

Pollux (AdaptDL) learns seven parameters (:class:`~pipedejavu.costmodel.
goodput_model.PerfParams`) from observed step times. Here the observations come
from our predictor (:func:`pipedejavu.costmodel.megatron.predictor.predict_plan`) for
Megatron-style plans of one GPU type, in AdaptDL's terms: with ``m``
micro-batches per iteration, ``accum_step_time`` is the compute of one
micro-batch (the predicted pipeline time / ``m``) and ``optim_step_time`` the
iteration minus ``m - 1`` of them (the last micro-step, the gradient all-reduce,
the optimizer). Pollux predicts the iteration as
``predict_step_time(params, nodes, replicas, mbs, m - 1)``; for a pipeline,
``replicas`` is its data-parallel degree (Pollux has no stage count).

:func:`predictor_observations` makes the observations, :func:`heldout_errors`
fits on one part and reports the error on another. ``benchmarks/
pollux_vs_predictor.py`` runs the comparison.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipedejavu.core.plan3d import DEFAULT_ZONE
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.costmodel.megatron.tables import plan_from_stages

__all__ = ["balanced_stages", "heldout_errors", "predictor_observations"]


def balanced_stages(num_layers: int, num_stages: int) -> list[tuple[int, int, int]]:
    """``num_stages`` contiguous ``(start, stop, tp=1)`` stages of near-equal size."""
    if not 1 <= num_stages <= num_layers:
        raise ProblemError(
            f"num_stages must be in [1, {num_layers}] (the layers), got {num_stages}"
        )
    bounds = np.linspace(0, num_layers, num_stages + 1).round().astype(int)
    return [(int(a), int(b), 1) for a, b in itertools.pairwise(bounds)]


def predictor_observations(
    model: str,
    gpu_type: str,
    num_stages: int,
    dps: Sequence[int],
    mbs_values: Sequence[int],
    microbatch_counts: Sequence[int],
    *,
    data: Any = None,
) -> list[dict[str, Any]]:
    """Our predictor's times for every plan of the grid, as Pollux observes them.

    Plans: ``num_stages`` balanced stages at TP 1, each ``dp`` x ``mbs`` x ``m``
    (global batch ``dp x mbs x m``), canonically placed on ``gpu_type`` nodes;
    plans that need an unprofiled (mbs, tp) or exceed memory are left out.

    Returns:
        One dict per plan: ``nodes``, ``replicas`` (= dp), ``mbs``,
        ``microbatches``, ``accum_step_time``, ``optim_step_time``,
        ``iteration_s`` (seconds) and the plan's ``model`` and ``stages``.
    """

    data = load_sailor_data() if data is None else data
    layers = data.model_info(model).num_layers
    gpn = data.gpu_spec(gpu_type).gpus_per_node
    stages = balanced_stages(layers, num_stages)
    profiled = {m for m, t in data.profile(model, gpu_type) if t == 1}
    rows = []
    for dp, mbs, m in itertools.product(dps, mbs_values, microbatch_counts):
        if mbs not in profiled:
            continue
        plan = plan_from_stages(
            stages,
            gpu_type=gpu_type,
            dp=dp,
            mbs=mbs,
            gbs=dp * mbs * m,
            model=model,
            gpus_per_node=gpn,
            zone=DEFAULT_ZONE,
            experts=data.model_info(model).expert_axes,
        )
        prediction = predict_plan(plan, data)
        if not prediction.fits_memory:
            continue
        total = prediction.iteration_time_s
        accum = prediction.to_json()["breakdown"]["pipeline_s"] / m
        rows.append(
            {
                "model": model,
                "stages": num_stages,
                "nodes": math.ceil(num_stages * dp / gpn),
                "replicas": dp,
                "mbs": mbs,
                "microbatches": m,
                "accum_step_time": accum,
                "optim_step_time": total - (m - 1) * accum,
                "iteration_s": total,
            }
        )
    return rows


def _arrays(rows, *keys):
    return [np.array([r[k] for r in rows], dtype=np.float64) for k in keys]


def heldout_errors(
    train: Sequence[dict], test: Sequence[dict]
) -> tuple[Any, np.ndarray, np.ndarray, float]:
    """Fit Pollux on ``train``; its relative errors against our predictor.

    Returns:
        ``(perf_params, train_errors, test_errors, fit_seconds)``; errors are
        ``|Pollux / ours - 1|`` of the iteration time, one per plan.
    """
    from pipedejavu.costmodel.goodput.fit import fit_perf_params
    from pipedejavu.costmodel.goodput.model import predict_step_time

    if not train or not test:
        raise ProblemError("heldout_errors needs plans to fit on and to test on")
    nodes, reps, mbs, acc, opt = _arrays(
        train, "nodes", "replicas", "mbs", "accum_step_time", "optim_step_time"
    )
    started = time.perf_counter()
    params = fit_perf_params(nodes, reps, mbs, acc, opt)
    fit_s = time.perf_counter() - started

    def errors(rows):
        n, r, a, m, t = _arrays(
            rows, "nodes", "replicas", "mbs", "microbatches", "iteration_s"
        )
        predicted = np.asarray(predict_step_time(params, n, r, a, m - 1))
        return np.abs(predicted / t - 1)

    return params, errors(train), errors(test), fit_s
