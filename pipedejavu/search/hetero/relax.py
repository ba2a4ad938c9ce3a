"""The relaxed objective of hardware-aware stage construction.

The homogeneous relaxation (:mod:`pipedejavu.search.engine.relax`) extended to typed
devices and costly links. One restart has two parameter arrays:

* ``boundary_logits`` f[S]: stage lengths ``L * softmax``, soft ends
  ``c_s = cumsum`` (contiguity by construction; stages may vanish), sigmoid
  membership ``P[l, s]`` (:func:`pipedejavu.search.engine.relax.soft_assignment`).
* ``slot_logits`` f[S, C]: a softmax over the C usable slots per stage: a
  ``(submesh, config, type)``, or a whole-host submesh over hosts of several
  types (priced by its slowest type's model); ``share[c, t]`` is the fraction of
  slot c's devices of type t (one-hot for one type), and a stage's type share
  is ``pi[s, t] = sum_c W[s, c] share[c, t]``.

Terms (all divided by ``scale``, a typical stage latency):

* Stage latency from the linear model fitted per slot:
  ``t_s = sum_c W[s, c] (presence_s a_c + sum_l P[l, s] b[l, c])``.
* Devices per type ``n[s, t] = presence_s sum_c W[s, c] size_c share[c, t]``;
  the budget penalty ``sum_t ((sum_s n[s, t] - D_t) / D)^2`` is annealed up.
* Transfer after stage s: the soft end ``c_s`` puts weight
  ``w[s, b] = sigmoid((c_s - b + 1/2) / tau) - sigmoid((c_s - b - 1/2) / tau)``
  on boundary ``b`` (after layer ``b - 1``), so the expected round trip on a
  link is ``sum_b w[s, b] time_link(bytes[b - 1])`` (no weight at ``L``: the
  last stage sends nothing). Types pair as ``pi[s] x pi[s + 1]``; two stages of
  one type are taken to share a host (intra-host link) when the first ends
  mid-host as packing in pipeline order would place it (the type's cumulative
  devices ``U``: ``mid = tanh(kappa sin^2(pi U / devices_per_host))``, 0 at host
  boundaries, ~1 elsewhere), else to use the inter-host link of their types.
  This is a smooth guide only: the rounding and the polish choose placements
  exactly over every valid plan. The transfer is weighted by the next stage's
  presence.
* The bottleneck: ``tau_max * logsumexp`` over stage latencies and transfers.

``loss = sum t + sum c + (B - 1) smooth_max + penalty * budget``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pipedejavu.search.engine.relax import (
    EXACT,
    RelaxedParams,
    Temperatures,
    soft_stages,
)

__all__ = [
    "HeteroRelaxedParams",
    "HeteroRelaxedProblem",
    "Temperatures",
    "hetero_relaxed_loss",
    "hetero_relaxed_terms",
]


class HeteroRelaxedProblem(NamedTuple):
    """The arrays the relaxed objective reads (a pytree of arrays).

    Attributes:
        per_layer: f[L, C] seconds per layer on each slot, / ``scale``.
        intercept: f[C] seconds per stage on each slot, / ``scale``.
        slot_devices: f[C] devices of each slot's submesh.
        slot_types: f[C, T] the share of each type in a slot's devices
            (one-hot for one type; zero rows: padding).
        type_devices: f[T] devices of each type ``D_t``.
        intra_time: f[L - 1, T] round trip after each layer on the intra-host
            link of each type, / ``scale``.
        inter_time: f[L - 1, T, T] the same on the inter-host links.
        devices_per_host: f[].
        num_microbatches: f[] B.
    """

    per_layer: jax.Array
    intercept: jax.Array
    slot_devices: jax.Array
    slot_types: jax.Array
    type_devices: jax.Array
    intra_time: jax.Array
    inter_time: jax.Array
    devices_per_host: jax.Array
    num_microbatches: jax.Array


#: One restart: ``boundary_logits`` f[S], ``slot_logits`` f[S, C] (the slots
#: are (submesh, config, type) here) -- the homogeneous engine's parameters.
HeteroRelaxedParams = RelaxedParams


def boundary_weights(ends: jax.Array, num_layers: int, tau: jax.Array) -> jax.Array:
    """f[S, L - 1]: how much the soft end ``c_s`` sits at boundary ``b = 1..L-1``."""
    positions = jnp.arange(1, num_layers, dtype=ends.dtype)[None, :]
    upper = jax.nn.sigmoid((ends[:, None] - positions + 0.5) / tau)
    lower = jax.nn.sigmoid((ends[:, None] - positions - 0.5) / tau)
    return upper - lower


def hetero_relaxed_terms(
    params: HeteroRelaxedParams,
    data: HeteroRelaxedProblem,
    stage_mask: jax.Array,
    temps: Temperatures,
) -> dict[str, jax.Array]:
    """Stage latencies, transfers and the parts of the loss (all / ``scale``)."""
    num_layers = data.per_layer.shape[0]
    ends, presence, weights, latency = soft_stages(params, data, stage_mask, temps)
    share = jnp.matmul(weights, data.slot_types, precision=EXACT)  # [S, T]
    devices = presence[:, None] * jnp.matmul(
        weights * data.slot_devices, data.slot_types, precision=EXACT
    )
    budget = (devices.sum(axis=0) - data.type_devices) / data.type_devices.sum()

    # Transfers between stage s and s + 1 (s = 0..S-2).
    at = boundary_weights(ends[:-1], num_layers, temps.boundary)  # [S-1, L-1]
    intra = jnp.matmul(at, data.intra_time, precision=EXACT)  # [S-1, T]
    inter = jnp.einsum(
        "sb,bpq->spq", at, data.inter_time, precision=EXACT
    )  # [S-1, T, T]
    cumulative = jnp.cumsum(devices, axis=0)[:-1]  # [S-1, T]
    wave = jnp.sin(jnp.pi * cumulative / data.devices_per_host) ** 2
    mid = jnp.tanh(0.5 * data.devices_per_host**2 * wave)
    same = mid * intra + (1.0 - mid) * jnp.diagonal(inter, axis1=1, axis2=2)
    pairs = share[:-1, :, None] * share[1:, None, :]  # [S-1, T, T]
    eye = jnp.eye(share.shape[1], dtype=share.dtype)
    transfer = jnp.sum(pairs * inter * (1.0 - eye), axis=(1, 2))
    transfer = transfer + jnp.sum(jnp.diagonal(pairs, axis1=1, axis2=2) * same, -1)
    transfer = presence[1:] * transfer

    both = jnp.concatenate([latency, transfer])
    smooth_max = temps.max * jax.nn.logsumexp(both / temps.max)
    objective = (
        jnp.sum(latency)
        + jnp.sum(transfer)
        + (data.num_microbatches - 1.0) * smooth_max
    )
    penalty = temps.penalty * jnp.sum(budget**2)
    return {
        "latency": latency,
        "transfer": transfer,
        "devices": devices,
        "objective": objective,
        "penalty": penalty,
        "loss": objective + penalty,
    }


def hetero_relaxed_loss(
    params: HeteroRelaxedParams,
    data: HeteroRelaxedProblem,
    stage_mask: jax.Array,
    temps: Temperatures,
) -> jax.Array:
    """The scalar the optimizer minimizes for one restart."""
    return hetero_relaxed_terms(params, data, stage_mask, temps)["loss"]
