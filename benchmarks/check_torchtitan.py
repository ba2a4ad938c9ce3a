"""torchtitan's half of ``check_exports.py``, and the helpers both halves use.

``check_exports.py`` imports this module (the fake process group, from
``fake_process_group.py``; one copy of the error classes and the rank check).
For each torchtitan export (torchtitan v0.2.2, CPU; the torch version is in
the results file):

* ``ConfigManager().parse_args(["--job.config_file", ...])`` reads the TOML
  (its own loader; an unknown key raises); ``ParallelDims`` and its mesh on
  every rank (torch's ``fake`` process group); ``pipeline_module_split`` of a
  small llama3 ``Transformer`` and ``build_pipeline_schedule``: each rank's
  parts, stage indices and micro-batches;
* the recomputation the file names, through torchtitan's ``apply_ac`` on each
  part (``"full"``: every block wrapped), and the precision through
  ``maybe_enable_amp`` (fp32: no autocast, or a float32 one);
* for the knobs (:func:`knob_cases`: ``P`` of 2 to 8, ``V`` of 1 to 4, ``M``
  multiples of ``P`` and not, TP 1 and 2, recomputation none and full, ZB-H1,
  its interleaved form and ZB-V):
  the parts of rank ``r`` are Megatron-LM's chunks (virtual stage ``c P + r``)
  and PyTorch's per-rank actions (``pipeline_order`` without its empty slots)
  are our simulators' orders: ``interleaved_order`` for ``1F1B`` (``V = 1``)
  and ``Interleaved1F1B``, ``zero_bubble_order`` (and the tests' re-statement
  of PyTorch's rule) for ``InterleavedZeroBubble`` with ``V`` of 1 to 4, and
  ``zbv_order`` for ``ZBVZeroBubble`` (its parts placed in a V). For ``1F1B``
  the order compared is ``Schedule1F1B._get_pipeline_order``, PyTorch's
  statement of what its ``_step_microbatches`` runs (``min(M, P - r)``
  forwards, then backward-forward pairs: the same sequence).

Sharded plans (FSDP, HSDP, CP) are checked by ``check_torchtitan_fsdp.py``,
which imports this module.

A refusal of ours is checked against the real code too (:func:`titan_rejects`):
the config the plan would need raises, or torchtitan's own code shows that it
runs something else (``apply_tp``'s plan, ``apply_ac``'s wrapping,
``maybe_enable_amp``'s context, the schedule's rounds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import tempfile
import typing
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_export_knobs as knob_rules  # noqa: E402  (plans, re-stated rules)
import test_export_targets as rules  # noqa: E402
from fake_process_group import fake_rank  # noqa: E402  (re-exported)

from pipedejavu.core.training_options import (  # noqa: E402
    TORCHTITAN_OP,
    TrainingOptions,
)
from pipedejavu.io.export_rules import ExportRefused, num_blocks  # noqa: E402
from pipedejavu.io.export_torchtitan import module_fqns, schedule_name  # noqa: E402
from pipedejavu.io.exports import export_plan  # noqa: E402
from pipedejavu.simulation.interleaved import interleaved_order  # noqa: E402
from pipedejavu.simulation.zero_bubble import (  # noqa: E402
    zbv_order,
    zero_bubble_order,
)


class Mismatch(AssertionError):
    """The real code built something else than the plan: a silent difference."""


class RealRejects(Exception):
    """The real code rejected an export we wrote."""


@contextlib.contextmanager
def silenced():
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Mismatch(what)


def profile_of(plan, stage: int) -> list[int]:
    return list(range(plan.stages[stage].start, plan.stages[stage].stop))


def check_rank_cover(plan, coords: dict[int, tuple[int, int, int]], named) -> None:
    """Every (stage, replica) holds ``tp`` ranks, TP ranks ``0..tp-1``, and a
    rank's named GPU type is its replica's."""
    tp = next(iter({r.tp for s in plan.stages for r in s.replicas}))
    seen = Counter()
    for rank, (stage, replica, tp_rank) in coords.items():
        seen[(stage, replica)] += 1
        expect(0 <= tp_rank < tp, f"rank {rank}: tp rank {tp_rank}")
        if len(plan.gpus_by_type()) > 1:
            gpu = plan.stages[stage].replicas[replica].gpu_type
            expect(
                named.get(rank) == gpu, f"rank {rank}: type {named.get(rank)} != {gpu}"
            )
    expect(
        dict(seen)
        == {(s, j): tp for s in range(plan.num_stages) for j in range(plan.dp)},
        "ranks per replica",
    )


# ------------------------------------------------------------ torchtitan code
def titan_config(text: str | None, overrides: list[str] = ()):
    from torchtitan.config import ConfigManager

    args = list(overrides)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text or "")
    try:
        with silenced():
            return ConfigManager().parse_args(["--job.config_file", f.name, *args])
    finally:
        os.unlink(f.name)


def titan_dims(config, world: int):
    from torchtitan.distributed import ParallelDims

    p = config.parallelism
    return ParallelDims(
        dp_shard=p.data_parallel_shard_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        world_size=world,
    )


def titan_model(blocks: int):
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    args = TransformerModelArgs(dim=16, n_layers=blocks, n_heads=2, vocab_size=32,
                                multiple_of=8, max_seq_len=16)  # fmt: skip
    return Transformer(args)


def checkpoint_mode(options: TrainingOptions) -> str:
    """The ``[activation_checkpoint] mode`` a plan's recomputation needs
    (``"selective"``: torchtitan's op policy)."""
    if options.recompute == "none":
        return "none"
    return "selective" if options.selective_modules == (TORCHTITAN_OP,) else "full"


def block_wrapping(block) -> str:
    """How ``apply_ac`` wrapped a block: ``"none"``, ``"full"`` (a checkpoint
    without a policy) or ``"selective"`` (with a policy's ``context_fn``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
    )

    if not isinstance(block, CheckpointWrapper):
        return "none"
    keywords = getattr(block.checkpoint_fn, "keywords", {})
    return "selective" if "context_fn" in keywords else "full"


def wrapped_blocks(part, ac_config, policy: bool = False) -> list:
    """Which transformer blocks of ``part`` torchtitan's ``apply_ac`` wraps
    (``policy``: how, :func:`block_wrapping`)."""
    from torchtitan.distributed import activation_checkpoint as ac

    ac._layer_sac_count = 0  # its per-process count of wrapped blocks
    with silenced():
        ac.apply_ac(part, ac_config)
    how = [block_wrapping(b) for b in part.layers.values()]
    return how if policy else [h != "none" for h in how]


def amp_is_fp32(dims, config) -> bool:
    """``maybe_enable_amp`` runs no autocast, or a float32 one."""
    from torchtitan.distributed.utils import maybe_enable_amp

    context = maybe_enable_amp(dims, config.training.mixed_precision_param, "cuda")
    if isinstance(context, contextlib.nullcontext):
        return True
    return context.fast_dtype == torch.float32


def megatron_part(plan, chunks: int, k: int) -> list[int]:
    """Profile layers of Megatron-LM's virtual stage ``k`` (``--num-layers-per-
    virtual-pipeline-stage``: the transformer layers in ``P V`` equal chunks,
    the embedding before the first, the head after the last)."""
    last, parts = plan.num_layers - 1, plan.num_stages * chunks
    size = (last - 1) // parts
    layers = list(range(1 + k * size, 1 + (k + 1) * size))
    return ([0] if k == 0 else []) + layers + ([last] if k == parts - 1 else [])


def our_order(schedule: str, rank: int, ranks: int, chunks: int, count: int):
    """Our simulators' order as ``(kind, chunk, micro-batch)``."""
    if schedule == "ZBVZeroBubble":
        ops = zbv_order(rank, ranks, count)
        return [("FBW"[o.backward + o.weight], o.chunk, o.microbatch) for o in ops]
    if schedule in ("1F1B", "Interleaved1F1B"):
        ops = interleaved_order(rank, ranks, chunks, count)
        return [("B" if op.backward else "F", op.chunk, op.microbatch) for op in ops]
    order = knob_rules.pytorch_order(rank, ranks, chunks, count, True)
    ops = zero_bubble_order(rank, ranks, count, chunks)
    real = [("FBW"[o.backward + o.weight], o.chunk, o.microbatch) for o in ops]
    expect(real == order, f"zero_bubble_order rank {rank} differs from its rule")
    return real


