"""Both rank orders exported to Megatron-LM, checked by Megatron-LM's own code.

For every plan of a grid (TP, pipeline stages, DP, GPUs per node), placed in
each of Megatron-LM's rank orders (:func:`pipedejavu.core.plan3d.
canonical_nodes`), the exported arguments go through Megatron-LM's
``parse_args`` and ``validate_args`` (as in ``benchmarks/check_exports.py``):
``--use-tp-pp-dp-mapping`` must be set exactly for ``tp-pp-dp`` plans. Then
Megatron Core's ``RankGenerator`` with the order ``initialize.py`` passes for
those arguments (``tp-cp-ep-dp-pp``, or ``tp-cp-ep-pp-dp`` with the flag) gives
the pipeline and data-parallel rank groups; each must be the ranks our plan
puts on each pipeline and on each stage's replicas (stage ``s``, replica
``j``, TP rank ``t`` at rank ``s dp tp + j tp + t`` or ``j G + s tp + t``),
and the node of each rank (``rank // GPUs per node``) the node our plan gives
that replica.

Needs the launchers' environment of ``benchmarks/check_exports.py``; not run
by CI.

    PYTHONPATH=.:MEGATRON_LM_SOURCE python benchmarks/check_rank_order_export.py
"""

from __future__ import annotations

import shlex

import check_exports  # Megatron's argument parsing, silenced

from pipedejavu.core.plan3d import RANK_ORDERS, Plan3D, rank_order_of
from pipedejavu.costmodel.megatron.tables import plan_from_stages
from pipedejavu.io.exports import export_plan

#: The order Megatron-LM's ``initialize.py`` builds its groups with.
MEGATRON_ORDER = {"tp-dp-pp": "tp-cp-ep-dp-pp", "tp-pp-dp": "tp-cp-ep-pp-dp"}


def plans():
    """``(plan, order, gpus per node)`` over a grid."""
    for tp in (1, 2, 4):
        for pp in (2, 3, 4, 8):
            for dp in (1, 2, 3, 4, 8):
                for gpn in (4, 8):
                    if tp > gpn:
                        continue
                    blocks = 24
                    bounds = [0, *(1 + blocks * s // pp for s in range(1, pp)), 26]
                    stages = [
                        (a, b, tp) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                    ]
                    for order in RANK_ORDERS:
                        plan = plan_from_stages(
                            stages,
                            gpu_type="H100-SXM",
                            dp=dp,
                            mbs=1,
                            gbs=dp * pp,
                            model="m",
                            gpus_per_node=gpn,
                            zone="z",
                            rank_order=order,
                        )
                        yield plan, order, gpn


def ours(plan: Plan3D, order: str) -> tuple[set, set, dict]:
    """Our pipeline groups, data-parallel groups and node of each rank."""
    tp, pp, dp = plan.stages[0].replicas[0].tp, plan.num_stages, plan.dp
    pipeline = tp * pp

    def rank(s: int, j: int, t: int) -> int:
        if order == RANK_ORDERS[0]:
            return s * dp * tp + j * tp + t
        return j * pipeline + s * tp + t

    pipes = {
        tuple(rank(s, j, t) for s in range(pp)) for j in range(dp) for t in range(tp)
    }
    data = {
        tuple(rank(s, j, t) for j in range(dp)) for s in range(pp) for t in range(tp)
    }
    nodes = {
        rank(s, j, t): plan.stages[s].replicas[j].node
        for s in range(pp)
        for j in range(dp)
        for t in range(tp)
    }
    return pipes, data, nodes


def check(plan: Plan3D, order: str, gpn: int) -> str:
    from megatron.core.parallel_state import RankGenerator

    if rank_order_of(plan, gpn) not in (order, RANK_ORDERS[0]):
        return f"placed as {rank_order_of(plan, gpn)}"
    text = export_plan(plan, "megatron", gpus_per_node={"H100-SXM": gpn})
    args, _ = check_exports.megatron_args(
        shlex.split(text.splitlines()[-1]), plan.num_gpus
    )
    exported = "tp-pp-dp" if args.use_tp_pp_dp_mapping else "tp-dp-pp"
    placed = rank_order_of(plan, gpn)
    if exported != placed:
        return f"exported {exported} for a {placed} plan"
    tp, pp, dp = plan.stages[0].replicas[0].tp, plan.num_stages, plan.dp
    generator = RankGenerator(
        tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=MEGATRON_ORDER[exported]
    )
    pipes, data, nodes = ours(plan, placed)
    if {tuple(g) for g in generator.get_ranks("pp")} != pipes:
        return "pipeline groups differ"
    if {tuple(g) for g in generator.get_ranks("dp")} != data:
        return "data-parallel groups differ"
    base = min(nodes.values())
    if any(rank // gpn != node - base for rank, node in nodes.items()):
        return "nodes differ"
    return "as planned"


def main(argv=None) -> int:
    def flagged(planned) -> dict[str, int]:
        flag = sum(rank_order_of(plan, gpn) == "tp-pp-dp" for plan, _, gpn in planned)
        return {"as_planned_with_the_flag": flag}

    return check_exports.check_cases(
        argv,
        __doc__,
        "check_rank_order_export",
        plans(),
        check,
        lambda plan, order, gpn: {"plan": plan.describe(), "order": order},
        flagged,
    )


if __name__ == "__main__":
    raise SystemExit(main())
