"""Tick jobs: what a cron tick runs on the ``control`` queue (the ledger's host). A tick
only creates work.

run_tick(entry, job, scheduled_for, options)
    1. takes the Redis lock for (entry, scheduled time) with an owner token —
       ``SET lock:cron:<entry>:<stamp> <owner> NX EX scheduler.lock_ttl_s``;
       the pay run's is ``lock:payroll:<month>`` (payrun/runs.py);
    2. inserts the unique ledger row — ``cron_runs(entry, scheduled_for)``; the pay run's
       is ``payroll_runs(company_id, month)``;
    3. only then enqueues the real jobs, in one MULTI/EXEC that WATCHes the lock: if the
       lock expired or changed hands while this owner was paused, nothing is enqueued.
    The lock is released only by its owner (compare-and-delete).

record_not_run(entry, job, ticks, status, detail)   rows for missed / coalesced ticks (meta: unlisted)
reap()                                              the reaper tick's real job
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from redis import WatchError
from rq import Retry, get_current_job

from payrun import keys

log = logging.getLogger("payrun.ticks")

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lock_key(entry: str, stamp: str) -> str:
    return f"lock:cron:{entry}:{stamp}"


def tick_job_id(entry: str, stamp: str) -> str:
    return f"tick-{entry}-{stamp}"


def _test_pause(where: str, entry: str) -> None:
    """TEST ONLY (PAYRUN_TEST_TICK_PAUSE=<dir>): announce that this process reached
    ``where`` and wait for <dir>/go, so a test can SIGSTOP it at a known point."""
    d = os.environ.get("PAYRUN_TEST_TICK_PAUSE")
    if not d:
        return
    path = Path(d)
    (path / f"reached-{entry}-{where}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (path / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def run_tick(entry: str, job: str, scheduled_for: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    from jobs.tasks import settings
    from scheduler.store import Store

    cfg = settings()
    current = get_current_job()
    conn = current.connection
    options = options or {}
    store = Store(cfg.ledger_path)
    try:
        if job == "payroll":
            return _payroll_tick(cfg, conn, store, entry, scheduled_for, options)
        return _cron_tick(cfg, conn, store, entry, job, scheduled_for, options)
    finally:
        store.close()


def _detail(options: dict[str, Any], text: str) -> str:
    n = int(options.get("coalesced") or 0)
    return text + (f"; caught up after downtime (superseded {n} earlier tick(s))" if n else "")


def _payroll_tick(cfg, conn, store, entry: str, scheduled_for: str, options: dict[str, Any]) -> dict[str, Any]:
    """The pay run: exactly what `payrun run --month M` does (payrun/runs.py: lock
    lock:payroll:<month>, unique payroll_runs rows, fan-out), so cron and the command for
    the same month make one set of jobs. The cron_runs row records the tick's outcome."""
    from zoneinfo import ZoneInfo

    from payrun import payroll, runs
    from scheduler.cron import from_iso, pay_month

    month = pay_month(from_iso(scheduled_for), ZoneInfo(cfg.timezone), options.get("month", "previous"))
    owner = runs.new_owner()
    first = store.claim_tick(entry, scheduled_for, "payroll", owner)
    ledger = _PausingLedger(store.ledger, entry) if os.environ.get("PAYRUN_TEST_TICK_PAUSE") else store.ledger
    db = payroll.PayrollDB(cfg.payroll_path)
    try:
        if not payroll.company_ids_for(db, month):
            text = f"no salary lines for {month}: nothing to pay (import them, then `payrun run --month {month}`)"
            if first:
                store.finish_tick(entry, scheduled_for, "failed", 0, _detail(options, text), owner=owner)
            log.error("payroll tick %s: %s", scheduled_for, text)
            return {"month": month, "error": text}
        result = runs.start_run(cfg, conn, ledger, db, month, owner=owner)
    finally:
        db.close()
    if result.locked_by:
        text = f"pay run for {month} in progress elsewhere (lock held by {result.locked_by})"
    elif result.aborted:
        text = f"stopped: {result.aborted}"
    else:
        text = f"{month}: {result.jobs} render jobs for {len(result.created)} companies"
        if result.already:
            text += f"; {len(result.already)} companies already run"
    status = "aborted" if result.aborted else "enqueued"
    if result.jobs:  # in the audit log as `payrun run` is ("who started this run?" had no answer there)
        from payrun import audit

        try:
            audit.audit(cfg, audit.Outcome("run", f"cron {entry} ({scheduled_for}): payrun run --month {month}",
                                           result.jobs, ok=not result.aborted,
                                           message=f"created {result.jobs:,} render job(s) for {month}"), via="cron")
        except OSError as e:  # the run is made; a log line must not fail the tick
            log.warning("payroll tick %s: could not write the audit log: %s", scheduled_for, e)
    if first:
        store.finish_tick(entry, scheduled_for, status, result.jobs, _detail(options, text), owner=owner)
    elif result.jobs:
        store.finish_tick(entry, scheduled_for, status, result.jobs, "resumed by a second run: " + text)
    return {"entry": entry, "scheduled_for": scheduled_for, "first": first, **result.to_dict()}


class _PausingLedger:
    """TEST ONLY: the ledger, with a pause point right after a payroll_runs row is claimed."""

    def __init__(self, ledger, entry: str):
        self._ledger, self._entry = ledger, entry

    def __getattr__(self, name):
        return getattr(self._ledger, name)

    def claim_run(self, company_id: int, month: str, owner: str) -> bool:
        ok = self._ledger.claim_run(company_id, month, owner)
        if ok:
            _test_pause("after-row", self._entry)
        return ok


