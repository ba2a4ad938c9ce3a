"""Pollux/AdaptDL's goodput model: ``GoodputFunction`` and ``fit_perf_params``.

A drop-in port of AdaptDL's ``adaptdl/goodput.py`` (the variant of
``../shared/seeds/000_*.txt``): the same names, argument order, broadcasting and
results, in JAX. ``GoodputFunction`` predicts the throughput, statistical
efficiency and goodput (their product) of data-parallel configurations, and
``optimize`` picks, per ``(num_nodes, num_replicas)``, the atomic batch size and
accumulation steps of the best of 50 geometrically sampled global batches.
``fit_perf_params`` fits the step-time model to measured step times.

Differences from AdaptDL, all on bad input: where AdaptDL asserts, this raises
:class:`GoodputInputError`, a ``ValueError`` (and, for code that caught
AdaptDL's bare ``assert``, an ``AssertionError``) naming the argument; the seed's
debug side effect (appending to ``./error.log`` before one assertion) is not
reproduced. ``fit_perf_params`` may return a better fit than AdaptDL's single
L-BFGS-B run (see its docstring).

The maths live in :mod:`.goodput_model` as pure, jittable, vmappable functions;
this module is the Python shell: input checks, float64, numpy results.

Example:
    >>> from pipedejavu.costmodel.goodput.function import GoodputFunction
    >>> fn = GoodputFunction((0.05, 0.001, 0.1, 0.01, 0.02, 0.001, 1.5),
    ...                      (0.5, 1.0), init_batch_size=128)
    >>> goodput, atomic_bsz, accum_steps = fn.optimize(
    ...     2, 8, max_batch_size=4096, atomic_bsz_range=(16, 256), accumulation=True)
    >>> atomic_bsz, accum_steps
    (82, 0)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from pipedejavu.costmodel.goodput import model
from pipedejavu.costmodel.goodput.fit import fit_perf_params, perf_objective
from pipedejavu.costmodel.goodput.model import (
    GradParams,
    PerfParams,
    candidate_configs,
    goodput_from_step_time,
    predict_accum_time,
    predict_log_optim_time,
    predict_network_time,
    predict_step_time,
)


class GoodputInputError(ValueError, AssertionError):
    """Bad input where AdaptDL asserts: a ValueError (and an AssertionError)."""


def _traced(*values: Any) -> bool:
    return any(
        isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(values)
    )


def _to_numpy(value: jax.Array) -> Any:
    array = np.asarray(value)
    return array[()] if array.ndim == 0 else array  # numpy scalar, as AdaptDL


@jax.jit
def _evaluate(perf, grad, init, num_nodes, num_replicas, atomic_bsz, accum_steps):
    batch_size = model.global_batch(num_replicas, atomic_bsz, accum_steps)
    values = model.goodput(
        perf, grad, init, num_nodes, num_replicas, atomic_bsz, accum_steps
    )
    return values, jnp.all(init <= batch_size)


_throughput = jax.jit(model.throughput)
_efficiency = jax.jit(model.efficiency)


@functools.partial(jax.jit, static_argnames="accumulation")
def _optimize(perf, grad, init, nodes, replicas, max_batch, lo, hi, accumulation):
    def one(num_nodes, num_replicas):
        return model.optimize_one(
            perf, grad, init, num_nodes, num_replicas, max_batch, lo, hi, accumulation
        )

    return jax.vmap(one)(nodes, replicas)


def _as_params(values: Any, cls: type, name: str):
    try:
        items = tuple(values)
    except TypeError:
        raise ValueError(
            f"{name} must be a sequence of {len(cls._fields)} numbers "
            f"{cls._fields}, got {values!r}"
        ) from None
    if len(items) != len(cls._fields):
        raise ValueError(
            f"{name} must have {len(cls._fields)} values {cls._fields}, "
            f"got {len(items)}"
        )
    if not _traced(items):
        items = tuple(float(v) for v in items)
    return cls(*items)


class GoodputFunction:
    """Pollux's goodput of data-parallel configurations (AdaptDL's interface).

    Args:
        perf_params: :class:`PerfParams` or 7 numbers in its order.
        grad_params: :class:`GradParams` or ``(sqr, var)``.
        init_batch_size: the batch size the gradient statistics were measured
            at (and the smallest allowed global batch), samples; positive.

    Arguments named ``num_nodes, num_replicas, atomic_bsz, accum_steps`` are
    array-likes broadcasting together (ints: nodes, replicas, samples per replica
    per micro-step, extra micro-steps per optimizer step). Results are float64
    numpy arrays of the broadcast shape (numpy scalars for scalar inputs). Under
    ``jax.jit``/``jax.vmap``/``jax.grad`` (traced inputs) the methods skip the
    input checks and return JAX arrays in the ambient precision.
    """

    def __init__(
        self, perf_params: ArrayLike, grad_params: ArrayLike, init_batch_size: ArrayLike
    ) -> None:
        self._perf_params = _as_params(perf_params, PerfParams, "perf_params")
        self._grad_params = _as_params(grad_params, GradParams, "grad_params")
        if not _traced(init_batch_size):
            init = float(init_batch_size)
            if not (math.isfinite(init) and init > 0):
                raise ValueError(
                    f"init_batch_size must be positive, got {init_batch_size!r}"
                )
        self._init_batch_size = init_batch_size

    @property
    def perf_params(self) -> PerfParams:
        return self._perf_params

    @property
    def grad_params(self) -> GradParams:
        return self._grad_params

    @property
    def init_batch_size(self) -> ArrayLike:
        return self._init_batch_size

    def __repr__(self) -> str:
        return (
            f"GoodputFunction({self._perf_params}, {self._grad_params}, "
            f"init_batch_size={self._init_batch_size})"
        )

    def __call__(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Same as :meth:`evaluate`."""
        return self.evaluate(num_nodes, num_replicas, atomic_bsz, accum_steps)

    def evaluate(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Goodput (useful samples per second) = throughput x efficiency.

        Raises:
            GoodputInputError: a global batch ``num_replicas * atomic_bsz *
                (accum_steps + 1)`` is below ``init_batch_size``.
        """
        args = (num_nodes, num_replicas, atomic_bsz, accum_steps)
        if _traced(self._perf_params, self._grad_params, self._init_batch_size, args):
            return model.goodput(
                self._perf_params, self._grad_params, self._init_batch_size, *args
            )
        with jax.enable_x64(True):
            values, ok = _evaluate(
                self._perf_params,
                self._grad_params,
                self._init_batch_size,
                *(np.asarray(a) for a in args),
            )
            if not bool(ok):
                batch = model.global_batch(
                    np.asarray(num_replicas),
                    np.asarray(atomic_bsz),
                    np.asarray(accum_steps),
                )
                raise GoodputInputError(
                    "num_replicas * atomic_bsz * (accum_steps + 1) must be at least "
                    f"init_batch_size = {self._init_batch_size}, got the global "
                    f"batch {np.min(batch)}"
                )
            return _to_numpy(values)

    def throughput(self, num_nodes, num_replicas, atomic_bsz, accum_steps):
        """Samples per second of the predicted step time (no batch-size check)."""
        args = (num_nodes, num_replicas, atomic_bsz, accum_steps)
        if _traced(self._perf_params, args):
            return model.throughput(self._perf_params, *args)
        with jax.enable_x64(True):
            return _to_numpy(
                _throughput(self._perf_params, *(np.asarray(a) for a in args))
            )

    def efficiency(self, batch_size):
        """Statistical efficiency of ``batch_size`` (any positive value)."""
        if _traced(self._grad_params, self._init_batch_size, batch_size):
            return model.efficiency(
                self._grad_params, self._init_batch_size, batch_size
            )
        with jax.enable_x64(True):
            return _to_numpy(
                _efficiency(
                    self._grad_params, self._init_batch_size, np.asarray(batch_size)
                )
            )

    def optimize(
        self,
        num_nodes,
        num_replicas,
        max_batch_size=None,
        atomic_bsz_range=None,
        accumulation=False,
    ):
        """The best ``(goodput, atomic_bsz, accum_steps)`` per configuration.

        Samples 50 global batches geometrically between ``max(init_batch_size,
        min_atomic * num_replicas)`` and ``max_batch_size``, derives each one's
        atomic batch and accumulation steps (:func:`.goodput_model.candidate_configs`),
        and keeps the first best goodput; a candidate whose atomic batch falls
        outside ``atomic_bsz_range`` counts as goodput 0.

        Args:
            num_nodes: nodes of each configuration; array-like, >= 1.
            num_replicas: replicas (GPUs) of each configuration, >= num_nodes;
                broadcasts with num_nodes.
            max_batch_size: the largest global batch (default init_batch_size).
            atomic_bsz_range: ``(min, max)`` samples per replica per micro-step;
                ``None`` or 0 at either end means no bound (1 and max_batch_size).
            accumulation: allow gradient accumulation steps.

        Returns:
            ``(goodput, atomic_bsz, accum_steps)``: float and int numpy arrays of
            the broadcast shape; Python scalars if num_nodes or num_replicas is
            a scalar (then the other must have one element).

        Raises:
            GoodputInputError: num_nodes < 1, num_nodes > num_replicas,
                max_batch_size < init_batch_size, or a sampled global batch below
                init_batch_size (atomic_bsz_range with a non-positive minimum).
            ValueError: the inputs do not broadcast, or a scalar meets an array
                of several elements.
        """
        init = self._init_batch_size
        nodes = np.asarray(num_nodes)
        replicas = np.asarray(num_replicas)
        if not np.all(np.less_equal(1, nodes)):
            raise GoodputInputError(f"num_nodes must all be >= 1, got {num_nodes}")
        if not np.all(np.less_equal(nodes, replicas)):
            raise GoodputInputError(
                "num_nodes must not exceed num_replicas, got "
                f"num_nodes {num_nodes} and num_replicas {num_replicas}"
            )
        if max_batch_size is None:
            max_batch_size = init
        if np.ndim(max_batch_size) != 0:
            raise ValueError(f"max_batch_size must be a number, got {max_batch_size!r}")
        if not init <= max_batch_size:
            raise GoodputInputError(
                f"max_batch_size must be at least init_batch_size = {init}, "
                f"got {max_batch_size}"
            )
        atomic_bsz_range = atomic_bsz_range or (None, None)
        if len(atomic_bsz_range) != 2:
            raise ValueError(
                f"atomic_bsz_range must be (min, max), got {atomic_bsz_range!r}"
            )
        min_atomic_bsz = atomic_bsz_range[0] or 1
        max_atomic_bsz = atomic_bsz_range[1] or max_batch_size

        output_shape = np.broadcast(nodes, replicas).shape
        output_scalar = np.isscalar(num_nodes) or np.isscalar(num_replicas)
        size = math.prod(output_shape)
        # Pad to a power of two with (1 node, 1 replica): fewer compilations.
        padded = np.ones((2, max(8, 1 << max(size - 1, 0).bit_length())))
        padded[0, :size] = np.broadcast_to(nodes, output_shape).flatten()
        padded[1, :size] = np.broadcast_to(replicas, output_shape).flatten()
        with jax.enable_x64(True):
            results = _optimize(
                self._perf_params,
                self._grad_params,
                np.float64(init),
                padded[0],
                padded[1],
                np.float64(max_batch_size),
                np.float64(min_atomic_bsz),
                np.float64(max_atomic_bsz),
                accumulation=bool(accumulation),
            )
        goodput, atomic_bsz, accum_steps, ok = (np.asarray(r)[:size] for r in results)
        if not np.all(ok):  # AdaptDL's evaluate() asserts this
            raise GoodputInputError(
                "a sampled candidate's global batch num_replicas * atomic_bsz * "
                f"(accum_steps + 1) is below init_batch_size = {init}"
            )
        goodput = goodput.reshape(output_shape)
        atomic_bsz = atomic_bsz.reshape(output_shape)
        accum_steps = accum_steps.reshape(output_shape)
        if output_scalar:
            if goodput.size != 1:
                raise ValueError(
                    "num_nodes or num_replicas is a scalar, so the other must have "
                    f"one element for a scalar result, got shape {output_shape}"
                )
            return goodput.item(), atomic_bsz.item(), accum_steps.item()
        return goodput, atomic_bsz, accum_steps


__all__ = [
    "GoodputFunction",
    "GoodputInputError",
    "GradParams",
    "PerfParams",
    "candidate_configs",
    "fit_perf_params",
    "goodput_from_step_time",
    "perf_objective",
    "predict_accum_time",
    "predict_log_optim_time",
    "predict_network_time",
    "predict_step_time",
]
