"""Report on the collective fits of :mod:`pipedejavu.costmodel.alpa.comm`: rows,
tables, plots.

One call gives everything the CLI prints::

    rows = comm_report("prof_database.pkl")      # fits + k-fold validation
    print(format_table(rows))                     # text table + summary lines
    json.dumps([row.to_dict() for row in rows])   # or rows_to_dicts(rows)
    plot_fits("prof_database.pkl", rows, "plots/")  # one log-log PNG per mesh

Quality measures per fit (all on the *used* points, see
:mod:`pipedejavu.costmodel.alpa.comm`):
``mape`` the in-sample mean absolute percentage error; ``cv_mape`` the same on
k-fold held-out predictions (folds interleaved by size); ``r2_linear`` the
coefficient of determination of the seconds on the *linear regime*, the points
where ``alpha + beta * bytes >= floor`` (all used points for a plain line).
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pipedejavu.costmodel.alpa.comm_data import (
    ARTIFACT,
    COLLECTIVES,
    INVALID,
    NO_OP,
    CommKey,
    CommSeries,
    GroupShape,
    comm_series,
    stack_series,
)
from pipedejavu.costmodel.alpa.comm_fit import (
    DEFAULT_FIT,
    AlphaBeta,
    CommFitConfig,
    alpha_beta_time,
    fit_alpha_beta,
    held_out_errors,
)

__all__ = [
    "TABLE_LEGEND",
    "FitRow",
    "comm_report",
    "format_table",
    "plot_fits",
    "rows_to_dicts",
]

#: Targets the report checks (median held-out MAPE; R^2 of the linear regime).
TARGET_CV_MAPE = 0.10
TARGET_R2 = 0.99


@dataclasses.dataclass(frozen=True)
class FitRow:
    """One fitted curve, its data counts and its quality.

    Attributes:
        collective, cluster, mesh, num_groups, group_size, crosses_hosts,
            stride, dtype: the curve (see
            :class:`~pipedejavu.costmodel.alpa.comm_data.GroupShape`).
        num_points: points in the database; ``num_used`` of them were fitted,
            ``num_skipped = num_invalid + num_no_op + num_artifact`` were not
            (inf/nan times; no collective run; ``make_monotonic`` copies of a
            no-op). ``num_clamped``: used points lowered by ``make_monotonic``.
        regimes: 1 (a line), 2 (floor + line, or two lines), 3 (floor + two
            lines); 0 if no fit. ``has_floor``: the floor was kept.
        floor_s, alpha_s: seconds; ``beta_s_per_byte``; ``bandwidth_gbps`` =
            ``1e-9 / beta`` (GB/s of payload) of the large-message line;
            ``alpha_mid_s``, ``beta_mid_s_per_byte`` and ``bandwidth_mid_gbps``
            of the intermediate line
            (equal to the former with a single line).
        floor_until_bytes: where the lines rise above the floor (``nan``
            without a floor); ``mid_until_bytes``: where the intermediate line
            hands over to the large-message line (``nan`` with a single line).
        num_linear: used points above the floor (the linear regime, one or
            two lines); ``r2_linear``: R^2 of their seconds.
        mape, cv_mape, cv_max_ape: in-sample and held-out relative errors.
    """

    collective: str
    cluster: str
    mesh: tuple[int, int]
    num_groups: int
    group_size: int
    crosses_hosts: bool
    stride: int
    dtype: str
    num_points: int
    num_used: int
    num_skipped: int
    num_invalid: int
    num_no_op: int
    num_artifact: int
    num_clamped: int
    regimes: int
    has_floor: bool
    floor_s: float
    alpha_s: float
    beta_s_per_byte: float
    bandwidth_gbps: float
    alpha_mid_s: float
    beta_mid_s_per_byte: float
    bandwidth_mid_gbps: float
    floor_until_bytes: float
    mid_until_bytes: float
    num_linear: int
    r2_linear: float
    mape: float
    cv_mape: float
    cv_max_ape: float

    @property
    def key(self) -> CommKey:
        """The :class:`~pipedejavu.costmodel.alpa.comm_data.CommKey` of this curve."""
        group = GroupShape(
            self.num_groups, self.group_size, self.crosses_hosts, self.stride
        )
        return CommKey(self.collective, self.cluster, self.mesh, group, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``nan`` becomes ``None``; ``mesh`` a list)."""
        out = dataclasses.asdict(self)
        out["mesh"] = list(self.mesh)
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in out.items()
        }


def _r2(observed: np.ndarray, predicted: np.ndarray) -> float:
    if observed.size < 3:
        return math.nan
    total = np.sum((observed - observed.mean()) ** 2)
    return (
        float(1.0 - np.sum((observed - predicted) ** 2) / total)
        if total > 0
        else math.nan
    )


