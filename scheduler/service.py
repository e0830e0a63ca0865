"""`payrun scheduler`: rq-scheduler with a JSON job class, plus our cron pass.

Run two of them (supervisor.conf runs scheduler-a and scheduler-b, as two servers would).
Every tick still fires once:

- Each pass (every ``scheduler.poll_s``) runs under rq-scheduler's per-pass lock
  ``rq:scheduler_lock`` — an optimisation for the ordinary day, not a guarantee (it is
  taken per pass and expires under a paused process; rq-scheduler #312).
- The guarantee: for each entry a shared cursor ``payrun:cron:cursor:<entry>`` (the last
  instant a scheduler handled) gives the due ticks ``(cursor, now]`` (scheduler/cron.py
  ``plan``). A tick is enqueued only by the scheduler that wins
  ``SET payrun:cron:tick:<entry>:<stamp> claimed:<token> NX``, and only inside a
  MULTI/EXEC that WATCHes that marker — a claimer paused until its claim expired and
  another scheduler took the tick enqueues nothing. The tick job's id is deterministic
  (``tick-<entry>-<stamp>``) and it carries the time it stands for (UTC ISO).
- The tick job then takes its own lock and unique row (scheduler/ticks.py).
- A lost cursor (Redis without persistence, a FLUSHALL, a new Redis after a failover) is
  rebuilt from durable knowledge in the ledger's SQLite file, not from "now": the newest
  ``cron_runs`` row of the entry, or its registration time (``cron_entries``, written at
  a scheduler's start) when it has no row (scheduler/cron.py ``recovered_cursor``). A tick
  due meanwhile is then caught up or recorded missed as below. Only a ledger sure to be
  the one ticks are recorded in may judge (a tick was recorded in it, or its data
  directory is a control host's: scheduler/cron.py ``ledger_unsure``); a scheduler
  elsewhere leaves a lost cursor to one on the control host (its own empty ledger recorded
  a tick that ran as MISSED, or skipped one due during the outage).
- Catch-up: when no scheduler ran at a tick's time, the newest due tick within
  ``scheduler.catchup_window_s`` (6 h) fires once on return; older due ticks are recorded
  as missed (cron_runs rows via a control job, and an ERROR line here).

rq-scheduler's own ``cron()`` is not used for the entries: its cron strings follow the
host's zone, one job id is reused for every run, the job does not know which time it
stands for, missed ticks are neither caught up on purpose nor reported, and moving a job
from its sorted set to a queue is not atomic between two instances. Its sorted set and
loop still serve any job scheduled with its API (moved atomically here: ZREM first).

TEST ONLY: ``PAYRUN_CLOCK_FILE`` names a file holding epoch seconds; when set, the cron
pass reads "now" from it instead of the system clock, so a test can move time.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from redis import WatchError
from rq import Queue
from rq.serializers import JSONSerializer
from rq_scheduler import Scheduler

from jobs.runtime import HOST_ID_FIELD, OUTAGE_LOG_EVERY_S, PayrunJob, PayrunQueue, RepeatedFailure, make_queue
from payrun import keys
from payrun.procs import host_id
from payrun.config import Config
from scheduler import cron, ticks

log = logging.getLogger("payrun.scheduler")
UTC = timezone.utc

CLAIM_TTL_S = 30
"""A claimed tick not enqueued within this (the claimer died or froze) may be claimed again."""
ENTRIES_KEY = "payrun:cron:entries"
"""The entries the scheduler started last loaded (read by older versions of `payrun schedule`)."""
ENTRIES_TTL_S = 86400
"""A scheduler's own copy (``entries_key``) outlives its last beat by this much (a killed
one's copy goes by itself; only the copies of schedulers alive are read)."""
STATE_KEY = "payrun:cron:state"
MISSED_CAP = 50
"""At most this many missed-tick rows per entry per pass (the newest); the rest are counted
(the job's ``meta['unlisted']``, kept on the oldest row: `payrun schedule` counts them too,
and said "MISSED 50" of the 503 the log named)."""

