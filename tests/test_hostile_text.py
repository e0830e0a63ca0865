"""Text from outside never reaches the operator's terminal as control sequences (security
review, session 39): a mail server's reply quoted in a job's last error is recorded with
its control characters escaped, and an error stored raw (by an older version) is escaped
where `payrun failed`, `payrun job` and the console show it. Real parts: aiosmtpd on
127.0.0.1, Redis, the render worker, the send lanes, the ledger."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from console.failed import FailedFilter, detail, page, short_error
from jobs.events import one_line
from jobs.runtime import RenderWorker, make_queue, run_lanes
from payrun import keys, ledger as ledger_mod, payroll, runs
from payrun.cli import cli
from payrun.text import visible

MONTH = "2026-11"  # the month of conftest's `world`
HOSTILE = "550 5.1.1 \x1b[2J\x1b]0;owned\x07 no such user \x9b31m\u202eresu"


def test_visible_escapes_control_characters_and_keeps_text():
    assert visible("ok: তানভীর আহমেদ, র\u200d্যাব") == "ok: তানভীর আহমেদ, র\u200d্যাব"
    assert visible("a\x1b[2Jb\x07c\x7f\x9b\u202e\u2028") == "a\\x1b[2Jb\\x07c\\x7f\\x9b\\u202e\\u2028"
    assert one_line("x\x1b[31m\n  y", 300) == "x\\x1b[31m y"
    assert len(one_line("\x1b" * 400, 300)) == 300  # the limit holds after escaping


@pytest.fixture
def refusing_smtpd(monkeypatch):
    """aiosmtpd on 127.0.0.1 that answers RCPT for ``refuse`` with HOSTILE."""
    from aiosmtpd.controller import Controller

    class Handler:
        refuse: set[str] = set()

        async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
            if address in self.refuse:
                return HOSTILE
            envelope.rcpt_tos.append(address)
            return "250 OK"

        async def handle_DATA(self, server, session, envelope):
            return "250 OK"

    class EphemeralController(Controller):
        def _trigger_server(self):  # learn the real port before aiosmtpd's readiness probe
            self.port = self.server.sockets[0].getsockname()[1]
            super()._trigger_server()

    handler = Handler()
    controller = EphemeralController(handler, hostname="127.0.0.1", port=0)
    controller.start()
    monkeypatch.setenv("PAYRUN_EMAIL_URL", f"smtp://127.0.0.1:{controller.port}")
    from jobs import tasks

    tasks.settings.cache_clear()
    yield handler
    controller.stop()
    tasks.settings.cache_clear()


def _no_raw_controls(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text and "\u202e" not in text, repr(text)


def test_a_mail_servers_reply_with_escape_sequences_reaches_no_terminal(world, refusing_smtpd):
    cfg, conn, db, ledger = world
    snap = next(iter(payroll.snapshots(db, MONTH)))
    refusing_smtpd.refuse.add(snap["employee"]["email"])
    runs.start_run(cfg, conn, ledger, db, MONTH)
    RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    ledger_mod.drain(conn, ledger)
    job_id = keys.email_job_id(MONTH, snap["employee"]["id"])
    assert ledger.job(job_id)["status"] == "failed"

    # recorded escaped: the ledger, the job's meta in Redis (what `failed` and the console read)
    stored = ledger.job(job_id)["last_error"]
    assert "550" in stored and "\\x1b[2J" in stored and "\\u202e" in stored
    _no_raw_controls(stored)
    _no_raw_controls(json.dumps(json.loads(conn.hget(f"rq:job:{job_id}", "meta")), ensure_ascii=False))

    runner = CliRunner()
    out = runner.invoke(cli, ["failed"])
    assert out.exit_code == 0, out.output
    assert job_id in out.output and "\\x1b[2J" in out.output
    _no_raw_controls(out.output)
    out = runner.invoke(cli, ["job", job_id])
    assert out.exit_code == 0, out.output
    assert "\\x1b[2J" in out.output
    _no_raw_controls(out.output)

    # an error stored raw by an older version: escaped where it is shown
    ledger.db.conn.execute("UPDATE jobs SET last_error = ? WHERE id = ?", (f"SMTP refused: {HOSTILE}", job_id))
    ledger.db.conn.commit()
    meta = json.loads(conn.hget(f"rq:job:{job_id}", "meta"))
    meta["last_error"] = f"SMTP refused: {HOSTILE}"
    conn.hset(f"rq:job:{job_id}", "meta", json.dumps(meta))
    for args in (["failed"], ["job", job_id]):
        out = runner.invoke(cli, args)
        assert out.exit_code == 0 and "\\x1b[2J" in out.output, out.output
        _no_raw_controls(out.output)
    # the console's failed list and job screen
    rows = page(conn, ledger, FailedFilter.parse("")).rows
    for r in rows:
        _no_raw_controls(short_error(r["error"]))
    from console.screens.job import render_detail

    _no_raw_controls(render_detail(detail(conn, ledger, job_id)).plain)


def test_an_http_providers_error_reply_is_quoted_with_its_controls_escaped():
    """The HTTP API's error text goes through the same quoting (jobs.mail._short)."""
    from jobs.errors import PermanentError
    from jobs.mail import transport_for
    from stub_http import answering_posts
    from test_mail import make_msg

    with answering_posts(422, json.dumps({"error": f"bad recipient {HOSTILE}"}).encode()) as url:
        with pytest.raises(PermanentError) as ei:
            transport_for(url, 5).send(make_msg())
    assert "HTTP 422" in str(ei.value) and "\\x1b[2J" in str(ei.value)
    _no_raw_controls(str(ei.value))


def test_a_reminder_message_may_break_lines_but_not_hide_or_reorder_text():
    from payrun.text import message_problem

    assert message_problem("Dear all,\n\tplease check your bank details.\r\nরহিম ক্‌ষ র‍্যা") is None
    assert "control character" in message_problem("a\rb")  # a lone CR rewrites the line it is on
    assert "control character" in message_problem("a\x1b[2Jb")
    assert "U+202E" in message_problem("a\u202eb")
    assert "at most 5,000" in message_problem("x" * 5001)
    assert message_problem("x" * 5000) is None
