"""A disk that fills up during the night (session 42's on-call drill): the slip store, the
data directory under the SQLite ledger. The full disk is injected at a seam (ENOSPC from
the write, SQLITE_FULL from the ledger's commit): no test mounts anything."""

from __future__ import annotations

import errno
import sqlite3
import time

import pytest

from conftest import WORLD_MONTH as MONTH
from conftest import enqueue_due
from jobs import events, slip
from jobs.runtime import PayrunJob, RenderWorker, make_queue
from payrun import keys, runs


def _no_room(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_slip_store_holds_the_renders_spending_no_attempt_and_they_go_on_once_there_is_room(world,
                                                                                                    monkeypatch):
    """Drill: the slip store filled after ~100 of 300 slips, and the other 198 failed for good
    within 80 s (6 attempts each, backoff up to 30 s), in the failed list before anyone could
    be paged, under a status note that said "an address refused". Now each waits (5 s, then
    longer) spending no attempt, its error names the store and what to do, and a try while
    the store is still full costs a statvfs, not a render."""
    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    queue = make_queue(keys.RENDER_QUEUE, conn)
    ids = queue.get_job_ids()
    budget = PayrunJob.fetch(ids[0], connection=conn).retries_left
    monkeypatch.setattr(slip, "_write_all", _no_room)
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    assert queue.failed_job_registry.get_job_ids() == []
    assert set(queue.scheduled_job_registry.get_job_ids()) == set(ids)
    job = PayrunJob.fetch(ids[0], connection=conn)
    assert job.retries_left == budget and job.meta["held"] == 1 and job.meta["store_full_holds"] == 1
    assert job.meta["retry_after"] == 5.0
    said = job.meta["last_error"]
    assert f"slip store {cfg.slips_dir}: No space left on device (the disk is full" in said, said
    assert "free space there" in said and "spending no attempt" in said and said.endswith("once there is room")
    assert not list(cfg.slips_dir.rglob("*.pdf")) and not list(cfg.slips_dir.rglob("*.tmp"))

    # still full at the next try: no render, a longer wait
    monkeypatch.setattr(slip, "free_bytes", lambda path: 4096)
    monkeypatch.setattr(slip, "render_pdf", lambda snapshot: pytest.fail("rendered into a full store"))
    enqueue_due(conn, queue, {i: 0 for i in ids})
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    job = PayrunJob.fetch(ids[0], connection=conn)
    assert job.retries_left == budget and job.meta["store_full_holds"] == 2 and job.meta["retry_after"] == 10.0
    assert queue.failed_job_registry.get_job_ids() == []

    # space freed: every slip is made once, and its send queued
    monkeypatch.undo()
    enqueue_due(conn, queue, {i: 0 for i in ids})
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    assert {PayrunJob.fetch(i, connection=conn).get_status() for i in ids} == {"finished"}
    assert len(list(cfg.slips_dir.rglob("*.pdf"))) == len(ids)
    assert len(make_queue(keys.EMAIL_QUEUE, conn).get_job_ids()) == len(ids)


def test_a_full_store_found_at_the_sync_is_held_too(world, monkeypatch):
    """A file system that allocates late (ext4, XFS) may take every write and refuse the
    fsync: the render worker's finish (jobs.tasks.finish_render) holds the job the same way."""
    from jobs import tasks
    from jobs.errors import StoreFull

    cfg, conn, db, ledger = world
    staged = slip.stage_slip(cfg.slips_dir / "2026-11" / "1" / "emp-00001.pdf", b"%PDF-1.7 test", store=cfg.slips_dir)

    def no_room_at_sync(tmp, path, synced=False, folder=True):
        slip._unlink_quietly(tmp)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slip, "commit_slip", no_room_at_sync)
    result = {"slip": "2026-11/1/emp-00001.pdf", "bytes": 13,
              tasks.FINISH_KEY: {"staged": str(staged), "email": {}, "store_full_holds": 2}}
    with pytest.raises(StoreFull) as held:
        tasks.finish_render(conn, result)
    assert held.value.retry_after_s == 20.0 and str(cfg.slips_dir) in str(held.value)


