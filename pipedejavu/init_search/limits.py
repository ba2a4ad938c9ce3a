"""The documented ranges of the init-search settings and its memory estimate.

Every number ``pipedejavu init-search`` (and :class:`~.strategies.
InitSearchConfig`) takes has a range, checked before any work; the candidates
trained side by side must also fit :data:`DEFAULT_MEMORY_LIMIT_GB` (or the
given ``memory_limit_gb``) by :func:`population_bytes`, checked before
anything is allocated. No JAX here: the checks cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedejavu.core.errors import ProblemError

__all__ = [
    "DEFAULT_MEMORY_LIMIT_GB",
    "INT_RANGES",
    "MAX_BUDGET_EPOCHS",
    "MAX_LEARNING_RATE",
    "MAX_MEMORY_LIMIT_GB",
    "MAX_TARGETS",
    "check_memory",
    "param_count",
    "population_bytes",
]

#: Inclusive ranges of the integer settings (``keep`` also below num_workers).
INT_RANGES: dict[str, tuple[int, int]] = {
    "num_workers": (2, 4096),
    "epochs": (2, 100_000),
    "demo_epochs": (1, 10_000),
    "rounds": (1, 1_000),
    "keep": (1, 4095),
    "chunk_epochs": (1, 1_000),
    "patience": (1, 100_000),
    "batch_size": (1, 65_536),
    "seeds": (1, 100),
    "seed": (0, 2**31 - 1),
}
#: num_workers x epochs, the budget counted in epochs, at most this.
MAX_BUDGET_EPOCHS = 1_000_000
#: Learning rate in (0, MAX_LEARNING_RATE].
MAX_LEARNING_RATE = 10.0
#: At most this many time-to-target losses.
MAX_TARGETS = 16
#: Memory the candidates trained side by side may take, GiB (by default).
DEFAULT_MEMORY_LIMIT_GB = 2.0
#: The largest memory limit accepted, GiB.
MAX_MEMORY_LIMIT_GB = 1024.0

_FLOAT32 = 4
# Per parameter: the parameters, Adam's two moments, the gradient, the update,
# the kept initial parameters (refine), and the input and output copies of a
# jitted call: 10 float32 numbers, rounded up.
_STATE_COPIES = 10


def param_count(hidden: Sequence[int], num_inputs: int, num_classes: int) -> int:
    """Parameters of an MLP: kernels and biases of every dense layer."""
    widths = [num_inputs, *hidden, num_classes]
    return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def population_bytes(
    num_candidates: int,
    hidden: Sequence[int],
    num_inputs: int,
    num_classes: int,
    batch_size: int,
    sizes: tuple[int, int, int],
) -> int:
    """Estimated peak bytes of training ``num_candidates`` candidates at once.

    Per candidate: ten float32 copies of the parameters (state, gradients,
    kept initializations, a jitted call's inputs and outputs), a mini-batch's
    activations forward and backward (x3), the activations of evaluating the
    whole validation or test part (x2), and the epoch's shuffle of the
    training indices (x3). Plus the dataset itself, twice.

    Args:
        num_candidates: candidates held at once.
        hidden, num_inputs, num_classes: the MLP.
        batch_size: training images per gradient evaluation.
        sizes: training, validation and test images.
    """
    num_train, num_validation, num_test = sizes
    width = num_inputs + sum(hidden) + num_classes
    per_candidate = _FLOAT32 * (
        _STATE_COPIES * param_count(hidden, num_inputs, num_classes)
        + 3 * batch_size * width
        + 2 * max(num_validation, num_test) * width
        + 3 * num_train
    )
    data = 2 * _FLOAT32 * (num_train + num_validation + num_test) * (num_inputs + 1)
    return num_candidates * per_candidate + data


def check_memory(
    num_workers: int,
    keep: int,
    hidden: Sequence[int],
    num_inputs: int,
    num_classes: int,
    batch_size: int,
    sizes: tuple[int, int, int],
    memory_limit_gb: float,
) -> int:
    """The estimate for ``num_workers + keep`` candidates (refine's largest
    population); returns it in bytes.

    Raises:
        ProblemError: over ``memory_limit_gb`` GiB (one line, before any work).
    """
    needed = population_bytes(
        num_workers + keep, hidden, num_inputs, num_classes, batch_size, sizes
    )
    if needed > memory_limit_gb * 2**30:
        raise ProblemError(
            f"num_workers = {num_workers} candidates need about "
            f"{needed / 2**30:.3g} GiB, over the memory limit of "
            f"{memory_limit_gb:g} GiB (--memory-limit-gb, "
            f"InitSearchConfig.memory_limit_gb); use fewer workers or a smaller "
            "model, or raise the limit"
        )
    return needed
