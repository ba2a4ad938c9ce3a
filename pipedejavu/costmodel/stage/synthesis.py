"""Synthetic stage-construction instances from layer lists and an analytic model.

:func:`synthesize` builds an instance of Alpa's problem that no profile covers
from a list of :class:`~costmodel.layers.LayerSpec` (L = 512 layers on 128x8
devices: about 0.5 s on 2 cores, 0.5 GB peak); :func:`stage_cost_table` is the
reusable core (e.g. with another ``device_flops`` per device type).

Model, for the stage of layers ``i..j`` (inclusive) on submesh ``m`` of shape
``(h, d)`` (``n = h d`` devices) under config ``k``:

* **Configs** are logical meshes ``(dp, tp)`` with ``dp * tp = n``: config slot
  ``k`` has tensor-parallel degree ``configs[k]`` (default: 1, 2, 4, ..., devices
  per host, Alpa's ``single_node_model_parallel`` space without its duplicate
  physical mesh), hence K = log2(devices per host) + 1 = 4 on 8-GPU hosts. A slot
  whose degree does not divide ``n`` (or whose ``dp`` does not divide
  ``micro_batch_size`` when given, Alpa's rule) is inf, as Alpa pads.
* **Layout**: devices are numbered host-major and a tensor-parallel group is
  ``tp`` consecutive devices (tensor parallelism within a host first). It
  crosses hosts iff ``tp > d``; a data-parallel group (stride ``tp``) crosses
  hosts iff ``h > 1`` and ``dp > 1``. A group that crosses runs entirely at the
  inter-host speed (no hierarchical collectives).
* **Latency** (seconds per micro-batch, forward + backward), the sum of
  ``(1 + backward_factor) F / (n * device_flops * efficiency)`` with ``F`` the
  forward FLOPs of layers ``i..j`` and the backward pass costing
  ``backward_factor = 2`` times the forward; the tensor-parallel collectives,
  ``sum_l tp_allreduces_l * all_reduce(tp, tp_allreduce_bytes_l / dp)`` (each
  replica all-reduces the activations of its ``1 / dp`` of the micro-batch;
  Megatron: 2 forward and 2 backward per block); the data-parallel gradient
  all-reduce ``all_reduce(dp, P / tp) / B`` (``P`` the stage's parameter bytes,
  gradients in the parameter dtype, once per iteration and amortized over the
  ``B = num_microbatches`` micro-batches); and a fixed ``stage_overhead``
  (launches, pipeline bookkeeping; default 1 ms). No overlap of communication
  with compute. Collective times come from ``comm`` (:class:`AlphaBetaComm` by
  default).
* **Memory** per device (bytes): parameters with gradients and mixed-precision
  Adam state, ``P / param_dtype_bytes * state_bytes_per_param / tp`` (16 bytes
  per parameter: fp16 weight and gradient, fp32 master copy and two moments;
  sharded by ``tp``, replicated over ``dp``), plus the activation stash
  ``A / n`` per in-flight micro-batch (``A`` the stage's stash bytes; split by
  ``dp`` and by ``tp``, which assumes Megatron's sequence parallelism shards the
  parts plain tensor parallelism replicates). Under 1F1B a stage with ``s``
  stages after it holds ``s + 1`` micro-batches, so, as Alpa's
  ``(available - peak - initial) // intermediate - 1``:
  ``max_n_succ_stages = floor((memory_per_device - static) / (A / n)) - 1``,
  clipped to ``[-1, UNLIMITED_SUCCEEDING_STAGES]`` (-1: not even one
  micro-batch fits).
* **Noise** (:func:`synthesize` only): every entry times ``1 + noise * U(-1, 1)``.

Not modelled: pipeline send/receive between stages (Alpa's table leaves it out
too; :func:`~costmodel.layers.boundary_activation_bytes` gives its bytes),
overlap, ZeRO/optimizer sharding, activation recomputation, expert-parallel
all-to-all, temporaries (Alpa's ``peak``), fragmentation, kernel efficiency that
varies with shapes.

Defaults: ``device_flops = 312e12`` (A100 dense bf16 peak), ``efficiency =
0.5``, ``memory_per_device = 80 GiB``; :class:`AlphaBetaComm` 150 GB/s and 5 us
per step within a host (NVLink-like), 12.5 GB/s and 20 us across hosts
(100 Gb/s). Table memory: L^2 M K entries of 8 bytes twice (costs and limits);
at L = 512 on 128x8 (M = 11 power-of-two submeshes, K = 4) about 185 MB, so
keep K at 4 or less there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pipedejavu.core.problem import (
    UNLIMITED_SUCCEEDING_STAGES,
    Problem,
    get_submesh_choices,
)
from pipedejavu.costmodel.stage.layers import LayerSpec

__all__ = [
    "AlphaBetaComm",
    "CollectiveModel",
    "StageTables",
    "stage_cost_table",
    "synthesize",
]

DEFAULT_DEVICE_FLOPS = 312e12
DEFAULT_MEMORY_PER_DEVICE = 80.0 * 2**30
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


class CollectiveModel(Protocol):
    """What the cost table needs from a communication model.

    ``predict_collective`` returns seconds for one collective over a group of
    ``num_devices`` devices moving ``num_bytes`` (the full buffer: the
    all-reduced array, the gathered output). :func:`stage_cost_table` calls it
    with a numpy array of byte counts first and uses the result if it has the
    same shape; otherwise (or on ``TypeError``/``ValueError``) it calls it once
    per distinct byte count with a Python float. ``crosses_hosts`` is always
    passed by keyword. Only ``"all_reduce"`` is asked for; groups of one device
    are never asked (they cost 0).
    """

    def predict_collective(
        self,
        collective: str,
        num_devices: int,
        num_bytes: ArrayLike,
        crosses_hosts: bool,
    ) -> ArrayLike: ...


@dataclasses.dataclass(frozen=True)
class AlphaBetaComm:
    """Ring collectives with per-step latency and per-link bandwidth.

    For ``n`` devices and ``B`` bytes: all-reduce ``2 (n-1)/n B / bw +
    2 (n-1) latency``; all-gather, reduce-scatter and all-to-all ``(n-1)/n B / bw
    + (n-1) latency``; send/receive ``B / bw + latency``. The inter-host link
    and latency apply when the group crosses hosts.

    Args:
        intra_host_bandwidth: bytes/s per link within a host.
        inter_host_bandwidth: bytes/s per link across hosts.
        intra_host_latency: seconds per ring step within a host.
        inter_host_latency: seconds per ring step across hosts.
    """

    intra_host_bandwidth: float = 150e9
    inter_host_bandwidth: float = 12.5e9
    intra_host_latency: float = 5e-6
    inter_host_latency: float = 20e-6

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            positive = field.name.endswith("bandwidth")
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                kind = "> 0" if positive else ">= 0"
                raise ValueError(f"{field.name} must be finite and {kind}, got {value}")

    def predict_collective(
        self,
        collective: str,
        num_devices: int,
        num_bytes: ArrayLike,
        crosses_hosts: bool,
    ) -> NDArray[np.float64]:
        """Seconds for one collective; broadcasts over ``num_bytes``."""
        if collective not in COLLECTIVES:
            raise ValueError(
                f"collective must be one of {', '.join(COLLECTIVES)}, "
                f"got {collective!r}"
            )
        if crosses_hosts:
            bandwidth, latency = self.inter_host_bandwidth, self.inter_host_latency
        else:
            bandwidth, latency = self.intra_host_bandwidth, self.intra_host_latency
        size = np.asarray(num_bytes, dtype=np.float64)
        if collective == "send_recv":
            return size / bandwidth + latency
        if num_devices <= 1:
            return np.zeros_like(size)
        steps = num_devices - 1
        fraction = steps / num_devices
        if collective == "all_reduce":
            return 2.0 * fraction * size / bandwidth + 2.0 * steps * latency
        return fraction * size / bandwidth + steps * latency


class StageTables(NamedTuple):
    """Alpa's stage tables (arrays use inclusive ``[i, j]`` layer indexing).

    Attributes:
        compute_cost: f64[L, L, M, K] seconds per micro-batch; inf below the
            diagonal and for configs that do not fit the submesh.
        max_n_succ_stages: i64[L, L, M, K]; -1 where never feasible.
        submesh_shapes: i64[M, 2] ``(hosts, devices per host)``.
    """

    compute_cost: NDArray[np.float64]
    max_n_succ_stages: NDArray[np.int64]
    submesh_shapes: NDArray[np.int64]


def _collective_time(
    comm: CollectiveModel,
    collective: str,
    num_devices: int,
    num_bytes: NDArray[np.float64],
    crosses_hosts: bool,
) -> NDArray[np.float64]:
    """``comm``'s seconds for each byte count; 0 for a group of one device."""
    if num_devices <= 1:
        return np.zeros_like(num_bytes)
    try:
        result = np.asarray(
            comm.predict_collective(
                collective, num_devices, num_bytes, crosses_hosts=crosses_hosts
            ),
            dtype=np.float64,
        )
    except (TypeError, ValueError):
        result = None
    if result is None or result.shape != num_bytes.shape:
        distinct, inverse = np.unique(num_bytes, return_inverse=True)
        times = [
            float(
                comm.predict_collective(
                    collective, num_devices, float(size), crosses_hosts=crosses_hosts
                )
            )
            for size in distinct
        ]
        result = np.asarray(times, dtype=np.float64)[inverse.reshape(num_bytes.shape)]
    if not np.isfinite(result).all() or (result < 0).any():
        raise ValueError(
            f"comm.predict_collective({collective!r}, {num_devices}, ..., "
            f"{crosses_hosts}) must return finite seconds >= 0"
        )
    return result


