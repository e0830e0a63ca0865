"""HR's questions after a pay run (session 42's HR walkthrough: "did everyone get their
slip?"): whom a job's email went to, reminders to those whose slip failed, a corrected
slip that says it replaces the one sent, and the date an employee left."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from payrun import keys, payroll, runs
from payrun.cli import cli
from payrun.recipient import from_job_data, recipient, recipient_text
from tests.test_payrun import MONTH, provider, set_email, work_everything  # noqa: F401 - a fixture

# ---- whom a job's email is for ---------------------------------------------------------


def test_a_renders_snapshot_gives_its_name_and_address_and_nothing_else():
    snap = {"employee": {"id": "emp-1", "name_en": "Ana", "email": "ana@x.example", "bank_account": "•••• 4821"},
            "earnings": {"basic": 4_500_000}, "month": MONTH}
    assert from_job_data(snap) == ("Ana", "ana@x.example")
    assert from_job_data({"to": "b@x.example", "to_name": "Bo", "slip": "a.pdf"}) == ("Bo", "b@x.example")
    assert from_job_data(["not", "a", "payload"]) == (None, None) and from_job_data({"month": MONTH}) == (None, None)
    shown = recipient("emp-1", None, snap, None)
    assert shown == {"employee_id": "emp-1", "name": "Ana", "email": "ana@x.example", "source": "job"}


def test_the_address_a_send_was_made_with_wins_over_the_jobs_and_the_one_on_file():
    payload = {"to": "old@x.example", "to_name": "Bo"}
    assert recipient("e", "retried@x.example", payload, ("Bo Now", "now@x.example"))["email"] == "retried@x.example"
    assert recipient("e", None, payload, ("Bo Now", "now@x.example"))["source"] == "job"
    on_file = recipient("e", None, None, ("Bo Now", "now@x.example"))
    assert on_file == {"employee_id": "e", "name": "Bo Now", "email": "now@x.example", "source": "on_file_now"}
    assert recipient(None, None, {"month": MONTH}, None) is None
    assert recipient_text(on_file) == ("to: Bo Now <now@x.example> (e; the address on file now; the one this job "
                                       "was made with is no longer known)")


def _job(*args) -> tuple[str, dict]:
    text = CliRunner().invoke(cli, ["job", *args])
    assert text.exit_code == 0, text.output
    out = CliRunner().invoke(cli, ["job", *args, "--json"])
    assert out.exit_code == 0, out.output
    return text.output, json.loads(out.output)


def test_payrun_job_names_whom_the_slip_was_for_and_the_address_it_went_to(world, provider):
    """HR walkthrough: `payrun job email-…` showed states and tries, not to whom: "which
    address did it go to?" had no answer. It names the employee and the address the send
    was made with, after HR changed the one on file, and once Redis dropped the job; a render
    names its send's. No salary figure is shown."""
    cfg, conn, db, ledger = world
    emp = "emp-00003"
    name, sent_to = db.conn.execute("SELECT name_en, email FROM employees WHERE id = ?", (emp,)).fetchone()
    set_email(db, "emp-00001", "nobody@nowhere.invalid")  # refused: its send fails for good
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    send, render = keys.email_job_id(MONTH, emp), f"render-{MONTH}-{emp}"
    set_email(db, emp, "new.address@x.example")  # HR changed it since: the slip went to the old one

    text, data = _job(send)
    assert f"to: {name} <{sent_to}> ({emp}; the address this send was made with)" in text, text
    assert data["recipient"] == {"employee_id": emp, "name": name, "email": sent_to, "source": "sent_with"}
    assert "recipient" not in data["ledger"]  # the ledger row's named columns keep their shape
    text, data = _job(render)
    assert f"for: {name} <{sent_to}> ({emp}; the address its send {send} was made with)" in text, text
    assert data["recipient"]["email"] == sent_to
    snap = payroll.employee_snapshot(db, MONTH, emp)
    figures = [str(v) for v in (*snap["earnings"].values(), *snap["deductions"].values()) if v > 99_999]
    assert figures
    for shown in (text, json.dumps(data)):
        assert not any(f in shown for f in figures), figures

    # a send refused for its address, fixed since by an import: it names the tried one, and the new
    # one a retry goes to (it said "fix the employee ... a retry alone fails again")
    bad = "emp-00001"
    refused = keys.email_job_id(MONTH, bad)
    text, _ = _job(refused)
    assert "fix the employee in the payroll data" in text, text  # not fixed yet
    set_email(db, bad, "fixed@x.example")
    text, data = _job(refused)
    assert "to: " in text and "<nobody@nowhere.invalid> (emp-00001; the address this send was made with)" in text
    assert (f"the address on file now is fixed@x.example (changed since this send was made): `payrun retry "
            f"{refused}` sends it there") in text, text
    assert "fix the employee in the payroll data" not in text and data["recipient"]["email"] == "nobody@nowhere.invalid"

    conn.flushdb()  # a day later: Redis has dropped the finished jobs; the ledger keeps the address
    text, data = _job(send)
    assert f"to: {name} <{sent_to}> ({emp}; the address this send was made with)" in text, text
    # a send made before the ledger kept addresses (migration 4): only the one on file now is known
    ledger.db.conn.execute("UPDATE jobs SET recipient = NULL WHERE id = ?", (send,))
    ledger.db.conn.commit()
    text, data = _job(send)
    assert (f"to: {name} <new.address@x.example> ({emp}; the address on file now; the one this job was made "
            "with is no longer known)") in text, text
    assert data["recipient"]["source"] == "on_file_now"


# ---- reminders to those whose slip failed ----------------------------------------------


