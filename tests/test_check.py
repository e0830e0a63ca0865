"""`payrun check`: the evening-before readiness check. Its policy on its own (pure), then
its checks against a real Redis, real worker, ledger and scheduler processes, the local
HTTP provider and a real SMTP server (aiosmtpd). No check may send or enqueue anything."""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from aiosmtpd.smtp import AuthResult
from click.testing import CliRunner

from cluster import Cluster, scrub_env
from jobs.mail import transport_for
from payrun import keys, preflight
from payrun.cli import cli
from payrun.preflight import FAIL, OK, WARN
from payrun.provider import Provider
from test_mail import EphemeralController, Recorder, tls_files  # noqa: F401 (a fixture)

DHAKA = ZoneInfo("Asia/Dhaka")


# ---- policy (pure) ------------------------------------------------------------------

def test_the_send_rate_is_the_tightest_of_limit_cap_and_lanes():
    assert preflight.send_rate(40, 50, 50, 1.2) == 40  # the provider's limit
    assert preflight.send_rate(40, 45, 50, 1.2) == pytest.approx(37.5)  # the seed's cap of 45
    assert preflight.send_rate(40, 50, 12, 1.2) == pytest.approx(10)  # too few lanes
    assert preflight.send_rate(40, 50, 0, 1.2) == 0  # nothing sends


def test_a_run_takes_as_long_as_its_slower_half():
    # 50,000 slips at 40/s: the provider's 1,250 s, not the renders' (2 workers at 40 ms)
    assert preflight.run_seconds(50_000, 40, 0.040, 2) == pytest.approx(60 + 1250)
    # one slow render worker: the renders set the pace (0.3 s / 0.85 per slip)
    assert preflight.run_seconds(10_000, 40, 0.3, 1) == pytest.approx(60 + 10_000 * 0.3 / 0.85)
    assert preflight.run_seconds(10, 0, 0.04, 2) is None
    assert preflight.run_seconds(10, 40, 0.04, 0) is None
    assert preflight.run_seconds(0, 0, 0, 0) == 0


def test_the_deadline_is_the_first_0900_after_the_start():
    tick = datetime(2026, 12, 1, 2, 0, tzinfo=DHAKA)
    assert preflight.deadline_after(tick) == datetime(2026, 12, 1, 9, 0, tzinfo=DHAKA)
    late = datetime(2026, 12, 1, 9, 30, tzinfo=DHAKA)  # a rerun after 09:00: tomorrow's
    assert preflight.deadline_after(late) == datetime(2026, 12, 2, 9, 0, tzinfo=DHAKA)
    level, text = preflight.deadline_verdict(tick, 1310)
    assert level == OK and "about 22 min: done by about 02:21" in text and "6 h 39 min before 09:00" in text
    level, text = preflight.deadline_verdict(tick, 6.5 * 3600)
    assert level == WARN and "less than an hour before 09:00" in text
    level, text = preflight.deadline_verdict(tick, 8 * 3600)
    assert level == FAIL and "after 09:00" in text
    assert preflight.deadline_verdict(tick, None) == (
        FAIL, "cannot finish: nothing would render or send its slips (deadline 09:00 on 2026-12-01)")


def test_disk_and_redis_memory_verdicts():
    assert preflight.disk_verdict(10 << 30, 50_000, 18_000)[0] == OK
    assert preflight.disk_verdict(1_000_000_000, 50_000, 18_000)[0] == WARN  # 0.9 GB needed, 1.35 asked
    level, text = preflight.disk_verdict(500_000_000, 50_000, 18_000)
    assert level == FAIL and "fill up mid-run" in text
    assert preflight.redis_memory_verdict(2 << 20, 0, "noeviction", 50_000, True)[0] == OK
    level, text = preflight.redis_memory_verdict(2 << 20, 100 << 20, "noeviction", 50_000, True)
    assert level == FAIL and "above its maxmemory of 100.0 MiB" in text  # 50,000 × 5.5 KiB = 269 MiB
    level, text = preflight.redis_memory_verdict(2 << 20, 100 << 20, "allkeys-lru", 10, False)
    assert level == FAIL and "deletes keys, jobs among them" in text


def test_a_redis_too_small_and_evicting_is_said_both_ways_with_what_to_raise():
    """Both problems in one check (it said only the policy: set to noeviction, the next check
    failed on the maxmemory); with no maxmemory nothing is evicted, so the policy warns."""
    level, text = preflight.redis_memory_verdict(900 << 10, 3 << 20, "allkeys-lru", 300, False)
    assert level == FAIL
    assert "above its maxmemory of 3.0 MiB: it would refuse writes mid-run (raise maxmemory above ~5.0 MiB)" in text
    assert "maxmemory-policy is allkeys-lru: under memory pressure Redis deletes keys" in text
    level, text = preflight.redis_memory_verdict(900 << 10, 0, "allkeys-lru", 300, False)
    assert level == WARN and "with no maxmemory: nothing is evicted now" in text and "noeviction" in text


