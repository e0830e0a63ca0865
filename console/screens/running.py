"""What each worker is doing: running jobs (elapsed against timeout, stuck) and workers."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Static

from console.data import Snapshot
from console.fmt import (by_process, duration, longest_job, process_name, process_state, store_full, store_wait,
                         stuck_text, tagged_name, worker_state)
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
        # the processes first (the render pool, each send-email process, the control worker),
        # then the send-email lanes: with two send-email processes the render workers came
        # after 100 lane rows, and a paused process's state after the other's 50 lanes
        rows, lane_rows = [], []
        self._processes = {}
        for group in by_process(snap.workers):
            if len(group) == 1:
                rows.append(self._worker_row(group[0], snap))
                continue
            key = process_name(group)
            if key in self._processes:  # (two host ids' processes of one hostname and pid: a rebooted
                key = f"{key}/{group[0].host_id or len(self._processes)}"  # host's dead lanes beside its new ones)
            self._processes[key] = group
            rows.append((key, self._process_cells(group)))
            lane_rows += [self._worker_row(w, snap) for w in group]
        rows += lane_rows
        with self.app.batch_update():
            self.query_one(LiveTable).sync(rows)

    @staticmethod
    def _worker_row(w, snap: Snapshot) -> tuple[str, tuple]:
        """One worker (a render or control worker, a send-email lane), keyed by its name."""
        if not w.alive:
            state = Text("GONE", style="bold red")
        elif w.paused_s is not None:  # (its lanes read "idle": the process takes no sends)
            state = Text("PAUSED", style="bold red")
        else:
            full = store_full(snap.eta)
            state = Text(worker_state(w.state, w.kind, full, store_wait(w, full, snap.store_faults))
                         + (" (stopping)" if w.stopping else ""),
                         style="yellow" if w.stopping else "")
        job = w.job_id or (Text(f"{w.job_returned} (handed back)", style="dim") if w.job_returned else "")
        return (w.name, (tagged_name(w.name, w.host, w.host_tag), w.where, w.queues, state, job,
                         duration(w.job_elapsed_s), duration(w.heartbeat_age_s),
                         Text("yes", style="green") if w.alive else Text("NO", style="bold red")))

    @staticmethod
    def _process_cells(lanes: list) -> tuple:
        """One send-email process of several lanes: its state from theirs, its longest job."""
        first, top = lanes[0], longest_job(lanes)
        state = process_state(lanes)
        alive = sum(1 for w in lanes if w.alive)
        beat = min((w.heartbeat_age_s for w in lanes if w.heartbeat_age_s is not None), default=None)
        # ("email.app1.4200.*": its state counts the lanes, "43/50 busy"; with " (50 lanes)"
        # after it, `alive` went off the right edge at 80 columns)
        return (Text(f"{tagged_name(process_name(lanes), first.host, first.host_tag)}.*", style="bold"),
                first.where, first.queues,
                Text(state, style="bold red" if "PAUSED" in state or "GONE" in state
                     else "yellow" if "stopping" in state else ""),
                top.job_id if top else "", duration(top.job_elapsed_s if top else None), duration(beat),
                Text("yes", style="green") if alive == len(lanes) else
                Text("NO" if not alive else f"{alive}/{len(lanes)}", style="bold red"))

    def on_data_table_row_selected(self, event) -> None:
        """Enter on a row (the table consumes the key; this is its message)."""
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        key = self.query_one(LiveTable).current_key
        snap = self.app.snapshot
        if key in getattr(self, "_processes", {}):  # a send-email process: its longest job
            w = longest_job(self._processes[key])
        else:
            w = next((w for w in (snap.workers if snap else []) if w.name == key), None)
        if w and w.job_id:
            from console.screens.job import JobScreen

            self.app.push_screen(JobScreen(w.job_id))

    def action_stop_worker(self) -> None:
        key = self.query_one(LiveTable).current_key
        if key in getattr(self, "_processes", {}):  # a send-email process: stopped through a lane of it
            lanes = self._processes[key]
            key = next((w.name for w in lanes if w.alive), lanes[0].name)
        if key:
            self.app.confirm_stop(key)
