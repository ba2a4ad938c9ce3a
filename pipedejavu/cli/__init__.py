"""The ``pipedejavu`` command line: a module per command group (parse, call, print)."""

from pipedejavu.cli.main import main as main

__all__ = ["main"]
