"""``plan``'s knob flags: the schedule, recomputation, sequence parallelism,
the distributed optimizer, the rank order and the kept switches, read into
the :class:`~pipedejavu.planning.knob_space.KnobSpace` the search takes
(:mod:`pipedejavu.cli.any_model` adds them with the training options)."""

from __future__ import annotations

import argparse
from typing import Any

from pipedejavu.cli.expert_flags import add_expert_options
from pipedejavu.core.plan3d import RANK_ORDERS
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import (
    MAX_RECOMPUTE_LAYERS,
    RECOMPUTE_GRANULARITIES,
)
from pipedejavu.io.exports import SWITCH_FLAGS, schedule_targets_text
from pipedejavu.planning.knob_space import SCHEDULES, KnobSpace
from pipedejavu.planning.plan_model import KEPT_OPTIONS

__all__ = [
    "add_knob_options",
    "knob_space",
    "knobs_asked",
    "recompute_choices",
    "recompute_layer_choices",
    "unused_at_tp1",
]

_KEPT_HELP = {
    "overlap_grad_reduce": "overlap the data-parallel gradient reduction with "
    "the backward pass",
    "overlap_param_gather": "overlap the distributed optimizer's parameter "
    "all-gather with the next forward (needs the distributed optimizer)",
    "grad_reduce_in_bf16": "reduce gradients in bf16 (bf16 or fp8 training)",
    "tp_comm_overlap": "run the tensor-parallel collectives beside their GEMMs "
    "(needs sequence parallelism)",
}


def recompute_choices(text: str) -> tuple[str, ...]:
    """``plan --recompute``: ``auto`` (every mode) or a comma list of modes."""
    values = tuple(v.strip() for v in text.split(","))
    if values == ("auto",):
        return RECOMPUTE_GRANULARITIES
    bad = [v for v in values if v not in RECOMPUTE_GRANULARITIES]
    if bad or not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"--recompute takes auto or distinct values of "
            f"{', '.join(RECOMPUTE_GRANULARITIES)} separated by commas, got {text!r}"
        )
    return values


_ON_OFF = {"auto": (True, False), "on": (True,), "off": (False,)}


def recompute_layer_choices(text: str) -> tuple[int | None, ...]:
    """``plan --recompute-num-layers``: a comma list of block counts and
    ``all`` (every block)."""
    values: list[int | None] = []
    for token in (v.strip() for v in text.split(",")):
        if token == "all":
            values.append(None)
        elif token.isdigit() and 1 <= int(token) <= MAX_RECOMPUTE_LAYERS:
            values.append(int(token))
        else:
            values = []
            break
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            "--recompute-num-layers takes distinct block counts >= 1 and 'all' "
            f"separated by commas, got {text!r}"
        )
    return tuple(values)


def add_knob_options(parser: Any) -> None:
    """``plan``'s knobs: ``--schedule``, ``--recompute`` (several modes),
    ``--sequence-parallel`` and ``--distributed-optimizer``
    (:mod:`pipedejavu.planning.knobs`)."""
    parser.add_argument(
        "--schedule",
        choices=("auto", *SCHEDULES),
        help="pipeline schedule to search: 1f1b, interleaved (Megatron-LM's "
        "interleaved 1F1B, equal chunks), zb-h1 (the zero-bubble ZB-H1: "
        "backward split into input- and weight-gradient passes; torchtitan's "
        "InterleavedZeroBubble with one stage per rank), interleaved-zb (the "
        "same over equal chunks, several per rank), zbv (ZB-V: two chunks per "
        "rank placed in a V, torchtitan's ZBVZeroBubble) or auto, all five "
        "(with --megatron-args: the two Megatron-LM runs) (default: auto for "
        "a model priced by the analytical model; 1f1b for a Sailor model "
        f"priced by its profiles); export targets: {schedule_targets_text()}",
    )
    parser.add_argument(
        "--recompute",
        type=recompute_choices,
        metavar="auto|MODE[,MODE]",
        help="activation recomputation to search, Megatron-LM's "
        "--recompute-granularity: auto (none, selective and full) or a comma "
        "list (default: auto for a model priced by the analytical model; none "
        "for a Sailor model priced by its profiles)",
    )
    parser.add_argument(
        "--recompute-num-layers",
        type=recompute_layer_choices,
        metavar="N|all[,...]",
        help="with full recomputation, the transformer blocks of each stage "
        "(model chunk) to recompute: N, the first N (Megatron-LM's "
        "--recompute-method block --recompute-num-layers N), or all (its "
        "uniform method); a comma list searches each (default: all; with "
        "--megatron-args, the launch's value and all)",
    )
    parser.add_argument(
        "--recompute-per-stage",
        action="store_true",
        default=None,
        help="with full recomputation, also search plans whose stages each "
        "rerun their own count of blocks: the least of 0 and "
        "--recompute-num-layers that fits (AdaPipe-style; 1F1B and ZB-H1; "
        "Megatron-LM and torchtitan take one count for every stage, so such a "
        "plan exports only where its stages' counts agree)",
    )
    parser.add_argument(
        "--rank-order",
        choices=("auto", RANK_ORDERS[0]),
        help="Megatron-LM's rank orders to search: auto (tp-dp-pp, its default, "
        "and tp-pp-dp, --use-tp-pp-dp-mapping; with --export, those the target "
        "lays out) or tp-dp-pp alone (default: auto)",
    )
    for flag, what in (
        ("--sequence-parallel", "Megatron-LM's --sequence-parallel (TP > 1)"),
        (
            "--distributed-optimizer",
            "Megatron-LM's --use-distributed-optimizer (optimizer state sharded "
            "over DP)",
        ),
    ):
        parser.add_argument(
            flag,
            choices=tuple(_ON_OFF),
            help=f"{what}: auto searches both (default: auto for a model priced "
            "by the analytical model; off for a Sailor model priced by its "
            "profiles)",
        )
    add_expert_options(parser)
    for name in KEPT_OPTIONS:
        parser.add_argument(
            SWITCH_FLAGS[name],
            action="store_true",
            default=None,
            help=f"{_KEPT_HELP[name]}: kept in every plan searched, as "
            "Megatron-LM's flag of that name (default: off; a Sailor model is "
            "then priced by the analytical model)",
        )


