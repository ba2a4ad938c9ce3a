"""The analytical model's FP8 GEMM pricing against a real GPU.

The planner prices ``fp8`` training as fp8 inputs to the GEMMs of the four
linear layers of each block (QKV, output projection, MLP up and down; 1 byte
per input element, bf16 output, the sheet's fp8 peak) with bf16 activations
and attention (:mod:`pipedejavu.costmodel.analytical.ops`), priced with
``HALF_PRECISION_ANALYTICAL`` like bf16. This script checks those GEMMs, and
only those, on the GPU it runs on, with no refitting.

The grid is taken from the model's own operation list: for each model shape,
tensor-parallel degree, micro-batch size and sequence length, the ``Gemm``
operations of ``block_forward_ops`` and ``block_backward_ops`` whose names are
``qkv``, ``out_proj``, ``mlp_up``, ``mlp_down`` and their ``.dgrad`` and
``.wgrad`` (the weight gradients are :data:`~pipedejavu.costmodel.analytical.
layers.WEIGHT_GRADIENT_OPS`). Equal shapes (``mbs 2, seq 2048`` and ``mbs 1,
seq 4096`` give the same GEMMs) are measured once; each row lists where it
occurs. Each is priced as the planner prices an operation, ``pass_seconds([op],
gpu, HALF_PRECISION_ANALYTICAL)``, once from the bf16 operation list and once
from the fp8 one, against the device's GPU-sheet entry.

Measured, per GEMM, in the layouts a Megatron linear layer uses:

* bf16: ``torch.mm``: forward ``x @ w.t()``, dgrad ``dy @ w``, wgrad
  ``dy.t() @ x`` (the weight gradient as Megatron computes it, ``n x k``:
  the same FLOPs as the model's ``k x n``).
* fp8: ``torch._scaled_mm(a, b.t(), scale_a, scale_b, out_dtype=bf16)`` with
  per-tensor float32 scales. Hopper's fp8 GEMMs take the first operand
  row-major and the second column-major (``b.t()`` of a contiguous ``(N, K)``
  tensor), so Transformer Engine keeps transposed fp8 copies (its fused
  cast-transpose kernels): forward ``x`` and ``w`` as they are, dgrad ``dy``
  and ``w``'s transpose, wgrad the transposes of ``dy`` and ``x``. Transformer
  Engine's hybrid recipe: e4m3 for the forward's operands and the weights,
  e5m2 for the gradient operand of dgrad and wgrad (e4m3 where ``_scaled_mm``
  refuses it, recorded per row), fast accumulation in the forward only
  (``use_fast_accum``; split accumulation in dgrad and wgrad, as its
  ``_2X_ACC_*`` settings).

The casts to fp8 are not timed with the GEMMs: Transformer Engine fuses them
into the kernels before (norm, activation, cast-transpose of the gradient).
The model prices no cast either. With casts on (the default) each operand's
unfused conversion (``tensor.to(fp8)``, 3 bytes an element) is timed on its
own and set beside the memory-bound price of that many bytes: what the casts
would add where they are not fused.

Timing: the GEMM is warmed up, then the GPU is given a queued sleep long
enough for the CPU to enqueue every rep, then CUDA events between consecutive
calls (median and min over reps), as in ``benchmarks/gpu_blocks.py``; on the
CPU (``--smoke``: tiny blocks, bf16 only) ``time.perf_counter`` around each
call, and the fp8 call runs once, untimed, as a check of its operands (the CPU
kernel's rules are not cuBLASLt's). Results are written to ``--out`` after
every GEMM; what could not run says why (``status`` of each precision).

The default grid: GPT-3 175B at tp 8, Llama-3-70B at tp 4 and 8, Llama-3-8B at
tp 1 and 2, GPT-Neo-2.7 (hidden 2,560) at tp 1; micro-batches 1 and 2 of
2,048, 4,096 and 8,192 tokens (2,048 to 16,384 tokens a GEMM): 288 distinct
GEMMs, each timed in bf16 and fp8 (5 warm-up and 40 timed calls each).

Usage::

    PYTHONPATH=. python benchmarks/gpu_fp8_gemms.py \
        --out benchmarks/results/gpu_fp8_gemms.json
    PYTHONPATH=. python benchmarks/gpu_fp8_gemms.py --smoke --out smoke.json

The estimated GPU time is printed before the run; ``--max-seconds`` (170 s
from the start) skips the GEMMs that would not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stamp  # noqa: E402
from gpu_blocks import (  # noqa: E402  (torch: None where it is absent)
    calibrate_sleep,
    environment,
    print_rows,
    sheet_name_for,
    torch,
)

from pipedejavu.core.gpu_sheet import GpuSheetEntry  # noqa: E402
from pipedejavu.core.transformer import TransformerSpec  # noqa: E402
from pipedejavu.costmodel.analytical.ops import (  # noqa: E402
    Gemm,
    MemoryOp,
    PassOptions,
    block_backward_ops,
    block_forward_ops,
    validate_spec,
)
from pipedejavu.costmodel.analytical.roofline import (  # noqa: E402
    HALF_PRECISION_ANALYTICAL,
    gemm_efficiency,
    pass_arrays,
    pass_seconds,
)
from pipedejavu.io.gpu_sheet import load_gpu_sheet  # noqa: E402
from pipedejavu.io.model_config import load_model_spec  # noqa: E402

#: The linear layers whose GEMMs the model runs in fp8.
LINEAR_LAYERS = ("qkv", "out_proj", "mlp_up", "mlp_down")
KINDS = ("forward", "dgrad", "wgrad")
#: What the planner prices fp16/bf16/fp8 with (``AnalyticalSource``).
CONSTANTS = HALF_PRECISION_ANALYTICAL
#: (preset, tp) of the default grid: GPT-3 175B, Llama-3 70B and 8B, a 2.7B GPT.
DEFAULT_MODELS = (
    ("GPT-3-175B", 8),
    ("Llama-3-70B", 4),
    ("Llama-3-70B", 8),
    ("Llama-3-8B", 1),
    ("Llama-3-8B", 2),
    ("GPT-Neo-2.7", 1),
)
#: (mbs, seq) of the default grid: 2,048 to 16,384 tokens.
DEFAULT_SAMPLES = tuple((mbs, seq) for mbs in (1, 2) for seq in (2048, 4096, 8192))

ESTIMATE_SLOWDOWN = 1.3  # measured / predicted assumed by the time estimate
ROW_OVERHEAD_S = 0.08  # per GEMM: operands, casts, synchronizations, sleeps, gc
STARTUP_S = 10.0  # CUDA context, cuBLAS handles, the sleep's calibration


# ------------------------------------------------------------------ the grid
def smoke_models() -> list[tuple[TransformerSpec, int]]:
    """Tiny blocks (every GEMM dimension a multiple of 16) for the CPU run."""
    gpt = TransformerSpec(
        name="tiny-gpt",
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=256,
        vocab_size=512,
        seq_length=32,
        max_position_embeddings=64,
    )
    llama = TransformerSpec(
        name="tiny-llama",
        num_layers=1,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=352,
        vocab_size=512,
        seq_length=32,
        gated_mlp=True,
        norm="rmsnorm",
        position="rotary",
        tied_embeddings=False,
        linear_bias=False,
    )
    return [(gpt, 1), (gpt, 2), (llama, 2)]


SMOKE_SAMPLES = ((1, 32), (2, 32))


def default_models() -> list[tuple[TransformerSpec, int]]:
    return [(load_model_spec(name), tp) for name, tp in DEFAULT_MODELS]


def with_seq_length(spec: TransformerSpec, seq: int) -> TransformerSpec:
    """``spec`` at ``seq`` tokens per sample; a learned position table grows
    to fit (it is no GEMM: the linear layers' shapes do not depend on it)."""
    rows = spec.max_position_embeddings
    if spec.position == "learned":
        rows = max(rows, seq)
    return dataclasses.replace(spec, seq_length=seq, max_position_embeddings=rows)


def linear_gemms(
    spec: TransformerSpec, mbs: int, tp: int, precision: str
) -> list[Gemm]:
    """The linear layers' GEMMs of one block's forward and backward, in the
    model's order: ``qkv``, ``out_proj``, ``mlp_up``, ``mlp_down``, then the
    ``.dgrad`` and ``.wgrad`` of each, last layer first (12 :class:`Gemm`).

    Raises:
        ValueError: ``tp`` does not split ``spec``.
    """
    validate_spec(spec, tp)
    opts = PassOptions(mbs, tp, precision, flash_attention=True)
    ops = block_forward_ops(spec, opts) + block_backward_ops(spec, opts)
    return [
        op
        for op in ops
        if isinstance(op, Gemm) and op.name.split(".")[0] in LINEAR_LAYERS
    ]


def gemm_kind(name: str) -> str:
    """``forward``, ``dgrad`` or ``wgrad`` from an operation's name."""
    suffix = name.rpartition(".")[2] if "." in name else "forward"
    if suffix not in KINDS:
        raise ValueError(f"not a linear layer's GEMM: {name!r}")
    return suffix


def predict_gemm(op: Gemm, gpu: GpuSheetEntry) -> dict[str, Any]:
    """The planner's price of one GEMM on ``gpu``: seconds, the roofline's
    parts (efficiency, compute and memory seconds, which bounds it), FLOPs and
    bytes; ``{"error": ...}`` where the sheet lacks the precision's peak."""
    try:
        seconds = pass_seconds([op], gpu, CONSTANTS, fp8_casts=False)
        arrays = pass_arrays([op], gpu, fp8_casts=False)
    except ValueError as error:
        return {"error": str(error)}
    efficiency = float(
        gemm_efficiency(
            arrays.gemm_seconds_at_peak,
            arrays.gemm_simt,
            arrays.gemm_backward,
            CONSTANTS,
        )[0]
    )
    compute = float(arrays.gemm_seconds_at_peak[0]) / efficiency
    memory = op.bytes / (gpu.memory_bandwidth_bytes_per_s * CONSTANTS.memory_efficiency)
    return {
        "seconds": seconds,
        "efficiency": efficiency,
        "compute_seconds": compute,
        "memory_seconds": memory,
        "bound": "memory" if memory > compute else "compute",
        "flops": op.flops,
        "bytes": op.bytes,
        "input_bytes": op.input_bytes,
        "precision": op.precision,
    }


def build_rows(
    models: Iterable[tuple[TransformerSpec, int]],
    samples: Iterable[tuple[int, int]],
    gpu: GpuSheetEntry,
) -> list[dict[str, Any]]:
    """One row per distinct (kind, m, n, k) linear GEMM of the grid, with its
    bf16 and fp8 predictions and every (model, tp, mbs, seq, op) it stands for.

    Raises:
        ValueError: the bf16 and fp8 operation lists disagree on a shape (the
            check prices what the planner prices, or nothing).
    """
    rows: dict[tuple, dict[str, Any]] = {}
    samples = list(samples)
    for spec, tp in models:
        for mbs, seq in samples:
            block = with_seq_length(spec, seq)
            bf16 = linear_gemms(block, mbs, tp, "bf16")
            fp8 = linear_gemms(block, mbs, tp, "fp8")
            for half, eight in zip(bf16, fp8, strict=True):
                if _named_shape(half) != _named_shape(eight):
                    raise ValueError(f"bf16 and fp8 differ: {half} vs {eight}")
                kind = gemm_kind(half.name)
                shape = (int(half.m), int(half.n), int(half.k))
                key = (kind, *shape)
                use = f"{spec.name} tp{tp} b{mbs} s{seq} {half.name}"
                if key in rows:
                    rows[key]["uses"].append(use)
                    continue
                rows[key] = {
                    "name": f"{spec.name} tp{tp} {half.name} t{mbs * seq}",
                    "kind": kind,
                    "m": shape[0],
                    "n": shape[1],
                    "k": shape[2],
                    "uses": [use],
                    "predicted": {
                        "bf16": predict_gemm(half, gpu),
                        "fp8": predict_gemm(eight, gpu),
                    },
                }
    return list(rows.values())


def _named_shape(op: Gemm) -> tuple:
    return op.name, op.batch, op.m, op.n, op.k


def cast_price(elements: int, gpu: GpuSheetEntry) -> float:
    """Seconds the roofline gives an unfused cast of ``elements`` bf16 values
    to fp8 (read 2, write 1 byte each), as a forward memory-bound kernel."""
    return pass_seconds([MemoryOp("fp8_cast", 3.0 * elements)], gpu, CONSTANTS)


def estimate_seconds(
    row: dict[str, Any], warmup: int, reps: int, *, casts: bool, gpu: GpuSheetEntry
) -> float:
    """Wall seconds one row is expected to take on the GPU."""
    calls = 0.0
    for precision in ("bf16", "fp8"):
        calls += row["predicted"][precision].get("seconds", 0.0)
    if casts:
        calls += cast_price(row["m"] * row["k"], gpu) + cast_price(
            row["n"] * row["k"], gpu
        )
    return ROW_OVERHEAD_S + (warmup + reps) * ESTIMATE_SLOWDOWN * calls


# --------------------------------------------------------------- measuring
def time_calls(
    call_fn: Callable[[], Any],
    device: str,
    *,
    warmup: int,
    reps: int,
    cycles_per_ms: float | None,
) -> dict[str, Any]:
    """Milliseconds of ``reps`` calls after ``warmup``: ``{"median", "min",
    "reps", "cpu_enqueue_ms", "queued_sleep_ms"}``. On CUDA one event between
    consecutive calls, all queued behind a GPU sleep that outlasts the CPU's
    enqueueing (so launch gaps do not count)."""
    if device != "cuda":
        for _ in range(warmup):
            call_fn()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            call_fn()
            samples.append(1e3 * (time.perf_counter() - start))
        return {"median": statistics.median(samples), "min": min(samples), "reps": reps}
    for _ in range(warmup):
        call_fn()
    torch.cuda.synchronize()
    # One call's enqueue time, after the warm-up (the first calls pick
    # kernels and create handles), sizes the sleep.
    started = time.perf_counter()
    call_fn()
    cpu_ms = 1e3 * (time.perf_counter() - started)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    sleep_ms = min(max(2.0 * reps * cpu_ms, 1.0), 50.0) if cycles_per_ms else 0.0
    if sleep_ms:
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
    events[0].record()
    for index in range(reps):
        call_fn()
        events[index + 1].record()
    torch.cuda.synchronize()
    samples = [events[i].elapsed_time(events[i + 1]) for i in range(reps)]
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "reps": reps,
        "cpu_enqueue_ms": cpu_ms,
        "queued_sleep_ms": sleep_ms,
    }


