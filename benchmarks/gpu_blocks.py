"""The analytical layer cost model against a real GPU: one transformer block.

Times the forward and the backward pass of one Megatron-style GPT block in
PyTorch on the GPU this runs on, and compares each with what the analytical
cost model (:func:`pipedejavu.costmodel.analytical.layers.analytical_layer_times`,
``tp = 1``, layer 1) predicts from the GPU's datasheet entry, with the
constants the planner uses for that precision (``HALF_PRECISION_ANALYTICAL``
for bf16, ``FITTED_ANALYTICAL`` for fp32) and no refitting.

The block runs the kernels of Megatron-LM's local (non-Transformer-Engine) GPT
layer, in eager PyTorch, in Megatron's order: pre-norm (LayerNorm, or RMSNorm
for llama-style blocks), the QKV projection, the attention core (flash:
``scaled_dot_product_attention`` restricted to the flash backend; unfused:
``baddbmm`` scores with the scale, an in-place causal ``masked_fill_``,
softmax, an optional dropout, ``bmm``, the context's layout copy), the output
projection, dropout and residual add, the second norm, the MLP (GeLU or
SwiGLU), dropout and residual add; rotary embeddings (unfused) on the llama
style; fp32 ``main_grad`` accumulation hooks as Megatron's DDP registers them.
``OP_DIFFERENCES`` lists where this differs from the model's operation list.

Each rep: synchronize, queue a GPU sleep long enough for the CPU to enqueue the
whole step (so launch gaps do not count), then CUDA events around the forward
and around the backward of the same step: both are timed directly, neither is
a difference. The CPU time to enqueue each pass is recorded beside it
(``launch_bound`` where it exceeds the GPU time: without the sleep, that pass
would wait on the CPU). Results are written to ``--out`` after every config.

``--split`` also times the zero-bubble (ZB-H1) split of the same backward:
each rep after the full step runs a second step whose backward is
``torch.autograd.grad(out, [x], grad_outputs=grad_out)``, the block input
``x`` alone requested, between the same CUDA events (after the same queued
sleep). That is the input-gradient pass B; W = full backward - B (medians) and
its share W / backward are set beside the model's B, W and share
(:func:`~pipedejavu.costmodel.analytical.layers.weight_gradient_seconds`; B is
the layer backward less W), with the median and max |predicted - measured
share| in percentage points per group and the median |error| of W and of B
(``split`` per row and ``split_summary`` in the JSON). PyTorch skips the
weight gradients in that pass: with ``inputs`` given, the engine fills its
graph task's ``exec_info`` with the nodes on a path to them
(``torch/csrc/autograd/graph_task.h``), the ``AccumulateGrad`` nodes of the
weights do not run (so neither do the ``main_grad`` hooks), and each backward
formula asks ``task_should_compute_output`` (``torch/csrc/autograd/node.h``)
before computing a weight's gradient. Checked on the CPU with torch 2.14.1 on
every smoke block: ``torch.utils.flop_counter`` counts exactly half the
linear layers' ``aten::mm`` FLOPs (the dgrad GEMMs) and all of the unfused
attention core's ``aten::bmm`` FLOPs (dQ, dK, dS, dV are input gradients);
the profiler shows none of the bias column sums (``aten::sum`` 4 -> 0 on a gpt
block), none of the RMSNorm weight reductions (``aten::sum`` 4 -> 2 on a
llama block; LayerNorm gets ``grad_input_mask`` from the same check) and none
of the ``main_grad.add_`` calls: the hooks fire 0 times (12 in the full
backward of a gpt block). Every ``--split`` row records the same FLOP counts
of one full and one input-only backward (``split.measured.flops``) on the
device it runs on. ``SPLIT_DIFFERENCES`` lists where the measured split is not
the model's.

Usage::

    PYTHONPATH=. PYTHONDONTWRITEBYTECODE=1 python benchmarks/gpu_blocks.py \
        --out benchmarks/results/gpu_blocks.json
    PYTHONPATH=. python benchmarks/gpu_blocks.py --out smoke.json --smoke
    PYTHONPATH=. python benchmarks/gpu_blocks.py --split \
        --out benchmarks/results/gpu_zero_bubble_split.json

The default grid is estimated at about two minutes on an H100 (printed before
the run), two and a half with ``--split``; ``--budget-s`` (210 s from the start)
skips what would not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

try:  # The grid, the predictions and the summary need no torch.
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None
    F = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stamp  # noqa: E402

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.transformer import TransformerSpec
from pipedejavu.costmodel.analytical.layers import (
    activation_bytes,
    analytical_layer_times,
    is_weight_gradient,
    weight_gradient_seconds,
)
from pipedejavu.costmodel.analytical.ops import (
    Gemm,
    PassOptions,
    block_backward_ops,
    block_forward_ops,
)
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    HALF_PRECISION_ANALYTICAL,
    AnalyticalConstants,
    pass_seconds,
)
from pipedejavu.io.gpu_sheet import load_gpu_sheet

#: Where the torch block does not run the model's operation list exactly.
OP_DIFFERENCES = (
    "bias_dropout_add (both): Megatron fuses bias + dropout + residual add in "
    "one kernel (3 reads/writes of b s h + mask); here the bias is added in the "
    "GEMM's epilogue (F.linear), dropout is one kernel (read, write, mask) and "
    "the residual add another (2 reads, 1 write): 5 b s h + mask instead of 3 b "
    "s h + mask; with dropout 0 (llama style) only the add runs and no mask",
    "swiglu: chunk, silu and multiply are two kernels (5 f instead of 3 f "
    "forward; backward about 13 f with the chunk's concatenation instead of "
    "5 f)",
    "gelu: tanh GeLU is one kernel as counted (bias in the GEMM epilogue)",
    "unfused attention in bf16: masked_fill_ and softmax are two kernels "
    "(Megatron's fused scaled-upper-triangular softmax is one); in fp32 the "
    "model counts the same two passes",
    "qkv split: torch.split's backward concatenates dq, dk, dv into d(qkv) "
    "(one extra read and write of the QKV output; Megatron without Transformer "
    "Engine does the same); with grouped-query attention the query reshape "
    "copies it (as Megatron's) ",
    "flash attention: the flash backend of scaled_dot_product_attention "
    "(FlashAttention-2 in PyTorch), not Transformer Engine's kernel; with "
    "grouped-query attention enable_gqa (or, where unsupported, "
    "repeat_interleave of K and V, recorded per row)",
    "rotary embeddings (llama style): not in the model's list; applied to q "
    "and k unfused (multiply, rotate-half, multiply, add), as Megatron without "
    "rope fusion",
    "bias gradients (gpt style): a column sum of each output gradient per "
    "biased linear layer, not counted by the model",
    "grad_accumulate: main_grad.add_(grad) per parameter (fp32 main_grad read "
    "and written plus the gradient read: 10 bytes a parameter in bf16, 12 in "
    "fp32, where the model counts 8), Megatron's DDP without gradient "
    "accumulation fusion",
    "norms: F.layer_norm / F.rms_norm (fused kernels in recent PyTorch; an "
    "older F.rms_norm is several element-wise kernels)",
)

#: Where the measured B/W split (``--split``) is not the model's.
SPLIT_DIFFERENCES = (
    "bias gradients (gpt style): column sums of the output gradients, skipped "
    "in B, so measured in W; the model counts none",
    "norm weight gradients (LayerNorm gamma and beta, RMSNorm weight): the "
    "norm backward kernels compute them in the full backward and skip them in "
    "B, so their reductions land in the measured W; the model prices each "
    "norm backward as one B operation",
    "W = full backward - B of two separate steps: a zero-bubble runtime that "
    "runs W on its own re-reads the saved inputs and output gradients and "
    "launches its kernels separately, not measured here",
)

LAUNCH_FLOOR_S = 3e-3  # per timed step: the queued sleep and a synchronize
CONFIG_OVERHEAD_S = 0.6  # per config: weights, buffers, warm-up of new shapes
PROFILE_OVERHEAD_S = 3.0  # per profiled config (the profiler's start-up)
ESTIMATE_SLOWDOWN = 1.3  # measured / predicted assumed by the time estimate


# ------------------------------------------------------------------ the grid
@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One measured block.

    Args:
        style: ``gpt`` (LayerNorm, GeLU 4h MLP, multi-head attention, biases,
            hidden dropout 0.1) or ``llama`` (RMSNorm, SwiGLU, grouped-query
            attention, rotary embeddings, no biases, no dropout).
        hidden_size, num_heads, num_query_groups, ffn_hidden_size: the shape.
        seq_length, mbs: tokens per sample, samples per micro-batch.
        precision: ``bf16`` or ``fp32`` (our precision string; fp32 is fp32
            GEMMs on CUDA cores, TF32 off).
        flash_attention: fused attention (flash) or Megatron's unfused core.
        profile: also record a per-kernel profile of one step.
    """

    style: str
    hidden_size: int
    num_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    seq_length: int
    mbs: int
    precision: str
    flash_attention: bool
    profile: bool = False

    def __post_init__(self) -> None:
        if self.style not in ("gpt", "llama"):
            raise ValueError(f"style must be 'gpt' or 'llama', got {self.style!r}")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(
                f"precision must be bf16, fp16 or fp32, got {self.precision!r}"
            )

    @property
    def name(self) -> str:
        attention = "flash" if self.flash_attention else "unfused"
        return (
            f"{self.style}-h{self.hidden_size}-s{self.seq_length}-b{self.mbs}-"
            f"{self.precision}-{attention}"
        )

    @property
    def group(self) -> str:
        """What the summary groups by: precision and attention."""
        return f"{self.precision}-{'flash' if self.flash_attention else 'unfused'}"

    @property
    def hidden_dropout(self) -> float:
        return 0.1 if self.style == "gpt" else 0.0

    @property
    def rotary(self) -> bool:
        return self.style == "llama"

    def spec(self) -> TransformerSpec:
        gpt = self.style == "gpt"
        return TransformerSpec(
            name=self.name,
            num_layers=1,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=50304 if gpt else 128256,
            seq_length=self.seq_length,
            gated_mlp=not gpt,
            norm="layernorm" if gpt else "rmsnorm",
            position="learned" if gpt else "rotary",
            max_position_embeddings=self.seq_length if gpt else 0,
            tied_embeddings=gpt,
            linear_bias=gpt,
        )


