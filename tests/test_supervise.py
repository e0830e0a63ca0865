"""`payrun up` / `payrun down` with the real supervisor.conf: every program starts, a pay
run completes through the supervised processes, and `down` stops everything."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request

from pathlib import Path

import pytest

from conftest import wait_for
from payrun.errors import SetupError
from payrun import payroll


@pytest.fixture(autouse=True)
def _no_supervisord_outlives_its_test(tmp_path):
    """After each test, a supervisord still running for a home under its tmp_path (a failed
    assert between `up` and the test's own `down`) is brought down: pytest removes the
    temp dir, and the programs ran on, polling Redis, for as long as the host stayed up."""
    yield
    for pidfile in tmp_path.glob("**/supervisord.pid"):
        try:
            pid = int(pidfile.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            continue
        env = clean_env(tmp_path, pidfile.parent)
        out = payrun("down", env=env)
        assert False, f"a supervisord (pid {pid}) was left running for {pidfile.parent}: brought down " \
                      f"(rc {out.returncode}); the test should have"


def payrun(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "payrun.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(tmp_path, home) -> dict[str, str]:
    """This environment without PAYRUN_*, with PAYRUN_HOME=home and a config file giving the
    provider, the bank simulation and the metrics endpoint free ports: their defaults
    (8025, 8026, 9308) would collide with a `payrun up` or a second test run on this host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYRUN_")}
    conf = tmp_path / "ports.toml"
    if not conf.exists():
        conf.write_text(f"[provider]\nport = {free_port()}\n[metrics]\nport = {free_port()}\n"
                        f'[scheduler]\nbank_url = "http://127.0.0.1:{free_port()}"\n')
    env.update(PAYRUN_HOME=str(home), PAYRUN_CONFIG=str(conf))
    return env


def test_up_run_status_down(tmp_path, monkeypatch):
    home = tmp_path / "h"
    env = clean_env(tmp_path, home)
    payroll.seed(payroll.PayrollDB(home / "payroll.db"), companies=2, employees=10, seed=5, month="2026-11")
    # a command that acts, run before `up`, starts the embedded Redis in the background: `up`
    # takes it over (a look such as `payrun failed` refuses instead of starting one)
    assert payrun("failed", env=env).returncode == 1
    assert payrun("reap", env=env).returncode == 0
    up = payrun("up", env=env)
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        assert "stopped the embedded Redis another payrun command had started" in up.stdout
        for program in ("redis", "ledger", "pdf-render-00", "send-email", "control", "provider"):
            assert program in up.stdout and "RUNNING" in up.stdout
        run = payrun("run", "--month", "2026-11", "--json", env=env)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["jobs_created"] == 10

        def all_sent():
            out = payrun("status", "--json", env=env)
            return out.returncode == 0 and json.loads(out.stdout)["total"]["done"] == 10

        wait_for(all_sent, timeout_s=90, interval_s=0.5, what="10 slips delivered by supervised workers")
        # through the local provider, which wants the data directory's token: its senders
        # (PAYRUN_EMAIL_URL unset) showed it, anyone else is refused, and no log has it
        stats = json.loads(payrun("provider", "stats", env=env).stdout)
        assert stats["delivered"] == 10 and stats["unauthorized"] == 0, stats
        port = int(tomllib.loads(Path(env["PAYRUN_CONFIG"]).read_text())["provider"]["port"])
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats", timeout=5)
        assert refused.value.code == 401
        token_file = home / "redis" / "provider-token"
        token = token_file.read_text().strip()
        assert oct(token_file.stat().st_mode & 0o777) == "0o600" and len(token) >= 24
        logs = {p.name: p.read_text(errors="replace") for p in (home / "log").iterdir() if p.is_file()}
        assert "provider.log" in logs and not [name for name, text in logs.items() if token in text]
        # each worker names its supervisord program, as `supervisorctl restart` takes it
        listed = json.loads(payrun("workers", "--json", env=env).stdout)
        programs = {(w["kind"], w["program"]) for w in listed if w["alive"] and w["kind"] != "control"}
        assert {("render", "pdf-render:pdf-render-00"), ("email", "send-email")} <= programs, listed
        assert all(p for _, p in programs), listed
        shown = payrun("workers", env=env).stdout
        assert " pdf-render:pdf-render-00 " in shown
        from conftest import assert_worker_columns_line_up

        assert_worker_columns_line_up(shown)  # (walkthrough, session 35: the programs pushed them out of line)
        # Redis stopped under supervisord: a command says so at once (it waited a silent minute)
        from payrun import config, supervise

        cfg = config.load(env={"PAYRUN_HOME": str(home), "PAYRUN_CONFIG": env["PAYRUN_CONFIG"]})
        supervise.ctl(cfg, "stop", "redis")
        failed = payrun("failed", env=env, timeout=30)
        assert failed.returncode == 1 and "the embedded Redis is STOPPED under supervisord" in failed.stderr, failed.stderr
        workers = payrun("workers", env=env, timeout=30)  # the same words (it asked "is `payrun up` running?")
        assert workers.returncode == 1 and "the embedded Redis is STOPPED under supervisord" in workers.stderr, \
            workers.stderr
        supervise.ctl(cfg, "start", "redis")
        assert payrun("failed", env=env).returncode == 0
    finally:
        down = payrun("down", env=env)
    assert down.returncode == 0, down.stderr
    ps = payrun("ps", env=env)
    assert ps.returncode != 0  # nothing left running
    from payrun import config, redis_server

    cfg = config.load(env={"PAYRUN_HOME": str(home)})
    assert not redis_server.ping(redis_server.connect(cfg, socket_timeout=1))  # Redis stopped too


def test_up_refuses_a_redis_still_in_use_and_starts_nothing(tmp_path):
    from payrun import config, redis_server, supervise

    env = clean_env(tmp_path, tmp_path / "h")
    cfg = config.load(env={"PAYRUN_HOME": env["PAYRUN_HOME"]})
    user = redis_server.ensure_running(cfg)  # e.g. a console or a demo holding a connection
    try:
        user.ping()
        up = payrun("up", env=env)
        assert up.returncode == 2
        assert "running outside supervisord" in up.stderr and "other connection(s)" in up.stderr
        out, code = supervise.ctl(cfg, "status")
        assert code not in (0, 3)  # supervisord was never started
        assert user.ping()  # and the server in use was left alone
    finally:
        user.close()
        redis_server.stop(cfg)


def test_up_waits_until_every_program_has_stayed_up():
    from payrun.supervise import _uptime_s, settled

    assert _uptime_s("provider   RUNNING   pid 16815, uptime 0:00:01") == 1
    assert _uptime_s("ledger   RUNNING   pid 7, uptime 2 days, 1:02:03") == 2 * 86400 + 3723
    assert _uptime_s("provider   BACKOFF   Exited too quickly (process log may have details)") is None
    ok = "redis   RUNNING   pid 1, uptime 0:00:09\nbank   STOPPED   Not started\n"
    assert settled(ok)
    # supervisord says RUNNING after startsecs; one that has just been restarted is not up yet
    assert not settled(ok + "provider   RUNNING   pid 16815, uptime 0:00:01\n")
    assert not settled(ok + "provider   STARTING\n")
    assert not settled("")
    assert not settled("unix:///x/supervisor.sock no such file")


def test_up_with_the_providers_port_taken_fails_and_stops_everything(tmp_path):
    """Another payrun's provider (or anything) on our provider's port: the provider cannot
    listen, and `up` must say so, not report success while it crash-loops (the workers
    would send through the other installation's provider)."""
    env = clean_env(tmp_path, tmp_path / "h")
    conf = tmp_path / "ports.toml"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        conf.write_text(re.sub(r"\[provider\]\nport = \d+", f"[provider]\nport = {port}", conf.read_text()))
        assert f"port = {port}" in conf.read_text()
        up = None
        try:
            up = payrun("up", env=env)
        finally:
            if up is None or "so everything was stopped again" not in up.stderr:
                payrun("down", env=env)
    assert up.returncode == 2, up.stdout + up.stderr
    # (BACKOFF within its startsecs; on a loaded host it may only restart over and over, and
    # up gives up after its timeout: stopped all the same, with the provider's log)
    assert "so everything was stopped again" in up.stderr and "provider" in up.stderr
    assert "Address already in use" in up.stderr or "cannot listen" in up.stderr
    ps = payrun("ps", env=env)
    assert ps.returncode == 3 and "supervisord is not running for" in ps.stderr  # nothing left half-up


def test_up_with_a_program_that_cannot_start_stops_everything_and_shows_its_log(tmp_path):
    env = clean_env(tmp_path, tmp_path / "h")
    (tmp_path / "h" / "ledger.db").mkdir(parents=True)  # the ledger cannot open its database
    up = payrun("up", env=env)
    if up.returncode != 2:  # (a failed assert left this supervisord running in a temp dir pytest then removed)
        payrun("down", env=env)
    assert up.returncode == 2, up.stdout + up.stderr
    assert "ledger failed to start, so everything was stopped again" in up.stderr
    assert "ledger.log ends:" in up.stderr and "unable to open database file" in up.stderr
    assert payrun("ps", env=env).returncode != 0  # supervisord is gone, not left half-up
    from payrun import config, redis_server

    cfg = config.load(env={"PAYRUN_HOME": env["PAYRUN_HOME"]})
    assert not redis_server.ping(redis_server.connect(cfg, socket_timeout=1))


@pytest.mark.slow
def test_control_and_worker_only_host_stop_of_the_worker_host_loses_nothing(tmp_path):
    from payrun import config, keys, redis_server

    control = clean_env(tmp_path, tmp_path / "control")
    n = 150
    payroll.seed(payroll.PayrollDB(tmp_path / "control" / "payroll.db"), companies=3, employees=n, seed=9,
                 month="2026-11")
    up = payrun("up", env=control)
    assert up.returncode == 0, up.stderr + up.stdout
    worker_host = None
    try:
        url = payrun("config", "redis-url", env=control).stdout.strip()
        email_url = json.loads(payrun("config", "show", "--json", env=control).stdout)["effective"]["email_url"]
        worker_host = dict(clean_env(tmp_path, tmp_path / "worker"), PAYRUN_REDIS_URL=url,
                           PAYRUN_SLIPS_DIR=str(tmp_path / "control" / "slips"))
        (tmp_path / "worker").mkdir()
        refused = payrun("up", "--role", "worker", env=worker_host)  # its senders would have no provider
        assert refused.returncode != 0 and "a worker-only host needs PAYRUN_EMAIL_URL" in refused.stderr
        worker_host["PAYRUN_EMAIL_URL"] = email_url
        # (two hosts on one machine: the control host's local provider wants its token)
        worker_host["PAYRUN_EMAIL_TOKEN"] = (tmp_path / "control" / "redis" / "provider-token").read_text().strip()
        up_w = payrun("up", "--role", "worker", env=worker_host)
        assert up_w.returncode == 0, up_w.stderr + up_w.stdout
        assert "pdf-render" in up_w.stdout and "ledger" not in up_w.stdout
        assert json.loads(payrun("run", "--month", "2026-11", "--json", env=control).stdout)["jobs_created"] == n

        def done() -> int:
            out = payrun("status", "--json", env=control)
            return json.loads(out.stdout)["total"]["done"] if out.returncode == 0 else 0

        wait_for(lambda: done() >= 20, timeout_s=120, interval_s=0.5, what="the run to be under way")
        stopped = payrun("down", env=worker_host)  # the whole second host goes away mid-run
        assert stopped.returncode == 0, stopped.stderr
        wait_for(lambda: done() == n, timeout_s=240, interval_s=1, what="every slip, with the worker host gone")
        cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "control")})
        conn = redis_server.connect(cfg)
        assert conn.zcard("rq:failed:pdf-render") == 0 and conn.zcard("rq:failed:send-email") == 0
        # Nothing sent twice: a send the worker host had in flight when it went down was
        # finished and recorded there (its lanes finish before it exits), not sent again by
        # the control host's sender. Each slip's idempotency key reads sent, and the control
        # host's provider (up all along: its counts cover the whole run) delivered each once.
        sent = sum(1 for k in conn.scan_iter(match=keys.idem_state("*"), count=500)
                   if conn.hget(k, "state") in (b"sent", "sent"))
        stats = json.loads(payrun("provider", "stats", env=control).stdout)
        assert sent == n and stats["delivered"] == n and stats["duplicates_refused"] == 0, (sent, stats)
    finally:
        if worker_host is not None:
            payrun("down", env=worker_host)
        payrun("down", env=control)


