"""``pipedejavu plan --model M --tokens T --gpus-available TYPE:MAX,...
--prices FILE (--deadline 60d | --budget USD)``: what to rent
(:func:`~pipedejavu.planning.capacity.answer_capacity`).

The report lists every candidate pool with its plan, time to train and
cost, marks the Pareto frontier and the choice, and says that the choice is
the optimum over the candidates under the predictor; ``--json`` prints all
of it, ``--plot FILE`` draws cost against time to train.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from pipedejavu.cli.parsing import given_flags, int_in, require_matplotlib
from pipedejavu.core.files import json_text
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.gpu_sheet import GpuSheet, load_gpu_sheet
from pipedejavu.io.price_sheet import load_price_sheet
from pipedejavu.planning.capacity import (
    CandidateOutcome,
    CapacityAnswer,
    CapacityQuestion,
    answer_capacity,
)
from pipedejavu.planning.capacity_results import pool_key
from pipedejavu.planning.training import parse_gpu_pool

__all__ = [
    "add_capacity_options",
    "add_pool_options",
    "parse_available",
    "parse_counts",
    "parse_duration",
    "parse_tokens",
    "plan_pools",
    "run_capacity",
]

T = TypeVar("T")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)"


def parse_duration(text: str) -> float:
    """Seconds of ``60d``, ``12h``, ``90m``, ``3600s``, ``2w`` (a bare number:
    days)."""
    found = re.fullmatch(_NUMBER + r"\s*([smhdw]?)", text.strip().lower())
    if found is None or not 0 < float(found.group(1)) < 1e15:
        raise argparse.ArgumentTypeError(
            f"a duration like 60d, 12h or 90m, got {text!r:.40}"
        )
    return float(found.group(1)) * _UNITS[found.group(2) or "d"]


def parse_tokens(text: str) -> float:
    """Tokens of ``1T``, ``300B``, ``15e12``, ``2.5t``."""
    found = re.fullmatch(_NUMBER + r"\s*([kmbgt]?)", text.strip().lower())
    if found is None or not 0 < float(found.group(1)) * _SCALE[found.group(2)] < 1e18:
        raise argparse.ArgumentTypeError(
            f"a token count like 1T, 300B or 15e12, got {text!r:.40}"
        )
    return float(found.group(1)) * _SCALE[found.group(2)]


def parse_counts(text: str) -> tuple[int, ...]:
    """``--counts``: GPU counts separated by commas, sorted, each once."""
    values = [v.strip() for v in text.split(",")]
    if not values or not all(v.isdigit() and 1 <= int(v) <= 2**20 for v in values):
        raise argparse.ArgumentTypeError(
            f"GPU counts separated by commas, got {text!r:.40}"
        )
    return tuple(sorted({int(v) for v in values}))


def add_capacity_options(plan: Any) -> None:
    """Add capacity planning's options to the ``plan`` parser."""
    plan.add_argument(
        "--gpus-available",
        action="append",
        metavar="TYPE:MAX",
        help="capacity planning: the GPU types one could rent and the most of "
        "each (repeat or separate with commas); with --tokens, --prices and "
        "--deadline or --budget, plans every candidate count of every type and "
        "chooses what to rent",
    )
    plan.add_argument(
        "--tokens", type=parse_tokens, metavar="T", help="tokens to train on (1T)"
    )
    plan.add_argument(
        "--prices",
        metavar="FILE",
        help='JSON of prices per GPU-hour: {"currency": "USD", "per_gpu_hour": '
        '{"H100-SXM": 2.5}} (`pipedejavu data prices-example.json`: an '
        "example, not quotes)",
    )
    plan.add_argument(
        "--deadline",
        type=parse_duration,
        metavar="60d",
        help="the least cost that trains within this (s, m, h, d, w)",
    )
    plan.add_argument(
        "--budget",
        type=float,
        metavar="AMOUNT",
        help="the least time to train within this, in the prices' currency",
    )
    plan.add_argument(
        "--every-plan",
        action="store_true",
        help="plan every candidate pool to its optimum (default: a pool certified "
        "dominated, slower and dearer than a pool of the frontier whatever its "
        "plan, is searched only until that is certain, and listed as dominated)",
    )
    add_pool_options(
        plan,
        results="write each pool's outcome to this CSV as it finishes (and a "
        "Parquet copy beside it at the end, with pyarrow); a sweep given a file "
        "that already holds pools of the same question plans only the others",
    )


