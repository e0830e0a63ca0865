"""Job functions for the test and chaos suites. A worker runs them only when its
environment has PAYRUN_TEST_JOBS=1 (see jobs.tasks.allowed_functions); production
workers refuse them like any other function outside the allow-list."""

from __future__ import annotations

import signal
import time


def hang() -> None:
    """Hang as a render stuck inside C code does: SIGALRM (RQ's in-horse timeout) is
    blocked, so only the parent killing the work horse ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    while True:
        time.sleep(3600)


def sleep(seconds: float) -> float:
    """A job that takes a while (shutdown tests)."""
    time.sleep(seconds)
    return seconds


def noop() -> None:
    return None


def spin(seconds: float) -> float:
    """Busy Python code for ``seconds``: a lane's timeout (raised between Python
    instructions, as with RQ's timer) can interrupt it where it cannot interrupt a sleep."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return seconds


def loses_its_first_timeout(seconds: float) -> float:
    """Busy Python code for ``seconds`` whose first timeout lands inside a weakref callback,
    where CPython ignores it (reported as "unraisable"), as a real job's can: only a
    timeout raised again stops it before ``seconds``."""
    import weakref

    from rq.timeouts import BaseTimeoutException

    class _Dying:
        pass

    def callback(_ref) -> None:  # runs in this thread, as the object dies
        try:
            spin(seconds)
        except BaseTimeoutException:
            raise  # out of a weakref callback: Python drops it
    kept = weakref.ref(_Dying(), callback)  # (the object dies at once: callback runs here)
    del kept
    return spin(seconds)


def held_then_flaky() -> None:
    """Held back on its first try (a 429 pause), then failing with a transient error: the
    retry after the failure waits at the back of the queue, not at the held try's front."""
    from rq import get_current_job

    from jobs.errors import Throttled, TransientError

    if int(get_current_job().meta.get("attempt", 1)) == 1:
        raise Throttled("provider rate limit: not sent, no attempt spent", 0.2)
    raise TransientError("HTTP 503 from the provider (test)")


def throttled_once(then_fail: bool = False) -> str:
    """Held back by the provider's rate limit on its first try (as a send is by a 429 or
    an outage pause), then done (or ``then_fail``: a permanent error) on the next: the
    held try must spend no attempt."""
    from rq import get_current_job

    from jobs.errors import PermanentError, Throttled

    if int(get_current_job().meta.get("attempt", 1)) == 1:
        raise Throttled("provider rate limit: not sent, no attempt spent", 0.2)
    if then_fail:
        raise PermanentError("HTTP 422 invalid recipient address")
    return "sent"


def flaky() -> None:
    """Fails with a transient error every time: retried with backoff until its budget is spent."""
    from jobs.errors import TransientError

    raise TransientError("HTTP 503 from the provider (test)")