@pytest.mark.slow
def test_supervisorctl_stop_of_one_worker_lets_its_job_finish(tmp_path):
    from payrun import config, redis_server
    from jobs.runtime import PayrunJob, make_queue

    env = dict(clean_env(tmp_path, tmp_path / "h"), PAYRUN_TEST_JOBS="1")
    up = payrun("up", env=env)
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        cfg = config.load(env={"PAYRUN_HOME": env["PAYRUN_HOME"]})
        conn = redis_server.connect(cfg)
        make_queue("pdf-render", conn).enqueue_call("jobs.testing.sleep", args=(4,), job_id="finish-me", timeout=20)
        # the worker records the execution (rq:wip) before its horse marks the job started
        # with its name: wait for the name
        worker = wait_for(lambda: PayrunJob.fetch("finish-me", connection=conn).worker_name, timeout_s=30,
                          what="a worker to start the job")
        pid = int(worker.rsplit(".", 1)[1])
        out = subprocess.run([sys.executable, "-m", "payrun.cli", "ps"], env=env, capture_output=True, text=True)
        program = next(ln.split()[0] for ln in out.stdout.splitlines() if f"pid {pid}," in ln)
        from payrun import supervise

        stop_out, _ = supervise.ctl(cfg, "stop", program)
        assert "stopped" in stop_out
        assert PayrunJob.fetch("finish-me", connection=conn).get_status() == "finished"
    finally:
        payrun("down", env=env)


