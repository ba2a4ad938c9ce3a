"""Published runs: the vendored SC'21 table, its 16-bit constants, predictions."""

import json
from pathlib import Path

import numpy as np
import pytest

from pipedejavu.core.gpu_sheet import GpuSheetEntry
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.analytical.ops import Gemm
from pipedejavu.costmodel.analytical.roofline import (
    FITTED_ANALYTICAL,
    HALF_PRECISION_ANALYTICAL,
    MEASURED_TENSOR_EFFICIENCY,
    pass_seconds,
)
from pipedejavu.planning.moe_published import MOE_FIELDS
from pipedejavu.planning.published_runs import (
    FITTED_FIELDS,
    bundled_published_path,
    fit_half_precision,
    fit_tensor_efficiency,
    load_published_runs,
    predict_published,
)

GEMMS = Path(__file__).parents[1] / "benchmarks" / "results" / "gpu_fp8_gemms.json"


def _measured_gemms():
    """The bf16 GEMMs timed on an H200: (Gemm, measured seconds) in file order,
    and the sheet entry they were priced with."""
    data = json.loads(GEMMS.read_text())
    entry = data["gpu_sheet_entry"]
    gpu = GpuSheetEntry(
        entry["name"],
        entry["memory_bytes"],
        entry["memory_bandwidth_bytes_per_s"],
        tuple((name, peak) for name, peak in entry["peak_flops"]),
        entry["gpus_per_node"],
        entry["intra_node_bytes_per_s"],
        entry["inter_node_bytes_per_s"],
    )
    pairs = []
    for row in data["rows"]:
        measured = row["measured"]["bf16"]
        if measured.get("status") != "ok":
            continue
        name = "linear" if row["kind"] == "forward" else f"linear.{row['kind']}"
        gemm = Gemm(name, 1, row["m"], row["n"], row["k"], 2, 2, "bf16")
        assert gemm.flops == row["predicted"]["bf16"]["flops"]
        pairs.append((gemm, measured["median"] * 1e-3))
    return pairs, gpu


def test_tensor_efficiency_is_fitted_on_measured_gemms():
    """The frozen constant is the fit on every other measured GEMM; the held-out
    half is priced within 5% (median; measured 2.5%)."""
    pairs, gpu = _measured_gemms()
    assert len(pairs) == 288
    fit, held = pairs[0::2], pairs[1::2]
    value = fit_tensor_efficiency([g for g, _ in fit], [t for _, t in fit], gpu)
    assert value == pytest.approx(MEASURED_TENSOR_EFFICIENCY, abs=5e-5)
    errors = [
        pass_seconds([g], gpu, HALF_PRECISION_ANALYTICAL) / t - 1 for g, t in held
    ]
    assert HALF_PRECISION_ANALYTICAL.tensor_efficiency == MEASURED_TENSOR_EFFICIENCY
    assert np.median(np.abs(errors)) <= 0.05


def test_tensor_efficiency_fit_refuses_bad_input():
    pairs, gpu = _measured_gemms()
    gemm = pairs[0][0]
    with pytest.raises(ValueError, match="one measured time per GEMM"):
        fit_tensor_efficiency([gemm], [], gpu)
    with pytest.raises(ValueError, match="positive"):
        fit_tensor_efficiency([gemm], [0.0], gpu)
    with pytest.raises(ValueError, match="tensor-core"):
        fit_tensor_efficiency([gemm._replace(precision="fp32")], [1e-3], gpu)


def test_the_ten_runs_are_read_as_launched():
    runs = load_published_runs()
    assert len(runs) == 10
    by_id = {run.run_id: run for run in runs}
    big = by_id["sc21_table1_530B"].run
    assert (big.tp, big.pp, big.virtual_chunks) == (8, 35, 3)
    assert big.recompute_full and big.precision == "fp16"
    assert not big.flash_attention and big.attention_dropout
    assert (
        sum(run.num_gpus for run in runs)
        == 32 + 64 + 128 + 256 + 512 + 1024 + 1536 + 1920 + 2520 + 3072
    )


def test_frozen_constants_predict_the_runs():
    runs = load_published_runs()
    measured = np.array([run.tflops_per_gpu for run in runs])
    errors = predict_published(runs, HALF_PRECISION_ANALYTICAL) / measured - 1
    # In-sample (the constants were fitted on these runs); the benchmark
    # reports leave-one-out. Only the FITTED_FIELDS and the measured tensor
    # efficiency differ from the profiles' fit (and the mixtures of experts'
    # constants, fitted on the MoE runs, which dense models never read).
    assert np.median(np.abs(errors)) <= 0.02
    assert np.abs(errors).max() <= 0.055
    for field in FITTED_ANALYTICAL.__dataclass_fields__:
        if field not in (*FITTED_FIELDS, *MOE_FIELDS, "tensor_efficiency"):
            assert getattr(HALF_PRECISION_ANALYTICAL, field) == getattr(
                FITTED_ANALYTICAL, field
            )


@pytest.mark.slow
def test_refit_reproduces_the_frozen_constants():
    fitted = fit_half_precision(load_published_runs())
    for field in FITTED_FIELDS:
        np.testing.assert_allclose(
            getattr(fitted, field), getattr(HALF_PRECISION_ANALYTICAL, field), atol=2e-3
        )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[]", "expected an object with a list of runs"),
        ('{"runs": [3]}', "is not an object"),
        ('{"runs": [{"model": {}}]}', "missing model.seq_length"),
        ("{not json", "invalid JSON"),
    ],
)
def test_bad_files_fail_with_one_line(tmp_path, content, message):
    path = tmp_path / "runs.json"
    path.write_text(content)
    with pytest.raises(ProblemError, match=message) as info:
        load_published_runs(str(path))
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_record_with_a_bad_number(tmp_path):
    runs = json.loads((bundled_published_path()).read_text())
    runs["runs"][0]["model"]["num_layers"] = -4
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))
    with pytest.raises(ProblemError, match="model.num_layers must be a positive"):
        load_published_runs(str(path))
