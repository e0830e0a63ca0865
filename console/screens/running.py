"""What each worker is doing: running jobs (elapsed against timeout, stuck) and workers."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Static

from console.data import Snapshot
from console.fmt import duration, store_full, stuck_text, worker_state
from console.screens.base import ConsoleScreen
from console.widgets.status import StatusBar
from console.widgets.table import LiveTable


class RunningScreen(ConsoleScreen):
    CRUMB = "running"
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("enter", "open", "Job"),
        Binding("s", "stop_worker", "Stop its worker"),
    ]

    def compose(self) -> ComposeResult:
        yield StatusBar(self.CRUMB)
        yield Static("", id="summary")
        yield LiveTable([("job", "job"), ("queue", "queue"), ("elapsed", "elapsed/timeout"), ("lease", "lease"),
                         ("stuck", "stuck"), ("worker", "worker")], id="running",
                        # at 80 columns the stuck reason ran off the edge ("worker email.app1.4200.07
                        # is"): the worker (s stops it, Enter's detail names it) goes, then the
                        # reason is cut at a word
                        drop=("queue", "worker"), clip=("stuck",))
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(LiveTable).focus()
        if self.app.snapshot is not None:
            self.show_snapshot(self.app.snapshot)

    def show_snapshot(self, snap: Snapshot) -> None:
        rows = []
        for r in snap.running:
            el = Text(f"{duration(r.elapsed_s)}/{duration(r.timeout_s)}")
            if r.stuck:
                el.stylize("bold red")
            elif r.near_timeout:
                el.stylize("bold yellow")
            rows.append((r.job_id, (r.job_id, r.queue, el, duration(r.lease_left_s) if r.lease_left_s > 0 else
                                    Text("lapsed", style="bold red"),
                                    Text(stuck_text(r.stuck, r.worker), style="bold red") if r.stuck else "",
                                    r.worker)))
        with self.app.batch_update():
            self.query_one(LiveTable).sync(rows)
        if snap.redis_down:
            self.query_one("#summary", Static).update("running jobs unknown: Redis unreachable")
            return
        stuck = sum(1 for r in snap.running if r.stuck)
        near = sum(1 for r in snap.running if r.near_timeout and not r.past_timeout and not r.stuck)
        past = sum(1 for r in snap.running if r.past_timeout and not r.stuck)
        self.query_one("#summary", Static).update(
            f"{len(snap.running):,} running · {near} near their timeout (≥80%) · "
            + (f"{past} past it · " if past else "") + f"{stuck} stuck "
            f"(dead worker, lapsed lease, or over {self.app.source.cfg.lease.stuck_after_s / 60:g} min)")

    def _row(self):
        key = self.query_one(LiveTable).current_key
        snap = self.app.snapshot
        return next((r for r in (snap.running if snap else []) if r.job_id == key), None)

    def on_data_table_row_selected(self, event) -> None:
        """Enter on a row (the table consumes the key; this is its message)."""
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        r = self._row()
        if r:
            from console.screens.job import JobScreen

            self.app.push_screen(JobScreen(r.job_id))

    def action_stop_worker(self) -> None:
        r = self._row()
        if r and r.worker:
            self.app.confirm_stop(r.worker)


class WorkersScreen(ConsoleScreen):
    CRUMB = "workers"
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("enter", "open", "Its job"),
        Binding("s", "stop_worker", "Stop worker"),
    ]

    def compose(self) -> ComposeResult:
        yield StatusBar(self.CRUMB)
        yield Static("", id="workers-note")  # (a send-email process paused for its own credentials)
        yield LiveTable([("name", "worker"), ("proc", "host:pid program"), ("queues", "queues"), ("state", "state"),
                         ("job", "job"), ("for", "for"), ("beat", "rq beat"), ("alive", "alive")], id="workers",
                        drop=("queues", "proc", "beat"))  # (at 80 columns alive was cut off: `payrun ps` names programs)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#workers-note", Static).display = False
        self.query_one(LiveTable).focus()
        if self.app.snapshot is not None:
            self.show_snapshot(self.app.snapshot)

    def show_snapshot(self, snap: Snapshot) -> None:
        from jobs.senders import refused_line

        note = self.query_one("#workers-note", Static)
        note.display = bool(snap.refused_senders)
        note.update(Text("\n".join(refused_line(r, snap.taken_at * 1000) for r in snap.refused_senders),
                         style="bold red"))
        rows = []
        for w in sorted(snap.workers, key=lambda w: (w.kind, w.name)):
            if not w.alive:
                state = Text("GONE", style="bold red")
            elif w.paused_s is not None:  # (its lanes read "idle": the process takes no sends)
                state = Text("PAUSED", style="bold red")
            else:
                state = Text(worker_state(w.state, w.kind, store_full(snap.eta)) + (" (stopping)" if w.stopping else ""),
                             style="yellow" if w.stopping else "")
            job = w.job_id or (Text(f"{w.job_returned} (handed back)", style="dim") if w.job_returned else "")
            rows.append((w.name, (w.name, w.where, w.queues, state, job,
                                  duration(w.job_elapsed_s), duration(w.heartbeat_age_s),
                                  Text("yes", style="green") if w.alive else Text("NO", style="bold red"))))
        with self.app.batch_update():
            self.query_one(LiveTable).sync(rows)

    def on_data_table_row_selected(self, event) -> None:
        """Enter on a row (the table consumes the key; this is its message)."""
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        key = self.query_one(LiveTable).current_key
        snap = self.app.snapshot
        w = next((w for w in (snap.workers if snap else []) if w.name == key), None)
        if w and w.job_id:
            from console.screens.job import JobScreen

            self.app.push_screen(JobScreen(w.job_id))

    def action_stop_worker(self) -> None:
        key = self.query_one(LiveTable).current_key
        if key:
            self.app.confirm_stop(key)