def test_plain_supervisord_and_supervisorctl_work_with_the_printed_environment(tmp_path):
    import shlex

    env = clean_env(tmp_path, tmp_path / "h")
    printed = payrun("supervisor-env", env=env)
    assert printed.returncode == 0, printed.stderr
    for line in printed.stdout.splitlines():
        if line.startswith("export "):
            k, v = line[len("export "):].split("=", 1)
            env[k] = shlex.split(v)[0] if v else ""
    bindir = os.path.dirname(sys.executable)
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "supervisor.conf")
    started = subprocess.run([os.path.join(bindir, "supervisord"), "-c", conf], env=env, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    try:
        def running():
            out = subprocess.run([os.path.join(bindir, "supervisorctl"), "-c", conf, "status"], env=env,
                                 capture_output=True, text=True).stdout
            return "redis" in out and all(" RUNNING " in ln for ln in out.splitlines() if ln.strip()) and out

        assert "ledger" in wait_for(running, timeout_s=60, interval_s=0.5, what="every program RUNNING")
    finally:
        down = payrun("down", env={k: v for k, v in env.items()
                                   if not k.startswith("PAYRUN_") or k in ("PAYRUN_HOME", "PAYRUN_CONFIG")})
    assert down.returncode == 0, down.stderr


def test_the_ledger_fails_on_its_own_database_before_it_waits_for_redis(tmp_path):
    """Under supervisord the ledger waited for the embedded Redis first, and only then found
    its database unreadable: on a loaded host after `payrun up` had said all was well."""
    env = clean_env(tmp_path, tmp_path / "h")
    (tmp_path / "h" / "ledger.db").mkdir(parents=True)
    env.update(SUPERVISOR_ENABLED="1", PAYRUN_REDIS_SUPERVISED="1")  # as supervisord runs it: Redis is waited for
    out = payrun("ledger", env=env, timeout=60)
    assert out.returncode != 0 and "unable to open database file" in out.stdout + out.stderr, out
    assert not (tmp_path / "h" / "redis" / "redis.sock").exists()


def test_up_returns_only_once_the_embedded_redis_answers(tmp_path, monkeypatch):
    """supervisord calls Redis RUNNING after `startsecs`, before a loaded host has created its
    socket (CI saw `payrun up` return 0 and the next connect fail): `up` also waits for a PONG.
    And then for UP_SETTLE_S more: the programs wait for Redis before they do anything that
    can fail (a loaded host's fast suite saw a ledger with an unreadable database fail just
    after `up` had returned 0, Redis having answered at ~5 s)."""
    from payrun import config, redis_server, supervise

    (tmp_path / "h").mkdir()
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    running = "redis   RUNNING   pid 1, uptime 0:00:07\nledger   RUNNING   pid 2, uptime 0:00:07\n"
    statuses = iter(["unix:///x/supervisor.sock no such file"])
    monkeypatch.setattr(supervise, "ctl", lambda cfg, *a, **kw: (next(statuses, running), 0))
    monkeypatch.setattr(supervise, "take_over_redis", lambda cfg: "")
    monkeypatch.setattr(supervise.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))
    now = [0.0]

    def pause(s: float) -> None:
        now[0] += s

    pinged = []  # (when, answered): no answer for the first two looks
    monkeypatch.setattr(redis_server, "ping", lambda conn: pinged.append((now[0], len(pinged) >= 2)) or pinged[-1][1])
    assert "RUNNING" in supervise.up(cfg, timeout_s=30, clock=lambda: now[0], pause=pause)
    first_pong = next(t for t, ok in pinged if ok)
    assert first_pong == 1.0  # every status said RUNNING; up went on until the server answered,
    assert now[0] == first_pong + supervise.UP_SETTLE_S  # then gave the programs their 5 s with it

    monkeypatch.setattr(redis_server, "ping", lambda conn: False)
    statuses = iter(["unix:///x/supervisor.sock no such file"])
    with pytest.raises(supervise.SetupError, match="does not answer"):
        supervise.up(cfg, timeout_s=2, clock=lambda: now[0], pause=pause)


def test_up_starts_again_what_supervisord_gave_up_on_and_leaves_the_rest_running(tmp_path):
    """On-call drill: a bad config edit (or a full disk) made programs fail until
    supervisord gave up on them (FATAL). `payrun up`, which the status notes suggest, said
    "already running", exited 0 and started nothing. Now it starts them again once the
    cause is fixed, and says so; while the cause lasts it says which did not stay up, and
    stops nothing else."""
    from payrun import config, supervise

    home = tmp_path / "h"
    env = clean_env(tmp_path, home)
    conf = Path(env["PAYRUN_CONFIG"])
    good = conf.read_text()
    payroll.seed(payroll.PayrollDB(home / "payroll.db"), companies=1, employees=2, seed=5, month="2026-11")
    up = payrun("up", env=env)
    cfg = config.load(env={"PAYRUN_HOME": str(home), "PAYRUN_CONFIG": str(conf)})
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        conf.write_text(good + "email_rate_per_s = 40.0.\n")  # a typo, then a restart
        supervise.ctl(cfg, "restart", "pdf-render:*", timeout_s=60)
        def all_fatal():
            lines = [ln for ln in supervise.ctl(cfg, "status", "pdf-render:*")[0].splitlines() if ln.strip()]
            return lines and all(" FATAL " in ln for ln in lines)

        wait_for(all_fatal, timeout_s=60, what="supervisord to give up on the render workers")
        assert " RUNNING " in supervise.ctl(cfg, "status", "ledger")[0]  # the rest runs on
        conf.write_text(good)  # fixed; the month's run waits on renders meanwhile
        assert payrun("run", "--month", "2026-11", env=env).returncode == 0
        status = payrun("status", env=env)
        assert "supervisord gave up on pdf-render:pdf-render-00" in status.stdout, status.stdout
        assert "then `payrun up` starts them again" in status.stdout
        again = payrun("up", env=env)
        assert again.returncode == 0, again.stderr + again.stdout
        assert "stopped by failing (pdf-render:pdf-render-00" in again.stdout and "started" in again.stdout
        assert " FATAL " not in supervise.ctl(cfg, "status")[0]

        def all_sent():
            out = payrun("status", "--json", env=env)
            return out.returncode == 0 and json.loads(out.stdout)["total"]["done"] == 2

        wait_for(all_sent, timeout_s=90, interval_s=0.5, what="the run to go on")
        assert "supervisord is already running" in payrun("up", env=env).stdout  # nothing to do
    finally:
        conf.write_text(good)
        payrun("down", env=env)