def add_pool_options(parser: Any, *, results: str) -> None:
    """``--counts``, ``--workers``, ``--cluster`` and ``--results`` (its help
    given): where and on which counts the candidate pools are planned, shared
    by capacity planning and ``sweep``."""
    parser.add_argument(
        "--counts",
        type=parse_counts,
        metavar="N[,N...]",
        help="the GPU counts to plan for every type (default: powers of two to "
        "a node, then doubling whole nodes, and the most available)",
    )
    parser.add_argument(
        "--workers",
        type=int_in("--workers", 1, 256),
        default=1,
        help="processes planning the candidate pools (default 1; with --cluster "
        "local, the local Dask cluster's)",
    )
    parser.add_argument(
        "--cluster",
        metavar="ADDRESS|local",
        help="plan the pools on a Dask cluster: a scheduler's address "
        "(tcp://host:8786) or local (one started here with --workers processes; "
        "needs pip install 'pipedejavu[cluster]')",
    )
    parser.add_argument("--results", metavar="FILE.csv", help=results)


def plan_pools(
    plan: Callable[..., T],
    question: Any,
    args: argparse.Namespace,
    finished: Callable[[Any], tuple[str, float]],
) -> T:
    """Run ``plan`` (:func:`answer_capacity` or ``run_sweep``) on ``question``
    with the ``--workers``, ``--cluster`` and ``--results`` of
    :func:`add_pool_options`, printing ``[done/total] what: 1.2 s`` on stderr
    as each pool or row finishes (``finished`` gives what it was and its
    planning seconds)."""

    def progress(done: int, total: int, piece: Any) -> None:
        what, seconds = finished(piece)
        print(f"[{done}/{total}] {what}: {seconds:.1f} s", file=sys.stderr, flush=True)

    return plan(
        question,
        workers=args.workers,
        cluster=args.cluster,
        results=args.results,
        progress=progress,
    )


def parse_available(texts: list[str], sheet: GpuSheet) -> dict[str, int]:
    """``--gpus-available`` (repeated or comma-separated ``TYPE:MAX``) as
    ``{sheet name: most}``; a type named twice is refused."""
    available: dict[str, int] = {}
    for item in (i for text in texts for i in text.split(",")):
        for gpu, n in parse_gpu_pool([item]).items():  # (each up to a search's)
            name = sheet.resolve(gpu)
            if name in available:
                raise ProblemError(f"--gpus-available names {name} twice")
            available[name] = n
    return available


def _question(args: argparse.Namespace) -> CapacityQuestion:
    missing = [
        flag
        for flag, value in (
            ("--model", args.model),
            ("--tokens", args.tokens),
            ("--prices", args.prices),
            ("--global-batch", args.global_batch),
        )
        if value is None
    ]
    if missing:
        raise ProblemError(f"--gpus-available needs {', '.join(missing)}")
    if (args.deadline is None) == (args.budget is None):
        raise ProblemError("--gpus-available needs --deadline or --budget (one)")
    given = given_flags(
        (
            ("--gpus", args.gpus),
            ("--export", args.export),
            ("--megatron-args", args.megatron_args),
            ("--goodput-grad", args.goodput_grad),
            ("--elastic", args.elastic),
        )
    )
    if given:
        raise ProblemError(f"capacity planning takes no {', '.join(given)}")
    if args.plot:
        require_matplotlib()
    sheet = load_gpu_sheet(args.gpu_sheet)
    available = parse_available(args.gpus_available, sheet)
    return CapacityQuestion(
        model=args.model,
        tokens=args.tokens,
        global_batch=args.global_batch,
        available=available,
        prices=load_price_sheet(args.prices, sheet),
        deadline_s=args.deadline,
        budget=args.budget,
        seq_length=args.seq_len,
        precision=args.precision,
        counts=args.counts,
        gpu_sheet=args.gpu_sheet,
        profiles=args.profiles,
        mixed=bool(args.mixed_types),
        every_plan=bool(args.every_plan),
    )


