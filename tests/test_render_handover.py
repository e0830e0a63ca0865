"""A warm horse hands each slip's finish to its render worker: the horse stops once the
slip is written, and the worker makes it durable, enqueues its send and records the end
while the horse renders the next slip (jobs.runtime.RenderWorker._finish_rendered). The
outcome must be the fork-per-job worker's, record for record. Real Redis, real renders."""

from __future__ import annotations

import os
import stat
import time

import pytest
import redis
from rq.job import Job, JobStatus

from jobs import slip, tasks
from jobs.runtime import PayrunJob, RenderWorker, make_queue
from payrun import keys, ledger as ledger_mod, runs

MONTH = "2026-11"  # the month of conftest's `world`


def _warm_worker(conn, jobs_per_horse: int) -> RenderWorker:
    w = RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn, name="render.test.handover")
    w.jobs_per_horse = jobs_per_horse
    return w


def _render_ids(conn) -> list[str]:
    q = make_queue(keys.RENDER_QUEUE, conn)
    return sorted(q.finished_job_registry.get_job_ids() + q.failed_job_registry.get_job_ids()
                  + q.get_job_ids() + q.scheduled_job_registry.get_job_ids())


@pytest.mark.parametrize("batch", [1, 4], ids=["one-at-a-time", "batch-of-4"])
def test_a_warm_horse_hands_the_finish_over_and_the_records_are_the_fork_per_jobs(world, monkeypatch, batch):
    """Also with render.batch = 4: jobs taken and started four at a time (the next four
    while the last of a batch renders), their renders finished two at a time (slips
    durable, each folder synced once, then one transaction)."""
    cfg, conn, db, ledger = world
    assert runs.start_run(cfg, conn, ledger, db, MONTH).jobs == 12
    finished_here = []
    # (one at a time: finish_render each; in a batch: commit_renders, then one transaction)
    if batch == 1:
        finish = tasks.finish_render
        monkeypatch.setattr(tasks, "finish_render", lambda c, r: finished_here.append(r["slip"]) or finish(c, r))
    else:
        commit = tasks.commit_renders
        monkeypatch.setattr(tasks, "commit_renders",
                            lambda c, rs: finishes.append(len(rs)) or finished_here.extend(r["slip"] for r in rs)
                            or commit(c, rs))
    finishes: list[int] = []
    taken_ahead: list[int] = []
    take_ahead = RenderWorker._take_ahead

    def _take_ahead(self):
        before = len(self._behind)
        take_ahead(self)
        taken_ahead.append(len(self._behind) - before)

    monkeypatch.setattr(RenderWorker, "_take_ahead", _take_ahead)
    # 5 jobs per horse: twice a horse is replaced while its last render waits to be finished
    w = _warm_worker(conn, jobs_per_horse=5)
    w.batch = batch
    w.work(burst=True, logging_level="WARNING")
    assert len(finished_here) == 12  # by the worker (this process), not in its horses
    if batch > 1:  # half a batch at a time; the next batch taken while the last of one rendered
        assert finishes and max(finishes) == 2 and sum(finishes) == 12
        assert taken_ahead.count(4) == 2  # jobs 5-8 and 9-12 (1-4: the first take)

    q = make_queue(keys.RENDER_QUEUE, conn)
    ids = q.finished_job_registry.get_job_ids()
    assert len(ids) == 12 and q.failed_job_registry.count == 0
    from payrun import slipstore

    slips = sorted(p for p in cfg.slips_dir.rglob("*") if p.is_file() and p.name != slipstore.ID_FILE)
    assert (cfg.slips_dir / slipstore.ID_FILE).exists()  # (the first render worker names the store)
    assert len(slips) == 12 and all(p.suffix == ".pdf" for p in slips)  # no staged file left behind
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in slips)
    assert all(p.read_bytes().startswith(b"%PDF") for p in slips)
    for job_id in ids:
        job = PayrunJob.fetch(job_id, connection=conn)
        assert job.get_status() == JobStatus.FINISHED
        result = job.return_value()
        assert set(result) == {"slip", "bytes"}  # what render_slip returns, nothing of the hand-over
        assert (cfg.slips_dir / result["slip"]).stat().st_size == result["bytes"]
        h = conn.hgetall(job.key)
        assert h[b"worker_name"] == b"render.test.handover" and h[b"ended_at"] >= h[b"started_at"]
        assert job.meta["attempt"] == 1
    # one send per slip, each for its own slip
    sends = make_queue(keys.EMAIL_QUEUE, conn).get_jobs()
    assert sorted(j.args[0]["slip"] for j in sends) == sorted(
        PayrunJob.fetch(i, connection=conn).return_value()["slip"] for i in ids)
    # RQ's own books: every execution record gone, the worker's count, no job left current
    assert conn.zcard(q.started_job_registry.key) == 0 and not list(conn.scan_iter("rq:execution:*"))
    worker = conn.hgetall(w.key)
    assert int(worker[b"successful_job_count"]) == 12 and b"current_job" not in worker
    # the ledger: every render ran once and is done
    ledger_mod.drain(conn, ledger)
    rows = ledger.jobs(kind="render", limit=100)
    assert len(rows) == 12 and {r["status"] for r in rows} == {"done"}


