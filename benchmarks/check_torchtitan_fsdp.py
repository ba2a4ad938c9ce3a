"""torchtitan's own code on sharded-data-parallel exports (issue 45, item 3).

Seeded random plans (FSDP and HSDP over the layout's shard groups, context
parallelism, TP, a few pipelines, ZeRO stages 0 to 3, fp32, bf16, fp8 and
fp16, recomputation none, full, torchtitan's per-op policy or Megatron's
selective modules, sequence lengths that CP's load balancing takes and some
it does not) are exported with ``export_plan(plan,
"torchtitan", ...)``. For each export:

* ``ConfigManager().parse_args`` reads the TOML (an unknown key raises) and
  ``ParallelDims`` takes its degrees: ``dp_replicate``, ``dp_shard``, ``cp``,
  ``tp``, ``pp`` and the world size must be the layout's (``dp_replicate``,
  ``shard_replicas``, ``cp``, the TP, the stages, the plan's GPUs);
* the local batch and ``train.py``'s gradient accumulation must be the plan's
  micro-batch and micro-batch count;
* ``build_mesh`` on torch's fake process group (CPU meshes); the whole
  ``dense`` mesh (``pp, dp_replicate, fsdp, tp``) and ``dataloading`` mesh
  (``pp, batch, cp, tp``) must put every global rank where the layout's rank
  rule does (:meth:`~pipedejavu.core.layout.ParallelLayout.rank`, replica
  ``j`` = replicate group ``j // dp_shard``, shard ``j mod dp_shard``);
* the model converters (fp8: torchao's ``Float8LinearConverter`` with the
  tensorwise recipe, emulated on the CPU) and ``parallelize_llama`` on a small
  llama3 ``Transformer`` on the meta device: every FSDP unit (the embedding,
  each block, the norm with the head) over the ``dp_replicate x fsdp`` mesh of
  the plan's sizes, its ``MixedPrecisionPolicy`` (bf16 or fp32 parameters,
  fp32 reduction), whether it reshards after the forward
  (``reshard_after_forward``), every block wrapped by ``apply_ac`` (with the
  op policy's ``context_fn`` for torchtitan's per-op recomputation, without
  for full, none without recomputation), TP's DTensors on the ``tp`` mesh, CP's
  hooks on every attention (torchtitan 0.2.2; 0.2.1 enters CP per step) and
  ``maybe_enable_amp`` leaving mixed precision to FSDP;
* a plan without FSDP (unsharded, one replica or DDP alone) goes through
  ``check_torchtitan.check_torchtitan`` (its pipeline split and schedule).

A refusal must be the one the rules below re-state (:func:`expected_refusal`)
and is confirmed by the real code (:func:`confirm`): PyTorch's
``PipelineStage`` turning FSDP's gradient sync and resharding off between
micro-batches, ``ParallelDims.fsdp_enabled`` with CP, ``parallelize_llama``'s
DDP and sequence-length assertions, CP's SDPA handlers, the config's types,
``maybe_enable_amp``, ``apply_tp``'s plan, ``apply_ac``, the schedule.

Run it in an environment with torchtitan and CPU torch (torchao for fp8's
conversion: on ``PYTHONPATH`` is enough; without it the converter's
registration and recipe are checked, not the conversion)::

    PYTHONPATH=. python benchmarks/check_torchtitan_fsdp.py

Writes ``benchmarks/results/check_torchtitan_fsdp_<torchtitan version>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import sys
import time
import typing
from collections import Counter
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stamp  # noqa: E402
from check_torchtitan import (  # noqa: E402
    Mismatch,
    RealRejects,
    block_wrapping,
    check_torchtitan,
    checkpoint_mode,
    expect,
    fake_rank,
    options_rejects,
    silenced,
    titan_config,
    titan_dims,
    titan_schedule_rejects,
)
from test_export_torchtitan_fsdp import sharded_plan  # noqa: E402  (the tests' plans)

from pipedejavu.core.training_options import (  # noqa: E402
    TORCHTITAN_OP,
    TrainingOptions,
)
from pipedejavu.io.export_rules import ExportRefused  # noqa: E402
from pipedejavu.io.exports import export_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLOAT8 = "quantize.linear.float8"


# ----------------------------------------------------------------- the plans
def random_case(seed: int):
    """A seeded plan (the tests' :func:`sharded_plan`), its training options
    and length (module docstring)."""
    rng = np.random.default_rng(seed)
    while True:
        tp = int(rng.choice([1, 1, 2, 4, 8]))
        dp = int(rng.choice([1, 2, 3, 4, 6, 8]))
        cp = int(rng.choice([1, 1, 2, 4, 8]))
        if tp * dp * cp <= 256 and (dp * cp > 1 or rng.random() < 0.15):
            break
    shards = [s for s in range(1, dp + 1) if dp % s == 0]
    dp_shard = None if rng.random() < 0.5 else int(rng.choice(shards))
    pp = 1 if rng.random() < 0.85 else int(rng.integers(2, 5))
    blocks = int(rng.integers(1, 4))
    mbs, steps = int(rng.choice([1, 2, 4])), int(rng.integers(1, 5))
    plan = sharded_plan(pp=pp, tp=tp, dp=dp, cp=cp, dp_shard=dp_shard, mbs=mbs,
                        steps=steps, blocks=blocks)  # fmt: skip
    stage = 3 if rng.random() < 0.85 else int(rng.integers(0, 3))
    precision = str(
        rng.choice(["fp32", "bf16", "fp8", "fp16"], p=[0.25, 0.45, 0.28, 0.02])
    )
    how = str(
        rng.choice(["none", "full", "op", "core_attn"], p=[0.35, 0.35, 0.25, 0.05])
    )
    options = TrainingOptions(
        precision=precision,
        zero_stage=stage,
        reshard_after_forward=bool(stage != 3 or rng.random() < 0.5),
        recompute=how if how in ("none", "full") else "selective",
        recompute_modules=(TORCHTITAN_OP if how == "op" else "core_attn",),
        sequence_parallel=tp > 1 and rng.random() < 0.97,
        flash_attention=bool(rng.random() < 0.97),
        grad_reduce_in_bf16=precision in ("bf16", "fp8") and rng.random() < 0.05,
    )  # fmt: skip
    divisor = tp * 2 * cp
    length = divisor * int(rng.integers(1, 65)) * 64
    if rng.random() < 0.05:
        length += int(rng.integers(1, divisor))
    if rng.random() < 0.05:
        length = None
    return f"seed {seed}", plan, options, length


# ----------------------------------------------------------------- the rules
def expected_refusal(plan, options: TrainingOptions, length) -> str | None:
    """Which refusal the export gives (a part of its message), re-stated in
    the export's order; ``None``: exported."""
    layout, tp, pp = plan.layout, plan.stages[0].replicas[0].tp, plan.num_stages
    fsdp = options.zero_stage == 3 and layout.shard_group > 1
    if fsdp and pp > 1:
        return "pipeline stages run FSDP without gradient sync"
    if not fsdp and layout.cp > 1:
        return "always shards the model state over context-parallel GPUs"
    if not fsdp and plan.dp > 1 and (tp > 1 or pp > 1):
        return "only as FSDP/HSDP"
    if not fsdp and options.zero_stage and plan.dp > 1:
        return "shards optimizer state only with FSDP"
    if options.precision == "fp16":
        return "has no fp16 training"
    if options.precision in ("bf16", "fp8") and not fsdp:
        return options.precision
    if options.grad_reduce_in_bf16:
        return "mixed_precision_reduce"
    if tp > 1 and not options.sequence_parallel:
        return "without sequence parallelism"
    if length is not None and length % (tp * 2 * layout.cp):
        return "seq_len to be a multiple of tp x 2 cp"
    if layout.cp > 1 and not options.flash_attention:
        return "SDPA's fused kernels only"
    op = options.selective_modules == (TORCHTITAN_OP,)
    if op and options.precision == "fp8":
        return "which the policy recomputes"
    if options.recompute == "selective" and not op:
        return "no selective recomputation"
    if pp > 1 and plan.num_microbatches < pp:
        return "at least as many micro-batches"
    return None


@contextlib.contextmanager
def cpu_meshes():
    """torchtitan's meshes on the CPU (its ``device_type`` is ``cuda`` when
    no accelerator is found, and FSDP places parameters on the mesh's device)."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    saved = parallel_dims.device_type
    parallel_dims.device_type = "cpu"
    try:
        yield
    finally:
        parallel_dims.device_type = saved


def small_llama(blocks: int):
    """A llama3 ``Transformer`` on the meta device that TP up to 8 splits
    (every ``nn.Linear`` a multiple of 16 wide, as float8 needs)."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    args = TransformerModelArgs(dim=64, n_layers=blocks, n_heads=8, vocab_size=128,
                                multiple_of=64, max_seq_len=64)  # fmt: skip
    with torch.device("meta"):
        return Transformer(args)


