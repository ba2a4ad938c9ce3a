"""The ZB-H1 zero-bubble pipeline schedule on the discrete-event simulator.

Qi et al. (ICLR'24, "Zero Bubble Pipeline Parallelism") split each backward
into ``B`` (the input gradient, which the previous stage waits for) and ``W``
(the weight gradient, which nobody waits for). ZB-H1 keeps 1F1B's warm-up and
defers the ``W`` passes so that they fill the cool-down, where 1F1B's ranks wait
for gradients. This is the order of PyTorch's
``ScheduleInterleavedZeroBubble`` (``torch.distributed.pipelining``, the
paper's ZB-1p) with one stage per rank, which torchtitan launches as
``InterleavedZeroBubble``:

* rank ``r`` of ``P`` runs ``min(P - r - 1, M)`` warm-up forwards;
* then per step one forward and one ``B``; after its ``j``-th ``B`` (from 0) it
  runs the oldest pending ``W`` once ``j >= r`` (rank ``r`` keeps ``r`` weight
  passes pending, which the cool-down then fills in);
* then the remaining ``B`` passes with the same rule, then the remaining ``W``.

The event loop is :func:`pipedejavu.simulation.interleaved.run_interleaved`
(links, buffered sends and first-come-first-served as there); a ``W`` runs on
its rank after its ``B`` and sends nothing.

**Closed form** (``tests/test_zero_bubble.py``): equal stages ``f``, ``b``,
``w`` with ``w <= f`` and ``w <= b <= w + f`` (the paper's ``F = B = W`` among
them) and free links, ``M >= P``: the iteration takes
``M (f + b + w) + (P - 1)(f + b - w)``, against 1F1B's ``M (f + b + w) + (P -
1)(f + b + w)`` with the backward whole: the bubble shrinks by ``2 (P - 1) w``.
Outside that regime it is longer (with ``w > b`` the last rank ends at ``(P -
1) f + M (f + b + w)``: its ``P - 1`` pending ``W`` passes run after its last
``B``).

**Memory.** A micro-batch counts as in flight from its forward to its ``W``
(:attr:`ZeroBubbleResult.peak_in_flight`), holding all its stashed activations
until then: an upper bound (after ``B`` the real runtime keeps only what ``W``
needs, the inputs of the linear layers and their output gradients). Rank ``r``
peaks at ``min(P, M)`` micro-batches, every rank as many as 1F1B's first.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pipedejavu.simulation.interleaved import Op, checked_array, run_interleaved

__all__ = [
    "ZeroBubbleResult",
    "simulate_zero_bubble",
    "zero_bubble_in_flight",
    "zero_bubble_order",
]


def _count(value, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return int(value)


def zero_bubble_in_flight(num_ranks: int, num_microbatches: int) -> int:
    """The most micro-batches any rank holds in flight (forward done, ``W`` not
    yet) under :func:`zero_bubble_order`: ``min(P, M)``, on every rank
    (``tests/test_zero_bubble.py`` checks it against the order)."""
    return min(
        _count(num_ranks, "num_ranks", 1),
        _count(num_microbatches, "num_microbatches", 1),
    )


def zero_bubble_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Op]:
    """The commands of rank ``rank`` in run order (module docstring).

    Example:
        >>> ops = zero_bubble_order(1, 2, 3)
        >>> " ".join("FBW"[o.backward + o.weight] + str(o.microbatch) for o in ops)
        'F0 B0 F1 B1 W0 F2 B2 W1 W2'

    Raises:
        ValueError: a size below 1, or ``rank`` outside ``[0, num_ranks)``.
    """
    ranks = _count(num_ranks, "num_ranks", 1)
    count = _count(num_microbatches, "num_microbatches", 1)
    rank = _count(rank, "rank", 0)
    if rank >= ranks:
        raise ValueError(f"rank must be in [0, {ranks}), got {rank}")
    warmup = min(ranks - rank - 1, count)
    order = [Op(False, 0, b) for b in range(warmup)]
    pending = 0  # the oldest micro-batch whose W has not run
    for j in range(count):
        if warmup + j < count:
            order.append(Op(False, 0, warmup + j))
        order.append(Op(True, 0, j))
        if j >= rank:
            order.append(Op(True, 0, pending, True))
            pending += 1
    order += [Op(True, 0, b, True) for b in range(pending, count)]
    return order


@functools.lru_cache(maxsize=4096)
def _order(rank: int, num_ranks: int, num_microbatches: int) -> tuple[Op, ...]:
    """:func:`zero_bubble_order`, kept (the predictor asks for the same orders
    over and over)."""
    return tuple(zero_bubble_order(rank, num_ranks, num_microbatches))


@functools.lru_cache(maxsize=4096)
def _peak(rank: int, num_ranks: int, num_microbatches: int) -> int:
    """The most micro-batches the rank holds between a forward and its ``W``
    under its order."""
    held = peak = 0
    for op in _order(rank, num_ranks, num_microbatches):
        held += 1 if not op.backward else (-1 if op.weight else 0)
        peak = max(peak, held)
    return peak


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroBubbleResult:
    """The timed ZB-H1 schedule of one iteration.

    Attributes:
        num_microbatches: M.
        iteration_time: seconds until the last command ends.
        forward_end, input_grad_end, weight_grad_end: f64[P, M] seconds at
            which each rank ends ``F``, ``B`` and ``W`` of each micro-batch.
        busy_time: f64[P] seconds each rank computes, ``M (f + b + w)``.
        peak_in_flight: i64[P] most micro-batches forwarded whose ``W`` has
            not yet run.
        peak_memory: f64[P] ``peak_in_flight x memory_per_microbatch`` (the
            order's peak), or ``None``.
    """

    num_microbatches: int
    iteration_time: float
    forward_end: NDArray[np.float64]
    input_grad_end: NDArray[np.float64]
    weight_grad_end: NDArray[np.float64]
    busy_time: NDArray[np.float64]
    peak_in_flight: NDArray[np.int64]
    peak_memory: NDArray[np.float64] | None


def simulate_zero_bubble(
    forward: ArrayLike,
    input_grad: ArrayLike,
    weight_grad: ArrayLike,
    num_microbatches: int,
    *,
    transfer: ArrayLike | None = None,
    memory_per_microbatch: ArrayLike | None = None,
) -> ZeroBubbleResult:
    """Simulate one iteration of ZB-H1 (module docstring).

    Args:
        forward: f64[P] seconds of each rank's forward per micro-batch.
        input_grad: f64[P] seconds of its ``B`` (input gradient; any
            recomputation belongs here).
        weight_grad: f64[P] seconds of its ``W``.
        num_microbatches: M >= 1.
        transfer: f64[P - 1] seconds per micro-batch per direction over the
            link after each rank but the last (``None``: free links).
        memory_per_microbatch: f64[P] bytes one micro-batch holds on a rank
            from its forward to its ``W`` (``None``: no memory report).

    Raises:
        ValueError: naming the bad argument, what was expected and what arrived.

    Example:
        >>> # P = 4, f = b = w = 1, M = 8: M (f + b + w) + (P - 1)(f + b - w)
        >>> simulate_zero_bubble([1.0] * 4, [1.0] * 4, [1.0] * 4, 8).iteration_time
        27.0
    """
    array = np.asarray(forward)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"forward must have shape (P,) with P >= 1, got {array.shape}")
    ranks = array.size
    count = _count(num_microbatches, "num_microbatches", 1)
    f = checked_array(forward, "forward", (ranks,))
    b = checked_array(input_grad, "input_grad", (ranks,))
    w = checked_array(weight_grad, "weight_grad", (ranks,))
    links = np.zeros(ranks)
    if transfer is not None:
        links[:-1] = checked_array(transfer, "transfer", (ranks - 1,))
    orders = [_order(r, ranks, count) for r in range(ranks)]
    grids = run_interleaved(
        f[:, None].tolist(),
        b[:, None].tolist(),
        links.tolist(),
        orders,
        count,
        weight=w[:, None].tolist(),
    )
    f_end, b_end, w_end = (np.array(grids[k])[:, 0, :] for k in (1, 3, 9))
    iteration = float(max(f_end.max(), b_end.max(), w_end.max()))
    peak = np.array([_peak(r, ranks, count) for r in range(ranks)], dtype=np.int64)
    memory = None
    if memory_per_microbatch is not None:
        memory = peak * checked_array(
            memory_per_microbatch, "memory_per_microbatch", (ranks,)
        )
    return ZeroBubbleResult(
        num_microbatches=count,
        iteration_time=iteration,
        forward_end=f_end,
        input_grad_end=b_end,
        weight_grad_end=w_end,
        busy_time=count * (f + b + w),
        peak_in_flight=peak,
        peak_memory=memory,
    )
