"""The sharded plans are searched first and their best time is the cutoff of
the pipelines' proofs (``plan_model``, ``plan_with_knobs(outside_s=...)``):
the answer is the faster of the two spaces, as each searched alone gives it,
and where the sharded plan wins it is proven by the pipelines' certified
bound reaching its time."""

from __future__ import annotations

import math

import pytest

from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.planning.plan_model import default_space, plan_model
from pipedejavu.planning.sharded_search import best_sharded

MODEL = "Llama-3-8B"


@pytest.mark.parametrize(
    "pool, gbs", [({"H100-SXM": 8}, 64), ({"H100-SXM": 16}, 32), ({"A100-80": 8}, 16)]
)
def test_the_sharded_plan_settles_the_pipelines_proofs(pool, gbs):
    full = plan_model(MODEL, pool, gbs)
    pipelines = plan_model(MODEL, pool, gbs, sharded=False)  # searched alone
    choice = choose_cost_source(MODEL, pool)
    sharded = best_sharded(choice, pool, gbs, default_space(choice, None))
    sharded_s = sharded.prediction.iteration_time_s
    pipelines_s = pipelines.result.prediction.iteration_time_s
    assert pipelines.result.proven
    best = full.result.prediction.iteration_time_s
    assert best == min(pipelines_s, sharded_s)
    assert sharded_s < pipelines_s  # (these pools: the sharded plan wins)
    assert full.result.plan.num_stages == 1 and full.result.proven
    assert full.result.predicted_lower_bound_s == pytest.approx(sharded_s, rel=1e-12)
    proofs = [o for o in full.outcomes if o.how in ("proof", "zero-bubble")]
    assert proofs  # the choices step 1 left, settled against the sharded time
    assert all(o.cutoff_s == sharded_s and o.proven for o in proofs)
    assert all(math.isnan(o.best_s) for o in proofs)  # nothing beat it


def test_a_cutoff_below_the_pipelines_leaves_their_plan_unproven():
    """``plan_training(cutoff_s=...)`` below the pipelines' optimum: the
    proof settles every configuration against it, certifies it as the
    bound, and does not call the plan found proven; at the optimum's own
    time it is proven as without a cutoff."""
    from pipedejavu.planning.training import plan_training

    pool, gbs = {"H100-SXM": 8}, 64
    choice = choose_cost_source(MODEL, pool)
    free = plan_training(choice.model, choice.pool(pool), gbs, profiles=choice.data)
    best = free.prediction.iteration_time_s
    assert free.proven and free.predicted_lower_bound_s == pytest.approx(best)
    cut = plan_training(
        choice.model, choice.pool(pool), gbs, profiles=choice.data, cutoff_s=0.9 * best
    )
    assert not cut.proven
    assert cut.predicted_lower_bound_s == pytest.approx(0.9 * best, rel=1e-12)
    assert cut.prediction.iteration_time_s >= best * (1 - 1e-12)
    at = plan_training(
        choice.model, choice.pool(pool), gbs, profiles=choice.data, cutoff_s=best
    )
    assert at.proven and at.prediction.iteration_time_s == best
