"""The proof's memory rule under ZB-H1 counts the stages a chain can have in
O(L) per micro-batch count (:func:`~pipedejavu.search.megatron.space.
cover_counts`) where the capacities nest; checked against the reachability
over every count (:func:`~pipedejavu.search.megatron.space.chain_counts`)."""

from __future__ import annotations

import numpy as np
import pytest

from pipedejavu.search.megatron.space import (
    chain_counts,
    cover_counts,
    nested_capacities,
)


def _table(rng, layers: int, first_bonus: bool) -> np.ndarray:
    """Capacities that fall as a span grows (a budget less each layer's
    cost), spans from layer 0 raised at random (the first stage stashes token
    ids, not its input)."""
    cost = rng.uniform(0, 5, layers)
    budget = rng.uniform(5, 30)
    table = np.full((layers, layers), -1.0)
    for a in range(layers):
        for e in range(a, layers):
            bonus = rng.uniform(0, 10) if a == 0 and first_bonus else 0.0
            table[a, e] = np.floor(budget - cost[a : e + 1].sum() + bonus)
    return table


@pytest.mark.parametrize("seed", range(6))
def test_cover_counts_equal_the_reachability_on_nested_tables(seed):
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(300):
        layers = int(rng.integers(1, 14))
        table = _table(rng, layers, first_bonus=bool(rng.integers(0, 2)))
        assert nested_capacities(table)
        most = int(rng.integers(1, layers + 3))
        for need in (1, 2, 3, 5, 8, 13):
            memory = np.where(table >= need, most, -1).astype(np.int64)
            memory[np.tril_indices(layers, -1)] = -1
            want = chain_counts(memory, most)
            assert (cover_counts(table, need, most) == want).all()
            checked += int(want.any())
    assert checked > 100  # many of them hold a chain


def test_a_table_that_does_not_nest_past_the_first_layer_is_told():
    table = _table(np.random.default_rng(1), 6, first_bonus=False)
    assert nested_capacities(table)
    table[2, 4] = table[2, 3] + 1  # a span holding more than one inside it
    assert not nested_capacities(table)
    table = _table(np.random.default_rng(1), 6, first_bonus=False)
    table[0, 3] = 1e9  # from layer 0: allowed
    assert nested_capacities(table)
