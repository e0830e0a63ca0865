"""The worker runtime: thin subclasses of RQ that add payrun's policy.

- ``PayrunJob``: JSON serializer; retry delay from ``jobs.policy.backoff_delay`` (full
  jitter, at least a 429's Retry-After); refuses functions outside the allow-list.
- ``EventsMixin``: classifies each failure (a permanent one spends every remaining retry
  at once), and reports running / retrying / done / failed to the ledger stream.
- ``RenderWorker``: RQ's forking ``Worker`` (a hung render in C code can be killed) with
  WeasyPrint, fonts and the template warmed in the parent, so each fork starts warm.
- ``LaneWorker`` + ``run_lanes``: send-email is IO-bound, so one process runs many
  concurrent sends as threads ("lanes"), each lane a registered RQ worker that
  ``rq info`` shows, instead of one forked process per in-flight email.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from rq import Queue, SimpleWorker, Worker
from rq.exceptions import DequeueTimeout
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.timeouts import TimerDeathPenalty

from jobs import events
from jobs.errors import PermanentError
from jobs.policy import backoff_delay, classify
from jobs.tasks import ALLOWED_FUNCTIONS

log = logging.getLogger("payrun.worker")


class PayrunJob(Job):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("serializer", JSONSerializer)
        super().__init__(*args, **kwargs)

    def get_retry_interval(self) -> float:
        policy = self.meta.get("retry") or {}
        # attempt within the current budget: `payrun retry` restarts the count, not the history
        attempt = max(1, int(self.meta.get("attempt", 1)) - int(self.meta.get("budget_start", 0)))
        delay = backoff_delay(
            attempt,
            float(policy.get("base_s", 1.0)),
            float(policy.get("cap_s", 300.0)),
            retry_after_s=self.meta.get("retry_after"),
        )
        self.meta["last_delay"] = round(delay, 3)
        return delay

    def perform(self) -> Any:
        if self.func_name not in ALLOWED_FUNCTIONS:
            raise PermanentError(
                f"refused: {self.func_name!r} is not a payrun job function (allowed: {', '.join(sorted(ALLOWED_FUNCTIONS))})"
            )
        return super().perform()


def make_queue(name: str, conn) -> Queue:
    return Queue(name, connection=conn, serializer=JSONSerializer, job_class=PayrunJob)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class EventsMixin:
    """Failure classification and ledger events, shared by every payrun worker class."""

    job_class = PayrunJob
    serializer = JSONSerializer

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_class", PayrunJob)
        kwargs.setdefault("exception_handlers", [self._classify_exception])
        super().__init__(*args, **kwargs)

    # horse / lane side: about to run
    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        job.meta["attempt"] = int(job.meta.get("attempt", 0)) + 1
        job.meta.pop("retry_after", None)
        job.save_meta()
        super().prepare_job_execution(job, remove_from_intermediate_queue)
        events.emit(self.connection, job.id, "running", attempt=job.meta["attempt"], worker=self.name)

    def _classify_exception(self, job: Job, exc_type, exc_value, tb) -> bool:
        verdict = classify(exc_value)
        job.meta["last_error"] = _one_line(verdict.reason)
        job.meta["error_attempt"] = job.meta.get("attempt")
        if verdict.retry_after_s:
            job.meta["retry_after"] = verdict.retry_after_s
        if not verdict.transient:
            job.retries_left = 0
        job.save_meta()
        return True

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry) -> None:
        super().handle_job_success(job, queue, started_job_registry)
        events.emit(self.connection, job.id, "done", attempt=job.meta.get("attempt"))

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry=None, exc_string: str = "") -> None:
        job.meta = job.get_meta(refresh=True)  # the horse may have died holding newer meta
        if job.meta.get("error_attempt") != job.meta.get("attempt"):
            # no exception handler ran for this attempt: the horse was killed (timeout in C code)
            job.meta["last_error"] = _one_line(exc_string or "work horse terminated")
            job.meta["error_attempt"] = job.meta.get("attempt")
        super().handle_job_failure(job, queue, started_job_registry, exc_string)
        status = job.get_status(refresh=True)
        if status in (JobStatus.SCHEDULED, JobStatus.QUEUED):
            events.emit(self.connection, job.id, "retrying", attempt=job.meta.get("attempt"),
                        error=job.meta.get("last_error"), delay=job.meta.get("last_delay"))
        else:
            events.emit(self.connection, job.id, "failed", attempt=job.meta.get("attempt"),
                        error=job.meta.get("last_error"))


class RenderWorker(EventsMixin, Worker):
    """Fork per job, warmed: the parent imports WeasyPrint and renders one sample slip
    before it takes work, so every forked horse inherits the loaded fonts and template."""

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        from jobs import slip

        started = time.monotonic()
        slip.warm_up()
        log.info("Worker %s: WeasyPrint warmed in %.2f s", self.name, time.monotonic() - started)
        super().bootstrap(*args, **kwargs)


class LaneWorker(EventsMixin, SimpleWorker):
    """One lane of a send-email process: runs jobs in its thread, timeouts by timer."""

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self) -> None:  # the process's main thread owns signals
        pass

    def subscribe(self) -> None:  # one pubsub thread per lane would be 45 threads
        pass

    def unsubscribe(self) -> None:
        pass

    def procline(self, message: str) -> None:  # one process title, not 45
        pass


def worker_name(kind: str, index: int | None = None) -> str:
    base = f"{kind}.{socket.gethostname()}.{os.getpid()}"
    return base if index is None else f"{base}.{index:02d}"


def lane_loop(lane: LaneWorker, stop: threading.Event, poll_s: int = 1) -> int:
    """Dequeue and run jobs until ``stop`` is set; a job in hand is always finished."""
    lane.register_birth()
    lane.set_state("idle")
    done = 0
    try:
        while not stop.is_set():
            try:
                if is_suspended(lane.connection):
                    stop.wait(poll_s)
                    lane.heartbeat()
                    continue
                result = Queue.dequeue_any(
                    lane.queues, poll_s, connection=lane.connection, job_class=lane.job_class,
                    serializer=lane.serializer,
                )
            except DequeueTimeout:
                lane.heartbeat()
                continue
            except Exception as e:  # Redis blip: back off, keep the lane alive
                log.warning("Lane %s: %s; retrying in 1 s", lane.name, e)
                stop.wait(1)
                continue
            if result is None:
                continue
            job, queue = result
            lane.execute_job(job, queue)
            lane.heartbeat()
            done += 1
    finally:
        lane.register_death()
    return done


def run_lanes(conn, queue_names: list[str], lanes: int, burst: bool = False) -> int:
    """Run ``lanes`` concurrent lanes in this process until SIGTERM/SIGINT (or, with
    ``burst``, until the queues are empty). Returns the number of jobs run."""
    queues = [make_queue(q, conn) for q in queue_names]
    stop = threading.Event()
    workers = [LaneWorker(queues, connection=conn, name=worker_name("email", i)) for i in range(lanes)]
    # retries sit in RQ's scheduled registry: lane 0 also runs RQ's scheduler for our queues
    workers[0]._start_scheduler(burst=False)
    counts: list[int] = [0] * lanes

    def run(i: int) -> None:
        counts[i] = lane_loop(workers[i], stop)

    def on_signal(signum, frame):
        log.info("send-email %d: %s: finishing jobs in hand, taking no more", os.getpid(), signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    threads = [threading.Thread(target=run, args=(i,), name=f"lane-{i}", daemon=True) for i in range(lanes)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            if burst and all(q.count == 0 for q in queues) and all(w.get_state() != "busy" for w in workers):
                stop.set()
            for t in threads:
                t.join(timeout=0.2)
    finally:
        stop.set()
        if workers[0].scheduler:
            workers[0].stop_scheduler()
    return sum(counts)