def _per_submesh(value: ArrayLike, name: str, num_submeshes: int) -> NDArray:
    """A float or f64[M] argument as f64[M], checked > 0 (inf allowed)."""
    array = np.asarray(value, dtype=np.float64)
    if array.shape not in ((), (num_submeshes,)):
        raise ValueError(
            f"{name} must be a float or have shape ({num_submeshes},) (one per "
            f"submesh), got shape {array.shape}"
        )
    if np.isnan(array).any() or (array <= 0).any():
        raise ValueError(f"{name} must be > 0, got {value}")
    return np.broadcast_to(array, (num_submeshes,))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_inputs(
    layers: tuple[LayerSpec, ...],
    cluster: tuple[int, int],
    num_microbatches: int,
    efficiency: float,
    configs: Sequence[int] | None,
) -> None:
    if not layers or not all(isinstance(layer, LayerSpec) for layer in layers):
        raise ValueError("layers must be a non-empty sequence of LayerSpec")
    if len(cluster) != 2 or not all(_is_int(x) and x >= 1 for x in cluster):
        raise ValueError(
            "cluster must be two integers (num_hosts, devices_per_host) >= 1, "
            f"got {cluster!r}"
        )
    if not _is_int(num_microbatches) or num_microbatches < 1:
        raise ValueError(
            f"num_microbatches must be an integer >= 1, got {num_microbatches!r}"
        )
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    if configs is not None and (
        len(configs) == 0 or not all(_is_int(c) and c >= 1 for c in configs)
    ):
        raise ValueError(
            f"configs must be tensor-parallel degrees (integers >= 1), got {configs!r}"
        )


