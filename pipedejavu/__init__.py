"""pipedejavu: pipeline-stage search for large models, measured against Alpa's DP.

The public API. Every name is imported on first use (``pdj.solve`` imports
:mod:`pipedejavu.planning.solve` then), so ``import pipedejavu``, which every
``pipedejavu`` command runs as the parent of :mod:`pipedejavu.cli`, imports
nothing but this file: numpy, SciPy and JAX load with the first call that
needs them. ``__all__`` and ``dir()`` list every name."""

from pipedejavu.core.version import __version__ as __version__

#: Each public name and the module (under ``pipedejavu``) that defines it.
_LAZY = {
    "Cluster": "core.cluster",
    "DeviceType": "core.cluster",
    "Link": "core.cluster",
    "HeteroPlan": "core.hetero",
    "HeteroProblem": "core.hetero",
    "check_hetero_plan": "core.hetero_rules",
    "evaluate_hetero": "core.hetero_rules",
    "LayerMemory": "core.layer_memory",
    "InfeasibleProblemError": "core.problem",
    "Plan": "core.problem",
    "PlanError": "core.problem",
    "Problem": "core.problem",
    "ProblemError": "core.problem",
    "Stage": "core.problem",
    "check_plan": "core.problem",
    "evaluate": "core.problem",
    "get_submesh_choices": "core.problem",
    "make_plan": "core.problem",
    "compare": "planning.compare",
    "bundled_examples": "planning.inputs",
    "example_names": "planning.inputs",
    "load_cluster": "planning.inputs",
    "load_example": "planning.inputs",
    "load_plan": "planning.inputs",
    "load_problem": "planning.inputs",
    "solve": "planning.solve",
    "plan_training": "planning.training",
    "plan_model": "planning.plan_model",
    "plot_plan": "planning.plan_pictures",
    "MemoryHeadroom": "core.memory_headroom",
    "enable_compilation_cache": "search.engine.compile_cache",
    "simulate": "simulation.simulate",
    "simulate_plan": "simulation.simulate",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module 'pipedejavu' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
