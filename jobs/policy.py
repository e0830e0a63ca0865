"""Policy as pure functions: backoff, error classification, lease arithmetic.

Nothing here touches Redis, the clock or the network; callers pass what they know.
"""

from __future__ import annotations

import errno
import json
import random
import re
import smtplib
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from jobs.errors import OutcomeUnknown, PermanentError, SlipMissing, TransientError


def backoff_ceiling(attempt: int, base_s: float, cap_s: float) -> float:
    """The upper bound of the wait after failed attempt number ``attempt`` (1-based).

    attempt 1 -> 2*base, 2 -> 4*base, ... capped: the seed's table (2, 4, 8, 16, 32, 64 s).
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, got {attempt}")
    exp = min(attempt, 62)  # 2**62 * base already exceeds any cap; avoid float overflow
    return min(cap_s, base_s * (2**exp))


def backoff_delay(
    attempt: int,
    base_s: float,
    cap_s: float,
    rng: random.Random | None = None,
    retry_after_s: float | None = None,
    jitter: bool = True,
) -> float:
    """Full jitter: ``random(0, min(cap, base * 2**attempt))``, but never less than a
    provider's Retry-After (a 429 asks us to wait at least that long).

    ``jitter=False`` waits the ceiling itself: the naive policy, kept only so the chaos
    suite can show the thundering herd that full jitter prevents."""
    ceiling = backoff_ceiling(attempt, base_s, cap_s)
    delay = (rng or random).uniform(0, ceiling) if jitter else ceiling
    if retry_after_s is not None and retry_after_s > delay:
        delay = float(retry_after_s)
    return delay


def backoff_attempt(tries: int, budget_start: int = 0, returned: int = 0, returned_at_budget_start: int = 0) -> int:
    """The attempt number the backoff grows with (``backoff_ceiling``): the job's tries
    since its budget began (``budget_start``: the tries before the last `payrun retry`,
    plus every try held back by the provider), less the tries handed back by a stopping
    worker or returned by the reaper since then (``returned`` is the job's count of
    those, ``returned_at_budget_start`` what it was at that `payrun retry`): a worker
    dying under a job does not make its next wait longer. At least 1."""
    since = max(0, int(returned) - int(returned_at_budget_start))
    return max(1, int(tries) - int(budget_start) - since)


@dataclass(frozen=True)
class Verdict:
    transient: bool
    reason: str
    retry_after_s: float | None = None
    on_data: bool = True
    """For a permanent failure: whether it failed on the job's data (an address refused, a
    name too long), so that a retry alone fails again; not for a slip file missing."""


TRANSIENT_BUILTINS: tuple[type[BaseException], ...] = (
    TimeoutError,
    ConnectionError,  # refused, reset, aborted, broken pipe
    socket.timeout,
    smtplib.SMTPServerDisconnected,
    smtplib.SMTPConnectError,
)


def unreadable_reason(exc: BaseException) -> str:
    """Why a job's data could not be read (RQ's DeserializationError says nothing itself:
    the serializer's error is its cause). Never the data."""
    cause = exc.__cause__ or exc.__context__
    if cause is None:
        return "not JSON"
    return f"not JSON ({type(cause).__name__}: {cause})"


def classify(exc: BaseException) -> Verdict:
    """Decide whether a failure is worth retrying.

    Transient: our TransientError (SMTP 4xx, HTTP 429/5xx, dropped connections), timeouts
    (including RQ's JobTimeoutException), connection errors, a killed work horse.
    Permanent: our PermanentError (bad address, bad data, template error) and any other
    exception: a bug retried six times is still a bug, and it reaches a human at once.
    """
    name = type(exc).__name__
    if isinstance(exc, SlipMissing):
        return Verdict(False, str(exc) or name, on_data=False)
    if isinstance(exc, PermanentError):
        return Verdict(False, str(exc) or name)
    if isinstance(exc, OutcomeUnknown):
        return Verdict(True, f"outcome unknown, retrying with the same key: {exc}", exc.retry_after_s)
    if isinstance(exc, TransientError):
        return Verdict(True, str(exc) or name, exc.retry_after_s)
    if name in ("JobTimeoutException", "AbandonedJobError", "ShutDownImminentException"):
        return Verdict(True, str(exc) or name)
    if name == "DeserializationError":  # RQ's: the job's data is not JSON (its hash written by hand, a pickle)
        return Verdict(False, f"job data unreadable: {unreadable_reason(exc)}", on_data=False)
    if isinstance(exc, smtplib.SMTPResponseException):
        code = exc.smtp_code
        return Verdict(400 <= code < 500, f"SMTP {code} {exc.smtp_error!r}")
    if isinstance(exc, TRANSIENT_BUILTINS):
        return Verdict(True, f"{name}: {exc}")
    if isinstance(exc, OSError) and exc.errno in HOST_TROUBLE_ERRNOS:
        # the host's trouble, not the employee's: a full or failing disk is fixed by the
        # operator, and the same job then succeeds (a walkthrough saw 249 of 300 slips
        # failed for good in 5 s, marked "fix the data", when the slip store filled up)
        return Verdict(True, f"{name}: {exc} ({HOST_TROUBLE_ERRNOS[exc.errno]})")
    try:
        import redis

        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return Verdict(True, f"{name}: {exc}")
        if redis_refuses_writes(exc):
            return Verdict(True, f"{name}: {exc} (Redis refuses writes: is its disk full?)")
    except ImportError:  # pragma: no cover
        pass
    return Verdict(False, f"{name}: {exc}")


