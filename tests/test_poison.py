"""A job payrun cannot read — its hash has no ``data`` field, or data that is not JSON
(written by hand, by `rq requeue`, a pickle) — is failed as "job data unreadable" and the
worker goes on with the next job. It used to end the control / pdf-render worker as it
took the job (RQ's restore, or its process title reading the function's name, raised in
the worker itself), and supervisord started it again onto the same job until FATAL.
Nothing of such a job is ever unpickled or run. Real Redis."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from datetime import datetime, timezone

import pytest
from click.testing import CliRunner

from conftest import wait_for
from jobs.runtime import RenderWorker, make_queue, run_lanes
from payrun import keys

BAD = {
    "no-data": None,
    "not-json": b"hello",
    # what `rq requeue` under RQ's default serializer would have a job carry
    "pickle": pickle.dumps(("os.system", None, ("touch /tmp/payrun-poison-ran",), {})),
}


def _poison(conn, queue: str, job_id: str, data: bytes | None) -> None:
    """A job hash as RQ writes one, and its id pushed on the queue, as RQ would."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    h = {"created_at": now, "enqueued_at": now, "origin": queue, "description": "poison()", "status": "queued",
         "timeout": "30", "meta": json.dumps({"kind": "test"})}
    if data is not None:
        h["data"] = data
    conn.hset(f"rq:job:{job_id}", mapping=h)
    conn.sadd("rq:queues", f"rq:queue:{queue}")
    conn.rpush(f"rq:queue:{queue}", job_id)


def _assert_failed_unreadable(conn, queue: str, job_id: str) -> None:
    assert conn.zscore(f"rq:failed:{queue}", job_id) is not None, f"{job_id} is not in the failed registry"
    h = conn.hgetall(f"rq:job:{job_id}")
    assert h[b"status"] == b"failed"
    assert json.loads(h[b"meta"])["last_error"].startswith("job data unreadable: ")
    assert job_id.encode() not in conn.lrange(f"rq:queue:{queue}:intermediate", 0, -1)
    assert not [m for m in conn.zrange(f"rq:wip:{queue}", 0, -1) if m.startswith(job_id.encode())]
    failed = [f for _, f in conn.xrange(keys.EVENTS_STREAM)
              if f[b"job"] == job_id.encode() and f[b"status"] == b"failed"]
    assert failed and failed[-1][b"error"].startswith(b"job data unreadable: ")  # the ledger is told
    assert failed[-1][b"kind"] and failed[-1][b"queue"] == queue.encode()  # (a row even for an id it never had)


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("queue", [keys.CONTROL_QUEUE, keys.RENDER_QUEUE])
def test_a_render_or_control_worker_fails_an_unreadable_job_and_takes_the_next(conn, cfg, monkeypatch, queue, bad):
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _poison(conn, queue, "poison-1", BAD[bad])
    make_queue(queue, conn).enqueue_call("jobs.testing.noop", job_id="after-1", meta={"kind": "test"})
    w = RenderWorker([make_queue(queue, conn)], connection=conn, name=f"{queue}.test.poison")
    w.jobs_per_horse = 100  # the warm horse: its worker starts the job itself (where it raised)
    w.work(burst=True, logging_level="CRITICAL")
    _assert_failed_unreadable(conn, queue, "poison-1")
    assert conn.hget("rq:job:after-1", "status") == b"finished"


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_send_lane_fails_an_unreadable_job_and_takes_the_next(conn, cfg, monkeypatch, bad):
    from jobs.limits import Limiter

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _poison(conn, keys.EMAIL_QUEUE, "poison-1", BAD[bad])
    make_queue(keys.EMAIL_QUEUE, conn).enqueue_call("jobs.testing.noop", job_id="after-1", meta={"kind": "test"})
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=1, burst=True, limiter=Limiter(conn, "email", 2, 40.0, lease_s=30))
    _assert_failed_unreadable(conn, keys.EMAIL_QUEUE, "poison-1")
    assert conn.hget("rq:job:after-1", "status") == b"finished"


