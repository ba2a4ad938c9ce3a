"""How a Megatron-LM launch splits its transformer layers over pipeline stages.

:func:`pipeline_split` (and :func:`split_pipeline`, its first two answers)
reads the flags that decide it, with the rules of
Megatron Core (``megatron/training/arguments.py``' ``validate_args``,
``TransformerConfig.__post_init__``, ``get_num_layers_to_build`` and
``PipelineParallelLayerLayout``; read in core_v0.16.1, no code copied):

* no flag: ``L / PP`` layers a stage (``L`` must divide);
* ``--decoder-first-pipeline-num-layers F`` and/or
  ``--decoder-last-pipeline-num-layers La``: the first (last) stage holds
  ``F`` (``La``) layers, and what they leave divides evenly over the other
  stages;
* ``--account-for-embedding-in-pipeline-split`` /
  ``--account-for-loss-in-pipeline-split``: the embedding (the loss) counts
  as one more layer: ``(L + 1 [+ 1]) / PP`` a stage, one fewer transformer
  layer on the first (last) stage;
* ``--pipeline-model-parallel-layout``: the layers of every (virtual) stage
  spelled out: ``E`` embedding, ``t`` transformer layer, ``m`` MTP depth,
  ``L`` loss, stages split by ``|``, ``x*n`` and ``(...)*n`` repeat, commas cosmetic;
  ``PP x V`` stages in the order of the interleaved schedule's virtual
  stages;
* ``--num-layers-per-virtual-pipeline-stage`` or
  ``--num-virtual-stages-per-pipeline-rank``: ``V`` model chunks a stage
  (the interleaved schedule).

A layout's multi-token-prediction depths (``m``) follow Megatron Core's
``validate_layer_layout``: as many as ``--mtp-num-layers``
(:meth:`PipelineSplit.check_mtp`), after every transformer layer, all in one
virtual stage, the last of its pipeline rank. The cost model prices them with
the LM head (:mod:`pipedejavu.costmodel.analytical.mtp_ops`), so they must sit
in the loss's virtual stage, the last; Megatron's "standalone" MTP (``m`` in
the last virtual stage of another rank, ``...,m|L``) is refused as not priced.
A layout's virtual stages may hold any number of transformer layers (none:
``"mL"``): :attr:`PipelineSplit.virtual_layers` gives each one's, which the
interleaved pipeline model prices chunk by chunk
(:func:`~pipedejavu.costmodel.megatron.interleaving.chunk_layers`).

What the predictor does not model is refused with one line: unequal model
chunks from uneven first/last stages under the interleaved schedule
(``--decoder-first/last-pipeline-num-layers`` with ``V > 1``; a layout
spells them out instead), standalone MTP, and the flag combinations
Megatron-LM itself refuses.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from pipedejavu.core.errors import ProblemError

__all__ = [
    "MAX_LAYOUT_CHARS",
    "PipelineSplit",
    "layout_stages",
    "pipeline_split",
    "split_pipeline",
]

#: Longest ``--pipeline-model-parallel-layout`` once its repeats are unrolled
#: (a layout spells out every layer; a million layers is beyond any model).
MAX_LAYOUT_CHARS = 1_000_000
_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")


def _unroll(pattern: re.Pattern[str], text: str) -> str:
    out, end, size = [], 0, len(text)
    for match in pattern.finditer(text):
        body, digits = match.group(1), match.group(2)
        # (a count of more digits than the limit is past it; int() would take
        # time, or refuse more than 4,300 digits)
        too_many = len(digits) > len(str(MAX_LAYOUT_CHARS))
        times = MAX_LAYOUT_CHARS + 1 if too_many else int(digits)
        size += len(body) * times - len(match.group(0))
        if size > MAX_LAYOUT_CHARS:
            raise ProblemError(
                "Megatron arguments: --pipeline-model-parallel-layout unrolls to "
                f"more than {MAX_LAYOUT_CHARS:,} characters"
            )
        out += [text[end : match.start()], body * times]
        end = match.end()
    return "".join(out) + text[end:]


def layout_stages(layout: str) -> list[str]:
    """The (virtual) stages of a ``--pipeline-model-parallel-layout``, each as
    its layer letters: ``"Et*2|(tt|)*2,tL"`` -> ``["Ett", "tt", "tt", "tL"]``.

    Raises:
        ProblemError: a letter other than ``E``, ``t``, ``L``, ``m``, or a
            layout that unrolls to more than :data:`MAX_LAYOUT_CHARS`.
    """
    if len(layout) > MAX_LAYOUT_CHARS:
        raise ProblemError(
            "Megatron arguments: --pipeline-model-parallel-layout is too long"
        )
    text = _unroll(_SINGLE, _unroll(_GROUP, layout.replace(",", "")))
    stages = text.split("|")
    for stage in stages:
        bad = set(stage) - set("EtLm")
        if bad:
            raise ProblemError(
                f"Megatron arguments: --pipeline-model-parallel-layout has "
                f"{''.join(sorted(bad))!r}; its letters are E (embedding), t "
                "(transformer layer), L (loss), m (multi-token prediction)"
            )
    return stages


class PipelineSplit(NamedTuple):
    """What :func:`pipeline_split` reads.

    Attributes:
        chunks: ``V``, model chunks per pipeline rank (1: no interleaving).
        stage_layers: transformer layers of each pipeline rank (all its
            chunks) when they differ; ``()``: Megatron's even split.
        virtual_layers: with a layout and ``V > 1``, the transformer layers
            of each of the ``PP x V`` virtual stages, in their order (rank
            ``r`` holds ``r, r + PP, ...``); ``()``: the chunks Megatron's
            even split gives
            (:func:`~pipedejavu.costmodel.megatron.interleaving.chunk_layers`).
        layout_mtp: the MTP depths (``m``) a layout holds; ``None``: no layout
            (Megatron puts ``--mtp-num-layers`` on the last stage).
    """

    chunks: int
    stage_layers: tuple[int, ...] = ()
    virtual_layers: tuple[int, ...] = ()
    layout_mtp: int | None = None

    def check_mtp(self, mtp_layers: int) -> None:
        """Refuse a layout whose ``m`` are not ``--mtp-num-layers``
        (``mtp_layers``; 0 without the flag), as Megatron Core's
        ``validate_layer_layout`` asserts.

        Raises:
            ProblemError: the counts differ.
        """
        if self.layout_mtp is not None and self.layout_mtp != mtp_layers:
            raise ProblemError(
                f"Megatron arguments: --pipeline-model-parallel-layout holds "
                f"{self.layout_mtp} MTP layer(s) (m), --mtp-num-layers says "
                f"{mtp_layers} (Megatron Core's validate_layer_layout: they must "
                "match)"
            )


def _mtp_placement(stages: list[str], pp: int) -> None:
    """Megatron Core's ``validate_layer_layout`` rules on where ``m`` sits,
    then the one the cost model adds (``m`` beside the loss)."""
    where = [k for k, stage in enumerate(stages) if "m" in stage]
    if not where:
        return
    text = "|".join(stages)
    if "t" in text[text.index("m") :]:
        raise ProblemError(
            "Megatron arguments: a transformer layer (t) follows an MTP layer (m) "
            "in --pipeline-model-parallel-layout (validate_layer_layout: decoder "
            "layers must be placed before MTP layers)"
        )
    chunks = len(stages) // pp
    for k in where:
        if k // pp != chunks - 1:
            raise ProblemError(
                f"Megatron arguments: --pipeline-model-parallel-layout puts MTP "
                f"layers (m) in virtual stage {k // pp} of pipeline rank {k % pp}, "
                "not its last (validate_layer_layout: MTP sits in a rank's last "
                "virtual stage)"
            )
    if len(where) > 1:
        raise ProblemError(
            "Megatron arguments: --pipeline-model-parallel-layout spreads its MTP "
            "layers (m) over several virtual stages (validate_layer_layout: all "
            "in one)"
        )
    if where[0] != len(stages) - 1:
        raise ProblemError(
            f"Megatron arguments: MTP layers (m) on pipeline rank {where[0] % pp}, "
            "apart from the loss (Megatron's standalone MTP), are not priced: the "
            "cost model runs them with the LM head; put them beside L, in the "
            "last virtual stage"
        )


def _from_layout(layout: str, num_layers: int, pp: int) -> PipelineSplit:
    stages = layout_stages(layout)
    if len(stages) % pp:
        raise ProblemError(
            f"Megatron arguments: --pipeline-model-parallel-layout has {len(stages)} "
            f"stages, not a multiple of --pipeline-model-parallel-size {pp}"
        )
    text = "|".join(stages)
    if text.count("E") != 1 or not stages[0].startswith("E"):
        raise ProblemError(
            "Megatron arguments: --pipeline-model-parallel-layout must start with "
            "the embedding (E) and hold it once"
        )
    if text.count("L") != 1 or not stages[-1].endswith("L"):
        raise ProblemError(
            "Megatron arguments: --pipeline-model-parallel-layout must end with "
            "the loss (L) and hold it once"
        )
    counts = tuple(stage.count("t") for stage in stages)
    if sum(counts) != num_layers:
        raise ProblemError(
            f"Megatron arguments: --pipeline-model-parallel-layout holds "
            f"{sum(counts)} transformer layers, --num-layers says {num_layers}"
        )
    _mtp_placement(stages, pp)
    chunks = len(stages) // pp
    if chunks > 1:
        _pipelined(pp)
    ranks = tuple(sum(counts[r::pp]) for r in range(pp))
    return PipelineSplit(
        chunks,
        ranks if len(set(ranks)) > 1 else (),
        counts if chunks > 1 else (),
        text.count("m"),
    )


def _first_last(
    num_layers: int, pp: int, first: int | None, last: int | None
) -> tuple[int, ...]:
    rest = num_layers - (first or 0) - (last or 0)
    left = pp - (first is not None) - (last is not None)
    if left < 0 or (left == 0 and rest) or (left > 0 and (rest <= 0 or rest % left)):
        raise ProblemError(
            f"Megatron arguments: {num_layers} layers with "
            f"--decoder-first-pipeline-num-layers {first} and "
            f"--decoder-last-pipeline-num-layers {last} leave {rest} for "
            f"{max(left, 0)} other stage(s): they must divide evenly"
        )
    counts = [rest // left if left else 0] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _pipelined(pp: int) -> None:
    if pp == 1:
        raise ProblemError(
            "Megatron arguments: virtual pipeline stages need "
            "--pipeline-model-parallel-size > 1"
        )


def _virtual(
    per_rank_layers: int, pp: int, per_chunk: int | None, per_rank: int | None
) -> int:
    if per_chunk is None and per_rank is None:
        return 1
    _pipelined(pp)
    if per_rank is not None:
        chunks = per_rank
    elif per_rank_layers % per_chunk:
        raise ProblemError(
            f"Megatron arguments: {per_rank_layers} layers per pipeline stage "
            f"are not divisible by --num-layers-per-virtual-pipeline-stage "
            f"{per_chunk}"
        )
    else:
        chunks = per_rank_layers // per_chunk
    if per_rank_layers % chunks:
        raise ProblemError(
            f"Megatron arguments: {per_rank_layers} layers per pipeline stage do "
            f"not split into pipeline stages x virtual stages = {pp} x {chunks}"
        )
    return chunks


def _uneven_chunks(counts: tuple[int, ...], chunks: int) -> tuple[int, ...]:
    """The virtual stages' layers of uneven first/last stages under the
    interleaved schedule: each rank's layers split evenly over its chunks, as
    ``TransformerConfig`` requires them to."""
    for r, count in enumerate(counts):
        if count % chunks:
            where = "first" if r == 0 else "last" if r == len(counts) - 1 else "middle"
            raise ProblemError(
                f"Megatron arguments: the {where} pipeline stage's {count} layers "
                f"do not split into --num-virtual-stages-per-pipeline-rank {chunks} "
                "equal chunks (TransformerConfig requires it)"
            )
    return tuple(count // chunks for _ in range(chunks) for count in counts)


def pipeline_split(
    num_layers: int,
    pp: int,
    *,
    first: int | None = None,
    last: int | None = None,
    embedding: bool = False,
    loss: bool = False,
    layout: str | None = None,
    layers_per_chunk: int | None = None,
    chunks_per_rank: int | None = None,
) -> PipelineSplit:
    """The model chunks per stage and the transformer layers of each pipeline
    stage and virtual stage. Arguments are the flags of the module docstring
    (``None``/``False`` when not given). A layout's ``m`` are checked against
    ``--mtp-num-layers`` by :meth:`PipelineSplit.check_mtp`.

    Raises:
        ProblemError: flags Megatron-LM refuses together, a split that does not
            divide, or one the predictor does not model (module docstring).
    """
    if layers_per_chunk is not None and chunks_per_rank is not None:
        raise ProblemError(
            "Megatron arguments: give one of --num-layers-per-virtual-pipeline-stage "
            "and --num-virtual-stages-per-pipeline-rank"
        )
    uneven = first is not None or last is not None
    if layout is not None:
        if layers_per_chunk or chunks_per_rank:
            raise ProblemError(
                "Megatron arguments: --pipeline-model-parallel-layout gives the "
                "virtual stages itself; validate_args refuses it with "
                "--num-virtual-stages-per-pipeline-rank or "
                "--num-layers-per-virtual-pipeline-stage"
            )
        if uneven or embedding or loss:
            raise ProblemError(
                "Megatron arguments: --pipeline-model-parallel-layout cannot be "
                "combined with the other pipeline-split flags (TransformerConfig "
                "refuses them together)"
            )
        return _from_layout(layout, num_layers, pp)
    if uneven and (embedding or loss):
        raise ProblemError(
            "Megatron arguments: --decoder-first/last-pipeline-num-layers cannot be "
            "combined with --account-for-embedding/loss-in-pipeline-split"
        )
    if uneven:
        if layers_per_chunk is not None:
            raise ProblemError(
                "Megatron arguments: uneven first/last stages take "
                "--num-virtual-stages-per-pipeline-rank, not "
                "--num-layers-per-virtual-pipeline-stage"
            )
        counts = _first_last(num_layers, pp, first, last)
        chunks, virtual = chunks_per_rank or 1, ()
        if chunks > 1:
            _pipelined(pp)
            virtual = _uneven_chunks(counts, chunks)
        return PipelineSplit(chunks, counts if len(set(counts)) > 1 else (), virtual)
    total = num_layers + embedding + loss
    if total % pp:
        what = "".join(
            [" + 1 (embedding)" if embedding else "", " + 1 (loss)" if loss else ""]
        )
        raise ProblemError(
            f"Megatron arguments: --num-layers {num_layers}{what} is not "
            f"divisible by --pipeline-model-parallel-size {pp}"
        )
    per_rank = total // pp
    chunks = _virtual(per_rank, pp, layers_per_chunk, chunks_per_rank)
    if not (embedding or loss):
        return PipelineSplit(chunks)
    # ``per_rank / chunks`` layers a virtual stage, the embedding (loss) one
    # of the first (last): the first (last) stage holds one block fewer
    counts = [per_rank] * pp
    counts[0] -= embedding
    counts[-1] -= loss
    return PipelineSplit(chunks, tuple(counts) if len(set(counts)) > 1 else ())


def split_pipeline(
    num_layers: int, pp: int, *, mtp_layers: int = 0, **flags
) -> tuple[int, tuple[int, ...]]:
    """``(V, counts)`` of :func:`pipeline_split` (``flags``: its keywords),
    a layout's ``m`` checked against ``mtp_layers``
    (:meth:`PipelineSplit.check_mtp`).

    Raises:
        ProblemError: as :func:`pipeline_split`, or a layout whose ``m`` are
            not ``mtp_layers``.
    """
    split = pipeline_split(num_layers, pp, **flags)
    split.check_mtp(mtp_layers)
    return split.chunks, split.stage_layers
