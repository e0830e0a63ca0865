"""What every console view shares: the status line, the footer, read-only filtering."""

from __future__ import annotations

from textual.screen import Screen

from console.app import WRITE_ACTIONS


class ConsoleScreen(Screen):
    CRUMB = ""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """--readonly: actions that change something are hidden from the footer and refused."""
        if self.app.readonly and action in WRITE_ACTIONS:
            return False
        return True

    def on_screen_resume(self) -> None:
        if self.app.snapshot is not None:
            self.show_snapshot(self.app.snapshot)

    def show_snapshot(self, snap) -> None:  # overridden by views that show live data
        pass
