"""Untrusted text input found wanting by a review: devices read as files,
Megatron arguments that overflowed, mistyped flags, hostile profile keys and
elastic configs, and error lines too long to read. Each fails with one line
(a :class:`ProblemError`), exit 2 from the CLI."""

from __future__ import annotations

import json
import os
import threading

import pytest
from helpers import run_cli

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import read_bytes


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_devices_are_refused_before_reading():
    """A device never ends (``/dev/zero``) or waits for input (a terminal's
    ``/dev/stdin``, which a plan's model path could name)."""
    with pytest.raises(ProblemError, match="is a device, not a file"):
        read_bytes("/dev/zero", 100, "plan")


def test_a_fifo_is_still_read(tmp_path):
    """Process substitution (``--cluster-file <(...)``) hands over a FIFO."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    writer = threading.Thread(target=path.write_bytes, args=(b'{"ok": 1}',))
    writer.start()
    assert json.loads(read_bytes(path, 100)) == {"ok": 1}
    writer.join()


# ------------------------------------------------------------ Megatron flags
LAUNCH = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 1 "
    "--global-batch-size 8 --bf16"
)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("--tensor-model-paralel-size 8", "did you mean --tensor-model-parallel-size"),
        ("--use-distributed-optimiser", "did you mean --use-distributed-optimizer"),
        ("--num-layers " + "9" * 5000, "at most 40 digits, got '9999"),
        (
            "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
            "'Et*" + "9" * 5000 + "|tL'",
            "unrolls to more than",
        ),
    ],
)
def test_megatron_flags_that_would_mislead_or_overflow(capsys, extra, says):
    code, out, err = run_cli(
        capsys,
        "predict",
        "--gpus",
        "H100-SXM:8",
        "--megatron-args",
        f"{LAUNCH} {extra}",
    )
    assert code == 2 and out == ""
    assert says in err and len(err) < 400 and err.count("\n") == 1


def test_megatron_flags_read_as_megatron_reads_them():
    from pipedejavu.io.megatron_args import spec_from_megatron_args as parse

    full = " --recompute-granularity full --recompute-method block"
    # more layers to recompute than there are: every one (Megatron-LM takes it)
    huge = parse(LAUNCH + full + " --recompute-num-layers 1000000000000")
    assert huge.recompute_num_layers == 8
    # the groups count only with --group-query-attention, and say so
    run = parse(LAUNCH + " --num-query-groups 2")
    assert run.spec.num_query_groups == 8
    assert any(word.startswith("--num-query-groups 2") for word in run.ignored)
    # Megatron-LM's alias of the sequence length
    alias = parse(LAUNCH.replace("--seq-length", "--encoder-seq-length"))
    assert alias.spec.seq_length == 1024
    # a flag of Megatron-LM's spelled close to one read here is listed, not
    # refused (--fp8-amax-history-len is close to --fp8-format's family)
    flag = "--fp8-amax-history-len 1024"
    assert flag in parse(f"{LAUNCH} {flag}").ignored
    # (--fp4-format is read: the recipe FP4 training runs)
    assert parse(LAUNCH + " --fp4-format e2m1").fp4_recipe == "nvfp4"


# ------------------------------------------------------- files of other kinds
def test_an_elastic_section_that_is_not_an_object(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"elasticity": [1]}))
    code, _, err = run_cli(capsys, "elastic", path)
    assert code == 2 and "'elasticity' must be an object" in err


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda t: t.__setitem__(" 1", t.pop("1")), "layer key that is not one of"),
        (lambda t: t.__setitem__("1_0", t.pop("10")), "layer key that is not one of"),
    ],
)
def test_profile_keys_that_int_reads_but_name_no_entry(tmp_path, edit, says):
    import shutil

    from pipedejavu.costmodel.megatron.sailor_data import (
        SailorData,
        bundled_sailor_dir,
    )

    root = tmp_path / "data"
    shutil.copytree(bundled_sailor_dir(), root)
    profile = root / "profiles" / "OPT-350" / "GH-96" / "profile.json"
    data = json.loads(profile.read_text())
    edit(data["8"]["4"])
    profile.write_text(json.dumps(data))
    with pytest.raises(ProblemError, match=says):
        SailorData(root).profile("OPT-350", "GH-96")
    data["8"]["4"] = json.loads(
        (bundled_sailor_dir() / "profiles/OPT-350/GH-96/profile.json").read_text()
    )["8"]["4"]
    data[str(10**30)] = data.pop("8")  # an mbs no plan can have
    profile.write_text(json.dumps(data))
    with pytest.raises(ProblemError, match="mbs and tp keys must be integers up to"):
        SailorData(root).profile("OPT-350", "GH-96")


def test_profiles_folder_without_the_model_is_refused(capsys, tmp_path):
    """``--profiles DIR`` without the model: it was priced analytically (and
    in bf16, not the profiles' fp32) with only the JSON saying so."""
    (tmp_path / "profiles").mkdir()
    code, _, err = run_cli(
        capsys, "plan", "--model", "OPT-350", "--gpus", "GH-96:8",
        "--global-batch", 8, "--profiles", tmp_path,
    )  # fmt: skip
    assert code == 2 and "holds no profiles of OPT-350" in err


def test_a_cluster_of_thousands_of_types_is_refused(capsys, tmp_path):
    path = tmp_path / "cluster.json"
    types = {f"t{k}": {} for k in range(3000)}
    path.write_text(
        json.dumps({"devices_per_host": 8, "device_types": types, "hosts": ["t0"]})
    )
    code, _, err = run_cli(
        capsys, "inspect", "generated-gpt-32layers-2x8", "--cluster-file", path
    )
    assert code == 2 and "device_types must name 1 to 64 types" in err


def test_plans_of_too_many_layers_are_refused_before_any_table(capsys, tmp_path):
    """A model of 1,000 blocks took 2.3 GB and 27 s to plan on 8 GPUs; 2,000
    ran out of memory. Predicting it stays possible."""
    import importlib.resources

    preset = importlib.resources.files("pipedejavu") / "data/models/llama-3-8b.json"
    fields = json.loads(preset.read_text())
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({**fields, "num_layers": 2000}))
    code, _, err = run_cli(
        capsys, "plan", "--model", path, "--gpus", "H100-SXM:8", "--global-batch", 8
    )
    assert code == 2 and "plans are searched for models of at most 512" in err


