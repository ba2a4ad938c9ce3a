"""``pipedejavu predict``: Megatron/DeepSpeed 3D plans on per-layer GPU profiles.

Registered by :mod:`pipedejavu.cli.main`; exit codes as there (0 ok, 2 bad input,
3 no feasible plan).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from pipedejavu.cli.any_model import (
    add_training_options,
    any_model_options,
    choose_for_plan,
    cost_source_options,
    costs_line,
    kept_options,
    plan_megatron_args,
    predict_plan_file,
    read_launch,
)
from pipedejavu.cli.batch import add_plan_options, run_batch_modes
from pipedejavu.cli.expert_flags import expert_knobs
from pipedejavu.cli.knob_flags import knob_space, knobs_asked, unused_at_tp1
from pipedejavu.cli.megatron_report import (
    GB,
    context_parallel_line,
    format_comparison,
    format_knobs,
    format_launchers,
    format_prediction,
    format_training_plan,
    launchers_json,
    pool_text,
    utilization_line,
    warn_if_over_memory,
)
from pipedejavu.cli.parsing import add_json_option, int_in
from pipedejavu.cli.pictures import PLOT_HELP, check_plot, write_plot
from pipedejavu.cli.progress import PlanProgress
from pipedejavu.cli.torchtitan import (
    add_sharded_flag,
    predict_torchtitan,
    refuse_described,
    sharded_of,
)
from pipedejavu.core.files import json_text
from pipedejavu.core.layout import MAX_GPUS
from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH, MAX_SEARCH_GPUS
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.exports import (
    DATA_PARALLEL_ALONE,
    EXPORTS,
    export_plan,
    launchers,
    schedule_targets_text,
)
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.expert_search import moe_options_of
from pipedejavu.planning.knob_space import MEGATRON_SCHEDULES, SCHEDULES, KnobSpace
from pipedejavu.planning.megatron_launch import plan_utilization, predict_megatron_run
from pipedejavu.planning.plan_model import (
    default_space,
    launched_space,
    plan_model,
    target_space,
)
from pipedejavu.planning.training import (
    check_global_batch,
    expected_slow,
    parse_gpu_pool,
    plan_training,
)

__all__ = ["COMMANDS", "LAUNCH_FALLBACK", "add_parsers", "export_model", "run"]

COMMANDS = ("predict", "plan")
#: The target whose launchable plan a default search reports when its best
#: plan launches on none: the one that runs the most of the knobs.
LAUNCH_FALLBACK = "megatron"


def add_parsers(commands: Any) -> None:
    """Add the subcommands to the CLI's subparsers."""
    predict = commands.add_parser(
        "predict",
        help="predict the iteration time and memory per GPU of a training plan, "
        "a Megatron-LM launch or a torchtitan job",
    )
    predict.add_argument(
        "plan",
        metavar="PLAN.json",
        nargs="?",
        help="a 3D plan in our JSON (names its model; what `pipedejavu plan "
        "--json` writes) or a Sailor plan_config file (needs --model); or give "
        "--megatron-args instead",
    )
    predict.add_argument(
        "--megatron-args",
        metavar="ARGS",
        help="the flags of a Megatron-LM pretrain_gpt.py launch, in one quoted "
        "string: predicts that launch on --gpus from the analytical model (no "
        "profiles needed); flags that change nothing are listed and ignored",
    )
    predict.add_argument(
        "--torchtitan-config",
        metavar="FILE.toml",
        help="a torchtitan job file (its --job.config_file; v0.2 or 2024-12 "
        "schema): predicts that job on --gpus (FSDP2/HSDP, TP, CP, PP as it runs "
        "them) with torchtitan's constants",
    )
    predict.add_argument(
        "--gpus",
        metavar="TYPE:COUNT",
        help="with --megatron-args or --torchtitan-config: the GPUs of the "
        "launch, e.g. A100-80:3072 "
        f"(a type of the GPU sheet; `pipedejavu data gpus.json` prints its path; "
        f"at most {MAX_GPUS})",
    )
    predict.add_argument(
        "--model",
        metavar="NAME|CONFIG.json",
        help="price the plan for this model: a model of the profiles (e.g. "
        "OPT-350; needed for a Sailor plan_config file), a bundled preset (e.g. "
        "Llama-3-8B) or a Hugging Face config.json (default: the model the plan "
        "names)",
    )
    add_training_options(predict)
    predict.add_argument(
        "--profiles",
        metavar="DIR",
        help="a folder laid out like Sailor's data (profiles/, llm_info.json, "
        "network/, configs/); default: the bundled copy",
    )
    add_json_option(predict)
    predict.add_argument("--plot", metavar="FILE.png", help=PLOT_HELP)

    plan = commands.add_parser(
        "plan",
        help="find the fastest training plan (stages, TP, CP, EP, DP, schedule, "
        "knobs) of a model on a GPU pool, proven under the predictor; or what "
        "to rent",
    )
    plan.add_argument(
        "--model",
        metavar="NAME|CONFIG.json",
        help="the model: a Sailor model priced by its profiles (OPT-350, "
        "GPT-Neo-2.7, LLAMA-3-8, OPT-30), a bundled preset priced by the "
        "analytical model (GPT-3-175B, Llama-3-8B, Llama-3-70B, Llama-3.1-405B, "
        "Qwen2.5-7B, Qwen2.5-72B, Mistral-7B) or a Hugging Face config.json; "
        "or give --megatron-args instead",
    )
    plan.add_argument(
        "--megatron-args",
        metavar="ARGS",
        help="the flags of your Megatron-LM pretrain_gpt.py launch, in one "
        "quoted string: predicts it on --gpus and plans the same model, global "
        "batch and training options, side by side with the speed-up",
    )
    plan.add_argument(
        "--gpus",
        action="append",
        metavar="TYPE:COUNT",
        help="GPUs available, e.g. GH-96:64 or H100:64 (a type of the profiles "
        "or of the GPU sheet; for a pool of several types repeat the flag or "
        "separate them with commas, each type once; at most "
        f"{MAX_SEARCH_GPUS} GPUs in all)",
    )
    add_training_options(plan, knobs=True)
    plan.add_argument(
        "--global-batch",
        type=int_in("--global-batch", 1, MAX_GLOBAL_BATCH),
        help=f"samples per iteration, 1 to {MAX_GLOBAL_BATCH} (required unless "
        "--goodput-grad or --elastic)",
    )
    plan.add_argument("--profiles", metavar="DIR", help="as for predict")
    plan.add_argument(
        "--method",
        choices=["dp", "diff"],
        default="dp",
        help="dp: exact (default); diff: the differentiable engine per "
        "configuration, with a certified gap",
    )
    plan.add_argument(
        "--per-stage-tp",
        action="store_true",
        help="allow a TP degree per stage (not launchable with Megatron-LM, "
        "DeepSpeed or torchtitan)",
    )
    plan.add_argument(
        "--mixed-types",
        action="store_true",
        help="with several --gpus types, also plans whose stages run on "
        "different types (searched by the proof under the predictor with the "
        "1F1B schedule in the tp-dp-pp order; slower); with --gpus-available, "
        "also the candidate pools mixing two of the types",
    )
    plan.add_argument(
        "--all-gpus",
        action="store_true",
        help="use every GPU of each type used (default: fewer when faster)",
    )
    plan.add_argument(
        "--export",
        choices=EXPORTS,
        help="also print the plan for this framework (megatron: a whole "
        "pretrain_gpt.py command); the search keeps to the schedules, rank "
        "orders and training options it launches as planned (schedules: "
        f"{schedule_targets_text()}; a precision or knob value it never launches: "
        "exit 2 before the search; a plan it still cannot launch as planned: "
        "exit 2 after it). Without --export the report names the targets that "
        "launch the plan, and where none does, the best plan Megatron-LM "
        "launches",
    )
    add_json_option(plan)

    add_sharded_flag(plan)
    add_plan_options(plan)


