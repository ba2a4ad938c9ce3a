"""The ``pipedejavu`` command line: one module per command group; thin (parse, call, print)."""

from pipedejavu.cli.main import main as main

__all__ = ["main"]
