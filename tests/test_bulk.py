"""The fan-out's bulk enqueue writes the same job records as RQ's ``enqueue_many``,
against the real Redis server."""

from __future__ import annotations

import json
import zlib

from rq import Retry
from rq.serializers import PickleSerializer
from rq.queue import Queue

from jobs.runtime import PayrunJob, make_queue
from payrun import bulk, keys, payroll, runs
from payrun.ledger import Ledger

OPTIONS = dict(timeout=120, retry=Retry(max=4), result_ttl=24 * 3600, failure_ttl=30 * 24 * 3600)
ARGS = [
    {"employee": {"id": "E1", "name": "রহিম উদ্দিন"}, "net": "৳ 52,000", "lines": [1, 2.5, None]},
    {"employee": {"id": "E2", "name": "O'Brien <b>&amp;</b>"}, "key": "k\"2", "nested": {"a": [True, False]}},
    {"employee": {"id": "E3"}, "empty": {}, "list": []},
]


def _jobs(n_from: int = 0):
    return [(f"render-2026-11-E{i + 1 + n_from}", a, f"render slip k{i}",
             {"kind": "render", "key": f"k{i}", "company": 7, "retry": {"attempts": 5}})
            for i, a in enumerate(ARGS)]


def _state(conn, queue):
    records = {}
    for job_id in conn.lrange(queue.key, 0, -1):
        h = conn.hgetall(b"rq:job:" + job_id)
        h[b"data"] = zlib.decompress(h[b"data"])
        for ts in (b"created_at", b"enqueued_at"):
            assert h.pop(ts)  # a timestamp in RQ's format, compared below
        records[job_id] = h
    return conn.lrange(queue.key, 0, -1), records, conn.smembers("rq:queues")


def test_template_is_available_for_the_pinned_rq(conn):
    """If this fails after an RQ upgrade, the fan-out silently takes RQ's slow path:
    check what enqueue_many sends now and teach payrun.bulk (or accept the slower run)."""
    tpl = bulk.template(make_queue(keys.RENDER_QUEUE, conn), runs.RENDER_FUNC, **OPTIONS)
    assert tpl is not None
    fields = dict(zip(tpl.fields[::2], tpl.fields[1::2]))
    assert fields["origin"] == keys.RENDER_QUEUE and fields["status"] == "queued"
    assert not set(bulk.PER_JOB) & set(fields)


def test_bulk_records_equal_enqueue_many(conn):
    queue = make_queue(keys.RENDER_QUEUE, conn)
    with conn.pipeline() as pipe:
        queue.enqueue_many([queue.prepare_data(runs.RENDER_FUNC, args=(a,), job_id=j, description=d, meta=m, **OPTIONS)
                            for j, a, d, m in _jobs()], pipeline=pipe)
        pipe.execute()
    from_rq = _state(conn, queue)
    conn.flushdb()

    enq = bulk.BulkEnqueuer(conn, bulk.template(queue, runs.RENDER_FUNC, **OPTIONS))
    assert enq.enqueue(enq.job_args(*j) for j in _jobs()) == len(ARGS)
    assert _state(conn, queue) == from_rq

    # and RQ reads them back as it wrote them
    for job_id, arg, description, meta in _jobs():
        job = PayrunJob.fetch(job_id, connection=conn)
        assert job.func_name == runs.RENDER_FUNC and list(job.args) == [arg] and job.kwargs == {}
        assert job.description == description and job.meta == meta
        assert job.timeout == 120 and job.retries_left == 4 and job.origin == keys.RENDER_QUEUE
        assert job.get_status() == "queued" and job.enqueued_at and job.created_at
    assert queue.count == len(ARGS) and queue.job_ids == [j[0] for j in _jobs()]


def test_bulk_appends_after_jobs_already_queued_and_empty_chunk_is_a_no_op(conn):
    queue = make_queue(keys.RENDER_QUEUE, conn)
    enq = bulk.BulkEnqueuer(conn, bulk.template(queue, runs.RENDER_FUNC, **OPTIONS))
    assert enq.enqueue([]) == 0
    assert not conn.exists(queue.key)
    enq.enqueue(enq.job_args(*j) for j in _jobs())
    enq.enqueue(enq.job_args(*j) for j in _jobs(n_from=10))
    assert queue.job_ids == [j[0] for j in _jobs()] + [j[0] for j in _jobs(n_from=10)]


def test_template_refuses_what_it_cannot_repeat(conn):
    pickled = Queue("other", connection=conn, serializer=PickleSerializer)
    assert bulk.template(pickled, runs.RENDER_FUNC, **OPTIONS) is None

    class CompactJSON:  # JSON, but not the bytes json.dumps gives: job_args() would differ
        dumps = staticmethod(lambda o: json.dumps(o, separators=(",", ":")).encode())
        loads = staticmethod(lambda b: json.loads(b))

    compact = Queue("other", connection=conn, serializer=CompactJSON)
    assert bulk.template(compact, runs.RENDER_FUNC, **OPTIONS) is None
    # recording the template sends nothing
    assert conn.dbsize() == 0


