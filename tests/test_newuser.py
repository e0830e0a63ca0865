"""What a new ops engineer met following README.md from a fresh clone (session 43):
each test is a message that said what happened and not which month or what to do."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from payrun.cli import cli
from payrun.retention import refusal


def _home(tmp_path, monkeypatch):
    """A data directory with no Redis at all: what is tested here is refused before Redis."""
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.delenv("PAYRUN_CONFIG", raising=False)
    home = tmp_path / "var"
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    return home


# ---- prune: the run started last and the latest month are two months -----------------

def test_prune_refusal_names_the_run_started_last_and_the_latest_month_apart():
    """October run after December: `prune --before 2027-01` said "2026-10 is the latest
    pay run; 2026-12 is the latest pay run"."""
    months = ["2026-10", "2026-11", "2026-12"]
    msg = refusal(months, "2026-10", "2026-12", {})
    assert msg == ("refusing to prune: 2026-10 is the pay run started last (the one `payrun status` shows); "
                   "2026-12 is the latest month run (prune older months, or add --force)"), msg
    # one month both: said once, as before
    assert refusal(months, "2026-12", "2026-12", {}) == ("refusing to prune: 2026-12 is the latest pay run "
                                                         "(prune older months, or add --force)")
    # only what this prune would remove is named; nothing run, nothing refused
    assert refusal(["2026-10"], "2026-10", "2026-12", {}).count("is the") == 1
    assert refusal(["2026-09"], "2026-10", "2026-12", {}) is None
    assert refusal(["2026-09"], None, None, {}) is None
    assert refusal(["2026-09"], None, "2026-09", {"2026-09": 2}) == (
        "refusing to prune: 2026-09 is the latest month run; 2026-09 has 2 unfinished jobs "
        "(prune older months, or add --force)")


def test_prune_command_names_both_months_when_an_older_month_ran_last(tmp_path, monkeypatch):
    from payrun.ledger import Ledger

    home = _home(tmp_path, monkeypatch)
    home.mkdir(mode=0o700)
    ledger = Ledger(home / "ledger.db")
    ledger.claim_run(1, "2026-12", "test")
    ledger.claim_run(1, "2026-10", "test")  # started after December's
    ledger.close()
    out = CliRunner().invoke(cli, ["prune", "--before", "2027-01"])
    assert out.exit_code == 2, out.output
    assert ("2026-10 is the pay run started last (the one `payrun status` shows); 2026-12 is the latest month "
            "run") in out.output, out.output
    assert "2026-12 is the latest pay run" not in out.output


# ---- resend: no salary line for that month ----------------------------------------------

def test_resend_without_a_salary_line_says_how_a_slip_is_made(tmp_path, monkeypatch):
    """`payrun resend` of an employee with no salary line for the month said only "employee
    emp-91012 has no salary line for 2026-12": not that no slip was made, nor what makes one."""
    from payrun.ledger import Ledger

    home = _home(tmp_path, monkeypatch)
    runner = CliRunner()
    assert runner.invoke(cli, ["seed", "--month", "2026-11", "--companies", "1", "--employees", "3"]).exit_code == 0

    # the month not run for the company: `run`
    out = runner.invoke(cli, ["resend", "--employee", "emp-00001", "--month", "2026-12"])
    assert out.exit_code == 2, out.output
    assert out.output.strip() == (
        "payrun: emp-00001 has no salary line for 2026-12, so no 2026-12 slip was made for them and there is "
        "none to send again; paid that month: import the salary line (`payrun import FILE.csv`), then "
        "`payrun run --month 2026-12 --company 1` makes and sends it"), out.output

    # the month run: `--resume`
    ledger = Ledger(home / "ledger.db")
    ledger.claim_run(1, "2026-12", "test")
    ledger.close()
    out = runner.invoke(cli, ["resend", "--employee", "emp-00001", "--month", "2026-12"])
    assert out.exit_code == 2 and "then `payrun run --month 2026-12 --company 1 --resume` makes" in out.output, \
        out.output

    # marked left: the steps that pay them, and the day they left kept
    assert runner.invoke(cli, ["employee", "left", "emp-00002", "--on", "2026-11-30"]).exit_code == 0
    out = runner.invoke(cli, ["resend", "--employee", "emp-00002", "--month", "2026-12"])
    assert out.exit_code == 2, out.output
    assert "(they are marked as left: left 2026-11-30)" in out.output, out.output
    assert ("`payrun employee back emp-00002`, `payrun run --month 2026-12 --company 1 --resume`, then "
            "`payrun employee left emp-00002 --on 2026-11-30` again") in out.output, out.output

    # unknown employees and months with a line are answered as before
    out = runner.invoke(cli, ["resend", "--employee", "emp-99999", "--month", "2026-12"])
    assert out.exit_code == 2 and "no employee 'emp-99999'" in out.output, out.output
    out = runner.invoke(cli, ["resend", "--employee", "emp-00001", "--month", "2026-11"])
    assert out.exit_code == 2 and "2026-11 has not been run for company 1" in out.output, out.output
    assert not (home / "redis" / "redis.pid").exists()  # refused before Redis


# ---- up: RUNNING is not taking jobs ------------------------------------------------------

