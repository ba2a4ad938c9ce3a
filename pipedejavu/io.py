"""Files in and out: problem files, Alpa stage profiles, the bundled examples."""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from pathlib import Path

from .problem import Problem, ProblemError

__all__ = [
    "BundledExample",
    "GENERATED_EXAMPLE",
    "bundled_examples",
    "example_names",
    "load_example",
    "load_problem",
    "parse_cluster",
    "sniff_format",
]

_CLUSTER = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_cluster(text: str) -> tuple[int, int]:
    """``"2x8"`` -> ``(2, 8)`` (hosts x devices per host).

    Raises:
        ProblemError: not of the form HxD with positive integers.
    """
    match = _CLUSTER.match(text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ProblemError(
            f"cluster must look like HOSTSxDEVICES_PER_HOST, e.g. 1x4 or 2x8; "
            f"got {text!r}"
        )
    return int(match.group(1)), int(match.group(2))


def sniff_format(path: str | os.PathLike) -> str:
    """``"npz"``, ``"npy"`` or ``"pickle"`` from a file's first bytes.

    Raises:
        ProblemError: missing, unreadable, empty or of another kind.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except OSError as error:
        raise ProblemError(f"cannot read {path}: {error.strerror}") from None
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "npz"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head[:1] == b"\x80":
        return "pickle"
    if not head:
        raise ProblemError(f"{path} is empty")
    raise ProblemError(
        f"{path} is neither a problem .npz nor an Alpa stage-profile .npy"
    )


def load_problem(
    path: str | os.PathLike,
    *,
    cluster_shape: tuple[int, int] | None = None,
    num_microbatches: int | None = None,
    submesh_space: str = "small_power_of_two",
) -> Problem:
    """Read a problem ``.npz`` or an Alpa stage-profile ``.npy``.

    Args:
        path: the file; its kind is read from its first bytes, not its name.
        cluster_shape: for an Alpa profile, the ``(hosts, devices per host)``
            Alpa was given (required); for a ``.npz`` it must match the file.
        num_microbatches: for an Alpa profile, the B Alpa was given (required);
            for a ``.npz`` it overrides the stored B.
        submesh_space: for an Alpa profile, Alpa's
            ``submesh_physical_shape_space``.

    Raises:
        ProblemError: unreadable or invalid input, or a missing setting.
    """
    kind = sniff_format(path)
    if kind == "npz":
        problem = Problem.from_npz(path)
        if cluster_shape is not None and tuple(cluster_shape) != problem.cluster_shape:
            raise ProblemError(
                f"{path} is a problem for a {problem.cluster_shape[0]}x"
                f"{problem.cluster_shape[1]} cluster, not {cluster_shape[0]}x"
                f"{cluster_shape[1]} (its submesh table is fixed)"
            )
        if num_microbatches is not None:
            problem = problem.replace(num_microbatches=num_microbatches)
        return problem
    if kind == "pickle":
        raise ProblemError(
            f"{path} is a pickle (an Alpa prof_database.pkl?), not a stage problem; "
            "give a problem .npz or an Alpa stage-profile .npy"
        )
    if cluster_shape is None or num_microbatches is None:
        raise ProblemError(
            f"{path} is an Alpa stage profile: say what Alpa was told with "
            "--cluster HxD and --num-microbatches B"
        )
    from pipedejavu.costmodel import problem_from_stage_profile

    return problem_from_stage_profile(
        path,
        cluster_shape=cluster_shape,
        num_microbatches=num_microbatches,
        submesh_space=submesh_space,
    )


@dataclasses.dataclass(frozen=True)
class BundledExample:
    """A real Alpa stage profile shipped with the package, with its run settings."""

    name: str
    filename: str
    description: str
    cluster_shape: tuple[int, int]
    num_microbatches: int
    submesh_space: str = "small_power_of_two"

    @property
    def path(self) -> Path:
        return Path(
            str(importlib.resources.files("pipedejavu").joinpath("data", self.filename))
        )

    def load(self) -> Problem:
        return load_problem(
            self.path,
            cluster_shape=self.cluster_shape,
            num_microbatches=self.num_microbatches,
            submesh_space=self.submesh_space,
        )


_GPT = "GPT-1.3B (24 blocks, hidden 2048, seq 1024), global batch 1024"


def bundled_examples() -> tuple[BundledExample, ...]:
    """The three real Alpa GPT profiles (see ``pipedejavu/data/ATTRIBUTION.md``)."""
    return (
        BundledExample(
            "gpt1.3b-6layers-B32",
            "profile-results-2023-04-25-16-15-47.npy",
            f"{_GPT}, 6 auto layers, 32 micro-batches",
            (1, 4),
            32,
        ),
        BundledExample(
            "gpt1.3b-6layers-B128",
            "profile-results-2023-04-25-16-59-36.npy",
            f"{_GPT}, 6 auto layers, 128 micro-batches",
            (1, 4),
            128,
        ),
        BundledExample(
            "gpt1.3b-12layers-B32",
            "profile-results-2023-04-25-17-25-46.npy",
            f"{_GPT}, 12 auto layers, 32 micro-batches",
            (1, 4),
            32,
        ),
    )


#: The generated instance of ``pipedejavu demo`` / ``compare`` (no data file:
#: ``random_problem`` is deterministic in its seed).
GENERATED_EXAMPLE = "generated-gpt-32layers-2x8"


def example_names() -> tuple[str, ...]:
    """Names accepted wherever a problem path is: bundled profiles + generated."""
    return tuple(e.name for e in bundled_examples()) + (GENERATED_EXAMPLE,)


def load_example(name: str) -> Problem:
    """A bundled example by name (see :func:`example_names`)."""
    if name == GENERATED_EXAMPLE:
        from .generate import random_problem

        return random_problem(32, (2, 8), num_microbatches=32, seed=0)
    for example in bundled_examples():
        if example.name == name:
            return example.load()
    raise ProblemError(
        f"no example named {name!r}; choose one of {', '.join(example_names())}"
    )
