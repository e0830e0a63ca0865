"""`payrun check`: is this payrun ready for its next pay run?

The evening before the 1st, the on-call engineer wants one answer, not nine commands: will
the 02:00 tick fire, will something take its jobs, will the provider take our mail, is
there room for the slips, and will it all be done by 09:00? Each check gives a Finding
(ok, warn or fail) with what to do; the command exits 1 when any check fails.

Nothing here changes the system: no job is enqueued, no email is sent (the provider is
asked something it refuses without sending: an SMTP login then QUIT, or an HTTP request
with no message), the slip store gets a test file that is removed at once, and Redis is
only read (the embedded Redis is not started for a look).

The policy (what is enough, how long a run takes) is in the pure functions at the top,
tested on their own; the checks that read the system are below them.
"""

from __future__ import annotations

import errno
import math
import os
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

OK, WARN, FAIL = "ok", "warn", "fail"
AREAS = ("redis", "scheduler", "payroll", "render", "intake", "workers", "ledger", "email", "data", "slips",
         "estimate")

SEED_SEND_S = 1.2
"""How long a send takes when we cannot know (a real provider): the seed's 1.2 s."""
POOL_EFFICIENCY = 0.85
"""The render pool's slips/s against cores ÷ a lone warm render (bench/render.py: 0.80–0.86)."""
START_S = 60.0
"""A run's start before its first delivery: the fan-out, the first renders, the first send."""
REDIS_BYTES_PER_SLIP = {True: 5.5 * 1024, False: 14 * 1024}
"""What Redis holds per delivered slip for a day (README, Known limits): the embedded
server's settings (True) and Redis's defaults (False)."""
DISK_MARGIN = 1.5
"""Room asked for beyond the month's slips (resends, a slip bigger than the sample)."""
DEADLINE_MARGIN_S = 3600.0
"""A run expected to end less than an hour before 09:00 is a warning: one outage eats that."""


@dataclass(frozen=True)
class Finding:
    area: str
    level: str
    text: str
    detail: dict[str, Any] | None = None
    """What the text shortens, whole, for --json (the employee ids of "emp-00001, … and 2,310 more")."""

    def to_dict(self) -> dict[str, Any]:
        out = {"area": self.area, "level": self.level, "text": self.text}
        if self.detail is not None:
            out["detail"] = self.detail
        return out


@dataclass
class Report:
    month: str | None = None
    tick: str | None = None
    """The next pay-run tick (ISO, the configured zone), if a scheduler entry runs one."""
    tick_month: str | None = None
    """The month that tick pays (another than ``month`` when --month named one)."""
    role: str = "control"
    """Which host's part was checked: "control" (everything) or "worker" (that host's part)."""
    findings: list[Finding] = field(default_factory=list)

    def add(self, area: str, level: str, text: str, detail: dict[str, Any] | None = None) -> None:
        self.findings.append(Finding(area, level, text, detail))

    @property
    def failures(self) -> int:
        return sum(f.level == FAIL for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.level == WARN for f in self.findings)

    def in_order(self) -> None:
        """The findings by area, in AREAS order (each area's in the order found)."""
        self.findings.sort(key=lambda f: AREAS.index(f.area) if f.area in AREAS else len(AREAS))

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "month": self.month, "tick": self.tick, "tick_month": self.tick_month,
                "ready": not self.failures, "failures": self.failures, "warnings": self.warnings,
                "checks": [f.to_dict() for f in self.findings]}


# ---- policy (pure) ------------------------------------------------------------------

def send_rate(rate_per_s: float, cap: int, lanes: int, send_s: float) -> float:
    """Sends per second the run can reach: the provider's limit, the global cap over a
    send's time, and every send lane of every live sending process over a send's time."""
    send_s = max(send_s, 0.001)
    return max(0.0, min(rate_per_s, cap / send_s, lanes / send_s))


def run_seconds(slips: int, sends_per_s: float, render_s: float, render_workers: int) -> float | None:
    """How long a run of ``slips`` takes, start to last delivery: the slower of the sends and
    the renders (they overlap), plus the start. None when nothing would send or render."""
    if slips <= 0:
        return 0.0
    if sends_per_s <= 0 or render_workers <= 0 or render_s <= 0:
        return None
    renders_per_s = render_workers / render_s * POOL_EFFICIENCY
    return START_S + max(slips / sends_per_s, slips / renders_per_s)


def deadline_after(start: datetime, hour: int = 9, minute: int = 0) -> datetime:
    """The first 09:00 (in ``start``'s zone) at or after ``start``: what a run begun then must meet."""
    deadline = start.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return deadline if deadline >= start else deadline + timedelta(days=1)


def deadline_verdict(start: datetime, seconds: float | None) -> tuple[str, str]:
    """Whether a run begun at ``start`` (local) and lasting ``seconds`` ends before 09:00."""
    deadline = deadline_after(start)
    if seconds is None:
        return FAIL, f"cannot finish: nothing would render or send its slips (deadline {deadline:%H:%M} on {deadline:%Y-%m-%d})"
    end = start + timedelta(seconds=seconds)
    took = _duration(seconds)
    left = (deadline - end).total_seconds()
    if left < 0:
        return FAIL, (f"about {took}: done by {end:%H:%M}, after {deadline:%H:%M}: start earlier, add render workers "
                      "or raise the provider's limit")
    if left < DEADLINE_MARGIN_S:
        return WARN, (f"about {took}: done by {end:%H:%M}, less than an hour before {deadline:%H:%M} "
                      "(one provider outage would eat that)")
    return OK, f"about {took}: done by about {end:%H:%M}, {_duration(left)} before {deadline:%H:%M}"


