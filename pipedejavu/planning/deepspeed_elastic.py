"""DeepSpeed's elastic batch sizes (elasticity v0.1 and v0.2), ported to plain Python.

An elastic job may be given any of many GPU counts. DeepSpeed picks one global
batch size that many of those counts can run unchanged, as
``global batch = micro-batch x gradient-accumulation steps x data-parallel size``
for one of the allowed micro-batch sizes. Candidates are the micro-batch sizes and
their least common multiple, each scaled by the largest highly composite number
that keeps it within ``max_train_batch_size`` (highly composite numbers have more
divisors than any smaller number, hence many valid GPU counts). The candidate
with the most valid GPU counts in ``[min_gpus, max_gpus]`` wins, ties going to
the larger (or, with ``prefer_larger_batch: false``, the smaller) batch. Version
0.2 counts data-parallel replicas instead of GPUs: ``num_gpus_per_node`` GPUs per
node and ``model_parallel_size`` GPUs per replica.

The functions, their argument names and their results follow DeepSpeed's
``deepspeed/elasticity`` (v0.16.5) exactly, including its corner cases: the
highly-composite-number list wraps around for ``max // base >= 720720``, a
configuration without any valid count returns ``valid_gpus = None`` (when the
smaller batch is preferred) and later fails with DeepSpeed's ``TypeError``,
version 0.1 asked for a micro-batch without a world size divides by zero, and
version 0.2 reports data-parallel sizes while ``world_size`` counts GPUs.
Where DeepSpeed fails by accident (``TypeError``, ``ZeroDivisionError``, numpy's
``UFuncTypeError``) the same exception is raised, with a note saying what is wrong.
Valid GPU counts are Python ints (DeepSpeed leaks numpy integers into them).

No JAX here: this module imports numpy (for DeepSpeed's ``np.lcm``) and
``packaging`` (for its version check) only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipedejavu.search.megatron.space import divisors

# Highly composite numbers up to 720720 (OEIS A002182), DeepSpeed's scale factors.
HCN_LIST = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520,
    5040, 7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160,
    110880, 166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720,
)  # fmt: skip

LATEST_ELASTICITY_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"

_DEFAULTS = {
    "enabled": False,
    "max_train_batch_size": 2000,
    "micro_batch_sizes": [2, 4, 6],
    "min_gpus": 1,
    "max_gpus": 10000,
    "num_gpus_per_node": 1,
    "model_parallel_size": 1,
    "min_time": 0,
    "version": LATEST_ELASTICITY_VERSION,
    "prefer_larger_batch": True,
    "ignore_non_elastic_batch_info": False,
}


class ElasticityError(Exception):
    """Base class of every elasticity error (DeepSpeed's name)."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The requested world size is not among the valid GPU counts."""


class _NoDivisibleMicroBatch(ElasticityIncompatibleWorldSize, AssertionError):
    """No micro-batch size divides the per-GPU batch (DeepSpeed asserts here)."""


def _noted(error: BaseException, note: str) -> BaseException:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)
    return error