def _cron_tick(cfg, conn, store, entry: str, job: str, scheduled_for: str, options: dict[str, Any]) -> dict[str, Any]:
    from payrun.runs import new_owner
    from scheduler.cron import from_iso, stamp

    st = stamp(from_iso(scheduled_for))
    owner = new_owner()
    lock = lock_key(entry, st)
    ttl = int(cfg.scheduler.lock_ttl_s)
    if not conn.set(lock, owner, nx=True, ex=ttl):
        holder = conn.get(lock)
        holder = holder.decode() if isinstance(holder, bytes) else holder
        log.warning("tick %s %s: lock held by %s; doing nothing", entry, scheduled_for, holder)
        return {"entry": entry, "scheduled_for": scheduled_for, "locked_by": holder, "jobs_created": 0}
    try:
        if not store.claim_tick(entry, scheduled_for, job, owner):
            log.warning("tick %s %s: already ran (unique row); doing nothing", entry, scheduled_for)
            return {"entry": entry, "scheduled_for": scheduled_for, "already": True, "jobs_created": 0}
        _test_pause("after-row", entry)
        datas, text = _real_jobs(cfg, conn, store, entry, job, st, scheduled_for)
        created = _enqueue_if_owner(conn, lock, owner, ttl, datas)
        if created is None:
            text = "lock expired or changed hands while this run was paused: enqueued nothing"
            store.finish_tick(entry, scheduled_for, "aborted", 0, _detail(options, text), owner=owner)
            log.error("tick %s %s: %s", entry, scheduled_for, text)
            return {"entry": entry, "scheduled_for": scheduled_for, "aborted": text, "jobs_created": 0}
        store.finish_tick(entry, scheduled_for, "enqueued", created, _detail(options, text), owner=owner)
        return {"entry": entry, "scheduled_for": scheduled_for, "jobs_created": created}
    finally:
        conn.eval(_RELEASE, 1, lock, owner)


def _real_jobs(cfg, conn, store, entry: str, job: str, st: str, scheduled_for: str) -> tuple[list, str]:
    """The jobs a tick creates, as (queue name, EnqueueData-like kwargs) pairs."""
    control = keys.CONTROL_QUEUE
    if job == "reaper":
        return [(control, dict(func="scheduler.ticks.reap", args=(scheduled_for,), job_id=f"reap-{entry}-{st}",
                               timeout=120, description=f"reaper ({entry} {scheduled_for})"))], "reaper enqueued"
    if job == "bank-status":
        months = store.ledger.months()
        if not months:
            return [], "no pay run yet: nothing to check"
        month = months[-1]
        datas = []
        for run in store.ledger.runs(month):
            cid = run["company_id"]
            counts = store.credit_counts(month, cid)
            if counts and counts.get("credited", 0) == sum(counts.values()) >= run["jobs"]:
                continue  # every salary of this company already reached its account
            datas.append((control, dict(
                func="scheduler.bank.check_company", args=(month, cid, scheduled_for),
                job_id=f"bank-{entry}-{st}-{month}-c{cid}", timeout=60, retry=Retry(max=2),
                description=f"bank credits {month} company {cid}",
                meta={"kind": "bank", "retry": {"base_s": 5.0, "cap_s": 60.0, "attempts": 3}})))
        return datas, f"{month}: {len(datas)} compan{'y' if len(datas) == 1 else 'ies'} to check"
    raise ValueError(f"unknown tick job {job!r}")


def _enqueue_if_owner(conn, lock: str, owner: str, ttl: int, datas: list) -> int | None:
    """Enqueue every job in one transaction that WATCHes the lock; None if the lock is not
    ours any more (it expired while we were paused, or another run took it)."""
    from jobs.runtime import make_queue

    queues: dict[str, Any] = {}
    with conn.pipeline() as pipe:
        try:
            pipe.watch(lock)
            held = pipe.get(lock)
            if (held.decode() if isinstance(held, bytes) else held) != owner:
                return None
            pipe.multi()
            for qname, kw in datas:
                q = queues.setdefault(qname, make_queue(qname, conn))
                kw = dict(kw)
                meta = {"kind": "tick-work", **kw.pop("meta", {})}
                q.enqueue_call(kw.pop("func"), args=kw.pop("args"), result_ttl=7 * 24 * 3600,
                               failure_ttl=30 * 24 * 3600, meta=meta, pipeline=pipe, **kw)
            pipe.expire(lock, ttl)
            pipe.execute()
        except WatchError:
            return None
    return len(datas)


def record_not_run(entry: str, job: str, ticks: list[str], status: str, detail: str) -> int:
    """Rows for ticks that did not run: 'missed' (past the catch-up window) or 'coalesced'.
    ``ticks`` is at most the pass's newest 50; the job's ``meta['unlisted']`` counts its
    older ones (in meta, not an argument: a control worker of the version before takes
    the job during a deploy and records the rows as before)."""
    from jobs.tasks import settings
    from scheduler.store import Store

    current = get_current_job()
    unlisted = int((current.meta or {}).get("unlisted") or 0) if current is not None else 0
    store = Store(settings().ledger_path)
    try:
        n = store.record_not_run(entry, job, ticks, status, detail, unlisted=unlisted)
    finally:
        store.close()
    if status == "missed":
        from scheduler.service import missed_is_error

        (log.error if missed_is_error(job) else log.warning)(
            "cron %s: %d tick(s) missed: %s", entry, len(ticks) + unlisted, detail)
    return n


def reap(scheduled_for: str | None = None) -> dict[str, Any]:
    """The reaper tick's real job: return jobs of dead workers (jobs/reaper.py)."""
    from jobs import reaper

    returned = reaper.reap(get_current_job().connection)
    return {"returned": [s.job_id for s in returned], "tick": scheduled_for}
