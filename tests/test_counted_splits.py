"""Interleaved plans with the embedding and/or the loss counted in the split
(Megatron-LM's --account-for-embedding/loss-in-pipeline-split): searched,
bounded below their predictions, predicted with Megatron's chunks, and
exported with the flags that make Megatron-LM build them."""

from __future__ import annotations

import itertools

import pytest
from helpers import decoder_spec

from pipedejavu.core.layout import PIPELINE_SPLITS, split_blocks
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.interleaving import chunk_layers, profile_chunks
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.io.exports import export_plan
from pipedejavu.io.gpu_sheet import load_gpu_sheet
from pipedejavu.search.megatron.interleaved import (
    interleaved_candidates,
    search_interleaved,
)
from pipedejavu.search.megatron.interleaved_floor import candidate_plan

#: 14 blocks: 14 = 2 x 7 splits into no V >= 2 chunks per rank of two
#: blocks or more but 7 x 2 (one block each); 16 units (both counted) do.
SPEC = decoder_spec(
    name="fourteen",
    num_layers=14,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=8,
    ffn_hidden_size=2048,
    vocab_size=8192,
    seq_length=1024,
)
GPU = "H100-SXM"


def _megatron_blocks(blocks, ranks, chunks, embedding, loss):
    """Transformer layers of each (rank, chunk) as Megatron-Core's
    get_num_layers_to_build gives them (core_v0.16.1), written from its
    rule: the units per rank split into equal chunks, one fewer block in the
    first chunk of rank 0 (the embedding counted) and in the last chunk of the
    last rank (the loss counted)."""
    units = blocks + embedding + loss
    per_chunk = units // ranks // chunks
    out = {}
    for rank, chunk in itertools.product(range(ranks), range(chunks)):
        held = per_chunk
        if embedding and rank == 0 and chunk == 0:
            held -= 1
        if loss and rank == ranks - 1 and chunk == chunks - 1:
            held -= 1
        out[rank, chunk] = held
    return out


@pytest.mark.parametrize(
    "blocks, parts", [(14, 4), (14, 8), (94, 32), (61, 9), (16, 4), (7, 3)]
)
def test_split_blocks_is_megatrons_even_split(blocks, parts):
    for embedding, loss in PIPELINE_SPLITS:
        held = split_blocks(blocks, parts, embedding, loss)
        units = blocks + embedding + loss
        if units % parts:
            assert held is None
            continue
        assert sum(held) == blocks
        expected = _megatron_blocks(blocks, 1, parts, embedding, loss)
        assert held == [expected[0, k] for k in range(parts)]


@pytest.fixture(scope="module")
def source():
    return AnalyticalSource(SPEC, load_gpu_sheet(), TrainingOptions("bf16"))


def test_counted_splits_are_candidates_with_megatrons_chunks(source):
    """Every candidate's plan is predicted with Megatron-Core's chunks, its
    bound below its prediction; splits with the embedding and the loss
    counted are among them (this model has no equal split of two blocks or
    more per chunk)."""
    items = interleaved_candidates(source, SPEC.name, {GPU: 8}, 32, C)
    splits = {item.split for item in items}
    assert (True, True) in splits and (False, False) in splits
    blocks = SPEC.num_layers
    for item in items:
        plan = candidate_plan(source, SPEC.name, 32, item)
        spans = chunk_layers(plan, item.chunks)
        expected = _megatron_blocks(blocks, item.ranks, item.chunks, *item.split)
        order = [expected[r, c] for c in range(item.chunks) for r in range(item.ranks)]
        layers = profile_chunks(order)  # (the embedding and head added)
        for r, c in itertools.product(range(item.ranks), range(item.chunks)):
            start, stop = spans[r][c]
            assert stop - start == layers[c * item.ranks + r]
        prediction = predict_plan(plan, source, constants=C, virtual_stages=item.chunks)
        assert item.bound <= prediction.iteration_time_s * (1 + 1e-12)


def test_the_search_is_the_best_candidate(source):
    """search_interleaved returns the least predicted time over every
    candidate that fits (brute force over the candidates)."""
    best = min(
        (
            p.iteration_time_s
            for item in interleaved_candidates(source, SPEC.name, {GPU: 8}, 32, C)
            if (
                p := predict_plan(
                    candidate_plan(source, SPEC.name, 32, item),
                    source,
                    constants=C,
                    virtual_stages=item.chunks,
                )
            ).fits_memory
        ),
    )
    found = search_interleaved(source, SPEC.name, {GPU: 8}, 32, C)
    assert found.proven and found.prediction.iteration_time_s == pytest.approx(best)


def test_a_counted_split_exports_and_reads_back(source):
    """The export writes --num-layers-per-virtual-pipeline-stage with the
    account-for flags, and the command read back gives the plan's stages
    (export_plan reads every Megatron export back)."""
    item = next(
        item
        for item in interleaved_candidates(source, SPEC.name, {GPU: 8}, 32, C)
        if item.split == (True, True) and item.ranks == 4 and item.chunks == 2
    )
    plan = candidate_plan(source, SPEC.name, 32, item)
    options = TrainingOptions("bf16", virtual_stages=2)
    text = export_plan(plan, "megatron", spec=SPEC, options=options)
    assert "--num-layers-per-virtual-pipeline-stage 2" in text
    assert "--account-for-embedding-in-pipeline-split" in text
    assert "--account-for-loss-in-pipeline-split" in text
    assert "--decoder-first-pipeline-num-layers" not in text