def runtime_1f1b(rank: int, ranks: int, count: int):
    """``Schedule1F1B._step_microbatches``' order (module docstring)."""
    warmup = min(count, ranks - rank)
    order = [("F", 0, b) for b in range(warmup)]
    for b in range(count):
        order.append(("B", 0, b))
        if warmup < count:
            order.append(("F", 0, warmup))
            warmup += 1
    return order


def pytorch_order(schedule, rank: int, ranks: int):
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    v_shape = type(schedule).__name__ == "ScheduleZBVZeroBubble"
    out = []
    for action in schedule.pipeline_order[rank]:
        if action is None or action.computation_type.value not in kinds:
            continue  # empty slots, gradient reductions
        kind = kinds[action.computation_type.value]
        if v_shape:  # chunk 0: stage r, chunk 1: stage 2 P - 1 - r
            chunk = int(action.stage_index != rank)
            expect(action.stage_index in (rank, 2 * ranks - 1 - rank), "V stage")
        else:
            chunk = action.stage_index // ranks
            expect(action.stage_index % ranks == rank, f"rank {rank} runs {action}")
        out.append((kind, chunk, action.microbatch_index))
    return out


def compare_orders(schedule, par, ranks: int, chunks: int) -> Counter:
    """Every rank's order in PyTorch's schedule against ours."""
    name, count = par.pipeline_parallel_schedule, schedule._n_microbatches
    out = Counter()
    for rank in range(ranks):
        ours = our_order(name, rank, ranks, chunks, count)
        stated = pytorch_order(schedule, rank, ranks)
        if name == "1F1B":
            runs = runtime_1f1b(rank, ranks, count)
            expect(runs == ours, f"rank {rank}: Schedule1F1B's order differs")
            if stated != ours:
                out["1F1B pipeline_order (not run) differs"] += 1
        else:
            expect(stated == ours, f"rank {rank}: PyTorch's order differs")
        out[name] += 1
    return out


