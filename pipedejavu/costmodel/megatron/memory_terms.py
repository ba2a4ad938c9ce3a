"""A prediction's peak memory per GPU, term by term.

:func:`memory_terms` splits the memory of the GPU at the peak (the stage and
replica :func:`~pipedejavu.costmodel.megatron.predictor.predict_plan` found
largest) into what a user checks before a launch:

* ``parameters``, ``gradients``, ``optimizer``: the model state
  (:func:`~pipedejavu.costmodel.megatron.rules.state_terms`: replicated or
  sharded over the shard group as the training options' ZeRO stage says);
* ``communication_buffers``: the rest of the model state the predictor
  counted: the largest gradient bucket flattened for its all-reduce, or
  ZeRO-3's gathered layers
  (:func:`~pipedejavu.costmodel.megatron.sharding.fsdp_buffer_bytes`);
* ``activations``: the activations stashed at the peak with their overhead
  (temporaries, the allocator's rounding: the predictor's
  ``activation_overhead``);
* ``reserve``: what the GPU type keeps beyond them (CUDA context, libraries,
  the allocator's fragmentation: the predictor's ``reserve_bytes``).

They sum to the prediction's peak exactly (the same rules; the buffers and
the reserve are what the predictor added beyond the others).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.costmodel.megatron.constants import (
    FITTED_CONSTANTS,
    PredictorConstants,
)
from pipedejavu.costmodel.megatron.interleaving import rank_layers
from pipedejavu.costmodel.megatron.rules import (
    STATE_TERMS,
    rank_expert_params,
    rank_params,
    state_terms,
)

__all__ = ["MEMORY_TERMS", "memory_terms"]

#: The terms, in the order reports show them.
MEMORY_TERMS = (
    *STATE_TERMS,
    "communication_buffers",
    "activations",
    "reserve",
)


def memory_terms(
    plan: Plan3D,
    data: Any,
    prediction: Any,
    constants: PredictorConstants = FITTED_CONSTANTS,
    stage: int | None = None,
) -> dict[str, Any]:
    """The peak GPU's memory by term (module docstring), in bytes, with the
    stage it is on: ``{"stage": s, "terms": {...}, "total": bytes}``; with
    ``stage``, that of the stage's GPU of most memory.

    Args:
        plan: the plan predicted.
        data: its cost source (profiles or the analytical model).
        prediction: :func:`~pipedejavu.costmodel.megatron.predictor.
            predict_plan`'s answer for it.
        constants: the predictor's constants it was predicted with.
    """
    memory = prediction.memory_bytes
    if stage is None:
        s, j = (int(k) for k in np.unravel_index(int(np.argmax(memory)), memory.shape))
    else:
        s, j = stage, int(np.argmax(memory[stage]))
    info = data.model_info(plan.model)
    replica = plan.stages[s].replicas[j]
    spans = rank_layers(plan, bool(data.options.v_shape))[s]
    held = rank_params(info, replica.tp, spans)
    experts = rank_expert_params(info, replica.tp, spans)
    edp = plan.layout.edp(s) if experts else 1
    terms = state_terms(info, held, plan.layout.shard_replicas, experts, edp)
    out = {name: float(value) for name, value in terms.items()}
    out["communication_buffers"] = float(prediction.model_state_bytes[s, j]) - sum(
        out.values()
    )
    stash = float(prediction.activation_bytes[s])
    out["activations"] = (1.0 + constants.activation_overhead) * stash
    out["reserve"] = float(constants.reserve(replica.gpu_type))
    return {"stage": s, "terms": out, "total": float(memory[s, j])}
