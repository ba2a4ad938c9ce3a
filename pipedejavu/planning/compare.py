"""The comparison harness: every planner on one instance, measured side by side.

``compare(problem, methods=...)`` runs each method ``warmup`` times (discarded:
JIT compilation, caches) and then ``repeats`` times, and reports for each the
plan cost and its ratio to the exact DP's, the search-time distribution and its
change against the DP's, and the plan's simulated GPipe and 1F1B iteration
times (how they relate to the cost: :mod:`pipedejavu.core.hetero_rules`). The
stochastic methods (``diff``, ``anneal``, ``random``) get seed ``seed + r`` on
repeat ``r``, so the repeats show their spread, not one lucky draw; the table
shows the median cost and the worst ratio.

``pipedejavu compare`` prints the same table (or JSON / CSV).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pipedejavu.core.hetero import HeteroProblem
from pipedejavu.core.problem import InfeasibleProblemError, Plan, Problem, ProblemError
from pipedejavu.planning.solve import HETERO_METHODS, METHODS, solve
from pipedejavu.simulation.simulate import simulate_plan

__all__ = ["Comparison", "MethodResult", "compare", "DEFAULT_METHODS"]

DEFAULT_METHODS = ("dp", "diff", "greedy", "uniform", "anneal")
#: defaults for a :class:`pipedejavu.HeteroProblem` (typed devices and links).
DEFAULT_HETERO_METHODS = ("dp", "diff", "alpa")
_SEEDED = {"diff", "anneal", "random"}
_PERCENTILES = (50, 90, 95, 99)


@dataclasses.dataclass(frozen=True, repr=False)
class MethodResult:
    """One method's measurements.

    Attributes:
        method: the method name (``pipedejavu.METHODS``).
        costs: plan cost of each repeat (seconds per iteration, the objective).
        times: wall-clock search time of each repeat (seconds).
        plan: the cheapest plan found over the repeats (``None`` on error).
        simulated_1f1b: simulated 1F1B iteration time of ``plan`` (seconds).
        simulated_gpipe: simulated GPipe iteration time of ``plan`` (seconds).
        error: why the method gave no plan (infeasible, unknown method, ...).
    """

    method: str
    costs: tuple[float, ...]
    times: tuple[float, ...]
    plan: Plan | None
    simulated_1f1b: float
    error: str | None = None
    simulated_gpipe: float = math.nan

    @property
    def cost(self) -> float:
        """Median plan cost over the repeats."""
        return float(np.median(self.costs)) if self.costs else math.nan

    @property
    def worst_cost(self) -> float:
        return max(self.costs) if self.costs else math.nan

    def __repr__(self) -> str:
        # the plan's info holds the engine's whole loss curve: not printed
        if self.error:
            return f"MethodResult({self.method!r}, no plan: {self.error})"
        stages = self.plan.num_stages if self.plan is not None else None
        return (
            f"MethodResult({self.method!r}, cost={self.cost:.6g} s, "
            f"runs={len(self.costs)}, stages={stages})"
        )

    def time_stats(self) -> dict[str, float]:
        """mean and p50/p90/p95/p99 of the search times (seconds).

        A percentile ``q`` is reported only when the samples support it, i.e.
        at least ``100 / (100 - q)`` of them (p90: 10, p95: 20, p99: 100)
        so that at least one sample lies above it; otherwise it is NaN
        (printed as ``-``)."""
        if not self.times:
            return {k: math.nan for k in ("mean", "p50", "p90", "p95", "p99")}
        times = np.asarray(self.times)
        stats = {"mean": float(times.mean())}
        for q in _PERCENTILES:
            supported = len(times) * (100 - q) >= 100 or q == 50
            stats[f"p{q}"] = float(np.percentile(times, q)) if supported else math.nan
        return stats


@dataclasses.dataclass(frozen=True, repr=False)
class Comparison:
    """All methods on one instance; ``reference`` (the exact DP) anchors ratios.

    ``print(comparison)`` prints :meth:`format_table`; ``repr`` is one line.
    ``hetero``: the instance was a :class:`pipedejavu.HeteroProblem` (the cost
    is its planner's objective, not Alpa's formula).
    """

    results: tuple[MethodResult, ...]
    reference: str
    repeats: int
    warmup: int
    num_layers: int
    num_devices: int
    num_microbatches: int
    hetero: bool = False

    def __str__(self) -> str:
        return self.format_table()

    def __repr__(self) -> str:
        methods = ", ".join(repr(r) for r in self.results)
        return (
            f"Comparison({self.num_layers} layers, {self.num_devices} devices, "
            f"B={self.num_microbatches}, {self.repeats} runs, reference "
            f"{self.reference!r}: {methods})"
        )

    @property
    def has_transfers(self) -> bool:
        """Whether some plan pays for transfers between its stages."""
        return any(any(getattr(r.plan, "transfers", ())) for r in self.results)

    def result(self, method: str) -> MethodResult:
        for r in self.results:
            if r.method == method:
                return r
        raise KeyError(method)

    def _reference(self) -> MethodResult | None:
        try:
            ref = self.result(self.reference)
        except KeyError:
            return None
        return None if ref.error else ref

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-able dict per method (the table's columns, unrounded)."""
        ref = self._reference()
        ref_cost = ref.cost if ref else math.nan
        ref_time = ref.time_stats()["mean"] if ref else math.nan
        rows = []
        for r in self.results:
            stats = r.time_stats()
            rows.append(
                {
                    "method": r.method,
                    "cost": r.cost,
                    "worst_cost": r.worst_cost,
                    "cost_ratio": r.cost / ref_cost,
                    "worst_ratio": r.worst_cost / ref_cost,
                    "cost_delta_pct": 100 * (r.cost / ref_cost - 1),
                    "time_mean_s": stats["mean"],
                    "time_p50_s": stats["p50"],
                    "time_p90_s": stats["p90"],
                    "time_p95_s": stats["p95"],
                    "time_p99_s": stats["p99"],
                    "time_delta_pct": 100 * (stats["mean"] / ref_time - 1),
                    "simulated_1f1b_s": r.simulated_1f1b,
                    "simulated_gpipe_s": r.simulated_gpipe,
                    "num_stages": r.plan.num_stages if r.plan else None,
                    "repeats": len(r.times),
                    "error": r.error,
                }
            )
        return rows

    def to_json(self) -> dict[str, Any]:
        def clean(value: Any) -> Any:
            if isinstance(value, float) and not math.isfinite(value):
                return None
            return value

        return {
            "reference": self.reference,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "num_layers": self.num_layers,
            "num_devices": self.num_devices,
            "num_microbatches": self.num_microbatches,
            "methods": [{k: clean(v) for k, v in row.items()} for row in self.rows()],
            "plans": {
                r.method: r.plan.to_json() for r in self.results if r.plan is not None
            },
        }

    def to_csv(self) -> str:
        rows = self.rows()
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()

    def format_table(self) -> str:
        """The table a user reads: cost vs DP, time vs DP, simulated GPipe and
        1F1B."""
        header = (
            f"{'method':<12} {'cost (s)':>11} {'x DP':>8} {'worst':>8} "
            f"{'mean (s)':>9} {'p50':>8} {'p90':>8} {'p95':>8} {'p99':>8} "
            f"{'time vs DP':>11} {'GPipe sim':>10} {'1F1B sim':>10} {'stages':>6}"
        )
        lines = [header, "-" * len(header)]
        for row in self.rows():
            if row["error"]:
                lines.append(f"{row['method']:<12} no plan: {row['error']}")
                continue

            def fmt(value: float, spec: str) -> str:
                if math.isfinite(value):
                    return format(value, spec)
                width = spec.lstrip("+").split(".")[0]
                return format("-", f">{width}") if width.isdigit() else "-"

            delta = row["time_delta_pct"]
            lines.append(
                f"{row['method']:<12} {fmt(row['cost'], '11.5g')} "
                f"{fmt(row['cost_ratio'], '8.4f')} {fmt(row['worst_ratio'], '8.4f')} "
                f"{fmt(row['time_mean_s'], '9.4f')} {fmt(row['time_p50_s'], '8.4f')} "
                f"{fmt(row['time_p90_s'], '8.4f')} {fmt(row['time_p95_s'], '8.4f')} "
                f"{fmt(row['time_p99_s'], '8.4f')} "
                f"{(fmt(delta, '+10.0f') + '%') if math.isfinite(delta) else '-':>11} "
                f"{fmt(row['simulated_gpipe_s'], '10.5g')} "
                f"{fmt(row['simulated_1f1b_s'], '10.5g')} {row['num_stages']:>6}"
            )
        lines.append(
            f"{self.num_layers} layers, {self.num_devices} devices, "
            f"B={self.num_microbatches}; {self.repeats} timed runs after "
            f"{self.warmup} warm-up; ratios against '{self.reference}'."
        )
        lines.extend(self._legend())
        return "\n".join(lines)

    def _legend(self) -> list[str]:
        """What the cost and the simulated times are, and why they differ."""
        runs = "the median over the runs (worst: the worst run)"
        sims = (
            "GPipe sim, 1F1B sim, stages: the cheapest run's plan run under each "
            "schedule by the discrete-event simulator (pipedejavu.simulate), in "
            "seconds."
        )
        if self.hetero:
            lines = [
                "cost: the planner's objective (1F1B's period with its in-flight "
                "limit, S - s micro-batches at stage s: an estimate of the 1F1B "
                f"sim), {runs}.",
                sims,
            ]
            if self.has_transfers:
                lines.append(
                    "Links shared by both directions make the 1F1B sim differ "
                    "(docs/hetero.md)."
                )
            return lines
        lines = [
            f"cost: Alpa's objective sum(t) + (B - 1) max(t) over the stages' "
            f"latencies t, {runs}; dp returns its exact minimum.",
            sims,
        ]
        below = [
            row["method"]
            for row in self.rows()
            if not row["error"] and row["simulated_1f1b_s"] < row["cost"] * (1 - 1e-9)
        ]
        if below:
            lines.append(
                f"1F1B sim below the cost ({', '.join(below)}) is no contradiction: "
                "the cost is the formula, not the schedule's time. It adds each "
                "other stage's latency once to the slowest stage's B micro-batches; "
                "1F1B waits for the round trip through the stages after the slowest "
                "twice (first and last micro-batch) but runs the slowest stage's "
                "other warm-up forwards and last backwards meanwhile, which can "
                "take less (docs/cli.md)."
            )
        return lines


