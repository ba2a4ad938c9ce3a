"""The training knobs travel with the exports, or the export says why not.

Each target's rule is re-stated here from its source, independently of the
exporters (the versions: :mod:`pipedejavu.io.export_torchtitan` and
:mod:`pipedejavu.io.exports`); CI installs none of them, and
``benchmarks/check_exports.py`` runs the real code on the same kinds of plans.

* torchtitan v0.2.2 (commit 73a0e697) on torch 2.14.1:
  ``pipeline_module_split`` gives rank ``r`` the model parts ``r, r + P, ...``
  (``"loop"`` style); ``build_pipeline_schedule`` splits ``local_batch_size``
  into micro-batches of ``pipeline_parallel_microbatch_size``;
  ``Schedule1F1B`` needs ``M >= P``; ``ScheduleInterleaved1F1B`` and
  ``ScheduleInterleavedZeroBubble`` take micro-batches in rounds of ``M /
  max(1, M // P)`` and the latter raises unless that divides ``M``;
  ``apply_ac`` with ``mode = "full"`` wraps every transformer block (the
  default mode, ``"selective"``, every second one); ``maybe_enable_amp`` runs
  ``torch.autocast`` with ``mixed_precision_param`` (default bfloat16) under
  DDP or on one GPU and nothing with TP or PP; ``apply_tp`` always shards the
  norms along the sequence.
* Megatron-LM (megatron-core 0.16.1 ``get_forward_backward_func``) and
  DeepSpeed 0.19.8 (``TrainSchedule``) have no zero-bubble schedule.
* PyTorch's per-rank order (``_get_1f1b_rank_ops`` with the interleaved
  schedules' stage-index rules), re-stated in :func:`pytorch_order` and
  compared with our simulators' orders.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import tomllib

from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.export_rules import ExportRefused
from pipedejavu.io.exports import (
    EXPORTS,
    LAUNCHED_SCHEDULES,
    LAUNCHED_TRAINING,
    export_plan,
)
from pipedejavu.simulation.interleaved import interleaved_order
from pipedejavu.simulation.zero_bubble import zero_bubble_order


def even_plan(num_stages, per_stage, *, tp=1, dp=1, mbs=1, num_microbatches=8):
    """``num_stages`` stages of ``per_stage`` transformer layers; profile layer
    0 is the embedding and the last the head."""
    total = num_stages * per_stage + 2
    bounds = [0] + [1 + s * per_stage for s in range(1, num_stages)] + [total]
    return plan_from_stages(
        [(a, b, tp) for a, b in zip(bounds, bounds[1:], strict=False)],
        gpu_type="B-80", dp=dp, mbs=mbs, gbs=mbs * dp * num_microbatches,
        model="m", gpus_per_node=8, zone="z",
    )  # fmt: skip


def transformer_counts(plan):
    last = plan.num_layers - 1
    return [sum(0 < x < last for x in range(s.start, s.stop)) for s in plan.stages]


# ------------------------------------------------------------ the rules
def torchtitan_refusal(plan, options):
    """The reason torchtitan cannot run ``plan`` as priced, or ``None``."""
    tp = plan.stages[0].replicas[0].tp
    pp, count = plan.num_stages, plan.num_microbatches
    chunks = options.virtual_stages
    if plan.dp > 1 and (tp > 1 or pp > 1):
        return "FSDP/HSDP"
    if options.precision != "fp32":
        return "bf16" if options.precision == "bf16" else options.precision
    if tp > 1 and not options.sequence_parallel:
        return "without sequence parallelism"
    if options.distributed_optimizer and plan.dp > 1:
        return "optimizer state only with FSDP"
    counts = transformer_counts(plan)
    if chunks > 1 and (pp < 2 or len(set(counts)) > 1 or counts[0] % chunks):
        return "Interleaved1F1B runs Megatron-LM's chunks"
    if options.recompute == "selective":
        return "selective recomputation"
    limit = options.recompute_num_layers
    if limit is not None and limit < max(counts) // chunks:
        return f"not the first {limit} of each chunk"
    if pp == 1:
        return None
    if options.zero_bubble and chunks == 1:
        rounds = max(1, count // pp)
        return None if count % rounds == 0 else "multiple of max(1, M // P)"
    if options.v_shape:  # ScheduleZBVZeroBubble: any M
        return None
    if chunks > 1:  # (our orders: Megatron-LM's rounds of P micro-batches)
        return None if count % pp == 0 else "multiple of the"
    return None if count >= pp else "at least as many micro-batches"


def check_torchtitan(plan, options, text):
    """The fragment, parsed back, builds the plan with its knobs."""
    config = tomllib.loads(text)
    training, par = config["training"], config["parallelism"]
    assert (training["dtype"], training["mixed_precision_param"]) == (
        "float32",
        "float32",
    )
    mode = "none" if options.recompute == "none" else "full"
    assert config["activation_checkpoint"] == {"mode": mode}
    pp, tp = par["pipeline_parallel_degree"], par["tensor_parallel_degree"]
    assert (pp, tp, par["data_parallel_replicate_degree"]) == (
        plan.num_stages,
        plan.stages[0].replicas[0].tp,
        plan.dp,
    )
    assert par["data_parallel_shard_degree"] == 1
    accumulation, rest = divmod(
        training["global_batch_size"], training["local_batch_size"] * plan.dp
    )
    assert rest == 0
    if pp == 1:
        assert "pipeline_parallel_schedule" not in par
        assert (training["local_batch_size"], accumulation) == (
            plan.mbs,
            plan.num_microbatches,
        )
        return
    micro = par["pipeline_parallel_microbatch_size"]
    per_step, rest = divmod(training["local_batch_size"], micro)
    assert rest == 0 and (micro, per_step * accumulation) == (
        plan.mbs,
        plan.num_microbatches,
    )
    chunks = options.virtual_stages
    expected = {
        (False, False): "1F1B",
        (True, False): "Interleaved1F1B",
        (False, True): "InterleavedZeroBubble",
        (True, True): "InterleavedZeroBubble",
    }[chunks > 1, options.zero_bubble]
    if options.v_shape:
        expected = "ZBVZeroBubble"
    assert par["pipeline_parallel_schedule"] == expected
    check_parts(plan, chunks, par["module_fqns_per_model_part"], options.v_shape)


def check_parts(plan, chunks, parts, v_shape=False):
    """The parts are the model in order; rank ``r`` (parts ``k`` with ``k mod
    P == r``) holds the plan's stage ``r`` layers (``chunks = 1``) or its
    count of transformer layers in ``chunks`` equal chunks, the embedding on
    rank 0 and the head on rank ``P - 1`` (Megatron-LM's chunks); with
    ``v_shape`` (torchtitan's V style) rank ``r`` holds parts ``r`` and ``2 P
    - 1 - r``, the embedding and the head both on rank 0."""
    last = plan.num_layers - 1
    pp = plan.num_stages
    assert len(parts) == pp * chunks
    profile = []
    for names in parts:
        layers = []
        for name in names:
            if name == "tok_embeddings":
                layers.append(0)
            elif name == "norm":
                assert names[-2:] == ["norm", "output"]
                layers.append(last)
            elif name != "output":
                layers.append(int(name.removeprefix("layers.")) + 1)
        profile.append(layers)
    assert [x for layers in profile for x in layers] == list(range(plan.num_layers))
    counts = transformer_counts(plan)
    for rank in range(pp):
        mine = [profile[k] for k in range(rank, pp * chunks, pp)]
        if v_shape:
            mine = [profile[rank], profile[2 * pp - 1 - rank]]
        if chunks == 1:
            assert mine == [
                list(range(plan.stages[rank].start, plan.stages[rank].stop))
            ]
            continue
        for layers in mine:
            assert sum(0 < x < last for x in layers) == counts[rank] // chunks
        held = {x for layers in mine for x in layers}
        end = 0 if v_shape else pp - 1
        assert (0 in held) == (rank == 0) and (last in held) == (rank == end)


# ----------------------------------------------------------- torchtitan knobs
KNOBS = [
    TrainingOptions(),
    TrainingOptions(recompute="full"),
    TrainingOptions(sequence_parallel=True, recompute="full"),
    TrainingOptions(sequence_parallel=True, virtual_stages=2),
    TrainingOptions(sequence_parallel=True, virtual_stages=4, recompute="full"),
    TrainingOptions(virtual_stages=3),
    TrainingOptions(zero_bubble=True),
    TrainingOptions(zero_bubble=True, sequence_parallel=True, recompute="full"),
    TrainingOptions(zero_bubble=True, virtual_stages=2),
    TrainingOptions(zero_bubble=True, virtual_stages=3, recompute="full"),
    TrainingOptions(zero_bubble=True, virtual_stages=2, v_shape=True),
    TrainingOptions(
        zero_bubble=True,
        virtual_stages=2,
        v_shape=True,
        recompute="full",
        sequence_parallel=True,
    ),
    TrainingOptions(recompute="full", recompute_num_layers=4),
    TrainingOptions(recompute="full", recompute_num_layers=2, virtual_stages=2),
    TrainingOptions(recompute="selective"),
    TrainingOptions("bf16"),
    TrainingOptions("fp16"),
    TrainingOptions("fp8"),
    TrainingOptions(distributed_optimizer=True),
]
#: stages, TP, DP, micro-batches, transformer layers per stage.
SHAPES = list(
    itertools.product((1, 2, 3, 4, 8), (1, 2), (1, 2), (1, 3, 4, 6, 8, 9, 16), (4, 12))
)


@pytest.mark.parametrize("options", KNOBS, ids=str)
def test_torchtitan_carries_the_knobs_or_says_why_not(options):
    outcomes = set()
    for pp, tp, dp, count, per_stage in SHAPES:
        plan = even_plan(pp, per_stage, tp=tp, dp=dp, num_microbatches=count)
        reason = torchtitan_refusal(plan, options)
        try:
            text = export_plan(plan, "torchtitan", options=options)
        except ExportRefused as refusal:
            message = str(refusal)
            assert reason is not None, f"refused a plan it runs: {message}"
            assert "\n" not in message and reason in message, (reason, message)
            assert message.startswith("cannot export this plan to torchtitan: ")
            outcomes.add("refused")
            continue
        assert reason is None, f"exported a plan it cannot run ({reason})"
        check_torchtitan(plan, options, text)
        outcomes.add("built")
    plain = options.precision == "fp32" and options.recompute != "selective"
    assert outcomes == ({"built", "refused"} if plain else {"refused"})


def test_uneven_stages_keep_their_layers():
    plan = plan_from_stages(
        [(0, 2, 1), (2, 9, 1), (9, 11, 1)], gpu_type="B-80", dp=1, mbs=2,
        gbs=12, model="m", gpus_per_node=8, zone="z",
    )  # fmt: skip
    for options in (TrainingOptions(), TrainingOptions(zero_bubble=True)):
        check_torchtitan(
            plan, options, export_plan(plan, "torchtitan", options=options)
        )


def test_options_that_change_nothing_change_nothing():
    """At TP 1 sequence parallelism, at DP 1 the distributed optimizer and at
    one stage zero bubble (F, B, W per micro-batch is the whole backward) run
    as without them; ``recompute_num_layers`` covering every chunk is full."""
    plan = even_plan(2, 4)
    plain = export_plan(plan, "torchtitan")
    for options in (
        TrainingOptions(sequence_parallel=True),
        TrainingOptions(distributed_optimizer=True),
    ):
        assert export_plan(plan, "torchtitan", options=options) == plain
    full = export_plan(plan, "torchtitan", options=TrainingOptions(recompute="full"))
    layers = TrainingOptions(recompute="full", recompute_num_layers=4)
    assert export_plan(plan, "torchtitan", options=layers) == full
    one = even_plan(1, 4)
    zero_bubble = TrainingOptions(zero_bubble=True)
    assert export_plan(one, "torchtitan", options=zero_bubble) == export_plan(
        one, "torchtitan"
    )


# ------------------------------------------------------ zero bubble elsewhere
HOSTS = {"B-80": 8}
ZERO_BUBBLE = TrainingOptions(zero_bubble=True)


ZB_H1_TARGETS = [t for t in EXPORTS if "zb-h1" in LAUNCHED_SCHEDULES[t]]


@pytest.mark.parametrize("target", [t for t in EXPORTS if t not in ZB_H1_TARGETS])
def test_zero_bubble_is_refused_where_no_schedule_runs_it(target):
    plan = even_plan(2, 4)
    with pytest.raises(ExportRefused) as refusal:
        export_plan(plan, target, gpus_per_node=HOSTS, options=ZERO_BUBBLE)
    message = str(refusal.value)
    assert "\n" not in message
    if target in ("megatron", "deepspeed"):
        assert "no zero-bubble schedule" in message
    else:
        assert "schedule settings" in message
    assert message.endswith("--export megatron-deepspeed, torchtitan can launch it")
    if target != "alpa":  # two GPUs do not fill its hosts
        assert export_plan(plan, target, gpus_per_node=HOSTS).strip()


# ------------------------------------------------------------ PyTorch's order
def pytorch_order(rank, num_ranks, num_chunks, num_microbatches, zero_bubble):
    """Rank ``rank``'s actions ``(kind, chunk, microbatch)`` under PyTorch's
    ``ScheduleInterleaved1F1B`` (``zero_bubble`` False) or
    ``ScheduleInterleavedZeroBubble`` with ``num_chunks`` local stages,
    without its empty slots; ``kind`` is ``F``, ``B`` (the full backward, or
    the input gradient with ``zero_bubble``) or ``W``."""
    ranks, count = num_ranks, num_microbatches
    per_round = count // max(1, count // ranks)
    total = num_chunks * count
    hops = 1 if zero_bubble else 2  # forwards added per rank before the last
    warmup = min((num_chunks - 1) * per_round + hops * (ranks - 1 - rank), total)
    done = {"F": [0] * num_chunks, "B": [0] * num_chunks, "W": [0] * num_chunks}
    order, backward_steps = [], []

    def run(kind, chunk):
        order.append((kind, chunk, done[kind][chunk]))
        done[kind][chunk] += 1

    def forward_chunk(step):
        return (step // per_round) % num_chunks

    def backward_chunk(step):
        return num_chunks - 1 - ((step - warmup) // per_round) % num_chunks

    for step in range(total + warmup):  # warm-up, steady, cool-down
        if step < total:
            run("F", forward_chunk(step))
        if step >= warmup:
            run("B", backward_chunk(step))
            backward_steps.append(step)
            if zero_bubble and step - warmup >= rank:
                run("W", backward_chunk(backward_steps[sum(done["W"])]))
    while zero_bubble and sum(done["W"]) < len(backward_steps):
        run("W", backward_chunk(backward_steps[sum(done["W"])]))
    return order


def ours(ops):
    return [("FBW"[op.backward + getattr(op, "weight", False)], op.chunk, op.microbatch)
            for op in ops]  # fmt: skip


#: Our interleaved order ``(rank, ranks, chunks, micro-batches)`` that
#: PyTorch's ``ScheduleInterleaved1F1B`` (False: Megatron's) and
#: ``ScheduleInterleavedZeroBubble`` (True) run.
OUR_INTERLEAVED = {
    False: interleaved_order,
    True: lambda rank, ranks, chunks, count: zero_bubble_order(
        rank, ranks, count, chunks
    ),
}


@pytest.mark.parametrize("zero_bubble", [False, True], ids=["megatron", "zero-bubble"])
@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("num_chunks", [2, 3, 4])
def test_pytorch_interleaved_orders_are_ours(num_ranks, num_chunks, zero_bubble):
    for rounds in (1, 2, 3):
        count = rounds * num_ranks
        for rank in range(num_ranks):
            theirs = pytorch_order(rank, num_ranks, num_chunks, count, zero_bubble)
            mine = OUR_INTERLEAVED[zero_bubble](rank, num_ranks, num_chunks, count)
            assert theirs == ours(mine)


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
def test_pytorch_zero_bubble_order_is_zb_h1(num_ranks):
    for count in range(1, 3 * num_ranks + 2):
        for rank in range(num_ranks):
            theirs = pytorch_order(rank, num_ranks, 1, count, True)
            assert theirs == ours(zero_bubble_order(rank, num_ranks, count))


@pytest.mark.parametrize("target", EXPORTS)
def test_launched_schedules_are_what_the_exports_accept(target):
    """The schedules a target launches (what ``plan --export`` searches) are
    those its export accepts on a plan every target can otherwise run."""
    plan = even_plan(2, 4)
    accepted = set()
    for schedule, options in (
        ("1f1b", TrainingOptions()),
        ("interleaved", TrainingOptions(virtual_stages=2)),
        ("zb-h1", TrainingOptions(zero_bubble=True)),
        ("interleaved-zb", TrainingOptions(zero_bubble=True, virtual_stages=2)),
        ("zbv", TrainingOptions(zero_bubble=True, virtual_stages=2, v_shape=True)),
    ):
        try:
            export_plan(plan, target, gpus_per_node={"B-80": 2}, options=options)
        except ExportRefused:
            continue
        accepted.add(schedule)
    assert accepted == set(LAUNCHED_SCHEDULES[target])


@pytest.mark.parametrize("target", EXPORTS)
def test_launched_training_is_what_the_exports_accept(target):
    """The precisions, recomputation modes, sequence parallelism and optimizer
    sharding a target launches (what ``plan --export`` searches) are those its
    export accepts, one knob varied from the target's own first values: on a
    TP 2 pipeline (sequence parallelism matters there) and, for the
    optimizer, on plain data parallelism over 2 replicas."""
    launched = LAUNCHED_TRAINING[target]
    base = TrainingOptions(
        precision=launched["precision"][0],
        recompute=launched["recompute"][0],
        sequence_parallel=launched["sequence_parallel"][0],
        distributed_optimizer=launched["distributed_optimizer"][0],
    )
    values = {
        "precision": ("fp32", "fp16", "bf16", "fp8"),
        "recompute": ("none", "selective", "full"),
        "sequence_parallel": (True, False),
        "distributed_optimizer": (True, False),
        "overlap_grad_reduce": (True, False),
        "overlap_param_gather": (True, False),
        "grad_reduce_in_bf16": (True, False),
        "tp_comm_overlap": (True, False),
    }
    for knob, candidates in values.items():
        if knob in ("distributed_optimizer", "overlap_grad_reduce"):
            plan = even_plan(1, 4, dp=2)
        else:
            plan = even_plan(2, 4, tp=2)
        accepted = set()
        for value in candidates:
            changes = {knob: value}
            if knob == "overlap_param_gather":  # needs the grad overlap
                changes["overlap_grad_reduce"] = value
            if knob == "tp_comm_overlap":  # needs sequence parallelism
                changes["sequence_parallel"] = value or base.sequence_parallel
            if knob == "grad_reduce_in_bf16" and "bf16" in launched["precision"]:
                changes["precision"] = "bf16"  # bf16 gradients need bf16
            try:
                options = dataclasses.replace(base, **changes)
            except ValueError:  # no such training (e.g. no optimizer sharding)
                continue
            try:
                # one host of the plan's GPUs (Alpa's mesh takes whole hosts)
                hosts = {"B-80": sum(s.num_gpus for s in plan.stages)}
                export_plan(plan, target, gpus_per_node=hosts, options=options)
            except ExportRefused:
                continue
            accepted.add(value)
        assert accepted == set(launched[knob]), knob


def test_the_sequence_length_and_precision_reach_the_launchers():
    """The tokens per sample a plan was priced at go where each launcher takes
    them (without, torchtitan trains 2,048-token samples and Megatron-LM the
    script's own length); Megatron-DeepSpeed's arguments name the precision
    too (GPTModelPipe's layer list and the model's dtype follow it)."""
    plan = even_plan(2, 4)
    text = export_plan(plan, "megatron", seq_length=8192)
    assert " --seq-length 8192 " in text.splitlines()[-1]
    unknown = export_plan(plan, "megatron")
    assert "--seq-length" not in unknown.splitlines()[-1]
    assert "# --seq-length: the length the plan was priced at is not known" in unknown
    config = tomllib.loads(export_plan(plan, "torchtitan", seq_length=8192))
    assert config["training"]["seq_len"] == 8192
    unknown = export_plan(plan, "torchtitan")
    assert "seq_len" not in tomllib.loads(unknown)["training"]
    assert "# seq_len: the length the plan was priced at is not known" in unknown
    for precision in ("fp32", "fp16", "bf16"):
        options = TrainingOptions(precision)
        data = json.loads(
            export_plan(plan, "megatron-deepspeed", options=options, seq_length=4096)
        )
        args = data["arguments"]
        assert args[-3:] == ["--deepspeed", "--deepspeed_config", "ds_config.json"]
        assert args[args.index("--seq-length") + 1] == "4096"
        assert (f"--{precision}" in args) == (precision != "fp32")
        assert (precision in data["ds_config"]) == (precision != "fp32")
        assert data["seq_length"] == 4096  # stated beside the arguments too
    # The files without a length field state it for the user (issue 43).
    hosts = {"B-80": 2}
    for target in ("deepspeed", "alpa", "sailor"):
        text = export_plan(plan, target, gpus_per_node=hosts, seq_length=4096)
        assert json.loads(text)["seq_length"] == 4096
        text = export_plan(plan, target, gpus_per_node=hosts)
        assert json.loads(text)["seq_length"] is None


# ------------------------------------------------- Megatron-DeepSpeed's ZB-H1
def megatron_deepspeed_zbh1_order(stage, stages, micro_batches):
    """Stage ``stage``'s compute under Megatron-DeepSpeed's
    ``ZeroBubbleH1Pipeline.steps`` with ``--enable-zbh1-exact-semantics``
    (``megatron/core/pipeline_parallel/deepspeed_zbh1_schedule.py`` at
    f4157bea), re-stated: ``ForwardPass`` is ``F``; ``BackwardOnlyPass`` a
    ``B`` that stores its linear layers' weight gradients
    (``WeightGradStore.flush``); ``WeightPass`` the ``W`` of the oldest stored
    one (``WeightGradStore.pop``); the first stage's ``BackwardPass`` a ``B``
    with its own ``W`` at once."""
    first, count = stage == 0, micro_batches
    done = {"F": 0, "B": 0, "W": 0}
    order, stored = [], []

    def forward():
        order.append(("F", 0, done["F"]))
        done["F"] += 1

    def backward(weight_now):
        order.append(("B", 0, done["B"]))
        if weight_now:
            order.append(("W", 0, done["B"]))
        else:
            stored.append(done["B"])
        done["B"] += 1

    def weight():
        order.append(("W", 0, stored.pop(0)))

    for _ in range(stages - stage - 1):  # F section
        if done["F"] < count:
            forward()
    for _ in range(stage):  # FB section
        if done["F"] < count:
            forward()
            backward(first)
    while done["F"] < count:  # FBW section
        forward()
        done["W"] += 1
        backward(first)
        if not first:
            weight()
    while done["B"] < count:  # BW section
        done["W"] += 1
        backward(first)
        if not first:
            weight()
    while done["W"] < count:  # W section
        done["W"] += 1
        weight()
    return order


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 8])
def test_megatron_deepspeed_zbh1_is_our_order(num_ranks):
    """Its exact-semantics ZB-H1 is our ZB-H1 order exactly when ``M = 1`` or
    ``M >= P - 1`` (with ``1 < M < P - 1`` its sections skip and each ``W``
    follows its ``B``), and the export runs it exactly then:
    ``--enable-zbh1-pipeline --enable-zbh1-exact-semantics``."""
    for count in range(1, 3 * num_ranks + 2):
        same = all(
            megatron_deepspeed_zbh1_order(rank, num_ranks, count)
            == ours(zero_bubble_order(rank, num_ranks, count))
            for rank in range(num_ranks)
        )
        assert same == (count == 1 or count >= num_ranks - 1), count
        plan = even_plan(num_ranks, 2, num_microbatches=count)
        try:
            data = json.loads(
                export_plan(plan, "megatron-deepspeed", options=ZERO_BUBBLE)
            )
        except ExportRefused as refusal:
            assert not same and "at least P - 1" in str(refusal), refusal
            continue
        assert same
        args = data["arguments"]
        assert "--enable-zbh1-pipeline" in args
        assert "--enable-zbh1-exact-semantics" in args
        assert args.index("--enable-zbh1-pipeline") < args.index("--deepspeed")