def disk_verdict(free_bytes: int, slips: int, slip_bytes: int) -> tuple[str, str]:
    need = int(slips * slip_bytes * DISK_MARGIN)
    text = f"{_size(free_bytes)} free, ~{_size(need)} needed for {slips:,} slips of ~{_size(slip_bytes)}"
    if free_bytes < slips * slip_bytes:
        return FAIL, text + ": the store would fill up mid-run (free space, or `payrun prune --slips`)"
    if free_bytes < need:
        return WARN, text + " (with little to spare)"
    return OK, text


DATA_BYTES_PER_SLIP = 24 * 1024
"""What a slip takes in the data directory with the embedded Redis: its append-only file
(~5.5 KiB of Redis data a slip, rewritten when it doubles, the rewrite's copy beside it),
the ledger's rows (~3 KiB) and the log lines; 6 KiB without the embedded Redis."""

DATA_BYTES_PER_SLIP_NO_REDIS = 6 * 1024


def data_verdict(home: Path, free_bytes: int, slips: int, embedded_redis: bool) -> tuple[str, str]:
    """The data directory's room: FAIL when it is (nearly) full, since the ledger, the payroll
    database and the embedded Redis's append-only file live there (Redis refuses every write
    then: the run stops); WARN when the month's slips may not fit."""
    from payrun import diskspace

    what = "the embedded Redis's append-only file, the ledger, logs" if embedded_redis else "the ledger, logs"
    if free_bytes < diskspace.NEARLY_FULL_BYTES:
        return FAIL, (f"{home}: {_size(free_bytes)} free: full ({what}): free space there "
                      f"({diskspace.what_to_free(home)})")
    need = slips * (DATA_BYTES_PER_SLIP if embedded_redis else DATA_BYTES_PER_SLIP_NO_REDIS)
    text = f"{home}: {_size(free_bytes)} free" + (f", ~{_size(need)} needed for {slips:,} slips ({what})" if slips
                                                  else "")
    if free_bytes < need:
        return WARN, text + ": it may fill up mid-run, which stops the run until space is freed"
    return OK, text


def store_room_verdict(store: Path, free_bytes: int) -> tuple[str, str]:
    """The slip store's room when no slips are counted for the month (already run): a store
    with no room for a few slips is full, and every render waits (jobs.errors.StoreFull).
    (It read "ok … writable; 4.0 KiB free" of a store full mid-run: the 4 KiB test file fit.)"""
    from jobs.policy import STORE_ROOM_MIN_BYTES

    if free_bytes < STORE_ROOM_MIN_BYTES:
        return FAIL, (f"{store}: {_size(free_bytes)} free: full, no room for a slip (~18 KiB): renders wait "
                      "until space is freed (`payrun prune --slips`, or grow it)")
    return OK, f"{store}: writable; {_size(free_bytes)} free"


def store_write_text(store: Path, err: OSError, user: str) -> str:
    """Why the slip store's test file could not be made, and what to do, by its errno (its
    strerror alone said "No such file or directory" of a store that is there, on /proc)."""
    code = err.errno
    if code == errno.EROFS:
        todo = "its file system is mounted read-only: mount it read-write (every slip is written there)"
    elif code in (errno.EACCES, errno.EPERM):
        todo = (f"this account ({user}) may not write there: the store must belong to the account payrun runs "
                f"as (chown -R {user} {store})")
    elif code in (errno.ENOSPC, errno.EDQUOT):
        todo = "no room for a 4 KiB file: free space (`payrun prune --slips`) or raise the quota"
    elif code == errno.EIO:
        from jobs.policy import store_fault_todo
        from payrun.slipstore import mount_point

        todo = store_fault_todo(code, str(mount_point(store)))
    elif code in (errno.ENOENT, errno.ENOTDIR):
        todo = ("no file can be made in it (a virtual file system such as /proc or /sys, or it went away): set "
                "PAYRUN_SLIPS_DIR to a directory on a disk")
    else:
        todo = "set PAYRUN_SLIPS_DIR to a directory this account can write to"
    return f"{store}: a slip cannot be written there ({err.strerror or err}): {todo}"


def store_missing_text(store: Path) -> str:
    """What to do about a slip store that is not a directory: `payrun up` makes a missing
    one, but not under a file (PAYRUN_SLIPS_DIR=/srv/slips.tar/slips) nor over one."""
    from payrun import slipstore

    return slipstore.not_a_directory(store) or (
        f"no slip store at {store}: `payrun up` makes it (mount the shared store first on a multi-host setup)")


