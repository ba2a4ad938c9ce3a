"""Build every export with the launchers' own code on CPU (issue 27).

tests/test_export_targets.py re-states each target's rules in pure Python;
this script runs the real code instead, on the same seeded random plans
(uneven, embedding-only and head-only stages, mixed GPU types, per-stage TP,
every TP/DP/PP mix, batches that are not whole micro-batches) and on plans the
planner returned:

* Megatron-LM: the export's shell line through ``parse_args`` +
  ``validate_args`` (``WORLD_SIZE`` set), ``core_transformer_config_from_args``;
  then, for every global rank, ``parallel_state.initialize_model_parallel`` on
  torch's ``fake`` process group (the order of ``megatron/training/
  initialize.py``), ``get_num_layers_to_build`` +
  ``get_transformer_layer_offset`` and ``is_pipeline_first/last_stage`` (the
  embedding and the head); the micro-batch calculator.
* DeepSpeed and Megatron-DeepSpeed: for every global rank a real
  ``PipelineModule`` on ``PipeModelDataParallelTopology`` (fake process
  group), whose ``_partition_layers`` takes the export's ``parts`` as the
  export says, over one dummy layer per entry of the export's layer list; the
  engine's ``DeepSpeedConfig`` with the module's grid as ``mpu`` (its batch,
  precision and ZeRO stage). With ``--megatron-deepspeed SOURCE`` every
  Megatron-DeepSpeed export, and its knobs (ZB-H1, full recomputation, flash
  attention, precision), also goes through Megatron-DeepSpeed's own parser,
  micro-batch calculator, ``GPTModelPipe`` and ``ZeroBubbleH1Pipeline``
  (``benchmarks/check_megatron_deepspeed.py``, in a process of its own: its
  ``megatron`` package shadows Megatron-LM's).
* Whole models and users' commands (``benchmarks/check_model_exports.py``):
  every bundled preset, Sailor's ``LLAMA-3-8`` on ``GH-96:32`` at global
  batch 256 as ``pipedejavu plan --export TARGET`` plans it, and users'
  ``--megatron-args`` commands with the plan's flags in place of theirs: the
  whole ``pretrain_gpt.py`` command through ``parse_args`` (its ``<...>``
  placeholders given values; :data:`CPU_ONLY` added), the model's shape,
  length and blocks, the training options and the user's own flags.
* torchtitan (``benchmarks/check_torchtitan.py``): ``ConfigManager`` on the
  TOML, ``ParallelDims`` and its mesh on every rank (fake process group),
  ``pipeline_module_split`` of a small llama3 ``Transformer`` and
  ``build_pipeline_schedule``, the recomputation through ``apply_ac`` and the
  precision through ``maybe_enable_amp``; for a refused plan, the config it
  would need through ``parallelize_llama`` or the schedule, or torchtitan's
  own code showing that it runs something else. Then the training knobs
  (schedules 1F1B, Interleaved1F1B and InterleavedZeroBubble, recomputation,
  TP with sequence parallelism, and the knobs it refuses) on even plans of 2
  to 8 stages: each rank's parts and PyTorch's per-rank action order against
  our simulators' (``--no-knobs`` skips them).
* Alpa and Sailor: not installable here (Alpa needs jax 0.3 / CUDA; Sailor is
  not a package); their documented rules are checked by the tests.

A refusal of ours is checked too: the real code must reject the plan as
planned (a non-whole batch: Megatron's calculator and DeepSpeed's config
raise; per-stage TP: each launcher takes one TP integer).

Run with the ``launchers`` extra installed (CPU torch is enough; Megatron-LM
imports ``triton``, and Megatron-DeepSpeed ``transformers``) and the
Megatron-LM source of the installed megatron-core on ``PYTHONPATH`` (the
wheels do not ship ``megatron/training``)::

    PYTHONPATH=.:/path/to/Megatron-LM python benchmarks/check_exports.py \
        --megatron-deepspeed /path/to/Megatron-DeepSpeed

Writes benchmarks/results/check_exports.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shlex
import sys
import time
import warnings
from collections import Counter
from importlib import metadata
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import stamp  # noqa: E402
import test_export_targets as rules  # noqa: E402  (plans, hosts, re-stated maps)
import torch  # noqa: E402
from check_model_exports import (  # noqa: E402
    Case,
    megatron_args_cases,
    megatron_deepspeed_case,
    megatron_deepspeed_knob_cases,
    model_cases,
    run_megatron_deepspeed,
)
from check_torchtitan import (  # noqa: E402
    Mismatch,
    RealRejects,
    check_rank_cover,
    check_torchtitan,
    expect,
    fake_rank,
    profile_of,
    run_knobs,
    silenced,
    titan_rejects,
)

from pipedejavu.io.export_rules import ExportRefused, num_blocks  # noqa: E402
from pipedejavu.io.exports import export_plan  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "check_exports.json"
TARGETS = ("megatron", "deepspeed", "megatron-deepspeed", "torchtitan")


# ---------------------------------------------------------------- Megatron-LM
MODEL_ARGS = [
    "--hidden-size", "64", "--num-attention-heads", "8",
    "--seq-length", "128", "--max-position-embeddings", "128",
]  # fmt: skip


#: Flags the check adds for a CPU: the rotary embedding's default fusion
#: needs Transformer Engine (>= 1.4), which a GPU machine's Megatron-LM has
#: and this one has not (TransformerConfig raises without it).
CPU_ONLY = ["--no-rope-fusion"]

#: Values of the kind Megatron-LM's parser takes for the export's ``<...>``
#: placeholders (the data, tokenizer and training a plan leaves to the user).
PLACEHOLDER_VALUES = {
    "<DATA_PATH>": "data",
    "<TOKENIZER_TYPE>": "NullTokenizer",
    "<TOKENIZER>": "tokenizer",
    "<VOCAB_FILE>": "vocab.json",
    "<MERGE_FILE>": "merges.txt",
    "<TRAIN_ITERS>": "10",
    "<LR>": "0.0001",
}


def megatron_args(argv: list[str], world: int):
    """Megatron-LM's parsed and validated arguments for ``argv``: flags, or
    the export's whole command (the launcher's words and the script dropped,
    its placeholders given values), with the :data:`MODEL_ARGS` it lacks."""
    import megatron.training.arguments as margs

    # validate_args asks the GPU's architecture only to word a TP warning.
    margs.get_device_arch_version = lambda: 9
    os.environ.update(WORLD_SIZE=str(world), RANK="0")
    saved = sys.argv
    if "pretrain_gpt.py" in argv:
        argv = argv[argv.index("pretrain_gpt.py") + 1 :]
    words = [PLACEHOLDER_VALUES.get(w, w) for w in argv]
    given = {w.partition("=")[0] for w in words}
    model = [
        word
        for flag, value in zip(MODEL_ARGS[::2], MODEL_ARGS[1::2], strict=True)
        if flag not in given
        for word in (flag, value)
    ]
    sys.argv = ["pretrain_gpt.py", *words, *model, *CPU_ONLY]
    try:
        with silenced():
            args = margs.parse_args()
            margs.validate_args(args)
            config = margs.core_transformer_config_from_args(args)
    finally:
        sys.argv = saved
    return args, config


def megatron_microbatches(gbs: int, mbs: int, dp: int) -> int:
    from megatron.core import num_microbatches_calculator as calc

    calc.destroy_num_microbatches_calculator()
    with silenced():
        calc.init_num_microbatches_calculator(0, None, gbs, mbs, dp, False)
    try:
        return calc.get_num_microbatches()
    finally:
        calc.destroy_num_microbatches_calculator()


def check_model_shape(args, config, spec, seq_length: int) -> None:
    """Megatron-LM read the model ``spec`` at ``seq_length`` from the
    export's command."""
    positions = {"learned": "learned_absolute", "rotary": "rope"}
    shape = {
        "num_layers": (config.num_layers, spec.num_layers),
        "hidden_size": (config.hidden_size, spec.hidden_size),
        "ffn_hidden_size": (config.ffn_hidden_size, spec.ffn_hidden_size),
        "num_attention_heads": (config.num_attention_heads, spec.num_attention_heads),
        "num_query_groups": (config.num_query_groups, spec.num_query_groups),
        "gated_linear_unit": (config.gated_linear_unit, spec.gated_mlp),
        "normalization": (config.normalization.lower(), spec.norm),
        "add_bias_linear": (config.add_bias_linear, spec.linear_bias),
        "add_qkv_bias": (config.add_qkv_bias, spec.linear_bias or spec.qkv_bias),
        "seq_length": (args.seq_length, seq_length),
        "position_embedding_type": (
            args.position_embedding_type,
            positions[spec.position],
        ),
        "untie": (args.untie_embeddings_and_output_weights, not spec.tied_embeddings),
        "vocab divisible by": (
            args.make_vocab_size_divisible_by,
            spec.vocab_divisible_by,
        ),
    }
    if args.tokenizer_type != "GPT2BPETokenizer":
        shape["vocab_size"] = (args.vocab_size, spec.vocab_size)
    wrong = [k for k, (got, want) in shape.items() if got != want]
    expect(not wrong, f"model shape: {wrong}")
    expect(args.max_position_embeddings >= seq_length, "--max-position-embeddings")


