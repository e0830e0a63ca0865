"""A render worker that takes and starts ``render.batch`` jobs at once and finishes that
many renders in one transaction (jobs.runtime.RenderWorker._take_batch,
_finish_rendered). It must keep every promise of one job at a time: the same records,
no job lost or run twice on a stop, a lease on each job it holds. Real Redis, real
renders, real worker processes where signals matter."""

from __future__ import annotations

import os
import signal
import time

import pytest
from rq import Retry
from rq.job import JobStatus

from conftest import wait_for
from test_resilience import _no_worker_outlives_its_test, start_worker  # noqa: F401 - (its fixture: no worker outlives a test)
from jobs import events
from jobs.runtime import PayrunJob, RenderWorker, make_queue
from payrun import keys, ledger as ledger_mod


def _worker(conn, batch: int, name: str = "render.test.batch") -> RenderWorker:
    w = RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn, name=name)
    w.jobs_per_horse, w.batch = 100, batch
    return w


def _noops(conn, *ids: str) -> None:
    q = make_queue(keys.RENDER_QUEUE, conn)
    for i in ids:
        q.enqueue_call("jobs.testing.noop", job_id=i, timeout=30, meta={"kind": "test"})


def _wip_ids(conn) -> list[str]:
    return sorted(m.decode().split(":", 1)[0] for m in conn.zrange(f"rq:wip:{keys.RENDER_QUEUE}", 0, -1))


def test_a_batch_is_the_workers_share_of_what_waits_and_starts_in_one_go(conn, monkeypatch):
    """Up to ``batch`` jobs, never more than this worker's share (waiting ÷ the queue's
    workers, rounded up): a queue's last jobs are spread over its workers, not held by one."""
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _noops(conn, *(f"n-{i}" for i in range(6)))
    conn.sadd(f"rq:workers:{keys.RENDER_QUEUE}", "rq:worker:render.a", "rq:worker:render.b")  # two workers
    w = _worker(conn, batch=16)
    job, _ = w._take_at_once()
    assert job.id == "n-0" and [h[0].id for h in w._behind] == ["n-1", "n-2"]
    # all three started: leases in the started registry, status, attempt counted, `running` told
    assert _wip_ids(conn) == ["n-0", "n-1", "n-2"]
    assert make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == ["n-3", "n-4", "n-5"]
    assert not conn.lrange(f"rq:queue:{keys.RENDER_QUEUE}:intermediate", 0, -1)
    for i in ("n-0", "n-1", "n-2"):
        j = PayrunJob.fetch(i, connection=conn)
        assert j.get_status() == JobStatus.STARTED and j.meta["attempt"] == 1 and j.worker_name == w.name
    running = [f for _, f in conn.xrange(keys.EVENTS_STREAM) if ledger_mod._decode(f)["status"] == "running"]
    assert len(running) == 3
    # the horse is handed each job's hash as the start left it, instead of fetching it: the same
    for held, _, execution in w._behind:
        given = {k.encode("latin-1"): v.encode("latin-1") for k, v in held._started_hash.items()}
        assert given == conn.hgetall(held.key)
        assert float(conn.hget(execution.key, "created_at")) == execution.created_at.timestamp()
    # the held ones are handed over in order, with no round trip of their own
    assert w._take_at_once()[0].id == "n-1" and w.prepare_execution(PayrunJob.fetch("n-1", connection=conn))
    # one worker alone takes up to its batch
    conn.srem(f"rq:workers:{keys.RENDER_QUEUE}", "rq:worker:render.b")
    w2 = _worker(conn, batch=2, name="render.test.batch2")
    assert w2._take_at_once()[0].id == "n-3" and [h[0].id for h in w2._behind] == ["n-4"]


