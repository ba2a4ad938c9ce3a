"""Text reports of ``pipedejavu predict`` and ``pipedejavu plan``."""

from __future__ import annotations

import warnings
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.interleaving import rank_layers
from pipedejavu.io.export_rules import head_layers, num_blocks
from pipedejavu.planning.knob_space import recompute_name, schedule_name
from pipedejavu.planning.launch_compare import SEARCH_SPACE_NOTE, RunComparison

__all__ = [
    "context_parallel_line",
    "format_comparison",
    "format_knobs",
    "format_launchers",
    "format_prediction",
    "memory_line",
    "format_training_plan",
    "launchers_json",
    "objective_note",
    "pool_text",
    "proof_line",
    "seconds_or_na",
    "utilization_line",
    "warn_if_over_memory",
]

GB = 1e9


def format_prediction(plan, prediction, options: TrainingOptions | None = None) -> str:
    """The text report of ``pipedejavu predict`` (``options``: the training
    the prediction priced; its schedule names the pipeline line)."""
    breakdown = prediction.to_json()["breakdown"]
    options = options or TrainingOptions()
    chunks = options.virtual_stages
    schedule = "1F1B"
    if options.v_shape:
        schedule = "ZB-V zero bubble, 2 chunks per stage in a V"
    elif chunks > 1 and options.zero_bubble:
        schedule = f"interleaved zero bubble, {chunks} chunks per stage"
    elif chunks > 1:
        schedule = f"Megatron's interleaved 1F1B, {chunks} chunks per stage"
    elif options.zero_bubble:
        schedule = "ZB-H1 zero bubble"
    overlapped = ""
    if options.overlap_grad_reduce or options.overlap_param_gather:
        overlapped = ", what outlasts the passes it overlaps"
    lines = [
        f"plan: {plan.model}, {plan.describe()}, "
        f"{prediction.num_microbatches} micro-batches per pipeline",
        f"iteration time: {prediction.iteration_time_s:.4f} s",
        f"  pipeline ({schedule}): {breakdown['pipeline_s']:.4f} s, "
        f"bubble {100 * breakdown['bubble_fraction']:.1f}%",
        f"  tied-embedding all-reduce: {breakdown['tied_allreduce_s']:.4f} s",
        f"  data-parallel all-reduce{overlapped} (slowest stage): "
        f"{breakdown['dp_allreduce_s']:.4f} s",
        f"  optimizer step (largest): {breakdown['optimizer_s']:.4f} s",
    ]
    limits = prediction.memory_limit_bytes.min(axis=1)
    capacity = prediction.memory_capacity.min(axis=1)
    kept = prediction.memory_capacity_bytes is not None
    # with a headroom: "of <usable> GB usable (<capacity> GB)"
    lines.append(
        "peak memory per GPU (of what a plan may use: each GPU's memory less the "
        "--memory-headroom):"
        if kept
        else "peak memory per GPU:"
    )
    held = rank_layers(plan, options.v_shape)  # ZB-V: each rank's two chunks
    for s, _stage in enumerate(plan.stages):
        used = prediction.stage_memory_bytes[s]
        layers = " and ".join(f"{a}-{b - 1}" for a, b in held[s])
        total = f" usable ({capacity[s] / GB:.2f} GB)" if kept else ""
        lines.append(
            f"  stage {s} (layers {layers}, "
            f"{prediction.peak_in_flight[s]} in flight): {used / GB:.2f} GB of "
            f"{limits[s] / GB:.2f} GB{total}"
            + ("" if used <= limits[s] else "  EXCEEDS")
        )
    if prediction.memory_terms is not None:
        lines.append(memory_line(prediction.memory_terms))
    return "\n".join(lines)


def warn_if_over_memory(prediction: Any, what: str) -> None:
    """Warn ``the {what} exceeds device memory: peak ... GB on a GPU`` when
    ``prediction`` does not fit (a launch, a job)."""
    if not prediction.fits_memory:
        warnings.warn(
            f"the {what} exceeds device memory: peak "
            f"{prediction.peak_memory_bytes / GB:.2f} GB on a GPU",
            stacklevel=2,
        )


