"""``pipedejavu goodput fit|optimize`` and ``pipedejavu elastic``: the two ports.

Parsers and run functions for :mod:`pipedejavu.cli.main`. Files are untrusted: size
and row bounds, no code, and one ``pipedejavu: error:`` line naming the file
(exit 2) when anything is wrong.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
from pathlib import Path

from pipedejavu.cli.parsing import add_json_option, fail, int_in
from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import json_text, read_bytes, read_json
from pipedejavu.planning.deepspeed_elastic import (
    ElasticityError,
    compute_elastic_config,
)

EXIT_OK = 0
MAX_CSV_BYTES = 64 * 1024 * 1024
MAX_CONFIG_BYTES = 1024 * 1024
DEFAULT_DEEPSPEED_VERSION = "0.16.5"
FIT_COLUMNS = (
    "num_nodes",
    "num_replicas",
    "atomic_bsz",
    "accum_step_time",
    "optim_step_time",
)
#: ``--world-size`` lies in [1, MAX_WORLD_SIZE].
MAX_WORLD_SIZE = 1_000_000
#: ``--init-batch``, ``--max-batch-size`` and the atomic batch bounds lie in
#: [1, MAX_BATCH]; node and replica counts in [1, MAX_COUNT], at most
#: MAX_ROWS of them.
MAX_BATCH = 10**9
MAX_COUNT = 1_000_000
MAX_ROWS = 4096
PERF_FIELDS = ("alpha_c", "beta_c", "alpha_n", "beta_n", "alpha_r", "beta_r", "gamma")


class InputError(Exception):
    """Bad input; the message is the one line printed."""


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Adds ``goodput`` (``fit``, ``optimize``) and ``elastic`` to the CLI."""
    goodput = commands.add_parser(
        "goodput",
        help="Pollux/AdaptDL's goodput model: fit it, pick batch sizes",
    )
    actions = goodput.add_subparsers(dest="goodput_command", required=True)
    fit = actions.add_parser(
        "fit",
        help="fit the step-time model (PerfParams) to measured step times",
    )
    fit.add_argument(
        "steps",
        metavar="STEPS.csv",
        help="CSV with a header naming the columns " + ", ".join(FIT_COLUMNS),
    )
    add_json_option(fit)

    optimize = actions.add_parser(
        "optimize",
        help="best atomic batch and accumulation steps per (nodes, replicas)",
    )
    optimize.add_argument(
        "--perf",
        required=True,
        help="7 comma-separated numbers " + ",".join(PERF_FIELDS) + ", or the "
        "JSON that `goodput fit --json` printed",
    )
    optimize.add_argument(
        "--grad",
        required=True,
        metavar="SQR,VAR",
        help="gradient statistics at --init-batch: the squared norm and the "
        "variance of the gradient (Pollux's grad_sqr, grad_var), two finite "
        "numbers >= 0, not both 0",
    )
    optimize.add_argument(
        "--init-batch",
        required=True,
        type=int_in("--init-batch", 1, MAX_BATCH),
        metavar="N",
        help=f"the batch the statistics refer to, 1..{MAX_BATCH:,}",
    )
    optimize.add_argument(
        "--nodes",
        required=True,
        help=f"comma-separated node counts (broadcast), each 1..{MAX_COUNT:,}, "
        f"at most {MAX_ROWS}",
    )
    optimize.add_argument(
        "--replicas",
        required=True,
        help=f"comma-separated replica counts (broadcast), each 1..{MAX_COUNT:,}, "
        f"at most {MAX_ROWS}",
    )
    optimize.add_argument(
        "--max-batch-size",
        type=int_in("--max-batch-size", 1, MAX_BATCH),
        metavar="N",
        help=f"largest global batch, --init-batch..{MAX_BATCH:,} (none: no bound)",
    )
    optimize.add_argument(
        "--atomic-bsz-range",
        metavar="MIN,MAX",
        help=f"per-replica batch bounds, each 0..{MAX_BATCH:,}; 0 at either end: "
        "no bound",
    )
    optimize.add_argument(
        "--accumulation",
        action="store_true",
        help="also consider gradient accumulation steps",
    )
    add_json_option(optimize)

    elastic = commands.add_parser(
        "elastic",
        help="DeepSpeed's elastic global batch size and valid GPU counts",
    )
    elastic.add_argument(
        "config", metavar="CONFIG.json", help="DeepSpeed config with 'elasticity'"
    )
    elastic.add_argument(
        "--world-size",
        type=int_in("--world-size", 1, MAX_WORLD_SIZE),
        metavar="N",
        help=f"GPU count to check and pick a micro-batch for, 1..{MAX_WORLD_SIZE:,} "
        "and small enough that DeepSpeed's rule gives a batch (world size / "
        "model_parallel_size x the smallest micro-batch <= max_train_batch_size); "
        "version 0.2 needs it or the WORLD_SIZE environment variable",
    )
    elastic.add_argument(
        "--deepspeed-version",
        default=DEFAULT_DEEPSPEED_VERSION,
        help="target DeepSpeed version (at least 0.3.8)",
    )
    add_json_option(elastic)