def degrees_text(plan, options: TrainingOptions, length) -> str:
    """The degrees the plan would need (for a refused plan's witness)."""
    layout, tp = plan.layout, plan.stages[0].replicas[0].tp
    if options.zero_stage == 3 and layout.shard_group > 1:
        data = (layout.dp_replicate, layout.shard_replicas)
    else:
        data = (plan.dp, 1)
    return (
        f"[training]\nlocal_batch_size = {plan.mbs}\nglobal_batch_size = {plan.gbs}\n"
        + (f"seq_len = {length}\n" if length is not None else "")
        + f"[parallelism]\ndata_parallel_replicate_degree = {data[0]}\n"
        f"data_parallel_shard_degree = {data[1]}\n"
        f"context_parallel_degree = {layout.cp}\ntensor_parallel_degree = {tp}\n"
        f"pipeline_parallel_degree = {plan.num_stages}\n"
    )


# ---------------------------------------------------------------- witnesses
_CACHE: dict[str, str] = {}


def pipeline_fsdp_witness() -> str:
    """PyTorch's ``_PipelineStageBase.backward_maybe_with_nosync`` on a real
    FSDP module, for a micro-batch that is not the last."""
    if "pipeline" in _CACHE:
        return _CACHE["pipeline"]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining.stage import _PipelineStageBase

    with fake_rank(0, 2), silenced():
        module = fully_shard(nn.Linear(16, 16, device="meta"),
                             mesh=init_device_mesh("cpu", (2,)))  # fmt: skip
        group = module._get_fsdp_state()._fsdp_param_group
        before = (group.reduce_grads, group.reshard_after_backward)
        x = torch.ones(2, requires_grad=True)
        _PipelineStageBase.backward_maybe_with_nosync(
            SimpleNamespace(submod=module), "full",
            {"stage_output": (2 * x).sum(), "output_grads": None, "input_values": [x]},
            last_backward=False,
        )  # fmt: skip
        after = (group.reduce_grads, group.reshard_after_backward)
    why = ""
    if before == (True, True) and after == (False, False):
        why = (
            "PipelineStage: FSDP gradient sync and resharding off between micro-batches"
        )
    _CACHE["pipeline"] = why
    return why


