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


def test_demo_delivers_every_slip_once_with_no_429(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAYRUN_REDIS_URL", "PAYRUN_EMAIL_URL", "PAYRUN_CONFIG")}
    env["PAYRUN_HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-m", "payrun.cli", "demo", "--employees", "60", "--companies", "2",
                        "--timeout", "240"], env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"provider: (\d+) delivered, (\d+) duplicates refused, (\d+) throttled \(429\), (\d+) rejected", out)
    assert m, out[-3000:]
    assert tuple(map(int, m.groups())) == (60, 0, 0, 0), out[-3000:]
    assert "warning" not in out
    assert "Redis unreachable" not in out  # the summary comes from the ledger, after the shutdown, on purpose
    slips = list((tmp_path / "home" / "demo").rglob("*.pdf"))
    assert len(slips) == 60 and all(p.stat().st_mode & 0o777 == 0o600 for p in slips)
