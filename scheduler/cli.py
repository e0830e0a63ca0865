"""The scheduling commands of `payrun` (registered onto the main click group)."""

from __future__ import annotations


def register(cli) -> None:
    """Add this package's commands to the `payrun` group."""
