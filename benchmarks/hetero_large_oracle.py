"""The exact oracle alone on the large suite's L = 128 instance (128 devices).

``hetero_vs_alpa.py --suite large`` cuts the oracle off at ``--oracle-limit``;
this runs it alone with a longer limit (default 520 s: twice the 254 s the
canonical-placement oracle took in the suite run of 2026-11-23) to see
whether it finishes within 2x. Results: ``benchmarks/results/hetero_large_oracle.json``.
Since issue 23 the oracle is exact for ``hetero_bound`` (a lower bound on the
1F1B objective) and prices its plans on the objective: ``oracle_cost`` is its
plan's objective and ``oracle_info`` has ``proven``, ``lower_bound`` and
``gap`` (only ``lower_bound`` when cut off).

Usage::

    python benchmarks/hetero_large_oracle.py [--limit 520]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import stamp

from pipedejavu.costmodel.stage.hetero_generate import (
    hetero_problem,
    three_type_cluster,
)
from pipedejavu.search.hetero.exact import HeteroTimeoutError, hetero_exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=520.0)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/hetero_large_oracle.json")
    )
    args = parser.parse_args()
    cluster = three_type_cluster((4, 4, 8))
    problem = hetero_problem(128, cluster, num_microbatches=32, seed=0)
    load = os.getloadavg()
    started = time.perf_counter()
    try:
        plan = hetero_exact(problem, time_limit_s=args.limit)
        cost, finished = plan.cost, True
        info = {k: v for k, v in plan.info.items() if k != "t_max"}
    except HeteroTimeoutError as error:
        best = error.best_plan
        cost, finished = (None if best is None else best.cost), False
        info = {"lower_bound": error.lower_bound}
    row = {
        "benchmark": "hetero_large_oracle",
        "date": stamp.now(),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_at_start": load,
            "load_average_at_end": os.getloadavg(),
        },
        "instance": "4H100+4A100+8V100 L=128",
        "limit_s": args.limit,
        "oracle_cost": cost,
        "oracle_finished": finished,
        "oracle_s": time.perf_counter() - started,
        "oracle_info": info,
    }
    print(json.dumps(row, indent=1, default=float))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
