"""torchtitan's per-operation selective recomputation ("op"): what it reruns
and keeps of a dense block, against the products counted by hand."""

from __future__ import annotations

import pytest

from pipedejavu.core.training_options import TORCHTITAN_OP, TrainingOptions
from pipedejavu.costmodel.analytical.layers import activation_bytes
from pipedejavu.costmodel.analytical.mla_ops import any_block_forward_ops
from pipedejavu.costmodel.analytical.ops import Gemm, MemoryOp, PassOptions
from pipedejavu.costmodel.analytical.recompute import rerun_ops
from pipedejavu.io.model_config import load_model_spec

SPEC = load_model_spec("llama-3-8b")  # h 4096, 32 heads, 8 groups, ffn 14336


def test_options_take_torchtitan_op_alone():
    options = TrainingOptions(recompute="selective", recompute_modules=[TORCHTITAN_OP])
    assert options.recompute_modules == (TORCHTITAN_OP,)
    with pytest.raises(ValueError, match="alone"):
        TrainingOptions(
            recompute="selective", recompute_modules=(TORCHTITAN_OP, "core_attn")
        )


@pytest.mark.parametrize("tp", [1, 2])
def test_reruns_every_other_product(tp):
    opts = PassOptions(1, tp, "bf16", sequence_parallel=tp > 1)
    ops = any_block_forward_ops(SPEC, opts)
    rerun = rerun_ops(ops, (TORCHTITAN_OP,), SPEC, opts, expert=False)
    tokens = SPEC.seq_length
    # wk (4096 x 1024), wo (4096 x 4096), w3 (4096 x 14336), each over tp
    expected = 2 * tokens * 4096 * (1024 + 4096 + 14336) / tp
    assert sum(op.flops for op in rerun if isinstance(op, Gemm)) == pytest.approx(
        expected
    )
    assert not [op for op in rerun if isinstance(op, Gemm) and op.attention]
    names = {op.name for op in rerun if isinstance(op, MemoryOp)}
    assert {"input_norm", "post_attention_norm", "swiglu"} <= names


def test_keeps_the_saved_products():
    kept = activation_bytes(SPEC, 1, 1, "bf16", recompute=(TORCHTITAN_OP,))
    tokens = SPEC.seq_length
    # input 4096, wq 4096, wv 1024, attention output 4096, w1 14336, w2 4096
    # (2 B each) and the fp32 log-sum-exp of 32 heads
    by_hand = tokens * (4096 * 4 + 1024 + 14336) * 2 + tokens * 32 * 4
    assert kept[1] == pytest.approx(by_hand)
    none = activation_bytes(SPEC, 1, 1, "bf16", recompute="none")
    assert kept[1] < none[1]


def test_expert_blocks_refused():
    opts = PassOptions(1, 1, "bf16")
    ops = any_block_forward_ops(SPEC, opts)
    with pytest.raises(ValueError, match="dense blocks"):
        rerun_ops(ops, (TORCHTITAN_OP,), SPEC, opts, expert=True)
