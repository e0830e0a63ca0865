"""Global limits shared by every worker on every host, kept in Redis.

One named resource (``email``) has
- a concurrency cap: a sorted set of holders scored by lease expiry. A slot held by a
  killed worker frees itself when its lease runs out, so nothing leaks;
- a rate limit in two steps. Each send *reserves* the next start time (GCRA without
  burst: starts spaced 1/rate apart across all hosts, at RATE_HEADROOM of the limit),
  then sleeps until it: no caller polls, so 45 waiting lanes cost one script call per
  send. Then, awake, it passes the *send gate*: a rolling window of the moments sends
  actually started (a sorted set), which lets a send go only while fewer than the
  limit started in the last 1 s + a margin. The provider counts arrivals in a rolling
  second, not our schedule: a sender that woke late, followed by one on time, would put
  41 arrivals in one second (measured: 429s in 6 of 7 runs of 2,000 sends paced at
  97.5% without the gate, each stopping every sender for a second). The gate's window
  is the provider's second plus a margin for the jitter between our clock stamp and
  the provider's. The margin tunes itself: 20 ms, widened by 20 ms at each 429 (up to
  100 ms), narrowed back by 10 ms a minute; the schedule slows with it so that senders do
  not queue at the gate (``jobs.policy.gate_margin_ms``, ``paced_rate``). For the first
  2 s after an idle spell the margin is at least 100 ms: a run's first requests reach
  the provider late (cold code, fresh threads, a busy host) (``gate_window_ms``);
- a pause: when the provider answers 429 with Retry-After, every sender stops until then;
- an outage pause: when the provider fails ``limits.outage_after`` sends in a row (5xx,
  connections refused or dropped, timeouts) every sender stops for outage_pause_s, then
  the cap is 1 (one send probes the provider) until a send succeeds; each failed probe
  pauses again, twice as long (``jobs.policy.outage_pause_s``). Sends held back by it
  spend no attempt (ProviderDown): only the failures before the pause do.
Each decision is one Lua script using Redis's clock (hosts' clocks may differ).

The values in force live in the hash ``payrun:limit:<name>`` (fields ``cap``,
``rate_per_s``) so they can be changed while running (`payrun limits set`). A send-email
process writes its config's values there at start, except a value an operator set
(`payrun limits set`, the console: ``<field>_set_at`` says when), which stays until
`payrun limits reset`; the config's values are kept beside it (``config_<field>``), so
`payrun limits show` can say which applies. (Up to session 24 the first start's values
stayed for good: a config edit never applied, and an incident's override outlived it.)

Lanes take a slot *before* they dequeue, so a job never waits for a slot while
holding a worker or its lease, and waiting never spends a retry attempt. Under a low rate
a slot is also refused while the start its holder would get lies beyond most of a send's
wait for its start (``jobs.policy.slot_wait_for_rate_ms``): the lanes taking jobs follow
the rate, and a job waits its turn in the queue, not in held tries.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from typing import Any
from dataclasses import dataclass

from jobs.policy import (GATE_FIT, GATE_MARGIN_DECAY_MS_PER_S, GATE_MARGIN_MAX_MS, GATE_MARGIN_MIN_MS,
                         GATE_MARGIN_STEP_MS, GATE_WARMUP_MARGIN_MS, GATE_WARMUP_MS, START_WAIT_FIT,
                         gate_margin_ms, late_for_gate, paced_rate, slots_for_rate, start_wait_budget_s)
from jobs.policy import outage_pause_s as outage_pause_s_for
from payrun import keys
from redis.exceptions import ConnectionError as RedisConnectionError

RATE_HEADROOM = 0.975
"""Sends are scheduled at 97.5% of the configured rate (or slower, see paced_rate); the
send gate (below) absorbs the threads that wake late."""

# The gate's margin in force, as jobs.policy.gate_margin_ms computes it. KEYS[4] = the
# gate hash; ARGV[4..6] = min, max, decay per ms.
_MARGIN = """
local function margin(now)
  local g = redis.call('HMGET', KEYS[4], 'margin_ms', 'at_ms')
  local lo, hi = tonumber(ARGV[4]), tonumber(ARGV[5])
  local m = tonumber(g[1] or lo) - math.max(0, now - tonumber(g[2] or '0')) * tonumber(ARGV[6])
  if m < lo then m = lo end
  if m > hi then m = hi end
  return m
end
"""

# The margin for a start at ``at``: the warm-up margin (ARGV[7]) if the gate is idle (no
# start in ``sends`` within the widest window: its warm-up begins with this start) or was
# idle less than ARGV[8] ms before ``at`` (the gate hash's busy_ms), else ``m``. Also says
# whether the gate was idle. jobs.policy.gate_window_ms; needs _MARGIN's KEYS[4].
_WARM = """
local function warm_margin(sends, now, at, m)
  local warm = math.max(m, tonumber(ARGV[7]))
  local idle = redis.call('ZCOUNT', sends, now - 1000.0 - warm, '+inf') == 0
  local busy = at
  if not idle then busy = tonumber(redis.call('HGET', KEYS[4], 'busy_ms') or '0') end
  if at - busy < tonumber(ARGV[8]) then return warm, idle end
  return m, idle