def bf16_operands(kind: str, m: int, n: int, k: int, device: str) -> dict:
    """The bf16 tensors of one GEMM as Megatron's linear layer holds them and
    the call it makes: ``{"call", "out", "a", "b"}``: ``call()`` the bf16
    product, ``out`` its shape, ``a`` ``(rows_a, k)`` and ``b`` ``(rows_b, k)``
    contiguous bf16 operands in the layout fp8 needs, ``a @ b.t()`` the same
    product (the transposes Transformer Engine makes in its casts)."""
    randn = _randn(device)
    if kind == "forward":  # y = x @ w^T: x (m, k), w (n, k)
        x, w = randn(m, k), randn(n, k)
        return {"call": lambda: torch.mm(x, w.t()), "out": (m, n), "a": x, "b": w}
    if kind == "dgrad":  # dx = dy @ w: dy (m, k), w (k, n) as stored (out, in)
        dy, w = randn(m, k), randn(k, n)
        call = lambda: torch.mm(dy, w)  # noqa: E731
        return {"call": call, "out": (m, n), "a": dy, "b": w.t().contiguous()}
    # wgrad: dw = dy^T @ x, (n, m): dy (k, n), x (k, m), k = tokens
    dy, x = randn(k, n), randn(k, m)
    return {
        "call": lambda: torch.mm(dy.t(), x),
        "out": (n, m),
        "a": dy.t().contiguous(),
        "b": x.t().contiguous(),
    }


