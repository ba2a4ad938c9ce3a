"""Tokens, capacity and dispatch bytes of a mixture-of-experts block on one
GPU for one micro-batch: how the expert layers run (:class:`ExpertPass`), how
many tokens each local expert takes (:func:`expert_tokens`, :func:`expert_shape`)
and the bytes the expert-parallel dispatch and combine send
(:func:`dispatch_bytes`, :func:`combine_bytes`), which
:mod:`~pipedejavu.costmodel.analytical.moe_ops` leaves out of its operations
for the caller to price where the EP group lies.
"""

from __future__ import annotations

import dataclasses
import math

from pipedejavu.core import moe_counts
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.ops import (
    PassOptions,
    element_bytes,
    validate_spec,
)

__all__ = [
    "DISPATCHERS",
    "INDEX_BYTES",
    "ROUTING_MAP_BYTES",
    "ExpertPass",
    "ExpertShape",
    "combine_bytes",
    "dispatch_bytes",
    "expert_shape",
    "expert_tokens",
    "miss_probability",
]

#: Megatron-LM's ``--moe-token-dispatcher-type`` choices.
DISPATCHERS = ("alltoall", "allgather", "flex")
#: Bytes of one entry of a permutation's row map (int32).
INDEX_BYTES = 4
#: Bytes of one entry of the router's boolean routing map.
ROUTING_MAP_BYTES = 1
#: The largest imbalance factor taken (bounded input).
MAX_IMBALANCE = 1024.0


@dataclasses.dataclass(frozen=True)
class ExpertPass:
    """How the expert layers run, besides :class:`PassOptions`.

    Args:
        ep: expert-parallel degree (``E / ep`` experts a GPU).
        etp: expert tensor-parallel degree (each expert's width split ``etp``
            ways); ``None``: the attention's ``tp``.
        imbalance: the busiest expert's tokens over the mean (1.0: balanced
            routing, the default). Every local expert of the priced GPU gets
            that load: an upper bound where one expert alone is hot.
        grouped_gemm: the local experts' GEMMs run as one grouped GEMM
            (``--moe-grouped-gemm``; Megatron-LM's default is off).
        capacity_factor: each expert takes at most ``ceil(T k / E x
            capacity_factor)`` tokens from each GPU (the rest dropped),
            ``--moe-expert-capacity-factor``; ``None``: no cap.
        pad_to_capacity: each expert gets exactly its capacity
            (``--moe-pad-expert-input-to-capacity``; needs a capacity factor).
        dispatcher: ``alltoall``, ``allgather`` or ``flex``
            (``--moe-token-dispatcher-type``; Megatron-LM's default is
            ``allgather``, the published recipes set ``alltoall``).
        shared_expert_overlap: the shared experts run beside the dispatch and
            combine (``--moe-shared-expert-overlap``; alltoall only, as
            Megatron-Core checks): see :func:`overlapped_shared_ops`.
        router_fp32: the router's logits and probabilities in fp32
            (``--moe-router-dtype fp32``); else the activations' dtype.

    Raises:
        ValueError: a field out of range (one line).
    """

    ep: int = 1
    etp: int | None = None
    imbalance: float = 1.0
    grouped_gemm: bool = False
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    dispatcher: str = "alltoall"
    shared_expert_overlap: bool = False
    router_fp32: bool = False

    def __post_init__(self) -> None:
        for name in ("ep", "etp"):
            value = getattr(self, name)
            if value is None and name == "etp":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not _is_number(self.imbalance) or not (
            1.0 <= self.imbalance <= MAX_IMBALANCE
        ):
            raise ValueError(
                f"imbalance must be a number in [1, {MAX_IMBALANCE:g}], "
                f"got {self.imbalance!r}"
            )
        cap = self.capacity_factor
        if cap is not None and (not _is_number(cap) or not 0.0 < cap <= 1024.0):
            raise ValueError(
                f"capacity_factor must be None or a number in (0, 1024], got {cap!r}"
            )
        for name in (
            "grouped_gemm",
            "pad_to_capacity",
            "shared_expert_overlap",
            "router_fp32",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name} must be true or false, got {getattr(self, name)!r}"
                )
        if self.pad_to_capacity and cap is None:
            raise ValueError("pad_to_capacity needs a capacity_factor")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"dispatcher must be one of {', '.join(DISPATCHERS)}, "
                f"got {self.dispatcher!r}"
            )
        if self.shared_expert_overlap and self.dispatcher != "alltoall":
            raise ValueError("shared_expert_overlap needs the alltoall dispatcher")


def _is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


# ------------------------------------------------------------------ shapes
@dataclasses.dataclass(frozen=True)
class ExpertShape:
    block: int  # the first expert block (0-based)
    tokens: float  # T: tokens the GPU holds (b s / tp with SP)
    sent: float  # routed copies the GPU permutes and sends (T k, capped)
    local_experts: int  # L = E / ep
    per_expert: float  # n: tokens each local expert's GEMMs take
    etp: int
    act: float  # bytes of an activation element
    router: float  # bytes of a logit / probability


