"""payrun's success path (``EventsMixin.handle_job_success`` without RQ's WATCH and
SMEMBERS for dependents, ``PayrunJob.perform`` without its own PERSIST) leaves the same
records in Redis as RQ's own, against the real Redis server. If one of these fails after
an RQ upgrade, compare RQ's ``BaseWorker.handle_job_success`` / ``Job.perform`` with ours."""

from __future__ import annotations

import rq
from rq import SimpleWorker
from rq.job import Job, JobStatus

from jobs.runtime import LaneWorker, PayrunJob, RenderWorker, make_queue
from payrun import keys

VOLATILE = {b"started_at", b"ended_at", b"created_at", b"enqueued_at", b"last_heartbeat", b"worker_name"}


class StockSuccess(LaneWorker):
    """RQ's own success path (WATCH, enqueue_dependents, MULTI) and RQ's Job.perform."""

    def handle_job_success(self, job, queue, started_job_registry):
        job._done_emitted = False
        SimpleWorker.handle_job_success(self, job, queue, started_job_registry)


def _enqueue(conn, job_id: str, **kw):
    return make_queue(keys.EMAIL_QUEUE, conn).enqueue_call(
        "jobs.tasks.noop", job_id=job_id, timeout=5, result_ttl=600, ttl=900, meta={"kind": "test"}, **kw)


def _run(conn, worker_cls, job_id: str) -> tuple[str, dict]:
    """Take the job as a lane does and run it; returns the worker's name and the Redis
    commands the run sent (from its start transaction to the end of its success path)."""
    q = make_queue(keys.EMAIL_QUEUE, conn)
    w = worker_cls([q], connection=conn, name=f"email.test.{job_id}")
    w.register_birth()
    job, _ = q.dequeue_any([q], None, connection=conn, job_class=PayrunJob, serializer=w.serializer)
    assert job.id == job_id
    w.prepare_execution(job)
    conn.config_resetstat()
    assert w.perform_job(job, q)
    sent = {c.removeprefix("cmdstat_"): v["calls"] for c, v in conn.info("commandstats").items()}
    return w.name, sent


def _record(conn, job_id: str, worker_name: str) -> dict:
    key = f"rq:job:{job_id}".encode()
    job = {k: v for k, v in conn.hgetall(key).items() if k not in VOLATILE}
    results = conn.xrange(f"rq:results:{job_id}")
    worker = conn.hgetall(f"rq:worker:{worker_name}")
    return {
        "job": job,
        "job_ttl": round(conn.ttl(key), -1),
        "finished": conn.zscore(f"rq:finished:{keys.EMAIL_QUEUE}", job_id) is not None,
        "wip": conn.zcard(f"rq:wip:{keys.EMAIL_QUEUE}"),
        "executions": sorted(k for k in conn.keys(f"rq:execution:{job_id}:*")),
        "results": [sorted(k for k in fields if k not in (b"created_at", b"execution_id")) for _, fields in results],
        "result_types": [fields[b"type"] for _, fields in results],
        "results_ttl": round(conn.ttl(f"rq:results:{job_id}"), -1),
        "successful_job_count": worker.get(b"successful_job_count"),
        "has_working_time": float(worker.get(b"total_working_time", 0)) > 0,
    }


def test_the_rq_version_is_the_one_these_overrides_copy():
    assert rq.__version__ == "2.12.0", "payrun's success path copies RQ 2.12's: check it against the new RQ"


def test_a_success_leaves_the_records_rqs_own_path_leaves(conn):
    _enqueue(conn, "ours-1")
    name, sent = _run(conn, LaneWorker, "ours-1")
    ours = _record(conn, "ours-1", name)
    _enqueue(conn, "stock-1")
    name, stock_sent = _run(conn, StockSuccess, "stock-1")
    stock = _record(conn, "stock-1", name)
    # the round trips saved: RQ's WATCH + SMEMBERS for dependents and its own PERSIST
    assert stock_sent.get("watch") == 1 and stock_sent.get("smembers") == 1
    assert "watch" not in sent and "smembers" not in sent
    assert sent["persist"] == 1 and sent["multi"] == stock_sent["multi"]  # persist rides in a transaction
    assert ours["job"][b"status"] == JobStatus.FINISHED.value.encode()
    assert ours["finished"] and ours["wip"] == 0 and ours["executions"] == []
    assert ours["results"] and ours["job_ttl"] > 0
    assert ours == stock
    done = [f for _, f in conn.xrange(keys.EVENTS_STREAM) if f.get(b"status") == b"done"]
    assert sorted(f[b"job"] for f in done) == [b"ours-1", b"stock-1"]  # one ledger 'done' each


