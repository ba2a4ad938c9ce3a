"""Planners to measure against: Alpa's DP (exact and Alpa-compatible), oracles,
and the heuristics users would otherwise pick (uniform, greedy, random, anneal)."""

from pipedejavu.problem import get_submesh_choices as get_submesh_choices

from .annealing import anneal as anneal
from .brute import brute_force as brute_force
from .dp import exact_dp as exact_dp
from .dp import explain_infeasible as explain_infeasible
from .dp import min_sum_plan as min_sum_plan
from .hetero import alpa_homogeneous as alpa_homogeneous
from .hetero import hetero_brute_force as hetero_brute_force
from .heuristics import greedy as greedy
from .heuristics import random_search as random_search
from .heuristics import uniform as uniform

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