def check_torchtitan(
    plan,
    text: str,
    options: TrainingOptions | None = None,
    spec=None,
    seq_length: int | None = None,
) -> dict:
    """Build the export with torchtitan's code; returns what was compared
    (``spec``: the model, whose blocks it must build; ``seq_length``: the
    length it must train at)."""
    from torchtitan.distributed.pipeline_parallel import (
        build_pipeline_schedule,
        pipeline_module_split,
    )

    options = options or TrainingOptions()
    try:
        config = titan_config(text)
        dims = titan_dims(config, plan.num_gpus)
    except (AssertionError, ValueError, SystemExit) as error:
        raise RealRejects(f"config: {error}") from None
    world, last = plan.num_gpus, plan.num_layers - 1
    blocks = num_blocks(plan, spec)
    training, par = config.training, config.parallelism
    expect(training.dtype == "float32", "training.dtype")
    if seq_length is not None:
        expect(training.seq_len == seq_length, f"seq_len {training.seq_len}")
    mode = checkpoint_mode(options)
    ac_config = config.activation_checkpoint
    expect(ac_config.mode == mode, "activation_checkpoint.mode")
    if mode == "selective":
        expect(ac_config.selective_ac_option == "op", "selective_ac_option")
    # train.py: gradient accumulation over the batch degree.
    degree = dims.dp_replicate * dims.dp_shard
    expect(training.global_batch_size % (training.local_batch_size * degree) == 0,
           "train.py batch assertion")  # fmt: skip
    accumulation = training.global_batch_size // (training.local_batch_size * degree)
    chunks = options.virtual_stages
    model = titan_model(blocks)
    coords, compared = {}, Counter()
    for rank in range(world):
        with fake_rank(rank, world), silenced():
            dims._meshes, dims._world_mesh = {}, None
            dims.build_mesh()
            expect(amp_is_fp32(dims, config), "maybe_enable_amp: not fp32")
            stage = dims.get_mesh("pp").get_local_rank() if dims.pp_enabled else 0
            replica = (
                dims.get_mesh("dp_replicate").get_local_rank()
                if dims.dp_replicate_enabled
                else 0
            )
            tp_rank = dims.get_mesh("tp").get_local_rank() if dims.tp_enabled else 0
            coords[rank] = (stage, replica, tp_rank)
            if dims.dp_replicate_enabled and not dims.fsdp_enabled:
                # parallelize_llama: DDP only as the one parallelism.
                if world != dims.get_mesh("dp_replicate").size():
                    raise RealRejects("parallelize_llama: DDP > 1D")
            if not dims.pp_enabled:
                parts, built = [titan_model(blocks)], list(range(plan.num_layers))
                micro, count = training.local_batch_size, accumulation
                expect(built == profile_of(plan, stage), f"rank {rank} builds {built}")
            else:
                stages, parts = pipeline_module_split(
                    model, dims.get_mesh("pp"), par.pipeline_parallel_schedule,
                    torch.device("cpu"), par.module_fqns_per_model_part,
                )  # fmt: skip
                expect(len(parts) == chunks, f"rank {rank}: {len(parts)} parts")
                for chunk, (pstage, part) in enumerate(zip(stages, parts, strict=True)):
                    index = chunk * plan.num_stages + stage
                    if options.v_shape:  # torchtitan's V style
                        index = 2 * plan.num_stages - 1 - stage if chunk else stage
                    expect(pstage.stage_index == index, f"rank {rank} stage index")
                    built = [0] if part.tok_embeddings is not None else []
                    built += sorted(int(k) + 1 for k in part.layers.keys())
                    if last > blocks + 1:  # the norm a profile layer of its own
                        built += [blocks + 1] if part.norm is not None else []
                        built += [last] if part.output is not None else []
                    elif part.norm is not None and part.output is not None:
                        built.append(last)
                    else:
                        expect(part.norm is None and part.output is None, "norm/head")
                    want = (
                        megatron_part(plan, chunks, index)
                        if chunks > 1
                        else profile_of(plan, stage)
                    )
                    expect(built == want, f"rank {rank} part {chunk} builds {built}")
                try:
                    schedule = build_pipeline_schedule(config, stages, lambda *a: None)
                except ValueError as error:
                    raise RealRejects(f"build_pipeline_schedule: {error}") from None
                name = type(schedule).__name__
                expect(name == "Schedule" + schedule_name(options), name)
                micro = par.pipeline_parallel_microbatch_size
                count = accumulation * schedule._n_microbatches
                if rank == 0:
                    compared.update(compare_orders(schedule, par, plan.num_stages,
                                                   chunks))  # fmt: skip
            if mode != "none":  # every block, with the op policy or without
                for part in parts:
                    wrapped = wrapped_blocks(part, ac_config, policy=True)
                    expect(wrapped == [mode] * len(wrapped), f"apply_ac {mode}")
        expect((micro, count) == (plan.mbs, plan.num_microbatches), "batch")
    check_rank_cover(plan, coords, rules.types_by_rank(text))
    return dict(compared)