@pytest.mark.parametrize("batch", [1, 4], ids=["one-at-a-time", "batch-of-4"])
def test_a_finish_that_fails_goes_through_the_jobs_failure_handling(world, monkeypatch, batch):
    """The worker's finish of one render raises (Redis gone at the send's enqueue; in a
    batch, at the slip's commit, before the batch's one transaction): that render is
    retried like any failed try (attempt spent, scheduled), the others finish, and the
    slip already in place stays (the retry writes it again)."""
    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)
    failed: list[str] = []
    if batch == 1:
        enqueue = tasks.enqueue_email

        def flaky(c, conf, payload):
            if not failed:
                failed.append(payload["employee_id"])
                raise redis.ConnectionError("Redis went away")
            return enqueue(c, conf, payload)

        monkeypatch.setattr(tasks, "enqueue_email", flaky)  # this process is the worker (burst)
    else:
        commit = tasks.commit_renders

        def flaky(c, results):  # noqa: F811 - (the batch's own failure point)
            errors = commit(c, results)
            if not failed:
                failed.append(results[0][tasks.FINISH_KEY]["email"]["employee_id"])
                errors[0] = redis.ConnectionError("Redis went away")
            return errors

        monkeypatch.setattr(tasks, "commit_renders", flaky)
        monkeypatch.setattr(tasks, "finish_render", lambda c, r: pytest.fail("a batch finishes in one transaction"))
    w = _warm_worker(conn, jobs_per_horse=100)
    w.batch = batch
    w.work(burst=True, logging_level="CRITICAL")

    q = make_queue(keys.RENDER_QUEUE, conn)
    n = len(_render_ids(conn))
    assert failed and q.finished_job_registry.count == n - 1
    bad = PayrunJob.fetch(f"render-{MONTH}-{failed[0]}", connection=conn)
    assert bad.get_status() in (JobStatus.SCHEDULED, JobStatus.QUEUED)
    assert bad.meta["attempt"] == 1 and "ConnectionError" in bad.meta["last_error"]
    assert conn.zcard(q.started_job_registry.key) == 0
    assert not conn.exists(f"rq:job:{keys.email_job_id(MONTH, failed[0])}")
    assert make_queue(keys.EMAIL_QUEUE, conn).count == n - 1


def test_staged_then_committed_is_write_slip(tmp_path):
    """stage_slip + commit_slip (two processes' halves) leave what write_slip leaves."""
    pdf = b"%PDF-1.7 test\n%%EOF\n"
    target = tmp_path / "a" / "b" / "slip.pdf"
    staged = slip.stage_slip(target, pdf)
    assert not target.exists() and staged.parent == target.parent and stat.S_IMODE(staged.stat().st_mode) == 0o600
    slip.commit_slip(staged, target)
    assert target.read_bytes() == pdf and not staged.exists()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    # a commit that cannot rename removes the staged file and says why
    staged = slip.stage_slip(target, pdf)
    with pytest.raises(FileNotFoundError):
        slip.commit_slip(staged, tmp_path / "missing-dir" / "slip.pdf")
    assert not staged.exists()
    assert [p.name for p in target.parent.iterdir()] == ["slip.pdf"]


