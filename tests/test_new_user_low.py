"""What a new user hit (issue 43's low items): each test names the symptom."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from test_readme import ROOT

import pipedejavu as pdj
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