def test_a_clock_off_the_redis_servers_is_a_warning():
    assert preflight.clock_verdict(0.4) is None and preflight.clock_verdict(-1.9) is None
    level, text = preflight.clock_verdict(-7.25)
    assert level == WARN and "7.2 s behind the Redis server's" in text
    assert "ahead of" in preflight.clock_verdict(3)[1]


def test_worker_and_scheduler_verdicts_name_what_is_missing():
    found = preflight.worker_verdicts(render=0, send_processes=1, lanes=50, control=0, hosts=1)
    assert [f.level for f in found] == [FAIL, OK, FAIL]
    assert "no pdf-render worker" in found[0].text and "no control worker" in found[2].text
    tick = "2026-12-01T02:00:00+06:00"
    assert preflight.scheduler_verdict(2, None, tick, "Asia/Dhaka").level == OK
    one = preflight.scheduler_verdict(1, None, tick, "Asia/Dhaka")
    assert one.level == WARN and "2026-12-01 02:00 Asia/Dhaka" in one.text
    assert "none stands by to fire the tick if this one is down then" in one.text  # (it read "it fires alone")
    none = preflight.scheduler_verdict(0, None, tick, "Asia/Dhaka")
    assert none.level == FAIL and "the tick of 2026-12-01 02:00 Asia/Dhaka will not fire" in none.text
    assert "has not fired" in preflight.scheduler_verdict(2, tick, tick, "Asia/Dhaka").text


def test_workers_of_another_machine_with_this_hostname_are_a_warning():
    """Containers or a cloned VM image with one hostname: payrun keeps their records
    apart by host id (session 42), but the console and `payrun workers` show one host."""
    from types import SimpleNamespace as W

    rows = [W(name="render.vm.10", host="vm", host_id="aaaaaaaa"), W(name="render.vm.11", host="vm", host_id=None),
            W(name="render.other.10", host="other", host_id="cccccccc")]
    assert preflight.named_alike(rows, "vm", "aaaaaaaa") is None
    found = preflight.named_alike(rows + [W(name="email.vm.10.00", host="vm", host_id="bbbbbbbb")], "vm", "aaaaaaaa")
    assert found.level == WARN and "email.vm.10.00" in found.text and "also named 'vm'" in found.text
    assert "own hostname" in found.text


def test_check_fails_a_pay_run_tick_the_running_schedulers_did_not_load():
    """Drill (session 41): the pay run's cron edited in the file, schedulers not restarted:
    `payrun schedule` named the difference, and `payrun check` said "ok  next pay-run tick
    <the file's time>; 2 schedulers running" of a tick that would not fire then."""
    tick = "2026-12-01T02:00:00+06:00"
    f = preflight.scheduler_verdict(2, None, tick, "Asia/Dhaka", ["payroll: running with cron '0 3 1 * *'"])
    assert f.level == FAIL, f
    assert "2026-12-01 02:00 Asia/Dhaka" in f.text and "payroll: running with cron '0 3 1 * *'" in f.text
    assert "will not fire it then" in f.text and "restart scheduler-a scheduler-b" in f.text
    assert preflight.scheduler_verdict(2, None, tick, "Asia/Dhaka", []).level == OK


def test_programs_stopped_by_hand_are_named_with_the_command_that_starts_them():
    """`payrun up` leaves a program stopped by hand stopped: the check said only "`payrun
    up`" for a ledger, a render worker and a scheduler stopped with supervisorctl, and that
    started none of them. Given up on (FATAL) fails; "Not started" (not meant to run here) is
    no finding."""
    status = ("bank                             RUNNING   pid 23841, uptime 0:01:12\n"
              "ledger                           STOPPED   Dec 06 02:24 AM\n"
              "pdf-render:pdf-render-00         STOPPED   Dec 06 02:24 AM\n"
              "provider                         STOPPED   Not started\n"
              "reaper                           FATAL     Exited too quickly (process log may have details)\n"
              "scheduler-b                      STOPPED   Dec 06 02:24 AM\n")
    found = preflight.supervisor_verdicts(status, "/srv/payrun/var/log")
    assert [(f.area, f.level) for f in found] == [("workers", FAIL), ("workers", WARN)]
    assert "gave up on reaper here (FATAL): see their logs in /srv/payrun/var/log, then `payrun up`" in found[0].text
    assert found[1].text == ("ledger, pdf-render:pdf-render-00, scheduler-b stopped by hand here, which `payrun up` "
                             "leaves stopped: `eval \"$(payrun supervisor-env)\"` then `supervisorctl -c "
                             "\"$PAYRUN_SUPERVISOR_CONF\" start ledger pdf-render:pdf-render-00 scheduler-b`")
    assert preflight.supervisor_verdicts("provider   STOPPED   Not started\n", "log") == []


