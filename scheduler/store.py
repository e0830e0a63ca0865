"""Scheduler tables in the ledger's SQLite file (control host only).

cron_runs     UNIQUE(entry, scheduled_for): one row per tick. For entries other than the
              pay run the row is the tick's second guard (after its Redis lock): a tick
              whose row exists does nothing. For the pay run the guard is
              payroll_runs(company_id, month) (payrun/runs.py) and this row records the
              tick's outcome. Ticks that did not run are rows too: status 'missed' (past
              the catch-up window) or 'coalesced' (superseded by a newer tick on catch-up).
              A pass records at most 50 missed ticks as rows (the newest); the oldest of
              them counts the pass's older ones in ``unlisted``, so the missed count that
              `payrun schedule` shows is the one the scheduler logged.
cron_entries  per entry: when a scheduler first loaded it (``registered_at``, UTC ISO). With
              the newest cron_runs row it is where an entry's cursor starts again when
              Redis lost it (scheduler/cron.py ``recovered_cursor``).
bank_credits  per (month, employee): whether the salary reached the account, as last
              reported by the payroll bank.

Created with CREATE TABLE IF NOT EXISTS on the ledger file; the ledger's own migrations
(payrun/ledger.py) are not touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from payrun.ledger import Ledger, utcnow

SCHEMA = """
CREATE TABLE IF NOT EXISTS cron_runs (
    entry TEXT NOT NULL,
    scheduled_for TEXT NOT NULL,          -- UTC ISO 8601, the time the tick stands for
    job TEXT,
    owner TEXT,
    status TEXT NOT NULL,                 -- running | enqueued | aborted | failed | missed | coalesced
    jobs INTEGER NOT NULL DEFAULT 0,
    detail TEXT,
    duplicates_stopped INTEGER NOT NULL DEFAULT 0,
    unlisted INTEGER NOT NULL DEFAULT 0,  -- missed: older ticks of the same pass with no row of their own
    created_at TEXT,
    updated_at TEXT,
    PRIMARY KEY (entry, scheduled_for)
);
CREATE INDEX IF NOT EXISTS cron_runs_status ON cron_runs(entry, status);
CREATE TABLE IF NOT EXISTS cron_entries (
    entry TEXT PRIMARY KEY,
    registered_at TEXT NOT NULL           -- UTC ISO 8601: the first scheduler start that loaded it
);
CREATE TABLE IF NOT EXISTS bank_credits (
    month TEXT NOT NULL,
    employee_id TEXT NOT NULL,
    company_id INTEGER,
    status TEXT NOT NULL,                 -- credited | pending | returned
    amount INTEGER,                       -- poisha
    credited_at TEXT,
    reason TEXT,
    checked_at TEXT,
    PRIMARY KEY (month, employee_id)
);
"""

def missed_pay_months(conn, months_run: list[str] | set[str]) -> dict[str, str]:
    """Pay months whose cron tick was missed (past the catch-up window) and that have no
    pay run in the ledger since: month -> the newest missed tick's time (UTC ISO). After a
    missed tick `payrun status` showed the month before, complete, with no word of it, and
    `payrun schedule` kept saying "run it by hand" after the month was run by hand."""
    import sqlite3

    try:
        rows = conn.execute("SELECT scheduled_for, detail FROM cron_runs WHERE job = 'payroll' AND status = 'missed'"
                            " ORDER BY scheduled_for").fetchall()
    except sqlite3.OperationalError:  # no scheduler tables yet
        return {}
    return missed_not_run([(r[0], r[1] or "") for r in rows], months_run)


def missed_not_run(rows: list[tuple[str, str]], months_run: list[str] | set[str]) -> dict[str, str]:
    """(scheduled_for, detail) of missed pay-run ticks -> {month: newest tick} for the
    months their detail names (``payrun run --month M``) that are not in ``months_run``."""
    import re

    out: dict[str, str] = {}
    for scheduled_for, detail in rows:
        for month in re.findall(r"payrun run --month ([0-9]{4}-[0-9]{2})", detail):
            if month not in months_run and scheduled_for > out.get(month, ""):
                out[month] = scheduled_for
    return out


RAN = ("running", "enqueued", "aborted", "failed")
NOT_RUN = ("missed", "coalesced")


class Store:
    def __init__(self, ledger_path: Path | str):
        self.ledger = Ledger(ledger_path)
        self.db = self.ledger.db
        with self.db.conn:
            self.db.conn.executescript(SCHEMA)
        self._add_column("cron_runs", "unlisted", "INTEGER NOT NULL DEFAULT 0")

    def _add_column(self, table: str, column: str, decl: str) -> None:
        """A column added since the table was first made (CREATE TABLE IF NOT EXISTS keeps
        an old table as it was); two processes adding it at once: the second finds it."""
        import sqlite3

        if any(r[1] == column for r in self.db.conn.execute(f"PRAGMA table_info({table})")):
            return
        try:
            with self.db.conn:
                self.db.conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        except sqlite3.OperationalError as e:
            if "duplicate column" not in str(e):
                raise

    def close(self) -> None:
        self.ledger.close()

    # ---- ticks ---------------------------------------------------------------------

    def claim_tick(self, entry: str, scheduled_for: str, job: str, owner: str) -> bool:
        """Insert the tick's unique row; False (and the duplicate counted) if it exists."""
        now = utcnow()
        with self.db.conn:
            cur = self.db.conn.execute(
                "INSERT OR IGNORE INTO cron_runs (entry, scheduled_for, job, owner, status, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, 'running', ?, ?)", (entry, scheduled_for, job, owner, now, now))
            if cur.rowcount == 1:
                return True
            self.db.conn.execute(
                "UPDATE cron_runs SET duplicates_stopped = duplicates_stopped + 1, updated_at = ?"
                " WHERE entry = ? AND scheduled_for = ?", (now, entry, scheduled_for))
        return False

    def finish_tick(self, entry: str, scheduled_for: str, status: str, jobs: int = 0,
                    detail: str | None = None, owner: str | None = None) -> None:
        with self.db.conn:
            self.db.conn.execute(
                "UPDATE cron_runs SET status = ?, jobs = ?, detail = ?, updated_at = ? WHERE entry = ?"
                " AND scheduled_for = ?" + (" AND owner = ?" if owner else ""),
                (status, jobs, detail, utcnow(), entry, scheduled_for, *((owner,) if owner else ())))

    def record_not_run(self, entry: str, job: str, ticks: list[str], status: str, detail: str,
                       unlisted: int = 0) -> int:
        """Rows for ticks that did not run (missed / coalesced), oldest first; ``unlisted``:
        how many older ticks of the same pass have no row (counted on the oldest row, so a
        second recording of the same ticks counts them once). Idempotent."""
        now = utcnow()
        with self.db.conn:
            cur = self.db.conn.executemany(
                "INSERT OR IGNORE INTO cron_runs (entry, scheduled_for, job, status, detail, unlisted, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(entry, t, job, status, detail, unlisted if i == 0 else 0, now, now) for i, t in enumerate(ticks)])
        return cur.rowcount

    def register_entries(self, entries: list[str], now: str) -> int:
        """Record when each entry was first loaded (``now``, UTC ISO); an entry already
        registered keeps its time. Returns how many were new."""
        with self.db.conn:
            cur = self.db.conn.executemany("INSERT OR IGNORE INTO cron_entries (entry, registered_at) VALUES (?, ?)",
                                           [(e, now) for e in entries])
        return cur.rowcount

    def recovery_facts(self, entry: str) -> tuple[str | None, str | None]:
        """(registered_at, newest scheduled_for of any cron_runs row) of one entry, UTC ISO
        or None: what a lost Redis cursor is rebuilt from."""
        q = self.db.conn.execute
        reg = q("SELECT registered_at FROM cron_entries WHERE entry = ?", (entry,)).fetchone()
        newest = q("SELECT MAX(scheduled_for) FROM cron_runs WHERE entry = ?", (entry,)).fetchone()
        return (reg[0] if reg else None), (newest[0] if newest else None)

    def ticks_recorded(self) -> bool:
        """Whether any tick (of any entry, run or not) was ever recorded here: only the
        control worker's ledger gets cron_runs rows (scheduler/cron.py ``ledger_unsure``)."""
        return self.db.conn.execute("SELECT 1 FROM cron_runs LIMIT 1").fetchone() is not None

    def tick(self, entry: str, scheduled_for: str) -> dict[str, Any] | None:
        rows = list(self.db.query("SELECT * FROM cron_runs WHERE entry = ? AND scheduled_for = ?",
                                  (entry, scheduled_for)))
        return dict(rows[0]) if rows else None

    def ticks(self, entry: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        sql = "SELECT * FROM cron_runs" + (" WHERE entry = ?" if entry else "")
        sql += " ORDER BY scheduled_for DESC LIMIT ?"
        return [dict(r) for r in self.db.query(sql, ((entry,) if entry else ()) + (limit,))]

    def summary(self, entry: str) -> dict[str, Any]:
        """For `payrun schedule` and the console: the last tick that ran, and missed ticks."""
        q = self.db.conn.execute
        marks = ",".join("?" * len(RAN))
        last = q(f"SELECT scheduled_for, status, jobs, detail, duplicates_stopped FROM cron_runs"
                 f" WHERE entry = ? AND status IN ({marks}) ORDER BY scheduled_for DESC LIMIT 1",
                 (entry, *RAN)).fetchone()
        missed = q("SELECT COUNT(*) + COALESCE(SUM(unlisted), 0), MAX(scheduled_for) FROM cron_runs"
                   " WHERE entry = ? AND status = 'missed'", (entry,)).fetchone()
        missed_detail = q("SELECT detail FROM cron_runs WHERE entry = ? AND status = 'missed'"
                          " ORDER BY scheduled_for DESC LIMIT 1", (entry,)).fetchone()
        coalesced = q("SELECT COUNT(*) FROM cron_runs WHERE entry = ? AND status = 'coalesced'",
                      (entry,)).fetchone()[0]
        return {
            "last_run": last[0] if last else None,
            "outcome": last[1] if last else None,
            "jobs": last[2] if last else 0,
            "detail": last[3] if last else None,
            "duplicates_stopped": last[4] if last else 0,
            "missed": missed[0],
            "last_missed": missed[1],
            "missed_detail": missed_detail[0] if missed_detail else None,  # (what to run by hand)
            "coalesced": coalesced,
        }

    # ---- bank credits --------------------------------------------------------------

    def record_credits(self, month: str, company_id: int, credits: list[dict[str, Any]]) -> int:
        now = utcnow()
        with self.db.conn:
            self.db.conn.executemany(
                "INSERT INTO bank_credits (month, employee_id, company_id, status, amount, credited_at, reason,"
                " checked_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(month, employee_id) DO UPDATE SET"
                " status = excluded.status, amount = excluded.amount, credited_at = excluded.credited_at,"
                " reason = excluded.reason, checked_at = excluded.checked_at, company_id = excluded.company_id",
                [(month, c["employee"], company_id, c["status"], c.get("amount"), c.get("credited_at"),
                  c.get("reason"), now) for c in credits])
        return len(credits)

    def credit_counts(self, month: str, company_id: int | None = None) -> dict[str, int]:
        sql = "SELECT status, COUNT(*) FROM bank_credits WHERE month = ?"
        args: tuple = (month,)
        if company_id is not None:
            sql += " AND company_id = ?"
            args += (company_id,)
        return {s: n for s, n in self.db.conn.execute(sql + " GROUP BY status", args)}

    def credit(self, month: str, employee_id: str) -> dict[str, Any] | None:
        rows = list(self.db.query("SELECT * FROM bank_credits WHERE month = ? AND employee_id = ?",
                                  (month, employee_id)))
        return dict(rows[0]) if rows else None
