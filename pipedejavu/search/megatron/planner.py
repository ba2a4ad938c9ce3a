"""Search Megatron-style plans: mbs x dp x TP x GPUs outside, the exact DP inside.

A configuration fixes the GPU type, the micro-batch size, the data-parallel
degree ``dp`` (so ``B = gbs / (mbs dp)``, which must divide exactly, as Megatron
and DeepSpeed require), the TP degree (one for every stage, or a set to choose
from per stage) and the GPUs of one pipeline. Each configuration compiles into a
:class:`pipedejavu.Problem` with ``stage_tail_cost``
(:mod:`pipedejavu.costmodel.megatron.tables`), whose optimum the exact DP finds
(:mod:`pipedejavu.search.alpa.tail`): the least ``sum c + (B - 1) max c + max tail``.

Over configurations, a best-first branch and bound: every plan of a
configuration costs at least ``B * W / G`` (``W``: the least GPU-seconds of
all layers per micro-batch; ``G``: the pipeline's GPUs; its slowest stage
carries at least its share of the work), so configurations are solved in
increasing order of that bound and the search stops when the bound reaches the
best plan found (with ``rescore_tolerance``: the best plan times ``1 +
tolerance``). The result is the proven optimum of the planning objective over
the search space. The configurations' optima within the tolerance are then
re-scored by the predictor (the simulation), and the best predicted is chosen.
Finally (``certify``) a branch and bound on the predictor itself
(:mod:`pipedejavu.search.megatron.certify`) proves that plan the predictor's
optimum over the whole search space, or replaces it by a better one it finds,
or, when its prediction budget runs out, certifies a lower bound on the
predicted time.

Search space: stages of contiguous layers; per stage a TP degree that divides
the GPUs of a node and has a profile entry at the mbs (one degree for all
stages with ``uniform_tp``); ``dp`` replicas of every stage on GPUs of one type;
``mbs`` from the profile; at most the GPUs available (fewer when that is
faster; ``allow_fewer_gpus``). Pools of several GPU types: the plan uses one
type (each type is searched, and the best kept; see :func:`search_megatron`),
or with ``mixed_types`` a type per stage, searched by the proof's branch and
bound only.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.memory_headroom import kept_free
from pipedejavu.core.plan3d import (
    DEFAULT_ZONE,
    Plan3D,
    Replica,
    canonical_nodes,
)
from pipedejavu.core.problem import InfeasibleProblemError, Problem, ProblemError
from pipedejavu.costmodel.megatron.comm import ring_allreduce_times, ring_hops
from pipedejavu.costmodel.megatron.constants import PredictorConstants
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.rules import (
    is_blocking,
    optimizer_share,
    optimizer_time,
    stage_params,
)
from pipedejavu.costmodel.megatron.sailor_data import SailorData
from pipedejavu.costmodel.megatron.tables import (
    StageTables,
    boundary_time,
    compile_tables,
    plan_tables,
    stage_entry,
    usable_degrees,
)
from pipedejavu.search.alpa.tail import cheaper_plan_with_tail
from pipedejavu.search.engine.config import SearchConfig
from pipedejavu.search.megatron.certify import certify_predicted
from pipedejavu.search.megatron.settings import (
    MegatronSearchConfig,
    MegatronSearchResult,
    bound_reaches,
    check_plan_size,
)
from pipedejavu.search.megatron.space import chain_counts, config_groups, type_plan
from pipedejavu.search.megatron.transfers import BoundCache
from pipedejavu.simulation.zero_bubble import zero_bubble_in_flight

__all__ = ["search_megatron"]


@dataclasses.dataclass(frozen=True, order=True)
class _Config:
    bound: float
    gpu: str = dataclasses.field(compare=False)
    mbs: int = dataclasses.field(compare=False)
    dp: int = dataclasses.field(compare=False)
    tps: tuple[int, ...] = dataclasses.field(compare=False)
    gpus: int = dataclasses.field(compare=False)


def _configs(
    data: SailorData,
    model: str,
    gpu: str,
    count: int,
    gbs: int,
    constants: PredictorConstants,
    config: MegatronSearchConfig,
) -> list[_Config]:
    """The configurations of one GPU type (:func:`~pipedejavu.search.megatron.
    space.config_groups`), each with its bound."""
    info = data.model_info(model)
    spec = data.gpu_spec(gpu)
    overhead = constants.op_overhead_s
    rings: dict[tuple[int, int], list] = {}

    def hops(tp: int, dp: int) -> list:
        if (tp, dp) not in rings:
            nodes = canonical_nodes([tp], dp, spec.gpus_per_node)[0]
            replicas = [Replica(gpu, tp, zone=DEFAULT_ZONE)] * dp
            rings[(tp, dp)] = ring_hops(data.network, replicas, nodes) if dp > 1 else []
        return rings[(tp, dp)]

    least_output = min(float(v[:-1].min()) for v in info.act_output.values())

    @functools.cache
    def boundary(mbs: int, tp: int, dp: int) -> float:
        """The least blocking transfer a boundary costs each of its two stages
        (twice: activation and gradient), as the tables price it."""
        nbytes = least_output * info.activation_bytes * mbs
        if not is_blocking(nbytes, tp, tp, constants):
            return 0.0
        return min(
            boundary_time(
                data.network,
                gpu,
                tp,
                dp,
                spec.gpus_per_node,
                nbytes,
                same_node=same,
                zone=DEFAULT_ZONE,
            )
            for same in (False, True)
        )

    per_mbs: dict[int, tuple] = {}

    def layer_terms(mbs: int) -> tuple:
        """Per TP degree usable at ``mbs``: layer times, optimizer step of all
        parameters, the parameters; and the least work of all layers."""
        if mbs not in per_mbs:
            layer, optimizer, total_params = {}, {}, {}
            for t in usable_degrees(data, model, gpu, mbs, count):
                times = data.layer_times(
                    model, gpu, mbs, t, smooth=constants.smooth_profiles
                )
                layer[t] = times.forward + times.backward
                params = stage_params(info, t, 0, info.num_layers)
                total_params[t] = params
                optimizer[t] = optimizer_time(float(times.update[0]), params, info, t)
            work_all = np.min([t * row for t, row in layer.items()], axis=0).sum()
            per_mbs[mbs] = (layer, optimizer, total_params, work_all)
        return per_mbs[mbs]

    out = []
    groups = config_groups(
        data,
        model,
        {gpu: count},
        gbs,
        config,
    )
    for group in groups:
        mbs, dp, steps = group.mbs, group.dp, group.steps
        layer, optimizer, total_params, work_all = layer_terms(mbs)
        small = min(group.tps)
        if config.uniform_tp:
            # S = gpus / tp stages: sum c >= the layers' time plus 2 S
            # overheads, max c >= sum c / S, and the largest optimizer step >=
            # the average one (every size of the group at once).
            stages = np.array(group.sizes) // small
            total = (
                float(layer[small].sum())
                + 2 * stages * overhead
                + 4 * (stages - 1) * boundary(mbs, small, dp)
            )
            bounds = total * (stages + steps - 1) / stages
            bounds = np.maximum(bounds, steps * float(layer[small].max()))
            # The stage with the most parameters holds >= 1/S of them; its
            # all-reduce and step cost at least as much as for exactly 1/S
            # (ring time grows with bytes).
            share = total_params[small] / stages * info.gradient_bytes
            bounds += optimizer[small] * optimizer_share(info, dp) / stages
            bounds += ring_allreduce_times(hops(small, dp), dp, share)
            out += [
                _Config(float(b), gpu, mbs, dp, group.tps, gpus)
                for b, gpus in zip(bounds.tolist(), group.sizes, strict=True)
            ]
            continue
        for gpus in group.sizes:
            usable = tuple(t for t in group.tps if t <= gpus)
            # sum c >= the fastest layers' time, max c >= W / G.
            fastest = float(np.min([layer[t] for t in usable], axis=0).sum())
            longest = float(np.min([layer[t].max() for t in usable]))
            share = max(work_all / gpus, longest)
            bound = max(fastest + (steps - 1) * share, steps * share)
            out.append(_Config(bound, gpu, mbs, dp, usable, gpus))
    return out


def _memory(
    tables: StageTables, tps: tuple[int, ...], gpus: int, zero_bubble: bool
) -> NDArray[np.int64]:
    """The problem's ``max_n_succ_stages`` for these degrees and GPUs."""
    memory = tables.max_n_succ_stages[:, :, [tables.tps.index(t) for t in tps]]
    if zero_bubble:
        # ZB-H1 holds min(P, B) on every stage: at the fewest stages these
        # GPUs take (exact with one degree; 1F1B's rule then asks no more)
        fewest = -(-gpus // max(tps))
        least = zero_bubble_in_flight(fewest, tables.num_microbatches)
        memory = np.where(memory >= least - 1, memory, -1)
    return memory


def _problem(
    tables: StageTables, tps: tuple[int, ...], gpus: int, memory: NDArray[np.int64]
) -> Problem:
    """The configuration's planning problem (``memory``: :func:`_memory`)."""
    index = [tables.tps.index(t) for t in tps]
    # GPUs counted in units of the degrees' gcd: the same plans, a DP over
    # that many times fewer device counts.
    unit = math.gcd(gpus, *tps)
    return Problem(
        compute_cost=tables.compute_cost[:, :, index],
        max_n_succ_stages=memory,
        submesh_shapes=np.array([[1, t // unit] for t in tps], dtype=np.int64),
        cluster_shape=(1, gpus // unit),
        num_microbatches=tables.num_microbatches,
        stage_tail_cost=tables.stage_tail_cost[:, :, index],
    )


def _solve_diff(problem: Problem, seed: int) -> tuple[float, list, float]:
    """The engine on the tail-free problem; plus the tail of its plan.

    Returns ``(objective, stages, certified lower bound)``.
    """
    import jax

    from pipedejavu.search.engine.driver import search

    tails = problem.stage_tail_cost
    base = problem.replace(stage_tail_cost=None)
    result = search(
        base, SearchConfig(num_restarts=32, num_steps=200), key=jax.random.key(seed)
    )
    stages = [
        (s.start, s.stop, s.submesh_index, s.config_index) for s in result.plan.stages
    ]
    tail = max(tails[a, b - 1, m, k] for a, b, m, k in stages)
    finite = np.isfinite(problem.compute_cost)
    least_tail = float(tails[finite].min()) if finite.any() else 0.0
    return result.plan.cost + tail, stages, result.lower_bound + least_tail


def search_megatron(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    config: MegatronSearchConfig | None = None,
    *,
    progress_fn: Callable[[dict[str, Any]], None] | None = None,
    bound_cache: BoundCache | None = None,
    solved: MegatronSearchResult | None = None,
    cutoff_s: float = math.inf,
) -> MegatronSearchResult:
    """The best plan for ``model`` on the GPU pool (module docstring).

    Args:
        data: profiles, sizes, links, GPU specs.
        model: the model's profile name.
        gpus: ``{gpu_type: count}``, the pool.
        global_batch: samples per iteration (gbs).
        constants: the predictor's constants.
        config: settings (:class:`MegatronSearchConfig`).
        progress_fn: called with a dict after each configuration solved
            (``{"solved", "best", "bound"}``), then during the proof
            (``{"phase": "proof", ...}``:
            :func:`~pipedejavu.search.megatron.certify.certify_predicted`).
        bound_cache: the proof's bound tables, to reuse and fill
            (``certify_predicted``'s ``cache``).
        solved: the result of this same search (the same arguments) with
            ``certify`` off, e.g. a probe's: its DP is not run again, only the
            proof (its seconds count in ``search_time_s``).
        cutoff_s: the time of a plan outside this space (a sharded one): the
            proof settles configurations against the lesser of it and the
            plan found; ``proven`` then holds only where the certified bound
            reaches the plan's own time (``certify_predicted``'s cutoff).

    Raises:
        ProblemError: unknown model or GPU type, bad counts.
        InfeasibleProblemError: no plan fits (memory, divisibility); says why.
    """
    config = config or MegatronSearchConfig()
    started = time.perf_counter()
    if solved is None:
        result = _solve(data, model, gpus, global_batch, constants, config, progress_fn)
    elif solved.certificate is not None or solved.method != config.method:
        raise ProblemError("solved: a result of the same method, not yet proven")
    else:
        result = solved
    if not config.certify:
        return result
    plan, objective, prediction = result.plan, result.objective_s, result.prediction
    candidates = result.candidates
    certificate = certify_predicted(
        data,
        model,
        gpus,
        global_batch,
        constants,
        plan,
        config,
        max_plans=config.proof_budget,
        mixed_types=config.mixed_types,
        cache=bound_cache,
        progress_fn=progress_fn,
        cutoff_s=cutoff_s,
        polish_max_plans=config.polish_budget,
        own_incumbent=True,
    )
    if certificate.improved:
        plan, prediction = certificate.plan, certificate.prediction
        objective = _objective(data, model, constants, plan)
        candidates += ((plan, objective, prediction.iteration_time_s),)
    # (a cutoff below the plan: settled against it, the plan not proven)
    reached = bound_reaches(certificate.lower_bound_s, prediction.iteration_time_s)
    earlier = 0.0 if solved is None else solved.search_time_s
    return dataclasses.replace(
        result,
        plan=plan,
        prediction=prediction,
        objective_s=objective,
        candidates=candidates,
        search_time_s=earlier + time.perf_counter() - started,
        predicted_lower_bound_s=certificate.lower_bound_s,
        proven=certificate.proven and reached,
        certificate=certificate,
    )


def _solve(
    data: SailorData,
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    constants: PredictorConstants,
    config: MegatronSearchConfig,
    progress_fn: Callable[[dict[str, Any]], None] | None,
) -> MegatronSearchResult:
    """:func:`search_megatron` without its proof."""
    started = time.perf_counter()
    check_plan_size(data, model)
    if global_batch < 1:
        raise ProblemError(f"global batch must be >= 1, got {global_batch}")
    configs: list[_Config] = []
    for gpu, count in gpus.items():
        if count < 1:
            raise ProblemError(f"{gpu}: the GPU count must be >= 1, got {count}")
        if gpu not in data.gpu_types(model):
            raise ProblemError(
                f"no profile of model {model} on GPU type {gpu!r} (have: "
                f"{', '.join(data.gpu_types(model))})"
            )
        configs += _configs(data, model, gpu, count, global_batch, constants, config)
    if not configs:
        raise InfeasibleProblemError(
            f"no (mbs, dp, tp) divides the global batch {global_batch} with the "
            f"profiled micro-batch sizes on {dict(gpus)}"
        )
    total = len(configs)
    heapq.heapify(configs)
    tables: dict[tuple, StageTables] = {}
    counts: dict[tuple, NDArray[np.bool_]] = {}  # chain_counts per rule
    zero_bubble = bool(data.options.zero_bubble)
    found: list[tuple[float, _Config, list]] = []
    best = math.inf
    lower = math.inf  # least bound of what the search did not solve exactly
    solved = 0
    tolerance = 1.0 + config.rescore_tolerance
    while configs:
        item = heapq.heappop(configs)
        limit = best * tolerance if config.method == "dp" else best
        if item.bound >= limit or (
            config.method == "diff" and len(found) >= config.diff_configs
        ):
            lower = min(lower, item.bound)
            break
        gpn = data.gpu_spec(item.gpu).gpus_per_node
        one_node = item.dp * item.gpus <= gpn
        key = (item.gpu, item.mbs, item.dp, one_node)
        if key not in tables:
            tps = tuple(usable_degrees(data, model, item.gpu, item.mbs))
            tables[key] = compile_tables(
                data,
                model,
                constants,
                gpu_type=item.gpu,
                mbs=item.mbs,
                dp=item.dp,
                num_microbatches=global_batch // (item.mbs * item.dp),
                tps=tps,
                zone=DEFAULT_ZONE,
                pipeline_gpus=item.gpus if one_node else None,
            )
        memory = None
        if len(item.tps) == 1 and item.gpus % item.tps[0] == 0:
            stages = item.gpus // item.tps[0]
            steps = tables[key].num_microbatches  # ZB-H1's rule reads min(P, B)
            rule = (key, item.tps, min(stages, steps) if zero_bubble else 0)
            if rule not in counts:  # every stage count at once
                memory = _memory(tables[key], item.tps, item.gpus, zero_bubble)
                # (per-stage recomputation: the most any count allows)
                most = memory[:, :, 0, :].max(axis=-1)
                counts[rule] = chain_counts(most, len(memory))
            if stages >= len(counts[rule]) or not counts[rule][stages]:
                solved += 1
                continue  # what the DP would find, without its passes
        if memory is None:
            memory = _memory(tables[key], item.tps, item.gpus, zero_bubble)
        try:
            problem = _problem(tables[key], item.tps, item.gpus, memory)
        except ProblemError:  # the TP degrees cannot add up to these GPUs
            continue
        solved += 1
        try:
            if config.method == "dp":
                value, stages, _ = cheaper_plan_with_tail(problem, limit)
            else:
                value, stages, bound = _solve_diff(problem, seed=solved)
                lower = min(lower, max(bound, item.bound))
        except InfeasibleProblemError:
            continue
        if stages is not None:
            found.append((value, item, stages))
            best = min(best, value)
        if progress_fn is not None:
            progress_fn({"solved": solved, "best": best, "bound": item.bound})
    if not found:
        raise InfeasibleProblemError(
            f"no plan of {model} fits the memory of {dict(gpus)}"
            f"{kept_free(getattr(data, 'memory_headroom', None))} with global "
            f"batch {global_batch} (every configuration's stages exceed the GPU "
            "memory or cannot be placed)"
        )
    if config.method == "dp":
        lower = best  # exhausted: every configuration bound >= best, or solved
    candidates = []
    for value, item, stages in sorted(found, key=lambda x: x[0]):
        if value > best * tolerance:
            continue
        stage_tps = [(a, b, item.tps[m]) for a, b, m, _ in stages]
        plan = type_plan(data, model, stage_tps, item, global_batch)
        prediction = predict_plan(plan, data, constants=constants)
        candidates.append((plan, value, prediction))
    # the fastest that fits (ZB-H1's tables relax memory with several degrees)
    chosen = min(
        candidates, key=lambda c: (not c[2].fits_memory, c[2].iteration_time_s, c[1])
    )
    return MegatronSearchResult(
        plan=chosen[0],
        prediction=chosen[2],
        objective_s=chosen[1],
        optimum_s=best,
        lower_bound_s=min(lower, best),
        gap=best / min(lower, best) - 1.0,
        configurations=total,
        solved=solved,
        candidates=tuple((p, v, r.iteration_time_s) for p, v, r in candidates),
        search_time_s=time.perf_counter() - started,
        method=config.method,
    )


def _objective(
    data: SailorData, model: str, constants: PredictorConstants, plan: Plan3D
) -> float:
    """The planning objective of a canonically placed one-type plan, on the
    search's tables (``nan`` for a plan mixing GPU types: no table prices it)."""
    if len(plan.gpus_by_type()) > 1:
        return math.nan
    tables, spans = plan_tables(data, model, constants, plan)
    entries = [
        stage_entry(tables, a, b, m, len(spans) - 1 - s)
        for s, (a, b, m) in enumerate(spans)
    ]
    costs = [cost for cost, _, _ in entries]
    tails = [tail for _, tail, _ in entries]
    steps = plan.num_microbatches
    return float(math.fsum(costs) + (steps - 1) * max(costs) + max(tails))