def _table(answer: CapacityAnswer) -> str:
    currency = answer.question.prices.currency
    # (wide enough for a mixed pool's name, H100-SXM:16,A100-80:16)
    width = max([18, *(len(pool_key(o.pool)) for o in answer.outcomes)])
    rows = [f"{'':2s}{'pool':{width}s} {'rented':{width}s} {'s/iter':>9s} "
            f"{'days':>8s} {'cost ' + currency:>14s}  plan"]  # fmt: skip
    frontier = set(answer.frontier)
    for i, o in enumerate(answer.outcomes):
        mark = "*" if i == answer.choice else ("f" if i in frontier else " ")
        pool = pool_key(o.pool)
        if not o.feasible:
            what = "no plan" if o.dominated_by is None else "dominated"
            rows.append(f"{mark} {pool:{width}s} {what}: {(o.reason or '')[:150]}")
            continue
        used = pool_key(o.used or {})
        rows.append(
            f"{mark} {pool:{width}s} {used:{width}s} {o.iteration_s:9.3f} "
            f"{o.time_s / 86400:8.2f} {o.cost:14,.0f}  {o.shape}"
        )
    return "\n".join(rows)


def _plot(answer: CapacityAnswer, path: str) -> None:
    import matplotlib  # (heavy, optional: only for --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planned = [o for o in answer.outcomes if o.feasible]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([o.time_s / 86400 for o in planned], [o.cost for o in planned],
               s=12, color="0.6", label="candidate")  # fmt: skip
    front = [answer.outcomes[i] for i in answer.frontier]
    ax.plot([o.time_s / 86400 for o in front], [o.cost for o in front], "o-",
            label="Pareto frontier")  # fmt: skip
    for o in front:
        label = pool_key(o.used or {})
        ax.annotate(label, (o.time_s / 86400, o.cost), fontsize=7)
    chosen = answer.outcomes[answer.choice]
    ax.plot([chosen.time_s / 86400], [chosen.cost], "r*", ms=14, label="chosen")
    q = answer.question
    if q.deadline_s is not None:
        ax.axvline(q.deadline_s / 86400, color="r", ls=":", label="deadline")
    else:
        ax.axhline(q.budget, color="r", ls=":", label="budget")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("days to train")
    ax.set_ylabel(f"cost ({q.prices.currency})")
    ax.set_title(f"{q.model}, {q.tokens:.3g} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_capacity(args: argparse.Namespace) -> int:
    """``plan --gpus-available ...``: the answer, printed."""
    question = _question(args)

    def finished(outcome: CandidateOutcome) -> tuple[str, float]:
        return pool_key(outcome.pool), outcome.search_s

    answer = plan_pools(answer_capacity, question, args, finished)
    if args.plot:
        _plot(answer, args.plot)
    if args.json:
        print(json_text(answer.to_json(), indent=1))
        return 0
    chosen = answer.outcomes[answer.choice]
    q = question
    goal = (
        f"least cost within {q.deadline_s / 86400:g} days"
        if q.deadline_s is not None
        else f"least time within {q.budget:,.0f} {q.prices.currency}"
    )
    print(f"capacity: {q.model}, {q.tokens:.4g} tokens, global batch "
          f"{q.global_batch}; {goal}")  # fmt: skip
    if q.prices.example:
        print(f"note: {q.prices.source} is an example price sheet, not quotes")
    print(_table(answer))
    used = pool_key(chosen.used or {})
    print(f"rent {used}: {chosen.time_s / 86400:.2f} days, {chosen.cost:,.0f} "
          f"{q.prices.currency} ({chosen.shape})")  # fmt: skip
    proven = all(o.proven for o in answer.outcomes if o.feasible)
    print(
        f"* chosen, f Pareto frontier; optimal over the {len(answer.outcomes)} "
        "candidate pools under the predictor (every pool planned"
        + (" to its proven optimum" if proven else "; not every plan proven")
        + (
            ", or proven dominated"
            if any(o.dominated_by is not None for o in answer.outcomes)
            else ""
        )
        + ")"
    )
    for path in (args.plot, args.results):
        if path:
            print(f"wrote {path}")
    return 0
