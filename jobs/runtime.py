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

Deadlines (``jobs.policy`` holds the arithmetic):
- a job past its timeout is killed by the parent 2 s later even when it hangs in C code
  (RQ alone waits timeout + 60 s); that counts as a transient failure and is retried;
- on SIGTERM a worker takes no new job and has ``grace_s`` to finish the one in hand;
  past the grace, or on a second SIGTERM, the job goes back to the *front* of its queue
  without spending an attempt, and the worker exits by itself;
- every worker keeps ``payrun:alive:<name>`` alive (TTL 10 s) from a thread of its own;
  the reaper (payrun/reaper.py) returns the jobs of a worker whose key lapsed.
"""

from __future__ import annotations

import collections
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from rq import Queue, SimpleWorker, Worker
from rq.executions import Execution
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job, JobStatus, _job_stack
from rq.worker import WorkerStatus
from rq.defaults import DEFAULT_FAILURE_TTL, DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.scheduler import RQScheduler
from rq import job as rq_job, queue as rq_queue, registry as rq_registry, results as rq_results
from rq import serializers as rq_serializers
from rq.serializers import JSONSerializer
from rq.worker import base as rq_worker_base
from rq.suspension import WORKERS_SUSPENDED
from rq.worker_registration import WORKERS_BY_QUEUE_KEY
from rq.timeouts import BaseTimeoutException
from rq.utils import get_version, now as utcnow, utcformat

from jobs import events, idempotency
from jobs.errors import (ClaimLost, PermanentError, ProviderDown, RefusedHere, RenderPending, SlipMissing, StoreHeld,
                         Throttled)
from jobs.limits import EMPTY
from jobs.policy import (backoff_attempt, backoff_delay, classify, outage_hold_is_free, shutdown_deadline,
                         store_full_hold_is_free, unreadable_reason)
from jobs.tasks import allowed_functions
from jobs.watchdog import WATCHDOG, WatchdogDeathPenalty
from payrun.procs import host_id
from payrun import keys

RQ_RESOLVE_SERIALIZER = rq_serializers.resolve_serializer


def _resolve_serializer_fast(serializer=None):
    """RQ's resolve_serializer, answering at once for the serializer payrun always passes.
    RQ calls it for every Job, Queue and registry object it builds, 7 times per send, and
    each call checks a runtime Protocol (``isinstance`` walks its attributes): 15 µs, ~2%
    of a send's CPU. Same answer for JSONSerializer; everything else goes to RQ's."""
    if serializer is JSONSerializer:
        return serializer
    return RQ_RESOLVE_SERIALIZER(serializer)


RQ_MODULES_RESOLVING_SERIALIZERS = (rq_job, rq_queue, rq_registry, rq_results, rq_worker_base)
for _m in RQ_MODULES_RESOLVING_SERIALIZERS:
    _m.resolve_serializer = _resolve_serializer_fast

KILL_MARGIN_S = 2
"""How long past its timeout a job may run before the parent kills its work horse."""
ALIVE_TTL_S = 10
"""A worker whose payrun:alive key is older than this is presumed dead."""
ALIVE_EVERY_S = 2
SCHEDULER_CHECK_S = 5
"""How often a worker checks that RQ's scheduler for its queues runs (and restarts it)."""
SCHEDULER_STOP_S = 5.0
"""How long a stopping worker waits for its RQ scheduler process before killing it."""
HEARTBEAT_EVERY_S = 1.0
"""At most one plain worker heartbeat per second (RQ sends one before and after every job)."""
LANE_HEARTBEAT_EVERY_S = 10.0
"""A send lane's plain heartbeat: each job start renews the worker key anyway."""

log = logging.getLogger("payrun.worker")


def _json_only(args: tuple, kwargs: dict[str, Any], position: int) -> tuple:
    """The arguments with JSON as the serializer, whatever the caller passed (``position``:
    where the serializer sits among the positional ones)."""
    if len(args) > position:
        args = args[:position] + (JSONSerializer,) + args[position + 1:]
    else:
        kwargs["serializer"] = JSONSerializer
    return args


class PayrunJob(Job):
    """RQ's Job, JSON only, whatever serializer the caller names. ``Job.fetch(id,
    connection=c)`` passes serializer=None, which RQ would resolve to pickle, and rq's own
    commands (``rq requeue``, ``rq empty``, ``rq enqueue``, ``rq worker``) pass their
    ``--serializer`` default, pickle, by name: `rq requeue --all` under `payrun config
    rq-env` unpickled every failed job's meta (code run by whoever can write to Redis)."""

    def __init__(self, *args: Any, **kwargs: Any):
        args = _json_only(args, kwargs, 2)  # Job(id, connection, serializer)
        super().__init__(*args, **kwargs)

    returned_tries = 0
    """Tries handed back or reaped (events.RETURNED_FIELD), as loaded with the job."""

    def restore(self, raw_data) -> None:
        super().restore(raw_data)
        # RQ imports and calls a job's success/failure/stopped callbacks by the names stored
        # in its hash, even for a job whose function perform() refuses; payrun sets none, so
        # a name there came from someone writing to Redis: dropped, never imported.
        self._success_callback_name = self._failure_callback_name = self._stopped_callback_name = None
        self.meta = recover_meta(self.meta)
        k = events.RETURNED_FIELD
        self.returned_tries = int(raw_data.get(k.encode(), raw_data.get(k)) or 0)

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict:
        """RQ's record, with ``enqueue_at_front_on_retry`` always written (RQ writes it only
        when true, and its HSET would leave a stale 1 behind): a held try's flag must not
        outlive it (``EventsMixin._classify_exception``)."""
        obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        obj["enqueue_at_front_on_retry"] = int(bool(self.enqueue_at_front_on_retry))
        return obj

    def get_retry_interval(self) -> float:
        policy = self.meta.get("retry") or {}
        attempt = backoff_attempt(int(self.meta.get("attempt", 1)), int(self.meta.get("budget_start", 0)),
                                  self.returned_tries, int(self.meta.get("budget_returned", 0)))
        delay = backoff_delay(
            attempt,
            float(policy.get("base_s", 1.0)),
            float(policy.get("cap_s", 300.0)),
            retry_after_s=self.meta.get("retry_after"),
            jitter=bool(policy.get("jitter", True)),
        )
        self.meta["last_delay"] = round(delay, 3)
        return delay

    # The attempt counter and the ledger's running/done events ride in RQ's own pipelines
    # (one MULTI with the status change): fewer round trips per job, and a 'done' event can
    # no longer be lost between RQ recording the end and us reporting it.
    def prepare_for_execution(self, worker_name: str, pipeline) -> None:
        lane = self.__dict__.pop("_execution_for", None)
        if lane is not None:  # LaneWorker.prepare_execution left its execution record to us
            lane.execution = Execution.create(self, lane.get_heartbeat_ttl(self), pipeline=pipeline,
                                              worker_name=lane.name)
            lane.set_state(WorkerStatus.BUSY, pipeline=pipeline)
        super().prepare_for_execution(worker_name, pipeline)
        pipeline.persist(self.key)  # RQ's Job.perform sends this on its own (see perform)
        pipeline.hset(self.key, "meta", self.serializer.dumps(self.meta))
        pipeline.xadd(keys.EVENTS_STREAM, events.event(self.id, "running", attempt=self.meta.get("attempt"),
                                                      worker=worker_name))

    def _handle_success(self, result_ttl, pipeline, worker_name: str = "", *args: Any, **kwargs: Any):
        super()._handle_success(result_ttl, pipeline, worker_name, *args, **kwargs)
        pipeline.xadd(keys.EVENTS_STREAM, events.event(self.id, "done", attempt=self.meta.get("attempt")))
        self._done_emitted = True

    def perform(self) -> Any:
        """RQ's Job.perform (rq 2.12) without its PERSIST round trip: the job key's expiry
        is already removed in prepare_for_execution's transaction, just before."""
        allowed = allowed_functions()
        if self.func_name not in allowed:
            raise PermanentError(
                f"refused: {self.func_name!r} is not a payrun job function (allowed: {', '.join(sorted(allowed))})"
            )
        _job_stack.push(self)
        try:
            self._result = self._execute()
        finally:
            assert self is _job_stack.pop()
        return self._result


NO_DATA = "its Redis hash has no 'data' field"