def test_store_full_waits_grow_to_a_minute_and_stay_free_for_hours():
    from jobs.policy import STORE_FULL_HOLDS_PER_JOB, store_full_hold_is_free, store_full_wait_s

    assert [store_full_wait_s(n) for n in range(7)] == [5, 10, 20, 40, 60, 60, 60]
    assert sum(store_full_wait_s(n) for n in range(STORE_FULL_HOLDS_PER_JOB)) > 5 * 3600  # the night of a run
    assert store_full_hold_is_free(STORE_FULL_HOLDS_PER_JOB - 1)
    assert not store_full_hold_is_free(STORE_FULL_HOLDS_PER_JOB)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_ledger_waits_out_a_full_disk_and_applies_every_event_once_there_is_room(conn, cfg, caplog):
    """Drill: with the data directory full, `payrun ledger` ended on "database or disk is
    full" at its first batch, three times in 10 s, and supervisord gave up on it (FATAL):
    after freeing space the run's status stayed frozen until someone ran `payrun up`. Now it
    waits, saying so at once and every 30 s (the path, the room left, what to do), keeps
    the events in Redis, and applies them all once there is room."""
    import logging

    from payrun import ledger as ledger_mod
    from payrun.ledger import Ledger

    store = Ledger(cfg.ledger_path)
    store.create_jobs([{"id": "j1", "kind": "render"}])
    events.emit(conn, "j1", "running", attempt=1)
    events.emit(conn, "j1", "done", attempt=1)
    full = [True]
    real_apply = store.apply

    def apply(batch):
        if full[0]:
            raise sqlite3.OperationalError("database or disk is full")
        return real_apply(batch)

    store.apply = apply
    clock = _Clock()

    def pause(s: float) -> None:
        clock.t += s
        if clock.t - 1000.0 >= 95:  # space freed after 95 s
            full[0] = False

    caplog.set_level(logging.INFO, logger="payrun.ledger")
    try:
        ledger_mod.serve(conn, store, lambda: store.job("j1")["status"] == "done" or clock.t > 2000,
                         log=logging.getLogger("payrun.ledger"), clock=clock, pause=pause)
        assert store.job("j1")["status"] == "done" and ledger_mod.backlog(conn) == 0
    finally:
        store.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "payrun.ledger"]
    said = [m for m in lines if "cannot write" in m]
    assert 2 <= len(said) <= 4, lines  # at once, then every 30 s, not at every try
    assert (f"ledger: cannot write {cfg.ledger_path}: No space left on device (database or disk is full; "
            in said[0]), said[0]
    assert f"free space in {cfg.home}" in said[0] and "nothing is lost" in said[0] and "2 behind" in said[0]
    assert lines[-1].startswith(f"ledger: writing {cfg.ledger_path} again: back after"), lines


def test_a_ledger_started_on_a_full_disk_waits_for_room_instead_of_exiting(cfg, monkeypatch, caplog):
    import logging

    from payrun import diskspace
    from payrun import ledger as ledger_mod

    tries = []

    def open_ledger():
        tries.append(1)
        if len(tries) < 4:  # SQLite could not make its -shm there: "disk I/O error"
            raise sqlite3.OperationalError("disk I/O error")
        return "opened"

    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 0)
    clock = _Clock()
    caplog.set_level(logging.INFO, logger="payrun.ledger")
    got = ledger_mod.open_waiting(open_ledger, cfg.ledger_path, lambda: False, logging.getLogger("payrun.ledger"),
                                  clock=clock, pause=lambda s: setattr(clock, "t", clock.t + s))
    assert got == "opened" and len(tries) == 4
    lines = [r.getMessage() for r in caplog.records if r.name == "payrun.ledger"]
    assert lines[0].startswith(f"ledger: cannot open {cfg.ledger_path}: No space left on device (disk I/O error; "
                               "0 B free there)"), lines
    # an I/O error on a disk with room is not a full disk: it goes up
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 10 * 2**30)
    tries.clear()
    with pytest.raises(sqlite3.OperationalError):
        ledger_mod.open_waiting(open_ledger, cfg.ledger_path, lambda: False, clock=clock, pause=lambda s: None)


