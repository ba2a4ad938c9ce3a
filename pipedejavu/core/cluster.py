"""A cluster description: hosts of typed devices and the links between them.

Alpa treats a cluster as ``num_hosts x devices_per_host`` identical devices with
free links. This module says what the devices are and what moving bytes costs:

* every host holds ``devices_per_host`` devices of one :class:`DeviceType`
  (a relative ``speed``: stage latency on it is the reference latency divided by
  ``speed``; and ``memory_bytes`` per device, which
  :mod:`pipedejavu.costmodel.stage.hetero_generate` sizes each type's memory limits
  with; a
  problem read from a file carries its own profiled memory rule instead);
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

A file must describe every link the cluster has (:meth:`Cluster.from_types`):
inside every host type, and between the types of any two hosts (``"default"``
covers the pairs not named). A link left out is an error, never free; a free
link is written ``"bandwidth_gbps": "inf"``. Every number has a documented
range (:data:`~pipedejavu.core.validation.CLUSTER_RANGES`): ``speed`` in
[1e-6, 1e6]; ``memory_gb`` in [1e-6, 1e6] (``memory_bytes`` in [1e3, 1e15]);
``latency_us`` in [0, 3.6e9] (``latency_s`` in [0, 3600]); ``bandwidth_gbps``
in [1e-9, 1e10] (``bandwidth_bytes_per_s`` in [1e-3, 1e18]) or ``"inf"``;
``devices_per_host`` and the number of hosts in [1, 2**20], at most 2**20
devices in all. Errors name the key, the range with its unit and the value as
the file gave it (``inter_host['default'].bandwidth_gbps must be in [1e-9,
1e10] or "inf" (gigabits per second), got -5``). Files are untrusted: larger than
:data:`MAX_CLUSTER_FILE_BYTES`, not UTF-8, or nested too deeply, they are
refused with a :class:`~pipedejavu.core.errors.ProblemError` naming the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipedejavu.core.errors import ProblemError
from pipedejavu.core.files import parse_json, parse_toml, read_text
from pipedejavu.core.validation import MAX_DEVICES, as_number, in_range

__all__ = ["Cluster", "DeviceType", "FREE_LINK", "Link", "parse_json"]


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
        where = f"device type {self.name!r}:"
        in_range(self.speed, f"{where} speed", "speed", self.speed)
        if self.memory_bytes is not None:
            memory = self.memory_bytes
            in_range(memory, f"{where} memory_bytes", "memory_bytes", memory)


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
        in_range(self.latency_s, "link latency_s", "latency_s", self.latency_s)
        bandwidth = self.bandwidth
        in_range(
            bandwidth,
            "link bandwidth",
            "bandwidth_bytes_per_s",
            bandwidth,
            allow_inf=True,
        )

    def time(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` bytes in one message."""
        return self.latency_s + num_bytes / self.bandwidth

    def to_json(self) -> dict[str, Any]:
        """SI keys (exact round trip); a free bandwidth is written ``"inf"``."""
        bandwidth = self.bandwidth if math.isfinite(self.bandwidth) else "inf"
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": bandwidth}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> Link:
        """A link described in a file, in one unit per quantity:

        * latency: ``latency_us`` (microseconds, in [0, 3.6e9]) or
          ``latency_s`` (in [0, 3600]);
        * bandwidth: ``bandwidth_gbps`` (gigabits per second, in [1e-9, 1e10])
          or ``bandwidth_bytes_per_s`` (in [1e-3, 1e18]); the text ``"inf"``
          for a free link.

        Both are required: a link the file does not describe is an error, never
        free by default.

        Raises:
            ProblemError: naming ``where``, the key, its unit and the value.
        """
        if not isinstance(data, Mapping):
            raise ProblemError(
                f"{where}: a link must be an object like "
                f'{{"latency_us": 5, "bandwidth_gbps": 100}}, got {data!r:.60}'
            )
        keys = {"latency_us", "latency_s", "bandwidth_gbps", "bandwidth_bytes_per_s"}
        unknown = set(data) - keys
        if unknown:
            raise ProblemError(f"{where}: unknown keys {sorted(unknown)}")
        latency_keys = [k for k in ("latency_us", "latency_s") if k in data]
        bandwidth_keys = [
            k for k in ("bandwidth_gbps", "bandwidth_bytes_per_s") if k in data
        ]
        if len(latency_keys) > 1 or len(bandwidth_keys) > 1:
            raise ProblemError(f"{where}: give each quantity in one unit only")
        if not latency_keys or not bandwidth_keys:
            missing = "latency_us" if not latency_keys else "bandwidth_gbps"
            raise ProblemError(
                f"{where}: missing {missing} (a link must state its latency and "
                'bandwidth; "bandwidth_gbps": "inf" for a free link)'
            )
        latency_key, bandwidth_key = latency_keys[0], bandwidth_keys[0]
        latency = _number(data[latency_key], f"{where}.{latency_key}")
        bandwidth = _number(
            data[bandwidth_key], f"{where}.{bandwidth_key}", allow_inf=True
        )
        in_range(latency, f"{where}.{latency_key}", latency_key, data[latency_key])
        in_range(
            bandwidth,
            f"{where}.{bandwidth_key}",
            bandwidth_key,
            data[bandwidth_key],
            allow_inf=True,
        )
        if latency_key == "latency_us":
            latency /= 1e6
        if bandwidth_key == "bandwidth_gbps":
            bandwidth *= 1e9 / 8
        return cls(latency_s=latency, bandwidth=bandwidth)


