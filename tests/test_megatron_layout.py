"""The pipeline split of a Megatron-LM launch (io/megatron_layout.py):
Megatron Core's rules on hand-worked cases, refusals, and the round trip
through our own Megatron export."""

from __future__ import annotations

import json

import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.plan3d import Plan3D, Replica, Stage3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.io.export_megatron import to_megatron
from pipedejavu.io.export_rules import transformer_layers
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_layout import (
    MAX_LAYOUT_CHARS,
    layout_stages,
    split_pipeline,
)
from pipedejavu.planning.megatron_launch import plan_from_megatron_run

MODEL = (
    "--hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --vocab-size 51200 --micro-batch-size 1 --bf16"
)


@pytest.mark.parametrize(
    ("layers", "pp", "flags", "expected"),
    [
        (24, 4, {}, (1, ())),
        (24, 4, {"layers_per_chunk": 3}, (2, ())),
        (24, 4, {"chunks_per_rank": 3}, (3, ())),
        # first/last: what they leave divides over the other stages
        (126, 16, {"first": 7, "last": 7}, (1, (7,) + (8,) * 14 + (7,))),
        (30, 4, {"first": 6}, (1, (6, 8, 8, 8))),
        (30, 4, {"last": 3}, (1, (9, 9, 9, 3))),
        (10, 2, {"first": 4}, (1, (4, 6))),
        (10, 1, {"first": 10}, (1, ())),
        # the embedding / the loss counted as a layer of the split
        (126, 16, {"embedding": True, "loss": True}, (1, (7,) + (8,) * 14 + (7,))),
        (31, 4, {"embedding": True}, (1, (7, 8, 8, 8))),
        (31, 4, {"loss": True}, (1, (8, 8, 8, 7))),
        (6, 2, {"embedding": True, "loss": True}, (1, ())),
        (2, 4, {"embedding": True, "loss": True}, (1, (0, 1, 1, 0))),
        # a layout: per stage, in the virtual stages' order
        (7, 3, {"layout": "Et|t*3,|(t)*3L"}, (1, (1, 3, 3))),
        (8, 2, {"layout": "Et*2|(tt|)*2,ttL"}, (2, ())),
        (4, 2, {"layout": "Ett|ttL"}, (1, ())),
        # unequal model chunks: each rank holds its virtual stages' layers
        (6, 2, {"layout": "Et|t|ttt|tL"}, (2, (4, 2))),
        # uneven first/last stages, each rank's layers over its chunks
        (24, 4, {"first": 6, "chunks_per_rank": 2}, (2, ())),
        (24, 4, {"first": 4, "last": 4, "chunks_per_rank": 2}, (2, (4, 8, 8, 4))),
    ],
)
def test_split_follows_megatron(layers, pp, flags, expected):
    assert split_pipeline(layers, pp, **flags) == expected


def test_layout_unrolls_like_megatron():
    assert layout_stages("Et*2|(tt|)*2,tL") == ["Ett", "tt", "tt", "tL"]
    assert layout_stages("E|(t|)*3,L") == ["E", "t", "t", "t", "L"]
    longest = f"Et*{MAX_LAYOUT_CHARS - 2}L"  # unrolls to the limit exactly
    assert len(layout_stages(longest)[0]) == MAX_LAYOUT_CHARS
    with pytest.raises(ProblemError, match="unrolls to more than"):
        layout_stages(f"Et*{MAX_LAYOUT_CHARS - 1}L")


