"""Deadlines, shutdown and the reaper, with real worker processes and real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner
from rq import Retry, SimpleWorker

from conftest import started_send, wait_for
from console.data import read_workers
from jobs import events, reaper
from jobs.runtime import PayrunJob, make_queue
from payrun import keys
from payrun.procs import host_id
from payrun import ledger as ledger_mod
from payrun.ledger import Ledger

FAST_RETRY = {"base_s": 0.1, "cap_s": 0.2, "attempts": 2}

UP = 3600.0
"""A Redis up an hour: a missing liveness key means its worker died (in a Redis up for
less than jobs.policy.LIVENESS_SETTLE_S it may have lapsed while Redis was down)."""


@pytest.fixture(params=[100, 1], ids=["warm-horse", "fork-per-job"])
def env(cfg, tmp_path, request):
    """Environment for worker processes: short timeout and grace, test jobs allowed; each
    render-worker test runs with the default warm horse and with RQ's fork per job."""
    conf = tmp_path / "payrun.toml"
    conf.write_text(
        f"[render]\ntimeout_s = 2\njobs_per_horse = {request.param}\n[email]\ntimeout_s = 2\n[lease]\ngrace_s = 2\n"
    )
    e = dict(os.environ, PAYRUN_CONFIG=str(conf), PAYRUN_TEST_JOBS="1")
    return e


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test():
    """A test that fails half-way must not leave its worker taking later tests' jobs."""
    yield
    while _started:
        p = _started.pop()
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def start_worker(env, queue: str, log_path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", queue], env=env,
                         stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
    _started.append(p)
    return p


def enqueue(conn, queue: str, func: str, *args, job_id: str, timeout: int = 2, retry=None, **meta):
    return make_queue(queue, conn).enqueue_call(
        func, args=args, job_id=job_id, timeout=timeout, retry=retry,
        meta={"kind": "test", "retry": FAST_RETRY, **meta},
    )


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def status_of(conn, job_id: str) -> str:
    return PayrunJob.fetch(job_id, connection=conn).get_status(refresh=True)


def worker_busy_with(conn, job_id: str) -> bool:
    return any(m.decode().startswith(job_id + ":") for m in conn.zrange("rq:wip:pdf-render", 0, -1))


def test_a_render_hung_in_c_code_is_killed_at_its_timeout_retried_then_failed(conn, env, tmp_path, cfg):
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.hang", job_id="hang-1", retry=Retry(max=1))
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="after-1")
    w = start_worker(env, keys.RENDER_QUEUE, tmp_path / "w.log")
    try:
        # timed from the first try's start, not the worker's (its start-up varies with the host's load)
        wait_for(lambda: worker_busy_with(conn, "hang-1"), timeout_s=60, what="the hung job to start")
        t0 = time.monotonic()
        wait_for(lambda: status_of(conn, "hang-1") == "failed", timeout_s=40, what="hung job to fail")
        elapsed = time.monotonic() - t0
        # two attempts of 2 s + 2 s margin each (RQ alone would wait 62 s per attempt)
        assert elapsed < 20, elapsed
        wait_for(lambda: status_of(conn, "after-1") == "finished", timeout_s=20, what="the next job")
        assert w.poll() is None  # the worker keeps serving
    finally:
        w.terminate()
        w.wait(timeout=20)
    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": "hang-1", "kind": "render"}])
    ledger_mod.drain(conn, ledger)
    job = ledger.job("hang-1")
    assert job["status"] == "failed" and job["attempts"] == 2
    assert [h["outcome"] for h in job["history"]] == ["retrying", "failed"]
    assert "timeout" in job["last_error"]


