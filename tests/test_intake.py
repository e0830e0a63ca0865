"""The send-email process's intake: one poll wakes as many idle lanes as jobs wait,
and honours `payrun drain --queue` and `rq suspend` (real Redis, polls driven by hand)."""

from __future__ import annotations

import threading

from conftest import wait_for
from jobs.runtime import Intake, make_queue
from payrun import keys


def _waiters(intake: Intake, n: int) -> tuple[list, list[threading.Thread]]:
    got: list = []
    lock = threading.Lock()

    def wait():
        r = intake.wait(30)
        with lock:
            got.append(r)

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    wait_for(lambda: intake._idle == n, timeout_s=10, what=f"{n} idle lanes")
    return got, threads


def test_one_poll_wakes_one_idle_lane_per_waiting_job(conn):
    q = make_queue(keys.EMAIL_QUEUE, conn)
    stop = threading.Event()
    intake = Intake(conn, [q], stop)
    got, threads = _waiters(intake, 3)
    assert intake.poll() == 0 and got == []  # nothing waiting: nobody wakes
    q.enqueue_call("jobs.testing.noop", job_id="a", meta={"kind": "test"})
    q.enqueue_call("jobs.testing.noop", job_id="b", meta={"kind": "test"})
    assert intake.poll() == 2
    wait_for(lambda: len(got) == 2, timeout_s=10, what="two lanes woken")
    assert all([x.name for x in r] == [keys.EMAIL_QUEUE] for r in got)
    assert intake._idle == 1  # the third still waits
    stop.set()
    intake.wake_all()
    wait_for(lambda: len(got) == 3, timeout_s=10, what="the last lane to see the stop")
    assert got[-1] is None
    for t in threads:
        t.join(timeout=5)


def test_a_drained_queue_or_suspended_workers_wake_nobody(conn):
    q = make_queue(keys.EMAIL_QUEUE, conn)
    q.enqueue_call("jobs.testing.noop", job_id="a", meta={"kind": "test"})
    stop = threading.Event()
    intake = Intake(conn, [q], stop)
    got, threads = _waiters(intake, 2)

    conn.sadd(keys.PAUSED_QUEUES, keys.EMAIL_QUEUE)  # payrun drain --queue send-email
    assert intake.poll() == 0 and intake.open_queues() == []
    conn.srem(keys.PAUSED_QUEUES, keys.EMAIL_QUEUE)
    conn.set("rq:suspended", 1)  # rq suspend / payrun drain
    assert intake.poll() == 0 and intake.open_queues() == []
    assert got == [] and intake._idle == 2

    conn.delete("rq:suspended")  # resumed: one job, one lane
    assert intake.poll() == 1
    wait_for(lambda: len(got) == 1, timeout_s=10, what="one lane woken")
    assert [x.name for x in intake.open_queues()] == [keys.EMAIL_QUEUE]
    stop.set()
    intake.wake_all()
    for t in threads:
        t.join(timeout=5)


def test_an_idle_lane_comes_back_empty_handed_to_renew_its_heartbeat(conn):
    intake = Intake(conn, [make_queue(keys.EMAIL_QUEUE, conn)], threading.Event())
    assert intake.wait(0.05) == []


def test_a_lane_tries_straight_for_the_next_job_only_while_jobs_wait(conn):
    q = make_queue(keys.EMAIL_QUEUE, conn)
    intake = Intake(conn, [q], threading.Event())
    assert intake.poll() == 0 and not intake.more_work()
    q.enqueue_call("jobs.testing.noop", job_id="a", meta={"kind": "test"})
    assert intake.poll() == 1 and intake.more_work()
    conn.sadd(keys.PAUSED_QUEUES, keys.EMAIL_QUEUE)  # drained: its jobs are not work
    assert intake.poll() == 0 and not intake.more_work()


