"""Global limits across worker processes and "hosts", sampled in a real Redis."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import wait_for
from jobs.limits import Limiter, Settings, set_limits
from jobs.runtime import make_queue
from payrun import keys


def limiter(conn, cap=3, rate=1000.0, lease_s=30.0) -> Limiter:
    lim = Limiter(conn, "email", cap, rate, lease_s)
    lim.seed()
    return lim


def test_cap_is_never_exceeded_by_threads(conn):
    lim = limiter(conn, cap=3)
    in_flight, peak, lock = [0], [0], threading.Lock()

    def worker():
        for _ in range(10):
            slot = lim.slot()
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0], lim.in_use())
            time.sleep(0.005)  # the "send"
            with lock:
                in_flight[0] -= 1
            lim.release(slot)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] <= 3 and lim.in_use() == 0


def test_a_dead_holders_slot_comes_back_after_its_lease(conn):
    lim = limiter(conn, cap=1, lease_s=0.3)
    assert lim.try_slot("killed-worker")[0]  # taken, never released
    assert not lim.try_slot("other")[0]
    wait_for(lambda: lim.try_slot("other")[0], timeout_s=5, what="the lease to free the slot")


def test_the_reaper_frees_the_slots_of_a_killed_senders_lanes_after_two_passes(conn, cfg):
    """Walkthrough: after a `kill -9` of the send-email process its 50 slots stayed taken
    for their whole lease (~45 s, "email 50/50 in flight") while the new process sent at
    a quarter of the rate; the reaper had returned its jobs at +13 s. Freed once two
    reaper passes SLOT_SETTLE_S apart find the lane without liveness (a process paused
    for a moment is not dead: its send may still be in flight)."""
    from click.testing import CliRunner

    from jobs.limits import free_dead_slots
    from jobs.policy import SLOT_SETTLE_S
    from payrun.cli import cli

    lim = limiter(conn, cap=3, lease_s=60.0)
    for lane in ("send-email.h.1.0", "send-email.h.1.1"):  # process 1 is alive, process 2 was killed
        conn.set(keys.alive(lane), 1, ex=10)
    for holder in ("send-email.h.1.0:aa", "send-email.h.2.0:bb", "send-email.h.2.1:cc"):
        assert lim.try_slot(holder)[0]
    assert not lim.try_slot("send-email.h.1.1:dd")[0]  # full
    t = 1_000_000.0
    assert free_dead_slots(conn, now=t) == []  # first seen dead: marked, kept
    assert free_dead_slots(conn, now=t + SLOT_SETTLE_S / 2) == []
    assert sorted(free_dead_slots(conn, now=t + SLOT_SETTLE_S)) == ["send-email.h.2.0:bb", "send-email.h.2.1:cc"]
    assert lim.in_use() == 1 and lim.try_slot("send-email.h.1.1:dd")[0]  # the live lane's stays
    assert lim.try_slot("no-lane-named")[0]
    assert free_dead_slots(conn, now=t + 100) == []  # a holder that names no lane: its lease frees it
    assert conn.hlen(keys.limit_slots_dead_seen("email")) == 0  # nothing left marked
    # a lane back before the second pass (a pause, not a death) keeps its slot
    conn.delete(keys.alive("send-email.h.1.1"))
    assert free_dead_slots(conn, now=t + 200) == []
    conn.set(keys.alive("send-email.h.1.1"), 1, ex=10)
    assert free_dead_slots(conn, now=t + 300) == [] and lim.in_use() == 3
    assert conn.hlen(keys.limit_slots_dead_seen("email")) == 0
    # `payrun reap` does it too (an earlier pass saw the lane dead long ago)
    conn.delete(keys.alive("send-email.h.1.0"))
    conn.hset(keys.limit_slots_dead_seen("email"), "send-email.h.1.0:aa", time.time() - 60)
    out = CliRunner().invoke(cli, ["reap"])
    assert out.exit_code == 0 and "freed 1 email slot(s) held by senders with no liveness: send-email.h.1.0" \
        in out.output, out.output
    assert lim.in_use() == 2  # dd, and the holder that names no lane


def test_a_lane_going_on_to_its_next_job_gives_its_slot_back_in_the_same_try(conn):
    lim = limiter(conn, cap=1)
    assert lim.try_slot("lane-a:1")[0]
    assert not lim.try_slot("lane-a:2")[0]  # at the cap
    assert lim.try_slot("lane-a:2", previous="lane-a:1")[0]  # one round trip: back, then taken
    assert lim.in_use() == 1 and not lim.try_slot("lane-b:1")[0]
    # the previous slot is given back even when the try fails (a pause, or the cap lowered)
    set_limits(conn, "email", cap=0)
    assert not lim.try_slot("lane-a:3", previous="lane-a:2")[0]
    assert lim.in_use() == 0


def _starts(conn) -> dict[str, float]:
    return {m.decode(): s for m, s in conn.zrange(keys.limit_sends("email"), 0, -1, withscores=True)}


def test_a_send_that_stalled_after_the_gate_takes_a_new_start_before_it_leaves(conn):
    lim = limiter(conn, cap=10, rate=1000.0)
    assert lim.token()
    (first, at), = _starts(conn).items()
    assert lim.recheck(now_s=lim.last_gate_pass_s())  # on time: nothing written
    assert _starts(conn) == {first: at} and "regated" not in lim.stats()
    assert lim.recheck(now_s=lim.last_gate_pass_s() + 0.5)  # as if this thread stalled 0.5 s
    (second, at2), = _starts(conn).items()  # the first start taken back, a later one recorded
    assert second != first and at2 >= at and lim.stats()["regated"] == 1


def test_a_send_whose_thread_stalled_on_the_gates_reply_is_late_too(conn):
    """The stall can come between Redis recording the start and this thread seeing the
    reply (the GIL, a busy host): lateness counts from when the thread asked."""
    from jobs.policy import REGATE_LATE_MS

    lim = limiter(conn, cap=10, rate=1000.0)
    script = lim._gate

    def reply_seen_late(*args, **kwargs):
        r = script(*args, **kwargs)
        time.sleep(REGATE_LATE_MS * 2 / 1000)  # a stall injected after Redis recorded the start
        return r

    lim._gate = reply_seen_late
    assert lim.gate()
    lim._gate = script
    assert lim.recheck()
    assert lim.stats()["regated"] == 1


def test_a_recheck_waits_out_a_429_pause_and_then_takes_its_start(conn):
    lim = limiter(conn, cap=10, rate=1000.0)
    assert lim.token()
    lim.pause(0.2)
    t = time.monotonic()
    assert lim.recheck(now_s=t + 0.5)
    assert time.monotonic() - t >= 0.15 and len(_starts(conn)) == 1
    # and gives up (taking its start back) when the deadline comes first
    lim.pause(5)
    assert not lim.recheck(deadline_s=time.monotonic() + 0.3, now_s=time.monotonic() + 0.5)
    assert _starts(conn) == {}


def test_rate_spaces_starts_across_limiters(conn):
    a, b = limiter(conn, cap=100, rate=50.0), limiter(conn, cap=100, rate=50.0)
    starts: list[float] = []
    lock = threading.Lock()

    def go(lim):
        for _ in range(15):
            lim.token()
            with lock:
                starts.append(time.monotonic())

    threads = [threading.Thread(target=go, args=(x,)) for x in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    starts.sort()
    # 60 starts at 50/s (paced at 99%): about 1.2 s, and no 1 s window holds more than 50
    assert starts[-1] - starts[0] >= 59 / 50 * 0.95
    assert max(sum(1 for s in starts if t0 <= s < t0 + 1.0) for t0 in starts) <= 51
    # counted by the gate script itself as each start passes (no round trip of its own):
    # all but the few that found their reserved time already due waited
    assert 50 <= int(a.stats()["waits"]) <= 60


def test_the_send_gate_holds_the_limit_over_any_second_even_when_senders_bunch(conn):
    """Senders that arrive at once (woke late, or skipped the schedule) are let through
    at most ``limit`` per 1 s + the gate's margin, by their real start times, on every host."""
    from jobs.policy import GATE_MARGIN_MIN_MS, GATE_WARMUP_MARGIN_MS

    GATE_MARGIN_S = GATE_MARGIN_MIN_MS / 1000  # no 429 yet: the margin is at its minimum

    a, b = limiter(conn, cap=100, rate=10.0), limiter(conn, cap=100, rate=10.0)
    starts: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(24)

    def go(lim):
        barrier.wait()
        started_ms = lim.gate(deadline_s=time.monotonic() + 10)  # as the gate recorded it
        with lock:
            starts.append(started_ms / 1000)

    threads = [threading.Thread(target=go, args=(a if i % 2 else b,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    starts.sort()
    assert len(starts) == 24, starts
    # 10 at once, 10 one window later, 4 after the next: any 11 starts span the gate's window
    # (the first window after an idle spell a wider one: see the warm-up tests below)
    spans = [later - first for first, later in zip(starts, starts[10:])]
    assert min(spans) >= 1.0 + GATE_MARGIN_S - 1e-6, [round(x - starts[0], 3) for x in starts]
    assert starts[10] - starts[0] >= 1.0 + GATE_WARMUP_MARGIN_MS / 1000 - 1e-6
    assert starts[-1] - starts[0] >= 2 * (1.0 + GATE_MARGIN_S) - 0.05
    assert int(a.stats()["gated"]) == 14  # each start the gate held back, counted once as it passed


def test_the_send_gate_keeps_a_wider_margin_for_its_first_window_after_an_idle_spell(conn):
    """A run's first requests reach the provider later than later ones: for the first
    2 s after an idle spell the gate counts over 1 s + the warm-up margin."""
    from jobs.policy import GATE_MARGIN_MIN_MS, GATE_WARMUP_MARGIN_MS

    lim = limiter(conn, cap=100, rate=10.0)
    first = [lim.gate() for _ in range(10)]  # an idle gate: the limit passes at once
    between = 1.0 + (GATE_MARGIN_MIN_MS + GATE_WARMUP_MARGIN_MS) / 2000  # past the usual window, inside the warm one
    t = time.monotonic()
    assert lim.gate(deadline_s=t + between) is None  # the 11th needs 1 s + the warm-up margin
    assert time.monotonic() - t < between / 2  # known at once, not after waiting
    eleventh = lim.gate(deadline_s=time.monotonic() + 10)
    assert eleventh - min(first) >= 1000 + GATE_WARMUP_MARGIN_MS - 0.01


def test_after_its_warm_up_the_send_gate_counts_over_1_s_and_the_margin(conn):
    from jobs.policy import GATE_MARGIN_MIN_MS, GATE_WARMUP_MARGIN_MS, GATE_WARMUP_MS

    lim = limiter(conn, cap=100, rate=10.0)
    first = [lim.gate() for _ in range(10)]
    # as if these 10 came at the end of a run busy for longer than the warm-up
    conn.hset(keys.limit_gate("email"), "busy_ms", min(first) - GATE_WARMUP_MS - 1000)
    between = 1.0 + (GATE_MARGIN_MIN_MS + GATE_WARMUP_MARGIN_MS) / 2000
    eleventh = lim.gate(deadline_s=time.monotonic() + between)
    assert eleventh, "held to the warm-up margin after the warm-up"
    assert eleventh - min(first) >= 1000 + GATE_MARGIN_MIN_MS - 0.01


def test_the_send_gate_gives_way_to_a_429_pause(conn):
    lim = limiter(conn, rate=10.0)
    lim.pause(0.3)
    assert lim.gate() is False  # reserve again after the pause, do not send now


def test_a_429_pauses_every_sender(conn):
    lim, other = limiter(conn), limiter(conn)
    t0 = time.monotonic()  # (before the pause: a stall between the two lines cannot shorten it)
    lim.pause(0.5)
    other.token()
    assert time.monotonic() - t0 >= 0.45
    assert other.stats()["http_429"] == 1


def test_a_429_widens_the_send_gate_once_per_pause_and_slows_the_schedule(conn):
    """Each pause widens the gate's margin by one step (several 429s from sends already in
    flight count once), for every host, and the schedule spaces starts to fit the gate."""
    from jobs.policy import GATE_MARGIN_MIN_MS, GATE_MARGIN_STEP_MS, paced_rate

    lim, other = limiter(conn, rate=40.0), limiter(conn, rate=40.0)
    assert lim.gate_margin_ms() == GATE_MARGIN_MIN_MS
    for _ in range(3):  # three senders got a 429 at once
        lim.pause(0.05)
    widened = other.gate_margin_ms()
    assert GATE_MARGIN_MIN_MS + GATE_MARGIN_STEP_MS - 0.1 <= widened <= GATE_MARGIN_MIN_MS + GATE_MARGIN_STEP_MS
    wait_for(lambda: not conn.exists(keys.limit_pause("email")), timeout_s=2, what="the pause to end")
    # the schedule: consecutive reservations are 1 / paced_rate apart (the TAT moves by it)
    for _ in range(5):  # (again if this test stalled past a reserved start: see _stalled)
        _busy_for_long(conn)  # past the gate's warm-up (tested below)
        other.token()
        tat1 = float(conn.get(keys.limit_tat("email")))
        stalled = _stalled(conn, tat1)
        other.token()
        tat2 = float(conn.get(keys.limit_tat("email")))
        if not stalled:
            break
    expected = 1000.0 / paced_rate(40.0, 0.975, widened)
    assert abs((tat2 - tat1) - expected) < 0.2, (tat2 - tat1, expected)
    assert expected > 1000.0 / (40.0 * 0.975)  # slower than the headroom alone


def _stalled(conn, tat_ms: float) -> bool:
    """Whether Redis's clock is past ``tat_ms`` already: the next reservation would start
    from now, not from the schedule (this process stalled longer than one interval, ~25 ms
    at 40/s: GC, a loaded host), and a check of the spacing would measure the stall."""
    sec, usec = conn.time()
    return int(sec) * 1000 + int(usec) / 1000 > tat_ms


def _busy_for_long(conn):
    """The gate as in the middle of a long run: a start just now, the idle spell long ago."""
    sec, usec = conn.time()
    conn.zadd(keys.limit_sends("email"), {"earlier": int(sec) * 1000 + int(usec) / 1000})
    conn.hset(keys.limit_gate("email"), "busy_ms", 0)


def test_the_schedule_fits_the_warm_up_window_after_an_idle_spell(conn):
    """Paced to the gate's warm-up window while it lasts, so that senders do not queue at
    the gate (where a sliding window would repeat the delay window after window)."""
    from jobs.policy import GATE_MARGIN_MIN_MS, GATE_WARMUP_MARGIN_MS, paced_rate

    lim = limiter(conn, rate=40.0)
    for _ in range(5):  # (again, from idle, if this test stalled past a reserved start)
        conn.delete(keys.limit_tat("email"), keys.limit_sends("email"), keys.limit_gate("email"))
        tats, stalled = [], False
        for _ in range(3):
            lim.token()
            tats.append(float(conn.get(keys.limit_tat("email"))))
            stalled = stalled or _stalled(conn, tats[-1])
        _busy_for_long(conn)
        stalled = stalled or _stalled(conn, tats[-1])
        lim.token()
        tat = float(conn.get(keys.limit_tat("email")))
        if not stalled:
            break
    warm = 1000.0 / paced_rate(40.0, 0.975, GATE_WARMUP_MARGIN_MS)
    assert all(abs((b - a) - warm) < 0.2 for a, b in zip(tats, tats[1:])), (tats, warm)
    assert abs((tat - tats[-1]) - 1000.0 / paced_rate(40.0, 0.975, GATE_MARGIN_MIN_MS)) < 0.2


def test_a_start_past_the_callers_deadline_is_not_reserved_and_a_raised_rate_applies_at_once(conn):
    """A rate lowered from the console to 3/s with 50 lanes waiting: the starts reach past a
    send's deadline, the send gives up (RateWait) and tries again. A reservation it gave up
    on used to stay, so each try pushed the schedule further: hours ahead within minutes,
    and no send started even after the rate was raised back (exploratory testing)."""
    lim = limiter(conn, rate=3.0)
    sec, usec = conn.time()
    far = int(sec) * 1000 + int(usec) / 1000 + 10_000  # the schedule 10 s ahead: the starts of waiting senders
    conn.set(keys.limit_tat("email"), str(far))
    for _ in range(20):  # twenty senders that each wait at most 1 s
        assert lim.token(deadline_s=time.monotonic() + 1.0) is False
    assert float(conn.get(keys.limit_tat("email"))) == far  # none of them moved it
    sends = conn.zcard(keys.limit_sends("email"))
    set_limits(conn, "email", rate_per_s=40.0)  # the operator puts the rate back
    started = time.monotonic()
    assert lim.token(deadline_s=time.monotonic() + 1.0) is True  # sending resumes at once
    assert time.monotonic() - started < 0.5 and conn.zcard(keys.limit_sends("email")) == sends + 1
    set_limits(conn, "email", cap=7)  # a cap change leaves the schedule alone
    assert conn.exists(keys.limit_tat("email"))


def test_senders_that_give_up_keep_sending_at_a_low_rate(conn):
    """Twelve senders at 4/s, each giving up after 0.5 s and trying again (as a send's
    RateWait retry does): the schedule stays within reach and starts go on at the rate.
    Before, each give-up pushed it further and the starts stopped within a second or two."""
    lim = limiter(conn, rate=4.0)
    stop_at = time.monotonic() + 3.0
    passed = []

    def sender():
        while time.monotonic() < stop_at:
            if lim.token(deadline_s=time.monotonic() + 0.5):
                passed.append(time.monotonic())
            else:
                time.sleep(0.05)  # (a RateWait job is retried after a second)

    threads = [threading.Thread(target=sender) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    sec, usec = conn.time()
    ahead_ms = float(conn.get(keys.limit_tat("email")) or 0) - (int(sec) * 1000 + int(usec) / 1000)
    assert ahead_ms < 500 + 1000 / (4.0 * 0.975) + 50, ahead_ms
    assert len(passed) >= 8, len(passed)  # ~11 at 3.9/s over 3 s
    assert max(passed) > stop_at - 1.0  # still starting at the end


def test_a_sends_wait_budget_and_the_furthest_start_a_new_slot_may_get():
    from jobs.policy import (START_WAIT_FIT, latest_start_ms, slot_wait_for_rate_ms, slots_for_rate,
                             start_wait_budget_s)

    assert start_wait_budget_s(30) == 15.0  # half the send timeout (jobs.policy.send_window)
    assert start_wait_budget_s(6) == 3.0
    assert latest_start_ms(-500.0, 3, 100.0) == 300.0  # a schedule behind now counts as now
    assert latest_start_ms(2000.0, 0, 100.0) == 2000.0
    budget = 15_000.0
    fits = START_WAIT_FIT * budget  # 12 s
    assert slot_wait_for_rate_ms(0.0, 21, 550.0, budget) == 0.0  # 11.55 s: taken
    assert slot_wait_for_rate_ms(0.0, 22, 550.0, budget) == pytest.approx(22 * 550.0 - fits)
    assert slot_wait_for_rate_ms(5000.0, 12, 550.0, budget) == 0.0
    assert slot_wait_for_rate_ms(5000.0, 13, 550.0, budget) == pytest.approx(5000 + 13 * 550.0 - fits)
    # the default limits: 50 slots at 40/s never come near it
    assert slot_wait_for_rate_ms(50 * 25.7, 49, 25.7, budget) == 0.0
    assert slots_for_rate(550.0, budget) == 22  # the most taken at once (the schedule not ahead)
    assert slot_wait_for_rate_ms(0.0, slots_for_rate(550.0, budget) - 1, 550.0, budget) == 0.0
    assert slot_wait_for_rate_ms(0.0, slots_for_rate(550.0, budget), 550.0, budget) > 0.0


def _low_rate_holders(lim: Limiter, n: int = 100, prefix: str = "lane") -> int:
    """Slots taken, one try each, by new holders until one is refused (or ``n``)."""
    taken = 0
    while taken < n and lim.try_slot(f"{prefix}-{taken}")[0]:
        taken += 1
    return taken


def test_at_a_low_rate_slots_follow_the_rate_not_the_cap(conn):
    """Session 42: at `limits set --rate 2` with 100 lanes (cap 50) every lane took a job
    and reserved a start up to 25 s out; those past half the send timeout went back (a held
    try) and their lanes took the next job at once. A slot is now refused while the start
    its holder would get (the schedule's lead plus one interval per slot held) lies beyond
    START_WAIT_FIT of the send's wait budget: at 2/s, 22 slots, not 50. The Lua mirrors
    jobs.policy.slot_wait_for_rate_ms, at the pace the schedule keeps at the gate's widest
    margin."""
    from jobs.limits import RATE_HEADROOM
    from jobs.policy import GATE_MARGIN_MAX_MS, paced_rate, slot_wait_for_rate_ms

    lim = Limiter(conn, "email", 50, 40.0, lease_s=60, start_wait_s=15.0)
    lim.seed()
    assert _low_rate_holders(lim) == 50  # the default rate: the cap binds
    conn.delete(keys.limit_slots("email"))
    sec, usec = conn.time()
    conn.set(keys.limit_tat("email"), str(sec * 1000 + usec / 1000 + 1300))  # 50 starts waiting at 40/s
    assert _low_rate_holders(lim) == 50
    conn.delete(keys.limit_slots("email"))

    set_limits(conn, "email", rate_per_s=2.0)  # while running: read at the next try
    interval = 1000.0 / paced_rate(2.0, RATE_HEADROOM, GATE_MARGIN_MAX_MS)  # ~553 ms
    assert _low_rate_holders(lim) == 22 == lim.slots_for_rate(2.0)  # 21 x 553 ms = 11.6 s <= 12 s < 22 x 553 ms
    ok, wait_ms = lim.try_slot("lane-late")
    assert not ok and wait_ms == pytest.approx(slot_wait_for_rate_ms(0.0, 22, interval, 15_000.0), abs=1.5)
    assert Limiter(conn, "email", 50, 40.0, lease_s=60).try_slot("no-budget")[0]  # (no budget: the cap alone)
    conn.delete(keys.limit_slots("email"))
    sec, usec = conn.time()
    conn.set(keys.limit_tat("email"), str(sec * 1000 + usec / 1000 + 5200))  # 5.2 s of starts reserved
    assert _low_rate_holders(lim) == 13  # 5.2 s + 12 x 553 ms <= 12 s
    # the job comes with the slot, or stays queued: taking it is refused alike
    q = make_queue(keys.EMAIL_QUEUE, conn)
    q.enqueue_call("jobs.tasks.noop", job_id="waits-its-turn")
    stop = threading.Event()
    stop.set()  # (one try, no waiting)
    assert lim.take(stop, "lane-x", q.key, q.intermediate_queue_key, q.job_class.redis_job_namespace_prefix) is None
    assert q.job_ids == ["waits-its-turn"]
    conn.zrem(keys.limit_slots("email"), "lane-12")
    got = lim.take(stop, "lane-x", q.key, q.intermediate_queue_key, q.job_class.redis_job_namespace_prefix)
    assert got.job_id == "waits-its-turn" and q.count == 0
    set_limits(conn, "email", rate_per_s=40.0)  # raised again: the cap binds again at once
    assert _low_rate_holders(lim, prefix="more") == 50 - 13 and lim.in_use() == 50


def test_at_a_low_rate_with_many_lanes_jobs_wait_their_turn_instead_of_cycling_held_tries(conn, cfg, redis_url,
                                                                                          tmp_path, monkeypatch):
    """Session 42: rate 2/s, 100 lanes, cap 50: one job had 57 held tries ("waited too long
    for the global send rate") in 2 minutes, each a ledger row and an attempt listed by
    `payrun job`, and ~250 jobs showed "retrying". Here a send-email process of 60 lanes
    (cap 50) at 2/s, with a 6 s send timeout (a 3 s wait budget, so that a few jobs already
    outrun it): every job is delivered, at the rate, and none is held more than once."""
    from jobs import tasks
    from payrun import config as config_mod
    from payrun.provider import Provider
    from tests.cluster import scrub_env

    provider = Provider(latency_s=0.0, rate_per_s=1000).start()
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    conf = tmp_path / "c.toml"
    conf.write_text("[email]\nlanes = 60\ntimeout_s = 6\n")
    monkeypatch.setenv("PAYRUN_CONFIG", str(conf))
    monkeypatch.setenv("PAYRUN_SLIPS_DIR", str(store))
    tasks.settings.cache_clear()
    here = config_mod.load()
    env = dict(scrub_env(), PAYRUN_REDIS_URL=redis_url, PAYRUN_CONFIG=str(conf), PAYRUN_SLIPS_DIR=str(store),
               PAYRUN_EMAIL_URL=provider.url, PYTHONPATH=os.pathsep.join(sys.path))
    log = tmp_path / "send-email.log"
    n = 16
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", "send-email"], env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: conn.scard("rq:workers") >= 60, timeout_s=60, what="60 lanes")
        set_limits(conn, "email", rate_per_s=2.0)
        ids = []
        for i in range(n):
            emp = f"emp-{i:03d}"
            rel = tasks.slip_relpath("2026-11", 1, emp)
            (store / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            (store / rel).write_bytes(b"%PDF-1.7 test slip")
            (store / rel).chmod(0o600)
            ids.append(tasks.enqueue_email(conn, here, {
                "month": "2026-11", "key": keys.idem_key("2026-11", emp), "company_id": 1,
                "company_name": "Meghna", "employee_id": emp, "to": f"{emp}@meghna.example", "to_name": f"E {i}",
                "slip": rel}))
        started = time.monotonic()
        wait_for(lambda: provider.stats()["delivered"] >= n or proc.poll() is not None, timeout_s=60,
                 what=f"{n} deliveries at 2/s")
        assert provider.stats()["delivered"] == n, log.read_text()[-3000:]
        took = time.monotonic() - started
        q = make_queue(keys.EMAIL_QUEUE, conn)
        held = {i: int(q.fetch_job(i).get_meta(refresh=True).get("held", 0)) for i in ids}
        assert max(held.values()) <= 1 and sum(held.values()) <= 3, held
        assert took > (n - 1) / 2.0 - 1, took  # (the rate held: ~7.7 s for 16 at 1.95/s)
        assert conn.zcard("rq:failed:send-email") == 0 and provider.stats()["throttled_429"] == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        provider.stop()
        tasks.settings.cache_clear()


def test_limits_change_at_run_time(conn):
    lim = limiter(conn, cap=1)
    assert lim.try_slot("a")[0] and not lim.try_slot("b")[0]
    set_limits(conn, "email", cap=2)
    assert lim.try_slot("b")[0]
    assert limiter(conn, cap=1).settings().cap == 2  # a new worker does not overwrite it


def test_cap_holds_across_two_hosts(conn, cfg, tmp_path):
    """Two send-email processes in separate process groups (two "hosts") share a cap of 4."""
    conf = tmp_path / "c.toml"
    conf.write_text("[limits]\nemail_concurrency = 4\n[email]\nlanes = 6\n")
    env = dict(os.environ, PAYRUN_CONFIG=str(conf), PAYRUN_TEST_JOBS="1")
    q = make_queue(keys.EMAIL_QUEUE, conn)
    for i in range(40):
        q.enqueue_call("jobs.testing.sleep", args=(0.2,), job_id=f"s-{i}", timeout=5)
    procs = [subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", "send-email"], env=env,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(2)]
    peak = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            peak = max(peak, conn.zcard("rq:wip:send-email"))
            if q.count == 0 and conn.zcard("rq:wip:send-email") == 0:
                break
            time.sleep(0.01)  # sampling interval, not a wait for a condition
        assert q.count == 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    assert 3 <= peak <= 4, peak


def test_a_provider_429_says_how_long_after_its_gate_pass_the_request_left(conn, cfg, monkeypatch, caplog):
    """The sender's side of a 429, for diagnosing one: the line names the key and the time
    from the gate pass to the write; every sender is paused."""
    import logging

    from jobs import idempotency, tasks
    from jobs.errors import Throttled

    class Refusing:  # the provider answers 429 Retry-After: 1 once the request is written
        def prepare(self, msg):
            return b"{}"

        def send(self, msg, prepared, before_write=None, before_data=None, until=None):
            assert before_write() is True
            raise Throttled("provider: 429 rate limited", retry_after_s=1.0)

    tasks.settings.cache_clear()
    monkeypatch.setattr(tasks, "transport", lambda: Refusing())
    monkeypatch.setattr(tasks, "_limiters", {})
    assert idempotency.claim(conn, "2026-11:1:emp-1", "email-x:1", 60) not in (idempotency.SENT, idempotency.BUSY)
    caplog.set_level(logging.WARNING, logger="payrun.jobs")
    caplog.set_level(logging.DEBUG, logger="payrun.sends")  # as PAYRUN_LOG_DEBUG=payrun.sends does
    sec, usec = conn.time()
    t0_ms = int(sec) * 1000 + int(usec) / 1000
    try:
        tasks.send_limited(conn, tasks.settings(), object(), "2026-11:1:emp-1", "email-x:1")
        raise AssertionError("the 429 must reach the job")
    except Throttled:
        pass
    lines = [r.getMessage() for r in caplog.records if "provider 429" in r.getMessage()]
    assert len(lines) == 1 and "2026-11:1:emp-1: written" in lines[0] and "after its gate pass" in lines[0]
    # the trace line (bench/email.py --trace): the start Redis recorded, then the write
    trace = [r.getMessage().split() for r in caplog.records if r.name == "payrun.sends"]
    assert len(trace) == 1 and trace[0][:3] == ["send", "2026-11:1:emp-1:", "gate"] and trace[0][4] == "written"
    stamp, written = float(trace[0][3]), float(trace[0][5])
    assert t0_ms - 1 <= stamp <= written < t0_ms + 10_000
    assert conn.pttl(keys.limit_pause("email")) > 0  # everyone waits
    tasks.settings.cache_clear()


def test_a_send_that_starts_late_in_its_job_ends_before_the_jobs_timeout(conn, cfg, monkeypatch):
    """Review (session 34): a send was given its whole timeout (30 s) from when it left the
    rate limiter, up to 15 s into its job, so the job's timeout (30 s) could cut it after the
    provider had the message and before its record: over SMTP a second email on the retry.
    It now ends by its own deadline before the job's end (3 s; a fifth of a short timeout):
    failed as a send (here: its outcome unknown), with time left to record one that was made."""
    from jobs import idempotency, mail, tasks
    from jobs.errors import OutcomeUnknown, RateWait
    from jobs.policy import counts_as_provider_failure
    from payrun.provider import Provider

    slow = Provider(latency_s=20, rate_per_s=1000).start()  # answers long after any deadline here
    try:
        tasks.settings.cache_clear()
        monkeypatch.setattr(tasks, "transport", lambda: mail.HttpTransport(slow.url, 30))
        monkeypatch.setattr(tasks, "_limiters", {})
        key, token = "2026-11:1:emp-late", "email-late:1"
        assert idempotency.claim(conn, key, token, 60) not in (idempotency.SENT, idempotency.BUSY)
        msg = mail.Message(to_addr="a@payrun.test", to_name="A", subject="s", text_body="b",
                           attachment_name="s.pdf", attachment_bytes=b"%PDF-1.7", idempotency_key=key,
                           sender="payroll@payrun.test")
        settings = tasks.settings()
        short = dataclasses.replace(settings, email=dataclasses.replace(settings.email, timeout_s=10))
        start = time.monotonic()
        with pytest.raises(OutcomeUnknown):  # (the transport's own timeout: 30 s)
            tasks.send_limited(conn, short, msg, key, token, started=start - 2.0)  # a 10 s job with 8 s left
        took = time.monotonic() - start
        assert took < 8.0 - 2.0 + mail.CUTOFF_MARGIN_S + 0.5, took  # by the job's end less a fifth of 10 s
        assert took > 8.0 - 2.0 - 0.5, took  # (not cut sooner)

        # with too little of its job left to send at all: no start taken, no send timed out
        # (which would count toward a provider outage), the claim given back, no attempt spent
        assert idempotency.claim(conn, key, token, 60) not in (idempotency.SENT, idempotency.BUSY)
        with pytest.raises(RateWait):
            tasks.send_limited(conn, settings, msg, key, token, started=time.monotonic() - 23.0)  # 7 s of 30 left
        assert not idempotency.state(conn, key).get("owner")
        assert not counts_as_provider_failure(RateWait())
    finally:
        slow.stop()
        tasks.settings.cache_clear()


def _late_msg(key):
    from jobs import mail

    return mail.Message(to_addr="a@payrun.test", to_name="A", subject="s", text_body="b",
                        attachment_name="s.pdf", attachment_bytes=b"%PDF-1.7", idempotency_key=key,
                        sender="payroll@payrun.test")


def test_a_job_enqueued_with_a_shorter_timeout_than_the_config_now_gives_is_sent(conn, cfg, monkeypatch):
    """Review (session 35): a reminder enqueued with a 30 s timeout, the configured send
    timeout raised to 120 s since: its window kept 30 s (a quarter of 120) for the send,
    more than its whole job, and it was refused as a RateWait on every try."""
    from jobs import idempotency, mail, tasks
    from payrun.provider import Provider

    fast = Provider(latency_s=0.05, rate_per_s=1000).start()
    try:
        tasks.settings.cache_clear()
        settings = tasks.settings()
        long = dataclasses.replace(settings, email=dataclasses.replace(settings.email, timeout_s=120))
        monkeypatch.setattr(tasks, "transport", lambda: mail.HttpTransport(fast.url, 120))
        monkeypatch.setattr(tasks, "_limiters", {})
        key, token = "2026-11:1:emp-short-job", "email-short:1"
        assert idempotency.claim(conn, key, token, 60) not in (idempotency.SENT, idempotency.BUSY)
        assert tasks.send_limited(conn, long, _late_msg(key), key, token, started=time.monotonic(), job_timeout_s=30)
        assert idempotency.state(conn, key).get("state") == "sent"
    finally:
        fast.stop()
        tasks.settings.cache_clear()


def test_a_send_that_stalls_after_its_start_time_is_not_made_without_time_left(conn, cfg, monkeypatch):
    """Review (session 35): a sender that stalled between its start time and the write
    (a paused process; over SMTP a slow EHLO name) made the send with its window nearly
    gone: it timed out, counted toward the provider-outage pause. Now a RateWait."""
    from jobs import idempotency, mail, tasks
    from jobs.errors import RateWait
    from payrun.provider import Provider

    fast = Provider(latency_s=0.05, rate_per_s=1000).start()
    try:
        tasks.settings.cache_clear()
        settings = tasks.settings()
        monkeypatch.setattr(tasks, "transport", lambda: mail.HttpTransport(fast.url, 30))
        monkeypatch.setattr(tasks, "_limiters", {})
        lim = tasks.limiter(conn)
        real = lim.recheck

        def stalls(**kw):
            ok = real(**kw)
            time.sleep(1.5)  # (the stall itself, not a wait for something: 2 s job, 0.1 s of its window left)
            return ok

        monkeypatch.setattr(lim, "recheck", stalls)
        counted = []
        monkeypatch.setattr(tasks, "_count_provider_failure", lambda *a: counted.append(a))
        key, token = "2026-11:1:emp-stalled", "email-stalled:1"
        assert idempotency.claim(conn, key, token, 60) not in (idempotency.SENT, idempotency.BUSY)
        with pytest.raises(RateWait):
            tasks.send_limited(conn, settings, _late_msg(key), key, token, started=time.monotonic(), job_timeout_s=2)
        assert not idempotency.state(conn, key).get("owner")  # the claim given back
        assert fast.stats()["received"] == 0  # not made
        assert counted == []  # not the provider's failure
    finally:
        fast.stop()
        tasks.settings.cache_clear()


def test_the_configs_limits_apply_at_each_start_unless_an_operator_set_one(conn):
    """Ops walkthrough: the first start's cap and rate stayed in Redis for good, so a
    config edit never applied and an incident's `limits set` outlived every restart
    unseen. Now each send-email start puts the config's values in force, except one an
    operator set, which stays (and says so) until `payrun limits reset`."""
    from jobs.limits import limit_sources, reset_limits, seed_limits

    assert seed_limits(conn, "email", 50, 40.0) == {}
    assert Limiter(conn, "email", 1, 1.0, lease_s=60).settings() == Settings(cap=50, rate_per_s=40.0)
    assert seed_limits(conn, "email", 45, 33.0) == {}  # the config edited: in force at the next start
    assert Limiter(conn, "email", 1, 1.0, lease_s=60).settings() == Settings(cap=45, rate_per_s=33.0)
    set_limits(conn, "email", rate_per_s=25.0)  # an incident
    kept = seed_limits(conn, "email", 45, 33.0)  # a restart (a deploy, down/up)
    assert set(kept) == {"rate_per_s"} and kept["rate_per_s"][0] == "25.0"
    assert Limiter(conn, "email", 1, 1.0, lease_s=60).settings() == Settings(cap=45, rate_per_s=25.0)
    src = limit_sources(conn, "email")
    assert src["rate_per_s"]["set_at"] and src["rate_per_s"]["config"] == "33.0" and src["cap"]["set_at"] is None
    reset_limits(conn, "email", 45, 33.0)
    assert seed_limits(conn, "email", 45, 33.0) == {}
    assert Limiter(conn, "email", 1, 1.0, lease_s=60).settings() == Settings(cap=45, rate_per_s=33.0)
    assert limit_sources(conn, "email")["rate_per_s"]["set_at"] is None


def test_a_change_of_the_limits_in_force_is_stamped_for_the_consoles_eta(conn):
    """The console's ETA counts the send rate from the last change of the cap or rate
    (console.data.Source.delivery_rate): each way a value changes in force stamps it; a
    first start, or a restart with the same config, changes nothing and stamps nothing."""
    from jobs.limits import CHANGED_AT, reset_limits, seed_limits

    def stamp():
        v = conn.hget(keys.limit_conf("email"), CHANGED_AT)
        return float(v) if v else None

    seed_limits(conn, "email", 50, 40.0)
    assert stamp() is None  # the first start: no pace before it to set apart
    seed_limits(conn, "email", 50, 40.0)
    assert stamp() is None  # a restart, same config
    before = time.time()
    seed_limits(conn, "email", 45, 40.0)  # a deploy with a new cap
    first = stamp()
    assert first is not None and before <= first <= time.time()
    set_limits(conn, "email", cap=10)
    second = stamp()
    assert second is not None and second >= first
    conn.hset(keys.limit_conf("email"), CHANGED_AT, "1.0")
    reset_limits(conn, "email", 45, 40.0)
    assert stamp() > 1.0


def test_limits_show_and_reset_from_the_cli(cfg, conn):
    from click.testing import CliRunner

    from payrun.cli import cli

    runner = CliRunner()
    Limiter(conn, "email", cfg.limits.email_concurrency, cfg.limits.email_rate_per_s, lease_s=60).seed()
    assert runner.invoke(cli, ["limits", "set", "--rate", "12"]).exit_code == 0
    shown = runner.invoke(cli, ["limits", "show"]).output
    assert "note: the rate in force (12.0) was set by `payrun limits set` or the console at" in shown, shown
    # in the payroll's zone, as every other time the CLI prints (it printed UTC's ISO form)
    from jobs.limits import limit_sources
    from payrun.clitools import local_time

    set_at = limit_sources(conn, "email")["rate_per_s"]["set_at"]
    assert f"console at {local_time(set_at, cfg.timezone)};" in shown and set_at not in shown, shown
    assert f"the config says {cfg.limits.email_rate_per_s}" in shown and "`payrun limits reset`" in shown
    assert "slots are taken at once" not in shown  # at 12/s the cap (50) binds first
    assert runner.invoke(cli, ["limits", "set", "--rate", "2"]).exit_code == 0
    shown = runner.invoke(cli, ["limits", "show"]).output
    assert ("at 2/s at most 22 slots are taken at once: a lane takes a send only while its start would come "
            "within 12 s; the other jobs wait in the queue (no attempt spent, not retried)") in shown, shown
    assert json.loads(runner.invoke(cli, ["limits", "show", "--json"]).output)["email"]["slots_for_rate"] == 22
    out = runner.invoke(cli, ["limits", "reset"])
    assert out.exit_code == 0 and f"rate {cfg.limits.email_rate_per_s:g}/s (the config's)" in out.output
    shown = runner.invoke(cli, ["limits", "show"]).output
    assert "note:" not in shown and f"{cfg.limits.email_rate_per_s:g}/s" in shown


def test_slots_held_by_senders_waiting_for_the_rate_are_told_apart(conn):
    """Ops walkthrough: at 12/s, "50 / 50 in flight" while the provider saw 16 at once:
    most slots were lanes waiting for their start under the rate. Raising the cap, which
    that reading invites, changes nothing: the views now say how many wait."""
    from jobs.limits import waiting_for_rate

    assert waiting_for_rate(None, 1000.0, 12, 50) == 0
    assert waiting_for_rate(900.0, 1000.0, 12, 50) == 0  # the schedule is not ahead of now
    assert waiting_for_rate(1000.0 + 2500, 1000.0, 12, 50) == 30  # 2.5 s of starts at 12/s
    assert waiting_for_rate(1000.0 + 60_000, 1000.0, 12, 50) == 50  # never more than the slots taken
    lim = Limiter(conn, "email", 50, 12.0, lease_s=60)
    lim.seed()
    sec, usec = conn.time()
    conn.set(keys.limit_tat("email"), str(sec * 1000 + usec / 1000 + 2000))
    assert lim.waiting_for_rate(50) in (23, 24)  # 2 s ahead at 12/s (less the ms since)


def test_a_lanes_connection_dropped_while_it_waited_for_its_start_costs_the_send_no_attempt(conn):
    """On-call drill (session 41): at a low rate (`limits set --rate 6`) 45 lanes sleep
    until their reserved start; a `supervisorctl restart redis` closed each lane's one
    connection under it, and every one of them woke to a broken pipe at the send gate:
    39 sends spent an attempt, one every 170 ms, long after Redis was back. The limiter's
    scripts that may run twice with the same outcome (a slot for the same holder, a
    reserved start, the gate with the same member) are tried once more on a new
    connection, as the idempotency scripts are. Redis really away: the error goes up."""
    import redis

    from jobs.runtime import lane_connection

    lane = lane_connection(conn)
    lim = limiter(lane, cap=3, rate=1000.0)
    assert lim.try_slot("lane-1")[0] and lim.token()  # the lane holds its connection

    def restart():  # the server closes the lane's connection, as a restart does
        conn.client_kill_filter(_id=lane.client_id())

    restart()
    assert lim.try_slot("lane-1")[0]
    restart()
    assert lim.token()
    restart()
    assert lim.gate()
    assert lim.in_use() == 1  # the slot taken once, for its one holder

    away = Limiter(redis.Redis(unix_socket_path="/nonexistent/payrun-drill.sock"), "email", 3, 1000.0, 30.0)
    with pytest.raises(redis.ConnectionError):  # Redis really away: the error reaches the job
        away.token()
