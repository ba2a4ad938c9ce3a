"""benchmarks/gpu_fp8_gemms.py without a GPU: its grid against the model's
operation list, its predictions against the planner's, its time estimate, its
operand layouts and the summary; the CPU smoke run writes every field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import load_benchmark

from pipedejavu.costmodel.analytical.layers import (
    WEIGHT_GRADIENT_OPS,
    analytical_layer_times,
)
from pipedejavu.costmodel.analytical.ops import Gemm, backward_gemms
from pipedejavu.costmodel.analytical.roofline import (
    FP8_CAST_BYTES,
    HALF_PRECISION_ANALYTICAL,
    fp8_cast_bytes,
    pass_seconds,
)
from pipedejavu.io.gpu_sheet import load_gpu_sheet

fp8 = load_benchmark("gpu_fp8_gemms")
SHEET = load_gpu_sheet()
FP8_GPUS = [name for name, gpu in SHEET.items() if dict(gpu.peak_flops).get("fp8")]
DEFAULT_ROWS = fp8.build_rows(
    fp8.default_models(), fp8.DEFAULT_SAMPLES, SHEET["H100-SXM"]
)
NAMES = {
    layer + suffix for layer in fp8.LINEAR_LAYERS for suffix in ("", ".dgrad", ".wgrad")
}


def _use_op(use: str, precision: str) -> Gemm:
    """The model's operation a row's use names, rebuilt from the preset."""
    model, tp, mbs, seq, name = use.split()
    spec = next(spec for spec, _ in fp8.default_models() if spec.name == model)
    block = fp8.with_seq_length(spec, int(seq[1:]))
    ops = fp8.linear_gemms(block, int(mbs[1:]), int(tp[2:]), precision)
    return next(op for op in ops if op.name == name)


def test_each_block_has_the_twelve_linear_gemms_the_planner_prices():
    for spec, tp in fp8.default_models():
        for precision in ("bf16", "fp8"):
            ops = fp8.linear_gemms(spec, 1, tp, precision)
            assert sorted(op.name for op in ops) == sorted(NAMES)
            # The weight gradients are the zero-bubble W of the linear layers.
            wgrads = {op.name for op in ops if fp8.gemm_kind(op.name) == "wgrad"}
            assert wgrads == set(WEIGHT_GRADIENT_OPS) & NAMES
            assert {op.input_bytes for op in ops} == {2.0 if precision == "bf16" else 1}
            assert {op.precision for op in ops} == {precision}


def test_grid_shapes_are_the_ops_shapes_and_flops():
    uses = [use for row in DEFAULT_ROWS for use in row["uses"]]
    # 6 (model, tp) x 6 (mbs, seq) x 12 GEMMs, each measured once per shape.
    assert len(uses) == len(set(uses)) == 6 * 6 * 12
    assert len(DEFAULT_ROWS) == 6 * 4 * 12  # four distinct token counts
    for row in DEFAULT_ROWS:
        m, n, k = row["m"], row["n"], row["k"]
        assert all(size % 16 == 0 for size in (m, n, k))  # _scaled_mm's rule
        for precision in ("bf16", "fp8"):
            assert row["predicted"][precision]["flops"] == 2 * m * n * k
        for use in row["uses"]:
            for precision in ("bf16", "fp8"):
                op = _use_op(use, precision)
                assert (op.m, op.n, op.k) == (m, n, k)
                assert op.flops == 2 * m * n * k
                assert fp8.gemm_kind(op.name) == row["kind"]


def test_fp8_quantization_is_priced_per_element_of_the_16_bit_operand():
    """Current scaling: 6 bytes per element of a forward's input and of an
    input gradient's output gradient; none for weight gradients or bf16."""
    gpu = SHEET["H100-SXM"]
    forward = Gemm("linear_fc1", 1, 4096, 1024, 2048, 1, 2, "fp8")
    dgrad, wgrad = backward_gemms(forward)
    assert fp8_cast_bytes(forward) == FP8_CAST_BYTES * 4096 * 2048 == 6 * 4096 * 2048
    assert fp8_cast_bytes(dgrad) == 6 * 4096 * 1024
    assert fp8_cast_bytes(wgrad) == 0
    assert fp8_cast_bytes(forward._replace(precision="bf16")) == 0
    c = HALF_PRECISION_ANALYTICAL
    for gemm, efficiency in ((forward, 1.0), (dgrad, c.backward_memory_efficiency)):
        added = pass_seconds([gemm], gpu, c) - pass_seconds(
            [gemm], gpu, c, fp8_casts=False
        )
        bandwidth = gpu.memory_bandwidth_bytes_per_s * c.memory_efficiency
        expected = fp8_cast_bytes(gemm) / (bandwidth * efficiency)
        assert added == pytest.approx(expected + 2 * c.kernel_overhead_s, rel=1e-9)
    assert pass_seconds([wgrad], gpu, c) == pass_seconds(
        [wgrad], gpu, c, fp8_casts=False
    )


