"""Dead letters for the console, one page at a time (never the whole registry).

- No text, company or month in the filter: page RQ's failed registries themselves, newest first
  (ZREVRANGE with scores over the one or three ``rq:failed:<q>`` keys, merged), then
  HMGET the page's jobs. The count is ZCARD.
- Company, month or text: the ledger answers (``status = 'failed'`` with LIMIT/OFFSET, and a
  COUNT), since it holds the company and the last error of every job; each row on the
  page is then checked against Redis (ZSCORE) so a job retried meanwhile shows as such.
  The ledger trails Redis by its backlog (about a second when `payrun ledger` runs).

Filter syntax (the console's ``/`` and `payrun failed`'s options):
  ``queue:send-email company:3 month:2026-11 refused``  ->  queue, company id, pay month,
  text in the last error
  (the text matches as `payrun failed --error` does: a case-insensitive substring)
"""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from jobs.events import NO_ATTEMPT_OUTCOMES, RETURNED_FIELD, attempts_spent
from payrun import keys
from payrun.deadletters import UNREADABLE_MISSING as DATA_MISSING, never_ran, unreadable_job as _unreadable
from payrun.text import visible

_FREE = ",".join(f"'{o}'" for o in NO_ATTEMPT_OUTCOMES)  # SQL list of the outcomes that spent no attempt


@dataclass(frozen=True)
class FailedFilter:
    queue: str | None = None
    company: int | None = None
    text: str | None = None
    month: str | None = None

    @classmethod
    def parse(cls, s: str) -> "FailedFilter":
        """``queue:Q company:N month:YYYY-MM words…``; unknown queue names and bad months
        raise ValueError."""
        queue = company = month = None
        words = []
        try:
            parts = shlex.split(s or "")
        except ValueError:
            parts = (s or "").split()
        for w in parts:
            k, sep, v = w.partition(":")
            if sep and k in ("queue", "q"):
                if v not in keys.QUEUES:
                    raise ValueError(f"unknown queue {v!r} (choose from {', '.join(keys.QUEUES)})")
                queue = v
            elif sep and k in ("company", "c"):
                if not v.isdigit():
                    raise ValueError(f"company:{v} is not a company id (a number)")
                company = int(v)
            elif sep and k == "month":
                if not keys.MONTH_RE.fullmatch(v):
                    raise ValueError(f"month:{v} is not a month (YYYY-MM, e.g. month:2026-11)")
                month = v
            else:
                words.append(w)
        return cls(queue, company, " ".join(words) or None, month)

    @staticmethod
    def unknown_keys(s: str) -> list[str]:
        """Words of ``s`` that look like a filter key with a typo (``compny:2``): they are
        matched as text in the last error, which showed "0 failed" and read like "company 2
        has none"."""
        try:
            parts = shlex.split(s or "")
        except ValueError:
            parts = (s or "").split()
        return [w for w in parts if re.fullmatch(r"[A-Za-z]+:[\w.-]+", w)
                and w.partition(":")[0] not in ("queue", "q", "company", "c", "month")]

    def __str__(self) -> str:
        parts = []
        if self.queue:
            parts.append(f"queue:{self.queue}")
        if self.company is not None:
            parts.append(f"company:{self.company}")
        if self.month:
            parts.append(f"month:{self.month}")
        if self.text:
            parts.append(self.text)
        return " ".join(parts)

    @property
    def uses_ledger(self) -> bool:
        return self.company is not None or bool(self.text) or bool(self.month)

    def command(self) -> str:
        """The equivalent `payrun retry` for every job matching this filter."""
        cmd = "payrun retry --all"
        if self.queue:
            cmd += f" --queue {self.queue}"
        if self.company is not None:
            cmd += f" --company {self.company}"
        if self.month:
            cmd += f" --month {self.month}"
        if self.text:
            cmd += f" --error {shlex.quote(self.text)}"
        return cmd


@dataclass
class FailedPage:
    rows: list[dict[str, Any]]
    total: int
    offset: int
    flt: FailedFilter
    source: str
    took_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


def _queues(flt: FailedFilter) -> tuple[str, ...]:
    return (flt.queue,) if flt.queue else keys.QUEUES


