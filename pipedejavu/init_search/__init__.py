"""Parallel random initialization: many starting points at once, keep the
promising ones, resample around them, train the survivors (pipeDejavu's third
idea), measured against one run and best-of-N at equal compute.

Modules: :mod:`.data` (the bundled digits and their split), :mod:`.model`
(flax MLPs, He/Glorot base distributions), :mod:`.train` (vmapped, jitted
training of a population), :mod:`.sampling` (top-k selection, resampling),
:mod:`.strategies` (the three strategies and their compute accounting),
:mod:`.summary` (confidence intervals, time to target) and :mod:`.plots`.
"""

from pipedejavu.init_search.data import Dataset as Dataset
from pipedejavu.init_search.data import load_digits as load_digits
from pipedejavu.init_search.model import MODEL_NAMES as MODEL_NAMES
from pipedejavu.init_search.model import ModelConfig as ModelConfig
from pipedejavu.init_search.model import model_config as model_config
from pipedejavu.init_search.sampling import resample as resample
from pipedejavu.init_search.sampling import resample_scales as resample_scales
from pipedejavu.init_search.sampling import select_top_k as select_top_k
from pipedejavu.init_search.strategies import STRATEGY_NAMES as STRATEGY_NAMES
from pipedejavu.init_search.strategies import InitSearchConfig as InitSearchConfig
from pipedejavu.init_search.strategies import StrategyResult as StrategyResult
from pipedejavu.init_search.strategies import run_strategies as run_strategies
from pipedejavu.init_search.train import METRICS as METRICS
from pipedejavu.init_search.train import TrainConfig as TrainConfig

__all__ = [
    "METRICS",
    "MODEL_NAMES",
    "STRATEGY_NAMES",
    "Dataset",
    "InitSearchConfig",
    "ModelConfig",
    "StrategyResult",
    "TrainConfig",
    "load_digits",
    "model_config",
    "resample",
    "resample_scales",
    "run_strategies",
    "select_top_k",
]