def redis_memory_verdict(used: int, maxmemory: int, policy: str, slips: int, embedded: bool) -> tuple[str, str]:
    """Redis keeps ~5.5 KiB per slip for a day (14 KiB with Redis's default settings): a
    maxmemory below that refuses writes mid-run, and an evicting policy drops jobs. Both
    are said when both hold (it said only the policy: fixed, the next check found the
    maxmemory). With no maxmemory Redis never evicts: an evicting policy is then a warning."""
    per = REDIS_BYTES_PER_SLIP[embedded]
    need = used + int(slips * per)
    text = f"{_size(used)} used" + (f", ~{_size(need)} at the end of a run of {slips:,} slips" if slips else "")
    evicting = bool(policy) and policy != "noeviction"
    problems = []
    if maxmemory and need > maxmemory:
        problems.append(f"above its maxmemory of {_size(maxmemory)}: it would refuse writes mid-run (raise "
                        f"maxmemory above ~{_size(need)})")
    if evicting and maxmemory:
        problems.append(f"maxmemory-policy is {policy}: under memory pressure Redis deletes keys, jobs among "
                        "them (set it to noeviction)")
    if problems:
        return FAIL, text + "; " + "; ".join(problems)
    if evicting:
        return WARN, (text + f"; maxmemory-policy is {policy}, with no maxmemory: nothing is evicted now, but "
                      "once a maxmemory is set Redis deletes keys under pressure, jobs among them (set it to "
                      "noeviction)")
    return OK, text + (f" (maxmemory {_size(maxmemory)})" if maxmemory else "")


CLOCK_SKEW_S = 2.0
"""A host clock this far from Redis's is a warning: leases, liveness and the reaper compare
times written by different hosts, and the schedulers fire by their own clocks."""


def clock_verdict(skew_s: float) -> tuple[str, str] | None:
    """This host's clock against the Redis server's (local minus Redis), or None when close."""
    if abs(skew_s) < CLOCK_SKEW_S:
        return None
    return WARN, (f"this host's clock is {abs(skew_s):.1f} s {'ahead of' if skew_s > 0 else 'behind'} the Redis "
                  "server's: leases, liveness and the schedulers compare times across hosts (sync the clocks: NTP)")


def worker_verdicts(render: int, send_processes: int, lanes: int, control: int, hosts: int) -> list[Finding]:
    out = []
    where = f" on {hosts} host{'s' if hosts != 1 else ''}" if hosts > 1 else ""
    if render:
        out.append(Finding("workers", OK, f"{render} pdf-render worker{'s' if render != 1 else ''}{where}"))
    else:
        out.append(Finding("workers", FAIL, "no pdf-render worker is running: no slip would be rendered "
                                            "(`payrun up`, `payrun ps`)"))
    if send_processes:
        out.append(Finding("workers", OK, f"{send_processes} send-email process{'es' if send_processes != 1 else ''} "
                                          f"with {lanes} lanes"))
    else:
        out.append(Finding("workers", FAIL, "no send-email worker is running: no slip would be emailed "
                                            "(`payrun up`, `payrun ps`)"))
    if control:
        out.append(Finding("workers", OK, f"{control} control worker{'s' if control != 1 else ''} (cron ticks' jobs)"))
    else:
        out.append(Finding("workers", FAIL, "no control worker is running: a cron tick's pay run would wait, "
                                            "not start (`payrun up` on the control host)"))
    return out


def refused_sender_verdicts(refused: list[dict], send_processes: int, now_ms: float) -> list[Finding]:
    """The live send-email processes paused because the provider refuses their own
    credentials (jobs.senders.read_refused): a warning each while others send (their jobs
    go to those, at less capacity); a failure when none is left sending."""
    from jobs.senders import refused_line

    if not refused:
        return []
    if len(refused) >= send_processes:
        return [Finding("workers", FAIL, f"every send-email process is paused, the provider refusing its "
                                         f"credentials: {refused_line(refused[0], now_ms)}")]
    return [Finding("workers", WARN, refused_line(r, now_ms)) for r in refused]


def named_alike(workers, hostname: str, host_id: str) -> Finding | None:
    """A warning when live ``workers`` (console.data.WorkerRow) of another machine or
    container bear this host's ``hostname`` (another host id: payrun.procs.host_id), or
    None. payrun keeps their records and locks apart by id; people and `payrun ps` go by
    hostname (the console and `payrun workers` add a suffix of the host id). Pure."""
    alike = sorted({w.name for w in workers if w.host == hostname and w.host_id and w.host_id != host_id})
    if not alike:
        return None
    named = ", ".join(alike[:3]) + (f" and {len(alike) - 3} more" if len(alike) > 3 else "")
    return Finding("workers", WARN, f"another machine or container is also named {hostname!r} (workers {named}): "
                                    "`payrun ps` and the logs show both hosts' as one (the console and `payrun "
                                    "workers` add a suffix of the host id); give each host its own hostname "
                                    "(README: Two hosts with one hostname)")


def supervisor_verdicts(status: str, log_dir) -> list[Finding]:
    """What this host's `supervisorctl status` says: programs supervisord gave up on
    (FATAL) fail (`payrun up` starts them again); programs stopped by hand (STOPPED with a
    date: "Not started" is one not meant to run here) are named with the command that
    starts them, since `payrun up` leaves them stopped. The check said "`payrun up`" for a
    ledger, workers or a scheduler stopped by hand, and `payrun up` started none of them."""
    from payrun import supervise

    out = []
    given_up = supervise.gave_up(status, ("FATAL",))
    if given_up:
        out.append(Finding("workers", FAIL, f"supervisord gave up on {', '.join(given_up)} here (FATAL): see their "
                                            f"logs in {log_dir}, then `payrun up`"))
    by_hand = [ln.split()[0] for ln in status.splitlines()
               if len(ln.split()) > 1 and ln.split()[1] == "STOPPED" and "Not started" not in ln]
    if by_hand:
        out.append(Finding("workers", WARN, f"{', '.join(by_hand)} stopped by hand here, which `payrun up` leaves "
                                            "stopped: `eval \"$(payrun supervisor-env)\"` then `supervisorctl -c "
                                            f"\"$PAYRUN_SUPERVISOR_CONF\" start {' '.join(by_hand)}`"))
    return out


