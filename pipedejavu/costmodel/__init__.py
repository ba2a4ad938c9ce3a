"""costmodel: Alpa profile databases -> stage tables -> :class:`pipedejavu.Problem`.

Alpa's files are pickles and are treated as untrusted: they are read only through
a restricted unpickler that maps the known Alpa class names to plain classes.
"""

from ._unpickle import UnsafePickleError as UnsafePickleError
from ._unpickle import load_alpa_npy as load_alpa_npy
from ._unpickle import load_alpa_pickle as load_alpa_pickle
from .alpa_memory import StageMemoryStats as StageMemoryStats
from .alpa_memory import stage_memory_stats as stage_memory_stats
from .alpa_profiles import problem_from_stage_profile as problem_from_stage_profile
from .alpa_profiles import read_prof_database as read_prof_database
from .alpa_profiles import read_stage_profile as read_stage_profile
from .alpa_profiles import stage_profile_tables as stage_profile_tables
from .alpa_types import MeshProfilingResult as MeshProfilingResult
from .alpa_types import ModuleProfileResult as ModuleProfileResult
from .alpa_types import StageProfileResult as StageProfileResult
from .layers import LayerSpec as LayerSpec
from .layers import boundary_activation_bytes as boundary_activation_bytes
from .layers import gpt_layers as gpt_layers
from .layers import irregular_layers as irregular_layers
from .memory_model import MemoryStatsTable as MemoryStatsTable
from .memory_model import memory_stats_table as memory_stats_table
from .memory_model import synthetic_memory_stats as synthetic_memory_stats
from .synthesis import AlphaBetaComm as AlphaBetaComm
from .synthesis import StageTables as StageTables
from .synthesis import stage_cost_table as stage_cost_table
from .synthesis import synthesize as synthesize

# The JAX-based parts load on first use, so that reading Alpa's files (and
# `import baselines`) does not pay for importing JAX.
_LAZY = {
    "CommModel": "comm",
    "fit_comm_model": "comm",
    "comm_report": "comm_plots",
    "predict_stage_costs": "predict",
    "SubsetConfig": "predict",
    "PredictionResult": "predict",
    "plan_regret": "predict_regret",
    "predictor_report": "predict_regret",
    "format_predictor_report": "predict_regret",
    "RegretResult": "predict_regret",
    "LayerProfile": "profiler",
    "profile_model": "profiler",
    "problem_from_layer_profile": "profiler",
    "profile_to_problem": "profiler",
    "fit_stage_overhead": "profiler",
    "DataParallelScaling": "profiler",
    "StageOverhead": "profiler",
    "GoodputFunction": "goodput",
    "PerfParams": "goodput",
    "GradParams": "goodput",
    "fit_perf_params": "goodput",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pipedejavu.costmodel' has no attribute {name!r}")


__all__ = [
    "AlphaBetaComm",
    "MemoryStatsTable",
    "memory_stats_table",
    "synthetic_memory_stats",
    *_LAZY,
    "LayerSpec",
    "StageTables",
    "boundary_activation_bytes",
    "gpt_layers",
    "irregular_layers",
    "stage_cost_table",
    "synthesize",
    "MeshProfilingResult",
    "ModuleProfileResult",
    "StageMemoryStats",
    "StageProfileResult",
    "UnsafePickleError",
    "load_alpa_npy",
    "load_alpa_pickle",
    "problem_from_stage_profile",
    "read_prof_database",
    "read_stage_profile",
    "stage_memory_stats",
    "stage_profile_tables",
]