def check_megatron_options(args, options) -> None:
    """Megatron-LM set the training options the plan was priced with."""
    recompute = None if options.recompute == "none" else options.recompute
    expect(args.recompute_granularity == recompute, "--recompute-granularity")
    expect(args.bf16 == (options.precision in ("bf16", "fp8")), "--bf16")
    expect(args.fp16 == (options.precision == "fp16"), "--fp16")
    expect(args.use_distributed_optimizer == options.distributed_optimizer,
           "--use-distributed-optimizer")  # fmt: skip
    unfused = args.attention_backend.name == "unfused"
    expect(unfused == (not options.flash_attention), "--attention-backend")


@contextlib.contextmanager
def megatron_rank(args, rank: int, world: int):
    """Rank ``rank`` of ``world`` on the fake process group, with Megatron
    Core's parallel state initialised as the parsed ``args`` say (in the
    order ``initialize.py`` passes for ``--use-tp-pp-dp-mapping``), and
    destroyed on leaving."""
    from megatron.core import parallel_state as ps

    order = "tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    with fake_rank(rank, world):
        ps.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            order=order,
            create_gloo_process_groups=False,
        )
        try:
            yield
        finally:
            ps.destroy_model_parallel()


def check_megatron(
    plan, text: str, *, spec=None, options=None, seq_length=None, user=None
) -> None:
    """The export's command through Megatron-LM's code (module docstring);
    ``spec``: the model, whose shape and blocks it must read; ``options``:
    the training the plan was priced with; ``user``: ``{argument: value}`` of
    the ``--megatron-args`` command it must keep."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    world = plan.num_gpus
    try:
        args, config = megatron_args(shlex.split(text.splitlines()[-1]), world)
    except (AssertionError, ValueError, SystemExit) as error:
        raise RealRejects(f"validate_args: {error}") from None
    expect(args.data_parallel_size == plan.dp, "data parallel size")
    expect(args.micro_batch_size == plan.mbs, "micro-batch")
    if spec is not None:
        check_model_shape(args, config, spec, seq_length or spec.seq_length)
    if options is not None:
        check_megatron_options(args, options)
    for name, value in (user or {}).items():
        expect(getattr(args, name) == value, f"--megatron-args {name}")
    try:
        count = megatron_microbatches(args.global_batch_size, args.micro_batch_size,
                                      args.data_parallel_size)  # fmt: skip
    except AssertionError as error:
        raise RealRejects(f"micro-batch calculator: {error}") from None
    expect(count == plan.num_microbatches, "micro-batches")
    blocks = num_blocks(plan, spec)
    head = list(range(blocks + 1, plan.num_layers))  # the norm and the head
    coords = {}
    for rank in range(world):
        with megatron_rank(args, rank, world):
            stage = ps.get_pipeline_model_parallel_rank()
            replica = ps.get_data_parallel_rank()
            coords[rank] = (stage, replica, ps.get_tensor_model_parallel_rank())
            num = get_num_layers_to_build(config)
            offset = get_transformer_layer_offset(config)
            built = [0] if ps.is_pipeline_first_stage() else []
            built += [offset + i + 1 for i in range(num)]
            built += head if ps.is_pipeline_last_stage() else []
        expect(built == profile_of(plan, stage), f"rank {rank} builds {built}")
    check_rank_cover(plan, coords, rules.types_by_rank(text))


def megatron_rejects(plan) -> str:
    """Why Megatron cannot run a plan we refused."""
    if len(rules.tps(plan)) > 1:
        return "one --tensor-model-parallel-size for all stages"
    try:
        megatron_microbatches(plan.gbs, plan.mbs, plan.dp)
    except AssertionError:
        return "micro-batch calculator asserts"
    return ""


# ------------------------------------------------------------------ DeepSpeed
def deepspeed_classes():
    import deepspeed.comm as dscomm
    from deepspeed.runtime.pipe import LayerSpec, PipelineModule

    class Named(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name
            self.w = torch.nn.Parameter(torch.zeros(1))

    class Parts(PipelineModule):
        """The override the export's file names: ``parts`` given."""

        def __init__(self, *args, parts, **kwargs):
            self._given = parts
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            self.parts = list(self._given)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return dscomm, LayerSpec, Named, Parts


