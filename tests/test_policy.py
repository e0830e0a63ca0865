"""The pure policy functions: backoff, classification, lease arithmetic."""

import errno
import random
import smtplib
import statistics

import pytest
import redis

from jobs.errors import OutcomeUnknown, PermanentError, TransientError
from jobs.policy import backoff_attempt, backoff_ceiling, backoff_delay, classify, is_stuck, lease_expired, shutdown_deadline


def test_ceiling_matches_the_seed_table():
    assert [backoff_ceiling(a, 1, 300) for a in range(1, 7)] == [2, 4, 8, 16, 32, 64]
    assert backoff_ceiling(9, 1, 300) == 300
    assert backoff_ceiling(10_000, 1, 300) == 300  # no overflow


def test_ceiling_rejects_attempt_zero():
    with pytest.raises(ValueError):
        backoff_ceiling(0, 1, 300)


@pytest.mark.parametrize("attempt", [1, 2, 3, 6, 12])
def test_full_jitter_stays_within_bounds_and_spreads(attempt):
    rng = random.Random(attempt)
    ceiling = backoff_ceiling(attempt, 1, 300)
    delays = [backoff_delay(attempt, 1, 300, rng) for _ in range(5000)]
    assert all(0 <= d <= ceiling for d in delays)
    # uniform on [0, ceiling]: mean ~ ceiling/2, and both ends are reached
    assert abs(statistics.mean(delays) - ceiling / 2) < ceiling * 0.03
    assert min(delays) < ceiling * 0.01 and max(delays) > ceiling * 0.99


def test_retry_after_is_a_floor():
    rng = random.Random(1)
    assert all(backoff_delay(1, 1, 300, rng, retry_after_s=5) >= 5 for _ in range(100))


@pytest.mark.parametrize(
    "exc, transient",
    [
        (TransientError("HTTP 503"), True),
        (TransientError("HTTP 429", retry_after_s=2), True),
        (OutcomeUnknown("connection reset after the request"), True),
        (TimeoutError(), True),
        (ConnectionRefusedError(), True),
        (smtplib.SMTPServerDisconnected(), True),
        (smtplib.SMTPResponseException(451, b"try later"), True),
        (smtplib.SMTPResponseException(550, b"no such user"), False),
        (PermanentError("invalid recipient address"), False),
        (KeyError("employee"), False),  # a bug or bad data: retrying cannot help
        # the host's trouble, not the employee's data (a full slip store failed a whole run)
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (OSError(errno.EROFS, "Read-only file system"), True),
        (OSError(errno.EACCES, "Permission denied"), False),  # set up wrong: a person must look
        (redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device"), True),
        (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
        (redis.ResponseError("Error running script (call to f_e879): @user_script:14: @user_script: 14: -MISCONF "
                             "Redis is configured to save RDB snapshots, but it is currently not able to persist"), True),
        (redis.ResponseError("Error running script (call to f_e879): @user_script:3: user_script:3: bad argument"),
         False),
        (redis.ResponseError("Command # 1 (HSET payrun:limit:email cap 10) of pipeline caused error: MISCONF Redis "
                             "is configured to save RDB snapshots"), True),
        # redis-py's own classes for READONLY and OOM (their code taken off the message)
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True),
        (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), True),
    ],
)
def test_classification_table(exc, transient):
    assert classify(exc).transient is transient


def test_a_full_disk_says_what_to_do_and_is_not_blamed_on_the_data():
    verdict = classify(OSError(errno.ENOSPC, "No space left on device"))
    assert verdict.transient and "the disk is full: free space, then `payrun retry --all`" in verdict.reason
    assert "Redis refuses writes" in classify(redis.ResponseError("MISCONF Errors writing to the AOF")).reason
    from jobs.policy import redis_refusal_reason

    wrapped = redis.ResponseError("Command # 1 (HSET k v) of pipeline caused error: MISCONF Errors writing")
    assert redis_refusal_reason(wrapped) == "MISCONF Errors writing"
    oom = redis.exceptions.OutOfMemoryError("Command # 2 (SET k v) of pipeline caused error: command not allowed")
    assert redis_refusal_reason(oom) == "OOM command not allowed"


