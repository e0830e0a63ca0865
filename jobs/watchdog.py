"""Job timeouts for the send lanes: one watchdog thread per process.

RQ's ``TimerDeathPenalty`` starts a ``threading.Timer`` (a new OS thread) for every job and
cancels it after: ~180 µs of CPU per send, ~3% of a send's whole cost, for a timer that
almost never fires. ``WatchdogDeathPenalty`` keeps the same contract (raise the job's
timeout exception in the job's own thread once ``timeout`` seconds have passed; never
after the job left its ``with`` block) with deadlines in one heap and one thread per
process that sleeps until the earliest.

A timeout can only interrupt Python code, as with RQ's timer: a lane blocked in a socket
call is bounded by the send's own cutoff (``arm_call``: jobs.mail shuts the socket of a
send past its deadline), and the send's timeout is below the lease.

Unlike RQ's timer, a timeout is raised again every ``REFIRE_EVERY_S`` until the job has
left its ``with`` block. CPython ignores an exception raised in a weakref callback or a
``__del__`` (it reports it as "unraisable"), and an async exception that lands there is
lost: the job then ran on past its timeout, holding its lane, until something else
stopped it. A job's code that swallowed the timeout (``except Exception``) is stopped
the same way.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable

from rq.timeouts import BaseDeathPenalty, BaseTimeoutException, JobTimeoutException

REFIRE_EVERY_S = 5.0
"""A fired timeout whose job is still inside its ``with`` block is raised again this often
(a timeout Python dropped, or one the job swallowed). Not sooner: a job's own cleanup
after its timeout (giving its idempotency claim back, a QUIT) gets this long before the
next one lands in it."""


@functools.lru_cache(maxsize=64)
def timeout_exception(base: type[BaseException], timeout: float) -> type[BaseException]:
    """``base`` with RQ's message for ``timeout`` built in (an async exception can only be
    raised as a class). RQ's timer patches ``base.__init__`` itself, for every job; a
    subclass per timeout leaves the class alone and still matches ``except base``."""
    message = f"Task exceeded maximum timeout value ({timeout} seconds)"

    def __init__(self, *args, **kwargs):  # noqa: N807
        base.__init__(self, message)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def raise_in_thread(thread_id: int, exc: type[BaseException]) -> bool:
    """Raise ``exc`` in thread ``thread_id`` at its next Python instruction."""
    ret = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))
    if ret > 1:  # more than one thread state hit: undo (CPython's documented contract)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
        raise SystemError("PyThreadState_SetAsyncExc failed")
    return ret == 1


def _clear_pending(thread_id: int) -> None:
    """Drop an async exception raised into ``thread_id`` and not delivered yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