def gpt_config(hidden, seq, mbs, precision, flash, *, head_dim=128, profile=False):
    heads = hidden // head_dim
    return BlockConfig(
        "gpt", hidden, heads, heads, 4 * hidden, seq, mbs, precision, flash, profile
    )


def llama_config(hidden, seq, mbs, *, ffn, heads, groups, profile=False):
    return BlockConfig(
        "llama", hidden, heads, groups, ffn, seq, mbs, "bf16", True, profile
    )


def gpt_shapes() -> list[tuple[int, int, int]]:
    """(hidden, seq, mbs) of the GPT-style grid."""
    return [
        (hidden, seq, mbs)
        for hidden in (1024, 2048, 4096, 8192)
        for seq in ((1024, 2048, 4096) if hidden <= 4096 else (1024, 2048))
        for mbs in (1, 2, 4)
    ]


def default_grid() -> list[BlockConfig]:
    """The GPU grid, most informative first (``--budget-s`` cuts its tail)."""
    grid = [
        gpt_config(h, s, b, "bf16", True, profile=(h, s, b) == (4096, 2048, 1))
        for h, s, b in gpt_shapes()
    ]
    for hidden, ffn in ((4096, 14336), (8192, 28672)):
        for seq in (2048, 4096):
            for mbs in (1, 2):
                grid.append(
                    llama_config(
                        hidden,
                        seq,
                        mbs,
                        ffn=ffn,
                        heads=hidden // 128,
                        groups=8,
                        profile=(hidden, seq, mbs) == (4096, 4096, 1),
                    )
                )
    for h, s, b in (
        (1024, 4096, 1),
        (2048, 1024, 1),
        (2048, 2048, 2),
        (4096, 2048, 1),
        (8192, 2048, 1),
    ):
        grid.append(
            gpt_config(h, s, b, "bf16", False, profile=(h, s, b) == (4096, 2048, 1))
        )
    # fp32 GEMMs run on CUDA cores (~15x slower than bf16): last, so that the
    # budget cuts its largest configs first.
    grid += [
        gpt_config(h, s, b, "fp32", False, profile=(h, s, b) == (2048, 2048, 1))
        for h, s, b in gpt_shapes()
    ]
    return grid


def smoke_grid() -> list[BlockConfig]:
    """Tiny blocks for a CPU run of the whole path."""
    grid = []
    for hidden, seq in ((64, 32), (128, 64)):
        grid.append(gpt_config(hidden, seq, 2, "bf16", True, head_dim=32))
    grid.append(gpt_config(64, 32, 1, "bf16", False, head_dim=32, profile=True))
    grid.append(gpt_config(128, 64, 1, "fp32", False, head_dim=32, profile=True))
    grid.append(llama_config(128, 64, 2, ffn=352, heads=4, groups=2, profile=True))
    return grid


# ------------------------------------------------------------ the prediction
def constants_for(precision: str) -> tuple[str, AnalyticalConstants]:
    """The constants the planner prices ``precision`` with (AnalyticalSource)."""
    if precision in ("fp16", "bf16", "fp8"):
        return "HALF_PRECISION_ANALYTICAL", HALF_PRECISION_ANALYTICAL
    return "FITTED_ANALYTICAL", FITTED_ANALYTICAL


def constants_record() -> dict[str, Any]:
    """Which constants price each precision, and their values (for a results
    file)."""
    return {
        "bf16": "HALF_PRECISION_ANALYTICAL",
        "fp32": "FITTED_ANALYTICAL",
        "values": {
            "HALF_PRECISION_ANALYTICAL": dataclasses.asdict(HALF_PRECISION_ANALYTICAL),
            "FITTED_ANALYTICAL": dataclasses.asdict(FITTED_ANALYTICAL),
        },
    }


