"""Parallel random initialization (pipedejavu.init_search): vmapped training,
selection, resampling, determinism, sharding and compute accounting.

Every test uses the tiny MLP, mini-batches of 128 (8 per epoch) and one epoch
per compiled call, so the whole module compiles the training step only for
populations of 1, 2 and 4 candidates.
"""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fake_devices_env, python_last_line

from pipedejavu.cli.main import main
from pipedejavu.core.problem import ProblemError
from pipedejavu.init_search import (
    InitSearchConfig,
    TrainConfig,
    load_digits,
    model_config,
    resample,
    resample_scales,
    run_strategies,
    select_top_k,
)
from pipedejavu.init_search.model import init_params
from pipedejavu.init_search.summary import summarize, time_to_target
from pipedejavu.init_search.train import (
    VALIDATION_LOSS,
    candidate_epochs,
    device_data,
    init_population,
    new_population,
    train_epochs,
)

TRAIN = TrainConfig(model=model_config("mlp-small"), batch_size=128)
STEPS = 1079 // 128  # mini-batches per epoch on the 1,079 training images
CONFIG = InitSearchConfig(
    num_workers=4, epochs=4, demo_epochs=1, rounds=2, keep=2, chunk_epochs=1
)
KEY = 7


@pytest.fixture(scope="module")
def dataset():
    return load_digits()


@pytest.fixture(scope="module")
def results(dataset):
    # Full float32 matrix products: on a GPU (TF32 by default) the training
    # would differ from the CPU run it is compared with by 1e-4 (an H200).
    with jax.default_matmul_precision("highest"):
        return run_strategies(dataset, TRAIN, CONFIG, key=jax.random.key(KEY))


def test_bundled_digits_split_is_a_partition_of_the_file(dataset):
    import importlib.resources

    sizes = [len(part.labels) for part in dataset]
    assert sizes == [1079, 359, 359]
    for part in dataset:  # every digit in every part
        assert set(np.unique(part.labels)) == set(range(10))
    # The three parts together are the file's 1,797 images, each exactly once.
    path = importlib.resources.files("pipedejavu").joinpath("data", "digits.npz")
    with np.load(path) as raw:
        original = np.column_stack(
            [raw["images"].reshape(-1, 64) / 16.0, raw["labels"]]
        )
    parts = np.concatenate([np.column_stack([p.inputs, p.labels]) for p in dataset])
    np.testing.assert_array_equal(
        np.unique(parts, axis=0, return_counts=True)[1].sum(), 1797
    )
    np.testing.assert_allclose(
        parts[np.lexsort(parts.T[::-1])], original[np.lexsort(original.T[::-1])]
    )


def test_bad_digits_file_fails_with_one_clear_line(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, pixels=np.zeros((3, 64)))
    with pytest.raises(ProblemError, match=r"bad\.npz: expected the arrays"):
        load_digits(path)
    path = tmp_path / "objects.npz"
    np.savez(path, images=np.array([{"a": 1}], dtype=object), labels=np.zeros(1))
    with pytest.raises(ProblemError, match=r"objects\.npz"):
        load_digits(path)
    with pytest.raises(ProblemError, match="missing.npz"):
        load_digits(tmp_path / "missing.npz")
    path = tmp_path / "huge.npz"  # compresses to a few KB, 4 MB once read
    np.savez_compressed(path, images=np.zeros(1 << 22, np.uint8), labels=np.zeros(1))
    with pytest.raises(ProblemError, match=r"huge\.npz: holds a \d+-byte array"):
        load_digits(path)


def test_vmapped_training_equals_a_python_loop_over_the_same_keys(dataset):
    data = device_data(dataset)
    keys = jax.random.split(jax.random.key(3), 4)
    data_keys = jax.random.split(jax.random.key(4), 4)
    population = new_population(TRAIN, init_population(TRAIN, keys), data_keys)
    # Two compiled calls of one epoch each (the vmapped, jitted path).
    chunks = []
    trained = population
    for _ in range(2):
        trained, metrics = train_epochs(trained, data, config=TRAIN, num_epochs=1)
        chunks.append(np.asarray(metrics))
    vmapped = np.concatenate(chunks, axis=1)
    one = jax.jit(partial(candidate_epochs, config=TRAIN, num_epochs=2))
    optimizer = TRAIN.optimizer()
    for i in range(4):
        params = init_params(TRAIN.model, keys[i])
        (params, _, epoch), metrics = one(
            params, optimizer.init(params), data_keys[i], jnp.int32(0), data
        )
        assert int(epoch) == 2 == int(trained.epoch[i])
        np.testing.assert_allclose(
            vmapped[i], np.asarray(metrics), rtol=2e-5, atol=1e-6
        )
        for looped, batched in zip(
            jax.tree_util.tree_leaves(params),
            jax.tree_util.tree_leaves(trained.params),
            strict=True,
        ):
            np.testing.assert_allclose(batched[i], looped, rtol=2e-5, atol=2e-6)
    assert not np.allclose(vmapped[0], vmapped[1])  # the candidates differ


