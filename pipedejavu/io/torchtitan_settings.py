"""The settings of a torchtitan job file beyond its degrees: precision,
compile and float8 of each schema, the pipeline, activation checkpointing,
and the checks torchtitan makes across them.

Each function reads from a :class:`~pipedejavu.io.torchtitan_keys.JobTable`
and returns fields of :class:`~pipedejavu.io.torchtitan_job.TorchtitanJob`;
what torchtitan refuses is refused, one :class:`ProblemError` line naming the
file and key. The rules and their sources in torchtitan's code are listed in
:mod:`pipedejavu.io.torchtitan_job`.
"""

from __future__ import annotations

import math
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.io.torchtitan_keys import JobTable
from pipedejavu.io.torchtitan_models import TorchtitanModel

__all__ = [
    "CONVERTERS",
    "LOOPED_SCHEDULES",
    "SINGLE_SCHEDULES",
    "check_parallelism",
    "checkpointing_settings",
    "pipeline_settings",
    "settings_2024_12",
    "settings_v02",
]

#: PyTorch's single-stage schedules (``PipelineScheduleSingle``: one part
#: per rank) and looped ones (``PipelineScheduleMulti``), by
#: ``get_schedule_class``'s names; ``DualPipeV`` is not in 2024-12's PyTorch.
SINGLE_SCHEDULES = ("1F1B", "GPipe", "PipelineScheduleSingle")
LOOPED_SCHEDULES = (
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
    "PipelineScheduleMulti",
)
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # pipeline_module_split's "v" style
#: torchtitan v0.2's registered model converters.
CONVERTERS = (
    "quantize.linear.float8",
    "quantize.linear.mx",
    "quantize.grouped_mm.float8",
    "quantize.grouped_mm.mx",
)
_NOT_PRICED = {
    "quantize.linear.mx": "MX linears",
    "quantize.grouped_mm.float8": "float8 grouped expert GEMMs",
    "quantize.grouped_mm.mx": "MX grouped expert GEMMs",
}
_PIPELINE_KEYS = (
    "pipeline_parallel_microbatch_size",
    "pipeline_parallel_microbatches",
    "module_fqns_per_model_part",
    "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
    "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_split_points",
)
_DTYPES_2024_12 = ("bfloat16", "float32", "float16")  # TORCH_DTYPE_MAP at 9dec370


def _note_section(table: JobTable, section: str, why: str) -> None:
    for present, key in list(table.values):
        if present == section:
            table.note(section, key, why)


def settings_v02(table: JobTable, extra: list[str]) -> dict[str, Any]:
    """v0.2's own settings: global batch, dtypes, FSDP resharding, experts,
    compile and converters (float8). ``extra`` collects ignored-list lines
    that are not one key's."""
    source = table.source
    module = table.text("job", "custom_config_module", "")
    if module:
        raise ProblemError(
            f"{source}: [job] custom_config_module {module!r} extends the job "
            "config with a Python module, which is not imported here"
        )
    table.note("experimental", "custom_import", "a module torchtitan imports: not read")
    total = table.raw("training", "global_batch_size", -1)
    if isinstance(total, int) and not isinstance(total, bool) and total < 0:
        total = None  # train.py: local x dp
    elif total is not None:
        total = table.integer("training", "global_batch_size", None)
    ep = table.integer("parallelism", "expert_parallel_degree", 1, limit=2**20)
    etp = table.integer("parallelism", "expert_tensor_parallel_degree", 1, limit=2**20)
    enable = table.flag("compile", "enable")
    components = table.names("compile", "components")
    components = ("model", "loss") if components is None else components
    converters = table.names("model", "converters") or ()
    table.note(
        "debug",
        "moe_force_load_balance",
        "forces balanced routing: every expert gets as many tokens",
    )
    for name in converters:
        if name not in CONVERTERS:
            old = " (v0.1's 'float8' is v0.2's 'quantize.linear.float8')"
            raise ProblemError(
                f"{source}: [model] converters names {name!r}, not a converter of "
                f"torchtitan v0.2 ({', '.join(CONVERTERS)})"
                + (old if name == "float8" else "")
            )
        if name in _NOT_PRICED:
            extra.append(
                f"[model] converters: {name} ({_NOT_PRICED[name]}: not priced)"
            )
    float8 = "quantize.linear.float8" in converters
    section = "quantize.linear.float8"
    recipe, gather = None, False
    if float8:
        recipe = table.choice(
            section,
            "recipe_name",
            None,
            (None, "tensorwise", "rowwise", "rowwise_with_gw_hp"),
        )
        gather = table.flag(section, "enable_fsdp_float8_all_gather")
        if recipe is not None and gather:
            raise ProblemError(
                f"{source}: [{section}] enable_fsdp_float8_all_gather with "
                "recipe_name is refused by torchtitan's float8 converter"
            )
        recipe = recipe or "tensorwise"
    else:
        _note_section(table, section, "no effect without its converter")
    return {
        "global_batch_size": total,
        "dtype": table.choice("training", "dtype", "float32", ("bfloat16", "float32")),
        "mixed_precision_param": table.choice(
            "training", "mixed_precision_param", "bfloat16", ("bfloat16", "float32")
        ),
        "mixed_precision_reduce": table.choice(
            "training", "mixed_precision_reduce", "float32", ("float32",)
        ),
        "fsdp_reshard_after_forward": table.choice(
            "parallelism",
            "fsdp_reshard_after_forward",
            "default",
            ("default", "always", "never"),
        ),
        "ep": ep,
        "etp": etp,
        "compile": enable and "model" in components,
        "compile_loss": enable and "loss" in components,
        "converters": converters,
        "float8": float8,
        "float8_recipe": recipe,
        "float8_fsdp_all_gather": gather,
    }


