"""The training knobs a plan may take (:class:`KnobSpace`) and how the search
settled each choice of them (:class:`KnobOutcome`); the search is
:mod:`pipedejavu.planning.knobs`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from pipedejavu.core.plan3d import RANK_ORDERS
from pipedejavu.core.training_options import (
    RECOMPUTE_GRANULARITIES,
    TORCHTITAN_OP,
    RecomputeGranularity,
    TrainingOptions,
)
from pipedejavu.io.exports import (
    LAUNCHED_RANK_ORDERS,
    LAUNCHED_RECOMPUTE_LAYERS,
    LAUNCHED_SCHEDULES,
    LAUNCHED_TRAINING,
)
from pipedejavu.planning.training import finite_or_none

__all__ = [
    "MEGATRON_SCHEDULES",
    "SCHEDULES",
    "KnobOutcome",
    "KnobSpace",
    "recompute_name",
    "schedule_name",
]

_ON_OFF = (True, False)
#: The pipeline schedules searched.
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "interleaved-zb", "zbv")
#: Those Megatron-LM runs (it has no flag for the zero-bubble schedules).
MEGATRON_SCHEDULES = LAUNCHED_SCHEDULES["megatron"]


def recompute_name(options: TrainingOptions) -> str:
    """The recomputation ``options`` run, for a report: ``none``,
    ``selective``, ``full``, ``full (first N blocks)`` or ``full (per stage:
    n0, n1, ... blocks)``."""
    if options.recompute_choices is not None:
        counts = options.recompute_stage_layers or options.recompute_choices
        names = ", ".join("all" if n is None else str(n) for n in counts)
        if options.recompute_stage_layers is None:
            return f"{options.recompute} (per stage, of {names} blocks)"
        return f"{options.recompute} (per stage: {names} blocks)"
    if options.selective_modules == (TORCHTITAN_OP,):
        return "selective (torchtitan's per-op policy)"
    if options.recompute_num_layers is None:
        return options.recompute
    return f"{options.recompute} (first {options.recompute_num_layers} blocks)"


def schedule_name(options: TrainingOptions) -> str:
    """The schedule ``options`` run, for a report: ``1F1B``, ``interleaved 1F1B
    (V chunks)``, ``ZB-H1``, ``interleaved ZB (V chunks)`` or ``ZB-V``."""
    if options.v_shape:
        return "ZB-V"
    if options.virtual_stages > 1:
        kind = "ZB" if options.zero_bubble else "1F1B"
        return f"interleaved {kind} ({options.virtual_stages} chunks)"
    return "ZB-H1" if options.zero_bubble else "1F1B"


def _shown(value: Any) -> str:
    """A knob value as the CLI spells it."""
    return {True: "on", False: "off"}.get(value, str(value))


@dataclasses.dataclass(frozen=True)
class KnobSpace:
    """The knob values a plan may take (each a tuple of allowed values).

    Args:
        recompute: ``none``, ``selective``, ``full`` (Megatron-LM's
            ``--recompute-granularity``; ``full`` recomputes every layer,
            ``--recompute-method uniform --recompute-num-layers 1``).
        sequence_parallel: ``--sequence-parallel`` (with TP > 1).
        distributed_optimizer: ``--use-distributed-optimizer``.
        schedules: ``1f1b`` (DeepSpeed's and Megatron-LM's non-interleaved
            1F1B, any stages) and ``interleaved`` (Megatron-LM's interleaved
            1F1B, ``V >= 2`` equal chunks per rank:
            :mod:`pipedejavu.search.megatron.interleaved`) and ``zb-h1`` (the
            zero-bubble schedule ZB-H1, any stages:
            :mod:`pipedejavu.simulation.zero_bubble`; priced analytically only,
            profiles do not split the backward) and ``interleaved-zb`` (the
            same over ``V >= 2`` equal chunks per rank, PyTorch's
            ``ScheduleInterleavedZeroBubble``; the interleaved plans' search)
            and ``zbv`` (ZB-V: two equal chunks per rank in a V, PyTorch's
            ``ScheduleZBVZeroBubble``; the same search).
        rank_orders: Megatron-LM's rank orders
            (:data:`~pipedejavu.core.plan3d.RANK_ORDERS`: ``tp-dp-pp``, its
            default, and ``tp-pp-dp``, ``--use-tp-pp-dp-mapping``), a placement
            of the same plans, searched with every schedule.
        recompute_layers: with ``full``, how many transformer blocks of each
            stage (model chunk) are recomputed: ``None`` every one (the
            ``uniform`` method), ``N`` the first ``N`` (Megatron-LM's
            ``--recompute-method block --recompute-num-layers N``); each value
            is a choice, fewer blocks first.
        recompute_per_stage: with ``full``, one more choice: each stage
            reruns its own count of blocks, the least of 0 and
            ``recompute_layers`` with which it fits (AdaPipe-style,
            :mod:`pipedejavu.costmodel.megatron.stage_recompute`; 1F1B and
            ZB-H1 plans; no launcher takes counts that differ by stage, so
            such a plan exports only where its counts agree).
    """

    recompute: tuple[RecomputeGranularity, ...] = RECOMPUTE_GRANULARITIES
    sequence_parallel: tuple[bool, ...] = _ON_OFF
    distributed_optimizer: tuple[bool, ...] = _ON_OFF
    schedules: tuple[str, ...] = SCHEDULES
    rank_orders: tuple[str, ...] = RANK_ORDERS
    recompute_layers: tuple[int | None, ...] = (None,)
    recompute_per_stage: bool = False

    def __post_init__(self) -> None:
        layers = self.recompute_layers
        if (
            not isinstance(layers, tuple)
            or not layers
            or len(set(layers)) != len(layers)
            or any(
                v is not None
                and (isinstance(v, bool) or not isinstance(v, int) or v < 1)
                for v in layers
            )
        ):
            raise ValueError(
                "recompute_layers: distinct values, each None (every block) or "
                f"an int >= 1; got {layers}"
            )
        for name, allowed in (("schedules", SCHEDULES), ("rank_orders", RANK_ORDERS)):
            values = getattr(self, name)
            if (
                not isinstance(values, tuple)
                or not values
                or any(v not in allowed for v in values)
                or len(set(values)) != len(values)
            ):
                raise ValueError(
                    f"{name}: distinct values from {allowed}; got {values}"
                )
        if not isinstance(self.recompute_per_stage, bool):
            raise ValueError(
                f"recompute_per_stage must be a bool, got {self.recompute_per_stage!r}"
            )
        if self.recompute_per_stage and "full" not in self.recompute:
            raise ValueError(
                "recompute_per_stage chooses counts of full recomputation: add "
                f"'full' to recompute, got {self.recompute}"
            )
        if RANK_ORDERS[0] not in self.rank_orders:
            raise ValueError(
                f"rank_orders: the default order {RANK_ORDERS[0]} is always "
                f"searched (the others are added to it); got {self.rank_orders}"
            )
        for name, allowed in (
            ("recompute", RECOMPUTE_GRANULARITIES),
            ("sequence_parallel", _ON_OFF),
            ("distributed_optimizer", _ON_OFF),
        ):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not values:
                raise ValueError(f"{name}: give a non-empty tuple of values")
            bad = [
                v
                for v in values
                if v not in allowed or (name != "recompute" and not isinstance(v, bool))
            ]
            if bad or len(set(values)) != len(values):
                raise ValueError(
                    f"{name}: values must be distinct, from {allowed}; got {values}"
                )

    @classmethod
    def fixed(
        cls, options: TrainingOptions, rank_orders: tuple[str, ...] = RANK_ORDERS
    ) -> KnobSpace:
        """The one choice ``options`` makes (its schedule: 1F1B, interleaved
        when ``options.virtual_stages > 1``, ZB-H1 with ``zero_bubble``,
        interleaved-zb with both, zbv with ``v_shape``), in ``rank_orders``
        (a placement: the same costs). Per-stage recomputation's choice comes
        with the uniform counts it chooses from (which it never loses to)."""
        schedule = "1f1b"
        if options.v_shape:
            schedule = "zbv"
        elif options.virtual_stages > 1:
            schedule = "interleaved-zb" if options.zero_bubble else "interleaved"
        elif options.zero_bubble:
            schedule = "zb-h1"
        layers: tuple[int | None, ...] = (options.recompute_num_layers,)
        choices = options.recompute_choices
        if choices is not None:
            layers = tuple(n for n in choices if n != 0) or (None,)
        return cls(
            (options.recompute,),
            (options.sequence_parallel,),
            (options.distributed_optimizer,),
            (schedule,),
            rank_orders,
            layers,
            choices is not None,
        )

    def for_target(self, target: str) -> KnobSpace:
        """The part of this space that export ``target`` launches as planned
        (:data:`~pipedejavu.io.exports.LAUNCHED_SCHEDULES`,
        :data:`~pipedejavu.io.exports.LAUNCHED_RANK_ORDERS`,
        :data:`~pipedejavu.io.exports.LAUNCHED_TRAINING`,
        :data:`~pipedejavu.io.exports.LAUNCHED_RECOMPUTE_LAYERS`).

        Raises:
            ValueError: a knob none of whose values the target launches (the
                knob, its values and the target's, one line).
        """
        training = LAUNCHED_TRAINING[target]
        launched = {
            "schedules": LAUNCHED_SCHEDULES[target],
            "rank_orders": LAUNCHED_RANK_ORDERS[target],
            "recompute": training["recompute"],
            "sequence_parallel": training["sequence_parallel"],
            "distributed_optimizer": training["distributed_optimizer"],
        }
        kept = {}
        for name, allowed in launched.items():
            values = tuple(v for v in getattr(self, name) if v in allowed)
            if name == "sequence_parallel" and not values and True in allowed:
                # "with TP > 1" (torchtitan's): plans without it still launch
                # at TP 1; a target without it (DeepSpeed's) is refused here,
                # not after a search whose TP > 1 plans it cannot launch
                values = getattr(self, name)
            if not values:
                shown = [_shown(v) for v in getattr(self, name)]
                raise ValueError(
                    f"{target} does not launch {name.replace('_', ' ')} "
                    f"{', '.join(shown)} as planned (it launches "
                    f"{', '.join(_shown(v) for v in allowed)})"
                )
            kept[name] = values
        layers = LAUNCHED_RECOMPUTE_LAYERS[target]
        if layers is not None and "full" in kept["recompute"]:
            counts = tuple(n for n in self.recompute_layers if n in layers)
            if not counts:
                shown = ", ".join(str(n) for n in self.recompute_layers)
                raise ValueError(
                    f"{target} recomputes every block of a stage or none, not "
                    f"the first {shown} (give --recompute-num-layers all)"
                )
            kept["recompute_layers"] = counts
        # (per-stage counts: only where the target takes counts of blocks)
        per_stage = self.recompute_per_stage and "full" in kept["recompute"]
        per_stage = per_stage and layers is None
        return dataclasses.replace(self, recompute_per_stage=per_stage, **kept)

    def choices(self, base: TrainingOptions) -> list[TrainingOptions]:
        """Every choice, the fastest per plan first (module docstring);
        ``base`` gives the other fields. Without the dominated ones: see
        :meth:`dominated`."""
        return [c for c in self.all_choices(base) if not self.is_dominated(c)]

    def is_dominated(self, options: TrainingOptions) -> bool:
        """Settled by the distributed optimizer's rule (module docstring);
        not when the gradient reduction overlaps the backward pass, where
        the optimizer's all-gather after its step may wait longer than the
        whole all-reduce hidden behind that pass."""
        return (
            not options.distributed_optimizer
            and True in self.distributed_optimizer
            and not options.overlap_grad_reduce
        )

    def for_experts(self) -> KnobSpace:
        """The space searched for a mixture of experts: Megatron's default
        rank order only (with replicas outermost and several stages,
        Megatron-Core needs the expert block to be the dense one, ``etp x ep
        = tp x cp``, which an EP above TP never is: :mod:`pipedejavu.core.
        layout`)."""
        return dataclasses.replace(self, rank_orders=self.rank_orders[:1])

    def dominated(self, base: TrainingOptions) -> list[TrainingOptions]:
        """The choices :meth:`is_dominated` settles."""
        return [c for c in self.all_choices(base) if self.is_dominated(c)]

    def all_choices(self, base: TrainingOptions) -> list[TrainingOptions]:
        """Every choice of the space, in search order."""
        order = {value: i for i, value in enumerate(RECOMPUTE_GRANULARITIES)}
        modes = []  # (granularity, blocks recomputed): fewer blocks first
        for r in sorted(self.recompute, key=order.__getitem__):
            if r != "full":
                modes.append((r, None))
                continue
            some = sorted(n for n in self.recompute_layers if n is not None)
            every = [None] if None in self.recompute_layers else []
            modes += [(r, n) for n in [*some, *every]]
            if self.recompute_per_stage:
                modes.append((r, (0, *some, None)))
        out = []
        for (r, layers), sp, dist in itertools.product(
            modes,
            sorted(self.sequence_parallel, reverse=True),
            sorted(self.distributed_optimizer, reverse=True),
        ):
            per_stage = layers if isinstance(layers, tuple) else None
            out.append(
                dataclasses.replace(
                    base,
                    recompute=r,
                    recompute_num_layers=None if per_stage else layers,
                    recompute_choices=per_stage,
                    recompute_stage_layers=None,
                    sequence_parallel=sp,
                    tp_comm_overlap=base.tp_comm_overlap and sp,
                    distributed_optimizer=dist,
                    zero_stage=max(base.zero_stage, 1) if dist else 0,
                    overlap_param_gather=base.overlap_param_gather and dist,
                    virtual_stages=1,
                    zero_bubble=False,
                    v_shape=False,
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """Each knob's allowed values (``recompute_per_stage``: a bool)."""
        return {
            k: v if isinstance(v, bool) else list(v)
            for k, v in dataclasses.asdict(self).items()
        }

    def describe(self) -> str:
        """``recompute none|selective|full, sequence parallel on|off, ...``."""

        def flags(values: tuple[bool, ...]) -> str:
            return "|".join("on" if v else "off" for v in values)

        blocks = ""
        if self.recompute_layers != (None,) and "full" in self.recompute:
            names = ["all" if n is None else str(n) for n in self.recompute_layers]
            blocks = f" (full: {'|'.join(names)} blocks a stage)"
        if self.recompute_per_stage and "full" in self.recompute:
            blocks += " (and per stage)"
        return (
            f"schedule {'|'.join(self.schedules)}, "
            f"recompute {'|'.join(self.recompute)}{blocks}, sequence parallel "
            f"{flags(self.sequence_parallel)}, distributed optimizer "
            f"{flags(self.distributed_optimizer)}, rank order "
            f"{'|'.join(self.rank_orders)}"
        )


@dataclasses.dataclass(frozen=True)
class KnobOutcome:
    """How one choice of knobs was settled.

    Attributes:
        options: the choice.
        how: ``searched`` (full search and proof), ``proof`` (the proof's
            branch and bound with the cutoff), ``infeasible`` (no plan fits),
            ``dominated`` (the distributed optimizer's rule, module docstring)
            ``interleaved`` (the interleaved schedules' branch and bound,
            with the cutoff; ``options.zero_bubble``: interleaved-zb,
            ``options.v_shape``: zbv) or
            ``zero-bubble`` (the proof's branch and bound on the ZB-H1
            predictor, with the cutoff).
        best_s: the best predicted time found in this choice (``nan``: none
            found, or none below the cutoff).
        cutoff_s: the best predicted time before this choice (``inf`` first),
            or a sharded plan's where it is less (``plan_with_knobs``'
            ``outside_s``).
        proven: the choice holds no plan that fits faster than
            ``min(cutoff_s, best_s)``.
        time_s: seconds spent.
        rank_order: the placement searched.
    """

    options: TrainingOptions
    how: str
    best_s: float
    cutoff_s: float
    proven: bool
    time_s: float
    rank_order: str = RANK_ORDERS[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options.to_json(),
            "rank_order": self.rank_order,
            "how": self.how,
            "best_s": finite_or_none(self.best_s),
            "cutoff_s": finite_or_none(self.cutoff_s),
            "proven": self.proven,
            "time_s": self.time_s,
        }

    @classmethod
    def infeasible(
        cls, options: TrainingOptions, seconds: float, order: str = RANK_ORDERS[0]
    ) -> KnobOutcome:
        """A choice with no plan that fits in ``order`` (proven)."""
        return cls(options, "infeasible", math.nan, math.inf, True, seconds, order)
