"""The exports of issue 43 for ``check_exports.py``: whole models, the user's
``--megatron-args`` command and Megatron-DeepSpeed's knobs.

``check_exports.py`` imports this module for its cases (:class:`Case`) and
runs each through the launchers' own code as it does the random plans:

* **models** (:func:`model_cases`): every bundled model preset Megatron-LM
  has a position flag for (not ALiBi) on two plans (two stages; TP 1 and DP
  1, then TP 2 and DP 2), each target with training it launches; Sailor's
  ``LLAMA-3-8`` (32 blocks, the final norm and the LM head two profile
  layers) on ``GH-96:32`` at global batch 256 as ``pipedejavu plan
  --export TARGET`` plans it (:func:`~pipedejavu.planning.plan_model.
  plan_model` and the CLI's ``export_model``), and the reviewed plan of issue
  43 on it. The Megatron-LM export is the whole ``pretrain_gpt.py`` command,
  read by Megatron-LM's ``parse_args`` with its placeholders given values:
  the model's shape, length and blocks, and the training options;
* **``--megatron-args``** (:func:`megatron_args_cases`): users' commands
  (a launcher's words before the script, ``--flag=value``, plan flags of
  every kind, including a layout, virtual stages and context parallelism)
  with the plan's flags in place of theirs, on the seeded random plans and
  the reviewed plan: Megatron builds the plan and keeps the user's own flags;
* **Megatron-DeepSpeed's knobs** (:func:`megatron_deepspeed_knob_cases`):
  even plans of 2 to 8 stages, ZB-H1 with 1 to ``2 P + 1`` micro-batches,
  full recomputation, bf16 and fp16, flash attention or not; and the knobs
  it refuses. Every ``megatron-deepspeed`` export goes to
  ``check_megatron_deepspeed.py`` (:func:`run_megatron_deepspeed`), which
  runs Megatron-DeepSpeed's own parser, micro-batch calculator,
  ``GPTModelPipe`` and ``ZeroBubbleH1Pipeline`` in a process of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_export_knobs as knob_rules  # noqa: E402
import test_export_targets as rules  # noqa: E402

from pipedejavu.core.training_options import TrainingOptions  # noqa: E402
from pipedejavu.costmodel.megatron.tables import plan_from_stages  # noqa: E402
from pipedejavu.io.export_rules import num_blocks  # noqa: E402

TARGETS = ("megatron", "deepspeed", "megatron-deepspeed", "torchtitan")
#: Training each target launches, for the model cases.
MODEL_OPTIONS = {
    "megatron": TrainingOptions(
        "bf16", recompute="full", distributed_optimizer=True, sequence_parallel=True
    ),
    "deepspeed": TrainingOptions("bf16", distributed_optimizer=True),
    "megatron-deepspeed": TrainingOptions(
        "bf16", recompute="full", zero_bubble=True, distributed_optimizer=True
    ),
    "torchtitan": TrainingOptions(recompute="full", sequence_parallel=True),
}
#: Issue 43's reviewed plan of LLAMA-3-8 on GH-96:32 (its stages' bounds).
REVIEWED = [0, 3, 6, 9, 13, 18, 23, 28, 35]
#: Users' Megatron-LM commands and the values of their own flags that the
#: export must keep (Megatron-LM's argument names).
USER_COMMANDS = [
    (
        "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 32 "
        "--hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
        "--max-position-embeddings 4096 --vocab-size 50304 --micro-batch-size 1 "
        "--global-batch-size 256 --tensor-model-parallel-size=8 "
        "--pipeline-model-parallel-size 1 --recompute-activations --bf16 "
        "--tokenizer-type NullTokenizer --data-path /data/corpus --lr 3e-4 "
        "--train-iters 1000",
        {"hidden_size": 4096, "num_attention_heads": 32, "seq_length": 4096,
         "lr": 3e-4, "train_iters": 1000, "data_path": ["/data/corpus"]},
    ),
    (
        "pretrain_gpt.py --num-layers 24 --hidden-size 1024 "
        "--num-attention-heads 16 --seq-length 2048 --max-position-embeddings "
        "2048 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
        "--num-layers-per-virtual-pipeline-stage 3 --sequence-parallel "
        "--use-distributed-optimizer --overlap-grad-reduce --micro-batch-size 4 "
        "--global-batch-size 512 --fp16 --recompute-granularity full "
        "--recompute-method block --recompute-num-layers 2 "
        "--context-parallel-size 2 --tokenizer-type "
        "GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file "
        "gpt2-merges.txt --data-path my_text_document --lr 1e-4 --train-iters 100",
        {"hidden_size": 1024, "num_attention_heads": 16, "seq_length": 2048,
         "lr": 1e-4, "train_iters": 100, "vocab_file": "gpt2-vocab.json"},
    ),
    (
        "pretrain_gpt.py --num-layers=16 --hidden-size=512 "
        "--num-attention-heads=8 --seq-length=1024 --max-position-embeddings=1024 "
        "--pipeline-model-parallel-size=2 "
        "--pipeline-model-parallel-layout='Et*8|t*8L' --micro-batch-size=2 "
        "--global-batch-size=64 --use-tp-pp-dp-mapping --tokenizer-type "
        "NullTokenizer --vocab-size 32000 --mock-data --lr=2e-4 --train-iters=50",
        {"hidden_size": 512, "num_attention_heads": 8, "seq_length": 1024,
         "lr": 2e-4, "train_iters": 50, "mock_data": True},
    ),
]  # fmt: skip


@dataclasses.dataclass
class Case:
    """One export to build: the plan, what it was priced with, and for a
    ``--megatron-args`` export the user's command and what it must keep."""

    name: str
    plan: Any
    hosts: dict[str, int]
    targets: tuple[str, ...] = TARGETS
    options: TrainingOptions | None = None
    spec: Any = None
    seq_length: int | None = None
    megatron_args: str | None = None
    user: dict | None = None

    def options_for(self, target: str) -> TrainingOptions | None:
        if self.options is None and self.spec is not None and not self.megatron_args:
            return MODEL_OPTIONS[target]
        return self.options