def test_a_try_held_back_by_the_provider_spends_no_attempt_and_the_ledger_says_held(conn, env, tmp_path, cfg):
    from payrun.ledger import tries_text

    # no Retry at all: a job with no retries left still gets its held try back
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.throttled_once", job_id="held-1")
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.throttled_once", True, job_id="held-2")
    w = start_worker(env, keys.RENDER_QUEUE, tmp_path / "w.log")
    try:
        wait_for(lambda: status_of(conn, "held-1") == "finished", timeout_s=30, what="the held job to finish")
        wait_for(lambda: status_of(conn, "held-2") == "failed", timeout_s=30, what="the other to fail")
    finally:
        w.terminate()
        w.wait(timeout=20)
    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": "held-1", "kind": "render"}, {"id": "held-2", "kind": "render"}])
    ledger_mod.drain(conn, ledger)
    job = ledger.job("held-1")
    assert job["status"] == "done" and job["attempts"] == 2
    assert [h["outcome"] for h in job["history"]] == ["held", "done"]
    assert tries_text(job) == ("2 tries: 1 attempt spent, 1 held back (rate limit, provider outage, its send-email "
                               "process's own credentials refused, a send already in flight, or a slip store full "
                               "or that cannot be written): no attempt spent")
    assert "job held-1 held (try 1, no attempt spent)" in (tmp_path / "w.log").read_text()
    from payrun.cli import cli

    out = CliRunner().invoke(cli, ["job", "held-1"], env=env)
    assert out.exit_code == 0 and "1 attempt spent, 1 held back" in out.output, out.output
    # its last error is the held try's: not "of an earlier attempt" (drill 43)
    assert "last error (of an earlier try, held back: no attempt spent): " in out.output, out.output
    # the failed list counts attempts spent (the budget), the held try beside them
    out = CliRunner().invoke(cli, ["failed"], env=env)
    assert out.exit_code == 0 and "held-2" in out.output and "attempts=1  (+1 held)" in out.output, out.output
    out = CliRunner().invoke(cli, ["failed", "--json"], env=env)
    assert [(r["id"], r["attempts"], r["held"], r["returned"]) for r in json.loads(out.output)] == [("held-2", 2, 1, 0)]
    from console.failed import FailedFilter, page

    for flt in (FailedFilter(), FailedFilter(text="422")):  # from Redis, and from the ledger
        assert [(r["id"], r["attempts"]) for r in page(conn, ledger, flt).rows] == [("held-2", 1)], flt


def _died_under_its_first_try(conn, job, worker: str) -> None:
    """As a render worker that took ``job``, started it and died leaves it (for the reaper)."""
    conn.lrem(make_queue(keys.RENDER_QUEUE, conn).key, 0, job.id)
    conn.zadd("rq:wip:pdf-render", {f"{job.id}:exec1": time.time() + 300})
    conn.hset(job.key, mapping={"worker_name": worker, "status": "started"})
    job.meta["attempt"] = 1
    job.save_meta()


def _worker_until(env, tmp_path, done, what: str) -> None:
    w = start_worker(env, keys.RENDER_QUEUE, tmp_path / "w.log")
    try:
        wait_for(done, timeout_s=30, what=what)
    finally:
        w.terminate()
        w.wait(timeout=20)


def test_a_try_returned_by_the_reaper_is_not_counted_as_an_attempt_spent(conn, env, tmp_path, cfg):
    """The on-call engineer reads `attempts=` against the retry budget: a try whose worker
    died (or was stopped by a deploy) and was handed back spent none of it."""
    from console.failed import FailedFilter, page
    from payrun.cli import cli
    from payrun.ledger import tries_text

    job = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.throttled_once", True, job_id="back-1")
    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": "back-1", "kind": "render"}])
    # try 1: taken by a worker that died with it
    _died_under_its_first_try(conn, job, "render.gone.1")
    events.emit(conn, job.id, "running", attempt=1, worker="render.gone.1")
    assert [s.job_id for s in reaper.reap(conn, redis_uptime_s=UP)] == ["back-1"]
    # try 2: a live worker, a permanent error
    _worker_until(env, tmp_path, lambda: status_of(conn, "back-1") == "failed", "the job to fail")
    ledger_mod.drain(conn, ledger)
    row = ledger.job("back-1")
    assert row["attempts"] == 2 and [h["outcome"] for h in row["history"]] == ["reaped", "failed"]
    assert tries_text(row) == "2 tries: 1 attempt spent, 1 handed back (its worker stopped or died): no attempt spent"
    out = CliRunner().invoke(cli, ["job", "back-1"], env=env)
    assert out.exit_code == 0 and "1 attempt spent, 1 handed back" in out.output, out.output
    assert "failed  attempts=1 (+1 returned)  key=" in out.output, out.output  # counted as `failed` does
    out = CliRunner().invoke(cli, ["failed"], env=env)
    assert out.exit_code == 0 and "attempts=1  (+1 returned)" in out.output, out.output
    out = CliRunner().invoke(cli, ["failed", "--json"], env=env)
    assert [(r["attempts"], r["held"], r["returned"]) for r in json.loads(out.output)] == [(2, 0, 1)]
    for flt in (FailedFilter(), FailedFilter(text="422")):  # from Redis, and from the ledger
        assert [(r["id"], r["attempts"]) for r in page(conn, ledger, flt).rows] == [("back-1", 1)], flt
    # returned by a reaper of the version before the Redis count (a rolling deploy): the
    # ledger's record of it still counts
    conn.hdel(job.key, events.RETURNED_FIELD)
    out = CliRunner().invoke(cli, ["failed", "--json"], env=env)
    assert [(r["attempts"], r["returned"]) for r in json.loads(out.output)] == [(2, 1)]
    assert [(r["id"], r["attempts"]) for r in page(conn, ledger, FailedFilter()).rows] == [("back-1", 1)]


