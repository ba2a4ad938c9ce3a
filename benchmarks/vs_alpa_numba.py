"""Alpa's own ``training_dp`` (under numba, as Alpa runs it) vs ours, one process.

Checks that ``baselines/alpa_dp.py`` is a fair stand-in for Alpa in
``dp_scaling.py``: same answers, and how its speed compares with Alpa's code.
Alpa's two functions are read from an Alpa checkout at run time (nothing of
Alpa is stored in this project); numba is needed here only, it is not a
dependency of pipedejavu.

Usage::

    git clone https://github.com/alpa-projects/alpa /tmp/alpa
    pip install numba
    python benchmarks/vs_alpa_numba.py --alpa-checkout /tmp/alpa
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from pathlib import Path

import numpy as np

from pipedejavu.baselines.alpa_dp import alpa_training_dp
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.search.alpa.exact import exact_dp

if importlib.util.find_spec("numba") is None:
    sys.exit("this benchmark needs numba (pip install numba)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
from make_alpa_reference import load_alpa_dp  # noqa: E402

CASES = [(16, (1, 8)), (32, (2, 8)), (32, (4, 8))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpa-checkout", type=Path, required=True)
    args = parser.parse_args()
    training_dp = load_alpa_dp(args.alpa_checkout)
    print(
        f"# {platform.machine()}, python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )
    print(
        f"{'L':>4} {'D':>4} {'alpa-numba s':>13} {'ours (alpa mode) s':>19} "
        f"{'exact s':>8} {'numba/ours':>11} {'numba/exact':>12} {'same':>5}"
    )
    for num_layers, cluster in CASES:
        problem = random_problem(
            num_layers,
            cluster,
            num_microbatches=32,
            seed=num_layers * 1000 + cluster[0] * cluster[1],
        )
        choices = tuple(tuple(int(x) for x in s) for s in problem.submesh_shapes)
        arguments = (
            num_layers,
            problem.num_devices,
            problem.num_microbatches,
            choices,
            problem.num_configs,
            np.array(problem.compute_cost),
            np.array(problem.max_n_succ_stages),
        )
        training_dp(
            2,
            1,
            1,
            ((1, 1),) * len(choices),
            1,  # compile first
            np.ones((2, 2, len(choices), 1)),
            np.ones((2, 2, len(choices), 1), dtype=np.int64),
        )
        started = time.perf_counter()
        alpa_cost, solution = training_dp(*arguments)
        numba_time = time.perf_counter() - started
        started = time.perf_counter()
        ours = alpa_training_dp(problem)
        ours_time = time.perf_counter() - started
        started = time.perf_counter()
        exact_dp(problem)
        exact_time = time.perf_counter() - started
        same = ours.info["alpa_cost"] == float(alpa_cost) and [
            (s.start, s.stop, s.submesh_index, s.config_index) for s in ours.stages
        ] == [(a, b, m, k) for (a, b), m, k in solution]
        print(
            f"{num_layers:>4} {problem.num_devices:>4} {numba_time:>13.3f} "
            f"{ours_time:>19.3f} {exact_time:>8.3f} {numba_time / ours_time:>11.1f} "
            f"{numba_time / exact_time:>12.0f} {str(same):>5}",
            flush=True,
        )


if __name__ == "__main__":
    main()
