"""The on-call console against a real Redis with real jobs: Pilot drives the keys
(App.run_test at 80x24), the assertions read Redis, the ledger and the audit log."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from conftest import wait_for
from console import actions
from console.app import ConsoleApp
from console.data import Snapshot, Source
from console.failed import FailedFilter
from jobs.runtime import PayrunJob, make_queue, run_lanes
from payrun import keys, ledger as ledger_mod, payroll, runs, status
from payrun.ledger import Ledger
from payrun.provider import Provider

MONTH = "2026-11"
SIZE = (80, 24)
WRITES = {"set", "setex", "hset", "hsetnx", "hdel", "hincrby", "del", "unlink", "expire", "pexpire", "zadd", "zrem",
          "zremrangebyscore", "lpush", "rpush", "lrem", "lpop", "rpop", "sadd", "srem", "xadd", "xack", "xdel",
          "persist", "rename", "eval", "evalsha", "publish", "incr", "incrby"}


def sync(fn):
    """Run an async Pilot test with asyncio.run (no async pytest plugin needed)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def writes(conn) -> dict[str, int]:
    stats = conn.info("commandstats")
    return {k[len("cmdstat_"):]: v["calls"] for k, v in stats.items() if k[len("cmdstat_"):] in WRITES}


async def settle(pilot, until=lambda: True, timeout_s: float = 20.0, what: str = "the console") -> None:
    """Let thread workers finish and the UI catch up, until ``until()`` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        await pilot.pause()
        if until():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def notified(pilot, app, text: str, what: str = "the console") -> None:
    """Wait until a notification containing ``text`` has been shown."""
    await settle(pilot, lambda: any(text in n.message for n in app._notifications), what=what)


def text_of(app, selector: str) -> str:
    return str(app.screen.query_one(selector).render())


def cells(app, table: str, key: str) -> list[str]:
    return [str(c) for c in app.screen.query_one(table).get_row(key)]


def cell(app, table: str, key: str, column: str) -> str:
    """One cell by its column's key (a narrow terminal leaves some columns out)."""
    return str(app.screen.query_one(table).get_cell(key, column))


# ---- worlds -----------------------------------------------------------------------------

@pytest.fixture
def provider(monkeypatch):
    p = Provider(latency_s=0.01, rate_per_s=1000).start()
    monkeypatch.setenv("PAYRUN_EMAIL_URL", p.url)
    from jobs import tasks

    tasks.settings.cache_clear()
    yield p
    p.stop()


@pytest.fixture
def payrun_world(cfg, conn, provider):
    """Company 1's run done (one slip refused by the provider), company 2 fanned out and
    waiting: real fan-out, real render and send lanes, the ledger applied."""
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=2, employees=8, seed=3, month=MONTH)
    ledger = Ledger(cfg.ledger_path)
    first = db.conn.execute("SELECT id FROM employees WHERE company_id = 1 ORDER BY id LIMIT 1").fetchone()[0]
    db.conn.execute("UPDATE employees SET email = 'nobody@nowhere.invalid' WHERE id = ?", (first,))
    db.conn.commit()
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)
    run_lanes(conn, [keys.RENDER_QUEUE], lanes=2, burst=True)
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    runs.start_run(cfg, conn, ledger, db, MONTH, company_id=2)
    ledger_mod.drain(conn, ledger)
    n1, n2 = (db.conn.execute("SELECT COUNT(*) FROM employees WHERE company_id = ?", (c,)).fetchone()[0] for c in (1, 2))
    yield cfg, conn, ledger, first, n1, n2
    ledger.close()
    db.close()


@pytest.fixture
def failed_world(cfg, conn, monkeypatch):
    """Seven jobs failed for good by real lanes: 3 refused functions and 2 TypeErrors on
    pdf-render, 2 refused on send-email; each with a ledger row (company 1 or 2)."""
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    ledger = Ledger(cfg.ledger_path)
    plan = [("r-refused-1", keys.RENDER_QUEUE, "jobs.testing.nope", (), 1),
            ("r-refused-2", keys.RENDER_QUEUE, "jobs.testing.nope", (), 2),
            ("r-refused-3", keys.RENDER_QUEUE, "jobs.testing.nope", (), 1),
            ("r-typeerr-1", keys.RENDER_QUEUE, "jobs.testing.sleep", ("x",), 1),
            ("r-typeerr-2", keys.RENDER_QUEUE, "jobs.testing.sleep", ("x",), 2),
            ("e-refused-1", keys.EMAIL_QUEUE, "jobs.testing.nope", (), 1),
            ("e-refused-2", keys.EMAIL_QUEUE, "jobs.testing.nope", (), 2)]
    ledger.create_jobs([{"id": j, "kind": "render" if q == keys.RENDER_QUEUE else "email", "company_id": c,
                         "month": MONTH, "queue": q} for j, q, _, _, c in plan])
    for job_id, q, func, args, _ in plan:
        make_queue(q, conn).enqueue_call(func, args=args, job_id=job_id, timeout=5, meta={"kind": "test"})
    run_lanes(conn, [keys.RENDER_QUEUE, keys.EMAIL_QUEUE], lanes=2, burst=True)
    ledger_mod.drain(conn, ledger)
    assert conn.zcard(f"rq:failed:{keys.RENDER_QUEUE}") == 5 and conn.zcard(f"rq:failed:{keys.EMAIL_QUEUE}") == 2
    yield cfg, conn, ledger
    ledger.close()


def make_app(cfg, conn, **kw) -> ConsoleApp:
    kw.setdefault("no_blink", True)
    return ConsoleApp(Source(cfg, conn), **kw)


# ---- the layering -------------------------------------------------------------------------

def test_console_cli_and_data_layer_never_import_textual():
    code = ("import sys, console.cli, console.data, console.actions, console.failed, console.fmt, payrun.cli; "
            "print(any(m == 'textual' or m.startswith('textual.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the overview ----------------------------------------------------------------------

@sync
async def test_overview_shows_the_right_numbers(payrun_world):
    cfg, conn, ledger, bad, n1, n2 = payrun_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None and app.snapshot.status, what="first refresh")
        snap = app.snapshot
        assert snap.error is None
        # the HR line: the same figures as `payrun status`
        report = status.report(cfg, ledger, conn=conn)
        assert snap.status["total"] == report["total"]
        assert report["total"] | {} == {"queued": n2, "running": 0, "retrying": 0, "done": n1 - 1, "failed": 1,
                                        "stuck": 0, "total": n1 + n2, "no_slip": 0, "no_salary_line": 0,
                                        "no_slip_final": 0}
        answer = text_of(app, "#answer")
        assert f"{n1 - 1} sent, {n2} in progress, 1 failed" in answer
        assert cells(app, "#companies", "1")[2:7] == [str(n1 - 1), "0", "0", "1", str(n1)]
        assert cells(app, "#companies", "2")[2:7] == ["0", str(n2), "0", "0", str(n2)]
        # the queues: company 2 waits to render; one send failed for good
        render = cells(app, "#queues", keys.RENDER_QUEUE)
        assert render[1:6] == [str(n2), "0", "0", "0", "0"]  # waiting, running, retry, later, failed
        assert render[6].endswith("s")  # age of the oldest waiting job
        assert cells(app, "#queues", keys.EMAIL_QUEUE)[1:6] == ["0", "0", "0", "0", "1"]
        # throughput: the renders and sends of company 1 finished within the last minute
        q = {r.name: r for r in snap.queues}
        # (the last two minutes: the world's set-up and the console's start may cross a minute)
        assert sum(q[keys.RENDER_QUEUE].per_min[-2:]) == n1 and sum(q[keys.EMAIL_QUEUE].per_min[-2:]) == n1 - 1
        assert "50" in text_of(app, "#limits")
        # Enter on the send-email row drills down to its failed jobs
        table = app.screen.query_one("#queues")
        table.focus()
        table.move_cursor(row=table.get_row_index(keys.EMAIL_QUEUE))
        await pilot.press("enter")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None, what="failed page")
        assert app.screen.page.total == 1
        assert app.screen.page.rows[0]["id"] == keys.email_job_id(MONTH, bad)
        assert "refused" in app.screen.page.rows[0]["error"].lower() or app.screen.page.rows[0]["error"]
        await pilot.press("escape")
        assert app.screen.CRUMB == "overview"


def add_late_employee(db, like: str, new_id: str, month: str) -> None:
    """A copy of employee ``like`` (same company) with salary lines for ``month`` only:
    someone imported after that month was run."""
    for table, key in (("employees", "id"), ("salary_lines", "employee_id")):
        cols = [r[1] for r in db.conn.execute(f"PRAGMA table_info({table})")]
        sel = ", ".join("?" if c == key else c for c in cols)
        where = f"{key} = ?" + (" AND month = ?" if table == "salary_lines" else "")
        db.conn.execute(f"INSERT INTO {table} ({', '.join(cols)}) SELECT {sel} FROM {table} WHERE {where}",
                        (new_id, like, month) if table == "salary_lines" else (new_id, like))
    db.conn.commit()


@sync
async def test_the_overview_steps_through_months_and_counts_employees_with_no_slip(payrun_world):
    """HR asks about November while December runs: m steps back a month (pinned), and the
    HR line counts who has salary lines and no slip, as `payrun status` does."""
    cfg, conn, ledger, bad, n1, n2 = payrun_world
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.ensure_month(db, "2026-12")
    runs.start_run(cfg, conn, ledger, db, "2026-12", company_id=1)  # the run started last
    add_late_employee(db, bad, "emp-90001", MONTH)
    december_2 = payroll.count_employees(db, "2026-12", 2)  # company 2 is not in December's run
    db.close()
    report = status.report(cfg, ledger, month=MONTH, conn=conn)
    assert report["total"]["no_slip"] == 1
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None and app.snapshot.status, what="first refresh")
        assert app.snapshot.status["month"] == "2026-12"
        # as `payrun status`: company 2 has December salary lines and no slip (never run)
        assert app.snapshot.status["total"]["no_slip"] == december_2 > 0
        assert app.snapshot.status["total"] == status.report(cfg, ledger, month="2026-12", conn=conn)["total"]
        # ... and says why as it does (a walkthrough saw "added after the run" for a company never run)
        assert (f"{december_2:,} employees of company 2 have no slip (never run): payrun run --month 2026-12 "
                "--company 2") in text_of(app, "#answer")
        assert "(pinned)" not in text_of(app, "StatusBar")
        await pilot.press("m")
        await settle(pilot, lambda: app.snapshot.status["month"] == MONTH, what="November")
        st = app.snapshot.status
        assert st["total"] == report["total"]  # the same figures as `payrun status --month`
        assert [c["no_slip"] for c in st["companies"]] == [1, 0]
        answer = text_of(app, "#answer")
        assert "1 with no slip yet" in answer and "1 employee of company 1 has no slip (added after the run)" in answer
        assert f"payrun run --month {MONTH} --resume" in answer
        assert f"{MONTH} (pinned)" in text_of(app, "StatusBar")
        await pilot.press("m")  # nothing before November: back to following the latest run
        await settle(pilot, lambda: app.snapshot.status["month"] == "2026-12", what="back to December")
        assert app.source.month is None
        await pilot.press("colon", *f"month {MONTH}", "enter")
        await settle(pilot, lambda: app.snapshot.status["month"] == MONTH, what=":month")
        assert app.snapshot.status["total"]["no_slip"] == 1
        with payroll.PayrollDB(cfg.payroll_path) as db:  # what the yellow line says to do
            assert runs.start_run(cfg, conn, ledger, db, MONTH, resume=True).added == [1]
        await settle(pilot, lambda: app.snapshot.status["total"]["no_slip"] == 0, what="the top-up counted")
        assert "no slip" not in text_of(app, "#answer")
        await pilot.press("colon", *"month 2025-01", "enter")
        await pilot.pause()
        assert app.source.month == MONTH  # an unknown month is refused, the view stays
        await pilot.press("colon", *"month latest", "enter")
        await settle(pilot, lambda: app.snapshot.status["month"] == "2026-12", what=":month latest")
    from payrun.cli import cli

    runner = CliRunner()
    for bad_month, said in (("2026-13", "YYYY-MM"), ("2025-01", f"runs: {MONTH}, 2026-12")):
        out = runner.invoke(cli, ["console", "--month", bad_month])
        assert out.exit_code == 2 and said in out.output, out.output


