"""Pipeline layouts with multi-token prediction and unequal model chunks
(io/megatron_layout.py, costmodel/megatron/interleaving.py): the published
DeepSeek-V3 layouts read as Megatron Core reads them, its refusals, the
interleaved pipeline priced chunk by chunk, and DeepSeek-V3 launched with
``Et|(tt|)*30mL`` at PP 8 x VP 4 predicted."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import DEEPSEEK_V3_MODEL_ARGS, DEEPSEEK_V3_RUN_ARGS

from pipedejavu.cli.main import main
from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.interleaving import (
    chunk_layers,
    interleaved_pipelines,
)
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.rules import span_backward
from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_layout import PipelineSplit, pipeline_split, split_pipeline
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.megatron_launch import predict_megatron_run
from pipedejavu.simulation.interleaved import simulate_interleaved

# ---- reading: DeepSeek-V3's published layouts, Megatron Core's rules -------

#: DeepSeek-V3's 61 layers (the model zoo's and Megatron-Bridge's layouts).
PUBLISHED = [
    # model zoo, H100 (PP 8, VP 4 from the layout's 32 stages): the last
    # virtual stage holds the MTP depth and the loss, no transformer layer
    (
        "Et|(tt|)*30mL",
        8,
        PipelineSplit(4, (7,) + (8,) * 6 + (6,), (1,) + (2,) * 30 + (0,), 1),
    ),
    # model zoo, long context: one virtual stage of one layer
    (
        "Et*2|(tt|)*22t|(tt|)*7mL",
        8,
        PipelineSplit(4, (8,) * 7 + (5,), (2,) * 23 + (1,) + (2,) * 7 + (0,), 1),
    ),
    # Megatron-Bridge's (16, 1) and (8, 2): the same 16 stages
    ("Et*4|(t*4|)*14tmL", 16, PipelineSplit(1, (4,) * 15 + (1,), (), 1)),
    ("Et*4|(t*4|)*14tmL", 8, PipelineSplit(2, (8,) * 7 + (5,), (4,) * 15 + (1,), 1)),
    # Megatron-Bridge's (8, 1)
    ("Et*8|(t*8|)*6t*5mL", 8, PipelineSplit(1, (8,) * 7 + (5,), (), 1)),
]


@pytest.mark.parametrize(("layout", "pp", "expected"), PUBLISHED)
def test_published_layouts_read_as_megatron(layout, pp, expected):
    split = pipeline_split(61, pp, layout=layout)
    assert split == expected
    # each rank holds virtual stages r, r + PP, ... (get_num_layers_to_build)
    if split.virtual_layers:
        assert split.stage_layers == tuple(
            sum(split.virtual_layers[r::pp]) for r in range(pp)
        )
    split.check_mtp(1)
    assert split_pipeline(61, pp, layout=layout, mtp_layers=1) == expected[:2]


@pytest.mark.parametrize(
    ("layers", "pp", "layout", "mtp", "message"),
    [
        # validate_layer_layout: as many m as --mtp-num-layers
        (14, 4, "Et|(tt|)*6tmL", 2, "holds 1 MTP layer.*says 2"),
        (14, 4, "Et|(tt|)*6tmL", 0, "holds 1 MTP layer.*says 0"),
        (14, 4, "Et|(tt|)*6tL", 1, "holds 0 MTP layer.*says 1"),
        # decoder layers before MTP layers
        (3, 2, "Ett|mtL", 1, "decoder layers must be placed before MTP"),
        # MTP in a rank's last virtual stage, all of it in one
        (4, 2, "Ett|ttm||L", 1, "virtual stage 0 of pipeline rank 1, not its last"),
        (4, 2, "Ett|tt|m|mL", 2, "all in one"),
        # Megatron's standalone MTP (its docstring's example): not priced
        (61, 16, "Et*3|(tt|)*29,m|L", 1, "rank 14, apart from the loss"),
        (4, 2, "Ettttm|L", 1, "rank 0, apart from the loss"),
    ],
)
def test_mtp_placement_refused_as_megatron(layers, pp, layout, mtp, message):
    with pytest.raises(ProblemError, match=message):
        split_pipeline(layers, pp, layout=layout, mtp_layers=mtp)


#: A small model of DeepSeek-V3's kind (MLA, two dense blocks then experts).
SMALL = (
    "--num-layers 14 --hidden-size 512 --ffn-hidden-size 1024 "
    "--num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
    "--vocab-size 4096 --micro-batch-size 1 --global-batch-size 64 --bf16 "
    "--disable-bias-linear --position-embedding-type rope --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights "
    "--num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 256 "
    "--moe-shared-expert-intermediate-size 256 --moe-layer-freq ([0]*2+[1]*12) "
    "--multi-latent-attention --q-lora-rank 128 --kv-lora-rank 64 "
    "--qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --qk-layernorm "
    "--use-flash-attn --use-distributed-optimizer --moe-grouped-gemm "
    "--moe-token-dispatcher-type alltoall --pipeline-model-parallel-size 4 "
    "--expert-model-parallel-size 4"
)


def test_launch_refusals_are_one_line(capsys):
    """The launch reader checks a layout's m against --mtp-num-layers, and
    refuses a layout beside the virtual-stage flags as validate_args does."""
    for extra, message in [
        ("--pipeline-model-parallel-layout Et|(tt|)*6tmL", "says 0"),
        (
            "--mtp-num-layers 2 --pipeline-model-parallel-layout Et|(tt|)*6tmL",
            "says 2",
        ),
        (
            "--mtp-num-layers 1 --num-virtual-stages-per-pipeline-rank 2 "
            "--pipeline-model-parallel-layout Et|(tt|)*6tmL",
            "validate_args refuses it",
        ),
    ]:
        flags = ["--megatron-args", f"{SMALL} {extra}", "--gpus", "H100-SXM:32"]
        assert main(["predict", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


# ---- the interleaved pipeline, chunk by chunk ------------------------------


def _plan(edges, gbs=8):
    """One pipeline on one node (its links alike, the wrap-around too)."""
    stages = [
        Stage3D(a, b, (Replica("GH-96", 1, node=0),))
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    return Plan3D(tuple(stages), mbs=1, gbs=gbs, model="OPT-350")


def test_chunks_of_a_layout_by_hand():
    # "Et|ttt|t|tL" at PP 2: profile layers 2, 3, 1, 2 a virtual stage; rank 0
    # holds virtual stages 0 and 2 (the embedding, 2 blocks), rank 1 stages 1
    # and 3 (4 blocks and the head)
    plan = _plan((0, 3, 8), gbs=2)
    assert chunk_layers(plan, 2, sizes=(1, 3, 1, 1)) == [
        [(0, 2), (5, 6)],
        [(2, 5), (6, 8)],
    ]
    # virtual stages of no block ("Et|ttttt||L" at PP 2): one empty, one the
    # head alone (as "mL", its MTP depths in the head's profile layer)
    plan = _plan((0, 2, 8), gbs=2)
    assert chunk_layers(plan, 2, sizes=(1, 5, 0, 0)) == [
        [(0, 2), (7, 7)],
        [(2, 7), (7, 8)],
    ]
    with pytest.raises(ProblemError, match="not 2 x 2 counts"):
        chunk_layers(plan, 2, sizes=(1, 5, 1, 0))
    with pytest.raises(ProblemError, match="not the chunks"):
        chunk_layers(plan, 2, sizes=(1, 3, 1, 1))


@pytest.mark.parametrize(
    ("edges", "chunks"),
    [
        ([0, 13, 26], 2),  # 24 blocks in 4 chunks of 6
        ([0, 9, 17, 26], 2),  # in 6 of 4
        ([0, 7, 13, 19, 26], 3),  # in 12 of 2
        ([0, 8, 16, 24, 32], 2),  # 30: the embedding and loss counted, 8 of 4
        ([0, 4, 9], 2),  # 7: the embedding counted, 4 of 2
    ],
)
def test_even_sizes_give_the_even_split(edges, chunks):
    """The sizes of Megatron's even split, given, give the chunks the split
    is read with: one definition of a chunk."""
    plan = _plan(edges)
    rows = chunk_layers(plan, chunks)
    sizes = [0] * (plan.num_stages * chunks)
    for r, row in enumerate(rows):
        for c, (start, stop) in enumerate(row):
            k = c * plan.num_stages + r
            sizes[k] = stop - start - (k == 0) - (k == len(sizes) - 1)
    assert chunk_layers(plan, chunks, sizes=sizes) == rows


def test_unequal_chunks_priced_chunk_by_chunk():
    """OPT-350's 24 blocks as 1, 11 | 0, 12 over two ranks of two chunks
    (rank 0: the embedding and one block, then an empty chunk): each chunk's
    forward and backward are its own layers' times and one instruction's
    overhead, and the schedule is the interleaved simulator's on them."""
    data = load_sailor_data()
    info = data.model_info("OPT-350")
    smooth = FITTED_CONSTANTS.smooth_profiles  # as the predictor reads them
    entry = data.layer_times("OPT-350", "GH-96", 1, 1, smooth=smooth)
    plan = _plan([0, 2, 26], gbs=8)
    sizes = (1, 11, 0, 12)
    overhead = FITTED_CONSTANTS.op_overhead_s
    spans = [[(0, 2), (13, 13)], [(2, 13), (13, 26)]]  # by hand
    forward = np.array(
        [[entry.forward[a:b].sum() + overhead for a, b in row] for row in spans]
    )
    backward = np.array(
        [[span_backward(info, entry, a, b) + overhead for a, b in row] for row in spans]
    )
    assert forward[0, 1] == overhead and backward[0, 1] == overhead
    free = interleaved_pipelines(
        plan,
        info,
        2,
        {("GH-96", 1): entry},
        overhead,
        lambda *_: 0.0,
        [[0], [1]],
        sizes=sizes,
    )
    hand = simulate_interleaved(forward, backward, plan.num_microbatches)
    np.testing.assert_allclose(
        free.ends[:, 0], hand.backward_end.max(axis=(1, 2)), rtol=1e-12
    )
    # the predictor, its links priced: each rank's work, and bounds by hand
    predicted = predict_plan(plan, data, virtual_stages=2, chunk_sizes=sizes)
    np.testing.assert_allclose(predicted.stage_forward_s[:, 0], forward.sum(axis=1))
    np.testing.assert_allclose(predicted.stage_backward_s[:, 0], backward.sum(axis=1))
    work = plan.num_microbatches * (forward + backward).sum(axis=1)
    one = (forward + backward).sum()  # one micro-batch through every chunk
    assert predicted.pipeline_s >= max(work.max(), one)
    # at most every pass and every message (6 hops a micro-batch) in a row
    hops = 6 * plan.num_microbatches * predicted.activation_transfer_s.max()
    assert predicted.pipeline_s <= work.sum() + hops
    # the same blocks in equal chunks (6 a virtual stage) run another pipeline
    even = predict_plan(_plan([0, 13, 26], gbs=8), data, virtual_stages=2)
    assert even.pipeline_s < predicted.pipeline_s


