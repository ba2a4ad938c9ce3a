"""Measured layer costs: time the layers of a small flax GPT and build a Problem.

The model (:class:`GPTConfig`, presets in :data:`MODEL_NAMES`, defined in
:mod:`pipedejavu.costmodel.profiling.gpt_model` and re-exported here) is cut into Alpa's pipeline
layers: the embedding (token + position), each transformer block (pre-LayerNorm
causal self-attention and a GELU MLP, both residual), and the head (final
LayerNorm, LM projection and the mean cross-entropy loss). A layer's cost is
what it costs inside a pipeline stage: one jitted call of ``jax.vjp`` of the layer
at its real input activation, pulled back with the real gradient of its output,
returning the output, the parameter gradients and (except for the embedding) the
input gradient. Calls are timed wall-clock with ``jax.block_until_ready`` on
whatever backend JAX sees, after warm-up calls, in rounds that visit every timed
function once in a shuffled order (so load drifts on a shared machine hit all of
them alike); a function's time is the median of its rounds.

Stage model. A contiguous span ``i..j`` run as one jitted function is not the sum
of its layers' calls: each call pays a fixed overhead (dispatch, thread wake-up,
result buffers), XLA fuses and overlaps work across layer boundaries, and a stage
whose working set outgrows the caches slows down (measured on a 2-core CPU with
a 32 MiB L3: gpt-small stages of three or more blocks run ~35% slower than the
sum of their blocks, two blocks do not). So, for ``n`` layers::

    predicted(i..j) = sum_l t_l * (1 + spill_fraction * [W(i..j) > spill_bytes])
                      - (n - 1) * per_boundary_s
                      - boundary_fraction * sum_{k=i..j-1} (t_k + t_{k+1}) / 2

with ``W`` the summed vjp stashes of the layers per device, and the four
coefficients fit to spans timed as one function in the same rounds
(:func:`fit_stage_overhead`). One-layer stages are the measurement itself.

Devices. One device was measured. :func:`problem_from_layer_profile` defaults to
a 1x1 cluster, where ``compute_cost`` is the measured model. Larger clusters need
an explicit :class:`DataParallelScaling`, a stated assumption rather than a
measurement: on a submesh of ``d`` devices each stage runs data-parallel with
Amdahl scaling of the measured time (its working set split over the devices),
plus a ring all-reduce of its gradients once per iteration (alpha-beta), charged
as ``1 / B`` of it per micro-batch.
Units: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import NDArray
from scipy.optimize import lsq_linear

from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    Problem,
    get_submesh_choices,
)
from pipedejavu.costmodel.profiling.gpt_model import MODEL_NAMES as MODEL_NAMES

# The model lives in gpt_model; every name it had here stays importable.
from pipedejavu.costmodel.profiling.gpt_model import PRESETS as PRESETS
from pipedejavu.costmodel.profiling.gpt_model import Block as Block
from pipedejavu.costmodel.profiling.gpt_model import Embedding as Embedding
from pipedejavu.costmodel.profiling.gpt_model import GPTConfig as GPTConfig
from pipedejavu.costmodel.profiling.gpt_model import Head as Head
from pipedejavu.costmodel.profiling.gpt_model import gpt_config as gpt_config
from pipedejavu.costmodel.profiling.gpt_model import gpt_modules as gpt_modules
from pipedejavu.costmodel.profiling.gpt_model import kinds_step as kinds_step
from pipedejavu.costmodel.profiling.gpt_model import layer_names as layer_names
from pipedejavu.costmodel.profiling.gpt_model import span_step as span_step

__all__ = [
    "MODEL_NAMES",
    "DataParallelScaling",
    "GPTConfig",
    "LayerProfile",
    "StageOverhead",
    "fit_stage_overhead",
    "gpt_config",
    "gpt_modules",
    "predict_span_time",
    "problem_from_layer_profile",
    "profile_model",
    "profile_to_problem",
]

ProgressFn = Callable[[int, int, str], None]


def _nbytes(tree) -> int:
    return int(sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in tree))


def _stash_bytes(layer: nn.Module, params, x, *extra) -> int:
    """Bytes the backward of ``layer`` keeps from its forward: the jaxpr-level
    vjp residuals (an upper bound on what XLA keeps), without the weights."""

    def residuals(params, x, *extra):
        if jnp.issubdtype(x.dtype, jnp.integer):  # token ids: no input gradient
            _, pullback = jax.vjp(lambda p: layer.apply(p, x, *extra), params)
        else:
            _, pullback = jax.vjp(lambda p, h: layer.apply(p, h, *extra), params, x)
        weights = {id(leaf) for leaf in jax.tree_util.tree_leaves(params)}
        return [r for r in jax.tree_util.tree_leaves(pullback) if id(r) not in weights]

    return _nbytes(jax.eval_shape(residuals, params, x, *extra))


@dataclasses.dataclass(frozen=True, eq=False)
class LayerProfile:
    """Raw measurements of one model on one backend (one device).

    Args:
        model_name: preset name, or ``"custom"``. config: the profiled model.
        layer_names: L names. backend: ``jax.default_backend()``.
        device_kind: the device's ``device_kind``.
        layer_times_s: f64[L] median seconds of one layer's forward + backward.
        layer_samples_s: f64[L, R] every timed round.
        spans: ``(start, stop)`` half-open multi-layer spans timed as one function.
        span_times_s: f64[S] their median seconds. span_samples_s: f64[S, R].
        activation_bytes: i64[L] each layer's output per micro-batch (what a
            stage boundary after it sends; 4 for the loss).
        stash_bytes: i64[L] what its backward keeps from its forward (inputs and
            intermediates, not the weights), per micro-batch: jaxpr-level vjp
            residuals, an upper bound on what XLA keeps.
        param_bytes: i64[L] its parameters.
        repeats, warmup, burst: timed rounds, untimed calls per function, calls
            per sample (see :func:`profile_model`).
        compile_s: seconds spent compiling and warming up.
    """

    model_name: str
    config: GPTConfig
    layer_names: tuple[str, ...]
    backend: str
    device_kind: str
    layer_times_s: NDArray[np.float64]
    layer_samples_s: NDArray[np.float64]
    spans: tuple[tuple[int, int], ...]
    span_times_s: NDArray[np.float64]
    span_samples_s: NDArray[np.float64]
    activation_bytes: NDArray[np.int64]
    stash_bytes: NDArray[np.int64]
    param_bytes: NDArray[np.int64]
    repeats: int
    warmup: int
    burst: int
    compile_s: float

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def with_statistic(self, statistic: str) -> LayerProfile:
        """A copy whose times are another statistic of the same samples:
        ``"median"`` (the default) or ``"min"`` (the least-disturbed call, a
        steadier estimate on a loaded machine)."""
        reducers = {"median": np.median, "min": np.min}
        if statistic not in reducers:
            raise ValueError(f"statistic must be median or min, got {statistic!r}")
        reduce = reducers[statistic]
        return dataclasses.replace(
            self,
            layer_times_s=reduce(self.layer_samples_s, axis=1),
            span_times_s=reduce(self.span_samples_s, axis=1),
        )


def _check_count(value: object, name: str, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _check_spans(spans: object, num_layers: int) -> tuple[tuple[int, int], ...]:
    if isinstance(spans, str):
        if spans != "auto":
            raise ValueError(
                f"spans must be 'auto' or (start, stop) pairs, got {spans!r}"
            )
        half = (num_layers + 1) // 2
        spans = [(0, num_layers), (0, half), (num_layers // 2, num_layers), (1, 3)]
        spans = [(a, b) for a, b in spans if b - a >= 2 and b <= num_layers]
    checked: list[tuple[int, int]] = []
    for span in spans:  # type: ignore[union-attr]
        try:
            start, stop = (int(x) for x in span)
        except (TypeError, ValueError):
            raise ValueError(
                f"spans must hold (start, stop) pairs, got {span!r}"
            ) from None
        if not 0 <= start < stop - 1 < num_layers:
            raise ValueError(
                f"span {(start, stop)} must satisfy 0 <= start and start + 2 <= stop "
                f"<= L = {num_layers} (half-open, at least two layers)"
            )
        if (start, stop) not in checked:
            checked.append((start, stop))
    return tuple(checked)


def profile_model(
    name_or_config: str | GPTConfig,
    *,
    batch: int | None = None,
    seq_len: int | None = None,
    repeats: int = 10,
    warmup: int = 2,
    burst: int = 2,
    spans: str | Sequence[tuple[int, int]] = "auto",
    seed: int = 0,
    progress_fn: ProgressFn | None = None,
) -> LayerProfile:
    """Time every layer, and the multi-layer ``spans``, of a GPT on this backend.

    Args:
        name_or_config: a preset name (:data:`MODEL_NAMES`) or a :class:`GPTConfig`.
        batch, seq_len: override the config's micro-batch size / sequence length.
        repeats: timed rounds (>= 1); warmup: untimed calls per function (>= 0).
        burst: calls per sample, back to back, of which the last is timed (>= 1):
            a stage runs micro-batch after micro-batch, so its caches are warm;
            1 times each call right after other functions ran (cold).
        spans: ``(start, stop)`` half-open spans of >= 2 layers timed as one
            function (the overhead fit's data), or ``"auto"``: the whole model,
            both halves and layers 1..2.
        seed: parameters and tokens.
        progress_fn: called ``(done, total, what)`` after each compilation and
            each timed round.

    Returns:
        The measurements; see :class:`LayerProfile`.
    """
    repeats = _check_count(repeats, "repeats", 1)
    warmup = _check_count(warmup, "warmup", 0)
    burst = _check_count(burst, "burst", 1)
    if isinstance(name_or_config, GPTConfig):
        name, config = "custom", name_or_config
    else:
        name, config = name_or_config, gpt_config(name_or_config)
    changes = {"batch_size": batch, "seq_len": seq_len}
    config = dataclasses.replace(
        config, **{k: v for k, v in changes.items() if v is not None}
    )
    num_layers = config.num_layers
    spans = _check_spans(spans, num_layers)

    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.seq_len)
    tokens = rng.integers(0, config.vocab_size, shape, dtype=np.int32)
    targets = np.roll(tokens, -1, axis=1)
    hidden = np.zeros((*shape, config.hidden_size), np.float32)
    tokens, targets, zeros = jax.device_put((tokens, targets, hidden))
    # numpy N(0, 0.02) parameters: timings do not depend on the values, and a
    # jitted flax init costs one more XLA compilation per layer kind.
    params = []
    for index, layer in enumerate(gpt_modules(config)):
        x = tokens if index == 0 else hidden
        extra = (targets,) if index == num_layers - 1 else ()
        abstract = jax.eval_shape(layer.init, jax.random.key(0), x, *extra)
        normal = jax.tree_util.tree_map(
            lambda leaf: rng.normal(0.0, 0.02, leaf.shape).astype(leaf.dtype),
            abstract,
        )
        params.append(jax.device_put(normal))

    def arguments(start: int, stop: int, cotangent) -> tuple:
        return (tuple(params[start:stop]), inputs[start], targets, cotangent)

    # Forward with zero output gradients for the real activations, then the real
    # output gradients, head first; these calls compile the layer functions.
    started = time.perf_counter()
    cotangents: list = [zeros] * (num_layers - 1) + [jnp.ones((), jnp.float32)]
    inputs, outputs = [tokens], [None] * num_layers
    for index in range(num_layers - 1):
        call = arguments(index, index + 1, cotangents[index])
        inputs.append(span_step(config, index, index + 1)(*call)[0])
    total = num_layers + len(spans) + repeats
    for index in reversed(range(num_layers)):
        call = arguments(index, index + 1, cotangents[index])
        outputs[index], gradients = span_step(config, index, index + 1)(*call)
        if index > 0:
            cotangents[index - 1] = gradients[1]
        if progress_fn is not None:
            progress_fn(num_layers - index, total, f"compiled {index}")
    timed = [(index, index + 1) for index in range(num_layers)] + list(spans)
    calls = []
    for count, (start, stop) in enumerate(timed):
        function = span_step(config, start, stop)
        call = arguments(start, stop, cotangents[stop - 1])
        for _ in range(warmup if count < num_layers else warmup + 1):
            jax.block_until_ready(function(*call))
        calls.append((function, call))
        if progress_fn is not None and count >= num_layers:
            progress_fn(count + 1, total, f"compiled span {start}..{stop - 1}")
    compile_s = time.perf_counter() - started

    samples = np.zeros((len(timed), repeats))
    order_rng = np.random.default_rng(seed)
    for round_index in range(repeats):
        for which in order_rng.permutation(len(timed)):
            function, call = calls[which]
            for _ in range(burst - 1):  # the stage's steady state, cache warm
                jax.block_until_ready(function(*call))
            began = time.perf_counter()
            jax.block_until_ready(function(*call))
            samples[which, round_index] = time.perf_counter() - began
        if progress_fn is not None:
            done = num_layers + len(spans) + round_index + 1
            progress_fn(done, total, f"timed round {round_index + 1}/{repeats}")

    medians = np.median(samples, axis=1)
    device = jax.devices()[0]
    return LayerProfile(
        model_name=name,
        config=config,
        layer_names=layer_names(config),
        backend=jax.default_backend(),
        device_kind=str(device.device_kind),
        layer_times_s=medians[:num_layers],
        layer_samples_s=samples[:num_layers],
        spans=spans,
        span_times_s=medians[num_layers:],
        span_samples_s=samples[num_layers:].reshape(len(spans), repeats),
        activation_bytes=np.array([_nbytes([out]) for out in outputs], np.int64),
        stash_bytes=np.array(
            [
                _stash_bytes(layer, params[i], inputs[i], *extra)
                for i, layer in enumerate(gpt_modules(config))
                for extra in [(targets,) if i == num_layers - 1 else ()]
            ],
            np.int64,
        ),
        param_bytes=np.array(
            [_nbytes(jax.tree_util.tree_leaves(p)) for p in params], np.int64
        ),
        repeats=repeats,
        warmup=warmup,
        burst=burst,
        compile_s=compile_s,
    )


@dataclasses.dataclass(frozen=True)
class StageOverhead:
    """How a span run as one function differs from the sum of its layers' calls.

    Args:
        per_boundary_s: seconds saved per internal layer boundary, the fixed
            per-call part (negative: a cost).
        boundary_fraction: saved per boundary, as a fraction of the two adjacent
            layers' mean time (fusion and overlap across the boundary).
        spill_fraction: slowdown, as a fraction of the layers' sum, of a stage
            whose working set exceeds ``spill_bytes``.
        spill_bytes: working-set capacity (bytes of summed layer stashes per
            device); ``inf``: no stage spills.
        num_spans: spans the fit used (0: no effect is modelled).
    """

    per_boundary_s: float = 0.0
    boundary_fraction: float = 0.0
    spill_fraction: float = 0.0
    spill_bytes: float = math.inf
    num_spans: int = 0


def _span_sums(values: NDArray) -> NDArray[np.float64]:
    """f64[L, L]: ``[i, j]`` = sum of ``values[i..j]`` (meaningful for i <= j)."""
    prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    return prefix[None, 1:] - prefix[:-1, None]


def _features(profile: LayerProfile, devices: int = 1) -> tuple:
    """f64[L, L] tables for stage ``i..j``: sum of layer times, internal
    boundaries, sum of adjacent-pair mean times, working set per device."""
    times = profile.layer_times_s
    first, last = np.indices((len(times), len(times)))
    pair_means = np.concatenate([(times[:-1] + times[1:]) / 2, [0.0]])
    adjacent = _span_sums(pair_means) - pair_means[None, :]
    working_set = _span_sums(profile.stash_bytes) / devices
    return _span_sums(times), (last - first).astype(float), adjacent, working_set


def _stage_table(
    profile: LayerProfile, overhead: StageOverhead, devices: int = 1
) -> NDArray[np.float64]:
    """f64[L, L] predicted seconds of stage ``i..j`` (inclusive); inf for i > j."""
    total, boundaries, adjacent, working_set = _features(profile, devices)
    table = (
        total * (1 + overhead.spill_fraction * (working_set > overhead.spill_bytes))
        - overhead.per_boundary_s * boundaries
        - overhead.boundary_fraction * adjacent
    )
    return np.where(boundaries >= 0, table, np.inf)


def fit_stage_overhead(
    profile: LayerProfile, spans: Sequence[tuple[int, int]] | None = None
) -> StageOverhead:
    """Fit :class:`StageOverhead` to the spans timed as one function.

    Least squares on the *relative* error of the predicted span times with
    ``|per_boundary_s| <= min(layer time) / 2``, ``|boundary_fraction| <= 1/2``
    (so predictions stay positive) and ``0 <= spill_fraction <= 2``. Negative
    boundary terms are allowed: a span measured slower than its layers' sum
    fits a boundary *cost*. ``spill_bytes`` is chosen among ``inf`` and the
    geometric midpoints between the working sets of the fitted spans that lie
    above the largest single layer's (every single layer is its measurement);
    the best residual wins, ``inf`` on ties.

    Args:
        profile: the measurements. spans: a subset of ``profile.spans`` to fit
            on (held-out checks); default all of them.
    """
    chosen = profile.spans if spans is None else tuple(tuple(s) for s in spans)
    missing = [s for s in chosen if s not in profile.spans]
    if missing:
        raise ValueError(
            f"spans must be among the profiled spans {list(profile.spans)}, "
            f"got {missing}"
        )
    if not chosen:
        return StageOverhead()
    starts, ends = (np.array(side) for side in zip(*chosen, strict=True))
    ends = ends - 1
    total, boundaries, adjacent, working_set = (
        table[starts, ends] for table in _features(profile)
    )
    measured = profile.span_times_s[[profile.spans.index(s) for s in chosen]]
    target = (total - measured) / measured
    largest_layer = float(profile.stash_bytes.max())
    sizes = np.unique(
        np.append(working_set[working_set > largest_layer], largest_layer)
    )
    upper = np.array([profile.layer_times_s.min() / 2, 0.5, 2.0])
    best = (math.inf, StageOverhead(num_spans=len(chosen)))
    for capacity in [math.inf, *np.sqrt(sizes[:-1] * sizes[1:])]:
        spill = total * (working_set > capacity)
        columns = [boundaries, adjacent, -spill][: 3 if spill.any() else 2]
        rows = np.stack(columns, axis=1) / measured[:, None]
        bound = upper[: len(columns)]
        fit = lsq_linear(rows, target, bounds=(-bound * [1, 1, 0][: len(bound)], bound))
        residual = float(np.sum((rows @ fit.x - target) ** 2))
        if residual < best[0] * (1 - 1e-9) - 1e-15:
            values = [*np.clip(fit.x, -bound, bound), 0.0][:3]
            overhead = StageOverhead(*(float(v) for v in values), capacity, len(chosen))
            best = (residual, overhead)
    return best[1]


def predict_span_time(
    profile: LayerProfile,
    start: int,
    stop: int,
    overhead: StageOverhead | None = None,
) -> float:
    """Predicted seconds of layers ``start..stop-1`` (half-open) as one stage.

    ``overhead`` defaults to :func:`fit_stage_overhead` on all profiled spans.
    """
    if not 0 <= start < stop <= profile.num_layers:
        raise ValueError(
            f"span must satisfy 0 <= start < stop <= {profile.num_layers}, "
            f"got {(start, stop)}"
        )
    overhead = fit_stage_overhead(profile) if overhead is None else overhead
    return float(_stage_table(profile, overhead)[start, stop - 1])


@dataclasses.dataclass(frozen=True)
class DataParallelScaling:
    """Assumed (not measured) cost of a stage on a submesh of ``d > 1`` devices.

    Each micro-batch is split over the ``d`` devices (data parallelism):

    * compute: ``t_1 * ((1 - parallel_fraction) + parallel_fraction / d)``
      (Amdahl), ``t_1`` the measured one-device stage time;
    * gradients: a ring all-reduce of the stage's parameter bytes ``P`` once per
      iteration, ``2 (d - 1) * allreduce_latency_s + 2 (d - 1) / d * P / bw``
      with ``bw`` the intra-host bandwidth on one host, the inter-host one
      otherwise; charged ``1 / B`` of it per micro-batch.

    Defaults are round numbers for a GPU server (NVLink-class 100 GB/s inside a
    host, 100 Gb/s = 12.5 GB/s between hosts); set them for your cluster.
    """

    parallel_fraction: float = 0.95
    allreduce_latency_s: float = 1e-5
    intra_host_bandwidth: float = 100e9
    inter_host_bandwidth: float = 12.5e9

    def __post_init__(self) -> None:
        if not 0.0 <= self.parallel_fraction <= 1.0:
            raise ValueError(
                f"parallel_fraction must be in [0, 1], got {self.parallel_fraction}"
            )
        latency = self.allreduce_latency_s
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(
                f"allreduce_latency_s must be finite and >= 0, got {latency}"
            )
        for name in ("intra_host_bandwidth", "inter_host_bandwidth"):
            if not getattr(self, name) > 0:  # inf: free communication
                raise ValueError(
                    f"{name} must be > 0 bytes/s, got {getattr(self, name)}"
                )

    def stage_time(
        self, one_device_s, param_bytes, hosts: int, devices: int, num_microbatches: int
    ):
        """Seconds per micro-batch on a ``hosts x devices`` submesh (arrays ok)."""
        count = hosts * devices
        if count == 1:
            return one_device_s
        fraction = self.parallel_fraction
        compute = one_device_s * ((1 - fraction) + fraction / count)
        bandwidth = (
            self.intra_host_bandwidth if hosts == 1 else self.inter_host_bandwidth
        )
        allreduce = (
            2
            * (count - 1)
            * (self.allreduce_latency_s + param_bytes / (count * bandwidth))
        )
        return compute + allreduce / num_microbatches


def problem_from_layer_profile(
    profile: LayerProfile,
    cluster: tuple[int, int] = (1, 1),
    *,
    num_microbatches: int,
    scaling: DataParallelScaling | None = None,
    overhead: StageOverhead | None = None,
    submesh_space: str = "power_of_two",
    memory_budget_bytes: float | None = None,
    weight_memory_factor: float = 4.0,
) -> Problem:
    """A one-config :class:`Problem` (K = 1) from measured layer times.

    ``compute_cost[i, j, m, 0]`` is :func:`predict_span_time` of layers ``i..j``
    (inclusive), its working-set term taken per device, scaled to submesh ``m``
    by ``scaling``.

    Args:
        profile: the measurements. cluster: ``(num_hosts, devices_per_host)``.
        num_microbatches: B.
        scaling: required when the cluster has more than one device (only one
            was measured); see :class:`DataParallelScaling`.
        overhead: default :func:`fit_stage_overhead` of the profile.
        submesh_space: Alpa's submesh space (:func:`get_submesh_choices`).
        memory_budget_bytes: device memory for one stage; ``None`` = unlimited.
            Otherwise ``max_n_succ_stages = floor((budget - weight_memory_factor
            * params) / (stash / d)) - 1``: replicated weights, gradients and
            optimizer state (4x the parameters for Adam), and the summed layer
            stashes of each in-flight micro-batch split over ``d`` devices.

    Raises:
        ValueError: a multi-device cluster without ``scaling``, bad arguments.
        ProblemError: from :class:`Problem` / :func:`get_submesh_choices`.
    """
    num_hosts, devices_per_host = (int(x) for x in cluster)
    if num_hosts * devices_per_host > 1 and scaling is None:
        raise ValueError(
            f"cluster {(num_hosts, devices_per_host)} has "
            f"{num_hosts * devices_per_host} devices but the profile measured one; "
            "pass scaling=DataParallelScaling(...) to state how stages scale"
        )
    scaling = DataParallelScaling() if scaling is None else scaling
    overhead = fit_stage_overhead(profile) if overhead is None else overhead
    batches = _check_count(num_microbatches, "num_microbatches", 1)
    shapes = get_submesh_choices(num_hosts, devices_per_host, submesh_space)
    params = _span_sums(profile.param_bytes)
    cost = np.stack(
        [
            scaling.stage_time(
                _stage_table(profile, overhead, h * d), params, h, d, batches
            )
            for h, d in shapes
        ],
        axis=-1,
    )[..., None]
    memory = None
    if memory_budget_bytes is not None:
        if not (memory_budget_bytes > 0 and weight_memory_factor >= 0):
            raise ValueError(
                "memory_budget_bytes must be > 0 and weight_memory_factor >= 0, got "
                f"{memory_budget_bytes} and {weight_memory_factor}"
            )
        stash = np.maximum(_span_sums(profile.stash_bytes), 1.0)
        free = memory_budget_bytes - weight_memory_factor * params
        memory = np.stack(
            [np.floor(free / (stash / (h * d))) - 1 for h, d in shapes], axis=-1
        )
        memory = np.clip(memory, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)
        memory = memory[..., None]
    return Problem(
        compute_cost=cost,
        max_n_succ_stages=memory,
        submesh_shapes=np.asarray(shapes, dtype=np.int64),
        cluster_shape=(num_hosts, devices_per_host),
        num_microbatches=batches,
    )


def profile_to_problem(
    model_name: str,
    out_path: str | os.PathLike | None = None,
    *,
    cluster: tuple[int, int] = (1, 1),
    num_microbatches: int = 8,
    repeats: int = 10,
    warmup: int = 2,
    scaling: DataParallelScaling | None = None,
    memory_budget_bytes: float | None = None,
    progress_fn: ProgressFn | None = None,
) -> tuple[Problem, LayerProfile]:
    """Profile a preset and build its problem in one call (for the CLI).

    With ``out_path`` the problem file is written (DESIGN section 2) with the
    extra keys ``layer_names``, ``layer_times_s``, ``activation_bytes``,
    ``stash_bytes``, ``param_bytes``, ``backend``, ``model_name``,
    ``per_boundary_s`` and ``boundary_fraction`` (ignored by problem readers).
    """
    profile = profile_model(
        model_name, repeats=repeats, warmup=warmup, progress_fn=progress_fn
    )
    overhead = fit_stage_overhead(profile)
    problem = problem_from_layer_profile(
        profile,
        cluster,
        num_microbatches=num_microbatches,
        scaling=scaling,
        overhead=overhead,
        memory_budget_bytes=memory_budget_bytes,
    )
    if out_path is not None:
        np.savez(
            out_path,
            compute_cost=problem.compute_cost,
            max_n_succ_stages=problem.max_n_succ_stages,
            submesh_shapes=problem.submesh_shapes,
            cluster_shape=np.asarray(problem.cluster_shape, dtype=np.int64),
            num_microbatches=np.asarray(problem.num_microbatches, dtype=np.int64),
            layer_names=np.asarray(profile.layer_names),
            layer_times_s=profile.layer_times_s,
            activation_bytes=profile.activation_bytes,
            stash_bytes=profile.stash_bytes,
            param_bytes=profile.param_bytes,
            backend=np.asarray(profile.backend),
            model_name=np.asarray(profile.model_name),
            per_boundary_s=np.asarray(overhead.per_boundary_s),
            boundary_fraction=np.asarray(overhead.boundary_fraction),
        )
    return problem, profile