@pytest.mark.parametrize("gpu", ["H100-SXM", "H200"])
def test_predictions_are_what_the_planner_adds_for_fp8(gpu):
    """The planner's fp8 block differs from its bf16 block by exactly these
    GEMMs' predicted differences and their operands' quantizations: the check
    prices what the planner prices."""
    for spec, tp in fp8.default_models():
        mbs, seq = 2, 4096
        block = fp8.with_seq_length(spec, seq)
        rows = fp8.build_rows([(spec, tp)], [(mbs, seq)], SHEET[gpu])
        assert sum(len(row["uses"]) for row in rows) == 12
        times = {
            precision: analytical_layer_times(
                block,
                SHEET[gpu],
                mbs,
                tp,
                precision,
                constants=HALF_PRECISION_ANALYTICAL,
            )
            for precision in ("bf16", "fp8")
        }
        planner = sum(times["fp8"][part][1] - times["bf16"][part][1] for part in (0, 1))
        ours = sum(
            row["predicted"]["fp8"]["seconds"] - row["predicted"]["bf16"]["seconds"]
            for row in rows
        )
        ops = [_use_op(row["uses"][0], "fp8") for row in rows]
        casts = sum(
            pass_seconds([op], SHEET[gpu], HALF_PRECISION_ANALYTICAL)
            - pass_seconds([op], SHEET[gpu], HALF_PRECISION_ANALYTICAL, fp8_casts=False)
            for op in ops
        )
        assert casts > 0
        np.testing.assert_allclose(ours + casts, planner, rtol=1e-9)
        for row, op in zip(rows, ops, strict=True):
            np.testing.assert_allclose(
                row["predicted"]["fp8"]["seconds"],
                pass_seconds(
                    [op], SHEET[gpu], HALF_PRECISION_ANALYTICAL, fp8_casts=False
                ),
                rtol=1e-12,
            )


@pytest.mark.parametrize("gpu", FP8_GPUS)
def test_predicted_fp8_is_never_slower_and_twice_as_fast_when_large(gpu):
    rows = fp8.build_rows(fp8.default_models(), fp8.DEFAULT_SAMPLES, SHEET[gpu])
    rows += fp8.build_rows(fp8.smoke_models(), fp8.SMOKE_SAMPLES, SHEET[gpu])
    for row in rows:
        half, eight = (row["predicted"][p]["seconds"] for p in ("bf16", "fp8"))
        assert eight <= half * (1 + 1e-12), row["name"]
    largest = max(rows, key=lambda row: row["predicted"]["bf16"]["flops"])
    assert largest["name"] == "Llama-3-70B tp4 mlp_up t16384"
    pred = largest["predicted"]
    assert pred["bf16"]["bound"] == pred["fp8"]["bound"] == "compute"
    # The sheet's fp8 peak is (about) twice the bf16 one; the efficiency curve
    # is flat at this size, so the speed-up is close to the peaks' ratio.
    peaks = SHEET[gpu].peak("fp8") / SHEET[gpu].peak("bf16")
    speedup = pred["bf16"]["seconds"] / pred["fp8"]["seconds"]
    assert peaks > 1.9
    assert 0.95 * peaks < speedup <= peaks * (1 + 1e-12)


