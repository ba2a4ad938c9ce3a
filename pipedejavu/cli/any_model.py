"""``pipedejavu plan`` and ``predict`` for any model on any GPU of the sheet.

:mod:`pipedejavu.cli.megatron` registers the commands and dispatches here:

* ``plan --model CONFIG.json|NAME --gpus TYPE:N --global-batch B`` with
  ``--precision``, ``--recompute``, ``--seq-len`` and ``--gpu-sheet``
  (:func:`pipedejavu.planning.any_model.choose_cost_source` picks the costs);
* ``predict PLAN.json [--model CONFIG.json|NAME]`` with the same options (the
  plan file's recorded options and sequence length are the defaults);
* ``plan --megatron-args "..." --gpus TYPE:N``: the user's launch and the best
  plan side by side (:func:`pipedejavu.planning.launch_compare.compare_megatron_run`).

Errors propagate to the CLI (exit 2 for bad input, 3 for no feasible plan).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from pipedejavu.cli.calibrate import add_calibration_flag, calibration_of
from pipedejavu.cli.expert_flags import refuse_expert_flags
from pipedejavu.cli.knob_flags import add_knob_options, knob_space
from pipedejavu.cli.parsing import given_flags, headroom_type, int_in
from pipedejavu.core.plan3d import MAX_SEARCH_GPUS
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import (
    RECOMPUTE_GRANULARITIES,
    TRAINING_PRECISIONS,
    TrainingOptions,
)
from pipedejavu.io.exports import (
    DATA_PARALLEL_ALONE,
    SWITCH_FLAGS,
)
from pipedejavu.io.gpu_sheet import GpuSheet, load_gpu_sheet
from pipedejavu.io.megatron_args import MegatronRun, spec_from_megatron_args
from pipedejavu.io.sailor_plan import load_plan3d, load_plan_training
from pipedejavu.planning.any_model import (
    LONG_CONTEXT,
    CostChoice,
    choose_cost_source,
    predict_any_plan,
    sheet_name,
)
from pipedejavu.planning.knob_space import (
    MEGATRON_SCHEDULES,
    recompute_name,
)
from pipedejavu.planning.launch_compare import (
    RunComparison,
    compare_megatron_run,
    launch_knob_space,
)
from pipedejavu.planning.measured_runs import plan_choice
from pipedejavu.planning.megatron_launch import (
    check_whole_microbatches,
    options_of_run,
)
from pipedejavu.planning.plan_model import KEPT_OPTIONS, launched_space
from pipedejavu.planning.training import parse_gpu_pool

__all__ = [
    "MAX_SEQ_LENGTH",
    "add_training_options",
    "any_model_options",
    "choose_for_plan",
    "cost_source_options",
    "costs_line",
    "launch_pool",
    "plan_megatron_args",
    "predict_plan_file",
    "read_launch",
]

#: Longest sequence ``--seq-len`` takes (16 Mi tokens).
MAX_SEQ_LENGTH = 2**24


def add_training_options(parser: Any, *, knobs: bool = False) -> None:
    """``--precision``, ``--recompute``, ``--attention``, ``--seq-len`` and
    ``--gpu-sheet`` (with ``knobs``: :func:`add_knob_options`' knobs instead of
    one ``--recompute``) and ``--calibration``."""
    add_calibration_flag(parser)
    parser.add_argument(
        "--attention",
        choices=("fused", "unfused"),
        help="the attention kernel: fused (flash attention, one kernel) or "
        "unfused (the scores written out and read back, as Megatron-DeepSpeed "
        "runs without --use-flash-attn and Sailor's profiles measured) "
        "(default: what a PLAN.json records; else fused; a Sailor model priced "
        "by its profiles keeps its profiled kernel)",
    )
    parser.add_argument(
        "--precision",
        choices=TRAINING_PRECISIONS,
        help="training precision (default: what a PLAN.json records; else fp32 "
        "for the profiled Sailor models OPT-350, GPT-Neo-2.7, LLAMA-3-8, OPT-30 "
        "and bf16 for any other); other than fp32, a Sailor model is priced by "
        "the analytical model",
    )
    if knobs:
        add_knob_options(parser)
    else:
        parser.add_argument(
            "--recompute",
            choices=RECOMPUTE_GRANULARITIES,
            help="activation recomputation, Megatron-LM's --recompute-granularity "
            "(default: what a PLAN.json records; else none)",
        )
    parser.add_argument(
        "--seq-len",
        type=int_in("--seq-len", 1, MAX_SEQ_LENGTH),
        metavar="S",
        help="tokens per sample (default: what a PLAN.json records; else the "
        "model's training length: a preset's recorded length (pipedejavu data "
        "models/README.md), a Sailor model's profiled length, a config.json's "
        f"context up to {LONG_CONTEXT} tokens; a longer context needs --seq-len)",
    )
    parser.add_argument(
        "--gpu-sheet",
        metavar="FILE",
        help="a JSON GPU sheet extending or overriding the bundled one (same "
        "schema; `pipedejavu data gpus.json` prints its path)",
    )
    parser.add_argument(
        "--memory-headroom",
        type=headroom_type,
        metavar="F|GB",
        help="memory every GPU keeps free: a fraction of its memory (0.1), a "
        "percentage (10%%) or gigabytes (8GB); the search, its proof, the "
        "prediction and the memory report all honour it (default: none; plans "
        "may fill each GPU's memory less the predictor's runtime reserve)",
    )


def any_model_options(args: argparse.Namespace) -> list[str]:
    """The any-model options given (for messages refusing them)."""
    names = (
        "precision",
        "schedule",
        "recompute",
        "sequence_parallel",
        "distributed_optimizer",
        "rank_order",
        "seq_len",
        "gpu_sheet",
        "memory_headroom",
        "attention",
        *KEPT_OPTIONS,
    )
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None)]


def costs_line(
    choice: CostChoice, cost_source: str, options: TrainingOptions | None = None
) -> str:
    """What priced a plan, in one line of the text report (``options``: the
    plan's, default the choice's)."""
    options = options or choice.options
    recompute = recompute_name(options)
    line = f"costs: {cost_source} ({options.precision}, recompute {recompute}"
    if not options.flash_attention:
        line += ", unfused attention"
    if options.sequence_parallel:
        line += ", sequence parallel"
    if options.distributed_optimizer:
        line += ", distributed optimizer"
    if choice.spec is not None:
        line += f", {choice.spec.seq_length} tokens per sample"
    return line + ")"


def cost_source_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of :func:`~pipedejavu.planning.any_model.choose_cost_source`
    (and of the planners that call it) that ``plan --model`` gives: precision,
    sequence length, GPU sheet, profiles, memory headroom and calibration."""
    return {
        "precision": args.precision,
        "seq_length": args.seq_len,
        "gpu_sheet": args.gpu_sheet,
        "profiles": args.profiles,
        "memory_headroom": args.memory_headroom,
        "calibration": calibration_of(args),
    }


