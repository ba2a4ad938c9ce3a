"""The GPU sheet: bundled entries, agreement with Sailor's names, user files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipedejavu.cli.main import main
from pipedejavu.core.errors import ProblemError
from pipedejavu.core.gpu_sheet import PEAK_PRECISIONS, GpuSheetEntry
from pipedejavu.core.plan3d import Plan3D
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.sailor_data import bundled_sailor_dir
from pipedejavu.io.gpu_sheet import MAX_GPU_SHEET_BYTES, load_gpu_sheet
from pipedejavu.io.model_config import load_model_spec

EXPECTED = (
    "A100-40", "A100-80", "H100-SXM", "H100-PCIe", "H100-96GB-500W", "H200", "H800",
    "GH-96", "B200", "B300", "GB200", "GB300", "L4", "L40S", "V100-16", "V100-32",
    "RTX-3090", "RTX-4090", "Titan-RTX", "RTX-2080", "MI250X", "MI300X",
)  # fmt: skip
#: NVIDIA publishes no multiprocessor count or clock for these (GPUS.md).
BLACKWELL = ("B200", "B300", "GB200", "GB300")
# Sailor's cloud nodes hold 4 A100s; the sheet gives a DGX A100's 8.
NODE_SIZE_DIFFERS_FROM_SAILOR = {"A100-40", "A100-80"}


def test_bundled_sheet_has_every_gpu_with_sources():
    sheet = load_gpu_sheet()
    assert set(EXPECTED) <= set(sheet)
    for name in sheet:
        entry = sheet[name]
        assert entry.sources and entry.note, name
        for precision, value in entry.peak_flops:
            assert precision in PEAK_PRECISIONS and math.isfinite(value) and value > 0


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("A100-80", "bf16", 312),
        ("A100-40", "tf32", 156),
        ("H100-SXM", "bf16", 989.4),
        ("H100-SXM", "fp8", 1978.9),
        ("H100-PCIe", "fp16", 756),
        ("H200", "bf16", 989.4),
        ("V100-32", "fp16", 125),
        ("MI300X", "bf16", 1307.4),
        # HGX B200 and B300: the 8-GPU table's dense FP4 and sparse others, per GPU
        ("B200", "bf16", 36_000 / 8 / 2),
        ("B200", "fp4", 72_000 / 8),
        ("B300", "fp8", 72_000 / 8 / 2),
        ("B300", "fp4", 108_000 / 8),
        # NVL72 racks: the rack's figures over 72 GPUs
        ("GB200", "bf16", 360_000 / 72 / 2),
        ("GB200", "fp4", 1_440_000 / 72 / 2),
        ("GB300", "fp8", 720_000 / 72 / 2),
        ("GB300", "fp4", 1_080_000 / 72),
        ("H100-96GB-500W", "bf16", 989.4),
    ],
)
def test_dense_peaks(name, precision, tflops):
    np.testing.assert_allclose(load_gpu_sheet()[name].peak(precision), tflops * 1e12)


def test_multiprocessors_and_clock_agree_with_the_tensor_peaks():
    """A 16-bit tensor peak over multiprocessors x clock is the tensor cores'
    FLOP per clock per multiprocessor: a power of two on every entry (so a
    wrong count or clock shows); it sets the exponentials' price."""
    sheet = load_gpu_sheet()
    per_clock = {}
    unknown = [name for name in sheet if sheet[name].multiprocessors is None]
    assert sorted(unknown) == sorted(BLACKWELL)
    for name in set(sheet) - set(unknown):
        entry = sheet[name]
        assert entry.multiprocessors and entry.clock_hz, name
        half = dict(entry.peak_flops).get("bf16") or entry.peak("fp16")
        ratio = half / (entry.multiprocessors * entry.clock_hz)
        power = 2.0 ** round(math.log2(ratio))
        assert ratio == pytest.approx(power, rel=0.02), (name, ratio)
        per_clock[name] = power
        assert entry.exponentials_per_s == 16 * entry.multiprocessors * entry.clock_hz
    assert per_clock["H100-SXM"] == per_clock["H200"] == 4096
    assert per_clock["H100-96GB-500W"] == 4096
    assert per_clock["A100-80"] == 2048 and per_clock["V100-16"] == 1024


def test_precisions_a_gpu_lacks_are_absent():
    sheet = load_gpu_sheet()
    with pytest.raises(KeyError, match="no fp8"):
        sheet["A100-80"].peak("fp8")
    assert "bf16" not in sheet["V100-16"].precisions
    assert "tf32" not in sheet["Titan-RTX"].precisions
    with_fp4 = [name for name in sheet if "fp4" in sheet[name].precisions]
    assert sorted(with_fp4) == sorted(BLACKWELL)
    with pytest.raises(KeyError, match="no fp4"):
        sheet["H100-SXM"].peak("fp4")


