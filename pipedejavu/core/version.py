"""The package version (one place; ``pipedejavu.__version__`` re-exports it)."""

__version__ = "0.1.0"