def recover_meta(meta: dict) -> dict:
    """Undo what RQ's own registry cleanup (``rq info``, RQ maintenance) does to a JSON
    job it finds abandoned: it reads ``meta`` with pickle, fails, keeps the raw bytes as
    ``{'unserialized': b'{...json...}'}`` and saves that back *pickled*. We never unpickle
    (that would run code chosen by whoever can write to Redis): pickletools only *lists*
    the opcodes, and the JSON bytes are taken from the one bytes constant inside."""
    import json
    import pickletools

    raw = meta.get("unserialized") if isinstance(meta, dict) and len(meta) == 1 else None
    if not isinstance(raw, (bytes, bytearray)):
        return meta
    candidates = [bytes(raw)]
    if raw[:1] == b"\x80":  # a pickle: look for a bytes constant holding our JSON
        try:
            candidates = [arg for op, arg, _ in pickletools.genops(bytes(raw))
                          if isinstance(arg, (bytes, bytearray)) and arg[:1] == b"{"]
        except Exception:
            candidates = []
    for c in candidates:
        try:
            value = json.loads(bytes(c).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(value, dict):
            return recover_meta(value)
    return {}


class UnreadableJob(Exception):
    """A job hash with no ``data`` field, met by RQ's dequeue (``DequeuedJob``)."""

    def __init__(self, job_id: str, raw_meta: bytes | None):
        super().__init__(f"job {job_id}: {NO_DATA}")
        self.job_id, self.raw_meta = job_id, raw_meta


class DequeuedJob(PayrunJob):
    """PayrunJob as RQ's blocking dequeue fetches it (``RenderWorker``): a hash with no
    ``data`` raises UnreadableJob, which RQ's dequeue lets through, instead of RQ's
    NoSuchJobError, which it swallows, leaving the id taken in the queue's intermediate
    list: never run, never failed, put back by the reaper and skipped again."""

    def refresh(self) -> None:
        raw = self.connection.hgetall(self.key)
        if not raw:
            raise NoSuchJobError(f"No such job: {self.key}")
        try:
            self.restore(raw)
        except NoSuchJobError:
            raise UnreadableJob(self.id, raw.get(b"meta")) from None


class PayrunQueue(Queue):
    """RQ's Queue with JSON, whatever serializer the caller names, and PayrunJob when it
    names no job class (``Queue.all``, ``Queue.from_queue_key`` and RQ's own command line
    pass ``None``, which RQ resolves to pickle, or pickle by name: ``rq enqueue``, ``rq
    empty``). ``RQ_QUEUE_CLASS=jobs.runtime.PayrunQueue`` makes ``rq info`` use
    it (`payrun config rq-env`): its registry cleanup then reads jobs with JSON instead
    of unpickling what it finds in Redis."""

    def __init__(self, *args: Any, **kwargs: Any):
        args = _json_only(args, kwargs, 5)  # Queue(name, connection, default_timeout, is_async, job_class, serializer)
        if len(args) > 4:
            if args[4] is None:
                args = args[:4] + (PayrunJob,) + args[5:]
        elif kwargs.get("job_class") is None:
            kwargs["job_class"] = PayrunJob
        super().__init__(*args, **kwargs)


def _all_empty(queues) -> bool:
    """Every queue empty (a burst run's end); a Redis away counts as not empty (the lanes
    waiting to record a made send must not die with the error)."""
    try:
        return all(q.count == 0 for q in queues)
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return False


def make_queue(name: str, conn) -> Queue:
    return PayrunQueue(name, connection=conn)


def register_queues(conn, queues: list[Queue]) -> None:
    """List a worker's queues in RQ's set of queues (``rq:queues``) as it starts. RQ adds a
    queue there on its first enqueue only: until then ``rq info -R`` and ``Queue.all()``
    showed neither the queue nor the worker serving it (the control queue, on a quiet
    day). An empty queue listed is what RQ leaves anyway once a queue has drained."""
    if queues:
        conn.sadd(Queue.redis_queues_keys, *[q.key for q in queues])


class PayrunScheduler(RQScheduler):
    """RQ's scheduler process (moves due retries from the scheduled registry to their
    queue), made to die with the worker that forked it, like a work horse."""

    def start(self):
        self._payrun_parent = os.getpid()
        return super().start()

    def to_dict(self) -> dict:
        """RQ's record of it (``rq:scheduler:<name>``), plus ``host_id`` (payrun.procs):
        free_dead_scheduler_locks judges its pid only on its own host."""
        return {**super().to_dict(), HOST_ID_FIELD: host_id()}

    RQ_RAISED = "Scheduler [PID %s] raised an exception.\n%s"
    """rq 2.12, rq.scheduler.run (pinned)."""

    def work(self):
        die_with_parent(getattr(self, "_payrun_parent", os.getppid()))
        try:
            return super().work()
        except (RedisConnectionError, RedisTimeoutError) as e:
            # RQ's run() logged it with its traceback, and multiprocessing printed that again:
            # one line instead, and exit REDIS_GONE_EXIT (its worker starts another:
            # ensure_scheduler). INFO: the outage is its worker's to tell (RedisOutageLog);
            # a WARNING here read as a second incident.
            self.log.info("Scheduler [PID %s]: Redis went away (%s): it exits; its worker starts another "
                          "once Redis answers", os.getpid(), events.one_line(str(e)))
            self.log = _Without(self.log, self.RQ_RAISED)  # (RQ's line for the SystemExit below)
            raise SystemExit(self.REDIS_GONE_EXIT) from None

    REDIS_GONE_EXIT = 75
    """Its exit code when Redis went away (EX_TEMPFAIL): its worker tells its restart as
    part of the outage, not as a scheduler that died (ensure_scheduler)."""


class _Without:
    """A logger less one message (a format string, as the caller passes it)."""

    def __init__(self, logger: logging.Logger, msg: str):
        self._logger, self._msg = logger, msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)

    def error(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if msg != self._msg:
            self._logger.error(msg, *args, **kwargs)


def free_dead_scheduler_locks(conn, queue_names, hostname: str | None = None, host: str | None = None) -> list[str]:
    """Release RQ's scheduler locks (``rq:scheduler-lock:<queue>``) whose holder was a
    scheduler process on this host that is gone. A worker killed by SIGKILL takes its
    scheduler with it (``PayrunScheduler``: it dies with its parent), and the lock stayed
    its 61 s: every due retry of the queue waited for it (a walkthrough: a held send
    picked up a minute late after a `kill -9`). The holder is known by the lock's value
    (its name) and its record (``rq:scheduler:<name>``: hostname, pid, host id); a holder
    on another host, or with no record left, is left to its lock's TTL. Another host is
    another hostname or, the same, another host id (``host``, default payrun.procs.host_id:
    two machines named alike; a record without one, of a payrun before session 42, goes by
    its hostname). Returns the queues freed."""
    from rq.scheduler import SCHEDULER_KEY_TEMPLATE, release_lock

    from payrun.procs import pid_alive

    here = hostname or socket.gethostname()
    me = host or host_id()
    freed = []
    for name in queue_names:
        key = RQScheduler.get_locking_key(name)
        holder = conn.get(key)
        if holder is None:
            continue
        holder = holder.decode()
        record = conn.hmget(SCHEDULER_KEY_TEMPLATE % holder, "hostname", "pid", HOST_ID_FIELD)
        if record[0] is None or record[0].decode() != here or not (record[1] or b"").isdigit():
            continue
        if record[2] is not None and record[2].decode() != me:
            continue  # another machine of this hostname: its pid is nothing here
        pid = int(record[1])
        if pid <= 0 or pid_alive(pid):
            continue
        if release_lock(conn, key, holder):  # (only if still that holder's)
            log.warning("RQ scheduler lock for %s was held by scheduler pid %d on this host, which is gone: "
                        "released (due retries wait no longer for its lapse)", name, pid)
            freed.append(name)
    return freed


class _QuietJobOK(logging.Filter):
    """Drops RQ's per-job success lines ("Successfully completed ... job in ...", "...: Job
    OK (id)"): payrun's own "job <id> done (attempt n) in x s" line says the same. Three
    lines of five per job at 100,000 jobs a night were noise at 02:00. And RQ's "run `rq
    resume` to resume" names payrun's command (it also clears drained queues).

    A job failing with one of payrun's own errors (jobs.errors: a 503, a 429, an outage, a
    bad address) is logged on one line, its error's class and message, without RQ's
    traceback (40 lines per failed send during a provider outage). Anything else, a bug,
    keeps its traceback. So is a job that failed because Redis went away under it (an
    outage, not a bug): one WARNING line."""

    RQ_FAILED = "Worker %s: job %s: exception raised while executing (%s)\n%s"
    REDIS_AWAY = ("redis.exceptions.ConnectionError", "redis.exceptions.TimeoutError",
                  "redis.exceptions.BusyLoadingError")  # (a restarted Redis loading its data)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg == "Worker %s: suspended, run `rq resume` to resume":
            record.msg = "Worker %s: intake stopped everywhere (`payrun drain`): waiting for `payrun resume`"
        if msg.startswith("Successfully completed"):
            return False
        args = record.args if isinstance(record.args, tuple) else ()
        if msg == self.RQ_FAILED and len(args) == 4 and isinstance(args[3], str):
            last = args[3].rstrip().rsplit("\n", 1)[-1]
            if last.startswith("jobs.errors."):
                record.msg = "Worker %s: job %s: %s"
                record.args = (args[0], args[1], last[len("jobs.errors."):])
                if not last.startswith("jobs.errors.PermanentError"):
                    record.levelno, record.levelname = logging.WARNING, "WARNING"  # retried
            elif last.startswith(self.REDIS_AWAY):
                # Redis went away under the job (its record, the send it enqueues): no bug to
                # trace; the job is retried, or returned by the reaper once Redis is back
                record.msg = "Worker %s: job %s: Redis unavailable: %s"
                record.args = (args[0], args[1], last[len("redis.exceptions."):])
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        if msg == "Worker %s: %s: %s (%s)" and len(args) > 2 and "Job OK" in str(args[2]):
            return False
        return True


logging.getLogger("rq.worker").addFilter(_QuietJobOK())


def say_scheduler_gone(worker: str, pid: int | None, exitcode: int | None) -> None:
    """The line for a worker's RQ scheduler found dead (ensure_scheduler): one that exited
    because Redis went away (PayrunScheduler.REDIS_GONE_EXIT) is part of the outage its
    worker tells (RedisOutageLog), so INFO; any other death (killed, a bug) is a WARNING."""
    if exitcode == PayrunScheduler.REDIS_GONE_EXIT:
        log.info("Worker %s: RQ scheduler (pid %s) exited, Redis away; starting another once Redis answers",
                 worker, pid)
    else:
        log.warning("Worker %s: RQ scheduler (pid %s) is gone (exit code %s); starting another", worker, pid,
                    exitcode)


class EventsMixin:
    """Failure classification and ledger events, shared by every payrun worker class."""

    job_class = PayrunJob
    serializer = JSONSerializer
    log_result_lifespan = False  # "result is kept for 86400 seconds" after every job

    grace_s: float = 30.0
    """Set from lease.grace_s by whoever starts the worker."""

    _outage: "RedisOutageLog | None" = None
    """The process's story of Redis away (a render or control worker's own; a send-email
    process's, shared by its lanes: run_lanes)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_class", PayrunJob)
        kwargs.setdefault("exception_handlers", [self._classify_exception])
        super().__init__(*args, **kwargs)
        self.in_hand: tuple[Job, Queue] | None = None
        self._requeue_ids: set[str] = set()

    def serialize(self) -> dict:
        """RQ's record of this worker, plus its ``host_id`` (with_host_id)."""
        return with_host_id(super().serialize())

    def register_birth(self, *args: Any, **kwargs: Any) -> None:
        """RQ's record of this worker, plus the supervisord program running it (field
        ``program``, when there is one): the console and `payrun workers` name it beside
        host:pid, so the on-call knows what to `supervisorctl restart` without `payrun ps`."""
        super().register_birth(*args, **kwargs)
        if program := supervisor_program():
            self.connection.hset(self.key, "program", program)

    def ensure_scheduler(self) -> None:
        """Restart RQ's scheduler for our queues if it died, at most every SCHEDULER_CHECK_S.

        The scheduler is a forked process that exits on the first Redis error (a Redis
        restart), and its lock outlives it by 61 s; RQ itself only looks again at its
        10-minute maintenance, so retries (the scheduled registry) would wait that long.
        A worker that lost the lock race to another worker's scheduler also takes over
        here within seconds once that one is gone. Call from the main thread (it forks)."""
        now = time.monotonic()
        if now < getattr(self, "_next_scheduler_check", 0.0) or getattr(self, "_stop_requested", False):
            return  # a stopping worker stopped its scheduler on purpose: starting another kept it alive
        self._next_scheduler_check = now + SCHEDULER_CHECK_S
        current = self.scheduler
        process = getattr(current, "_process", None) if current is not None else None
        if process is not None and process.is_alive():
            return
        try:
            if current is not None and process is not None:
                if getattr(self, "_scheduler_gone_said", None) != process.pid:  # (once, not at every check)
                    self._scheduler_gone_said = process.pid
                    say_scheduler_gone(self.name, process.pid, process.exitcode)
                current.release_locks()  # only locks still holding its own name
            self._start_scheduler(burst=False)
        except Exception as e:  # Redis still down: try again at the next check
            if self._outage is not None and isinstance(e, REDIS_AWAY):
                self._outage.failed("scheduler", e)  # (a try of the process's story, not a line every 5 s)
            else:
                log.warning("Worker %s: cannot start the RQ scheduler yet: %s", self.name, e)
        else:
            if self._outage is not None:
                self._outage.ok("scheduler")

    def stop_scheduler(self) -> None:
        """RQ's, with a bound: SIGTERM, then SIGKILL after SCHEDULER_STOP_S. RQ joins the
        scheduler process without a timeout, and a worker stuck there outlives its grace.

        Then the scheduler's locks are released from here too (only those still holding
        its name): a scheduler process that dies without releasing them (SIGTERM in the
        moment after its fork, before it handles the signal; the SIGKILL above) left them
        for their 61 s, and every due retry on every host waited that long (a worker
        stopped right after it started: a restart loop, a deploy)."""
        process = getattr(self.scheduler, "_process", None)
        if process is None or not process.pid:
            return
        try:
            os.kill(process.pid, signal.SIGTERM)
        except OSError:
            pass
        process.join(SCHEDULER_STOP_S)
        if process.is_alive():
            log.warning("Worker %s: RQ scheduler (pid %s) did not stop within %g s; killing it",
                        self.name, process.pid, SCHEDULER_STOP_S)
            process.kill()
            process.join(1)
        if process.exitcode != 0:
            try:
                self.scheduler.release_locks()
            except Exception as e:  # Redis away: they expire by themselves
                log.warning("Worker %s: could not release the RQ scheduler's locks (%s): they lapse in 61 s",
                            self.name, e)

    # RQ writes the worker's heartbeat (HSET + EXPIRE, two round trips) three times per job
    # and its state twice: between two renders that is ~8 round trips while the core idles.
    # The worker key lives worker_ttl + 60 s (480 s); liveness is our own key (Liveness).
    heartbeat_every_s: float = HEARTBEAT_EVERY_S

    def heartbeat(self, timeout: int | None = None, pipeline=None) -> None:
        last = getattr(self, "last_heartbeat", None)
        if (timeout is None and pipeline is None and last is not None
                and (utcnow() - last).total_seconds() < self.heartbeat_every_s):
            return
        program = supervisor_program()
        if pipeline is None and program:
            # a record that lapsed (Redis away past its expiry) is made again by the next
            # beat with RQ's few fields: the program too (and one round trip, not RQ's two)
            with self.connection.pipeline(transaction=False) as p:
                super().heartbeat(timeout, p)
                p.hset(self.key, "program", program)
                p.execute()
            return
        super().heartbeat(timeout, pipeline)

    def set_state(self, state: str, pipeline=None) -> None:
        if pipeline is None and state == getattr(self, "_state", None):
            return  # already so in Redis (nobody else writes a worker's state)
        super().set_state(state, pipeline)

    def _start_scheduler(self, burst: bool = False, logging_level: str | None = "INFO",
                         date_format: str = DEFAULT_LOGGING_DATE_FORMAT, log_format: str = DEFAULT_LOGGING_FORMAT):
        """RQ's own method (rq 2.12, worker/base.py), with PayrunScheduler for RQScheduler."""
        self.scheduler = PayrunScheduler(
            self.queues, connection=getattr(self, "scheduler_connection", None) or self.connection,
            logging_level=logging_level if logging_level is not None else self.log.level,
            date_format=date_format, log_format=log_format, serializer=self.serializer,
        )
        self.scheduler.acquire_locks()
        missing = {q.name for q in self.queues} - set(self.scheduler.acquired_locks)
        if missing and free_dead_scheduler_locks(self.scheduler.connection, sorted(missing)):
            self.scheduler.acquire_locks()  # (acquire_locks takes every lock it can, the held ones again)
        if self.scheduler.acquired_locks:
            if burst:
                try:
                    self.scheduler.register_birth()
                    self.scheduler.enqueue_scheduled_jobs()
                finally:
                    self.scheduler.release_locks()
                    self.scheduler.register_death()
            else:
                self.scheduler.start()

    def execute_job(self, job: Job, queue: Queue) -> None:
        self.in_hand = (job, queue)
        try:
            super().execute_job(job, queue)
        except DeserializationError as e:
            # data that is not JSON (a pickle from `rq requeue`, bytes written by hand): RQ
            # reads the function's name for the process title as the job starts, in the
            # worker itself (a warm horse's worker), and the error ended the worker, which
            # took the same job again after each restart. (A lane meets it inside the job's
            # own try: it fails there, jobs.policy.classify names it.)
            self.fail_unreadable(job.id, queue, unreadable_reason(e), job=job)
        finally:
            self.in_hand = None

    def fail_unreadable(self, job_id: str, queue: Queue, reason: str, job: Job | None = None,
                        raw_meta: bytes | None = None, never_started: bool = False) -> None:
        """Put a job payrun cannot read (no ``data`` field in its hash, or data that is not
        JSON) in its queue's failed registry with the error "job data unreadable: <reason>",
        and tell the ledger: the worker goes on with the next job. Nothing of it is run or
        unpickled; its meta is kept only if it is JSON (``raw_meta``: as found in Redis).
        `payrun failed` lists it; `payrun retry` cannot bring it back (nothing to run).
        ``never_started``: taken, not started (a batch's take): no execution of its own
        (``self.execution`` is another job's, or none)."""
        error = events.one_line(f"job data unreadable: {reason}")
        meta: dict = {}
        try:
            if job is not None:
                meta = dict(job.meta)
            elif raw_meta:
                loaded = json.loads(raw_meta)
                meta = loaded if isinstance(loaded, dict) else {}
        except Exception:  # noqa: BLE001 - unreadable meta too: start afresh
            meta = {}
        meta.update(last_error=error, error_attempt=meta.get("attempt"), permanent=False)
        key = self.job_class.key_for(job_id)
        with self.connection.pipeline() as pipe:
            if job is not None and not never_started and getattr(self, "execution", None) is not None:
                self.cleanup_execution(job, pipeline=pipe)  # started already (its attempt counted)
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            pipe.hset(key, mapping={"status": JobStatus.FAILED.value, "ended_at": utcformat(utcnow()),
                                    "meta": json.dumps(meta)})
            pipe.expire(key, DEFAULT_FAILURE_TTL)
            pipe.zadd(queue.failed_job_registry.key, {job_id: time.time() + DEFAULT_FAILURE_TTL})
            # (kind and queue: a ledger row for a job payrun never created, so the ledger shows it too)
            events.emit(pipe, job_id, "failed", attempt=meta.get("attempt"), error=error,
                        kind=meta.get("kind") or "unreadable", queue=queue.name)
            pipe.execute()
        log.error("Worker %s: job %s: %s: moved to the failed jobs (`payrun failed`), not run", self.name,
                  job_id, error)

    def requeue_front(self, job: Job, queue: Queue, reason: str) -> None:
        """Give a job back without spending an attempt: front of its queue, ledger told,
        its idempotency claim released (a resend uses the same key; the provider dedupes)."""
        job.meta = job.get_meta(refresh=True)
        attempt = int(job.meta.get("attempt", 0))
        # a second signal can land between the dequeue and the horse's start (the job in
        # the started registry, its status still queued): that try never began, its
        # attempt counter never moved, so it is neither a returned try nor a ledger row
        try:
            began = job.get_status(refresh=True) == JobStatus.STARTED
        except Exception:  # noqa: BLE001 - gone: count nothing
            began = False
        # (a try that began is counted returned below: the backoff leaves it out, as it
        # does a try the reaper returned; jobs.policy.backoff_attempt)
        if began and job.meta.get("kind") == "email" and job.meta.get("key"):
            # before the job is back on its queue: another lane may take it at once, and
            # would find the key still claimed by this attempt ("being sent": a retry spent)
            idempotency.release(self.connection, job.meta["key"], f"{job.id}:{attempt}")
        with self.connection.pipeline() as pipe:
            if getattr(self, "execution", None) is not None:
                self.cleanup_execution(job, pipeline=pipe)
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            if began:
                pipe.hincrby(job.key, events.RETURNED_FIELD, 1)  # a try that spent no attempt
            events.emit(pipe, job.id, "queued", attempt=attempt if began else None, outcome="requeued",
                        error=reason)
            pipe.execute()
        log.warning("Worker %s: %s returned to the front of %s (%s)", self.name, job.id, queue.name, reason)

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        """RQ writes the job's last_heartbeat here on its own (a round trip per job), then
        saves the whole job record, heartbeat field included, in the success or failure
        transaction that follows: setting it in memory gives the same record. (The one
        outcome that saves no record, success with result_ttl 0, deletes the job record
        in that transaction instead: no heartbeat to keep.)"""
        job.ended_at = utcnow()
        job.last_heartbeat = job.ended_at

    # horse / lane side: about to run
    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        # data that is not JSON raises DeserializationError here, before an attempt is counted
        # or a "running" event written: the job never runs (RQ would raise it a step later,
        # for the process title, and `payrun failed` said attempts=1 of it, 0 of one with no data)
        try:
            job.func_name
        except DeserializationError:
            if remove_from_intermediate_queue:
                # RQ's start transaction (skipped now) takes the id out of the intermediate
                # list; left there, the job read "taken from the queue by a worker that stopped
                # before starting it" until a reaper pass (RQ's maintenance: failed it again)
                self.connection.lrem(
                    make_queue(job.origin, self.connection).intermediate_queue_key, 1, job.id)
            raise
        job.meta["attempt"] = int(job.meta.get("attempt", 0)) + 1
        job.meta.pop("retry_after", None)
        super().prepare_job_execution(job, remove_from_intermediate_queue)  # PayrunJob writes meta + event
        events.log_emitted(job.id, "running", attempt=job.meta["attempt"], worker=self.name)

    def _classify_exception(self, job: Job, exc_type, exc_value, tb) -> bool:
        if isinstance(exc_value, ClaimLost) and self._taken_over(job):
            job._taken_over = True  # handle_job_failure lets it go; its meta is not ours to save
            return False
        verdict = classify(exc_value)
        if isinstance(exc_value, DeserializationError):  # (a lane's; a render worker's: fail_unreadable)
            job._unreadable = True
        job._held_try = False
        job.meta["last_error"] = events.one_line(verdict.reason)
        job.meta["error_attempt"] = job.meta.get("attempt")
        # (`payrun failed`: fix the data before a retry; a missing slip file is not the data's)
        job.meta["permanent"] = not verdict.transient and verdict.on_data
        job.meta["slip_missing"] = isinstance(exc_value, SlipMissing)  # (a retry renders it again first)
        if verdict.retry_after_s:
            job.meta["retry_after"] = verdict.retry_after_s
        if not verdict.transient:
            job.retries_left = 0
        elif (isinstance(exc_value, (ProviderDown, RefusedHere))
              and not outage_hold_is_free(int(job.meta.get("outage_holds", 0)))):
            # held back by outages OUTAGE_HOLDS_PER_JOB times: a message the provider fails
            # every time, not an outage any more; this one spends its attempt
            job.meta["last_error"] = events.one_line(f"{verdict.reason} (held {job.meta.get('outage_holds')} times "
                                               "already: this attempt counts)")
        elif isinstance(exc_value, StoreHeld) and not store_full_hold_is_free(int(job.meta.get("store_full_holds", 0))):
            # held for a full or unwritable slip store STORE_FULL_HOLDS_PER_JOB times (hours): this one
            # spends its attempt, and the job reaches the failed list in the end
            job.meta["last_error"] = events.one_line(f"{verdict.reason} (held {job.meta.get('store_full_holds')} "
                                                     "times already: this attempt counts)")
        elif isinstance(exc_value, Throttled):
            # waiting for the provider's limit is not a failed attempt: RQ's retry takes
            # one from the budget, we give it back (and keep the backoff where it was)
            job.retries_left = (job.retries_left or 0) + 1
            job.meta["budget_start"] = int(job.meta.get("budget_start", 0)) + 1
            job.meta["held"] = int(job.meta.get("held", 0)) + 1  # tries that spent no attempt
            # handle_job_failure runs next in this process on this job object (RQ's
            # perform_job); a parent that finds its horse dead has a fresh one: not held
            job._held_try = True
            if isinstance(exc_value, (ProviderDown, RefusedHere)):  # (one host refused: bounded alike)
                job.meta["outage_holds"] = int(job.meta.get("outage_holds", 0)) + 1
            if isinstance(exc_value, StoreHeld):
                job.meta["store_full_holds"] = int(job.meta.get("store_full_holds", 0)) + 1
        # a held try goes back to the front of its queue when its wait is over (RQ's retry
        # and scheduler read this flag), not behind a large run's every other send: it was
        # at the front when the provider held it back. A failed attempt waits at the back.
        # A send waiting for its slip's render waits at the back: it was not held back by the
        # provider, and going to the front every few seconds would put it ahead of a run.
        job.enqueue_at_front_on_retry = job._held_try and not isinstance(exc_value, RenderPending)
        job.save_meta()
        return True

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry) -> None:
        """RQ's handle_job_success (rq 2.12, worker/base.py) in one transaction, without
        its WATCH and SMEMBERS round trips for dependent jobs: payrun enqueues none. The
        transaction still asks whether the dependents key exists; if some other client did
        register a dependent, RQ's own enqueue_dependents runs after it. (One registered
        later sees this job finished, set in the same transaction, and RQ enqueues it at
        once.) A job with repeats left goes through RQ's method unchanged."""
        job._done_emitted = False
        if job.repeats_left is not None and job.repeats_left > 0:
            super().handle_job_success(job, queue, started_job_registry)
        else:
            with self.connection.pipeline() as pipe:
                self._success_in(job, pipe)
                has_dependents = pipe.execute()[-1]
            if has_dependents:
                queue.enqueue_dependents(job)
        self._say_done(job)

    def _success_in(self, job: Job, pipe) -> None:
        """What handle_job_success writes for a job with no repeats left, queued on ``pipe``
        (a transaction), its last command the EXISTS of the job's dependents key (the
        caller enqueues them if its reply is 1); ``self.execution`` is the job's."""
        job._done_emitted = False
        self.increment_successful_job_count(pipeline=pipe)
        self.increment_total_working_time(job.ended_at - job.started_at, pipe)
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        if result_ttl != 0:
            execution = getattr(self, "execution", None)
            job._handle_success(
                result_ttl, pipeline=pipe, worker_name=self.name,
                execution_id=execution.id if execution else None,
                execution_started_at=execution.created_at if execution else None,
                execution_ended_at=job.ended_at,
            )
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        self.cleanup_execution(job, pipeline=pipe)
        pipe.exists(job.dependents_key)

    def _say_done(self, job: Job) -> None:
        """The job's "done" line (its event went with the success's transaction), or the
        event itself when RQ wrote no success record (result_ttl 0)."""
        if getattr(job, "_done_emitted", False):
            took = (job.ended_at - job.started_at).total_seconds() if job.ended_at and job.started_at else None
            events.log_emitted(job.id, "done", duration_s=took, attempt=job.meta.get("attempt"))
        else:  # result_ttl = 0: RQ skips _handle_success
            events.emit(self.connection, job.id, "done", attempt=job.meta.get("attempt"))

    def _taken_over(self, job: Job) -> bool:
        """Whether this try's execution is gone from its queue's started registry: the
        reaper returned the job while this worker stalled (its liveness or lease ran
        out), and the job is back in its queue or another worker's."""
        execution = getattr(self, "execution", None)
        if execution is None:
            return False
        return self.connection.zscore(job.started_job_registry.key, f"{job.id}:{execution.id}") is None

    def _let_go(self, job: Job) -> None:
        """End a try the reaper took over (ClaimLost, ``_taken_over``): its execution
        record goes, and nothing else is touched: no retry, no failure, no ledger event,
        no meta saved (the job's state belongs to the try the reaper made way for)."""
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job, pipeline=pipe)  # (the worker's current job too)
            pipe.execute()
        log.warning("Worker %s: job %s: this try stalled until the reaper had returned the job (and freed "
                    "its claim): it stops here unsent, and the job stays with the try that follows",
                    self.name, job.id)

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry=None, exc_string: str = "") -> None:
        if getattr(job, "_taken_over", False):
            self._let_go(job)
            return
        if job.id in self._requeue_ids:  # killed by us at the end of the grace period
            self._requeue_ids.discard(job.id)
            self.requeue_front(job, queue, f"worker {self.name} stopped: not finished within the {self.grace_s:g} s grace")
            return
        job.meta = job.get_meta(refresh=True)  # the horse may have died holding newer meta
        if job.meta.get("error_attempt") != job.meta.get("attempt"):
            # no exception handler ran for this attempt: the horse was killed (timeout in C code)
            job.meta["last_error"] = events.one_line(exc_string or "work horse terminated")
            job.meta["error_attempt"] = job.meta.get("attempt")
            job.enqueue_at_front_on_retry = False  # a failed attempt, not held: not a held try's front place
        super().handle_job_failure(job, queue, started_job_registry, exc_string)
        status = job.get_status(refresh=True)
        if status in (JobStatus.SCHEDULED, JobStatus.QUEUED):
            # a held try stays a "retrying" event with held=1: a ledger or metrics process
            # of an older version (workers upgraded first) records it as a retry, a
            # current one as "held"
            events.emit(self.connection, job.id, "retrying", attempt=job.meta.get("attempt"),
                        error=job.meta.get("last_error"), delay=job.meta.get("last_delay"),
                        held=1 if getattr(job, "_held_try", False) else None)
        else:
            unreadable = getattr(job, "_unreadable", False)  # its data is not JSON (as fail_unreadable says)
            events.emit(self.connection, job.id, "failed", attempt=job.meta.get("attempt"),
                        error=job.meta.get("last_error"),
                        kind=(job.meta.get("kind") or "unreadable") if unreadable else None,
                        queue=queue.name if unreadable else None)