def run(args: argparse.Namespace) -> int:
    """Runs ``goodput`` or ``elastic``; returns the exit code."""
    try:
        if args.command == "elastic":
            _run_elastic(args)
        elif args.goodput_command == "fit":
            _run_fit(args)
        else:
            _run_optimize(args)
    except InputError as error:
        return fail(str(error))
    return EXIT_OK


def _read_bounded(path: str, limit: int) -> bytes:
    try:
        return read_bytes(path, limit)
    except ProblemError as error:
        raise InputError(str(error)) from None


def read_steps_csv(path: str) -> dict[str, list[float]]:
    """The five measurement columns of a step-time CSV (extra columns ignored)."""
    from pipedejavu.costmodel.goodput.fit import MAX_POINTS

    try:
        text = _read_bounded(path, MAX_CSV_BYTES).decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    reader = csv.reader(io.StringIO(text))
    try:
        header = [name.strip() for name in next(reader)]
    except StopIteration:
        raise InputError(f"{path}: empty file, expected a header line") from None
    except csv.Error as error:
        raise InputError(f"{path}: line 1: {error}") from None
    missing = [name for name in FIT_COLUMNS if name not in header]
    if missing:
        raise InputError(
            f"{path}: missing column(s) {', '.join(missing)}; the header must name "
            + ", ".join(FIT_COLUMNS)
        )
    index = {name: header.index(name) for name in FIT_COLUMNS}
    columns: dict[str, list[float]] = {name: [] for name in FIT_COLUMNS}
    try:
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            if len(columns["num_nodes"]) >= MAX_POINTS:
                raise InputError(f"{path}: more than {MAX_POINTS} rows")
            for name, column in index.items():
                cell = row[column].strip() if column < len(row) else ""
                try:
                    value = float(cell)
                except ValueError:
                    raise InputError(
                        f"{path}: line {reader.line_num}: {name} must be a number, "
                        f"got {cell[:40]!r}"
                    ) from None
                if not math.isfinite(value):
                    raise InputError(
                        f"{path}: line {reader.line_num}: {name} must be finite"
                    )
                columns[name].append(value)
    except csv.Error as error:
        raise InputError(f"{path}: line {reader.line_num}: {error}") from None
    if not columns["num_nodes"]:
        raise InputError(f"{path}: no measurements after the header")
    return columns


