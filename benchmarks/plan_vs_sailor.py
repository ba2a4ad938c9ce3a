"""Our planner against Sailor's on Sailor's planning settings, by our predictor.

Settings (the issue's): OPT-350M on 16, 32, 64, 128 GH-96 GPUs with gbs 64, 512,
1024, 1024; GPT-Neo-2.7B on 64, 128, 256 GH-96 GPUs with gbs 1024; OPT-350M on
the RTX cluster of the measured runs (8 RTX-3090, 16 Titan-RTX, 24 RTX-2080)
with gbs 256 and 288. For each: our plan (exact method), its predicted time,
the planning optimum and bound, whether the plan is proven the predictor's
optimum (or its certified gap), our search time with the proof (cold: first
call in the process, profiles read; warm: again); Sailor's chosen plan where
the issue gives it, predicted by our predictor, and Sailor's own predicted
time and search time from the issue; the measured runs of the same setting in
the bundled data (each predicted by us, and the best measured time); on the
pools of several types, also the plan with ``mixed_types`` (stages on different
types), its certified gap and search time.

Usage::

    python benchmarks/plan_vs_sailor.py [--diff] \
        [--out benchmarks/results/plan_vs_sailor.json]
"""

from __future__ import annotations

import argparse
import time

import stamp

from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.fit import load_measured_runs
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.planning.training import plan_training
from pipedejavu.search.megatron.space import type_plan

RTX = {"RTX-3090": 8, "Titan-RTX": 16, "RTX-2080": 24}
#: (model, pool, gbs, Sailor's plan: (stages as (start, stop), tp, dp, mbs),
#:  Sailor's predicted time, Sailor's search time) from the issue.
SETTINGS = [
    ("OPT-350", {"GH-96": 16}, 64, ([(0, 26)], 4, 4, 8), 0.50, 0.77),
    ("OPT-350", {"GH-96": 32}, 512, ([(0, 13), (13, 26)], 1, 16, 2), 1.63, 0.94),
    ("OPT-350", {"GH-96": 64}, 1024, ([(0, 13), (13, 26)], 1, 32, 2), 1.64, 1.21),
    ("OPT-350", {"GH-96": 128}, 1024, ([(0, 13), (13, 26)], 1, 64, 2), 0.91, 1.45),
    ("GPT-Neo-2.7", {"GH-96": 64}, 1024, None, None, None),
    ("GPT-Neo-2.7", {"GH-96": 128}, 1024, None, None, None),
    ("GPT-Neo-2.7", {"GH-96": 256}, 1024, None, None, None),
    ("OPT-350", RTX, 256, None, None, None),
    ("OPT-350", RTX, 288, None, None, None),
]