def sdpa_witness() -> str:
    """CP's SDPA handlers: the fused kernels only, no math attention."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import (
            _attention as cp_attention,
        )
    except ImportError:  # older torch
        from torch.distributed.tensor.experimental import _attention as cp_attention
    names = {op.name() for op in cp_attention.custom_ops}
    fused = all(
        any(k in n for k in ("flash_attention", "efficient_attention", "cudnn"))
        for n in names
    )
    if names and fused and not any("math" in n for n in names):
        return "CP's SDPA handlers: flash, efficient and cuDNN attention only"
    return ""


def parallelize_raises(plan, text: str, error: type[Exception], words: str) -> bool:
    """``parallelize_llama`` of a small llama on the mesh of ``plan``'s GPUs,
    the config ``text``'s degrees, raises ``error`` saying ``words``."""
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    config = titan_config(text)
    dims = titan_dims(config, plan.num_gpus)
    with cpu_meshes(), fake_rank(0, plan.num_gpus), silenced():
        dims.build_mesh()
        try:
            parallelize_llama(small_llama(2), dims, config)
        except error as raised:
            return words in str(raised)
    return False


def length_witness(plan, options, length) -> str:
    """``parallelize_llama``'s assertion on the length the plan needs."""
    text = degrees_text(plan, options, length)
    if parallelize_raises(plan, text, AssertionError, "must be divisible"):
        return "parallelize_llama: seq_len % (tp x 2 cp) assertion"
    return ""


