"""``pipedejavu`` command line: parse, call the API, print. Thin on purpose.

Exit codes: 0 success; 2 bad input (one line on stderr naming the file or the
argument); 3 no feasible plan (with the reason); 141 stdout closed early by its
reader (``pipedejavu ... | head``), nothing printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from pipedejavu.cli import data as cli_data
from pipedejavu.cli import goodput as cli_goodput
from pipedejavu.cli import init_search as cli_init_search
from pipedejavu.cli import megatron as cli_megatron
from pipedejavu.cli.commands import run_compare, run_costmodel, run_demo, run_profile
from pipedejavu.cli.formatting import format_inspection, format_plan
from pipedejavu.cli.parsing import (
    EXIT_BAD_INPUT,
    Parser,
    count,
    fraction,
    join_number_lists,
)
from pipedejavu.core.errors import InfeasibleProblemError, PlanError, ProblemError
from pipedejavu.core.files import json_text
from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import evaluate_hetero
from pipedejavu.core.npzfile import npz_output_path
from pipedejavu.core.problem import SUBMESH_SPACES, Problem, evaluate
from pipedejavu.core.validation import MAX_MICROBATCHES
from pipedejavu.core.version import __version__
from pipedejavu.planning.inputs import (
    example_names,
    load_plan,
    load_problem,
    parse_cluster,
)
from pipedejavu.planning.solve import solve
from pipedejavu.search.engine.compile_cache import enable_compilation_cache

EXIT_OK, EXIT_INFEASIBLE = 0, 3
#: Exit status when stdout's reader closed the pipe early (128 + SIGPIPE, what a
#: shell reports for ``yes | head``); nothing is printed.
EXIT_BROKEN_PIPE = 141


def _add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "problem",
        help="a problem .npz, an Alpa stage-profile .npy, or a bundled example: "
        + ", ".join(example_names()),
    )
    parser.add_argument(
        "--cluster",
        metavar="HxD",
        help="hosts x devices per host Alpa was given (needed for an Alpa .npy; "
        "checked against a .npz or an example)",
    )
    parser.add_argument(
        "--num-microbatches",
        "-B",
        type=count("--num-microbatches", 1, MAX_MICROBATCHES),
        metavar="B",
        help="micro-batches (needed for an Alpa .npy; replaces a .npz's or an "
        "example's B)",
    )
    parser.add_argument(
        "--cluster-file",
        metavar="FILE",
        help="a cluster of typed hosts and links (.json/.toml, or the bundled "
        "a100-v100-4x8); makes the problem heterogeneous: costs scaled by each "
        "type's speed, activation transfers priced from the .npz's "
        "boundary_bytes or activation_bytes (zero if absent)",
    )
    parser.add_argument(
        "--submesh-space",
        choices=[space for space in SUBMESH_SPACES if space != "manual"],
        help="Alpa's submesh_physical_shape_space of an Alpa .npy "
        "(small_power_of_two when not given)",
    )


def _subparser(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    return commands.add_parser(name, **kwargs)


def _build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pipedejavu",
        description="Split a model into pipeline stages and map them onto "
        "submeshes (Alpa's formulation; typed devices and links with a cluster "
        "file).",
    )
    parser.add_argument(
        "--version", action="version", version=f"pipedejavu {__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    solve = _subparser(commands, "solve", help="find a plan for a problem")
    _add_problem_arguments(solve)
    solve.add_argument(
        "--method",
        default="dp",
        help="dp, diff, brute_force, uniform, greedy, random, anneal; with typed "
        "devices (a --cluster-file or a heterogeneous problem): dp, diff, alpa, "
        "brute_force",
    )
    solve.add_argument(
        "--restarts",
        type=count("--restarts", 1, 4096),
        help="diff: random restarts optimized at once, 1 to 4096 (the engine's "
        "default when not given)",
    )
    solve.add_argument(
        "--steps",
        type=count("--steps", 1, 100_000),
        help="diff: optimizer steps per restart, 1 to 100000 (the engine's "
        "default when not given)",
    )
    solve.add_argument(
        "--seed",
        type=count("--seed", 0, 2**32 - 1),
        default=0,
        help="random seed of diff, anneal and random",
    )
    solve.add_argument(
        "--alpa-compatible",
        action="store_true",
        help="reproduce Alpa's training_dp answer exactly, 1e-6 candidate gap "
        "included (homogeneous problems; with typed devices use --method alpa)",
    )
    solve.add_argument(
        "--json",
        action="store_true",
        help="print only the plan JSON on stdout (with lower_bound and gap when "
        "the method certifies its plan)",
    )

    inspect = _subparser(commands, "inspect", help="sizes and coverage of a problem")
    _add_problem_arguments(inspect)

    convert = _subparser(
        commands,
        "convert",
        help="write a problem .npz: from an Alpa stage profile, an example, or "
        "with a cluster file (a heterogeneous problem)",
    )
    _add_problem_arguments(convert)
    convert.add_argument(
        "output", help="the problem .npz to write (.npz is appended if missing)"
    )

    evaluate = _subparser(
        commands,
        "evaluate",
        help="check a plan JSON (from solve --json or elsewhere) against a "
        "problem and price it exactly",
    )
    _add_problem_arguments(evaluate)
    evaluate.add_argument("plan", help="the plan JSON file")

    compare = _subparser(
        commands, "compare", help="run several planners on one problem and measure"
    )
    _add_problem_arguments(compare)
    compare.add_argument(
        "--methods",
        help="comma-separated methods (dp,diff,greedy,uniform,anneal when not "
        "given; with typed devices: dp,diff,alpa)",
    )
    compare.add_argument(
        "--repeats",
        type=count("--repeats", 1, 1000),
        default=3,
        help="timed runs each, 1 to 1000",
    )
    compare.add_argument(
        "--warmup",
        type=count("--warmup", 0, 100),
        default=1,
        help="untimed runs first, 0 to 100",
    )
    compare.add_argument(
        "--seed", type=count("--seed", 0, 2**32 - 1), default=0, help="base seed"
    )
    output = compare.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--csv", action="store_true", help="print CSV")
    compare.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNGs to DIR: Gantt chart of the best plan's simulated 1F1B "
        "schedule, anytime curves, the engine's loss curve (needs matplotlib)",
    )

    _add_costmodel_parsers(
        _subparser(
            commands,
            "costmodel",
            help="fit and check the cost models on Alpa's profiles",
        )
    )

    profile = _subparser(
        commands,
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
    profile.add_argument(
        "--repeats",
        type=count("--repeats", 1, 10_000),
        default=10,
        help="timed rounds, 1 to 10000",
    )
    profile.add_argument(
        "--warmup",
        type=count("--warmup", 0, 1000),
        default=2,
        help="untimed calls, 0 to 1000",
    )

    demo = _subparser(
        commands,
        "demo",
        help="solve the bundled real Alpa profiles and generated instances",
    )
    demo.add_argument("--json", action="store_true", help="print plans as JSON lines")
    demo.add_argument(
        "--alpa-scan",
        action="store_true",
        help="also run Alpa's own algorithm on the generated 32-layer instance "
        "(about 40 s on 2 cores: it evaluates thousands of caps; the demo prints "
        "both counts)",
    )
    cli_data.add_parser(commands)
    cli_init_search.add_parser(commands)
    cli_goodput.add_parsers(commands)  # goodput fit|optimize, elastic
    cli_megatron.add_parsers(commands)
    return parser


def _add_costmodel_parsers(costmodel: argparse.ArgumentParser) -> None:
    models = costmodel.add_subparsers(dest="costmodel_command", required=True)
    report = _subparser(
        models,
        "report",
        help="fit every collective of a prof_database.pkl, one row a fit",
    )
    report.add_argument(
        "prof_db", help="Alpa's prof_database.pkl ('bundled' for the bundled one)"
    )
    report.add_argument("--json", action="store_true", help="print JSON")
    report.add_argument("--plot", metavar="DIR", help="write log-log PNGs to DIR")
    report.add_argument(
        "--folds",
        type=count("--folds", 2, 1000),
        default=5,
        help="k of the held-out k-fold error, 2 to 1000 (at most the points of "
        "a curve)",
    )
    predict = _subparser(
        models,
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
    predict.add_argument(
        "--seeds",
        type=count("--seeds", 1, 1000),
        default=3,
        help="random draws per fraction, 1 to 1000",
    )
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
    predict.add_argument("--json", action="store_true", help="print JSON")


def _load(args: argparse.Namespace) -> Problem | HeteroProblem:
    """The problem the arguments name (file or example, with a cluster file)."""
    return load_problem(
        args.problem,
        cluster_shape=parse_cluster(args.cluster) if args.cluster else None,
        num_microbatches=args.num_microbatches,
        submesh_space=args.submesh_space,
        cluster=args.cluster_file,
    )


class _ScanProgress:
    """Progress of Alpa's cap scan on stderr, every 2 s once it runs past 2 s."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last = self.started

    def __call__(self, position: int, total: int, evaluated: int) -> None:
        now = time.perf_counter()
        if now - self.last >= 2.0:
            self.last = now
            print(
                f"alpa scan: cap {position + 1} of {total}, {evaluated} evaluated, "
                f"{now - self.started:.0f} s",
                file=sys.stderr,
                flush=True,
            )