def test_a_finish_moves_only_a_file_staged_beside_its_own_slip(cfg, conn, tmp_path):
    """What the horse hands over names the staged file; the worker renames only a file
    stage_slip made beside that slip's place, nothing else (and moves nothing then)."""
    rel = "2026-11/1/emp-1.pdf"
    other = cfg.slips_dir / "2026-11" / "1" / ".emp-2.pdf.1.ab.tmp"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x")
    elsewhere = tmp_path / ".emp-1.pdf.1.ab.tmp"
    elsewhere.write_bytes(b"x")
    for staged in (other, elsewhere):
        with pytest.raises(ValueError, match="not a slip staged for"):
            tasks.finish_render(conn, {"slip": rel, "bytes": 1, tasks.FINISH_KEY: {"staged": str(staged), "email": {}}})
        assert staged.exists()
    assert not (cfg.slips_dir / rel).exists()


def test_a_batch_commit_syncs_each_folder_once_and_a_failing_sync_fails_only_its_folders_slips(cfg, conn,
                                                                                               monkeypatch):
    """tasks.commit_renders: every staged slip durable and in place, then one sync per
    folder (not one per slip); a folder whose sync fails fails the slips put in it, each
    told with the error, and only those. A slip not staged beside its place is refused
    alone."""
    import errno

    pdf = b"%PDF-1.7 test\n%%EOF\n"
    rels = ["2026-11/1/e-1.pdf", "2026-11/1/e-2.pdf", "2026-11/2/e-3.pdf", "2026-11/2/e-4.pdf"]
    results = [{"slip": rel, "bytes": len(pdf),
                tasks.FINISH_KEY: {"staged": str(slip.stage_slip(cfg.slips_dir / rel, pdf)), "email": {}}}
               for rel in rels]
    results[3][tasks.FINISH_KEY]["staged"] = results[2][tasks.FINISH_KEY]["staged"]  # (not e-4's)
    synced = []
    sync = slip.sync_folder

    def failing_in_1(folder):
        synced.append(folder.name)
        here = [r for r in rels if r.split("/")[1] == folder.name and r != rels[3]]
        assert all((cfg.slips_dir / r).exists() for r in here)  # renamed in first: the sync makes them durable
        if folder.name == "1":
            raise OSError(errno.EIO, "Input/output error")
        sync(folder)

    monkeypatch.setattr(slip, "sync_folder", failing_in_1)
    errors = tasks.commit_renders(conn, results)
    assert sorted(synced) == ["1", "2"]  # once each, for four slips
    assert [type(e).__name__ for e in errors[:2]] == ["OSError", "OSError"]  # (one disk write still works: EIO alone)
    assert errors[2] is None and (cfg.slips_dir / rels[2]).read_bytes() == pdf
    assert isinstance(errors[3], ValueError) and not (cfg.slips_dir / rels[3]).exists()
    # the renames into 1 happened (not durable: the retry writes them again); nothing moved for
    # the refused one (its own staged file stays, as finish_render leaves it)
    left = sorted(p.name for p in (cfg.slips_dir / "2026-11").rglob("*"))
    assert left[1:] == ["1", "2", "e-1.pdf", "e-2.pdf", "e-3.pdf"] and left[0].startswith(".e-4.pdf.")
    with pytest.raises(OSError):
        tasks.commit_render(conn, {"slip": "2026-11/1/e-5.pdf", "bytes": len(pdf), tasks.FINISH_KEY: {
            "staged": str(slip.stage_slip(cfg.slips_dir / "2026-11/1/e-5.pdf", pdf)), "email": {}}})


def test_outside_a_warm_horse_render_slip_does_everything_itself(world):
    """The fork-per-job worker (jobs_per_horse = 1) and direct calls never hand over."""
    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)
    _warm_worker(conn, jobs_per_horse=1).work(burst=True, logging_level="WARNING")
    q = make_queue(keys.RENDER_QUEUE, conn)
    assert q.failed_job_registry.count == 0 and q.finished_job_registry.count == len(_render_ids(conn))
    for job_id in q.finished_job_registry.get_job_ids():
        assert set(Job.fetch(job_id, connection=conn, serializer=PayrunJob(connection=conn).serializer)
                   .return_value()) == {"slip", "bytes"}
    assert not tasks._hand_finish_over


