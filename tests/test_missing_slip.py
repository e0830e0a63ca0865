"""A send whose slip file is gone (deleted, or a slip store not mounted on its host):
it fails at once, not as the employee's data, and `payrun retry` renders the slip again
first, the send waiting for that render without spending attempts. Real Redis, the real
render worker and send lanes, WeasyPrint, the local HTTP provider, the ledger."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from conftest import enqueue_due
from jobs import tasks
from jobs.errors import RenderPending, SlipMissing
from jobs.policy import classify, pauses_every_sender, render_wait_s
from jobs.runtime import make_queue, run_lanes
from payrun import deadletters, keys, ledger as ledger_mod
from payrun.cli import cli
from test_payrun import MONTH, provider, work_everything  # noqa: F401 - provider is a fixture

EMP = "emp-00004"


def delivered(provider) -> int:
    with provider.state.lock:
        return len(provider.state.delivered)


def test_a_missing_slip_is_not_the_employees_data_and_waits_for_its_render():
    missing = classify(SlipMissing("slip file x is missing"))
    assert not missing.transient and missing.on_data is False
    assert classify(ValueError("bad data")).on_data is True
    pending = classify(RenderPending("being rendered again", retry_after_s=5.0))
    assert pending.transient and pending.retry_after_s == 5.0
    assert not pauses_every_sender(pending)  # waiting for a render is nobody else's business


def test_the_render_of_a_send_is_the_runs_or_the_resends():
    base = {"month": MONTH, "employee_id": EMP, "key": f"slip:{MONTH}:{EMP}"}
    assert tasks.render_job_of(base) == keys.render_job_id(MONTH, EMP)
    assert tasks.render_job_of({**base, "key": f"slip:{MONTH}:{EMP}:resend-3"}) == f"resend-{MONTH}-{EMP}-3"


def render_all(conn, jobs_per_horse: int = 100) -> None:
    """The render worker as production runs it: a warm horse serving many jobs (its end
    recorded by the worker after the slip is committed)."""
    from jobs.runtime import RenderWorker

    w = RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn)
    w.jobs_per_horse = jobs_per_horse
    w.work(burst=True, logging_level="WARNING")


def slip_file(cfg):
    return next(cfg.slips_dir.glob(f"{MONTH}/*/{EMP}.pdf"))


def render_then_lose_one_slip(world):
    """The month rendered (no sends yet), then one slip file deleted: its send fails."""
    from payrun import runs

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    render_all(conn)
    slip_file(cfg).unlink()
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    ledger_mod.drain(conn, ledger)
    return keys.email_job_id(MONTH, EMP)


def test_a_deleted_slip_fails_its_send_at_once_and_a_retry_renders_it_again_then_sends_it_once(world, provider):
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    runner = CliRunner()
    listed = json.loads(runner.invoke(cli, ["failed", "--json"]).output)
    assert [r["id"] for r in listed] == [send_id] and listed[0]["attempts"] == 1
    assert "is missing from the slip store" in listed[0]["error"] and "`payrun retry` renders it again" in listed[0]["error"]
    assert listed[0]["permanent"] is False  # not "fix the data": the data is fine
    assert "[permanent: fix the data" not in runner.invoke(cli, ["failed"]).output
    assert delivered(provider) == 11

    render_q, email_q = make_queue(keys.RENDER_QUEUE, conn), make_queue(keys.EMAIL_QUEUE, conn)
    render_q.enqueue_call("jobs.tasks.noop", job_id="render-other-1")  # a run's renders waiting
    said = runner.invoke(cli, ["retry", "--all"])
    assert said.exit_code == 0, said.output
    assert said.output.startswith("requeued 1 job(s); 1 of them render their slip again first")
    assert "had failed on the employee's data" not in said.output
    render_id = keys.render_job_id(MONTH, EMP)
    assert render_q.get_job_ids() == [render_id, "render-other-1"]  # at the front of the render queue
    assert conn.ttl(f"rq:job:{render_id}") == -1  # (its finished record's expiry is lifted while it waits)
    assert email_q.get_job_ids() == [send_id]

    # the senders get to it before the renderers: it waits, spending no attempt
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    send = email_q.fetch_job(send_id)
    assert send.get_status() == "scheduled" and send.meta["held"] == 1 and "being rendered again" in send.meta["last_error"]
    assert send.meta["attempt"] == 2 and send.meta["render_waits"][0] == 1
    # ... and its wait over, it goes behind the sends waiting, not ahead of a run
    email_q.enqueue_call("jobs.tasks.noop", job_id="email-other-1")
    enqueue_due(conn, email_q, {send_id: 0})
    assert email_q.get_job_ids() == ["email-other-1", send_id]
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)  # (still no slip: it waits again)
    assert email_q.fetch_job(send_id).meta["render_waits"][0] == 2

    render_all(conn)  # the render; its end enqueues no second send
    assert slip_file(cfg).stat().st_mode & 0o777 == 0o600
    assert email_q.get_job_ids() == [] and email_q.scheduled_job_registry.get_job_ids() == [send_id]
    enqueue_due(conn, email_q, {send_id: 0})
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    ledger_mod.drain(conn, ledger)
    assert provider.delivery(f"slip:{MONTH}:{EMP}")
    assert delivered(provider) == 12
    assert json.loads(runner.invoke(cli, ["failed", "--json"]).output) == []
    row = ledger.job(send_id)
    assert row["status"] == "done" and [h["outcome"] for h in row["history"]][0] == "failed"
    assert ledger.job(render_id)["status"] == "done"
    assert sum(c["done"] for c in ledger.slip_counts(MONTH).values()) == 12


def test_a_render_record_gone_from_redis_is_made_again_from_the_payroll_database(world, provider):
    """Finished renders are kept a day in Redis: a retry later makes the render job again,
    with the same id, from the month's payroll data."""
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    render_id = keys.render_job_id(MONTH, EMP)
    conn.delete(f"rq:job:{render_id}")
    conn.zrem(f"rq:finished:{keys.RENDER_QUEUE}", render_id)
    again: list[str] = []
    assert deadletters.retry(cfg, conn, [send_id], payroll_db=db, rendered_again=again,
                             ledger=ledger) == ([send_id], [])
    assert again == [render_id]
    made = make_queue(keys.RENDER_QUEUE, conn).fetch_job(render_id)
    assert made.meta["attempt"] == 1  # its next try is the ledger's second, not a new first
    assert made.func_name == "jobs.tasks.render_slip" and made.args[0]["key"] == f"slip:{MONTH}:{EMP}"
    assert made.meta["kind"] == "render" and made.meta[tasks.RENDERED_AGAIN_FOR] == send_id
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)  # the send first: it waits for the render
    email_q = make_queue(keys.EMAIL_QUEUE, conn)
    assert email_q.scheduled_job_registry.get_job_ids() == [send_id]
    render_all(conn)
    enqueue_due(conn, email_q, {send_id: 0})
    work_everything(conn, ledger)
    assert provider.delivery(f"slip:{MONTH}:{EMP}") and delivered(provider) == 12
    row = ledger.job(render_id)
    assert row["status"] == "done" and [(h["attempt"], h["outcome"]) for h in row["history"]] == [(1, "done"),
                                                                                                 (2, "done")]


