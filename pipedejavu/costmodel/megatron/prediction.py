"""What the predictor answers for a plan: :class:`Prediction` (the time of
one iteration and its parts, the memory per GPU; :mod:`~pipedejavu.costmodel.
megatron.predictor` computes it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.simulation.timeline import Bar

__all__ = ["Prediction"]


@dataclasses.dataclass(frozen=True, eq=False)
class Prediction:
    """A plan's predicted iteration.

    Attributes:
        iteration_time_s: seconds per iteration.
        pipeline_s: seconds until the last backward of the slowest pipeline.
        tied_allreduce_s: f64[dp] each pipeline's tied-embedding all-reduce.
        dp_allreduce_s: f64[S] seconds of each stage's gradient all-reduce
            that the iteration waits for (all of it, unless overlapped:
            :func:`~pipedejavu.costmodel.megatron.rules.gradient_sync`).
        optimizer_s: f64[S, dp] seconds of each GPU's optimizer step.
        bubble_fraction: idle share of the pipeline phase, averaged over GPUs.
        stage_forward_s, stage_backward_s: f64[S, dp] seconds per micro-batch;
        activation_transfer_s, gradient_transfer_s: f64[S - 1, dp] over each
            boundary.
        peak_in_flight: i64[S] micro-batches whose activations a stage holds.
        memory_bytes: f64[S, dp] peak device memory of a GPU of each replica.
        memory_limit_bytes: f64[S, dp] device memory a plan may use there.
        num_microbatches: B per pipeline.
        model_state_bytes: f64[S, dp] weights, gradients, Adam states and the
            largest flattened all-reduce bucket per GPU.
        activation_bytes: f64[S] activations stashed at the peak per GPU (before
            ``activation_overhead``).
        recompute_stage_layers: with per-stage recomputation, the blocks each
            stage reruns (:mod:`pipedejavu.costmodel.megatron.stage_recompute`;
            ``None`` otherwise).
        memory_capacity_bytes: f64[S, dp] device memory of that GPU type
            before the headroom (``None``: ``memory_limit_bytes``).
        memory_terms: the peak GPU's memory by term
            (:func:`~pipedejavu.costmodel.megatron.memory_terms.memory_terms`).
        stage_ready_s: f64[S] seconds at which each stage's last backward
            (and the tied-embedding all-reduce) is done in every pipeline: its
            gradient sync and optimizer step follow.
        timeline: the slowest pipeline's iteration simulated in full, as
            :class:`~pipedejavu.simulation.timeline.Bar` s, when called (for
            pictures: :mod:`pipedejavu.planning.plan_pictures`).
        stage_terms: stage ``s``'s largest GPU's memory by term, as
            :attr:`memory_terms` gives the peak's, when called with ``s``.
    """

    iteration_time_s: float
    pipeline_s: float
    tied_allreduce_s: NDArray[np.float64]
    dp_allreduce_s: NDArray[np.float64]
    optimizer_s: NDArray[np.float64]
    bubble_fraction: float
    stage_forward_s: NDArray[np.float64]
    stage_backward_s: NDArray[np.float64]
    activation_transfer_s: NDArray[np.float64]
    gradient_transfer_s: NDArray[np.float64]
    peak_in_flight: NDArray[np.int64]
    memory_bytes: NDArray[np.float64]
    memory_limit_bytes: NDArray[np.float64]
    num_microbatches: int
    model_state_bytes: NDArray[np.float64]
    activation_bytes: NDArray[np.float64]
    recompute_stage_layers: tuple[int | None, ...] | None = None
    memory_capacity_bytes: NDArray[np.float64] | None = None
    memory_terms: dict[str, Any] | None = None
    stage_ready_s: NDArray[np.float64] | None = None
    timeline: Callable[[], tuple[Bar, ...]] | None = None
    stage_terms: Callable[[int], dict[str, Any]] | None = None

    @property
    def memory_capacity(self) -> NDArray[np.float64]:
        """f64[S, dp] :attr:`memory_capacity_bytes`, else the limits."""
        capacity = self.memory_capacity_bytes
        return self.memory_limit_bytes if capacity is None else capacity

    @property
    def peak_memory_bytes(self) -> float:
        return float(self.memory_bytes.max())

    @property
    def fits_memory(self) -> bool:
        return bool((self.memory_bytes <= self.memory_limit_bytes).all())

    @property
    def stage_memory_bytes(self) -> NDArray[np.float64]:
        """f64[S] the largest memory of a GPU of each stage."""
        return self.memory_bytes.max(axis=1)

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration_time_s": self.iteration_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "fits_memory": self.fits_memory,
            "num_microbatches": self.num_microbatches,
            "breakdown": {
                "pipeline_s": self.pipeline_s,
                "tied_allreduce_s": float(self.tied_allreduce_s.max(initial=0.0)),
                "dp_allreduce_s": float(self.dp_allreduce_s.max(initial=0.0)),
                "optimizer_s": float(self.optimizer_s.max()),
                "bubble_fraction": self.bubble_fraction,
            },
            "memory_per_stage_bytes": self.stage_memory_bytes.tolist(),
            "memory_limit_per_stage_bytes": self.memory_limit_bytes.min(
                axis=1
            ).tolist(),
            "memory_capacity_per_stage_bytes": self.memory_capacity.min(
                axis=1
            ).tolist(),
            "peak_in_flight": self.peak_in_flight.tolist(),
            "recompute_stage_layers": (
                None
                if self.recompute_stage_layers is None
                else list(self.recompute_stage_layers)
            ),
            "memory_terms": self.memory_terms,
        }