def test_remind_failed_slip_emails_only_those_whose_slip_failed(world, provider):
    """HR walkthrough: `payrun remind` emailed every active employee of a company; HR
    could not reach only the few whose slip did not arrive. `--failed-slip M` picks the
    company's employees whose slip of M failed for good; it says when a reminder goes to
    the very address the slip failed at, and refuses when nobody's slip failed."""
    from jobs.runtime import PayrunJob

    cfg, conn, db, ledger = world
    bad = "emp-00001"
    company = payroll.employee_snapshot(db, MONTH, bad)["company"]["id"]
    other = 2 if company == 1 else 1
    set_email(db, bad, "nobody@nowhere.invalid")
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    assert ledger.failed_slips(MONTH, company) == {bad: "nobody@nowhere.invalid"}
    runner = CliRunner()

    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "2h", "--failed-slip", MONTH, "--json"])
    assert out.exit_code == 0, out.output
    done = json.loads(out.output)
    assert done["scheduled"] == 1 and done["jobs"] == [f"remind-{done['batch']}-{bad}"]
    assert done["failed_slip"] == MONTH and done["same_address"] == 1 and done["same_address_refused"] == 1
    payload = PayrunJob.fetch(done["jobs"][0], connection=conn).args[0]
    assert payload["to"] == "nobody@nowhere.invalid" and "could not email you your salary slip for November 2026" \
        in payload["text"], payload

    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "90m", "--failed-slip", MONTH])
    # its send was refused there (HTTP 422): not "if it was refused", payrun knows it was
    assert (f"note: 1 of them goes to the address its {MONTH} slip was refused at (not changed since): it will "
            "be refused too and reach no one; fix the address") in out.output, out.output

    name = db.conn.execute("SELECT name_en FROM employees WHERE id = ?", (bad,)).fetchone()[0]
    conn.delete(PayrunJob.key_for(done["jobs"][0]))  # gone from Redis: the ledger still names its address
    text, _ = _job(done["jobs"][0])
    assert f"to: {name} <nobody@nowhere.invalid> ({bad}; the address this send was made with)" in text, text

    # a resend to the address the slip was refused at says it will be refused too (it said nothing)
    out = runner.invoke(cli, ["resend", "--employee", bad, "--month", MONTH])
    assert out.exit_code == 0, out.output
    assert (f"note: its {MONTH} slip's send ({keys.email_job_id(MONTH, bad)}) was refused at this very address, "
            "nobody@nowhere.invalid: this resend will be refused too; fix the address") in out.output, out.output
    other_one = next(e for e in payroll.employee_ids(db, MONTH, company) if e != bad)
    assert "refused" not in runner.invoke(cli, ["resend", "--employee", other_one, "--month", MONTH]).output
    from payrun import status

    (note,) = [n for n in status.report(cfg, ledger, MONTH)["notes"] if "failed for good and" in n]
    assert "(an address refused: fix it with `payrun import`, then `payrun retry`)" in note, note
    set_email(db, bad, "fixed@x.example")  # HR fixed it: the next reminder goes to the new address, no note
    # and `payrun status` no longer asks for the import already made (it did: "fix it with `payrun import`")
    (note,) = [n for n in status.report(cfg, ledger, MONTH)["notes"] if "failed for good and" in n]
    assert note.endswith(f"(all with another address on file since the send: `payrun retry "
                         f"{keys.email_job_id(MONTH, bad)}` sends it to the new one)"), note
    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "3h", "--failed-slip", MONTH])
    assert out.exit_code == 0, out.output
    assert f"1 reminder(s) for company {company} (employees whose {MONTH} slip failed) scheduled" in out.output
    batch = out.output.split("(batch ")[1].split(")")[0]  # and how to take it back, with its batch
    assert f"to take them back before they are due: payrun remind --cancel {batch}\n" in out.output, out.output
    assert runner.invoke(cli, ["remind", "--cancel", batch]).output.startswith(f"cancelled 1 reminder(s) of batch {batch}")
    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "now", "--failed-slip", MONTH])
    assert out.exit_code == 0 and "--cancel" not in out.output, out.output  # due at once: nothing to take back
    assert "note:" not in out.output

    # a leaver of the month is reached (it was their final slip)
    assert runner.invoke(cli, ["employee", "left", bad, "--on", "2026-11-30"]).exit_code == 0
    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "4h", "--failed-slip", MONTH, "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["scheduled"] == 1, out.output
    # one who left before the month gets no reminder: said, with the day they left
    assert runner.invoke(cli, ["employee", "left", bad, "--on", "2026-10-30"]).exit_code == 0
    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "4h", "--failed-slip", MONTH])
    assert out.exit_code == 2 and (f"(1 failed, of employees marked left before {MONTH} or on a day not recorded: "
                                   f"{bad} (left 2026-10-30))") in out.output, out.output
    from scheduler.cli import remind

    set_email(db, "emp-00002", "nobody2@nowhere.invalid")  # (one more failed slip, of someone still here)
    ledger.db.conn.execute("UPDATE jobs SET status = 'failed' WHERE id = ?", (keys.email_job_id(MONTH, "emp-00002"),))
    ledger.db.conn.commit()
    assert payroll.employee_snapshot(db, MONTH, "emp-00002")["company"]["id"] == company
    from datetime import timedelta

    done = remind(cfg, conn, ledger, db, company, timedelta(hours=5), None, failed_slip=MONTH)
    assert done["scheduled"] == 1 and done["left_out_left"] == [bad], done
    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "6h", "--failed-slip", MONTH])
    assert (f"note: 1 whose {MONTH} slip failed is marked as left before {MONTH} (or on a day not recorded) and "
            f"gets no reminder: {bad} (left 2026-10-30)") in out.output, out.output
    assert runner.invoke(cli, ["employee", "back", bad]).exit_code == 0

    made = len(ledger.jobs(kind="reminder"))
    out = runner.invoke(cli, ["remind", "--company", str(other), "--in", "2h", "--failed-slip", MONTH])
    assert out.exit_code == 2, out.output
    assert f"no employee of company {other} has a {MONTH} slip that failed for good" in out.output
    assert len(ledger.jobs(kind="reminder")) == made  # the refused one wrote nothing
    assert "--failed-slip YYYY-MM" in runner.invoke(cli, ["remind", "--help"]).output
    bad_month = runner.invoke(cli, ["remind", "--company", str(company), "--in", "2h", "--failed-slip", "11-2026"])
    assert bad_month.exit_code == 2 and "payrun:" in bad_month.output, bad_month.output


def test_remind_failed_slip_reaches_the_final_slips_of_a_company_whose_staff_all_left_in_the_month(world, provider):
    """Review (session 43): `--failed-slip M` reaches a leaver of M (their final slip), but
    `remind` first refused any company with no active employee: a company whose staff all
    left in November (a unit closed) got "has no active employees" for its failed final
    slips, with nothing scheduled."""
    cfg, conn, db, ledger = world
    bad = "emp-00001"
    company = payroll.employee_snapshot(db, MONTH, bad)["company"]["id"]
    set_email(db, bad, "nobody@nowhere.invalid")
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    assert ledger.failed_slips(MONTH, company) == {bad: "nobody@nowhere.invalid"}
    staff = [r[0] for r in db.conn.execute("SELECT id FROM employees WHERE company_id = ?", (company,))]
    runner = CliRunner()
    assert runner.invoke(cli, ["employee", "left", *staff, "--on", "2026-11-30"]).exit_code == 0
    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "2h", "--failed-slip", MONTH, "--json"])
    assert out.exit_code == 0, out.output
    done = json.loads(out.output)
    assert done["scheduled"] == 1 and done["jobs"] == [f"remind-{done['batch']}-{bad}"], done
    # a reminder to the whole company still needs someone working there
    out = runner.invoke(cli, ["remind", "--company", str(company), "--in", "2h"])
    assert out.exit_code == 2 and f"company {company} has no employee working here or who left in" in out.output, out.output


