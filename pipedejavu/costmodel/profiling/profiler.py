"""Measured layer costs: time the layers of a small flax GPT and build a Problem.

The model (:class:`~pipedejavu.costmodel.profiling.gpt_model.GPTConfig`, presets in
:data:`~pipedejavu.costmodel.profiling.gpt_model.MODEL_NAMES`, defined in
:mod:`pipedejavu.costmodel.profiling.gpt_model`) is cut into Alpa's pipeline
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

The stage model fitted on these measurements is in
:mod:`pipedejavu.costmodel.profiling.stage_overhead`; the problem built from them in
:mod:`pipedejavu.costmodel.profiling.layer_problem`.
Units: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import NDArray

from pipedejavu.costmodel.profiling.gpt_model import (
    GPTConfig,
    gpt_config,
    gpt_modules,
    layer_names,
    span_step,
)

__all__ = ["LayerProfile", "ProgressFn", "check_count", "profile_model"]

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


def check_count(value: object, name: str, minimum: int) -> int:
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
    repeats = check_count(repeats, "repeats", 1)
    warmup = check_count(warmup, "warmup", 0)
    burst = check_count(burst, "burst", 1)
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
