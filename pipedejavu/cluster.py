"""A cluster description: hosts of typed devices and the links between them.

Alpa treats a cluster as ``num_hosts x devices_per_host`` identical devices with
free links. This module says what the devices are and what moving bytes costs:

* every host holds ``devices_per_host`` devices of one :class:`DeviceType`
  (a relative ``speed``: stage latency on it is the reference latency divided by
  ``speed``; and ``memory_bytes`` per device, informative);
* a :class:`Link` per device type for transfers inside a host, and one per pair
  of types for transfers between hosts (symmetric);
* ``Cluster.homogeneous(H, D)`` is the ``HxD`` shorthand, with free links.

Files: JSON, or TOML on Python >= 3.11 (``Cluster.from_file``)::

    {"devices_per_host": 8,
     "device_types": {"a100": {"speed": 1.0, "memory_gb": 40},
                      "v100": {"speed": 0.5, "memory_gb": 16}},
     "hosts": ["a100", "a100", "v100", "v100"],
     "intra_host": {"a100": {"latency_us": 5, "bandwidth_gbps": 1200},
                    "v100": {"latency_us": 5, "bandwidth_gbps": 800}},
     "inter_host": {"default": {"latency_us": 20, "bandwidth_gbps": 100},
                    "a100-v100": {"latency_us": 30, "bandwidth_gbps": 50}}}

Bandwidths are in gigabits per second in files (``bandwidth_gbps``, what network
specs quote) and bytes per second in Python; latencies in microseconds in files
and seconds in Python. Units inside the library: seconds and bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .problem import ProblemError

__all__ = ["Cluster", "DeviceType", "Link", "FREE_LINK"]


@dataclasses.dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator.

    Args:
        name: a label, e.g. ``"a100"``.
        speed: throughput relative to the device the tables were profiled on
            (> 0); a stage runs ``1 / speed`` times as long.
        memory_bytes: memory per device in bytes (``None`` = as profiled).
    """

    name: str
    speed: float = 1.0
    memory_bytes: float | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ProblemError(
                f"device type name must be a non-empty string, got {self.name!r}"
            )
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ProblemError(
                f"device type {self.name!r}: speed must be finite and > 0, "
                f"got {self.speed}"
            )
        if self.memory_bytes is not None and not self.memory_bytes > 0:
            raise ProblemError(
                f"device type {self.name!r}: memory_bytes must be > 0, "
                f"got {self.memory_bytes}"
            )


