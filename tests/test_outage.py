"""A provider outage: when the provider fails ``limits.outage_after`` sends in a row,
every sender on every host pauses, then one send at a time probes it, and the sends held
back spend no attempt. Policy in pure functions; the rest against the session Redis and
the local provider."""

from __future__ import annotations

import json
import logging
import os
import smtplib
import socket
import threading
import time

import pytest

from jobs import idempotency, tasks
from jobs.errors import (OutcomeUnknown, PermanentError, ProviderDown, RateWait, RecipientDeferred, Throttled,
                         TransientError)
from jobs.limits import Limiter, read_outage
from jobs.policy import (OUTAGE_HOLDS_PER_JOB, classify, counts_as_provider_failure, outage_hold_is_free,
                         outage_pause_s, pauses_every_sender)
from payrun import config, keys
from payrun.procs import host_id
from payrun.provider import Provider

# ---- policy (pure) ------------------------------------------------------------------


def test_the_outage_pause_doubles_with_each_failed_probe_up_to_its_ceiling():
    assert [outage_pause_s(t, 5, 30) for t in range(1, 7)] == [5, 10, 20, 30, 30, 30]
    assert outage_pause_s(1, 0.2, 0.5) == 0.2 and outage_pause_s(3, 0.2, 0.5) == 0.5
    assert outage_pause_s(10_000, 5, 30) == 30  # no overflow on a very long outage
    with pytest.raises(ValueError):
        outage_pause_s(0, 5, 30)


def _job_timeout():
    from rq.timeouts import JobTimeoutException

    from jobs.watchdog import timeout_exception

    return timeout_exception(JobTimeoutException, 30)()  # what the watchdog raises in a send


@pytest.mark.parametrize("exc, counts", [
    (TransientError("HTTP 503 provider outage"), True),
    (OutcomeUnknown("connection dropped after the request was sent"), True),
    (ConnectionRefusedError(111, "refused"), True),
    (socket.timeout("timed out"), True),
    (smtplib.SMTPServerDisconnected("gone"), True),
    (_job_timeout(), True),  # a provider that hangs: the job's timeout ends the send
    (Throttled("HTTP 429", retry_after_s=1.0), False),  # the 429 pause covers it
    (RateWait(), False),  # our own limiter
    (RecipientDeferred("SMTP deferred recipient: 451 greylisted"), False),  # one address's
    (PermanentError("HTTP 422 bad address"), False),  # one employee's problem
    (ValueError("a bug"), False),
])
def test_what_counts_as_the_provider_failing(exc, counts):
    assert counts_as_provider_failure(exc) is counts


def test_a_job_held_back_by_an_outage_is_transient_and_pauses_nobody_by_itself():
    down = ProviderDown("email provider down", retry_after_s=5.0)
    assert isinstance(down, Throttled)  # the runtime gives the attempt back (jobs.runtime)
    assert classify(down).transient and classify(down).retry_after_s == 5.0
    assert not pauses_every_sender(down)  # the outage pause is already on


def test_a_job_is_held_for_free_a_bounded_number_of_times():
    assert [outage_hold_is_free(n) for n in (0, 9, 10, 50)] == [True, True, False, False]
    assert OUTAGE_HOLDS_PER_JOB == 10


