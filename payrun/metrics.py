"""Prometheus metrics, served by the ledger process on 127.0.0.1:<metrics.port>.

Two kinds:
- read at scrape time from Redis and the ledger (a custom collector, so every scrape is
  current and costs a handful of reads): queue depth, running, failed registry size,
  jobs by state, slips by state, stuck jobs, ledger backlog, limiter state, 429s, waits;
- observed as the ledger applies workers' events (counters and a histogram in this
  process): job durations per queue, attempts by outcome, retries.
Every name starts with ``payrun_``. No label carries a salary, a name or an address.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jobs.events import outcome_of
from payrun import keys

log = logging.getLogger("payrun.metrics")

DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 20, 30, 60)


class Observed:
    """What the ledger sees go by: attempts ending, with their duration."""

    def __init__(self, registry: CollectorRegistry):
        self.duration = Histogram("payrun_job_duration_seconds", "Duration of one attempt of a job, by queue.",
                                  ["queue"], buckets=DURATION_BUCKETS, registry=registry)
        self.attempts = Counter("payrun_job_attempts_total", "Attempts that ended, by queue and outcome (held: a try held back by the provider's "
                                "rate limit or an outage; requeued / reaped: handed back by a stopping worker / "
                                "returned after its worker died. None of them spends an attempt or is a retry).",
                                ["queue", "outcome"], registry=registry)
        self.retries = Counter("payrun_job_retries_total", "Attempts that failed and were scheduled again.",
                               ["queue"], registry=registry)
        self._started: dict[str, tuple[datetime, str]] = {}
        self._lock = threading.Lock()

    def event(self, ev: dict[str, str]) -> None:
        job, status = ev.get("job", ""), ev.get("status", "")
        queue = ev.get("queue") or _queue_of(job)
        try:
            ts = datetime.fromisoformat(ev["ts"])
        except (KeyError, ValueError):
            return
        with self._lock:
            if status == "running":
                self._started[job] = (ts, queue)
                if len(self._started) > 200_000:  # events lost to a crash must not grow this forever
                    self._started.clear()
                return
            outcome = outcome_of(ev)
            if outcome not in ("done", "failed", "retrying", "held", "requeued", "reaped"):
                return
            started = self._started.pop(job, None)
        self.attempts.labels(queue, outcome).inc()
        if outcome == "retrying":
            self.retries.labels(queue).inc()
        if started is not None and outcome in ("done", "failed", "retrying", "held"):
            self.duration.labels(started[1]).observe(max(0.0, (ts - started[0]).total_seconds()))


def _queue_of(job_id: str) -> str:
    from jobs.events import _queue_of as queue_of

    return queue_of(job_id) or "other"


class StateCollector:
    """Gauges read at scrape time. ``ledger_path`` is opened read-only per scrape.

    Redis away is logged at the first scrape that fails, then at most every 30 s with how
    many failed, and once when a scrape reads it again (it was a line per scrape)."""

    def __init__(self, conn, cfg, clock=None):
        import time

        from jobs.runtime import OUTAGE_LOG_EVERY_S, RepeatedFailure

        self.conn = conn
        self.cfg = cfg
        self._clock = clock or time.monotonic
        self._outage = RepeatedFailure(OUTAGE_LOG_EVERY_S)
        self._outage_lock = threading.Lock()  # (scrapes may run in threads of their own)

    def collect(self):
        depth = GaugeMetricFamily("payrun_queue_depth", "Jobs waiting in a queue.", labels=["queue"])
        running = GaugeMetricFamily("payrun_jobs_running", "Jobs running now (RQ started registry).", labels=["queue"])
        failed = GaugeMetricFamily("payrun_jobs_failed_registry", "Jobs in RQ's failed registry.", labels=["queue"])
        try:
            with self.conn.pipeline(transaction=False) as p:
                for q in keys.QUEUES:
                    p.llen(f"rq:queue:{q}")
                    p.zcard(f"rq:wip:{q}")
                    p.zcard(f"rq:failed:{q}")
                values = p.execute()
            for i, q in enumerate(keys.QUEUES):
                depth.add_metric([q], values[3 * i])
                running.add_metric([q], values[3 * i + 1])
                failed.add_metric([q], values[3 * i + 2])
            yield from (depth, running, failed)
            from jobs.limits import email_limiter
            from jobs.reaper import find_stuck

            yield GaugeMetricFamily("payrun_stuck_jobs", "Running jobs whose worker is gone or lease lapsed.",
                                    value=len(find_stuck(self.conn)))
            lim = email_limiter(self.conn, self.cfg)
            st, stats = lim.settings(), lim.stats()
            yield GaugeMetricFamily("payrun_email_cap", "Email sends allowed in flight (all hosts).", value=st.cap)
            yield GaugeMetricFamily("payrun_email_in_flight", "Email slots held now.", value=lim.in_use())
            yield GaugeMetricFamily("payrun_email_rate_per_second", "Email send rate limit.", value=st.rate_per_s)
            yield CounterMetricFamily("payrun_http_429", "429 answers from the email provider.",
                                      value=stats.get("http_429", 0))
            yield CounterMetricFamily("payrun_limiter_waits", "Sends that had to wait for a slot or the rate.",
                                      value=stats.get("waits", 0))
            yield CounterMetricFamily("payrun_limiter_gated", "Sends the send gate held back (senders bunched).",
                                      value=stats.get("gated", 0))
            yield CounterMetricFamily("payrun_limiter_regated",
                                      "Sends that stalled after the send gate and passed it again.",
                                      value=stats.get("regated", 0))
            from jobs.limits import read_outage

            outage = read_outage(self.conn) or {}
            yield GaugeMetricFamily("payrun_email_provider_down",
                                    "1 while the provider is down (sends failing in a row paused every sender).",
                                    value=1 if outage.get("pauses") else 0)
            yield GaugeMetricFamily("payrun_email_provider_failed_in_a_row",
                                    "Sends the provider failed in a row (0 after a success).",
                                    value=outage.get("failed_in_a_row", 0))
            from jobs.senders import read_refused

            yield GaugeMetricFamily("payrun_email_senders_refused",
                                    "Send-email processes paused because the provider refuses their own credentials "
                                    "(their sends go to the others).",
                                    value=len(read_refused(self.conn)))
            yield CounterMetricFamily("payrun_email_outage_pauses",
                                      "Pauses of every sender for a provider outage.",
                                      value=stats.get("outage_pauses", 0))
            yield GaugeMetricFamily("payrun_email_gate_margin_ms",
                                    "The send gate's margin over 1 s (widened by 429s, narrows back with time).",
                                    value=lim.gate_margin_ms())
            from payrun.ledger import backlog

            yield GaugeMetricFamily("payrun_ledger_backlog", "Worker events not yet applied to the ledger.",
                                    value=backlog(self.conn))
            up = 1
            with self._outage_lock:
                line = self._outage.ok(self._clock())
            if line is not None:
                log.warning("metrics: Redis answers again: %s", line)
        except Exception as e:  # Redis down: say so instead of failing the scrape
            with self._outage_lock:
                line = self._outage.failed(self._clock(), e)
            if line is not None:
                log.warning("metrics: Redis unavailable: %s", line)
            up = 0
        yield GaugeMetricFamily("payrun_redis_up", "1 if Redis answered this scrape.", value=up)
        yield from self._ledger()

    def _ledger(self):
        import sqlite3

        jobs = GaugeMetricFamily("payrun_jobs", "Jobs in the ledger by kind and state.", labels=["kind", "state"])
        try:
            db = sqlite3.connect(f"file:{self.cfg.ledger_path}?mode=ro", uri=True, timeout=2)
            try:
                for kind, state, n in db.execute("SELECT kind, status, COUNT(*) FROM jobs GROUP BY kind, status"):
                    jobs.add_metric([kind, state], n)
            finally:
                db.close()
        except sqlite3.Error as e:
            log.warning("metrics: ledger unreadable: %s", e)
        yield jobs


def serve(conn, cfg) -> tuple[Observed, Any]:
    """Start the endpoint on 127.0.0.1:metrics.port (0 = any free port). Returns the
    observer the ledger feeds and the HTTP server (``server.server_port``)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    observed = Observed(registry)
    registry.register(StateCollector(conn, cfg))
    server, _thread = start_http_server(cfg.metrics.port, addr="127.0.0.1", registry=registry)
    log.info("metrics on http://127.0.0.1:%d/metrics", server.server_port)
    return observed, server
