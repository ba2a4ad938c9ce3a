"""The differentiable stage/mesh engine and the exact sub-solvers it polishes with.

``pipedejavu.search.exact`` (numpy only) is imported eagerly; the JAX engine is
loaded on first use so that ``import pipedejavu.baselines`` stays light. The
heterogeneous oracle is ``pipedejavu.search.hetero_exact.hetero_exact`` (its
module keeps the name, so the package does not re-export the function).
"""

from .exact import exact_dp as exact_dp

_LAZY = {
    "SearchConfig": "engine",
    "SearchResult": "engine",
    "differentiable": "engine",
    "search": "engine",
    "LinearStageModel": "linear",
    "fit_linear_model": "linear",
    "lower_bound": "bounds",
    "HeteroTimeoutError": "hetero_exact",
    "hetero_search": "hetero_engine",
    "HeteroSearchConfig": "hetero_engine",
    "hetero_lower_bound": "hetero_bounds",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pipedejavu.search' has no attribute {name!r}")


__all__ = ["exact_dp", *_LAZY]
