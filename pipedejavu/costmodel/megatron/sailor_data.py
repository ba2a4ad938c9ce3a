"""Readers for per-layer GPU profiles, model sizes, link fits and GPU specs.

The layout is the Sailor planner's (github.com/eth-easl/sailor, MIT; a copy ships
in ``pipedejavu/data/sailor`` with its attribution)::

    DIR/profiles/<MODEL>/<GPU>/profile.json   profile[mbs][tp][layer] = [fwd, bwd, upd]
    DIR/llm_info.json                         llm_info[model][tp][layer] = {...}
    DIR/network/multizone_bandwidths_het.json inter-node link fits
    DIR/network/intra_node_bandwidths.json    intra-node link fits
    DIR/network/network_coeffs_all_homo.json  fallback fits per GPU type
    DIR/configs/basic_cluster_config.json     GPUs per node, memory per GPU

Units: seconds, bytes, and floats (fp32 elements) where the files count floats.
Every file is JSON, read with a size limit, checked for shape and finite
non-negative numbers, and any problem is a :class:`ProblemError` naming the file.
Nothing here reads a measured run (``measured/``): see
:mod:`pipedejavu.costmodel.megatron.fit` for that.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pipedejavu.core.files import read_json
from pipedejavu.core.layout import MAX_GPUS
from pipedejavu.core.memory_headroom import MemoryHeadroom
from pipedejavu.core.plan3d import MAX_GLOBAL_BATCH
from pipedejavu.core.problem import ProblemError
from pipedejavu.core.training_options import TrainingOptions
from pipedejavu.costmodel.megatron.profile_types import (
    FIT_LOG2_MB_RANGE,
    BandwidthFit,
    GpuSpec,
    LayerTimes,
    ModelInfo,
    with_memory_headroom,
)

__all__ = [
    "FIT_LOG2_MB_RANGE",
    "BandwidthFit",
    "GpuSpec",
    "LayerTimes",
    "ModelInfo",
    "NetworkTables",
    "SailorData",
    "bundled_sailor_dir",
    "load_sailor_data",
    "smooth_profile",
]

MAX_DATA_FILE_BYTES = 64 * 2**20


def bundled_sailor_dir() -> Path:
    """The copy of Sailor's data shipped inside the package."""
    return Path(str(importlib.resources.files("pipedejavu") / "data" / "sailor"))


def _read_json(path: Path) -> Any:
    return read_json(path, MAX_DATA_FILE_BYTES, "data file")


def _number(value: Any, path: Path, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProblemError(f"{path}: {where} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ProblemError(f"{path}: {where} must be finite and >= 0, got {value}")
    return value


def _key(text: str, limit: int) -> int:
    """A JSON key that names a count: ASCII digits only (``int`` also takes
    ``" 1"`` and ``"1_0"``, which then name no entry), at most ``limit``.

    Raises:
        ValueError: anything else.
    """
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise ValueError(text)
    value = int(text)
    if value > limit or str(value) != text:
        raise ValueError(text)
    return value


def _layer_vector(table: Any, path: Path, where: str, pick) -> NDArray[np.float64]:
    """``table`` maps ``"0".."n-1"`` to entries; returns f64[n] of ``pick(entry)``."""
    if not isinstance(table, dict) or not table:
        raise ProblemError(f"{path}: {where} must map layer indices to entries")
    try:
        keys = sorted(_key(k, len(table) - 1) for k in table)
    except ValueError:
        raise ProblemError(
            f"{path}: {where} has a layer key that is not one of 0..{len(table) - 1}"
        ) from None
    if keys != list(range(len(keys))):
        raise ProblemError(f"{path}: {where} layers must be 0..n-1, got {keys[:5]}...")
    return np.array(
        [pick(table[str(k)], f"{where} layer {k}") for k in keys], dtype=np.float64
    )


def _fit(entry: Any, path: Path, where: str) -> BandwidthFit:
    if not (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], list)
        and len(entry[0]) == 3
    ):
        raise ProblemError(f"{path}: {where} must be [[a, b, c], max_bandwidth]")
    coeffs = []
    for value in entry[0]:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProblemError(f"{path}: {where} has a non-numeric coefficient")
        if not math.isfinite(value):
            raise ProblemError(f"{path}: {where} has a non-finite coefficient")
        coeffs.append(float(value))
    peak = _number(entry[1], path, where + " max bandwidth")
    if peak <= 0:
        raise ProblemError(f"{path}: {where} max bandwidth must be > 0")
    return BandwidthFit(tuple(coeffs), peak)