def test_error_lines_stay_readable(capsys):
    from pipedejavu.cli.main import MAX_ERROR_CHARS, _one_line

    line = _one_line(ProblemError("x" * 10**6))
    assert len(line) < MAX_ERROR_CHARS + 50 and line.endswith("more characters)")
    assert _one_line(ProblemError("a\nb")) == "a b"


def test_a_plan_that_does_not_price_names_its_file(capsys, tmp_path):
    """What is wrong with a plan's GPUs or layers, found while pricing it, names
    the file as the reader's own errors do."""
    code, out, err = run_cli(
        capsys, "plan", "--model", "Llama-3-8B", "--gpus", "H100:8",
        "--global-batch", 8, "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    for stage in data["stages"]:
        for replica in stage["replicas"]:
            replica["gpu"] = "Z999"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, "predict", path)
    assert code == 2
    assert err.startswith(f"pipedejavu: error: {path}: GPU type 'Z999'")


def test_evaluate_refuses_a_plan_of_other_micro_batches_or_nan_numbers(
    capsys, tmp_path
):
    """``evaluate``: a plan whose recorded numbers are NaN or infinite, or that
    runs another number of micro-batches than the problem, is one line (a B
    of 10**30 was called valid)."""
    code, out, err = run_cli(capsys, "solve", "generated-gpt-32layers-2x8", "--json")
    assert code == 0, err
    plan = json.loads(out)
    cases = [
        ({**plan, "cost": float("nan")}, "cost must be a finite number"),
        ({**plan, "num_microbatches": 10**30}, "the plan runs B = 1e+30"),
        ({**plan, "num_microbatches": 31}, "generated-gpt-32layers-2x8 B = 32"),
    ]
    for index, (data, says) in enumerate(cases):
        path = tmp_path / f"plan{index}.json"
        path.write_text(json.dumps(data))  # (Python writes NaN as NaN)
        code, _, err = run_cli(capsys, "evaluate", "generated-gpt-32layers-2x8", path)
        assert code == 2 and says in err, err
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, out, err = run_cli(capsys, "evaluate", "generated-gpt-32layers-2x8", path)
    assert code == 0 and "a valid plan" in out, err


def test_gpu_names_in_any_case_and_the_aliases_in_the_message():
    from pipedejavu.io.gpu_sheet import load_gpu_sheet
    from pipedejavu.planning.any_model import sheet_name

    sheet = load_gpu_sheet()
    assert sheet_name(sheet, "h100") == sheet_name(sheet, "H100") == "H100-SXM"
    assert sheet_name(sheet, "a100-80") == "A100-80" and "gh-96" in sheet
    with pytest.raises(ProblemError, match="aliases: A100, .*H100"):
        sheet_name(sheet, "Z999")
