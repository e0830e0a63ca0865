"""`payrun up/down/ps`: supervisord with the repository's supervisor.conf."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from payrun import redis_server
from payrun.config import Config
from payrun.errors import SetupError

ROOT = Path(__file__).resolve().parent.parent
CONFS = {"all": ROOT / "supervisor.conf", "worker": ROOT / "supervisor-worker.conf"}
CONF = CONFS["all"]
ROLES = tuple(CONFS)


def _role(cfg: Config) -> str:
    f = cfg.home / "supervisor.role"
    return f.read_text().strip() if f.exists() else "all"


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise SetupError(f"{name} not found: run scripts/setup (it installs supervisor into the venv)")
    return found


ENV_KEYS = ("PAYRUN_HOME", "PAYRUN_CONFIG", "PAYRUN_BIN", "PAYRUN_RENDER_WORKERS", "PAYRUN_REDIS_AUTOSTART",
            "PAYRUN_PROVIDER_AUTOSTART", "PAYRUN_REDIS_SUPERVISED")
"""What supervisor.conf reads from the environment (`payrun supervisor-env` prints them)."""


def env(cfg: Config) -> dict[str, str]:
    redis_server.private_dir(cfg.home)
    redis_server.private_dir(cfg.log_dir)
    e = dict(os.environ)
    e.update(
        PAYRUN_HOME=str(cfg.home),
        # `payrun --config FILE up`: every program reads the same file (it was ignored)
        PAYRUN_CONFIG=str(Path(cfg.source).absolute()) if cfg.source != "defaults" else "",
        PAYRUN_BIN=_bin("payrun"),
        PAYRUN_REDIS_SUPERVISED="1" if cfg.embedded_redis else "",
        PAYRUN_RENDER_WORKERS=str(cfg.render_workers),
        PAYRUN_REDIS_AUTOSTART="true" if cfg.embedded_redis else "false",
        PAYRUN_PROVIDER_AUTOSTART="false" if cfg.email.url else "true",
    )
    return e


STATUS_TIMEOUT_S = 30.0
"""How long a `supervisorctl status` may take: a supervisord that accepts and never answers
(hung) must not hang `payrun ps`, `up` or a command checking its Redis. Stops have no
limit: `stop` waits for each program in turn (workers finish their jobs: up to their
stopwaitsecs each), and `down` must not go on to stop Redis before they are done."""

HUNG = 124
"""ctl's exit code when supervisorctl did not answer within its timeout."""


def absent(out: str) -> bool:
    """supervisorctl's output says no supervisord runs here (no socket, or nobody on it)."""
    return "no such file" in out or "refused" in out.lower()