def _predict_launch(args: argparse.Namespace) -> int:
    refuse_described(args, "--megatron-args")
    if not args.gpus:
        raise ProblemError("--megatron-args needs --gpus TYPE:COUNT, e.g. A100-80:64")
    run, gpu, count, sheet = read_launch(
        args.megatron_args, args.gpus, args.gpu_sheet, most=MAX_GPUS
    )
    launch = predict_megatron_run(
        run, gpu, count, sheet, memory_headroom=args.memory_headroom
    )
    prediction = launch.prediction
    warn_if_over_memory(prediction, "launch")
    if args.json:
        print(json_text(launch.to_json()))
    else:
        print(format_prediction(launch.plan, prediction, launch.options))
        if launch.context_parallel > 1:
            print(context_parallel_line(launch.context_parallel))
        if launch.experts_line is not None:
            print(launch.experts_line)
        print(f"{utilization_line(launch)}; costs: {launch.cost_source}")
    return write_plot(args, launch.plan, prediction)


def _predict(args: argparse.Namespace) -> int:
    check_plot(args)
    if args.torchtitan_config is not None:
        return predict_torchtitan(args)
    if args.megatron_args is not None:
        return _predict_launch(args)
    if args.gpus:
        raise ProblemError(
            "--gpus and TYPE:COUNT pools go with --megatron-args (a plan names "
            "its GPUs)"
        )
    if args.plan is None:
        raise ProblemError("give PLAN.json, or --megatron-args with --gpus")

    plan, prediction, choice = predict_plan_file(args)
    cost_source = choice.data.cost_source(plan) if choice.analytical else "profiles"
    if not prediction.fits_memory:
        peak = prediction.peak_memory_bytes / GB
        limits = [
            round(float(x) / GB, 2) for x in prediction.memory_limit_bytes.min(axis=1)
        ]
        warnings.warn(
            f"the plan exceeds device memory: peak {peak:.2f} GB on a GPU "
            f"(limits per stage {limits} GB)",
            stacklevel=1,
        )
    if args.json:
        out = {"model": plan.model, "plan": plan.describe()}
        out.update(prediction.to_json())
        out.update(cost_source=cost_source, options=choice.options.to_json())
        out.update(notes=list(choice.notes))
        print(json_text(out))
    else:
        print(format_prediction(plan, prediction, choice.options))
        if choice.analytical:
            print(costs_line(choice, cost_source))
            for note in choice.notes:
                print(f"note: {note}")
    return write_plot(args, plan, prediction)


