"""The spans a polishing DP may use around a plan's stage boundaries.

Kept free of JAX so that the exact heterogeneous search and its local polish
import it without loading JAX.
"""

from __future__ import annotations

import numpy as np

__all__ = ["neighbourhood"]


def neighbourhood(boundaries: list[int], num_layers: int, window: int) -> np.ndarray:
    """bool[L, L]: spans (start, end inclusive) the polish DP may use."""
    anchors = [boundaries[0]]
    for left, right in zip(boundaries[:-1], boundaries[1:], strict=True):
        if right - left >= 2:
            anchors.append((left + right) // 2)
        anchors.append(right)
    groups = [
        np.arange(max(a - window, 0), min(a + window, num_layers) + 1)
        if 0 < a < num_layers
        else np.array([a])
        for a in anchors
    ]
    allowed = np.zeros((num_layers, num_layers), dtype=bool)
    for first in range(len(groups)):
        for last in range(first + 1, min(first + 5, len(groups))):
            starts = groups[first][groups[first] < num_layers]
            stops = groups[last][groups[last] > 0]
            start_grid, stop_grid = np.meshgrid(starts, stops, indexing="ij")
            keep = start_grid < stop_grid
            allowed[start_grid[keep], stop_grid[keep] - 1] = True
    return allowed