def test_without_the_payroll_database_a_gone_render_is_refused_and_the_send_stays_failed(world, provider):
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    render_id = keys.render_job_id(MONTH, EMP)
    conn.delete(f"rq:job:{render_id}")
    refused: list[tuple[str, str]] = []
    assert deadletters.retry(cfg, conn, [send_id], payroll_db=None, refused=refused) == ([], [])
    assert refused and refused[0][0] == send_id and "control host" in refused[0][1]
    assert deadletters.is_failed(conn, send_id)
    assert make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == []


def test_a_slip_rendered_again_and_still_missing_says_the_store_is_another(world, provider):
    """A send host whose slip store is not the render hosts' (unmounted since `up`): the
    render made the file, this host cannot see it; the send says so instead of looping."""
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    assert deadletters.retry(cfg, conn, [send_id], payroll_db=db) == ([send_id], [])
    render_all(conn)
    slip_file(cfg).unlink()  # as if this host read another store
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    ledger_mod.drain(conn, ledger)
    failed = deadletters.failed(conn, keys.EMAIL_QUEUE)
    assert [r["id"] for r in failed] == [send_id]
    assert "rendered again" in failed[0]["error"] and "another slip store" in failed[0]["error"]
    assert delivered(provider) == 11


def test_a_resends_missing_slip_is_rendered_again_by_its_resend_render(world, provider):
    cfg, conn, db, ledger = world
    runner = CliRunner()
    from payrun import runs

    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    assert runner.invoke(cli, ["resend", "--employee", EMP, "--month", MONTH]).exit_code == 0
    render_all(conn)
    resent = next(cfg.slips_dir.glob(f"{MONTH}/*/{EMP}.resend-1.pdf"))
    resent.unlink()
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    send_id = f"email-{MONTH}-{EMP}-resend-1"
    assert [r["id"] for r in deadletters.failed(conn)] == [send_id]
    out = json.loads(runner.invoke(cli, ["retry", send_id, "--json"]).output)
    assert out["requeued"] == [send_id] and out["rendered_again"] == [f"resend-{MONTH}-{EMP}-1"]
    email_q = make_queue(keys.EMAIL_QUEUE, conn)
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)  # the send before its render: it waits
    assert email_q.scheduled_job_registry.get_job_ids() == [send_id] and not provider.delivery(
        f"slip:{MONTH}:{EMP}:resend-1")
    render_all(conn)
    enqueue_due(conn, email_q, {send_id: 0})
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    delivered = provider.delivery(f"slip:{MONTH}:{EMP}:resend-1")
    assert delivered and "Re-issued" in delivered["subject"]
    assert resent.exists()


