"""Magnitude limits on cost tables: plan costs must not overflow float64.

A plan's cost adds up to ``L + B`` table entries (``sum t + (B - 1) max t``
over at most ``L`` stages), so a table whose largest finite entry is near the
float64 maximum gives ``inf`` plans: solvers would then see no finite plan and
blame another rule. :func:`check_cost_magnitude` refuses such tables up front.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.errors import ProblemError

__all__ = ["MAX_PLAN_SECONDS", "check_cost_magnitude"]

#: Largest plan cost (seconds) a problem may reach: sums of cost entries stay
#: finite in float64 with room for the solvers' arithmetic.
MAX_PLAN_SECONDS = 1e300


def check_cost_magnitude(
    cost: NDArray[np.float64], num_microbatches: int, extra: float = 0.0
) -> None:
    """Refuse costs whose plan sums could overflow float64.

    A plan's cost is at most ``(L + B) * max`` (``max`` the largest finite
    entry) plus ``extra`` (the largest other per-plan term, e.g. transfers);
    it must stay below :data:`MAX_PLAN_SECONDS`.

    Raises:
        ProblemError: one line with the largest entry and the bound.
    """
    finite = cost[np.isfinite(cost)]
    if finite.size == 0:
        return
    largest = float(finite.max())
    steps = cost.shape[0] + int(num_microbatches)
    with np.errstate(over="ignore"):
        total = np.float64(largest) * steps + np.float64(extra)
    if not total < MAX_PLAN_SECONDS:
        raise ProblemError(
            f"compute_cost entries must be <= {MAX_PLAN_SECONDS / steps:.3g} s so "
            f"that plan costs ((L + B) = {steps} entries summed) stay below "
            f"{MAX_PLAN_SECONDS:g} s and do not overflow, got {largest:g}"
        )