def ctl(cfg: Config, *args: str, timeout_s: float | None = None) -> tuple[str, int]:
    """supervisorctl's output and exit code; with ``timeout_s``, a supervisord that does not
    answer in time gives exit code HUNG instead of hanging the caller."""
    try:
        p = subprocess.run([_bin("supervisorctl"), "-c", str(CONFS.get(_role(cfg), CONF)), *args], env=env(cfg),
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"supervisorctl {' '.join(args)}: supervisord did not answer within {timeout_s:.0f} s", HUNG
    return p.stdout + p.stderr, p.returncode


def status_here(cfg: Config, timeout_s: float = 5) -> str | None:
    """`supervisorctl status` of the payrun supervisord answering on this data directory's
    socket, whichever role it runs (`payrun up`, or `payrun up --role worker`), or None
    when none does: no socket, a socket left by a killed one, or no answer in
    ``timeout_s``. (redis_server.supervisord_here answers for role all only: whether the
    embedded Redis is this supervisord's.)"""
    if not (cfg.home / "supervisor.sock").exists():
        return None
    out, code = ctl(cfg, "status", timeout_s=timeout_s)
    return None if code == HUNG or absent(out) else out


def ps_code(status: str) -> int:
    """`payrun ps`'s exit code for a `supervisorctl status` output: 0 when every program is
    RUNNING or was never meant to start here (``STOPPED   Not started``: autostart=false, as
    the local provider is with PAYRUN_EMAIL_URL set and the embedded Redis with
    PAYRUN_REDIS_URL), else 3. supervisorctl's own code is 3 for those too, so a monitor
    reading `payrun ps` alarmed forever on a host sending through a real provider."""
    lines = [ln for ln in status.splitlines() if ln.strip()]
    if not lines:
        return 3
    for ln in lines:
        f = ln.split()
        if len(f) > 1 and f[1] == "RUNNING":
            continue
        if len(f) > 3 and f[1] == "STOPPED" and f[2:4] == ["Not", "started"]:
            continue
        return 3
    return 0


UP_SETTLE_S = 5.0
"""`payrun up` returns once every program has been up this long (supervisord's uptime, from
its start) without a restart, and the embedded Redis has answered this long (the programs
wait for it before anything else that can fail).
supervisord counts a start good once the program has lived its ``startsecs``: a program
that fails a little later (the provider finding its port taken, on a loaded host after
its imports) was RUNNING for a moment, and `up` said everything was up while it
crash-looped."""


def _uptime_s(line: str) -> float | None:
    """The uptime of one `supervisorctl status` line that says RUNNING
    (``... RUNNING   pid 12, uptime 0:00:07``; ``uptime 2 days, 1:02:03``), in seconds."""
    if " RUNNING " not in line or "uptime " not in line:
        return None
    text = line.rsplit("uptime ", 1)[1].strip()
    days = 0
    if "day" in text:
        head, _, text = text.partition(",")
        days = int(head.split()[0])
    try:
        h, m, sec = (int(x) for x in text.strip().split(":"))
    except ValueError:
        return None
    return days * 86400 + h * 3600 + m * 60 + sec


def settled(status: str, min_uptime_s: float = UP_SETTLE_S) -> bool:
    """Every program in a `supervisorctl status` output is STOPPED (not started on this
    host) or has been RUNNING at least ``min_uptime_s``."""
    lines = [ln for ln in status.splitlines() if ln.strip()]
    if not lines:
        return False
    for ln in lines:
        if " STOPPED " in ln:
            continue
        up_s = _uptime_s(ln)
        if up_s is None or up_s < min_uptime_s:
            return False
    return True


WORKER_PROGRAMS = ("pdf-render", "send-email", "control")
"""supervisord programs that are RQ workers: RUNNING is not yet taking jobs (see
``not_registered``)."""


def worker_pids(status: str) -> dict[str, int]:
    """program -> pid of each worker program a `supervisorctl status` output says RUNNING
    (``pdf-render:pdf-render-00   RUNNING   pid 26783, uptime 0:00:10``)."""
    out: dict[str, int] = {}
    for ln in status.splitlines():
        f = ln.split()
        if len(f) >= 4 and f[1] == "RUNNING" and f[2] == "pid" and f[0].split(":")[0] in WORKER_PROGRAMS \
                and f[3].rstrip(",").isdigit():
            out[f[0]] = int(f[3].rstrip(","))
    return out


def not_registered(pids: dict[str, int], workers, hostname: str, host_id: str | None) -> list[str]:
    """The worker programs (``worker_pids``) with no live worker of their pid on this host in
    Redis (console.data.read_workers rows) yet: a worker imports, warms WeasyPrint and waits
    for Redis before it registers, which on a loaded host took ~12 s after its spawn, past
    `payrun up`'s 5 s of RUNNING (a fresh-clone walkthrough, session 43: `payrun check` right
    after `up` FAILed "no pdf-render worker is running", and `payrun run` said "is `payrun up`
    running?", though every worker was starting)."""
    live = {w.pid for w in workers if w.alive and not w.stopping and w.host == hostname
            and w.host_id in (None, host_id)}
    return [name for name, pid in sorted(pids.items()) if pid not in live]


def _not_registered_yet(cfg: Config, status: str) -> list[str]:
    """``not_registered`` of this host's worker programs; none when Redis cannot be read (the
    programs' logs say why: no reason to hold `payrun up`)."""
    pids = worker_pids(status)
    if not pids:
        return []
    import socket

    from console.data import read_workers
    from payrun.procs import host_id

    try:
        conn = redis_server.connect(cfg, socket_timeout=2, socket_connect_timeout=2)
        try:
            rows = read_workers(conn, time.time())
        finally:
            conn.close()
    except Exception:  # noqa: BLE001 - Redis away or refusing: not this look's to judge
        return []
    return not_registered(pids, rows, socket.gethostname(), host_id())


def up(cfg: Config, wait: bool = True, timeout_s: float = 60, role: str = "all",
       clock: Callable[[], float] | None = None, pause: Callable[[float], None] | None = None) -> str:
    """Start supervisord for a role: ``all`` (control host: everything) or ``worker``
    (render and send workers only, against PAYRUN_REDIS_URL). ``clock``/``pause``: monotonic
    seconds and sleep, for tests."""
    clock, pause = clock or time.monotonic, pause or time.sleep
    conf = CONFS[role]
    if not conf.exists():
        raise SetupError(f"{conf} is missing")
    check_role(cfg, role)
    if role == "worker" and (why := credentials_refused(cfg)):
        raise SetupError(why)
    out, code = ctl(cfg, "status", timeout_s=STATUS_TIMEOUT_S)
    if code == HUNG:
        raise SetupError(f"a supervisord holds {cfg.home / 'supervisor.sock'} but does not answer ({out}): "
                         f"stop it (its pid is in {cfg.home / 'supervisord.pid'}), then `payrun up` again")
    if not absent(out) and code in (0, 3):
        return _start_failed_again(cfg, out, wait, timeout_s)
    note = take_over_redis(cfg) if role == "all" else ""
    if role == "all" and not cfg.email.url:
        from payrun.provider import local_token

        local_token(cfg)  # the local provider's token, made before it and its senders start (not shown)
    (cfg.home / "supervisor.role").write_text(role)
    p = subprocess.run([_bin("supervisord"), "-c", str(conf)], env=env(cfg), capture_output=True, text=True)
    if p.returncode != 0:
        raise SetupError(f"supervisord failed to start: {(p.stderr or p.stdout).strip()}")
    if not wait:
        return note + "supervisord started"
    # supervisord calls a program RUNNING once it has lived `startsecs`, not once it serves:
    # on a loaded host the embedded Redis (a Python wrapper that execs redis-server) can be
    # RUNNING before its socket exists, and a script's next command would fail to connect;
    # and a program can fail just after it (UP_SETTLE_S): everything must have stayed up
    # (and the programs waited for Redis before they did anything that can fail: on a
    # loaded host it answered ~5 s after the start, and a ledger that could not open its
    # database failed just after `up` had said all was well: they get UP_SETTLE_S with it too)
    own_redis = role == "all" and cfg.embedded_redis
    conn = redis_server.connect(cfg, socket_timeout=2) if own_redis else None
    redis_since: float | None = None
    unregistered: list[str] = []
    try:
        deadline = clock() + timeout_s
        while clock() < deadline:
            out, code = ctl(cfg, "status", timeout_s=STATUS_TIMEOUT_S)
            lines = [ln for ln in out.splitlines() if ln.strip()]
            if conn is not None and redis_since is None and redis_server.ping(conn):
                redis_since = clock()
            redis_settled = conn is None or (redis_since is not None and clock() - redis_since >= UP_SETTLE_S)
            unregistered = []
            if settled(out) and redis_settled and (conn is None or redis_server.ping(conn)):
                # RUNNING is not taking jobs: wait for the workers to register (see not_registered)
                if not (unregistered := _not_registered_yet(cfg, out)):
                    return note + out.rstrip()
            failed = [ln.split()[0] for ln in lines if " FATAL " in ln or " BACKOFF " in ln or " EXITED " in ln]
            if failed:
                # nothing half-up: a control host missing one program is not a working control host
                logs = "".join(_log_tail(cfg, name) for name in failed)
                down(cfg)
                raise SetupError(f"{', '.join(failed)} failed to start, so everything was stopped again:\n"
                                 f"{out.rstrip()}\n{logs}logs: {cfg.log_dir}")
            pause(0.5)
        if unregistered:  # every program up, only slow to take jobs: not a failed start
            return note + out.rstrip() + (
                f"\nnote: {', '.join(unregistered)} not taking jobs yet ({timeout_s:.0f} s after the start: not "
                f"registered in Redis): `payrun workers` shows them once they are; their logs: {cfg.log_dir}")
        waiting = "" if conn is None or redis_server.ping(conn) else \
            f"the embedded Redis does not answer on {cfg.redis_dir} (see {cfg.log_dir / 'redis.log'})\n"
        unsettled = [ln.split()[0] for ln in out.splitlines() if ln.strip() and not settled(ln)]
        logs = "".join(_log_tail(cfg, name) for name in unsettled[:3])
        down(cfg)  # nothing half-up (a program restarting over and over never reaches FATAL)
        raise SetupError(f"not everything stayed up for {UP_SETTLE_S:g} s within {timeout_s:.0f} s, so everything "
                         f"was stopped again:\n{waiting}{out.rstrip()}\n{logs}logs: {cfg.log_dir}")
    finally:
        if conn is not None:
            conn.close()


GAVE_UP = ("FATAL", "EXITED")
"""supervisorctl states of a program that stopped by failing (not STOPPED: stopped on
purpose, or not started on this host). BACKOFF is supervisord still trying (it ignores a
`start` then): waited for, not started."""


def gave_up(status: str, states: tuple[str, ...] = GAVE_UP) -> list[str]:
    return [ln.split()[0] for ln in status.splitlines()
            if len(ln.split()) > 1 and ln.split()[1] in states]


def _start_failed_again(cfg: Config, status: str, wait: bool, timeout_s: float) -> str:
    """`payrun up` with supervisord running already: the programs it gave up on (FATAL after
    a full disk or a bad config file, EXITED) are started again, and `up` waits until they
    stay up, as a first `up` does. It said "already running", exited 0 and started nothing,
    while the status note it answered read "is `payrun up` running?" (an on-call drill)."""
    dead = gave_up(status)
    retrying = gave_up(status, ("BACKOFF",))
    if not dead and not retrying:
        # stopped by hand (a date, not "Not started"): left stopped, but said (a drill read the
        # list, saw no failure, and the schedulers it had stopped stayed stopped over a tick)
        by_hand = [ln.split()[0] for ln in status.splitlines()
                   if len(ln.split()) > 1 and ln.split()[1] == "STOPPED" and "Not started" not in ln]
        note = (f"\nnote: {', '.join(by_hand)} stopped by hand, left stopped: `eval \"$(payrun supervisor-env)\"` "
                f"then `supervisorctl -c \"$PAYRUN_SUPERVISOR_CONF\" start {' '.join(by_hand)}`") if by_hand else ""
        return "supervisord is already running:\n" + status.rstrip() + note
    if dead:
        ctl(cfg, "start", *dead, timeout_s=60)
    out = status
    deadline = time.monotonic() + timeout_s
    while wait:
        out, _ = ctl(cfg, "status", timeout_s=STATUS_TIMEOUT_S)
        mine = [ln for ln in out.splitlines() if ln.split() and ln.split()[0] in (*dead, *retrying)]
        if mine and all(settled(ln) for ln in mine):
            break
        failed = gave_up("\n".join(mine))
        if failed or time.monotonic() > deadline:
            failed = failed or [ln.split()[0] for ln in mine if not settled(ln)]
            logs = "".join(_log_tail(cfg, name) for name in failed[:3])
            raise SetupError(f"supervisord is running, but {', '.join(failed)} stopped by failing and did not stay "
                             f"up when started again (the rest runs on):\n{out.rstrip()}\n{logs}logs: {cfg.log_dir}")
        time.sleep(0.5)
    if not dead:
        return f"supervisord is already running; {', '.join(retrying)} came up after its restarts:\n" + out.rstrip()
    return (f"supervisord was running with {len(dead)} program{'' if len(dead) == 1 else 's'} stopped by failing "
            f"({', '.join(dead)}): started {'them' if len(dead) > 1 else 'it'} again:\n" + out.rstrip())


def _is_supervisord(pid: int) -> bool:
    """Whether process ``pid`` runs supervisord (its program, or python running it)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2]
    except OSError:
        return False
    return any(os.path.basename(a) == b"supervisord" for a in args)


def stop_with_supervisord(command: str | None, env=os.environ) -> bool:
    """In a program supervisord runs (not Redis): be sent SIGTERM when supervisord dies.

    supervisord killed (the OOM killer, kill -9) left every program running on as an orphan
    (an ops drill): still taking and sending jobs, its log lines lost (their pipe went with
    supervisord), unseen by `payrun ps`, in the way of the next `payrun up` (its ports, its
    Redis connections), and stopped from under by `payrun down`, which then stopped Redis
    beneath sends in flight. With this each program stops as on `supervisorctl stop`: the
    jobs in hand finish, within the grace. Redis is left running: the sends finishing need
    it, and `payrun up` takes it over once they are done. Linux only (prctl
    PR_SET_PDEATHSIG). True if set."""
    if not env.get("SUPERVISOR_ENABLED") or not env.get("SUPERVISOR_PROCESS_NAME") or command in (None, "redis"):
        return False
    parent = os.getppid()
    if not _is_supervisord(parent):  # (a grandchild: the env is inherited)
        return False
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # supervisord died before the line above
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def processes(cfg: Config, proc: Path = Path("/proc")) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, program) of the live processes supervisord started for this data
    directory, their own forks included (a horse, RQ's scheduler process): found by the
    environment supervisord gave them, which forks inherit. Zombies are left out. Linux
    /proc; processes of other users are not readable and not listed."""
    home = str(Path(cfg.home).absolute())
    ours: dict[int, tuple[int, str]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "environ").read_bytes()
            env = dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
            if env.get(b"PAYRUN_HOME", b"").decode(errors="replace") != home or b"SUPERVISOR_PROCESS_NAME" not in env:
                continue
            name = (d / "cmdline").read_bytes().decode(errors="replace")
            state, parent = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if ("payrun" in name or "redis" in name) and state != "Z":
            ours[int(d.name)] = (int(parent), env[b"SUPERVISOR_PROCESS_NAME"].decode(errors="replace"))
    return ours


def orphans(cfg: Config, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """(pid, program) of the programs supervisord started for this data directory that
    outlived it (they are not its children any more)."""
    ours = processes(cfg, proc)
    # a program itself (not a fork of one) whose parent is not supervisord; not Redis (left
    # running on purpose: `down` stops it after the others)
    return sorted((pid, name) for pid, (parent, name) in ours.items()
                  if parent not in ours and name != "redis" and not _is_supervisord(parent))


def orphans_line(found: list[tuple[int, str]]) -> str:
    """What `ps`, `up` and `down` say of them."""
    if not found:
        return ""
    named = ", ".join(f"{name} (pid {pid})" for pid, name in found[:12])
    more = f" and {len(found) - 12} more" if len(found) > 12 else ""
    return (f"{len(found)} of its programs still run without it (supervisord died?): {named}{more}; they "
            f"stop by themselves once their jobs in hand are done (a payrun of this version), or stop them with "
            f"kill -TERM {' '.join(str(p) for p, _ in found)}")


def busy_elsewhere(workers, own_pids: set[int], hostname: str, host_id: str | None = None) -> list:
    """Of ``workers`` (console.data.WorkerRow), those alive with a job in hand that this
    data directory's supervisord does not run: another host's (or a `payrun worker` started
    by hand). A control host's `payrun down` stops Redis and the provider beneath their
    sends in flight: each is retried, and over SMTP delivered twice (an ops drill: 9 of
    1,600 slips). Another host is another hostname, or the same one with another
    ``host_id`` (payrun.procs.host_id: two containers started alike run the same pids). Pure."""
    def ours(w) -> bool:
        return (w.host == hostname and w.pid in own_pids
                and (host_id is None or getattr(w, "host_id", None) in (None, host_id)))

    return [w for w in workers if w.alive and w.job_id and not ours(w)]


def beneath(cfg: Config) -> list[str]:
    """What a control host's `payrun down` stops that other hosts' sends go through: its
    embedded Redis, its local provider (pure). An external Redis and a real provider go on
    without it: then nothing is cut beneath another host's send. A multi-host drill (s41,
    external Redis, the local provider) was told "Stopping this host stops Redis" of a
    Redis it does not run."""
    return (["Redis"] if cfg.embedded_redis else []) + ([] if cfg.email.url else ["the local provider"])


def busy_elsewhere_line(busy, stopped: list[str] | None = None) -> str:
    """What `payrun down` says of them; ``stopped``: :func:`beneath`."""
    named = ", ".join(f"{w.name} ({w.where}, {w.job_id})" for w in busy[:6])
    more = f" and {len(busy) - 6} more" if len(busy) > 6 else ""
    stops = " and ".join(stopped or ["Redis", "the local provider"])
    return (f"{len(busy)} worker{'' if len(busy) == 1 else 's'} not run by this host's supervisord "
            f"{'holds a job' if len(busy) == 1 else 'hold jobs'} now: {named}{more}. Stopping this host stops {stops} "
            "beneath their sends in flight (each is then retried, and over SMTP delivered "
            "twice). Stop them first (`payrun down` on their host), or `payrun drain` and wait until `payrun "
            "running` is empty; `payrun down --force` stops this host anyway")


def take_over_redis(cfg: Config) -> str:
    """Before supervisord starts its own embedded Redis: any payrun command (`payrun failed`,
    `payrun run`, ...) starts that server in the background when it is not up, and
    supervisord's program cannot start while it runs. Shut it down cleanly (its data is on
    disk and the supervised server loads it) unless something is still using it."""
    if not cfg.embedded_redis:
        return ""
    conn = redis_server.connect(cfg, socket_timeout=2)
    if not redis_server.ping(conn):
        return ""
    me = conn.client_id()
    others = [c for c in conn.client_list() if int(c["id"]) != me]
    if others:
        found = orphans(cfg)
        raise SetupError(
            f"the embedded Redis in {cfg.redis_dir} is running outside supervisord and {len(others)} "
            f"other connection(s) are using it ("
            + (f"a supervisord that died: {orphans_line(found)}" if found else
               "a `payrun demo`, a console, workers started by hand?")
            + "): stop them, then run `payrun up` again")
    redis_server.stop(cfg)
    if redis_server.ping(redis_server.connect(cfg, socket_timeout=2)):
        raise SetupError(f"the embedded Redis in {cfg.redis_dir}, started outside supervisord, did not stop "
                         f"(see {cfg.redis_dir / 'redis.log'}); supervisord cannot run its own beside it")
    return ("stopped the embedded Redis another payrun command had started (its data is kept: "
            "supervisord runs it now)\n")


def _log_tail(cfg: Config, program: str, lines: int = 5) -> str:
    name = program.split(":")[-1]
    path = cfg.log_dir / f"{name}.log"
    if not path.exists():
        return ""
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    return f"{path.name} ends:\n" + "".join(f"  {ln}\n" for ln in tail)


PROBE_TIMEOUT_S = 5.0
"""How long `payrun up --role worker` waits for the provider's answer to its credentials."""


def credentials_refused(cfg: Config) -> str | None:
    """Why a worker host's senders would be refused by the email provider whatever they
    send (it refuses this host's token or login: `payrun check`'s probe, nothing sent), or
    None: accepted, or no verdict (the provider away or slow: its sends wait that out).
    A multi-host drill (s41) started a worker host without PAYRUN_EMAIL_TOKEN, as the
    README's steps then read: 202 sends answered 401, each spending an attempt of its slip
    (19 slips spent 3 of their 6), and no outage pause, since the control host's sends
    went through between them."""
    from jobs import mail
    from payrun.config import redact_url
    from payrun.provider import email_token

    try:
        transport = mail.transport_for(cfg.email_url, timeout_s=min(PROBE_TIMEOUT_S, float(cfg.email.timeout_s)),
                                       token=email_token(cfg), sender=cfg.email.sender)
        transport.probe()
    except mail.CredentialsRefused as e:
        from payrun.text import visible

        return (f"the email provider at {redact_url(cfg.email_url)} refuses this host's credentials: "
                f"{visible(str(e))[:300]}; each of this host's sends would be refused and spend an attempt of "
                f"its slip (`payrun check` here says the same)")
    except Exception:  # noqa: BLE001 - away, slow, a bad URL: not this refusal (`payrun check` says what)
        return None
    return None


def check_role(cfg: Config, role: str) -> None:
    from payrun import slipstore

    if why := slipstore.store_problem(cfg.slips_dir):  # every render and send would fail on it
        raise SetupError(why)
    if role == "worker" and cfg.embedded_redis:
        raise SetupError("a worker-only host needs PAYRUN_REDIS_URL: the control host's Redis "
                         "(`payrun config redis-url` there)")
    if role == "worker" and not cfg.email.url:
        # its senders would go to http://127.0.0.1:<provider.port>, the local provider
        # simulator that only a control host runs: connection refused on every send, and
        # each streak of them paused every sender on every host (multi-host drill: 12
        # pauses, a run of 287 slips took 80 s instead of 10)
        raise SetupError("a worker-only host needs PAYRUN_EMAIL_URL (or email.url in the config): the email "
                         "provider the control host sends to (a worker host runs no local provider)")
    if role == "worker":
        from payrun import slipstore

        try:
            conn = redis_server.connect(cfg, socket_timeout=5)
            conn.ping()
        except Exception as e:  # noqa: BLE001 - any reason it cannot be reached
            # (it started supervisord anyway, and said so only once every worker had crashed
            # on it and `up` had stopped them again)
            raise SetupError(f"the control host's Redis at {redis_server.shown_url(cfg)} does not answer "
                             f"({type(e).__name__}: {str(e)[:120]}): start the control host first (`payrun up` "
                             f"there), or check PAYRUN_REDIS_URL (`payrun config redis-url` on the control host)")
        if why := slipstore.mismatch(conn, cfg.slips_dir):
            raise SetupError(why)
    if role == "all" and not cfg.embedded_redis:
        # a control host on an external Redis: refused when another host's ledger already
        # applies its events (this is a worker host: its ledger would take a share of them
        # into its own file, and the control host's would never see those slips' ends)
        from payrun import ledger as ledger_mod

        try:
            owner = ledger_mod.events_owner(redis_server.connect(cfg, socket_timeout=5))
        except Exception:  # noqa: BLE001 - Redis not reachable now: the programs say so themselves
            owner = None
        if owner and not ledger_mod.owned_here(owner, cfg.ledger_path):
            raise SetupError(f"another ledger applies this Redis's events ({owner}): this is a worker host, "
                             "so start it with `payrun up --role worker` (a second ledger would take a share of "
                             "the events from the control host's)")


ORPHAN_WAIT_S = 50.0
"""How long `payrun down` waits for the programs of a supervisord that died to finish
their jobs and exit, before it stops Redis (above the workers' stopwaitsecs, 45 s)."""


def wait_gone(pids: list[int], timeout_s: float, clock: Callable[[], float] = time.monotonic,
              pause: Callable[[float], None] = time.sleep, alive: Callable[[int], bool] | None = None) -> list[int]:
    """Wait until none of ``pids`` runs, at most ``timeout_s``; returns those still running."""
    alive = alive or (lambda pid: Path(f"/proc/{pid}").exists())
    deadline = clock() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and clock() < deadline:
        pause(0.2)
        left = [p for p in left if alive(p)]
    return left


def down(cfg: Config, say: Callable[[str], None] | None = None) -> str:
    out, code = ctl(cfg, "status", timeout_s=STATUS_TIMEOUT_S)
    if code == HUNG:
        raise SetupError(f"supervisord does not answer ({out}): nothing was stopped; its pid is in "
                         f"{cfg.home / 'supervisord.pid'}")
    if code not in (0, 3):
        # its programs may still run (supervisord killed): Redis stays until they are gone,
        # or sends they finish would go unrecorded (an ops drill: sent again after `up`)
        if found := orphans(cfg):
            if say:
                say(f"supervisord is not running for {cfg.home}, but {orphans_line(found)}; waiting up to "
                    f"{ORPHAN_WAIT_S:.0f} s for them before stopping Redis")
            if left := wait_gone([p for p, _ in found], ORPHAN_WAIT_S):
                raise SetupError(f"supervisord is not running for {cfg.home}, and "
                                 f"{orphans_line([f for f in found if f[0] in left])}. Redis was left running "
                                 "for them: `payrun down` again once they are gone")
        stopped = redis_server.stop(cfg)
        return "supervisord is not running" + ("; stopped the embedded Redis" if stopped else "")
    # workers first (they finish their jobs within the grace), the ledger drains, Redis last
    ctl(cfg, "stop", "pdf-render:*", "send-email", "control", "reaper")
    if _role(cfg) == "all":
        ctl(cfg, "stop", "ledger", "provider")
        ctl(cfg, "stop", "redis")
    ctl(cfg, "stop", "all")
    out, _ = ctl(cfg, "shutdown")
    redis_server.stop(cfg)  # an embedded server started outside supervisord, if any
    return out.strip() or "stopped"
