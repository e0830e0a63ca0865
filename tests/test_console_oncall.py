"""Session 42's on-call walkthrough (the console at 02:00 in tmux, 120x35 and 80x24): what
it showed of this session's additions, and what it did not."""

from __future__ import annotations

import time

from rich.text import Text

from console.app import ConsoleApp
from console.data import Limits, WorkerRow
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
        # (session 43: at 80 columns the alert is fitted, its "(where)" kept: test_console43_*)
        assert line.startswith("send-email app1:4300 PAUSED: credentials refused (its PAYRUN_EMAIL_TOKEN)"), line
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


class StoreFaultSource(FixedSource):
    """The fixed overview with app1's slip store remounted read-only: its render workers
    take none ("suspended"), a render worker's entry in payrun:slips:faults says why."""

    def __init__(self, code: int = 30):  # (errno.EROFS)
        super().__init__()
        self.code = code

    def snapshot(self):
        import errno
        import os

        from console.data import eta

        snap = fixed_snapshot()
        for w in snap.workers:
            if w.kind == "render":
                w.state, w.job_id, w.job_elapsed_s = "suspended", None, None
        snap.store_faults = [{"id": "3f2a", "host": "app1", "path": "/srv/payrun/slips", "mount": "/srv",
                              "errno": self.code, "error": f"{os.strerror(self.code)}, {errno.errorcode[self.code]}",
                              "since_ms": (NOW - 90) * 1000}]
        snap.eta = eta(snap.status["total"], 39.9, NOW, "Asia/Dhaka", store_free=10 << 30, store="/srv/payrun/slips",
                       store_faults=snap.store_faults)
        return snap


def test_the_eta_of_a_slip_store_that_cannot_be_written_says_which_and_what_to_do():
    """Session 43: with every render held by a store remounted read-only the console read
    "ETA 17:51 — on time for 09:00" (the full store's no-ETA was all it knew)."""
    import errno

    from console.data import eta
    from console.fmt import eta_text

    total = {"queued": 198, "running": 0, "retrying": 0, "done": 102, "failed": 0, "stuck": 0, "total": 300}
    ro = {"host": "app1", "path": "/srv/payrun/slips", "mount": "/srv", "errno": errno.EROFS,
          "error": "Read-only file system, EROFS", "since_ms": 1.0}
    out = eta(total, 4.7, NOW, "Asia/Dhaka", store_free=10 << 30, store_faults=[ro])
    assert out["at"] is None and out["store_faults"] == 1
    assert eta_text(out) == ("no ETA: slip store /srv/payrun/slips read-only on app1 (Read-only file system, EROFS): "
                             "every render waits, spending no attempt; check the disk (`dmesg`), then `mount -o "
                             "remount,rw /srv` (or replace the disk); the run goes on by itself"), eta_text(out)
    io = dict(ro, host="app2", errno=errno.EIO, error="Input/output error, EIO")
    text = eta_text(eta(total, 4.7, NOW, "Asia/Dhaka", store_faults=[io, ro]))
    assert text.startswith("no ETA: slip store /srv/payrun/slips failing on app2 (Input/output error, EIO) and 1 "
                           "more host's (`payrun status`): every render waits"), text
    assert "check the disk (`dmesg`) and replace it (or mount a healthy one at /srv)" in text
    assert eta_text(eta(total | {"queued": 0, "done": 300}, 0.0, NOW, "Asia/Dhaka", store_faults=[ro])) == \
        "all delivered"  # (nothing left: nothing waits on it)
    assert eta_text(eta(total, 4.7, NOW, "Asia/Dhaka", store_faults=[])).startswith("ETA ")