def test_a_worker_hosts_status_names_the_programs_its_supervisord_gave_up_on(tmp_path, conn, redis_url,
                                                                              monkeypatch):
    """The status note on programs supervisord gave up on (FATAL) asked only a supervisord
    of role all (redis_server.supervisord_here: "it runs the embedded Redis"): on a worker
    host (`payrun up --role worker`) it found none, and never named the host's render and
    send workers that a bad config edit had left FATAL. `payrun check` asked a supervisord
    of either role; status asks the same function now."""
    from payrun import config, redis_server, status, supervise
    from payrun.ledger import Ledger

    home, conf = tmp_path / "worker", tmp_path / "worker.toml"
    conf.write_text("")
    for k, v in (("PAYRUN_HOME", str(home)), ("PAYRUN_CONFIG", str(conf)), ("PAYRUN_REDIS_URL", redis_url),
                 ("PAYRUN_EMAIL_URL", "smtp://127.0.0.1:1025")):
        monkeypatch.setenv(k, v)
    cfg = config.load()
    conf.write_text("[limits]\nemail_rate_per_s = 40.0.\n")  # a typo: every program fails its start
    assert supervise.up(cfg, wait=False, role="worker") == "supervisord started"
    try:
        assert (home / "supervisor.role").read_text() == "worker"

        def all_fatal():
            lines = [ln for ln in supervise.ctl(cfg, "status")[0].splitlines() if ln.strip()]
            return lines and all(" FATAL " in ln for ln in lines) and lines

        wait_for(all_fatal, timeout_s=90, interval_s=0.5, what="supervisord to give up on every program")
        assert not redis_server.supervisord_here(cfg)  # (its other meaning, kept: no embedded Redis of its own)
        given_up = status.programs_given_up(cfg)
        assert {"pdf-render:pdf-render-00", "send-email", "reaper"} <= set(given_up), given_up
        conn.rpush("rq:queue:pdf-render", "render-2026-11-emp-00001")  # a job waits, and no worker takes it
        led = Ledger(cfg.ledger_path)  # (a worker host that was a control host once has one)
        notes = status.report(cfg, led, conn=conn)["notes"]
        led.close()
        assert any("no pdf-render worker is running" in n for n in notes), notes
        note = next(n for n in notes if n.startswith("supervisord gave up on "))
        assert "pdf-render:pdf-render-00" in note and "then `payrun up` starts them again" in note, note
        # the usual worker host has no ledger: status refuses, and names them in its refusal
        from click.testing import CliRunner

        from payrun.cli import cli

        cfg.ledger_path.unlink()
        out = CliRunner().invoke(cli, ["status"])
        assert out.exit_code != 0 and "on the control host" in out.output, out.output
        assert "here, supervisord gave up on" in out.output and "pdf-render:pdf-render-00" in out.output, out.output
        assert not cfg.ledger_path.exists()
    finally:
        conf.write_text("")
        supervise.down(cfg)


def test_up_says_which_program_did_not_stay_up_when_started_again(tmp_path, monkeypatch):
    """The other outcome of starting again what supervisord gave up on: the cause lasts (the
    disk still full), `up` fails naming the program and its log, and stops nothing."""
    from payrun import config, supervise

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path)})
    (cfg.log_dir).mkdir(parents=True, exist_ok=True)
    (cfg.log_dir / "reaper.log").write_text("redis.exceptions.ResponseError: MISCONF Errors writing to the AOF file\n")
    calls = []
    status = ("ledger    RUNNING   pid 10, uptime 0:05:00\n"
              "reaper    FATAL     Exited too quickly (process log may have details)\n")

    def ctl(cfg_, *args, timeout_s=None):
        calls.append(args)
        return status, 3

    monkeypatch.setattr(supervise, "ctl", ctl)
    with pytest.raises(supervise.SetupError) as e:
        supervise._start_failed_again(cfg, status, wait=True, timeout_s=5)
    assert "reaper stopped by failing and did not stay up when started again (the rest runs on)" in str(e.value)
    assert "MISCONF" in str(e.value) and ("start", "reaper") in calls
    assert not any(a[0] in ("stop", "shutdown") for a in calls)  # nothing else stopped


def test_up_refuses_a_slip_store_another_account_could_change(cfg, conn):
    """Session 31: a render and a send refuse a slip store folder that is not this
    account's alone; `payrun up` says so before the night's run, not each job after it."""
    from payrun import supervise

    company = cfg.slips_dir / "2026-11" / "3"
    company.mkdir(parents=True)
    for d in (cfg.slips_dir, company.parent, company):
        d.chmod(0o700)
    supervise.check_role(cfg, "all")
    company.chmod(0o777)
    with pytest.raises(SetupError, match=rf"the slip store's folder {company} can be written by other accounts "
                                         r"\(mode 777\).*chmod go-w"):
        supervise.check_role(cfg, "all")
    company.chmod(0o700)
    # the store's own folder (drill 43: a tmpfs mounted for it, mode 1777): `up` named a retry
    # of slips that do not exist yet, not the `payrun up` to run again
    cfg.slips_dir.chmod(0o1777)
    with pytest.raises(SetupError) as refused:
        supervise.check_role(cfg, "all")
    assert str(refused.value) == (
        f"the slip store's folder {cfg.slips_dir.resolve()} can be written by other accounts (mode 1777): another "
        "account could swap a slip in it; make it this account's alone (chown, chmod go-w), then `payrun up` (and "
        "`payrun retry --all` if slips failed on it)"), str(refused.value)
    cfg.slips_dir.chmod(0o700)
    (cfg.slips_dir / "2026-12").symlink_to(company)
    with pytest.raises(SetupError, match="2026-12 is a symlink"):
        supervise.check_role(cfg, "all")


def test_up_refuses_a_slip_store_that_cannot_be_a_directory(cfg, tmp_path):
    """`payrun up` with PAYRUN_SLIPS_DIR under a file (or a file itself, or a symlink to an
    unmounted store) started everything, and every render failed on it; it says so first,
    in the words `payrun check` uses, and makes nothing."""
    import dataclasses

    from payrun import supervise

    tarball = tmp_path / "slips.tar"
    tarball.write_bytes(b"not a folder")
    for store, said in ((tarball / "slips", f"{tarball} is a file, not a directory"),
                        (tarball, "is a file, not a directory: set PAYRUN_SLIPS_DIR"),
                        (tmp_path / "mnt-link", "which is not there: mount the shared store")):
        if store.name == "mnt-link":
            store.symlink_to(tmp_path / "unmounted" / "slips")
        with pytest.raises(SetupError, match=said):
            supervise.check_role(dataclasses.replace(cfg, slips=str(store)), "all")
    assert tarball.read_bytes() == b"not a folder" and not (tmp_path / "unmounted").exists()


def test_a_worker_host_is_not_started_as_a_control_host(cfg, conn, monkeypatch):
    """Multi-host drill: `payrun up` (role all) on a worker host started a second ledger
    that took a share of the events. It is refused while another host's ledger applies
    them; and `payrun up` with no --role starts a data directory in the role it was last
    started with (a worker host's `payrun ps` says "`payrun up` starts it")."""
    from click.testing import CliRunner

    from payrun import supervise
    from payrun.cli import cli

    conn.set("payrun:ledger:owner", "control-host 4242 /srv/payrun/ledger.db", px=15_000)
    with pytest.raises(SetupError, match=r"another ledger applies this Redis's events \(control-host 4242 "
                                         r"/srv/payrun/ledger.db\): this is a worker host.*--role worker"):
        supervise.check_role(cfg, "all")
    with pytest.raises(SetupError, match="a worker-only host needs PAYRUN_EMAIL_URL"):
        supervise.check_role(cfg, "worker")  # (a worker host: fine, given the provider to send to)
    conn.set("payrun:ledger:owner", f"other-host 1 {cfg.ledger_path}", px=15_000)
    with pytest.raises(SetupError, match="this is a worker host"):  # the same path on another host
        supervise.check_role(cfg, "all")
    conn.set("payrun:ledger:owner", f"{socket.gethostname()} 1 {cfg.ledger_path}", px=15_000)
    supervise.check_role(cfg, "all")  # this data directory's own ledger (a restart): fine

    roles = []
    monkeypatch.setattr(supervise, "up", lambda cfg_, wait, role: roles.append(role) or "started")
    (cfg.home / "supervisor.role").write_text("worker")
    assert CliRunner().invoke(cli, ["up"]).exit_code == 0
    assert CliRunner().invoke(cli, ["up", "--role", "all"]).exit_code == 0
    (cfg.home / "supervisor.role").unlink()
    assert CliRunner().invoke(cli, ["up"]).exit_code == 0
    assert roles == ["worker", "all", "all"]