end
"""

# KEYS: slots, conf, pause, outage, tat; ARGV: holder, default cap, lease ms, a slot this
# holder's lane gives back first ('' for none), (the job key prefix: _ACQUIRE_SLOT_AND_TAKE),
# then for the rate: default rate, headroom, gate fit, the gate's widest margin (ms), and
# the furthest start a new holder may be given (ms; '' for no such check). After an outage
# pause the cap is 1 (one send probes the provider) until a send succeeds. Under the cap, a
# slot is refused while the start its holder could get (the schedule's lead, plus one
# interval per slot already held, each of which may reserve first) is further off than
# that: jobs.policy.slot_wait_for_rate_ms, the interval at paced_rate with the widest
# margin. {1, 0} a slot; {0, wait ms} none.
_ACQUIRE_SLOT = """
if ARGV[4] and ARGV[4] ~= '' then redis.call('ZREM', KEYS[1], ARGV[4]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pause = tonumber(redis.call('GET', KEYS[3]) or '0')
if pause > now then return {0, pause - now} end
local cap = tonumber(redis.call('HGET', KEYS[2], 'cap') or ARGV[2])
if redis.call('HEXISTS', KEYS[4], 'trips') == 1 then cap = 1 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= cap then
  return {0, 200}
end
if ARGV[10] and ARGV[10] ~= '' then
  local limit = tonumber(redis.call('HGET', KEYS[2], 'rate_per_s') or ARGV[6])
  local rate = math.min(limit * tonumber(ARGV[7]),
                        math.max(1, math.floor(limit)) * 1000.0 / (1000.0 + tonumber(ARGV[9])) * tonumber(ARGV[8]))
  if rate > 0 then
    local ahead = tonumber(redis.call('GET', KEYS[5]) or '0') - now
    local over = math.max(0, ahead) + held * 1000.0 / rate - tonumber(ARGV[10])
    if over > 0 then return {0, math.max(100, math.ceil(over))} end
  end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return {1, 0}
"""

# A slot, then a job: KEYS as _ACQUIRE_SLOT's, then a queue and its intermediate list;
# ARGV as _ACQUIRE_SLOT's (ARGV[5]: the job key prefix). After the slot, RQ's non-blocking
# dequeue of one queue (LMOVE into the intermediate list, HGETALL of the job) in the same
# script: {1, 0, id, hash} taken (an empty hash: the job expired meanwhile, which RQ's
# dequeue skips); {2, 0} the queue was empty, the slot given back; {0, wait ms} no slot.
_ACQUIRE_SLOT_AND_TAKE = _ACQUIRE_SLOT.replace("return {1, 0}\n", """local id = redis.call('LMOVE', KEYS[6], KEYS[7], 'LEFT', 'RIGHT')
if not id then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return {2, 0}
end
return {1, 0, id, redis.call('HGETALL', ARGV[5] .. id)}
""")
assert _ACQUIRE_SLOT_AND_TAKE != _ACQUIRE_SLOT

# KEYS: tat, conf, pause, gate hash, sends, outage; ARGV: default rate, headroom, gate fit
# (jobs.policy.paced_rate), then _MARGIN's, the warm-up margin and its length (ms). The
# pace fits the gate's window at the reserved time, the warm-up's included, so that
# senders do not queue at the gate (a sliding window repeats a delay it once imposed).
# ARGV[9]: the longest wait the caller takes (ms; '' for any): a start later than that is
# not reserved, so that the schedule does not move for a send that will not happen
# (callers that gave up after reserving pushed it further each try: at a rate lowered to
# 3/s, 50 lanes ran it out hours ahead and sending stopped for good).
# {1, wait ms} reserved; {0, wait ms, 1 if an outage pause} paused; {2, wait ms} too far
_RESERVE = _MARGIN + _WARM + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local pause = tonumber(redis.call('GET', KEYS[3]) or '0')
if pause > now then return {0, tostring(pause - now), redis.call('HEXISTS', KEYS[6], 'trips')} end
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local m = warm_margin(KEYS[5], now, tat, margin(now))
local limit = tonumber(redis.call('HGET', KEYS[2], 'rate_per_s') or ARGV[1])
local rate = limit * tonumber(ARGV[2])
local gate_rate = math.max(1, math.floor(limit)) * 1000.0 / (1000.0 + m) * tonumber(ARGV[3])
if gate_rate < rate then rate = gate_rate end
local interval = 1000.0 / rate
if ARGV[9] ~= '' and tat - now > tonumber(ARGV[9]) then return {2, tostring(tat - now)} end
redis.call('SET', KEYS[1], tostring(tat + interval), 'PX', math.ceil(tat + interval - now) + 10000)
return {1, tostring(tat - now)}
"""

# KEYS: sends, conf, pause, gate hash, stats; ARGV: default rate, a start of this
# sender's to take back first ('' for none), this start's member, then _MARGIN's, the
# warm-up margin and its length (ms), then the stats fields to count when this start
# passes (waits, gated, regated: no round trip of their own)
_GATE = _MARGIN + _WARM + """
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[1], ARGV[2]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local pause = tonumber(redis.call('GET', KEYS[3]) or '0')
if pause > now then return {0, tostring(pause - now), 'pause'} end
local limit = math.max(1, math.floor(tonumber(redis.call('HGET', KEYS[2], 'rate_per_s') or ARGV[1])))
local base = margin(now)
local widest = 1000.0 + math.max(base, tonumber(ARGV[7]))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - widest)
local m, idle = warm_margin(KEYS[1], now, now, base)
local window = 1000.0 + m
if redis.call('ZCOUNT', KEYS[1], now - window, '+inf') >= limit then
  local oldest = redis.call('ZRANGEBYSCORE', KEYS[1], now - window, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return {0, tostring(tonumber(oldest[2]) + window - now), 'gate'}
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(widest) * 2)
if idle then redis.call('HSET', KEYS[4], 'busy_ms', tostring(now)) end
for i = 9, #ARGV do redis.call('HINCRBY', KEYS[5], ARGV[i], 1) end
return {1, tostring(now), 'ok'}
"""

# KEYS: pause, stats, (unused), gate hash; ARGV: pause ms, (unused), (unused), min, max,
# decay per ms, step
_PAUSE = _MARGIN + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local untl = now + tonumber(ARGV[1])
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if untl > cur then redis.call('SET', KEYS[1], untl, 'PX', tonumber(ARGV[1])) end
redis.call('HINCRBY', KEYS[2], 'http_429', 1)
-- widen the gate's margin, once per second (in-flight sends bring several 429s at once)
local at = tonumber(redis.call('HGET', KEYS[4], 'at_ms') or '0')
if now - at >= 1000 then
  local m = math.min(tonumber(ARGV[5]), margin(now) + tonumber(ARGV[7]))
  redis.call('HSET', KEYS[4], 'margin_ms', tostring(m), 'at_ms', tostring(now))
end
return untl
"""


# KEYS: outage, pause, stats; ARGV: sends in a row that make an outage, the error, the
# outage hash's life (ms), when the failed send started (Redis ms; 0 = now), a pause the
# provider asked for (a 503's Retry-After, ms; 0 = none), then the pause (ms) for trip 1,
# 2, ... (the last one repeats; jobs.policy.outage_pause_s). A failure trips a pause when
# the streak is long enough, unless an outage pause is on or the send started before it
# ended (it was in flight, not the probe): that one is held, no new pause.
# {0, 0, streak, 0}: counted; {1, ms, streak, trips}: every sender paused from now;
# {2, ms left, streak, trips}: held during an outage already paused
_PROVIDER_FAILED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local streak = redis.call('HINCRBY', KEYS[1], 'streak', 1)
if streak == 1 then redis.call('HSET', KEYS[1], 'first_ms', now) end
redis.call('HSET', KEYS[1], 'last_ms', now, 'last_error', ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
if streak < tonumber(ARGV[1]) then return {0, 0, streak, 0} end
local h = redis.call('HMGET', KEYS[1], 'trips', 'paused_until')
local trips = tonumber(h[1] or '0')
local untl = tonumber(h[2] or '0')
local started = tonumber(ARGV[4])
if started <= 0 then started = now end
if trips > 0 and (now < untl or started < untl) then
  return {2, math.max(0, untl - now), streak, trips}
end
trips = redis.call('HINCRBY', KEYS[1], 'trips', 1)
if trips == 1 then redis.call('HSET', KEYS[1], 'opened_ms', now) end
local ms = tonumber(ARGV[5 + math.min(trips, #ARGV - 5)])
local asked = tonumber(ARGV[5])
if asked > ms then ms = math.min(asked, tonumber(ARGV[#ARGV])) end
untl = now + ms
if untl > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], untl, 'PX', ms) end
redis.call('HSET', KEYS[1], 'paused_until', untl)
redis.call('HINCRBY', KEYS[3], 'outage_pauses', 1)
return {1, ms, streak, trips}
"""

OUTAGE_OK_LUA = """
local function outage_ok(outage, stats, pause)
  local h = redis.call('HMGET', outage, 'trips', 'first_ms', 'streak', 'paused_until')
  if not h[3] then return {0} end
  redis.call('DEL', outage)
  if not h[1] then return {1} end
  redis.call('HINCRBY', stats, 'outages', 1)
  if h[4] and tonumber(redis.call('GET', pause) or '0') == tonumber(h[4]) then redis.call('DEL', pause) end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  return {2, tonumber(h[1]), now - tonumber(h[2] or now)}
end
"""
"""A send succeeded: the streak of failures ends, and an outage with it (its pause lifted
if still on, a 429's left alone). {0}: there was none; {1}: failures, no pause yet; {2,
pauses, ms since the first failure}: an outage ended. Run by every success inside the
script that marks its key sent (jobs.idempotency.mark_sent): no round trip of its own."""

# KEYS: outage, stats, pause
_PROVIDER_OK = OUTAGE_OK_LUA + "return outage_ok(KEYS[1], KEYS[2], KEYS[3])\n"

OUTAGE_TTL_S = 600
"""A streak of failures (or an outage) with no send for this long is forgotten."""


@dataclass(frozen=True)
class Down:
    """``Limiter.provider_failed``: the provider is down; every sender waits ``wait_s``."""
    streak: int
    trips: int
    wait_s: float
    started: bool
    """This failure started the pause (else one was on already)."""


@dataclass(frozen=True)
class Taken:
    """A job taken off a queue together with a slot (``Limiter.take``)."""
    slot: str
    job_id: str
    raw: dict  # the job's hash as HGETALL returns it; empty if it expired meanwhile


EMPTY = "empty"
"""``Limiter.take``: the queue was empty (no slot held)."""


@dataclass(frozen=True)
class Settings:
    cap: int
    rate_per_s: float


@functools.lru_cache(maxsize=8)
def _outage_pauses_ms(first_s: float, max_s: float) -> tuple[int, ...]:
    """The outage pause for trip 1, 2, ... until it reaches ``max_s`` (ms)."""
    pauses: list[int] = []
    for trips in range(1, 64):
        pauses.append(int(outage_pause_s_for(trips, first_s, max_s) * 1000))
        if pauses[-1] >= max_s * 1000:
            break
    return tuple(pauses)


def _once_more_on_drop(script):
    """``script`` tried once more, on a new connection, when its connection was dropped.
    A send lane holds one connection (jobs.runtime.lane_connection); after a Redis restart
    its first command finds it closed. At a low rate most lanes sleep until their reserved
    start, so that command is the send gate's: in an on-call drill (`limits set --rate 6`,
    `supervisorctl restart redis`) 39 sends spent an attempt on the broken pipe, one at
    each reserved start, long after Redis was back. Only scripts with the same outcome
    when run twice by one caller are wrapped (a slot for the same holder, a reserved
    start: a schedule one start later at worst, the gate with the same member), as in
    jobs.idempotency._run. Redis really away: the second try raises."""
    def call(keys=(), args=()):
        try:
            return script(keys=keys, args=args)
        except RedisConnectionError:
            return script(keys=keys, args=args)  # (redis-py reconnects: still down, it raises again)
    return call


def rate_slots(rate_per_s: float, start_wait_s: float | None) -> int | None:
    """The most slots taken at once under ``rate_per_s`` (jobs.policy.slots_for_rate: the
    lanes taking sends follow a low rate), for a send whose start may wait ``start_wait_s``
    (jobs.policy.start_wait_budget_s); None without one. `payrun limits show` and the
    console's limits line say it when it is below the cap. Pure."""
    if start_wait_s is None or rate_per_s <= 0:
        return None
    interval_ms = 1000.0 / paced_rate(rate_per_s, RATE_HEADROOM, GATE_MARGIN_MAX_MS)
    return slots_for_rate(interval_ms, start_wait_s * 1000)


class Limiter:
    """The limits of one resource. Thread-safe: lanes of one process share it."""

    def __init__(self, conn, name: str, cap: int, rate_per_s: float, lease_s: float,
                 outage_after: int = 0, outage_pause_s: float = 5.0, outage_pause_max_s: float = 30.0,
                 start_wait_s: float | None = None):
        """``start_wait_s``: how long a send may wait for its start under the rate
        (jobs.policy.start_wait_budget_s); with it, a slot is taken only while the start
        its holder would get fits in START_WAIT_FIT of that (see _ACQUIRE_SLOT). None: the
        cap alone decides."""
        self.conn = conn
        self.outage_after = int(outage_after)
        self._outage_pauses_ms = _outage_pauses_ms(outage_pause_s, outage_pause_max_s)
        self.name = name
        self.default_cap = cap
        self.default_rate = rate_per_s
        self.lease_ms = int(lease_s * 1000)
        self.k_slots = keys.limit_slots(name)
        self.k_conf = keys.limit_conf(name)
        self.k_tat = keys.limit_tat(name)
        self.k_pause = keys.limit_pause(name)
        self.k_sends = keys.limit_sends(name)
        self.k_stats = keys.limit_stats(name)
        self.k_gate = keys.limit_gate(name)
        self.k_outage = keys.limit_outage(name)
        self._margin_args = [GATE_MARGIN_MIN_MS, GATE_MARGIN_MAX_MS, GATE_MARGIN_DECAY_MS_PER_S / 1000.0]
        self.start_wait_s = start_wait_s
        self._rate_args = [rate_per_s, RATE_HEADROOM, GATE_FIT, GATE_MARGIN_MAX_MS,
                           "" if start_wait_s is None else START_WAIT_FIT * start_wait_s * 1000]
        self._acquire = _once_more_on_drop(conn.register_script(_ACQUIRE_SLOT))
        self._acquire_take = conn.register_script(_ACQUIRE_SLOT_AND_TAKE)  # (dequeues: not twice)
        self._reserve = _once_more_on_drop(conn.register_script(_RESERVE))
        self._pause = conn.register_script(_PAUSE)
        self._gate = _once_more_on_drop(conn.register_script(_GATE))
        self._failed = conn.register_script(_PROVIDER_FAILED)
        self._ok = conn.register_script(_PROVIDER_OK)
        self._lock = threading.Lock()
        self._passed = threading.local()  # (member, monotonic) of this thread's last gate pass

    def seed(self) -> dict[str, tuple[str, str]]:
        """Put this config's values in force, except those an operator set at run time
        (kept until `payrun limits reset`). Returns {field: (value in force, set at)} for
        the overrides kept, for the caller to log."""
        return seed_limits(self.conn, self.name, self.default_cap, self.default_rate)

    def waiting_for_rate(self, in_use: int) -> int:
        """``waiting_for_rate`` now, read from Redis (its clock)."""
        with self.conn.pipeline(transaction=False) as p:
            p.get(self.k_tat)
            p.time()
            tat, (sec, usec) = p.execute()
        return waiting_for_rate(float(tat) if tat else None, sec * 1000 + usec / 1000, self.settings().rate_per_s,
                                in_use)

    def slots_for_rate(self, rate_per_s: float) -> int | None:
        """The most slots taken at once under ``rate_per_s`` (:func:`rate_slots`); None
        without a wait budget."""
        return rate_slots(rate_per_s, self.start_wait_s)

    def settings(self) -> Settings:
        raw = self.conn.hgetall(self.k_conf)
        get = lambda f, d: float(raw.get(f.encode(), raw.get(f, d)))  # noqa: E731
        return Settings(cap=int(get("cap", self.default_cap)), rate_per_s=get("rate_per_s", self.default_rate))

    # ---- concurrency --------------------------------------------------------------
    def try_slot(self, holder: str, previous: str | None = None) -> tuple[bool, int]:
        """One try for a slot; ``previous``, a slot given back in the same round trip
        (a lane going straight on to its next job), is released whatever the outcome."""
        ok, wait_ms = self._acquire(keys=[self.k_slots, self.k_conf, self.k_pause, self.k_outage, self.k_tat],
                                    args=[holder, self.default_cap, self.lease_ms, previous or "", "",
                                          *self._rate_args])
        return bool(ok), int(wait_ms)

    def slot(self, stop: threading.Event | None = None, holder: str | None = None,
             previous: str | None = None, on_wait=None) -> str | None:
        """Block until a slot is ours; returns its holder id (None if ``stop`` was set).
        ``previous``: see :meth:`try_slot` (released by the first try). ``on_wait``:
        called before each wait (a lane renews its worker record: a pause may last)."""
        holder = holder or uuid.uuid4().hex
        waited = False
        while True:
            ok, wait_ms = self.try_slot(holder, previous)
            previous = None
            if ok:
                if waited:
                    self._count_wait()
                return holder
            waited = True
            if on_wait is not None:
                on_wait()
            if stop is not None and stop.wait(min(wait_ms, 500) / 1000):
                return None
            if stop is None:
                time.sleep(min(wait_ms, 500) / 1000)

    def take(self, stop: threading.Event, holder: str, queue_key: str, intermediate_key: str, job_prefix: str,
             previous: str | None = None, on_wait=None) -> Taken | str | None:
        """:meth:`slot`, then RQ's non-blocking dequeue of one queue, in one script per try:
        three round trips per send become one. Blocks while no slot is free. Returns a
        ``Taken`` (its slot is ours), ``EMPTY`` (the queue was empty: no slot held) or
        None (``stop`` was set while waiting). ``previous``: see :meth:`try_slot`.
        ``on_wait``: see :meth:`slot`."""
        waited = False
        while True:
            r = self._acquire_take(keys=[self.k_slots, self.k_conf, self.k_pause, self.k_outage, self.k_tat,
                                         queue_key, intermediate_key],
                                   args=[holder, self.default_cap, self.lease_ms, previous or "", job_prefix,
                                         *self._rate_args])
            previous = None
            if int(r[0]) == 1:
                if waited:
                    self._count_wait()
                flat = r[3]
                job_id = r[2].decode() if isinstance(r[2], bytes) else r[2]
                return Taken(holder, job_id, dict(zip(flat[0::2], flat[1::2])))
            if int(r[0]) == 2:
                return EMPTY
            waited = True
            if on_wait is not None:
                on_wait()
            if stop.wait(min(int(r[1]), 500) / 1000):
                return None

    def release(self, holder: str) -> None:
        self.conn.zrem(self.k_slots, holder)

    def in_use(self) -> int:
        """Slots held now (expired leases not counted). Reads only."""
        sec, usec = self.conn.time()  # not EVAL: a read-only user may run this
        now_ms = int(sec) * 1000 + int(usec) // 1000
        return int(self.conn.zcount(self.k_slots, now_ms, "+inf"))

    # ---- rate -------------------------------------------------------------------
    def token(self, deadline_s: float | None = None) -> bool:
        """Block until this send may start: its reserved start time, after any 429 pause,
        then through the send gate. False if that would be after ``deadline_s``
        (time.monotonic()), or at once during an outage pause (the job goes back, its
        slot freed: after the pause one send at a time probes the provider)."""
        waited = False
        while True:
            # (a few ms less: the reply's way back; a start it reserved is then taken, not dropped)
            longest = "" if deadline_s is None else max(0, int((deadline_s - time.monotonic()) * 1000) - 5)
            ok, wait_ms, *outage = self._reserve(
                keys=[self.k_tat, self.k_conf, self.k_pause, self.k_gate, self.k_sends, self.k_outage],
                args=[self.default_rate, RATE_HEADROOM, GATE_FIT, *self._margin_args,
                      GATE_WARMUP_MARGIN_MS, GATE_WARMUP_MS, longest])
            if int(ok) == 2 or (outage and int(outage[0])):
                return False  # too far ahead (nothing reserved), or an outage pause
            wait_s = float(wait_ms) / 1000
            if not int(ok) and deadline_s is not None and time.monotonic() + wait_s > deadline_s:
                return False  # a pause that outlasts the deadline (a reserved start is kept: the
                              # script checked it against the deadline, and giving it up would
                              # move the schedule for a send that does not happen)
            if wait_s > 0.001:
                waited = True
                time.sleep(wait_s)
            if not int(ok):
                continue  # it was a pause: reserve again now that it is over
            passed = self.gate(deadline_s, count=("waits",) if waited else ())
            if passed is None:
                return False
            if not passed:
                continue  # a 429 pause began meanwhile: our reservation is void
            return True

    def gate(self, deadline_s: float | None = None, replace: str = "",
             count: tuple[str, ...] = ()) -> float | bool | None:
        """Record this send's start in the rolling window once fewer than the limit started
        in the last 1 s + the margin; wait (a few ms, when senders bunched) until then.
        Go: the start time recorded (Redis clock, ms; truthy). False: a 429 pause is on
        (reserve again). None: past ``deadline_s``. ``replace``: a start of this sender's
        recorded earlier, taken back in the same script (see :meth:`recheck`). ``count``:
        stats fields counted, in the same script, when it passes ("gated" is added when
        the gate held it back)."""
        member = uuid.uuid4().hex[:16]
        counts = list(count)
        while True:
            # this start's time on our clock, for recheck: no later than Redis recorded it.
            # Taken after the reply it would miss a stall of this thread between the two
            # (50 lanes share one GIL: traces on a busy host showed 11-22 ms there)
            asked = time.monotonic()
            ok, wait_ms, why = self._gate(keys=[self.k_sends, self.k_conf, self.k_pause, self.k_gate, self.k_stats],
                                          args=[self.default_rate, replace, member, *self._margin_args,
                                                GATE_WARMUP_MARGIN_MS, GATE_WARMUP_MS, *counts])
            replace = ""
            if int(ok):
                self._passed.last = (member, asked, float(wait_ms))
                return float(wait_ms)
            if (why.decode() if isinstance(why, bytes) else why) == "pause":
                self._passed.last = None
                return False
            wait_s = float(wait_ms) / 1000
            if deadline_s is not None and time.monotonic() + wait_s > deadline_s:
                return None
            if "gated" not in counts:
                counts.append("gated")
            time.sleep(max(wait_s, 0.0005))

    def last_gate_pass_s(self) -> float | None:
        """When this thread's last send passed the gate (time.monotonic(), taken as it asked:
        the start was recorded no earlier), if it did."""
        last = getattr(self._passed, "last", None)
        return last[1] if last else None

    def last_gate_stamp_ms(self) -> float | None:
        """The start Redis recorded for this thread's last gate pass (its clock, ms)."""
        last = getattr(self._passed, "last", None)
        return last[2] if last else None

    def recheck(self, deadline_s: float | None = None, now_s: float | None = None) -> bool:
        """Call right before the request leaves. If this thread passed the gate more than
        REGATE_LATE_MS ago (it stalled since), its start is recorded again, now, waiting
        for room in the window and out any 429 pause that began meanwhile. False: past
        ``deadline_s`` (the start was taken back; do not send)."""
        last = getattr(self._passed, "last", None)
        if last is None:
            return True
        member, passed_s, _ = last
        if not late_for_gate(passed_s, time.monotonic() if now_s is None else now_s):
            return True
        count = ("regated",)
        while True:
            passed = self.gate(deadline_s, replace=member, count=count)
            if passed is None:
                return False
            if passed:
                return True
            member, count = "", ()  # a pause: taken back already; wait it out, then take a start again
            left = self.conn.pttl(self.k_pause)
            if deadline_s is not None and time.monotonic() + max(left, 0) / 1000 > deadline_s:
                return False
            time.sleep(max(left, 1) / 1000)

    def pause(self, seconds: float) -> None:
        """Every sender on every host waits ``seconds`` (a provider's Retry-After). The key
        lives exactly that long, so "paused" is simply "the key exists"."""
        self._pause(keys=[self.k_pause, self.k_stats, self.k_pause, self.k_gate],
                    args=[int(seconds * 1000), "", "", *self._margin_args, GATE_MARGIN_STEP_MS])

    # ---- provider outages -----------------------------------------------------------
    def provider_failed(self, error: str, started_ms: float = 0, asked_s: float | None = None) -> Down | None:
        """Count a send the provider failed (jobs.policy.counts_as_provider_failure);
        ``started_ms``: when it passed the send gate (Redis clock; 0 = unknown, counts as
        now); ``asked_s``: a pause the provider asked for (a 503's Retry-After, honoured
        up to the longest outage pause). None: not an outage (yet), the job retries as
        usual. A ``Down``: the provider failed ``outage_after`` sends in a row, so every
        sender on every host waits ``wait_s`` (this call started that pause, or one was
        on already, or the send was in flight when it ended: it was not the probe)."""
        if self.outage_after < 2:
            return None
        tripped, ms, streak, trips = self._failed(
            keys=[self.k_outage, self.k_pause, self.k_stats],
            args=[self.outage_after, error[:300], OUTAGE_TTL_S * 1000, int(started_ms or 0),
                  int((asked_s or 0) * 1000), *self._outage_pauses_ms])
        if not int(tripped):
            return None
        return Down(streak=int(streak), trips=int(trips), wait_s=max(0, int(ms)) / 1000, started=int(tripped) == 1)

    def provider_ok(self) -> tuple[int, float] | None:
        """A send succeeded: end any streak of failures (the send path does this inside
        jobs.idempotency.mark_sent, at no cost). (pauses, seconds since the first
        failure) when that ended an outage, else None."""
        return outage_ended(self._ok(keys=[self.k_outage, self.k_stats, self.k_pause]))

    def outage_keys(self) -> tuple[str, str, str] | None:
        """The keys OUTAGE_OK_LUA needs (outage, stats, pause); None when outages are off."""
        return (self.k_outage, self.k_stats, self.k_pause) if self.outage_after >= 2 else None

    def gate_margin_ms(self) -> float:
        """The send gate's margin over 1 s in force now (ms). Reads only."""
        sec, usec = self.conn.time()
        now_ms = int(sec) * 1000 + int(usec) / 1000
        m, at = self.conn.hmget(self.k_gate, "margin_ms", "at_ms")
        return gate_margin_ms(float(m) if m else None, now_ms - float(at or 0))

    def _count_wait(self) -> None:  # a slot wait (rare: the gate counts its own in its script)
        try:
            self.conn.hincrby(self.k_stats, "waits", 1)
        except Exception:
            pass

    def count_duplicate(self) -> None:
        """A send the provider deduped (``stats()['duplicates']``): a resend of a slip it
        already had. Never fails the send that found it."""
        try:
            self.conn.hincrby(self.k_stats, "duplicates", 1)
        except Exception:
            pass

    def stats(self) -> dict[str, int]:
        raw = self.conn.hgetall(self.k_stats)
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def free_dead_slots(conn, name: str = "email", now: float | None = None) -> list[str]:
    """Give back the slots held by lanes that lost their liveness key (a ``kill -9`` of a
    send-email process, the OOM killer) once two reaper passes SLOT_SETTLE_S apart found
    them so, instead of when their leases end (``email.timeout_s`` + 15 s later):
    meanwhile the cap counted them in flight and the live senders ran at a fraction of
    the rate. Run by the reaper next to its job returns, by the same rule (no liveness
    for ALIVE_TTL_S). Returns the holders freed."""
    from jobs.policy import dead_slot_holders, slot_lane, slots_to_free

    now = time.time() if now is None else now
    k, k_seen = keys.limit_slots(name), keys.limit_slots_dead_seen(name)
    holders = [h.decode() if isinstance(h, bytes) else h for h in conn.zrange(k, 0, -1)]
    lanes = sorted({slot_lane(h) for h in holders} - {""})
    alive: dict[str, bool] = {}
    if lanes:
        with conn.pipeline(transaction=False) as p:
            for lane in lanes:
                p.exists(keys.alive(lane))
            alive = {lane: bool(n) for lane, n in zip(lanes, p.execute())}
    seen = {(h.decode() if isinstance(h, bytes) else h): float(t) for h, t in conn.hgetall(k_seen).items()}
    free, mark, forget = slots_to_free(dead_slot_holders(holders, alive), seen, now)
    if free or mark or forget:
        with conn.pipeline() as p:
            if free:
                p.zrem(k, *free)
            if forget:
                p.hdel(k_seen, *forget)
            for h in mark:
                p.hsetnx(k_seen, h, now)
            p.expire(k_seen, 3600)
            p.execute()
    return free


def waiting_for_rate(tat_ms: float | None, now_ms: float, rate_per_s: float, in_use: int) -> int:
    """Of the ``in_use`` slots, about how many are held by senders waiting for their start
    under the rate (reserved, not yet at the provider): the rate's schedule runs
    ``tat - now`` ms ahead, one start per 1000 / rate ms. "50 / 50 in flight" at a rate of
    12/s is mostly senders waiting, not requests at the provider: raising the cap does
    nothing then (ops walkthrough)."""
    if not tat_ms or tat_ms <= now_ms or rate_per_s <= 0:
        return 0
    return min(int(in_use), round((tat_ms - now_ms) * rate_per_s / 1000.0))


LIMIT_FIELDS = ("cap", "rate_per_s")
CHANGED_AT = "changed_at"
"""The limit's hash field: when its cap or rate last changed in force (epoch seconds), by an
operator (`payrun limits`, the console), a reset, or a start with new config values. The
console's ETA counts the send rate from then on (a lowered cap slows sends at once; the
last minutes' pace would promise the old one for minutes)."""

# KEYS[1]: the limit's hash; ARGV: cap, rate from the config, now (epoch s). A field with
# <field>_set_at (an operator's value) is kept; the others take the config's (a value that
# was there before and differs stamps changed_at). Returns the kept ones as
# {field, value, set_at, ...}.
_SEED = """
local kept = {}
local fields = {'cap', 'rate_per_s'}
for i, f in ipairs(fields) do
  redis.call('HSET', KEYS[1], 'config_' .. f, ARGV[i])
  local at = redis.call('HGET', KEYS[1], f .. '_set_at')
  if at then
    table.insert(kept, f)
    table.insert(kept, redis.call('HGET', KEYS[1], f) or '')
    table.insert(kept, at)
  else
    local was = redis.call('HGET', KEYS[1], f)
    if was and was ~= ARGV[i] then
      redis.call('HSET', KEYS[1], 'changed_at', ARGV[3])
    end
    redis.call('HSET', KEYS[1], f, ARGV[i])
  end
end
return kept
"""


def seed_limits(conn, name: str, cap: int, rate_per_s: float) -> dict[str, tuple[str, str]]:
    """A send-email process's start: the config's cap and rate in force, but for a value
    an operator set (kept: {field: (value, set at)}), in one script (two processes
    starting at once)."""
    flat = conn.eval(_SEED, 1, keys.limit_conf(name), int(cap), float(rate_per_s), repr(time.time()))
    out = {}
    for i in range(0, len(flat or []), 3):
        f, v, at = (x.decode() if isinstance(x, bytes) else str(x) for x in flat[i:i + 3])
        out[f] = (v, at)
    return out


def limit_sources(conn, name: str) -> dict[str, dict]:
    """Per field: {"value", "config" (what the config said at the last start, or None),
    "set_at" (when an operator set it, or None)}. Reads only."""
    raw = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
           for k, v in conn.hgetall(keys.limit_conf(name)).items()}
    return {f: {"value": raw.get(f), "config": raw.get(f"config_{f}"), "set_at": raw.get(f"{f}_set_at")}
            for f in LIMIT_FIELDS}


