"""Dead letters: jobs that failed for good, read from RQ's failed registries (without
running RQ's cleanup), and requeued by hand with a fresh attempt budget."""

from __future__ import annotations

import json
import zlib
from datetime import datetime
from typing import Any

from rq import Retry
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.registry import FailedJobRegistry

from jobs import events
from jobs.policy import REISSUE_FIELDS
from jobs.runtime import PayrunJob, make_queue
from payrun import keys
from payrun.config import Config


def _registry(conn, queue: str) -> FailedJobRegistry:
    q = make_queue(queue, conn)
    return FailedJobRegistry(queue=q, job_class=PayrunJob, serializer=q.serializer)


def failed(conn, queue: str | None = None, error: str | None = None, limit: int | None = None,
           company: int | None = None, ledger=None, month: str | None = None) -> list[dict[str, Any]]:
    """Failed jobs, newest first, optionally only one queue, whose last error contains
    ``error`` (case-insensitive), of one pay ``month`` (YYYY-MM, from the job's slip key
    or id), and (with the ``ledger``) of one ``company``."""
    out: list[dict[str, Any]] = []
    for qname in ([queue] if queue else [keys.RENDER_QUEUE, keys.EMAIL_QUEUE, keys.CONTROL_QUEUE]):
        reg = _registry(conn, qname)
        ids = reg.get_job_ids(desc=True, cleanup=False)
        for job in _fetch_many(conn, ids, reg.serializer):
            if job is None:
                continue
            last_error = job.meta.get("last_error") or ""
            if error and error.lower() not in last_error.lower():
                continue
            if month and keys.month_of(job.id, job.meta.get("key")) != month:
                continue
            never = never_ran(job.meta, last_error)
            out.append({
                "id": job.id, "queue": qname, "kind": job.meta.get("kind"), "key": job.meta.get("key"),
                # tries; of them held (by the provider) and returned (by a stopping worker or
                # the reaper) spent no attempt: events.attempts_spent
                "attempts": 0 if never else job.meta.get("attempt", 0),
                "held": 0 if never else int(job.meta.get("held", 0)),
                "returned": 0 if never else job.returned_tries, "error": last_error,
                # failed unread, as its data cannot be read: it never ran, and nothing can rerun it
                "never_ran": never,
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
            if not r["never_ran"]:
                r["returned"] = max(r["returned"], returned.get(r["id"], 0))
            # HR sent the slip again (`payrun resend`) and that one was delivered: the job
            # still failed, but the employee has the slip (status counts it as sent)
            r["delivered_by_resend"] = bool(r.get("key")) and slip_key(r["key"]) in resent
    if company is not None:
        out = [r for r in out if r.get("company") == company]
    # newest first by the second (the failed registry's score, which orders the console's
    # list, has whole seconds), then by id: the console's order
    out.sort(key=lambda r: ((r["ended_at"] or "")[:19], r["id"]), reverse=True)
    return out[:limit] if limit else out


UNREADABLE_ERROR = "job data unreadable: "
"""How the error of a job a worker failed unread begins (jobs.runtime fail_unreadable, and a
lane's DeserializationError through jobs.policy.classify)."""


def never_ran(meta: dict, last_error: str) -> bool:
    """Whether a failed job never ran: a worker failed it unread (its hash had no ``data``,
    or data that is not JSON), or its hash has no data and no try of it is counted. Its
    attempts are 0 whatever its meta says: a worker of the version before counted one for
    data that is not JSON as it failed it (`payrun failed` said attempts=1 of that kind,
    attempts=0 of the other, and neither ran)."""
    return last_error.startswith(UNREADABLE_ERROR) or (last_error == DATA_MISSING and not meta.get("attempt"))


DATA_MISSING = "job data missing (its Redis hash has no 'data' field): nothing to retry"
DATA_UNREADABLE = "job data unreadable (its 'data' field is not JSON): nothing to retry"


def _fetch_many(conn, ids: list[str], serializer) -> list[PayrunJob | None]:
    """RQ's ``Job.fetch_many``, but a hash with no ``data`` field (written by hand, or a
    job the workers moved here as unreadable) is a job whose meta says "job data missing",
    not a NoSuchJobError that ended the whole listing. None for a hash that is gone."""
    with conn.pipeline() as pipe:
        for job_id in ids:
            pipe.hgetall(PayrunJob.key_for(job_id))
        raws = pipe.execute()
    out: list[PayrunJob | None] = []
    for job_id, raw in zip(ids, raws):
        if not raw:
            out.append(None)
            continue
        job = PayrunJob(job_id, connection=conn, serializer=serializer)
        try:
            job.restore(raw)
        except NoSuchJobError:
            job.meta = _json_meta(raw.get(b"meta"))
            job.meta["last_error"] = job.meta.get("last_error") or DATA_MISSING
            ended = raw.get(b"ended_at")
            try:
                job.ended_at = datetime.fromisoformat(ended.decode().replace("Z", "+00:00")) if ended else None
            except ValueError:
                job.ended_at = None
        out.append(job)
    return out


def _json_meta(raw: bytes | None) -> dict:
    """A job's meta read as JSON only (never unpickled); {} if it is anything else."""
    try:
        value = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


UNREADABLE_MISSING = "job data missing (its Redis hash has no 'data' field)"
UNREADABLE_NOT_JSON = "job data unreadable (its 'data' field is not JSON)"


def unreadable_job(conn, job_id: str) -> dict[str, Any] | None:
    """For a job whose hash is there but whose data RQ cannot read (no ``data`` field:
    written by hand, or so by rq; data not JSON), what the console's job detail and
    `payrun job` show instead of RQ's error (which is the raw hash): its status and queue, its meta read as JSON only, why
    its data cannot be read and which fields the hash has (never their values). None if
    the hash is gone or RQ reads its data (another error)."""
    raw = conn.hgetall(f"rq:job:{job_id}")
    if not raw:
        return None
    fields = sorted(_str(k) for k in raw)
    data = raw.get(b"data")
    if data is None:
        why = UNREADABLE_MISSING
    else:
        try:  # as RQ reads it (rq.job.Job.restore): zlib-compressed, or left as it was written
            data = zlib.decompress(data)
        except zlib.error:
            pass
        try:  # and as rq.job.Job._deserialize_data does: [func, instance, args, kwargs]
            _func, _instance, _args, _kwargs = json.loads(data.decode("utf-8"))
            return None
        except (ValueError, TypeError):  # (UnicodeDecodeError too; JSON of another shape: RQ cannot read it either)
            why = UNREADABLE_NOT_JSON
    meta = _json_meta(raw.get(b"meta"))
    return {"rq_status": _str(raw.get(b"status")) or None, "origin": _str(raw.get(b"origin")) or None,
            "meta": {k: v for k, v in meta.items() if k in ("kind", "key", "attempt", "last_error", "permanent")},
            "unreadable": why, "fields": fields}


def _str(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else ("" if v is None else str(v))


def readdressed(conn, job_ids: list[str], payroll_db) -> set[str]:
    """Of failed jobs ``job_ids``, the sends that failed for good whose employee's email
    address in ``payroll_db`` is no longer the one they used: HR fixed it since, and
    `payrun retry` sends to the new one (an HR drill: the list still said "fix the data"
    after the fix was imported, and the retry that it fails again unless fixed)."""
    from payrun import payroll

    if not job_ids or payroll_db is None:
        return set()
    used: dict[str, tuple[str, str]] = {}  # job id -> (employee, address it used)
    serializer = _registry(conn, keys.EMAIL_QUEUE).serializer
    with conn.pipeline(transaction=False) as p:  # (no MULTI: the console's read-only user may not)
        for job_id in job_ids:
            p.hgetall(f"rq:job:{job_id}")
        raws = p.execute()
    for job_id, raw in zip(job_ids, raws):
        if not raw:
            continue
        job = PayrunJob(job_id, connection=conn, serializer=serializer)
        try:
            job.restore(raw)
        except Exception:  # (a job record RQ cannot read: not ours to judge here)
            continue
        if job.meta.get("kind") != "email" or not job.meta.get("permanent"):
            continue
        payload = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
        if payload.get("employee_id") and payload.get("to"):
            used[job.id] = (payload["employee_id"], payload["to"])
    now = payroll.emails(payroll_db, sorted({e for e, _ in used.values()}))
    return {i for i, (emp, to) in used.items() if now.get(emp) not in (None, to)}


def refused_for_good(conn, job_ids: list[str]) -> set[str]:
    """Of ``job_ids``, those Redis holds as failed for good on their data (``permanent`` in
    their meta: a send's address refused, not a provider's trouble). Failed jobs are kept 30
    days; one Redis no longer holds is not counted."""
    if not job_ids:
        return set()
    with conn.pipeline(transaction=False) as p:
        for job_id in job_ids:
            p.hget(PayrunJob.key_for(job_id), "meta")
        raws = p.execute()
    return {j for j, raw in zip(job_ids, raws) if _json_meta(raw).get("permanent")}


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


def still_left_out(left_out: list[str], requeued: list[str], rendered_again: list[str]) -> list[str]:
    """The older failures :func:`one_per_slip` left out, less those the retry put back after
    all: a render a retried send put back for its missing slip file, a send a retried render
    took along. "Left out" must not name a job the same retry requeued."""
    back = set(requeued) | set(rendered_again)
    return [i for i in left_out if i not in back]


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
    for k in REISSUE_FIELDS:  # a resend stays marked re-issued (its date: when HR asked), and corrected
        if old.get(k):
            new[k] = old[k]
    if isinstance(old.get("company"), dict) and new.get("company", {}).get("id") != old["company"].get("id"):
        new["company"] = old["company"]
    if new != old:
        job.args = (new,)


def _address_of(job: PayrunJob) -> str | None:
    """The address a send job goes to (its payload's ``to``); None for any other job."""
    if job.func_name != "jobs.tasks.send_slip" or not job.args or not isinstance(job.args[0], dict):
        return None
    to = job.args[0].get("to")
    return to if isinstance(to, str) and to else None


ADDRESSED_FUNCS = ("jobs.tasks.send_slip", "jobs.oneoff.send_reminder")
"""Jobs that carry the address they email (payload ``to``, ``to_name``, ``employee_id``)."""


def _refresh_address(job: PayrunJob, payroll_db) -> None:
    """A send job (a slip's or a reminder's) carries the address it was made with; HR may
    have fixed it since. (An HR walkthrough: `retry --all` said a failed reminder "goes to
    the new one" and sent it to the refused address again: only slips read it again.)"""
    if payroll_db is None or job.func_name not in ADDRESSED_FUNCS or not job.args \
            or not isinstance(job.args[0], dict):
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


def _fresh_budget(cfg: Config, job: PayrunJob) -> None:
    """A fresh attempt budget: attempts keep counting (the ledger's history stays whole);
    the backoff restarts."""
    policy = cfg.email.retry if job.origin == keys.EMAIL_QUEUE else cfg.render.retry
    job.retries_left = policy.attempts - 1 if policy.attempts > 1 else None
    job.meta.update(budget_start=int(job.meta.get("attempt", 0)), budget_returned=job.returned_tries,
                    retry=vars(policy))
    for k in ("last_error", "error_attempt", "retry_after", "last_delay", "permanent", "slip_missing",
              "render_waits", "store_full_holds"):  # (its free holds for a full store too: the host's, not the job's)
        job.meta.pop(k, None)


SLIP_MISSING_TEXT = "is missing from the slip store"
"""In the last error of a send that found no slip file (jobs.tasks.slip_missing, and the
plain PermanentError of the versions before it)."""


def slip_gone(job: PayrunJob) -> bool:
    """Whether a failed send needs its slip rendered again before it can work: its last try
    found no slip file (jobs.errors.SlipMissing; before that error existed, a permanent
    failure saying so). Told by the send host's record, not by this host's slip store,
    which may not be the shared one (an operator's shell without PAYRUN_SLIPS_DIR)."""
    if job.func_name != "jobs.tasks.send_slip" or not job.args or not isinstance(job.args[0], dict):
        return False
    return bool(job.meta.get("slip_missing")) or SLIP_MISSING_TEXT in (job.meta.get("last_error") or "")


def _render_on_its_way(conn, queue, job: PayrunJob) -> bool:
    """Whether a render job will run without being requeued: queued (and really in its
    queue), running, or waiting out a backoff."""
    from rq.job import JobStatus

    status = job.get_status(refresh=False)
    if status == JobStatus.QUEUED:
        return conn.lpos(queue.key, job.id) is not None
    return status in (JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED)


def render_again(cfg: Config, conn, send: PayrunJob, payroll_db=None, ledger=None) -> str:
    """Put the render of a failed send's slip at the front of the render queue, once more,
    for the send's retry (which waits for it without spending attempts: jobs.tasks.
    slip_missing). The render job is the one that made the slip (the pay run's, or a
    resend's), run again with a fresh budget and the employee's data read again; if Redis
    no longer has it (finished renders are kept a day), it is made again from the payroll
    database with the same id. Its end enqueues no second send (the send exists). Returns
    the render job's id; InputError when it cannot be made (no payroll database here, a
    month pruned from the ``ledger``). Two retries at once requeue it once (a lock per
    render job for the few milliseconds of this)."""
    from rq.registry import FinishedJobRegistry

    from jobs import tasks
    from payrun import payroll
    from payrun.errors import InputError

    payload = send.args[0]
    render_id = tasks.render_job_of(payload)
    if ledger is not None and (pruned := ledger.pruned_at(payload["month"])) is not None:
        raise InputError(f"{send.id}: its slip must be rendered again, and {payload['month']} was pruned from the "
                         f"ledger ({pruned[:16].replace('T', ' ')} UTC): `payrun resend` makes a new slip")
    lock = f"payrun:render-again:{render_id}"
    if not conn.set(lock, send.id, nx=True, ex=30):
        return render_id  # another retry of this slip is requeueing it right now
    try:
        queue = make_queue(keys.RENDER_QUEUE, conn)
        try:
            job = PayrunJob.fetch(render_id, connection=conn, serializer=queue.serializer)
        except NoSuchJobError:
            job = None
        if job is not None and _render_on_its_way(conn, queue, job):
            return render_id  # (a retry of the send before this one)
        resend = ":resend-" in payload["key"]
        if job is None:
            if payroll_db is None:
                raise InputError(f"{send.id}: its slip {payload['slip']} must be rendered again and its render job "
                                 f"{render_id} is no longer in Redis: retry it on the control host (the payroll "
                                 "database is there)")
            snap = payroll.employee_snapshot(payroll_db, payload["month"], payload["employee_id"])
            if snap["company"]["id"] != payload["company_id"]:
                raise InputError(f"{send.id}: its slip must be rendered again, and {payload['employee_id']}'s "
                                 f"{payload['month']} salary line is now under company {snap['company']['id']}, not "
                                 f"{payload['company_id']}: `payrun resend` makes a new slip")
            snap["key"] = payload["key"]
            snap.update({k: payload[k] for k in REISSUE_FIELDS if payload.get(k)})
            policy = cfg.render.retry
            # its tries go on from the ledger's last (a new job would start at 1 again and
            # write over the first render's history there)
            row = ledger.job(render_id) if ledger is not None else None
            tries = max((int(h["attempt"]) for h in (row or {}).get("history", [])), default=0)
            job = queue.create_job(
                "jobs.oneoff.resend_slip" if resend else "jobs.tasks.render_slip", args=(snap,), job_id=render_id,
                timeout=cfg.render.timeout_s, retry=Retry(max=policy.attempts - 1) if policy.attempts > 1 else None,
                result_ttl=24 * 3600, failure_ttl=30 * 24 * 3600,
                description=f"{'resend' if resend else 'render'} slip {payload['key']}",
                meta={"kind": "resend" if resend else "render", "key": payload["key"],
                      "company": payload["company_id"], "retry": vars(policy),
                      **({"attempt": tries, "budget_start": tries} if tries else {})})
        else:
            _fresh_budget(cfg, job)
            _refresh_snapshot(job, payroll_db)
        job.meta[tasks.RENDERED_AGAIN_FOR] = send.id
        with conn.pipeline() as pipe:  # (the enqueue saves the job, in this transaction)
            for reg in (FailedJobRegistry(queue=queue, job_class=PayrunJob, serializer=queue.serializer),
                        FinishedJobRegistry(queue=queue, job_class=PayrunJob, serializer=queue.serializer)):
                reg.remove(job, pipeline=pipe)
            queue._enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.persist(job.key)  # a finished render's key expires with its result: not while it waits
            events.emit(pipe, render_id, "queued", reset=1, kind="resend" if resend else "render",
                        company=payload["company_id"], employee=payload["employee_id"], month=payload["month"],
                        key=payload["key"], queue=keys.RENDER_QUEUE)
            pipe.execute()
        return render_id
    finally:
        conn.delete(lock)


def send_of_render(job: PayrunJob) -> str | None:
    """The id of the send a render job's end enqueues (the pay run's, or a resend's)."""
    from jobs import oneoff

    snap = job.args[0] if job.args and isinstance(job.args[0], dict) else None
    if job.func_name not in RENDER_FUNCS or snap is None:
        return None
    try:
        month, emp, key = snap["month"], snap["employee"]["id"], snap["key"]
    except (KeyError, TypeError):
        return None
    if job.func_name == "jobs.oneoff.resend_slip":
        return oneoff.resend_email_job_id(month, emp, oneoff.resend_number(key))
    return keys.email_job_id(month, emp)


def retry(cfg: Config, conn, job_ids: list[str], payroll_db=None, rendered_again: list[str] | None = None,
          refused: list[tuple[str, str]] | None = None, ledger=None) -> tuple[list[str], list[str]]:
    """Requeue failed jobs with a fresh attempt budget, reading what HR may have fixed
    since from ``payroll_db``: a send's address, a render's employee data. A send whose
    slip file was missing gets its slip rendered again first (:func:`render_again`; its
    render's id appended to ``rendered_again``); one whose render cannot be made stays
    failed, with why appended to ``refused`` (raised as InputError without it). A render
    retried by itself takes its send along when that send failed for want of the slip (a
    render that failed after its send existed: the send then waits for it); the send's id
    is added to the ids requeued. Returns (requeued, not_found)."""
    from payrun.errors import InputError

    requeued, missing = [], []
    todo = list(job_ids)
    for job_id in todo:
        reg = _failed_in(conn, job_id)
        try:
            job = PayrunJob.fetch(job_id, connection=conn, serializer=reg.serializer) if reg is not None else None
        except NoSuchJobError:
            job = None
            if conn.exists(PayrunJob.key_for(job_id)):  # its hash has no `data`: nothing to run again
                if refused is None:
                    raise InputError(f"{job_id}: {DATA_MISSING}") from None
                refused.append((job_id, DATA_MISSING))
                continue
        if job is None:
            missing.append(job_id)
            continue
        try:
            job.func_name  # its data read as JSON, never unpickled
        except DeserializationError:  # (a worker failed it as unreadable): nothing to run again
            if refused is None:
                raise InputError(f"{job_id}: {DATA_UNREADABLE}") from None
            refused.append((job_id, DATA_UNREADABLE))
            continue
        again = slip_gone(job)
        _fresh_budget(cfg, job)
        _refresh_address(job, payroll_db)
        _refresh_snapshot(job, payroll_db)
        if again:
            try:
                render_id = render_again(cfg, conn, job, payroll_db, ledger)
            except InputError as e:
                if refused is None:
                    raise
                refused.append((job_id, str(e)))
                continue
            if rendered_again is not None:
                rendered_again.append(render_id)
        job.save()
        with conn.pipeline() as pipe:
            reg.remove(job, pipeline=pipe)
            make_queue(job.origin, conn)._enqueue_job(job, pipeline=pipe)
            # a send's address, read again above: the ledger keeps the one it now goes to
            events.emit(pipe, job.id, "queued", reset=1, to=_address_of(job))
            pipe.execute()
        requeued.append(job_id)
        send_id = send_of_render(job)
        if send_id and send_id not in todo and (send_reg := _failed_in(conn, send_id)) is not None:
            send = PayrunJob.fetch(send_id, connection=conn, serializer=send_reg.serializer)
            if slip_gone(send):
                todo.append(send_id)  # (its render is on its way now: it waits for it, not renders again)
    return requeued, missing
