"""``solve``, ``inspect``, ``convert`` and ``evaluate``: the commands on one
problem (a file or a bundled example, with a cluster file), and the arguments
that name it (``compare`` takes them too)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pipedejavu.cli.formatting import format_inspection, format_plan
from pipedejavu.cli.parsing import add_json_option, count
from pipedejavu.core.errors import PlanError, ProblemError
from pipedejavu.core.files import json_text
from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import evaluate_hetero
from pipedejavu.core.npzfile import npz_output_path
from pipedejavu.core.problem import SUBMESH_SPACES, Problem, evaluate
from pipedejavu.core.validation import MAX_MICROBATCHES
from pipedejavu.planning.inputs import (
    example_names,
    load_plan,
    load_problem,
    parse_cluster,
)
from pipedejavu.planning.solve import solve

__all__ = ["COMMANDS", "add_parsers", "add_problem_arguments", "load", "run"]

COMMANDS = ("solve", "inspect", "convert", "evaluate")


def add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments naming a problem: a file or example, its cluster, B, a
    cluster file and Alpa's submesh space (:func:`load` reads them)."""
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


def add_parsers(commands: Any) -> None:
    """Register :data:`COMMANDS` on the command line's sub-parsers."""
    solve = commands.add_parser("solve", help="find a plan for a problem")
    add_problem_arguments(solve)
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
    add_json_option(
        solve,
        "print only the plan JSON on stdout (with lower_bound and gap when the "
        "method certifies its plan)",
    )

    inspect = commands.add_parser("inspect", help="sizes and coverage of a problem")
    add_problem_arguments(inspect)

    convert = commands.add_parser(
        "convert",
        help="write a problem .npz: from an Alpa stage profile, an example, or "
        "with a cluster file (a heterogeneous problem)",
    )
    add_problem_arguments(convert)
    convert.add_argument(
        "output", help="the problem .npz to write (.npz is appended if missing)"
    )

    evaluate = commands.add_parser(
        "evaluate",
        help="check a plan JSON (from solve --json or elsewhere) against a "
        "problem and price it exactly",
    )
    add_problem_arguments(evaluate)
    evaluate.add_argument("plan", help="the plan JSON file")


def load(args: argparse.Namespace) -> Problem | HeteroProblem:
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
    problem = load(args)
    options = _solve_options(args, isinstance(problem, HeteroProblem))
    plan = solve(problem, args.method, **options)
    if args.json:
        print(json_text(plan.to_json()))
    else:
        print(format_plan(problem, plan))


def _run_convert(args: argparse.Namespace) -> None:
    output = npz_output_path(args.output)  # before any work
    problem = load(args)
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
    problem = load(args)
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


def run(args: argparse.Namespace) -> None:
    """Run a command of :data:`COMMANDS`; errors propagate to the CLI."""
    if args.command == "solve":
        _run_solve(args)
    elif args.command == "inspect":
        print(format_inspection(load(args)))
    elif args.command == "convert":
        _run_convert(args)
    else:
        _run_evaluate(args)
