"""How the send-email process stops: a signal, a second signal, a Redis failure under one
lane while another waits to record a send (real Redis; the lanes' job loop is replaced
so each lane holds exactly what the test says)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from conftest import wait_for
from jobs import runtime
from payrun import keys


class _Job:
    def __init__(self, job_id: str):
        self.id = job_id


@pytest.fixture
def handlers():
    """run_lanes installs its own SIGTERM/SIGINT handlers: put pytest's back."""
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGTERM, old[0])
    signal.signal(signal.SIGINT, old[1])


def _lanes(monkeypatch, lane_0, lane_1) -> list:
    """Lane 0 and lane 1 run the given functions (lane, stop, fatal); jobs handed back to
    their queue by a forced stop are listed in the result."""
    returned: list = []

    def fake_lane_loop(lane, stop, intake, limiter=None, fatal=None, creds=None):
        return (lane_0 if lane.name.endswith(".0") else lane_1)(lane, stop, fatal)

    monkeypatch.setattr(runtime, "lane_loop", fake_lane_loop)
    monkeypatch.setattr(runtime.LaneWorker, "requeue_front", lambda self, job, q, reason: returned.append(job.id))
    monkeypatch.setattr(runtime, "worker_name", lambda kind, i: f"email.test-stop.{i}")
    return returned


def _signal_when(cond, what: str) -> None:
    """SIGTERM this process once ``cond`` holds (from a thread: the handler runs in the
    main thread, inside run_lanes)."""
    def go():
        wait_for(cond, timeout_s=20, interval_s=0.02, what=what)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=go, daemon=True).start()


def _logged(caplog, text: str) -> bool:
    return any(text in r.getMessage() for r in list(caplog.records))


def test_the_first_sigterm_after_a_lanes_redis_failure_still_lets_a_made_send_be_recorded(conn, monkeypatch,
                                                                                         caplog, handlers):
    """Lane 0's Redis command failed mid-job (the process will exit for a restart); lane 1
    has made its send and waits for Redis to record it. The operator's SIGTERM is the
    *first* signal: it must not be taken for a second one, which hands the job back to
    its queue at once and gets the slip sent again."""
    holding, recorded = threading.Event(), threading.Event()

    def lane_0(lane, stop, fatal):
        holding.wait(20)
        fatal.set()
        stop.set()
        return 0

    def lane_1(lane, stop, fatal):
        lane.in_hand = (_Job("email-2026-11-e1"), None)
        holding.set()
        # the send is made; recording it waits (jobs.tasks._record_sent) until the signal
        wait_for(lambda: _logged(caplog, "already finishing jobs in hand"), timeout_s=20, what="the SIGTERM")
        recorded.set()
        lane.in_hand = None
        return 1

    returned = _lanes(monkeypatch, lane_0, lane_1)
    _signal_when(lambda: _logged(caplog, "Redis failed under a job"), "the stop after the Redis failure")
    with caplog.at_level(logging.INFO, logger="payrun.worker"), pytest.raises(SystemExit) as exit_:
        runtime.run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, grace_s=30)
    assert exit_.value.code == 1  # for a restart
    assert recorded.is_set() and returned == []
    assert not _logged(caplog, "second signal")


def _two_sigterms_while_lane_1_holds(conn, monkeypatch, caplog, job_id: str, on_hold=lambda: None) -> list:
    """Lane 1 holds ``job_id`` (after ``on_hold()``) in a send that would outlast the grace;
    the process gets a SIGTERM, then a second one. Returns the jobs handed back."""
    holding, release = threading.Event(), threading.Event()

    def lane_0(lane, stop, fatal):
        return 0

    def lane_1(lane, stop, fatal):
        lane.in_hand = (_Job(job_id), None)
        on_hold()
        holding.set()
        release.wait(20)
        return 0

    returned = _lanes(monkeypatch, lane_0, lane_1)
    _signal_when(holding.is_set, "lane 1 to hold its job")
    _signal_when(lambda: _logged(caplog, "SIGTERM: finishing jobs in hand"), "the first SIGTERM")
    try:
        with caplog.at_level(logging.INFO, logger="payrun.worker"):
            runtime.run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, grace_s=30)
    finally:
        release.set()
    return returned


def test_a_second_sigterm_hands_the_job_in_hand_back_at_once(conn, monkeypatch, caplog, handlers):
    returned = _two_sigterms_while_lane_1_holds(conn, monkeypatch, caplog, "email-2026-11-e2")
    assert returned == ["email-2026-11-e2"]
    assert _logged(caplog, "second signal: returning jobs in hand now")


@pytest.mark.parametrize("redis_back", [True, False])
def test_a_second_sigterm_records_a_made_send_waiting_for_redis_before_handing_it_back(conn, monkeypatch, caplog,
                                                                                     handlers, redis_back):
    """Review of d3880c0/702521e: lane 1 made its send and waits for Redis to record it;
    a second SIGTERM came before its next try. The job was handed back with its claim
    freed, and its next try sent the slip again. Now the forced stop records the send
    first (Redis back) or leaves the job to the reaper with its claim (Redis still away)."""
    import redis as redis_mod

    from jobs import idempotency, tasks
    from jobs.limits import email_limiter
    from payrun import config as config_mod

    job_id, key = "email-2026-11-e3", "slip:2026-11:e3"
    token = f"{job_id}:1"
    assert idempotency.claim(conn, key, token, 60) == idempotency.OK
    lim = email_limiter(conn, config_mod.load())

    class _Away:
        def evalsha(self, *a, **k):
            raise redis_mod.ConnectionError("Redis is loading")

    def waiting_to_record():  # what _record_sent leaves while it waits for Redis
        with tasks._RECORDING_LOCK:
            tasks._RECORDING[job_id] = (conn if redis_back else _Away(), key, token, "<m@payrun>", lim.outage_keys())

    try:
        returned = _two_sigterms_while_lane_1_holds(conn, monkeypatch, caplog, job_id, waiting_to_record)
    finally:
        tasks._RECORDING.clear()
    if redis_back:
        assert idempotency.state(conn, key)["state"] == "sent" and returned == [job_id]
    else:
        assert idempotency.state(conn, key)["state"] == "sending" and returned == []
        assert _logged(caplog, "left to the reaper")