def test_a_lane_job_record_ends_with_its_heartbeat_at_its_end(conn, cfg, monkeypatch):
    """Lanes skip RQ's separate heartbeat write at the end of a job: the record saved with
    the outcome carries it (and the failure path too)."""
    from jobs.runtime import run_lanes

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    q = make_queue(keys.EMAIL_QUEUE, conn)
    q.enqueue_call("jobs.testing.noop", job_id="ok", meta={"kind": "test"})
    q.enqueue_call("os.getcwd", job_id="bad", meta={"kind": "test"})  # refused: not a payrun job
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    for job_id, status in (("ok", b"finished"), ("bad", b"failed")):
        h = conn.hgetall(f"rq:job:{job_id}")
        assert h[b"status"] == status
        assert h[b"ended_at"] and h[b"last_heartbeat"] == h[b"ended_at"]
        assert h[b"started_at"] <= h[b"last_heartbeat"]


def test_a_render_workers_give_back_never_queues_a_job_twice(conn):
    """The give-back of a job taken from a drained queue: only while the id is still in the
    intermediate list (LMOVE), or always after an LPOP (several queues: no such list)."""
    from jobs.runtime import RenderWorker, make_queue

    q = make_queue("pdf-render", conn)
    w = RenderWorker([q], connection=conn)
    conn.rpush(q.intermediate_queue_key, "j1")
    assert w._give_back(keys=[q.intermediate_queue_key, q.key], args=["j1", 1]) == 1
    assert conn.lrange(q.key, 0, -1) == [b"j1"] and conn.llen(q.intermediate_queue_key) == 0
    # a reaper or a stopping worker already returned it: nothing more
    assert w._give_back(keys=[q.intermediate_queue_key, q.key], args=["j1", 1]) == 0
    assert conn.lrange(q.key, 0, -1) == [b"j1"]
    assert w._give_back(keys=[q.intermediate_queue_key, q.key], args=["j2", 0]) == 1  # after an LPOP
    assert conn.lrange(q.key, 0, -1) == [b"j2", b"j1"]


def _render_worker(conn):
    from jobs.runtime import RenderWorker

    q = make_queue(keys.RENDER_QUEUE, conn)
    return RenderWorker([q], connection=conn, name="render.test.1"), q


def test_a_render_worker_takes_a_waiting_job_in_one_round_trip_as_rqs_dequeue_would(conn):
    """With jobs waiting, the render worker's dequeue is one script: RQ's move into the
    intermediate list (which the horse's start removes it from) and the job's hash, in
    queue order; the job is the one RQ's own fetch builds."""
    from jobs.runtime import PayrunJob

    w, q = _render_worker(conn)
    for i in (1, 2):
        q.enqueue_call("jobs.tasks.noop", job_id=f"r{i}", timeout=5, meta={"kind": "test", "n": i})
    conn.config_resetstat()
    job, queue = w.dequeue_job_and_maintain_ttl(timeout=1)
    calls = {c.removeprefix("cmdstat_"): v["calls"] for c, v in conn.info("commandstats").items()}
    assert (job.id, queue.name) == ("r1", keys.RENDER_QUEUE)
    assert calls.get("evalsha", 0) >= 1  # (twice the first time: NOSCRIPT, then loaded)
    assert not {"blmove", "lpop", "smembers"} & set(calls)  # RQ's dequeue, the drain check's pipeline
    assert calls["lmove"] == calls["hgetall"] == 1  # inside the script
    assert conn.lrange(q.key, 0, -1) == [b"r2"] and conn.lrange(q.intermediate_queue_key, 0, -1) == [b"r1"]
    stock = PayrunJob.fetch("r1", connection=conn)
    assert (job.func_name, job.args, job.meta, job.timeout, job.origin) == \
        (stock.func_name, stock.args, stock.meta, stock.timeout, stock.origin)
    assert w._took_at_once