def scheduler_verdict(alive: int, due_since: str | None, tick: str | None, zone: str,
                      differs: list[str] | None = None) -> Finding:
    """``differs``: the pay-run entries the running schedulers loaded otherwise than this
    file says (scheduler.cli.running_entries_differ): the file is read at their start, and
    check said "ok next pay-run tick <the file's time>" of a tick they would not fire then."""
    if due_since:
        return Finding("scheduler", FAIL, f"a pay-run tick due since {local_text(due_since, zone)} has not fired: is a "
                                          "scheduler running? (`payrun schedule`)")
    if not alive:
        what = f"the tick of {local_text(tick, zone)} will not fire" if tick else "no cron tick will fire"
        return Finding("scheduler", FAIL, f"no scheduler is running: {what} (`payrun up` on the control host)")
    nxt = f"next pay-run tick {local_text(tick, zone)}" if tick else "no pay-run entry in scheduler.entries"
    if differs:
        return Finding("scheduler", FAIL, f"{nxt} by this file, but the schedulers running loaded another schedule "
                                          f"at their start ({'; '.join(differs)}): they will not fire it then. "
                                          "Restart them to use this file's: `eval \"$(payrun supervisor-env)\"` then "
                                          "`supervisorctl -c \"$PAYRUN_SUPERVISOR_CONF\" restart scheduler-a scheduler-b`")
    if alive == 1:
        return Finding("scheduler", WARN, f"{nxt}; one scheduler running, not two: none stands by to fire the "
                                          "tick if this one is down then (start the other: `payrun ps`)")
    return Finding("scheduler", OK, f"{nxt}; {alive} schedulers running (one fires, the other stands by)")


def wrapped(prefix: str, text: str, width: int | None) -> list[str]:
    """A line of the check as a terminal of ``width`` columns shows it: ``prefix`` then
    ``text``, wrapped with the text's column kept (the terminal wrapped a 200-character
    finding to column 0, under the marks of the next ones), never inside a `command` (copied
    from two lines, the first half would run alone) nor inside a word (a URL, a path).
    ``width`` None: one line, as for a pipe or cron mail (one finding a line, for grep)."""
    if width is None:
        return [prefix + text]
    import re
    import textwrap

    glue = "\0"  # (no check's text has a NUL: the import refuses control characters)
    kept = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", glue), text)
    lines = textwrap.wrap(kept, width=max(width - len(prefix), 30), break_long_words=False,
                          break_on_hyphens=False) or [""]
    return [(prefix if i == 0 else " " * len(prefix)) + line.replace(glue, " ") for i, line in enumerate(lines)]


def local_text(iso: str | None, zone: str) -> str:
    """An ISO time as the check says it: "2026-12-01 02:00 Asia/Dhaka"."""
    if not iso:
        return "?"
    from zoneinfo import ZoneInfo

    return f"{datetime.fromisoformat(iso).astimezone(ZoneInfo(zone)):%Y-%m-%d %H:%M} {zone}"


def _duration(seconds: float) -> str:
    m = int(math.ceil(seconds / 60))
    return f"{m} min" if m < 120 else f"{m // 60} h {m % 60:02d} min"


