"""The analytical constants torchtitan runs are priced with.

torchtitan trains with PyTorch's own kernels, not Transformer Engine's:
attention through ``scaled_dot_product_attention`` (its FlashAttention-2 path
on Hopper, where the measured constants are cuDNN's fused attention, which
Transformer Engine runs), the linear layers through PyTorch's matmuls (or
torchao's float8 ones), FSDP2's collectives beside them. Two constants of
:data:`~pipedejavu.costmodel.analytical.roofline.HALF_PRECISION_ANALYTICAL`
are refitted for it, every other one kept:

* ``attention_efficiency``: the attention kernels' speed relative to cuDNN's;
* ``tensor_efficiency``: the GEMMs' best fraction of the sheet's peak;

and one fact of torchtitan's loss code is set: the logits' working copies at
the loss's peak (:data:`TORCHTITAN_LOSS_LOGIT_BYTES`).

They are fitted on the seven torchtitan runs of Llama 3.1 8B on 8 H100 (96 GB
HBM2e, 500 W) published with torchtitan (the bundled
``data/published/torchtitan_llama3_8b_h100.json``) by
:func:`pipedejavu.planning.torchtitan_published.fit_torchtitan_constants`,
through the predictor itself; their leave-one-out errors are in
``docs/torchtitan.md`` and ``benchmarks/results/torchtitan_published.json``
(``tests/test_torchtitan_published.py`` refits and compares). One GPU type
and one software stack (PyTorch of December 2024) only: the 500 W power limit
of those GPUs and torchtitan's kernels are one factor here, not two.
"""

from __future__ import annotations

import dataclasses

from pipedejavu.costmodel.analytical.roofline import HALF_PRECISION_ANALYTICAL

__all__ = ["TORCHTITAN_ANALYTICAL", "TORCHTITAN_FITTED", "TORCHTITAN_LOSS_LOGIT_BYTES"]

#: The two constants as fitted on all seven runs (module docstring).
TORCHTITAN_FITTED = {"attention_efficiency": 0.3151, "tensor_efficiency": 0.6139}
#: Bytes per logit torchtitan's loss holds at its peak beyond the fp32
#: log-softmax it keeps: the model's bf16 logits (``pred``, alive until the
#: loss returns) and their fp32 copy (``pred.float()``, the cross-entropy's
#: input), from its ``train.py`` and loss code; not fitted.
TORCHTITAN_LOSS_LOGIT_BYTES = 6.0
#: :data:`HALF_PRECISION_ANALYTICAL` with :data:`TORCHTITAN_FITTED` and
#: :data:`TORCHTITAN_LOSS_LOGIT_BYTES`.
TORCHTITAN_ANALYTICAL = dataclasses.replace(
    HALF_PRECISION_ANALYTICAL,
    **TORCHTITAN_FITTED,
    loss_logit_bytes=TORCHTITAN_LOSS_LOGIT_BYTES,
)