def test_a_terminal_gets_each_finding_wrapped_under_its_text_and_commands_whole():
    """At 80 columns the terminal wrapped a 200-character finding to column 0, under the
    marks; a pipe still gets one line a finding (grep, cron mail)."""
    prefix = "  WARN  workers    "
    text = ("ledger, scheduler-b stopped by hand here, which `payrun up` leaves stopped: `eval \"$(payrun "
            "supervisor-env)\"` then `supervisorctl -c \"$PAYRUN_SUPERVISOR_CONF\" start ledger scheduler-b`")
    assert preflight.wrapped(prefix, text, None) == [prefix + text]
    lines = preflight.wrapped(prefix, text, 79)
    assert lines[0].startswith(prefix) and all(ln.startswith(" " * len(prefix)) for ln in lines[1:])
    assert " ".join(ln.strip() for ln in lines) == (prefix + text).strip()  # nothing lost or added
    for command in ("`payrun up`", "`eval \"$(payrun supervisor-env)\"`",
                    "`supervisorctl -c \"$PAYRUN_SUPERVISOR_CONF\" start ledger scheduler-b`"):
        assert any(command in ln for ln in lines), (command, lines)  # each on one line
    short = [ln for ln in lines if "supervisorctl" not in ln]  # (a command longer than the room overflows)
    assert all(len(ln) <= 79 for ln in short), lines


def test_with_redis_down_the_estimate_and_the_local_provider_say_why(world, tmp_path):
    """Redis down: the estimate is of the config's workers, and says so (it read as if 1
    render worker were running); the local provider unreachable names `payrun up`."""
    import dataclasses
    import socket as socket_mod

    import redis

    cfg, conn, db, ledger = world
    with socket_mod.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed: nothing listens there)
    cfg = dataclasses.replace(cfg, provider=dataclasses.replace(cfg.provider, port=port))

    def down():
        raise redis.ConnectionError("Error 111 connecting")

    rep = preflight.check(cfg, month="2026-11", connect=down, now=datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc))
    said = {f.area: f for f in rep.findings if f.level != WARN or f.area == "estimate"}
    assert said["redis"].level == FAIL and "unreachable" in said["redis"].text
    assert "the config's: the live workers and limits could not be read" in said["estimate"].text
    assert said["email"].level == FAIL and said["email"].text.endswith(
        "(the local provider simulator: `payrun up` starts it)")


@pytest.mark.parametrize("error, why", [("timeout", "no answer within 5 s"), ("auth", "its password was refused")])
def test_an_external_redis_unreachable_is_not_sent_to_payrun_up(cfg, error, why):
    """`payrun up` starts the embedded Redis only: for an external one the check said
    "`payrun up`" and "(TimeoutError)"."""
    import redis

    def down():
        raise redis.TimeoutError("Timeout reading from socket") if error == "timeout" else \
            redis.AuthenticationError("invalid username-password pair")

    assert not cfg.embedded_redis
    rep = preflight.check(cfg, worker_host=True, email=False, connect=down)
    [found] = [f for f in rep.findings if f.area == "redis"]
    assert found.level == FAIL and f"unreachable ({why}): see to that Redis and to PAYRUN_REDIS_URL" in found.text
    assert "payrun up" not in found.text and "password=" not in found.text.split("***")[-1]


# ---- the provider, asked without sending ----------------------------------------------

def test_the_http_probe_checks_the_token_and_sends_nothing():
    p = Provider(latency_s=0.01, rate_per_s=1000, token="right-token").start()
    try:
        assert transport_for(p.url, 5).__class__.__name__ == "HttpTransport"
        with pytest.MonkeyPatch.context() as m:
            m.setenv("PAYRUN_EMAIL_TOKEN", "right-token")
            assert transport_for(p.url, 5).probe() == "reachable, token accepted"
            m.setenv("PAYRUN_EMAIL_TOKEN", "wrong-token")
            with pytest.raises(ValueError) as ei:
                transport_for(p.url, 5).probe()
            assert "refused our token (401): check PAYRUN_EMAIL_TOKEN" in str(ei.value)
            assert "wrong-token" not in str(ei.value)
            m.delenv("PAYRUN_EMAIL_TOKEN")
            with pytest.raises(ValueError, match="wants a token \\(401\\) and PAYRUN_EMAIL_TOKEN is not set"):
                transport_for(p.url, 5).probe()
            m.setenv("PAYRUN_EMAIL_TOKEN", "right-token")
            p.outage(60, 503)
            with pytest.raises(ValueError, match="in trouble: 503"):
                transport_for(p.url, 5).probe()
            with pytest.raises(ValueError, match="no messages endpoint at /v2/v1/messages"):
                transport_for(p.url + "/v2", 5).probe()
            with pytest.raises(ValueError, match=r"took the connection, then TLS failed \(.+\): does it speak "
                                                 r"https:// on that port\?"):
                transport_for(p.url.replace("http://", "https://"), 5).probe()  # (it speaks http://)
        assert p.stats()["delivered"] == 0
    finally:
        p.stop()
    with pytest.raises(ValueError, match="cannot reach the provider"):
        transport_for(p.url, 2).probe()  # stopped: nothing listens


