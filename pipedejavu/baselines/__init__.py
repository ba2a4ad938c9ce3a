"""Planners to measure against: Alpa's DP (exact and Alpa-compatible), oracles,
and the heuristics users would otherwise pick (uniform, greedy, random, anneal)."""

from pipedejavu.baselines.annealing import anneal as anneal
from pipedejavu.baselines.brute import brute_force as brute_force
from pipedejavu.baselines.hetero import alpa_homogeneous as alpa_homogeneous
from pipedejavu.baselines.hetero import hetero_brute_force as hetero_brute_force
from pipedejavu.baselines.heuristics import greedy as greedy
from pipedejavu.baselines.heuristics import random_search as random_search
from pipedejavu.baselines.heuristics import uniform as uniform
from pipedejavu.core.problem import get_submesh_choices as get_submesh_choices
from pipedejavu.search.alpa.caps import explain_infeasible, min_sum_plan
from pipedejavu.search.alpa.exact import exact_dp as exact_dp

__all__ = [
    "alpa_homogeneous",
    "anneal",
    "brute_force",
    "exact_dp",
    "explain_infeasible",
    "get_submesh_choices",
    "greedy",
    "hetero_brute_force",
    "min_sum_plan",
    "random_search",
    "uniform",
]
