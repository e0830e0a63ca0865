"""The SQLite ledger's schema: an existing ledger is upgraded in place, and the HR count
reads its slip states from indexes alone (a query plan, not a timing)."""

from __future__ import annotations

import sqlite3
import time
import subprocess
import sys

import pytest

from payrun import ledger as ledger_mod
from payrun.ledger import MIGRATIONS, Ledger

MONTH = "2026-11"


def _rows():
    """Six slips of two companies in every state the count distinguishes."""
    out = []
    for i, (render, email) in enumerate([("done", "done"), ("done", "failed"), ("failed", None),
                                         ("done", "running"), ("done", None), ("queued", None)]):
        emp, company = f"emp-{i:05d}", 1 + i % 2
        key = f"slip:{MONTH}:{emp}"
        out.append((f"render-{MONTH}-{emp}", "render", company, emp, MONTH, key, render))
        if email:
            out.append((f"email-{MONTH}-{emp}", "email", company, emp, MONTH, key, email))
    return out


def _version_1(path, rows) -> None:
    old = sqlite3.connect(path)
    old.execute("PRAGMA journal_mode = WAL")  # as every ledger payrun wrote (Ledger.__init__)
    old.executescript(MIGRATIONS[0])
    old.execute("PRAGMA user_version = 1")
    old.executemany("INSERT INTO jobs (id, kind, company_id, employee_id, month, key, status)"
                    " VALUES (?,?,?,?,?,?,?)", rows)
    old.commit()
    old.close()


