"""The status ledger: one SQLite row per job, on the control host only.

Workers never open this file. They append state changes to the Redis stream
``payrun:events`` (jobs/events.py); one ``payrun ledger`` process reads it through a
consumer group and applies the changes here in batches, acknowledging them only after
the SQLite transaction commits, so a restarted ledger re-applies what it had not
committed (applying is idempotent: the same event gives the same row).

Tables
  jobs          one row per job (render or email): status, attempts, last error, times
  attempts      one row per try of a job: worker, start, end, outcome (held, requeued, reaped:
                spent no attempt), error, delay
  payroll_runs  UNIQUE(company_id, month): the second guard (after the Redis lock) that
                makes a pay run happen once
  pruned_months the months `payrun prune` removed

A send's row keeps the address it was made with (``recipient``, never logged); no row
holds a salary figure.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlite_utils

from jobs.events import RETURNED_OUTCOMES, attempts_spent, outcome_of
from payrun import diskspace

STATES = ("queued", "running", "retrying", "done", "failed")

MIGRATE_WAIT_MS = 900_000
"""How long a process opening a ledger being upgraded waits for the upgrade (building
migration 2's indexes took 5 s per million job rows here, 35 s at five million)."""

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        company_id INTEGER,
        employee_id TEXT,
        month TEXT,
        key TEXT,
        queue TEXT,
        status TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        last_error TEXT,
        worker TEXT,
        created_at TEXT,
        updated_at TEXT,
        started_at TEXT,
        finished_at TEXT
    );
    CREATE INDEX IF NOT EXISTS jobs_month_kind ON jobs(month, kind, company_id);
    CREATE INDEX IF NOT EXISTS jobs_key ON jobs(key, kind);
    CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
    CREATE TABLE IF NOT EXISTS attempts (
        job_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        worker TEXT,
        started_at TEXT,
        ended_at TEXT,
        outcome TEXT,
        error TEXT,
        delay_s REAL,
        PRIMARY KEY (job_id, attempt)
    );
    CREATE TABLE IF NOT EXISTS payroll_runs (
        company_id INTEGER NOT NULL,
        month TEXT NOT NULL,
        owner TEXT,
        status TEXT NOT NULL,
        jobs INTEGER NOT NULL DEFAULT 0,
        created_at TEXT,
        updated_at TEXT,
        PRIMARY KEY (company_id, month)
    );
    """,
    # 2: the HR line's per-company slip counts (SLIP_STATUS_SQL: every render row of the
    # month joined to its email row by key) read status from the indexes alone instead of
    # 100,000 table rows at 50,000 slips: 158 against 330 ms per count in one run. Each
    # new index starts with the old one's columns, so every other query keeps its index.
    """
    CREATE INDEX IF NOT EXISTS jobs_month_kind_slip ON jobs(month, kind, company_id, key, status);
    CREATE INDEX IF NOT EXISTS jobs_key_status ON jobs(key, kind, status);
    DROP INDEX IF EXISTS jobs_month_kind;
    DROP INDEX IF EXISTS jobs_key;
    """,
    # 3: the months `payrun prune` removed, so that `payrun run` can refuse one (its jobs'
    # ids can still be in Redis: the new renders would queue no sends, and never finish)
    """
    CREATE TABLE IF NOT EXISTS pruned_months (month TEXT PRIMARY KEY, pruned_at TEXT NOT NULL);
    """,
    # 4: the address a send job was made with (or a retry gave it), from its "queued" event's
    # ``to``: whether a send went to the address on file now, once Redis has dropped the
    # finished job (a day): `payrun import` called an address changed A -> B -> A "the old
    # address" then. NULL for sends made before (or by workers of an older version). Adding
    # a column with no default rewrites no row: instant at millions of jobs.
    """
    ALTER TABLE jobs ADD COLUMN recipient TEXT;
    """,
]

JOB_COLUMNS = ("id", "kind", "company_id", "employee_id", "month", "key", "queue", "status", "attempts",
               "last_error", "worker", "created_at", "updated_at", "started_at", "finished_at")
"""The columns of ``jobs`` that :meth:`Ledger.job` and :meth:`Ledger.jobs` read (`payrun job
--json`, the console), in the order the JSON shows them. Named, not ``SELECT *`` less a list
of private ones: a column a later migration adds (a newer host's, during a rolling deploy)
appears only once the code here names it. Not ``recipient`` (migration 4): `payrun job` shows
the address beside the row, with the name, as ``recipient`` (payrun.recipient), and the
console's lists have no use for it (read it with :meth:`Ledger.recipients`)."""

ATTEMPT_COLUMNS = ("job_id", "attempt", "worker", "started_at", "ended_at", "outcome", "error", "delay_s")
"""The columns of ``attempts`` a job's ``history`` shows, as JOB_COLUMNS for ``jobs``."""

_JOB_SELECT = "SELECT " + ", ".join(f'"{c}"' for c in JOB_COLUMNS) + " FROM jobs"
_ATTEMPT_SELECT = "SELECT " + ", ".join(f'"{c}"' for c in ATTEMPT_COLUMNS) + " FROM attempts"


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _secure_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    else:  # one copied in, or made under another umask: owner-only again, -wal and -shm too
        from payrun.files import sqlite_owner_only

        sqlite_owner_only(path)


class Ledger:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        _secure_file(self.path)
        self.db = sqlite_utils.Database(self.path)
        self.db.conn.execute("PRAGMA busy_timeout = 10000")
        self.db.conn.execute("PRAGMA journal_mode = WAL")
        self.db.conn.execute("PRAGMA synchronous = NORMAL")
        self._migrate()

    def _migrate(self) -> None:
        """Bring the schema to version len(MIGRATIONS), once, whichever process opens the
        ledger first after an upgrade: in one IMMEDIATE transaction, the version re-read
        under the write lock (so processes started together do the work once), every
        statement inside it (executescript would commit each one, leaving a moment with
        the old index dropped and the new one not built). Writers that arrive meanwhile
        wait up to their busy timeout; processes that open the ledger wait for it to end."""
        conn = self.db.conn
        if conn.execute("PRAGMA user_version").fetchone()[0] >= len(MIGRATIONS):
            return
        conn.execute(f"PRAGMA busy_timeout = {MIGRATE_WAIT_MS}")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                for number, sql in enumerate(MIGRATIONS[version:], start=version + 1):
                    for statement in filter(None, (part.strip() for part in sql.split(";"))):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {number}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        finally:
            conn.execute("PRAGMA busy_timeout = 10000")

    def close(self) -> None:
        self.db.close()

    # ---- pay runs -------------------------------------------------------------

    def claim_run(self, company_id: int, month: str, owner: str) -> bool:
        """Insert the unique payroll_runs row; False if this (company, month) already ran."""
        now = utcnow()
        with self.db.conn:
            cur = self.db.conn.execute(
                "INSERT OR IGNORE INTO payroll_runs (company_id, month, owner, status, created_at, updated_at)"
                " VALUES (?, ?, ?, 'fanning-out', ?, ?)",
                (company_id, month, owner, now, now),
            )
        return cur.rowcount == 1

    def finish_run(self, company_id: int, month: str, jobs: int, status: str = "enqueued") -> None:
        with self.db.conn:
            self.db.conn.execute(
                "UPDATE payroll_runs SET status = ?, jobs = ?, updated_at = ? WHERE company_id = ? AND month = ?",
                (status, jobs, utcnow(), company_id, month),
            )

    def runs(self, month: str | None = None) -> list[dict[str, Any]]:
        """Pay-run rows (one per company and month); ``seq`` is their insertion order."""
        sql = "SELECT rowid AS seq, * FROM payroll_runs"
        args: tuple = ()
        if month:
            sql += " WHERE month = ?"
            args = (month,)
        return [dict(r) for r in self.db.query(sql + " ORDER BY month, company_id", args)]

    # ---- jobs -----------------------------------------------------------------

    def create_jobs(self, rows: Iterable[dict[str, Any]]) -> int:
        """Insert new job rows in one transaction (fan-out); existing ids are left alone.
        ``recipient``: a send's address, where it is known when the row is made (a reminder)."""
        now = utcnow()
        data = [
            (r["id"], r["kind"], r.get("company_id"), r.get("employee_id"), r.get("month"), r.get("key"),
             r.get("queue"), r.get("status", "queued"), now, now, r.get("recipient"))
            for r in rows
        ]
        with self.db.conn:
            self.db.conn.executemany(
                "INSERT OR IGNORE INTO jobs (id, kind, company_id, employee_id, month, key, queue, status,"
                " created_at, updated_at, recipient) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                data,
            )
        return len(data)

    def apply(self, events: list[dict[str, str]]) -> None:
        """Apply worker events in one transaction. Each event: job, status, ts, and
        optionally kind, company, employee, month, key, queue, attempt, error, worker, delay, and
        ``to`` (a send's address: when it is made, and when a retry reads it again)."""
        with self.db.conn:
            for ev in events:
                self._apply_one(ev)

    def _apply_one(self, ev: dict[str, str]) -> None:
        c = self.db.conn
        job_id, status, ts = ev["job"], ev["status"], ev.get("ts") or utcnow()
        attempt = int(ev["attempt"]) if ev.get("attempt") else None
        error = ev.get("error") or None
        if ev.get("kind"):  # a creation event carries the identity of the job
            c.execute(
                "INSERT OR IGNORE INTO jobs (id, kind, company_id, employee_id, month, key, queue, status,"
                " created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (job_id, ev["kind"], int(ev["company"]) if ev.get("company") else None, ev.get("employee"),
                 ev.get("month"), ev.get("key"), ev.get("queue"), status, ts, ts),
            )
        sets = ["status = ?", "updated_at = ?"]
        args: list[Any] = [status, ts]
        if attempt is not None:
            sets.append("attempts = MAX(attempts, ?)")
            args.append(attempt)
        if error is not None:
            sets.append("last_error = ?")
            args.append(error)
        if ev.get("worker"):
            sets.append("worker = ?")
            args.append(ev["worker"])
        if ev.get("to"):
            sets.append("recipient = ?")
            args.append(ev["to"])
        if status == "running":
            sets.append("started_at = COALESCE(started_at, ?)")
            args.append(ts)
        if status in ("done", "failed"):
            sets.append("finished_at = ?")
            args.append(ts)
        if status == "queued" and ev.get("reset") == "1":  # retried by hand: fresh budget
            sets.append("finished_at = NULL")
        c.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))
        outcome = outcome_of(ev)
        if attempt is not None and outcome in ("running", "retrying", "held", "done", "failed", "requeued", "reaped"):
            if outcome == "running":
                c.execute(
                    "INSERT INTO attempts (job_id, attempt, worker, started_at, outcome) VALUES (?,?,?,?, 'running')"
                    " ON CONFLICT(job_id, attempt) DO UPDATE SET worker = excluded.worker, started_at = excluded.started_at",
                    (job_id, attempt, ev.get("worker"), ts),
                )
            else:
                c.execute(
                    "INSERT INTO attempts (job_id, attempt, ended_at, outcome, error, delay_s) VALUES (?,?,?,?,?,?)"
                    " ON CONFLICT(job_id, attempt) DO UPDATE SET ended_at = excluded.ended_at,"
                    " outcome = excluded.outcome, error = excluded.error, delay_s = excluded.delay_s",
                    (job_id, attempt, ts, outcome, error, float(ev["delay"]) if ev.get("delay") else None),
                )

    def job(self, job_id: str) -> dict[str, Any] | None:
        rows = list(self.db.query(_JOB_SELECT + " WHERE id = ?", (job_id,)))
        if not rows:
            return None
        row = dict(rows[0])
        row["history"] = [
            dict(r) for r in self.db.query(_ATTEMPT_SELECT + " WHERE job_id = ? ORDER BY attempt", (job_id,))
        ]
        return row

    def ids_like(self, job_id: str, limit: int = 3) -> list[str]:
        """For an id that is no job's: up to ``limit`` ids that start with it (a number
        cut short), else the newest email job's id, as an example of the form."""
        hits = [r[0] for r in self.db.conn.execute(
            "SELECT id FROM jobs WHERE id > ? AND id < ? ORDER BY id LIMIT ?", (job_id, job_id + "\uffff", limit))]
        if hits:
            return hits
        return [r[0] for r in self.db.conn.execute(
            "SELECT id FROM jobs WHERE kind = 'email' ORDER BY rowid DESC LIMIT 1")]

    def ids_of_employee(self, employee_id: str, limit: int = 6) -> list[str]:
        """The newest job ids of an employee (`payrun job emp-00003`, an employee's id given
        for a job's, answered with an unrelated example id)."""
        return [r[0] for r in self.db.conn.execute(
            "SELECT id FROM jobs WHERE employee_id = ? ORDER BY rowid DESC LIMIT ?", (employee_id, limit))]

    def reminder_ids(self, batch: str) -> list[str]:
        """The job ids of a `payrun remind` batch (remind-<batch>-<employee>)."""
        pattern = "remind-" + batch.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "-%"
        rows = self.db.conn.execute(
            "SELECT id FROM jobs WHERE kind = 'reminder' AND id LIKE ? ESCAPE '\\' ORDER BY id", (pattern,))
        return [r[0] for r in rows]

    def remove_jobs(self, job_ids: list[str]) -> None:
        """Delete rows of jobs that never ran (cancelled reminders): they are no one's job."""
        with self.db.conn:
            self.db.conn.executemany("DELETE FROM attempts WHERE job_id = ?", [(i,) for i in job_ids])
            self.db.conn.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in job_ids])

    def employees_with_jobs(self, month: str) -> set[str]:
        """Employees with any job for ``month`` (render, send, resend), whatever company
        the job was made under: who has had a slip made or sent that month."""
        return {r["employee_id"] for r in self.db.query(
            "SELECT DISTINCT employee_id FROM jobs WHERE month = ? AND employee_id IS NOT NULL"
            " AND kind != 'reminder'", (month,))}

    def has_slip_job(self, employee_id: str, month: str) -> bool:
        """Whether a pay run made ``employee_id``'s slip job for ``month`` (its render)."""
        return self.db.conn.execute("SELECT 1 FROM jobs WHERE month = ? AND employee_id = ? AND kind = 'render' "
                                    "LIMIT 1", (month, employee_id)).fetchone() is not None

    def jobs(self, status: str | None = None, month: str | None = None, kind: str | None = None,
             limit: int = 100) -> list[dict[str, Any]]:
        where, args = [], []
        for col, val in (("status", status), ("month", month), ("kind", kind)):
            if val:
                where.append(f"{col} = ?")
                args.append(val)
        sql = _JOB_SELECT + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY updated_at DESC LIMIT ?"
        return [dict(r) for r in self.db.query(sql, (*args, limit))]

    def renders_left(self, month: str, company_id: int | None = None) -> int:
        """How many renders of ``month`` (its run's, and resends') are still to be made:
        queued, running or retrying. None left: the month's sends only read slips made, so
        a slip store that cannot be written, or is full, holds none of them (`payrun status`)."""
        sql = ("SELECT COUNT(*) FROM jobs WHERE month = ? AND kind IN ('render', 'resend')"
               " AND status IN ('queued', 'running', 'retrying')")
        args: list[Any] = [month]
        if company_id is not None:
            sql += " AND company_id = ?"
            args.append(company_id)
        return self.db.conn.execute(sql, args).fetchone()[0]

    def recipients(self, job_ids: Iterable[str]) -> dict[str, str]:
        """send job id -> the address it was made with (or its last retry read), for the
        ids whose address the ledger has (not sends made before migration 4)."""
        out: dict[str, str] = {}
        for chunk in iter_chunks(list(job_ids), 500):
            marks = ",".join("?" * len(chunk))
            for r in self.db.conn.execute(f"SELECT id, recipient FROM jobs WHERE id IN ({marks})"
                                          " AND recipient IS NOT NULL", tuple(chunk)):
                out[r[0]] = r[1]
        return out

    def send_of(self, key: str) -> tuple[str, str | None] | None:
        """The send job of a slip ``key`` (a render's, or a resend's): (its id, the address it
        was made with, None when not recorded); None when no send of it is in the ledger yet."""
        row = self.db.conn.execute("SELECT id, recipient FROM jobs WHERE key = ? AND kind = 'email'"
                                   " ORDER BY rowid DESC LIMIT 1", (key,)).fetchone()
        return (row[0], row[1]) if row else None

    # ---- the HR view ------------------------------------------------------------

    SLIP_STATUS_SQL = """
        SELECT r.company_id AS company_id,
               CASE
                 WHEN e.status = 'done' THEN 'done'
                 WHEN r.key IN ({resent}) THEN 'done'
                 WHEN r.status = 'failed' OR e.status = 'failed' THEN 'failed'
                 WHEN e.status IS NOT NULL THEN e.status
                 WHEN r.status = 'done' THEN 'queued'
                 ELSE r.status
               END AS status
        FROM jobs r
        LEFT JOIN jobs e ON e.key = r.key AND e.kind = 'email'
        WHERE r.kind = 'render' {filters}
    """

    RESENT_SQL = """
        SELECT substr(rr.key, 1, instr(rr.key, ':resend-') - 1)
        FROM jobs rr JOIN jobs x ON x.key = rr.key AND x.kind = 'email' AND x.status = 'done'
        WHERE rr.kind = 'resend' {month}
    """
    """Slip keys (slip:<month>:<employee>) whose slip a resend (`payrun resend`: a job of
    kind 'resend' with key <slip key>:resend-<n>, and its email of the same key) has
    delivered. Resends are few: read from the (month, kind) index, not per slip."""

    def slip_counts(self, month: str | None = None, company_id: int | None = None) -> dict[int, dict[str, int]]:
        """Counts of slips (not jobs) per company: a slip is done when its email is delivered,
        or a resend of it (`payrun resend`) was; failed when its render or send failed for
        good, else in its current job's state.
        (``stuck`` is filled in by the caller from ``stuck_jobs``.)"""
        filters, params = "", {}
        if month:
            filters += " AND r.month = :month"
            params["month"] = month
        if company_id is not None:
            filters += " AND r.company_id = :company"
            params["company"] = company_id
        resent = self.RESENT_SQL.format(month="AND rr.month = :month" if month else "")
        sql = (
            "SELECT company_id, status, COUNT(*) AS n FROM ("
            + self.SLIP_STATUS_SQL.format(filters=filters, resent=resent)
            + ") GROUP BY company_id, status"
        )
        out: dict[int, dict[str, int]] = {}
        for row in self.db.query(sql, params):
            counts = out.setdefault(row["company_id"], {s: 0 for s in STATES} | {"stuck": 0, "total": 0})
            counts[row["status"]] = counts.get(row["status"], 0) + row["n"]
            counts["total"] += row["n"]
        return out

    def delivered_at(self, slip_key: str) -> str | None:
        """When the latest delivered email of a slip (slip:<month>:<employee>: the run's send,
        or a resend's, key <slip key>:resend-<n>) finished (UTC ISO); None if none was."""
        prefix = slip_key + ":resend-"  # (a range, not LIKE: read from the key index)
        row = self.db.conn.execute(
            "SELECT MAX(finished_at) FROM jobs WHERE kind = 'email' AND status = 'done'"
            " AND (key = ? OR (key >= ? AND key < ?))", (slip_key, prefix, prefix + "\uffff")).fetchone()
        return row[0] if row else None

    def failed_slips(self, month: str, company_id: int) -> dict[str, str | None]:
        """The employees of ``company_id`` whose ``month`` slip failed for good, as `payrun
        status` counts it (its render or send failed, and no resend delivered it since):
        employee id -> the address its send was made with (None: no send, or not recorded).
        The company is the slip's (its salary line's that month). `payrun remind --failed-slip`."""
        resent = self.RESENT_SQL.format(month="AND rr.month = :month")
        sql = self.SLIP_STATUS_SQL.format(filters="AND r.month = :month AND r.company_id = :company", resent=resent)
        sql = sql.replace("SELECT r.company_id AS company_id,",
                          "SELECT r.company_id AS company_id, r.employee_id AS employee_id, e.recipient AS recipient,", 1)
        return {r["employee_id"]: r["recipient"] for r in self.db.query(
            f"SELECT employee_id, recipient FROM ({sql}) WHERE status = 'failed' ORDER BY employee_id",
            {"month": month, "company": company_id})}

    def failed_resends(self, month: str, company_id: int | None = None) -> int:
        """Resends (`payrun resend`) of ``month`` whose render or send failed for good and
        that no later try delivered. The HR counts leave them out (a slip counts once, by
        its first email), so `payrun status` read "0 failed" while HR's resend had failed."""
        sql = ("SELECT COUNT(*) FROM jobs r LEFT JOIN jobs e ON e.key = r.key AND e.kind = 'email'"
               " WHERE r.kind = 'resend' AND r.month = ? AND (r.status = 'failed' OR e.status = 'failed')"
               " AND COALESCE(e.status, '') != 'done'")
        args: list[Any] = [month]
        if company_id is not None:
            sql += " AND r.company_id = ?"
            args.append(company_id)
        return self.db.execute(sql, args).fetchone()[0]

    def failed_on_host_trouble(self, month: str, company_id: int | None = None) -> int:
        """Slips of ``month`` failed for good, as :meth:`slip_counts` counts them (a resend's
        jobs, and a slip a resend delivered since, are not), whose failed job (its render, else
        its send) failed on the host's trouble (jobs.policy.failed_on_host_trouble: a full or
        failing disk, Redis refusing writes), not on the employee's data. Counted over every
        job of the month, a failed resend's disk error made a slip refused for its address
        read "all on the host's trouble"."""
        from jobs.policy import failed_on_host_trouble

        filters, params = " AND r.month = :month", {"month": month}
        if company_id is not None:
            filters += " AND r.company_id = :company"
            params["company"] = company_id
        sql = self.SLIP_STATUS_SQL.format(filters=filters, resent=self.RESENT_SQL.format(month="AND rr.month = :month"))
        sql = sql.replace("SELECT r.company_id AS company_id,", "SELECT r.company_id AS company_id, CASE WHEN "
                          "r.status = 'failed' THEN r.last_error ELSE e.last_error END AS error,", 1)
        return sum(1 for row in self.db.query(f"SELECT error FROM ({sql}) WHERE status = 'failed'", params)
                   if failed_on_host_trouble(row["error"]))

    def companies_with_slips(self, month: str) -> set[int]:
        """Companies with a slip (render) job in ``month``: from the (month, kind, company) index."""
        return {r[0] for r in self.db.execute(
            "SELECT DISTINCT company_id FROM jobs WHERE month = ? AND kind = 'render'", [month])}

    def delivered_by_resend(self, slip_keys: Iterable[str]) -> set[str]:
        """Of these slip keys (slip:<month>:<employee>), those whose slip a resend
        (key slip:<month>:<employee>:resend-<n>) has delivered."""
        wanted = set(slip_keys)
        months = {k.split(":")[1] for k in wanted if k.count(":") >= 2}
        resent: set[str] = set()
        for month in months:
            resent.update(r[0] for r in self.db.execute(self.RESENT_SQL.format(month="AND rr.month = ?"), [month]))
        return wanted & resent

    def stuck_jobs(self, month: str | None, stuck_after_s: float, extra_ids: list[str] = (),
                   now: float | None = None) -> dict[str, int]:
        """Jobs counted as stuck, id -> company: running longer than ``stuck_after_s``
        in the ledger, plus ``extra_ids`` (found stuck in Redis: dead worker, lapsed lease)."""
        now = time.time() if now is None else now
        cutoff = datetime.fromtimestamp(now - stuck_after_s, timezone.utc).isoformat(timespec="milliseconds")
        where = "status = 'running' AND updated_at < ?" + (" AND month = ?" if month else "")
        args: tuple = (cutoff, month) if month else (cutoff,)
        out = {r["id"]: r["company_id"] for r in self.db.query(f"SELECT id, company_id FROM jobs WHERE {where}", args)}
        for chunk in iter_chunks(list(extra_ids), 500):
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT id, company_id FROM jobs WHERE id IN ({marks})" + (" AND month = ?" if month else "")
            for r in self.db.query(sql, (*chunk, month) if month else tuple(chunk)):
                out[r["id"]] = r["company_id"]
        return out

    def statuses(self, job_ids: Iterable[str]) -> dict[str, str]:
        """job id -> status, for the ids the ledger knows."""
        out: dict[str, str] = {}
        for chunk in iter_chunks(list(job_ids), 500):
            marks = ",".join("?" * len(chunk))
            for r in self.db.conn.execute(f"SELECT id, status FROM jobs WHERE id IN ({marks})", tuple(chunk)):
                out[r[0]] = r[1]
        return out

    def companies_of(self, job_ids: list[str]) -> dict[str, int]:
        """job id -> company id, for the ids the ledger knows."""
        return {i: c for i, (c, _) in self.whose(job_ids).items()}

    def whose(self, job_ids: list[str]) -> dict[str, tuple[int | None, str | None]]:
        """job id -> (company id, employee id), for the ids the ledger knows."""
        out: dict[str, tuple[int | None, str | None]] = {}
        for chunk in iter_chunks(list(job_ids), 500):
            marks = ",".join("?" * len(chunk))
            for r in self.db.query(f"SELECT id, company_id, employee_id FROM jobs WHERE id IN ({marks})",
                                   tuple(chunk)):
                out[r["id"]] = (r["company_id"], r["employee_id"])
        return out

    def returned_tries(self, job_ids: list[str]) -> dict[str, int]:
        """job id -> tries the ledger recorded as handed back or reaped (no attempt spent),
        for the ids that had any. A worker of the version before this count existed (during
        a rolling deploy) still reports the outcome, but does not count it in Redis."""
        out: dict[str, int] = {}
        for chunk in iter_chunks(list(job_ids), 500):
            marks = ",".join("?" * len(chunk))
            returned = ",".join(f"'{o}'" for o in RETURNED_OUTCOMES)
            for r in self.db.query(f"SELECT job_id, COUNT(*) AS n FROM attempts WHERE job_id IN ({marks})"
                                   f" AND outcome IN ({returned}) GROUP BY job_id", tuple(chunk)):
                out[r["job_id"]] = r["n"]
        return out

    def pruned_at(self, month: str) -> str | None:
        """When `payrun prune` removed ``month`` from this ledger (ISO time, UTC), if it did."""
        row = self.db.conn.execute("SELECT pruned_at FROM pruned_months WHERE month = ?", (month,)).fetchone()
        return row[0] if row else None

    def months(self) -> list[str]:
        return [r["month"] for r in self.db.query("SELECT DISTINCT month FROM payroll_runs ORDER BY month")]

    def latest_month(self) -> str | None:
        """The month of the run started last (not the highest month: last month's run may
        follow this month's, or an old month be re-run for one company)."""
        return latest_month(self.runs())