def test_the_one_round_trip_take_honours_drains_and_suspension_and_skips_expired_jobs(conn):
    from rq.suspension import resume, suspend

    w, q = _render_worker(conn)
    q.enqueue_call("jobs.tasks.noop", job_id="kept", timeout=5, meta={"kind": "test"})
    conn.sadd(keys.PAUSED_QUEUES, keys.RENDER_QUEUE)  # payrun drain --queue pdf-render
    assert w._take_at_once() is None
    conn.delete(keys.PAUSED_QUEUES)
    suspend(conn)  # payrun drain / rq suspend
    assert w._take_at_once() is None and not w._took_at_once
    assert conn.lrange(q.key, 0, -1) == [b"kept"] and conn.llen(q.intermediate_queue_key) == 0
    resume(conn)
    conn.lpush(q.key, "expired")  # its hash gone (TTL) while it waited: RQ's dequeue skips it too
    job, _ = w._take_at_once()
    assert job.id == "kept" and conn.lrange(q.intermediate_queue_key, 0, -1) == [b"kept"]
    assert w._take_at_once() is None  # empty: RQ's blocking dequeue takes over
    conn.rpush(q.key, *[f"gone-{i}" for i in range(150)])  # a queue full of expired ids
    q.enqueue_call("jobs.tasks.noop", job_id="next", timeout=5, meta={"kind": "test"})
    assert w._take_at_once() is None  # 100 dropped, then it stops: RQ's dequeue goes on
    assert conn.llen(q.key) == 51 and conn.lrange(q.intermediate_queue_key, 0, -1) == [b"kept"]
    job, _ = w._take_at_once()
    assert job.id == "next" and conn.llen(q.key) == 0


def test_the_horse_reads_its_job_and_execution_as_rqs_fetches_do(conn):
    from rq.executions import Execution
    from rq.job import NoSuchJobError

    import pytest
    from jobs.runtime import PayrunJob

    w, q = _render_worker(conn)
    q.enqueue_call("jobs.tasks.noop", job_id="h1", timeout=5, meta={"kind": "test"})
    job = PayrunJob.fetch("h1", connection=conn)
    execution = w.prepare_execution(job)
    got_job, got_execution = w._fetch_for_horse("h1", execution.id)
    stock = Execution.fetch(execution.id, "h1", connection=conn)
    assert (got_execution.id, got_execution.job_id, got_execution.created_at, got_execution.last_heartbeat,
            got_execution.worker_name) == (stock.id, stock.job_id, stock.created_at, stock.last_heartbeat,
                                           stock.worker_name)
    assert got_job.to_dict() == PayrunJob.fetch("h1", connection=conn).to_dict()
    with pytest.raises(NoSuchJobError):
        w._fetch_for_horse("gone", execution.id)
    with pytest.raises(ValueError):
        w._fetch_for_horse("h1", "no-such-execution")


def test_sigterm_between_two_jobs_stops_a_render_worker_at_once(conn):
    """Its state still reads busy between two jobs (the idle write is left to a wait for
    work), but with no job in hand RQ's rule for an idle worker applies: stop at once.
    Otherwise it went on to a blocking dequeue that never looks at the stop request."""
    from datetime import datetime, timezone

    import pytest
    from rq.exceptions import StopRequested
    from rq.worker import WorkerStatus

    w, q = _render_worker(conn)
    w.set_state(WorkerStatus.BUSY)
    assert w.in_hand is None
    with pytest.raises(StopRequested):
        w._shutdown()
    assert w._stop_requested  # (recorded too: see the next test)
    w2, _ = _render_worker(conn)
    w2.set_state(WorkerStatus.BUSY)
    w2.in_hand = (object(), q)  # a job in hand: finish it first
    w2._shutdown_requested_date = datetime.now(timezone.utc)  # (request_stop, the signal handler, sets it)
    w2._shutdown()
    assert w2._stop_requested and w2.get_state() == WorkerStatus.BUSY