def _plan(args: argparse.Namespace) -> int:
    import sys

    if args.megatron_args is not None:
        check_plot(args)
        return _plan_megatron_args(args)
    if args.model is None:
        raise ProblemError(
            "give --model NAME|CONFIG.json (or --megatron-args with your launch)"
        )
    if (args.goodput_grad is not None or args.elastic) and any_model_options(args):
        raise ProblemError(
            "goodput and elastic modes plan the profiled models as profiled: "
            f"give no {', '.join(any_model_options(args))} with them"
        )
    handled = run_batch_modes(args)  # goodput or elastic mode
    if handled is not None:
        return handled
    check_plot(args)

    if args.mixed_types and args.per_stage_tp:
        raise ProblemError(
            "--mixed-types and --per-stage-tp cannot be combined: plans mixing "
            "GPU types use one TP degree for all stages"
        )
    # Every range is checked before any work; the one line on stderr before
    # the search is only for a search that may take more than ~10 s.
    pool = parse_gpu_pool(args.gpus)
    check_global_batch(args.global_batch, "--global-batch")
    choice = choose_for_plan(args, pool)
    if expected_slow(pool, args.method, args.mixed_types):
        print(
            f"planning {args.model} on {sum(pool.values())} GPUs may take a "
            "minute or more; progress every 2 s ...",
            file=sys.stderr,
            flush=True,
        )
    auto = default_space(choice, args.export)
    experts = expert_knobs(args, choice.spec)
    space = knob_space(args, auto, MEGATRON_SCHEDULES if experts else SCHEDULES)
    asked = knobs_asked(args)
    space = target_space(args.export, space, choice, sharded_of(args, asked))
    result, choice, knobs = _search(args, choice, pool, space, asked, args.export)
    alone = args.export in DATA_PARALLEL_ALONE and result.method != "enumeration"
    spec, spec_note = export_model(choice)
    seq = None if spec is None else spec.seq_length
    exported = _export(args, result, choice.data, result.options, spec)
    targets = _launchers(result, choice.data, spec)
    other = None
    if not args.export and not any(why is None for why in targets.values()):
        other = _launchable_plan(args, choice, pool, space, asked)
    if args.json:
        out = result.to_json() if knobs is None else knobs.to_json()
        if choice.spec is not None:
            out["seq_length"] = choice.spec.seq_length
            out.update(
                plan_utilization(
                    choice.spec,
                    result.plan,
                    result.options,
                    choice.data,
                    choice.data.sheet,
                    result.prediction.iteration_time_s,
                )
            )
        if seq is not None:  # a model priced by its profiles: their length
            out.setdefault("seq_length", seq)
        notes = list(choice.notes) if choice.analytical else []
        notes += unused_at_tp1(args, result.plan)
        notes += [spec_note] if spec_note else []
        if notes:
            out["notes"] = notes
        out["launchers"] = launchers_json(targets, result, other)
        if exported is not None:
            out["export"] = {"target": args.export, "text": exported}
            out["export"]["data_parallel_alone"] = alone
        print(json_text(out))
    else:
        shown = pool_text(pool, choice.gpu_types)
        print(format_training_plan(result, pool=shown, spec=spec))
        if knobs is not None:
            print(format_knobs(knobs))
        if alone:
            print(
                f"searched: data parallelism alone or none ({args.export} runs "
                "unsharded replicas beside no TP or PP)"
            )
        if choice.analytical:
            print(costs_line(choice, result.cost_source, result.options))
            for note in choice.notes:
                print(f"note: {note}")
        for note in unused_at_tp1(args, result.plan):
            print(f"note: {note}")
        if spec_note:
            print(f"note: {spec_note}")
        print(format_launchers(targets, result, other))
        if exported is not None:
            print(f"\n--- {args.export} ---\n{exported}", end="")
    return write_plot(args, result.plan, result.prediction)


