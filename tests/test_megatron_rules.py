"""One definition of each predictor rule (``costmodel/megatron/rules.py``): a
changed constant reaches the prediction, the planning tables and the proof's
bounds together, and the proven optimum follows it (brute force)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import largest_stage_bound, proof_groups

from pipedejavu.baselines.megatron_brute import brute_force_megatron
from pipedejavu.core.plan3d import Plan3D, Replica
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.comm import ring_allreduce_time
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.predictor import Prediction, predict_plan
from pipedejavu.costmodel.megatron.rules import (
    gradient_sync,
    in_flight_capacity,
    least_gradient_sync,
    memory_bytes,
    overlap_bucket_elements,
)
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.sheet_network import SheetNetwork
from pipedejavu.costmodel.megatron.tables import plan_tables
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.search.megatron.bounds import stage_bounds
from pipedejavu.search.megatron.chains import StageBounds
from pipedejavu.search.megatron.planner import search_megatron

DATA = SailorData()
MODEL, POOL, GBS = "OPT-350", {"RTX-2080": 4}, 8


def _tables_fit(plan: Plan3D, constants: PredictorConstants) -> bool:
    """The plan passes the tables' memory rule (``max_n_succ_stages``)."""
    tables, spans = plan_tables(DATA, MODEL, constants, plan)
    return all(
        plan.num_stages - 1 - s <= tables.max_n_succ_stages[a, b, m, 0]
        for s, (a, b, m) in enumerate(spans)
    )


def _proof_bound(plan: Plan3D, constants: PredictorConstants) -> float:
    """The proof's largest stage bound of the plan (``inf``: a stage fails the
    memory test its position asks for)."""
    first = plan.stages[0].replicas[0]
    (group,) = [
        g
        for g in proof_groups(DATA, MODEL, POOL, GBS)
        if (g.gpu, g.mbs, g.dp, g.tps)
        == (first.gpu_type, plan.mbs, plan.dp, (first.tp,))
    ]
    bounds = StageBounds(
        group, stage_bounds(DATA, MODEL, constants, group), constants.op_overhead_s
    )
    return largest_stage_bound(bounds, plan)


def _just_too_tight(name: str, prediction: Prediction) -> PredictorConstants:
    """Constants under which the predicted memory of the plan's fullest GPU
    exceeds its device memory by 1 MB (the other constants unchanged)."""
    s, j = np.unravel_index(
        np.argmin(prediction.memory_limit_bytes - prediction.memory_bytes),
        prediction.memory_bytes.shape,
    )
    limit = float(prediction.memory_limit_bytes[s, j])
    excess = limit + 1e6 - float(prediction.memory_bytes[s, j])
    if name == "reserve_bytes":
        gpu = next(iter(POOL))
        reserve = C.reserve(gpu) + excess
        return dataclasses.replace(C, reserve_bytes=((gpu, reserve),))
    stash = (1.0 + C.activation_overhead) * float(prediction.activation_bytes[s])
    overhead = (stash + excess) / float(prediction.activation_bytes[s]) - 1.0
    return dataclasses.replace(C, activation_overhead=overhead)


@pytest.mark.parametrize("name", ["reserve_bytes", "activation_overhead"])
def test_changed_constant_reaches_prediction_tables_and_proof(name):
    """The proven optimum under the fitted constants fits with a margin; a
    constant raised until it no longer fits by 1 MB: the prediction, the
    tables and the proof's bounds all drop it, and the proof under the new
    constant finds the brute-force optimum (another plan)."""
    base = search_megatron(DATA, MODEL, POOL, GBS, C)
    plan = base.plan
    assert base.proven and base.prediction.fits_memory
    assert _tables_fit(plan, C) and math.isfinite(_proof_bound(plan, C))
    tight = _just_too_tight(name, base.prediction)
    assert getattr(tight, name) != getattr(C, name)
    assert not predict_plan(plan, DATA, constants=tight).fits_memory
    assert not _tables_fit(plan, tight)
    assert _proof_bound(plan, tight) == math.inf
    moved = search_megatron(DATA, MODEL, POOL, GBS, tight)
    _, best = brute_force_megatron(DATA, MODEL, POOL, GBS, tight, score="predictor")
    assert moved.proven and moved.plan != plan
    assert moved.prediction.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert moved.prediction.iteration_time_s > base.prediction.iteration_time_s


