"""pipedejavu: pipeline-stage search for large models, measured against Alpa's DP."""

from .problem import InfeasibleProblemError as InfeasibleProblemError
from .problem import Plan as Plan
from .problem import PlanError as PlanError
from .problem import Problem as Problem
from .problem import ProblemError as ProblemError
from .problem import Stage as Stage
from .problem import check_plan as check_plan
from .problem import evaluate as evaluate
from .problem import get_submesh_choices as get_submesh_choices
from .problem import make_plan as make_plan

__version__ = "0.1.0"

_LAZY = {
    "solve": "api",
    "compare": "compare",
    "load_problem": "io",
    "bundled_examples": "io",
    "load_example": "io",
    "simulate": "simulate",
    "simulate_plan": "simulate",
    "Cluster": "cluster",
    "DeviceType": "cluster",
    "Link": "cluster",
    "HeteroProblem": "hetero",
    "HeteroPlan": "hetero",
    "evaluate_hetero": "hetero",
}


def __getattr__(name: str):
    # The solvers live in packages that import this vocabulary; loading them lazily
    # keeps `import costmodel` / `import baselines` free of import cycles.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'pipedejavu' has no attribute {name!r}")


__all__ = [
    "Cluster",
    "DeviceType",
    "HeteroPlan",
    "HeteroProblem",
    "InfeasibleProblemError",
    "Link",
    "Plan",
    "PlanError",
    "Problem",
    "ProblemError",
    "Stage",
    "bundled_examples",
    "check_plan",
    "compare",
    "evaluate",
    "evaluate_hetero",
    "get_submesh_choices",
    "load_example",
    "load_problem",
    "make_plan",
    "simulate",
    "simulate_plan",
    "solve",
]