PAYLOAD = {"month": MONTH, "employee_id": EMP, "key": f"slip:{MONTH}:{EMP}", "slip": f"{MONTH}/1/{EMP}.pdf"}


@pytest.mark.parametrize("status,kind", [("queued", RenderPending), ("started", RenderPending),
                                         ("scheduled", RenderPending), ("deferred", RenderPending),
                                         ("finished", SlipMissing), ("failed", SlipMissing), ("stopped", SlipMissing),
                                         ("canceled", SlipMissing), (None, SlipMissing)])
def test_what_a_send_without_its_slip_raises_follows_its_render(conn, status, kind):
    key = f"rq:job:{keys.render_job_id(MONTH, EMP)}"
    conn.delete(key)
    if status:
        conn.hset(key, mapping={"status": status, "meta": "{}"})
    try:
        assert isinstance(tasks.slip_missing(conn, PAYLOAD), kind)
    finally:
        conn.delete(key)


def test_a_send_waits_for_its_render_with_a_growing_pause_and_gives_up_after_an_hour(conn):
    """No render worker up, or pdf-render drained: the send does not poll for ever."""
    assert [render_wait_s(n, 0.0) for n in range(7)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert render_wait_s(3, 3599.0) == 40.0 and render_wait_s(3, 3600.0) is None
    key = f"rq:job:{keys.render_job_id(MONTH, EMP)}"
    conn.hset(key, mapping={"status": "queued", "meta": "{}"})
    try:
        meta: dict = {}
        first = tasks.slip_missing(conn, PAYLOAD, meta, now=1000.0)
        assert isinstance(first, RenderPending) and first.retry_after_s == 5.0 and meta["render_waits"] == [1, 1000.0]
        again = tasks.slip_missing(conn, PAYLOAD, meta, now=1005.0)
        assert again.retry_after_s == 10.0 and meta["render_waits"] == [2, 1000.0]
        late = tasks.slip_missing(conn, PAYLOAD, meta, now=1000.0 + 3600)
        assert isinstance(late, SlipMissing) and "for over 60 min" in str(late) and "pdf-render worker" in str(late)
        assert "render_waits" not in meta  # (a retry starts the count again)
    finally:
        conn.delete(key)


def test_a_send_that_failed_on_something_else_is_not_rendered_again_whatever_this_hosts_store(world, provider,
                                                                                              tmp_path):
    """Review: whether a slip is gone was told by the retrying host's slip store; from a
    shell whose PAYRUN_SLIPS_DIR was not the shared store, a send that failed on its
    address had its slip rendered again (or was refused). The send host's record decides."""
    cfg, conn, db, ledger = world
    from payrun import runs

    db.conn.execute("UPDATE employees SET email = 'nobody@nowhere.invalid' WHERE id = ?", (EMP,))
    db.conn.commit()
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    send_id = keys.email_job_id(MONTH, EMP)
    assert [r["id"] for r in deadletters.failed(conn)] == [send_id]
    elsewhere = dataclasses.replace(cfg, slips=str(tmp_path / "not-the-store"))
    again: list[str] = []
    assert deadletters.retry(elsewhere, conn, [send_id], payroll_db=db, rendered_again=again) == ([send_id], [])
    assert again == [] and make_queue(keys.RENDER_QUEUE, conn).get_job_ids() == []
    # a failure recorded by a version before SlipMissing is told by its error
    old = make_queue(keys.EMAIL_QUEUE, conn).fetch_job(send_id)
    old.meta.update(last_error=f"slip file {old.args[0]['slip']} is missing from the slip store: re-run its render")
    assert deadletters.slip_gone(old)


def render_and_send_fail_on_the_data(world):
    """A slip lost after its render; its send retried, which makes the render again; but
    HR broke the employee's name since (too long for the slip): the render fails on the
    data, and the send with it. Returns (send id, render id, what the send's retry said)."""
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    db.conn.execute("UPDATE employees SET name_en = ? WHERE id = ?", ("A" * 81, EMP))  # too long for the slip
    db.conn.commit()
    first_retry = deadletters.retry(cfg, conn, [send_id], payroll_db=db)
    render_all(conn)  # fails on the data
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)  # and the send with it
    return send_id, keys.render_job_id(MONTH, EMP), first_retry


