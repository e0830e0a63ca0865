"""The stuck-job reaper: returns jobs whose worker died, in seconds rather than after
RQ's 10-minute maintenance.

A job in RQ's started registry (``rq:wip:<queue>``, member ``<job id>:<execution id>``,
score = the lease's expiry) is returned to the *front* of its queue when its lease has
expired, or when its worker's liveness key ``payrun:alive:<worker>`` (TTL 10 s) is gone
in a Redis that has been up for 10 s (keys lapse while Redis is down: a live worker
beats again up to 2 s after a restart, jobs.policy.LIVENESS_SETTLE_S).
The return is one Lua script whose first step is ZREM: of two reapers running at once,
exactly one removes the entry, and only that one enqueues the job. Returning a job does
not spend a retry; an email job's idempotency claim is released so the next attempt can
send with the same key (the provider dedupes a send that did go out).

RQ's own cleanup would instead move such a job to *failed* (or retry it, spending an
attempt) and, run from two places at once, can enqueue it twice.

It also returns jobs *stranded between dequeue and start*. RQ takes a job by moving it
from the queue to ``rq:queue:<q>:intermediate`` (BLMOVE), and only then records the
execution in the started registry; a worker killed, or stopped by SIGTERM while idle
(RQ raises StopRequested wherever it is), in that gap of a few round trips leaves the
job in the intermediate list only: in no queue, in no registry, invisible to the check
above. RQ's maintenance would find it after 10 minutes and *fail* it. Each reaper pass
marks the ids it sees there (``payrun:dequeued-seen:<q>``, id -> first seen); an id still
there, not started, ``DEQUEUED_SETTLE_S`` after it was first seen goes back to the front
of its queue, through a script whose first step is LREM (exactly once, again).

The ledger event of a return is written by the same script (XADD), so no worker can
start the returned job and report it before the return itself is recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jobs import events
from jobs.policy import DEQUEUED_SETTLE_S, is_stranded, should_reap
from payrun import keys

# KEYS: wip, queue, job hash, intermediate list, idempotency state, events stream
# ARGV: wip member, job id, idempotency token ('' = none), then the event's fields
# The job hash's returned-tries counter (events.RETURNED_FIELD) goes up with the return
# when the try had begun (status 'started': a worker that died between recording the
# execution and its horse starting the job never moved the attempt counter).
_REQUEUE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[3]) == 0 then return 2 end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[5], 'state') == 'sending'
   and redis.call('HGET', KEYS[5], 'owner') == ARGV[3] then
  redis.call('DEL', KEYS[5])
end
if redis.call('HGET', KEYS[3], 'status') == 'started' then
  redis.call('HINCRBY', KEYS[3], '%s', 1)
end
redis.call('HSET', KEYS[3], 'status', 'queued')
redis.call('LREM', KEYS[4], 0, ARGV[2])
redis.call('LREM', KEYS[2], 0, ARGV[2])
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('XADD', KEYS[6], '*', unpack(ARGV, 4))
return 1
""" % events.RETURNED_FIELD

# A job stranded between dequeue and start never began a try (its attempt counter did not
# move), so its return is not counted as a returned try.
# KEYS: intermediate list, queue, job hash, wip, dequeued-seen hash, events stream
# ARGV: job id, then the event's fields
_RETURN_DEQUEUED = """
local prefix = ARGV[1] .. ':'
for _, m in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
  if string.sub(m, 1, string.len(prefix)) == prefix then
    redis.call('HDEL', KEYS[5], ARGV[1])
    return 0
  end
end
redis.call('HDEL', KEYS[5], ARGV[1])
if redis.call('LREM', KEYS[1], 0, ARGV[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[3]) == 0 then return 2 end
local st = redis.call('HGET', KEYS[3], 'status')
if st == 'finished' or st == 'failed' or st == 'canceled' or st == 'stopped' then return 3 end
redis.call('HSET', KEYS[3], 'status', 'queued')
redis.call('LREM', KEYS[2], 0, ARGV[1])
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[6], '*', unpack(ARGV, 2))
return 1
"""

# KEYS: intermediate list, wip, dequeued-seen hash; ARGV: now (as the hash stores it).
# One script: read apart, another reaper could return a job (deleting its mark) between
# this pass's read of the list and of the marks, and the pass would mark it again with
# its old sighting time, for a job back on its queue that a live worker takes next.
_MARK_DEQUEUED = """
local started = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local colon = string.find(m, ':', 1, true)
  started[colon and string.sub(m, 1, colon - 1) or m] = true
end
local taken = {}
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if not started[id] then
    taken[id] = true
    redis.call('HSETNX', KEYS[3], id, ARGV[1])
  end
end
for _, id in ipairs(redis.call('HKEYS', KEYS[3])) do
  if not taken[id] then redis.call('HDEL', KEYS[3], id) end
end
return 1
"""