class NetworkTables:
    """Fitted links between and inside nodes.

    ``inter(zone_a, gpu_a, zone_b, gpu_b, n)``: a node of ``gpu_a`` and one of
    ``gpu_b`` with ``n`` GPUs on each side sending at once; the fit gives their
    *aggregate* bandwidth (Sailor measured ``n`` concurrent pairs). ``intra(gpu,
    n)``: ``n`` GPUs inside one node, ``n / 2`` concurrent pairs, aggregate.
    ``n`` is rounded up to the next key the tables hold (down when above them)."""

    def __init__(self, directory: Path) -> None:
        net = directory / "network"
        het_path = net / "multizone_bandwidths_het.json"
        homo_path = net / "network_coeffs_all_homo.json"
        intra_path = net / "intra_node_bandwidths.json"
        het = _read_json(het_path) if het_path.exists() else {}
        homo = _read_json(homo_path) if homo_path.exists() else {}
        intra = _read_json(intra_path) if intra_path.exists() else {}
        self._set(het, homo, intra, (het_path, homo_path, intra_path))

    def _set(self, het: Any, homo: Any, intra: Any, paths: tuple) -> None:
        self._paths = paths
        if not isinstance(het, dict) or not isinstance(homo, dict):
            raise ProblemError(f"{paths[0]}: expected a JSON object")
        self._het = het
        self._homo_inter = homo.get("inter", {})
        given = isinstance(intra, dict) and intra
        self._intra = intra if given else homo.get("intra", {})

    @classmethod
    def from_tables(cls, tables: Any, source: str) -> NetworkTables:
        """Tables as :meth:`tables` gives them (a calibration file keeps them;
        ``source`` names it in every error).

        Raises:
            ProblemError: not the three tables (one line naming ``source``).
        """
        if not isinstance(tables, dict) or set(tables) != {"het", "homo", "intra"}:
            raise ProblemError(f"{source}: links must hold het, homo and intra")
        out = cls.__new__(cls)
        path = Path(source)
        out._set(tables["het"], tables["homo"], tables["intra"], (path,) * 3)
        return out

    def tables(self) -> dict[str, Any]:
        """The fits as read: ``{"het", "homo", "intra"}`` (for
        :meth:`from_tables`)."""
        homo = {"inter": self._homo_inter}
        return {"het": self._het, "homo": homo, "intra": self._intra}

    @staticmethod
    def _nearest(table: Any, n: int, path: Path, where: str) -> Any:
        if not isinstance(table, dict) or not table:
            raise ProblemError(f"{path}: no link fits for {where}")
        try:
            keys = sorted(_key(k, MAX_GPUS) for k in table)
        except ValueError:
            raise ProblemError(
                f"{path}: {where} has a GPU count that is not an integer up to "
                f"{MAX_GPUS}"
            ) from None
        above = [k for k in keys if k >= n]
        return table[str(above[0] if above else keys[-1])]

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - the tables live as long as self
    def inter(self, zone_a: str, gpu_a: str, zone_b: str, gpu_b: str, n: int):
        """The inter-node :class:`BandwidthFit` (see the class docstring)."""
        het_path, homo_path, _ = self._paths
        side = self._het.get(zone_a, {}).get(gpu_a)
        if isinstance(side, dict) and side:
            mine = self._nearest(side, n, het_path, f"{zone_a}/{gpu_a}")
            other = mine.get(zone_b, {}).get(gpu_b) if isinstance(mine, dict) else None
            if isinstance(other, dict) and other:
                entry = self._nearest(other, n, het_path, f"{gpu_a}->{gpu_b}")
                return _fit(entry, het_path, f"{zone_a}/{gpu_a}->{zone_b}/{gpu_b}")
        if gpu_a == gpu_b and zone_a == zone_b and gpu_a in self._homo_inter:
            entry = self._nearest(self._homo_inter[gpu_a], n, homo_path, gpu_a)
            return _fit(entry, homo_path, f"inter {gpu_a}")
        raise ProblemError(
            f"{het_path}: no link fit between {gpu_a} ({zone_a}) and {gpu_b} ({zone_b})"
        )

    def intra_sizes(self, gpu: str) -> tuple[int, ...]:
        """The GPUs of a node the intra-node fits of ``gpu`` hold (or none).

        Raises:
            ProblemError: a key that is not a GPU count.
        """
        table = self._intra.get(gpu, {})
        try:
            return tuple(sorted(_key(k, MAX_GPUS) for k in table))
        except (ValueError, TypeError):
            raise ProblemError(
                f"{self._paths[2]}: {gpu} has a GPU count that is not an integer "
                f"up to {MAX_GPUS}"
            ) from None

    @functools.lru_cache(maxsize=1024)  # noqa: B019
    def intra(self, gpu: str, n: int) -> BandwidthFit:
        """The intra-node :class:`BandwidthFit` for ``n`` GPUs of a ``gpu`` node."""
        _, _, intra_path = self._paths
        if gpu not in self._intra:
            raise ProblemError(f"{intra_path}: no intra-node link fit for {gpu}")
        entry = self._nearest(self._intra[gpu], max(n, 2), intra_path, gpu)
        return _fit(entry, intra_path, f"intra {gpu}")