def test_the_smtp_probe_logs_in_and_quits_without_mail(monkeypatch):
    handler = Recorder()

    def authenticator(server, session, envelope, mechanism, auth_data):
        return AuthResult(success=(auth_data.login, auth_data.password) == (b"payroll", b"s3cret"), handled=False)

    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0, authenticator=authenticator,
                              auth_require_tls=False)
    ctl.start()
    try:
        assert transport_for(f"smtp://payroll:s3cret@127.0.0.1:{ctl.port}", 5).probe() == "connected, login accepted"
        with pytest.raises(ValueError) as ei:
            transport_for(f"smtp://payroll:wr0ng@127.0.0.1:{ctl.port}", 5).probe()
        assert "login refused (535" in str(ei.value) and "wr0ng" not in str(ei.value)
        assert handler.messages == []
    finally:
        ctl.stop()
    with pytest.raises(ValueError, match="cannot connect"):
        transport_for(f"smtp://127.0.0.1:{ctl.port}", 2).probe()


def test_payrun_check_fails_an_smtp_server_that_takes_the_login_but_refuses_our_sender(cfg, monkeypatch):
    """Session 43: the check logged in and said "ok" of a server that refuses our MAIL FROM
    (5.7.1), which refuses every slip of the night. It offers email.sender, then RSET."""
    from payrun import config as config_mod
    from test_senders import SenderRefusing

    handler = SenderRefusing(allowed="payroll@meghna.example")
    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0, auth_require_tls=False,
                              authenticator=lambda *a: AuthResult(success=True, handled=False))
    ctl.start()
    try:
        monkeypatch.setenv("PAYRUN_EMAIL_URL", f"smtp://payroll:s3cret@127.0.0.1:{ctl.port}")
        said = {}
        for sender in ("Payroll <payroll@payrun.localhost>", "Payroll <payroll@meghna.example>"):
            c = config_mod.load()
            c.email.sender = sender
            rep = preflight.Report(month=None, role="control")
            preflight._email(c, rep)
            (said[sender],) = [(f.level, f.text) for f in rep.findings if f.area == "email"]
        level, text = said["Payroll <payroll@payrun.localhost>"]
        assert level == FAIL and "then our sender payroll@payrun.localhost refused (553 5.7.1" in text, text
        assert said["Payroll <payroll@meghna.example>"] == (
            OK, f"smtp://payroll:***@127.0.0.1:{ctl.port}: connected, login accepted, sender payroll@meghna.example "
                "accepted (nothing was sent)")
        assert handler.messages == []
    finally:
        ctl.stop()


@pytest.mark.parametrize("mode", ["starttls", "smtps"])
def test_the_smtp_probe_speaks_tls_to_the_servers_name(tls_files, monkeypatch, mode):
    """STARTTLS and smtps:// probed as a send connects: TLS checks the URL's host. The probe
    made its connection with no host, so every TLS probe failed with "check_hostname
    requires server_hostname" whatever the server."""
    cert, key = tls_files
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    handler = Recorder()

    def authenticator(server, session, envelope, mechanism, auth_data):
        return AuthResult(success=(auth_data.login, auth_data.password) == (b"payroll", b"s3cret"), handled=False)

    kw = ({"tls_context": ctx, "require_starttls": True} if mode == "starttls"
          else {"ssl_context": ctx, "auth_require_tls": False})  # (aiosmtpd offers no AUTH on smtps otherwise)
    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0, authenticator=authenticator, **kw)
    ctl.start()
    url = (f"smtp://payroll:s3cret@127.0.0.1:{ctl.port}?starttls=1" if mode == "starttls"
           else f"smtps://payroll:s3cret@127.0.0.1:{ctl.port}")
    try:
        with pytest.raises(ValueError, match=r"certificate is not trusted \(self.signed certificate\): .*SSL_CERT_FILE"):
            transport_for(url, 5).probe()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the test certificate
        said = transport_for(url, 5).probe()
        assert said == ("connected, STARTTLS, login accepted" if mode == "starttls"
                        else "connected over TLS, login accepted")
        if mode == "starttls":  # the same server without STARTTLS: no login offered in clear text
            with pytest.raises(ValueError, match=r"offers no login \(SMTP AUTH\).*\?starttls=1"):
                transport_for(url.replace("?starttls=1", ""), 5).probe()
        assert handler.messages == []
    finally:
        ctl.stop()


class _Trickle:
    """A server that takes connections and answers a byte at a time, each well within a
    socket timeout: an SMTP greeting, or (HTTP) a status line once the request is in."""

    def __init__(self, reply: bytes, after_request: bool, every_s: float = 0.2):
        self.reply, self.after_request, self.every_s = reply, after_request, every_s
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(c,), daemon=True).start()

    def _trickle(self, c):
        with c:
            try:
                if self.after_request:
                    c.recv(65536)
                for b in self.reply:
                    if self.stop.wait(self.every_s):  # (the server's pace, not a test's wait)
                        return
                    c.sendall(bytes([b]))
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("kind", ["smtp", "http"])
def test_a_probe_ends_within_its_timeout_however_slow_the_server(kind):
    """A provider that takes the connection and answers a byte at a time never trips a
    socket timeout: the probe held `payrun check` for 41 s with a 5 s timeout (HTTP) and
    18 s (SMTP). Its whole exchange now ends by its timeout, as a send's does."""
    if kind == "smtp":
        server = _Trickle(b"220 " + b"x" * 200 + b"\r\n", after_request=False)
    else:
        server = _Trickle(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}", after_request=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError) as ei:
            transport_for(f"{kind}://127.0.0.1:{server.port}", 1.0).probe()
        took = time.monotonic() - t0
    finally:
        server.close()
    assert took < 1.4, took
    assert str(ei.value) == ("connected, then no answer to its greeting within 1 s" if kind == "smtp"
                             else "the provider took the connection, then did not answer within 1 s")


