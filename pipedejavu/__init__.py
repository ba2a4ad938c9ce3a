"""pipedejavu: pipeline-stage search for large models, measured against Alpa's DP.

The vocabulary (problem, cluster, hetero) comes first; the API modules below it
import only the vocabulary at load time and the solvers (`pipedejavu.search`,
`pipedejavu.baselines`, `pipedejavu.costmodel`) when a call needs them, so
`import pipedejavu` stays light (no JAX)."""

from pipedejavu.core.cluster import Cluster as Cluster
from pipedejavu.core.cluster import DeviceType as DeviceType
from pipedejavu.core.cluster import Link as Link
from pipedejavu.core.hetero import HeteroPlan as HeteroPlan
from pipedejavu.core.hetero import HeteroProblem as HeteroProblem
from pipedejavu.core.hetero_rules import check_hetero_plan as check_hetero_plan
from pipedejavu.core.hetero_rules import evaluate_hetero as evaluate_hetero
from pipedejavu.core.layer_memory import LayerMemory as LayerMemory
from pipedejavu.core.problem import InfeasibleProblemError as InfeasibleProblemError
from pipedejavu.core.problem import Plan as Plan
from pipedejavu.core.problem import PlanError as PlanError
from pipedejavu.core.problem import Problem as Problem
from pipedejavu.core.problem import ProblemError as ProblemError
from pipedejavu.core.problem import Stage as Stage
from pipedejavu.core.problem import check_plan as check_plan
from pipedejavu.core.problem import evaluate as evaluate
from pipedejavu.core.problem import get_submesh_choices as get_submesh_choices
from pipedejavu.core.problem import make_plan as make_plan
from pipedejavu.core.version import __version__ as __version__
from pipedejavu.planning.compare import compare as compare
from pipedejavu.planning.inputs import bundled_examples as bundled_examples
from pipedejavu.planning.inputs import load_cluster as load_cluster
from pipedejavu.planning.inputs import load_example as load_example
from pipedejavu.planning.inputs import load_plan as load_plan
from pipedejavu.planning.inputs import load_problem as load_problem
from pipedejavu.planning.solve import solve as solve
from pipedejavu.planning.training import plan_training as plan_training
from pipedejavu.search.engine.compile_cache import (
    enable_compilation_cache as enable_compilation_cache,
)
from pipedejavu.simulation.simulate import simulate as simulate
from pipedejavu.simulation.simulate import simulate_plan as simulate_plan

__all__ = [
    "Cluster",
    "DeviceType",
    "HeteroPlan",
    "HeteroProblem",
    "InfeasibleProblemError",
    "LayerMemory",
    "Link",
    "Plan",
    "PlanError",
    "Problem",
    "ProblemError",
    "Stage",
    "bundled_examples",
    "check_hetero_plan",
    "check_plan",
    "compare",
    "enable_compilation_cache",
    "evaluate",
    "evaluate_hetero",
    "get_submesh_choices",
    "load_cluster",
    "load_example",
    "load_plan",
    "load_problem",
    "make_plan",
    "plan_training",
    "simulate",
    "simulate_plan",
    "solve",
]
