"""Global limits shared by every worker on every host, kept in Redis.

One named resource (``email``) has
- a concurrency cap: a sorted set of holders scored by lease expiry. A slot held by a
  killed worker frees itself when its lease runs out, so nothing leaks;
- a rate limit: each send *reserves* the next start time (GCRA without burst: starts
  spaced 1/rate apart across all hosts), then sleeps until it. No caller polls, so 45
  waiting lanes cost one script call per send, not one per wake-up. Starts are paced at
  96% of the limit (RATE_HEADROOM): a thread wakes a little late now and then, and the
  provider counts arrivals, not our schedule;
- a pause: when the provider answers 429 with Retry-After, every sender stops until then.
Each decision is one Lua script using Redis's clock (hosts' clocks may differ).

The values in force live in the hash ``payrun:limit:<name>`` (fields ``cap``,
``rate_per_s``) so they can be changed while running (`payrun limits set`); a worker
seeds them from its config with HSETNX at start.

Lanes take a slot *before* they dequeue, so a job never waits for a slot while
holding a worker or its lease, and waiting never spends a retry attempt.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from payrun import keys

RATE_HEADROOM = 0.96
"""Sends start at 96% of the configured rate: 40 ms of slack per second for threads that
wake late and requests that take longer to leave. Measured with bench/email.py, 2,000
sends, cap 48, against a provider counting arrivals in a rolling second: at 99% and at
97.5% a few late threads drew 429s (49 of them at 97.5%, each pausing every sender for a
second: 0.50 of the limit); at 96%, 0 429s and 0.96 of the limit."""

_ACQUIRE_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pause = tonumber(redis.call('GET', KEYS[3]) or '0')
if pause > now then return {0, pause - now} end
local cap = tonumber(redis.call('HGET', KEYS[2], 'cap') or ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= cap then
  return {0, 200}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return {1, 0}
"""

_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local pause = tonumber(redis.call('GET', KEYS[3]) or '0')
if pause > now then return {0, tostring(pause - now)} end
local rate = tonumber(redis.call('HGET', KEYS[2], 'rate_per_s') or ARGV[1]) * tonumber(ARGV[2])
local interval = 1000.0 / rate
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
redis.call('SET', KEYS[1], tostring(tat + interval), 'PX', math.ceil(tat + interval - now) + 10000)
return {1, tostring(tat - now)}
"""

_PAUSE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local untl = now + tonumber(ARGV[1])
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if untl > cur then redis.call('SET', KEYS[1], untl, 'PX', tonumber(ARGV[1])) end
redis.call('HINCRBY', KEYS[2], 'http_429', 1)
return untl
"""


@dataclass(frozen=True)
class Settings:
    cap: int
    rate_per_s: float


class Limiter:
    """The limits of one resource. Thread-safe: lanes of one process share it."""

    def __init__(self, conn, name: str, cap: int, rate_per_s: float, lease_s: float):
        self.conn = conn
        self.name = name
        self.default_cap = cap
        self.default_rate = rate_per_s
        self.lease_ms = int(lease_s * 1000)
        self.k_slots = keys.limit_slots(name)
        self.k_conf = keys.limit_conf(name)
        self.k_tat = keys.limit_tat(name)
        self.k_pause = keys.limit_pause(name)
        self.k_stats = keys.limit_stats(name)
        self._acquire = conn.register_script(_ACQUIRE_SLOT)
        self._reserve = conn.register_script(_RESERVE)
        self._pause = conn.register_script(_PAUSE)
        self._waits = 0
        self._lock = threading.Lock()

    def seed(self) -> None:
        """Write this config's values unless someone already set them (at run time)."""
        self.conn.hsetnx(self.k_conf, "cap", self.default_cap)
        self.conn.hsetnx(self.k_conf, "rate_per_s", self.default_rate)

    def settings(self) -> Settings:
        raw = self.conn.hgetall(self.k_conf)
        get = lambda f, d: float(raw.get(f.encode(), raw.get(f, d)))  # noqa: E731
        return Settings(cap=int(get("cap", self.default_cap)), rate_per_s=get("rate_per_s", self.default_rate))

    # ---- concurrency --------------------------------------------------------------
    def try_slot(self, holder: str) -> tuple[bool, int]:
        ok, wait_ms = self._acquire(keys=[self.k_slots, self.k_conf, self.k_pause],
                                    args=[holder, self.default_cap, self.lease_ms])
        return bool(ok), int(wait_ms)

    def slot(self, stop: threading.Event | None = None, holder: str | None = None) -> str | None:
        """Block until a slot is ours; returns its holder id (None if ``stop`` was set)."""
        holder = holder or uuid.uuid4().hex
        waited = False
        while True:
            ok, wait_ms = self.try_slot(holder)
            if ok:
                if waited:
                    self._count_wait()
                return holder
            waited = True
            if stop is not None and stop.wait(min(wait_ms, 500) / 1000):
                return None
            if stop is None:
                time.sleep(min(wait_ms, 500) / 1000)

    def release(self, holder: str) -> None:
        self.conn.zrem(self.k_slots, holder)

    def in_use(self) -> int:
        """Slots held now (expired leases not counted). Reads only."""
        sec, usec = self.conn.time()  # not EVAL: a read-only user may run this
        now_ms = int(sec) * 1000 + int(usec) // 1000
        return int(self.conn.zcount(self.k_slots, now_ms, "+inf"))

    # ---- rate -------------------------------------------------------------------
    def token(self, deadline_s: float | None = None) -> bool:
        """Block until this send may start: its reserved start time, after any 429 pause.
        False if that would be after ``deadline_s`` (time.monotonic())."""
        waited = False
        while True:
            ok, wait_ms = self._reserve(keys=[self.k_tat, self.k_conf, self.k_pause],
                                        args=[self.default_rate, RATE_HEADROOM])
            wait_s = float(wait_ms) / 1000
            if deadline_s is not None and time.monotonic() + wait_s > deadline_s:
                return False
            if wait_s > 0.001:
                waited = True
                time.sleep(wait_s)
            if not int(ok):
                continue  # it was a pause: reserve again now that it is over
            if waited and self.conn.exists(self.k_pause):
                continue  # a 429 arrived while we slept: our reservation is void
            if waited:
                self._count_wait()
            return True

    def pause(self, seconds: float) -> None:
        """Every sender on every host waits ``seconds`` (a provider's Retry-After). The key
        lives exactly that long, so "paused" is simply "the key exists"."""
        self._pause(keys=[self.k_pause, self.k_stats], args=[int(seconds * 1000)])

    def _count_wait(self) -> None:
        try:
            self.conn.hincrby(self.k_stats, "waits", 1)
        except Exception:
            pass

    def stats(self) -> dict[str, int]:
        raw = self.conn.hgetall(self.k_stats)
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def set_limits(conn, name: str, cap: int | None = None, rate_per_s: float | None = None) -> None:
    """Change a limit while running; every worker reads it on its next acquire."""
    mapping = {}
    if cap is not None:
        mapping["cap"] = int(cap)
    if rate_per_s is not None:
        mapping["rate_per_s"] = float(rate_per_s)
    if mapping:
        conn.hset(keys.limit_conf(name), mapping=mapping)


def email_limiter(conn, cfg) -> Limiter:
    return Limiter(conn, "email", cfg.limits.email_concurrency, cfg.limits.email_rate_per_s,
                   lease_s=cfg.email.timeout_s + 15)