@dataclass(frozen=True)
class Stuck:
    job_id: str
    queue: str
    member: str
    worker: str
    reason: str
    where: str = "started"
    """started: in RQ's started registry; dequeued: taken from its queue, never started."""


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def find_stuck(conn, now: float | None = None, queues=keys.QUEUES,
               redis_uptime_s: float | None = None) -> list[Stuck]:
    """Running jobs whose lease expired or whose worker is gone. Reads only.
    ``redis_uptime_s``: how long Redis has been up (default: asked; a missing liveness
    key means nothing in its first seconds, jobs.policy.LIVENESS_SETTLE_S)."""
    now = time.time() if now is None else now
    uptime = redis_uptime(conn) if redis_uptime_s is None else redis_uptime_s
    out: list[Stuck] = []
    for q in queues:
        entries = conn.zrange(f"rq:wip:{q}", 0, -1, withscores=True)
        if not entries:
            continue
        members = [_text(m) for m, _ in entries]
        ids = [m.split(":", 1)[0] for m in members]
        workers = _workers_of(conn, members, ids)
        with conn.pipeline(transaction=False) as pipe:
            for w in workers:
                pipe.exists(keys.alive(w)) if w else pipe.echo("1")
            # no name anywhere: we cannot tell whether its worker lives, so only the lease decides
            alive = [bool(int(a)) for a in pipe.execute()]
        for member, (_, expiry), job_id, worker, is_alive in zip(members, entries, ids, workers, alive):
            reason = should_reap(lease_expires_s=float(expiry), now_s=now, worker_alive=is_alive,
                                 redis_uptime_s=uptime)
            if reason:
                out.append(Stuck(job_id, q, member, worker, reason.format(worker=worker or "?")))
    return out + find_stranded(conn, now, queues)


REDIS_SEEN_TTL_S = 7 * 24 * 3600


def redis_uptime(conn, mark: bool = False) -> float:
    """How long this Redis has served its data, for the liveness rule: its uptime, but no
    longer than since a reaper first saw this server (``mark``: this pass records it, on
    Redis's clock, if nobody did). Uptime alone counts the time spent loading the data
    (liveness keys lapse meanwhile), and a failover to a replica up for days would count
    those days: either way the first pass after it took live lanes for dead (review of
    5f15469). Without ``mark`` (the console, status, metrics: possibly the read-only
    user) a server no reaper has seen yet counts by its uptime."""
    info = conn.info("server")
    uptime = float(info.get("uptime_in_seconds", 0))
    run_id = info.get("run_id")
    if not run_id:
        return uptime
    key = keys.redis_seen(str(run_id))
    with conn.pipeline(transaction=False) as pipe:
        (sec, usec), first = pipe.time().get(key).execute()
    now = sec + usec / 1e6
    if first is None:
        if not mark:
            return uptime
        conn.set(key, repr(now), nx=True, ex=REDIS_SEEN_TTL_S)
        first = conn.get(key)  # (another reaper's mark, if it was first)
    return max(0.0, min(uptime, now - float(first)))


def _workers_of(conn, members: list[str], ids: list[str]) -> list[str | None]:
    """The worker running each started execution (``job_id:execution_id`` in rq:wip).

    From RQ's execution record (``rq:execution:<member>``), written in the same MULTI as
    the rq:wip entry: the job hash's ``worker_name`` is written by a later transaction,
    so a reaper reading it just after a job started found no name and took the worker
    for dead (a live send was returned and sent twice, caught in `payrun demo`); after
    a retry it may still name the previous attempt's worker. The job hash is the fallback
    for an execution record that is gone."""
    with conn.pipeline(transaction=False) as pipe:
        for member, job_id in zip(members, ids):
            pipe.hget(f"rq:execution:{member}", "worker_name")
            pipe.hget(f"rq:job:{job_id}", "worker_name")
        names = [_text(n) for n in pipe.execute()]
    return [by_execution or by_job or None for by_execution, by_job in zip(names[::2], names[1::2])]


