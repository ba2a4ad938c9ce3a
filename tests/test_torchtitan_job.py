"""torchtitan job files: the flavors' shapes, both schemas, the degrees, the
refusals, and the seven published Llama 3.1 8B runs read back.

Shapes are checked against numbers derived by hand from torchtitan's code
(cited at each table) and against the bundled presets, which come from the
models' own Hugging Face configs: two independent sources.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedejavu.core import files
from pipedejavu.core.errors import ProblemError
from pipedejavu.io.model_config import load_model_spec
from pipedejavu.io.torchtitan_job import (
    MAX_JOB_FILE_BYTES,
    TorchtitanDegrees,
    parse_torchtitan_job,
    read_torchtitan_job,
)
from pipedejavu.io.torchtitan_keys import SCHEMA_KEYS
from pipedejavu.io.torchtitan_models import (
    MODEL_FLAVORS,
    llama_ffn_width,
    torchtitan_model,
)

FIXTURES = Path(__file__).parent / "fixtures" / "torchtitan"
PUBLISHED_JSON = (
    Path(__file__).resolve().parents[2]
    / "shared/data/published/torchtitan_llama3_8b_h100.json"
)


def parse(text: str, **kwargs):
    return parse_torchtitan_job(text, "job.toml", **kwargs)


def refused(text: str, match: str, **kwargs) -> str:
    with pytest.raises(ProblemError, match=match) as caught:
        parse(text, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("job.toml: ")
    return message


# ------------------------------------------------------------------ shapes
# torchtitan models/llama3/model/model.py FeedForward (v0.2.2; the same rule in
# models/llama/model.py at 9dec370): int(2 * 4 dim / 3), times the multiplier
# (truncated), rounded up to multiple_of.
@pytest.mark.parametrize(
    "dim, multiple_of, multiplier, width",
    [
        (4096, 1024, 1.3, 14336),  # 10922 -> 14198 -> 14 x 1024
        (8192, 4096, 1.3, 28672),  # 21845 -> 28398 -> 7 x 4096
        (16384, 4096, 1.2, 53248),  # 43690 -> 52428 -> 13 x 4096
        (256, 256, None, 768),  # debugmodel: 682 -> 3 x 256
    ],
)
def test_llama_ffn_width(dim, multiple_of, multiplier, width):
    assert llama_ffn_width(dim, multiple_of, multiplier) == width


# Each flavor against the bundled preset of the same model (its Hugging Face
# config), with the fields torchtitan's flavor is known to differ in.
@pytest.mark.parametrize(
    "schema, name, flavor, preset, differs",
    [
        ("v0.2", "llama3", "8B", "llama-3-8b", {}),
        ("v0.2", "llama3_ft", "8B_flex", "llama-3-8b", {}),
        ("v0.2", "llama3", "70B", "llama-3-70b", {}),
        ("v0.2", "llama3", "405B", "llama-3.1-405b", {}),
        ("2024-12", "llama3", "8B", "llama-3-8b", {}),
        ("2024-12", "llama3", "70B", "llama-3-70b", {}),
        ("v0.2", "qwen3", "30B-A3B", "qwen3-30b-a3b", {}),
        ("v0.2", "qwen3", "235B-A22B", "qwen3-235b-a22b", {}),
        # torchtitan's DeepSeek-V3 has no multi-token-prediction module
        ("v0.2", "deepseek_v3", "671B", "deepseek-v3", {"mtp_layers": 0}),
    ],
)
def test_flavors_match_the_models_configs(schema, name, flavor, preset, differs):
    model = torchtitan_model(name, flavor, schema=schema, seq_len=4096, source="x")
    expected = dataclasses.replace(
        load_model_spec(preset), name=model.spec.name, seq_length=4096, **differs
    )
    assert model.spec == expected


def test_llama4_flavors():
    # models/llama4/__init__.py and model/model.py (v0.2.2): dense width
    # llama3's rule on dim 5120, x1.2, multiple of 2048: 13653 -> 16383 ->
    # 16384; an expert's int(16383 / (top_k 1 + 1 shared)) = 8191 -> 8192.
    scout = torchtitan_model(
        "llama4", "17bx16e", schema="v0.2", seq_len=8192, source="x"
    )
    spec = scout.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads) == (
        48,
        5120,
        40,
    )
    assert (spec.num_query_groups, spec.ffn_hidden_size, spec.vocab_size) == (
        8,
        16384,
        202_048,
    )
    assert spec.moe.num_experts == 16 and spec.moe.topk == 1
    assert spec.moe.ffn_hidden_size == spec.moe.shared_ffn_hidden_size == 8192
    assert spec.moe.layers is None  # interleave_moe_layer_step 1
    maverick = torchtitan_model(
        "llama4", "17bx128e_irope", schema="v0.2", seq_len=8192, source="x"
    )
    # step 2: block i routes when (i + 1) % 2 == 0
    assert maverick.spec.moe.layers == tuple(i % 2 == 1 for i in range(48))
    assert maverick.spec.moe.num_experts == 128
    assert maverick.attention == "flex" and len(maverick.notes) == 2


def test_deepseek_16b_projects_queries_directly():
    # models/deepseek_v3/__init__.py "16B": q_lora_rank 0, 1 dense block of
    # 10944, 64 experts of 1408, top 6, 2 shared (one MLP of 2 x 1408).
    spec = torchtitan_model(
        "deepseek_v3", "16B", schema="v0.2", seq_len=4096, source="x"
    ).spec
    assert spec.mla.q_lora_rank == 0 and spec.mla.kv_lora_rank == 512
    assert spec.moe.layers == (False,) + (True,) * 26
    assert (spec.moe.num_experts, spec.moe.topk) == (64, 6)
    assert spec.moe.shared_ffn_hidden_size == 2816 and spec.ffn_hidden_size == 10944
    assert spec.vocab_size == 102_400


def test_qwen3_small_flavors_tie_their_embeddings():
    spec = torchtitan_model(
        "qwen3", "0.6B", schema="v0.2", seq_len=4096, source="x"
    ).spec
    # 16 heads of 128 on a width of 1024: kv_channels
    assert spec.tied_embeddings and spec.kv_channels == 128 and spec.qk_layernorm
    assert spec.ffn_hidden_size == 3072 and spec.vocab_size == 151_936


def test_every_listed_flavor_builds():
    for schema, models in MODEL_FLAVORS.items():
        for name, flavors in models.items():
            for flavor in flavors:
                model = torchtitan_model(
                    name, flavor, schema=schema, seq_len=2048, source="x"
                )
                assert model.spec.seq_length == 2048


def test_vocabulary_from_the_tokenizer_in_2024_12_only():
    old = "[model]\nflavor = '8B'\nname = 'llama3'\n[training]\nbatch_size = 1\n"
    assert parse(old).spec.vocab_size == 128_256  # Llama 3's tokenizer
    assert parse(old, vocab_size=2256).spec.vocab_size == 2256
    new = "[model]\nflavor = '8B'\n[training]\nlocal_batch_size = 1\n"
    assert parse(new).spec.vocab_size == 128_256  # the flavor's own
    refused(new, "vocabulary of 128256 in torchtitan's model arguments", vocab_size=9)


# ----------------------------------------------------------- published runs
# The seven runs of torchtitan_llama3_8b_h100.json: (fixture, dp_shard, cp,
# local batch, global batch, seq_len, AC, compile, float8).
PUBLISHED = {
    "torchtitan_202412_table1_llama31_8b_8gpu_fsdp": (
        "published_fsdp", 8, 1, 2, 16, 8192, "selective", False, False),
    "torchtitan_202412_table1_llama31_8b_8gpu_fsdp_compile": (
        "published_fsdp_compile", 8, 1, 2, 16, 8192, "selective", True, False),
    "torchtitan_202412_table1_llama31_8b_8gpu_fsdp_compile_float8": (
        "published_fsdp_compile_float8", 8, 1, 2, 16, 8192, "selective", True, True),
    "torchtitan_202412_table2_llama31_8b_8gpu_fsdp8_cp1_seq32k": (
        "published_fsdp8_cp1", 8, 1, 1, 8, 32768, "full", True, True),
    "torchtitan_202412_table2_llama31_8b_8gpu_fsdp4_cp2_seq64k": (
        "published_fsdp4_cp2", 4, 2, 1, 4, 65536, "full", True, True),
    "torchtitan_202412_table2_llama31_8b_8gpu_fsdp2_cp4_seq128k": (
        "published_fsdp2_cp4", 2, 4, 1, 2, 131072, "full", True, True),
    "torchtitan_202412_table2_llama31_8b_8gpu_fsdp1_cp8_seq256k": (
        "published_fsdp1_cp8", 1, 8, 1, 1, 262144, "full", True, True),
}  # fmt: skip


@pytest.mark.parametrize("run", PUBLISHED)
def test_published_runs_read_back(run):
    fixture, shard, cp, local, total, seq, ac, compiled, float8 = PUBLISHED[run]
    job = read_torchtitan_job(FIXTURES / f"{fixture}.toml")
    assert (job.schema, job.model_name, job.flavor) == ("2024-12", "llama3", "8B")
    assert job.degrees(8) == TorchtitanDegrees(1, shard, cp, 1, 1)
    assert (job.local_batch_size, job.global_batch(8), job.seq_len) == (
        local,
        total,
        seq,
    )
    assert job.spec.seq_length == seq and job.gradient_accumulation_steps(8) == 1
    assert job.activation_checkpoint == ac and job.compile is compiled
    assert job.selective_ac_option == ("op" if ac == "selective" else None)
    assert job.float8 is float8
    assert job.float8_recipe == ("tensorwise" if float8 else None)
    assert (job.mixed_precision_param, job.mixed_precision_reduce) == (
        "bfloat16",
        "float32",
    )
    assert job.spec.num_params == 8_030_261_248  # Llama 3.1 8B, vocab 128,256


@pytest.mark.skipif(not PUBLISHED_JSON.exists(), reason="the shared data set")
def test_published_table_matches_the_json():
    runs = {run["id"]: run for run in json.loads(PUBLISHED_JSON.read_text())["runs"]}
    assert set(runs) == set(PUBLISHED)
    for run_id, (_, shard, cp, local, total, seq, ac, compiled, _) in PUBLISHED.items():
        run = runs[run_id]
        par, batch = run["parallelism"], run["batch"]
        assert (par["dp"], par["cp"], par["tp"], par["pp"]) == (shard, cp, 1, 1)
        assert (batch["micro_batch_size"], batch["global_batch_size"]) == (local, total)
        assert run["model"]["seq_length"] == seq and par["torch_compile"] is compiled
        assert par["recompute"].startswith(ac)


# ---------------------------------------------------------------- v0.2 jobs
def test_v02_three_dimensional_job():
    job = read_torchtitan_job(FIXTURES / "v02_llama3_70b_3d.toml")
    assert job.schema == "v0.2" and job.spec.num_layers == 80
    # 128 GPUs: dp_shard = 128 // (TP 8 x PP 4) = 4
    assert job.degrees(128) == TorchtitanDegrees(1, 4, 1, 8, 4)
    assert job.global_batch(128) == 128
    assert job.gradient_accumulation_steps(128) == 2  # 128 / (16 x 4)
    assert job.pipeline_schedule == "Interleaved1F1B"  # any case, as PyTorch
    assert (job.num_microbatches, job.microbatch_size, job.stages_per_rank) == (8, 2, 2)
    assert job.float8 and job.float8_recipe == "rowwise" and job.compile
    assert job.async_tp and job.activation_checkpoint == "full"
    assert "[optimizer] lr = 0.00015" in job.ignored
    assert job.degrees(64).dp_shard == 2
    with pytest.raises(ProblemError, match=r"-1 \(the rest: 3\) .* is 96, not the 100"):
        job.degrees(100)


def test_v02_expert_jobs():
    deepseek = read_torchtitan_job(FIXTURES / "v02_deepseek_v3_16b.toml")
    degrees = deepseek.degrees(16)
    assert (degrees.dp_shard, degrees.ep, degrees.efsdp) == (8, 8, 2)
    assert deepseek.fsdp_reshard_after_forward == "always"
    assert deepseek.selective_ac_option == 2
    assert any("flex attention" in line for line in deepseek.ignored)
    qwen = read_torchtitan_job(FIXTURES / "v02_qwen3_30b_a3b.toml")
    degrees = qwen.degrees(32)  # 32 // (2 x CP 2 x TP 4) = 2
    assert degrees == TorchtitanDegrees(2, 2, 2, 4, 1, 4, 4) and degrees.dp == 4
    assert qwen.gradient_accumulation_steps(32) == 8  # 64 / (2 x 4)
    assert (qwen.compile, qwen.compile_loss, qwen.dtype) == (False, True, "bfloat16")
    assert qwen.cp_rotate_method == "alltoall"


@pytest.mark.parametrize(
    "degrees, world, resolved",
    [
        ("", 8, (1, 8, 1, 1, 1)),
        ("tensor_parallel_degree = 2\n", 8, (1, 4, 1, 2, 1)),
        ("data_parallel_replicate_degree = 2\ntensor_parallel_degree = 2\n", 16,
         (2, 4, 1, 2, 1)),
        ("context_parallel_degree = 4\npipeline_parallel_degree = 2\n", 64,
         (1, 8, 4, 1, 2)),
        ("data_parallel_shard_degree = 2\ntensor_parallel_degree = 4\n", 8,
         (1, 2, 1, 4, 1)),
    ],
)  # fmt: skip
def test_the_shard_degree_takes_the_rest(degrees, world, resolved):
    job = parse(f"[model]\nflavor = '8B'\n[parallelism]\n{degrees}")
    assert job.degrees(world) == TorchtitanDegrees(*resolved)
    assert job.degrees(world).world_size == world


@pytest.mark.parametrize(
    "degrees, world, match",
    [
        ("tensor_parallel_degree = 4\n", 6, r"-1 \(the rest: 1\) .* is 4, not the 6"),
        ("tensor_parallel_degree = 8\n", 4, r"the rest: 0"),
        ("data_parallel_shard_degree = 2\n", 8, r"shard_degree 2 .* is 2, not the 8"),
        ("data_parallel_replicate_degree = 2\ntensor_parallel_degree = 2\n"
         "data_parallel_shard_degree = 1\n", 4, "is DDP"),
        ("expert_parallel_degree = 2\ndata_parallel_shard_degree = 1\n", 1,
         "does not divide data_parallel_shard_degree 1"),
    ],
)  # fmt: skip
def test_degrees_that_are_not_the_world_are_refused(degrees, world, match):
    job = parse(f"[model]\nflavor = '8B'\n[parallelism]\n{degrees}")
    with pytest.raises(ProblemError, match=match) as caught:
        job.degrees(world)
    assert "\n" not in str(caught.value)


def test_a_global_batch_not_whole_steps_is_refused():
    job = parse("[training]\nlocal_batch_size = 3\nglobal_batch_size = 48\n")
    assert job.global_batch(8) == 48 and job.gradient_accumulation_steps(8) == 2
    with pytest.raises(
        ProblemError, match="48 is not a multiple of local_batch_size 3"
    ):
        job.global_batch(32)
    assert parse("[training]\nglobal_batch_size = -5\n").global_batch_size is None


def test_2024_12_ignores_unknown_keys_as_torchtitan_did():
    job = parse(
        "[model]\nname = 'llama3'\n[training]\nbatch_size = 1\n"
        "tensor_paralel_degree = 2\n"
    )
    assert job.tp == 1
    assert job.ignored == (
        "[training] tensor_paralel_degree = 2 (not a key of torchtitan 9dec370, "
        "whose parser ignores it)",
    )


def test_the_export_reads_back():
    # pipedejavu's own torchtitan export, read as torchtitan would read it.
    from pipedejavu.core.training_options import TrainingOptions
    from pipedejavu.costmodel.megatron.tables import plan_from_stages
    from pipedejavu.io.export_torchtitan import to_torchtitan

    plan = plan_from_stages(
        [(0, 1, 2), (1, 13, 2), (13, 26, 2)], gpu_type="GH-96", dp=1, mbs=2,
        gbs=12, model="OPT-350", gpus_per_node=4, zone="us-central1-a",
    )  # fmt: skip
    text = to_torchtitan(plan, TrainingOptions(sequence_parallel=True), 2048)
    job = parse(text)
    assert job.schema == "v0.2" and job.model_name == "llama3"
    assert job.degrees(plan.num_gpus) == TorchtitanDegrees(1, 1, 1, 2, 3)
    assert job.global_batch(plan.num_gpus) == plan.gbs
    assert (job.num_microbatches, job.stages_per_rank) == (plan.num_microbatches, 1)
    assert job.activation_checkpoint == "none" and job.dtype == "float32"


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "text, match",
    [
        ("[training\nseq_len = 2", "not a valid TOML file"),
        ("a = " + "[" * 5000 + "]" * 5000, "not a valid TOML file|nested too deeply"),
        ("seq_len = 2048\n", "'seq_len' = 2048 is outside any"),
        ("training = 3\n", r"\[training\] must be a table"),
        ("[parallelism]\ntensor_parallel_degre = 2\n",
         "unknown key 'tensor_parallel_degre' in .parallelism. .* did you mean "
         "'tensor_parallel_degree'"),
        ("[moe]\nexperts = 8\n", r"unknown section \[moe\]"),
        ("[parallelism]\ntensor_parallel_degree = 2\n[training]\nbatch_size = 1\n",
         r"mixes torchtitan's schemas: \[parallelism\] .* \[training\] batch_size"),
        ("[parallelism]\ntensor_parallel_degree = 'x'\n",
         r"\[parallelism\] tensor_parallel_degree must be a positive integer "
         r".* got 'x'"),
        ("[parallelism]\ntensor_parallel_degree = 2.0\n", "got 2.0"),
        ("[parallelism]\npipeline_parallel_degree = true\n", "got True"),
        ("[parallelism]\ncontext_parallel_degree = 0\n", "got 0"),
        ("[parallelism]\ndata_parallel_shard_degree = -2\n", "or -1, got -2"),
        ("[model]\nflavor = '7B'\n", "flavor '7B' is not a flavor of torchtitan v0.2's "
         "llama3 .read: debugmodel"),
        ("[model]\nname = 'gpt_oss'\nflavor = '20b'\n", "'gpt_oss' is not read"),
        ("[model]\nname = 'mixtral'\n", "'mixtral' is not a model read"),
        ("[training]\nbatch_size = 1\n", "default 'llama' is not one of its models"),
        ("[model]\nconverters = ['float8']\n", "v0.1's 'float8' is v0.2's"),
        ("[model]\nconverters = ['quantize.linear.float8']\n"
         "[quantize.linear.float8]\nrecipe_name = 'rowwise'\n"
         "enable_fsdp_float8_all_gather = true\n", "refused by torchtitan's float8"),
        ("[model]\nflavor = '8B'\n[parallelism]\ntensor_parallel_degree = 2\n"
         "enable_async_tensor_parallel = true\n", "async tensor parallelism needs"),
        ("[training]\nseq_len = 1000\n[parallelism]\ncontext_parallel_degree = 8\n",
         "seq_len 1000 is not a multiple of .* 2 x context_parallel_degree 8"),
        ("[training]\nseq_len = 2047\n", "torchtitan asserts it"),
        ("[model]\nflavor = '8B'\n[parallelism]\ntensor_parallel_degree = 16\n",
         "does not divide .* 8 key/value heads"),
        ("[model]\nname = 'qwen3'\nflavor = '30B-A3B'\n[parallelism]\n"
         "expert_parallel_degree = 3\n", "does not divide the 128 experts"),
        ("[model]\nname = 'qwen3'\nflavor = '30B-A3B'\n[parallelism]\n"
         "tensor_parallel_degree = 2\nexpert_parallel_degree = 2\n"
         "expert_tensor_parallel_degree = 4\n",
         "must be 1 or tensor_parallel_degree 2"),
        ("[model]\nname = 'qwen3'\nflavor = '8B'\n[parallelism]\n"
         "pipeline_parallel_degree = 2\n", "has no pipelining function"),
        ("[model]\nname = 'deepseek_v3'\nflavor = '16B'\n[parallelism]\n"
         "context_parallel_degree = 2\n", "not .*'s flex attention"),
        ("[activation_checkpoint]\nselective_ac_option = 'every2'\n",
         "'op' or a number of blocks"),
        ("[activation_checkpoint]\nselective_ac_option = 2\n", "must be a string"),
        ("[activation_checkpoint]\nmode = 'memory_budget'\n",
         "needs the model compiled"),
        ("[activation_checkpoint]\nmode = 'partial'\n", "one of 'selective', 'full'"),
        ("[job]\ncustom_config_module = 'my.config'\n", "not imported here"),
        ("[training]\nlocal_batch_size = 3\n[parallelism]\n"
         "pipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\n",
         "local_batch_size 3 is not a multiple"),
        ("[model]\nname = 'llama3'\n[training]\nbatch_size = 3\n[experimental]\n"
         "pipeline_parallel_degree = 2\n",
         "pipeline_parallel_microbatches 2 does not divide"),
        ("[parallelism]\npipeline_parallel_degree = 2\n"
         "pipeline_parallel_schedule = 'Zigzag'\n", "one of PyTorch's schedules"),
        ("[model]\nflavor = '8B'\n[parallelism]\npipeline_parallel_degree = 4\n"
         "pipeline_parallel_layers_per_stage = 8\n",
         "makes 5 stages of 32 layers .* not 1 per rank on 4 ranks with 1F1B"),
        ("[parallelism]\npipeline_parallel_degree = 2\n"
         "module_fqns_per_model_part = [['tok_embeddings'], ['layers.0'], ['norm']]\n",
         "3 pipeline parts on 2 ranks"),
        ("[parallelism]\npipeline_parallel_degree = 8\n"
         "pipeline_parallel_schedule = 'Interleaved1F1B'\n",
         "16 pipeline stages do not"),
        ("[model]\nnorm_type = 'fused_rmsnorm'\nname = 'llama3'\n[training]\n"
         "compile = true\n", "does not compile"),
    ],
)  # fmt: skip
def test_refusals_are_one_line(text, match):
    refused(text, match)


def test_files_are_read_bounded(tmp_path, monkeypatch):
    big = tmp_path / "big.toml"
    big.write_text("# x\n" * (MAX_JOB_FILE_BYTES // 4 + 1))
    with pytest.raises(ProblemError, match="larger than 1048576 bytes"):
        read_torchtitan_job(big)
    with pytest.raises(ProblemError, match="cannot read torchtitan job file"):
        read_torchtitan_job(tmp_path / "absent.toml")
    monkeypatch.setattr(files, "tomllib", None)  # Python 3.10
    with pytest.raises(ProblemError, match="needs Python 3.11 or later"):
        read_torchtitan_job(FIXTURES / "published_fsdp.toml")


def test_settings_torchtitan_does_not_read_are_listed_not_refused():
    job = parse(
        "[activation_checkpoint]\nmode = 'full'\nselective_ac_option = 3\n"
        "[parallelism]\npipeline_parallel_schedule = 'Zigzag'\n"
        "pipeline_parallel_microbatch_size = 4\n"
        "[compile]\nenable = true\ncomponents = []\n"
        "[debug]\nmoe_force_load_balance = true\n"
    )
    assert job.selective_ac_option is None and not job.compile and not job.compile_loss
    assert job.pipeline_schedule == "Zigzag" and job.num_microbatches == 1
    assert job.ignored == (
        "[activation_checkpoint] selective_ac_option = 3 (no effect with mode 'full')",
        "[parallelism] pipeline_parallel_schedule = 'Zigzag' (no effect with "
        "pipeline_parallel_degree 1)",
        "[parallelism] pipeline_parallel_microbatch_size = 4 (no effect with "
        "pipeline_parallel_degree 1)",
        "[debug] moe_force_load_balance = True (forces balanced routing: every "
        "expert gets as many tokens)",
    )


@pytest.mark.parametrize(
    "pipeline, schedule, stages_per_rank",
    [
        ("", "1F1B", 1),
        ("pipeline_parallel_schedule = 'Interleaved1F1B'\n", "Interleaved1F1B", 2),
        # ceil((32 + 1 + 1) / 9) = 4 stages on 2 ranks
        ("pipeline_parallel_schedule = 'loopedbfs'\n"
         "pipeline_parallel_layers_per_stage = 9\n", "LoopedBFS", 2),
        ("pipeline_parallel_schedule = 'ZBVZeroBubble'\nmodule_fqns_per_model_part"
         " = [['tok_embeddings', 'layers.0'], ['layers.1'], ['layers.2'], "
         "['norm', 'output']]\n", "ZBVZeroBubble", 2),
        ("pipeline_parallel_schedule = 'InterleavedZeroBubble'\n"
         "module_fqns_per_model_part = [['a'], ['b'], ['c'], ['d'], ['e'], ['f']]\n",
         "InterleavedZeroBubble", 3),
    ],
)  # fmt: skip
def test_stages_per_rank(pipeline, schedule, stages_per_rank):
    job = parse(
        "[model]\nflavor = '8B'\n[training]\nlocal_batch_size = 8\n"
        f"[parallelism]\npipeline_parallel_degree = 2\n{pipeline}"
    )
    assert (job.pipeline_schedule, job.stages_per_rank) == (schedule, stages_per_rank)
    assert (job.num_microbatches, job.microbatch_size) == (8, 1)


def test_2024_12_pipeline_and_float8():
    job = parse(
        "[model]\nname = 'llama3'\nflavor = '8B'\n[training]\nbatch_size = 8\n"
        "[experimental]\npipeline_parallel_degree = 2\n"
        "pipeline_parallel_microbatches = 4\n"
        "pipeline_parallel_split_points = 'layers.8,layers.16,layers.24'\n"
        "pipeline_parallel_schedule = 'Interleaved1F1B'\n"
        "[float8]\nenable_float8_linear = true\nscaling_type_weight = 'delayed'\n"
    )
    assert job.pipeline_split_points == ("layers.8", "layers.16", "layers.24")
    assert (job.num_microbatches, job.microbatch_size, job.stages_per_rank) == (4, 2, 2)
    assert job.float8 and job.float8_recipe == "delayed"


def test_v02_float8_defaults_to_tensorwise():
    job = parse(
        "[model]\nconverters = ['quantize.linear.float8', 'quantize.linear.mx']\n"
        "[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n"
    )
    assert job.float8 and job.float8_recipe == "tensorwise"
    assert job.float8_fsdp_all_gather
    assert job.ignored == (
        "[model] converters: quantize.linear.mx (MX linears: not priced)",
    )
    plain = parse("[quantize.linear.float8]\nrecipe_name = 'rowwise'\n")
    assert not plain.float8 and plain.float8_recipe is None
    assert plain.ignored == (
        "[quantize.linear.float8] recipe_name = 'rowwise' (no effect without its "
        "converter)",
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ("[model]\nconverters = 'quantize.linear.float8'\n", "a list of strings"),
        ("[parallelism]\npipeline_parallel_degree = 2\n"
         "pipeline_parallel_schedule = 'Interleaved1F1B'\n"
         "module_fqns_per_model_part = []\n", "0 pipeline parts on 2 ranks"),
        ("[parallelism]\npipeline_parallel_degree = 2\n"
         "pipeline_parallel_schedule = 'ZBVZeroBubble'\n"
         "module_fqns_per_model_part = [['a'], ['b'], ['c'], ['d'], ['e'], ['f']]\n",
         "not 2 per rank"),
        ("[model]\nname = 'deepseek_v3'\nflavor = 'debugmodel'\n[parallelism]\n"
         "pipeline_parallel_degree = 2\nexpert_parallel_degree = 2\n"
         "pipeline_parallel_schedule = 'DualPipeV'\n", "DualPipeV with expert"),
        ("[model]\nname = 'llama3'\n[training]\nbatch_size = 2\n[experimental]\n"
         "pipeline_parallel_degree = 2\npipeline_parallel_schedule = 'DualPipeV'\n",
         "one of PyTorch's schedules"),
    ],
)  # fmt: skip
def test_more_refusals(text, match):
    refused(text, match)


# ------------------------------------------------------------------- fuzzing
def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(value)  # ints, finite floats and plain strings


_VALUES = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([2**24 + 1, 10**30, 8192, 65536]),
    st.booleans(),
    st.floats(-2, 2, allow_nan=False),
    st.sampled_from(["op", "2", "x", "8B", "70B", "llama3", "qwen3", "deepseek_v3",
                     "llama4", "30B-A3B", "16B", "full", "selective", "none",
                     "Interleaved1F1B", "DualPipeV", "quantize.linear.float8",
                     "rowwise", "bfloat16", "float16", "alltoall", ""]),
    st.lists(st.sampled_from(["model", "loss", "quantize.linear.float8", "a"]),
             max_size=3),
)  # fmt: skip
_KEYS = {
    schema: sorted((section, key) for section, keys in table.items() for key in keys)
    + [("training", "unknown_key"), ("moe", "experts")]
    for schema, table in SCHEMA_KEYS.items()
}
_ENTRIES = st.sampled_from(sorted(_KEYS)).flatmap(
    lambda schema: st.dictionaries(st.sampled_from(_KEYS[schema]), _VALUES, max_size=12)
)


@settings(max_examples=300, deadline=None)
@given(
    entries=_ENTRIES,
    world=st.sampled_from([1, 2, 8, 12, 64]),
)
def test_any_job_file_reads_or_is_refused_in_one_line(entries, world):
    sections: dict[str, list[str]] = {}
    for (section, key), value in entries.items():
        sections.setdefault(section, []).append(f"{key} = {_toml_value(value)}")
    text = "".join(
        f"[{section}]\n" + "".join(line + "\n" for line in lines)
        for section, lines in sections.items()
    )
    try:
        job = parse(text)
        degrees = job.degrees(world)
        assert degrees.world_size == world
        assert job.global_batch(world) % (job.local_batch_size * degrees.dp) == 0
    except ProblemError as error:
        assert "\n" not in str(error)