def _meta(raw: Any) -> dict[str, Any]:
    try:
        m = json.loads(_s(raw)) if raw else {}
        return m if isinstance(m, dict) else {}
    except ValueError:
        return {}


def _redis_rows(conn, ids: list[tuple[str, str]], ledger=None) -> list[dict[str, Any]]:
    with conn.pipeline(transaction=False) as p:
        for job_id, _ in ids:
            p.hmget(f"rq:job:{job_id}", "meta", "ended_at", "description", RETURNED_FIELD)
            p.hexists(f"rq:job:{job_id}", "data")
        res = p.execute()
        res = list(zip(res[::2], res[1::2]))
    # a worker of the version before the Redis count (a rolling deploy) reported its
    # returned tries to the ledger only
    in_ledger = ledger.returned_tries([i for i, _ in ids]) if ledger is not None and ids else {}
    rows = []
    for (job_id, q), ((meta, ended, desc, returned), has_data) in zip(ids, res):
        m = _meta(meta)
        returned = max(int(_s(returned) or 0), in_ledger.get(job_id, 0))
        # (a hash with no data and no error of a worker's: as `payrun failed` says)
        error = m.get("last_error") or ("" if has_data else f"{DATA_MISSING}: nothing to retry")
        rows.append({"id": job_id, "queue": q, "company": None, "kind": m.get("kind"),
                     # attempts spent: tries held back by the provider or handed back spent none;
                     # none for a job failed unread (a worker of the version before counted one)
                     "attempts": 0 if never_ran(m, error) else attempts_spent(
                         int(m.get("attempt", 0) or 0), int(m.get("held", 0) or 0), returned),
                     "error": error,
                     # the last try failed on the data (EventsMixin._classify_exception): a
                     # retry alone fails again, as `payrun failed` says
                     "permanent": bool(m.get("permanent")),
                     "ended_at": _s(ended) or None, "in_redis": True})
    return rows


def _add_companies(ledger, rows: list[dict[str, Any]]) -> None:
    if ledger is None or not rows:
        return
    marks = ",".join("?" * len(rows))
    got = {r["id"]: r["company_id"] for r in
           ledger.db.query(f"SELECT id, company_id FROM jobs WHERE id IN ({marks})", [r["id"] for r in rows])}
    for r in rows:
        r["company"] = got.get(r["id"])