def context_parallel_line(cp: int) -> str:
    """The note under a prediction with ``cp``-way context parallelism."""
    return (
        f"context parallelism {cp}: each GPU of a sequence priced as a replica "
        f"of its own on 1/{cp} of it (the memory lines are per GPU)"
    )


def memory_line(memory: dict) -> str:
    """The peak GPU's memory by term (:func:`~pipedejavu.costmodel.megatron.
    memory_terms.memory_terms`), in GB."""
    terms = ", ".join(
        f"{name.replace('_', ' ')} {value / GB:.2f}"
        for name, value in memory["terms"].items()
    )
    return f"  the peak GPU (stage {memory['stage']}) in GB: {terms}"


def pool_text(pool: dict[str, int], names: dict[str, str]) -> str:
    """The user's GPU pool ``{given name: count}`` as given, each type with
    the name it resolved to where that differs (``names``): ``H100:64
    (H100-SXM)``."""
    return ", ".join(
        f"{gpu}:{count}" + ("" if names.get(gpu, gpu) == gpu else f" ({names[gpu]})")
        for gpu, count in pool.items()
    )


def layers_legend(plan, spec) -> str | None:
    """What the plan's layer numbers are: ``0`` the embedding, ``1..L`` the
    model's ``L`` transformer blocks, then the final norm and LM head (one
    layer, or two in a profile that times them apart); ``None`` without the
    model, or for a plan of another model's layer count."""
    if spec is None:
        return None
    try:
        blocks = num_blocks(plan, spec)
    except ProblemError:
        return None
    last = (
        f"{blocks + 1} the final norm and LM head"
        if head_layers(plan, spec) == 1
        else f"{blocks + 1} the final norm, {blocks + 2} the LM head"
    )
    return (
        f"  layers: 0 the embedding, 1-{blocks} the {blocks} transformer blocks, "
        + last
    )


def format_training_plan(result, pool: str | None = None, spec=None) -> str:
    """The text report of ``pipedejavu plan`` (``pool``: the GPUs as the user
    gave them, :func:`pool_text`; default the plan's pool; ``spec``: the
    model, whose layers :func:`layers_legend` names)."""
    plan, prediction = result.plan, result.prediction
    used, available = result.gpus_used, result.gpus_available
    mixed = len({s.replicas[0].gpu_type for s in plan.stages}) > 1

    def where(stage) -> str:
        first = stage.replicas[0]
        return f"{first.gpu_type}, tp {first.tp}" if mixed else f"tp {first.tp}"

    shown = pool or ", ".join(f"{gpu}:{n}" for gpu, n in available.items())
    lines = [
        f"model {plan.model}, global batch {plan.gbs}, GPUs {shown}",
        f"plan: {plan.describe()}",
        "  stages: "
        + ", ".join(f"layers {s.start}-{s.stop - 1} ({where(s)})" for s in plan.stages),
    ]
    legend = layers_legend(plan, spec)
    if legend is not None:
        lines.append(legend)
    if sum(used.values()) < sum(available.values()):
        fewer = ", ".join(f"{gpu}:{n}" for gpu, n in used.items())
        lines.append(f"  uses fewer GPUs than available: {fewer}")
    chunks = result.options.virtual_stages
    if result.method == "enumeration":
        objective = [
            f"sharded single-stage space: every one of its {result.configurations} "
            "plans priced by the predictor (no planning objective)",
        ]
    elif chunks == 1 and not mixed and result.optimum_s != result.optimum_s:
        objective = [
            "planning objective: n/a (the closed form prices Megatron's default "
            "rank order); plans in the tp-pp-dp order searched by the branch "
            "and bound on the predictor",
        ]
    elif chunks > 1:
        objective = [
            f"  {schedule_name(result.options)}: {chunks} model chunks per stage "
            + (
                "placed in a V (rank r holds chunks r and 2P-1-r of equal "
                "blocks; rank 0 the embedding and the head)"
                if result.options.v_shape
                else "(the stages' layers count each rank's chunks together)"
            ),
            "planning objective: n/a (the closed form is the non-interleaved "
            "pipeline's); interleaved plans searched by the branch and bound on "
            "the predictor",
        ]
    else:
        objective = [
            f"planning objective (the closed-form pipeline time the search "
            f"minimizes) of this plan: {seconds_or_na(result.objective_s)}",
            f"  least planning objective over the search space: "
            f"{result.optimum_s:.4f} s, lower bound {result.lower_bound_s:.4f} s, "
            f"gap {100 * result.gap:.2f}% ({result.method}; {result.solved} of "
            f"{result.configurations} configurations solved)",
            *objective_note(result),
        ]
    lines += [
        f"predicted iteration time: {prediction.iteration_time_s:.4f} s",
        *objective,
        proof_line(result),
        f"search time: {result.search_time_s:.3f} s",
        format_prediction(plan, prediction, result.options).split("\n", 1)[1],
    ]
    return "\n".join(lines)


