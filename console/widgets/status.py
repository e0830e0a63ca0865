"""The top line: where we are, and whether what is on screen is fresh."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.fmt import clock, duration


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; }
    StatusBar.stale { background: $error 40%; }
    """

    def __init__(self, crumb: str, **kw):
        super().__init__("", **kw)
        self.crumb = crumb

    def on_mount(self) -> None:
        self.update_text()

    def update_text(self) -> None:
        app = self.app
        now = app.clock()
        snap = app.snapshot
        t = Text()
        t.append(" payrun ", style="bold reverse")
        month = (snap.status or {}).get("month") if snap else None
        t.append(f" {month or '-'}")
        if app.source.month:
            t.append(" (pinned)", style="bold")
        t.append(f" › {self.crumb} ")
        if app.readonly:
            t.append(" READ-ONLY ", style="bold black on yellow")
            t.append(" ")
        stale = app.stale_reason(now)
        if snap is None:
            t.append("connecting…", style="italic")
        elif stale:
            t.append(stale, style="bold")
        else:
            t.append(f"● live {clock(snap.taken_at, app.source.cfg.timezone)} ({snap.took_s * 1000:.0f} ms)",
                     style="green")
        self.set_class(bool(stale), "stale")
        self.update(t)


def stale_text(age_s: float, error: str | None) -> str:
    if error:
        return f"last refresh {duration(age_s)} ago: {error}"
    return f"last refresh {duration(age_s)} ago (waiting for Redis…)"
