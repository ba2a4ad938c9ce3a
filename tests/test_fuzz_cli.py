"""Property-based fuzzing of the command line's numeric arguments.

For each command, hypothesis puts numbers (negative, zero, huge like 10**12,
non-integers, ``nan``/``inf`` text, not numbers at all) into one numeric
argument of a small valid command, runs ``pipedejavu.cli.main.main`` in-process
under a per-call time budget, and checks the error contract:

* the exit code is 0, 2 (bad input) or 3 (no feasible plan);
* on 2, exactly one line on stderr besides ``warning:`` lines, the last one;
* never a traceback, an exception out of ``main``, or a run past the budget.

Commands whose valid values mean real work (``profile`` profiles, ``solve
--method diff`` compiles the engine) are given an input that stops them after
the argument checks (an ``--out`` in a missing folder, ``--method dp``), so a
valid number is still checked and the test stays fast.
"""

from __future__ import annotations

import json
import signal
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedejavu.cli.main import main
from pipedejavu.costmodel.stage.generate import random_problem

#: Seconds one call may take (a valid huge number must be refused, not run).
BUDGET_S = 30.0

FUZZ = settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
    ],
    database=None,
    derandomize=True,  # the same examples every run: xfail marks stay exact
)

#: Numbers as a user might type them, right or wrong.
NUMBERS = st.one_of(
    st.integers(-(10**13), 10**13).map(str),
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "2",
            "1000000000000",
            "-1000000000000",
            str(10**40),
            "1.5",
            "0.5",
            "-0.0",
            "1e12",
            "1e-300",
            "nan",
            "inf",
            "-inf",
            "NaN",
            "Infinity",
            "",
            " 3",
            "0x10",
            "1_000",
            "two",
        ]
    ),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


class _OverBudget(BaseException):
    """Raised by the timer; a BaseException so that no handler swallows it."""


