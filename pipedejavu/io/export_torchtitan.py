"""A torchtitan job-config fragment (TOML) for a plan.

Checked against torchtitan v0.2.2 (commit 73a0e697: ``torchtitan/config/
job_config.py``, ``distributed/parallel_dims.py``,
``distributed/pipeline_parallel.py``, ``models/llama3/infra/parallelize.py``,
``train.py``; no code copied):

* ``ParallelDims``: ``dp_replicate x dp_shard x cp x tp x pp`` is the world
  size; the mesh is ``pp, dp_replicate, fsdp, cp, tp`` (TP fastest: the shared
  rank order of :mod:`pipedejavu.io.export_rules`).
* Data parallelism without sharding (``data_parallel_replicate_degree = dp``,
  ``data_parallel_shard_degree = 1``) is DDP, which ``parallelize_llama``
  accepts only when it is the only parallelism (otherwise ``RuntimeError: DDP
  has not supported > 1D parallelism``). With TP or PP, torchtitan's data
  parallelism is FSDP or HSDP, which shards parameters, gradients and
  optimizer state: not the plan we priced. So a plan with ``dp > 1`` and
  ``tp > 1`` or several stages is refused.
* The batch (``train.py``): gradient accumulation is ``global_batch_size /
  (local_batch_size x dp)``. With one stage a rank runs ``local_batch_size``
  samples in one forward/backward (``pipeline_parallel_microbatch_size`` is
  not used), so ``local_batch_size`` is the micro-batch and the global batch
  gives the accumulation. With several stages (then ``dp = 1``) the pipeline
  schedule splits ``local_batch_size`` into micro-batches of
  ``pipeline_parallel_microbatch_size``: ``local_batch_size`` is the global
  batch, one accumulation step.
* ``module_fqns_per_model_part`` (``pipeline_module_split``) with the llama3
  decoder's names ``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``;
  the ``1F1B`` schedule, one stage per rank. PyTorch's ``Schedule1F1B``
  (``torch.distributed.pipelining``, built by ``build_pipeline_schedule``)
  raises ``ValueError`` for fewer micro-batches than stages, so such a plan is
  refused (``GPipe`` would run it, but holds every micro-batch's activations
  on every stage: not the memory the plan was checked against). Found by
  ``benchmarks/check_exports.py`` with torch 2.14.1.
"""

from __future__ import annotations

import json

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.io.export_rules import (
    ExportRefused,
    check_whole_batch,
    type_comment,
    uniform_tp,
)

__all__ = ["TORCHTITAN_VERSION", "module_fqns", "to_torchtitan"]

TORCHTITAN_VERSION = "torchtitan v0.2.2"


def module_fqns(plan: Plan3D) -> list[list[str]]:
    """torchtitan's module names of each stage (module docstring)."""
    last = plan.num_layers - 1
    out = []
    for stage in plan.stages:
        names = []
        for layer in range(stage.start, stage.stop):
            if layer == 0:
                names.append("tok_embeddings")
            elif layer == last:
                names += ["norm", "output"]
            else:
                names.append(f"layers.{layer - 1}")
        out.append(names)
    return out


def to_torchtitan(plan: Plan3D) -> str:
    """The TOML fragment: ``[training]`` batch sizes and ``[parallelism]``.

    Raises:
        ExportRefused: per-stage TP; data parallelism beside TP or PP (module
            docstring); a batch that is not whole micro-batches; fewer
            micro-batches than stages.
    """
    tp = uniform_tp(plan, TORCHTITAN_VERSION)
    check_whole_batch(plan, TORCHTITAN_VERSION)
    pp = plan.num_stages
    if plan.dp > 1 and (tp > 1 or pp > 1):
        raise ExportRefused(
            f"{TORCHTITAN_VERSION} runs data parallelism beside TP or PP only as "
            f"FSDP/HSDP (sharded; its DDP refuses > 1D parallelism), but the plan "
            f"prices {plan.dp} unsharded replicas with tp {tp} and {pp} stage(s)"
        )
    if pp > 1 and plan.num_microbatches < pp:
        raise ExportRefused(
            f"{TORCHTITAN_VERSION}'s 1F1B schedule (PyTorch's Schedule1F1B) needs "
            f"at least as many micro-batches as stages; the plan runs "
            f"{plan.num_microbatches} over {pp} stages"
        )
    if pp == 1:
        local_batch = plan.mbs  # one forward/backward per accumulation step
    else:
        local_batch = plan.gbs  # dp == 1: the schedule splits it into mbs
    text = (
        f"# {TORCHTITAN_VERSION} job config fragment (pipedejavu plan)\n"
        + type_comment(plan)
        + "[training]\n"
        f"local_batch_size = {local_batch}\n"
        f"global_batch_size = {plan.gbs}\n"
        "\n[parallelism]\n"
        f"data_parallel_replicate_degree = {plan.dp}\n"
        "data_parallel_shard_degree = 1\n"
        f"tensor_parallel_degree = {tp}\n"
        f"pipeline_parallel_degree = {pp}\n"
    )
    if pp == 1:
        return text
    fqns = ",\n    ".join(json.dumps(part) for part in module_fqns(plan))
    return text + (
        'pipeline_parallel_schedule = "1F1B"\n'
        f"pipeline_parallel_microbatch_size = {plan.mbs}\n"
        f"module_fqns_per_model_part = [\n    {fqns},\n]\n"
    )
