"""``plan``'s flags for a mixture of experts' expert layouts:
``--moe-dispatcher``, ``--moe-a2a-overlap`` and ``--moe-expert-tp``
(:mod:`pipedejavu.planning.expert_search`)."""

from __future__ import annotations

import argparse
from typing import Any

from pipedejavu.core.problem import ProblemError
from pipedejavu.planning.expert_search import DISPATCHERS_SEARCHED, MAX_EXPERT_TP

__all__ = ["add_expert_options", "expert_knobs", "refuse_expert_flags"]

_ON_OFF = {"auto": (False, True), "on": (True,), "off": (False,)}
_FLAGS = (
    ("--moe-dispatcher", "moe_dispatcher"),
    ("--moe-a2a-overlap", "moe_a2a_overlap"),
    ("--moe-expert-tp", "moe_expert_tp"),
)


def expert_tp_degrees(text: str) -> tuple[int, ...]:
    """``--moe-expert-tp``: a comma list of distinct degrees in
    ``[1, MAX_EXPERT_TP]``.

    Raises:
        argparse.ArgumentTypeError: anything else (one line).
    """
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts[:65])
    except ValueError:
        values = ()
    if (
        len(parts) > 64
        or not values
        or len(set(values)) != len(values)
        or not all(1 <= v <= MAX_EXPERT_TP for v in values)
    ):
        raise argparse.ArgumentTypeError(
            f"give distinct degrees from 1 to {MAX_EXPERT_TP}, comma separated; "
            f"got {text[:40]!r}"
        )
    return values


def add_expert_options(parser: Any) -> None:
    """``--moe-dispatcher``, ``--moe-a2a-overlap`` and ``--moe-expert-tp``."""
    parser.add_argument(
        "--moe-dispatcher",
        choices=("auto", *DISPATCHERS_SEARCHED),
        help="a mixture of experts' token dispatcher to search: alltoall, "
        "flex (DeepEP's fused dispatch and combine: Megatron-LM's "
        "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend "
        "deepep, which needs DeepEP installed) or auto, both (default: auto)",
    )
    parser.add_argument(
        "--moe-a2a-overlap",
        choices=tuple(_ON_OFF),
        help="a mixture of experts' dispatch and combine overlapped with another "
        "micro-batch's compute (Megatron-LM's --overlap-moe-expert-parallel-comm: "
        "no full recomputation, pipelines interleaved): auto searches both "
        "(default: auto)",
    )
    parser.add_argument(
        "--moe-expert-tp",
        type=expert_tp_degrees,
        metavar="N[,N]",
        help="a mixture of experts' expert TP degrees to search (Megatron-LM's "
        "--expert-tensor-parallel-size): a comma list; each degree adds as "
        "many expert layouts to the search (default: 1, each expert whole on "
        "its GPU, the published recipes' choice)",
    )


def refuse_expert_flags(args: argparse.Namespace, why: str) -> None:
    """Refuse either flag where it has no effect (``why``).

    Raises:
        ProblemError: one was given (one line).
    """
    given = [flag for flag, name in _FLAGS if getattr(args, name, None) is not None]
    if given:
        raise ProblemError(f"{' and '.join(given)}: {why}")


def expert_knobs(args: argparse.Namespace, spec: Any) -> dict[str, tuple]:
    """``plan_model``'s ``dispatchers``, ``dispatch_overlap`` and
    ``expert_tp`` from ``--moe-dispatcher``, ``--moe-a2a-overlap``
    (``auto``: both) and ``--moe-expert-tp`` (default 1).

    Raises:
        ProblemError: any of them for a model without experts.
    """
    if spec is None or spec.moe is None:
        why = f"only for a mixture of experts, and {args.model} has none"
        refuse_expert_flags(args, why)
        return {}
    dispatcher = getattr(args, "moe_dispatcher", None)
    overlap = getattr(args, "moe_a2a_overlap", None)
    return {
        "dispatchers": DISPATCHERS_SEARCHED
        if dispatcher in (None, "auto")
        else (dispatcher,),
        "dispatch_overlap": _ON_OFF[overlap or "auto"],
        "expert_tp": getattr(args, "moe_expert_tp", None) or (1,),
    }