def _schema(path) -> tuple[int, set[str]]:
    c = sqlite3.connect(path)
    try:
        return (c.execute("PRAGMA user_version").fetchone()[0],
                {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE 'jobs_%'")})
    finally:
        c.close()


def test_a_version_1_ledger_is_upgraded_in_place_and_counts_the_same(tmp_path):
    path = tmp_path / "ledger.db"
    _version_1(path, _rows())

    led = Ledger(path)
    assert led.db.conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    indexes = {r[0] for r in led.db.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'"
                                                 " AND name LIKE 'jobs_%'")}
    assert indexes == {"jobs_month_kind_slip", "jobs_key_status", "jobs_status"}
    counts = led.slip_counts(MONTH)
    assert {c: {k: v for k, v in row.items() if v} for c, row in counts.items()} == {
        1: {"done": 1, "failed": 1, "queued": 1, "total": 3},  # emp 0, 2, 4 (rendered, email not made yet)
        2: {"failed": 1, "running": 1, "queued": 1, "total": 3},
    }
    Ledger(path).close()  # opening it again migrates nothing


def test_the_hr_count_reads_slip_states_from_indexes_alone(tmp_path):
    """SLIP_STATUS_SQL visits every render row of the month and its email row: from the
    table, that was half the time of a console HR refresh at 50,000 slips."""
    led = Ledger(tmp_path / "ledger.db")
    sql = "EXPLAIN QUERY PLAN " + led.SLIP_STATUS_SQL.format(
        filters=" AND r.month = :month", resent=led.RESENT_SQL.format(month="AND rr.month = :month"))
    plan = " / ".join(r[3] for r in led.db.conn.execute(sql, {"month": MONTH}))
    assert "SEARCH r USING COVERING INDEX jobs_month_kind_slip" in plan, plan
    assert "SEARCH e USING COVERING INDEX jobs_key_status" in plan, plan
    # slips a resend delivered: the month's few resend rows, once, not a probe per slip
    assert "SEARCH rr USING COVERING INDEX jobs_month_kind_slip (month=? AND kind=?)" in plan, plan
    assert "CORRELATED" not in plan, plan


def test_an_upgrade_that_fails_half_way_leaves_the_old_schema_whole(tmp_path, monkeypatch):
    path = tmp_path / "ledger.db"
    _version_1(path, _rows())
    monkeypatch.setattr(ledger_mod, "MIGRATIONS", [MIGRATIONS[0], MIGRATIONS[1] + "CREATE INDEX broken ON nope(x);"])
    with pytest.raises(sqlite3.OperationalError):
        Ledger(path)
    # nothing of migration 2 happened: not the new indexes, not the old ones dropped
    assert _schema(path) == (1, {"jobs_month_kind", "jobs_key", "jobs_status"})


def test_processes_opening_an_old_ledger_together_upgrade_it_once(tmp_path):
    """`payrun up` starts the ledger, the scheduler and workers at once: each opens the
    ledger; one upgrades it, the others wait for it and find it done."""
    path = tmp_path / "ledger.db"
    rows = [(f"render-{i}", "render", 1 + i % 60, f"emp-{i}", MONTH, f"slip:{MONTH}:emp-{i}", "done")
            for i in range(60_000)]
    _version_1(path, rows)
    code = "import sys; from payrun.ledger import Ledger; Ledger(sys.argv[1]).close(); print('opened')"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert _schema(path) == (len(MIGRATIONS), {"jobs_month_kind_slip", "jobs_key_status", "jobs_status"})


def test_a_held_try_is_a_retrying_event_that_a_current_ledger_records_as_held(tmp_path):
    """Workers send a held try as status "retrying" with held=1: a ledger of the version
    before (workers upgraded first, on another host) records a retry, as it always did;
    this one records "held" (and counts it as no attempt spent)."""
    from jobs.events import event, outcome_of

    led = Ledger(tmp_path / "ledger.db")
    led.create_jobs([{"id": "email-1", "kind": "email"}])
    held = event("email-1", "retrying", attempt=1, error="provider down", delay=5.0, held=1)
    assert outcome_of(held) == "held" and "outcome" not in held
    led.apply([event("email-1", "running", attempt=1), held,
               event("email-1", "running", attempt=2), event("email-1", "retrying", attempt=2, error="HTTP 503"),
               event("email-1", "running", attempt=3), event("email-1", "done", attempt=3)])
    job = led.job("email-1")
    assert [h["outcome"] for h in job["history"]] == ["held", "retrying", "done"]
    assert job["status"] == "done" and job["attempts"] == 3


def test_the_run_started_last_wins_a_tie_in_the_same_millisecond(tmp_path, monkeypatch):
    """CI, on a fast host, claimed last month's run in the same millisecond as this month's:
    `payrun status` picked the higher month. Of two runs claimed at the same instant the
    one inserted last is the run started last (the console reads it the same way)."""
    monkeypatch.setattr(ledger_mod, "utcnow", lambda: "2026-12-01T01:00:00.000+00:00")
    led = Ledger(tmp_path / "ledger.db")
    led.claim_run(1, "2026-11", "a")
    led.claim_run(2, "2026-11", "a")
    led.claim_run(1, "2026-10", "late")
    assert led.latest_month() == "2026-10"
    assert ledger_mod.latest_month(led.runs()) == "2026-10"
    led.claim_run(3, "2026-11", "b")
    assert led.latest_month() == "2026-11"
    monkeypatch.setattr(ledger_mod, "utcnow", lambda: "2026-11-30T23:59:59.999+00:00")  # clock stepped back
    led.claim_run(4, "2026-09", "old")
    assert led.latest_month() == "2026-11"  # the timestamps still decide first
    assert ledger_mod.latest_month([]) is None


def test_a_second_ledger_waits_and_takes_no_event_from_the_one_applying_them(tmp_path, conn, caplog):
    """Multi-host drill: `payrun up` on a worker host started a second ledger on the same
    event group: it took a share of the events into its own file, and the control host's
    ledger showed 134 of 287 delivered slips as queued for ever. One ledger owns the events
    (a lease in Redis); another waits, says why, and applies nothing; a killed ledger's
    restart on the same host and file takes over at once."""
    import logging
    import os
    import threading

    from jobs import events

    first, second = Ledger(tmp_path / "control.db"), Ledger(tmp_path / "worker-host.db")
    me_first = f"control 1 {tmp_path / 'control.db'}"
    me_second = ledger_mod.owner_id(tmp_path / "worker-host.db")
    assert ledger_mod.own_events(conn, me_first) is None  # the control host's ledger applies them
    first.create_jobs([{"id": f"render-{MONTH}-emp-{i:05d}", "kind": "render", "company_id": 1, "month": MONTH,
                        "queue": "pdf-render"} for i in range(5)])
    for i in range(5):
        events.emit(conn, f"render-{MONTH}-emp-{i:05d}", "running", worker="w", attempt=1)
    stop = threading.Event()
    with caplog.at_level(logging.ERROR, logger="payrun.test"):
        t = threading.Thread(target=ledger_mod.serve, args=(conn, second, stop.is_set),
                             kwargs={"log": logging.getLogger("payrun.test"), "me": me_second})
        t.start()
        deadline = time.monotonic() + 20
        while "another ledger applies the events" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        t.join(10)
    assert f"another ledger applies the events ({me_first})" in caplog.text
    assert "payrun up --role worker" in caplog.text
    assert second.db.conn.execute("SELECT COUNT(*) FROM attempts").fetchone()[0] == 0  # it took nothing
    assert ledger_mod.drain(conn, first) == 5  # all five are the control host's

    # a ledger of this host and file that was killed: its restart does not wait out the lease
    dead = f"{me_second.split(' ')[0]} 999999999 {tmp_path / 'control.db'}"
    conn.set("payrun:ledger:owner", dead, px=ledger_mod.LEDGER_LEASE_MS)
    stop.clear()
    me_again = ledger_mod.owner_id(tmp_path / "control.db")
    t = threading.Thread(target=ledger_mod.serve, args=(conn, first, stop.is_set), kwargs={"me": me_again})
    t.start()
    deadline = time.monotonic() + 20
    while ledger_mod.events_owner(conn) != me_again and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    t.join(10)
    assert ledger_mod.events_owner(conn) == me_again and os.getpid() == int(me_again.split(" ")[1])
    ledger_mod.let_go_of_events(conn, me_again)
    assert ledger_mod.events_owner(conn) is None


def test_a_ledger_of_another_machine_with_this_hostname_is_not_taken_for_a_dead_one_of_ours(tmp_path):
    """Two control hosts with one hostname and one data directory path (a cloned image):
    the second's ledger took the first's live ownership of the events for a killed ledger
    of its own (its pid is not alive here) and deleted it, and both applied the events,
    each into its own file. The owner id says the host id; one without it (before
    session 42) is judged by hostname, as before."""
    import socket

    from payrun.procs import host_id

    path = tmp_path / "ledger.db"
    me = ledger_mod.owner_id(path)
    assert me.startswith(f"{socket.gethostname()}/{host_id()} ") and me.endswith(f" {path}")
    theirs = f"{socket.gethostname()}/0badcafe 999999999 {path}"
    ours_dead, before_42 = f"{socket.gethostname()}/{host_id()} 999999999 {path}", f"{socket.gethostname()} 999999999 {path}"
    assert not ledger_mod._dead_here(theirs, me) and not ledger_mod.owned_here(theirs, path)
    assert ledger_mod._dead_here(ours_dead, me) and ledger_mod.owned_here(ours_dead, path)
    assert ledger_mod._dead_here(before_42, me) and ledger_mod.owned_here(before_42, path)


def test_status_notes_a_failed_resend_the_slip_counts_leave_out(tmp_path):
    """HR's `payrun resend` failed for good (an address refused); `payrun status` read
    "12 sent, 0 failed" and said nothing, since a slip counts once, by its first email."""
    from payrun import config, status

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    led = Ledger(tmp_path / "ledger.db")
    key = f"slip:{MONTH}:emp-1"
    rows = [dict(id=f"render-{MONTH}-emp-1", kind="render", company_id=1, employee_id="emp-1", month=MONTH,
                 key=key, status="done"),
            dict(id=f"email-{MONTH}-emp-1", kind="email", company_id=1, employee_id="emp-1", month=MONTH,
                 key=key, status="done")]
    for n, (r_status, e_status) in enumerate([("done", "failed"), ("failed", None), ("done", "done")], 1):
        rk = f"{key}:resend-{n}"
        rows.append(dict(id=f"resend-{MONTH}-emp-1-{n}", kind="resend", company_id=1, employee_id="emp-1",
                         month=MONTH, key=rk, status=r_status))
        if e_status:
            rows.append(dict(id=f"email-{MONTH}-emp-1-resend-{n}", kind="email", company_id=1, employee_id="emp-1",
                             month=MONTH, key=rk, status=e_status))
    led.create_jobs(rows)
    led.claim_run(1, MONTH, "test")
    assert led.failed_resends(MONTH) == 2 and led.failed_resends(MONTH, 2) == 0
    r = status.report(cfg, led, MONTH)
    assert r["total"]["done"] == 1 and r["total"]["failed"] == 0  # the slip itself was delivered
    assert any(f"2 resends (`payrun resend`) of {MONTH} failed for good" in n
               and f"payrun failed --month {MONTH}" in n for n in r["notes"]), r["notes"]
    led.close()


def _version_3(path, rows) -> None:
    """A ledger as the version before the send's address was kept (schema 3)."""
    old = sqlite3.connect(path)
    old.execute("PRAGMA journal_mode = WAL")
    for sql in MIGRATIONS[:3]:
        old.executescript(sql)
    old.execute("PRAGMA user_version = 3")
    old.executemany("INSERT INTO jobs (id, kind, company_id, employee_id, month, key, status)"
                    " VALUES (?,?,?,?,?,?,?)", rows)
    old.commit()
    old.close()


def test_a_version_3_ledger_gains_the_sends_address_in_place_and_keeps_its_rows(tmp_path):
    """Migration 4 adds jobs.recipient to an existing ledger (rows kept, address unknown for
    sends made before); a send's "queued" event with ``to`` sets it, a retry's again; `payrun
    job`'s row (and --json) keeps its shape: no address in it."""
    from jobs.events import event

    path = tmp_path / "ledger.db"
    _version_3(path, _rows())
    led = Ledger(path)
    assert led.db.conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) == 4
    assert led.db.conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == len(_rows())
    assert led.recipients([f"email-{MONTH}-emp-00000"]) == {}  # made before: not known
    sends = [f"email-{MONTH}-emp-00004", f"email-{MONTH}-emp-00001"]
    led.apply([event(sends[0], "queued", kind="email", company=1, employee="emp-00004", month=MONTH,
                     key=f"slip:{MONTH}:emp-00004", queue="send-email", to="a@example.org"),
               event(sends[0], "running", attempt=1), event(sends[0], "done", attempt=1),
               event(sends[1], "queued", reset=1, to="fixed@example.org")])  # a retry to the fixed address
    assert led.recipients([*sends, "nope"]) == {sends[0]: "a@example.org", sends[1]: "fixed@example.org"}
    assert "recipient" not in led.job(sends[0]) and all("recipient" not in r for r in led.jobs(limit=20))
    assert led.slip_counts(MONTH)[1]["done"] == 2  # emp 0 and now emp 4 (company 1 + i % 2)
    led.close()
    Ledger(path).close()  # opening it again migrates nothing