def test_classification_keeps_retry_after():
    assert classify(TransientError("429", retry_after_s=3)).retry_after_s == 3


def test_rq_timeouts_are_transient():
    from rq.timeouts import JobTimeoutException

    assert classify(JobTimeoutException("Task exceeded maximum timeout value (30 seconds)")).transient


def test_lease_arithmetic():
    assert not lease_expired(last_heartbeat_s=100, now_s=159, visibility_s=60)
    assert lease_expired(last_heartbeat_s=100, now_s=161, visibility_s=60)
    assert is_stuck(started_s=0, last_heartbeat_s=700, now_s=701, visibility_s=60, stuck_after_s=600)
    assert not is_stuck(started_s=500, last_heartbeat_s=700, now_s=701, visibility_s=60, stuck_after_s=600)
    assert shutdown_deadline(10, 30) == 40


def test_a_send_claim_outlasts_the_send_and_its_lease():
    from jobs.policy import send_claim_ttl_s

    assert send_claim_ttl_s(send_timeout_s=30, visibility_s=60) == 90
    assert send_claim_ttl_s(send_timeout_s=0.2, visibility_s=0.3) == 1  # never 0: EXPIRE 0 deletes


def test_another_hosts_stage_is_abandoned_only_past_its_renders_timeout_and_lease():
    """A slip staged on another host (shared slip store) whose try may still be finishing
    there: abandoned only once that try's timeout and its job's lease are both over (the
    same bound as a send's claim), not at the lease alone."""
    from jobs.policy import lease_bound_s, stage_abandoned

    assert lease_bound_s(30, 60) == 90
    assert not stage_abandoned(age_s=61, render_timeout_s=30, visibility_s=60)  # its lease alone: a try may commit
    assert not stage_abandoned(age_s=90, render_timeout_s=30, visibility_s=60)
    assert stage_abandoned(age_s=90.5, render_timeout_s=30, visibility_s=60)
    assert not stage_abandoned(age_s=-5, render_timeout_s=30, visibility_s=60)  # the store's clock ahead of ours


def test_a_made_send_is_recorded_with_short_doubling_waits_until_its_job_has_no_time_left():
    from jobs.policy import record_retry_wait_s

    waits = [record_retry_wait_s(t, left_s=100) for t in range(1, 7)]
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]  # Redis back within ~1 s of a restart is seen at once
    assert record_retry_wait_s(3, left_s=0.25) == 0.25  # never past the job's time
    assert record_retry_wait_s(1, left_s=0) is None and record_retry_wait_s(9, left_s=-1) is None
    assert record_retry_wait_s(10_000, left_s=5) == 1.0  # no overflow
    with pytest.raises(ValueError):
        record_retry_wait_s(0, left_s=5)


def test_a_made_send_may_wait_to_be_recorded_until_its_own_jobs_timeout():
    from jobs.policy import RECORD_MARGIN_S, job_end

    assert RECORD_MARGIN_S == 2  # (the record waits until the job's end less this: jobs.tasks.send_limited)
    assert job_end(1000.0, job_timeout_s=30, default_timeout_s=30) == 1030.0
    # enqueued with 12 s, config raised to 30 since: the job is still killed at 12
    assert job_end(1000.0, job_timeout_s=12, default_timeout_s=30) == 1012.0
    assert job_end(1000.0, job_timeout_s=None, default_timeout_s=30) == 1030.0