def _succeeding_limit(
    free: NDArray[np.float64], stash: NDArray[np.float64]
) -> NDArray[np.int64]:
    """Alpa's ``floor(free / stash) - 1`` clipped to ``[-1, unlimited]``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        limit = np.floor(free / stash) - 1.0
    limit = np.where(stash > 0, limit, np.where(free >= 0, np.inf, -1.0))
    return np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)


def stage_cost_table(
    layers: Sequence[LayerSpec],
    cluster: tuple[int, int],
    *,
    num_microbatches: int,
    device_flops: ArrayLike = DEFAULT_DEVICE_FLOPS,
    memory_per_device: ArrayLike = DEFAULT_MEMORY_PER_DEVICE,
    comm: CollectiveModel | None = None,
    submesh_space: str = "power_of_two",
    manual_submeshes: Sequence[tuple[int, int]] | None = None,
    configs: Sequence[int] | None = None,
    efficiency: float = 0.5,
    stage_overhead: float = 1e-3,
    backward_factor: float = 2.0,
    param_dtype_bytes: float = 2.0,
    state_bytes_per_param: float = 16.0,
    micro_batch_size: int | None = None,
) -> StageTables:
    """Alpa's ``compute_cost`` and ``max_n_succ_stages`` from the analytic model.

    Args:
        layers: L layer specs in pipeline order.
        cluster: ``(num_hosts, devices_per_host)``.
        num_microbatches: B; the gradient all-reduce is amortized over it.
        device_flops: peak FLOP/s of one device: a float, or f64[M] one per
            submesh choice (e.g. for a device type per submesh).
        memory_per_device: bytes per device (float or f64[M]); ``inf`` means
            memory never limits.
        comm: a :class:`CollectiveModel`; ``None`` uses :class:`AlphaBetaComm`.
        submesh_space: Alpa's submesh space (see ``get_submesh_choices``).
        manual_submeshes: the shapes for ``submesh_space="manual"``.
        configs: tensor-parallel degree of each config slot (K of them);
            ``None`` = 1, 2, 4, ..., devices per host.
        efficiency: achieved fraction of ``device_flops``, in (0, 1].
        stage_overhead: seconds added to every stage.
        backward_factor: backward FLOPs / forward FLOPs.
        param_dtype_bytes: bytes per parameter in ``LayerSpec.param_bytes``.
        state_bytes_per_param: bytes per parameter of weights, gradients and
            optimizer state (16: mixed-precision Adam).
        micro_batch_size: when given, configs whose ``dp`` does not divide it
            are inf (Alpa's rule).

    Returns:
        :class:`StageTables`; formulas in the module docstring.

    Raises:
        ValueError: a bad argument, named with what was expected.
    """
    layers = tuple(layers)
    cluster = tuple(cluster)
    _check_inputs(layers, cluster, num_microbatches, efficiency, configs)
    num_hosts, devices_per_host = (int(x) for x in cluster)
    if configs is None:
        configs = tuple(2**e for e in range(devices_per_host.bit_length()))
        configs = tuple(c for c in configs if c <= devices_per_host)
    configs = tuple(int(c) for c in configs)
    if stage_overhead < 0 or backward_factor < 0:
        raise ValueError("stage_overhead and backward_factor must be >= 0")
    comm = AlphaBetaComm() if comm is None else comm
    shapes = np.array(
        get_submesh_choices(
            num_hosts, devices_per_host, submesh_space, manual_submeshes
        ),
        dtype=np.int64,
    )
    num_layers, num_submeshes, num_configs = len(layers), len(shapes), len(configs)
    flops_rate = _per_submesh(device_flops, "device_flops", num_submeshes)
    memory = _per_submesh(memory_per_device, "memory_per_device", num_submeshes)

    def prefix(values: list[float]) -> NDArray[np.float64]:
        return np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])

    def span(prefix_sums: NDArray[np.float64]) -> NDArray[np.float64]:
        # [L, L]: entry [i, j] sums layers i..j (garbage below the diagonal).
        return prefix_sums[None, 1:] - prefix_sums[:-1, None]

    span_flops = span(prefix([layer.forward_flops for layer in layers]))
    span_params = span(prefix([layer.param_bytes for layer in layers]))
    span_stash = span(prefix([layer.stash_bytes for layer in layers]))
    tp_counts = np.array([layer.tp_allreduces for layer in layers], np.float64)
    tp_bytes = np.array([layer.tp_allreduce_bytes for layer in layers], np.float64)

    # Written slab by slab into the final arrays: no [L, L, M, K] temporaries.
    shape = (num_layers, num_layers, num_submeshes, num_configs)
    compute_cost = np.empty(shape)
    max_n_succ_stages = np.empty(shape, dtype=np.int64)
    for m, (hosts, width) in enumerate(shapes.tolist()):
        size = hosts * width
        compute = (1.0 + backward_factor) * span_flops
        compute /= size * flops_rate[m] * efficiency
        for k, tp in enumerate(configs):
            dp = size // tp
            if size % tp or (micro_batch_size is not None and micro_batch_size % dp):
                compute_cost[:, :, m, k] = np.inf
                max_n_succ_stages[:, :, m, k] = -1
                continue
            per_layer = tp_counts * _collective_time(
                comm, "all_reduce", tp, tp_bytes / dp, tp > width
            )
            gradient = _collective_time(
                comm, "all_reduce", dp, np.triu(span_params) / tp, hosts > 1
            )
            compute_cost[:, :, m, k] = (
                compute
                + span(prefix(per_layer))
                + gradient / num_microbatches
                + stage_overhead
            )
            static = span_params / param_dtype_bytes * state_bytes_per_param / tp
            max_n_succ_stages[:, :, m, k] = _succeeding_limit(
                memory[m] - static, span_stash / size
            )
    below = np.tril_indices(num_layers, -1)
    compute_cost[below] = np.inf
    max_n_succ_stages[below] = -1
    return StageTables(compute_cost, max_n_succ_stages, shapes)


def synthesize(
    layers: Sequence[LayerSpec],
    cluster: tuple[int, int] = (1, 8),
    *,
    num_microbatches: int,
    comm: CollectiveModel | None = None,
    device_flops: ArrayLike = DEFAULT_DEVICE_FLOPS,
    memory_per_device: ArrayLike = DEFAULT_MEMORY_PER_DEVICE,
    submesh_space: str = "power_of_two",
    configs: Sequence[int] | None = None,
    efficiency: float = 0.5,
    seed: int | None = None,
    noise: float = 0.0,
    **options: float | int | None,
) -> Problem:
    """A validated :class:`~pipedejavu.Problem` for ``layers`` on ``cluster``.

    Args:
        layers: L layer specs (e.g. :func:`~costmodel.layers.gpt_layers`).
        cluster: ``(num_hosts, devices_per_host)``, devices per host a power of
            two.
        num_microbatches: B.
        comm, device_flops, memory_per_device, submesh_space, configs,
            efficiency: as in :func:`stage_cost_table`.
        seed: seed of ``numpy.random.default_rng`` for the noise (the same seed
            gives the same problem).
        noise: relative measurement noise in [0, 1): each entry is multiplied by
            ``1 + noise * U(-1, 1)``.
        **options: the other keywords of :func:`stage_cost_table`
            (``stage_overhead``, ``backward_factor``, ``micro_batch_size``, ...).

    Returns:
        The problem; ``compute_cost`` in seconds per micro-batch.

    Raises:
        ValueError: a bad argument.
        ProblemError: the tables do not form a valid problem.
    """
    if not 0 <= noise < 1:
        raise ValueError(f"noise must be in [0, 1), got {noise}")
    tables = stage_cost_table(
        layers,
        cluster,
        num_microbatches=num_microbatches,
        device_flops=device_flops,
        memory_per_device=memory_per_device,
        comm=comm,
        submesh_space=submesh_space,
        configs=configs,
        efficiency=efficiency,
        **options,
    )
    compute_cost = tables.compute_cost
    if noise > 0:
        rng = np.random.default_rng(seed)
        starts, ends = np.triu_indices(compute_cost.shape[0])
        factor = rng.uniform(-1.0, 1.0, (len(starts),) + compute_cost.shape[2:])
        compute_cost[starts, ends] *= 1.0 + noise * factor
    return Problem(
        compute_cost=compute_cost,
        max_n_succ_stages=tables.max_n_succ_stages,
        submesh_shapes=tables.submesh_shapes,
        cluster_shape=(int(cluster[0]), int(cluster[1])),
        num_microbatches=num_microbatches,
    )