def results_header(env: dict[str, Any], gpu: GpuSheetEntry) -> dict[str, Any]:
    """The fields a GPU results file opens with: date, machine, environment,
    the sheet entry it priced with and the constants
    (:func:`constants_record`)."""
    return {
        "date": stamp.now(),
        "machine": f"{env['device_name']}, {env['host']} ({env['cpu']})",
        "environment": env,
        "gpu_sheet_entry": dataclasses.asdict(gpu),
        "constants": constants_record(),
    }


def predict(config: BlockConfig, gpu: GpuSheetEntry) -> dict[str, Any]:
    """The model's block forward and backward on ``gpu`` (tp 1), in ms, with
    the time of each operation, the GEMM FLOPs and the activation bytes."""
    spec = config.spec()
    name, constants = constants_for(config.precision)
    forward, backward, _ = analytical_layer_times(
        spec,
        gpu,
        config.mbs,
        1,
        config.precision,
        flash_attention=config.flash_attention,
        attention_dropout=False,
        constants=constants,
    )
    opts = PassOptions(config.mbs, 1, config.precision, config.flash_attention)
    passes = {
        "forward": block_forward_ops(spec, opts),
        "backward": block_backward_ops(spec, opts),
    }
    return {
        "forward_ms": 1e3 * float(forward[1]),
        "backward_ms": 1e3 * float(backward[1]),
        "constants": name,
        "ops_ms": {
            key: [[op.name, 1e3 * pass_seconds([op], gpu, constants)] for op in ops]
            for key, ops in passes.items()
        },
        "gemm_flops": {
            key: sum(op.flops for op in ops if isinstance(op, Gemm))
            for key, ops in passes.items()
        },
        "activation_bytes": float(
            activation_bytes(
                spec,
                config.mbs,
                1,
                config.precision,
                flash_attention=config.flash_attention,
                attention_dropout=False,
            )[1]
        ),
    }


def predict_split(config: BlockConfig, gpu: GpuSheetEntry) -> dict[str, Any]:
    """The model's zero-bubble split of the block backward on ``gpu`` (tp 1):
    W from ``weight_gradient_seconds`` (layer 1), B = backward - W, in ms, W's
    share of the backward, W's operations and its GEMM FLOPs."""
    spec = config.spec()
    _, constants = constants_for(config.precision)
    kwargs = {
        "flash_attention": config.flash_attention,
        "attention_dropout": False,
        "constants": constants,
    }
    _, backward, _ = analytical_layer_times(
        spec, gpu, config.mbs, 1, config.precision, **kwargs
    )
    weight = weight_gradient_seconds(
        spec, gpu, config.mbs, 1, config.precision, **kwargs
    )
    opts = PassOptions(config.mbs, 1, config.precision, config.flash_attention)
    ops = [op for op in block_backward_ops(spec, opts) if is_weight_gradient(op)]
    backward_ms, weight_ms = 1e3 * float(backward[1]), 1e3 * float(weight[1])
    return {
        "backward_ms": backward_ms,
        "input_backward_ms": backward_ms - weight_ms,
        "weight_gradient_ms": weight_ms,
        "weight_gradient_share": weight_ms / backward_ms,
        "weight_gradient_ops_ms": [
            [op.name, 1e3 * pass_seconds([op], gpu, constants)] for op in ops
        ],
        "weight_gradient_gemm_flops": sum(
            op.flops for op in ops if isinstance(op, Gemm)
        ),
    }


def estimate_seconds(
    prediction: dict[str, Any],
    config: BlockConfig,
    warmup: int,
    reps: int,
    min_reps: int,
    config_s: float,
    *,
    split: dict[str, Any] | None = None,
) -> float:
    """Wall seconds one config is expected to take on the GPU; with ``split``
    (:func:`predict_split`), the input-gradient steps too: one FLOP-counted
    full step and input-gradient step, then one input-gradient step per rep."""
    step = (
        ESTIMATE_SLOWDOWN * (prediction["forward_ms"] + prediction["backward_ms"]) / 1e3
        + LAUNCH_FLOOR_S
    )
    timed = max(min_reps, min(reps, int(config_s / step)))
    profile = PROFILE_OVERHEAD_S + 2 * step if config.profile else 0.0
    extra = 0.0
    if split is not None:
        input_step = (
            ESTIMATE_SLOWDOWN
            * (prediction["forward_ms"] + split["input_backward_ms"])
            / 1e3
            + LAUNCH_FLOOR_S
        )
        extra = step + (1 + timed) * input_step
    return CONFIG_OVERHEAD_S + (warmup + timed) * step + profile + extra


# --------------------------------------------------------------- the device
#: (substrings all in the device name, the sheet entry), first match wins.
DEVICE_NAMES = (
    (("GH200",), "GH-96"),
    (("H200",), "H200"),
    (("H800",), "H800"),
    (("H100", "PCIE"), "H100-PCIe"),
    (("H100", "SXM"), "H100-SXM"),
    (("H100", "HBM3"), "H100-SXM"),
    (("A100", "80GB"), "A100-80"),
    (("A100", "40GB"), "A100-40"),
    (("L40S",), "L40S"),
    (("L4",), "L4"),
    (("4090",), "RTX-4090"),
    (("3090",), "RTX-3090"),
    (("V100", "32GB"), "V100-32"),
    (("V100", "16GB"), "V100-16"),
    (("MI300X",), "MI300X"),
    (("MI250X",), "MI250X"),
)


def sheet_name_for(device_name: str) -> str | None:
    """The GPU-sheet entry of a ``torch.cuda.get_device_name()``; ``None``
    where no entry fits (then ``--gpu`` must name one)."""
    upper = device_name.upper().replace("-", " ")
    for parts, entry in DEVICE_NAMES:
        if all(part in upper for part in parts):
            return entry
    return None


def _nvidia_smi() -> dict[str, str]:
    fields = "name,driver_version,clocks.max.sm,power.limit,memory.total"
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as error:
        return {"error": f"nvidia-smi: {error}"}
    values = (v.strip() for v in line.split(","))
    return dict(zip(fields.split(","), values, strict=False))


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
        "host": platform.node(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device_name=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            multiprocessors=props.multi_processor_count,
            memory_bytes=props.total_memory,
            cudnn=torch.backends.cudnn.version(),
            nvidia_smi=_nvidia_smi(),
            matmul_allow_tf32=_read_flag(lambda: torch.backends.cuda.matmul.allow_tf32),
            float32_matmul_precision=_read_flag(torch.get_float32_matmul_precision),
            matmul_bf16_reduced_precision_reduction=_read_flag(
                lambda: (
                    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
                )
            ),
        )
        env["driver"] = env["nvidia_smi"].get("driver_version")
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()})"
    return env


