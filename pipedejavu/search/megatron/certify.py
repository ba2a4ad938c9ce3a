"""Prove a Megatron-style plan optimal under the predictor itself.

The search (:mod:`pipedejavu.search.megatron.planner`) proves the optimum of the planning
objective (the closed-form pipeline) and re-scores its best plans with the
predictor (:func:`pipedejavu.costmodel.megatron.predictor.predict_plan`, a simulation).
The two can disagree, so the plan with the least *predicted* time might lie
elsewhere. This module closes that gap by a branch and bound on the predictor:

**A lower bound per plan.** For a plan with stages ``s`` over layers
``[a_s, b_s)``, ``B`` micro-batches and the predictor's quantities (module
docstring of :mod:`pipedejavu.costmodel.megatron.predictor`):

* a stage starts its first forward no earlier than the forwards of the stages
  before it took, ``F(a_s)`` (their layers' forward times plus one instruction
  overhead at least; transfers only add), and is then busy ``B x busy_s``
  (its layers' forward and backward plus two overheads per micro-batch;
  blocking transfers only add): its last backward ends at ``>= F(a_s) + B busy_s``;
* the last backward of stage ``s - 1`` follows the gradient of the micro-batch
  whose backward ends last on stage ``s``, so stage 0 ends ``>= F(a_s) + B
  busy_s + G(a_s)`` (``G``: the backward times of the layers before, plus an
  overhead);
* a stage's optimizer step (exact: it depends on its parameters only) and its
  data-parallel all-reduce (at least its least value over every offset the
  stage's replicas can have within a node in Megatron's rank order) follow its
  last backward; the tied-embedding all-reduce only adds.

So ``predicted(plan) >= max_s w(a_s, b_s, tp_s)`` with ``w = max(F + B busy +
tail, F + B busy + G)``. Memory: DeepSpeed's 1F1B warm-up keeps at least
``min(stages after + 1, B)`` micro-batches in flight on a stage at its peak (the
simulator's ``peak_in_flight``; ``tests/test_megatron_certify.py`` checks it), so
a stage whose model state, largest bucket, reserve and that many stashes exceed
its GPU is in no plan that fits.

**Per configuration** (GPU type, mbs, dp, TP, GPUs: the search's space), the
least ``max_s w`` over its chains of stages is a bottleneck path, solved exactly
by a DP over (GPUs used, layers covered). A configuration whose least bound
reaches the incumbent's predicted time holds no better plan. The others are
settled by enumerating their chains whose every stage has ``w`` below the
incumbent (depth first, pruned by the DP's bound on the rest) and predicting
each; a better plan that fits in memory becomes the incumbent. Configurations
are taken in increasing order of bound. When every configuration is settled the
incumbent is the predictor's optimum over the search space (``proven``);
otherwise (``max_plans`` predictions spent) the least bound of the unsettled
configurations is a certified lower bound on every plan's predicted time.

**Mixed GPU types** (``mixed_types``: one mbs, dp and TP degree, a type per
stage). Per (mbs, dp, TP) a coarse DP over (layers covered, stages left per
type, the next stage's type) bounds every vector of stage counts per type
(placements and the previous neighbour taken at their cheapest). A vector
taken off the queue for the first time gets an exact-placement bound
(:class:`_PlacedMix`: with the counts fixed, every stage's ranks follow from
its type and the stages of its type before it) and goes back at that bound;
taken again, its chains are enumerated least bound first and predicted.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.plan3d import DEFAULT_ZONE, Plan3D, Replica
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.comm import p2p_time, ring_hops
from pipedejavu.costmodel.megatron.constants import (
    BYTES_PER_PARAM,
    FLOAT_BYTES,
    PredictorConstants,
)
from pipedejavu.costmodel.megatron.predictor import (
    Prediction,
    predict_plan,
    profiling_params,
)
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import (
    plan_from_mixed_stages,
    plan_from_stages,
    span_allreduce,
    usable_degrees,
)

__all__ = ["PredictedCertificate", "certify_predicted"]


@dataclasses.dataclass(frozen=True, eq=False)
class PredictedCertificate:
    """What the branch and bound on the predictor established.

    Attributes:
        plan: the best plan known (the incumbent, or a better one found).
        prediction: its prediction.
        lower_bound_s: certified lower bound on the predicted iteration time of
            every plan of the search space that fits in memory.
        proven: every configuration settled: ``plan`` is the predictor's
            optimum (``lower_bound_s == prediction.iteration_time_s``).
        configurations: configurations of the search space.
        pruned: configurations settled by their bound alone.
        enumerated: configurations settled by predicting their remaining plans.
        open: configurations left unsettled (prediction budget spent).
        plans_predicted: predictor calls.
        improved: the incumbent was beaten.
        time_s: wall-clock seconds.
    """

    plan: Plan3D
    prediction: Prediction
    lower_bound_s: float
    proven: bool
    configurations: int
    pruned: int
    enumerated: int
    open: int
    plans_predicted: int
    improved: bool
    time_s: float

    @property
    def gap(self) -> float:
        """Certified relative gap of the plan's predicted time."""
        best = self.prediction.iteration_time_s
        return best / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class _Group:
    """Configurations sharing (GPU type, mbs, dp) and a set of TP degrees."""

    gpu: str
    mbs: int
    dp: int
    steps: int
    tps: tuple[int, ...]
    sizes: tuple[int, ...]  # pipeline GPUs (sum of stage TP degrees) allowed