def test_a_gpu_without_an_fp8_peak_is_priced_in_bf16_only():
    rows = fp8.build_rows(fp8.smoke_models(), fp8.SMOKE_SAMPLES, SHEET["A100-80"])
    for row in rows:
        assert "seconds" in row["predicted"]["bf16"]
        assert "no fp8 peak" in row["predicted"]["fp8"]["error"]
        estimate = fp8.estimate_seconds(row, 5, 40, casts=True, gpu=SHEET["A100-80"])
        assert estimate > 0


@pytest.mark.parametrize("gpu", ["H100-SXM", "H200"])
def test_default_grid_fits_three_minutes_with_room(gpu):
    rows = fp8.build_rows(fp8.default_models(), fp8.DEFAULT_SAMPLES, SHEET[gpu])
    args = fp8.parse_args(["--out", "x.json"])
    seconds = fp8.STARTUP_S + sum(
        fp8.estimate_seconds(row, args.warmup, args.reps, casts=True, gpu=SHEET[gpu])
        for row in rows
    )
    assert 20 < seconds < 0.5 * 180 < args.max_seconds < 180


@pytest.mark.parametrize("kind", fp8.KINDS)
def test_operands_hold_the_product_in_the_layout_fp8_needs(kind):
    torch = pytest.importorskip("torch")
    m, n, k = 32, 48, 64
    operands = fp8.bf16_operands(kind, m, n, k, "cpu")
    out = operands["call"]()
    assert (
        tuple(out.shape) == operands["out"] == ((n, m) if kind == "wgrad" else (m, n))
    )
    a, b = operands["a"], operands["b"]
    assert a.is_contiguous() and b.is_contiguous() and a.shape[1] == b.shape[1] == k
    reference = a.double() @ b.double().t()  # what _scaled_mm(a, b.t()) computes
    np.testing.assert_allclose(out.double().numpy(), reference.numpy(), atol=0.1)
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip(f"torch {torch.__version__} has no _scaled_mm")
    call_fn, info = fp8._fp8_call(operands, kind, "cpu")
    gradient = "float8_e5m2" if kind != "forward" else "float8_e4m3fn"
    assert (info["a_dtype"], info["b_dtype"]) == (gradient, "float8_e4m3fn")
    assert info["use_fast_accum"] == (kind == "forward")
    result = call_fn()
    assert result.dtype == torch.bfloat16
    scale = reference.abs().max().item()
    np.testing.assert_allclose(
        result.double().numpy(), reference.numpy(), atol=0.1 * scale
    )


def _row(kind, bf16_ms, fp8_ms, pred_bf16_s, pred_fp8_s, casts_ms=None):
    row = {
        "name": f"hand-made {kind}",
        "m": 1024,
        "n": 1024,
        "k": 1024,
        "kind": kind,
        "predicted": {
            "bf16": {"seconds": pred_bf16_s, "flops": 2e12},
            "fp8": {"seconds": pred_fp8_s, "flops": 2e12},
        },
        "measured": {
            "bf16": {"status": "ok", "median": bf16_ms},
            "fp8": (
                {"status": "ok", "median": fp8_ms}
                if fp8_ms is not None
                else {"status": "not run: no CUDA"}
            ),
        },
    }
    if casts_ms is not None:
        row["measured"]["casts"] = {
            "a": {"median": casts_ms, "elements": 10**6},
            "b": {"median": casts_ms, "elements": 10**6},
        }
    row["comparison"] = fp8.compare(row, SHEET["H100-SXM"])
    return row


