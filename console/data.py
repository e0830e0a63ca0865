"""What the console shows, as plain data: one read-only snapshot of Redis and the ledger.

No textual here: `payrun queues|workers|running --json` print the same snapshots, and the
benchmark times them. Nothing in this module writes to Redis or to SQLite:

- RQ's registry ``count`` / ``get_job_ids()`` run cleanup, which *moves* jobs; we read
  the keys themselves (LLEN, ZCOUNT, ZCARD, ZREVRANGE, HMGET) in pipelines;
- the ledger is opened ``mode=ro`` (``ReadOnlyLedger``), never migrated.

Sources of each figure
  depth          LLEN rq:queue:<q>
  running        ZCOUNT rq:wip:<q> (leases; an expired one is also *stuck*)
  retrying       ZCARD rq:scheduled:<q> (waiting out a backoff) less ``later``
  later          ZCOUNT payrun:delayed:<q> from now on (reminders not yet due)
  failed         ZCARD rq:failed:<q>
  oldest         enqueued_at of LINDEX rq:queue:<q> 0 (RQ pops from the left)
  throughput     ZCOUNT rq:finished:<q> by minute: a finished job is scored
                 ended_at + result_ttl, and payrun's jobs keep results FINISHED_TTL_S
  workers        rq:workers -> HGETALL rq:worker:<name>, EXISTS payrun:alive:<name>
  stuck          jobs.reaper.find_stuck (dead worker, lapsed lease) + running longer
                 than lease.stuck_after_s (the rule `payrun status` uses)
  HR line        the ledger's slip counts (payrun.status), ETA from the send rate
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable
from zoneinfo import ZoneInfo

from jobs.events import one_line
from payrun import keys
from payrun.ledger import STATES, Ledger, latest_month
from payrun.ledger import backlog as ledger_backlog
from payrun.ledger import backlog_age_s as ledger_backlog_age_s

FINISHED_TTL_S = 24 * 3600
"""result_ttl of payrun's render and email jobs (payrun/runs.py, jobs/tasks.py): a finished
job's score in rq:finished:<q> is its end time plus this."""
SPARK_MINUTES = 10
"""Throughput history shown per queue, in one-minute buckets (newest last)."""
RATE_WINDOW_MIN = 5
"""The ETA uses the send rate of the last this-many minutes."""
CHANGE_SETTLE_S = 15
"""After the send limits change, the ETA's rate is the one since the change from this many
seconds on (before it, too few sends to tell; those in flight were started under the old)."""
STALL_MIN = 2
"""No slip delivered in the last two minutes (two rolling minute buckets) while some
wait, in a run started more than this many minutes ago: the HR line says so instead of
an ETA from the last RATE_WINDOW_MIN minutes' rate (which read "on time" for minutes
after sending stopped)."""
DEADLINE = (9, 0)
"""The design's promise: every slip delivered by 09:00 (local time, config.timezone)."""
NEAR_TIMEOUT = 0.8
"""A running job past this fraction of its timeout is highlighted."""
PAGE_SIZE = 50
HR_MIN_INTERVAL_S = 2.0
"""The HR line (a scan of the ledger: ~150 ms at 50,000 slips) is recomputed when the
ledger has changed and at most this often; queues, workers and running jobs are read on
every refresh. The snapshot says how old the HR figures are (``status_at``)."""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


def parse_ts(v: Any) -> float | None:
    """An RQ timestamp (``2026-11-01T02:00:01.123456Z``) as a UNIX time."""
    s = _s(v)
    if not s:
        return None
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def paused_queues_key() -> str:
    """Set of queue names whose intake is stopped (`payrun drain --queue Q`)."""
    return getattr(keys, "PAUSED_QUEUES", "payrun:paused-queues")


SUSPENDED_KEY = "rq:suspended"
"""RQ's global suspension flag (rq.suspension): no worker takes a new job."""


# ---- the snapshot -------------------------------------------------------------------

@dataclass
class QueueRow:
    name: str
    depth: int
    running: int
    retrying: int
    failed: int
    oldest_age_s: float | None
    per_min: list[int]
    paused: bool
    later: int = 0
    """Jobs scheduled for later on purpose (`payrun remind`), not yet due: RQ's scheduled
    registry holds them beside the retrying ones, which ``retrying`` counts. (A reminder
    deleted by hand before it is due is still subtracted until its due time; one past due
    that no worker's scheduler has moved yet counts as retrying.)"""
    reminders_per_min: list[int] = field(default_factory=list)
    """Of ``per_min``, reminder emails (send-email only): not slips, so not in the delivery rate."""
    month_per_min: list[int] | None = None
    """Of the last RATE_WINDOW_MIN of ``per_min``, the shown month's slips alone
    (:func:`read_month_finished`), when the console read them: what the ETA counts."""

    @property
    def rate_per_s(self) -> float:
        recent = self.per_min[-RATE_WINDOW_MIN:]
        return sum(recent) / (60.0 * len(recent)) if recent else 0.0

    def slips_finished(self, minutes: int) -> int:
        """Jobs finished in the last ``minutes`` minutes less the reminders sent in them
        (over the whole span: a reminder sent just before a minute's edge can finish just
        after it); of the shown month alone once ``month_per_min`` is read (at most its
        RATE_WINDOW_MIN minutes)."""
        if minutes <= 0:
            return 0
        if self.month_per_min is not None:
            return sum(self.month_per_min[-minutes:])
        return max(0, sum(self.per_min[-minutes:]) - sum(self.reminders_per_min[-minutes:]))


@dataclass
class WorkerRow:
    name: str
    host: str
    pid: int | None
    queues: str
    state: str
    job_id: str | None
    job_elapsed_s: float | None
    heartbeat_age_s: float | None
    alive: bool
    stopping: bool
    kind: str  # render | email | control
    job_returned: str | None = None
    """A worker that lost liveness (killed, or hung) keeps its RQ registration until RQ
    drops it (up to 8 min): the job it held, once no longer running under it (the reaper
    handed it back), is here and ``job_id`` is None."""
    program: str | None = None
    """The supervisord program running it, as `supervisorctl` names it
    (``pdf-render:pdf-render-00``); None when not run by supervisord."""
    host_id: str | None = None
    """Its host's id (payrun.procs.host_id): two machines with one hostname differ here;
    None for a worker of a payrun before session 42."""
    paused_s: float | None = None
    """A send-email lane whose process has paused itself because the provider refuses its
    own credentials (jobs.senders.read_refused): for how long; None when not paused."""
    host_tag: str | None = None
    """The short suffix of ``host_id`` shown after the hostname ("app1/3f2a") when live
    workers of two hosts bear this hostname (console.fmt.host_tags); None otherwise."""

    @property
    def where(self) -> str:
        """host:pid, and the supervisord program when there is one."""
        from console.fmt import tagged

        return f"{tagged(self.host, self.host_tag, 18)}:{self.pid}" + (f" {self.program}" if self.program else "")

    @property
    def shown_host(self) -> str:
        """The hostname, with its host id's suffix when another live host bears it too."""
        from console.fmt import tagged

        return tagged(self.host, self.host_tag)

    @property
    def process(self) -> str:
        """host:pid: one send-email process runs many lanes (each an RQ worker)."""
        return f"{self.host}:{self.pid}"


