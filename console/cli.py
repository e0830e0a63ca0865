"""The console's commands of `payrun` (registered onto the main click group). Importing
this module must not import textual: the TUI is loaded only by `payrun console`."""

from __future__ import annotations


def register(cli) -> None:
    """Add this package's commands to the `payrun` group."""
