"""DeepSpeed elasticity port: reference answers, hand-computed cases, brute force."""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest
from helpers import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.planning import deepspeed_elastic as elastic
from pipedejavu.planning.deepspeed_elastic import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    get_best_candidates,
    get_candidate_batch_sizes,
    get_valid_gpus,
)

_CASES = json.loads(
    gzip.decompress(
        (
            Path(__file__).parent / "fixtures" / "reference" / "elastic_cases.json.gz"
        ).read_bytes()
    )
)


def _decode(value):
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        return {key: _decode(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _check_error(raised: BaseException, expected: dict) -> None:
    names = [cls.__name__ for cls in type(raised).__mro__]
    assert expected["type"] in names, (type(raised), expected)
    message = expected.get("message_without_numpy_scalar_repr", expected["message"])
    if expected["type"] == "UFuncTypeError":  # numpy's wording, version-specific
        return
    assert str(raised) == message


def _run_compute_case(case, monkeypatch) -> None:
    inputs = _decode(case["inputs"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if isinstance(inputs["env_WORLD_SIZE"], str):
        monkeypatch.setenv("WORLD_SIZE", inputs["env_WORLD_SIZE"])
    call = (
        inputs["ds_config"],
        inputs["target_deepspeed_version"],
        inputs["world_size"],
        inputs["return_microbatch"],
    )
    if "error" in case:
        with pytest.raises(Exception) as info:
            compute_elastic_config(*call)
        _check_error(info.value, case["error"])
        return
    result = compute_elastic_config(*call)
    expected = case["result"]
    assert len(result) == expected["return_len"]
    assert result[0] == expected["final_batch_size"]
    assert type(result[0]) is int
    assert result[1] == expected["valid_gpus"]
    assert all(type(n) is int for n in result[1])
    if expected["return_len"] == 3:
        assert result[2] == expected["micro_batch_size"]


def _run_helper_case(name, case) -> None:
    function = getattr(elastic, name)
    args = _decode(case["args"])
    if "error" in case:
        with pytest.raises(Exception) as info:
            function(**args)
        _check_error(info.value, case["error"])
        return
    result = function(**args)
    if name == "get_candidate_batch_sizes":
        assert sorted(result) == case["result_sorted"]
        return
    assert list(result) == case["result"]
    # The v0.2 fallback batch is a float in DeepSpeed; keep the type too.
    assert [type(r) for r in result if not isinstance(r, list)] == [
        type(r) for r in case["result"] if not isinstance(r, list)
    ]


def _failures(run, cases) -> list[str]:
    failed = []
    for case in cases:
        try:
            run(case)
        except AssertionError as error:  # collect them all, report together
            failed.append(f"{case['id']}: {error}")
    return failed


def test_compute_elastic_config_matches_deepspeed(monkeypatch):
    cases = _CASES["compute_elastic_config"]
    assert len(cases) == 320
    failed = _failures(lambda c: _run_compute_case(c, monkeypatch), cases)
    assert not failed, "\n".join(failed[:10])


@pytest.mark.parametrize(
    "name",
    [
        "get_candidate_batch_sizes",
        "get_valid_gpus",
        "get_best_candidates",
        "_get_compatible_gpus_v01",
        "_get_compatible_gpus_v02",
    ],
)
def test_helpers_match_deepspeed(name):
    cases = _CASES[name]
    assert len(cases) >= 32
    failed = _failures(lambda c: _run_helper_case(name, c), cases)
    assert not failed, "\n".join(failed[:10])


def test_hand_computed_v01():
    # micro 1, max 10: 10 // 1 = 10, the largest HCN <= 10 is 6; lcm 1 -> 6 too.
    assert get_candidate_batch_sizes([1, 1], 10) == [6]
    # 6 samples of micro-batch 1: 6 GPUs, or 1, 2, 3 (divisors of 6 up to 6 // 2).
    assert get_valid_gpus(6, [1], 1, 10) == [1, 2, 3, 6]
    assert get_valid_gpus(6, [1], 2, 3) == [2, 3]
    config = {
        "elasticity": {
            "enabled": True,
            "max_train_batch_size": 10,
            "micro_batch_sizes": [1],
            "max_gpus": 10,
            "version": 0.1,
        }
    }
    assert compute_elastic_config(config, "0.16.5") == (6, [1, 2, 3, 6])
    # world size 3: 6 // 3 = 2 samples per GPU, micro-batch 1 (the only one).
    assert compute_elastic_config(config, "0.16.5", world_size=3) == (
        6,
        [1, 2, 3, 6],
        1,
    )
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"World size \(4\)"):
        compute_elastic_config(config, "0.16.5", world_size=4)


def test_hand_computed_v02_with_model_parallelism():
    # 8 GPUs per node, model-parallel 4: 2 replicas per node. v0.1 runs on
    # max 2000 / 2 = 1000 with micro [2, 4]: candidates 2 * 360 = 720 (1000 // 2
    # = 500 -> HCN 360), 4 * 240 = 960 (250 -> 240); 960 has more valid counts.
    config = {
        "elasticity": {
            "enabled": True,
            "max_train_batch_size": 2000,
            "micro_batch_sizes": [2, 4],
            "num_gpus_per_node": 8,
            "model_parallel_size": 4,
            "version": 0.2,
        }
    }
    batch, dp_sizes, micro = compute_elastic_config(
        config, "0.16.5", world_size=16, return_microbatch=True
    )
    assert batch == 960 * 2
    v01_batch, v01_valid = elastic._get_compatible_gpus_v01([2, 4], 1000, 1, 1250)
    assert v01_batch == 960
    assert dp_sizes == [2 * n for n in v01_valid]
    # 16 GPUs / model-parallel 4 = 4 replicas is valid; 1920 // 16 = 120 per
    # GPU, and the larger micro-batch 4 divides it.
    assert 4 in dp_sizes and micro == 4


def test_best_candidate_ties_and_nothing_valid():
    # With micro-batch 1 in [1, 10], 4 runs on {1, 2, 4} and 9 on {1, 3, 9}: a tie.
    assert get_valid_gpus(4, [1], 1, 10) == [1, 2, 4]
    assert get_valid_gpus(9, [1], 1, 10) == [1, 3, 9]
    assert get_best_candidates([4, 9], [1], 1, 10, True) == (9, [1, 3, 9])
    assert get_best_candidates([9, 4], [1], 1, 10, False) == (4, [1, 2, 4])
    # No candidate has a valid count in [50, 60]: larger preferred keeps the
    # largest candidate with no counts, smaller keeps min(micro) and None.
    assert get_best_candidates([98, 84], [7], 50, 60, True) == (98, [])
    assert get_best_candidates([98, 84], [7], 50, 60, False) == (7, None)


def test_highly_composite_wraparound():
    # max // base >= 720720: DeepSpeed's argmax finds no larger HCN and wraps to
    # the last one.
    assert get_candidate_batch_sizes([1], 2_000_000) == [720720]
    assert get_candidate_batch_sizes([3], 2) == [3]  # base >= max: itself


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 400),
    micro=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    low=st.integers(1, 40),
    width=st.integers(0, 300),
)
def test_valid_gpus_equals_brute_force(batch, micro, low, width):
    high = low + width
    expected = sorted(
        {
            n
            for n in range(low, high + 1)
            for mb in micro
            if batch % mb == 0
            and (batch // mb) % n == 0
            and (n == batch // mb or n <= (batch // mb) // 2)
        }
    )
    assert get_valid_gpus(batch, micro, low, high) == expected


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 600),
    micro=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    mp=st.sampled_from([1, 2, 4, 8]),
)
def test_is_valid_world_size_agrees_with_deepspeed(batch, micro, mp):
    # mp = 1: the same counts as get_valid_gpus over the whole range.
    valid = set(get_valid_gpus(batch, micro, 1, batch))
    assert {
        n for n in range(1, batch + 1) if elastic.is_valid_world_size(batch, micro, n)
    } == valid
    # With model parallelism, v0.2's data-parallel sizes for one GPU per
    # replica per node (num_gpus_per_node = mp): n GPUs valid iff n / mp is.
    for n in range(mp, 4 * mp + 1):
        expected = n % mp == 0 and (n // mp) in valid
        assert elastic.is_valid_world_size(batch, micro, n, mp) == expected


def test_errors_say_what_is_wrong():
    assert issubclass(ElasticityConfigError, ElasticityError)
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)
    config = {"elasticity": {"enabled": True, "micro_batch_sizes": [2]}}
    with pytest.raises(ElasticityConfigError, match="missing max_train_batch_size"):
        compute_elastic_config(config, "0.16.5")
    config = {
        "elasticity": {
            "enabled": True,
            "max_train_batch_size": 100,
            "micro_batch_sizes": [7],
            "min_gpus": 50,
            "max_gpus": 60,
            "prefer_larger_batch": False,
            "version": 0.1,
        }
    }
    with pytest.raises(TypeError) as info:  # DeepSpeed's TypeError, explained
        compute_elastic_config(config, "0.16.5", world_size=4)
    if sys.version_info >= (3, 11):
        assert (
            "no candidate batch size has any valid GPU count" in info.value.__notes__[0]
        )
    config["elasticity"]["prefer_larger_batch"] = True
    with pytest.raises(ZeroDivisionError) as info:
        compute_elastic_config(config, "0.16.5", return_microbatch=True)
    if sys.version_info >= (3, 11):
        assert "world_size > 0" in info.value.__notes__[0]


def test_elastic_does_not_import_jax():
    code = (
        "import pipedejavu.planning.deepspeed_elastic, sys; print('jax' in sys.modules)"
    )
    child = run_python("-c", code, timeout=60)
    assert child.stdout.strip() == "False"


def test_hcn_list_starts_with_the_highly_composite_numbers():
    def num_divisors(n):
        return sum(2 - (i * i == n) for i in range(1, math.isqrt(n) + 1) if n % i == 0)

    record, records = 0, []
    for n in range(1, 10081):
        if num_divisors(n) > record:
            record = num_divisors(n)
            records.append(n)
    assert tuple(records) == elastic.HCN_LIST[: len(records)]
    assert elastic.HCN_LIST[len(records) - 1] == 10080