@dataclass
class RunningRow:
    job_id: str
    queue: str
    worker: str
    elapsed_s: float | None
    timeout_s: float | None
    lease_left_s: float
    stuck: str | None

    @property
    def near_timeout(self) -> bool:
        """At NEAR_TIMEOUT of its timeout or beyond (past it too)."""
        return bool(self.timeout_s and self.elapsed_s is not None and self.elapsed_s >= NEAR_TIMEOUT * self.timeout_s)

    @property
    def past_timeout(self) -> bool:
        """Running longer than its timeout (its worker is being made to stop it, or is gone)."""
        return bool(self.timeout_s and self.elapsed_s is not None and self.elapsed_s > self.timeout_s)


@dataclass
class Limits:
    cap: int
    rate_per_s: float
    in_use: int
    waits: int
    http_429: int
    paused_for_s: float
    outage: dict | None = None
    """The provider failing sends in a row, or down (jobs.limits.read_outage)."""
    duplicates: int = 0
    """Sends the provider deduped: resends of slips it already had (a killed sender's)."""
    waiting_for_rate: int = 0
    """Of in_use, senders waiting for their start under the rate (jobs.limits.waiting_for_rate)."""
    changed_at: float | None = None
    """When the cap or rate last changed in force (jobs.limits.CHANGED_AT), if in the last
    RATE_WINDOW_MIN minutes."""
    sent_since_change: int | None = None
    """Slips sent since ``changed_at`` (send-email finishes, reminders left out)."""
    slots_for_rate: int | None = None
    """The most slots taken at once under the rate (jobs.limits.rate_slots): below the cap,
    the rate holds the sends back, not the cap (`payrun limits show` says it too)."""


@dataclass
class Snapshot:
    taken_at: float
    queues: list[QueueRow] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)
    running: list[RunningRow] = field(default_factory=list)
    limits: Limits | None = None
    status: dict[str, Any] | None = None
    eta: dict[str, Any] | None = None
    suspended: bool = False
    paused_queues: list[str] = field(default_factory=list)
    status_at: float | None = None
    """When the HR figures were computed (they may be up to HR_MIN_INTERVAL_S older)."""
    months: list[str] = field(default_factory=list)
    """Every month with a pay run in the ledger, oldest first."""
    latest_month: str | None = None
    """The run started last: what the overview shows unless a month is pinned."""
    error: str | None = None
    """Set when a part could not be read (the rest of the snapshot is still shown)."""
    redis_down: bool = False
    """Redis could not be read: queues, workers and running jobs are unknown (not zero)."""
    retry_errors: list[tuple[str, int]] = field(default_factory=list)
    """Why jobs are waiting out a backoff: the heads of their last errors, most frequent
    first, over the RETRY_SAMPLE due first (read_retrying)."""
    ledger_backlog: int = 0
    """Workers' events not yet applied to the ledger (the HR figures lag by them)."""
    ledger_backlog_age_s: float = 0.0
    """How old the oldest of them is (a ledger keeping up applies each within ~0.2 s)."""
    refused_senders: list[dict[str, Any]] = field(default_factory=list)
    """Send-email processes paused because the provider refuses their own credentials
    (jobs.senders.read_refused: process, host, pid, since_ms, where), as `payrun workers`
    names them."""
    store_faults: list[dict[str, Any]] = field(default_factory=list)
    """Slip stores that cannot be written, read-only or failing (payrun.slipstore.
    store_faults: host, path, mount, errno, error, since_ms), as `payrun status` names them:
    those hosts' render workers take no render."""
    took_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for q, row in zip(d["queues"], self.queues):
            q["rate_per_s"] = round(row.rate_per_s, 3)
        for r, row in zip(d["running"], self.running):
            r["near_timeout"] = row.near_timeout
            r["past_timeout"] = row.past_timeout
        return d


# ---- the read-only ledger -------------------------------------------------------------

class ReadOnlyLedger(Ledger):
    """The ledger's queries on a ``mode=ro`` connection: no migration, no chmod, no WAL
    switch. Usable from any one thread at a time (the console polls from a worker thread)."""

    def __init__(self, path: Path | str):  # noqa: D107 - deliberately not calling Ledger.__init__
        import sqlite_utils

        self.path = Path(path)
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 2000")
        conn.execute("PRAGMA query_only = 1")
        conn.execute("PRAGMA cache_size = -65536")  # 64 MB: the HR query's pages stay cached
        conn.execute("PRAGMA mmap_size = 268435456")
        self.db = sqlite_utils.Database(conn)

    def data_version(self) -> int:
        """Changes whenever another connection (the `payrun ledger` writer) commits."""
        return int(self.db.conn.execute("PRAGMA data_version").fetchone()[0])