@dataclasses.dataclass(frozen=True)
class Link:
    """A link: ``time(n) = latency_s + n / bandwidth`` seconds for ``n`` bytes.

    Args:
        latency_s: per-message latency in seconds (>= 0).
        bandwidth: bytes per second (> 0; ``inf`` = free).
    """

    latency_s: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ProblemError(
                f"link latency must be finite and >= 0, got {self.latency_s}"
            )
        if not self.bandwidth > 0:
            raise ProblemError(f"link bandwidth must be > 0, got {self.bandwidth}")

    def time(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` bytes in one message."""
        return self.latency_s + num_bytes / self.bandwidth

    def to_json(self) -> dict[str, float]:
        """SI keys (exact round trip); a free bandwidth is left out."""
        data = {"latency_s": self.latency_s}
        if math.isfinite(self.bandwidth):
            data["bandwidth_bytes_per_s"] = self.bandwidth
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> Link:
        """Keys: ``latency_us`` or ``latency_s``; ``bandwidth_gbps`` (gigabits
        per second) or ``bandwidth_bytes_per_s``; absent = 0 / free."""
        if not isinstance(data, Mapping):
            raise ProblemError(f"{where}: a link must be an object, got {data!r}")
        keys = {"latency_us", "latency_s", "bandwidth_gbps", "bandwidth_bytes_per_s"}
        unknown = set(data) - keys
        if unknown:
            raise ProblemError(f"{where}: unknown keys {sorted(unknown)}")
        if {"latency_us", "latency_s"} <= set(data) or {
            "bandwidth_gbps",
            "bandwidth_bytes_per_s",
        } <= set(data):
            raise ProblemError(f"{where}: give each quantity in one unit only")
        try:
            if "latency_s" in data:
                latency = float(data["latency_s"])
            else:
                latency = float(data.get("latency_us", 0.0)) / 1e6
            if "bandwidth_bytes_per_s" in data:
                bandwidth = float(data["bandwidth_bytes_per_s"])
            else:
                bandwidth = float(data.get("bandwidth_gbps", math.inf)) * 1e9 / 8
        except (TypeError, ValueError) as error:
            raise ProblemError(f"{where}: {error}") from None
        return cls(latency_s=latency, bandwidth=bandwidth)


#: A link that costs nothing (Alpa's assumption).
FREE_LINK = Link()


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Hosts of typed devices and the links between them.

    Args:
        device_types: the T kinds of device.
        host_types: for each host, the index of its device type (length H).
        devices_per_host: devices on every host.
        intra_host: one :class:`Link` per device type (transfers inside a host).
        inter_host: ``T x T`` links between hosts by their types (symmetric).
    """

    device_types: tuple[DeviceType, ...]
    host_types: tuple[int, ...]
    devices_per_host: int
    intra_host: tuple[Link, ...]
    inter_host: tuple[tuple[Link, ...], ...]

    def __post_init__(self) -> None:
        num_types = len(self.device_types)
        if num_types == 0:
            raise ProblemError("a cluster needs at least one device type")
        names = [t.name for t in self.device_types]
        if len(set(names)) != len(names):
            raise ProblemError(f"device type names must be unique, got {names}")
        if not self.host_types:
            raise ProblemError("a cluster needs at least one host")
        if any(not 0 <= t < num_types for t in self.host_types):
            raise ProblemError(
                f"host_types must index device_types (0..{num_types - 1}), "
                f"got {list(self.host_types)}"
            )
        if not (isinstance(self.devices_per_host, int) and self.devices_per_host >= 1):
            raise ProblemError(
                "devices_per_host must be an integer >= 1, "
                f"got {self.devices_per_host!r}"
            )
        if len(self.intra_host) != num_types:
            raise ProblemError(
                f"intra_host needs one link per device type ({num_types}), "
                f"got {len(self.intra_host)}"
            )
        if len(self.inter_host) != num_types or any(
            len(row) != num_types for row in self.inter_host
        ):
            raise ProblemError(f"inter_host must be a {num_types}x{num_types} matrix")
        for a in range(num_types):
            for b in range(num_types):
                if self.inter_host[a][b] != self.inter_host[b][a]:
                    raise ProblemError(
                        f"inter_host must be symmetric: {names[a]}-{names[b]} differs "
                        f"from {names[b]}-{names[a]}"
                    )

    # ------------------------------------------------------------------ shapes
    @property
    def num_hosts(self) -> int:
        return len(self.host_types)

    @property
    def num_types(self) -> int:
        return len(self.device_types)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    @property
    def shape(self) -> tuple[int, int]:
        """``(num_hosts, devices_per_host)``, Alpa's cluster shape."""
        return (self.num_hosts, self.devices_per_host)

    def hosts_of_type(self, device_type: int) -> tuple[int, ...]:
        """Host indices holding ``device_type``, in order."""
        return tuple(h for h, t in enumerate(self.host_types) if t == device_type)

    def devices_of_type(self) -> tuple[int, ...]:
        """Number of devices of each type."""
        return tuple(
            len(self.hosts_of_type(t)) * self.devices_per_host
            for t in range(self.num_types)
        )

    @property
    def speeds(self) -> tuple[float, ...]:
        return tuple(t.speed for t in self.device_types)

    def link(self, host_a: int, host_b: int) -> Link:
        """The link between two hosts (the intra-host link when they are one)."""
        type_a, type_b = self.host_types[host_a], self.host_types[host_b]
        if host_a == host_b:
            return self.intra_host[type_a]
        return self.inter_host[type_a][type_b]

    # ------------------------------------------------------------ constructors
    @classmethod
    def homogeneous(
        cls,
        num_hosts: int,
        devices_per_host: int,
        *,
        intra_host: Link = FREE_LINK,
        inter_host: Link = FREE_LINK,
        name: str = "device",
    ) -> Cluster:
        """Alpa's ``HxD`` cluster: one device type (speed 1), by default free links."""
        if not (isinstance(num_hosts, int) and num_hosts >= 1):
            raise ProblemError(f"num_hosts must be an integer >= 1, got {num_hosts!r}")
        return cls(
            device_types=(DeviceType(name),),
            host_types=(0,) * num_hosts,
            devices_per_host=devices_per_host,
            intra_host=(intra_host,),
            inter_host=((inter_host,),),
        )

    @classmethod
    def from_types(
        cls,
        device_types: Sequence[DeviceType],
        hosts: Sequence[str | int],
        devices_per_host: int,
        *,
        intra_host: Mapping[str, Link] | Link = FREE_LINK,
        inter_host: Mapping[str, Link] | Link = FREE_LINK,
    ) -> Cluster:
        """Build from names: ``hosts`` lists each host's type name (or index).

        ``intra_host`` maps a type name to its link (or one link for all);
        ``inter_host`` maps ``"a-b"`` pairs (and ``"default"``) to links.
        """
        names = [t.name for t in device_types]
        index = {n: i for i, n in enumerate(names)}

        def type_index(host: str | int) -> int:
            if isinstance(host, str):
                if host not in index:
                    raise ProblemError(f"host type {host!r} is not one of {names}")
                return index[host]
            return int(host)

        num_types = len(names)
        if isinstance(intra_host, Link):
            intra = (intra_host,) * num_types
        else:
            unknown = set(intra_host) - set(names) - {"default"}
            if unknown:
                raise ProblemError(f"intra_host names unknown types {sorted(unknown)}")
            default = intra_host.get("default", FREE_LINK)
            intra = tuple(intra_host.get(n, default) for n in names)
        if isinstance(inter_host, Link):
            inter = tuple((inter_host,) * num_types for _ in range(num_types))
        else:
            default = inter_host.get("default", FREE_LINK)
            matrix = [[default] * num_types for _ in range(num_types)]
            for key, link in inter_host.items():
                if key == "default":
                    continue
                parts = key.split("-")
                if len(parts) != 2 or any(p not in index for p in parts):
                    raise ProblemError(
                        f"inter_host key {key!r} must be 'default' or 'a-b' with a, b "
                        f"in {names}"
                    )
                a, b = index[parts[0]], index[parts[1]]
                matrix[a][b] = matrix[b][a] = link
            inter = tuple(tuple(row) for row in matrix)
        return cls(
            device_types=tuple(device_types),
            host_types=tuple(type_index(h) for h in hosts),
            devices_per_host=devices_per_host,
            intra_host=intra,
            inter_host=inter,
        )

    # -------------------------------------------------------------------- files
    def to_json(self) -> dict[str, Any]:
        names = [t.name for t in self.device_types]
        types = {}
        for t in self.device_types:
            entry: dict[str, Any] = {"speed": t.speed}
            if t.memory_bytes is not None:
                entry["memory_bytes"] = t.memory_bytes
            types[t.name] = entry
        inter = {}
        for a in range(self.num_types):
            for b in range(a, self.num_types):
                inter[f"{names[a]}-{names[b]}"] = self.inter_host[a][b].to_json()
        return {
            "devices_per_host": self.devices_per_host,
            "device_types": types,
            "hosts": [names[t] for t in self.host_types],
            "intra_host": {
                n: link.to_json()
                for n, link in zip(names, self.intra_host, strict=True)
            },
            "inter_host": inter,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cluster:
        if not isinstance(data, Mapping):
            raise ProblemError(
                f"a cluster must be a JSON object, got {type(data).__name__}"
            )
        unknown = set(data) - {
            "devices_per_host",
            "device_types",
            "hosts",
            "intra_host",
            "inter_host",
        }
        if unknown:
            raise ProblemError(f"cluster: unknown keys {sorted(unknown)}")
        for key in ("devices_per_host", "device_types", "hosts"):
            if key not in data:
                raise ProblemError(f"cluster: missing key {key!r}")
        types = []
        if not isinstance(data["device_types"], Mapping):
            raise ProblemError("cluster: device_types must map names to objects")
        for name, entry in data["device_types"].items():
            if not isinstance(entry, Mapping):
                raise ProblemError(
                    f"device type {name!r} must be an object like "
                    f'{{"speed": 1.0, "memory_gb": 40}}, got {entry!r}'
                )
            extra = set(entry) - {"speed", "memory_gb", "memory_bytes"}
            if extra:
                raise ProblemError(
                    f"device type {name!r}: unknown keys {sorted(extra)}"
                )
            if {"memory_gb", "memory_bytes"} <= set(entry):
                raise ProblemError(f"device type {name!r}: give memory in one unit")
            try:
                memory = entry.get("memory_bytes")
                if memory is None and entry.get("memory_gb") is not None:
                    memory = float(entry["memory_gb"]) * 1e9
                speed = float(entry.get("speed", 1.0))
            except (TypeError, ValueError) as error:
                raise ProblemError(f"device type {name!r}: {error}") from None
            types.append(
                DeviceType(
                    name=str(name),
                    speed=speed,
                    memory_bytes=None if memory is None else float(memory),
                )
            )
        intra = {
            str(k): Link.from_json(v, f"intra_host[{k!r}]")
            for k, v in dict(data.get("intra_host", {})).items()
        }
        inter = {
            str(k): Link.from_json(v, f"inter_host[{k!r}]")
            for k, v in dict(data.get("inter_host", {})).items()
        }
        dph = data["devices_per_host"]
        if isinstance(dph, bool) or not isinstance(dph, int):
            raise ProblemError(f"devices_per_host must be an integer, got {dph!r}")
        return cls.from_types(
            types, list(data["hosts"]), dph, intra_host=intra, inter_host=inter
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Cluster:
        """Read a ``.json`` or ``.toml`` cluster file (format in the module doc)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise ProblemError(f"cannot read cluster file {path}: {error}") from None
        if path.suffix.lower() == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ProblemError("TOML cluster files need Python >= 3.11") from None
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as error:
                raise ProblemError(f"{path}: invalid TOML: {error}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise ProblemError(f"{path}: invalid JSON: {error}") from None
        return cls.from_json(data)

    def describe(self) -> str:
        """One line, e.g. ``2x8 a100 (speed 1) + 2x8 v100 (speed 0.5)``."""
        parts = []
        for t, kind in enumerate(self.device_types):
            hosts = len(self.hosts_of_type(t))
            if hosts:
                shape = f"{hosts}x{self.devices_per_host}"
                parts.append(f"{shape} {kind.name} (speed {kind.speed:g})")
        return " + ".join(parts)