HORSE_STOP = b"stop\n"
"""What a worker writes to its warm horse to make it exit after the job in hand."""

HORSE_EXIT_S = 5.0
"""How long a worker waits for a horse it stopped (idle, it exits at once) before SIGKILL."""


def reap_within(pid: int, timeout_s: float, clock=time.monotonic, pause=time.sleep) -> bool:
    """Wait for child ``pid`` to exit, at most ``timeout_s``; then SIGKILL it and wait.
    True if it exited by itself. A worker never hangs on a horse that does not leave."""
    deadline = clock() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if clock() >= deadline:
            break
        pause(0.01)
    log.warning("work horse %s did not exit within %.0f s of being told to; killing it", pid, timeout_s)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    return False


class _RqWorkerLog:
    """RQ's logger as one worker uses it (RQ logs through ``worker.log``): everything goes
    to RQ's logger, except two messages about Redis going away, handed to the worker:
    the dequeue loop's "could not connect to Redis instance" (``on_no_redis(error,
    retry_s)``; RQ's retry, its sleep and backoff, is left as it is), and the work loop's
    "found an unhandled exception, quitting..." (with its traceback) or "Redis connection
    timeout, quitting..." when a Redis error ended it (``on_quit(error)``)."""

    RQ_NO_REDIS = "Worker %s: could not connect to Redis instance: %s retrying in %d seconds..."
    RQ_QUITTING = ("Worker %s: found an unhandled exception, quitting...", "Worker %s: Redis connection timeout, quitting...")
    """rq 2.12, Worker.dequeue_job_and_maintain_ttl and Worker.work (pinned)."""

    def __init__(self, logger: logging.Logger, on_no_redis: Callable[[object, float], None],
                 on_quit: Callable[[BaseException], None]):
        self._logger = logger
        self._on_no_redis = on_no_redis
        self._on_quit = on_quit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)

    def error(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if msg == self.RQ_NO_REDIS and len(args) == 3:
            self._on_no_redis(args[1], args[2])
            return
        if msg in self.RQ_QUITTING and isinstance(error := sys.exc_info()[1], (RedisConnectionError, RedisTimeoutError)):
            self._on_quit(error)
            return
        kwargs.setdefault("stacklevel", 2)
        self._logger.error(msg, *args, **kwargs)


class _OneOutageStory:
    """For RQ's forking Worker: its parts that meet Redis away tell one story of it
    (RedisOutageLog, ``self._outage``): its dequeue loop (RQ's ERROR "could not connect to
    Redis instance" at each try, handed over by _RqWorkerLog; back: ``heartbeat``), its
    command channel's thread (RQ's same ERROR every 2 s; back: its next read, the
    resubscription's reply), and a render or control worker's liveness thread. Each keeps
    trying on its own schedule. An idle worker logged the outage three times over."""

    max_connection_wait_time = 5.0
    """RQ's dequeue loop, meeting Redis away, waits 1, 2, 4 … s between tries, up to this
    (RQ's default: 60 s): a worker idle when Redis went took work again up to a minute after
    Redis was back (a restart of Redis mid-run, a failover), and said "Redis answers again"
    as late: the command channel, back within 2 s, does not end the story while the dequeue
    loop failed in the last OUTAGE_QUIET_S, and it says nothing more for a minute (its next
    read). `rq worker` under `payrun config rq-env` (PayrunRqWorker) kept RQ's 60 s until
    session 42. One try every 5 s per worker is nothing for Redis, and the line saying so
    is said every 30 s (RedisOutageLog)."""

    def _tell_outages_as_one(self, logger: logging.Logger = log) -> None:
        """Call at the end of ``__init__`` (RQ's ``self.log`` and ``self.name`` are set)."""
        kwargs = self.connection.connection_pool.connection_kwargs
        # (a test sets its clock)
        self._outage = RedisOutageLog(f"Worker {self.name}", redis_address(kwargs), logger=logger)
        self._outage_story = self._outage.story  # (read by each heartbeat: one lookup, as before)
        self.log = _RqWorkerLog(self.log, self._cannot_take_work, self._quit_for_redis)

    def _cannot_take_work(self, error: object, retry_s: float) -> None:
        """RQ's dequeue loop met Redis away (its ERROR "could not connect to Redis instance",
        at every try: 1, 2, 4 … s apart, for as long as Redis was away): a failed try of the
        worker's story; its success is the next heartbeat (the first thing RQ's loop does
        at each try)."""
        self._outage.failed("dequeue", error)

    def _pubsub_exception_handler(self, exc, pubsub, pubsub_thread) -> None:
        """RQ's handler for its command channel's thread (`payrun stop-worker`, RQ's
        shutdown and stop-job commands), less loud: with Redis away it logged an ERROR
        every 2 s in every worker (an ops drill: 10 lines per worker for 20 s of Redis
        stopped). It still tries every 2 s; what is said is the worker's one story."""
        if not isinstance(exc, RedisConnectionError):
            return super()._pubsub_exception_handler(exc, pubsub, pubsub_thread)
        self._outage.failed("command channel", exc)
        time.sleep(PUBSUB_RETRY_S)

    def subscribe(self) -> None:
        """RQ's, and each read of the command channel that did not fail counts as its part
        being back (after an outage, the first read reconnects and resubscribes: it returns
        at once; otherwise one read a minute, RQ's)."""
        super().subscribe()
        get_message = self.pubsub.get_message

        def get_message_told(*args: Any, **kwargs: Any):
            message = get_message(*args, **kwargs)
            self._outage.ok("command channel")
            return message

        self.pubsub.get_message = get_message_told  # (RQ's thread looks it up at each read)


class PayrunRqWorker(_OneOutageStory, Worker):
    """RQ's plain Worker with JSON, PayrunJob and PayrunQueue, whatever `rq worker` passes
    (its ``--serializer`` default is pickle: the worker's scheduler, ``--with-scheduler``,
    fetched due jobs with RQ's own Job class and unpickled their meta).
    ``RQ_WORKER_CLASS=jobs.runtime.PayrunRqWorker`` (`payrun config rq-env`) makes rq's
    commands use it; payrun's own workers are `payrun worker QUEUE`.

    Redis away is told as a render worker tells it (_OneOutageStory): RQ logged an ERROR
    at every try of its dequeue loop and every 2 s from its command channel's thread, and
    a traceback when a Redis error ended its work loop. Otherwise RQ's Worker as it is."""

    def __init__(self, *args: Any, **kwargs: Any):
        # Worker(queues, name, default_result_ttl, connection, exception_handlers,
        # maintenance_interval, default_worker_ttl, worker_ttl, job_class, queue_class,
        # log_job_description, job_monitoring_interval, disable_default_exception_handler,
        # prepare_for_work, serializer, ...) in rq 2.12 (pinned)
        args = _json_only(args, kwargs, 14)
        for position, name, cls in ((8, "job_class", PayrunJob), (9, "queue_class", PayrunQueue)):
            if len(args) > position:
                if args[position] is None:
                    args = args[:position] + (cls,) + args[position + 1:]
            elif kwargs.get(name) is None:
                kwargs[name] = cls
        super().__init__(*args, **kwargs)
        self._tell_outages_as_one(self.log)  # (RQ's logger: the one `rq worker` shows)

    def serialize(self) -> dict:
        return with_host_id(super().serialize())

    def heartbeat(self, timeout: int | None = None, pipeline=None) -> None:
        super().heartbeat(timeout, pipeline)
        if pipeline is None:  # (written: Redis answered)
            self._outage.ok("dequeue")

    def _quit_for_redis(self, error: BaseException) -> None:
        """A Redis error ended RQ's work loop: one line instead of RQ's "found an unhandled
        exception, quitting..." and its traceback. What follows is RQ's (its teardown)."""
        self._outage.log.error("Worker %s: Redis went away (%s): its work loop ends", self.name,
                               events.one_line(str(error)))


class RenderWorker(EventsMixin, _OneOutageStory, Worker):
    """A forking worker, warmed: the parent imports WeasyPrint and renders the sample slip
    in both its shapes (with and without a Bengali name) before it takes work, so its work
    horse starts warm, with both cascades kept (jobs.cascade). The parent checks deadlines every
    second while the horse runs, and can always kill it (a render hung in C code).

    ``jobs_per_horse`` > 1 keeps one horse for that many jobs instead of forking per job
    (RQ's way): a fresh fork re-copies the pages a render touches and re-walks the heap,
    about 40 ms of CPU on a 65 ms render (measured). The horse is replaced when it is
    killed (timeout, grace, second signal), when it dies, and after ``jobs_per_horse``
    jobs (so nothing a job leaves behind lives long). 1 = fork per job."""

    jobs_per_horse: int = 1

    batch: int = 1
    """Render jobs taken and started at once (``render.batch``), with a warm horse: one
    script takes them, one transaction starts them (the next batch while the last of one
    renders), and the worker finishes half that many renders in one transaction (their
    slips made durable first, each folder synced once). 1 = one at a time."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("job_monitoring_interval", 1)
        super().__init__(*args, **kwargs)
        self._tell_outages_as_one()
        self._redis_failed: BaseException | None = None
        self._grace_deadline: float | None = None
        self._timed_out: set[str] = set()
        self._liveness: Liveness | None = None
        self._to_horse: int | None = None
        self._from_horse: int | None = None
        self._horse_jobs = 0
        self._replies = b""  # what the horse wrote after its last full reply line
        self._handoff: dict | None = None  # horse: the finish of the job just run, for the worker
        # worker: renders handed over, not finished yet (up to ``batch`` of them), and those being finished
        self._rendered: list[tuple[Job, Queue, Execution | None, dict]] = []
        self._finishing: list[tuple[Job, Queue, Execution | None]] = []
        # worker: jobs started with its batch behind the one in hand (not handed to the horse yet)
        self._behind: collections.deque[tuple[Job, Queue, Execution]] = collections.deque()
        self._held_execution: Execution | None = None  # worker, meanwhile: the execution of the job in hand
        self._took_at_once = False  # the last dequeue was _take_at_once's (it checked suspension)
        self._parent_pid = os.getpid()  # the worker: a horse dies with it (die_with_parent)

    # ---- a horse that serves several jobs ---------------------------------------------
    def fork_work_horse(self, job: Job, queue: Queue) -> None:
        if self.jobs_per_horse <= 1:
            return super().fork_work_horse(job, queue)
        if not self._horse_pid:
            self._spawn_horse()
        started = job.__dict__.pop("_started_hash", None)  # (a batch's: the horse needs no fetch)
        item = [job.id, queue.name, self.execution.id]
        if started is not None:
            ex = self.execution
            item.append({"job": started, "execution": [ex.created_at.timestamp(), ex.last_heartbeat.timestamp(),
                                                       ex.worker_name]})
        line = json.dumps(item).encode() + b"\n"
        try:
            os.write(self._to_horse, line)
        except OSError:  # it died between jobs: a new one takes this job
            self._reap_horse()
            self._spawn_horse()
            os.write(self._to_horse, line)

    def prepare_execution(self, job: Job) -> Execution:
        """With a warm horse, the worker starts the job itself, before it hands it over: RQ
        writes the execution record and the busy state here (rq 2.12,
        executions.prepare_execution), then the horse writes the start in a transaction of
        its own (prepare_job_execution). Here both are one transaction (the lane's way:
        ``PayrunJob.prepare_for_execution``), and the horse, which reads the job after it,
        writes nothing before it runs: one round trip less per render. The records are the
        same; the job reads started, and its attempt is counted, from the moment it is
        handed over (a horse that dies before it runs spends that attempt, as one that dies
        while running does)."""
        if self.jobs_per_horse <= 1:
            return super().prepare_execution(job)
        started = job.__dict__.pop("_batch_execution", None)
        if started is not None:  # started with its batch (_take_batch)
            self.execution = started
            return started
        self.execution = None
        job._execution_for = self
        self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
        return self.execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        if self._is_horse and self.jobs_per_horse > 1:
            return  # started by the worker (prepare_execution); the fetched job says so
        super().prepare_job_execution(job, remove_from_intermediate_queue)

    def main_work_horse(self, job: Job, queue: Queue) -> None:  # RQ's fork-per-job horse
        die_with_parent(self._parent_pid)
        super().main_work_horse(job, queue)

    def _spawn_horse(self) -> None:
        parent_r, horse_w = os.pipe()
        horse_r, parent_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the horse never returns into the worker's code: it exits from here
            code = 1
            try:
                os.setpgrp()
                die_with_parent(self._parent_pid)
                os.close(parent_r)
                os.close(parent_w)
                self._horse_loop(horse_r, horse_w)
                code = 0
            finally:
                os._exit(code)
        os.close(horse_r)
        os.close(horse_w)
        self._horse_pid, self._to_horse, self._from_horse, self._horse_jobs = pid, parent_w, parent_r, 0
        self.procline(f"Forked horse {pid} for up to {self.jobs_per_horse} jobs")

    def _horse_loop(self, r: int, w: int) -> None:
        """In the horse: one job per line from the parent, one reply line per job: ``1``
        (done: RQ recorded its end), or ``p`` and what is left of a render that handed its
        finish over (jobs.tasks.hand_finish_over): the worker finishes it
        (``_finish_rendered``) while this horse renders the next slip."""
        import random

        from jobs import tasks

        random.seed()
        self.setup_work_horse_signals()
        self._is_horse = True
        tasks.hand_finish_over(True)
        with os.fdopen(r, "rb") as lines:
            for line in lines:
                if line == HORSE_STOP:
                    return
                job_id, queue_name, execution_id, *given = json.loads(line)
                self._handoff = None
                try:
                    job, self.execution = self._fetch_for_horse(job_id, execution_id, *given)
                    queue = make_queue(queue_name, self.connection)
                    self.perform_job(job, queue)
                except BaseException:  # noqa: BLE001 - like RQ's horse: exit, the parent handles it
                    os._exit(1)
                reply = b"1\n" if self._handoff is None else b"p " + json.dumps(self._handoff).encode() + b"\n"
                try:
                    os.write(w, reply)
                except OSError:  # the worker is gone (killed): this job is done, stop here
                    return

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry) -> None:
        """In a warm horse, a render that handed its finish over is not done yet: what is
        left goes to the worker with the reply (``_horse_loop``), and the worker records the
        end once it has finished it (``_finish_rendered``)."""
        from jobs import tasks

        if self._is_horse and isinstance(job._result, dict) and tasks.FINISH_KEY in job._result:
            self._handoff = {"result": job._result}
            return
        super().handle_job_success(job, queue, started_job_registry)

    def _finish_rendered(self, due_only: bool = False) -> None:
        """Finish the renders the horse handed over (jobs.tasks.finish_render: each slip made
        durable and put in place, its send enqueued), then record their ends as the horse
        would have: success, or RQ's failure handling (retry or failed) for one whose
        finish raised. Called with the next job already handed to the horse (so the syncs
        are waited out beside its render: ``due_only``, once half a batch of renders
        wait, or none is left to hand over), before waiting for work, and on the way out.
        (Half a batch: a batch's 16 finishes at once, with the next batch's take beside
        them, took longer than the render they were hidden behind, 30-50 ms of a ~37 ms
        render, and the horse waited; in halves it waits ~0.5 ms a slip, session 46.) With
        ``batch`` > 1 the slips are made durable and put in place (each folder synced
        once: jobs.tasks.commit_renders), then their sends and successes are written in
        one transaction.

        The jobs count as in hand meanwhile (a SIGTERM waits for them); a second SIGTERM
        hands them back unfinished (``request_force_stop``)."""
        from jobs import tasks

        if not self._rendered or (due_only and len(self._rendered) < (self.batch + 1) // 2 and self._behind):
            return
        mine, held = self.execution, self.in_hand
        self._finishing, self._held_execution = [r[:3] for r in self._rendered], mine  # (before they leave
        rendered, self._rendered = self._rendered, []                                 # _rendered: a second SIGTERM sees them)
        if held is None:
            self.in_hand = rendered[0][:2]
        try:
            batched = self.batch > 1 and tasks._email_enqueuer(self.connection, tasks.settings()) is not None
            durable = []
            # (a render job has no repeats: RQ's path, finish_render, for one that has)
            ones = [r[3]["result"] for r in rendered if batched and not r[0].repeats_left]
            commit_errors = iter(tasks.commit_renders(self.connection, ones) if ones else ())
            for job, queue, execution, handed in rendered:
                self.execution = execution
                try:
                    if batched and not job.repeats_left:
                        if (error := next(commit_errors)) is not None:
                            raise error.with_traceback(None)  # (one folder's error is several slips')
                        durable.append((job, queue, execution, handed))
                        continue
                    result = tasks.finish_render(self.connection, handed["result"])
                except Exception:  # noqa: BLE001 - as RQ's perform_job handles a job's own error
                    # (less its failure callback: a render job has none)
                    exc_info = sys.exc_info()
                    job._status = JobStatus.FAILED
                    self.handle_execution_ended(job, queue, job.failure_callback_timeout)
                    self.handle_exception(job, *exc_info)
                    self.handle_job_failure(job=job, queue=queue, started_job_registry=queue.started_job_registry,
                                            exc_string="".join(traceback.format_exception(*exc_info)))
                    continue
                self.handle_execution_ended(job, queue, job.success_callback_timeout)
                job._result = result
                job._status = JobStatus.FINISHED
                self.handle_job_success(job, queue, queue.started_job_registry)  # (logs "job <id> done")
            if durable:
                self._succeed_rendered(durable, held)
        finally:
            self._finishing, self._held_execution = [], None
            self.execution = mine
            self.in_hand = held

    def _succeed_rendered(self, durable: list[tuple[Job, Queue, Execution | None, dict]],
                          held: tuple[Job, Queue] | None) -> None:
        """The sends of renders whose slips are durable, and their successes, in one
        transaction (one round trip for the batch, not two per slip)."""
        from jobs import tasks

        cfg = tasks.settings()
        sends, exists_at = [], []
        with self.connection.pipeline() as pipe:
            for job, queue, execution, handed in durable:
                sends.append(tasks.enqueue_email_in(pipe, self.connection, cfg, handed["result"][tasks.FINISH_KEY]["email"]))
                self.execution = execution
                self.handle_execution_ended(job, queue, job.success_callback_timeout)
                job._result = tasks.finished_render(handed["result"])
                job._status = JobStatus.FINISHED
                self._success_in(job, pipe)
                exists_at.append(len(pipe) - 1)  # (the EXISTS of its dependents key)
            if held is not None:  # (each success cleared the worker's current job: it is the one in hand)
                self.set_current_job_id(held[0].id, pipeline=pipe)
            replies = pipe.execute()
        for (job, queue, _, _), send, at in zip(durable, sends, exists_at):
            if send is not None:
                events.log_emitted(send[0], "queued", **send[1])
            if replies[at]:
                queue.enqueue_dependents(job)
            self._say_done(job)

    def set_current_job_id(self, job_id: str | None = None, pipeline=None) -> None:
        if job_id is None and self._finishing and self.in_hand is not None \
                and all(self.in_hand[0] is not f[0] for f in self._finishing):
            return  # a finish after the next job started: the worker's current job is that one
        super().set_current_job_id(job_id, pipeline)

    def _fetch_for_horse(self, job_id: str, execution_id: str, given: dict | None = None) -> tuple[Job, Execution]:
        """RQ's ``Job.fetch`` and ``Execution.fetch`` (rq 2.12: HGETALL each, the same
        errors when either is gone) in one round trip instead of two; none for a job its
        worker started with a batch: ``given`` holds the job's hash as that start left it
        (``_take_batch``) and its execution's fields."""
        execution = Execution(id=execution_id, job_id=job_id, connection=self.connection)
        if given is not None:
            raw_job = {k.encode("latin-1"): v.encode("latin-1") for k, v in given["job"].items()}
            created, beat, worker = given["execution"]
            raw_execution = {b"created_at": created, b"last_heartbeat": beat, b"worker_name": worker.encode()}
        else:
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.job_class.key_for(job_id))
                pipe.hgetall(execution.key)
                raw_job, raw_execution = pipe.execute()
        if not raw_job:
            raise NoSuchJobError(f"No such job: {self.job_class.key_for(job_id)}")
        job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)
        job.restore(raw_job)
        if not raw_execution:
            raise ValueError(f"Execution {execution_id} not found in Redis")
        execution.created_at = datetime.fromtimestamp(float(raw_execution[b"created_at"]), tz=timezone.utc)
        execution.last_heartbeat = datetime.fromtimestamp(float(raw_execution[b"last_heartbeat"]), tz=timezone.utc)
        execution.worker_name = raw_execution.get(b"worker_name", b"").decode()
        return job, execution

    def _read_reply(self) -> bytes:
        """The horse's next reply line (without its newline); b"" if the horse is gone."""
        while b"\n" not in self._replies:
            chunk = os.read(self._from_horse, 65536)
            if not chunk:
                self._replies = b""
                return b""
            self._replies += chunk
        line, _, self._replies = self._replies.partition(b"\n")
        return line

    def _reap_horse(self) -> None:
        self._replies = b""
        for fd in (self._to_horse, self._from_horse):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._to_horse = self._from_horse = None
        if self._horse_pid:
            reap_within(self._horse_pid, HORSE_EXIT_S)
        self._horse_pid = 0

    def monitor_work_horse(self, job: Job, queue: Queue) -> None:
        if self.jobs_per_horse <= 1:
            return super().monitor_work_horse(job, queue)
        import select

        job.started_at = utcnow()
        self._finish_rendered(due_only=True)  # the jobs before, while the horse renders this one
        if self.batch > 1:
            self._take_ahead()  # (the last of its batch: the next batch meanwhile)
        long_job = False
        while True:
            ready, _, _ = select.select([self._from_horse], [], [], self.job_monitoring_interval)
            if ready:
                reply = self._read_reply()
                break
            long_job = True
            if self._behind and self._stop_requested:  # SIGTERM: the jobs behind this one go back now
                self._give_back_behind("it is stopping (SIGTERM) and had not begun them")
            self.set_current_job_working_time((utcnow() - job.started_at).total_seconds())
            self.maintain_heartbeats(job)  # may kill the horse: the read then sees EOF
        if long_job:  # (the horse sets it to 0 as each job starts: a job under a second never moved it)
            self.set_current_job_working_time(0)
        if reply.startswith(b"p "):
            self._rendered.append((job, queue, self.execution, json.loads(reply[2:])))
        if reply.startswith((b"1", b"p ")):
            self._horse_jobs += 1
            if self._horse_jobs >= self.jobs_per_horse:
                self._stop_horse()
            return
        # the horse died with the job in hand (killed by us or by the OS, or crashed)
        pid = self._horse_pid
        self._reap_horse()
        try:
            status = job.get_status()
        except Exception:  # noqa: BLE001 - finished and expired already
            return
        if status not in (JobStatus.FINISHED, JobStatus.FAILED):
            job.ended_at = utcnow()
            self.handle_work_horse_killed(job, pid, None, None)
            self.handle_job_failure(job, queue=queue, exc_string=f"Work-horse {pid} terminated unexpectedly")

    def _stop_horse(self) -> None:
        if self._to_horse is not None:
            # Say so, do not count on EOF: a process forked from this worker while the
            # horse lived (RQ's scheduler, taken over from a stopped worker) holds a copy
            # of this pipe's write end, so closing ours is no EOF (a worker hung here).
            try:
                os.write(self._to_horse, HORSE_STOP)
            except OSError:  # it is gone already
                pass
            os.close(self._to_horse)
            self._to_horse = None
        self._reap_horse()

    def wait_for_horse(self):
        if self.jobs_per_horse <= 1:
            return super().wait_for_horse()
        pid = self._horse_pid
        self._reap_horse()
        return pid, None, None

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        from jobs import slip

        started = time.monotonic()
        slip.tune_gc()
        if self.jobs_per_horse > 1:  # (a fork per job keeps nothing between renders; its forks would copy more)
            slip.tune_malloc()
        slip.warm_up()
        # Everything alive now (WeasyPrint, fonts, the parsed template and CSS) is moved out
        # of the collector's sight: otherwise the first collection in each forked child walks
        # it all and the kernel copies those pages (~25 ms of CPU per render, measured).
        gc.collect()
        gc.freeze()
        log.info("Worker %s: WeasyPrint warmed in %.2f s", self.name, time.monotonic() - started)
        self._liveness = Liveness(self.connection, [self.name], outage=self._outage).start()
        register_queues(self.connection, self.queues)
        try:  # the first render worker names the slip store (`payrun up --role worker` checks it)
            from jobs import tasks
            from payrun import slipstore

            slipstore.claim(self.connection, tasks.settings().slips_dir)
        except Exception as e:  # noqa: BLE001 - a convenience for the next host's check, never a reason not to work
            log.warning("Worker %s: could not name the slip store: %s", self.name, e)
        super().bootstrap(*args, **kwargs)

    def teardown(self) -> None:
        if not self.is_horse and self._rendered:
            job_ids = ", ".join(r[0].id for r in self._rendered)
            try:
                self._finish_rendered()
            except Exception as e:  # noqa: BLE001 - Redis down: they stay started, the reaper returns them
                log.warning("Worker %s: could not finish %s on the way out: %s", self.name, job_ids, e)
        if not self.is_horse:
            self._give_back_behind("it is stopping and had not begun them")
        if not self.is_horse and self._horse_pid and self.jobs_per_horse > 1:
            self._stop_horse()
        if not self.is_horse:
            return_stranded(self.connection, [q.name for q in self.queues], self.name)
        try:
            super().teardown()
        except (RedisConnectionError, RedisTimeoutError) as e:  # RQ's register_death: Redis away
            if self.is_horse:
                raise
            self._redis_failed = self._redis_failed or e
            log.warning("Worker %s: could not record its exit, Redis is away: its record lapses by itself",
                        self.name)
        if self._liveness is not None and not self.is_horse:
            self._liveness.stop()

    def request_stop(self, signum, frame) -> None:
        if self._grace_deadline is None:
            self._grace_deadline = shutdown_deadline(time.monotonic(), self.grace_s)
            if self.horse_pid:
                log.info("Worker %s: SIGTERM: finishing the job in hand (grace %g s), taking no more",
                         self.name, self.grace_s)
        super().request_stop(signum, frame)

    def request_force_stop(self, signum, frame) -> None:
        """Second SIGTERM: hand the job back now, then exit. The job in hand may not have
        reached a horse yet (both signals right after the dequeue), or may have just
        finished in it: it goes back unless RQ already recorded its end. So does a render
        the horse handed over that this worker has not finished (``_finish_rendered``):
        its slip is rendered again."""
        # (job, queue, its execution): the job in hand, and a render handed over but not
        # finished (being finished now, or waiting for it)
        # (in the order they were taken: they go back to the front of their queue in it)
        unfinished = list(self._finishing) + [r[:3] for r in self._rendered]
        if self._finishing:
            if self.in_hand is not None and all(self.in_hand[0] is not f[0] for f in self._finishing):
                unfinished.append((*self.in_hand, self._held_execution))
        elif self.in_hand is not None:
            unfinished.append((*self.in_hand, self.execution))
        unfinished.extend(self._behind)  # started with their batch, never handed over
        self._behind.clear()
        if unfinished and self.horse_pid:
            self.kill_horse()
            self.wait_for_horse()
        for job, queue, execution in reversed(unfinished):  # (the last first: each goes to the front)
            try:
                status = job.get_status(refresh=True)
            except Exception:  # noqa: BLE001 - gone (expired): nothing to hand back
                status = None
            if status in (JobStatus.QUEUED, JobStatus.STARTED):
                self.execution = execution  # (requeue_front removes this job's own execution record)
                self.requeue_front(job, queue, f"worker {self.name} stopped at once (second signal)")
        if self._liveness is not None:
            self._liveness.stop()
        raise SystemExit(0)

    # Between two renders RQ's loop sends ~7 round trips besides the start's own: the
    # suspension check, the worker's state set idle (busy again at the start), the drain
    # check (twice: before and after a wait), the move, the job's fetch, the working-time
    # reset. While jobs are waiting, one script does what matters of it (the drain and
    # suspension checks, RQ's move into the intermediate list, the job's hash); the
    # state stays busy, and is set idle only when the worker does wait for work.
    # KEYS: drained set, suspension key, the queue, its intermediate list, the queue's
    # workers; ARGV: the queue's name, the job key prefix, K. Up to K jobs (render.batch),
    # and no more than this worker's share of those waiting (their number over the queue's
    # workers, rounded up: a queue's last jobs are spread over its workers, not left to
    # one). {id, hash, id, hash, ...}: taken; {}: closed, or empty. A job whose hash expired
    # while queued is skipped (RQ's dequeue does too) and dropped; after 100 of those the
    # script stops (with {}: RQ's dequeue goes on) rather than hold Redis for a queue full
    # of them.
    _TAKE_K = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return {} end