# ---- predictions of launches -----------------------------------------------


def _same(a, b) -> None:
    """Two predictions, number for number."""
    assert a.iteration_time_s == b.iteration_time_s
    for name in (
        "stage_forward_s",
        "stage_backward_s",
        "memory_bytes",
        "activation_bytes",
        "peak_in_flight",
        "dp_allreduce_s",
    ):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


DENSE = (
    "--hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --vocab-size 51200 --micro-batch-size 1 "
    "--global-batch-size 64 --bf16 --pipeline-model-parallel-size 4"
)


@pytest.mark.parametrize(
    ("model", "layout", "flags"),
    [
        # equal chunks: the layout and --num-virtual-stages-per-pipeline-rank
        (
            f"{DENSE} --num-layers 16",
            "Ett|(tt|)*6ttL",
            "--num-virtual-stages-per-pipeline-rank 2",
        ),
        # the embedding and loss counted in the split
        (
            f"{DENSE} --num-layers 14",
            "Et|(tt|)*6tL",
            "--num-virtual-stages-per-pipeline-rank 2 "
            "--account-for-embedding-in-pipeline-split "
            "--account-for-loss-in-pipeline-split",
        ),
        # with MTP: Megatron puts it on the last virtual stage beside the loss
        # (the loss counted, the MTP depth not), as the layout spells it
        (
            f"{SMALL} --mtp-num-layers 1",
            "Et|(tt|)*6tmL",
            "--num-virtual-stages-per-pipeline-rank 2 "
            "--account-for-embedding-in-pipeline-split "
            "--account-for-loss-in-pipeline-split",
        ),
    ],
)
def test_a_layout_of_even_chunks_predicts_as_the_flags(model, layout, flags):
    sheet = load_gpu_sheet()
    laid = spec_from_megatron_args(f"{model} --pipeline-model-parallel-layout {layout}")
    flagged = spec_from_megatron_args(f"{model} {flags}")
    assert laid.virtual_chunks == flagged.virtual_chunks == 2
    assert laid.stage_layers == flagged.stage_layers
    a = predict_megatron_run(laid, "H100-SXM", 32, sheet)
    b = predict_megatron_run(flagged, "H100-SXM", 32, sheet)
    _same(a.prediction, b.prediction)


