"""Property-based fuzzing of the MoE, MLA, MTP and low-precision flags of
``--megatron-args`` and of ``--moe-layer-freq``.

Whatever flags and values hypothesis draws (right, wrong, huge, negative, not
numbers, half-formed patterns), reading them gives a run or one
:class:`ProblemError` of one line, never another exception; a layer pattern
built from the grammar Megatron-LM documents reads as Python's ``eval`` (what
Megatron-LM runs) reads it.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.core.errors import ProblemError
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_pattern import moe_layer_freq

FUZZ = settings(max_examples=300, deadline=None, database=None, derandomize=True)

BASE = (
    "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--micro-batch-size 1 --vocab-size 32000 --position-embedding-type rope "
)
VALUE_FLAGS = [
    "--num-experts",
    "--moe-router-topk",
    "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size",
    "--moe-layer-freq",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--num-virtual-stages-per-pipeline-rank",
    "--moe-token-dispatcher-type",
    "--moe-flex-dispatcher-backend",
    "--moe-router-score-function",
    "--moe-router-load-balancing-type",
    "--moe-expert-capacity-factor",
    "--q-lora-rank",
    "--kv-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
    "--mtp-num-layers",
    "--kv-channels",
    "--fp8-format",
    "--fp8-recipe",
    "--fp4-format",
    "--fp4-recipe",
]
SWITCHES = [
    "--moe-grouped-gemm",
    "--moe-router-force-load-balancing",
    "--moe-pad-expert-input-to-capacity",
    "--moe-shared-expert-overlap",
    "--moe-shared-expert-gate",
    "--overlap-moe-expert-parallel-comm",
    "--moe-router-pre-softmax",
    "--moe-enable-deepep",
    "--multi-latent-attention",
    "--qk-layernorm",
    "--group-query-attention",
    "--disable-bias-linear",
    "--use-tp-pp-dp-mapping",
    "--bf16",
    "--fp16",
]
#: Values that often make sense (powers of two, Megatron's words) and often not.
SENSIBLE = st.sampled_from(["1", "2", "4", "8", "16", "64"])
VALUES = st.one_of(
    SENSIBLE,
    SENSIBLE,
    st.integers(-5, 300).map(str),
    st.sampled_from(
        [
            "0",
            "-1",
            str(10**40),
            "1.5",
            "nan",
            "inf",
            "-0.5",
            "alltoall",
            "allgather",
            "flex",
            "deepep",
            "hybridep",
            "sinkhorn",
            "aux_loss",
            "softmax",
            "e4m3",
            "hybrid",
            "e2m1",
            "nvfp4",
            "mxfp8",
            "tensorwise",
            "custom",
            "([0]*3+[1]*5)",
            "[1]*8",
            "([1]*3+[0]*1)*2",
            "[1,0]*4",
            "[1]*99999999",
            "[[1]]*8",
            "",
            "x",
        ]
    ),
    st.text(alphabet="0123456789[](),+* -x", max_size=30),
)
FLAG = st.one_of(
    st.tuples(st.sampled_from(VALUE_FLAGS), VALUES).map(lambda pair: list(pair)),
    st.sampled_from(SWITCHES).map(lambda flag: [flag]),
)


#: A mixture of experts Megatron-LM accepts, for the drawn flags to change.
EXPERTS = "--num-experts 16 --disable-bias-linear --moe-router-topk 2".split()


@FUZZ
@given(st.booleans(), st.lists(FLAG, max_size=6))
def test_moe_flags_give_a_run_or_one_line(experts, flags):
    argv = BASE.split() + (EXPERTS if experts else [])
    argv += [word for flag in flags for word in flag]
    try:
        run = spec_from_megatron_args(argv)
    except ProblemError as error:
        text = str(error)
        assert text and "\n" not in text and len(text) < 1000
        return
    moe = run.spec.moe
    assert (moe is None) == (run.moe_options is None)
    if moe is not None:
        assert moe.num_experts % run.ep == 0 and moe.topk <= moe.num_experts
        assert moe.ffn_hidden_size % (run.etp or run.tp) == 0
    else:
        assert run.ep == 1


def _expression(depth: int) -> st.SearchStrategy[str]:
    """Expressions of the documented grammar that Python evaluates to a list."""
    bit = st.sampled_from(["0", "1"])
    count = st.integers(0, 4).map(str)
    flat = st.lists(bit, max_size=4).map(lambda items: "[" + ",".join(items) + "]")
    if depth == 0:
        return flat
    inner = _expression(depth - 1)
    return st.one_of(
        flat,
        st.tuples(inner, count).map(lambda p: f"{p[0]}*{p[1]}"),
        st.tuples(count, inner).map(lambda p: f"{p[0]}*{p[1]}"),
        st.tuples(inner, inner).map(lambda p: f"{p[0]}+{p[1]}"),
        inner.map(lambda text: f"({text})"),
    )


@FUZZ
@given(_expression(3))
def test_layer_patterns_read_as_megatrons_eval(text):
    expected = eval(text)  # noqa: S307 (Megatron-LM's own reading: the reference)
    if not expected:
        return  # (an empty pattern names no layer: refused below as any length)
    got = moe_layer_freq(text, len(expected))
    assert got == tuple(entry == 1 for entry in expected)


@FUZZ
@given(st.text(alphabet="0123456789[](),+*", max_size=40), st.integers(1, 64))
def test_any_pattern_text_reads_or_is_refused_in_one_line(text, num_layers):
    try:
        layers = moe_layer_freq(text, num_layers)
    except ProblemError as error:
        assert "\n" not in str(error)
        return
    assert len(layers) == num_layers
    if "[" in text:  # then it is Python's list, as Megatron-LM reads it
        assert layers == tuple(entry == 1 for entry in eval(text))  # noqa: S307