class SailorData:
    """A folder laid out like Sailor's data (module docstring), read lazily.

    Args:
        directory: the folder; ``None`` = the bundled copy.
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        root = bundled_sailor_dir() if directory is None else Path(directory)
        if not root.is_dir():
            raise ProblemError(f"profiles directory {root} does not exist")
        self.root = root
        self._profiles: dict[tuple[str, str], dict[tuple[int, int], LayerTimes]] = {}
        self._smoothed: dict[tuple[str, str, str], dict] = {}
        self._infos: dict[str, ModelInfo] = {}
        self._llm_info: Any = None
        self._network: NetworkTables | None = None
        self._gpus: dict[str, GpuSpec] | None = None
        self.memory_headroom: MemoryHeadroom | None = None

    def with_memory_headroom(self, headroom: MemoryHeadroom | None) -> SailorData:
        """These profiles with ``headroom`` kept free on every GPU
        (:meth:`gpu_spec`; the parsed files are shared)."""
        return with_memory_headroom(self, headroom)

    # ----------------------------------------------------------------- lists
    def models(self) -> tuple[str, ...]:
        folder = self.root / "profiles"
        if not folder.is_dir():
            return ()
        return tuple(sorted(p.name for p in folder.iterdir() if p.is_dir()))

    def gpu_types(self, model: str) -> tuple[str, ...]:
        """GPU types with a profile for ``model``."""
        folder = self.root / "profiles" / model
        if not folder.is_dir():
            raise ProblemError(
                f"no profiles for model {model!r} under {self.root / 'profiles'} "
                f"(models: {', '.join(self.models()) or 'none'})"
            )
        return tuple(
            sorted(p.name for p in folder.iterdir() if (p / "profile.json").is_file())
        )

    # -------------------------------------------------------------- profiles
    def profile(self, model: str, gpu: str) -> dict[tuple[int, int], LayerTimes]:
        """``{(mbs, tp): LayerTimes}`` for one model on one GPU type."""
        key = (model, gpu)
        if key not in self._profiles:
            if gpu not in self.gpu_types(model):
                raise ProblemError(
                    f"no profile of model {model} on GPU type {gpu!r} (have: "
                    f"{', '.join(self.gpu_types(model))})"
                )
            path = self.root / "profiles" / model / gpu / "profile.json"
            self._profiles[key] = _parse_profile(_read_json(path), path)
        return self._profiles[key]

    def layer_times(
        self, model: str, gpu: str, mbs: int, tp: int, *, smooth: bool = False
    ) -> LayerTimes:
        """The profile entry, or a :class:`ProblemError` listing what exists.

        With ``smooth``, the entry of :func:`smooth_profile` (affine in mbs).
        """
        table = self.profile(model, gpu)
        if smooth:
            key = (model, gpu, "smooth")
            if key not in self._smoothed:
                self._smoothed[key] = smooth_profile(table)
            table = self._smoothed[key]
        if (mbs, tp) not in table:
            have = ", ".join(f"({m}, {t})" for m, t in sorted(table))
            raise ProblemError(
                f"the {gpu} profile of {model} has no entry for mbs {mbs}, tp {tp} "
                f"(it has (mbs, tp) = {have})"
            )
        return table[(mbs, tp)]

    # ------------------------------------------------------------ llm_info
    def model_info(self, model: str) -> ModelInfo:
        if model not in self._infos:
            path = self.root / "llm_info.json"
            if self._llm_info is None:
                self._llm_info = _read_json(path)
                if not isinstance(self._llm_info, dict):
                    raise ProblemError(f"{path}: expected a JSON object")
            if model not in self._llm_info:
                raise ProblemError(
                    f"{path} has no model {model!r} (has: "
                    f"{', '.join(sorted(self._llm_info))})"
                )
            self._infos[model] = _parse_info(model, self._llm_info[model], path)
        return self._infos[model]

    @property
    def options(self) -> TrainingOptions:
        """The training the profiles describe: Sailor's fp32 Megatron-DeepSpeed
        runs (no recomputation, no interleaving, unfused attention)."""
        return TrainingOptions(flash_attention=False)

    # ------------------------------------------------------- network, GPUs
    @property
    def network(self) -> NetworkTables:
        if self._network is None:
            self._network = NetworkTables(self.root)
        return self._network

    def gpu_spec(self, gpu: str) -> GpuSpec:
        if self._gpus is None:
            path = self.root / "configs" / "basic_cluster_config.json"
            data = _read_json(path)
            if not isinstance(data, dict):
                raise ProblemError(f"{path}: expected a JSON object")
            specs = {}
            for name, entry in data.items():
                if not isinstance(entry, dict):
                    continue  # e.g. "zone"
                per_node = entry.get("gpus_per_node")
                memory = entry.get("mem_per_gpu")
                if isinstance(per_node, bool) or not isinstance(per_node, int):
                    raise ProblemError(f"{path}: {name}.gpus_per_node must be an int")
                specs[name] = GpuSpec(
                    name, per_node, _number(memory, path, f"{name}.mem_per_gpu")
                )
            self._gpus = specs
        if gpu not in self._gpus:
            raise ProblemError(
                f"{self.root / 'configs'}: unknown GPU type {gpu!r} (known: "
                f"{', '.join(sorted(self._gpus))})"
            )
        return self._gpus[gpu].with_headroom(self.memory_headroom)


def _parse_profile(data: Any, path: Path) -> dict[tuple[int, int], LayerTimes]:
    if not isinstance(data, dict) or not data:
        raise ProblemError(f"{path}: expected profile[mbs][tp][layer]")
    table = {}
    lengths = set()

    def triple(entry: Any, where: str) -> tuple[float, float, float]:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ProblemError(f"{path}: {where} must be [forward, backward, update]")
        return tuple(_number(v, path, where) for v in entry)

    for mbs_key, per_tp in data.items():
        if not isinstance(per_tp, dict):
            raise ProblemError(f"{path}: profile[{mbs_key!r}] must be an object")
        for tp_key, layers in per_tp.items():
            try:
                key = (_key(mbs_key, MAX_GLOBAL_BATCH), _key(tp_key, MAX_GPUS))
            except ValueError:
                raise ProblemError(
                    f"{path}: mbs and tp keys must be integers up to "
                    f"{MAX_GLOBAL_BATCH} and {MAX_GPUS}, got "
                    f"{mbs_key[:20]!r}/{tp_key[:20]!r}"
                ) from None
            if key[0] < 1 or key[1] < 1:
                raise ProblemError(f"{path}: mbs and tp must be >= 1, got {key}")
            where = f"mbs {key[0]} tp {key[1]}"
            rows = _layer_vector(layers, path, where, lambda e, w: triple(e, w))
            lengths.add(rows.shape[0])
            table[key] = LayerTimes(
                forward=rows[:, 0].copy(),
                backward=rows[:, 1].copy(),
                update=rows[:, 2].copy(),
            )
    if len(lengths) != 1:
        raise ProblemError(f"{path}: entries disagree on the number of layers")
    for entry in table.values():
        for array in (entry.forward, entry.backward, entry.update):
            array.setflags(write=False)
    return table


def _affine_fit(mbs: NDArray[np.float64], times: NDArray[np.float64]):
    """``times ~ a + b * mbs`` with ``a, b >= 0``, least squares on relative error;
    returns the fitted times (zeros stay zeros)."""
    positive = times > 0
    if positive.sum() < 3:
        return times.copy()
    weights = 1.0 / times[positive]
    design = np.stack([weights, mbs[positive] * weights], axis=1)
    target = np.ones(int(positive.sum()))
    # Two variables: the unconstrained solution, else the best one-sided one.
    (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
    if a < 0 or b < 0:
        options = []
        for column in (0, 1):
            x = design[:, column]
            value = max(float(x @ target) / float(x @ x), 0.0)
            coefficients = [0.0, 0.0]
            coefficients[column] = value
            options.append((float(np.sum((x * value - target) ** 2)), coefficients))
        a, b = min(options)[1]
    fitted = a + b * mbs
    return np.where(positive, fitted, times)


def smooth_profile(
    table: Mapping[tuple[int, int], LayerTimes],
) -> dict[tuple[int, int], LayerTimes]:
    """The profile with forward and backward times affine in mbs.

    A layer's time on a micro-batch is a fixed cost plus a cost per sample, so
    for every (tp, layer) the forward and the backward times over the profiled
    mbs values are fitted as ``a + b * mbs`` (``a, b >= 0``; least squares on
    relative error, so that small and large mbs weigh alike) and the fit replaces
    the entries. This removes the noise of single entries at small mbs (e.g.
    GH-96 at tp 4: mbs 1 profiled slower than mbs 2). A (tp, layer) with fewer
    than three profiled mbs keeps its entries. ``update`` becomes the median
    over mbs of that tp (the optimizer does not depend on mbs).
    """
    out: dict[tuple[int, int], LayerTimes] = {}
    for tp in sorted({t for _, t in table}):
        sizes = sorted(m for m, t in table if t == tp)
        mbs = np.array(sizes, dtype=np.float64)
        forward = np.stack([table[(m, tp)].forward for m in sizes])
        backward = np.stack([table[(m, tp)].backward for m in sizes])
        update = float(np.median([table[(m, tp)].update[0] for m in sizes]))
        for array in (forward, backward):
            for layer in range(array.shape[1]):
                array[:, layer] = _affine_fit(mbs, array[:, layer])
        for row, m in enumerate(sizes):
            entry = LayerTimes(
                forward=forward[row].copy(),
                backward=backward[row].copy(),
                update=np.full(forward.shape[1], update),
            )
            for array in (entry.forward, entry.backward, entry.update):
                array.setflags(write=False)
            out[(m, tp)] = entry
    return out


_INFO_FIELDS = ("params_floats", "act_output_floats", "act_mem_floats")


def _parse_info(model: str, data: Any, path: Path) -> ModelInfo:
    if not isinstance(data, dict) or not data:
        raise ProblemError(f"{path}: {model} must map tp to layers")
    fields: dict[str, dict[int, NDArray[np.float64]]] = {f: {} for f in _INFO_FIELDS}
    for tp_key, layers in data.items():
        try:
            tp = int(tp_key)
        except ValueError:
            raise ProblemError(f"{path}: {model} tp key {tp_key!r}") from None
        for field in _INFO_FIELDS:

            def pick(entry: Any, where: str, field=field) -> float:
                if not isinstance(entry, dict) or field not in entry:
                    raise ProblemError(f"{path}: {model} {where} lacks {field}")
                return _number(entry[field], path, f"{model} {where} {field}")

            vector = _layer_vector(layers, path, f"{model} tp {tp}", pick)
            vector.setflags(write=False)
            fields[field][tp] = vector
    if len({v.shape for v in fields["params_floats"].values()}) != 1:
        raise ProblemError(f"{path}: {model} tp entries disagree on the layer count")
    return ModelInfo(
        name=model,
        params=fields["params_floats"],
        act_output=fields["act_output_floats"],
        act_mem=fields["act_mem_floats"],
    )


@functools.lru_cache(maxsize=8)
def _cached(directory: str | None) -> SailorData:
    return SailorData(directory)


def load_sailor_data(directory: str | os.PathLike | None = None) -> SailorData:
    """A :class:`SailorData` for ``directory`` (``None``: the bundled copy),
    cached per path."""
    return _cached(None if directory is None else str(Path(directory).resolve()))
