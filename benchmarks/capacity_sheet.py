"""Issue 47's capacity question over the whole GPU sheet: Llama-3-70B on 1T
tokens (global batch 1,024 of its 8,192-token samples), every GPU type of
the bundled sheet at 12 counts each (8 to 2,048, up to 2,048 of each
available), the bundled example prices (an example, not quotes), the least
cost within 90 days; answered on 2 local worker processes and on a local
Dask cluster of 2 workers (its start included), the two answers compared
field by field (wall-clock fields aside), and again with every pool planned
to its optimum (``--every-plan``, 2 local processes): the same choice, the
same frontier and the same outcome for every pool not dominated. Target:
<= 5 minutes with 2 local workers on the 2-core machine.

    python benchmarks/capacity_sheet.py [--types N] [--engines 2,dask,every]
        [--out FILE]

``--types N`` takes the first N types of the sheet (a quicker check).
Writes ``benchmarks/results/capacity_sheet.json`` with date and machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import stamp

from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.price_sheet import load_price_sheet
from pipedejavu.planning.capacity import (
    CapacityQuestion,
    answer_capacity,
    without_clock,
    without_trace,
)

PRICES = stamp.ROOT / "pipedejavu/data/prices-example.json"
COUNTS = (8, 16, 32, 48, 64, 96, 128, 256, 384, 512, 1024, 2048)
ENGINES = {"2": (2, None), "dask": (2, "local"), "1": (1, None), "every": (2, None)}


def _plain(outcome) -> dict:
    """An outcome without the wall clock and the trace of how each knob
    choice was settled (which follows the cutoffs; a pruned answer leaves
    it out)."""
    out = without_clock(outcome.to_json())
    return {**out, "plan": without_trace(out["plan"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", type=int, default=None)
    parser.add_argument("--engines", default="2,dask,every")
    parser.add_argument("--out", default=str(stamp.RESULTS / "capacity_sheet.json"))
    args = parser.parse_args()
    sheet = load_gpu_sheet()
    types = list(sheet)[: args.types]
    question = CapacityQuestion(
        model="Llama-3-70B",
        tokens=1e12,
        global_batch=1024,
        available={gpu: max(COUNTS) for gpu in types},
        prices=load_price_sheet(PRICES, sheet),
        deadline_s=90 * 86400.0,
        counts=COUNTS,
    )
    answers, seconds = {}, {}
    for name in args.engines.split(","):
        workers, cluster = ENGINES[name]
        started = time.perf_counter()

        def progress(done, total, outcome, started=started):
            if done % 20 == 0 or done == total:
                print(f"  [{done}/{total}] {time.perf_counter() - started:.0f} s",
                      flush=True)  # fmt: skip

        asked = dataclasses.replace(question, every_plan=name == "every")
        answers[name] = answer_capacity(
            asked, workers=workers, cluster=cluster, progress=progress
        )
        seconds[name] = time.perf_counter() - started
        print(f"{name}: {seconds[name]:.1f} s", flush=True)
    every = answers.pop("every", None)
    first = without_clock(next(iter(answers.values())).to_json())
    identical = all(without_clock(a.to_json()) == first for a in answers.values())
    answer = next(iter(answers.values()))
    compared = {}
    if every is not None:  # every pool planned to its optimum: the same answer?
        kept = [
            _plain(a) == _plain(b)
            for a, b in zip(answer.outcomes, every.outcomes, strict=True)
            if a.dominated_by is None
        ]
        compared = {
            "every_plan_s": seconds.pop("every"),
            "same_as_every_plan": (answer.choice, answer.frontier)
            == (every.choice, every.frontier)
            and all(kept),
        }
    chosen = answer.outcomes[answer.choice]
    planned = [o for o in answer.outcomes if o.feasible]
    slowest = sorted(answer.outcomes, key=lambda o: -o.search_s)[:5]
    out = {
        "question": {
            "model": question.model,
            "tokens": question.tokens,
            "global_batch": question.global_batch,
            "types": types,
            "counts": list(COUNTS),
            "deadline_days": question.deadline_s / 86400,
            "prices": "pipedejavu/data/prices-example.json (an example, not quotes)",
        },
        "pools": len(answer.outcomes),
        "pools_with_a_plan": len(planned),
        "not_proven": sum(1 for o in planned if not o.proven),
        "dominated": sum(1 for o in answer.outcomes if o.dominated_by is not None),
        "chosen": {
            "used": dict(chosen.used),
            "shape": chosen.shape,
            "days": chosen.time_s / 86400,
            "cost": chosen.cost,
        },
        "frontier": [
            {
                "used": dict(answer.outcomes[i].used),
                "days": answer.outcomes[i].time_s / 86400,
                "cost": answer.outcomes[i].cost,
            }
            for i in answer.frontier
        ],  # fmt: skip
        "slowest_pools": [
            {"pool": dict(o.pool), "search_s": o.search_s} for o in slowest
        ],
        "planning_s_summed": sum(o.search_s for o in answer.outcomes),
        "seconds": seconds,
        "target_s": 300,
        "identical": identical,
        **compared,
        **stamp.stamp("unknown"),
    }
    print(f"chosen {dict(chosen.used)}: {chosen.time_s / 86400:.1f} days, "
          f"{chosen.cost:,.0f} USD; identical: {identical}")  # fmt: skip
    stamp.save(args.out, out, end="\n")


if __name__ == "__main__":  # (spawned workers import this file)
    main()