def test_a_send_waits_and_runs_within_its_jobs_time_leaving_time_for_its_record():
    from jobs.policy import SEND_RESERVE_S, send_window

    assert SEND_RESERVE_S == 3
    # at its job's start (a 30 s job): half its timeout at the limiter; the send ends 3 s before the job
    assert send_window(1000.0, send_timeout_s=30, job_ends_s=1030.0) == (1015.0, 1027.0)
    # later in its job: the wait leaves the send a quarter of its timeout
    assert send_window(1010.0, send_timeout_s=30, job_ends_s=1030.0) == (1019.5, 1027.0)
    # too late to start one: the wait ends before now (a RateWait, not a send with no time)
    wait_until, _ = send_window(1021.0, send_timeout_s=30, job_ends_s=1030.0)
    assert wait_until < 1021.0
    # a short timeout: a fifth of it reserved, not 3 s (which would leave a 2 s send nothing)
    assert send_window(1000.0, send_timeout_s=5, job_ends_s=1005.0) == (1002.5, 1004.0)
    assert send_window(1000.0, send_timeout_s=1, job_ends_s=1001.0) == (1000.5, 1000.8)


def test_a_send_is_given_no_longer_than_its_jobs_own_timeout():
    """Review (session 35): a reminder enqueued with a 30 s timeout, the configuration
    raised to 120 s since: its window kept a quarter of 120 s for the send, more than its
    whole job, so it was never started (a RateWait on every try)."""
    from jobs.policy import send_timeout_s, send_window

    assert send_timeout_s(30, None) == 30 and send_timeout_s(30, 30) == 30
    assert send_timeout_s(120, 30) == 30  # the job's own, shorter
    assert send_timeout_s(30, 120) == 30  # (a longer job: the send's timeout is still the configured one)
    wait_until, send_until = send_window(1000.0, send_timeout_s(120, 30), job_ends_s=1030.0)
    assert (wait_until, send_until) == (1015.0, 1027.0)  # as any 30 s send job
    wait_until, _ = send_window(1000.0, 120, job_ends_s=1030.0)
    assert wait_until < 1000.0  # (what it was: never started)


def test_a_send_stalled_after_its_start_is_not_made_with_no_time_left():
    """Review (session 35): a send that got its start time and then stalled (a paused
    process, a slow EHLO name) was made with its window nearly gone: it timed out and counted
    toward the provider-outage pause. An eighth of its timeout is the least it starts with."""
    from jobs.policy import send_may_start, send_window

    wait_until, send_until = send_window(1000.0, 30, job_ends_s=1030.0)
    assert send_may_start(wait_until, send_until, 30)  # the latest start the window gives: 12 s left
    assert send_may_start(send_until - 3.75, send_until, 30)
    assert not send_may_start(send_until - 3.7, send_until, 30)
    assert not send_may_start(send_until + 1, send_until, 30)
    wait_until, send_until = send_window(1000.0, 2, job_ends_s=1002.0)  # a short timeout: the same share
    assert send_may_start(wait_until, send_until, 2) and not send_may_start(send_until - 0.2, send_until, 2)


def test_a_send_waits_for_the_ehlo_name_within_the_shared_window_and_a_quarter_of_its_time():
    from jobs.policy import ehlo_wait_s

    assert ehlo_wait_s(100.0, window_ends_s=102.0, send_left_s=20.0) == 2.0  # the first send
    assert ehlo_wait_s(101.5, window_ends_s=102.0, send_left_s=20.0) == 0.5  # one started meanwhile: the same end
    assert ehlo_wait_s(103.0, window_ends_s=102.0, send_left_s=20.0) == 0.0  # after the window: nobody waits
    assert ehlo_wait_s(100.0, window_ends_s=102.0, send_left_s=4.0) == 1.0  # a late send keeps 3/4 of its time
    assert ehlo_wait_s(100.0, window_ends_s=102.0, send_left_s=-1.0) == 0.0


def test_is_stranded():
    from jobs.policy import is_stranded

    assert not is_stranded(None, now_s=100)  # first sighting
    assert not is_stranded(95, now_s=100, settle_s=10)
    assert is_stranded(90, now_s=100, settle_s=10)