def test_a_running_control_worker_fails_a_job_with_no_data_pushed_while_it_waits(conn, cfg, tmp_path):
    """The worker waiting in RQ's blocking dequeue: RQ skipped such a job without a word and
    left its id taken in the intermediate list (never run, never failed)."""
    import os

    env = dict(os.environ, PAYRUN_TEST_JOBS="1")
    log = open(tmp_path / "w.log", "ab")
    w = subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", keys.CONTROL_QUEUE], env=env, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: conn.keys("payrun:alive:control.*") and conn.keys("rq:worker:control.*"), timeout_s=60,
                 what="the control worker to start")
        wait_for(lambda: conn.hget(conn.keys("rq:worker:control.*")[0], "state") == b"idle", timeout_s=30,
                 what="the control worker to wait for work")
        for i, bad in enumerate(sorted(BAD)):
            _poison(conn, keys.CONTROL_QUEUE, f"poison-{i}", BAD[bad])
        make_queue(keys.CONTROL_QUEUE, conn).enqueue_call("jobs.testing.noop", job_id="after-1",
                                                            meta={"kind": "test"})
        wait_for(lambda: conn.hget("rq:job:after-1", "status") == b"finished", timeout_s=30, what="the next job")
        wait_for(lambda: conn.zcard(f"rq:failed:{keys.CONTROL_QUEUE}") == len(BAD), timeout_s=30,
                 what="the unreadable jobs to fail")
        for i in range(len(BAD)):
            _assert_failed_unreadable(conn, keys.CONTROL_QUEUE, f"poison-{i}")
        assert w.poll() is None, (tmp_path / "w.log").read_text()  # still running
    finally:
        w.terminate()
        try:
            w.wait(timeout=40)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
        log.close()


def test_payrun_failed_lists_a_failed_job_with_no_data_and_retry_refuses_it(conn, cfg):
    from payrun.cli import cli

    conn.hset("rq:job:handmade", mapping={"origin": keys.CONTROL_QUEUE, "status": "failed"})
    conn.zadd(f"rq:failed:{keys.CONTROL_QUEUE}", {"handmade": 9_999_999_999})
    out = CliRunner().invoke(cli, ["failed"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "handmade" in out.output and "job data missing" in out.output
    rows = json.loads(CliRunner().invoke(cli, ["failed", "--json"], catch_exceptions=False).output)
    assert [r["id"] for r in rows] == ["handmade"] and rows[0]["error"].startswith("job data missing")
    out = CliRunner().invoke(cli, ["retry", "handmade"], catch_exceptions=False)
    assert "job data missing" in out.output
    assert conn.zscore(f"rq:failed:{keys.CONTROL_QUEUE}", "handmade") is not None  # left where it was


@pytest.mark.parametrize("bad", ["not-json", "pickle"])
def test_a_send_lane_says_an_unreadable_job_in_one_line_as_the_other_workers_do(conn, cfg, monkeypatch, caplog, bad):
    """Ops drill (session 39): a render or control worker logged "job data unreadable: not JSON
    (…)" for a job whose data is not JSON; a send lane logged RQ's traceback under "exception
    raised while executing (<DeserializationError>)", which names neither."""
    from jobs.limits import Limiter

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _poison(conn, keys.EMAIL_QUEUE, "poison-2", BAD[bad])
    caplog.set_level("INFO")
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=1, burst=True, limiter=Limiter(conn, "email", 2, 40.0, lease_s=30))
    _assert_failed_unreadable(conn, keys.EMAIL_QUEUE, "poison-2")
    said = [r.getMessage() for r in caplog.records if "poison-2" in r.getMessage() and r.levelname == "ERROR"]
    assert len(said) == 1 and "job data unreadable: not JSON (" in said[0], said
    assert "Traceback" not in said[0] and "moved to the failed jobs" in said[0]


@pytest.mark.parametrize("bad", ["not-json", "pickle"])
def test_retry_refuses_a_job_failed_as_unreadable_instead_of_crashing(conn, cfg, monkeypatch, bad):
    """A job a worker failed as "job data unreadable" keeps its data: `payrun retry` (and the
    console's, through it) read it for the slip check and ended in a DeserializationError
    traceback, `--all` half-way through. Now it is refused, as a job with no data is."""
    from payrun.cli import cli

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    _poison(conn, keys.RENDER_QUEUE, "poison-1", BAD[bad])
    w = RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn, name="render.test.poison-retry")
    w.work(burst=True, logging_level="CRITICAL")
    _assert_failed_unreadable(conn, keys.RENDER_QUEUE, "poison-1")
    out = CliRunner().invoke(cli, ["retry", "poison-1"], catch_exceptions=False)
    assert out.exit_code == 1 and "job data unreadable (its 'data' field is not JSON)" in out.output, out.output
    out = CliRunner().invoke(cli, ["retry", "--all", "--json"], catch_exceptions=False)
    assert json.loads(out.output)["not_requeued"][0]["id"] == "poison-1", out.output
    assert conn.zscore(f"rq:failed:{keys.RENDER_QUEUE}", "poison-1") is not None  # left where it was
    assert conn.llen(f"rq:queue:{keys.RENDER_QUEUE}") == 0