def latest_month(runs: Iterable[Mapping[str, Any]]) -> str | None:
    """The month of the run started last among ledger ``runs`` rows: the latest created_at,
    and of two claimed in the same millisecond (a fast host), the one inserted last."""
    last = max(runs, key=lambda r: (r.get("created_at") or "", r.get("seq") or 0), default=None)
    return last["month"] if last else None


def tries_counts(row: Mapping[str, Any]) -> tuple[int, int, int]:
    """(attempts spent, tries held back, tries handed back) of a job's ledger ``row``."""
    tries = int(row.get("attempts") or 0)
    outcomes = [h.get("outcome") for h in row.get("history", ())]
    held = outcomes.count("held")
    returned = sum(outcomes.count(o) for o in RETURNED_OUTCOMES)
    return attempts_spent(tries, held, returned), held, returned


HELD_BACK_WHY = ("rate limit, provider outage, its send-email process's own credentials refused, a send already "
                 "in flight, or a slip store full or that cannot be written")
"""Why a try is held back (outcome "held", no attempt spent), as `payrun job` and the
console's job view say it. Its process's credentials refused (jobs.errors.RefusedHere,
another host sending) was missing: a send held that way read as if the rate had held it;
so was a slip store that cannot be written (jobs.errors.StoreUnwritable: read-only, EIO)."""


