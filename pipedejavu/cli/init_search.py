"""``pipedejavu init-search``: one budget spent three ways (one run, best of N,
filter-and-refine), on the bundled digits; a progress bar on stderr, a table or
JSON on stdout, and optional figures. Thin: parse, call
:mod:`pipedejavu.init_search`, print.

Exit codes: 0 success; 2 bad input (one line on stderr naming the argument).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from pipedejavu.cli.parsing import (
    add_json_option,
    fail,
    float_in,
    int_in,
    require_matplotlib,
)
from pipedejavu.core.files import json_text
from pipedejavu.core.problem import ProblemError
from pipedejavu.init_search.data import load_digits
from pipedejavu.init_search.limits import (
    DEFAULT_MEMORY_LIMIT_GB,
    INT_RANGES,
    MAX_BUDGET_EPOCHS,
    MAX_LEARNING_RATE,
    MAX_MEMORY_LIMIT_GB,
    MAX_TARGETS,
    check_memory,
)

EXIT_OK = 0
# Settings whose error messages start with their field name.
_OPTION_FIELDS = {
    "num_workers",
    "epochs",
    "demo_epochs",
    "rounds",
    "keep",
    "resample_scale",
    "shrink",
    "patience",
    "chunk_epochs",
    "model",
    "init",
    "learning_rate",
    "batch_size",
    "memory_limit_gb",
}


def _int_option(parser, name: str, help: str, **kwargs) -> None:
    """``name`` (``--num-workers``): an integer in the inclusive range
    :data:`INT_RANGES` gives its setting (``num_workers``), named in its help."""
    low, high = INT_RANGES[name[2:].replace("-", "_")]
    parser.add_argument(
        name,
        type=int_in(name, low, high),
        metavar="N",
        help=f"{help}; {low:,}..{high:,}",
        **kwargs,
    )


def _float_option(parser, name: str, high: float, help: str, **kwargs) -> None:
    """``name``: a number in ``(0, high]``, named in its help."""
    parser.add_argument(
        name, type=float_in(name, 0, high), help=f"{help}, in (0, {high:g}]", **kwargs
    )


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register the ``init-search`` subcommand (every number has a range)."""
    parser = commands.add_parser(
        "init-search",
        help="parallel random initialization vs one run vs best of N, at equal "
        "compute (flax MLP on the bundled digits)",
        description="Parallel random initialization vs one run vs best of N at "
        "equal compute. Ranges are inclusive; also --keep < --num-workers and "
        "divides it, --rounds x --demo-epochs < --epochs, --num-workers x "
        f"--epochs <= {MAX_BUDGET_EPOCHS:,}, and the candidates must fit "
        "--memory-limit-gb (estimated before any work).",
    )
    parser.add_argument("--model", default="mlp", help="mlp-small, mlp or mlp-deep")
    parser.add_argument("--init", default="he", help="base distribution: he or glorot")
    _int_option(parser, "--num-workers", "N candidates", default=8)
    _int_option(parser, "--epochs", "epochs per worker (budget N x E)", default=100)
    _int_option(parser, "--demo-epochs", "warm-up epochs before scoring", default=20)
    _int_option(parser, "--rounds", "search rounds", default=3)
    _int_option(parser, "--keep", "survivors per round (top k)", default=2)
    _float_option(
        parser, "--resample-scale", 1, "neighbourhood scale of round 1", default=0.5
    )
    _float_option(parser, "--shrink", 1, "scale factor per later round", default=0.5)
    _float_option(
        parser,
        "--learning-rate",
        MAX_LEARNING_RATE,
        "Adam's step size",
        default=1e-3,
    )
    _int_option(
        parser,
        "--batch-size",
        "training images per gradient evaluation (at most the training images)",
        default=64,
    )
    _int_option(
        parser,
        "--patience",
        "stop after this many epochs without progress (none: spend the budget)",
    )
    _int_option(
        parser,
        "--chunk-epochs",
        "epochs per compiled call (progress and early-stopping granularity)",
        default=10,
    )
    _int_option(parser, "--seeds", "repetitions", default=3)
    _int_option(parser, "--seed", "first seed", default=0)
    _float_option(
        parser,
        "--memory-limit-gb",
        MAX_MEMORY_LIMIT_GB,
        "the candidates trained at once may need at most this much memory "
        "(estimated; refused before any work)",
        default=DEFAULT_MEMORY_LIMIT_GB,
        metavar="GIB",
    )
    parser.add_argument(
        "--target",
        default="0.15,0.12",
        help=f"validation losses for time to target, comma-separated, 1 to "
        f"{MAX_TARGETS} finite numbers > 0",
    )
    parser.add_argument("--data", help="a digits .npz of the bundled layout")
    parser.add_argument("--plot", metavar="DIR", help="write figures here")
    add_json_option(parser)


def parse_targets(text: str) -> list[float]:
    """``"0.15,0.12"`` -> the losses; 1 to :data:`MAX_TARGETS` finite numbers > 0.

    Raises:
        ProblemError: anything else (one line naming --target).
    """
    try:
        targets = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        targets = []
    if not 1 <= len(targets) <= MAX_TARGETS or not all(
        math.isfinite(t) and t > 0 for t in targets
    ):
        raise ProblemError(
            f"--target must be 1 to {MAX_TARGETS} comma-separated finite numbers "
            f"> 0, got {text!r:.60}"
        )
    return targets