def objective_note(result) -> list[str]:
    """Why the plan's objective may exceed the least one (empty when equal)."""
    value = result.objective_s
    if value == value and value <= result.optimum_s * (1 + 1e-9):
        return []
    return [
        "  (the plan is chosen by predicted iteration time, not by the objective: "
        "among the optima within 2% of the least objective, and by the proof "
        "under the predictor over the whole search space, so its objective may "
        "exceed the least)"
    ]


def seconds_or_na(value: float) -> str:
    return f"{value:.4f} s" if value == value else "n/a (GPU types mixed)"


def proof_line(result) -> str:
    """What is proven about the predicted time."""
    bound = result.predicted_lower_bound_s
    if result.proven:
        line = "proven optimal under the predictor over the search space"
        if len(result.gpus_available) > 1 and not result.mixed_types:
            line += (
                " (one GPU type per plan; --mixed-types also searches plans "
                "whose stages run on different types)"
            )
        return line
    if bound == bound:  # certified, not proven
        return (
            f"predicted time certified within {100 * result.predicted_gap:.2f}% "
            f"of the best plan (lower bound {bound:.4f} s)"
        )
    return "predicted time not certified"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def format_knobs(knobs) -> str:
    """How each choice of knobs of a :class:`~pipedejavu.planning.knobs.KnobPlan`
    was settled, a line each."""
    options = knobs.result.options
    # (a plan mixing GPU types, or one whose nodes follow neither order)
    order = knobs.rank_order or "n/a (not a Megatron-LM placement)"
    lines = [
        f"knobs: {schedule_name(options)}, recompute {recompute_name(options)}, "
        f"sequence parallel {_on(options.sequence_parallel)}, distributed optimizer "
        f"{_on(options.distributed_optimizer)}"
        + (f" (ZeRO-{options.zero_stage})" if options.zero_stage > 1 else "")
        + f", rank order {order} "
        f"(searched: "
        + (
            f"{knobs.space.describe()})"
            if knobs.outcomes or knobs.result.method != "enumeration"
            else "the sharded single-stage space alone)"
        )
    ]
    dominated = [o for o in knobs.outcomes if o.how == "dominated"]
    for outcome in knobs.outcomes:
        if outcome.how == "dominated":
            continue
        o = outcome.options
        schedule = "interleaved" if outcome.how == "interleaved" else "1F1B"
        if o.zero_bubble:
            zb = {"1F1B": "ZB-H1", "interleaved": "interleaved ZB"}[schedule]
            schedule = "ZB-V" if o.v_shape else zb
        if outcome.rank_order != "tp-dp-pp":
            schedule += f" ({outcome.rank_order})"
        name = (
            f"  {schedule}, recompute {recompute_name(o)}, SP "
            f"{_on(o.sequence_parallel)}, dist-opt {_on(o.distributed_optimizer)}: "
        )
        if outcome.how == "interleaved":
            text = (
                f"best {outcome.best_s:.4f} s ({o.virtual_stages} chunks)"
                if outcome.best_s == outcome.best_s
                else f"no plan below {outcome.cutoff_s:.4f} s"
            )
        elif outcome.how == "searched":
            text = f"searched, best {outcome.best_s:.4f} s"
        elif outcome.how == "infeasible":
            text = "no plan fits"
        elif outcome.best_s == outcome.best_s:  # a plan below the cutoff
            text = f"proof found {outcome.best_s:.4f} s (< {outcome.cutoff_s:.4f} s)"
        else:
            text = f"proof: no plan below {outcome.cutoff_s:.4f} s"
        if not outcome.proven:
            text += " (not proven: budget spent)"
        lines.append(name + text + f" [{outcome.time_s:.1f} s]")
    if dominated:
        lines.append(
            f"  {len(dominated)} choices without the distributed optimizer: never "
            "faster than with it (it only lowers memory, the optimizer step and the "
            "data-parallel traffic)"
        )
    return "\n".join(lines)