HOST_TROUBLE_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "the disk is full: free space, then `payrun retry --all` for what failed meanwhile",
    errno.EDQUOT: "the disk quota is used up: free space, then `payrun retry --all` for what failed meanwhile",
    errno.EIO: "the disk reported an I/O error",
    errno.EROFS: "the file system went read-only (a disk error?)",
    errno.EMFILE: "this process has too many files open",
    errno.ENFILE: "the host has too many files open",
    errno.ENOMEM: "the host is out of memory",
}
"""OS errors that say the host is in trouble, not the job's data: transient."""

HOST_TROUBLE_MARKS = tuple(f"({text}" for text in HOST_TROUBLE_ERRNOS.values()) + (
    "(Redis refuses writes", "spending no attempt: the run goes on by itself once there is room",
    "spending no attempt: the run goes on by itself once it can be written")
"""What classify() and jobs.tasks put in the error of a job that failed on the host's trouble
(a full or failing disk, Redis refusing writes), not on the employee's data."""


def failed_on_host_trouble(error: str | None) -> bool:
    """Whether a failed job's last error is the host's trouble (HOST_TROUBLE_MARKS): a retry
    once the host is fixed delivers it, no data to fix. `payrun status` told 198 slips failed
    on a full slip store "an address refused: fix it with `payrun import`" (session-42 drill)."""
    return bool(error) and any(mark in error for mark in HOST_TROUBLE_MARKS)


REDIS_REFUSES_WRITES = ("MISCONF", "READONLY", "OOM ")
"""Redis's replies when it cannot take writes (a failed AOF write: a full disk; a replica;
maxmemory): transient, once the operator has fixed the host."""


def redis_refusal_reason(exc: BaseException, limit: int = 120) -> str:
    """Redis's own words from a refusal (redis_refuses_writes), without the script or
    pipeline redis-py wraps them in: "MISCONF Redis is configured to save …"."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    starts = [i for p in REDIS_REFUSES_WRITES if (i := text.find(p)) >= 0]
    if not starts:
        code = {"ReadOnlyError": "READONLY", "OutOfMemoryError": "OOM"}.get(type(exc).__name__)
        if code:  # (redis-py took the code off: put it back, and drop a pipeline's wrapping)
            return f"{code} {text.split('caused error: ', 1)[-1]}"[:limit]
    return text[min(starts) if starts else 0:][:limit]


def redis_refuses_writes(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing writes (REDIS_REFUSES_WRITES): it is up and
    answering, and takes writes again by itself once its host is fixed."""
    try:
        import redis
    except ImportError:  # pragma: no cover
        return False
    if not isinstance(exc, redis.ResponseError):
        return False
    if isinstance(exc, (redis.exceptions.ReadOnlyError, redis.exceptions.OutOfMemoryError)):
        return True  # (redis-py raises these by their code, and strips it from the message)
    text = str(exc)
    if text.startswith(REDIS_REFUSES_WRITES):
        return True
    # a write inside a script ("Error running script (call to f_…): @user_script:14: … -MISCONF …"),
    # or in a transaction ("Command # 1 (HSET …) of pipeline caused error: MISCONF …")
    if text.startswith("Error running script"):
        return any(f"-{p}" in text for p in REDIS_REFUSES_WRITES)
    if text.startswith("Command # "):
        return any(f"caused error: {p}" in text for p in REDIS_REFUSES_WRITES)
    return False


# Refusals at RCPT that are about us, not the recipient: Postfix checks the sender (and
# whether we may relay at all) when the recipient is given, by default
# (smtpd_delay_reject), so a bad sender or a missing login is refused there for every
# slip. RFC 3463 enhanced codes X.1.7 / X.1.8 are the sender's address; the texts are
# Postfix's, Exim's and Exchange's usual ones.
_RCPT_OURS_TEXTS = ("sender address rejected", "relay access denied", "relaying denied", "relay not permitted",
                    "unable to relay", "client host rejected", "must authenticate", "sender verify failed",
                    "client not authenticated", "authentication is required",
                    # our HELO name, our IP on a blocklist (Postfix's RBL reply names the host)
                    "helo command rejected", "blocked using", "client host [")
# RFC 4954's own reply (530 5.7.0 Authentication required), whole: "authentication
# required" elsewhere in a reply may be the recipient's (a restricted mailbox)
_RCPT_OURS_PREFIXES = ("5.7.0 authentication required", "authentication required")
# ... unless the reply is about the recipient after all: a server that verifies the
# recipient's own domain relays what *that* host said ("Recipient address rejected:
# unverified address: host mx.old.example said: 554 5.7.1 Relay access denied"), and
# Exchange refuses a restricted group or mailbox with "RESOLVER.RST.AuthRequired".
_RCPT_THEIRS_TEXTS = ("recipient address rejected", "resolver.rst.", "recipient verify failed")
# Where a server starts quoting the recipient's host: Postfix "host … said:", Exim
# "… Response: 550 …".
_QUOTE_STARTS = (" said:", " response:")


def rcpt_refusal_is_ours(reply: str) -> bool:
    """Whether an SMTP refusal of a recipient (the reply's text, after its code) blames
    our side: our sender address, our host, our missing login. Then every slip would be
    refused the same way, so it is an account problem (jobs.errors.AccountRefused: all
    senders pause) and not this slip's permanent failure. Only the server's own words
    count: what it quotes from the recipient's host (after "said:") is the recipient's."""
    text = " ".join(reply.split()).lower()
    parts = text.split(" ", 1)[0].rstrip(":;,").split(".")
    if len(parts) == 3 and parts[0] in ("4", "5") and parts[1] == "1" and parts[2] in ("7", "8"):
        return True
    own = text
    for quote in _QUOTE_STARTS:
        own = own.split(quote, 1)[0]
    if any(t in own for t in _RCPT_THEIRS_TEXTS):
        return False
    return own.startswith(_RCPT_OURS_PREFIXES) or any(t in own for t in _RCPT_OURS_TEXTS)


