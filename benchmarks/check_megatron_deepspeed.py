"""Megatron-DeepSpeed's half of ``check_exports.py``, in a process of its own.

Megatron-DeepSpeed ships a ``megatron`` package of its own, which would shadow
Megatron-LM's, so ``check_exports.py --megatron-deepspeed SOURCE`` runs this
file as a separate process with that source (commit f4157bea, the one the
export names) first on ``PYTHONPATH``, sends it every ``megatron-deepspeed``
export as JSON on standard input and reads one outcome per export back. For
each export, with Megatron-DeepSpeed's own code on CPU (DeepSpeed 0.19.8,
torch's ``fake`` process group):

* the export's ``arguments``, with a small model's width (the export leaves
  the shape to the user; the model's norm and tied or untied head are
  passed, which decide ``GPTModelPipe``'s layer list) and
  ``--no-gradient-accumulation-fusion`` (APEX's CUDA kernel), through its
  ``parse_args`` and ``validate_args`` (``WORLD_SIZE`` set): the parallel
  sizes, batch, blocks, length and dtype are the plan's, ZB-H1
  (``--enable-zbh1-pipeline --enable-zbh1-exact-semantics``), recomputation
  (``--checkpoint-activations``, ``--checkpoint-num-layers 1``,
  ``--deepspeed-activation-checkpointing``) and flash attention
  (``use_flash_attn``) are set exactly when the plan was priced with them;
* its micro-batch calculator (``megatron/microbatches.py``);
* on the first rank of every stage, the real ``GPTModelPipe`` (its ``mpu``
  initialised) with ``_partition_layers`` given the export's ``parts``, as
  the export says: its spec list must be the export's layer list (``layers``
  with ``--fp16``/``--bf16``, else ``layers_fp32``), the stage must build the
  plan's profile layers, and its activation checkpoint interval must be 1
  with recomputation (0 without), checkpointing the transformer layers and
  nothing else (``_is_checkpointable``). On a CPU accelerator commit f4157bea
  passes ``sequence_parallel`` to ``torch.nn.LayerNorm``, which has no such
  argument (APEX's fused norm, its CUDA path, has; 4efb479d adds a norm that
  takes it): the check gives ``GPTModelPipe`` a ``LayerNorm`` that takes it.
  Flash attention is parsed, not built (``flash_attn`` needs CUDA);
* for a ZB-H1 export, ``ZeroBubbleH1Pipeline.steps()`` on every stage (the
  schedule ``initialize.py`` puts in place of DeepSpeed's ``TrainSchedule``
  under ``--enable-zbh1-pipeline``), read as the engine runs it
  (``BackwardOnlyPass``: ``B``, its weight gradients stored;
  ``WeightPass``: the oldest stored ``W``; ``BackwardPass``: ``B`` then its
  ``W``), against our ZB-H1 order (:func:`~pipedejavu.simulation.zero_bubble.
  zero_bubble_order`); ``{"zbh1": [[P, M], ...]}`` asks for the same
  comparison alone (the plans we refused for their micro-batches).

    PYTHONPATH=MEGATRON_DEEPSPEED_SOURCE:. \
        python benchmarks/check_megatron_deepspeed.py < cases.json
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

from fake_process_group import fake_rank  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: The width of the model built (the export leaves the shape to the user).
WIDTH = ["--hidden-size", "64", "--num-attention-heads", "8"]
#: Flags for building on a CPU: APEX's fused weight-gradient kernel is CUDA's.
CPU_ONLY = ["--no-gradient-accumulation-fusion"]
VOCAB = 128


class Differs(AssertionError):
    """The real code built something else than the plan."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Differs(what)


def parsed(argv: list[str], world: int):
    """Megatron-DeepSpeed's parsed and validated arguments, set as its global
    arguments."""
    import megatron.arguments as margs
    from megatron import global_vars

    os.environ.update(WORLD_SIZE=str(world), RANK="0")
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = margs.parse_args()
            margs.validate_args(args)
    finally:
        sys.argv = saved
    args.padded_vocab_size = VOCAB
    global_vars._GLOBAL_ARGS = args
    return args


def microbatches(args) -> int:
    from megatron.microbatches import build_num_microbatches_calculator

    with contextlib.redirect_stdout(io.StringIO()):
        return build_num_microbatches_calculator(args).get()