def test_looking_never_writes_to_redis(payrun_world):
    cfg, conn, ledger, bad, *_ = payrun_world
    src = Source(cfg, conn)
    before = writes(conn)
    snap = src.snapshot()
    src.failed_page(FailedFilter())
    src.failed_page(FailedFilter.parse("company:1 nowhere"))
    src.failed_ids(FailedFilter.parse("queue:send-email"))
    src.job_detail(keys.email_job_id(MONTH, bad))
    assert snap.error is None and snap.queues
    after = writes(conn)
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {}


def test_the_job_view_names_whom_the_email_is_for_as_payrun_job_does(payrun_world):
    """`payrun job` names the recipient (session 42, HR: "which address did it go to?"); the
    console's job view, the on-call's, said nothing of it."""
    from click.testing import CliRunner

    from console.screens.job import render_detail
    from payrun.cli import cli

    cfg, conn, ledger, bad, *_ = payrun_world
    src = Source(cfg, conn)
    send = keys.email_job_id(MONTH, bad)
    d = src.job_detail(send)
    assert d["recipient"]["email"] == "nobody@nowhere.invalid" and d["recipient"]["employee_id"] == bad, d
    assert d["recipient_send"] is None
    cli_line = next(line for line in CliRunner().invoke(cli, ["job", send], catch_exceptions=False).output.splitlines()
                    if line.startswith("to: "))
    assert cli_line in render_detail(d, cfg.timezone).plain
    render_id = next(i for i in ledger.ids_of_employee(bad) if i.startswith("render"))
    r = src.job_detail(render_id)
    assert r["recipient_send"] == send and "for: " in render_detail(r, cfg.timezone).plain, r
    assert src.job_detail("render-nothing-here").get("recipient") is None


def test_json_twins(payrun_world):
    from payrun.cli import cli

    cfg, conn, ledger, bad, n1, n2 = payrun_world
    runner = CliRunner()
    q = json.loads(runner.invoke(cli, ["queues", "--json"], catch_exceptions=False).output)
    by = {r["name"]: r for r in q["queues"]}
    assert by[keys.RENDER_QUEUE]["depth"] == n2 and by[keys.EMAIL_QUEUE]["failed"] == 1
    assert q["limits"]["cap"] == cfg.limits.email_concurrency
    assert json.loads(runner.invoke(cli, ["workers", "--json"], catch_exceptions=False).output) == []
    assert json.loads(runner.invoke(cli, ["running", "--json"], catch_exceptions=False).output) == []
    text = runner.invoke(cli, ["queues"], catch_exceptions=False).output
    assert keys.RENDER_QUEUE in text and "per min" in text


# ---- failed jobs and retry -----------------------------------------------------------------

@sync
async def test_retry_all_filtered_requeues_exactly_the_matching_jobs(failed_world):
    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("f")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None, what="failed page")
        assert app.screen.page.total == 7
        await pilot.press("slash")
        await pilot.press(*"queue:pdf-render refused")
        await pilot.press("enter")
        await settle(pilot, lambda: app.screen.page.flt.text == "refused" and app.screen.page.total == 3,
                     what="filtered page")
        assert sorted(r["id"] for r in app.screen.page.rows) == ["r-refused-1", "r-refused-2", "r-refused-3"]
        await pilot.press("A")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped", what="bulk preview")
        dialog = app.screen
        assert dialog.count == 3 and sorted(dialog.sample) == ["r-refused-1", "r-refused-2", "r-refused-3"]
        assert dialog.command == "payrun retry --all --queue pdf-render --error refused"
        await pilot.press("2", "enter")  # the wrong count does nothing
        assert app.screen is dialog and conn.llen(f"rq:queue:{keys.RENDER_QUEUE}") == 0
        await pilot.press("3", "enter")
        await settle(pilot, lambda: conn.llen(f"rq:queue:{keys.RENDER_QUEUE}") == 3, what="the retry")
    queued = sorted(m.decode() for m in conn.lrange(f"rq:queue:{keys.RENDER_QUEUE}", 0, -1))
    assert queued == ["r-refused-1", "r-refused-2", "r-refused-3"]
    assert sorted(m.decode() for m in conn.zrange(f"rq:failed:{keys.RENDER_QUEUE}", 0, -1)) == ["r-typeerr-1",
                                                                                                 "r-typeerr-2"]
    assert conn.zcard(f"rq:failed:{keys.EMAIL_QUEUE}") == 2
    job = PayrunJob.fetch("r-refused-2", connection=conn)
    assert job.get_status() == "queued" and "last_error" not in job.meta
    entry = actions.read_audit(cfg)[-1]
    assert entry["what"] == "retry" and entry["count"] == 3 and entry["via"] == "console"
    assert entry["command"] == "payrun retry --all --queue pdf-render --error refused" and entry["who"]


async def _type_burst_failed_company_2(app, pilot):
    """`:failed company:2` and Enter, every key queued at once as a terminal delivers a
    paste; waits for company 2's three failed jobs."""
    from textual import events

    burst = [("colon", ":")] + [(c if c.isalnum() else {" ": "space", ":": "colon"}[c], c)
                                for c in "failed company:2"] + [("enter", None)]
    for key, ch in burst:
        app.post_message(events.Key(key, ch))
    await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 3,
                 what="company 2's failed jobs, from the command")


@sync
async def test_a_command_typed_in_one_burst_is_a_command_not_hotkeys(failed_world):
    """Walkthrough: `:failed company:2` pasted (or typed fast) into tmux opened the plain
    failed view: the keys after `:` arrived before the bar had focus and ran as hotkeys
    (f: failed, then a: …). `:drain` would have started with d."""
    from textual import events

    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await _type_burst_failed_company_2(app, pilot)
        assert app.typeahead is None and not app.screen.query("#command-bar")
        # Esc in the burst: the bar closes, nothing typed after `:` runs as a hotkey
        for key, ch in [("colon", ":"), ("d", "d"), ("escape", None)]:
            app.post_message(events.Key(key, ch))
        await settle(pilot, lambda: app.typeahead is None and not app.screen.query("#command-bar"), what="closed")
        assert type(app.screen).__name__ == "FailedScreen"  # no drain dialog
        # half the command before the bar has focus, half after: one command, not the last half
        for key, ch in [("colon", ":"), ("o", "o"), ("v", "v")]:
            app.post_message(events.Key(key, ch))
        await settle(pilot, lambda: app.typeahead is None and app.screen.query("#command-bar"), what="the bar")
        await pilot.press("e", "r")
        assert app.screen.query_one("#command-bar").value == "over"
        await pilot.press("escape")
        # a terminal sends a paste as one event: after `:`, and `:failed …` pasted whole
        app.post_message(events.Key("colon", ":"))
        app.post_message(events.Paste("running"))
        await settle(pilot, lambda: app.typeahead is None and app.screen.query("#command-bar"), what="the bar")
        assert app.screen.query_one("#command-bar").value == "running"
        await pilot.press("escape")
        await settle(pilot, lambda: not app.screen.query("#command-bar"), what="closed")
        app.post_message(events.Paste(":failed company:1\r"))
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.flt.company == 1,
                     what=":failed company:1 pasted")
        # a bar that never takes focus must not leave the console swallowing keys
        app.typeahead, app._typeahead_since = [], time.monotonic() - 5
        await pilot.press("escape")  # back to the overview, as a key does
        await settle(pilot, lambda: type(app.screen).__name__ == "OverviewScreen", what="keys work again")
        assert app.typeahead is None


@sync
async def test_a_command_typed_in_one_burst_reaches_the_bar_of_a_read_only_console(failed_world):
    """New-user walkthrough (session 35): in `payrun console --readonly`, `:failed company:2`
    pasted into tmux became `:faie company:2`: l and d, keys of disabled actions (limits,
    drain), were refused with a warning on their way in, before `:` had opened the bar."""
    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await _type_burst_failed_company_2(app, pilot)
        assert app.screen.page.flt.company == 2
        # a disabled key alone still says why it does nothing
        await pilot.press("escape")
        await settle(pilot, lambda: type(app.screen).__name__ == "OverviewScreen", what="the overview")
        await pilot.press("d")
        await notified(pilot, app, "read-only console: d", what="the read-only warning")


@sync
async def test_retry_selected_and_one_by_company(failed_world):
    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"failed company:2", "enter")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 3,
                     what="company 2's failed jobs")
        assert {r["id"] for r in app.screen.page.rows} == {"r-refused-2", "r-typeerr-2", "e-refused-2"}
        await pilot.press("r")  # one job: a keypress
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
        one = app.screen.command
        await pilot.press("y")
        await settle(pilot, lambda: sum(conn.llen(f"rq:queue:{q}") for q in keys.QUEUES) == 1, what="one retry")
        assert one.startswith("payrun retry ")
        ledger_mod.drain(conn, ledger)  # what `payrun ledger` does within a second
        await settle(pilot, lambda: app.screen.page.total == 2 and len(app.screen.page.rows) == 2,
                     what="the page to drop the retried job")
        await pilot.press("space", "space", "R")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped")
        assert app.screen.count == 2
        await pilot.press("2", "enter")
        await settle(pilot, lambda: sum(conn.llen(f"rq:queue:{q}") for q in keys.QUEUES) == 3, what="bulk retry")
    assert conn.zcard(f"rq:failed:{keys.RENDER_QUEUE}") + conn.zcard(f"rq:failed:{keys.EMAIL_QUEUE}") == 4
    assert [e["count"] for e in actions.read_audit(cfg)] == [1, 2]


@sync
async def test_retry_selected_with_one_row_retries_that_row_and_permanent_failures_say_so(failed_world):
    """Walkthrough: space selects a row and moves the cursor down, and R with one row
    selected retried the row under the cursor, another job. And a job that failed on its
    data (an address refused) looked like any other, its retry offered with no word that it
    fails again: the list marks it, the dialogs say it."""
    cfg, conn, ledger = failed_world
    refused = "HTTP 422 invalid recipient address: 'rina.das.15@doel.invalid' (domain does not exist)"
    for job_id, permanent, error in (("e-refused-2", True, f"provider 127.0.0.1:9: {refused}"),
                                     ("e-refused-1", False, "provider 127.0.0.1:9: HTTP 503 down")):
        meta = json.loads(conn.hget(f"rq:job:{job_id}", "meta"))  # (one failed on its data, one ran out of tries)
        conn.hset(f"rq:job:{job_id}", "meta", json.dumps({**meta, "permanent": permanent, "last_error": error}))
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"failed queue:send-email", "enter")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 2,
                     what="the send-email failed jobs")
        rows = {r["id"]: r for r in app.screen.page.rows}
        assert rows["e-refused-2"]["permanent"] and not rows["e-refused-1"]["permanent"]
        assert cell(app, "#failed", "e-refused-2", "why") == "data" and cell(app, "#failed", "e-refused-1", "why") == ""
        shown = cell(app, "#failed", "e-refused-2", "error")  # (no "provider host:port: "; at 80 columns cut at a word)
        assert shown.startswith("HTTP 422 invalid recipient") and refused.startswith(shown.removesuffix("…")), shown
        assert "failed on the employee's data" in text_of(app, "#failed-summary")
        first = app.screen.query_one("#failed").current_key
        await pilot.press("space", "R")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
        assert app.screen.command == f"payrun retry {first}"  # the selected row, not the one under the cursor
        assert ("fails again" in app.screen.body) == (first == "e-refused-2")
        # the refused address and the reason whole (an HR drill read "(domain does not ): a retry")
        assert (f"({refused}): a retry" in app.screen.body) == (first == "e-refused-2")
        await pilot.press("n")
        await settle(pilot, lambda: type(app.screen).__name__ == "FailedScreen")
        await pilot.press("A")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped")
        assert app.screen.count == 2 and app.screen.note.startswith("1 of them failed on the employee's data")
        await pilot.press("escape")
    assert conn.llen(f"rq:queue:{keys.EMAIL_QUEUE}") == 0  # nothing retried


