"""Generated heterogeneous instances: GPT-like models on clusters of mixed devices.

The model is stated in full so that the numbers can be checked by hand:

* **Compute.** A transformer block of hidden size ``h`` on ``b x s`` tokens
  takes ``72 b s h^2 (1 + s / (6 h))`` flops forward + backward (Megatron-LM's
  count, no recomputation); the LM head ``6 b s h V``. ``num_layers`` clustered
  layers share ``num_blocks`` blocks evenly; the first and last layer carry the
  embedding / head. A layer's seconds on the reference device are its flops
  over ``reference_tflops``. Stage costs (how a span of layers speeds up on a
  submesh of ``n`` devices, configs, overheads, noise) come from
  :func:`pipedejavu.costmodel.stage.generate.random_problem`'s model, scaled to these
  seconds.
* **Device types.** Type ``t`` runs a stage ``1 / speed_t`` times as long as the
  reference, times an independent ``1 +- type_noise`` per entry (each type is
  profiled separately).
* **Memory per type.** A block holds ``12 h^2`` parameters (embedding and
  untied head ``V h`` each) at ``bytes_per_param`` (16: fp16 weights and
  gradients, fp32 master copy and Adam moments) and stashes
  ``activation_bytes * b s h`` bytes per in-flight micro-batch (34: Megatron's
  count without recomputation; 2 with full recomputation), the head also its
  fp16 logits ``2 b s V``. A stage shards both over its ``n`` devices; with
  ``usable_memory_fraction`` of ``DeviceType.memory_bytes`` per device, Alpa's
  rule gives ``max_n_succ_stages = floor((capacity - params) / activations) - 1``
  (``-1`` when the parameters do not fit): older devices with less memory get
  tighter limits. A type without ``memory_bytes`` is never limited.
* **Transfers.** The activation crossing a boundary is ``b s h`` fp16 values
  (``2 b s h`` bytes: 16.8 MB at ``h = 4096, s = 2048, b = 1``); the links come
  from the cluster (NVLink-class inside a host, 25-200 Gb/s between hosts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pipedejavu.core.cluster import Cluster, DeviceType, Link
from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.problem import UNLIMITED_SUCCEEDING_STAGES, ProblemError
from pipedejavu.costmodel.stage.generate import random_problem

__all__ = [
    "GPTSpec",
    "hetero_problem",
    "model_memory_limits",
    "three_type_cluster",
    "two_type_cluster",
]


@dataclasses.dataclass(frozen=True)
class GPTSpec:
    """A GPT-like model (defaults: GPT-3 6.7B, 32 blocks of width 4096).

    Args:
        hidden_size: h.
        seq_len: s, tokens per sequence.
        micro_batch_size: b, sequences per micro-batch.
        vocab_size: V.
        num_blocks: transformer blocks, shared evenly by the clustered layers
            (``None`` = one per layer, so the model grows with L).
        bytes_per_param: training-state bytes per parameter.
        activation_bytes: stashed bytes per token per hidden unit per block.
    """

    hidden_size: int = 4096
    seq_len: int = 2048
    micro_batch_size: int = 1
    vocab_size: int = 51200
    num_blocks: int | None = 32
    bytes_per_param: float = 16.0
    activation_bytes: float = 34.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "seq_len", "micro_batch_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ProblemError(
                    f"GPTSpec.{name} must be an integer >= 1, got {value!r}"
                )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ProblemError(
                f"GPTSpec.num_blocks must be >= 1, got {self.num_blocks}"
            )
        if self.bytes_per_param <= 0 or self.activation_bytes <= 0:
            raise ProblemError("GPTSpec byte counts must be > 0")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch_size

    @property
    def block_flops(self) -> float:
        """Forward + backward flops of one block per micro-batch."""
        h, s = self.hidden_size, self.seq_len
        return 72.0 * self.tokens * h * h * (1.0 + s / (6.0 * h))

    @property
    def boundary_bytes(self) -> float:
        """fp16 activation between two layers, per micro-batch."""
        return 2.0 * self.tokens * self.hidden_size


def _links(
    names: Sequence[str],
    intra_gbps: Sequence[float],
    inter_gbps: float,
    cross_gbps: float | None,
    intra_latency_us: float,
    inter_latency_us: float,
) -> tuple[dict[str, Link], dict[str, Link]]:
    if len(intra_gbps) != len(names):
        raise ProblemError(
            f"intra_host_gbps needs one value per type ({len(names)}), "
            f"got {len(intra_gbps)}"
        )
    intra = {
        n: Link(intra_latency_us * 1e-6, g * 1e9 / 8)
        for n, g in zip(names, intra_gbps, strict=True)
    }
    inter = {"default": Link(inter_latency_us * 1e-6, inter_gbps * 1e9 / 8)}
    if cross_gbps is not None:
        for a, first in enumerate(names):
            for second in names[a + 1 :]:
                inter[f"{first}-{second}"] = Link(
                    inter_latency_us * 1e-6, cross_gbps * 1e9 / 8
                )
    return intra, inter


def _host_list(counts: Sequence[int], order: str) -> list[int]:
    if order == "grouped":
        return [t for t, count in enumerate(counts) for _ in range(count)]
    if order == "interleaved":
        hosts, left = [], list(counts)
        while any(left):
            for t in range(len(left)):
                if left[t]:
                    hosts.append(t)
                    left[t] -= 1
        return hosts
    raise ProblemError(f"host_order must be 'grouped' or 'interleaved', got {order!r}")


def _typed_cluster(
    names,
    speeds,
    memory_gb,
    hosts,
    devices_per_host,
    intra_host_gbps,
    inter_host_gbps,
    cross_type_gbps,
    intra_latency_us,
    inter_latency_us,
    host_order,
) -> Cluster:
    """The cluster of :func:`two_type_cluster` / :func:`three_type_cluster`."""
    types = tuple(
        DeviceType(n, s, None if g is None else g * 1e9)
        for n, s, g in zip(names, speeds, memory_gb, strict=True)
    )
    intra, inter = _links(
        names,
        intra_host_gbps,
        inter_host_gbps,
        cross_type_gbps,
        intra_latency_us,
        inter_latency_us,
    )
    return Cluster.from_types(
        types,
        _host_list(hosts, host_order),
        devices_per_host,
        intra_host=intra,
        inter_host=inter,
    )


def two_type_cluster(
    fast_hosts: int = 2,
    slow_hosts: int = 2,
    devices_per_host: int = 8,
    *,
    slow_speed: float = 0.5,
    names: tuple[str, str] = ("a100", "v100"),
    memory_gb: tuple[float | None, float | None] = (40.0, 16.0),
    intra_host_gbps: tuple[float, float] = (2400.0, 1200.0),
    inter_host_gbps: float = 100.0,
    cross_type_gbps: float | None = None,
    intra_latency_us: float = 5.0,
    inter_latency_us: float = 20.0,
    host_order: str = "grouped",
) -> Cluster:
    """Fast (speed 1, the reference) and slow hosts, e.g. A100-40GB + V100-16GB.

    Args:
        fast_hosts, slow_hosts: hosts of each type (>= 0, not both 0).
        devices_per_host: devices per host.
        slow_speed: the slow type's speed relative to the fast one.
        names: the two type names.
        memory_gb: memory per device of each type (``None`` = unlimited).
        intra_host_gbps: NVLink-class bandwidth per direction inside a host
            (A100 NVLink3 ~2400, V100 NVLink2 ~1200 Gb/s).
        inter_host_gbps: between hosts (InfiniBand / Ethernet, 25-200 Gb/s).
        cross_type_gbps: between hosts of different types (``None`` = same).
        intra_latency_us, inter_latency_us: per-message latencies.
        host_order: ``"grouped"`` (fast hosts first) or ``"interleaved"``.
    """
    if fast_hosts < 0 or slow_hosts < 0 or fast_hosts + slow_hosts == 0:
        raise ProblemError(
            f"need fast_hosts, slow_hosts >= 0 and some host, got "
            f"{fast_hosts}, {slow_hosts}"
        )
    return _typed_cluster(
        names,
        (1.0, slow_speed),
        memory_gb,
        (fast_hosts, slow_hosts),
        devices_per_host,
        intra_host_gbps,
        inter_host_gbps,
        cross_type_gbps,
        intra_latency_us,
        inter_latency_us,
        host_order,
    )


def three_type_cluster(
    hosts: tuple[int, int, int] = (1, 1, 2),
    devices_per_host: int = 8,
    *,
    names: tuple[str, str, str] = ("h100", "a100", "v100"),
    speeds: tuple[float, float, float] = (2.0, 1.0, 0.45),
    memory_gb: tuple[float | None, ...] = (80.0, 40.0, 16.0),
    intra_host_gbps: tuple[float, float, float] = (3600.0, 2400.0, 1200.0),
    inter_host_gbps: float = 100.0,
    cross_type_gbps: float | None = 50.0,
    intra_latency_us: float = 5.0,
    inter_latency_us: float = 20.0,
    host_order: str = "grouped",
) -> Cluster:
    """Three generations (speeds relative to the A100 the tables are profiled
    on); hosts of different generations talk over a slower fabric."""
    if len(hosts) != 3 or any(h < 0 for h in hosts) or sum(hosts) == 0:
        raise ProblemError(f"hosts must be three counts >= 0, not all 0, got {hosts}")
    return _typed_cluster(
        names,
        speeds,
        memory_gb,
        hosts,
        devices_per_host,
        intra_host_gbps,
        inter_host_gbps,
        cross_type_gbps,
        intra_latency_us,
        inter_latency_us,
        host_order,
    )


def _memory_limits(
    spec: GPTSpec,
    num_layers: int,
    sizes: np.ndarray,
    capacity: float,
) -> np.ndarray:
    """i64[P, M] Alpa's rule for spans ``triu_indices(L)`` on each submesh."""
    blocks = (spec.num_blocks or num_layers) / num_layers
    h, vocab = spec.hidden_size, spec.vocab_size
    params = np.full(num_layers, blocks * 12.0 * h * h)
    params[0] += vocab * h
    params[-1] += vocab * h
    params *= spec.bytes_per_param
    stash = np.full(num_layers, blocks * spec.activation_bytes * spec.tokens * h)
    stash[-1] += 2.0 * spec.tokens * vocab
    starts, ends = np.triu_indices(num_layers)
    param_sum = np.concatenate([[0.0], np.cumsum(params)])
    stash_sum = np.concatenate([[0.0], np.cumsum(stash)])
    span_params = (param_sum[ends + 1] - param_sum[starts])[:, None] / sizes
    span_stash = (stash_sum[ends + 1] - stash_sum[starts])[:, None] / sizes
    limit = np.floor((capacity - span_params) / span_stash) - 1
    limit = np.where(span_params > capacity, -1, limit)
    return np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)