def _randn(device: str):
    def randn(rows: int, cols: int):
        return torch.randn(rows, cols, device=device, dtype=torch.bfloat16)

    return randn


def scaled_mm(a, b, scale_a, scale_b, *, fast_accum: bool):
    """``a @ b.t()`` in fp8 with per-tensor scales, bf16 out."""
    out = torch._scaled_mm(
        a,
        b.t(),
        scale_a,
        scale_b,
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )
    return out[0] if isinstance(out, tuple) else out  # torch < 2.4: (out, amax)


def fp8_skip_reason(device: str, shape: tuple[int, int, int]) -> str | None:
    """Why the fp8 GEMM cannot run here; ``None`` if it can be tried."""
    if torch is None:
        return "not run: PyTorch is not installed"
    if device != "cuda":
        return "not run: no CUDA"
    if not hasattr(torch, "_scaled_mm"):
        return f"not run: torch {torch.__version__} has no torch._scaled_mm"
    if not hasattr(torch, "float8_e4m3fn"):
        return f"not run: torch {torch.__version__} has no float8 dtypes"
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 9):
        return f"not run: fp8 GEMMs need compute capability 8.9+, got {capability}"
    if any(size % 16 for size in shape):
        return f"not run: _scaled_mm needs dimensions divisible by 16, got {shape}"
    return None


