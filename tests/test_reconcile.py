"""Ledger reconciliation (a final state whose event was lost) and the reaper's release of
a dead attempt's idempotency claim before the job is back on its queue."""

from __future__ import annotations

import time

import pytest

from conftest import started_send
from jobs import idempotency, reaper
from jobs.runtime import PayrunJob, make_queue
from payrun import keys
from payrun import ledger as ledger_mod
from payrun.ledger import Ledger


def test_a_job_finished_in_rq_whose_done_event_was_lost_is_reconciled(conn, cfg):
    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": f"job-{i}", "kind": "email"} for i in range(3)])
    ledger.apply([{"job": "job-0", "status": "running", "attempt": "1"},
                  {"job": "job-1", "status": "running", "attempt": "1"}])
    q = make_queue(keys.EMAIL_QUEUE, conn)
    for i in range(3):
        q.enqueue_call("jobs.tasks.noop", job_id=f"job-{i}", meta={"attempt": 1, "last_error": "boom"})
    conn.hset("rq:job:job-0", "status", "finished")  # done in RQ, its event never written
    conn.hset("rq:job:job-1", "status", "failed")
    assert ledger_mod.reconcile(conn, ledger, now=time.time()) == (0, "")  # too recent: events may be on the way
    fixed, cursor = ledger_mod.reconcile(conn, ledger, now=time.time() + 60)
    assert fixed == 2 and cursor == ""
    assert ledger.job("job-0")["status"] == "done" and ledger.job("job-0")["finished_at"]
    assert ledger.job("job-1")["status"] == "failed" and ledger.job("job-1")["last_error"] == "boom"
    assert ledger.job("job-2")["status"] == "queued"  # still queued in RQ: left alone
    assert ledger_mod.reconcile(conn, ledger, now=time.time() + 60) == (0, "")
    fixed, cursor = ledger_mod.reconcile(conn, ledger, now=time.time() + 60, limit=1)
    assert (fixed, cursor) == (0, "job-2")  # sliced: the next call goes on after job-2


def test_a_job_that_waited_in_its_queue_and_just_ended_is_left_for_its_event(conn, cfg):
    """Walkthrough (session 28): every job that waited in its queue over 5 s (its ledger row
    idle that long) and ended a moment before a pass was "reconciled" with a warning that
    its event was lost: 42 warnings in a healthy run. RQ's own end time decides now."""
    from rq.utils import utcformat

    from datetime import datetime, timezone

    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": "waited", "kind": "email"}, {"id": "lost", "kind": "email"}])
    q = make_queue(keys.EMAIL_QUEUE, conn)
    now = time.time() + 60  # both rows idle for a minute
    for job_id, ended_s_ago in (("waited", 1.0), ("lost", 30.0)):
        q.enqueue_call("jobs.tasks.noop", job_id=job_id, meta={"attempt": 1})
        conn.hset(f"rq:job:{job_id}", mapping={
            "status": "finished", "ended_at": utcformat(datetime.fromtimestamp(now - ended_s_ago, timezone.utc))})
    fixed_ids: list[str] = []
    assert ledger_mod.reconcile(conn, ledger, now=now, fixed_ids=fixed_ids) == (1, "")
    assert fixed_ids == ["lost"] and ledger.job("waited")["status"] == "queued"
    assert ledger_mod.reconcile(conn, ledger, now=now + 10) == (1, "")  # its event never came after all
    assert ledger.job("waited")["status"] == "done"


def test_the_reaper_releases_the_dead_attempts_claim_before_the_job_is_queued(conn):
    q, job = started_send(conn, "send-dead", "slip:k", attempt=2, worker="email.gone.1")
    assert idempotency.claim(conn, "slip:k", "send-dead:2", 60) == idempotency.OK
    assert [s.job_id for s in reaper.reap(conn, redis_uptime_s=3600)] == ["send-dead"]  # a Redis long up
    assert idempotency.state(conn, "slip:k") == {}  # released: the next attempt may send at once
    assert q.get_job_ids() == ["send-dead"]
    assert idempotency.claim(conn, "slip:k", "send-dead:3", 60) == idempotency.OK
    assert PayrunJob.fetch("send-dead", connection=conn).get_status() == "queued"


def test_idempotency_claims_run_on_a_server_that_lost_its_scripts(conn):
    """The scripts run by digest (EVALSHA): a restarted or flushed server, which no longer
    knows them, gets them loaded again instead of the send failing."""
    conn.script_flush()
    assert idempotency.claim(conn, "slip:f", "send-f:1", 60) == idempotency.OK
    assert idempotency.claim(conn, "slip:f", "send-f:2", 60) == idempotency.BUSY
    conn.script_flush()
    idempotency.mark_sent(conn, "slip:f", "send-f:1", "<m1@payrun>")
    assert idempotency.claim(conn, "slip:f", "send-f:3", 60) == idempotency.SENT
    assert idempotency.state(conn, "slip:f")["message_id"] == "<m1@payrun>"
    conn.script_flush()
    assert idempotency.release(conn, "slip:f", "send-f:3") is False  # sent: never released


def test_a_dead_worker_counts_from_when_a_reaper_first_saw_this_redis_not_its_uptime(conn):
    """Review of 5f15469: Redis's uptime includes the time it spent loading its data (the
    liveness keys lapse meanwhile), and a failover to a replica up for days brings its
    days along; the first pass after either took live lanes for dead and freed claims of
    sends waiting to be recorded. A missing liveness key counts from the first time a
    reaper saw this server (its run_id), on Redis's clock."""
    from payrun import keys

    q, job = started_send(conn, "send-live", "slip:l", attempt=1, worker="email.restarted.1")
    run_id = conn.info("server")["run_id"]
    up = float(conn.info("server")["uptime_in_seconds"])
    assert up <= reaper.redis_uptime(conn) <= up + 1  # no reaper saw it yet: readers count its uptime
    assert reaper.reap(conn) == []  # the first pass: seen just now, only the lease decides
    assert conn.exists(keys.redis_seen(run_id))
    assert reaper.redis_uptime(conn, mark=True) < 5  # a later pass does not move the mark
    sec, _ = conn.time()
    conn.set(keys.redis_seen(run_id), repr(sec - 11.0))  # seen 11 s ago, the worker still silent
    up = float(conn.info("server")["uptime_in_seconds"])
    assert reaper.redis_uptime(conn, mark=True) == pytest.approx(min(up, 11.0), abs=1.5)
    if up >= 11:  # (the session's Redis has been up that long: not when this test runs alone)
        assert [s.job_id for s in reaper.reap(conn)] == ["send-live"]
