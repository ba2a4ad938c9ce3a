"""Megatron-LM's mixture-of-experts, multi-latent-attention and MTP flags.

:func:`read_moe` turns the flags of :data:`MOE_INT_FLAGS`,
:data:`MOE_TEXT_FLAGS`, :data:`MOE_CHOICE_FLAGS`, :data:`MOE_LIST_FLAGS` and
:data:`MOE_BOOL_FLAGS` (read by :func:`~pipedejavu.io.megatron_command.
read_flags`) into the model's :class:`~pipedejavu.core.moe.MoeSpec`,
:class:`~pipedejavu.core.moe.MlaSpec`, MTP layers and per-head query/key norm,
the expert-parallel sizes, and the run's MoE switches (:class:`MoeOptions`).

Defaults are Megatron-LM's (core_v0.16.1: ``megatron/training/arguments.py``
and ``megatron/core/transformer/transformer_config.py``): ``--num-experts 0``
is a dense model; ``--moe-router-topk`` 2; ``--moe-ffn-hidden-size`` the
``--ffn-hidden-size``; ``--moe-layer-freq`` 1 (every layer;
:func:`~pipedejavu.io.megatron_pattern.moe_layer_freq`);
``--expert-tensor-parallel-size`` the ``--tensor-model-parallel-size``;
``--moe-token-dispatcher-type`` allgather (flex: ``--moe-flex-dispatcher-
backend`` deepep); ``--kv-lora-rank`` 32, ``--qk-head-dim`` 128,
``--qk-pos-emb-head-dim`` 64, ``--v-head-dim`` 128, no ``--q-lora-rank``
(queries projected directly). Flags Megatron-LM reads only with another
(the MoE flags without ``--num-experts``, the MLA ranks without
``--multi-latent-attention``, the shared-expert gate and overlap without
shared experts) are listed as ignored. Settings Megatron-LM refuses are
refused here with one line; each check cites where Megatron-LM makes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import json_fields
from pipedejavu.core.moe import (
    MlaSpec,
    MoeSpec,
    dispatch_overlap_needs,
    expert_tp_needs,
)
from pipedejavu.io.megatron_pattern import moe_layer_freq

__all__ = [
    "DISPATCHERS",
    "MOE_BOOL_FLAGS",
    "MOE_CHOICE_FLAGS",
    "MOE_INT_FLAGS",
    "MOE_LIST_FLAGS",
    "MOE_TEXT_FLAGS",
    "MoeOptions",
    "MoeRead",
    "read_moe",
]

#: Megatron-LM's token dispatchers (``--moe-token-dispatcher-type``).
DISPATCHERS = ("allgather", "alltoall", "flex")
#: Flags read as positive integers.
MOE_INT_FLAGS = (
    "moe-router-topk",
    "moe-ffn-hidden-size",
    "moe-shared-expert-intermediate-size",
    "expert-model-parallel-size",
    "expert-tensor-parallel-size",
    "q-lora-rank",
    "kv-lora-rank",
    "qk-head-dim",
    "qk-pos-emb-head-dim",
    "v-head-dim",
)
#: Flags read as text and converted here (0 allowed, a float, a pattern).
MOE_TEXT_FLAGS = (
    "num-experts",
    "mtp-num-layers",
    "moe-expert-capacity-factor",
    "moe-layer-freq",
)
#: Flags read as one of some words (Megatron-LM's choices, 0.16.1 and on).
MOE_CHOICE_FLAGS = {
    "moe-token-dispatcher-type": DISPATCHERS,
    "moe-flex-dispatcher-backend": ("deepep", "hybridep", "ncclep"),
    "moe-router-score-function": ("softmax", "sigmoid", "sqrtsoftplus"),
    "moe-router-load-balancing-type": (
        "aux_loss",
        "seq_aux_loss",
        "global_aux_loss",
        "sinkhorn",
        "quantile_balancing",
        "none",
    ),
}
#: Flags read as one or more words (``nargs='+'``).
MOE_LIST_FLAGS = ("moe-router-load-balancing-type",)
#: Switches.
MOE_BOOL_FLAGS = (
    "moe-grouped-gemm",
    "moe-router-force-load-balancing",
    "moe-pad-expert-input-to-capacity",
    "moe-shared-expert-overlap",
    "moe-shared-expert-gate",
    "overlap-moe-expert-parallel-comm",
    "moe-router-pre-softmax",
    "moe-enable-deepep",
    "multi-latent-attention",
    "qk-layernorm",
)
#: The flags that mean nothing without ``--num-experts`` (Megatron-LM reads
#: them only for expert layers).
_EXPERT_ONLY = (
    "moe-router-topk",
    "moe-shared-expert-intermediate-size",
    "moe-layer-freq",
    "moe-token-dispatcher-type",
    "moe-flex-dispatcher-backend",
    "moe-grouped-gemm",
    "moe-router-force-load-balancing",
    "moe-expert-capacity-factor",
    "moe-pad-expert-input-to-capacity",
    "moe-shared-expert-overlap",
    "moe-shared-expert-gate",
    "expert-tensor-parallel-size",
    "moe-enable-deepep",
)
#: Router settings: checked as Megatron-LM checks them, but they change
#: nothing a prediction reads.
_ROUTER_ONLY = (
    "moe-router-score-function",
    "moe-router-pre-softmax",
    "moe-router-load-balancing-type",
)
#: The MLA flags, in :class:`~pipedejavu.core.moe.MlaSpec`'s order, with
#: Megatron-LM's defaults (``_add_mla_args``; no q-lora-rank: 0 here).
_MLA_DEFAULTS = {
    "q-lora-rank": 0,
    "kv-lora-rank": 32,
    "qk-head-dim": 128,
    "qk-pos-emb-head-dim": 64,
    "v-head-dim": 128,
}
_MLA_ONLY = tuple(_MLA_DEFAULTS)
#: Load balancing a capacity factor works with (TransformerConfig).
_CAPACITY_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


@dataclasses.dataclass(frozen=True)
class MoeOptions:
    """How a Megatron-LM run moves and computes its experts' tokens.

    Attributes:
        dispatcher: ``--moe-token-dispatcher-type`` (:data:`DISPATCHERS`).
        flex_backend: the flex dispatcher's backend (``deepep``, ``hybridep``,
            ``ncclep``); ``None`` for the other dispatchers.
        grouped_gemm: ``--moe-grouped-gemm`` (one grouped GEMM for the local
            experts instead of one GEMM each).
        force_load_balancing: ``--moe-router-force-load-balancing`` (tokens
            routed evenly, as benchmarks run).
        capacity_factor: ``--moe-expert-capacity-factor`` (tokens past it are
            dropped); ``None``: dropless.
        pad_to_capacity: ``--moe-pad-expert-input-to-capacity``.
        shared_expert_overlap: ``--moe-shared-expert-overlap`` (the shared
            experts run beside the dispatch all-to-all).
        overlap_dispatch: ``--overlap-moe-expert-parallel-comm`` (the
            dispatch and combine all-to-alls overlapped with another
            micro-batch's compute).

    Raises:
        ValueError: a dispatcher not in :data:`DISPATCHERS`, a capacity
            factor that is not a finite non-negative number.
    """

    dispatcher: Literal["allgather", "alltoall", "flex"] = "allgather"
    flex_backend: str | None = None
    grouped_gemm: bool = False
    force_load_balancing: bool = False
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    shared_expert_overlap: bool = False
    overlap_dispatch: bool = False

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"dispatcher must be one of {', '.join(DISPATCHERS)}, "
                f"got {self.dispatcher!r:.40}"
            )
        factor = self.capacity_factor
        if factor is not None and not (
            isinstance(factor, float) and math.isfinite(factor) and factor >= 0
        ):
            raise ValueError(
                f"capacity_factor must be a finite float >= 0 or None, got "
                f"{factor!r:.40}"
            )
        backends = MOE_CHOICE_FLAGS["moe-flex-dispatcher-backend"]
        if self.flex_backend is not None and self.flex_backend not in backends:
            raise ValueError(
                f"flex_backend must be one of {', '.join(backends)} or None, "
                f"got {self.flex_backend!r:.40}"
            )
        for name in (
            "grouped_gemm",
            "force_load_balancing",
            "pad_to_capacity",
            "shared_expert_overlap",
            "overlap_dispatch",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name} must be true or false, got {getattr(self, name)!r:.40}"
                )

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object (what a plan file records)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> MoeOptions:
        """Options from a JSON object written by :meth:`to_json`; absent keys
        take their defaults.

        Raises:
            ValueError: not an object, an unknown key, or a bad value (one
                line).
        """
        values = json_fields(cls, data, "experts")
        factor = values.get("capacity_factor")
        if isinstance(factor, int) and not isinstance(factor, bool):
            values["capacity_factor"] = float(factor)
        return cls(**values)


class MoeRead(NamedTuple):
    """What :func:`read_moe` reads (``moe``/``options`` ``None`` for a dense
    run, ``mla`` ``None`` without multi-latent attention)."""

    moe: MoeSpec | None
    mla: MlaSpec | None
    mtp_layers: int
    qk_layernorm: bool
    ep: int
    etp: int | None
    options: MoeOptions | None
    ignored: list[str]


def _refuse(text: str) -> ProblemError:
    return ProblemError(f"Megatron arguments: {text}")


def _count(values: Mapping[str, Any], flag: str) -> int | None:
    """A text flag read as a non-negative integer (``None`` if absent)."""
    if flag not in values:
        return None
    text = values[flag]
    try:
        if len(text) > 40:  # (int() of thousands of digits takes long)
            raise ValueError(text)
        number = int(text)
    except ValueError:
        raise _refuse(f"--{flag} must be an integer, got {text[:40]!r}") from None
    if number < 0:  # (TransformerConfig refuses negative counts)
        raise _refuse(f"--{flag} must be >= 0, got {number}")
    return number


def _capacity(values: Mapping[str, Any]) -> float | None:
    text = values.get("moe-expert-capacity-factor")
    if text is None:
        return None
    try:
        factor = float(text[:40])
    except ValueError:
        factor = math.nan
    if not math.isfinite(factor) or len(text) > 40:
        raise _refuse(
            f"--moe-expert-capacity-factor must be a finite number, got {text[:40]!r}"
        )
    # TransformerConfig: a negative factor means none (dropless)
    return None if factor < 0 else factor


def _not_read(values: Mapping[str, Any], flags: tuple[str, ...], why: str) -> list:
    out = []
    for flag in flags:
        if flag in values:
            value = values[flag]
            if isinstance(value, tuple):
                value = " ".join(value)
            shown = "" if value is True else f" {value}"
            out.append(f"--{flag}{shown} (no effect {why})")
    return out


def _router_checks(values: Mapping[str, Any], topk: int, capacity: float | None):
    """TransformerConfig.__post_init__'s router checks (core_v0.16.1); they
    apply whether or not the run has experts."""
    balancing = values.get("moe-router-load-balancing-type", ("aux_loss",))
    single = balancing[0] if len(balancing) == 1 else None
    score = values.get("moe-router-score-function", "softmax")
    if (
        topk == 1
        and score == "softmax"
        and not values.get("moe-router-pre-softmax")
        and single != "sinkhorn"
    ):
        # softmax over one score has zero gradient
        raise _refuse(
            "--moe-router-topk 1 with the softmax score function needs "
            "--moe-router-pre-softmax, as Megatron-LM's TransformerConfig asserts"
        )
    if capacity is not None and any(b not in _CAPACITY_BALANCING for b in balancing):
        raise _refuse(
            "--moe-expert-capacity-factor works only with the aux_loss, "
            "seq_aux_loss, global_aux_loss or none load balancing, as Megatron-LM's "
            "TransformerConfig asserts"
        )
    if values.get("moe-pad-expert-input-to-capacity") and capacity is None:
        raise _refuse(
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
            "(TransformerConfig)"
        )


def _options(values: Mapping[str, Any], capacity: float | None) -> MoeOptions:
    dispatcher = values.get("moe-token-dispatcher-type", "allgather")
    backend = values.get("moe-flex-dispatcher-backend", "deepep")
    if values.get("moe-enable-deepep"):
        # TransformerConfig: the deprecated switch needs flex and means deepep
        if dispatcher != "flex" or backend == "hybridep":
            raise _refuse(
                "--moe-enable-deepep needs --moe-token-dispatcher-type flex and "
                "no other backend (TransformerConfig)"
            )
        backend = "deepep"
    if dispatcher == "flex" and values.get("moe-pad-expert-input-to-capacity"):
        if backend == "deepep":  # TransformerConfig
            raise _refuse(
                "the flex dispatcher's deepep backend does not support "
                "--moe-pad-expert-input-to-capacity (TransformerConfig)"
            )
    return MoeOptions(
        dispatcher=dispatcher,
        flex_backend=backend if dispatcher == "flex" else None,
        grouped_gemm=bool(values.get("moe-grouped-gemm")),
        force_load_balancing=bool(values.get("moe-router-force-load-balancing")),
        capacity_factor=capacity,
        pad_to_capacity=bool(values.get("moe-pad-expert-input-to-capacity")),
        shared_expert_overlap=bool(values.get("moe-shared-expert-overlap")),
        overlap_dispatch=bool(values.get("overlap-moe-expert-parallel-comm")),
    )


def _experts(
    values: Mapping[str, Any],
    num_experts: int,
    *,
    num_layers: int,
    ffn_hidden_size: int,
    tp: int,
) -> tuple[MoeSpec, int, list[str]]:
    """The expert layers and the expert tensor parallelism."""
    ignored = []
    topk = int(values.get("moe-router-topk", 2))
    # validate_args: the experts' width defaults to --ffn-hidden-size
    width = int(values.get("moe-ffn-hidden-size", ffn_hidden_size))
    shared = int(values.get("moe-shared-expert-intermediate-size", 0))
    if not shared:
        ignored += _not_read(
            values,
            ("moe-shared-expert-gate", "moe-shared-expert-overlap"),
            "without --moe-shared-expert-intermediate-size",
        )
    layers = moe_layer_freq(str(values.get("moe-layer-freq", "1")), num_layers)
    if not any(layers):
        raise _refuse(
            f"--moe-layer-freq {values['moe-layer-freq']!r} makes no layer an expert "
            "layer: give no --num-experts for a dense model"
        )
    if topk > num_experts:  # (the router's top-k of E scores fails)
        raise _refuse(
            f"--moe-router-topk {topk} is more than --num-experts {num_experts}"
        )
    etp = int(values.get("expert-tensor-parallel-size", tp))
    if width % etp:
        # the experts' GEMMs (TEGroupedLinear) split their width with divide()
        raise _refuse(
            f"--expert-tensor-parallel-size {etp} must divide the experts' width "
            f"{width} (--moe-ffn-hidden-size)"
        )
    if shared % tp:  # the shared experts' MLP is split over TP
        raise _refuse(
            f"--tensor-model-parallel-size {tp} must divide "
            f"--moe-shared-expert-intermediate-size {shared}"
        )
    biased = not values.get("disable-bias-linear")
    if expert_tp_needs(etp=etp, linear_bias=biased) is not None:
        raise _refuse(
            f"experts with linear biases (no --disable-bias-linear) need "
            f"--expert-tensor-parallel-size 1, not {etp}, as Megatron-LM asserts"
        )
    try:
        moe = MoeSpec(
            num_experts=num_experts,
            topk=topk,
            ffn_hidden_size=width,
            shared_ffn_hidden_size=shared,
            layers=None if all(layers) else layers,
            shared_expert_gate=bool(shared and values.get("moe-shared-expert-gate")),
        )
    except ValueError as error:
        raise _refuse(str(error)) from None
    return moe, etp, ignored


def _overlap_checks(
    values: Mapping[str, Any],
    options: MoeOptions,
    *,
    ep: int,
    pp: int,
    chunks: int,
    recompute: tuple[Any, Any, Any],
    params_dtype: str,
    mtp_layers: int,
) -> None:
    """TransformerConfig.__post_init__'s checks of
    ``--overlap-moe-expert-parallel-comm`` (core_v0.16.1):
    :func:`~pipedejavu.core.moe.dispatch_overlap_needs`."""
    needs = dispatch_overlap_needs(
        ep=ep,
        dispatcher=options.dispatcher,
        pp=pp,
        chunks=chunks,
        full_recompute=recompute[0] == "full" or recompute[1] is not None,
        params_dtype=params_dtype,
        shared_expert_overlap=options.shared_expert_overlap
        and "moe-shared-expert-intermediate-size" in values,
        mtp_layers=mtp_layers,
    )
    if needs is not None:
        raise _refuse(
            f"--overlap-moe-expert-parallel-comm needs {needs} (TransformerConfig)"
        )


def read_moe(
    values: Mapping[str, Any],
    *,
    num_layers: int,
    ffn_hidden_size: int,
    tp: int,
    pp: int,
    chunks: int,
    recompute: tuple[Any, Any, Any],
    params_dtype: str,
    position: str,
) -> MoeRead:
    """The MoE, MLA and MTP flags of a Megatron-LM run (module docstring).

    Args:
        values: the flags read (:func:`~pipedejavu.io.megatron_command.
            read_flags`).
        num_layers, ffn_hidden_size: the model's (``--ffn-hidden-size`` or
            its default).
        tp, pp, chunks: tensor and pipeline parallelism, model chunks per
            pipeline rank.
        recompute: ``(granularity, method, num_layers)`` of the run.
        params_dtype: ``fp32``, ``fp16`` or ``bf16``.
        position: ``--position-embedding-type`` (``rope``, ...).

    Raises:
        ProblemError: a value or combination Megatron-LM refuses, or a form
            of ``--moe-layer-freq`` not read here.
    """
    ignored: list[str] = []
    # validate_args: --num-experts 0 is no experts
    num_experts = _count(values, "num-experts") or 0
    mtp_layers = _count(values, "mtp-num-layers") or 0
    ep = int(values.get("expert-model-parallel-size", 1))
    capacity = _capacity(values)
    _router_checks(values, int(values.get("moe-router-topk", 2)), capacity)
    ignored += _not_read(values, _ROUTER_ONLY, "on the prediction")
    if ep > 1 and not num_experts:  # validate_args
        raise _refuse(f"--expert-model-parallel-size {ep} needs --num-experts")
    if num_experts and num_experts % ep:  # validate_args
        raise _refuse(
            f"--num-experts {num_experts} is not a multiple of "
            f"--expert-model-parallel-size {ep}"
        )
    if "moe-ffn-hidden-size" in values and not num_experts:
        # TransformerConfig asserts it is unset without experts
        raise _refuse("--moe-ffn-hidden-size needs --num-experts")
    if values.get("overlap-moe-expert-parallel-comm") and not num_experts:
        raise _refuse(
            "--overlap-moe-expert-parallel-comm needs expert parallelism "
            "(--num-experts, --expert-model-parallel-size > 1)"
        )
    moe = options = etp = None
    if num_experts:
        moe, etp, more = _experts(
            values,
            num_experts,
            num_layers=num_layers,
            ffn_hidden_size=ffn_hidden_size,
            tp=tp,
        )
        ignored += more
        options = _options(values, capacity)
        if options.shared_expert_overlap and moe.shared_ffn_hidden_size:
            if options.dispatcher != "alltoall":  # TransformerConfig
                raise _refuse(
                    "--moe-shared-expert-overlap works only with "
                    "--moe-token-dispatcher-type alltoall"
                )
        if options.overlap_dispatch:
            _overlap_checks(
                values,
                options,
                ep=ep,
                pp=pp,
                chunks=chunks,
                recompute=recompute,
                params_dtype=params_dtype,
                mtp_layers=mtp_layers,
            )
        if etp == tp:
            etp = None  # (Megatron's default, as StageAxes says it)
    else:
        ignored += _not_read(values, _EXPERT_ONLY, "without --num-experts")
    mla = None
    if values.get("multi-latent-attention"):
        if values.get("group-query-attention"):  # validate_args
            raise _refuse(
                "--multi-latent-attention and --group-query-attention are exclusive"
            )
        sizes = {flag: int(values.get(flag, _MLA_DEFAULTS[flag])) for flag in _MLA_ONLY}
        try:
            mla = MlaSpec(*(sizes[flag] for flag in _MLA_ONLY))
        except ValueError as error:
            raise _refuse(str(error)) from None
    else:
        ignored += _not_read(values, _MLA_ONLY, "without --multi-latent-attention")
    if mtp_layers and position not in ("rope", "none"):  # validate_args
        raise _refuse(
            f"--mtp-num-layers needs --position-embedding-type rope or none, not "
            f"{position}"
        )
    return MoeRead(
        moe,
        mla,
        mtp_layers,
        bool(values.get("qk-layernorm")),
        ep,
        etp,
        options,
        ignored,
    )