def _mean(values: np.ndarray) -> float:
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else math.nan


def comm_report(
    prof_db: Any, *, num_folds: int = 5, config: CommFitConfig | None = None
) -> list[FitRow]:
    """Fit every collective curve of ``prof_db`` and measure each fit.

    Args:
        prof_db: a path to ``prof_database.pkl`` or the dict from
            :func:`~costmodel.read_prof_database`.
        num_folds: k of the held-out k-fold validation (>= 2).
        config: fit settings (default
            :data:`~pipedejavu.costmodel.alpa.comm_fit.DEFAULT_FIT`).

    Returns:
        One :class:`FitRow` per curve, in database order.
    """
    config = DEFAULT_FIT if config is None else config
    series = comm_series(prof_db, config=config)
    num_bytes, seconds, used = stack_series(series)
    params, regimes = fit_alpha_beta(num_bytes, seconds, used, config=config)
    held_out = held_out_errors(
        num_bytes, seconds, used, num_folds=num_folds, config=config
    )
    rows = []
    for i, curve in enumerate(series):
        n = len(curve.seconds)
        b, t, mask = num_bytes[i, :n], seconds[i, :n], used[i, :n]
        fit = AlphaBeta(*(float(p[i]) for p in params))
        predicted = _time(fit, b)
        line = _time(fit._replace(floor=-np.inf), b)
        linear = mask & (line >= fit.floor)
        kinds = np.bincount(curve.kind, minlength=4)
        key = curve.key
        rows.append(
            FitRow(
                collective=key.collective,
                cluster=key.cluster,
                mesh=tuple(key.mesh),
                num_groups=key.group.num_groups,
                group_size=key.group.group_size,
                crosses_hosts=key.group.crosses_hosts,
                stride=key.group.stride,
                dtype=key.dtype,
                num_points=n,
                num_used=int(mask.sum()),
                num_skipped=int(n - mask.sum()),
                num_invalid=int(kinds[INVALID]),
                num_no_op=int(kinds[NO_OP]),
                num_artifact=int(kinds[ARTIFACT]),
                num_clamped=int((curve.clamped & mask).sum()),
                regimes=int(regimes[i]),
                has_floor=bool(fit.floor > 0),
                floor_s=fit.floor,
                alpha_s=fit.alpha,
                beta_s_per_byte=fit.beta,
                bandwidth_gbps=_gbps(fit.beta),
                alpha_mid_s=fit.alpha_mid,
                beta_mid_s_per_byte=fit.beta_mid,
                bandwidth_mid_gbps=_gbps(fit.beta_mid),
                floor_until_bytes=_floor_until(fit),
                mid_until_bytes=_mid_until(fit),
                num_linear=int(linear.sum()),
                r2_linear=_r2(t[linear], predicted[linear]),
                mape=_mean(np.abs(predicted - t)[mask] / t[mask]),
                cv_mape=_mean(held_out[i, :n][mask]),
                cv_max_ape=float(np.max(held_out[i, :n][mask]))
                if mask.any()
                else math.nan,
            )
        )
    return rows


def _time(params: AlphaBeta, num_bytes: np.ndarray) -> np.ndarray:
    """:func:`~costmodel.comm.alpha_beta_time` in float64."""
    with jax.enable_x64(True):
        return np.asarray(alpha_beta_time(params, num_bytes), dtype=np.float64)


def _gbps(beta: float) -> float:
    return 1e-9 / beta if beta > 0 else math.nan


def _mid_until(fit: AlphaBeta) -> float:
    if not fit.beta_mid != fit.beta:  # one line (or nan)
        return math.nan
    return (fit.alpha - fit.alpha_mid) / (fit.beta_mid - fit.beta)


def _floor_until(fit: AlphaBeta) -> float:
    if not fit.floor > 0:
        return math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        mid = (fit.floor - fit.alpha_mid) / np.float64(fit.beta_mid)
        large = (fit.floor - fit.alpha) / np.float64(fit.beta)
    # min of the lines (concave) clears the floor when both do; max when either
    both = max(mid, large) if fit.beta < fit.beta_mid else min(mid, large)
    return float(max(both, 0.0))


def _stat(values: np.ndarray, statistic) -> float | None:
    values = values[np.isfinite(values)]
    return float(statistic(values)) if values.size else None