def test_a_ledger_command_on_a_worker_host_says_where_the_ledger_is(cfg):
    """Multi-host drill: `payrun status` on a worker host made an empty ledger there and
    answered "no pay run yet" in the middle of a run."""
    from click.testing import CliRunner

    from payrun.cli import cli

    (cfg.home / "supervisor.role").write_text("worker")
    out = CliRunner().invoke(cli, ["status"])
    assert out.exit_code != 0 and "is a worker host's" in out.output and "on the control host" in out.output
    assert "this host's own part: `payrun ps` (its programs), `payrun check`" in out.output, out.output
    assert not cfg.ledger_path.exists()


def test_a_worker_host_on_another_slip_store_is_refused(cfg, conn, tmp_path, redis_url):
    """Multi-host drill: a worker host whose PAYRUN_SLIPS_DIR was its own directory rendered
    there, and the control host's sends found no file: 118 of 287 failed for good as bad
    data. The first render worker names the store (an id in Redis and in a file at its
    root); `payrun up --role worker` on another directory is refused before anything starts."""
    import stat

    from payrun import config, slipstore, supervise

    shared, own, other = tmp_path / "shared", tmp_path / "own", tmp_path / "other"
    assert slipstore.mismatch(conn, own) is None  # nothing rendered yet: nothing to compare
    slipstore.claim(conn, shared)
    store_id = (shared / slipstore.ID_FILE).read_text().strip()
    assert stat.S_IMODE((shared / slipstore.ID_FILE).stat().st_mode) == 0o600
    slipstore.claim(conn, own)  # a later worker elsewhere: the store is named already
    assert not (own / slipstore.ID_FILE).exists()
    assert slipstore.mismatch(conn, shared) is None
    assert "has no slip store id" in slipstore.mismatch(conn, own)
    other.mkdir()
    (other / slipstore.ID_FILE).write_text("0123456789abcdef\n")
    assert f"is another store (id 0123456789abcdef), not the one the other hosts render into (id {store_id}" \
        in slipstore.mismatch(conn, other)

    def worker_host(slips: Path):
        return config.load(env={"PAYRUN_HOME": str(tmp_path / "w"), "PAYRUN_REDIS_URL": redis_url,
                                "PAYRUN_EMAIL_URL": "http://127.0.0.1:9/", "PAYRUN_SLIPS_DIR": str(slips)})

    with pytest.raises(SetupError, match="set PAYRUN_SLIPS_DIR to the shared store"):
        supervise.check_role(worker_host(own), "worker")
    supervise.check_role(worker_host(shared), "worker")  # the shared store: fine


def test_a_worker_host_whose_redis_does_not_answer_is_refused_before_anything_starts(tmp_path):
    """New-user walkthrough: `payrun up --role worker` with the control host's Redis not up
    (or a wrong PAYRUN_REDIS_URL) started supervisord, and said so only after every worker
    had crashed on it and `up` had stopped them again."""
    from payrun import config, supervise

    dead = f"redis://:pw@127.0.0.1:{free_port()}/0"
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "w"), "PAYRUN_REDIS_URL": dead,
                           "PAYRUN_EMAIL_URL": "http://127.0.0.1:9/", "PAYRUN_SLIPS_DIR": str(tmp_path / "s")})
    with pytest.raises(SetupError, match=r"the control host's Redis at redis://:\*\*\*@127.0.0.1:\d+/0 does not "
                                         r"answer \(ConnectionError: .*start the control host first"):
        supervise.check_role(cfg, "worker")
    env = clean_env(tmp_path, tmp_path / "w2")
    env.update(PAYRUN_REDIS_URL=dead, PAYRUN_EMAIL_URL="http://127.0.0.1:9/", PAYRUN_SLIPS_DIR=str(tmp_path / "s"))
    up = payrun("up", "--role", "worker", env=env)
    assert up.returncode != 0 and "does not answer" in up.stderr, up.stdout + up.stderr
    assert not (tmp_path / "w2" / "supervisord.pid").exists()  # nothing was started


def test_a_worker_names_its_supervisord_program(conn, monkeypatch):
    """The console's worker rows named host:pid only (a session-27 known limit): which
    program to restart took `payrun ps` beside it."""
    import time as time_mod

    from console.data import read_workers
    from jobs.runtime import RenderWorker, make_queue, supervisor_program
    from payrun import keys

    assert supervisor_program({}) is None
    assert supervisor_program({"SUPERVISOR_GROUP_NAME": "pdf-render",
                               "SUPERVISOR_PROCESS_NAME": "pdf-render-01"}) == "pdf-render:pdf-render-01"
    assert supervisor_program({"SUPERVISOR_GROUP_NAME": "send-email",
                               "SUPERVISOR_PROCESS_NAME": "send-email"}) == "send-email"
    monkeypatch.setenv("SUPERVISOR_GROUP_NAME", "pdf-render")
    monkeypatch.setenv("SUPERVISOR_PROCESS_NAME", "pdf-render-01")
    w = RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn, name="render.test.program")
    w.register_birth()
    monkeypatch.delenv("SUPERVISOR_PROCESS_NAME")
    bare = RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn, name="render.test.bare")
    bare.register_birth()
    rows = {r.name: r for r in read_workers(conn, time_mod.time())}
    assert rows["render.test.program"].program == "pdf-render:pdf-render-01"
    assert rows["render.test.program"].where.endswith(" pdf-render:pdf-render-01")
    bare_row = rows["render.test.bare"]
    assert bare_row.program is None and bare_row.where == f"{bare_row.host[:18]}:{bare_row.pid}"
    # a record that lapsed (Redis away past its expiry) gets its program back at the next beat
    monkeypatch.setenv("SUPERVISOR_PROCESS_NAME", "pdf-render-01")
    conn.delete(w.key)
    w.last_heartbeat = None
    w.heartbeat()
    assert conn.hget(w.key, "program") == b"pdf-render:pdf-render-01" and 0 < conn.ttl(w.key) <= w.worker_ttl + 60
    assert conn.hget(w.key, "last_heartbeat")