class _SearchProgress:
    """Progress of the differentiable search on stderr once it runs past 2 s
    (and at once when it has many restarts: a long run)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, done: int, total: int, best_loss: float) -> None:
        elapsed = time.perf_counter() - self.started
        if done == 0:
            print(
                f"diff: {total} steps for many restarts (compiling first)",
                file=sys.stderr,
                flush=True,
            )
        elif elapsed >= 2.0:
            print(
                f"diff: step {done} of {total}, best relaxed loss so far "
                f"{best_loss:.4g} s, {elapsed:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    def message(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def _solve_options(args: argparse.Namespace, hetero: bool) -> dict[str, Any]:
    """``solve`` options from the flags; flags that do not apply are refused."""
    if args.alpa_compatible:
        if hetero:
            raise ProblemError(
                "--alpa-compatible reproduces Alpa's training_dp on a homogeneous "
                "problem; with typed devices use --method alpa (Alpa's way)"
            )
        if args.method != "dp":
            raise ProblemError("--alpa-compatible applies to --method dp")
        return {"alpa_compatible": True, "progress_fn": _ScanProgress()}
    tuned = args.restarts is not None or args.steps is not None
    if args.method != "diff" and tuned:
        raise ProblemError("--restarts and --steps apply to --method diff")
    if args.method == "diff" and hetero:
        if tuned:
            raise ProblemError(
                "--restarts/--steps apply to the homogeneous engine only"
            )
        return {"seed": args.seed}
    if args.method == "diff":
        progress = _SearchProgress()
        options: dict[str, Any] = {
            "seed": args.seed,
            "progress_fn": progress,
            "message_fn": progress.message,
        }
        if args.restarts is not None:
            options["num_restarts"] = args.restarts
        if args.steps is not None:
            options["num_steps"] = args.steps
        return options
    if args.method in ("anneal", "random"):
        return {"seed": args.seed}
    if args.method == "dp" and not hetero:
        return {"progress_fn": lambda line: print(line, file=sys.stderr, flush=True)}
    return {}


def _run_solve(args: argparse.Namespace) -> None:
    problem = _load(args)
    options = _solve_options(args, isinstance(problem, HeteroProblem))
    plan = solve(problem, args.method, **options)
    if args.json:
        print(json_text(plan.to_json()))
    else:
        print(format_plan(problem, plan))


def _run_convert(args: argparse.Namespace) -> None:
    output = npz_output_path(args.output)  # before any work
    problem = _load(args)
    written = problem.to_npz(output)
    if isinstance(problem, HeteroProblem):
        where = f"cluster {problem.cluster.describe()}"
    else:
        where = f"cluster {problem.cluster_shape[0]}x{problem.cluster_shape[1]}"
    print(
        f"wrote {written}: L = {problem.num_layers}, M = {problem.num_submeshes}, "
        f"K = {problem.num_configs}, {where}, B = {problem.num_microbatches}"
    )


def _run_evaluate(args: argparse.Namespace) -> None:
    problem = _load(args)
    plan = load_plan(args.plan)
    hetero = isinstance(problem, HeteroProblem)
    if hetero and not isinstance(plan, HeteroPlan):
        raise ProblemError(
            f"{args.plan} holds a plan without device types and hosts; "
            f"{args.problem} has typed devices and needs a placed plan"
        )
    if not hetero and isinstance(plan, HeteroPlan):
        raise ProblemError(
            f"{args.plan} holds a placed plan (device types, hosts); "
            f"{args.problem} is a homogeneous problem"
        )
    if plan.num_microbatches != problem.num_microbatches:
        # (the API prices a plan on another B on purpose, e.g. as a score)
        raise ProblemError(
            f"{args.plan}: the plan runs B = {plan.num_microbatches:.4g} "
            f"micro-batches, {args.problem} B = {problem.num_microbatches}"
        )
    try:
        cost = evaluate_hetero(problem, plan) if hetero else evaluate(problem, plan)
    except PlanError as error:
        raise ProblemError(f"{args.plan}: {error}") from None
    print(
        f"{args.plan}: a valid plan of {len(plan.stages)} stage(s), "
        f"{cost:.6f} s per iteration (the file says {plan.cost:.6f} s)"
    )


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stdout.flush()  # keep warnings next to the output they concern
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    try:
        raw = sys.argv[1:] if argv is None else argv
        args = _build_parser().parse_args(join_number_lists(raw))
    except SystemExit as stop:  # --help and --version exit 0; bad usage returns
        if stop.code == EXIT_BAD_INPUT:
            return EXIT_BAD_INPUT
        raise
    # The one place the persistent compilation cache is switched on by us
    # ($PIPEDEJAVU_CACHE_DIR, "off" to keep it off; a cache the user set wins).
    enable_compilation_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _show_warning
        try:
            code = _run(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
        except BrokenPipeError:
            return _closed_pipe()
        return code


def _closed_pipe() -> int:
    """The reader of stdout went away (``pipedejavu ... | head``): stop
    quietly, with the status a shell gives a command killed by SIGPIPE."""
    try:  # the interpreter's final flush must not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (tests)
        pass
    return EXIT_BROKEN_PIPE


#: The most characters of an error line (a message quoting a hostile input
#: whole, e.g. a million hosts, would print megabytes).
MAX_ERROR_CHARS = 2000


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) <= MAX_ERROR_CHARS:
        return text
    cut = len(text) - MAX_ERROR_CHARS
    return f"{text[:MAX_ERROR_CHARS]}... ({cut:,} more characters)"


def _run(args: argparse.Namespace) -> int:
    if args.command == "init-search":
        return cli_init_search.run(args)
    try:
        if args.command == "solve":
            _run_solve(args)
        elif args.command == "inspect":
            print(format_inspection(_load(args)))
        elif args.command == "convert":
            _run_convert(args)
        elif args.command == "evaluate":
            _run_evaluate(args)
        elif args.command == "compare":
            run_compare(_load(args), args)
        elif args.command == "costmodel":
            run_costmodel(args)
        elif args.command == "profile":
            run_profile(args)
        elif args.command == "data":
            cli_data.run(args)
        elif args.command == "demo":
            run_demo(sys.stdout, as_json=args.json, alpa_scan=args.alpa_scan)
        elif args.command in ("goodput", "elastic"):
            return cli_goodput.run(args)
        elif args.command in cli_megatron.COMMANDS:
            return cli_megatron.run(args)
    except ProblemError as error:
        print(f"pipedejavu: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InfeasibleProblemError as error:
        print(f"pipedejavu: no feasible plan: {_one_line(error)}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except BrokenPipeError:
        raise  # stdout's reader went away: main stops quietly
    except OSError as error:
        print(f"pipedejavu: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