@dataclass(frozen=True)
class ElasticityConfig:
    """The ``elasticity`` section of a DeepSpeed config, validated like DeepSpeed.

    Build it with :meth:`from_dict`; the checks (and their messages) run in
    DeepSpeed's order, so the first problem reported is the one DeepSpeed reports.
    """

    enabled: Any = False
    max_acceptable_batch_size: Any = 2000
    micro_batches: Any = field(default_factory=lambda: [2, 4, 6])
    min_gpus: Any = 1
    max_gpus: Any = 10000
    model_parallel_size: Any = 1
    num_gpus_per_node: Any = 1
    min_time: Any = 0
    version: Any = LATEST_ELASTICITY_VERSION
    prefer_larger_batch_size: Any = True
    ignore_non_elastic_batch_info: Any = False

    @classmethod
    def from_dict(cls, param_dict: dict) -> ElasticityConfig:
        """Reads and validates the ``elasticity`` dictionary.

        Raises:
            ElasticityConfigError: a required key is missing or a value is invalid.
        """
        get = param_dict.get
        enabled = get("enabled", _DEFAULTS["enabled"])
        if enabled:
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if key not in param_dict:
                    raise ElasticityConfigError(f"Elasticity config missing {key}")
        return cls(
            enabled=enabled,
            max_acceptable_batch_size=get(
                "max_train_batch_size", _DEFAULTS["max_train_batch_size"]
            ),
            micro_batches=get(
                "micro_batch_sizes", list(_DEFAULTS["micro_batch_sizes"])
            ),
            min_gpus=get("min_gpus", _DEFAULTS["min_gpus"]),
            max_gpus=get("max_gpus", _DEFAULTS["max_gpus"]),
            model_parallel_size=get(
                "model_parallel_size", _DEFAULTS["model_parallel_size"]
            ),
            num_gpus_per_node=get("num_gpus_per_node", _DEFAULTS["num_gpus_per_node"]),
            min_time=get("min_time", _DEFAULTS["min_time"]),
            version=get("version", _DEFAULTS["version"]),
            prefer_larger_batch_size=get(
                "prefer_larger_batch", _DEFAULTS["prefer_larger_batch"]
            ),
            ignore_non_elastic_batch_info=get(
                "ignore_non_elastic_batch_info",
                _DEFAULTS["ignore_non_elastic_batch_info"],
            ),
        )

    def __post_init__(self) -> None:
        micro = self.micro_batches
        if not isinstance(micro, list):
            raise ElasticityConfigError(
                "Elasticity expected value of micro_batch_sizes to be a list of "
                f"micro batches, instead is: {type(micro)}, containing: {micro}"
            )
        # DeepSpeed's messages print a stray "f" before the list; kept verbatim.
        if not all(isinstance(m, int) for m in micro):
            raise ElasticityConfigError(
                "Elasticity expected micro_batch_sizes to only contain a list of "
                f"integers, instead contains: f{micro}"
            )
        if not all(m > 0 for m in micro):
            raise ElasticityConfigError(
                "Elasticity expected micro_batch_sizes to only contain positive "
                f"integers, instead contains: f{micro}"
            )
        if self.min_gpus < 1 or self.max_gpus < 1:
            raise ElasticityConfigError(
                "Elasticity min/max gpus must be > 0, "
                f"given min_gpus: {self.min_gpus}, max_gpus: {self.max_gpus}"
            )
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(
                "Elasticity min_gpus cannot be greater than max_gpus, "
                f"given min_gpus: {self.min_gpus}, max_gpus: {self.max_gpus}"
            )
        if self.model_parallel_size < 1:
            raise ElasticityConfigError(
                "Model-Parallel size cannot be less than 1, "
                f"given model-parallel size: {self.model_parallel_size}"
            )
        if self.num_gpus_per_node < 1:
            raise ElasticityConfigError(
                "Number of GPUs per node cannot be less than 1, "
                f"given number of GPUs per node: {self.num_gpus_per_node}"
            )
        if self.min_time < 0:
            raise ElasticityConfigError(
                f"Elasticity min time needs to be >= 0: given {self.min_time}"
            )


def _hcn_scale(value) -> int:
    """The largest highly composite number <= value; 720720 past the list's end."""
    for index, hcn in enumerate(HCN_LIST):
        if hcn > value:
            return HCN_LIST[index - 1]  # index 0 wraps to the last, as in DeepSpeed
    return HCN_LIST[-1]