def _measured(model, pool, gbs):
    """Measured runs of this model and gbs on this pool's GPU types and count."""
    out = []
    for run in load_measured_runs():
        plan = run.plan
        same_types = set(plan.gpus_by_type()) <= set(pool)
        if (
            plan.model == model
            and plan.gbs == gbs
            and same_types
            and not run.suspect
            and (len(pool) > 1 or plan.num_gpus == sum(pool.values()))
        ):
            out.append(run)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--diff", action="store_true", help="also run --method diff on each setting"
    )
    parser.add_argument("--out", default="benchmarks/results/plan_vs_sailor.json")
    args = parser.parse_args()
    data = load_sailor_data()
    rows = []
    for model, pool, gbs, sailor, sailor_time, sailor_search in SETTINGS:
        cold_start = time.perf_counter()
        ours = plan_training(model, pool, gbs)
        cold = time.perf_counter() - cold_start
        warm_start = time.perf_counter()
        again = plan_training(model, pool, gbs)
        warm = time.perf_counter() - warm_start
        assert again.plan == ours.plan
        row = {
            "model": model,
            "gpus": pool,
            "gbs": gbs,
            "ours": {
                "plan": ours.plan.describe(),
                "layers_per_stage": [s.num_layers for s in ours.plan.stages],
                "predicted_s": ours.iteration_time_s,
                "objective_s": ours.objective_s,
                "optimum_s": ours.optimum_s,
                "lower_bound_s": ours.lower_bound_s,
                "gap": ours.gap,
                "proven_optimal_under_predictor": ours.proven,
                "predicted_lower_bound_s": ours.predicted_lower_bound_s,
                "predicted_gap": ours.predicted_gap,
                "fits_memory": ours.prediction.fits_memory,
                "peak_memory_gb": ours.prediction.peak_memory_bytes / 1e9,
                "search_time_cold_s": cold,
                "search_time_warm_s": warm,
                "configurations": ours.configurations,
                "solved": ours.solved,
            },
        }
        line = (
            f"{model:11s} {str(pool):60s} gbs {gbs:5d} | ours {ours.plan.describe()} "
            f"{[s.num_layers for s in ours.plan.stages]}: "
            f"{ours.iteration_time_s:.3f} s "
            f"({'proven optimal' if ours.proven else 'gap'}"
            f"{'' if ours.proven else f' {100 * ours.predicted_gap:.2f}%'}; "
            f"search {cold:.2f} s cold, {warm:.2f} s warm)"
        )
        if sailor is not None:
            stages, tp, dp, mbs = sailor
            gpu = next(iter(pool))
            plan = type_plan(
                data,
                model,
                [(a, b, tp) for a, b in stages],
                gpu=gpu,
                dp=dp,
                mbs=mbs,
                gbs=gbs,
            )
            predicted = predict_plan(plan, data, constants=FITTED_CONSTANTS)
            row["sailor"] = {
                "plan": plan.describe(),
                "predicted_by_us_s": predicted.iteration_time_s,
                "fits_memory": predicted.fits_memory,
                "sailor_predicted_s": sailor_time,
                "sailor_search_time_s": sailor_search,
                "ours_over_sailor": ours.iteration_time_s / predicted.iteration_time_s,
            }
            line += (
                f" | Sailor {plan.describe()}: "
                f"{predicted.iteration_time_s:.3f} s by us "
                f"({sailor_time} s by Sailor, search {sailor_search} s); ratio "
                f"{ours.iteration_time_s / predicted.iteration_time_s:.3f}"
            )
        measured = _measured(model, pool, gbs)
        if measured:
            row["measured"] = [
                {
                    "run": run.name,
                    "plan": run.plan.describe(),
                    "measured_s": run.time_s,
                    "predicted_by_us_s": predict_plan(run.plan, data).iteration_time_s,
                    "same_as_ours": run.plan.stages == ours.plan.stages
                    and run.plan.mbs == ours.plan.mbs,
                }
                for run in measured
            ]
            best = min(measured, key=lambda r: r.time_s)
            line += f" | best measured {best.name}: {best.time_s:.3f} s"
        if len(pool) > 1:  # plans whose stages run on different GPU types
            mixed = plan_training(model, pool, gbs, mixed_types=True)
            row["mixed_types"] = {
                "plan": mixed.plan.describe(),
                "layers_per_stage": [s.num_layers for s in mixed.plan.stages],
                "predicted_s": mixed.iteration_time_s,
                "proven_optimal_under_predictor": mixed.proven,
                "predicted_lower_bound_s": mixed.predicted_lower_bound_s,
                "predicted_gap": mixed.predicted_gap,
                "search_time_s": mixed.search_time_s,
                "over_one_type": mixed.iteration_time_s / ours.iteration_time_s,
            }
            line += (
                f" | mixed types: {mixed.plan.describe()} "
                f"{mixed.iteration_time_s:.3f} s, gap "
                f"{100 * mixed.predicted_gap:.1f}% ({mixed.search_time_s:.1f} s)"
            )
        if args.diff:
            diff = plan_training(model, pool, gbs, method="diff")
            row["diff"] = {
                "plan": diff.plan.describe(),
                "predicted_s": diff.iteration_time_s,
                "objective_s": diff.objective_s,
                "lower_bound_s": diff.lower_bound_s,
                "gap": diff.gap,
                "proven_optimal_under_predictor": diff.proven,
                "predicted_gap": diff.predicted_gap,
                "search_time_s": diff.search_time_s,
            }
            line += (
                f" | diff: objective gap {100 * diff.gap:.2f}%, predicted "
                f"{diff.iteration_time_s:.3f} s, predicted gap "
                f"{100 * diff.predicted_gap:.2f}% ({diff.search_time_s:.1f} s)"
            )
        print(line, flush=True)
        rows.append(row)
    result = {
        **stamp.opening_cpu("plan_vs_sailor"),
        "constants": FITTED_CONSTANTS.to_json(),
        "settings": rows,
    }
    stamp.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