def test_the_same_address_note_is_sure_of_a_refusal_and_hedges_only_other_failures():
    from scheduler.cli import same_address_text

    assert "if it was refused, so will the reminder be" in same_address_text(1, MONTH)  # a provider's trouble
    assert same_address_text(2, MONTH, 2).startswith(
        f"2 of them go to the address their {MONTH} slip was refused at (not changed since): they will be refused too")
    assert f"3 of them go to the address their {MONTH} slip's send failed at (not changed since), 1 of those to an " \
        "address refused for good (their reminders will be refused too)" in same_address_text(3, MONTH, 1)


# ---- a corrected slip says it replaces the one sent ------------------------------------


def test_reissue_marks_name_the_slip_replaced_and_call_it_corrected_only_after_a_change_since():
    from jobs.policy import reissue_marks

    day = lambda iso: iso[:10]  # noqa: E731 - the zone's date, as the caller gives it
    assert reissue_marks("2026-12-04", None, "2026-12-02T10:00:00+00:00", day) == {"reissued": "2026-12-04"}
    assert reissue_marks("2026-12-04", "2026-12-01T03:00:00.000+00:00", None, day) == \
        {"reissued": "2026-12-04", "replaces": "2026-12-01"}
    assert reissue_marks("2026-12-04", "2026-12-01T03:00:00.000+00:00", "2026-12-02T10:00:00.000+00:00", day) == \
        {"reissued": "2026-12-04", "replaces": "2026-12-01", "corrected": True}
    # figures changed before the slip was delivered: it had them already
    assert "corrected" not in reissue_marks("2026-12-04", "2026-12-01T03:00:00+00:00", "2026-11-30T10:00:00+00:00", day)


def test_a_corrected_slip_says_so_and_does_not_say_credited():
    from jobs import slip

    base = slip.SAMPLE_SNAPSHOT
    html = slip.render_html({**base, "reissued": "2026-12-04", "replaces": "2026-12-01", "corrected": True})
    assert "Corrected slip — replaces the one sent on 2026-12-01" in html and "Corrected payslip" in html
    assert "Credited to bank account" not in html and "Corrected net pay, for bank account" in html
    html = slip.render_html({**base, "reissued": "2026-12-04", "replaces": "2026-12-01"})
    assert "Re-issued on 2026-12-04: this slip replaces the one sent on 2026-12-01." in html
    assert "Credited to bank account" in html and "Corrected" not in html
    # only dates are printed; "corrected" needs the slip it replaces, and a resend
    for odd in ({"reissued": "2026-12-04", "replaces": "<b>x</b>", "corrected": True},
                {"replaces": "2026-12-01", "corrected": True}, {"reissued": "2026-12-04", "corrected": "yes"}):
        html = slip.render_html({**base, **odd})
        assert "Corrected" not in html and "<b>x" not in html and "Credited to bank account" in html, odd


def _correct_basic(db, tmp_path, emp: str, month: str) -> str:
    """An HR import that changes one figure of ``emp``'s ``month`` line (the rest as is)."""
    import csv

    cols = payroll.CSV_COLUMNS
    row = db.conn.execute(
        "SELECT s.company_id, e.id, e.name_en, e.name_bn, e.email, e.department, e.designation, e.bank_account, "
        "s.month, s.basic, s.house_rent, s.medical, s.conveyance, s.bonus, s.tax, s.provident_fund, s.loan "
        "FROM salary_lines s JOIN employees e ON e.id = s.employee_id WHERE s.employee_id = ? AND s.month = ?",
        (emp, month)).fetchone()
    line = dict(zip(cols, row))
    for f in payroll.AMOUNT_FIELDS:
        line[f] = f"{line[f] / 100:.2f}"
    line["basic"] = f"{float(line['basic']) + 1000:.2f}"
    path = tmp_path / "fix.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerow(line)
    return str(path)


def test_a_resend_after_a_salary_correction_is_a_corrected_slip_naming_the_one_it_replaces(world, provider, tmp_path):
    """HR walkthrough: a resend after a salary correction read "Credited …" with the new net
    pay, like the slip sent before: the employee could not tell which one holds. Corrected
    since its delivery, it says "Corrected slip — replaces the one sent on <date>" (its
    email "Corrected:"); a resend with the same figures names the slip it replaces too."""
    import pypdf

    cfg, conn, db, ledger = world
    emp, other = "emp-00003", "emp-00004"
    runs.start_run(cfg, conn, ledger, db, MONTH)
    work_everything(conn, ledger)
    sent_on = ledger.delivered_at(keys.idem_key(MONTH, emp))
    assert sent_on
    from datetime import datetime
    from zoneinfo import ZoneInfo

    day = datetime.fromisoformat(sent_on).astimezone(ZoneInfo(cfg.timezone)).strftime("%Y-%m-%d")
    runner = CliRunner()
    assert runner.invoke(cli, ["import", _correct_basic(db, tmp_path, emp, MONTH)]).exit_code == 0
    out = runner.invoke(cli, ["resend", "--employee", emp, "--month", MONTH])
    assert out.exit_code == 0, out.output
    assert f"a corrected slip (its figures changed since): it says it replaces the one sent on {day}" in out.output
    out = runner.invoke(cli, ["resend", "--employee", other, "--month", MONTH, "--json"])
    assert json.loads(out.output)["replaces"] == day and json.loads(out.output)["corrected"] is False
    work_everything(conn, ledger)

    company = payroll.employee_snapshot(db, MONTH, emp)["company"]["id"]

    def text(who: str) -> str:
        path = cfg.slips_dir / MONTH / str(company if who == emp else
                                           payroll.employee_snapshot(db, MONTH, who)["company"]["id"]) \
            / f"{who}.resend-1.pdf"
        return " ".join(" ".join(p.extract_text() for p in pypdf.PdfReader(str(path)).pages).split())

    fixed = text(emp)
    assert f"Corrected slip — replaces the one sent on {day}" in fixed and "Credited to" not in fixed, fixed
    sent = provider.delivery(f"{keys.idem_key(MONTH, emp)}:resend-1")
    assert sent["subject"].startswith("Corrected: Your salary slip for November 2026"), sent
    same = text(other)
    assert f"this slip replaces the one sent on {day}" in same and "Corrected" not in same, same
    assert provider.delivery(f"{keys.idem_key(MONTH, other)}:resend-1")["subject"].startswith("Re-issued: ")


# ---- the day an employee left ----------------------------------------------------------