def _launched(targets: dict[str, str | None]) -> list[str]:
    return [target for target, why in targets.items() if why is None]


def format_launchers(
    targets: dict[str, str | None], result, other: tuple[str, object] | None
) -> str:
    """Which export targets launch the plan as planned
    (:func:`~pipedejavu.io.exports.launchers`); where none does, why not, a
    line each, and ``other``: the best plan a target launches ``(target,
    result)``, with its time against this one's, or ``(target, why none)``."""
    able = _launched(targets)
    if able:
        return (
            f"launched as planned by: {', '.join(able)} (--export TARGET writes "
            "its launch)"
        )
    lines = ["launched as planned by: no export target"]
    lines += [f"  {target}: {why}" for target, why in targets.items()]
    if other is None:
        return "\n".join(lines)
    target, found = other
    if isinstance(found, str):
        lines.append(f"no plan {target} launches found ({found})")
        return "\n".join(lines)
    best = result.prediction.iteration_time_s
    time = found.prediction.iteration_time_s
    lines.append(
        f"best plan {target} launches: {found.plan.describe()}, "
        f"{schedule_name(found.options)}, recompute {recompute_name(found.options)}: "
        f"{time:.4f} s per iteration, {100 * (time / best - 1):.1f}% more than "
        f"the plan above (rerun with --export {target} for it and its launch)"
    )
    return "\n".join(lines)


def launchers_json(
    targets: dict[str, str | None], result, other: tuple[str, object] | None
) -> dict:
    """:func:`format_launchers` as JSON: ``launched_by`` (targets),
    ``refused`` (``{target: why}``) and, where none launches the plan and
    ``other`` was searched, ``best_launchable`` (``target``, ``plan``,
    ``options``, ``iteration_time_s``, ``slower_by`` as a fraction; or
    ``target`` and ``none_because``)."""
    out: dict = {
        "launched_by": _launched(targets),
        "refused": {t: why for t, why in targets.items() if why is not None},
    }
    if out["launched_by"]:
        return out
    if other is None:
        return out
    target, found = other
    if isinstance(found, str):
        out["best_launchable"] = {"target": target, "none_because": found}
        return out
    best = result.prediction.iteration_time_s
    time = found.prediction.iteration_time_s
    out["best_launchable"] = {
        "target": target,
        "plan": found.plan.describe(),
        "options": found.options.to_json(),
        "iteration_time_s": time,
        "slower_by": time / best - 1,
    }
    return out


def utilization_line(launch: Any) -> str:
    """The model and hardware FLOPs of a predicted launch, their TFLOP/s per
    GPU, MFU and HFU, each named (they differ when blocks are recomputed)."""
    line = (
        f"model FLOPs per iteration {launch.model_flops_per_iteration:.4g}: "
        f"{launch.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {100 * launch.mfu:.1f}%"
    )
    if launch.hardware_flops != launch.model_flops_per_iteration:
        line += (
            f"; with the recomputed forwards {launch.hardware_flops:.4g}: "
            f"{launch.hardware_tflops_per_gpu:.1f} TFLOP/s per GPU, "
            f"HFU {100 * launch.hfu:.1f}%"
        )
    return line


def format_comparison(comparison: RunComparison, best_report: str) -> str:
    """The text report of ``plan --megatron-args``."""
    given, best = comparison.given, comparison.best
    lines = [
        "--- your launch ---",
        format_prediction(given.plan, given.prediction, given.options),
        f"{utilization_line(given)}; costs: {given.cost_source}",
        "",
        "--- the best plan found ---",
        best_report,
        format_knobs(comparison.knobs),
        f"searched: {SEARCH_SPACE_NOTE}",
        "",
        f"your launch: {given.prediction.iteration_time_s:.4f} s per iteration; "
        f"best plan: {best.iteration_time_s:.4f} s; speed-up "
        f"x{comparison.speedup:.3f}",
    ]
    return "\n".join(lines)
