"""The three exceptions every part of pipedejavu raises.

They live apart from :mod:`pipedejavu.core.problem` so that the low-level readers
(:mod:`pipedejavu.core.npzfile`) can raise them without importing the vocabulary;
:mod:`pipedejavu.core.problem` and the top-level package re-export them.
"""

from __future__ import annotations

__all__ = ["InfeasibleProblemError", "PlanError", "ProblemError"]


class ProblemError(ValueError):
    """The input does not describe a valid problem (bad shapes, NaNs, files, ...).

    Raised for every unreadable, corrupt or inconsistent input file too; the
    message is one line and names the file or argument.
    """


class InfeasibleProblemError(Exception):
    """A valid problem that has no feasible plan; the message says why."""


class PlanError(ValueError):
    """A plan breaks one of the problem's rules.

    Attributes:
        rule: short name of the broken rule, e.g. ``"contiguity"``, ``"memory"``.
        stage: index of the offending stage, or ``None`` for whole-plan rules.
    """

    def __init__(self, rule: str, stage: int | None, message: str):
        where = "plan" if stage is None else f"stage {stage}"
        super().__init__(f"{where} breaks the {rule} rule: {message}")
        self.rule = rule
        self.stage = stage