def test_a_send_made_and_a_send_retried_tell_the_ledger_their_address(world, caplog):
    """The address a send goes to reaches the ledger through its events (workers never
    open it): when the send is made (jobs.tasks.enqueue_email), and when `payrun retry`
    reads it again from the payroll data. Never in a log line."""
    import logging

    from rq.registry import FailedJobRegistry

    from jobs import tasks
    from jobs.runtime import make_queue
    from payrun import deadletters, keys, payroll

    cfg, conn, db, ledger = world
    month = "2026-11"
    emp = db.conn.execute("SELECT id, email FROM employees ORDER BY id LIMIT 1").fetchone()
    snap = payroll.employee_snapshot(db, month, emp[0])
    caplog.set_level(logging.DEBUG)
    job_id = tasks.enqueue_email(conn, cfg, tasks.email_payload(snap, f"{month}/1/{emp[0]}.pdf"))
    ledger_mod.ensure_group(conn)
    ledger_mod.drain(conn, ledger)
    assert ledger.recipients([job_id]) == {job_id: emp[1]}
    # it fails for good; HR fixes the address; `payrun retry` sends it to the new one
    q = make_queue(keys.EMAIL_QUEUE, conn)
    job = q.fetch_job(job_id)
    q.remove(job)
    job.set_status("failed")
    FailedJobRegistry(queue=q).add(job, ttl=600)
    db.conn.execute("UPDATE employees SET email = 'fixed@example.org' WHERE id = ?", (emp[0],))
    db.conn.commit()
    assert deadletters.retry(cfg, conn, [job_id], db) == ([job_id], [])
    ledger_mod.drain(conn, ledger)
    assert ledger.recipients([job_id]) == {job_id: "fixed@example.org"}
    logged = [f"{r.getMessage()} {r.__dict__}" for r in caplog.records]
    assert any(f"job {job_id} queued" in line for line in logged), logged  # (its line is there ...)
    assert not [line for line in logged if emp[1] in line or "fixed@example.org" in line]  # (... without the address)