local share = math.ceil(redis.call('LLEN', KEYS[3]) / math.max(1, redis.call('SCARD', KEYS[5])))
local out, k, skipped = {}, math.max(1, math.min(tonumber(ARGV[3]), share)), 0
while #out < 2 * k and skipped < 100 do
  local id = redis.call('LMOVE', KEYS[3], KEYS[4], 'LEFT', 'RIGHT')
  if not id then break end
  local h = redis.call('HGETALL', ARGV[2] .. id)
  if #h > 0 then out[#out + 1] = id; out[#out + 1] = h
  else redis.call('LREM', KEYS[4], 1, id); skipped = skipped + 1 end
end
return out
"""

    def _take_at_once(self) -> tuple[Job, Queue] | None:
        """The next job of the worker's one queue, if one is waiting and intake is open,
        in one round trip (RQ's non-blocking dequeue of one queue: LMOVE into its
        intermediate list, then the job). None: RQ's dequeue, with its wait, decides.
        With ``batch`` > 1, the next job started with the last batch, or a new batch
        (``_take_batch``)."""
        self._took_at_once = False
        if self._behind and not self._stop_requested:
            job, queue, job._batch_execution = self._behind.popleft()
            self._took_at_once = True
            return job, queue
        queues = self._ordered_queues
        if self._stop_requested or len(queues) != 1 or get_version(self.connection) < (6, 2, 0):
            return None
        queue = queues[0]
        self.heartbeat()  # (at most once a second; it also looks after RQ's scheduler)
        if self.batch > 1 and self.jobs_per_horse > 1:
            return self._take_batch(queue)
        # (a Redis error goes up to RQ's work loop, as one in the drain check does: the worker
        # exits non-zero and its supervisor starts it again)
        while True:
            got = self._take(queue, 1)
            if not got:
                return None
            job_id, flat = got[0].decode(), got[1]
            job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)
            raw = dict(zip(flat[::2], flat[1::2]))
            try:
                job.restore(raw)
                break
            except NoSuchJobError:  # a hash with no `data` (RQ's restore says so this way): never runnable
                self.fail_unreadable(job_id, queue, NO_DATA, raw_meta=raw.get(b"meta"))
        job.redis_server_version = self.get_redis_server_version()
        # RQ's line for a dequeue, at debug: the job's "running" line follows at once (one
        # line per job less in a worker's log: 50,000 a month, ~0.1 ms of its CPU each)
        self.log.debug("Worker %s: %s: %s", self.name, queue.name, job.id)
        self._took_at_once = True
        return job, queue

    def _take(self, queue: Queue, k: int) -> list:
        """``_TAKE_K``'s answer for up to ``k`` jobs of ``queue``."""
        if getattr(self, "_take_script", None) is None:
            self._take_script = self.connection.register_script(self._TAKE_K)
        return self._take_script(keys=[keys.PAUSED_QUEUES, WORKERS_SUSPENDED, queue.key, queue.intermediate_queue_key,
                                       WORKERS_BY_QUEUE_KEY % queue.name],
                                 args=[queue.name, self.job_class.redis_job_namespace_prefix, k])

    def _take_batch(self, queue: Queue, ahead: bool = False) -> tuple[Job, Queue] | None:
        """Take up to ``batch`` jobs of ``queue`` in one script and start them in one
        transaction (for each what the start of one writes: its execution, the started
        registry's lease, the job's status, attempt and ``running`` event); the first is
        returned, the others wait in ``_behind`` for the horse, their leases renewed with
        the job in hand's (``maintain_heartbeats``). None: no job taken. ``ahead``: taken
        while the job in hand renders (``_take_ahead``): all of them wait in ``_behind``,
        and the worker's current job stays the one in hand."""
        got = self._take(queue, self.batch)
        jobs = []
        for i in range(0, len(got or ()), 2):
            job_id, flat = got[i].decode(), got[i + 1]
            job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)
            raw = dict(zip(flat[::2], flat[1::2]))
            try:
                job.restore(raw)
                job._started_hash = raw  # (with the start's fields below: what the horse would fetch)
                job.func_name  # (data that is not JSON: DeserializationError)
            except NoSuchJobError:  # a hash with no `data` (RQ's restore says so this way): never runnable
                self.fail_unreadable(job_id, queue, NO_DATA, raw_meta=raw.get(b"meta"))
                continue
            except DeserializationError as e:
                self.fail_unreadable(job_id, queue, unreadable_reason(e), job=job, never_started=True)
                continue
            jobs.append(job)
        if not jobs:
            return None
        started = []
        with self.connection.pipeline() as pipe:
            for job in jobs:  # (EventsMixin.prepare_job_execution, RQ's prepare_execution and its start, each)
                job.meta["attempt"] = int(job.meta.get("attempt", 0)) + 1
                job.meta.pop("retry_after", None)
                ttl = self.get_heartbeat_ttl(job)
                execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
                job.heartbeat(utcnow(), ttl, pipeline=pipe)
                job.prepare_for_execution(self.name, pipeline=pipe)
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                started.append((job, queue, execution))
            if not ahead:
                self.set_current_job_id(jobs[0].id, pipeline=pipe)
                self.set_current_job_working_time(0, pipeline=pipe)
            elif self.in_hand is not None:  # (the job in hand: the one the worker reads busy with)
                self.set_current_job_id(self.in_hand[0].id, pipeline=pipe)
            self.heartbeat(self.get_heartbeat_ttl(jobs[0]), pipeline=pipe)
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            pipe.execute()
        self._behind.extend(started)  # held from the moment they are started (a second SIGTERM hands them back)
        version = self.get_redis_server_version()
        for job, _, _ in started:
            job.redis_server_version = version
            # the hash as the start left it (PayrunJob.prepare_for_execution's fields), for the horse
            raw = {k.decode("latin-1"): v.decode("latin-1") for k, v in job._started_hash.items()}
            raw.update(status=JobStatus.STARTED.value, started_at=utcformat(job.started_at),
                       last_heartbeat=utcformat(job.last_heartbeat), worker_name=self.name,
                       meta=self.serializer.dumps(job.meta).decode("latin-1"))
            job._started_hash = raw
            events.log_emitted(job.id, "running", attempt=job.meta["attempt"], worker=self.name)
        if ahead:
            return None
        job, queue, job._batch_execution = self._behind.popleft()
        self._took_at_once = True
        return job, queue

    def _take_ahead(self) -> None:
        """With the last job of its batch in the horse, take and start the next batch now
        (``_take_batch``, ``ahead``): the horse gets its next job as soon as it replies.
        Taken after its reply, the take's and the start's round trips kept the horse
        waiting ~7-15 ms at every batch's edge (~1 % of the pool, session 46). Only where
        the worker's next dequeue would take a batch at once (one queue open to it, no
        stop asked, its slip store writable). A Redis error here is left to that dequeue,
        between two jobs: raised here, it would end the worker with a render in the horse
        (thrown away, rendered again after the reaper's pass). Jobs the take moved and
        never started are the reaper's, as a dequeue's are."""
        if self._behind or self.batch <= 1 or self._stop_requested or len(self._ordered_queues) != 1:
            return
        try:
            if get_version(self.connection) >= (6, 2, 0) and not self._store_blocked():
                self._take_batch(self._ordered_queues[0], ahead=True)
        except (RedisConnectionError, RedisTimeoutError) as e:
            log.warning("Worker %s: could not take its next batch ahead (%s); it takes it after this job",
                        self.name, events.one_line(str(e)))

    def _give_back_behind(self, why: str) -> None:
        """Jobs started with a batch and never handed to the horse go back to the front of
        their queue, in their order, spending no attempt (requeue_front)."""
        mine = self.execution
        try:
            while self._behind:
                job, queue, execution = self._behind.pop()  # (last first: each goes to the front)
                self.execution = execution
                try:
                    self.requeue_front(job, queue, f"worker {self.name}: {why}")
                except Exception as e:  # noqa: BLE001 - Redis away: the reaper returns it (lease, liveness)
                    log.warning("Worker %s: could not give %s back: %s", self.name, job.id, e)
        finally:
            self.execution = mine

    def check_for_suspension(self, burst: bool) -> None:
        if self._took_at_once:
            return  # the take about to run checks `rq suspend` itself, in its script
        super().check_for_suspension(burst)

    def set_state(self, state: str, pipeline=None) -> None:
        if state == WorkerStatus.IDLE and pipeline is None and self.in_hand is not None:
            return  # RQ's "idle" at the end of each job: written by the dequeue if it has to wait
        super().set_state(state, pipeline)

    def _shutdown(self) -> None:
        """RQ's rule for SIGTERM: a busy worker finishes its job, any other stops at once
        (StopRequested, wherever it is; a job it had just taken goes back at teardown).
        Between two jobs this worker's state still reads busy (see set_state): with no job
        in hand (and none held from its batch: those go back at teardown, by its loop's
        next stop check) it is idle, and stops at once as RQ's idle worker does, rather than take
        one more job after a wait that no longer looks at the stop request.

        The stop is also recorded in ``_stop_requested`` (RQ sets it only for a busy
        worker): StopRequested is raised wherever the main thread is, and a signal that
        lands inside a logging call (RQ's dequeue line, say) has it swallowed by the log
        handler's error handling. The worker then went on taking jobs until it was killed;
        now its loop stops at its next check."""
        if self.in_hand is None and not self._behind and self.get_state() == WorkerStatus.BUSY:
            self._state = WorkerStatus.IDLE  # (this process's view only: it is on its way out)
        self._stop_requested = True
        super()._shutdown()

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        """A job waiting in the queue is taken at once (``_take_at_once``); otherwise RQ's
        dequeue, over the queues not drained (`payrun drain --queue Q`). A drain that comes
        while the worker is blocked waiting for a job (up to SCHEDULER_CHECK_S) still holds:
        a job taken from a queue closed meanwhile goes back to its front untouched, and the
        worker waits like any drained one."""
        if self._store_blocked():  # no render can be written: take none until there is room, or it can be
            self._finish_rendered()
            self._give_back_behind("its slip store cannot take a slip now")
            while self._store_blocked():
                if self._stop_requested or timeout is None:  # None: a burst worker, done
                    return None
                self.set_state("suspended")
                self.heartbeat()
                time.sleep(1)
        taken = self._take_at_once()
        if taken is not None:
            return taken
        self._finish_rendered()  # before any wait: a render handed over is finished now
        every = self._ordered_queues
        while True:
            while not (open_ := intake_queues(self.connection, every)):
                if self._stop_requested or timeout is None:  # None: a burst worker, done
                    return None
                self.set_state("suspended")
                self.heartbeat()
                time.sleep(1)
            self._ordered_queues = open_
            job_class, self.job_class = self.job_class, DequeuedJob  # (RQ's dequeue fetches with it)
            try:
                result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except UnreadableJob as e:  # RQ's dequeue attached the queue it took it from
                self.fail_unreadable(e.job_id, e.queue, NO_DATA, raw_meta=e.raw_meta)
                continue
            finally:
                self._ordered_queues = every
                self.job_class = job_class
            if result is None or intake_queues(self.connection, [result[1]]):
                return result
            job, queue = result
            # RQ's dequeue wrote nothing but the move: LMOVE into the intermediate list (one
            # queue), or LPOP (several). Only if the id is still ours in the intermediate list
            # (a reaper or a stopping worker may have returned it meanwhile) does it go back.
            back = self._give_back(keys=[queue.intermediate_queue_key, queue.key],
                                   args=[job.id, int(len(open_) == 1 and get_version(self.connection) >= (6, 2, 0))])
            if back:
                log.info("Worker %s: intake on %s was stopped while it waited; %s stays at the front of the queue",
                         self.name, queue.name, job.id)

    STORE_LOOK_EVERY_S = 1.0
    """How often, at most, a render worker looks at its slip store's room (one statvfs)."""

    def _store_free(self) -> int | None:
        """Room left in the slip store (statvfs), None if it cannot be told."""
        from jobs.tasks import settings

        try:
            st = os.statvfs(settings().slips_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _store_full(self) -> bool:
        """Whether this pdf-render worker's slip store has no room for a slip
        (jobs.policy.STORE_ROOM_MIN_BYTES), looked at most every STORE_LOOK_EVERY_S: while
        it is full the worker takes no render, and the run's renders wait in their queue
        (a render taken would fail to write its slip and be held, at the cost of a render,
        three log lines and a ledger event a minute per slip: at 50,000 slips both cores
        busy for nothing). Said at once, every 30 s, and when there is room again."""
        from jobs.policy import STORE_ROOM_MIN_BYTES

        if any(q.name != keys.RENDER_QUEUE for q in self.queues):
            return False  # (the control worker, or one that serves other queues too)
        now = time.monotonic()
        if now < getattr(self, "_store_looked_until", 0.0):
            return self._store_was_full
        self._store_looked_until = now + self.STORE_LOOK_EVERY_S
        story = getattr(self, "_store_story", None)
        if story is None:
            story = self._store_story = RepeatedFailure(OUTAGE_LOG_EVERY_S)
        free = self._store_free()
        self._store_was_full = free is not None and free < STORE_ROOM_MIN_BYTES
        from jobs.tasks import settings

        store = settings().slips_dir
        if self._store_was_full:
            if (line := story.failed(now, f"{free // 1024:,} KiB free")) is not None:
                log.error("Worker %s: the slip store %s is full (%s): taking no render until there is room; the "
                          "renders wait in their queue, spending no attempt. Free space there (`df -h %s`; `payrun "
                          "prune --before YYYY-MM --slips`)", self.name, store, line, store)
        elif (line := story.ok(now)) is not None:
            log.warning("Worker %s: the slip store %s has room again (%s KiB free): taking renders again, %s",
                        self.name, store, f"{(free or 0) // 1024:,}", line)
        return self._store_was_full

    def _store_blocked(self) -> bool:
        """Whether no render can be written in this worker's slip store: full, or it cannot
        be written (read-only, a failing disk)."""
        return self._store_full() or self._store_unwritable()

    def _store_read_only(self) -> bool:
        """Whether the slip store's file system is mounted read-only (statvfs's ST_RDONLY)."""
        from jobs.tasks import settings

        try:
            return bool(os.statvfs(settings().slips_dir).f_flag & os.ST_RDONLY)
        except OSError:
            return False

    def _store_unwritable(self) -> bool:
        """Whether this pdf-render worker's slip store cannot be written: its file system
        went read-only (EROFS), or its disk fails (EIO), as a test write in it says
        (payrun.slipstore.probe_write). Looked at most every STORE_LOOK_EVERY_S, and with a
        test write only when there is a reason to (the mount read-only, a render of this host
        held for it: payrun.slipstore.fault_reported, or the last look failed): a healthy
        store costs a statvfs and an HGET a second. While it cannot be written the worker
        takes no render (each would fail at its write: a run of 50,000 spent every attempt
        and dead-lettered them all for one disk) and keeps this host's entry in Redis alive
        for `payrun status` and `payrun check`. Said at once, every 30 s, and when it can
        be written again."""
        from jobs.policy import errno_text, is_store_failing, store_fault_todo
        from jobs.tasks import settings
        from payrun import slipstore

        if any(q.name != keys.RENDER_QUEUE for q in self.queues):
            return False  # (the control worker, or one that serves other queues too)
        now = time.monotonic()
        failing = getattr(self, "_store_fault", None)
        if now < getattr(self, "_fault_looked_until", 0.0):
            return failing is not None
        self._fault_looked_until = now + self.STORE_LOOK_EVERY_S
        if failing is None and not self._store_read_only() and not slipstore.fault_reported(self.connection):
            return False
        store = settings().slips_dir
        story = getattr(self, "_fault_story", None)
        if story is None:
            story = self._fault_story = RepeatedFailure(OUTAGE_LOG_EVERY_S)
        err = slipstore.probe_write(store)
        if err is not None and is_store_failing(err):
            self._store_fault = err
            slipstore.report_fault(self.connection, store, err)
            if (line := story.failed(now, errno_text(err))) is not None:
                log.error("Worker %s: the slip store %s cannot be written (%s): taking no render until it can; the "
                          "renders wait in their queue, spending no attempt; %s", self.name, store, line,
                          store_fault_todo(err.errno, str(slipstore.mount_point(store))))
            return True
        self._store_fault = None
        slipstore.clear_fault(self.connection)
        if (line := story.ok(now)) is not None:
            log.warning("Worker %s: the slip store %s can be written again: taking renders again, %s",
                        self.name, store, line)
        return False

    _GIVE_BACK = """
if ARGV[2] == '1' and redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
"""

    @property
    def _give_back(self):
        if getattr(self, "_give_back_script", None) is None:
            self._give_back_script = self.connection.register_script(self._GIVE_BACK)
        return self._give_back_script


    @property
    def dequeue_timeout(self) -> int:
        # wake up every few seconds when idle, so heartbeat() can look after the scheduler
        return min(super().dequeue_timeout, SCHEDULER_CHECK_S)

    def heartbeat(self, *args: Any, **kwargs: Any) -> None:
        story = self._outage_story
        away = story.since is not None and not args and not kwargs and story.failing("dequeue")
        if away:  # RQ's dequeue found Redis away: this beat is written (not skipped), and says if it is back
            self.last_heartbeat = None
        super().heartbeat(*args, **kwargs)
        if away:
            self._outage.ok("dequeue")
        if not self.is_horse and self.scheduler is not None:
            self.ensure_scheduler()

    def _quit_for_redis(self, error: BaseException) -> None:
        """A Redis error ended RQ's work loop (Redis went away while this worker was busy, or
        between two jobs outside RQ's dequeue wait): one line, not RQ's traceback, and
        the process exits 1 (``work``) for its supervisor to start it again."""
        self._redis_failed = error
        log.error("Worker %s: Redis went away (%s): exiting for a restart (it waits for Redis as it starts); "
                  "a job it held goes back to its queue by the reaper once Redis is back", self.name,
                  events.one_line(str(error)))

    def work(self, *args: Any, **kwargs: Any) -> bool:
        worked = super().work(*args, **kwargs)
        if self._redis_failed is not None:
            raise SystemExit(1)  # (RQ's work returns: exit 0 would read as a stop asked for)
        return worked

    def maintain_heartbeats(self, job: Job) -> None:
        super().maintain_heartbeats(job)
        # the leases of the jobs it holds besides the one in hand: started with its batch and
        # waiting behind it, or rendered and waiting to be finished (up to half a batch of
        # renders: two renders killed at their timeout meanwhile outlast a lease)
        held = [(h[0], h[2]) for h in (*self._behind, *self._rendered) if h[2] is not None]
        if held:
            with self.connection.pipeline() as pipe:
                for one, execution in held:
                    execution.heartbeat(one.started_job_registry, int(self.get_heartbeat_ttl(one)), pipeline=pipe)
                pipe.execute()
        elapsed = (utcnow() - job.started_at).total_seconds() if job.started_at else 0.0
        if job.timeout and job.timeout > 0 and elapsed > job.timeout + KILL_MARGIN_S and job.id not in self._timed_out:
            log.warning("Worker %s: job %s exceeded its %s s timeout; killing its work horse", self.name, job.id, job.timeout)
            self._timed_out.add(job.id)
            self.kill_horse()
        elif self._grace_deadline is not None and time.monotonic() >= self._grace_deadline and job.id not in self._requeue_ids:
            self._requeue_ids.add(job.id)
            self.kill_horse()

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry=None, exc_string: str = "") -> None:
        if job.id in self._timed_out:
            self._timed_out.discard(job.id)
            exc_string = f"JobTimeoutException: killed after its {job.timeout} s timeout (it did not stop by itself)"
        super().handle_job_failure(job, queue, started_job_registry, exc_string)