# ---- the whole check ------------------------------------------------------------------

def test_a_payrun_with_nothing_running_is_not_ready_and_says_what_to_do(world):
    cfg, conn, db, ledger = world
    conn.sadd(keys.PAUSED_QUEUES, keys.EMAIL_QUEUE)
    out = CliRunner().invoke(cli, ["check", "--month", "2026-11", "--no-email"])
    assert out.exit_code == 1, out.output
    lines = out.output.splitlines()
    assert lines[0].startswith("payrun check: the 2026-11 pay run, run by hand (the next tick, ")
    assert "  ok    payroll    2026-11: the run pays 12 employees in 2 companies" in lines
    text = "\n".join(lines)
    for want in ("FAIL  intake     intake is drained on send-email", "FAIL  workers    no pdf-render worker",
                 "FAIL  ledger     no `payrun ledger` is running", "FAIL  scheduler  no scheduler is running",
                 "FAIL  workers    no send-email worker"):
        assert want in text, out.output
    assert lines[-1].startswith("NOT READY: ")
    data = json.loads(CliRunner().invoke(cli, ["check", "--month", "2026-11", "--no-email", "--json"]).output)
    assert data["ready"] is False and data["month"] == "2026-11" and data["failures"] >= 5
    assert {c["area"] for c in data["checks"]} >= {"redis", "scheduler", "payroll", "render", "workers", "ledger"}
    # it looked, and wrote nothing: no job, no ledger row
    assert not conn.keys("rq:job:*") and ledger.db.conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0


def test_json_carries_what_the_text_shortens(world):
    """The text names five employees "and N more"; --json lists every one (and the companies
    with no line at all), and the estimate's figures."""
    cfg, conn, db, ledger = world
    ids = [r[0] for r in db.conn.execute("SELECT employee_id FROM salary_lines WHERE month = '2026-11' "
                                         "ORDER BY employee_id LIMIT 7")]
    db.conn.execute(f"DELETE FROM salary_lines WHERE employee_id IN ({','.join('?' * len(ids))})", ids)
    db.conn.commit()
    data = json.loads(CliRunner().invoke(cli, ["check", "--month", "2026-11", "--no-email", "--json"]).output)
    unpaid = [c for c in data["checks"] if c["area"] == "payroll" and c["level"] == WARN]
    assert len(unpaid) == 1 and "and 2 more" in unpaid[0]["text"] and unpaid[0]["detail"] == {"employees": ids}
    assert all("detail" not in c for c in data["checks"] if c["area"] in ("redis", "intake"))
    estimate = next(c for c in data["checks"] if c["area"] == "estimate")
    assert estimate["detail"]["slips"] == 5 and estimate["detail"]["deadline"].endswith("T09:00:00+06:00")


def test_a_month_already_run_is_estimated_for_the_companies_not_run_yet(world):
    """The estimate was of the whole month after its run ("300 slips ... about 2 min") while
    running it again makes none: it counts the slips a run would still make."""
    from payrun import payroll

    cfg, conn, db, ledger = world
    ledger.claim_run(1, "2026-11", "test")
    second = payroll.count_employees(db, "2026-11", 2)
    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    rep = preflight.check(cfg, month="2026-11", email=False, now=now)
    ran = next(f for f in rep.findings if f.area == "payroll" and f.level == WARN)
    assert ran.text == (f"2026-11 was already run for 1 company: running it makes only the {second} slips of the "
                        "1 company not run yet") and ran.detail == {"companies_run": [1]}
    assert next(f for f in rep.findings if f.area == "estimate").detail["slips"] == second
    ledger.claim_run(2, "2026-11", "test")
    rep = preflight.check(cfg, month="2026-11", email=False, now=now)
    assert "running it again makes no slip (`payrun status --month 2026-11`)" in " ".join(f.text for f in rep.findings)
    assert not [f for f in rep.findings if f.area == "estimate"]


def test_bad_input_to_check_is_refused_in_one_line(world):
    out = CliRunner().invoke(cli, ["check", "--month", "2026-13"])
    assert out.exit_code == 2 and out.output.startswith("payrun: ") and len(out.output.splitlines()) == 1