def summarize(rows: Sequence[FitRow]) -> dict[str, Any]:
    """Aggregate quality of the fits, JSON-able.

    Fits without parameters (too few points) are counted, not averaged; a
    statistic over no fit is ``None``.
    """
    cv = np.array([r.cv_mape for r in rows], dtype=float)
    r2 = np.array([r.r2_linear for r in rows], dtype=float)
    finite = [r for r in rows if math.isfinite(r.cv_mape)]
    worst = max(finite, key=lambda r: r.cv_mape) if finite else None
    return {
        "num_fits": len(rows),
        "num_without_fit": sum(r.regimes == 0 for r in rows),
        "points_used": sum(r.num_used for r in rows),
        "points_skipped": sum(r.num_skipped for r in rows),
        "points_invalid": sum(r.num_invalid for r in rows),
        "median_cv_mape": _stat(cv, np.median),
        "mean_cv_mape": _stat(cv, np.mean),
        "fraction_cv_mape_within_target": _stat(
            cv, lambda v: np.mean(v <= TARGET_CV_MAPE)
        ),
        "median_r2_linear": _stat(r2, np.median),
        "fraction_r2_linear_within_target": _stat(
            r2, lambda v: np.mean(v >= TARGET_R2)
        ),
        "num_with_floor": sum(r.has_floor for r in rows),
        "num_with_two_lines": sum(
            r.regimes - r.has_floor == 2 for r in rows if r.regimes
        ),
        "worst_cv_mape": None if worst is None else worst.to_dict(),
    }


def rows_to_dicts(rows: Sequence[FitRow]) -> list[dict[str, Any]]:
    """JSON-able dicts of the rows (see :meth:`FitRow.to_dict`)."""
    return [row.to_dict() for row in rows]