def test_a_try_returned_by_the_reaper_does_not_lengthen_the_next_backoff(conn, env, tmp_path):
    """A worker died under try 1 (the reaper returned it); try 2 fails: the wait before
    try 3 is the first attempt's (2 × base), not the second's (4 × base)."""
    retry = {"base_s": 5.0, "cap_s": 300.0, "attempts": 3, "jitter": False}  # no jitter: the ceiling itself
    job = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.flaky", job_id="flaky-1", retry=Retry(max=2))
    job.meta["retry"] = retry
    job.save_meta()
    _died_under_its_first_try(conn, job, "render.gone.3")
    assert [s.job_id for s in reaper.reap(conn, redis_uptime_s=UP)] == ["flaky-1"]
    _worker_until(env, tmp_path, lambda: status_of(conn, "flaky-1") == "scheduled", "try 2 to fail")
    job = PayrunJob.fetch("flaky-1", connection=conn)
    assert (job.meta["attempt"], job.returned_tries, job.retries_left) == (2, 1, 1)
    assert job.meta["last_delay"] == 10.0  # backoff_ceiling(1, 5, 300); the reaped try counted: 20


def test_a_job_whose_worker_died_before_its_horse_started_it_is_returned_without_a_try(conn):
    """The worker records the execution (rq:wip) before its horse starts the job: a death
    in between is returned by the reaper, but no try began, so none is counted returned
    and the ledger gets no attempt (it would overwrite the previous try's row)."""
    queue = make_queue(keys.RENDER_QUEUE, conn)
    job = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="unstarted-1")
    conn.lrem(queue.key, 0, job.id)
    conn.zadd("rq:wip:pdf-render", {f"{job.id}:exec1": time.time() + 300})
    conn.hset(job.key, mapping={"worker_name": "render.gone.2"})  # status still 'queued'
    assert [s.job_id for s in reaper.reap(conn, redis_uptime_s=UP)] == ["unstarted-1"]
    assert queue.get_job_ids() == ["unstarted-1"]
    assert conn.hget(job.key, events.RETURNED_FIELD) is None
    (ev,) = [e for e in (ledger_mod._decode(f) for _, f in conn.xrange(keys.EVENTS_STREAM))
             if e.get("outcome") == "reaped"]
    assert "attempt" not in ev


def test_attempts_spent_leaves_out_held_and_returned_tries():
    assert events.attempts_spent(6, held=3, returned=1) == 2
    assert events.attempts_spent(2) == 2
    assert events.attempts_spent(1, held=1, returned=1) == 0  # never below zero
    assert set(events.NO_ATTEMPT_OUTCOMES) == {"held", "requeued", "reaped"}


def test_sigterm_finishes_within_grace_then_requeues_at_front_without_spending_an_attempt(conn, env, tmp_path, cfg):
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.sleep", 30, job_id="long-1", timeout=40, retry=Retry(max=3))
    w = start_worker(env, keys.RENDER_QUEUE, tmp_path / "w.log")
    wait_for(lambda: worker_busy_with(conn, "long-1"), timeout_s=30, what="the job to start")
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="later-1")
    t0 = time.monotonic()
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 2 + 8  # grace 2 s, then out by itself (not after the 30 s job)
    ids = make_queue(keys.RENDER_QUEUE, conn).get_job_ids()
    assert ids == ["long-1", "later-1"]  # at the front
    job = PayrunJob.fetch("long-1", connection=conn)
    assert job.retries_left == 3 and job.get_status() == "queued"
    assert not worker_busy_with(conn, "long-1")
    assert conn.hget(job.key, events.RETURNED_FIELD) == b"1"  # a try that spent no attempt

def test_a_second_sigterm_before_the_horse_started_hands_the_job_back(conn):
    """Both signals can land between the dequeue and the fork (the job already in RQ's
    started registry, no horse yet): the job still goes back to the front, once, and a
    job that finished in the horse meanwhile does not (CI caught the first case)."""
    from rq.job import JobStatus

    from jobs.runtime import RenderWorker

    q = make_queue(keys.RENDER_QUEUE, conn)
    job = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="early-1")
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="next-1")
    w = RenderWorker([q], connection=conn, name="render.test.early")
    taken, _ = q.dequeue_any([q], None, connection=conn, job_class=PayrunJob, serializer=w.serializer)
    assert taken.id == "early-1"
    w.prepare_execution(taken)  # in rq:wip now, as the test harness sees a busy worker
    w.in_hand = (taken, q)
    with pytest.raises(SystemExit):
        w.request_force_stop(signal.SIGTERM, None)
    assert q.get_job_ids() == ["early-1", "next-1"]  # back at the front
    assert conn.zcard(f"rq:wip:{keys.RENDER_QUEUE}") == 0
    # that try never began: no returned try counted, and no attempt for the ledger to record
    assert conn.hget("rq:job:early-1", events.RETURNED_FIELD) is None
    (ev,) = [ledger_mod._decode(f) for _, f in conn.xrange(keys.EVENTS_STREAM)
             if ledger_mod._decode(f).get("outcome") == "requeued"]
    assert ev["job"] == "early-1" and "attempt" not in ev

    taken, _ = q.dequeue_any([q], None, connection=conn, job_class=PayrunJob, serializer=w.serializer)
    w.prepare_execution(taken)
    taken.set_status(JobStatus.FINISHED)  # its horse finished it just before the signal
    w.in_hand = (taken, q)
    with pytest.raises(SystemExit):
        w.request_force_stop(signal.SIGTERM, None)
    assert q.get_job_ids() == ["next-1"]  # not run twice



