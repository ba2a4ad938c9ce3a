"""Measured iterations from training logs (``pipedejavu.io.run_logs``) and run
files (``pipedejavu.planning.measured_runs``): the numbers each launcher
prints are read as it means them, the warm-up is left out, and every bad log
or run file is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipedejavu.core.problem import ProblemError
from pipedejavu.io.run_logs import read_training_log
from pipedejavu.planning.measured_runs import load_run, load_runs

BUNDLED = Path(__file__).resolve().parent.parent / "pipedejavu/data"
SAILOR_PLAN = BUNDLED / "sailor/measured/gh200-opt350/plan_config_N4_D2.json"
MODEL = BUNDLED / "models/sailor-opt-350.json"


def _megatron_line(iteration: int, ms: float, deepspeed: bool = False) -> str:
    line = (
        f" [2026-01-01 00:00:{iteration:02d}] iteration {iteration:8d}/ 100 | "
        f"consumed samples: {64 * iteration:10d} | elapsed time per iteration "
        f"(ms): {ms:.1f} | learning rate: 1.000000E-04 | global batch size: "
        "   64 | lm loss: 7.5E+00 | loss scale: 1.0 |"
    )
    if deepspeed:
        line += " samples per second: 51.800 | TFLOPs: 101.2 |"
    return line + "\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_megatron_lm_seconds_and_memory_are_read(tmp_path):
    lines = [_megatron_line(i, ms) for i, ms in ((10, 9000.0), (20, 1500.0))]
    lines.insert(
        1,
        "[Rank 0] (after 10 iterations) memory (MB) | allocated: 100.0 | "
        "max allocated: 200.0 | reserved: 300.0 | max reserved: 1,024.0\n",
    )
    lines.append(_megatron_line(30, 1700.0))
    log = read_training_log(_write(tmp_path / "train.log", "".join(lines)))
    assert log.launcher == "megatron-lm"
    assert [i.iteration for i in log.intervals] == [10, 20, 30]
    assert [i.seconds for i in log.intervals] == [9.0, 1.5, 1.7]
    assert log.peak_memory_bytes() == 1024 * 2**20  # max reserved, MB
    # the first logged interval is the warm-up
    assert [i.seconds for i in log.steady()] == [1.5, 1.7]
    assert [i.seconds for i in log.steady(2)] == [1.7]
    assert [i.seconds for i in log.steady(9)] == [1.7]  # the last one left


def test_megatron_deepspeed_is_told_apart(tmp_path):
    text = "".join(_megatron_line(i, 800.0, deepspeed=True) for i in (1, 2))
    log = read_training_log(_write(tmp_path / "ds.log", text))
    assert log.launcher == "megatron-deepspeed"
    assert [i.seconds for i in log.intervals] == [0.8, 0.8]


def test_torchtitan_tokens_per_second_and_colours(tmp_path):
    text = (
        "[titan] 2026-01-01 00:00:00,000 - root - INFO - Training starts at step 1\n"
        "[titan] 2026-01-01 00:00:01,000 - root - INFO - \x1b[31mstep:  1  "
        "\x1b[32mloss: 12.2500  \x1b[33mmemory: 40.12GiB(42.22%)  "
        "\x1b[34mtps: 1,234  \x1b[36mtflops: 71.10  \x1b[35mmfu: 7.19%\x1b[39m\n"
        "[titan] ... - step: 10  loss:  8.1000  grad_norm:  1.2000  memory: "
        "45.50GiB(47.89%)  tps: 6,500  tflops: 374.5  mfu: 37.87%\n"
        "[titan] ... - step: 20  loss:  7.9000  memory: 45.50GiB(47.89%)  "
        "wps: 6,700  mfu: 39.03%\n"
    )
    log = read_training_log(_write(tmp_path / "titan.log", text))
    assert log.launcher == "torchtitan"
    assert [i.tokens_per_gpu_s for i in log.intervals] == [1234, 6500, 6700]
    assert log.peak_memory_bytes() == pytest.approx(45.5 * 2**30)


@pytest.mark.parametrize(
    "text, words",
    [
        ("nothing to see here\n", "no iteration line"),
        ("", "no iteration line"),
        (
            _megatron_line(1, 100.0)
            + "step: 2  loss: 1.0  memory: 1.0GiB(1%)  tps: 100\n",
            "both Megatron and torchtitan",
        ),
        (_megatron_line(1, 0.0), "not a number where one belongs"),
        (
            " iteration 1/ 2 | elapsed time per iteration (ms): 1e999 |\n",
            "not a number where one belongs",
        ),
    ],
)
def test_a_bad_log_is_one_line_naming_it(tmp_path, text, words):
    path = _write(tmp_path / "bad.log", text)
    with pytest.raises(ProblemError) as error:
        read_training_log(path)
    message = str(error.value)
    assert message.startswith(str(path)) and words in message
    assert "\n" not in message


def test_an_over_long_line_is_skipped_not_held(tmp_path):
    text = "x" * (1 << 17) + _megatron_line(5, 2000.0) + _megatron_line(6, 2200.0)
    # the iteration line glued to the long line is no line of its own
    log = read_training_log(_write(tmp_path / "long.log", text))
    assert [i.iteration for i in log.intervals] == [6]


def test_a_missing_log_is_named(tmp_path):
    with pytest.raises(ProblemError, match="no such log file"):
        read_training_log(tmp_path / "absent.log")


def _run(tmp_path: Path, name: str = "run.json", **body) -> Path:
    body = {"format": "pipedejavu-run/1", **body}
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return path


def test_a_run_file_reads_its_plan_model_log_and_training(tmp_path):
    text = "".join(_megatron_line(i, ms) for i, ms in ((1, 50.0), (2, 1.4e3)))
    _write(tmp_path / "train.log", text + _megatron_line(3, 1.6e3))
    path = _run(
        tmp_path,
        plan=str(SAILOR_PLAN),
        model=str(MODEL),
        log="train.log",  # (beside the run file)
        training={"precision": "fp32", "flash_attention": False},
    )
    run = load_run(path)
    assert run.seconds == pytest.approx(1.5)  # median of 1.4 and 1.6
    assert "megatron-lm log, median of 2" in run.how
    assert run.options.precision == "fp32" and not run.options.flash_attention
    assert run.plan.gpus_by_type() == {"GH-96": 16}
    assert run.model == str(MODEL)


def test_torchtitan_tokens_become_seconds_of_the_plans_batch(tmp_path):
    text = "".join(
        f"step: {i}  loss: 3.0  memory: 10.0GiB(10%)  tps: {tps}\n"
        for i, tps in ((1, 10), (2, 4000), (3, 4000))
    )
    _write(tmp_path / "titan.log", text)
    run = load_run(
        _run(
            tmp_path,
            plan=str(SAILOR_PLAN),
            model=str(MODEL),
            log="titan.log",
            seq_length=2048,
        )
    )
    plan = run.plan
    assert run.seconds == pytest.approx(plan.gbs * 2048 / (4000 * plan.num_gpus))
    assert run.memory_bytes == pytest.approx(10 * 2**30)


def test_a_sailor_plan_carries_its_measured_time(tmp_path):
    run = load_run(_run(tmp_path, plan=str(SAILOR_PLAN), model=str(MODEL)))
    assert run.seconds == json.loads(SAILOR_PLAN.read_text())["real"]
    assert "real" in run.how


def test_the_bundled_run_files_read():
    runs = load_runs([BUNDLED / "runs/rtx-opt350", BUNDLED / "runs/gh200-opt350"])
    assert len(runs) == 8 + 15
    assert all(r.options.precision == "fp32" for r in runs)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"plan": "p.json", "colour": 1}, "unknown keys ['colour']"),
        ({}, "no plan"),
        ({"plan": str(SAILOR_PLAN)}, "a Sailor plan names no model"),
        (
            {
                "plan": str(SAILOR_PLAN),
                "model": "m",
                "log": "a",
                "seconds_per_iteration": 1,
            },
            "not both",
        ),
        (
            {
                "plan": str(SAILOR_PLAN),
                "model": str(MODEL),
                "seconds_per_iteration": -1,
            },
            "must be > 0",
        ),
        ({"plan": "p.json", "skip_intervals": -1}, "skip_intervals"),
        ({"plan": "p.json", "training": {"precision": "fp7"}}, "fp7"),
    ],
)
def test_a_bad_run_file_is_one_line_naming_it(tmp_path, body, words):
    path = _run(tmp_path, **body)
    with pytest.raises(ProblemError) as error:
        load_run(path)
    message = str(error.value)
    assert message.startswith(str(path)) and words in message, message
    assert "\n" not in message


def test_not_a_run_file_and_no_runs(tmp_path):
    path = _write(tmp_path / "x.json", "[1, 2]")
    with pytest.raises(ProblemError, match="not a run file"):
        load_run(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ProblemError, match="no run file"):
        load_runs([tmp_path / "empty"])
    with pytest.raises(ProblemError, match="no such run file or folder"):
        load_runs([tmp_path / "nowhere"])