# ---- provider outages -------------------------------------------------------

def counts_as_provider_failure(exc: BaseException) -> bool:
    """Whether a send's failure says the provider is not working (an HTTP 5xx, an SMTP 4xx,
    a refused, dropped or timed-out connection, an outcome left unknown, a send the job's
    timeout cut short: a provider that hangs): what a provider outage looks like. Not a
    429 (its Retry-After pauses senders already), not our own limiter's wait (RateWait),
    not one recipient's trouble (RecipientDeferred, a permanent error)."""
    from jobs.errors import RecipientDeferred, Throttled

    if isinstance(exc, (Throttled, RecipientDeferred)):
        return False
    if isinstance(exc, TransientError):
        return True
    if any(c.__name__ == "JobTimeoutException" for c in type(exc).__mro__):  # RQ's, raised in the send
        return True
    return isinstance(exc, TRANSIENT_BUILTINS)


OUTAGE_HOLDS_PER_JOB = 10
"""How many times one job may be held back by an outage without spending an attempt.
In an outage most jobs are held once or twice (they wait in the queue while senders are
paused); a job held more often is one the provider fails every time (a message it
chokes on), and counting its attempts again lets it reach the failed list instead of
holding the run open for good."""


def outage_hold_is_free(holds_so_far: int, limit: int = OUTAGE_HOLDS_PER_JOB) -> bool:
    """Whether the next hold of a job already held ``holds_so_far`` times spends no attempt."""
    return holds_so_far < limit


def outage_pause_s(trips: int, first_s: float, max_s: float) -> float:
    """How long every sender waits after the ``trips``-th time in a row (1-based) that the
    provider failed ``limits.outage_after`` sends in a row: ``first_s``, doubled each time
    the send that probes it after a pause fails too, at most ``max_s`` (defaults 5, 10,
    20, 30, 30 s: a provider back from an outage gets its next request within 30 s)."""
    if trips < 1:
        raise ValueError(f"trips is 1-based, got {trips}")
    return min(max_s, first_s * (2 ** min(trips - 1, 62)))


# ---- one send-email process refused for its own credentials --------------------------

SENDER_BEAT_S = 3.0
"""How often a send-email process writes its entry in the senders' hash (jobs.senders)."""
SENDER_TTL_S = 15.0
"""An entry not written for this long is a process gone (killed, or Redis away from it)."""
HOST_PROBE_FIRST_S = 5.0
HOST_PROBE_MAX_S = 60.0
"""A process paused for its refused credentials asks the provider again (a login or an
empty request, nothing sent; its token file read again first) after 5 s, then 10, 20, 40,
60, 60 ... s."""
HOST_REFUSED_LOG_EVERY_S = 60.0
"""Its ERROR line is repeated at most this often while it stays paused."""


def sender_entry(refused_where: str | None, until_ms: float, since_ms: float | None = None) -> str:
    """One process's value in the senders' hash: sending (``refused_where`` None) or
    paused since ``since_ms`` because the provider refused the credentials that came from
    ``refused_where`` (words such as "PAYRUN_EMAIL_TOKEN", never the secret); alive until
    ``until_ms`` (epoch ms). JSON."""
    doc: dict = {"until_ms": int(until_ms)}
    if refused_where is not None:
        doc.update(refused=True, where=refused_where, since_ms=int(since_ms if since_ms is not None else 0))
    return json.dumps(doc, separators=(",", ":"))


def read_sender_entry(raw: object) -> dict | None:
    """A senders' hash value as a dict (until_ms, refused, where, since_ms), or None when
    it is not one (written by another version, damaged): such an entry is left out."""
    try:
        doc = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        if not isinstance(doc, dict):
            return None
        return {"until_ms": float(doc["until_ms"]), "refused": doc.get("refused") is True,
                "where": str(doc.get("where") or ""), "since_ms": float(doc.get("since_ms") or 0)}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def another_sender_sends(entries: dict[str, dict | None], me: str, now_ms: float) -> bool:
    """Whether a send-email process other than ``me`` is alive (its entry not lapsed) and
    not paused for refused credentials: then the provider refusing ``me`` is ``me``'s own
    credentials (one host's token or password), and only ``me`` pauses, its jobs going to
    the others. False when every live process is refused, or ``me`` is alone: then the
    refusal counts toward a provider outage as any failure does (every sender pauses and
    one probes). Pure."""
    for name, e in entries.items():
        if name == me or e is None or e["until_ms"] <= now_ms:
            continue
        if not e["refused"]:
            return True
    return False


def unlisted_senders(live_lanes: Iterable[str], listed: Iterable[str], me: str) -> set[str]:
    """The send-email processes (``email.<host>.<pid>``) of ``live_lanes`` (lane worker
    names ``email.<host>.<pid>.<nn>`` whose liveness key is there) with no entry in the
    senders' hash (``listed``) and other than ``me``: processes of a payrun before session
    42, which keeps none, while hosts run two versions (a rolling deploy). They send as far
    as anyone knows, so a refusal of ``me`` alone is ``me``'s credentials. Pure."""
    listed = set(listed)
    out = set()
    for lane in live_lanes:
        process = lane.rsplit(".", 1)[0]
        if lane.startswith("email.") and process.count(".") >= 2 and process != me and process not in listed:
            out.add(process)
    return out