def _size(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


# ---- the checks that read the system -------------------------------------------------

def check(cfg, *, month: str | None = None, worker_host: bool = False, email: bool = True,
          now: datetime | None = None, connect: Callable[[], Any] | None = None) -> Report:
    """Every check, in the order an operator reads them. ``worker_host``: this data
    directory is a worker host's (no ledger, payroll data or scheduler here). ``connect``:
    the Redis connection (default: the one the config names, not started if down)."""
    from zoneinfo import ZoneInfo

    now = now or datetime.now(timezone.utc)
    zone = ZoneInfo(cfg.timezone)
    rep = Report(month=month, role="worker" if worker_host else "control")
    conn = _redis(cfg, rep, connect)

    tick_local: datetime | None = None
    due_since = None
    if not worker_host:
        tick_local, due_since = _next_tick(cfg, conn, rep, now, zone)
    if not worker_host:
        _missed_months(cfg, rep)
    slips = _payroll(cfg, rep) if not worker_host and rep.month else 0

    render_s, slip_bytes = _render(rep)
    live = None
    if conn is not None:
        _redis_memory(cfg, conn, rep, slips)
        _intake(conn, rep)
        live = _workers(cfg, conn, rep, worker_host)
        if not worker_host:
            _ledger(cfg, conn, rep)
            from scheduler import cron
            from scheduler.cli import running_entries_differ, schedulers_alive

            alive = schedulers_alive(conn)
            pay = {e.name for e in cron.load_entries(cfg.scheduler.entries) if e.job == "payroll"}
            differs = [line for line in running_entries_differ(cfg, conn, alive)
                       if line.split(": ")[0] in pay or (": " in line and line.split(": ")[1] in pay)]
            rep.findings.append(scheduler_verdict(len(alive), due_since, rep.tick, cfg.timezone, differs))
    _supervisor(cfg, rep)
    if email:
        _email(cfg, rep)
    _data(cfg, rep, slips)
    _slips(cfg, rep, slips, slip_bytes, conn, worker_host)
    if not worker_host and rep.month:
        by_tick = tick_local is not None and rep.tick_month == rep.month
        _estimate(cfg, conn, rep, slips, render_s, live, tick_local if by_tick else now.astimezone(zone), by_tick)
    rep.in_order()
    return rep


def _redis(cfg, rep: Report, connect) -> Any:
    from payrun import redis_server
    from payrun.config import redact_url

    where = "embedded (unix socket)" if cfg.embedded_redis else redact_url(redis_server.url(cfg))
    try:
        conn = connect() if connect else redis_server.connect(cfg, socket_timeout=5, socket_connect_timeout=5)
        conn.ping()
    except Exception as e:  # noqa: BLE001 - whatever stops us reaching it, said in one line
        import redis

        from jobs.policy import redis_refusal_reason, redis_refuses_writes

        if redis_refuses_writes(e):  # (it answers PING with MISCONF too: it read "unreachable … `payrun up`")
            rep.add("redis", FAIL, f"{where}: reachable, but {redis_server.refusal_text(redis_refusal_reason(e), cfg)}"
                                   "; the checks that read Redis were not made")
            return None
        why = ("no answer within 5 s" if isinstance(e, (redis.TimeoutError, TimeoutError)) else
               "its password was refused" if isinstance(e, redis.AuthenticationError)
               else type(e).__name__)
        # `payrun up` starts the embedded Redis only: it said so for an external one too
        todo = ("`payrun up`, then check again" if cfg.embedded_redis else
                "see to that Redis and to PAYRUN_REDIS_URL (its address, its password), then check again")
        rep.add("redis", FAIL, f"{where}: unreachable ({why}): {todo}; the checks that read Redis (workers, "
                               "intake, limits, and on the control host the scheduler and ledger) were not made")
        return None
    try:
        info = conn.info("persistence")
    except Exception:  # noqa: BLE001 - a managed Redis may refuse INFO sections
        info = {}
    if info and not int(info.get("aof_enabled", 0)) and cfg.embedded_redis:
        rep.add("redis", WARN, f"{where}: reachable, but appendonly is off: a Redis restart loses the queued jobs")
    elif info and not int(info.get("aof_enabled", 0)):
        rep.add("redis", WARN, f"{where}: reachable; appendonly is off: a restart of this Redis loses queued jobs "
                               "unless its snapshots are recent (turn on appendonly)")
    else:
        rep.add("redis", OK, f"{where}: reachable" + (", appendonly on" if info else ""))
    try:
        before = time.time()
        sec, usec = conn.time()
        skew = (before + time.time()) / 2 - (sec + usec / 1e6)
    except Exception:  # noqa: BLE001 - a Redis that refuses TIME: nothing to compare
        skew = 0.0
    if said := clock_verdict(skew):
        rep.add("redis", *said)
    return conn


def _redis_memory(cfg, conn, rep: Report, slips: int) -> None:
    try:
        mem = conn.info("memory")
    except Exception:  # noqa: BLE001
        return
    level, text = redis_memory_verdict(int(mem.get("used_memory", 0)), int(mem.get("maxmemory", 0)),
                                       str(mem.get("maxmemory_policy", "")), slips, cfg.embedded_redis)
    rep.add("redis", level, text)


def _next_tick(cfg, conn, rep: Report, now: datetime, zone) -> tuple[datetime | None, str | None]:
    """The next pay-run tick (local), and a tick due and not fired; sets the report's month
    to the one that tick pays when none was asked for."""
    from scheduler import cron
    from scheduler.cli import schedule_view

    try:
        entries = {e.name: e for e in cron.load_entries(cfg.scheduler.entries)}
        rows = schedule_view(cfg, conn, now=now)
    except Exception as e:  # noqa: BLE001 - a bad schedule is a finding, not a crash
        rep.add("scheduler", FAIL, f"the schedule cannot be read: {e}")
        return None, None
    pay = [r for r in rows if r["job"] == "payroll"]
    if not pay:
        rep.add("scheduler", WARN, "no pay-run entry in scheduler.entries: a pay run starts only by hand "
                                   "(`payrun run --month M`)")
        return None, None
    row = min(pay, key=lambda r: r["next_utc"])
    nxt = datetime.fromisoformat(row["next_utc"]).astimezone(zone)
    rep.tick = nxt.isoformat()
    rep.tick_month = cron.pay_month(nxt, zone, entries[row["name"]].month)
    if rep.month is None:
        rep.month = rep.tick_month
    return nxt, row.get("due_since")


def _missed_months(cfg, rep: Report) -> None:
    """Pay months whose cron tick was missed (past the catch-up window) and not run since:
    `payrun status` and `payrun schedule` named them, and check said "ready" beside, of the
    next month's tick alone (drill, session 41)."""
    if not cfg.ledger_path.exists():
        return
    from payrun.ledger import Ledger
    from payrun.status import missed_run_text
    from scheduler.store import missed_pay_months

    led = Ledger(cfg.ledger_path)
    try:
        missed = missed_pay_months(led.db.conn, set(led.months()))
    finally:
        led.close()
    for month, tick in sorted(missed.items()):
        rep.add("scheduler", WARN, missed_run_text(month, tick, cfg.timezone), {"month": month, "tick": tick})


def _payroll(cfg, rep: Report) -> int:
    """The month's slips: employees the run pays (salary lines, ``in_month_run``) and how many
    with salary lines it leaves out; those the month pays without one named, and leavers
    with one (paid, their final slip, or left out)."""
    from payrun import payroll

    if not cfg.payroll_path.exists():
        rep.add("payroll", FAIL, f"no payroll database at {cfg.payroll_path}: `payrun import` the companies and "
                                 "employees first")
        return 0
    try:
        with payroll.PayrollDB(cfg.payroll_path) as db:
            names = {int(c["id"]): c["name"] for c in payroll.companies(db)}
            companies = payroll.company_ids_for(db, rep.month)
            slips = payroll.count_employees(db, rep.month)
            missing = payroll.without_salary_line(db, rep.month, sorted(names))
            leavers = payroll.leavers_with_salary_line(db, rep.month)
            first = sorted(e for cid, es in missing.items() if cid in companies for e in es)[:5]
            named = dict(zip(first, payroll.with_leaving_dates(db, first)))  # (a leaver with their date)
    except sqlite3.OperationalError as e:
        from payrun import diskspace

        free = diskspace.free_bytes(cfg.payroll_path)
        if not diskspace.no_room(e, free):
            raise
        rep.add("payroll", FAIL, f"cannot read {diskspace.full_text(cfg.payroll_path, e, free)}")
        return 0
    # leavers with a salary line whom the run leaves out (left before the month, or on a day
    # not recorded): the count said "employees with salary lines", and counted only the paid
    left_out = sum(1 for _, _, paid in leavers if not paid)
    out_text = payroll.left_out_text(left_out, rep.month)
    if not slips:
        rep.add("payroll", FAIL, f"no salary line for {rep.month} of anyone the run pays: {out_text}; the tick would "
                                 "pay nothing (`payrun employee left ID --on DATE` for one who worked in it, or `payrun "
                                 "import FILE.csv` with the month's lines)" if left_out else
                f"no salary lines for {rep.month}: the tick would pay nothing (`payrun import FILE.csv` with the "
                "month's lines)")
        return 0
    rep.add("payroll", OK, f"{rep.month}: the run pays {_n(slips, 'employee')} in {_n(len(companies), 'company')}"
                           + (f"; {out_text}" if left_out else ""), {"pays": slips, "left_out": left_out})
    absent = sorted(set(missing) - set(companies))  # a company with staff and not one line: its file not imported?
    if absent:
        shown = ", ".join(f"{cid} ({names.get(cid, '?')})" for cid in absent[:5]) + (
            f" and {len(absent) - 5} more" if len(absent) > 5 else "")
        rep.add("payroll", WARN, f"{len(absent)} compan{'y has' if len(absent) == 1 else 'ies have'} active employees "
                                 f"and no salary line for {rep.month} at all, so no slips: {shown} (its file not "
                                 "imported yet?)", {"companies": absent})
    unpaid = sorted(e for cid, ids in missing.items() if cid in companies for e in ids)
    if unpaid:
        shown = ", ".join(named.get(e, e) for e in unpaid[:5]) + (f" and {len(unpaid) - 5:,} more" if len(unpaid) > 5 else "")
        rep.add("payroll", WARN, f"{len(unpaid):,} employee{'s' if len(unpaid) != 1 else ''} of the "
                                 f"companies paid {'have' if len(unpaid) != 1 else 'has'} no salary line for {rep.month}, "
                                 f"so no slip: {shown} (`payrun import`, or for those gone before {rep.month} "
                                 "`payrun employee left ID --on DATE`)",
                {"employees": unpaid})
    run: list[dict] = []
    if cfg.ledger_path.exists():
        from payrun.ledger import Ledger

        led = Ledger(cfg.ledger_path)
        try:
            run = led.runs(rep.month)
            with_slip = led.employees_with_jobs(rep.month) if run and leavers else set()
        finally:
            led.close()
        leavers = [x for x in leavers if x[0] not in with_slip]  # (a month run: those still without a slip)
    if leavers:  # (an HR walkthrough: a leaver's final month said nothing before the run)
        rep.add("payroll", WARN, leavers_text(leavers, rep.month, ran=bool(run)),
                {"final_slips": [e for e, _, paid in leavers if paid],
                 "left_out": [e for e, _, paid in leavers if not paid],
                 "left_on": {e: day for e, day, _ in leavers}})
    if cfg.ledger_path.exists():
        ran = {int(r["company_id"]) for r in run}
        if run:
            # a run makes slips for the companies not run yet only: the estimate, the room
            # and the memory are for those (they were for the whole month, run or not)
            with payroll.PayrollDB(cfg.payroll_path) as db:
                left = sum(payroll.count_employees(db, rep.month, cid) for cid in companies if cid not in ran)
            rest = (f": running it again makes no slip (`payrun status --month {rep.month}`)" if not left else
                    f": running it makes only the {left:,} slips of the {_n(len(set(companies) - ran), 'company')} "
                    "not run yet")
            rep.add("payroll", WARN, f"{rep.month} was already run for {_n(len(ran), 'company')}{rest}",
                    {"companies_run": sorted(ran)})
            return left
    return slips


def leavers_text(leavers: list[tuple[str, str | None, bool]], month: str, ran: bool = False) -> str:
    """`payrun check`'s note on employees marked left with a salary line for ``month``
    (``payroll.leavers_with_salary_line``): those the run pays (left in the month or later:
    their final slip) and those it leaves out (left before it, or on a day not recorded),
    each with the day they left, and what to do if one of the second worked that month.
    ``ran``: the month has run (``leavers`` are then those still without a slip of it), so
    what makes a slip is `run --resume`, not the run to come."""
    from payrun.payroll import left_label

    def shown(group: list[tuple[str, str | None, bool]]) -> str:
        return ", ".join(f"{e} ({left_label(day)})" for e, day, _ in group[:5]) + (
            f" and {len(group) - 5:,} more" if len(group) > 5 else "")

    paid = [x for x in leavers if x[2]]
    out = [x for x in leavers if not x[2]]
    resume = f"`payrun run --month {month} --resume`"
    parts = []
    if paid:
        parts.append(f"{resume + ' makes' if ran else 'the run makes'} the final slip of {_n(len(paid), 'employee')} "
                     f"who left in {month} or later: {shown(paid)}")
    if out:
        parts.append(f"{'the run made' if ran else 'it makes'} no slip for {_n(len(out), 'employee')} who left before "
                     f"{month} or on a day not recorded: {shown(out)} (worked in {month}: `payrun employee left ID "
                     f"--on DATE`, the day they left, {'then ' + resume if ran else 'before the run'})")
    return (f"{_n(len(leavers), 'employee')} marked as left {'has' if len(leavers) == 1 else 'have'} a salary line "
            f"for {month}{' and no slip of it' if ran else ''}: " + "; ".join(parts))


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun if count == 1 else (noun[:-1] + 'ies' if noun.endswith('y') else noun + 's')}"


