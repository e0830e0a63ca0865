"""The HR view: slips per company and in total, from the ledger.

A slip is ``done`` when its email was delivered, ``failed`` when its render or its send
failed for good, otherwise in the state of its current job; ``stuck`` counts slips whose
job has been running longer than lease.stuck_after_s (10 minutes by default), or whose
worker is gone or lease lapsed in Redis (the reaper returns those within seconds).
"""

from __future__ import annotations

from typing import Any

from payrun.config import Config
from payrun.ledger import STATES, Ledger, backlog


def _company_names(cfg: Config) -> dict[int, str]:
    if not cfg.payroll_path.exists():
        return {}
    from payrun import payroll

    with payroll.PayrollDB(cfg.payroll_path) as db:
        return {int(c["id"]): c["name"] for c in payroll.companies(db)}


def report(cfg: Config, ledger: Ledger, month: str | None = None, company: int | None = None,
           conn=None) -> dict[str, Any]:
    if month is None:
        months = ledger.months()
        month = months[-1] if months else None
    counts = ledger.slip_counts(month, company) if month else {}
    if month:
        redis_stuck: list[str] = []
        if conn is not None:
            from jobs.reaper import find_stuck

            try:
                redis_stuck = [s.job_id for s in find_stuck(conn)]
            except Exception:  # Redis unreachable: the ledger's own rule still applies
                redis_stuck = []
        for job_id, cid in ledger.stuck_jobs(month, cfg.lease.stuck_after_s, redis_stuck).items():
            if cid in counts and (company is None or cid == company):
                counts[cid]["stuck"] += 1
    names = _company_names(cfg)
    zero = {s: 0 for s in STATES} | {"stuck": 0, "total": 0}
    total = dict(zero)
    companies = []
    for cid in sorted(counts):
        row = counts[cid]
        for k in total:
            total[k] += row.get(k, 0)
        companies.append({"id": cid, "name": names.get(cid, f"company {cid}"), **row})
    return {
        "month": month,
        "total": total,
        "companies": companies,
        "ledger_backlog": backlog(conn) if conn is not None else None,
    }


def hr_line(c: dict[str, int]) -> str:
    waiting = c["queued"] + c["running"] + c["retrying"]
    parts = [f"{c['done']:,} sent"]
    if c["stuck"]:
        parts.append(f"{c['stuck']:,} stuck")
    if waiting - c["stuck"] > 0:
        parts.append(f"{waiting - c['stuck']:,} in progress")
    parts.append(f"{c['failed']:,} failed")
    return ", ".join(parts)


def format_report(r: dict[str, Any]) -> str:
    if not r["month"]:
        return "no pay run yet: `payrun run --month YYYY-MM` starts one"
    lines = [f"Pay run {r['month']}: {r['total']['total']:,} slips"]
    head = f"{'id':>4}  {'company':<30} {'sent':>7} {'queued':>7} {'running':>7} {'retrying':>8} {'failed':>7} {'stuck':>6}"
    lines.append(head)
    for c in r["companies"]:
        lines.append(
            f"{c['id']:>4}  {c['name'][:30]:<30} {c['done']:>7,} {c['queued']:>7,} {c['running']:>7,} "
            f"{c['retrying']:>8,} {c['failed']:>7,} {c['stuck']:>6,}"
        )
    lines.append(f"Total: {hr_line(r['total'])}")
    if r.get("ledger_backlog"):
        lines.append(f"(ledger is {r['ledger_backlog']:,} updates behind: is `payrun ledger` running?)")
    return "\n".join(lines)
