"""DeepSpeed's schedule run op by op (the compiled program) against one numpy
step of every stage at a time (``run_by_steps``), side by side in one process.

For each pipeline shape: the program built and run (its first call), the
program run again from its cache, and the steps (first call, then again);
best of ``--repeats`` of each, with random stage and link times (seed 0), and
a check that both give the same grids bit for bit. Also the time to build
every rank's command order of the interleaved and zero-bubble schedules for
SC'21 530B's shape (35 ranks, 3 chunks, 280 micro-batches).

    python benchmarks/simulator_speed.py [--out FILE] [--repeats N]

Writes ``benchmarks/results/simulator_speed.json`` (date, machine).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import stamp

from pipedejavu.simulation import deepspeed, interleaved, zero_bubble

SHAPES = [(8, 32), (16, 64), (21, 128), (32, 128), (35, 280), (64, 512)]


def _best(fn, repeats: int, clear: bool) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        if clear:
            deepspeed.clear_caches()
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best, out


def deepspeed_rows(repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for stages, count in SHAPES:
        for blocking in (True, False):
            args = (
                rng.uniform(0.1, 2, stages).tolist(),
                rng.uniform(0.1, 4, stages).tolist(),
                rng.uniform(0, 0.5, stages - 1).tolist(),
                rng.uniform(0, 0.5, stages - 1).tolist(),
                [blocking] * (stages - 1),
                count,
            )

            def program(args=args):
                return deepspeed.run_deepspeed(*args, method="program")

            def steps(args=args):
                return deepspeed.run_deepspeed(*args, method="steps")

            first, grids_p = _best(program, repeats, clear=True)
            cached, _ = _best(program, repeats, clear=False)
            steps_first, grids_s = _best(steps, repeats, clear=True)
            steps_cached, _ = _best(steps, repeats, clear=False)
            same = all(
                np.array_equal(
                    np.array(a, dtype=np.float64).reshape(-1, count), b, equal_nan=True
                )
                for a, b in zip(grids_p[1], grids_s[1], strict=True)
            )
            rows.append(
                {
                    "stages": stages,
                    "microbatches": count,
                    "blocking": blocking,
                    "program_first_ms": 1e3 * first,
                    "program_cached_ms": 1e3 * cached,
                    "steps_first_ms": 1e3 * steps_first,
                    "steps_cached_ms": 1e3 * steps_cached,
                    "first_speedup": first / steps_first,
                    "same_grids": bool(same),
                }
            )
            print(
                f"S={stages:3d} B={count:4d} {'blocking' if blocking else 'buffered'}"
                f": program {1e3 * first:7.2f} ms (cached {1e3 * cached:6.2f}), "
                f"steps {1e3 * steps_first:6.2f} ms (cached {1e3 * steps_cached:6.2f})"
                f", x{first / steps_first:.1f}, same grids: {same}",
                flush=True,
            )
    return rows


def order_rows() -> list[dict]:
    ranks, chunks, count = 35, 3, 280
    builders = {
        "interleaved": lambda r: interleaved.interleaved_order(r, ranks, chunks, count),
        "zb-h1": lambda r: zero_bubble.zero_bubble_order(r, ranks, count),
        "interleaved zb": lambda r: zero_bubble.zero_bubble_order(
            r, ranks, count, chunks
        ),
        "zb-v": lambda r: zero_bubble.zbv_order(r, ranks, count),
    }
    rows = []
    for name, build in builders.items():
        started = time.perf_counter()
        for r in range(ranks):
            build(r)
        seconds = time.perf_counter() - started
        rows.append({"schedule": name, "ranks": ranks, "build_ms": 1e3 * seconds})
        print(f"orders of {ranks} ranks, {name}: {1e3 * seconds:.1f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/simulator_speed.json")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    result = {
        "orders_530b_shape": order_rows(),  # first: nothing built yet
        "deepspeed": deepspeed_rows(args.repeats),
        **stamp.stamp(),
    }
    result["seconds"] = time.perf_counter() - started
    stamp.write_json(args.out, result)
    print(f"wrote {args.out} ({result['seconds']:.1f} s)")


if __name__ == "__main__":
    main()