def test_should_reap():
    from jobs.policy import should_reap

    assert should_reap(lease_expires_s=200, now_s=100, worker_alive=True) is None
    assert "gone" in should_reap(lease_expires_s=200, now_s=100, worker_alive=False)
    assert "lease expired" in should_reap(lease_expires_s=99, now_s=100, worker_alive=True)
    assert should_reap(lease_expires_s=float("inf"), now_s=100, worker_alive=True) is None


def test_a_missing_liveness_key_in_a_redis_just_restarted_is_no_death():
    """Keys lapse while Redis is down; a live worker beats again within ALIVE_EVERY_S."""
    from jobs.policy import LIVENESS_SETTLE_S, should_reap
    from jobs.runtime import ALIVE_EVERY_S, ALIVE_TTL_S

    assert should_reap(lease_expires_s=200, now_s=100, worker_alive=False, redis_uptime_s=3) is None
    assert should_reap(lease_expires_s=200, now_s=100, worker_alive=False, redis_uptime_s=9.9) is None
    assert "gone" in should_reap(lease_expires_s=200, now_s=100, worker_alive=False, redis_uptime_s=10)
    # the lease still decides meanwhile
    assert "lease expired" in should_reap(lease_expires_s=99, now_s=100, worker_alive=False, redis_uptime_s=3)
    assert LIVENESS_SETTLE_S >= ALIVE_TTL_S > 2 * ALIVE_EVERY_S


def test_no_jitter_waits_the_ceiling():
    assert backoff_delay(3, 1, 300, jitter=False) == 8


def test_gate_margin_widens_per_429_and_narrows_back_with_time():
    from jobs.policy import (GATE_MARGIN_MAX_MS, GATE_MARGIN_MIN_MS, GATE_MARGIN_STEP_MS, gate_margin_ms,
                             raised_gate_margin_ms)

    assert gate_margin_ms(None, 0) == GATE_MARGIN_MIN_MS  # never raised
    raised = raised_gate_margin_ms(gate_margin_ms(None, 0))
    assert raised == GATE_MARGIN_MIN_MS + GATE_MARGIN_STEP_MS
    assert gate_margin_ms(raised, 0) == raised
    assert gate_margin_ms(raised, 60_000) == raised - 10.0  # 10 ms a minute
    assert gate_margin_ms(raised, 3_600_000) == GATE_MARGIN_MIN_MS  # never below the minimum
    m = GATE_MARGIN_MIN_MS
    for _ in range(20):
        m = raised_gate_margin_ms(m)
    assert m == GATE_MARGIN_MAX_MS


def test_paced_rate_fits_the_gate():
    from jobs.policy import paced_rate

    # at the minimum margin the headroom decides (97.5% of 40/s), as before the gate tuned itself
    assert paced_rate(40.0, 0.975, 20.0) == 39.0
    # wider: no faster than floor(limit) starts per (1 s + margin), so nobody queues at the gate
    wide = paced_rate(40.0, 0.975, 60.0)
    assert wide < 40 * 1000 / 1060
    assert wide > 0.93 * 40
    # evenly spaced starts at that rate: any window of 1 s + margin holds at most the limit
    interval = 1.0 / wide
    assert int(1.060 / interval) + 1 <= 40


def test_only_a_provider_429_pauses_every_sender():
    from jobs.errors import ClaimLost, RateWait, Throttled
    from jobs.policy import pauses_every_sender

    assert pauses_every_sender(Throttled("429 from the provider", retry_after_s=1.0))
    assert not pauses_every_sender(RateWait("waited too long for our own limiter", retry_after_s=1.0))
    assert not pauses_every_sender(Throttled("another attempt is sending", retry_after_s=None))
    assert not pauses_every_sender(ClaimLost("the claim ran out, another attempt has it"))
    assert not pauses_every_sender(TransientError("connection refused"))


def test_a_send_is_late_for_the_gate_past_a_quarter_of_its_smallest_margin():
    from jobs.policy import GATE_MARGIN_MIN_MS, REGATE_LATE_MS, late_for_gate

    assert REGATE_LATE_MS == GATE_MARGIN_MIN_MS / 4
    assert not late_for_gate(100.0, 100.0 + REGATE_LATE_MS / 1000 - 0.001)
    assert late_for_gate(100.0, 100.0 + REGATE_LATE_MS / 1000 + 0.001)
    assert not late_for_gate(100.0, 99.0)  # a clock read before the pass is not late


