"""Three ways to spend one training budget, counted in gradient evaluations.

With N workers, E epochs each and S mini-batches per epoch the budget is
``G = N * E * S`` gradient evaluations (one candidate, one mini-batch):

- ``single``: one base initialization trained for N * E epochs.
- ``best_of_n``: N independent initializations trained E epochs each, side by
  side; the one with the lowest validation loss at the end is the answer.
- ``refine`` (pipeDejavu's parallel random initialization): R search rounds.
  Round 0 draws N initializations (the same N as ``best_of_n``), round r >= 1
  resamples N new ones around the survivors' *initial* parameters at a
  shrinking scale (:mod:`.sampling`). Each round trains its N candidates for
  W = ``demo_epochs`` epochs and scores them by validation loss; the k best of
  the round's candidates and the previous survivors, all scored after the same
  W epochs from their starts, survive. The k survivors then train on from
  where their warm-up left them for the rest of the budget, ``N * (E - R * W)
  / k`` epochs each; the lowest validation loss at the end is the answer.

Every strategy uses the same model, Adam at the same constant learning rate
and the same mini-batch size; the validation split decides every choice, the
test split none. Each strategy records, after every epoch, the compute spent
so far and the metrics of its current pick (the lowest validation loss among
the models it holds), which gives the validation-vs-compute curves.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipedejavu.init_search.data import Dataset
from pipedejavu.init_search.limits import (
    DEFAULT_MEMORY_LIMIT_GB,
    INT_RANGES,
    MAX_BUDGET_EPOCHS,
    MAX_MEMORY_LIMIT_GB,
    check_memory,
)
from pipedejavu.init_search.sampling import resample, resample_scales, select_top_k
from pipedejavu.init_search.train import (
    METRICS,
    VALIDATION_LOSS,
    DeviceData,
    Population,
    TrainConfig,
    device_data,
    init_population,
    new_population,
    steps_per_epoch,
    train_epochs,
)
from pipedejavu.search.engine.restarts import shard

__all__ = [
    "ABLATION_NAMES",
    "STRATEGY_NAMES",
    "InitSearchConfig",
    "StrategyResult",
    "run_strategies",
]

STRATEGY_NAMES = ("single", "best_of_n", "refine")
#: ``refine_random``: ``refine`` with the survivors of every round drawn at
#: random instead of by score (same rounds, resampling and compute): what the
#: scores themselves are worth.
ABLATION_NAMES = ("refine_random",)

#: ``progress_fn(strategy, evaluations done, budget, current best validation loss)``
ProgressFn = Callable[[str, int, int, float], None]


@dataclasses.dataclass(frozen=True)
class InitSearchConfig:
    """The budget and the search's settings (hashable; validated).

    Attributes:
        num_workers: N candidates trained side by side.
        epochs: E; the budget is N * E epochs of gradient evaluations.
        demo_epochs: W warm-up epochs before each scoring.
        rounds: R search rounds (R * W < E).
        keep: k survivors per round; N must be a multiple of k.
        resample_scale: neighbourhood scale of round 1, in (0, 1].
        shrink: factor on the scale per later round, in (0, 1].
        chunk_epochs: epochs per jitted call (progress and early stopping are
            checked between calls).
        patience: stop a strategy once its pick's validation loss has not
            improved for this many epochs (the search rounds always finish);
            None: always spend the whole budget.
        memory_limit_gb: the candidates trained at once may take this much
            memory, GiB, in (0, 1024] (estimated by
            :func:`~.limits.population_bytes`; checked before any work).

    Ranges (inclusive): num_workers 2..4096, epochs 2..100,000, demo_epochs
    1..10,000, rounds 1..1,000, keep 1..num_workers - 1, chunk_epochs
    1..1,000, patience 1..100,000, num_workers x epochs <= 1,000,000
    (:mod:`.limits`).
    """

    num_workers: int = 8
    epochs: int = 100
    demo_epochs: int = 20
    rounds: int = 3
    keep: int = 2
    resample_scale: float = 0.5
    shrink: float = 0.5
    chunk_epochs: int = 10
    patience: int | None = None
    memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB

    def __post_init__(self) -> None:
        for name in (
            "num_workers",
            "epochs",
            "demo_epochs",
            "rounds",
            "keep",
            "chunk_epochs",
            "patience",
        ):
            value = getattr(self, name)
            if name == "patience" and value is None:
                continue
            low, high = INT_RANGES[name]
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not low <= value <= high
            ):
                raise ValueError(
                    f"{name} must be an integer in [{low}, {high}], got {value!r}"
                )
        if self.keep >= self.num_workers or self.num_workers % self.keep:
            raise ValueError(
                f"keep ({self.keep}) must divide num_workers ({self.num_workers}) "
                "and be smaller"
            )
        if self.num_workers * self.epochs > MAX_BUDGET_EPOCHS:
            raise ValueError(
                f"num_workers x epochs (the budget in epochs) must be <= "
                f"{MAX_BUDGET_EPOCHS:,}, got {self.num_workers} x {self.epochs}"
            )
        if self.rounds * self.demo_epochs >= self.epochs:
            raise ValueError(
                f"rounds * demo_epochs ({self.rounds} * {self.demo_epochs}) must be "
                f"below epochs ({self.epochs}) to leave budget for the survivors"
            )
        for name in ("resample_scale", "shrink"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
        if not 0 < self.memory_limit_gb <= MAX_MEMORY_LIMIT_GB:
            raise ValueError(
                f"memory_limit_gb must lie in (0, {MAX_MEMORY_LIMIT_GB:g}], got "
                f"{self.memory_limit_gb!r}"
            )

    @property
    def final_epochs(self) -> int:
        """Epochs each survivor trains after the search: N (E - R W) / k."""
        return (
            self.num_workers
            * (self.epochs - self.rounds * self.demo_epochs)
            // (self.keep)
        )

    def budget(self, steps: int) -> int:
        """G = N * E * S gradient evaluations, S mini-batches per epoch."""
        return self.num_workers * self.epochs * steps


@dataclasses.dataclass(frozen=True)
class StrategyResult:
    """What one strategy did with the budget.

    Attributes:
        name: one of :data:`STRATEGY_NAMES`.
        budget: G gradient evaluations allowed.
        gradient_evaluations: gradient evaluations spent (G without early stop).
        sequential_steps: optimizer steps in a row when the N workers train
            the candidates of a phase side by side (wall-clock proxy).
        compute: i64[P] gradient evaluations spent at each curve point.
        sequential: i64[P] sequential steps taken at each curve point.
        curve: f64[P, 5] the pick's metrics (:data:`METRICS` order) there.
        picked: id of the final pick (candidate ids: round * N + index).
        survivors: ids of the models trained to the end.
        trajectories: candidate id -> f64[epochs, 5] its metrics per epoch.
        rounds: refine only: per round, the scale, candidate ids, their scores
            and the ids kept.
        wall_time_s: seconds, compilation included.
    """

    name: str
    budget: int
    gradient_evaluations: int
    sequential_steps: int
    compute: np.ndarray
    sequential: np.ndarray
    curve: np.ndarray
    picked: int
    survivors: tuple[int, ...]
    trajectories: dict[int, np.ndarray]
    rounds: tuple[dict[str, Any], ...]
    wall_time_s: float

    @property
    def final(self) -> dict[str, float]:
        """The final pick's metrics by name."""
        return {name: float(v) for name, v in zip(METRICS, self.curve[-1], strict=True)}

    def to_json(self, *, curve: bool = False) -> dict[str, Any]:
        """Plain JSON: totals, final metrics (and the curve when asked)."""
        final = self.final
        out: dict[str, Any] = {
            "gradient_evaluations": self.gradient_evaluations,
            "budget": self.budget,
            "sequential_steps": self.sequential_steps,
            **{
                f"final_{name}": final[name] for name in METRICS if name != "train_loss"
            },
            "best_validation_loss": float(np.nanmin(self.curve[:, VALIDATION_LOSS])),
            "picked": self.picked,
            "survivors": list(self.survivors),
            "wall_time_s": self.wall_time_s,
        }
        if curve:
            out["curve"] = {
                "gradient_evaluations": self.compute.tolist(),
                "sequential_steps": self.sequential.tolist(),
                **{name: self.curve[:, i].tolist() for i, name in enumerate(METRICS)},
            }
        return out


