"""A provider outage: when the provider fails ``limits.outage_after`` sends in a row,
every sender on every host pauses, then one send at a time probes it, and the sends held
back spend no attempt. Policy in pure functions; the rest against the session Redis and
the local provider."""

from __future__ import annotations

import json
import logging
import smtplib
import socket
import time

import pytest

from conftest import wait_for
from jobs import idempotency, limits, tasks
from jobs.errors import OutcomeUnknown, PermanentError, ProviderDown, RateWait, Throttled, TransientError
from jobs.limits import Limiter, read_outage
from jobs.policy import classify, counts_as_provider_failure, outage_pause_s, pauses_every_sender
from payrun import config, keys
from payrun.provider import Provider

# ---- policy (pure) ------------------------------------------------------------------


def test_the_outage_pause_doubles_with_each_failed_probe_up_to_its_ceiling():
    assert [outage_pause_s(t, 5, 30) for t in range(1, 7)] == [5, 10, 20, 30, 30, 30]
    assert outage_pause_s(1, 0.2, 0.5) == 0.2 and outage_pause_s(3, 0.2, 0.5) == 0.5
    assert outage_pause_s(10_000, 5, 30) == 30  # no overflow on a very long outage
    with pytest.raises(ValueError):
        outage_pause_s(0, 5, 30)


