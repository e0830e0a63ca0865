"""Dead letters: jobs that failed for good, read from RQ's failed registries (without
running RQ's cleanup), and requeued by hand with a fresh attempt budget."""

from __future__ import annotations

import json
from typing import Any

from rq.registry import FailedJobRegistry

from jobs import events
from jobs.runtime import PayrunJob, make_queue
from payrun import keys
from payrun.config import Config


def _registry(conn, queue: str) -> FailedJobRegistry:
    q = make_queue(queue, conn)
    return FailedJobRegistry(queue=q, job_class=PayrunJob, serializer=q.serializer)


def failed(conn, queue: str | None = None, error: str | None = None, limit: int | None = None,
           company: int | None = None, ledger=None) -> list[dict[str, Any]]:
    """Failed jobs, newest first, optionally only one queue, whose last error contains
    ``error`` (case-insensitive), and (with the ``ledger``) of one ``company``."""
    out: list[dict[str, Any]] = []
    for qname in ([queue] if queue else [keys.RENDER_QUEUE, keys.EMAIL_QUEUE, keys.CONTROL_QUEUE]):
        reg = _registry(conn, qname)
        ids = reg.get_job_ids(desc=True, cleanup=False)
        for job in PayrunJob.fetch_many(ids, connection=conn, serializer=reg.serializer):
            if job is None:
                continue
            last_error = job.meta.get("last_error") or ""
            if error and error.lower() not in last_error.lower():
                continue
            out.append({
                "id": job.id, "queue": qname, "kind": job.meta.get("kind"), "key": job.meta.get("key"),
                # tries; of them held (by the provider) and returned (by a stopping worker or
                # the reaper) spent no attempt: events.attempts_spent
                "attempts": job.meta.get("attempt", 0), "held": int(job.meta.get("held", 0)),
                "returned": job.returned_tries, "error": last_error,
                # the last try's error was permanent (EventsMixin._classify_exception): the data, not luck
                "permanent": bool(job.meta.get("permanent")),
                "ended_at": job.ended_at.isoformat() if job.ended_at else None,
            })
    if ledger is not None and out:
        whose = ledger.whose([r["id"] for r in out])
        returned = ledger.returned_tries([r["id"] for r in out])
        resent = ledger.delivered_by_resend([slip_key(r["key"]) for r in out if r.get("key")])
        for r in out:
            r["company"], r["employee"] = whose.get(r["id"], (None, None))
            r["returned"] = max(r["returned"], returned.get(r["id"], 0))
            # HR sent the slip again (`payrun resend`) and that one was delivered: the job
            # still failed, but the employee has the slip (status counts it as sent)
            r["delivered_by_resend"] = bool(r.get("key")) and slip_key(r["key"]) in resent
    if company is not None:
        out = [r for r in out if r.get("company") == company]
    out.sort(key=lambda r: (r["ended_at"] or "", r["id"]), reverse=True)  # (ties as the console's list)
    return out[:limit] if limit else out


def slip_key(key: str) -> str:
    """The slip a key belongs to: slip:<month>:<employee> (a resend's key adds :resend-<n>)."""
    return key.split(":resend-", 1)[0]


def one_per_slip(conn, job_ids: list[str]) -> tuple[list[str], list[str]]:
    """Of failed jobs about to be retried, one per slip: the newest to fail. A slip can
    have several dead letters (its send failed, then HR's `payrun resend` of it failed
    too): retrying both, once the address is fixed, emailed it twice. Returns (to retry,
    left out), each in the order given. Jobs of no slip (no key) are all kept."""
    with conn.pipeline(transaction=False) as p:
        for job_id in job_ids:
            p.hget(PayrunJob.key_for(job_id), "meta")
            p.zscore(f"rq:failed:{keys.RENDER_QUEUE}", job_id)
            p.zscore(f"rq:failed:{keys.EMAIL_QUEUE}", job_id)
        raw = p.execute()
    newest: dict[str, tuple[float, str]] = {}
    slip_of: dict[str, str] = {}
    for i, job_id in enumerate(job_ids):
        meta_raw, *scores = raw[3 * i:3 * i + 3]
        try:
            key = (json.loads(meta_raw) or {}).get("key") if meta_raw else None  # (JSON serializer)
        except (ValueError, AttributeError):  # unreadable meta: no slip to group by
            key = None
        if not key:
            continue
        slip = slip_key(key)
        slip_of[job_id] = slip
        # a failed registry's score is the failure's expiry: failure_ttl after it failed,
        # the same ttl for every job of a slip, so the highest is the newest failure
        when = max((float(x) for x in scores if x is not None), default=0.0)
        if slip not in newest or (when, job_id) > newest[slip]:
            newest[slip] = (when, job_id)
    left_out = {i for i in slip_of if newest[slip_of[i]][1] != i}  # (a set: --all may name thousands)
    return [i for i in job_ids if i not in left_out], [i for i in job_ids if i in left_out]