def test_the_next_batch_is_taken_while_the_last_of_a_batch_is_in_hand(conn, monkeypatch):
    """_take_ahead (called as each job is handed over): with the last job of its batch in
    the horse, the worker takes and starts the next batch then, not after the horse's
    reply, so the horse is handed its next job at once. Not while jobs of the batch still
    wait, nor once a stop is asked or the slip store cannot take a slip; the worker's
    current job stays the one in hand."""
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _noops(conn, *(f"a-{i}" for i in range(7)))
    q = make_queue(keys.RENDER_QUEUE, conn)
    w = _worker(conn, batch=2)
    w.register_birth()
    job, _ = w._take_at_once()
    w.prepare_execution(job)
    w._take_ahead()  # a-1 still waits behind a-0: nothing more
    assert [h[0].id for h in w._behind] == ["a-1"] and q.get_job_ids() == [f"a-{i}" for i in range(2, 7)]
    job, q1 = w._take_at_once()
    w.prepare_execution(job)
    w.in_hand = (job, q1)  # (as execute_job sets it)
    w._take_ahead()  # a-1, the last of its batch, in hand: a-2 and a-3 now, started
    assert [h[0].id for h in w._behind] == ["a-2", "a-3"] and q.get_job_ids() == ["a-4", "a-5", "a-6"]
    assert _wip_ids(conn) == ["a-0", "a-1", "a-2", "a-3"]
    for i in ("a-2", "a-3"):
        j = PayrunJob.fetch(i, connection=conn)
        assert j.get_status() == JobStatus.STARTED and j.meta["attempt"] == 1 and j.worker_name == w.name
    assert conn.hget(w.key, "current_job") == b"a-1"  # (the one in hand, not the first taken ahead)
    assert w._take_at_once()[0].id == "a-2"  # handed over from what was taken ahead, no round trip
    assert w._take_at_once()[0].id == "a-3"
    monkeypatch.setattr(w, "_store_blocked", lambda: True)
    w._take_ahead()
    assert not w._behind
    monkeypatch.setattr(w, "_store_blocked", lambda: False)
    w._stop_requested = True
    w._take_ahead()
    assert not w._behind and q.get_job_ids() == ["a-4", "a-5", "a-6"]


def test_the_jobs_a_worker_holds_keep_their_lease_while_the_one_in_hand_runs_long(conn, monkeypatch):
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _noops(conn, "l-0", "l-1", "l-2")
    w = _worker(conn, batch=3)
    job, _ = w._take_at_once()
    w.prepare_execution(job)
    wip = f"rq:wip:{keys.RENDER_QUEUE}"
    for held, _, execution in w._behind:  # as if they had waited most of their lease already
        conn.zadd(wip, {execution.composite_key: time.time() + 5}, xx=True)
    from rq.utils import now

    # one of them rendered already, waiting to be finished (half a batch may wait so)
    rendered = w._behind.pop()
    w._rendered.append((*rendered, {}))
    job.started_at = now()  # (as the hand-over sets it)
    w.maintain_heartbeats(job)  # (every second while a job runs past one)
    for held, _, execution in (*w._behind, rendered):
        assert conn.zscore(wip, execution.composite_key) > time.time() + 50


def test_a_second_sigterm_hands_back_the_job_in_hand_and_the_ones_held_in_their_order(conn, monkeypatch):
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _noops(conn, "s-0", "s-1", "s-2", "s-3")
    w = _worker(conn, batch=3)
    job, q = w._take_at_once()
    w.prepare_execution(job)
    w.in_hand = (job, q)
    with pytest.raises(SystemExit):
        w.request_force_stop(signal.SIGTERM, None)
    assert make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == ["s-0", "s-1", "s-2", "s-3"]
    assert _wip_ids(conn) == [] and not list(conn.scan_iter("rq:execution:*"))
    for i in ("s-0", "s-1", "s-2"):
        back = PayrunJob.fetch(i, connection=conn)
        # started with the batch: a try that spent no attempt (the backoff leaves it out)
        assert back.get_status() == JobStatus.QUEUED and int(conn.hget(back.key, events.RETURNED_FIELD)) == 1
    requeued = [ledger_mod._decode(f) for _, f in conn.xrange(keys.EVENTS_STREAM)
                if ledger_mod._decode(f).get("outcome") == "requeued"]
    assert sorted(e["job"] for e in requeued) == ["s-0", "s-1", "s-2"]