class _Bar:
    """A progress bar on stderr over all seeds and strategies."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.base = total, width, 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last_shown = -1

    def __call__(self, name: str, done: int, budget: int, best: float) -> None:
        fraction = min((self.base + done) / self.total, 1.0)
        filled = round(fraction * self.width)
        line = (
            f"init-search [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{100 * fraction:3.0f}% {name} best val loss {best:.4f} "
            f"{time.perf_counter() - self.started:.0f} s"
        )
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif round(100 * fraction) // 10 != self.last_shown:  # a line per 10%
            self.last_shown = round(100 * fraction) // 10
            print(line, file=sys.stderr, flush=True)
        if done >= budget:
            self.base += budget

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit code."""
    try:
        targets = parse_targets(args.target)
        if args.plot:
            require_matplotlib()
    except ProblemError as error:
        return fail(str(error))
    import jax

    from pipedejavu.init_search.model import model_config
    from pipedejavu.init_search.strategies import InitSearchConfig, run_strategies
    from pipedejavu.init_search.summary import summarize
    from pipedejavu.init_search.train import TrainConfig, steps_per_epoch

    try:
        config = InitSearchConfig(
            num_workers=args.num_workers,
            epochs=args.epochs,
            demo_epochs=args.demo_epochs,
            rounds=args.rounds,
            keep=args.keep,
            resample_scale=args.resample_scale,
            shrink=args.shrink,
            patience=args.patience,
            chunk_epochs=args.chunk_epochs,
            memory_limit_gb=args.memory_limit_gb,
        )
        train_config = TrainConfig(
            model=model_config(args.model, args.init),
            learning_rate=args.learning_rate,
            batch_size=args.batch_size,
        )
        dataset = load_digits(args.data)
        steps = steps_per_epoch(train_config, len(dataset.train.labels))
        check_memory(
            config.num_workers,
            config.keep,
            train_config.model.hidden,
            train_config.model.num_inputs,
            train_config.model.num_classes,
            train_config.batch_size,
            (
                len(dataset.train.labels),
                len(dataset.validation.labels),
                len(dataset.test.labels),
            ),
            config.memory_limit_gb,
        )
    except ProblemError as error:  # the data file or the memory: named there
        return fail(str(error))
    except ValueError as error:  # settings: name the option, not the field
        first, _, rest = str(error).partition(" ")
        option = "--" + first.replace("_", "-")
        return fail(f"{option} {rest}" if first in _OPTION_FIELDS else str(error))
    bar = _Bar(3 * config.budget(steps) * args.seeds)
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        runs.append(
            run_strategies(
                dataset, train_config, config, key=jax.random.key(seed), progress_fn=bar
            )
        )
    bar.close()
    summary = summarize(runs, targets)
    if args.plot:
        from pipedejavu.init_search.plots import plot_candidates, plot_compute

        directory = Path(args.plot)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            return fail(f"cannot create plot directory {directory}: {error}")
        written = [
            plot_candidates(runs[0], directory / "init_search_candidates.png"),
            plot_compute(runs, directory / "init_search_compute.png"),
        ]
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        summary["config"] = {
            "model": args.model,
            "init": args.init,
            "seeds": list(range(args.seed, args.seed + args.seeds)),
            "targets": targets,
            **vars(config),
            "learning_rate": args.learning_rate,
            "batch_size": args.batch_size,
        }
        print(json_text(summary))
    else:
        print(_table(summary, targets, args.seeds))
    return EXIT_OK


def _table(summary: dict, targets: list[float], seeds: int) -> str:
    def cell(value, interval, digits=4) -> str:
        if value is None:
            return "-"
        if interval is None:
            return f"{value:.{digits}f}"
        if digits == 0:  # a positive count: its interval is on log scale
            return f"{value:.0f} [{interval[0]:.0f}, {interval[1]:.0f}]"
        return f"{value:.{digits}f} +- {(interval[1] - interval[0]) / 2:.{digits}f}"

    lines = [
        f"equal compute, mean +- 95% half-interval over {seeds} seed(s); "
        "evals to target: mean [95% interval on log scale], (runs reaching it)"
    ]
    header = (
        f"{'strategy':<10} {'grad evals':>10} {'val loss':>18} {'val acc':>18} "
        f"{'test acc':>18}"
    )
    for target in targets:
        header += f" {'evals to ' + format(target, 'g'):>28}"
    lines.append(header)
    for name, entry in summary["strategies"].items():
        ci = entry["ci95"]
        cells = [
            cell(entry[key], ci[key])
            for key in (
                "final_validation_loss",
                "final_validation_accuracy",
                "final_test_accuracy",
            )
        ]
        row = f"{name:<10} {entry['gradient_evaluations']:>10.0f} " + " ".join(
            f"{c:>18}" for c in cells
        )
        for target in targets:
            hit = entry["time_to_target"][repr(float(target))]
            text = (
                cell(hit["mean"], hit["ci95"], 0) + f" ({hit['reached']}/{hit['runs']})"
            )
            row += f" {text:>28}"
        lines.append(row)
    return "\n".join(lines)