def export_model(choice: Any) -> tuple[Any, str | None]:
    """The model a plan's exports build: ``(spec, note)``. A model priced
    analytically is its spec; one priced by its profiles alone is its bundled
    description where that has the profile's layers, else ``None`` with a
    note (the exports then assume one embedding and one head layer)."""
    if choice.spec is not None:
        return choice.spec, None
    layers = choice.data.model_info(choice.model).num_layers
    try:
        spec = load_model_spec(choice.model)
    except ProblemError:
        spec = None
    if spec is not None and spec.num_profile_layers == layers:
        return spec, None
    return None, (
        f"no description of {choice.model} with its {layers} profile layers: "
        "its exports take them as the embedding, the transformer blocks and the "
        "head, and do not know the length it was profiled at"
    )


def _search(
    args: argparse.Namespace,
    choice: Any,
    pool: dict[str, int],
    space: KnobSpace,
    asked: bool,
    export: str | None,
    uniform_tp: bool | None = None,
) -> tuple[Any, Any, Any]:
    """The best plan of ``space`` (what ``export`` launches, if given), as
    :func:`~pipedejavu.planning.plan_model.plan_model` finds it: ``(result,
    choice, knobs)`` (``knobs`` ``None`` for a model priced by its profiles
    searched with its profiled training alone)."""
    uniform = not args.per_stage_tp if uniform_tp is None else uniform_tp
    alone = export in DATA_PARALLEL_ALONE  # (torchtitan's DDP)
    # A model priced by its profiles searches the rank orders (a placement,
    # the same costs) with its profiled training, or what an export needs.
    profiled = KnobSpace.fixed(choice.options, space.rank_orders)
    if choice.analytical or asked or len(space.rank_orders) > 1 or space != profiled:
        knobs = plan_model(
            args.model,
            pool,
            args.global_batch,
            space=space,
            export=export,
            options=kept_options(args, choice.options),
            **cost_source_options(args),
            method=args.method,
            uniform_tp=uniform,
            allow_fewer_gpus=not args.all_gpus,
            mixed_types=args.mixed_types,
            progress_fn=PlanProgress(),
            sharded=sharded_of(args, asked),
            **expert_knobs(args, choice.spec),
        )
        return knobs.result, knobs.choice, knobs
    result = plan_training(
        choice.model,
        choice.pool(pool),
        args.global_batch,
        profiles=choice.data,
        method=args.method,
        uniform_tp=uniform,
        allow_fewer_gpus=not args.all_gpus,
        mixed_types=args.mixed_types,
        progress_fn=PlanProgress(),
        dp_alone=alone,
    )
    return result, choice, None