def test_the_running_job_has_no_expiry_without_rqs_own_persist(conn):
    """RQ's Job.perform PERSISTs the job key before running it; ours does it in the start
    transaction. A queued job's TTL must not expire it while it runs."""
    _enqueue(conn, "ttl-1")
    assert conn.ttl("rq:job:ttl-1") > 0  # ttl=900: the queued job expires
    q = make_queue(keys.EMAIL_QUEUE, conn)
    w = LaneWorker([q], connection=conn, name="email.test.ttl")
    job, _ = q.dequeue_any([q], None, connection=conn, job_class=PayrunJob, serializer=w.serializer)
    w.prepare_execution(job)
    w.prepare_job_execution(job)
    assert conn.ttl("rq:job:ttl-1") == -1


def test_a_dependent_job_registered_by_another_client_is_still_enqueued(conn):
    """payrun enqueues no dependent jobs; if a script does, RQ's enqueue_dependents runs."""
    parent = _enqueue(conn, "parent-1")
    child = make_queue(keys.EMAIL_QUEUE, conn).enqueue_call("jobs.tasks.noop", job_id="child-1",
                                                            depends_on=parent, meta={"kind": "test"})
    assert child.get_status(refresh=True) == JobStatus.DEFERRED
    q = make_queue(keys.EMAIL_QUEUE, conn)
    w = LaneWorker([q], connection=conn, name="email.test.dep")
    job, _ = q.dequeue_any([q], None, connection=conn, job_class=PayrunJob, serializer=w.serializer)
    assert job.id == "parent-1"
    w.prepare_execution(job)
    w.perform_job(job, q)
    assert Job.fetch("child-1", connection=conn, serializer=w.serializer).get_status(refresh=True) == JobStatus.QUEUED
    assert conn.lrange(q.key, 0, -1) == [b"child-1"]


def test_the_render_worker_uses_the_same_success_path(conn):
    # (RenderWorker's own only stops a warm horse's render that handed its finish over,
    # before it: the worker finishes it and records the end through this same path)
    assert super(RenderWorker, RenderWorker).handle_job_success is LaneWorker.handle_job_success


class StockStart(LaneWorker):
    """RQ's own start: the execution record and busy state in a transaction of their own."""

    def prepare_execution(self, job):
        return SimpleWorker.prepare_execution(self, job)


def _started(conn, worker_cls, job_id: str) -> tuple[dict, dict]:
    """Take the job as a lane does and start it (no run); the records and commands sent."""
    _enqueue(conn, job_id)
    q = make_queue(keys.EMAIL_QUEUE, conn)
    w = worker_cls([q], connection=conn, name=f"email.test.{job_id}")
    w.register_birth()
    job, _ = q.dequeue_any([q], None, connection=conn, job_class=PayrunJob, serializer=w.serializer)
    conn.config_resetstat()
    w.prepare_execution(job)
    w.prepare_job_execution(job, remove_from_intermediate_queue=True)
    sent = {c.removeprefix("cmdstat_"): v["calls"] for c, v in conn.info("commandstats").items()}
    key = f"rq:job:{job_id}".encode()
    execs = conn.keys(f"rq:execution:{job_id}:*")
    assert w.execution is not None and len(execs) == 1
    wip = conn.zrange(f"rq:wip:{keys.EMAIL_QUEUE}", 0, -1, withscores=True)
    worker = conn.hgetall(f"rq:worker:{w.name}")
    record = {
        "job": {k: v for k, v in conn.hgetall(key).items() if k not in VOLATILE},
        "job_ttl": conn.ttl(key),
        "wip": sorted(m.decode().replace(w.execution.id, "<execution>").replace(job_id, "<job>") for m, _ in wip),
        "wip_ttl_ok": all(s > 0 for _, s in wip),
        "execution": sorted(conn.hgetall(execs[0])),
        "execution_ttl": round(conn.ttl(execs[0]), -1),
        "execution_registry": [m.decode() == w.execution.id for m in conn.zrange(f"rq:executions:{job_id}", 0, -1)],
        "worker_state": worker.get(b"state"),
        "worker_job": worker.get(b"current_job") == job_id.encode(),
        "intermediate": conn.llen(f"rq:queue:{keys.EMAIL_QUEUE}:intermediate"),
        "running_events": [f[b"job"] == job_id.encode() for _, f in conn.xrange(keys.EVENTS_STREAM)
                           if f.get(b"status") == b"running"],
    }
    conn.delete(keys.EVENTS_STREAM, f"rq:wip:{keys.EMAIL_QUEUE}")
    return record, sent


def test_a_lane_starts_a_job_in_one_transaction_with_the_records_rqs_start_leaves(conn):
    ours, sent = _started(conn, LaneWorker, "start-1")
    stock, stock_sent = _started(conn, StockStart, "start-2")
    assert sent["exec"] == 1 and stock_sent["exec"] == 2  # one round trip less per send
    assert ours["job"][b"status"] == JobStatus.STARTED.value.encode()
    assert ours["worker_state"] == b"busy" and ours["worker_job"] and ours["running_events"] == [True]
    assert ours["wip"] == ["<job>:<execution>"] and ours["execution"] and ours["execution_registry"] == [True]
    assert ours == stock
