"""Parallel random initialization: many starting points at once, keep the
promising ones, resample around them, train the survivors (pipeDejavu's third
idea), measured against one run and best-of-N at equal compute.

Modules: :mod:`.data` (the bundled digits and their split), :mod:`.model`
(flax MLPs, He/Glorot base distributions), :mod:`.train` (vmapped, jitted
training of a population), :mod:`.sampling` (top-k selection, resampling),
:mod:`.strategies` (the three strategies and their compute accounting),
:mod:`.summary` (confidence intervals, time to target), :mod:`.plots` and
:mod:`.limits` (the settings' ranges, the memory estimate).
"""

from pipedejavu.core.lazy import lazy_getattr
from pipedejavu.init_search.limits import (
    DEFAULT_MEMORY_LIMIT_GB as DEFAULT_MEMORY_LIMIT_GB,
)
from pipedejavu.init_search.limits import population_bytes as population_bytes

# The JAX-based parts load on first use, so that the CLI's parser (which reads
# the ranges of :mod:`.limits`) does not pay for importing JAX.
_LAZY = {
    "Dataset": "data",
    "load_digits": "data",
    "MODEL_NAMES": "model",
    "ModelConfig": "model",
    "model_config": "model",
    "resample": "sampling",
    "resample_scales": "sampling",
    "select_top_k": "sampling",
    "STRATEGY_NAMES": "strategies",
    "InitSearchConfig": "strategies",
    "StrategyResult": "strategies",
    "run_strategies": "strategies",
    "METRICS": "train",
    "TrainConfig": "train",
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = ["DEFAULT_MEMORY_LIMIT_GB", "population_bytes", *_LAZY]