def open_payroll_ro(payroll_path: Path):
    """The payroll db as a read-only ``sqlite_utils.Database`` (None if there is none)."""
    import sqlite_utils

    if not Path(payroll_path).exists():
        return None
    conn = sqlite3.connect(f"file:{payroll_path}?mode=ro", uri=True, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 2000")
    conn.execute("PRAGMA query_only = 1")
    return sqlite_utils.Database(conn)


def company_names(payroll_path: Path) -> dict[int, str]:
    if not Path(payroll_path).exists():
        return {}
    conn = sqlite3.connect(f"file:{payroll_path}?mode=ro", uri=True)
    try:
        return {int(i): n for i, n in conn.execute("SELECT id, name FROM companies")}
    except sqlite3.Error:
        return {}
    finally:
        conn.close()


# ---- readers ------------------------------------------------------------------------

def read_queues(conn, now: float, queues=keys.QUEUES) -> tuple[list[QueueRow], bool, list[str]]:
    """Per queue figures, RQ's global suspension and the paused queues. 2 round trips."""
    with conn.pipeline(transaction=False) as p:
        for q in queues:
            p.llen(f"rq:queue:{q}")
            p.zcount(f"rq:wip:{q}", "-inf", "+inf")
            p.zcard(f"rq:scheduled:{q}")
            p.zcard(f"rq:failed:{q}")
            p.lindex(f"rq:queue:{q}", 0)
            p.zcount(keys.delayed(q), f"({now}", "+inf")
            for i in range(SPARK_MINUTES, 0, -1):
                lo = now - 60 * i + FINISHED_TTL_S
                p.zcount(f"rq:finished:{q}", f"({lo}", lo + 60)
        for i in range(SPARK_MINUTES, 0, -1):  # the same minutes, reminders sent (by send time)
            lo = now - 60 * i
            p.zcount(keys.REMINDERS_SENT, f"({lo}", lo + 60)
        p.exists(SUSPENDED_KEY)
        p.smembers(paused_queues_key())
        res = p.execute()
    reminders = [int(x) for x in res[-2 - SPARK_MINUTES:-2]]
    per = 6 + SPARK_MINUTES
    heads = [res[i * per + 4] for i in range(len(queues))]
    with conn.pipeline(transaction=False) as p:
        for h in heads:
            p.hget(f"rq:job:{_s(h)}", "enqueued_at") if h else p.echo("")
        enq = p.execute()
    paused = sorted(_s(m) for m in res[-1])
    rows = []
    for i, q in enumerate(queues):
        r = res[i * per:(i + 1) * per]
        t = parse_ts(enq[i])
        later = min(int(r[5]), int(r[2]))
        rows.append(QueueRow(q, int(r[0]), int(r[1]), int(r[2]) - later, int(r[3]),
                             max(0.0, now - t) if t else None, [int(x) for x in r[6:]], q in paused, later,
                             reminders if q == keys.EMAIL_QUEUE else []))
    return rows, bool(res[-2]), paused


RETRY_SAMPLE = 100
"""Retrying jobs whose last errors the overview reads per refresh (the ones due first)."""


def error_head(text: str) -> str:
    """What a failure was, short and shared by its kind: "HTTP 503 provider outage" of
    "provider 127.0.0.1:8025: HTTP 503 provider outage: try later"."""
    from console.failed import short_error
    from console.fmt import cells_head, columns

    head = short_error(text).split(": ")[0].strip()
    # (cut at 48 columns, not mid-clause: "provider down (11 sends in a row failed),  ×1";
    # columns, not len: CJK text takes two a character, a Bengali vowel sign none)
    if columns(head) > 48:
        cut = cells_head(head, 48)
        if "; " in cut:  # ("waited too long for the global send rate; retryi ×100": at a clause,
            cut = cut[: cut.rindex("; ")]  # else at a word)
        elif head[len(cut)] != " " and " " in cut:
            cut = cut[: cut.rindex(" ")]
        head = cut.rstrip(" ,;")
    return head


def read_retrying(conn, sample: int = RETRY_SAMPLE, queues=(keys.RENDER_QUEUE, keys.EMAIL_QUEUE)) -> list[tuple[str, int]]:
    """The last errors of the jobs waiting out a backoff (RQ's scheduled registries; a
    reminder scheduled for later has none and is left out), grouped by ``error_head``,
    most frequent first. 2 round trips. Without it an outage the provider answers with
    every other send (never "N failed in a row") showed only as a retry count."""
    with conn.pipeline(transaction=False) as p:
        for q in queues:
            p.zrange(f"rq:scheduled:{q}", 0, sample - 1)
        ids = [_s(m) for ms in p.execute() for m in ms][:sample]
    from collections import Counter

    from console.failed import metas

    return Counter(error_head(str(err)) for _, meta in metas(conn, ids)
                   if (err := meta.get("last_error"))).most_common()


class MonthFinished:
    """The shown month's slip jobs that finished on a queue in each of the last
    RATE_WINDOW_MIN minutes (the buckets of :func:`read_queues`' ``per_min``): ids
    ``render-<month>-…`` / ``email-<month>-…`` (a resend's send too; a reminder,
    ``remind-…``, never). The finished registries hold every month's jobs for a day, so
    a catch-up run of last month beside this one (or a run just ended) otherwise counts
    in this month's rate and stall check.

    Read incrementally: the first call reads the window (~12,000 ids at 40 sends/s, ~10
    ms), each later one only what was added since, less OVERLAP_S (RQ scores a finished
    job by the moment it is recorded plus its result_ttl, on the recording host's clock:
    a host up to OVERLAP_S behind is still counted)."""

    OVERLAP_S = 30.0

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], tuple[float, list[float]]] = {}
        # (queue, month) -> (read up to this score, the month's scores read in the window)

    def buckets(self, conn, now: float, month: str, queue: str) -> list[int]:
        from bisect import bisect_right

        lo = now - 60 * RATE_WINDOW_MIN + FINISHED_TTL_S
        hi = lo + 60 * RATE_WINDOW_MIN
        prefix = f"{'email' if queue == keys.EMAIL_QUEUE else 'render'}-{month}-".encode()
        upto, scores = self._seen.get((queue, month), (lo, []))
        if upto > hi:  # the clock stepped back: read the window afresh
            upto, scores = lo, []
        start = max(lo, min(upto, hi) - self.OVERLAP_S)
        fresh = conn.zrangebyscore(f"rq:finished:{queue}", f"({start}", "+inf", withscores=True)
        scores = scores[bisect_right(scores, lo):bisect_right(scores, start)]
        scores += [score for member, score in fresh if member.startswith(prefix)]
        scores.sort()  # (fresh is in order already)
        self._seen = {k: v for k, v in self._seen.items() if k[0] != queue}  # one month per queue kept
        self._seen[(queue, month)] = (hi, scores)
        edges = [bisect_right(scores, lo + 60 * i) for i in range(RATE_WINDOW_MIN + 1)]
        return [edges[i + 1] - edges[i] for i in range(RATE_WINDOW_MIN)]


def read_month_finished(conn, now: float, month: str, queue: str) -> list[int]:
    """:class:`MonthFinished`'s buckets, read whole (one round trip)."""
    return MonthFinished().buckets(conn, now, month, queue)


def _kind(name: str, queues: str) -> str:
    if keys.EMAIL_QUEUE in queues.split(","):
        return "email"
    if keys.RENDER_QUEUE in queues.split(","):
        return "render"
    # a record that lost its fields (its key lapsed, then one write recreated it) still
    # has payrun's name: email.<host>.<pid>.<lane>, render.<host>.<pid>
    for prefix, kind in (("email.", "email"), ("render.", "render")):
        if name.startswith(prefix):
            return kind
    return "control"