class LaneWorker(EventsMixin, SimpleWorker):
    """One lane of a send-email process: runs jobs in its thread; timeouts from the
    process's one watchdog thread (jobs/watchdog.py), not a timer thread per job."""

    death_penalty_class = WatchdogDeathPenalty
    # Every job start already renews the worker key (RQ pipelines it with the start); a
    # send takes 1.2 s, so the plain heartbeat after it was one more round trip per send.
    heartbeat_every_s = LANE_HEARTBEAT_EVERY_S

    def _install_signal_handlers(self) -> None:  # the process's main thread owns signals
        pass

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            super().execute_job(job, queue)
        finally:
            # a timeout raised again (jobs.watchdog.REFIRE_EVERY_S) that escaped the job's
            # with-block exit before it disarmed must not fire into the lane's next work
            # (and one landing here, as this disarms, is the job's, not the lane's)
            while True:
                try:
                    WATCHDOG.disarm_thread(threading.get_ident())
                    break
                except BaseTimeoutException:
                    continue

    def set_state(self, state: str, pipeline=None) -> None:
        """RQ marks a worker idle after every job; a lane that goes straight on to the next
        stays busy in Redis (one round trip less per send) and is marked idle only when it
        waits for work (``idle()``)."""
        if state == WorkerStatus.IDLE and pipeline is None:
            return
        super().set_state(state, pipeline)

    def idle(self) -> None:
        super().set_state(WorkerStatus.IDLE)

    def own_queue(self, name: str) -> Queue:
        """This lane's Queue object for ``name``, on its own connection (built once; RQ's
        dequeue builds one per job)."""
        queues = self.__dict__.setdefault("_own_queues", {})
        if name not in queues:
            queues[name] = make_queue(name, self.connection)
        return queues[name]

    def prepare_execution(self, job: Job) -> None:
        """RQ (rq 2.12, executions.prepare_execution) writes the execution record and the
        busy state in a transaction of its own, right before the start transaction of
        prepare_job_execution. A lane has them written in that one instead
        (``PayrunJob.prepare_for_execution``): the same records, one round trip less per
        send, and nobody sees an execution whose job has not started."""
        self.execution = None
        job._execution_for = self

    def handle_exception(self, job: Job, *exc_info) -> None:
        """A timeout is raised into the lane wherever it is, possibly between a Redis
        command and its reply on the lane's own connection (``lane_connection``): drop
        that connection before anything else uses it, so no later command reads a stale
        reply. (redis-py drops it itself when the timeout lands inside the read.)"""
        if isinstance(exc_info[1], BaseTimeoutException):
            held = getattr(self.connection, "connection", None)
            if held is not None:
                held.disconnect()
        if isinstance(exc_info[1], DeserializationError):
            # data that is not JSON: one line, as a render worker's fail_unreadable says it
            # (RQ logged its traceback, "exception raised while executing (<DeserializationError>)")
            log.error("Worker %s: job %s: job data unreadable: %s: moved to the failed jobs (`payrun failed`), "
                      "not run", self.name, job.id, unreadable_reason(exc_info[1]))
            for handler in self._exc_handlers:  # (RQ's walk: _classify_exception fails it for good)
                if handler(job, *exc_info) is False:
                    break
            return
        super().handle_exception(job, *exc_info)

    def subscribe(self) -> None:  # one pubsub thread per lane would be 45 threads
        pass

    def unsubscribe(self) -> None:
        pass

    def procline(self, message: str) -> None:  # one process title, not 45
        pass


