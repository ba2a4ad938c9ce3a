"""Megatron-LM's activation recomputation flags, read as Megatron-LM reads them.

:func:`read_recompute` reads the granularity, method and layer count
(``--recompute-granularity``, ``--recompute-method``,
``--recompute-num-layers``; ``--recompute-activations`` means selective; the
SC'21 scripts' ``--checkpoint-activations`` and
``--activations-checkpoint-method`` mean full, ``--activations-checkpoint-
num-layers`` default 1) and the modules selective recomputation reruns
(``--recompute-modules``, Megatron-Core's default ``core_attn``; the
deprecated ``--moe-layer-recompute`` adds ``moe`` and sets the granularity
to selective). Refused in one line as Megatron-LM refuses them
(``validate_args`` and ``TransformerConfig.__post_init__``, core_v0.16.1):
contradictory flags, full recomputation without its method or count, a
method or count with selective recomputation, and, under selective
recomputation, a module Megatron-Core does not know, ``moe_act`` without
``--moe-grouped-gemm``, ``mla_up_proj`` without ``--multi-latent-attention``,
``shared_experts`` with ``--moe-shared-expert-overlap``, ``moe_act`` or
``layernorm`` with FP8's delayed scaling (its default recipe). Modules given
with another granularity are read by nothing (Megatron-Core reads them only
under selective recomputation): they are listed as ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.training_options import (
    DEFAULT_RECOMPUTE_MODULES,
    RECOMPUTE_MODULES,
)

__all__ = [
    "RECOMPUTE_BOOL_FLAGS",
    "RECOMPUTE_LIST_FLAGS",
    "read_recompute",
    "read_recompute_modules",
]

#: Flags read as one or more words.
RECOMPUTE_LIST_FLAGS = ("recompute-modules",)
#: Switches.
RECOMPUTE_BOOL_FLAGS = ("moe-layer-recompute",)


def _refuse(message: str) -> ProblemError:
    return ProblemError(f"Megatron arguments: {message}")


def read_recompute(values: Mapping[str, Any]) -> tuple[Any, Any, int | None]:
    """``(granularity, method, num_layers)`` of the run (module doc), each
    ``None`` where not set.

    Raises:
        ProblemError: contradictory flags, or ones Megatron-LM refuses.
    """
    granularity = values.get("recompute-granularity")
    method = values.get("recompute-method")
    num_layers = values.get("recompute-num-layers")
    if values.get("recompute-activations"):
        if granularity == "full":
            raise _refuse(
                "--recompute-activations (selective) contradicts "
                "--recompute-granularity full"
            )
        granularity = "selective"
    old_method = values.get("activations-checkpoint-method")
    if old_method is None and values.get("checkpoint-activations"):
        old_method = "uniform"
    if old_method is not None:
        if granularity == "selective" or (method not in (None, old_method)):
            raise _refuse(
                "the old --checkpoint-activations / --activations-checkpoint-method "
                "contradict the --recompute-* flags"
            )
        granularity, method = "full", old_method
        num_layers = values.get("activations-checkpoint-num-layers", num_layers or 1)
    if granularity == "selective" and (method is not None or num_layers is not None):
        raise _refuse(
            "--recompute-method and --recompute-num-layers apply only to "
            "--recompute-granularity full"
        )
    if granularity == "full" and (method is None or num_layers is None):
        # Megatron Core's TransformerConfig refuses either missing (0.16.1)
        missing = "--recompute-method uniform|block" if method is None else ""
        if num_layers is None:
            missing += (" and " if missing else "") + "--recompute-num-layers N"
        raise _refuse(
            f"--recompute-granularity full needs {missing}, as Megatron-LM does "
            "(--recompute-method uniform --recompute-num-layers 1 recomputes every "
            "layer)"
        )
    if granularity is None:
        method = num_layers = None
    total = values.get("num-layers")
    if num_layers is not None and total is not None:
        # Megatron-LM accepts more; a stage recomputes as with all its layers
        # (block: min(N, its layers); uniform: one unit of its layers)
        num_layers = min(num_layers, total)
    return granularity, method, num_layers


def read_recompute_modules(
    values: Mapping[str, Any], granularity: str | None, *, fp8_recipe: str | None
) -> tuple[str | None, tuple[str, ...], list[str]]:
    """``(granularity, modules, ignored)``: the granularity once
    ``--moe-layer-recompute`` is read, the modules selective recomputation
    reruns (Megatron-Core's default where none is given, and where the
    granularity is not selective, whose modules nothing reads), and the
    ignored flags' words (module doc).

    Args:
        values: the flags read.
        granularity: :func:`read_recompute`'s.
        fp8_recipe: the FP8 recipe of an FP8 run, else ``None``.

    Raises:
        ProblemError: a combination Megatron-Core refuses (module doc).
    """
    given = tuple(values.get("recompute-modules") or ())
    modules = given or DEFAULT_RECOMPUTE_MODULES
    if values.get("moe-layer-recompute"):  # (deprecated: selective, with moe)
        if granularity == "full":
            raise _refuse(
                "--moe-layer-recompute contradicts --recompute-granularity full "
                "(TransformerConfig)"
            )
        granularity, modules = "selective", (*modules, "moe")
    if granularity != "selective":
        ignored = []
        if given:
            ignored.append(
                f"--recompute-modules {' '.join(given)} (read only with "
                "--recompute-granularity selective)"[:200]
            )
        return granularity, DEFAULT_RECOMPUTE_MODULES, ignored
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise _refuse(
            f"--recompute-modules {unknown[0][:40]!r} is not one of Megatron-Core's "
            f"modules ({', '.join(RECOMPUTE_MODULES)})"
        )
    needs = {
        "moe_act": ("moe-grouped-gemm", "--moe-grouped-gemm"),
        "mla_up_proj": ("multi-latent-attention", "--multi-latent-attention"),
    }
    for module, (flag, words) in needs.items():
        if module in modules and not values.get(flag):
            raise _refuse(
                f"--recompute-modules {module} needs {words} (TransformerConfig)"
            )
    overlap = values.get("moe-shared-expert-overlap") and (
        "moe-shared-expert-intermediate-size" in values
    )
    if "shared_experts" in modules and overlap:
        raise _refuse(
            "--recompute-modules shared_experts cannot run with "
            "--moe-shared-expert-overlap (TransformerConfig)"
        )
    cast = [m for m in ("moe_act", "layernorm") if m in modules]
    if cast and fp8_recipe == "delayed":
        raise _refuse(
            f"--recompute-modules {' and '.join(cast)} with FP8 needs an "
            "--fp8-recipe other than delayed, Megatron-LM's default "
            "(TransformerConfig: delayed scaling does not support them)"
        )
    ordered = tuple(m for m in RECOMPUTE_MODULES if m in modules)
    return granularity, ordered, []
