"""One send-email process refused for its own credentials (jobs.senders), beside others
that send: it pauses itself, its jobs go to the others without spending an attempt, and
it takes sends again once its token works. Every process refused: a provider outage,
as before (tests/test_outage.py)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import senders, tasks
from jobs.errors import AccountRefused, ProviderDown, RefusedHere, Throttled, TransientError
from jobs.limits import read_outage
from jobs.policy import (OUTAGE_HOLDS_PER_JOB, SENDER_TTL_S, another_sender_sends, counts_as_provider_failure,
                         host_probe_s, pauses_every_sender, read_sender_entry, sender_entry)
from payrun import keys
from payrun.provider import Provider, TokenFile
from test_outage import _send, sending_to_a_local_provider

GOOD = "good-token-0123456789"
BAD = "stale-token-9876543210"

# ---- the policy, pure ---------------------------------------------------------------------


def test_a_senders_entry_says_alive_until_and_where_refused_credentials_come_from():
    assert read_sender_entry(sender_entry(None, 5000)) == {"until_ms": 5000, "refused": False, "where": "",
                                                         "since_ms": 0}
    e = read_sender_entry(sender_entry("PAYRUN_EMAIL_TOKEN", 9000, since_ms=1000).encode())
    assert e == {"until_ms": 9000, "refused": True, "where": "PAYRUN_EMAIL_TOKEN", "since_ms": 1000}
    for junk in (b"", b"[]", b"{}", b"not json", b'{"until_ms": "x"}', None):
        assert read_sender_entry(junk) is None


def _e(until_ms, refused=False):
    return {"until_ms": until_ms, "refused": refused, "where": "x" if refused else "", "since_ms": 0}


@pytest.mark.parametrize("entries, local", [
    ({}, False),                                                      # alone, never beaten
    ({"me": _e(2000, True)}, False),                                  # alone
    ({"me": _e(2000, True), "b": _e(2000)}, True),                    # another one sends
    ({"me": _e(2000, True), "b": _e(2000, True)}, False),             # every one refused
    ({"me": _e(2000, True), "b": _e(900)}, False),                    # the other one is gone
    ({"me": _e(2000, True), "b": None, "c": _e(2000, True)}, False),  # unreadable: left out
    ({"me": _e(2000, True), "b": _e(2000, True), "c": _e(2000)}, True),
])
def test_a_refusal_is_this_processs_alone_only_while_another_live_one_is_not_refused(entries, local):
    assert another_sender_sends(entries, "me", now_ms=1000) is local


def test_a_paused_process_asks_again_after_5_s_then_twice_as_long_up_to_a_minute():
    assert [host_probe_s(n) for n in range(7)] == [5, 10, 20, 40, 60, 60, 60]
    assert host_probe_s(10_000) == 60 and host_probe_s(-1) == 5


def test_a_send_refused_here_alone_pauses_nobody_else_and_is_no_provider_failure():
    e = RefusedHere("not sent: refused here")
    assert isinstance(e, Throttled) and e.retry_after_s == 1.0
    assert not pauses_every_sender(e) and not counts_as_provider_failure(e)
    assert counts_as_provider_failure(AccountRefused("HTTP 401"))  # (everyone refused: an outage, as before)


def test_the_runtime_holds_a_job_refused_here_for_free_a_bounded_number_of_times():
    from jobs.runtime import EventsMixin

    from test_outage import HeldJob

    def Job(holds):  # noqa: N802 - a stand-in for RQ's job
        return HeldJob(holds, attempt=2, retries_left=4)

    refused = RefusedHere("not sent: the provider refused this send-email process's credentials")
    free = Job(holds=0)
    EventsMixin._classify_exception(None, free, RefusedHere, refused, None)
    assert free.retries_left == 5 and free.meta["held"] == 1 and free._held_try
    assert free.enqueue_at_front_on_retry and free.meta["retry_after"] == 1.0
    spent = Job(holds=OUTAGE_HOLDS_PER_JOB)
    EventsMixin._classify_exception(None, spent, RefusedHere, refused, None)
    assert spent.retries_left == 4 and "this attempt counts" in spent.meta["last_error"]


# ---- HostCredentials, against Redis ----------------------------------------------------------


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _alive(conn, name, refused_where=None):
    conn.hset(keys.limit_senders("email"), name,
              sender_entry(refused_where, time.time() * 1000 + SENDER_TTL_S * 1000, time.time() * 1000))


def test_the_first_of_two_processes_refused_pauses_itself_and_the_last_one_is_an_outage(conn, caplog):
    caplog.set_level(logging.INFO, logger="payrun.jobs.senders")
    a = senders.HostCredentials("email.host-a.1")
    b = senders.HostCredentials("email.host-b.2")
    a._write(conn)
    b._write(conn)
    assert a.refused(conn, "PAYRUN_EMAIL_TOKEN in this process's environment", "HTTP 401 bad token") is True
    assert a.paused and not b.paused
    assert [r["process"] for r in senders.read_refused(conn)] == ["email.host-a.1"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "THIS process's credentials" in errors[0].getMessage()
    assert "PAYRUN_EMAIL_TOKEN" in errors[0].getMessage()
    # a second refusal of the same process (another lane's send in flight): no second line
    assert a.refused(conn, "PAYRUN_EMAIL_TOKEN", "HTTP 401 bad token") is True
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    # b refused too: every live process is refused, so this is the provider's (or the
    # account's) doing: an outage, counted as before, and b keeps sending to probe it
    assert b.refused(conn, "PAYRUN_EMAIL_TOKEN", "HTTP 401 bad token") is False
    assert not b.paused
    # a process gone (its entry lapsed) sends nothing: alone, the refusal is an outage
    c = senders.HostCredentials("email.host-c.3")
    conn.delete(keys.limit_senders("email"))
    conn.hset(keys.limit_senders("email"), "email.host-d.4", sender_entry(None, time.time() * 1000 - 1))
    assert c.refused(conn, "x", "HTTP 401") is False and not c.paused


def test_a_paused_process_probes_on_its_schedule_says_so_at_a_throttle_and_resumes_when_its_token_file_is_fixed(
        conn, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="payrun.jobs.senders")
    from jobs import mail

    token_file = tmp_path / "provider-token"
    token_file.write_text(BAD + "\n")
    token_file.chmod(0o600)
    provider = Provider(latency_s=0, rate_per_s=100, token=GOOD).start()
    try:
        tr = mail.transport_for(provider.url, 5, token=TokenFile(token_file))
        mono = Clock()
        me = senders.HostCredentials("email.host-a.1", mono=mono)
        _alive(conn, "email.host-b.2")
        assert me.refused(conn, tr.credentials_source(), "HTTP 401") is True
        assert me.next_probe == 1005.0
        said = lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]  # noqa: E731
        assert str(token_file) in said()[0] and BAD not in said()[0] and GOOD not in said()[0]
        mono.t = 1005.0
        assert me.probe(tr) is False and me.paused and me.next_probe == 1015.0
        assert len(said()) == 1  # repeated at a throttle, not at every probe
        mono.t = 1065.0
        assert me.probe(tr) is False and me.next_probe == 1065.0 + 20
        assert len(said()) == 2 and "still refuses" in said()[1] and str(token_file) in said()[1]
        # the operator replaces the file (the way the README says): the next probe reads it
        new = tmp_path / "provider-token.new"
        new.write_text(GOOD + "\n")
        new.chmod(0o600)
        os.replace(new, token_file)
        assert me.probe(tr) is True and not me.paused
        assert any("accepts this process's credentials again" in r.getMessage() for r in caplog.records)
        assert provider.stats()["delivered"] == 0  # probes send nothing
        assert not any(BAD in r.getMessage() or GOOD in r.getMessage() for r in caplog.records)
    finally:
        provider.stop()


def test_a_process_paused_again_soon_after_a_resume_backs_off_instead_of_looping():
    """A probe the provider accepts while it refuses the sends (an SMTP login accepted, our
    sender refused): each resume sent a lane's worth of sends to be refused, every 5 s."""
    mono = Clock()
    me = senders.HostCredentials("email.host-a.1", mono=mono)
    me._pause("x", "HTTP 401", 0)
    assert me.next_probe == 1005.0
    mono.t = 1005.0
    me._resume("a probe")
    mono.t = 1006.0
    me._pause("x", "HTTP 401", 0)  # refused again at once
    assert me.next_probe == 1016.0
    mono.t = 1016.0
    me._resume("a probe")
    mono.t = 1017.0
    me._pause("x", "HTTP 401", 0)
    assert me.next_probe == 1037.0
    mono.t = 1037.0
    me._resume("a probe")
    mono.t = 2000.0  # a long time later: a new story
    me._pause("x", "HTTP 401", 0)
    assert me.next_probe == 2005.0


