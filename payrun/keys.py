"""Every Redis key and queue name payrun uses, in one place.

RQ owns the ``rq:`` prefix; everything of ours lives under ``payrun:`` (and the lock
name the design fixes, ``lock:payroll:<month>``).
"""

import re

RENDER_QUEUE = "pdf-render"
EMAIL_QUEUE = "send-email"
CONTROL_QUEUE = "control"
QUEUES = (RENDER_QUEUE, EMAIL_QUEUE, CONTROL_QUEUE)

PAUSED_QUEUES = "payrun:paused-queues"
"""Queues drained by `payrun drain --queue Q`: workers take nothing from them until resumed."""

REMINDERS_SENT = "payrun:reminders-sent"
"""Reminder emails delivered (zset: job id -> time sent, a day kept): they finish on the
send-email queue beside the slips, and the console's delivery rate (its ETA) leaves them out."""
REMINDERS_KEPT_S = 86400

EVENTS_STREAM = "payrun:events"
"""Stream of job state changes, written by workers, applied to SQLite by `payrun ledger`."""
EVENTS_GROUP = "ledger"

SLIP_STORE_ID = "payrun:slips:store-id"
"""The slip store's id (payrun.slipstore): the same as in the file at the store's root."""

SLIP_STORE_FAULTS = "payrun:slips:faults"
"""Hash: host id (payrun.procs.host_id) -> JSON (host name, path, mount, errno, error,
since_ms, until_ms): the hosts whose slip store cannot be written (read-only, a failing
disk), as their render workers found it (payrun.slipstore.report_fault); an entry lapses
at its until_ms unless renewed."""

LEDGER_OWNER = "payrun:ledger:owner"
"""Which `payrun ledger` applies the events ("host pid ledger-path"), with a lease: one
ledger file gets them all (a second ledger reading the same group took a share of them
into its own file: a worker host started with `payrun up` lost 134 of 287 slips' events)."""
"""Consumer group of the ledger process: unacknowledged events survive its restart."""


def payroll_lock(month: str) -> str:
    """The pay-run lock of the design: SET lock:payroll:<month> <owner> NX EX 900."""
    return f"lock:payroll:{month}"


def idem_key(month: str, employee_id: str) -> str:
    """The idempotency key of one slip: slip:2026-11:emp-48213."""
    return f"slip:{month}:{employee_id}"


def idem_state(key: str) -> str:
    """Redis hash recording the side effect of an idempotency key (claimed/sent)."""
    return f"payrun:idem:{key}"


def stop_process(host: str, pid: int | str, host_id: str | None = None) -> str:
    """Set by `payrun stop-worker` for a send-email process (on any host): its intake
    sees it within a poll and stops the process gracefully, as SIGTERM would. ``host_id``
    (its worker record's, payrun.procs.host_id) tells apart two machines of one hostname
    whose processes have the same pid (containers started alike); None: a process of a
    payrun before session 42, which listens without it."""
    return f"payrun:stop:{host}:{pid}" + (f":{host_id}" if host_id else "")


def alive(worker_name: str) -> str:
    """Liveness of one worker (TTL 10 s, renewed every 2 s); gone = the worker is dead."""
    return f"payrun:alive:{worker_name}"


def redis_seen(run_id: str) -> str:
    """When a reaper first saw this Redis server (its run_id, a new one per start): Redis's
    time, seconds; the liveness rule counts from it (jobs.reaper.redis_uptime)."""
    return f"payrun:redis-seen:{run_id}"


def delayed(queue: str) -> str:
    """Sorted set job id -> due time (UNIX s) of jobs scheduled for later on purpose
    (`payrun remind --in`): they wait in RQ's scheduled registry beside jobs waiting out a
    retry backoff, and are counted apart from them. Entries a day past due are dropped
    when the next are added."""
    return f"payrun:delayed:{queue}"


def dequeued_seen(queue: str) -> str:
    """Hash job id -> when a reaper first saw it taken from ``queue`` but not started."""
    return f"payrun:dequeued-seen:{queue}"


MONTH_RE = re.compile(r"[0-9]{4}-(?:0[1-9]|1[0-2])")
"""A pay month as written everywhere: YYYY-MM."""
_JOB_MONTH = re.compile(r"(?:render|email|resend)-([0-9]{4}-[0-9]{2})-")


def month_of(job_id: str, key: str | None = None) -> str | None:
    """The pay month of one of our jobs, from its slip key (``slip:<month>:…``) or else its
    id (``render-<month>-…``, ``email-<month>-…``, ``resend-<month>-…``); None for others
    (a reminder)."""
    if key and key.startswith("slip:"):
        return key.split(":", 2)[1]
    m = _JOB_MONTH.match(job_id or "")
    return m.group(1) if m else None


def render_job_id(month: str, employee_id: str) -> str:
    return f"render-{month}-{employee_id}"


def email_job_id(month: str, employee_id: str) -> str:
    return f"email-{month}-{employee_id}"


def limit_conf(name: str) -> str:
    """Hash of the limits in force for a resource: cap, rate_per_s (changeable at run time)."""
    return f"payrun:limit:{name}"


def limit_slots(name: str) -> str:
    """Sorted set of concurrency-slot holders, scored by lease expiry (ms)."""
    return f"payrun:limit:{name}:slots"


def limit_slots_dead_seen(name: str) -> str:
    """Hash: slot holder -> when a reaper pass first saw its lane without liveness."""
    return f"payrun:limit:{name}:slots-dead-seen"


def limit_tat(name: str) -> str:
    """GCRA theoretical arrival time (ms) of the rate limit."""
    return f"payrun:limit:{name}:tat"


def limit_sends(name: str) -> str:
    """Sorted set of the moments sends actually started (ms), over the last ~1 s: the send gate."""
    return f"payrun:limit:{name}:sends"


def limit_pause(name: str) -> str:
    """Until when (ms) every sender waits, after a provider's 429 Retry-After."""
    return f"payrun:limit:{name}:pause"


def limit_gate(name: str) -> str:
    """Hash: the send gate's margin over 1 s (margin_ms) and when a 429 last raised it (at_ms)."""
    return f"payrun:limit:{name}:gate"


def limit_outage(name: str) -> str:
    """Hash: a provider failing sends in a row (streak, first_ms, last_ms, last_error) and,
    once that tripped the outage pause, how many pauses in a row (trips, opened_ms). Gone
    once a send succeeds; expires 10 min after its last failure."""
    return f"payrun:limit:{name}:outage"


def limit_senders(name: str) -> str:
    """Hash: send-email process (``email.<host>.<pid>``) -> JSON: alive until (ms) and, when
    the provider refused that process's own credentials, since when and where they come
    from (jobs.senders; jobs.policy.sender_entry)."""
    return f"payrun:limit:{name}:senders"


def limit_stats(name: str) -> str:
    """Counters: waits (acquires that had to wait), http_429, outage_pauses, outages."""
    return f"payrun:limit:{name}:stats"


def job_field(conn, job_ids: list[str], field: str, chunk: int = 1000):
    """(job id, the raw value of ``field`` in its RQ hash, None if absent) for each of
    ``job_ids``, in order, ``chunk`` to a round trip: the console's and prune's bulk reads."""
    for i in range(0, len(job_ids), chunk):
        part = job_ids[i:i + chunk]
        with conn.pipeline(transaction=False) as pipe:
            for job_id in part:
                pipe.hget(f"rq:job:{job_id}", field)
            yield from zip(part, pipe.execute())
