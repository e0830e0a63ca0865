"""A slip store that cannot be written (session 43): its file system went read-only (EROFS:
ext4's errors=remount-ro after a disk error) or its disk fails (EIO). Before, every render
spent its attempts there and was dead-lettered: 50,000 dead letters at 02:00 for one
host's disk. Now it is held like a full store (tests/test_diskfull.py): no attempt spent,
the host's render workers take no render while a test write in the store fails, and
`payrun status` and `payrun check` name the path, the errno and what to do.

The failing disk is injected at the os calls' seams (jobs.slip._write_all, the probe's
payrun.slipstore._probe_write); a read-only file system is a real tmpfs remounted
read-only (as root; skipped otherwise)."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess

import pytest

from conftest import WORLD_MONTH as MONTH
from conftest import enqueue_due
from jobs import policy, slip, tasks
from jobs.errors import StoreHeld, StoreUnwritable, Throttled
from jobs.runtime import PayrunJob, RenderWorker, make_queue
from payrun import keys, runs, slipstore


def _eio(*args, **kwargs):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


# ---- the policy, pure -----------------------------------------------------------------------

def test_erofs_is_always_the_stores_and_eio_only_when_a_test_write_fails_too():
    assert policy.store_fault_held(errno.EROFS, None)  # a mount's state, whatever the test write says
    assert policy.store_fault_held(errno.EIO, errno.EIO)  # a dead disk
    assert policy.store_fault_held(errno.EIO, errno.EROFS)  # remounted read-only since the write
    # one write in a million, or a bad block under one slip's folder: an ordinary failed attempt
    assert not policy.store_fault_held(errno.EIO, None)
    assert not policy.store_fault_held(errno.EIO, errno.ENOSPC)
    assert not policy.store_fault_held(errno.EACCES, errno.EIO)
    assert policy.is_store_failing(OSError(errno.EROFS, "x")) and policy.is_store_failing(OSError(errno.EIO, "x"))
    assert not policy.is_store_failing(OSError(errno.ENOSPC, "x")) and not policy.is_store_failing(ValueError())
    e = StoreUnwritable("x", retry_after_s=5.0)
    assert isinstance(e, StoreHeld) and isinstance(e, Throttled) and not policy.pauses_every_sender(e)


def test_a_held_renders_error_names_the_store_the_errno_and_what_to_do():
    ro = policy.store_unwritable_text("/srv/slips", OSError(errno.EROFS, os.strerror(errno.EROFS)), "/srv", 5.0)
    assert ro == ("slip store /srv/slips: cannot be written (Read-only file system, EROFS): held 5 s, spending no "
                  "attempt: the run goes on by itself once it can be written; check the disk (`dmesg`), then `mount -o "
                  "remount,rw /srv`"), ro
    io = policy.store_unwritable_text("/srv/slips", OSError(errno.EIO, os.strerror(errno.EIO)), "/srv", 60.0)
    assert "(Input/output error, EIO): held 60 s" in io and io.endswith("check the disk (`dmesg`) and replace it")
    todo = policy.store_fault_todo(errno.EROFS, "/srv")  # (the worker's ERROR, status and check say it all)
    assert "`dmesg`" in todo and "`fsck`" in todo and "`mount -o remount,rw /srv`" in todo
    assert "replace the disk" in policy.store_fault_todo(errno.EIO, "/srv")
    # failed for good after its free holds (hours): `payrun status` counts it as the host's trouble
    assert policy.failed_on_host_trouble(io)


def test_the_test_write_leaves_nothing_and_says_what_a_failing_disk_says(tmp_path, monkeypatch):
    assert slipstore.probe_write(tmp_path) is None
    monkeypatch.setattr(slipstore, "_probe_write", _eio)
    said = slipstore.probe_write(tmp_path)
    assert isinstance(said, OSError) and said.errno == errno.EIO
    assert list(tmp_path.iterdir()) == []  # no test file left, failed or not
    assert slipstore.mount_point(tmp_path / "not-there") == slipstore.mount_point(tmp_path)


# ---- a failing disk (EIO), injected ---------------------------------------------------------

def test_renders_on_a_failing_disk_are_held_and_the_worker_takes_none_until_a_test_write_succeeds(world, monkeypatch,
                                                                                                  caplog):
    from payrun import status

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    queue = make_queue(keys.RENDER_QUEUE, conn)
    ids = queue.get_job_ids()
    budget = PayrunJob.fetch(ids[0], connection=conn).retries_left
    monkeypatch.setattr(RenderWorker, "STORE_LOOK_EVERY_S", 0.0)  # (each dequeue looks: no 1 s window)
    with monkeypatch.context() as m:
        m.setattr(slip, "_write_all", _eio)
        m.setattr(slipstore, "_probe_write", _eio)
        caplog.set_level(logging.WARNING, logger="payrun.worker")
        RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
        # the first render met the disk and was held; the worker then took no other
        (first, *rest) = ids
        job = PayrunJob.fetch(first, connection=conn)
        assert job.get_status() == "scheduled" and job.retries_left == budget, job.get_status()
        assert job.meta["store_full_holds"] == 1 and job.meta["retry_after"] == 5.0
        said = job.meta["last_error"]
        assert said.startswith(f"slip store {cfg.slips_dir}: cannot be written (Input/output error, EIO): held 5 s, "
                               "spending no attempt"), said
        assert queue.get_job_ids() == rest and queue.failed_job_registry.get_job_ids() == []
        assert {PayrunJob.fetch(i, connection=conn).get_status() for i in rest} == {"queued"}
        assert not list(cfg.slips_dir.rglob("*.tmp")) and not list(cfg.slips_dir.glob(".payrun-probe-*"))
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "slip store" in r.getMessage()]
        assert len(errors) == 1 and (f"the slip store {cfg.slips_dir} cannot be written (Input/output error, EIO): "
                                     "taking no render until it can") in errors[0], errors
        assert "`dmesg`" in errors[0]
        # recorded for `payrun status` (and `payrun check`) on any host
        (entry,) = slipstore.read_faults(conn)
        assert entry["path"] == str(cfg.slips_dir) and entry["errno"] == errno.EIO
        notes = status.report(cfg, ledger, MONTH, conn=conn)["notes"]
        assert notes[0].startswith(f"the slip store {cfg.slips_dir} cannot be written on {entry['host']} "
                                   "(Input/output error, EIO) since "), notes
        assert "its renders wait in their queue, spending no attempt" in notes[0] and "`dmesg`" in notes[0]

    # the disk replaced: the next look's test write succeeds, the entry goes, every slip is made once
    enqueue_due(conn, queue, {first: 0})
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    assert {PayrunJob.fetch(i, connection=conn).get_status() for i in ids} == {"finished"}
    assert len(list(cfg.slips_dir.rglob("*.pdf"))) == len(ids) and slipstore.read_faults(conn) == []
    assert not any("cannot be written" in n for n in status.report(cfg, ledger, MONTH, conn=conn)["notes"])


def test_a_store_fault_holds_no_send_once_every_slip_is_made_and_status_says_so(world, monkeypatch):
    """On-call (session 44): with every slip rendered and only sends left (they only read
    slips), `payrun status` still gave the fault as its first note, "its renders wait", as
    if it held the run; the console's ETA already went on. Now status keeps it as a note
    that it holds none of the run's sends (text and `--json` alike), after the others; a full
    store's note goes, as the console's ETA does."""
    from click.testing import CliRunner

    from console.data import Source
    from payrun import ledger as ledger_mod, status
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    eio = OSError(errno.EIO, os.strerror(errno.EIO))
    slipstore.report_fault(conn, cfg.slips_dir, eio)
    assert ledger.renders_left(MONTH) == 12 and ledger.renders_left(MONTH, 1) < 12
    notes = status.report(cfg, ledger, MONTH, conn=conn)["notes"]
    assert notes[0].startswith(f"the slip store {cfg.slips_dir} cannot be written on ") and \
        "its renders wait in their queue" in notes[0], notes
    assert Source(cfg, conn).snapshot().eta["store_fault"] is not None  # (the console: no ETA)

    slipstore.clear_fault(conn)  # (a render worker's test write would clear it: made while it can be written)
    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
    ledger_mod.drain(conn, ledger)
    slipstore.report_fault(conn, cfg.slips_dir, eio)  # failing now, with the 12 sends still to go
    assert ledger.renders_left(MONTH) == 0
    report = status.report(cfg, ledger, MONTH, conn=conn)
    assert report["total"]["queued"] == 12
    (note,) = [n for n in report["notes"] if "cannot be written" in n]
    assert report["notes"][-1] == note and "no send-email worker is running" in report["notes"][0], report["notes"]
    assert note.startswith(f"the slip store {cfg.slips_dir} cannot be written on ") and "(Input/output error, EIO)" \
        in note, note
    assert (f"it holds none of the {MONTH} run's sends (every slip is made; a send only reads its slip), only a "
            "render to come (a retry, a resend); its disk reports I/O errors") in note, note
    assert "its renders wait" not in note
    out = CliRunner().invoke(cli, ["status", "--month", MONTH])
    assert out.exit_code == 0 and f"note: {note}" in out.output.splitlines(), out.output
    out = CliRunner().invoke(cli, ["status", "--month", MONTH, "--json"])
    assert [n for n in json.loads(out.output)["notes"] if "cannot be written" in n] == [note], out.output
    # the console agrees: the fault promises no ETA only while renders are left
    assert Source(cfg, conn).snapshot().eta["store_fault"] is None
    slipstore.clear_fault(conn)
    # so for a full store (tests/test_diskfull.py): no note while only sends are left
    from payrun import diskspace

    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 4096)
    assert not any("slip store" in n for n in status.report(cfg, ledger, MONTH, conn=conn)["notes"])


def test_status_of_one_company_words_a_store_fault_by_that_companys_renders_left(world):
    """`payrun status --company N` with a slip store that cannot be written: whether it holds
    the company's slips is of that company's renders left, not the run's. A company with
    every slip made reads that it holds none of that company's sends (not "the run's":
    the other company still renders, and the note counts those renders); a company still
    rendering reads that its renders wait, as the whole run does."""
    from click.testing import CliRunner

    from payrun import ledger as ledger_mod, status
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)
    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
    ledger_mod.drain(conn, ledger)
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=2)  # (company 2's renders not made yet)
    ledger_mod.drain(conn, ledger)
    others = ledger.renders_left(MONTH, 2)
    assert ledger.renders_left(MONTH, 1) == 0 and others > 0 and ledger.renders_left(MONTH) == others
    slipstore.report_fault(conn, cfg.slips_dir, OSError(errno.EIO, os.strerror(errno.EIO)))

    def fault(company=None):
        notes = status.report(cfg, ledger, MONTH, company, conn=conn)["notes"]
        (note,) = [n for n in notes if "cannot be written" in n]
        return note, notes

    note, notes = fault(1)
    assert notes[-1] == note, notes  # (holding none of it: after the notes that do)
    assert (f"it holds none of company 1's sends of the {MONTH} run (every slip of company 1 is made; a send only "
            f"reads its slip), only a render of it to come (a retry, a resend); {others} renders of the run's other "
            "companies wait in their queue, spending no attempt, and go on by themselves once it can be written "
            "(`payrun status` without --company); its disk reports I/O errors") in note, note
    assert "every slip is made" not in note and "run's sends" not in note
    for company in (2, None):  # still rendering: its renders wait, the first note
        note, notes = fault(company)
        assert notes[0] == note and "its renders wait in their queue" in note and "holds none" not in note, notes
    out = CliRunner().invoke(cli, ["status", "--month", MONTH, "--company", "1"])
    assert out.exit_code == 0 and f"note: {fault(1)[0]}" in out.output.splitlines(), out.output
    out = CliRunner().invoke(cli, ["status", "--month", MONTH, "--company", "1", "--json"])
    assert [n for n in json.loads(out.output)["notes"] if "cannot be written" in n] == [fault(1)[0]], out.output
    # every slip of the run made: no other company's renders to count
    slipstore.clear_fault(conn)
    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
    ledger_mod.drain(conn, ledger)
    slipstore.report_fault(conn, cfg.slips_dir, OSError(errno.EIO, os.strerror(errno.EIO)))
    assert ledger.renders_left(MONTH) == 0
    note, _ = fault(1)
    assert ("only a render of it to come (a retry, a resend); its disk reports I/O errors" in note
            and "other companies" not in note), note
    assert f"it holds none of the {MONTH} run's sends (every slip is made;" in fault()[0]


def test_one_eio_a_test_write_does_not_confirm_is_an_ordinary_failed_attempt(world, monkeypatch):
    """A disk that fails one write in a million (or a bad block under one slip's folder) is
    not a dead store: that slip spends an attempt (six, then the failed list, counted as the
    host's trouble), and the worker goes on rendering the others."""
    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    queue = make_queue(keys.RENDER_QUEUE, conn)
    ids = queue.get_job_ids()
    budget = PayrunJob.fetch(ids[0], connection=conn).retries_left
    real = slip._write_all
    marker = cfg.home / "failed-once"  # (each render runs in a process of its own)

    def once(fd, data):
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return real(fd, data)
        _eio()

    monkeypatch.setattr(RenderWorker, "STORE_LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(slip, "_write_all", once)
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    job = PayrunJob.fetch(ids[0], connection=conn)
    assert job.get_status() == "scheduled" and job.retries_left == budget - 1
    assert "store_full_holds" not in job.meta and "(the disk reported an I/O error" in job.meta["last_error"]
    assert {PayrunJob.fetch(i, connection=conn).get_status() for i in ids[1:]} == {"finished"}
    assert slipstore.read_faults(conn) == []


def test_eio_at_the_sync_of_a_handed_over_render_is_held_too(world, monkeypatch):
    """A failing disk mostly says EIO at the fsync (the data never reached it): the render
    worker's finish of a warm horse's render (jobs.tasks.finish_render) holds it too."""
    cfg, conn, db, ledger = world
    staged = slip.stage_slip(cfg.slips_dir / "2026-11" / "1" / "emp-00001.pdf", b"%PDF-1.7 test", store=cfg.slips_dir)

    def eio_at_sync(tmp, path, synced=False, folder=True):
        slip._unlink_quietly(tmp)
        _eio()

    monkeypatch.setattr(slip, "commit_slip", eio_at_sync)
    monkeypatch.setattr(slipstore, "_probe_write", _eio)
    result = {"slip": "2026-11/1/emp-00001.pdf", "bytes": 13,
              tasks.FINISH_KEY: {"staged": str(staged), "email": {}, "store_full_holds": 1}}
    with pytest.raises(StoreUnwritable) as held:
        tasks.finish_render(conn, result)
    assert held.value.retry_after_s == 10.0 and str(cfg.slips_dir) in str(held.value) and "EIO" in str(held.value)
    assert [e["errno"] for e in slipstore.read_faults(conn)] == [errno.EIO]
    assert make_queue(keys.EMAIL_QUEUE, conn).get_job_ids() == []  # no send of a slip not written


def test_check_fails_a_slip_store_another_hosts_workers_cannot_write(world):
    """`payrun check` on the control host cannot write a worker host's store itself: what
    that host's render workers found is a FAIL, with its host, path and errno."""
    from payrun import preflight

    cfg, conn, db, ledger = world
    cfg.slips_dir.mkdir(parents=True)  # (this host's own store is fine)
    now_ms = conn.time()[0] * 1000
    conn.hset(keys.SLIP_STORE_FAULTS, "0badd15c", json.dumps({
        "host": "render-2", "path": "/srv/slips", "mount": "/srv", "errno": errno.EROFS,
        "error": "Read-only file system, EROFS", "since_ms": now_ms - 60_000, "until_ms": now_ms + 30_000}))
    conn.hset(keys.SLIP_STORE_FAULTS, "0ldd15c0", json.dumps({  # lapsed: its host fixed it, or is gone
        "host": "render-3", "path": "/srv/slips", "mount": "/srv", "errno": errno.EIO,
        "error": "Input/output error, EIO", "since_ms": now_ms - 600_000, "until_ms": now_ms - 1_000}))
    rep = preflight.check(cfg, month=MONTH, email=False, connect=lambda: conn)
    said = [f for f in rep.findings if f.area == "slips" and f.level == preflight.FAIL]
    assert len(said) == 1 and said[0].text.startswith(
        "the slip store /srv/slips cannot be written on render-2 (Read-only file system, EROFS) since "), said
    assert "`mount -o remount,rw /srv`" in said[0].text and rep.failures >= 1
    # a worker host's check is of its own part: not of another host's store
    rep = preflight.check(cfg, worker_host=True, email=False, connect=lambda: conn)
    assert not [f for f in rep.findings if f.area == "slips" and f.level == preflight.FAIL], rep.findings


# ---- a real file system remounted read-only (root) ------------------------------------------

def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def tmpfs_store(cfg):
    """The slip store on a tmpfs of its own (remount it read-only with ``_mount``); unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    store = cfg.slips_dir
    store.mkdir(parents=True, exist_ok=True)
    made = _mount("-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(store))
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield store
    finally:
        subprocess.run(["umount", "-l", str(store)], capture_output=True, timeout=10)


def test_a_slip_store_remounted_read_only_holds_every_render_and_status_and_check_say_so(world, tmpfs_store,
                                                                                          monkeypatch, caplog):
    from payrun import preflight, status

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    queue = make_queue(keys.RENDER_QUEUE, conn)
    ids = queue.get_job_ids()
    budget = PayrunJob.fetch(ids[0], connection=conn).retries_left
    RenderWorker([queue], connection=conn).work(burst=True, max_jobs=2, logging_level="WARNING")
    assert len(list(tmpfs_store.rglob("*.pdf"))) == 2
    assert _mount("-o", "remount,ro", str(tmpfs_store)).returncode == 0
    assert slipstore.mount_point(tmpfs_store) == tmpfs_store
    assert slipstore.probe_write(tmpfs_store).errno == errno.EROFS

    # a render that meets it (taken before its worker looked) is held, spending no attempt
    monkeypatch.setattr(RenderWorker, "_store_unwritable", lambda self: False)
    RenderWorker([queue], connection=conn).work(burst=True, max_jobs=1, logging_level="WARNING")
    held = PayrunJob.fetch(ids[2], connection=conn)
    assert held.get_status() == "scheduled" and held.retries_left == budget and held.meta["store_full_holds"] == 1
    assert held.meta["last_error"].startswith(f"slip store {tmpfs_store}: cannot be written (Read-only file system, "
                                              "EROFS): held 5 s, spending no attempt"), held.meta["last_error"]
    assert "`mount -o remount,rw " in held.meta["last_error"]  # (its long test path is cut at 300 characters)
    monkeypatch.undo()

    # a worker takes none while it is read-only: the statvfs says so before any write
    caplog.set_level(logging.WARNING, logger="payrun.worker")
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    assert {PayrunJob.fetch(i, connection=conn).get_status() for i in ids[3:]} == {"queued"}
    assert any(f"the slip store {tmpfs_store} cannot be written (Read-only file system, EROFS): taking no render"
               in r.getMessage() for r in caplog.records)
    notes = status.report(cfg, ledger, MONTH, conn=conn)["notes"]
    assert notes[0].startswith(f"the slip store {tmpfs_store} cannot be written on "), notes
    assert f"(Read-only file system, EROFS) since " in notes[0] and f"`mount -o remount,rw {tmpfs_store}`" in notes[0]
    # the console: no ETA, the store, what to do (it read "ETA 17:51 — on time": session 43)
    from console.data import Source
    from console.fmt import eta_text

    snap = Source(cfg, conn).snapshot()
    assert [(f["path"], f["errno"]) for f in snap.store_faults] == [(str(tmpfs_store), errno.EROFS)], snap.store_faults
    assert snap.eta["at"] is None and snap.eta["store_fault"]["mount"] == str(tmpfs_store)
    said = eta_text(dict(snap.eta, no_worker=[]))  # (no worker is up here: that is said first)
    assert said.startswith(f"no ETA: slip store {tmpfs_store} read-only on "), said
    # with no worker's entry (none up), status still sees the read-only mount itself
    conn.delete(keys.SLIP_STORE_FAULTS)
    notes = status.report(cfg, ledger, MONTH, conn=conn)["notes"]
    assert "(Read-only file system, EROFS): its renders wait" in notes[0], notes
    assert Source(cfg, conn).snapshot().eta["store_fault"]["path"] == str(tmpfs_store)  # (the console too)
    rep = preflight.check(cfg, month=MONTH, email=False, connect=lambda: conn)
    (slips,) = [f for f in rep.findings if f.area == "slips"]
    assert slips.level == preflight.FAIL and "(Read-only file system)" in slips.text, slips.text

    # remounted read-write: the run goes on by itself, every slip made once
    assert _mount("-o", "remount,rw", str(tmpfs_store)).returncode == 0
    enqueue_due(conn, queue, {ids[2]: 0})
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    assert {PayrunJob.fetch(i, connection=conn).get_status() for i in ids} == {"finished"}
    assert len(list(tmpfs_store.rglob("*.pdf"))) == len(ids) and slipstore.read_faults(conn) == []
    assert not list(tmpfs_store.rglob("*.tmp")) and not list(tmpfs_store.glob(".payrun-probe-*"))


def test_a_send_waiting_for_its_render_keeps_waiting_past_the_hour_while_a_store_cannot_be_written(conn):
    """As for a full store (tests/test_missing_slip.py): the render is held, spending no
    attempt, for hours; the send waiting for it must not fail for good an hour in."""
    from jobs.errors import RenderPending, SlipMissing
    from test_missing_slip import EMP, PAYLOAD

    conn.hset(f"rq:job:{keys.render_job_id(PAYLOAD['month'], EMP)}", mapping={"status": "queued", "meta": "{}"})
    slipstore.report_fault(conn, "/srv/slips", OSError(errno.EIO, os.strerror(errno.EIO)))
    meta: dict = {"render_waits": [60, 1000.0]}
    late = tasks.slip_missing(conn, PAYLOAD, meta, now=1000.0 + 5 * 3600)
    assert isinstance(late, RenderPending) and "a slip store that cannot be written" in str(late), late
    slipstore.clear_fault(conn)  # written again, and the render still not run: the hour counts
    assert isinstance(tasks.slip_missing(conn, PAYLOAD, meta, now=1000.0 + 5 * 3600 + 60), SlipMissing)


def test_payrun_job_counts_a_try_held_for_a_store_that_cannot_be_written_among_the_held_back():
    """Review (session 43): a render held for a read-only or failing store is a held try (no
    attempt spent), but `payrun job` and the console's job view gave the held-back reasons as
    "rate limit, provider outage, …, a full slip store": not why it was held."""
    from payrun.ledger import tries_text

    held = policy.store_unwritable_text("/srv/slips", OSError(errno.EROFS, os.strerror(errno.EROFS)), "/srv", 5.0)
    row = {"attempts": 2, "history": [{"outcome": "held", "error": held}, {"outcome": "done", "error": None}]}
    said = tries_text(row)
    assert said.startswith("2 tries: 1 attempt spent, 1 held back (") and "a slip store full or that cannot be " \
        "written" in said, said