RENDER_FUNCS = ("jobs.tasks.render_slip", "jobs.oneoff.resend_slip")


def _refresh_snapshot(job: PayrunJob, payroll_db) -> None:
    """A render job carries the employee's data as it was when the job was made; a render
    that failed on that data (a name too long for the slip, say) is retried after HR fixed
    it, so the retry renders from the payroll database as it is now. Its key stays (the
    slip is still the same one), and so does its company: the month's slip is from the
    company that ran that month's payroll, even if the employee has moved since (the
    ledger counts the job there too). An employee or salary line gone since: the data it
    had."""
    if payroll_db is None or job.func_name not in RENDER_FUNCS or not job.args:
        return
    from payrun import payroll
    from payrun.errors import InputError

    old = job.args[0]
    try:
        new = payroll.employee_snapshot(payroll_db, old["month"], old["employee"]["id"])
    except (InputError, KeyError, TypeError):
        return
    new["key"] = old.get("key", new.get("key"))
    if old.get("reissued"):  # a resend stays marked re-issued (its date: when HR asked)
        new["reissued"] = old["reissued"]
    if isinstance(old.get("company"), dict) and new.get("company", {}).get("id") != old["company"].get("id"):
        new["company"] = old["company"]
    if new != old:
        job.args = (new,)


def _refresh_address(job: PayrunJob, payroll_db) -> None:
    """A send job carries the address of its snapshot; HR may have fixed it since."""
    if payroll_db is None or job.func_name != "jobs.tasks.send_slip" or not job.args:
        return
    payload = dict(job.args[0])
    row = payroll_db.conn.execute(
        "SELECT email, name_en FROM employees WHERE id = ?", (payload.get("employee_id"),)
    ).fetchone()
    if row and row[0] != payload.get("to"):
        payload["to"], payload["to_name"] = row[0], row[1]
        job.args = (payload,)


def _failed_in(conn, job_id: str) -> FailedJobRegistry | None:
    """The failed registry of ours holding ``job_id``, if any."""
    for qname in keys.QUEUES:
        reg = _registry(conn, qname)
        if conn.zscore(reg.key, job_id) is not None:
            return reg
    return None


def is_failed(conn, job_id: str) -> bool:
    """Whether ``job_id`` is in one of our queues' failed registries (a dead letter)."""
    return _failed_in(conn, job_id) is not None


def retry(cfg: Config, conn, job_ids: list[str], payroll_db=None) -> tuple[list[str], list[str]]:
    """Requeue failed jobs with a fresh attempt budget, reading what HR may have fixed
    since from ``payroll_db``: a send's address, a render's employee data. Returns
    (requeued, not_found)."""
    requeued, missing = [], []
    for job_id in job_ids:
        reg = _failed_in(conn, job_id)
        job = PayrunJob.fetch(job_id, connection=conn, serializer=reg.serializer) if reg is not None else None
        if job is None:
            missing.append(job_id)
            continue
        policy = cfg.email.retry if job.origin == keys.EMAIL_QUEUE else cfg.render.retry
        job.retries_left = policy.attempts - 1 if policy.attempts > 1 else None
        # attempts keep counting (the ledger's history stays whole); the backoff restarts
        job.meta.update(budget_start=int(job.meta.get("attempt", 0)), budget_returned=job.returned_tries,
                        retry=vars(policy))
        for k in ("last_error", "error_attempt", "retry_after", "last_delay", "permanent"):
            job.meta.pop(k, None)
        _refresh_address(job, payroll_db)
        _refresh_snapshot(job, payroll_db)
        job.save()
        with conn.pipeline() as pipe:
            reg.remove(job, pipeline=pipe)
            make_queue(job.origin, conn)._enqueue_job(job, pipeline=pipe)
            events.emit(pipe, job.id, "queued", reset=1)
            pipe.execute()
        requeued.append(job_id)
    return requeued, missing