class Liveness:
    """Keeps payrun:alive:<name> for each name, TTL ALIVE_TTL_S, from a thread with its own
    Redis client (a forked horse never shares a connection pool with it)."""

    def __init__(self, conn, names: list[str], outage: "RedisOutageLog | None" = None):
        pool = conn.connection_pool
        self.conn = conn.__class__(connection_pool=pool.__class__(
            connection_class=pool.connection_class, **pool.connection_kwargs))
        self.names = list(names)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self.outage = RepeatedFailure(OUTAGE_LOG_EVERY_S)
        self.shared = outage
        """The process's story of Redis away (a render or control worker, a send-email
        process: run_lanes): a beat that cannot
        reach Redis is a failed try of it, not a `liveness:` line of its own."""

    def beat(self) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            for name in self.names:
                pipe.set(keys.alive(name), os.getpid(), ex=ALIVE_TTL_S)
            pipe.execute()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as e:  # Redis down: the key lapses, the reaper may act; keep trying
                if self.shared is not None and isinstance(e, REDIS_AWAY):
                    self.shared.failed("liveness", e)
                elif (line := self.outage.failed(time.monotonic(), e)) is not None:
                    log.warning("liveness: %s", line)  # (it said so every 2 s while Redis was away)
            else:
                if self.shared is not None:
                    self.shared.ok("liveness")
                if (line := self.outage.ok(time.monotonic())) is not None:
                    log.warning("liveness: beating again: %s", line)
            self._stop.wait(ALIVE_EVERY_S)

    def start(self) -> "Liveness":
        self.beat()
        self._thread.start()
        return self

    def stop(self, forget: bool = True) -> None:
        """Stop beating; ``forget``: delete the keys now (else they lapse by their TTL)."""
        self._stop.set()
        if not forget:
            return
        try:
            self.conn.delete(*[keys.alive(n) for n in self.names])
        except Exception:
            pass


def die_with_parent(parent_pid: int) -> None:
    """In a work horse: be killed (SIGKILL) when the worker that forked it dies. A worker
    killed with -9 (OOM killer, crash) would otherwise leave its horse running the job to
    the end, after the reaper has already returned that job to the queue: the job would
    run twice and the orphan would keep writing into Redis. Linux only (prctl
    PR_SET_PDEATHSIG); elsewhere the orphan finishes its job, as with plain RQ."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the worker died before the line above
        os._exit(1)


def return_stranded(conn, queue_names: list[str], who: str) -> None:
    """On the way out: a job this worker took from its queue but had not started (a
    SIGTERM while idle lands wherever RQ is, possibly just after its BLMOVE) goes back
    to the front now, not at the reaper's next passes."""
    from jobs import reaper

    try:
        for s in reaper.return_dequeued_now(conn, queue_names):
            log.warning("Worker %s: %s was taken but not started; returned to the front of %s", who, s.job_id, s.queue)
    except Exception as e:  # Redis down: the reaper returns it later
        log.warning("Worker %s: could not check for jobs taken but not started: %s", who, e)


def supervisor_program(env=os.environ) -> str | None:
    """The supervisord program this process is, as `supervisorctl` names it: supervisord
    sets SUPERVISOR_GROUP_NAME and SUPERVISOR_PROCESS_NAME in its children
    (``pdf-render:pdf-render-00`` for one of numprocs, ``send-email`` for a lone one);
    None when not run by supervisord."""
    name = env.get("SUPERVISOR_PROCESS_NAME", "").strip()
    if not name:
        return None
    group = env.get("SUPERVISOR_GROUP_NAME", "").strip()
    return f"{group}:{name}" if group and group != name else name


HOST_ID_FIELD = "host_id"
"""In payrun's RQ worker and scheduler records: payrun.procs.host_id() of the process's
host. A hostname alone did not tell two machines apart (containers, cloned images): a
worker starting on one judged the other's records by its own pids."""


def with_host_id(record: dict) -> dict:
    """An RQ record (a worker's ``serialize()``) with this host's id."""
    return {**record, HOST_ID_FIELD: host_id()}


def namesakes(records: list[tuple[str, dict[str, str], bool]], hostname: str, host: str) -> list[str]:
    """Of RQ worker records ``(name, hash fields, liveness key present)``, the live ones
    that bear ``hostname`` and another host id than ``host``: another machine (or
    container) with this one's hostname. Pure."""
    return [name for name, h, alive in records
            if alive and not h.get("death") and h.get("hostname") == hostname
            and h.get(HOST_ID_FIELD, host) != host]


