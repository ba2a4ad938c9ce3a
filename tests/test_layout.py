"""The named-axis layout (pipedejavu.core.layout) against Megatron-Core's own
rank groups, recorded by ``tests/fixtures/make_megatron_rank_groups.py``, and
against the per-stage-TP placement the plans here have always used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.layout import (
    DP_OUTER,
    MAX_GPUS,
    PP_OUTER,
    ParallelLayout,
    StageAxes,
    rank_order,
)
from pipedejavu.core.plan3d import canonical_nodes

FIXTURE = json.loads(
    (Path(__file__).parent / "fixtures" / "megatron_rank_groups.json").read_text()
)
LAYOUTS = FIXTURE["layouts"]


def _layout(entry: dict) -> ParallelLayout:
    sizes = {k: entry[k] for k in ("tp", "cp", "dp", "pp", "ep", "etp")}
    return ParallelLayout.uniform(**sizes, order=entry["order"])


def test_the_fixture_covers_both_orders_refusals_and_folded_context():
    accepted = [e for e in LAYOUTS if "refused" not in e]
    assert FIXTURE["megatron_core"] == "0.16.1"
    assert len(accepted) >= 300 and len(LAYOUTS) - len(accepted) >= 100
    assert {e["order"] for e in accepted} == {PP_OUTER, DP_OUTER}
    # experts folded over context parallelism, expert TP below TP, pp > 1
    assert any(e["cp"] > 1 and e["ep"] > 1 and e["pp"] > 1 for e in accepted)
    assert any(e["etp"] < e["tp"] and e["ep"] > 1 for e in accepted)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_groups_are_megatrons(index):
    """Every group Megatron-Core builds, members in its order, and the
    layouts it refuses refused."""
    entry = LAYOUTS[index]
    if "refused" in entry:
        with pytest.raises(ProblemError):
            _layout(entry)
        return
    layout = _layout(entry)
    assert layout.num_gpus == entry["tp"] * entry["cp"] * entry["dp"] * entry["pp"]
    # the expert generator's pp groups are the dense ones (Megatron checks)
    for axes, groups in [*entry["dense"].items(), *entry["expert"].items()]:
        assert layout.groups(axes) == groups, (axes, entry)


@st.composite
def layouts(draw):
    """Layouts with a TP per stage (dense and expert axes)."""
    pp = draw(st.integers(1, 4))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.integers(1, 4))
    order = draw(st.sampled_from([PP_OUTER, DP_OUTER]))
    stages = []
    for _ in range(pp):
        tp = draw(st.sampled_from([1, 2, 4]))
        if order == DP_OUTER and pp > 1:
            ep, etp = 1, tp * cp  # the expert block must be the dense one
        else:
            ep = draw(
                st.sampled_from([d for d in (1, 2, 4) if (tp * cp * dp) % d == 0])
            )
            etp = draw(
                st.sampled_from([d for d in (1, 2) if (tp * cp * dp) % (d * ep) == 0])
            )
        stages.append(StageAxes(tp, ep, etp))
    return ParallelLayout(tuple(stages), dp, cp, order)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_gpu_has_one_rank_and_groups_partition_them(layout):
    dense = [rank for stage in layout.stage_ranks() for rank in stage]
    assert sorted(dense) == list(range(layout.num_gpus))
    for s in range(layout.pp):
        sizes = layout.sizes(s)
        expert = {
            layout.expert_rank(s, etp=x, ep=e, edp=f)
            for x in range(sizes["etp"])
            for e in range(sizes["ep"])
            for f in range(sizes["edp"])
        }
        assert expert == set(layout.stage_ranks()[s])  # the same GPUs, laid out again
    for axes in ("tp", "cp", "dp", "dp-cp", "tp-cp", "etp", "ep", "edp", "etp-ep"):
        members = sorted(r for group in layout.groups(axes) for r in group)
        assert members == list(range(layout.num_gpus)), axes


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=5),
    st.integers(1, 4),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from(["tp-dp-pp", "tp-pp-dp"]),
)
def test_per_stage_tp_places_replicas_as_plans_always_have(tps, dp, per_node, order):
    """Replica ``j`` of stage ``s`` starts at rank ``dp sum_{r<s} tp_r + j
    tp_s`` (tp-dp-pp) or ``j G + sum_{r<s} tp_r`` (tp-pp-dp, ``G = sum tp``),
    the numbering plans have always had; plan3d.canonical_nodes places them
    on nodes by it."""
    layout = ParallelLayout(tuple(tps), dp, order=order)
    expected = []
    for s, tp in enumerate(tps):
        if order == "tp-dp-pp":
            expected.append([dp * sum(tps[:s]) + j * tp for j in range(dp)])
        else:
            expected.append([j * sum(tps) + sum(tps[:s]) for j in range(dp)])
    assert [[layout.rank(s, dp=j) for j in range(dp)] for s in range(len(tps))] == (
        expected
    )
    assert [layout.replica_ranks(s) for s in range(len(tps))] == expected
    assert canonical_nodes(tps, dp, per_node, order) == [
        [rank // per_node for rank in ranks] for ranks in expected
    ]
    # and a replica's TP group is its consecutive ranks
    for s, tp in enumerate(tps):
        first = layout.rank(s, dp=dp - 1)
        assert [layout.rank(s, tp=t, dp=dp - 1) for t in range(tp)] == list(
            range(first, first + tp)
        )


def test_legacy_order_names_and_bad_input_give_one_line():
    assert rank_order("tp-dp-pp") == PP_OUTER and rank_order("tp-pp-dp") == DP_OUTER
    assert ParallelLayout((2, 2), 2, order="tp-pp-dp").order == DP_OUTER
    bad = [
        (dict(stages=(), dp=1), "at least one stage"),
        (dict(stages=(0,), dp=1), "stage 0: tp must be >= 1"),
        (dict(stages=(2,), dp=1.5), "dp must be an integer"),
        (dict(stages=(2,), dp=1, order="pp-dp-tp"), "rank order must be one of"),
        (dict(stages=(4,), dp=2**16), f"at most {MAX_GPUS} GPUs"),
        (dict(stages=(2, 10**30), dp=1), "stage 1: tp must be <="),
        (dict(stages=(StageAxes(2, 3),), dp=2), "not whole groups of etp 2 x ep 3"),
        (
            dict(stages=(StageAxes(2, 2, 2), 2), dp=4, order=DP_OUTER),
            "etp x ep (4) must be tp x cp (2)",
        ),
        (dict(stages="22", dp=1), "stages must be a sequence"),
    ]
    for kwargs, says in bad:
        with pytest.raises(
            ProblemError, match=says.replace("(", r"\(").replace(")", r"\)")
        ):
            ParallelLayout(**kwargs)
    layout = ParallelLayout((2, 4), 2)
    with pytest.raises(ProblemError, match="stages' sizes differ"):
        layout.groups("pp")
    with pytest.raises(ProblemError, match="distinct names"):
        layout.groups("tp-ep")
    with pytest.raises(ProblemError, match="tp must be in"):
        layout.rank(0, tp=2)
    with pytest.raises(ProblemError, match="stage must be in"):
        layout.rank(2)


def test_one_stage_is_one_layout_in_both_orders():
    """Megatron allows any expert data parallelism with one stage: both orders
    number the GPUs alike."""
    for ep, etp in [(1, None), (4, 1), (2, 2)]:
        a = ParallelLayout.uniform(tp=2, cp=2, dp=2, ep=ep, etp=etp)
        b = ParallelLayout.uniform(tp=2, cp=2, dp=2, ep=ep, etp=etp, order=DP_OUTER)
        for axes in ("tp", "cp", "dp", "ep", "edp", "etp-ep"):
            assert a.groups(axes) == b.groups(axes)


@pytest.mark.parametrize(
    "layout, owners",
    [
        # expert blocks of 2 GPUs in replicas of 2: one block a replica
        (ParallelLayout.uniform(tp=2, pp=2, dp=4, ep=2, etp=1), [0, 1, 2, 3]),
        # a block of 8 covers all four replicas: one expert-DP member
        (ParallelLayout.uniform(tp=2, pp=2, dp=4, ep=8, etp=1), [0]),
        # blocks of 2 inside replicas of 4: two members a replica
        (
            ParallelLayout.uniform(tp=4, pp=2, dp=4, ep=2, etp=1),
            [0, 0, 1, 1, 2, 2, 3, 3],
        ),
        # replicas outermost: blocks are the replicas
        (
            ParallelLayout.uniform(tp=2, pp=2, dp=4, ep=2, etp=1, order=DP_OUTER),
            [0, 1, 2, 3],
        ),
    ],
)
def test_expert_replicas_hold_the_first_gpu_of_each_expert_block(layout, owners):
    for stage in range(layout.pp):
        got = layout.expert_replicas(stage)
        assert got == owners and len(got) == layout.edp(stage)
        # the block's first rank (expert rank etp 0, ep 0, edp f) lies in it
        firsts = layout.replica_ranks(stage)
        for f, j in enumerate(got):
            rank = layout.expert_rank(stage, edp=f)
            assert firsts[j] <= rank < firsts[j] + layout.model_size(stage)
