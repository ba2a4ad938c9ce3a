"""``pipedejavu plan`` options that choose the global batch too.

* goodput mode: ``--goodput-grad SQR,VAR --init-batch N --max-global-batch N``
  (:func:`pipedejavu.planning.batch.plan_goodput`);
* elastic mode: ``--gpus TYPE:LOW..HIGH --elastic`` (with or without
  ``--goodput-grad``; :func:`pipedejavu.planning.elastic.plan_elastic`).

:mod:`pipedejavu.cli.megatron` adds the options (:func:`add_plan_options`) and
hands the parsed arguments to :func:`run_batch_modes` first. Errors propagate
to the CLI (exit 2 for bad input, 3 for no feasible plan).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from pipedejavu.cli.capacity import add_capacity_options, run_capacity
from pipedejavu.cli.megatron_report import format_training_plan
from pipedejavu.cli.parsing import int_in, require_matplotlib
from pipedejavu.cli.pictures import write_picture
from pipedejavu.core.files import json_text
from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.planning.batch import (
    MAX_CANDIDATE_BATCHES,
    candidate_batches,
    plan_goodput,
)
from pipedejavu.planning.elastic import (
    elastic_counts,
    parse_gpu_range,
    plan_elastic,
)
from pipedejavu.planning.elastic_report import format_elastic, plot_elastic
from pipedejavu.planning.training import parse_gpu_pool

__all__ = ["add_plan_options", "parse_grad", "run_batch_modes"]


def add_plan_options(plan: Any) -> None:
    """Add the goodput, elastic and capacity options to the ``plan`` parser."""
    add_capacity_options(plan)
    plan.add_argument(
        "--goodput-grad",
        metavar="SQR,VAR",
        help="goodput mode: Pollux's gradient statistics (squared norm and "
        "variance of the gradient at --init-batch; two finite numbers >= 0, "
        "not both 0); the global batch is chosen too, maximizing throughput x "
        "statistical efficiency",
    )
    plan.add_argument(
        "--init-batch",
        type=int_in("--init-batch", 1, MAX_GLOBAL_BATCH),
        help="the batch the gradient statistics refer to (smallest candidate), "
        f"1 to {MAX_GLOBAL_BATCH}",
    )
    plan.add_argument(
        "--max-global-batch",
        type=int_in("--max-global-batch", 1, MAX_GLOBAL_BATCH),
        help=f"largest candidate global batch, 1 to {MAX_GLOBAL_BATCH}",
    )
    plan.add_argument(
        "--batch-multiple",
        type=int_in("--batch-multiple", 1, MAX_GLOBAL_BATCH),
        help="candidate global batches are multiples of this, 1 to "
        f"{MAX_GLOBAL_BATCH} (default: 1 in goodput mode, the GPUs per node in "
        f"elastic mode); goodput mode plans at most {MAX_CANDIDATE_BATCHES} "
        "candidates (raise it for a wide range)",
    )
    plan.add_argument(
        "--elastic",
        action="store_true",
        help="elastic mode: --gpus TYPE:LOW..HIGH; the best plan at every GPU "
        "count (whole nodes) and DeepSpeed's one global batch for all of them",
    )
    plan.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the plan: one iteration as a timeline per pipeline "
        "stage and each stage's memory by term (.png or .svg); elastic mode: "
        "throughput and goodput against the GPU count; capacity planning: cost "
        "against time to train (needs matplotlib: pip install 'pipedejavu[plot]')",
    )


def parse_grad(text: str) -> tuple[float, float]:
    """``"SQR,VAR"`` -> two finite non-negative floats, not both 0."""
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if (
        len(values) != 2
        or not all(math.isfinite(v) and v >= 0 for v in values)
        or values == (0.0, 0.0)
    ):
        raise ProblemError(
            f"--goodput-grad must be SQR,VAR: two finite numbers >= 0, not both 0; "
            f"got {text!r}"
        )
    return values  # type: ignore[return-value]


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_batch_modes(args: argparse.Namespace) -> int | None:
    """Run goodput or elastic mode; ``None`` for a plain ``plan`` call.

    Raises:
        ProblemError: inconsistent options.
    """
    if args.gpus_available:  # capacity planning
        return run_capacity(args)
    if not args.gpus:
        raise ProblemError(
            "give --gpus TYPE:COUNT (or --gpus-available TYPE:MAX with --tokens, "
            "--prices and --deadline or --budget: what to rent)"
        )
    goodput = args.goodput_grad is not None
    if not goodput and not args.elastic:
        if args.global_batch is None:
            raise ProblemError(
                "give --global-batch N (or --goodput-grad SQR,VAR for goodput "
                "mode, or --elastic)"
            )
        return None
    if args.export:
        raise ProblemError(
            "--export takes a fixed --global-batch (plan the batch goodput or "
            "elastic mode chose again with --export)"
        )
    grad = parse_grad(args.goodput_grad) if goodput else None
    if goodput and args.init_batch is None:
        raise ProblemError("--goodput-grad needs --init-batch N")
    high = args.max_global_batch or args.global_batch
    if high is None:
        raise ProblemError("give --max-global-batch N (the largest global batch)")
    if args.elastic:
        return _run_elastic(args, grad, high)
    if args.plot:
        raise ProblemError(
            "--plot draws a plan, elastic mode or capacity; not goodput mode"
        )
    return _run_goodput(args, grad, high)


def _run_goodput(args, grad, high) -> int:

    multiple = 1 if args.batch_multiple is None else args.batch_multiple
    pool = parse_gpu_pool(args.gpus)  # ranges checked before the first line
    batches = candidate_batches(args.init_batch, high, multiple)
    _progress(
        f"goodput mode: planning {args.model} on {', '.join(args.gpus)}, up to "
        f"{len(batches)} candidate batches (a plan search each, pruned by a "
        "bound) ..."
    )
    result = plan_goodput(
        args.model,
        pool,
        grad,
        args.init_batch,
        high,
        batches=batches,
        profiles=args.profiles,
        method=args.method,
        uniform_tp=not args.per_stage_tp,
        allow_fewer_gpus=not args.all_gpus,
        progress_fn=lambda r: _progress(
            f"  batch {r.batch}: {r.status}"
            + ("" if r.value is None else f", goodput {r.value:.3f}/s")
        ),
    )
    if args.json:
        print(json_text(result.to_json()))
        return 0
    print(
        f"goodput mode: global batch {result.global_batch} of "
        f"{len(result.records)} candidates ({result.planned} planned, "
        f"{result.pruned} pruned by their bound)\n"
        f"goodput {result.goodput:.3f} samples/s = throughput "
        f"{result.throughput:.3f} samples/s x efficiency {result.efficiency:.4f}"
    )
    print(format_training_plan(result.training))
    return 0


def _run_elastic(args, grad, high) -> int:

    if len(args.gpus) != 1:
        raise ProblemError("--elastic takes one --gpus TYPE:LOW..HIGH")
    if args.plot:
        require_matplotlib()
    gpu, low, top = parse_gpu_range(args.gpus[0])
    gpn = load_sailor_data(args.profiles).gpu_spec(gpu).gpus_per_node
    counts = elastic_counts(low, top, gpn)
    result = plan_elastic(
        args.model,
        gpu,
        counts,
        high,
        grad_params=grad,
        init_batch=args.init_batch,
        batch_multiple=args.batch_multiple,
        profiles=args.profiles,
        method=args.method,
        uniform_tp=not args.per_stage_tp,
        allow_fewer_gpus=not args.all_gpus,
        progress_fn=_progress,
    )
    if args.json:
        print(json_text(result.to_json()))
    else:
        print(format_elastic(result))
    if not args.plot:
        return 0
    return write_picture(lambda: plot_elastic(result, args.plot), args.plot)