def test_a_second_sigterm_requeues_at_once(conn, env, tmp_path):
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.sleep", 30, job_id="long-2", timeout=40, retry=Retry(max=3))
    env = dict(env)
    env["PAYRUN_CONFIG"] = str(tmp_path / "slow-grace.toml")
    (tmp_path / "slow-grace.toml").write_text("[lease]\ngrace_s = 50\n")
    w = start_worker(env, keys.RENDER_QUEUE, tmp_path / "w.log")
    wait_for(lambda: worker_busy_with(conn, "long-2"), timeout_s=30, what="the job to start")
    w.send_signal(signal.SIGTERM)

    def first_signal_seen():  # two signals sent back to back arrive as one
        return any(conn.hget(k, "shutdown_requested_date") for k in conn.keys("rq:worker:render.*"))

    wait_for(first_signal_seen, timeout_s=10, what="the worker to take the first SIGTERM")
    t0 = time.monotonic()
    w.send_signal(signal.SIGTERM)
    w.wait(timeout=10)
    assert time.monotonic() - t0 < 5
    assert make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == ["long-2"]
    assert PayrunJob.fetch("long-2", connection=conn).retries_left == 3


def test_sigkill_loses_nothing_the_reaper_returns_the_job(cfg, conn, env, tmp_path):
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.sleep", 30, job_id="crash-1", timeout=40, retry=Retry(max=3))
    w = start_worker(env, keys.RENDER_QUEUE, tmp_path / "w.log")
    wait_for(lambda: worker_busy_with(conn, "crash-1"), timeout_s=30, what="the job to start")
    # RQ writes the worker's current_job from the work horse, a moment after the execution
    # (rq:wip) is recorded: a kill in between leaves a dead worker that never named its job
    wait_for(lambda: any(conn.hget(k, "current_job") == b"crash-1" for k in conn.keys("rq:worker:render.*")),
             timeout_s=30, what="the worker to name its job")
    kids = children(w.pid)  # its work horse (and RQ's scheduler process, once it holds its lock)
    assert kids, "no work horse"
    w.kill()  # SIGKILL: a crash, nothing runs on the way out
    w.wait(timeout=10)
    # ... and they die with it (PR_SET_PDEATHSIG): no orphan finishes the job after the
    # reaper has returned it, or keeps writing into Redis
    wait_for(lambda: not any(alive(k) for k in kids), timeout_s=10, what=f"the worker's children {kids} to die")
    # its liveness key lapses within 10 s; until then the job is running, not stuck
    wait_for(lambda: not read_workers(conn, time.time())[0].alive, timeout_s=20, interval_s=0.2,
             what="its liveness to lapse")
    (gone,) = read_workers(conn, time.time())  # what `payrun workers` and the console show
    assert (gone.job_id, gone.job_returned) == ("crash-1", None)  # still held: the reaper has not run
    returned = reaper.reap(conn, redis_uptime_s=UP)
    assert [s.job_id for s in returned] == ["crash-1"] and "gone" in returned[0].reason
    assert make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == ["crash-1"]
    assert PayrunJob.fetch("crash-1", connection=conn).retries_left == 3
    assert reaper.reap(conn, redis_uptime_s=UP) == []  # once
    assert conn.hget("rq:job:crash-1", events.RETURNED_FIELD) == b"1"  # a try that spent no attempt
    # RQ keeps the dead worker registered for minutes: it must not read as busy with the job
    (gone,) = read_workers(conn, time.time())
    assert (gone.alive, gone.job_id, gone.job_returned) == (False, None, "crash-1")
    from payrun.cli import cli

    Ledger(cfg.ledger_path).close()  # a data directory in use (the CLI refuses an empty one)
    out = CliRunner().invoke(cli, ["workers"], env=env)
    assert out.exit_code == 0 and "GONE" in out.output and "its job crash-1 was handed back" in out.output, out.output
    # (walkthrough, session 35) the columns line up with the header's, whatever the host's name
    from conftest import assert_worker_columns_line_up

    assert_worker_columns_line_up(out.output)


