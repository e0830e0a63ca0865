"""The embedded Redis: unix socket, password, append-only file, a read-only user."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
import redis

from payrun import config, redis_server
from payrun.errors import SetupError


@pytest.fixture
def embedded(tmp_path):
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    conn = redis_server.ensure_running(cfg)
    yield cfg, conn
    redis_server.stop(cfg)


def test_locked_down(embedded):
    cfg, conn = embedded
    conf = (cfg.redis_dir / "redis.conf").read_text()
    assert "port 0" in conf and "unixsocket " in conf and "appendonly yes" in conf
    assert stat.S_IMODE(os.stat(cfg.redis_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cfg.redis_dir / "password").st_mode) == 0o600
    no_password = redis.Redis(unix_socket_path=str(cfg.redis_dir / "redis.sock"))
    with pytest.raises(redis.AuthenticationError):
        no_password.set("x", 1)
    assert conn.set("x", 1)
    # the AOF holds the jobs' data (salaries): owner-only, even when a CLI command under a
    # permissive umask started the server
    files = [p for p in cfg.redis_dir.rglob("*") if p.is_file()]
    assert any("appendonly" in str(p) for p in files)
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if p.stat().st_mode & 0o077} == {}


def test_the_redis_conf_is_owner_only_even_when_it_was_not(tmp_path):
    """Security review (session 31): open()'s mode applies only to a new file, so a redis.conf
    left at 0644 kept that mode with both passwords written into it."""
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    conf = redis_server.write_conf(cfg, daemonize=False)
    conf.chmod(0o644)
    assert redis_server.write_conf(cfg, daemonize=False) == conf
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600 and "requirepass" in conf.read_text()


def test_readonly_user_reads_but_cannot_write(embedded):
    cfg, conn = embedded
    conn.set("k", "v")
    conn.rpush("rq:queue:pdf-render", "job-1")
    ro = redis.Redis.from_url(redis_server.url(cfg, readonly=True))
    assert ro.get("k") == b"v" and ro.llen("rq:queue:pdf-render") == 1 and ro.time()
    for write in (lambda: ro.set("k", "w"), lambda: ro.lpop("rq:queue:pdf-render"),
                  lambda: ro.eval("return redis.call('DEL', KEYS[1])", 1, "k"), lambda: ro.flushall(),
                  lambda: ro.client_kill_filter(_type="normal"), lambda: ro.client_pause(1000),
                  lambda: ro.config_set("maxclients", "1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    assert conn.get("k") == b"v" and conn.ping()
    assert ro.client_setname("console") and ro.client_getname() == "console" and ro.ping()


def test_no_client_shows_its_password(embedded):
    """Security review (session 31): redis-py's repr of a client lists its password, and
    Textual's crash screen prints every frame's locals. A client payrun makes holds its
    login in a credential provider, and still logs in, as the read-only user too."""
    from rq.registry import StartedJobRegistry

    cfg, conn = embedded
    password = (cfg.redis_dir / "password").read_text().strip()
    assert len(password) >= 16
    readonly = redis_server.connect(cfg, redis_server.url(cfg, readonly=True))
    for client in (conn, redis_server.connect(cfg), readonly):
        shown = repr(client) + repr(client.connection_pool) + repr(client.connection_pool.get_connection())
        assert password not in shown and "***" in shown
        assert client.ping()
    assert conn.acl_whoami() == "default"
    with pytest.raises(redis.exceptions.NoPermissionError):
        readonly.set("k", "v")
    # RQ tells registries apart by their connections' keywords: two clients of one server are one
    assert StartedJobRegistry("q", connection=conn) == StartedJobRegistry("q", connection=redis_server.connect(cfg))


def test_restart_keeps_data(embedded):
    cfg, conn = embedded
    conn.rpush("rq:queue:pdf-render", "a", "b")
    assert redis_server.stop(cfg)
    conn2 = redis_server.ensure_running(cfg)
    assert conn2.lrange("rq:queue:pdf-render", 0, -1) == [b"a", b"b"]


def test_kill_9_keeps_every_acknowledged_write(embedded):
    """A send's record ("this slip is sent") must outlive a crash of redis-server itself:
    Redis writes the append-only file before it replies, so `appendfsync everysec` risks
    the last second only when the whole host goes down, not when the process is killed.
    Written and killed well inside one second, before any fsync could have run."""
    import signal

    cfg, conn = embedded
    pid = int(conn.info("server")["process_id"])
    with conn.pipeline(transaction=False) as p:
        for i in range(2000):
            p.set(f"payrun:idem:test-{i}", f"sent:{i}")
        p.execute()
    conn.rpush("rq:queue:send-email", "last")  # acknowledged: the very last write
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while redis_server._alive(pid):
        assert time.monotonic() < deadline, "redis-server did not die"
        time.sleep(0.01)
    conn2 = redis_server.ensure_running(cfg)
    assert int(conn2.info("server")["process_id"]) != pid
    assert conn2.lrange("rq:queue:send-email", 0, -1) == [b"last"]
    assert conn2.mget([f"payrun:idem:test-{i}" for i in range(2000)]) == [f"sent:{i}".encode() for i in range(2000)]


def test_job_records_and_result_streams_stay_compact(embedded):
    """A ~400-byte job payload keeps the compact hash encoding and a one-entry stream does
    not cost a 4 KiB node: RQ keeps both for every job for 24 h (~7 KiB a slip, not ~16)."""
    _, conn = embedded
    assert conn.config_get("hash-max-ziplist-value")["hash-max-ziplist-value"] == "1024"
    conn.hset("rq:job:x", mapping={"data": os.urandom(400), "status": "finished", "origin": "pdf-render"})
    assert conn.object("encoding", "rq:job:x") in (b"ziplist", b"listpack")
    conn.xadd("rq:results:x", {"type": 1, "return_value": "e30=" * 20})
    assert conn.memory_usage("rq:results:x") < 2048


def test_supervised_redis_without_supervisord_fails_at_once_and_says_why(tmp_path, monkeypatch):
    """`eval "$(payrun supervisor-env)"` leaves PAYRUN_REDIS_SUPERVISED in the shell: with no
    supervisord running, a command must not wait 60 s for a Redis nobody will start."""
    import time

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    monkeypatch.setenv("PAYRUN_REDIS_SUPERVISED", "1")
    monkeypatch.delenv("SUPERVISOR_ENABLED", raising=False)
    t0 = time.monotonic()
    with pytest.raises(redis_server.RedisUnavailable, match="supervisord is not running in .*unset PAYRUN_REDIS_SUPERVISED"):
        redis_server.ensure_running(cfg)
    assert time.monotonic() - t0 < 10
    assert not redis_server.ping(redis_server.connect(cfg, socket_timeout=1))  # and it started none


def test_stop_returns_only_once_the_server_process_is_gone(tmp_path):
    """Its last act is to unlink the socket file: a server started right after at the same
    path (supervisord's, from `payrun up`) must not lose its socket to the old one."""
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    conn = redis_server.ensure_running(cfg)
    pid = int(conn.info("server")["process_id"])
    assert redis_server.stop(cfg)
    assert not redis_server._alive(pid)
    assert not (cfg.redis_dir / "redis.sock").exists()


def test_a_command_never_starts_a_second_redis_beside_supervisords(tmp_path, monkeypatch):
    """With supervisord running this data directory, a command whose Redis does not answer
    (supervisord restarting it) waits for that one: a second server would take its socket."""
    import socket

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    redis_server.private_dir(cfg.home)
    (cfg.home / "supervisor.role").write_text("all")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # stands in for supervisord's socket
    listener.bind(str(cfg.home / "supervisor.sock"))
    listener.listen(1)
    monkeypatch.delenv("PAYRUN_REDIS_SUPERVISED", raising=False)

    def gave_up(conn, timeout_s=15.0):
        raise redis_server.RedisUnavailable(f"Redis did not answer within {timeout_s:.0f} s")

    monkeypatch.setattr(redis_server, "wait_until_up", gave_up)
    try:
        with pytest.raises(redis_server.RedisUnavailable, match="supervisord runs the embedded Redis here"):
            redis_server.ensure_running(cfg)
        assert not (cfg.redis_dir / "redis.sock").exists()  # none started
    finally:
        listener.close()
    assert not redis_server.supervisord_here(cfg)  # a socket file nobody answers on is stale


def test_a_command_fails_at_once_only_for_a_redis_supervisord_will_not_start(tmp_path, monkeypatch):
    """FATAL, or stopped by hand: say so at once (it waited a silent minute). EXITED (about to
    be restarted) and "Not started" (a supervisord just up): wait for it, as before."""
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    redis_server.private_dir(cfg.home)
    monkeypatch.delenv("PAYRUN_REDIS_SUPERVISED", raising=False)
    monkeypatch.delenv("SUPERVISOR_ENABLED", raising=False)
    monkeypatch.setattr(redis_server, "supervisord_here", lambda cfg: True)
    waited = []
    monkeypatch.setattr(redis_server, "wait_until_up", lambda conn, timeout_s=15.0: waited.append(timeout_s))
    for state, why in [("FATAL", "Exited too quickly (process log may have details)"), ("STOPPED", "Dec 03 08:40 AM")]:
        monkeypatch.setattr(redis_server, "_supervised_redis_state", lambda cfg: (state, why))
        with pytest.raises(redis_server.RedisUnavailable, match=f"the embedded Redis is {state} under supervisord"):
            redis_server.ensure_running(cfg)
    assert waited == []
    for state, why in [("EXITED", "Dec 03 08:40 AM"), ("STOPPED", "Not started"), ("STARTING", ""), (None, "")]:
        monkeypatch.setattr(redis_server, "_supervised_redis_state", lambda cfg: (state, why))
        redis_server.ensure_running(cfg)
    assert waited == [60, 60, 60, 60]


def test_secrets_and_the_ledger_are_made_owner_only_again(tmp_path, monkeypatch):
    """Security review: a ledger or a password file that existed with a wider mode (copied
    in, restored from a backup) was used as it was."""
    from payrun import config
    from payrun.ledger import Ledger

    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    secret = redis_server.local_secret(cfg, "bank-token")
    pw = cfg.redis_dir / "bank-token"
    pw.chmod(0o644)
    assert redis_server.local_secret(cfg, "bank-token") == secret
    assert stat.S_IMODE(pw.stat().st_mode) == 0o600
    Ledger(cfg.ledger_path).close()
    cfg.ledger_path.chmod(0o644)
    Ledger(cfg.ledger_path).close()
    assert stat.S_IMODE(cfg.ledger_path.stat().st_mode) == 0o600


def test_a_payroll_database_restored_readable_by_others_is_owner_only_again(tmp_path):
    """Security review (session 31): a payroll.db (every salary and bank account) copied in
    or restored at 0644, in a home made by hand at 0755, stayed so, and SQLite made its -wal
    and -shm 0644 too; only the ledger was made owner-only again."""
    import sqlite3

    from payrun import payroll

    home = tmp_path / "srv"
    home.mkdir()
    home.chmod(0o755)
    path = home / "payroll.db"
    payroll.PayrollDB(path).close()
    backup = sqlite3.connect(path)  # a restore: the file, and a -wal and -shm left beside it, all 0644
    backup.execute("PRAGMA journal_mode=WAL")
    backup.execute("CREATE TABLE IF NOT EXISTS restored (x)")
    for p in [path, *home.glob("payroll.db-*")]:
        p.chmod(0o644)
    db = payroll.PayrollDB(path)
    try:
        modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in home.iterdir()}
        assert set(modes) >= {"payroll.db", "payroll.db-wal", "payroll.db-shm"}
        assert set(modes.values()) == {"0o600"}, modes
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
    finally:
        db.close()
        backup.close()


