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

from payrun import keys


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def event(job_id: str, status: str, **fields: Any) -> dict[str, str]:
    ev = {"job": job_id, "status": status, "ts": utcnow()}
    for k, v in fields.items():
        if v is not None:
            ev[k] = str(v)
    return ev


def emit(conn, job_id: str, status: str, **fields: Any) -> None:
    """Append one event (``conn`` may be a pipeline, to make it atomic with an enqueue)."""
    conn.xadd(keys.EVENTS_STREAM, event(job_id, status, **fields))
