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
from .comm import CommModel as CommModel
from .comm import fit_comm_model as fit_comm_model
from .comm_plots import comm_report as comm_report
from .layers import LayerSpec as LayerSpec
from .layers import boundary_activation_bytes as boundary_activation_bytes
from .layers import gpt_layers as gpt_layers
from .layers import irregular_layers as irregular_layers
from .synthesize import AlphaBetaComm as AlphaBetaComm
from .synthesize import StageTables as StageTables
from .synthesize import stage_cost_table as stage_cost_table
from .synthesize import synthesize as synthesize

__all__ = [
    "AlphaBetaComm",
    "CommModel",
    "comm_report",
    "fit_comm_model",
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