def test_two_reapers_at_once_return_a_job_exactly_once(conn):
    queue = make_queue(keys.RENDER_QUEUE, conn)
    for i in range(20):
        job = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id=f"dead-{i}")
        conn.lrem(queue.key, 0, job.id)  # as if a worker had taken it...
        conn.zadd("rq:wip:pdf-render", {f"{job.id}:exec{i}": time.time() + 300})
        conn.hset(job.key, mapping={"worker_name": "render.gone.1", "status": "started"})  # ...and died
    results: list[list] = []
    barrier = threading.Barrier(8)

    def run():
        barrier.wait()
        results.append(reaper.reap(conn, redis_uptime_s=UP))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    returned = [s.job_id for r in results for s in r]
    assert sorted(returned) == sorted(f"dead-{i}" for i in range(20))
    assert sorted(queue.get_job_ids()) == sorted(f"dead-{i}" for i in range(20))
    assert conn.zcard("rq:wip:pdf-render") == 0
    # each counted once as a returned try, with the return itself
    assert {conn.hget(f"rq:job:dead-{i}", events.RETURNED_FIELD) for i in range(20)} == {b"1"}


def strand(conn, queue: str, job_id: str) -> None:
    """As RQ's dequeue does (BLMOVE queue -> intermediate), by a worker that then died."""
    q = make_queue(queue, conn)
    assert conn.lmove(q.key, q.intermediate_queue_key) == job_id.encode()


def test_a_job_taken_by_a_worker_that_died_before_starting_it_is_returned_once(conn):
    """The gap between RQ's BLMOVE and the started registry: the job is in no queue and
    no registry. The reaper returns it once it has sat there DEQUEUED_SETTLE_S (first
    pass: seen; later pass: returned), exactly once with eight reapers at once."""
    queue = make_queue(keys.RENDER_QUEUE, conn)
    for i in range(5):
        enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id=f"taken-{i}")
        strand(conn, keys.RENDER_QUEUE, f"taken-{i}")
    # one that a live worker has started: in the intermediate list *and* the registry
    enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="starting-1")
    strand(conn, keys.RENDER_QUEUE, "starting-1")
    conn.zadd("rq:wip:pdf-render", {"starting-1:e": time.time() + 60})
    conn.set(keys.alive("render.alive.1"), 1, ex=10)
    conn.hset("rq:job:starting-1", "worker_name", "render.alive.1")
    assert queue.get_job_ids() == []
    t0 = time.time()
    assert reaper.reap(conn, now=t0) == []  # first sighting: a live worker may be mid-gap
    assert reaper.find_stuck(conn, now=t0 + 5) == []
    stuck = reaper.find_stuck(conn, now=t0 + 10)
    assert sorted(s.job_id for s in stuck) == [f"taken-{i}" for i in range(5)]
    assert all(s.where == "dequeued" and "before starting it" in s.reason for s in stuck)
    results: list[list] = []
    barrier = threading.Barrier(8)

    def run():
        barrier.wait()
        results.append(reaper.reap(conn, now=t0 + 11))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.job_id for r in results for s in r) == [f"taken-{i}" for i in range(5)]
    assert sorted(queue.get_job_ids()) == [f"taken-{i}" for i in range(5)]
    assert conn.lrange(queue.intermediate_queue_key, 0, -1) == [b"starting-1"]
    assert status_of(conn, "taken-0") == "queued"
    # the ledger hears of each return once, in the same step as the return
    evs = [ledger_mod._decode(f) for _, f in conn.xrange(keys.EVENTS_STREAM)]
    reaped = [e for e in evs if e.get("outcome") == "reaped"]
    assert sorted(e["job"] for e in reaped) == [f"taken-{i}" for i in range(5)]
    assert all(e["status"] == "queued" and "attempt" not in e for e in reaped)
    assert conn.hkeys(keys.dequeued_seen(keys.RENDER_QUEUE)) == []  # no marks left behind
    # never started, so no try was returned: nothing counted
    assert conn.hget("rq:job:taken-0", events.RETURNED_FIELD) is None


def test_a_worker_stopping_returns_what_it_took_but_did_not_start_at_once(conn):
    enqueue(conn, keys.EMAIL_QUEUE, "jobs.testing.noop", job_id="taken-e")
    strand(conn, keys.EMAIL_QUEUE, "taken-e")
    returned = reaper.return_dequeued_now(conn, [keys.EMAIL_QUEUE], settle_s=0.2)
    assert [s.job_id for s in returned] == ["taken-e"]
    assert make_queue(keys.EMAIL_QUEUE, conn).get_job_ids() == ["taken-e"]
    assert reaper.return_dequeued_now(conn, [keys.EMAIL_QUEUE], settle_s=0.2) == []


def test_a_live_worker_job_is_not_reaped(conn):
    conn.set(keys.alive("render.alive.1"), 1, ex=10)
    job = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="alive-1")
    conn.lrem(make_queue(keys.RENDER_QUEUE, conn).key, 0, job.id)
    conn.zadd("rq:wip:pdf-render", {"alive-1:e": time.time() + 60})
    conn.hset(job.key, "worker_name", "render.alive.1")
    assert reaper.find_stuck(conn) == []
    assert [s.job_id for s in reaper.find_stuck(conn, now=time.time() + 120)] == ["alive-1"]  # lease lapsed


