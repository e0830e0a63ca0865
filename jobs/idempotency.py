"""Idempotency at the side effect: a send claims its slip's key before it talks to the
provider, and marks it sent after.

State per key (Redis hash ``payrun:idem:<key>``): ``state`` = sending | sent, ``owner`` =
the attempt holding it, ``message_id`` once sent. A claim is one atomic Lua script:
  sent                      -> SENT  (skip: recorded as done, nothing sent)
  sending by another owner  -> BUSY  (transient: that attempt may still deliver)
  otherwise                 -> OK    (we own it for ``ttl`` seconds)
The ``sending`` claim expires with its TTL, so a crashed sender never blocks the key for
good; the provider's own dedupe by Idempotency-Key covers a send whose outcome is unknown.
Just before the message is written, the sender *holds* its claim: still its own (then
renewed for another TTL), or the send stops unsent. A sender that stalled (a paused VM,
a stopped process) until the reaper freed its claim or the TTL ran out, while another
attempt claimed the key and sent, would otherwise send the slip a second time; over
SMTP nobody dedupes it.
"""

from __future__ import annotations

import hashlib

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from jobs.limits import OUTAGE_OK_LUA, outage_ended
from payrun import keys

OK, SENT, BUSY = "ok", "sent", "busy"

_CLAIM = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'sent' then return 'sent' end
if state == 'sending' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 'busy' end
redis.call('HSET', KEYS[1], 'state', 'sending', 'owner', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return 'ok'
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'state') == 'sending' and redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

_HOLD = """
if redis.call('HGET', KEYS[1], 'state') == 'sending' and redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
  return 1
end
return 0
"""

_MARK_SENT = """
redis.call('HSET', KEYS[1], 'state', 'sent', 'owner', ARGV[1], 'message_id', ARGV[2], 'sent_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return 1
"""

# A delivery noted on a host's disk while Redis could not record it (jobs.unrecorded),
# recorded once Redis is back: sent, whoever holds a claim now (that attempt's hold fails
# and it stops unsent), unless the key is recorded sent already (that record stays).
_MARK_NOTED = """
if redis.call('HGET', KEYS[1], 'state') == 'sent' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'sent', 'owner', ARGV[1], 'message_id', ARGV[2], 'sent_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return 1
"""

# The same, and the send's success ends the provider's streak of failures (jobs.limits:
# KEYS[2..4] = outage, stats, pause), in the same round trip.
_MARK_SENT_OK = OUTAGE_OK_LUA + _MARK_SENT.replace("return 1\n", "return outage_ok(KEYS[2], KEYS[3], KEYS[4])\n")
assert _MARK_SENT_OK.endswith("return outage_ok(KEYS[2], KEYS[3], KEYS[4])\n")

SENT_TTL_S = 90 * 24 * 3600
"""How long a sent key is remembered (a slip is resent deliberately with a new key)."""


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


_SHA = {s: hashlib.sha1(s.encode()).hexdigest() for s in (_CLAIM, _RELEASE, _HOLD, _MARK_SENT, _MARK_SENT_OK, _MARK_NOTED)}


def _run(conn, script: str, key: str, *args, more_keys: tuple[str, ...] = ()):
    """EVALSHA (the script's text goes over the wire once per server, not once per send;
    its digest is computed once per process, not once per call as register_script does).

    A dropped connection is tried once more, on a new one: a send lane holds one
    connection, and after a Redis restart its first command finds it closed (a broken
    pipe), which failed that job's attempt (47 of 1,200 sends after a `supervisorctl
    restart redis`). Each script here may run twice for the same owner with the same
    outcome, so a retry after a reply that was lost is harmless too."""
    ks = (keys.idem_state(key), *more_keys)
    try:
        return _evalsha(conn, script, ks, args)
    except RedisConnectionError:
        return _evalsha(conn, script, ks, args)  # (redis-py reconnects: still down, it raises again)


def _evalsha(conn, script: str, ks: tuple[str, ...], args: tuple):
    try:
        return conn.evalsha(_SHA[script], len(ks), *ks, *args)
    except NoScriptError:  # a new or restarted server: load it, then run it
        conn.script_load(script)
        return conn.evalsha(_SHA[script], len(ks), *ks, *args)


def claim(conn, key: str, owner: str, ttl_s: int) -> str:
    return _text(_run(conn, _CLAIM, key, owner, int(ttl_s)))


def release(conn, key: str, owner: str) -> bool:
    return bool(_run(conn, _RELEASE, key, owner))


def hold(conn, key: str, owner: str, ttl_s: int) -> bool:
    """Whether ``owner`` still holds its claim on ``key``; if so it is renewed for
    ``ttl_s``. False: the claim ran out, and another attempt may have it or have sent."""
    return bool(_run(conn, _HOLD, key, owner, int(ttl_s)))


def mark_sent(conn, key: str, owner: str, message_id: str,
              outage_keys: tuple[str, str, str] | None = None) -> tuple[int, float] | None:
    """Record the key sent. With ``outage_keys`` (jobs.limits.Limiter.outage_keys) the
    success also ends the provider's streak of failures, in the same script: returns
    (pauses, seconds since the first failure) if that ended an outage."""
    import time

    args = (owner, message_id or "", str(int(time.time())), SENT_TTL_S)
    if outage_keys is None:
        _run(conn, _MARK_SENT, key, *args)
        return None
    return outage_ended(_run(conn, _MARK_SENT_OK, key, *args, more_keys=outage_keys))


def mark_noted(conn, key: str, message_id: str, owner: str) -> bool:
    """Record as sent a delivery noted while Redis could not record it (jobs.unrecorded):
    True if this recorded it, False if the key was recorded sent already."""
    import time

    return bool(_run(conn, _MARK_NOTED, key, owner, message_id or "", str(int(time.time())), SENT_TTL_S))


def state(conn, key: str) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in conn.hgetall(keys.idem_state(key)).items()}