def _fp8_call(operands: dict, kind: str, device: str) -> tuple[Callable, dict]:
    """The fp8 GEMM of ``operands`` (e5m2 gradient where ``_scaled_mm`` takes
    it), checked once; returns the call and what it runs."""
    e4m3 = torch.float8_e4m3fn
    fast = kind == "forward"
    a_dtypes = [e4m3] if kind == "forward" else [torch.float8_e5m2, e4m3]
    scale = torch.ones((), dtype=torch.float32, device=device)
    b = operands["b"].to(e4m3)
    refused = []
    for a_dtype in a_dtypes:
        a = operands["a"].to(a_dtype)
        try:
            out = scaled_mm(a, b, scale, scale, fast_accum=fast)
        except (RuntimeError, ValueError) as error:
            if "out of memory" in str(error).lower():
                raise
            refused.append(f"{a_dtype}: {str(error).splitlines()[0][:200]}")
            continue
        if tuple(out.shape) != operands["out"]:
            raise RuntimeError(f"fp8 output {tuple(out.shape)} != {operands['out']}")
        info = {
            "a_dtype": str(a_dtype).removeprefix("torch."),
            "b_dtype": str(e4m3).removeprefix("torch."),
            "use_fast_accum": fast,
            "scales": "per-tensor float32 (1.0)",
        }
        if refused:
            info["gradient_operand"] = "e4m3, e5m2 refused: " + refused[0]
        return functools.partial(scaled_mm, a, b, scale, scale, fast_accum=fast), info
    raise RuntimeError("_scaled_mm refused every operand dtype: " + " | ".join(refused))


