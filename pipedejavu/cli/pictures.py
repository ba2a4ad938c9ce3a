"""``--plot FILE.png|.svg`` of ``plan`` and ``predict``: the plan's picture
(:mod:`pipedejavu.planning.plan_pictures`), checked before any work and
written after the answer is printed (:func:`write_picture`, which writes the
other pictures of ``plan`` too)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from pipedejavu.cli.parsing import require_matplotlib
from pipedejavu.core.problem import ProblemError
from pipedejavu.planning.plan_pictures import check_picture_path, plot_plan

__all__ = ["PLOT_HELP", "check_plot", "write_picture", "write_plot"]

#: What ``--plot`` draws for a plan.
PLOT_HELP = (
    "also draw the plan: one iteration as a timeline per pipeline stage and "
    "each stage's memory by term, as a .png or .svg (needs matplotlib: pip "
    "install 'pipedejavu[plot]')"
)


def check_plot(args: argparse.Namespace) -> None:
    """Refuse a ``--plot`` file of another kind, or without matplotlib.

    Raises:
        ProblemError: one line naming the file or the missing package.
    """
    if getattr(args, "plot", None) is None:
        return
    check_picture_path(args.plot)
    require_matplotlib()


def write_plot(args: argparse.Namespace, plan: Any, prediction: Any) -> int:
    """Write the picture of ``plan`` to ``--plot`` (if given) and return the
    exit status: 1, with an error line on stderr, when it cannot be written
    (the answer printed stands), else 0."""
    if getattr(args, "plot", None) is None:
        return 0
    return write_picture(lambda: plot_plan(plan, prediction, args.plot), args.plot)


def write_picture(draw: Callable[[], Any], path: str) -> int:
    """Call ``draw`` (which writes the picture ``path``) after the answer is
    printed, and return the exit status: 1, with an error line on stderr, when
    it cannot be written (the answer printed stands), else 0 with ``plot
    written to PATH`` on stderr."""
    try:
        draw()
    except (ProblemError, OSError) as error:
        sys.stdout.flush()
        print(f"pipedejavu: error: no plot written: {error}", file=sys.stderr)
        return 1
    print(f"plot written to {path}", file=sys.stderr, flush=True)
    return 0
