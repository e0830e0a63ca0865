"""Send-email processes and their own credentials, across hosts sharing one Redis.

The provider refusing our credentials (jobs.errors.AccountRefused: HTTP 401/403, an SMTP
login refused) says nothing about the slip. When every send-email process is refused, it
is the provider or the account (a token expired at 02:00): the refusal counts toward a
provider outage, every sender pauses and one probes (jobs.limits). When only one process
is refused while others send (one host's PAYRUN_EMAIL_TOKEN mistyped, its token file
stale), counting it there spent the jobs' attempts one by one (and the others' successes
kept resetting the streak, so nothing ever paused): its jobs reached the failed list while
the provider and the other hosts were fine.

So each send-email process keeps an entry in ``payrun:limit:email:senders`` (written every
``SENDER_BEAT_S`` by a thread of its own, alive ``SENDER_TTL_S``). A refused send writes
this process's entry as refused and reads everyone's in one transaction
(``HostCredentials.refused``); if another live process is not refused
(``jobs.policy.another_sender_sends``), only this process pauses:

- the send raises ``RefusedHere`` (no attempt spent, back to the front of the queue, for a
  host whose credentials work; nobody else pauses, the outage streak is not touched);
- its lanes take no more jobs (``lane_loop`` waits on ``wait_resumed``), so the held jobs
  go to the other processes instead of coming back here;
- it says so in one ERROR naming where its credentials come from (the transport's
  ``credentials_source``: the token file's path, PAYRUN_EMAIL_TOKEN, PAYRUN_SMTP_PASSWORD,
  never the value), repeated every ``HOST_REFUSED_LOG_EVERY_S`` while paused;
- it asks the provider again (``Transport.probe``: an empty request or a login, nothing
  sent; a token file is read again first) after 5 s, then 10, 20, 40, 60 s ...
  (``jobs.policy.host_probe_s``), and takes sends again once accepted.

Once no other live process sends (they stopped, died, or were refused too), a paused
process takes sends again, and a refusal counts toward a provider outage as when every
process is refused (``look_at_others``), rather than a run waiting on paused processes.

``payrun workers``, ``payrun check`` and the metrics read the entries (``read_refused``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jobs.policy import (HOST_PROBE_MAX_S, HOST_REFUSED_LOG_EVERY_S, SENDER_BEAT_S, SENDER_TTL_S, another_sender_sends,
                         host_probe_s, read_sender_entry, sender_entry, unlisted_senders)
from payrun import keys

log = logging.getLogger("payrun.jobs.senders")

FORGET_AFTER_S = 600.0
"""An entry lapsed this long (a process gone) is deleted by the next refusal's look."""
KEY_TTL_S = 3600
"""The whole hash goes once no send-email process has written it for an hour."""