@sync
async def test_retry_from_the_job_detail_says_a_job_refused_for_its_data_fails_again(failed_world):
    """Drill: the failed list's r warned that a refused address fails again unless fixed;
    the job detail's r, on the same job, offered "Requeue it" and nothing more."""
    cfg, conn, ledger = failed_world
    refused = "HTTP 422 invalid recipient address: 'rina.das.15@doel.invalid' (domain does not exist)"
    meta = json.loads(conn.hget("rq:job:e-refused-2", "meta"))
    conn.hset("rq:job:e-refused-2", "meta", json.dumps({**meta, "permanent": True,
                                                        "last_error": f"provider 127.0.0.1:9: {refused}"}))
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"failed queue:send-email", "enter")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 2)
        table = app.screen.query_one("#failed")
        table.move_cursor(row=table.get_row_index("e-refused-2"))
        await pilot.press("enter")
        await settle(pilot, lambda: getattr(app.screen, "detail", None) is not None, what="job detail")
        assert app.screen.detail["permanent"] and not app.screen.detail["address_changed"]
        await pilot.press("r")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the retry dialog")
        assert "fails again unless the employee was fixed first" in app.screen.body, app.screen.body
        assert app.screen.command == "payrun retry e-refused-2"
        await pilot.press("n")
    assert conn.llen(f"rq:queue:{keys.EMAIL_QUEUE}") == 0  # nothing retried


@sync
async def test_a_failed_page_past_the_end_after_a_retry_shows_the_last_page(failed_world):
    """Drill: on page 2 of a company's failed jobs, A retried them all and the view read
    "0 failed · page 2/1"; a list shrunk by retries elsewhere left an empty page."""
    from console.screens.failed import FailedScreen

    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        app.push_screen(FailedScreen(page_size=3))
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 7)
        await pilot.press("n", "n")
        await settle(pilot, lambda: app.screen.page.offset == 6, what="page 3")
        actions.retry(cfg, conn, ["r-refused-1", "r-refused-2", "r-refused-3", "r-typeerr-1"], via="test")
        app.refresh_now()
        await settle(pilot, lambda: app.screen.page.total == 3, what="the shrunk list")
        assert app.screen.page.offset == 0 and len(app.screen.page.rows) == 3
        assert "3 failed · page 1/1" in text_of(app, "#failed-summary")


@sync
async def test_a_bad_failed_filter_typed_after_colon_opens_nothing_and_a_misspelt_key_is_said(failed_world):
    """Drill: `:failed queue:nosuch` said "unknown queue" over the failed view opened with
    no filter (every failed job); `/compny:2` read "0 failed · filter: compny:2", as if
    company 2 had none (it was matched as text in the last error)."""
    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"failed queue:nosuch", "enter")
        await notified(pilot, app, "unknown queue 'nosuch'", what="the refusal")
        assert type(app.screen).__name__ == "OverviewScreen"
        await pilot.press("colon", *"failed compny:2", "enter")
        await notified(pilot, app, "compny:2: not a filter key", what="the misspelt key said")
        assert FailedFilter.unknown_keys("company:2 queue:send-email address: refused") == []


@sync
async def test_retry_with_options_in_the_command_bar_is_refused_not_taken_for_a_job_id(failed_world):
    """`:retry --all` opened "Retry --all?" behind a one-key confirmation (a job id)."""
    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"retry --all", "enter")
        await notified(pilot, app, ":retry takes job ids", what="the refusal")
        assert type(app.screen).__name__ == "OverviewScreen"


@sync
async def test_retry_of_an_id_that_is_no_failed_job_is_said_before_any_confirmation(failed_world):
    """Console drill (session 38): `:retry nosuch-job` opened "Retry nosuch-job?" and was
    refused only after the y. The ids are looked up first (off the keyboard's thread): none
    failed, nothing is offered; some, only the failed ones are."""
    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"retry nosuch-job", "enter")
        await notified(pilot, app, "not among failed jobs: nosuch-job", what="the refusal")
        assert type(app.screen).__name__ == "OverviewScreen"
        await pilot.press("colon", *"retry nosuch-job e-refused-1", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the confirmation")
        assert app.screen.title_text == "Retry e-refused-1?"
        await pilot.press("y")
        await notified(pilot, app, "requeued 1 job(s)", what="the retry")
    assert conn.zscore(f"rq:failed:{keys.EMAIL_QUEUE}", "e-refused-1") is None
    assert conn.zcard(f"rq:failed:{keys.RENDER_QUEUE}") == 5


@sync
async def test_the_view_under_a_dialog_stays_live_and_a_job_detail_reloads(failed_world):
    """Walkthrough: with a confirmation open the view under it stopped updating while its
    header still said "live"; the job detail never showed a retry's outcome."""
    cfg, conn, ledger = failed_world
    now = [1_800_000_000.0]
    app = ConsoleApp(Source(cfg, conn, clock=lambda: now[0]), clock=lambda: now[0], no_blink=True, poll=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        overview = app.screen
        await pilot.press("d")  # a confirmation over the overview
        await settle(pilot, lambda: type(app.screen).__name__ in ("ConfirmKey", "ConfirmTyped"))
        assert app.live_screen() is overview
        shown = []
        overview.show_snapshot, real = (lambda snap: (shown.append(snap), real(snap))), overview.show_snapshot
        app.refresh_now()
        await settle(pilot, lambda: shown, what="a refresh to reach the view under the dialog")
        await pilot.press("escape")
        await settle(pilot, lambda: app.screen is overview)

        await pilot.press("colon", *"failed queue:pdf-render TypeError", "enter")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 2)
        await pilot.press("enter")
        await settle(pilot, lambda: getattr(app.screen, "detail", None) is not None, what="job detail")
        job_id = app.screen.detail["id"]
        assert app.screen.detail["rq_status"] == "failed"
        actions.retry(cfg, conn, [job_id], via="test")  # (elsewhere: the CLI)
        app.screen._loaded_at -= app.screen.RELOAD_S  # (its last read as old as a reload wants)
        app.refresh_now()  # the next refresh reads it again
        await settle(pilot, lambda: app.screen.detail.get("rq_status") == "queued", what="the detail to reload")


@sync
async def test_job_detail_shows_attempts_and_traceback(failed_world):
    cfg, conn, ledger = failed_world
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"failed queue:pdf-render TypeError", "enter")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 2)
        await pilot.press("enter")
        await settle(pilot, lambda: getattr(app.screen, "detail", None) is not None, what="job detail")
        shown = text_of(app, "#job")
        assert "TypeError" in shown and "#1" in shown and "Traceback" in shown
        assert "in Redis: failed" in shown  # (it read "JobStatus.FAILED")
        # attempt times on the console's clock (Asia/Dhaka by default), and it says so
        detail = app.screen.detail
        started = detail["ledger"]["history"][0]["started_at"]
        from console.data import parse_ts
        from console.fmt import clock

        assert f"attempts ({cfg.timezone})" in shown and f"#1 {clock(parse_ts(started), cfg.timezone)}" in shown
        # retried meanwhile (elsewhere): r says it is not failed instead of offering a retry
        # that requeues nothing and is audited as one
        from console import actions

        job_id = detail["id"]
        actions.retry(cfg, conn, [job_id], via="test")
        app.screen.reload()
        await settle(pilot, lambda: app.screen.detail.get("rq_status") == "queued", what="the detail reloaded")
        await pilot.press("r")
        await pilot.pause()
        assert type(app.screen).__name__ == "JobScreen"  # no confirmation asked
        audit_lines = (cfg.home / "audit.log").read_text().splitlines()
        with pytest.raises(actions.ActionError, match=f"not among failed jobs: {job_id}"):
            actions.retry(cfg, conn, [job_id], via="test")
        assert (cfg.home / "audit.log").read_text().splitlines() == audit_lines  # nothing done, nothing audited


@sync
async def test_a_failed_job_with_no_data_shows_what_it_lacks_not_the_raw_hash(cfg, conn):
    """A failed job whose hash has no ``data`` (written by hand, or left so by rq), as
    `payrun failed` lists it ("job data missing"): the failed list says so too, and its
    detail says what is missing and which fields the hash has, not RQ's "NoSuchJobError:
    Unexpected job format: {…}" with every raw value; r refuses at once, as payrun retry does."""
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    conn.hset("rq:job:poison-1", mapping={"status": "failed", "origin": keys.EMAIL_QUEUE, "created_at": now,
                                          "ended_at": now, "description": "secret-looking-value"})
    conn.zadd(f"rq:failed:{keys.EMAIL_QUEUE}", {"poison-1": time.time() + 3600})
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("f")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 1)
        assert "job data missing" in app.screen.page.rows[0]["error"]
        await pilot.press("r")  # (the list's r offered y/n on it: session 40)
        await notified(pilot, app, "poison-1 cannot be retried: job data missing", what="the refusal")
        assert type(app.screen).__name__ == "FailedScreen"  # no confirmation offered
        await pilot.press("enter")
        await settle(pilot, lambda: getattr(app.screen, "detail", None) is not None, what="job detail")
        shown = text_of(app, "#job")
        assert "in Redis: failed" in shown
        assert "job data missing (its Redis hash has no 'data' field)" in shown
        assert "fields in its hash: created_at, description, ended_at, origin, status" in shown
        assert "Unexpected job format" not in shown and "secret-looking-value" not in shown
        # what it lacks, that it never ran, that it cannot be retried: one clear line (session 40)
        assert ("job data missing (its Redis hash has no 'data' field): it was never run, and it cannot be "
                "retried (`payrun retry` refuses it: nothing to run)") in " ".join(shown.split()), shown
        await pilot.press("r")
        await notified(pilot, app, "nothing to retry")
        assert type(app.screen).__name__ == "JobScreen"  # no confirmation offered
    assert not (cfg.home / "audit.log").exists() or "poison-1" not in (cfg.home / "audit.log").read_text()


def _no_data_and_not_json(conn) -> None:
    """Two failed jobs payrun cannot read: a hash with no ``data`` field, and one whose data
    is not JSON (as a worker fails them: tests/test_poison.py)."""
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    for job_id, q, extra in (("poison-nodata", keys.EMAIL_QUEUE, {}),
                             ("poison-notjson", keys.RENDER_QUEUE, {"data": b"hello"})):
        conn.hset(f"rq:job:{job_id}", mapping={"status": "failed", "origin": q, "created_at": now, "ended_at": now,
                                               "meta": json.dumps({"kind": "test", "last_error": "job data "
                                                                   "unreadable: x"}), **extra})
        conn.zadd(f"rq:failed:{q}", {job_id: time.time() + 3600})


