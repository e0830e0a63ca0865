"""Job state changes, reported by workers through Redis (never by opening the ledger).

An event is a flat dict of strings appended to the stream ``payrun:events``; the ledger
process applies them to SQLite in order (payrun/ledger.py). Fields:
  job, status (queued/running/retrying/done/failed), ts (UTC ISO-8601), and optionally
  attempt, error (one line, no salary data), delay (seconds chosen for a retry), worker,
  and for a job created by another job: kind, company, employee, month, key, queue.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import logging

from payrun import keys
from payrun.text import visible

_log = logging.getLogger("payrun.jobs")


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters (an error for a log line or an event),
    its control characters written as escapes (``\\x1b``): a mail server's or provider's reply
    quoted in an error reaches the ledger, logs and the operator's terminal."""
    text = visible(" ".join(str(text).split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


RETURNED_OUTCOMES = ("requeued", "reaped")
"""Outcomes of a try handed back by a worker told to stop, or returned by the reaper."""

NO_ATTEMPT_OUTCOMES = ("held", *RETURNED_OUTCOMES)
"""Outcomes of a try that spent none of the job's retry budget: held back by the provider
(rate limit, outage, a send of the same slip in flight), handed back by a worker told to
stop (SIGTERM, a deploy), returned by the reaper after its worker died. Every try counts
in ``attempts``; only the others are attempts *spent*."""

RETURNED_FIELD = "payrun_returned"
"""Field of RQ's job hash (``rq:job:<id>``; RQ keeps fields it does not know) counting the
job's tries handed back by a stopping worker or returned by the reaper: the Redis side of
the outcomes above (the meta's ``held`` counts the other kind). A Lua script can add to it
atomically with the return, which it could not do inside the JSON meta."""


def attempts_spent(tries: int, held: int = 0, returned: int = 0) -> int:
    """Attempts of the retry budget spent by ``tries`` tries of which ``held`` were held
    back by the provider and ``returned`` handed back or reaped."""
    return max(0, int(tries) - int(held) - int(returned))


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def outcome_of(ev: dict[str, str]) -> str:
    """An event's outcome: "held" for a try held back by the provider (a retrying event
    with held=1, spent no attempt), else its outcome field or its status."""
    if ev.get("held") == "1" and ev.get("status") == "retrying":
        return "held"
    return ev.get("outcome") or ev.get("status", "")


def event(job_id: str, status: str, **fields: Any) -> dict[str, str]:
    ev = {"job": job_id, "status": status, "ts": utcnow()}
    for k, v in fields.items():
        if v is not None:
            ev[k] = str(v)
    return ev


def emit(conn, job_id: str, status: str, **fields: Any) -> None:
    """Append one event (``conn`` may be a pipeline, to make it atomic with an enqueue),
    and log it as one line with job_id, queue, attempt and outcome as fields."""
    ev = event(job_id, status, **fields)
    conn.xadd(keys.EVENTS_STREAM, ev)
    _log_event(job_id, status, ev)


def log_emitted(job_id: str, status: str, duration_s: float | None = None, **fields: Any) -> None:
    """The log line of an event written by a script (XADD inside Lua, atomic with its change).
    ``duration_s``: how long the job ran (logged, not part of the event)."""
    _log_event(job_id, status, event(job_id, status, **fields), duration_s)


def _log_event(job_id: str, status: str, ev: dict[str, str], duration_s: float | None = None) -> None:
    outcome = outcome_of(ev)
    free = outcome in NO_ATTEMPT_OUTCOMES  # held back, handed back or reaped: no attempt spent
    _log.info("job %s %s%s%s", job_id, outcome,
              (f" (try {ev['attempt']}, no attempt spent)" if free else f" (attempt {ev['attempt']})")
              if "attempt" in ev else "",
              f" in {duration_s:.2f} s" if duration_s is not None else "",
              extra={"job_id": job_id, "queue": ev.get("queue") or _queue_of(job_id),
                     "attempt": int(ev["attempt"]) if "attempt" in ev else None,
                     "outcome": outcome, "error": ev.get("error"),
                     "worker": ev.get("worker"),
                     "duration_s": round(duration_s, 3) if duration_s is not None else None})


def _queue_of(job_id: str) -> str | None:
    for prefix, queue in (("render-", keys.RENDER_QUEUE), ("email-", keys.EMAIL_QUEUE)):
        if job_id.startswith(prefix):
            return queue
    return None