def ddp_witness(plan, length) -> str:
    """``parallelize_llama`` on the unsharded degrees the plan prices."""
    text = degrees_text(plan, TrainingOptions(), length)
    if parallelize_raises(
        plan, text, RuntimeError, "DDP has not supported > 1D parallelism"
    ):
        return "parallelize_llama: DDP has not supported > 1D parallelism"
    return ""


def confirm(reason: str, plan, options: TrainingOptions, length) -> str:
    """The real code's witness for a refusal (``""``: not confirmed)."""
    from torchtitan.config.job_config import Training

    tp = plan.stages[0].replicas[0].tp
    if reason.startswith("pipeline stages"):
        return pipeline_fsdp_witness()
    if reason.startswith("always shards"):
        dims = titan_dims(titan_config(degrees_text(plan, options, length)),
                          plan.num_gpus)  # fmt: skip
        return "ParallelDims.fsdp_enabled with cp > 1" if dims.fsdp_enabled else ""
    if reason == "only as FSDP/HSDP":
        return ddp_witness(plan, None)
    if reason.startswith("shards optimizer"):
        return options_rejects(plan, tp, TrainingOptions(distributed_optimizer=True))
    if reason == "has no fp16 training":
        return options_rejects(plan, tp, TrainingOptions("fp16"))
    if reason in ("bf16", "fp8"):  # what maybe_enable_amp runs without FSDP
        return options_rejects(plan, tp, TrainingOptions("bf16"))
    if reason == "mixed_precision_reduce":
        allowed = typing.get_args(typing.get_type_hints(Training)[reason])
        return "mixed_precision_reduce: float32 only" if allowed == ("float32",) else ""
    if reason == "without sequence parallelism":
        return options_rejects(plan, tp, TrainingOptions())
    if reason.startswith("seq_len"):
        return length_witness(plan, options, length)
    if reason.startswith("SDPA"):
        return sdpa_witness()
    if reason == "no selective recomputation":
        return options_rejects(plan, tp, TrainingOptions(recompute="selective"))
    if reason == "which the policy recomputes":
        from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

        ops = torch.ops.aten
        if ops.mm.default in _op_sac_save_list and not any(
            "_scaled_mm" in str(op) for op in _op_sac_save_list
        ):
            return "parallelize's op policy saves aten.mm, not aten._scaled_mm"
        return ""
    if reason.startswith("at least"):
        return titan_schedule_rejects(plan, tp, options)
    return ""