def _configure_torch() -> list[str]:
    """fp32 GEMMs in full fp32 (our ``fp32``: CUDA cores, TF32 off); returns
    the settings that failed (an API PyTorch changed)."""
    failed = []
    for name, set_fn in (
        (
            "float32_matmul_precision",
            lambda: torch.set_float32_matmul_precision("highest"),
        ),
        (
            "matmul.allow_tf32",
            lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False),
        ),
        (
            "cudnn.allow_tf32",
            lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
        ),
    ):
        try:
            set_fn()
        except Exception as error:  # pragma: no cover - depends on the version
            failed.append(f"{name}: {error}")
    return failed


def _read_flag(read_fn: Callable[[], Any]) -> Any:
    try:
        return read_fn()
    except Exception as error:  # pragma: no cover - depends on the version
        return f"unreadable: {error}"


# ------------------------------------------------------------ the torch block
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def init_block(config: BlockConfig, device: str, seed: int) -> dict[str, Any]:
    """Weights (normal, std 0.02; norms 1, biases 0), fp32 ``main_grad``
    buffers with Megatron DDP's accumulation hooks, and the step's tensors."""
    torch.manual_seed(seed)
    dtype = getattr(torch, _DTYPES[config.precision])
    h, f = config.hidden_size, config.ffn_hidden_size
    d = h // config.num_heads
    qkv_out = (config.num_heads + 2 * config.num_query_groups) * d
    up = 2 * f if config.style == "llama" else f
    bias = config.style == "gpt"
    shapes = {
        "qkv_w": (qkv_out, h),
        "proj_w": (h, h),
        "fc1_w": (up, h),
        "fc2_w": (h, f),
    }
    params = {
        name: torch.randn(shape, device=device, dtype=dtype) * 0.02
        for name, shape in shapes.items()
    }
    for norm in ("norm1", "norm2"):
        params[f"{norm}_w"] = torch.ones(h, device=device, dtype=dtype)
        if bias:
            params[f"{norm}_b"] = torch.zeros(h, device=device, dtype=dtype)
    if bias:
        for name, size in (
            ("qkv_b", qkv_out),
            ("proj_b", h),
            ("fc1_b", up),
            ("fc2_b", h),
        ):
            params[name] = torch.zeros(size, device=device, dtype=dtype)
    for param in params.values():
        param.requires_grad_(True)
        param.main_grad = torch.zeros(param.shape, device=device, dtype=torch.float32)
        param.register_post_accumulate_grad_hook(_accumulate_main_grad)
    s, b = config.seq_length, config.mbs
    # Megatron's [s, b, h] where its unfused core needs it (views, no copies);
    # [b, s, h] for flash, whose output then needs no layout copy (as TE's).
    shape = (b, s, h) if config.flash_attention else (s, b, h)
    state: dict[str, Any] = {"params": params}
    state["x"] = torch.randn(shape, device=device, dtype=dtype).requires_grad_(True)
    state["grad_out"] = torch.randn(shape, device=device, dtype=dtype)
    if not config.flash_attention:
        state["mask"] = torch.ones(s, s, device=device, dtype=torch.bool).triu_(1)[
            None, None
        ]
        state["scores_buffer"] = torch.empty(
            b * config.num_heads, s, s, device=device, dtype=dtype
        )
    if config.rotary:
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=device).float() / d)
        angles = torch.outer(torch.arange(s, device=device).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)  # [s, d]
        # Broadcast over the [s, b, heads, d] or [b, s, heads, d] layout.
        view = (1, s, 1, d) if config.flash_attention else (s, 1, 1, d)
        state["cos"] = angles.cos().to(dtype).view(view)
        state["sin"] = angles.sin().to(dtype).view(view)
    return state


def _accumulate_main_grad(param) -> None:
    # Megatron's DDP hook (without gradient-accumulation fusion).
    param.main_grad.add_(param.grad)
    param.grad = None


def _norm(x, params, prefix: str, config: BlockConfig):
    h = config.hidden_size
    if config.style == "gpt":
        return F.layer_norm(x, (h,), params[f"{prefix}_w"], params[f"{prefix}_b"])
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (h,), params[f"{prefix}_w"], eps=1e-5)
    variance = x.float().pow(2).mean(-1, keepdim=True)  # pragma: no cover
    return (x.float() * torch.rsqrt(variance + 1e-5)).to(x.dtype) * params[
        f"{prefix}_w"
    ]


def _rotate(t, state):
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * state["cos"] + rotated * state["sin"]


def _dropout_add(x, residual, p: float):
    if p > 0:
        x = F.dropout(x, p=p, training=True)
    return residual + x