def read_workers(conn, now: float) -> list[WorkerRow]:
    wkeys = sorted(_s(k) for k in conn.smembers("rq:workers"))
    if not wkeys:
        return []
    with conn.pipeline(transaction=False) as p:
        for k in wkeys:
            p.hgetall(k)
            p.exists(keys.alive(k.split(":", 2)[-1]))
        res = p.execute()
    infos = []
    for i, k in enumerate(wkeys):
        h = {_s(a): _s(b) for a, b in res[2 * i].items()}
        if not h or h.get("death"):
            continue
        infos.append((k.split(":", 2)[-1], h, bool(res[2 * i + 1])))
    with conn.pipeline(transaction=False) as p:
        for _, h, _ in infos:
            if h.get("current_job"):
                p.hmget(f"rq:job:{h['current_job']}", "started_at", "status", "worker_name")
            else:
                p.echo("")
        started = p.execute()
    out = []
    for (name, h, alive), job in zip(infos, started):
        job_id = h.get("current_job") or None
        st, status, runner = (_s(v) for v in job) if job_id else ("", "", "")
        returned = None
        if job_id and not alive and (status != "started" or (runner and runner != name)):
            job_id, returned = None, job_id  # the reaper gave it back (or it ended): not this worker's now
        hb = parse_ts(h.get("last_heartbeat"))
        t0 = parse_ts(st) if job_id else None
        pid = int(h["pid"]) if h.get("pid", "").isdigit() else None
        host = h.get("hostname")
        parts = name.split(".")
        if (pid is None or not host) and len(parts) >= 3 and parts[0] in ("email", "render") \
                and parts[2].isdigit():  # a record that lost its fields: payrun's name says them
            host, pid = host or parts[1], pid or int(parts[2])
        out.append(WorkerRow(
            name=name, host=host or "?", pid=pid, queues=h.get("queues", ""),
            state=h.get("state", "?"), job_id=job_id,
            job_elapsed_s=max(0.0, now - t0) if t0 else None,
            heartbeat_age_s=max(0.0, now - hb) if hb else None, alive=alive,
            stopping=bool(h.get("shutdown_requested_date")), kind=_kind(name, h.get("queues", "")),
            job_returned=returned, program=h.get("program") or None, host_id=h.get("host_id") or None,
        ))
    return out


def tag_hosts(workers: list[WorkerRow]) -> list[WorkerRow]:
    """Mark ``workers`` whose hostname live workers of another host id bear too with their
    host id's suffix (``host_tag``, console.fmt.host_tags): two containers named alike
    showed as one host. Returns ``workers``."""
    from console.fmt import host_tags

    tags = host_tags(workers)
    for w in workers:
        w.host_tag = tags.get((w.host, w.host_id or ""))
    return workers


def read_paused_senders(conn, workers: list[WorkerRow], now: float) -> list[dict[str, Any]]:
    """The send-email processes paused because the provider refuses their own credentials
    (jobs.senders.read_refused), and their lanes in ``workers`` marked (``paused_s``). The
    console said nothing of them: a paused process read "idle" beside a queue with work.
    Each entry gets its lanes' ``host_id`` and ``host_tag`` (None when no lane is listed)."""
    from jobs.senders import read_refused

    refused = read_refused(conn, now_ms=now * 1000)
    by = {(r["host"], r["pid"]): r for r in refused}
    for r in refused:
        r.setdefault("host_id", None)
        r.setdefault("host_tag", None)
    for w in workers:
        if w.kind == "email" and (r := by.get((w.host, w.pid))) is not None:
            w.paused_s = max(0.0, now - r["since_ms"] / 1000)
            r["host_id"], r["host_tag"] = w.host_id, w.host_tag
    return refused


def read_running(conn, now: float, stuck_after_s: float, queues=keys.QUEUES) -> list[RunningRow]:
    from jobs.reaper import find_stuck

    with conn.pipeline(transaction=False) as p:
        for q in queues:
            p.zrange(f"rq:wip:{q}", 0, -1, withscores=True)
        wips = p.execute()
    entries = [(q, _s(m).split(":", 1)[0], float(score)) for q, w in zip(queues, wips) for m, score in w]
    if not entries:
        return []
    with conn.pipeline(transaction=False) as p:
        for _, job_id, _ in entries:
            p.hmget(f"rq:job:{job_id}", "started_at", "timeout", "worker_name")
        fields = p.execute()
    stuck = {s.job_id: s.reason for s in find_stuck(conn, now, queues)}
    out = []
    for (q, job_id, lease), (st, to, w) in zip(entries, fields):
        t0 = parse_ts(st)
        elapsed = max(0.0, now - t0) if t0 else None
        reason = stuck.get(job_id)
        if reason is None and elapsed is not None and elapsed > stuck_after_s:
            reason = f"running {elapsed / 60:.0f} min (over {stuck_after_s / 60:g} min)"
        out.append(RunningRow(job_id, q, _s(w), elapsed, float(_s(to)) if _s(to) else None, lease - now, reason))
    out.sort(key=lambda r: -(r.elapsed_s or 0))
    return out


def read_limits(conn, cfg, now: float | None = None) -> Limits:
    """The email limit's figures; ``now`` (the console's clock) for the sends since the last
    change of the limits (the slots' leases are always read against this host's clock)."""
    name = "email"
    now_ms = int(time.time() * 1000)
    with conn.pipeline(transaction=False) as p:
        p.hgetall(keys.limit_conf(name))
        p.zcount(keys.limit_slots(name), now_ms, "+inf")
        p.hgetall(keys.limit_stats(name))
        p.pttl(keys.limit_pause(name))
        p.hgetall(keys.limit_outage(name))
        p.get(keys.limit_tat(name))
        conf, in_use, stats, pause, outage_raw, tat = p.execute()
    conf = {_s(k): _s(v) for k, v in conf.items()}
    stats = {_s(k): int(v) for k, v in stats.items()}
    from jobs.limits import outage_from

    from jobs.limits import rate_slots, waiting_for_rate
    from jobs.policy import start_wait_budget_s

    outage = outage_from(outage_raw, pause, now_ms=now_ms)
    rate = float(conf.get("rate_per_s", cfg.limits.email_rate_per_s))
    changed_at, sent = _sent_since_change(conn, conf, now_ms / 1000 if now is None else now)
    return Limits(cap=int(float(conf.get("cap", cfg.limits.email_concurrency))), rate_per_s=rate,
                  in_use=int(in_use), waits=stats.get("waits", 0), http_429=stats.get("http_429", 0),
                  paused_for_s=max(0, int(pause)) / 1000, outage=outage, duplicates=stats.get("duplicates", 0),
                  waiting_for_rate=waiting_for_rate(float(tat) if tat else None, now_ms, rate, int(in_use)),
                  changed_at=changed_at, sent_since_change=sent,
                  slots_for_rate=rate_slots(rate, start_wait_budget_s(cfg.email.timeout_s)))


def _sent_since_change(conn, conf: dict[str, str], now: float) -> tuple[float | None, int | None]:
    """(when the send limits last changed, slips sent since) if that was in the last
    RATE_WINDOW_MIN minutes, else (None, None). One more round trip only then."""
    from jobs.limits import CHANGED_AT

    try:
        at = float(conf.get(CHANGED_AT) or "")
    except ValueError:
        return None, None
    if not 0 <= now - at < 60 * RATE_WINDOW_MIN:
        return None, None
    with conn.pipeline(transaction=False) as p:
        p.zcount(f"rq:finished:{keys.EMAIL_QUEUE}", f"({at + FINISHED_TTL_S}", "+inf")
        p.zcount(keys.REMINDERS_SENT, f"({at}", "+inf")
        finished, reminders = p.execute()
    return at, max(0, int(finished) - int(reminders))