STATUS = ("ledger                           RUNNING   pid 11, uptime 0:00:07\n"
          "pdf-render:pdf-render-00         RUNNING   pid 12, uptime 0:00:07\n"
          "send-email                       RUNNING   pid 13, uptime 0:00:07\n"
          "control                          RUNNING   pid 14, uptime 0:00:07\n"
          "provider                         STOPPED   Not started\n")


def _row(pid: int, kind: str, host: str = "vm", host_id: str | None = "h1", alive: bool = True, stopping=False):
    from console.data import WorkerRow

    return WorkerRow(name=f"{kind}.{host}.{pid}", host=host, pid=pid, queues="", state="idle", job_id=None,
                     job_elapsed_s=None, heartbeat_age_s=0.0, alive=alive, stopping=stopping, kind=kind,
                     host_id=host_id)


def test_the_worker_programs_not_registered_in_redis_yet():
    from payrun.supervise import not_registered, worker_pids

    pids = worker_pids(STATUS + "pdf-render:pdf-render-01         STARTING  \n"
                                "reaper                           FATAL     Exited too quickly\n")
    assert pids == {"pdf-render:pdf-render-00": 12, "send-email": 13, "control": 14}
    assert not_registered(pids, [], "vm", "h1") == ["control", "pdf-render:pdf-render-00", "send-email"]
    rows = [_row(12, "render"), _row(13, "email"), _row(13, "email"), _row(14, "control", host_id=None)]
    assert not_registered(pids, rows, "vm", "h1") == []
    # another machine's worker of that pid, a dead record, a stopping one: not this program's
    for other in (_row(12, "render", host="vm2"), _row(12, "render", host_id="h2"), _row(12, "render", alive=False),
                  _row(12, "render", stopping=True)):
        assert not_registered(pids, [other, *rows[1:]], "vm", "h1") == ["pdf-render:pdf-render-00"]


def _fake_up(monkeypatch, tmp_path, registered_after: int | None):
    """`payrun up` with supervisord, its status and Redis faked: the workers register on the
    ``registered_after``-th look (None: never)."""
    import subprocess

    from payrun import config, redis_server, supervise

    (tmp_path / "h").mkdir()
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    statuses = iter(["unix:///x/supervisor.sock no such file"])
    monkeypatch.setattr(supervise, "ctl", lambda cfg, *a, **kw: (next(statuses, STATUS), 0))
    monkeypatch.setattr(supervise, "take_over_redis", lambda cfg: "")
    monkeypatch.setattr(supervise.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))
    monkeypatch.setattr(redis_server, "ping", lambda conn: True)
    looks = []

    def not_yet(cfg, status):
        looks.append(status)
        return [] if registered_after is not None and len(looks) >= registered_after else ["pdf-render:pdf-render-00"]

    monkeypatch.setattr(supervise, "_not_registered_yet", not_yet)
    now = [0.0]

    def pause(s: float) -> None:
        now[0] += s

    return cfg, now, pause, looks


def test_up_returns_once_its_workers_take_jobs(monkeypatch, tmp_path):
    from payrun import supervise

    cfg, now, pause, looks = _fake_up(monkeypatch, tmp_path, registered_after=9)
    out = supervise.up(cfg, timeout_s=60, clock=lambda: now[0], pause=pause)
    assert "note:" not in out and "pdf-render:pdf-render-00" in out
    assert len(looks) == 9 and now[0] == supervise.UP_SETTLE_S + 4.0  # Redis's 5 s, then 8 looks more


def test_up_with_a_worker_slow_to_register_says_so_and_stops_nothing(monkeypatch, tmp_path):
    from payrun import supervise

    cfg, now, pause, looks = _fake_up(monkeypatch, tmp_path, registered_after=None)
    monkeypatch.setattr(supervise, "down", lambda *a, **k: pytest.fail("a slow worker stopped everything"))
    out = supervise.up(cfg, timeout_s=20, clock=lambda: now[0], pause=pause)
    assert out.endswith("note: pdf-render:pdf-render-00 not taking jobs yet (20 s after the start: not registered "
                        f"in Redis): `payrun workers` shows them once they are; their logs: {cfg.log_dir}"), out


# ---- a supervisord started by hand is this data directory's ------------------------------

def test_down_and_ps_know_a_home_whose_supervisord_was_started_by_hand(tmp_path, monkeypatch):
    """`eval "$(payrun supervisor-env)" && supervisord -c supervisor.conf` in a new data
    directory, then `payrun down` before the ledger had made ledger.db: "no payrun data
    directory at …", exit 2, and supervisord left running (tests/test_supervise.py's
    plain-supervisord test failed so, now and then, on a loaded host)."""
    home = _home(tmp_path, monkeypatch)
    home.mkdir(mode=0o700)
    (home / "supervisord.pid").write_text("999999\n")  # supervisord's own file; no payroll.db, no ledger.db
    for cmd in (["ps"], ["down"]):
        out = CliRunner().invoke(cli, cmd)
        assert "no payrun data directory" not in out.output, (cmd, out.output)
    assert "supervisord is not running for" in CliRunner().invoke(cli, ["ps"]).output
