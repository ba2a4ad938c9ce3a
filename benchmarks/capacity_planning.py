"""Capacity planning (issue 47): one worked question, answered with 1 and 2
local workers and on a local Dask cluster of 2 workers, side by side.

The question: Llama-3-8B on 100B tokens (global batch 256, its 8,192-token
samples), H100-SXM, A100-80 and L40S up to 64 of each, the bundled example
price sheet (an example, not quotes), finished within 30 days at the least
cost. Every candidate pool is planned to its proven optimum or proven
dominated (a frontier pool beats any plan of it in time and cost); the three
answers are compared field by field (wall-clock fields aside) and their
times side by side (the Dask time includes starting its cluster).

    python benchmarks/capacity_planning.py [--out FILE]

Writes ``benchmarks/results/capacity_planning.json`` with date and machine.
"""

from __future__ import annotations

import time

import stamp

from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.price_sheet import load_price_sheet
from pipedejavu.planning.capacity import (
    CapacityQuestion,
    answer_capacity,
    without_clock,
)

PRICES = stamp.ROOT / "pipedejavu/data/prices-example.json"


def main() -> None:
    out_path = stamp.out_option(__doc__, str(stamp.RESULTS / "capacity_planning.json"))
    sheet = load_gpu_sheet()
    question = CapacityQuestion(
        model="Llama-3-8B",
        tokens=1e11,
        global_batch=256,
        available={"H100-SXM": 64, "A100-80": 64, "L40S": 64},
        prices=load_price_sheet(PRICES, sheet),
        deadline_s=30 * 86400.0,
    )
    answers, seconds = {}, {}
    for name, workers, cluster in (
        ("1", 1, None),
        ("2", 2, None),
        ("dask-local-2", 2, "local"),
    ):
        started = time.perf_counter()
        answers[name] = answer_capacity(question, workers=workers, cluster=cluster)
        seconds[name] = time.perf_counter() - started
        print(f"{name}: {seconds[name]:.1f} s")
    first = without_clock(answers["1"].to_json())
    identical = all(without_clock(a.to_json()) == first for a in answers.values())
    answer = answers["1"]
    rows = [
        {
            "pool": dict(o.pool),
            "used": None if o.used is None else dict(o.used),
            "shape": o.shape,
            "iteration_s": o.iteration_s if o.feasible else None,
            "days": o.time_s / 86400 if o.feasible else None,
            "cost": o.cost if o.feasible else None,
            "frontier": i in answer.frontier,
            "chosen": i == answer.choice,
            "proven": o.proven,
            "reason": o.reason,
            "dominated_by": None if o.dominated_by is None else dict(o.dominated_by),
        }
        for i, o in enumerate(answer.outcomes)
    ]
    out = {
        "question": {
            "model": question.model,
            "tokens": question.tokens,
            "global_batch": question.global_batch,
            "available": dict(question.available),
            "deadline_days": question.deadline_s / 86400,
            "prices": "pipedejavu/data/prices-example.json (an example, not quotes)",
        },
        "candidates": rows,
        "seconds": seconds,
        "speed_up_2_workers": seconds["1"] / seconds["2"],
        "speed_up_dask_local_2": seconds["1"] / seconds["dask-local-2"],
        "identical": identical,
        **stamp.stamp("unknown"),
    }
    chosen = answer.outcomes[answer.choice]
    print(f"chosen {dict(chosen.used)}: {chosen.time_s / 86400:.2f} days, "
          f"{chosen.cost:,.0f} USD; identical everywhere: {identical}")  # fmt: skip
    stamp.save(out_path, out, end="\n")


if __name__ == "__main__":  # (spawned workers import this file)
    main()
