"""Session 42's on-call walkthrough (the console at 02:00 in tmux, 120x35 and 80x24): what
it showed of this session's additions, and what it did not."""

from __future__ import annotations

import time

from console.app import ConsoleApp
from console.data import WorkerRow
from jobs.policy import SENDER_TTL_S, sender_entry
from payrun import keys

from test_console_narrow import ready, sync
from test_console_snapshots import NOW, FixedSource, fixed_snapshot

WHERE = "PAYRUN_EMAIL_TOKEN in this process's environment (a restart takes a new value)"


def _lane(pid: int, i: int, job: str | None = None) -> WorkerRow:
    return WorkerRow(f"email.app1.{pid}.{i:02d}", "app1", pid, "send-email", "busy" if job else "idle", job,
                     1.0 if job else None, 0.5, True, False, "email")


def test_a_send_email_process_paused_for_its_credentials_is_read_with_its_lanes(conn):
    """The console read nothing of `payrun:limit:email:senders`: a process paused because
    the provider refuses its own token showed as an idle process."""
    from console.data import read_paused_senders

    now = time.time()
    conn.hset(keys.limit_senders("email"), "email.app1.4300",
              sender_entry(WHERE, now * 1000 + SENDER_TTL_S * 1000, (now - 65) * 1000))
    conn.hset(keys.limit_senders("email"), "email.app1.4200",
              sender_entry(None, now * 1000 + SENDER_TTL_S * 1000))
    workers = [_lane(4200, 0, "email-2026-11-emp-00001"), _lane(4200, 1), _lane(4300, 0), _lane(4300, 1)]
    refused = read_paused_senders(conn, workers, now)
    assert [(r["host"], r["pid"], r["where"]) for r in refused] == [("app1", 4300, WHERE)]
    assert [w.paused_s is not None for w in workers] == [False, False, True, True]
    assert 64 <= workers[2].paused_s <= 67


class PausedSource(FixedSource):
    """The fixed overview, with a second send-email process paused for its credentials."""

    def snapshot(self):
        snap = fixed_snapshot()
        paused = [_lane(4300, i) for i in range(3)]
        for w in paused:
            w.paused_s = 65.0
        snap.workers += paused
        snap.refused_senders = [{"process": "email.app1.4300", "host": "app1", "pid": 4300,
                                 "since_ms": (NOW - 65) * 1000, "where": WHERE}]
        return snap