def test_a_full_slip_store_gives_the_held_jobs_back_before_it_waits(conn, monkeypatch):
    """A worker whose store cannot take a slip takes nothing until it can; the jobs it
    started with its batch go back to the front (another host's worker may have room)."""
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _noops(conn, "f-0", "f-1", "f-2")
    w = _worker(conn, batch=3)
    job, q = w._take_at_once()
    w._stop_requested = True  # (so the wait below ends at once)
    monkeypatch.setattr(w, "_store_blocked", lambda: True)
    assert w.dequeue_job_and_maintain_ttl(5) is None
    assert make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == ["f-1", "f-2"]  # f-0 is the one taken
    assert _wip_ids(conn) == ["f-0"]


def test_sigterm_gives_the_held_jobs_back_at_once_and_the_one_in_hand_after_its_grace(conn, cfg, tmp_path):
    """A real worker process with a batch of 4: the first job runs long, three wait behind
    it. SIGTERM: the three go back to the front at once (another worker can take them
    during the grace), the long one when the grace ends; the order is kept, no attempt is
    spent, nothing is left started."""
    conf = tmp_path / "payrun.toml"
    conf.write_text("[render]\ntimeout_s = 2\nbatch = 4\n[email]\ntimeout_s = 2\n[lease]\ngrace_s = 3\n")
    env = dict(os.environ, PAYRUN_CONFIG=str(conf), PAYRUN_TEST_JOBS="1")
    q = make_queue(keys.RENDER_QUEUE, conn)
    q.enqueue_call("jobs.testing.sleep", args=(30,), job_id="long-b", timeout=40, retry=Retry(max=3),
                   meta={"kind": "test"})
    _noops(conn, "b-1", "b-2", "b-3", "c-1")
    # another worker on the queue (RQ drops a member whose record is gone): a share of 3 each
    conn.hset("rq:worker:render.someone-else", "state", "idle")
    conn.sadd(f"rq:workers:{keys.RENDER_QUEUE}", "rq:worker:render.someone-else")
    w = start_worker(env, keys.RENDER_QUEUE, tmp_path / "w.log")
    wait_for(lambda: _wip_ids(conn) == ["b-1", "b-2", "long-b"], timeout_s=30, what="the batch to start")
    assert q.get_job_ids() == ["b-3", "c-1"]
    t0 = time.monotonic()
    w.send_signal(signal.SIGTERM)
    wait_for(lambda: q.get_job_ids()[:2] == ["b-1", "b-2"], timeout_s=5, what="the held jobs to go back")
    assert time.monotonic() - t0 < 2.5  # before the grace ends: the long one is still in hand
    assert _wip_ids(conn) == ["long-b"]
    assert w.wait(timeout=15) == 0
    assert q.get_job_ids() == ["long-b", "b-1", "b-2", "b-3", "c-1"]
    assert _wip_ids(conn) == []
    for i in ("long-b", "b-1", "b-2"):
        back = PayrunJob.fetch(i, connection=conn)
        assert back.get_status() == JobStatus.QUEUED and int(conn.hget(back.key, events.RETURNED_FIELD)) == 1
    assert PayrunJob.fetch("long-b", connection=conn).retries_left == 3


def test_sigterm_between_two_jobs_of_a_batch_stops_the_loop_and_teardown_gives_the_rest_back(conn, monkeypatch):
    """Between two jobs there is no job in hand, but jobs of the batch wait behind: the
    signal must not raise StopRequested wherever the loop is (a job popped from the batch
    and not handed over would be lost to the worker until the reaper's pass); the loop
    stops at its next check, and the rest go back in order."""
    from rq.worker import WorkerStatus

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _noops(conn, "t-0", "t-1", "t-2")
    w = _worker(conn, batch=3)
    w.register_birth()
    w.set_state(WorkerStatus.BUSY)
    job, q = w._take_at_once()
    w.prepare_execution(job)
    conn.hset(job.key, "status", JobStatus.FINISHED)  # (as if it had just been done)
    conn.zrem(f"rq:wip:{keys.RENDER_QUEUE}", w.execution.composite_key)
    w.request_stop(signal.SIGTERM, None)  # (the SIGTERM handler)
    assert w._stop_requested and w._take_at_once() is None
    w._give_back_behind("it is stopping and had not begun them")  # (teardown's)
    assert make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == ["t-1", "t-2"]
    assert _wip_ids(conn) == []