def test_a_render_workers_wait_is_its_own_hosts_store():
    """By host id (two hosts named alike), by hostname for a worker with none; a fault beats
    a full store; a send lane never reads so."""
    import errno

    from console.fmt import store_wait, worker_state

    def w(host, host_id, kind="render"):
        return WorkerRow(f"{kind}.{host}.1", host, 1, "pdf-render", "suspended", None, None, 1.0, True, False, kind,
                         host_id=host_id)

    faults = [{"id": "aaaa1111", "host": "app1", "errno": errno.EROFS}, {"id": "bbbb2222", "host": "app2",
                                                                         "errno": errno.EIO}]
    assert store_wait(w("app1", "aaaa1111"), False, faults) == "read-only"
    assert store_wait(w("app1", "cccc3333"), False, faults) is None  # (another host named app1)
    assert store_wait(w("app2", None), True, faults) == "failing"
    assert store_wait(w("app3", None), True, faults) == "full"
    assert store_wait(w("app1", "aaaa1111", kind="email"), True, faults) is None
    assert worker_state("suspended", "render", False, "read-only") == "waits: read-only"
    assert worker_state("suspended", "render", False, "failing") == "waits: disk error"
    assert worker_state("suspended", "render", True) == "waits: store full"
    assert worker_state("busy", "render", False, "read-only") == "busy"


