"""The Megatron-LM launch flags ``predict --megatron-args`` reads, checked by
Megatron-LM's own code.

* **Pipeline splits.** For a grid of layer counts and pipeline sizes, with
  ``--decoder-first/last-pipeline-num-layers`` and
  ``--account-for-embedding/loss-in-pipeline-split``, the transformer layers
  each pipeline rank builds in Megatron Core (``parse_args`` +
  ``validate_args`` as in ``benchmarks/check_exports.py``, then
  ``get_num_layers_to_build`` on every rank) against
  :func:`pipedejavu.io.megatron_layout.split_pipeline`: the same counts, or
  both refuse. Where Megatron accepts a split with negative layers (its checks
  let them through), we refuse it; that is counted apart.
* **Gradient flags.** ``--overlap-grad-reduce``, ``--overlap-param-gather``
  and ``--grad-reduce-in-bf16`` as our Megatron export writes them
  (:func:`pipedejavu.io.exports.option_flags`) parse and validate, and set
  the arguments they name.
* **TP-communication overlap.** ``--tp-comm-overlap`` as our export writes it
  (with ``--sequence-parallel``, TP 2) validates and sets both; at TP 1
  Megatron refuses it, and so does our reading of the flags.

Needs the launchers' environment of ``benchmarks/check_exports.py`` (torch,
megatron-core with the Megatron-LM source of the same version on
``PYTHONPATH``); not run by CI.

    PYTHONPATH=.:MEGATRON_LM_SOURCE python benchmarks/check_megatron_launch_flags.py
"""

from __future__ import annotations

import time

import check_exports  # Megatron's argument parsing, silenced
import stamp
from check_torchtitan import fake_rank

from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.io.exports import option_flags
from pipedejavu.io.megatron_args import spec_from_megatron_args
from pipedejavu.io.megatron_layout import split_pipeline

LAYERS_AND_STAGES = ((30, 4), (31, 4), (32, 4), (126, 16), (10, 2), (8, 4), (6, 2))
FIRST_LAST = ((None, None), (6, None), (None, 3), (7, 7), (4, None))
EMBEDDING_LOSS = ((True, False), (False, True), (True, True))


def megatron_counts(layers: int, pp: int, extra: list[str]) -> list[int]:
    """Transformer layers each pipeline rank builds in Megatron Core (TP 1,
    DP 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    argv = [
        "--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", "1", "--global-batch-size", "1", *extra,
    ]  # fmt: skip
    args, config = check_exports.megatron_args(argv, pp)
    counts = []
    for rank in range(pp):
        with fake_rank(rank, pp):
            ps.initialize_model_parallel(1, pp, None, create_gloo_process_groups=False)
            try:
                counts.append(get_num_layers_to_build(config))
            finally:
                ps.destroy_model_parallel()
    return counts


def cases():
    for layers, pp in LAYERS_AND_STAGES:
        for first, last in FIRST_LAST:
            extra = []
            if first is not None:
                extra += ["--decoder-first-pipeline-num-layers", str(first)]
            if last is not None:
                extra += ["--decoder-last-pipeline-num-layers", str(last)]
            yield layers, pp, extra, {"first": first, "last": last}
        for embedding, loss in EMBEDDING_LOSS:
            extra = ["--account-for-embedding-in-pipeline-split"] * embedding
            extra += ["--account-for-loss-in-pipeline-split"] * loss
            yield layers, pp, extra, {"embedding": embedding, "loss": loss}


def main(argv=None) -> int:
    out = stamp.out_option(
        __doc__, str(stamp.RESULTS / "check_megatron_launch_flags.json"), argv
    )
    started = time.perf_counter()
    outcomes = {"same counts": 0, "both refuse": 0, "megatron: negative layers": 0}
    failures = []
    for layers, pp, extra, flags in cases():
        try:
            _, ours = split_pipeline(layers, pp, **flags)
            ours = list(ours) or [layers // pp] * pp
        except ProblemError:
            ours = None
        try:
            theirs = megatron_counts(layers, pp, extra)
        except (AssertionError, ValueError, SystemExit):
            theirs = None
        if ours == theirs:
            outcomes["both refuse" if ours is None else "same counts"] += 1
        elif ours is None and theirs is not None and min(theirs) < 0:
            outcomes["megatron: negative layers"] += 1
        else:
            failures.append({"layers": layers, "pp": pp, "flags": extra,
                             "ours": ours, "megatron": theirs})  # fmt: skip
    options = TrainingOptions(
        "bf16",
        distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_bf16=True,
    )
    flags = option_flags(options)
    parsed, _ = check_exports.megatron_args(
        ["--num-layers", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
         *flags],
        2,
    )  # fmt: skip
    gradient_flags = {
        "flags": flags,
        "overlap_grad_reduce": parsed.overlap_grad_reduce,
        "overlap_param_gather": parsed.overlap_param_gather,
        "grad_reduce_in_bf16": parsed.grad_reduce_in_bf16,
        "use_distributed_optimizer": parsed.use_distributed_optimizer,
    }
    if not all(v for k, v in gradient_flags.items() if k != "flags"):
        failures.append({"gradient flags": gradient_flags})
    overlap = option_flags(
        TrainingOptions("bf16", sequence_parallel=True, tp_comm_overlap=True)
    )
    base = ["--num-layers", "8", "--micro-batch-size", "1", "--global-batch-size", "2"]
    parsed, _ = check_exports.megatron_args(
        [*base, "--tensor-model-parallel-size", "2", *overlap], 2
    )
    tp_flags = {
        "flags": overlap,
        "tp_comm_overlap": parsed.tp_comm_overlap,
        "sequence_parallel": parsed.sequence_parallel,
    }
    try:
        check_exports.megatron_args([*base, *overlap], 1)
        tp_flags["megatron refuses at tp 1"] = False
    except (AssertionError, ValueError, SystemExit):
        tp_flags["megatron refuses at tp 1"] = True
    model = "--hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    model += "--max-position-embeddings 32 --vocab-size 128 "
    try:
        spec_from_megatron_args(model + " ".join([*base, *overlap]))
        tp_flags["we refuse at tp 1"] = False
    except ProblemError:
        tp_flags["we refuse at tp 1"] = True
    if not all(v for k, v in tp_flags.items() if k != "flags"):
        failures.append({"tp-comm flags": tp_flags})
    fields = {
        "pipeline_splits": outcomes,
        "gradient_flags": gradient_flags,
        "tp_comm_flags": tp_flags,
    }
    shown = ("pipeline_splits", "versions")
    return check_exports.write_check(out, started, fields, failures, shown)


if __name__ == "__main__":
    raise SystemExit(main())