@pytest.mark.slow
def test_a_killed_supervisord_takes_its_programs_with_it_and_up_starts_clean(tmp_path):
    """Ops drill: supervisord killed with -9 mid-run (the OOM killer) left every program
    running as an orphan: still sending, its log lines lost, invisible to `payrun ps`,
    `payrun up` refused (their Redis connections, their ports), and `payrun down` stopped
    Redis beneath their sends (12 slips sent twice after the next `up`). Each program now
    stops as on `supervisorctl stop` when supervisord dies, its last lines written to its
    log file itself; Redis stays for them, and the next `payrun up` takes it over and
    finishes the run, each slip once."""
    import signal

    from payrun import config, keys, redis_server, supervise

    home = tmp_path / "h"
    env = clean_env(tmp_path, home)
    n = 120
    payroll.seed(payroll.PayrollDB(home / "payroll.db"), companies=2, employees=n, seed=3, month="2026-11")
    up = payrun("up", env=env)
    assert up.returncode == 0, up.stderr + up.stdout
    cfg = config.load(env={"PAYRUN_HOME": str(home), "PAYRUN_CONFIG": env["PAYRUN_CONFIG"]})
    try:
        assert json.loads(payrun("run", "--month", "2026-11", "--json", env=env).stdout)["jobs_created"] == n

        def done() -> int:
            out = payrun("status", "--json", env=env)
            return json.loads(out.stdout)["total"]["done"] if out.returncode == 0 else 0

        wait_for(lambda: done() >= 10, timeout_s=120, interval_s=0.5, what="the run to be under way")
        assert supervise.orphans(cfg) == []  # supervisord's own children are not orphans
        logs_at_kill = {p: p.stat().st_size for p in (home / "log").glob("*.log")}
        os.kill(int((home / "supervisord.pid").read_text()), signal.SIGKILL)
        # every program but Redis stops by itself, its jobs in hand finished (within the grace)
        # (every process of theirs, their forks too: a horse or RQ's scheduler process outlives
        # its worker by a moment, and `ps` names it meanwhile)
        wait_for(lambda: not [p for p, (_, name) in supervise.processes(cfg).items() if name != "redis"],
                 timeout_s=90, interval_s=0.5, what="the orphans to stop")
        assert redis_server.ping(redis_server.connect(cfg, socket_timeout=2))  # Redis stays for them
        # and their last lines (the jobs they finished, their stop) are in their log files
        after_kill = {p.name: p.read_bytes()[size:].decode() for p, size in logs_at_kill.items()}
        assert "ledger: stopped" in after_kill["ledger.log"], after_kill
        renders = [name for name in after_kill if name.startswith("pdf-render-")]
        assert renders, after_kill
        for name in renders:
            assert "stopping on request" in after_kill[name] or "shut down" in after_kill[name], after_kill
        assert after_kill["send-email.log"].strip(), after_kill
        assert 10 <= done() < n  # (the ledger applied what it had on its way out)
        # The slips sent before the kill are those whose idempotency key reads sent. The
        # ledger's count can lag them by a send finished after the ledger stopped: its event
        # waits in the stream for the next `up` (CI, session 43: ledger 46, sent 47).
        idem = redis_server.connect(cfg)
        before = sum(1 for k in idem.scan_iter(match=keys.idem_state("*"), count=500)
                     if idem.hget(k, "state") in (b"sent", "sent"))
        idem.close()  # (`up` takes Redis over only when nothing else is connected to it)
        assert 10 <= before < n
        # The provider stops with the others: it answers the sends in flight first, so each
        # slip it delivered was recorded sent and is not sent again (the next provider, its
        # dedupe gone with the old one's memory, would take it: a second email). Its counts
        # are in its last log line.
        at_stop = re.search(r"provider counters at stop: .*\bdelivered=(\d+)", after_kill.get("provider.log", ""))
        assert at_stop and int(at_stop.group(1)) == before, (before, after_kill.get("provider.log", "")[-3000:])
        ps = payrun("ps", env=env)
        assert ps.returncode == 3 and "supervisord is not running" in ps.stderr and "still run" not in ps.stderr
        again = payrun("up", env=env)  # takes Redis over: nothing uses it any more
        assert again.returncode == 0, again.stderr + again.stdout
        wait_for(lambda: done() == n, timeout_s=240, interval_s=1, what="every slip after the restart")
        conn = redis_server.connect(cfg)
        assert conn.zcard("rq:failed:pdf-render") == 0 and conn.zcard("rq:failed:send-email") == 0
        stats = json.loads(payrun("provider", "stats", env=env).stdout)
        # the provider restarted too (its counts are since then): each slip not sent before
        # the kill was sent once after it, and none sent before was sent again (with the old
        # provider's count above: each slip delivered once in all)
        assert stats["delivered"] == n - before and stats["duplicates_refused"] == 0, (before, stats)
    finally:
        payrun("down", env=env)


def test_orphans_of_a_dead_supervisord_are_named_and_down_leaves_redis_for_them(tmp_path, monkeypatch):
    """`payrun ps` said only "supervisord is not running" while 11 of its programs ran on,
    and `payrun down` stopped Redis beneath them. A stand-in for such a program: a process
    with the environment supervisord gives its programs, whose parent is not supervisord."""
    from click.testing import CliRunner

    from payrun import config, supervise
    from payrun.cli import cli

    home = tmp_path / "h"
    home.mkdir()
    (home / "payroll.db").touch()
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.delenv("SUPERVISOR_ENABLED", raising=False)
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    env = dict(os.environ, SUPERVISOR_ENABLED="1", SUPERVISOR_PROCESS_NAME="send-email", PAYRUN_HOME=str(home))
    orphan = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()  # payrun worker send-email"],
                              env=env, stdin=subprocess.PIPE)
    try:
        cfg = config.load(env={"PAYRUN_HOME": str(home)})
        wait_for(lambda: supervise.orphans(cfg), timeout_s=10, what="the stand-in to be seen")
        assert supervise.orphans(cfg) == [(orphan.pid, "send-email")]
        ps = CliRunner().invoke(cli, ["ps"])
        assert ps.exit_code == 3 and f"send-email (pid {orphan.pid})" in ps.output, ps.output
        assert "still run without it" in ps.output and f"kill -TERM {orphan.pid}" in ps.output
        monkeypatch.setattr(supervise, "ORPHAN_WAIT_S", 0.5)
        stopped = []
        monkeypatch.setattr(supervise.redis_server, "stop", lambda cfg: stopped.append(1) or True)
        down = CliRunner().invoke(cli, ["down"])
        assert down.exit_code != 0 and "Redis was left running" in down.output and not stopped, down.output
        orphan.stdin.close()
        orphan.wait(10)
        down = CliRunner().invoke(cli, ["down"])
        assert down.exit_code == 0 and "stopped the embedded Redis" in down.output and stopped, down.output
    finally:
        orphan.kill()
        orphan.wait()


def test_wait_gone_polls_until_the_processes_leave_or_the_deadline():
    from payrun.supervise import wait_gone

    now = [0.0]
    running = {1, 2}

    def pause(s: float) -> None:
        now[0] += s
        if now[0] >= 1.0:
            running.discard(1)

    assert wait_gone([1, 2, 3], 5, clock=lambda: now[0], pause=pause, alive=running.__contains__) == [2]
    assert now[0] >= 5.0
    now[0] = 0.0
    assert wait_gone([1], 5, clock=lambda: now[0], pause=pause, alive=running.__contains__) == []


