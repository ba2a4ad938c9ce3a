"""The settings of the Megatron-style search
(:func:`~pipedejavu.search.megatron.planner.search_megatron`) and what it
returns."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.predictor import Prediction
from pipedejavu.search.megatron.space import SearchScope

__all__ = [
    "MAX_PLAN_BLOCKS",
    "MegatronSearchConfig",
    "MegatronSearchResult",
    "bound_reaches",
    "check_plan_size",
]

#: The most transformer blocks a plan is searched for. The planning tables
#: hold every span of layers, and the gradient buckets of every span grow
#: with the cube of the count: 1,000 blocks took 2.3 GB and 27 s on 8 GPUs,
#: 2,000 ran out of memory. The largest dense models trained have about 130
#: blocks. Predicting a given plan or launch has no such limit.
MAX_PLAN_BLOCKS = 512


def bound_reaches(lower_s: float, time_s: float) -> bool:
    """A certified lower bound ``lower_s`` on every plan's predicted time
    settles a plan of ``time_s`` as the optimum (to floating-point rounding:
    the bound and the time are sums taken in different orders)."""
    return lower_s >= time_s * (1 - 1e-12)


def check_plan_size(data: Any, model: str) -> None:
    """Refuse to search plans of a model of more than :data:`MAX_PLAN_BLOCKS`
    blocks (its ``data.model_info(model).num_layers`` counts the embedding and
    the head too).

    Raises:
        ProblemError: naming the model and the limit.
    """
    blocks = data.model_info(model).num_layers - 2
    if blocks > MAX_PLAN_BLOCKS:
        raise ProblemError(
            f"{model} has {blocks} transformer layers; plans are searched for "
            f"models of at most {MAX_PLAN_BLOCKS} (the search's tables grow with "
            "the cube of the layers): predict a plan or a launch of it instead"
        )


@dataclasses.dataclass(frozen=True)
class MegatronSearchConfig(SearchScope):
    """Static settings of :func:`~pipedejavu.search.megatron.planner.search_megatron`.

    Args:
        uniform_tp, allow_fewer_gpus, mbs_values, max_stages, dp_alone: the
            configurations searched
            (:class:`~pipedejavu.search.megatron.space.SearchScope`);
            Megatron-LM, DeepSpeed and torchtitan need ``uniform_tp``, and
            torchtitan runs data parallelism with TP or PP only as FSDP
            (``dp_alone`` keeps its DDP plans).
        rescore_tolerance: re-score by the predictor every configuration optimum
            within this fraction of the best planning objective.
        method: ``"dp"`` (exact) or ``"diff"`` (the differentiable engine per
            configuration, with its certified lower bound).
        diff_configs: with ``"diff"``, after how many configurations with a plan
            (best bound first) the engine stops; the bound of the first
            configuration left enters the certified lower bound.
        certify: prove the chosen plan (of either method) the predictor's
            optimum (:mod:`pipedejavu.search.megatron.certify`; a better plan it
            finds is chosen instead).
        certify_max_plans: most predictor calls the proof may spend; beyond,
            it certifies a lower bound on the predicted time instead (``None``:
            3000, or 10000 with ``mixed_types``, whose plans have more stages
            and whose proof needs more predictions: 3,600-5,000 on the RTX
            cluster of the measured runs).
        polish_max_plans: predictor calls the polish of a proof that spent
            ``certify_max_plans`` may make on top
            (:mod:`~pipedejavu.search.megatron.polish`; ``None``: a third of
            the proof's; 0: no polish).
        mixed_types: with several GPU types and ``uniform_tp``, also plans whose
            stages run on different types (``dp`` replicas of one type per
            stage); the proof's branch and bound searches them
            (:mod:`pipedejavu.search.megatron.certify`), so it needs
            ``certify``, and ``uniform_tp`` (a TP degree per stage together
            with mixed types is not searched).
    """

    rescore_tolerance: float = 0.02
    method: str = "dp"
    diff_configs: int = 8
    certify: bool = True
    certify_max_plans: int | None = None
    mixed_types: bool = False
    polish_max_plans: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("dp", "diff"):
            raise ValueError(f"method must be 'dp' or 'diff', got {self.method!r}")
        if not (math.isfinite(self.rescore_tolerance) and self.rescore_tolerance >= 0):
            raise ValueError(
                f"rescore_tolerance must be >= 0, got {self.rescore_tolerance}"
            )
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"max_stages must be >= 1, got {self.max_stages}")
        if self.diff_configs < 1:
            raise ValueError(f"diff_configs must be >= 1, got {self.diff_configs}")
        if self.mixed_types and not self.certify:
            raise ValueError("mixed_types needs certify (the proof searches them)")
        if self.mixed_types and not self.uniform_tp:
            raise ValueError(
                "mixed_types needs one TP degree for all stages (uniform_tp; "
                "plans mixing GPU types and TP degrees are not searched)"
            )
        for name in ("certify_max_plans", "polish_max_plans"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def proof_budget(self) -> int:
        """``certify_max_plans``, its default filled in."""
        if self.certify_max_plans is not None:
            return self.certify_max_plans
        return 10_000 if self.mixed_types else 3000

    @property
    def polish_budget(self) -> int:
        """``polish_max_plans``, its default filled in."""
        if self.polish_max_plans is not None:
            return self.polish_max_plans
        return self.proof_budget // 3


@dataclasses.dataclass(frozen=True, eq=False)
class MegatronSearchResult:
    """The chosen plan and what is known about it.

    Attributes:
        plan: the chosen plan (canonically placed).
        prediction: the predictor's view of it.
        objective_s: its planning objective (closed form; ``nan`` for a plan
            mixing GPU types).
        optimum_s: the least planning objective found.
        lower_bound_s: a certified lower bound on the planning objective over
            the whole search space (``== optimum_s`` for the exact method).
        gap: ``optimum_s / lower_bound_s - 1``.
        configurations: configurations in the search space.
        solved: configurations whose optimum was computed.
        candidates: ``(plan, objective, predicted)`` of the re-scored optima.
        search_time_s: wall-clock seconds (the proof included).
        predicted_lower_bound_s: certified lower bound on the predicted time of
            every plan of the search space that fits (``nan`` with
            ``certify=False``).
        proven: the plan is the predictor's optimum over the search space.
        certificate: the proof's record
            (:class:`~pipedejavu.search.megatron.certify.PredictedCertificate`),
            or ``None``.
    """

    plan: Plan3D
    prediction: Prediction
    objective_s: float
    optimum_s: float
    lower_bound_s: float
    gap: float
    configurations: int
    solved: int
    candidates: tuple[tuple[Plan3D, float, float], ...]
    search_time_s: float
    method: str
    predicted_lower_bound_s: float = math.nan
    proven: bool = False
    certificate: Any = None

    @property
    def predicted_gap(self) -> float:
        """Certified relative gap of the predicted time (``nan``: none)."""
        if not self.predicted_lower_bound_s > 0:
            return math.nan
        return self.prediction.iteration_time_s / self.predicted_lower_bound_s - 1