def test_a_running_payrun_is_ready_and_a_wrong_token_is_caught(tmp_path, redis_url, conn):
    provider = Provider(latency_s=0.05, rate_per_s=40, token="t0ken").start()
    env = dict(scrub_env(), PAYRUN_REDIS_URL=redis_url, PAYRUN_EMAIL_URL=provider.url, PAYRUN_EMAIL_TOKEN="t0ken")
    try:
        with Cluster(tmp_path / "home", env) as cluster:
            cluster.seed(30)
            cluster.start(render=1, lanes=2, reaper=False)
            cluster.spawn("control", "worker", "control")
            cluster.spawn("scheduler-a", "scheduler")
            cluster.spawn("scheduler-b", "scheduler")
            cluster.wait_alive(conn, "render-0")
            cluster.wait_alive(conn, "email-0")
            with pytest.MonkeyPatch.context() as m:
                for k, v in env.items():
                    m.setenv(k, v)
                from payrun import config as config_mod

                cfg = config_mod.load(env=cluster.env)
                evening = datetime(2026, 11, 30, 18, 0, tzinfo=timezone.utc)  # 00:00 in Dhaka, 2 h before the tick
                deadline = time.monotonic() + 60
                while True:  # until the control worker, the ledger and both schedulers are up
                    rep = preflight.check(cfg, month="2026-11", now=evening)
                    if not rep.failures or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert not rep.failures, rep.to_dict()
                texts = {f.area: f.text for f in rep.findings if f.level == OK}
                assert "token accepted (nothing was sent)" in texts["email"]
                assert "2 schedulers running" in texts["scheduler"]
                assert "the run pays 30 employees in " in texts["payroll"]
                assert "writable" in texts["slips"]
                assert "30 slips at " in texts["estimate"] and "from the tick at 2026-12-01 02:00" in texts["estimate"]
                m.setenv("PAYRUN_EMAIL_TOKEN", "expired")
                bad = preflight.check(cfg, month="2026-11", now=evening)
                assert [f.text for f in bad.findings if f.level == FAIL] == [
                    f"{provider.url}: the provider refused our token (401): check PAYRUN_EMAIL_TOKEN"]
            assert provider.stats()["delivered"] == 0 and not conn.keys("rq:job:render-*")
    finally:
        provider.stop()


def test_a_worker_host_checks_what_that_host_needs(cfg, conn):
    (cfg.home / "supervisor.role").write_text("worker\n")
    out = CliRunner().invoke(cli, ["check", "--no-email", "--json"])
    data = json.loads(out.output)
    assert out.exit_code == 1 and data["month"] is None and data["role"] == "worker"  # (no worker runs here yet)
    areas = {c["area"] for c in data["checks"]}
    assert areas >= {"redis", "render", "intake", "workers", "slips"}
    assert not areas & {"payroll", "scheduler", "ledger", "estimate"}  # the control host's
    assert not any("control worker" in c["text"] for c in data["checks"])  # the control host's part
    # another host's render worker, alive: not this host's, so this host still has none
    name = "render.elsewhere.4242"
    conn.sadd("rq:workers", f"rq:worker:{name}")
    conn.hset(f"rq:worker:{name}", mapping={"hostname": "elsewhere", "pid": "4242", "queues": keys.RENDER_QUEUE,
                                            "state": "idle"})
    conn.set(keys.alive(name), 1, ex=60)
    data = json.loads(CliRunner().invoke(cli, ["check", "--no-email", "--json"]).output)
    assert any(c["level"] == FAIL and "no pdf-render worker" in c["text"] for c in data["checks"]), data
    # another machine's worker bearing this host's name (a cloned image): not this host's
    # either, and said (review, session 42: the worker host's own rows were picked first,
    # so the warning could never show there)
    import socket

    twin = f"render.{socket.gethostname()}.4343"
    conn.sadd("rq:workers", f"rq:worker:{twin}")
    conn.hset(f"rq:worker:{twin}", mapping={"hostname": socket.gethostname(), "pid": "4343", "host_id": "0badc0de",
                                            "queues": keys.RENDER_QUEUE, "state": "idle"})
    conn.set(keys.alive(twin), 1, ex=60)
    data = json.loads(CliRunner().invoke(cli, ["check", "--no-email", "--json"]).output)
    assert any(c["level"] == FAIL and "no pdf-render worker" in c["text"] for c in data["checks"]), data
    assert any(c["level"] == WARN and f"also named {socket.gethostname()!r}" in c["text"] for c in data["checks"]), data
    refused = CliRunner().invoke(cli, ["check", "--month", "2026-11"])
    assert refused.exit_code == 2 and "--month is for the control host" in refused.output


# ---- a slip store this host cannot write to (as root: chmod stops no one) --------------