def test_lanes_of_a_paused_process_wait_and_the_wait_ends_when_it_resumes():
    import threading

    me = senders.HostCredentials("email.host-a.1")
    stop = threading.Event()
    t0 = time.monotonic()
    me.wait_resumed(stop, 5.0)  # not paused: no wait
    assert time.monotonic() - t0 < 1.0
    me._pause("x", "HTTP 401", 0)
    threading.Timer(0.1, me.sent).start()  # a send already on its way went through
    me.wait_resumed(stop, 30.0)
    assert not me.paused and time.monotonic() - t0 < 10.0


def test_a_paused_process_takes_sends_again_once_no_other_one_sends(conn, caplog):
    """The other host stopped (or died, or was refused too): staying paused would leave the
    run to nobody; sending again makes the next refusal an outage, as with every host refused."""
    caplog.set_level(logging.INFO, logger="payrun.jobs.senders")
    me = senders.HostCredentials("email.host-a.1")
    _alive(conn, "email.host-b.2")
    assert me.refused(conn, "PAYRUN_EMAIL_TOKEN", "HTTP 401") is True
    me.look_at_others(conn)
    assert me.paused  # b still sends
    conn.hset(keys.limit_senders("email"), "email.host-b.2", sender_entry(None, time.time() * 1000 - 1))
    me.look_at_others(conn)
    assert not me.paused
    assert any("no other send-email process sends now" in r.getMessage() for r in caplog.records)
    assert me.refused(conn, "PAYRUN_EMAIL_TOKEN", "HTTP 401") is False  # now an outage