@pytest.mark.parametrize("k", [1, 3, 5])
def test_selection_keeps_exactly_the_k_best_scores(k):
    rng = np.random.default_rng(k)
    scores = rng.choice([0.5, 1.0, 2.0, 3.0, 4.0, np.nan], size=9).astype(np.float32)
    scores[[2, 6]] = 0.25, 0.25  # a tie at the top
    chosen = np.asarray(select_top_k(jnp.asarray(scores), k=k))
    assert len(set(chosen.tolist())) == k
    ranked = np.where(np.isnan(scores), np.inf, scores)
    expected = np.sort(ranked)[:k]
    np.testing.assert_array_equal(ranked[chosen], expected)  # lowest first
    assert chosen[0] == 2 and (k < 2 or chosen[1] == 6)  # ties: lower index first


def test_refine_rounds_keep_the_k_best_and_resample_at_the_configured_scales(results):
    rounds = results["refine"].rounds
    assert [r["scale"] for r in rounds] == [1.0, CONFIG.resample_scale]
    for record in rounds:
        scores = np.asarray(record["scores"])
        order = np.argsort(scores, kind="stable")[: CONFIG.keep]
        assert record["kept"] == [record["ids"][i] for i in order]
    # Round 1 competes the previous survivors with N new candidates.
    assert rounds[1]["ids"][: CONFIG.keep] == rounds[0]["kept"]
    assert len(rounds[1]["ids"]) == CONFIG.keep + CONFIG.num_workers
    assert results["refine"].survivors == tuple(rounds[-1]["kept"])


def test_resampling_scale_shrinks_as_configured():
    scales = resample_scales(5, 0.6, 0.5)
    np.testing.assert_allclose(scales, [1.0, 0.6, 0.3, 0.15, 0.075])
    with pytest.raises(ValueError, match="shrink"):
        resample_scales(3, 0.5, 1.5)
    parents = init_population(TRAIN, jax.random.split(jax.random.key(0), 4))
    parents = jax.tree_util.tree_map(lambda x: x[:2], parents)
    parent_index = jnp.array([0, 1, 0, 1])
    fresh = init_population(TRAIN, jax.random.split(jax.random.key(1), 4))
    # The base distribution: He normal kernels, std sqrt(2 / fan_in); zero biases.
    kernel = np.asarray(fresh["Dense_0"]["kernel"])  # [4, 64, 16]
    assert np.std(kernel) == pytest.approx(np.sqrt(2 / 64), rel=0.05)
    assert not np.any(np.asarray(fresh["Dense_0"]["bias"]))
    distances = []
    for scale in scales[1:]:
        children = resample(parents, parent_index, jnp.float32(scale), fresh)
        moved = 0.0
        for child, parent, draw in zip(
            jax.tree_util.tree_leaves(children),
            jax.tree_util.tree_leaves(parents),
            jax.tree_util.tree_leaves(fresh),
            strict=True,
        ):
            anchor = np.sqrt(1 - scale**2) * np.asarray(parent)[parent_index]
            np.testing.assert_allclose(
                np.asarray(child) - anchor, scale * np.asarray(draw), atol=1e-6
            )
            moved += float(
                np.sum((np.asarray(child) - np.asarray(parent)[parent_index]) ** 2)
            )
        distances.append(moved)
    assert all(a > b for a, b in zip(distances, distances[1:], strict=False))


def test_same_key_same_result_and_another_key_differs(dataset, results):
    again = run_strategies(dataset, TRAIN, CONFIG, key=jax.random.key(KEY))
    for name, result in results.items():
        np.testing.assert_array_equal(result.curve, again[name].curve)
        assert result.picked == again[name].picked
    other = run_strategies(
        dataset, TRAIN, CONFIG, key=jax.random.key(KEY + 1), strategies=["refine"]
    )
    assert not np.array_equal(other["refine"].curve, results["refine"].curve)