@sync
async def test_retry_of_a_failed_job_with_no_data_says_at_once_it_cannot_be_retried(failed_world):
    """Console drill (session 40): `:retry poison-nodata` (a failed job whose hash has no
    data) asked "Retry poison-nodata? y/n" and the y met `payrun retry`'s refusal. It is said
    at once, with why, as an id that is no failed job is; among good ids only those are
    offered."""
    cfg, conn, ledger = failed_world
    _no_data_and_not_json(conn)
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"retry poison-nodata", "enter")
        await notified(pilot, app, "poison-nodata cannot be retried: job data missing (its Redis hash has no "
                                   "'data' field)", what="the refusal")
        assert any("nothing to retry" in n.message for n in app._notifications)
        assert type(app.screen).__name__ == "OverviewScreen"  # no confirmation offered
        await pilot.press("colon", *"retry poison-notjson", "enter")
        await notified(pilot, app, "poison-notjson cannot be retried: job data unreadable (its 'data' field is "
                                   "not JSON)", what="the refusal")
        assert type(app.screen).__name__ == "OverviewScreen"
        await pilot.press("colon", *"retry poison-nodata e-refused-1 poison-notjson", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the confirmation")
        assert app.screen.title_text == "Retry e-refused-1?" and app.screen.command == "payrun retry e-refused-1"
        await pilot.press("n")
    assert conn.zscore(f"rq:failed:{keys.EMAIL_QUEUE}", "poison-nodata") is not None
    assert not (cfg.home / "audit.log").exists()  # nothing done


@sync
async def test_retry_by_id_of_a_send_refused_for_an_address_fixed_since_says_it_goes_to_the_new_one(payrun_world):
    """Console drill (session 40): the failed list's r said a send refused for an address HR
    has fixed since goes to the new one (`payrun failed`/`retry` say so too); `:retry ID` on
    the same job said only "requeue with a fresh attempt budget"."""
    cfg, conn, ledger, bad, *_ = payrun_world
    job_id = keys.email_job_id(MONTH, bad)
    with payroll.PayrollDB(cfg.payroll_path) as db:
        db.conn.execute("UPDATE employees SET email = 'fixed@payroll.example' WHERE id = ?", (bad,))
        db.conn.commit()
    other = conn.zrange(f"rq:failed:{keys.EMAIL_QUEUE}", 0, -1)
    assert [o.decode() for o in other] == [job_id]
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *f"retry {job_id}", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the confirmation")
        body = app.screen.body
        assert "the retry sends it to the new address (fixed@payroll.example)" in body, body
        assert "nobody@nowhere.invalid" in body  # the refused one, whole
        await pilot.press("y")
        await notified(pilot, app, "requeued 1 job(s)", what="the retry")
    job = PayrunJob.fetch(job_id, connection=conn)
    assert job.args[0]["to"] == "fixed@payroll.example"


@sync
async def test_retry_of_several_ids_says_how_many_go_to_an_address_fixed_since(payrun_world, monkeypatch):
    cfg, conn, ledger, bad, *_ = payrun_world
    job_id = keys.email_job_id(MONTH, bad)
    _no_data_and_not_json(conn)
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    make_queue(keys.RENDER_QUEUE, conn).enqueue_call("jobs.testing.nope", job_id="r-refused-1", timeout=5,
                                                     meta={"kind": "test"})
    run_lanes(conn, [keys.RENDER_QUEUE], lanes=1, burst=True)
    assert conn.zscore(f"rq:failed:{keys.RENDER_QUEUE}", "r-refused-1") is not None
    with payroll.PayrollDB(cfg.payroll_path) as db:
        db.conn.execute("UPDATE employees SET email = 'fixed@payroll.example' WHERE id = ?", (bad,))
        db.conn.commit()
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *f"retry {job_id} r-refused-1 poison-nodata", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped", what="the confirmation")
        assert app.screen.count == 2 and app.screen.sample == [job_id, "r-refused-1"]
        assert ("1 of them had an address refused that the payroll data has changed since: it goes to the new one"
                in app.screen.note), app.screen.note
        assert any("poison-nodata cannot be retried" in n.message for n in app._notifications)
        await pilot.press("escape")
    assert conn.zscore(f"rq:failed:{keys.EMAIL_QUEUE}", job_id) is not None  # nothing retried


def test_a_job_detail_never_shows_rqs_raw_hash(cfg, conn, monkeypatch):
    """RQ's "Unexpected job format: {…}" is the whole hash, every value: when the look at
    what the job lacks cannot be made (Redis went away between the two reads), the detail
    says the error without it."""
    from console import failed

    conn.hset("rq:job:poison-1", mapping={"status": "failed", "origin": keys.EMAIL_QUEUE,
                                          "description": "secret-looking-value"})

    def gone(*a, **k):
        raise ConnectionError("Redis went away")

    monkeypatch.setattr(failed, "_unreadable", gone)
    d = failed.detail(conn, None, "poison-1")
    assert d["rq_error"] == "NoSuchJobError: Unexpected job format (its hash has no 'data' field)"
    assert "secret-looking-value" not in json.dumps(d)


def screen_text(app) -> str:
    """What the terminal shows (notifications and dialogs included), as plain text."""
    import html
    import re

    svg = app.export_screenshot()
    return html.unescape("".join(re.findall(r">([^<]*)</text>", svg))).replace("\xa0", " ")


@sync
async def test_brackets_in_a_typed_id_or_a_providers_error_are_shown_as_written(failed_world):
    """Console drill (session 40): `:retry x[/]y` blanked the console (Textual read the
    notification as markup: MarkupError), and a retry dialog whose body holds a provider's
    error with ``[/]`` in it (or whose command holds a filter typed) did the same."""
    cfg, conn, ledger = failed_world
    meta = json.loads(conn.hget("rq:job:e-refused-2", "meta"))
    conn.hset("rq:job:e-refused-2", "meta", json.dumps({**meta, "permanent": True,
                                                        "last_error": "HTTP 422 address 'a[/]b@x' [b]refused"}))
    ledger.db.conn.execute("UPDATE jobs SET last_error = ? WHERE id = 'e-refused-2'",
                           ("HTTP 422 address 'a[/]b@x' [b]refused",))
    ledger.db.conn.commit()
    app = make_app(cfg, conn)
    async with app.run_test(size=(120, 30), notifications=True) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *"retry x[/]y", "enter")
        await notified(pilot, app, "not among failed jobs: x[/]y", what="the refusal")
        await settle(pilot, lambda: "not among failed jobs: x[/]y" in screen_text(app), what="the refusal shown")
        await pilot.press("colon", *"retry e-refused-2", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the confirmation")
        assert "'a[/]b@x' [b]refused" in app.screen.body
        await settle(pilot, lambda: "a[/]b@x" in screen_text(app) and "[b]refused" in screen_text(app),
                     what="the error shown as written")
        await pilot.press("n")
        await pilot.press("f")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None)
        await pilot.press("slash", *"[/]", "enter", "A")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped", what="the bulk confirmation")
        await settle(pilot, lambda: "payrun retry --all --error '[/]'" in screen_text(app), what="the command")
        await pilot.press("escape")
    assert app.return_code in (None, 0)
    assert conn.zcard(f"rq:failed:{keys.EMAIL_QUEUE}") == 2  # nothing retried


# ---- read-only ------------------------------------------------------------------------

@sync
async def test_readonly_hides_and_refuses_actions(failed_world):
    cfg, conn, ledger = failed_world
    before = writes(conn)
    app = make_app(cfg, conn, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        assert "READ-ONLY" in text_of(app, "StatusBar")
        assert app.screen.check_action("drain", ()) is False and app.screen.check_action("failed", ()) is True
        await pilot.press("D", "d", "u", "l")
        assert app.screen.CRUMB == "overview"  # no dialog opened
        # each says why it did nothing (a key that did nothing read as a console not answering)
        said = [n.message for n in app._notifications]
        assert "read-only console: d (drain) is disabled" in said and "read-only console: l (limits) is disabled" \
            in said, said
        await pilot.press("f")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None)
        footer_keys = {b.binding.action for b in app.screen.active_bindings.values() if b.enabled}
        assert "retry_one" not in footer_keys and "filter" in footer_keys
        await pilot.press("r", "A", "space", "R")
        assert app.screen.CRUMB == "failed"
        await pilot.press("colon", *"retry r-refused-1", "enter")
        await pilot.press("colon", *"drain", "enter")
        await pilot.press("colon", *"limits cap=1", "enter")
        await pilot.pause()
        assert app.screen.CRUMB == "failed"
    after = writes(conn)
    assert after == before
    assert actions.read_audit(cfg) == []
    assert conn.zcard(f"rq:failed:{keys.RENDER_QUEUE}") == 5 and not conn.exists("rq:suspended")


# ---- drain, stop a worker, limits ----------------------------------------------------------

@pytest.fixture
def worker_env(cfg, tmp_path):
    conf = tmp_path / "payrun.toml"
    conf.write_text("[render]\ntimeout_s = 20\n[email]\ntimeout_s = 20\n[lease]\ngrace_s = 20\nvisibility_s = 60\n")
    return dict(os.environ, PAYRUN_CONFIG=str(conf), PAYRUN_TEST_JOBS="1")


@sync
async def test_drain_stops_intake_and_a_stopped_worker_finishes_its_job_and_exits(cfg, conn, worker_env, tmp_path):
    w = subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", keys.RENDER_QUEUE], env=worker_env,
                         stdout=open(tmp_path / "w.log", "ab"), stderr=subprocess.STDOUT)
    try:
        q = make_queue(keys.RENDER_QUEUE, conn)
        # long enough to be still running when the console's first refresh comes on a loaded host
        q.enqueue_call("jobs.testing.sleep", args=(8,), job_id="long-1", timeout=20, meta={"kind": "test"})
        wait_for(lambda: conn.zcard(f"rq:wip:{keys.RENDER_QUEUE}") == 1, timeout_s=60, what="the worker to start long-1")
        app = make_app(cfg, conn, interval_s=0.3)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, lambda: app.snapshot is not None and app.snapshot.running, what="running job")
            assert app.snapshot.running[0].job_id == "long-1" and not app.snapshot.running[0].stuck
            await pilot.press("D")  # every queue: typed confirmation
            await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped")
            assert app.screen.command == "payrun drain"
            await pilot.press(*"all", "enter")
            await settle(pilot, lambda: conn.exists("rq:suspended"), what="drain")
            q.enqueue_call("jobs.testing.noop", job_id="after-1", timeout=20, meta={"kind": "test"})
            await pilot.press("w")
            await settle(pilot, lambda: app.screen.CRUMB == "workers" and app.screen.query_one("#workers").row_count == 1)
            name = app.screen.query_one("#workers").current_key
            await pilot.press("s")
            await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
            assert app.screen.command == f"payrun stop-worker {name}"
            await pilot.press("y")
            await settle(pilot, lambda: any(e["what"] == "stop-worker" for e in actions.read_audit(cfg)),
                         what="stop requested")
        assert w.wait(timeout=40) == 0
        assert PayrunJob.fetch("long-1", connection=conn).get_status() == "finished"  # it finished its job
        assert PayrunJob.fetch("after-1", connection=conn).get_status() == "queued"  # and took no new one
        assert conn.lrange(f"rq:queue:{keys.RENDER_QUEUE}", 0, -1) == [b"after-1"]
        assert [e["what"] for e in actions.read_audit(cfg)] == ["drain", "stop-worker"]
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    out = CliRunner().invoke(__import__("payrun.cli", fromlist=["cli"]).cli, ["resume"], catch_exceptions=False)
    assert "resumed everywhere" in out.output and not conn.exists("rq:suspended")


