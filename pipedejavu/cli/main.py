"""``pipedejavu`` command line: parse, call the API, print. Thin on purpose.

A command's module (its arguments, and the code that runs it) is imported only
when that command runs: the top-level parser knows every command by its name
and one-line help alone (:data:`COMMANDS`), so ``pipedejavu --help`` imports no
command, and ``pipedejavu solve`` none of ``plan``'s (SciPy) or the engine's
(JAX). :func:`_build_parser` builds every command's parser at once.

Exit codes: 0 success; 2 bad input (one line on stderr naming the file or the
argument); 3 no feasible plan (with the reason); 141 stdout closed early by its
reader (``pipedejavu ... | head``), nothing printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Collection, Sequence
from types import ModuleType

from pipedejavu.cli.parsing import EXIT_BAD_INPUT, Parser, fail, join_number_lists
from pipedejavu.core.errors import InfeasibleProblemError, ProblemError
from pipedejavu.core.version import __version__
from pipedejavu.search.engine.compile_cache import cache_when_jax_loads

EXIT_OK, EXIT_INFEASIBLE = 0, 3
#: Exit status when stdout's reader closed the pipe early (128 + SIGPIPE, what a
#: shell reports for ``yes | head``); nothing is printed.
EXIT_BROKEN_PIPE = 141

#: Every command in the order ``--help`` lists them: the module (in
#: ``pipedejavu.cli``) that registers its arguments and runs it, and its
#: one-line help, which that module gives too (tests/test_startup.py checks
#: that the two agree). A module registers its commands together.
COMMANDS: dict[str, tuple[str, str]] = {
    "solve": ("problem", "find a plan for a problem"),
    "inspect": ("problem", "sizes and coverage of a problem"),
    "convert": (
        "problem",
        "write a problem .npz: from an Alpa stage profile, an example, or with a "
        "cluster file (a heterogeneous problem)",
    ),
    "evaluate": (
        "problem",
        "check a plan JSON (from solve --json or elsewhere) against a problem "
        "and price it exactly",
    ),
    "compare": ("tools", "run several planners on one problem and measure"),
    "costmodel": ("tools", "fit and check the cost models on Alpa's profiles"),
    "profile": (
        "tools",
        "time the layers of a flax GPT on this machine's JAX backend and write "
        "the problem",
    ),
    "demo": ("tools", "solve the bundled real Alpa profiles and generated instances"),
    "data": (
        "data",
        "list the bundled data files, or print the installed path of one",
    ),
    "init-search": (
        "init_search",
        "parallel random initialization vs one run vs best of N, at equal "
        "compute (flax MLP on the bundled digits)",
    ),
    "goodput": ("goodput", "Pollux/AdaptDL's goodput model: fit it, pick batch sizes"),
    "elastic": (
        "goodput",
        "DeepSpeed's elastic global batch size and valid GPU counts",
    ),
    "calibrate": (
        "calibrate",
        "fit the predictor's constants per GPU type to the cluster's own "
        "per-layer profiles and measured runs",
    ),
    "predict": (
        "megatron",
        "predict the iteration time and memory per GPU of a training plan, a "
        "Megatron-LM launch or a torchtitan job",
    ),
    "plan": (
        "megatron",
        "find the fastest training plan (stages, TP, CP, EP, DP, schedule, "
        "knobs) of a model on a GPU pool, proven under the predictor; or what "
        "to rent",
    ),
    "sweep": (
        "sweep",
        "plan every model x global batch x GPU type and count (a table, a CSV "
        "that resumes, local processes or a Dask cluster)",
    ),
}


#: ``--help``'s groups of :data:`COMMANDS`, in the order it lists them.
COMMAND_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plan and predict training", ("plan", "predict", "calibrate", "sweep")),
    ("batch size and elasticity", ("goodput", "elastic")),
    (
        "Alpa's stage formulation (a stage profile onto submeshes, solved exactly)",
        ("solve", "inspect", "convert", "evaluate", "compare", "costmodel", "profile"),
    ),
    ("tools", ("demo", "data", "init-search")),
)
DESCRIPTION = (
    "Plan how to train a model on GPUs: pipeline stages, tensor, context, "
    "expert and data parallelism, the schedule and the other knobs, proven "
    "fastest under the predictor; predict a plan's or a launch's time and "
    "memory per GPU before it runs; calibrate to your cluster; choose what to "
    "rent."
)


class TopParser(Parser):
    """The top-level parser: its help lists the commands by
    :data:`COMMAND_GROUPS`, from :data:`COMMANDS` alone (so it reads the same
    whichever command modules are imported)."""

    def format_help(self) -> str:
        import textwrap

        width = 79
        out = [self.format_usage().rstrip(), ""]
        out += textwrap.wrap(DESCRIPTION, width) + [""]
        for title, names in COMMAND_GROUPS:
            out.append(f"{title}:")
            for name in names:
                out += textwrap.wrap(
                    COMMANDS[name][1],
                    width,
                    initial_indent=f"  {name:<12}  ",
                    subsequent_indent=" " * 16,
                )
            out.append("")
        out += [
            "options:",
            "  -h, --help    show this help message and exit",
            "  --version     show the version and exit",
            "",
            "pipedejavu COMMAND --help lists a command's options.",
        ]
        return "\n".join(out) + "\n"


def command_module(name: str) -> ModuleType:
    """The module of a :data:`COMMANDS` module name, imported now: the one
    place the command line imports a command's code."""
    if name == "problem":
        from pipedejavu.cli import problem as module
    elif name == "tools":
        from pipedejavu.cli import tools as module
    elif name == "data":
        from pipedejavu.cli import data as module
    elif name == "init_search":
        from pipedejavu.cli import init_search as module
    elif name == "goodput":
        from pipedejavu.cli import goodput as module
    elif name == "megatron":
        from pipedejavu.cli import megatron as module
    elif name == "calibrate":
        from pipedejavu.cli import calibrate as module
    elif name == "sweep":
        from pipedejavu.cli import sweep as module
    else:
        raise ValueError(f"no command module {name!r}")
    return module