def _render(rep: Report) -> tuple[float, int]:
    """A sample slip rendered here, cold then warm: the warm time and its size."""
    from jobs import slip

    try:
        t0 = time.perf_counter()
        slip.warm_up()
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        pdf = slip.render_pdf(slip.SAMPLE_SNAPSHOT)
        warm = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the renderer's own failure, said
        rep.add("render", FAIL, f"the sample slip does not render here: {type(e).__name__}: {e}")
        return 0.0, 0
    hb = slip.harfbuzz_subsetting()["harfbuzz_subset"]
    text = f"a sample slip renders in {warm * 1000:.0f} ms warm ({cold:.1f} s cold), {len(pdf) // 1024} KiB"
    if hb:
        rep.add("render", OK, text + "; fonts subset with HarfBuzz")
    else:
        rep.add("render", WARN, text + "; fonts subset with fontTools, several times slower than HarfBuzz "
                                       "(install libharfbuzz-subset0: scripts/setup)")
    return warm, len(pdf)


def _intake(conn, rep: Report) -> None:
    from rq.suspension import WORKERS_SUSPENDED

    from payrun import keys

    paused = sorted(m.decode() if isinstance(m, bytes) else m for m in conn.smembers(keys.PAUSED_QUEUES))
    if conn.exists(WORKERS_SUSPENDED):
        rep.add("intake", FAIL, "intake is drained everywhere: no worker would take the run's jobs (`payrun resume`)")
    elif paused:
        rep.add("intake", FAIL, f"intake is drained on {', '.join(paused)}: those jobs would wait (`payrun resume`)")
    else:
        rep.add("intake", OK, "open on every queue")