def queued_text(ahead: int | None, queue: str, rate_per_s: float | None, drained: bool = False) -> str:
    """`payrun job` of a job waiting in its queue: how many jobs are ahead of it (None:
    not known) and, on send-email, the rate sends start at, so a send held back by a low
    rate (drill 43: `limits set --rate 2`) does not read as a send forgotten; ``drained``
    (intake stopped on its queue, or everywhere): that instead of a turn."""
    if ahead is None:
        return "in Redis: queued"
    text = (f"in Redis: queued, {ahead:,} job{'' if ahead == 1 else 's'} ahead of it on {queue}" if ahead else
            f"in Redis: queued, next on {queue}")
    if drained:
        return text + " (intake is drained there: nothing is taken until `payrun resume`)"
    if ahead and queue == "send-email" and rate_per_s:
        s = max(1, round(ahead / rate_per_s))
        took = f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"
        text += f" (sends start at most {rate_per_s:g}/s: its turn in about {took})"
    return text


def tries_text(row: Mapping[str, Any]) -> str:
    """How many tries a job's ledger ``row`` (with its history) had, in words. A try held
    back (outcome "held": :data:`HELD_BACK_WHY`) or handed back (outcome "requeued": its
    worker was stopped, a deploy; "reaped": its worker died) spent no attempt, and a reader
    at 02:00 must not count it against the retry budget."""
    tries = int(row.get("attempts") or 0)
    spent, held, returned = tries_counts(row)
    if not held and not returned:
        return f"{tries} attempt{'' if tries == 1 else 's'}"
    free = []
    if held:
        free.append(f"{held} held back ({HELD_BACK_WHY})")
    if returned:
        free.append(f"{returned} handed back (its worker stopped or died)")
    return (f"{tries} {'try' if tries == 1 else 'tries'}: {spent} attempt{'' if spent == 1 else 's'} spent, "
            f"{', '.join(free)}: no attempt spent")