@sync
async def test_the_console_names_a_send_email_process_paused_for_its_credentials():
    """Overview (the limits line, the process row) and the workers view (the lanes, a note
    naming where its credentials come from), at 80 columns."""
    app = ConsoleApp(PausedSource(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        line = str(app.screen.query_one("#limits").render())
        assert line.startswith("send-email app1:4300 PAUSED 1m05s: provider refuses its credentials"), line
        procs = app.screen.query_one("#procs")
        row = [str(c) for c in procs.get_row("app1:4300")]
        assert any("PAUSED" in c for c in row) and any("credentials refused" in c for c in row), row
        assert not any("PAUSED" in str(c) for c in procs.get_row("app1:4200"))
        await pilot.press("w")
        await ready(pilot, lambda: app.screen.CRUMB == "workers")
        note = app.screen.query_one("#workers-note")
        assert note.display and "send-email app1 pid 4300 PAUSED 65 s" in str(note.render())
        assert WHERE in str(note.render())
        table = app.screen.query_one("#workers")
        assert "PAUSED" in str(table.get_row("email.app1.4300.00")[table.get_column_index("state")])
        assert "PAUSED" not in str(table.get_row("email.app1.4200.44")[table.get_column_index("state")])


def test_the_job_view_names_whom_the_email_is_for_before_its_attempts():
    """A send held 49 times (the rate, a paused process) then refused: its "to:" line came
    after the 50 attempts, off a 24- or 35-row screen; `payrun job` says it second."""
    from console.screens.job import render_detail

    history = [{"attempt": i, "started_at": "2026-11-30T20:31:53+00:00", "ended_at": "2026-11-30T20:31:53+00:00",
                "outcome": "held", "error": "waited too long for the global send rate; retrying"}
               for i in range(1, 50)]
    d = {"id": "email-2026-11-emp-61007", "rq_status": "failed",
         "ledger": {"kind": "email", "company_id": 61, "key": "slip:2026-11:emp-61007", "status": "failed",
                    "attempts": 50, "history": history, "last_error": "HTTP 422 invalid recipient address"},
         "recipient": {"employee_id": "emp-61007", "name": "Sourav Saha", "email": "sourav.7@padma-pharma.invalid",
                       "source": "sent_with"}}
    lines = render_detail(d, "Asia/Dhaka").plain.splitlines()
    assert lines[1].startswith("to: Sourav Saha <sourav.7@padma-pharma.invalid>"), lines[:3]


def test_the_slip_store_full_eta_names_the_store_to_free():
    """Walkthrough: "no ETA: slip store full (4 KiB free): no render until space is freed
    (`payrun status` says where)": at 02:00 a second command to learn what to free."""
    from console.data import eta
    from console.fmt import eta_text

    total = {"queued": 198, "running": 0, "retrying": 0, "done": 102, "failed": 0, "stuck": 0, "total": 300}
    text = eta_text(eta(total, 4.7, NOW, "Asia/Dhaka", store_free=4096, store="/srv/payrun/slips"))
    assert text == ("no ETA: slip store full (4 KiB free): every render waits, spending no attempt; free space in "
                    "/srv/payrun/slips and the run goes on by itself"), text
    assert "store_full_at" not in eta(total, 4.7, NOW, "Asia/Dhaka", store_free=10 << 30, store="/srv/payrun/slips")


def test_the_retrying_reason_is_cut_at_a_clause_not_mid_word():
    """Walkthrough: "retrying: waited too long for the global send rate; retryi ×100"."""
    from console.data import error_head

    assert error_head("waited too long for the global send rate; retrying") == "waited too long for the global send rate"
    assert error_head("a" * 30 + " " + "b" * 30) == "a" * 30


class StoreFullSource(FixedSource):
    """The fixed overview with the slip store full: the render workers take none ("suspended")."""

    def snapshot(self):
        from console.data import eta

        snap = fixed_snapshot()
        for w in snap.workers:
            if w.kind == "render":
                w.state, w.job_id, w.job_elapsed_s = "suspended", None, None
        snap.eta = eta(snap.status["total"], 39.9, NOW, "Asia/Dhaka", store_free=4096, store="/srv/payrun/slips")
        return snap


@sync
async def test_a_render_worker_taking_none_while_the_slip_store_is_full_says_why():
    """Walkthrough: with the store full the overview's render process read "idle" beside 398
    renders waiting, and the workers view (and `payrun workers`) "suspended", RQ's word for
    `rq suspend`."""
    from console.cli import worker_table

    app = ConsoleApp(StoreFullSource(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        assert "free space in /srv/payrun/slips" in str(app.screen.query_one("#answer").render())
        row = [str(c) for c in app.screen.query_one("#procs").get_row("app1:4101")]
        assert "takes none: slip store full" in row, row
        await pilot.press("w")
        await ready(pilot, lambda: app.screen.CRUMB == "workers")
        table = app.screen.query_one("#workers")
        assert str(table.get_row("render.app1.4101")[table.get_column_index("state")]) == "waits: store full"
        from console.widgets.table import RESERVED
        from test_console_narrow import right_edge

        assert 0 < right_edge(table, "alive") <= table.size.width - RESERVED  # (still on screen at 80)
    snap = StoreFullSource().snapshot()
    lines = worker_table(snap.workers, store_full=True)
    assert any("render.app1.4101" in ln and "waits: store full" in ln for ln in lines), lines
    assert not any("slip store full" in ln for ln in worker_table(snap.workers)), "not full: RQ's state"


# ---- session 43: the gaps session 42's closing note left ---------------------------------------


def test_the_job_view_counts_a_try_held_for_its_processs_credentials_among_the_held_back():
    """A send held because its send-email process's own credentials were refused (another
    host sending: RefusedHere) read "held back (rate limit, provider outage, a send already
    in flight or a full slip store)": not the reason it was held."""
    from console.screens.job import render_detail

    held = ("not sent: the provider refused this send-email process's credentials (PAYRUN_EMAIL_TOKEN in this "
            "process's environment (a restart takes a new value)) while others send: back for another process, "
            "no attempt spent")
    history = [{"attempt": 1, "started_at": "2026-11-30T20:12:37+00:00", "ended_at": "2026-11-30T20:12:38+00:00",
                "outcome": "held", "error": held},
               {"attempt": 2, "started_at": "2026-11-30T20:12:39+00:00", "ended_at": "2026-11-30T20:12:40+00:00",
                "outcome": "done", "error": None}]
    d = {"id": "email-2026-11-emp-00015", "rq_status": "finished",
         "ledger": {"kind": "email", "company_id": 1, "key": "slip:2026-11:emp-00015", "status": "done",
                    "attempts": 2, "history": history, "last_error": held}}
    text = render_detail(d, "Asia/Dhaka").plain
    [line] = [ln for ln in text.splitlines() if ln.startswith("ledger: ")]
    assert "1 held back (" in line and "its send-email process's own credentials refused" in line, line