@pytest.mark.parametrize("bad", ["no-data", "not-json"])
def test_payrun_job_says_a_failed_job_with_no_data_is_there_and_what_it_lacks(conn, cfg, bad):
    """`payrun job` answered "no job … in the ledger or in Redis" for one with no data (RQ's
    fetch failed), and said nothing of data that is not JSON (RQ's fetch passed it)."""
    from payrun.cli import cli
    from payrun.ledger import Ledger

    Ledger(cfg.ledger_path).close()  # (a data directory: `payrun job` reads the ledger first)

    fields = {"origin": keys.CONTROL_QUEUE, "status": "failed", "description": "x-value"}
    if BAD[bad] is not None:
        fields["data"] = BAD[bad]
    conn.hset("rq:job:handmade", mapping=fields)
    conn.zadd(f"rq:failed:{keys.CONTROL_QUEUE}", {"handmade": 9_999_999_999})
    out = CliRunner().invoke(cli, ["job", "handmade"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    said = {"no-data": "job data missing (its Redis hash has no 'data' field)",
            "not-json": "job data unreadable (its 'data' field is not JSON)"}[bad]
    assert "in Redis: failed" in out.output and f"{said}: nothing to run or retry" in out.output, out.output
    assert f"fields in its hash: {', '.join(sorted(fields))}" in out.output and "x-value" not in out.output
    data = json.loads(CliRunner().invoke(cli, ["job", "handmade", "--json"], catch_exceptions=False).output)
    assert data["rq_status"] == "failed" and data["unreadable"] == said


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("queue", [keys.RENDER_QUEUE, keys.EMAIL_QUEUE])
def test_an_unreadable_job_never_ran_and_every_listing_says_attempts_0(conn, cfg, monkeypatch, queue, bad):
    """`payrun failed` said attempts=1 of a job whose data is not JSON and attempts=0 of one
    with no data; neither ran (the worker counted the attempt, and told the ledger the job
    was running, before RQ read the data). Both are 0 now, in `payrun failed` (marked "never
    ran"), its --json and `payrun job` (the ledger: no try at all)."""
    from jobs.limits import Limiter
    from payrun import ledger as ledger_mod
    from payrun.cli import cli

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    led = ledger_mod.Ledger(cfg.ledger_path)
    ledger_mod.ensure_group(conn)
    _poison(conn, queue, "poison-3", BAD[bad])
    if queue == keys.EMAIL_QUEUE:
        run_lanes(conn, [queue], lanes=1, burst=True, limiter=Limiter(conn, "email", 2, 40.0, lease_s=30))
    else:
        RenderWorker([make_queue(queue, conn)], connection=conn, name=f"{queue}.test.never-ran").work(
            burst=True, logging_level="CRITICAL")
    _assert_failed_unreadable(conn, queue, "poison-3")
    assert not [f for _, f in conn.xrange(keys.EVENTS_STREAM) if f[b"status"] == b"running"]  # never began
    ledger_mod.drain(conn, led)
    row = led.job("poison-3")
    assert row["attempts"] == 0 and row["history"] == [], row
    led.close()
    out = CliRunner().invoke(cli, ["failed"], catch_exceptions=False).output
    line = next(ln for ln in out.splitlines() if ln.startswith("poison-3"))
    assert " attempts=0 " in line and "[never ran: its data cannot be read; nothing to retry]" in line, out
    rows = json.loads(CliRunner().invoke(cli, ["failed", "--json"], catch_exceptions=False).output)
    assert [(r["attempts"], r["never_ran"]) for r in rows] == [(0, True)], rows
    out = CliRunner().invoke(cli, ["job", "poison-3"], catch_exceptions=False).output
    assert "attempts=0" in out.splitlines()[0] and "#1" not in out, out


def test_an_unreadable_job_an_earlier_worker_counted_an_attempt_of_is_listed_as_never_ran(conn, cfg):
    """A worker of the version before counted one attempt for data that is not JSON (its
    meta says attempt 1): `payrun failed` lists it with attempts=0 too, as never ran; a
    failed job that ran before it lost its data keeps its attempts."""
    from payrun.cli import cli

    meta = {"kind": "test", "attempt": 1, "error_attempt": 1, "held": 1,
            "last_error": "job data unreadable: not JSON (JSONDecodeError: Expecting value: line 1 column 1 (char 0))"}
    conn.hset("rq:job:old-poison", mapping={"origin": keys.RENDER_QUEUE, "status": "failed", "data": b"hello",
                                            "meta": json.dumps(meta)})
    conn.hset("rq:job:ran-then-lost", mapping={"origin": keys.RENDER_QUEUE, "status": "failed",
                                               "meta": json.dumps({"kind": "test", "attempt": 3})})
    conn.zadd(f"rq:failed:{keys.RENDER_QUEUE}", {"old-poison": 9_999_999_999, "ran-then-lost": 9_999_999_999})
    rows = {r["id"]: r for r in json.loads(CliRunner().invoke(cli, ["failed", "--json"],
                                                              catch_exceptions=False).output)}
    assert (rows["old-poison"]["attempts"], rows["old-poison"]["held"], rows["old-poison"]["never_ran"]) == (0, 0, True)
    assert (rows["ran-then-lost"]["attempts"], rows["ran-then-lost"]["never_ran"]) == (3, False)
    out = CliRunner().invoke(cli, ["failed"], catch_exceptions=False).output
    assert "old-poison" in out and " attempts=0 " in out and "never ran" in out, out
    # the console's failed list says as much (it said attempts 1 of it)
    from console.failed import FailedFilter, page

    unheld = {k: v for k, v in meta.items() if k != "held"}
    conn.hset("rq:job:old-poison-2", mapping={"origin": keys.RENDER_QUEUE, "status": "failed", "data": b"hello",
                                              "meta": json.dumps(unheld)})
    conn.zadd(f"rq:failed:{keys.RENDER_QUEUE}", {"old-poison-2": 9_999_999_999})
    shown = {r["id"]: r["attempts"] for r in page(conn, None, FailedFilter()).rows}
    assert shown == {"old-poison": 0, "old-poison-2": 0, "ran-then-lost": 3}, shown


def test_a_job_rq_wrote_reads_as_readable_and_compressed_junk_does_not(conn, cfg):
    """RQ writes a job's data zlib-compressed: read raw, every job looked "not JSON", and
    `payrun job` called a healthy job unreadable."""
    import zlib

    from payrun import deadletters
    from payrun.cli import cli
    from payrun.ledger import Ledger

    Ledger(cfg.ledger_path).close()
    make_queue(keys.CONTROL_QUEUE, conn).enqueue("jobs.testing.noop", job_id="healthy-1")
    assert zlib.decompress(conn.hget("rq:job:healthy-1", "data"))  # (compressed, as RQ writes it)
    assert deadletters.unreadable_job(conn, "healthy-1") is None
    out = CliRunner().invoke(cli, ["job", "healthy-1"], catch_exceptions=False).output
    assert "unreadable" not in out and "in Redis: queued" in out, out
    # JSON, but not RQ's [func, instance, args, kwargs]: RQ cannot read it either (`payrun
    # job` called it readable, and the console offered a retry that `payrun retry` refuses)
    for junk in (zlib.compress(b"hello"), zlib.compress(BAD["pickle"]), zlib.compress(b"{}"), b"[1, 2]", b"null"):
        conn.hset("rq:job:junk-1", mapping={"origin": keys.CONTROL_QUEUE, "status": "failed", "data": junk})
        assert deadletters.unreadable_job(conn, "junk-1")["unreadable"].startswith("job data unreadable")


@pytest.mark.parametrize("bad", ["not-json", "pickle"])
@pytest.mark.parametrize("queue", [keys.EMAIL_QUEUE, keys.RENDER_QUEUE])
def test_an_unreadable_job_is_not_left_in_the_intermediate_list_by_a_worker_that_goes_on(
        conn, cfg, monkeypatch, queue, bad):
    """Failed before its start transaction (not to count an attempt), a job whose data is
    not JSON stayed in its queue's intermediate list: "taken by a worker that stopped before
    starting it" to the reaper and the console, until a reaper pass. A worker's exit hands
    such ids back (return_stranded), which hid it in a burst run: here it hands back nothing."""
    from jobs import reaper
    from jobs.limits import Limiter

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    monkeypatch.setattr(reaper, "return_dequeued_now", lambda *a, **k: [])  # (a worker still running)
    _poison(conn, queue, "poison-4", BAD[bad])
    if queue == keys.EMAIL_QUEUE:
        run_lanes(conn, [queue], lanes=1, burst=True, limiter=Limiter(conn, "email", 2, 40.0, lease_s=30))
    else:
        w = RenderWorker([make_queue(queue, conn)], connection=conn, name=f"{queue}.test.intermediate")
        w.jobs_per_horse = 1  # a horse per job: the horse meets the data first
        w.work(burst=True, logging_level="CRITICAL")
    reaper.mark_dequeued(conn)
    assert reaper.find_stranded(conn, settle_s=0) == []  # (what the console and `payrun status` read)
    _assert_failed_unreadable(conn, queue, "poison-4")


def test_the_consoles_ledger_filtered_failed_list_says_0_attempts_of_an_earlier_workers_poison_job(conn, cfg):
    """A worker of the version before counted an attempt of a job whose data is not JSON
    and told the ledger it was running (attempt 1), then failed it unread: the console's
    failed list filtered by text, company or month (the ledger answers) and `payrun job`
    said attempts 1, where `payrun failed` and the unfiltered list say 0, never ran. A job
    that ran and failed keeps its attempts."""
    from console.failed import FailedFilter, page
    from jobs import events
    from payrun import ledger as ledger_mod

    led = ledger_mod.Ledger(cfg.ledger_path)
    ledger_mod.ensure_group(conn)
    error = "job data unreadable: not JSON (JSONDecodeError: Expecting value: line 1 column 1 (char 0))"
    # as that worker wrote it: its "running" event, then fail_unreadable's "failed" (kind and queue: a row)
    events.emit(conn, "old-poison", "running", attempt=1, worker="pdf-render.app1.4101")
    events.emit(conn, "old-poison", "failed", attempt=1, error=error, kind="unreadable", queue=keys.RENDER_QUEUE)
    conn.hset("rq:job:old-poison", mapping={"origin": keys.RENDER_QUEUE, "status": "failed", "data": b"hello",
                                            "meta": json.dumps({"kind": "test", "attempt": 1, "error_attempt": 1,
                                                                "last_error": error, "permanent": False})})
    conn.zadd(f"rq:failed:{keys.RENDER_QUEUE}", {"old-poison": 9_999_999_999})
    # a job that ran twice and failed on unreadable data of another kind keeps its 2
    for attempt in (1, 2):
        events.emit(conn, "ran-twice", "running", attempt=attempt, worker="pdf-render.app1.4101",
                    kind="render", queue=keys.RENDER_QUEUE)
    ran_error = "TemplateError: data unreadable in 'designation'"
    events.emit(conn, "ran-twice", "failed", attempt=2, error=ran_error)
    conn.hset("rq:job:ran-twice", mapping={"origin": keys.RENDER_QUEUE, "status": "failed", "data": b"[]",
                                           "meta": json.dumps({"kind": "render", "attempt": 2, "last_error": ran_error})})
    conn.zadd(f"rq:failed:{keys.RENDER_QUEUE}", {"ran-twice": 9_999_999_999})
    ledger_mod.drain(conn, led)
    assert led.job("old-poison")["attempts"] == 1  # (what the ledger holds of it)
    try:
        filtered = page(conn, led, FailedFilter.parse("unreadable"))
        assert filtered.source == "ledger"
        assert {r["id"]: r["attempts"] for r in filtered.rows} == {"old-poison": 0, "ran-twice": 2}, filtered.rows
        unfiltered = page(conn, led, FailedFilter())
        assert {r["id"]: r["attempts"] for r in unfiltered.rows} == {"old-poison": 0, "ran-twice": 2}
        # its hash gone from Redis (failure TTL): the ledger's error alone says it never ran
        conn.delete("rq:job:old-poison")
        conn.zrem(f"rq:failed:{keys.RENDER_QUEUE}", "old-poison")
        row = next(r for r in page(conn, led, FailedFilter.parse("unreadable")).rows if r["id"] == "old-poison")
        assert (row["attempts"], row["in_redis"]) == (0, False)
    finally:
        led.close()
    # `payrun job` likewise (it said attempts=1 of it, from the ledger)
    from payrun.cli import cli

    out = CliRunner().invoke(cli, ["job", "old-poison"], catch_exceptions=False).output
    assert " attempts=0 " in out.splitlines()[0] and out.splitlines()[1].startswith("never ran: "), out
    out = CliRunner().invoke(cli, ["job", "ran-twice"], catch_exceptions=False).output
    assert " attempts=2 " in out.splitlines()[0] and "never ran" not in out, out