def test_a_home_too_deep_for_a_socket_path_still_gets_a_unix_socket(tmp_path, request):
    """A socket path has ~107 bytes: a deeper $PAYRUN_HOME reaches its socket through a
    short symlink of ours in the temp directory, never a TCP port (a local user who took
    the port while Redis was down would be sent the password)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    cfg = config.load(env={"PAYRUN_HOME": str(deep / "h")})
    assert len(str(cfg.redis_dir / redis_server.SOCKET_NAME)) > redis_server.MAX_SOCKET_PATH
    links = Path(tempfile.mkdtemp(prefix="pl-"))  # a temp directory of a usual depth
    request.addfinalizer(lambda: shutil.rmtree(links))
    link = redis_server.short_socket_dir(cfg, tmp=str(links))
    assert link.parent == links
    assert os.readlink(link) == str(cfg.redis_dir.absolute())
    assert redis_server.short_socket_dir(cfg, tmp=str(links)) == link  # found again, same link
    link.unlink()
    conn = redis_server.ensure_running(cfg)
    try:
        url = redis_server.url(cfg)
        assert url.startswith("unix://") and len(url.split("?")[0]) - len("unix://") <= redis_server.MAX_SOCKET_PATH
        conf = (cfg.redis_dir / "redis.conf").read_text()
        assert "port 0\n" in conf and "bind " not in conf
        assert conn.set("x", 1) and redis.Redis.from_url(redis_server.url(cfg, readonly=True)).get("x") == b"1"
        assert (cfg.redis_dir / redis_server.SOCKET_NAME).is_socket()  # in the 0700 directory itself
    finally:
        redis_server.stop(cfg)
        redis_server.short_socket_dir(cfg).unlink()  # (the one in the real temp directory)
    # someone else's link, or one pointing elsewhere, or anything else there: refused
    link = redis_server.short_socket_dir(cfg, tmp=str(links))
    os.lchown(link, 12345, 12345)
    with pytest.raises(SetupError, match="is not payrun's link there"):
        redis_server.short_socket_dir(cfg, tmp=str(links))
    link.unlink()
    os.symlink(str(tmp_path), link)
    with pytest.raises(SetupError, match="is not payrun's link there"):
        redis_server.short_socket_dir(cfg, tmp=str(links))
    link.unlink()
    link.mkdir()
    with pytest.raises(SetupError, match="remove it, or use a shorter PAYRUN_HOME"):
        redis_server.short_socket_dir(cfg, tmp=str(links))
    # a $TMPDIR itself too deep: /tmp
    assert redis_server.short_socket_dir(cfg, tmp=str(deep)).parent == Path("/tmp")
    Path("/tmp", link.name).unlink()


def test_never_a_second_server_beside_one_that_does_not_answer(tmp_path, monkeypatch):
    """A server still running for this data directory but not answering at the URL payrun
    computes (an older payrun's TCP port, a hung server; here: another password) is never
    joined by a second one on the same append-only file: the command waits, then says
    which process to stop."""
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    conn = redis_server.ensure_running(cfg)
    pid = int(conn.info("server")["process_id"])
    pw_file = cfg.redis_dir / "password"
    old_pw = pw_file.read_text()
    pw_file.write_text("not-the-servers-password")
    monkeypatch.setattr(redis_server, "STILL_RUNNING_WAIT_S", 0.5)
    try:
        with pytest.raises(redis_server.RedisUnavailable, match=f"still running \\(pid {pid}.*`kill {pid}`"):
            redis_server.ensure_running(cfg)
        assert (cfg.redis_dir / "redis.pid").read_text().strip() == str(pid)  # no second server wrote it
    finally:
        pw_file.write_text(old_pw)
        redis_server.stop(cfg)
    assert not redis_server._alive(pid)
    (cfg.redis_dir / "redis.pid").write_text(f"{pid}\n")  # stale, as after a crash: started at once
    assert redis_server.ensure_running(cfg).ping()
    redis_server.stop(cfg)


def test_stopping_an_embedded_redis_that_cannot_save_says_so_and_leaves_it_up(tmp_path):
    """On-call drill (session 26): `payrun down` with the data disk full reported the
    embedded Redis stopped while it ran on, refusing to shut down without its save. Its
    disk made to fail (its `dir` moved to /proc, where no file can be made), stop() raises
    and says why at once; freed, it stops."""
    cfg = config.load(env={"PAYRUN_HOME": str(tmp_path / "h")})
    conn = redis_server.ensure_running(cfg)
    pid = int(conn.info("server")["process_id"])
    try:
        try:
            conn.config_set("dir", "/proc")
            started = time.monotonic()
            with pytest.raises(SetupError, match="did not stop: it refused .*is its disk full"):
                redis_server.stop(cfg, timeout_s=30)
            assert time.monotonic() - started < 10  # (it does not wait out the timeout for a refusal)
            assert redis_server._alive(pid) and conn.ping()
        finally:
            conn.config_set("dir", str(cfg.redis_dir))
        assert redis_server.stop(cfg)
        assert not redis_server._alive(pid)
    finally:
        if redis_server._alive(pid):  # (a failed assertion above: no server left behind)
            os.kill(pid, 9)


def test_a_secret_made_by_another_process_meanwhile_is_the_one(tmp_path, monkeypatch):
    """supervisord starts the provider and its senders together: each can find the token
    missing. The one that lost the race to create it would fail (FileExistsError) or read
    it empty; it takes the other's."""
    from pathlib import Path

    from payrun import config as config_mod, redis_server

    cfg = config_mod.load(None, env={"PAYRUN_HOME": str(tmp_path)})
    theirs = redis_server.local_secret(cfg, "provider-token")
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self: False if self.name == "provider-token" else real_exists(self))
    assert redis_server.local_secret(cfg, "provider-token") == theirs
    assert sorted(p.name for p in (tmp_path / "redis").iterdir()) == ["provider-token"]  # no leftovers