def choose_for_plan(args: argparse.Namespace, pool: dict[str, int]) -> CostChoice:
    """The cost source of ``plan --model`` (before its knobs: a model of the
    profiles given no knob flag is priced by its profiles), with the kept
    switches given (:func:`kept_options`) in its options."""

    def choose(options: TrainingOptions | None) -> CostChoice:
        return choose_cost_source(
            args.model, pool, options=options, **cost_source_options(args)
        )

    choice = choose(None)
    kept = kept_options(args, choice.options)
    return choice if kept is None else choose(kept)


def predict_plan_file(args: argparse.Namespace) -> tuple[Any, Any, CostChoice]:
    """``predict PLAN.json``: ``(plan as priced, prediction, choice)``.

    Priced from the profiles alone, ``--model`` must name the model the plan
    names (as before); priced analytically, ``--model`` prices the plan for
    that model (its layers must match).
    """
    options, seq_length, moe = load_plan_training(args.plan)
    plan, _ = load_plan3d(args.plan)
    model = args.model if args.model is not None else plan.model
    if model != plan.model:
        seq_length = None  # the recorded length is the other model's
    if model is None:
        raise ProblemError(
            f"{args.plan} names no model; give --model (a model of the profiles, "
            "e.g. OPT-350, a bundled preset or a config.json)"
        )

    def choose(base: TrainingOptions | None) -> CostChoice:
        return plan_choice(
            model,
            plan,
            options=base,
            experts=moe,
            precision=args.precision,
            recompute=args.recompute,
            seq_length=args.seq_len if args.seq_len is not None else seq_length,
            gpu_sheet=args.gpu_sheet,
            profiles=args.profiles,
            memory_headroom=args.memory_headroom,
            calibration=calibration_of(args),
        )

    try:  # what is wrong with the plan's GPUs, model or layers names it
        choice = choose(options)
        fused = {"fused": True, "unfused": False}.get(getattr(args, "attention", ""))
        if fused is not None and choice.options.flash_attention != fused:
            choice = choose(dataclasses.replace(choice.options, flash_attention=fused))
        if not choice.analytical:
            # Profiles alone: today's reading, which checks --model against it.
            plan, _ = load_plan3d(args.plan, model=args.model)
            plan = plan.replace(model=choice.model)
        plan, prediction = predict_any_plan(plan, choice)
        # the batch the plan says, not one rounded up to whole micro-batches
        check_whole_microbatches(plan.gbs, plan.mbs, plan.dp)
    except ProblemError as error:
        if str(error).startswith(str(args.plan)):
            raise
        raise ProblemError(f"{args.plan}: {error}") from None
    return plan, prediction, choice