# ------------------------------------------------------------------ refusals
def tp_plan_styles() -> dict[str, str]:
    """The style ``apply_tp`` gives each module, recorded by running it with
    ``parallelize_module`` replaced (DTensor needs a GPU)."""
    import torchtitan.models.llama3.infra.parallelize as llama

    styles = {}

    def record(module=None, device_mesh=None, parallelize_plan=None):
        for name, style in parallelize_plan.items():
            styles[name.split(".")[-1]] = type(style).__name__

    saved = llama.parallelize_module
    llama.parallelize_module = record
    try:
        with silenced():
            llama.apply_tp(titan_model(1), None, loss_parallel=True,
                           enable_float8_tensorwise_tp=False)  # fmt: skip
    finally:
        llama.parallelize_module = saved
    return styles


def layer_sac_never_first(blocks: int, first: int) -> bool:
    """No ``selective_ac_option`` of torchtitan's layer-level mode wraps
    exactly the first ``first`` of ``blocks`` blocks."""
    from torchtitan.config.job_config import ActivationCheckpoint

    want = [i < first for i in range(blocks)]
    for every in range(1, blocks + 1):
        config = ActivationCheckpoint(mode="selective", selective_ac_option=str(every))
        if wrapped_blocks(titan_model(blocks), config) == want:
            return False
    return True


