"""One pay run: lock, unique row, fan-out.

1. ``SET lock:payroll:<month> <owner> NX EX 900`` — the ordinary day's guard against a
   second server. Released only by its owner (compare-and-delete), extended while the
   fan-out runs, and checked before every chunk: an owner that was paused past the TTL
   finds it lost and enqueues nothing more.
2. ``INSERT payroll_runs(company_id, month)`` (unique) — the rare day's guard, when a
   lock expired under a paused owner.
3. Fan-out: one render job per employee carrying its data snapshot, written to the ledger
   and enqueued to Redis in chunks, one atomic script per chunk (``payrun.bulk``: the
   records RQ's ``enqueue_many`` would write, without its per-job Python cost).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rq import Retry

from jobs.runtime import make_queue
from payrun import bulk, keys
from payrun.config import Config
from payrun.errors import InputError
from payrun.ledger import Ledger
from payrun.payroll import leaving_date_problem  # noqa: F401 - where `employee left` finds it

log = logging.getLogger("payrun.runs")

LOCK_TTL_S = 900
CHUNK = 1000
RENDER_FUNC = "jobs.tasks.render_slip"

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2])) end
return 0
"""


class LockLost(Exception):
    """The pay-run lock expired or was taken by another owner while we held it."""


@dataclass
class RunResult:
    month: str
    owner: str
    locked_by: str | None = None
    """Set when another owner held the lock: nothing was done."""
    created: dict[int, int] = field(default_factory=dict)
    """company id -> jobs created by this call."""
    already: list[int] = field(default_factory=list)
    """Companies whose run for this month already exists (unique row)."""
    aborted: str | None = None
    resumed: list[int] = field(default_factory=list)
    """Companies whose half-done fan-out this call completed (``resume``)."""
    added: list[int] = field(default_factory=list)
    """Companies already run whose employees imported since got their jobs (``resume``)."""

    @property
    def jobs(self) -> int:
        return sum(self.created.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "month": self.month, "owner": self.owner, "locked_by": self.locked_by,
            "jobs_created": self.jobs, "companies_created": sorted(set(self.created) - set(self.added)),
            "companies_already_run": sorted(self.already), "companies_resumed": sorted(self.resumed),
            "companies_added_to": sorted(self.added), "aborted": self.aborted,
        }


def behind(ledger: Ledger, payroll_db, month: str) -> list[int]:
    """Companies whose run for ``month`` is complete but who have employees with salary
    lines for it and no job of that month at all (imported after the run): what
    ``start_run(..., resume=True)`` would create slips for."""
    return sorted(missing_slips(ledger, payroll_db, month))


def behind_for(ledger: Ledger, payroll_db, month: str, employee_ids) -> list[int]:
    """The companies of :func:`behind` that these employees (a file just imported) leave
    behind: the ones with one of them among the employees the month's run has no job for."""
    done = [r["company_id"] for r in ledger.runs(month) if r["status"] != "fanning-out"]
    mine = set(employee_ids)
    return sorted(cid for cid, ids in without_slip(ledger, payroll_db, month, done).items() if ids & mine)


def missing_slips(ledger: Ledger, payroll_db, month: str) -> dict[int, int]:
    """Per company of :func:`behind`, how many employees have no slip job."""
    return {cid: len(ids) for cid, ids in missing_slip_ids(ledger, payroll_db, month).items()}


def missing_slip_ids(ledger: Ledger, payroll_db, month: str) -> dict[int, set[str]]:
    """Per company whose run of ``month`` is made, the employees it pays (``in_month_run``)
    with no slip job: added after the run, or a leaver of the month it left out
    (payrun.status tells them apart). Companies with none are left out."""
    done = [r["company_id"] for r in ledger.runs(month) if r["status"] != "fanning-out"]
    return {cid: ids for cid, ids in without_slip(ledger, payroll_db, month, done).items() if ids}


def not_run(ledger: Ledger, payroll_db, month: str, company_id: int | None = None) -> dict[int, int]:
    """Companies with salary lines for ``month`` that no run of that month covered (none
    started for them, no slip job of theirs), and how many employees each: imported
    after the run, or left out by `run --company`. `payrun run --month M` covers them."""
    from payrun import payroll

    started = {r["company_id"] for r in ledger.runs(month)} | ledger.companies_with_slips(month)
    return {cid: payroll.count_employees(payroll_db, month, cid)
            for cid in payroll.company_ids_for(payroll_db, month, company_id) if cid not in started}


