"""Any model on any GPU: which cost source prices a model on a set of GPU types.

:func:`choose_cost_source` turns what a user types (a model name or config
file, GPU type names, precision, recomputation, sequence length) into the data
object the planner and the predictor read:

* A model of the profiles (the bundled Sailor models OPT-350, GPT-Neo-2.7,
  LLAMA-3-8 and OPT-30, or those of a ``--profiles`` folder) trained as the
  profiles measured it (fp32, no recomputation, the profiled sequence length)
  on GPU types that all have its profile: the profiles
  (:class:`~pipedejavu.costmodel.megatron.sailor_data.SailorData`), exactly as
  before.
* The same model on a GPU type without its profile: an
  :class:`~pipedejavu.costmodel.analytical.source.AnalyticalSource` that uses
  the profiles where they cover an entry (and their measured links) and the
  analytical model elsewhere (``cost_source`` ``mixed`` when a plan uses
  both). Trained otherwise (another precision, recomputation or length): the
  analytical model everywhere, the profiles having measured something else.
* Any other model (a bundled preset such as ``Llama-3-70B`` or a Hugging Face
  ``config.json``): the analytical model on the GPU sheet, bf16 by default.

:func:`plan_any_model` plans with it (:func:`~pipedejavu.planning.training.
plan_training`); :mod:`pipedejavu.planning.knobs` searches the training knobs
with the plan; :mod:`pipedejavu.planning.launch_compare` prices a user's
Megatron-LM launch beside the best plan.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import (
    RecomputeGranularity,
    TrainingOptions,
    TrainingPrecision,
)
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.calibrate import QK_LAYER_SCALING
from pipedejavu.costmodel.analytical.calibration_file import ClusterCalibration
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.analytical.source import (
    DEFAULT_MBS_VALUES,
    AnalyticalSource,
)
from pipedejavu.costmodel.megatron.predictor import Prediction, predict_plan
from pipedejavu.costmodel.megatron.sailor_data import (
    NetworkTables,
    SailorData,
    load_sailor_data,
)
from pipedejavu.io.gpu_sheet import GpuSheet, load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.planning.training import (
    TrainingPlan,
    headroom_of,
    parse_gpu_pool,
    plan_training,
)

__all__ = [
    "CostChoice",
    "LONG_CONTEXT",
    "check_plan_layers",
    "choose_cost_source",
    "plan_any_model",
    "predict_any_plan",
    "sheet_name",
]

#: The precision of a model without profiles when none is given: what large
#: models train in.
DEFAULT_ANALYTICAL_PRECISION: TrainingPrecision = "bf16"
#: The longest context a model file is planned at without a sequence length
#: given: a config's ``max_position_embeddings`` past it (131,072 tokens for
#: Llama 3.1 and Qwen2.5) is a long-context limit, not a pretraining length.
LONG_CONTEXT = 8192


@dataclasses.dataclass(frozen=True)
class CostChoice:
    """The cost source for a model on some GPU types (:func:`choose_cost_source`).

    Attributes:
        data: a :class:`SailorData` or an :class:`AnalyticalSource`.
        model: the model's name in ``data`` (what plans name).
        gpu_types: ``{given name: name in data}`` (aliases resolved).
        options: the training options priced.
        spec: the model (``None`` for a profiled model priced from its
            profiles alone).
        notes: what was decided and why, one sentence each (for the report).
    """

    data: Any
    model: str
    gpu_types: dict[str, str]
    options: TrainingOptions
    spec: TransformerSpec | None
    notes: tuple[str, ...] = ()

    @property
    def analytical(self) -> bool:
        return isinstance(self.data, AnalyticalSource)

    @property
    def measured(self) -> bool:
        """Some layers are priced by profiles (alone, or beside the
        analytical model where they do not cover a GPU type)."""
        return not self.analytical or self.data.profiles is not None

    def pool(self, gpus: Mapping[str, int]) -> dict[str, int]:
        """``gpus`` with its type names as ``data`` knows them."""
        out: dict[str, int] = {}
        given: dict[str, str] = {}
        for name, count in gpus.items():
            canonical = self.gpu_types[name]
            if canonical in out:
                raise ProblemError(
                    f"--gpus names {canonical} twice ({given[canonical]} and "
                    f"{name}); give each type once with its total count"
                )
            out[canonical], given[canonical] = count, name
        return out


def sheet_name(sheet: GpuSheet, name: str) -> str:
    """The sheet's name of GPU type ``name`` (itself, an alias's or a
    different case's).

    Raises:
        ProblemError: not on the sheet; naming its types and aliases.
    """
    try:
        return sheet.resolve(name)
    except KeyError:
        raise ProblemError(
            f"GPU type {name!r} is not on the GPU sheet (known: "
            f"{', '.join(sorted(sheet))}; aliases: {', '.join(sheet.aliases)}); "
            "add it with --gpu-sheet FILE"
        ) from None


def _profiled_name(profiles: SailorData, model: str) -> str | None:
    """``model``'s folder in ``profiles`` (case-insensitive), or ``None``."""
    if os.path.sep in model or model.endswith(".json"):
        return None
    names = profiles.models()
    if model in names:
        return model
    by_lower = {name.lower(): name for name in names}
    return by_lower.get(model.lower())