def unused_at_tp1(args: argparse.Namespace, plan: Any) -> list[str]:
    """A note where the command asked for sequence parallelism or
    ``--tp-comm-overlap`` and the best plan runs without TP, where they do
    nothing (Megatron-LM turns them off at TP 1, and so do the plan and its
    export)."""
    asked = [
        flag
        for flag, given in (
            (
                "--sequence-parallel on",
                getattr(args, "sequence_parallel", None) == "on",
            ),
            ("--tp-comm-overlap", getattr(args, "tp_comm_overlap", None)),
        )
        if given
    ]
    if not asked or any(r.tp > 1 for s in plan.stages for r in s.replicas):
        return []
    return [
        f"{' and '.join(asked)}: the best plan runs at TP 1, where they do nothing "
        "(Megatron-LM turns them off); the plan and its export run without them"
    ]


def knobs_asked(args: argparse.Namespace) -> bool:
    """A knob flag was given."""
    return any(
        getattr(args, name, None) is not None
        for name in (
            "schedule",
            "recompute",
            "sequence_parallel",
            "distributed_optimizer",
            "rank_order",
            "recompute_num_layers",
            "recompute_per_stage",
        )
    )


def knob_space(
    args: argparse.Namespace,
    auto: KnobSpace,
    schedules: tuple[str, ...] = SCHEDULES,
) -> KnobSpace:
    """The knobs ``plan`` searches: each knob flag given, else ``auto``'s
    values (every value for a model priced by the analytical model alone; the
    profiled value for a model priced by its profiles, where they cover its
    GPUs); ``--schedule auto`` means ``schedules``.

    Raises:
        ProblemError: flags that contradict each other (the reason, one
            line).
    """
    try:
        space = _knob_space(args, auto, schedules)
    except ValueError as error:
        raise ProblemError(f"the knob flags: {error}") from None
    if getattr(args, "recompute_num_layers", None) and "full" not in space.recompute:
        raise ProblemError(
            "--recompute-num-layers counts blocks of full recomputation, which "
            f"--recompute {','.join(space.recompute)} leaves out: add full to "
            "--recompute or drop it"
        )
    return space


def _knob_space(
    args: argparse.Namespace, auto: KnobSpace, schedules: tuple[str, ...]
) -> KnobSpace:
    return KnobSpace(
        tuple(args.recompute) if args.recompute else auto.recompute,
        _ON_OFF[args.sequence_parallel]
        if args.sequence_parallel
        else auto.sequence_parallel,
        _ON_OFF[args.distributed_optimizer]
        if args.distributed_optimizer
        else auto.distributed_optimizer,
        _schedules(args.schedule, schedules) if args.schedule else auto.schedules,
        RANK_ORDERS[:1]
        if getattr(args, "rank_order", None) == RANK_ORDERS[0]
        else auto.rank_orders,
        getattr(args, "recompute_num_layers", None) or auto.recompute_layers,
        bool(getattr(args, "recompute_per_stage", None)) or auto.recompute_per_stage,
    )


def _schedules(value: str, auto: tuple[str, ...]) -> tuple[str, ...]:
    return auto if value == "auto" else (value,)