def _run_fit(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from pipedejavu.costmodel.goodput.fit import (
        fit_perf_params,
        perf_objective,
    )

    columns = read_steps_csv(args.steps)
    try:
        params = fit_perf_params(*(columns[name] for name in FIT_COLUMNS))
    except ValueError as error:
        raise InputError(f"{args.steps}: {error}") from None
    with jax.enable_x64(True):
        objective = float(
            perf_objective(
                np.array(params), *(np.asarray(columns[n]) for n in FIT_COLUMNS)
            )
        )
    if args.json:
        print(
            json_text(
                {
                    "perf_params": params._asdict(),
                    "objective": objective,
                    "num_measurements": len(columns["num_nodes"]),
                }
            )
        )
        return
    print(f"fitted {len(columns['num_nodes'])} measurements of {args.steps}")
    for name, value in params._asdict().items():
        print(f"  {name:8s} {value:.6g}")
    print(f"  objective {objective:.6g} (RMSLE accum + RMSLE optim + regularizers)")


def _numbers(text: str, name: str, count: int | None = None) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(
            f"{name} must be comma-separated numbers, got {text!r}"
        ) from None
    if not values or not all(math.isfinite(v) for v in values):
        raise InputError(f"{name} must be finite numbers, got {text!r}")
    if count is not None and len(values) != count:
        raise InputError(f"{name} needs {count} numbers, got {len(values)}")
    return values


def _integers(text: str, name: str, low: int, high: int) -> list[int]:
    values = _numbers(text, name)
    if (
        len(values) > MAX_ROWS
        or not all(v.is_integer() for v in values)
        or not all(low <= v <= high for v in values)
    ):
        raise InputError(
            f"{name} must be 1 to {MAX_ROWS} comma-separated integers in "
            f"[{low:,}, {high:,}], got {text!r:.60}"
        )
    return [int(v) for v in values]


#: The most seconds a perf parameter may say (a step of a day); ``gamma`` lies
#: in ``[1, 10]``, as ``goodput fit`` bounds it (Pollux's).
MAX_PERF_SECONDS = 86400.0


def _perf_params(text: str) -> list[float]:
    if not text.endswith(".json"):
        values = _numbers(text, "--perf", 7)
        where = "--perf"
    else:
        where = f"{text}: perf_params"
        try:  # (unreadable, not UTF-8, invalid JSON, nested too deeply)
            document = read_json(text, MAX_CONFIG_BYTES, "--perf file")
        except ProblemError as error:
            raise InputError(str(error)) from None
        try:
            params = document["perf_params"]
            values = [float(params[name]) for name in PERF_FIELDS]
        except (ValueError, KeyError, TypeError, OverflowError):
            raise InputError(
                f"{text}: expected the JSON of `goodput fit --json`, with "
                "perf_params " + ", ".join(PERF_FIELDS)
            ) from None
    times, gamma = values[:6], values[6]
    if not all(math.isfinite(v) and 0 <= v <= MAX_PERF_SECONDS for v in times):
        raise InputError(
            f"{where}: the first six (alpha_c ... beta_r) must be seconds in "
            f"[0, {MAX_PERF_SECONDS:g}], got {values[:6]}"
        )
    if not (math.isfinite(gamma) and 1 <= gamma <= 10):
        raise InputError(f"{where}: gamma must be in [1, 10], got {gamma}")
    return values


def _run_optimize(args: argparse.Namespace) -> None:
    import numpy as np

    from pipedejavu.costmodel.goodput.function import GoodputFunction

    perf = _perf_params(args.perf)
    grad = _numbers(args.grad, "--grad", 2)
    if min(grad) < 0 or max(grad) == 0:
        raise InputError(
            f"--grad must be SQR,VAR: two finite numbers >= 0, not both 0; got "
            f"{args.grad!r:.60}"
        )
    nodes = _integers(args.nodes, "--nodes", 1, MAX_COUNT)
    replicas = _integers(args.replicas, "--replicas", 1, MAX_COUNT)
    if len(nodes) > 1 and len(replicas) > 1 and len(nodes) != len(replicas):
        raise InputError(
            f"--nodes and --replicas must have the same length or one value, got "
            f"{len(nodes)} and {len(replicas)}"
        )
    bounds = None
    if args.atomic_bsz_range is not None:
        bounds = tuple(
            _integers(args.atomic_bsz_range, "--atomic-bsz-range", 0, MAX_BATCH)
        )
        if len(bounds) != 2:
            raise InputError(
                f"--atomic-bsz-range needs MIN,MAX, got {args.atomic_bsz_range!r:.60}"
            )
    try:
        fn = GoodputFunction(perf, grad, args.init_batch)
        nodes_array, replicas_array = np.broadcast_arrays(nodes, replicas)
        goodput, atomic, accum = fn.optimize(
            nodes_array,
            replicas_array,
            args.max_batch_size,
            bounds,
            args.accumulation,
        )
    except ValueError as error:
        message = str(error).replace("init_batch_size", "--init-batch")
        raise InputError(
            message.replace("max_batch_size", "--max-batch-size")
        ) from None
    rows = []
    for i in range(goodput.size):
        batch = int(replicas_array[i] * atomic[i] * (accum[i] + 1))
        valid = goodput[i] > 0
        rows.append(
            {
                "num_nodes": int(nodes_array[i]),
                "num_replicas": int(replicas_array[i]),
                "goodput": float(goodput[i]),
                "atomic_bsz": int(atomic[i]),
                "accum_steps": int(accum[i]),
                "global_batch": batch,
                "throughput": float(
                    fn.throughput(
                        nodes_array[i], replicas_array[i], atomic[i], accum[i]
                    )
                )
                if valid
                else 0.0,
                "efficiency": float(fn.efficiency(batch)) if valid else 0.0,
            }
        )
    if args.json:
        print(json_text(rows))
        return
    print(
        f"{'nodes':>5} {'replicas':>8} {'atomic':>7} {'accum':>5} {'batch':>7} "
        f"{'samples/s':>11} {'efficiency':>10} {'goodput':>11}"
    )
    for row in rows:
        print(
            f"{row['num_nodes']:>5} {row['num_replicas']:>8} {row['atomic_bsz']:>7} "
            f"{row['accum_steps']:>5} {row['global_batch']:>7} "
            f"{row['throughput']:>11.5g} {row['efficiency']:>10.4f} "
            f"{row['goodput']:>11.5g}"
        )
    if any(row["goodput"] == 0 for row in rows):
        print("goodput 0: no sampled batch fits --atomic-bsz-range")


def _run_elastic(args: argparse.Namespace) -> None:

    path = args.config
    try:
        config = read_json(path, MAX_CONFIG_BYTES, "DeepSpeed config")
    except ProblemError as error:
        raise InputError(str(error)) from None
    try:
        result = compute_elastic_config(
            config, args.deepspeed_version, world_size=args.world_size or 0
        )
    except (ElasticityError, ValueError, TypeError, ArithmeticError) as error:
        if args.world_size is None and "needs WORLD_SIZE" in str(error):
            raise InputError(
                f"{path}: elasticity version 0.2 needs --world-size N "
                f"(1..{MAX_WORLD_SIZE:,}) or the WORLD_SIZE environment variable, "
                f"got neither (WORLD_SIZE={os.environ.get('WORLD_SIZE')!r:.20})"
            ) from None
        notes = "; ".join(getattr(error, "__notes__", []))
        detail = f"{error}" + (f" ({notes})" if notes else "")
        raise InputError(f"{path}: {type(error).__name__}: {detail}") from None
    except NotImplementedError as error:
        raise InputError(f"{path}: {error}") from None
    batch, valid = result[0], result[1]
    micro = result[2] if len(result) == 3 else None
    section = config["elasticity"]
    version = float(section.get("version", 0.2))
    if batch < 1:  # DeepSpeed's fallback for a world size too large: batch 0
        raise InputError(
            f"--world-size {args.world_size}: DeepSpeed's rule gives no global "
            f"batch for it with {path} (its data-parallel replicas x the smallest "
            "micro-batch exceed max_train_batch_size); expected a smaller "
            "world size"
        )
    if args.json:
        out = {"final_batch_size": batch, "valid_gpus": valid, "version": version}
        if micro is not None or len(result) == 3:
            out["micro_batch_size"] = micro
        print(json_text(out))
        return
    label = "data-parallel sizes" if version == 0.2 else "GPU counts"
    print(f"{Path(path).name}: elasticity v{version}")
    print(f"global batch size {batch}")
    print(f"valid {label} ({len(valid)}): {', '.join(str(n) for n in valid)}")
    if len(result) == 3:
        print(f"micro-batch size at world size {args.world_size}: {micro}")