# ---- the send path (jobs.tasks.send_limited), in this process ----------------------------------


@pytest.fixture
def refused_here(cfg, monkeypatch, tmp_path):
    """This process sends with a token the local provider refuses; another process's entry
    is alive beside it, not refused."""
    monkeypatch.setenv("PAYRUN_EMAIL_TOKEN", BAD)
    monkeypatch.setattr(senders, "HOST", senders.HostCredentials("email.this-host.1"))
    yield from sending_to_a_local_provider(monkeypatch, tmp_path, token=GOOD)


def test_a_send_refused_for_this_processs_credentials_while_another_sends_goes_back_unspent(conn, refused_here):
    cfg, provider = refused_here
    _alive(conn, "email.other-host.2")
    with pytest.raises(RefusedHere) as ei:
        _send(conn, cfg, 1)
    assert "401" in str(ei.value) and "PAYRUN_EMAIL_TOKEN" in str(ei.value) and BAD not in str(ei.value)
    assert senders.HOST.paused
    assert read_outage(conn) is None  # no streak: the provider is fine
    assert conn.get(keys.idem_state("2026-11:1:emp-1")) is None  # its claim given back: another host sends it
    # a lane that took a job as this process paused: not sent, back for another process
    with pytest.raises(RefusedHere) as ei:
        _send(conn, cfg, 2)
    assert "not sent" in str(ei.value)
    assert provider.stats()["delivered"] == 0


def test_every_process_refused_is_still_a_provider_outage(conn, refused_here):
    cfg, provider = refused_here
    _alive(conn, "email.other-host.2", refused_where="PAYRUN_EMAIL_TOKEN")
    errors = []
    for n in range(4):
        with pytest.raises(TransientError) as ei:
            _send(conn, cfg, n)
        errors.append(ei.value)
    assert [type(e) for e in errors[:2]] == [AccountRefused, AccountRefused]
    assert isinstance(errors[2], ProviderDown) and isinstance(errors[3], ProviderDown)
    assert not senders.HOST.paused
    assert "refused our credentials" in read_outage(conn)["last_error"]