def spec_names(specs, blocks: int) -> list[str]:
    """The export's names of ``GPTModelPipe``'s specs."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    names, embedded = [], False
    for spec in specs:
        if not isinstance(spec, LayerSpec):
            names.append(getattr(spec, "__name__", repr(spec)))
            continue
        kind = spec.typename.__name__
        if isinstance(spec, TiedLayerSpec) or kind in ("EmbeddingPipe", "LMHeadPipe"):
            names.append("head" if embedded or kind == "LMHeadPipe" else "embedding")
            embedded = True
        elif kind == "ParallelTransformerLayerPipe":
            names.append(f"transformer.{spec.module_kwargs['layer_number']}")
        elif kind in ("LayerNorm", "RMSNorm", "NormWithSequenceParallel"):
            names.append("final_norm")
        else:
            names.append(kind)
    expect(names.count("head") == 1 and len(names) > blocks, f"specs {names}")
    return names


def gpt_model_pipe(args, parts: list[int], stage_rank: int, world: int, subclass=None):
    """The real ``GPTModelPipe`` on ``stage_rank``, ``parts`` given (to its
    ``_partition_layers``, or to ``subclass``'s, a subclass of it)."""
    import deepspeed.comm as dscomm
    import megatron.arguments as margs
    import megatron.model.gpt_model as gpt
    import torch
    from megatron import global_vars
    from megatron.core import mpu, tensor_parallel

    class NormWithSequenceParallel(torch.nn.LayerNorm):
        """``torch.nn.LayerNorm`` taking the flag (module docstring)."""

        def __init__(self, size, eps=1e-5, sequence_parallel=False):
            super().__init__(size, eps)

    def partition(self, method="uniform"):
        """The override the export's file names: ``parts`` given."""
        self.parts = list(parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    # on the class itself: DeepSpeed's _is_checkpointable reads its name
    cls = subclass or gpt.GPTModelPipe
    saved = cls._partition_layers
    cls._partition_layers = partition
    gpt.LayerNorm = NormWithSequenceParallel
    # flash attention parsed, not built (flash_attn needs CUDA)
    built = copy.copy(args)
    built.use_flash_attn = built.use_flash_attn_v2 = False
    global_vars._GLOBAL_ARGS = built
    with fake_rank(stage_rank, world), contextlib.redirect_stdout(io.StringIO()):
        dscomm.cdb = None
        dscomm.init_distributed(dist_backend="fake", auto_mpi_discovery=False,
                                verbose=False)  # fmt: skip
        mpu.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        )
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            config = margs.core_transformer_config_from_args(built)
            return cls(config=config, num_tokentypes=0, parallel_output=True)
        finally:
            mpu.destroy_model_parallel()
            global_vars._GLOBAL_ARGS = args
            cls._partition_layers = saved


def real_zbh1(stage: int, stages: int, count: int) -> list[tuple[str, int, int]]:
    """``ZeroBubbleH1Pipeline.steps()`` of ``stage`` as the engine runs it."""
    from deepspeed.runtime.pipe import schedule as ds
    from megatron.core.pipeline_parallel import deepspeed_zbh1_schedule as zb

    order, stored, done = [], [], {"F": 0, "B": 0}
    for step in zb.ZeroBubbleH1Pipeline(count, stages, stage).steps():
        for command in step:
            if isinstance(command, ds.ForwardPass):
                order.append(("F", 0, done["F"]))
                done["F"] += 1
            elif isinstance(command, zb.BackwardOnlyPass):
                order.append(("B", 0, done["B"]))
                stored.append(done["B"])
                done["B"] += 1
            elif isinstance(command, ds.BackwardPass):
                order += [("B", 0, done["B"]), ("W", 0, done["B"])]
                done["B"] += 1
            elif isinstance(command, zb.WeightPass):
                order.append(("W", 0, stored.pop(0)))
    return order


def zbh1_equal(stages: int, count: int) -> bool:
    """The real ZB-H1 order is ours on every stage."""
    from pipedejavu.simulation.zero_bubble import zero_bubble_order

    def ours(rank):
        ops = zero_bubble_order(rank, stages, count)
        return [("FBW"[o.backward + o.weight], o.chunk, o.microbatch) for o in ops]

    return all(real_zbh1(r, stages, count) == ours(r) for r in range(stages))


def argv_of(case: dict, out: dict) -> list[str]:
    """The export's arguments with the model's width and structure, the
    CPU's flags and a length (128 where the export states none)."""
    argv = [*out["arguments"], *WIDTH, *case["structure"], *CPU_ONLY]
    if "--seq-length" not in argv:
        argv += ["--seq-length", "128"]
    length = argv[argv.index("--seq-length") + 1]
    return argv + ["--max-position-embeddings", length]


def check(case: dict) -> dict:
    """One export (module docstring); returns what was compared."""
    out = json.loads(case["export"])
    options, plan = case["options"], case["plan"]
    world, stages = out["world_size"], plan["stages"]
    try:
        args = parsed(argv_of(case, out), world)
    except (AssertionError, ValueError, SystemExit) as error:
        return {"outcome": f"real code rejects: validate_args: {error}"}
    half = options["precision"] in ("bf16", "fp16")
    full = options["recompute"] == "full"
    expect(
        (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
         args.data_parallel_size, args.micro_batch_size, args.global_batch_size)
        == (out["model_parallel_size"], len(stages), plan["dp"], plan["mbs"],
            plan["gbs"]),
        "parallel sizes and batch",
    )  # fmt: skip
    expect(args.num_layers == plan["blocks"], f"--num-layers {args.num_layers}")
    if case["seq_length"] is not None:
        expect(args.seq_length == case["seq_length"], "sequence length")
    expect(args.fp16 == (options["precision"] == "fp16"), "fp16")
    expect(args.bf16 == (options["precision"] == "bf16"), "bf16")
    zero_bubble = options["zero_bubble"]
    expect(args.enable_zbh1_pipeline == zero_bubble, "--enable-zbh1-pipeline")
    expect(args.enable_zbh1_exact_semantics == zero_bubble, "exact semantics")
    expect(args.checkpoint_activations == full, "--checkpoint-activations")
    expect(args.deepspeed_activation_checkpointing == full, "deepspeed checkpointing")
    expect(args.use_flash_attn == options["flash_attention"], "flash attention")
    expect(microbatches(args) == plan["microbatches"], "micro-batch calculator")
    pipe = out["pipeline_module"]
    layers, parts = (
        (pipe["layers"], pipe["parts"])
        if half
        else (pipe["layers_fp32"], pipe["parts_fp32"])
    )
    where = case["profile_of_name"]
    tp = out["model_parallel_size"]
    for stage, (start, stop) in enumerate(stages):
        rank = stage * plan["dp"] * tp
        try:
            module = gpt_model_pipe(args, parts, rank, world)
        except Exception as error:  # noqa: BLE001
            return {"outcome": f"real code rejects: GPTModelPipe: {error!r}"}
        expect(spec_names(module._layer_specs, plan["blocks"]) == layers, "specs")
        expect(module.stage_id == stage, f"rank {rank}: stage {module.stage_id}")
        names = layers[module._local_start : module._local_stop]
        built = sorted({where[n] for n in names})
        expect(built == list(range(start, stop)), f"stage {stage} builds {built}")
        interval = module.activation_checkpoint_interval
        expect(interval == (1 if full else 0), f"checkpoint interval {interval}")
        if full:  # (interval 0 checkpoints nothing)
            checkpointed = [
                module._is_checkpointable([f]) for f in module.forward_funcs
            ]
            blocks = [n.startswith("transformer.") for n in names]
            expect(checkpointed == blocks, "checkpointed layers")
    if zero_bubble:
        expect(zbh1_equal(len(stages), plan["microbatches"]), "ZB-H1 order")
    return {"outcome": "built as planned"}


def subclass_checkpoints(case: dict) -> list[str]:
    """The layers but the transformer layers that DeepSpeed checkpoints, on
    the first rank of every stage, when ``parts`` go to a subclass of
    ``GPTModelPipe`` of another name (its ``_is_checkpointable`` recognises
    ``GPTModelPipe`` by the class's name)."""
    import megatron.model.gpt_model as gpt

    class MyGPTModelPipe(gpt.GPTModelPipe):
        pass

    out = json.loads(case["export"])
    pipe, plan = out["pipeline_module"], case["plan"]
    half = case["options"]["precision"] in ("bf16", "fp16")
    layers, parts = (
        (pipe["layers"], pipe["parts"])
        if half
        else (pipe["layers_fp32"], pipe["parts_fp32"])
    )
    args = parsed(argv_of(case, out), out["world_size"])
    found = []
    for stage in range(len(plan["stages"])):
        rank = stage * plan["dp"] * out["model_parallel_size"]
        module = gpt_model_pipe(args, parts, rank, out["world_size"], MyGPTModelPipe)
        names = layers[module._local_start : module._local_stop]
        pairs = zip(names, module.forward_funcs, strict=True)
        found += [n for n, f in pairs if module._is_checkpointable([f])]
    return [n for n in found if not n.startswith("transformer.")]


def main() -> int:
    import logging

    logging.disable(logging.WARNING)
    request = json.load(sys.stdin)
    results = []
    for case in request.get("cases", []):
        try:
            result = check(case)
        except Differs as error:
            result = {"outcome": f"silent difference: {error}"}
        results.append({"name": case["name"], **result})
    zbh1 = [[p, m, zbh1_equal(p, m)] for p, m in request.get("zbh1", [])]
    full = [c for c in request.get("cases", []) if c["options"]["recompute"] == "full"]
    probe = {}  # a model of tied embeddings and one of an untied head
    for untied in (False, True):
        for case in full:
            if ("--untie-embeddings-and-output-weights" in case["structure"]) == untied:
                probe[case["name"]] = subclass_checkpoints(case)
                break
    answer = {"results": results, "zbh1": zbh1, "subclass": probe}
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
