"""Alpa's formulation solved exactly (the default ``dp`` method).

The DP itself lives in :mod:`pipedejavu.search.exact`, the neutral home of the exact
sub-solvers that the differentiable engine also uses for its repair and polish
(``search`` never imports ``baselines``); this module is the baseline's name
for it.
"""

from pipedejavu.search.exact import exact_dp as exact_dp
from pipedejavu.search.exact import explain_infeasible as explain_infeasible
from pipedejavu.search.exact import min_sum_plan as min_sum_plan

__all__ = ["exact_dp", "explain_infeasible", "min_sum_plan"]