def host_probe_s(failed_probes: int, first_s: float = HOST_PROBE_FIRST_S, max_s: float = HOST_PROBE_MAX_S) -> float:
    """How long a process paused for refused credentials waits before asking the provider
    again, after ``failed_probes`` probes that were refused too (0: the first wait)."""
    return min(max_s, first_s * (2 ** min(max(0, failed_probes), 62)))


RENDER_WAIT_FIRST_S = 5.0
RENDER_WAIT_MAX_S = 60.0
RENDER_WAIT_LIMIT_S = 3600.0
"""A send whose slip is being rendered again (a retry of it put the render at the front
of pdf-render) looks again after 5 s, then 10, 20, 40, 60, 60 ... s, spending no attempt;
after an hour of that (no render worker up, pdf-render drained) it fails instead."""


def render_wait_s(waits_so_far: int, waited_s: float, first_s: float = RENDER_WAIT_FIRST_S,
                  max_s: float = RENDER_WAIT_MAX_S, limit_s: float = RENDER_WAIT_LIMIT_S) -> float | None:
    """How long a send waits before it looks for its re-rendered slip again, after
    ``waits_so_far`` looks over ``waited_s`` seconds; None once it has waited ``limit_s``
    (it fails then: the render is not running)."""
    if waited_s >= limit_s:
        return None
    return min(max_s, first_s * 2 ** min(max(0, waits_so_far), 16))


STORE_FULL_WAIT_FIRST_S = 5.0
STORE_FULL_WAIT_MAX_S = 60.0
STORE_FULL_HOLDS_PER_JOB = 360
"""A render that finds the slip store full (jobs.errors.StoreFull) tries again after 5 s,
then 10, 20, 40, 60, 60 ... s, spending no attempt, up to 360 times (about 6 hours: the
night of a run); past that its tries count again and it reaches the failed list."""

STORE_ROOM_MIN_BYTES = 64 * 1024
"""A render held for a full store renders again only once its store has this much room
(a slip is ~18 KiB): while it is full, a held try costs one statvfs, not a render."""


def store_full_wait_s(holds_so_far: int, first_s: float = STORE_FULL_WAIT_FIRST_S,
                      max_s: float = STORE_FULL_WAIT_MAX_S) -> float:
    """How long a render held ``holds_so_far`` times already for a full slip store waits
    before it tries again: 5, 10, 20, 40, then 60 s."""
    return min(max_s, first_s * 2 ** min(max(0, int(holds_so_far)), 16))


def store_full_hold_is_free(holds_so_far: int, limit: int = STORE_FULL_HOLDS_PER_JOB) -> bool:
    """Whether the next hold of a render held ``holds_so_far`` times for a full store spends no attempt."""
    return holds_so_far < limit


def store_full_text(store: str, error: OSError, free_bytes: int | None, wait_s: float) -> str:
    """A render's error when its slip store has no room: the path, the system's words, what
    is free there, and what to do. No figure of the slip itself."""
    what = ("the disk quota is used up" if error.errno == errno.EDQUOT else "the disk is full")
    free = "" if free_bytes is None else f", {free_bytes // 1024:,} KiB free"
    return (f"slip store {store}: {error.strerror or error} ({what}{free}): free space there (`payrun prune "
            f"--before YYYY-MM --slips`, or grow it); held {wait_s:g} s, spending no attempt: the run goes on "
            "by itself once there is room")