def test_an_smtp_login_refused_here_alone_names_the_password_variable_never_the_password(
        conn, cfg, monkeypatch, tmp_path, caplog):
    from tests.test_mail import Recorder, smtp_with_login

    caplog.set_level(logging.INFO, logger="payrun.jobs.senders")
    handler = Recorder()
    ctl = smtp_with_login(handler)
    try:
        monkeypatch.setenv("PAYRUN_EMAIL_URL", f"smtp://payroll@127.0.0.1:{ctl.port}")
        monkeypatch.setenv("PAYRUN_SMTP_PASSWORD", "wr0ng-pw")
        monkeypatch.setattr(senders, "HOST", senders.HostCredentials("email.this-host.1"))
        monkeypatch.setattr(tasks, "_limiters", {})
        monkeypatch.setattr(tasks, "_transports", {})
        tasks.settings.cache_clear()
        _alive(conn, "email.other-host.2")
        with pytest.raises(RefusedHere) as ei:
            _send(conn, tasks.settings(), 1)
        assert "535" in str(ei.value) and "wr0ng" not in str(ei.value)
        assert senders.HOST.paused and read_outage(conn) is None and not handler.messages
        [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert "PAYRUN_SMTP_PASSWORD (login 'payroll' at 127.0.0.1:" in said and "wr0ng" not in said
        assert senders.HOST.probe(tasks.transport()) is False  # (the variable takes a restart)
    finally:
        ctl.stop()
        tasks.settings.cache_clear()


# ---- two send-email processes, one Redis, the local HTTP provider ------------------------------


def _worker(env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", "send-email", "--lanes", "4"],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(what: str, pred, timeout_s: float, why=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}: {why()}")
        time.sleep(0.05)
    return got


def _enqueue(conn, cfg, store: Path, first: int, n: int) -> list[str]:
    ids = []
    for i in range(first, first + n):
        emp = f"emp-{i:03d}"
        rel = tasks.slip_relpath("2026-11", 1, emp)
        path = store / rel
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(b"%PDF-1.7 test slip")
        path.chmod(0o600)
        ids.append(tasks.enqueue_email(conn, cfg, {
            "month": "2026-11", "key": keys.idem_key("2026-11", emp), "company_id": 1, "company_name": "Meghna",
            "employee_id": emp, "to": f"{emp}@meghna.example", "to_name": f"E {i}", "slip": rel}))
    return ids


def test_one_host_with_a_stale_token_file_leaves_its_sends_to_the_other_host_then_picks_up_once_fixed(
        conn, cfg, redis_url, tmp_path):
    """The bug: host B's token file was stale. Each of B's sends was refused and spent an
    attempt of its slip, and A's successes kept resetting the outage streak, so nothing
    paused: slips reached the failed list while the provider and host A were fine."""
    from tests.cluster import scrub_env

    provider = Provider(latency_s=0.0, rate_per_s=1000, token=GOOD).start()
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    base = scrub_env()
    base.update(PAYRUN_REDIS_URL=redis_url, PAYRUN_SLIPS_DIR=str(store), PYTHONPATH=os.pathsep.join(sys.path))
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    env_a = dict(base, PAYRUN_HOME=str(home_a), PAYRUN_EMAIL_URL=provider.url, PAYRUN_EMAIL_TOKEN=GOOD)
    # host B: the local provider's token file of its own data directory, stale
    (home_b / "redis").mkdir(parents=True, mode=0o700)
    token_file = home_b / "redis" / "provider-token"
    token_file.write_text(BAD + "\n")
    token_file.chmod(0o600)
    toml_b = tmp_path / "b.toml"
    toml_b.write_text(f"[provider]\nport = {provider.port}\n")
    env_b = dict(base, PAYRUN_HOME=str(home_b), PAYRUN_CONFIG=str(toml_b))
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    procs = []
    try:
        procs = [_worker(env_a, log_a), _worker(env_b, log_b)]
        pids = {p.pid for p in procs}
        tail = lambda: f"A: {log_a.read_text()[-2000:]}\nB: {log_b.read_text()[-2000:]}"  # noqa: E731

        def both_lanes_up():
            names = [n.decode() for n in conn.smembers("rq:workers")]
            return {int(n.rsplit(".", 2)[1]) for n in names if n.startswith("rq:worker:email.")} >= pids  # (a hostname may hold dots)
        _wait("both send-email processes", both_lanes_up, 60, tail)
        ids = _enqueue(conn, cfg, store, 0, 40)
        _wait("40 deliveries", lambda: provider.stats()["delivered"] >= 40, 60, tail)
        from jobs.runtime import make_queue

        q = make_queue(keys.EMAIL_QUEUE, conn)
        assert conn.zcard("rq:failed:send-email") == 0, tail()
        spent = {}
        for job_id in ids:
            meta = q.fetch_job(job_id).get_meta(refresh=True)
            spent[job_id] = int(meta.get("attempt", 0)) - int(meta.get("held", 0))
        assert set(spent.values()) == {1}, (spent, tail())  # no slip spent an attempt on B's token
        assert read_outage(conn) is None  # nobody else paused
        refused = senders.read_refused(conn)
        assert [r["pid"] for r in refused] == [procs[1].pid], refused
        b_log = log_b.read_text()
        said = [ln for ln in b_log.splitlines() if "refuses THIS process's credentials" in ln]
        assert len(said) == 1 and "ERROR" in said[0] and str(token_file) in said[0], b_log[-3000:]
        assert BAD not in b_log and GOOD not in b_log
        # the operator fixes B's token file; B picks up again without a restart
        new = token_file.with_name("provider-token.new")
        new.write_text(GOOD + "\n")
        new.chmod(0o600)
        os.replace(new, token_file)
        _wait("host B taking sends again", lambda: not senders.read_refused(conn), 30, tail)
        assert "accepts this process's credentials again" in log_b.read_text()
        procs[0].send_signal(signal.SIGTERM)  # only B left to send
        procs[0].wait(timeout=30)
        _enqueue(conn, cfg, store, 100, 5)
        _wait("host B's deliveries", lambda: provider.stats()["delivered"] >= 45, 30, tail)
        assert conn.zcard("rq:failed:send-email") == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        provider.stop()


# ---- what the on-call engineer sees ---------------------------------------------------------


def test_check_warns_of_a_paused_process_and_fails_when_none_is_left_sending():
    from payrun import preflight
    from payrun.preflight import FAIL, WARN

    r = {"process": "email.host-b.42", "host": "host-b", "pid": 42, "since_ms": 1_000_000.0,
         "where": "PAYRUN_EMAIL_TOKEN in this process's environment (a restart takes a new value)"}
    assert preflight.refused_sender_verdicts([], 2, 1_060_000.0) == []
    [one] = preflight.refused_sender_verdicts([r], 2, 1_060_000.0)
    assert one.level == WARN and one.area == "workers"
    assert one.text.startswith("send-email host-b pid 42 PAUSED 60 s: the provider refuses its credentials "
                               "(PAYRUN_EMAIL_TOKEN in this process's environment"), one.text
    [every] = preflight.refused_sender_verdicts([r], 1, 1_060_000.0)
    assert every.level == FAIL and "every send-email process is paused" in every.text


def test_workers_names_a_process_paused_for_its_credentials(cfg, conn):
    from click.testing import CliRunner

    from payrun.cli import cli
    from payrun.ledger import Ledger

    Ledger(cfg.ledger_path).close()  # a data directory in use
    _alive(conn, "email.host-b.42", refused_where="the local provider's token file /srv/b/redis/provider-token")
    _alive(conn, "email.host-a.41")
    out = CliRunner().invoke(cli, ["workers"], catch_exceptions=False).output
    lines = [ln for ln in out.splitlines() if "PAUSED" in ln]
    assert len(lines) == 1 and lines[0].startswith("send-email host-b pid 42 PAUSED"), out
    assert "/srv/b/redis/provider-token" in lines[0]
    assert senders.read_refused(conn)[0]["host"] == "host-b"
    from payrun import metrics

    got = {m.name: m.samples[0].value for m in metrics.StateCollector(conn, cfg).collect() if m.samples}
    assert got["payrun_email_senders_refused"] == 1 and got["payrun_email_provider_down"] == 0


class SenderRefusing:
    """aiosmtpd handler: takes any login, refuses MAIL FROM for every address but ``allowed``
    (a 553 5.7.1, as a provider answers a sender the login may not send as); records the
    commands it was given and the messages it took."""

    def __init__(self, allowed: str):
        self.allowed = allowed
        self.commands: list[str] = []
        self.messages: list[bytes] = []

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        self.commands.append(f"MAIL {address}")
        if address != self.allowed:
            return "553 5.7.1 Sender address rejected: not owned by user payroll"
        envelope.mail_from = address
        return "250 OK"

    async def handle_RSET(self, server, session, envelope):
        self.commands.append("RSET")
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        self.messages.append(envelope.content)
        return "250 OK"


def test_a_refused_smtp_sender_keeps_the_process_paused_its_probe_offers_the_sender_and_sends_nothing(caplog):
    """Review (session 42): over SMTP the credentials probe only logged in, so a server that
    takes our login but refuses our MAIL FROM (5.7.1 sender not allowed) passed it, and each
    resume refused one lane's worth of sends again. The probe now offers our sender (MAIL
    FROM, then RSET: no RCPT, no DATA) and a refusal there is still refused."""
    from aiosmtpd.smtp import AuthResult

    from jobs import mail
    from test_mail import EphemeralController

    handler = SenderRefusing(allowed="payroll@meghna.example")
    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0, auth_require_tls=False,
                              authenticator=lambda *a: AuthResult(success=True, handled=False))
    ctl.start()
    try:
        url = f"smtp://payroll:s3cret@127.0.0.1:{ctl.port}"
        refused = mail.transport_for(url, 5, sender="Payroll <payroll@payrun.localhost>")
        with pytest.raises(mail.CredentialsRefused) as ei:
            refused.probe()
        assert str(ei.value).startswith("connected, login accepted, then our sender payroll@payrun.localhost refused "
                                        "(553 5.7.1 Sender address rejected"), str(ei.value)
        assert "set email.sender to an address this login may send as" in str(ei.value)
        mono = Clock()
        me = senders.HostCredentials("email.host-a.1", mono=mono)
        me._pause(refused.credentials_source(), "SMTP refused sender: 553", 0)
        mono.t = me.next_probe
        caplog.set_level(logging.INFO, logger="payrun.jobs.senders")
        assert me.probe(refused) is False and me.paused  # (it passed before: login accepted)
        # email.sender fixed (and the process restarted with it): the probe passes, sends resume
        fixed = mail.transport_for(url, 5, sender="Payroll <payroll@meghna.example>")
        assert fixed.probe() == "connected, login accepted, sender payroll@meghna.example accepted"
        mono.t = me.next_probe
        assert me.probe(fixed) is True and not me.paused
        assert handler.commands == ["MAIL payroll@payrun.localhost"] * 2 + ["MAIL payroll@meghna.example", "RSET"] * 2
        assert handler.messages == []  # probes send nothing
        # without a sender (as before), a probe stops at the login
        assert mail.transport_for(url, 5).probe() == "connected, login accepted"
    finally:
        ctl.stop()