def test_compute_accounting_adds_up_to_the_budget(dataset, results):
    budget = CONFIG.num_workers * CONFIG.epochs * STEPS
    for name, result in results.items():
        assert result.budget == budget, name
        assert result.gradient_evaluations == budget == result.compute[-1], name
        assert np.all(np.diff(result.compute) > 0), name
        # Counted independently: every epoch any candidate trained, S each.
        epochs = sum(len(t) for t in result.trajectories.values())
        assert epochs * STEPS == budget, name
    refine = results["refine"]
    search = CONFIG.rounds * CONFIG.num_workers * CONFIG.demo_epochs * STEPS
    assert search + CONFIG.keep * CONFIG.final_epochs * STEPS == budget
    for survivor in refine.survivors:
        own = len(refine.trajectories[survivor])
        assert own == CONFIG.demo_epochs + CONFIG.final_epochs
    assert results["single"].sequential_steps == budget
    assert results["best_of_n"].sequential_steps == CONFIG.epochs * STEPS
    # The ablation (survivors drawn at random) spends the same, from the same
    # first round.
    ablation = run_strategies(
        dataset, TRAIN, CONFIG, key=jax.random.key(KEY), strategies=["refine_random"]
    )["refine_random"]
    assert ablation.gradient_evaluations == budget
    assert ablation.rounds[0]["scores"] == refine.rounds[0]["scores"]
    # Early stopping spends less, and the count still matches what ran.
    stopped = run_strategies(
        dataset,
        TRAIN,
        InitSearchConfig(**{**vars(CONFIG), "patience": 1, "epochs": 12}),
        key=jax.random.key(KEY),
        strategies=["best_of_n"],
    )["best_of_n"]
    epochs = sum(len(t) for t in stopped.trajectories.values())
    assert stopped.gradient_evaluations == epochs * STEPS <= stopped.budget


def test_summary_time_to_target_and_intervals(results):
    single = results["single"]
    target = float(single.curve[2, VALIDATION_LOSS])
    first = time_to_target(single, target)
    assert first is not None and first <= single.compute[2]
    assert time_to_target(single, -1.0) is None
    summary = summarize([results, results], targets=[target])
    entry = summary["strategies"]["single"]
    assert entry["gradient_evaluations"] == single.budget
    # Two identical runs: a zero-width interval around the common value.
    low, high = entry["ci95"]["final_test_accuracy"]
    assert low == pytest.approx(high) == pytest.approx(single.final["test_accuracy"])
    assert summary["paired_differences"]["refine - best_of_n"]


_FOUR_DEVICES = """
import json, jax
from pipedejavu.init_search import InitSearchConfig, TrainConfig, load_digits
from pipedejavu.init_search import model_config, run_strategies
train = TrainConfig(model=model_config("mlp-small"), batch_size=128)
config = InitSearchConfig(num_workers=4, epochs=4, demo_epochs=1, rounds=2, keep=2,
                          chunk_epochs=1)
result = run_strategies(load_digits(), train, config, key=jax.random.key(%d),
                        strategies=["refine"])["refine"]
print(json.dumps({"devices": jax.device_count(), "rounds": list(result.rounds),
                  "picked": result.picked, "final": result.final}))
"""


def test_one_and_four_fake_devices_give_the_same_survivors(results):
    sharded = json.loads(python_last_line(_FOUR_DEVICES % KEY, fake_devices_env(4)))
    assert sharded["devices"] == 4
    refine = results["refine"]
    assert [r["kept"] for r in sharded["rounds"]] == [r["kept"] for r in refine.rounds]
    assert sharded["picked"] == refine.picked
    for mine, theirs in zip(refine.rounds, sharded["rounds"], strict=True):
        np.testing.assert_allclose(mine["scores"], theirs["scores"], rtol=1e-5)
    assert sharded["final"]["validation_loss"] == pytest.approx(
        refine.final["validation_loss"], rel=1e-4
    )


_TINY = [
    "init-search",
    "--model=mlp-small",
    "--batch-size=128",
    "--num-workers=4",
    "--epochs=4",
    "--demo-epochs=1",
    "--rounds=2",
    "--keep=2",
    "--chunk-epochs=1",
    "--seeds=1",
    f"--seed={KEY}",
]


def test_cli_json_reports_the_three_strategies_and_writes_plots(
    results, tmp_path, capsys
):
    assert main([*_TINY, "--json", "--plot", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert set(report["strategies"]) == {"single", "best_of_n", "refine"}
    for name, entry in report["strategies"].items():
        assert entry["gradient_evaluations"] == results[name].budget
        assert entry["final_validation_loss"] == pytest.approx(
            results[name].final["validation_loss"], rel=1e-6
        )
        assert 0.0 <= entry["final_validation_accuracy"] <= 1.0
    assert "init-search [" in captured.err  # the progress bar
    for figure in ("init_search_candidates.png", "init_search_compute.png"):
        assert (tmp_path / figure).stat().st_size > 1000


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--keep=3"], "--keep"),
        (["--demo-epochs=2", "--rounds=2"], "--rounds"),
        (["--model=resnet"], "--model"),
        (["--data=missing.npz"], "missing.npz"),
        (["--target=a,b"], "--target"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(extra, message, capsys):
    assert main([*_TINY, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