def _profiled_spec(model: str, seq_length: int | None) -> TransformerSpec:
    """The description of a model of the profiles (a bundled preset)."""
    try:
        return load_model_spec(model, seq_length=seq_length)
    except ProblemError as error:
        if "unknown model" not in str(error):
            raise
        raise ProblemError(
            f"{model} has profiles but no bundled description: to price it on "
            "other GPU types or for other training options, give its config "
            "with --model CONFIG.json"
        ) from None


def choose_cost_source(
    model: str,
    gpu_types: Iterable[str],
    *,
    options: TrainingOptions | None = None,
    precision: TrainingPrecision | None = None,
    recompute: RecomputeGranularity | None = None,
    seq_length: int | None = None,
    gpu_sheet: str | os.PathLike | None = None,
    profiles: str | os.PathLike | None = None,
    mbs_values: Sequence[int] = DEFAULT_MBS_VALUES,
    memory_headroom: MemoryHeadroom | float | str | None = None,
    experts: ExpertLayers | None = None,
    context_parallel: int = 1,
    calibration: ClusterCalibration | None = None,
) -> CostChoice:
    """The cost source that prices ``model`` on ``gpu_types`` (module doc).

    Args:
        model: a model of the profiles, a bundled preset name, or a model file
            (a Hugging Face ``config.json`` or this package's format).
        gpu_types: GPU type names (profile folder names, GPU sheet names or
            their aliases).
        options: the training options (``None``: fp32 for a model of the
            profiles, bf16 for any other; no recomputation).
        precision: replaces the precision of ``options``.
        recompute: replaces the recomputation of ``options``.
        seq_length: tokens per sample (``None``: the model's, or the profiled
            length).
        gpu_sheet: a JSON file extending the bundled GPU sheet.
        profiles: a folder laid out like Sailor's data (``None``: bundled).
        mbs_values: micro-batch sizes the analytical source offers.
        memory_headroom: memory every GPU keeps free (a fraction of its
            memory, a string such as ``"8GB"`` or a
            :class:`~pipedejavu.core.memory_headroom.MemoryHeadroom`; ``None``:
            none): the source's GPUs offer plans only the rest, so the
            predictor, the planning tables and the proof honour it alike.
        experts: a mixture of experts' expert layout and kernels (``None``:
            EP 1; :func:`~pipedejavu.planning.plan_model.plan_model` searches
            the EP degrees); ignored for a dense model.
        context_parallel: the plans' context parallelism ``c``: the source
            prices ``1 / c`` of each sequence (analytically only).
        calibration: the analytical model's constants fitted to the cluster
            (:func:`~pipedejavu.costmodel.analytical.cluster_fit.fit_cluster`;
            ``None``: the project's), for every GPU type priced analytically.

    Raises:
        ProblemError: an unknown model or GPU type, a bad model file or option,
            ``profiles`` given without a profile of ``model``, a bad headroom.
    """
    headroom = headroom_of(memory_headroom)
    choice = _choose(
        model, list(gpu_types), options, precision, recompute, seq_length,
        gpu_sheet, profiles, mbs_values, experts, context_parallel, calibration,
    )  # fmt: skip
    if headroom is None:
        return choice
    return dataclasses.replace(choice, data=choice.data.with_memory_headroom(headroom))