def test_reap_saying_nothing_stuck_says_a_worker_just_killed_still_counts_as_alive(cfg, conn):
    """Ops walkthrough: `payrun reap` right after a kill -9 said "nothing stuck" (exit 0),
    and 10 s later returned the 34 jobs the dead sender held: a false all-clear."""
    from click.testing import CliRunner

    from payrun.cli import cli

    assert CliRunner().invoke(cli, ["reap"]).output.strip() == "nothing stuck"  # nothing running
    conn.set(keys.alive("render.alive.2"), 1, ex=10)
    job = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id="alive-2")
    conn.lrem(make_queue(keys.RENDER_QUEUE, conn).key, 0, job.id)
    conn.zadd("rq:wip:pdf-render", {"alive-2:e": time.time() + 60})
    conn.hset(job.key, "worker_name", "render.alive.2")
    out = CliRunner().invoke(cli, ["reap"])
    assert out.exit_code == 0 and out.output.startswith("nothing stuck\n"), out.output
    assert "1 job is running on live workers; a worker killed in the last 10 s still counts as alive" in out.output


def test_a_job_just_started_is_not_reaped_before_its_record_names_the_worker(conn):
    """RQ records the execution (rq:wip, rq:execution:...) one transaction before it
    writes worker_name into the job hash. A reaper pass in between took the live worker
    for dead and returned a send that was in flight (`payrun demo`: sent twice, caught by
    the provider's dedupe). The worker is read from the execution record now."""
    from jobs.runtime import LaneWorker

    q = make_queue(keys.EMAIL_QUEUE, conn)
    enqueue(conn, keys.EMAIL_QUEUE, "jobs.testing.noop", job_id="window-1")
    w = LaneWorker([q], connection=conn, name="email.test.window")
    conn.set(keys.alive(w.name), 1, ex=10)  # the worker lives
    taken, _ = q.dequeue_any([q], None, connection=conn, job_class=PayrunJob, serializer=w.serializer)
    # RQ's first transaction only (a forking worker's parent does this; a lane writes the
    # execution with the job's start, in one transaction): in rq:wip, no worker_name yet
    SimpleWorker.prepare_execution(w, taken)
    assert conn.zcard(f"rq:wip:{keys.EMAIL_QUEUE}") == 1 and not conn.hget(taken.key, "worker_name")
    assert reaper.find_stuck(conn) == []
    # an earlier attempt's (dead) worker still named in the job hash does not count either
    conn.hset(taken.key, "worker_name", "email.gone.1")
    assert reaper.find_stuck(conn) == []
    # the execution's own worker gone: returned
    conn.delete(keys.alive(w.name))
    assert [s.job_id for s in reaper.find_stuck(conn, redis_uptime_s=UP)] == ["window-1"]
    assert "email.test.window is gone" in reaper.find_stuck(conn, redis_uptime_s=UP)[0].reason


def test_a_lane_whose_liveness_lapsed_while_redis_was_down_keeps_its_send(conn):
    """Redis restarted after more than 10 s away: every liveness key has lapsed, and a live
    lane beats again only up to 2 s later. A reaper pass in that gap returned the lane's
    job and freed its send's claim while the lane waited to record a send the provider
    had accepted: the next try sent the slip again. In a Redis up less than
    LIVENESS_SETTLE_S only the lease decides."""
    from jobs import idempotency

    started_send(conn, "send-live", "slip:live", attempt=1, worker="email.restarted.1", lease_s=60)
    assert idempotency.claim(conn, "slip:live", "send-live:1", 60) == idempotency.OK
    assert reaper.reap(conn, redis_uptime_s=3) == []
    assert idempotency.state(conn, "slip:live")["state"] == "sending"
    # the lane is back: it beats, and records its send
    conn.set(keys.alive("email.restarted.1"), 1, ex=10)
    idempotency.mark_sent(conn, "slip:live", "send-live:1", "<m1@payrun>")
    assert reaper.reap(conn, redis_uptime_s=12) == []
    # a lane that never beats again is dead once Redis has been up long enough
    conn.delete(keys.alive("email.restarted.1"))
    assert [s.job_id for s in reaper.reap(conn, redis_uptime_s=12)] == ["send-live"]
    assert idempotency.state(conn, "slip:live")["state"] == "sent"  # its claim was not the reaper's to free


