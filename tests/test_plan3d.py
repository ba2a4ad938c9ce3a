"""3D plans: the vocabulary, our JSON, and Sailor's plan_config (every bundled file)."""

from __future__ import annotations

import json

import pytest
from helpers import small_plan

from pipedejavu.core.layout import DP_OUTER, PP_OUTER, ParallelLayout, StageAxes
from pipedejavu.core.plan3d import (
    Plan3D,
    Replica,
    ReplicaRow,
    Stage3D,
    replica_of,
)
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.sailor_data import bundled_sailor_dir
from pipedejavu.io.sailor_plan import (
    load_plan3d,
    plan_from_sailor,
    plan_to_sailor,
    write_sailor_plan,
)

PLAN_FILES = sorted((bundled_sailor_dir() / "measured").glob("*/plan_config_*.json"))
MEASURED_FIELDS = ("real", "max_mem", "red_grads")


def test_sizes():
    plan = small_plan()
    assert (plan.num_stages, plan.dp, plan.num_layers, plan.num_gpus) == (2, 2, 26, 16)
    assert plan.num_microbatches == 16  # ceil(64 / (2 * 2))
    assert small_plan(gbs=65).num_microbatches == 17
    assert plan.gpus_by_type() == {"GH-96": 16}
    assert plan.describe().startswith("pp 2 [12+14], dp 2, tp 4, mbs 2, gbs 64")


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: small_plan(stages=(Stage3D(1, 26, (Replica("GH-96", 4),)),)),
            "starts at",
        ),
        (
            lambda: small_plan(
                stages=(
                    Stage3D(0, 12, (Replica("GH-96", 4),)),
                    Stage3D(12, 26, (Replica("GH-96", 4),) * 2),
                )
            ),
            "same number of data-parallel replicas",
        ),
        (lambda: Stage3D(3, 3, (Replica("GH-96", 4),)), "at least one layer"),
        (lambda: Replica("GH-96", 0), "tp must be a positive integer"),
        (lambda: Replica("", 1), "gpu_type"),
        (lambda: small_plan(mbs=0), "mbs must be a positive integer"),
        (lambda: small_plan(gbs=1.5), "gbs must be a positive integer"),
        (lambda: Stage3D(0, 2, ()), "at least one Replica"),
    ],
)
def test_validation(build, message):
    with pytest.raises(ProblemError, match=message):
        build()


def test_our_json_round_trip(tmp_path):
    plan = small_plan(
        stages=(
            Stage3D(0, 5, (Replica("RTX-3090", 8, node=0), Replica("RTX-2080", 8))),
            Stage3D(5, 26, (Replica("Titan-RTX", 2, zone="z"), Replica("GH-96", 2))),
        )
    )
    data = plan.to_json()
    assert data["layout"] == {"order": "tp-cp-ep-dp-pp", "dp": 2, "cp": 1}
    assert Plan3D.from_json(json.loads(json.dumps(data))) == plan
    data["iteration_time_s"] = 1.0  # extra keys (a planner's) are ignored
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    loaded, kind = load_plan3d(path)
    assert (loaded, kind) == (plan, "pipedejavu")
    with pytest.raises(ProblemError, match="is a plan for model 'OPT-350'"):
        load_plan3d(path, model="GPT-Neo-2.7")


