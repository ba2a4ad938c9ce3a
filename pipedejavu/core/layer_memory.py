"""Per-layer bytes that bound each device type's stages (Alpa's memory rule).

Used by :meth:`pipedejavu.core.hetero.HeteroProblem.from_problem` to derive the
memory rule of every device type that sets ``memory_bytes``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.problem import UNLIMITED_SUCCEEDING_STAGES, ProblemError

__all__ = ["LayerMemory"]


@dataclasses.dataclass(frozen=True, eq=False)
class LayerMemory:
    """Per-layer bytes that let each device type's memory bound the stages.

    Alpa's rule on a device of ``capacity`` bytes, for a stage on layers
    ``i..j`` over ``n`` devices (the rule of
    :func:`pipedejavu.costmodel.profiling.layer_problem.problem_from_layer_profile`)::

        max_n_succ_stages = floor((capacity - weight_factor * params) /
                                  (stash / n)) - 1

    ``params``, ``stash``: the span's summed ``param_bytes`` and
    ``stash_bytes``; weights, gradients and optimizer state are replicated
    over the stage's devices (``weight_factor`` bytes per parameter byte), each
    in-flight micro-batch's stash is split over them. ``-1``: never fits.

    Args:
        param_bytes: f64[L] parameter bytes of each layer.
        stash_bytes: f64[L] bytes each layer keeps per micro-batch in flight.
        weight_factor: bytes held per parameter byte (4: Adam, fp32).
    """

    param_bytes: NDArray[np.float64]
    stash_bytes: NDArray[np.float64]
    weight_factor: float = 4.0

    def __post_init__(self) -> None:
        params = np.array(self.param_bytes, dtype=np.float64)
        stash = np.array(self.stash_bytes, dtype=np.float64)
        if params.ndim != 1 or stash.shape != params.shape:
            raise ProblemError(
                "layer_memory needs param_bytes and stash_bytes of shape (L,), got "
                f"{params.shape} and {stash.shape}"
            )
        if not (np.isfinite(params).all() and np.isfinite(stash).all()) or (
            (params < 0).any() or (stash < 0).any()
        ):
            raise ProblemError("layer_memory bytes must be finite and >= 0")
        if not (math.isfinite(self.weight_factor) and self.weight_factor >= 0):
            raise ProblemError(
                f"layer_memory weight_factor must be >= 0, got {self.weight_factor}"
            )
        object.__setattr__(self, "param_bytes", params)
        object.__setattr__(self, "stash_bytes", stash)

    def max_n_succ_stages(
        self, submesh_sizes: NDArray[np.int64], capacity: float
    ) -> NDArray[np.int64]:
        """i64[L, L, M] the rule on devices of ``capacity`` bytes (lower
        triangle: -1)."""
        num_layers = self.param_bytes.shape[0]
        params = _span_sums(self.param_bytes)
        stash = np.maximum(_span_sums(self.stash_bytes), 1.0)
        sizes = np.asarray(submesh_sizes, dtype=np.float64)
        free = capacity - self.weight_factor * params
        with np.errstate(divide="ignore", invalid="ignore"):
            limit = np.floor(free[..., None] / (stash[..., None] / sizes)) - 1
        limit = np.where(free[..., None] < 0, -1, limit)
        limit = np.clip(limit, -1, UNLIMITED_SUCCEEDING_STAGES).astype(np.int64)
        limit[np.tril_indices(num_layers, -1)] = -1
        return limit


def _span_sums(values: NDArray[np.float64]) -> NDArray[np.float64]:
    """f64[L, L]: ``[i, j]`` = sum of ``values[i..j]`` (meaningful for i <= j)."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[None, 1:] - prefix[:-1, None]
