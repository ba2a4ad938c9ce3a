"""The engine's static settings and its result."""

from __future__ import annotations

import dataclasses

import numpy as np

from pipedejavu.core.problem import Plan

__all__ = ["SearchConfig", "SearchResult"]


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Static settings of the engine (hashable; validated on construction).

    Attributes:
        num_restarts: random initializations optimized at once (vmap).
        num_steps: Adam steps per restart.
        max_stages: stage slots S of the relaxation (None: min(L, D, 32)).
        learning_rate: Adam step size on the logits.
        boundary_temperature: (start, end) of the boundary sharpness, layers.
        slot_temperature: (start, end) of the slot softmax temperature.
        max_temperature: (start, end) of the smooth-max temperature, relative to
            a typical stage latency.
        penalty: (start, end) weight of the device-budget penalty.
        num_polished: best rounded restarts polished exactly (up to as many
            again while the lower bound does not prove the best plan optimal).
        polish_window: layers a boundary may move in one polish round.
        max_polish_rounds: polish rounds per restart at most.
        num_chunks: the steps run in this many jitted chunks; progress is
            reported between chunks.
        time_budget_s: polishing starts no round that would (judging by the
            previous round) end past this many seconds from the start, once a
            plan is found; the fit, optimization and lower bound come on top.
            None: no limit.
        memory_limit_gb: the restarts run in batches that each need at most
            this much memory (estimated by :func:`restart_bytes`); their
            parameters, all kept at once, must fit in it too.
    """

    num_restarts: int = 64
    num_steps: int = 300
    max_stages: int | None = None
    learning_rate: float = 0.1
    boundary_temperature: tuple[float, float] = (2.0, 0.05)
    slot_temperature: tuple[float, float] = (1.0, 0.05)
    max_temperature: tuple[float, float] = (0.3, 0.003)
    penalty: tuple[float, float] = (1.0, 1000.0)
    num_polished: int = 4
    polish_window: int = 2
    max_polish_rounds: int = 20
    num_chunks: int = 10
    time_budget_s: float | None = None
    memory_limit_gb: float = 2.0

    def __post_init__(self) -> None:
        if not self.memory_limit_gb > 0:
            raise ValueError(f"memory_limit_gb must be > 0, got {self.memory_limit_gb}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s}")
        for name in (
            "num_restarts",
            "num_steps",
            "num_polished",
            "num_chunks",
            "max_polish_rounds",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.polish_window < 0:
            raise ValueError(f"polish_window must be >= 0, got {self.polish_window}")
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"max_stages must be >= 1, got {self.max_stages}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        for name in (
            "boundary_temperature",
            "slot_temperature",
            "max_temperature",
            "penalty",
        ):
            pair = getattr(self, name)
            if len(pair) != 2 or not all(x > 0 for x in pair):
                raise ValueError(f"{name} must be two positive numbers, got {pair}")
        if self.num_steps % self.num_chunks:
            raise ValueError(
                f"num_steps ({self.num_steps}) must be a multiple of num_chunks "
                f"({self.num_chunks})"
            )


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """A plan and how the search got there.

    Attributes:
        plan: the best plan (its ``info`` holds the scalar fields below too).
        lower_bound: certified lower bound on the optimum (seconds).
        loss_curve: f[num_steps] seconds: the best relaxed loss over all
            restarts so far, at the final temperatures and penalty (the loss
            that is rounded), evaluated after each chunk of steps and held over
            the chunk; never rises.
        final_losses: f[num_restarts] relaxed loss of each restart at the end.
        polished_costs: exact cost reached from each polished restart.
        best_restart: index of the restart that produced the plan.
        fraction_best: fraction of polished restarts that reached the best cost.
        compile_time_s: tracing + XLA compilation (0 when cached).
        run_time_s: total wall time of the search.
    """

    plan: Plan
    lower_bound: float
    loss_curve: np.ndarray
    final_losses: np.ndarray
    polished_costs: dict[int, float]
    best_restart: int
    fraction_best: float
    compile_time_s: float
    run_time_s: float
