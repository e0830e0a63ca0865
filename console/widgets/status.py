"""The top line: where we are, and whether what is on screen is fresh."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.fmt import cells_head, clock, columns, duration


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
            # one line: at 120 columns "Redis unreachable (ConnectionError: Error 111 connecting
            # to" was cut mid-message; the age and what is wrong go first, the detail if it fits
            t.append(fit(stale, self.size.width - t.cell_len) if self.size.width else stale, style="bold")
        else:
            t.append(f"● live {clock(snap.taken_at, app.source.cfg.timezone)} ({snap.took_s * 1000:.0f} ms)",
                     style="green")
        self.set_class(bool(stale), "stale")
        self.update(t)

    def on_resize(self) -> None:
        self.update_text()


def fit(text: str, width: int) -> str:
    """``text`` in ``width`` terminal columns (not ``len``: a CJK character takes two):
    whole if it fits, else without its parenthesised details ("Redis unreachable (ConnectionError: …)" → "Redis unreachable"), then without
    "last refresh", else cut at a word with "…"."""
    if columns(text) <= width:
        return text
    out, depth = [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        if depth == 0:
            out.append(ch)
        if ch == ")" and depth:
            depth -= 1
    short = " ".join("".join(out).split()).replace(" ;", ";").replace(" :", ":")
    if columns(short) <= width:
        return short
    short = short.removeprefix("last refresh ")  # "12s ago: Redis unreachable"
    if columns(short) <= width:
        return short
    if width <= 1:
        return ""
    cut = cells_head(short, width - 1)
    if " " in cut and short[len(cut)] != " ":
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" :;,") + "…"


def stale_text(age_s: float, error: str | None) -> str:
    if error:
        return f"last refresh {duration(age_s)} ago: {error}"
    return f"last refresh {duration(age_s)} ago (waiting for Redis…)"