def test_sigterm_landing_inside_a_log_line_still_stops_a_render_worker(conn):
    """The signal handler raises StopRequested wherever the main thread is. Inside a log
    handler's emit (RQ's dequeue line then, the job's "running" line now), logging swallows
    it ("--- Logging error ---"): the worker went on taking every job until it was killed
    (a rolling deploy's render worker ran 35 s past its 5 s grace). Now it finishes the job
    it took and stops."""
    import logging
    import signal

    w, q = _render_worker(conn)
    w.jobs_per_horse = 10
    for i in range(5):
        q.enqueue_call("jobs.tasks.noop", job_id=f"s{i}", timeout=5, meta={"kind": "test"})

    class SignalDuringEmit(logging.Handler):
        fired = False

        def emit(self, record):
            try:  # as StreamHandler.emit does: an error goes to handleError, not up
                if not self.fired and record.getMessage().startswith("job s0 running"):
                    self.fired = True
                    w.request_stop(signal.SIGTERM, None)
            except Exception:  # noqa: BLE001
                self.handleError(record)

    handler = SignalDuringEmit()
    jobs_log = logging.getLogger("payrun.jobs")
    jobs_log.addHandler(handler)
    level = jobs_log.level
    jobs_log.setLevel(logging.INFO)
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False  # (no traceback on stderr)
    try:
        w.work(burst=True, logging_level="INFO")
    finally:
        logging.raiseExceptions = raise_exceptions
        jobs_log.removeHandler(handler)
        jobs_log.setLevel(level)
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
    assert handler.fired
    assert q.count == 4 and q.finished_job_registry.get_job_ids() == ["s0"]


def test_repeated_failure_says_it_once_then_every_30_s_with_a_count_and_when_it_is_back():
    from jobs.runtime import RepeatedFailure

    r = RepeatedFailure(every_s=30)
    assert r.ok(0.0) is None  # never failed: nothing to say
    assert r.failed(100.0, "Connection refused") == "Connection refused"  # the first at once
    assert [r.failed(100.0 + s, "Connection refused") for s in range(1, 30)] == [None] * 29
    line = r.failed(130.0, "Connection refused")
    assert line is not None and "31 looks failed, 30 since the last line" in line and "after 30 s" in line
    assert r.failed(131.0, "Connection refused") is None
    assert r.ok(140.5) == "back after 40 s (32 looks failed)"
    assert r.ok(141.0) is None
    assert r.failed(200.0, "again") == "again"  # a new outage is said at once


def test_redis_away_the_intake_says_cannot_look_for_work_once_and_when_it_is_back(conn, tmp_path, caplog):
    import logging

    import redis

    away = redis.Redis(unix_socket_path=str(tmp_path / "gone.sock"), socket_connect_timeout=0.2)
    q = make_queue(keys.EMAIL_QUEUE, conn)
    stop = threading.Event()
    intake = Intake(away, [q], stop)
    caplog.set_level(logging.WARNING, logger="payrun")
    t = threading.Thread(target=intake._run, daemon=True)
    t.start()
    try:
        wait_for(lambda: intake.outage.count >= 3, timeout_s=20, what="three failed looks")
        said = [r.getMessage() for r in caplog.records if "cannot look for work" in r.getMessage()]
        assert len(said) == 1, said  # it said so every second
        intake.conn = conn  # Redis is back
        wait_for(lambda: any("can look for work again" in r.getMessage() for r in caplog.records), timeout_s=20,
                 what="the line saying it is back")
    finally:
        stop.set()
        t.join(timeout=10)
    back = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
    assert len(back) == 1 and "looks failed" in back[0], back


def test_redis_away_liveness_says_so_once_not_every_beat(conn, tmp_path, caplog):
    import logging

    import redis

    from jobs.runtime import Liveness

    away = redis.Redis(unix_socket_path=str(tmp_path / "gone.sock"), socket_connect_timeout=0.2)
    live = Liveness(away, ["w1"])
    caplog.set_level(logging.WARNING, logger="payrun")
    live._thread.start()
    try:
        wait_for(lambda: live.outage.count >= 2, timeout_s=20, what="two failed beats")
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("liveness:")]
        assert len(said) == 1, said
        live.conn = conn
        wait_for(lambda: any("beating again" in r.getMessage() for r in caplog.records), timeout_s=20,
                 what="the line saying it beats again")
    finally:
        live._stop.set()
        live._thread.join(timeout=10)
    assert conn.exists(keys.alive("w1"))