def gpt_model_pipe_profile(blocks: int, half: bool, last: int) -> dict[str, int]:
    """``GPTModelPipe``'s specs (re-stated as in the tests; its own in
    ``check_megatron_deepspeed.py``) to profile layers (``last``: the head's;
    the norm's is ``blocks + 1``)."""
    names = ["_to_float16", "embedding"] + [f"transformer.{i}" for i in range(blocks)]
    names += ["final_norm", "head"] + (["float16_to_fp32"] if half else [])
    where = [0, 0, *range(1, blocks + 1), blocks + 1, last]
    where += [last] if half else []
    return dict(zip(names, where, strict=True))


def check_deepspeed(
    plan, text: str, *, megatron: bool, spec=None, options=None
) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dscomm, LayerSpec, Named, Parts = deepspeed_classes()
    out = json.loads(text)
    pipe = out["pipeline_module"]
    tp, dp, world = (
        out["model_parallel_size"],
        out["data_parallel_size"],
        out["world_size"],
    )
    expect(world == plan.num_gpus, "world size")
    last, blocks = plan.num_layers - 1, num_blocks(plan, spec)
    if megatron:
        lists = [
            (pipe["layers"], pipe["parts"], gpt_model_pipe_profile(blocks, True, last)),
            (
                pipe["layers_fp32"],
                pipe["parts_fp32"],
                gpt_model_pipe_profile(blocks, False, last),
            ),
        ]
    else:
        where = {"embedding": 0, "head": last}
        where |= {f"transformer.{i}": i + 1 for i in range(blocks)}
        if last == blocks + 2:  # the final norm a profile layer of its own
            where["final_norm"] = blocks + 1
        lists = [(pipe["layers"], pipe["parts"], where)]
    named = {}
    for block in out.get("gpu_types_by_rank", []):
        first, stop = block["ranks"][0], block["ranks"][1] + 1
        named.update(dict.fromkeys(range(first, stop), block["gpu_type"]))
    for layers, parts, where in lists:
        expect(set(layers) == set(where) and len(layers) == len(where), "layer list")
        coords = {}
        for rank in range(world):
            with fake_rank(rank, world), silenced():
                dscomm.cdb = None
                dscomm.init_distributed(dist_backend="fake", auto_mpi_discovery=False,
                                        verbose=False)  # fmt: skip
                topo = PipeModelDataParallelTopology(
                    num_pp=pipe["num_stages"], num_mp=tp, num_dp=dp
                )
                try:
                    module = Parts([LayerSpec(Named, n) for n in layers], topology=topo,
                                   parts=parts)  # fmt: skip
                except Exception as error:  # noqa: BLE001
                    raise RealRejects(f"PipelineModule: {error!r}") from None
                grid = module._grid
                stage = module.stage_id
                coords[rank] = (stage, grid.get_data_parallel_id(),
                                grid.get_slice_parallel_rank())  # fmt: skip
                built = sorted({where[f.name] for f in module.forward_funcs})
                if rank == 0:
                    try:
                        config = DeepSpeedConfig(dict(out["ds_config"]), mpu=grid)
                    except AssertionError as error:
                        raise RealRejects(f"DeepSpeedConfig: {error}") from None
                    expect(
                        (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                         config.gradient_accumulation_steps)
                        == (plan.gbs, plan.mbs, plan.num_microbatches),
                        "DeepSpeedConfig batch",
                    )  # fmt: skip
                    if options is not None:
                        expect(
                            (config.bfloat16_config.enabled,
                             config.float16_config.enabled,
                             config.zero_optimization_stage)
                            == (options.precision == "bf16",
                                options.precision == "fp16",
                                int(options.distributed_optimizer)),
                            "DeepSpeedConfig precision and ZeRO stage",
                        )  # fmt: skip
            expect(built == profile_of(plan, stage), f"rank {rank} builds {built}")
        check_rank_cover(plan, coords, named)