def hr_report(ledger: Ledger, names: dict[int, str], stuck_after_s: float, redis_stuck: list[str],
              month: str | None = None, now: float | None = None,
              no_slip: dict[int, int] | None = None,
              no_salary_line: dict[int, int] | None = None,
              no_slip_final: dict[int, int] | None = None) -> dict[str, Any]:
    """The same figures as payrun.status.report (per company and total), from a read-only
    ledger, the stuck ids already found in Redis and ``no_slip`` (per company, employees
    with salary lines and no slip, added after the run or of a company it never covered:
    payrun.runs.no_slip) and ``no_salary_line`` (per company of the run, active employees with
    no salary line for the month: payrun.payroll.without_salary_line) and ``no_slip_final``
    (of ``no_slip``, leavers the month pays, their final slip, whom its run left out)."""
    if month is None:
        month = ledger.latest_month()
    counts = ledger.slip_counts(month) if month else {}
    if month:
        for _, cid in ledger.stuck_jobs(month, stuck_after_s, redis_stuck, now=now).items():
            if cid in counts:
                counts[cid]["stuck"] += 1
    no_slip = no_slip or {}
    no_salary_line = no_salary_line or {}
    no_slip_final = no_slip_final or {}
    total = {s: 0 for s in STATES} | {"stuck": 0, "total": 0, "no_slip": 0, "no_salary_line": 0, "no_slip_final": 0}
    companies = []
    for cid in sorted(set(counts) | set(no_slip)):
        row = counts.get(cid, {k: 0 for k in (*STATES, "stuck", "total")}) | {
            "no_slip": no_slip.get(cid, 0), "no_salary_line": no_salary_line.get(cid, 0),
            "no_slip_final": no_slip_final.get(cid, 0)}
        for k in total:
            total[k] += row.get(k, 0)
        companies.append({"id": cid, "name": names.get(cid, f"company {cid}"), **row})
    return {"month": month, "total": total, "companies": companies}


def unserved(queues: list[QueueRow], workers: list[WorkerRow]) -> list[str]:
    """The slip queues with work (waiting, or retries due back) that no live worker takes
    from: nothing there moves until one starts (`payrun up`)."""
    served = {q.strip() for w in workers if w.alive and not w.stopping for q in w.queues.split(",")}
    return [q.name for q in queues
            if q.name in (keys.RENDER_QUEUE, keys.EMAIL_QUEUE) and (q.depth or q.retrying) and q.name not in served]


def renders_to_make(queues: list[QueueRow]) -> bool:
    """Whether any render is still to be made: waiting, running, or held / waiting out a
    backoff in the pdf-render queue. (Seen live, session 43: with every render made and 949
    sends left, a store remounted read-only read "no ETA: … every render waits".) Pure."""
    return any(q.depth or q.running or q.retrying for q in queues if q.name == keys.RENDER_QUEUE)


def stalled(queues: list[QueueRow], running_s: float | None) -> bool:
    """No slip delivered (send-email finishes, reminders left out) in the current and the
    previous minute, in a run going for more than STALL_MIN minutes."""
    email = next((q for q in queues if q.name == keys.EMAIL_QUEUE), None)
    return (email is not None and running_s is not None and running_s > 60 * STALL_MIN
            and email.slips_finished(2) == 0)


def _remaining(total: dict[str, int]) -> int:
    return max(0, total.get("total", 0) - total.get("done", 0) - total.get("failed", 0))


def eta(total: dict[str, int], rate_per_s: float, now: float, tz: str, drained: bool = False,
        provider_down_s: float | None = None, started: float | None = None,
        no_worker: list[str] | None = None, stalled: bool = False, redis_down: bool = False,
        store_free: int | None = None, store: str | None = None,
        store_faults: list[dict[str, Any]] | None = None, renders_left: bool = True) -> dict[str, Any]:
    """When the last slip should be delivered at the recent rate, and whether that is
    before the 09:00 deadline: the first one at or after ``started`` (when the run
    began: a run started at 01:00 and still going at 09:05 is late, not on time for
    tomorrow's 09:00), or without it the next one after ``now``. ``drained``: intake is
    stopped on a queue every slip passes through, so nothing will arrive until a resume.
    ``provider_down_s``: the email provider has been down this long (an outage pause):
    no slip is delivered until it answers, so no time is promised; ``if_back_now`` says
    when the rest would be delivered if it answered now, at ``rate_per_s``. ``no_worker``:
    queues with slips waiting and no live worker (``unserved``): no time is promised
    either (the recent rate may be another month's, or the workers' before they went).
    ``stalled``: no slip delivered for 2 minutes (:func:`stalled`): no time is promised.
    ``redis_down``: the queues could not be read: the rate is unknown, not zero.
    ``store_free``: the slip store's room; below jobs.policy.STORE_ROOM_MIN_BYTES it is
    full and no render is made until space is freed: no time is promised (the session-42
    drill's console read "ETA 14:25 — on time" with every render waiting on a full store).
    ``store``: its path, said with it (``store_full_at``): what to free at 02:00.
    ``store_faults``: slip stores that cannot be written (payrun.slipstore.store_faults:
    read-only, a failing disk): their hosts' renders wait, so no time is promised either
    (session 43: the console read "ETA 17:51 — on time" with every render held by a store
    remounted read-only); ``store_fault`` names the first (host, path, mount, errno,
    error), ``store_faults`` counts them. ``renders_left``: renders are still to be made
    (:func:`renders_to_make`); once none is, a full or unwritable store holds nothing back
    (sends only read their slips) and the ETA is promised as usual."""
    from jobs.policy import STORE_ROOM_MIN_BYTES

    remaining = _remaining(total)
    zone = ZoneInfo(tz)
    local = datetime.fromtimestamp(now, zone)
    anchor = datetime.fromtimestamp(min(started, now), zone) if started else local
    deadline = anchor.replace(hour=DEADLINE[0], minute=DEADLINE[1], second=0, microsecond=0)
    if deadline < anchor:
        deadline += timedelta(days=1)
    out: dict[str, Any] = {"remaining": remaining, "rate_per_s": round(rate_per_s, 3),
                           "deadline": deadline.isoformat(), "at": None, "on_time": None,
                           "drained": drained and remaining > 0, "no_slip": total.get("no_slip", 0),
                           "no_salary_line": total.get("no_salary_line", 0),
                           "failed": total.get("failed", 0),
                           "provider_down_s": provider_down_s if remaining > 0 else None,
                           "no_worker": list(no_worker or []) if remaining > 0 and not drained else [],
                           "stalled": stalled and remaining > 0, "redis_down": redis_down and remaining > 0,
                           "store_full_free": (store_free if remaining > 0 and renders_left and store_free is not None
                                               and store_free < STORE_ROOM_MIN_BYTES else None)}
    if out["store_full_free"] is not None and store:
        out["store_full_at"] = store
    faults = list(store_faults or []) if remaining > 0 and renders_left else []
    out["store_faults"] = len(faults)
    out["store_fault"] = ({k: faults[0].get(k) for k in ("host", "path", "mount", "errno", "error")}
                          if faults else None)
    if remaining == 0:
        out.update(at=local.isoformat(), on_time=True)
    elif (drained or out["no_worker"] or out["redis_down"] or out["store_full_free"] is not None
          or out["store_fault"] is not None):
        pass  # no ETA: nothing moves until `payrun resume` / a worker starts; or unknown
    elif provider_down_s is not None:
        if rate_per_s > 0:
            back = local + timedelta(seconds=remaining / rate_per_s)
            out.update(if_back_now=back.isoformat(), on_time_if_back_now=back <= deadline,
                       back_within_a_minute=remaining / rate_per_s < 60)
    elif rate_per_s > 0 and not out["stalled"]:
        at = local + timedelta(seconds=remaining / rate_per_s)
        out.update(at=at.isoformat(), on_time=at <= deadline)
    return out