def test_a_program_whose_supervisord_died_logs_into_its_log_file(tmp_path):
    """Ops drill: supervisord killed, its programs finished their jobs in hand (PDEATHSIG)
    but their last lines went into the pipe supervisord had held, and were lost. Once that
    pipe is gone a program's lines go straight to the end of the file supervisord wrote."""
    import logging

    from payrun import logs

    home = tmp_path / "h"
    (home / "log").mkdir(parents=True)
    env = {"SUPERVISOR_ENABLED": "1", "SUPERVISOR_PROCESS_NAME": "pdf-render-01", "PAYRUN_HOME": str(home)}
    assert logs.supervised_log_file(env) is None  # supervisord has not written one: no guess
    log_file = home / "log" / "pdf-render-01.log"
    log_file.write_text("a line supervisord wrote\n")
    assert logs.supervised_log_file(env) == log_file
    assert logs.supervised_log_file({**env, "SUPERVISOR_ENABLED": ""}) is None
    assert logs.supervised_log_file({**env, "SUPERVISOR_PROCESS_NAME": "../../etc/x"}) is None

    r, w = os.pipe()
    handler = logs.SupervisedStreamHandler(log_file)
    handler.setStream(os.fdopen(w, "w", encoding="utf-8"))
    handler.setFormatter(logging.Formatter("%(message)s"))
    record = lambda msg: logging.LogRecord("payrun.worker", logging.INFO, __file__, 1, msg, None, None)  # noqa: E731
    handler.emit(record("through the pipe"))
    assert os.read(r, 100) == b"through the pipe\n"
    os.close(r)  # supervisord is gone
    handler.emit(record("job render-1 done (attempt 1) in 0.04 s"))
    handler.emit(record("Worker render.1: warm shut down"))
    assert log_file.read_text() == ("a line supervisord wrote\njob render-1 done (attempt 1) in 0.04 s\n"
                                    "Worker render.1: warm shut down\n")
    handler.close()


def test_ps_exits_0_when_the_only_stopped_programs_were_never_meant_to_start():
    """With PAYRUN_EMAIL_URL (or PAYRUN_REDIS_URL) set, the local provider (or the embedded
    Redis) is autostart=false: `STOPPED   Not started` is how it should be, and `payrun ps`
    exited 3 for it on every host sending through a real provider."""
    from payrun import supervise

    running = ("control                          RUNNING   pid 1374, uptime 0:00:07\n"
               "ledger                           RUNNING   pid 1373, uptime 0:00:07\n")
    assert supervise.ps_code(running) == 0
    assert supervise.ps_code(running + "provider                         STOPPED   Not started\n") == 0
    # stopped by hand, given up on, restarting: not running as it should
    assert supervise.ps_code(running + "ledger                           STOPPED   Dec 05 08:53 PM\n") == 3
    assert supervise.ps_code(running + "send-email                       FATAL     Exited too quickly\n") == 3
    assert supervise.ps_code(running + "send-email                       BACKOFF   Exited too quickly\n") == 3
    assert supervise.ps_code(running + "redis                            STARTING  \n") == 3
    assert supervise.ps_code("") == 3


def test_up_in_a_directory_with_no_payrun_data_says_it_started_an_empty_one(tmp_path, monkeypatch):
    """Run from the wrong directory, `payrun up` started a whole empty payrun there (its
    provider then holding the port the real one needs), without a word."""
    from click.testing import CliRunner

    from payrun import supervise
    from payrun.cli import cli

    home = tmp_path / "var"
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.setattr(supervise, "up", lambda cfg_, wait, role: "started")
    payroll.seed(payroll.PayrollDB(home / "demo" / "payroll.db"), companies=1, employees=1, seed=5, month="2026-11")
    fresh = CliRunner().invoke(cli, ["up"])
    assert fresh.exit_code == 0
    assert f"note: {home} held no payrun data, so this is a new, empty payrun" in fresh.output, fresh.output
    assert "`payrun demo` keeps its data in its demo/ folder" in fresh.output
    payroll.seed(payroll.PayrollDB(home / "payroll.db"), companies=1, employees=1, seed=5, month="2026-11")
    again = CliRunner().invoke(cli, ["up"])
    assert again.exit_code == 0 and "note:" not in again.output, again.output
    assert "note:" not in CliRunner().invoke(cli, ["up", "--role", "worker"], env={"PAYRUN_HOME": str(tmp_path / "w")}).output


def test_up_says_that_intake_is_still_drained(cfg, conn, monkeypatch):
    """A drain outlives `payrun down`/`up`: `up` listed every program RUNNING and said
    nothing, and the run did not move."""
    from click.testing import CliRunner

    from payrun.cli import cli

    monkeypatch.setattr(supervise_mod(), "up", lambda cfg_, wait, role: "started")
    payroll.seed(payroll.PayrollDB(cfg.payroll_path), companies=1, employees=1, seed=5, month="2026-11")
    runner = CliRunner()
    assert "drained" not in runner.invoke(cli, ["up"]).output
    assert runner.invoke(cli, ["drain"]).exit_code == 0
    out = runner.invoke(cli, ["up"])
    assert out.exit_code == 0 and "note: intake is drained everywhere (`payrun drain`)" in out.output, out.output
    assert runner.invoke(cli, ["resume"]).exit_code == 0
    assert "drained" not in runner.invoke(cli, ["up"]).output


def supervise_mod():
    from payrun import supervise

    return supervise


def test_up_names_programs_stopped_by_hand_and_starts_nothing(tmp_path, monkeypatch):
    """Ops drill: both schedulers stopped with supervisorctl over a tick; `payrun up` listed
    them STOPPED under "supervisord is already running", exit 0, and said nothing more: the
    tick stayed due. Left stopped (it may be on purpose), but named, with the start."""
    from payrun import config, supervise

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path)})
    calls = []
    monkeypatch.setattr(supervise, "ctl", lambda cfg_, *args, timeout_s=None: calls.append(args) or ("", 0))
    status = ("ledger        RUNNING   pid 10, uptime 0:05:00\n"
              "provider      STOPPED   Not started\n"
              "scheduler-a   STOPPED   Dec 05 09:43 PM\n"
              "scheduler-b   STOPPED   Dec 05 09:43 PM\n")
    out = supervise._start_failed_again(cfg, status, wait=True, timeout_s=5)
    assert out.startswith("supervisord is already running:") and calls == []
    note = out.splitlines()[-1]
    assert note.startswith("note: scheduler-a, scheduler-b stopped by hand, left stopped") and "provider" not in note
    assert 'start scheduler-a scheduler-b' in note


def _another_hosts_sender_holding_a_job(cfg, conn, monkeypatch, alive_s: int) -> tuple[list, str]:
    """A send-email worker of another host ("worker-host", pid 4242), alive for ``alive_s``,
    in the middle of a send; supervise.down recorded, not run. Returns (downs, its name)."""
    import time as time_mod

    from jobs.runtime import make_queue
    from payrun import keys, supervise

    (cfg.home / "payroll.db").touch()
    downs: list = []
    monkeypatch.setattr(supervise, "down", lambda cfg_, say=None: downs.append(1) or "stopped")
    name = "email.worker-host.4242.07"
    job = make_queue(keys.EMAIL_QUEUE, conn).enqueue_call("jobs.tasks.noop", job_id="email-2026-11-emp-00042")
    conn.sadd("rq:workers", f"rq:worker:{name}")
    conn.hset(f"rq:worker:{name}", mapping={"hostname": "worker-host", "pid": 4242, "queues": keys.EMAIL_QUEUE,
                                            "state": "busy", "current_job": job.id, "program": "send-email"})
    conn.hset(job.key, mapping={"status": "started", "worker_name": name,
                                "started_at": time_mod.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time_mod.gmtime())})
    conn.set(keys.alive(name), 4242, ex=alive_s)
    return downs, name