@pytest.mark.parametrize("name", BLACKWELL)
def test_blackwell_entries_agree_with_their_architecture(name):
    """Dense peaks double from TF32 to 16 bits to FP8; FP4 doubles FP8 on
    Blackwell and triples it on Blackwell Ultra (B300, GB300: 1.5x the
    Blackwell FP4); NVLink 5 is 900 GB/s one way; one NIC per GPU, 400 Gb/s
    ConnectX-7 (B200, GB200) or 800 Gb/s ConnectX-8 (B300, GB300); an NVL72
    node is its 72-GPU NVLink domain."""
    entry = load_gpu_sheet()[name]
    peak = dict(entry.peak_flops)
    assert peak["fp16"] == peak["bf16"] == 2 * peak["tf32"]
    assert peak["fp8"] == 2 * peak["bf16"]
    ultra = name in ("B300", "GB300")
    assert peak["fp4"] == pytest.approx((3 if ultra else 2) * peak["fp8"])
    assert entry.intra_node_bytes_per_s == 1.8e12 / 2
    nic_bits = 800e9 if ultra else 400e9
    per_gpu = entry.inter_node_bytes_per_s / entry.gpus_per_node
    assert per_gpu == pytest.approx(nic_bits / 8)
    assert entry.gpus_per_node == (72 if name.startswith("GB") else 8)
    assert entry.memory_bandwidth_bytes_per_s == 8e12
    assert entry.exponentials_per_s is None


def test_sheet_agrees_with_sailor_cluster_config():
    with open(bundled_sailor_dir() / "configs" / "basic_cluster_config.json") as f:
        sailor = {k: v for k, v in json.load(f).items() if isinstance(v, dict)}
    sheet = load_gpu_sheet()
    for name, spec in sailor.items():
        entry = sheet[name]
        if name not in NODE_SIZE_DIFFERS_FROM_SAILOR:
            assert entry.gpus_per_node == spec["gpus_per_node"], name
        # Sailor gives usable bytes; the sheet the nominal capacity.
        np.testing.assert_allclose(entry.memory_bytes, spec["mem_per_gpu"], rtol=0.05)


def test_aliases_resolve_but_are_not_listed():
    sheet = load_gpu_sheet()
    assert sheet["H100"] is sheet["H100-SXM"] and sheet["A100"] is sheet["A100-80"]
    assert "H100" in sheet and "H100" not in list(sheet)
    assert sheet["GB200-NVL72"] is sheet["GB200"]
    assert sheet["gb300-nvl72"] is sheet["GB300"]
    with pytest.raises(KeyError, match="not on the GPU sheet"):
        sheet["B100"]


def _write(tmp_path, data):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(data))
    return path


NEW_GPU = {
    "memory_bytes": 192e9,
    "memory_bandwidth_bytes_per_s": 8e12,
    "peak_flops": {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15},
    "gpus_per_node": 8,
    "intra_node_bytes_per_s": 900e9,
    "inter_node_bytes_per_s": 400e9,
}


