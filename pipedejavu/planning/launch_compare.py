"""A user's Megatron-LM launch beside the best plan for the same training.

:func:`compare_megatron_run` predicts the launch
(:func:`~pipedejavu.planning.megatron_launch.predict_megatron_run`) and plans
the same model, GPUs, global batch and precision from scratch with every knob
searched (:func:`~pipedejavu.planning.knobs.search_knobs`: stages, TP, DP,
micro-batch size, the schedule, recomputation, sequence parallelism and the
distributed optimizer); the attention kernel and its dropout stay the launch's
(facts of the model's code), and so do its gradient-sync flags
(``--overlap-grad-reduce``, ``--overlap-param-gather``,
``--grad-reduce-in-bf16``). A mixture of experts keeps the launch's expert
layout (EP, expert TP, dispatcher, overlap: what the launch's costs price) and
Megatron's default rank order (as ``plan --model`` searches one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.source import (
    DEFAULT_MBS_VALUES,
    AnalyticalSource,
)
from pipedejavu.io.megatron_args import MegatronRun
from pipedejavu.planning.any_model import CostChoice
from pipedejavu.planning.expert_search import layout_search
from pipedejavu.planning.knob_space import MEGATRON_SCHEDULES, KnobSpace
from pipedejavu.planning.knobs import KnobPlan, search_knobs
from pipedejavu.planning.megatron_launch import (
    LaunchPrediction,
    expert_layers,
    options_of_run,
    predict_megatron_run,
)
from pipedejavu.planning.training import TrainingPlan

__all__ = [
    "SEARCH_SPACE_NOTE",
    "RunComparison",
    "compare_megatron_run",
    "launch_knob_space",
]

#: What the best plan of :func:`compare_megatron_run` was chosen among.
SEARCH_SPACE_NOTE = (
    "stages of contiguous layers, one TP degree, DP, micro-batch size and the "
    "GPUs used; the 1F1B and Megatron's interleaved schedules; recomputation "
    "none, selective or full (with a block launch, also its recomputed "
    "blocks); sequence parallelism and the distributed "
    "optimizer on or off; Megatron-LM's two rank orders; the "
    "launch's precision, attention kernel, gradient-sync flags and global batch"
)


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """A user's Megatron-LM launch and the best plan for the same model, global
    batch, GPUs and precision (:func:`compare_megatron_run`).

    Attributes:
        given: the launch as predicted.
        knobs: the best plan over the search space
            (:data:`SEARCH_SPACE_NOTE`) and how each choice was settled.
        source: the cost source that priced the best plan.
    """

    given: LaunchPrediction
    knobs: KnobPlan
    source: AnalyticalSource

    @property
    def best(self) -> TrainingPlan:
        """The best plan (its ``options`` say its knobs)."""
        return self.knobs.result

    @property
    def speedup(self) -> float:
        """Given time over the best plan's (> 1: the best plan is faster)."""
        return self.given.prediction.iteration_time_s / self.best.iteration_time_s

    def to_json(self) -> dict[str, Any]:
        """The best plan's JSON (what ``pipedejavu predict`` reads) with the
        given launch's time and prediction beside it."""
        out = self.knobs.to_json()
        out.update(
            given_iteration_time_s=self.given.prediction.iteration_time_s,
            speedup=self.speedup,
            given=self.given.to_json(),
            search_space=SEARCH_SPACE_NOTE,
        )
        return out


def launch_knob_space(run: MegatronRun) -> KnobSpace:
    """The knobs searched beside a launch by default: every knob, with the
    schedules Megatron-LM runs
    (:data:`~pipedejavu.planning.knob_space.MEGATRON_SCHEDULES`), and the
    launch's own block recomputation beside every block recomputed."""
    layers = options_of_run(run).recompute_num_layers
    return KnobSpace(
        schedules=MEGATRON_SCHEDULES,
        recompute_layers=(None,) if layers is None else (layers, None),
    )


def compare_megatron_run(
    run: MegatronRun,
    gpu_type: str,
    num_gpus: int,
    sheet: Mapping[str, GpuSheetEntry],
    *,
    space: KnobSpace | None = None,
    memory_headroom: MemoryHeadroom | None = None,
    **plan_options: Any,
) -> RunComparison:
    """Predict a Megatron-LM launch and plan the same training from scratch.

    Args:
        run: the parsed command line.
        gpu_type: a GPU type of ``sheet`` (its canonical name).
        num_gpus: GPUs of the launch (the best plan may use fewer).
        sheet: the GPU sheet.
        space: the knobs searched (``None``: :func:`launch_knob_space`).
        memory_headroom: memory every GPU keeps free, in the launch's
            prediction and the search alike (``None``: none).
        **plan_options: passed to :func:`~pipedejavu.planning.knobs.
            search_knobs` (``method``, ``allow_fewer_gpus``, ``progress_fn``).

    Raises:
        ProblemError: the launch cannot run, the GPU type is unknown, or it
            uses context parallelism (predicted, not planned).
        InfeasibleProblemError: no plan of the search space fits.
    """
    if run.context_parallel > 1:
        raise ProblemError(
            "plan does not search context parallelism: `pipedejavu predict "
            "--megatron-args` predicts this launch; plan it with "
            "--context-parallel-size 1"
        )
    given = predict_megatron_run(
        run, gpu_type, num_gpus, sheet, memory_headroom=memory_headroom
    )
    base = dataclasses.replace(options_of_run(run), virtual_stages=1)
    mbs_values = sorted({*DEFAULT_MBS_VALUES, run.micro_batch})
    gpu = given.plan.stages[0].replicas[0].gpu_type

    experts = expert_layers(run)

    def make_choice(options: TrainingOptions) -> CostChoice:
        source = AnalyticalSource(
            run.spec, sheet, options, mbs_values=mbs_values, experts=experts
        )
        source = source.with_memory_headroom(memory_headroom)
        return CostChoice(source, run.spec.name, {gpu: gpu}, options, run.spec)

    space = space or launch_knob_space(run)
    one_stage = False
    if experts is not None:
        found = layout_search(
            experts,
            space,
            precision=base.precision,
            mtp_layers=run.spec.mtp_layers,
        )
        if found is None:
            raise ProblemError(
                "no plan of the search space runs the launch's expert layout "
                "(--overlap-moe-expert-parallel-comm needs Megatron-LM's "
                "schedules, no full recomputation and interleaved pipelines)"
            )
        space, one_stage = found.space, found.one_stage_1f1b
    knobs = search_knobs(
        make_choice,
        base,
        {gpu: num_gpus},
        given.plan.gbs,
        space=space,
        one_stage_1f1b=one_stage,
        **plan_options,
    )
    return RunComparison(given, knobs, knobs.choice.data)