def _workers(cfg, conn, rep: Report, worker_host: bool = False) -> dict[str, int]:
    """The live workers; on a worker host, this host's only, and no control worker (the
    control host's part): other hosts' workers said a worker host whose own were all down
    was ready, and the control host's missing control worker failed a worker host's check."""
    import socket

    from console.data import read_workers
    from payrun.procs import host_id

    rows = every = [w for w in read_workers(conn, time.time()) if w.alive and not w.stopping]
    if worker_host:  # (another machine with this hostname is not this host: its id differs)
        rows = [w for w in rows if w.host == socket.gethostname() and w.host_id in (None, host_id())]
    render = sum(w.kind == "render" for w in rows)
    email_rows = [w for w in rows if w.kind == "email"]
    processes = len({(w.host, w.host_id, w.pid) for w in email_rows})
    control = sum(w.kind == "control" for w in rows)
    hosts = len({(w.host, w.host_id) for w in rows})  # (two machines named alike: two hosts)
    found = worker_verdicts(render, processes, len(email_rows), control, hosts)
    if alike := named_alike(every, socket.gethostname(), host_id()):  # (before this host's own were picked)
        found.append(alike)
    if worker_host:
        found = [f for f in found if "control worker" not in f.text]
    rep.findings.extend(found)
    from jobs.senders import read_refused

    refused = read_refused(conn)
    if worker_host:
        refused = [r for r in refused if r["host"] == socket.gethostname()]
    rep.findings.extend(refused_sender_verdicts(refused, processes, time.time() * 1000))
    return {"render": render, "lanes": len(email_rows)}


def _supervisor(cfg, rep: Report) -> None:
    """This host's supervisord, if one runs here (either role): what it gave up on or was
    stopped by hand. Asked whether Redis answers or not (a FATAL embedded Redis is why)."""
    from payrun import supervise

    if (status := supervise.status_here(cfg)) is not None:
        rep.findings.extend(supervisor_verdicts(status, cfg.log_dir))


def _ledger(cfg, conn, rep: Report) -> None:
    from payrun import keys
    from payrun.ledger import LEDGER_STALE_S, backlog_age_s

    owner = conn.get(keys.LEDGER_OWNER)
    age = backlog_age_s(conn)
    if age > LEDGER_STALE_S:
        rep.add("ledger", FAIL, f"the ledger is {age:.0f} s behind the workers: is `payrun ledger` running "
                                "(`payrun ps`)? Status and the console would lag the run")
    elif owner is None:
        rep.add("ledger", FAIL, "no `payrun ledger` is running: the run's progress would not reach the ledger, "
                                "`payrun status` or the console (`payrun up`)")
    else:
        rep.add("ledger", OK, "`payrun ledger` is applying the workers' events")