def settings_2024_12(table: JobTable, extra: list[str]) -> dict[str, Any]:
    """2024-12's own settings: dtypes, compile, norm type, float8."""
    source = table.source
    compiled = table.flag("training", "compile")
    norm = table.choice(
        "model",
        "norm_type",
        "rmsnorm",
        ("rmsnorm", "fused_rmsnorm", "layernorm", "np_layernorm"),
    )
    if norm == "fused_rmsnorm" and compiled:
        raise ProblemError(
            f"{source}: [model] norm_type 'fused_rmsnorm' does not compile "
            "(torchtitan raises with [training] compile)"
        )
    if norm in ("layernorm", "np_layernorm"):
        extra.append(
            f"[model] norm_type {norm!r} (LayerNorm without bias, counted as "
            "RMSNorm's one weight)"
        )
    float8 = table.flag("float8", "enable_float8_linear")
    recipe, gather = None, False
    if float8:
        scalings = [
            table.choice("float8", key, "dynamic", ("dynamic", "delayed"))
            for key in (
                "scaling_type_input",
                "scaling_type_weight",
                "scaling_type_grad_output",
            )
        ]
        recipe = "delayed" if "delayed" in scalings else "tensorwise"
        gather = table.flag("float8", "enable_fsdp_float8_all_gather")
    else:
        _note_section(table, "float8", "no effect without enable_float8_linear")
    return {
        "global_batch_size": None,
        "mixed_precision_param": table.choice(
            "training", "mixed_precision_param", "bfloat16", _DTYPES_2024_12
        ),
        "mixed_precision_reduce": table.choice(
            "training", "mixed_precision_reduce", "float32", _DTYPES_2024_12
        ),
        "compile": compiled,
        "float8": float8,
        "float8_recipe": recipe,
        "float8_fsdp_all_gather": gather,
    }


def check_parallelism(
    table: JobTable,
    model: TorchtitanModel,
    fields: dict[str, Any],
    extra: list[str],
) -> None:
    """What torchtitan refuses of the degrees with this model, known before
    the world size: ETP with EP, experts that do not split over EP, heads
    that do not split over TP, the sequence over TP and CP, async TP
    without compile, CP with a FlexAttention/varlen flavor, PP for a model
    without a pipelining function."""
    source, spec = table.source, model.spec
    tp, cp, ep, etp = (
        fields["tp"],
        fields["cp"],
        fields.get("ep", 1),
        fields.get("etp", 1),
    )
    if ep > 1 and etp not in (1, tp):
        raise ProblemError(
            f"{source}: [parallelism] expert_tensor_parallel_degree {etp} must be "
            f"1 or tensor_parallel_degree {tp} with experts (torchtitan's "
            "ParallelDims)"
        )
    if ep > 1 and spec.moe is None:
        extra.append(
            f"[parallelism] expert_parallel_degree {ep} (no effect: {spec.name} "
            "has no experts)"
        )
    elif ep > 1 and spec.moe.num_experts % ep:
        raise ProblemError(
            f"{source}: [parallelism] expert_parallel_degree {ep} does not divide "
            f"the {spec.moe.num_experts} experts of {spec.name}"
        )
    groups = spec.num_attention_heads if spec.mla else spec.num_query_groups
    if spec.num_attention_heads % tp or groups % tp:
        raise ProblemError(
            f"{source}: tensor_parallel_degree {tp} does not divide {spec.name}'s "
            f"{spec.num_attention_heads} query heads and {groups} key/value heads "
            "(torchtitan's TP splits whole heads)"
        )
    if table.schema == "v0.2":
        divisor = tp * 2 * cp  # ParallelDims.seq_len_divisor, asserted always
    else:
        divisor = tp * (2 * cp if cp > 1 else 1)
    if fields["seq_len"] % divisor:
        raise ProblemError(
            f"{source}: [training] seq_len {fields['seq_len']} is not a multiple of "
            f"tensor_parallel_degree {tp} x 2 x context_parallel_degree {cp}"
            + (" (torchtitan asserts it)" if table.schema == "v0.2" else "")
        )
    if fields["async_tp"] and tp > 1 and not fields["compile"]:
        raise ProblemError(
            f"{source}: async tensor parallelism needs the model compiled "
            "(torchtitan raises)"
        )
    if fields["async_tp"] and tp == 1:
        extra.append("async tensor parallelism (no effect at TP 1)")
    flex_refused = model.attention == "varlen" or (
        model.attention != "sdpa" and spec.moe is not None
    )
    if cp > 1 and flex_refused:
        raise ProblemError(
            f"{source}: context parallelism runs SDPA attention, not "
            f"{spec.name}'s {model.attention} attention (torchtitan raises)"
        )
    if fields["pp"] > 1 and not model.pipelining:
        raise ProblemError(
            f"{source}: {spec.name} has no pipelining function in torchtitan "
            "(it raises with pipeline_parallel_degree > 1)"
        )