def test_a_second_sigterm_hands_back_a_render_waiting_to_be_finished(world):
    """The horse answered, the worker has not finished the render yet (it is handing the
    horse the next job): a second SIGTERM puts it back at the front of its queue like the
    job in hand, its execution record gone, the try counted returned (no attempt spent)."""
    import signal

    from jobs import events

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)
    q = make_queue(keys.RENDER_QUEUE, conn)
    w = _warm_worker(conn, jobs_per_horse=100)
    job, queue = w.dequeue_job_and_maintain_ttl(None)
    w.prepare_execution(job)  # started by the worker, as before a hand-over
    execution = w.execution
    assert conn.zcard(q.started_job_registry.key) == 1
    snapshot = job.args[0]
    rel = tasks.slip_relpath(MONTH, snapshot["company"]["id"], snapshot["employee"]["id"])
    staged = slip.stage_slip(cfg.slips_dir / rel, b"%PDF-1.7\n%%EOF\n")
    handed = {"slip": rel, "bytes": 15, tasks.FINISH_KEY: {"staged": str(staged),
                                                            "email": tasks.email_payload(snapshot, rel)}}
    w._rendered, w.in_hand = [(job, queue, execution, {"result": handed})], None
    with pytest.raises(SystemExit):
        w.request_force_stop(signal.SIGTERM, None)
    assert q.get_job_ids()[0] == job.id
    assert conn.zcard(q.started_job_registry.key) == 0 and not conn.exists(execution.key)
    back = PayrunJob.fetch(job.id, connection=conn)
    assert back.get_status() == JobStatus.QUEUED and int(conn.hget(back.key, events.RETURNED_FIELD)) == 1
    assert not conn.exists(f"rq:job:{keys.email_job_id(MONTH, snapshot['employee']['id'])}")  # no send yet


def test_a_render_tried_again_removes_the_slip_staged_by_a_try_whose_process_was_killed(world):
    """On-call drill (session 41): `kill -9` of a pdf-render worker between its horse's
    stage of a slip and the worker's commit left `.emp-00338.pdf.<pid>.<hex>.tmp` (a copy
    of the slip) beside the slip its next try made, for good. A render that is not its
    slip's first try removes the stages of that slip whose process is gone; a stage of a
    live process (another render of it under way) stays."""
    import subprocess
    import sys

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)
    job_id = _render_ids(conn)[0]
    job = PayrunJob.fetch(job_id, connection=conn)
    path = cfg.slips_dir / tasks.slip_relpath(MONTH, 1, job_id.split(f"render-{MONTH}-", 1)[1])
    job.meta["attempt"] = 1  # its first try was returned by the reaper
    job.save_meta()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    path.parent.mkdir(parents=True, exist_ok=True)
    stale, live = path.parent / f".{path.name}.{dead}.e40389ab.tmp", path.parent / f".{path.name}.{os.getpid()}.0a1b2c3d.tmp"
    stale.write_bytes(b"%PDF- a slip staged by a killed try")
    live.write_bytes(b"%PDF- a slip being staged now")
    # another host's (the store is shared): one just staged stays, one older than its try's
    # render timeout and lease goes (session 42)
    theirs = path.parent / slip.stage_name(path.name, "0badcafe", dead, "0a1b2c3d")
    abandoned = path.parent / slip.stage_name(path.name, "0badcafe", os.getpid(), "0a1b2c3d")
    theirs.write_bytes(b"%PDF- staged on another host, its try finishing there")
    abandoned.write_bytes(b"%PDF- staged on another host long ago")
    long_ago = time.time() - (cfg.render.timeout_s + cfg.lease.visibility_s) - 30
    os.utime(abandoned, (long_ago, long_ago))
    _warm_worker(conn, jobs_per_horse=100).work(burst=True, logging_level="WARNING")
    assert make_queue(keys.RENDER_QUEUE, conn).failed_job_registry.count == 0
    assert path.exists() and not stale.exists() and live.exists()
    assert theirs.exists() and not abandoned.exists()
    assert not list(cfg.slips_dir.rglob(f".*.{dead}.*.tmp"))


