"""``predict --torchtitan-config FILE.toml --gpus TYPE:COUNT``: a torchtitan
job predicted (:mod:`pipedejavu.planning.torchtitan_launch`), the way
``--megatron-args`` predicts a Megatron-LM launch."""

from __future__ import annotations

import argparse
import sys

from pipedejavu.cli.any_model import any_model_options, launch_pool
from pipedejavu.cli.megatron_report import (
    context_parallel_line,
    format_prediction,
    utilization_line,
    warn_if_over_memory,
)
from pipedejavu.core.files import json_text
from pipedejavu.core.layout import MAX_GPUS
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.torchtitan_job import read_torchtitan_job
from pipedejavu.planning.torchtitan_launch import predict_torchtitan_job

__all__ = ["add_sharded_flag", "predict_torchtitan", "refuse_described", "sharded_of"]


def add_sharded_flag(plan: argparse.ArgumentParser) -> None:
    """``plan --sharded auto|on|off``."""
    plan.add_argument(
        "--sharded",
        choices=("auto", "on", "off"),
        default="auto",
        help="also search every single-stage plan of sharded data parallelism "
        "(FSDP2/HSDP over dp_shard x cp GPUs, ZeRO-3) with TP and context "
        "parallelism, every GPU used, and keep the faster (auto: for a model "
        "priced analytically on one GPU type, without --export or with "
        "--export torchtitan, when no knob flag or kept switch is given; on: "
        "also with knob flags, refused where it does not apply)",
    )


def sharded_of(args: argparse.Namespace, asked: bool = False) -> bool | None:
    """``--sharded`` as :func:`~pipedejavu.planning.plan_model.plan_model`
    takes it; ``auto`` is off where a knob was ``asked`` (the sharded space
    fixes the schedule, sequence parallelism and the optimizer's sharding
    itself: ``--sharded on`` joins it anyway)."""
    given = {"auto": None, "on": True, "off": False}[getattr(args, "sharded", "auto")]
    return False if given is None and asked else given


def refuse_described(args: argparse.Namespace, flag: str) -> None:
    """Refuse what a launch description (``flag``: ``--megatron-args``,
    ``--torchtitan-config``) already says: a plan file, a model, profiles or
    training options (the GPU sheet and a memory headroom are not).

    Raises:
        ProblemError: one line naming what to leave out.
    """
    given = [
        name
        for name in any_model_options(args)
        if name not in ("--gpu-sheet", "--memory-headroom")
    ]
    if args.plan is not None or args.model or args.profiles or given:
        raise ProblemError(
            f"{flag} describes the model, its training and the plan: give no "
            "PLAN.json, --model, --profiles, --precision, --recompute or "
            "--seq-len with it"
        )
    if getattr(args, "calibration", None):
        raise ProblemError(
            f"--calibration prices plan files and models, not {flag} (priced "
            "with the launcher's own constants)"
        )


def predict_torchtitan(args: argparse.Namespace) -> int:
    """Print the prediction of ``args.torchtitan_config`` on ``args.gpus``.

    Raises:
        ProblemError: flags that the job file already says, a bad pool, a
            job that cannot run or is not priced (one line each).
    """
    refuse_described(args, "--torchtitan-config")
    if args.megatron_args is not None:
        raise ProblemError("give --torchtitan-config or --megatron-args, not both")
    if not args.gpus:
        raise ProblemError("--torchtitan-config needs --gpus TYPE:COUNT, e.g. H100:64")
    gpu, count, sheet = launch_pool(
        args.gpus, args.gpu_sheet, "--torchtitan-config", most=MAX_GPUS
    )
    job = read_torchtitan_job(args.torchtitan_config)
    if job.ignored:
        shown = "; ".join(job.ignored)
        print(f"ignored (no effect on the prediction): {shown:.400}", file=sys.stderr)
    predicted = predict_torchtitan_job(
        job, gpu, count, sheet, memory_headroom=args.memory_headroom
    )
    launch = predicted.launch
    warn_if_over_memory(launch.prediction, "job")
    if args.json:
        print(json_text(predicted.to_json()))
        return 0
    degrees = predicted.degrees
    print(
        f"torchtitan job {job.model_name} {job.flavor} ({job.schema} schema) on "
        f"{count} {gpu}: dp_replicate {degrees.dp_replicate}, dp_shard "
        f"{degrees.dp_shard}, cp {degrees.cp}, tp {degrees.tp}, pp {degrees.pp}"
    )
    print(format_prediction(launch.plan, launch.prediction, launch.options))
    if degrees.cp > 1:
        print(context_parallel_line(degrees.cp))
    print(
        f"{predicted.tokens_per_s_per_gpu:.0f} tokens/s per GPU; "
        f"{utilization_line(launch)}; costs: {launch.cost_source} with "
        "torchtitan's constants"
    )
    for note in predicted.notes:
        print(f"not priced: {note}")
    return 0