def test_compare_and_summary_by_hand():
    rows = [
        _row("forward", 4.0, 2.5, 0.0036, 0.0020, casts_ms=0.01),  # -10%, -20%
        _row("forward", 2.0, 1.0, 0.0022, 0.0010),  # +10%, 0%; x2.0 vs x2.2
        _row("wgrad", 1.0, None, 0.0005, 0.0003),  # bf16 -50%, no fp8
        {
            "name": "skipped",
            "kind": "dgrad",
            "m": 16,
            "n": 16,
            "k": 16,
            "status": "skipped: limit",
        },
    ]
    first = rows[0]["comparison"]
    np.testing.assert_allclose(first["bf16"]["error"], -0.1)
    np.testing.assert_allclose(first["fp8"]["abs_error"], 0.2)
    np.testing.assert_allclose(first["fp8"]["measured_s"], 2.5e-3)
    np.testing.assert_allclose(first["bf16"]["tflops"], 2e12 / 4e-3 / 1e12)
    np.testing.assert_allclose(first["speedup"]["measured"], 1.6)
    np.testing.assert_allclose(first["speedup"]["predicted"], 1.8)
    np.testing.assert_allclose(first["speedup"]["error"], 1.8 / 1.6 - 1)
    np.testing.assert_allclose(first["casts"]["share_of_fp8_gemm"], 0.02 / 2.5)
    priced = 2 * fp8.cast_price(10**6, SHEET["H100-SXM"])
    np.testing.assert_allclose(first["casts"]["priced_s"], priced)
    assert "fp8" not in rows[2]["comparison"]
    assert "speedup" not in rows[2]["comparison"]
    summary = fp8.summarize(rows)
    assert list(summary) == ["all", "forward", "wgrad"]
    everything = summary["all"]
    assert everything["bf16"]["count"] == 3 and everything["fp8"]["count"] == 2
    np.testing.assert_allclose(everything["bf16"]["median_abs"], 0.1)
    np.testing.assert_allclose(everything["bf16"]["max_abs"], 0.5)
    np.testing.assert_allclose(everything["bf16"]["median_signed"], -0.1)
    np.testing.assert_allclose(everything["fp8"]["max_abs"], 0.2)
    np.testing.assert_allclose(everything["speedup"]["max_abs"], 0.125)
    np.testing.assert_allclose(everything["speedup"]["measured_median"], 1.8)
    np.testing.assert_allclose(everything["speedup"]["predicted_median"], 2.0)
    assert everything["casts"]["count"] == 1
    assert summary["wgrad"]["fp8"]["median_abs"] is None
    fp8.print_table(rows, summary)  # prints rows of every status


def test_smoke_run_writes_every_field(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    assert fp8.main(["--smoke", "--out", str(out), "--gpu", "H200"]) == 0
    result = json.loads(out.read_text())
    for key in ("date", "machine", "environment", "grid", "rows", "summary"):
        assert result[key], key
    env = result["environment"]
    assert {"device_name", "torch", "cuda", "python"} <= set(env)
    assert result["gpu_sheet_entry"]["name"] == "H200"
    assert result["constants"]["name"] == "HALF_PRECISION_ANALYTICAL"
    rows = fp8.build_rows(fp8.smoke_models(), fp8.SMOKE_SAMPLES, SHEET["H200"])
    assert result["grid"]["num_gemms"] == len(result["rows"]) == len(rows)
    torch_missing = env["torch"] is None
    for row in result["rows"]:
        assert row["predicted"]["fp8"]["seconds"] > 0  # priced without a GPU
        statuses = {row["measured"][p]["status"] for p in ("bf16", "fp8")}
        if torch_missing:
            assert statuses == {"not run: PyTorch is not installed"}
        else:
            assert row["measured"]["bf16"]["status"] == "ok"
            assert row["measured"]["fp8"]["status"] == "not run: no CUDA"
            assert row["comparison"]["bf16"]["measured_s"] > 0
            assert "speedup" not in row["comparison"]
    assert set(result["summary"]) == {"all", *fp8.KINDS} or torch_missing
    printed = capsys.readouterr().out
    assert "estimated" in printed and "summary:" in printed


def test_the_time_limit_skips_and_still_writes(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "limited.json"
    argv = ["--smoke", "--out", str(out), "--max-seconds", "0", "--only", "llama"]
    assert fp8.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["rows"] and all(
        row["status"].startswith("skipped: limit") for row in result["rows"]
    )
    assert len(result["skipped"]) == len(result["rows"])
    assert all(
        any("tiny-llama" in use for use in row["uses"]) for row in result["rows"]
    )


def test_bad_arguments_are_refused(tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert fp8.main(["--smoke", "--out", out, "--gpu", "H9000"]) == 2
    assert "unknown GPU 'H9000'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fp8.parse_args(["--out", out, "--reps", "0"])
