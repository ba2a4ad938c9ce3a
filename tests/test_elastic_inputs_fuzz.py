"""Property test (issue 23): numeric arguments of ``init-search``, ``elastic``
and ``goodput optimize`` give exit 0, 2 or 3, one stderr line on exit 2, never
a traceback, each call well under 2 s of this process's CPU time (training is
replaced by a stand-in result, so the arguments' checks are what is timed; CPU
time, not wall-clock, so that other jobs on the machine do not count)."""

from __future__ import annotations

import json
import time

import pytest
from helpers import fixture_fuzz
from hypothesis import given
from hypothesis import strategies as st

from pipedejavu.cli.main import main

_NUMBER = st.one_of(
    st.integers(-(10**13), 10**13).map(str),
    st.integers(-3, 70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "x", "1e400", "-0", "0x10", "1,2", "nan"]),
)
_SETTINGS = fixture_fuzz(25)


def _call(argv, capsys):
    started = time.process_time()
    code = main(argv)
    elapsed = time.process_time() - started
    out, err = capsys.readouterr()
    assert code in (0, 2, 3), (argv, code, err)
    assert "Traceback" not in err
    if code == 2:
        assert err.count("\n") == 1 and out == "", (argv, err)
    assert elapsed < 2.0, (argv, elapsed)
    return code


@pytest.fixture(scope="module")
def tiny_run():
    """A stand-in for training: what run_strategies returns, in small."""
    import numpy as np

    from pipedejavu.init_search.strategies import STRATEGY_NAMES, StrategyResult

    curve = np.array([[0.9, 0.6, 0.8, 0.6, 0.8], [0.5, 0.3, 0.9, 0.3, 0.9]])
    return {
        name: StrategyResult(
            name=name,
            budget=20,
            gradient_evaluations=20,
            sequential_steps=10,
            compute=np.array([10, 20]),
            sequential=np.array([5, 10]),
            curve=curve,
            picked=0,
            survivors=(0,),
            trajectories={0: curve},
            rounds=(),
            wall_time_s=0.1,
        )
        for name in STRATEGY_NAMES
    }


_INIT_OPTIONS = [
    "--num-workers",
    "--epochs",
    "--demo-epochs",
    "--rounds",
    "--keep",
    "--resample-scale",
    "--shrink",
    "--learning-rate",
    "--batch-size",
    "--patience",
    "--chunk-epochs",
    "--seeds",
    "--seed",
    "--memory-limit-gb",
    "--target",
]


@_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(_INIT_OPTIONS), _NUMBER), max_size=4))
def test_init_search_numbers(tiny_run, capsys, monkeypatch, pairs):
    import pipedejavu.init_search.strategies as strategies

    monkeypatch.setattr(strategies, "run_strategies", lambda *a, **k: tiny_run)
    argv = ["init-search", "--model", "mlp-small", "--seeds", "1"]
    argv += [f"{option}={value}" for option, value in pairs]
    _call(argv, capsys)


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds.json"
    section = {"enabled": True, "max_train_batch_size": 2000}
    section.update(micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=10000)
    path.write_text(json.dumps({"elasticity": section}))
    return str(path)


@_SETTINGS
@given(_NUMBER)
def test_elastic_world_size(ds_config, capsys, world):
    _call(["elastic", ds_config, f"--world-size={world}"], capsys)


_OPTIMIZE = {
    "--init-batch": "32",
    "--nodes": "1",
    "--replicas": "4",
    "--grad": "1,16",
}


@_SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(
            [*_OPTIMIZE, "--max-batch-size", "--atomic-bsz-range", "--perf"]
        ),
        st.one_of(
            _NUMBER,
            st.lists(_NUMBER, min_size=1, max_size=8).map(",".join),
        ),
        max_size=3,
    )
)
def test_goodput_optimize_numbers(capsys, changes):
    values = {"--perf": "0.05,0.001,0.1,0.01,0.02,0.001,1.5", **_OPTIMIZE}
    values.update(changes)
    argv = ["goodput", "optimize", *(f"{k}={v}" for k, v in values.items())]
    _call(argv, capsys)