def _alarm(signum, frame):
    raise _OverBudget


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` under the time budget; the contract's checks."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, BUDGET_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main(argv)
    except _OverBudget:
        pytest.fail(f"pipedejavu {' '.join(argv)}: ran past {BUDGET_S} s")
    except SystemExit as stop:  # --help/--version only
        code = stop.code
    except BaseException as error:  # a traceback for the user
        pytest.fail(f"pipedejavu {' '.join(argv)}: raised {error!r:.300}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    shown = f"pipedejavu {' '.join(argv)} -> {code}\n{err[-2000:]}"
    assert code in (0, 2, 3), shown
    assert "Traceback" not in err, shown
    if code == 2:
        lines = [x for x in err.splitlines() if not x.startswith("warning:")]
        assert len(lines) == 1 and err.rstrip("\n").endswith(lines[0]), shown
        assert lines[0].startswith("pipedejavu"), shown
    return code, out, err


# ------------------------------------------------------------------ inputs
@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("fuzz_cli")
    problem = random_problem(5, (1, 4), num_microbatches=4, seed=0)
    paths = {"problem": str(problem.to_npz(folder / "p.npz"))}
    from pipedejavu import solve

    plan = folder / "plan.json"
    plan.write_text(json.dumps(solve(problem).to_json()))
    paths["plan"] = str(plan)
    steps = folder / "steps.csv"
    steps.write_text(
        "num_nodes,num_replicas,atomic_bsz,accum_step_time,optim_step_time\n"
        "1,1,32,0.11,0.12\n1,2,32,0.11,0.16\n1,4,32,0.11,0.17\n2,8,32,0.11,0.31\n"
        "1,1,64,0.15,0.16\n1,4,64,0.15,0.21\n2,8,64,0.15,0.36\n4,16,64,0.15,0.42\n"
    )
    paths["steps"] = str(steps)
    config = folder / "ds.json"
    config.write_text(
        json.dumps(
            {
                "elasticity": {
                    "enabled": True,
                    "max_train_batch_size": 2000,
                    "micro_batch_sizes": [2, 4, 6],
                    "version": 0.1,
                }
            }
        )
    )
    paths["ds_config"] = str(config)
    paths["folder"] = str(folder)
    paths["tiny_moe"] = str(Path(__file__).parent / "tiny_moe.json")
    return paths


PERF = "0.1,0.01,0.2,0.02,0.05,0.005,1.2"

#: ``name: argv template`` (its words; ``{x}`` for the fuzzed number);
#: ``{problem}`` etc. are the module's small valid inputs, ``{perf}`` is PERF.
_TEMPLATE_TEXTS = {
    "solve -B": "solve {problem} -B {x}",
    "solve --seed": "solve {problem} --method anneal --seed {x}",
    "solve --restarts": "solve {problem} --restarts {x}",
    "solve --steps": "solve {problem} --steps {x}",
    "solve --cluster": "solve {problem} --cluster 1x{x}",
    "inspect -B": "inspect {problem} -B {x}",
    "inspect --cluster": "inspect {problem} --cluster 1x{x}",
    "convert -B": "convert {problem} {folder}/out.npz -B {x}",
    "evaluate -B": "evaluate {problem} {plan} -B {x}",
    "compare --repeats": "compare {problem} --methods dp,greedy --warmup 0 "
    "--repeats {x}",
    "compare --warmup": "compare {problem} --methods dp --repeats 1 --warmup {x}",
    "compare --seed": "compare {problem} --methods random --repeats 1 --seed {x}",
    "costmodel predict --fraction": "costmodel predict {problem} --seeds 1 "
    "--fraction {x}",
    "costmodel predict --seeds": "costmodel predict {problem} --fraction 0.5 "
    "--seeds {x}",
    # profile checks --out before profiling: a missing folder stops it there
    "profile --repeats": "profile --out {folder}/no/x.npz --repeats {x}",
    "profile -B": "profile --out {folder}/no/x.npz -B {x}",
    "profile --cluster": "profile --out {folder}/no/x.npz --cluster {x}x1",
    "goodput optimize --init-batch": "goodput optimize --perf {perf} --grad 0.5,2.0 "
    "--nodes 1,1,2 --replicas 1,4,8 --init-batch {x}",
    "goodput optimize --max-batch-size": "goodput optimize --perf {perf} "
    "--grad 0.5,2.0 --nodes 1 --replicas 4 --init-batch 128 --max-batch-size {x}",
    "goodput optimize --grad": "goodput optimize --perf {perf} --grad {x},2.0 "
    "--nodes 1 --replicas 4 --init-batch 128",
    "goodput optimize --replicas": "goodput optimize --perf {perf} --grad 0.5,2.0 "
    "--nodes 1 --replicas {x} --init-batch 128",
    "goodput optimize --atomic-bsz-range": "goodput optimize --perf {perf} "
    "--grad 0.5,2.0 --nodes 1 --replicas 4 --init-batch 128 "
    "--atomic-bsz-range 16,{x}",
    "goodput optimize --perf": "goodput optimize "
    "--perf {x},0.01,0.2,0.02,0.05,0.005,1.2 "
    "--grad 0.5,2.0 --nodes 1 --replicas 4 --init-batch 128",
    "elastic --world-size": "elastic {ds_config} --world-size {x}",
    "init-search --num-workers": "init-search --data {folder}/missing.npz "
    "--num-workers {x}",
    "init-search --epochs": "init-search --data {folder}/missing.npz --epochs {x}",
    "init-search --learning-rate": "init-search --data {folder}/missing.npz "
    "--learning-rate {x}",
    "plan --gpus": "plan --model OPT-350 --global-batch 64 --gpus GH-96:{x}",
    "plan --global-batch": "plan --model OPT-350 --gpus GH-96:4 --global-batch {x}",
    "sweep --global-batch": "sweep --models OPT-350 --gpus-available GH-96:1 "
    "--global-batch 16,{x}",
    "plan --max-global-batch": "plan --model OPT-350 --gpus GH-96:4..8 --elastic "
    "--batch-multiple 8 --max-global-batch {x}",
    "plan --batch-multiple": "plan --model OPT-350 --gpus GH-96:4..8 --elastic "
    "--max-global-batch 16 --batch-multiple {x}",
    "plan --recompute-num-layers": "plan --model Llama-3-8B --gpus A100-40:8 "
    "--global-batch 16 --recompute full --schedule 1f1b --sequence-parallel on "
    "--distributed-optimizer on --rank-order tp-dp-pp --recompute-num-layers {x}",
    "plan --moe-expert-tp": "plan --model {tiny_moe} --gpus H100:8 --global-batch 16 "
    "--schedule 1f1b --recompute none --moe-dispatcher alltoall "
    "--moe-a2a-overlap off --moe-expert-tp {x}",
    "plan --init-batch": "plan --model OPT-350 --gpus GH-96:4 --goodput-grad 0.5,2.0 "
    "--max-global-batch 256 --init-batch {x}",
}
TEMPLATES = {
    name: [PERF if word == "{perf}" else word for word in text.split()]
    for name, text in _TEMPLATE_TEXTS.items()
}

#: Commands the fuzz once broke (issue 23): a progress line printed before the
#: number was checked (two stderr lines on exit 2), and an unbounded
#: --max-global-batch (MemoryError). ``name: the number``.
ONCE_BROKEN = {
    "plan --gpus": "0",
    "plan --global-batch": "0",
    "plan --init-batch": "0",
    "plan --batch-multiple": "-1",
    "plan --max-global-batch": "1000000000000",
}


@pytest.mark.parametrize("name", list(TEMPLATES))
@FUZZ
@given(number=NUMBERS)
def test_numeric_argument_keeps_the_error_contract(capsys, inputs, name, number):
    argv = [part.format(x=number, **inputs) for part in TEMPLATES[name]]
    run_cli(capsys, argv)


@pytest.mark.parametrize("name", list(ONCE_BROKEN))
def test_commands_the_fuzz_once_broke(capsys, inputs, name):
    argv = [part.format(x=ONCE_BROKEN[name], **inputs) for part in TEMPLATES[name]]
    code, _, _ = run_cli(capsys, argv)
    assert code == 2


def test_the_fuzzed_templates_are_valid_with_a_sensible_number(capsys, inputs):
    """Each template runs (or stops where intended) with a plain number, so the
    fuzz reaches the code behind the argument checks."""
    sensible = {
        "--fraction": "0.5",
        "--learning-rate": "0.001",
        "--grad": "0.5",
        "--max-global-batch": "64",
        "--atomic-bsz-range": "64",
        "--max-batch-size": "1024",
        "--init-batch": "64",
        "--perf": "0.1",
        "--world-size": "8",
        "--epochs": "100",
    }
    stopped = {  # exit 2 on purpose, with this in the message
        "profile": "no folder",
        "init-search": "missing.npz",
        "solve --restarts": "apply to --method diff",
        "solve --steps": "apply to --method diff",
    }
    wrong = []
    for name, template in TEMPLATES.items():
        x = next((v for k, v in sensible.items() if k in name), "4")
        argv = [part.format(x=x, **inputs) for part in template]
        code, _, err = run_cli(capsys, argv)
        why = next((v for k, v in stopped.items() if name.startswith(k)), None)
        if (code, why and why in err) != ((2, True) if why else (0, None)):
            wrong.append((name, code, err[-300:]))
    assert not wrong
