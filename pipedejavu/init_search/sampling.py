"""Keep the best candidates and resample new starting points around them.

Resampling keeps each new point distributed like the base initialization when
its parent was: a child of parent parameters ``p`` at scale ``s`` in (0, 1] is
``sqrt(1 - s**2) * p + s * z`` with ``z`` a fresh draw from the base
distribution (He or Glorot kernels, zero biases). ``s = 1`` is a fresh draw
(the coarse first round); as ``s`` shrinks the children crowd around their
parent (the finer rounds). Kernels keep the base variance, so no child starts
with exploding or vanishing activations that the base scheme would not give.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["resample", "resample_scales", "select_top_k"]


def resample_scales(num_rounds: int, initial_scale: float, shrink: float) -> np.ndarray:
    """Neighbourhood scale of each search round.

    Args:
        num_rounds: R rounds.
        initial_scale: scale of round 1 (the first resampling), in (0, 1].
        shrink: factor per later round, in (0, 1].

    Returns:
        f64[R]: 1.0 for round 0 (fresh draws), then ``initial_scale *
        shrink**(r - 1)`` for round r >= 1.
    """
    if not 0 < initial_scale <= 1:
        raise ValueError(f"initial_scale must lie in (0, 1], got {initial_scale}")
    if not 0 < shrink <= 1:
        raise ValueError(f"shrink must lie in (0, 1], got {shrink}")
    rounds = np.arange(num_rounds, dtype=np.float64)
    return np.where(rounds == 0, 1.0, initial_scale * shrink ** (rounds - 1))


@partial(jax.jit, static_argnames="k")
def select_top_k(scores: jax.Array, *, k: int) -> jax.Array:
    """Indices i32[k] of the k lowest scores of f32[C], lowest first.

    NaN (a diverged candidate) counts as +inf; ties go to the lower index.
    """
    scores = jnp.where(jnp.isnan(scores), jnp.inf, scores)
    return jax.lax.top_k(-scores, k)[1]


@jax.jit
def resample(
    parents: Any, parent_index: jax.Array, scale: jax.Array, fresh: Any
) -> Any:
    """New starting points around parent parameters.

    Args:
        parents: stacked parameter pytrees (leading axis [P]) to resample around.
        parent_index: i32[C] the parent of each child.
        scale: f32[] neighbourhood scale s in (0, 1].
        fresh: stacked draws from the base distribution (leading axis [C]), one
            per child (:func:`pipedejavu.init_search.train.init_population`).

    Returns:
        Stacked children (leading axis [C]): ``sqrt(1 - s**2) * parent + s *
        fresh``.
    """
    keep = jnp.sqrt(1.0 - scale**2)
    return jax.tree_util.tree_map(
        lambda p, z: keep * p[parent_index] + scale * z, parents, fresh
    )
