"""The keys of torchtitan's job files, their schemas, and typed reading of
their values, one :class:`ProblemError` line per problem.

:data:`SCHEMA_KEYS` lists, per schema, every section and key torchtitan's
config accepts: ``"v0.2"`` the fields of the ``JobConfig`` dataclasses of
torchtitan v0.2.1 and v0.2.2 (``torchtitan/config/job_config.py``; v0.2.2
added ``lr_scheduler.total_steps`` and ``parallelism.
context_parallel_load_balancer``), ``"2024-12"`` the ``--section.key``
arguments of ``torchtitan/config_manager.py`` at commit 9dec370a. Names only:
the tables are written out here from torchtitan's source, which is never
imported. :func:`flatten` turns a parsed TOML document into ``(section, key)``
pairs, :func:`detect_schema` tells the schemas apart (see
:mod:`pipedejavu.io.torchtitan_job`), and :class:`JobTable` reads values by
type, records which keys were read, and lists the rest as ignored.
"""

from __future__ import annotations

import difflib
from typing import Any

from pipedejavu.core.errors import ProblemError

__all__ = ["SCHEMA_KEYS", "JobTable", "detect_schema", "flatten", "shown"]

_V02 = {
    "job": "config_file dump_folder description print_config save_config_file "
    "custom_config_module",
    "profiling": "enable_profiling save_traces_folder profile_freq profiler_active "
    "profiler_warmup enable_memory_snapshot save_memory_snapshot_folder",
    "metrics": "log_freq enable_tensorboard disable_color_printing save_tb_folder "
    "save_for_all_ranks enable_wandb",
    "model": "name flavor hf_assets_path tokenizer_path converters "
    "print_after_conversion",
    "optimizer": "name lr beta1 beta2 eps weight_decay implementation "
    "early_step_in_backward",
    "lr_scheduler": "warmup_steps total_steps decay_ratio decay_type min_lr_factor",
    "training": "dataset dataset_path local_batch_size global_batch_size seq_len "
    "max_norm steps enable_cpu_offload dtype mixed_precision_param "
    "mixed_precision_reduce gc_freq gc_debug",
    "training.dataloader": "num_workers persistent_workers pin_memory prefetch_factor",
    "parallelism": "data_parallel_replicate_degree data_parallel_shard_degree "
    "fsdp_reshard_after_forward tensor_parallel_degree disable_loss_parallel "
    "enable_async_tensor_parallel pipeline_parallel_degree "
    "module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
    "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
    "pipeline_parallel_schedule pipeline_parallel_schedule_csv "
    "pipeline_parallel_microbatch_size pipeline_parallel_expert_parallel_overlap "
    "context_parallel_degree context_parallel_load_balancer "
    "context_parallel_rotate_method expert_parallel_degree "
    "expert_tensor_parallel_degree expert_parallel_comm_backend",
    "checkpoint": "enable enable_ft_dataloader_checkpoints folder interval "
    "initial_load_path initial_load_model_only initial_load_in_hf "
    "initial_load_in_hf_quantized last_save_model_only last_save_in_hf "
    "export_dtype async_mode keep_latest_k load_step exclude_from_loading "
    "enable_first_step_checkpoint create_seed_checkpoint load_only",
    "activation_checkpoint": "mode selective_ac_option "
    "per_op_sac_force_recompute_mm_shapes_by_fqns early_stop memory_budget "
    "visualize_memory_budget_pareto preserve_rng_state determinism_check debug",
    "compile": "enable components backend",
    "quantize.linear.float8": "enable_fsdp_float8_all_gather "
    "precompute_float8_dynamic_scale_for_fsdp recipe_name filter_fqns emulate",
    "quantize.linear.mx": "mxfp8_dim1_cast_kernel_choice recipe_name filter_fqns",
    "quantize.grouped_mm.float8": "fqns",
    "quantize.grouped_mm.mx": "recipe_name fqns",
    "comm": "init_timeout_seconds train_timeout_seconds trace_buf_size "
    "save_traces_folder save_traces_file_prefix mode",
    "memory_estimation": "enable disable_fake_mode",
    "fault_tolerance": "enable process_group process_group_timeout_ms replica_id "
    "group_size min_replica_size semi_sync_method",
    "experimental": "custom_import custom_args_module",
    "validation": "enable dataset dataset_path local_batch_size seq_len freq steps",
    "validation.dataloader": "num_workers persistent_workers pin_memory "
    "prefetch_factor",
    "debug": "seed deterministic deterministic_warn_only moe_force_load_balance",
}
_V2412 = {
    "job": "config_file dump_folder description use_for_integration_test print_args",
    "profiling": "enable_profiling save_traces_folder profile_freq "
    "enable_memory_snapshot save_memory_snapshot_folder",
    "metrics": "log_freq enable_tensorboard disable_color_printing save_tb_folder "
    "rank_0_only enable_wandb",
    "model": "name flavor norm_type tokenizer_path",
    "optimizer": "name lr fused early_step_in_backward",
    "training": "dataset dataset_path batch_size seq_len warmup_steps max_norm "
    "steps data_parallel_replicate_degree data_parallel_shard_degree "
    "enable_cpu_offload tensor_parallel_degree disable_loss_parallel "
    "mixed_precision_param mixed_precision_reduce compile gc_freq seed "
    "deterministic",
    "experimental": "enable_async_tensor_parallel pipeline_parallel_degree "
    "pipeline_parallel_split_points pipeline_parallel_schedule "
    "pipeline_parallel_schedule_csv pipeline_parallel_microbatches "
    "enable_compiled_autograd context_parallel_degree "
    "context_parallel_rotate_method",
    "checkpoint": "enable_checkpoint folder interval_type interval "
    "model_weights_only export_dtype create_seed_checkpoint async_mode "
    "keep_latest_k load_step",
    "activation_checkpoint": "mode selective_ac_option",
    "float8": "enable_float8_linear enable_fsdp_float8_all_gather "
    "precompute_float8_dynamic_scale_for_fsdp scaling_type_input "
    "scaling_type_weight scaling_type_grad_output",
    "comm": "init_timeout_seconds train_timeout_seconds trace_buf_size",
    "memory_estimation": "enabled disable_fake_mode",
}
#: Every section and its keys, per schema.
SCHEMA_KEYS: dict[str, dict[str, frozenset[str]]] = {
    schema: {section: frozenset(keys.split()) for section, keys in table.items()}
    for schema, table in (("v0.2", _V02), ("2024-12", _V2412))
}
_SCHEMA_NAMES = {"v0.2": "torchtitan v0.2", "2024-12": "torchtitan 9dec370 (2024-12)"}
# The section paths of either schema and their parents ("quantize.linear").
_TABLES = frozenset(
    ".".join(parts[:end])
    for keys in SCHEMA_KEYS.values()
    for parts in (section.split(".") for section in keys)
    for end in range(1, len(parts) + 1)
)


