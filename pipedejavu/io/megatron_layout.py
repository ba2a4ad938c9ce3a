"""How a Megatron-LM launch splits its transformer layers over pipeline stages.

:func:`split_pipeline` reads the flags that decide it, with the rules of
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
  spelled out: ``E`` embedding, ``t`` transformer layer, ``L`` loss, stages
  split by ``|``, ``x*n`` and ``(...)*n`` repeat, commas cosmetic;
  ``PP x V`` stages in the order of the interleaved schedule's virtual
  stages;
* ``--num-layers-per-virtual-pipeline-stage`` or
  ``--num-virtual-stages-per-pipeline-rank``: ``V`` model chunks a stage
  (the interleaved schedule).

What the predictor does not model is refused with one line: unequal model
chunks under the interleaved schedule (uneven first/last stages with ``V >
1``; the embedding or loss counted in the split is even, and priced:
:func:`~pipedejavu.costmodel.megatron.interleaving.chunk_layers`),
multi-token-prediction layers (``m``), and the flag combinations Megatron-LM
itself refuses.
"""

from __future__ import annotations

import re

from pipedejavu.core.errors import ProblemError

__all__ = ["MAX_LAYOUT_CHARS", "layout_stages", "split_pipeline"]

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


def _from_layout(layout: str, num_layers: int, pp: int) -> tuple[int, tuple[int, ...]]:
    stages = layout_stages(layout)
    if len(stages) % pp:
        raise ProblemError(
            f"Megatron arguments: --pipeline-model-parallel-layout has {len(stages)} "
            f"stages, not a multiple of --pipeline-model-parallel-size {pp}"
        )
    if any("m" in stage for stage in stages):
        raise ProblemError(
            "Megatron arguments: multi-token-prediction layers (m in "
            "--pipeline-model-parallel-layout) are not supported"
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
    chunks = len(stages) // pp
    if chunks > 1 and len(set(counts)) > 1:
        raise ProblemError(
            "Megatron arguments: a --pipeline-model-parallel-layout with unequal "
            "model chunks under the interleaved schedule is not supported (give "
            "every virtual stage as many transformer layers)"
        )
    return chunks, counts if chunks == 1 and len(set(counts)) > 1 else ()


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


def _virtual(
    per_rank_layers: int, pp: int, per_chunk: int | None, per_rank: int | None
) -> int:
    if per_chunk is None and per_rank is None:
        return 1
    if pp == 1:
        raise ProblemError(
            "Megatron arguments: virtual pipeline stages need "
            "--pipeline-model-parallel-size > 1"
        )
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


def split_pipeline(
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
) -> tuple[int, tuple[int, ...]]:
    """``(V, counts)``: model chunks per stage and the transformer layers of
    each pipeline stage (``()`` for Megatron's even split; always ``()``
    when ``V > 1``, whose chunks are equal). Arguments are the flags of the
    module docstring (``None``/``False`` when not given).

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
        if uneven or embedding or loss or layers_per_chunk or chunks_per_rank:
            raise ProblemError(
                "Megatron arguments: --pipeline-model-parallel-layout cannot be "
                "combined with the other pipeline-split or virtual-stage flags"
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
        if chunks_per_rank not in (None, 1):
            raise ProblemError(
                "Megatron arguments: uneven first/last stages with the interleaved "
                "schedule are not supported (its model chunks would differ)"
            )
        counts = _first_last(num_layers, pp, first, last)
        return 1, counts if len(set(counts)) > 1 else ()
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
        return chunks, ()
    # ``per_rank / chunks`` layers a virtual stage, the embedding (loss) one
    # of the first (last): the first (last) stage holds one block fewer
    counts = [per_rank] * pp
    counts[0] -= embedding
    counts[-1] -= loss
    return chunks, tuple(counts) if len(set(counts)) > 1 else ()