def test_a_leaving_date_is_a_real_day_not_after_today():
    from payrun.runs import leaving_date_problem

    assert leaving_date_problem("2026-11-20", "2026-12-06") is None
    assert leaving_date_problem("2026-12-06", "2026-12-06") is None
    assert "YYYY-MM-DD" in leaving_date_problem("20/11/2026", "2026-12-06")
    assert "no such day" in leaving_date_problem("2026-02-30", "2026-12-06")
    assert "after today (2026-12-06)" in leaving_date_problem("2026-12-07", "2026-12-06")


def test_the_steps_that_pay_a_leaver_left_out_record_their_day_and_never_clear_it():
    """HR walkthrough: the note's steps were `employee back`, `run --resume`, then `employee
    left` again, which cleared the leaving date on the way (a bare `left` then recorded
    today). The run pays a leaver by the day they left now: recording (or correcting) that
    day with `--on` and `run --resume` makes their slip; `back` is not needed."""
    note = payroll.left_text({1: ["emp-1", "emp-2"], 2: ["emp-3"]}, MONTH,
                             {"emp-1": "2026-10-28", "emp-2": None, "emp-3": "2026-10-28"})
    assert note.startswith("3 employees marked as left (`payrun employee left`) have a salary line for 2026-11 and "
                           "no slip of it: emp-1 (left 2026-10-28) emp-2 (left, date not recorded) emp-3 (left "
                           "2026-10-28). A run of 2026-11 pays leavers who left on or after 2026-11-01"), note
    assert note.endswith("Worked in 2026-11: `payrun employee left emp-1 emp-2 emp-3 --on DATE` (the day they left), "
                         "then `payrun run --month 2026-11 --resume`"), note
    assert "back" not in note
    many = payroll.left_text({1: [f"emp-{i}" for i in range(12)]}, MONTH, {})
    assert "… (2 more)" in many and "`payrun employee left ID… --on DATE`" in many, many
    # `employee back` still names the day it clears, and the `left --on` that puts it back
    assert payroll.left_again(["emp-1", "emp-2"], {"emp-1": "2026-10-28"}) == (
        "`payrun employee left emp-2` and `payrun employee left emp-1 --on 2026-10-28` again (the day they left "
        "is not recorded: add `--on` the day)")


