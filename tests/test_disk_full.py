"""A Redis that refuses writes (MISCONF: it cannot write to its disk), as on-call meets it
when the data directory fills up: a real redis-server made to fail its snapshot (its `dir`
moved to /proc, where no file can be made), then fixed (its `dir` back, a snapshot that
succeeds). Until this session every worker, the ledger and the reaper crashed on it, and
supervisord gave up on them; `payrun status` printed a traceback."""

from __future__ import annotations

import logging
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from conftest import wait_for
from payrun import config as config_mod
from payrun import redis_server


class RefusingRedis:
    """A redis-server of its own (unix socket, password), with RDB snapshots on so that a
    failed snapshot makes it refuse writes, as a failed AOF write does."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="pr-misconf-", dir="/tmp"))  # (short: a socket path)
        self.sock = self.dir / "r.sock"
        self.password = secrets.token_hex(8)
        conf = self.dir / "redis.conf"
        conf.write_text(f"port 0\nunixsocket {self.sock}\nunixsocketperm 700\nrequirepass {self.password}\n"
                        f"dir {self.dir}\nsave 3600 1\nstop-writes-on-bgsave-error yes\nappendonly no\n")
        self.proc = subprocess.Popen([redis_server.redis_server_binary(), str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"unix://{self.sock}?password={self.password}"
        self.conn = redis.Redis.from_url(self.url, socket_timeout=10)
        wait_for(lambda: self.sock.exists() and self._answers(), timeout_s=15, what="the test redis-server")

    def _answers(self) -> bool:
        try:
            return bool(self.conn.ping())
        except redis.ConnectionError:
            return False

    def _snapshot(self) -> str:
        self.conn.bgsave()
        wait_for(lambda: self.conn.info("persistence")["rdb_bgsave_in_progress"] == 0, timeout_s=15,
                 what="the snapshot to end")
        return self.conn.info("persistence")["rdb_last_bgsave_status"]

    def fill_the_disk(self) -> None:
        self.conn.config_set("dir", "/proc")
        assert self._snapshot() == "err"

    def free_space(self) -> None:
        self.conn.config_set("dir", str(self.dir))
        assert self._snapshot() == "ok"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def refusing():
    r = RefusingRedis()
    try:
        yield r
    finally:
        r.close()


def test_a_redis_refusing_writes_is_up_and_says_why(refusing):
    conn = refusing.conn
    assert redis_server.refusal(conn) is None
    refusing.fill_the_disk()
    with pytest.raises(redis.ResponseError, match="^MISCONF"):
        conn.set("x", 1)
    assert redis_server.ping(conn)  # up: no second server may start beside it
    assert redis_server.refusal(conn).startswith("MISCONF")
    refusing.free_space()
    assert redis_server.refusal(conn) is None and conn.set("x", 1)


def test_a_program_starting_meanwhile_waits_for_writes_instead_of_failing_its_start(refusing, cfg, caplog):
    """A worker restarted by supervisord waits (and says why once a minute) rather than fail
    three starts in a row and be given up on; it goes on once Redis takes writes."""
    refusing.fill_the_disk()
    now, pauses = [0.0], []

    def pause(s):
        pauses.append(s)
        now[0] += s
        if len(pauses) == 40:  # 80 s later: space freed
            refusing.free_space()

    with caplog.at_level(logging.WARNING, logger="payrun.test"):
        waited = redis_server.wait_for_writes(refusing.conn, "worker pdf-render", logging.getLogger("payrun.test"),
                                              cfg, clock=lambda: now[0], pause=pause)
    assert waited == pytest.approx(80.0) and len(pauses) == 40
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3  # at once, a minute later, and when it goes on
    assert said[0].startswith("worker pdf-render waits: Redis refuses writes (MISCONF") and "is its disk full" in said[0]
    assert "takes writes again after 80 s; starting" in said[-1]


def test_status_notes_it_and_a_command_says_it_in_one_line(refusing, cfg, monkeypatch):
    from payrun import status
    from payrun.cli import cli
    from payrun.ledger import Ledger

    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": "render-2026-11-emp-1", "kind": "render", "company_id": 1, "employee_id": "emp-1",
                         "month": "2026-11", "key": "slip:2026-11:emp-1", "queue": "pdf-render"}])
    ledger.claim_run(1, "2026-11", "test")
    ledger.finish_run(1, "2026-11", 1)
    refusing.fill_the_disk()
    report = status.report(cfg, ledger, "2026-11", conn=refusing.conn)
    assert report["notes"][0].startswith("Redis refuses writes (MISCONF")
    assert "then `payrun up` starts again what supervisord gave up on" in report["notes"][0]
    monkeypatch.setenv("PAYRUN_REDIS_URL", refusing.url)
    out = CliRunner().invoke(cli, ["limits", "set", "--cap", "10"])
    assert out.exit_code == 1 and "Traceback" not in out.output, out.output
    assert out.output.startswith("payrun: Redis refuses writes (MISCONF") and "is its disk full?" in out.output
    assert "\n" not in out.output.strip()
    out = CliRunner().invoke(cli, ["status"])  # a read-only look still answers, with the note
    assert out.exit_code == 0 and "Redis refuses writes" in out.output, out.output


def test_a_made_send_waits_for_a_redis_refusing_writes_to_record_it(refusing, cfg):
    """The provider accepted the message, then Redis refused to record it: the record
    waits, as for a Redis that went away, and the slip reads sent once it can write (its
    next try sent it a second time: 28 of 600 in the drill)."""
    from jobs import idempotency, tasks
    from jobs.limits import email_limiter

    conn = refusing.conn
    lim = email_limiter(conn, config_mod.load())
    key, token = "slip:2026-11:emp-00031", "email-2026-11-emp-00031:1"
    assert idempotency.claim(conn, key, token, 60) == idempotency.OK
    refusing.fill_the_disk()
    now, waits = [100.0], []

    def pause(s):
        waits.append(s)
        now[0] += s
        if len(waits) == 3:
            refusing.free_space()

    tasks._record_sent(conn, key, token, "<m31@payrun>", lim, record_by=130.0, clock=lambda: now[0], pause=pause)
    assert len(waits) == 3 and idempotency.state(conn, key)["state"] == "sent"


def test_a_replica_or_a_full_memory_refuses_writes_too_and_it_is_transient(refusing):
    """READONLY (a Redis turned replica) and OOM (maxmemory reached): redis-py raises its
    own classes for them, without the code in the message; a job meeting them is retried
    (they were failed for good), as for MISCONF."""
    from jobs.policy import classify, redis_refusal_reason, redis_refuses_writes

    conn = refusing.conn
    conn.config_set("maxmemory-policy", "noeviction")
    conn.config_set("maxmemory", 1)
    with pytest.raises(redis.ResponseError) as oom:
        with conn.pipeline() as p:  # (as RQ writes: in a transaction)
            p.set("x", "y" * 1000)
            p.execute()
    conn.config_set("maxmemory", 0)
    assert redis_refuses_writes(oom.value) and classify(oom.value).transient
    assert redis_refusal_reason(oom.value).startswith("OOM")
    with socket.socket() as s:  # a master that is not there: this server turns read-only
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn.replicaof("127.0.0.1", port)
    try:
        with pytest.raises(redis.ResponseError) as ro:
            conn.set("x", 1)
        assert redis_refuses_writes(ro.value) and classify(ro.value).transient
        assert redis_refusal_reason(ro.value).startswith("READONLY")
    finally:
        conn.replicaof("NO", "ONE")


def test_a_made_send_whose_redis_hangs_is_noted_in_seconds_not_cut_off_by_its_timeout(refusing, cfg, monkeypatch):
    """Multi-host drill: Redis stopped (SIGSTOP) for 35 s, then killed: the records of the
    sends it caught waited on the lane's 30 s socket timeout until the job's own 30 s
    timeout cut them off, before any note was written, and 25 of 1,200 slips were sent
    again by the other host. The record now waits RECORD_SOCKET_TIMEOUT_S for a reply,
    notes the delivery, and the send-email process records the note once Redis answers."""
    import os
    import signal
    import time

    from jobs import idempotency, tasks, unrecorded
    from jobs.limits import email_limiter

    conn = redis.Redis.from_url(refusing.url, socket_timeout=30)  # a lane's client: as long as a send
    lim = email_limiter(conn, cfg)
    key, token = "slip:2026-11:emp-00031", "email-2026-11-emp-00031:1"
    assert idempotency.claim(conn, key, token, 60) == idempotency.OK
    monkeypatch.setattr(tasks, "RECORD_SOCKET_TIMEOUT_S", 0.5)
    os.kill(refusing.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            tasks._record_sent(conn, key, token, "<m31@payrun>", lim, record_by=time.monotonic() + 2.0)
        assert time.monotonic() - started < 10  # (it waited 30 s for the first reply)
        assert unrecorded.find(cfg.home, key) == "<m31@payrun>"
    finally:
        os.kill(refusing.proc.pid, signal.SIGCONT)
    assert tasks.record_noted(conn, cfg.home) == 1
    assert idempotency.state(conn, key)["state"] == "sent" and unrecorded.pending(cfg.home) == []