def process_name(pid: int | None = None, host: str | None = None) -> str:
    """This send-email process as the senders' hash names it: its lanes' worker name
    without the lane number (jobs.runtime.worker_name)."""
    return f"email.{host or socket.gethostname()}.{pid or os.getpid()}"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class HostCredentials:
    """This process's credential state: sending, or paused because the provider refused
    its own credentials while other send-email processes send (see the module)."""

    def __init__(self, name: str | None = None, resource: str = "email", clock: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic):
        self._name = name
        self.key = keys.limit_senders(resource)
        self._clock = clock
        self._mono = mono
        self._lock = threading.Lock()
        self._resumed = threading.Event()
        self._resumed.set()
        self.where: str | None = None
        """While paused: where the refused credentials come from (words, never the secret)."""
        self.error = ""
        self.since_ms: float | None = None
        self.paused_at: float | None = None  # (monotonic)
        self.failed_probes = 0
        """Probes refused this pause."""
        self.probes = 0
        """Probes this pause, answered or not (the backoff's index; carried over a pause that
        comes back within HOST_PROBE_MAX_S of its resume: a probe the provider accepts while
        its sends are refused, an SMTP sender refused, backs off instead of looping)."""
        self.resumed_at: float | None = None
        self.next_probe: float = 0.0
        self._said_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self._name or process_name()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def why(self) -> str:
        return (f"the provider refuses this send-email process's credentials ({self.where}), since "
                f"{time.strftime('%H:%M:%S', time.gmtime((self.since_ms or 0) / 1000))} UTC")

    # ---- the send path ---------------------------------------------------------------
    def refused(self, conn, where: str, error: str) -> bool:
        """The provider refused a send of this process for its credentials (from ``where``).
        Records it and reads every process's entry in one transaction (two processes
        refused at once: the second sees the first). True: another live process is not
        refused, so this one pauses itself (the caller raises RefusedHere). False: every
        live process is refused, or this one is alone (or Redis did not answer): the
        refusal is the provider's or the account's, an outage as before."""
        now_ms = self._clock() * 1000
        since = self.since_ms if self.paused and self.since_ms else now_ms
        try:
            with conn.pipeline(transaction=True) as p:
                p.hset(self.key, self.name, sender_entry(where, now_ms + SENDER_TTL_S * 1000, since))
                p.expire(self.key, KEY_TTL_S)
                p.hgetall(self.key)
                raw = p.execute()[-1]
        except Exception as e:  # Redis away: the send's own error says more; as before
            log.warning("could not record this process's refused credentials (%s)", e)
            return False
        entries = {_s(k): read_sender_entry(v) for k, v in raw.items()}
        gone = [k for k, e in entries.items() if e is None or e["until_ms"] < now_ms - FORGET_AFTER_S * 1000]
        if gone:
            try:
                conn.hdel(self.key, *gone)
            except Exception:
                pass
        if not another_sender_sends(entries, self.name, now_ms) and not self._unlisted(conn, entries):
            return False
        self._pause(where, error, since)
        return True

    def sent(self) -> None:
        """A send of this process went through: if it was paused (a send already on its way,
        its token file read again), its credentials work: it takes sends again."""
        if self.paused:
            self._resume("the provider accepts this process's credentials again (a send went through)")

    # ---- pause and resume ----------------------------------------------------------------
    def _pause(self, where: str, error: str, since_ms: float) -> None:
        with self._lock:
            if self.paused:
                self.error = error
                return
            self.where, self.error, self.since_ms = where, error, since_ms
            self.paused_at = self._mono()
            again_soon = self.resumed_at is not None and self.paused_at - self.resumed_at < HOST_PROBE_MAX_S
            self.probes = self.probes + 1 if again_soon else 0
            self.failed_probes = 0
            self.next_probe = self.paused_at + host_probe_s(self.probes)
            self._said_at = self.paused_at
            self._resumed.clear()
        log.error("send-email %s: the provider refuses THIS process's credentials, which come from %s, while other "
                  "send-email processes send: it takes no more sends (its jobs go to the others, no attempt spent) "
                  "and asks the provider again in %.0f s, nothing sent (last error: %s)",
                  self.name, where, self.next_probe - self.paused_at, error)
        self._write()

    def _resume(self, how: str) -> None:
        with self._lock:
            if not self.paused:
                return
            took = self._mono() - (self.paused_at or self._mono())
            where = self.where
            self.where, self.error, self.since_ms, self.paused_at = None, "", None, None
            self.resumed_at = self._mono()
            self._resumed.set()
        log.warning("send-email %s: taking sends again after %.0f s paused: %s (its credentials come from %s)",
                    self.name, took, how, where)
        self._write()

    def wait_resumed(self, stop: threading.Event, timeout_s: float = 1.0) -> None:
        """Block a lane while paused, at most ``timeout_s`` (it looks at ``stop`` then)."""
        if self.paused and not stop.is_set():
            self._resumed.wait(timeout_s)

    def probe(self, transport) -> bool | None:
        """Ask the provider again (nothing sent). True: accepted, sends resume. False: still
        refused (the next probe later, the ERROR repeated at its throttle). None: no
        answer about the credentials (the provider unreachable): asked again later."""
        from jobs.mail import CredentialsRefused

        now = self._mono()
        try:
            transport.probe()
        except CredentialsRefused as e:
            self.failed_probes += 1
            self.probes += 1
            self.next_probe = now + host_probe_s(self.probes)
            if self._said_at is None or now - self._said_at >= HOST_REFUSED_LOG_EVERY_S:
                self._said_at = now
                log.error("send-email %s: the provider still refuses THIS process's credentials, which come from "
                          "%s, after %.0f s (%d probe%s refused: %s): it takes no sends; fix them (a token file is "
                          "read again at the next probe, in %.0f s)", self.name, self.where,
                          now - (self.paused_at or now), self.failed_probes, "" if self.failed_probes == 1 else "s",
                          e, self.next_probe - now)
            return False
        except Exception as e:  # noqa: BLE001 - unreachable, timed out: not an answer about us
            self.probes += 1
            self.next_probe = now + host_probe_s(self.probes)
            log.warning("send-email %s: could not ask the provider about this process's credentials (%s); "
                        "again in %.0f s", self.name, e, self.next_probe - now)
            return None
        self._resume("the provider accepts this process's credentials again (a probe)")
        return True

    def look_at_others(self, conn) -> None:
        """While paused: if no other live process sends any more (they stopped, died, or
        were refused too), take sends again: a refusal then counts toward a provider outage,
        as when every process is refused (every sender pauses, one probes, status says so),
        instead of a run waiting on processes that are all paused on their own."""
        if not self.paused:
            return
        try:
            raw = conn.hgetall(self.key)
        except Exception:  # Redis away: stay as we are
            return
        entries = {_s(k): read_sender_entry(v) for k, v in raw.items()}
        if not another_sender_sends(entries, self.name, self._clock() * 1000) and not self._unlisted(conn, entries):
            self._resume("no other send-email process sends now: a refusal counts toward a provider outage again")

    def _unlisted(self, conn, entries: dict) -> set[str]:
        """Live send-email processes with no entry in the hash: of the version before
        session 42, during a rolling deploy (jobs.policy.unlisted_senders). Without them, a
        new process refused alone beside old hosts counted it toward an outage, spending
        its jobs' attempts one by one as before session 42. Empty if Redis does not answer."""
        try:
            lanes = [n for n in (_s(m).split(":", 2)[-1] for m in conn.smembers("rq:workers"))
                     if n.startswith("email.")]
            if not lanes:
                return set()
            with conn.pipeline(transaction=False) as p:
                for n in lanes:
                    p.exists(keys.alive(n))
                alive = p.execute()
        except Exception:  # noqa: BLE001 - a look only; the hash said what it could
            return set()
        return unlisted_senders([n for n, a in zip(lanes, alive) if a], entries, self.name)

    # ---- the entry and the watch thread ----------------------------------------------------
    def entry(self) -> str:
        until = self._clock() * 1000 + SENDER_TTL_S * 1000
        with self._lock:
            if self.paused:
                return sender_entry(self.where or "?", until, self.since_ms)
            return sender_entry(None, until)

    def _write(self, conn=None) -> None:
        conn = conn if conn is not None else getattr(self, "_conn", None)
        if conn is None:
            return
        try:
            with conn.pipeline(transaction=False) as p:
                p.hset(self.key, self.name, self.entry())
                p.expire(self.key, KEY_TTL_S)
                p.execute()
        except Exception:  # Redis away: the process's outage story tells it; written at the next beat
            pass

    def start(self, conn, transport: Callable[[], Any]) -> "HostCredentials":
        """Write this process's entry every SENDER_BEAT_S and, while paused, probe the
        provider when due (``transport()``: the process's transport)."""
        self._conn = conn
        self._stop = stop = threading.Event()  # (a thread of an earlier start ends on its own)
        self._write()

        def run() -> None:
            while not stop.is_set():
                if self.paused and self._mono() >= self.next_probe:
                    try:
                        self.probe(transport())
                    except Exception as e:  # noqa: BLE001 - never end the thread
                        log.warning("send-email %s: credentials probe failed: %s", self.name, e)
                self.look_at_others(conn)
                self._write()
                wait = SENDER_BEAT_S
                if self.paused:
                    wait = max(0.05, min(wait, self.next_probe - self._mono()))
                stop.wait(wait)

        self._thread = threading.Thread(target=run, name="credentials", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and delete this process's entry (it sends no more)."""
        self._stop.set()
        conn = getattr(self, "_conn", None)
        if conn is not None:
            try:
                conn.hdel(self.key, self.name)
            except Exception:
                pass


HOST = HostCredentials()
"""This process's state (the send path, the lanes and run_lanes share it)."""


def read_refused(conn, now_ms: float | None = None, resource: str = "email") -> list[dict]:
    """The live send-email processes paused because the provider refuses their own
    credentials: [{"process", "host", "pid", "since_ms", "where"}], oldest first."""
    raw = conn.hgetall(keys.limit_senders(resource))
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    out = []
    for k, v in raw.items():
        e = read_sender_entry(v)
        if e is None or not e["refused"] or e["until_ms"] <= now_ms:
            continue
        name = _s(k)
        parts = name.split(".")
        pid = int(parts[-1]) if len(parts) >= 3 and parts[-1].isdigit() else None
        host = ".".join(parts[1:-1]) if pid is not None else "?"
        out.append({"process": name, "host": host, "pid": pid, "since_ms": e["since_ms"], "where": e["where"]})
    return sorted(out, key=lambda d: d["since_ms"])


def refused_line(r: dict, now_ms: float | None = None) -> str:
    """One paused process as `payrun workers` and `payrun check` say it."""
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    for_s = max(0.0, (now_ms - r["since_ms"]) / 1000)
    host = r["host"] + (f"/{r['host_tag']}" if r.get("host_tag") else "")  # (two hosts named alike: console.data)
    return (f"send-email {host} pid {r['pid']} PAUSED {for_s:.0f} s: the provider refuses its credentials "
            f"({r['where']}); its sends go to the other send-email processes; it takes sends again once they "
            f"work (a token file is read again at each probe)")