def _refuse_with_megatron_args(args: argparse.Namespace) -> None:
    given = given_flags(
        (
            ("--model", args.model),
            ("--profiles", args.profiles),
            ("--precision", args.precision),
            ("--seq-len", args.seq_len),
            ("--goodput-grad", args.goodput_grad),
            ("--elastic", args.elastic),
            ("--per-stage-tp", args.per_stage_tp),
            ("--mixed-types", args.mixed_types),
            ("--calibration", getattr(args, "calibration", None)),
            ("--attention", getattr(args, "attention", None)),
            *((SWITCH_FLAGS[name], getattr(args, name, None)) for name in KEPT_OPTIONS),
        )
    )
    if given:
        raise ProblemError(
            f"--megatron-args describes the model and its training: give no "
            f"{', '.join(given)} with it"
        )
    if not args.gpus or len(args.gpus) != 1:
        raise ProblemError("--megatron-args takes one --gpus TYPE:COUNT")


def read_launch(
    megatron_args: str,
    gpus: str,
    gpu_sheet: str | None,
    *,
    most: int = MAX_SEARCH_GPUS,
) -> tuple[MegatronRun, str, int, GpuSheet]:
    """A Megatron-LM launch on ``gpus`` (``TYPE:COUNT``, at most ``most``
    GPUs: a prediction allows :data:`~pipedejavu.core.layout.MAX_GPUS`, a
    search :data:`~pipedejavu.core.plan3d.MAX_SEARCH_GPUS`): the parsed run,
    the sheet's name of the GPU type, the count and the sheet; the flags that
    change nothing are listed on stderr.

    Raises:
        ProblemError: a bad pool, a GPU type not on the sheet, bad flags.
    """
    gpu, count, sheet = launch_pool(gpus, gpu_sheet, "--megatron-args", most=most)
    run = spec_from_megatron_args(megatron_args)
    if run.ignored:
        shown = " ".join(run.ignored)
        print(f"ignored (no effect on the prediction): {shown:.300}", file=sys.stderr)
    return run, gpu, count, sheet