def no_slip(ledger: Ledger, payroll_db, month: str) -> dict[int, int]:
    """Per company, employees with salary lines for ``month`` and no slip: those
    :func:`missing_slips` counts (added after their company's run) and those of
    companies the month's run never covered (:func:`not_run`). `payrun status` and the
    console's HR line count these."""
    return {**missing_slips(ledger, payroll_db, month), **not_run(ledger, payroll_db, month)}


def without_slip(ledger: Ledger, payroll_db, month: str, companies: list[int]) -> dict[int, set[str]]:
    """Per company, the employees with salary lines for ``month`` and no job of that month
    at all (a resend by hand, or a job made under another company, counts as one)."""
    from payrun import payroll

    if not companies:
        return {}
    known = ledger.employees_with_jobs(month)
    if len(companies) == 1:
        return {companies[0]: payroll.employee_ids(payroll_db, month, companies[0]) - known}
    every = payroll.employee_ids_by_company(payroll_db, month)
    return {cid: every.get(cid, set()) - known for cid in companies}


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def acquire(conn, month: str, owner: str, ttl_s: int = LOCK_TTL_S) -> bool:
    return bool(conn.set(keys.payroll_lock(month), owner, nx=True, ex=ttl_s))


def release(conn, month: str, owner: str) -> bool:
    return bool(conn.eval(_RELEASE, 1, keys.payroll_lock(month), owner))


def extend(conn, month: str, owner: str, ttl_s: int = LOCK_TTL_S) -> bool:
    return bool(conn.eval(_EXTEND, 1, keys.payroll_lock(month), owner, ttl_s))


def validate_month(month: str) -> str:
    import re

    if not re.fullmatch(r"[0-9]{4}-[0-9]{2}", month or ""):  # ASCII digits: months compare as text
        raise InputError(f"--month must look like 2026-11 (YYYY-MM), got {month!r}")
    if not 1 <= int(month[5:]) <= 12:
        raise InputError(f"--month must look like 2026-11 (YYYY-MM): {month!r} has no month {month[5:]} "
                         "(months are 01-12)")
    return month