def test_email_lanes_finish_their_sends_on_sigterm(conn, env, tmp_path):
    for i in range(6):
        enqueue(conn, keys.EMAIL_QUEUE, "jobs.testing.sleep", 1.0, job_id=f"send-{i}", timeout=2)
    w = start_worker(env, keys.EMAIL_QUEUE, tmp_path / "e.log")
    wait_for(lambda: conn.zcard("rq:wip:send-email") >= 3, timeout_s=30, what="sends in flight")
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=10) == 0
    statuses = [status_of(conn, f"send-{i}") for i in range(6)]
    assert set(statuses) <= {"finished", "queued"} and "finished" in statuses
    assert conn.zcard("rq:wip:send-email") == 0  # nothing left half-done


def test_stop_worker_stops_a_send_email_process_on_any_host(conn, env, cfg, tmp_path):
    """No signal from here: the request goes through Redis, as it must for another host."""
    from console import actions

    for i in range(4):
        enqueue(conn, keys.EMAIL_QUEUE, "jobs.testing.sleep", 1.0, job_id=f"send-{i}", timeout=2)
    w = start_worker(env, keys.EMAIL_QUEUE, tmp_path / "e.log")
    wait_for(lambda: conn.zcard("rq:wip:send-email") >= 2, timeout_s=30, what="sends in flight")
    lane = next(n.decode().split(":", 2)[-1] for n in conn.smembers("rq:workers")
                if b"email" in n and conn.hget(n, "pid") == str(w.pid).encode())
    out = actions.stop_worker(cfg, conn, lane, via="test")
    assert f"process {w.pid}" in out.message
    assert w.wait(timeout=15) == 0
    statuses = [status_of(conn, f"send-{i}") for i in range(4)]
    assert set(statuses) <= {"finished", "queued"} and "finished" in statuses  # in hand: finished
    assert conn.zcard("rq:wip:send-email") == 0
    assert not conn.exists(keys.stop_process(socket.gethostname(), w.pid, host_id()))  # taken by the process
    assert "stop requested (" in (tmp_path / "e.log").read_text()


def test_a_worker_retires_its_horse_even_when_a_forked_process_holds_the_horses_pipe(conn):
    """RQ's scheduler, forked from a render worker while its warm horse lived (it takes the
    scheduler over from a stopped worker), holds a copy of the pipe to the horse: closing
    the worker's end was no EOF, the horse never left, and the worker waited for it for
    good at its jobs_per_horse-th job (seen in a run: half the render capacity gone)."""
    import threading

    from jobs.runtime import RenderWorker, make_queue

    q = make_queue(keys.RENDER_QUEUE, conn)
    for i in range(5):
        q.enqueue_call("jobs.tasks.noop", job_id=f"held-{i}", timeout=20, meta={"kind": "test"})
    w = RenderWorker([q], connection=conn)
    w.jobs_per_horse = 2
    hold_r, hold_w = os.pipe()
    holders = []
    spawn = w._spawn_horse

    def spawn_then_fork_a_holder():
        spawn()
        pid = os.fork()
        if pid == 0:  # like the scheduler: every descriptor of the worker, kept
            os.close(hold_w)
            os.read(hold_r, 1)
            os._exit(0)
        holders.append(pid)

    w._spawn_horse = spawn_then_fork_a_holder
    hung = threading.Event()
    release = threading.Timer(60, lambda: (hung.set(), os.close(hold_w)))
    release.start()
    try:
        w.work(burst=True, logging_level="WARNING")
    finally:
        release.cancel()
        if not hung.is_set():
            os.close(hold_w)
        for pid in holders:
            os.waitpid(pid, 0)
        os.close(hold_r)
    assert not hung.is_set(), "the worker waited for its horse until the holder let go"
    assert all(PayrunJob.fetch(f"held-{i}", connection=conn).get_status() == "finished" for i in range(5))


def test_a_held_try_goes_back_to_the_front_of_its_queue_and_a_failed_one_to_the_back(conn, cfg, monkeypatch):
    """Walkthrough: a send held back during an outage waited behind the whole rest of a
    large run. Now a held try (no attempt spent) comes back first when its wait is over,
    as RQ's retry and scheduler read ``enqueue_at_front_on_retry``; a failed attempt still
    waits its backoff at the back, and its record says so (no flag left from a held try)."""
    from rq import Retry

    from conftest import enqueue_due
    from jobs.runtime import RenderWorker

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    queue = make_queue(keys.RENDER_QUEUE, conn)
    held = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.throttled_once", job_id="held-front")
    failed = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.flaky", job_id="failed-back", retry=Retry(max=2))
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    scheduled = queue.scheduled_job_registry
    assert set(scheduled.get_job_ids()) == {"held-front", "failed-back"}
    assert conn.hget(held.key, "enqueue_at_front_on_retry") == b"1"
    assert conn.hget(failed.key, "enqueue_at_front_on_retry") == b"0"
    for later in ("next-1", "next-2"):  # the rest of the run, queued meanwhile
        enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.noop", job_id=later)
    enqueue_due(conn, queue, {"held-front": 0, "failed-back": 1})  # both waits over
    assert queue.get_job_ids() == ["held-front", "next-1", "next-2", "failed-back"]
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")
    assert status_of(conn, "held-front") == "finished" and status_of(conn, "next-2") == "finished"
    # held, then failed: the failed attempt's retry waits at the back (no flag left from the hold)
    both = enqueue(conn, keys.RENDER_QUEUE, "jobs.testing.held_then_flaky", job_id="held-then-failed",
                   retry=Retry(max=2))
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")  # held
    assert conn.hget(both.key, "enqueue_at_front_on_retry") == b"1"
    enqueue_due(conn, queue, {"held-then-failed": 0})
    RenderWorker([queue], connection=conn).work(burst=True, logging_level="WARNING")  # failed, to retry
    assert "held-then-failed" in scheduled.get_job_ids()
    assert conn.hget(both.key, "enqueue_at_front_on_retry") == b"0"