def test_a_command_on_a_full_data_directory_says_so_in_one_line(world, monkeypatch):
    """Drill: `payrun status` and `payrun check` on a full data directory ended in a
    40-line traceback, "sqlite3.OperationalError: disk I/O error" (SQLite could not make
    the payroll database's -shm there). Now one line: where, the room left, what to do."""
    from click.testing import CliRunner

    from payrun import diskspace, payroll
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)

    def no_shm(*a, **k):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(payroll.PayrollDB, "__init__", no_shm)
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 0)
    out = CliRunner().invoke(cli, ["status"])
    assert out.exit_code == 1, out.output
    assert out.output.startswith(f"payrun: no space left on the disk of {cfg.home} (disk I/O error; 0 B free "
                                 "there): free space there"), out.output
    assert "Traceback" not in out.output and out.output.count("\n") == 1
    # check goes on and says which of its checks fail (test_payrun_check_on_a_full_data_directory…)
    out = CliRunner().invoke(cli, ["check", "--no-email"])
    assert out.exit_code == 1 and f"{cfg.home}: 0 B free: full" in out.output, out.output
    # the same error with room on the disk is not a full disk: not said to be one
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 10 * 2**30)
    out = CliRunner().invoke(cli, ["status"])
    assert isinstance(out.exception, sqlite3.OperationalError)


def test_status_says_slips_failed_on_a_full_disk_need_space_and_a_retry_not_an_import(world):
    """Drill: 198 slips failed for good on a full slip store, and `payrun status` said why in
    one way only: "(an address refused: fix it with `payrun import`, then `payrun retry`)"."""
    from jobs.policy import classify
    from payrun import ledger as ledger_mod
    from payrun import status

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    disk = classify(OSError(errno.ENOSPC, "No space left on device")).reason
    for emp in ("emp-00001", "emp-00002"):
        events.emit(conn, keys.render_job_id(MONTH, emp), "failed", attempt=6, error=disk)
    ledger_mod.drain(conn, ledger)
    notes = [n for n in status.report(cfg, ledger, MONTH)["notes"] if "failed for good" in n]
    assert len(notes) == 1 and "(all on the host's trouble, not their data (a full or failing disk" in notes[0], notes
    assert f"then `payrun retry --all --month {MONTH}`)" in notes[0] and "payrun import" not in notes[0]
    # and one refused for its address besides: both said
    events.emit(conn, keys.render_job_id(MONTH, "emp-00003"), "failed", attempt=1,
                error="PermanentError: SMTP 550 no such user")
    ledger_mod.drain(conn, ledger)
    (note,) = [n for n in status.report(cfg, ledger, MONTH)["notes"] if "failed for good" in n]
    assert note.startswith("3 slips of") and "(2 on the host's trouble" in note, note
    assert note.endswith("; the rest: an address refused: fix it with `payrun import`, then `payrun retry`)"), note


