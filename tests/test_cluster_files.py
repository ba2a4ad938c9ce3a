"""Cluster files: every link described, values named with their units, the
bundled cluster and examples, and device memory never silently dropped."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from helpers import save_with_layer_bytes

import pipedejavu as pdj
from pipedejavu import Cluster, DeviceType, Link, ProblemError
from pipedejavu.cli.main import main
from pipedejavu.core.cluster import FREE_LINK
from pipedejavu.planning.inputs import BUNDLED_CLUSTERS, example_names, load_cluster

A100_V100 = {
    "devices_per_host": 8,
    "device_types": {
        "a100": {"speed": 1.0, "memory_gb": 40},
        "v100": {"speed": 0.5, "memory_gb": 16},
    },
    "hosts": ["a100", "a100", "v100", "v100"],
    "intra_host": {
        "a100": {"latency_us": 5, "bandwidth_gbps": 2400},
        "v100": {"latency_us": 5, "bandwidth_gbps": 1200},
    },
    "inter_host": {
        "default": {"latency_us": 20, "bandwidth_gbps": 25},
        "a100-v100": {"latency_us": 20, "bandwidth_gbps": 10},
    },
}


def _without(section: str, key: str) -> dict:
    data = json.loads(json.dumps(A100_V100))
    del data[section][key]
    return data


def test_the_readme_cluster_is_the_bundled_one():
    bundled = load_cluster("a100-v100-4x8")
    assert bundled == Cluster.from_json(A100_V100)
    assert bundled.shape == (4, 8) and set(BUNDLED_CLUSTERS) == {"a100-v100-4x8"}
    assert bundled.link(0, 2).bandwidth == pytest.approx(10e9 / 8)  # a100-v100
    assert bundled.link(2, 3).bandwidth == pytest.approx(25e9 / 8)  # default
    assert bundled.link(2, 2).latency_s == pytest.approx(5e-6)


@pytest.mark.parametrize(
    ("section", "key", "message"),
    [
        ("inter_host", "default", "between a 'a100' and a 'a100' host"),
        ("intra_host", "v100", "inside a 'v100' host"),
    ],
)
def test_an_undescribed_link_is_an_error_not_free(section, key, message):
    with pytest.raises(ProblemError, match=message):
        Cluster.from_json(_without(section, key))


def test_links_that_cannot_occur_need_no_description():
    data = _without("inter_host", "default")
    data["hosts"] = ["a100", "v100"]  # one host of each: no a100-a100 link
    cluster = Cluster.from_json(data)
    assert cluster.link(0, 1).bandwidth == pytest.approx(10e9 / 8)
    one_host = {
        "devices_per_host": 4,
        "device_types": {"a": {"speed": 1.0}, "unused": {"speed": 2.0}},
        "hosts": ["a"],
        "intra_host": {"a": {"latency_us": 1, "bandwidth_gbps": 100}},
    }
    assert Cluster.from_json(one_host).num_hosts == 1
    with pytest.raises(ProblemError, match="inside a 'a' host"):
        Cluster.from_json({**one_host, "intra_host": {}})


def test_a_link_must_state_latency_and_bandwidth_and_inf_is_free():
    data = json.loads(json.dumps(A100_V100))
    data["inter_host"]["default"] = {"latency_us": 20}
    with pytest.raises(ProblemError, match=r"inter_host\['default'\]: missing"):
        Cluster.from_json(data)
    data["inter_host"]["default"] = {"latency_us": 0, "bandwidth_gbps": "inf"}
    assert Cluster.from_json(data).link(0, 1).bandwidth == math.inf


def test_a_pair_given_twice_is_an_error():
    data = json.loads(json.dumps(A100_V100))
    data["inter_host"]["v100-a100"] = {"latency_us": 1, "bandwidth_gbps": 1}
    with pytest.raises(ProblemError, match="a100-v100 link twice"):
        Cluster.from_json(data)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            ("inter_host", "default", "bandwidth_gbps"),
            -5,
            r"inter_host\['default'\].bandwidth_gbps must be in \[1e-9, 1e10\] or "
            r"\"inf\" \(gigabits per second\), got -5",
        ),
        (
            ("intra_host", "a100", "latency_us"),
            -1,
            r"intra_host\['a100'\].latency_us must be in \[0, 3.6e9\] "
            r"\(microseconds\), got -1",
        ),
        (
            ("device_types", "v100", "speed"),
            0,
            r"device_types\['v100'\].speed must be in \[1e-6, 1e6\] \(relative to "
            r"the profiled device\), got 0",
        ),
        (
            ("device_types", "v100", "memory_gb"),
            -16,
            r"device_types\['v100'\].memory_gb must be in \[1e-6, 1e6\] \(gigabytes\)",
        ),
        (
            ("device_types", "v100", "speed"),
            "fast",
            r"device_types\['v100'\].speed must be a number, got 'fast'",
        ),
        (
            ("inter_host", "default", "latency_us"),
            True,
            r"inter_host\['default'\].latency_us must be a number, got True",
        ),
    ],
)
def test_value_errors_name_the_key_and_the_users_unit(tmp_path, path, value, message):
    data = json.loads(json.dumps(A100_V100))
    data[path[0]][path[1]][path[2]] = value
    with pytest.raises(ProblemError, match=message):
        Cluster.from_json(data)
    file = tmp_path / "c.json"
    file.write_text(json.dumps(data))
    with pytest.raises(ProblemError, match=f"c.json: {message}"):
        Cluster.from_file(file)


def test_structural_errors_are_problem_errors():
    for broken in (
        {**A100_V100, "hosts": "a100"},
        {**A100_V100, "hosts": [1, 2]},
        {**A100_V100, "intra_host": ["a100"]},
        {**A100_V100, "devices_per_host": 2**30},
        {**A100_V100, "device_types": {"a100": 1}},
    ):
        with pytest.raises(ProblemError):
            Cluster.from_json(broken)


def test_python_api_mappings_are_strict_single_links_are_not():
    fast, slow = DeviceType("fast"), DeviceType("slow", 0.5)
    with pytest.raises(ProblemError, match="inter_host does not describe"):
        Cluster.from_types(
            [fast, slow],
            ["fast", "slow"],
            2,
            intra_host=FREE_LINK,
            inter_host={"fast-fast": Link(1.0, 1.0)},
        )
    cluster = Cluster.from_types([fast, slow], ["fast", "slow"], 2)  # free, stated
    assert cluster.link(0, 1) == FREE_LINK


def test_free_links_round_trip_through_json(tmp_path):
    cluster = Cluster.homogeneous(2, 4)
    data = json.loads(json.dumps(cluster.to_json()))  # standard JSON, no Infinity
    assert Cluster.from_json(data) == cluster


def test_cluster_file_memory_is_applied_or_refused(tmp_path, capsys):
    """memory_gb bounds each type's stages where the problem carries what that
    needs (per-layer bytes, or the generated example's model); otherwise the
    cluster is refused in one line, never silently ignored."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps(A100_V100))
    # the generated 4 x 8 example: its model's limits on each type's memory
    typed = pdj.load_problem("generated-gpt-32layers-4x8", cluster=path)
    bundled = pdj.load_example("hetero-gpt-32layers-a100-v100")
    np.testing.assert_array_equal(typed.max_n_succ_stages, bundled.max_n_succ_stages)
    # a problem file with one profiled memory rule: refused, one line
    gen = tmp_path / "gen.npz"
    pdj.load_example("generated-gpt-32layers-4x8").to_npz(gen)
    with pytest.raises(ProblemError, match=r"gen\.npz with .*c\.json: device memory"):
        pdj.load_problem(gen, cluster=path)
    code = main(["inspect", str(gen), "--cluster-file", str(path)])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "memory_gb" in err
    # ... accepted once memory_gb is left out: the profiled rule on every type
    no_memory = json.loads(json.dumps(A100_V100))
    for entry in no_memory["device_types"].values():
        del entry["memory_gb"]
    path.write_text(json.dumps(no_memory))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = pdj.load_problem(gen, cluster=path)
    for t in range(2):
        np.testing.assert_array_equal(
            plain.max_n_succ_stages[..., t],
            pdj.load_problem(gen).max_n_succ_stages,
        )
    code = main(["inspect", str(gen), "--cluster-file", str(path)])
    _, err = capsys.readouterr()
    assert code == 0 and "warning" not in err


def test_cluster_file_memory_uses_the_profiled_layer_bytes(tmp_path):
    """A ``pipedejavu profile``-style .npz (param_bytes, stash_bytes): each
    type gets Alpa's rule for its own memory (LayerMemory)."""
    base = pdj.load_example("generated-gpt-32layers-4x8")
    gen = tmp_path / "prof.npz"
    layers = base.num_layers
    params, stash = np.full(layers, 2e9), np.full(layers, 3e8)
    save_with_layer_bytes(gen, base, params, stash)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(A100_V100))
    typed = pdj.load_problem(gen, cluster=path)
    memory = pdj.LayerMemory(params, stash)
    for t, gb in enumerate((40, 16)):
        expected = memory.max_n_succ_stages(base.submesh_sizes, gb * 1e9)
        np.testing.assert_array_equal(typed.max_n_succ_stages[..., 0, t], expected)
    # the v100 (16 GB) type is bounded more tightly somewhere
    assert (typed.max_n_succ_stages[..., 1] < typed.max_n_succ_stages[..., 0]).any()
    bad = tmp_path / "bad.npz"
    np.savez(bad, **{**dict(np.load(gen)), "param_bytes": np.full(layers, -1.0)})
    with pytest.raises(ProblemError, match=r"bad\.npz: layer_memory bytes"):
        pdj.load_problem(bad, cluster=path)