def test_status_names_a_process_paused_for_its_credentials_in_one_line(cfg, conn):
    """Session 42's closing note: `payrun workers`, `payrun check` and the console named a
    send-email process paused for its own credentials; `payrun status` said nothing."""
    import json

    from click.testing import CliRunner

    from payrun.cli import cli
    from payrun.ledger import Ledger

    ledger = Ledger(cfg.ledger_path)
    assert ledger.claim_run(1, "2026-11", "test")
    ledger.create_jobs([{"id": "email-2026-11-emp-1", "kind": "email", "month": "2026-11", "company_id": 1}])
    ledger.finish_run(1, "2026-11", 1)
    ledger.close()
    _alive(conn, "email.host-a.41")
    runner = CliRunner()
    data = json.loads(runner.invoke(cli, ["status", "--json"], catch_exceptions=False).output)
    assert data["paused_senders"] == [] and not any("PAUSED" in n for n in data["notes"]), data["notes"]
    where = "PAYRUN_EMAIL_TOKEN in this process's environment (a restart takes a new value)"
    since = time.time() * 1000 - 65_000
    conn.hset(keys.limit_senders("email"), "email.host-b.42",
              sender_entry(where, time.time() * 1000 + SENDER_TTL_S * 1000, since))
    data = json.loads(runner.invoke(cli, ["status", "--json"], catch_exceptions=False).output)
    [p] = data["paused_senders"]
    assert (p["host"], p["pid"], p["where"], p["since_ms"]) == ("host-b", 42, where, int(since))
    assert 64 <= p["paused_s"] <= 70
    text = runner.invoke(cli, ["status"], catch_exceptions=False).output
    [line] = [ln for ln in text.splitlines() if "PAUSED" in ln]  # one line: which, since when, why, what to do
    assert line.startswith("note: send-email process 42 on host-b is PAUSED since "), line
    assert f"({where})" in line and "fix its credentials on host-b" in line, line
    assert "spending no attempt" in line and "takes sends again by itself" in line, line
    from payrun.status import paused_sender_text

    r = {"process": "email.host-b.42", "host": "host-b", "pid": 42, "since_ms": 1_793_478_300_000.0, "where": where}
    assert paused_sender_text(r, "Asia/Dhaka", 1_793_478_365_000.0).startswith(
        "send-email process 42 on host-b is PAUSED since 02:25:00 +06 (65 s): the provider refuses its own "
        "credentials (PAYRUN_EMAIL_TOKEN")