def _number(value: Any, where: str, *, allow_inf: bool = False) -> float:
    """A number from a file (``int``/``float``; ``"inf"`` when allowed)."""
    if allow_inf and value in ("inf", "Infinity"):
        return math.inf
    number = as_number(value, where)
    if math.isnan(number):
        raise ProblemError(f"{where} must be a number, got nan")
    return number


#: Largest cluster file read (bytes); a description of 100,000 hosts fits.
MAX_CLUSTER_FILE_BYTES = 16 * 2**20
#: The most device types a cluster names (the planner's tables grow with the
#: square of the count; real clusters mix a handful).
MAX_DEVICE_TYPES = 64


#: A link that costs nothing (Alpa's assumption).
FREE_LINK = Link()


def _intra_links(
    links: Mapping[str, Link] | Link, names: list[str], hosts_per_type: list[int]
) -> tuple[Link, ...]:
    if isinstance(links, Link):
        return (links,) * len(names)
    unknown = set(links) - set(names) - {"default"}
    if unknown:
        raise ProblemError(f"intra_host names unknown types {sorted(unknown)}")
    default = links.get("default")
    chosen = []
    for name, count in zip(names, hosts_per_type, strict=True):
        link = links.get(name, default)
        if link is None:
            if count:
                raise ProblemError(
                    f"intra_host does not describe the link inside a {name!r} host; "
                    f'give intra_host["{name}"] or intra_host["default"]'
                )
            link = FREE_LINK  # no host of this type: never used
        chosen.append(link)
    return tuple(chosen)


def _inter_links(
    links: Mapping[str, Link] | Link, names: list[str], hosts_per_type: list[int]
) -> tuple[tuple[Link, ...], ...]:
    num_types = len(names)
    if isinstance(links, Link):
        return tuple((links,) * num_types for _ in range(num_types))
    index = {n: i for i, n in enumerate(names)}
    matrix: list[list[Link | None]] = [[None] * num_types for _ in range(num_types)]
    given: dict[tuple[int, int], str] = {}
    for key, link in links.items():
        if key == "default":
            continue
        parts = key.split("-")
        if len(parts) != 2 or any(p not in index for p in parts):
            raise ProblemError(
                f"inter_host key {key!r} must be 'default' or 'a-b' with a, b "
                f"in {names}"
            )
        a, b = sorted((index[parts[0]], index[parts[1]]))
        if (a, b) in given:
            raise ProblemError(
                f"inter_host gives the {names[a]}-{names[b]} link twice "
                f"({given[(a, b)]!r} and {key!r})"
            )
        given[(a, b)] = key
        matrix[a][b] = matrix[b][a] = link
    default = links.get("default")
    for a in range(num_types):
        for b in range(a, num_types):
            if matrix[a][b] is not None:
                continue
            needed = (
                hosts_per_type[a] >= 2
                if a == b
                else hosts_per_type[a] >= 1 and hosts_per_type[b] >= 1
            )
            if default is None and needed:
                raise ProblemError(
                    f"inter_host does not describe the link between a {names[a]!r} "
                    f'and a {names[b]!r} host; give inter_host["{names[a]}-'
                    f'{names[b]}"] or inter_host["default"]'
                )
            matrix[a][b] = matrix[b][a] = default if default is not None else FREE_LINK
    return tuple(tuple(row) for row in matrix)  # type: ignore[arg-type]