def measure_row(
    row: dict[str, Any],
    device: str,
    *,
    warmup: int,
    reps: int,
    casts: bool,
    cycles_per_ms: float | None,
) -> dict[str, Any]:
    """Time one row's GEMM in bf16 and fp8 (and the operands' casts):
    ``{"bf16": ..., "fp8": ..., "casts": ...}``, each timing or ``{"status":
    "not run: why"}``."""
    kind, m, n, k = row["kind"], row["m"], row["n"], row["k"]
    out: dict[str, Any] = {}
    operands = bf16_operands(kind, m, n, k, device)
    try:
        kwargs = {"warmup": warmup, "reps": reps, "cycles_per_ms": cycles_per_ms}
        out["bf16"] = dict(
            status="ok", **time_calls(operands["call"], device, **kwargs)
        )
        reason = fp8_skip_reason(device, (m, n, k))
        if reason is not None:
            out["fp8"] = {"status": reason}
            if device == "cpu" and torch is not None and hasattr(torch, "_scaled_mm"):
                out["fp8"]["cpu_call_check"] = _cpu_call_check(operands, kind)
            return out
        try:
            call_fn, info = _fp8_call(operands, kind, device)
            timing = time_calls(call_fn, device, **kwargs)
        except Exception as error:  # recorded beside the bf16 timing, not fatal
            out["fp8"] = {"status": f"error: {type(error).__name__}: {error}"[:300]}
            return out
        out["fp8"] = dict(status="ok", **info, **timing)
        if casts:
            out["casts"] = {}
            for name, dtype in (("a", info["a_dtype"]), ("b", info["b_dtype"])):
                source, target = operands[name], getattr(torch, dtype)
                timing = time_calls(
                    lambda s=source, t=target: s.to(t), device, **kwargs
                )
                out["casts"][name] = dict(
                    elements=source.numel(), dtype=dtype, **timing
                )
        return out
    finally:
        operands.clear()


def _cpu_call_check(operands: dict, kind: str) -> str:
    """Run the fp8 call once on the CPU (untimed): the operands' layout and
    dtypes, as far as the CPU kernel checks them."""
    try:
        _, info = _fp8_call(operands, kind, "cpu")
    except Exception as error:  # a check, never fatal
        return f"failed: {type(error).__name__}: {str(error)[:200]}"
    return f"ran once ({info['a_dtype']} x {info['b_dtype']}, untimed)"