@pytest.mark.parametrize("path", PLAN_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_bundled_plan_config_round_trips(path, tmp_path):
    original = json.loads(path.read_text())
    plan, kind = load_plan3d(path, model="OPT-350")
    assert kind == "sailor" and plan.model == "OPT-350"
    pipe = original["pipeline_list"][0]
    assert plan.num_stages == pipe["num_stages"]
    assert [list(range(s.start, s.stop)) for s in plan.stages] == pipe[
        "layers_per_stage"
    ]
    assert [s.dp for s in plan.stages] == pipe["dp"]
    assert (plan.mbs, plan.gbs) == (original["mbs"], original["gbs"])
    # Writing gives back the file minus its measured fields, key for key.
    expected = {k: v for k, v in original.items() if k not in MEASURED_FIELDS}
    assert plan_to_sailor(plan) == expected
    out = tmp_path / "back.json"
    write_sailor_plan(plan, out)
    assert load_plan3d(out, model="OPT-350")[0] == plan


def test_measured_fields_are_not_read():
    data = json.loads(PLAN_FILES[0].read_text())
    stripped = {k: v for k, v in data.items() if k not in MEASURED_FIELDS}
    garbage = dict(stripped, real="not a number", max_mem=None)
    assert plan_from_sailor(garbage) == plan_from_sailor(data)


def _sailor(**changes):
    data = json.loads(PLAN_FILES[0].read_text())
    data["pipeline_list"][0].update(changes)
    return data


@pytest.mark.parametrize(
    "data, message",
    [
        ({"pipeline_list": []}, "0 pipelines"),
        ({"mbs": 1}, "'pipeline_list' list"),
        (_sailor(layers_per_stage=[[0, 2, 3]]), "not consecutive"),
        (_sailor(dp=[3]), "dp is 3 but tmp_per_stage lists"),
        (_sailor(num_stages=2), "must agree"),
        (
            _sailor(tmp_per_stage=[[[[["GH-96", 4, "z"], ["GH-96", 4, "z"]], 8]] * 16]),
            "spans 2 nodes",
        ),
        (_sailor(tmp_per_stage=[[[[["GH-96", 4, "z"]], 0]] * 16]), "tp must be"),
    ],
)
def test_bad_plan_config(data, message):
    with pytest.raises(ProblemError, match=message):
        plan_from_sailor(data, source="x.json")


def test_unreadable_files(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(ProblemError, match="cannot read"):
        load_plan3d(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ProblemError, match="invalid JSON"):
        load_plan3d(broken)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"stages": [{"layers": [0]}]}')
    with pytest.raises(ProblemError, match="wrong.json: not a valid 3D plan"):
        load_plan3d(wrong)


# ------------------------------------------------------------ the plan's layout
def _placed(order, tp=2, dp=4, pp=2, gpn=8):
    """A plan on nodes of ``gpn`` GPUs placed in ``order`` (legacy names)."""
    from pipedejavu.core.placement import canonical_nodes

    nodes = canonical_nodes([tp] * pp, dp, gpn, order)
    return Plan3D(
        tuple(
            Stage3D(s, s + 1, tuple(Replica("A100", tp, node=n) for n in nodes[s]))
            for s in range(pp)
        ),
        mbs=1,
        gbs=dp,
        layout=ParallelLayout.uniform(tp=tp, pp=pp, dp=dp, order=order),
    )


def test_every_plan_has_a_layout_its_stages_imply():
    plan = small_plan()
    assert plan.layout == ParallelLayout.uniform(tp=4, pp=2, dp=2)
    assert plan.layout.order == PP_OUTER
    gh = Replica("GH-96", 4)
    # a plan of one stage stores the default order: both orders are one layout
    one = Plan3D(
        (Stage3D(0, 26, (gh, gh)),),
        mbs=1,
        gbs=2,
        layout=ParallelLayout.uniform(tp=4, dp=2, order=DP_OUTER),
    )
    assert one.layout.order == PP_OUTER


@pytest.mark.parametrize(
    "layout, message",
    [
        (ParallelLayout.uniform(tp=4, pp=3, dp=2), "pp 3 and dp 2"),
        (ParallelLayout.uniform(tp=4, pp=2, dp=1), "pp 2 and dp 1"),
        (ParallelLayout.uniform(tp=2, pp=2, dp=2), "layout says tp 2"),
        ("tp-dp-pp", "must be a ParallelLayout"),
    ],
)
def test_a_layout_must_match_the_stages(layout, message):
    with pytest.raises(ProblemError, match=message):
        small_plan(layout=layout)


def test_a_stage_mixing_tp_degrees_is_refused():
    stage = Stage3D(0, 26, (Replica("GH-96", 4), Replica("GH-96", 2)))
    with pytest.raises(ProblemError, match=r"stage 0 mixes TP degrees \[2, 4\]"):
        Plan3D((stage,), mbs=1, gbs=2)


def test_context_and_expert_axes_count_and_round_trip():
    layout = ParallelLayout((StageAxes(4, ep=8, etp=1), StageAxes(4, ep=4)), dp=2, cp=2)
    plan = small_plan(layout=layout)
    assert plan.num_gpus == 2 * 4 * 2 * 2 and plan.gpus_by_type() == {"GH-96": 32}
    assert "cp 2, ep 4/8, etp 1" in plan.describe()
    data = json.loads(json.dumps(plan.to_json()))
    assert data["layout"] == {"order": PP_OUTER, "dp": 2, "cp": 2}
    assert [(s.get("ep"), s.get("etp")) for s in data["stages"]] == [(8, 1), (4, None)]
    assert Plan3D.from_json(data) == plan


def test_old_files_read_their_order_from_rank_order_or_their_nodes():
    mapped = _placed("tp-pp-dp")
    assert mapped.layout.order == DP_OUTER
    data = mapped.to_json()
    del data["layout"]  # a file written before plans had layouts
    assert Plan3D.from_json(data).layout.order == DP_OUTER  # from its nodes
    data["rank_order"] = "tp-pp-dp"
    assert Plan3D.from_json(data).layout.order == DP_OUTER
    # without nodes nothing tells: Megatron's default
    for stage in data["stages"]:
        for replica in stage["replicas"]:
            del replica["node"]
    del data["rank_order"]
    assert Plan3D.from_json(data).layout.order == PP_OUTER
    # the layout's own order wins over the nodes (checked where exports read it)
    data = _placed("tp-dp-pp").to_json()
    data["layout"]["order"] = "tp-pp-dp"  # legacy name read
    assert Plan3D.from_json(data).layout.order == DP_OUTER


@pytest.mark.parametrize(
    "layout, message",
    [
        ([], "'layout' must be an object"),
        ({"order": "pp-tp"}, "rank order must be one of"),
        ({"size": 3}, "unknown key 'size'"),
        ({"dp": 3}, "the layout's dp 3 is not the 4 replicas"),
        ({"cp": 0}, "cp must be >= 1, got 0"),
        ({"cp": 2**40}, "cp must be <= 131072"),
    ],
)
def test_bad_layout_objects_in_files(layout, message):
    data = _placed("tp-dp-pp").to_json()
    data["layout"] = layout
    with pytest.raises(ProblemError, match=message):
        Plan3D.from_json(data, source="p.json")


def test_bad_expert_axes_in_files():
    data = _placed("tp-dp-pp").to_json()
    data["stages"][0]["ep"] = 3  # 3 does not divide the stage's 8 GPUs
    with pytest.raises(ProblemError, match="not whole groups of etp 2 x ep 3"):
        Plan3D.from_json(data, source="p.json")
    data["stages"][0]["ep"] = "8"
    with pytest.raises(ProblemError, match="p.json: .*ep must be"):
        Plan3D.from_json(data, source="p.json")


def test_exports_read_the_layout_order_and_check_it_against_the_nodes():
    from pipedejavu.core.placement import plan_rank_order

    assert plan_rank_order(_placed("tp-pp-dp"), 8) == "tp-pp-dp"
    assert plan_rank_order(_placed("tp-dp-pp"), 8) == "tp-dp-pp"
    # one node: both orders place the GPUs alike, the layout's is kept
    assert plan_rank_order(_placed("tp-pp-dp", dp=2), 8) == "tp-pp-dp"
    wrong = _placed("tp-pp-dp")
    wrong = wrong.replace(layout=_placed("tp-dp-pp").layout)
    with pytest.raises(ProblemError, match="says rank order tp-dp-pp, but its nodes"):
        plan_rank_order(wrong, 8)


def test_replace_keeps_the_layout_axes_the_new_stages_allow():
    plan = _placed("tp-pp-dp", pp=3)
    cut = plan.replace(stages=plan.stages[:2])
    assert cut.layout == ParallelLayout.uniform(tp=2, pp=2, dp=4, order=DP_OUTER)
    experts = small_plan(layout=ParallelLayout((StageAxes(4, ep=2),) * 2, 2, cp=2))
    gh = experts.stages[0].replicas
    moved = (Stage3D(0, 10, gh), Stage3D(10, 26, gh))
    assert experts.replace(stages=moved).layout == experts.layout
    assert experts.replace(mbs=1).layout == experts.layout


def test_replica_of_shares_one_checked_replica_per_value():
    """replica_of gives a replica equal to a new one, the same object for the
    same value, and refuses what Replica refuses; on_node keeps the rest."""
    first = replica_of("GH-96", 4, "zone-b", 3, 4)
    assert first == Replica("GH-96", 4, zone="zone-b", node=3, gpus_on_node=4)
    assert replica_of("GH-96", 4, "zone-b", 3, 4) is first
    assert replica_of("GH-96", 4, "zone-b", 5, 4) != first
    moved = first.on_node(7)
    assert moved == Replica("GH-96", 4, zone="zone-b", node=7, gpus_on_node=4)
    assert moved.on_node(3) is first
    with pytest.raises(ProblemError, match="tp must be a positive integer"):
        replica_of("GH-96", 0)
    with pytest.raises(ProblemError, match="node must be an integer"):
        first.on_node(-1)


def test_a_replica_row_is_the_tuple_of_its_replicas():
    """A ReplicaRow equals, hashes and slices as the tuple of its replicas; a
    stage and a plan built from either are equal and write the same JSON."""
    kind = Replica("GH-96", 2, zone="zone-b")
    nodes = [0, 0, 1, 1, None, 3]
    row = ReplicaRow(kind, nodes)
    replicas = tuple(Replica("GH-96", 2, zone="zone-b", node=n) for n in nodes)
    assert row == replicas and replicas == row and hash(row) == hash(replicas)
    assert list(row) == list(replicas) and len(row) == 6 and row[2] == replicas[2]
    assert row[1::2] == replicas[1::2] and isinstance(row[1::2], ReplicaRow)
    plans = [
        Plan3D((Stage3D(0, 2, held), Stage3D(2, 4, held)), mbs=1, gbs=12)
        for held in (row, replicas)
    ]
    assert plans[0] == plans[1]
    assert plans[0].to_json() == plans[1].to_json()
    assert plans[0].gpus_by_type() == plans[1].gpus_by_type() == {"GH-96": 24}
    assert Plan3D.from_json(plans[0].to_json()) == plans[0]
    for bad in (-1, True, 2.0, 2**40):
        with pytest.raises(ProblemError, match="node must be an integer"):
            ReplicaRow(kind, [0, bad])
    with pytest.raises(ProblemError, match="at least one Replica"):
        ReplicaRow(kind, [])


@pytest.mark.parametrize("seed", range(30))
def test_check_nodes_reads_a_row_as_its_replicas(seed):
    """check_nodes accepts and refuses a plan of ReplicaRows as it does the
    same plan of Replica tuples, with the same message."""
    import random

    from pipedejavu.core.placement import check_nodes

    rng = random.Random(seed)
    stages, start = [], 0
    for _ in range(rng.randint(1, 3)):
        kind = Replica(rng.choice(["A", "B"]), rng.choice([1, 2, 4, 8]))
        nodes = [rng.choice([None, 0, 1, 2, 3]) for _ in range(3)]
        stages.append((start, kind, nodes))
        start += 1
    outcomes = []
    for as_row in (True, False):
        plan = Plan3D(
            tuple(
                Stage3D(
                    first,
                    first + 1,
                    ReplicaRow(kind, nodes)
                    if as_row
                    else tuple(kind.on_node(n) for n in nodes),
                )
                for first, kind, nodes in stages
            ),
            mbs=1,
            gbs=3,
        )
        try:
            check_nodes(plan, lambda gpu: {"A": 8, "B": 4}[gpu])
            outcomes.append(None)
        except ProblemError as error:
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1]