def test_down_on_a_control_host_waits_for_another_hosts_workers_holding_jobs(cfg, conn, monkeypatch):
    """Ops drill: `payrun down` on the control host while a worker host was sending stopped
    Redis and the local provider beneath 9 sends in flight; each was retried, and the
    restarted provider (its dedupe memory gone) delivered them twice: 1,609 deliveries for
    1,600 slips. Over SMTP that is every provider. It is refused while a worker it does not
    run holds a job, and says what to do; --force stops anyway."""
    from click.testing import CliRunner

    from payrun import keys
    from payrun.cli import cli

    downs, name = _another_hosts_sender_holding_a_job(cfg, conn, monkeypatch, alive_s=10)

    out = CliRunner().invoke(cli, ["down"])
    assert out.exit_code != 0 and not downs, out.output
    assert "1 worker not run by this host's supervisord holds a job now: email.worker-host.4242.07 " \
           "(worker-host:4242 send-email, email-2026-11-emp-00042)" in out.output, out.output
    assert "`payrun down` on their host" in out.output and "`payrun down --force`" in out.output
    assert CliRunner().invoke(cli, ["down", "--force"]).exit_code == 0 and downs == [1]
    conn.delete(keys.alive(name))  # gone (its job goes back with the reaper): nothing to wait for
    assert CliRunner().invoke(cli, ["down"]).exit_code == 0 and downs == [1, 1]
    conn.set(keys.alive(name), 4242, ex=10)
    conn.hdel(f"rq:worker:{name}", "current_job")  # alive and idle: nothing in flight to lose
    assert CliRunner().invoke(cli, ["down"]).exit_code == 0 and downs == [1, 1, 1]


def test_down_on_a_control_host_names_what_it_stops_beneath_another_hosts_sends(cfg, conn, monkeypatch):
    """Multi-host drill (s41): a control host on an external Redis, with the local provider,
    refused `payrun down` saying "Stopping this host stops Redis and the provider", of a
    Redis it does not run. It names what it stops; with a real provider too it stops
    nothing their sends go through, and stops without --force."""
    from click.testing import CliRunner

    from payrun import config as config_mod
    from payrun import supervise
    from payrun.cli import cli

    downs, _ = _another_hosts_sender_holding_a_job(cfg, conn, monkeypatch, alive_s=60)

    out = CliRunner().invoke(cli, ["down"])  # the external Redis of `cfg`, the local provider
    assert out.exit_code != 0 and not downs, out.output
    assert "Stopping this host stops the local provider beneath their sends" in out.output, out.output
    assert "stops Redis" not in out.output
    assert supervise.beneath(cfg) == ["the local provider"]
    assert supervise.beneath(config_mod.load(env={"PAYRUN_HOME": str(cfg.home)})) == ["Redis", "the local provider"]
    monkeypatch.setenv("PAYRUN_EMAIL_URL", "smtp://127.0.0.1:1025")  # a real provider: nothing beneath them
    assert supervise.beneath(config_mod.load()) == []
    assert CliRunner().invoke(cli, ["down"]).exit_code == 0 and downs == [1]


def test_busy_elsewhere_is_alive_with_a_job_and_not_ours():
    from types import SimpleNamespace as W

    from payrun import supervise

    rows = [W(name="a", alive=True, job_id="j1", host="here", pid=10),    # ours (our supervisord's)
            W(name="b", alive=True, job_id="j2", host="here", pid=11),    # this host, not ours: a second home
            W(name="c", alive=True, job_id="j3", host="there", pid=10),   # another host (same pid: not ours)
            W(name="d", alive=False, job_id="j4", host="there", pid=12),  # gone: the reaper returns its job
            W(name="e", alive=True, job_id=None, host="there", pid=13)]   # idle
    assert [w.name for w in supervise.busy_elsewhere(rows, {10}, "here")] == ["b", "c"]
    # two machines named alike, their send-email processes the same pid (containers started
    # alike): the other's is not ours; a row without a host id (before session 42) as before
    alike = [W(name="f", alive=True, job_id="j5", host="here", pid=10, host_id="bbbbbbbb"),
             W(name="g", alive=True, job_id="j6", host="here", pid=10, host_id="aaaaaaaa"),
             W(name="h", alive=True, job_id="j7", host="here", pid=10, host_id=None)]
    assert [w.name for w in supervise.busy_elsewhere(alike, {10}, "here", "aaaaaaaa")] == ["f"]


def test_a_worker_program_being_restarted_is_said_as_starting_not_as_not_running(tmp_path, monkeypatch):
    """Drill 43: during a deploy's `supervisorctl restart send-email`, `payrun status` read
    "135 jobs wait on send-email and no send-email worker is running: is `payrun up`
    running?" for the seconds the new process took to register. A program supervisord
    (re)started less than a minute ago, or is starting or stopping, is said as starting."""
    from payrun import config, status, supervise

    out = ("ledger                           RUNNING   pid 101, uptime 3:02:11\n"
           "pdf-render:pdf-render-00         RUNNING   pid 102, uptime 3:02:11\n"
           "pdf-render:pdf-render-01         STARTING  \n"
           "send-email                       RUNNING   pid 240, uptime 0:00:04\n")
    assert status.starting_programs(out, "send-email") == "send-email RUNNING for 4 s"
    assert status.starting_programs(out, "pdf-render") == "pdf-render:pdf-render-01 STARTING"
    assert status.starting_programs(out.replace("0:00:04", "0:02:04"), "send-email") is None  # up 2 min: not a start
    assert status.starting_programs("send-email   STOPPING\n", "send-email") == "send-email STOPPING"
    assert status.starting_programs("send-email   FATAL     Exited too quickly\n", "send-email") is None
    assert status.starting_programs("", "send-email") is None

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path)})
    notes = ["135 jobs wait on send-email and no send-email worker is running: is `payrun up` running (`payrun ps`)?",
             "intake is drained on pdf-render (`payrun drain --queue`): `payrun resume` restarts it"]
    monkeypatch.setattr(supervise, "status_here", lambda c, timeout_s=5: out)
    said = status.starting_notes(cfg, notes)
    assert said[0].startswith("135 jobs wait on send-email: its worker is starting here (supervisord: send-email "
                              "RUNNING for 4 s) and takes them once it has registered; still so after a minute: "
                              "`payrun ps`"), said[0]
    assert said[1] == notes[1]
    monkeypatch.setattr(supervise, "status_here", lambda c, timeout_s=5: None)  # no supervisord here: as it was
    assert status.starting_notes(cfg, notes) == notes
