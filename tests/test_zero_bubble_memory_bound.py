"""The proof's memory rule under ZB-H1 is the predictor's: every stage of a
pipeline of ``P`` stages holds ``min(P, B)`` micro-batches at its peak
(:func:`~pipedejavu.simulation.zero_bubble.zero_bubble_in_flight`), not
1F1B's ``min(stages after + 1, B)``. Checked against the predictor's peaks on
random plans, and, on small spaces by enumeration, the proof's chains of a
zero-bubble choice are exactly the plans the predictor says fit."""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import numpy as np
from helpers import TINY_GPT, proof_groups

from pipedejavu.baselines.megatron_brute import enumerate_plans
from pipedejavu.core.plan3d import DEFAULT_ZONE
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.search.megatron.bounds import memory_counts
from pipedejavu.search.megatron.certify import group_bounds
from pipedejavu.search.megatron.chains import Incumbent, StageBounds, chains
from pipedejavu.search.megatron.space import ConfigGroup
from pipedejavu.simulation.zero_bubble import zero_bubble_in_flight

#: 4 blocks whose activations at 8192 tokens nearly fill an L4.
TINY = {**TINY_GPT, "name": "tiny-zb", "num_layers": 4, "seq_length": 8192}
TINY["max_position_embeddings"] = 8192


def _zero_bubble(path, pool, seq_length, recompute="none"):
    base = choose_cost_source(path, pool, seq_length=seq_length)
    options = dataclasses.replace(base.options, zero_bubble=True, recompute=recompute)
    return choose_cost_source(path, pool, seq_length=seq_length, options=options)


def test_the_proofs_count_is_the_predictors_on_random_plans():
    """Random ZB-H1 plans (P up to 8, B below, at and above P, and past the
    predictor's direct simulation): every stage's simulated peak is
    ``min(P, B)``, the count the proof's bounds of that size ask."""
    pool = {"H100-SXM": 64}
    choice = _zero_bubble("Llama-3-8B", pool, 2048)
    data, model = choice.data, choice.model
    layers = data.model_info(model).num_layers
    rng = np.random.default_rng(7)
    checked = collections.Counter()
    for _ in range(24):
        stages = int(rng.integers(1, 9))
        tp, dp = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
        steps = int(rng.choice([1, max(stages - 1, 1), stages, stages + 3, 300]))
        cuts = np.sort(rng.choice(np.arange(1, layers), stages - 1, replace=False))
        edges = [0, *cuts.tolist(), layers]
        plan = plan_from_stages(
            [(edges[s], edges[s + 1], tp) for s in range(stages)],
            gpu_type="H100-SXM",
            dp=dp,
            mbs=1,
            gbs=steps * dp,
            model=model,
            gpus_per_node=8,
            zone=DEFAULT_ZONE,
        )
        prediction = predict_plan(plan, data, constants=C)
        held = zero_bubble_in_flight(stages, steps)
        assert prediction.peak_in_flight.tolist() == [held] * stages
        group = ConfigGroup("H100-SXM", 1, dp, steps, (tp,), (stages * tp,))
        bounds = StageBounds(group, {tp: None}, 0.0, zero_bubble=True)
        assert bounds.pipeline(stages * tp).in_flight == held
        checked[(steps > stages, steps > 256)] += 1
    assert len(checked) == 3  # B <= P, P < B, and B past direct simulation
    # 1F1B's bounds, or several degrees: 1F1B's rule alone
    group = ConfigGroup("H100-SXM", 1, 1, 8, (1, 2), (4,))
    two = StageBounds(group, {1: None, 2: None}, 0.0, zero_bubble=True)
    assert two.pipeline(4) is two and two.in_flight == 0


def _spaces(tmp_path):
    path = tmp_path / "tiny-zb.json"
    path.write_text(json.dumps(TINY))
    return [
        (str(path), {"L4": 4}, 4, "none"),
        (str(path), {"L4": 8}, 8, "none"),
        (str(path), {"L4": 8}, 16, "full"),
    ]


def test_zero_bubble_chains_are_exactly_the_fitting_plans(tmp_path):
    """Every plan of small ZB-H1 spaces (TP 1 and 2, B from 1 to 16, with and
    without recomputation) predicted: per configuration and pipeline size,
    the proof enumerates (below an infinite incumbent) exactly the chains
    whose plans fit, and its memory counts say which stage counts have
    one."""
    compared = differ_1f1b = 0
    for path, pool, gbs, recompute in _spaces(tmp_path):
        choice = _zero_bubble(path, pool, 8192, recompute)
        data, model, pool = choice.data, choice.model, choice.pool(pool)
        fitting, every = collections.defaultdict(set), collections.defaultdict(set)
        for plan, _ in enumerate_plans(data, model, pool, gbs, C):
            tp = plan.stages[0].replicas[0].tp
            key = (plan.stages[0].replicas[0].gpu_type, plan.mbs, plan.dp, tp)
            key = (*key, tp * plan.num_stages)
            stages = tuple((s.start, s.stop, tp) for s in plan.stages)
            every[key].add(stages)
            if predict_plan(plan, data, constants=C).fits_memory:
                fitting[key].add(stages)
        for group in proof_groups(data, model, pool, gbs):
            (t,) = group.tps
            counts = memory_counts(data, model, C, group)
            for size, (bounds, g) in group_bounds(data, model, C, group).items():
                key = (group.gpu, group.mbs, group.dp, t, size)
                assert every[key]  # the same space
                found = {
                    tuple(map(tuple, c))
                    for c in chains(bounds, g, size, Incumbent(math.inf))
                }
                assert found == fitting[key], key
                assert bool(counts[size // t]) == bool(fitting[key]), key
                compared += 1
                # 1F1B's rule lets more through
                loose = StageBounds(group, bounds.tables, bounds.overhead)
                more = {
                    tuple(map(tuple, c))
                    for c in chains(
                        loose, loose.bottleneck(size), size, Incumbent(math.inf)
                    )
                }
                assert found <= more
                differ_1f1b += found != more
    assert compared >= 100 and differ_1f1b >= 20