def get_candidate_batch_sizes(base_list: Sequence, max_acceptable_batch_size) -> list:
    """Each base scaled by the largest HCN that keeps it <= the maximum.

    A base at or above the maximum is its own candidate. Duplicates are removed;
    the result is sorted (DeepSpeed returns set order).
    """
    candidates = []
    for base in base_list:
        if base >= max_acceptable_batch_size:
            candidates.append(base)
        else:
            candidates.append(_hcn_scale(max_acceptable_batch_size // base) * base)
    return sorted(set(candidates))


def get_valid_gpus(batch_size, micro_batches, min_valid_gpus, max_valid_gpus) -> list:
    """GPU counts in ``[min_valid_gpus, max_valid_gpus]`` that can run ``batch_size``.

    A count n is valid when some micro-batch size mb divides ``batch_size`` and n
    divides ``batch_size // mb`` (each GPU then runs ``batch_size // (mb * n)``
    accumulation steps of mb samples). Sorted, without duplicates.
    """
    valid = set()
    for micro_batch in micro_batches:
        if batch_size % micro_batch != 0:
            continue
        max_gpus = batch_size // micro_batch
        if min_valid_gpus <= max_gpus <= max_valid_gpus:
            valid.add(max_gpus)
        if isinstance(max_gpus, float):  # DeepSpeed's range() rejects floats
            raise TypeError("'float' object cannot be interpreted as an integer")
        # DeepSpeed scans i = 1 .. max_gpus // 2; the divisors below give the same.
        for i in divisors(int(max_gpus)) if max_gpus >= 1 else ():
            if i > max_gpus // 2 or i > max_valid_gpus:
                break
            if i >= min_valid_gpus:
                valid.add(i)
    return sorted(valid)


def is_valid_world_size(
    batch_size: int,
    micro_batches: Sequence[int],
    num_gpus: int,
    model_parallel_size: int = 1,
) -> bool:
    """Whether ``num_gpus`` GPUs can run the global batch ``batch_size``.

    DeepSpeed's rule with model parallelism: the GPUs form ``num_gpus /
    model_parallel_size`` data-parallel replicas (which must be a whole number),
    and some micro-batch size ``mb`` must split the batch evenly over them
    (``batch_size % (mb * replicas) == 0``). With ``model_parallel_size = 1`` this
    is membership in ``get_valid_gpus(batch_size, micro_batches, 1, inf)``, and
    version 0.2's data-parallel sizes follow the same rule. For a pipeline plan
    ``model_parallel_size`` is tensor-parallel size x pipeline stages.
    """
    if num_gpus < 1 or model_parallel_size < 1 or num_gpus % model_parallel_size:
        return False
    replicas = num_gpus // model_parallel_size
    return any(batch_size % (mb * replicas) == 0 for mb in micro_batches)


def get_best_candidates(
    candidate_batch_sizes, micro_batches, min_gpus, max_gpus, prefer_larger
) -> tuple:
    """The candidate with the most valid GPU counts, and those counts.

    Ties go to the larger batch if ``prefer_larger``, else to the smaller. When no
    candidate beats the starting point (``min(micro_batches)`` with no valid
    counts) the result is ``(min(micro_batches), None)``.
    """
    max_valid_gpus = 0
    valid_gpus = None
    final_batch_size = int(min(micro_batches))
    for batch_size in candidate_batch_sizes:
        current = get_valid_gpus(batch_size, micro_batches, min_gpus, max_gpus)
        if len(current) > max_valid_gpus or (
            len(current) == max_valid_gpus
            and (
                (prefer_larger and batch_size > final_batch_size)
                or (not prefer_larger and batch_size < final_batch_size)
            )
        ):
            max_valid_gpus = len(current)
            valid_gpus = current
            final_batch_size = batch_size
    return final_batch_size, valid_gpus


def _lcm(micro_batches) -> int:
    import numpy as np  # DeepSpeed's np.lcm.reduce, so that [] fails the same way

    try:
        return int(np.lcm.reduce(micro_batches))
    except TypeError as error:
        raise _noted(
            error, f"micro_batch_sizes must be a non-empty list, got {micro_batches}"
        ) from None


def _get_compatible_gpus_v01(
    micro_batches,
    max_acceptable_batch_size,
    min_gpus=None,
    max_gpus=None,
    prefer_larger=True,
) -> tuple:
    """Version 0.1: ``(final_batch_size, valid_gpus)`` for data parallelism only."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    if not all(mb <= max_acceptable_batch_size for mb in micro_batches):
        # DeepSpeed's message, line-continuation spaces included.
        raise ValueError(
            "All micro batches must be less than             or equal to "
            f"max_acceptable_batch_size: {max_acceptable_batch_size}"
        )
    base_list = [*micro_batches, _lcm(micro_batches)]
    candidates = get_candidate_batch_sizes(base_list, max_acceptable_batch_size)
    return get_best_candidates(
        candidates, micro_batches, min_gpus, max_gpus, prefer_larger
    )


def _pick_microbatch(micro_batches, batch_size, num_gpus, prefer_larger):
    """First (or, if prefer_larger, largest) mb dividing ``batch_size // num_gpus``."""
    chosen = None
    for micro_batch in micro_batches:
        if batch_size // num_gpus % micro_batch == 0:
            if chosen is None:
                chosen = micro_batch
            if prefer_larger and chosen < micro_batch:
                chosen = micro_batch
    return chosen


def _get_compatible_gpus_v02(
    micro_batches,
    max_acceptable_batch_size,
    current_num_gpus,
    min_gpus=None,
    max_gpus=None,
    prefer_larger=True,
    num_gpus_per_node=1,
    model_parallel_size=1,
) -> tuple:
    """Version 0.2: ``(final_batch_size, valid_dp_sizes, micro_batch_size)``.

    Runs version 0.1 per node (``num_gpus_per_node // model_parallel_size``
    replicas each). If ``current_num_gpus // model_parallel_size`` is not a valid
    data-parallel size, falls back to the largest (or smallest) multiple of
    ``mb x current data-parallel size`` within the maximum, valid for that size
    only; that batch is a float, as in DeepSpeed.
    """
    if num_gpus_per_node % model_parallel_size != 0:
        raise ElasticityError(
            f"In Elasticity v0.2, number of GPUs per node:{num_gpus_per_node} "
            f"should be divisible by model parallel size {model_parallel_size}"
        )
    dp_size_per_node = num_gpus_per_node // model_parallel_size
    final_batch_size, valid_world_size = _get_compatible_gpus_v01(
        micro_batches,
        int(max_acceptable_batch_size / dp_size_per_node),
        int(min_gpus / num_gpus_per_node),
        int(max_gpus / num_gpus_per_node),
        prefer_larger=prefer_larger,
    )
    final_batch_size = int(final_batch_size) * dp_size_per_node
    if valid_world_size is None:
        raise _noted(
            TypeError("'NoneType' object is not iterable"),
            "no candidate batch size has a valid node count in "
            f"[min_gpus, max_gpus] / num_gpus_per_node = [{min_gpus}, {max_gpus}] / "
            f"{num_gpus_per_node}",
        )
    valid_dp_sizes = [i * dp_size_per_node for i in valid_world_size]
    if current_num_gpus // model_parallel_size in valid_dp_sizes:
        micro = _pick_microbatch(
            micro_batches, final_batch_size, current_num_gpus, prefer_larger
        )
        return final_batch_size, valid_dp_sizes, micro

    current_dp_size = (current_num_gpus / num_gpus_per_node) * dp_size_per_node
    candidates = []
    for micro_batch in micro_batches:
        min_batch_size = micro_batch * current_dp_size
        factor = math.floor(max_acceptable_batch_size / float(min_batch_size))
        candidates.append(factor * min_batch_size)
    batch_size = max(candidates) if prefer_larger else min(candidates)
    micro = _pick_microbatch(micro_batches, batch_size, current_num_gpus, prefer_larger)
    return batch_size, [int(current_dp_size)], micro


def _compatible_ds_version_check(target_deepspeed_version: str) -> bool:
    from packaging import version as pkg_version

    if pkg_version.parse(target_deepspeed_version) < pkg_version.parse(
        MINIMUM_DEEPSPEED_VERSION
    ):
        raise ElasticityError(
            f"Target deepspeed version of {target_deepspeed_version} is not "
            f"compatible with minimum version {MINIMUM_DEEPSPEED_VERSION} "
            "supporting elasticity."
        )
    return True


def _largest_dividing_microbatch(micro_batches, final_batch_size, world_size):
    for micro_batch in sorted(set(micro_batches), reverse=True):
        if final_batch_size // world_size % micro_batch == 0:
            return micro_batch
    raise _NoDivisibleMicroBatch(
        f"Unable to find divisible micro batch size world_size={world_size}, "
        f"final_batch_size={final_batch_size}, and  micro_batches={micro_batches}."
    )


def _world_size_from_env() -> int:
    value = os.environ.get("WORLD_SIZE")
    if value is not None and value.isnumeric():
        return int(value)
    raise ElasticityConfigError(
        "Elasticity V 0.2 needs WORLD_SIZE to compute valid batch size. Either give "
        "it as argument to function compute_elastic_config or set it as an "
        f"environment variable. Value of WORLD_SIZE as environment variable is {value}"
    )


def compute_elastic_config(
    ds_config: dict,
    target_deepspeed_version: str,
    world_size: int = 0,
    return_microbatch: bool = False,
) -> tuple:
    """DeepSpeed's ``compute_elastic_config``: the elastic global batch size.

    Args:
        ds_config: a DeepSpeed config dictionary with an ``elasticity`` section
            (``enabled``, ``max_train_batch_size``, ``micro_batch_sizes``, and
            optionally ``min_gpus``, ``max_gpus``, ``prefer_larger_batch``,
            ``num_gpus_per_node``, ``model_parallel_size``, ``min_time``,
            ``version``: 0.1 or 0.2, the default).
        target_deepspeed_version: the DeepSpeed version the job will run
            (at least 0.3.8).
        world_size: the GPU count to check (0: none). Version 0.2 needs it, or
            the ``WORLD_SIZE`` environment variable.
        return_microbatch: also return a micro-batch size.

    Returns:
        ``(final_batch_size, valid_gpus)``, or ``(final_batch_size, valid_gpus,
        micro_batch_size)`` when ``world_size > 0`` (whatever
        ``return_microbatch`` says) or ``return_microbatch``. ``final_batch_size``
        is an int in samples; ``valid_gpus`` the valid GPU counts (v0.1) or
        data-parallel sizes (v0.2).

    Raises:
        ValueError: ``ds_config`` is not a dictionary, or a micro-batch size
            exceeds the maximum batch.
        ElasticityConfigError: elasticity missing, disabled or misconfigured.
        ElasticityError: incompatible versions or model-parallel size.
        ElasticityIncompatibleWorldSize: ``world_size`` is not a valid count.
        NotImplementedError: a version other than 0.1 and 0.2.

    Example:
        >>> config = {"elasticity": {"enabled": True, "max_train_batch_size": 2000,
        ...           "micro_batch_sizes": [2, 4, 6], "version": 0.1}}
        >>> batch, gpus = compute_elastic_config(config, "0.16.5")
        >>> batch, gpus[:6]
        (1680, [1, 2, 3, 4, 5, 6])
    """
    if not isinstance(ds_config, dict):
        raise ValueError(
            "Expected ds_config to be a dictionary but received "
            f"a {type(ds_config)}, containing: {ds_config}"
        )
    if "elasticity" not in ds_config:
        raise ElasticityConfigError(
            "'elasticity' is missing from config json, please add it if running an "
            "elastic training job."
        )
    section = ds_config["elasticity"]
    if not isinstance(section, dict):  # (DeepSpeed fails on .get)
        raise ElasticityConfigError(
            f"'elasticity' must be an object of settings, got {type(section).__name__}"
        )
    if not section.get("enabled", _DEFAULTS["enabled"]):
        raise ElasticityConfigError(
            "Elasticity is disabled, please enable it ('enabled':true) if running an "
            "elastic training job."
        )
    config = ElasticityConfig.from_dict(section)
    mp_size = config.model_parallel_size
    if mp_size > 1 and float(config.version) != 0.2:
        raise ElasticityConfigError(
            f"Elasticity V{config.version} does not support model-parallel training. "
            f"Given model-parallel size: {mp_size}"
        )
    if float(config.version) > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(
            f"Attempting to run elasticity version {config.version} but runtime only "
            f"supports up to {LATEST_ELASTICITY_VERSION}"
        )
    _compatible_ds_version_check(target_deepspeed_version)

    if float(config.version) == 0.1:
        final_batch_size, valid_gpus = _get_compatible_gpus_v01(
            micro_batches=config.micro_batches,
            max_acceptable_batch_size=config.max_acceptable_batch_size,
            min_gpus=config.min_gpus,
            max_gpus=config.max_gpus,
            prefer_larger=config.prefer_larger_batch_size,
        )
        candidate_micro = None
    elif float(config.version) == 0.2:
        current = world_size if world_size != 0 else _world_size_from_env()
        final_batch_size, valid_gpus, candidate_micro = _get_compatible_gpus_v02(
            micro_batches=config.micro_batches,
            max_acceptable_batch_size=config.max_acceptable_batch_size,
            current_num_gpus=current,
            min_gpus=config.min_gpus,
            max_gpus=config.max_gpus,
            prefer_larger=config.prefer_larger_batch_size,
            num_gpus_per_node=config.num_gpus_per_node,
            model_parallel_size=mp_size,
        )
    else:
        raise NotImplementedError(
            f"Unable to find elastic logic for version: {config.version}"
        )
    final_batch_size = int(final_batch_size)

    if world_size > 0:
        if valid_gpus is None:
            raise _noted(
                TypeError("argument of type 'NoneType' is not iterable"),
                "no candidate batch size has any valid GPU count in "
                f"[min_gpus, max_gpus] = [{config.min_gpus}, {config.max_gpus}]",
            )
        if world_size not in valid_gpus:
            raise ElasticityIncompatibleWorldSize(
                f"World size ({world_size}) is not valid with the current list of "
                f"valid GPU counts: {valid_gpus}"
            )
        micro = _largest_dividing_microbatch(
            config.micro_batches, final_batch_size, world_size
        )
        return final_batch_size, valid_gpus, micro
    if return_microbatch:
        if float(config.version) == 0.2:
            return final_batch_size, valid_gpus, candidate_micro
        try:
            micro = _largest_dividing_microbatch(
                config.micro_batches, final_batch_size, world_size
            )
        except ZeroDivisionError as error:
            raise _noted(
                error,
                "elasticity v0.1 needs world_size > 0 to choose a micro-batch size "
                "(return_microbatch=True)",
            ) from None
        return final_batch_size, valid_gpus, micro
    return final_batch_size, valid_gpus
