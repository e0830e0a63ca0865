"""`payrun demo`, the first command a new user runs: the whole system on one machine
(embedded Redis, local provider, ledger, reaper, render workers, send-email lanes).

In a calm run nothing is interrupted, so the provider must see every slip exactly once:
its Idempotency-Key dedupe would hide a second send from the "delivered" count (over SMTP
it would be a second email), so the duplicates it refused are asserted too."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def _demo(tmp_path, employees: int, *, timeout_s: int) -> tuple[str, int]:
    """`payrun demo` as a new user runs it: a fresh home, no Redis, provider or config from
    the test session's environment. Returns its output and exit code."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAYRUN_REDIS_URL", "PAYRUN_EMAIL_URL", "PAYRUN_CONFIG")}
    env["PAYRUN_HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-m", "payrun.cli", "demo", "--employees", str(employees), "--companies", "2",
                        "--timeout", str(timeout_s)], env=env, capture_output=True, text=True, timeout=300)
    return r.stdout + r.stderr, r.returncode


def test_demo_delivers_every_slip_once_with_no_429(tmp_path):
    out, rc = _demo(tmp_path, 60, timeout_s=240)
    assert rc == 0, out[-3000:]
    m = re.search(r"provider: (\d+) delivered, (\d+) duplicates refused, (\d+) throttled \(429\), (\d+) rejected", out)
    assert m, out[-3000:]
    assert tuple(map(int, m.groups())) == (60, 0, 0, 0), out[-3000:]
    assert "warning" not in out
    assert "Redis unreachable" not in out  # the summary comes from the ledger, after the shutdown, on purpose
    slips = list((tmp_path / "home" / "demo").rglob("*.pdf"))
    assert len(slips) == 60 and all(p.stat().st_mode & 0o777 == 0o600 for p in slips)


def test_the_progress_bar_counts_what_the_status_report_counts(tmp_path):
    """The bar reads one cheap count per poll (kind x state), not `payrun status`'s per-slip
    join, which at 50,000 slips cost 0.4-0.5 CPU-s a call, every 0.5 s."""
    from payrun.demo import _progress
    from payrun.ledger import Ledger

    month = "2026-11"
    led = Ledger(tmp_path / "ledger.db")
    states = [("done", "done"), ("done", "failed"), ("failed", None), ("done", "running"), ("done", None),
              ("queued", None), ("done", "retrying"), ("running", None)]
    with led.db.conn:
        for i, (render, email) in enumerate(states):
            key = f"slip:{month}:emp-{i}"
            led.db.conn.execute("INSERT INTO jobs (id, kind, company_id, month, key, status) VALUES (?,?,?,?,?,?)",
                                (f"render-{i}", "render", 1, month, key, render))
            if email:
                led.db.conn.execute("INSERT INTO jobs (id, kind, company_id, month, key, status)"
                                    " VALUES (?,?,?,?,?,?)", (f"email-{i}", "email", 1, month, key, email))
    slips = led.slip_counts(month)[1]
    assert _progress(led, month) == {"done": slips["done"], "failed": slips["failed"], "rendered": 5}
    assert (slips["done"], slips["failed"]) == (1, 2)


def test_the_demo_waits_long_enough_for_the_run_it_was_asked_for():
    """A flat 900 s gave up on a healthy 50,000-slip demo (at 40/s the sends alone take
    1,250 s): the default now grows with the slips and the email rate limit."""
    from payrun.demo import DEMO_TIMEOUT_S, default_timeout_s

    assert default_timeout_s(600, 40.0) == DEMO_TIMEOUT_S == 900
    assert default_timeout_s(50_000, 40.0) == 2 * 1_250 + 300
    assert default_timeout_s(50_000, 10.0) == 2 * 5_000 + 300
    assert default_timeout_s(20_000, 40.0) == 1_300


def test_a_demo_that_gives_up_counts_what_the_provider_delivered(tmp_path):
    """New-user walkthrough (session 35): `demo --timeout 10` gave up and printed "164 sent"
    beside the provider's "196 delivered": the table was taken while sends were in flight
    and before the ledger had caught up. It now stops the workers first (they finish and
    record what they hold) and applies the ledger's backlog, then counts."""
    out, rc = _demo(tmp_path, 1500, timeout_s=10)
    assert rc != 0 and "gave up after 10 s" in out, out[-3000:]
    total = re.search(r"Total: ([\d,]+) sent, ([\d,]+) in progress", out)
    delivered = re.search(r"provider: ([\d,]+) delivered", out)
    assert total and delivered, out[-3000:]
    sent = int(total.group(1).replace(",", ""))
    assert 0 < sent < 1500 and sent == int(delivered.group(1).replace(",", "")), out[-3000:]