def _dequeued_not_started(conn, q: str) -> list[str]:
    """Ids in the queue's intermediate list with no execution in its started registry
    (``_MARK_DEQUEUED`` works out the same set inside its script, to mark it atomically)."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.lrange(f"rq:queue:{q}:intermediate", 0, -1)
        pipe.zrange(f"rq:wip:{q}", 0, -1)
        taken, started = pipe.execute()
    running = {_text(m).split(":", 1)[0] for m in started}
    return list(dict.fromkeys(i for i in map(_text, taken) if i not in running))


def find_stranded(conn, now: float | None = None, queues=keys.QUEUES,
                  settle_s: float = DEQUEUED_SETTLE_S) -> list[Stuck]:
    """Jobs taken from their queue and not started for ``settle_s`` since a reaper pass
    first saw them (``mark_dequeued``). Reads only."""
    now = time.time() if now is None else now
    out: list[Stuck] = []
    for q in queues:
        ids = _dequeued_not_started(conn, q)
        if not ids:
            continue
        seen = conn.hmget(keys.dequeued_seen(q), ids)
        for job_id, first in zip(ids, seen):
            first_s = float(first) if first else None
            if is_stranded(first_s, now, settle_s):
                out.append(_stranded(job_id, q, f" ({now - first_s:.0f} s ago)"))
    return out


def _stranded(job_id: str, queue: str, since: str = "") -> Stuck:
    return Stuck(job_id, queue, job_id, "", f"taken from {queue} by a worker that stopped before starting it{since}",
                 where="dequeued")


def mark_dequeued(conn, now: float | None = None, queues=keys.QUEUES) -> None:
    """Record when each taken-not-started job was first seen; forget ids gone since."""
    now = time.time() if now is None else now
    for q in queues:
        conn.eval(_MARK_DEQUEUED, 3, f"rq:queue:{q}:intermediate", f"rq:wip:{q}", keys.dequeued_seen(q), repr(now))


def _event_args(job_id: str, outcome: str, attempt, error: str) -> list[str]:
    ev = events.event(job_id, "queued", attempt=attempt, outcome=outcome, error=error)
    return [x for kv in ev.items() for x in kv]


def return_dequeued(conn, s: Stuck) -> bool:
    """Put one stranded job back at the front of its queue, once (see the module doc)."""
    error = f"returned by the reaper: {s.reason}"
    done = conn.eval(_RETURN_DEQUEUED, 6, f"rq:queue:{s.queue}:intermediate", f"rq:queue:{s.queue}",
                     f"rq:job:{s.job_id}", f"rq:wip:{s.queue}", keys.dequeued_seen(s.queue), keys.EVENTS_STREAM,
                     s.job_id, *_event_args(s.job_id, "reaped", None, error))
    if int(done) != 1:
        return False
    events.log_emitted(s.job_id, "queued", outcome="reaped", error=error)
    return True


def return_dequeued_now(conn, queues, settle_s: float = 1.0, poll_s: float = 0.05) -> list[Stuck]:
    """At a worker's exit: the jobs of these queues that stay taken-not-started for
    ``settle_s`` (polled; a live worker crosses that gap in milliseconds) go back at once
    rather than at the reaper's next passes. Returns what it returned."""
    candidates = {q: set(_dequeued_not_started(conn, q)) for q in queues}
    deadline = time.monotonic() + settle_s
    while any(candidates.values()) and time.monotonic() < deadline:
        time.sleep(poll_s)
        candidates = {q: ids & set(_dequeued_not_started(conn, q)) for q, ids in candidates.items()}
    stranded = [_stranded(job_id, q) for q, ids in candidates.items() for job_id in ids]
    return [s for s in stranded if return_dequeued(conn, s)]


def reap(conn, now: float | None = None, redis_uptime_s: float | None = None) -> list[Stuck]:
    """Return every stuck job to the front of its queue, once. Returns what this call returned."""
    from jobs.runtime import PayrunJob

    returned: list[Stuck] = []
    mark_dequeued(conn, now)
    if redis_uptime_s is None:
        redis_uptime_s = redis_uptime(conn, mark=True)
    for s in find_stuck(conn, now, redis_uptime_s=redis_uptime_s):
        if s.where == "dequeued":
            if return_dequeued(conn, s):
                returned.append(s)
            continue
        # Read the attempt *before* returning the job: once it is back on its queue a
        # worker may start the next attempt at once (and bump the attempt) — releasing
        # the dead attempt's idempotency claim after that missed it, and the new attempt
        # found the key "being sent" for the claim's whole TTL, burning its retries.
        # The claim is released inside the same script, before the job is enqueued.
        try:
            job = PayrunJob.fetch(s.job_id, connection=conn)
            meta, began = job.meta, job.get_status(refresh=False) == "started"
        except Exception:
            meta, began = {}, False
        # a try that never began (its horse never started it) has no attempt of its own:
        # the counter still holds the previous try's, whose ledger row must stay as it is
        attempt = meta.get("attempt") if began else None
        key, token = "", ""
        if meta.get("kind") == "email" and meta.get("key") and attempt:
            key, token = meta["key"], f"{s.job_id}:{attempt}"
        error = f"returned by the reaper: {s.reason}"
        done = conn.eval(_REQUEUE, 6, f"rq:wip:{s.queue}", f"rq:queue:{s.queue}", f"rq:job:{s.job_id}",
                         f"rq:queue:{s.queue}:intermediate", keys.idem_state(key), keys.EVENTS_STREAM,
                         s.member, s.job_id, token, *_event_args(s.job_id, "reaped", attempt, error))
        if int(done) != 1:
            continue  # another reaper got there first, or the job is gone
        events.log_emitted(s.job_id, "queued", attempt=attempt, outcome="reaped", error=error)
        returned.append(s)
    return returned