def test_what_to_do_about_a_slip_store_that_cannot_be_written_is_said_by_its_errno(tmp_path):
    import errno

    store = tmp_path / "slips"
    said = {code: preflight.store_write_text(store, OSError(code, os.strerror(code)), "payrun")
            for code in (errno.EROFS, errno.EACCES, errno.ENOSPC, errno.ENOENT, errno.EIO)}
    assert said[errno.EROFS] == (f"{store}: a slip cannot be written there (Read-only file system): its file system "
                                 "is mounted read-only: mount it read-write (every slip is written there)")
    assert f"(chown -R payrun {store})" in said[errno.EACCES]
    assert "`payrun prune --slips`" in said[errno.ENOSPC]
    assert "(No such file or directory): no file can be made in it (a virtual file system" in said[errno.ENOENT]
    # a failing disk is not "a directory this account can write to" (session 43): the disk
    assert said[errno.EIO].startswith(f"{store}: a slip cannot be written there (Input/output error): its disk reports "
                                      "I/O errors: read the kernel log (`dmesg`)"), said[errno.EIO]
    # not a directory: `payrun up` makes a missing one, but none under a file
    assert "`payrun up` makes it" in preflight.store_missing_text(store)
    (tmp_path / "afile").write_text("x")
    assert preflight.store_missing_text(tmp_path / "afile") == (
        f"the slip store {tmp_path / 'afile'} is a file, not a directory: set PAYRUN_SLIPS_DIR to a directory "
        "(or move the file)")
    assert preflight.store_missing_text(tmp_path / "afile" / "a" / "slips") == (
        f"no slip store at {tmp_path / 'afile' / 'a' / 'slips'}, and none can be made there: {tmp_path / 'afile'} is a "
        "file, not a directory; set PAYRUN_SLIPS_DIR to a directory (or move the file)")
    (tmp_path / "gone").symlink_to(tmp_path / "unmounted")
    assert "is a symlink to" in preflight.store_missing_text(tmp_path / "gone")


def test_a_slip_store_under_a_symlink_to_an_unmounted_store_is_named_a_symlink_not_a_file(tmp_path):
    """PAYRUN_SLIPS_DIR=/srv/slips/site-a with /srv/slips a symlink to a share not
    mounted: it said "/srv/slips is a file, not a directory ... (or move the file)", and
    moving it loses the link to the share. A valid store (a symlink to a mounted one, a
    store not made yet under a directory or under such a symlink) is not refused."""
    from payrun import slipstore

    (tmp_path / "mnt" / "share").mkdir(parents=True)
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "slips").symlink_to(tmp_path / "mnt" / "gone")
    said = slipstore.not_a_directory(tmp_path / "srv" / "slips" / "site-a" / "2026")
    assert said == (f"no slip store at {tmp_path / 'srv' / 'slips' / 'site-a' / '2026'}, and none can be made there: "
                    f"{tmp_path / 'srv' / 'slips'} is a symlink to {tmp_path / 'mnt' / 'gone'}, which is not there: "
                    "mount the shared store, or point the symlink at it"), said
    (tmp_path / "srv" / "mounted").symlink_to(tmp_path / "mnt" / "share")
    for fine in ("mounted", "mounted/site-a", "mounted/site-a/2026", "new/site-a"):
        assert slipstore.not_a_directory(tmp_path / "srv" / fine) is None, fine