def test_start_run_falls_back_to_enqueue_many(cfg, conn, monkeypatch):
    """Without a template (an RQ this module does not know), the run is still whole."""
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=2, employees=12, seed=3, month="2026-11")
    ledger = Ledger(cfg.ledger_path)
    try:
        monkeypatch.setattr(bulk, "template", lambda *a, **k: None)
        res = runs.start_run(cfg, conn, ledger, db, "2026-11")
        assert res.jobs == 12 and conn.llen("rq:queue:" + keys.RENDER_QUEUE) == 12
        first = conn.lindex("rq:queue:" + keys.RENDER_QUEUE, 0).decode()
        assert PayrunJob.fetch(first, connection=conn).func_name == runs.RENDER_FUNC
    finally:
        ledger.close()
        db.close()


def _send_state(conn):
    """The send queue's jobs (timestamps checked, then dropped) and the events stream
    (each event's own ts dropped)."""
    queue = make_queue(keys.EMAIL_QUEUE, conn)
    events_ = []
    for _, ev in conn.xrange(keys.EVENTS_STREAM):
        assert ev.pop(b"ts")
        events_.append(ev)
    return _state(conn, queue), events_


def test_enqueue_email_writes_what_rq_enqueue_call_writes_once(cfg, conn, monkeypatch):
    """A render's send job goes in with one script (payrun.bulk.OneEnqueuer): the same
    event first and the same record RQ's ``enqueue_call`` wrote in a MULTI after an EXISTS,
    and nothing at all when the job is there already (a render retried after its send)."""
    from jobs import tasks

    payload = {"month": "2026-11", "key": "slip:2026-11:E1", "company_id": 7, "company_name": "Ṭaka & Co <b>",
               "employee_id": "E1", "to": "rahim@example.test", "to_name": "রহিম উদ্দিন", "slip": "2026-11/7/E1.pdf"}
    with monkeypatch.context() as m:
        m.setattr(tasks, "_email_enqueuer", lambda *a: None)  # RQ's own path
        assert tasks.enqueue_email(conn, cfg, payload) == "email-2026-11-E1"
    from_rq = _send_state(conn)
    assert len(from_rq[0][1]) == 1 and [e[b"status"] for e in from_rq[1]] == [b"queued"]
    conn.flushdb()

    assert tasks._email_enqueuer(conn, cfg) is not None  # the pinned RQ's enqueue is one this repeats
    assert tasks.enqueue_email(conn, cfg, payload) == "email-2026-11-E1"
    assert _send_state(conn) == from_rq
    job = PayrunJob.fetch("email-2026-11-E1", connection=conn)
    assert job.func_name == tasks.SEND_FUNC and list(job.args) == [payload]
    assert job.timeout == cfg.email.timeout_s and job.retries_left == cfg.email.retry.attempts - 1

    # once: a second enqueue (a render retried after its send was made) writes nothing
    assert tasks.enqueue_email(conn, cfg, payload) is None
    assert _send_state(conn) == from_rq
    assert conn.llen("rq:queue:" + keys.EMAIL_QUEUE) == 1


def test_per_connection_cache_builds_once_per_connection_and_options():
    """The send lanes' caches (the send's enqueue script, the limits): one object per
    connection and options, built again for a new connection that reuses a freed one's id."""
    import threading

    from jobs import tasks

    cache: dict = {}
    lock = threading.Lock()
    built = []

    def get(conn, which):
        return tasks._per_connection(cache, lock, conn, which, lambda: built.append(conn) or object())

    a, b = object(), object()
    first = get(a, 1)
    assert get(a, 1) is first and len(built) == 1
    assert get(b, 1) is not first and len(built) == 2
    assert get(a, 2) is not first and len(built) == 3  # new options: built again
    c = object()
    cache[id(c)] = (a, 2, first)  # a freed connection's id now used by c
    assert get(c, 2) is not first and built[-1] is c


def test_job_field_reads_one_field_of_many_jobs_in_order_across_chunks(conn):
    from payrun.keys import job_field

    for i in range(5):
        conn.hset(f"rq:job:j{i}", mapping={"status": f"s{i}"})
    ids = ["j0", "nosuch", "j1", "j2", "j3", "j4"]
    assert list(job_field(conn, ids, "status", chunk=2)) == [
        ("j0", b"s0"), ("nosuch", None), ("j1", b"s1"), ("j2", b"s2"), ("j3", b"s3"), ("j4", b"s4")]
    assert list(job_field(conn, [], "status")) == []
