"""A discrete-event simulator of one pipeline training iteration.

Alpa scores a plan with ``sum_s t_s + (B - 1) * max_s t_s``. This module runs the
schedule instead (a FlexFlow-style "simulation playground") to show where that
formula is exact and where it is not. The run loops (free links: a sweep over the
stages; shared links: an event loop) are in :mod:`pipedejavu.simulation.schedules`.

Model:

* Each stage ``s`` is one resource (its devices act together) that runs, in the
  schedule's fixed order, ``F(s, b)`` (forward of micro-batch ``b``, lasting
  ``forward[s]``) and ``B(s, b)`` (backward, lasting ``backward[s]``).
* ``F(s, b)`` needs the activation of ``F(s - 1, b)``; ``B(s, b)`` needs the
  gradient of ``B(s + 1, b)`` and (by the order) ``F(s, b)``; the last stage's
  ``B(S - 1, b)`` follows its own ``F(S - 1, b)``.
* **Links.** Boundary ``l`` (between stages ``l`` and ``l + 1``) is one
  half-duplex link shared by both directions: it carries one transfer at a time,
  each lasting ``transfer[l]`` seconds (the activation of ``F(l, b)`` forward,
  the gradient of ``B(l + 1, b)`` back), first come first served by request time
  (the producer's end); at an exact tie a gradient goes before an activation.
  One micro-batch therefore keeps link ``l`` busy ``c_l = 2 * transfer[l]``
  seconds, the round trip of :func:`transfer_aware_formula`.
* **Schedules.** ``"gpipe"``: all forwards ``F(s, 0..B-1)``, then all backwards
  in the *same* micro-batch order ``B(s, 0..B-1)``. ``"1f1b"`` (Megatron /
  PipeDream-flush, non-interleaved): ``w = min(S - s, B)`` warm-up forwards, then
  alternately one backward and one forward, then the remaining backwards.
  ``"deepspeed"``: the same compute order as DeepSpeed's pipeline engine issues
  it, with its *blocking* transfers: a transfer starts when both stages reach it
  and keeps both busy (no overlap of a stage's compute with its own sends and
  receives); see :mod:`pipedejavu.simulation.deepspeed`. Megatron-LM's own
  non-interleaved order (``P - s - 1`` warm-up forwards, then one forward and
  one backward per step) is the same command order as ``"1f1b"``; its
  interleaved schedule (``V`` model chunks per stage) is
  :func:`pipedejavu.simulation.interleaved.simulate_interleaved`.
* **In flight** at a stage: forwards done minus backwards done (activations
  stashed); its peak depends on the order only: ``B`` for GPipe and
  ``min(S - s, B)`` for 1F1B.

Where the closed forms agree and differ (each claim is a test in
``tests/test_simulate.py``; ``t = f + b``, ``x`` = ``transfer``):

* **GPipe is a closed form** (:func:`gpipe_formula`). Its forward phase is a
  tandem line of deterministic servers ``f_0, x_0, f_1, ..., f_{S-1}`` that all
  ``B`` micro-batches enter at time 0, so it ends at ``sum f + sum x + (B - 1)
  max(f, x)``; every gradient transfer starts after the last activation has
  crossed, so the backward phase is the reverse line and
  ``T = sum t + 2 sum x + (B - 1) (max(max f, max x) + max(max b, max x))``.
  With free links that is ``>=`` Alpa's ``sum t + (B - 1) max t``, equal iff one
  stage has both the largest ``f`` and the largest ``b`` (e.g. any common
  ``backward_ratio``), and above it otherwise: ``f = (1, 4), b = (4, 1), B = 2``
  gives 18 s against 15 s.
* **Equal stages, free links**: both schedules take ``(S + B - 1)(f + b)``,
  Alpa's formula. (1F1B: stage ``s`` runs its ``S - s`` warm-up forwards back to
  back from ``s f``; the last stage then alternates without idling, and each
  backward reaches stage 0 ``(S - 1) b`` later.)
* **Unequal stages, 1F1B**: with a common ``backward_ratio`` the simulation never
  exceeded Alpa's formula on thousands of random instances and can be well below
  it (``f = (2, 1), b = (4, 2), B = 2``: 13 s against 15 s: the slow first stage
  overlaps its forwards with the others, while the formula puts every ``f + b``
  on the critical path). With stage-dependent ratios it can exceed it
  (``f = (1, 4, 1), b = (4, 1, 1), B = 2``: 18 s against 17 s).
* **Links** (:func:`transfer_aware_formula`, ``sum t + sum c + (B - 1)
  max(max t, max c)`` with ``c = 2 x``): GPipe equals it when the links are the
  bottleneck of both phases (``x >= max f`` and ``x >= max b``:
  ``S (f + b) + 2 (S + B - 2) x`` for equal stages) or never are (``x`` at most
  the ``f`` and the ``b`` of the slowest stage). 1F1B does not follow it: one
  round trip is two separate visits to a link, so with two stages, an even ``B``
  and ``x >= f + b`` at both stages the link never idles and
  ``T = f_0 + 2 B x + b_0``, *below* the formula; with an odd ``B`` or more
  stages the warm-up limit of ``S - s`` micro-batches in flight starves the
  links and ``T`` can exceed the formula: the forward of micro-batch ``b + w``
  at stage ``s`` (``w = min(S - s, B)``) waits for the backward of ``b``, at
  least the round trip ``R_s = sum_{k >= s} (f_k + b_k) + 2 sum_{l >= s} x_l``
  later, so ``T >= R_0 + floor((B - 1) / w) R_s`` (far above the formula when
  links are slow). The planner's objective
  (:func:`pipedejavu.core.hetero_rules.hetero_objective`) adds these in-flight
  loops to the period; it does not model the links' first-come-first-served
  sharing, so it estimates 1F1B (within 25% on the tested instances).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.hetero_rules import check_hetero_plan, transfer_times
from pipedejavu.core.problem import Plan, Problem, check_plan, objective
from pipedejavu.simulation.deepspeed import run_deepspeed
from pipedejavu.simulation.schedules import (
    TimedSchedule,
    checked_count,
    checked_vector,
    command_order,
    run_events,
    run_fixed_order,
    timed_fields,
)

__all__ = [
    "SCHEDULES",
    "Event",
    "SimulationResult",
    "alpa_formula",
    "gpipe_formula",
    "simulate",
    "simulate_plan",
    "split_latencies",
    "transfer_aware_formula",
]

SCHEDULES = ("gpipe", "1f1b", "deepspeed")


class Event(NamedTuple):
    """One busy interval of a stage (``kind`` ``"F"``/``"B"``) or a link (``"T"``).

    ``direction`` is ``"F"`` (activation forward) or ``"B"`` (gradient back) for a
    transfer and ``""`` for a stage event. Times in seconds from the start.
    """

    kind: str
    microbatch: int
    start: float
    end: float
    direction: str = ""


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class SimulationResult(TimedSchedule):
    """The timed schedule of one iteration.

    Attributes:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"deepspeed"``.
        num_microbatches: B.
        iteration_time: seconds until the last event ends.
        forward, backward: f64[S] seconds per micro-batch of each stage.
        transfer: f64[S - 1] seconds per micro-batch per direction of each link.
        forward_start, forward_end, backward_start, backward_end: f64[S, B]
            seconds; ``[s, b]`` is ``F(s, b)`` / ``B(s, b)``.
        activation_start, activation_end, gradient_start, gradient_end:
            f64[S - 1, B] seconds; the transfers over link ``l`` of micro-batch
            ``b`` (NaN where ``transfer[l] == 0``: nothing is modelled).
        busy_time: f64[S] seconds each stage computes, ``B * (f + b)``.
        idle_fraction: f64[S] ``1 - busy_time / iteration_time``.
        peak_in_flight: i64[S] most micro-batches forwarded but not yet
            backwarded at each stage.
        peak_memory: f64[S] bytes, ``peak_in_flight * memory_per_microbatch``, or
            ``None`` when no memory was given.
    """

    schedule: str

    @property
    def num_stages(self) -> int:
        """S."""
        return self.forward.shape[0]

    @functools.cached_property
    def stage_events(self) -> tuple[tuple[Event, ...], ...]:
        """Per stage, its ``F``/``B`` events in time order."""
        rows = []
        for s in range(self.num_stages):
            events = [
                Event(kind, b, float(start[s, b]), float(end[s, b]))
                for kind, start, end in (
                    ("F", self.forward_start, self.forward_end),
                    ("B", self.backward_start, self.backward_end),
                )
                for b in range(self.num_microbatches)
            ]
            rows.append(tuple(sorted(events, key=lambda e: (e.start, e.end))))
        return tuple(rows)

    @functools.cached_property
    def link_events(self) -> tuple[tuple[Event, ...], ...]:
        """Per link ``l`` (stages ``l`` -> ``l + 1``), its ``T`` events in time
        order; empty for a free link."""
        rows = []
        for link in range(self.num_stages - 1):
            events = [
                Event("T", b, float(start[link, b]), float(end[link, b]), direction)
                for direction, start, end in (
                    ("F", self.activation_start, self.activation_end),
                    ("B", self.gradient_start, self.gradient_end),
                )
                for b in range(self.num_microbatches)
                if not math.isnan(start[link, b])
            ]
            rows.append(tuple(sorted(events, key=lambda e: (e.start, e.end))))
        return tuple(rows)


def alpa_formula(latencies: Sequence[float], num_microbatches: int) -> float:
    """Alpa's pipeline latency ``sum(t) + (B - 1) * max(t)`` in seconds.

    Args:
        latencies: f64[S] seconds per micro-batch (forward + backward) per stage.
        num_microbatches: B >= 1.
    """
    return objective(latencies, num_microbatches)


def transfer_aware_formula(
    latencies: Sequence[float], transfers: Sequence[float], num_microbatches: int
) -> float:
    """``sum t + sum c + (B - 1) * max(max t, max c)`` in seconds.

    Links count as pipeline steps: ``c_l`` is the round-trip time of one
    micro-batch over link ``l`` (activation forward plus gradient back, i.e.
    ``2 * transfer[l]`` of :func:`simulate`). With ``c = 0`` it is Alpa's formula.

    Args:
        latencies: f64[S] seconds per micro-batch (forward + backward) per stage.
        transfers: f64[S - 1] round-trip seconds per micro-batch per link.
        num_microbatches: B >= 1.
    """
    latencies = [float(t) for t in latencies]
    transfers = [float(c) for c in transfers]
    if len(transfers) != len(latencies) - 1:
        raise ValueError(
            f"transfers must have S - 1 = {len(latencies) - 1} entries, "
            f"got {len(transfers)}"
        )
    bottleneck = max(max(latencies), max(transfers, default=0.0))
    return float(
        math.fsum(latencies)
        + math.fsum(transfers)
        + (num_microbatches - 1) * bottleneck
    )


def gpipe_formula(
    forward: ArrayLike,
    backward: ArrayLike,
    num_microbatches: int,
    transfer: ArrayLike | None = None,
) -> float:
    """GPipe's exact iteration time under :func:`simulate`'s model, in seconds:
    ``sum(f + b) + 2 sum x + (B - 1) (max(max f, max x) + max(max b, max x))``.

    Args:
        forward, backward: f64[S] seconds per micro-batch per stage.
        num_microbatches: B >= 1.
        transfer: f64[S - 1] seconds per micro-batch per direction per link
            (``None``: free links).
    """
    forward = checked_vector(forward, "forward", None)
    backward = checked_vector(backward, "backward", forward.shape[0])
    links = (
        np.zeros(0)
        if transfer is None
        else checked_vector(transfer, "transfer", forward.shape[0] - 1)
    )
    slowest_link = float(links.max(initial=0.0))
    return float(
        math.fsum(forward)
        + math.fsum(backward)
        + 2 * math.fsum(links)
        + (num_microbatches - 1)
        * (max(forward.max(), slowest_link) + max(backward.max(), slowest_link))
    )


def split_latencies(
    latencies: ArrayLike, backward_ratio: float = 2.0
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Split forward+backward latencies as ``backward = backward_ratio * forward``.

    Args:
        latencies: f64[S] seconds per micro-batch (forward + backward).
        backward_ratio: backward / forward time, >= 0 (2 by default, so forward
            is a third of the latency).

    Returns:
        ``(forward, backward)``, each f64[S] seconds.
    """
    ratio = float(backward_ratio)
    if not math.isfinite(ratio) or ratio < 0:
        raise ValueError(f"backward_ratio must be finite and >= 0, got {ratio}")
    latencies = checked_vector(latencies, "latencies", None)
    forward = latencies / (1.0 + ratio)
    return forward, latencies - forward