def deepspeed_rejects(plan) -> str:
    """Why DeepSpeed cannot run a plan we refused (its config's batch rule)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    if len(rules.tps(plan)) > 1:
        return "one model-parallel size for all stages"

    class Grid:  # the data-parallel size the engine reads from its mpu
        def get_data_parallel_world_size(self):
            return plan.dp

    config = {"train_batch_size": plan.gbs, "train_micro_batch_size_per_gpu": plan.mbs}
    try:
        with fake_rank(0, plan.num_gpus), silenced():
            DeepSpeedConfig(config, mpu=Grid())
    except AssertionError:
        return "DeepSpeedConfig batch assertion"
    return ""


# ---------------------------------------------------------------------- main
def check_case(target: str, case, text: str) -> None:
    """``case``'s export to ``target`` through the launcher's code; any other
    error of the real code is a rejection."""
    plan, spec, options = case.plan, case.spec, case.options_for(target)
    length = case.seq_length or (spec.seq_length if spec is not None else None)
    try:
        if target == "megatron":
            check_megatron(plan, text, spec=None if case.megatron_args else spec,
                           options=options, seq_length=length,
                           user=case.user)  # fmt: skip
        elif target in ("deepspeed", "megatron-deepspeed"):
            check_deepspeed(plan, text, megatron=target != "deepspeed", spec=spec,
                            options=options)  # fmt: skip
        else:
            check_torchtitan(plan, text, options, spec, length)
    except (Mismatch, RealRejects):
        raise
    except Exception as error:  # noqa: BLE001
        raise RealRejects(repr(error)) from None


def rejects(target: str, case) -> str:
    """Why the launcher cannot run ``case`` as planned (``""``: no reason
    found)."""
    if target == "megatron":
        return megatron_rejects(case.plan)
    if target == "torchtitan":
        return titan_rejects(case.plan, case.options_for(target))
    return deepspeed_rejects(case.plan)


KEYS = ("plans checked", "built as planned", "refused by us",
        "refusal confirmed by the real code", "silent differences",
        "exports the real code rejects")  # fmt: skip


def run_cases(cases, targets, problems: list, deepspeed_cases: list) -> dict:
    """Every case to each of its targets; the counts and the refusals'
    witnesses per target. Each ``megatron-deepspeed`` export built goes to
    ``deepspeed_cases`` for its own code (``check_megatron_deepspeed.py``);
    a refusal of ours without a witness is a problem."""
    tally = {t: Counter() for t in targets}
    reasons = {t: Counter() for t in targets}
    for case in cases:
        for target in [t for t in case.targets if t in targets]:
            count = tally[target]
            count["plans checked"] += 1
            try:
                text = export_plan(case.plan, target, gpus_per_node=case.hosts,
                                   options=case.options_for(target),
                                   seq_length=case.seq_length, spec=case.spec,
                                   megatron_args=case.megatron_args)  # fmt: skip
            except ExportRefused as refusal:
                count["refused by us"] += 1
                why = rejects(target, case)
                if why:
                    count["refusal confirmed by the real code"] += 1
                    reasons[target][why] += 1
                else:
                    problems.append((target, case.name, f"refused: {refusal}"))
                continue
            if target == "megatron-deepspeed":
                deepspeed_cases.append(megatron_deepspeed_case(case, text))
            try:
                check_case(target, case, text)
            except Mismatch as error:
                count["silent differences"] += 1
                problems.append((target, case.name, f"silent difference: {error}"))
            except RealRejects as error:
                count["exports the real code rejects"] += 1
                problems.append((target, case.name, f"real code rejects: {error}"))
            else:
                count["built as planned"] += 1
    return {
        "targets": {t: {k: tally[t][k] for k in KEYS} for t in targets},
        "refusals_confirmed_by": {t: dict(reasons[t]) for t in targets},
    }


def megatron_deepspeed_knobs(source: Path, deepspeed_cases: list, problems: list):
    """Megatron-DeepSpeed's knob cases exported; every export built (these and
    ``deepspeed_cases``) through its own code, and each ZB-H1 plan refused
    for its micro-batches against its ``ZeroBubbleH1Pipeline``."""
    tally, refused, pairs = Counter(), Counter(), []
    knob_cases = []
    for case in megatron_deepspeed_knob_cases():
        tally["plans checked"] += 1
        try:
            text = export_plan(case.plan, "megatron-deepspeed", options=case.options)
        except ExportRefused as refusal:
            tally["refused by us"] += 1
            if "ZeroBubbleH1Pipeline" in str(refusal):
                pairs.append([case.plan.num_stages, case.plan.num_microbatches])
            else:  # (the reasons read in its source; module docstring)
                why = str(refusal).split("megatron-deepspeed: ", 1)[1]
                refused[why.split(";")[0][:90]] += 1
            continue
        knob_cases.append(megatron_deepspeed_case(case, text))
    real = run_megatron_deepspeed(source, deepspeed_cases + knob_cases, pairs)
    outcomes = Counter()
    for result in real["results"]:
        outcomes[result["outcome"].split(":")[0]] += 1
        if result["outcome"] != "built as planned":
            problems.append(("megatron-deepspeed code", result["name"],
                             result["outcome"]))  # fmt: skip
    zbh1_confirmed = sum(not equal for _, _, equal in real["zbh1"])
    for stages, count, equal in real["zbh1"]:
        if equal:
            problems.append(("megatron-deepspeed code", f"P {stages} M {count}",
                             "refused ZB-H1 runs our order"))  # fmt: skip
    tally["refusal confirmed by the real code"] = zbh1_confirmed
    return {
        "exports_through_its_code": dict(outcomes),
        # the layers but the blocks checkpointed with parts in a subclass
        "parts_in_a_subclass_of_another_name": real["subclass"],
        "exports_from_the_plans_above": len(deepspeed_cases),
        "knob_cases": dict(tally),
        "zbh1_refusals_whose_real_order_differs": zbh1_confirmed,
        "refused_for_reasons_read_in_its_source": dict(refused),
    }


def planner_plans():
    from pipedejavu.costmodel.megatron.sailor_data import load_sailor_data
    from pipedejavu.planning.training import plan_training

    data = load_sailor_data()
    out = []
    for model, pool, gbs, options in rules.PLANNED:
        plan = plan_training(model, pool, gbs, **options).plan
        hosts = {gpu: data.gpu_spec(gpu).gpus_per_node for gpu in pool}
        out.append(Case(f"plan {model} {pool} gbs {gbs}", plan, hosts))
    return out


def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "megatron-core", "deepspeed", "torchtitan"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    import megatron.training
    from megatron.core import package_info

    # The megatron package imported (the source tree on PYTHONPATH).
    out["megatron imported"] = package_info.__version__
    out["megatron source"] = Path(megatron.training.__file__).parents[2].name
    out["python"] = platform.python_version()
    return out


def write_check(
    out: str | Path,
    started: float,
    fields: dict,
    failures: list,
    shown: tuple[str, ...],
) -> int:
    """Write a launcher check's results file (date, machine, the torch and
    megatron-core versions, ``fields``, ``failures``, seconds), print the
    ``shown`` entries and the first failures; the exit status (1 on a
    failure)."""
    result = {
        **stamp.stamp("vm", cores=False),
        "versions": {
            name: metadata.version(name) for name in ("torch", "megatron-core")
        },
        **fields,
        "failures": failures,
        "seconds": time.perf_counter() - started,
    }
    stamp.write_json(out, result, end="\n")
    print(json.dumps({key: result[key] for key in shown}))
    for failure in failures[:10]:
        print(failure)
    return 0 if not failures else 1


def check_cases(argv, doc, name, cases, check, describe, counted=None) -> int:
    """The ``main`` of a check of ``cases`` by Megatron-LM's own code: each
    case through ``check(*case)`` ("as planned", or what differs), a refusal
    of our export or a rejection by Megatron-LM standing for what differs;
    the results file (``--out``, by default ``results/NAME.json``;
    :func:`write_check`) holds the count of "as planned" and of "differs or
    rejected", ``counted(cases as planned)``'s fields and, for each case not
    as planned, ``describe(*case)`` and why. ``doc``: the script's
    docstring."""
    out = stamp.out_option(doc, str(stamp.RESULTS / f"{name}.json"), argv)
    started = time.perf_counter()
    outcomes: dict[str, int] = {}
    failures, planned = [], []
    for case in cases:
        try:
            outcome = check(*case)
        except ExportRefused as error:
            outcome = f"refused: {error}"
        except (AssertionError, ValueError, SystemExit) as error:
            outcome = f"Megatron rejects: {error}"
        key = outcome if outcome == "as planned" else "differs or rejected"
        outcomes[key] = outcomes.get(key, 0) + 1
        if outcome == "as planned":
            planned.append(case)
        else:
            failures.append({**describe(*case), "why": outcome})
    extra = counted(planned) if counted else {}
    shown = ("outcomes", *extra) if extra else ("outcomes", "versions")
    fields = {"outcomes": outcomes, **extra}
    return write_check(out, started, fields, failures, shown)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plans", type=int, default=rules.NUM_PLANS,
                        help="seeded random plans (the tests' generator)")  # fmt: skip
    parser.add_argument("--no-planner", action="store_true")
    parser.add_argument("--no-knobs", action="store_true",
                        help="skip torchtitan's training-knob plans")  # fmt: skip
    parser.add_argument("--no-models", action="store_true",
                        help="skip the model and --megatron-args exports")  # fmt: skip
    parser.add_argument("--command-plans", type=int, default=40,
                        help="random plans each --megatron-args command is "
                        "exported on")  # fmt: skip
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--megatron-commit", default="",
                        help="commit of the Megatron-LM source, recorded")  # fmt: skip
    parser.add_argument("--megatron-deepspeed", type=Path, default=None,
                        help="Megatron-DeepSpeed's source: run its own code on "
                        "every megatron-deepspeed export and its knobs")  # fmt: skip
    parser.add_argument("--megatron-deepspeed-commit", default="",
                        help="commit of that source, recorded")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    ns = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    targets = ns.targets.split(",")
    cases = [Case(f"seed {s}", rules.random_plan(s), rules.HOSTS)
             for s in range(ns.plans)]  # fmt: skip
    if not ns.no_planner:
        cases += planner_plans()
    problems, deepspeed_cases = [], []
    start = time.perf_counter()
    plans = run_cases(cases, targets, problems, deepspeed_cases)
    seconds = time.perf_counter() - start
    models = commands = None
    if not ns.no_models:
        start = time.perf_counter()
        models = run_cases(model_cases(), targets, problems, deepspeed_cases)
        models["seconds"] = round(time.perf_counter() - start, 1)
        if "megatron" in targets:
            start = time.perf_counter()
            commands = run_cases(megatron_args_cases(ns.command_plans), ["megatron"],
                                 problems, [])  # fmt: skip
            commands["seconds"] = round(time.perf_counter() - start, 1)
    deepspeed = None
    if ns.megatron_deepspeed is not None and "megatron-deepspeed" in targets:
        start = time.perf_counter()
        deepspeed = megatron_deepspeed_knobs(
            ns.megatron_deepspeed, deepspeed_cases, problems
        )
        deepspeed["seconds"] = round(time.perf_counter() - start, 1)
    knobs = None
    if "torchtitan" in targets and not ns.no_knobs:
        start = time.perf_counter()
        knobs = run_knobs(problems)
        knobs["seconds"] = round(time.perf_counter() - start, 1)
    commit = {"megatron-lm commit": ns.megatron_commit} if ns.megatron_commit else {}
    if ns.megatron_deepspeed_commit:
        commit["megatron-deepspeed commit"] = ns.megatron_deepspeed_commit
    not_checked = {
        "alpa": "Alpa (jax 0.3, CUDA) does not install here; rules re-stated "
        "in tests/test_export_targets.py",
        "sailor": "Sailor is not a package; its plan reader re-stated in the tests",
    }
    if deepspeed is None:
        not_checked["megatron-deepspeed arguments"] = (
            "Megatron-DeepSpeed's own code not run (no --megatron-deepspeed); "
            "its GPTModelPipe layer list is re-stated"
        )
    result = {
        **stamp.stamp(),
        "versions": versions() | commit,
        "random_plans": ns.plans,
        "planner_plans": 0 if ns.no_planner else len(rules.PLANNED),
        "seconds": round(seconds, 1),
        **plans,
        "models": models,
        "megatron_args_commands": commands,
        "megatron_deepspeed_code": deepspeed,
        "torchtitan_knobs": knobs,
        "problems": [list(p) for p in problems],
        "not_checked": not_checked,
    }
    ns.out.write_text(json.dumps(result, indent=1) + "\n")
    width = max(map(len, KEYS))
    for title, part in (("plans", plans), ("models", models),
                        ("--megatron-args", commands)):  # fmt: skip
        if part is None:
            continue
        shown = list(part["targets"])
        print(f"{title:{width}}  " + "  ".join(f"{t:>18}" for t in shown))
        for key in KEYS:
            row = (part["targets"][t][key] for t in shown)
            print(f"{key:{width}}  " + "  ".join(f"{n:>18}" for n in row))
    if deepspeed is not None:
        print(f"Megatron-DeepSpeed's code: {deepspeed['exports_through_its_code']}, "
              f"knobs {deepspeed['knob_cases']}")  # fmt: skip
    if knobs is not None:
        counts = knobs["counts"]
        print("torchtitan knobs: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in KEYS))
        print(f"  PyTorch's rank orders equal ours: {knobs['rank_orders_equal_ours']}")
    for problem in problems[:20]:
        print(" | ".join(problem))
    print(f"{len(cases)} plans in {seconds:.0f} s; wrote {ns.out}")
    parts = [p for p in (plans, models, commands) if p is not None]
    silent = any(p["targets"][t]["silent differences"] for p in parts
                 for t in p["targets"])  # fmt: skip
    silent = silent or bool(knobs and knobs["counts"].get("silent differences"))
    silent = silent or bool(
        deepspeed and deepspeed["exports_through_its_code"].get("silent difference")
    )
    return 1 if silent else 0


if __name__ == "__main__":
    raise SystemExit(main())