def shown(value: Any) -> str:
    """``repr(value)``, cut to 40 characters for messages."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def flatten(
    data: dict[str, Any], source: str
) -> tuple[dict[tuple[str, str], Any], list[str]]:
    """``{(section, key): value}`` of a parsed TOML document, and the sections
    in file order (``"quantize.linear.float8"`` for nested ones).

    A table at a section's path is a section; any other table is a key's
    value (an unknown section's keys are its keys).

    Raises:
        ProblemError: a key outside any section, or a section that is not a
            table.
    """
    values: dict[tuple[str, str], Any] = {}
    sections: list[str] = []

    def walk(table: dict[str, Any], path: str) -> None:
        sections.append(path)
        for key, value in table.items():
            where = f"{path}.{key}" if path else key
            if where in _TABLES or (not path and isinstance(value, dict)):
                if not isinstance(value, dict):
                    raise ProblemError(
                        f"{source}: [{where}] must be a table, got {shown(value)}"
                    )
                walk(value, where)
            elif not path:
                raise ProblemError(
                    f"{source}: {shown(key)} = {shown(value)} is outside any [section]"
                )
            else:
                values[(path, key)] = value

    walk(data, "")
    return values, [section for section in sections if section]


def _owner(schema: str, section: str, key: str | None) -> bool:
    keys = SCHEMA_KEYS[schema]
    if key is None:
        return (
            section in keys
            or section in _TABLES
            and any(name.startswith(section + ".") for name in keys)
        )
    return section in keys and key in keys[section]


def detect_schema(
    values: dict[tuple[str, str], Any], sections: list[str], source: str
) -> str:
    """``"v0.2"`` or ``"2024-12"``: the schema whose own sections or keys the
    file uses (neither: ``"v0.2"``).

    Raises:
        ProblemError: the file uses sections or keys of both.
    """
    found: dict[str, str] = {}
    items = [(section, None) for section in sections] + list(values)
    for section, key in items:
        owners = [schema for schema in SCHEMA_KEYS if _owner(schema, section, key)]
        if len(owners) == 1 and owners[0] not in found:
            found[owners[0]] = f"[{section}]" + ("" if key is None else f" {key}")
    if len(found) == 2:
        raise ProblemError(
            f"{source}: mixes torchtitan's schemas: {found['v0.2']} is "
            f"{_SCHEMA_NAMES['v0.2']}'s, {found['2024-12']} "
            f"{_SCHEMA_NAMES['2024-12']}'s"
        )
    return next(iter(found), "v0.2")


class JobTable:
    """A job file's values, read by type; what is not read is ignored.

    Args:
        values: ``{(section, key): value}`` (:func:`flatten`).
        sections: the sections in file order.
        source: the file, for messages.
        schema: its schema (:func:`detect_schema`).

    Raises:
        ProblemError: (v0.2) a section or key torchtitan's ``ConfigManager``
            refuses, with the closest known key where there is one.
    """

    def __init__(
        self,
        values: dict[tuple[str, str], Any],
        sections: list[str],
        source: str,
        schema: str,
    ):
        self.values, self.source, self.schema = values, source, schema
        self._read: set[tuple[str, str]] = set()
        self._why: dict[tuple[str, str], str] = {}
        keys = SCHEMA_KEYS[schema]
        for section in sections:
            if not _owner(schema, section, None) and schema == "v0.2":
                raise ProblemError(
                    f"{source}: unknown section [{section}] (torchtitan v0.2's "
                    "ConfigManager refuses it)"
                )
        for section, key in values:
            if _owner(schema, section, key):
                continue
            if schema == "2024-12":
                self._why[(section, key)] = (
                    "not a key of torchtitan 9dec370, whose parser ignores it"
                )
                continue
            known = sorted(keys.get(section, ()))
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ProblemError(
                f"{source}: unknown key {shown(key)} in [{section}] (torchtitan "
                f"v0.2's ConfigManager refuses it){hint}"
            )

    def has(self, section: str, key: str) -> bool:
        return (section, key) in self.values

    def raw(self, section: str, key: str, default: Any = None) -> Any:
        """The value as parsed (``default`` when absent), marked read."""
        self._read.add((section, key))
        return self.values.get((section, key), default)

    def fail(self, section: str, key: str, expected: str) -> ProblemError:
        value = self.values.get((section, key))
        return ProblemError(
            f"{self.source}: [{section}] {key} must be {expected}, got {shown(value)}"
        )

    def integer(
        self,
        section: str,
        key: str,
        default: int | None,
        *,
        low: int = 1,
        limit: int = 2**24,
        also: tuple[int, ...] = (),
    ) -> int | None:
        """A TOML integer in ``[low, limit]`` (or one of ``also``)."""
        value = self.raw(section, key, default)
        if value is None and default is None:
            return None
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or not (low <= value <= limit or value in also):
            kind = "a positive integer" if low == 1 else f"an integer >= {low}"
            extra = "".join(f" or {v}" for v in also)
            raise self.fail(section, key, f"{kind} at most {limit}{extra}")
        return value

    def flag(self, section: str, key: str, default: bool = False) -> bool:
        value = self.raw(section, key, default)
        if not isinstance(value, bool):
            raise self.fail(section, key, "true or false")
        return value

    def text(self, section: str, key: str, default: str | None) -> str | None:
        value = self.raw(section, key, default)
        if value is not None and not isinstance(value, str):
            raise self.fail(section, key, "a string")
        return value

    def choice(self, section: str, key: str, default: str, choices: tuple) -> str:
        value = self.raw(section, key, default)
        if value not in choices:
            raise self.fail(section, key, f"one of {', '.join(map(repr, choices))}")
        return value

    def names(
        self, section: str, key: str, *, comma: bool = False, limit: int = 10_000
    ) -> tuple[str, ...] | None:
        """A list of strings (``comma``: or one comma-separated string, as
        torchtitan splits one); ``None`` when absent."""
        value = self.raw(section, key)
        if value is None:
            return None
        if comma and isinstance(value, str):
            value = value.split(",")
        if (
            not isinstance(value, list)
            or len(value) > limit
            or not all(isinstance(item, str) for item in value)
        ):
            raise self.fail(section, key, "a list of strings")
        return tuple(value)

    def note(self, section: str, key: str, why: str) -> None:
        """List a present key as ignored, with ``why``."""
        if self.has(section, key):
            self._read.discard((section, key))
            self._why[(section, key)] = why

    def ignored(self) -> tuple[str, ...]:
        """The keys not read, in file order: ``[section] key = value`` and
        the reason where there is one."""
        out = []
        for section, key in self.values:
            if (section, key) in self._read:
                continue
            line = f"[{section}] {key} = {shown(self.values[(section, key)])}"
            why = self._why.get((section, key))
            out.append(line if why is None else f"{line} ({why})")
        return tuple(out)