def test_a_render_workers_command_channel_says_redis_is_away_once_then_every_30_s(conn, caplog, monkeypatch):
    """Ops drill (session 39): with Redis stopped for 20 s, RQ's pubsub thread logged "could not
    connect to Redis instance" as an ERROR every 2 s in every render and control worker. Now
    the first at once, then every 30 s (the worker's one story, RedisOutageLog); its next
    read that does not fail says Redis is back; an outage later is said at once again."""
    from types import SimpleNamespace

    import redis as redis_mod

    from jobs import runtime

    w = runtime.RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn, name="render.test.away")
    now = [0.0]
    monkeypatch.setattr(runtime, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                          sleep=lambda s: now.__setitem__(0, now[0] + s)))
    w._outage.clock = lambda: now[0]
    caplog.set_level("INFO")
    err = redis_mod.ConnectionError("Error 2 connecting to redis.sock. No such file or directory.")
    for _ in range(60):  # 120 s of Redis away, RQ's thread trying every 2 s
        w._pubsub_exception_handler(err, None, None)
    said = [r for r in caplog.records if "redis.sock" in r.getMessage()]
    assert len(said) == 4, [r.getMessage() for r in said]  # at 0, 30, 60, 90 s
    assert all(r.levelname == "WARNING" for r in said) and "still failing" in said[1].getMessage()
    w._outage.ok("command channel")  # its next read (the resubscription's reply)
    assert "back after 120 s (60 looks failed)" in caplog.records[-1].getMessage()
    now[0] += 3600  # Redis was back for an hour; away again
    w._pubsub_exception_handler(err, None, None)
    assert len([r for r in caplog.records if "redis.sock" in r.getMessage()]) == len(said) + 1


def test_a_burst_lanes_empty_queue_check_counts_redis_away_as_work_left():
    """`_all_empty` caught the Redis errors by names never imported: a NameError instead."""
    import redis as redis_mod

    from jobs.runtime import _all_empty

    class Away:
        @property
        def count(self):
            raise redis_mod.ConnectionError("away")

    assert _all_empty([Away()]) is False


def test_the_reaper_loop_says_redis_is_away_once_then_every_30_s_and_back_once(cfg, conn, caplog, monkeypatch):
    """Ops drill (session 39): with Redis stopped 20 s, `payrun reap --loop` logged two lines
    every pass (every 5 s) for as long as it was away. The clock is faked: 60 passes away
    (300 s), 2 back."""
    import signal as signal_mod

    import redis as redis_mod
    from click.testing import CliRunner

    from jobs import limits
    from payrun import cli as cli_mod

    class Stopped(BaseException):
        pass

    now, passes = [1000.0], [0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(signal_mod, "signal", lambda *a: None)
    monkeypatch.setattr(cli_mod, "_setup_logging", lambda *a, **k: None)

    def reap(c):
        passes[0] += 1
        if passes[0] > 62:
            raise Stopped()
        if passes[0] <= 60:
            raise redis_mod.ConnectionError("Error 2 connecting to redis.sock. No such file or directory.")
        return []

    def free(c):
        if passes[0] <= 60:
            raise redis_mod.ConnectionError("Error 2 connecting to redis.sock. No such file or directory.")
        return []

    monkeypatch.setattr(reaper, "reap", reap)
    monkeypatch.setattr(limits, "free_dead_slots", free)
    caplog.set_level("WARNING", logger="payrun.reaper")
    with pytest.raises(Stopped):  # (CliRunner lets a BaseException through)
        CliRunner().invoke(cli_mod.cli, ["reap", "--loop"])
    said = [r.getMessage() for r in caplog.records if r.name == "payrun.reaper"]
    away = [m for m in said if "redis.sock" in m]
    assert 2 <= len(away) <= 12, said  # at once, then every 30 s of the 300 s; not 120 lines
    assert not any("email slots" in m for m in said), said
    assert len([m for m in said if "answers again" in m]) == 1, said