def reset_limits(conn, name: str, cap: int, rate_per_s: float) -> None:
    """`payrun limits reset`: the config's values in force again, no operator override."""
    with conn.pipeline() as pipe:
        pipe.hdel(keys.limit_conf(name), *(f"{f}_set_at" for f in LIMIT_FIELDS))
        pipe.hset(keys.limit_conf(name), mapping={"cap": int(cap), "rate_per_s": float(rate_per_s),
                                                  "config_cap": int(cap), "config_rate_per_s": float(rate_per_s),
                                                  CHANGED_AT: repr(time.time())})
        pipe.delete(keys.limit_tat(name))
        pipe.execute()


def set_limits(conn, name: str, cap: int | None = None, rate_per_s: float | None = None) -> None:
    """Change a limit while running (an operator's value: it outlives restarts until
    `payrun limits reset`); every worker reads it on its next acquire."""
    from datetime import datetime, timezone

    mapping: dict[str, Any] = {}
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if cap is not None:
        mapping["cap"] = int(cap)
        mapping["cap_set_at"] = now
    if rate_per_s is not None:
        mapping["rate_per_s"] = float(rate_per_s)
        mapping["rate_per_s_set_at"] = now
    if mapping:
        mapping[CHANGED_AT] = repr(time.time())
        with conn.pipeline() as pipe:
            pipe.hset(keys.limit_conf(name), mapping=mapping)
            if rate_per_s is not None:
                # the schedule so far was paced at the old rate: a raised rate applies from
                # the next start, not after the starts already spaced out at the old one (the
                # send gate still holds every host to the new limit in any rolling second)
                pipe.delete(keys.limit_tat(name))
            pipe.execute()