def _choose(
    model: str,
    gpu_types: list[str],
    options: TrainingOptions | None,
    precision: TrainingPrecision | None,
    recompute: RecomputeGranularity | None,
    seq_length: int | None,
    gpu_sheet: str | os.PathLike | None,
    profiles: str | os.PathLike | None,
    mbs_values: Sequence[int],
    experts: ExpertLayers | None = None,
    context_parallel: int = 1,
    calibration: ClusterCalibration | None = None,
) -> CostChoice:
    data = load_sailor_data(profiles)
    profiled = _profiled_name(data, model)
    if profiled is None and profiles is not None:
        have = ", ".join(data.models()) or "none"
        raise ProblemError(
            f"--profiles {os.fspath(profiles)} holds no profiles of {model} (it "
            f"has: {have}); without --profiles a model without profiles is "
            "priced analytically"
        )
    cp = context_parallel
    if profiled is not None and cp > 1:
        raise ProblemError(
            f"context parallelism {cp} is priced analytically, not from the "
            f"profiles of {profiled}"
        )
    if profiled is not None:
        options = _options(options, precision, recompute, "fp32")
        return _choose_profiled(
            data, profiled, gpu_types, options, seq_length, gpu_sheet, mbs_values,
            calibration,
        )  # fmt: skip
    spec = load_model_spec(model, seq_length=seq_length, longest_context=LONG_CONTEXT)
    options = _options(options, precision, recompute, DEFAULT_ANALYTICAL_PRECISION)
    sheet = load_gpu_sheet(gpu_sheet)
    names = {g: sheet_name(sheet, g) for g in gpu_types}
    if cp > 1 and spec.seq_length % (2 * cp):
        raise ProblemError(
            f"a sequence of {spec.seq_length} tokens does not split over 2 x "
            f"context parallelism {cp} (load-balanced halves)"
        )
    share = dataclasses.replace(spec, seq_length=spec.seq_length // cp)
    source = AnalyticalSource(
        share, sheet, options, mbs_values=mbs_values, experts=experts,
        context_parallel=cp, calibrated=_calibrated(calibration, names),
        measured_links=_links(calibration),
    )  # fmt: skip
    return CostChoice(source, spec.name, names, options, spec, _said(calibration))


def _calibrated(
    calibration: ClusterCalibration | None, names: Mapping[str, str]
) -> dict[str, dict[str, float]] | None:
    """A calibration's constants for the pool's types (``None``: none)."""
    if calibration is None:
        return None
    return calibration.fields_for(names.values())


def _links(calibration: ClusterCalibration | None) -> NetworkTables | None:
    """A calibration's measured links (``None``: the sheet's)."""
    return None if calibration is None else calibration.links


def _said(calibration: ClusterCalibration | None) -> tuple[str, ...]:
    if calibration is None:
        return ()
    said = "the analytical model's constants calibrated to the cluster"
    if calibration.links is not None:
        said += ", its measured links where they hold a fit"
    return (said,)


def _options(
    base: TrainingOptions | None,
    precision: TrainingPrecision | None,
    recompute: RecomputeGranularity | None,
    default_precision: TrainingPrecision,
) -> TrainingOptions:
    fields: dict[str, Any] = {}
    if precision is not None:
        fields["precision"] = precision
    if recompute is not None:
        fields["recompute"] = recompute
    try:
        if base is None:
            base = TrainingOptions(default_precision)
        return dataclasses.replace(base, **fields)
    except ValueError as error:
        raise ProblemError(f"training options: {error}") from None


def _choose_profiled(
    data: SailorData,
    model: str,
    gpu_types: list[str],
    options: TrainingOptions,
    seq_length: int | None,
    gpu_sheet: str | os.PathLike | None,
    mbs_values: Sequence[int],
    calibration: ClusterCalibration | None = None,
) -> CostChoice:
    """A model of the profiles: the profiles alone when they cover every GPU
    type and measured this training, else an analytical source (module doc;
    ``calibration`` for the layers it prices)."""
    have = set(data.gpu_types(model))
    # Sailor's implementation of the model: unfused attention (and Megatron's
    # query-key layer scaling where its code applies it, below).
    options = dataclasses.replace(options, flash_attention=False)
    plain = options == data.options
    # sequence parallelism changes nothing at TP 1, where the profiles still
    # price (torchtitan runs it with every TP > 1 plan)
    but_sp = dataclasses.replace(options, sequence_parallel=False) == data.options
    spec = None
    if seq_length is not None:
        spec = _profiled_spec(model, seq_length)
        same_length = seq_length == _profiled_spec(model, None).seq_length
        plain, but_sp = plain and same_length, but_sp and same_length
    # (the profiles themselves price it: a calibration is not needed)
    profiled = () if calibration is None else (f"priced by the {model} profiles",)
    if plain and all(gpu in have for gpu in gpu_types):
        names = {g: g for g in gpu_types}
        return CostChoice(data, model, names, options, None, profiled)
    sheet = load_gpu_sheet(gpu_sheet)
    names = {g: g if g in have else sheet_name(sheet, g) for g in gpu_types}
    if plain and all(name in have for name in names.values()):
        return CostChoice(data, model, names, options, None, profiled)
    spec = spec or _profiled_spec(model, None)
    if but_sp and not plain:
        note = (
            f"the {model} profiles measured no sequence parallelism: priced by the "
            "analytical model at TP > 1, by the profiles at TP 1 (where it "
            "changes nothing)"
        )
    elif plain:
        missing = ", ".join(sorted({n for n in names.values() if n not in have}))
        note = (
            f"no {model} profile on {missing}: priced there by the analytical "
            "model (by the profiles on the profiled GPU types)"
        )
    else:
        note = (
            f"the {model} profiles measured fp32 training without recomputation "
            "under 1F1B (the backward whole) at "
            f"{_profiled_spec(model, None).seq_length} tokens per sample: "
            "priced by the analytical model instead"
        )
    source = AnalyticalSource(
        spec,
        sheet,
        options,
        profiles=data if but_sp else None,
        profile_model=model,
        measured_links=data.network if but_sp else _links(calibration),
        mbs_values=mbs_values,
        query_key_layer_scaling=model in QK_LAYER_SCALING,
        calibrated=_calibrated(calibration, names),
    )
    notes = (note, *_said(calibration))
    return CostChoice(source, spec.name, names, options, spec, notes)


def check_plan_layers(plan: Plan3D, choice: CostChoice) -> None:
    """A plan's layers must be the model's (embedding, blocks, head).

    Raises:
        ProblemError: the plan covers another number of layers.
    """
    expected = choice.data.model_info(choice.model).num_layers
    stop = plan.stages[-1].stop
    if stop != expected:
        raise ProblemError(
            f"the plan covers {stop} layers, but {choice.model} has {expected} "
            "(embedding, transformer blocks, final norm and LM head as the "
            "planner counts them): a plan for another model?"
        )


def plan_any_model(
    model: str,
    gpus: Mapping[str, int],
    global_batch: int,
    *,
    options: TrainingOptions | None = None,
    precision: TrainingPrecision | None = None,
    recompute: RecomputeGranularity | None = None,
    seq_length: int | None = None,
    gpu_sheet: str | os.PathLike | None = None,
    profiles: str | os.PathLike | None = None,
    memory_headroom: MemoryHeadroom | float | str | None = None,
    **plan_options: Any,
) -> tuple[TrainingPlan, CostChoice]:
    """:func:`~pipedejavu.planning.training.plan_training` for any model on any
    GPU of the sheet (:func:`choose_cost_source` picks the costs).

    Returns:
        ``(TrainingPlan, CostChoice)``.

    Raises:
        ProblemError: ``options`` with model chunks (``virtual_stages > 1``):
            those plans are searched by
            :func:`~pipedejavu.planning.knobs.plan_with_knobs`.
    """
    if options is not None and options.virtual_stages > 1:
        raise ProblemError(
            "plan_any_model searches stage plans of one chunk per rank (1F1B, "
            f"ZB-H1); options with {options.virtual_stages} chunks per rank are "
            "searched by pipedejavu.planning.knobs.plan_with_knobs(..., "
            "space=KnobSpace.fixed(options))"
        )
    pool = parse_gpu_pool(gpus)
    choice = choose_cost_source(
        model,
        pool,
        options=options,
        precision=precision,
        recompute=recompute,
        seq_length=seq_length,
        gpu_sheet=gpu_sheet,
        profiles=profiles,
        memory_headroom=memory_headroom,
    )
    result = plan_training(
        choice.model,
        choice.pool(pool),
        global_batch,
        profiles=choice.data,
        **plan_options,
    )
    return result, choice


def predict_any_plan(plan: Plan3D, choice: CostChoice) -> tuple[Plan3D, Prediction]:
    """Price ``plan`` for ``choice``'s model: its GPU types renamed as the
    source knows them, its model set, its layers checked.

    Returns:
        ``(plan as priced, prediction)``.

    Raises:
        ProblemError: the plan does not fit the model or the GPUs.
    """
    stages = []
    for stage in plan.stages:
        replicas = tuple(
            dataclasses.replace(r, gpu_type=choice.gpu_types[r.gpu_type])
            for r in stage.replicas
        )
        stages.append(dataclasses.replace(stage, replicas=replicas))
    plan = dataclasses.replace(plan, stages=tuple(stages), model=choice.model)
    if choice.analytical:
        check_plan_layers(plan, choice)
    if choice.spec is not None:
        for tp in sorted({r.tp for stage in plan.stages for r in stage.replicas}):
            try:
                choice.spec.check_tp(tp)
            except ValueError as error:
                raise ProblemError(f"the plan's TP {tp}: {error}") from None
    return plan, predict_plan(plan, choice.data)
