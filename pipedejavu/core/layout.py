"""Named-axis parallel layouts: which GPU holds which shard of a plan.

A plan's GPUs are laid out along named axes. The dense part of the model (the
attention, the dense MLPs, the embedding and the head) uses

* ``tp``: tensor parallelism, per stage (stages may differ: ``--per-stage-tp``);
* ``cp``: context parallelism, each GPU of a group holding a share of every
  sequence, the same for all stages;
* ``dp``: data parallelism, replicas of the stage, the same for all stages;
* ``pp``: the pipeline stage.

Sharded data parallelism (ZeRO, FSDP) splits ``dp`` once more: ``dp_shard``
replicas, the inner factor of ``dp`` (neighbouring replicas, as torchtitan's
mesh ``dp_replicate, dp_shard, cp, tp`` lays them out), shard the model state
a training option says is sharded
(:attr:`~pipedejavu.core.training_options.TrainingOptions.zero_stage`) over
their ``dp_shard x cp`` GPUs (:attr:`ParallelLayout.shard_group`: torchtitan
shards over ``dp_shard`` and ``cp`` together, Megatron-LM's distributed
optimizer over ``dp`` and ``cp``); ``dp / dp_shard`` groups replicate it
(HSDP). ``dp_shard`` by default is all of ``dp``.

Expert layers (mixture of experts) use the same GPUs of each stage, laid out
again as Megatron-Core folds them: ``etp`` (expert tensor parallelism, by
default ``tp``), ``ep`` (expert parallelism: experts spread over the GPUs) and
``edp`` (expert data parallelism: whatever is left, ``tp cp dp / (etp ep)``
GPUs), with ``pp`` shared. The context-parallel GPUs are folded into ``ep``
and ``edp`` there.

**The rank rule** (Megatron-Core's ``RankGenerator``, as
``initialize_model_parallel`` builds its dense and expert generators): an
order string names the axes innermost first; a GPU's rank is
``sum_i index_i prod_{k < i} size_k``. Two orders exist:

* :data:`PP_OUTER`, ``tp-cp-ep-dp-pp`` (Megatron's default): stage ``s``
  holds the consecutive ranks from ``first_s = sum_{r < s} G_r``
  (``G_r = tp_r cp dp``); dense ``(tp t, cp c, dp d)`` is rank ``first_s + t +
  tp_s c + tp_s cp d``, expert ``(etp x, ep e, edp f)`` is ``first_s + x +
  etp_s e + etp_s ep_s f``;
* :data:`DP_OUTER`, ``tp-cp-ep-pp-dp`` (``--use-tp-pp-dp-mapping``): a
  replica of the whole pipeline holds consecutive ranks,
  ``first_s = sum_{r < s} tp_r cp`` and a replica's stride ``P = sum_r tp_r
  cp``; dense ``first_s + t + tp_s c + P d``, expert ``first_s + x + etp_s e +
  P f``. With several stages this needs ``etp_s ep_s = tp_s cp`` (Megatron
  asserts that the expert and dense data-parallel sizes then agree); with one
  stage both orders are one layout.

With equal stages these are Megatron's ranks exactly (checked against its
``RankGenerator`` on recorded layouts: ``tests/fixtures/megatron_rank_groups.json``);
with per-stage TP they number each stage's GPUs as the plans here always have
(:func:`pipedejavu.core.plan3d.canonical_nodes`).

Not Megatron's *pipeline layout* (``--pipeline-model-parallel-layout``, which
layers each stage holds: :mod:`pipedejavu.io.megatron_layout`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.validation import as_count, describe

__all__ = [
    "DENSE_AXES",
    "DP_OUTER",
    "EXPERT_AXES",
    "LEGACY_ORDERS",
    "MAX_GPUS",
    "PIPELINE_SPLITS",
    "PP_OUTER",
    "RANK_ORDERS",
    "ParallelLayout",
    "StageAxes",
    "experts_fit",
    "chunks_hold_blocks",
    "rank_order",
    "split_blocks",
]

#: Most GPUs in a plan, and so in a prediction: the largest clusters trained on
#: today (the predictor's time grows with the replicas: ~1 s at 131,072 GPUs of
#: data parallelism alone).
MAX_GPUS = 2**17
#: Megatron-Core's default order, innermost axis first: pipeline stages outermost.
PP_OUTER = "tp-cp-ep-dp-pp"
#: Megatron-Core's order under ``--use-tp-pp-dp-mapping``: replicas outermost.
DP_OUTER = "tp-cp-ep-pp-dp"
RANK_ORDERS = (PP_OUTER, DP_OUTER)
#: The names plan files and the command line used before the named axes.
LEGACY_ORDERS = {"tp-dp-pp": PP_OUTER, "tp-pp-dp": DP_OUTER}
#: The axes of the dense part and of expert layers, innermost first in
#: :data:`PP_OUTER` (:data:`DP_OUTER` puts ``pp`` before the data axis).
DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")


def rank_order(name: Any) -> str:
    """A rank order of :data:`RANK_ORDERS`, the legacy names accepted.

    Raises:
        ProblemError: any other value.
    """
    if isinstance(name, str) and name in LEGACY_ORDERS:
        return LEGACY_ORDERS[name]
    if isinstance(name, str) and name in RANK_ORDERS:
        return name
    known = ", ".join(RANK_ORDERS + tuple(LEGACY_ORDERS))
    raise ProblemError(f"rank order must be one of {known}; got {describe(name)}")


def experts_fit(tp: int, cp: int, dp: int, ep: int = 1, etp: int | None = None) -> bool:
    """Whether a stage of ``tp x cp x dp`` GPUs is whole groups of ``etp x
    ep`` (``etp`` ``None``: ``tp``): Megatron-Core's rule for the expert
    layout (``initialize_model_parallel``: expert data parallelism a whole
    number). The one definition the layout checks and the search keeps to."""
    return (tp * cp * dp) % ((tp if etp is None else etp) * ep) == 0


class StageAxes(NamedTuple):
    """One stage's own axes: ``tp``, and for expert layers ``ep`` and ``etp``
    (``None``: ``tp``, Megatron's default for ``--expert-tensor-parallel-size``)."""

    tp: int
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The named-axis layout of a plan (module docstring).

    Args:
        stages: each stage's :class:`StageAxes` (a bare int is its ``tp``);
            ``pp`` is their number.
        dp: data-parallel replicas of every stage.
        cp: context-parallel GPUs per sequence, the same for every stage.
        order: :data:`PP_OUTER` or :data:`DP_OUTER` (the legacy names
            ``tp-dp-pp`` and ``tp-pp-dp`` are read as those).
        dp_shard: the replicas of a shard group (module docstring; a divisor
            of ``dp``; ``None``, or ``dp`` itself, stored as ``None``: all).

    Raises:
        ProblemError: a size that is not a positive integer, more than
            :data:`MAX_GPUS` GPUs, a stage whose expert block ``etp ep`` does
            not divide its GPUs ``tp cp dp`` (no whole expert data
            parallelism), or a :data:`DP_OUTER` pipeline whose expert block is
            not its dense one ``tp cp`` (Megatron-Core refuses both).
    """

    stages: tuple[StageAxes, ...]
    dp: int
    cp: int = 1
    order: str = PP_OUTER
    dp_shard: int | None = None
    #: Each stage's first rank and the stride between its replicas (derived).
    _firsts: tuple[int, ...] = dataclasses.field(
        init=False, repr=False, compare=False, default=()
    )
    _strides: tuple[tuple[int, int], ...] = dataclasses.field(
        init=False, repr=False, compare=False, default=()
    )

    def __post_init__(self) -> None:
        given = self.stages
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise ProblemError(f"stages must be a sequence, got {describe(given)}")
        if not given:
            raise ProblemError("a layout needs at least one stage")
        if len(given) > MAX_GPUS:
            raise ProblemError(f"at most {MAX_GPUS} stages, got {len(given)}")
        # Every size is bounded before any product is taken.
        dp = as_count(self.dp, "dp", maximum=MAX_GPUS)
        cp = as_count(self.cp, "cp", maximum=MAX_GPUS)
        stages = []
        for s, item in enumerate(given):
            axes = StageAxes(item) if not isinstance(item, tuple) else item
            if not isinstance(axes, StageAxes):
                axes = StageAxes(*axes)
            tp = as_count(axes.tp, f"stage {s}: tp", maximum=MAX_GPUS)
            ep = as_count(axes.ep, f"stage {s}: ep", maximum=MAX_GPUS)
            etp = axes.etp
            if etp is not None:
                etp = as_count(etp, f"stage {s}: etp", maximum=MAX_GPUS)
            stages.append(StageAxes(tp, ep, etp))
        total = sum(axes.tp for axes in stages) * cp * dp
        if total > MAX_GPUS:
            raise ProblemError(f"a layout holds at most {MAX_GPUS} GPUs, got {total}")
        order = rank_order(self.order)
        for s, axes in enumerate(stages):
            block = axes.expert_tp * axes.ep
            gpus = axes.tp * cp * dp
            if not experts_fit(axes.tp, cp, dp, axes.ep, axes.etp):
                raise ProblemError(
                    f"stage {s}: its {gpus} GPUs (tp {axes.tp} x cp {cp} x dp {dp}) "
                    f"are not whole groups of etp {axes.expert_tp} x ep {axes.ep}"
                )
            if order == DP_OUTER and len(stages) > 1 and block != axes.tp * cp:
                raise ProblemError(
                    f"stage {s}: with replicas outermost ({DP_OUTER}) and several "
                    f"stages, etp x ep ({block}) must be tp x cp ({axes.tp * cp}): "
                    "expert and dense data parallelism of the same size"
                )
        object.__setattr__(self, "stages", tuple(stages))
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "cp", cp)
        object.__setattr__(self, "order", order)
        shard = self.dp_shard
        if shard is not None:
            shard = as_count(shard, "dp_shard", maximum=MAX_GPUS)
            if dp % shard:
                raise ProblemError(
                    f"dp_shard {shard} does not divide the {dp} data-parallel replicas"
                )
            object.__setattr__(self, "dp_shard", None if shard == dp else shard)
        # Ranks: stage s from its first; replicas apart by the whole pipeline's
        # model GPUs (replicas outermost) or by the replica's own GPUs.
        pipelined = order == DP_OUTER and len(stages) > 1
        models = [axes.tp * cp for axes in stages]
        widths = models if pipelined else [m * dp for m in models]
        firsts = [0]
        for width in widths[:-1]:
            firsts.append(firsts[-1] + width)
        pipeline = sum(models)
        strides = tuple(
            (pipeline, pipeline) if pipelined else (model, axes.expert_tp * axes.ep)
            for model, axes in zip(models, stages, strict=True)
        )
        object.__setattr__(self, "_firsts", tuple(firsts))
        object.__setattr__(self, "_strides", strides)

    @classmethod
    def uniform(
        cls,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        order: str = PP_OUTER,
        dp_shard: int | None = None,
    ) -> ParallelLayout:
        """Every stage alike, as Megatron-LM, DeepSpeed and torchtitan run."""
        count = as_count(pp, "pp", maximum=MAX_GPUS)
        return cls((StageAxes(tp, ep, etp),) * count, dp, cp, order, dp_shard)

    # ------------------------------------------------------------ sizes
    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def num_gpus(self) -> int:
        return sum(self.stage_gpus(s) for s in range(self.pp))

    @property
    def shard_replicas(self) -> int:
        """Data-parallel replicas of a shard group (``dp_shard``, else ``dp``)."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def shard_group(self) -> int:
        """GPUs a sharded model state is split over: ``dp_shard x cp``."""
        return self.shard_replicas * self.cp

    @property
    def dp_replicate(self) -> int:
        """Shard groups holding the same shards (HSDP; 1: plain sharding)."""
        return self.dp // self.shard_replicas

    def model_size(self, stage: int) -> int:
        """GPUs of one dense replica of ``stage``: ``tp cp``."""
        return self.stages[stage].tp * self.cp

    def stage_gpus(self, stage: int) -> int:
        return self.model_size(stage) * self.dp

    def expert_block(self, stage: int) -> int:
        """GPUs of one expert replica of ``stage``: ``etp ep``."""
        axes = self.stages[stage]
        return axes.expert_tp * axes.ep

    def edp(self, stage: int) -> int:
        """Expert data-parallel replicas of ``stage``."""
        return self.stage_gpus(stage) // self.expert_block(stage)

    def sizes(self, stage: int) -> dict[str, int]:
        """Every axis's size at ``stage`` (``pp`` the layout's)."""
        axes = self.stages[stage]
        return {
            "tp": axes.tp,
            "cp": self.cp,
            "dp": self.dp,
            "etp": axes.expert_tp,
            "ep": axes.ep,
            "edp": self.edp(stage),
            "pp": self.pp,
        }

    def first_rank(self, stage: int) -> int:
        """The lowest rank of ``stage``'s first replica."""
        return self._firsts[stage]

    # ------------------------------------------------------------ the rule
    def rank(self, stage: int, *, tp: int = 0, cp: int = 0, dp: int = 0) -> int:
        """Global rank of the dense coordinates ``(tp, cp, dp)`` of ``stage``."""
        axes = self._coordinates(stage, {"tp": tp, "cp": cp, "dp": dp})
        return self._firsts[stage] + tp + axes.tp * cp + self._strides[stage][0] * dp

    def expert_rank(
        self, stage: int, *, etp: int = 0, ep: int = 0, edp: int = 0
    ) -> int:
        """Global rank of the expert coordinates ``(etp, ep, edp)`` of ``stage``
        (the same GPUs as the dense ones, laid out again)."""
        axes = self._coordinates(stage, {"etp": etp, "ep": ep, "edp": edp})
        stride = self._strides[stage][1]
        return self._firsts[stage] + etp + axes.expert_tp * ep + stride * edp

    def replica_ranks(self, stage: int) -> list[int]:
        """The first rank of each of ``stage``'s data-parallel replicas (its
        ``tp cp`` GPUs are the consecutive ranks from there)."""
        self._coordinates(stage, {})
        first, stride = self._firsts[stage], self._strides[stage][0]
        return [first + j * stride for j in range(self.dp)]

    def expert_replicas(self, stage: int) -> list[int]:
        """For each expert data-parallel index of ``stage`` (a block of ``etp
        ep`` GPUs), the data-parallel replica holding its first GPU."""
        self._coordinates(stage, {})
        replica, expert = self._strides[stage]
        return [f * expert // replica for f in range(self.edp(stage))]

    def _coordinates(self, stage: int, coords: dict[str, int]) -> StageAxes:
        if not (isinstance(stage, int) and 0 <= stage < self.pp):
            raise ProblemError(
                f"stage must be in [0, {self.pp}), got {describe(stage)}"
            )
        sizes = self.sizes(stage)
        for name, value in coords.items():
            if not (isinstance(value, int) and 0 <= value < sizes[name]):
                raise ProblemError(
                    f"stage {stage}: {name} must be in [0, {sizes[name]}), "
                    f"got {describe(value)}"
                )
        return self.stages[stage]

    def axis_order(self, expert: bool = False) -> tuple[str, ...]:
        """The axes innermost first in this layout's order."""
        names = EXPERT_AXES if expert else DENSE_AXES
        return names if self.order == PP_OUTER else (*names[:2], "pp", names[2])

    # ------------------------------------------------------------ groups
    def groups(self, axes: str) -> list[list[int]]:
        """The communication groups along ``axes`` (``"tp"``, ``"dp-cp"``,
        ``"ep"``, ``"etp-ep"``, ``"pp"``...: dense or expert names, not both),
        as Megatron-Core's ``RankGenerator.get_ranks`` lists them: the groups
        by the other axes' indices, the first of this order's axes fastest;
        members likewise.

        Raises:
            ProblemError: unknown or mixed names; ``pp`` in a group where the
                stages' sizes differ (no GPU of one stage pairs with one of
                another).
        """
        names = axes.split("-") if isinstance(axes, str) else []
        expert = any(name in EXPERT_AXES[:3] for name in names)
        order = self.axis_order(expert)
        if (
            not names
            or any(n not in order for n in names)
            or len(set(names)) < len(names)
        ):
            raise ProblemError(
                f"groups: axes must be distinct names of {'-'.join(DENSE_AXES)} or "
                f"of {'-'.join(EXPERT_AXES)}, got {describe(axes)}"
            )
        inner = [name for name in order if name in names]
        outer = [name for name in order if name not in names]
        if "pp" in inner and len({self._shape(s, expert) for s in range(self.pp)}) > 1:
            raise ProblemError(
                f"groups {axes}: the stages' sizes differ, so no GPU of one stage "
                "pairs with one of another"
            )
        rank = self.expert_rank if expert else self.rank
        found = []
        for fixed in self._walk(outer, {}):
            members = []
            for point in self._walk(inner, fixed):
                stage = point.pop("pp")
                members.append(rank(stage, **point))
            found.append(members)
        return found

    def _shape(self, stage: int, expert: bool) -> tuple[int, ...]:
        sizes = self.sizes(stage)
        return tuple(sizes[name] for name in self.axis_order(expert) if name != "pp")

    def _walk(
        self, names: list[str], fixed: dict[str, int]
    ) -> Iterator[dict[str, int]]:
        """Every assignment of ``names`` (the first fastest) extending
        ``fixed``; a size is read at the stage ``pp`` already has (the stage
        is outer to every per-stage axis in both orders)."""
        if not names:
            yield dict(fixed)
            return
        *faster, slowest = names
        if slowest == "pp":
            count = self.pp
        else:
            count = self.sizes(fixed.get("pp", 0))[slowest]
        for index in range(count):
            yield from self._walk(faster, {**fixed, slowest: index})

    def stage_ranks(self) -> list[list[int]]:
        """Every GPU's rank, by stage then dense ``(dp, cp, tp)`` (tp fastest)."""
        return [
            [
                self.rank(s, tp=t, cp=c, dp=d)
                for d, c, t in itertools.product(
                    range(self.dp), range(self.cp), range(self.stages[s].tp)
                )
            ]
            for s in range(self.pp)
        ]


#: Megatron-LM's even pipeline splits, its default first: ``(embedding,
#: loss)`` counted as one layer of the split
#: (``--account-for-embedding-in-pipeline-split``,
#: ``--account-for-loss-in-pipeline-split``).
PIPELINE_SPLITS = ((False, False), (True, True), (True, False), (False, True))


def split_blocks(
    blocks: int, parts: int, embedding: bool = False, loss: bool = False
) -> list[int] | None:
    """The transformer blocks of each of ``parts`` pipeline parts (ranks, or
    virtual stages in their order) when Megatron-LM splits ``blocks`` evenly
    (``get_num_layers_to_build``): equal parts of the blocks with the
    embedding (``embedding``) and/or the loss (``loss``) counted as a layer
    of the first (last) part; ``None`` where they do not split evenly."""
    units = blocks + embedding + loss
    if parts < 1 or units % parts:
        return None
    per = units // parts
    held = [
        per - (embedding and k == 0) - (loss and k == parts - 1) for k in range(parts)
    ]
    return None if min(held) < 0 else held


def chunks_hold_blocks(
    blocks: int, ranks: int, chunks: int, embedding: bool = False, loss: bool = False
) -> bool:
    """Whether ``ranks`` pipeline ranks of ``chunks`` model chunks each split
    ``blocks`` evenly as Megatron-LM's interleaved schedule does
    (:func:`split_blocks` of ``ranks x chunks`` virtual stages) with a block
    in every chunk: a chunk of the embedding or the loss alone is neither
    searched nor exported."""
    held = split_blocks(blocks, ranks * chunks, embedding, loss)
    return ranks >= 2 and held is not None and min(held) >= 1
