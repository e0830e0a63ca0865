"""A rolling deploy, and a roll-back, run two versions of payrun on one data directory for
a while (session 42's deploy drill). The payroll database keeps the columns a later version
added true whichever version writes it: the version before knows nothing of them."""

from __future__ import annotations

import sqlite_utils

from payrun import payroll
from payrun.payroll import AMOUNT_FIELDS

MONTH = "2026-11"


def _db(tmp_path) -> payroll.PayrollDB:
    db = payroll.PayrollDB(tmp_path / "payroll.db")
    payroll.seed(db, companies=1, employees=3, month=MONTH)
    return db


def _as_an_earlier_version(path):
    """The database as the version before left_on and corrected_at writes it: its own
    connection, statements that name neither column."""
    return sqlite_utils.Database(path)


def test_an_earlier_versions_back_then_left_does_not_keep_the_first_leaving_date(tmp_path):
    """Drill: new `employee left emp-00010 --on 2026-11-20`; rolled back, the old `employee
    back` then `employee left` (weeks later) set only `active`; status named them "left
    2026-11-20", the first leaving's date. Now the second leaving is undated, as any mark
    an earlier version made."""
    db = _db(tmp_path)
    emp = "emp-00001"
    payroll.set_active(db, [emp], False, left_date="2026-11-20")
    assert payroll.left_on(db, [emp]) == {emp: "2026-11-20"}
    old = _as_an_earlier_version(db.path)
    with old.conn:
        old.conn.execute("UPDATE employees SET active = 1 WHERE id = ?", (emp,))  # its `employee back`
    with old.conn:
        old.conn.execute("UPDATE employees SET active = 0 WHERE id = ?", (emp,))  # its `employee left`
    assert payroll.left_on(db, [emp]) == {emp: None}
    assert payroll.left_label(payroll.left_on(db, [emp])[emp]) == "left, date not recorded"
    # this version's own marks still record (and correct) the date
    payroll.set_active(db, [emp], True)
    payroll.set_active(db, [emp], False, left_date="2026-12-01")
    assert payroll.left_on(db, [emp]) == {emp: "2026-12-01"}
    payroll.set_active(db, [emp], False, left_date="2026-12-02")  # already left: a date corrected
    assert payroll.left_on(db, [emp]) == {emp: "2026-12-02"}
    # without --on: one call marks and dates those marked now and keeps the others' dates
    # (it was two transactions: a stop between them left a leaver undated)
    other = "emp-00002"
    assert payroll.set_active(db, [emp, other], False, left_date="2026-12-05", redate=False) == [other]
    assert payroll.left_on(db, [emp, other]) == {emp: "2026-12-02", other: "2026-12-05"}


def test_an_earlier_versions_import_of_other_figures_marks_the_line_corrected(tmp_path):
    """Drill: rolled back, the old `payrun import` of a corrected salary upserted the line
    and never set corrected_at; after the next deploy, `payrun resend` called the slip
    "Re-issued", not "Corrected". The database stamps it whoever changes the figures; the
    same figures upserted again, or another column changed, leave it alone."""
    db = _db(tmp_path)
    emp = "emp-00002"
    old = _as_an_earlier_version(db.path)
    cols = ("employee_id", "month", "company_id", *AMOUNT_FIELDS)
    line = dict(zip(cols, old.execute(f"SELECT {', '.join(cols)} FROM salary_lines WHERE employee_id = ? "
                                      "AND month = ?", (emp, MONTH)).fetchone()))
    with old.conn:
        old["salary_lines"].upsert_all([line], pk=("employee_id", "month"))  # the same figures
    assert payroll.corrected_at(db, MONTH, emp) is None
    with old.conn:
        old["salary_lines"].upsert_all([{**line, "basic": line["basic"] + 100_000}], pk=("employee_id", "month"))
    stamped = payroll.corrected_at(db, MONTH, emp)
    assert stamped is not None
    from jobs.policy import reissue_marks

    # as `payrun resend` reads it: a slip delivered before the correction is a corrected one
    marks = reissue_marks("2026-12-06", "2026-12-01T20:00:00.000+00:00", stamped, lambda iso: iso[:10])
    assert marks.get("corrected") is True
    assert payroll.corrected_at(db, MONTH, "emp-00001") is None  # other lines untouched


def test_a_stop_request_of_the_version_before_host_ids_stops_a_send_email_process(conn):
    """Drill (rolling deploy): a console opened before the deploy, or a host's CLI not yet
    updated, asked a new send-email process to stop with the key without a host id
    (payrun:stop:<host>:<pid>): the process listened on its host-id key only, never
    stopped, and the console said it was asked. It takes either request now."""
    import os
    import socket
    import threading

    from jobs.runtime import Intake, make_queue
    from payrun import keys

    asked: list[str] = []
    intake = Intake(conn, [make_queue(keys.EMAIL_QUEUE, conn)], threading.Event(),
                    on_stop_request=lambda: asked.append("stop"))
    intake.poll()
    assert asked == []
    legacy = keys.stop_process(socket.gethostname(), os.getpid())  # as the version before sets it
    conn.set(legacy, "email.host.1 via console", ex=60)
    intake.poll()
    assert asked == ["stop"] and not conn.exists(legacy)  # taken, as its own key is


def _old_lane(conn, name: str, alive: bool = True) -> None:
    """A send-email lane of the version before session 42: an RQ worker record and a
    liveness key, no entry in the senders' hash."""
    from payrun import keys

    conn.sadd("rq:workers", f"rq:worker:{name}")
    conn.hset(f"rq:worker:{name}", mapping={"hostname": "old-host", "pid": "77", "queues": "send-email"})
    if alive:
        conn.set(keys.alive(name), "1", ex=10)


def test_unlisted_senders_are_live_send_lanes_of_processes_without_an_entry():
    from jobs.policy import unlisted_senders

    lanes = ["email.old-host.77.00", "email.old-host.77.01", "email.new-host.5.00", "email.me.1.03",
             "render.old-host.9", "control.old-host.8"]
    assert unlisted_senders(lanes, {"email.new-host.5": {}}, "email.me.1") == {"email.old-host.77"}
    assert unlisted_senders([], {}, "email.me.1") == set()


def test_a_new_process_refused_alone_beside_an_old_hosts_sender_pauses_itself(conn):
    """Rolling deploy, two send-email hosts: the updated one's token is wrong, the other
    still runs the version before session 42, which keeps no entry in the senders' hash.
    The new process saw no other sender, counted its refusals toward an outage, and its
    jobs spent attempts one by one while the old host delivered (the pre-42 story). A live
    send lane with no entry counts as a sender: the new process pauses itself; once that
    lane is gone, a refusal is an outage again."""
    from jobs import senders
    from payrun import keys

    me = senders.HostCredentials("email.new-host.5")
    me._write(conn)
    assert me.refused(conn, "PAYRUN_EMAIL_TOKEN", "HTTP 401") is False  # alone: an outage, as before
    _old_lane(conn, "email.old-host.77.00", alive=False)  # a record whose process died: no sender
    assert me.refused(conn, "PAYRUN_EMAIL_TOKEN", "HTTP 401") is False
    _old_lane(conn, "email.old-host.77.01")
    assert me.refused(conn, "PAYRUN_EMAIL_TOKEN", "HTTP 401") is True and me.paused
    me.look_at_others(conn)
    assert me.paused  # the old host still sends
    conn.delete(keys.alive("email.old-host.77.01"))
    me.look_at_others(conn)
    assert not me.paused