def test_the_day_an_employee_left_is_recorded_and_shown_where_leavers_are_named(world):
    """HR walkthrough: `payrun employee left` kept no date, and `run`, `status` and `resend`
    named a leaver with none: HR could not tell whether they left before or after the month
    being run. `--on` records it (default today); the three name it; `back` clears it; a
    payroll database from before gets the column, its marks shown as not dated."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    cfg, conn, db, ledger = world
    runner = CliRunner()
    gone, late, old = "emp-00005", "emp-00006", "emp-00007"
    today = datetime.now(ZoneInfo(cfg.timezone)).strftime("%Y-%m-%d")
    out = runner.invoke(cli, ["employee", "left", gone, "--on", "2026-10-20"])
    assert out.exit_code == 0 and "1 employee marked as left on 2026-10-20" in out.output, out.output
    assert ("runs of 2026-11 and later, and reminders about those months, leave them out (a run of 2026-10 pays them"
            in out.output), out.output
    assert "a `payrun remind` about 2026-10, due in it or `--month 2026-10`, reaches them)" in out.output
    assert runner.invoke(cli, ["employee", "left", late]).exit_code == 0
    assert payroll.left_on(db, [gone, late, "emp-00001"]) == {gone: "2026-10-20", late: today}
    again = runner.invoke(cli, ["employee", "left", gone])
    assert "1 already so (left 2026-10-20: `--on DATE` corrects it)" in again.output, again.output
    assert payroll.left_on(db, [gone]) == {gone: "2026-10-20"}
    for bad, why in (("2026-11-31", "no such day"), ("2999-01-01", "is after today")):
        out = runner.invoke(cli, ["employee", "left", old, "--on", bad])
        assert out.exit_code == 2 and why in out.output, out.output
    assert payroll.is_active(db, old) is True  # refused: nothing marked

    out = runner.invoke(cli, ["run", "--month", MONTH])
    assert out.exit_code == 0, out.output
    assert f": {gone} (left 2026-10-20). A run of {MONTH} pays" in out.output and late not in out.output, out.output
    st = runner.invoke(cli, ["status", "--month", MONTH, "--json"])
    assert any(f"{gone} (left 2026-10-20)" in n for n in json.loads(st.output)["notes"]), st.output
    out = runner.invoke(cli, ["resend", "--employee", gone, "--month", MONTH])
    assert out.exit_code == 2 and "(`payrun employee left`; left 2026-10-20), before" in out.output, out.output
    assert f"`payrun employee left {gone} --on DATE` (the day they left, {MONTH}-01 or later)" in out.output

    # a corrected date; back clears it
    out = runner.invoke(cli, ["employee", "left", gone, "--on", "2026-10-25"])
    assert "1 already so (1 now dated 2026-10-25)" in out.output, out.output
    out = runner.invoke(cli, ["employee", "back", late])
    assert out.exit_code == 0, out.output  # it says which day it cleared, and how to put it back
    assert (f"the day they left is cleared: {late} (left {today}); to mark them left as before: "
            f"`payrun employee left {late} --on {today}` again") in out.output, out.output
    assert payroll.left_on(db, [gone, late]) == {gone: "2026-10-25"}

    # a payroll database made before leaving dates: the column is added, old marks undated
    db.conn.execute(f"DROP TRIGGER {payroll.LEFT_ON_TRIGGER}")  # (made with the column: it names it)
    db.conn.execute("ALTER TABLE employees DROP COLUMN left_on")
    db.conn.execute("UPDATE employees SET active = 0 WHERE id = ?", (old,))  # (marked then; November has its slip)
    db.conn.commit()
    again = payroll.PayrollDB(cfg.payroll_path)
    assert payroll.left_on(again, [gone, old]) == {gone: None, old: None}
    st = runner.invoke(cli, ["status", "--month", MONTH])
    assert f"{gone} (left, date not recorded)" in st.output, st.output
    again.close()


# ---- a leaver's final month ------------------------------------------------------------


def test_a_months_run_pays_those_working_here_and_leavers_who_left_in_it_or_later():
    """The rule, and the SQL that applies it agreeing with it (a NULL date must read as
    "not recorded", not drop out of a NOT)."""
    assert payroll.in_month_run(True, None, MONTH)
    for day in ("2026-11-01", "2026-11-20", "2026-11-30", "2026-12-06"):
        assert payroll.in_month_run(False, day, MONTH), day
    for day in ("2026-10-31", "2025-11-20", None, ""):
        assert not payroll.in_month_run(False, day, MONTH), day
    db = payroll.PayrollDB(":memory:")
    payroll.seed(db, companies=1, employees=6, seed=1, month=MONTH)
    ids = sorted(payroll.employee_ids(db, MONTH))
    dates = {ids[0]: "2026-11-01", ids[1]: "2026-11-30", ids[2]: "2026-10-31", ids[3]: "2026-12-02"}
    for emp, day in dates.items():
        payroll.set_active(db, [emp], False, left_date=day)
    db.conn.execute("UPDATE employees SET active = 0 WHERE id = ?", (ids[4],))  # an earlier version's mark: no date
    db.conn.commit()
    got = payroll.leavers_with_salary_line(db, MONTH)
    assert got == [(e, dates.get(e), payroll.in_month_run(False, dates.get(e), MONTH)) for e in ids[:5]]
    paid = {ids[0], ids[1], ids[3], ids[5]}
    assert payroll.employee_ids(db, MONTH) == paid and payroll.count_employees(db, MONTH) == 4
    assert {s["employee"]["id"] for s in payroll.snapshots(db, MONTH)} == paid
    assert payroll.left_with_salary_line(db, MONTH, [1]) == {1: [ids[2], ids[4]]}
    # a November leaver with no November line is missing one (their final slip); an October one is not
    db.conn.execute("DELETE FROM salary_lines WHERE month = ? AND employee_id IN (?, ?)", (MONTH, ids[0], ids[2]))
    db.conn.commit()
    assert payroll.without_salary_line(db, MONTH, [1]) == {1: [ids[0]]}
    assert payroll.with_leaving_dates(db, [ids[0], ids[5]]) == [f"{ids[0]} (left 2026-11-01)", ids[5]]
    # December: none of November's leavers; the one who left on 2026-12-02 is
    payroll.ensure_month(db, "2026-12")
    assert payroll.employee_ids(db, "2026-12") == {ids[3], ids[5]}


def test_a_leaver_gets_the_final_slip_of_the_month_they_left_in_and_hr_counts_add_up(world, provider):
    """HR walkthrough: someone who left on the 20th of November, with a November salary
    line, got no November slip (the run paid `active = 1` only) unless HR did `employee
    back`, `run --resume`, `employee left --on` by hand. The run pays them; `check` names
    every leaver with a line for the month and what the run does with each; `status` counts
    neither the paid leaver nor the one left out as missing or extra; an October leaver
    and one whose date is not recorded are left out, named, and made by recording the day."""
    from payrun import preflight, status
    from payrun.runs import no_slip

    cfg, conn, db, ledger = world
    runner = CliRunner()
    final, october, undated = sorted(payroll.employee_ids(db, MONTH, 1))[:3]  # (one company: the notes' order)
    assert runner.invoke(cli, ["employee", "left", final, "--on", "2026-11-20"]).exit_code == 0
    assert runner.invoke(cli, ["employee", "left", october, "--on", "2026-10-31"]).exit_code == 0
    db.conn.execute("UPDATE employees SET active = 0 WHERE id = ?", (undated,))  # an earlier version's `left`
    db.conn.commit()
    assert payroll.left_on(db, [undated]) == {undated: None}

    rep = preflight.check(cfg, month=MONTH, email=False)
    (warn,) = [f for f in rep.findings if f.area == "payroll" and "marked as left" in f.text]
    assert warn.level == preflight.WARN and warn.text == (
        f"3 employees marked as left have a salary line for {MONTH}: the run makes the final slip of 1 employee "
        f"who left in {MONTH} or later: {final} (left 2026-11-20); it makes no slip for 2 employees who left before "
        f"{MONTH} or on a day not recorded: {october} (left 2026-10-31), {undated} (left, date not recorded) "
        f"(worked in {MONTH}: `payrun employee left ID --on DATE`, the day they left, before the run)"), warn.text
    assert warn.detail == {"final_slips": [final], "left_out": [october, undated],
                           "left_on": {final: "2026-11-20", october: "2026-10-31", undated: None}}
    assert next(f for f in rep.findings if f.area == "estimate").detail["slips"] == 10

    out = runner.invoke(cli, ["run", "--month", MONTH])
    assert out.exit_code == 0 and "created 10 render jobs" in out.output, out.output
    assert f"{october} (left 2026-10-31) {undated} (left, date not recorded)" in out.output
    work_everything(conn, ledger)
    assert provider.delivery(keys.idem_key(MONTH, final)) is not None  # the final slip went out
    hr = status.report(cfg, ledger, MONTH)
    assert hr["total"]["done"] == 10 and hr["total"]["total"] == 10
    assert hr["total"]["no_slip"] == 0 and hr["total"]["no_salary_line"] == 0, hr["notes"]
    assert no_slip(ledger, db, MONTH) == {}  # (the console's HR line counts these)
    # `check` after the run names only the leavers still without a slip
    (warn,) = [f for f in preflight.check(cfg, month=MONTH, email=False).findings if "marked as left" in f.text]
    assert warn.detail["final_slips"] == [] and warn.detail["left_out"] == [october, undated], warn.detail
    assert "before the run" not in warn.text and f"then `payrun run --month {MONTH} --resume`" in warn.text, warn.text
    (note,) = [n for n in hr["notes"] if "marked as left" in n]
    assert final not in note and f"{october} (left 2026-10-31)" in note, note

    # HR: the undated one worked until 2026-11-05; the way the note names makes their slip
    assert runner.invoke(cli, ["employee", "left", undated, "--on", "2026-11-05"]).exit_code == 0
    hr = status.report(cfg, ledger, MONTH)
    assert hr["total"]["no_slip"] == 1 and any("run --month 2026-11 --resume" in n for n in hr["notes"])
    # said as a leaver's final slip left out, with their day (it read "added after the run")
    (late,) = [n for n in hr["notes"] if f"who left in {MONTH} or later" in n]
    assert f"{undated} (left 2026-11-05)" in late and "before the day they left was recorded" in late, late
    assert "added after the run" not in late and hr["total"]["no_slip_final"] == 1
    out = runner.invoke(cli, ["run", "--month", MONTH, "--resume"])
    assert "created 1 render job" in out.output, out.output
    assert payroll.left_on(db, [undated]) == {undated: "2026-11-05"}  # (no `back`: the date stays)
    work_everything(conn, ledger)
    hr = status.report(cfg, ledger, MONTH)
    assert hr["total"]["done"] == 11 and hr["total"]["no_slip"] == 0
    (note,) = [n for n in hr["notes"] if "marked as left" in n]
    assert note.startswith(f"1 employee marked as left (`payrun employee left`) has a salary line for {MONTH} and "
                           f"no slip of it: {october} (left 2026-10-31). ") and undated not in note, note
    from console.data import Source  # the console's HR line: the same counts

    assert Source(cfg, conn).snapshot().status["total"] == status.report(cfg, ledger, month=MONTH, conn=conn)["total"]
    # their resend works (they have a slip); the October leaver's is refused with the way to make theirs
    assert runner.invoke(cli, ["resend", "--employee", undated, "--month", MONTH]).exit_code == 0
    out = runner.invoke(cli, ["resend", "--employee", october, "--month", MONTH])
    assert out.exit_code == 2 and "before 2026-11 or on a day not recorded" in out.output, out.output


def test_check_counts_those_the_run_pays_and_the_leavers_with_salary_lines_it_leaves_out(world):
    """HR (session 44): `payrun check` read "12 employees with salary lines" and counted
    only those the run pays, leaving out, unsaid, leavers who left before the month or on
    a day not recorded. It says whom the run pays and how many with salary lines it leaves
    out; with no one paid, that it pays no one of them."""
    from payrun import preflight

    cfg, conn, db, ledger = world

    def line(rep):
        (f,) = [f for f in rep.findings if f.area == "payroll" and f.level in (preflight.OK, preflight.FAIL)]
        return f

    ok = line(preflight.check(cfg, month=MONTH, email=False))
    assert ok.level == preflight.OK and ok.text == f"{MONTH}: the run pays 12 employees in 2 companies", ok.text
    ids = sorted(payroll.employee_ids(db, MONTH))
    payroll.set_active(db, ids[:1], False, left_date="2026-11-20")  # paid: their final slip
    payroll.set_active(db, ids[1:3], False, left_date="2026-10-31")  # left out
    db.conn.execute("UPDATE employees SET active = 0 WHERE id = ?", (ids[3],))  # left out: no day recorded
    db.conn.commit()
    ok = line(preflight.check(cfg, month=MONTH, email=False))
    assert ok.text == (f"{MONTH}: the run pays 9 employees in 2 companies; 3 employees with salary lines left out "
                       f"(left before {MONTH} or on a day not recorded)"), ok.text
    assert ok.detail == {"pays": 9, "left_out": 3}
    payroll.set_active(db, ids, False, left_date="2026-10-31")
    fail = line(preflight.check(cfg, month=MONTH, email=False))
    assert fail.level == preflight.FAIL and fail.text.startswith(
        f"no salary line for {MONTH} of anyone the run pays: 12 employees with salary lines left out (left before "
        f"{MONTH} or on a day not recorded); the tick would pay nothing (`payrun employee left ID --on DATE` for one "
        "who worked in it"), fail.text


def test_seed_counts_what_a_run_pays_and_the_leavers_it_leaves_out_as_check_does(world):
    """`payrun seed`'s note on a database holding more than the seed read "N employees with
    salary lines" and counted those the run pays: a leaver of the month (their final slip)
    in, those who left before it out, unsaid. It says what the run pays, as `payrun check`
    does, with the final slips among them, and how many with salary lines it leaves out."""
    from payrun import preflight

    cfg, conn, db, ledger = world
    runner = CliRunner()
    ids = sorted(payroll.employee_ids(db, MONTH))  # emp-00001 … emp-00012; a seed of 2 or 11 re-writes the first
    payroll.set_active(db, ids[-1:], False, left_date="2026-11-20")  # paid: their final slip
    payroll.set_active(db, ids[-3:-1], False, left_date="2026-10-31")  # left out

    def check_says() -> str:
        (ok,) = [f for f in preflight.check(cfg, month=MONTH, email=False).findings
                 if f.area == "payroll" and f.level == preflight.OK]
        return ok.text.removeprefix(f"{MONTH}: the run pays ")

    out = runner.invoke(cli, ["seed", "--companies", "2", "--employees", "2", "--seed", "3", "--month", MONTH])
    assert out.exit_code == 0, out.output
    pays, left_out = check_says().split("; ")
    assert pays == "10 employees in 2 companies" and left_out == (
        f"2 employees with salary lines left out (left before {MONTH} or on a day not recorded)"), check_says()
    assert (f"note: the database holds more than this seed (seed adds and updates, never removes): 2 companies in "
            f"all; a run of {MONTH} pays {pays} (1 of them left in {MONTH} or later: their final slip); {left_out}\n"
            ) in out.output, out.output
    # no more paid than seeded, one with salary lines left out: it said nothing of them
    payroll.set_active(db, ids[-1:], False, left_date="2026-10-31")
    out = runner.invoke(cli, ["seed", "--companies", "2", "--employees", "9", "--seed", "3", "--month", MONTH])
    assert out.exit_code == 0, out.output
    assert check_says() == (f"9 employees in 2 companies; 3 employees with salary lines left out (left before "
                            f"{MONTH} or on a day not recorded)"), check_says()
    assert (f"2 companies in all; a run of {MONTH} pays 9 employees in 2 companies; 3 employees with salary lines "
            f"left out (left before {MONTH} or on a day not recorded)\n") in out.output, out.output


def test_check_after_the_months_run_says_what_makes_a_leavers_slip_now():
    """Drill (session 43): after the night's run `payrun check` still told the on-call to
    record an October leaver's day "before the run", though the run was over; what makes
    their slip then is the day recorded and `run --resume`, as `payrun status` says."""
    from payrun.preflight import leavers_text

    leavers = [("emp-40010", "2026-11-20", True), ("emp-40011", "2026-10-20", False)]
    before = leavers_text(leavers, MONTH)
    assert before.endswith("the day they left, before the run)"), before
    after = leavers_text(leavers, MONTH, ran=True)
    assert after == (
        f"2 employees marked as left have a salary line for {MONTH} and no slip of it: "
        f"`payrun run --month {MONTH} --resume` makes the final slip of 1 employee who left in {MONTH} or later: "
        f"emp-40010 (left 2026-11-20); the run made no slip for 1 employee who left before {MONTH} or on a day "
        f"not recorded: emp-40011 (left 2026-10-20) (worked in {MONTH}: `payrun employee left ID --on DATE`, "
        f"the day they left, then `payrun run --month {MONTH} --resume`)"), after
    assert "before the run" not in after
    one = leavers_text(leavers[1:], MONTH, ran=True)
    assert one.startswith(f"1 employee marked as left has a salary line for {MONTH} and no slip of it: the run made "
                          "no slip for 1 employee"), one


def test_an_import_records_leavers_with_their_day_or_nothing_at_all(world, tmp_path):
    """HR walkthrough: the import file could not say who left (an `active` column was not
    read): each leaver took an `employee left` by hand. An optional `left_on` column marks
    them, with the day; a bad day, a day after today or two days for one employee refuses
    the whole file, nothing marked and no line imported."""
    import csv

    cfg, conn, db, ledger = world
    runner = CliRunner()
    cols = [*payroll.CSV_COLUMNS, "left_on"]
    base = [dict(zip(cols, [*r, ""])) for r in db.conn.execute(
        "SELECT s.company_id, e.id, e.name_en, e.name_bn, e.email, e.department, e.designation, e.bank_account, "
        "s.month, s.basic / 100.0, s.house_rent / 100.0, s.medical / 100.0, s.conveyance / 100.0, s.bonus / 100.0, "
        "s.tax / 100.0, s.provident_fund / 100.0, s.loan / 100.0 FROM salary_lines s JOIN employees e ON e.id = "
        "s.employee_id WHERE s.month = ? ORDER BY e.id LIMIT 3", (MONTH,))]
    one, two, three = (r["employee_id"] for r in base)

    def write(rows) -> str:
        path = tmp_path / "employees.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
        return str(path)

    december = {**base[1], "month": "2026-12"}
    bad = [{**base[0], "left_on": "2026-11-31"}, {**base[1], "left_on": "2026-10-20"},
           {**december, "left_on": "2026-10-21"}, {**base[2], "left_on": "2999-01-01"}]
    out = runner.invoke(cli, ["import", write(bad)])
    assert out.exit_code == 2 and "3 bad row(s), nothing imported" in out.output, out.output
    assert "line 2: left_on '2026-11-31': no such day" in out.output
    assert (f"line 4: {two}'s left_on differs from line 3 (2026-10-20 there, 2026-10-21 here): one employee's "
            "leaving date is the same on every row") in out.output, out.output
    assert "line 5: left_on '2999-01-01': is after today" in out.output
    assert payroll.leavers_with_salary_line(db, MONTH) == [] and "2026-12" not in payroll.months(db)

    good = [{**base[0], "left_on": "2026-11-20"}, {**base[1], "left_on": "2026-10-20"}, {**december, "left_on":
            "2026-10-20"}, base[2]]
    out = runner.invoke(cli, ["import", write(good)])
    assert out.exit_code == 0, out.output
    assert (f"marked 2 employees as left (left_on): {two} on 2026-10-20; {one} on 2026-11-20: a month's run still "
            "pays them for the month they left in") in out.output, out.output
    assert (f"note: 2 salary lines of a month after the one the employee left in: {two} 2026-11, {two} 2026-12: no "
            "pay run makes a slip of them (if they worked that month, correct left_on)") in out.output, out.output
    assert "not imported" not in out.output  # (the column is payrun's)
    assert payroll.left_on(db, [one, two, three]) == {one: "2026-11-20", two: "2026-10-20"}
    assert one in payroll.employee_ids(db, MONTH) and two not in payroll.employee_ids(db, MONTH)
    # the same file again changes nothing; a corrected day is said; an empty one leaves the mark be
    again = runner.invoke(cli, ["import", write(good)])
    assert "marked" not in again.output, again.output
    out = runner.invoke(cli, ["import", write([{**base[1], "left_on": "2026-11-02"}, {**december, "left_on":
                                               "2026-11-02"}, {**base[0], "left_on": ""}])])
    assert f"marked 1 employee as left (left_on): {two} on 2026-11-02" in out.output, out.output
    assert payroll.left_on(db, [one, two]) == {one: "2026-11-20", two: "2026-11-02"}
    from payrun.audit import read_audit

    assert read_audit(cfg)[-1]["message"].endswith("; 1 marked as left"), read_audit(cfg)[-1]


def test_a_leavers_slip_of_the_month_they_left_in_says_it_is_their_final_one():
    """HR walkthrough: the final payslip read like any other. The slip of the month a
    leaver left in says "Final payslip" with the day they left; their slip of an earlier
    month, anyone else's, and a value that is no date of the slip's month say nothing."""
    from jobs.slip import render_html

    db = payroll.PayrollDB(":memory:")
    payroll.seed(db, companies=1, employees=3, seed=1, month="2026-10")
    payroll.ensure_month(db, MONTH)
    one, two, _ = sorted(payroll.employee_ids(db, MONTH))
    payroll.set_active(db, [one], False, left_date="2026-11-20")
    final = payroll.employee_snapshot(db, MONTH, one)
    assert final["final"] == "2026-11-20"
    assert {s["employee"]["id"]: s.get("final") for s in payroll.snapshots(db, MONTH)}[one] == "2026-11-20"
    assert "final" not in payroll.employee_snapshot(db, "2026-10", one)  # (paid that month too: not the last)
    assert "final" not in payroll.employee_snapshot(db, MONTH, two)
    html = render_html(final)
    assert ">Final payslip<" in html and "(you left on 2026-11-20)" in html, html
    # (drill 43: the final slip's pay period ran to the month's end, past the day they left)
    assert "1 – 20 November 2026" in html and "1 – 30 November 2026" not in html
    from jobs.slip import pay_period

    assert pay_period(MONTH) == "1 – 30 November 2026" and pay_period(MONTH, "2026-11-20") == "1 – 20 November 2026"
    assert pay_period(MONTH, "2026-11-01") == "1 November 2026"
    for other in (payroll.employee_snapshot(db, MONTH, two), {**final, "final": "2026-10-20"},
                  {**final, "final": "<b>2026-11-20</b>"}):
        html = render_html(other)
        assert "Final payslip" not in html and "you left" not in html and "1 – 30 November 2026" in html
    # the line more still fits one page, every field at its maximum and re-issued too
    from jobs.slip import render_pdf
    from tests.test_slip import _every_field_at_its_maximum, pdf_text

    snap = _every_field_at_its_maximum("W")
    text = pdf_text(render_pdf({**snap, "reissued": "2026-12-04", "final": f"{snap['month']}-20"}))
    assert "Final payslip" in text and f"(you left on {snap['month']}-20)" in text and "Re-issued" in text


def test_a_final_slips_email_says_it_is_the_final_one_and_gives_no_figure():
    """HR (session 44): the final slip's PDF said "Final payslip", its email read as any
    month's. Its subject and the body's first line say it is the final one, with the day
    they left; a resend of it keeps that; nothing else changes, and no figure is in it."""
    from jobs.tasks import slip_email

    base = {"month": MONTH, "key": f"slip:{MONTH}:emp-1", "company_name": "Meghna Textiles", "employee_id": "emp-1",
            "to": "ana@x.example", "to_name": "Ana Rahman", "slip": "a.pdf"}
    subject, body, name = slip_email({**base, "final": "2026-11-20"})
    assert subject == "Your final salary slip for November 2026 — Meghna Textiles", subject
    assert body.split("\n")[2] == ("Please find attached your final salary slip for November 2026, your last month "
                                   "with Meghna Textiles (you left on 2026-11-20)."), body
    assert name == f"salary-slip-{MONTH}-emp-1-final.pdf", name  # (session 45: the file name says so too)
    plain = slip_email(base)
    assert plain[2] == f"salary-slip-{MONTH}-emp-1.pdf", plain
    assert plain[0] == "Your salary slip for November 2026 — Meghna Textiles"
    assert plain[1].split("\n")[2] == "Please find attached your salary slip for November 2026.", plain
    for other in ("2026-10-20", "<b>2026-11-20</b>", 20261120, None):  # (no date of the slip's month: no mark)
        assert slip_email({**base, "final": other}) == plain, other
    # a resend's name: "-final" then the resend's own mark, as for any slip
    again = {"reissued": "2026-12-04", "replaces": "2026-12-01"}
    assert slip_email({**base, **again})[2] == f"salary-slip-{MONTH}-emp-1-reissued.pdf"
    assert slip_email({**base, **again, "corrected": True})[2] == f"salary-slip-{MONTH}-emp-1-corrected.pdf"
    assert slip_email({**base, **again, "final": "2026-11-20"})[2] == f"salary-slip-{MONTH}-emp-1-final-reissued.pdf"
    subject, body, name = slip_email({**base, "final": "2026-11-20", "reissued": "2026-12-04", "replaces": "2026-12-01",
                                      "corrected": True})
    assert name == f"salary-slip-{MONTH}-emp-1-final-corrected.pdf", name
    assert subject.startswith("Corrected: Your final salary slip for November 2026"), subject
    assert body.split("\n")[2].startswith("Please find attached your corrected final salary slip for November 2026, "
                                          "your last month with Meghna Textiles (you left on 2026-11-20). It was "
                                          "corrected on 2026-12-04"), body


def test_a_leavers_final_slip_email_over_real_smtp_says_final(world, monkeypatch):
    """The same end to end: a November leaver's slip goes out over a real SMTP server
    (aiosmtpd) saying it is their final one, in its PDF's file name too; everyone else's
    does not; no salary figure is in any subject or body."""
    from email import message_from_bytes
    from email.policy import default as default_policy

    from jobs import slip, tasks
    from test_mail import EphemeralController, Recorder
    from tests.test_payrun import work_everything

    cfg, conn, db, ledger = world
    leaver = sorted(payroll.employee_ids(db, MONTH))[0]
    payroll.set_active(db, [leaver], False, left_date="2026-11-20")
    handler = Recorder()
    controller = EphemeralController(handler, hostname="127.0.0.1", port=0)
    controller.start()
    try:
        monkeypatch.setenv("PAYRUN_EMAIL_URL", f"smtp://127.0.0.1:{controller.port}")
        tasks.settings.cache_clear()
        runs.start_run(cfg, conn, ledger, db, MONTH)
        work_everything(conn, ledger)
    finally:
        controller.stop()
    assert len(handler.messages) == 12
    by_rcpt = {rcpts[0]: message_from_bytes(content, policy=default_policy) for rcpts, content in handler.messages}
    for snap in payroll.snapshots(db, MONTH):
        msg = by_rcpt[snap["employee"]["email"]]
        text = msg.get_body(preferencelist=("plain",)).get_content()
        first = text.splitlines()[2]
        [pdf] = [p for p in msg.iter_attachments() if p.get_content_type() == "application/pdf"]
        name = pdf.get_filename()
        if snap["employee"]["id"] == leaver:
            assert name == f"salary-slip-{MONTH}-{leaver}-final.pdf", name
            assert msg["Subject"].startswith("Your final salary slip for November 2026 — "), msg["Subject"]
            assert first.startswith("Please find attached your final salary slip for November 2026, your last "
                                    "month with ") and first.endswith("(you left on 2026-11-20)."), first
        else:
            assert "final" not in msg["Subject"] + text, (msg["Subject"], text)
            assert name == f"salary-slip-{MONTH}-{snap['employee']['id']}.pdf", name
        t = slip.totals(snap)
        amounts = [v for v in (*snap["earnings"].values(), *snap["deductions"].values(), *t.values())
                   if isinstance(v, int) and v]
        figures = [slip.format_amount(v) for v in amounts] + [slip.group_lakh(v // 100) for v in amounts if v >= 100_000]
        assert not any(f in msg["Subject"] + text for f in figures), (msg["Subject"], text)


def test_a_run_by_the_version_before_that_left_a_leaver_out_is_counted_and_resumed(world, monkeypatch):
    """A rolling deploy: the version before runs the month (`active = 1`: a November
    leaver gets no slip); the new version's `status` counts them as having no slip (not as
    left out on purpose) and its `run --resume` makes their final slip."""
    from payrun import status

    cfg, conn, db, ledger = world
    runner = CliRunner()
    final = sorted(payroll.employee_ids(db, MONTH))[0]
    assert runner.invoke(cli, ["employee", "left", final, "--on", "2026-11-20"]).exit_code == 0
    with monkeypatch.context() as old:  # the version before's rule, in the queries that read it
        old.setattr(payroll, "IN_MONTH_RUN", "(e.active = 1)")
        runs.start_run(cfg, conn, ledger, db, MONTH)
    assert final not in ledger.employees_with_jobs(MONTH) and len(ledger.employees_with_jobs(MONTH)) == 11
    hr = status.report(cfg, ledger, MONTH)
    assert hr["total"]["no_slip"] == 1 and not any("marked as left" in n for n in hr["notes"]), hr["notes"]
    # not "added after the run" (session 43): they were not; why the run left them out, and the step
    assert not any("added after the run" in n for n in hr["notes"]), hr["notes"]
    assert hr["total"]["no_slip_final"] == 1 and sum(c["no_slip_final"] for c in hr["companies"]) == 1
    note = next(n for n in hr["notes"] if f"who left in {MONTH} or later" in n)
    assert f"{final} (left 2026-11-20)" in note and "an earlier payrun version" in note, note
    assert note.endswith(f"`payrun run --month {MONTH} --resume` makes the slip"), note
    from console.data import Source  # the console's HR line: the same counts, the same reason
    from console.screens.overview import no_slip_lines

    st = Source(cfg, conn).snapshot().status
    assert st["total"] == hr["total"]
    (cid,) = [c["id"] for c in hr["companies"] if c["no_slip_final"]]
    assert no_slip_lines(st) == [f"1 leaver of company {cid} has no slip (the run left them out): "
                                 f"payrun run --month {MONTH} --resume"]
    out = runner.invoke(cli, ["run", "--month", MONTH, "--resume"])
    assert "created 1 render job" in out.output, out.output
    assert final in ledger.employees_with_jobs(MONTH) and status.report(cfg, ledger, MONTH)["total"]["no_slip"] == 0
