"""What a new user hit (issue 43's low items): each test names the symptom."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time

import numpy as np
import pytest
from test_readme import ROOT

import pipedejavu as pdj
from pipedejavu.core.errors import ProblemError
from pipedejavu.planning.compare import MethodResult, compare
from pipedejavu.simulation.simulate import simulate_plan

# --- print(comparison) dumped the engine's 300-entry loss curve ---------------


@pytest.fixture(scope="module")
def comparison():
    problem = pdj.load_example("generated-gpt-32layers-2x8")
    return problem, compare(problem, ["dp", "greedy"], repeats=1, warmup=0)


def test_a_comparison_prints_as_its_table_and_reprs_in_one_line(comparison):
    _, result = comparison
    dp = result.result("dp")
    curve = [float(i) for i in range(300)]  # what the engine's plan carries
    plan = dataclasses.replace(dp.plan, info={**dp.plan.info, "loss_curve": curve})
    long = dataclasses.replace(
        result, results=(dataclasses.replace(dp, plan=plan), *result.results[1:])
    )
    assert str(long) == long.format_table()
    text = repr(long)
    assert "\n" not in text and len(text) < 300, text
    assert "'dp', cost=90.2022 s, runs=1, stages=4" in text
    failed = MethodResult("diff", (), (), None, float("nan"), error="no memory")
    assert repr(failed) == "MethodResult('diff', no plan: no memory)"


# --- compare's 1F1B sim (90.006) below the "true optimum" (90.202) -----------


def test_the_table_says_what_cost_and_sims_are(comparison):
    _, result = comparison
    table = result.format_table()
    assert "cost: Alpa's objective sum(t) + (B - 1) max(t)" in table
    assert "dp returns its exact minimum" in table
    assert "1F1B sim below the cost (dp, greedy) is no contradiction" in table


def test_the_1f1b_time_below_the_cost_is_the_documented_decomposition(comparison):
    # docs/cli.md explains 90.006 < 90.202 on this example by the round trip
    # through the stages after the slowest, waited for twice, and the slowest
    # stage's other warm-up forwards and last backwards run meanwhile
    problem, result = comparison
    plan = result.result("dp").plan
    run = simulate_plan(problem, plan, schedule="1f1b")
    t = run.forward + run.backward
    slowest = int(np.argmax(t))
    after = len(t) - slowest - 1
    round_trip = t[slowest + 1 :].sum()
    cost = t.sum() + (problem.num_microbatches - 1) * t[slowest]
    np.testing.assert_allclose(cost, plan.cost, rtol=1e-12)
    decomposed = (
        problem.num_microbatches * t[slowest]
        + t[:slowest].sum()
        + 2 * round_trip
        - after * t[slowest]
    )
    np.testing.assert_allclose(run.iteration_time, decomposed, rtol=1e-9)
    assert run.iteration_time < plan.cost
    page = (ROOT / "docs" / "cli.md").read_text()
    stages = ", ".join(f"{x:.3f}" for x in t[:-1]) + f" and {t[-1]:.3f} s"
    for quoted in (
        stages,
        f"{t.sum():.3f} + {problem.num_microbatches - 1} x {t[slowest]:.3f} = "
        f"{plan.cost:.3f} s",
        f"R = {round_trip:.3f} s",
        f"{after * t[slowest]:.3f} = {run.iteration_time:.3f} s",
    ):
        assert quoted in re.sub(r"\s+", " ", page), quoted


# --- bundled_examples() lists 3 where load_example takes 6 --------------------


def test_the_examples_are_all_named_where_a_user_looks():
    from pipedejavu.planning import inputs

    names = inputs.example_names()
    assert len(names) == 6 and len(set(names)) == 6
    profiles = [example.name for example in pdj.bundled_examples()]
    assert list(names[: len(profiles)]) == profiles
    # help(pdj.load_example) names every example, help(pdj.bundled_examples)
    # says it lists only the profiles and where the rest are
    for name in names:
        assert f"``{name}``" in pdj.load_example.__doc__, name
    assert "example_names" in pdj.bundled_examples.__doc__
    assert "six" in pdj.bundled_examples.__doc__
    for name in names[len(profiles) :]:
        assert pdj.load_example(name).num_layers == 32, name


# --- config.json with a byte-order mark; a config without model_type --------

GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 100,
    "n_positions": 128,
}


def test_a_config_with_a_byte_order_mark_is_read(tmp_path):
    from pipedejavu.io.model_config import load_model_spec

    plain, marked = tmp_path / "plain.json", tmp_path / "config.json"
    plain.write_text(json.dumps(GPT2), encoding="utf-8")
    marked.write_text(json.dumps(GPT2), encoding="utf-8-sig")  # Notepad's way
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_model_spec(marked) == load_model_spec(plain)
    assert load_model_spec(marked).num_layers == 2


def test_a_config_without_model_type_is_told_so(tmp_path):
    from pipedejavu.io.model_config import load_model_spec

    path = tmp_path / "config.json"
    config = {k: v for k, v in GPT2.items() if k != "model_type"}
    path.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], **config}))
    with pytest.raises(ProblemError) as error:
        load_model_spec(path)
    message = str(error.value)
    assert "needs 'model_type'" in message and "gpt2, gpt_neo" in message, message
    assert str(path) in message and "\n" not in message
    # the own format with a typo is still told about its unknown key
    path.write_text(json.dumps({"num_layers": 2, "hiden_size": 64}))
    with pytest.raises(ProblemError, match="unknown key 'hiden_size'"):
        load_model_spec(path)


# --- a FIFO given as --model blocked forever ---------------------------------


def _read_in_thread(path):
    """``load_model_spec(path)`` in a thread; a reader still blocked after 10 s
    (the old code, in ``open``) is released by opening the FIFO for writing."""
    from pipedejavu.io.model_config import load_model_spec

    outcome = {}

    def read():
        try:
            outcome["spec"] = load_model_spec(str(path))
        except ProblemError as error:
            outcome["error"] = str(error)

    reader = threading.Thread(target=read, daemon=True)
    started = time.perf_counter()
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
        outcome["blocked"] = True
    outcome["seconds"] = time.perf_counter() - started
    return outcome


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_model_fifo_nothing_writes_to_is_refused(tmp_path, monkeypatch):
    from pipedejavu.io import model_config

    monkeypatch.setattr(model_config, "MODEL_FIFO_WAIT_S", 0.3, raising=False)
    path = tmp_path / "config.json"
    os.mkfifo(path)
    outcome = _read_in_thread(path)
    assert "blocked" not in outcome and outcome["seconds"] < 5
    assert outcome["error"] == (
        f"model file {path} is a FIFO nothing wrote to in 0.3 s; give a file "
        "(or a command's output, as <(cat FILE) does)"
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_model_fifo_written_a_little_later_is_read(tmp_path, monkeypatch):
    # process substitution, --model <(jq ... config.json): a writer comes
    from pipedejavu.io import model_config

    monkeypatch.setattr(model_config, "MODEL_FIFO_WAIT_S", 5.0, raising=False)
    path = tmp_path / "config.json"
    os.mkfifo(path)

    def write():
        time.sleep(0.3)
        path.write_text(json.dumps(GPT2))

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    outcome = _read_in_thread(path)
    writer.join()
    assert outcome.get("spec") is not None and outcome["spec"].num_layers == 2


# --- "s_nan.json.cost must be": the file and the field ran together ----------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda plan: plan.update(cost=float("nan")),
            "plan.json: cost must be a finite number, got nan",
        ),
        (
            lambda plan: plan.update(num_microbatches="32"),
            "plan.json: num_microbatches must be",
        ),
        (lambda plan: plan.update(method=3), "plan.json: method must be text"),
        (lambda plan: plan.update(stages=7), "plan.json: stages must be a list"),
        (
            lambda plan: plan["stages"][0].update(latency=float("inf")),
            "plan.json: stages[0].latency must be a finite number, got inf",
        ),
    ],
)
def test_a_plan_field_is_named_apart_from_its_file(tmp_path, change, message):
    from pipedejavu.planning.inputs import load_plan

    problem = pdj.load_example("generated-gpt-32layers-2x8")
    plan = pdj.solve(problem).to_json()
    change(plan)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(ProblemError) as error:
        load_plan(path)
    assert message in str(error.value)
    assert f"{path}: " in str(error.value)


# --- a plan file's rank_order "bogus" and an unknown format were accepted ----


@pytest.fixture(scope="module")
def training_plan():
    from pipedejavu.planning.training import plan_training

    return plan_training("OPT-350", {"GH-96": 16}, global_batch=64).plan.to_json()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "rank_order",
            "bogus",
            "'rank_order' must be tp-dp-pp or tp-pp-dp (or null), got 'bogus'",
        ),
        ("rank_order", 3, "'rank_order' must be tp-dp-pp or tp-pp-dp"),
        (
            "format",
            "megatron.plan",
            "'format' must be 'pipedejavu.core.plan3d' (or absent), got "
            "'megatron.plan'",
        ),
        ("kind", "stage-plan", "'kind' must be 'training-plan' (or absent)"),
    ],
)
def test_a_plan_file_with_a_bad_format_or_rank_order_is_refused(
    tmp_path, training_plan, key, value, message
):
    from pipedejavu.io.sailor_plan import load_plan3d

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**training_plan, key: value}))
    with pytest.raises(ProblemError) as error:
        load_plan3d(path)
    assert str(error.value).startswith(f"{path}: not a valid 3D plan: {message}")


@pytest.mark.parametrize("order", [None, "tp-dp-pp", "tp-pp-dp", "absent"])
def test_a_plan_file_with_a_known_rank_order_or_none_is_read(
    tmp_path, training_plan, order
):
    from pipedejavu.io.sailor_plan import load_plan3d

    data = {k: v for k, v in training_plan.items() if k != "format"}
    if order != "absent":
        data["rank_order"] = order
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    plan, kind = load_plan3d(path)
    assert kind == "pipedejavu" and plan.num_gpus == 16


# --- H100-80 / H100-80GB unknown while A100-80 is known ----------------------

LAUNCH = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 1 "
    "--global-batch-size 8 --bf16"
)


@pytest.mark.parametrize("gpu", ["H100-80", "H100-80GB", "h100-80gb", "A100-80GB"])
def test_predict_takes_a_gpu_named_with_its_memory(capsys, gpu):
    from pipedejavu.cli.main import main

    code = main(["predict", "--gpus", f"{gpu}:8", "--megatron-args", LAUNCH])
    out, err = capsys.readouterr()
    assert code == 0, err
    expected = "H100-SXM:8" if gpu.lower().startswith("h100") else "A100-80:8"
    assert f"({expected})" in out.splitlines()[0]


def test_alpas_way_says_how_it_placed_its_stages(capsys):
    """The bundled heterogeneous example's Alpa plan lands on hosts 3, 2, 1, 0,
    3 (its runtime slicing: pipeline order would split a 1x4 stage); the
    report says so instead of 'placed in host order'."""
    from pipedejavu.cli.main import main

    assert main(["solve", "hetero-gpt-32layers-a100-v100", "--method", "alpa"]) == 0
    out = capsys.readouterr().out
    assert "placed blind to the GPU types: by Alpa's runtime slicing" in out
    assert "host order" not in out