def _schedule(table: JobTable, where: tuple[str, str], pp: int) -> str:
    names = SINGLE_SCHEDULES + LOOPED_SCHEDULES
    if table.schema == "2024-12":
        names = tuple(name for name in names if name != "DualPipeV")
    text = table.text(*where, "1F1B")
    canonical = {name.lower(): name for name in names}
    if pp == 1:  # torchtitan looks the name up only with PP
        table.note(*where, "no effect with pipeline_parallel_degree 1")
        return canonical.get(text.lower(), text)
    if text.lower() in canonical:
        return canonical[text.lower()]
    raise table.fail(*where, f"one of PyTorch's schedules ({', '.join(names)})")


def pipeline_settings(
    table: JobTable,
    model: TorchtitanModel,
    fields: dict[str, Any],
    where: dict[str, tuple[str, str]],
) -> dict[str, Any]:
    """The schedule, micro-batches and parts per rank (1 and 1 without PP)."""
    source, pp, local = table.source, fields["pp"], fields["local_batch_size"]
    schedule = _schedule(table, where["schedule"], pp)
    csv = table.text(*where["csv"], "")
    if csv:
        table.note(*where["csv"], "a schedule from a CSV file: not read")
    out: dict[str, Any] = {"pipeline_schedule": schedule}
    if table.schema == "v0.2":
        size = table.integer("parallelism", "pipeline_parallel_microbatch_size", 1)
        count = local // size
        if pp > 1 and local % size:
            raise ProblemError(
                f"{source}: [training] local_batch_size {local} is not a multiple "
                f"of [parallelism] pipeline_parallel_microbatch_size {size} "
                "(torchtitan raises)"
            )
        parts, per_rank = _v02_parts(table, model, pp, schedule, out)
    else:
        count = table.integer("experimental", "pipeline_parallel_microbatches", pp)
        if pp > 1 and local % count:
            raise ProblemError(
                f"{source}: [experimental] pipeline_parallel_microbatches {count} "
                f"does not divide [training] batch_size {local} (unequal "
                "micro-batches are not priced)"
            )
        points = table.names(
            "experimental", "pipeline_parallel_split_points", comma=True
        )
        out["pipeline_split_points"] = points
        parts = None if points is None else len(points) + 1
        per_rank = 1 if schedule in SINGLE_SCHEDULES else 2
    if pp == 1:
        for key in _PIPELINE_KEYS:
            table.note(where["pp"][0], key, "no effect with pipeline_parallel_degree 1")
        return {**out, "num_microbatches": 1, "stages_per_rank": 1}
    if parts is not None:
        per_rank = _parts_per_rank(source, parts, pp, schedule)
    return {**out, "num_microbatches": count, "stages_per_rank": per_rank}