@pytest.mark.parametrize("toml, problem", [
    ("[limits]\noutage_after = 1\n", "outage_after must be 0 (off) or >= 2"),
    ("[limits]\noutage_after = -3\n", "outage_after must be 0 (off) or >= 2"),
    ("[limits]\noutage_pause_s = 0\n", "0.1 <= outage_pause_s <= outage_pause_max_s <= 3600"),
    ("[limits]\noutage_pause_s = 60.0\noutage_pause_max_s = 30.0\n", "0.1 <= outage_pause_s <= outage_pause_max_s <= 3600"),
])
def test_outage_settings_are_validated_at_start(tmp_path, toml, problem):
    p = tmp_path / "payrun.toml"
    p.write_text(toml)
    with pytest.raises(config.ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        config.load(p, env={"PAYRUN_HOME": str(tmp_path)})


def test_the_defaults_and_off(tmp_path):
    d = config.LimitsConfig()
    assert (d.outage_after, d.outage_pause_s, d.outage_pause_max_s) == (10, 5.0, 30.0)
    p = tmp_path / "payrun.toml"
    p.write_text("[limits]\noutage_after = 0\n")
    assert config.load(p, env={"PAYRUN_HOME": str(tmp_path)}).limits.outage_after == 0


# ---- the limiter, in Redis -------------------------------------------------------------


def limiter(conn, after=3, first_s=30.0, max_s=60.0, cap=5) -> Limiter:
    lim = Limiter(conn, "email", cap, 1000.0, lease_s=30, outage_after=after, outage_pause_s=first_s,
                  outage_pause_max_s=max_s)
    lim.seed()
    return lim


def end_pause(conn) -> None:
    """The pause runs out now (tests do not wait 30 s for it): its key goes, and the end
    the outage recorded moves to now."""
    assert conn.delete(keys.limit_pause("email")) == 1
    conn.hset(keys.limit_outage("email"), "paused_until", int(now_ms(conn)) - 1)


def now_ms(conn) -> float:
    sec, usec = conn.time()
    return int(sec) * 1000 + int(usec) / 1000


def test_sends_failing_in_a_row_pause_every_sender_then_one_probe_at_a_time(conn):
    lim, other_host = limiter(conn), limiter(conn)
    assert lim.provider_failed("HTTP 503") is None
    assert other_host.provider_failed("HTTP 503") is None  # the streak is shared by every host
    assert read_outage(conn)["state"] == "failing"
    down = lim.provider_failed("TransientError: HTTP 503 provider outage")
    assert down is not None and down.started and (down.streak, down.trips) == (3, 1)
    assert 29 <= down.wait_s <= 30
    out = read_outage(conn)
    assert out["state"] == "paused" and out["pauses"] == 1 and out["failed_in_a_row"] == 3
    assert out["last_error"] == "TransientError: HTTP 503 provider outage" and out["outage_since"]
    # nobody takes a slot while paused, on any host
    ok, wait_ms = other_host.try_slot("lane-a")
    assert not ok and 0 < wait_ms <= 30_000
    # a send in flight when the pause began fails too: it is held back, the pause unchanged
    late = other_host.provider_failed("HTTP 503")
    assert late is not None and not late.started and late.trips == 1 and late.wait_s <= down.wait_s
    # after the pause: one send probes the provider, the others wait
    end_pause(conn)
    assert read_outage(conn)["state"] == "probing"
    assert lim.try_slot("probe")[0]
    assert other_host.try_slot("lane-b") == (False, 200)
    # the probe fails: a pause twice as long
    lim.release("probe")
    again = lim.provider_failed("HTTP 503")
    assert again.started and again.trips == 2 and 59 <= again.wait_s <= 60
    end_pause(conn)
    assert other_host.try_slot("probe-2")[0]
    # the next probe succeeds: the outage is over, the cap is back for every host
    ended = other_host.provider_ok()
    assert ended is not None and ended[0] == 2 and ended[1] >= 0
    assert read_outage(conn) is None
    assert lim.try_slot("lane-c")[0] and lim.try_slot("lane-d")[0]  # 3 of 5 held
    stats = lim.stats()
    assert stats["outage_pauses"] == 2 and stats["outages"] == 1


def test_a_send_in_flight_when_the_pause_ended_is_not_the_probe(conn):
    """A failure of a send that started before the pause ended (a slow request, in flight
    all along) is held; only a send started after it (the probe) can pause again."""
    lim = limiter(conn, after=2)
    started_before = now_ms(conn) - 1000  # a slow request, sent a second before the outage began
    lim.provider_failed("HTTP 503")
    assert lim.provider_failed("HTTP 503").trips == 1
    end_pause(conn)
    late = lim.provider_failed("TimeoutError: timed out", started_ms=started_before)
    assert late is not None and not late.started and late.trips == 1 and late.wait_s == 0
    assert read_outage(conn)["state"] == "probing" and read_outage(conn)["pauses"] == 1
    probe = lim.provider_failed("HTTP 503", started_ms=now_ms(conn))
    assert probe.started and probe.trips == 2


def test_a_503s_retry_after_lengthens_the_pause_up_to_its_ceiling(conn):
    lim = limiter(conn, after=2, first_s=5, max_s=30)
    lim.provider_failed("HTTP 503")
    assert 19 <= lim.provider_failed("HTTP 503", asked_s=20).wait_s <= 20
    end_pause(conn)
    assert 29 <= lim.provider_failed("HTTP 503", asked_s=600).wait_s <= 30


def test_a_success_anywhere_ends_the_streak_and_lifts_the_outage_pause(conn):
    """The success path does it inside the script that marks the key sent: every host's
    success counts, at no extra round trip."""
    from jobs import idempotency

    lim = limiter(conn, after=3)
    for _ in range(5):
        assert lim.provider_failed("HTTP 503") is None
        assert lim.provider_failed("HTTP 503") is None
        assert idempotency.claim(conn, "k", "o", 60) == idempotency.OK
        assert idempotency.mark_sent(conn, "k", "o", "m-1", outage_keys=lim.outage_keys()) is None  # no outage
        conn.delete(keys.idem_state("k"))
    assert read_outage(conn) is None and not conn.exists(keys.limit_pause("email"))
    for _ in range(3):
        lim.provider_failed("HTTP 503")
    assert conn.pttl(keys.limit_pause("email")) > 0
    # a send in flight all along succeeds: the provider is back, nobody waits out the pause
    assert idempotency.claim(conn, "k2", "o", 60) == idempotency.OK
    ended = idempotency.mark_sent(conn, "k2", "o", "m-2", outage_keys=lim.outage_keys())
    assert ended is not None and ended[0] == 1
    assert read_outage(conn) is None and not conn.exists(keys.limit_pause("email"))
    assert idempotency.state(conn, "k2")["state"] == "sent"


def test_an_outage_success_leaves_a_429_pause_alone(conn):
    lim = limiter(conn, after=2)
    lim.provider_failed("HTTP 503")
    lim.provider_failed("HTTP 503")
    end_pause(conn)
    lim.pause(20)  # the provider's Retry-After, meanwhile
    assert lim.provider_ok() is not None
    assert conn.pttl(keys.limit_pause("email")) > 10_000


def test_off_counts_nothing(conn):
    lim = limiter(conn, after=0)
    for _ in range(20):
        assert lim.provider_failed("HTTP 503") is None
    assert read_outage(conn) is None and lim.try_slot("x")[0] and lim.outage_keys() is None


def test_a_sender_waiting_for_its_start_gives_up_at_once_when_an_outage_pause_begins(conn):
    """Its job goes back without an attempt spent and its slot is freed: after the pause
    only the probe may send (a 429 pause is waited out instead)."""
    lim = limiter(conn, after=2, first_s=20, max_s=20)
    waiting = threading.Event()
    result = []
    lim.pause(2)  # a 429 pause: a sender waits it out ...
    t = threading.Thread(target=lambda: (waiting.set(), result.append(lim.token(deadline_s=time.monotonic() + 60))))
    t0 = time.monotonic()
    t.start()
    waiting.wait(5)
    lim.provider_failed("HTTP 503")
    assert lim.provider_failed("HTTP 503").started  # ... but an outage pause begins meanwhile
    t.join(30)
    assert result == [False] and time.monotonic() - t0 < 15


def test_taking_a_job_during_an_outage(conn):
    """The lanes' path (slot and job in one script): nothing while paused, one at a time
    while probing, all lanes again once a send succeeded."""
    from jobs.limits import EMPTY

    lim = limiter(conn, after=2, cap=5)
    q, inter = f"rq:queue:{keys.EMAIL_QUEUE}", f"rq:queue:{keys.EMAIL_QUEUE}:intermediate"
    conn.rpush(q, *[f"job-{i}" for i in range(5)])
    lim.provider_failed("HTTP 503")
    lim.provider_failed("HTTP 503")
    stop = threading.Event()
    timer = threading.Timer(0.5, stop.set)
    timer.start()
    assert lim.take(stop, "lane-0", q, inter, "rq:job:") is None  # paused: waited until stopped
    timer.cancel()
    end_pause(conn)
    first = lim.take(threading.Event(), "lane-1", q, inter, "rq:job:")
    assert first not in (None, EMPTY) and first.job_id == "job-0"
    stop2 = threading.Event()
    timer = threading.Timer(0.5, stop2.set)
    timer.start()
    assert lim.take(stop2, "lane-2", q, inter, "rq:job:") is None  # the probe holds the only slot
    timer.cancel()
    assert lim.provider_ok() is not None
    got = [lim.take(threading.Event(), f"lane-{i}", q, inter, "rq:job:") for i in (3, 4)]
    assert [g.job_id for g in got] == ["job-1", "job-2"]


# ---- the send path, against the local provider ----------------------------------------


def sending_to_a_local_provider(monkeypatch, tmp_path, **provider_kw):
    """(settings, provider): a local provider, outage after 3 failures (30 s pause, 60 s at
    most), this process's limiters and transports fresh. A generator for a fixture to yield
    from (test_senders' too)."""
    provider = Provider(latency_s=0.0, rate_per_s=1000, **provider_kw).start()
    toml = tmp_path / "outage.toml"
    toml.write_text("[limits]\noutage_after = 3\noutage_pause_s = 30.0\noutage_pause_max_s = 60.0\n")
    monkeypatch.setenv("PAYRUN_CONFIG", str(toml))
    monkeypatch.setenv("PAYRUN_EMAIL_URL", provider.url)
    tasks.settings.cache_clear()
    monkeypatch.setattr(tasks, "_limiters", {})
    monkeypatch.setattr(tasks, "_transports", {})
    try:
        yield tasks.settings(), provider
    finally:
        provider.stop()
        tasks.settings.cache_clear()


@pytest.fixture
def outage_cfg(cfg, monkeypatch, tmp_path):
    yield from sending_to_a_local_provider(monkeypatch, tmp_path)


def _send(conn, cfg, n: int):
    from jobs import mail

    key = f"2026-11:1:emp-{n}"
    token = f"email-{n}:1"
    assert idempotency.claim(conn, key, token, 60) == idempotency.OK
    msg = mail.Message(to_addr=f"e{n}@example.test", to_name=f"E {n}", subject="slip", text_body="hi",
                       attachment_name="s.pdf", attachment_bytes=b"%PDF-1.7 test", idempotency_key=key,
                       sender=cfg.email.sender)
    return tasks.send_limited(conn, cfg, msg, key, token)


def test_a_provider_503_storm_holds_back_sends_without_spending_attempts_and_ends_with_a_success(
        conn, outage_cfg, caplog):
    cfg, provider = outage_cfg
    caplog.set_level(logging.WARNING, logger="payrun.jobs")
    provider.outage(600, 503)
    errors = []
    for n in range(4):
        try:
            _send(conn, cfg, n)
            raise AssertionError("sent during the outage")
        except TransientError as e:
            errors.append(e)
    # the first two are ordinary failures (an attempt each); the third makes the outage
    assert [type(e) for e in errors[:2]] == [TransientError, TransientError]
    assert isinstance(errors[2], ProviderDown) and "3 sends in a row failed" in str(errors[2])
    assert "no attempt spent" in str(errors[2]) and "503" in str(errors[2]) and errors[2].retry_after_s > 0
    # a send starting during the pause does not reach the provider at all
    assert isinstance(errors[3], ProviderDown) and "not sent" in str(errors[3])
    assert provider.stats()["outage_5xx"] == 3
    assert any("email provider down: 3 sends in a row failed" in r.getMessage() for r in caplog.records)
    assert read_outage(conn)["state"] == "paused"
    provider.end_outage()
    end_pause(conn)
    assert read_outage(conn)["state"] == "probing"
    assert _send(conn, cfg, 10)  # the probe: delivered
    assert read_outage(conn) is None
    assert any("email provider answering again" in r.getMessage() for r in caplog.records)
    assert provider.stats()["delivered"] == 1


def test_a_provider_refusing_our_credentials_is_an_outage_not_a_run_of_permanent_failures(conn, outage_cfg):
    """Exploratory testing: a provider answering 401 to every send (a token expired at
    02:00) failed each slip for good after one attempt, 40 a second, with no pause and no
    note. It says nothing about the slip: the senders pause and probe, as for a 503."""
    cfg, provider = outage_cfg
    provider.outage(600, 401)
    errors = []
    for n in range(4):
        with pytest.raises(TransientError) as ei:
            _send(conn, cfg, n)
        errors.append(ei.value)
    assert not any(isinstance(e, PermanentError) for e in errors)
    assert "401" in str(errors[0]) and "refused our credentials" in str(errors[0])
    assert isinstance(errors[2], ProviderDown) and isinstance(errors[3], ProviderDown)
    out = read_outage(conn)
    assert out["state"] == "paused" and "refused our credentials" in out["last_error"]
    from payrun.status import outage_text

    note = outage_text(out, "Asia/Dhaka")  # what status, queues and limits show says
    assert note.startswith("the email provider refuses our credentials since"), note
    assert "check PAYRUN_EMAIL_TOKEN" in note and "fix the token or login (PAYRUN_EMAIL_TOKEN;" in note[:120], note
    from payrun.status import cut

    assert cut("HTTP 401 provider outage (simulated)", 30) == "HTTP 401 provider outage…"
    assert cut("short", 30) == "short" and len(cut("x" * 50, 20)) == 20
    provider.end_outage()
    end_pause(conn)
    assert _send(conn, cfg, 10)  # the probe, once the token is fixed: delivered
    assert read_outage(conn) is None


def test_the_refusal_note_names_the_local_providers_token_file_when_that_was_refused():
    """The note said "fix the token or login (PAYRUN_EMAIL_TOKEN; ...)" when that variable
    was not set and the refused token was the local provider's file: it names the file's
    rule then (the path is in the last error, which jobs.mail words so)."""
    from jobs import events, mail
    from jobs.errors import AccountRefused
    from payrun.provider import Provider
    from payrun.status import outage_text

    class OtherHomesFile:  # (a TokenSource: the token file of another data directory)
        path = "/srv/payrun/redis/provider-token"

        def current(self):
            return "not-the-providers"

        refresh = current

    provider = Provider(latency_s=0, rate_per_s=100, token="the-providers").start()
    try:
        with pytest.raises(AccountRefused) as ei:
            mail.transport_for(provider.url, 5, token=OtherHomesFile()).send(
                mail.Message(to_addr="a@meghna.example", to_name="A", subject="s", text_body="t",
                             attachment_name="s.pdf", attachment_bytes=b"%PDF", idempotency_key="slip:2026-11:a",
                             sender="p@payrun.localhost"))
    finally:
        provider.stop()
    out = {"outage_since": 1_796_000_000.0, "since": 1_796_000_000.0, "state": "probing", "paused_for_s": 0,
           "failed_in_a_row": 12,  # (the last error as jobs.tasks records it)
           "last_error": f"{type(ei.value).__name__}: {events.one_line(ei.value, 200)}"}
    note = outage_text(out, "Asia/Dhaka")
    assert note.startswith("the email provider refuses our credentials since "), note
    assert ("fix the local provider's token file (`payrun provider` and its senders must share one PAYRUN_HOME), "
            in note) and "PAYRUN_EMAIL_TOKEN" not in note, note
    assert "/srv/payrun/redis/provider-token" in note
    out["last_error"] = ("AccountRefused: the provider refused our credentials, check PAYRUN_EMAIL_TOKEN (the "
                         "provider's token): provider api.mail.example:443: HTTP 401 bad token")
    assert "fix the token or login (PAYRUN_EMAIL_TOKEN; SMTP: PAYRUN_SMTP_PASSWORD)" in outage_text(out, "Asia/Dhaka")


# ---- what the on-call engineer sees ------------------------------------------------------


def test_status_limits_and_queues_say_the_provider_is_down(cfg, conn):
    from click.testing import CliRunner

    from payrun.cli import cli
    from payrun.ledger import Ledger

    ledger = Ledger(cfg.ledger_path)
    assert ledger.claim_run(1, "2026-11", "test")
    ledger.create_jobs([{"id": "email-2026-11-emp-1", "kind": "email", "month": "2026-11", "company_id": 1}])
    ledger.finish_run(1, "2026-11", 1)
    ledger.close()
    lim = limiter(conn, after=2, first_s=30, max_s=30)
    lim.provider_failed("TransientError: HTTP 503 provider outage")
    assert lim.provider_failed("TransientError: HTTP 503 provider outage").started
    runner = CliRunner()
    data = json.loads(runner.invoke(cli, ["status", "--json"]).output)
    out = data["provider_outage"]
    assert out["state"] == "paused" and out["failed_in_a_row"] == 2 and out["pauses"] == 1 and out["paused_for_s"] > 20
    assert data["notes"][0].startswith("the email provider is down since ")
    assert "2 sends in a row failed, last: TransientError: HTTP 503" in data["notes"][0]
    text = runner.invoke(cli, ["status"]).output
    assert "note: the email provider is down since" in text and "spend no attempt" in text
    shown = runner.invoke(cli, ["limits", "show"])
    assert shown.exit_code == 0 and "the email provider is down since" in shown.output
    assert "provider outages: 0 ended, 1 pauses" in shown.output
    assert json.loads(runner.invoke(cli, ["limits", "show", "--json"]).output)["email"]["outage"]["pauses"] == 1
    queues = runner.invoke(cli, ["queues"])
    assert queues.exit_code == 0 and "the email provider is down since" in queues.output, queues.output
    assert json.loads(runner.invoke(cli, ["queues", "--json"]).output)["limits"]["outage"]["state"] == "paused"
    # once a send succeeds, all of it is gone
    assert lim.provider_ok() is not None
    data = json.loads(runner.invoke(cli, ["status", "--json"]).output)
    assert data["provider_outage"] is None and not any("provider" in n for n in data["notes"])
    # a 429 storm: every sender waits out the Retry-After, and status says why nothing moves
    lim.pause(20)
    data = json.loads(runner.invoke(cli, ["status", "--json"]).output)
    assert data["notes"][0].startswith("the email provider answered 429 (over its rate limit)"), data["notes"]
    assert "no attempt is spent" in data["notes"][0]


def test_the_console_limits_line_shows_the_outage():
    from console.data import Limits, Snapshot
    from console.screens.overview import OverviewScreen as Overview

    base = dict(cap=50, rate_per_s=40.0, in_use=1, waits=0, http_429=0, paused_for_s=12.0)
    down = {"state": "paused", "failed_in_a_row": 37, "pauses": 2, "paused_for_s": 12.0, "for_s": 95.0,
            "since": 0.0, "outage_since": 0.0, "last_error": "TransientError: HTTP 503"}
    line = Overview._limits_text(Snapshot(taken_at=0, limits=Limits(**base, outage=down))).plain
    assert "PROVIDER DOWN 1m35s, 37 failed in a row, paused 12s" in line and "(429)" not in line
    probing = down | {"state": "probing", "paused_for_s": 0.0}
    line = Overview._limits_text(Snapshot(taken_at=0, limits=Limits(**base | {"paused_for_s": 0.0},
                                                                    outage=probing))).plain
    assert "PROVIDER DOWN 1m35s, 37 failed in a row, probing" in line
    failing = down | {"state": "failing", "pauses": 0, "failed_in_a_row": 4}
    line = Overview._limits_text(Snapshot(taken_at=0, limits=Limits(**base | {"paused_for_s": 0.0},
                                                                    outage=failing))).plain
    assert "provider failed the last 4 sends" in line and "DOWN" not in line
    # alerts come first: a narrow terminal cuts the end of the line (at 80 columns the
    # outage was cut off after "resends deduped")
    line = Overview._limits_text(Snapshot(taken_at=0, paused_queues=["send-email"],
                                          limits=Limits(**base | {"duplicates": 13}, outage=down))).plain
    assert line.startswith("⏸ drained: send-email · PROVIDER DOWN 1m35s"), line
    assert line.endswith("13 resends deduped"), line
    assert Overview._limits_text(Snapshot(taken_at=0, suspended=True)).plain == "⏸ ALL INTAKE STOPPED"


def test_a_job_failing_with_our_own_error_is_one_log_line_and_a_bug_keeps_its_traceback():
    import traceback

    from jobs.runtime import _QuietJobOK

    def rq_record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException as e:
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return logging.LogRecord("rq.worker", logging.ERROR, __file__, 1, _QuietJobOK.RQ_FAILED,
                                 ("email.vm.1.00", "email-2026-11-emp-1", "jobs.tasks.send_slip", text), None)

    quiet = _QuietJobOK()
    r = rq_record(ProviderDown("email provider down (10 sends in a row failed)", retry_after_s=5))
    assert quiet.filter(r) and r.levelname == "WARNING"
    assert r.getMessage() == ("Worker email.vm.1.00: job email-2026-11-emp-1: "
                              "ProviderDown: email provider down (10 sends in a row failed)")
    r = rq_record(PermanentError("HTTP 422 bad address"))
    assert quiet.filter(r) and r.levelname == "ERROR" and "\n" not in r.getMessage()
    r = rq_record(KeyError("a bug"))
    assert quiet.filter(r) and r.levelname == "ERROR" and "Traceback" in r.getMessage()
    # Redis gone under the job (a render's finish enqueuing its send): an outage, not a bug
    import redis as redis_mod

    r = rq_record(redis_mod.ConnectionError("Error 2 connecting to /x/redis.sock. No such file or directory."))
    assert quiet.filter(r) and r.levelname == "WARNING"
    assert r.getMessage() == ("Worker email.vm.1.00: job email-2026-11-emp-1: Redis unavailable: "
                              "ConnectionError: Error 2 connecting to /x/redis.sock. No such file or directory.")
    # a restarted Redis still loading its data (drill, session 41: it was a 40-line traceback)
    r = rq_record(redis_mod.BusyLoadingError("Redis is loading the dataset in memory"))
    assert quiet.filter(r) and r.levelname == "WARNING"
    assert r.getMessage() == ("Worker email.vm.1.00: job email-2026-11-emp-1: Redis unavailable: "
                              "BusyLoadingError: Redis is loading the dataset in memory")


class HeldJob:
    """What the runtime's _classify_exception touches of an RQ job (test_senders' too)."""

    def __init__(self, holds: int, attempt: int = 3, retries_left: int = 2):
        self.meta = {"attempt": attempt, "outage_holds": holds}
        self.retries_left = retries_left  # RQ has already taken this attempt off

    def save_meta(self):
        pass


def test_the_runtime_gives_a_held_job_its_attempt_back_a_bounded_number_of_times():
    from jobs.runtime import EventsMixin

    Job = HeldJob
    down = ProviderDown("email provider down (10 sends in a row failed)", retry_after_s=5.0)
    free = Job(holds=0)
    EventsMixin._classify_exception(None, free, ProviderDown, down, None)
    assert free.retries_left == 3 and free.meta["outage_holds"] == 1 and free.meta["retry_after"] == 5.0
    assert free._held_try and free.meta["held"] == 1  # the ledger shows this try as "held"
    spent = Job(holds=OUTAGE_HOLDS_PER_JOB)
    EventsMixin._classify_exception(None, spent, ProviderDown, down, None)
    assert spent.retries_left == 2 and spent.meta["outage_holds"] == OUTAGE_HOLDS_PER_JOB
    assert "this attempt counts" in spent.meta["last_error"]
    assert not getattr(spent, "_held_try", False) and "held" not in spent.meta


def test_a_provider_that_hangs_makes_an_outage_too(conn, cfg, monkeypatch, tmp_path):
    """Requests accepted and never answered: each send ends in the job's timeout (RQ's
    JobTimeoutException from the watchdog, which runs out before the transport's own
    deadline), and those count as the provider failing."""
    from rq.timeouts import JobTimeoutException

    from jobs.watchdog import WatchdogDeathPenalty

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    accepting = threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(4)], daemon=True)
    accepting.start()
    toml = tmp_path / "hang.toml"
    toml.write_text("[email]\ntimeout_s = 1\n[limits]\noutage_after = 2\noutage_pause_s = 30.0\n"
                    "outage_pause_max_s = 60.0\n")
    monkeypatch.setenv("PAYRUN_CONFIG", str(toml))
    monkeypatch.setenv("PAYRUN_EMAIL_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    tasks.settings.cache_clear()
    monkeypatch.setattr(tasks, "_limiters", {})
    monkeypatch.setattr(tasks, "_transports", {})
    outcomes = []
    try:
        for n in range(2):
            try:
                with WatchdogDeathPenalty(0.3, JobTimeoutException, job_id=f"email-{n}"):
                    _send(conn, tasks.settings(), n)
            except BaseException as e:  # noqa: BLE001 - the job's outcome, whatever it is
                outcomes.append(e)
    finally:
        server.close()
        for c, _ in held:
            c.close()
        tasks.settings.cache_clear()
    assert not isinstance(outcomes[0], ProviderDown) and isinstance(outcomes[1], ProviderDown), outcomes
    assert read_outage(conn)["state"] == "paused"


def test_a_lane_record_that_lost_its_fields_still_shows_as_its_process(conn):
    """What a lapsed worker key leaves once one write recreates it: only a heartbeat. The
    console groups it under its process by payrun's name, not as a "?:None control"."""
    from console.data import read_workers

    conn.sadd("rq:workers", "rq:worker:email.vm.4564.33")
    conn.hset("rq:worker:email.vm.4564.33", "last_heartbeat", "2026-12-02T01:33:00.000000Z")
    (w,) = read_workers(conn, time.time())
    assert (w.kind, w.host, w.pid) == ("email", "vm", 4564)


def test_the_eta_promises_no_time_while_the_provider_is_down():
    """Walkthrough: 2 minutes into a 3-minute outage the console still said "ETA 08:28 —
    on time for 09:00" while nothing went out."""
    from console.data import eta
    from console.fmt import eta_text

    now = 1_793_478_300.0  # 02:25 in Dhaka
    total = {"queued": 40_000, "running": 0, "retrying": 0, "done": 10_000, "failed": 0, "stuck": 0, "total": 50_000}
    down = eta(total, 37.0, now, "Asia/Dhaka", provider_down_s=146)
    assert down["at"] is None and down["on_time"] is None
    assert eta_text(down) == "no ETA: email provider down 2m26s (if back now: done 02:43, on time for 09:00)"
    assert eta_text(eta(total, 0.0, now, "Asia/Dhaka", provider_down_s=146)) == "no ETA: email provider down 2m26s"
    # the last slips: not "done 02:25" read at 02:25:41 (walkthrough, session 32)
    last = eta(total | {"queued": 300, "done": 49_700}, 37.0, now, "Asia/Dhaka", provider_down_s=20)
    assert eta_text(last) == "no ETA: email provider down 20s (if back now: done in under a minute, on time for 09:00)"
    done = eta(total | {"queued": 0, "done": 50_000}, 0.0, now, "Asia/Dhaka", provider_down_s=146)
    assert eta_text(done) == "all delivered"


# ---- Redis away: what the on-call reads in the logs -----------------------------------


class FakeClock:
    """A monotonic clock that moves only when the code under test pauses."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def pause(self, s: float) -> None:
        self.t += s


class Switch:
    """A client of the session Redis whose new connections go to a socket path that does
    not exist while Redis is ``away()``, and to Redis again once it is ``back()``."""

    def __init__(self, redis_url):
        import redis as redis_mod

        self.client = redis_mod.Redis.from_url(redis_url, socket_timeout=5)
        self._kwargs = self.client.connection_pool.connection_kwargs
        self._good = self._kwargs["path"]

    def away(self) -> None:
        self._set(self._good + ".gone")

    def back(self) -> None:
        self._set(self._good)

    def _set(self, path: str) -> None:
        self._kwargs["path"] = path
        self.client.connection_pool.reset()  # (its connections were made for the other path)


def away_then_back(redis_url):
    switch = Switch(redis_url)
    switch.away()
    return switch.client, switch.back


def test_the_ledger_says_redis_is_away_once_then_every_30_s_and_once_when_it_is_back(redis_url, conn, tmp_path,
                                                                                     caplog):
    """It logged "ledger: Redis unavailable (…); retrying in N s" at every try (every
    10 s once its backoff grew) for as long as Redis was away."""
    from payrun import ledger as ledger_mod

    client, back = away_then_back(redis_url)
    clock = FakeClock()
    store = ledger_mod.Ledger(tmp_path / "ledger.db")
    log = logging.getLogger("payrun.ledger")
    came_back = []

    def pause(s: float) -> None:
        clock.pause(s)
        if clock.t - 1000.0 >= 95 and not came_back:  # 95 s away, then Redis answers
            came_back.append(clock.t)
            back()

    def stop() -> bool:
        return any("answers again" in r.getMessage() for r in caplog.records) or clock.t > 2000

    caplog.set_level(logging.INFO, logger="payrun.ledger")
    try:
        ledger_mod.serve(client, store, stop, log=log, clock=clock, pause=pause)
    finally:
        store.close()
        client.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "payrun.ledger"]
    away = [m for m in lines if "Redis unavailable" in m]
    # tries at 0, 0.5, 1.5, 3.5, 7.5, 15.5, 25.5, 35.5 … 95.5 s: said at 0, 35.5, 65.5 s
    assert len(away) == 3, lines
    assert "still failing after" not in away[0] and "still failing after 36 s" in away[1], away
    assert "looks failed" in away[2]
    assert len(lines) == 4 and lines[-1].startswith("ledger: Redis answers again: back after 96 s (13 looks failed)"), lines


def test_metrics_say_redis_is_away_at_the_first_failed_scrape_then_every_30_s_and_once_back(redis_url, conn, cfg,
                                                                                              caplog):
    """A scrape every 15 s (Prometheus's default) logged "metrics: Redis unavailable" each
    time for as long as Redis was away."""
    from payrun.metrics import StateCollector

    client, back = away_then_back(redis_url)
    clock = FakeClock()
    collector = StateCollector(client, cfg, clock=clock)
    caplog.set_level(logging.INFO, logger="payrun.metrics")

    def scrape() -> float:
        (up,) = [m for m in collector.collect() if m.name == "payrun_redis_up"]
        clock.pause(15)
        return up.samples[0].value

    try:
        assert [scrape() for _ in range(7)] == [0] * 7  # 0 … 90 s
        back()
        assert scrape() == 1 and scrape() == 1
    finally:
        client.close()
    lines = [r.getMessage() for r in caplog.records if "Redis" in r.getMessage()]
    assert len(lines) == 5, lines  # at 0, 30, 60, 90 s, and back
    assert "still failing after 30 s: 3 looks failed, 2 since the last line" in lines[1]
    assert lines[-1] == "metrics: Redis answers again: back after 105 s (7 looks failed)"


def test_a_render_worker_waiting_for_work_says_redis_is_away_in_lines_of_its_own_not_rqs_errors(
        redis_url, conn, cfg, caplog, monkeypatch):
    """RQ's dequeue loop (a worker blocked waiting for a job when Redis goes) logged an
    ERROR "could not connect to Redis instance: … retrying in N seconds..." at every try,
    1, 2, 4 … 60 s apart, beside the worker's own lines. Its retry is left as it is."""
    import types

    import rq.worker.base as rq_worker_base
    from rq import Worker
    from rq.worker import WorkerStatus

    from jobs.runtime import RenderWorker, make_queue, worker_name

    switch = Switch(redis_url)
    queue = make_queue("control", switch.client)
    w = RenderWorker([queue], connection=switch.client, name=worker_name("control"))
    w.register_birth()
    w._state = WorkerStatus.IDLE  # (waiting for a job already: RQ's loop does not set it again)
    clock = FakeClock()
    w._outage.clock = clock
    slept = []

    def sleep(s: float) -> None:  # RQ's wait between two tries
        slept.append(s)
        clock.pause(s)
        if clock.t - 1000.0 >= 100:
            switch.back()
            job_id = "control-noop-1"
            make_queue("control", conn).enqueue("jobs.testing.noop", job_id=job_id)

    monkeypatch.setattr(rq_worker_base, "time", types.SimpleNamespace(**{**vars(time), "sleep": sleep}))
    caplog.set_level(logging.INFO)
    switch.away()
    try:
        job, _ = Worker.dequeue_job_and_maintain_ttl(w, 1)  # RQ's own loop
    finally:
        switch.client.close()
    assert job.id == "control-noop-1"
    # RQ's backoff, capped at 5 s (RenderWorker.max_connection_wait_time; RQ's 60 s kept a
    # worker idle for up to a minute after Redis was back)
    assert slept == [1, 2, 4] + [5] * 19
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    lines = [r.getMessage() for r in caplog.records if r.name == "payrun.worker"]
    # tries at 0, 1, 3, 7, 12, 17 … 97 s failed, the one at 102 s took the job: 2 s after Redis was back
    assert len(lines) == 5, lines
    at = switch._good
    assert lines[0].startswith(f"Worker {w.name}: Redis unreachable at {at}: ") and \
        lines[0].endswith("; will retry, nothing lost") and "still failing" not in lines[0]
    assert lines[1].endswith("(still failing after 32 s: 9 looks failed, 8 since the last line); will retry, "
                             "nothing lost")
    assert "still failing after 62 s" in lines[2] and "still failing after 92 s" in lines[3]
    assert lines[4] == f"Worker {w.name}: Redis answers again at {at}: back after 102 s (22 looks failed)"


def test_a_render_worker_that_loses_redis_mid_render_exits_in_one_line_and_its_restart_loses_nothing(tmp_path):
    """Real processes (tests/cluster.py restarts one that exits, as supervisord does) and
    payrun's embedded Redis, stopped while a render worker works through a queue, then
    started again. The worker exits 1 (RQ's work loop ends on a Redis error; it used to
    exit after three tracebacks: RQ's "found an unhandled exception", the handed-over
    render's failure, and its record's removal failing on the way out); the process
    started in its place waits for Redis; the render it held goes back to the queue by
    the reaper; every slip renders once and its send is queued once."""
    from cluster import Cluster, scrub_env

    from payrun import redis_server

    n = 40
    env = scrub_env()
    env.update(PAYRUN_REDIS_SUPERVISED="1", SUPERVISOR_ENABLED="1")
    cluster = Cluster(tmp_path / "h", env, "[render]\ntimeout_s = 5\n[email]\ntimeout_s = 5\n[lease]\ngrace_s = 5\n"
                      "visibility_s = 20\n")
    try:
        assert cluster.cfg.embedded_redis
        conn = redis_server.ensure_running(cluster.cfg)
        cluster.seed(n)
        cluster.start(render=1, email=False)
        first = cluster.wait_alive(conn, "render-0")
        assert cluster.run(conn) == n
        deadline = time.monotonic() + 60
        while not (conn.zcard("rq:finished:pdf-render") >= 5 and conn.zcard("rq:wip:pdf-render") > 0):
            assert time.monotonic() < deadline, cluster.log_tail("render-0")
            time.sleep(0.01)
        assert redis_server.stop(cluster.cfg)
        exited = cluster.wait_exit("render-0", first, timeout_s=30)
        time.sleep(2)  # the outage itself, with the worker started again meanwhile (not a wait for a condition)
        conn = redis_server.ensure_running(cluster.cfg)
        deadline = time.monotonic() + 120
        while cluster.ledger.db.execute("SELECT COUNT(*) FROM jobs WHERE kind = 'render' AND status = 'done'"
                                        ).fetchone()[0] < n:
            assert time.monotonic() < deadline, cluster.log_tail("render-0") + cluster.log_tail("reaper")
            time.sleep(0.2)
        assert conn.llen(f"rq:queue:{keys.EMAIL_QUEUE}") == n  # each send queued once
        assert len(set(conn.lrange(f"rq:queue:{keys.EMAIL_QUEUE}", 0, -1))) == n
        assert conn.zcard("rq:failed:pdf-render") == 0
        assert [e["pid"] for e in cluster.procs["render-0"].exits] == [first]  # the new one waited for Redis
        log = cluster.log_tail("render-0", 10**7)
        reaper_log = cluster.log_tail("reaper", 10**7)
    finally:
        cluster.shutdown()
        redis_server.stop(cluster.cfg)
    assert exited["code"] == 1, log
    assert "Traceback" not in log and "found an unhandled exception" not in log, log
    assert log.count("Redis went away") == 2 and log.count("exiting for a restart") == 1, log  # (and its scheduler)
    assert "returned" in reaper_log, reaper_log  # the render it held


# ---- Redis away: one story per worker, whichever of its parts meets it ------------------


def test_a_process_s_parts_meeting_one_outage_tell_one_story():
    """A render worker's liveness thread, its command channel's thread and its dequeue
    loop each logged Redis away in lines of their own (three at once, three every 30 s,
    two "back"). One story: the first failure of any part at once, then every 30 s with
    the tries of all parts, and back once."""
    from jobs.runtime import PartsFailure

    s = PartsFailure(every_s=30, quiet_s=6)
    assert s.ok(100.0, "liveness") is None  # nothing failed: nothing to say
    assert s.failed(100.0, "refused", "dequeue") == "refused"
    said = [s.failed(100.0 + t, "refused", part) for t in range(1, 30)
            for part in ("liveness", "command channel", "dequeue")]
    assert said == [None] * 87  # every part keeps trying; nothing more is said for 30 s
    line = s.failed(130.0, "refused", "liveness")
    assert line == "refused (still failing after 30 s: 89 looks failed, 88 since the last line)"
    # Redis back at 130.5: each part learns it on its own schedule
    assert s.ok(131.0, "liveness") is None  # the command channel failed 2 s ago: not yet
    assert s.ok(132.0, "dequeue") is None
    assert s.ok(132.5, "command channel") == "back after 31 s (89 looks failed)"  # (counted to the first success)
    assert s.ok(133.0, "liveness") is None and s.since is None
    assert s.failed(200.0, "again", "command channel") == "again"  # a new outage is said at once


def test_a_part_that_keeps_failing_keeps_the_outage_open_while_another_succeeds():
    """Redis refusing new connections (maxclients): the command channel, which reconnects,
    fails every 2 s while the liveness thread's connection still works. Not a "back" and
    a new outage every 2 s: one outage, said every 30 s, over once every part succeeds or
    the one failing has been quiet for ``quiet_s`` (a part that stopped trying)."""
    from jobs.runtime import PartsFailure

    s = PartsFailure(every_s=30, quiet_s=6)
    said = []
    for t in range(0, 62, 2):
        said.append(s.failed(float(t), "max number of clients reached", "command channel"))
        said.append(s.ok(t + 1.0, "liveness"))
    assert [x for x in said if x is not None] == [
        "max number of clients reached",
        "max number of clients reached (still failing after 30 s: 16 looks failed, 15 since the last line)",
        "max number of clients reached (still failing after 60 s: 31 looks failed, 15 since the last line)"]
    assert s.ok(65.0, "liveness") is None  # the last failure 5 s ago
    assert s.ok(66.0, "liveness") == "back after 61 s (31 looks failed)"
    # a part's own earlier failure never holds back its own success
    assert s.failed(100.0, "refused", "dequeue") == "refused"
    assert s.ok(100.5, "dequeue") == "back after 0 s (1 look failed)"


def test_a_try_begun_while_redis_was_away_and_told_after_back_opens_no_new_outage():
    """A full run on a loaded host (session 43): a send-email process said "back after
    31 s", then "Redis unreachable … No such file or directory" and "back after 0 s" at
    once: a thread's connect had failed before Redis came back and was told after another
    part's success ended the story. A failure told within ``quiet_s`` after "back" is not
    said; one after it is a new outage, said at once."""
    from jobs.runtime import PartsFailure

    s = PartsFailure(every_s=30, quiet_s=6)
    assert s.failed(100.0, "refused", "scheduler") == "refused"
    assert s.ok(131.0, "intake") == "back after 31 s (1 look failed)"
    assert s.failed(131.2, "No such file or directory", "liveness") is None  # late: not said
    assert s.since is None and s.late == 1
    assert s.ok(131.5, "liveness") is None  # nothing open: nothing to say
    assert s.failed(137.5, "refused", "liveness") == "refused"  # past the window: a new outage


def test_where_redis_is_said_without_its_password():
    from jobs.runtime import redis_address

    sock = "/srv/payrun/redis/redis.sock"
    assert redis_address({"path": sock, "password": "s3cret"}) == sock
    assert redis_address({"host": "10.0.0.5", "port": 6380, "username": "payrun", "password": "s3cret"}) \
        == "10.0.0.5:6380"


def test_parts_on_many_threads_failing_at_once_say_it_once(caplog):
    """The liveness and command channel threads meet the outage at the same moment as the
    dequeue loop: one line, and "back" once, however the threads interleave."""
    from jobs.runtime import RedisOutageLog

    clock = FakeClock()
    outage = RedisOutageLog("Worker w", "/r.sock", clock=clock)
    caplog.set_level(logging.INFO, logger="payrun.worker")
    go = threading.Barrier(8)

    def part(name: str) -> None:
        go.wait()
        for _ in range(500):
            outage.failed(name, "refused")

    threads = [threading.Thread(target=part, args=(f"part-{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert outage.story.count == 4000 and sum(outage.tries.values()) == 4000

    def back(name: str) -> None:
        go.wait()
        for _ in range(100):
            outage.ok(name)

    threads = [threading.Thread(target=back, args=(f"part-{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.name == "payrun.worker"]
    assert lines == ["Worker w: Redis unreachable at /r.sock: refused; will retry, nothing lost",
                     "Worker w: Redis answers again at /r.sock: back after 0 s (4000 looks failed)"], lines


@pytest.fixture
def own_redis(tmp_path):
    """payrun's embedded Redis for this test alone: stopped and started again by it."""
    from payrun import redis_server

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    conn = redis_server.ensure_running(cfg)
    yield cfg, conn
    redis_server.stop(cfg)


def _idle_through_an_outage(own_redis, monkeypatch, caplog, worker_class, liveness: bool) -> tuple[list, dict, str]:
    """A worker waiting for work on "control" (RQ's own dequeue loop, on a thread), its
    command channel subscribed and (``liveness``) its liveness thread beating, while the
    embedded Redis is stopped, then started again. Each part tries on its own schedule
    (shortened: 0.2 s); the story's clock is a FakeClock moved 31 s once every part has
    failed twice. Returns the log records of the outage, the failed tries per part, and
    the worker's name."""
    import types

    import rq.worker.base as rq_worker_base
    from rq import Worker
    from rq.worker import WorkerStatus

    from jobs import runtime
    from jobs.runtime import Liveness, make_queue, worker_name
    from payrun import redis_server

    from conftest import wait_for

    cfg, conn = own_redis
    monkeypatch.setattr(runtime, "ALIVE_EVERY_S", 0.2)
    monkeypatch.setattr(runtime, "PUBSUB_RETRY_S", 0.2)
    monkeypatch.setattr(rq_worker_base, "time", types.SimpleNamespace(
        **{**vars(time), "sleep": lambda s: time.sleep(min(s, 0.2))}))  # RQ's wait between two tries
    w = worker_class([make_queue("control", conn)], connection=conn, name=worker_name("control"))
    clock = FakeClock()
    w._outage.clock = clock
    w.register_birth()
    w._state = WorkerStatus.IDLE
    live = Liveness(conn, [w.name], outage=w._outage).start() if liveness else None
    w.subscribe()
    taken = []
    loop = threading.Thread(target=lambda: taken.append(Worker.dequeue_job_and_maintain_ttl(w, 1)), daemon=True)
    parts = ("dequeue", "command channel") + (("liveness",) if liveness else ())
    caplog.set_level(logging.INFO)
    try:
        loop.start()
        # (RQ writes the idle state before its loop's try: Redis stopped just then ends the thread)
        wait_for(lambda: any(c.get("cmd") == "blmove" for c in conn.client_list()), what="the loop waiting for work")
        assert redis_server.stop(cfg)
        wait_for(lambda: all(w._outage.tries.get(p, 0) >= 2 for p in parts), timeout_s=30, what="each part failing")
        clock.pause(31)
        before = dict(w._outage.tries)
        wait_for(lambda: all(w._outage.tries[p] > before[p] for p in parts), timeout_s=30,
                 what="each part failing again, 31 s on")
        conn = redis_server.ensure_running(cfg)
        make_queue("control", conn).enqueue("jobs.testing.noop", job_id="control-noop-1")
        wait_for(lambda: taken, timeout_s=30, what="the idle worker taking the job once Redis is back")
        wait_for(lambda: not w._outage.away, timeout_s=30, what="every part back")
    finally:
        if live is not None:
            live.stop()
        w.unsubscribe()
    assert taken[0][0].id == "control-noop-1"
    return [r for r in caplog.records if r.name.startswith(("payrun", "rq"))], dict(w._outage.tries), w.name


def _one_story(records, name: str, tries: dict) -> None:
    said = [(r.levelname, r.getMessage()) for r in records if r.levelno >= logging.WARNING]
    assert len(said) == 3, said
    assert all(level == "WARNING" for level, _ in said), said  # (RQ said each try as an ERROR)
    (_, first), (_, again), (_, back) = said
    assert first.startswith(f"Worker {name}: Redis unreachable at ") and first.endswith("; will retry, nothing lost")
    assert "still failing" not in first
    assert "(still failing after 31 s: " in again and again.endswith("; will retry, nothing lost")
    assert f"Worker {name}: Redis answers again at " in back and ": back after 31 s (" in back
    assert f"({sum(tries.values())} looks failed)" in back  # every part's tries, in one count


def test_an_idle_render_or_control_worker_tells_a_redis_outage_in_one_story(own_redis, monkeypatch, caplog):
    """Its liveness thread (`liveness: …` every 30 s, `beating again`), its command channel's
    thread (`its command channel cannot reach Redis`) and its dequeue loop (`cannot take
    work`, `takes work again`) each told the outage: 3 lines at once, 3 every 30 s, 2
    back. One line when Redis goes, one every 30 s, one when it is back; each part still
    tries on its own schedule (all three failed, and again)."""
    from jobs.runtime import RenderWorker

    records, tries, name = _idle_through_an_outage(own_redis, monkeypatch, caplog, RenderWorker, liveness=True)
    assert set(tries) == {"dequeue", "command channel", "liveness"}
    _one_story(records, name, tries)


def test_a_plain_rq_worker_under_rq_env_tells_a_redis_outage_in_one_story(own_redis, monkeypatch, caplog):
    """`rq worker` with `payrun config rq-env` (PayrunRqWorker) logged RQ's ERROR "could
    not connect to Redis instance: … retrying in N seconds..." at every try of its dequeue
    loop and every 2 s from its command channel's thread, for as long as Redis was away."""
    from jobs.runtime import PayrunRqWorker

    records, tries, name = _idle_through_an_outage(own_redis, monkeypatch, caplog, PayrunRqWorker, liveness=False)
    assert set(tries) == {"dequeue", "command channel"}
    _one_story(records, name, tries)
    assert {r.name for r in records if r.levelno >= logging.WARNING} == {"rq.worker"}  # (what `rq worker` shows)


def test_a_plain_rq_worker_under_rq_env_says_redis_is_back_within_seconds_not_a_minute(redis_url, conn, monkeypatch):
    """`rq worker` under `payrun config rq-env` (PayrunRqWorker) said "Redis answers again"
    up to a minute after Redis was back: RQ's dequeue loop waits 1, 2, 4 … up to 60 s
    between tries, and its command channel, back within 2 s, cannot end the story while the
    loop failed in the last OUTAGE_QUIET_S (then says nothing for a minute). Redis back 1 s
    after the loop's try at 63 s: the line came at 123 s. The loop waits 5 s at most now
    (_OneOutageStory.max_connection_wait_time, as a render worker's): the line comes at its
    first try after Redis is back. RQ's own loop runs, on a clock that moves only when it
    waits; the command channel's thread is played beside it (a try every 2 s)."""
    import types

    import redis as redis_mod
    import rq.worker.base as rq_worker_base
    from rq import Worker

    from jobs.runtime import PUBSUB_RETRY_S, PayrunRqWorker, make_queue, worker_name

    switch = Switch(redis_url)
    w = PayrunRqWorker([make_queue("control", switch.client)], connection=switch.client, name=worker_name("control"))
    w.register_birth()
    set_state = w.set_state

    def set_state_then_redis_goes(*args, **kwargs):  # (RQ's loop writes its idle state, then tries)
        set_state(*args, **kwargs)
        switch.away()

    w.set_state = set_state_then_redis_goes
    clock = FakeClock()
    w._outage.clock = clock
    back_at = clock.t + 64.0
    channel = {"next": clock.t, "back": False}
    said: list[tuple[float, str]] = []

    class Said(logging.Handler):  # (RQ's logger, whatever an earlier test did to its propagation)
        def emit(self, record: logging.LogRecord) -> None:
            said.append((clock.t, record.getMessage()))

    def sleep(s: float) -> None:  # RQ's wait between two tries; the command channel tries meanwhile
        end = clock.t + s
        while channel["next"] <= end and not channel["back"]:
            clock.t = channel["next"]
            if clock.t < back_at:
                w._outage.failed("command channel", redis_mod.ConnectionError("Connection refused."))
            else:
                w._outage.ok("command channel")  # (its reconnection's reply; its next read is a minute on)
                channel["back"] = True
            channel["next"] += PUBSUB_RETRY_S
        clock.t = end
        if clock.t >= back_at:
            switch.back()

    handler = Said(logging.WARNING)
    w._outage.log.addHandler(handler)
    # (and its level: a worker run earlier with work(logging_level="CRITICAL"), test_poison's,
    # left rq.worker at CRITICAL, and the WARNING looked for was dropped)
    level = w._outage.log.level
    w._outage.log.setLevel(logging.WARNING)
    monkeypatch.setattr(rq_worker_base, "time", types.SimpleNamespace(**{**vars(time), "sleep": sleep}))
    make_queue("control", conn).enqueue("jobs.testing.noop", job_id="control-noop-1")
    try:
        job, _ = Worker.dequeue_job_and_maintain_ttl(w, 1)  # RQ's own loop
    finally:
        w._outage.log.removeHandler(handler)
        w._outage.log.setLevel(level)
        switch.client.close()
    assert job.id == "control-noop-1"
    back = [(at, line) for at, line in said if "Redis answers again" in line]
    assert len(back) == 1, said
    assert back[0][0] - back_at <= 5.0, (back[0][0] - back_at, said)  # (it was 59 s)
    assert not w._outage.away


def test_a_plain_rq_worker_whose_work_loop_a_redis_error_ended_says_so_in_one_line(conn, caplog):
    """RQ's "found an unhandled exception, quitting..." and its traceback; anything else
    RQ says as an ERROR stays as it is."""
    import redis

    from jobs.runtime import PayrunRqWorker, make_queue

    w = PayrunRqWorker([make_queue("control", conn)], connection=conn)
    caplog.set_level(logging.INFO)
    try:
        raise redis.exceptions.ConnectionError("Error 111 connecting to 10.0.0.5:6379. Connection refused.")
    except redis.exceptions.ConnectionError:
        w.log.error("Worker %s: found an unhandled exception, quitting...", w.name, exc_info=True)  # (RQ's words)
    try:
        raise ValueError("a bug")
    except ValueError:
        w.log.error("Worker %s: found an unhandled exception, quitting...", w.name, exc_info=True)
    quit_, bug = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert quit_.getMessage() == (f"Worker {w.name}: Redis went away (Error 111 connecting to 10.0.0.5:6379. "
                                  "Connection refused.): its work loop ends") and not quit_.exc_info
    assert bug.getMessage().endswith("found an unhandled exception, quitting...") and bug.exc_info


def test_an_idle_send_email_process_tells_a_redis_outage_in_one_story(own_redis, monkeypatch, caplog):
    """A send-email process (run_lanes, 2 lanes, waiting for work) told the outage twice
    over: its liveness thread (`liveness: …`, `beating again`) and its intake (`cannot look
    for work`, `can look for work again`), and its RQ scheduler's restart added a WARNING
    (`RQ scheduler (pid) is gone; starting another`, then `cannot start the RQ scheduler
    yet` every check while Redis stayed away), and each idle lane's heartbeat ended its
    thread with a traceback (the process then exited, no lane left). One story now, as a
    render worker's: one WARNING when Redis goes, one every 30 s (the fake clock moved),
    one when it is back; each part still tries on its own schedule, and the lanes live."""
    from jobs import runtime, tasks
    from payrun import keys, redis_server

    from conftest import wait_for

    cfg, conn = own_redis
    # (this process's own data directory: one another test's send noted in ./var, recorded
    # here, was a fourth WARNING)
    monkeypatch.setenv("PAYRUN_HOME", str(cfg.home))
    tasks.settings.cache_clear()
    clock = FakeClock()
    stories: list = []

    class Told(runtime.RedisOutageLog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.clock = clock
            stories.append(self)

    lanes: list = []

    class Lane(runtime.LaneWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            lanes.append(self)

    monkeypatch.setattr(runtime, "RedisOutageLog", Told)
    monkeypatch.setattr(runtime, "LaneWorker", Lane)
    monkeypatch.setattr(runtime, "ALIVE_EVERY_S", 0.2)
    monkeypatch.setattr(runtime, "SCHEDULER_CHECK_S", 0.2)
    # idle lanes write their heartbeat (every 10 s) and wait for work (30 s at a time): their
    # write in an outage ended each lane's thread with a traceback, then the process
    monkeypatch.setattr(runtime, "IDLE_HEARTBEAT_S", 0.3)
    monkeypatch.setattr(runtime.LaneWorker, "heartbeat_every_s", 0.1)
    caplog.set_level(logging.INFO)
    ran: list = []
    process = threading.Thread(target=lambda: ran.append(runtime.run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2)),
                               daemon=True)
    process.start()
    try:
        wait_for(lambda: len(lanes) == 2 and lanes[0].scheduler is not None, what="the process starting")
        (story,) = stories
        scheduler = lanes[0].scheduler._process
        wait_for(scheduler.is_alive, what="its RQ scheduler running")
        parts = ("intake", "liveness", "lanes")
        assert redis_server.stop(cfg)
        wait_for(lambda: all(story.tries.get(p, 0) >= 2 for p in parts), timeout_s=30, what="each part failing")
        wait_for(lambda: not scheduler.is_alive(), timeout_s=30, what="its RQ scheduler exiting, Redis away")
        clock.pause(31)
        before = dict(story.tries)
        wait_for(lambda: all(story.tries[p] > before[p] for p in parts), timeout_s=30,
                 what="each part failing again, 31 s on")
        assert sorted(t.name for t in threading.enumerate() if t.name.startswith("lane-")) == ["lane-0", "lane-1"]
        conn = redis_server.ensure_running(cfg)
        wait_for(lambda: not story.away, timeout_s=30, what="every part back")
        wait_for(lambda: lanes[0].scheduler._process is not scheduler and lanes[0].scheduler._process.is_alive(),
                 timeout_s=30, what="another RQ scheduler started")
    finally:
        conn.set(keys.stop_process(socket.gethostname(), os.getpid(), host_id()), "test")
        process.join(30)
        tasks.settings.cache_clear()
    assert not process.is_alive() and ran == [0]
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    said = [s for s in said if "did not stop within" not in s[1]]  # (its stop, on a loaded host: not the outage)
    assert len(said) == 3, said
    assert all(level == "WARNING" for level, _ in said), said
    (_, first), (_, again), (_, back) = said
    who = f"send-email {os.getpid()}"
    assert first.startswith(f"{who}: Redis unreachable at ") and first.endswith("; will retry, nothing lost")
    assert "(still failing after 31 s: " in again
    assert back.startswith(f"{who}: Redis answers again at ") and ": back after 31 s (" in back
    assert f"({sum(story.tries.values())} looks failed)" in back
    assert set(story.tries) == {"intake", "liveness", "lanes", "scheduler"}, story.tries  # each tried, and again
    restarted = [r.getMessage() for r in caplog.records if "RQ scheduler (pid" in r.getMessage()]
    assert restarted == [f"Worker {lanes[0].name}: RQ scheduler (pid {scheduler.pid}) exited, Redis away; starting "
                         "another once Redis answers"], restarted  # (INFO, once: not at every 0.2 s check)


def test_a_scheduler_that_exited_for_redis_is_told_as_the_outage_and_one_that_died_otherwise_warns(caplog):
    from jobs.runtime import PayrunScheduler, say_scheduler_gone

    caplog.set_level(logging.INFO, logger="payrun.worker")
    say_scheduler_gone("w", 41, PayrunScheduler.REDIS_GONE_EXIT)
    say_scheduler_gone("w", 42, -9)
    say_scheduler_gone("w", 43, 1)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "Worker w: RQ scheduler (pid 41) exited, Redis away; starting another once Redis answers"),
        ("WARNING", "Worker w: RQ scheduler (pid 42) is gone (exit code -9); starting another"),
        ("WARNING", "Worker w: RQ scheduler (pid 43) is gone (exit code 1); starting another")]


def test_a_worker_whose_scheduler_was_killed_warns_once_and_starts_another(conn, caplog):
    """Redis up, the scheduler killed (not Redis): still a WARNING, said once."""
    import signal

    from jobs.runtime import LaneWorker, lane_connection, make_queue
    from payrun import keys

    from conftest import wait_for

    worker = LaneWorker([make_queue(keys.EMAIL_QUEUE, conn)], connection=lane_connection(conn), name="sched-kill")
    worker.scheduler_connection = conn
    worker._start_scheduler(burst=False)
    first = worker.scheduler._process
    caplog.set_level(logging.INFO, logger="payrun.worker")
    try:
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        worker.ensure_scheduler()
        assert worker.scheduler._process is not first
        wait_for(worker.scheduler._process.is_alive, what="another scheduler")
    finally:
        worker.stop_scheduler()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "payrun.worker"
            and "did not stop within" not in r.getMessage()]  # (the test's stop of it, on a loaded host)
    assert said == [("WARNING", f"Worker sched-kill: RQ scheduler (pid {first.pid}) is gone (exit code -9); "
                                "starting another")], said


def test_a_render_workers_scheduler_that_exits_as_redis_goes_is_restarted_within_the_workers_story(
        own_redis, monkeypatch, caplog):
    """An idle render worker's RQ scheduler exits when Redis goes; its worker said
    `RQ scheduler (pid) is gone; starting another` (WARNING) and `cannot start the RQ
    scheduler yet` (WARNING) at every check (5 s) while Redis stayed away: a second
    incident beside the worker's own story. Now one INFO line, the failed starts are
    tries of the story, and the scheduler is started again once Redis answers."""
    from jobs import runtime
    from jobs.runtime import RenderWorker, make_queue, worker_name
    from payrun import redis_server

    from conftest import wait_for

    cfg, conn = own_redis
    monkeypatch.setattr(runtime, "SCHEDULER_CHECK_S", 0.0)
    w = RenderWorker([make_queue("control", conn)], connection=conn, name=worker_name("control"))
    w._outage.clock = clock = FakeClock()
    w._start_scheduler(burst=False)
    first = w.scheduler._process
    caplog.set_level(logging.INFO)
    try:
        wait_for(first.is_alive, what="its RQ scheduler running")
        assert redis_server.stop(cfg)
        wait_for(lambda: not first.is_alive(), timeout_s=30, what="its RQ scheduler exiting, Redis away")
        for _ in range(3):  # checks while Redis stays away
            w.ensure_scheduler()
        assert w._outage.tries == {"scheduler": 3} and w._outage.away
        clock.pause(31)
        w.ensure_scheduler()
        conn = redis_server.ensure_running(cfg)
        wait_for(lambda: w.ensure_scheduler() or w.scheduler._process is not first, timeout_s=30,
                 what="another RQ scheduler started")
        wait_for(w.scheduler._process.is_alive, what="it running")
    finally:
        w.stop_scheduler()
    assert first.exitcode == runtime.PayrunScheduler.REDIS_GONE_EXIT
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "payrun.worker"
            and "did not stop within" not in r.getMessage()]  # (the test's stop of it, on a loaded host)
    assert [m for level, m in said if level == "INFO"] == [
        f"Worker {w.name}: RQ scheduler (pid {first.pid}) exited, Redis away; starting another once Redis answers"]
    warned = [m for level, m in said if level != "INFO"]
    assert len(warned) == 3, warned  # the worker's story: at once, 31 s on, back
    assert "Redis unreachable" in warned[0] and "still failing after 31 s" in warned[1]
    assert warned[2].startswith(f"Worker {w.name}: Redis answers again at ") and f"({sum(w._outage.tries.values())} looks failed)" in warned[2]


def test_a_lane_started_while_redis_is_away_waits_for_it_instead_of_dying(conn):
    """A send-email process whose lanes were still starting when Redis went away lost them:
    `register_birth` ran before the lane's outage handling and ended its thread with a
    ConnectionError traceback, leaving the process with fewer lanes (seen as a flaky test,
    session 42). The lane now retries its birth as a failed try of the process's story."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from jobs.runtime import Intake, LaneWorker, lane_loop, make_queue

    from conftest import wait_for

    q = make_queue(keys.EMAIL_QUEUE, conn)
    lane = LaneWorker([q], connection=conn, name="email.test-host.1.0")
    born = lane.register_birth
    tries: list = []

    def flaky_birth(*a, **kw):
        tries.append(1)
        if len(tries) <= 2:
            raise RedisConnectionError("Error 111 connecting to unix socket. Connection refused.")
        if len(tries) == 3:  # made, but its reply lost with the connection: made again, RQ refuses
            born(*a, **kw)
            raise RedisConnectionError("Connection closed by server.")
        return born(*a, **kw)

    lane.register_birth = flaky_birth
    stop = threading.Event()
    intake = Intake(conn, [q], stop)
    ran: list = []
    thread = threading.Thread(target=lambda: ran.append(lane_loop(lane, stop, intake)), daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(tries) >= 4 and conn.exists(lane.key), timeout_s=30, what="the lane born once Redis answers")
        assert thread.is_alive()
        assert conn.hget(lane.key, "state") == b"idle"
    finally:
        stop.set()
        intake.wake_all()
        thread.join(timeout=30)
    assert ran == [0], ran  # (it ended by the stop, not an exception)