class Watchdog:
    """Deadlines of running jobs, and one daemon thread that fires them.

    ``arm`` returns an entry; ``disarm(entry)`` returns True if the deadline had already
    fired. Both take the same lock as the firing, so once ``disarm`` returned the entry can
    no longer fire. A fired timeout stays in the heap, due again ``refire_s`` later, until
    it is disarmed (``arm_call``'s calls are made once). Disarmed entries stay in the heap
    until they reach its top (lazy deletion: at most one per job started within the
    longest timeout)."""

    def __init__(self, clock=time.monotonic, refire_s: float = REFIRE_EVERY_S):
        self.refire_s = refire_s
        self._clock = clock
        # arm/disarm take the plain lock, not the condition: a timeout fired at a lane (an
        # async exception, raised while the watchdog holds this lock) that lands as the lane
        # acquires it inside Condition.__enter__'s Python frame left it held for good; the
        # watchdog then never fired again and every later arm hung (the whole send-email
        # process). A C-level __enter__ has no frame for it to land in.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, list]] = []
        self._by_thread: dict[int, list[list]] = {}  # the timeouts not yet disarmed, per thread
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.fired = 0  # timeouts and calls fired (a timeout raised again counts once)
        self.refired = 0  # timeouts raised again: their job was still running

    def arm(self, seconds: float, thread_id: int, exc: type[BaseException]) -> list:
        entry = [thread_id, exc, "armed"]
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._heap.clear()  # a forked child inherits no thread, and no parent's jobs
                self._by_thread.clear()
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="job-watchdog", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (self._clock() + seconds, next(self._seq), entry))
            if thread_id is not None:
                self._by_thread.setdefault(thread_id, []).append(entry)
            if self._heap[0][2] is entry:
                self._cond.notify()
        return entry

    def arm_call(self, seconds: float, fn: Callable[[], None]) -> list:
        """Call ``fn()`` on the watchdog's thread once ``seconds`` have passed, unless
        disarmed first (the same guarantee as ``arm``). ``fn`` runs under the watchdog's
        lock: it must be quick and must not arm or disarm."""
        return self.arm(seconds, None, fn)  # type: ignore[arg-type]

    def disarm(self, entry: list) -> bool:
        with self._lock:
            fired = entry[2] == "fired"
            entry[2] = "done"
            if fired and entry[0] == threading.get_ident():
                _clear_pending(entry[0])  # (fired just now, not delivered yet: it must not land after this)
            mine = self._by_thread.get(entry[0])
            if mine is not None:
                mine[:] = [e for e in mine if e is not entry and e[2] != "done"]  # (by identity: equal by value)
                if not mine:
                    del self._by_thread[entry[0]]
            return fired

    def disarm_thread(self, thread_id: int) -> int:
        """Disarm every timeout armed for ``thread_id``; returns how many were live. A lane
        calls it after each job: a repeated timeout that landed in the ``with`` block's
        own exit, before that disarmed it, would otherwise go on firing into the lane's
        next work."""
        with self._lock:
            live = [e for e in self._by_thread.pop(thread_id, ()) if e[2] != "done"]
            fired = False
            for e in live:
                fired = fired or e[2] == "fired"
                e[2] = "done"
            if fired and thread_id == threading.get_ident():
                _clear_pending(thread_id)
            return len(live)

    def pending(self) -> int:
        """Timeouts and calls not yet disarmed that can still fire."""
        with self._lock:
            return sum(1 for *_, e in self._heap if e[2] in ("armed", "fired"))

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2][2] == "done":
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, _, entry = self._heap[0]
                left = deadline - self._clock()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                first = entry[2] == "armed"
                entry[2] = "fired"
                if first:
                    self.fired += 1
                try:
                    if entry[0] is None:  # arm_call
                        entry[1]()
                    elif raise_in_thread(entry[0], entry[1]):
                        # due again until disarmed: the job's with block disarms it on its way out
                        heapq.heappush(self._heap, (self._clock() + self.refire_s, next(self._seq), entry))
                        if not first:
                            self.refired += 1
                except Exception:  # the thread is gone (or the call failed): nothing left to stop
                    pass


WATCHDOG = Watchdog()


class WatchdogDeathPenalty(BaseDeathPenalty):
    """RQ's death-penalty interface (``with penalty: job.perform()``) on the shared
    ``WATCHDOG``. A timeout of 0 or less means none, as in RQ."""

    def __init__(self, timeout, exception=JobTimeoutException, **kwargs):
        super().__init__(timeout, exception, **kwargs)
        self._entry: list | None = None

    def setup_death_penalty(self) -> None:
        if self._timeout <= 0:
            return
        exc = timeout_exception(self._exception, self._timeout)
        self._entry = WATCHDOG.arm(self._timeout, threading.get_ident(), exc)

    def cancel_death_penalty(self) -> None:
        if self._entry is not None:
            WATCHDOG.disarm(self._entry)
            self._entry = None

    def __exit__(self, type, value, traceback):
        """RQ's exit ignores a timeout that lands while it cancels, and moves on with the
        entry still live: with timeouts raised again (REFIRE_EVERY_S) that left the next
        one to land in RQ's bookkeeping after the job, or in the lane's next job. Cancel
        again until it is done: the next fire is REFIRE_EVERY_S away."""
        while self._entry is not None:
            try:
                self.cancel_death_penalty()
            except BaseTimeoutException:
                continue
        return False