def _format(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


#: What the columns of :func:`format_table` mean (printed under the table).
TABLE_LEGEND = (
    "columns: mesh = hosts x devices profiled; groups = replica groups x devices "
    "per group; stride = device-id step inside a group (1: neighbours; 2x2 "
    "groups with stride 1 and 2 are different curves); X = a group spans hosts; "
    "dt = dtype; used / skip = points fitted / skipped (inf, no-op, clamped "
    "copies of a no-op); reg = the fit's regimes (F: a latency floor, then 1 or "
    "2 lines); floor_us = the floor, alpha_us = the large-message line's "
    "intercept (microseconds); midGB/s, GB/s = bandwidth of the intermediate and "
    "the large-message line; R2lin = R^2 of the points above the floor; MAPE% = "
    "in-sample error; cv% = held-out k-fold error."
)


def format_table(rows: Sequence[FitRow], *, summary: bool = True) -> str:
    """A fixed-width text table of the rows, plus a legend and summary lines.

    Columns (:data:`TABLE_LEGEND`): mesh and groups as ``hosts x devices`` and
    ``groups x size`` with the group's device stride (rows differing only in
    stride are different curves); ``X`` marks groups spanning hosts; ``reg``
    the regimes (``F`` floor, ``1``/``2`` lines); bandwidths of the
    intermediate and the large-message line.
    """
    header = (
        f"{'collective':<15}{'mesh':>5}{'groups':>8}{'stride':>7}{'X':>2}{'dt':>4}"
        f"{'used':>5}{'skip':>5}{'reg':>4}{'floor_us':>9}{'alpha_us':>9}"
        f"{'midGB/s':>8}{'GB/s':>8}{'R2lin':>8}{'MAPE%':>6}{'cv%':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        shape = f"{r.num_groups}x{r.group_size}"
        regimes = ("F" if r.has_floor else "") + str(r.regimes - r.has_floor)
        lines.append(
            f"{r.collective:<15}{r.mesh[0]:>3}x{r.mesh[1]:<1}{shape:>8}{r.stride:>7}"
            f"{'X' if r.crosses_hosts else '-':>2}{r.dtype:>4}{r.num_used:>5}"
            f"{r.num_skipped:>5}{regimes if r.regimes else '-':>4}"
            f"{r.floor_s * 1e6:>9.1f}{r.alpha_s * 1e6:>9.1f}"
            f"{r.bandwidth_mid_gbps:>8.2f}{r.bandwidth_gbps:>8.2f}"
            f"{r.r2_linear:>8.4f}{r.mape * 100:>6.1f}{r.cv_mape * 100:>6.1f}"
        )
    lines += ["", *textwrap.wrap(TABLE_LEGEND, width=len(header))]
    if summary and rows:
        s = summarize(rows)
        lines += [
            "",
            f"{s['num_fits']} fits ({s['num_without_fit']} without enough points), "
            f"{s['num_with_floor']} with a latency floor, "
            f"{s['num_with_two_lines']} with two lines; points used "
            f"{s['points_used']}, skipped {s['points_skipped']} "
            f"({s['points_invalid']} inf/nan).",
            f"held-out median MAPE {_format(s['median_cv_mape'], '.1%')} (target "
            f"<= {TARGET_CV_MAPE:.0%}; "
            f"{_format(s['fraction_cv_mape_within_target'], '.0%')} of fits "
            "within); median R^2 above the floor "
            f"{_format(s['median_r2_linear'], '.4f')} ("
            f"{_format(s['fraction_r2_linear_within_target'], '.0%')} of fits >= "
            f"{TARGET_R2}).",
        ]
    return "\n".join(lines)


def plot_fits(
    prof_db: Any,
    rows: Sequence[FitRow],
    out_dir: str | Path,
    *,
    config: CommFitConfig | None = None,
) -> list[Path]:
    """Log-log PNGs of data vs fit: one per mesh, a panel per collective.

    Colours are replica-group shapes (``groups x devices``, the device-id
    stride inside a group, whether a group spans hosts); circles f16 and
    crosses f32 points used in the fit; grey dots the points left out (inf,
    no-op sizes, values Alpa's ``make_monotonic`` clamped); lines the fits
    (dashed for f32). The legend says all of this.

    Args:
        prof_db: the database the rows were fitted on (path or dict).
        rows: from :func:`comm_report`.
        out_dir: created if missing.
        config: must match the rows' fit (which points were used).

    Returns:
        The PNG paths, one per ``(cluster, mesh)``.
    """
    from matplotlib.figure import Figure  # lazy: plotting is optional
    from matplotlib.lines import Line2D

    config = DEFAULT_FIT if config is None else config
    by_key = {row.key: row for row in rows}
    meshes: dict[tuple[str, tuple[int, int]], list[CommSeries]] = {}
    for curve in comm_series(prof_db, config=config):
        if curve.key in by_key:
            meshes.setdefault((curve.key.cluster, curve.key.mesh), []).append(curve)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for (cluster, mesh), curves in meshes.items():
        figure = Figure(figsize=(12, 9), layout="constrained")
        axes = figure.subplots(2, 2).ravel()
        shapes = sorted({tuple(c.key.group) for c in curves})
        palette = [f"C{i}" for i in range(10) if i != 7]  # C7 is the skipped grey
        colors = {s: palette[i % len(palette)] for i, s in enumerate(shapes)}
        for ax, collective in zip(axes, COLLECTIVES, strict=True):
            for curve in (c for c in curves if c.key.collective == collective):
                _plot_curve(
                    ax, curve, by_key[curve.key], colors[tuple(curve.key.group)]
                )
            ax.set(
                xscale="log", yscale="log", title=f"{collective} on {mesh[0]}x{mesh[1]}"
            )
            ax.set(xlabel="payload bytes", ylabel="seconds")
        handles = [
            Line2D([], [], color=colors[s], label=_shape_label(s)) for s in shapes
        ]
        handles += [
            Line2D([], [], color="0.3", marker="o", ls="-", label="f16 points, fit"),
            Line2D([], [], color="0.3", marker="x", ls="--", label="f32 points, fit"),
            Line2D(
                [],
                [],
                color="0.6",
                marker=".",
                ls="",
                label="skipped (inf, no-op,\nclamped by Alpa)",
            ),
        ]
        figure.legend(
            handles=handles,
            loc="outside right upper",
            fontsize="small",
            title="replica groups\n(groups x devices)",
        )
        figure.suptitle(
            f"Alpa's collective timings on the {mesh[0]}x{mesh[1]} mesh "
            f"({cluster}) and the fitted curves"
        )
        path = out_dir / f"comm_{cluster}_{mesh[0]}x{mesh[1]}.png"
        figure.savefig(path, dpi=80)
        paths.append(path)
    return paths


def _shape_label(shape: tuple) -> str:
    """E.g. ``2x4, stride 2, across hosts``: 2 groups of 4 devices, every
    other device id, each group spanning hosts."""
    num_groups, group_size, crosses, stride = shape
    where = ", across hosts" if crosses else ""
    return f"{num_groups}x{group_size}, stride {stride}{where}"


def _plot_curve(ax: Any, curve: CommSeries, row: FitRow, color: str) -> None:
    positive = curve.num_bytes > 0
    used = curve.used & positive
    skipped = ~curve.used & positive & np.isfinite(curve.seconds)
    marker = "o" if row.dtype == "f16" else "x"
    ax.scatter(curve.num_bytes[used], curve.seconds[used], s=12, c=color, marker=marker)
    ax.scatter(curve.num_bytes[skipped], curve.seconds[skipped], s=6, c="0.6")
    if used.any() and math.isfinite(row.beta_s_per_byte):
        grid = np.geomspace(
            curve.num_bytes[used].min(), curve.num_bytes[used].max(), 200
        )
        params = AlphaBeta(
            row.floor_s,
            row.alpha_s,
            row.beta_s_per_byte,
            row.alpha_mid_s,
            row.beta_mid_s_per_byte,
        )
        fit = _time(params, grid)
        ax.plot(grid, fit, color=color, lw=1, ls="-" if row.dtype == "f16" else "--")