def _two_stages(spec, name: str, tp: int, dp: int):
    layers = spec.num_profile_layers
    cut = layers // 2 if tp == 1 else layers // 3
    return plan_from_stages(
        [(0, cut, tp), (cut, layers, tp)],
        gpu_type="GH-96", dp=dp, mbs=1, gbs=16 * dp, model=name,
        gpus_per_node=4, zone="z",
    )  # fmt: skip


def reviewed_plan():
    return plan_from_stages(
        [(a, b, 4) for a, b in zip(REVIEWED, REVIEWED[1:], strict=False)],
        gpu_type="GH-96", dp=1, mbs=1, gbs=256, model="LLAMA-3-8",
        gpus_per_node=4, zone="z",
    )  # fmt: skip


def model_cases() -> list[Case]:
    """The model cases (module docstring)."""
    from pipedejavu.cli.megatron import export_model
    from pipedejavu.io.model_config import list_model_presets, load_model_spec
    from pipedejavu.planning.plan_model import plan_model

    out = []
    for name in list_model_presets():
        spec = load_model_spec(name)
        if spec.position == "alibi" or not spec.is_dense:  # no MoE flags yet
            continue
        for tp, dp in ((1, 1), (2, 2)):
            plan = _two_stages(spec, name, tp, dp)
            out.append(Case(f"{name} tp {tp} dp {dp}", plan, {"GH-96": 4}, spec=spec))
    llama = load_model_spec("LLAMA-3-8")
    out.append(Case("LLAMA-3-8 reviewed plan", reviewed_plan(), {"GH-96": 4},
                    spec=llama))  # fmt: skip
    for target in TARGETS:
        best = plan_model("LLAMA-3-8", {"GH-96": 32}, 256, export=target)
        spec, _ = export_model(best.choice)
        out.append(
            Case(
                f"plan LLAMA-3-8 GH-96:32 gbs 256 --export {target}",
                best.result.plan,
                {"GH-96": 4},
                targets=(target,),
                options=best.result.options,
                spec=spec,
            )
        )
    return out