def _device_type(name: str, entry: Any) -> DeviceType:
    """A :class:`DeviceType` from its file entry (``speed``, ``memory_gb`` or
    ``memory_bytes``)."""
    where = f"device_types[{name!r}]"
    if not isinstance(entry, Mapping):
        raise ProblemError(
            f"{where} must be an object like "
            f'{{"speed": 1.0, "memory_gb": 40}}, got {entry!r:.60}'
        )
    extra = set(entry) - {"speed", "memory_gb", "memory_bytes"}
    if extra:
        raise ProblemError(f"{where}: unknown keys {sorted(extra)}")
    if {"memory_gb", "memory_bytes"} <= set(entry):
        raise ProblemError(f"{where}: give memory in one unit")
    speed = _number(entry.get("speed", 1.0), f"{where}.speed")
    in_range(speed, f"{where}.speed", "speed", entry.get("speed"))
    memory = None
    for key, scale in (("memory_gb", 1e9), ("memory_bytes", 1.0)):
        if key in entry:
            value = _number(entry[key], f"{where}.{key}")
            memory = in_range(value, f"{where}.{key}", key, entry[key]) * scale
    return DeviceType(name=name, speed=speed, memory_bytes=memory)


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
        if len(self.host_types) * self.devices_per_host > MAX_DEVICES:
            raise ProblemError(
                f"hosts x devices_per_host = {len(self.host_types)} x "
                f"{self.devices_per_host} is more than {MAX_DEVICES} devices"
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

        ``intra_host`` maps a type name (or ``"default"``) to its link, or is one
        link for all types; ``inter_host`` maps ``"a-b"`` pairs (and
        ``"default"``) to links, or is one link for every pair. With a mapping,
        every link the cluster has must be described: the intra-host link of
        every type that has hosts, and the inter-host link of every pair of
        types with hosts on both ends (``"a-a"`` when type ``a`` has two or more
        hosts); a missing one is an error, not a free link.

        Raises:
            ProblemError: unknown names, a pair given twice, or a link missing.
        """
        names = [t.name for t in device_types]
        index = {n: i for i, n in enumerate(names)}

        def type_index(host: str | int) -> int:
            if isinstance(host, str):
                if host not in index:
                    raise ProblemError(f"host type {host!r} is not one of {names}")
                return index[host]
            if isinstance(host, bool) or not isinstance(host, int):
                raise ProblemError(
                    f"a host must be a type name or index, got {host!r:.60}"
                )
            return host

        host_types = tuple(type_index(h) for h in hosts)
        hosts_per_type = [host_types.count(t) for t in range(len(names))]
        return cls(
            device_types=tuple(device_types),
            host_types=host_types,
            devices_per_host=devices_per_host,
            intra_host=_intra_links(intra_host, names, hosts_per_type),
            inter_host=_inter_links(inter_host, names, hosts_per_type),
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
        """A cluster from its JSON object (format in the module doc).

        Raises:
            ProblemError: naming the key, its unit and the value at fault.
        """
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
        if not isinstance(data["device_types"], Mapping):
            raise ProblemError("cluster: device_types must map names to objects")
        if not 1 <= len(data["device_types"]) <= MAX_DEVICE_TYPES:
            raise ProblemError(
                f"cluster: device_types must name 1 to {MAX_DEVICE_TYPES} types, "
                f"got {len(data['device_types'])}"
            )
        types = [
            _device_type(str(name), entry)
            for name, entry in data["device_types"].items()
        ]
        hosts = data["hosts"]
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise ProblemError(
                f"cluster: hosts must be a list of device type names, got {hosts!r:.60}"
            )
        if not 1 <= len(hosts) <= MAX_DEVICES:
            raise ProblemError(
                f"cluster: hosts must list 1 to {MAX_DEVICES} hosts, got {len(hosts)}"
            )
        links = {}
        for key in ("intra_host", "inter_host"):
            entries = data.get(key, {})
            if not isinstance(entries, Mapping):
                raise ProblemError(
                    f"cluster: {key} must map names to links, got {entries!r:.60}"
                )
            links[key] = {
                str(k): Link.from_json(v, f"{key}[{str(k)!r}]")
                for k, v in entries.items()
            }
        dph = data["devices_per_host"]
        if (
            isinstance(dph, bool)
            or not isinstance(dph, int)
            or not 1 <= dph <= MAX_DEVICES
        ):
            raise ProblemError(
                f"devices_per_host must be an integer in [1, {MAX_DEVICES}], "
                f"got {dph!r:.60}"
            )
        return cls.from_types(types, hosts, dph, **links)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Cluster:
        """Read a ``.json`` or ``.toml`` cluster file (format in the module doc).

        Raises:
            ProblemError: one line naming the file: unreadable, larger than
                :data:`MAX_CLUSTER_FILE_BYTES`, not UTF-8 text, invalid or too
                deeply nested JSON/TOML, or invalid contents.
        """
        path = Path(path)
        text = read_text(path, MAX_CLUSTER_FILE_BYTES, "cluster file")
        if path.suffix.lower() == ".toml":
            data = parse_toml(text, str(path))
        else:
            data = parse_json(text, str(path))
        try:
            return cls.from_json(data)
        except ProblemError as error:
            raise ProblemError(f"{path}: {error}") from None

    def describe(self) -> str:
        """One line, e.g. ``2x8 a100 (speed 1) + 2x8 v100 (speed 0.5)``."""
        parts = []
        for t, kind in enumerate(self.device_types):
            hosts = len(self.hosts_of_type(t))
            if hosts:
                shape = f"{hosts}x{self.devices_per_host}"
                parts.append(f"{shape} {kind.name} (speed {kind.speed:g})")
        return " + ".join(parts)
