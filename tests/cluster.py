"""A small cluster of real payrun processes for the chaos suite (tests/test_chaos.py).

``Cluster`` starts ``python -m payrun.cli worker pdf-render`` / ``worker send-email`` /
``ledger`` / ``reap --loop`` as separate processes (each in its own session, so the
forked RQ scheduler and work horses can be cleaned up with the process group), restarts
any that exits like supervisord's ``autorestart=true`` (a supervisor thread polls every
0.1 s), and lets a test kill, SIGTERM or replace them. Every wait polls with a deadline.

The local provider runs in the test process (``payrun.provider.Provider``); the cluster
only passes its URL to the workers.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

from payrun import config as config_mod
from payrun import ledger as ledger_mod
from payrun import keys, payroll, runs, status
from payrun.ledger import Ledger

MONTH = "2026-11"


@dataclasses.dataclass
class Proc:
    name: str
    args: list[str]
    popen: subprocess.Popen
    started_at: float
    autorestart: bool = True
    restarts: int = 0
    exits: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Every exit seen: {"pid", "code", "at" (monotonic), "after_s" (since it started)}."""

    @property
    def pid(self) -> int:
        return self.popen.pid


class Cluster:
    def __init__(self, home: Path, env: dict[str, str], config_toml: str = "", month: str = MONTH):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.month = month
        self.log_dir = self.home / "log"
        self.log_dir.mkdir(exist_ok=True)
        self.env = dict(env)
        self.env["PAYRUN_HOME"] = str(self.home)
        self.env.pop("PAYRUN_CONFIG", None)
        if config_toml:
            conf = self.home / "payrun.toml"
            conf.write_text(config_toml)
            self.env["PAYRUN_CONFIG"] = str(conf)
        self.cfg = config_mod.load(env=self.env)
        self.procs: dict[str, Proc] = {}
        self.pgids: set[int] = set()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)
        self._supervisor.start()
        self._ledger: Ledger | None = None

    # ---- plumbing --------------------------------------------------------------

    def redis_url(self) -> str:
        from payrun import redis_server

        return redis_server.url(self.cfg)

    def connect(self, **kw) -> redis.Redis:
        kw.setdefault("socket_timeout", 5)
        kw.setdefault("socket_connect_timeout", 5)
        return redis.Redis.from_url(self.redis_url(), **kw)

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.cfg.ledger_path)
        return self._ledger

    # ---- processes ---------------------------------------------------------------

    def spawn(self, name: str, *args: str, autorestart: bool = True) -> Proc:
        with self._lock:
            old = self.procs.get(name)
            popen = self._popen(name, list(args))
            proc = Proc(name, list(args), popen, time.monotonic(), autorestart,
                        restarts=old.restarts + 1 if old else 0, exits=old.exits if old else [])
            self.procs[name] = proc
            return proc

    def _popen(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "payrun.cli", *args], env=self.env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.pgids.add(p.pid)
        return p

    def start(self, render: int = 2, lanes: int | None = None, ledger: bool = True, reaper: bool = True,
              email: bool = True) -> None:
        if ledger:
            self.spawn("ledger", "ledger")
        if reaper:
            self.spawn("reaper", "reap", "--loop", "--every", "1")
        for i in range(render):
            self.spawn(f"render-{i}", "worker", "pdf-render")
        if email:
            self.start_email(lanes)

    def start_email(self, lanes: int | None = None, name: str = "email-0") -> Proc:
        args = ["worker", "send-email"] + (["--lanes", str(lanes)] if lanes else [])
        return self.spawn(name, *args)

    def workers(self, kind: str = "") -> list[str]:
        with self._lock:
            return sorted(n for n in self.procs if n.startswith(("render-", "email-")) and n.startswith(kind))

    def _supervise(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                for proc in list(self.procs.values()):
                    code = proc.popen.poll()
                    if code is None or getattr(proc.popen, "_seen", False):
                        continue
                    proc.popen._seen = True  # type: ignore[attr-defined]
                    now = time.monotonic()
                    proc.exits.append({"pid": proc.pid, "code": code, "at": now, "after_s": now - proc.started_at})
                    if proc.autorestart and not self._stop.is_set():
                        self.spawn(proc.name, *proc.args, autorestart=True)

    def signal(self, name: str, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` to the process (not its group: a worker stops its own horse)."""
        with self._lock:
            proc = self.procs[name]
            pid = proc.pid
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        return pid

    def wait_exit(self, name: str, pid: int, timeout_s: float) -> dict[str, Any]:
        """The exit record of ``name`` with this pid, once the supervisor saw it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                for e in self.procs[name].exits:
                    if e["pid"] == pid:
                        return e
            time.sleep(0.05)
        raise AssertionError(f"{name} (pid {pid}) did not exit within {timeout_s} s; see {self.log_dir}")

    def wait_alive(self, conn, name: str, timeout_s: float = 60.0) -> int:
        """Wait until the current process of ``name`` runs (its liveness key exists: a
        render worker sets it after warming WeasyPrint). Returns its pid."""
        import socket

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                pid = self.procs[name].pid
            kind = "render" if name.startswith("render") else "email"
            worker = f"{kind}.{socket.gethostname()}.{pid}" + (".00" if kind == "email" else "")
            try:
                if conn.exists(keys.alive(worker)):
                    return pid
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{name} did not come up within {timeout_s} s:\n{self.log_tail(name)}")

    def wait_started(self, name: str, marker: str, timeout_s: float = 60.0) -> None:
        """Wait until the current process of ``name`` wrote ``marker`` to its log."""
        deadline = time.monotonic() + timeout_s
        path = self.log_dir / f"{name}.log"
        while time.monotonic() < deadline:
            if path.exists() and marker in path.read_text(errors="replace"):
                return
            time.sleep(0.1)
        raise AssertionError(f"{name} did not log {marker!r} within {timeout_s} s")

    def shutdown(self, grace_s: float = 20.0) -> None:
        """Stop supervising, SIGTERM everything, then SIGKILL every process group left."""
        self._stop.set()
        self._supervisor.join(timeout=5)
        procs = list(self.procs.values())
        for p in procs:
            if p.popen.poll() is None:
                try:
                    p.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pgid in self.pgids:  # orphaned RQ schedulers and horses of killed workers
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- the pay run -------------------------------------------------------------------

    def seed(self, employees: int, companies: int = 3) -> None:
        with payroll.PayrollDB(self.cfg.payroll_path) as db:
            payroll.seed(db, companies=companies, employees=employees, seed=7, month=self.month)

    def run(self, conn) -> int:
        with payroll.PayrollDB(self.cfg.payroll_path) as db:
            result = runs.start_run(self.cfg, conn, self.ledger, db, self.month)
        assert result.aborted is None and result.locked_by is None, result
        return result.jobs

    def report(self) -> dict[str, Any]:
        return status.report(self.cfg, self.ledger, self.month)

    def progress(self) -> dict[str, int]:
        return self.report()["total"]

    def wait_done(self, conn, total: int, timeout_s: float, what: str = "the pay run",
                  tick=None) -> dict[str, int]:
        """Poll until the ledger counts ``total`` slips done or failed and has no backlog.
        ``tick()`` (the chaos) is called on every poll. Returns the total counts."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, int] = {}
        while True:
            if tick is not None:
                tick()
            last = self.progress()
            if last["done"] + last["failed"] >= total:
                try:
                    if ledger_mod.backlog(conn) == 0:
                        return last
                except redis.RedisError:
                    pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not finished after {timeout_s} s: {last}; logs in {self.log_dir}\n"
                                     + self.explain_open(conn))
            time.sleep(0.25)

    def explain_open(self, conn, limit: int = 3) -> str:
        """For a run that did not finish: the slips not done, with their ledger rows and
        attempts, their RQ job hashes and registries, and every log line naming them."""
        rows = self.ledger.db.execute(
            "SELECT r.key FROM jobs r LEFT JOIN jobs e ON e.key = r.key AND e.kind = 'email'"
            " WHERE r.kind = 'render' AND r.month = ? AND COALESCE(e.status, '') != 'done' LIMIT ?",
            (self.month, limit)).fetchall()
        out: list[str] = []
        log_lines = [(log.stem, line) for log in sorted(self.log_dir.glob("*.log"))
                     for line in log.read_text(errors="replace").splitlines()] if rows else []
        for (key,) in rows:
            out.append(f"== slip {key}")
            for j in self.ledger.db.query("SELECT * FROM jobs WHERE key = ?", (key,)):
                job_id = j["id"]
                out.append(f"ledger {j}")
                for a in self.ledger.db.query("SELECT * FROM attempts WHERE job_id = ? ORDER BY attempt", (job_id,)):
                    out.append(f"  attempt {a}")
                try:
                    h = conn.hgetall(f"rq:job:{job_id}")
                    out.append(f"  rq hash {({k.decode(): v.decode(errors='replace')[:300] for k, v in h.items() if k != b'data'})}")
                    for q in keys.QUEUES:
                        for lst in (f"rq:queue:{q}", f"rq:queue:{q}:intermediate"):
                            if conn.lpos(lst, job_id) is not None:
                                out.append(f"  in {lst}")
                    for reg in ("wip", "scheduled", "failed", "finished", "deferred"):
                        for q in keys.QUEUES:
                            if conn.zscore(f"rq:{reg}:{q}", job_id) is not None:
                                out.append(f"  in rq:{reg}:{q}")
                except redis.RedisError as e:
                    out.append(f"  redis: {e}")
            # the email job id of this slip
            emp = key.split(":", 2)[-1]
            for name in (keys.render_job_id(self.month, emp), keys.email_job_id(self.month, emp)):
                out += [f"  {stem}: {line[:400]}" for stem, line in log_lines if name in line]
        return "\n".join(out)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def scrub_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without payrun settings a cluster must choose itself."""
    env = dict(os.environ if base is None else base)
    for k in ("PAYRUN_CONFIG", "PAYRUN_EMAIL_URL", "PAYRUN_REDIS_URL", "PAYRUN_REDIS_SUPERVISED", "PAYRUN_TEST_JOBS"):
        env.pop(k, None)
    return env
