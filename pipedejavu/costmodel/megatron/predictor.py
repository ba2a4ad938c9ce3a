"""Predict a Megatron/DeepSpeed 3D plan's iteration time and peak memory per GPU.

Inputs: a :class:`~pipedejavu.core.plan3d.Plan3D` and a cost source (profiles,
:class:`~pipedejavu.costmodel.megatron.sailor_data.SailorData`, or the analytical
model). The base case (fp32, ZeRO off, DeepSpeed's pipeline engine):

**Time** of one iteration (what ``train_batch`` takes):

1. *Layers.* A stage's forward (backward) per micro-batch is the sum of its
   layers' forward (backward) times at the plan's (mbs, tp) on its GPU type, from
   the profile made affine in mbs (:func:`~pipedejavu.costmodel.megatron.sailor_data.
   smooth_profile`: single small-mbs entries are noisy), plus ``op_overhead_s``
   for the instruction itself (fitted).
2. *Pipeline.* Every pipeline ``j`` (replica ``j`` of each stage) runs DeepSpeed's
   1F1B ``TrainSchedule`` on the discrete-event simulator
   (``schedule="deepspeed"``: warm-up, steady state, cool-down in DeepSpeed's
   command order). Each boundary moves the output activation of the stage's last
   layer (fp32, ``mbs x`` the profile's mbs-1 size) forward and its gradient back,
   priced by :func:`~pipedejavu.costmodel.megatron.comm.p2p_time` (fitted link,
   size-dependent bandwidth, GPUs taking part, the receiver's TP all-gather).
   A message of more than ``buffered_message_bytes`` per GPU (NCCL's 4 MiB
   buffer) is a rendezvous that keeps both stages busy; a smaller one is handed
   to the library at once and only its receiver waits for it.
3. *Tied embedding.* With more than one stage, the word-embedding gradient
   (:meth:`ModelInfo.tied_params`) is all-reduced between the first and last
   stage of every pipeline once both have finished their last backward.
4. *Data parallelism.* Then each stage's gradients are all-reduced over its
   ``dp`` replicas, starting when the slowest replica is ready (not overlapped
   with the backward pass, unless the options overlap it as Megatron-LM's
   ``--overlap-grad-reduce``/``--overlap-param-gather`` do:
   :func:`~pipedejavu.costmodel.megatron.rules.gradient_sync`): DeepSpeed's
   buckets (whole layers added until a bucket holds more than 5e8 elements),
   one ring all-reduce per bucket.
5. *Optimizer.* Adam is memory-bound, so its step scales with the parameters it
   updates: ``update_s x stage parameters / profiling-model parameters``, where
   ``update_s`` (median over mbs) is the profile's optimizer time for its
   two-transformer-layer model (embedding, two layers, head; the tied embedding
   counted once).
6. The iteration ends when the last GPU finishes its optimizer step (the loss
   broadcast at the end of ``train_batch`` synchronizes the pipeline).

**Memory** per GPU (device level, as ``nvidia-smi`` reports it):
``16 B x parameters`` (fp32 weights, gradients, Adam's two moments) + ``4 B x``
the largest all-reduce bucket (DeepSpeed flattens a bucket into a new buffer) +
``(1 + activation_overhead) x`` the stashed activations (the simulator's peak
in-flight count times ``mbs x`` the stage's ``act_mem`` plus its received input)
+ ``reserve_bytes`` of the GPU type (term by term:
:mod:`~pipedejavu.costmodel.megatron.memory_terms`).

Options (mixed precision, recomputation, overlaps) come with the cost source;
ZeRO-3 / FSDP2: :mod:`~pipedejavu.costmodel.megatron.sharding`. Not modelled:
contention between collectives or stages on shared links. Constants:
:class:`PredictorConstants`, fitted by :mod:`pipedejavu.costmodel.megatron.fit`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Sequence

import numpy as np

from pipedejavu.core.plan3d import Plan3D, Stage3D, check_nodes
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.replica import alike, kinds_of, one_by_one
from pipedejavu.costmodel.megatron.comm import node_keys
from pipedejavu.costmodel.megatron.constants import (
    FITTED_CONSTANTS,
    PredictorConstants,
)
from pipedejavu.costmodel.megatron.interleaving import (
    interleaved_pipelines,
    rank_layers,
)
from pipedejavu.costmodel.megatron.long_pipelines import (
    PipelineSummary,
    every_pipeline,
    pipeline_summary,
)
from pipedejavu.costmodel.megatron.memory_terms import memory_terms
from pipedejavu.costmodel.megatron.prediction import Prediction
from pipedejavu.costmodel.megatron.rules import (
    expert_allreduce,
    expert_ring,
    gradient_sync,
    is_blocking,
    memory_bytes,
    message_bytes,
    model_state_bytes,
    optimizer_time,
    p2p_pair,
    rank_expert_params,
    rank_params,
    span_act_mem,
    span_backward,
    stage_allreduce,
    stash_bytes,
    tied_allreduce_time,
)
from pipedejavu.costmodel.megatron.sailor_data import (
    LayerTimes,
    ModelInfo,
    SailorData,
    load_sailor_data,
)
from pipedejavu.costmodel.megatron.sharding import (
    context_shares,
    sharded_passes,
    sharded_schedule,
)
from pipedejavu.costmodel.megatron.stage_recompute import (
    as_layers,
    check_one_chunk,
    stage_recompute_counts,
)
from pipedejavu.costmodel.megatron.zero_bubble import zero_bubble_pipelines
from pipedejavu.simulation.simulate import SimulationResult, simulate
from pipedejavu.simulation.timeline import Bar, timeline_bars

__all__ = ["Prediction", "predict_plan"]


def transfer_kinds(stage: Stage3D) -> list[tuple]:
    """:func:`_kind` of each of a stage's replicas (a row's computed once)."""
    kind = alike(stage.replicas)
    if kind is None:
        return [_kind(replica) for replica in stage.replicas]
    return [_kind(kind)] * len(stage.replicas)


def _kind(replica) -> tuple:
    """What a transfer's price reads of a replica (not its node)."""
    return (replica.gpu_type, replica.tp, replica.zone)