def names_taken(conn, names: list[str]) -> str | None:
    """Why this process cannot take ``names`` (its lanes' worker names), or None: a live
    record (no death registered) already bears one, as RQ's register_birth says for one
    worker. Asked before the process beats any liveness: its lanes' threads each met
    RQ's refusal and died, and the process beat the other's liveness meanwhile. A name is
    kind.hostname.pid: another machine with this hostname whose process has this pid
    (containers started alike), or a record of this host's that outlived its process
    (a pid reused since); the process exits and its supervisord starts it again."""
    with conn.pipeline(transaction=False) as p:
        for n in names:
            p.hgetall(f"rq:worker:{n}")
        found = p.execute()
    for n, h in zip(names, found):
        if h and b"death" not in h:
            other = h[HOST_ID_FIELD.encode()].decode() if HOST_ID_FIELD.encode() in h else "?"
            return (f"There exists an active worker named {n!r} already (host id {other}, this host's "
                    f"{host_id()}): another machine with this hostname runs a process with this pid, or a "
                    "record of an exited one is left; this process exits (supervisord starts it again)")
    return None


def worker_name(kind: str, index: int | None = None) -> str:
    base = f"{kind}.{socket.gethostname()}.{os.getpid()}"
    return base if index is None else f"{base}.{index:02d}"


def dead_here(records: list[tuple[str, dict[str, str], bool]], hostname: str, own_pid: int,
              running: Callable[[int], bool], host: str | None = None) -> list[str]:
    """Of RQ worker records ``(name, hash fields, liveness key present)``, the ones of this
    host whose process is gone: same hostname and same host id (``host``: two machines or
    containers named alike have different ones, and a pid of one means nothing on the
    other; a record without one, of a payrun before session 42, goes by its hostname, as
    it did), another pid that no longer ``running``, no liveness. A send-email process whose Redis failed under its jobs exits without
    `register_death` for the lanes that held one, and they stayed listed as GONE, beside
    the restarted process's live lanes, until RQ's 480 s key expiry (console drill). A pid
    reused since by another process keeps its record until then (never one that lives).
    Pure."""
    out = []
    for name, h, alive in records:
        pid = h.get("pid", "")
        if alive or h.get("death") or h.get("hostname") != hostname or not pid.isdigit():
            continue
        if host is not None and h.get(HOST_ID_FIELD, host) != host:
            continue
        if int(pid) != own_pid and not running(int(pid)):
            out.append(name)
    return out


def worker_records(conn) -> list[tuple[str, dict[str, str], bool]]:
    """Every RQ worker record: ``(name, hash fields, liveness key present)``. Two round trips."""
    from jobs.reaper import _text

    names = sorted(_text(k).split(":", 2)[-1] for k in conn.smembers("rq:workers"))
    if not names:
        return []
    with conn.pipeline(transaction=False) as p:
        for n in names:
            p.hgetall(f"rq:worker:{n}")
            p.exists(keys.alive(n))
        res = p.execute()
    return [(n, {_text(a): _text(b) for a, b in res[2 * i].items()}, bool(res[2 * i + 1]))
            for i, n in enumerate(names)]


def hosts_named_alike(conn, hostname: str | None = None, host: str | None = None) -> str | None:
    """What to tell when a live worker bears this host's hostname and runs on another
    machine or container (another host id: ``namesakes``), or None. payrun tells their
    pids apart by host id, but people and `payrun workers` go by hostname."""
    hostname, host = hostname or socket.gethostname(), host or host_id()
    found = namesakes(worker_records(conn), hostname, host)
    if not found:
        return None
    named = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"another machine or container is also named {hostname!r}: its live workers {named} are not this "
            f"host's (host id {host}, theirs differ); payrun keeps their records and locks apart, but `payrun "
            f"ps` and the logs show both as {hostname!r} (the console and `payrun workers` add a suffix of the "
            f"host id): give each host its own hostname (README: Two hosts with one hostname)")


def forget_dead_here(conn, hostname: str | None = None, own_pid: int | None = None,
                     running: Callable[[int], bool] | None = None, host: str | None = None) -> list[str]:
    """At a worker's start: register the death of this host's workers whose process is
    gone (:func:`dead_here`), as RQ's ``register_death`` would have. Their jobs are the
    reaper's (it goes by liveness and leases, not by these records). Returns their names."""
    from payrun.procs import pid_alive
    from rq.utils import utcformat

    records = worker_records(conn)
    if not records:
        return []
    dead = dead_here(records, hostname or socket.gethostname(), os.getpid() if own_pid is None else own_pid,
                     running or pid_alive, host or host_id())
    if dead:
        fields = dict((n, h) for n, h, _ in records)
        with conn.pipeline() as p:
            for n in dead:
                p.srem("rq:workers", f"rq:worker:{n}")
                for q in filter(None, fields[n].get("queues", "").split(",")):
                    p.srem(f"rq:workers:{q}", f"rq:worker:{n}")
                p.hset(f"rq:worker:{n}", "death", utcformat(utcnow()))
                p.expire(f"rq:worker:{n}", 60)
            p.execute()
        log.info("%d worker record(s) of this host's exited processes removed: %s", len(dead),
                 ", ".join(dead[:4]) + (f" and {len(dead) - 4} more" if len(dead) > 4 else ""))
    return dead


SEND_SWITCH_INTERVAL_S = 0.001
"""GIL switch interval in a send-email process (Python's default is 5 ms)."""

IDLE_POLL_S = 0.05
"""How often a send-email process looks for work (one pipelined LLEN per queue, plus the
drain and suspend flags) on behalf of all its idle lanes."""

IDLE_HEARTBEAT_S = 30.0
"""An idle lane renews its RQ worker key (`rq info`) this often; liveness is separate."""


def _open(queues: list[Queue], paused_raw) -> list[Queue]:
    """``queues`` less those in the drained set (SMEMBERS payrun:paused-queues)."""
    paused = {m.decode() if isinstance(m, bytes) else m for m in paused_raw}
    return [q for q in queues if q.name not in paused]


def intake_queues(conn, queues: list[Queue]) -> list[Queue]:
    """The queues a worker may take from now: those not drained by `payrun drain --queue`;
    none while everything is drained (`payrun drain`, RQ's suspension). One round trip."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.smembers(keys.PAUSED_QUEUES)
        pipe.exists(WORKERS_SUSPENDED)
        paused, suspended = pipe.execute()
    return [] if suspended else _open(queues, paused)


class RepeatedFailure:
    """When to log a failure that repeats every second (Redis away: the intake looks again
    each second and logged "cannot look for work" each time, 60 lines a minute per
    send-email process): the first at once, then one line every ``every_s`` with how many
    looks failed since, and one line when a look succeeds again. Pure: the caller passes
    the clock and logs what it returns."""

    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s
        self.since: float | None = None
        """When the failures began (None: not failing)."""
        self._said_at = 0.0
        self._unsaid = 0
        self.count = 0
        """Failures since they began."""

    def failed(self, now: float, error: object) -> str | None:
        self.count += 1
        if self.since is None:
            self.since = self._said_at = now
            self._unsaid = 0
            return f"{error}"
        self._unsaid += 1
        if now - self._said_at < self.every_s:
            return None
        said, self._said_at, self._unsaid = self._unsaid, now, 0
        return (f"{error} (still failing after {now - self.since:.0f} s: {self.count} looks failed, "
                f"{said} since the last line)")

    def ok(self, now: float) -> str | None:
        if self.since is None:
            return None
        line = f"back after {now - self.since:.0f} s ({self.count} look{'' if self.count == 1 else 's'} failed)"
        self.since, self.count, self._unsaid = None, 0, 0
        return line


OUTAGE_LOG_EVERY_S = 30.0
"""A send-email process's "cannot look for work" is repeated at most this often."""

PUBSUB_RETRY_S = 2.0
"""How often RQ's command channel thread tries Redis again (RQ's own 2 s)."""

OUTAGE_QUIET_S = 6.0
"""One process's parts meeting one outage (``PartsFailure``): Redis counts as back once a
part succeeds and no other part has failed for this long. Longer than any part's wait
between two tries while it fails (liveness and the command channel 2 s, a render or
control worker's dequeue up to 5 s), so a part that keeps failing while another succeeds
(Redis refusing new connections at maxclients: the command channel reconnects, the
others keep theirs) keeps the outage open instead of a "back" and a new outage every 2 s."""


class PartsFailure(RepeatedFailure):
    """RepeatedFailure told by several parts of one process, each trying Redis on its own
    schedule (a render worker: its liveness thread, its command channel's thread, its
    dequeue loop), as one story: the first failure of any part is said at once, then one
    line every ``every_s`` with how many tries of all parts failed, and one line when Redis
    is back: a part succeeded and no other part has failed for ``quiet_s`` (the "back after
    N s" counts to the first success since the last failure). A part that stopped trying
    (a dequeue loop now busy with a job) holds nothing open past ``quiet_s``. Pure: the
    caller passes the clock, logs what it returns, and holds a lock (threads)."""

    def __init__(self, every_s: float = 30.0, quiet_s: float = OUTAGE_QUIET_S):
        super().__init__(every_s)
        self.quiet_s = quiet_s
        self._failed_at: dict[str, float] = {}
        """The last failure of each part, this outage (a part that succeeded since: none)."""
        self._ok_at: float | None = None
        """The first success since the last failure."""
        self._back_at: float | None = None
        """When the last outage was told over ("back")."""
        self.late = 0
        """Failures told within ``quiet_s`` after "back", not said (tries begun before it)."""

    def failed(self, now: float, error: object, part: str = "") -> str | None:  # type: ignore[override]
        if self.since is None and self._back_at is not None and now - self._back_at < self.quiet_s:
            # a try begun while Redis was away, told after another part's success ended the
            # story (a loaded host: the thread ran late): "unreachable" then "back after 0 s"
            # right after "back" told the on-call of an outage that was over. If Redis is
            # really away again, this part's next try fails after the window and is told.
            self.late += 1
            return None
        self._failed_at[part] = now
        self._ok_at = None
        return super().failed(now, error)

    def failing(self, part: str) -> bool:
        """``part`` failed in this outage and has not succeeded since."""
        return part in self._failed_at

    def ok(self, now: float, part: str = "") -> str | None:  # type: ignore[override]
        if self.since is None:
            return None
        self._failed_at.pop(part, None)
        if self._ok_at is None:
            self._ok_at = now
        if any(now - at < self.quiet_s for at in self._failed_at.values()):
            return None
        ok_at = self._ok_at
        self._failed_at.clear()
        self._ok_at = None
        self._back_at = now
        return super().ok(ok_at)


REDIS_AWAY = (RedisConnectionError, RedisTimeoutError, OSError)
"""What a part meeting Redis away raises (told by the process's RedisOutageLog)."""


def redis_address(connection_kwargs: dict) -> str:
    """Where a client's Redis is, for a log line: its socket path or host:port (never a
    credential: those are other fields)."""
    if path := connection_kwargs.get("path"):
        return str(path)
    return f"{connection_kwargs.get('host', 'localhost')}:{connection_kwargs.get('port', 6379)}"


class RedisOutageLog:
    """One worker process's lines about Redis away, whichever of its parts (threads) meets
    it: ``failed(part, error)`` at each failed try, ``ok(part)`` at each success while an
    outage is open (``away``). Lines (WARNING; logger payrun.worker unless told):
    "<who>: Redis unreachable at <address>: <error>; will retry, nothing lost" at once,
    the same with "(still failing after N s: M looks failed, …)" every 30 s, and
    "<who>: Redis answers again at <address>: back after N s (M looks failed)" once. Each
    part keeps trying on its own schedule; this only decides what is said (PartsFailure)."""

    def __init__(self, who: str, address: str, clock: Callable[[], float] = time.monotonic,
                 every_s: float = OUTAGE_LOG_EVERY_S, quiet_s: float = OUTAGE_QUIET_S, logger: logging.Logger = log):
        self.who, self.address, self.clock, self.log = who, address, clock, logger
        self.story = PartsFailure(every_s, quiet_s)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.tries: dict[str, int] = {}
        """Failed tries per part, since the process started (for tests and a debugger)."""

    @property
    def away(self) -> bool:
        return self.story.since is not None

    def _locked(self) -> threading.Lock:
        if self._pid != os.getpid():  # a forked work horse: the thread that held the lock is not here
            self._lock, self._pid = threading.Lock(), os.getpid()
        return self._lock

    def failed(self, part: str, error: object) -> None:
        with self._locked():  # (the line is logged under it too: "back" never before "unreachable")
            self.tries[part] = self.tries.get(part, 0) + 1
            if (line := self.story.failed(self.clock(), error, part)) is not None:
                self.log.warning("%s: Redis unreachable at %s: %s; will retry, nothing lost", self.who, self.address,
                                 line)

    def ok(self, part: str) -> None:
        if self.story.since is None:
            return
        with self._locked():
            if (line := self.story.ok(self.clock(), part)) is not None:
                self.log.warning("%s: Redis answers again at %s: %s", self.who, self.address, line)


