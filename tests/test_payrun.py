"""The pay run end to end against real parts: Redis, worker processes, the local HTTP
provider or a real SMTP server (aiosmtpd), WeasyPrint, the SQLite ledger."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from email import message_from_bytes
from email.policy import default as default_policy

import pypdf
import pytest

from jobs import oneoff, slip
from jobs.runtime import RenderWorker, make_queue, run_lanes
from payrun import deadletters, keys, ledger as ledger_mod, payroll, runs, status
from payrun.ledger import Ledger
from payrun.provider import Provider

MONTH = "2026-11"  # the month of conftest's `world`


@pytest.fixture
def provider(monkeypatch):
    p = Provider(latency_s=0.02, rate_per_s=1000).start()
    monkeypatch.setenv("PAYRUN_EMAIL_URL", p.url)
    from jobs import tasks

    tasks.settings.cache_clear()
    yield p
    p.stop()


def work_everything(conn, ledger) -> None:
    """Render with the real forking worker, then send with the real lanes, in burst mode."""
    w = RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn)
    w.work(burst=True, logging_level="WARNING")
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    ledger_mod.drain(conn, ledger)


def set_email(db, employee_id: str, email: str) -> None:
    """What HR does in the payroll database (a bad address, then its fix)."""
    db.conn.execute("UPDATE employees SET email = ? WHERE id = ?", (email, employee_id))
    db.conn.commit()


def pdf_text(path) -> str:
    return "\n".join(page.extract_text() for page in pypdf.PdfReader(str(path)).pages)


def test_run_twice_makes_one_set_of_jobs(world):
    cfg, conn, db, ledger = world
    first = runs.start_run(cfg, conn, ledger, db, MONTH)
    assert first.jobs == 12 and sorted(first.created) == [1, 2]
    second = runs.start_run(cfg, conn, ledger, db, MONTH)
    assert second.jobs == 0 and second.already == [1, 2]
    assert make_queue(keys.RENDER_QUEUE, conn).count == 12
    assert len(ledger.jobs(kind="render", limit=100)) == 12
    assert {r["company_id"] for r in ledger.runs(MONTH)} == {1, 2}
    assert conn.get(keys.payroll_lock(MONTH)) is None  # released by its owner


def test_a_held_lock_stops_a_second_server(world):
    cfg, conn, db, ledger = world
    assert runs.acquire(conn, MONTH, "server-A")
    result = runs.start_run(cfg, conn, ledger, db, MONTH, owner="server-B")
    assert result.locked_by == "server-A" and result.jobs == 0
    assert make_queue(keys.RENDER_QUEUE, conn).count == 0
    assert not runs.release(conn, MONTH, "server-B")  # only the owner releases
    assert runs.release(conn, MONTH, "server-A")


def test_expired_lock_under_paused_owner_is_stopped_by_the_unique_row(world):
    cfg, conn, db, ledger = world
    assert runs.start_run(cfg, conn, ledger, db, MONTH, owner="server-A").jobs == 12
    conn.delete(keys.payroll_lock(MONTH))  # as if A's lock expired and B took over later
    again = runs.start_run(cfg, conn, ledger, db, MONTH, owner="server-B")
    assert again.jobs == 0 and again.already == [1, 2]
    assert make_queue(keys.RENDER_QUEUE, conn).count == 12


def test_two_concurrent_cli_runs_make_one_set(world):
    cfg, conn, db, ledger = world
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "payrun.cli", "run", "--month", MONTH, "--json"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sum(o["jobs_created"] for o in outs) == 12
    assert make_queue(keys.RENDER_QUEUE, conn).count == 12


def test_pay_run_end_to_end_over_http(world, provider, caplog):
    import logging

    cfg, conn, db, ledger = world
    caplog.set_level(logging.DEBUG)
    assert runs.start_run(cfg, conn, ledger, db, MONTH).jobs == 12
    work_everything(conn, ledger)
    # nothing logged carries a salary figure or a bank account
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "job email-2026-11-emp-00001" in logged  # we did capture the workers' lines
    # one line per job's end, with its duration; RQ's three per-job success lines are dropped
    assert re.search(r"job email-2026-11-emp-00001 done \(attempt 1\) in \d+\.\d\d s", logged)
    assert "Job OK" not in logged and "Successfully completed" not in logged and "result is kept" not in logged
    assert "enqueued 9 render jobs of company 1" in logged  # one line per chunk, not per job
    assert "payrun-bulk-template" not in logged
    for snap in payroll.snapshots(db, MONTH):
        t = slip.totals(snap)
        for amount in (t["net"], t["gross"], snap["earnings"]["basic"]):
            assert slip.format_amount(amount) not in logged  # "45,000.00"
    for (acct,) in db.conn.execute("SELECT bank_account FROM employees"):
        assert acct not in logged

    stats = provider.stats()
    assert stats["delivered"] == 12 and stats["duplicates_refused"] == 0
    report = status.report(cfg, ledger, MONTH)
    assert report["total"]["done"] == 12 and report["total"]["failed"] == 0
    for snap in payroll.snapshots(db, MONTH):
        path = cfg.slips_dir / MONTH / str(snap["company"]["id"]) / f"{snap['employee']['id']}.pdf"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        text = pdf_text(path)
        assert snap["employee"]["name_en"] in text
        assert "November 2026" in text
        t = slip.totals(snap)
        assert t["net"] == t["gross"] - t["deductions"]
        assert slip.format_amount(t["net"]) in text
        delivered = provider.delivery(snap["key"])
        assert delivered["to"] == snap["employee"]["email"]
    rows = ledger.jobs(limit=100)
    assert len(rows) == 24 and all(r["status"] == "done" and r["attempts"] == 1 for r in rows)


def test_a_refused_address_fails_at_once_with_a_reason(world, provider):
    cfg, conn, db, ledger = world
    set_email(db, "emp-00001", "nobody@nowhere.invalid")
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    job = ledger.job(keys.email_job_id(MONTH, "emp-00001"))
    assert job["status"] == "failed" and job["attempts"] == 1
    assert "invalid recipient" in job["last_error"]
    assert [h["outcome"] for h in job["history"]] == ["failed"]
    assert provider.stats()["delivered"] == 11
    report = status.report(cfg, ledger, MONTH)
    assert report["total"]["failed"] == 1 and report["total"]["done"] == 11
    # HR walkthrough: "11 sent, 1 failed" said nothing of who, or where to look
    assert (f"1 slip of {MONTH} failed for good and was not delivered: `payrun failed --month {MONTH}` names "
            "each employee and why") in " ".join(report["notes"]), report["notes"]
    by_company = status.report(cfg, ledger, MONTH, company=1)["notes"]
    assert any(f"`payrun failed --month {MONTH} --company 1` names" in n for n in by_company), by_company


def test_a_sent_key_is_never_sent_again(world, provider):
    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    # the same send job enqueued again by mistake (a duplicate fan-out, a hand requeue)
    snap = next(payroll.snapshots(db, MONTH))
    from jobs import tasks

    rel = tasks.slip_relpath(MONTH, snap["company"]["id"], snap["employee"]["id"])
    make_queue(keys.EMAIL_QUEUE, conn).enqueue_call(
        "jobs.tasks.send_slip", args=(tasks.email_payload(snap, rel),), job_id="email-dup-1",
        meta={"kind": "email"},
    )
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=1, burst=True)
    assert provider.stats()["delivered"] == 12
    assert provider.stats()["received"] == 12  # skipped before the provider saw it


def test_a_resend_the_provider_dedupes_is_said_and_counted(world, provider, caplog):
    """Walkthrough: after a `kill -9` of the send-email process, 36 in-flight slips went to
    the provider again (its dedupe kept them from the inbox) and nothing in payrun said so.
    Here: a send accepted by the provider whose sender died before recording it (the
    reaper then drops the dead attempt's claim), sent again."""
    from click.testing import CliRunner

    from jobs import tasks
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    snap = next(payroll.snapshots(db, MONTH))
    conn.delete(keys.idem_state(snap["key"]))  # what the reaper does to a killed attempt's claim
    rel = tasks.slip_relpath(MONTH, snap["company"]["id"], snap["employee"]["id"])
    make_queue(keys.EMAIL_QUEUE, conn).enqueue_call(
        "jobs.tasks.send_slip", args=(tasks.email_payload(snap, rel),), job_id="email-again-1",
        meta={"kind": "email"},
    )
    with caplog.at_level("WARNING", logger="payrun.jobs"):
        run_lanes(conn, [keys.EMAIL_QUEUE], lanes=1, burst=True)
    assert (provider.stats()["delivered"], provider.stats()["duplicates_refused"]) == (12, 1)
    assert any(f"send {snap['key']}: the provider already had this slip" in r.getMessage() for r in caplog.records)
    assert not any(str(snap["employee"]["id"]) in r.getMessage() and "basic" in r.getMessage()
                   for r in caplog.records)  # (no salary figures in that line)
    out = CliRunner().invoke(cli, ["limits", "show"])
    assert "1 resends deduped by the provider" in out.output, out.output
    out = CliRunner().invoke(cli, ["queues"])
    assert "1 resends deduped by the provider" in out.output, out.output


def test_a_send_the_reaper_took_over_while_it_stalled_sends_nothing_and_lets_the_job_go(world, provider, monkeypatch,
                                                                                      caplog):
    """A sender stalls (a paused VM) after its start; the reaper returns its job (the
    worker's liveness ran out) and frees its claim. When the sender wakes it must not
    write the message, and must not retry the job either: the job is back in its queue,
    and its next try sends it, once."""
    import time

    from jobs import reaper, tasks

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
    real = tasks.transport()
    stalled: list[str] = []

    class StallsOnce:  # the first send's sender "stalls" in here while the reaper runs
        def prepare(self, msg):
            if not stalled:
                stalled.append(msg.idempotency_key)
                assert [s.job_id for s in reaper.reap(conn, now=time.time() + 3600)]  # its lease long gone
            return real.prepare(msg)

        def send(self, *args, **kw):
            return real.send(*args, **kw)

    monkeypatch.setattr(tasks, "transport", lambda: StallsOnce())
    with caplog.at_level("WARNING", logger="payrun.worker"):
        run_lanes(conn, [keys.EMAIL_QUEUE], lanes=1, burst=True)
    ledger_mod.drain(conn, ledger)
    st = provider.stats()
    assert (st["received"], st["delivered"]) == (12, 12)  # the stalled try wrote nothing
    q = make_queue(keys.EMAIL_QUEUE, conn)
    assert q.scheduled_job_registry.get_job_ids() == [] and q.failed_job_registry.get_job_ids() == []
    assert len(q.finished_job_registry.get_job_ids()) == 12 and q.count == 0
    assert any("this try stalled until the reaper had returned the job" in r.getMessage() for r in caplog.records)
    emails = ledger.jobs(month=MONTH, kind="email")
    assert len(emails) == 12 and {j["status"] for j in emails} == {"done"}


def test_end_to_end_over_real_smtp(world, monkeypatch):
    from aiosmtpd.controller import Controller

    received = []

    class Handler:
        async def handle_DATA(self, server, session, envelope):
            received.append((envelope.rcpt_tos, envelope.content))
            return "250 OK"

    class EphemeralController(Controller):
        def _trigger_server(self):  # learn the real port before aiosmtpd's readiness probe
            self.port = self.server.sockets[0].getsockname()[1]
            super()._trigger_server()

    controller = EphemeralController(Handler(), hostname="127.0.0.1", port=0)
    controller.start()
    try:
        port = controller.port
        monkeypatch.setenv("PAYRUN_EMAIL_URL", f"smtp://127.0.0.1:{port}")
        from jobs import tasks

        tasks.settings.cache_clear()
        cfg, conn, db, ledger = world
        runs.start_run(cfg, conn, ledger, db, MONTH)
        work_everything(conn, ledger)
    finally:
        controller.stop()
    assert len(received) == 12
    by_rcpt = {rcpts[0]: message_from_bytes(content, policy=default_policy) for rcpts, content in received}
    for snap in payroll.snapshots(db, MONTH):
        msg = by_rcpt[snap["employee"]["email"]]
        assert msg["Idempotency-Key"] == snap["key"]
        pdf = next(p for p in msg.iter_attachments() if p.get_content_type() == "application/pdf").get_content()
        text = "\n".join(pg.extract_text() for pg in pypdf.PdfReader(io.BytesIO(pdf)).pages)
        assert snap["employee"]["name_en"] in text and slip.format_amount(slip.totals(snap)["net"]) in text


def test_ledger_replays_what_it_had_not_acknowledged(cfg, conn):
    from jobs import events

    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": "render-x", "kind": "render", "month": MONTH, "company_id": 1, "key": "k"}])
    events.emit(conn, "render-x", "running", attempt=1, worker="w1")
    events.emit(conn, "render-x", "done", attempt=1)
    # a ledger that read the events and died before committing: they stay pending
    ledger_mod.ensure_group(conn)
    conn.xreadgroup(keys.EVENTS_GROUP, "ledger-1", {keys.EVENTS_STREAM: ">"}, count=10)
    assert ledger.job("render-x")["status"] == "queued"
    assert ledger_mod.drain(conn, ledger) == 2  # the restarted ledger replays them
    job = ledger.job("render-x")
    assert job["status"] == "done" and job["history"][0]["outcome"] == "done"
    assert ledger_mod.backlog(conn) == 0
    ledger.close()


def test_status_before_any_run_names_the_months_with_salary_lines(world):
    """Walkthrough: with 1,800 employees seeded for a month, `payrun status` said only
    "no pay run yet: `payrun run --month YYYY-MM` starts one"."""
    from click.testing import CliRunner

    from payrun.cli import cli

    out = CliRunner().invoke(cli, ["status"])
    assert out.exit_code == 0, out.output
    assert f"no pay run yet; salary lines are in for {MONTH}: `payrun run --month {MONTH}` starts it" in out.output
    assert json.loads(CliRunner().invoke(cli, ["status", "--json"]).output)["salary_months"] == [MONTH]


def test_status_json_shape(world, provider):
    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    out = subprocess.run([sys.executable, "-m", "payrun.cli", "status", "--json"], capture_output=True,
                         text=True, env=dict(os.environ), timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["month"] == MONTH
    assert data["total"] | {} == data["total"] and data["total"]["queued"] == 12
    for k in ("queued", "running", "retrying", "done", "failed"):
        assert k in data["total"] and all(k in c for c in data["companies"])
    assert {c["id"] for c in data["companies"]} == {1, 2} and all(c["name"] for c in data["companies"])


def test_bad_address_fixed_then_retried_is_delivered(world, provider):
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    set_email(db, "emp-00002", "nobody@nowhere.invalid")
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    runner = CliRunner()
    listed = json.loads(runner.invoke(cli, ["failed", "--json"]).output)
    assert [r["id"] for r in listed] == [keys.email_job_id(MONTH, "emp-00002")]
    assert "invalid recipient" in listed[0]["error"] and listed[0]["attempts"] == 1 and listed[0]["permanent"] is True
    text = runner.invoke(cli, ["failed"]).output  # the on-call engineer: fix first, a retry alone fails again
    assert "[permanent: fix the data, then retry]" in text and "note: 1 of them failed for good on the employee's data" in text
    shown = runner.invoke(cli, ["job", listed[0]["id"]]).output
    assert "in Redis: failed\n" in shown and "fix the employee in the payroll data (`payrun import`)" in shown
    ledger_mod.drain(conn, ledger)
    detail = json.loads(runner.invoke(cli, ["job", listed[0]["id"], "--json"]).output)
    assert detail["rq_status"] == "failed" and "PermanentError" in detail["traceback"]
    assert detail["ledger"]["history"][0]["outcome"] == "failed"
    # HR fixes the address, then retries everything that failed on it (the retry says the
    # address changed since; of a job whose data did not change, that it fails again)
    set_email(db, "emp-00002", "fixed@payroll.example")
    # the list no longer says "fix the data" of an address fixed since (an HR drill)
    assert listed[0]["address_changed"] is False
    assert json.loads(runner.invoke(cli, ["failed", "--json"]).output)[0]["address_changed"] is True
    text = runner.invoke(cli, ["failed"]).output
    assert "[address changed since: retry sends it to the new one]" in text and "[permanent:" not in text
    assert "failed for good on the employee's data" not in text
    assert (f"note: 1 of them went to an address the payroll data has changed since: `payrun retry "
            f"{listed[0]['id']}` sends it to the new one") in text
    said = runner.invoke(cli, ["retry", "--all", "--error", "invalid recipient"]).output
    assert said.startswith("requeued 1 job(s)\n") and "had failed on the employee's data" not in said
    assert "note: 1 of them had an address refused that the payroll data has changed since: it goes to the new one" in said
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    ledger_mod.drain(conn, ledger)
    assert provider.delivery(f"slip:{MONTH}:emp-00002")["to"] == "fixed@payroll.example"
    job = ledger.job(listed[0]["id"])
    assert job["status"] == "done" and [h["outcome"] for h in job["history"]] == ["failed", "done"]
    assert json.loads(runner.invoke(cli, ["failed", "--json"]).output) == []


def test_retry_all_sends_a_slip_with_two_dead_letters_once(world, provider):
    """HR walkthrough: the send to a bad address failed, HR's `payrun resend` to the same
    address failed too; once the address was fixed, `retry --all` requeued both and the
    employee got the slip twice. Now only the newest failure of a slip is retried."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    set_email(db, "emp-00002", "nobody@nowhere.invalid")
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    runner = CliRunner()
    assert runner.invoke(cli, ["resend", "--employee", "emp-00002", "--month", MONTH]).exit_code == 0
    work_everything(conn, ledger)
    failed = json.loads(runner.invoke(cli, ["failed", "--json"]).output)
    resend_send = f"email-{MONTH}-emp-00002-resend-1"
    assert [r["id"] for r in failed] == [resend_send, keys.email_job_id(MONTH, "emp-00002")], failed
    set_email(db, "emp-00002", "fixed@payroll.example")
    out = json.loads(runner.invoke(cli, ["retry", "--all", "--json"]).output)
    assert out["requeued"] == [resend_send] and out["left_out_same_slip"] == [keys.email_job_id(MONTH, "emp-00002")]
    work_everything(conn, ledger)
    delivered = [k for k in (f"slip:{MONTH}:emp-00002", f"slip:{MONTH}:emp-00002:resend-1") if provider.delivery(k)]
    assert delivered == [f"slip:{MONTH}:emp-00002:resend-1"]
    assert provider.delivery(delivered[0])["to"] == "fixed@payroll.example"
    # the older dead letter stays listed, as delivered since by the resend: --all leaves it out
    again = json.loads(runner.invoke(cli, ["retry", "--all", "--json"]).output)
    assert again["requeued"] == [] and again["left_out_resent"] == [keys.email_job_id(MONTH, "emp-00002")]


def test_a_fan_out_that_died_half_way_is_resumed_with_only_the_missing_jobs(world):
    cfg, conn, db, ledger = world
    # a fan-out that died after its first 4 jobs of company 1: row still 'fanning-out'
    assert ledger.claim_run(1, MONTH, "dead-owner")
    snaps = [s for s in payroll.snapshots(db, MONTH) if s["company"]["id"] == 1][:4]
    q = make_queue(keys.RENDER_QUEUE, conn)
    for s in snaps:
        q.enqueue_call("jobs.tasks.render_slip", args=(s,), job_id=keys.render_job_id(MONTH, s["employee"]["id"]))
    plain = runs.start_run(cfg, conn, ledger, db, MONTH)
    assert plain.already == [1] and plain.created == {2: payroll.count_employees(db, MONTH, 2)}
    resumed = runs.start_run(cfg, conn, ledger, db, MONTH, resume=True)
    n1 = payroll.count_employees(db, MONTH, 1)
    assert resumed.resumed == [1] and resumed.created[1] == n1 - 4
    ids = q.get_job_ids()
    assert len(ids) == len(set(ids)) == 12  # every employee once
    assert {r["status"] for r in ledger.runs(MONTH)} == {"enqueued"}
    assert runs.start_run(cfg, conn, ledger, db, MONTH, resume=True).jobs == 0


def test_status_defaults_to_the_run_started_last_and_refuses_a_month_or_company_it_does_not_know(world, provider):
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    ledger.claim_run(1, "2026-10", "late")  # last month's run for one company, started after this one
    runner = CliRunner()
    assert json.loads(runner.invoke(cli, ["status", "--json"]).output)["month"] == "2026-10"
    assert json.loads(runner.invoke(cli, ["status", "--json", "--month", MONTH]).output)["total"]["queued"] == 12
    for args, said in ((["--month", "2026-13"], "must look like 2026-11"),
                       (["--month", "2025-01"], "no pay run for 2025-01 (runs: 2026-10, 2026-11): `payrun run --month "
                                             "2025-01` starts it"),
                       (["--month", MONTH, "--company", "999"], "no company 999 in the payroll database")):
        out = runner.invoke(cli, ["status", *args])
        assert out.exit_code == 2 and said in out.output, (args, out.output)


def test_run_and_status_say_why_jobs_will_not_move(world, provider, monkeypatch):
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runner = CliRunner()  # click 8.2: out.stderr is stderr alone
    out = runner.invoke(cli, ["run", "--month", MONTH])
    assert out.exit_code == 0
    assert "note: 12 jobs wait on pdf-render and no pdf-render worker is running" in out.stderr
    status = json.loads(runner.invoke(cli, ["status", "--json"]).output)
    assert status["redis_reachable"] and status["notes"] == [
        "12 jobs wait on pdf-render and no pdf-render worker is running: is `payrun up` running (`payrun ps`)?"]
    runner.invoke(cli, ["drain"], catch_exceptions=False)
    text = runner.invoke(cli, ["status"]).output
    assert "note: intake is drained everywhere (`payrun drain`)" in text and "no pdf-render worker" not in text
    runner.invoke(cli, ["resume"], catch_exceptions=False)
    from redis.exceptions import ConnectionError as RedisDown

    from payrun import status as status_mod

    def gone(conn, **kw):
        raise RedisDown("Redis went away after the first look")

    real = status_mod.intake_notes
    monkeypatch.setattr(status_mod, "intake_notes", gone)
    midway = runner.invoke(cli, ["status", "--json"])
    assert midway.exit_code == 0  # a failed second look reads as unreachable, not a traceback
    assert json.loads(midway.output)["redis_reachable"] is False
    monkeypatch.setattr(status_mod, "intake_notes", real)
    work_everything(conn, ledger)
    assert json.loads(runner.invoke(cli, ["status", "--json"]).output)["notes"] == []  # all sent: nothing to say
    monkeypatch.setenv("PAYRUN_REDIS_URL", "redis://:pw@127.0.0.1:1/0")
    out = runner.invoke(cli, ["status"])
    assert out.exit_code == 0 and "12 sent" in out.output
    assert "(Redis unreachable: figures are the ledger's; stuck jobs and its backlog were not checked)" in out.output


def run_then_write_late_employees(runner, cli, tmp_path):
    """Run MONTH, then write a CSV of two employees of company 1 (emp-90001, emp-90002)
    with salary lines for it: people hired after the run."""
    assert runner.invoke(cli, ["run", "--month", MONTH]).exit_code == 0
    lines = open("docs/sample-employees.csv", encoding="utf-8").read().splitlines()
    late = tmp_path / "late.csv"
    late.write_text("\n".join([lines[0]] + [ln.replace(",2026-11,", f",{MONTH},") for ln in lines[1:3]]) + "\n",
                    encoding="utf-8")
    return late


def test_employees_imported_after_their_month_was_run_get_their_slips_with_resume(world, tmp_path):
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runner = CliRunner()
    late = run_then_write_late_employees(runner, cli, tmp_path)
    out = runner.invoke(cli, ["import", str(late)])
    assert out.exit_code == 0, out.output
    assert f"note: {MONTH} was already run for company 1, before some of these employees" in out.output
    # a file whose employees all have their MONTH slip (or no MONTH line) is not told of the
    # two left behind by another file: the note speaks of "these employees"
    lines = late.read_text(encoding="utf-8").splitlines()
    other = tmp_path / "other-month.csv"
    other.write_text("\n".join([lines[0], lines[1].replace(f",{MONTH},", ",2031-01,")]) + "\n", encoding="utf-8")
    quiet = runner.invoke(cli, ["import", str(other)])
    assert quiet.exit_code == 0 and "was already run" not in quiet.output, quiet.output
    hr = json.loads(runner.invoke(cli, ["status", "--json"]).stdout)  # HR must not read "all done"
    assert hr["total"]["no_slip"] == 2 and hr["companies"][0]["no_slip"] == 2
    assert any(n.startswith(f"2 employees of company 1 have salary lines for {MONTH} and no slip")
               for n in hr["notes"])
    text = runner.invoke(cli, ["status"]).stdout
    assert "2 with no slip yet" in text
    head, first = text.splitlines()[1:3]
    assert head.endswith(" no slip") and first.endswith(" 2")  # company 1's row says who
    assert f"payrun run --month {MONTH} --resume" in out.output
    plain = runner.invoke(cli, ["run", "--month", MONTH])
    assert "already run" in plain.output and "render jobs" not in plain.output  # run alone stays once-only
    assert f"note: company 1 has employees added since {MONTH} was run, with no slip" in plain.output
    resumed = runner.invoke(cli, ["run", "--month", MONTH, "--resume", "--json"])
    data = json.loads(resumed.stdout)
    assert data["jobs_created"] == 2 and data["companies_added_to"] == [1]
    q = make_queue(keys.RENDER_QUEUE, conn)
    assert {keys.render_job_id(MONTH, "emp-90001"), keys.render_job_id(MONTH, "emp-90002")} <= set(q.get_job_ids())
    assert len(q.get_job_ids()) == 14
    assert data["companies_created"] == []  # topped up, not run afresh
    again = json.loads(runner.invoke(cli, ["run", "--month", MONTH, "--resume", "--json"]).stdout)
    assert again["jobs_created"] == 0 and again["companies_added_to"] == []
    assert "already run" not in runner.invoke(cli, ["import", str(late)]).output  # nothing behind now
    assert {r["jobs"] for r in ledger.runs(MONTH) if r["company_id"] == 1} == {payroll.count_employees(db, MONTH, 1)}


def test_resume_gives_no_second_slip_to_an_employee_resent_by_hand(world, tmp_path):
    """The old way to reach a late employee was `payrun resend` (its own job id and key): a
    later `run --resume` must not make them a second slip. (Since session 25 `resend`
    refuses a slip no run made and names `--resume`; a ledger can still hold such a
    resend from before.)"""
    from click.testing import CliRunner

    from payrun.cli import cli
    from scheduler.cli import resend

    cfg, conn, db, ledger = world
    runner = CliRunner()
    late = run_then_write_late_employees(runner, cli, tmp_path)
    assert runner.invoke(cli, ["import", str(late)]).exit_code == 0
    refused = runner.invoke(cli, ["resend", "--employee", "emp-90001", "--month", MONTH])
    assert refused.exit_code == 2 and (f"emp-90001 has no {MONTH} slip to send again: company 1's {MONTH} run was "
                                       f"made before this employee was added; `payrun run --month {MONTH} --company 1 "
                                       "--resume` makes the slip") in refused.output, refused.output
    # as an older payrun let it through
    ledger.has_slip_job = lambda *a: True
    resend(cfg, conn, ledger, db, "emp-90001", MONTH)
    del ledger.has_slip_job
    data = json.loads(runner.invoke(cli, ["run", "--month", MONTH, "--resume", "--json"]).stdout)
    assert data["jobs_created"] == 1 and data["companies_added_to"] == [1]
    ids = make_queue(keys.RENDER_QUEUE, conn).get_job_ids()
    assert keys.render_job_id(MONTH, "emp-90002") in ids and keys.render_job_id(MONTH, "emp-90001") not in ids


def test_a_resend_that_nothing_will_take_says_so(world):
    """Ops walkthrough: a resend queued while no worker ran was reported nowhere (status
    looked at workers only while the run's slips were in progress)."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)  # the run is over; the workers stopped (burst)
    out = CliRunner().invoke(cli, ["resend", "--employee", "emp-00003", "--month", MONTH])
    assert out.exit_code == 0 and f"its send: email-{MONTH}-emp-00003-resend-1)" in out.output
    assert "note: 1 job waits on pdf-render and no pdf-render worker is running" in out.output, out.output
    notes = json.loads(CliRunner().invoke(cli, ["status", "--json"]).output)["notes"]
    assert any("waits on pdf-render and no pdf-render worker is running" in n for n in notes), notes


def test_a_resend_of_a_month_never_run_is_refused(world):
    """HR walkthrough: a resend before the month's run went out, `status` did not count
    it, and the run then sent the slip a second time."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    out = CliRunner().invoke(cli, ["resend", "--employee", "emp-00005", "--month", MONTH])
    assert out.exit_code == 2, out.output
    company = payroll.employee_snapshot(db, MONTH, "emp-00005")["company"]["id"]
    assert (f"emp-00005 has no {MONTH} slip to send again: {MONTH} has not been run for company {company}; "
            f"`payrun run --month {MONTH} --company {company}` makes and sends it") in out.output
    assert make_queue(keys.RENDER_QUEUE, conn).count == 0 and ledger.jobs() == []


def test_a_resend_of_a_leaver_the_run_left_out_says_why_and_how(world):
    """HR walkthrough (session 41): a late run left out an employee marked left; their
    resend said the run "was made before this employee was added" and that `run --resume`
    makes the slip, which leaves them out again. It says they are marked left now, and the
    steps that make their slip."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runner = CliRunner()
    assert runner.invoke(cli, ["employee", "left", "emp-00005", "--on", "2026-10-31"]).exit_code == 0
    runs.start_run(cfg, conn, ledger, db, MONTH)
    company = payroll.employee_snapshot(db, MONTH, "emp-00005")["company"]["id"]
    out = runner.invoke(cli, ["resend", "--employee", "emp-00005", "--month", MONTH])
    assert out.exit_code == 2, out.output
    assert (f"emp-00005 has no {MONTH} slip to send again: they are marked as left (`payrun employee left`; "
            f"left 2026-10-31), before {MONTH} or on a day not recorded, so company {company}'s {MONTH} run left "
            f"them out; worked in {MONTH}: `payrun employee left emp-00005 --on DATE` (the day they left, "
            f"{MONTH}-01 or later), then `payrun run --month {MONTH} --company {company} --resume`") in out.output, \
        out.output
    assert "added" not in out.output
    assert payroll.is_active(db, "emp-00005") is False and payroll.is_active(db, "emp-99999") is None


def test_status_warns_of_a_ledger_backlog_only_when_it_is_old(world):
    from payrun import status as status_mod

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    conn.xadd(keys.EVENTS_STREAM, {"job": "render-x", "status": "running", "ts": "2026-11-01T00:00:00.000+00:00"})
    fresh = status_mod.report(cfg, ledger, conn=conn)
    assert fresh["ledger_backlog"] == 1 and fresh["ledger_backlog_age_s"] < 10
    assert "updates behind" not in status_mod.format_report(fresh)  # a pay run's normal few
    conn.delete(keys.EVENTS_STREAM)
    conn.xadd(keys.EVENTS_STREAM, {"job": "render-x", "status": "running", "ts": "x"}, id="1000-0")
    stale = status_mod.report(cfg, ledger, conn=conn)
    assert stale["ledger_backlog_age_s"] > 3600
    assert "(ledger is 1 updates behind, the oldest from" in status_mod.format_report(stale)
    # many months run: the header says it shows only the latest others
    many = stale | {"months": [f"2026-{m:02d}" for m in range(1, 12)]}
    head = status_mod.format_report(many).splitlines()[0]
    assert "(other runs: …, 2026-05, 2026-06" in head and "--json lists all 10" in head, head
    assert "…" not in status_mod.format_report(stale | {"months": ["2026-10", MONTH]}).splitlines()[0]


def set_name(db, employee_id: str, name: str) -> None:
    db.conn.execute("UPDATE employees SET name_en = ? WHERE id = ?", (name, employee_id))
    db.conn.commit()


def test_a_render_that_failed_on_bad_data_is_retried_with_the_data_fixed_since(world, provider):
    """The render's error says to fix the payroll data, and `payrun failed` says to retry:
    the retried render reads the fixed data (it used to render its old snapshot again and
    fail the same way). A retry naming an unknown id as well requeues nothing."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    set_name(db, "emp-00003", "A" * 81)  # the slip allows 80
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    runner = CliRunner()
    failed = json.loads(runner.invoke(cli, ["failed", "--json"]).output)
    render_id = keys.render_job_id(MONTH, "emp-00003")
    assert [r["id"] for r in failed] == [render_id] and "payroll data" in failed[0]["error"]
    mixed = runner.invoke(cli, ["retry", render_id, "no-such-job"])
    assert mixed.exit_code == 2 and "no-such-job" in mixed.output and "nothing was requeued" in mixed.output
    assert [r["id"] for r in json.loads(runner.invoke(cli, ["failed", "--json"]).output)] == [render_id]
    set_name(db, "emp-00003", "Ayesha Siddiqua")
    out = runner.invoke(cli, ["retry", "--all", "--json"])
    assert json.loads(out.output)["requeued"] == [render_id]
    work_everything(conn, ledger)
    ledger_mod.drain(conn, ledger)
    assert json.loads(runner.invoke(cli, ["failed", "--json"]).output) == []
    assert provider.delivery(f"slip:{MONTH}:emp-00003")["to"]
    text = pypdf.PdfReader(next(cfg.slips_dir.glob(f"{MONTH}/*/emp-00003.pdf"))).pages[0].extract_text()
    assert "Ayesha Siddiqua" in text
    assert sum(c["done"] for c in ledger.slip_counts(MONTH).values()) == 12


def test_a_retried_render_of_an_employee_who_moved_company_keeps_the_company_of_its_month(world, provider):
    """The employee moved to another company after the month was run: the retried render
    reads the fixed name, but the slip stays the one of the company that paid that month,
    and the ledger keeps counting it there (it used to print the new company's name on a
    slip the old company's row counted)."""
    cfg, conn, db, ledger = world
    set_name(db, "emp-00003", "A" * 81)
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    render_id = keys.render_job_id(MONTH, "emp-00003")
    ledger_mod.drain(conn, ledger)
    company = ledger.job(render_id)["company_id"]
    names = dict(db.conn.execute("SELECT id, name FROM companies"))
    other = next(c for c in names if c != company)
    set_name(db, "emp-00003", "Ayesha Siddiqua")
    db.conn.execute("UPDATE employees SET company_id = ? WHERE id = ?", (other, "emp-00003"))
    db.conn.commit()
    assert deadletters.retry(cfg, conn, [render_id], payroll_db=db) == ([render_id], [])
    work_everything(conn, ledger)
    ledger_mod.drain(conn, ledger)
    pdf = cfg.slips_dir / MONTH / str(company) / "emp-00003.pdf"
    text = pypdf.PdfReader(pdf).pages[0].extract_text()
    assert "Ayesha Siddiqua" in text and names[company] in text and names[other] not in text
    assert not list(cfg.slips_dir.glob(f"{MONTH}/{other}/emp-00003.pdf"))
    assert ledger.job(render_id)["company_id"] == company
    assert ledger.slip_counts(MONTH)[company]["done"] == ledger.slip_counts(MONTH)[company]["total"]


def test_a_failed_slip_that_a_resend_delivered_counts_as_sent(world, provider):
    """HR fixed the data and pressed "send again" (`payrun resend`) for a slip whose render
    had failed: the employee has the slip, so `payrun status` counts it as sent, `payrun
    failed` says so beside the failed job, and `retry --all` leaves it out."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    set_name(db, "emp-00005", "B" * 81)
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    ledger_mod.drain(conn, ledger)
    company = ledger.job(keys.render_job_id(MONTH, "emp-00005"))["company_id"]
    assert ledger.slip_counts(MONTH)[company]["failed"] == 1
    set_name(db, "emp-00005", "Bokul Ahmed")
    runner = CliRunner()
    assert runner.invoke(cli, ["resend", "--employee", "emp-00005", "--month", MONTH]).exit_code == 0
    from console import actions

    entry = actions.read_audit(cfg)[-1]  # an action that emails an employee is audited
    assert entry["what"] == "resend" and entry["command"] == f"payrun resend --employee emp-00005 --month {MONTH}"
    work_everything(conn, ledger)
    ledger_mod.drain(conn, ledger)
    assert provider.delivery(f"slip:{MONTH}:emp-00005:resend-1")
    from jobs.oneoff import resend_email_job_id

    resend_send = resend_email_job_id(MONTH, "emp-00005", 1)  # the ledger keeps the address a resend went to
    address = db.conn.execute("SELECT email FROM employees WHERE id = 'emp-00005'").fetchone()[0]
    assert ledger.recipients([resend_send]) == {resend_send: address}
    counts = ledger.slip_counts(MONTH)[company]
    assert counts["failed"] == 0 and counts["done"] == counts["total"]
    listed = runner.invoke(cli, ["failed"]).output
    assert "[slip delivered by a resend]" in listed and "1 of them delivered by a `payrun resend`" in listed
    assert "nothing left to retry: every one of these slips was delivered by a resend" in listed
    name = db.conn.execute("SELECT name_en FROM employees WHERE id = 'emp-00005'").fetchone()[0]
    assert f"(emp-00005 {name}, company {company})" in listed  # who, not only which job
    assert json.loads(runner.invoke(cli, ["failed", "--json"]).output)[0]["delivered_by_resend"] is True
    out = runner.invoke(cli, ["retry", "--all", "--json"])
    render_id = keys.render_job_id(MONTH, "emp-00005")
    assert json.loads(out.output) == {"requeued": [], "not_found": [], "left_out_resent": [render_id],
                                      "left_out_same_slip": [], "rendered_again": [], "not_requeued": []}
    assert "left out 1 whose slip a `payrun resend` delivered since" in runner.invoke(cli, ["retry", "--all"]).output
    # the console's "retry all matching" acts on the same set
    from console.failed import FailedFilter, matching_ids

    assert matching_ids(conn, ledger, FailedFilter()) == []


def test_a_reminder_refused_for_its_address_is_retried_to_the_fixed_one(world, provider):
    """HR walkthrough (session 41): a reminder failed on a refused address; HR imported the
    fix and `payrun retry --all` said "it goes to the new one", but the reminder went to the
    refused address again (only a slip's send read the address again)."""
    from click.testing import CliRunner

    from payrun.cli import cli
    from tests.conftest import enqueue_due

    cfg, conn, db, ledger = world
    set_email(db, "emp-00002", "nobody@nowhere.invalid")
    runner = CliRunner()
    out = runner.invoke(cli, ["remind", "--company", "1", "--in", "now", "--json"])
    assert out.exit_code == 0, out.output
    q = make_queue(keys.EMAIL_QUEUE, conn)
    due = {j: 0 for j in q.scheduled_job_registry.get_job_ids()}
    assert due
    conn.zrem(q.scheduled_job_registry.key, *due)
    enqueue_due(conn, q, due)
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    ledger_mod.drain(conn, ledger)
    failed = json.loads(runner.invoke(cli, ["failed", "--json"]).output)
    assert [r["id"] for r in failed] == [f"remind-{json.loads(out.output)['batch']}-emp-00002"], failed
    set_email(db, "emp-00002", "fixed@payroll.example")
    out = runner.invoke(cli, ["retry", "--all"])
    assert out.exit_code == 0 and "it goes to the new one" in out.output, out.output
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    ledger_mod.drain(conn, ledger)
    assert json.loads(runner.invoke(cli, ["failed", "--json"]).output) == []
    assert provider.stats()["rejected"] == 1


def test_reminders_are_audited(world):
    from click.testing import CliRunner

    from console import actions
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    out = CliRunner().invoke(cli, ["remind", "--company", "1", "--in", "2h", "--message", "Check your bank details"])
    assert out.exit_code == 0, out.output
    entry = actions.read_audit(cfg)[-1]
    assert entry["what"] == "remind" and entry["count"] == payroll.count_employees(db, MONTH, 1)
    assert entry["command"] == "payrun remind --company 1 --in 2h --message 'Check your bank details'"


def test_a_reminder_batch_can_be_cancelled_before_it_is_due(world):
    """HR scheduled a reminder with the wrong text: `payrun remind --cancel BATCH` takes
    back every reminder not yet due (job, schedule and ledger row), audited; reminders due
    within seconds are left to go out, and the command says so."""
    import time

    from click.testing import CliRunner
    from rq.registry import ScheduledJobRegistry

    from jobs.runtime import make_queue
    from payrun import audit
    from payrun.cli import cli
    from scheduler.cli import cancel_reminders

    cfg, conn, db, ledger = world
    runner = CliRunner()
    first = json.loads(runner.invoke(cli, ["remind", "--company", "1", "--in", "2h", "--json"]).output)
    other = json.loads(runner.invoke(cli, ["remind", "--company", "2", "--in", "3h", "--json"]).output)
    registry = ScheduledJobRegistry(queue=make_queue(keys.EMAIL_QUEUE, conn))
    n = first["scheduled"]
    assert n == payroll.count_employees(db, MONTH, 1) and len(ledger.reminder_ids(first["batch"])) == n

    # due in an hour, but as seen an hour later: all due, nothing taken back
    assert cancel_reminders(cfg, conn, ledger, first["batch"], now=time.time() + 7200)["cancelled"] == 0

    out = runner.invoke(cli, ["remind", "--cancel", first["batch"], "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {"batch": first["batch"], "cancelled": n, "already_due": 0,
                                      "jobs": sorted(first["jobs"])}
    assert set(registry.get_job_ids()) == set(other["jobs"])  # the other batch is untouched
    assert not any(conn.exists(f"rq:job:{j}") for j in first["jobs"])
    assert not any(conn.zscore(keys.delayed(keys.EMAIL_QUEUE), j) for j in first["jobs"])
    assert ledger.reminder_ids(first["batch"]) == [] and len(ledger.reminder_ids(other["batch"])) > 0
    entry = audit.read_audit(cfg)[-1]
    assert (entry["what"], entry["count"], entry["command"]) == (
        "remind-cancel", n, f"payrun remind --cancel {first['batch']}")

    again = runner.invoke(cli, ["remind", "--cancel", first["batch"]])
    assert again.exit_code == 2 and "cancelled already" in again.output
    soon = json.loads(runner.invoke(cli, ["remind", "--company", "1", "--in", "2s", "--json"]).output)
    out = runner.invoke(cli, ["remind", "--cancel", soon["batch"]])
    assert out.exit_code == 0 and "cancelled 0 reminder(s)" in out.output
    assert f"{soon['scheduled']} already due" in out.output
    assert set(soon["jobs"]) <= set(registry.get_job_ids())
    for args, says in ((["--cancel", "yesterday"], "a batch looks like"),
                       (["--cancel", other["batch"], "--company", "2"], "takes no --company"),
                       (["--company", "1"], "needs --company and --in")):
        bad = runner.invoke(cli, ["remind", *args])
        assert bad.exit_code == 2 and says in bad.output, (args, bad.output)


def test_a_second_reminder_batch_for_the_same_company_and_second_is_refused(world, monkeypatch):
    """Batches are named by company and due second. A second `remind` landing on the same
    second used to reuse the first one's job ids: its text silently replaced the first's
    (or, once sent, it was skipped as a duplicate) while it reported N scheduled. Now it
    is refused and writes nothing; a cancelled batch can be scheduled again. Cancelling
    works in chunks (one script call per chunk) and takes back every reminder."""
    from datetime import datetime, timedelta, timezone

    import scheduler.cli as scli
    from payrun.errors import InputError

    cfg, conn, db, ledger = world
    now = datetime.now(timezone.utc).replace(microsecond=400000)  # +300 ms stays in the same second
    first = scli.remind(cfg, conn, ledger, db, 1, timedelta(hours=2), "first text", now=now)
    job0 = first["jobs"][0]
    text0 = conn.hget(f"rq:job:{job0}", "data")
    rows0 = ledger.db.conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
    with pytest.raises(InputError, match=f"batch {first['batch']} is already scheduled"):
        scli.remind(cfg, conn, ledger, db, 1, timedelta(hours=2), "second text", now=now + timedelta(milliseconds=300))
    assert conn.hget(f"rq:job:{job0}", "data") == text0
    assert ledger.db.conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == rows0
    # another company, or the next second, is another batch
    assert scli.remind(cfg, conn, ledger, db, 2, timedelta(hours=2), None, now=now)["batch"] != first["batch"]
    assert scli.remind(cfg, conn, ledger, db, 1, timedelta(hours=2), None,
                       now=now + timedelta(seconds=1))["batch"] != first["batch"]

    monkeypatch.setattr(scli, "CANCEL_CHUNK", 3)
    n = first["scheduled"]
    assert n > 3
    out = scli.cancel_reminders(cfg, conn, ledger, first["batch"])
    assert (out["cancelled"], out["already_due"], sorted(out["jobs"])) == (n, 0, sorted(first["jobs"]))
    again = scli.remind(cfg, conn, ledger, db, 1, timedelta(hours=2), "second text", now=now)
    assert again["batch"] == first["batch"] and again["scheduled"] == n


def test_status_counts_a_company_that_was_never_run(world):
    """A company imported after the run (or left out by `run --company`) has salary lines
    and no slip: HR's "did everyone get their slip?" must not answer yes. It used to be
    missing from `payrun status`, and `status --company` said it had no slips."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)
    n2 = payroll.count_employees(db, MONTH, 2)
    runner = CliRunner()
    data = json.loads(runner.invoke(cli, ["status", "--json"]).output)
    assert data["total"]["no_slip"] == n2
    row = next(c for c in data["companies"] if c["id"] == 2)
    assert row["total"] == 0 and row["no_slip"] == n2
    assert f"company 2 ({n2} employees) has salary lines for {MONTH} and was never run: " \
           f"payrun run --month {MONTH} --company 2" in data["notes"]
    one = runner.invoke(cli, ["status", "--company", "2"])
    assert one.exit_code == 0 and "never run" in one.output
    assert "no slip" in runner.invoke(cli, ["status"]).output


def test_down_says_a_run_was_in_progress(world):
    """Ops walkthrough: `payrun down` mid-run printed only "Shut down"."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    ledger_mod.drain(conn, ledger)
    out = CliRunner().invoke(cli, ["down"])
    assert out.exit_code == 0, out.output
    assert (f"the {MONTH} pay run was in progress: at most 12 slips not sent yet wait in Redis (counted as the "
            "stop began: sends in hand finished meanwhile); `payrun up` goes on with them") in out.output, out.output


def test_a_slip_of_a_month_already_run_keeps_its_companys_name_after_a_rename(world, provider, tmp_path):
    """A company renamed after its month was run (HR walkthrough: a resend of November
    printed the new name): the import says that slips of months already run keep the old
    name, a resend of November prints it, and December's run prints the new one."""
    from click.testing import CliRunner

    from payrun import payroll
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    company = ledger.job(keys.render_job_id(MONTH, "emp-00004"))["company_id"]
    old = {c["id"]: c for c in payroll.companies(db)}[company]
    companies_csv = tmp_path / "companies.csv"
    companies_csv.write_text("id,name,address\n" + f'{company},Renamed Holdings PLC,"Plot 9, Tejgaon, Dhaka 1208"\n',
                             encoding="utf-8")
    runner = CliRunner()
    out = runner.invoke(cli, ["import", "--companies", str(companies_csv)])
    assert out.exit_code == 0, out.output
    assert f"name or address replaced for company {company}" in out.output
    assert f"slips of months already run ({MONTH}) keep the name and address they were run with" in out.output
    assert runner.invoke(cli, ["resend", "--employee", "emp-00004", "--month", MONTH]).exit_code == 0
    work_everything(conn, ledger)
    text = pypdf.PdfReader(cfg.slips_dir / oneoff.resend_path(MONTH, company, "emp-00004", 1)).pages[0].extract_text()
    assert old["name"] in text and "Renamed Holdings" not in text and "Re-issued on" in text
    # a month run after the rename prints the new name; November's stays
    december = "2026-12"
    assert payroll.ensure_month(db, december) > 0
    runs.start_run(cfg, conn, ledger, db, december)
    work_everything(conn, ledger)
    text = pypdf.PdfReader(next(cfg.slips_dir.glob(f"{december}/*/emp-00004.pdf"))).pages[0].extract_text()
    assert "Renamed Holdings PLC" in text and old["name"] not in text
    assert payroll.employee_snapshot(db, MONTH, "emp-00004")["company"] == old
    assert payroll.employee_snapshot(db, december, "emp-00004")["company"]["name"] == "Renamed Holdings PLC"


def test_a_typo_in_a_companys_name_kept_for_a_month_already_run_is_corrected_by_importing_with_that_month(
        world, provider, tmp_path):
    """The name kept for a month could not be corrected (a typo stayed on that month's
    resends): `payrun import --companies FILE --month M` replaces it too, and says so; a
    --month without --companies or a bad month is refused with nothing imported."""
    from click.testing import CliRunner

    from payrun import payroll
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    company = ledger.job(keys.render_job_id(MONTH, "emp-00004"))["company_id"]
    old = {c["id"]: c for c in payroll.companies(db)}[company]
    fixed = tmp_path / "companies.csv"
    fixed.write_text(f'id,name,address\n{company},Meghna Textlies Ltd,"{old["address"]}"\n', encoding="utf-8")
    runner = CliRunner()
    refused = runner.invoke(cli, ["import", str(fixed), "--month", MONTH])
    assert refused.exit_code == 2 and "--month goes with --companies" in refused.output
    refused = runner.invoke(cli, ["import", "--companies", str(fixed), "--month", "2026-13"])
    assert refused.exit_code == 2 and "no month 13" in refused.output, refused.output
    assert {c["id"]: c for c in payroll.companies(db)}[company] == old  # nothing imported

    out = runner.invoke(cli, ["import", "--companies", str(fixed), "--month", MONTH, "--month", "2026-10"])
    assert out.exit_code == 0, out.output
    assert f"{MONTH}: corrected the name and address kept for company {company}" in out.output
    assert f"2026-10: nothing to correct: no pay run of 2026-10 keeps company details (months run: {MONTH})" \
        in out.output  # (a typo'd month read like a month run with nothing to fix)
    assert "keep the name and address they were run with" not in out.output  # (November's is corrected)
    assert payroll.employee_snapshot(db, MONTH, "emp-00004")["company"]["name"] == "Meghna Textlies Ltd"
    assert runner.invoke(cli, ["resend", "--employee", "emp-00004", "--month", MONTH]).exit_code == 0
    work_everything(conn, ledger)
    text = pypdf.PdfReader(cfg.slips_dir / oneoff.resend_path(MONTH, company, "emp-00004", 1)).pages[0].extract_text()
    assert "Meghna Textlies Ltd" in text and old["name"] not in text



def redis_away_at_first_record(monkeypatch, key: str) -> None:
    """The first record of ``key``'s send finds Redis away, and its job has no time left to
    wait: the send is delivered and not recorded (a note is left on the host)."""
    import redis as redis_mod

    from jobs import idempotency, tasks

    real = idempotency.mark_sent
    away_for = {key}

    def redis_away_once(conn_, key_, owner, message_id, outage_keys=None):
        if key_ in away_for:
            away_for.discard(key_)
            raise redis_mod.ConnectionError("Error 111 connecting to redis.sock (test: Redis away)")
        return real(conn_, key_, owner, message_id, outage_keys=outage_keys)

    monkeypatch.setattr(idempotency, "mark_sent", redis_away_once)
    monkeypatch.setattr(tasks, "record_retry_wait_s", lambda tries, left: None)  # its timeout reached at once


def test_a_send_delivered_while_redis_could_not_record_it_is_recorded_at_its_next_try_not_sent_again(
        world, provider, monkeypatch, caplog):
    """On-call drill: Redis away for 30 s; 13 of 600 sends the provider had accepted could
    not be recorded before their timeout, and their next try sent them again (over SMTP, a
    second email). The give-up now leaves a note on this host, and the next try records
    the send from it and sends nothing."""
    import logging

    from conftest import enqueue_due
    from jobs import idempotency, tasks, unrecorded

    cfg, conn, db, ledger = world
    key = f"slip:{MONTH}:emp-00002"
    redis_away_at_first_record(monkeypatch, key)
    # (the send-email process records notes at its start and every few seconds: here its
    # next try comes first; the next test has the process record it)
    monkeypatch.setattr(tasks, "record_noted", lambda conn_, home: 0)
    runs.start_run(cfg, conn, ledger, db, MONTH)
    with caplog.at_level(logging.WARNING, logger="payrun.jobs"):
        work_everything(conn, ledger)
        assert unrecorded.find(cfg.home, key)  # noted: delivered, not recorded
        notes = status.report(cfg, ledger, MONTH, conn=conn)["notes"]
        assert any(n.startswith(f"1 slip delivered while Redis could not record it ({key})") for n in notes), notes
        queue = make_queue(keys.EMAIL_QUEUE, conn)
        scheduled = queue.scheduled_job_registry
        job_id = keys.email_job_id(MONTH, "emp-00002")
        assert scheduled.get_job_ids() == [job_id]  # its retry
        enqueue_due(conn, queue, {job_id: 0})  # its backoff over
        conn.delete(keys.idem_state(key))  # (the first try's claim lapsed meanwhile)
        run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    ledger_mod.drain(conn, ledger)
    stats = provider.stats()
    assert stats["received"] == 12 and stats["delivered"] == 12  # no second request for emp-00002
    assert idempotency.state(conn, key)["state"] == "sent"
    assert "recorded now, not sent again" in caplog.text
    assert unrecorded.find(cfg.home, key) is None and not (cfg.home / unrecorded.FILE).exists()
    assert ledger.job(job_id)["status"] == "done"


def test_a_delivery_noted_on_one_host_is_recorded_by_its_send_email_process_and_sent_by_no_host_again(
        world, provider, monkeypatch, tmp_path, caplog):
    """The note of a delivery Redis could not record lives on its host's disk: a next try
    on another host, without it, used to send the slip again (over SMTP a second email).
    The host's send-email process now records its notes in Redis when it starts (it exits
    when Redis fails under it, and supervisord starts it again) and every few seconds:
    then the try on another host finds the key sent."""
    import logging

    from conftest import enqueue_due
    from jobs import idempotency, tasks, unrecorded

    cfg, conn, db, ledger = world
    key = f"slip:{MONTH}:emp-00002"
    redis_away_at_first_record(monkeypatch, key)
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    noted = [e["message_id"] for e in unrecorded.pending(cfg.home)]  # (unless recorded in the run already)
    assert noted or idempotency.state(conn, key)["owner"].startswith("noted on ")
    conn.delete(keys.idem_state(key)) if noted else None  # (the failed try's claim lapsed meanwhile)
    queue = make_queue(keys.EMAIL_QUEUE, conn)
    job_id = keys.email_job_id(MONTH, "emp-00002")
    assert queue.scheduled_job_registry.get_job_ids() == [job_id]  # its retry, on whichever host takes it
    conn.zadd(queue.scheduled_job_registry.key, {job_id: time.time() + 3600})  # (not due while this host starts)
    with caplog.at_level(logging.WARNING, logger="payrun.jobs"):
        run_lanes(conn, [keys.EMAIL_QUEUE], lanes=1, burst=True)  # this host's sender starts again
    assert not (cfg.home / unrecorded.FILE).exists()
    state = idempotency.state(conn, key)
    assert state["state"] == "sent" and state["owner"].startswith("noted on ")
    if noted:
        assert state["message_id"] == noted[0]
        assert f"recorded 1 delivery noted while Redis could not record it ({key})" in caplog.text

    other_home = tmp_path / "other-host"  # the retry runs on another host: no note there
    other_home.mkdir()
    monkeypatch.setenv("PAYRUN_HOME", str(other_home))
    tasks.settings.cache_clear()
    enqueue_due(conn, queue, {job_id: 0})
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    ledger_mod.drain(conn, ledger)
    stats = provider.stats()
    assert stats["received"] == 12 and stats["delivered"] == 12  # no second request for emp-00002
    assert ledger.job(job_id)["status"] == "done"


def test_a_reminder_whose_pdf_cannot_be_rendered_gives_its_claim_back(world, provider, monkeypatch):
    """Review (session 35): the release on a failed reminder PDF (session 35's fix) had no
    test. Kept, the claim held the retry off for ~90 s as if another attempt were sending."""
    from click.testing import CliRunner

    from conftest import enqueue_due
    from jobs import idempotency
    from jobs.runtime import PayrunJob
    from payrun.cli import cli

    cfg, conn, db, ledger = world
    res = json.loads(CliRunner().invoke(cli, ["remind", "--company", "1", "--in", "2h", "--json"]).output)
    job_id = res["jobs"][0]
    key = PayrunJob.fetch(job_id, connection=conn).args[0]["key"]

    def broken(subject, text):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(oneoff, "notice_pdf", broken)
    queue = make_queue(keys.EMAIL_QUEUE, conn)
    enqueue_due(conn, queue, {job_id: 0})
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=1, burst=True)
    job = PayrunJob.fetch(job_id, connection=conn)
    assert "Input/output error" in job.meta["last_error"]
    assert provider.stats()["received"] == 0
    assert not idempotency.state(conn, key).get("owner")  # its claim (taken first) given back: the retry may send


def test_status_notes_jobs_held_by_gone_workers_and_names_the_reaper(world):
    """Ops drill: with the reaper stopped, a killed sender's 33 jobs stayed held for 4
    minutes; `payrun status` counted them stuck and said nothing of why or what to do."""
    cfg, conn, db, ledger = world
    runs.start_run(cfg, conn, ledger, db, "2026-11")
    assert not any("held by workers that are gone" in n
                   for n in status.report(cfg, ledger, "2026-11", None, conn=conn)["notes"])
    q = make_queue(keys.RENDER_QUEUE, conn)
    job_id = q.get_job_ids()[0]
    conn.lrem(q.key, 0, job_id)  # taken by a worker since killed: its lease lapsed a while ago
    conn.zadd(f"rq:wip:{keys.RENDER_QUEUE}", {f"{job_id}:e1": time.time() - 30})
    conn.hset(f"rq:job:{job_id}", mapping={"worker_name": "render.gone.1", "status": "started"})
    notes = status.report(cfg, ledger, "2026-11", None, conn=conn)["notes"]
    assert any(n.startswith("1 job is held by workers that are gone") and "`payrun reap`" in n for n in notes), notes


def test_status_names_an_active_employee_with_no_salary_line_for_the_month(world):
    """An HR drill: an employee whose salary line never came got no slip, and status said
    "299 sent, 0 failed" (the console: "all delivered"). Status names them, and leaves
    out those marked left."""
    from click.testing import CliRunner

    from payrun.cli import cli

    cfg, conn, db, ledger = world
    victim = sorted(payroll.employee_ids(db, MONTH))[0]
    db.conn.execute("DELETE FROM salary_lines WHERE employee_id = ? AND month = ?", (victim, MONTH))
    db.conn.commit()
    runner = CliRunner()
    ran = runner.invoke(cli, ["run", "--month", MONTH])
    assert ran.exit_code == 0
    # the run itself says so, not only status afterwards
    assert "1 employee of company" in ran.stderr and f"has no salary line for {MONTH}: no slip is made " \
        f"for them: {victim}" in ran.stderr, ran.stderr
    hr = json.loads(runner.invoke(cli, ["status", "--json"]).stdout)
    assert hr["total"]["total"] == 11 and hr["total"]["no_salary_line"] == 1
    assert hr["no_salary_line"] == [victim]
    assert any(f"no salary line for {MONTH}, so no slip was made: {victim}" in n for n in hr["notes"])
    assert "1 with no salary line" in runner.invoke(cli, ["status"]).stdout
    other = sorted(payroll.employee_ids(db, MONTH))[0]  # a line removed after its slip was made
    db.conn.execute("DELETE FROM salary_lines WHERE employee_id = ? AND month = ?", (other, MONTH))
    db.conn.commit()
    assert json.loads(runner.invoke(cli, ["status", "--json"]).stdout)["no_salary_line"] == [victim]
    # next month's hire, imported before next month's run, is not missing from this month
    db.conn.execute("INSERT INTO employees (id, company_id, name_en, name_bn, email, department, designation, "
                    "bank_account) SELECT 'emp-99999', company_id, name_en, name_bn, 'new.hire@example.com', "
                    "department, designation, bank_account FROM employees WHERE id = ?", (other,))
    db.conn.execute("INSERT INTO salary_lines (employee_id, month, basic, house_rent, medical, conveyance, bonus, tax, "
                    "provident_fund, loan, company_id) SELECT 'emp-99999', '2031-01', basic, house_rent, medical, conveyance, "
                    "bonus, tax, provident_fund, loan, company_id FROM salary_lines WHERE employee_id = ? AND month = ?",
                    (sorted(payroll.employee_ids(db, MONTH))[-1], MONTH))
    db.conn.commit()
    hr = json.loads(runner.invoke(cli, ["status", "--json"]).stdout)
    assert hr["no_salary_line"] == [victim], hr["notes"]
    assert runner.invoke(cli, ["employee", "left", victim, "--on", "2026-10-31"]).exit_code == 0  # gone before
    hr = json.loads(runner.invoke(cli, ["status", "--json"]).stdout)
    assert hr["total"]["no_salary_line"] == 0 and hr["no_salary_line"] == []
    assert not any("no salary line" in n for n in hr["notes"])


def test_status_rows_of_a_bengali_company_line_up_in_a_terminal():
    """HR walkthrough (session 41): `payrun status` padded company names by characters; a
    Bengali name's virama takes no column, so its row's figures stood two columns left of
    the header's in a terminal. Rows are padded (and cut) by the columns a terminal draws."""
    from payrun.columns import columns
    from payrun import status as status_mod

    row = {"queued": 0, "running": 0, "retrying": 0, "failed": 0, "stuck": 0, "done": 149}
    names = ["Sundarban Steel Mills Ltd.", "পদ্মা টেক্সটাইল লিমিটেড",
             "মেঘনা ইস্পাত ও প্রকৌশল লিমিটেড, চট্টগ্রাম শাখা"]  # the last one is cut
    report = {"month": MONTH, "months": [MONTH], "total": dict(row, done=447, total=447),
              "companies": [dict(row, id=i, name=n) for i, n in enumerate(names, 1)], "notes": []}
    lines = status_mod.format_report(report).splitlines()[1:5]
    assert len({columns(line) for line in lines}) == 1, [(columns(x), x) for x in lines]
    assert lines[3].split("…")[0].strip().startswith("3  মেঘনা") and "…" in lines[3]