def test_uneven_first_last_stages_interleaved():
    """--decoder-first/last-pipeline-num-layers with virtual stages: each
    rank's layers split evenly over its chunks, as the layout that spells
    them out."""
    model = f"{DENSE} --num-layers 24"
    flagged = spec_from_megatron_args(
        f"{model} --decoder-first-pipeline-num-layers 4 "
        "--decoder-last-pipeline-num-layers 4 --num-virtual-stages-per-pipeline-rank 2"
    )
    laid = spec_from_megatron_args(
        f"{model} --pipeline-model-parallel-layout Ett|t*4|t*4|tt|tt|t*4|t*4|ttL"
    )
    assert flagged.virtual_stage_layers == laid.virtual_stage_layers
    sheet = load_gpu_sheet()
    _same(
        predict_megatron_run(flagged, "H100-SXM", 32, sheet).prediction,
        predict_megatron_run(laid, "H100-SXM", 32, sheet).prediction,
    )


#: DeepSeek-V3 launched as the model zoo's H100 recipe lays it out (bf16,
#: the alltoall dispatcher, full recomputation), PP 8 x VP 4.
DEEPSEEK = (
    DEEPSEEK_V3_MODEL_ARGS
    + DEEPSEEK_V3_RUN_ARGS
    + "--tensor-model-parallel-size 2 --sequence-parallel "
    "--pipeline-model-parallel-size 8 --expert-model-parallel-size 64 "
    "--expert-tensor-parallel-size 1"
)
LAUNCH = f"{DEEPSEEK} --mtp-num-layers 1 --pipeline-model-parallel-layout Et|(tt|)*30mL"


