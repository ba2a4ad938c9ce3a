"""The expert layouts ``plan --model`` searches for a mixture of experts, and
the part of the knob space each one runs with.

An expert layout (:class:`~pipedejavu.costmodel.analytical.moe_layers.
ExpertLayers`) is an EP degree dividing the routed experts, an expert TP
degree (1 by default: each expert whole on its GPU, Megatron-Core's recipes'
choice; others when asked, ``--moe-expert-tp``), grouped GEMMs, a
token dispatcher (``alltoall``, or ``flex``, DeepEP's fused dispatch and
combine, Megatron-LM's ``--moe-token-dispatcher-type flex
--moe-flex-dispatcher-backend deepep``) and whether the dispatch and combine
overlap another micro-batch's compute (``--overlap-moe-expert-parallel-comm``).

The overlap runs only where :func:`~pipedejavu.core.moe.dispatch_overlap_needs`
holds (the rule the Megatron-LM reader refuses launches by): a layout with it
is searched without full recomputation, with Megatron-LM's schedules only, the
1F1B schedule without pipeline stages and pipelines interleaved
(:func:`layout_search` asks the rule each of these).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from pipedejavu.core.moe import dispatch_overlap_needs, expert_tp_needs
from pipedejavu.core.training_options import params_dtype
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass
from pipedejavu.io.megatron_moe import MoeOptions
from pipedejavu.planning.knob_space import MEGATRON_SCHEDULES, KnobSpace
from pipedejavu.search.megatron.space import divisors

__all__ = [
    "DISPATCHERS_SEARCHED",
    "MAX_EXPERT_TP",
    "ExpertSearch",
    "expert_layouts",
    "layers_of",
    "layout_search",
    "moe_options_of",
]

#: The token dispatchers ``plan --model`` searches (``--moe-dispatcher``).
DISPATCHERS_SEARCHED = ("alltoall", "flex")
#: The largest expert TP degree ``plan --model`` may be asked to search
#: (``--moe-expert-tp``; the default is 1).
MAX_EXPERT_TP = 1024


@dataclasses.dataclass(frozen=True)
class ExpertSearch:
    """One expert layout and the knobs searched with it.

    Attributes:
        layers: the layout.
        space: the knob space it runs with.
        one_stage_1f1b: its 1F1B plans have one stage (pipelines are
            interleaved).
    """

    layers: ExpertLayers
    space: KnobSpace
    one_stage_1f1b: bool = False


def expert_layouts(
    spec: TransformerSpec,
    gpus: int,
    *,
    dispatchers: Sequence[str] = ("alltoall",),
    overlap: Sequence[bool] = (False,),
    expert_tp: Sequence[int] = (1,),
) -> list[ExpertLayers]:
    """Every expert layout of ``spec`` on ``gpus`` GPUs (module docstring):
    each EP degree dividing the routed experts, with each expert TP degree
    given (``etp x ep`` at most the GPUs; expert TP 1 for experts with linear
    biases, :func:`~pipedejavu.core.moe.expert_tp_needs`), each dispatcher
    and overlap given;
    the flex dispatcher and the overlap only with EP > 1 (without it there
    is nothing to send)."""
    assert spec.moe is not None
    out = []
    for ep, etp in itertools.product(divisors(spec.moe.num_experts), expert_tp):
        if ep * etp > gpus or expert_tp_needs(etp=etp, linear_bias=spec.linear_bias):
            continue
        for dispatcher in dispatchers:
            for beside in overlap:
                if ep == 1 and (dispatcher != "alltoall" or beside):
                    continue
                experts = ExpertPass(
                    ep=ep, etp=etp, grouped_gemm=True, dispatcher=dispatcher
                )
                out.append(ExpertLayers(experts, overlap_dispatch=beside))
    return out


def layout_search(
    layers: ExpertLayers,
    space: KnobSpace,
    *,
    precision: str,
    mtp_layers: int = 0,
) -> ExpertSearch | None:
    """``space`` cut to what ``layers`` runs with: the experts' rank order
    (:meth:`~pipedejavu.planning.knob_space.KnobSpace.for_experts`) and the
    overlap's rule (module docstring); ``None`` where the layout runs with no
    plan of it."""
    space = space.for_experts()
    if not layers.overlap_dispatch:
        return ExpertSearch(layers, space)
    experts = layers.experts

    def runs(pp: int, chunks: int, recompute: str = "none") -> bool:
        return (
            dispatch_overlap_needs(
                ep=experts.ep,
                dispatcher=experts.dispatcher,
                pp=pp,
                chunks=chunks,
                full_recompute=recompute == "full",
                params_dtype=params_dtype(precision),
                shared_expert_overlap=experts.shared_expert_overlap,
                mtp_layers=mtp_layers,
            )
            is None
        )

    one, interleaved, piped = runs(1, 1), runs(2, 2), runs(2, 1)
    schedules = [s for s in space.schedules if s in MEGATRON_SCHEDULES]
    if not interleaved:
        schedules = [s for s in schedules if s != "interleaved"]
    if not (one or piped):
        schedules = [s for s in schedules if s != "1f1b"]
    shapes = [(1, 1)] * one + [(2, 2)] * interleaved + [(2, 1)] * piped
    recompute = tuple(
        r for r in space.recompute if any(runs(p, c, r) for p, c in shapes)
    )
    if not schedules or not recompute:
        return None
    cut = dataclasses.replace(
        space,
        schedules=tuple(schedules),
        recompute=recompute,
        recompute_per_stage=space.recompute_per_stage and "full" in recompute,
    )
    return ExpertSearch(layers, cut, one_stage_1f1b=not piped)


def moe_options_of(layers: ExpertLayers) -> MoeOptions:
    """The Megatron-LM switches ``layers`` was priced with (what a plan file
    records and ``--export megatron`` writes; the flex dispatcher's backend:
    DeepEP, the one priced)."""
    experts = layers.experts
    return MoeOptions(
        dispatcher=experts.dispatcher,  # type: ignore[arg-type]
        flex_backend="deepep" if experts.dispatcher == "flex" else None,
        grouped_gemm=experts.grouped_gemm,
        capacity_factor=experts.capacity_factor,
        pad_to_capacity=experts.pad_to_capacity,
        shared_expert_overlap=experts.shared_expert_overlap,
        overlap_dispatch=layers.overlap_dispatch,
    )


def layers_of(options: MoeOptions, ep: int, etp: int | None) -> ExpertLayers:
    """How experts laid out over ``ep`` x ``etp`` and run with ``options``
    are priced (routing balanced: what ``--moe-router-force-load-balancing``
    makes so, and what the prediction assumes without it)."""
    experts = ExpertPass(
        ep=ep,
        etp=etp,
        grouped_gemm=options.grouped_gemm,
        capacity_factor=options.capacity_factor,
        pad_to_capacity=options.pad_to_capacity,
        dispatcher=options.dispatcher,
        shared_expert_overlap=options.shared_expert_overlap,
    )
    return ExpertLayers(experts, overlap_dispatch=options.overlap_dispatch)
