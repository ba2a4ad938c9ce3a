"""The heavier ``pipedejavu`` sub-commands (compare, costmodel, profile).

Kept apart from :mod:`pipedejavu.cli.main` so that the parser stays readable; each
function takes the parsed arguments, calls the library and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from pipedejavu.cli.formatting import format_duration, format_plan
from pipedejavu.cli.parsing import require_matplotlib
from pipedejavu.core.errors import InfeasibleProblemError, ProblemError
from pipedejavu.core.files import json_text
from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.npzfile import npz_output_path
from pipedejavu.core.problem import Problem, get_submesh_choices
from pipedejavu.costmodel.alpa.profiles import prof_database_path
from pipedejavu.planning import plots
from pipedejavu.planning.compare import compare, simulate_schedule
from pipedejavu.planning.inputs import (
    GENERATED_EXAMPLE,
    HETERO_EXAMPLE,
    bundled_examples,
    example_description,
    load_example,
    load_problem,
    parse_cluster,
    sniff_format,
)
from pipedejavu.planning.solve import solve


class _CompareProgress:
    """A stderr line per method (and every 5 s) once the comparison takes 2 s."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.last = self.started
        self.method = None

    def __call__(self, method: str, run: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.started >= 2.0 and (
            method != self.method or now - self.last >= 5.0
        ):
            self.last, self.method = now, method
            print(
                f"compare: {method} run {run + 1} of {total}, "
                f"{now - self.started:.0f} s",
                file=sys.stderr,
                flush=True,
            )


def run_compare(problem: Problem, args: argparse.Namespace) -> None:
    if args.plot:
        require_matplotlib()  # before minutes of solving, not after

    methods = None
    if args.methods is not None:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods:
            raise ProblemError("--methods needs at least one method")
    result = compare(
        problem,
        methods,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        progress_fn=_CompareProgress(),
    )
    if args.json:
        print(json_text(result.to_json()))
    elif args.csv:
        print(result.to_csv(), end="")
    else:
        print(result.format_table())
    if args.plot:
        for path in write_comparison_plots(problem, result, Path(args.plot)):
            print(f"wrote {path}", file=sys.stderr)


def write_comparison_plots(problem: Problem, result, directory: Path) -> list[Path]:
    """Gantt of the best plan's 1F1B schedule, anytime curves, loss curve."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ProblemError(
            f"cannot create plot directory {directory}: {error}"
        ) from None
    written = []
    planned = [r for r in result.results if r.plan is not None]
    if not planned:
        return written
    best = min(planned, key=lambda r: r.plan.cost)
    schedule = simulate_schedule(problem, best.plan)
    written.append(
        plots.plot_gantt(
            schedule,
            directory / "gantt_1f1b.png",
            title=f"{best.method} plan, simulated 1F1B",
        )
    )
    methods = {r.method: r for r in planned}
    optimum = methods["dp"].plan.cost if "dp" in methods else None
    traces = {  # a method without an anytime trace is its one answer
        r.method: r.plan.info.get("trace") or [(r.plan.search_time_s, r.plan.cost)]
        for r in planned
    }
    if traces:
        written.append(
            plots.plot_anytime(traces, directory / "anytime.png", optimum=optimum)
        )
    if "diff" in methods and methods["diff"].plan.info.get("loss_curve"):
        written.append(
            plots.plot_loss_curve(
                methods["diff"].plan.info["loss_curve"],
                directory / "loss_curve.png",
                optimum=optimum,
                plan_cost=methods["diff"].plan.cost,
            )
        )
    return [Path(p) for p in written]


def run_costmodel(args: argparse.Namespace) -> None:
    if args.costmodel_command == "report":
        _costmodel_report(args)
    else:
        _costmodel_predict(args)


def _costmodel_report(args: argparse.Namespace) -> None:
    from pipedejavu.costmodel.alpa.comm_plots import (
        comm_report,
        format_table,
        plot_fits,
        rows_to_dicts,
        summarize,
    )

    source = prof_database_path(args.prof_db)  # "bundled": the shipped one
    if not Path(source).is_file():
        raise ProblemError(f"no such file: {source}")
    if args.plot:
        require_matplotlib()
    try:
        rows = comm_report(source, num_folds=args.folds)
    except ValueError as error:
        if isinstance(error, ProblemError):
            raise
        raise ProblemError(f"{source}: {error}") from None
    if args.json:
        print(json_text({"summary": summarize(rows), "fits": rows_to_dicts(rows)}))
    else:
        print(format_table(rows))
    if args.plot:
        for path in plot_fits(source, rows, args.plot):
            print(f"wrote {path}", file=sys.stderr)


def _costmodel_predict(args: argparse.Namespace) -> None:
    import os

    from pipedejavu.costmodel.stage.predict import SubsetConfig  # JAX
    from pipedejavu.planning.predict_regret import (
        format_predictor_report,
        predictor_report,
    )

    fractions = tuple(args.fraction) if args.fraction else (0.1, 0.25, 0.5, 1.0)
    settings: dict = {}
    source = args.stage_profile
    bundled = {e.name: e for e in bundled_examples()}
    if source in bundled and not os.path.exists(source):
        example = bundled[source]  # the .npy itself: its memory records count
        source = str(example.path)
        settings = {
            "cluster_shape": example.cluster_shape,
            "num_microbatches": example.num_microbatches,
            "submesh_space": example.submesh_space,
        }
    elif not os.path.exists(source) or sniff_format(source) == "npz":
        source = load_problem(source)  # an example by name, or a problem .npz
        if isinstance(source, HeteroProblem):
            raise ProblemError(
                f"{args.stage_profile} is a heterogeneous problem (typed devices); "
                "costmodel predict takes an Alpa stage profile or a homogeneous "
                "problem"
            )
    else:
        if args.cluster:
            settings["cluster_shape"] = parse_cluster(args.cluster)
        if args.num_microbatches is not None:
            settings["num_microbatches"] = args.num_microbatches
        settings["submesh_space"] = args.submesh_space
    try:
        report = predictor_report(
            source,
            fractions=fractions,
            seeds=tuple(range(args.seeds)),
            support=args.support,
            refine=args.refine,
            config=SubsetConfig(design=args.design),
            **settings,
        )
    except ValueError as error:
        raise ProblemError(str(error)) from None
    if args.json:
        print(json_text(report))
    else:
        print(format_predictor_report(report))


def run_profile(args: argparse.Namespace) -> None:
    output = npz_output_path(args.out)  # before loading JAX and profiling
    cluster = parse_cluster(args.cluster)
    try:  # the cluster's submeshes, checked before minutes of profiling
        get_submesh_choices(*cluster, "power_of_two")
    except ProblemError as error:
        raise ProblemError(f"--cluster {args.cluster}: {error}") from None

    from pipedejavu.costmodel.profiling.gpt_model import MODEL_NAMES
    from pipedejavu.costmodel.profiling.layer_problem import (
        DataParallelScaling,
        profile_to_problem,
    )

    if args.model not in MODEL_NAMES:
        raise ProblemError(
            f"unknown model {args.model!r}; choose one of {', '.join(MODEL_NAMES)}"
        )
    started = time.perf_counter()

    def progress(done: int, total: int, what: str) -> None:
        if time.perf_counter() - started >= 2.0:
            print(f"profile: {done}/{total} {what}", file=sys.stderr, flush=True)

    try:
        problem, profile = profile_to_problem(
            args.model,
            output,
            cluster=cluster,
            # one device measured; more are modelled (an assumption, documented
            # in costmodel.profiling.layer_problem.DataParallelScaling)
            scaling=None if cluster == (1, 1) else DataParallelScaling(),
            num_microbatches=args.num_microbatches,
            repeats=args.repeats,
            warmup=args.warmup,
            progress_fn=progress,
        )
    except ValueError as error:
        if isinstance(error, ProblemError):
            raise
        raise ProblemError(str(error)) from None
    print(
        f"{args.model} on {profile.backend} ({profile.device_kind}): "
        f"{len(profile.layer_names)} layers, forward + backward per micro-batch"
    )
    for name, seconds, activation in zip(
        profile.layer_names,
        profile.layer_times_s,
        profile.activation_bytes,
        strict=True,
    ):
        print(
            f"  {name:<12} {seconds * 1e3:9.3f} ms   output {activation / 1e6:8.3f} MB"
        )
    print(
        f"wrote {output}: L = {problem.num_layers}, cluster "
        f"{problem.cluster_shape[0]}x{problem.cluster_shape[1]}, "
        f"B = {problem.num_microbatches} "
        f"({time.perf_counter() - started:.1f} s)"
    )


def run_demo(out: TextIO, *, as_json: bool = False, alpa_scan: bool = False) -> None:
    """The bundled real Alpa profiles and the generated instances, solved.

    Alpa's own algorithm runs on every real profile; on the generated 32-layer
    instance only with ``alpa_scan`` (about 40 s there on 2 cores).
    """
    names = [example.name for example in bundled_examples()]
    for name in names + [GENERATED_EXAMPLE, HETERO_EXAMPLE]:
        problem = load_example(name)
        hetero = name == HETERO_EXAMPLE
        try:
            plan = solve(problem, "dp")
        except InfeasibleProblemError as error:
            if as_json:
                print(json_text({"example": name, "infeasible": str(error)}), file=out)
            else:
                print(
                    f"== {name}: {example_description(name)}\n"
                    f"no feasible plan: {error}\n",
                    file=out,
                )
            continue
        if as_json:
            print(json_text({"example": name, "plan": plan.to_json()}), file=out)
            continue
        print(f"== {name}: {example_description(name)}", file=out)
        print(format_plan(problem, plan), file=out)
        if hetero:
            alpa = solve(problem, "alpa")
            # (the exact plan is proven only where its gap closes)
            ours = "the optimum" if plan.info.get("gap", 0.0) == 0 else "our plan"
            print(
                f"Alpa's way (--method alpa: its DP at the average speed, links "
                f"free, placed as Alpa places stages on hosts): cost "
                f"{alpa.cost:.6f} s, "
                f"{alpa.cost / plan.cost:.3f} x {ours}",
                file=out,
            )
        elif name in names or alpa_scan:
            alpa = solve(problem, "dp", alpa_compatible=True)
            same = [s.to_json() for s in plan.stages] == [
                s.to_json() for s in alpa.stages
            ]
            print(
                f"Alpa's training_dp (alpa-compatible): "
                f"{'same plan' if same else 'a different plan'}, cost "
                f"{alpa.cost:.6f} s, {alpa.info['num_evaluated']} caps evaluated in "
                f"{format_duration(alpa.search_time_s)} vs "
                f"{plan.info['num_evaluated']} in "
                f"{format_duration(plan.search_time_s)}",
                file=out,
            )
        else:
            print(
                f"Alpa's training_dp: skipped here (about 40 s; the exact DP "
                f"evaluated {plan.info['num_evaluated']} caps in "
                f"{format_duration(plan.search_time_s)}); pipedejavu demo --alpa-scan "
                "runs it",
                file=out,
            )
        if name == GENERATED_EXAMPLE:
            engine = solve(problem, "diff", seed=0)
            print(
                f"differentiable engine (--method diff): cost {engine.cost:.6f} s "
                f"({engine.cost / plan.cost:.5f} x the optimum), certified within "
                f"{100 * engine.info['gap']:.3f}% of its lower bound, "
                f"{engine.search_time_s:.1f} s (JAX compilation included)",
                file=out,
            )
        print(file=out)
