"""One job: the ledger row, every attempt, the last error and the traceback."""

from __future__ import annotations

import time

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from console import actions
from console.screens.base import ConsoleScreen
from payrun.ledger import tries_text
from payrun.text import visible
from console.widgets.status import StatusBar


def _hms(iso: str | None, tz: str | None, missing: str) -> str:
    """An attempt's time as the console's clock shows it (config.timezone), not UTC."""
    if not iso:
        return missing
    from console.data import parse_ts
    from console.fmt import clock

    ts = parse_ts(iso)
    return clock(ts, tz) if ts is not None and tz else iso[11:19]


def unreadable_line(d: dict) -> str:
    """What a job whose data is missing or not JSON is, in one line: what it lacks, that no
    worker ran it (a worker fails it as it takes it; one tried before is not said never
    run), and that it cannot be retried (`payrun retry` refuses it: nothing to run)."""
    tried = (d.get("meta") or {}).get("attempt") or any(
        h.get("started_at") for h in ((d.get("ledger") or {}).get("history") or [])
        if "unreadable" not in (h.get("error") or ""))
    ran = "no worker can run it as it is" if tried else "it was never run"
    return f"{d['unreadable']}: {ran}, and it cannot be retried (`payrun retry` refuses it: nothing to run)"


def render_detail(d: dict, tz: str | None = None) -> Text:
    t = Text()
    led = d.get("ledger")
    t.append(f"{d['id']}\n", style="bold")
    if d.get("recipient"):  # (second, as in `payrun job`: after a long attempt list it was off screen)
        from payrun.recipient import recipient_text

        t.append(f"{visible(recipient_text(d['recipient'], d.get('recipient_send')))}\n")
    if led:
        t.append(f"{led['kind']} · company {led.get('company_id')} · {led.get('key') or ''}\n")
        t.append(f"ledger: {led['status']} after {tries_text(led)}"
                 f"{' on ' + led['worker'] if led.get('worker') else ''}\n")
        if led.get("last_error"):
            t.append("last error: ", style="bold")
            t.append(f"{visible(led['last_error'])}\n", style="red")
        t.append(f"\nattempts ({tz or 'UTC'})\n", style="bold underline")
        for h in led.get("history", []):
            delay = f"  retry in {h['delay_s']:.1f} s" if h.get("delay_s") else ""
            t.append(f"  #{h['attempt']} {_hms(h.get('started_at'), tz, '?')} → {_hms(h.get('ended_at'), tz, '…')} "
                     f"{h.get('outcome')}{delay}  {visible(h.get('error') or '')}\n")
    else:
        t.append("(not in the ledger)\n", style="dim")
    t.append(f"\nin Redis: {d.get('rq_status') or d.get('rq_error') or '?'}")
    if d.get("func"):
        t.append(f" · {d['func']} on {d.get('origin')}")
    elif d.get("unreadable") and d.get("origin"):
        t.append(f" · on {visible(d['origin'])}")
    t.append("\n")
    if d.get("unreadable"):  # (not RQ's error: that is the raw hash)
        t.append(f"{unreadable_line(d)}\n", style="red")
        if not led and (d.get("meta") or {}).get("last_error"):
            t.append("last error: ", style="bold")
            t.append(f"{visible(d['meta']['last_error'])}\n", style="red")
        t.append(f"fields in its hash: {visible(', '.join(d.get('fields') or []))}\n", style="dim")
    if d.get("traceback"):
        t.append("\nlast traceback\n", style="bold underline")
        t.append("\n".join(visible(line) for line in d["traceback"].rstrip().splitlines()) + "\n", style="dim")
    return t


class JobScreen(ConsoleScreen):
    CRUMB = "job"
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("r", "retry_one", "Retry"),
    ]

    RELOAD_S = 2.0

    def __init__(self, job_id: str):
        super().__init__()
        self.job_id = job_id
        self.detail: dict | None = None
        self._loaded_at = float("-inf")
        self._loading = False

    def compose(self) -> ComposeResult:
        yield StatusBar(f"job {self.job_id}")
        with VerticalScroll(id="job-scroll"):
            yield Static("loading…", id="job")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#job-scroll").focus()
        self.reload()

    def reload(self) -> None:
        self._load()

    def show_snapshot(self, snap) -> None:
        """Each refresh reads the job again (at most every RELOAD_S): a retry's outcome, a
        running try's end, show here as they happen, under the header's "● live"."""
        now = time.monotonic()
        if now - self._loaded_at >= self.RELOAD_S and not self._loading:
            self.reload()

    def _load(self) -> None:
        self._loading, self._loaded_at = True, time.monotonic()
        self._read()

    @work(thread=True, exit_on_error=False, group="job")
    def _read(self) -> None:
        try:
            d = self.app.source.job_detail(self.job_id)
        except Exception as e:
            d = {"id": self.job_id, "rq_error": f"{type(e).__name__}: {e}"}
        try:
            self.app.call_from_thread(self._show, d)
        except RuntimeError:  # the app is closing
            pass

    def _show(self, d: dict) -> None:
        self._loading = False
        if d == self.detail:
            return  # (unchanged: the operator's scroll position stays)
        self.detail = d
        self.query_one("#job", Static).update(render_detail(d, self.app.source.cfg.timezone))

    def action_retry_one(self) -> None:
        from console.dialogs.confirm import ConfirmKey

        if self.app.refuse_if_readonly("retry"):
            return
        status = (self.detail or {}).get("rq_status")
        if (self.detail or {}).get("unreadable"):  # (payrun retry refuses it too)
            self.app.notify(f"{self.job_id}: {self.detail['unreadable']}: nothing to retry",
                            severity="warning", timeout=6)
            return
        if self.detail is not None and status != "failed":
            self.app.notify(f"{self.job_id} is not failed ({status or 'not in Redis'}): nothing to retry",
                            severity="warning", timeout=6)
            return
        cmd = f"payrun retry {self.job_id}"
        from console.failed import retry_one_body

        d = self.detail or {}
        body = retry_one_body({**d, "error": (d.get("ledger") or {}).get("last_error")
                               or (d.get("meta") or {}).get("last_error") or ""})
        self.app.push_screen(ConfirmKey(f"Retry {self.job_id}?", body, cmd),
                             lambda ok: ok and self.app.act("retry", actions.retry, [self.job_id], cmd))
