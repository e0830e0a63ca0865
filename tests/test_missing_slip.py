"""A send whose slip file is gone (deleted, or a slip store not mounted on its host):
it fails at once, not as the employee's data, and `payrun retry` renders the slip again
first, the send waiting for that render without spending attempts. Real Redis, the real
render worker and send lanes, WeasyPrint, the local HTTP provider, the ledger."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import enqueue_due
from jobs import tasks
from jobs.errors import RenderPending, SlipMissing
from jobs.policy import classify, pauses_every_sender
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


def slip_file(cfg):
    return next(cfg.slips_dir.glob(f"{MONTH}/*/{EMP}.pdf"))


def render_then_lose_one_slip(world):
    """The month rendered (no sends yet), then one slip file deleted: its send fails."""
    from jobs.runtime import RenderWorker

    from payrun import runs

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
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

    said = runner.invoke(cli, ["retry", "--all"])
    assert said.exit_code == 0, said.output
    assert said.output.startswith("requeued 1 job(s); 1 of them render their slip again first")
    assert "had failed on the employee's data" not in said.output
    render_id = keys.render_job_id(MONTH, EMP)
    render_q, email_q = make_queue(keys.RENDER_QUEUE, conn), make_queue(keys.EMAIL_QUEUE, conn)
    assert render_q.get_job_ids() == [render_id]  # at the front of the render queue
    assert email_q.get_job_ids() == [send_id]

    # the senders get to it before the renderers: it waits, spending no attempt, paused by no one
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    send = email_q.fetch_job(send_id)
    assert send.get_status() == "scheduled" and send.meta["held"] == 1 and "being rendered again" in send.meta["last_error"]
    assert not conn.exists(keys.limit_pause("email"))

    work_everything(conn, ledger)  # the render; its end enqueues no second send
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
    assert deadletters.retry(cfg, conn, [send_id], payroll_db=db, rendered_again=again) == ([send_id], [])
    assert again == [render_id]
    made = make_queue(keys.RENDER_QUEUE, conn).fetch_job(render_id)
    assert made.func_name == "jobs.tasks.render_slip" and made.args[0]["key"] == f"slip:{MONTH}:{EMP}"
    assert made.meta["kind"] == "render" and made.meta[tasks.RENDERED_AGAIN_FOR] == send_id
    work_everything(conn, ledger)
    assert provider.delivery(f"slip:{MONTH}:{EMP}") and delivered(provider) == 12
    assert ledger.job(render_id)["status"] == "done"


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
    from jobs.runtime import RenderWorker

    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
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
    from jobs.runtime import RenderWorker

    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
    resent = next(cfg.slips_dir.glob(f"{MONTH}/*/{EMP}.resend-1.pdf"))
    resent.unlink()
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    send_id = f"email-{MONTH}-{EMP}-resend-1"
    assert [r["id"] for r in deadletters.failed(conn)] == [send_id]
    out = json.loads(runner.invoke(cli, ["retry", send_id, "--json"]).output)
    assert out["requeued"] == [send_id] and out["rendered_again"] == [f"resend-{MONTH}-{EMP}-1"]
    work_everything(conn, ledger)
    email_q = make_queue(keys.EMAIL_QUEUE, conn)
    if email_q.scheduled_job_registry.get_job_ids():  # the send came before its render: it waited
        enqueue_due(conn, email_q, {send_id: 0})
        run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    delivered = provider.delivery(f"slip:{MONTH}:{EMP}:resend-1")
    assert delivered and "Re-issued" in delivered["subject"]
    assert resent.exists()


@pytest.mark.parametrize("status,kind", [("queued", RenderPending), ("started", RenderPending),
                                         ("finished", SlipMissing), ("failed", SlipMissing), (None, SlipMissing)])
def test_what_a_send_without_its_slip_raises_follows_its_render(conn, status, kind):
    payload = {"month": MONTH, "employee_id": EMP, "key": f"slip:{MONTH}:{EMP}", "slip": f"{MONTH}/1/{EMP}.pdf"}
    key = f"rq:job:{keys.render_job_id(MONTH, EMP)}"
    conn.delete(key)
    if status:
        conn.hset(key, mapping={"status": status, "meta": "{}"})
    try:
        assert isinstance(tasks.slip_missing(conn, payload), kind)
    finally:
        conn.delete(key)
