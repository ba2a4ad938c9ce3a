"""How flat ZB-H1's predicted times are around the best plan of a large pool
(issue 47's 16,384-GPU proof): Llama-3.1-405B on 16,384 H100, global batch
1,024, planned with the proof; then, in the chosen plan's configuration
(its knobs, TP, DP, pipeline size and placement):

* the plan of equal stages (what the search chose before its open proof's
  plan was polished) and the planner's plan, predicted;
* the polish (``search/megatron/polish.py``) from random chains: where it ends;
* random chains near equal stages (each stage 7, 8 or 9 layers) and near
  the planner's plan (one to four layers moved): how many predict within
  0.1%, 0.6% and 1% of the plan (or faster), and how close the proof's path
  bound of each chain comes to its prediction;
* the configuration's least bound (what the proof starts from).

    python benchmarks/zero_bubble_landscape.py [--samples N] [--out FILE]

Writes ``benchmarks/results/zero_bubble_landscape.json`` with date and machine.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import stamp

from pipedejavu.core.plan3d import RANK_ORDERS
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.planning.any_model import choose_cost_source
from pipedejavu.planning.plan_model import plan_model
from pipedejavu.search.megatron.bounds import stage_bounds
from pipedejavu.search.megatron.chains import StageBounds
from pipedejavu.search.megatron.polish import polish_cuts, with_sizes
from pipedejavu.search.megatron.space import ConfigGroup

MODEL, GPU, GPUS, BATCH = "Llama-3.1-405B", "H100-SXM", 16384, 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--restarts", type=int, default=4)
    parser.add_argument(
        "--out", default=str(stamp.RESULTS / "zero_bubble_landscape.json")
    )
    args = parser.parse_args()
    started = time.perf_counter()
    pool = {GPU: GPUS}
    knobs = plan_model(MODEL, pool, BATCH)
    planned_s = time.perf_counter() - started
    plan = knobs.result.plan
    choice = choose_cost_source(MODEL, pool, options=knobs.result.options)
    best = knobs.result.prediction.iteration_time_s

    def predict(candidate) -> float:
        prediction = predict_plan(candidate, choice.data, constants=C)
        return prediction.iteration_time_s if prediction.fits_memory else math.inf

    sizes = [stage.num_layers for stage in plan.stages]
    count, layers = len(sizes), sum(sizes)
    tp = plan.stages[0].replicas[0].tp
    order = knobs.rank_order or RANK_ORDERS[0]  # (the proof's names)
    print(stamp.header())
    print(
        f"planned in {planned_s:.0f} s: {best:.4f} s, stages {sizes}, TP {tp}, "
        f"DP {plan.dp}, {plan.num_microbatches} micro-batches, {order}"
    )
    equal = np.diff(np.linspace(0, layers, count + 1).round().astype(int)).tolist()
    equal_s = predict(with_sizes(plan, equal))
    print(f"equal stages {equal}: {equal_s:.4f} s")

    group = ConfigGroup(
        GPU, plan.mbs, plan.dp, plan.num_microbatches, (tp,), (count * tp,)
    )
    tables = stage_bounds(choice.data, choice.model, C, group, rank_order=order)
    bounds = StageBounds(group, tables, C.op_overhead_s, zero_bubble=True)
    pipeline = bounds.pipeline(count * tp)
    least = pipeline.least(pipeline.bottleneck(count * tp), count * tp, np.inf)
    paths = pipeline.paths(count * tp)
    print(f"configuration's least bound {least:.4f} s")

    rng = np.random.default_rng(0)
    restarts = []
    while len(restarts) < args.restarts:
        start = 8 + rng.integers(-2, 3, count)
        start[-1] += layers - start.sum()
        if start.min() < 1:
            continue
        start_plan = with_sizes(plan, start.tolist())
        start_s = predict(start_plan)
        if not math.isfinite(start_s):
            continue
        end, end_s, used = polish_cuts(start_plan, start_s, predict, 5000)
        restarts.append(
            {
                "start": start.tolist(),
                "start_s": start_s,
                "end_s": end_s,
                "end": [s.num_layers for s in end.stages],
                "predictions": used,
            }
        )
        print(
            f"polish from {start.tolist()}: {start_s:.4f} -> {end_s:.4f} s "
            f"({used} predictions)"
        )

    def sample(draw) -> dict:
        """Predictions and path bounds of ``args.samples`` chains ``draw()``
        gives (``None``: none this time)."""
        found = []
        while len(found) < args.samples:
            sizes_drawn = draw()
            if sizes_drawn is None:
                continue
            time_s = predict(with_sizes(plan, sizes_drawn))
            if math.isfinite(time_s):
                edges = [0, *np.cumsum(sizes_drawn).tolist()]
                found.append((time_s, paths.chain(edges)))
        times = np.array([t for t, _ in found])
        ratio = np.array([b / t for t, b in found])
        over = times / best - 1
        return {
            "chains": len(found),
            "within": {f"{p}%": float(np.mean(over < p / 100)) for p in (0.1, 0.6, 1)},
            "faster": int(np.sum(over < 0)),
            "median_slower": float(np.median(over)),
            "path_bound_over_prediction": {
                "median": float(np.median(ratio)),
                "least": float(ratio.min()),
                "most": float(ratio.max()),
            },
        }

    def near_equal():
        drawn = 8 + rng.choice([-1, 0, 1], count, p=[0.15, 0.7, 0.15])
        return drawn.tolist() if drawn.sum() == layers else None

    def near_plan():
        drawn = list(sizes)
        for _ in range(int(rng.integers(1, 5))):
            source, target = rng.choice(count, 2, replace=False)
            if drawn[source] < 2:
                return None
            drawn[source] -= 1
            drawn[target] += 1
        return drawn

    samples = {}
    for name, draw, what in (
        ("near_equal", near_equal, "stages of 7-9 layers"),
        ("near_plan", near_plan, "1-4 random layer moves from the plan"),
    ):
        samples[name] = found = sample(draw)
        print(
            f"{found['chains']} chains, {what}: within {found['within']} of the "
            f"plan, {found['faster']} faster; slower by "
            f"{found['median_slower']:.2%} (median); path bound / prediction "
            f"{found['path_bound_over_prediction']}"
        )
    stamp.write_opened(
        args.out,
        "zero_bubble_landscape",
        started,
        {
            "model": MODEL,
            "gpus": {GPU: GPUS},
            "global_batch": BATCH,
            "planned_s": planned_s,
            "plan_s": best,
            "plan_stages": sizes,
            "tp": tp,
            "dp": plan.dp,
            "microbatches": plan.num_microbatches,
            "rank_order": order,
            "proven": bool(knobs.result.proven),
            "lower_bound_s": knobs.result.predicted_lower_bound_s,
            "equal_stages": equal,
            "equal_stages_s": equal_s,
            "configuration_least_bound_s": least,
            "restarts": restarts,
            "samples": samples,
        },
    )


if __name__ == "__main__":
    main()
