"""The blocks timed on a GPU by ``gpu_blocks.py``, priced with today's constants.

``gpu_blocks.py`` needs a GPU; its results file records the measured times and
the prediction of the constants of that day. When the constants change (the
16-bit ones were recalibrated on 2026-11-26), this script prices the same
blocks again, on this machine, from the GPU-sheet entry the file recorded,
and writes the measured times with the new predictions and errors (the
measurement's date and machine kept under ``measured``). No GPU needed.

Usage::

    PYTHONPATH=. python benchmarks/gpu_blocks_reprice.py \\
        [--measured benchmarks/results/gpu_blocks.json] \\
        [--out benchmarks/results/gpu_blocks_repriced.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipedejavu.core.gpu_sheet import GpuSheetEntry

sys.path.insert(0, str(Path(__file__).parent))
import gpu_blocks  # noqa: E402  (the benchmark's own prediction and summary)
import stamp  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def sheet_entry(recorded: dict) -> GpuSheetEntry:
    """The GPU-sheet entry the measurement was priced with."""
    return GpuSheetEntry(
        recorded["name"],
        recorded["memory_bytes"],
        recorded["memory_bandwidth_bytes_per_s"],
        tuple((name, peak) for name, peak in recorded["peak_flops"]),
        recorded["gpus_per_node"],
        recorded["intra_node_bytes_per_s"],
        recorded["inter_node_bytes_per_s"],
    )


def reprice(measured: dict) -> dict:
    """``measured`` (a ``gpu_blocks.py`` results file) with every measured
    row's prediction and error recomputed, and the summary."""
    gpu = sheet_entry(measured["gpu_sheet_entry"])
    rows = []
    for row in measured["rows"]:
        if row.get("status") != "ok":
            continue
        config = gpu_blocks.BlockConfig(**row["config"])
        repriced = dict(row, predicted=gpu_blocks.predict(config, gpu))
        repriced["error"] = gpu_blocks.errors(repriced)
        rows.append(repriced)
    return {
        **stamp.stamp("unknown"),
        "measured": {
            "date": measured["date"],
            "machine": measured["machine"],
            "constants": measured["constants"],
        },
        "environment": measured["environment"],
        "gpu_sheet_entry": measured["gpu_sheet_entry"],
        "constants": gpu_blocks.constants_record(),
        "rows": rows,
        "summary": gpu_blocks.summarize(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", default=str(RESULTS / "gpu_blocks.json"))
    parser.add_argument("--out", default=str(RESULTS / "gpu_blocks_repriced.json"))
    args = parser.parse_args(argv)
    result = reprice(json.loads(Path(args.measured).read_text()))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for key, entry in result["summary"].items():
        both = entry["forward_backward"]
        median, signed = 100 * both["median_abs"], 100 * both["median_signed"]
        print(
            f"{key:14s} {entry['count']:3d} configs: fwd+bwd median "
            f"{median:.1f}% (signed {signed:+.1f}%)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