@sync
async def test_stopping_a_send_email_lane_says_it_stops_the_whole_process_and_an_unknown_worker_is_refused(cfg, conn):
    """Drill: s on a running send ("Stop worker email.vm.24520.01?") named one lane; the y
    stopped the process and all its 50 lanes (the body said so in its last words).
    `:stop nosuch` was offered behind a y and refused after it."""
    import dataclasses

    from console.data import WorkerRow

    app = ConsoleApp(Source(cfg, conn), no_blink=True, poll=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        lanes = [WorkerRow(f"email.vm.77.{i:02d}", "vm", 77, keys.EMAIL_QUEUE, "busy" if i < 3 else "idle",
                           f"email-{MONTH}-emp-{i:05d}" if i < 3 else None, 1.0, 0.5, True, False, "email")
                 for i in range(5)]
        app.snapshot = dataclasses.replace(app.snapshot, workers=lanes)
        await pilot.press("colon", *"stop email.vm.77.01", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the stop dialog")
        assert app.screen.title_text == "Stop the send-email process 77 on vm (all 5 lanes, 3 sending)?"
        assert app.screen.command == "payrun stop-worker email.vm.77.01"
        await pilot.press("n")
        await settle(pilot, lambda: type(app.screen).__name__ == "OverviewScreen")
        await pilot.press("colon", *"stop nosuch", "enter")
        await notified(pilot, app, "no worker named 'nosuch'", what="the refusal")
        assert type(app.screen).__name__ == "OverviewScreen"


@pytest.mark.parametrize("everything", [False, True], ids=["one-queue", "everything"])
def test_a_drain_holds_for_a_render_worker_already_waiting_for_a_job(cfg, conn, worker_env, tmp_path, everything):
    """The worker is blocked in its dequeue (up to 5 s) when the drain comes: the job that
    arrives next must not run. It stays at the front of its queue and runs after resume."""
    from payrun.cli import cli

    log_path = tmp_path / "w.log"
    w = subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", keys.RENDER_QUEUE], env=worker_env,
                         stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
    try:
        def worker_state():
            names = conn.smembers("rq:workers")
            return {conn.hget(n, "state") for n in names}

        wait_for(lambda: worker_state() == {b"idle"}, timeout_s=60, what="the worker waiting for a job")
        runner = CliRunner()
        out = runner.invoke(cli, ["drain"] + ([] if everything else ["--queue", keys.RENDER_QUEUE]),
                            catch_exceptions=False)
        assert out.exit_code == 0
        q = make_queue(keys.RENDER_QUEUE, conn)
        q.enqueue_call("jobs.testing.noop", job_id="after-drain", timeout=20, meta={"kind": "test"})
        # either it took the job and gave it back, or its next look saw the drain first
        wait_for(lambda: "after-drain stays at the front" in log_path.read_text() or worker_state() == {b"suspended"},
                 timeout_s=30, what="the worker to see the drain")
        assert PayrunJob.fetch("after-drain", connection=conn).get_status() == "queued"
        assert conn.lrange(q.key, 0, -1) == [b"after-drain"]
        assert conn.llen(q.intermediate_queue_key) == 0
        runner.invoke(cli, ["resume"], catch_exceptions=False)
        wait_for(lambda: PayrunJob.fetch("after-drain", connection=conn).get_status() == "finished",
                 timeout_s=30, what="the job to run after resume")
        assert PayrunJob.fetch("after-drain", connection=conn).meta["attempt"] == 1  # no attempt spent
    finally:
        w.terminate()
        w.wait(timeout=30)


@sync
async def test_u_after_a_drain_of_every_queue_resumes_every_queue(cfg, conn):
    """Ops walkthrough: after `payrun drain` (every queue) the overview said "resume with u";
    u on a queue offered "Resume pdf-render?", said "intake resumed on pdf-render", and
    nothing moved (the drain of all held). u now offers what stops intake: every queue.
    `payrun resume --queue Q` says the drain of all still holds."""
    from payrun.cli import cli

    actions.drain(cfg, conn, None, via="cli")
    out = CliRunner().invoke(cli, ["resume", "--queue", keys.RENDER_QUEUE], catch_exceptions=False)
    assert "intake stays stopped on every queue" in out.output and "`payrun resume`" in out.output, out.output
    assert conn.exists("rq:suspended")
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None and app.snapshot.suspended)
        app.screen.query_one("#queues").focus()
        await pilot.press("u")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the resume dialog")
        assert app.screen.command == "payrun resume"  # every queue, not --queue pdf-render
        await pilot.press("y")
        await settle(pilot, lambda: not conn.exists("rq:suspended"), what="intake resumed everywhere")


@sync
async def test_resume_of_one_queue_typed_after_a_drain_of_every_queue_offers_every_queue(cfg, conn):
    """Drill: after D, `:resume send-email` offered "Resume send-email? Workers take new
    jobs again", and after the y nothing moved (the drain of all held), as u did before;
    and `:drain nosuch` offered "Drain nosuch?" and was refused only after the y."""
    actions.drain(cfg, conn, None, via="cli")
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None and app.snapshot.suspended)
        await pilot.press("colon", *f"resume {keys.EMAIL_QUEUE}", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the resume dialog")
        assert app.screen.command == "payrun resume" and "a drain of all" in app.screen.body
        await pilot.press("y")
        await settle(pilot, lambda: not conn.exists("rq:suspended"), what="intake resumed everywhere")
        for command in ("drain nosuch", "resume nosuch"):
            await pilot.press("colon", *command, "enter")
            await notified(pilot, app, "unknown queue 'nosuch'", what=f"{command} refused")
            assert type(app.screen).__name__ == "OverviewScreen"
            app.clear_notifications()


def test_drain_and_resume_one_queue_from_the_cli(cfg, conn):
    from payrun.cli import cli

    runner = CliRunner()
    out = runner.invoke(cli, ["drain", "--queue", keys.EMAIL_QUEUE], catch_exceptions=False)
    assert out.exit_code == 0 and keys.EMAIL_QUEUE in out.output
    snap = Source(cfg, conn).snapshot()
    assert snap.paused_queues == [keys.EMAIL_QUEUE] and not snap.suspended
    assert [q.paused for q in snap.queues] == [q.name == keys.EMAIL_QUEUE for q in snap.queues]
    bad = runner.invoke(cli, ["drain", "--queue", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output
    runner.invoke(cli, ["resume", "--queue", keys.EMAIL_QUEUE], catch_exceptions=False)
    assert Source(cfg, conn).snapshot().paused_queues == []
    log = actions.read_audit(cfg)
    assert [(e["command"], e["via"]) for e in log] == [(f"payrun drain --queue {keys.EMAIL_QUEUE}", "cli"),
                                                        (f"payrun resume --queue {keys.EMAIL_QUEUE}", "cli")]
    assert json.loads(runner.invoke(cli, ["audit", "--json"]).output)[0]["what"] == "drain"


@sync
async def test_change_limits_from_the_command_bar(cfg, conn):
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("l")
        await settle(pilot, lambda: type(app.screen).__name__ == "LimitsDialog")
        await pilot.press(*"0", "enter", "enter")  # refused in the dialog, not after the confirmation
        await pilot.pause()
        assert type(app.screen).__name__ == "LimitsDialog"
        await pilot.press("shift+tab", "backspace", *"30", "enter", *"20", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
        assert app.screen.command == "payrun limits set --cap 30 --rate 20"
        old_cap, old_rate = app.snapshot.limits.cap, app.snapshot.limits.rate_per_s
        # old -> new per field: a digit that landed in the other field shows at a glance
        assert app.screen.title_text == f"Change the email limits: cap {old_cap} → 30 in flight; rate {old_rate:g} → 20/s?"
        await pilot.press("y")
        await settle(pilot, lambda: conn.hget(keys.limit_conf("email"), "cap") == b"30", what="new cap")
        await settle(pilot, lambda: app.snapshot.limits.cap == 30, what="the overview to show it")
        # `:audit` shows the change on the console's clock, and says which (the log is UTC)
        from console.data import parse_ts
        from console.fmt import clock

        await pilot.press("colon", *"audit", "enter")
        await settle(pilot, lambda: any(n.title.startswith("audit log") for n in app._notifications),
                     what="the audit toast")
        note = [n for n in app._notifications if n.title.startswith("audit log")][-1]
        entry = actions.read_audit(cfg)[-1]
        assert f"({cfg.timezone} times)" in note.title
        assert f"{clock(parse_ts(entry['ts']), cfg.timezone)} {entry['who']} payrun limits set" in note.message
    assert float(conn.hget(keys.limit_conf("email"), "rate_per_s")) == 20.0


@sync
async def test_the_limits_dialog_says_a_cap_above_what_the_rate_allows_sends_no_faster(cfg, conn):
    """`payrun limits show` and the limits line said "the rate allows 22" at 2/s; the dialog
    where the cap is raised said nothing, and cap 100 at 2/s still sent 22 at a time. The
    note follows what is typed, and the confirmation (`:limits` too) says it."""
    from jobs.limits import set_limits

    set_limits(conn, "email", cap=50, rate_per_s=2.0)
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None and app.snapshot.limits.rate_per_s == 2.0)
        slots = app.slots_for_rate(2.0)
        assert slots == app.snapshot.limits.slots_for_rate and slots < 50
        note = lambda: str(app.screen.query_one("#rate-note").render())  # noqa: E731
        await pilot.press("l")
        await settle(pilot, lambda: type(app.screen).__name__ == "LimitsDialog", what="the limits dialog")
        assert f"the rate 2/s allows only {slots} in flight: a cap above that (50) sends no faster" in note()
        await pilot.press(*"10")  # a cap the rate allows: nothing to say
        await settle(pilot, lambda: note() == "", what="the note gone at cap 10")
        await pilot.press("backspace", "backspace", *"100")
        await settle(pilot, lambda: "(100) sends no faster" in note(), what="the note at cap 100")
        await pilot.press("enter", *"40")  # a rate that allows 100 in flight
        await settle(pilot, lambda: note() == "", what="the note gone at 40/s")
        await pilot.press("backspace", "backspace", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the confirmation")
        assert f"the rate 2/s allows only {slots} in flight: a cap above that (100)" in app.screen.body
        await pilot.press("n")
        await pilot.press("colon", *"limits cap=80", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what=":limits's confirmation")
        assert "a cap above that (80) sends no faster" in app.screen.body
        await pilot.press("n")
        await pilot.press("colon", *"limits cap=20", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what=":limits's confirmation")
        assert "sends no faster" not in app.screen.body
        await pilot.press("n")


@sync
async def test_the_command_bar_gives_focus_back_to_the_table_that_had_it(cfg, conn):
    """Drill: after any `:` command on the overview, focus fell to the processes table,
    and d on the queue under the cursor said "select a queue (Tab to the queues table)"."""
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        overview = app.screen
        assert overview.focused.id == "queues"
        for keys_ in (("colon", "escape"), ("colon", *"limits cap=abc", "enter"),
                      ("colon", *"workers", "enter", "escape")):
            await pilot.press(*keys_)
            await settle(pilot, lambda: app.screen is overview and not overview.query("CommandBar"),
                         what="the overview again")
            await pilot.pause()
            assert overview.focused is not None and overview.focused.id == "queues", (keys_, overview.focused)
        await pilot.press("d")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey", what="the drain dialog")
        await pilot.press("n")


@sync
async def test_actions_typed_in_the_command_bar_are_carried_out(cfg, conn):
    """`:drain Q`, `:resume`, `:drain` + all: the dialog's answer must reach the action (it
    went to the command bar, removed by then: the dialog closed and nothing happened)."""
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("colon", *f"drain {keys.EMAIL_QUEUE}", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
        await pilot.press("y")
        await settle(pilot, lambda: conn.sismember(keys.PAUSED_QUEUES, keys.EMAIL_QUEUE), what="queue drained")
        await pilot.press("colon", *"drain", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped")
        await pilot.press(*"all", "enter")
        await settle(pilot, lambda: conn.exists("rq:suspended"), what="everything drained")
        await pilot.press("colon", *"resume", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
        await pilot.press("y")
        await settle(pilot, lambda: not conn.exists("rq:suspended") and not conn.smembers(keys.PAUSED_QUEUES),
                     what="resumed")
    assert [e["command"] for e in actions.read_audit(cfg)] == [
        f"payrun drain --queue {keys.EMAIL_QUEUE}", "payrun drain", "payrun resume"]


# ---- a stale view says so, and keys never wait for Redis -----------------------------------

@sync
async def test_unreachable_redis_is_said_and_keys_still_work(cfg, tmp_path):
    from console.data import connect

    now = [1_800_000_000.0]
    dead = connect(cfg, f"unix://{tmp_path / 'no.sock'}")
    app = ConsoleApp(Source(cfg, dead, clock=lambda: now[0]), clock=lambda: now[0], no_blink=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        now[0] += 12
        app._tick()
        await pilot.pause()
        assert "last refresh 12s ago: Redis unreachable" in text_of(app, "StatusBar")
        await pilot.press("f")
        assert app.screen.CRUMB == "failed"


@sync
async def test_the_limits_dialog_does_not_give_the_configs_limits_as_in_force_when_redis_is_unreachable(cfg, tmp_path):
    """Drill: with Redis stopped, l said "in force: cap 50 in flight, rate 40/s" (the
    config's) while `payrun limits set` had put cap 10 and 30/s in force."""
    from console.data import connect

    dead = connect(cfg, f"unix://{tmp_path / 'no.sock'}")
    app = ConsoleApp(Source(cfg, dead), no_blink=True)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        assert app.snapshot.limits is None
        await pilot.press("l")
        await settle(pilot, lambda: type(app.screen).__name__ == "LimitsDialog", what="the limits dialog")
        body = " ".join(str(w.render()) for w in app.screen.query(".dialog-body"))
        assert "in force: unknown" in body and "in force: cap" not in body, body
        assert "(now " not in app.screen.query_one("#cap").placeholder
        await pilot.press("escape")


class SlowSource(Source):
    def snapshot(self) -> Snapshot:
        time.sleep(8)
        return super().snapshot()


@sync
async def test_a_slow_refresh_never_blocks_the_keys(cfg, conn):
    app = ConsoleApp(SlowSource(cfg, conn), no_blink=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        t0 = time.monotonic()
        await pilot.press("r")
        await pilot.pause()
        assert app.screen.CRUMB == "running" and time.monotonic() - t0 < 4.0  # the refresh takes 8
        await pilot.press("question_mark")
        await pilot.pause()
        assert type(app.screen).__name__ == "HelpScreen"
        # the help lists the `:` commands: `:` there opens the bar on the view underneath
        await pilot.press("colon", *"overview", "enter")
        await settle(pilot, lambda: type(app.screen).__name__ == "OverviewScreen", what=":overview from the help")
        app.exit()


# ---- the tables ------------------------------------------------------------------------------

@sync
async def test_a_cell_that_grows_widens_its_column():
    """A value updated in place ("0/50" in flight, then "14/50") was cut to the column's first
    width ("14/5"): a walkthrough read 14 of 5 lanes busy."""
    from textual.app import App

    from console.widgets.table import LiveTable

    class One(App):
        def compose(self):
            yield LiveTable([("busy", "busy"), ("job", "job")], id="t")

    app = One()
    async with app.run_test(size=(80, 10)) as pilot:
        table = app.query_one("#t", LiveTable)
        table.sync([("p", ("0/50", "idle"))])
        await pilot.pause()
        table.sync([("p", ("14/50", "email-2026-11-emp-00018 1s"))])
        await pilot.pause()
        assert [c.content_width for c in table.columns.values()] == [5, len("email-2026-11-emp-00018 1s")]
        assert "14/50" in "".join(s.text for s in table.render_line(1))  # as drawn, whole


# ---- the ETA ---------------------------------------------------------------------------------

def test_the_delivery_rate_leaves_reminder_emails_out():
    """`payrun remind` during a run: reminders finish on the send-email queue beside the
    slips. Counted as deliveries, 300 reminders a minute read as 300 slips a minute, and
    the ETA came early."""
    from console.data import QueueRow, Source

    sends = QueueRow(keys.EMAIL_QUEUE, 0, 40, 0, 0, None, [600] * 10, False, 0, [0] * 8 + [300, 300])
    assert sends.slips_finished(5) == 600 * 3 + 300 * 2
    # a reminder sent at the end of one minute that finished in the next is still subtracted
    edge = QueueRow(keys.EMAIL_QUEUE, 0, 40, 0, 0, None, [0] * 8 + [0, 10], False, 0, [0] * 8 + [1, 0])
    assert edge.slips_finished(5) == 9
    assert Source.delivery_rate([sends]) == pytest.approx((600 * 3 + 300 * 2) / 300)
    first = QueueRow(keys.EMAIL_QUEUE, 0, 40, 0, 0, None, [0] * 9 + [600], False, 0, [0] * 9 + [300])
    assert Source.delivery_rate([first], running_s=60) == pytest.approx(300 / 60)  # a run's first minute
    # only reminders so far: the render rate stands in, as before the first slip is sent
    renders = QueueRow(keys.RENDER_QUEUE, 100, 2, 0, 0, None, [60] * 10, False)
    only = QueueRow(keys.EMAIL_QUEUE, 0, 0, 0, 0, None, [0] * 9 + [50], False, 0, [0] * 9 + [50])
    assert Source.delivery_rate([renders, only]) == pytest.approx(1.0)


def test_the_eta_follows_sending_again_at_once_after_an_outage_and_a_lowered_limit_at_once():
    """Walkthrough (session 27): after a provider outage the ETA read LATE for minutes while
    sends went out at the full 40/s again, since the rate was the last 5 minutes' average
    with the outage in it; a limit lowered from 40/s to 10/s kept the old pace's ETA."""
    from console.data import QueueRow, Source, eta

    now = 1_793_478_300.0 + 20_100  # 08:00 in Dhaka
    after = QueueRow(keys.EMAIL_QUEUE, 0, 40, 0, 0, None, [2400, 2400, 0, 0, 0, 0, 0, 0, 2400], False)
    assert after.slips_finished(5) == 2400
    rate = Source.delivery_rate([after], running_s=3600, send_limit_per_s=40.0)
    assert rate == pytest.approx(40.0)  # the last minute's, not 2,400 / 300 s = 8/s
    total = {"queued": 40_000, "running": 0, "retrying": 0, "done": 10_000, "failed": 0, "stuck": 0, "total": 50_000}
    assert eta(total, rate, now, "Asia/Dhaka")["on_time"] is True
    assert eta(total, 8.0, now, "Asia/Dhaka")["on_time"] is False  # what it said before
    steady = QueueRow(keys.EMAIL_QUEUE, 0, 40, 0, 0, None, [2400] * 10, False)
    assert Source.delivery_rate([steady], running_s=3600, send_limit_per_s=10.0) == pytest.approx(10.0)
    assert Source.delivery_rate([steady], running_s=3600) == pytest.approx(40.0)
    # a slowdown still counts over the window (the last minute is not taken when slower)
    slowing = QueueRow(keys.EMAIL_QUEUE, 0, 40, 0, 0, None, [2400] * 9 + [600], False)
    assert Source.delivery_rate([slowing], running_s=3600) == pytest.approx((2400 * 4 + 600) / 300)
    # the render rate, standing in before any send has finished, is not a send: no cap
    renders = QueueRow(keys.RENDER_QUEUE, 100, 2, 0, 0, None, [3000] * 10, False)
    assert Source.delivery_rate([renders], running_s=3600, send_limit_per_s=10.0) == pytest.approx(50.0)


def test_the_eta_follows_a_lowered_cap_within_seconds_not_minutes(world):
    """Console drill (session 38): with the cap lowered to 10 at 1.2 s a send (~8/s real)
    and the rate limit 30/s, the ETA went on promising 30/s for up to 5 minutes: the rate
    was the window's, capped only by the rate limit. It now counts the sends since the
    change, from CHANGE_SETTLE_S after it."""
    from console.data import CHANGE_SETTLE_S, FINISHED_TTL_S, QueueRow, Source
    from jobs.limits import CHANGED_AT, set_limits

    steady = QueueRow(keys.EMAIL_QUEUE, 0, 10, 0, 0, None, [1800] * 10, False)  # 30/s until now
    assert Source.delivery_rate([steady], running_s=3600, send_limit_per_s=30.0) == pytest.approx(30.0)
    assert Source.delivery_rate([steady], 3600, 30.0, since_change=(40.0, 320)) == pytest.approx(8.0)
    # too soon to tell; the window passed; a raised limit: as before
    assert Source.delivery_rate([steady], 3600, 30.0, since_change=(CHANGE_SETTLE_S - 1, 0)) == pytest.approx(30.0)
    assert Source.delivery_rate([steady], 3600, 30.0, since_change=(301.0, 2408)) == pytest.approx(30.0)
    assert Source.delivery_rate([steady], 3600, 40.0, since_change=(40.0, 1600)) == pytest.approx(30.0)

    # for real: the stamp in Redis, the sends since it in RQ's finished registry
    cfg, conn, db, ledger = world
    month = "2026-12"
    payroll.seed(db, companies=2, employees=12, seed=3, month=month)
    runs.start_run(cfg, conn, ledger, db, month)
    set_limits(conn, "email", cap=30, rate_per_s=30.0)
    now = time.time() + 3600  # an hour into the run, sending 30/s
    finished = f"rq:finished:{keys.EMAIL_QUEUE}"
    for i in range(9000):  # the last 5 minutes
        conn.zadd(finished, {f"email-{month}-x{i:05d}": now - 300 + i / 30 + FINISHED_TTL_S})
    assert Source(cfg, conn, clock=lambda: now).snapshot().eta["rate_per_s"] == pytest.approx(30.0, rel=0.02)
    set_limits(conn, "email", cap=10)
    conn.hset(keys.limit_conf("email"), CHANGED_AT, repr(now - 40))  # lowered 40 s ago
    conn.zremrangebyscore(finished, f"({now - 40 + FINISHED_TTL_S}", "+inf")
    for i in range(320):  # ~8/s since
        conn.zadd(finished, {f"email-{month}-y{i:05d}": now - 40 + (i + 1) / 8 + FINISHED_TTL_S})
    snap = Source(cfg, conn, clock=lambda: now).snapshot()
    assert snap.error is None, snap.error
    assert snap.limits.sent_since_change == 320
    assert snap.eta["rate_per_s"] == pytest.approx(8.0, rel=0.02), snap.eta  # was 30.0


def test_the_eta_is_not_late_in_a_runs_first_minutes_nor_given_while_drained_or_over_missing_slips():
    """Walkthrough: 5 s into a run the console said "ETA 09:13 — LATE for 09:00" (the rate
    was over 5 minutes, 4 of them before the run); drained, it still promised a time; with
    employees who have no slip it said "all delivered"."""
    from console.data import QueueRow, Source, eta
    from console.fmt import eta_text

    now = 1_793_478_300.0  # 02:25 in Dhaka
    sends = QueueRow(keys.EMAIL_QUEUE, 0, 40, 0, 0, None, [0] * 9 + [150], False)  # 150 sent in 5 s
    # over 5 minutes (0.5, what read LATE), or the last minute's pace when faster
    assert Source.delivery_rate([sends]) == pytest.approx(2.5)
    rate = Source.delivery_rate([sends], running_s=5)
    assert rate == pytest.approx(15.0)  # over 10 s at least, not over empty minutes
    # a long run: 5 minutes, or the last minute's pace when faster (sending again after a pause)
    assert Source.delivery_rate([sends], running_s=900) == pytest.approx(2.5)
    total = {"queued": 49_850, "running": 0, "retrying": 0, "done": 150, "failed": 0, "stuck": 0, "total": 50_000}
    assert "on time for 09:00" in eta_text(eta(total, rate, now, "Asia/Dhaka"))
    assert "LATE" in eta_text(eta(total, 0.5, now, "Asia/Dhaka"))
    drained = eta(total, rate, now, "Asia/Dhaka", drained=True)
    assert drained["at"] is None and eta_text(drained).startswith("no ETA: intake drained")
    finished = total | {"queued": 0, "done": 50_000}
    assert eta_text(eta(finished, 0.0, now, "Asia/Dhaka")) == "all delivered"
    assert eta_text(eta(finished | {"no_slip": 3}, 0.0, now, "Asia/Dhaka")) == "all slips made are delivered"
    assert eta_text(eta(finished | {"no_salary_line": 1}, 0.0, now, "Asia/Dhaka")) == "all slips made are delivered"


def test_the_eta_never_says_all_delivered_over_failed_slips_nor_promises_a_time_with_no_worker():
    """Walkthrough: a run ending "413 sent, 4 failed" read "— all delivered"; with every
    pdf-render worker stopped and 300 slips waiting, the console kept "ETA 17:52 — on time
    for 09:00" from the month before's deliveries while `payrun status` said no worker runs."""
    from console.data import QueueRow, WorkerRow, eta, unserved
    from console.fmt import eta_text

    now = 1_793_478_300.0
    ended = {"queued": 0, "running": 0, "retrying": 0, "done": 413, "failed": 4, "stuck": 0, "total": 417}
    text = eta_text(eta(ended, 0.0, now, "Asia/Dhaka"))
    assert "all delivered" not in text and text.startswith("finished: 4 failed"), text

    renders = QueueRow(keys.RENDER_QUEUE, 300, 0, 0, 0, 12.0, [0] * 10, False)
    sends = QueueRow(keys.EMAIL_QUEUE, 0, 0, 0, 0, None, [2000] * 10, False)

    def worker(name, queues, alive=True, stopping=False):
        return WorkerRow(name, "vm", 1, queues, "idle", None, None, 1.0, alive, stopping,
                         "email" if "email" in queues else "render")

    lanes = [worker("send-email.vm.1.0", keys.EMAIL_QUEUE)]
    assert unserved([renders, sends], lanes) == [keys.RENDER_QUEUE]
    gone = lanes + [worker("r1", keys.RENDER_QUEUE, alive=False), worker("r2", keys.RENDER_QUEUE, stopping=True)]
    assert unserved([renders, sends], gone) == [keys.RENDER_QUEUE]  # dead or stopping: not a taker
    assert unserved([renders, sends], lanes + [worker("r3", keys.RENDER_QUEUE)]) == []
    idle = QueueRow(keys.RENDER_QUEUE, 0, 0, 0, 0, None, [0] * 10, False)
    assert unserved([idle, sends], []) == []  # nothing waiting: nothing to say
    later = QueueRow(keys.EMAIL_QUEUE, 0, 0, 5, 0, None, [0] * 10, False)
    assert unserved([later], []) == [keys.EMAIL_QUEUE]  # retries come back only through a worker

    waiting = ended | {"queued": 300, "total": 717}
    stalled = eta(waiting, 33.0, now, "Asia/Dhaka", no_worker=[keys.RENDER_QUEUE])
    assert stalled["at"] is None and stalled["on_time"] is None
    assert eta_text(stalled).startswith(f"no ETA: no {keys.RENDER_QUEUE} worker running"), eta_text(stalled)
    assert eta_text(eta(waiting, 33.0, now, "Asia/Dhaka")).startswith("ETA ")  # with workers: a time


def test_the_eta_says_when_sending_has_stopped_and_when_redis_cannot_be_read():
    """Exploratory testing: with sending stopped (a rate limit run away) the console said
    "ETA 13:34 — on time for 09:00" for minutes, from the last 5 minutes' rate; with Redis
    unreachable it said "nothing delivered in the last 5 min", which it could not know."""
    from console.data import QueueRow, eta, stalled
    from console.fmt import eta_text

    now = 1_793_478_300.0
    total = {"queued": 0, "running": 0, "retrying": 80, "done": 1420, "failed": 0, "stuck": 0, "total": 1500}
    stopped = QueueRow(keys.EMAIL_QUEUE, 80, 0, 0, 0, None, [0] * 5 + [900, 500, 20, 0, 0], False)
    assert stalled([stopped], running_s=600)
    assert not stalled([stopped], running_s=90)  # a run's first minutes: sends have not begun
    going = QueueRow(keys.EMAIL_QUEUE, 80, 0, 0, 0, None, [0] * 8 + [0, 3], False)
    assert not stalled([going], running_s=600)  # one delivered this minute
    reminders = QueueRow(keys.EMAIL_QUEUE, 80, 0, 0, 0, None, [0] * 8 + [4, 4], False, 0, [0] * 8 + [4, 4])
    assert stalled([reminders], running_s=600)  # reminder emails are not slips
    e = eta(total, 4.7, now, "Asia/Dhaka", stalled=True)
    assert e["at"] is None and eta_text(e).startswith("no ETA: no slip delivered for 2 minutes"), eta_text(e)
    assert eta_text(eta(total, 4.7, now, "Asia/Dhaka")).startswith("ETA ")
    down = eta(total, 0.0, now, "Asia/Dhaka", redis_down=True)
    assert eta_text(down) == "ETA unknown: Redis unreachable (the figures are the ledger's)"
    finished = total | {"retrying": 0, "done": 1500}
    assert eta_text(eta(finished, 0.0, now, "Asia/Dhaka", stalled=True, redis_down=True)) == "all delivered"


def test_the_eta_counts_the_shown_months_slips_not_a_catch_up_run_of_another_month(world):
    """Exploratory testing: the ETA's rate and stall check counted every month's jobs in
    the finished registries (kept a day), so a catch-up run of last month beside this
    one's (or a run just ended) made this month's ETA early, and hid this month's stall."""
    from console.data import FINISHED_TTL_S, RATE_WINDOW_MIN, read_month_finished, stalled

    cfg, conn, db, ledger = world
    month = "2026-12"
    payroll.seed(db, companies=2, employees=12, seed=3, month=month)
    runs.start_run(cfg, conn, ledger, db, month)
    now = time.time() + 600  # the run began 10 minutes ago: its rate is over 5 minutes
    finished = f"rq:finished:{keys.EMAIL_QUEUE}"

    def ended(job_id: str, ago_s: float) -> None:  # as RQ scores a finished job
        conn.zadd(finished, {job_id: now - ago_s + FINISHED_TTL_S})

    for i in range(30):  # this month: 30 sends 1-3 minutes ago, none in the last minute
        ended(f"email-{month}-emp-{i:05d}", 70 + i * 3)
    ended(f"email-{month}-emp-00007-resend-1", 200)  # a resend is one of the month's slips
    for i in range(600):  # last month's catch-up, delivering right now
        ended(f"email-2026-11-emp-{i:05d}", 1 + i * 0.1)
    ended("remind-b1-emp-00001", 5)  # a reminder is no slip
    ended(f"email-{month}-emp-99999", 60 * RATE_WINDOW_MIN + 30)  # before the window

    buckets = read_month_finished(conn, now, month, keys.EMAIL_QUEUE)
    assert len(buckets) == RATE_WINDOW_MIN and sum(buckets) == 31 and buckets[-1] == 0, buckets

    snap = Source(cfg, conn, clock=lambda: now).snapshot()
    assert snap.error is None, snap.error
    email = next(q for q in snap.queues if q.name == keys.EMAIL_QUEUE)
    assert sum(email.per_min) == 633  # the sparkline still shows every job the queue finished
    assert snap.eta["rate_per_s"] == pytest.approx(31 / 300, abs=1e-3)  # not (31 + 600) / 300
    assert snap.eta["stalled"] is False  # sends 1-2 minutes ago
    email.month_per_min[-2:] = [0, 0]
    assert stalled(snap.queues, running_s=600)  # though last month's catch-up delivers
    # the console reads only what was added since its last refresh (less an overlap for
    # a host whose clock is behind), and forgets what left the window
    src = Source(cfg, conn, clock=lambda: now)
    assert src.snapshot().eta["rate_per_s"] == pytest.approx(31 / 300, abs=1e-3)
    for i in range(60):
        ended(f"email-{month}-emp-1{i:04d}", 1 + i * 0.25)
    ended(f"email-{month}-emp-20000", 20)  # recorded late, by a host 20 s behind
    now += 200  # the 31 from 70-160 s ago stay in the window, 14 of them leave it
    snap = src.snapshot()
    left = sum(1 for i in range(30) if 70 + i * 3 + 200 >= 60 * RATE_WINDOW_MIN) + 1  # (+ the resend)
    assert snap.eta["rate_per_s"] == pytest.approx((31 - left + 61) / 300, abs=1e-3), (left, snap.eta)
    assert sum(next(q for q in snap.queues if q.name == keys.EMAIL_QUEUE).month_per_min) == 31 - left + 61
    now -= 200
    # no send of the month yet: its renders stand in, not last month's sends
    conn.delete(finished)
    conn.zadd(f"rq:finished:{keys.RENDER_QUEUE}", {f"render-{month}-emp-00001": now - 10 + FINISHED_TTL_S})
    for i in range(300):
        ended(f"email-2026-11-emp-{i:05d}", 10 + i * 0.5)
    snap = Source(cfg, conn, clock=lambda: now).snapshot()
    # (1 render in the last minute: its pace, 1/60; every month's sends would read 100/60)
    assert snap.eta["rate_per_s"] == pytest.approx(1 / 60, abs=1e-3)


def test_a_run_still_going_after_its_0900_is_late_not_on_time_for_tomorrow():
    """Walkthrough at 50,000 slips: a run still going after 09:00 read "ETA 10:54 — on time
    for 09:00", the next morning's 09:00. The deadline is the first 09:00 after the run
    began."""
    from console.data import eta
    from console.fmt import eta_text

    total = {"queued": 10_000, "running": 0, "retrying": 0, "done": 40_000, "failed": 0, "stuck": 0, "total": 50_000}
    started = 1_793_473_200.0  # 01:00 in Dhaka, on the 1st
    now = started + 8 * 3600 + 300  # 09:05
    late = eta(total, 10.0, now, "Asia/Dhaka", started=started)
    assert late["on_time"] is False and eta_text(late) == "ETA 09:21 — LATE for 09:00", eta_text(late)
    assert eta(total, 10.0, started + 3600, "Asia/Dhaka", started=started)["on_time"] is True  # 02:00: 02:16
    # a run begun after 09:00 (a rerun, a demo) has until the next morning's 09:00
    rerun = eta(total, 10.0, started + 9.5 * 3600 + 60, "Asia/Dhaka", started=started + 9.5 * 3600)
    assert rerun["on_time"] is True and eta_text(rerun) == "ETA 10:47 — on time for 09:00 tomorrow", eta_text(rerun)


def test_payrun_failed_says_how_many_failed_not_how_many_it_showed(failed_world):
    from payrun.cli import cli

    runner = CliRunner()
    out = runner.invoke(cli, ["failed", "--limit", "3"], catch_exceptions=False).output
    assert len(out.strip().splitlines()) == 4  # three jobs, then the count
    assert "7 failed jobs, the newest 3 shown (--limit N for more)" in out
    assert "7 failed job(s); retry with" in runner.invoke(cli, ["failed"], catch_exceptions=False).output
    assert len(json.loads(runner.invoke(cli, ["failed", "--limit", "3", "--json"]).output)) == 3


def test_redis_down_is_said_in_full_not_cut_mid_word(cfg, tmp_path):
    """Walkthrough: with everything down, `payrun queues` said "… connecting to
    /…/redis.sock. No such file or direct": the error was cut at 80 characters."""
    from console.data import connect
    from jobs.events import one_line as clip

    sock = tmp_path / "gone" / "redis.sock"  # (AF_UNIX paths stop at 107 bytes)
    snap = Source(cfg, connect(cfg, f"unix://{sock}")).snapshot()
    assert "Redis unreachable" in snap.error and "No such file or directory" in snap.error, snap.error
    assert clip("abc", 3) == "abc" and clip("abcdef", 4) == "abc…"


def test_the_months_finished_count_reads_afresh_when_the_console_clock_steps_back(conn):
    """Review of 9928c1c: the incremental read kept reading from where it was; a clock
    stepped back then read only the window's last 30 s and undercounted."""
    from console.data import FINISHED_TTL_S, MonthFinished

    mf = MonthFinished()
    now = 1_800_000_000.0
    registry = f"rq:finished:{keys.EMAIL_QUEUE}"
    conn.zadd(registry, {"email-2026-11-emp-00001": now - 30 + FINISHED_TTL_S})
    assert sum(mf.buckets(conn, now, "2026-11", keys.EMAIL_QUEUE)) == 1
    back = now - 300
    conn.zadd(registry, {"email-2026-11-emp-00002": back - 60 + FINISHED_TTL_S})
    assert sum(mf.buckets(conn, back, "2026-11", keys.EMAIL_QUEUE)) == 1  # emp-00002; emp-00001 is "ahead"


@sync
async def test_the_overview_says_why_jobs_are_retrying(cfg, conn, monkeypatch):
    """Walkthrough: during 2,173 HTTP 503s the overview showed only a retry count (an
    outage that fails every other send never reaches "N failed in a row"): it now names
    the last errors of the jobs waiting out a backoff."""
    from rq import Retry

    from console.data import read_retrying

    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    q = make_queue(keys.EMAIL_QUEUE, conn)
    for i in range(3):
        q.enqueue_call("jobs.testing.flaky", job_id=f"flaky-{i}", timeout=5, retry=Retry(max=3),
                       meta={"kind": "test"})
    q.enqueue_call("jobs.testing.noop", job_id="later-1", meta={"kind": "test"})
    conn.zadd(q.scheduled_job_registry.key, {"later-1": time.time() + 3600})  # a reminder for later: no error
    conn.lrem(q.key, 0, "later-1")
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)
    assert conn.zcard(q.scheduled_job_registry.key) == 4  # three retries and the one for later
    assert read_retrying(conn) == [("HTTP 503 from the provider (test)", 3)]
    app = make_app(cfg, conn, poll=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        assert "retrying: HTTP 503 from the provider (test) ×3" in text_of(app, "#limits")


def test_a_long_error_head_is_cut_clean():
    """Walkthrough (session 32): an outage read "retrying: email provider down (11 sends in
    a row failed),  ×1" (cut at 48 characters in the middle of ", every sender paused")."""
    from console.data import error_head

    text = ("email provider down (11 sends in a row failed), every sender paused 30 s: "
            "held, no attempt spent (last: HTTP 503)")
    assert error_head(text) == "email provider down (11 sends in a row failed)"
    assert error_head("provider 127.0.0.1:8025: HTTP 503 provider outage: try later") == "HTTP 503 provider outage"


def test_the_workers_table_lines_up_whatever_the_host_program_or_job():
    """New-user walkthrough: `payrun workers` under supervisord put every row's queues,
    state and job right of their headings (the host:pid program column was not padded).
    The pure table, with hosts of several lengths (a host:pid of exactly 8 characters, as
    `vm:19091`, lined up by chance), programs, a long job id and a worker of three queues."""
    from conftest import assert_worker_columns_line_up
    from console.cli import worker_table
    from console.data import WorkerRow

    def row(name, host, pid, queues="pdf-render", job=None, program=None, alive=True, kind="render"):
        return WorkerRow(name=name, host=host, pid=pid, queues=queues, state="busy" if job else "idle",
                         job_id=job, job_elapsed_s=3.0 if job else None, heartbeat_age_s=4.0, alive=alive,
                         stopping=False, kind=kind, program=program)

    plain = [row("render.vm.19091", "vm", 19091, job="render-2026-11-emp-00017"),
             row("render.payrun-control-01.dhaka.example.4242", "payrun-control-01.dhaka.example", 4242)]
    supervised = [row("render.vm.19091", "vm", 19091, program="pdf-render:pdf-render-00",
                      job="render-2026-11-emp-00017"),
                  row("email.vm.19100.00", "vm", 19100, queues="send-email", program="send-email", kind="email"),
                  row("control.vm.7", "vm", 7, queues="control,pdf-render,send-email", program="control",
                      job="bank-bank-status-20261130T2000Z-2026-11-c12", kind="control")]
    gone = [row(f"email.gone-host.555.{i:02d}", "gone-host", 555, queues="send-email", alive=False, kind="email")
            for i in range(3)]
    for workers in (plain, supervised, supervised + gone, gone):
        lines = worker_table(workers)
        assert len(lines) == 1 + len(workers) - (len(gone) - 1 if gone[0] in workers else 0), lines
        assert "host:pid program" in lines[0] if any(w.program for w in workers) else "host:pid " in lines[0]
        assert_worker_columns_line_up("\n".join(lines))
        beat = lines[0].index("RQ heartbeat")  # the `for` column ends where the header's does
        assert all(ln.index("beat ") == beat for ln in lines[1:]), lines
    assert worker_table([]) == []
    assert "(3 lanes)" in worker_table(gone)[1] and "GONE" in worker_table(gone)[1]


def test_a_job_running_past_its_timeout_is_said_to_be_past_it_not_near_it():
    """Ops walkthrough: `payrun running` labelled a job at 1m21s of a 30 s timeout "NEAR
    TIMEOUT"."""
    from console.data import RunningRow

    def row(elapsed):
        return RunningRow("render-x", "pdf-render", "w", elapsed, 30.0, 10.0, None)

    assert [(row(e).near_timeout, row(e).past_timeout) for e in (10, 25, 30, 81)] == [
        (False, False), (True, False), (True, False), (True, True)]
    assert (row(None).near_timeout, row(None).past_timeout) == (False, False)


@sync
async def test_the_overview_says_when_the_ledger_is_behind(failed_world):
    """Ops walkthrough: with the ledger paused 20 s, `payrun status` said "ledger is 1,665
    updates behind"; the console showed its lagging figures with an ETA and no note."""
    from console.fmt import ledger_behind_text

    cfg, conn, ledger = failed_world
    assert ledger_behind_text(0, 0) == "" and ledger_behind_text(5, 3.0) == ""  # keeping up: a few are normal
    conn.delete(keys.EVENTS_STREAM)
    old_ms = int((time.time() - 25) * 1000)
    for i in range(3):  # written 25 s ago, applied by no ledger
        conn.xadd(keys.EVENTS_STREAM, {"id": f"x-{i}", "state": "done"}, id=f"{old_ms}-{i}")
    snap = Source(cfg, conn).snapshot()
    assert snap.ledger_backlog == 3 and 20 <= snap.ledger_backlog_age_s < 60, snap.ledger_backlog_age_s
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None and app.snapshot.status is not None)
        await settle(pilot, lambda: "the ledger is 3 updates behind" in text_of(app, "#answer"), what="the note")
        assert "is `payrun ledger` running?" in text_of(app, "#answer")


def test_the_hr_line_counts_an_active_employee_with_no_salary_line(payrun_world):
    """An HR drill: an employee of a company in the run with no salary line for the month
    got no slip, and the console said "all delivered". It counts them as `payrun status`
    does."""
    from console.fmt import answer

    cfg, conn, ledger, *_ = payrun_world
    with payroll.PayrollDB(cfg.payroll_path) as db:
        db.conn.execute("INSERT INTO employees (id, company_id, name_en, name_bn, email, department, designation, "
                        "bank_account) VALUES ('emp-77777', 2, 'No Line', '', 'no.line@example.com', 'HR', 'Clerk', "
                        "'1234567890123')")
        db.conn.commit()
    snap = Source(cfg, conn).snapshot()
    assert snap.error is None
    assert snap.status["total"]["no_salary_line"] == 1
    assert [c["no_salary_line"] for c in snap.status["companies"]] == [0, 1]
    assert snap.status["total"] == status.report(cfg, ledger, month=MONTH, conn=conn)["total"]
    assert "1 with no salary line" in answer(snap.status["total"])


@sync
async def test_a_refused_address_fixed_since_reads_fixed_and_a_slip_resent_since_reads_resent(payrun_world):
    """An HR drill: after importing the corrected address, the failed list still said
    "data: a retry alone fails again: fix it first", and so did the retry dialog."""
    import redis

    from payrun.redis_server import READONLY_ACL

    cfg, conn, ledger, bad, *_ = payrun_world
    job_id = keys.email_job_id(MONTH, bad)
    # as the console reads: a user that may not write, nor MULTI (RQ's fetch_many does)
    conn.execute_command("ACL", "SETUSER", "drill-ro", "reset", *READONLY_ACL.split(), ">drill-pw")
    sock = conn.connection_pool.connection_kwargs["path"]
    ro = redis.Redis(unix_socket_path=sock, username="drill-ro", password="drill-pw")
    src = Source(cfg, ro)
    row = next(r for r in src.failed_page(FailedFilter()).rows if r["id"] == job_id)
    assert row["permanent"] and not row["address_changed"]
    assert src.permanent_among([job_id]) == [job_id]
    with payroll.PayrollDB(cfg.payroll_path) as db:
        db.conn.execute("UPDATE employees SET email = 'fixed@payroll.example' WHERE id = ?", (bad,))
        db.conn.commit()
    row = next(r for r in src.failed_page(FailedFilter()).rows if r["id"] == job_id)
    assert row["address_changed"] and src.permanent_among([job_id]) == []
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("f")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 1,
                     what="the failed send")
        assert cell(app, "#failed", job_id, "why") == "fixed"
        assert "fixed: its address was refused and has changed since" in text_of(app, "#failed-summary")
        assert "fails again" not in text_of(app, "#failed-summary")
        await pilot.press("r")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
        assert "the retry sends it to the new address (fixed@payroll.example)" in app.screen.body, app.screen.body
        assert "fails again" not in app.screen.body
        await pilot.press("n")
    assert conn.llen(f"rq:queue:{keys.EMAIL_QUEUE}") == 0  # nothing retried
    # HR sent the slip again instead (`payrun resend`), and it was delivered: a retry of the
    # failed send would email it a second time; `payrun failed` said so, the console did not
    from click.testing import CliRunner

    from payrun.cli import cli

    assert CliRunner().invoke(cli, ["resend", "--employee", bad, "--month", MONTH]).exit_code == 0
    run_lanes(conn, [keys.RENDER_QUEUE], lanes=2, burst=True)
    run_lanes(conn, [keys.EMAIL_QUEUE], lanes=4, burst=True)
    ledger_mod.drain(conn, ledger)
    row = next(r for r in src.failed_page(FailedFilter()).rows if r["id"] == job_id)
    assert row["delivered_by_resend"]
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None)
        await pilot.press("f")
        await settle(pilot, lambda: getattr(app.screen, "page", None) is not None and app.screen.page.total == 1,
                     what="the failed send")
        assert cell(app, "#failed", job_id, "why") == "resent"
        summary = text_of(app, "#failed-summary")
        assert "resent: its slip was delivered by a `payrun resend` since" in summary and "fixed:" not in summary
        await pilot.press("r")
        await settle(pilot, lambda: type(app.screen).__name__ == "ConfirmKey")
        assert "a retry emails the employee the slip again" in app.screen.body
        await pilot.press("n")
    ro.close()
    conn.execute_command("ACL", "DELUSER", "drill-ro")


@sync
async def test_a_company_name_with_brackets_prints_as_written_not_as_markup(payrun_world):
    """Security review (session 39): the companies table is a DataTable, which reads a str
    cell as Rich markup: a company name imported with ``[/]`` stopped the console with a
    MarkupError, and ``[@click=app.…]`` made the name a clickable console action."""
    cfg, conn, ledger, bad, n1, n2 = payrun_world
    name = "Acme [/] [@click=app.quit]Bold[/] [link=http://127.0.0.1:9/]x[/link] Ltd"
    db = payroll.PayrollDB(cfg.payroll_path)
    db.conn.execute("UPDATE companies SET name = ? WHERE id = 1", (name,))
    db.conn.commit()
    db.close()
    app = make_app(cfg, conn)
    async with app.run_test(size=(160, 24)) as pilot:
        await settle(pilot, lambda: app.snapshot is not None and app.snapshot.status, what="first refresh")
        await settle(pilot, lambda: "1" in app.screen.query_one("#companies").keys(), what="the companies table")
        await pilot.pause()
        cell = app.screen.query_one("#companies").get_row("1")[1]
        shown = str(cell).removesuffix("…")  # (a long name is cut at a word: console.fmt.clip)
        assert shown == name[:len(shown)] and len(shown) >= 24
        assert not any(getattr(s.style, "meta", None) or "link" in str(s.style) for s in getattr(cell, "spans", []))
    assert app.return_code in (None, 0)


@sync
async def test_a_worker_hosts_console_says_the_run_is_the_control_hosts(cfg, conn):
    """Multi-host drill (s41): mid-run, a worker host's console (no ledger on that host)
    read "no pay run in the ledger yet: `payrun run --month YYYY-MM` starts one", where
    `payrun status` there says the ledger is on the control host."""
    (cfg.home / "supervisor.role").write_text("worker")  # (what `payrun up --role worker` leaves)
    app = make_app(cfg, conn)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: app.snapshot is not None, what="first refresh")
        await settle(pilot, lambda: "worker host" in text_of(app, "#answer"), what="the worker host's line")
        said = text_of(app, "#answer")
        assert "the ledger" in said and "is on the control host" in said and "starts one" not in said
    assert not cfg.ledger_path.exists()  # (the console made no ledger here)