class _Recorder:
    """Compute, the pick's curve and every candidate's trajectory (Python shell)."""

    def __init__(
        self,
        name: str,
        budget: int,
        steps: int,
        config: InitSearchConfig,
        progress_fn: ProgressFn | None,
    ) -> None:
        self.name, self.budget, self.steps = name, budget, steps
        self.patience, self.progress_fn = config.patience, progress_fn
        self.spent = self.sequential = 0
        self.compute: list[int] = []
        self.steps_taken: list[int] = []
        self.curve: list[np.ndarray] = []
        self.picks: list[int] = []
        self.trajectories: dict[int, list[np.ndarray]] = {}
        self.best, self.since_best = np.inf, 0

    def record(
        self,
        ids: Sequence[int],
        metrics: np.ndarray,
        standing: tuple[Sequence[int], np.ndarray] | None = None,
    ) -> bool:
        """Log epochs of ``metrics`` f64[C, e, 5] for candidates ``ids``; models
        held but not trained (``standing``: ids, f64[k, 5]) compete for the
        pick. Returns True when early stopping says stop."""
        for cid, rows in zip(ids, metrics, strict=True):
            self.trajectories.setdefault(int(cid), []).extend(rows)
        all_ids = list(ids) if standing is None else list(standing[0]) + list(ids)
        for epoch in range(metrics.shape[1]):
            rows = metrics[:, epoch]
            if standing is not None:
                rows = np.concatenate([standing[1], rows])
            validation = np.where(
                np.isnan(rows[:, VALIDATION_LOSS]), np.inf, rows[:, VALIDATION_LOSS]
            )
            pick = int(np.argmin(validation))
            self.spent += len(ids) * self.steps
            self.sequential += self.steps
            self.compute.append(self.spent)
            self.steps_taken.append(self.sequential)
            self.curve.append(rows[pick])
            self.picks.append(all_ids[pick])
            if validation[pick] < self.best:
                self.best, self.since_best = validation[pick], 0
            else:
                self.since_best += 1
        if self.progress_fn is not None:
            self.progress_fn(self.name, self.spent, self.budget, float(self.best))
        return self.patience is not None and self.since_best >= self.patience

    def result(
        self, survivors: Sequence[int], rounds: tuple, started: float
    ) -> StrategyResult:
        return StrategyResult(
            name=self.name,
            budget=self.budget,
            gradient_evaluations=self.spent,
            sequential_steps=self.sequential,
            compute=np.asarray(self.compute, dtype=np.int64),
            sequential=np.asarray(self.steps_taken, dtype=np.int64),
            curve=np.asarray(self.curve, dtype=np.float64),
            picked=self.picks[-1],
            survivors=tuple(int(s) for s in survivors),
            trajectories={k: np.asarray(v) for k, v in self.trajectories.items()},
            rounds=rounds,
            wall_time_s=time.perf_counter() - started,
        )