def _v02_parts(
    table: JobTable, model: TorchtitanModel, pp: int, schedule: str, out: dict
) -> tuple[int | None, int]:
    """v0.2's explicit parts (or ``None``) and the stages per rank
    ``pipeline_llm`` derives (``pipeline_parallel_layers_per_stage``)."""
    section, source = "parallelism", table.source
    raw = table.raw(section, "module_fqns_per_model_part")
    fqns = None
    if raw is not None:
        if not isinstance(raw, list) or len(raw) > 10_000:
            raise table.fail(section, "module_fqns_per_model_part", "a list of lists")
        fqns = []
        for part in raw:
            if not isinstance(part, list) or not all(isinstance(n, str) for n in part):
                raise table.fail(
                    section, "module_fqns_per_model_part", "a list of lists of strings"
                )
            fqns.append(tuple(part))
        fqns = tuple(fqns)
    first = table.integer(
        section, "pipeline_parallel_first_stage_less_layers", 1, low=0
    )
    last = table.integer(section, "pipeline_parallel_last_stage_less_layers", 1, low=0)
    per_stage = table.integer(section, "pipeline_parallel_layers_per_stage", None)
    out.update(
        module_fqns_per_model_part=fqns,
        pipeline_first_stage_less_layers=first,
        pipeline_last_stage_less_layers=last,
        pipeline_layers_per_stage=per_stage,
    )
    single = schedule in SINGLE_SCHEDULES
    per_rank = 1 if single else 2
    layers = model.spec.num_layers
    if pp > 1 and per_stage is not None:
        stages = math.ceil((layers + first + last) / per_stage)
        per_rank = stages // pp
        if stages % pp or (single and per_rank != 1) or (not single and per_rank < 2):
            need = "1" if single else "at least 2"
            raise ProblemError(
                f"{source}: [parallelism] pipeline_parallel_layers_per_stage "
                f"{per_stage} makes {stages} stages of {layers} layers (and "
                f"{first} + {last} for the embedding and head), not {need} per "
                f"rank on {pp} ranks with {schedule} (torchtitan raises)"
            )
    stages = pp * per_rank
    if pp > 1 and fqns is None and stages > 1:
        weights = layers + first + last
        if stages > weights or max(first, last) > weights // stages:
            raise ProblemError(
                f"{source}: {stages} pipeline stages do not split {layers} layers "
                f"with stage weights {first} and {last} (torchtitan's "
                "generate_llm_fqn_per_model_part raises)"
            )
    return (None if fqns is None else len(fqns)), per_rank


def _parts_per_rank(source: str, parts: int, pp: int, schedule: str) -> int:
    """Parts per rank of explicit parts (``pipeline_module_split``)."""
    per_rank = parts // pp
    single = schedule in SINGLE_SCHEDULES
    if (
        parts % pp
        or not per_rank
        or (single and per_rank != 1)
        or (schedule in _V_SHAPED and per_rank != 2)
    ):
        need = "1" if single else "2" if schedule in _V_SHAPED else "a whole number"
        raise ProblemError(
            f"{source}: {parts} pipeline parts on {pp} ranks are not {need} per "
            f"rank, as {schedule} runs them"
        )
    return per_rank


def checkpointing_settings(
    table: JobTable, compiled: bool, pipelined_experts: bool
) -> dict[str, Any]:
    """``[activation_checkpoint]``: the mode, the selective option, the
    memory budget (v0.2: ``memory_budget`` needs the model compiled).
    ``pipelined_experts``: DualPipeV's overlap with EP and PP, which refuses
    any checkpointing."""
    section, source = "activation_checkpoint", table.source
    modes = ("selective", "full", "none")
    if table.schema == "v0.2":
        modes += ("memory_budget",)
    mode = table.choice(section, "mode", "selective", modes)
    out: dict[str, Any] = {"activation_checkpoint": mode, "selective_ac_option": None}
    if mode == "selective":
        option = table.text(section, "selective_ac_option", "2")
        if option != "op" and not (option.isascii() and option.isdigit()):
            raise table.fail(
                section, "selective_ac_option", "'op' or a number of blocks like '2'"
            )
        out["selective_ac_option"] = option if option == "op" else int(option)
    else:
        table.note(section, "selective_ac_option", f"no effect with mode {mode!r}")
    if mode == "memory_budget":
        if not compiled:
            raise ProblemError(
                f"{source}: [{section}] mode 'memory_budget' needs the model "
                "compiled (torchtitan asserts it)"
            )
        budget = table.raw(section, "memory_budget", 0.5)
        if not isinstance(budget, int | float) or isinstance(budget, bool):
            raise table.fail(section, "memory_budget", "a number")
        out["memory_budget"] = float(budget)
    if pipelined_experts and mode != "none":
        raise ProblemError(
            f"{source}: DualPipeV with expert parallelism refuses activation "
            "checkpointing (torchtitan raises; set mode 'none' or "
            "pipeline_parallel_expert_parallel_overlap false)"
        )
    return out
