"""The fused attention kernel on a real GPU: forward and backward, per backend.

Times PyTorch's ``scaled_dot_product_attention`` (causal, bf16, ``[b, heads, s,
d]``) restricted to one backend at a time -- ``flash`` (FlashAttention-2, what
eager PyTorch and ``gpu_blocks.py`` run) and ``cudnn`` (cuDNN's fused attention,
the kernel Transformer Engine runs under Megatron-LM on Hopper) -- on the
attention shapes of the presets the planner is used on, per GPU of a TP group
(heads and key/value heads divided by TP), and sets each beside the analytical
model's price of the same kernel: the ``flash_attention`` operation of
:func:`~pipedejavu.costmodel.analytical.ops.attention_core_forward_ops` and its
backward (``flash_attention.backward`` of
:func:`~pipedejavu.costmodel.analytical.ops.block_backward_ops`), priced by
:func:`~pipedejavu.costmodel.analytical.roofline.pass_seconds` with the
16-bit constants the planner uses.

``--fit FILE`` (no GPU) fits, per backend, the fused attention's five
constants (:func:`~pipedejavu.costmodel.analytical.kernels.fit_attention`) on
every other row (rows sorted by name), reports the errors on the rest
(``fit``), and the errors of the planner's constants today on every row
(``repriced``); a measuring run ends with the same. ``--extended`` times
shapes outside the fitted grid, all held out: ``--fit`` on its file adds the
errors of the planner's constants today (``repriced``) and fits nothing.

Timing: for each rep, synchronize, queue a GPU sleep long enough for the CPU to
enqueue the step, then CUDA events around the forward and around the backward
(``out.backward(grad)``) of the same step. Grouped-query attention runs with
``enable_gqa`` where the backend takes it, else with K and V expanded by
``repeat_interleave`` before the timed step (recorded per row).

Usage::

    PYTHONPATH=. python benchmarks/gpu_attention.py --out gpu_attention.json
    PYTHONPATH=. python benchmarks/gpu_attention.py --out smoke.json --smoke
    PYTHONPATH=. python benchmarks/gpu_attention.py --fit \
        benchmarks/results/gpu_attention.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stamp  # noqa: E402
from gpu_blocks import (  # noqa: E402  (torch: None where it is absent)
    calibrate_sleep,
    environment,
    results_header,
    sheet_name_for,
    torch,
)

from pipedejavu.core.transformer import TransformerSpec  # noqa: E402
from pipedejavu.costmodel.analytical.kernels import (  # noqa: E402
    ATTENTION_FIELDS,
    attention_errors,
    fit_attention,
)
from pipedejavu.costmodel.analytical.ops import (  # noqa: E402
    PassOptions,
    attention_core_forward_ops,
    block_backward_ops,
)
from pipedejavu.costmodel.analytical.roofline import (  # noqa: E402
    HALF_PRECISION_ANALYTICAL,
    pass_seconds,
)
from pipedejavu.io.gpu_sheet import load_gpu_sheet  # noqa: E402
from pipedejavu.io.model_config import load_model_spec  # noqa: E402

BACKENDS = ("flash", "cudnn")
#: (preset, tp) of the grid: head dims 128 (most) and 64 (OPT-350M), multi-head
#: and grouped-query attention, 1 to 32 heads per GPU.
MODELS = (
    ("GPT-3-175B", 8),
    ("Llama-3-70B", 8),
    ("Llama-3-70B", 4),
    ("Llama-3-8B", 1),
    ("Llama-3-8B", 2),
    ("GPT-Neo-2.7", 1),
    ("OPT-350", 1),
)
#: (seq_length, mbs) of the grid: up to 16k tokens a micro-batch.
TOKENS = tuple(
    (s, b) for s in (1024, 2048, 4096, 8192) for b in (1, 2, 4) if s * b <= 16384
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention call on one GPU of a TP group."""

    model: str
    tp: int
    seq_length: int
    mbs: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def name(self) -> str:
        return f"{self.model}-tp{self.tp}-s{self.seq_length}-b{self.mbs}"

    def spec(self) -> TransformerSpec:
        if self.model.startswith(SYNTHETIC):  # a head shape of no preset
            heads, groups = self.heads * self.tp, self.kv_heads * self.tp
            return TransformerSpec(
                name=self.model,
                num_layers=1,
                hidden_size=heads * self.head_dim,
                num_attention_heads=heads,
                num_query_groups=groups,
                ffn_hidden_size=4 * heads * self.head_dim,
                vocab_size=32768,
                seq_length=self.seq_length,
                norm="rmsnorm",
                position="rotary",
                max_position_embeddings=0,
                linear_bias=False,
            )
        spec = load_model_spec(self.model)
        positions = spec.max_position_embeddings and max(
            spec.max_position_embeddings, self.seq_length
        )
        return dataclasses.replace(
            spec, seq_length=self.seq_length, max_position_embeddings=positions
        )