def titan_schedule_rejects(plan, tp: int, options: TrainingOptions) -> str:
    """The pipeline config the plan would need, through the real
    ``pipeline_module_split`` and ``build_pipeline_schedule`` on rank 0."""
    from torchtitan.distributed.pipeline_parallel import (
        build_pipeline_schedule,
        pipeline_module_split,
    )

    name, chunks = schedule_name(options), options.virtual_stages
    fqns = ",".join(json.dumps(part) for part in module_fqns(plan, chunks))
    text = (
        f"[training]\nlocal_batch_size = {plan.gbs}\n"
        f"global_batch_size = {plan.gbs}\n[parallelism]\n"
        f"tensor_parallel_degree = {tp}\n"
        f"pipeline_parallel_degree = {plan.num_stages}\n"
        f'pipeline_parallel_schedule = "{name}"\n'
        f"pipeline_parallel_microbatch_size = {plan.mbs}\n"
        f"module_fqns_per_model_part = [{fqns}]\n"
    )
    config = titan_config(text)
    dims = titan_dims(config, plan.num_gpus)
    model = titan_model(plan.num_layers - 2)
    with fake_rank(0, plan.num_gpus), silenced():
        dims.build_mesh()
        stages, _ = pipeline_module_split(
            model, dims.get_mesh("pp"), name, torch.device("cpu"),
            config.parallelism.module_fqns_per_model_part,
        )  # fmt: skip
        try:
            schedule = build_pipeline_schedule(config, stages, lambda *a: None)
        except ValueError:
            return f"Schedule{name}: raises ValueError for the plan's micro-batches"
    rounds = getattr(schedule, "microbatches_per_round", plan.num_stages)
    if rounds != plan.num_stages:
        return f"Schedule{name}: rounds of M / max(1, M // P) micro-batches, not P"
    return ""


