"""``pipedejavu predict``: Megatron/DeepSpeed 3D plans on per-layer GPU profiles.

Registered by :mod:`pipedejavu.cli`; exit codes as there (0 ok, 2 bad input,
3 no feasible plan).
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

from .problem import ProblemError

__all__ = ["COMMANDS", "add_parsers", "format_prediction", "run"]

COMMANDS = ("predict",)
GB = 1e9


def add_parsers(commands: Any) -> None:
    """Add the subcommands to the CLI's subparsers."""
    predict = commands.add_parser(
        "predict",
        help="predict the iteration time and memory of a Megatron/DeepSpeed 3D "
        "plan from per-layer GPU profiles",
    )
    predict.add_argument(
        "plan",
        metavar="PLAN.json",
        help="a 3D plan in our JSON (names its model; what `pipedejavu plan "
        "--json` writes) or a Sailor plan_config file (needs --model)",
    )
    predict.add_argument(
        "--model", help="the model's folder under DIR/profiles, e.g. OPT-350"
    )
    predict.add_argument(
        "--profiles",
        metavar="DIR",
        help="a folder laid out like Sailor's data (profiles/, llm_info.json, "
        "network/, configs/); default: the bundled copy",
    )
    predict.add_argument("--json", action="store_true", help="print JSON")


def _data(directory: str | None):
    from .costmodel.sailor_data import load_sailor_data

    return load_sailor_data(directory)


def format_prediction(plan, prediction) -> str:
    """The text report of ``pipedejavu predict``."""
    breakdown = prediction.to_json()["breakdown"]
    lines = [
        f"plan: {plan.model}, {plan.describe()}, "
        f"{prediction.num_microbatches} micro-batches per pipeline",
        f"iteration time: {prediction.iteration_time_s:.4f} s",
        f"  pipeline (1F1B, DeepSpeed order): {breakdown['pipeline_s']:.4f} s, "
        f"bubble {100 * breakdown['bubble_fraction']:.1f}%",
        f"  tied-embedding all-reduce: {breakdown['tied_allreduce_s']:.4f} s",
        f"  data-parallel all-reduce (slowest stage): "
        f"{breakdown['dp_allreduce_s']:.4f} s",
        f"  optimizer step (largest): {breakdown['optimizer_s']:.4f} s",
        "peak memory per GPU:",
    ]
    limits = prediction.memory_limit_bytes.min(axis=1)
    for s, stage in enumerate(plan.stages):
        used = prediction.stage_memory_bytes[s]
        lines.append(
            f"  stage {s} (layers {stage.start}-{stage.stop - 1}, "
            f"{prediction.peak_in_flight[s]} in flight): {used / GB:.2f} GB of "
            f"{limits[s] / GB:.2f} GB" + ("" if used <= limits[s] else "  EXCEEDS")
        )
    return "\n".join(lines)


def _predict(args: argparse.Namespace) -> int:
    from .costmodel.megatron import predict_plan
    from .plan3d import load_plan3d

    plan, _ = load_plan3d(args.plan, model=args.model)
    if plan.model is None:
        raise ProblemError(
            f"{args.plan} names no model; give --model (a folder under "
            "DIR/profiles, e.g. OPT-350)"
        )
    prediction = predict_plan(plan, _data(args.profiles))
    if not prediction.fits_memory:
        peak = prediction.peak_memory_bytes / GB
        limits = [round(x / GB, 2) for x in prediction.memory_limit_bytes.min(axis=1)]
        warnings.warn(
            f"the plan exceeds device memory: peak {peak:.2f} GB on a GPU "
            f"(limits per stage {limits} GB)",
            stacklevel=1,
        )
    if args.json:
        out = {"model": plan.model, "plan": plan.describe()}
        out.update(prediction.to_json())
        print(json.dumps(out))
    else:
        print(format_prediction(plan, prediction))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a subcommand of :data:`COMMANDS`; errors propagate to the CLI."""
    if args.command == "predict":
        return _predict(args)
    raise ProblemError(f"unknown command {args.command!r}")  # pragma: no cover