def test_user_file_extends_and_overrides(tmp_path):
    path = _write(
        tmp_path,
        {
            "gpus": {
                "X200": NEW_GPU,
                "A100-80": {"gpus_per_node": 4, "peak_flops": {"bf16": 300e12}},
            },
            "aliases": {"blackwell": "X200"},
        },
    )
    sheet = load_gpu_sheet(path)
    assert sheet["blackwell"].peak("fp8") == 4.5e15
    assert sheet["blackwell"].peak("fp4") == 9e15
    a100 = sheet["A100-80"]
    assert a100.gpus_per_node == 4 and a100.peak("bf16") == 300e12
    assert a100.peak("fp16") == 312e12  # untouched fields stay
    assert isinstance(a100, GpuSheetEntry)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"gpus": {"X": {**NEW_GPU, "memory_bytes": -1}}}, "memory_bytes must be"),
        ({"gpus": {"X": {**NEW_GPU, "memory_bytes": "80GB"}}}, "memory_bytes must"),
        ({"gpus": {"X": {**NEW_GPU, "peak_flops": {"int4": 1e15}}}}, "precision"),
        ({"gpus": {"X": {**NEW_GPU, "peak_flops": {"bf16": None}}}}, "peak bf16"),
        ({"gpus": {"X": {**NEW_GPU, "gpus_per_node": 2.5}}}, "gpus_per_node"),
        (
            {"gpus": {"X": {**NEW_GPU, "gpus_per_node": 10**12}}},
            "gpus_per_node must be at most 4096",
        ),
        ({"gpus": {"X": {**NEW_GPU, "speed": 1}}}, "unknown field 'speed'"),
        (
            {"gpus": {"X": {**NEW_GPU, "multiprocessors": 132}}},
            "multiprocessors and clock_hz together",
        ),
        (
            {"gpus": {"X": {**NEW_GPU, "multiprocessors": 0, "clock_hz": 1e9}}},
            "multiprocessors must be an integer",
        ),
        (
            {"gpus": {"X": {**NEW_GPU, "multiprocessors": 8, "clock_hz": 1e12}}},
            "clock_hz must be at most",
        ),
        ({"gpus": {"X": {"memory_bytes": 1e9}}}, "missing field"),
        ({"gpus": {"A100-80": {"inter_node_bytes_per_s": 0}}}, "inter_node"),
        ({"gpus": [1, 2]}, "'gpus' must map"),
        ({"gpus": {}, "aliases": {"x": "nope"}}, "alias 'x'"),
        ({"gpu": {}}, "unknown key 'gpu'"),
    ],
)
def test_bad_user_files_give_one_line_naming_the_file(tmp_path, data, match):
    path = _write(tmp_path, data)
    with pytest.raises(ProblemError, match=match) as caught:
        load_gpu_sheet(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"{", "invalid JSON"),
        (b"null", "must be a JSON object"),
        (b"\x80\x81", "not UTF-8"),
        (b" " * (MAX_GPU_SHEET_BYTES + 1), "larger than"),
        (b'{"gpus": {"A100-80": {"memory_bytes": 1e999}}}', "finite"),
    ],
)
def test_hostile_user_files(tmp_path, content, match):
    path = tmp_path / "gpus.json"
    path.write_bytes(content)
    with pytest.raises(ProblemError, match=match) as caught:
        load_gpu_sheet(path)
    assert str(path) in str(caught.value)


def test_missing_user_file(tmp_path):
    with pytest.raises(ProblemError, match="cannot read GPU sheet"):
        load_gpu_sheet(tmp_path / "absent.json")


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("H100-80", "H100-SXM"),  # nvidia-smi: "NVIDIA H100 80GB HBM3", the SXM
        ("H100-80GB", "H100-SXM"),
        ("h100-80gb", "H100-SXM"),
        ("A100-80GB", "A100-80"),
        ("A100-40GB", "A100-40"),
        ("V100-16GB", "V100-16"),
        ("H100-PCIe-80GB", "H100-PCIe"),
        ("GH200-96", "GH-96"),
        ("H200-141GB", "H200"),
        ("RTX-2080-11GB", "RTX-2080"),
        ("B200-180GB", "B200"),  # DGX B200: 1,440 GB over 8
        ("GB200-186", "GB200"),
        ("B300-288GB", "B300"),
    ],
)
def test_a_name_with_its_memory_resolves(given, canonical):
    sheet = load_gpu_sheet()
    assert given in sheet and sheet.resolve(given) == canonical
    assert sheet[given] is sheet[canonical]


@pytest.mark.parametrize(
    "given", ["H100-94", "A100-SXM-40", "RTX-3090GB", "B200-80", "B200-192", "H100-96"]
)
def test_a_memory_the_gpu_does_not_have_is_unknown(given):
    # the size is checked against the entry, not stripped: an H100 NVL (94 GB)
    # is not the sheet's H100, and A100-SXM (80 GB) with 40 is not either A100
    sheet = load_gpu_sheet()
    assert given not in sheet
    with pytest.raises(KeyError, match="memory in GB appended"):
        sheet.resolve(given)


def test_a_blackwell_cluster_is_built_from_its_node_size(capsys):
    """``--gpus B200:16`` places two DGX B200 nodes of 8; a GB200 node is its
    NVL72 rack, so TP may span more than 8 GPUs there (within 72), never on a
    B200."""
    code = main(
        ["plan", "--model", "Qwen2.5-7B", "--gpus", "B200:16", "--global-batch", "64"]
        + ["--json"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = Plan3D.from_json(json.loads(out))
    gpus_by_node: dict[int, int] = {}
    for stage in plan.stages:
        for replica in stage.replicas:
            assert replica.gpu_type == "B200"
            gpus_by_node[replica.node] = gpus_by_node.get(replica.node, 0) + replica.tp
    assert gpus_by_node == {0: 8, 1: 8}
    source = AnalyticalSource(load_model_spec("GPT-3-175B"), load_gpu_sheet())
    assert max(source.tp_values("B200")) == 8
    wide = source.tp_values("GB200")
    assert all(72 % tp == 0 for tp in wide) and max(wide) > 8