def options_rejects(plan, tp: int, options: TrainingOptions) -> str | None:
    """The witness for a refused knob, ``""`` if none, ``None`` if the knobs
    are not why."""
    from torchtitan.config.job_config import ActivationCheckpoint, Optimizer, Training
    from torchtitan.distributed.utils import maybe_enable_amp

    if options.precision == "bf16":
        dims = titan_dims(titan_config(None, [
            "--parallelism.data_parallel_replicate_degree", str(plan.dp),
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.tensor_parallel_degree", str(tp),
            "--parallelism.pipeline_parallel_degree", str(plan.num_stages),
        ]), plan.num_gpus)  # fmt: skip
        context = maybe_enable_amp(dims, "bfloat16", "cuda")
        if isinstance(context, contextlib.nullcontext):
            return "maybe_enable_amp: no mixed precision with TP or PP"
        return "maybe_enable_amp: torch.autocast over fp32 weights"
    if options.precision in ("fp16", "fp8"):
        hints = typing.get_type_hints(Training)
        allowed = typing.get_args(hints["mixed_precision_param"])
        return f"mixed_precision_param only {', '.join(allowed)}"
    if tp > 1 and not options.sequence_parallel:
        styles = tp_plan_styles()
        norms = ("norm", "attention_norm", "ffn_norm")
        if all(styles.get(n) == "SequenceParallel" for n in norms):
            return "apply_tp: SequenceParallel on every norm"
        return ""
    if options.distributed_optimizer and plan.dp > 1:
        fields = [f.name for f in dataclasses.fields(Optimizer)]
        sharded = any("shard" in f or "zero" in f for f in fields)
        return "" if sharded else "Optimizer config: no sharding without FSDP"
    if options.recompute == "selective":
        blocks = 4
        layer = wrapped_blocks(titan_model(blocks), ActivationCheckpoint())
        if layer == [False, True] * (blocks // 2):
            return "apply_ac selective: whole blocks (every 2nd) or an op policy"
        return ""
    limit = options.recompute_num_layers
    if limit is not None:
        most = max(knob_rules.transformer_counts(plan)) // options.virtual_stages
        if limit < most:
            if layer_sac_never_first(most, limit):
                return "apply_ac layer-level: every n-th block, not the first k"
            return ""
    return None


def titan_rejects(plan, options: TrainingOptions | None = None) -> str:
    """Why torchtitan cannot run a plan we refused, as planned, in our
    refusals' order."""
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    options = options or TrainingOptions()
    if len(rules.tps(plan)) > 1:
        return "one tensor_parallel_degree for all stages"
    if plan.gbs % (plan.mbs * plan.dp):
        return "train.py batch assertion"
    tp = next(iter(rules.tps(plan)))
    if plan.dp == 1 or (tp == 1 and plan.num_stages == 1):
        why = options_rejects(plan, tp, options)
        if why is not None:
            return why
        return titan_schedule_rejects(plan, tp, options) if plan.num_stages > 1 else ""
    overrides = [
        "--parallelism.data_parallel_replicate_degree", str(plan.dp),
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(plan.num_stages),
    ]  # fmt: skip
    config = titan_config(None, overrides)
    dims = titan_dims(config, plan.num_gpus)
    with fake_rank(0, plan.num_gpus), silenced():
        dims.build_mesh()
        try:
            parallelize_llama(titan_model(plan.num_layers - 2), dims, config)
        except (RuntimeError, AssertionError) as error:
            # (no GPU: a CUDA build raises RuntimeError, a CPU build asserts)
            if "DDP has not supported" in str(error):
                return "parallelize_llama: DDP has not supported > 1D parallelism"
            # TP cannot be applied without a GPU: test parallelize_llama's
            # DDP condition on the real ParallelDims and mesh instead.
            ddp = dims.dp_replicate_enabled and not dims.fsdp_enabled
            if ddp and dims.world_size != dims.get_mesh("dp_replicate").size():
                return "ParallelDims: DDP beside other parallelism (TP needs a GPU)"
            return ""
    return ""


# --------------------------------------------------------------------- knobs
def knob_cases() -> list[tuple[str, object, TrainingOptions]]:
    """Even plans over the schedules, recomputation and TP, and the knobs
    torchtitan refuses."""
    even = knob_rules.even_plan
    out = []
    for ranks in (2, 3, 4, 8):
        for chunks in (1, 2, 3, 4):
            schedules = [
                TrainingOptions(virtual_stages=chunks),
                TrainingOptions(virtual_stages=chunks, zero_bubble=True),
            ]
            if chunks == 2:
                schedules.append(
                    TrainingOptions(virtual_stages=2, zero_bubble=True, v_shape=True)
                )
            counts = sorted({ranks, 2 * ranks, 3 * ranks, ranks + 1, 2 * ranks + 1})
            for base in schedules:
                for count in counts:
                    for tp, recompute in ((1, "none"), (2, "full"), (1, "full")):
                        options = dataclasses.replace(
                            base, recompute=recompute, sequence_parallel=tp > 1
                        )
                        plan = even(ranks, 2 * chunks, tp=tp, num_microbatches=count)
                        name = f"P {ranks} V {chunks} M {count} tp {tp} {recompute}"
                        if base.zero_bubble:
                            name += " zbv" if base.v_shape else " zb"
                        out.append((name, plan, options))
    refused = [
        (even(2, 4), TrainingOptions(recompute="selective")),
        (even(2, 4), TrainingOptions(recompute="full", recompute_num_layers=2)),
        (even(2, 4, tp=2), TrainingOptions()),
        (even(1, 4, dp=2), TrainingOptions(distributed_optimizer=True)),
        (even(1, 4, dp=2), TrainingOptions("bf16")),
        (even(2, 4), TrainingOptions("bf16")),
        (even(2, 4), TrainingOptions("fp16")),
    ]
    out += [(f"refused {o}", p, o) for p, o in refused]
    return out


def run_knobs(problems: list) -> dict:
    """Every knob case through the exporter and torchtitan's code."""
    tally, reasons, orders = Counter(), Counter(), Counter()
    for name, plan, options in knob_cases():
        tally["plans checked"] += 1
        expected = knob_rules.torchtitan_refusal(plan, options)
        try:
            text = export_plan(plan, "torchtitan", options=options)
        except ExportRefused as refusal:
            tally["refused by us"] += 1
            if expected is None or expected not in str(refusal):
                problems.append(("torchtitan knobs", name, "refusal unlike tests"))
            why = titan_rejects(plan, options)
            if why:
                tally["refusal confirmed by the real code"] += 1
                reasons[why] += 1
            else:
                problems.append(("torchtitan knobs", name, f"unconfirmed: {refusal}"))
            continue
        if expected is not None:
            problems.append(("torchtitan knobs", name, "tests' rules refuse it"))
        try:
            orders.update(check_torchtitan(plan, text, options))
        except Mismatch as error:
            tally["silent differences"] += 1
            problems.append(("torchtitan knobs", name, f"silent difference: {error}"))
        except RealRejects as error:
            tally["exports the real code rejects"] += 1
            problems.append(("torchtitan knobs", name, f"real code rejects: {error}"))
        except Exception as error:  # noqa: BLE001
            tally["exports the real code rejects"] += 1
            problems.append(("torchtitan knobs", name, f"real code: {error!r}"))
        else:
            tally["built as planned"] += 1
    return {
        "counts": dict(tally),
        "refusals_confirmed_by": dict(reasons),
        "rank_orders_equal_ours": dict(orders),
    }