@pytest.mark.parametrize(
    ("layers", "pp", "flags", "message"),
    [
        (24, 4, {"first": 6, "embedding": True}, "cannot be combined"),
        (24, 4, {"layout": "Et*12|t*12L", "first": 6}, "cannot be combined"),
        (24, 4, {"first": 5}, "divide evenly"),
        (24, 2, {"first": 10, "last": 10}, "divide evenly"),
        (24, 1, {"first": 10, "last": 14}, "divide evenly"),
        (24, 4, {"first": 5, "last": 5, "chunks_per_rank": 2}, "first pipeline"),
        (30, 4, {"first": 4, "last": 2, "chunks_per_rank": 4}, "last pipeline"),
        (28, 4, {"first": 4, "last": 4, "chunks_per_rank": 4}, "middle pipeline"),
        (24, 1, {"first": 24, "chunks_per_rank": 2}, "> 1"),
        (24, 4, {"first": 6, "layers_per_chunk": 2}, "num-virtual-stages"),
        (24, 4, {"embedding": True}, "not divisible"),
        (24, 4, {"layers_per_chunk": 4, "chunks_per_rank": 2}, "give one of"),
        (24, 4, {"layers_per_chunk": 4}, "not divisible"),
        (24, 1, {"layers_per_chunk": 4}, "> 1"),
        (4, 2, {"layout": "Ett|ttL|tt"}, "multiple"),
        (4, 1, {"layout": "Ett|ttL"}, "> 1"),
        (4, 2, {"layout": "Ett|ttmL"}, "holds 1 MTP layer.*says 0"),
        (4, 2, {"layout": "tt|EttL"}, "start with the embedding"),
        (4, 2, {"layout": "EttL|tt"}, "end with the loss"),
        (4, 2, {"layout": "Ett|tL"}, "--num-layers says 4"),
        (4, 2, {"layout": "Ett|xL"}, "letters are"),
        (4, 2, {"layout": "Et*99999999|L"}, "unrolls to more than"),
        (4, 2, {"layout": "(t*9999|)*9999L"}, "unrolls to more than"),
    ],
)
def test_split_refusals(layers, pp, flags, message):
    with pytest.raises(ProblemError, match=message):
        split_pipeline(layers, pp, **flags)


def _plan(counts: list[int], dp: int = 2) -> Plan3D:
    stages, start, last = [], 0, sum(counts) + 1
    for s, count in enumerate(counts):
        stop = last + 1 if s == len(counts) - 1 else start + count + (s == 0)
        replicas = tuple(Replica("H100-SXM", 1, node=0) for _ in range(dp))
        stages.append(Stage3D(start, stop, replicas))
        start = stop
    return Plan3D(tuple(stages), mbs=1, gbs=8, model="megatron-gpt")


@pytest.mark.parametrize(
    "counts",
    [[6, 6, 6, 6], [4, 7, 7, 6], [7, 6], [5, 9, 9], [3, 5, 9, 7], [1, 10], [0, 4, 4]],
)
def test_our_megatron_export_reads_back_as_the_same_stages(counts):
    """Every split our Megatron export writes (even, first/last counts, a
    layout) is read back by the flags' parser to the same stages."""
    plan = _plan(counts)
    assert transformer_layers(plan) == counts
    flags = to_megatron(plan)
    run = spec_from_megatron_args([*MODEL.split(), *flags])
    again = plan_from_megatron_run(run, "H100-SXM", plan.num_gpus, 8)
    assert [(s.start, s.stop) for s in again.stages] == [
        (s.start, s.stop) for s in plan.stages
    ]


def test_predict_an_uneven_launch(capsys):
    """Llama-3.1-405B's 126 layers over 16 stages, as Megatron splits them
    with uneven first and last stages; the same launch predicted with the
    embedding and loss counted in the split gives the same stages."""
    base = (
        "--num-layers 126 --hidden-size 16384 --num-attention-heads 128 "
        "--group-query-attention --num-query-groups 8 --ffn-hidden-size 53248 "
        "--swiglu --normalization RMSNorm --position-embedding-type rope "
        "--disable-bias-linear --untie-embeddings-and-output-weights "
        "--vocab-size 128256 --seq-length 8192 --micro-batch-size 1 "
        "--global-batch-size 2048 --tensor-model-parallel-size 8 "
        "--pipeline-model-parallel-size 16 --sequence-parallel --bf16 "
        "--use-distributed-optimizer"
    )
    outs = []
    for split in (
        "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7",
        "--account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split",
    ):
        argv = ["predict", "--megatron-args", f"{base} {split}", "--gpus", "H100:8192"]
        assert main([*argv, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["plan"].startswith("pp 16 [8+" + "8+" * 14 + "8]")
    assert outs[0]["iteration_time_s"] == outs[1]["iteration_time_s"]
    bad = f"{base} --decoder-first-pipeline-num-layers 9"
    assert main(["predict", "--megatron-args", bad, "--gpus", "H100:8192"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "divide evenly" in err[0]


def test_embedding_and_loss_counted_under_the_interleaved_schedule():
    # 30 blocks + embedding + loss = 32 over 4 stages of 4 chunks of 2: the
    # first (last) stage one block fewer, its first (last) chunk the embedding
    # (loss) and one block
    assert split_pipeline(30, 4, embedding=True, loss=True, layers_per_chunk=2) == (
        4,
        (7, 8, 8, 7),
    )
    assert split_pipeline(31, 4, embedding=True, chunks_per_rank=2) == (2, (7, 8, 8, 8))