#: The name prefix of a shape of no preset (``--extended``).
SYNTHETIC = "heads"


def extended_grid() -> list[Shape]:
    """Shapes outside the fitted grid, all held out: head dimensions 96 and
    256, longer sequences (16k, 32k tokens), other grouped-query ratios."""
    shapes = []
    for d in (96, 256):
        for heads, kv in ((8, 8), (16, 4)):
            for s in (2048, 8192):
                shapes.append(
                    Shape(f"{SYNTHETIC}{heads}x{kv}-d{d}", 1, s, 1, heads, kv, d)
                )
    for d in (64, 128):
        for heads, kv in ((8, 1), (32, 8)):
            for s in (16384, 32768):
                shapes.append(
                    Shape(f"{SYNTHETIC}{heads}x{kv}-d{d}", 1, s, 1, heads, kv, d)
                )
    return shapes


def grid(smoke: bool = False, extended: bool = False) -> list[Shape]:
    if extended:
        return extended_grid()
    if smoke:
        return [
            Shape("OPT-350", 1, 128, 1, 16, 16, 64),
            Shape("Llama-3-8B", 2, 64, 2, 16, 4, 128),
        ]
    shapes = []
    for preset, tp in MODELS:
        spec = load_model_spec(preset)
        heads = spec.num_attention_heads // tp
        kv_heads = max(spec.num_query_groups // tp, 1)
        for s, b in TOKENS:
            shapes.append(Shape(preset, tp, s, b, heads, kv_heads, spec.head_dim))
    return shapes


def model_ops(shape: Shape):
    """The model's fused attention operation, forward and backward."""
    opts = PassOptions(mbs=shape.mbs, tp=shape.tp, precision="bf16")
    spec = shape.spec()
    forward = [op for op in attention_core_forward_ops(spec, opts)]
    backward = [
        op
        for op in block_backward_ops(spec, opts)
        if op.name.startswith("flash_attention")
    ]
    assert [op.name for op in forward] == ["flash_attention"], forward
    assert [op.name for op in backward] == ["flash_attention.backward"], backward
    return forward[0], backward[0]


def predict(shape: Shape, gpu, constants=HALF_PRECISION_ANALYTICAL) -> dict[str, Any]:
    forward, backward = model_ops(shape)
    return {
        "forward_s": pass_seconds([forward], gpu, constants),
        "backward_s": pass_seconds([backward], gpu, constants),
        "forward_flops": forward.flops,
        "backward_flops": backward.flops,
    }


# ------------------------------------------------------------------ timing
def _tensors(shape: Shape, device: str, gqa: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, s, d = shape.mbs, shape.seq_length, shape.head_dim
    q = torch.randn(b, shape.heads, s, d, device=device, dtype=dtype)
    k, v = (
        torch.randn(b, shape.kv_heads, s, d, device=device, dtype=dtype)
        for _ in range(2)
    )
    if shape.kv_heads < shape.heads and gqa == "repeat_interleave":
        k = k.repeat_interleave(shape.heads // shape.kv_heads, dim=1)
        v = v.repeat_interleave(shape.heads // shape.kv_heads, dim=1)
    grad = torch.randn_like(q)
    return [t.requires_grad_(True) for t in (q, k, v)] + [grad]


def _sdpa_backend(backend: str, device: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device != "cuda":
        return sdpa_kernel([SDPBackend.MATH])
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([chosen[backend]])


def _call(tensors, backend: str, device: str, gqa: str):
    q, k, v, _ = tensors
    kwargs = (
        {"enable_gqa": True} if gqa == "enable_gqa" and k.shape[1] < q.shape[1] else {}
    )
    with _sdpa_backend(backend, device):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, **kwargs
        )


def time_shape(
    shape: Shape, backend: str, device: str, cycles_per_ms, *, warmup: int, reps: int
) -> dict[str, Any]:
    """Median forward and backward milliseconds, or why it did not run."""
    errors = []
    tries = (
        ["enable_gqa", "repeat_interleave"]
        if shape.kv_heads < shape.heads
        else ["none"]
    )
    for gqa in tries:
        tensors = None
        try:
            tensors = _tensors(shape, device, gqa)
            for _ in range(warmup):
                _call(tensors, backend, device, gqa).backward(tensors[3])
            forward, backward = [], []
            for _ in range(reps):
                for t in tensors[:3]:
                    t.grad = None
                if device == "cuda":
                    torch.cuda.synchronize()
                    if cycles_per_ms:
                        torch.cuda._sleep(int(2.0 * cycles_per_ms))
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    events[0].record()
                    out = _call(tensors, backend, device, gqa)
                    events[1].record()
                    out.backward(tensors[3])
                    events[2].record()
                    torch.cuda.synchronize()
                    forward.append(events[0].elapsed_time(events[1]))
                    backward.append(events[1].elapsed_time(events[2]))
                else:
                    t0 = time.perf_counter()
                    out = _call(tensors, backend, device, gqa)
                    t1 = time.perf_counter()
                    out.backward(tensors[3])
                    t2 = time.perf_counter()
                    forward.append((t1 - t0) * 1e3)
                    backward.append((t2 - t1) * 1e3)
            row = {
                "forward_ms": statistics.median(forward),
                "backward_ms": statistics.median(backward),
                "forward_ms_all": forward,
                "backward_ms_all": backward,
            }
            if gqa != "none":
                row["gqa"] = gqa
            if errors:
                row["fallback_errors"] = errors
            return row
        except (RuntimeError, TypeError) as error:
            errors.append(f"{gqa}: {str(error).splitlines()[0][:200]}")
        finally:
            del tensors
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"error": " | ".join(errors)}


# --------------------------------------------------------------------- fit
def calls(result: dict[str, Any], backend: str, rows=None):
    """The model's fused attention ops of one backend's timed calls and their
    measured seconds, forward and backward, rows sorted by name."""
    ops, seconds = [], []
    rows = sorted(result["rows"], key=lambda r: r["name"]) if rows is None else rows
    for row in rows:
        measured = row["measured"].get(backend, {})
        if "forward_ms" not in measured:
            continue
        shape = Shape(**{f.name: row[f.name] for f in dataclasses.fields(Shape)})
        forward, backward = model_ops(shape)
        ops += [forward, backward]
        seconds += [measured["forward_ms"] / 1e3, measured["backward_ms"] / 1e3]
    return ops, seconds


def _stats(errors) -> dict[str, float]:
    errors = [float(e) for e in errors]
    return {
        "count": len(errors),
        "median_abs": statistics.median(abs(e) for e in errors),
        "max_abs": max(abs(e) for e in errors),
        "median_signed": statistics.median(errors),
    }


def _by_pass(ops, errors) -> dict[str, Any]:
    return {
        kind: _stats(
            e
            for op, e in zip(ops, errors, strict=True)
            if op.name.endswith(".backward") == (kind == "backward")
        )
        for kind in ("forward", "backward")
    }


def fit_summary(result: dict[str, Any], gpu) -> dict[str, Any]:
    """Per backend: the fused-attention constants fitted on every other row
    (rows sorted by name) and the errors on the rest."""
    out = {}
    for backend in BACKENDS:
        rows = sorted(result["rows"], key=lambda r: r["name"])
        fit_ops, fit_s = calls(result, backend, rows[0::2])
        held_ops, held_s = calls(result, backend, rows[1::2])
        if not fit_ops or not held_ops:
            continue
        fitted = fit_attention(fit_ops, fit_s, gpu, HALF_PRECISION_ANALYTICAL)
        errors = attention_errors(held_ops, held_s, gpu, fitted)
        out[backend] = {
            "fit_rows": len(fit_ops) // 2,
            "held_out_rows": len(held_ops) // 2,
            "constants": {name: getattr(fitted, name) for name in ATTENTION_FIELDS},
            "held_out": _by_pass(held_ops, errors),
        }
    return out


def summarize(result: dict[str, Any], gpu, constants) -> dict[str, Any]:
    """|predicted / measured - 1| per backend and pass under ``constants``."""
    out = {}
    for backend in BACKENDS:
        ops, seconds = calls(result, backend)
        if ops:
            out[backend] = _by_pass(ops, attention_errors(ops, seconds, gpu, constants))
    return out


def refit(path: str) -> dict[str, Any]:
    """Add to a results file the fit per backend and the errors under the
    planner's constants today (``repriced``); returns both."""
    result = json.loads(Path(path).read_text())
    gpu = load_gpu_sheet()[result["gpu_sheet_entry"]["name"]]
    if not result["settings"].get("grid", "default").startswith("extended"):
        result["fit"] = fit_summary(result, gpu)  # held-out shapes: no fit
    result["repriced"] = {
        "date": stamp.now(),
        "constants": {
            name: getattr(HALF_PRECISION_ANALYTICAL, name) for name in ATTENTION_FIELDS
        },
        "errors": summarize(result, gpu, HALF_PRECISION_ANALYTICAL),
    }
    stamp.write_json(path, result)
    return {"fit": result.get("fit"), "repriced": result["repriced"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="the JSON results file")
    parser.add_argument(
        "--fit", help="fit on a results file, add the fit to it and print (no GPU)"
    )
    parser.add_argument("--gpu", help="GPU-sheet entry (default: from the device)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--extended",
        action="store_true",
        help="the shapes outside the fitted grid (head dimensions 96 and 256, "
        "16k and 32k tokens): a held-out check of the planner's constants",
    )
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.out and not args.fit:
        parser.error("give --out (measure) or --fit FILE")
    if args.reps is None:
        args.reps = 2 if args.smoke else 15
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if args.fit:
        print(json.dumps(refit(args.fit), indent=1))
        return 0
    if torch is None:
        print("gpu_attention: PyTorch is not installed", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_attention: no CUDA device (use --smoke)", file=sys.stderr)
        return 2
    sheet = load_gpu_sheet()
    name = args.gpu or (
        sheet_name_for(torch.cuda.get_device_name(0)) if device == "cuda" else "H200"
    )
    if name not in sheet:
        print(
            f"gpu_attention: no GPU-sheet entry {name!r}; pass --gpu", file=sys.stderr
        )
        return 2
    gpu = sheet[name]
    cycles_per_ms = calibrate_sleep() if device == "cuda" else None
    env = environment(device)
    result: dict[str, Any] = {
        **results_header(env, gpu),
        "settings": {
            "precision": "bf16" if device == "cuda" else "fp32 (CPU smoke)",
            "causal": True,
            "reps": args.reps,
            "warmup": args.warmup,
            "backends": list(BACKENDS),
            "grid": "extended (held out)" if args.extended else "default",
        },
        "rows": [],
    }
    for shape in grid(args.smoke, args.extended):
        row = {"name": shape.name, **dataclasses.asdict(shape)}
        row["predicted"] = predict(shape, gpu)
        row["measured"] = {
            backend: time_shape(
                shape,
                backend,
                device,
                cycles_per_ms,
                warmup=args.warmup,
                reps=args.reps,
            )
            for backend in BACKENDS
        }
        result["rows"].append(row)
        line = [
            shape.name,
            f"model {row['predicted']['forward_s'] * 1e3:.3f}/"
            f"{row['predicted']['backward_s'] * 1e3:.3f} ms",
        ]
        for backend, m in row["measured"].items():
            line.append(
                f"{backend} {m['forward_ms']:.3f}/{m['backward_ms']:.3f}"
                if "forward_ms" in m
                else f"{backend} failed: {m['error'][:80]}"
            )
        print("  ".join(line), flush=True)
        result["seconds"] = time.perf_counter() - started
        stamp.write_json(args.out, result)
    result["summary"] = summarize(result, gpu, HALF_PRECISION_ANALYTICAL)
    result["seconds"] = time.perf_counter() - started
    stamp.write_json(args.out, result)
    if args.extended:  # held out: the planner's constants, no fit
        print(json.dumps(result["summary"], indent=1))
        return 0
    print(json.dumps(refit(args.out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
