"""The relaxed objective: soft stage boundaries, soft device shares, smooth max.

A plan is relaxed into two small parameter arrays per restart:

* ``boundary_logits`` f[S]: stage lengths are ``L * softmax(boundary_logits)``,
  so the stage ends ``c_s = L * cumsum(softmax)`` are increasing and end at L:
  contiguity holds by construction and rounding the ends gives a contiguous
  partition. A stage whose share shrinks to zero disappears, so one compiled
  function searches every number of stages up to S (and ``stage_mask`` turns
  slots off per restart to seed different counts).
* ``slot_logits`` f[S, C]: a softmax over the C usable (submesh, config) slots
  per stage.

Layer ``l`` belongs to stage ``s`` with weight
``P[l, s] = sigmoid((c_s - l - 1/2) / tau) - sigmoid((c_{s-1} - l - 1/2) / tau)``
(``tau`` in layers, annealed towards 0). With the linear latency model
``t(i..j, c) ~ a_c + sum_l b[l, c]`` a soft stage costs
``t_s = sum_c W[s, c] (presence_s a_c + sum_l P[l, s] b[l, c])`` — one matmul.
The device budget enters as a squared penalty on ``sum_s presence_s sum_c W[s, c]
size_c - D`` relative to D, and the slowest stage as ``tau_max *
logsumexp(t / tau_max)``. Every quantity is normalized by ``scale`` (a typical
stage latency) so one set of temperatures fits any unit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

#: Matrix products of the relaxation in full float32: a GPU would otherwise
#: run them in TF32 (10-bit mantissa), which moved stage costs by 1e-4 to 1e-3
#: relative and made the vmapped and looped restarts disagree on an H200.
EXACT = jax.lax.Precision.HIGHEST


class RelaxedProblem(NamedTuple):
    """The arrays the relaxed objective reads (a pytree; no Python scalars).

    Attributes:
        per_layer: f[L, C] seconds per layer on each usable slot, / ``scale``.
        intercept: f[C] seconds per stage on each slot, / ``scale``.
        slot_devices: f[C] devices of each slot's submesh.
        num_devices: f[] D.
        num_microbatches: f[] B.
        num_layers: f[] L when ``per_layer`` has padding rows (zeros) after the
            L layers, so that problems of similar sizes share compiled code;
            None: ``per_layer.shape[0]``.
    """

    per_layer: jax.Array
    intercept: jax.Array
    slot_devices: jax.Array
    num_devices: jax.Array
    num_microbatches: jax.Array
    num_layers: jax.Array | None = None


class RelaxedParams(NamedTuple):
    """One restart's parameters: ``boundary_logits`` f[S], ``slot_logits`` f[S, C]."""

    boundary_logits: jax.Array
    slot_logits: jax.Array


class Temperatures(NamedTuple):
    """``boundary`` (layers), ``slot`` (logit units), ``max`` (relative latency),
    ``penalty`` (weight of the device-budget term)."""

    boundary: jax.Array
    slot: jax.Array
    max: jax.Array
    penalty: jax.Array


_MASKED = -1e4  # logit of a switched-off stage slot


def stage_ends(params: RelaxedParams, stage_mask: jax.Array, num_layers: Any):
    """Soft stage ends ``c_1..c_S`` (f[S], layers) and lengths (f[S]);
    ``num_layers`` may be traced."""
    logits = jnp.where(stage_mask, params.boundary_logits, _MASKED)
    lengths = num_layers * jax.nn.softmax(logits)
    return jnp.cumsum(lengths), lengths


def soft_assignment(ends: jax.Array, num_layers: int, tau: jax.Array) -> jax.Array:
    """``P[l, s]``, f[L, S]: how much layer l belongs to stage s.

    ``sigmoid((c_s - l - 1/2) / tau)`` is the weight of "layer l ends before
    ``c_s``"; the ends increase, so consecutive differences are >= 0 and a row
    sums to ``sigmoid((L - l - 1/2) / tau)`` ~ 1.
    """
    centers = jnp.arange(num_layers, dtype=ends.dtype)[:, None] + 0.5
    before_end = jax.nn.sigmoid((ends[None, :] - centers) / tau)
    before_start = jnp.concatenate(
        [jnp.zeros_like(before_end[:, :1]), before_end[:, :-1]], axis=1
    )
    return before_end - before_start


class SoftStages(NamedTuple):
    """The relaxed stages of one restart (shared by both engines)."""

    ends: jax.Array  # f[S] soft end of each stage (layers)
    presence: jax.Array  # f[S] ~1 for a stage of >= 1 layer, ~0 if it vanished
    weights: jax.Array  # f[S, C] softmax over the slots
    latency: jax.Array  # f[S] expected latency (/ scale)


def soft_stages(
    params: Any, data: Any, stage_mask: jax.Array, temps: Temperatures
) -> SoftStages:
    """Soft stage ends, presence, slot weights and expected latencies from
    ``params.boundary_logits`` / ``slot_logits`` and ``data.per_layer`` /
    ``intercept`` (any relaxed problem with those fields)."""
    rows = data.per_layer.shape[0]  # L, or L plus zero padding rows
    num_layers = getattr(data, "num_layers", None)
    ends, lengths = stage_ends(
        params, stage_mask, rows if num_layers is None else num_layers
    )
    # Padding rows lie past every end: they belong to no stage.
    membership = soft_assignment(ends, rows, temps.boundary)  # [rows, S]
    presence = 1.0 - jnp.exp(-3.0 * lengths)  # ~1 for a stage of >= 1 layer
    weights = jax.nn.softmax(params.slot_logits / temps.slot, axis=-1)  # [S, C]
    layer_work = jnp.matmul(membership.T, data.per_layer, precision=EXACT)  # [S, C]
    latency = jnp.sum(
        weights * (presence[:, None] * data.intercept[None, :] + layer_work), axis=-1
    )
    return SoftStages(ends, presence, weights, latency)


def relaxed_terms(
    params: RelaxedParams,
    data: RelaxedProblem,
    stage_mask: jax.Array,
    temps: Temperatures,
) -> dict[str, jax.Array]:
    """Stage latencies and the parts of the relaxed objective (all / ``scale``)."""
    _, presence, weights, latency = soft_stages(params, data, stage_mask, temps)
    devices = jnp.sum(
        presence * jnp.matmul(weights, data.slot_devices, precision=EXACT)
    )
    smooth_max = temps.max * jax.nn.logsumexp(latency / temps.max)
    budget = (devices - data.num_devices) / data.num_devices
    objective = jnp.sum(latency) + (data.num_microbatches - 1.0) * smooth_max
    return {
        "latency": latency,
        "devices": devices,
        "objective": objective,
        "penalty": temps.penalty * budget**2,
        "loss": objective + temps.penalty * budget**2,
    }


def relaxed_loss(
    params: RelaxedParams,
    data: RelaxedProblem,
    stage_mask: jax.Array,
    temps: Temperatures,
) -> jax.Array:
    """The scalar the optimizer minimizes for one restart."""
    return relaxed_terms(params, data, stage_mask, temps)["loss"]