class Intake:
    """Whether there is work, for every lane of one send-email process: one watcher
    thread polls (queue lengths, drained queues, `rq suspend`) every ``poll_s`` and wakes
    as many idle lanes as there are jobs waiting. A lane that just finished a job tries
    the next one at once; only a lane that found nothing waits here.

    Each idle lane used to poll for itself, 4 times a second, 3 round trips each: 50
    idle lanes cost 0.13 core of a 2-core machine doing nothing (measured), most of the
    sending process's CPU in a pay run whose renders keep the email queue short."""

    def __init__(self, conn, queues: list[Queue], stop: threading.Event, poll_s: float = IDLE_POLL_S,
                 on_stop_request: Callable[[], None] | None = None, outage: "RedisOutageLog | None" = None):
        self.conn, self.queues, self.stop, self.poll_s = conn, queues, stop, poll_s
        self.on_stop_request = on_stop_request
        """Called (from the watcher thread) once `payrun stop-worker` asked this process to stop."""
        self._stop_key = keys.stop_process(socket.gethostname(), os.getpid(), host_id())
        self._stop_key_before = keys.stop_process(socket.gethostname(), os.getpid())
        """The key a `payrun stop-worker` (or console) of a payrun before session 42 sets,
        without the host id: during a rolling deploy (or from a console left open since the
        day before) the request was never seen, and the stop said done. It cannot tell two
        machines of one hostname apart; the CLI of this version can."""
        self._cond = threading.Condition()
        self._idle = 0
        self._grants = 0
        self._open: list[Queue] = list(queues)
        self._suspended = False
        self.waiting = 0
        """Jobs waiting in the open queues at the last poll."""
        self.outage = RepeatedFailure(OUTAGE_LOG_EVERY_S)
        self.shared = outage
        """The process's story of Redis away (run_lanes): a poll that cannot reach Redis is a
        failed try of it, not a `cannot look for work` line of its own."""

    def start(self) -> "Intake":
        self.poll()
        threading.Thread(target=self._run, name="intake", daemon=True).start()
        return self

    def open_queues(self) -> list[Queue]:
        """The queues lanes may take from now (as of the last poll): none when suspended."""
        return [] if self._suspended else list(self._open)

    def wait(self, timeout_s: float) -> list[Queue] | None:
        """Block an idle lane until the watcher sees work for it. Returns the open queues,
        [] after ``timeout_s`` with nothing to do, None once the process is stopping."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._idle += 1
            try:
                while self._grants == 0:
                    if self.stop.is_set():
                        return None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return []
                    self._cond.wait(min(left, 0.5))
                self._grants -= 1
                return self.open_queues()
            finally:
                self._idle -= 1

    def more_work(self) -> bool:
        """Whether a lane that just finished a job should try for the next at once: jobs
        were waiting at the last poll. If not, it waits here instead of spending a slot
        try, a dequeue and a give-back on an empty queue; a job that comes meanwhile is
        seen by the next poll (every ``poll_s``), which wakes it."""
        return self.waiting > 0

    def wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def poll(self) -> int:
        """One look at Redis; wakes up to that many idle lanes. Returns the jobs waiting."""
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.smembers(keys.PAUSED_QUEUES)
            pipe.exists(WORKERS_SUSPENDED)
            pipe.getdel(self._stop_key)
            pipe.getdel(self._stop_key_before)
            for q in self.queues:
                pipe.llen(q.key)
            paused, suspended, stop_asked, stop_asked_before, *lengths = pipe.execute()
        stop_asked = stop_asked if stop_asked is not None else stop_asked_before
        if stop_asked is not None and self.on_stop_request is not None and not self.stop.is_set():
            who = stop_asked.decode() if isinstance(stop_asked, bytes) else stop_asked
            log.info("send-email %d: stop requested (%s)", os.getpid(), who)
            self.on_stop_request()
        open_ = _open(self.queues, paused)
        length = {q.name: n for q, n in zip(self.queues, lengths)}
        waiting = 0
        with self._cond:
            self._open = open_
            self._suspended = bool(suspended)
            if not self._suspended:
                waiting = sum(length[q.name] for q in open_)
            self.waiting = waiting
            self._grants = min(waiting, self._idle)
            if self._grants:
                self._cond.notify(self._grants)
        return waiting

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.poll()
            except Exception as e:  # Redis blip: lanes keep waiting; look again in a second
                if self.shared is not None and isinstance(e, REDIS_AWAY):
                    self.shared.failed("intake", e)
                elif (line := self.outage.failed(time.monotonic(), e)) is not None:
                    log.warning("send-email %d: cannot look for work: %s", os.getpid(), line)
                self.stop.wait(1)
                continue
            if self.shared is not None:
                self.shared.ok("intake")  # (one attribute read while Redis is up)
            if (line := self.outage.ok(time.monotonic())) is not None:
                log.warning("send-email %d: can look for work again: %s", os.getpid(), line)
            self.stop.wait(self.poll_s)
        self.wake_all()


def lane_loop(lane: LaneWorker, stop: threading.Event, intake: Intake, limiter=None,
              fatal: threading.Event | None = None, creds=None) -> int:
    """Dequeue and run jobs until ``stop`` is set; a job in hand is always finished.

    A lane that finished a job tries the next at once while jobs are waiting (as of the
    intake's last poll); otherwise, or when it found the queues empty, it waits on
    ``intake`` (one poll for the whole process) until there is work. With a ``limiter``,
    a lane first takes a global concurrency slot and only then dequeues (non-blocking): a
    job never waits for a slot while holding a lane or a lease, and an empty dequeue gives
    the slot straight back. A lane going straight on keeps its slot until the next slot
    try, which gives it back in the same script.

    An error around a job (not from the job: RQ handles those) means Redis failed under
    us mid-job: the lane sets ``fatal`` and stops, and the process exits non-zero for its
    supervisor to restart it (what RQ's own worker does, rq #1968); the reaper returns
    the jobs it held once its liveness lapses. A lane thread that died silently instead
    would leave the process running with fewer lanes, for good.

    With ``creds`` (jobs.senders.HostCredentials): while the provider refuses this
    process's own credentials and other processes send, the lane takes no job (they go to
    the others) and waits for it to take sends again, its worker record kept alive."""
    met_outage = False  # this lane's last try failed on Redis away (lane._outage)
    while (away := _lane_born(lane, again=met_outage)) is not None:  # (Redis away as the process started: the thread died)
        met_outage = _lane_tried(lane, away)
        if stop.wait(1.0):
            return 0
    done = 0
    try_now = True  # at start, and after a job while work is waiting: try the queues first
    held = None  # the finished job's slot, given back in the same round trip as the next try
    try:
        while not stop.is_set():
            if creds is not None and creds.paused:
                if held is not None:
                    _give_back(limiter, held)
                    held = None
                met_outage = _beat_idle(lane, met_outage, lane.heartbeat)
                creds.wait_resumed(stop, 1.0)
                try_now = True
                continue
            open_ = intake.open_queues()
            if not try_now or not open_:
                if held is not None:
                    _give_back(limiter, held)
                    held = None
                # Throttled (LANE_HEARTBEAT_EVERY_S). A lane woken often but seldom the one to
                # get the job never reached the idle timeout's heartbeat below: its worker key
                # lapsed ~90 s after its last job (a job start sets job timeout + 60 s), and the
                # next hset left a record with no host, pid or queues (`rq info`: "None None").
                met_outage = _beat_idle(lane, met_outage, lane.idle, lane.heartbeat)
                open_ = intake.wait(IDLE_HEARTBEAT_S)
                if open_ is None:
                    break
                if not open_:
                    met_outage = _beat_idle(lane, met_outage, lane.heartbeat)
                    continue
            try_now = False
            slot = None
            try:
                if limiter is not None and len(open_) == 1:  # the send-email queue: one script
                    previous, held = held, None
                    queue = lane.own_queue(open_[0].name)
                    # waiting for a slot can last (an outage pause: up to 30 s at a time, for
                    # minutes): the lane renews its worker record meanwhile, or it lapses
                    got = limiter.take(stop, f"{lane.name}:{uuid.uuid4().hex[:8]}", queue.key,
                                       queue.intermediate_queue_key, lane.job_class.redis_job_namespace_prefix,
                                       previous=previous, on_wait=lane.heartbeat)
                    if got is None:
                        break
                    result = None
                    if got is not EMPTY:
                        slot = got.slot
                        if got.raw:
                            job = lane.job_class(got.job_id, connection=lane.connection, serializer=lane.serializer)
                            try:
                                job.restore(got.raw)
                                result = job, queue
                            except NoSuchJobError:  # no `data` in its hash: never runnable
                                lane.fail_unreadable(got.job_id, queue, NO_DATA, raw_meta=got.raw.get(b"meta"))
                                try_now = True
                        else:
                            try_now = True  # expired while queued: RQ's dequeue skips it too
                else:
                    if limiter is not None:
                        previous, held = held, None
                        slot = limiter.slot(stop, holder=f"{lane.name}:{uuid.uuid4().hex[:8]}", previous=previous,
                                            on_wait=lane.heartbeat)
                        if slot is None:
                            break
                    result = Queue.dequeue_any(
                        open_, None, connection=lane.connection, job_class=lane.job_class,
                        serializer=lane.serializer,
                    )
            except Exception as e:  # Redis blip: back off, keep the lane alive
                met_outage = _lane_tried(lane, e)
                result = None
                stop.wait(1)
            else:
                if met_outage:  # (a local: nothing more per send while Redis is up)
                    met_outage = _beat_idle(lane, met_outage)  # (no writes: says its part is back)
            try:
                if result is not None:
                    job, queue = result
                    lane.execute_job(job, queue)
                    lane.heartbeat()
                    done += 1
                    try_now = intake.more_work()
            except Exception as e:
                log.error("Lane %s: %s while running a job; the process exits for a restart", lane.name, e)
                if fatal is not None:
                    fatal.set()
                stop.set()
                break
            finally:
                if slot is not None:
                    if try_now and not stop.is_set():
                        held = slot  # released by the next slot try, one round trip less
                    else:
                        _give_back(limiter, slot)
    finally:
        if held is not None:
            _give_back(limiter, held)
        try:
            lane.register_death()
        except Exception:  # Redis down: the worker key expires by itself
            pass
    return done


def _lane_born(lane: LaneWorker, again: bool = False) -> Exception | None:
    """A lane's RQ record made (``register_birth``) and marked idle; the error if Redis was away.
    Tried ``again`` after Redis was away, a record there is this lane's own whose reply was
    lost (the connection dropped after the write; RQ refuses to make it twice, "an active
    worker named ..."), so it is taken as made."""
    try:
        try:
            lane.register_birth()
        except ValueError:
            if not (again and lane.connection.exists(lane.key)):
                raise
        lane.idle()
        return None
    except REDIS_AWAY as e:
        return e


def _lane_tried(lane: LaneWorker, error: Exception) -> bool:
    """A lane's Redis command failed outside a job: Redis away is a failed try of its
    process's story (``lane._outage``, run_lanes: one story, not a line per lane per
    try); anything else, or a lane outside run_lanes, is its own line. Returns True."""
    if lane._outage is not None and isinstance(error, REDIS_AWAY):
        lane._outage.failed("lanes", error)
    else:
        log.warning("Lane %s: %s; retrying in 1 s", lane.name, error)
    return True


def _beat_idle(lane: LaneWorker, met_outage: bool, *writes: Callable[[], None]) -> bool:
    """An idle lane's writes (its idle state, its throttled heartbeat). Redis away ended
    the lane's thread with a traceback (every idle lane, once an outage outlasted the
    heartbeat's 10 s; the process then exited with no lane left): now a failed try of the
    process's story, and the lane goes on waiting for work. Returns whether the lane's
    last try met Redis away (``met_outage``, kept or cleared: its part is back)."""
    try:
        for write in writes:
            write()
    except REDIS_AWAY as e:
        return _lane_tried(lane, e)
    if met_outage and lane._outage is not None:
        lane._outage.ok("lanes")
    return False


def lane_connection(conn):
    """A Redis client for one lane: the process's pool and settings, but holding one
    connection of its own for plain commands. A client on the shared pool takes a
    connection out and puts it back around every command, and each take also polls the
    socket for stray data (a syscall): ~10 round trips per send paid that, ~5% of a
    send's CPU. Pipelines still take pooled connections. redis-py serializes commands on
    the held connection with a lock, so another thread (shutdown, returning a job in
    hand) may still use it; a command interrupted mid-reply (a job timeout raised in the
    lane) disconnects it, and the next command reconnects."""
    return conn.__class__(connection_pool=conn.connection_pool, single_connection_client=True)


def _give_back(limiter, slot: str) -> None:
    try:
        limiter.release(slot)
    except Exception:  # Redis down: the slot's lease frees it
        pass


def run_lanes(conn, queue_names: list[str], lanes: int, burst: bool = False, grace_s: float = 30.0,
              limiter=None) -> int:
    """Run ``lanes`` concurrent lanes in this process until SIGTERM/SIGINT (or, with
    ``burst``, until the queues are empty). Returns the number of jobs run.

    First signal: lanes take no new job and finish the one in hand (a send is bounded by
    its timeout, which config keeps at or below the grace). Past the grace, or on a
    second signal, jobs still in hand go back to the front of their queue and the
    process exits."""
    queues = [make_queue(q, conn) for q in queue_names]
    # Sends start at reserved moments ~25 ms apart; a sender that wakes late squeezes the
    # next second's arrivals at the provider. Two process-wide stalls are in our hands:
    # a full garbage collection walking everything imported (tens of ms, all threads
    # frozen) and the GIL hand-off to a woken thread (up to the 5 ms switch interval).
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SEND_SWITCH_INTERVAL_S)
    stop = threading.Event()
    lane_conns = [lane_connection(conn) for _ in range(lanes)]
    workers = [LaneWorker(queues, connection=lane_conns[i], name=worker_name("email", i)) for i in range(lanes)]
    # RQ's scheduler process opens its own connections from this one's settings
    workers[0].scheduler_connection = conn
    for w in workers:
        w.grace_s = grace_s
    # one story of Redis away for the whole process: its liveness thread, its intake, its
    # lanes and its RQ scheduler's restart each told it in lines of their own
    outage = RedisOutageLog(f"send-email {os.getpid()}", redis_address(conn.connection_pool.connection_kwargs))
    for w in workers:
        w._outage = outage
    if taken := names_taken(conn, [w.name for w in workers]):
        raise ValueError(taken)
    liveness = Liveness(conn, [w.name for w in workers], outage=outage).start()
    register_queues(conn, queues)
    intake = Intake(conn, queues, stop, on_stop_request=lambda: begin_stop("payrun stop-worker"),
                    outage=outage).start()
    # retries sit in RQ's scheduled registry: lane 0 also runs RQ's scheduler for our queues
    workers[0]._start_scheduler(burst=False)
    from jobs import senders, tasks as tasks_mod

    # this process's own credentials, beside the other send-email processes' (jobs.senders):
    # refused here alone, it pauses itself and its jobs go to the others
    creds = senders.HOST.start(conn, tasks_mod.transport)
    counts: list[int] = [0] * lanes
    deadline: list[float] = []
    forced = threading.Event()
    fatal = threading.Event()
    signalled: list[str] = []

    def run(i: int) -> None:
        counts[i] = lane_loop(workers[i], stop, intake, limiter=limiter, fatal=fatal, creds=creds)

    def on_signal(signum, frame):
        # a second *signal*, not a signal after a stop begun otherwise (a lane's Redis
        # failure): the operator's first SIGTERM then still means "finish what you hold"
        signalled.append(signal.Signals(signum).name)
        if len(signalled) > 1:
            log.warning("send-email %d: second signal: returning jobs in hand now", os.getpid())
            forced.set()
            return
        if deadline:
            log.info("send-email %d: %s: already finishing jobs in hand", os.getpid(), signalled[0])
        else:
            begin_stop(signalled[0])

    def begin_stop(why: str) -> None:
        log.info("send-email %d: %s: finishing jobs in hand (grace %g s), taking no more",
                 os.getpid(), why, grace_s)
        deadline.append(shutdown_deadline(time.monotonic(), grace_s))
        stop.set()
        intake.wake_all()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    from jobs import tasks, unrecorded

    home = tasks.settings().home
    notes_at = [0.0]

    def record_notes() -> None:
        """Deliveries this host noted while Redis could not record them (jobs.unrecorded):
        recorded in Redis now, so that no host sends them again."""
        if (home / unrecorded.FILE).exists():  # (one stat when there is nothing)
            tasks.record_noted(conn, home)
        notes_at[0] = time.monotonic()

    record_notes()
    threads = [threading.Thread(target=run, args=(i,), name=f"lane-{i}", daemon=True) for i in range(lanes)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            if time.monotonic() - notes_at[0] >= tasks.NOTES_RECORD_EVERY_S:
                record_notes()
            if fatal.is_set() and not deadline:
                # Redis failed under a lane mid-job: exit for a restart (below), but first
                # let the other lanes finish what they hold, within the grace: a send
                # already made waits for Redis to record it (jobs.tasks._record_sent),
                # instead of dying with the process and being sent again by its next try
                begin_stop("Redis failed under a job")
            if not burst and not stop.is_set():
                workers[0].ensure_scheduler()
            if (burst and not stop.is_set() and all(w.in_hand is None for w in workers)
                    and _all_empty(queues)):
                stop.set()
            if forced.is_set() or (deadline and time.monotonic() >= deadline[0]):
                from jobs.tasks import record_pending

                for w in workers:
                    held = w.in_hand
                    if held is not None:
                        # a send the provider accepted, waiting for Redis to record it: record
                        # it now (Redis may be back since the lane's last try), or the claim
                        # freed below lets the next try send the slip again
                        if record_pending(held[0].id) is False:
                            log.warning("send-email %d: %s was delivered and Redis still does not answer to "
                                        "record it: left to the reaper", os.getpid(), held[0].id)
                            continue
                        try:
                            w.requeue_front(held[0], held[1], f"worker {w.name} stopped before the send finished")
                        except Exception as e:  # Redis away: the reaper returns it once the lease lapses
                            log.warning("send-email %d: could not return %s (%s): the reaper returns it",
                                        os.getpid(), held[0].id, e)
                for w in workers:
                    try:
                        w.register_death()
                    except Exception:  # Redis away: the worker key expires by itself
                        pass
                break  # the lane threads are daemons: they end with the process
            for t in threads:
                t.join(timeout=0.2)
    finally:
        stop.set()
        if not fatal.is_set():
            return_stranded(conn, queue_names, f"send-email {os.getpid()}")
        if workers[0].scheduler:
            try:
                workers[0].stop_scheduler()
            except Exception:
                pass
        creds.stop()
        # lanes still sending (forced stop, a Redis failure): their liveness keys stay to
        # lapse, so the reaper does not free their slots while the process is still here
        liveness.stop(forget=not any(t.is_alive() for t in threads))
        for c in lane_conns:
            try:
                c.close()  # gives its connection back to the pool
            except Exception:
                pass
    if fatal.is_set():
        log.error("send-email %d: exiting after a Redis failure mid-job (restart me)", os.getpid())
        raise SystemExit(1)
    return sum(counts)
