"""costmodel: Alpa profile databases -> stage tables -> :class:`pipedejavu.Problem`.

Alpa's files are pickles and are treated as untrusted: they are read only through
a restricted unpickler that maps the known Alpa class names to plain classes.
"""

from pipedejavu.costmodel.alpa.memory import StageMemoryStats as StageMemoryStats
from pipedejavu.costmodel.alpa.memory import stage_memory_stats as stage_memory_stats
from pipedejavu.costmodel.alpa.profiles import (
    problem_from_stage_profile as problem_from_stage_profile,
)
from pipedejavu.costmodel.alpa.profiles import read_prof_database as read_prof_database
from pipedejavu.costmodel.alpa.profiles import read_stage_profile as read_stage_profile
from pipedejavu.costmodel.alpa.profiles import (
    stage_profile_tables as stage_profile_tables,
)
from pipedejavu.costmodel.stage.layers import LayerSpec as LayerSpec
from pipedejavu.costmodel.stage.layers import (
    boundary_activation_bytes as boundary_activation_bytes,
)
from pipedejavu.costmodel.stage.layers import gpt_layers as gpt_layers
from pipedejavu.costmodel.stage.layers import irregular_layers as irregular_layers
from pipedejavu.costmodel.stage.memory_model import MemoryStatsTable as MemoryStatsTable
from pipedejavu.costmodel.stage.memory_model import (
    memory_stats_table as memory_stats_table,
)
from pipedejavu.costmodel.stage.memory_model import (
    synthetic_memory_stats as synthetic_memory_stats,
)
from pipedejavu.costmodel.stage.synthesis import AlphaBetaComm as AlphaBetaComm
from pipedejavu.costmodel.stage.synthesis import StageTables as StageTables
from pipedejavu.costmodel.stage.synthesis import stage_cost_table as stage_cost_table
from pipedejavu.costmodel.stage.synthesis import synthesize as synthesize
from pipedejavu.io.alpa_pickle import UnsafePickleError as UnsafePickleError
from pipedejavu.io.alpa_pickle import load_alpa_npy as load_alpa_npy
from pipedejavu.io.alpa_pickle import load_alpa_pickle as load_alpa_pickle
from pipedejavu.io.alpa_records import MeshProfilingResult as MeshProfilingResult
from pipedejavu.io.alpa_records import ModuleProfileResult as ModuleProfileResult
from pipedejavu.io.alpa_records import StageProfileResult as StageProfileResult

# The JAX-based parts load on first use, so that reading Alpa's files (and
# `import baselines`) does not pay for importing JAX.
_LAZY = {
    "LinearStageModel": "stage.linear",
    "fit_linear_model": "stage.linear",
    "CommModel": "alpa.comm",
    "fit_comm_model": "alpa.comm",
    "comm_report": "alpa.comm_plots",
    "predict_stage_costs": "stage.predict",
    "SubsetConfig": "stage.predict",
    "PredictionResult": "stage.predict",
    "LayerProfile": "profiling.profiler",
    "profile_model": "profiling.profiler",
    "problem_from_layer_profile": "profiling.layer_problem",
    "profile_to_problem": "profiling.layer_problem",
    "fit_stage_overhead": "profiling.stage_overhead",
    "DataParallelScaling": "profiling.layer_problem",
    "StageOverhead": "profiling.stage_overhead",
    "GoodputFunction": "goodput.function",
    "PerfParams": "goodput.model",
    "GradParams": "goodput.model",
    "fit_perf_params": "goodput.fit",
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
