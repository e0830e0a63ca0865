"""The stuck-job reaper: returns jobs whose worker died, in seconds rather than after
RQ's 10-minute maintenance.

A job in RQ's started registry (``rq:wip:<queue>``, member ``<job id>:<execution id>``,
score = the lease's expiry) is returned to the *front* of its queue when its lease has
expired, or when its worker's liveness key ``payrun:alive:<worker>`` (TTL 10 s) is gone.
The return is one Lua script whose first step is ZREM: of two reapers running at once,
exactly one removes the entry, and only that one enqueues the job. Returning a job does
not spend a retry; an email job's idempotency claim is released so the next attempt can
send with the same key (the provider dedupes a send that did go out).

RQ's own cleanup would instead move such a job to *failed* (or retry it, spending an
attempt) and, run from two places at once, can enqueue it twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jobs import events
from jobs.policy import should_reap
from payrun import keys

_REQUEUE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[3]) == 0 then return 2 end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[5], 'state') == 'sending'
   and redis.call('HGET', KEYS[5], 'owner') == ARGV[3] then
  redis.call('DEL', KEYS[5])
end
redis.call('HSET', KEYS[3], 'status', 'queued')
redis.call('LREM', KEYS[4], 0, ARGV[2])
redis.call('LPUSH', KEYS[2], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class Stuck:
    job_id: str
    queue: str
    member: str
    worker: str
    reason: str


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def find_stuck(conn, now: float | None = None, queues=keys.QUEUES) -> list[Stuck]:
    """Running jobs whose lease expired or whose worker is gone. Reads only."""
    now = time.time() if now is None else now
    out: list[Stuck] = []
    for q in queues:
        entries = conn.zrange(f"rq:wip:{q}", 0, -1, withscores=True)
        if not entries:
            continue
        members = [_text(m) for m, _ in entries]
        ids = [m.split(":", 1)[0] for m in members]
        with conn.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(f"rq:job:{job_id}", "worker_name")
            workers = [_text(w) for w in pipe.execute()]
        with conn.pipeline(transaction=False) as pipe:
            for w in workers:
                pipe.exists(keys.alive(w)) if w else pipe.echo("0")
            alive = [bool(int(a)) for a in pipe.execute()]
        for member, (_, expiry), job_id, worker, is_alive in zip(members, entries, ids, workers, alive):
            reason = should_reap(lease_expires_s=float(expiry), now_s=now, worker_alive=is_alive)
            if reason:
                out.append(Stuck(job_id, q, member, worker, reason.format(worker=worker or "?")))
    return out


def reap(conn, now: float | None = None) -> list[Stuck]:
    """Return every stuck job to the front of its queue, once. Returns what this call returned."""
    from jobs.runtime import PayrunJob

    returned: list[Stuck] = []
    for s in find_stuck(conn, now):
        # Read the attempt *before* returning the job: once it is back on its queue a
        # worker may start the next attempt at once (and bump the attempt) — releasing
        # the dead attempt's idempotency claim after that missed it, and the new attempt
        # found the key "being sent" for the claim's whole TTL, burning its retries.
        # The claim is released inside the same script, before the job is enqueued.
        try:
            meta = PayrunJob.fetch(s.job_id, connection=conn).meta
        except Exception:
            meta = {}
        attempt = meta.get("attempt")
        key, token = "", ""
        if meta.get("kind") == "email" and meta.get("key") and attempt:
            key, token = meta["key"], f"{s.job_id}:{attempt}"
        done = conn.eval(_REQUEUE, 5, f"rq:wip:{s.queue}", f"rq:queue:{s.queue}", f"rq:job:{s.job_id}",
                         f"rq:queue:{s.queue}:intermediate", keys.idem_state(key), s.member, s.job_id, token)
        if int(done) != 1:
            continue  # another reaper got there first, or the job is gone
        returned.append(s)
        events.emit(conn, s.job_id, "queued", attempt=attempt, outcome="reaped", error=f"returned by the reaper: {s.reason}")
    return returned