def test_capacity_is_the_inverse_of_the_memory_rule():
    """``in_flight_capacity`` is the most micro-batches whose ``memory_bytes``
    fits, for random states and stashes and both constants."""
    rng = np.random.default_rng(3)
    gpu, limit = "RTX-2080", 11.8e9
    for constants in (C, dataclasses.replace(C, activation_overhead=0.5)):
        for _ in range(200):
            state, stash = rng.uniform(0, 8e9), rng.uniform(1e6, 1e9)
            n = int(in_flight_capacity(limit, state, stash, constants, gpu))
            if n >= 0:
                assert memory_bytes(state, n * stash, constants, gpu) <= limit
            assert memory_bytes(state, (n + 1) * stash, constants, gpu) > limit * (
                1 - 1e-12
            )


@pytest.mark.parametrize(("tp", "members"), [(1, 8), (2, 4), (4, 2), (1, 4)])
def test_ring_allreduce_inside_a_node_runs_at_each_gpus_link(tp, members):
    """A ring inside one node of a flat sheet link (every GPU sends at its own
    NVLink bandwidth) takes 2 (n - 1) steps of bytes / n at that bandwidth:
    the aggregate of the node's GPUs is shared by their pairs. (It was priced
    at the aggregate times the pairs' share inverted: 16x too fast with 8
    GPUs on the node.)"""
    sheet = load_gpu_sheet()
    gpu = sheet.resolve("H100")
    network = SheetNetwork(sheet)
    replicas = [Replica(gpu, tp, node=0)] * members
    nbytes = 2e9
    seconds = ring_allreduce_time(network, replicas, [0] * members, nbytes)
    link = sheet[gpu].intra_node_bytes_per_s
    expected = 2 * (members - 1) * (nbytes / members) / link
    assert seconds == pytest.approx(expected, rel=1e-12)


def test_gradient_sync_waits_for_what_outlasts_its_pass():
    """Without overlap the whole all-reduce; with the distributed optimizer a
    reduce-scatter (half its time) and an all-gather of the weights (bf16:
    half the bytes of the fp32 gradients); overlapped, what outlasts the pass
    it runs beside, never less than the last bucket's share; the bounds'
    infinite passes give exactly that share, below any finite pass."""

    def sync(backward, forward, *, held=4e8, precision="fp32", **flags):
        options = TrainingOptions(precision, **flags)
        return gradient_sync(1.0, held, 8, backward, forward, options)

    both = dict(
        distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    assert overlap_bucket_elements(8) == 4e7 and overlap_bucket_elements(64) == 6.4e7
    assert sync(5.0, 5.0) == 1.0  # plain all-reduce
    assert sync(5.0, 5.0, distributed_optimizer=True) == 1.0  # fp32: 0.5 + 0.5
    assert sync(5.0, 5.0, precision="bf16", distributed_optimizer=True) == 0.75
    assert sync(5.0, 5.0, precision="fp16", distributed_optimizer=True) == 1.0
    assert sync(0.0, 0.0, **both) == 1.0  # nothing to hide behind
    assert sync(0.2, 0.1, **both) == pytest.approx(0.3 + 0.4)  # 0.5 - 0.2, 0.5 - 0.1
    assert sync(5.0, 5.0, **both) == pytest.approx(0.1)  # the last bucket: 4e7 of 4e8
    assert sync(np.inf, np.inf, **both) == pytest.approx(0.1)
    options = TrainingOptions("fp32", **both)
    assert least_gradient_sync(1.0, 4e8, 8, options) == sync(np.inf, np.inf, **both)
    grad_only = dict(distributed_optimizer=True, overlap_grad_reduce=True)
    assert sync(5.0, 0.0, **grad_only) == pytest.approx(0.05 + 0.5)
    assert sync(5.0, 5.0, overlap_grad_reduce=True) == pytest.approx(0.1)
    assert sync(5.0, 5.0, held=1e6, **both) == 1.0  # one bucket: nothing overlaps
    windows = np.linspace(0.0, 2.0, 41)
    values = sync(windows, windows, **both)
    assert (np.diff(values) <= 0).all() and (
        values >= sync(np.inf, np.inf, **both)
    ).all()
