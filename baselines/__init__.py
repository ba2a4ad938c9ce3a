"""Planners to measure against: Alpa's DP (exact and Alpa-compatible), oracles."""

from pipedejavu.problem import get_submesh_choices as get_submesh_choices

from .brute_force import brute_force as brute_force
from .exact_dp import exact_dp as exact_dp
from .exact_dp import explain_infeasible as explain_infeasible
from .exact_dp import min_sum_plan as min_sum_plan

__all__ = [
    "brute_force",
    "exact_dp",
    "explain_infeasible",
    "get_submesh_choices",
    "min_sum_plan",
]
