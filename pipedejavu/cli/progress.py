"""Progress of a long ``plan`` on stderr: :class:`PlanProgress`."""

from __future__ import annotations

import sys
import time

__all__ = ["PlanProgress"]


class PlanProgress:
    """A line on stderr at most every 2 s: configurations solved, then the
    proof under the predictor (plans predicted, best, bound)."""

    def __init__(self, every_s: float = 2.0) -> None:
        self._clock = time.perf_counter
        self._every = every_s
        self._last = self._clock()

    def __call__(self, state: dict) -> None:
        now = self._clock()
        if now - self._last < self._every:
            return
        self._last = now
        if state.get("phase") == "interleaved":
            line = (
                f"interleaved: {state['predicted']} plans predicted, best "
                f"{state['best']:.4f} s"
            )
        elif state.get("phase") == "sharded":
            best = state["best_s"]
            line = f"sharded: {state['priced']} of {state['of']} plans priced" + (
                f", best {best:.4f} s" if best < float("inf") else ""
            )
        elif state.get("phase") == "proof":
            line = (
                f"proof: {state['predicted']} plans predicted, best "
                f"{state['best']:.4f} s, lower bound {state['bound']:.4f} s"
            )
        else:
            line = (
                f"search: {state['solved']} configurations solved, best "
                f"objective {state['best']:.4f} s"
            )
        print(line, file=sys.stderr, flush=True)