def _groups(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    gbs: int,
    *,
    uniform_tp: bool,
    allow_fewer_gpus: bool,
    mbs_values: tuple[int, ...] | None,
    max_stages: int | None,
) -> list[_Group]:
    """The search space of :func:`pipedejavu.search.megatron.planner.search_megatron`,
    grouped (its ``_configs``, without their bounds)."""
    info = data.model_info(model)
    out = []
    for gpu, count in gpus.items():
        table = data.profile(model, gpu)
        stages_cap = min(info.num_layers, max_stages or info.num_layers)
        for mbs in sorted({m for m, _ in table}):
            if gbs % mbs or (mbs_values is not None and mbs not in mbs_values):
                continue
            tps = usable_degrees(data, model, gpu, mbs, count)
            if not tps:
                continue
            for dp in range(1, count // min(tps) + 1):
                if (gbs // mbs) % dp:
                    continue
                budget = count // dp
                sets = [(t,) for t in tps] if uniform_tp else [tuple(tps)]
                for tp_set in sets:
                    small = min(tp_set)
                    low = small if allow_fewer_gpus else budget
                    high = min(budget, stages_cap * max(tp_set))
                    sizes = tuple(
                        g
                        for g in range(low, high + 1)
                        if not uniform_tp or g % small == 0
                    )
                    usable = tuple(t for t in tp_set if t <= high)
                    if sizes and usable:
                        out.append(
                            _Group(gpu, mbs, dp, gbs // (mbs * dp), usable, sizes)
                        )
    return out


def _pipeline_transfers(
    data: SailorData,
    a: tuple[str, int],
    b: tuple[str, int],
    nbytes: float,
    dp: int,
    first: int,
    second: int,
    memo: dict,
) -> list[tuple[float, float]]:
    """Per pipeline ``j``, (activation, gradient) seconds over the boundary
    from a stage of kind ``a`` whose replicas start at rank ``first`` of its
    type to the next of kind ``b`` starting at rank ``second`` of its type (TP
    innermost, then data: replica ``j`` at ``first + j x tp``). The placement
    fixes whether the two replicas share a node (one type) and how many
    pipelines share their node pair (what ``p2p_time`` reads); ``inf`` where no
    link fit prices it. ``memo``: shared by calls with the same kinds and
    bytes."""
    gpn_a = data.gpu_spec(a[0]).gpus_per_node
    gpn_b = data.gpu_spec(b[0]).gpus_per_node
    nodes = [
        ((first + j * a[1]) // gpn_a, (second + j * b[1]) // gpn_b) for j in range(dp)
    ]
    crowd: dict = {}
    for pair in nodes:
        crowd[pair] = crowd.get(pair, 0) + 1
    out = []
    for pair in nodes:
        key = (a[0] == b[0] and pair[0] == pair[1], crowd[pair])
        if key not in memo:
            sender = Replica(a[0], a[1], zone=DEFAULT_ZONE)
            receiver = Replica(b[0], b[1], zone=DEFAULT_ZONE)
            try:  # (activation: sender -> receiver, gradient: back)
                memo[key] = tuple(
                    p2p_time(
                        data.network, x, y, nbytes, same_node=key[0], concurrent=key[1]
                    )
                    for x, y in ((sender, receiver), (receiver, sender))
                )
            except ProblemError:  # no fit: the predictor cannot price it
                memo[key] = (math.inf, math.inf)
        out.append(memo[key])
    return out


def _blocking_transfers(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kinds: list[tuple[str, int]],
    mbs: int,
    dp: int,
    cache: dict,
) -> tuple[dict, dict, dict]:
    """``(sends, receives, pairs)``: per boundary after layer ``k``
    (``f64[L - 1]``), the least time per micro-batch that a stage of a kind
    ``(gpu, tp)`` spends in the blocking transfers (activation and gradient: a
    rendezvous keeps both stages busy) of that boundary: ``receives[kind]`` as
    the receiver in any of its pipelines, ``sends[kind]`` as the sender in its
    dearest pipeline, ``pairs[(kind, next kind)]`` the same for a known next
    kind. The least is over the other stage's kind and over the placements the
    plans can have: in Megatron's rank order a type's stages start at multiples
    of ``dp x`` the gcd of its degrees within its nodes, the next stage of the
    same type takes the next ranks, a stage of another type sits on nodes of its
    own; each placement fixes, per pipeline, whether the two replicas share a
    node and how many pipelines share their node pair (what ``p2p_time``
    reads). 0 where the message may be buffered; ``inf`` where no link fit
    prices it (no plan the predictor prices has it)."""
    info = data.model_info(model)
    boundaries = info.num_layers - 1
    step = {}  # a type's stages start at multiples of dp x gcd(its degrees)
    for gpu, t in kinds:
        step[gpu] = math.gcd(step.get(gpu, 0), dp * t)

    def offsets(gpu: str) -> list[int]:
        gpn = data.gpu_spec(gpu).gpus_per_node
        return sorted({(m * step[gpu]) % gpn for m in range(gpn)})

    def price(a, b, nbytes) -> tuple[float, float]:
        """(least over placements of the dearest pipeline's transfer, least of
        any pipeline's) from a stage of kind ``a`` to the next of kind ``b``."""
        if a[0] == b[0]:  # the next stage takes the type's next ranks
            combos = [(o, o + dp * a[1]) for o in offsets(a[0])]
        else:  # nodes of their own
            combos = [(o, r) for o in offsets(a[0]) for r in offsets(b[0])]
        memo: dict = {}
        worst = anyone = dear_there = dear_back = math.inf
        for o, r in combos:
            each = _pipeline_transfers(data, a, b, nbytes, dp, o, r, memo)
            both = [x + y for x, y in each]
            if max(both) < math.inf:
                worst = min(worst, max(both))
                anyone = min(anyone, min(both))
                dear_there = min(dear_there, max(x for x, _ in each))
                dear_back = min(dear_back, max(y for _, y in each))
        return worst, anyone, dear_there, dear_back

    def blocked(a: tuple[str, int], b: tuple[str, int], k: int) -> tuple:
        """A stage of kind ``a`` sends to one of kind ``b`` over boundary ``k``."""
        nbytes = float(info.act_output[a[1]][k]) * FLOAT_BYTES * mbs
        key = ("p2p", a, b, nbytes, dp, step[a[0]], step[b[0]])
        if key not in cache:
            cache[key] = price(a, b, nbytes)
        worst, anyone, there, back = cache[key]
        if nbytes / min(a[1], b[1]) <= constants.buffered_message_bytes:
            return 0.0, 0.0, there, back  # buffered: nobody waits in a rendezvous
        return worst, anyone, there, back

    def row(a, b, part: int) -> NDArray[np.float64]:
        return np.array([blocked(a, b, k)[part] for k in range(boundaries)])

    pairs = {(a, b): row(a, b, 0) for a in kinds for b in kinds}
    anyone = {(a, b): row(a, b, 1) for a in kinds for b in kinds}
    links = {(a, b): (row(a, b, 2), row(a, b, 3)) for a in kinds for b in kinds}
    sends = {a: np.min([pairs[(a, b)] for b in kinds], axis=0) for a in kinds}
    receives = {b: np.min([anyone[(a, b)] for a in kinds], axis=0) for b in kinds}
    return sends, receives, pairs, links


def _stage_bounds(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    group: _Group,
    cache: dict | None = None,
) -> dict:
    """``{tp: (w, cap, late, fwd)}`` of the group's GPU type
    (:func:`_kind_bounds`)."""
    kinds = [(group.gpu, t) for t in group.tps]
    out = _kind_bounds(
        data, model, constants, kinds, group.mbs, group.dp, group.steps, cache
    )
    return {t: out[(group.gpu, t)] for t in group.tps}


def _kind_bounds(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kinds: list[tuple[str, int]],
    mbs: int,
    dp: int,
    steps: int,
    cache: dict | None = None,
    *,
    with_sends: bool = True,
    placed: Mapping[str, int] | None = None,
) -> dict:
    """``{(gpu, tp): (w, cap, late, fwd)}``: for a stage of layers ``a..b-1`` of
    each kind (GPU type, TP degree) that stages of a plan may have,
    ``w[a, b]`` the first lower bound of the module docstring (``inf`` off the
    upper triangle), ``cap[a, b]`` how many micro-batches in flight fit in its
    GPUs' memory beside its model state (at most ``B``; ``-1``: not even the
    model state), and the parts of the warm-up bound: ``late - k fwd`` with
    ``k`` forwards before the first backward. The layers before and after a
    stage are counted at the fastest kind. ``placed``: ``{type: rank}`` where a
    type's stage starts (its all-reduce priced there exactly); ``w`` then
    leaves out the blocking transfers on both sides, which the caller adds for
    known neighbours."""
    info = data.model_info(model)
    num_layers = info.num_layers
    overhead = constants.op_overhead_s
    times = {
        (gpu, t): data.layer_times(model, gpu, mbs, t, smooth=constants.smooth_profiles)
        for gpu, t in kinds
    }
    before_f, before_b, after_fb = _layer_bounds(times, overhead)
    starts, ends = np.nonzero(np.triu(np.ones((num_layers, num_layers), dtype=bool)))
    stops = ends + 1
    cache = {} if cache is None else cache  # shared by the groups of one call
    sends, receives, _, links = _blocking_transfers(
        data, model, constants, kinds, mbs, dp, cache
    )
    link_rows = _link_rows(links, before_f, before_b, after_fb, times, steps)
    if not with_sends or placed is not None:  # the caller adds them
        sends = {kind: np.zeros_like(row) for kind, row in sends.items()}
    if placed is not None:
        receives = {kind: np.zeros_like(row) for kind, row in receives.items()}
    out = {}
    for kind in kinds:
        gpu, t = kind
        spec = data.gpu_spec(gpu)
        entry = times[kind]
        layer = np.concatenate([[0.0], np.cumsum(entry.forward + entry.backward)])
        forward = np.concatenate([[0.0], np.cumsum(entry.forward)])
        stage_f = forward[stops] - forward[starts] + overhead
        compute = layer[stops] - layer[starts] + 2 * overhead
        busy = compute.copy()
        busy += np.where(starts > 0, receives[kind][np.maximum(starts - 1, 0)], 0.0)
        busy += np.where(
            stops < num_layers, sends[kind][np.minimum(ends, num_layers - 2)], 0.0
        )
        params = info.params[t]
        pprefix = np.concatenate([[0.0], np.cumsum(params)])
        held = pprefix[stops] - pprefix[starts]
        tied = info.tied_params(t)
        held = held - np.where((starts == 0) & (stops == num_layers), tied, 0.0)
        # The least all-reduce over the offsets the stage can have in a node
        # (or at the one it has).
        spots = None if placed is None else (placed[gpu] % spec.gpus_per_node,)
        key = ("allreduce", gpu, t, dp, spots)
        if key not in cache:
            cache[key] = _least_allreduce(
                data, gpu, t, dp, params, tied, held, starts, ends, spots
            )
        allreduce, largest = cache[key]
        rate = float(entry.update[0]) / profiling_params(info, t)
        tail = allreduce + rate * held
        # How many micro-batches' stashes fit beside the model state.
        act = np.concatenate([[0.0], np.cumsum(info.act_mem[t])]) * FLOAT_BYTES
        received = np.where(
            starts > 0, info.act_output[t][np.maximum(starts - 1, 0)], 0.0
        )
        stash = (act[stops] - act[starts] + received * FLOAT_BYTES) * mbs
        room = (
            spec.memory_bytes
            - BYTES_PER_PARAM * held
            - FLOAT_BYTES * largest
            - constants.reserve(gpu)
        )
        per_microbatch = (1.0 + constants.activation_overhead) * stash
        fits = np.where(
            room < 0,
            -1.0,
            np.floor(room / np.maximum(per_microbatch, 1e-30)),
        )
        head = before_f[starts] + steps * busy
        last = np.maximum(tail, before_b[starts])
        shape = (num_layers + 1, num_layers + 1)
        w, cap = np.full(shape, np.inf), np.full(shape, -1.0)
        late, fwd = np.full(shape, np.inf), np.zeros(shape)
        w[starts, stops] = head + last
        if with_sends:  # the boundary after the stage, least over the next kind
            least = np.min([link_rows[(kind, other)] for other in kinds], axis=0)
            w = np.maximum(w, least[None, :])
        cap[starts, stops] = np.minimum(fits, float(steps))
        # The warm-up bound less k forwards (see _StageBounds.weights).
        late[starts, stops] = (
            before_f[starts] + stage_f + after_fb[stops] + steps * compute + last
        )
        fwd[starts, stops] = stage_f
        out[kind] = (w, cap, late, fwd)
    return out


def _send_rows(
    data: SailorData,
    model: str,
    constants: PredictorConstants,
    kinds: list[tuple[str, int]],
    mbs: int,
    dp: int,
    steps: int,
    cache: dict,
) -> dict:
    """``{(kind, next kind): (add, link)}``, each ``f64[L + 1]`` by the stage's
    stop ``b`` (0 at ``b = L``): ``add``, ``B`` x the least blocking transfer
    time over that boundary, which the stage's busy time gains; ``link``, the
    bound the boundary's link alone gives (:func:`_link_rows`)."""
    _, _, pairs, links = _blocking_transfers(
        data, model, constants, kinds, mbs, dp, cache
    )
    times = {
        (gpu, t): data.layer_times(model, gpu, mbs, t, smooth=constants.smooth_profiles)
        for gpu, t in kinds
    }
    before_f, before_b, after_fb = _layer_bounds(times, constants.op_overhead_s)
    link_rows = _link_rows(links, before_f, before_b, after_fb, times, steps)
    return {
        pair: (steps * np.concatenate([[0.0], row, [0.0]]), link_rows[pair])
        for pair, row in pairs.items()
    }


def _layer_bounds(times: dict, overhead: float) -> tuple:
    """``(before_f, before_b, after_fb)`` by layer index, at the fastest kind:
    the forward (backward) of the layers before, plus an overhead, and the
    forward and backward of the layers from there on."""
    fastest_f = np.min([x.forward for x in times.values()], axis=0)
    fastest_b = np.min([x.backward for x in times.values()], axis=0)
    before_f = np.concatenate([[0.0], np.cumsum(fastest_f)])
    before_b = np.concatenate([[0.0], np.cumsum(fastest_b)])
    before_f[1:] += overhead
    before_b[1:] += overhead
    fastest = np.min([x.forward + x.backward for x in times.values()], axis=0)
    after_fb = np.concatenate([np.cumsum(fastest[::-1])[::-1], [0.0]])
    return before_f, before_b, after_fb


def _link_rows(links, before_f, before_b, after_fb, times, steps) -> dict:
    """``{(kind, next kind): f64[L + 1]}`` by stop ``b``: a bound on the
    predicted time from the boundary's link alone (``inf`` off, 0 at ``b =
    L``). In each direction a pipeline's messages cross one at a time (a
    rendezvous, or a buffered message the sender hands over only once the
    previous one was taken), so the last of ``B`` activations arrives
    ``(B - 1) x`` after the first, which waits for the forwards before ``b``;
    that micro-batch then runs forward and backward through the layers from
    ``b`` on and backward through those before. The gradients alike: the first
    follows every forward and the backwards from ``b`` on, the last comes
    ``(B - 1)`` gradient transfers later and then runs back through the layers
    before ``b``. ``x``: the dearest pipeline's transfer, least over the
    placements."""
    fastest_b = np.min([x.backward for x in times.values()], axis=0)
    after_b = np.concatenate([np.cumsum(fastest_b[::-1])[::-1], [0.0]])
    out = {}
    for pair, (there, back) in links.items():
        stops = np.arange(1, len(there) + 1)
        forward = (
            before_f[stops] + (steps - 1) * there + after_fb[stops] + before_b[stops]
        )
        gradient = before_f[-1] + after_b[stops] + (steps - 1) * back + before_b[stops]
        row = np.zeros(len(there) + 2)
        row[1:-1] = np.maximum(forward, gradient)
        row[0] = np.inf
        out[pair] = row
    return out


def _least_allreduce(data, gpu, tp, dp, params, tied, held, starts, ends, spots):
    """The bucketed all-reduce of every span, least over the offsets of its
    replicas within a node (``spots``; ``None``: every offset), and its
    largest bucket."""
    gpn = data.gpu_spec(gpu).gpus_per_node
    replicas = [Replica(gpu, tp, zone=DEFAULT_ZONE)] * dp
    allreduce, largest, seen = None, None, set()
    for offset in range(gpn) if spots is None else spots:
        nodes = [(offset + j * tp) // gpn for j in range(dp)]
        hops = ring_hops(data.network, replicas, nodes) if dp > 1 else []
        if tuple(hops) in seen:
            continue
        seen.add(tuple(hops))
        times, largest = span_allreduce(hops, dp, params, tied, held, starts, ends)
        allreduce = times if allreduce is None else np.minimum(allreduce, times)
    return allreduce, largest


def _stages_after(group: _Group, tp: int, left: int) -> tuple[int, int]:
    """Least and most stages after a stage at degree ``tp`` when it and the
    stages after it have ``left`` GPUs."""
    rest = left - tp
    return -(-rest // max(group.tps)), rest // min(group.tps)


def _in_flight(group: _Group, tp: int, left: int) -> int:
    """The fewest micro-batches a stage at degree ``tp`` holds at its peak when
    it and the stages after it have ``left`` GPUs: ``min(stages after + 1,
    B)`` (DeepSpeed's 1F1B warm-up)."""
    return min(_stages_after(group, tp, left)[0] + 1, group.steps)


class _StageBounds:
    """A group's stage bounds for a stage with ``left`` GPUs for it and the
    stages after it (memory and the warm-up depend on how many follow)."""

    def __init__(self, group: _Group, tables: dict, overhead: float) -> None:
        self.group, self.tables, self.overhead = group, tables, overhead
        self._cache: dict[tuple[int, int], NDArray[np.float64]] = {}

    def weights(
        self, tp: int, left: int, send: tuple[Any, NDArray[np.float64]] | None = None
    ) -> NDArray[np.float64]:
        """``w[a, b]`` of a stage at degree ``tp`` followed by ``left - tp``
        GPUs of stages: ``inf`` where its memory cannot hold the micro-batches
        in flight. The warm-up bound: the stage's first backward waits for one
        micro-batch's forward to it (``F``), its own forward and the forward and
        backward of every layer after it (an overhead each per stage); before it
        the stage runs at most ``k = min(stages after + 1, B)`` forwards (the
        schedule's peak in flight), so ``B`` backwards and ``B - k`` forwards
        follow. ``send``: ``(name, (add, link))`` for a known next stage: its
        blocking transfers added to the first bound, and its link's bound
        (:func:`_send_rows`)."""
        key = (tp, left, None if send is None else send[0])
        if key not in self._cache:
            w, cap, late, fwd = self.tables[tp]
            fewest, most = _stages_after(self.group, tp, left)
            k = min(most + 1, self.group.steps)
            warm = late + 2 * self.overhead * fewest - k * fwd
            if send is None:
                bound = np.maximum(w, warm)
            else:
                add, link = send[1]
                bound = np.maximum(np.maximum(w + add[None, :], warm), link[None, :])
            fits = cap >= min(fewest + 1, self.group.steps)
            self._cache[key] = np.where(fits, bound, np.inf)
        return self._cache[key]

    def bottleneck(self, most_gpus: int) -> NDArray[np.float64]:
        """``g[u, p]``: the least ``max w`` over chains of stages covering
        layers ``p..`` to the end on exactly ``u`` GPUs (sum of the stages' TP
        degrees)."""
        size = next(iter(self.tables.values()))[0].shape[0]
        g = np.full((most_gpus + 1, size), np.inf)
        g[0, size - 1] = -np.inf  # nothing left to cover, no GPU used
        for u in range(1, most_gpus + 1):
            best = g[u]
            for t in self.tables:
                if t <= u:
                    # a stage a..b-1 at degree t, the rest from b on u - t GPUs
                    stage = self.weights(t, u)
                    rest = np.maximum(stage, g[u - t][None, :]).min(axis=1)
                    best = np.minimum(best, rest)
            g[u] = best
        return g


def certify_predicted(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    incumbent: Plan3D,
    *,
    uniform_tp: bool = True,
    allow_fewer_gpus: bool = True,
    mbs_values: tuple[int, ...] | None = None,
    max_stages: int | None = None,
    max_plans: int = 3000,
    mixed_types: bool = True,
    mixed_state_limit: int = 4000,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
) -> PredictedCertificate:
    """Prove ``incumbent`` (or a better plan found) the predictor's optimum over
    the search space of :func:`~pipedejavu.search.megatron.planner.search_megatron` with
    the same settings, or certify a lower bound (module docstring).

    Args:
        data, model, gpus, global_batch, constants: as for the search.
        incumbent: the plan to prove (it must fit in memory).
        uniform_tp, allow_fewer_gpus, mbs_values, max_stages: the search space.
        max_plans: most predictor calls in the enumeration.
        mixed_types: with several GPU types (and ``uniform_tp``), also plans
            whose stages run on different types (module docstring).
        mixed_state_limit: most stage-count vectors a mixed configuration's
            DP may visit; a configuration over it stays open at a coarser
            bound.
        progress_fn: called with ``{"phase": "proof", "settled", "open",
            "predicted", "best", "bound"}`` after each configuration settled
            and at least every second while one is enumerated (``bound``: the
            least bound of the configurations not settled, so ``min(bound,
            best)`` is a lower bound on every plan at that moment).
    """
    started = time.perf_counter()
    best_prediction = predict_plan(incumbent, data, constants=constants)
    best_plan = incumbent
    best = best_prediction.iteration_time_s if best_prediction.fits_memory else math.inf
    groups = _groups(
        data,
        model,
        gpus,
        global_batch,
        uniform_tp=uniform_tp,
        allow_fewer_gpus=allow_fewer_gpus,
        mbs_values=mbs_values,
        max_stages=max_stages,
    )
    # (bound, order, plans: best_ref -> the configuration's plans to predict,
    # or, with True, a mixed item's refinement: () -> (bound, plans))
    items: list[tuple[float, int, Callable, bool]] = []
    cache: dict = {}
    for group in groups:
        bounds = _StageBounds(
            group,
            _stage_bounds(data, model, constants, group, cache),
            constants.op_overhead_s,
        )
        g = bounds.bottleneck(max(group.sizes))
        for size in group.sizes:
            value = float(g[size, 0])
            if math.isfinite(value):
                plans = functools.partial(
                    _single_plans, data, model, global_batch, group, bounds, g, size
                )
                items.append((value, len(items), plans, False))
    skipped_mixes = 0
    lower = math.inf
    if mixed_types and uniform_tp and len(gpus) > 1:
        for mix in _mixes(data, model, gpus, global_batch, mbs_values, max_stages):
            kinds = [(gpu, mix.tp) for gpu, _ in mix.caps]
            tables = _kind_bounds(
                data,
                model,
                constants,
                kinds,
                mix.mbs,
                mix.dp,
                mix.steps,
                cache,
                with_sends=False,
            )
            sends = _send_rows(
                data, model, constants, kinds, mix.mbs, mix.dp, mix.steps, cache
            )
            bounds = {
                gpu: _StageBounds(
                    _Group(gpu, mix.mbs, mix.dp, mix.steps, (mix.tp,), ()),
                    {mix.tp: tables[(gpu, mix.tp)]},
                    constants.op_overhead_s,
                )
                for gpu, _ in mix.caps
            }
            g = _mixed_bottleneck(mix, bounds, sends, limit=mixed_state_limit)
            if g is None:  # too many count vectors: a coarser bound, left open
                value = _coarse_mixed_bound(mix, bounds)
                if value < best:
                    skipped_mixes += 1
                    lower = min(lower, value)
                continue
            placed = _PlacedMix(data, model, constants, mix, cache)
            least: dict = {}  # counts -> least bound over the first stage's type
            for (counts, _), row in g.items():
                if sum(1 for c in counts if c) >= 2:  # one type: see above
                    least[counts] = min(least.get(counts, math.inf), float(row[0]))
            for counts, value in least.items():
                if math.isfinite(value):
                    refine = functools.partial(
                        _refine, placed, gpus, global_batch, counts, mixed_state_limit
                    )
                    items.append((value, len(items), refine, True))
    # Least bound first; a mixed item carries a coarse bound until it is first
    # taken, then its exact-placement bound (_PlacedMix) and goes back.
    configurations = len(items)
    heapq.heapify(items)
    pruned = enumerated = predicted = 0
    left_open = skipped_mixes
    improved = False
    reported = time.perf_counter()

    def report(bound: float) -> None:
        nonlocal reported
        reported = time.perf_counter()
        if progress_fn is not None:
            progress_fn(
                {
                    "phase": "proof",
                    "settled": pruned + enumerated,
                    "open": left_open,
                    "predicted": predicted,
                    "best": best,
                    "bound": min(bound, lower, best),
                }
            )

    while items:
        value, order, plans, coarse = heapq.heappop(items)
        if value >= best:
            pruned += 1
            continue
        if coarse:
            refined, plans = plans()
            heapq.heappush(items, (max(value, refined), order, plans, False))
            continue
        if predicted >= max_plans or plans is None:
            left_open += 1
            lower = min(lower, value)
            continue
        complete = True
        best_ref = [best]
        for plan in plans(best_ref):
            if predicted >= max_plans:
                complete = False
                break
            predicted += 1
            if time.perf_counter() - reported > 1.0:
                report(value)
            try:
                prediction = predict_plan(plan, data, constants=constants)
            except ProblemError:  # a link the network tables do not price
                continue
            if prediction.fits_memory and prediction.iteration_time_s < best:
                best, best_plan, best_prediction = (
                    prediction.iteration_time_s,
                    plan,
                    prediction,
                )
                best_ref[0] = best
                improved = True
        if complete:
            enumerated += 1
        else:
            left_open += 1
            lower = min(lower, value)
        report(items[0][0] if items else math.inf)
    if not math.isfinite(best):
        raise ValueError("the incumbent does not fit in memory")
    return PredictedCertificate(
        plan=best_plan,
        prediction=best_prediction,
        lower_bound_s=min(lower, best),
        proven=left_open == 0,
        configurations=configurations,
        pruned=pruned,
        enumerated=enumerated,
        open=left_open,
        plans_predicted=predicted,
        improved=improved,
        time_s=time.perf_counter() - started,
    )


def _chains(bounds: _StageBounds, g, size: int, best_ref: list[float]):
    """Chains of ``(start, stop, tp)`` stages on exactly ``size`` GPUs whose every
    stage bound, and the bound of the rest, stay below ``best_ref[0]`` (read at
    each step: it falls as better plans are found)."""
    last = g.shape[1] - 1
    stack: list[tuple[int, int, tuple, float]] = [(0, size, (), float(g[size, 0]))]
    while stack:
        start, left, stages, bound = stack.pop()
        if bound >= best_ref[0]:
            continue
        if start == last:
            if left == 0:
                yield list(stages)
            continue
        for t in bounds.tables:
            if t > left:
                continue
            stage = bounds.weights(t, left)[start]
            row = np.maximum(stage, g[left - t])
            for stop in np.flatnonzero(row < best_ref[0]).tolist()[::-1]:
                chain = (*stages, (start, stop, t))
                stack.append((stop, left - t, chain, max(bound, float(stage[stop]))))


def _single_plans(data, model, gbs, group, bounds, g, size, best_ref):
    """The plans of a one-type configuration left to predict."""
    spec = data.gpu_spec(group.gpu)
    for stages in _chains(bounds, g, size, best_ref):
        yield plan_from_stages(
            stages,
            gpu_type=group.gpu,
            dp=group.dp,
            mbs=group.mbs,
            gbs=gbs,
            model=model,
            gpus_per_node=spec.gpus_per_node,
            zone=DEFAULT_ZONE,
        )


# ------------------------------------------------------------ mixed GPU types
@dataclasses.dataclass(frozen=True)
class _Mix:
    """Plans whose stages may run on different GPU types: one mbs, dp and TP
    degree; ``caps``: (type, most stages of that type) for each usable type."""

    mbs: int
    dp: int
    steps: int
    tp: int
    caps: tuple[tuple[str, int], ...]
    max_stages: int


def _mixes(data, model, gpus, gbs, mbs_values, max_stages) -> list[_Mix]:
    """The (mbs, dp, TP) settings at which two types or more can hold stages."""
    info = data.model_info(model)
    profiles = {gpu: data.profile(model, gpu) for gpu in gpus}
    out = []
    for mbs in sorted({m for table in profiles.values() for m, _ in table}):
        if gbs % mbs or (mbs_values is not None and mbs not in mbs_values):
            continue
        for tp in info.tp_values:
            usable = {
                gpu: count
                for gpu, count in gpus.items()
                if (mbs, tp) in profiles[gpu]
                and data.gpu_spec(gpu).gpus_per_node % tp == 0
                and count >= tp
            }
            if len(usable) < 2:
                continue
            for dp in range(1, max(usable.values()) // tp + 1):
                if (gbs // mbs) % dp:
                    continue
                caps = tuple(
                    (gpu, count // dp // tp)
                    for gpu, count in usable.items()
                    if count // dp // tp >= 1
                )
                if len(caps) < 2:
                    continue
                most = min(
                    info.num_layers,
                    max_stages or info.num_layers,
                    sum(c for _, c in caps),
                )
                out.append(_Mix(mbs, dp, gbs // (mbs * dp), tp, caps, most))
    return out


def _mixed_bottleneck(mix: _Mix, bounds: dict, sends: dict, limit: int) -> dict:
    """``{(counts, type): g[p]}``: the least ``max w`` over chains covering
    layers ``p..`` to the end with ``counts[i]`` stages of the ``i``-th type of
    ``mix.caps`` and the first stage of ``type`` (each stage's bound counts its
    blocking transfers to the next one). Built for count vectors with up to
    ``mix.max_stages`` stages, in increasing total; ``None`` if more than
    ``limit`` vectors would be needed."""
    types = [gpu for gpu, _ in mix.caps]
    caps = [cap for _, cap in mix.caps]
    vectors = [
        c
        for c in itertools.product(*(range(cap + 1) for cap in caps))
        if sum(c) <= mix.max_stages
    ]
    if len(vectors) > limit:
        return None
    vectors.sort(key=sum)
    size = bounds[types[0]].tables[mix.tp][0].shape[0]
    end = np.full(size, np.inf)
    end[size - 1] = -np.inf
    g: dict = {}
    for c in vectors:
        k = sum(c)
        if k == 0:
            continue
        for i, gpu in enumerate(types):
            if c[i] == 0:
                continue
            rest = c[:i] + (c[i] - 1,) + c[i + 1 :]
            best = np.full(size, np.inf)
            for after in types:
                tail = end if k == 1 else g.get((rest, after))
                if tail is None or (k == 1 and after != gpu):
                    continue
                stage = _mixed_weights(mix, bounds, sends, gpu, after, k)
                best = np.minimum(best, np.maximum(stage, tail[None, :]).min(axis=1))
            g[(c, gpu)] = best
    return g


def _coarse_mixed_bound(mix: _Mix, bounds: dict) -> float:
    """A lower bound on every mixed plan of ``mix`` that ignores the per-type
    stage counts and the transfers to the next stage."""
    size = next(iter(bounds.values())).tables[mix.tp][0].shape[0]
    g = np.full(size, np.inf)
    g[size - 1] = -np.inf
    least = math.inf
    for k in range(1, mix.max_stages + 1):
        stage = np.min([b.weights(mix.tp, k * mix.tp) for b in bounds.values()], axis=0)
        g = np.maximum(stage, g[None, :]).min(axis=1)
        if k >= 2:
            least = min(least, float(g[0]))
    return least


def _mixed_weights(mix, bounds, sends, gpu, after, k):
    """Bounds of a stage of type ``gpu`` followed by ``k - 1`` stages, the next
    of type ``after``."""
    row = sends[((gpu, mix.tp), (after, mix.tp))]
    return bounds[gpu].weights(mix.tp, k * mix.tp, send=(after, row))


def _refine(placed: _PlacedMix, gpus, gbs, counts, limit: int):
    """A mixed item's exact-placement bound and its plans left to predict;
    ``(-inf, None)`` (left open at its coarse bound) when its DP would have
    more than ``limit`` count vectors."""
    if math.prod(c + 1 for c in counts) > limit:
        return -math.inf, None
    value, g = placed.value(counts)
    return value, functools.partial(placed.plans, gpus, gbs, counts, g)


# Most (L + 1) x (L + 1) weight tables the mixes of one proof keep at once
# (about 170 MB at L = 26, 300 MB at L = 35); beyond, they are recomputed.
_WEIGHT_TABLES = 30_000


class _PlacedMix:
    """Exact-placement bounds of the mixed plans of one :class:`_Mix` with a
    given number of stages per type (``counts``, one entry per ``mix.caps``).

    With the counts fixed, every stage's placement is known from its type and
    how many stages of its type come before it (Megatron's rank order:
    :func:`~pipedejavu.costmodel.megatron.tables.plan_from_mixed_stages`), so
    a stage's bound can price, exactly:

    * its data-parallel all-reduce at the offset its replicas have in a node;
    * the blocking transfers over both its boundaries, with the actual
      neighbour kinds and placements: in pipeline ``j`` a stage is busy for
      ``R_j + S_j`` per micro-batch beside its layers (``R``: the boundary
      before, ``S``: after), and ``max_j (R_j + S_j) >= max(min R + max S,
      max R + min S)``;
    * the link bound of the boundary after it (:func:`_link_rows`) at the
      actual placements.

    The state of the bottleneck DP is (stages left per type, type of the next
    stage, type of the stage before it): the index of each stage in its type
    follows from the counts. Tables are shared by the count vectors of one
    mix (``self._weights``); DP rows are per count vector."""

    def __init__(self, data, model, constants, mix: _Mix, cache: dict) -> None:
        self.data, self.model, self.constants = data, model, constants
        self.mix, self.cache = mix, cache
        self.types = [gpu for gpu, _ in mix.caps]
        self.kinds = [(gpu, mix.tp) for gpu in self.types]
        info = data.model_info(model)
        self.layers = info.num_layers
        self.nbytes = np.asarray(info.act_output[mix.tp], dtype=float)[
            : self.layers - 1
        ] * (FLOAT_BYTES * mix.mbs)
        times = {
            kind: data.layer_times(
                model, kind[0], mix.mbs, mix.tp, smooth=constants.smooth_profiles
            )
            for kind in self.kinds
        }
        self._layer = (*_layer_bounds(times, constants.op_overhead_s), times)
        self._tables: dict = {}
        self._pairs: dict = {}
        self._weights: dict = {}
        # Every mix's weight tables, to bound them together (see weights).
        self._all_weights = cache.setdefault("placed mix weights", [])
        self._all_weights.append(self._weights)

    def _rank(self, gpu: str, index: int) -> int:
        return index * self.mix.dp * self.mix.tp

    def _table(self, gpu: str, index: int) -> tuple:
        """``(w, cap, late, fwd)`` of a stage of ``gpu``, ``index``-th of its
        type: no transfers in ``w``, the all-reduce at its placement."""
        spot = self._rank(gpu, index) % self.data.gpu_spec(gpu).gpus_per_node
        key = (gpu, spot)
        if key not in self._tables:
            out = _kind_bounds(
                self.data,
                self.model,
                self.constants,
                self.kinds,
                self.mix.mbs,
                self.mix.dp,
                self.mix.steps,
                self.cache,
                with_sends=False,
                placed={g: (spot if g == gpu else 0) for g in self.types},
            )
            self._tables[key] = out[(gpu, self.mix.tp)]
        return self._tables[key]

    def _pair(self, a: tuple[str, int], b: tuple[str, int]) -> tuple:
        """Over the boundaries between stage ``a = (type, index)`` and the next,
        ``b``: ``(least, dearest)`` blocking time per micro-batch of any
        pipeline (``f64[L - 1]``, 0 where buffered) and the link bound by the
        first stage's stop (``f64[L + 1]``)."""
        if (a, b) not in self._pairs:
            mix = self.mix
            first, second = self._rank(*a), self._rank(*b)
            ka, kb = (a[0], mix.tp), (b[0], mix.tp)
            rows = np.empty((self.layers - 1, mix.dp, 2))
            memo: dict = {}
            for k, nbytes in enumerate(self.nbytes.tolist()):
                if nbytes not in memo:
                    memo[nbytes] = _pipeline_transfers(
                        self.data, ka, kb, nbytes, mix.dp, first, second, {}
                    )
                rows[k] = memo[nbytes]
            both = rows.sum(axis=2)
            both[self.nbytes / mix.tp <= self.constants.buffered_message_bytes] = 0.0
            before_f, before_b, after_fb, times = self._layer
            link = _link_rows(
                {0: (rows[:, :, 0].max(axis=1), rows[:, :, 1].max(axis=1))},
                before_f,
                before_b,
                after_fb,
                times,
                mix.steps,
            )[0]
            self._pairs[(a, b)] = (both.min(axis=1), both.max(axis=1), link)
        return self._pairs[(a, b)]

    def weights(self, stage, before, after, count: int) -> NDArray[np.float64]:
        """``w[a, b]`` of ``stage = (type, index)`` with ``before`` and
        ``after`` its neighbours (``None`` at the ends: ``a`` must then be 0,
        ``b`` must be ``L``) and ``count`` stages from it to the end."""
        key = (stage, before, after, count)
        if key in self._weights:
            return self._weights[key]
        if sum(len(table) for table in self._all_weights) > _WEIGHT_TABLES:
            for table in self._all_weights:
                table.clear()
        steps, size = self.mix.steps, self.layers + 1
        w, cap, late, fwd = self._table(*stage)
        low_r = high_r = np.zeros(size)
        if before is not None:
            least, dear, _ = self._pair(before, stage)
            low_r = np.concatenate([[np.inf], steps * least, [np.inf]])
            high_r = np.concatenate([[np.inf], steps * dear, [np.inf]])
        if after is None:
            low_s = high_s = np.full(size, np.inf)
            low_s[-1] = high_s[-1] = 0.0
            link = np.zeros(size)
        else:
            least, dear, link = self._pair(stage, after)
            low_s = np.concatenate([[np.inf], steps * least, [np.inf]])
            high_s = np.concatenate([[np.inf], steps * dear, [np.inf]])
        busy = np.maximum(
            low_r[:, None] + high_s[None, :], high_r[:, None] + low_s[None, :]
        )
        warm = late + 2 * self.constants.op_overhead_s * (count - 1)
        warm = warm - min(count, steps) * fwd
        bound = np.maximum(np.maximum(w + busy, warm), link[None, :])
        bound = np.where(cap >= min(count, steps), bound, np.inf)
        self._weights[key] = bound
        return bound

    def bottleneck(self, counts: tuple[int, ...]) -> dict:
        """``{(left, type, before): g[p]}`` for every state reachable from
        ``counts``: the least ``max w`` over chains covering layers ``p..``
        with ``left`` stages per type, the first of ``type``, the stage before
        it of type ``before`` (``None``: it is the first stage)."""
        g: dict = {}
        size = self.layers + 1

        def index(left, i):
            return counts[i] - left[i]

        def solve(left, i, before):
            key = (left, i, before)
            if key in g:
                return g[key]
            stage = (self.types[i], index(left, i))
            prev = None
            if before is not None:
                prev = (self.types[before], index(left, before) - 1)
            total = sum(left)
            rest = left[:i] + (left[i] - 1,) + left[i + 1 :]
            best = np.full(size, np.inf)
            if total == 1:
                best = self.weights(stage, prev, None, 1)[:, -1].copy()
            else:
                for j, n in enumerate(rest):
                    if n == 0:
                        continue
                    nxt = (self.types[j], index(rest, j))
                    tail = solve(rest, j, i)
                    w = self.weights(stage, prev, nxt, total)
                    best = np.minimum(best, np.maximum(w, tail[None, :]).min(axis=1))
            g[key] = best
            return best

        for i, n in enumerate(counts):
            if n:
                solve(counts, i, None)
        return g

    def value(self, counts: tuple[int, ...]) -> tuple[float, dict]:
        g = self.bottleneck(counts)
        least = min(
            (float(g[(counts, i, None)][0]) for i, n in enumerate(counts) if n),
            default=math.inf,
        )
        return least, g

    def plans(self, gpus, gbs, counts, g, best_ref):
        """The plans with ``counts`` stages per type whose stage bounds and
        rest bound stay below ``best_ref[0]``, depth first and, among the
        children of a node, least bound first."""
        data, mix = self.data, self.mix
        gpn = {gpu: data.gpu_spec(gpu).gpus_per_node for gpu in gpus}
        last = self.layers
        stack = [
            (0, counts, i, None, (), float(g[(counts, i, None)][0]))
            for i, n in enumerate(counts)
            if n
        ]
        stack.sort(key=lambda item: -item[5])
        while stack:
            start, left, i, before, stages, bound = stack.pop()
            if bound >= best_ref[0]:
                continue
            gpu = self.types[i]
            stage = (gpu, counts[i] - left[i])
            prev = None
            if before is not None:
                prev = (self.types[before], counts[before] - left[before] - 1)
            total = sum(left)
            if total == 1:
                value = max(bound, float(self.weights(stage, prev, None, 1)[start, -1]))
                if value < best_ref[0]:
                    yield plan_from_mixed_stages(
                        [*stages, (start, last, mix.tp, gpu)],
                        dp=mix.dp,
                        mbs=mix.mbs,
                        gbs=gbs,
                        model=self.model,
                        pool=gpus,
                        gpus_per_node=gpn,
                        zone=DEFAULT_ZONE,
                    )
                continue
            rest = left[:i] + (left[i] - 1,) + left[i + 1 :]
            children = []
            for j, n in enumerate(rest):
                if n == 0:
                    continue
                nxt = (self.types[j], counts[j] - rest[j])
                w = self.weights(stage, prev, nxt, total)[start]
                row = np.maximum(w, g[(rest, j, i)])
                for stop in np.flatnonzero(row < best_ref[0]).tolist():
                    chain = (*stages, (start, stop, mix.tp, gpu))
                    value = max(bound, float(row[stop]))
                    children.append((stop, rest, j, i, chain, value))
            children.sort(key=lambda child: -child[5])
            stack.extend(children)