def test_a_stage_names_the_host_that_wrote_it(tmp_path):
    """`.<slip>.<host>-<pid>.<hex>.tmp`: the slip store is shared by hosts, and a pid
    means a process only on its own host. Short and safe (8 hex characters of the host,
    whatever its hostname); finish_render's check still holds."""
    from payrun.procs import host_id

    target = tmp_path / "emp-1.pdf"
    staged = slip.stage_slip(target, b"%PDF-")
    assert staged.name.startswith(f".emp-1.pdf.{host_id()}-{os.getpid()}.") and staged.name.endswith(".tmp")
    assert slip.staged_by(staged.name, "emp-1.pdf") == (host_id(), os.getpid())
    assert slip.stage_slip(target, b"%PDF-", host="0badcafe").name.startswith(f".emp-1.pdf.0badcafe-{os.getpid()}.")
    assert slip.staged_by(".emp-1.pdf.4242.e40389ab.tmp", "emp-1.pdf") == (None, 4242)  # before session 42
    for other in (".emp-1.pdf.host-42.ab.tmp", ".emp-2.pdf.0badcafe-42.ab.tmp", ".emp-1.pdf.0badcafe-42.ab",
                  ".emp-1.pdf.0BADCAFE-42.ab.tmp", "emp-1.pdf", ".emp-1.pdf.0badcafe-.ab.tmp"):
        assert slip.staged_by(other, "emp-1.pdf") is None, other


def _dead_pid() -> int:
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_stage_of_another_host_is_removed_only_once_its_try_is_over(tmp_path):
    """Hosts A and B share the slip store. A render on A whose lease ran out (stuck) is
    tried again on B while A's try still runs: A's stage names a pid that B does not have
    (or that is some other process of B's). B judged it by that pid and removed it, and
    A's commit then failed. B now leaves it until it is older than A's render timeout and
    lease (jobs.policy.stage_abandoned); its own stages are still judged by pid, and a
    stage named before hosts were (no host) as before."""
    import time

    a, b = "aaaaaaaa", "bbbbbbbb"
    path = tmp_path / "2026-11" / "1" / "emp-1.pdf"
    dead = _dead_pid()
    a_live = slip.stage_slip(path, b"%PDF- A, about to commit", host=a)  # (this pid is alive here, too)
    a_dead = path.parent / slip.stage_name(path.name, a, dead, "0a1b2c3d")  # no process of B's has it
    a_dead.write_bytes(b"%PDF- A's other try, finishing")
    b_dead = path.parent / slip.stage_name(path.name, b, dead, "0a1b2c3d")
    b_dead.write_bytes(b"%PDF- B's own killed try")
    b_live = slip.stage_slip(path, b"%PDF- B's live try", host=b)
    old_dead = path.parent / f".{path.name}.{dead}.e40389ab.tmp"
    old_dead.write_bytes(b"%PDF- staged before session 42, its process gone")
    old_live = path.parent / f".{path.name}.{os.getpid()}.e40389ab.tmp"
    old_live.write_bytes(b"%PDF- staged before session 42, its process alive")

    lease = (30, 60)  # render timeout, visibility
    now = time.time()
    for staged in path.parent.iterdir():
        os.utime(staged, (now, now))  # all staged just now (the clock passed in)
    assert sorted(slip.remove_dead_stages(path, host=b, lease=lease, now=now + 90)) == sorted([b_dead, old_dead])
    assert a_live.exists() and a_dead.exists() and b_live.exists() and old_live.exists()
    assert slip.remove_dead_stages(path, host=b, now=now + 3600) == []  # no lease given: never another host's
    slip.commit_slip(a_live, path)  # A's try finishes: its commit finds its stage
    assert path.read_bytes() == b"%PDF- A, about to commit"
    # A's other stage, long past its try's timeout and lease: abandoned
    assert slip.remove_dead_stages(path, host=b, lease=lease, now=now + 91) == [a_dead]
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, b_live.name, old_live.name])
    # and on A, A's stage of a gone process goes at once, B's live one stays
    a_dead.write_bytes(b"%PDF-")
    os.utime(a_dead, (now, now))
    assert slip.remove_dead_stages(path, host=a, lease=lease, now=now) == [a_dead] and b_live.exists()
