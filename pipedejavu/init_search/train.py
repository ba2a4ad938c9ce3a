"""Train a population of candidates at once: ``jax.vmap`` over parameter pytrees
and PRNG keys, ``lax.scan`` over epochs and mini-batch steps, one jit boundary.

A candidate is a parameter pytree, its Adam state, a data key (the order of its
mini-batches: epoch ``e`` uses the permutation drawn from ``fold_in(key, e)``)
and its epoch counter. :func:`candidate_epochs` trains one candidate;
:func:`train_epochs` is the same function vmapped over a :class:`Population`
and jitted. One gradient evaluation is the gradient of one candidate's loss on
one mini-batch of ``batch_size`` training images.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedejavu.init_search.data import Dataset
from pipedejavu.init_search.limits import INT_RANGES, MAX_LEARNING_RATE
from pipedejavu.init_search.model import ModelConfig, apply_model, init_params

__all__ = [
    "METRICS",
    "DeviceData",
    "Population",
    "TrainConfig",
    "candidate_epochs",
    "device_data",
    "new_population",
    "train_epochs",
]

#: Columns of the per-epoch metrics, in order.
METRICS = (
    "train_loss",
    "validation_loss",
    "validation_accuracy",
    "test_loss",
    "test_accuracy",
)
VALIDATION_LOSS = METRICS.index("validation_loss")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What every strategy trains with: the same model, optimizer and schedule.

    Attributes:
        model: the classifier.
        learning_rate: Adam's step size (constant: the same for every run,
            whatever its length), in (0, 10].
        batch_size: training images per gradient evaluation, 1..65,536 (and
            at most the training images).
    """

    model: ModelConfig = ModelConfig()
    learning_rate: float = 1e-3
    batch_size: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.learning_rate <= MAX_LEARNING_RATE:
            raise ValueError(
                f"learning_rate must lie in (0, {MAX_LEARNING_RATE:g}], got "
                f"{self.learning_rate}"
            )
        low, high = INT_RANGES["batch_size"]
        if (
            not isinstance(self.batch_size, int)
            or isinstance(self.batch_size, bool)
            or not low <= self.batch_size <= high
        ):
            raise ValueError(
                f"batch_size must be an integer in [{low}, {high}], got "
                f"{self.batch_size!r}"
            )

    def optimizer(self) -> optax.GradientTransformation:
        """Adam at the constant learning rate."""
        return optax.adam(self.learning_rate)


class DeviceData(NamedTuple):
    """The split as JAX arrays: inputs f32[n, 64], labels i32[n] per part."""

    train_inputs: jax.Array
    train_labels: jax.Array
    validation_inputs: jax.Array
    validation_labels: jax.Array
    test_inputs: jax.Array
    test_labels: jax.Array


def device_data(dataset: Dataset) -> DeviceData:
    """The split on the default device."""
    parts = (dataset.train, dataset.validation, dataset.test)
    return DeviceData(*(jnp.asarray(a) for part in parts for a in part))


class Population(NamedTuple):
    """Candidates trained side by side; every leaf has a leading axis [C].

    Attributes:
        params: the parameter pytrees.
        opt_state: their Adam states.
        data_key: key[C] mini-batch orders.
        epoch: i32[C] epochs trained so far.
    """

    params: Any
    opt_state: Any
    data_key: jax.Array
    epoch: jax.Array


def new_population(
    config: TrainConfig, params: Any, data_keys: jax.Array
) -> Population:
    """Fresh optimizer states for stacked parameters ``params`` (leading [C])."""
    opt_state = jax.vmap(config.optimizer().init)(params)
    count = data_keys.shape[0]
    return Population(params, opt_state, data_keys, jnp.zeros(count, jnp.int32))


@partial(jax.jit, static_argnames="model")
def _init_population(keys: jax.Array, *, model: ModelConfig) -> Any:
    return jax.vmap(partial(init_params, model))(keys)


def init_population(config: TrainConfig, keys: jax.Array) -> Any:
    """Stacked parameters (leading axis [C]), one base-distribution draw per
    key in key[C]."""
    return _init_population(keys, model=config.model)


def steps_per_epoch(config: TrainConfig, num_train: int) -> int:
    """Mini-batches per epoch (the last partial batch is dropped)."""
    steps = num_train // config.batch_size
    if steps < 1:
        raise ValueError(
            f"batch_size ({config.batch_size}) exceeds the {num_train} training images"
        )
    return steps


def _evaluate(
    config: TrainConfig, params: Any, inputs: jax.Array, labels: jax.Array
) -> tuple[jax.Array, jax.Array]:
    logits = apply_model(config.model, params, inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, accuracy


def candidate_epochs(
    params: Any,
    opt_state: Any,
    data_key: jax.Array,
    epoch: jax.Array,
    data: DeviceData,
    *,
    config: TrainConfig,
    num_epochs: int,
) -> tuple[tuple[Any, Any, jax.Array], jax.Array]:
    """Train one candidate for ``num_epochs`` epochs.

    Returns:
        ``((params, opt_state, epoch), metrics)`` with metrics f32[num_epochs,
        5] in :data:`METRICS` order after each epoch (train loss: the mean over
        the epoch's mini-batches; the others on the whole part).
    """
    num_train = data.train_labels.shape[0]
    steps = steps_per_epoch(config, num_train)
    optimizer = config.optimizer()

    def loss_fn(params, batch):
        logits = apply_model(config.model, params, data.train_inputs[batch])
        labels = data.train_labels[batch]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def one_epoch(carry, _):
        params, opt_state, epoch = carry
        order = jax.random.permutation(jax.random.fold_in(data_key, epoch), num_train)
        batches = order[: steps * config.batch_size].reshape(steps, config.batch_size)
        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), batches)
        validation = _evaluate(
            config, params, data.validation_inputs, data.validation_labels
        )
        test = _evaluate(config, params, data.test_inputs, data.test_labels)
        metrics = jnp.stack([jnp.mean(losses), *validation, *test])
        return (params, opt_state, epoch + 1), metrics

    return jax.lax.scan(one_epoch, (params, opt_state, epoch), None, length=num_epochs)


@partial(jax.jit, static_argnames=("config", "num_epochs"))
def train_epochs(
    population: Population, data: DeviceData, *, config: TrainConfig, num_epochs: int
) -> tuple[Population, jax.Array]:
    """Train every candidate of the population for ``num_epochs`` epochs.

    Returns:
        The population after training and metrics f32[C, num_epochs, 5].
    """
    run = jax.vmap(
        partial(candidate_epochs, config=config, num_epochs=num_epochs),
        in_axes=(0, 0, 0, 0, None),
    )
    (params, opt_state, epoch), metrics = run(
        population.params,
        population.opt_state,
        population.data_key,
        population.epoch,
        data,
    )
    return Population(params, opt_state, population.data_key, epoch), metrics


def finite_scores(scores: jax.Array | np.ndarray) -> jax.Array:
    """Scores with NaN (a diverged candidate) replaced by +inf."""
    scores = jnp.asarray(scores)
    return jnp.where(jnp.isnan(scores), jnp.inf, scores)