def test_an_address_changed_and_back_is_not_called_the_old_one_after_redis_dropped_the_send(cfg, conn, tmp_path):
    """A -> B -> A once Redis had dropped the finished jobs (a day after): the import
    compared the address on file with the one Redis held for the send, found none, and
    said "delivered to the old address ... `payrun resend`" of a slip delivered to the
    address on file. The ledger keeps the send's address."""
    import csv

    from click.testing import CliRunner

    from jobs import tasks
    from payrun import payroll
    from payrun.cli import cli

    runner = CliRunner()
    runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    runner.invoke(cli, ["import", "docs/sample-employees.csv"])
    assert runner.invoke(cli, ["run", "--month", MONTH]).exit_code == 0
    with open("docs/sample-employees.csv", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    e6, old = rows[6]["employee_id"], rows[6]["email"]
    with payroll.PayrollDB(cfg.payroll_path) as db:  # its render made its send, to A
        snap = payroll.employee_snapshot(db, MONTH, e6)
    send = tasks.enqueue_email(conn, cfg, tasks.email_payload(snap, f"{MONTH}/1/{e6}.pdf"))
    led = Ledger(cfg.ledger_path)
    ledger_mod.ensure_group(conn)
    ledger_mod.drain(conn, led)
    with led.db.conn:  # delivered
        led.db.conn.execute("UPDATE jobs SET status = 'done' WHERE employee_id = ?", (e6,))
    led.close()
    conn.flushdb()  # a day later: Redis has dropped the finished render and send

    def import_with(email: str) -> str:
        rows[6]["email"] = email
        path = tmp_path / "emp.csv"
        with open(path, "w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header)
            w.writeheader()
            w.writerows(rows)
        out = runner.invoke(cli, ["import", str(path)])
        assert out.exit_code == 0, out.output
        return out.output

    out = import_with("b.address@example.org")  # A -> B: to the old address, rightly
    assert f"delivered to the old address: {e6};" in out, out
    out = import_with(old)  # back to A
    assert f"delivered to the old address: {e6}" not in out and f"resend --employee {e6}" not in out, out
    assert (f"note: 1 {MONTH} slip already made has the address on file now (it changed and changed back; "
            f"delivered or on its way to it): nothing to do: {e6}") in out, out
    assert send == f"email-{MONTH}-{e6}"


JOB_JSON_KEYS = ["id", "kind", "company_id", "employee_id", "month", "key", "queue", "status", "attempts",
                 "last_error", "worker", "created_at", "updated_at", "started_at", "finished_at", "history"]
ATTEMPT_JSON_KEYS = ["job_id", "attempt", "worker", "started_at", "ended_at", "outcome", "error", "delay_s"]


def test_payrun_job_json_shows_the_columns_it_names_not_every_column_a_later_migration_adds(cfg, conn):
    """`payrun job --json` read `SELECT *` and left out the private columns it knew of: a
    column a later migration adds (a newer host's, mid rolling deploy) showed up in an older
    process's output, a private one too until someone added it to the list. It reads the
    columns it names: the JSON keeps its shape, and the send's address stays out of it."""
    import json

    from click.testing import CliRunner

    from jobs.events import event
    from payrun.cli import cli

    send = f"email-{MONTH}-emp-00004"
    led = Ledger(cfg.ledger_path)
    led.apply([event(send, "queued", kind="email", company=1, employee="emp-00004", month=MONTH,
                     key=f"slip:{MONTH}:emp-00004", queue="send-email", to="a@example.org"),
               event(send, "running", attempt=1, worker="w1"), event(send, "done", attempt=1)])

    def shown() -> dict:
        out = CliRunner().invoke(cli, ["job", send, "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.output)["ledger"]

    before = shown()
    assert list(before) == JOB_JSON_KEYS and list(before["history"][0]) == ATTEMPT_JSON_KEYS
    assert "a@example.org" not in json.dumps(before)
    # a later version's migration: new columns, one of them holding what must not be printed
    led.db.conn.execute("ALTER TABLE jobs ADD COLUMN bank_account TEXT")
    led.db.conn.execute("ALTER TABLE attempts ADD COLUMN smtp_transcript TEXT")
    led.db.conn.execute("UPDATE jobs SET bank_account = 'ACCT-123456'")
    led.db.conn.execute("UPDATE attempts SET smtp_transcript = 'RCPT TO:<a@example.org>'")
    led.db.conn.commit()
    after = shown()
    assert after == before
    assert "ACCT-123456" not in json.dumps(after) and list(led.jobs(limit=5)[0]) == JOB_JSON_KEYS[:-1]
    led.close()