def _ledger_where(flt: FailedFilter) -> tuple[str, list[Any]]:
    where, args = ["status = 'failed'"], []
    if flt.queue:
        where.append("queue = ?")
        args.append(flt.queue)
    if flt.company is not None:
        where.append("company_id = ?")
        args.append(flt.company)
    if flt.month:
        where.append("month = ?")
        args.append(flt.month)
    if flt.text:
        where.append("last_error LIKE ? ESCAPE '\\'")
        args.append("%" + flt.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")
    return " AND ".join(where), args


def page(conn, ledger, flt: FailedFilter, offset: int = 0, limit: int = 50) -> FailedPage:
    t0 = time.perf_counter()
    if flt.uses_ledger and ledger is not None:
        where, args = _ledger_where(flt)
        total = ledger.db.conn.execute(f"SELECT COUNT(*) FROM jobs WHERE {where}", args).fetchone()[0]
        rows = [
            {"id": r["id"], "queue": r["queue"], "company": r["company_id"], "kind": r["kind"],
             "attempts": attempts_spent(r["attempts"], r["free"]), "error": r["last_error"] or "",
             "ended_at": r["finished_at"]}
            for r in ledger.db.query(
                "SELECT id, queue, company_id, kind, attempts, last_error, finished_at, (SELECT COUNT(*) FROM"
                f" attempts a WHERE a.job_id = jobs.id AND a.outcome IN ({_FREE})) AS free"
                f" FROM jobs WHERE {where}"
                " ORDER BY substr(finished_at, 1, 19) DESC, id DESC LIMIT ? OFFSET ?", [*args, limit, offset])
        ]
        with conn.pipeline(transaction=False) as p:
            for r in rows:
                p.zscore(f"rq:failed:{r['queue']}", r["id"])
                p.hget(f"rq:job:{r['id']}", "meta")
            res = p.execute()
        for i, r in enumerate(rows):
            m = _meta(res[2 * i + 1])
            r["in_redis"] = res[2 * i] is not None
            r["permanent"] = bool(m.get("permanent"))
            # failed unread: it never ran, 0 attempts, as `payrun failed` and the unfiltered list
            # say (a worker of the version before told the ledger it ran once: attempts 1)
            if never_ran(m, r["error"]):
                r["attempts"] = 0
        return FailedPage(rows, total, offset, flt, "ledger", time.perf_counter() - t0)
    if flt.uses_ledger:  # no ledger file: scan Redis (correct, slower)
        ids = matching_ids(conn, None, flt)
        total = len(ids)
        chunk = ids[offset:offset + limit]
        qs = _queue_of(conn, chunk)
        rows = _redis_rows(conn, list(zip(chunk, qs)))
        return FailedPage(rows, total, offset, flt, "redis-scan", time.perf_counter() - t0)
    qs = _queues(flt)
    with conn.pipeline(transaction=False) as p:
        for q in qs:
            p.zcard(f"rq:failed:{q}")
            p.zrevrange(f"rq:failed:{q}", 0, offset + limit - 1, withscores=True)
        res = p.execute()
    total = sum(int(res[2 * i]) for i in range(len(qs)))
    merged = sorted(((float(sc), _s(m), q) for i, q in enumerate(qs) for m, sc in res[2 * i + 1]),
                    key=lambda t: (t[0], t[1]), reverse=True)  # newest first, ties by id as `payrun failed`
    chosen = [(m, q) for _, m, q in merged[offset:offset + limit]]
    rows = _redis_rows(conn, chosen, ledger)
    _add_companies(ledger, rows)
    return FailedPage(rows, total, offset, flt, "redis", time.perf_counter() - t0)


def permanent_among(conn, ids: list[str]) -> list[str]:
    """Of these failed jobs, those whose last try failed on their data (an address refused,
    a name too long): a retry alone fails again (the retry dialogs say so)."""
    return [job_id for job_id, meta in metas(conn, ids) if meta.get("permanent")]


def metas(conn, ids: list[str]):
    """(job id, its meta) for each of ``ids``, read 1,000 to a round trip."""
    from payrun.keys import job_field

    yield from ((job_id, _meta(raw)) for job_id, raw in job_field(conn, ids, "meta"))


def retry_one_body(row: dict[str, Any]) -> str:
    """What the one-job retry dialog says (the failed list's r and the job detail's r):
    a job that failed on its data fails again unless fixed first, one refused for an
    address changed since goes to the new one, one whose slip a resend delivered emails it again."""
    from payrun.status import cut

    body = "Requeue it with a fresh attempt budget."
    if row.get("delivered_by_resend"):
        return ("Its slip was delivered by a `payrun resend` since (payrun status counts it as sent): a retry "
                "emails the employee the slip again. " + body)
    if row.get("address_changed"):  # (as `payrun retry` says it: "it goes to the new one")
        new = f" ({visible(row['new_address'])})" if row.get("new_address") else ""
        return (f"Its address was refused ({cut(short_error(row.get('error') or ''), 160)}) and the payroll "
                f"data has changed it since: the retry sends it to the new address{new}. " + body)
    if row.get("permanent"):
        return (f"It failed on the employee's data ({cut(short_error(row.get('error') or ''), 160)}): a retry alone "
                "fails again unless the employee was fixed first (payrun import). " + body)
    return body


_TRANSPORT_PREFIX = re.compile(r"^(?:provider|SMTP) \S+?: ")


def short_error(text: str) -> str:
    """The last error as a list shows it: without the transport's "provider host:port: "
    prefix, the same on every row (at 80 columns it left only "HTTP" of the reason); control
    characters as escapes (an error stored before they were escaped at recording)."""
    return visible(_TRANSPORT_PREFIX.sub("", text or "", count=1))


def _queue_of(conn, ids: list[str]) -> list[str]:
    with conn.pipeline(transaction=False) as p:
        for job_id in ids:
            p.hget(f"rq:job:{job_id}", "origin")
        return [_s(o) for o in p.execute()]


def matching_ids(conn, ledger, flt: FailedFilter) -> list[str]:
    """Every failed job id matching ``flt`` (what "retry all matching" acts on), less the
    jobs whose slip a `payrun resend` has delivered since (as `payrun retry --all`: a
    retry would email that slip a second time)."""
    return _without_resent(ledger, _matching_ids(conn, ledger, flt))


def _without_resent(ledger, ids: list[str]) -> list[str]:
    if ledger is None or not ids:
        return ids
    from payrun.deadletters import slip_key

    keys: dict[str, str] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        keys.update((r[0], slip_key(r[1])) for r in ledger.db.conn.execute(
            f"SELECT id, key FROM jobs WHERE id IN ({','.join('?' * len(chunk))}) AND key IS NOT NULL", chunk))
    resent = ledger.delivered_by_resend(set(keys.values()))
    return [i for i in ids if keys.get(i) not in resent] if resent else ids


def _matching_ids(conn, ledger, flt: FailedFilter) -> list[str]:
    if flt.uses_ledger and ledger is not None:
        where, args = _ledger_where(flt)
        ids = [r[0] for r in ledger.db.conn.execute(
            f"SELECT id, queue FROM jobs WHERE {where} ORDER BY substr(finished_at, 1, 19) DESC, id DESC", args)]
        return ids
    out: list[str] = []
    for q in _queues(flt):
        ids = [_s(m) for m in conn.zrevrange(f"rq:failed:{q}", 0, -1)]
        if not flt.uses_ledger:
            out += ids
            continue
        if flt.month:
            ids = [job_id for job_id in ids if keys.month_of(job_id) == flt.month]
        text = (flt.text or "").lower()
        out += [job_id for job_id, meta in metas(conn, ids) if text in (meta.get("last_error") or "").lower()]
    return out


def detail(conn, ledger, job_id: str, on_file_of=None) -> dict[str, Any]:
    """One job: ledger row with its attempt history, RQ status, last error, traceback, and
    whom its email is for (``recipient``, ``recipient_send``: payrun.recipient, as `payrun
    job` says it; ``on_file_of``: employee id -> (name, address) on file now)."""
    out: dict[str, Any] = {"id": job_id, "ledger": None, "rq_status": None, "traceback": None, "meta": {}}
    if ledger is not None:
        out["ledger"] = ledger.job(job_id)
    job_data = None
    try:
        from jobs.runtime import PayrunJob

        job = PayrunJob.fetch(job_id, connection=conn)
        try:  # (the name and address alone are read out of it: payrun.recipient)
            job_data = job.args[0] if job.args else None
        except Exception:  # noqa: BLE001 - its data unreadable: said below
            job_data = None
        status = job.get_status(refresh=False)
        out["rq_status"] = getattr(status, "value", _s(status))  # "failed", not "JobStatus.FAILED"
        out["meta"] = {k: v for k, v in job.meta.items()
                       if k in ("kind", "key", "attempt", "last_error", "retry", "permanent")}
        out["origin"] = job.origin
        out["func"] = job.func_name
        result = job.latest_result()
        if result is not None and result.exc_string:
            out["traceback"] = result.exc_string
    except Exception as e:  # gone from Redis (expired, deleted) or Redis down
        try:
            unreadable = _unreadable(conn, job_id)
        except Exception:  # noqa: BLE001 - Redis down: say what the fetch said
            unreadable = None
        if unreadable is not None:  # RQ's error would dump the raw hash: say what it lacks instead
            out.update(unreadable)
        elif "Unexpected job format" in str(e):  # (its message is the whole raw hash, every value)
            out["rq_error"] = f"{type(e).__name__}: Unexpected job format (its hash has no 'data' field)"
        else:
            out["rq_error"] = f"{type(e).__name__}: {e}"
    try:
        from payrun.recipient import job_recipient

        out["recipient"], out["recipient_send"] = job_recipient(ledger, on_file_of or (lambda employee: None),
                                                                job_id, out["ledger"], job_data)
    except Exception:  # noqa: BLE001 - the rest of the view stands without it
        out["recipient"] = out["recipient_send"] = None
    return out


