"""Megatron-LM's flags: the bundled list, its reader, and the script that
derives it from Megatron-LM's source (run here on a small made-up source)."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, load_benchmark

from pipedejavu.core.errors import ProblemError
from pipedejavu.io import megatron_command
from pipedejavu.io.megatron_flags import (
    VALUE_KINDS,
    bundled_megatron_flags_path,
    load_megatron_flags,
    megatron_flags,
)

DATA = ROOT / "pipedejavu" / "data" / "megatron"
#: Flags of the SC'21 scripts and of older Megatron-LM that ``megatron_args``
#: still reads and that Megatron-LM 0.16.1 and 0.19.0 no longer have.
RETIRED = {
    "--activations-checkpoint-method",
    "--activations-checkpoint-num-layers",
    "--fp8-e4m3",
    "--fp8-hybrid",
    "--name",
}
WELL_KNOWN = (
    "--lr", "--train-iters", "--data-path", "--tokenizer-model", "--num-experts",
    "--moe-router-topk", "--expert-model-parallel-size",
    "--context-parallel-size", "--num-layers", "--hidden-size",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--micro-batch-size", "--global-batch-size", "--seq-length", "--bf16",
    "--use-distributed-optimizer", "--checkpoint-activations",
)  # fmt: skip


#: Today's versions in the list (the SC'21 one, v2.5, lacks the newer flags).
CORE = ("core_v0.16.1", "core_v0.19.0")


def test_sc21_flags_that_megatron_dropped_are_known():
    flags = megatron_flags()
    assert flags["--DDP-impl"].versions == ("v2.5",)
    assert flags["--DDP-impl"].allows("local") and not flags["--DDP-impl"].allows("x")
    assert "--use-distributed-optimizer" not in _versions("v2.5")


def _versions(ref: str) -> set[str]:
    return {name for name, info in megatron_flags().items() if ref in info.versions}


def _read_flags(module) -> set[str]:
    """The ``--flags`` that ``pipedejavu.io.megatron_command`` reads."""
    return {f"--{name}" for name in module.READ_FLAGS}


def test_bundled_list_parses_and_names_its_versions():
    flags = megatron_flags()
    assert flags is megatron_flags()  # read once
    # SC'21's Megatron-LM (its launches are read too), 0.16.1 and the newest
    assert flags.refs == ("v2.5", "core_v0.16.1", "core_v0.19.0")
    assert all(re.fullmatch("[0-9a-f]{40}", flags.commits[ref]) for ref in flags.refs)
    assert flags.allow_abbrev is False
    for name, info in flags.items():
        assert name.startswith("-") and info.value in VALUE_KINDS, name
        assert set(info.versions) <= set(flags.refs)
        assert set(info.value_by_version) == set(info.versions)


def test_readme_counts_and_commits_are_the_files():
    flags = megatron_flags()
    readme = (DATA / "README.md").read_text()
    for ref in flags.refs:
        row = re.search(
            rf"^\| `{ref}`.*\| `([0-9a-f]{{40}})` \| (\d+) \|$", readme, re.M
        )
        assert row is not None, ref
        assert row[1] == flags.commits[ref]
        assert int(row[2]) == sum(ref in info.versions for info in flags.values())
    assert f"together have {len(flags)} flags" in readme


def test_the_flags_the_project_reads_are_megatrons_but_the_retired_ones():
    flags = megatron_flags()
    read = _read_flags(megatron_command)
    assert len(read) > 40
    assert read - set(flags) <= RETIRED, read - set(flags) - RETIRED
    assert not RETIRED & set(flags)
    for name in read & set(flags):  # in today's versions (some not in 2021's)
        assert set(CORE) <= set(flags[name].versions), name


@pytest.mark.parametrize("name", WELL_KNOWN)
def test_well_known_flags_are_in_every_version(name):
    info = megatron_flags()[name]
    assert set(CORE) <= set(info.versions)
    assert info.condition is None


@pytest.mark.parametrize("name", ["--frobnicate", "--num-lay", "--lr-", "-lr", "lr"])
def test_unknown_flags_and_prefixes_are_not_in_it(name):
    assert name not in megatron_flags()


@pytest.mark.parametrize(
    ("name", "value", "nargs"),
    [
        ("--bf16", "none", None),
        ("--lr", "one", None),
        ("--num-layers", "one", None),
        ("--data-path", "many", "*"),
        ("--rampup-batch-size", "many", 3),
        ("--no-gradient-accumulation-fusion", "none", None),
        ("--disable-bias-linear", "none", None),
        ("--help", "none", None),
    ],
)
def test_value_kinds_of_known_flags(name, value, nargs):
    info = megatron_flags()[name]
    assert (info.value, info.nargs) == (value, nargs)


def test_choices_and_version_differences():
    flags = megatron_flags()
    granularity = flags["--recompute-granularity"]
    assert set(granularity.choices) == {"full", "selective"}
    assert granularity.allows("full") and not granularity.allows("fast")
    timing = flags["--timing-log-level"]  # int choices, matched as int()
    assert timing.allows("2") and not timing.allows("3") and not timing.allows("x")
    assert flags["--lr"].allows("anything") and flags["--lr"].choices is None
    lazy = flags["--lazy-mpu-init"]  # `type=bool` in 0.16.1, store_true since
    assert dict(lazy.value_by_version) == {
        "v2.5": "one",
        "core_v0.16.1": "one",
        "core_v0.19.0": "none",
    }
    assert flags["--kitchen-config-file"].condition == "HAVE_KITCHEN"
    assert flags["--export-quant-cfg"].condition == "has_nvidia_modelopt"


def test_the_package_data_ships_the_list():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["pipedejavu.data"]
    for file in ("flags.json", "README.md"):
        assert any(fnmatch.fnmatch(f"megatron/{file}", p) for p in patterns), file
    assert bundled_megatron_flags_path() == DATA / "flags.json"


def _good() -> dict:
    return {
        "ref": ["a", "b"],
        "commit": {"a": "0" * 40, "b": "1" * 40},
        "allow_abbrev": False,
        "flags": {
            "--x": {"value": "one", "choices": ["p", 2], "versions": ["a", "b"]},
            "--y": {"value": "many", "nargs": "+", "choices": None, "versions": ["b"]},
        },
    }


def test_a_written_list_reads_back(tmp_path):
    path = tmp_path / "flags.json"
    path.write_text(json.dumps(_good()))
    flags = load_megatron_flags(path)
    assert set(flags) == {"--x", "--y"} and flags.refs == ("a", "b")
    assert flags["--x"].allows("p") and flags["--x"].allows("2")
    assert not flags["--x"].allows("q") and flags["--y"].nargs == "+"
    assert dict(flags["--y"].value_by_version) == {"b": "many"}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.pop("ref"), '"ref" must be'),
        (lambda d: d.update(commit={"a": "0"}), '"commit" must give'),
        (lambda d: d.update(allow_abbrev="no"), '"allow_abbrev"'),
        (lambda d: d.update(flags=[]), '"flags" must be'),
        (lambda d: d["flags"].update({"x": d["flags"]["--x"]}), "not an option"),
        (lambda d: d["flags"]["--x"].update(value="two"), '"value" must be'),
        (lambda d: d["flags"]["--x"].update(choices="p"), '"choices" must be'),
        (lambda d: d["flags"]["--x"].update(choices=[True]), '"choices" must be'),
        (lambda d: d["flags"]["--x"].update(versions=["c"]), '"versions" must'),
        (lambda d: d["flags"]["--y"].pop("nargs"), '"nargs" must be'),
        (lambda d: d["flags"]["--x"].update(nargs="*"), '"nargs" must be'),
        (lambda d: d["flags"]["--x"].update(condition=1), '"condition" must'),
        (lambda d: d["flags"]["--x"].update(by_version={"c": {}}), '"by_version"'),
        (lambda d: d["flags"]["--x"].update(by_version={"a": {}}), "must give a"),
    ],
)
def test_a_malformed_list_is_one_line_naming_the_file(tmp_path, change, match):
    document = _good()
    change(document)
    path = tmp_path / "flags.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ProblemError, match=match) as caught:
        load_megatron_flags(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message


@pytest.mark.parametrize("text", ["", "[1]", "{", "x" * 5_000_000])
def test_an_unreadable_list_is_a_problem(tmp_path, text):
    path = tmp_path / "flags.json"
    path.write_text(text)
    with pytest.raises(ProblemError, match=re.escape(str(path))):
        load_megatron_flags(path)


# -- the generator, on a small made-up Megatron-LM source -----------------------

FAKE_SOURCE = {
    "megatron/training/arguments.py": """
        import argparse
        from megatron.training.argument_utils import ArgumentGroupFactory

        def add_megatron_arguments(parser):
            parser = _add_size_args(parser)
            parser = _add_config_args(parser)
            parser = _add_optional_args(parser)
            return parser

        def parse_args(extra_args_provider=None):
            parser = argparse.ArgumentParser(description='x', allow_abbrev=False)
            return add_megatron_arguments(parser)

        def _add_size_args(parser):
            group = parser.add_argument_group(title='size')
            group.add_argument('--num-layers', type=int, default=None)
            group.add_argument('--bf16', action='store_true')
            group.add_argument('--no-fusion', action='store_false', dest='fusion')
            group.add_argument('--data-path', nargs='*', default=None)
            group.add_argument('--ramp', nargs=3, type=int)
            group.add_argument('--pos', type=str, choices=['rope', 'none'])
            group.add_argument('--level', type=int, choices=(0, 1))
            group.add_argument('--maybe', nargs='?', const=1)
            group.add_argument('--skip-bos', action=argparse.BooleanOptionalAction)
            group.add_argument('--old-name', '--new-name', type=int)
            _more(group)
            return parser

        def _more(group):
            group.add_argument('--from-helper', type=float)

        def _add_config_args(parser):
            from megatron.training.config import TrainingConfig
            factory = ArgumentGroupFactory(TrainingConfig, exclude=['hidden'])
            group = factory.build_group(parser, 'training')
            return parser

        def _add_optional_args(parser):
            try:
                from somewhere import HAVE_X
            except ImportError:
                HAVE_X = False
            if HAVE_X:
                parser.add_argument('--x-only', type=int)
            return parser
    """,
    "megatron/training/config.py": """
        import enum
        from dataclasses import dataclass, field
        from typing import Literal, Optional

        class Mode(enum.Enum):
            fast = 1
            slow = 2

        @dataclass
        class BaseConfig:
            seed: int = 1234

        @dataclass(kw_only=True)
        class TrainingConfig(BaseConfig):
            train_iters: Optional[int] = None
            log_params: bool = False
            fused_kernel: bool = True
            style: Literal["cosine", "linear"] = "linear"
            ranks: list[int] = field(default_factory=list)
            mode: Mode = Mode.fast
            hidden: int = 3
            internal: int = field(default=0, init=False)
            renamed: int | None = field(
                default=None,
                metadata={"argparse_meta": {"arg_names": ["--other-name"]}},
            )
    """,
    "pretrain_gpt.py": """
        try:
            from megatron.post_training.arguments import add_extra_args
            has_extra = True
        except ImportError:
            has_extra = False

        if __name__ == "__main__":
            pretrain(extra_args_provider=add_extra_args if has_extra else None)
    """,
    "megatron/post_training/arguments.py": """
        def add_extra_args(parser):
            group = parser.add_argument_group(title='extra')
            group.add_argument('--export-thing', type=str)
            return parser
    """,
}


def _generator():
    return load_benchmark("megatron_flags", "megatron_flags_script")


def _fake_checkout(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(textwrap.dedent(text))
    return root


def test_the_generator_reads_add_argument_factory_fields_and_providers(tmp_path):
    script = _generator()
    source = _fake_checkout(tmp_path / "mlm", FAKE_SOURCE)
    output = tmp_path / "flags.json"
    assert script.main([str(source), "--output", str(output)]) == 0
    flags = load_megatron_flags(output)
    kinds = {
        name: (info.value, info.nargs, info.choices) for name, info in flags.items()
    }
    assert kinds == {
        "--num-layers": ("one", None, None),
        "--bf16": ("none", None, None),
        "--no-fusion": ("none", None, None),
        "--data-path": ("many", "*", None),
        "--ramp": ("many", 3, None),
        "--pos": ("one", None, ("rope", "none")),
        "--level": ("one", None, (0, 1)),
        "--maybe": ("optional", None, None),
        "--skip-bos": ("none", None, None),
        "--no-skip-bos": ("none", None, None),  # BooleanOptionalAction
        "--old-name": ("one", None, None),
        "--new-name": ("one", None, None),
        "--from-helper": ("one", None, None),
        # the dataclass fields, base class first, by the factory's rules
        "--seed": ("one", None, None),
        "--train-iters": ("one", None, None),
        "--log-params": ("none", None, None),  # bool defaulting to False
        "--no-fused-kernel": ("none", None, None),  # bool defaulting to True
        "--disable-fused-kernel": ("none", None, None),
        "--style": ("one", None, ("cosine", "linear")),
        "--ranks": ("many", "+", None),
        "--mode": ("one", None, ("fast", "slow")),
        "--other-name": ("one", None, None),  # argparse_meta arg_names
        "--x-only": ("one", None, None),
        "--export-thing": ("one", None, None),
        "-h": ("none", None, None),
        "--help": ("none", None, None),
    }
    assert flags["--x-only"].condition == "HAVE_X"
    assert flags["--export-thing"].condition == "has_extra"
    assert flags["--num-layers"].condition is None
    assert flags.allow_abbrev is False and flags.refs == ("work tree",)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("parser.add_argument(NAME, type=int)", "option name NAME"),
        ("parser.add_argument('--a', nargs=N)", "nargs N"),
        ("parser.add_argument('--a', choices=make())", "choices make() not read"),
        ("parser.add_argument('--a', **kwargs)", "**kwargs"),
        ("parser.add_argument('--a', action=Custom)", "unknown action"),
        ("parser.add_argument('--a')\nparser.add_argument('--a')", "twice"),
        ("for n in names:\n    parser.add_argument(n)", "inside a loop"),
        ("other.helper(parser)", "cannot follow other.helper(parser)"),
        ("missing(parser)", "cannot follow missing(parser)"),
    ],
)
def test_the_generator_reports_what_it_cannot_read(tmp_path, line, problem):
    script = _generator()
    line = line.replace("\n", "\n" + " " * 12)  # the body's indent below
    arguments = f"""
        import argparse
        def add_megatron_arguments(parser):
            {line}
            return parser
        def parse_args():
            parser = argparse.ArgumentParser(allow_abbrev=False)
    """
    files = {**FAKE_SOURCE, "megatron/training/arguments.py": arguments}
    source = _fake_checkout(tmp_path / "mlm", files)
    extractor = script.Extractor(script.Source(source, None))
    extractor.run()
    assert any(problem in p for p in extractor.problems), extractor.problems


def test_the_generator_says_when_abbreviations_are_allowed(tmp_path):
    script = _generator()
    arguments = FAKE_SOURCE["megatron/training/arguments.py"].replace(
        ", allow_abbrev=False", ""
    )
    files = {**FAKE_SOURCE, "megatron/training/arguments.py": arguments}
    source = _fake_checkout(tmp_path / "mlm", files)
    output = tmp_path / "flags.json"
    assert script.main([str(source), "--output", str(output)]) == 1
    assert json.loads(output.read_text())["allow_abbrev"] is True


def test_the_generator_reads_git_refs(tmp_path):
    source = _fake_checkout(tmp_path / "mlm", FAKE_SOURCE)
    git = ["git", "-C", str(source), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "v1"], check=True)
    subprocess.run([*git, "tag", "v1"], check=True)
    arguments = source / "megatron/training/arguments.py"
    arguments.write_text(arguments.read_text().replace("'--bf16'", "'--fp16'"))
    subprocess.run([*git, "commit", "-q", "-am", "v2"], check=True)
    subprocess.run([*git, "tag", "v2"], check=True)
    output = tmp_path / "flags.json"
    script = _generator()
    argv = [str(source), "--ref", "v1", "--ref", "v2", "--output", str(output)]
    assert script.main(argv) == 0
    flags = load_megatron_flags(output)
    assert flags.refs == ("v1", "v2")
    assert flags["--bf16"].versions == ("v1",) and flags["--fp16"].versions == ("v2",)
    assert flags["--num-layers"].versions == ("v1", "v2")
