"""``pipedejavu sweep --models M[,M...] --global-batch B[,B...]
--gpus-available TYPE:MAX,...``: every model x global batch x candidate pool
planned, one row each (:func:`~pipedejavu.planning.plan_sweep.run_sweep`).

The report prints a row per plan (seconds per iteration, tokens per second
per GPU, with ``--tokens`` the days to train and with ``--prices`` the
cost); ``--results FILE.csv`` keeps every row as it finishes (and resumes an
interrupted sweep), ``--json`` prints all of it.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipedejavu.cli.any_model import MAX_SEQ_LENGTH
from pipedejavu.cli.capacity import (
    add_pool_options,
    parse_available,
    parse_tokens,
    plan_pools,
)
from pipedejavu.cli.parsing import add_json_option, int_in
from pipedejavu.core.files import json_text
from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TRAINING_PRECISIONS
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.price_sheet import load_price_sheet
from pipedejavu.planning.capacity_results import pool_key
from pipedejavu.planning.plan_sweep import SweepQuestion, SweepRow, run_sweep

__all__ = ["add_parser", "run"]

HELP = (
    "plan every model x global batch x GPU type and count (a table, a CSV that "
    "resumes, local processes or a Dask cluster)"
)


def _batches(text: str) -> tuple[int, ...]:
    """``--global-batch``: sizes separated by commas, each in ``plan``'s range."""
    values = [v.strip() for v in text.split(",")]
    if not all(v.isdigit() and 1 <= int(v) <= MAX_GLOBAL_BATCH for v in values):
        raise argparse.ArgumentTypeError(
            f"global batch sizes from 1 to {MAX_GLOBAL_BATCH} separated by commas, "
            f"got {text!r:.40}"
        )
    return tuple(int(v) for v in values)


def add_parser(commands: Any) -> None:
    """Register ``sweep`` on the command line's sub-parsers."""
    sweep = commands.add_parser(
        "sweep",
        help=HELP,
        description="Plan every model of --models at every global batch of "
        "--global-batch on every candidate pool of --gpus-available (per type, "
        "powers of two to a node, then doubling nodes, and the most available; "
        "or --counts), each as `plan --model M --gpus TYPE:N` plans it, and "
        "print one row per plan.",
    )
    sweep.add_argument(
        "--models",
        required=True,
        metavar="M[,M...]",
        help="models as plan --model takes them (presets, config.json files)",
    )
    sweep.add_argument(
        "--global-batch",
        required=True,
        type=_batches,
        metavar="B[,B...]",
        help="global batch sizes (samples per iteration) to plan each model at",
    )
    sweep.add_argument(
        "--gpus-available",
        required=True,
        action="append",
        metavar="TYPE:MAX",
        help="the GPU types and the most of each (repeat or separate with commas)",
    )
    sweep.add_argument(
        "--seq-len",
        type=int_in("--seq-len", 1, MAX_SEQ_LENGTH),
        metavar="S",
        help="tokens per sample (default: each model's, as plan takes it)",
    )
    sweep.add_argument(
        "--precision",
        choices=TRAINING_PRECISIONS,
        help="training precision (default: as plan chooses it for each model)",
    )
    sweep.add_argument(
        "--gpu-sheet",
        metavar="FILE",
        help="a JSON GPU sheet extending or overriding the bundled one",
    )
    sweep.add_argument(
        "--profiles",
        metavar="DIR",
        help="per-layer profiles in Sailor's layout, used where they cover a plan",
    )
    sweep.add_argument(
        "--tokens",
        type=parse_tokens,
        metavar="T",
        help="tokens to train on (1T): adds the days to train",
    )
    sweep.add_argument(
        "--prices",
        metavar="FILE",
        help="JSON of prices per GPU-hour (with --tokens: adds the cost)",
    )
    sweep.add_argument(
        "--mixed-types",
        action="store_true",
        help="also the pools mixing two of the types (whole nodes of each), "
        "planned as plan --mixed-types plans them",
    )
    add_pool_options(
        sweep,
        results="write each row to this CSV as it finishes (a Parquet copy "
        "beside it at the end, with pyarrow); given a file that holds some of "
        "the sweep's rows, plan only the others",
    )
    add_json_option(sweep)


def _question(args: argparse.Namespace) -> SweepQuestion:
    if args.prices is not None and args.tokens is None:
        raise ProblemError("--prices needs --tokens (the cost is of the training)")
    sheet = load_gpu_sheet(args.gpu_sheet)
    models = tuple(m.strip() for m in args.models.split(","))
    if not all(models):
        raise ProblemError(f"--models {args.models[:60]!r}: an empty model name")
    return SweepQuestion(
        models=models,
        global_batches=args.global_batch,
        available=parse_available(args.gpus_available, sheet),
        counts=args.counts,
        seq_length=args.seq_len,
        precision=args.precision,
        gpu_sheet=args.gpu_sheet,
        profiles=args.profiles,
        tokens=args.tokens,
        prices=None if args.prices is None else load_price_sheet(args.prices, sheet),
        mixed=args.mixed_types,
    )


def _line(row: SweepRow, currency: str | None) -> str:
    p = row.planned
    head = f"{row.model[:24]:24s} {row.global_batch:>6d} {pool_key(row.pool):18s}"
    if p.used is None:
        return f"{head} no plan: {(p.reason or '')[:70]}"
    text = f"{head} {pool_key(p.used):18s} {p.iteration_s:9.3f} "
    text += f"{row.tokens_per_s_per_gpu:10,.0f}"
    if row.time_s is not None:
        text += f" {row.time_s / 86400:8.2f}"
    if row.cost is not None:
        text += f" {row.cost:14,.0f}"
    return f"{text}  {p.shape}{'' if p.proven else ' (not proven)'}"


def run(args: argparse.Namespace) -> int:
    """``sweep``: every row, printed."""
    question = _question(args)

    def finished(row: SweepRow) -> tuple[str, float]:
        pool = pool_key(row.pool)
        return f"{row.model} x {row.global_batch} on {pool}", row.planned.search_s

    rows = plan_pools(run_sweep, question, args, finished)
    currency = question.prices and question.prices.currency
    if args.json:
        out = {
            "models": list(question.models),
            "global_batches": list(question.global_batches),
            "available": dict(question.available),
            "tokens": question.tokens,
            "currency": currency,
            "prices_are_an_example": bool(question.prices and question.prices.example),
            "rows": [row.to_json() for row in rows],
        }
        print(json_text(out, indent=1))
        return 0
    if question.prices is not None and question.prices.example:
        print(f"note: {question.prices.source} is an example price sheet, not quotes")
    header = f"{'model':24s} {'batch':>6s} {'pool':18s} {'used':18s} {'s/iter':>9s} "
    header += f"{'tok/s/GPU':>10s}"
    if question.tokens is not None:
        header += f" {'days':>8s}"
    if currency:
        header += f" {'cost ' + currency:>14s}"
    print(header + "  plan")
    for row in rows:
        print(_line(row, currency))
    planned = sum(1 for row in rows if row.planned.used is not None)
    print(f"{len(rows)} plans asked, {planned} found (each the fastest on at most "
          "its pool's GPUs under the predictor)")  # fmt: skip
    if args.results:
        print(f"wrote {args.results}")
    return 0