def simulate(
    forward: ArrayLike,
    backward: ArrayLike,
    num_microbatches: int,
    *,
    schedule: str = "1f1b",
    transfer: ArrayLike | None = None,
    memory_per_microbatch: ArrayLike | None = None,
    gradient_transfer: ArrayLike | None = None,
    blocking: bool | ArrayLike = True,
) -> SimulationResult:
    """Simulate one training iteration of a pipeline (see the module docstring).

    Args:
        forward: f64[S] seconds per micro-batch of each stage's forward pass.
        backward: f64[S] seconds per micro-batch of each stage's backward pass.
        num_microbatches: B >= 1.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"deepspeed"``.
        transfer: f64[S - 1] seconds per micro-batch per direction over each link
            (``None``: free links).
        gradient_transfer: f64[S - 1] seconds of the gradient transfer back over
            each link when it differs from ``transfer`` (``"deepspeed"`` only;
            ``None``: ``transfer``).
        blocking: ``"deepspeed"`` only: per link (or one bool for all) whether a
            transfer is a rendezvous that keeps both stages busy (``True``) or is
            buffered: the sender hands the tensor over at once and the receiver
            waits only for its arrival (a tensor that fits in the communication
            library's buffer).
        memory_per_microbatch: f64[S] bytes each in-flight micro-batch holds at
            each stage (``None``: no memory report).

    Returns:
        The :class:`SimulationResult`.

    Raises:
        ValueError: naming the bad argument, what was expected and what arrived.

    Example:
        >>> simulate([1.0, 1.0], [2.0, 2.0], 4).iteration_time  # (S + B - 1)(f + b)
        15.0
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    count = checked_count(num_microbatches, "num_microbatches", 1)
    forward = checked_vector(forward, "forward", None)
    num_stages = forward.shape[0]
    if num_stages < 1:
        raise ValueError("forward must have at least one stage, got shape (0,)")
    backward = checked_vector(backward, "backward", num_stages)
    transfer = (
        np.zeros(num_stages - 1)
        if transfer is None
        else checked_vector(transfer, "transfer", num_stages - 1)
    )
    memory = (
        None
        if memory_per_microbatch is None
        else checked_vector(memory_per_microbatch, "memory_per_microbatch", num_stages)
    )

    if schedule != "deepspeed" and (
        gradient_transfer is not None or blocking is not True
    ):
        raise ValueError(
            "gradient_transfer and blocking apply to the deepspeed schedule only"
        )
    if schedule == "deepspeed":
        back = (
            transfer
            if gradient_transfer is None
            else checked_vector(gradient_transfer, "gradient_transfer", num_stages - 1)
        )
        modes = np.broadcast_to(np.asarray(blocking), (num_stages - 1,))
        if modes.dtype != np.bool_:
            raise ValueError(f"blocking must be bools, got dtype {modes.dtype}")
        orders, grids = run_deepspeed(
            forward.tolist(),
            backward.tolist(),
            transfer.tolist(),
            back.tolist(),
            modes.tolist(),
            count,
        )
        return _result(
            schedule, count, forward, backward, transfer, memory, orders, grids
        )
    orders = [command_order(schedule, s, num_stages, count) for s in range(num_stages)]
    args = (forward.tolist(), backward.tolist())
    if transfer.any():
        grids = run_events(*args, transfer.tolist(), orders, count)
    else:
        grids = run_fixed_order(*args, orders, count)
    return _result(schedule, count, forward, backward, transfer, memory, orders, grids)


def _result(schedule, count, forward, backward, transfer, memory, orders, grids):
    steps = np.where(np.asarray(orders) < count, 1, -1)
    peak = np.cumsum(steps, axis=1).max(axis=1).astype(np.int64)
    return SimulationResult(
        schedule=schedule,
        num_microbatches=count,
        forward=forward,
        backward=backward,
        transfer=transfer,
        peak_in_flight=peak,
        peak_memory=None if memory is None else peak * memory,
        **timed_fields(grids, count * (forward + backward), (-1, count)),
    )


def simulate_plan(
    problem: Problem | HeteroProblem,
    plan: Plan | HeteroPlan,
    *,
    schedule: str = "1f1b",
    backward_ratio: float = 2.0,
    transfer: ArrayLike | None = None,
    memory_per_microbatch: ArrayLike | None = None,
    num_microbatches: int | None = None,
) -> SimulationResult:
    """Simulate a plan of a problem, splitting each stage's table latency (forward
    + backward) as ``backward = backward_ratio * forward``.

    The latencies are read from ``problem.compute_cost`` after
    :func:`~pipedejavu.core.problem.check_plan` (or
    :func:`~pipedejavu.core.hetero_rules.check_hetero_plan` for a placed
    :class:`~pipedejavu.core.hetero.HeteroPlan` of a
    :class:`~pipedejavu.core.hetero.HeteroProblem`), never from the plan's
    records; B is the problem's unless ``num_microbatches`` is given. For a
    placed plan ``transfer`` defaults to half of each boundary's round trip
    (:func:`~pipedejavu.core.hetero_rules.transfer_times`, one direction).
    Other arguments as in :func:`simulate`.

    Raises:
        PlanError: the plan breaks a rule of the problem.
        ProblemError: a plan and a problem of different kinds (placed vs not).
        ValueError: a bad argument.
    """
    hetero_plan = isinstance(plan, HeteroPlan)
    if hetero_plan != isinstance(problem, HeteroProblem):
        raise ProblemError(
            "simulate_plan: plan and problem must match: a HeteroPlan (from "
            "solve on a HeteroProblem) with its HeteroProblem, or a Plan with its "
            f"Problem; got a {type(plan).__name__} and a {type(problem).__name__}"
        )
    if hetero_plan:
        check_hetero_plan(problem, plan)
        latencies = [
            float(
                problem.compute_cost[
                    s.start, s.stop - 1, s.submesh_index, s.config_index, s.device_type
                ]
            )
            for s in plan.stages
        ]
        if transfer is None:
            transfer = [c / 2 for c in transfer_times(problem, plan)] or None
    else:
        check_plan(problem, plan)
        latencies = [
            problem.stage_cost(s.start, s.stop, s.submesh_index, s.config_index)
            for s in plan.stages
        ]
    forward, backward = split_latencies(latencies, backward_ratio)
    return simulate(
        forward,
        backward,
        problem.num_microbatches if num_microbatches is None else num_microbatches,
        schedule=schedule,
        transfer=transfer,
        memory_per_microbatch=memory_per_microbatch,
    )