def model_memory_limits(
    num_layers: int,
    submesh_sizes: np.ndarray,
    memory_bytes: float,
    *,
    model: GPTSpec = GPTSpec(),
    usable_memory_fraction: float = 0.9,
) -> np.ndarray:
    """i64[L, L, M] the model's ``max_n_succ_stages`` on devices of
    ``memory_bytes`` (module doc), as :func:`hetero_problem` sets it per type.

    Entries below the diagonal (no span) are unlimited, as in
    :func:`hetero_problem`.
    """
    if not 0 < usable_memory_fraction <= 1:
        raise ProblemError(
            f"usable_memory_fraction must be in (0, 1], got {usable_memory_fraction}"
        )
    sizes = np.asarray(submesh_sizes, dtype=np.float64)
    memory = np.full(
        (num_layers, num_layers, sizes.shape[0]),
        UNLIMITED_SUCCEEDING_STAGES,
        dtype=np.int64,
    )
    starts, ends = np.triu_indices(num_layers)
    memory[starts, ends] = _memory_limits(
        model, num_layers, sizes, usable_memory_fraction * memory_bytes
    )
    return memory


def hetero_problem(
    num_layers: int,
    cluster: Cluster,
    *,
    num_microbatches: int = 32,
    seed: int = 0,
    model: GPTSpec = GPTSpec(),
    submesh_space: str = "power_of_two",
    num_configs: int = 2,
    reference_tflops: float = 150.0,
    irregularity: float = 0.05,
    noise: float = 0.02,
    type_noise: float = 0.02,
    usable_memory_fraction: float = 0.9,
) -> HeteroProblem:
    """A GPT-like heterogeneous instance (module doc).

    Args:
        num_layers: L clustered layers.
        cluster: the typed cluster (devices per host a power of two).
        num_microbatches: B.
        seed: seed of every random draw.
        model: the GPT dimensions and byte counts.
        submesh_space, num_configs: Alpa's submesh space and config slots.
        reference_tflops: sustained flop rate of the reference (speed 1) device,
            in teraflops (150 ~ an A100 at half of its bf16 peak).
        irregularity, noise: as in
            :func:`pipedejavu.costmodel.stage.generate.random_problem`.
        type_noise: independent relative noise per type and entry.
        usable_memory_fraction: share of device memory the stages may use.

    Returns:
        A validated :class:`HeteroProblem`, seconds and bytes.
    """
    if not 0 < usable_memory_fraction <= 1:
        raise ProblemError(
            f"usable_memory_fraction must be in (0, 1], got {usable_memory_fraction}"
        )
    if reference_tflops <= 0 or type_noise < 0:
        raise ProblemError("reference_tflops must be > 0 and type_noise >= 0")
    blocks = (model.num_blocks or num_layers) / num_layers
    layer_flops = blocks * model.block_flops
    head_flops = 6.0 * model.tokens * model.hidden_size * model.vocab_size
    reference = random_problem(
        num_layers,
        cluster.shape,
        num_microbatches=num_microbatches,
        submesh_space=submesh_space,
        num_configs=num_configs,
        irregularity=irregularity,
        edge_weight=1.0 + 0.5 * head_flops / layer_flops,
        noise=noise,
        seed=seed,
    )
    seconds = layer_flops / (reference_tflops * 1e12)
    rng = np.random.default_rng([seed, 1])
    speeds = np.asarray(cluster.speeds)
    cost = reference.compute_cost[..., None] * seconds / speeds
    cost = cost * (1.0 + type_noise * rng.uniform(-1, 1, cost.shape))
    memory = np.full(cost.shape, UNLIMITED_SUCCEEDING_STAGES, dtype=np.int64)
    for t, kind in enumerate(cluster.device_types):
        if kind.memory_bytes is None:
            continue
        limits = model_memory_limits(
            num_layers,
            reference.submesh_sizes,
            kind.memory_bytes,
            model=model,
            usable_memory_fraction=usable_memory_fraction,
        )
        memory[..., t] = limits[..., None]
    return HeteroProblem(
        compute_cost=cost,
        max_n_succ_stages=memory,
        submesh_shapes=reference.submesh_shapes,
        cluster=cluster,
        num_microbatches=num_microbatches,
        boundary_bytes=np.full(max(num_layers - 1, 0), model.boundary_bytes),
    )