def test_bundled_examples_and_cluster_work_together(capsys):
    assert {"generated-gpt-32layers-4x8", "hetero-gpt-32layers-a100-v100"} <= set(
        example_names()
    )
    hetero = pdj.load_example("hetero-gpt-32layers-a100-v100")
    assert isinstance(hetero, pdj.HeteroProblem)
    assert hetero.cluster == load_cluster("a100-v100-4x8")
    assert (hetero.boundary_bytes > 0).all()
    # memory per type comes from the cluster file's memory_gb: v100 is tighter
    a100, v100 = (hetero.max_n_succ_stages[..., t] for t in range(2))
    upper = np.triu(np.ones(a100.shape[:2], dtype=bool))
    assert (v100[upper] <= a100[upper]).all() and (v100[upper] < a100[upper]).any()
    code = main(
        [
            "solve",
            "generated-gpt-32layers-4x8",
            "--cluster-file",
            "a100-v100-4x8",
            "--method",
            "alpa",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)
    assert {s["device_type"] for s in plan["stages"]} == {0, 1}
    assert any(t > 0 for t in plan["transfers"])  # activations priced
    code = main(["solve", "hetero-gpt-32layers-a100-v100", "--cluster-file", "x.json"])
    _, err = capsys.readouterr()
    assert code == 2 and "already describes its cluster" in err


#: ``(section, entry, key)`` of every number of a cluster file, the key replacing
#: the one the bundled cluster gives in that unit, and values just outside its
#: documented range.
OUT_OF_RANGE = [
    (("device_types", "v100", "speed"), [1e-7, 2e6, 10**400]),
    (("device_types", "v100", "memory_gb"), [0, -16, 2e6]),
    (("device_types", "v100", "memory_bytes"), [1, 2e15]),
    (("intra_host", "a100", "latency_us"), [-1e-9, 4e9]),
    (("intra_host", "a100", "latency_s"), [-1, 3601, 1e300]),
    (("inter_host", "default", "bandwidth_gbps"), [0, 1e-10, 2e10, "-inf"]),
    (("inter_host", "a100-v100", "bandwidth_bytes_per_s"), [1e-4, 2e18]),
]
_UNIT_TWIN = {
    "memory_bytes": "memory_gb",
    "latency_s": "latency_us",
    "bandwidth_bytes_per_s": "bandwidth_gbps",
}


@pytest.mark.parametrize(
    ("path", "value"),
    [(path, value) for path, values in OUT_OF_RANGE for value in values],
    ids=lambda x: str(x)[:30],
)
def test_every_number_outside_its_documented_range_names_file_and_key(
    tmp_path, capsys, path, value
):
    data = json.loads(json.dumps(A100_V100))
    entry = data[path[0]][path[1]]
    entry.pop(_UNIT_TWIN.get(path[2], path[2]), None)
    entry[path[2]] = value
    file = tmp_path / "c.json"
    file.write_text(json.dumps(data))
    pattern = (
        rf"c.json: {path[0]}\['{path[1]}'\].{path[2]} "
        r"(must be in \[|is too large|must be a number)"
    )
    with pytest.raises(ProblemError, match=pattern):
        Cluster.from_file(file)
    code = main(["inspect", "generated-gpt-32layers-4x8", "--cluster-file", str(file)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and path[2] in err, err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"devices_per_host": 0}, r"devices_per_host must be an integer in \[1, "),
        ({"devices_per_host": 10**30}, r"devices_per_host must be an integer in \[1, "),
        ({"hosts": []}, "hosts must list 1 to 1048576 hosts, got 0"),
        ({"hosts": ["a100"] * (2**20 + 1)}, "hosts must list 1 to 1048576 hosts"),
        ({"devices_per_host": 2**19}, "more than 1048576 devices"),
    ],
)
def test_counts_outside_their_range(tmp_path, change, message):
    file = tmp_path / "c.json"
    file.write_text(json.dumps({**A100_V100, **change}))
    with pytest.raises(ProblemError, match=f"c.json: .*{message}"):
        Cluster.from_file(file)


def test_the_python_api_checks_the_same_ranges():
    with pytest.raises(ProblemError, match=r"speed must be in \[1e-6, 1e6\]"):
        DeviceType("x", speed=1e7)
    with pytest.raises(ProblemError, match=r"memory_bytes must be in \[1000, 1e15\]"):
        DeviceType("x", memory_bytes=1e16)
    with pytest.raises(ProblemError, match=r"latency_s must be in \[0, 3600\]"):
        Link(math.nan)
    with pytest.raises(ProblemError, match=r"bandwidth must be in \[0.001, 1e18\]"):
        Link(0.0, 1e19)
    assert Link(0.0, math.inf).bandwidth == math.inf


def test_a_toml_integer_too_long_to_convert_is_one_line(tmp_path):
    """tomllib raises ValueError (not its decode error) for an integer of
    more than 4,300 digits: one line naming the file, not a traceback."""
    path = tmp_path / "cluster.toml"
    path.write_text("devices_per_host = " + "9" * 5000 + "\n")
    with pytest.raises(ProblemError, match=r"cluster\.toml: not a valid TOML file"):
        Cluster.from_file(path)
