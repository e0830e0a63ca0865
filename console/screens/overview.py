"""The overview: the HR answer per company and in total with its ETA, the queues, the
limits in force and the worker processes, all live."""

from __future__ import annotations

from collections import defaultdict

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Static

from console.data import Snapshot
from console.fmt import (answer, clip, columns, duration, in_flight_notes, ledger_behind_text, longest_fitting,
                         no_run_text, paused_sender_alerts, spark, store_full, store_wait, tagged)
from console.screens.base import ConsoleScreen
from console.widgets.status import StatusBar
from console.widgets.table import LiveTable


def _n(v: int) -> str:
    return f"{v:,}"


def no_slip_lines(st: dict) -> list[str]:
    """Who has salary lines for the month shown and no slip, as `payrun status` tells them
    apart: companies the month's run never covered (a company row with no slips),
    leavers whom the month pays and their company's run left out (``no_slip_final``:
    an earlier version's run, or their day recorded since; they read "added after the run"
    before session 43), and employees added after their company's run (a walkthrough saw
    never-run companies called "added after the run")."""
    month = st["month"]
    never = [(c, c["no_slip"]) for c in st.get("companies", []) if c.get("no_slip") and not c.get("total")]
    ran = [c for c in st.get("companies", []) if c.get("no_slip") and c.get("total")]
    final = [(c, n) for c in ran if (n := c.get("no_slip_final", 0))]
    late = [(c, n) for c in ran if (n := c["no_slip"] - c.get("no_slip_final", 0)) > 0]
    resume = f"payrun run --month {month} --resume"
    out = []
    for rows, who1, whom, why, cmd in (
            (never, "employee", "employees", "no slip (never run)", f"payrun run --month {month}" + (
                f" --company {never[0][0]['id']}" if len(never) == 1 else "")),
            (final, "leaver", "leavers", "no slip (the run left them out)", resume),
            (late, "employee", "employees", "no slip (added after the run)", resume)):
        if not rows:
            continue
        n = sum(k for _, k in rows)
        ids = [str(c["id"]) for c, _ in rows]
        whose = f"compan{'y' if len(ids) == 1 else 'ies'} {', '.join(ids[:8])}{'…' if len(ids) > 8 else ''}"
        out.append(f"{n:,} {who1 if n == 1 else whom} of {whose} {'has' if n == 1 else 'have'} {why}: {cmd}")
    return out


def paused_sender_alert(r: dict, now: float, room: int | None = None) -> str:
    """The limits line's alert for a send-email process paused because the provider refuses
    its own credentials (jobs.senders.read_refused): which one, since when, and where its
    credentials come from (what to fix), in ``room`` columns if it can (console.fmt.
    paused_sender_alerts: the less important parts go first); `payrun workers` says it at
    length."""
    return longest_fitting(paused_sender_alerts(r, now), room)


