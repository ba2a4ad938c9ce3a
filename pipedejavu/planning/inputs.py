"""Files in and out: problem files, Alpa stage profiles, cluster files, plans,
and the bundled examples.

Wherever a problem is read (the API's :func:`load_problem` and ``solve``, every
CLI command), the source is a path or the name of a bundled example, and a
cluster (a :class:`~pipedejavu.core.cluster.Cluster`, a cluster file, or a bundled
cluster's name) turns a homogeneous problem into a
:class:`~pipedejavu.core.hetero.HeteroProblem`.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipedejavu.core.cluster import Cluster
from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import read_json
from pipedejavu.core.hetero import HeteroPlan, HeteroProblem
from pipedejavu.core.layer_memory import LayerMemory
from pipedejavu.core.npzfile import read_npz
from pipedejavu.core.problem import PROBLEM_KEYS, Plan, Problem
from pipedejavu.costmodel.alpa.profiles import problem_from_stage_profile
from pipedejavu.costmodel.stage.generate import random_problem
from pipedejavu.costmodel.stage.hetero_generate import (
    hetero_problem,
    model_memory_limits,
)

__all__ = [
    "BUNDLED_CLUSTERS",
    "BundledExample",
    "GENERATED_EXAMPLE",
    "bundled_examples",
    "example_names",
    "load_cluster",
    "load_example",
    "load_plan",
    "load_problem",
    "parse_cluster",
    "sniff_format",
]

_CLUSTER = re.compile(r"^\s*(\d{1,7})\s*[xX]\s*(\d{1,7})\s*$")

#: Largest plan JSON file read (bytes).
MAX_PLAN_FILE_BYTES = 16 * 2**20


def parse_cluster(text: str) -> tuple[int, int]:
    """``"2x8"`` -> ``(2, 8)`` (hosts x devices per host).

    Raises:
        ProblemError: not of the form HxD with positive integers.
    """
    match = _CLUSTER.match(text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ProblemError(
            f"cluster must look like HOSTSxDEVICES_PER_HOST, e.g. 1x4 or 2x8; "
            f"got {text!r:.60}"
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


# ------------------------------------------------------------------- clusters
#: Cluster files shipped in ``pipedejavu/data/``, by name.
BUNDLED_CLUSTERS = {"a100-v100-4x8": "cluster-a100-v100-4x8.json"}


def _data_path(filename: str) -> Path:
    return Path(str(importlib.resources.files("pipedejavu").joinpath("data", filename)))


def load_cluster(source: Cluster | str | os.PathLike) -> Cluster:
    """A :class:`Cluster`, read from a ``.json``/``.toml`` file or, when no
    such file exists, a bundled cluster by name (:data:`BUNDLED_CLUSTERS`).

    Raises:
        ProblemError: one line naming the file and what is wrong in it.
    """
    if isinstance(source, Cluster):
        return source
    if str(source) in BUNDLED_CLUSTERS and not os.path.exists(source):
        return Cluster.from_file(_data_path(BUNDLED_CLUSTERS[str(source)]))
    return Cluster.from_file(source)


def _with_cluster(
    problem: Problem,
    cluster: Cluster | str | os.PathLike,
    boundary_bytes: Any,
    source: str,
    *,
    layer_memory: LayerMemory | None = None,
    memory_rule: Callable[[Cluster], np.ndarray] | None = None,
) -> HeteroProblem:
    """``problem`` (reference-device costs) on a typed cluster.

    Device memory (``memory_gb``) bounds each type's stages through
    ``layer_memory`` (per-layer bytes, as ``pipedejavu profile`` writes them)
    or ``memory_rule`` (the cluster -> i64[L, L, M, K, T] rule of a generated
    model); without either, a cluster that sets it is refused
    (:meth:`HeteroProblem.from_problem`) rather than silently ignored.
    """
    typed = load_cluster(cluster)
    label = "the cluster" if isinstance(cluster, Cluster) else os.fspath(cluster)
    try:
        rule = None
        if memory_rule is not None and typed.shape == tuple(problem.cluster_shape):
            rule = memory_rule(typed)
        return HeteroProblem.from_problem(
            problem,
            typed,
            boundary_bytes=boundary_bytes,
            layer_memory=layer_memory,
            max_n_succ_stages=rule,
        )
    except ProblemError as error:
        raise ProblemError(f"{source} with {label}: {error}") from None


def _layer_memory(arrays: dict[str, np.ndarray], source: str) -> LayerMemory | None:
    """The per-layer memory bytes a ``pipedejavu profile`` file carries."""
    if "param_bytes" not in arrays or "stash_bytes" not in arrays:
        return None
    try:
        return LayerMemory(arrays["param_bytes"], arrays["stash_bytes"])
    except ProblemError as error:
        raise ProblemError(f"{source}: {error}") from None


# ------------------------------------------------------------------- examples
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
        return _data_path(self.filename)

    def load(self) -> Problem:
        return _read_file(
            self.path,
            cluster_shape=self.cluster_shape,
            num_microbatches=self.num_microbatches,
            submesh_space=self.submesh_space,
        )[0]


_GPT = "GPT-1.3B (24 blocks, hidden 2048, seq 1024), global batch 1024"


def bundled_examples() -> tuple[BundledExample, ...]:
    """The three real Alpa GPT profiles (see ``pipedejavu/data/ATTRIBUTION.md``),
    with their files and run settings.

    These are three of the six names :func:`load_example` takes; the other
    three are generated (no profile file). :func:`example_names` lists all six.
    """
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
#: A GPT-6.7B-like model on 4 hosts x 8 reference (A100-class) devices, with
#: activation sizes: any 4 x 8 cluster file makes it heterogeneous.
GPT_4X8_EXAMPLE = "generated-gpt-32layers-4x8"
#: The same instance as ``GPT_4X8_EXAMPLE`` with the bundled cluster file
#: ``a100-v100-4x8`` (``solve generated-gpt-32layers-4x8 --cluster-file
#: a100-v100-4x8``), with the cluster included.
HETERO_EXAMPLE = "hetero-gpt-32layers-a100-v100"


def _gpt_4x8() -> tuple[Problem, np.ndarray]:
    """The reference-device problem: :func:`hetero_problem`'s model on one
    device type (the A100-class reference, 40 GB), viewed homogeneously."""
    cluster = load_cluster("a100-v100-4x8")
    reference = dataclasses.replace(
        cluster, host_types=(0,) * cluster.num_hosts
    )  # every host of the reference type, same links
    typed = hetero_problem(32, reference, num_microbatches=32, seed=0)
    return typed.homogeneous_view(speed=1.0), typed.boundary_bytes


def _gpt_4x8_memory(problem: Problem) -> Callable[[Cluster], np.ndarray]:
    """The 4 x 8 example's memory rule per type of a cluster: its model's
    limits on each type's ``memory_bytes`` (as :func:`hetero_problem` sets
    them), the reference (40 GB) rule on types without."""

    def rule(cluster: Cluster) -> np.ndarray:
        per_type = [
            problem.max_n_succ_stages
            if kind.memory_bytes is None
            else np.broadcast_to(
                model_memory_limits(
                    problem.num_layers, problem.submesh_sizes, kind.memory_bytes
                )[..., None],
                problem.compute_cost.shape,
            )
            for kind in cluster.device_types
        ]
        return np.stack(per_type, axis=-1)

    return rule


def _generated(name: str) -> tuple[Problem | HeteroProblem, np.ndarray | None]:
    if name == GENERATED_EXAMPLE:
        return random_problem(32, (2, 8), num_microbatches=32, seed=0), None
    if name == GPT_4X8_EXAMPLE:
        return _gpt_4x8()
    # the 4 x 8 example on the bundled cluster: the same instance as
    # `--cluster-file a100-v100-4x8` gives it (costs scaled by type speed)
    problem, boundary = _gpt_4x8()
    typed = _with_cluster(
        problem,
        load_cluster("a100-v100-4x8"),
        boundary,
        f"example {name}",
        memory_rule=_gpt_4x8_memory(problem),
    )
    return typed, None


_GENERATED: dict[str, str] = {
    GENERATED_EXAMPLE: "generated GPT-like model, 32 layers, 2x8 cluster, "
    "power_of_two submeshes, 2 configs, B = 32 "
    "(pipedejavu.costmodel.stage.generate.random_problem)",
    GPT_4X8_EXAMPLE: "generated GPT-6.7B-like model, 32 layers, 4x8 A100-class "
    "devices (40 GB), 2 configs, B = 32, 16.8 MB activations per boundary "
    "(pipedejavu.costmodel.stage.hetero_generate); give it a 4x8 cluster file",
    HETERO_EXAMPLE: f"{GPT_4X8_EXAMPLE} on the bundled cluster a100-v100-4x8 "
    "(2 A100 + 2 V100 hosts x 8, 25 Gb/s between hosts, 10 Gb/s across types; "
    "costs scaled by each type's speed, memory limits per type from its "
    "memory_gb), B = 32: the same instance as --cluster-file a100-v100-4x8",
}


def example_names() -> tuple[str, ...]:
    """Every name :func:`load_example` takes, and ``pipedejavu solve`` wherever a
    problem path goes: the profiles of :func:`bundled_examples`, then the
    generated examples."""
    return tuple(e.name for e in bundled_examples()) + tuple(_GENERATED)


def example_description(name: str) -> str:
    """One line on what the example is."""
    for example in bundled_examples():
        if example.name == name:
            return example.description
    if name in _GENERATED:
        return _GENERATED[name]
    raise ProblemError(
        f"no example named {name!r}; choose one of {', '.join(example_names())}"
    )


def load_example(
    name: str,
    *,
    num_microbatches: int | None = None,
    cluster_shape: tuple[int, int] | None = None,
    cluster: Cluster | str | os.PathLike | None = None,
) -> Problem | HeteroProblem:
    """A bundled example by name.

    Args:
        name: one of :func:`example_names`: the real Alpa profiles of
            :func:`bundled_examples` (``gpt1.3b-6layers-B32``,
            ``gpt1.3b-6layers-B128``, ``gpt1.3b-12layers-B32``) and the
            generated ``generated-gpt-32layers-2x8``,
            ``generated-gpt-32layers-4x8`` and
            ``hetero-gpt-32layers-a100-v100``
            (:func:`example_description` says what each is).
        num_microbatches: replaces the example's B.
        cluster_shape: checked against the example's (which is fixed).
        cluster: a :class:`Cluster`, a cluster file or a bundled cluster name:
            the example's costs are scaled to its typed devices (its shape must
            be the example's).

    Raises:
        ProblemError: unknown name, or settings that do not fit the example.
    """
    boundary = None
    for example in bundled_examples():
        if example.name == name:
            problem = example.load()
            break
    else:
        example_description(name)  # raises for an unknown name
        problem, boundary = _generated(name)
    shape = (
        problem.cluster.shape
        if isinstance(problem, HeteroProblem)
        else problem.cluster_shape
    )
    if cluster_shape is not None and tuple(cluster_shape) != shape:
        raise ProblemError(
            f"example {name} is fixed to a {shape[0]}x{shape[1]} cluster; "
            f"--cluster {cluster_shape[0]}x{cluster_shape[1]} does not apply"
        )
    if cluster is not None:
        if isinstance(problem, HeteroProblem):
            raise ProblemError(
                f"example {name} already describes its cluster; drop the cluster"
            )
        rule = _gpt_4x8_memory(problem) if name == GPT_4X8_EXAMPLE else None
        problem = _with_cluster(
            problem, cluster, boundary, f"example {name}", memory_rule=rule
        )
    if num_microbatches is not None:
        problem = problem.replace(num_microbatches=num_microbatches)
    return problem


# ------------------------------------------------------------------- problems
def _read_file(
    path: str | os.PathLike,
    *,
    cluster_shape: tuple[int, int] | None,
    num_microbatches: int | None,
    submesh_space: str | None,
) -> tuple[Problem | HeteroProblem, np.ndarray | None, LayerMemory | None]:
    """The problem in a file, its activation bytes per boundary and its
    per-layer memory bytes (each if any)."""
    kind = sniff_format(path)
    source = os.fspath(path)
    if kind == "pickle":
        raise ProblemError(
            f"{source} is a pickle (an Alpa prof_database.pkl?), not a stage "
            "problem; give a problem .npz or an Alpa stage-profile .npy"
        )
    if kind == "npy":
        if cluster_shape is None or num_microbatches is None:
            raise ProblemError(
                f"{source} is an Alpa stage profile: say what Alpa was told with "
                "--cluster HxD and --num-microbatches B"
            )
        problem = problem_from_stage_profile(
            path,
            cluster_shape=cluster_shape,
            num_microbatches=num_microbatches,
            submesh_space=submesh_space or "small_power_of_two",
        )
        return problem, None, None
    if submesh_space is not None:
        raise ProblemError(
            f"{source} is a problem .npz: its submeshes are fixed, so a submesh "
            "space (--submesh-space) does not apply"
        )
    arrays = read_npz(
        path,
        required=(),
        optional=PROBLEM_KEYS
        + (
            "max_n_succ_stages",
            "cluster_json",
            "boundary_bytes",
            "activation_bytes",
            "stage_tail_cost",
            "param_bytes",
            "stash_bytes",
        ),
    )
    if "cluster_json" in arrays:
        problem: Problem | HeteroProblem = HeteroProblem.from_arrays(arrays, source)
        shape = problem.cluster.shape
    else:
        missing = [key for key in PROBLEM_KEYS if key not in arrays]
        if missing:
            raise ProblemError(
                f"{source} lacks the key(s) {', '.join(missing)} of a problem file"
            )
        problem = Problem.from_arrays(arrays, source)
        shape = problem.cluster_shape
    if cluster_shape is not None and tuple(cluster_shape) != shape:
        raise ProblemError(
            f"{source} is a problem for a {shape[0]}x{shape[1]} cluster, not "
            f"{cluster_shape[0]}x{cluster_shape[1]} (its submesh table is fixed)"
        )
    if num_microbatches is not None:
        problem = problem.replace(num_microbatches=num_microbatches)
    boundary = arrays.get("boundary_bytes")
    if boundary is None and "activation_bytes" in arrays:  # `pipedejavu profile`
        activations = arrays["activation_bytes"]
        if activations.ndim != 1 or activations.dtype.kind not in "iuf":
            raise ProblemError(
                f"{source}: activation_bytes must be a vector of numbers, got "
                f"{activations.dtype} {tuple(activations.shape)}"
            )
        boundary = activations[:-1].astype(np.float64)
    return problem, boundary, _layer_memory(arrays, source)


def load_problem(
    source: str | os.PathLike,
    *,
    cluster_shape: tuple[int, int] | None = None,
    num_microbatches: int | None = None,
    submesh_space: str | None = None,
    cluster: Cluster | str | os.PathLike | None = None,
) -> Problem | HeteroProblem:
    """Read a problem ``.npz`` (homogeneous or heterogeneous), an Alpa
    stage-profile ``.npy``, or a bundled example by name.

    Args:
        source: the file (its kind is read from its first bytes, not its name),
            or the name of a bundled example (:func:`example_names`) when no
            such file exists.
        cluster_shape: for an Alpa profile, the ``(hosts, devices per host)``
            Alpa was given (required); otherwise it must match the problem's.
        num_microbatches: for an Alpa profile, the B Alpa was given (required);
            otherwise it replaces the stored B.
        submesh_space: for an Alpa profile, Alpa's
            ``submesh_physical_shape_space`` (default ``"small_power_of_two"``);
            refused for a ``.npz``, whose submeshes are fixed.
        cluster: a :class:`Cluster`, a ``.json``/``.toml`` cluster file or a
            bundled cluster name (:data:`BUNDLED_CLUSTERS`): scales the
            (reference-device) costs to typed devices and prices activation
            transfers from the file's ``boundary_bytes`` (or the
            ``activation_bytes`` that ``pipedejavu profile`` writes; zero if
            absent). A type's ``memory_gb`` bounds its stages through the
            file's ``param_bytes``/``stash_bytes`` (:class:`LayerMemory`; the
            generated 4 x 8 example uses its model's limits); a problem
            without them is refused with it (ProblemError), never silently
            given the profiled rule. Refused for a problem that already has a
            cluster.

    Returns:
        A :class:`Problem`, or a :class:`HeteroProblem` for a heterogeneous
        file or when ``cluster`` is given.

    Raises:
        ProblemError: one line naming the file: unreadable, truncated, corrupt,
            too large, invalid, or a setting that does not apply.
    """
    name = os.fspath(source)
    if name in example_names() and not os.path.exists(name):
        if submesh_space is not None:
            raise ProblemError(
                f"example {name} has fixed submeshes; --submesh-space does not apply"
            )
        return load_example(
            name,
            num_microbatches=num_microbatches,
            cluster_shape=cluster_shape,
            cluster=cluster,
        )
    if not os.path.exists(name) and not os.path.splitext(name)[1]:
        # no such file and no extension: most likely a mistyped example name
        raise ProblemError(
            f"no file or example named {name!r}; give a problem file (.npz, "
            f".npy) or one of the examples: {', '.join(example_names())}"
        )
    problem, boundary, layer_memory = _read_file(
        source,
        cluster_shape=cluster_shape,
        num_microbatches=num_microbatches,
        submesh_space=submesh_space,
    )
    if cluster is None:
        return problem
    if isinstance(problem, HeteroProblem):
        raise ProblemError(
            f"{name} already describes its cluster; drop the cluster file"
        )
    return _with_cluster(problem, cluster, boundary, name, layer_memory=layer_memory)


# ---------------------------------------------------------------------- plans
def load_plan(path: str | os.PathLike) -> Plan | HeteroPlan:
    """Read a plan JSON file (as ``pipedejavu solve --json`` prints it): a
    :class:`HeteroPlan` when its stages are placed (have ``hosts``), else a
    :class:`Plan`. Check it against a problem with ``evaluate``.

    Raises:
        ProblemError: one line naming the file: unreadable, too large, not
            UTF-8, invalid or too deeply nested JSON, a missing/bad field, or a
            3D training plan (``pipedejavu plan``'s output, read by
            ``pipedejavu predict``).
    """
    source = os.fspath(path)
    data = read_json(path, MAX_PLAN_FILE_BYTES, "plan file")
    if isinstance(data, dict) and (
        data.get("kind") == "training-plan"
        or "replicas" in data
        or "layers" in data
        or "pipeline_list" in data
    ):
        raise ProblemError(
            f"{source} is a 3D training plan from `pipedejavu plan`; "
            "use `pipedejavu predict`"
        )
    stages = data.get("stages") if isinstance(data, dict) else None
    placed = (
        isinstance(stages, list)
        and bool(stages)
        and isinstance(stages[0], dict)
        and "hosts" in stages[0]
    )
    reader: Callable[..., Plan | HeteroPlan] = (
        HeteroPlan.from_json if placed else Plan.from_json
    )
    return reader(data, source)
