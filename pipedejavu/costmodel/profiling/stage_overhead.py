"""How a span run as one function differs from the sum of its layers' calls.

Stage model. A contiguous span ``i..j`` run as one jitted function is not the sum
of its layers' calls: each call pays a fixed overhead (dispatch, thread wake-up,
result buffers), XLA fuses and overlaps work across layer boundaries, and a stage
whose working set outgrows the caches slows down (measured on a 2-core CPU with
a 32 MiB L3: gpt-small stages of three or more blocks run ~35% slower than the
sum of their blocks, two blocks do not). So, for ``n`` layers::

    predicted(i..j) = sum_l t_l * (1 + spill_fraction * [W(i..j) > spill_bytes])
                      - (n - 1) * per_boundary_s
                      - boundary_fraction * sum_{k=i..j-1} (t_k + t_{k+1}) / 2

with ``W`` the summed vjp stashes of the layers per device, and the four
coefficients fit to spans timed as one function in the same rounds
(:func:`fit_stage_overhead`). One-layer stages are the measurement itself.
Units: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import lsq_linear

from pipedejavu.costmodel.profiling.profiler import LayerProfile

__all__ = [
    "StageOverhead",
    "fit_stage_overhead",
    "predict_span_time",
    "span_sums",
    "stage_table",
]


@dataclasses.dataclass(frozen=True)
class StageOverhead:
    """How a span run as one function differs from the sum of its layers' calls.

    Args:
        per_boundary_s: seconds saved per internal layer boundary, the fixed
            per-call part (negative: a cost).
        boundary_fraction: saved per boundary, as a fraction of the two adjacent
            layers' mean time (fusion and overlap across the boundary).
        spill_fraction: slowdown, as a fraction of the layers' sum, of a stage
            whose working set exceeds ``spill_bytes``.
        spill_bytes: working-set capacity (bytes of summed layer stashes per
            device); ``inf``: no stage spills.
        num_spans: spans the fit used (0: no effect is modelled).
    """

    per_boundary_s: float = 0.0
    boundary_fraction: float = 0.0
    spill_fraction: float = 0.0
    spill_bytes: float = math.inf
    num_spans: int = 0


def span_sums(values: NDArray) -> NDArray[np.float64]:
    """f64[L, L]: ``[i, j]`` = sum of ``values[i..j]`` (meaningful for i <= j)."""
    prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    return prefix[None, 1:] - prefix[:-1, None]


def _features(profile: LayerProfile, devices: int = 1) -> tuple:
    """f64[L, L] tables for stage ``i..j``: sum of layer times, internal
    boundaries, sum of adjacent-pair mean times, working set per device."""
    times = profile.layer_times_s
    first, last = np.indices((len(times), len(times)))
    pair_means = np.concatenate([(times[:-1] + times[1:]) / 2, [0.0]])
    adjacent = span_sums(pair_means) - pair_means[None, :]
    working_set = span_sums(profile.stash_bytes) / devices
    return span_sums(times), (last - first).astype(float), adjacent, working_set


def stage_table(
    profile: LayerProfile, overhead: StageOverhead, devices: int = 1
) -> NDArray[np.float64]:
    """f64[L, L] predicted seconds of stage ``i..j`` (inclusive); inf for i > j."""
    total, boundaries, adjacent, working_set = _features(profile, devices)
    table = (
        total * (1 + overhead.spill_fraction * (working_set > overhead.spill_bytes))
        - overhead.per_boundary_s * boundaries
        - overhead.boundary_fraction * adjacent
    )
    return np.where(boundaries >= 0, table, np.inf)


def fit_stage_overhead(
    profile: LayerProfile, spans: Sequence[tuple[int, int]] | None = None
) -> StageOverhead:
    """Fit :class:`StageOverhead` to the spans timed as one function.

    Least squares on the *relative* error of the predicted span times with
    ``|per_boundary_s| <= min(layer time) / 2``, ``|boundary_fraction| <= 1/2``
    (so predictions stay positive) and ``0 <= spill_fraction <= 2``. Negative
    boundary terms are allowed: a span measured slower than its layers' sum
    fits a boundary *cost*. ``spill_bytes`` is chosen among ``inf`` and the
    geometric midpoints between the working sets of the fitted spans that lie
    above the largest single layer's (every single layer is its measurement);
    the best residual wins, ``inf`` on ties.

    Args:
        profile: the measurements. spans: a subset of ``profile.spans`` to fit
            on (held-out checks); default all of them.
    """
    chosen = profile.spans if spans is None else tuple(tuple(s) for s in spans)
    missing = [s for s in chosen if s not in profile.spans]
    if missing:
        raise ValueError(
            f"spans must be among the profiled spans {list(profile.spans)}, "
            f"got {missing}"
        )
    if not chosen:
        return StageOverhead()
    starts, ends = (np.array(side) for side in zip(*chosen, strict=True))
    ends = ends - 1
    total, boundaries, adjacent, working_set = (
        table[starts, ends] for table in _features(profile)
    )
    measured = profile.span_times_s[[profile.spans.index(s) for s in chosen]]
    target = (total - measured) / measured
    largest_layer = float(profile.stash_bytes.max())
    sizes = np.unique(
        np.append(working_set[working_set > largest_layer], largest_layer)
    )
    upper = np.array([profile.layer_times_s.min() / 2, 0.5, 2.0])
    best = (math.inf, StageOverhead(num_spans=len(chosen)))
    for capacity in [math.inf, *np.sqrt(sizes[:-1] * sizes[1:])]:
        spill = total * (working_set > capacity)
        columns = [boundaries, adjacent, -spill][: 3 if spill.any() else 2]
        rows = np.stack(columns, axis=1) / measured[:, None]
        bound = upper[: len(columns)]
        fit = lsq_linear(rows, target, bounds=(-bound * [1, 1, 0][: len(bound)], bound))
        residual = float(np.sum((rows @ fit.x - target) ** 2))
        if residual < best[0] * (1 - 1e-9) - 1e-15:
            values = [*np.clip(fit.x, -bound, bound), 0.0][:3]
            overhead = StageOverhead(*(float(v) for v in values), capacity, len(chosen))
            best = (residual, overhead)
    return best[1]


def predict_span_time(
    profile: LayerProfile,
    start: int,
    stop: int,
    overhead: StageOverhead | None = None,
) -> float:
    """Predicted seconds of layers ``start..stop-1`` (half-open) as one stage.

    ``overhead`` defaults to :func:`fit_stage_overhead` on all profiled spans.
    """
    if not 0 <= start < stop <= profile.num_layers:
        raise ValueError(
            f"span must satisfy 0 <= start < stop <= {profile.num_layers}, "
            f"got {(start, stop)}"
        )
    overhead = fit_stage_overhead(profile) if overhead is None else overhead
    return float(stage_table(profile, overhead)[start, stop - 1])
