"""``pipedejavu`` command line: parse, call the API, print. Thin on purpose.

Exit codes: 0 success; 2 bad input (one line on stderr); 3 no feasible plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from .problem import SUBMESH_SPACES, InfeasibleProblemError, Plan, Problem, ProblemError

EXIT_OK, EXIT_BAD_INPUT, EXIT_INFEASIBLE = 0, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors are bad input too
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "problem",
        help="a problem .npz, an Alpa stage-profile .npy, or a bundled example: "
        "gpt1.3b-6layers-B32, gpt1.3b-6layers-B128, gpt1.3b-12layers-B32, "
        "generated-gpt-32layers-2x8",
    )
    parser.add_argument(
        "--cluster",
        metavar="HxD",
        help="hosts x devices per host Alpa was given (needed for an Alpa .npy)",
    )
    parser.add_argument(
        "--num-microbatches",
        "-B",
        type=int,
        metavar="B",
        help="micro-batches (needed for an Alpa .npy; overrides a .npz's B)",
    )
    parser.add_argument(
        "--cluster-file",
        metavar="FILE",
        help="a cluster of typed hosts and links (.json/.toml); makes the problem "
        "heterogeneous: costs scaled by each type's speed, activation transfers "
        "priced from the .npz's boundary_bytes or activation_bytes (zero if "
        "absent)",
    )
    parser.add_argument(
        "--submesh-space",
        choices=[space for space in SUBMESH_SPACES if space != "manual"],
        default="small_power_of_two",
        help="Alpa's submesh_physical_shape_space for an Alpa .npy "
        "(default: %(default)s)",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pipedejavu",
        description="Split a model into pipeline stages and map them onto "
        "submeshes (Alpa's formulation).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    solve = commands.add_parser("solve", help="find a plan for a problem")
    _add_problem_arguments(solve)
    solve.add_argument(
        "--method",
        default="dp",
        help="dp (default), diff, brute_force, uniform, greedy, random, anneal; "
        "with typed devices (--cluster-file): dp, diff, alpa, brute_force",
    )
    solve.add_argument(
        "--restarts", type=int, help="diff: random restarts optimized at once"
    )
    solve.add_argument("--steps", type=int, help="diff: optimizer steps per restart")
    solve.add_argument("--seed", type=int, default=0, help="diff: random seed")
    solve.add_argument(
        "--alpa-compatible",
        action="store_true",
        help="reproduce Alpa's training_dp answer exactly, 1e-6 candidate gap included",
    )
    solve.add_argument(
        "--json", action="store_true", help="print only the plan JSON on stdout"
    )

    inspect = commands.add_parser("inspect", help="sizes and coverage of a problem")
    _add_problem_arguments(inspect)

    convert = commands.add_parser(
        "convert", help="turn an Alpa stage profile into a problem .npz"
    )
    _add_problem_arguments(convert)
    convert.add_argument("output", help="the problem .npz to write")

    compare = commands.add_parser(
        "compare", help="run several planners on one problem and measure them"
    )
    _add_problem_arguments(compare)
    compare.add_argument(
        "--methods",
        help="comma-separated methods (default: dp,diff,greedy,uniform,anneal; "
        "with typed devices: dp,diff,alpa)",
    )
    compare.add_argument("--repeats", type=int, default=3, help="timed runs each")
    compare.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    compare.add_argument("--seed", type=int, default=0, help="base seed")
    output = compare.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--csv", action="store_true", help="print CSV")
    compare.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNGs to DIR: Gantt chart of the best plan's simulated 1F1B "
        "schedule, anytime curves, the engine's loss curve (needs matplotlib)",
    )

    costmodel = commands.add_parser(
        "costmodel", help="fit and check the cost models on Alpa's profiles"
    )
    models = costmodel.add_subparsers(dest="costmodel_command", required=True)
    report = models.add_parser(
        "report", help="fit every collective of a prof_database.pkl, one row a fit"
    )
    report.add_argument(
        "prof_db", help="Alpa's prof_database.pkl ('bundled' for the bundled one)"
    )
    report.add_argument("--json", action="store_true", help="print JSON")
    report.add_argument("--plot", metavar="DIR", help="write log-log PNGs to DIR")
    report.add_argument(
        "--folds", type=int, default=5, help="k of the held-out k-fold error"
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
        type=float,
        action="append",
        help="fraction of entries profiled (repeatable; default 0.1 0.25 0.5 1)",
    )
    predict.add_argument(
        "--seeds", type=int, default=3, help="random draws per fraction"
    )
    predict.add_argument("--cluster", metavar="HxD", help="for an Alpa .npy")
    predict.add_argument("--num-microbatches", "-B", type=int, help="for an Alpa .npy")
    predict.add_argument(
        "--submesh-space",
        choices=[space for space in SUBMESH_SPACES if space != "manual"],
        default="small_power_of_two",
        help="for an Alpa .npy (default: %(default)s)",
    )
    predict.add_argument(
        "--support",
        choices=["profiled", "all"],
        default="profiled",
        help="stages the planner may use: those Alpa profiled (default), or all "
        "the model predicts, filtered by the predicted memory limit",
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
        help="which entries to profile: favour short stages (default) or uniform",
    )
    predict.add_argument("--json", action="store_true", help="print JSON")

    profile = commands.add_parser(
        "profile",
        help="time the layers of a flax GPT on this machine's JAX backend and "
        "write the problem",
    )
    profile.add_argument(
        "--model", default="gpt-tiny", help="gpt-micro, gpt-tiny (default), gpt-small"
    )
    profile.add_argument("--out", required=True, help="the problem .npz to write")
    profile.add_argument(
        "--cluster",
        metavar="HxD",
        default="1x1",
        help="cluster to model (default 1x1: what was measured; more devices "
        "are modelled as data parallelism, see costmodel.profiler)",
    )
    profile.add_argument("--num-microbatches", "-B", type=int, default=8)
    profile.add_argument("--repeats", type=int, default=10, help="timed rounds")
    profile.add_argument("--warmup", type=int, default=2, help="untimed calls")

    demo = commands.add_parser(
        "demo", help="solve the bundled real Alpa profiles and a generated instance"
    )
    demo.add_argument("--json", action="store_true", help="print plans as JSON lines")
    from .cli_megatron import add_parsers

    add_parsers(commands)
    return parser


def _load(args: argparse.Namespace) -> Problem:
    problem = _load_base(args)
    cluster_file = getattr(args, "cluster_file", None)
    if cluster_file is None:
        return problem
    from .cluster import Cluster
    from .hetero import HeteroProblem

    if isinstance(problem, HeteroProblem):
        raise ProblemError(
            f"{args.problem} already describes its cluster; drop --cluster-file"
        )
    boundary = None
    if str(args.problem).endswith(".npz"):
        with np.load(args.problem, allow_pickle=False) as data:
            if "boundary_bytes" in data:
                boundary = data["boundary_bytes"]
            elif "activation_bytes" in data:  # `pipedejavu profile` output
                boundary = data["activation_bytes"][:-1].astype(np.float64)
    return HeteroProblem.from_problem(
        problem, Cluster.from_file(cluster_file), boundary_bytes=boundary
    )


def _load_base(args: argparse.Namespace) -> Problem:
    import os

    from .io import example_names, load_example, load_problem, parse_cluster

    if args.problem in example_names() and not os.path.exists(args.problem):
        problem = load_example(args.problem)
        if args.num_microbatches is not None:
            problem = problem.replace(num_microbatches=args.num_microbatches)
        return problem
    if os.path.exists(args.problem) and sniff_npz_hetero(args.problem):
        from .hetero import HeteroProblem

        problem = HeteroProblem.from_npz(args.problem)
        if args.num_microbatches is not None:
            problem = problem.replace(num_microbatches=args.num_microbatches)
        return problem
    cluster = parse_cluster(args.cluster) if args.cluster else None
    return load_problem(
        args.problem,
        cluster_shape=cluster,
        num_microbatches=args.num_microbatches,
        submesh_space=args.submesh_space,
    )


def sniff_npz_hetero(path: str) -> bool:
    """Whether ``path`` is a heterogeneous problem ``.npz`` (has a cluster)."""
    from .io import sniff_format

    if sniff_format(path) != "npz":
        return False
    with np.load(path, allow_pickle=False) as data:
        return "cluster_json" in data.files


def format_hetero_plan(problem, plan) -> str:
    """A readable table of a placed plan on typed devices."""
    cluster = problem.cluster
    lines = [
        f"method {plan.method}: {plan.num_stages} stage(s) on {cluster.describe()}, "
        f"B = {plan.num_microbatches}",
        f"{'stage':>5}  {'layers':>9}  {'submesh':>7}  {'type':>8}  {'hosts':>9}  "
        f"{'config':>6}  {'latency (s)':>12}  {'transfer (s)':>12}",
    ]
    for index, stage in enumerate(plan.stages):
        layers = f"{stage.start}-{stage.stop - 1}"
        submesh = f"{stage.submesh[0]}x{stage.submesh[1]}"
        hosts = ",".join(str(h) for h in stage.hosts)
        kind = cluster.device_types[stage.device_type].name
        transfer = (
            f"{plan.transfers[index]:12.6f}" if index < len(plan.transfers) else ""
        )
        lines.append(
            f"{index:>5}  {layers:>9}  {submesh:>7}  {kind:>8}  {hosts:>9}  "
            f"{stage.config_index:>6}  {stage.latency:>12.6f}  {transfer:>12}"
        )
    if "lower_bound" in plan.info:
        lines.append(
            f"lower bound {plan.info['lower_bound']:.6f} s: the plan is within "
            f"{100 * plan.info['gap']:.2f}% of the optimum"
        )
    lines.append(
        f"total: {plan.cost:.6f} s per iteration (stages + transfers + (B-1) x "
        f"bottleneck), {plan.inter_host_hops(cluster)} inter-host hop(s), "
        f"search {plan.search_time_s * 1e3:.1f} ms"
    )
    return "\n".join(lines)


def format_plan(problem: Problem, plan: Plan) -> str:
    """A readable plan table."""
    from .hetero import HeteroPlan

    if isinstance(plan, HeteroPlan):
        return format_hetero_plan(problem, plan)
    lines = [
        f"method {plan.method}: {plan.num_stages} stage(s) on "
        f"{problem.cluster_shape[0]}x{problem.cluster_shape[1]} = "
        f"{problem.num_devices} devices, B = {plan.num_microbatches}",
        f"{'stage':>5}  {'layers':>9}  {'submesh':>7}  {'devices':>7}  "
        f"{'config':>6}  {'latency (s)':>12}",
    ]
    for index, stage in enumerate(plan.stages):
        layers = f"{stage.start}-{stage.stop - 1}"
        submesh = f"{stage.submesh[0]}x{stage.submesh[1]}"
        lines.append(
            f"{index:>5}  {layers:>9}  {submesh:>7}  {stage.num_devices:>7}  "
            f"{stage.config_index:>6}  {stage.latency:>12.6f}"
        )
    latencies = [stage.latency for stage in plan.stages]
    if "lower_bound" in plan.info:
        lines.append(
            f"lower bound {plan.info['lower_bound']:.6f} s: the plan is within "
            f"{100 * plan.info['gap']:.2f}% of the optimum"
        )
    lines.append(
        f"total: sum {sum(latencies):.6f} s + (B-1) x max {max(latencies):.6f} s "
        f"= {plan.cost:.6f} s per iteration   "
        f"(search {plan.search_time_s * 1e3:.1f} ms)"
    )
    return "\n".join(lines)


def format_inspection(problem: Problem) -> str:
    """Sizes, coverage and feasibility of a problem, one fact a line."""
    from pipedejavu.baselines.exact_dp import explain_infeasible, min_sum_plan

    table = problem.compute_cost
    upper = np.triu(np.ones((problem.num_layers,) * 2, dtype=bool))
    entries = table[upper]
    finite = np.isfinite(entries)
    feasible = finite & (problem.max_n_succ_stages[upper] >= 0)
    shapes = ", ".join(f"{h}x{d}" for h, d in problem.submesh_shapes.tolist())
    plan_exists = np.isfinite(min_sum_plan(problem)[0])
    lines = [
        f"layers L = {problem.num_layers}, submeshes M = {problem.num_submeshes} "
        f"({shapes}), configs K = {problem.num_configs}",
        f"cluster {problem.cluster_shape[0]}x{problem.cluster_shape[1]} = "
        f"{problem.num_devices} devices, micro-batches B = {problem.num_microbatches}",
        f"stage entries (i <= j): {entries.size}",
        f"  finite (profiled): {int(finite.sum())}",
        f"  memory-feasible:   {int(feasible.sum())}",
        f"  missing (inf):     {int((~finite).sum())}",
    ]
    if finite.any():
        lines.append(
            f"finite latency range: {entries[finite].min():.6g} .. "
            f"{entries[finite].max():.6g} s"
        )
    lines.append(
        "feasible plan: yes"
        if plan_exists
        else f"feasible plan: no ({explain_infeasible(problem)})"
    )
    return "\n".join(lines)


def _demo(out: TextIO, as_json: bool) -> None:
    from .api import solve
    from .generate import random_problem
    from .io import bundled_examples

    cases = [
        (example.name, example.description, example.load)
        for example in bundled_examples()
    ]
    cases.append(
        (
            "generated-gpt-32layers-2x8",
            "generated GPT-like model, 32 layers, 2x8 cluster, power_of_two "
            "submeshes, 2 configs, B = 32 (pipedejavu.generate.random_problem)",
            lambda: random_problem(32, (2, 8), num_microbatches=32, seed=0),
        )
    )
    for name, description, load in cases:
        problem = load()
        try:
            plan = solve(problem, "dp")
            alpa = solve(problem, "dp", alpa_compatible=True)
        except InfeasibleProblemError as error:
            if as_json:
                print(json.dumps({"example": name, "infeasible": str(error)}), file=out)
            else:
                print(
                    f"== {name}: {description}\nno feasible plan: {error}\n", file=out
                )
            continue
        if as_json:
            print(json.dumps({"example": name, "plan": plan.to_json()}), file=out)
            continue
        same = [s.to_json() for s in plan.stages] == [s.to_json() for s in alpa.stages]
        print(f"== {name}: {description}", file=out)
        print(format_plan(problem, plan), file=out)
        print(
            f"Alpa's training_dp (alpa-compatible): "
            f"{'same plan' if same else 'a different plan'}, cost {alpa.cost:.6f} s, "
            f"{alpa.info['num_evaluated']} caps evaluated in "
            f"{alpa.search_time_s * 1e3:.1f} ms vs {plan.info['num_evaluated']} in "
            f"{plan.search_time_s * 1e3:.1f} ms",
            file=out,
        )
        if name.startswith("generated"):
            engine = solve(problem, "diff", seed=0)
            print(
                f"differentiable engine (--method diff): cost {engine.cost:.6f} s "
                f"({engine.cost / plan.cost:.5f} x the optimum), certified within "
                f"{100 * engine.info['gap']:.3f}% of its lower bound, "
                f"{engine.search_time_s:.1f} s (JAX compilation included)",
                file=out,
            )
        print(file=out)


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
    """Progress of the differentiable search on stderr once it runs past 2 s."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, done: int, total: int, best_loss: float) -> None:
        elapsed = time.perf_counter() - self.started
        if elapsed >= 2.0:
            print(
                f"diff: step {done} of {total}, best relaxed loss {best_loss:.4g}, "
                f"{elapsed:.0f} s",
                file=sys.stderr,
                flush=True,
            )


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stdout.flush()  # keep warnings next to the output they concern
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _show_warning
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "solve":
            from .api import solve

            problem = _load(args)
            options: dict = {}
            if args.alpa_compatible:
                if args.method != "dp":
                    raise ProblemError("--alpa-compatible applies to --method dp")
                options = {"alpa_compatible": True, "progress_fn": _ScanProgress()}
            from .hetero import HeteroProblem

            hetero = isinstance(problem, HeteroProblem)
            if args.method == "diff" and hetero:
                options = {"seed": args.seed}
                if args.restarts is not None or args.steps is not None:
                    raise ProblemError(
                        "--restarts/--steps apply to the homogeneous engine only"
                    )
            elif args.method == "diff":
                options = {"seed": args.seed, "progress_fn": _SearchProgress()}
                if args.restarts is not None:
                    options["num_restarts"] = args.restarts
                if args.steps is not None:
                    options["num_steps"] = args.steps
            elif args.method in ("anneal", "random"):
                options = {"seed": args.seed}
            if args.method != "diff" and (
                args.restarts is not None or args.steps is not None
            ):
                raise ProblemError("--restarts and --steps apply to --method diff")
            plan = solve(problem, args.method, **options)
            if args.json:
                print(json.dumps(plan.to_json()))
            else:
                print(format_plan(problem, plan))
        elif args.command == "inspect":
            print(format_inspection(_load(args)))
        elif args.command == "convert":
            problem = _load(args)
            problem.to_npz(args.output)
            print(
                f"wrote {args.output}: L = {problem.num_layers}, "
                f"M = {problem.num_submeshes}, K = {problem.num_configs}, "
                f"cluster {problem.cluster_shape[0]}x{problem.cluster_shape[1]}, "
                f"B = {problem.num_microbatches}"
            )
        elif args.command == "compare":
            from .commands import run_compare

            run_compare(_load(args), args)
        elif args.command == "costmodel":
            from .commands import run_costmodel

            run_costmodel(args)
        elif args.command == "profile":
            from .commands import run_profile

            run_profile(args)
        elif args.command == "demo":
            _demo(sys.stdout, args.json)
        else:
            from .cli_megatron import run

            return run(args)
    except ProblemError as error:
        print(f"pipedejavu: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except InfeasibleProblemError as error:
        print(f"pipedejavu: no feasible plan: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except OSError as error:
        print(f"pipedejavu: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