def deliver_the_slip(conn, ledger, provider, send_id) -> None:
    """Work everything after a retry; the slip is delivered once and nothing stays failed."""
    work_everything(conn, ledger)
    email_q = make_queue(keys.EMAIL_QUEUE, conn)
    if email_q.scheduled_job_registry.get_job_ids():  # (if the send looked before the render ended)
        enqueue_due(conn, email_q, {send_id: 0})
        run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    assert provider.delivery(f"slip:{MONTH}:{EMP}") and delivered(provider) == 12
    assert deadletters.failed(conn) == []


def test_a_render_retried_by_itself_takes_its_waiting_send_along(world, provider):
    """Review: a render made again for a send can fail on data HR broke since; fixed, and
    the render retried by itself (as `payrun failed` lists it), its end found the send
    there (failed) and enqueued nothing: the slip was never sent."""
    cfg, conn, db, ledger = world
    send_id, render_id, first_retry = render_and_send_fail_on_the_data(world)
    assert first_retry == ([send_id], [])
    failed = {r["id"]: r for r in deadletters.failed(conn)}
    assert set(failed) == {render_id, send_id}
    assert f"its render {render_id} failed" in failed[send_id]["error"] and "`payrun retry` this send" in failed[
        send_id]["error"]
    db.conn.execute("UPDATE employees SET name_en = 'Ayesha Siddiqua' WHERE id = ?", (EMP,))
    db.conn.commit()
    out = json.loads(CliRunner().invoke(cli, ["retry", render_id, "--json"]).output)
    assert out["requeued"] == [render_id, send_id]
    deliver_the_slip(conn, ledger, provider, send_id)


def test_two_retries_at_once_and_a_render_left_in_no_queue(world, provider):
    """Review: two retries of one slip at once queued its render twice; a render saved as
    queued but never pushed (a crash in between) was taken as on its way, and the send
    waited for it for ever."""
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    render_id = keys.render_job_id(MONTH, EMP)
    send = make_queue(keys.EMAIL_QUEUE, conn).fetch_job(send_id)
    render_q = make_queue(keys.RENDER_QUEUE, conn)
    conn.set(f"payrun:render-again:{render_id}", "another retry", ex=30)  # the other retry, half-way
    assert deadletters.render_again(cfg, conn, send, db) == render_id
    assert render_q.get_job_ids() == []  # left to the other retry
    conn.delete(f"payrun:render-again:{render_id}")
    conn.hset(f"rq:job:{render_id}", "status", "queued")  # queued, in no queue
    assert deadletters.render_again(cfg, conn, send, db) == render_id
    assert render_q.get_job_ids() == [render_id]
    assert deadletters.render_again(cfg, conn, send, db) == render_id  # now on its way: not twice
    assert render_q.get_job_ids() == [render_id]


