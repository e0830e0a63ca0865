"""Bulk enqueue for the fan-out: RQ's own job records, written by one script per chunk.

``Queue.enqueue_many`` spends most of a pay run's fan-out in Python: it builds a full
``Job`` per employee (two runtime ``Protocol`` checks, timeout parsing, callbacks), then
redis-py packs four commands per job and parses four replies. The fan-out's jobs differ
only in their id, their arguments, their description and their meta, so:

1. **A template from RQ itself.** ``enqueue_many`` is run for one prototype job into a
   pipeline that is never executed, and its recorded commands are the template. They must
   have the shape RQ 2.x sends (``SADD`` of the queue, ``HSET status``, ``HSET`` of the
   record, ``RPUSH``); if they do not, :func:`template` returns ``None`` and the caller
   uses ``enqueue_many`` (slow but always right). Every other field of the record (ttl's,
   timeout, retries, origin, callbacks, any field a later RQ adds) is copied from RQ's
   own ``to_dict`` as it is.
2. **One Lua script per chunk** writes, for each job, the same hash RQ would (template
   fields + its own ``data``, ``description``, ``meta`` and timestamps), then pushes the
   ids onto the queue in order — atomically, like the ``MULTI`` pipeline it replaces.
   Python packs one command of ~4 arguments per job instead of four commands of ~45.

``data`` is compressed with zlib exactly as RQ's ``to_dict`` does, so ``Job.fetch``,
``rq info`` and every worker read these jobs like any other (``tests/test_bulk.py``
compares the stored records field by field with ``enqueue_many``'s).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rq import Queue
from rq.utils import now, utcformat

_QUIET = logging.getLogger("payrun.bulk.template")
_QUIET.disabled = True

# fields that differ per job (everything else comes from the template)
PER_JOB = ("data", "description", "meta", "created_at", "enqueued_at")

_SCRIPT = """
-- KEYS[1] the queue list, KEYS[2] RQ's set of queues; the job keys are built from the
-- prefix (one Redis server, as everywhere in payrun: not for Redis Cluster)
-- ARGV: job key prefix, created/enqueued timestamp, n template pairs, the pairs,
--       then per job: id, data, description, meta
local prefix, ts = ARGV[1], ARGV[2]
local n = tonumber(ARGV[3])
local fields = {}
for i = 1, 2 * n do fields[i] = ARGV[3 + i] end
local base = 3 + 2 * n
local k = #fields
fields[k + 1] = 'created_at'; fields[k + 2] = ts
fields[k + 3] = 'enqueued_at'; fields[k + 4] = ts
fields[k + 5] = 'data'; fields[k + 7] = 'description'; fields[k + 9] = 'meta'
redis.call('SADD', KEYS[2], KEYS[1])
local ids = {}
for i = base + 1, #ARGV, 4 do
  fields[k + 6] = ARGV[i + 1]
  fields[k + 8] = ARGV[i + 2]
  fields[k + 10] = ARGV[i + 3]
  redis.call('HSET', prefix .. ARGV[i], unpack(fields))
  ids[#ids + 1] = ARGV[i]
  if #ids == 500 then redis.call('RPUSH', KEYS[1], unpack(ids)); ids = {} end
end
if #ids > 0 then redis.call('RPUSH', KEYS[1], unpack(ids)) end
return (#ARGV - base) / 4
"""


@dataclass(frozen=True)
class Template:
    """RQ's record of a prototype job, minus the fields that differ per job."""

    queue_key: str
    queues_key: str
    job_prefix: str
    data_head: bytes
    """The serialized job tuple up to its first argument: ``["func", null, [``."""
    data_tail: bytes
    """And after it: ``], {}]``."""
    fields: tuple[Any, ...]
    """Flat (field, value, ...) of the template record."""


def template(queue: Queue, func: str, **job_options: Any) -> Template | None:
    """Record what ``queue.enqueue_many`` sends for one job with ``job_options`` (timeout,
    retry, ttl's ...; not ``args``, ``job_id``, ``description`` or ``meta``) and make it the
    template. ``None`` when RQ sends something this module does not know how to repeat."""
    proto_id = "payrun-bulk-template"
    marker = {"payrun-bulk": ["marker", "\u09f3 \u0995", 1.5, None, {"n": [1, 2]}]}
    pipe = queue.connection.pipeline()
    log, queue.log = queue.log, _QUIET  # RQ's "Enqueueing job ..." would name a job that never exists
    try:
        queue.enqueue_many([queue.prepare_data(func, args=(marker,), job_id=proto_id, description="d",
                                               meta={"m": 1}, **job_options)], pipeline=pipe)
        stack = [tuple(c[0]) for c in pipe.command_stack]
    finally:
        queue.log = log
        pipe.reset()
    job_key = queue.job_class.key_for(proto_id)
    shape = [c[0] for c in stack]
    if shape != ["SADD", "HSET", "HSET", "RPUSH"]:
        return None
    sadd, status, record, push = stack
    if status[1:] != (job_key, "status", "queued") or record[1] != job_key or push[1:] != (queue.key, proto_id):
        return None
    if len(sadd) != 3 or sadd[2] != queue.key:
        return None
    mapping = dict(zip(record[2::2], record[3::2]))
    if mapping.get("status") != "queued" or not all(f in mapping for f in PER_JOB):
        return None
    # job_args() serializes each argument and meta with json.dumps: only right if the
    # queue's serializer is exactly that (separators, non-ASCII, floats, None, nesting)
    inner = json.dumps(marker).encode()
    if queue.serializer.dumps(marker) != inner or mapping["meta"] != json.dumps({"m": 1}).encode():
        return None
    raw = zlib.decompress(mapping["data"])
    head, sep, tail = raw.partition(inner)
    if not sep or inner in tail or raw != queue.serializer.dumps((func, None, (marker,), {})):
        return None
    fields: list[Any] = []
    for f, v in mapping.items():
        if f not in PER_JOB:
            fields += [f, v]
    return Template(queue_key=queue.key, queues_key=sadd[1], job_prefix=queue.job_class.redis_job_namespace_prefix,
                    data_head=head, data_tail=tail, fields=tuple(fields))


class BulkEnqueuer:
    """Enqueue chunks of jobs that share ``template``'s options, one script call a chunk."""

    def __init__(self, conn, tpl: Template):
        self.conn = conn
        self.tpl = tpl
        self._script = conn.register_script(_SCRIPT)
        self._argv_head = [tpl.job_prefix, "", len(tpl.fields) // 2, *tpl.fields]

    def job_args(self, job_id: str, arg: Any, description: str, meta: dict[str, Any]) -> tuple[str, bytes, str, bytes]:
        """The per-job part of a chunk: what RQ would store for ``func(arg)``."""
        data = self.tpl.data_head + json.dumps(arg).encode() + self.tpl.data_tail
        return job_id, zlib.compress(data), description, json.dumps(meta).encode()

    def enqueue(self, jobs: Iterable[tuple[str, bytes, str, bytes]]) -> int:
        """Write the jobs (from :meth:`job_args`) and push them onto the queue, in order,
        atomically. Returns how many were written."""
        argv = list(self._argv_head)
        argv[1] = utcformat(now())
        for j in jobs:
            argv.extend(j)
        if len(argv) == len(self._argv_head):
            return 0
        return int(self._script(keys=[self.tpl.queue_key, self.tpl.queues_key], args=argv))



_ONE_SCRIPT = """
-- One job, unless its record exists: the event first, then what RQ's enqueue writes.
-- KEYS[1] the queue list, KEYS[2] RQ's set of queues, KEYS[3] the job's key, KEYS[4] the
-- events stream. ARGV: timestamp, job id, n template pairs, the pairs, data, description,
-- meta, then the event's field/value pairs. Returns 1 if enqueued, 0 if the job was there.
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local ts, n = ARGV[1], tonumber(ARGV[3])
local base = 3 + 2 * n
local ev = {}
for i = base + 4, #ARGV do ev[#ev + 1] = ARGV[i] end
redis.call('XADD', KEYS[4], '*', unpack(ev))
redis.call('SADD', KEYS[2], KEYS[1])
local fields = {}
for i = 1, 2 * n do fields[i] = ARGV[3 + i] end
local k = #fields
fields[k + 1] = 'created_at'; fields[k + 2] = ts
fields[k + 3] = 'enqueued_at'; fields[k + 4] = ts
fields[k + 5] = 'data'; fields[k + 6] = ARGV[base + 1]
fields[k + 7] = 'description'; fields[k + 8] = ARGV[base + 2]
fields[k + 9] = 'meta'; fields[k + 10] = ARGV[base + 3]
redis.call('HSET', KEYS[3], unpack(fields))
redis.call('RPUSH', KEYS[1], ARGV[2])
return 1
"""


class OneEnqueuer:
    """Enqueue one job of ``template``'s options unless it exists, with its ledger event
    written first, in one script call: what ``enqueue_call`` inside a ``MULTI`` after an
    ``EXISTS`` did in two round trips, without building RQ's ``Job`` (a render worker
    enqueues each slip's send this way: ~0.6 ms of its CPU per slip before, measured)."""

    def __init__(self, conn, tpl: Template, events_stream: str):
        self.conn = conn
        self.tpl = tpl
        self.events_stream = events_stream
        self._script = conn.register_script(_ONE_SCRIPT)
        self._pairs = [len(tpl.fields) // 2, *tpl.fields]

    def enqueue(self, job_id: str, arg: Any, description: str, meta: dict[str, Any],
                event: dict[str, str], client=None) -> bool:
        """Write the job (as RQ would for ``func(arg)``) and push it onto its queue, after
        ``event`` (flat field/value strings) on the events stream; nothing if a job of
        that id exists. True if it was enqueued. ``client``: a pipeline to queue the
        script call on instead (its reply, 1 or 0, comes with the pipeline's)."""
        data = zlib.compress(self.tpl.data_head + json.dumps(arg).encode() + self.tpl.data_tail)
        argv: list[Any] = [utcformat(now()), job_id, *self._pairs, data, description, json.dumps(meta).encode()]
        for k, v in event.items():
            argv += [k, v]
        return bool(self._script(keys=[self.tpl.queue_key, self.tpl.queues_key, self.tpl.job_prefix + job_id,
                                       self.events_stream], args=argv, client=client))