@sync
async def test_a_render_worker_taking_none_while_the_slip_store_cannot_be_written_says_why():
    """Reproduced live (session 43, a tmpfs store remounted read-only, 80x24 in tmux): the
    answer read "ETA 17:51 — on time", the render processes "idle", the workers view
    "suspended". Now as for a full store, in its own words, at 80 columns."""
    from console.cli import worker_table
    from console.widgets.table import RESERVED
    from test_console_narrow import right_edge

    app = ConsoleApp(StoreFaultSource(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        said = str(app.screen.query_one("#answer").render())
        assert "no ETA: slip store /srv/payrun/slips read-only on app1" in said and "ETA 0" not in said, said
        assert "`mount -o remount,rw /srv`" in said.replace("\n", " ") and "the run goes on by itself" in said
        row = [str(c) for c in app.screen.query_one("#procs").get_row("app1:4101")]
        assert "takes none: slip store read-only" in row, row
        await pilot.press("w")
        await ready(pilot, lambda: app.screen.CRUMB == "workers")
        table = app.screen.query_one("#workers")
        assert str(table.get_row("render.app1.4101")[table.get_column_index("state")]) == "waits: read-only"
        assert 0 < right_edge(table, "alive") <= table.size.width - RESERVED  # (still on screen at 80)
    snap = StoreFaultSource(5).snapshot()  # (errno.EIO: a failing disk)
    lines = worker_table(snap.workers, False, snap.store_faults)
    assert any("render.app1.4101" in ln and "waits: disk error" in ln for ln in lines), lines


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


def test_the_paused_alert_drops_its_less_important_words_first_and_keeps_where():
    """At 80 columns the limits line's alert lost its "(where)": the part that says what to
    fix. Its shorter forms drop the provider's wording, the long words of where, how long,
    then "send-email"; each keeps which process and where its credentials come from."""
    from console.fmt import columns, longest_fitting, paused_sender_alerts, short_where

    assert short_where(WHERE) == ["PAYRUN_EMAIL_TOKEN in this process's environment",
                                  "PAYRUN_EMAIL_TOKEN in its environment", "its PAYRUN_EMAIL_TOKEN"]
    token_file = ("the local provider's token file /srv/payrun/var/redis/provider-token (PAYRUN_EMAIL_TOKEN not "
                  "set; read again before each probe)")
    assert short_where(token_file)[-1] == "token file …/redis/provider-token"
    assert short_where("PAYRUN_SMTP_PASSWORD (login 'payrun' at smtp.example:587)") == ["PAYRUN_SMTP_PASSWORD"]
    assert short_where("no token: PAYRUN_EMAIL_TOKEN is not set")[-1] == "PAYRUN_EMAIL_TOKEN not set"
    for host in ("vm", "payrun-worker-02.dhaka"):
        for where, must in ((WHERE, "PAYRUN_EMAIL_TOKEN"), (token_file, "provider-token"),
                            ("PAYRUN_SMTP_PASSWORD (login 'u' at h:25)", "PAYRUN_SMTP_PASSWORD")):
            r = {"host": host, "pid": 24303, "since_ms": (NOW - 62) * 1000, "where": where}
            forms = paused_sender_alerts(r, NOW)
            assert forms[0] == (f"send-email {host}:24303 PAUSED 1m02s: provider refuses its credentials "
                                f"({where.split(' (')[0]})")
            assert all(f"{host}:24303 PAUSED" in f and must in f for f in forms), forms
            assert [columns(f) for f in forms] == sorted((columns(f) for f in forms), reverse=True)
            fitted = longest_fitting(forms, 78)  # (an 80-column terminal, less the line's padding)
            assert columns(fitted) <= 78 and must in fitted, fitted
    assert longest_fitting(["a long one", "short"], None) == "a long one"
    assert longest_fitting(["a long one", "short"], 3) == "short"


class TwoSendersSource(FixedSource):
    """Two send-email processes: app1:4200 sending (45 lanes, 43 busy) and app1:4300 paused
    for its credentials (50 lanes); two render workers and a control worker."""

    def __init__(self, drained: bool = False):
        super().__init__()
        self.drained = drained

    def snapshot(self):
        snap = fixed_snapshot()
        paused = [_lane(4300, i) for i in range(50)]
        for w in paused:
            w.paused_s = 65.0
        snap.workers = paused + snap.workers + [
            WorkerRow("control.app1.4000", "app1", 4000, "control", "idle", None, None, 2.0, True, False, "control")]
        snap.refused_senders = [{"process": "email.app1.4300", "host": "app1", "pid": 4300,
                                 "since_ms": (NOW - 65) * 1000, "where": WHERE}]
        if self.drained:
            snap.paused_queues = ["send-email"]
        return snap


@sync
async def test_the_limits_line_keeps_where_a_paused_processs_credentials_come_from_at_80_columns():
    from console.fmt import columns

    full = ("send-email app1:4300 PAUSED 1m05s: provider refuses its credentials (PAYRUN_EMAIL_TOKEN in this "
            "process's environment)")

    def alert_of(app, drained: bool) -> tuple[str, int]:
        """The paused process's alert, and the columns the line takes up to its end."""
        alerts = str(app.screen.query_one("#limits").render()).split(" · ")
        return alerts[int(drained)], columns(" · ".join(alerts[:int(drained) + 1]))

    for size, drained in (((80, 24), False), ((80, 24), True), ((120, 35), False)):
        app = ConsoleApp(TwoSendersSource(drained), clock=lambda: NOW, poll=False, no_blink=True)
        async with app.run_test(size=size) as pilot:
            await ready(pilot, lambda: app.snapshot is not None)
            alert, end = alert_of(app, drained)
            assert "app1:4300 PAUSED" in alert and "PAYRUN_EMAIL_TOKEN" in alert, alert
            assert end <= size[0] - 2, (size, alert)  # (on the line's one row, not wrapped off it)
            if not drained:
                assert alert.startswith("send-email app1:4300 PAUSED"), alert
            if size[0] == 120:  # room for every word
                assert alert == full, alert
            await pilot.resize_terminal(200 if size[0] == 80 else 80, size[1])  # (fitted again on a resize)
            await ready(pilot, lambda: alert_of(app, drained)[0] != alert, "the alert fitted again")
            alert, end = alert_of(app, drained)
            assert (alert == full) == (app.size.width == 200) and end <= app.size.width - 2, alert


class RebootedSenderSource(FixedSource):
    """A host rebooted (a new host id): its send-email process came back with the pid it
    had (supervisord starts its programs in one order) and 10 lanes; lanes 10-49 of the
    process before the reboot are still listed (gone), under the same process name."""

    def snapshot(self):
        snap = fixed_snapshot()
        old = [_lane(4300, i) for i in range(10, 50)]
        new = [_lane(4300, i) for i in range(10)]
        for w in old:
            w.alive, w.host_id = False, "b00t0ld0"
        for w in new:
            w.host_id = "b00tnew1"
        from console.data import tag_hosts

        snap.workers = tag_hosts(old + new + snap.workers)  # (as the console's read does)
        return snap


@sync
async def test_the_workers_view_shows_two_processes_of_one_name_from_two_host_ids():
    """Review (session 43): the workers view keyed a send-email process's row by its name
    (email.<host>.<pid>); a rebooted host's new process of the same pid beside its old
    one's lapsing lanes made two rows of one key, and the view failed on every refresh."""
    app = ConsoleApp(RebootedSenderSource(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(120, 35)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        await pilot.press("w")
        await ready(pilot, lambda: app.screen.CRUMB == "workers")
        table = app.screen.query_one("#workers")
        keys = [str(k.value) for k in table.rows]
        assert "email.app1.4300" in keys and any(k.startswith("email.app1.4300/") for k in keys), keys
        assert not app.snapshot.error, app.snapshot.error


def test_payrun_workers_lists_the_processes_before_the_send_lanes():
    """Two send-email processes of 45 and 50 lanes: `payrun workers` listed the render
    workers after the 95 lane rows (by name), and the paused process's state after the
    other's 45 lanes."""
    from console.cli import worker_table
    from conftest import assert_worker_columns_line_up

    snap = TwoSendersSource().snapshot()
    lines = worker_table(snap.workers)
    assert len(lines) == 1 + 2 + 2 + 1 + 95, len(lines)
    heads = [ln.split()[0] for ln in lines[1:6]]
    assert heads == ["render.app1.4101", "render.app1.4102", "email.app1.4200.*", "email.app1.4300.*",
                     "control.app1.4000"], lines[:6]
    assert "(45 lanes)" in lines[3] and "43/45 busy" in lines[3] and "email-2026-11-emp-" in lines[3], lines[3]
    assert "(50 lanes)" in lines[4] and " PAUSED " in lines[4], lines[4]
    assert [ln.split()[0] for ln in lines[6:]] == sorted(w.name for w in snap.workers if w.kind == "email")
    assert_worker_columns_line_up("\n".join(lines))


@sync
async def test_the_workers_view_shows_each_process_before_the_send_lanes():
    """The workers view listed every worker by kind and name: the render workers came after
    95 send lanes (a screen and a half of scrolling at 120x35, four at 80x24)."""
    for size in ((80, 24), (120, 35)):
        app = ConsoleApp(TwoSendersSource(), clock=lambda: NOW, poll=False, no_blink=True)
        async with app.run_test(size=size) as pilot:
            await ready(pilot, lambda: app.snapshot is not None)
            await pilot.press("w")
            await ready(pilot, lambda: app.screen.CRUMB == "workers")
            table = app.screen.query_one("#workers")
            assert table.keys()[:5] == ["render.app1.4101", "render.app1.4102", "email.app1.4200",
                                        "email.app1.4300", "control.app1.4000"], table.keys()[:6]
            state = table.get_column_index("state")
            assert str(table.get_row("email.app1.4200")[state]) == "43/45 busy"
            assert str(table.get_row("email.app1.4300")[state]) == "PAUSED"
            assert str(table.get_row("email.app1.4300.07")[state]) == "PAUSED"  # (the lanes after)
            assert str(table.get_row("email.app1.4200")[0]) == "email.app1.4200.*"
            from console.widgets.table import RESERVED
            from test_console_narrow import right_edge

            assert 0 < right_edge(table, "alive") <= table.size.width - RESERVED  # (still on screen at 80)
            # s on a process row stops the process (through a lane of it: the name RQ knows)
            table.move_cursor(row=table.get_row_index("email.app1.4300"))
            await pilot.press("s")
            await ready(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
            assert app.screen.command == "payrun stop-worker email.app1.4300.00"
            assert "process 4300 on app1 (all 50 lanes" in app.screen.title_text, app.screen.title_text


def test_two_hosts_with_one_hostname_get_a_suffix_of_their_host_id():
    """Containers or cloned VMs share a hostname; payrun.procs.host_id tells them apart,
    but the console and `payrun workers` showed their workers as one host's."""
    from console.data import tag_hosts
    from console.fmt import host_tags, tagged, tagged_name

    def w(name, host, pid, host_id, alive=True, kind="render"):
        return WorkerRow(name, host, pid, "pdf-render", "idle", None, None, 1.0, alive, False, kind, host_id=host_id)

    one = [w("render.app1.10", "app1", 10, "aaaa1111"), w("render.app1.11", "app1", 11, "aaaa1111"),
           w("render.app2.10", "app2", 10, "cccc3333")]
    assert host_tags(one) == {}
    two = one + [w("render.app1.1", "app1", 1, "bbbb2222")]
    assert host_tags(two) == {("app1", "aaaa1111"): "aaaa", ("app1", "bbbb2222"): "bbbb"}
    close = one + [w("render.app1.1", "app1", 1, "aaaa9999")]  # (alike in 4 characters: 5)
    assert host_tags(close) == {("app1", "aaaa1111"): "aaaa1", ("app1", "aaaa9999"): "aaaa9"}
    restarted = one + [w("render.app1.12", "app1", 12, "dddd4444", alive=False)]  # a container's last boot
    assert host_tags(restarted) == {}
    same_pid = one + [w("render.app1.10x", "app1", 10, "dddd4444", alive=False)]  # "app1:10" would be two
    assert host_tags(same_pid)[("app1", "dddd4444")] == "dddd"
    assert host_tags(one + [w("render.app1.1", "app1", 1, None)]) == {}  # (a worker before session 42)
    assert tagged("app1", "bbbb") == "app1/bbbb" and tagged("app1", None) == "app1"
    assert tagged("a-very-long-hostname-of-a-vm", "bbbb", 18) == "a-very-long-hostna/bbbb"
    assert tagged_name("email.app1.4200.07", "app1", "bbbb") == "email.app1/bbbb.4200.07"
    tag_hosts(two)
    assert [x.where for x in two] == ["app1/aaaa:10", "app1/aaaa:11", "app2:10", "app1/bbbb:1"]


class NamesakesSource(FixedSource):
    """The fixed overview, with a third render worker on another host named app1."""

    def snapshot(self):
        from console.data import tag_hosts

        snap = fixed_snapshot()
        for w in snap.workers:
            w.host_id = "aaaa1111"
        snap.workers.append(WorkerRow("render.app1.7", "app1", 7, "pdf-render", "idle", None, None, 1.0, True, False,
                                      "render", host_id="bbbb2222"))
        tag_hosts(snap.workers)
        return snap


@sync
async def test_the_console_and_payrun_workers_tell_two_hosts_named_alike_apart():
    from console.cli import worker_table

    app = ConsoleApp(NamesakesSource(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        procs = app.screen.query_one("#procs")
        assert str(procs.get_row("app1/bbbb:7")[0]) == "app1/bbbb:7"
        assert str(procs.get_row("app1/aaaa:4200")[0]) == "app1/aaaa:4200"
        await pilot.press("w")
        await ready(pilot, lambda: app.screen.CRUMB == "workers")
        table = app.screen.query_one("#workers")  # (at 80 columns host:pid is left out: the name says it)
        assert str(table.get_row("render.app1.7")[0]) == "render.app1/bbbb.7"
        assert str(table.get_row("render.app1.4101")[0]) == "render.app1/aaaa.4101"
    lines = worker_table(NamesakesSource().snapshot().workers)
    assert any(ln.startswith("render.app1.7 ") and " app1/bbbb:7 " in ln for ln in lines), lines
    assert any(ln.startswith("render.app1.4101 ") and " app1/aaaa:4101 " in ln for ln in lines), lines


def test_a_paused_process_of_a_host_named_alike_is_named_with_its_suffix(conn):
    from console.data import read_paused_senders, tag_hosts
    from console.screens.overview import paused_sender_alert
    from jobs.senders import refused_line

    now = time.time()
    conn.hset(keys.limit_senders("email"), "email.app1.4300",
              sender_entry(WHERE, now * 1000 + SENDER_TTL_S * 1000, (now - 65) * 1000))
    workers = [_lane(4200, 0), _lane(4300, 0), _lane(4300, 1)]
    workers[0].host_id, workers[1].host_id, workers[2].host_id = "aaaa1111", "bbbb2222", "bbbb2222"
    [r] = read_paused_senders(conn, tag_hosts(workers), now)
    assert (r["host_id"], r["host_tag"]) == ("bbbb2222", "bbbb")
    assert refused_line(r, now * 1000).startswith("send-email app1/bbbb pid 4300 PAUSED 65 s")
    assert paused_sender_alert(r, now).startswith("send-email app1/bbbb:4300 PAUSED 1m05s")


@sync
async def test_a_view_failing_on_one_refresh_does_not_end_the_polling():
    """Walkthrough (session 43, tmux): the console read "last refresh 43s ago (Redis slow;
    still trying)" with Redis fine and no poll in flight: a view's error on one snapshot
    ended in the poll thread, and no next poll was set. It is said, and polling goes on."""
    from console.screens.overview import OverviewScreen

    fail = {"left": 1}
    show = OverviewScreen.show_snapshot

    def flaky(self, snap):
        if fail["left"]:
            fail["left"] -= 1
            fail["snap"] = snap  # (the next poll, 1 s on, may replace app.snapshot before we look)
            raise KeyError("host_tag")
        return show(self, snap)

    OverviewScreen.show_snapshot = flaky
    try:
        app = ConsoleApp(FixedSource(), clock=lambda: NOW, poll=True, interval_s=1.0, no_blink=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot, lambda: not fail["left"] and app.snapshot is not None, "the failing refresh")
            failed_at = app.polls
            assert "the overview view failed to show a refresh (KeyError: 'host_tag')" in (fail["snap"].error or "")
            await ready(pilot, lambda: app.polls > failed_at and app.snapshot is not fail["snap"], "polling to go on")
            assert not app.snapshot.error
    finally:
        OverviewScreen.show_snapshot = show


# ---- session 43 (followups): at a low rate the rate, not the cap, holds the sends back ------------

def test_at_a_low_rate_the_limits_line_says_the_rate_allows_fewer_slots_than_the_cap(cfg, conn):
    """`payrun limits show` says "at 2/s at most 22 slots are taken at once"; the console
    read "email 13/50 in flight" and nothing more, inviting a raised cap."""
    from console.data import read_limits
    from console.fmt import in_flight_notes
    from jobs.limits import rate_slots, set_limits
    from jobs.policy import start_wait_budget_s

    set_limits(conn, "email", cap=50, rate_per_s=2.0)
    lim = read_limits(conn, cfg)
    assert lim.slots_for_rate == 22 == rate_slots(2.0, start_wait_budget_s(cfg.email.timeout_s))
    assert rate_slots(2.0, None) is None and rate_slots(0.0, 15.0) is None
    set_limits(conn, "email", rate_per_s=40.0)
    assert read_limits(conn, cfg).slots_for_rate >= 50  # (the cap binds first: nothing more said)
    assert in_flight_notes(43, 45, 40.0, 0, 500) == [""]
    assert in_flight_notes(43, 45, 40.0, 3, 500) == [" (3 waiting for the rate)"]  # (as before)
    forms = in_flight_notes(13, 50, 2.0, 11, 22)
    assert forms[0] == (" (11 waiting for the rate; at 2/s at most 22 at once: the rate holds sends back, not the "
                        "cap)") and forms[-1] == "" and " (the rate allows 22)" in forms
    assert [len(f) for f in forms] == sorted((len(f) for f in forms), reverse=True)


def test_the_limits_dialogs_note_says_a_cap_above_what_the_rate_allows_sends_no_faster():
    from console.fmt import cap_over_rate_note

    assert cap_over_rate_note(50, 2.0, 22) == ("the rate 2/s allows only 22 in flight: a cap above that (50) sends "
                                               "no faster; raise the rate to send faster")
    assert cap_over_rate_note(22, 2.0, 22) == cap_over_rate_note(50, 40.0, 481) == ""
    assert cap_over_rate_note(None, 2.0, 22) == cap_over_rate_note(50, None, 22) == cap_over_rate_note(50, 2.0, None) == ""


class LowRateSource(FixedSource):
    """The fixed overview at `payrun limits set --rate 2` (session 43's reproduction: 13 of
    50 slots in use, 11 of them waiting for their start, 22 the most the rate lets)."""

    def snapshot(self):
        snap = fixed_snapshot()
        snap.limits = Limits(cap=50, rate_per_s=2.0, in_use=13, waits=12_049, http_429=0, paused_for_s=0,
                             waiting_for_rate=11, slots_for_rate=22)
        snap.retry_errors = []
        return snap


@sync
async def test_the_limits_line_at_a_low_rate_fits_80_columns_and_says_more_when_wider():
    for width, said in ((80, "email 13/50 in flight (the rate allows 22) · limit 2/s · 12,049 waits · 0 429s"),
                        (160, "email 13/50 in flight (11 waiting for the rate; at 2/s at most 22 at once: the rate "
                              "holds sends back, not the cap) · limit 2/s · 12,049 waits · 0 429s")):
        app = ConsoleApp(LowRateSource(), clock=lambda: NOW, poll=False, no_blink=True)
        async with app.run_test(size=(width, 30)) as pilot:
            await ready(pilot, lambda: app.snapshot is not None)
            line = app.screen.query_one("#limits")
            text = line.render()
            assert str(text) == said, (width, str(text))
            assert Text(str(text)).cell_len <= line.size.width, (width, line.size.width)


def test_a_store_that_cannot_be_written_holds_no_eta_back_once_every_render_is_made():
    """Seen live (session 43, followups): every render made, 949 sends left at 2/s, the store
    remounted read-only: "no ETA: … every render waits", though sends only read their slips.
    The same for a full store."""
    import errno

    from console.data import QueueRow, eta, renders_to_make
    from console.fmt import eta_text

    total = {"queued": 949, "running": 13, "retrying": 0, "done": 2_038, "failed": 0, "stuck": 0, "total": 3_000}
    ro = [{"host": "vm", "path": "/srv/slips", "mount": "/srv", "errno": errno.EROFS, "error": "Read-only file system, "
           "EROFS", "since_ms": None}]
    renders = QueueRow("pdf-render", 0, 0, 0, 0, None, [], False)
    sends = QueueRow("send-email", 949, 13, 0, 0, 700.0, [], False)
    assert not renders_to_make([renders, sends])
    assert renders_to_make([QueueRow("pdf-render", 0, 0, 3, 0, None, [], False)])  # (held: waiting out its hold)
    for kw in ({"store_faults": ro}, {"store_free": 4096, "store": "/srv/slips"}):
        assert eta_text(eta(total, 2.0, NOW, "Asia/Dhaka", renders_left=False, **kw)).startswith("ETA "), kw
        assert eta_text(eta(total, 2.0, NOW, "Asia/Dhaka", **kw)).startswith("no ETA: slip store "), kw
