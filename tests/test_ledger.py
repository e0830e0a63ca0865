"""The SQLite ledger's schema: an existing ledger is upgraded in place, and the HR count
reads its slip states from indexes alone (a query plan, not a timing)."""

from __future__ import annotations

import sqlite3

from payrun.ledger import MIGRATIONS, Ledger

MONTH = "2026-11"


def _rows():
    """Six slips of two companies in every state the count distinguishes."""
    out = []
    for i, (render, email) in enumerate([("done", "done"), ("done", "failed"), ("failed", None),
                                         ("done", "running"), ("done", None), ("queued", None)]):
        emp, company = f"emp-{i:05d}", 1 + i % 2
        key = f"slip:{MONTH}:{emp}"
        out.append((f"render-{MONTH}-{emp}", "render", company, emp, MONTH, key, render))
        if email:
            out.append((f"email-{MONTH}-{emp}", "email", company, emp, MONTH, key, email))
    return out


def test_a_version_1_ledger_is_upgraded_in_place_and_counts_the_same(tmp_path):
    path = tmp_path / "ledger.db"
    old = sqlite3.connect(path)
    old.executescript(MIGRATIONS[0])
    old.execute("PRAGMA user_version = 1")
    old.executemany("INSERT INTO jobs (id, kind, company_id, employee_id, month, key, status)"
                    " VALUES (?,?,?,?,?,?,?)", _rows())
    old.commit()
    old.close()

    led = Ledger(path)
    assert led.db.conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    indexes = {r[0] for r in led.db.conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'"
                                                 " AND name LIKE 'jobs_%'")}
    assert indexes == {"jobs_month_kind_slip", "jobs_key_status", "jobs_status"}
    counts = led.slip_counts(MONTH)
    assert {c: {k: v for k, v in row.items() if v} for c, row in counts.items()} == {
        1: {"done": 1, "failed": 1, "queued": 1, "total": 3},  # emp 0, 2, 4 (rendered, email not made yet)
        2: {"failed": 1, "running": 1, "queued": 1, "total": 3},
    }
    Ledger(path).close()  # opening it again migrates nothing


def test_the_hr_count_reads_slip_states_from_indexes_alone(tmp_path):
    """SLIP_STATUS_SQL visits every render row of the month and its email row: from the
    table, that was half the time of a console HR refresh at 50,000 slips."""
    led = Ledger(tmp_path / "ledger.db")
    sql = "EXPLAIN QUERY PLAN " + led.SLIP_STATUS_SQL.format(filters=" AND r.month = :month")
    plan = " / ".join(r[3] for r in led.db.conn.execute(sql, {"month": MONTH}))
    assert "SEARCH r USING COVERING INDEX jobs_month_kind_slip" in plan, plan
    assert "SEARCH e USING COVERING INDEX jobs_key_status" in plan, plan
