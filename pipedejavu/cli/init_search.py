"""``pipedejavu init-search``: one budget spent three ways (one run, best of N,
filter-and-refine), on the bundled digits; a progress bar on stderr, a table or
JSON on stdout, and optional figures. Thin: parse, call
:mod:`pipedejavu.init_search`, print.

Exit codes: 0 success; 2 bad input (one line on stderr naming the argument).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipedejavu.core.problem import ProblemError

EXIT_OK, EXIT_BAD_INPUT = 0, 2
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
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register the ``init-search`` subcommand."""
    parser = commands.add_parser(
        "init-search",
        help="parallel random initialization vs one run vs best of N, at equal "
        "compute (flax MLP on the bundled digits)",
    )
    parser.add_argument(
        "--model", default="mlp", help="mlp-small, mlp (default), mlp-deep"
    )
    parser.add_argument(
        "--init", default="he", help="base distribution: he (default) or glorot"
    )
    parser.add_argument("--num-workers", type=int, default=8, help="N candidates")
    parser.add_argument(
        "--epochs", type=int, default=100, help="epochs per worker (budget N x E)"
    )
    parser.add_argument(
        "--demo-epochs", type=int, default=20, help="warm-up epochs before scoring"
    )
    parser.add_argument("--rounds", type=int, default=3, help="search rounds")
    parser.add_argument("--keep", type=int, default=2, help="survivors per round")
    parser.add_argument("--resample-scale", type=float, default=0.5)
    parser.add_argument("--shrink", type=float, default=0.5)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--patience", type=int, help="stop after this many epochs without progress"
    )
    parser.add_argument(
        "--chunk-epochs",
        type=int,
        default=10,
        help="epochs per compiled call (progress and early-stopping granularity)",
    )
    parser.add_argument("--seeds", type=int, default=3, help="repetitions")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument(
        "--target",
        default="0.15,0.12",
        help="validation losses for time to target, comma-separated",
    )
    parser.add_argument("--data", help="a digits .npz of the bundled layout")
    parser.add_argument("--plot", metavar="DIR", help="write figures here")
    parser.add_argument("--json", action="store_true", help="print JSON")


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


def _fail(message: str) -> int:
    print(f"pipedejavu: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit code."""
    try:
        targets = [float(t) for t in args.target.split(",") if t.strip()]
    except ValueError:
        return _fail(f"--target must be comma-separated numbers, got {args.target!r}")
    if args.seeds < 1:
        return _fail(f"--seeds must be >= 1, got {args.seeds}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("--plot needs matplotlib: pip install 'pipedejavu[plot]'")
    import jax

    from pipedejavu.init_search import (
        InitSearchConfig,
        TrainConfig,
        load_digits,
        model_config,
        run_strategies,
    )
    from pipedejavu.init_search.summary import summarize
    from pipedejavu.init_search.train import steps_per_epoch

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
        )
        train_config = TrainConfig(
            model=model_config(args.model, args.init),
            learning_rate=args.learning_rate,
            batch_size=args.batch_size,
        )
        dataset = load_digits(args.data)
        steps = steps_per_epoch(train_config, len(dataset.train.labels))
    except ProblemError as error:  # the data file: the message names it
        return _fail(str(error))
    except ValueError as error:  # settings: name the option, not the field
        first, _, rest = str(error).partition(" ")
        option = "--" + first.replace("_", "-")
        return _fail(f"{option} {rest}" if first in _OPTION_FIELDS else str(error))
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
            return _fail(f"cannot create plot directory {directory}: {error}")
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
        print(json.dumps(summary))
    else:
        print(_table(summary, targets, args.seeds))
    return EXIT_OK


def _table(summary: dict, targets: list[float], seeds: int) -> str:
    def cell(value, interval, digits=4) -> str:
        if value is None:
            return "-"
        if interval is None:
            return f"{value:.{digits}f}"
        return f"{value:.{digits}f} +- {(interval[1] - interval[0]) / 2:.{digits}f}"

    lines = [f"equal compute, mean +- 95% half-interval over {seeds} seed(s)"]
    header = (
        f"{'strategy':<10} {'grad evals':>10} {'val loss':>18} {'val acc':>18} "
        f"{'test acc':>18}"
    )
    for target in targets:
        header += f" {'evals to ' + format(target, 'g'):>20}"
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
            row += f" {text:>20}"
        lines.append(row)
    return "\n".join(lines)
