"""Figures of the initialization search (matplotlib, the optional ``plot``
extra, imported inside each function; Agg canvas, no pyplot)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pipedejavu.init_search.strategies import StrategyResult
from pipedejavu.init_search.summary import mean_curves
from pipedejavu.init_search.train import METRICS

__all__ = ["candidate_legend", "plot_candidates", "plot_compute"]

_COLORS = {
    "single": "#4c72b0",
    "best_of_n": "#dd8452",
    "refine": "#55a868",
    "refine_random": "#c44e52",
}


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_candidates(
    results: dict[str, StrategyResult],
    path: str | os.PathLike[str],
    *,
    metric: str = "validation_loss",
    dpi: int = 120,
) -> Path:
    """Every candidate's ``metric`` against its own training epochs, one panel
    per strategy; the models trained to the end drawn thick and coloured, the
    discarded ones thin and grey, the final pick in black."""
    column = METRICS.index(metric)
    figure = _figure(4.2 * len(results), 3.8)
    panels = figure.subplots(1, len(results), sharey=True, squeeze=False)[0]
    for axes, (name, result) in zip(panels, results.items(), strict=True):
        for cid, rows in sorted(result.trajectories.items()):
            epochs = range(1, len(rows) + 1)
            if cid == result.picked:
                style = {"color": "black", "linewidth": 1.8, "zorder": 3}
            elif cid in result.survivors:
                style = {
                    "color": _COLORS.get(name, "C0"),
                    "linewidth": 1.4,
                    "zorder": 2,
                }
            else:
                style = {"color": "0.6", "linewidth": 0.7, "alpha": 0.7, "zorder": 1}
            axes.plot(epochs, rows[:, column], **style)
        axes.set_title(
            f"{name}: {len(result.trajectories)} candidates, "
            f"{len(result.survivors)} trained to the end",
            fontsize=9,
        )
        axes.set_xlabel("epochs trained (own)")
        axes.set_yscale("log")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(handles=candidate_legend(name), fontsize=7, loc="upper right")
    panels[0].set_ylabel(metric.replace("_", " "))
    path = Path(path)
    figure.savefig(path, dpi=dpi)
    return path


def candidate_legend(name: str) -> list:
    """The legend of :func:`plot_candidates`' panel of strategy ``name``."""
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], color="black", linewidth=1.8, label="final pick"),
        Line2D(
            [], [], color=_COLORS.get(name, "C0"), linewidth=1.4, label="trained to end"
        ),
        Line2D([], [], color="0.6", linewidth=0.7, label="discarded"),
    ]


def plot_compute(
    runs: Sequence[dict[str, StrategyResult]],
    path: str | os.PathLike[str],
    *,
    metrics: Sequence[str] = ("validation_loss", "validation_accuracy"),
    dpi: int = 120,
) -> Path:
    """The pick's metrics against gradient evaluations spent, per strategy: the
    mean over the runs (seeds) and its 95% confidence band."""
    from matplotlib.ticker import NullFormatter

    figure = _figure(5.0 * len(metrics), 3.8)
    panels = figure.subplots(1, len(metrics), squeeze=False)[0]
    for axes, metric in zip(panels, metrics, strict=True):
        for name, curve in mean_curves(runs, metric).items():
            color = _COLORS.get(name, None)
            band = curve["band"]
            if metric.endswith("accuracy"):
                band = band.clip(0.0, 1.0)
            axes.plot(curve["compute"], curve["mean"], color=color, label=name)
            axes.fill_between(
                curve["compute"], *band, color=color, alpha=0.25, linewidth=0
            )
        axes.set_xscale("log")
        axes.xaxis.set_minor_formatter(NullFormatter())
        if metric.endswith("loss"):
            axes.set_yscale("log")
        axes.set_xlabel("gradient evaluations (mini-batches x candidates)")
        axes.set_ylabel(f"{metric.replace('_', ' ')} of the pick")
        axes.grid(True, which="both", alpha=0.3)
    panels[0].legend()
    figure.suptitle(
        f"Equal compute, {len(runs)} seed(s), mean and 95% band", fontsize=10
    )
    path = Path(path)
    figure.savefig(path, dpi=dpi)
    return path
