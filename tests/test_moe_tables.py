"""The planning tables of a mixture of experts keep the predictor's memory
rule: a one-stage plan fits the tables exactly when it fits the predictor,
also where the experts are not all-reduced (expert data parallelism 1: no
bucket of theirs is held, as the predictor counts it)."""

from __future__ import annotations

import itertools

import pytest
from helpers import MOE_STATE_SPEC

from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.analytical.moe_layers import ExpertLayers
from pipedejavu.costmodel.analytical.moe_tokens import ExpertPass
from pipedejavu.costmodel.analytical.source import AnalyticalSource
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS as C
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.tables import compile_tables, plan_from_stages
from pipedejavu.io.gpu_sheet import load_gpu_sheet

SPEC = MOE_STATE_SPEC
GPU = "A100-40"


@pytest.mark.parametrize(
    ("ep", "tp", "dp"), [(4, 2, 2), (4, 4, 1), (2, 2, 2), (2, 1, 4)]
)
def test_one_stage_fits_the_tables_as_it_fits_the_predictor(ep, tp, dp):
    options = TrainingOptions(
        precision="bf16", distributed_optimizer=True, sequence_parallel=True
    )
    experts = ExpertLayers(ExpertPass(ep=ep, etp=1, grouped_gemm=True), False)
    base = AnalyticalSource(SPEC, load_gpu_sheet(), options, experts=experts)
    last = base.model_info(SPEC.name).num_layers - 1
    outcomes = set()
    for mbs, free in itertools.product((1, 2), range(0, 40, 2)):
        data = base.with_memory_headroom(MemoryHeadroom.parse(f"{free}GB"))
        tables = compile_tables(
            data, SPEC.name, C, gpu_type=GPU, mbs=mbs, dp=dp,
            num_microbatches=8, tps=[tp], zone="z",
        )  # fmt: skip
        plan = plan_from_stages(
            [(0, last + 1, tp)], gpu_type=GPU, dp=dp, mbs=mbs, gbs=8 * mbs * dp,
            model=SPEC.name, gpus_per_node=data.gpu_spec(GPU).gpus_per_node,
            zone="z", experts=(ep, 1),
        )  # fmt: skip
        fits = predict_plan(plan, data, constants=C).fits_memory
        assert (tables.max_n_succ_stages[0, last, 0, 0] >= 0) == fits, (mbs, free)
        outcomes.add(fits)
    assert outcomes == {True, False}  # the headrooms cross the boundary