def is_store_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a file system has no room (ENOSPC, EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


STORE_FAILING_ERRNOS = (errno.EROFS, errno.EIO)
"""What a slip store's file system says when it cannot be written at all: read-only (ext4's
errors=remount-ro after a disk error, a mount made read-only) or a failing disk."""


def is_store_failing(exc: BaseException) -> bool:
    """Whether ``exc`` says a file system cannot be written (EROFS, EIO): jobs.errors.StoreUnwritable."""
    return isinstance(exc, OSError) and exc.errno in STORE_FAILING_ERRNOS


def store_fault_held(write_errno: int | None, probe_errno: int | None) -> bool:
    """Whether a slip's write that failed with ``write_errno`` is the store's trouble (held,
    no attempt spent: jobs.errors.StoreUnwritable) rather than this slip's, given what a
    test write in the store's root said just after (``probe_errno``; None: it succeeded).

    EROFS is the mount's state: always the store's. EIO is the store's only when the test
    write fails too (a dead disk, or one remounted read-only since): a disk that fails one
    write in a million, or a bad block under one slip's folder, passes the test write, and
    that slip's try is an ordinary failed attempt, bounded by its retry budget (six tries,
    then the failed list, "the disk reported an I/O error": `payrun status` counts it as the
    host's trouble). Holding it free instead would retry a slip on a bad block for hours."""
    if write_errno == errno.EROFS:
        return True
    return write_errno == errno.EIO and probe_errno in STORE_FAILING_ERRNOS


def store_fault_todo(code: int | None, mount: str) -> str:
    """What the operator does about a slip store that cannot be written (``code``: EROFS or
    EIO), whose file system is mounted at ``mount``. Pure."""
    if code == errno.EROFS:
        return (f"its file system is read-only (after a disk error, ext4 remounts it so): read the kernel log "
                f"(`dmesg`) for the disk's errors, repair it (`fsck`) and mount it read-write again (`mount -o "
                f"remount,rw {mount}`), or replace the disk")
    return (f"its disk reports I/O errors: read the kernel log (`dmesg`) for the disk's errors, and replace the "
            f"disk (or mount a healthy one at {mount})")


def store_fault_word(code: int | None) -> str:
    """A slip store that cannot be written in a word or two, as the console's worker state
    and ETA say it: "read-only" (EROFS), "failing" (EIO, a disk the test write found
    failing). Pure."""
    return "read-only" if code == errno.EROFS else "failing"


def store_fault_step(code: int | None, mount: str) -> str:
    """``store_fault_todo`` in a few words, for the console's ETA line (the one line the
    on-call reads at 02:00): check the disk, then remount it read-write or replace it. Pure."""
    if code == errno.EROFS:
        return f"check the disk (`dmesg`), then `mount -o remount,rw {mount}` (or replace the disk)"
    return f"check the disk (`dmesg`) and replace it (or mount a healthy one at {mount})"


def errno_text(error: OSError) -> str:
    """"Read-only file system, EROFS": the system's words and the errno's name. Pure."""
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    return f"{error.strerror or error}, {name}"


def store_unwritable_text(store: str, error: OSError, mount: str, wait_s: float) -> str:
    """A render's error when its slip store cannot be written: the path, the system's words
    and errno, what to do, and that the render waits. No figure of the slip itself."""
    todo = (f"check the disk (`dmesg`), then `mount -o remount,rw {mount}`" if error.errno == errno.EROFS
            else "check the disk (`dmesg`) and replace it")  # (short: an error is cut at 300 characters)
    return (f"slip store {store}: cannot be written ({errno_text(error)}): held {wait_s:g} s, spending no attempt: "
            f"the run goes on by itself once it can be written; {todo}")


RECORD_RETRY_FIRST_S = 0.1
RECORD_RETRY_MAX_S = 1.0
RECORD_MARGIN_S = 2.0
"""A made send's record in Redis is retried until this long before the send's job
timeout: past it, the job's own timeout (and its failure handling) comes first."""


def job_end(started_s: float, job_timeout_s: float | None, default_timeout_s: float) -> float:
    """When (the clock of ``started_s``) a send job started at ``started_s`` is cut off:
    its own timeout (fixed when it was enqueued: a config changed since does not move it),
    or the configured one for a job that has none."""
    return started_s + (job_timeout_s or default_timeout_s)


SEND_RESERVE_S = 3.0
"""What a send leaves of its job's time: the record's margin (``RECORD_MARGIN_S``) and a
second to record it; at most a fifth of a short send timeout's."""


def send_window(now_s: float, send_timeout_s: float, job_ends_s: float,
                reserve_s: float = SEND_RESERVE_S) -> tuple[float, float]:
    """``(wait_until, send_until)`` for a send whose job is cut off at ``job_ends_s`` (the
    clock of ``now_s``): it waits for its start at the rate limiter until ``wait_until``
    (half its timeout, leaving the send a quarter of it), and the send itself, however
    long its own timeout, ends by ``send_until``, ``reserve_s`` before the job's end.

    A send used to wait up to half its timeout and then be given its whole timeout again,
    so its job's timeout (the same 30 s) could cut it after the provider had the message
    and before its record: over SMTP, a second email on the next try. Cut by its own
    deadline instead, it fails as a send does (not sent, or its outcome unknown), with time
    left to record one that was made; a start found too late is a RateWait (retried, no
    attempt spent), not a send timed out before it left. ``send_timeout_s``: the send's
    own timeout, no longer than its job's (the function ``send_timeout_s`` below)."""
    send_until = job_ends_s - min(reserve_s, send_timeout_s / 5)
    return min(now_s + send_timeout_s / 2, send_until - send_timeout_s / 4), send_until


def send_timeout_s(configured_s: float, job_timeout_s: float | None) -> float:
    """A send's timeout: the configured one, or its job's timeout if that is shorter (fixed
    when the job was enqueued: a reminder enqueued with 30 s and the configuration raised
    to 120 s since). Its window (``send_window``) reserved a quarter of the configured
    timeout for the send, more than such a job's whole time: it never started, a RateWait
    on every try."""
    return min(configured_s, job_timeout_s or configured_s)


def send_may_start(now_s: float, send_until_s: float, send_timeout_s: float) -> bool:
    """Whether a send whose start time has come (or whose sender stalled since) still has
    time to be made: an eighth of its timeout before ``send_until_s`` (its window's end,
    ``send_window``), half of what the window leaves it. One with less is a RateWait, tried
    again: started, it could only time out, and a send timed out counts toward the
    provider-outage pause (``counts_as_provider_failure``) when the provider was not at fault."""
    return send_until_s - now_s >= send_timeout_s / 8


def ehlo_wait_s(now_s: float, window_ends_s: float, send_left_s: float) -> float:
    """How long a send waits for this host's name for EHLO, being looked up (jobs.mail):
    until the shared window ends (every send meanwhile waits for the same lookup, not only
    the first), and never more than a quarter of what the send has left."""
    return max(0.0, min(window_ends_s - now_s, send_left_s / 4))


def record_retry_wait_s(tries: int, left_s: float, first_s: float = RECORD_RETRY_FIRST_S,
                        max_s: float = RECORD_RETRY_MAX_S) -> float | None:
    """How long to wait before trying again, for the ``tries``-th time (1-based), to record
    a send the provider has accepted while Redis does not answer (restarting, loading its
    data): 0.1 s, doubled each try, at most 1 s, and never past the ``left_s`` seconds
    the job has left. None: no time left, give up (the send is then made again by the
    job's next try: deduped by the HTTP provider, a second email over SMTP)."""
    if tries < 1:
        raise ValueError(f"tries is 1-based, got {tries}")
    if left_s <= 0:
        return None
    return min(left_s, max_s, first_s * (2 ** min(tries - 1, 62)))


# ---- lease arithmetic ------------------------------------------------------

def lease_bound_s(timeout_s: float, visibility_s: float) -> int:
    """How long a try of a job may still be at work, stalled or not: its whole timeout,
    plus the lease its worker keeps the job for (a stalled or killed worker's job goes
    back only once the lease ends). Past it, that try is abandoned."""
    return max(1, int(timeout_s + visibility_s))


def send_claim_ttl_s(send_timeout_s: float, visibility_s: float) -> int:
    """How long a send's claim on its slip's idempotency key lasts (renewed just before
    the message is written): its whole send, plus the lease a stalled or killed sender
    keeps its job for (``lease_bound_s``). Past it, another attempt may claim the key and send."""
    return lease_bound_s(send_timeout_s, visibility_s)


def stage_abandoned(age_s: float, render_timeout_s: float, visibility_s: float) -> bool:
    """Whether a slip staged ``age_s`` ago by a render on another host (whose processes
    this host cannot see) is abandoned: a try finishes its stage (the commit) within its
    timeout and lease (``lease_bound_s``), or its job has been handed to another try. The
    age is by the slip store's clock (the file's mtime) against this host's: a few seconds
    of skew are nothing beside the bound."""
    return age_s > lease_bound_s(render_timeout_s, visibility_s)


def lease_expired(last_heartbeat_s: float, now_s: float, visibility_s: float) -> bool:
    """A running job whose owner has not renewed it within the visibility timeout."""
    return now_s - last_heartbeat_s > visibility_s


def is_stuck(started_s: float, last_heartbeat_s: float, now_s: float, visibility_s: float, stuck_after_s: float) -> bool:
    """Stuck = lease expired (dead worker) or running longer than ``stuck_after_s``."""
    return lease_expired(last_heartbeat_s, now_s, visibility_s) or now_s - started_s > stuck_after_s


def shutdown_deadline(signal_at_s: float, grace_s: float) -> float:
    """When a worker that got SIGTERM at ``signal_at_s`` must have handed back its jobs."""
    return signal_at_s + grace_s


DEQUEUED_SETTLE_S = 10.0
"""How long a job may sit taken-but-not-started (RQ's intermediate list, outside the
started registry) before the reaper presumes its worker died in between. A live worker
crosses that gap in a few Redis round trips (milliseconds)."""


def is_stranded(first_seen_s: float | None, now_s: float, settle_s: float = DEQUEUED_SETTLE_S) -> bool:
    """A job seen taken from its queue but not started since ``first_seen_s``: stranded
    once that is ``settle_s`` ago (never on the first sighting)."""
    return first_seen_s is not None and now_s - first_seen_s >= settle_s


LIVENESS_SETTLE_S = 10.0
"""How long Redis must have been up before a missing liveness key (TTL 10 s, renewed
every 2 s: jobs.runtime.ALIVE_TTL_S) says its worker died. Keys lapse while Redis is
down, and after a restart a live worker's next beat is up to 2 s away: a reaper pass in
that gap took live lanes for dead, returned their jobs and freed their sends' claims,
while each lane waited to record a send the provider had accepted (the next try sent
the slip again). Within this window only the lease decides."""


def should_reap(lease_expires_s: float, now_s: float, worker_alive: bool,
                redis_uptime_s: float = float("inf")) -> str | None:
    """Why a running job must go back to its queue, or None: its lease ran out (nobody
    renewed it), or its worker's liveness key is gone (the worker died) in a Redis up
    for at least LIVENESS_SETTLE_S."""
    if not worker_alive and redis_uptime_s >= LIVENESS_SETTLE_S:
        return "worker {worker} is gone (no liveness for 10 s)"
    if lease_expires_s < now_s:
        return "its lease expired: worker {worker} stopped renewing it"
    return None


GATE_MARGIN_MIN_MS = 20.0
"""The send gate counts starts over 1 s plus a margin for the jitter between the moment
a sender passes the gate (Redis's clock) and the moment the provider stamps its arrival.
20 ms is enough on a quiet host (0 x 429 in 5 of 5 runs of 2,000 sends)."""

GATE_MARGIN_MAX_MS = 100.0
GATE_MARGIN_STEP_MS = 20.0
"""Each provider pause (a 429) widens the margin by this, at most once per second: a
noisy host (a VM whose vCPUs stall for tens of ms) bunches arrivals more than 20 ms, and
every 429 stops all senders for the Retry-After (measured here: 14 x 429 over 600 sends
at 20 ms gave 0.49 of the limit; 50 ms gave 0.95 and none)."""

GATE_MARGIN_DECAY_MS_PER_S = 10.0 / 60.0
"""Without a 429 the margin narrows back by 10 ms a minute, down to the minimum."""


def gate_margin_ms(stored_ms: float | None, ms_since_raised: float) -> float:
    """The margin in force: the stored one, narrowed back with time, within its bounds."""
    m = GATE_MARGIN_MIN_MS if stored_ms is None else stored_ms
    m -= max(0.0, ms_since_raised) / 1000.0 * GATE_MARGIN_DECAY_MS_PER_S
    return min(GATE_MARGIN_MAX_MS, max(GATE_MARGIN_MIN_MS, m))


GATE_WARMUP_MARGIN_MS = 100.0
GATE_WARMUP_MS = 2000.0
"""The first 2 s after the gate was idle (no start in the last 1 s + margin) it keeps a
margin of at least 100 ms. The first requests of a run reach the provider later than
their recorded start than later ones do: cold code on both sides, fresh threads, and on
one host whatever started the run (an enqueue of 2,000 jobs takes a core for 1-2 s). Per
request traces of four full email runs: gate-to-admission p50 1.2 ms, p99 5-7 ms, but
8-40 ms for the first three requests in three of them; the one 429 came from that
(the first admission 40 ms after its start, its window 982 ms at the provider). The
first window holds the same 40 starts, 80 ms longer; the sustained rate is unchanged."""


def gate_window_ms(margin_ms: float, ms_since_busy: float) -> float:
    """The span the gate counts starts over: 1 s plus the margin, and at least the warm-up
    margin during the first GATE_WARMUP_MS after the gate was idle (``ms_since_busy``:
    since the first start after the idle spell)."""
    if 0.0 <= ms_since_busy < GATE_WARMUP_MS:
        margin_ms = max(margin_ms, GATE_WARMUP_MARGIN_MS)
    return 1000.0 + margin_ms


def raised_gate_margin_ms(current_ms: float) -> float:
    """The margin after a 429."""
    return min(GATE_MARGIN_MAX_MS, current_ms + GATE_MARGIN_STEP_MS)


REGATE_LATE_MS = GATE_MARGIN_MIN_MS / 4
"""A send that passed the gate but is about to write its request later than this (its
thread stalled: GIL, a busy host) takes its place in the gate again first. Its first
record would say it started earlier than it does; enough such sends bunched together
are more arrivals in one provider second than the gate allowed (measured on a busy host:
gate-to-write p99 45 ms, max 90 ms, and 2-4 x 429 per 600 sends). Lateness counts from
when the thread asked the gate. 5 ms, a quarter of the margin: the provider's side
(our write to its admission: p99 5-15 ms, stalls of 20-100 ms on a busy host) needs the
rest; a re-gate is one round trip, for a few percent of sends."""


def pauses_every_sender(exc: BaseException) -> bool:
    """A 429 from the provider pauses every sender on every host for its Retry-After; a
    send that only waited too long for our own limiter (RateWait) must not: a pause then
    would lengthen the very wait that timed out; nor must a job held back by an outage
    pause (ProviderDown), which that pause already covers; nor a send stopped because
    another attempt took its claim over (ClaimLost); nor a send waiting for its slip's
    render (RenderPending); nor one this process's own credentials got refused
    (RefusedHere: only this process pauses); nor a render held for a full or unwritable
    slip store (StoreHeld)."""
    from jobs.errors import ClaimLost, ProviderDown, RateWait, RefusedHere, RenderPending, StoreHeld, Throttled

    return (isinstance(exc, Throttled)
            and not isinstance(exc, (RateWait, ProviderDown, ClaimLost, RenderPending, RefusedHere, StoreHeld))
            and bool(exc.retry_after_s))


def late_for_gate(passed_s: float, now_s: float) -> bool:
    """Whether a send that passed the gate at ``passed_s`` must pass it again at ``now_s``
    (both time.monotonic())."""
    return (now_s - passed_s) * 1000.0 > REGATE_LATE_MS


GATE_FIT = 0.995
"""The schedule runs this fraction of the gate's own ceiling (0.5% to spare)."""


def paced_rate(limit_per_s: float, headroom: float, margin_ms: float) -> float:
    """Sends per second to schedule: the headroom under the limit, and no faster than the
    gate lets through, ``floor(limit)`` starts per (1 s + margin), times GATE_FIT, so
    that senders are not queued at the gate (each wait there is a polling loop)."""
    gate_rate = max(1, int(limit_per_s)) * 1000.0 / (1000.0 + margin_ms) * GATE_FIT
    return min(limit_per_s * headroom, gate_rate)


START_WAIT_FIT = 0.8
"""A lane takes a send only while the start it would get is within this fraction of the
send's wait for its start (``start_wait_budget_s``): the rest covers the job's own steps
before it asks (its claim, its slip read, the message built) and a gate that holds it a
little."""


def start_wait_budget_s(send_timeout_s: float) -> float:
    """How long a send taken now may wait for its start under the rate: ``send_window``'s
    wait for a job of the configured timeout starting now (half of it: 15 s at 30 s)."""
    return send_window(0.0, send_timeout_s, job_end(0.0, None, send_timeout_s))[0]


def latest_start_ms(ahead_ms: float, holders: int, interval_ms: float) -> float:
    """The furthest start (ms from now) that a sender taking a slot now can be given: the
    rate's schedule runs ``ahead_ms`` ahead, and each of the ``holders`` slots already
    taken may still reserve one start before it, ``interval_ms`` apart. (A holder that
    reserved already is in ``ahead_ms`` too: counted twice, so this errs long.)"""
    return max(0.0, ahead_ms) + max(0, holders) * interval_ms


def slot_wait_for_rate_ms(ahead_ms: float, holders: int, interval_ms: float, budget_ms: float) -> float:
    """0 when a sender may take a slot (and a job) now: its start would come within
    START_WAIT_FIT of ``budget_ms``; else how long until it would if nothing else
    changed (the schedule's lead shrinks as time passes; a send that ends frees a start).

    Without it, at a low rate (`limits set --rate 2`, 100 lanes, cap 50) every lane took a
    job and reserved a start 25 s out; the sends past half their timeout went back (a held
    try, a ledger row, "retrying" in status) and their lanes took the next job at once,
    to be held again: 57 held tries of one job in 2 minutes, ~250 jobs "retrying". The
    lanes taking work now follow the rate: ~rate x the budget of them at most, re-read
    at every try (a rate changed while running applies at once); at the default rate
    (40/s) the cap (50) binds long before this does."""
    over = latest_start_ms(ahead_ms, holders, interval_ms) - START_WAIT_FIT * budget_ms
    return max(0.0, over)


def slots_for_rate(interval_ms: float, budget_ms: float) -> int:
    """The most slots ``slot_wait_for_rate_ms`` lets be taken at once (the schedule not
    ahead of now), starts ``interval_ms`` apart: 22 at 2/s with a 15 s budget."""
    return int(START_WAIT_FIT * budget_ms // interval_ms) + 1


SLOT_SETTLE_S = 5.0
"""A slot holder's lane must be seen without liveness this long (two reaper passes) before
its slot is freed: a process paused for a moment (SIGSTOP, a VM pause, Redis out of reach
for its liveness beats) is not dead, and its send may still be in flight."""


def slots_to_free(dead: list[str], seen: dict[str, float], now: float,
                  settle_s: float = SLOT_SETTLE_S) -> tuple[list[str], list[str], list[str]]:
    """(free now, mark as first seen now, forget) for a pass that finds ``dead`` holders,
    given when earlier passes first saw each (``seen``)."""
    free = [h for h in dead if h in seen and now - seen[h] >= settle_s]
    mark = [h for h in dead if h not in seen]
    forget = [h for h in seen if h not in dead or h in free]
    return free, mark, forget


def slot_lane(holder: str) -> str:
    """The lane worker a slot holder (``<lane worker name>:<tag>``) names; "" if none."""
    return holder.rpartition(":")[0]


def dead_slot_holders(holders: list[str], alive: dict[str, bool]) -> list[str]:
    """Of a cap's slot holders (``<lane worker name>:<tag>``), those whose lane has lost its
    liveness key (``alive[lane]`` False: killed, or hung past ALIVE_TTL_S, the rule the
    reaper applies to its jobs). A holder that names no lane, or a lane not asked about,
    is kept: its lease still frees it."""
    return [h for h in holders if slot_lane(h) and alive.get(slot_lane(h)) is False]


_SLIP_MONTH = re.compile(r"[0-9]{4}-[0-9]{2}")
_SLIP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def slip_path_problem(month: object, company_id: object, employee_id: object) -> str | None:
    """Why these cannot name a slip's file (``<month>/<company>/<employee>.pdf`` under the
    slip store), or None. The parts come from a job's arguments in Redis: a company or
    employee id such as ``../..`` would write a file outside the store. Ids the importer
    takes (``emp-00042``, a company number) always pass."""
    if not isinstance(month, str) or not _SLIP_MONTH.fullmatch(month):
        return f"month {month!r} is not YYYY-MM"
    if isinstance(company_id, bool) or not (
            (isinstance(company_id, int) and company_id >= 0)
            or (isinstance(company_id, str) and company_id.isascii() and company_id.isdigit() and len(company_id) <= 12)):
        return f"company id {company_id!r} is not a company number"
    if not isinstance(employee_id, str) or not _SLIP_NAME.fullmatch(employee_id):
        return f"employee id {employee_id!r} cannot name a file (letters, digits, - and _ only)"
    return None


def store_entry_problem(st_mode: int, st_uid: int, uid: int, slip: bool = False) -> str | None:
    """Why a folder of the slip store (or, ``slip``, a slip file in it), as ``os.lstat``
    describes it, is not this account's alone, or None. A send attaches what it reads there
    to an email: in a folder another account can write to or owns, that account could put a
    forged slip (other figures, a "new bank account" notice) in place of ours between the
    render and the send, without reading ours."""
    what = "is a symlink" if stat.S_ISLNK(st_mode) else None
    if what is None and not (stat.S_ISREG(st_mode) if slip else stat.S_ISDIR(st_mode)):
        what = "is not a regular file" if slip else "is not a folder"
    if what is None and st_uid != uid:
        what = f"belongs to uid {st_uid}, not to this account (uid {uid})"
    if what is None and st_mode & (0o077 if slip else 0o022):
        what = (f"can be {'read or written' if slip else 'written'} by other accounts "
                f"(mode {stat.S_IMODE(st_mode):o})")
    return what


REISSUE_FIELDS = ("reissued", "replaces", "corrected")
"""What a `payrun resend` adds to a slip's snapshot, and its send's payload, for the slip and
the email to say it replaces an earlier one (reissue_marks); a retry keeps them."""


def reissue_marks(today: str, delivered_at_utc: str | None, corrected_at_utc: str | None,
                  local_date) -> dict[str, object]:
    """A resend's marks: ``reissued`` (``today``, YYYY-MM-DD in the payroll's zone); when an
    earlier slip of that month was delivered (``delivered_at_utc``, the ledger's ISO time of
    the latest delivered send of it, a resend included), ``replaces``: its date,
    ``local_date(iso)``; and ``corrected`` when the salary line's figures changed after that
    delivery (``corrected_at_utc``, set by `payrun import`): the employee got other figures
    before. An employee who never got the slip is told of no slip it replaces."""
    marks: dict[str, object] = {"reissued": today}
    if delivered_at_utc:
        marks["replaces"] = local_date(delivered_at_utc)
        if corrected_at_utc and _utc_instant(corrected_at_utc) > _utc_instant(delivered_at_utc):
            marks["corrected"] = True
    return marks


def _utc_instant(iso: str):
    from datetime import datetime, timezone

    at = datetime.fromisoformat(iso)
    return at if at.tzinfo else at.replace(tzinfo=timezone.utc)


def final_day(month: object, value: object) -> str | None:
    """The day a leaver left (``value``, a snapshot's or its send's payload's ``final``, set by
    payrun.payroll's snapshot) when it marks the slip of ``month`` as their final one: a date
    (YYYY-MM-DD) of that month; anything else marks nothing. The slip (jobs.slip) and its
    email (jobs.tasks.slip_email) read it the same way."""
    if isinstance(value, str) and isinstance(month, str) and DAY_RE.fullmatch(value) and value[:7] == month:
        return value
    return None


DAY_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")  # a day (YYYY-MM-DD): final_day, and jobs.slip's dates
