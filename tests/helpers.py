"""Random tiny instances, the in-process command line and other helpers
shared by the tests."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipedejavu import Problem, get_submesh_choices
from pipedejavu.core.moe import MoeSpec
from pipedejavu.core.plan3d import DEFAULT_ZONE, RANK_ORDERS, Plan3D, Replica, Stage3D
from pipedejavu.core.problem import InfeasibleProblemError, ProblemError
from pipedejavu.core.transformer import DECODER_DESIGN, TransformerSpec
from pipedejavu.costmodel.analytical import source as analytical_source
from pipedejavu.costmodel.analytical.roofline import FITTED_ANALYTICAL
from pipedejavu.costmodel.megatron.constants import FITTED_CONSTANTS
from pipedejavu.costmodel.megatron.predictor import predict_plan
from pipedejavu.costmodel.megatron.tables import (
    plan_from_mixed_stages,
    plan_from_stages,
)
from pipedejavu.search.megatron.bounds import stage_bounds
from pipedejavu.search.megatron.chains import StageBounds
from pipedejavu.search.megatron.mixed import PlacedMix
from pipedejavu.search.megatron.space import Mix, SearchScope, config_groups
from pipedejavu.search.megatron.transfers import BoundCache

UNLIMITED = 2**20
ROOT = Path(__file__).resolve().parents[1]
#: The bundled example price sheet.
PRICES_EXAMPLE = ROOT / "pipedejavu" / "data" / "prices-example.json"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``pipedejavu ARGV...`` in this process (each argument as ``str``):
    its exit status, stdout and stderr, as ``capsys`` captured them."""
    from pipedejavu.cli.main import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_help(capsys, *command) -> str:
    """``pipedejavu COMMAND... --help``'s text, its whitespace runs made one
    space (argparse wraps its lines), after checking that it exits 0."""
    from pipedejavu.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main([*command, "--help"])
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def load_benchmark(name: str, module_name: str | None = None):
    """The script ``benchmarks/NAME.py`` imported as the module
    ``module_name`` (``name`` unless given), listed in ``sys.modules`` (the
    dataclasses of a script look their module up)."""
    spec = importlib.util.spec_from_file_location(
        module_name or name, ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def forbid_call(monkeypatch, owner, name: str, message: str) -> None:
    """``owner.name`` replaced, for this test, by a function whose call fails
    the test with ``message`` (something that must not run)."""

    def called(*args, **kwargs):
        raise AssertionError(message)

    monkeypatch.setattr(owner, name, called)


def run_python(
    *args: str, cwd=None, env=None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python ARGS...`` (this interpreter) run to its end in ``cwd`` with
    ``env``, its output captured as text: an exit other than 0 fails the test
    with the end of its stderr, more than ``timeout`` seconds with an error."""
    child = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return child


def python_last_line(code: str, env: dict[str, str]) -> str:
    """The last line ``python -c CODE`` prints, run in ``env`` (an error or
    more than 300 s fails the test)."""
    return run_python("-c", code, env=env).stdout.strip().splitlines()[-1]


def relaxed_start(rng: np.random.Generator, params_type, num_stages, num_slots):
    """``(params, mask, temps)`` of a relaxed search (``params_type``, the
    stage ends' logits and each stage's slot logits, drawn from ``rng``), the
    search's usual temperatures and the first three stages in use."""
    import jax.numpy as jnp

    from pipedejavu.search.engine.relax import Temperatures

    params = params_type(
        jnp.asarray(rng.normal(size=num_stages)),
        jnp.asarray(rng.normal(size=(num_stages, num_slots))),
    )
    temps = Temperatures(*(jnp.asarray(x) for x in (0.7, 0.8, 0.3, 5.0)))
    mask = jnp.asarray([True, True, True, False][:num_stages])
    return params, mask, temps


def one_knob_choice():
    """The knob space of one choice (plan --model's knobs fixed): 1F1B, no
    recompute, no sequence parallelism, the distributed optimizer."""
    from pipedejavu.planning.knob_space import KnobSpace

    return KnobSpace(
        schedules=("1f1b",),
        recompute=("none",),
        sequence_parallel=(False,),
        distributed_optimizer=(True,),
    )


def fixture_fuzz(max_examples: int):
    """Hypothesis settings for a property test that takes function-scoped
    fixtures (capsys, tmp_path: shared by its examples, which is meant):
    ``max_examples`` examples, no deadline."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


def fake_devices_env(count: int) -> dict[str, str]:
    """This process's environment with JAX on ``count`` fake CPU devices."""
    return dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
        JAX_PLATFORMS="cpu",
    )


def decoder_spec(**fields) -> TransformerSpec:
    """The ``TransformerSpec`` of ``fields``, of the package's
    :data:`~pipedejavu.core.transformer.DECODER_DESIGN` where they do not say
    otherwise."""
    return TransformerSpec(**{**DECODER_DESIGN, **fields})


#: A small mixture of experts, 4 blocks (the first dense) of 128 experts,
#: whose state at EP 1 nearly fills an A100-40: sharding the experts' state
#: over dp or over expert data parallelism decides whether a plan fits.
MOE_STATE_SPEC = decoder_spec(
    name="moe-state",
    num_layers=4,
    hidden_size=1024,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=2048,
    vocab_size=4096,
    seq_length=1024,
    moe=MoeSpec(128, 2, 2048, layers=(False, True, True, True)),
)
#: Qwen3-30B-A3B as its Hugging Face config.json reads: 48 expert blocks of
#: 128 experts, top 8; heads not h / a wide (kv_channels), per-head q/k norms.
QWEN3_30B_A3B = decoder_spec(
    name="Qwen3-30B-A3B",
    num_layers=48,
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=4,
    kv_channels=128,
    ffn_hidden_size=6144,
    vocab_size=151936,
    seq_length=4096,
    moe=MoeSpec(128, 8, 768),
    qk_layernorm=True,
)

#: DeepSeek-V3's model flags as Megatron-LM launches it (the model zoo's and
#: Megatron-Bridge's): bf16, MLA, 256 experts after 3 dense blocks, 8,192
#: sequences of 4,096 tokens a step.
DEEPSEEK_V3_MODEL_ARGS = (
    "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
    "--num-attention-heads 128 --seq-length 4096 --max-position-embeddings 4096 "
    "--vocab-size 129280 --micro-batch-size 1 --global-batch-size 8192 --bf16 "
    "--disable-bias-linear --position-embedding-type rope --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights "
    "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
    "--moe-shared-expert-intermediate-size 2048 --moe-layer-freq ([0]*3+[1]*58) "
    "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
    "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
)
#: The model zoo's H100 recipe's run flags for it: flash attention, the
#: distributed optimizer, grouped GEMMs, the alltoall dispatcher and full
#: recomputation of each block.
DEEPSEEK_V3_RUN_ARGS = (
    "--use-flash-attn --use-distributed-optimizer --moe-grouped-gemm "
    "--moe-token-dispatcher-type alltoall --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1 "
)

#: The 16-bit roofline constants before their recalibration of 2026-11-26.
#: The knob and rank-order tests chose their settings (GPUs, batch, options)
#: so that the search takes each of its paths (a choice settled by a proof,
#: rank orders that differ, recomputing some blocks winning...); which path a
#: setting takes depends on the constants, so those tests price 16-bit
#: training with these (:func:`pin_path_constants`). Their brute-force
#: comparisons hold under any constants.
PATH_TEST_HALF_PRECISION = dataclasses.replace(
    FITTED_ANALYTICAL, tensor_efficiency=0.6912, backward_memory_efficiency=0.8729
)


def pin_path_constants(monkeypatch) -> None:
    """Price 16-bit training with :data:`PATH_TEST_HALF_PRECISION`."""
    monkeypatch.setattr(
        analytical_source, "HALF_PRECISION_ANALYTICAL", PATH_TEST_HALF_PRECISION
    )


#: A tiny GPT config (8 blocks of a 4096-wide model) for the analytical
#: cost source: the knob, schedule and recomputation tests vary it.
TINY_GPT = {
    "name": "tiny-knobs",
    "num_layers": 8,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_query_groups": 32,
    "ffn_hidden_size": 16384,
    "vocab_size": 32000,
    "seq_length": 2048,
    "norm": "layernorm",
    "position": "learned",
    "max_position_embeddings": 2048,
    "tied_embeddings": True,
    "linear_bias": True,
}


def small_plan(**changes) -> Plan3D:
    """A small valid plan: OPT-350 in 2 stages of 2 GH-96 replicas of TP 4
    (dp 2), 64 sequences in micro-batches of 2; ``changes`` replace its
    fields."""
    gh = Replica("GH-96", 4)
    fields = dict(
        stages=(Stage3D(0, 12, (gh, gh)), Stage3D(12, 26, (gh, gh))),
        mbs=2,
        gbs=64,
        model="OPT-350",
    )
    fields.update(changes)
    return Plan3D(**fields)


def tiny_problem(
    rng: np.random.Generator,
    *,
    max_layers: int = 6,
    max_devices: int = 8,
    p_missing: float = 0.2,
    p_memory: float = 0.3,
) -> Problem:
    """L <= max_layers, D <= max_devices, 1-3 submeshes, 1-2 configs, inf entries
    and memory limits; stage costs grow with length and shrink with devices."""
    clusters = [(h, d) for h in (1, 2) for d in (1, 2, 4) if h * d <= max_devices]
    hosts, per_host = clusters[rng.integers(len(clusters))]
    choices = list(get_submesh_choices(hosts, per_host, "all"))
    count = int(rng.integers(1, min(3, len(choices)) + 1))
    picked = sorted(rng.choice(len(choices), size=count, replace=False).tolist())
    if 0 not in picked:  # keep (1, 1) so that the devices can always be covered
        picked = [0] + picked[1:]
    shapes = np.array([choices[i] for i in picked])
    num_layers = int(rng.integers(1, max_layers + 1))
    num_configs = int(rng.integers(1, 3))
    shape = (num_layers, num_layers, len(picked), num_configs)
    spans = np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1
    sizes = shapes[:, 0] * shapes[:, 1]
    cost = (
        rng.uniform(0.5, 2.0, size=shape)
        * np.clip(spans, 1, None)[:, :, None, None]
        / sizes[None, None, :, None] ** rng.uniform(0.5, 1.0)
    )
    cost[rng.random(shape) < p_missing] = np.inf
    memory = np.where(
        rng.random(shape) < p_memory,
        rng.integers(-1, num_layers, size=shape),
        UNLIMITED,
    )
    return Problem(
        compute_cost=cost,
        max_n_succ_stages=memory,
        submesh_shapes=shapes,
        cluster_shape=(hosts, per_host),
        num_microbatches=int(rng.integers(1, 17)),
    )


def solved_alike(reference, solver, problem):
    """``(reference(problem), solver(problem))``, or ``None`` after checking
    that ``solver`` finds no plan either where ``reference`` finds none."""
    try:
        expected = reference(problem)
    except InfeasibleProblemError:
        with pytest.raises(InfeasibleProblemError):
            solver(problem)
        return None
    return expected, solver(problem)


def save_with_layer_bytes(path, problem, param_bytes, stash_bytes) -> None:
    """Writes ``problem`` as ``pipedejavu profile`` does: its .npz fields and
    each layer's parameter and stashed activation bytes."""
    np.savez(
        path,
        compute_cost=problem.compute_cost,
        max_n_succ_stages=problem.max_n_succ_stages,
        submesh_shapes=problem.submesh_shapes,
        cluster_shape=np.asarray(problem.cluster_shape),
        num_microbatches=np.int64(problem.num_microbatches),
        param_bytes=param_bytes,
        stash_bytes=stash_bytes,
    )


def write_one_device_members(archive, num_microbatches: int) -> None:
    """Writes the members of a problem .npz but its compute_cost to the open
    zip ``archive``: one (1, 1) submesh of a 1 x 1 cluster,
    ``num_microbatches`` micro-batches."""
    for key, value in {
        "submesh_shapes": np.array([[1, 1]]),
        "cluster_shape": np.array([1, 1]),
        "num_microbatches": np.array(num_microbatches),
    }.items():
        buffer = io.BytesIO()
        np.save(buffer, value)
        archive.writestr(f"{key}.npy", buffer.getvalue())


def two_layer_problem(costs: dict, num_microbatches: int) -> Problem:
    """L = 2 on a 1x2 cluster with submeshes (1,1) and (1,2), one config.

    ``costs`` maps ``(start, end_inclusive, submesh)`` to seconds; the rest is inf.
    """
    table = np.full((2, 2, 2, 1), np.inf)
    for (start, end, submesh), value in costs.items():
        table[start, end, submesh, 0] = value
    return Problem(table, None, np.array([[1, 1], [1, 2]]), (1, 2), num_microbatches)


def proof_groups(
    data, model, pool, gbs, *, uniform=True, mbs_values=None, max_stages=None
):
    """The proof's configuration groups of a search space (``pool``: a dict
    or ``(type, count)`` pairs), pipelines on fewer GPUs than the pool's
    included; every micro-batch size unless ``mbs_values`` says which."""
    scope = SearchScope(uniform, True, mbs_values, max_stages)
    return config_groups(data, model, dict(pool), gbs, scope)


def mixed_in_pool(kinds, tp, dp, pool) -> bool:
    """True where stages on ``kinds`` (each ``tp`` GPUs, ``dp`` times) use two
    types or more, each within its count in ``pool``."""
    return len(set(kinds)) >= 2 and all(
        kinds.count(gpu) * tp * dp <= pool[gpu] for gpu in pool
    )


def every_mixed_plan(data, constants, model, pool, gbs, mbs_values, dps, counts):
    """``(types, plan, prediction)`` of every plan of one TP degree with a
    number of stages in ``counts`` on two types or more of ``pool``, in
    Megatron's rank order per type (:func:`mixed_plan`: ``prediction`` is
    ``None`` where no link fit prices it), over ``mbs_values``, the model's TP
    degrees and the data-parallel degrees ``dps``."""
    info = data.model_info(model)
    layers = info.num_layers
    gpn = {gpu: data.gpu_spec(gpu).gpus_per_node for gpu in pool}
    for mbs, tp, dp in itertools.product(mbs_values, info.tp_values, dps):
        if (gbs // mbs) % dp or any(
            (mbs, tp) not in data.profile(model, gpu) or gpn[gpu] % tp for gpu in pool
        ):
            continue
        for count in counts:
            for types in itertools.product(pool, repeat=count):
                if not mixed_in_pool(types, tp, dp, pool):
                    continue
                for cuts in itertools.combinations(range(1, layers), count - 1):
                    edges = (0, *cuts, layers)
                    plan, prediction = mixed_plan(
                        data, constants, edges, types, tp, dp, mbs, gbs, pool, model
                    )
                    yield types, plan, prediction


class PlacedMixChecks:
    """Checks of mixed plans of one pool against their predictions
    (:func:`mixed_plan`): the ``PlacedMix`` of each ``(mbs, tp, dp)``, built on
    first use over one ``BoundCache``, gives the bounds
    (:func:`placed_mix_bounds`)."""

    def __init__(self, data, model, constants, pool, gbs):
        self.data, self.model, self.constants = data, model, constants
        self.pool, self.gbs = pool, gbs
        self.types = list(pool)
        self.layers = data.model_info(model).num_layers
        self.cache = BoundCache()
        self.placed: dict = {}

    def ratio(self, mbs, tp, dp, edges, kinds) -> float | None:
        """Bound over predicted time of the plan of ``kinds`` cut at
        ``edges``, after checking that its largest stage bound does not exceed
        that time nor its bottleneck DP value that bound; ``None`` where the
        plan does not fit or no link fit prices it."""
        _, prediction = mixed_plan(
            self.data, self.constants, edges, kinds, tp, dp, mbs, self.gbs,
            self.pool, self.model,
        )  # fmt: skip
        if prediction is None or not prediction.fits_memory:
            return None
        time_s = prediction.iteration_time_s
        key = (mbs, tp, dp)
        if key not in self.placed:
            caps = tuple((gpu, self.pool[gpu] // (dp * tp)) for gpu in self.types)
            mix = Mix(mbs, dp, self.gbs // (mbs * dp), tp, caps, self.layers)
            self.placed[key] = PlacedMix(
                self.data, self.model, self.constants, mix, self.cache
            )
        largest, value = placed_mix_bounds(self.placed[key], edges, kinds, self.types)
        assert largest <= time_s * (1 + 1e-12)
        assert value <= largest * (1 + 1e-12)
        return largest / time_s


def placed_mix_bounds(placed, edges, kinds, types) -> tuple[float, float]:
    """A mixed plan's largest stage bound at Megatron's rank placement and the
    bottleneck DP value of its stage counts (``PlacedMix``), for the checks
    that both stay below the prediction.

    Args:
        placed: the ``PlacedMix`` of the plan's (mbs, tp, dp).
        edges: stage boundaries ``(0, ..., L)``.
        kinds: each stage's GPU type.
        types: the pool's types, in the order of the stage-count vector.
    """
    count = len(kinds)
    seen = dict.fromkeys(types, 0)
    order = []
    for gpu in kinds:
        order.append((gpu, seen[gpu]))
        seen[gpu] += 1
    largest = -math.inf
    for s, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        before = order[s - 1] if s > 0 else None
        after = order[s + 1] if s + 1 < count else None
        weights = placed.weights(order[s], before, after, count - s)
        largest = max(largest, float(weights[a, b]))
    value, _ = placed.value(tuple(seen[gpu] for gpu in types))
    return largest, value


def mixed_plan(data, constants, edges, types, tp, dp, mbs, gbs, pool, model):
    """A plan with a stage per pair of ``edges`` on ``types``, in Megatron's
    rank order, and its prediction (``None`` where no link fit prices it)."""
    plan = plan_from_mixed_stages(
        [
            (a, b, tp, gpu)
            for a, b, gpu in zip(edges[:-1], edges[1:], types, strict=True)
        ],
        dp=dp,
        mbs=mbs,
        gbs=gbs,
        model=model,
        pool=pool,
        gpus_per_node={gpu: data.gpu_spec(gpu).gpus_per_node for gpu in pool},
        zone=DEFAULT_ZONE,
    )
    try:
        return plan, predict_plan(plan, data, constants=constants)
    except ProblemError:  # no link fit between two of the types
        return plan, None


def stage_bound_tables(
    data,
    model,
    pool,
    gbs,
    *,
    uniform,
    max_stages=None,
    rank_order=RANK_ORDERS[0],
    constants=FITTED_CONSTANTS,
):
    """``(groups, tables)``: the proof's configuration groups of a search
    space and each one's ``StageBounds`` by ``(gpu, mbs, dp, tp)`` (a uniform
    group holds one degree)."""
    groups = proof_groups(
        data, model, pool, gbs, uniform=uniform, max_stages=max_stages
    )
    tables = {}
    for group in groups:
        bounds = stage_bounds(data, model, constants, group, rank_order=rank_order)
        table = StageBounds(group, bounds, constants.op_overhead_s)
        for tp in group.tps:
            tables[(group.gpu, group.mbs, group.dp, tp)] = table
    return groups, tables


def largest_stage_bound(table, plan, first_tail: bool = True) -> float:
    """The largest of the proof's stage bounds over a plan's stages, each at
    its position (``table``: the ``StageBounds`` of the plan's configuration,
    or the ``tables`` of :func:`stage_bound_tables`; ``inf`` where a stage
    fails the memory test its position asks for; ``first_tail``: with the
    earlier stages' all-reduces after a later stage's gradient chain, as the
    proof's enumeration bounds it)."""
    if isinstance(table, dict):
        first = plan.stages[0].replicas[0]
        table = table[(first.gpu_type, plan.mbs, plan.dp, first.tp)]
    left = sum(stage.replicas[0].tp for stage in plan.stages)
    largest, tails, reruns = -math.inf, [], []
    for stage in plan.stages:
        tp = stage.replicas[0].tp
        if first_tail:
            row = table.row(tp, left, stage.start, tails, reruns)
        else:
            row = table.row(tp, left, stage.start)
        largest = max(largest, float(row[stage.stop]))
        tails.append(table.tail_after(tp, stage.start, stage.stop))
        reruns.append(float(table.rerun_after(tp, stage.start)[stage.stop]))
        left -= tp
    return largest


def fitting_plan_bounds(bounds, plans):
    """``(plan, largest, time_s)`` of each of ``plans`` (``(plan,
    prediction)`` pairs) that fits: its largest stage bound
    (:func:`largest_stage_bound` of ``bounds``) and predicted time, after
    checking that the bound does not exceed the time."""
    for plan, prediction in plans:
        if not prediction.fits_memory:
            continue
        largest = largest_stage_bound(bounds, plan)
        assert largest <= prediction.iteration_time_s * (1 + 1e-12)
        yield plan, largest, prediction.iteration_time_s


def h100_plan(model, stages, dp, mbs, steps, order=RANK_ORDERS[0]) -> Plan3D:
    """A plan of ``(start, stop, tp)`` stages on 8-GPU H100-SXM nodes with
    ``steps`` micro-batches of ``mbs`` per replica, placed in ``order``."""
    return plan_from_stages(
        stages,
        gpu_type="H100-SXM",
        dp=dp,
        mbs=mbs,
        gbs=steps * dp * mbs,
        model=model,
        gpus_per_node=8,
        zone=DEFAULT_ZONE,
        rank_order=order,
    )


def fitting_h100_plan(choice, stages, dp, mbs, steps, order=RANK_ORDERS[0]):
    """``(plan, prediction)`` of :func:`h100_plan` under ``choice``'s costs,
    or ``None`` where the plan cannot be built (mixed degrees that do not pack
    into nodes) or does not fit in memory."""
    try:
        plan = h100_plan(choice.model, stages, dp, mbs, steps, order)
        prediction = predict_plan(plan, choice.data, constants=FITTED_CONSTANTS)
    except ProblemError:
        return None
    return (plan, prediction) if prediction.fits_memory else None