def test_check_fails_a_full_data_directory_and_a_full_slip_store_of_a_month_already_run(tmp_path):
    """Drill: with the slip store full mid-run (4 KiB free) `payrun check` said "ready": the
    month was run, so no room was counted for it, and its 4 KiB test file fit. And nothing
    looked at the data directory, where the ledger and the embedded Redis's AOF live."""
    from payrun import preflight

    level, text = preflight.store_room_verdict(tmp_path, 4096)
    assert level == preflight.FAIL and text.startswith(f"{tmp_path}: 4.0 KiB free: full, no room for a slip")
    assert preflight.store_room_verdict(tmp_path, 10 << 20)[0] == preflight.OK
    level, text = preflight.data_verdict(tmp_path, 0, 300, True)
    assert level == preflight.FAIL and "full (the embedded Redis's append-only file, the ledger, logs)" in text
    level, text = preflight.data_verdict(tmp_path, 100 << 20, 50_000, True)
    assert level == preflight.WARN and "~1.1 GiB needed for 50,000 slips" in text, text
    assert preflight.data_verdict(tmp_path, 500 << 20, 50_000, False)[0] == preflight.OK  # (~293 MiB)
    assert preflight.data_verdict(tmp_path, 100 << 20, 0, True) == (preflight.OK, f"{tmp_path}: 100.0 MiB free")


def test_payrun_check_on_a_full_data_directory_says_which_checks_fail_instead_of_a_traceback(world, monkeypatch):
    from payrun import diskspace, payroll, preflight

    cfg, conn, db, ledger = world

    def no_shm(*a, **k):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(payroll.PayrollDB, "__init__", no_shm)
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 0)
    rep = preflight.check(cfg, month=MONTH, email=False, connect=lambda: conn)
    said = {f.area: (f.level, f.text) for f in rep.findings}
    assert said["payroll"][0] == preflight.FAIL and said["payroll"][1].startswith(
        f"cannot read {cfg.payroll_path}: No space left on device (disk I/O error; 0 B free there)"), said["payroll"]
    assert said["data"][0] == preflight.FAIL and said["data"][1].startswith(f"{cfg.home}: 0 B free: full")


def test_status_says_the_slip_store_is_full_while_slips_are_still_to_be_made(world, monkeypatch):
    from payrun import diskspace, status

    cfg, conn, db, ledger = world
    cfg.slips_dir.mkdir(parents=True, exist_ok=True)
    runs.start_run(cfg, conn, ledger, db, MONTH)
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 4096)
    notes = status.report(cfg, ledger, MONTH)["notes"]
    assert notes[0] == (f"the slip store {cfg.slips_dir} is full (4.0 KiB free): every render waits, spending no "
                        f"attempt, and the run goes on by itself once there is room: free space there (`df -h "
                        f"{cfg.slips_dir}`; `payrun prune --before YYYY-MM --slips` removes old months' slips)"), notes
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 10 << 30)
    assert not any("slip store" in n for n in status.report(cfg, ledger, MONTH)["notes"])


def test_a_render_worker_takes_no_render_while_its_slip_store_is_full(world, monkeypatch, caplog):
    """A render taken into a full store is rendered, fails to write and is held: at 50,000
    slips, both cores and the logs busy for nothing while the store is full. The worker looks
    at the store's room (a statvfs, at most every second) and takes nothing while it is full;
    the renders wait in their queue, untouched, and go on once there is room."""
    import logging

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    queue = make_queue(keys.RENDER_QUEUE, conn)
    ids = queue.get_job_ids()
    monkeypatch.setattr(RenderWorker, "_store_free", lambda self: 4096)
    monkeypatch.setattr(slip, "render_pdf", lambda snapshot: pytest.fail("rendered into a full store"))
    caplog.set_level(logging.WARNING, logger="payrun.worker")
    w = RenderWorker([queue], connection=conn)
    w.work(burst=True, logging_level="WARNING")
    assert queue.get_job_ids() == ids and {PayrunJob.fetch(i, connection=conn).get_status() for i in ids} == {"queued"}
    said = [r.getMessage() for r in caplog.records if "slip store" in r.getMessage()]
    assert len(said) == 1 and f"the slip store {cfg.slips_dir} is full (4 KiB free): taking no render" in said[0], said
    monkeypatch.undo()
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    assert {PayrunJob.fetch(i, connection=conn).get_status() for i in ids} == {"finished"}
    # the control worker (same class) does not look at the slip store
    assert RenderWorker([make_queue(keys.CONTROL_QUEUE, conn)], connection=conn)._store_full() is False


