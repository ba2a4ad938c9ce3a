"""Pictures of a training plan: one iteration as a timeline, and the memory
of each stage, term by term.

:func:`plan_figure` draws a plan's prediction
(:class:`~pipedejavu.costmodel.megatron.prediction.Prediction`) in two panels:

* **Timeline.** One row per pipeline stage (stage 0 on top) of the slowest
  pipeline, simulated in full (:attr:`Prediction.timeline`): forwards,
  backwards and (zero-bubble schedules) weight gradients, the model chunks of
  an interleaved schedule in lighter shades, the sends of activations and
  gradients as a thin strip under the row; then, from when every pipeline is
  done with the stage (:attr:`Prediction.stage_ready_s`), the part of the
  gradient sync the iteration waits for and the optimizer step; the
  tied-embedding all-reduce of the first and last stage just before. What is
  left grey is the stage's bubble.
* **Memory.** One bar per stage: its largest GPU's memory, split into the
  terms :func:`~pipedejavu.costmodel.megatron.memory_terms.memory_terms`
  names (parameters, gradients, optimizer state, communication buffers,
  activations, reserve), against the GPU's memory (and the limit a headroom
  leaves, where it is lower).

:func:`plot_plan` writes the figure to a PNG or SVG file; ``plan --plot`` and
``predict --plot`` call it. Every drawn collection carries a ``gid``
(``"F:stage:chunk"``, ``"memory:term"``, ...) that tests read back.
matplotlib is the optional ``plot`` extra, imported when a picture is drawn.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from pipedejavu.core.plan3d import Plan3D
from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.memory_terms import MEMORY_TERMS
from pipedejavu.costmodel.megatron.prediction import Prediction
from pipedejavu.planning.plots import palette, time_unit
from pipedejavu.simulation.timeline import BAR_KINDS

__all__ = ["PICTURE_FORMATS", "TAIL_KINDS", "plan_figure", "plot_plan"]

#: File suffixes :func:`plot_plan` writes.
PICTURE_FORMATS = (".png", ".svg")
#: What follows a stage's pipeline, drawn after its bars.
TAIL_KINDS = {
    "tied": "tied-embedding all-reduce",
    "sync": "gradient sync (not overlapped)",
    "optimizer": "optimizer step",
}
_COLORS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "W": "#55a868",
    "T": "#8c8c8c",
    "tied": "#8172b3",
    "sync": "#c44e52",
    "optimizer": "#937860",
    "idle": "#eeeeee",
}


def check_picture_path(path: str | os.PathLike[str]) -> Path:
    """``path`` when its suffix is one of :data:`PICTURE_FORMATS`.

    Raises:
        ProblemError: another suffix (checked before anything is computed).
    """
    path = Path(path)
    if path.suffix.lower() not in PICTURE_FORMATS:
        raise ProblemError(
            f"--plot {path.name}: give a file ending in {' or '.join(PICTURE_FORMATS)}"
        )
    return path


def _timeline(axes: Any, plan: Plan3D, prediction: Prediction) -> None:
    from matplotlib.patches import Patch

    if prediction.timeline is None or prediction.stage_ready_s is None:
        raise ProblemError("this prediction keeps no timeline to draw")
    bars = prediction.timeline()
    stages = plan.num_stages
    ready = prediction.stage_ready_s
    sync = prediction.dp_allreduce_s
    optimizer = prediction.optimizer_s.max(axis=1)
    tied = float(prediction.tied_allreduce_s.max(initial=0.0))
    end = float(max(ready + sync + optimizer))
    unit, scale = time_unit(end)
    chunks = 1 + max((bar.chunk for bar in bars), default=0)
    groups: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for bar in bars:
        groups.setdefault((bar.kind, bar.stage, bar.chunk), []).append(
            (bar.start * scale, (bar.end - bar.start) * scale)
        )
    for s in range(stages):  # the idle background: what is left is a bubble
        axes.broken_barh(
            [(0.0, ready[s] * scale)], (s - 0.35, 0.7), facecolors=_COLORS["idle"],
            gid=f"idle:{s}",
        )  # fmt: skip
    edge = 0.3 if len(bars) <= 4000 else 0.0
    for (kind, s, chunk), spans in sorted(groups.items()):
        shade = 1.0 - 0.5 * chunk / (chunks - 1) if chunks > 1 else 1.0
        low, height = (s + 0.25, 0.1) if kind == "T" else (s - 0.35, 0.6)
        axes.broken_barh(
            spans, (low, height), facecolors=_COLORS[kind], alpha=shade,
            edgecolor="white", linewidth=edge, gid=f"{kind}:{s}:{chunk}",
        )  # fmt: skip
    for s in range(stages):
        tail = [
            ("sync", ready[s], sync[s]),
            ("optimizer", ready[s] + sync[s], optimizer[s]),
        ]
        if tied > 0 and s in (0, stages - 1):
            tail.append(("tied", ready[s] - tied, tied))
        for kind, start, seconds in tail:
            if seconds > 0:
                axes.broken_barh(
                    [(start * scale, seconds * scale)], (s - 0.35, 0.7),
                    facecolors=_COLORS[kind], gid=f"{kind}:{s}",
                )  # fmt: skip
    axes.set_ylim(stages - 0.5, -0.5)
    axes.set_xlim(0.0, max(end, 1e-300) * scale * 1.002)
    ticks = list(range(stages)) if stages <= 32 else list(range(0, stages, 4))
    axes.set_yticks(ticks, [f"stage {s}" for s in ticks])
    axes.set_xlabel(f"time in one iteration ({unit})")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    drawn = {bar.kind for bar in bars}
    handles = [
        Patch(color=_COLORS[k], label=n) for k, n in BAR_KINDS.items() if k in drawn
    ]
    handles += [
        Patch(color=_COLORS[k], label=n)
        for k, n in TAIL_KINDS.items()
        if k != "tied" or (tied > 0 and stages > 1)
    ]
    handles.append(Patch(color=_COLORS["idle"], label="idle (bubble)"))
    if chunks > 1:
        handles.append(
            Patch(color=_COLORS["F"], alpha=0.5, label=f"chunk {chunks - 1}")
        )
    axes.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0),
        ncols=min(len(handles), 5), frameon=False, fontsize=8,
    )  # fmt: skip


def _memory(axes: Any, plan: Plan3D, prediction: Prediction) -> None:
    from matplotlib.patches import Patch

    if prediction.stage_terms is None:
        raise ProblemError("this prediction keeps no memory terms to draw")
    stages = plan.num_stages
    terms = [prediction.stage_terms(s)["terms"] for s in range(stages)]
    colors = dict(zip(MEMORY_TERMS, palette(len(MEMORY_TERMS)), strict=True))
    left = np.zeros(stages)
    handles = []
    for name in MEMORY_TERMS:
        sizes = np.array([t.get(name, 0.0) for t in terms]) / 1e9
        if not sizes.any():
            continue
        axes.barh(
            range(stages), sizes, left=left, height=0.6, color=colors[name],
            gid=f"memory:{name}",
        )  # fmt: skip
        left += sizes
        handles.append(Patch(color=colors[name], label=name.replace("_", " ")))
    capacity = prediction.memory_capacity.min(axis=1) / 1e9
    limit = prediction.memory_limit_bytes.min(axis=1) / 1e9
    rows = np.arange(stages)
    axes.vlines(capacity, rows - 0.4, rows + 0.4, colors="black", gid="capacity")
    handles.append(Patch(color="black", label="GPU memory"))
    if (limit < capacity).any():
        axes.vlines(limit, rows - 0.4, rows + 0.4, colors="black",
                    linestyles="dashed", gid="limit")  # fmt: skip
        handles.append(Patch(color="grey", label="limit (headroom)"))
    axes.set_ylim(stages - 0.5, -0.5)
    ticks = list(range(stages)) if stages <= 32 else list(range(0, stages, 4))
    axes.set_yticks(ticks, [f"stage {s}" for s in ticks])
    axes.set_xlim(0.0, 1.05 * float(max(capacity.max(), left.max())))
    axes.set_xlabel("memory per GPU (GB), the stage's largest")
    axes.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0),
        ncols=min(len(handles), 4), frameon=False, fontsize=8,
    )  # fmt: skip


def plan_figure(plan: Plan3D, prediction: Prediction, *, title: str | None = None):
    """The two panels (module docstring) on a new matplotlib ``Figure``.

    Raises:
        ProblemError: a prediction without its timeline or memory terms.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stages = plan.num_stages
    rows = min(stages, 32)
    figure = Figure(figsize=(12.0, 2.6 + 0.55 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    timeline, memory = figure.subplots(
        2, 1, height_ratios=(0.6 + 0.35 * rows, 0.6 + 0.22 * rows)
    )
    _timeline(timeline, plan, prediction)
    _memory(memory, plan, prediction)
    if title is None:
        title = (
            f"{plan.describe()}\niteration {prediction.iteration_time_s:.4g} s, "
            f"bubble {prediction.bubble_fraction:.0%}, peak memory "
            f"{prediction.peak_memory_bytes / 1e9:.1f} GB"
        )
    figure.suptitle(title, fontsize=10)
    return figure


def plot_plan(
    plan: Plan3D,
    prediction: Prediction,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Write :func:`plan_figure` to ``path`` (``.png`` or ``.svg``).

    Raises:
        ProblemError: another suffix; a prediction without what is drawn.
    """
    path = check_picture_path(path)
    plan_figure(plan, prediction, title=title).savefig(path, dpi=dpi)
    return path