def test_a_month_pruned_from_the_ledger_is_not_rendered_again(world, provider):
    """Review: a retried send of a pruned month put back a ledger row counted as queued for
    ever (start_run refuses pruned months for the same reason)."""
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    ledger.db.conn.execute("INSERT INTO pruned_months (month, pruned_at) VALUES (?, ?)", (MONTH, "2027-01-01T00:00:00"))
    ledger.db.conn.commit()
    refused: list[tuple[str, str]] = []
    assert deadletters.retry(cfg, conn, [send_id], payroll_db=db, refused=refused, ledger=ledger) == ([], [])
    assert "was pruned from the ledger" in refused[0][1] and deadletters.is_failed(conn, send_id)


def test_a_render_that_ends_between_the_sends_read_and_its_look_is_read_again(world, provider, monkeypatch):
    """Review: the send read no file, then found the render finished (it committed the slip
    in between) and failed saying this host reads another store."""
    cfg, conn, db, ledger = world
    send_id = render_then_lose_one_slip(world)
    assert deadletters.retry(cfg, conn, [send_id], payroll_db=db) == ([send_id], [])
    render_all(conn)
    path = slip_file(cfg)
    kept = path.read_bytes()
    path.unlink()
    real = tasks.slip_missing

    def render_ends_meanwhile(*args, **kwargs):
        out = real(*args, **kwargs)
        path.write_bytes(kept)
        path.chmod(0o600)  # as a render commits it (a send reads only a slip that is ours alone)
        return out

    monkeypatch.setattr(tasks, "slip_missing", render_ends_meanwhile)
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    assert provider.delivery(f"slip:{MONTH}:{EMP}") and deadletters.failed(conn) == []


@pytest.mark.parametrize("via", ["cli", "console"])
def test_retry_all_does_not_call_a_render_it_puts_back_left_out(world, provider, via):
    """Review: a slip's render failed, then its send (for want of the slip). `retry --all`
    keeps one failure per slip, the send, and said it "left out" the older render; but the
    send's retry renders the slip again, by putting back that very render. Now the render
    is not named as left out; nor is a send a kept render took along."""
    cfg, conn, db, ledger = world
    send_id, render_id, _ = render_and_send_fail_on_the_data(world)
    assert {r["id"] for r in deadletters.failed(conn)} == {render_id, send_id}
    db.conn.execute("UPDATE employees SET name_en = 'Ayesha Siddiqua' WHERE id = ?", (EMP,))
    db.conn.commit()
    # (which of the two is kept depends on their failures' order, often the same second;
    # a kept render takes its send along, a kept send puts its render back)
    if via == "cli":
        out = json.loads(CliRunner().invoke(cli, ["retry", "--all", "--json"]).output)
        assert send_id in out["requeued"] and render_id in out["requeued"] + out["rendered_again"]
        assert out["left_out_same_slip"] == []
    else:  # the console's "retry all matching"
        from console import actions

        done = actions.retry(cfg, conn, [r["id"] for r in deadletters.failed(conn)])
        assert "left out" not in done.message and done.detail["same_slip"] == [], done.message
        assert render_id in done.detail["rendered_again"] or done.count == 2
    deliver_the_slip(conn, ledger, provider, send_id)