def test_deepseek_v3_published_layout_is_predicted(capsys):
    """``Et|(tt|)*30mL`` at PP 8 x VP 4 on 1,024 H100: a finite time, the
    model FLOPs Megatron counts, every stage's memory; the MTP depth on the
    last stage only (against the same layout without it: ``...|L``)."""
    sheet = load_gpu_sheet()
    with_mtp = spec_from_megatron_args(LAUNCH)
    without = spec_from_megatron_args(
        f"{DEEPSEEK} --pipeline-model-parallel-layout Et|(tt|)*30L"
    )
    assert with_mtp.virtual_chunks == 4 and with_mtp.spec.mtp_layers == 1
    mine = predict_megatron_run(with_mtp, "H100-SXM", 1024, sheet)
    base = predict_megatron_run(without, "H100-SXM", 1024, sheet)
    seconds = mine.prediction.iteration_time_s
    assert math.isfinite(seconds) and seconds > base.prediction.iteration_time_s
    assert mine.model_flops_per_iteration == pytest.approx(
        load_model_spec("DeepSeek-V3").model_flops_per_iteration(8192), rel=1e-12
    )
    memory = mine.prediction.memory_bytes
    assert memory.shape == (8, 64) and np.all(np.isfinite(memory) & (memory > 0))
    for name in ("stage_forward_s", "stage_backward_s", "memory_bytes"):
        ours, theirs = getattr(mine.prediction, name), getattr(base.prediction, name)
        assert np.array_equal(ours[:-1], theirs[:-1]), name
        assert np.all(ours[-1] > theirs[-1]), name
    flags = ["--megatron-args", LAUNCH, "--gpus", "H100-SXM:1024"]
    assert main(["predict", *flags]) == 0
    out = capsys.readouterr().out
    assert "Megatron's interleaved 1F1B, 4 chunks per stage" in out
    assert f"iteration time: {seconds:.4f} s" in out


def test_random_layouts_are_read_or_refused_in_one_line():
    """Seeded layouts, well and badly formed (m anywhere, empty virtual
    stages, stray characters, wrong counts): each launch is predicted or
    refused with one ProblemError line, never another exception."""
    rng = np.random.default_rng(7)
    model = (
        "--hidden-size 256 --num-attention-heads 4 --seq-length 256 "
        "--max-position-embeddings 256 --vocab-size 1024 --micro-batch-size 1 "
        "--global-batch-size 32 --bf16 --position-embedding-type rope"
    )
    sheet, outcomes = load_gpu_sheet(), {"predicted": 0, "refused": 0}
    for _ in range(300):
        pp, chunks = int(rng.choice([1, 2, 3, 4])), int(rng.choice([1, 1, 2, 3]))
        stages = ["t" * int(rng.choice([0, 0, 1, 1, 2])) for _ in range(pp * chunks)]
        stages[0] = "E" + stages[0]
        stages[-1] += str(rng.choice(["L", "L", "mL", "mmL", "Lm"]))
        if rng.random() < 0.3:
            k = int(rng.integers(len(stages)))
            stages[k] = str(rng.choice(["m", "", "tm"])) + stages[k]
        layout = "|".join(stages)
        if rng.random() < 0.15:
            i = int(rng.integers(len(layout) + 1))
            layout = layout[:i] + str(rng.choice(list("()*,|9x"))) + layout[i:]
        layers = max(layout.count("t") + int(rng.choice([0, 0, 0, 1])), 1)
        mtp = int(rng.choice([0, 0, 1, 2]))
        argv = (
            f"{model} --num-layers {layers} --pipeline-model-parallel-size {pp} "
            f"--pipeline-model-parallel-layout {layout}"
            + (f" --mtp-num-layers {mtp}" if mtp else "")
        )
        try:
            run = spec_from_megatron_args(argv)
            predicted = predict_megatron_run(run, "H100-SXM", 2 * pp, sheet)
        except ProblemError as refused:
            assert "\n" not in str(refused)
            outcomes["refused"] += 1
        else:
            assert math.isfinite(predicted.prediction.iteration_time_s)
            outcomes["predicted"] += 1
    assert min(outcomes.values()) > 20, outcomes