def _parser(modules: Collection[str]) -> argparse.ArgumentParser:
    """The command line's parser: the commands of ``modules`` with all their
    arguments, every other command by its name and help alone."""
    parser = TopParser(prog="pipedejavu", description=DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"pipedejavu {__version__}"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, metavar="COMMAND"
    )
    for name, (module_name, help_text) in COMMANDS.items():
        if name in commands.choices:
            continue  # registered with its module's other commands
        if module_name in modules:
            module = command_module(module_name)
            register = getattr(module, "add_parsers", None) or module.add_parser
            register(commands)
        else:
            commands.add_parser(name, help=help_text)
    return parser


def _build_parser() -> argparse.ArgumentParser:
    """The parser with every command's arguments (imports every command)."""
    return _parser({module for module, _ in COMMANDS.values()})


def _named_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs: its first word that is not an option (no
    top-level option takes a value); None if there is none or it is unknown."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stdout.flush()  # keep warnings next to the output they concern
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    try:
        words = join_number_lists(sys.argv[1:] if argv is None else argv)
        command = _named_command(words)
        modules = () if command is None else (COMMANDS[command][0],)
        args = _parser(modules).parse_args(words)
    except SystemExit as stop:  # --help and --version exit 0; bad usage returns
        if stop.code == EXIT_BAD_INPUT:
            return EXIT_BAD_INPUT
        raise
    # The one place the persistent compilation cache is switched on by us, for
    # the JAX the command runs, if any ($PIPEDEJAVU_CACHE_DIR, "off" to keep it
    # off; a cache the user set wins); a command without JAX never imports it.
    with cache_when_jax_loads(), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _show_warning
        try:
            code = _run(args)
            sys.stdout.flush()  # a closed pipe shows here, not at exit
        except BrokenPipeError:
            return _closed_pipe()
        return code


def _closed_pipe() -> int:
    """The reader of stdout went away (``pipedejavu ... | head``): stop
    quietly, with the status a shell gives a command killed by SIGPIPE."""
    try:  # the interpreter's final flush must not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (tests)
        pass
    return EXIT_BROKEN_PIPE


#: The most characters of an error line (a message quoting a hostile input
#: whole, e.g. a million hosts, would print megabytes).
MAX_ERROR_CHARS = 2000


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) <= MAX_ERROR_CHARS:
        return text
    cut = len(text) - MAX_ERROR_CHARS
    return f"{text[:MAX_ERROR_CHARS]}... ({cut:,} more characters)"


def _run(args: argparse.Namespace) -> int:
    module = command_module(COMMANDS[args.command][0])
    if args.command == "init-search":
        return module.run(args)  # reports its own errors
    try:
        code = module.run(args)
    except InfeasibleProblemError as error:
        print(f"pipedejavu: no feasible plan: {_one_line(error)}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except BrokenPipeError:
        raise  # stdout's reader went away: main stops quietly
    except (ProblemError, OSError) as error:
        return fail(_one_line(error))
    return EXIT_OK if code is None else code


if __name__ == "__main__":
    sys.exit(main())