def _email(cfg, rep: Report) -> None:
    from jobs import mail
    from payrun.config import redact_url

    url = cfg.email_url
    shown = redact_url(url)
    if not cfg.email.url:
        rep.add("email", WARN, f"PAYRUN_EMAIL_URL is not set: slips go to the local provider simulator ({shown}), "
                               "which delivers nothing to anyone (right for a rehearsal, not for payday)")
    try:
        from payrun.provider import email_token

        transport = mail.transport_for(url, timeout_s=min(15.0, float(cfg.email.timeout_s)), token=email_token(cfg),
                                       sender=cfg.email.sender)
        said = transport.probe()
    except Exception as e:  # noqa: BLE001 - every way a provider can refuse, in one line
        from payrun.text import visible

        from payrun.errors import ConfigError

        # (not for the token file itself, its path has "token" in it: its own words say what to do)
        local = "" if cfg.email.url or isinstance(e, ConfigError) else (
            " (the local provider simulator: the one listening there is another data directory's, or one "
            "started before payrun followed a replaced token file: `supervisorctl restart provider`)"
            if "refused our token" in str(e) else " (the local provider simulator: `payrun up` starts it)")
        rep.add("email", FAIL, f"{shown}: {visible(str(e))[:300]}{local}")
        return
    rep.add("email", OK, f"{shown}: {said} (nothing was sent)")


def _slips(cfg, rep: Report, slips: int, slip_bytes: int, conn=None, worker_host: bool = False) -> None:
    from payrun import slipstore

    before = len(rep.findings)
    _store_here(cfg, rep, slips, slip_bytes)
    if conn is None:
        return
    try:
        faults = slipstore.read_faults(conn)
    except Exception:  # noqa: BLE001 - Redis away: its own check says so
        return
    failed_here = any(f.area == "slips" and f.level == FAIL for f in rep.findings[before:])
    here = slipstore._host()[0]
    for entry in faults:  # (the render workers of each host found it: a host this check cannot look at itself)
        if entry["id"] == here and failed_here or entry["id"] != here and worker_host:
            continue  # (said already by this check's own test write; a worker host checks its own part)
        rep.add("slips", FAIL, slipstore.fault_text(entry, cfg.timezone))


def _store_here(cfg, rep: Report, slips: int, slip_bytes: int) -> None:
    from payrun import slipstore

    store: Path = cfg.slips_dir
    if slipstore.not_a_directory(store) or not store.is_dir():  # (the first: is_dir raises on a store out of reach)
        rep.add("slips", FAIL, store_missing_text(store))
        return
    probe = store / f".payrun-check-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        rep.add("slips", FAIL, store_write_text(store, e, _account()))
        return
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    st = os.statvfs(store)
    free = st.f_bavail * st.f_frsize
    if slips and slip_bytes:
        level, text = disk_verdict(free, slips, slip_bytes)
        rep.add("slips", level, f"{store}: writable; {text}")
    else:
        rep.add("slips", *store_room_verdict(store, free))


def _data(cfg, rep: Report, slips: int) -> None:
    from payrun import diskspace

    free = diskspace.free_bytes(cfg.home)
    if free is not None:
        rep.add("data", *data_verdict(cfg.home, free, slips, cfg.embedded_redis))


def _account() -> str:
    """The account this process runs as (its uid's name, not $USER: sudo keeps that)."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def _estimate(cfg, conn, rep: Report, slips: int, render_s: float, live: dict[str, int] | None,
              start: datetime, by_tick: bool) -> None:
    """How long the run takes, from the limits in force, the live workers and the warm render."""
    if not slips:
        return
    cap, rate = cfg.limits.email_concurrency, cfg.limits.email_rate_per_s
    if conn is not None:
        try:
            from jobs.limits import email_limiter

            st = email_limiter(conn, cfg).settings()
            cap, rate = st.cap, st.rate_per_s
        except Exception:  # noqa: BLE001 - the config's values then
            pass
    send_s = cfg.provider.latency_s if not cfg.email.url else SEED_SEND_S
    lanes = live["lanes"] if live else cfg.email.lanes
    render_workers = live["render"] if live else cfg.render_workers
    sends = send_rate(rate, cap, lanes, send_s)
    seconds = run_seconds(slips, sends, render_s, render_workers)
    level, text = deadline_verdict(start, seconds)
    how = (f"{slips:,} slips at {sends:.1f} sends/s (limit {rate:g}/s, cap {cap}, ~{send_s:g} s a send) and "
           f"{render_workers} render worker{'s' if render_workers != 1 else ''}"
           + ("" if live else " (the config's: the live workers and limits could not be read)"))
    when = f"from the tick at {start:%Y-%m-%d %H:%M}" if by_tick else f"if started now ({start:%H:%M})"
    rep.add("estimate", level, f"{how}, {when}: {text}", {
        "slips": slips, "sends_per_s": round(sends, 2), "render_workers": render_workers,
        "start": start.isoformat(timespec="seconds"),
        "seconds": None if seconds is None else round(seconds),
        "end": None if seconds is None else (start + timedelta(seconds=seconds)).isoformat(timespec="seconds"),
        "deadline": deadline_after(start).isoformat()})
