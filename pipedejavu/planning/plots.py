"""Figures, one independent function each.

matplotlib is imported inside each function (it is an optional dependency: the
``plot`` extra), and every figure is drawn on its own ``Figure`` with the Agg
canvas: no pyplot, no global backend switch, nothing left open.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipedejavu.simulation.simulate import SimulationResult

__all__ = [
    "palette",
    "plot_anytime",
    "plot_gantt",
    "plot_loss_curve",
    "plot_ratios",
    "time_unit",
    "value_axis",
]

_COLORS = {
    "F": "#4c72b0",  # forward
    "B": "#dd8452",  # backward
    "TF": "#55a868",  # activation transfer (forward direction)
    "TB": "#8172b3",  # gradient transfer (backward direction)
}


def time_unit(seconds: float) -> tuple[str, float]:
    """A readable unit for an axis spanning ``seconds``."""
    if seconds >= 1.0 or seconds == 0.0:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def plot_gantt(
    result: SimulationResult,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    show_microbatches: bool | None = None,
    dpi: int = 120,
) -> Path:
    """Draw a simulated iteration as a Gantt chart and save it (PNG by default).

    One row per stage (stage 0 on top), forwards and backwards in two colours;
    each link's transfers (activations and gradients in two more colours) as a
    thin row between the two stages it joins. The right margin gives each
    stage's idle fraction.

    Args:
        result: a :class:`~pipedejavu.simulation.simulate.SimulationResult`.
        path: the output file; its suffix picks the format (``.png``, ``.svg``...).
        title: the figure title (default: schedule, S, B and iteration time).
        show_microbatches: write the micro-batch index in each bar (default: when
            there are at most 400 compute bars).
        dpi: resolution of raster formats.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    num_stages = result.num_stages
    count = result.num_microbatches
    unit, scale = time_unit(result.iteration_time)
    if show_microbatches is None:
        show_microbatches = num_stages * count <= 200
    height = min(1.2 + 0.55 * num_stages, 16.0)
    figure = Figure(figsize=(12.0, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    bar_height, link_height = 0.7, 0.16
    edge = 0.4 if num_stages * count <= 2000 else 0.0

    def draw(y, half, pieces, color):
        spans = [(start * scale, (end - start) * scale) for start, end, _ in pieces]
        if spans:
            axes.broken_barh(
                spans,
                (y - half, 2 * half),
                facecolors=color,
                edgecolor="white",
                linewidth=edge,
            )

    for s in range(num_stages):
        for kind, start, end in (
            ("F", result.forward_start, result.forward_end),
            ("B", result.backward_start, result.backward_end),
        ):
            pieces = [(start[s, b], end[s, b], b) for b in range(count)]
            draw(s, bar_height / 2, pieces, _COLORS[kind])
            if show_microbatches:
                for begin, finish, b in pieces:
                    if finish > begin:
                        axes.text(
                            (begin + finish) / 2 * scale,
                            s,
                            str(b),
                            ha="center",
                            va="center",
                            fontsize=7,
                            color="white",
                        )
        axes.text(
            1.005,
            s,
            f"idle {result.idle_fraction[s]:.0%}",
            transform=axes.get_yaxis_transform(),
            va="center",
            fontsize=8,
        )
    for link in range(num_stages - 1):
        for kind, start, end in (
            ("TF", result.activation_start, result.activation_end),
            ("TB", result.gradient_start, result.gradient_end),
        ):
            pieces = [
                (start[link, b], end[link, b], b)
                for b in range(count)
                if start[link, b] == start[link, b]  # NaN: a free link
            ]
            draw(link + 0.5, link_height / 2, pieces, _COLORS[kind])

    axes.set_ylim(num_stages - 0.5, -0.5)
    axes.set_xlim(0.0, max(result.iteration_time, 1e-300) * scale * 1.002)
    ticks = range(num_stages) if num_stages <= 32 else range(0, num_stages, 4)
    axes.set_yticks(list(ticks), [f"stage {s}" for s in ticks])
    axes.set_xlabel(f"time ({unit})")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    handles = [
        Patch(color=_COLORS["F"], label="forward"),
        Patch(color=_COLORS["B"], label="backward"),
    ]
    if result.transfer.any():
        handles += [
            Patch(color=_COLORS["TF"], label="activation transfer"),
            Patch(color=_COLORS["TB"], label="gradient transfer"),
        ]
    axes.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncols=len(handles),
        frameon=False,
        fontsize=8,
    )
    if title is None:
        title = (
            f"{result.schedule.upper()}: {num_stages} stages, {count} micro-batches, "
            f"iteration {result.iteration_time * scale:.4g} {unit}"
        )
    figure.suptitle(title)
    return _saved(figure, path, dpi)


def palette(count: int) -> list:
    """``count`` distinct colours: matplotlib's 10-colour cycle while it
    suffices, else ``tab20`` (up to 20), else evenly spaced hues."""
    if count <= 10:
        return [f"C{i}" for i in range(count)]
    from matplotlib import colormaps

    if count <= 20:
        return [colormaps["tab20"](i) for i in range(count)]
    return [colormaps["hsv"](i / count) for i in range(count)]


def value_axis(axes, which: str, values) -> bool:
    """Log scale on ``axes``' ``which`` (``"x"``/``"y"``) axis when the positive
    ``values`` span at least a factor 10, with plain tick labels (``0.1``,
    ``100``; no ``9.6x10^1`` minor labels); linear otherwise. Returns whether
    the axis is logarithmic."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    positive = [float(v) for v in values if v > 0]
    if not positive or max(positive) / min(positive) < 10:
        return False
    getattr(axes, f"set_{which}scale")("log")
    axis = getattr(axes, f"{which}axis")
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())
    return True


def _figure(width: float = 7.0, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _saved(figure, path: str | os.PathLike[str], dpi: int, *framed) -> Path:
    """``figure`` written to ``path`` (its suffix picks the format), each
    axes of ``framed`` given its legend and grid first."""
    for axes in framed:
        axes.legend()
        axes.grid(True, which="both", alpha=0.3)
    path = Path(path)
    figure.savefig(path, dpi=dpi)
    return path


def plot_anytime(
    traces: dict[str, list[tuple[float, float]]],
    path: str | os.PathLike[str],
    *,
    optimum: float | None = None,
    title: str = "Best plan cost found so far",
    dpi: int = 120,
) -> Path:
    """Anytime curves: best cost so far against elapsed search time.

    Args:
        traces: method -> ``[(seconds, best cost), ...]`` in time order (the
            ``trace`` each solver leaves in ``plan.info``); a method that only
            returns its final answer (the exact DP, Alpa's way) is one point,
            drawn as a marker.
        path: the PNG to write.
        optimum: the exact optimum, drawn as a horizontal line.
    """
    figure = _figure()
    axes = figure.add_subplot()
    times_seen = []
    markers = iter("sD^vP*X")
    drawn = [method for method, trace in traces.items() if trace]
    colors = dict(zip(drawn, palette(len(drawn)), strict=True))
    for method, trace in traces.items():
        if not trace:
            continue
        times = [max(t, 1e-6) for t, _ in trace]
        costs = [c for _, c in trace]
        times_seen += times
        if len(trace) == 1:
            axes.plot(
                times,
                costs,
                marker=next(markers, "o"),
                ls="",
                ms=8,
                color=colors[method],
                label=f"{method} (one answer)",
            )
        else:
            axes.step(
                times,
                costs,
                where="post",
                marker="o",
                markersize=3,
                color=colors[method],
                label=method,
            )
    if optimum is not None:
        axes.axhline(
            optimum, color="black", linestyle="--", linewidth=1, label="optimum"
        )
    if value_axis(axes, "x", times_seen):
        axes.set_xlabel("elapsed search time (s, log scale)")
    else:
        axes.set_xlabel("elapsed search time (s)")
    axes.set_ylabel("best plan cost so far (s per iteration)")
    axes.set_title(title)
    return _saved(figure, path, dpi, axes)


def plot_loss_curve(
    losses: list[float],
    path: str | os.PathLike[str],
    *,
    optimum: float | None = None,
    plan_cost: float | None = None,
    dpi: int = 120,
) -> Path:
    """The engine's relaxed loss per optimizer step, best over its restarts.

    The relaxed loss is a smooth surrogate of the objective (a soft maximum, a
    soft device-budget penalty, the linear latency model), not the cost of any
    plan: it can sit above or below the optimum, and it can rise as the
    temperatures anneal. The figure says so; the exact optimum and the cost of
    the engine's rounded and polished plan are drawn for reference (the
    certified gap is ``plan.info["gap"]``).
    """
    figure = _figure()
    axes = figure.add_subplot()
    axes.plot(
        range(1, len(losses) + 1),
        losses,
        label="relaxed loss (best restart at each step)",
    )
    if optimum is not None:
        axes.axhline(
            optimum, color="black", linestyle="--", linewidth=1, label="DP optimum"
        )
    if plan_cost is not None:
        axes.axhline(
            plan_cost,
            color="C3",
            linestyle=":",
            linewidth=1.5,
            label="engine's plan, exact cost",
        )
    levels = [*losses, *(v for v in (optimum, plan_cost) if v is not None)]
    scale = ", log scale" if value_axis(axes, "y", levels) else ""
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(f"relaxed objective + penalty (s{scale})")
    axes.set_title("Differentiable engine: relaxed loss (a surrogate, not a plan cost)")
    axes.text(
        0.02,
        0.3,
        "The surrogate smooths the max and the device budget; its level is not "
        "a plan's cost.\nPlans are rounded, polished and priced exactly after "
        "the search.",
        transform=axes.transAxes,
        fontsize=7,
        va="bottom",
    )
    return _saved(figure, path, dpi, axes)


def plot_ratios(
    rows: list[dict],
    path: str | os.PathLike[str],
    *,
    x: str = "num_layers",
    dpi: int = 120,
) -> Path:
    """Cost / optimum and search time / DP time against ``x``, one line a method.

    Methods that tie (several optimal planners all at cost ratio 1) would draw
    on top of each other: each method gets its own marker and dash pattern and
    is shifted slightly along ``x`` (by at most 11%, on the log axis), so every
    method's markers stay visible.

    Args:
        rows: dicts with ``method``, ``x``, ``cost_ratio`` and ``time_ratio``
            (e.g. from ``benchmarks/compare_methods.py``); rows with the same
            method and ``x`` are averaged.
    """
    import numpy as np

    figure = _figure(11.0, 4.2)
    cost_axes, time_axes = figure.subplots(1, 2)
    methods = sorted({r["method"] for r in rows})
    styles = ["-", "--", "-.", ":"]
    markers = "osD^vP*X"
    colors = palette(len(methods))
    for index, method in enumerate(methods):
        mine = [r for r in rows if r["method"] == method]
        xs = sorted({r[x] for r in mine})
        shift = 2.0 ** (0.3 * (index - (len(methods) - 1) / 2) / max(len(methods), 1))
        for axes, key in ((cost_axes, "cost_ratio"), (time_axes, "time_ratio")):
            ys = [float(np.mean([r[key] for r in mine if r[x] == v])) for v in xs]
            axes.plot(
                [v * shift for v in xs],
                ys,
                marker=markers[index % len(markers)],
                linestyle=styles[index % len(styles)],
                markerfacecolor="none",
                color=colors[index],
                label=method,
            )
    cost_axes.set_ylabel("plan cost / exact optimum")
    cost_axes.set_title("cost (1 = optimal; tied methods shifted along x)", fontsize=9)
    log_time = value_axis(time_axes, "y", [r["time_ratio"] for r in rows])
    time_axes.set_ylabel(
        "search time / exact DP time" + (" (log scale)" if log_time else "")
    )
    for axes in (cost_axes, time_axes):
        axes.set_xlabel(x.replace("_", " "))
        axes.set_xscale("log", base=2)
    return _saved(figure, path, dpi, cost_axes, time_axes)