def launch_pool(
    gpus: str, gpu_sheet: str | None, flag: str, *, most: int
) -> tuple[str, int, GpuSheet]:
    """The one GPU type and count of a launch (``flag``: the launch
    description it goes with): the sheet's name of the type, the count, the
    sheet.

    Raises:
        ProblemError: a bad pool, several types, a type not on the sheet.
    """
    pool = parse_gpu_pool([gpus], most=most)
    if len(pool) != 1:  # a launch runs on one type (commas give several)
        raise ProblemError(f"{flag} takes one --gpus TYPE:COUNT, got {len(pool)} types")
    ((gpu, count),) = pool.items()
    sheet = load_gpu_sheet(gpu_sheet)
    return sheet.resolve(sheet_name(sheet, gpu)), count, sheet


#: What a kept option needs: the knob it needs on, and that knob's flag.
_KEPT_NEEDS = {
    "tp_comm_overlap": ("sequence_parallel", "--sequence-parallel"),
    "overlap_param_gather": ("distributed_optimizer", "--distributed-optimizer"),
}


def kept_options(
    args: argparse.Namespace, options: TrainingOptions
) -> TrainingOptions | None:
    """``options`` with the attention kernel given (``--attention``) and the
    kept switches of ``plan`` (:data:`KEPT_OPTIONS`)
    given on the command line turned on, and the knob each needs on in the
    base (the search turns the switch off with the knob:
    :meth:`~pipedejavu.planning.knob_space.KnobSpace.all_choices`); ``None``
    where none was given.

    Raises:
        ProblemError: a switch whose knob was turned off (``--sequence-parallel
            off --tp-comm-overlap``), or that the precision cannot take.
    """
    given = [name for name in KEPT_OPTIONS if getattr(args, name, None)]
    attention = getattr(args, "attention", None)
    if not given and attention is None:
        return None
    if attention == "unfused" and getattr(args, "export", None) == "torchtitan":
        raise ProblemError(
            "--attention unfused: torchtitan runs its attention fused (SDPA); "
            "give --attention fused or another --export"
        )
    changes = {} if attention is None else {"flash_attention": attention == "fused"}
    for name in given:
        changes[name] = True
        if name in _KEPT_NEEDS:
            knob, flag = _KEPT_NEEDS[name]
            if getattr(args, knob, None) == "off":
                raise ProblemError(
                    f"{SWITCH_FLAGS[name]} needs {flag}: give no {flag} off with it"
                )
            changes[knob] = True
    try:
        return dataclasses.replace(options, **changes)
    except ValueError as error:
        flags = ", ".join(SWITCH_FLAGS[n] for n in given)
        raise ProblemError(f"{flags}: {error}") from None


def plan_megatron_args(args: argparse.Namespace, progress_fn: Any) -> RunComparison:
    """``plan --megatron-args``: the launch predicted and the best plan."""
    _refuse_with_megatron_args(args)
    run, gpu, count, sheet = read_launch(
        args.megatron_args, args.gpus[0], args.gpu_sheet
    )
    if args.global_batch is not None and run.global_batch is not None:
        if args.global_batch != run.global_batch:
            raise ProblemError(
                f"--global-batch {args.global_batch} contradicts the launch's "
                f"--global-batch-size {run.global_batch}"
            )
    refuse_expert_flags(args, "plan --megatron-args keeps the launch's expert layout")
    # The schedules Megatron-LM runs, unless asked (it has no ZB-H1 flag).
    space = knob_space(args, launch_knob_space(run), MEGATRON_SCHEDULES)
    if getattr(args, "export", None):  # only what the target launches
        space = launched_space(args.export, space, options_of_run(run))
    return compare_megatron_run(
        run,
        gpu,
        count,
        sheet,
        space=space,
        method=args.method,
        allow_fewer_gpus=not args.all_gpus,
        progress_fn=progress_fn,
        dp_alone=getattr(args, "export", None) in DATA_PARALLEL_ALONE,
        memory_headroom=args.memory_headroom,
    )