def iter_chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ---- the applier: Redis stream -> SQLite ------------------------------------------

def _decode(fields: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }


def ensure_group(conn) -> None:
    import redis

    from payrun import keys

    try:
        conn.xgroup_create(keys.EVENTS_STREAM, keys.EVENTS_GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def apply_pending(conn, ledger: Ledger, consumer: str = "ledger-1", block_ms: int | None = None,
                  count: int = 1000, observer=None, replay: bool = True) -> int:
    """Read one batch from the stream, apply it, then acknowledge and delete it.

    First (with ``replay``) re-reads this consumer's unacknowledged entries (a crash
    between commit and ack replays them; applying twice gives the same rows), then new
    ones. Returns how many.
    """
    from payrun import keys

    if replay:
        ensure_group(conn)
    applied = 0
    for start in (("0", ">") if replay else (">",)):
        resp = conn.xreadgroup(keys.EVENTS_GROUP, consumer, {keys.EVENTS_STREAM: start}, count=count,
                               block=block_ms if start == ">" else None)
        if not resp:
            continue
        entries = [(eid, f) for eid, f in resp[0][1] if f]
        if not entries:
            continue
        batch = [_decode(f) for _, f in entries]
        ledger.apply(batch)
        if observer is not None and start == ">":  # replays were observed before the restart
            for ev in batch:
                observer.event(ev)
        ids = [eid for eid, _ in entries]
        pipe = conn.pipeline()
        pipe.xack(keys.EVENTS_STREAM, keys.EVENTS_GROUP, *ids)
        pipe.xdel(keys.EVENTS_STREAM, *ids)
        pipe.execute()
        applied += len(entries)
        if start == "0" and len(entries) >= count:
            return applied
    return applied


def backlog(conn) -> int:
    """Events written by workers and not yet applied to SQLite."""
    from payrun import keys

    try:
        return int(conn.xlen(keys.EVENTS_STREAM))
    except Exception:
        return 0


LEDGER_STALE_S = 10.0
"""An unapplied event older than this means the ledger is not keeping up (or not running):
it applies events within ~0.2 s, so a small backlog alone is normal in a pay run."""


def backlog_age_s(conn) -> float:
    """Seconds since the oldest event not yet applied was written (0 when none is waiting)."""
    from payrun import keys

    first = conn.xrange(keys.EVENTS_STREAM, count=1)
    if not first:
        return 0.0
    entry_id = first[0][0].decode() if isinstance(first[0][0], bytes) else first[0][0]
    sec, usec = conn.time()
    return max(0.0, sec + usec / 1e6 - int(entry_id.split("-")[0]) / 1000)


def drain(conn, ledger: Ledger, consumer: str = "ledger-1") -> int:
    """Apply everything waiting now (tests, `payrun status --sync`, demo shutdown)."""
    total = 0
    while True:
        n = apply_pending(conn, ledger, consumer)
        total += n
        if n == 0:
            return total


RECONCILE_EVERY_S = 5.0
RECONCILE_AFTER_S = 5.0
COALESCE_S = 0.2
"""After a small batch the ledger waits this long before reading again: rows lag by at
most this much more, and a pay run's events are applied ~20 at a time, not 1-3."""
COALESCE_BELOW = 200
"""A batch smaller than this is "small" (the stream is not backed up)."""
_OPEN = ("queued", "running", "retrying")


def reconcile(conn, ledger: Ledger, older_than_s: float = RECONCILE_AFTER_S, limit: int = 2000,
              now: float | None = None, after_id: str = "", fixed_ids: list[str] | None = None) -> tuple[int, str]:
    """Apply final states the event stream never carried.

    A worker reports a job's end *after* RQ recorded it (finished/failed), in a second
    write; if Redis goes away between the two (a restart, a failover) or the worker is
    SIGKILLed there, the event is lost and the ledger row would say running/queued for
    good although RQ is done with the job. So the ledger looks at rows still open and not
    updated for ``older_than_s``, reads their RQ status, and applies ``done``/``failed``
    for jobs RQ finished. Anything else (queued, started, scheduled, gone) is left alone:
    a later event will tell. Applying a final state twice gives the same row.

    A job RQ recorded as ended less than ``older_than_s`` ago is left for the next pass
    too: its event is most likely on its way (written just after RQ's record, or not yet
    read). A row idle that long can be a job that waited in its queue, so the row's age
    alone took every such job for a lost event (a walkthrough counted 42 warnings in a
    healthy run).

    Looks at up to ``limit`` open rows with ids after ``after_id`` (50,000 queued rows are
    read in slices, one per call). Returns (rows changed, the id to continue after; "" once
    the end was reached)."""
    now = time.time() if now is None else now
    cutoff = datetime.fromtimestamp(now - older_than_s, timezone.utc).isoformat(timespec="milliseconds")
    marks = ",".join("?" * len(_OPEN))
    ids = [r[0] for r in ledger.db.execute(
        f"SELECT id FROM jobs WHERE status IN ({marks}) AND updated_at < ? AND id > ? ORDER BY id LIMIT ?",
        (*_OPEN, cutoff, after_id, limit),
    ).fetchall()]
    cursor = ids[-1] if len(ids) >= limit else ""
    if not ids:
        return 0, cursor
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(f"rq:job:{job_id}", "status", "meta", "ended_at")
        found = pipe.execute()
    events: list[dict[str, str]] = []
    for job_id, (status, raw_meta, raw_ended) in zip(ids, found):
        status = status.decode() if isinstance(status, bytes) else status
        if status not in ("finished", "failed"):
            continue
        ended = _rq_time(raw_ended)
        if ended is not None and now - ended < older_than_s:
            continue  # ended just now: its event is on its way
        try:
            meta = json.loads(raw_meta) if raw_meta else {}
        except ValueError:
            meta = {}
        final = "done" if status == "finished" else "failed"
        ev = {"job": job_id, "status": final, "ts": utcnow(), "outcome": final}
        if meta.get("attempt"):
            ev["attempt"] = str(meta["attempt"])
        if final == "failed":
            ev["error"] = str(meta.get("last_error") or "failed (found in RQ; its event was lost)")
        events.append(ev)
    if events:
        ledger.apply(events)
        if fixed_ids is not None:
            fixed_ids.extend(ev["job"] for ev in events)
    return len(events), cursor


def _rq_time(raw) -> float | None:
    """An RQ timestamp field (``2026-11-01T02:00:01.123456Z``, UTC) as a UNIX time."""
    if not raw:
        return None
    try:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


LEDGER_LEASE_MS = 15_000
"""How long a ledger's ownership of the events lasts unrenewed (it renews every loop, ~1 s):
a killed ledger's successor waits at most this long."""

_OWN = """
local v = redis.call('GET', KEYS[1])
if (not v) or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
  return 1
end
return v
"""

_LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def owner_id(ledger_path) -> str:
    """This ledger's id as the events' owner: "host pid path", its host written
    ``hostname/host id`` (payrun.procs.host_id; two control hosts with one hostname and
    one data directory path, a cloned image, told apart: one took the other's live
    ownership for a dead ledger of its own, and both applied the events)."""
    import os

    return f"{_host_token()} {os.getpid()} {ledger_path}"


def _host_token() -> str:
    import socket

    from payrun.procs import host_id

    return f"{socket.gethostname()}/{host_id()}"


def same_host(token: str) -> bool:
    """Whether an owner id's host (``hostname/host id``; ``hostname`` alone before session
    42, judged by it as then) is this host."""
    import socket

    from payrun.procs import host_id

    name, _, their_id = token.partition("/")
    return name == socket.gethostname() and their_id in ("", host_id())


def own_events(conn, me: str) -> str | None:
    """Take or renew the ledger's ownership of the events (keys.LEDGER_OWNER). None: ours;
    else the other ledger's id ("host pid path")."""
    from payrun import keys

    got = conn.eval(_OWN, 1, keys.LEDGER_OWNER, me, LEDGER_LEASE_MS)
    return None if got == 1 else (got.decode() if isinstance(got, bytes) else str(got))


def owned_here(owner: str | None, ledger_path) -> bool:
    """Whether an events owner id ("host pid path", :func:`owner_id`) is a ledger on this
    host, on ``ledger_path``."""
    host, _, rest = (owner or "").partition(" ")
    return bool(owner) and same_host(host) and rest.partition(" ")[2] == str(ledger_path)


def events_owner(conn) -> str | None:
    """The ledger applying the events now ("host pid path"), if any."""
    from payrun import keys

    v = conn.get(keys.LEDGER_OWNER)
    return v.decode() if isinstance(v, bytes) else v


def _dead_here(other: str, me: str) -> bool:
    """Whether ``other`` is a ledger of this host and this file whose process is gone (a
    ledger killed and restarted: no need to wait out its lease)."""
    host, _, rest = other.partition(" ")
    pid, _, path = rest.partition(" ")
    _my_host, _, my_rest = me.partition(" ")
    if not same_host(host) or path != my_rest.partition(" ")[2] or not pid.isdigit():
        return False  # (another machine's pid is nothing here, whatever its hostname)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def let_go_of_events(conn, me: str) -> None:
    from payrun import keys

    try:
        conn.eval(_LET_GO, 1, keys.LEDGER_OWNER, me)
    except Exception:  # Redis away: the lease lapses by itself
        pass


def open_waiting(open_ledger, path: Path, stop, log=None, clock=time.monotonic, pause=time.sleep,
                 every_s: float = 5.0) -> Ledger | None:
    """``open_ledger()``, for `payrun ledger`'s start: while the disk under ``path`` is full
    (SQLite cannot make its journal or shared-memory index there), wait, saying so at once
    and every 30 s, and try again every ``every_s``; any other error goes up. None if
    ``stop()`` came first. (A ledger restarted on a full disk exited at once, three times,
    and supervisord gave up on it.)"""
    from jobs.runtime import OUTAGE_LOG_EVERY_S, RepeatedFailure

    full = RepeatedFailure(OUTAGE_LOG_EVERY_S)
    while not stop():
        try:
            opened = open_ledger()
        except sqlite3.OperationalError as e:
            free = diskspace.free_bytes(path)
            if not diskspace.no_room(e, free):
                raise
            if (line := full.failed(clock(), diskspace.full_text(path, e, free))) is not None and log:
                log.error("ledger: cannot open %s; the workers go on and their events wait in Redis, nothing is "
                          "lost: it starts by itself once there is room", line)
            pause(every_s)
            continue
        if (line := full.ok(clock())) is not None and log:
            log.warning("ledger: opened %s: %s", path, line)
        return opened
    return None


def _backlog_text(conn) -> str:
    try:
        return f"{backlog(conn):,}"
    except Exception:  # noqa: BLE001 - Redis away too: the line is about the disk
        return "?"


def serve(conn, ledger: Ledger, stop, consumer: str = "ledger-1", log=None, observer=None,
          me: str | None = None, clock=time.monotonic, pause=time.sleep) -> None:
    """The `payrun ledger` loop: block up to 1 s for events, apply in batches, until stop().
    Every RECONCILE_EVERY_S it also reconciles open rows against RQ (see ``reconcile``).

    Redis away is logged at once, then every 30 s with how many tries failed, and once
    when Redis answers again (it logged "Redis unavailable" at every try, every 10 s)."""
    import redis

    from jobs.runtime import OUTAGE_LOG_EVERY_S, RepeatedFailure

    wait = 0.5
    next_reconcile = time.monotonic() + RECONCILE_EVERY_S
    cursor = ""
    replay = True  # at start and after a Redis error: first what this consumer read and did not ack
    from payrun import keys

    warned_at = float("-inf")
    outage = RepeatedFailure(OUTAGE_LOG_EVERY_S)

    def answered() -> None:
        if (line := outage.ok(clock())) is not None and log:
            log.warning("ledger: Redis answers again: %s", line)

    full = RepeatedFailure(OUTAGE_LOG_EVERY_S)  # the disk under the ledger full: said at once, then every 30 s

    while not stop():
        other = None
        try:
            if me is not None and (other := own_events(conn, me)) is not None and _dead_here(other, me):
                conn.delete(keys.LEDGER_OWNER)  # this host's ledger before a restart (killed): its lease is void
                other = own_events(conn, me)
            if me is not None:
                answered()
            if me is not None and other is not None:
                # another ledger applies them (a worker host started as a control host, or
                # a second `payrun ledger`): reading the same group here would take a share
                # of the events into this file, lost to that one's
                if log and time.monotonic() - warned_at >= 60:
                    warned_at = time.monotonic()
                    log.error("ledger: another ledger applies the events (%s): this one waits and applies "
                              "nothing. On a worker host run `payrun down`, then `payrun up --role worker`", other)
                time.sleep(1.0)
                continue
            n = apply_pending(conn, ledger, consumer, block_ms=1000, observer=observer, replay=replay)
            answered()
            if (line := full.ok(clock())) is not None and log:
                log.warning("ledger: writing %s again: %s", ledger.path, line)
            replay = False
            if 0 < n < COALESCE_BELOW:
                # a trickle (a pay run's ~100 events/s): let it gather for a moment, so one
                # SQLite commit and one ack carry many events instead of two or three
                time.sleep(COALESCE_S)
            if time.monotonic() >= next_reconcile and backlog_age_s(conn) <= RECONCILE_AFTER_S:
                # (not while behind: after a full disk or a stop, the events of jobs RQ ended
                # long ago are still in the stream, not lost; reconciling then set their rows
                # from RQ and warned that "their event never came", 46 of them in a drill)
                next_reconcile = time.monotonic() + RECONCILE_EVERY_S
                fixed_ids: list[str] = []
                fixed, cursor = reconcile(conn, ledger, after_id=cursor, fixed_ids=fixed_ids)
                if fixed and log:
                    log.warning("ledger: %d job(s) ended in RQ over %.0f s ago and their event never came (a worker "
                                "killed, or Redis gone, between RQ's record and the event); their rows are set from "
                                "RQ: %s%s", fixed, RECONCILE_AFTER_S, ", ".join(fixed_ids[:5]),
                                " …" if fixed > 5 else "")
            wait = 0.5
        except (redis.ConnectionError, redis.TimeoutError) as e:
            replay = True
            if (line := outage.failed(clock(), e)) is not None and log:
                log.warning("ledger: Redis unavailable: %s; retrying in %.1f s", line, wait)
            pause(wait)
            wait = min(wait * 2, 10.0)
        except sqlite3.OperationalError as e:
            free = diskspace.free_bytes(ledger.path)
            if diskspace.no_room(e, free):
                # the data directory is full: the batch was rolled back and not acknowledged;
                # the events wait in Redis and the workers go on. It used to end the process,
                # and supervisord gave up on it (FATAL) within 10 s (session-42 drill)
                replay = True
                if (line := full.failed(clock(), diskspace.full_text(ledger.path, e, free))) is not None and log:
                    log.error("ledger: cannot write %s; the workers go on and their events wait in Redis (%s "
                              "behind), nothing is lost: it writes again by itself once there is room", line,
                              _backlog_text(conn))
                pause(wait)
                wait = min(wait * 2, 10.0)
                continue
            if "locked" not in str(e):
                raise
            # another process holds the write lock longer than the busy timeout (a newer
            # payrun upgrading the schema): the batch was rolled back and not acknowledged
            replay = True
            if log:
                log.warning("ledger: the SQLite file is locked by another process (%s); retrying in %.1f s", e, wait)
            time.sleep(wait)
            wait = min(wait * 2, 10.0)