def test_a_slip_store_another_account_could_change_is_neither_written_nor_read(world, provider):
    """Security review (session 31): a folder of the slip store that another account can
    write to (a shared mount at 1777, a month folder made by someone else) let that account
    swap a forged slip in between the render and the send, and the send mailed it. Now a
    render writes nothing there and a send reads nothing there: both fail as the host's
    trouble (retried, not "fix the data"; the send's claim released) until the store is
    this account's alone again."""
    from jobs import idempotency
    from jobs.errors import StoreUnsafe
    from payrun import runs

    cfg, conn, db, ledger = world
    month_dir = cfg.slips_dir / MONTH
    month_dir.mkdir(parents=True)
    month_dir.chmod(0o777)  # e.g. made by another account on a shared mount
    runs.start_run(cfg, conn, ledger, db, MONTH)
    render_all(conn)
    render_q, email_q = make_queue(keys.RENDER_QUEUE, conn), make_queue(keys.EMAIL_QUEUE, conn)
    render = render_q.fetch_job(keys.render_job_id(MONTH, EMP))
    assert render.get_status() == "scheduled"  # retried, as on a full disk
    assert f"the slip store's folder {month_dir} can be written by other accounts (mode 777)" in render.meta["last_error"]
    assert not render.meta["permanent"] and list(month_dir.rglob("*")) == [] and email_q.count == 0

    month_dir.chmod(0o700)  # the operator's fix; the retries go through
    enqueue_due(conn, render_q, {j: 0 for j in render_q.scheduled_job_registry.get_job_ids()})
    render_all(conn)
    assert email_q.count == 12
    slip = slip_file(cfg)
    slip.chmod(0o644)  # readable (and so replaceable, were its folder not ours) by others
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    assert delivered(provider) == 11 and not provider.delivery(f"slip:{MONTH}:{EMP}")
    send = email_q.fetch_job(keys.email_job_id(MONTH, EMP))
    assert send.get_status() == "scheduled" and f"the slip store's slip {slip} can be read or written by " \
        "other accounts (mode 644)" in send.meta["last_error"] and "chmod 600" in send.meta["last_error"]
    assert not idempotency.state(conn, f"slip:{MONTH}:{EMP}").get("owner")  # its claim released: the retry may send
    assert classify(StoreUnsafe("x")).transient

    slip.chmod(0o600)
    enqueue_due(conn, email_q, {send.id: 0})
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    assert provider.delivery(f"slip:{MONTH}:{EMP}") and delivered(provider) == 12


def test_a_slip_that_cannot_be_read_gives_the_sends_claim_back(world, provider, monkeypatch):
    """Review (session 34): an I/O error reading the slip (a store's disk or mount failing)
    kept the send's idempotency claim until it ran out, so its retry waited ~90 s for it."""
    from pathlib import Path

    from jobs import idempotency
    from payrun import runs

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    render_all(conn)
    broken = slip_file(cfg)
    real = Path.read_bytes

    def read_bytes(self):
        if self == broken:
            raise OSError(5, "Input/output error", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    assert delivered(provider) == 11
    send = make_queue(keys.EMAIL_QUEUE, conn).fetch_job(keys.email_job_id(MONTH, EMP))
    assert "Input/output error" in send.meta["last_error"] and not send.meta["permanent"]
    assert not idempotency.state(conn, f"slip:{MONTH}:{EMP}").get("owner")  # its claim released: the retry may send


def test_a_send_waiting_for_its_render_keeps_waiting_past_the_hour_while_the_slip_store_is_full(conn, monkeypatch):
    """Review (session 42): a render waits for room in a full slip store for hours (StoreFull,
    no attempt spent; pdf-render workers take none meanwhile), but a send waiting for that
    render failed for good after an hour, "is a pdf-render worker up, and pdf-render not
    drained?", while both were. It waits as long as the store is full; then the hour counts."""
    from jobs import policy
    from payrun import diskspace

    free = {"bytes": 0}
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: free["bytes"])
    key = f"rq:job:{keys.render_job_id(MONTH, EMP)}"
    conn.hset(key, mapping={"status": "queued", "meta": "{}"})
    try:
        meta: dict = {"render_waits": [60, 1000.0]}
        late = tasks.slip_missing(conn, PAYLOAD, meta, now=1000.0 + 5 * 3600)
        assert isinstance(late, RenderPending) and "full slip store" in str(late), late
        assert late.retry_after_s == policy.RENDER_WAIT_MAX_S and meta["render_waits"] == [61, 1000.0]
        free["bytes"] = 10 * policy.STORE_ROOM_MIN_BYTES  # room again, and the render still not run
        assert isinstance(tasks.slip_missing(conn, PAYLOAD, meta, now=1000.0 + 5 * 3600 + 60), SlipMissing)
    finally:
        conn.delete(key)