def expert_shape(
    spec: TransformerSpec, opts: PassOptions, experts: ExpertPass
) -> ExpertShape:
    moe = spec.moe
    if moe is None:
        raise ValueError(f"model {spec.name}: no experts (moe is None)")
    if not isinstance(experts, ExpertPass):
        raise ValueError(f"experts must be an ExpertPass, got {experts!r}")
    validate_spec(spec, opts.tp)
    etp = opts.tp if experts.etp is None else experts.etp
    moe_counts.check_expert_split(spec, experts.ep, etp)
    if opts.tp > 1 and not opts.sequence_parallel:
        raise ValueError(
            f"model {spec.name}: Megatron-Core's MoE layer trains with tp > 1 only "
            "with sequence parallelism"
        )
    if moe.shared_ffn_hidden_size % opts.tp:
        raise ValueError(
            f"model {spec.name}: tp {opts.tp} must divide the shared experts' "
            f"ffn_hidden_size ({moe.shared_ffn_hidden_size})"
        )
    if experts.dispatcher == "flex" and etp * experts.ep == 1:
        raise ValueError("the flex dispatcher needs etp x ep > 1")
    act, _ = element_bytes(opts.precision)
    tokens = opts.mbs * spec.seq_length / opts.tp
    k, num = moe.topk, moe.num_experts
    mean = tokens * k / num  # a source GPU's copies for one expert, balanced
    hot = mean * experts.imbalance
    sent = tokens * k
    if experts.capacity_factor is not None:
        capacity = math.ceil(mean * experts.capacity_factor)
        hot = capacity if experts.pad_to_capacity else min(hot, capacity)
        sent = num * capacity if experts.pad_to_capacity else min(sent, num * capacity)
    block = next(b for b in range(spec.num_layers) if moe.is_expert_block(b))
    return ExpertShape(
        block=block,
        tokens=tokens,
        sent=sent,
        local_experts=num // experts.ep,
        per_expert=hot * experts.ep * etp,
        etp=etp,
        act=act,
        router=4.0 if experts.router_fp32 else act,
    )


def expert_tokens(
    spec: TransformerSpec, opts: PassOptions, experts: ExpertPass
) -> float:
    """Tokens each local expert's GEMMs take on one GPU per micro-batch: the
    ``T k / E`` copies each of the ``ep x etp`` GPUs sharing the expert sends it
    (``T = b s / tp``), times ``imbalance``, capped at (or, padded, equal to)
    the capacity ``ceil(T k / E x capacity_factor)`` per sender.

    Raises:
        ValueError: a spec without experts, degrees that do not split it, or
            ``tp > 1`` without sequence parallelism.
    """
    return expert_shape(spec, opts, experts).per_expert


# ---------------------------------------------------------------- dispatch
def miss_probability(num: int, local: int, k: int) -> float:
    """Chance that a token's ``k`` experts (drawn without repeats from
    ``num``) avoid a given GPU's ``local`` experts."""
    p = 1.0
    for i in range(k):
        p *= max(num - local - i, 0) / (num - i)
    return p


def dispatch_bytes(
    spec: TransformerSpec, opts: PassOptions, experts: ExpertPass
) -> float:
    """Bytes one GPU sends in one forward dispatch of one micro-batch, only
    what leaves it, under balanced routing (``T = b s / tp`` tokens held):

    * ``alltoall``: the ``T k`` routed copies (capped at the capacity) of
      ``h`` activations and their probability, ``(ep - 1) / ep`` of them to
      the other GPUs of the EP group;
    * ``allgather``: the all-gather over the ``g = etp x ep`` GPUs of the
      tokens, their probabilities and routing map (``E`` each): ``(g - 1) T``
      rows;
    * ``flex``: one copy of each token to each other GPU of the ``etp x ep``
      group holding one of its experts (DeepEP sends a token once per GPU):
      ``(g - 1) (1 - P)`` copies, ``P`` the chance that none of its ``k``
      experts is on a given EP rank.

    The backward runs two more all-to-alls: the combine's gradient goes the
    dispatch's way with these bytes (without the probabilities), the
    dispatch's gradient the combine's way (:func:`combine_bytes`).

    Raises:
        ValueError: as :func:`expert_block_forward_ops`.
    """
    shape = expert_shape(spec, opts, experts)
    h, num, ep = spec.hidden_size, spec.moe.num_experts, experts.ep
    row = h * shape.act
    if experts.dispatcher == "alltoall":
        return shape.sent * (row + shape.router) * (ep - 1) / ep
    group = shape.etp * ep
    if experts.dispatcher == "allgather":
        per_token = row + num * (shape.router + ROUTING_MAP_BYTES)
        return (group - 1) * shape.tokens * per_token
    miss = miss_probability(num, shape.local_experts, spec.moe.topk)
    return (group - 1) * (1.0 - miss) * shape.tokens * row


def combine_bytes(
    spec: TransformerSpec, opts: PassOptions, experts: ExpertPass
) -> float:
    """Bytes one GPU sends in one forward combine of one micro-batch: the
    dispatched rows back, in the activations' dtype (``alltoall``, ``flex``),
    or the reduce-scatter over ``etp x ep`` GPUs in the probabilities' dtype
    (``allgather``). See :func:`dispatch_bytes`."""
    shape = expert_shape(spec, opts, experts)
    h, ep = spec.hidden_size, experts.ep
    if experts.dispatcher == "alltoall":
        return shape.sent * h * shape.act * (ep - 1) / ep
    group = shape.etp * ep
    if experts.dispatcher == "allgather":
        return (group - 1) * shape.tokens * h * shape.router
    miss = miss_probability(spec.moe.num_experts, shape.local_experts, spec.moe.topk)
    return (group - 1) * (1.0 - miss) * shape.tokens * h * shape.act