def _train(
    population: Population,
    ids: Sequence[int],
    num_epochs: int,
    data: DeviceData,
    train_config: TrainConfig,
    config: InitSearchConfig,
    recorder: _Recorder,
    standing: tuple[Sequence[int], np.ndarray] | None = None,
    stoppable: bool = True,
) -> tuple[Population, np.ndarray, bool]:
    """Train ``num_epochs`` epochs in jitted chunks; returns the population, the
    metrics f64[C, epochs run, 5] and whether early stopping ended it."""
    population = shard(population, len(ids))
    chunks, done = [], 0
    while done < num_epochs:
        count = min(config.chunk_epochs, num_epochs - done)
        population, metrics = train_epochs(
            population, data, config=train_config, num_epochs=count
        )
        chunks.append(np.asarray(metrics, dtype=np.float64))
        done += count
        if recorder.record(ids, chunks[-1], standing) and stoppable:
            return population, np.concatenate(chunks, axis=1), True
    return population, np.concatenate(chunks, axis=1), False


def _take(tree: Any, index: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[index], tree)


def _concat(first: Any, second: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), first, second)


def _refine(
    keys: tuple[jax.Array, jax.Array, jax.Array],
    data: DeviceData,
    train_config: TrainConfig,
    config: InitSearchConfig,
    recorder: _Recorder,
    *,
    by_score: bool = True,
) -> tuple[list[int], tuple[dict[str, Any], ...]]:
    init_key, data_key, resample_key = keys
    num, keep = config.num_workers, config.keep
    scales = resample_scales(config.rounds, config.resample_scale, config.shrink)
    kept: dict[str, Any] | None = None
    rounds = []
    for round_index in range(config.rounds):
        ids = list(range(round_index * num, (round_index + 1) * num))
        if kept is None:
            inits = init_population(train_config, jax.random.split(init_key, num))
            data_keys = jax.random.split(data_key, num)
        else:
            fresh = init_population(
                train_config,
                jax.random.split(jax.random.fold_in(resample_key, round_index), num),
            )
            inits = resample(
                kept["inits"],
                jnp.arange(num) % keep,
                jnp.float32(scales[round_index]),
                fresh,
            )
            data_keys = jax.random.split(jax.random.fold_in(data_key, round_index), num)
        population = new_population(train_config, inits, data_keys)
        standing = None if kept is None else (kept["ids"], kept["last"])
        population, metrics, _ = _train(
            population,
            ids,
            config.demo_epochs,
            data,
            train_config,
            config,
            recorder,
            standing,
            stoppable=False,
        )
        scores = metrics[:, -1, VALIDATION_LOSS]
        last = metrics[:, -1]
        if kept is not None:  # survivors compete, scored after the same warm-up
            ids = kept["ids"] + ids
            scores = np.concatenate([kept["scores"], scores])
            last = np.concatenate([kept["last"], last])
            population = _concat(kept["population"], population)
            inits = _concat(kept["inits"], inits)
        if by_score:
            chosen = np.asarray(select_top_k(jnp.asarray(scores), k=keep))
        else:  # the ablation: survivors drawn uniformly
            draw = jax.random.fold_in(resample_key, config.rounds + round_index)
            chosen = np.asarray(jax.random.permutation(draw, len(scores))[:keep])
        kept = {
            "ids": [ids[i] for i in chosen],
            "scores": scores[chosen],
            "last": last[chosen],
            "population": _take(population, chosen),
            "inits": _take(inits, chosen),
        }
        rounds.append(
            {
                "scale": float(scales[round_index]),
                "ids": list(ids),
                "scores": scores.tolist(),
                "kept": list(kept["ids"]),
            }
        )
    assert kept is not None
    _train(
        kept["population"],
        kept["ids"],
        config.final_epochs,
        data,
        train_config,
        config,
        recorder,
    )
    return kept["ids"], tuple(rounds)


