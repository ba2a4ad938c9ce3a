"""The differentiable stage/mesh engine and the exact sub-solvers it polishes with.

Every name loads its module on first use: ``exact_dp`` from
``pipedejavu.search.alpa.exact`` (numpy only), the JAX engine from
``pipedejavu.search.engine``, so importing a module of the package (the
command line's ``search.engine.compile_cache``) or ``pipedejavu.baselines``
stays light. The heterogeneous oracle is
``pipedejavu.search.hetero.exact.hetero_exact`` (its module keeps the name, so
the package does not re-export the function).
"""

from pipedejavu.core.lazy import lazy_getattr

_LAZY = {
    "exact_dp": "alpa.exact",
    "SearchConfig": "engine.config",
    "SearchResult": "engine.config",
    "differentiable": "engine.driver",
    "search": "engine.driver",
    "lower_bound": "engine.bounds",
    "HeteroTimeoutError": "hetero.exact",
    "hetero_search": "hetero.engine",
    "HeteroSearchConfig": "hetero.engine",
    "hetero_lower_bound": "hetero.bounds",
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = [*_LAZY]