def connect(cfg, url: str):
    """A client that fails fast: 2 s timeouts and no retries, so a Redis outage shows on
    screen within seconds (redis-py would otherwise back off and retry for longer)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from payrun import redis_server

    return redis_server.connect(cfg, url, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))


# ---- the source ---------------------------------------------------------------------

class Source:
    """Everything the console reads, for one configuration. ``snapshot()`` never raises:
    a part that fails leaves its previous value out and sets ``error``."""

    def __init__(self, cfg, conn=None, clock: Callable[[], float] = time.time, action_conn=None,
                 month: str | None = None):
        self.cfg = cfg
        self.clock = clock
        self.month = month
        """The pay run shown; None follows the run started last (``Ledger.latest_month``)."""
        self._conn = conn
        self._action_conn = action_conn if action_conn is not None else conn
        self._ledger: ReadOnlyLedger | None = None
        self._payroll = None
        self._names: dict[int, str] | None = None
        self._lock = threading.Lock()
        self._hr: tuple[int, float, tuple, tuple, dict] | None = None
        # (ledger data_version, computed at, stuck ids, (month, no_slip counts), report)
        self._no_slip: tuple[tuple, dict[int, int]] | None = None  # (what it depends on, counts)
        self._no_salary_line: dict[int, int] = {}  # counted with _no_slip: active, no salary line
        self._no_slip_final: dict[int, int] = {}  # of _no_slip: leavers' final slips the run left out
        self._month_finished = MonthFinished()

    @property
    def conn(self):
        """For looking: the read-only Redis user where there is one (the embedded server
        has it; an external Redis needs redis.readonly_url), so a read cannot write."""
        if self._conn is None:
            from payrun import redis_server

            self._conn = connect(self.cfg, redis_server.url(self.cfg, readonly=True))
        return self._conn

    @property
    def action_conn(self):
        """For confirmed actions only: the full-rights client."""
        if self._action_conn is None:
            from payrun import redis_server

            self._action_conn = connect(self.cfg, redis_server.url(self.cfg))
        return self._action_conn

    def ledger(self) -> ReadOnlyLedger | None:
        if self._ledger is None and Path(self.cfg.ledger_path).exists():
            self._ledger = ReadOnlyLedger(self.cfg.ledger_path)
        return self._ledger

    def names(self) -> dict[int, str]:
        if not self._names:
            self._names = company_names(self.cfg.payroll_path)
        return self._names

    def months(self) -> list[str]:
        """Every month with a pay run in the ledger, oldest first. (For the CLI: the console
        reads ``Snapshot.months``, so that no key waits on this lock.)"""
        with self._lock:
            led = self.ledger()
            return led.months() if led is not None else []

    def no_slip(self, led: ReadOnlyLedger, month: str | None, rows: list[dict[str, Any]]) -> dict[int, int]:
        """Per company, employees with salary lines for ``month`` and no slip (as `payrun
        status` counts them). Recounted only when the month, the payroll db (an import) or
        the month's run rows (``rows``: a `run --resume` updates them) have changed. Empty when this
        host has no payroll db; raises sqlite3.Error when it cannot be read."""
        from payrun.runs import missing_slip_ids, not_run

        if not month:
            self._no_salary_line, self._no_slip_final = {}, {}
            return {}
        if self._payroll is None:
            self._payroll = open_payroll_ro(self.cfg.payroll_path)
            if self._payroll is None:
                self._no_salary_line, self._no_slip_final = {}, {}
                return {}
        version = self._payroll.conn.execute("PRAGMA data_version").fetchone()[0]
        runs = tuple((r["company_id"], r["status"], r["jobs"], r["updated_at"]) for r in rows)
        key = (month, version, runs)
        if self._no_slip is not None and (self._no_slip[0] == key or (
                self._no_slip[0][0] == month and any(r["status"] == "fanning-out" for r in rows))):
            return self._no_slip[1]  # (a fan-out changes its rows 60 times; ~0.4 s a count at 50,000)
        missing = missing_slip_ids(led, self._payroll, month)  # (payrun.runs.no_slip, the leavers told apart)
        counts = {cid: len(ids) for cid, ids in missing.items()} | not_run(led, self._payroll, month)
        from payrun.payroll import left_on, without_salary_line

        left = set(left_on(self._payroll, sorted(e for ids in missing.values() for e in ids)))
        self._no_slip_final = {cid: n for cid, ids in missing.items() if (n := len(ids & left))}

        self._no_salary_line = {cid: len(ids) for cid, ids in without_salary_line(
            self._payroll, month, sorted({r["company_id"] for r in rows}), led.employees_with_jobs(month)).items()}
        self._no_slip = (key, counts)
        return counts

    # -- the overview ---------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            t0 = time.perf_counter()
            now = self.clock()
            snap = Snapshot(taken_at=now)
            errors = []
            try:
                conn = self.conn
                snap.queues, snap.suspended, snap.paused_queues = read_queues(conn, now)
                snap.workers = tag_hosts(read_workers(conn, now))
                snap.running = read_running(conn, now, self.cfg.lease.stuck_after_s)
                snap.limits = read_limits(conn, self.cfg, now)
                snap.retry_errors = read_retrying(conn)
                snap.refused_senders = read_paused_senders(conn, snap.workers, now)
                snap.ledger_backlog = ledger_backlog(conn)  # (`payrun status` said the ledger was behind; we did not)
                snap.ledger_backlog_age_s = round(ledger_backlog_age_s(conn), 1) if snap.ledger_backlog else 0.0
            except Exception as e:  # Redis down or slow: say so, keep going with the ledger
                errors.append(f"Redis unreachable ({type(e).__name__}: {one_line(e, 200)})")
                snap.queues, snap.workers, snap.running = [], [], []
                snap.redis_down = True
                self._month_finished = MonthFinished()  # a Redis back without its data: read afresh
            from payrun import slipstore

            # (read-only, a failing disk: the console read "ETA … on time" and its render workers "idle")
            snap.store_faults = slipstore.store_faults(None if snap.redis_down else self.conn,
                                                       self.cfg.slips_dir, now)
            try:
                led = self.ledger()
                if led is not None:
                    stuck_ids = tuple(sorted(r.job_id for r in snap.running if r.stuck))
                    runs = led.runs()  # read once: the months, the run started last, the shown month's rows
                    snap.months = sorted({r["month"] for r in runs})
                    snap.latest_month = latest_month(runs)
                    month = self.month or snap.latest_month
                    rows = [r for r in runs if r["month"] == month]
                    snap.status, snap.status_at = self._hr_report(led, stuck_ids, now, month, rows, errors)
                    started = max((parse_ts(r["created_at"]) or 0.0 for r in rows), default=0.0)
                    if month and not snap.redis_down and _remaining(snap.status["total"]):
                        self._month_rates(snap.queues, now, month)
                    lim = snap.limits
                    changed = (lim is not None and lim.changed_at is not None and lim.sent_since_change is not None
                               and lim.changed_at > started)  # (before the run: the run's own start counts)
                    rate = self.delivery_rate(snap.queues, now - started if started else None,
                                              lim.rate_per_s if lim else None,
                                              (now - lim.changed_at, lim.sent_since_change) if changed else None)
                    drained = snap.suspended or bool({keys.RENDER_QUEUE, keys.EMAIL_QUEUE} & set(snap.paused_queues))
                    out = snap.limits.outage if snap.limits else None
                    down = out["for_s"] if out and out["pauses"] else None
                    running_s = now - started if started else None
                    snap.eta = eta(snap.status["total"], rate, now, self.cfg.timezone, drained, down,
                                   started=started or None, no_worker=unserved(snap.queues, snap.workers),
                                   stalled=stalled(snap.queues, running_s), redis_down=snap.redis_down,
                                   store_free=self._store_free(), store=str(self.cfg.slips_dir),
                                   store_faults=snap.store_faults,
                                   renders_left=snap.redis_down or renders_to_make(snap.queues))
            except Exception as e:
                errors.append(f"ledger unreadable ({type(e).__name__}: {one_line(e, 200)})")
            snap.error = "; ".join(errors) or None
            snap.took_s = time.perf_counter() - t0
            return snap

    def _store_free(self) -> int | None:
        """The slip store's room (statvfs), None where it cannot be told (not mounted here)."""
        try:
            st = os.statvfs(self.cfg.slips_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _hr_report(self, led: ReadOnlyLedger, stuck_ids: tuple, now: float, month: str | None,
                   rows: list[dict[str, Any]], errors: list[str]) -> tuple[dict[str, Any], float]:
        version = led.data_version()
        try:
            no_slip = self.no_slip(led, month, rows)
        except sqlite3.Error as e:  # the HR line stands without it
            no_slip, self._no_salary_line, self._no_slip_final = {}, {}, {}
            errors.append(f"payroll db unreadable ({str(e)[:60]}): employees with no slip not counted")
        if self._hr is not None:
            v, at, ids, key, report = self._hr
            same = ids == stuck_ids and key == (month, no_slip, self._no_salary_line, self._no_slip_final)
            if same and (v == version or time.monotonic() - at < HR_MIN_INTERVAL_S):
                return report, self._hr_taken
        report = hr_report(led, self.names(), self.cfg.lease.stuck_after_s, list(stuck_ids), month=month, now=now,
                           no_slip=no_slip, no_salary_line=self._no_salary_line, no_slip_final=self._no_slip_final)
        self._hr = (version, time.monotonic(), stuck_ids, (month, no_slip, self._no_salary_line, self._no_slip_final),
                    report)
        self._hr_taken = now
        return report, now

    def _month_rates(self, queues: list[QueueRow], now: float, month: str) -> None:
        """Count the shown month's slips alone in the rate and stall check
        (:func:`read_month_finished`): the sends, and the renders only while no send of
        the month has finished (the rate falls back to them then)."""
        by = {q.name: q for q in queues}
        try:
            for name in (keys.EMAIL_QUEUE, keys.RENDER_QUEUE):
                if name in by:
                    by[name].month_per_min = self._month_finished.buckets(self.conn, now, month, name)
                    if sum(by[name].month_per_min):
                        break
        except Exception:  # noqa: BLE001 - Redis went away since the queues were read: every month's rate
            self._month_finished = MonthFinished()
            for q in queues:
                q.month_per_min = None

    @staticmethod
    def delivery_rate(queues: list[QueueRow], running_s: float | None = None,
                      send_limit_per_s: float | None = None,
                      since_change: tuple[float, int] | None = None) -> float:
        """Slips delivered per second recently: the send rate (reminder emails left out),
        or before any send has finished, the render rate (every slip passes through both).
        ``running_s``: how long ago the run started; in its first RATE_WINDOW_MIN minutes
        the rate is over that time (at least 10 s), not over empty minutes before it (which
        read as LATE). The last minute's pace counts when it is faster than the window's
        (sending back at full speed after an outage, a pause or a raised limit: the window
        alone read LATE for minutes), and the send rate never counts above
        ``send_limit_per_s``, the limit in force (a lowered limit counts at once).
        ``since_change``: (seconds since the cap or rate last changed, slips sent since):
        from CHANGE_SETTLE_S after a change until the window has passed it, the send rate
        is at most the one since the change (a cap lowered to 10, at 1.2 s a send, sends
        ~8/s, which no rate limit says: the minutes before it promised the old pace for up
        to RATE_WINDOW_MIN minutes). Only ever lower: the count is every month's sends, and
        a raised limit's pace is the last minute's, as above."""
        early = running_s is not None and running_s < 60 * RATE_WINDOW_MIN
        by = {}
        for q in queues:
            minutes = len(q.per_min[-RATE_WINDOW_MIN:])
            if not minutes:
                by[q.name] = 0.0
                continue
            window = max(10.0, running_s) if early else 60.0 * minutes
            rate = q.slips_finished(minutes) / window
            if not early or running_s >= 60:
                rate = max(rate, q.slips_finished(1) / 60.0)
            by[q.name] = rate
        sends = by.get(keys.EMAIL_QUEUE)
        if since_change and sends and CHANGE_SETTLE_S <= since_change[0] < 60 * RATE_WINDOW_MIN:
            sends = min(sends, since_change[1] / since_change[0])
        if sends:
            return min(sends, send_limit_per_s) if send_limit_per_s else sends
        return by.get(keys.RENDER_QUEUE) or 0.0

    # -- failed jobs ---------------------------------------------------------------
    def failed_page(self, flt: "FailedFilter", offset: int = 0, limit: int = PAGE_SIZE) -> "FailedPage":
        with self._lock:
            from console import failed

            led = self.ledger()
            page = failed.page(self.conn, led, flt, offset, limit)
            fixed = self._readdressed([r["id"] for r in page.rows if r.get("permanent")])
            ids = [r["id"] for r in page.rows]  # (`payrun failed` marks them: a retry emails the slip again)
            resent = set(ids) - set(failed._without_resent(led, ids))
            new = self._new_addresses(sorted(fixed))
            for r in page.rows:
                r["address_changed"] = r["id"] in fixed
                r["delivered_by_resend"] = r["id"] in resent
                if r["id"] in new:
                    r["new_address"] = new[r["id"]]
            return page

    def _readdressed(self, ids: list[str]) -> set[str]:
        """Of failed jobs ``ids``, the sends refused for an address the payroll db has
        changed since (payrun.deadletters.readdressed); none without a payroll db here."""
        from payrun.deadletters import readdressed

        if not ids:
            return set()
        if self._payroll is None:
            self._payroll = open_payroll_ro(self.cfg.payroll_path)
        try:
            return readdressed(self.conn, ids, self._payroll) if self._payroll is not None else set()
        except sqlite3.Error:
            return set()

    def _new_addresses(self, ids: list[str]) -> dict[str, str]:
        """Of failed sends ``ids`` (refused for an address changed since), job id -> the
        address the payroll db has now for its employee (by the slip key in its meta):
        what the retry dialog names as the one the retry goes to."""
        from console import failed
        from payrun import payroll

        if not ids or self._payroll is None:
            return {}
        emp_of = {}
        for job_id, meta in failed.metas(self.conn, ids):
            parts = str(meta.get("key") or "").split(":")  # slip:<month>:<employee>[:resend-<n>]
            if len(parts) >= 3 and parts[0] == "slip":
                emp_of[job_id] = parts[2]
        try:
            now = payroll.emails(self._payroll, sorted(set(emp_of.values())))
        except sqlite3.Error:
            return {}
        return {i: now[e] for i, e in emp_of.items() if now.get(e)}

    def failed_ids(self, flt: "FailedFilter") -> list[str]:
        with self._lock:
            from console import failed

            return failed.matching_ids(self.conn, self.ledger(), flt)

    def permanent_among(self, ids: list[str]) -> list[str]:
        with self._lock:
            from console import failed

            permanent = failed.permanent_among(self.conn, ids)
            fixed = self._readdressed(permanent)  # (a retry sends those to the new address)
            return [i for i in permanent if i not in fixed]

    def retry_preview(self, job_ids: list[str]) -> dict[str, Any]:
        """What `:retry ID…` says before it asks (reads only): ``not_failed``, the ids in no
        failed registry; ``unreadable``, id -> why for failed jobs whose data is missing or
        not JSON (`payrun retry` refuses them: nothing to run); of the others,
        ``address_changed`` (a send refused for an address the payroll data has changed
        since: the retry goes to the new one, as `payrun failed`/`retry` say),
        ``permanent`` (failed on the employee's data: fails again unless fixed first),
        ``delivered_by_resend``, ``errors`` (id -> its last error) and ``new_address``
        (id -> the address an ``address_changed`` send goes to now)."""
        from console import failed
        from console.actions import not_failed
        from jobs.runtime import PayrunJob
        from payrun.deadletters import unreadable_job

        with self._lock:
            conn = self.conn
            missing = not_failed(conn, list(job_ids))
            unreadable: dict[str, str] = {}
            for job_id in job_ids:
                if job_id in missing:
                    continue
                try:  # as `payrun retry` reads it (RQ stores the data compressed: read by RQ first)
                    PayrunJob.fetch(job_id, connection=conn).func_name
                except Exception:  # noqa: BLE001 - no data, data not JSON (or gone meanwhile: the action says)
                    if (u := unreadable_job(conn, job_id)) is not None:
                        unreadable[job_id] = u["unreadable"]
            rest = [i for i in job_ids if i not in missing and i not in unreadable]
            metas = dict(failed.metas(conn, rest))
            on_data = [i for i in rest if metas[i].get("permanent")]
            fixed = self._readdressed(on_data)
            resent = set(rest) - set(failed._without_resent(self.ledger(), rest))
            return {"not_failed": missing, "unreadable": unreadable,
                    "address_changed": [i for i in rest if i in fixed],
                    "permanent": [i for i in on_data if i not in fixed],
                    "delivered_by_resend": [i for i in rest if i in resent],
                    "errors": {i: metas[i].get("last_error") or "" for i in rest},
                    "new_address": self._new_addresses([i for i in rest if i in fixed])}

    def _on_file_of(self, employee: str):
        """(name, address) of an employee in the payroll database now, or None."""
        if self._payroll is None:
            self._payroll = open_payroll_ro(self.cfg.payroll_path)
        if self._payroll is None:
            return None
        return self._payroll.conn.execute("SELECT name_en, email FROM employees WHERE id = ?", (employee,)).fetchone()

    def job_detail(self, job_id: str) -> dict[str, Any]:
        """One job, and for a failed one what its retry would do, as the failed list marks
        it (``permanent``, ``address_changed``, ``delivered_by_resend``): the detail's r
        offered "Requeue it" with no word that a job refused for its data fails again."""
        with self._lock:
            from console import failed

            led = self.ledger()
            d = failed.detail(self.conn, led, job_id, self._on_file_of)
            if d.get("rq_status") == "failed":
                permanent = bool((d.get("meta") or {}).get("permanent"))
                d["address_changed"] = permanent and job_id in self._readdressed([job_id])
                d["permanent"] = permanent and not d["address_changed"]
                if d["address_changed"] and (new := self._new_addresses([job_id])):
                    d["new_address"] = new[job_id]
                d["delivered_by_resend"] = job_id not in failed._without_resent(led, [job_id])
            return d


from console.failed import FailedFilter, FailedPage  # noqa: E402  (re-exported)

__all__ = ["Source", "Snapshot", "QueueRow", "WorkerRow", "RunningRow", "Limits", "FailedFilter", "FailedPage",
           "ReadOnlyLedger", "hr_report", "eta", "read_queues", "read_workers", "read_running", "read_limits"]