def simulate_schedule(problem: Problem, plan: Plan, schedule: str = "1f1b"):
    """The plan's simulated schedule (transfers included for placed plans)."""
    return simulate_plan(problem, plan, schedule=schedule)


def _simulated(problem: Problem, plan: Plan, schedule: str = "1f1b") -> float:
    return float(simulate_schedule(problem, plan, schedule).iteration_time)


def compare(
    problem: Problem,
    methods: Sequence[str] | None = None,
    *,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    reference: str = "dp",
    progress_fn: Callable[[str, int, int], None] | None = None,
) -> Comparison:
    """Run every method on ``problem`` and measure it (module doc).

    Args:
        problem: the instance: a :class:`Problem` or a
            :class:`pipedejavu.HeteroProblem`.
        methods: names from ``pipedejavu.planning.solve.METHODS`` (or
            ``HETERO_METHODS``); default :data:`DEFAULT_METHODS`
            (:data:`DEFAULT_HETERO_METHODS`).
        repeats: timed runs per method (>= 1).
        warmup: untimed runs first (>= 0).
        seed: base seed of the stochastic methods.
        options: per-method options passed to ``solve`` (e.g.
            ``{"anneal": {"num_steps": 20000}}``).
        reference: the method the ratios are taken against.
        progress_fn: ``(method, run, total runs)`` before each run.

    Returns:
        A :class:`Comparison`. A method that finds no plan is reported with its
        error, not raised.

    Raises:
        ProblemError: bad ``repeats``/``warmup``, unknown method or option.
    """
    hetero = isinstance(problem, HeteroProblem)
    table = HETERO_METHODS if hetero else METHODS
    if methods is None:
        methods = DEFAULT_HETERO_METHODS if hetero else DEFAULT_METHODS

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ProblemError(f"repeats must be an integer >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ProblemError(f"warmup must be an integer >= 0, got {warmup!r}")
    methods = list(dict.fromkeys(methods))
    unknown = [m for m in methods if m not in table]
    if unknown:
        raise ProblemError(
            f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(table)}"
        )
    options = dict(options or {})
    for name in options:
        if name not in methods:
            raise ProblemError(f"options given for {name!r}, which is not compared")
    results = []
    for method in methods:
        extra = dict(options.get(method, {}))
        costs, times, best, error = [], [], None, None
        total = warmup + repeats
        for run in range(total):
            if progress_fn is not None:
                progress_fn(method, run, total)
            call = dict(extra)
            if method in _SEEDED and "seed" not in extra and "key" not in extra:
                call["seed"] = seed + max(run - warmup, 0)
            started = time.perf_counter()
            try:
                plan = solve(problem, method, **call)
            except (InfeasibleProblemError, TimeoutError) as failure:
                error = str(failure) or type(failure).__name__
                break
            elapsed = time.perf_counter() - started
            if run < warmup:
                continue
            costs.append(plan.cost)
            times.append(elapsed)
            if best is None or plan.cost < best.cost:
                best = plan
        simulated = _simulated(problem, best) if best is not None else math.nan
        results.append(
            MethodResult(
                method=method,
                costs=tuple(costs),
                times=tuple(times),
                plan=best,
                simulated_1f1b=simulated,
                error=error,
                simulated_gpipe=(
                    _simulated(problem, best, "gpipe") if best is not None else math.nan
                ),
            )
        )
    return Comparison(
        results=tuple(results),
        reference=reference,
        repeats=repeats,
        warmup=warmup,
        num_layers=problem.num_layers,
        num_devices=problem.num_devices,
        num_microbatches=problem.num_microbatches,
        hetero=hetero,
    )