def test_the_send_gate_window_is_wider_for_2_s_after_an_idle_spell():
    from jobs.policy import GATE_WARMUP_MARGIN_MS, GATE_WARMUP_MS, gate_window_ms

    assert gate_window_ms(20.0, 0.0) == 1000.0 + GATE_WARMUP_MARGIN_MS  # the first start after idle
    assert gate_window_ms(20.0, GATE_WARMUP_MS - 1) == 1000.0 + GATE_WARMUP_MARGIN_MS
    assert gate_window_ms(20.0, GATE_WARMUP_MS) == 1020.0  # warmed up: 1 s + the margin
    assert gate_window_ms(GATE_WARMUP_MARGIN_MS + 20, 0.0) == 1000.0 + GATE_WARMUP_MARGIN_MS + 20  # a wider margin wins


def test_the_backoff_grows_with_failed_attempts_only():
    assert backoff_attempt(3) == 3
    assert backoff_attempt(3, budget_start=1) == 2  # one try held back by the provider
    assert backoff_attempt(3, returned=1) == 2  # one returned by the reaper (its worker died)
    assert backoff_attempt(5, budget_start=3, returned=2, returned_at_budget_start=2) == 2  # after `payrun retry`
    assert backoff_attempt(5, budget_start=3, returned=3, returned_at_budget_start=2) == 1
    assert backoff_attempt(1, returned=1) == 1  # never below the first
    assert backoff_attempt(2, budget_start=0, returned=1, returned_at_budget_start=5) == 2  # a count from before


def test_dead_slot_holders_are_those_of_lanes_without_liveness():
    from jobs.policy import dead_slot_holders

    holders = ["send-email.h.1.0:aa", "send-email.h.2.0:bb", "a:b:c", "plain-uuid", ":x"]
    alive = {"send-email.h.1.0": True, "send-email.h.2.0": False, "a:b": False}
    assert dead_slot_holders(holders, alive) == ["send-email.h.2.0:bb", "a:b:c"]
    assert dead_slot_holders(holders, {}) == []  # not asked about: kept, its lease frees it


def test_a_dead_looking_slot_is_freed_only_once_two_passes_settle_apart_saw_it():
    from jobs.policy import SLOT_SETTLE_S, slots_to_free

    free, mark, forget = slots_to_free(["a:1", "b:2"], {}, now=100.0)
    assert (free, sorted(mark), forget) == ([], ["a:1", "b:2"], [])
    seen = {"a:1": 100.0, "b:2": 100.0, "gone:3": 90.0}
    free, mark, forget = slots_to_free(["a:1"], seen, now=100.0 + SLOT_SETTLE_S)
    assert free == ["a:1"] and mark == [] and sorted(forget) == ["a:1", "b:2", "gone:3"]
    assert slots_to_free(["a:1"], {"a:1": 100.0}, now=100.0 + SLOT_SETTLE_S - 0.1)[0] == []


@pytest.mark.parametrize("month, company, employee", [
    ("2026-11", 1, "emp-00042"), ("2026-11", "60", "emp-1"), ("2026-11", 7, "E_17-b")])
def test_ids_the_importer_takes_name_a_slip_file(month, company, employee):
    from jobs.policy import slip_path_problem

    assert slip_path_problem(month, company, employee) is None