def _attention(qkv, config: BlockConfig, state: dict[str, Any], gqa: str):
    """Megatron's split of the fused QKV output, then the attention core."""
    heads, groups = config.num_heads, config.num_query_groups
    d = config.hidden_size // heads
    d0, d1 = qkv.shape[0], qkv.shape[1]
    mixed = qkv.view(d0, d1, groups, (heads // groups + 2) * d)
    query, key, value = torch.split(mixed, [heads // groups * d, d, d], dim=3)
    query = query.reshape(d0, d1, heads, d)
    if config.rotary:
        query, key = _rotate(query, state), _rotate(key, state)
    if config.flash_attention:  # [b, s, heads, d] -> [b, heads, s, d] views
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        kwargs = {}
        if groups < heads and gqa == "enable_gqa":
            kwargs["enable_gqa"] = True
        elif groups < heads:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        with _sdpa_backends(state):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        return out.transpose(1, 2).reshape(d0, d1, config.hidden_size)
    s, b = d0, d1  # Megatron's unfused DotProductAttention, [s, b, ...]
    if groups < heads:
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
    query = query.reshape(s, b * heads, d)
    key = key.reshape(s, b * heads, d)
    scores = torch.baddbmm(
        state["scores_buffer"],
        query.transpose(0, 1),
        key.transpose(0, 1).transpose(1, 2),
        beta=0.0,
        alpha=1.0 / math.sqrt(d),
    ).view(b, heads, s, s)
    probs = torch.softmax(scores.masked_fill_(state["mask"], -10000.0), dim=-1)
    context = torch.bmm(
        probs.view(b * heads, s, s), value.reshape(s, b * heads, d).transpose(0, 1)
    )
    context = context.view(b, heads, s, d).permute(2, 0, 1, 3).contiguous()
    return context.view(s, b, config.hidden_size)


def _sdpa_backends(state: dict[str, Any]):
    """``sdpa_kernel`` with the step's backends (flash only, unless it fell
    back); no restriction where ``state`` names none."""
    backends = state.get("sdpa_backends")
    if not backends:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def block_forward(config: BlockConfig, state: dict[str, Any]):
    """One block's forward on ``state["x"]``: the output, same shape."""
    p, x = state["params"], state["x"]
    gqa = state.get("gqa", "enable_gqa")
    hidden = _norm(x, p, "norm1", config)
    qkv = F.linear(hidden, p["qkv_w"], p.get("qkv_b"))
    context = _attention(qkv, config, state, gqa)
    x = _dropout_add(
        F.linear(context, p["proj_w"], p.get("proj_b")), x, config.hidden_dropout
    )
    hidden = _norm(x, p, "norm2", config)
    up = F.linear(hidden, p["fc1_w"], p.get("fc1_b"))
    if config.style == "llama":
        gate, value = torch.chunk(up, 2, dim=-1)
        act = F.silu(gate) * value
    else:
        act = F.gelu(up, approximate="tanh")
    return _dropout_add(
        F.linear(act, p["fc2_w"], p.get("fc2_b")), x, config.hidden_dropout
    )


def _step(config: BlockConfig, state: dict[str, Any]) -> None:
    state["x"].grad = None
    block_forward(config, state).backward(state["grad_out"])


def choose_attention(
    config: BlockConfig, state: dict[str, Any], backend: str = "flash"
) -> dict[str, str]:
    """Run one step with one fused backend only (``flash``: FlashAttention-2;
    ``cudnn``: cuDNN's fused attention) and ``enable_gqa``; fall back to
    ``repeat_interleave`` of K and V, then to any backend. Returns what ran."""
    if not config.flash_attention:
        state["sdpa_backends"] = None
        return {"attention": "unfused (baddbmm, masked_fill_, softmax, bmm)"}
    from torch.nn.attention import SDPBackend

    chosen = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[backend]
    tries = [([chosen], "enable_gqa")]
    if config.num_query_groups < config.num_heads:
        tries.append(([chosen], "repeat_interleave"))
    tries.append((None, "enable_gqa"))
    errors = []
    for backends, gqa in tries:
        state["sdpa_backends"], state["gqa"] = backends, gqa
        try:
            _step(config, state)
        except (RuntimeError, TypeError) as error:  # TypeError: no enable_gqa
            if "out of memory" in str(error).lower():
                raise
            errors.append(f"{backends} {gqa}: {str(error).splitlines()[0][:200]}")
            continue
        name = backend if backends else f"default sdpa backends ({backend} refused)"
        out = {"attention": name}
        if config.num_query_groups < config.num_heads:
            out["gqa"] = gqa
        if errors:
            out["fallback_errors"] = errors
        return out
    raise RuntimeError("no attention backend ran: " + " | ".join(errors))


# ----------------------------------------------------------------- measuring


def calibrate_sleep() -> float | None:
    """Cycles per millisecond of ``torch.cuda._sleep`` (``None``: no sleep)."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    cycles = 20_000_000
    best = math.inf
    for _ in range(3):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return cycles / best if best > 0 else None


class Timer:
    """Forward and backward times of one step: CUDA events on a GPU (after a
    queued sleep), ``perf_counter`` on the CPU; CPU enqueue time beside."""

    def __init__(self, device: str):
        self.device = device
        self.cycles_per_ms = calibrate_sleep() if device == "cuda" else None

    def step(
        self,
        config: BlockConfig,
        state: dict[str, Any],
        sleep_ms: float = 0.0,
        *,
        input_only: bool = False,
    ) -> tuple[float, float, float, float]:
        """``(forward_ms, backward_ms, forward_cpu_ms, backward_cpu_ms)``; with
        ``input_only`` the backward is the input-gradient pass B alone."""
        state["x"].grad = None
        backward = _input_backward if input_only else _full_backward
        if self.device != "cuda":
            t0 = time.perf_counter()
            out = block_forward(config, state)
            t1 = time.perf_counter()
            backward(out, state)
            t2 = time.perf_counter()
            return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t1 - t0), 1e3 * (t2 - t1)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        if self.cycles_per_ms and sleep_ms > 0:
            torch.cuda._sleep(int(sleep_ms * self.cycles_per_ms))
        events[0].record()
        t0 = time.perf_counter()
        out = block_forward(config, state)
        t1 = time.perf_counter()
        events[1].record()
        backward(out, state)
        t2 = time.perf_counter()
        events[2].record()
        del out
        torch.cuda.synchronize()
        return (
            events[0].elapsed_time(events[1]),
            events[1].elapsed_time(events[2]),
            1e3 * (t1 - t0),
            1e3 * (t2 - t1),
        )


def _full_backward(out, state: dict[str, Any]) -> None:
    out.backward(state["grad_out"])


def _input_backward(out, state: dict[str, Any]) -> None:
    # The block input alone requested: autograd prunes the weights' gradients
    # (their GEMMs, the AccumulateGrad nodes and so the main_grad hooks).
    torch.autograd.grad(out, [state["x"]], grad_outputs=state["grad_out"])


def count_backward_flops(config: BlockConfig, state: dict[str, Any]) -> dict:
    """FLOPs by operator (``torch.utils.flop_counter``) of one full backward
    and one input-gradient backward: ``{"backward": {op: flops}, ...}``."""
    from torch.utils.flop_counter import FlopCounterMode

    counts = {}
    for key, backward in (
        ("backward", _full_backward),
        ("input_backward", _input_backward),
    ):
        state["x"].grad = None
        out = block_forward(config, state)
        with FlopCounterMode(display=False) as counter:
            backward(out, state)
        del out
        flops = counter.get_flop_counts().get("Global", {})
        counts[key] = {str(op): int(value) for op, value in flops.items()}
    return counts


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values)}


def profile_kernels(config: BlockConfig, state: dict[str, Any], device: str) -> dict:
    """The kernels (GPU) or the ATen operators (CPU) of one forward and one
    backward: ``{pass: {"kernels": [[name, count, ms], ...], ...}}``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    result = {}
    for phase in ("forward", "backward"):
        state["x"].grad = None
        out = None
        if phase == "backward":
            out = block_forward(config, state)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[activity]) as prof:
            if phase == "forward":
                out = block_forward(config, state)
            else:
                out.backward(state["grad_out"])
            if cuda:
                torch.cuda.synchronize()
        del out
        rows = []
        for event in prof.key_averages():
            if cuda:
                if "cuda" not in str(getattr(event, "device_type", "")).lower():
                    continue
                us = getattr(event, "self_device_time_total", None)
                if us is None:
                    us = getattr(event, "self_cuda_time_total", 0.0)
            else:
                if not event.key.startswith("aten::"):
                    continue
                us = event.self_cpu_time_total
            rows.append([event.key[:160], int(event.count), us / 1e3])
        rows.sort(key=lambda row: -row[2])
        result[phase] = {
            "num_kernels": sum(row[1] for row in rows),
            "total_ms": sum(row[2] for row in rows),
            "kernels": rows[:40],
        }
    return result


def measure(
    config: BlockConfig,
    device: str,
    timer: Timer,
    *,
    warmup: int,
    reps: int,
    min_reps: int,
    config_s: float,
    seed: int,
    split: bool = False,
    attention: str = "flash",
) -> dict[str, Any]:
    """Build the block, warm it up, time it, profile it if asked, free it;
    with ``split``, also count the FLOPs of both backwards and time an
    input-gradient step after each full step (under ``"split"``)."""
    state = init_block(config, device, seed)
    try:
        out: dict[str, Any] = choose_attention(config, state, attention)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        cpu_ms = 0.0
        activation = None
        for index in range(warmup):
            if index == 0 and device == "cuda":
                # The bytes the forward keeps for the backward (its output
                # included), against the model's activation bytes.
                state["x"].grad = None
                before = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                result = block_forward(config, state)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                activation = torch.cuda.memory_allocated() - before
                t2 = time.perf_counter()
                result.backward(state["grad_out"])
                cpu_ms = 1e3 * (t1 - t0 + time.perf_counter() - t2)
                del result
                continue
            _, _, fwd_cpu, bwd_cpu = timer.step(config, state)
            cpu_ms = max(cpu_ms, fwd_cpu + bwd_cpu)
        if device == "cuda":
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - started) / max(warmup, 1)
        count = max(min_reps, min(reps, int(config_s / max(step_s, 1e-9))))
        sleep_ms = min(max(2.0 * cpu_ms, 1.0), 200.0)
        split_out: dict[str, Any] = {}
        if split:  # also the input-gradient pass's warm-up
            try:
                split_out["flops"] = count_backward_flops(config, state)
            except Exception as error:  # the count is a check, never fatal
                split_out["flops"] = {"error": f"{type(error).__name__}: {error}"}
        samples, input_samples = [], []
        for _ in range(count):
            samples.append(timer.step(config, state, sleep_ms))
            if split:
                input_samples.append(
                    timer.step(config, state, sleep_ms, input_only=True)
                )
        fwd, bwd, fwd_cpu, bwd_cpu = (
            list(column) for column in zip(*samples, strict=True)
        )
        out.update(
            status="ok",
            reps=count,
            queued_sleep_ms=sleep_ms if timer.cycles_per_ms else 0.0,
            forward_ms=_stats(fwd),
            backward_ms=_stats(bwd),
            forward_cpu_enqueue_ms=_stats(fwd_cpu),
            backward_cpu_enqueue_ms=_stats(bwd_cpu),
        )
        out["launch_bound"] = {
            "forward": out["forward_cpu_enqueue_ms"]["median"]
            > out["forward_ms"]["median"],
            "backward": out["backward_cpu_enqueue_ms"]["median"]
            > out["backward_ms"]["median"],
        }
        if device == "cuda":
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
            out["measured_activation_bytes"] = activation
        if split:
            input_bwd = [sample[1] for sample in input_samples]
            input_cpu = [sample[3] for sample in input_samples]
            split_out.update(
                reps=len(input_samples),
                input_backward_ms=_stats(input_bwd),
                input_backward_cpu_enqueue_ms=_stats(input_cpu),
                launch_bound=statistics.median(input_cpu)
                > statistics.median(input_bwd),
            )
            out["split"] = split_out
        if config.profile:
            try:
                out["profile"] = profile_kernels(config, state, device)
            except Exception as error:  # the profile is a bonus, never fatal
                out["profile"] = {"error": f"{type(error).__name__}: {error}"[:300]}
        return out
    finally:
        for param in state["params"].values():
            param.main_grad = None
        state.clear()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ results
def errors(row: dict[str, Any]) -> dict[str, float]:
    """Signed relative errors ``predicted / measured - 1`` (medians)."""
    pred, meas = row["predicted"], row["measured"]
    fwd, bwd = meas["forward_ms"]["median"], meas["backward_ms"]["median"]
    return {
        "forward": pred["forward_ms"] / fwd - 1.0,
        "backward": pred["backward_ms"] / bwd - 1.0,
        "forward_backward": (pred["forward_ms"] + pred["backward_ms"]) / (fwd + bwd)
        - 1.0,
    }


def _group_keys(config: dict[str, Any]) -> tuple[str, str, str]:
    attention = "flash" if config["flash_attention"] else "unfused"
    return "all", f"{config['precision']}-{attention}", f"style:{config['style']}"


def _summary_order(groups: dict[str, Any]) -> list[str]:
    # "all", then the precision-attention groups, then the styles.
    return sorted(groups, key=lambda k: (k != "all", k.startswith("style:"), k))


def summarize(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Median and max |error| of forward, backward and their sum: overall,
    per group (precision-attention) and per style."""
    groups: dict[str, list[dict[str, float]]] = {}
    for row in rows:
        if row.get("status") != "ok":
            continue
        for key in _group_keys(row["config"]):
            groups.setdefault(key, []).append(row["error"])
    out = {}
    for key in _summary_order(groups):
        errs = groups[key]
        entry = {"count": len(errs)}
        for part in ("forward", "backward", "forward_backward"):
            values = [e[part] for e in errs]
            absolute = [abs(v) for v in values]
            entry[part] = {
                "median_abs": statistics.median(absolute),
                "max_abs": max(absolute),
                "median_signed": statistics.median(values),
            }
        out[key] = entry
    return out


def split_record(
    predicted: dict[str, Any],
    backward_ms: float,
    measured: dict[str, Any],
) -> dict[str, Any]:
    """One config's ``split``: the model's B/W (:func:`predict_split`), the
    measured ones and their errors.

    Args:
        predicted: :func:`predict_split` of the config.
        backward_ms: the measured full backward, median ms.
        measured: what :func:`measure` put under ``"split"`` (the
            input-gradient pass's ``input_backward_ms`` median and min, ...).

    Returns:
        ``{"predicted", "measured", "error"}``: measured W = backward - B
        (medians, ms; noise can make it <= 0) and its share of the backward,
        and the FLOPs autograd skipped in B (``skipped_flops``, where counted);
        ``error.share_pp`` = predicted - measured share in percentage points,
        ``error.weight_gradient`` and ``error.input_backward`` = predicted /
        measured - 1 (``None`` for W where the measured W is <= 0).
    """
    input_ms = measured["input_backward_ms"]["median"]
    weight_ms = backward_ms - input_ms
    share = weight_ms / backward_ms
    derived: dict[str, Any] = {
        "backward_ms": backward_ms,
        "weight_gradient_ms": weight_ms,
        "weight_gradient_share": share,
    }
    flops = measured.get("flops", {})
    if "backward" in flops and "input_backward" in flops:
        # What autograd left out of B: against the model's W GEMM FLOPs.
        derived["skipped_flops"] = sum(flops["backward"].values()) - sum(
            flops["input_backward"].values()
        )
    return {
        "predicted": predicted,
        "measured": dict(measured, **derived),
        "error": {
            "share_pp": 100.0 * (predicted["weight_gradient_share"] - share),
            "weight_gradient": (
                predicted["weight_gradient_ms"] / weight_ms - 1.0
                if weight_ms > 0
                else None
            ),
            "input_backward": predicted["input_backward_ms"] / input_ms - 1.0,
        },
    }


def summarize_split(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per group (as :func:`summarize`): median, max and signed median of
    |predicted - measured W share| in percentage points and of the relative
    errors of W and of B; ``weight_gradient.count`` leaves out the rows whose
    measured W is <= 0 (``measured_w_nonpositive``)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("status") != "ok" or "error" not in row.get("split", {}):
            continue
        for key in _group_keys(row["config"]):
            groups.setdefault(key, []).append(row["split"]["error"])
    out = {}
    for key in _summary_order(groups):
        errs = groups[key]
        entry: dict[str, Any] = {"count": len(errs)}
        for part in ("share_pp", "weight_gradient", "input_backward"):
            values = [e[part] for e in errs if e[part] is not None]
            absolute = [abs(v) for v in values]
            entry[part] = {
                "count": len(values),
                "median_abs": statistics.median(absolute) if values else None,
                "max_abs": max(absolute) if values else None,
                "median_signed": statistics.median(values) if values else None,
            }
        entry["measured_w_nonpositive"] = sum(
            e["weight_gradient"] is None for e in errs
        )
        out[key] = entry
    return out


def _config_head(config: dict[str, Any]) -> str:
    """A table line's first columns: the block's style, precision, attention,
    hidden size, sequence length and micro-batch."""
    return (
        f"{config['style']:5s} {config['precision']:4s} "
        f"{'flash' if config['flash_attention'] else 'unfsd':5s} "
        f"{config['hidden_size']:5d} {config['seq_length']:5d} {config['mbs']:2d}"
    )


def _row_line(row: dict[str, Any]) -> str:
    head = _config_head(row["config"])
    if row.get("status") != "ok":
        return f"{head}  {row.get('status')}: {row.get('reason', '')}"[:150]
    meas, pred, err = row["measured"], row["predicted"], row["error"]
    flops = pred["gemm_flops"]["forward"] + pred["gemm_flops"]["backward"]
    total_ms = meas["forward_ms"]["median"] + meas["backward_ms"]["median"]
    bound = "".join(
        tag for tag, on in zip("FB", meas["launch_bound"].values(), strict=True) if on
    )
    return (
        f"{head} {meas['forward_ms']['median']:9.3f} {pred['forward_ms']:9.3f} "
        f"{100 * err['forward']:+6.1f}% {meas['backward_ms']['median']:9.3f} "
        f"{pred['backward_ms']:9.3f} {100 * err['backward']:+6.1f}% "
        f"{100 * err['forward_backward']:+6.1f}% {flops / total_ms / 1e9:7.1f} "
        f"{bound}"
    ).rstrip()


TABLE_HEADER = (
    "style prec attn   hidden   seq  b   fwd ms  pred ms    err   bwd ms  pred ms"
    "    err  f+b err TFLOP/s launch-bound"
)


def print_rows(header: str, rows: list[dict[str, Any]], line) -> None:
    """A results table: ``header``, each row's ``line(row)``, then the title
    of the summary that follows it."""
    print(header)
    for row in rows:
        print(line(row))
    print()
    print("summary: |predicted / measured - 1|, median / max (signed median)")


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print_rows(TABLE_HEADER, rows, _row_line)
    print(f"  {'group':14s} {'n':>3s}  {'fwd+bwd':25s}{'fwd':25s}bwd")
    for key, entry in summary.items():
        parts = []
        for part in ("forward_backward", "forward", "backward"):
            stats = {key: 100 * value for key, value in entry[part].items()}
            parts.append(
                f"{stats['median_abs']:5.1f}% /{stats['max_abs']:6.1f}% "
                f"({stats['median_signed']:+6.1f}%) "
            )
        print((f"  {key:14s} {entry['count']:3d}  " + "".join(parts)).rstrip())


SPLIT_HEADER = (
    "style prec attn   hidden   seq  b   bwd ms     B ms   pred B    err     W ms"
    "   pred W    err W share   pred  pp diff  launch-bound"
)


def _split_line(row: dict[str, Any]) -> str:
    head = _config_head(row["config"])
    split = row.get("split", {})
    if row.get("status") != "ok" or "error" not in split:
        return f"{head}  {row.get('status')}"
    pred, meas, err = split["predicted"], split["measured"], split["error"]
    w_err = err["weight_gradient"]
    return (
        f"{head} {meas['backward_ms']:8.3f} "
        f"{meas['input_backward_ms']['median']:8.3f} "
        f"{pred['input_backward_ms']:8.3f} {100 * err['input_backward']:+6.1f}% "
        f"{meas['weight_gradient_ms']:8.3f} {pred['weight_gradient_ms']:8.3f} "
        + (f"{100 * w_err:+6.1f}% " if w_err is not None else "    n/a ")
        + f"{100 * meas['weight_gradient_share']:6.1f}% "
        f"{100 * pred['weight_gradient_share']:5.1f}% {err['share_pp']:+7.1f}  "
        f"{'B' if meas.get('launch_bound') else ''}"
    ).rstrip()


def _format_stats(stats: dict[str, Any], scale: float, unit: str) -> str:
    if stats["median_abs"] is None:
        return f"{'n/a':25s}"
    values = {key: scale * stats[key] for key in ("median_abs", "max_abs")}
    signed = scale * stats["median_signed"]
    return (
        f"{values['median_abs']:5.1f}{unit} /{values['max_abs']:6.1f}{unit} "
        f"({signed:+6.1f}{unit}) "
    )


def print_split_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print(SPLIT_HEADER)
    for row in rows:
        print(_split_line(row))
    print()
    print(
        "split summary: |predicted - measured W share| in percentage points, "
        "|predicted / measured - 1| of W and of B, median / max (signed median)"
    )
    print(f"  {'group':14s} {'n':>3s}  {'W share':29s}{'W':26s}B")
    for key, entry in summary.items():
        line = (
            f"  {key:14s} {entry['count']:3d}  "
            + _format_stats(entry["share_pp"], 1.0, "pp")
            + _format_stats(entry["weight_gradient"], 100.0, "%")
            + _format_stats(entry["input_backward"], 100.0, "%")
        )
        if entry["measured_w_nonpositive"]:
            line += f" ({entry['measured_w_nonpositive']} with measured W <= 0)"
        print(line.rstrip())


# --------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON results file")
    parser.add_argument("--gpu", help="GPU-sheet entry (default: from the device)")
    parser.add_argument("--smoke", action="store_true", help="tiny blocks on the CPU")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--reps", type=int, default=None, help="timed steps (max)")
    parser.add_argument("--min-reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--config-s", type=float, default=2.0, help="timed seconds per config"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=210.0,
        help="seconds from the start: skip configs whose estimate would pass it",
    )
    parser.add_argument("--max-activation-gb", type=float, default=40.0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--only", help="run configs whose name contains this")
    parser.add_argument(
        "--attention",
        choices=("flash", "cudnn"),
        default="flash",
        help="the fused attention backend of the flash rows (default flash: "
        "FlashAttention-2; cudnn: cuDNN's, which Transformer Engine runs)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="also time the input-gradient backward (B) and report W = full - B",
    )
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.smoke else 10
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    for name in ("reps", "min_reps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.min_reps = min(args.min_reps, args.reps)
    return args


def main(argv: list[str] | None = None) -> int:
    run_started = time.perf_counter()
    args = parse_args(argv)
    if torch is None:
        print("gpu_blocks: PyTorch is not installed", file=sys.stderr)
        return 2
    device = args.device
    if device == "auto":
        device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_blocks: no CUDA device (use --smoke for the CPU path)",
            file=sys.stderr,
        )
        return 2
    sheet = load_gpu_sheet()
    gpu_name = args.gpu
    if gpu_name is None and device == "cuda":
        gpu_name = sheet_name_for(torch.cuda.get_device_name(0))
    if gpu_name is None and args.smoke:
        gpu_name = "H100-SXM"
    if gpu_name is None:
        print(
            f"gpu_blocks: no GPU-sheet entry for {torch.cuda.get_device_name(0)!r}; "
            f"pass --gpu NAME (one of {', '.join(sheet)})",
            file=sys.stderr,
        )
        return 2
    try:
        gpu = sheet[gpu_name]
    except KeyError as error:
        print(f"gpu_blocks: {error.args[0]}", file=sys.stderr)
        return 2
    failed_settings = _configure_torch()
    if device == "cpu":
        torch.set_num_threads(1)  # steadier smoke timings on a shared CPU
    env = environment(device)
    if failed_settings:
        env["failed_settings"] = failed_settings
    print(
        f"torch {env['torch']} (CUDA {env['cuda']}) | device {env['device_name']} "
        f"| driver {env.get('driver')} | sheet entry {gpu.name}",
        flush=True,
    )
    grid = smoke_grid() if args.smoke else default_grid()
    if args.only:
        grid = [config for config in grid if args.only in config.name]
    if args.no_profile:
        grid = [dataclasses.replace(config, profile=False) for config in grid]
    predictions, estimates, split_predictions = [], [], []
    for config in grid:
        split_prediction = None
        try:  # e.g. a GPU without a bf16 peak on the sheet
            prediction = predict(config, gpu)
            if args.split:
                split_prediction = predict_split(config, gpu)
            estimate = estimate_seconds(
                prediction,
                config,
                args.warmup,
                args.reps,
                args.min_reps,
                args.config_s,
                split=split_prediction,
            )
        except ValueError as error:
            prediction, estimate = {"error": str(error)}, 0.0
        predictions.append(prediction)
        estimates.append(estimate)
        split_predictions.append(split_prediction)
    print(
        f"{len(grid)} configs; estimated {sum(estimates):.0f} s on a {gpu.name} "
        f"(budget {args.budget_s:.0f} s)",
        flush=True,
    )
    timer = Timer(device)
    result: dict[str, Any] = {
        **results_header(env, gpu),
        "settings": {
            "smoke": args.smoke,
            "device": device,
            "reps_max": args.reps,
            "reps_min": args.min_reps,
            "warmup": args.warmup,
            "config_s": args.config_s,
            "budget_s": args.budget_s,
            "max_activation_gb": args.max_activation_gb,
            "queued_sleep_cycles_per_ms": timer.cycles_per_ms,
            "timing": (
                "CUDA events around the forward and around the backward of the "
                "same step (both timed directly), after a queued GPU sleep so "
                "that the CPU's enqueueing does not count; median and min over "
                "reps"
                if device == "cuda"
                else "time.perf_counter around the forward and the backward"
            ),
            "precision_map": {
                "bf16": "bf16 weights and activations (our 'bf16')",
                "fp32": "fp32, TF32 off: CUDA-core GEMMs (our 'fp32')",
            },
            "error": "predicted / measured - 1 (medians)",
            "layout": "[b, s, h] with flash attention, [s, b, h] unfused",
            "hidden_dropout": "0.1 gpt style, 0 llama style",
            "attention_dropout": 0.0,
            "attention_backend": args.attention,
        },
        "op_differences": list(OP_DIFFERENCES),
        "grid": [dict(dataclasses.asdict(c), name=c.name) for c in grid],
        "estimated_seconds": sum(estimates),
        "rows": [],
        "skipped": [],
    }
    if args.split:
        result["settings"].update(
            split=True,
            split_timing=(
                "after each timed full step, a step whose backward is "
                "torch.autograd.grad(out, [x], grad_outputs=grad_out) (the "
                "input-gradient pass B), timed the same way; W = full backward "
                "- B (medians), share = W / full backward"
            ),
            split_error=(
                "share_pp: predicted - measured W share, percentage points; "
                "weight_gradient, input_backward: predicted / measured - 1"
            ),
        )
        result["split_differences"] = list(SPLIT_DIFFERENCES)
    rows = result["rows"]
    overrun: list[float] = []
    for index, (config, prediction, estimate, split_prediction) in enumerate(
        zip(grid, predictions, estimates, split_predictions, strict=True)
    ):
        row: dict[str, Any] = {
            "name": config.name,
            "config": dataclasses.asdict(config),
            "predicted": prediction,
            "estimated_s": estimate,
        }
        if split_prediction is not None:
            row["split"] = {"predicted": split_prediction}
        elapsed = time.perf_counter() - run_started
        # Scale the estimate by how far the configs so far overran theirs.
        scale = max(1.0, statistics.median(overrun)) if overrun else 1.0
        if "error" in prediction:
            row.update(status="skipped", reason=f"no prediction: {prediction['error']}")
        elif prediction["activation_bytes"] > args.max_activation_gb * 1e9:
            row.update(status="skipped", reason="activations over the limit")
        elif elapsed + scale * estimate > args.budget_s:
            row.update(
                status="skipped",
                reason=f"budget ({elapsed:.0f} s spent, needs {scale * estimate:.1f})",
            )
        else:
            config_started = time.perf_counter()
            try:
                row["measured"] = measure(
                    config,
                    device,
                    timer,
                    warmup=args.warmup,
                    reps=args.reps,
                    min_reps=args.min_reps,
                    config_s=args.config_s,
                    seed=index,
                    split=args.split,
                    attention=args.attention,
                )
                row["status"] = "ok"
                row["error"] = errors(row)
                if args.split:
                    row["split"] = split_record(
                        split_prediction,
                        row["measured"]["backward_ms"]["median"],
                        row["measured"].pop("split"),
                    )
            except Exception as error:
                oom = "out of memory" in str(error).lower()
                row.update(
                    status="oom" if oom else "error",
                    reason=f"{type(error).__name__}: {str(error)[:300]}",
                )
                if not oom:
                    row["traceback"] = traceback.format_exc()[-2000:]
            free_memory(device)
            row["seconds"] = time.perf_counter() - config_started
            overrun.append(row["seconds"] / estimate)
        if row["status"] == "skipped":
            result["skipped"].append({"name": config.name, "reason": row["reason"]})
        rows.append(row)
        print(f"[{index + 1}/{len(grid)}] {_row_line(row)}", flush=True)
        if args.split and row["status"] == "ok":
            print(f"  split: {_split_line(row)}", flush=True)
        result["seconds"] = time.perf_counter() - run_started
        result["summary"] = summarize(rows)
        if args.split:
            result["split_summary"] = summarize_split(rows)
        stamp.write_json(args.out, result)
    print()
    print_table(rows, result["summary"])
    if args.split:
        print()
        print_split_table(rows, result["split_summary"])
    print(f"wrote {args.out} ({result['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