def outage_ended(reply) -> tuple[int, float] | None:
    """OUTAGE_OK_LUA's reply: (pauses, seconds since the first failure) if it ended an
    outage, else None."""
    if not reply or int(reply[0]) != 2:
        return None
    return int(reply[1]), int(reply[2]) / 1000


def read_outage(conn, name: str = "email", now_ms: float | None = None) -> dict | None:
    """The provider's failing streak or outage as status and the console show it, or None.
    Reads only (a read-only user may run it): HGETALL and PTTL.
    state: "failing" (sends failed in a row, not yet an outage), "paused" (every sender
    waits ``paused_for_s``), "probing" (one send at a time until one succeeds)."""
    with conn.pipeline(transaction=False) as p:
        p.hgetall(keys.limit_outage(name))
        p.pttl(keys.limit_pause(name))
        raw, pause_ms = p.execute()
    return outage_from(raw, pause_ms, now_ms)


def outage_from(raw: dict, pause_ms: int | None, now_ms: float | None = None) -> dict | None:
    """read_outage's answer from the outage hash (HGETALL) and the pause key's PTTL, for a
    caller that reads them in its own pipeline."""
    if not raw:
        return None
    h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
         for k, v in raw.items()}
    if now_ms is None:
        now_ms = time.time() * 1000
    trips = int(h.get("trips", 0))
    paused_for_s = max(0, int(pause_ms or 0)) / 1000
    first = float(h.get("first_ms", now_ms))
    opened = float(h["opened_ms"]) if "opened_ms" in h else None
    return {
        "state": "failing" if not trips else ("paused" if paused_for_s > 0 else "probing"),
        "failed_in_a_row": int(h.get("streak", 0)),
        "pauses": trips,
        "paused_for_s": round(paused_for_s, 1),
        "since": round(first / 1000, 3),
        "for_s": round(max(0.0, now_ms - first) / 1000, 1),
        "outage_since": round(opened / 1000, 3) if opened else None,
        "last_error": h.get("last_error", ""),
    }


def email_limiter(conn, cfg) -> Limiter:
    lim = cfg.limits
    return Limiter(conn, "email", lim.email_concurrency, lim.email_rate_per_s, lease_s=cfg.email.timeout_s + 15,
                   outage_after=lim.outage_after, outage_pause_s=lim.outage_pause_s,
                   outage_pause_max_s=lim.outage_pause_max_s, start_wait_s=start_wait_budget_s(cfg.email.timeout_s))