def _check(plan: Plan3D, data: SailorData, model: str) -> ModelInfo:
    info = data.model_info(model)
    if plan.num_layers != info.num_layers:
        raise ProblemError(
            f"the plan covers layers 0..{plan.num_layers - 1} but model {model} has "
            f"{info.num_layers} profile layers (embedding, {info.num_layers - 2} "
            "transformer layers, head)"
        )
    layout = plan.layout  # a stage's replicas share its TP (Plan3D checks)
    ep, etp = info.expert_axes
    for s, axes in enumerate(layout.stages):
        if info.expert_params is None and (axes.ep > 1 or axes.etp is not None):
            raise ProblemError(
                f"stage {s} lays out experts (ep {axes.ep}), but model {model} has none"
            )
        if info.expert_params is not None and (axes.ep, axes.etp) != (ep, etp):
            raise ProblemError(
                f"stage {s} lays out its experts over ep {axes.ep}, etp "
                f"{axes.expert_tp}; the costs are for ep {ep}, etp "
                f"{axes.tp if etp is None else etp}"
            )
    for axes in layout.stages:
        info.check_tp(axes.tp)
    check_nodes(plan, lambda gpu: data.gpu_spec(gpu).gpus_per_node)
    return info


def predict_plan(
    plan: Plan3D,
    data: SailorData | None = None,
    *,
    model: str | None = None,
    constants: PredictorConstants | None = None,
    virtual_stages: int | None = None,
    zero_bubble: bool | None = None,
    stage_layers: Sequence[int | None] | None = None,
    chunk_sizes: Sequence[int] | None = None,
) -> Prediction:
    """Predict a plan's iteration time and memory (module docstring).

    Args:
        plan: the plan; its ``model`` names the profile unless ``model`` does.
        data: the profile folder (``None``: the bundled copy).
        model: the model's profile name (overrides ``plan.model``).
        constants: the free constants (``None``: the fitted
            :data:`pipedejavu.costmodel.megatron.fit.FITTED_CONSTANTS`).
        virtual_stages: model chunks per pipeline rank (``V > 1``: Megatron-LM's
            interleaved 1F1B, :mod:`pipedejavu.costmodel.megatron.interleaving`;
            ``None``: ``data.options.virtual_stages``).
        zero_bubble: the zero-bubble schedule: ZB-H1
            (:mod:`pipedejavu.costmodel.megatron.zero_bubble`), or with
            ``virtual_stages > 1`` its interleaved form
            (:func:`~pipedejavu.costmodel.megatron.interleaving.interleaved_pipelines`;
            ``None``: ``data.options.zero_bubble``).
        stage_layers: the blocks each stage reruns (per-stage recomputation,
            :mod:`pipedejavu.costmodel.megatron.stage_recompute`; ``None``:
            as ``data.options`` say). Needs costs that price the reruns
            (options with ``recompute_choices``).
        chunk_sizes: with ``virtual_stages > 1``, the transformer layers of
            each virtual stage (a layout's; ``None``: the even split;
            :func:`~pipedejavu.costmodel.megatron.interleaving.chunk_layers`).

    Raises:
        ProblemError: the plan does not fit the model, or names a GPU type or an
            (mbs, tp) the profiles lack.
    """
    if constants is None:
        constants = FITTED_CONSTANTS
    data = load_sailor_data() if data is None else data
    model = model or plan.model
    if model is None:
        raise ProblemError("the plan names no model; give one (--model)")
    plan = context_shares(plan, data)  # context parallelism as replicas
    info = _check(plan, data, model)
    network = data.network
    num_stages, dp, count = plan.num_stages, plan.dp, plan.num_microbatches
    mbs = plan.mbs

    if virtual_stages is None:
        virtual_stages = data.options.virtual_stages
    if zero_bubble is None:
        zero_bubble = data.options.zero_bubble
    v_shape = bool(data.options.v_shape)
    if v_shape and (virtual_stages != 2 or not zero_bubble):
        raise ProblemError(
            "ZB-V (v_shape) runs the zero-bubble schedule over 2 chunks per rank, "
            f"not {virtual_stages}{'' if zero_bubble else ' without zero bubble'}"
        )
    spans = rank_layers(plan, v_shape)  # each rank's layers
    check_one_chunk(data.options, virtual_stages)
    if stage_layers is None:
        counts = stage_recompute_counts(plan, data, info, constants, bool(zero_bubble))
    elif data.options.block_recompute and len(stage_layers) == num_stages:
        counts = tuple(stage_layers)
    else:
        raise ProblemError(
            "stage_layers needs costs with per-stage recomputation and one "
            f"count per stage ({num_stages}), got {list(stage_layers)}"
        )

    # The replicas a sharded state is split over (all of dp but with HSDP).
    shard = plan.layout.shard_replicas
    sharded = sharded_schedule(info, virtual_stages, bool(zero_bubble))
    overhead = constants.op_overhead_s
    times: dict[tuple[str, int], LayerTimes] = {}
    forward = np.zeros((num_stages, dp))
    backward = np.zeros((num_stages, dp))
    optimizer = np.zeros((num_stages, dp))
    memory = np.zeros((num_stages, dp))
    model_state = np.zeros((num_stages, dp))
    stash = np.zeros(num_stages)
    limit = np.zeros((num_stages, dp))
    capacity = np.zeros((num_stages, dp))
    nodes = [node_keys(stage.replicas, s) for s, stage in enumerate(plan.stages)]
    for s, stage in enumerate(plan.stages):
        per_kind: dict[tuple[str, int], tuple[float, float, float, float, float]] = {}
        alike_kind = alike(stage.replicas)  # a row: one kind, its row at once
        held_by = stage.replicas if alike_kind is None else [alike_kind]
        kinds = [(r.gpu_type, r.tp) for r in held_by]
        for key in dict.fromkeys(kinds):  # replicas of one kind in a stage agree
            gpu_type, tp = key
            if key not in times:
                times[key] = data.layer_times(
                    model, gpu_type, mbs, tp, smooth=constants.smooth_profiles
                )
            entry = times[key]
            layers = slice(stage.start, stage.stop)
            params = rank_params(info, tp, spans[s])
            experts = rank_expert_params(info, tp, spans[s])
            edp = plan.layout.edp(s) if experts else 1
            gpu = data.gpu_spec(gpu_type)
            per_kind[key] = (
                float(entry.forward[layers].sum()) + overhead,
                span_backward(
                    info, entry, stage.start, stage.stop, as_layers(info, counts, s)
                )
                + overhead,
                optimizer_time(
                    float(entry.update[0]), params, info, tp, shard, experts, edp
                ),
                gpu.memory_bytes,
                gpu.capacity,
            )
        rows = (
            next(iter(per_kind.values()))  # one kind: the row filled at once
            if len(per_kind) == 1
            else np.array([per_kind[key] for key in kinds]).T
        )
        for array, row in zip(
            (forward, backward, optimizer, limit, capacity), rows, strict=True
        ):
            array[s] = row

    # ZeRO-3: each micro-batch's passes gather and reduce-scatter their layers.
    gathered = np.zeros(num_stages)
    if sharded:
        extra_f, extra_b, gathered = sharded_passes(
            plan, info, network, nodes, spans, forward, backward
        )
        forward, backward = forward + extra_f, backward + extra_b

    # Transfers over each boundary, per pipeline.
    activation = np.zeros((max(num_stages - 1, 0), dp))
    gradient = np.zeros_like(activation)
    blocking = np.ones_like(activation, dtype=bool)
    transfers: dict[tuple, tuple[float, float]] = {}
    for s in range(num_stages - 1):
        a_stage, b_stage = plan.stages[s], plan.stages[s + 1]
        pairs = list(zip(nodes[s], nodes[s + 1], strict=True))
        sharing = Counter(pairs)
        # a stage's replicas share its TP degree (_check): one message size
        send_tp, receive_tp = a_stage.replicas[0].tp, b_stage.replicas[0].tp
        nbytes = float(message_bytes(info, send_tp, a_stage.stop - 1, mbs))
        blocking[s, :] = is_blocking(nbytes, send_tp, receive_tp, constants)
        keys = [
            (sender, receiver, nbytes, a == b, sharing[a, b])
            for sender, receiver, (a, b) in zip(
                transfer_kinds(a_stage), transfer_kinds(b_stage), pairs, strict=True
            )
        ]
        for j, key in enumerate(keys):
            if key not in transfers:  # replicas alike move tensors alike
                transfers[key] = p2p_pair(
                    network,
                    a_stage.replicas[j],
                    b_stage.replicas[j],
                    nbytes,
                    same_node=key[3],
                    concurrent=key[4],
                )
        activation[s], gradient[s] = np.array([transfers[key] for key in keys]).T

    interleaved = None
    if virtual_stages > 1:

        def link_time(r: int, j: int, nbytes: float, a_node, b_node) -> float:
            sender = plan.stages[r].replicas[j]
            receiver = plan.stages[(r + 1) % num_stages].replicas[j]
            pair = p2p_pair(
                network,
                sender,
                receiver,
                nbytes,
                same_node=a_node == b_node,
                concurrent=1,
            )
            return max(pair)

        interleaved = interleaved_pipelines(
            plan,
            info,
            virtual_stages,
            times,
            overhead,
            link_time,
            nodes,
            zero_bubble,
            v_shape,
            chunk_sizes,
        )
        forward, backward = interleaved.forward_s, interleaved.backward_s
        activation = gradient = interleaved.transfer_s[:-1]

    zero = None
    if zero_bubble and interleaved is None:
        transfer = np.maximum(activation, gradient)
        zero = zero_bubble_pipelines(plan, times, overhead, forward, backward, transfer)

    if interleaved is None and zero is None:

        def simulated(j: int, m: int) -> SimulationResult:
            return simulate(
                forward[:, j],
                backward[:, j],
                m,
                schedule="deepspeed",
                transfer=activation[:, j],
                gradient_transfer=gradient[:, j],
                blocking=blocking[:, j],
            )

        def run(j: int) -> PipelineSummary:
            def steps(m: int) -> PipelineSummary:
                result = simulated(j, m)
                return PipelineSummary(
                    result.backward_end.max(axis=1),
                    float(result.busy_time.sum()),
                    result.peak_in_flight,
                    None,
                )

            return pipeline_summary(steps, count, num_stages=num_stages)

        ends, busy, peak = every_pipeline(
            run, forward, backward, activation, gradient, blocking
        )
        slowest = int(np.argmax(ends.max(axis=0)))

        def timeline() -> tuple[Bar, ...]:
            return timeline_bars(simulated(slowest, count))

    elif interleaved is not None:
        ends, busy = interleaved.ends, interleaved.busy_s
        peak, timeline = interleaved.peak_in_flight, interleaved.timeline
    else:
        ends, busy, peak = zero.ends, zero.busy_s, zero.peak_in_flight
        timeline = zero.timeline
    pipeline = float(ends.max())
    bubble = 1.0 - busy / (pipeline * num_stages * dp) if pipeline > 0 else 0.0
    bubble = min(max(bubble, 0.0), 1.0)  # -6.7e-16 is rounding, not a bubble

    # Tied embedding all-reduce between the first and last stage of a pipeline
    # (ZB-V: both on rank 0, no all-reduce).
    tied = np.zeros(dp)
    ready = ends.copy()
    if num_stages > 1 and not v_shape:
        rings: dict[tuple, float] = {}
        times_j = []
        for j, (a, b) in enumerate(
            zip(*(one_by_one(plan.stages[k].replicas) for k in (0, -1)), strict=True)
        ):
            nbytes = info.tied_params(a.tp) * info.gradient_bytes
            key = (_kind(a), _kind(b), nodes[0][j] == nodes[-1][j], nbytes)
            if key not in rings:  # the time depends on whether they share a node
                rings[key] = tied_allreduce_time(
                    network, info, a, b, [nodes[0][j], nodes[-1][j]]
                )
            times_j.append(rings[key])
        tied = np.array(times_j)
        ready[0] = ready[-1] = np.maximum(ends[0], ends[-1]) + tied

    # Data-parallel gradient sync per stage (what of it is not overlapped),
    # then the optimizer step.
    allreduce = np.zeros(num_stages)
    finish = np.zeros((num_stages, dp))
    options = data.options
    for s, stage in enumerate(plan.stages):
        tp = stage.replicas[0].tp
        (start, stop), *more = spans[s]
        if sharded:  # reduce-scattered per micro-batch; HSDP: across groups
            group = stage.replicas[::shard]
            collective, largest = stage_allreduce(
                network, info, group, nodes[s][::shard], start, stop, more
            )
            collective /= shard
        else:
            collective, largest = stage_allreduce(
                network, info, stage.replicas, nodes[s], start, stop, more
            )
        held = rank_params(info, tp, spans[s])
        experts, edp = rank_expert_params(info, tp, spans[s]), 1
        if experts:
            edp = plan.layout.edp(s)
            members, ring = expert_ring(plan.layout, s, stage.replicas, nodes[s])
            seconds, biggest = expert_allreduce(
                network, info, tp, members, ring, spans[s]
            )
            collective, largest = collective + seconds, max(largest, biggest)
        allreduce[s] = collective
        if not sharded:
            allreduce[s] = gradient_sync(
                collective,
                held,
                dp,
                float(backward[s].min()),
                float(forward[s].min()),
                options,
            )
        finish[s] = ready[s].max() + allreduce[s] + optimizer[s]
        # Memory of a GPU of each replica.
        act = span_act_mem(
            info, tp, stage.start, stage.stop, as_layers(info, counts, s)
        )
        received = float(info.act_output[tp][stage.start - 1]) if s else 0.0
        stash[s] = stash_bytes(info, act, received, peak[s] * mbs)
        if interleaved is not None:
            stash[s] = interleaved.stash_bytes[s]
        if sharded:  # the gathered layers in place of a flattened bucket
            state = model_state_bytes(info, held, 0.0, shard, experts, edp)
            state += gathered[s]
        else:
            state = model_state_bytes(info, held, largest, shard, experts, edp)
        model_state[s] = state
        used = {
            r.gpu_type: memory_bytes(state, stash[s], constants, r.gpu_type)
            for r in kinds_of(stage.replicas)
        }
        if len(used) == 1:
            memory[s] = next(iter(used.values()))
        else:
            memory[s] = [used[r.gpu_type] for r in stage.replicas]
    iteration = float(finish.max())
    predicted = Prediction(
        iteration_time_s=iteration,
        pipeline_s=pipeline,
        tied_allreduce_s=tied,
        dp_allreduce_s=allreduce,
        optimizer_s=optimizer,
        bubble_fraction=float(bubble),
        stage_forward_s=forward,
        stage_backward_s=backward,
        activation_transfer_s=activation,
        gradient_transfer_s=gradient,
        peak_in_flight=peak,
        memory_bytes=memory,
        memory_limit_bytes=limit,
        memory_capacity_bytes=None if np.array_equal(capacity, limit) else capacity,
        model_state_bytes=model_state,
        activation_bytes=stash,
        num_microbatches=count,
        recompute_stage_layers=counts,
        stage_ready_s=ready.max(axis=1),
        timeline=timeline,
    )
    return dataclasses.replace(
        predicted,
        memory_terms=memory_terms(plan, data, predicted, constants),
        stage_terms=functools.partial(memory_terms, plan, data, predicted, constants),
    )
