"""`payrun up` / `payrun down` with the real supervisor.conf: every program starts, a pay
run completes through the supervised processes, and `down` stops everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import wait_for
from payrun import payroll


def payrun(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "payrun.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_up_run_status_down(tmp_path, monkeypatch):
    home = tmp_path / "h"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYRUN_")}
    env["PAYRUN_HOME"] = str(home)
    payroll.seed(payroll.PayrollDB(home / "payroll.db"), companies=2, employees=10, seed=5, month="2026-11")
    up = payrun("up", env=env)
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        for program in ("redis", "ledger", "pdf-render-00", "send-email", "control", "provider"):
            assert program in up.stdout and "RUNNING" in up.stdout
        run = payrun("run", "--month", "2026-11", "--json", env=env)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["jobs_created"] == 10

        def all_sent():
            out = payrun("status", "--json", env=env)
            return out.returncode == 0 and json.loads(out.stdout)["total"]["done"] == 10

        wait_for(all_sent, timeout_s=90, interval_s=0.5, what="10 slips delivered by supervised workers")
    finally:
        down = payrun("down", env=env)
    assert down.returncode == 0, down.stderr
    ps = payrun("ps", env=env)
    assert ps.returncode != 0  # nothing left running
    from payrun import config, redis_server

    cfg = config.load(env={"PAYRUN_HOME": str(home)})
    assert not redis_server.ping(redis_server.connect(cfg, socket_timeout=1))  # Redis stopped too