def _gpus_per_node(result: Any, data: Any) -> dict[str, int]:
    return {gpu: data.gpu_spec(gpu).gpus_per_node for gpu in result.plan.gpus_by_type()}


def _launchers(result: Any, data: Any, spec: Any) -> dict[str, str | None]:
    """:func:`~pipedejavu.io.exports.launchers` of the plan as priced."""
    return launchers(
        result.plan,
        gpus_per_node=_gpus_per_node(result, data),
        options=result.options,
        spec=spec,
    )


def _launchable_plan(
    args: argparse.Namespace,
    choice: Any,
    pool: dict[str, int],
    space: KnobSpace,
    asked: bool,
) -> tuple[str, Any]:
    """The best plan the most capable target (:data:`LAUNCH_FALLBACK`)
    launches, searched when the best plan of a search without ``--export``
    launches on none: ``(target, result)``, or ``(target, why none)``."""
    target = LAUNCH_FALLBACK
    try:
        narrowed = launched_space(target, space, choice.options)
        result, found, _ = _search(
            args, choice, pool, narrowed, asked, target, uniform_tp=True
        )
    except ProblemError as error:  # nothing it launches asked, or no plan
        return target, str(error)
    spec, _ = export_model(found)
    why = _launchers(result, found.data, spec)[target]
    return target, result if why is None else f"its best plan: {why}"


def _export(
    args: argparse.Namespace,
    result: Any,
    data: Any,
    options: Any = None,
    spec: Any = None,
    megatron_args: str | None = None,
) -> str | None:
    """The plan for ``--export``'s framework (``None``: not asked), for the
    model ``spec`` at the sequence length it was priced at."""
    if not args.export:
        return None
    layers = getattr(data, "experts", None)  # what the experts were priced with
    return export_plan(
        result.plan,
        args.export,
        gpus_per_node=_gpus_per_node(result, data),
        options=options,
        spec=spec,
        megatron_args=megatron_args,
        moe=None if layers is None else moe_options_of(layers),
    )


def _plan_megatron_args(args: argparse.Namespace) -> int:
    comparison = plan_megatron_args(args, PlanProgress())
    best = comparison.best
    spec = comparison.source.spec
    exported = _export(
        args, best, comparison.source, best.options, spec, args.megatron_args
    )
    targets = _launchers(best, comparison.source, spec)
    if args.json:
        out = comparison.to_json()
        out["launchers"] = launchers_json(targets, best, None)
        if exported is not None:
            out["export"] = {"target": args.export, "text": exported}
        print(json_text(out))
    else:
        print(format_comparison(comparison, format_training_plan(best)))
        print(format_launchers(targets, best, None))
        if exported is not None:
            print(f"\n--- {args.export} ---\n{exported}", end="")
    return write_plot(args, best.plan, best.prediction)


def run(args: argparse.Namespace) -> int:
    """Run a subcommand of :data:`COMMANDS`; errors propagate to the CLI."""
    if args.command == "predict":
        return _predict(args)
    if args.command == "plan":
        return _plan(args)
    raise ProblemError(f"unknown command {args.command!r}")  # pragma: no cover