# --------------------------------------------------------------- the check
def check_meshes(plan, dims) -> None:
    """Every global rank where the layout's rank rule puts it."""
    layout = plan.layout
    shard, cp = layout.shard_replicas, layout.cp
    dense = dims._global_meshes["dense"].mesh
    loading = dims._global_meshes["dataloading"].mesh
    sizes = (plan.num_stages, layout.dp_replicate, shard * cp, layout.stages[0].tp)
    expect(tuple(dense.shape) == sizes, "dense mesh")
    for (s, r, f, t), rank in np.ndenumerate(dense.numpy()):
        s, r, f, t = map(int, (s, r, f, t))
        want = layout.rank(s, tp=t, cp=f % cp, dp=r * shard + f // cp)
        expect(rank == want, f"dense mesh {(s, r, f, t)}: rank {rank}, not {want}")
    for (s, b, c, t), rank in np.ndenumerate(loading.numpy()):
        want = layout.rank(int(s), tp=int(t), cp=int(c), dp=int(b))
        expect(rank == want, f"data mesh {(s, b, c, t)}: rank {rank}, not {want}")


def converted(config, dims, model) -> int:
    """Linears torchtitan's converters swap (fp8: emulated on the CPU)."""
    import torchtitan.components.quantization  # noqa: F401  (registers them)
    from torchtitan.protocols import model_converter

    expect(config.model.converters == [FLOAT8], "model.converters")
    expect(FLOAT8 in model_converter._registry_model_converter_cls, "no converter")
    expect(config.quantize.linear.float8.recipe_name == "tensorwise", "recipe")
    try:
        import torchao  # noqa: F401
    except ImportError:
        return -1
    config.quantize.linear.float8.emulate = True  # no SM 8.9 here
    with silenced():
        model_converter.build_model_converters(config, dims).convert(model)
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def check_fsdp(plan, text: str, options: TrainingOptions, length) -> dict:
    """An FSDP export through torchtitan's code (module docstring)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.utils import maybe_enable_amp
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    try:
        config = titan_config(text)
        dims = titan_dims(config, plan.num_gpus)
    except (AssertionError, ValueError, SystemExit) as error:
        raise RealRejects(f"config: {error}") from None
    layout, tp = plan.layout, plan.stages[0].replicas[0].tp
    got = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp)
    want = (layout.dp_replicate, layout.shard_replicas, layout.cp, tp, 1)
    expect(got == want, f"ParallelDims {got}, planned {want}")
    training = config.training
    if length is not None:
        expect(training.seq_len == length, "seq_len")
    half = options.precision in ("bf16", "fp8")
    param = torch.bfloat16 if half else torch.float32
    expect(training.dtype == "float32", "training.dtype")
    degree = dims.dp_replicate * dims.dp_shard  # train.py's batch degree
    accumulation, rest = divmod(training.global_batch_size,
                                training.local_batch_size * degree)  # fmt: skip
    expect(rest == 0 and (training.local_batch_size, accumulation)
           == (plan.mbs, plan.num_microbatches), "batch")  # fmt: skip
    blocks = plan.num_layers - 2
    out = Counter()
    with cpu_meshes(), fake_rank(0, plan.num_gpus), silenced():
        dims.build_mesh()
        check_meshes(plan, dims)
        expect(isinstance(maybe_enable_amp(dims, training.mixed_precision_param,
                                           "cuda"), contextlib.nullcontext),
               "maybe_enable_amp: autocast under FSDP")  # fmt: skip
        model = small_llama(blocks)
        if options.precision == "fp8":
            linears = sum(isinstance(m, nn.Linear) for m in model.modules())
            swapped = converted(config, dims, model)
            expect(swapped in (-1, linears), f"{swapped} of {linears} float8")
            out["float8 linears converted" if swapped > 0 else "float8 not run"] += 1
        try:
            parallelize_llama(model, dims, config)
        except (AssertionError, RuntimeError, ValueError) as error:
            raise RealRejects(f"parallelize_llama: {error}") from None
        names = ("dp_replicate", "fsdp") if dims.dp_replicate > 1 else ("fsdp",)
        sizes = (layout.dp_replicate, layout.shard_group)[-len(names) :]
        groups = {}
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None and name:
                    groups.setdefault(id(group), (name, group))
        expect(len(groups) == blocks + 2, f"{len(groups)} FSDP units")
        for name, group in groups.values():
            mesh = group.mesh_info.mesh
            expect((mesh.mesh_dim_names, tuple(mesh.mesh.shape)) == (names, sizes),
                   f"{name}: FSDP mesh {mesh}")  # fmt: skip
            policy = group.mp_policy
            expect((policy.param_dtype, policy.reduce_dtype) == (param, torch.float32),
                   f"{name}: {policy}")  # fmt: skip
            reshards = group.post_forward_mesh_info is not None
            expect(reshards == options.reshard_after_forward, f"{name}: reshard")
        wrapped = [block_wrapping(b) for b in model.layers.values()]
        expect(wrapped == [checkpoint_mode(options)] * blocks, f"apply_ac {wrapped}")
        if tp > 1:
            weight = model.layers["0"].attention.wq.weight
            mesh = weight.device_mesh
            expect("tp" in mesh.mesh_dim_names and mesh["tp"].size() == tp, "TP")
        if layout.cp > 1 and find_spec("torchtitan.distributed.context_parallel"):
            for block in model.layers.values():  # (0.2.1 enters CP per step)
                hooks = block.attention.inner_attention._forward_pre_hooks
                expect(bool(hooks), "CP not applied to an attention")
            out["CP applied by parallelize_llama"] += 1
    out["FSDP units checked"] += len(groups)
    return dict(out)


def kinds(plan, options: TrainingOptions) -> list[str]:
    """What a built plan exercises, for the tally."""
    layout, tp = plan.layout, plan.stages[0].replicas[0].tp
    fsdp = options.zero_stage == 3 and layout.shard_group > 1
    out = ["HSDP" if fsdp and layout.dp_replicate > 1 else "FSDP" if fsdp else
           "unsharded"]  # fmt: skip
    out += ["CP"] * (layout.cp > 1) + ["TP"] * (tp > 1)
    out += ["PP"] * (plan.num_stages > 1) + [options.precision]
    out += [f"recomputation {checkpoint_mode(options)}"] * (options.recompute != "none")
    out += ["no resharding"] * (fsdp and not options.reshard_after_forward)
    return out


def run(num_plans: int, problems: list) -> dict:
    tally, built, reasons, details = Counter(), Counter(), Counter(), Counter()
    for seed in range(num_plans):
        name, plan, options, length = random_case(seed)
        tally["plans checked"] += 1
        expected = expected_refusal(plan, options, length)
        try:
            text = export_plan(plan, "torchtitan", options=options, seq_length=length)
        except ExportRefused as refusal:
            tally["refused by us"] += 1
            if expected is None or expected not in str(refusal):
                problems.append((name, f"refusal unlike the rules ({expected})",
                                 str(refusal)))  # fmt: skip
                continue
            why = confirm(expected, plan, options, length)
            if why:
                tally["refusal confirmed by the real code"] += 1
                reasons[why] += 1
            else:
                problems.append((name, "refusal not confirmed", str(refusal)))
            continue
        if expected is not None:
            problems.append((name, f"exported, the rules refuse ({expected})", ""))
        fsdp = options.zero_stage == 3 and plan.layout.shard_group > 1
        try:
            if fsdp:
                details.update(check_fsdp(plan, text, options, length))
            else:
                details.update(check_torchtitan(plan, text, options, None, length))
        except Mismatch as error:
            tally["silent differences"] += 1
            problems.append((name, "silent difference", str(error)))
        except RealRejects as error:
            tally["exports the real code rejects"] += 1
            problems.append((name, "real code rejects", str(error)))
        else:
            tally["built as planned"] += 1
            built.update(kinds(plan, options))
    tally.setdefault("silent differences", 0)
    return {
        "counts": dict(tally),
        "built_as_planned_with": dict(built),
        "refusals_confirmed_by": dict(reasons),
        "compared": dict(details),
    }


def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "torchtitan", "torchao"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    out["python"] = platform.python_version()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plans", type=int, default=440)
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    started = time.perf_counter()
    problems: list = []
    result = run(ns.plans, problems)
    found = versions()
    out = ns.out or ROOT / "benchmarks" / "results" / (
        f"check_torchtitan_fsdp_{found['torchtitan']}.json"
    )
    data = {
        **stamp.stamp("vm"),
        "versions": found,
        "random_plans": ns.plans,
        **result,
        "problems": [list(p) for p in problems],
        "seconds": round(time.perf_counter() - started, 1),
    }
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: data[k] for k in ("versions", "counts", "seconds")}))
    for problem in problems[:20]:
        print(" | ".join(problem))
    silent = data["counts"].get("silent differences", 0)
    return 1 if silent or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