_ADVANCE = """
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) return 1 end
return 0
"""
"""Move an entry's cursor forward, never back, and never make one: a cursor that Redis lost
in the middle of a pass (after this pass read it) is rebuilt from the ledger by the next
pass. Made here, at "now", it skipped a tick whose job the same loss took."""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
return 0
"""


def pass_lock_value(name: str, host: str, pid: int) -> str:
    """What a scheduler writes into rq-scheduler's pass lock: its name, host id
    (payrun.procs.host_id: a pid means a process only there) and pid, so its own restart
    can tell the lock of a dead earlier self (``own_dead_pass_lock``)."""
    return f"{name}|{host}|{pid}"


def pass_lock_holder(value: str) -> tuple[str, str | None, int | None]:
    """(name, host, pid) of a pass lock's value; a bare name (a scheduler of the version
    before) has no host or pid."""
    parts = value.split("|")
    if len(parts) == 3 and parts[2].isdigit():
        return parts[0], parts[1], int(parts[2])
    return value, None, None


def own_dead_pass_lock(value: str, name: str, host: str, pid: int, alive) -> int | None:
    """The pid of an earlier process of this very scheduler (same name, same host id, another
    pid that ``alive`` says is gone) holding the pass lock, else None (pure but for
    ``alive``). supervisord restarts a scheduler killed mid-pass under the same name within
    a second; it waited out the lock its dead self held, up to 11 s, and every tick with it."""
    held_name, held_host, held_pid = pass_lock_holder(value)
    if held_name != name or held_host != host or held_pid is None or held_pid == pid:
        return None
    return None if alive(held_pid) else held_pid



def missed_superseded(job: str, fire: datetime | None) -> bool:
    """Whether ticks missed past the catch-up window are covered by the tick fired on
    return: for a recurring check (bank-status, reaper) the newest run does what the
    missed ones would have; a pay run's tick pays one month, so its missed ones are not.
    (Two days down logged thousands of reaper ticks as ERROR "MISSED" beside the one that
    ran, and `payrun schedule` listed them as if something was left to do.)"""
    return fire is not None and job != "payroll"


def missed_is_error(job: str) -> bool:
    """Whether a missed tick is an ERROR (pure): only a pay run's, whose month someone must
    run by hand. A recurring check's (bank-status, reaper) missed tick is a WARNING whether or
    not a tick fired in the same pass: its next tick does the same work. (A scheduler down
    a few minutes logged ERROR "MISSED" for a reaper tick and woke the on-call for nothing.)"""
    return job == "payroll"


def entry_record(e: cron.Entry, zone: str) -> dict[str, str]:
    """What a running scheduler says it loaded for one entry (ENTRIES_KEY): what `payrun
    schedule` compares with the config file."""
    return {"cron": e.cron, "job": e.job, "zone": zone}


def window_text(seconds: float) -> str:
    """A catch-up window as people write it: 60 s, 15 min, 6 h (it printed 0.0166667 h)."""
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"


def entries_key(scheduler: str) -> str:
    """The entries one scheduler loaded at its start: during a deploy two schedulers can
    run two schedules, and `payrun schedule` names the one still on the old file."""
    return f"{ENTRIES_KEY}:{scheduler}"


def cursor_key(entry: str) -> str:
    return f"payrun:cron:cursor:{entry}"


def marker_key(entry: str, stamp: str) -> str:
    return f"payrun:cron:tick:{entry}:{stamp}"


# ---- the clock -------------------------------------------------------------------------

def clock() -> datetime:
    """Now, in UTC. TEST ONLY override: PAYRUN_CLOCK_FILE holding epoch seconds."""
    path = os.environ.get("PAYRUN_CLOCK_FILE")
    if path:
        for _ in range(50):  # the test rewrites the file; a torn read is retried
            try:
                return datetime.fromtimestamp(float(open(path).read().strip()), UTC)
            except (ValueError, OSError):
                time.sleep(0.01)
        raise RuntimeError(f"PAYRUN_CLOCK_FILE {path} does not hold epoch seconds")
    return datetime.now(UTC)


# ---- the durable side of the cursor ----------------------------------------------------

class LedgerMemory:
    """What outlives Redis: the ledger's SQLite file (scheduler/store.py) on the control
    host. Opened per call (only at a scheduler's start and while a cursor is lost), so a
    scheduler holds no SQLite connection in its loop."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.unsure: str | None = None
        """Why the last ``facts`` had no answer (cron.ledger_unsure)."""

    def role(self) -> str | None:
        """What `payrun up` wrote to this data directory's supervisor.role (None: never run here)."""
        path = self.cfg.home / "supervisor.role"
        try:
            return path.read_text().strip() if path.exists() else None
        except OSError:
            return None

    def available(self) -> bool:
        """False on a worker host (``payrun up --role worker``) with no ledger: opening one
        there would make an empty ledger, and an empty ledger says "start from now"."""
        return self.cfg.ledger_path.exists() or self.role() != "worker"

    def register(self, entries: list[str], now: datetime) -> None:
        if not self.available():
            return
        from scheduler.store import Store

        store = Store(self.cfg.ledger_path)
        try:
            store.register_entries(entries, cron.iso(now))
        finally:
            store.close()

    def ledger_here(self, conn) -> bool:
        """The `payrun ledger` applying the workers' events runs on this host, on this
        ledger file (its lease, keys.LEDGER_OWNER: "host pid path")."""
        from payrun.ledger import events_owner, owned_here

        if conn is None:
            return False
        try:
            owner = events_owner(conn)
        except Exception:  # noqa: BLE001 - Redis away: not sure
            return False
        return owned_here(owner, self.cfg.ledger_path)

    def facts(self, entry: str, conn=None) -> tuple[datetime | None, datetime | None] | None:
        """(registered_at, newest tick with a row) of an entry; None when this host's ledger
        cannot tell which ticks ran (``self.unsure`` says why): no ledger here, or one that
        is not sure to be the control host's (cron.ledger_unsure). ``conn``: the Redis whose
        ledger lease says whether this host's ledger is the one applying events."""
        role, exists = self.role(), self.cfg.ledger_path.exists()
        here = exists and self.ledger_here(conn)
        self.unsure = None
        if not exists:  # (no file: no tick recorded; a file is made only where it could be the ledger)
            self.unsure = cron.ledger_unsure(role, self.cfg.embedded_redis, False, False)
            if self.unsure is not None:
                return None
        from scheduler.store import Store

        store = Store(self.cfg.ledger_path)
        try:
            self.unsure = cron.ledger_unsure(role, self.cfg.embedded_redis, True, store.ticks_recorded(), here)
            if self.unsure is not None:
                return None
            reg, newest = store.recovery_facts(entry)
        finally:
            store.close()
        return (cron.from_iso(reg) if reg else None), (cron.from_iso(newest) if newest else None)


# ---- the cron pass ---------------------------------------------------------------------

class CronPass:
    """One scheduler's view of the cron entries; ``run(now)`` is one pass."""

    def __init__(self, conn, cfg: Config, name: str | None = None, memory: LedgerMemory | None = None):
        self.conn = conn
        self.memory = memory if memory is not None else LedgerMemory(cfg)
        self._no_memory_logged: set[str] = set()
        self.cfg = cfg
        self.zone = ZoneInfo(cfg.timezone)
        self.entries = cron.load_entries(cfg.scheduler.entries)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.window_s = float(cfg.scheduler.catchup_window_s)
        self.marker_ttl_s = int(max(self.window_s, 3600) + 86400)
        self.control = make_queue(keys.CONTROL_QUEUE, conn)
        self._started: datetime | None = None
        """When this scheduler registered its entries (``register``)."""
        self._seen_cursor: set[str] = set()
        """Entries whose cursor this scheduler has read: a cursor missing after that was lost."""

    def register(self, now: datetime) -> None:
        """Write the entries (and their next times) to Redis for `payrun schedule`."""
        if self._started is None:
            self._started = now
        records = {e.name: json.dumps(entry_record(e, self.cfg.timezone)) for e in self.entries}
        with self.conn.pipeline() as pipe:
            for key in (ENTRIES_KEY, entries_key(self.name)):
                pipe.delete(key)
                if records:
                    pipe.hset(key, mapping=records)
            pipe.expire(entries_key(self.name), ENTRIES_TTL_S)
            pipe.execute()
        try:  # each entry's registration time: where its cursor starts again if Redis loses it
            self.memory.register([e.name for e in self.entries], now)
        except Exception:
            log.exception("scheduler %s: could not record the entries in the ledger", self.name)

    def keep_registered(self, now: datetime) -> None:
        """Renew this scheduler's copy of its entries (each beat); written again if it is
        gone (Redis lost it, or it lapsed while Redis was away)."""
        if not self.conn.expire(entries_key(self.name), ENTRIES_TTL_S) and self.entries:
            self.register(now)

    def unregister(self) -> None:
        self.conn.delete(entries_key(self.name))

    def run(self, now: datetime) -> list[dict[str, Any]]:
        actions: list[dict[str, Any]] = []
        for e in self.entries:
            try:
                actions.extend(self._entry(e, now))
            except Exception:  # one entry's trouble must not stop the others
                log.exception("cron %s: pass failed", e.name)
        self.conn.hset(STATE_KEY, mapping={"last_pass": now.isoformat(), "last_pass_by": self.name})
        return actions

    def _cursor(self, e: cron.Entry, now: datetime) -> datetime | None:
        """The entry's shared cursor; when Redis has none, rebuilt from the ledger (None:
        this host's ledger cannot tell, the entry is left to a scheduler whose ledger can)."""
        key = cursor_key(e.name)
        raw = self.conn.get(key)
        if raw is not None:
            self._no_memory_logged.discard(e.name)  # (said again if Redis loses it again)
            self._seen_cursor.add(e.name)
        else:
            start = self._recover(e, now)
            if start is None:
                return None
            self.conn.set(key, repr(start.timestamp()), nx=True)  # two schedulers: the first one's stands
            raw = self.conn.get(key)
            if raw is None:
                return None
            self._seen_cursor.add(e.name)
        return datetime.fromtimestamp(float(raw), UTC)

    def _recover(self, e: cron.Entry, now: datetime) -> datetime | None:
        """Where a missing cursor starts again: never simply "now" (a pay-run tick due while
        Redis was away was skipped without a word), but from the ledger."""
        facts = self.memory.facts(e.name, self.conn)
        if facts is None:  # judging from a ledger that is not the ticks' recorded a false MISSED, or skipped one
            if e.name not in self._no_memory_logged:
                self._no_memory_logged.add(e.name)
                log.error("cron %s: no cursor in Redis, and %s: left to a scheduler on the control host, which "
                          "catches due ticks up or records them missed (is one running? `supervisorctl start "
                          "scheduler-a scheduler-b` there)", e.name, self.memory.unsure or "no ledger on this host")
            return None
        registered_at, newest = facts
        start = cron.recovered_cursor(now, registered_at, newest)
        if (newest is None and registered_at is not None and self._started is not None
                and e.name not in self._seen_cursor and registered_at >= self._started.replace(microsecond=0)):
            # the entry's very first start (registered by this start, no row): nothing was
            # lost — a fresh install logged "no cursor in Redis (lost, flushed or a new Redis)"
            log.info("cron %s: first start of this entry: ticks from %s on (no backfill)", e.name, self._both(start))
        elif start < now:
            source = "its newest tick row" if newest is not None else "its registration"
            log.warning("cron %s: no cursor in Redis (lost, flushed or a new Redis): resuming from %s (%s in "
                        "the ledger); ticks due since fire within the catch-up window or are recorded missed",
                        e.name, self._both(start), source)
        return start

    def _entry(self, e: cron.Entry, now: datetime) -> list[dict[str, Any]]:
        cursor = self._cursor(e, now)
        if cursor is None or cursor >= now:
            return []
        p = cron.plan(e.spec, self.zone, cursor, now, self.window_s)
        actions: list[dict[str, Any]] = []
        advance_to = now
        if p.missed:
            actions.append(self._record_missed(e, p.missed, now, superseded=missed_superseded(e.job, p.fire)))
        if p.fire is not None:
            outcome = self.fire(e, p.fire, coalesced=len(p.coalesced), now=now)
            actions.append({"entry": e.name, "tick": cron.iso(p.fire), "outcome": outcome})
            if outcome in ("claimed-elsewhere", "lost", "error"):
                # not known to be enqueued: keep the cursor before it, look again next pass
                advance_to = p.fire - timedelta(seconds=1)
        if advance_to > cursor:
            self.conn.eval(_ADVANCE, 1, cursor_key(e.name), repr(advance_to.timestamp()))
        return actions

    def _claim_and_enqueue(self, marker: str, enqueue) -> str:
        """'fired' | 'done-elsewhere' | 'claimed-elsewhere' | 'lost' | 'error'."""
        token = f"claimed:{self.name}:{uuid.uuid4().hex[:8]}"
        if not self.conn.set(marker, token, nx=True, ex=CLAIM_TTL_S):
            held = self.conn.get(marker) or b""
            return "claimed-elsewhere" if held.startswith(b"claimed:") else "done-elsewhere"
        try:
            with self.conn.pipeline() as pipe:
                pipe.watch(marker)
                held = pipe.get(marker)
                if (held.decode() if isinstance(held, bytes) else held) != token:
                    return "lost"
                pipe.multi()
                enqueue(pipe)
                pipe.set(marker, f"fired:{self.name}", ex=self.marker_ttl_s)
                pipe.execute()
                return "fired"
        except WatchError:
            return "lost"
        except Exception:
            log.exception("enqueue under %s failed", marker)
            return "error"

    def fire(self, e: cron.Entry, t: datetime, coalesced: int = 0, now: datetime | None = None) -> str:
        """Enqueue tick ``t`` once; ``now``: the pass's clock (how late it is; default the clock)."""
        st = cron.stamp(t)
        scheduled_for = cron.iso(t)
        options: dict[str, Any] = {"coalesced": coalesced}
        if e.job == "payroll":
            options["month"] = e.month

        def enqueue(pipe) -> None:
            self.control.enqueue_call(
                "scheduler.ticks.run_tick", args=(e.name, e.job, scheduled_for, options),
                job_id=ticks.tick_job_id(e.name, st), timeout=int(self.cfg.scheduler.tick_timeout_s),
                result_ttl=7 * 24 * 3600, failure_ttl=30 * 24 * 3600,
                description=f"cron tick {e.name} {scheduled_for} ({e.cron} {self.cfg.timezone})",
                meta={"kind": "tick", "entry": e.name, "scheduled_for": scheduled_for, "scheduler": self.name},
                pipeline=pipe,
            )

        outcome = self._claim_and_enqueue(marker_key(e.name, st), enqueue)
        if outcome == "fired":
            late = ((now or clock()) - t).total_seconds()  # (the pass's clock: it read the system's)
            (log.warning if coalesced or late > 120 else log.info)(
                "cron %s: tick %s enqueued (%s)%s", e.name, self._both(t), ticks.tick_job_id(e.name, st),
                f"; caught up {late / 60:.0f} min late, {coalesced} earlier tick(s) superseded" if late > 120 else "")
        elif outcome in ("lost", "error"):
            log.warning("cron %s: tick %s: %s", e.name, scheduled_for, outcome)
        return outcome

    def _record_missed(self, e: cron.Entry, missed: list[datetime], now: datetime,
                       superseded: bool = False) -> dict[str, Any]:
        newest = missed[-1]
        shown = missed[-MISSED_CAP:]
        detail = (f"no scheduler was running at the tick's time and none came back within the "
                  f"{window_text(self.window_s)} catch-up window (back at {now.astimezone(self.zone):%Y-%m-%d %H:%M %Z})")
        if len(missed) > len(shown):
            detail += f"; {len(missed) - len(shown)} older tick(s) not listed"
        if superseded:
            detail += "; the tick fired on return does their work: nothing to do"
        elif not missed_is_error(e.job):
            detail += "; the next tick does their work: nothing to do"
        if e.job == "payroll":
            months = sorted({cron.pay_month(t, self.zone, e.month) for t in missed})
            detail += "; run it by hand: " + ", ".join(f"payrun run --month {m}" for m in months)

        def enqueue(pipe) -> None:
            self.control.enqueue_call(
                "scheduler.ticks.record_not_run", args=(e.name, e.job, [cron.iso(t) for t in shown], "missed", detail),
                job_id=f"missed-{e.name}-{cron.stamp(newest)}", timeout=60, result_ttl=7 * 24 * 3600,
                failure_ttl=30 * 24 * 3600, meta={"kind": "tick", "unlisted": len(missed) - len(shown)},
                description=f"record missed ticks of {e.name}",
                pipeline=pipe,
            )

        outcome = self._claim_and_enqueue(marker_key(e.name, "missed-" + cron.stamp(newest)), enqueue)
        if outcome == "fired":
            (log.error if missed_is_error(e.job) else log.warning)(
                "cron %s: MISSED %d tick(s), newest %s: %s", e.name, len(missed), self._both(newest), detail)
        return {"entry": e.name, "missed": [cron.iso(t) for t in missed], "outcome": outcome}

    def _both(self, t: datetime) -> str:
        return f"{t.astimezone(self.zone):%Y-%m-%d %H:%M %Z} / {t.astimezone(UTC):%H:%M} UTC"

    def next_fire(self, e: cron.Entry, now: datetime) -> datetime:
        return cron.next_after(e.spec, self.zone, now)


# ---- rq-scheduler, JSON, atomic moves, our pass -----------------------------------------

class JSONQueue(PayrunQueue):
    """JSON and PayrunJob even when rq-scheduler passes ``serializer=None`` explicitly
    (``Queue.from_queue_key`` does: ``setdefault`` kept the None, i.e. pickle)."""


class PayrunScheduler(Scheduler):
    """rq-scheduler's loop with a JSON job class, an owner-checked pass lock, an atomic
    move out of its sorted set, and the cron pass of every entry in each pass."""

    job_class = PayrunJob
    queue_class = JSONQueue

    def __init__(self, cfg: Config, connection, name: str | None = None):
        name = name or f"{socket.gethostname()}.{os.getpid()}"
        super().__init__(queue_name=keys.CONTROL_QUEUE, interval=cfg.scheduler.poll_s, connection=connection,
                         job_class=PayrunJob, queue_class=JSONQueue, name=name)
        self.cron = CronPass(connection, cfg, name=name)
        self._stopping = False
        self.outage = RepeatedFailure(OUTAGE_LOG_EVERY_S)
        """A failing pass (Redis away) is logged at once, then every 30 s, and "back" once:
        each scheduler logged "pass failed" every poll (every second) while Redis was away."""

    def register_birth(self) -> None:
        """As rq-scheduler's, but a restart under the same name (supervisord restarting
        scheduler-a after a crash) takes over the stale record instead of refusing. The
        record also says this host's id (payrun.procs.host_id): a live record of another
        machine under this name (two control hosts with one hostname: supervisor.conf names
        them scheduler-a.<hostname>) is not taken over, this one registers as
        ``<name>.<host id>`` instead (both went on under one record: `payrun schedule` and
        `payrun check` counted one scheduler of two, and each could release the other's
        pass lock)."""
        theirs = self.connection.hmget(self.key, "death", "birth", HOST_ID_FIELD)
        if theirs[0] is None and theirs[1] is not None and theirs[2] not in (None, host_id().encode()):
            log.warning("scheduler %s: a live scheduler of another machine or container with this hostname "
                        "(host id %s) has this name: this one is %s.%s (give each host its own hostname)",
                        self.name, theirs[2].decode(), self.name, host_id())
            self.name = self.cron.name = f"{self.name}.{host_id()}"
        if self.connection.exists(self.key) and not self.connection.hexists(self.key, "death"):
            log.warning("scheduler %s: a record under this name is still alive in Redis; taking it over", self.name)
            self.connection.hset(self.key, "death", time.time())
        super().register_birth()
        self.connection.hset(self.key, HOST_ID_FIELD, host_id())

    def heartbeat(self) -> None:
        """rq-scheduler's EXPIRE of this scheduler's record, and the record made again when it
        is gone: it lapsed while Redis was away (10 s past the poll interval), and `payrun
        schedule` said "schedulers alive: 0" of two schedulers firing ticks, until restarted."""
        if not self.connection.expire(self.key, int(self._interval) + 10):
            with self.connection.pipeline() as p:
                p.hset(self.key, mapping={"birth": time.time(), HOST_ID_FIELD: host_id()})
                p.expire(self.key, int(self._interval) + 10)
                p.execute()
        self.cron.keep_registered(clock())

    def acquire_lock(self) -> bool:
        from payrun.procs import pid_alive

        from payrun.procs import host_id

        mine = pass_lock_value(self.name, host_id(), os.getpid())
        ttl = int(self._interval) + 10
        self._lock_acquired = bool(self.connection.set(self.scheduler_lock_key, mine, nx=True, ex=ttl))
        if not self._lock_acquired:
            held = self.connection.get(self.scheduler_lock_key)
            held = held.decode(errors="replace") if held is not None else None
            dead = held and own_dead_pass_lock(held, self.name, host_id(), os.getpid(), pid_alive)
            if dead and self.connection.eval(_TAKE_OVER, 1, self.scheduler_lock_key, held, mine, ttl):
                log.info("scheduler %s: took over the pass lock its earlier process (pid %d, gone) held",
                         self.name, dead)
                self._lock_acquired = True
        return self._lock_acquired

    def remove_lock(self) -> None:
        if self._lock_acquired:
            from payrun.procs import host_id

            self.connection.eval(_RELEASE, 1, self.scheduler_lock_key, pass_lock_value(self.name, host_id(), os.getpid()))
            self._lock_acquired = False

    def get_jobs_to_queue(self, with_times: bool = False):
        return self.get_jobs(clock().replace(tzinfo=None), with_times=with_times)

    def enqueue_job(self, job) -> None:
        """Move a due job from the sorted set to its queue — only the instance whose ZREM
        removed it (rq-scheduler's own move can enqueue a job twice from two instances)."""
        if not self.connection.zrem(self.scheduled_jobs_key, job.id):
            return
        super().enqueue_job(job)

    def get_queue_for_job(self, job):
        """Always our JSON queue: rq-scheduler would import whatever class a job's
        ``meta['queue_class_name']`` (a value in Redis) names."""
        return self.queue_class.from_queue_key(self.queue_class.redis_queue_namespace_prefix + job.origin,
                                               connection=self.connection, job_class=self.job_class)

    def enqueue_jobs(self):
        self.cron.run(clock())
        return list(super().enqueue_jobs())

    def _install_signal_handlers(self) -> None:
        def stop(signum, frame):
            self._stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)

    def run(self, burst: bool = False) -> None:
        self.register_birth()
        self._install_signal_handlers()
        now = clock()
        self.cron.register(now)
        for e in self.cron.entries:
            log.info("cron %s: '%s' (%s) runs %s; next %s", e.name, e.cron, self.cron.cfg.timezone, e.job,
                     self.cron._both(self.cron.next_fire(e, now)))
        log.info("scheduler %s: polling every %g s, catch-up window %s", self.name, self._interval,
                 window_text(self.cron.window_s))
        try:
            while not self._stopping:
                started = time.monotonic()
                try:
                    self.heartbeat()
                    if self.acquire_lock():
                        try:
                            self.enqueue_jobs()
                        finally:
                            self.remove_lock()
                    if (line := self.outage.ok(time.monotonic())) is not None:
                        log.warning("scheduler %s: passes work again: %s", self.name, line)
                    if burst:
                        break
                except Exception as e:  # Redis blip: keep going, ticks are not lost (cursor)
                    if (line := self.outage.failed(time.monotonic(), e)) is not None:
                        log.warning("scheduler %s: pass failed: %s", self.name, line)
                while not self._stopping and time.monotonic() - started < self._interval:
                    time.sleep(min(0.05, self._interval))
        finally:
            try:
                self.remove_lock()
                self.register_death()
                self.cron.unregister()
            except Exception:
                pass
            log.info("scheduler %s: stopped", self.name)