def start_run(
    cfg: Config,
    conn,
    ledger: Ledger,
    payroll_db,
    month: str,
    company_id: int | None = None,
    owner: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    resume: bool = False,
) -> RunResult:
    """Create the month's jobs once. Safe to call again, or on two servers at once.

    ``resume``: a company whose run row is still ``fanning-out`` (its fan-out died half-way)
    is completed: only the jobs missing from Redis are enqueued. Use it only once the
    process that started that run is known to be gone (we hold the month's lock, so it
    does not hold it any more). A company whose run is complete gets jobs for the
    employees with salary lines for the month and no slip job in the ledger (imported
    after the run; a job's ledger row is written before it is enqueued)."""
    from payrun import payroll

    validate_month(month)
    if (pruned := ledger.pruned_at(month)) is not None:
        raise InputError(f"{month} was pruned from the ledger ({pruned[:16].replace('T', ' ')} UTC) and cannot be "
                         f"run again: its jobs' ids can still be in Redis (finished ones for a day, failed ones "
                         f"for 30 days), so new renders would queue no sends and the month would never finish")
    owner = owner or new_owner()
    result = RunResult(month=month, owner=owner)
    companies = payroll.company_ids_for(payroll_db, month, company_id)
    if company_id is not None and not companies:
        if company_id not in {c["id"] for c in payroll.companies(payroll_db)}:
            raise InputError(f"no company {company_id} in the payroll database")
        raise InputError(f"company {company_id} has no salary lines for {month} (import or seed them first)")
    if not companies:
        raise InputError(f"no salary lines for {month}: import them (`payrun import FILE.csv`) or "
                         f"make sample ones (`payrun seed --month {month}`)")
    if not acquire(conn, month, owner):
        holder = conn.get(keys.payroll_lock(month))
        result.locked_by = holder.decode() if isinstance(holder, bytes) else holder
        return result
    try:
        total = payroll.count_employees(payroll_db, month, company_id)
        done = 0
        queue = make_queue(keys.RENDER_QUEUE, conn)
        retry = Retry(max=cfg.render.retry.attempts - 1) if cfg.render.retry.attempts > 1 else None
        meta_retry = vars(cfg.render.retry)
        job_options = dict(timeout=cfg.render.timeout_s, retry=retry, result_ttl=24 * 3600,
                           failure_ttl=30 * 24 * 3600)
        tpl = bulk.template(queue, RENDER_FUNC, **job_options)
        bulk_enqueuer = bulk.BulkEnqueuer(conn, tpl) if tpl is not None else None
        for cid in companies:
            claimed, resuming = ledger.claim_run(cid, month, owner), False
            top_up: list[dict[str, Any]] | None = None  # a complete run's newcomers (``resume``)
            if not claimed and resume:
                row = next((r for r in ledger.runs(month) if r["company_id"] == cid), None)
                resuming = row is not None and row["status"] == "fanning-out"
                if row is not None and not resuming:
                    missing = without_slip(ledger, payroll_db, month, [cid])[cid]
                    top_up = [s for s in payroll.snapshots(payroll_db, month, cid)
                              if s["employee"]["id"] in missing] or None
            if not claimed and not resuming and top_up is None:
                result.already.append(cid)
                done += payroll.count_employees(payroll_db, month, cid)
                if progress:
                    progress(done, total)
                continue
            # its name and address of this month, before its first snapshot is read
            payroll.keep_company_details(payroll_db, month, cid)
            created = 0
            batch: list[dict[str, Any]] = []

            def flush() -> None:
                nonlocal created, done
                if not batch:
                    return
                if not extend(conn, month, owner):
                    raise LockLost(f"lock:payroll:{month} is no longer ours")
                if resuming or top_up is not None:  # keep only the jobs never enqueued
                    with conn.pipeline(transaction=False) as p:
                        for snap in batch:
                            p.exists(queue.job_class.key_for(keys.render_job_id(month, snap["employee"]["id"])))
                        present = p.execute()
                    batch[:] = [snap for snap, there in zip(batch, present) if not there]
                    if not batch:
                        return
                # (job id, argument, description, meta) of each job, as RQ stores them
                jobs = [(keys.render_job_id(month, s["employee"]["id"]), s, f"render slip {s['key']}",
                         {"kind": "render", "key": s["key"], "company": cid, "retry": meta_retry}) for s in batch]
                ledger.create_jobs(
                    {"id": job_id, "kind": "render", "company_id": cid, "employee_id": s["employee"]["id"],
                     "month": month, "key": s["key"], "queue": keys.RENDER_QUEUE}
                    for job_id, s, _, _ in jobs
                )
                if bulk_enqueuer is not None:
                    bulk_enqueuer.enqueue(bulk_enqueuer.job_args(*j) for j in jobs)
                else:  # an RQ whose enqueue this module cannot repeat: its own (slower) path
                    with conn.pipeline() as pipe:
                        queue.enqueue_many(
                            [queue.prepare_data(RENDER_FUNC, args=(s,), job_id=job_id, description=description,
                                                meta=meta, **job_options)
                             for job_id, s, description, meta in jobs],
                            pipeline=pipe,
                        )
                        pipe.execute()
                log.debug("enqueued %d render jobs of company %s (%s .. %s)", len(batch), cid,
                          batch[0]["employee"]["id"], batch[-1]["employee"]["id"])
                created += len(batch)
                done += len(batch)
                batch.clear()
                if progress:
                    progress(done, total)

            for snap in (top_up if top_up is not None else payroll.snapshots(payroll_db, month, cid)):
                batch.append(snap)
                if len(batch) >= CHUNK:
                    flush()
            flush()
            if top_up is not None and not created:  # their jobs were in Redis after all
                result.already.append(cid)
                continue
            ledger.finish_run(cid, month, created if not (resuming or top_up is not None) else
                              payroll.count_employees(payroll_db, month, cid))
            result.created[cid] = created
            if resuming:
                result.resumed.append(cid)
            elif top_up is not None:
                result.added.append(cid)
    except LockLost as e:
        result.aborted = str(e)
    finally:
        release(conn, month, owner)
    return result