def test_the_consoles_eta_promises_no_time_while_the_slip_store_is_full():
    """Drill: with every render waiting on a full slip store the console read "ETA 14:25 —
    on time for 09:00 tomorrow" (from the rate before the store filled)."""
    from console.data import eta
    from console.fmt import eta_text

    now = 1_793_478_300.0
    total = {"queued": 198, "running": 0, "retrying": 0, "done": 102, "failed": 0, "stuck": 0, "total": 300}
    full = eta(total, 4.7, now, "Asia/Dhaka", store_free=4096)
    assert full["at"] is None and eta_text(full) == ("no ETA: slip store full (4 KiB free): no render until space "
                                                     "is freed (`payrun status` says where)")
    assert eta_text(eta(total, 4.7, now, "Asia/Dhaka", store_free=10 << 30)).startswith("ETA ")
    assert eta_text(eta(total | {"queued": 0, "done": 300}, 0.0, now, "Asia/Dhaka", store_free=0)) == "all delivered"


def test_a_ledger_catching_up_does_not_call_the_events_still_in_the_stream_lost(conn, cfg, monkeypatch, caplog):
    """Drill: once space was freed the ledger applied its first batch, then reconciled: 46 jobs
    RQ had ended over 5 s ago were "reconciled" with a warning that "their event never came",
    while their events were in the stream, next in line. It reconciles only when caught up."""
    import functools
    import logging
    from datetime import datetime, timezone

    from rq.utils import utcformat

    from payrun import ledger as ledger_mod
    from payrun.ledger import Ledger

    store = Ledger(cfg.ledger_path)
    ids = [f"job-{i}" for i in range(5)]
    minute_ago = datetime.fromtimestamp(time.time() - 60, timezone.utc).isoformat(timespec="milliseconds")
    monkeypatch.setattr(ledger_mod, "utcnow", lambda: minute_ago)  # (their rows made a minute ago, idle since)
    store.create_jobs([{"id": i, "kind": "email"} for i in ids])
    monkeypatch.undo()
    q = make_queue(keys.EMAIL_QUEUE, conn)
    ended = time.time() - 60
    sec, _ = conn.time()
    for n, job_id in enumerate(ids):  # ended a minute ago in RQ, their events written then, not applied yet
        q.enqueue_call("jobs.tasks.noop", job_id=job_id, meta={"attempt": 1})
        conn.hset(f"rq:job:{job_id}", mapping={
            "status": "finished", "ended_at": utcformat(datetime.fromtimestamp(ended, timezone.utc))})
        conn.xadd(keys.EVENTS_STREAM, events.event(job_id, "done", attempt=1), id=f"{(sec - 60) * 1000}-{n}")
    monkeypatch.setattr(ledger_mod, "apply_pending", functools.partial(ledger_mod.apply_pending, count=2))
    monkeypatch.setattr(ledger_mod, "RECONCILE_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="payrun.ledger")
    try:
        ledger_mod.serve(conn, store, lambda: ledger_mod.backlog(conn) == 0, log=logging.getLogger("payrun.ledger"))
        assert {store.job(i)["status"] for i in ids} == {"done"}
    finally:
        store.close()
    assert not [r.getMessage() for r in caplog.records if "never came" in r.getMessage()]


def test_status_blames_redis_refusing_writes_not_missing_workers_or_a_stopped_ledger(world, monkeypatch):
    """Drill (Redis's AOF disk full): beside the MISCONF note, `payrun status` said "218 jobs
    wait on pdf-render and no pdf-render worker is running: is `payrun up` running?" and
    "(ledger is 7 updates behind …: is `payrun ledger` running?)", while every worker and the
    ledger ran, waiting for Redis to take writes (a worker cannot record itself meanwhile)."""
    from payrun import redis_server, status

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    conn.xadd(keys.EVENTS_STREAM, events.event("x", "running", attempt=1), id="1000-0")  # not applied, old: behind
    assert any("no pdf-render worker is running" in n for n in status.report(cfg, ledger, MONTH, conn=conn)["notes"])
    monkeypatch.setattr(redis_server, "refusal",
                        lambda c: "MISCONF Errors writing to the AOF file: No space left on device")
    r = status.report(cfg, ledger, MONTH, conn=conn)
    assert r["notes"][0].startswith("Redis refuses writes (MISCONF Errors writing to the AOF file: No space left")
    assert not any("worker is running" in n for n in r["notes"]), r["notes"]
    assert r["redis_refuses_writes"] is True
    text = status.format_report(r)
    assert "it cannot take them while Redis refuses writes)" in text and "is `payrun ledger` running" not in text


def test_check_says_redis_refuses_writes_not_that_it_is_unreachable(cfg):
    """Drill: with the embedded Redis's AOF disk full (it answers even PING with MISCONF),
    `payrun check` said "unreachable (ResponseError): `payrun up`, then check again"."""
    import redis

    from payrun import preflight

    class Refusing:
        def ping(self):
            raise redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device")

    rep = preflight.check(cfg, month=MONTH, email=False, connect=Refusing)
    (said,) = [f for f in rep.findings if f.area == "redis"]
    assert said.level == preflight.FAIL and (
        ": reachable, but Redis refuses writes (MISCONF Errors writing to the AOF file: No space left on device): is "
        "its disk full") in said.text, said.text
    assert "`payrun up`, then check again" not in said.text


def test_a_retry_gives_a_render_held_past_its_cap_its_free_holds_for_a_full_store_again(world):
    """Review (session 42): a render held STORE_FULL_HOLDS_PER_JOB times (hours of a full
    store) reaches the failed list; the operator frees space and runs `payrun retry --all`, as
    `payrun status` says. Its fresh budget kept the old holds count, so the store filling
    again spent an attempt at each try at once and failed it within minutes, as before the
    holds were free."""
    from jobs.policy import STORE_FULL_HOLDS_PER_JOB, store_full_hold_is_free
    from payrun.deadletters import _fresh_budget

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    job = PayrunJob.fetch(make_queue(keys.RENDER_QUEUE, conn).get_job_ids()[0], connection=conn)
    job.meta.update(store_full_holds=STORE_FULL_HOLDS_PER_JOB, attempt=STORE_FULL_HOLDS_PER_JOB + 6)
    _fresh_budget(cfg, job)
    assert store_full_hold_is_free(int(job.meta.get("store_full_holds", 0)))


def test_status_counts_slips_failed_on_the_hosts_trouble_among_the_failed_slips_it_counts(world):
    """Review (session 42): the host's-trouble count was of every failed render and email job
    of the month, resends' and slips delivered since included, beside a count of failed
    slips: one slip refused for its address, with a resend that failed on a full disk,
    read "(all on the host's trouble, not their data ...)" and no word of the address."""
    from jobs.policy import classify
    from payrun import ledger as ledger_mod
    from payrun import status

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    disk = classify(OSError(errno.ENOSPC, "No space left on device")).reason
    events.emit(conn, keys.render_job_id(MONTH, "emp-00003"), "failed", attempt=1,
                error="PermanentError: SMTP 550 no such user")
    resend_key = f"{keys.idem_key(MONTH, 'emp-00001')}:resend-1"
    ledger.create_jobs([{"id": "resend-email-1", "kind": "email", "company_id": 1, "employee_id": "emp-00001",
                         "month": MONTH, "key": resend_key, "queue": keys.EMAIL_QUEUE}])
    events.emit(conn, "resend-email-1", "failed", attempt=1, error=disk)
    ledger_mod.drain(conn, ledger)
    (note,) = [n for n in status.report(cfg, ledger, MONTH)["notes"] if "failed for good and" in n]
    assert note.startswith("1 slip of") and "host's trouble" not in note, note
    assert "an address refused: fix it with `payrun import`" in note, note