def run_strategies(
    dataset: Dataset,
    train_config: TrainConfig,
    config: InitSearchConfig,
    *,
    key: jax.Array,
    strategies: Sequence[str] = STRATEGY_NAMES,
    progress_fn: ProgressFn | None = None,
) -> dict[str, StrategyResult]:
    """Run the strategies on one budget.

    Args:
        dataset: the split (train / validation / test).
        train_config: model, optimizer and mini-batch size, shared by all.
        config: budget and search settings.
        key: a ``jax.random`` key; the same key gives the same results. The
            strategies share their draws: ``single`` starts from ``best_of_n``'s
            first initialization and ``refine``'s round 0 is ``best_of_n``'s N.
        strategies: which of :data:`STRATEGY_NAMES` (and :data:`ABLATION_NAMES`)
            to run, in order.
        progress_fn: called after each jitted chunk (see :data:`ProgressFn`).

    Returns:
        Strategy name -> :class:`StrategyResult`.

    Raises:
        ProblemError: the candidates would need more than
            ``config.memory_limit_gb`` (:func:`~.limits.check_memory`), before
            anything is allocated.
    """
    known = STRATEGY_NAMES + ABLATION_NAMES
    unknown = [s for s in strategies if s not in known]
    if unknown:
        raise ValueError(f"strategies must be among {', '.join(known)}, got {unknown}")
    steps = steps_per_epoch(train_config, len(dataset.train.labels))
    model = train_config.model
    check_memory(
        config.num_workers,
        config.keep,
        model.hidden,
        model.num_inputs,
        model.num_classes,
        train_config.batch_size,
        (
            len(dataset.train.labels),
            len(dataset.validation.labels),
            len(dataset.test.labels),
        ),
        config.memory_limit_gb,
    )
    data = device_data(dataset)
    budget = config.budget(steps)
    init_key, data_key, resample_key = jax.random.split(key, 3)
    num = config.num_workers
    results = {}
    for name in strategies:
        started = time.perf_counter()
        recorder = _Recorder(name, budget, steps, config, progress_fn)
        rounds: tuple = ()
        if name in ("refine", "refine_random"):
            survivors, rounds = _refine(
                (init_key, data_key, resample_key),
                data,
                train_config,
                config,
                recorder,
                by_score=name == "refine",
            )
        else:
            count, epochs = (
                (1, num * config.epochs) if name == "single" else (num, config.epochs)
            )
            inits = init_population(train_config, jax.random.split(init_key, num))
            population = new_population(
                train_config,
                _take(inits, slice(0, count)),
                jax.random.split(data_key, num)[:count],
            )
            survivors = list(range(count))
            _train(population, survivors, epochs, data, train_config, config, recorder)
        results[name] = recorder.result(survivors, rounds, started)
    return results