@pytest.mark.parametrize("month, company, employee, why", [
    ("2026-11", 1, "../../etc/cron.d/x", "employee id"),
    ("2026-11", 1, "..", "employee id"),
    ("2026-11", 1, ".hidden", "employee id"),
    ("2026-11", 1, "a/b", "employee id"),
    ("2026-11", 1, "emp-1\x00", "employee id"),
    ("2026-11", 1, "", "employee id"),
    ("2026-11", 1, None, "employee id"),
    ("2026-11", "../..", "emp-1", "company id"),
    ("2026-11", "1/..", "emp-1", "company id"),
    ("2026-11", -1, "emp-1", "company id"),
    ("2026-11", True, "emp-1", "company id"),
    ("2026-11", "\u0661", "emp-1", "company id"),  # a digit of another script
    ("../2026", 1, "emp-1", "month"),
    ("2026-11/..", 1, "emp-1", "month"),
])
def test_ids_that_would_put_a_slip_outside_the_store_are_refused(month, company, employee, why):
    """The parts come from a job's arguments in Redis (a security review's finding: the
    send side checked its path, the render side wrote wherever the ids pointed)."""
    from jobs import oneoff, tasks
    from jobs.policy import slip_path_problem

    assert slip_path_problem(month, company, employee).startswith(why)
    with pytest.raises(PermanentError, match="refused to write a slip"):
        tasks.slip_relpath(month, company, employee)
    with pytest.raises(PermanentError, match="refused to write a slip"):
        oneoff.resend_path(month, company, employee, 1)


def test_a_slip_store_entry_must_be_this_accounts_alone():
    """jobs.policy.store_entry_problem, on what os.lstat says (session 31's review: a slip
    swapped in a folder another account can write to was mailed)."""
    import stat as st

    from jobs.policy import store_entry_problem

    me = 1000
    d, f, link = st.S_IFDIR, st.S_IFREG, st.S_IFLNK
    assert store_entry_problem(d | 0o700, me, me) is None
    assert store_entry_problem(d | 0o755, me, me) is None  # readable folders are fine: the slips are 0600
    assert store_entry_problem(f | 0o600, me, me, slip=True) is None
    assert store_entry_problem(d | 0o777, me, me) == "can be written by other accounts (mode 777)"
    assert store_entry_problem(d | 0o1777, me, me) == "can be written by other accounts (mode 1777)"
    assert store_entry_problem(d | 0o770, me, me) == "can be written by other accounts (mode 770)"
    assert store_entry_problem(d | 0o700, 65534, me) == "belongs to uid 65534, not to this account (uid 1000)"
    assert store_entry_problem(link | 0o777, me, me) == "is a symlink"
    assert store_entry_problem(f | 0o600, me, me) == "is not a folder"
    assert store_entry_problem(d | 0o700, me, me, slip=True) == "is not a regular file"
    assert store_entry_problem(f | 0o644, me, me, slip=True) == "can be read or written by other accounts (mode 644)"
    assert store_entry_problem(f | 0o600, 0, me, slip=True) == "belongs to uid 0, not to this account (uid 1000)"


def test_the_slip_stores_walk_looks_at_every_folder_below_its_root_without_following_links(tmp_path):
    from payrun.slipstore import unsafe

    root = tmp_path / "slips"
    (root / "2026-11" / "3").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (root / "2026-11").chmod(0o700)
    slip = root / "2026-11" / "3" / "emp-1.pdf"
    slip.write_bytes(b"%PDF")
    slip.chmod(0o600)
    assert unsafe(root, slip, slip=True) is None
    (tmp_path / "mnt").symlink_to(root)  # a root configured through a symlink (to a mount) is followed
    assert unsafe(tmp_path / "mnt", tmp_path / "mnt" / "2026-11" / "3" / "emp-1.pdf", slip=True) is None
    assert unsafe(tmp_path / "mnt", slip, slip=True) is None  # (a send's path comes resolved)
    assert unsafe(root, root / "2026-12" / "1" / "emp-1.pdf") is None  # not there yet: nothing to trust
    (root / "2026-11" / "3").rename(root / "2026-11" / "3.real")
    (root / "2026-11" / "3").symlink_to(root / "2026-11" / "3.real")
    assert f"folder {root / '2026-11' / '3'} is a symlink" in unsafe(root, slip, slip=True)
    root.chmod(0o777)
    assert f"folder {root} can be written by other accounts (mode 777)" in unsafe(root, slip)
