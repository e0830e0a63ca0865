"""A worker host's workers when the control host's Redis is away (its `payrun down`/`up`
in a deploy, ~15 s): an ops drill saw the worker host's send-email, which exits for a
restart when Redis fails under a job, fail its next starts at once ("cannot reach Redis")
and be given up on by supervisord (FATAL): that host sent nothing more until someone ran
`payrun up` there. A worker on an external Redis now waits for it at its start."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from payrun import config as config_mod
from payrun import redis_server


class Stopped(BaseException):
    """Raised from the patched pause: the worker was waiting, not exiting."""


@pytest.fixture
def gone(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    monkeypatch.setenv("PAYRUN_REDIS_URL", f"unix://{tmp_path}/no-redis.sock?password=pw")
    monkeypatch.setenv("PAYRUN_EMAIL_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("PAYRUN_CONFIG", raising=False)
    return config_mod.load()


def test_wait_until_reachable_says_so_once_a_minute_then_goes_on(gone, monkeypatch, caplog):
    now, pauses = [0.0], []
    answers = iter([False] * 40 + [True])
    monkeypatch.setattr(redis_server, "ping", lambda conn: next(answers))

    def pause(s):
        pauses.append(s)
        now[0] += s

    with caplog.at_level(logging.WARNING, logger="payrun.test"):
        waited = redis_server.wait_until_reachable(gone, "worker send-email", logging.getLogger("payrun.test"),
                                                   clock=lambda: now[0], pause=pause)
    assert waited == pytest.approx(80.0) and len(pauses) == 40
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3  # at once, a minute later, and when it goes on
    assert said[0].startswith("worker send-email waits: cannot reach Redis at unix://")
    assert "password=pw" not in " ".join(said)
    assert "Redis answers again after 80 s; starting" in said[-1]


@pytest.mark.parametrize("queue", ["send-email", "pdf-render"])
def test_a_worker_on_an_unreachable_external_redis_waits_instead_of_exiting(gone, monkeypatch, queue):
    from payrun.cli import cli

    def pause(s):
        raise Stopped()

    monkeypatch.setattr(redis_server, "_reach_pause", pause)
    with pytest.raises(Stopped):  # it paused to wait (before: exit 1, "cannot reach Redis", no pause)
        CliRunner().invoke(cli, ["worker", queue])


def test_a_burst_worker_still_fails_at_once(gone):
    from payrun.cli import cli

    result = CliRunner().invoke(cli, ["worker", "--burst", "pdf-render"])
    assert result.exit_code == 1 and "cannot reach Redis" in result.output


def test_a_look_on_a_worker_host_points_at_the_control_host(gone):
    """`payrun workers` on a worker host, its control host down, said "is `payrun up`
    running?": it was, on this host; the Redis that did not answer is the control host's."""
    from payrun.cli import cli

    (gone.home / "supervisor.role").write_text("worker")  # (what `payrun up --role worker` leaves)
    result = CliRunner().invoke(cli, ["workers"])
    assert result.exit_code == 1 and "is the control host up" in result.output, result.output
    assert "is `payrun up` running?" not in result.output and "password=pw" not in result.output


def test_supervisor_env_on_a_worker_host_is_the_worker_hosts(cfg, conn, tmp_path, monkeypatch):
    """The deploy steps run plain `payrun supervisor-env` on every host: on a worker host
    (started with `payrun up --role worker`, its control host's ledger applying the events)
    it took the host for a control host and refused, telling to start it with `--role
    worker`, which it had been (multi-host drill, s41). It takes the data directory's role."""
    from payrun import keys, supervise
    from payrun.cli import cli

    monkeypatch.setenv("PAYRUN_EMAIL_URL", "http://127.0.0.1:9")
    conn.set(keys.LEDGER_OWNER, f"control-host 4242 {tmp_path / 'control' / 'ledger.db'}")
    (cfg.home / "supervisor.role").write_text("worker")  # (what `payrun up --role worker` leaves)
    result = CliRunner().invoke(cli, ["supervisor-env"])
    assert result.exit_code == 0, result.output
    assert f"export PAYRUN_SUPERVISOR_CONF={supervise.CONFS['worker']}" in result.output
    # asked for a control host's environment there, it still refuses, as before
    control = CliRunner().invoke(cli, ["supervisor-env", "--role", "all"])
    assert control.exit_code != 0 and "another ledger applies this Redis's events" in control.output


class _NotStarted(Exception):
    """Raised where `up` would start supervisord."""


@pytest.fixture
def provider_401():
    """An HTTP provider that refuses every request's token (401), as the control host's
    provider refused a worker host started without PAYRUN_EMAIL_TOKEN."""
    from stub_http import answering_posts

    seen: list = []
    with answering_posts(401, b'{"error": "missing or wrong bearer token"}', seen) as url:
        yield url, seen


def test_up_as_a_worker_host_refuses_when_the_provider_refuses_its_credentials(cfg, conn, provider_401,
                                                                                monkeypatch):
    """A worker host started without the provider's token (the README's several-hosts steps
    did not name it) started anyway: its senders' 202 sends were answered 401, each
    spending an attempt of its slip, with no outage pause (the control host's sends went
    through between them). `payrun up --role worker` asks the provider first, as `payrun
    check` does (nothing sent), and refuses before anything starts."""
    from payrun import supervise
    from payrun.errors import SetupError

    url, seen = provider_401
    monkeypatch.setenv("PAYRUN_EMAIL_URL", url)
    monkeypatch.delenv("PAYRUN_EMAIL_TOKEN", raising=False)

    def not_started(name):
        raise _NotStarted(name)

    monkeypatch.setattr(supervise, "_bin", not_started)
    worker = config_mod.load()
    with pytest.raises(SetupError) as refused:
        supervise.up(worker, role="worker", wait=False)
    said = str(refused.value)
    assert seen and "refuses this host's credentials" in said and "PAYRUN_EMAIL_TOKEN is not set" in said
    assert not (worker.home / "supervisor.role").exists()  # nothing started, no role taken

    # a provider that does not answer is not this refusal: up goes on (its senders wait it out)
    monkeypatch.setenv("PAYRUN_EMAIL_URL", "http://127.0.0.1:9")
    with pytest.raises(_NotStarted):
        supervise.up(config_mod.load(), role="worker", wait=False)