@pytest.mark.parametrize("exc, counts", [
    (TransientError("HTTP 503 provider outage"), True),
    (OutcomeUnknown("connection dropped after the request was sent"), True),
    (ConnectionRefusedError(111, "refused"), True),
    (socket.timeout("timed out"), True),
    (smtplib.SMTPServerDisconnected("gone"), True),
    (Throttled("HTTP 429", retry_after_s=1.0), False),  # the 429 pause covers it
    (RateWait(), False),  # our own limiter
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


@pytest.mark.parametrize("toml, problem", [
    ("[limits]\noutage_after = 1\n", "outage_after must be 0 (off) or >= 2"),
    ("[limits]\noutage_after = -3\n", "outage_after must be 0 (off) or >= 2"),
    ("[limits]\noutage_pause_s = 0\n", "0 < outage_pause_s <= outage_pause_max_s"),
    ("[limits]\noutage_pause_s = 60.0\noutage_pause_max_s = 30.0\n", "0 < outage_pause_s <= outage_pause_max_s"),
])
def test_outage_settings_are_validated_at_start(tmp_path, toml, problem):
    p = tmp_path / "payrun.toml"
    p.write_text(toml)
    with pytest.raises(config.ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        config.load(p, env={"PAYRUN_HOME": str(tmp_path)})


def test_the_defaults_and_off():
    d = config.LimitsConfig()
    assert (d.outage_after, d.outage_pause_s, d.outage_pause_max_s) == (10, 5.0, 30.0)


# ---- the limiter, in Redis -------------------------------------------------------------


def limiter(conn, after=3, first_s=0.3, max_s=0.6, cap=5) -> Limiter:
    lim = Limiter(conn, "email", cap, 1000.0, lease_s=30, outage_after=after, outage_pause_s=first_s,
                  outage_pause_max_s=max_s)
    lim.seed()
    return lim


def test_sends_failing_in_a_row_pause_every_sender_then_one_probe_at_a_time(conn):
    lim, other_host = limiter(conn), limiter(conn)
    assert lim.provider_failed("HTTP 503") is None
    assert other_host.provider_failed("HTTP 503") is None  # the streak is shared by every host
    assert read_outage(conn)["state"] == "failing"
    down = lim.provider_failed("TransientError: HTTP 503 provider outage")
    assert down is not None and down.started and (down.streak, down.trips) == (3, 1)
    assert 0.25 <= down.wait_s <= 0.3
    out = read_outage(conn)
    assert out["state"] == "paused" and out["pauses"] == 1 and out["failed_in_a_row"] == 3
    assert out["last_error"] == "TransientError: HTTP 503 provider outage" and out["outage_since"]
    # nobody takes a slot while paused, on any host
    ok, wait_ms = other_host.try_slot("lane-a")
    assert not ok and 0 < wait_ms <= 300
    # a send in flight when the pause began fails too: it is held back, the pause unchanged
    late = other_host.provider_failed("HTTP 503")
    assert late is not None and not late.started and late.trips == 1 and late.wait_s <= down.wait_s
    # after the pause: one send probes the provider, the others wait
    wait_for(lambda: lim.try_slot("probe")[0], timeout_s=5, interval_s=0.02, what="the pause to end")
    assert read_outage(conn)["state"] == "probing"
    assert other_host.try_slot("lane-b") == (False, 200)
    # the probe fails: a pause twice as long
    lim.release("probe")
    again = lim.provider_failed("HTTP 503")
    assert again.started and again.trips == 2 and 0.5 <= again.wait_s <= 0.6
    wait_for(lambda: other_host.try_slot("probe-2")[0], timeout_s=5, interval_s=0.02, what="the second pause")
    # the next probe succeeds: the outage is over, the cap is back for every host
    ended = other_host.provider_ok()
    assert ended is not None and ended[0] == 2 and ended[1] >= 0.5
    assert read_outage(conn) is None
    assert lim.try_slot("lane-c")[0] and lim.try_slot("lane-d")[0]  # 3 of 5 held
    stats = lim.stats()
    assert stats["outage_pauses"] == 2 and stats["outages"] == 1


def test_a_success_between_failures_means_no_outage(conn):
    lim = limiter(conn, after=3)
    for _ in range(5):
        assert lim.provider_failed("HTTP 503") is None
        assert lim.provider_failed("HTTP 503") is None
        assert lim.provider_ok() is None  # a streak ended, no outage to report
    assert read_outage(conn) is None and not conn.exists(keys.limit_pause("email"))


def test_a_success_ends_a_streak_another_process_counted_once_it_has_seen_it(conn):
    """A process learns of another's failures when it takes a slot (the same script), so
    its successes pay a round trip only then; before that they cost nothing."""
    failing, healthy = limiter(conn, after=3), limiter(conn, after=3)
    failing.provider_failed("HTTP 503")
    failing.provider_failed("HTTP 503")
    limits._outage_hint.clear()  # what the healthy process knows: nothing yet
    assert healthy.provider_ok() is None and read_outage(conn)["failed_in_a_row"] == 2  # not seen yet
    assert healthy.try_slot("lane")[0]
    assert healthy.provider_ok() is None  # a streak, not an outage, ended
    assert read_outage(conn) is None
    assert failing.provider_failed("HTTP 503") is None  # counting starts again


def test_off_counts_nothing(conn):
    lim = limiter(conn, after=0)
    for _ in range(20):
        assert lim.provider_failed("HTTP 503") is None
    assert read_outage(conn) is None and lim.try_slot("x")[0]


def test_a_sender_waiting_for_its_start_gives_up_at_once_when_an_outage_pause_begins(conn):
    """Its job goes back without an attempt spent and its slot is freed: after the pause
    only the probe may send (a 429 pause is waited out instead)."""
    lim = limiter(conn, after=2, first_s=20, max_s=20)
    lim.provider_failed("HTTP 503")
    assert lim.provider_failed("HTTP 503").started
    t0 = time.monotonic()
    assert lim.token(deadline_s=time.monotonic() + 60) is False
    assert time.monotonic() - t0 < 2


# ---- the send path, against the local provider ----------------------------------------


@pytest.fixture
def outage_cfg(cfg, monkeypatch, tmp_path):
    provider = Provider(latency_s=0.0, rate_per_s=1000).start()
    toml = tmp_path / "outage.toml"
    toml.write_text("[limits]\noutage_after = 3\noutage_pause_s = 0.5\noutage_pause_max_s = 1.0\n")
    monkeypatch.setenv("PAYRUN_CONFIG", str(toml))
    monkeypatch.setenv("PAYRUN_EMAIL_URL", provider.url)
    tasks.settings.cache_clear()
    monkeypatch.setattr(tasks, "_limiter", None)
    monkeypatch.setattr(tasks, "_transports", {})
    try:
        yield tasks.settings(), provider
    finally:
        provider.stop()
        tasks.settings.cache_clear()


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
    provider.outage(60, 503)
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
    assert isinstance(errors[3], ProviderDown)
    assert provider.stats()["outage_5xx"] == 3
    assert any("email provider down: 3 sends in a row failed" in r.getMessage() for r in caplog.records)
    assert read_outage(conn)["state"] == "paused"
    provider.end_outage()
    wait_for(lambda: read_outage(conn)["state"] == "probing", timeout_s=5, interval_s=0.02, what="the pause to end")
    assert _send(conn, cfg, 10)  # the probe: delivered
    assert read_outage(conn) is None
    assert any("email provider answering again" in r.getMessage() for r in caplog.records)
    assert provider.stats()["delivered"] == 1


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
    limits._outage_hint["email"] = time.monotonic() + 60
    assert lim.provider_ok() is not None
    data = json.loads(runner.invoke(cli, ["status", "--json"]).output)
    assert data["provider_outage"] is None and not any("provider" in n for n in data["notes"])


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
