"""Measured iterations read from training logs, as the launchers print them.

* **Megatron-LM** and **Megatron-DeepSpeed** (``training_log``): a line per
  logging interval, ``iteration N/ TOTAL | ... | elapsed time per iteration
  (ms): T | ...``, ``T`` the mean over the interval; Megatron-LM's memory
  report ``[Rank R] (after N iterations) memory (MB) | allocated: A | max
  allocated: M | reserved: R | max reserved: X``. Megatron-DeepSpeed's lines
  carry ``samples per second`` or ``tokens per gpu per second``, Megatron-LM's
  do not: that is how the two are told apart (the numbers are read the same).
* **torchtitan** (its metrics logger): ``step: N  loss: L  memory:
  G.GGGiB(P%)  tps: T  ...`` (``wps`` in older releases), ``T`` tokens per
  second per GPU over the interval, ``G`` the peak memory reserved; colour
  codes are stripped.

:func:`read_training_log` reads a file into a :class:`TrainingLog` (the
logged intervals in order); :meth:`TrainingLog.steady` gives the intervals
after the warm-up. A log is untrusted: read line by line, each line and the
number of lines bounded, and anything unreadable is one line naming the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

from pipedejavu.core.problem import ProblemError

__all__ = [
    "LAUNCHERS",
    "LoggedInterval",
    "TrainingLog",
    "read_training_log",
]

#: The launchers whose logs are read.
LAUNCHERS = ("megatron-lm", "megatron-deepspeed", "torchtitan")
_MAX_LINE = 1 << 16
_MAX_LINES = 5_000_000
_MAX_INTERVALS = 1_000_000
_NUMBER = r"([0-9][0-9,]*(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_MEGATRON = re.compile(
    r"\biteration\s+([0-9]+)\s*/\s*[0-9]+\s*\|.*?elapsed time per iteration "
    rf"\(ms\):\s*{_NUMBER}"
)
_DEEPSPEED_MARKS = ("samples per second", "tokens per gpu per second")
_MEMORY = re.compile(
    rf"memory \(MB\)\s*\|\s*allocated:\s*{_NUMBER}\s*\|\s*max allocated:\s*"
    rf"{_NUMBER}\s*\|\s*reserved:\s*{_NUMBER}\s*\|\s*max reserved:\s*{_NUMBER}"
)
_TITAN = re.compile(rf"\bstep:\s*([0-9]+)\s+loss:.*?\b(?:tps|wps):\s*{_NUMBER}")
_TITAN_MEMORY = re.compile(rf"\bmemory:\s*{_NUMBER}\s*GiB")


@dataclasses.dataclass(frozen=True)
class LoggedInterval:
    """One logged interval ending at ``iteration``: ``seconds`` per iteration
    (Megatron) or ``tokens_per_gpu_s`` (torchtitan), and the peak memory
    reserved the line (or the memory report after it) gives, in bytes."""

    iteration: int
    seconds: float | None = None
    tokens_per_gpu_s: float | None = None
    memory_bytes: float | None = None


@dataclasses.dataclass(frozen=True)
class TrainingLog:
    """A training log read (:func:`read_training_log`)."""

    path: str
    launcher: str
    intervals: tuple[LoggedInterval, ...]

    def steady(self, skip: int = 1) -> tuple[LoggedInterval, ...]:
        """The intervals after the first ``skip`` (the warm-up: compilation,
        allocator growth, the first data loading); all but the last where
        fewer are logged.

        Raises:
            ProblemError: ``skip`` negative.
        """
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ProblemError(f"{self.path}: skip must be an integer >= 0")
        kept = self.intervals[skip:]
        return kept if kept else self.intervals[-1:]

    def peak_memory_bytes(self) -> float | None:
        """The largest memory the log reports (``None``: none)."""
        values = [i.memory_bytes for i in self.intervals if i.memory_bytes]
        return max(values) if values else None


def _number(text: str) -> float:
    value = float(text.replace(",", ""))
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _lines(path: Path) -> Iterator[str]:
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        read = 0
        while line := handle.readline(_MAX_LINE):
            read += 1
            if read > _MAX_LINES:
                raise ProblemError(f"{path}: more than {_MAX_LINES:,} lines")
            if len(line) == _MAX_LINE and not line.endswith("\n"):
                # an over-long line is no log line of ours: skip the rest of it
                while (rest := handle.readline(_MAX_LINE)) and not rest.endswith("\n"):
                    pass
                continue
            yield _COLOUR.sub("", line)


def read_training_log(path: str | os.PathLike) -> TrainingLog:
    """The logged intervals of a Megatron-LM, Megatron-DeepSpeed or torchtitan
    training log (module docstring), in order.

    Raises:
        ProblemError: one line naming the file: unreadable, no iteration line
            of a known launcher, lines of two launchers, a number that is not
            one, a non-positive time.
    """
    file = Path(path)
    name = os.fspath(path)
    if not file.is_file():
        raise ProblemError(f"{name}: no such log file")
    intervals: list[LoggedInterval] = []
    launchers: set[str] = set()
    try:
        for line in _lines(file):
            found = _MEGATRON.search(line)
            if found is not None:
                deepspeed = any(mark in line for mark in _DEEPSPEED_MARKS)
                launchers.add("megatron-deepspeed" if deepspeed else "megatron-lm")
                seconds = _number(found.group(2)) / 1e3
                if not seconds > 0:
                    raise ValueError(f"iteration time {found.group(2)} ms")
                intervals.append(LoggedInterval(int(found.group(1)), seconds))
            elif (found := _TITAN.search(line)) is not None:
                launchers.add("torchtitan")
                tps = _number(found.group(2))
                if not tps > 0:
                    raise ValueError(f"tokens per second {found.group(2)}")
                memory = _TITAN_MEMORY.search(line)
                peak = None if memory is None else _number(memory.group(1)) * 2**30
                intervals.append(LoggedInterval(int(found.group(1)), None, tps, peak))
            elif (found := _MEMORY.search(line)) is not None and intervals:
                peak = _number(found.group(4)) * 2**20
                intervals[-1] = dataclasses.replace(intervals[-1], memory_bytes=peak)
            if len(intervals) > _MAX_INTERVALS:
                raise ValueError(f"more than {_MAX_INTERVALS:,} logged intervals")
    except OSError as error:
        raise ProblemError(f"{name}: cannot read the log ({error.strerror})") from None
    except ValueError as error:
        raise ProblemError(f"{name}: not a number where one belongs: {error}") from None
    if not intervals:
        raise ProblemError(
            f"{name}: no iteration line of Megatron-LM, Megatron-DeepSpeed or "
            "torchtitan ('elapsed time per iteration (ms)', 'step: N ... tps:')"
        )
    megatron = launchers - {"torchtitan"}
    if "torchtitan" in launchers and megatron:
        raise ProblemError(f"{name}: lines of both Megatron and torchtitan")
    launcher = "megatron-deepspeed" if "megatron-deepspeed" in launchers else None
    launcher = launcher or launchers.pop()
    return TrainingLog(name, launcher, tuple(intervals))
