"""``compare``, ``costmodel``, ``profile`` and ``demo``: their arguments; they
run in :mod:`pipedejavu.cli.commands`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipedejavu.cli import problem as cli_problem
from pipedejavu.cli.commands import run_compare, run_costmodel, run_demo, run_profile
from pipedejavu.cli.parsing import add_json_option, count, fraction
from pipedejavu.core.problem import SUBMESH_SPACES
from pipedejavu.core.validation import MAX_MICROBATCHES

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("compare", "costmodel", "profile", "demo")


def add_parsers(commands: Any) -> None:
    """Register :data:`COMMANDS` on the command line's sub-parsers."""
    compare = commands.add_parser(
        "compare", help="run several planners on one problem and measure"
    )
    cli_problem.add_problem_arguments(compare)
    compare.add_argument(
        "--methods",
        help="comma-separated methods (dp,diff,greedy,uniform,anneal when not "
        "given; with typed devices: dp,diff,alpa)",
    )
    _count_option(compare, "--repeats", 1, 1000, "timed runs each", default=3)
    _count_option(compare, "--warmup", 0, 100, "untimed runs first", default=1)
    compare.add_argument(
        "--seed", type=count("--seed", 0, 2**32 - 1), default=0, help="base seed"
    )
    output = compare.add_mutually_exclusive_group()
    add_json_option(output)
    output.add_argument("--csv", action="store_true", help="print CSV")
    compare.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNGs to DIR: Gantt chart of the best plan's simulated 1F1B "
        "schedule, anytime curves, the engine's loss curve (needs matplotlib)",
    )

    _add_costmodel_parsers(
        commands.add_parser(
            "costmodel",
            help="fit and check the cost models on Alpa's profiles",
        )
    )

    profile = commands.add_parser(
        "profile",
        help="time the layers of a flax GPT on this machine's JAX backend and "
        "write the problem",
    )
    profile.add_argument(
        "--model", default="gpt-tiny", help="gpt-micro, gpt-tiny or gpt-small"
    )
    profile.add_argument(
        "--out",
        required=True,
        help="the problem .npz to write (.npz is appended if missing)",
    )
    profile.add_argument(
        "--cluster",
        metavar="HxD",
        default="1x1",
        help="cluster to model, hosts x devices per host with devices per host a "
        "power of two (1x1 is what was measured; more devices are modelled as "
        "data parallelism, see costmodel.profiling)",
    )
    profile.add_argument(
        "--num-microbatches",
        "-B",
        type=count("--num-microbatches", 1, MAX_MICROBATCHES),
        default=8,
        metavar="B",
        help="micro-batches B stored in the problem",
    )
    _count_option(profile, "--repeats", 1, 10_000, "timed rounds", default=10)
    _count_option(profile, "--warmup", 0, 1000, "untimed calls", default=2)

    demo = commands.add_parser(
        "demo",
        help="solve the bundled real Alpa profiles and generated instances",
    )
    add_json_option(demo, "print plans as JSON lines")
    demo.add_argument(
        "--alpa-scan",
        action="store_true",
        help="also run Alpa's own algorithm on the generated 32-layer instance "
        "(about 40 s on 2 cores: it evaluates thousands of caps; the demo prints "
        "both counts)",
    )


def _count_option(
    parser: argparse.ArgumentParser,
    flag: str,
    low: int,
    high: int,
    help: str,
    *,
    default: int,
) -> None:
    """``flag``: an integer from ``low`` to ``high``, that range in its help."""
    parser.add_argument(
        flag,
        type=count(flag, low, high),
        default=default,
        help=f"{help}, {low} to {high}",
    )


def _add_costmodel_parsers(costmodel: argparse.ArgumentParser) -> None:
    models = costmodel.add_subparsers(dest="costmodel_command", required=True)
    report = models.add_parser(
        "report",
        help="fit every collective of a prof_database.pkl, one row a fit",
    )
    report.add_argument(
        "prof_db", help="Alpa's prof_database.pkl ('bundled' for the bundled one)"
    )
    add_json_option(report)
    report.add_argument("--plot", metavar="DIR", help="write log-log PNGs to DIR")
    report.add_argument(
        "--folds",
        type=count("--folds", 2, 1000),
        default=5,
        help="k of the held-out k-fold error, 2 to 1000 (at most the points of "
        "a curve)",
    )
    predict = models.add_parser(
        "predict",
        help="predict a stage profile from a fraction of it: held-out error and "
        "plan regret",
    )
    predict.add_argument(
        "stage_profile",
        help="an Alpa stage-profile .npy, a problem .npz, or a bundled example name",
    )
    predict.add_argument(
        "--fraction",
        type=fraction("--fraction"),
        action="append",
        help="fraction of entries profiled, in (0, 1] (repeatable; 0.1 0.25 0.5 1 "
        "when not given)",
    )
    _count_option(predict, "--seeds", 1, 1000, "random draws per fraction", default=3)
    predict.add_argument("--cluster", metavar="HxD", help="for an Alpa .npy")
    predict.add_argument(
        "--num-microbatches",
        "-B",
        type=count("--num-microbatches", 1, MAX_MICROBATCHES),
        metavar="B",
        help="for an Alpa .npy",
    )
    predict.add_argument(
        "--submesh-space",
        choices=[space for space in SUBMESH_SPACES if space != "manual"],
        default="small_power_of_two",
        help="for an Alpa .npy",
    )
    predict.add_argument(
        "--support",
        choices=["profiled", "all"],
        default="profiled",
        help="stages the planner may use: those Alpa profiled, or all the model "
        "predicts, filtered by the predicted memory limit",
    )
    predict.add_argument(
        "--refine",
        action="store_true",
        help="profile the plan's predicted stages and re-plan until it uses "
        "measured stages only (reports the extra entries)",
    )
    predict.add_argument(
        "--design",
        choices=["short", "uniform"],
        default="short",
        help="which entries to profile: favour short stages, or uniform",
    )
    add_json_option(predict)


def run(args: argparse.Namespace) -> None:
    """Run a command of :data:`COMMANDS`; errors propagate to the CLI."""
    if args.command == "compare":
        run_compare(cli_problem.load(args), args)
    elif args.command == "costmodel":
        run_costmodel(args)
    elif args.command == "profile":
        run_profile(args)
    else:
        run_demo(sys.stdout, as_json=args.json, alpa_scan=args.alpa_scan)