class OverviewScreen(ConsoleScreen):
    CRUMB = "overview"
    BINDINGS = [
        Binding("enter", "drill", "Open", show=False),
        Binding("f", "failed", "Failed"),
        Binding("r", "running", "Running"),
        Binding("w", "workers", "Workers"),
        Binding("d", "drain", "Drain"),
        Binding("u", "resume", "Resume"),
        Binding("D", "drain_all", "Drain all", show=False),
        Binding("U", "resume_all", "Resume all", show=False),
        Binding("l", "limits", "Limits"),
        Binding("m", "month", "Month before (again: back to the latest)", show=False),
    ]
    FIXED_ROWS = 1 + 4 + 1 + 1  # status bar, queues table (header, 3 queues), limits line, footer
    """Rows of the overview besides the HR answer, the companies and the processes."""

    def compose(self) -> ComposeResult:
        yield StatusBar(self.CRUMB)
        yield Static("", id="answer")
        yield LiveTable([("id", "id"), ("company", "company"), ("sent", "sent"), ("waiting", "in progress"),
                         ("stuck", "stuck"), ("failed", "failed"), ("total", "slips")], id="companies")
        yield LiveTable([("queue", "queue"), ("waiting", "waiting"), ("running", "running"), ("retry", "retry"),
                         ("later", "later"), ("failed", "failed"), ("oldest", "oldest"), ("rate", "done/min, 10 min")], id="queues",
                        # at 80 columns a drained queue's "⏸" made the table 1 column too wide: a
                        # scrollbar row under it. Reminders not yet due go first (the limits line
                        # names the drained queues)
                        drop=("later",))
        yield Static("", id="limits")
        yield LiveTable([("proc", "worker process"), ("program", "program"), ("kind", "kind"), ("busy", "busy"),
                         ("job", "longest job"), ("beat", "rq beat")], id="procs",
                        # at 80 columns rq beat was cut to a digit ("1" for "12s"), and with a longer
                        # host name the longest job's time too: `payrun ps` names the programs
                        drop=("program", "beat"))
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#queues", LiveTable).focus()
        if self.app.snapshot is not None:
            self.show_snapshot(self.app.snapshot)

    def show_snapshot(self, snap: Snapshot) -> None:
        st = snap.status
        ans = self.query_one("#answer", Static)
        if st and st.get("month"):
            t = Text()
            t.append(f"{st['month']} total: ", style="bold")
            t.append(answer(st["total"], snap.eta), style="bold")
            if snap.eta and snap.eta.get("on_time") is False:
                t.stylize("bold red")
            for line in no_slip_lines(st):
                t.append("\n" + line, style="bold yellow")
        else:
            cfg = self.app.source.cfg
            t = Text(no_run_text(cfg.home, cfg.ledger_path))
        if behind := ledger_behind_text(snap.ledger_backlog, snap.ledger_backlog_age_s):  # (a run it has not seen yet)
            t.append("\n" + behind, style="bold yellow")
        ans.update(t)
        name_w = max(24, min(48, self.size.width - 56))  # 80 columns: 24; wider: whole names
        with self.app.batch_update():
            self.query_one("#companies", LiveTable).sync([
                (str(c["id"]), (str(c["id"]), clip(c["name"], name_w), _n(c["done"]),
                                _n(c["queued"] + c["running"] + c["retrying"] - c["stuck"]),
                                Text(_n(c["stuck"]), style="bold red") if c["stuck"] else "0",
                                Text(_n(c["failed"]), style="bold red") if c["failed"] else "0", _n(c["total"])))
                for c in (st or {}).get("companies", [])
            ])
            rows = []
            for q in snap.queues:
                name = Text(q.name)
                if q.paused or snap.suspended:
                    name.append(" ⏸", style="bold yellow")
                rows.append((q.name, (name, _n(q.depth), _n(q.running), _n(q.retrying), _n(q.later),
                                      Text(_n(q.failed), style="red") if q.failed else "0",
                                      duration(q.oldest_age_s),
                                      f"{spark(q.per_min)} {q.per_min[-1] if q.per_min else 0:>5,}")))
            self.query_one("#queues", LiveTable).sync(rows)
            self.query_one("#procs", LiveTable).sync(self._process_rows(snap))
        self.query_one("#limits", Static).update(self._limits_text(snap, self._limits_room()))
        self._fit()
        self.call_after_refresh(self._fit)  # the answer's new height is known after layout

    def on_resize(self) -> None:
        self._fit()
        if self.app.snapshot is not None:  # (the limits line is fitted to the width)
            self.query_one("#limits", Static).update(self._limits_text(self.app.snapshot, self._limits_room()))

    def _limits_room(self) -> int:
        """The limits line's columns: the screen's less its padding."""
        return max(20, (self.size.width or self.app.size.width) - 2)

    def _fit(self) -> None:
        """Give the companies the rows a tall screen has spare: everything else first (the
        processes their rows, at least 3), then as many company rows as fit, at least 7."""
        companies = self.query_one("#companies", LiveTable)
        procs = self.query_one("#procs", LiveTable)
        answer_rows = max(1, self.query_one("#answer", Static).size.height)
        spare = self.size.height - self.FIXED_ROWS - answer_rows - max(3, procs.row_count + 1)
        rows = max(8, spare)
        if companies.styles.max_height is None or companies.styles.max_height.value != rows:
            companies.styles.max_height = rows

    @staticmethod
    def _limits_text(snap: Snapshot, room: int | None = None) -> Text:
        """One line: the alerts first (a narrow terminal cuts the end of the line: at 80
        columns a provider outage or a drain was cut off), then the email limits. ``room``:
        the line's columns, which a paused send-email process's alert is fitted into (it
        lost its "(where)" at 80 columns); None: each alert whole."""
        t = Text()
        lim = snap.limits
        alerts: list[tuple[str, str]] = []
        if snap.suspended:
            alerts.append(("⏸ ALL INTAKE STOPPED", "bold yellow"))
        elif snap.paused_queues:
            alerts.append((f"⏸ drained: {', '.join(snap.paused_queues)}", "bold yellow"))
        out = lim.outage if lim else None
        if out and out["pauses"]:
            alerts.append((f"PROVIDER DOWN {duration(out['for_s'])}, {out['failed_in_a_row']:,} failed in a row, "
                           + (f"paused {out['paused_for_s']:.0f}s" if out["state"] == "paused" else "probing"),
                           "bold red"))
        elif lim and lim.paused_for_s:
            alerts.append((f"paused {lim.paused_for_s:.0f}s (429)", "bold yellow"))
        if out and not out["pauses"] and out["failed_in_a_row"] >= 2:
            alerts.append((f"provider failed the last {out['failed_in_a_row']:,} sends", "yellow"))
        if snap.refused_senders:  # (one process paused for its own credentials: the console said nothing)
            used = sum(columns(text) + 3 for text, _ in alerts)  # (each alert is followed by " · ")
            alerts.append((paused_sender_alert(snap.refused_senders[0], snap.taken_at,
                                               None if room is None else room - used), "bold red"))
            if more := len(snap.refused_senders) - 1:  # (the workers view names each)
                alerts.append((f"+{more} more send-email PAUSED (w)", "bold red"))
        if snap.retry_errors:  # why jobs wait out a backoff (an outage below "N in a row" showed only a count)
            shown = ", ".join(f"{head} ×{n:,}" for head, n in snap.retry_errors[:2])
            more = sum(n for _, n in snap.retry_errors[2:])
            alerts.append((f"retrying: {shown}" + (f", other ×{more:,}" if more else ""), "yellow"))
        for text, style in alerts:
            t.append(text, style=style)
            t.append(" · ")
        if lim:
            tail = Text(" · limit ")  # (a bare "40/s" read as a speed: it is the most sends a second may start)
            tail.append(f"{lim.rate_per_s:g}/s", style="bold")
            tail.append(f" · {lim.waits:,} waits · ")
            tail.append(f"{lim.http_429:,} 429s", style="bold red" if lim.http_429 else "")
            if lim.duplicates:  # a killed sender's sends went out again: the provider deduped them
                tail.append(f" · {lim.duplicates:,} resends deduped", style="bold yellow")
            t.append("email ")
            t.append(f"{lim.in_use}/{lim.cap}", style="bold")
            t.append(" in flight")
            # slots held by senders waiting for the rate are not requests at the provider; at a
            # low rate the rate, not the cap, holds the sends back (it read as idle lanes)
            notes = in_flight_notes(lim.in_use, lim.cap, lim.rate_per_s, lim.waiting_for_rate, lim.slots_for_rate)
            t.append(longest_fitting(notes, None if room is None else room - t.cell_len - tail.cell_len))
            t.append_text(tail)
        elif alerts:
            t.right_crop(3)  # (the trailing " · ")
        return t

    @staticmethod
    def _process_rows(snap: Snapshot) -> list[tuple[str, tuple]]:
        procs: dict[tuple, list] = defaultdict(list)
        for w in snap.workers:  # (by host id too: two containers named alike run the same pids)
            procs[(w.host, w.host_id or "", w.pid)].append(w)
        rows = []
        for group in sorted(procs, key=lambda k: (procs[k][0].kind, procs[k][0].process, k)):
            ws = procs[group]
            key = f"{ws[0].shown_host}:{ws[0].pid}"
            busy = [w for w in ws if w.job_id and w.alive]
            longest = max(busy, key=lambda w: w.job_elapsed_s or 0, default=None)
            dead = [w for w in ws if not w.alive]
            # the freshest lane: a send process's idle lanes beat only when they take a job
            # (their liveness is renewed every 2 s regardless), so the stalest read as a hang
            beat = min((w.heartbeat_age_s for w in ws if w.heartbeat_age_s is not None), default=None)
            kind = Text(ws[0].kind)
            if any(w.stopping for w in ws):
                kind.append(" stopping", style="yellow")
            paused = next((w.paused_s for w in ws if w.paused_s is not None), None)
            if paused is not None:
                kind.append(" PAUSED", style="bold red")
            if len(dead) == len(ws):
                kind.append(" GONE", style="bold red")
            elif dead:
                kind.append(f" {len(dead)} NO LIVENESS", style="bold red")
            held = [w.job_id for w in dead if w.job_id]
            if longest:
                job = f"{longest.job_id} {duration(longest.job_elapsed_s)}"
            elif held:
                job = Text(f"{held[0]} (held by a gone worker)", style="red")
            elif dead:
                job = "gone (its job handed back)" if any(w.job_returned for w in dead) else "gone"
            elif paused is not None:  # (it read "idle" beside a queue with work)
                job = Text(f"its credentials refused ({duration(paused)})", style="red")
            elif (ws[0].kind == "render" and any(w.state == "suspended" for w in ws)
                  and (wait := store_wait(ws[0], store_full(snap.eta), snap.store_faults))):
                # (it read "idle" beside 398 waiting: a full store; session 43 a read-only one)
                job = Text(f"takes none: slip store {wait}", style="red")
            else:
                job = "idle"
            rows.append((key, (f"{tagged(ws[0].host, ws[0].host_tag, 18)}:{ws[0].pid}", ws[0].program or "", kind,
                               f"{len(busy)}/{len(ws)}", job,
                               duration(beat))))
        return rows

    def on_data_table_row_selected(self, event) -> None:
        """Enter on a row (the table consumes the key; this is its message)."""
        event.stop()
        self.action_drill()

    # ---- keys -------------------------------------------------------------------------
    def _focused(self) -> tuple[str, str | None]:
        f = self.focused
        if isinstance(f, LiveTable):
            return f.id or "", f.current_key
        return "", None

    def action_drill(self) -> None:
        where, key = self._focused()
        if where == "queues" and key:
            self.app.go("failed", filter_text=f"queue:{key}")
        elif where == "companies" and key:
            self.app.go("failed", filter_text=f"company:{key}")
        elif where == "procs":
            self.app.go("workers")

    def action_failed(self) -> None:
        self.app.go("failed")

    def action_running(self) -> None:
        self.app.go("running")

    def action_workers(self) -> None:
        self.app.go("workers")

    def action_drain(self) -> None:
        where, key = self._focused()
        if where == "queues" and key:
            self.app.confirm_drain(key)
        else:
            self.notify("select a queue (Tab to the queues table), or D to drain every queue", severity="warning")

    def action_resume(self) -> None:
        where, key = self._focused()
        snap = self.app.snapshot
        if snap is not None and snap.suspended:
            # every queue drained (`payrun drain`, D): what stops intake is that, not one
            # queue; u offered "Resume pdf-render?", said "intake resumed" and nothing moved
            self.app.confirm_resume(None, why="Intake is stopped on every queue (a drain of all).")
        elif where == "queues" and key:
            self.app.confirm_resume(key)
        else:  # (as d: u off the queues table offered to lift every drain)
            self.notify("select a queue (Tab to the queues table), or U to resume every queue", severity="warning")

    def action_drain_all(self) -> None:
        self.app.confirm_drain(None)

    def action_resume_all(self) -> None:
        self.app.confirm_resume(None)

    def action_limits(self) -> None:
        self.app.ask_limits()

    def action_month(self) -> None:
        self.app.next_month()