def test_a_slip_store_that_cannot_be_made_under_its_directory_is_not_called_one_up_makes(cfg, monkeypatch):
    """A missing store under a directory this account cannot write (read-only, another
    account's; here immutable, which root meets too): `payrun check` said "`payrun up`
    makes it", and `up` started every program, each render failing to make it."""
    import dataclasses
    import subprocess

    from payrun import supervise
    from payrun.errors import SetupError

    parent = cfg.home / "locked"
    parent.mkdir()
    if subprocess.run(["chattr", "+i", str(parent)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not allowed here")
    try:
        store = parent / "slips"
        code, finding, text = _slips_check(cfg, monkeypatch, store)
        assert code == 1 and finding["level"] == FAIL, finding
        assert finding["text"].startswith(f"no slip store at {store}, and this account cannot make it: {parent} "
                                          "cannot be written"), finding
        assert "`payrun up` makes it" not in text, text
        with pytest.raises(SetupError, match="this account cannot make it"):
            supervise.check_role(dataclasses.replace(cfg, slips=str(store / "deeper")), "all")
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=True)
    supervise.check_role(dataclasses.replace(cfg, slips=str(parent / "slips")), "all")  # writable again: fine


def _slips_check(cfg, monkeypatch, store) -> tuple[int, dict, str]:
    """`payrun check` of a worker host (its part has the slip store, and needs no payroll data)."""
    (cfg.home / "supervisor.role").write_text("worker\n")
    monkeypatch.setenv("PAYRUN_SLIPS_DIR", str(store))
    out = CliRunner().invoke(cli, ["check", "--no-email", "--json"], catch_exceptions=False)
    finding = next(c for c in json.loads(out.output)["checks"] if c["area"] == "slips")
    return out.exit_code, finding, CliRunner().invoke(cli, ["check", "--no-email"]).output


def test_payrun_check_fails_a_slip_store_under_a_file_and_makes_nothing(cfg, monkeypatch):
    """PAYRUN_SLIPS_DIR under a regular file (ENOTDIR, which root meets too): it said
    "`payrun up` makes it", which cannot."""
    blocker = cfg.home / "slips.tar"
    blocker.write_bytes(b"not a directory")
    store = blocker / "slips"
    code, finding, text = _slips_check(cfg, monkeypatch, store)
    assert code == 1 and finding["level"] == FAIL, finding
    assert finding["text"] == (f"no slip store at {store}, and none can be made there: {blocker} is a file, not a "
                               "directory; set PAYRUN_SLIPS_DIR to a directory (or move the file)")
    assert "FAIL  slips" in text and "`payrun up` makes it" not in text, text
    assert blocker.read_bytes() == b"not a directory" and not (cfg.home / "slips").exists()


def test_payrun_check_fails_a_slip_store_no_file_can_be_made_in_and_makes_nothing(cfg, monkeypatch):
    """A directory root cannot write to either: /proc (its error, "No such file or
    directory", was all the check said of a store that is there)."""
    store = Path("/proc")
    if not store.is_dir():
        pytest.skip("no /proc here")
    before = set(os.listdir(store))
    code, finding, text = _slips_check(cfg, monkeypatch, store)
    if finding["level"] == OK:
        pytest.skip("this system lets a file be made in /proc")
    assert code == 1 and finding["level"] == FAIL, finding
    assert finding["text"].startswith("/proc: a slip cannot be written there (")
    assert finding["text"].endswith("set PAYRUN_SLIPS_DIR to a directory on a disk"), finding
    assert "FAIL  slips" in text, text
    assert not [n for n in set(os.listdir(store)) - before if n.startswith(".payrun-check")]


def test_a_local_provider_token_file_that_cannot_be_read_is_not_called_a_provider_to_restart(tmp_path):
    """A provider-token file that is not a token (a second line) made `payrun check` add
    "the one listening there is another data directory's ...: `supervisorctl restart
    provider`" (its path has "token" in it): no restart helps; the file's own words say
    what to do. A refused token keeps that advice."""
    from payrun import config as config_mod
    from payrun.provider import TOKEN_NAME

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    (tmp_path / "payrun.toml").write_text(f"[provider]\nport = {port}\n")
    cfg = config_mod.load(tmp_path / "payrun.toml", env={"PAYRUN_HOME": str(tmp_path / "home")})
    token = cfg.redis_dir / TOKEN_NAME
    cfg.redis_dir.mkdir(parents=True)
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"SECRETX\nthe new token")
    os.close(fd)
    rep = preflight.Report()
    preflight._email(cfg, rep)
    said = next(f.text for f in rep.findings if f.level == FAIL)
    assert f"{token} is not one line of printable ASCII" in said, said
    assert "restart" not in said and "`payrun up` starts it" not in said and "SECRETX" not in said, said
    token.write_text("the-token")
    p = Provider(port=port, latency_s=0, token="another-token").start()
    try:
        rep = preflight.Report()
        preflight._email(cfg, rep)
        said = next(f.text for f in rep.findings if f.level == FAIL)
        assert "refused our token (401)" in said and "`supervisorctl restart provider`" in said, said
    finally:
        p.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another account")
def test_a_slip_store_this_account_cannot_reach_is_said_not_a_traceback(tmp_path):
    """Not as root: a store below a folder this account cannot enter made `payrun check` and
    `payrun up` end in a PermissionError traceback (Path.exists raises EACCES). Run as the
    `nobody` account in a forked child (the modules are loaded already), on a store below a
    root-only folder."""
    import json as _json

    from payrun import preflight, slipstore

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    tmp_path.chmod(0o755)  # (nobody may enter tmp_path, not locked)
    store = locked / "slips"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = {"up": slipstore.store_problem(store), "check": preflight.store_missing_text(store)}
            os.write(w, _json.dumps(out).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - tell the parent
            os.write(w, _json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = _json.loads(f.read() or b"{}")
    os.waitpid(pid, 0)
    assert "error" not in said, said
    for text in (said["up"], said["check"]):
        assert text.startswith(f"the slip store {store} cannot be reached by this account (Permission denied"), text


def test_a_pay_month_whose_tick_was_missed_and_not_run_is_named_with_its_run(world):
    """Drill (session 41): everything down over the pay-run tick past the catch-up window;
    `payrun status` named the month to run by hand, `payrun check` said "ready" of the
    next tick alone. It warns with the same `payrun run --month M`, until the month runs."""
    from scheduler.store import Store

    cfg, conn, db, ledger = world
    store = Store(cfg.ledger_path)
    store.record_not_run("payroll", "payroll", ["2026-10-31T20:00:00+00:00"], "missed",
                         "no scheduler was running at the tick's time; run it by hand: payrun run --month 2026-10")
    store.close()
    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    rep = preflight.check(cfg, month="2026-11", email=False, now=now)
    missed = [f for f in rep.findings if f.area == "scheduler" and "was missed" in f.text]
    assert len(missed) == 1 and missed[0].level == WARN, rep.findings
    assert "the 2026-10 pay run has not run" in missed[0].text and "`payrun run --month 2026-10`" in missed[0].text
    ledger.claim_run(1, "2026-10", "test")  # run by hand since: nothing to say
    rep = preflight.check(cfg, month="2026-11", email=False, now=now)
    assert not [f for f in rep.findings if "was missed" in f.text]
