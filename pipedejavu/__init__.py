"""pipedejavu: pipeline-stage search for large models, measured against Alpa's DP.

The vocabulary (problem, cluster, hetero) comes first; the API modules below it
import only the vocabulary at load time and the solvers (`pipedejavu.search`,
`pipedejavu.baselines`, `pipedejavu.costmodel`) when a call needs them, so
`import pipedejavu` stays light (no JAX)."""

from .api import solve as solve
from .cluster import Cluster as Cluster
from .cluster import DeviceType as DeviceType
from .cluster import Link as Link
from .comparison import compare as compare
from .hetero import HeteroPlan as HeteroPlan
from .hetero import HeteroProblem as HeteroProblem
from .hetero import LayerMemory as LayerMemory
from .hetero import check_hetero_plan as check_hetero_plan
from .hetero import evaluate_hetero as evaluate_hetero
from .io import bundled_examples as bundled_examples
from .io import load_cluster as load_cluster
from .io import load_example as load_example
from .io import load_plan as load_plan
from .io import load_problem as load_problem
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
from .simulation import simulate as simulate
from .simulation import simulate_plan as simulate_plan

__version__ = "0.1.0"

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
    "evaluate",
    "evaluate_hetero",
    "get_submesh_choices",
    "load_cluster",
    "load_example",
    "load_plan",
    "load_problem",
    "make_plan",
    "simulate",
    "simulate_plan",
    "solve",
]