# ------------------------------------------------------------------ results
def compare(row: dict[str, Any], gpu: GpuSheetEntry) -> dict[str, Any]:
    """A measured row against its predictions.

    Returns:
        ``{"bf16": ..., "fp8": ...}`` for each precision both measured and
        predicted: ``measured_s``, ``predicted_s`` (seconds), ``error`` =
        predicted / measured - 1, ``abs_error``, ``tflops`` (measured);
        ``speedup`` where both were: the fp8 speed-up (bf16 seconds / fp8
        seconds) ``measured``, ``predicted``, ``error`` = predicted / measured -
        1, ``abs_error``; ``casts`` where timed: both operands' casts
        ``measured_s``, ``priced_s`` (memory-bound roofline), ``error`` and
        their ``share_of_fp8_gemm`` (measured cast seconds / fp8 GEMM seconds).
    """
    pred, meas = row["predicted"], row["measured"]
    out: dict[str, Any] = {}
    for precision in ("bf16", "fp8"):
        timing = meas.get(precision, {})
        if timing.get("status") != "ok" or "seconds" not in pred[precision]:
            continue
        measured = timing["median"] / 1e3
        error = pred[precision]["seconds"] / measured - 1.0
        out[precision] = {
            "measured_s": measured,
            "predicted_s": pred[precision]["seconds"],
            "error": error,
            "abs_error": abs(error),
            "tflops": pred[precision]["flops"] / measured / 1e12,
        }
    if "bf16" in out and "fp8" in out:
        measured = out["bf16"]["measured_s"] / out["fp8"]["measured_s"]
        predicted = out["bf16"]["predicted_s"] / out["fp8"]["predicted_s"]
        error = predicted / measured - 1.0
        out["speedup"] = {
            "measured": measured,
            "predicted": predicted,
            "error": error,
            "abs_error": abs(error),
        }
    if "casts" in meas and "fp8" in out:
        cast_s = sum(cast["median"] for cast in meas["casts"].values()) / 1e3
        priced = sum(cast_price(c["elements"], gpu) for c in meas["casts"].values())
        out["casts"] = {
            "measured_s": cast_s,
            "priced_s": priced,
            "error": priced / cast_s - 1.0,
            "share_of_fp8_gemm": cast_s / out["fp8"]["measured_s"],
        }
    return out


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "median_abs": None, "max_abs": None, "median_signed": None}
    absolute = [abs(v) for v in values]
    return {
        "count": len(values),
        "median_abs": statistics.median(absolute),
        "max_abs": max(absolute),
        "median_signed": statistics.median(values),
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per group (``all``, then each kind): count, median and max |error| and
    signed median of bf16, of fp8 and of the speed-up; the median measured and
    predicted speed-ups; the casts' error and median share of the fp8 GEMM."""
    groups: dict[str, list[dict[str, Any]]] = {"all": []}
    for row in rows:
        if "comparison" in row:
            groups["all"].append(row["comparison"])
            groups.setdefault(row["kind"], []).append(row["comparison"])
    out = {}
    for key in ["all", *[kind for kind in KINDS if kind in groups]]:
        found = groups[key]

        def values(part: str, field: str, found=found) -> list[float]:
            return [c[part][field] for c in found if part in c]

        out[key] = {
            "bf16": _stats(values("bf16", "error")),
            "fp8": _stats(values("fp8", "error")),
            "speedup": dict(
                _stats(values("speedup", "error")),
                measured_median=_median(values("speedup", "measured")),
                predicted_median=_median(values("speedup", "predicted")),
            ),
            "casts": dict(
                _stats(values("casts", "error")),
                share_of_fp8_gemm_median=_median(values("casts", "share_of_fp8_gemm")),
            ),
        }
    return out


TABLE_HEADER = (
    f"{'gemm':40s} {'M':>6s} {'N':>6s} {'K':>6s}   bf16 ms     pred     err"
    "    fp8 ms     pred     err  x meas  x pred     err"
)


def _ms(seconds: float | None) -> str:
    return f"{1e3 * seconds:9.3f}" if seconds is not None else f"{'-':>9s}"


def _pct(value: float | None) -> str:
    return f"{100 * value:+7.1f}%" if value is not None else f"{'-':>8s}"


def row_line(row: dict[str, Any]) -> str:
    """One table line: measured and predicted ms and error per precision, the
    measured and predicted speed-ups and its error (or why not measured)."""
    head = f"{row['name'][:40]:40s} {row['m']:6d} {row['n']:6d} {row['k']:6d}"
    if "comparison" not in row:
        return f"{head}  {row.get('status')}"[:160]
    found, pred = row["comparison"], row["predicted"]
    parts = []
    for precision in ("bf16", "fp8"):
        entry = found.get(precision, {})
        parts.append(
            _ms(entry.get("measured_s"))
            + _ms(pred[precision].get("seconds"))
            + _pct(entry.get("error"))
        )
    speedup = found.get("speedup")
    if speedup:
        parts.append(
            f"{speedup['measured']:7.2f} {speedup['predicted']:7.2f}"
            + _pct(speedup["error"])
        )
    else:
        parts.append(" " + row["measured"].get("fp8", {}).get("status", "")[:40])
    return f"{head} " + " ".join(parts)


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print_rows(TABLE_HEADER, rows, row_line)
    for key, entry in summary.items():
        parts = []
        for part in ("bf16", "fp8", "speedup", "casts"):
            stats = entry[part]
            if stats["count"]:
                median, top = 100 * stats["median_abs"], 100 * stats["max_abs"]
                signed = 100 * stats["median_signed"]
                parts.append(
                    f"{part} n={stats['count']} {median:.1f}% / {top:.1f}% "
                    f"({signed:+.1f}%)"
                )
        speedup = entry["speedup"]
        if speedup["count"]:
            parts.append(
                f"speed-up measured {speedup['measured_median']:.2f}x, "
                f"predicted {speedup['predicted_median']:.2f}x"
            )
        print(f"  {key:8s} " + ("; ".join(parts) or "nothing measured"))


# --------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON results file")
    parser.add_argument("--gpu", help="GPU-sheet entry (default: from the device)")
    parser.add_argument("--smoke", action="store_true", help="tiny GEMMs on the CPU")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per GEMM")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=170.0,
        help="seconds from the start: skip GEMMs whose estimate would pass it",
    )
    parser.add_argument(
        "--no-casts", action="store_true", help="do not time the fp8 casts"
    )
    parser.add_argument("--only", help="rows one of whose uses contains this")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 3 if args.smoke else 40
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 5
    for name in ("reps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def _environment(device: str) -> dict[str, Any]:
    if torch is None:
        return {
            "python": platform.python_version(),
            "torch": None,
            "cuda": None,
            "device": device,
            "device_name": f"CPU ({platform.machine()}), no PyTorch",
            "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
            "host": platform.node(),
        }
    env = environment(device)
    env["scaled_mm"] = hasattr(torch, "_scaled_mm")
    return env


def _machine(env: dict[str, Any]) -> str:
    """The device, its driver, torch and CUDA, the host: for the results."""
    versions = [
        f"{label} {env.get(key)}"
        for label, key in (("driver", "driver"), ("torch", "torch"), ("CUDA", "cuda"))
        if env.get(key)
    ]
    inside = f" ({', '.join(versions)})" if versions else ""
    return f"{env['device_name']}{inside}, {env['host']} ({env['cpu']})"


def _resolve_gpu(args, device: str, sheet) -> GpuSheetEntry | str:
    """The sheet entry to price with, or why there is none."""
    name = args.gpu
    if name is None and device == "cuda":
        name = sheet_name_for(torch.cuda.get_device_name(0))
        if name is None:
            return (
                f"no GPU-sheet entry for {torch.cuda.get_device_name(0)!r}; pass "
                f"--gpu NAME (one of {', '.join(sheet)})"
            )
    if name is None:
        name = "H100-SXM"
    if name not in sheet:
        return f"unknown GPU {name!r}; one of {', '.join(sheet)}"
    return sheet[name]


def main(argv: list[str] | None = None) -> int:
    run_started = time.perf_counter()
    args = parse_args(argv)
    if torch is None and not args.smoke:
        print("gpu_fp8_gemms: PyTorch is not installed", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_fp8_gemms: no CUDA device (--smoke runs on the CPU)", file=sys.stderr
        )
        return 2
    sheet = load_gpu_sheet()
    gpu = _resolve_gpu(args, device, sheet)
    if isinstance(gpu, str):
        print(f"gpu_fp8_gemms: {gpu}", file=sys.stderr)
        return 2
    if device == "cpu" and torch is not None:
        torch.set_num_threads(1)  # steadier smoke timings on a shared CPU
    env = _environment(device)
    models = smoke_models() if args.smoke else default_models()
    samples = SMOKE_SAMPLES if args.smoke else DEFAULT_SAMPLES
    rows = build_rows(models, samples, gpu)
    if args.only:
        rows = [row for row in rows if any(args.only in use for use in row["uses"])]
    casts = not args.no_casts
    estimates = [
        estimate_seconds(row, args.warmup, args.reps, casts=casts, gpu=gpu)
        for row in rows
    ]
    estimated = (0.0 if args.smoke else STARTUP_S) + sum(estimates)
    print(
        f"{_machine(env)} | sheet entry {gpu.name}\n"
        f"{len(rows)} GEMMs x (bf16, fp8), {args.warmup} + {args.reps} calls each; "
        f"estimated {estimated:.0f} s on the {gpu.name} "
        f"(limit {args.max_seconds:.0f} s)",
        flush=True,
    )
    cycles_per_ms = calibrate_sleep() if device == "cuda" else None
    result: dict[str, Any] = {
        "date": stamp.now(),
        "machine": _machine(env),
        "environment": env,
        "gpu_sheet_entry": dataclasses.asdict(gpu),
        "constants": {
            "name": "HALF_PRECISION_ANALYTICAL",
            "values": dataclasses.asdict(CONSTANTS),
        },
        "settings": {
            "smoke": args.smoke,
            "device": device,
            "reps": args.reps,
            "warmup": args.warmup,
            "max_seconds": args.max_seconds,
            "casts": casts,
            "queued_sleep_cycles_per_ms": cycles_per_ms,
            "timing": (
                "CUDA events between consecutive calls queued behind a GPU sleep; "
                "median and min over reps"
                if device == "cuda"
                else "time.perf_counter around each call"
            ),
            "bf16": "torch.mm: forward x @ w.t(), dgrad dy @ w, wgrad dy.t() @ x",
            "fp8": (
                "torch._scaled_mm(a, b.t()) with a (M, K), b (N, K) contiguous, "
                "per-tensor float32 scales, bf16 out; e4m3 forward and weights, "
                "e5m2 gradient operand in dgrad/wgrad; fast accumulation in the "
                "forward only (Transformer Engine's hybrid recipe)"
            ),
            "casts_note": (
                "not in the GEMM timings (Transformer Engine fuses them); timed "
                "alone as tensor.to(fp8) of each operand, priced as a memory-bound "
                "kernel of 3 bytes an element"
            ),
            "error": (
                "predicted / measured - 1 (medians); speed-up = bf16 s / fp8 s, its "
                "error = predicted speed-up / measured speed-up - 1"
            ),
            "prediction": "pass_seconds([op], gpu, HALF_PRECISION_ANALYTICAL)",
        },
        "grid": {
            "models": [
                {"name": spec.name, "tp": tp, "hidden_size": spec.hidden_size}
                for spec, tp in models
            ],
            "samples": [{"mbs": mbs, "seq_length": seq} for mbs, seq in samples],
            "layers": list(LINEAR_LAYERS),
            "kinds": list(KINDS),
            "num_gemms": len(rows),
        },
        "estimated_seconds": estimated,
        "rows": [],
        "skipped": [],
        "summary": summarize([]),
    }
    overrun: list[float] = []
    for index, (row, estimate) in enumerate(zip(rows, estimates, strict=True)):
        row["estimated_s"] = estimate
        elapsed = time.perf_counter() - run_started
        scale = max(1.0, statistics.median(overrun)) if overrun else 1.0
        if torch is None:
            row["status"] = "not run: PyTorch is not installed"
            row["measured"] = {p: {"status": row["status"]} for p in ("bf16", "fp8")}
            row["comparison"] = compare(row, gpu)
        elif elapsed + scale * estimate > args.max_seconds:
            row["status"] = f"skipped: limit ({elapsed:.0f} s spent)"
            result["skipped"].append(row["name"])
        else:
            started = time.perf_counter()
            try:
                row["measured"] = measure_row(
                    row,
                    device,
                    warmup=args.warmup,
                    reps=args.reps,
                    casts=casts,
                    cycles_per_ms=cycles_per_ms,
                )
                row["status"] = "ok"
                row["comparison"] = compare(row, gpu)
            except Exception as error:
                oom = "out of memory" in str(error).lower()
                row["status"] = f"{'oom' if oom else 'error'}: {type(error).__name__}"
                row["reason"] = str(error)[:300]
                if not oom:
                    row["traceback"] = traceback.format_exc()[-2000:]
            _free_memory(device)
            row["seconds"] = time.perf_counter() - started
            overrun.append(row["seconds"] / estimate)
        result["rows"].append(row)
        print(f"[{index + 1}/{len(rows)}] {row_line(row)}", flush=True)
        result["summary"] = summarize(result["rows"])
        result["seconds"] = time.perf_counter() - run_started
        stamp.write_json(args.out, result)
    print()
    print_table(result["rows"], result["summary"])
    print(f"wrote {args.out} ({result['seconds']:.1f} s)")
    return 0


def _free_memory(device: str) -> None:
    if device == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