def megatron_args_cases(plans: int) -> list[Case]:
    """Each user command on the first ``plans`` seeded random plans and on the
    reviewed plan (with its model's training options)."""
    out = []
    for index, (command, user) in enumerate(USER_COMMANDS):
        for seed in range(plans):
            plan = rules.random_plan(seed)
            out.append(Case(f"command {index} seed {seed}", plan, rules.HOSTS,
                            targets=("megatron",), megatron_args=command,
                            user=user))  # fmt: skip
        out.append(Case(f"command {index} reviewed plan", reviewed_plan(),
                        {"GH-96": 4}, targets=("megatron",),
                        options=MODEL_OPTIONS["megatron"], megatron_args=command,
                        user=user))  # fmt: skip
    return out


def megatron_deepspeed_knob_cases() -> list[Case]:
    """Even plans over Megatron-DeepSpeed's knobs, and the knobs it refuses."""
    even = knob_rules.even_plan
    out = []
    for ranks in (2, 3, 4, 8):
        for count in sorted({1, 2, ranks - 1, ranks, ranks + 1, 2 * ranks + 1}):
            for tp, options in (
                (1, TrainingOptions("bf16", zero_bubble=True, recompute="full")),
                (2, TrainingOptions(zero_bubble=True, flash_attention=False)),
                (1, TrainingOptions("fp16", zero_bubble=True)),
                (2, TrainingOptions("bf16", recompute="full")),
                (1, TrainingOptions(flash_attention=False, attention_dropout=True)),
            ):
                plan = even(ranks, 2, tp=tp, num_microbatches=count)
                name = f"P {ranks} M {count} tp {tp} {options}"
                out.append(
                    Case(
                        name,
                        plan,
                        {"B-80": 8},
                        targets=("megatron-deepspeed",),
                        options=options,
                    )
                )
    refused = [
        (even(2, 4, tp=2), TrainingOptions("bf16", sequence_parallel=True)),
        (even(2, 4), TrainingOptions(recompute="selective")),
        (even(2, 4), TrainingOptions(recompute="full", recompute_num_layers=2)),
        (even(4, 4), TrainingOptions(virtual_stages=2)),
    ]  # fmt: skip
    out += [Case(f"refused {o}", p, {"B-80": 8}, targets=("megatron-deepspeed",),
                 options=o) for p, o in refused]  # fmt: skip
    return out


def megatron_deepspeed_case(case: Case, text: str) -> dict:
    """One export for ``check_megatron_deepspeed.py``."""
    plan, spec = case.plan, case.spec
    options = case.options_for("megatron-deepspeed")
    blocks, last = num_blocks(plan, spec), plan.num_layers - 1
    where = {"_to_float16": 0, "embedding": 0, "final_norm": blocks + 1,
             "head": last, "float16_to_fp32": last}  # fmt: skip
    where |= {f"transformer.{i}": i + 1 for i in range(blocks)}
    structure = []
    if spec is not None and spec.norm == "rmsnorm":
        structure += ["--normalization", "rmsnorm"]
    if spec is not None and not spec.tied_embeddings:
        structure.append("--untie-embeddings-and-output-weights")
    return {
        "name": case.name,
        "export": text,
        "options": {
            "precision": options.precision if options else "fp32",
            "recompute": options.recompute if options else "none",
            "zero_bubble": bool(options and options.zero_bubble),
            "flash_attention": bool(options and options.flash_attention),
        },
        "plan": {
            "stages": [[s.start, s.stop] for s in plan.stages],
            "dp": plan.dp,
            "mbs": plan.mbs,
            "gbs": plan.gbs,
            "microbatches": plan.num_microbatches,
            "blocks": blocks,
        },
        "seq_length": case.seq_length or (spec.seq_length if spec else None),
        "structure": structure,
        "profile_of_name": where,
    }


def run_megatron_deepspeed(source: Path, cases: list[dict], zbh1: list) -> dict:
    """``check_megatron_deepspeed.py`` on ``cases`` (and the ZB-H1 orders of
    ``zbh1``'s ``[P, M]``) in a process with the Megatron-DeepSpeed source
    ``source`` first on its path (not Megatron-LM's)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(source).resolve()), str(ROOT)])
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "check_megatron_deepspeed.py")],
        input=json.dumps({"cases": cases, "zbh1": zbh1}),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(
            f"check_megatron_deepspeed.py exited {done.returncode}: "
            + done.stderr[-2000:]
        )
    return json.loads(lines[-1])
