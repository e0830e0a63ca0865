"""Retention. Redis forgets on its own: finished jobs after a day (result_ttl), failed
jobs after 30 days (failure_ttl), sent idempotency keys after 90 days, ledger events once
applied. The ledger keeps history until `payrun prune --before YYYY-MM` removes the
months before that one (jobs, attempts, pay-run rows), and with --slips their PDFs."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass

from payrun.config import Config
from payrun.ledger import Ledger, utcnow


@dataclass
class Pruned:
    months: list[str]
    jobs: int
    attempts: int
    runs: int
    slip_dirs: int
    refused: str | None = None
    """A dry run's answer when the real one would be refused (without --force)."""


LIVE_STATUSES = ("queued", "started", "scheduled", "deferred")
"""RQ statuses of a job not finished: a worker still takes it, or holds it, or a backoff
will put it back."""


def live_in_redis(conn, ids_by_month: dict[str, list[str]]) -> dict[str, int]:
    """Of each month's unfinished ledger jobs, how many Redis still holds unfinished (the
    others Redis forgot: nothing will finish them, only --force prunes them)."""
    from payrun.keys import job_field

    live: dict[str, int] = {}
    for month, ids in ids_by_month.items():
        n = sum(1 for _, st in job_field(conn, ids, "status") if st is not None and st.decode() in LIVE_STATUSES)
        if n:
            live[month] = n
    return live


def forced_refusal(months: list[str], live: dict[str, int]) -> str | None:
    """Why even --force must not prune these months, or None: a month whose jobs Redis
    still holds is being made now; pruning it deleted the ledger rows its workers report
    to and (with --slips) the slips its sends were about to attach, and the pay-run rows
    that keep `payrun run` from making it a second time."""
    busy = [f"{m} has {n:,} job{'' if n == 1 else 's'} still queued, running or waiting to retry in Redis"
            for m, n in sorted(live.items()) if m in months and n]
    if not busy:
        return None
    first = min(m for m, n in live.items() if m in months and n)
    return ("refusing to prune, even with --force: " + "; ".join(busy) + " (a month still being made: its "
            f"ledger rows and slips are needed; let it finish, `payrun status --month {first}`, or prune older months)")


def refusal(months: list[str], started_last: str | None, highest: str | None,
            unfinished: dict[str, int]) -> str | None:
    """Why pruning these months would hurt, or None. The pay run started last (the one
    `payrun status` shows), the latest month run, and any month with jobs not finished
    (queued, running, retrying) are kept: their ledger rows are what says who got a slip,
    and a month pruned and then run again is not supported. --force overrides this (not
    `forced_refusal`). When an older month was run after a later one, the two are named
    apart: both read "is the latest pay run" (a fresh-clone walkthrough, session 43)."""
    if started_last == highest:
        latest = {started_last: "is the latest pay run"}
    else:
        latest = {started_last: "is the pay run started last (the one `payrun status` shows)",
                  highest: "is the latest month run"}
    why = [f"{m} {what}" for m, what in sorted((m, w) for m, w in latest.items() if m) if m in months]
    busy = [f"{m} has {n:,} unfinished job{'' if n == 1 else 's'}" for m, n in sorted(unfinished.items())
            if m in months]
    why += busy
    if not why:
        return None
    return "refusing to prune: " + "; ".join(why) + " (prune older months, or add --force)"


def prune(cfg: Config, ledger: Ledger, before: str, slips: bool = False, dry_run: bool = False,
          force: bool = False, redis=None) -> Pruned:
    """``redis``: a callable giving a Redis connection, asked only when --force meets
    months with unfinished ledger jobs (are they still in Redis?)."""
    from payrun.errors import InputError

    db = ledger.db.conn
    months = [r[0] for r in db.execute(
        "SELECT DISTINCT month FROM jobs WHERE month < ? UNION SELECT DISTINCT month FROM payroll_runs WHERE month < ?"
        " ORDER BY 1", (before, before)) if r[0]]
    refused = None
    if not force:
        unfinished = dict(db.execute(
            "SELECT month, COUNT(*) FROM jobs WHERE month < ? AND status IN ('queued', 'running', 'retrying')"
            " GROUP BY month", (before,)).fetchall())
        # the run started last, and the highest month run (an old month re-run for one
        # company after it must not expose this month)
        refused = refusal(months, ledger.latest_month(), max(ledger.months(), default=None), unfinished)
        if refused and not dry_run:
            raise InputError(refused)
    else:
        ids_by_month: dict[str, list[str]] = {}
        for month, job_id in db.execute("SELECT month, id FROM jobs WHERE month < ? AND status IN "
                                        "('queued', 'running', 'retrying')", (before,)):
            ids_by_month.setdefault(month, []).append(job_id)
        if ids_by_month:
            if redis is None:
                raise InputError("refusing to prune with --force: cannot tell whether the unfinished jobs of "
                                 f"{', '.join(sorted(ids_by_month))} are still in Redis")
            refused = forced_refusal(months, live_in_redis(redis(), ids_by_month))
            if refused and not dry_run:
                raise InputError(refused)
    jobs = db.execute("SELECT COUNT(*) FROM jobs WHERE month < ?", (before,)).fetchone()[0]
    attempts = db.execute(
        "SELECT COUNT(*) FROM attempts WHERE job_id IN (SELECT id FROM jobs WHERE month < ?)", (before,)).fetchone()[0]
    runs = db.execute("SELECT COUNT(*) FROM payroll_runs WHERE month < ?", (before,)).fetchone()[0]
    slip_dirs = [d for d in (_month_dir(cfg, m) for m in months) if d is not None] if slips else []
    if not dry_run:
        with db:
            db.execute("DELETE FROM attempts WHERE job_id IN (SELECT id FROM jobs WHERE month < ?)", (before,))
            db.execute("DELETE FROM jobs WHERE month < ?", (before,))
            db.execute("DELETE FROM payroll_runs WHERE month < ?", (before,))
            db.executemany("INSERT OR REPLACE INTO pruned_months (month, pruned_at) VALUES (?, ?)",
                           [(m, utcnow()) for m in months])
        for d in slip_dirs:
            shutil.rmtree(d)
    return Pruned(months, jobs, attempts, runs, len(slip_dirs), refused)


_MONTH_DIR = re.compile(r"[0-9]{4}-[0-9]{2}")


def _month_dir(cfg: Config, month: str):
    """The slip folder of `month`, if it is one: a month as the ledger recorded it is text
    that came through Redis, and only ``YYYY-MM`` directly inside the slip store is ever
    deleted (a forged ``../..`` month sorts before every real one)."""
    if not isinstance(month, str) or not _MONTH_DIR.fullmatch(month):
        return None
    d = cfg.slips_dir / month
    if d.is_symlink() or not d.is_dir() or d.resolve().parent != cfg.slips_dir.resolve():
        return None
    return d
