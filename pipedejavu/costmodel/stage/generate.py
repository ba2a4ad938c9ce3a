"""Generated instances of Alpa's problem, for tests, benchmarks and the demo.

Real Alpa profiles are few and small; these instances follow the same shapes and
conventions at any size. The model is deliberately simple and stated in full:

* Layer ``l`` has a compute weight ``w_l`` (seconds of forward + backward work
  on one device): ~1 for transformer blocks with +-``irregularity`` noise; the
  first layer (embedding) and the last (LM head) weigh ``edge_weight``.
* A stage of layers ``i..j`` on submesh ``m`` of ``n`` devices with config ``k``
  costs ``sum(w_i..w_j) / (n * efficiency_k(n)) + overhead_k(n)`` where
  ``efficiency_k(n) = 1 / (1 + alpha_k * log2(n))`` (communication grows with
  the degree of model parallelism; configs differ in ``alpha_k``) and
  ``overhead_k(n) = beta_k * log2(1 + n) * (j - i + 1)`` (per-layer collectives).
  Multiplicative noise ``1 +- noise`` stands in for measurement error.
* Memory: a stage stores ``p_l / n`` parameter-and-optimizer bytes per device
  and ``a_l / n`` activation bytes per in-flight micro-batch per layer; 1F1B
  keeps ``s + 1`` micro-batches in flight when ``s`` stages follow, so
  ``max_n_succ_stages = floor((capacity - params) / activations) - 1``
  (``-1`` when the parameters alone do not fit), Alpa's liveness rule.
  ``memory_tightness`` scales how much of the device memory is usable.
* ``missing`` is the fraction of entries left unprofiled (inf), as Alpa's
  ``stage_imbalance_tolerance`` and failed profiles leave them.
"""

from __future__ import annotations

import numpy as np

from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    Problem,
    get_submesh_choices,
)

__all__ = ["random_problem"]


def random_problem(
    num_layers: int,
    cluster_shape: tuple[int, int],
    *,
    num_microbatches: int = 32,
    submesh_space: str = "power_of_two",
    num_configs: int = 2,
    irregularity: float = 0.2,
    edge_weight: float = 2.5,
    noise: float = 0.02,
    missing: float = 0.0,
    memory_tightness: float | None = None,
    seed: int = 0,
) -> Problem:
    """A GPT-like instance of Alpa's problem (see the module docstring).

    Args:
        num_layers: L >= 1.
        cluster_shape: ``(num_hosts, devices_per_host)``, devices per host a power
            of two (Alpa's submesh choices need it).
        num_microbatches: B.
        submesh_space: Alpa's submesh space.
        num_configs: K autosharding config slots.
        irregularity: relative spread of the block weights.
        edge_weight: weight of the first and last layer relative to a block.
        noise: multiplicative measurement noise on every entry.
        missing: fraction of entries set to inf (unprofiled).
        memory_tightness: ``None`` for unlimited memory; otherwise the usable
            memory per device in units of "one layer's parameters on one device"
            times L / D — around 1-3 makes memory bind for long stages.
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        A validated :class:`Problem`; costs in seconds.
    """
    rng = np.random.default_rng(seed)
    num_hosts, devices_per_host = cluster_shape
    shapes = np.array(
        get_submesh_choices(num_hosts, devices_per_host, submesh_space), dtype=np.int64
    )
    sizes = (shapes[:, 0] * shapes[:, 1]).astype(np.float64)
    weights = 1.0 + irregularity * rng.uniform(-1, 1, num_layers)
    if num_layers > 1:
        weights[0] = weights[-1] = edge_weight
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    starts, ends = np.triu_indices(num_layers)
    span_work = prefix[ends + 1] - prefix[starts]  # [P]
    span_len = (ends - starts + 1).astype(np.float64)
    alpha = rng.uniform(0.02, 0.15, num_configs)
    beta = rng.uniform(0.001, 0.01, num_configs)
    log_n = np.log2(sizes)
    efficiency = 1.0 / (1.0 + alpha[None, :] * log_n[:, None])  # [M, K]
    overhead = beta[None, :] * np.log2(1.0 + sizes)[:, None]  # [M, K]
    cost = (
        span_work[:, None, None] / (sizes[:, None] * efficiency)[None]
        + overhead[None] * span_len[:, None, None]
    )
    cost *= 1.0 + noise * rng.uniform(-1, 1, cost.shape)
    table = np.full((num_layers, num_layers, len(sizes), num_configs), np.inf)
    table[starts, ends] = cost
    if missing > 0:
        upper = np.zeros(table.shape, dtype=bool)
        upper[starts, ends] = True
        table[upper & (rng.random(table.shape) < missing)] = np.inf

    memory = None
    if memory_tightness is not None:
        num_devices = num_hosts * devices_per_host
        params = np.where(np.arange(num_layers) == 0, 3.0, 1.0)  # embedding is big
        activations = np.full(num_layers, 0.25)
        param_prefix = np.concatenate([[0.0], np.cumsum(params)])
        act_prefix = np.concatenate([[0.0], np.cumsum(activations)])
        capacity = memory_tightness * num_layers / num_devices
        stage_params = (param_prefix[ends + 1] - param_prefix[starts])[:, None] / sizes
        stage_acts = (act_prefix[ends + 1] - act_prefix[starts])[:, None] / sizes
        limit = np.floor((capacity - stage_params) / stage_acts) - 1
        limit = np.where(stage_params > capacity, -1, limit)
        limit = np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)
        memory = np.full(table.shape, -1, dtype=np.int64)
        memory[starts, ends] = limit[:, :, None]
    return Problem(
        compute_cost=table,
        max_n_succ_stages=memory,
        submesh_shapes=shapes,
        cluster_shape=(num_hosts, devices_per_host),
        num_microbatches=num_microbatches,
    )
