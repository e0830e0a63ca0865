"""Errors raised by job functions; the retry policy reads them (jobs/policy.py).

JobError
 ├── TransientError     worth retrying: timeouts, connection errors, SMTP 4xx, HTTP 429/5xx
 │    ├── OutcomeUnknown the request may have been delivered (connection dropped after
 │    │                  sending): retry with the same idempotency key
 │    ├── RecipientDeferred  SMTP 4xx for this recipient (greylisting, a full mailbox):
 │    │                  retried as usual; one address's trouble, not the provider's
 │    ├── AccountRefused the provider refused us, not this message (HTTP 401/403, SMTP
 │    │                  authentication failed, sender refused): every send would fail
 │    │                  the same way until someone fixes the credentials, so it counts
 │    │                  toward a provider outage (pause and probe) instead of failing
 │    │                  every slip of the run for good, one by one; when another
 │    │                  send-email process still sends, only this one pauses (RefusedHere)
 │    └── Throttled      the provider said 429: every sender pauses for its Retry-After,
 │         │             and the job is retried after it without spending an attempt
 │         ├── RateWait  our own limiter could not give a start in time: retried without
 │         │             spending an attempt, and nobody else pauses
 │         ├── ClaimLost this attempt's claim on the slip's idempotency key is gone (the
 │         │             reaper freed it, or its TTL ran out): nothing is sent, nobody
 │         │             else pauses; a try the reaper took over ends there, any other
 │         │             is retried without spending an attempt
 │         ├── ProviderDown  the provider failed limits.outage_after sends in a row (an
 │         │             outage): every sender pauses, and this job is retried after it
 │         │             without spending an attempt
 │         ├── RefusedHere  the provider refused THIS send-email process's credentials
 │         │             while another process still sends (one host's bad token):
 │         │             this process pauses itself (jobs.senders), the job goes back
 │         │             to the front for another one, no attempt spent, nobody else pauses
 │         ├── RenderPending  the send's slip file is missing and its render is queued
 │         │             or running (a retry put it there): looked at again shortly, no
 │         │             attempt spent, nobody else pauses
 │         └── StoreHeld  the host's slip store cannot take a slip: the render waits
 │              │        (5 s, doubling up to 60 s) and tries again, spending no attempt,
 │              │        until the operator fixes the host: its trouble, not the job's
 │              ├── StoreFull  no room (ENOSPC, EDQUOT): free space
 │              └── StoreUnwritable  its file system went read-only (EROFS), or its disk
 │                       fails (EIO, and a test write in the store fails too): fix the disk
 └── PermanentError     retrying cannot help: bad address (SMTP 5xx, HTTP 4xx), bad data,
      │                 template error; fails at once with a reason HR can act on
      └── SlipMissing   a send found no slip file (deleted, or a store not mounted on its
                        host) and no render of it on the way: fails at once, but not on the
                        employee's data: `payrun retry` renders the slip again first
"""

from __future__ import annotations


class JobError(Exception):
    """Base of the errors job functions raise on purpose."""


class TransientError(JobError):
    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """Wait at least this long before the next try (from a 429's Retry-After)."""


class OutcomeUnknown(TransientError):
    pass


class RecipientDeferred(TransientError):
    pass


class AccountRefused(TransientError):
    pass


class Throttled(TransientError):
    pass


class RateWait(Throttled):
    def __init__(self, message: str = "waited too long for the global send rate; retrying",
                 retry_after_s: float | None = 1.0):
        super().__init__(message, retry_after_s)


class ClaimLost(Throttled):
    def __init__(self, message: str, retry_after_s: float | None = 1.0):
        super().__init__(message, retry_after_s)


class ProviderDown(Throttled):
    pass


class RenderPending(Throttled):
    pass


class RefusedHere(Throttled):
    """The provider refused this send-email process's credentials (AccountRefused) while
    another live process's were not refused: a bad token or password on this host, not
    the provider. The job goes back for another host without spending an attempt; this
    process stops taking sends until its credentials work again (jobs.senders)."""

    def __init__(self, message: str, retry_after_s: float | None = 1.0):
        super().__init__(message, retry_after_s)


class StoreHeld(Throttled):
    """A render held because its host's slip store cannot take a slip (StoreFull,
    StoreUnwritable): no attempt spent, up to jobs.policy.STORE_FULL_HOLDS_PER_JOB holds
    (counted in the job's ``store_full_holds``), and nobody else pauses."""


class StoreFull(StoreHeld):
    """The slip store has no room for a slip (ENOSPC, EDQUOT, at its write or its sync).
    Not the job's fault, and no retry budget outlasts a disk that filled at 02:00 (a drill:
    198 of 300 slips failed for good within 80 s of the store filling): the render is held,
    spending no attempt, and tries again after ``retry_after_s`` (jobs.policy.store_full_wait_s)
    until space is freed; then the run goes on by itself."""


class StoreUnwritable(StoreHeld):
    """The slip store cannot be written: its file system went read-only (EROFS: ext4's
    errors=remount-ro after a disk error), or its disk fails (EIO at a slip's write, sync or
    rename, and a test write in the store's root fails too: jobs.policy.store_fault_held).
    Every render there would fail the same way: a run spent every slip's attempts and
    dead-lettered them all for one host's disk. Held like StoreFull; the host's render
    workers take no render until a test write succeeds (jobs.runtime.RenderWorker)."""


class StoreUnsafe(TransientError):
    """A folder or slip of the slip store that another account could change (not ours, a
    symlink, writable by group or others): a slip could be swapped in it between its render
    and its send. Nothing is written or read there; the job waits for the operator's fix
    like one on a full disk (jobs.policy.store_entry_problem)."""


class PermanentError(JobError):
    pass


class SlipMissing(PermanentError):
    """A send's slip file is not in its host's slip store, and its render is not queued or
    running (jobs.tasks.send_slip). Not the employee's data: a retry renders it again
    (payrun.deadletters.retry)."""
