"""The command line as a user meets it: --help everywhere, one-line errors, exit codes."""

from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from payrun import keys, payroll
from payrun.cli import cli

COMMANDS = ["seed", "import", "run", "status", "check", "worker", "ledger", "provider", "provider outage", "provider stats", "redis", "demo", "up",
            "down", "ps", "failed", "retry", "job", "reap", "limits show", "limits set", "prune", "supervisor-env", "config show", "config redis-url", "config rq-env"]


@pytest.fixture
def runner(cfg):
    return CliRunner()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_explains_itself(runner, command):
    result = runner.invoke(cli, [*command.split(), "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output and len(result.output.splitlines()) > 3


def read_csv(path) -> tuple[list[str], list[dict[str, str]]]:
    """A CSV file's header and rows (the sample employees, to change and import again)."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def write_csv(path, header: list[str], rows) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)


def one_line_error(result, code=2):
    assert result.exit_code == code, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("payrun: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def test_bad_month_is_refused(runner):
    msg = one_line_error(runner.invoke(cli, ["run", "--month", "2026-13"]))
    assert "YYYY-MM" in msg


def test_month_without_salary_lines_says_what_to_do(runner, cfg, conn):
    payroll.seed(payroll.PayrollDB(cfg.payroll_path), companies=1, employees=3, seed=1, month="2026-11")
    msg = one_line_error(runner.invoke(cli, ["run", "--month", "2026-12"]))
    assert "payrun seed --month 2026-12" in msg


def test_bad_csv_reports_lines_and_imports_nothing(runner, cfg, tmp_path):
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=1, employees=2, seed=1, month="2026-11")
    before = db.conn.execute("SELECT COUNT(*) FROM employees").fetchone()[0]
    good = open("docs/sample-employees.csv", encoding="utf-8").read().splitlines()
    bad = list(good)
    bad[3] = bad[3].replace("@", " at ", 1)  # malformed email on physical line 4
    p = tmp_path / "bad.csv"
    p.write_text("\n".join(bad) + "\n", encoding="utf-8")
    msg = one_line_error(runner.invoke(cli, ["import", str(p)]))
    assert "line 4" in msg and "email" in msg
    assert db.conn.execute("SELECT COUNT(*) FROM employees").fetchone()[0] == before


def test_config_show_redacts_and_redis_url_does_not(runner, cfg):
    shown = json.loads(runner.invoke(cli, ["config", "show", "--json"]).output)
    assert "password=***" in shown["redis"]["url"]
    assert shown["render"]["timeout_s"] == 30 and shown["lease"]["visibility_s"] == 60
    assert shown["metrics"]["port"]
    url = runner.invoke(cli, ["config", "redis-url"]).output.strip()
    assert url == cfg.redis.url and "***" not in url


def test_invalid_config_is_refused_naming_values(runner, tmp_path, monkeypatch):
    p = tmp_path / "c.toml"
    p.write_text("[render]\ntimeout_s = 90\n[lease]\ngrace_s = 100\n")
    monkeypatch.setenv("PAYRUN_CONFIG", str(p))
    msg = one_line_error(runner.invoke(cli, ["config", "show"]))
    assert "render.timeout_s (90 s)" in msg and "lease.visibility_s (60 s)" in msg


def test_unknown_queue(runner):
    msg = one_line_error(runner.invoke(cli, ["worker", "pdf-rendr"]))
    assert "pdf-render" in msg


def test_limits_set_and_show(runner, conn):
    assert runner.invoke(cli, ["limits", "set", "--cap", "30", "--rate", "20"]).exit_code == 0
    shown = json.loads(runner.invoke(cli, ["limits", "show", "--json"]).output)
    assert shown["email"]["cap"] == 30 and shown["email"]["rate_per_s"] == 20
    assert shown["email"]["gate_margin_ms"] == 20  # no 429 seen: the gate's narrowest margin
    assert "send gate: 1 s + 20 ms" in runner.invoke(cli, ["limits", "show"]).output
    one_line_error(runner.invoke(cli, ["limits", "set"]))


def test_limits_show_says_when_a_429_pause_holds_every_sender(runner, conn):
    """During a 429 pause `limits show` read "50 / 50 in flight" and nothing else: the
    on-call saw a full cap and no sends."""
    from payrun import keys

    conn.set(keys.limit_pause("email"), 1, px=60_000)  # (deleted below: no test waits it out)
    shown = json.loads(runner.invoke(cli, ["limits", "show", "--json"]).output)
    assert 0 < shown["email"]["paused_for_s"] <= 60
    out = runner.invoke(cli, ["limits", "show"]).output
    assert "paused: the provider answered 429" in out and "s left): no new send starts" in out, out
    conn.delete(keys.limit_pause("email"))
    assert "paused" not in runner.invoke(cli, ["limits", "show"]).output
    assert json.loads(runner.invoke(cli, ["limits", "show", "--json"]).output)["email"]["paused_for_s"] == 0


def test_unknown_job(runner, cfg, conn):
    from payrun.ledger import Ledger

    Ledger(cfg.ledger_path).close()  # a data directory in use
    msg = one_line_error(runner.invoke(cli, ["job", "nope"]))
    assert "no job 'nope'" in msg


def test_an_unknown_job_id_gets_the_ids_it_begins_or_one_of_this_ledgers(runner, cfg, conn):
    """The hint named a fixed example month whatever the ledger held; an id cut short
    (copied from a narrow terminal) now gets the ids it begins."""
    from payrun.ledger import Ledger

    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": f"{k}-2026-12-emp-{i:05d}", "kind": k, "month": "2026-12", "company_id": 1,
                         "employee_id": f"emp-{i:05d}"}
                        for k in ("render", "email") for i in (1, 12, 13, 2)])
    ledger.close()
    # an employee's id given for a job's: their jobs (it got an unrelated example id)
    msg = one_line_error(runner.invoke(cli, ["job", "emp-00012"]))
    assert msg.endswith("(that is an employee; their jobs, newest first: email-2026-12-emp-00012, "
                        "render-2026-12-emp-00012)"), msg
    msg = one_line_error(runner.invoke(cli, ["job", "email-2026-12-emp-0001"]))
    assert msg.endswith("(ids starting with it: email-2026-12-emp-00012, email-2026-12-emp-00013)"), msg
    msg = one_line_error(runner.invoke(cli, ["job", "slip-42"]))
    assert "ids look like email-2026-12-emp-00002" in msg, msg


def test_a_queued_jobs_view_says_how_many_are_ahead_of_it_and_the_rate_they_start_at(runner, cfg, conn):
    """Drill 43: with the rate lowered to 2/s, `payrun job` of a send waiting in its queue
    read "in Redis: queued" and nothing else: not how far back it is, nor what paces it."""
    from jobs.runtime import make_queue
    from payrun.ledger import queued_text

    assert queued_text(424, "send-email", 2.0) == ("in Redis: queued, 424 jobs ahead of it on send-email "
                                                  "(sends start at most 2/s: its turn in about 3 min 32 s)")
    assert queued_text(1, "send-email", 40.0) == ("in Redis: queued, 1 job ahead of it on send-email "
                                                 "(sends start at most 40/s: its turn in about 1 s)")
    assert queued_text(0, "send-email", 2.0) == "in Redis: queued, next on send-email"
    assert queued_text(7, "pdf-render", None) == "in Redis: queued, 7 jobs ahead of it on pdf-render"
    assert queued_text(None, "send-email", 2.0) == "in Redis: queued"
    assert queued_text(3, "send-email", 2.0, drained=True) == (  # (no turn promised while nothing is taken)
        "in Redis: queued, 3 jobs ahead of it on send-email (intake is drained there: nothing is taken until "
        "`payrun resume`)")
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=1, employees=3, seed=1, month="2026-11")
    assert runner.invoke(cli, ["run", "--month", "2026-11"]).exit_code == 0
    last = sorted(payroll.employee_ids(db, "2026-11"))[-1]
    out = runner.invoke(cli, ["job", f"render-2026-11-{last}"])
    assert "in Redis: queued, 2 jobs ahead of it on pdf-render\n" in out.output, out.output
    assert runner.invoke(cli, ["limits", "set", "--rate", "2"]).exit_code == 0
    q = make_queue("send-email", conn)
    for i in range(3):
        q.enqueue("builtins.print", f"emp-{i}", job_id=f"email-2026-11-emp-9000{i}")
    out = runner.invoke(cli, ["job", "email-2026-11-emp-90002"])
    assert "in Redis: queued, 2 jobs ahead of it on send-email (sends start at most 2/s: its turn in about 1 s)" \
        in out.output, out.output
    assert runner.invoke(cli, ["drain", "--queue", "send-email"]).exit_code == 0
    out = runner.invoke(cli, ["job", "email-2026-11-emp-90002"])
    assert "on send-email (intake is drained there: nothing is taken until `payrun resume`)" in out.output, out.output


def test_prune_keeps_later_months(runner, cfg):
    from payrun.ledger import Ledger

    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": f"render-{m}-emp-1", "kind": "render", "month": m, "company_id": 1}
                        for m in ("2026-09", "2026-10", "2026-11")])
    ledger.claim_run(1, "2026-11", "test")  # this month's run
    for m in ("2026-09", "2026-10"):
        (cfg.slips_dir / m / "1").mkdir(parents=True)
    # months with work not finished are kept (their ledger says who got a slip)...
    msg = one_line_error(runner.invoke(cli, ["prune", "--before", "2026-11"]))
    assert "2026-09 has 1 unfinished job" in msg and "--force" in msg
    with ledger.db.conn:
        ledger.db.conn.execute("UPDATE jobs SET status = 'done'")
    # ... and so is the latest pay run, finished or not
    msg = one_line_error(runner.invoke(cli, ["prune", "--before", "2026-12"]))
    assert "2026-11 is the latest pay run" in msg
    dry_refused = runner.invoke(cli, ["prune", "--before", "2026-12", "--dry-run"])  # a dry run says so
    assert dry_refused.exit_code == 0 and "but without --dry-run: refusing to prune" in dry_refused.output
    assert len(ledger.jobs(limit=10)) == 3  # nothing was removed
    dry = json.loads(runner.invoke(cli, ["prune", "--before", "2026-11", "--slips", "--dry-run", "--json"]).output)
    assert dry["jobs"] == 2 and dry["slip_dirs"] == 2 and (cfg.slips_dir / "2026-09").exists()
    out = runner.invoke(cli, ["prune", "--before", "2026-11", "--slips"])
    assert out.exit_code == 0 and "removed 2 jobs" in out.output
    assert [r["month"] for r in ledger.jobs(limit=10)] == ["2026-11"]
    assert not (cfg.slips_dir / "2026-09").exists()
    one_line_error(runner.invoke(cli, ["prune", "--before", "last-year"]))
    out = runner.invoke(cli, ["prune", "--before", "2026-12", "--force"])
    assert out.exit_code == 0 and "removed 1 job," in out.output
    # a prune deletes who-got-a-slip history: it is in the audit log (dry runs and refusals are not)
    from payrun.audit import read_audit

    pruned = [(e["command"], e["count"], e["detail"]["months"]) for e in read_audit(cfg) if e["what"] == "prune"]
    assert pruned == [("payrun prune --before 2026-11 --slips", 2, ["2026-09", "2026-10"]),
                      ("payrun prune --before 2026-12 --force", 1, ["2026-11"])]
    # a pruned month is not run again (its jobs can still be in Redis: the run would never finish)
    payroll.seed(payroll.PayrollDB(cfg.payroll_path), companies=1, employees=2, month="2026-10")
    msg = one_line_error(runner.invoke(cli, ["run", "--month", "2026-10"]))
    assert "2026-10 was pruned from the ledger" in msg and "cannot be run again" in msg
    assert ledger.months() == [] and ledger.jobs(limit=10) == []  # nothing created


def test_prune_deletes_only_month_folders_inside_the_slip_store(runner, cfg, tmp_path):
    """Security review: a month as the ledger recorded it came through Redis; one forged
    event with month '../../victim' (it sorts before every real month) made
    `prune --slips` delete a folder outside the slip store."""
    from payrun.ledger import Ledger

    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    cfg.slips_dir.mkdir(parents=True, exist_ok=True)
    forged = "../" * len(cfg.slips_dir.relative_to(tmp_path).parts) + "victim"
    assert (cfg.slips_dir / forged).resolve() == victim.resolve()
    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": f"render-{m}-emp-1", "kind": "render", "month": m, "company_id": 1}
                        for m in (forged, "2026-09", "2026-11")])
    ledger.claim_run(1, "2026-11", "test")
    with ledger.db.conn:
        ledger.db.conn.execute("UPDATE jobs SET status = 'done'")
    (cfg.slips_dir / "2026-09" / "1").mkdir(parents=True)
    out = runner.invoke(cli, ["prune", "--before", "2026-11", "--slips"])
    assert out.exit_code == 0, out.output
    assert victim.joinpath("keep").is_dir()  # untouched
    assert not (cfg.slips_dir / "2026-09").exists()  # the real month's folder went


def test_a_send_reads_only_files_inside_the_slip_store(tmp_path):
    """Security review: the slip path comes from a job in Redis, and the send attaches what
    it reads to an email: absolute paths, '..' and symlinks out are refused."""
    from jobs.tasks import _slip_path

    store = tmp_path / "slips"
    (store / "2026-11" / "1").mkdir(parents=True)
    (store / "2026-11" / "1" / "emp-1.pdf").write_bytes(b"%PDF")
    (tmp_path / "secret").write_text("x")
    (store / "2026-11" / "1" / "link.pdf").symlink_to(tmp_path / "secret")
    assert _slip_path(store, "2026-11/1/emp-1.pdf") == (store / "2026-11/1/emp-1.pdf").resolve()
    for bad in ("/etc/passwd", "../secret", "2026-11/../../secret", "2026-11/1/link.pdf", "", ".", "a\x00b", None):
        assert _slip_path(store, bad) is None, bad


def test_cli_retry_and_limits_are_audited(runner, cfg, conn):
    from console import actions

    runner.invoke(cli, ["limits", "set", "--cap", "40"])
    out = runner.invoke(cli, ["retry", "no-such-job"])  # bad input: nothing done, nothing audited
    assert out.exit_code == 2 and out.output.startswith("payrun: not among failed jobs: no-such-job"), out.output
    entries = actions.read_audit(cfg)
    assert entries[-1]["command"] == "payrun limits set --cap 40"
    assert entries[-1]["via"] == "cli" and entries[-1]["who"]
    out = runner.invoke(cli, ["retry", "--all"])  # an action that matched nothing is still one taken
    assert out.exit_code == 0 and "requeued 0 job(s); no failed job matched" in out.output
    assert actions.read_audit(cfg)[-1]["command"] == "payrun retry --all"
    out = runner.invoke(cli, ["retry", "--all", "--error", "no such text"])  # (on-call: a typo read as "done")
    assert out.exit_code == 0, out.output
    assert "no failed job matched (`payrun failed --error 'no such text'` lists what --all acts on)" in out.output


def test_the_readmes_import_of_the_sample_files_works_on_a_fresh_install(runner, cfg):
    """README: `payrun import --companies companies.csv && payrun import employees.csv`."""
    first = runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    assert first.exit_code == 0 and " new, 0 updated, 0 unchanged" in first.output, first.output
    again = runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    assert again.exit_code == 0 and ": 0 new, 0 updated, " in again.output, again.output
    out = runner.invoke(cli, ["import", "docs/sample-employees.csv"])
    assert out.exit_code == 0 and "imported 12 employees (12 new, 0 already there) " \
        "and 12 salary lines" in out.output, out.output
    assert payroll.count_employees(payroll.PayrollDB(cfg.payroll_path), "2026-11") == 12


def test_reimporting_employees_after_a_run_names_whose_slips_changed(runner, cfg, conn, tmp_path):
    """HR fixes data after the run: the import names the employees whose slip of a month
    already run now reads differently (it said "12 of them already have a slip, made with
    the old data" for one changed salary, and named the first row as the example), and
    the ones that moved company."""

    runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    runner.invoke(cli, ["import", "docs/sample-employees.csv"])
    assert runner.invoke(cli, ["run", "--month", "2026-11"]).exit_code == 0
    out = runner.invoke(cli, ["import", "docs/sample-employees.csv"])  # the same file again
    assert out.exit_code == 0 and "(0 new, 12 already there: 0 with changed details, 12 unchanged)" in out.output
    assert "12 salary lines (0 new, 0 with other figures, 12 the same)" in out.output, out.output
    assert "note:" not in out.output, out.output
    header, rows = read_csv("docs/sample-employees.csv")
    rows[4]["basic"] = "47000"  # a salary corrected: the slip changes, not the employee
    rows[6]["email"] = "new.address@example.org"  # an address fixed: both
    (tmp_path / "co.csv").write_text("id,name,address\n2,Padma Textiles Ltd.,\"Agrabad, Chattogram\"\n",
                                     encoding="utf-8")
    assert runner.invoke(cli, ["import", "--companies", str(tmp_path / "co.csv")]).exit_code == 0
    rows[8]["company_id"] = "2"  # HR corrects an employer
    fixed = tmp_path / "fixed.csv"
    write_csv(fixed, header, rows)
    out = runner.invoke(cli, ["import", str(fixed)])
    assert out.exit_code == 0 and "(0 new, 12 already there: 2 with changed details, 10 unchanged)" in out.output
    # (HR walkthrough, session 41: a corrected salary read "... 1 unchanged" and nothing on the line)
    assert "12 salary lines (0 new, 2 with other figures, 10 the same)" in out.output, out.output
    e4, e6, e8 = rows[4]["employee_id"], rows[6]["employee_id"], rows[8]["employee_id"]
    assert f"note: {e8} moved from company 1 to company 2 (for the months in this file;" in out.output
    assert (f"note: 2 2026-11 slips already made read differently now (made with the old data): {e4}, {e8}. "
            f"`payrun resend --employee {e4} --month 2026-11` sends one again") in out.output, out.output
    # (walkthrough, session 35) an address alone: the slip does not print it, so it does not
    # "read differently"; what to do depends on its send, here not made yet (no worker ran)
    assert (f"note: 1 2026-11 slip already made goes to a new email address now (the slip does not print it: no "
            f"new slip is needed): {e6}\n  not delivered yet, on its way to the old address (a job keeps the "
            f"address it was made with): {e6}; a send of it that fails goes to the new address with `payrun retry`"
            ) in out.output, out.output
    assert "payrun retry email-" not in out.output  # (it offered a retry of a send that had not failed: refused)
    assert rows[0]["employee_id"] not in out.output
    # its render failed: the retry to name is the render's, which reads the new address
    from payrun.ledger import Ledger

    led = Ledger(cfg.ledger_path)
    with led.db.conn:
        led.db.conn.execute("UPDATE jobs SET status = 'failed' WHERE id = ?", (f"render-2026-11-{e6}",))
    led.close()
    rows[6]["email"] = "newer.address@example.org"
    write_csv(fixed, header, rows)
    out = runner.invoke(cli, ["import", str(fixed)])
    assert out.exit_code == 0 and "read differently" not in out.output, out.output
    assert (f"\n  failed: {e6}; `payrun retry render-2026-11-{e6}` sends it to the new address\n" in out.output
            and "on its way" not in out.output), out.output


def test_the_note_on_a_changed_address_alone_says_what_each_slip_needs():
    """A slip whose employee's address alone changed needs no new slip; what it needs
    depends on its send: a failed one a retry (which reads the address again), one
    delivered to the old address a resend if it should reach the new one, one on its way
    nothing yet (it goes to the old address: a job keeps the address it was made with)."""
    from payrun.cli import readdressed_notes, readdressed_state

    assert readdressed_state("done", "done") == "delivered"
    assert readdressed_state("done", "failed") == "failed" and readdressed_state("failed", None) == "failed"
    for render, send in (("queued", None), ("running", None), ("retrying", None), ("done", None),
                         ("done", "queued"), ("done", "retrying"), ("done", "running"), (None, None)):
        assert readdressed_state(render, send) == "on its way", (render, send)
    states = {"e1": ("done", "failed"), "e2": ("failed", None), "e3": ("done", "done"), "e4": ("done", "retrying")}
    head, failed, delivered, pending = readdressed_notes("2026-11", states)
    assert head.startswith("note: 4 2026-11 slips already made go to a new email address now") and "e1, e2, e3, e4" in head
    assert failed == "  failed: e1, e2; `payrun retry email-2026-11-e1 render-2026-11-e2` sends them to the new address"
    assert delivered.startswith("  delivered to the old address: e3; `payrun resend --employee e3 --month 2026-11`")
    assert pending.startswith("  not delivered yet, on its way to the old address") and ": e4;" in pending
    assert readdressed_notes("2026-11", {"e3": ("done", "done")})[1:] == [delivered]
    many = readdressed_notes("2026-11", {f"e{i:02d}": ("done", "failed") for i in range(12)})
    assert "e09 and 2 more" in many[0] and "email-2026-11-e09`" in many[1] and "email-2026-11-e10" not in many[1]
    assert "(the other 2: ids from `payrun failed --month 2026-11`)" in many[1]


def test_provider_and_bank_ports_out_of_range_or_taken_are_one_line_errors(runner, cfg, tmp_path, monkeypatch):
    """They were tracebacks (OverflowError, OSError) from deep in the socket code."""
    import socket

    from payrun import config
    from payrun.errors import ConfigError

    for command in (["provider"], ["bank"]):
        out = runner.invoke(cli, [*command, "--port", "99999"])
        assert out.exit_code == 2 and "1<=x<=65535" in out.output and "Traceback" not in out.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        msg = one_line_error(runner.invoke(cli, ["provider", "--port", str(port)]))
        assert f"cannot listen on 127.0.0.1:{port}" in msg
    bad = tmp_path / "bad.toml"
    bad.write_text("[provider]\nport = 99999\n")
    with pytest.raises(ConfigError, match="provider.port must be a port number"):
        config.load(bad, env={"PAYRUN_HOME": str(tmp_path)})


def test_the_local_provider_listens_on_loopback_only(runner, tmp_path):
    """It has no login: on another interface anyone who reached it read every recipient and
    subject and could reset its dedupe (a security review's finding)."""
    from payrun import config
    from payrun.errors import ConfigError

    for host in ("0.0.0.0", "::", "10.1.2.3", ""):
        out = runner.invoke(cli, ["provider", "--host", host])
        assert out.exit_code == 2 and "must be this machine's loopback" in out.output, (host, out.output)
        assert "Traceback" not in out.output
    bad = tmp_path / "bad.toml"
    bad.write_text('[provider]\nhost = "0.0.0.0"\n')
    with pytest.raises(ConfigError, match="provider.host must be this machine's loopback"):
        config.load(bad, env={"PAYRUN_HOME": str(tmp_path)})
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert config.provider_host_problem(host) is None


def test_month_messages_name_the_real_problem(runner, cfg, conn):
    payroll.seed(payroll.PayrollDB(cfg.payroll_path), companies=1, employees=1, seed=1, month="2026-11")
    assert "has no month 13" in one_line_error(runner.invoke(cli, ["run", "--month", "2026-13"]))
    assert "outside the years payrun takes (2000-2100)" in one_line_error(
        runner.invoke(cli, ["run", "--month", "1999-11"]))
    # digits of another script are not a month (months are compared as text)
    assert "YYYY-MM" in one_line_error(runner.invoke(cli, ["run", "--month", "2026-\u0661\u0661"]))
    out = runner.invoke(cli, ["run", "--month", "2026-11"])
    assert out.exit_code == 0 and "created 1 render job for 1 company (2026-11)" in out.output


def test_redis_down_is_exit_1_not_the_bad_input_exit_2(runner, cfg, monkeypatch):
    """A script must tell "the system is down" from "my argument was wrong"."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PAYRUN_REDIS_URL", f"redis://:pw@127.0.0.1:{port}/0")
    from payrun.ledger import Ledger

    Ledger(cfg.ledger_path).close()  # a data directory in use
    out = runner.invoke(cli, ["queues"])
    assert out.exit_code == 1, out.output
    assert out.output.startswith("payrun: Redis unreachable") and len(out.output.strip().splitlines()) == 1
    assert runner.invoke(cli, ["queues", "--nope"]).exit_code == 2


def test_a_company_or_reminder_that_cannot_be_is_bad_input(runner, cfg, conn):
    payroll.seed(payroll.PayrollDB(cfg.payroll_path), companies=1, employees=2, seed=1, month="2026-11")
    for args in (["failed", "--company", "99"], ["retry", "--all", "--company", "99"]):
        assert "no company 99 in the payroll database" in one_line_error(runner.invoke(cli, args))
    assert runner.invoke(cli, ["failed", "--company", "1"]).exit_code == 0
    assert "31 days" in one_line_error(runner.invoke(cli, ["remind", "--company", "1", "--in", "400d"]))
    assert "--message is empty" in one_line_error(
        runner.invoke(cli, ["remind", "--company", "1", "--in", "1h", "--message", " "]))


def test_a_reminder_text_that_could_mislead_employees_is_refused_with_nothing_scheduled(runner, cfg, conn):
    """`payrun remind --message` goes to every employee of a company: a text with an escape
    sequence or a bidi override (which reorders what the employee reads) is refused, as a
    name in the payroll data is, with nothing scheduled; line breaks and Bengali's joiners stay."""
    payroll.seed(payroll.PayrollDB(cfg.payroll_path), companies=1, employees=2, seed=1, month="2026-11")
    for text, why in (("Pay\x1b[2Jday", "control character"), ("account \u202e1234", "right-to-left override"),
                      ("x" * 5001, "at most 5,000")):
        msg = one_line_error(runner.invoke(cli, ["remind", "--company", "1", "--in", "1h", "--message", text]))
        assert why in msg and "nothing was scheduled" in msg and "\x1b" not in msg and "\u202e" not in msg
    assert conn.zcard(keys.delayed(keys.EMAIL_QUEUE)) == 0 and not list(conn.scan_iter("rq:job:remind-*"))
    out = runner.invoke(cli, ["remind", "--company", "1", "--in", "1h", "--json",
                              "--message", "Line one\n\tর‍্যাব ক্‌ষ\r\nLine three"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["scheduled"] == 2


def test_a_worker_option_that_does_not_apply_is_refused_not_ignored(runner):
    msg = one_line_error(runner.invoke(cli, ["worker", "pdf-render", "--lanes", "5"]))
    assert "--lanes is for send-email workers" in msg
    assert "unknown queue 'pdf'" in one_line_error(runner.invoke(cli, ["worker", "pdf"]))


def test_import_says_what_it_did_not_read_and_which_detail_differs(runner, cfg, tmp_path):
    """HR walkthrough: an `active` column (to mark a leaver) was dropped without a word; a
    companies file given without --companies listed every missing column; "details differ"
    did not say which; `run --company 99` sent HR to import salary lines for a company that
    does not exist."""

    runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    wrong = runner.invoke(cli, ["import", "docs/sample-companies.csv"])
    assert wrong.exit_code == 2 and "this looks like a companies file: `payrun import --companies FILE`" in wrong.output
    other_way = runner.invoke(cli, ["import", "--companies", "docs/sample-employees.csv"])  # (no hint that way round)
    assert other_way.exit_code == 2
    assert "this looks like an employees file: `payrun import FILE` (without --companies)" in other_way.output
    header, rows = read_csv("docs/sample-employees.csv")
    extra = tmp_path / "extra.csv"
    write_csv(extra, header + ["active", "overtime"], [dict(r, active="0", overtime="500") for r in rows])
    out = runner.invoke(cli, ["import", str(extra)])
    assert out.exit_code == 0 and "note: column(s) not imported (payrun does not know them): active, overtime" \
        in out.output, out.output
    twice = tmp_path / "twice.csv"
    write_csv(twice, header, [rows[0], dict(rows[0], month="2026-12", designation="Chief", email="x@y.example")])
    out = runner.invoke(cli, ["import", str(twice)])
    assert out.exit_code == 2 and "details differ from line 2 (email, designation)" in out.output, out.output
    out = runner.invoke(cli, ["run", "--month", "2026-11", "--company", "99"])
    assert out.exit_code == 2 and "no company 99 in the payroll database" in out.output, out.output


def test_run_and_import_are_in_the_audit_log(runner, cfg, conn):
    """Ops walkthrough: `payrun audit` said "every action" but left out the run (the
    action that emails everyone) and the import (addresses and salaries)."""
    from payrun.audit import read_audit

    runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    runner.invoke(cli, ["import", "docs/sample-employees.csv"])
    assert runner.invoke(cli, ["run", "--month", "2026-11"]).exit_code == 0
    assert runner.invoke(cli, ["run", "--month", "2026-11"]).exit_code == 0  # nothing created: nothing done
    log = read_audit(cfg)
    assert [(e["what"], e["command"], e["count"]) for e in log] == [
        ("import", "payrun import --companies docs/sample-companies.csv", 1),
        ("import", "payrun import docs/sample-employees.csv", 12),
        ("run", "payrun run --month 2026-11", 12)]


def test_times_are_shown_in_the_payrolls_zone():
    """Ops walkthrough: status and the console said 13:14:16 +06, job and audit 07:14:51+00:00."""
    from payrun.clitools import local_time

    assert local_time("2026-12-04T07:14:51.123+00:00", "Asia/Dhaka") == "2026-12-04 13:14:51 +06"
    assert local_time("2026-12-04T20:00:00Z", "Asia/Dhaka") == "2026-12-05 02:00:00 +06"
    assert local_time("2026-12-04T07:14:51", "UTC") == "2026-12-04 07:14:51 +00"
    assert local_time(None, "Asia/Dhaka") == "?" and local_time("soon", "Asia/Dhaka") == "soon"


def test_an_employee_who_left_is_left_out_of_runs_and_reminders(runner, cfg, conn):
    """HR walkthrough: there was no way to mark a leaver; reminders kept going to them."""
    from payrun.audit import read_audit

    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=1, employees=5, seed=1, month="2026-11")
    gone = sorted(payroll.employee_ids(db, "2026-11"))[0]
    out = runner.invoke(cli, ["employee", "left", gone, "--on", "2026-10-31"])  # (before November: not paid)
    assert out.exit_code == 0 and "1 employee marked as left" in out.output, out.output
    assert gone not in payroll.employee_ids(db, "2026-11") and payroll.count_employees(db, "2026-11") == 4
    assert payroll.employee_snapshot(db, "2026-11", gone)["employee"]["id"] == gone  # a resend still can
    again = runner.invoke(cli, ["employee", "left", gone])
    assert "0 employees marked" in again.output and "1 already so" in again.output
    bad = runner.invoke(cli, ["employee", "left", gone, "emp-99999"])
    assert bad.exit_code == 2 and "no employee 'emp-99999' in the payroll database; nothing changed" in bad.output
    # a reminder leaves them out (and `remind --in now` is a time)
    out = runner.invoke(cli, ["remind", "--company", "1", "--in", "now"])
    assert out.exit_code == 0 and "4 reminder" in out.output, out.output
    assert runner.invoke(cli, ["employee", "back", gone]).exit_code == 0
    assert gone in payroll.employee_ids(db, "2026-11")
    assert [e["what"] for e in read_audit(cfg)][-3:] == ["employee", "remind", "employee"]


def test_a_leaver_left_out_of_a_month_they_have_a_salary_line_for_is_named(runner, cfg, conn):
    """HR walkthrough (session 41): October's run was missed; an employee who left after
    October was marked left; the late October run made them no slip, and neither `run` nor
    `status` said so. Now the late run pays one who left after October began (they worked
    in it); one who left before it is named with the way to make theirs (their real date),
    and one whose slip exists is not named."""
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=1, employees=3, seed=1, month="2026-10")
    late, early, paid = sorted(payroll.employee_ids(db, "2026-10"))
    assert runner.invoke(cli, ["employee", "left", late]).exit_code == 0  # today: after October
    assert runner.invoke(cli, ["employee", "left", early, "--on", "2026-09-30"]).exit_code == 0
    out = runner.invoke(cli, ["run", "--month", "2026-10"])
    assert out.exit_code == 0 and "created 2 render jobs" in out.output, out.output  # late's final slip too
    note = (f"1 employee marked as left (`payrun employee left`) has a salary line for 2026-10 and no slip "
            f"of it: {early} (left 2026-09-30). A run of 2026-10 pays leavers who left on or after 2026-10-01 "
            f"(their final slip); this one left before 2026-10, or on a day not recorded. Worked in 2026-10: "
            f"`payrun employee left {early} --on DATE` (the day they left), then `payrun run --month 2026-10 --resume`")
    assert note in out.output and late not in out.output, out.output
    st = runner.invoke(cli, ["status", "--month", "2026-10", "--json"])
    assert any(note in n for n in json.loads(st.output)["notes"]), st.output
    assert json.loads(st.output)["total"]["no_slip"] == 0  # (neither missing nor extra)
    # HR asks for their slip's job (drill 43: "no job … ids look like …", as for a typo)
    for kind in ("email", "render"):
        job = runner.invoke(cli, ["job", f"{kind}-2026-10-{early}"])
        assert job.exit_code == 2 and one_line_error(job) == (
            f"payrun: no job '{kind}-2026-10-{early}': no 2026-10 slip was made for {early}: they are marked as left "
            f"(left 2026-09-30), before 2026-10 or on a day not recorded, so the 2026-10 run left them out; worked in "
            f"2026-10: `payrun employee left {early} --on DATE` (the day they left, 2026-10-01 or later), then "
            f"`payrun run --month 2026-10 --resume`"), job.output
    assert "ids look like" in runner.invoke(cli, ["job", "email-2026-10-emp-99999"]).output  # (not an employee)
    # the way it names works, keeps them marked left with their day, and then nothing is named
    assert runner.invoke(cli, ["employee", "left", early, "--on", "2026-10-03"]).exit_code == 0
    out = runner.invoke(cli, ["run", "--month", "2026-10", "--resume"])
    assert "created 1 render job" in out.output and "marked as left" not in out.output, out.output
    assert payroll.left_on(db, [early]) == {early: "2026-10-03"}
    assert runner.invoke(cli, ["employee", "left", paid]).exit_code == 0
    st = runner.invoke(cli, ["status", "--month", "2026-10"])
    assert st.exit_code == 0 and "marked as left" not in st.output, st.output

def test_the_brakes_work_with_a_config_file_broken_mid_run(runner, cfg, conn, tmp_path, monkeypatch):
    """On-call drill: a typo saved in the config file blocked `payrun drain`, `down` and
    `ps` as well. The brakes now go on with the built-in defaults and the data directory
    (PAYRUN_HOME), saying so; every other command still refuses the file."""
    bad = tmp_path / "bad.toml"
    bad.write_text('timezone = "Asia/Dhaka"\n[limits]\nemail_rate_per_s = 40.0.\n', encoding="utf-8")
    monkeypatch.setenv("PAYRUN_CONFIG", str(bad))
    out = runner.invoke(cli, ["drain"])
    assert out.exit_code == 0, out.output
    assert "payrun: warning: config file" in out.output and "not valid TOML" in out.output
    assert "`payrun drain` goes on with the built-in defaults" in out.output
    from rq.suspension import is_suspended

    assert is_suspended(conn)  # intake stopped everywhere
    assert runner.invoke(cli, ["resume"]).exit_code == 0
    assert not is_suspended(conn)
    assert "not valid TOML" in one_line_error(runner.invoke(cli, ["failed"]))  # not a brake: refused
    monkeypatch.delenv("PAYRUN_HOME")  # the file might have named another home: no guessing
    assert "not valid TOML" in one_line_error(runner.invoke(cli, ["drain"]))
    # ... or another Redis (redis.url): with no PAYRUN_REDIS_URL and no embedded Redis
    # running in the home, nothing is guessed, and no new Redis is started (review)
    monkeypatch.setenv("PAYRUN_HOME", str(cfg.home))
    monkeypatch.delenv("PAYRUN_REDIS_URL")
    assert "not valid TOML" in one_line_error(runner.invoke(cli, ["drain"]))
    assert not (cfg.home / "redis" / "redis.pid").exists() and not list(cfg.home.glob("redis/*.sock"))


def test_the_gone_lanes_of_one_restarted_sender_read_as_one_row():
    """A send-email process that exited (a restart) left 50 lanes' RQ records: `payrun
    workers` printed 50 "GONE" lines and "50 worker(s) GONE (killed or hung)". Its idle
    lanes are one row now; a lane that held a job keeps its own (it names the job), and
    live workers are listed as before."""
    from console.cli import collapse_gone_lanes
    from console.data import WorkerRow

    def row(name, pid, alive=False, kind="email", job=None, returned=None):
        return WorkerRow(name=name, host="vm", pid=pid, queues="send-email" if kind == "email" else "pdf-render",
                         state="idle", job_id=job, job_elapsed_s=None, heartbeat_age_s=40.0, alive=alive,
                         stopping=False, kind=kind, job_returned=returned)

    old = [row(f"email.vm.13878.{i:02d}", 13878) for i in range(50)]
    held = row("email.vm.13878.50", 13878, returned="email-2026-11-emp-00007")
    new = [row(f"email.vm.14001.{i:02d}", 14001, alive=True) for i in range(3)]
    render = row("render.vm.12000", 12000, kind="render")
    shown = collapse_gone_lanes([*old[:20], held, *old[20:], render, *new])
    assert [(w.name, n) for w, n in shown] == [("email.vm.13878.00", 50), ("email.vm.13878.50", 1),
                                               ("render.vm.12000", 1), *[(w.name, 1) for w in new]]


def test_import_help_lists_the_columns_it_reads(runner):
    """A new user had to find docs/sample-employees.csv to learn the columns."""
    import re

    from payrun import payroll

    text = " ".join(runner.invoke(cli, ["import", "--help"]).output.split())
    listed = re.search(r"Employees \(.*?\): (.*?) Companies", text).group(1)
    assert [c.split(" (")[0] for c in listed.split(", ")] == list(payroll.CSV_COLUMNS), listed
    assert f"Companies (--companies; import them first): {', '.join(payroll.COMPANY_CSV_COLUMNS)}" in text
    assert f"Optional in an employees file: {', '.join(payroll.OPTIONAL_CSV_COLUMNS)} (YYYY-MM-DD" in text


def test_the_audit_line_of_an_import_of_one_says_one(runner, cfg, tmp_path):
    """`payrun audit` read "1 companies (0 updated)"."""
    one = tmp_path / "one.csv"
    one.write_text("id,name,address\n1,Doel Garments Ltd,\"House 1, Road 2, Dhaka\"\n", encoding="utf-8")
    assert runner.invoke(cli, ["import", "--companies", str(one)]).exit_code == 0
    out = runner.invoke(cli, ["audit"]).output
    assert "1 company (0 updated)" in out and "1 companies" not in out, out


def test_every_month_option_shows_its_form_in_help():
    """Half the --month options read `--month TEXT` in --help, the other half `--month YYYY-MM`."""
    import click

    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
            return
        for p in cmd.params:
            if isinstance(p, click.Option) and p.opts[0] in ("--month", "--before"):
                yield " ".join(path), p

    found = list(walk(cli, []))
    assert len(found) >= 8, found
    assert [(where, p.opts[0]) for where, p in found if p.metavar != "YYYY-MM"] == []


def test_a_taken_port_is_named_with_the_setting_that_moves_it(runner, cfg):
    """Two data directories `payrun up` on one host: the provider's log named the address
    but not what to change, and the bank's said only "cannot listen"."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = runner.invoke(cli, ["provider", "--port", str(port)])
        assert out.exit_code == 2, out.output
        assert f"cannot listen on 127.0.0.1:{port}" in out.output and "provider.port in the config file" in out.output
        out = runner.invoke(cli, ["bank", "--port", str(port)])
        assert out.exit_code == 2, out.output
        assert f"cannot listen on 127.0.0.1:{port}" in out.output and "scheduler.bank_url" in out.output, out.output


def test_prune_force_keeps_a_month_whose_jobs_redis_still_holds(runner, cfg, conn):
    """`prune --force` over a month still being made deleted its ledger rows, its pay-run
    rows and (--slips) the slips its sends were about to attach: --force now overrides
    only the latest-run rule and unfinished rows Redis has forgotten."""
    from jobs.runtime import make_queue
    from payrun import keys
    from payrun.ledger import Ledger

    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": f"render-{m}-emp-{i}", "kind": "render", "month": m, "company_id": 1}
                        for m in ("2026-10", "2026-11") for i in (1, 2)])
    ledger.claim_run(1, "2026-11", "test")
    for m in ("2026-10", "2026-11"):
        (cfg.slips_dir / m / "1").mkdir(parents=True)
    q = make_queue(keys.RENDER_QUEUE, conn)  # 2026-11 is still in the queue; Redis forgot 2026-10's
    q.enqueue_call("jobs.testing.noop", job_id="render-2026-11-emp-1", meta={"kind": "test"})
    msg = one_line_error(runner.invoke(cli, ["prune", "--before", "2026-12", "--slips", "--force"]))
    assert "even with --force: 2026-11 has 1 job still queued, running or waiting to retry in Redis" in msg, msg
    assert "2026-10" not in msg
    assert (cfg.slips_dir / "2026-11").exists() and len(ledger.jobs(limit=10)) == 4  # nothing removed
    dry = runner.invoke(cli, ["prune", "--before", "2026-12", "--force", "--dry-run"])
    assert dry.exit_code == 0 and "but without --dry-run: refusing to prune, even with --force" in dry.output
    out = runner.invoke(cli, ["prune", "--before", "2026-11", "--slips", "--force"])  # Redis forgot those
    assert out.exit_code == 0, out.output
    assert "removed 2 jobs, 0 attempts, 0 pay-run rows, 1 slip folder (months 2026-10)" in out.output
    q.delete(delete_jobs=True)  # 2026-11's job is gone too: --force prunes it
    out = runner.invoke(cli, ["prune", "--before", "2026-12", "--slips", "--force"])
    assert out.exit_code == 0 and "removed 2 jobs, 0 attempts, 1 pay-run row, 1 slip folder" in out.output


def test_an_address_changed_and_changed_back_is_not_called_the_old_address(runner, cfg, tmp_path):
    """A -> B -> A: the second import said "delivered to the old address ... `payrun
    resend` ... if it should" of a slip sent to the address now on file."""

    from payrun.cli import readdressed_notes
    from payrun.ledger import Ledger

    runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    runner.invoke(cli, ["import", "docs/sample-employees.csv"])
    assert runner.invoke(cli, ["run", "--month", "2026-11"]).exit_code == 0
    header, rows = read_csv("docs/sample-employees.csv")
    e6, e7, old = rows[6]["employee_id"], rows[7]["employee_id"], rows[6]["email"]
    led = Ledger(cfg.ledger_path)
    with led.db.conn:  # e6's slip was delivered (to A, the address its job has)
        led.db.conn.execute("UPDATE jobs SET status = 'done' WHERE employee_id = ?", (e6,))
    led.db.conn.executemany("INSERT INTO jobs (id, kind, employee_id, month, status) VALUES (?, 'email', ?, "
                            "'2026-11', 'done')", [(f"email-2026-11-{e6}", e6)])
    led.db.conn.commit()
    led.close()

    def import_with(e6_email: str, e7_email: str):
        rows[6]["email"], rows[7]["email"] = e6_email, e7_email
        path = tmp_path / "emp.csv"
        write_csv(path, header, rows)
        out = runner.invoke(cli, ["import", str(path)])
        assert out.exit_code == 0, out.output
        return out.output

    out = import_with("b.address@example.org", "b7@example.org")  # A -> B: to the old address, rightly
    assert f"delivered to the old address: {e6};" in out and "on its way to the old address" in out, out
    out = import_with(old, "c7@example.org")  # e6 back to A, e7 on to C
    assert f"delivered to the old address: {e6}" not in out and f"resend --employee {e6}" not in out, out
    assert (f"note: 1 2026-11 slip already made has the address on file now (it changed and changed back; "
            f"delivered or on its way to it): nothing to do: {e6}") in out, out
    assert f"note: 1 2026-11 slip already made goes to a new email address now (the slip does not print it: no " \
           f"new slip is needed): {e7}" in out, out
    # the policy alone: a failed send is still named with its retry (it reads the address again)
    lines = readdressed_notes("2026-11", {"e1": ("done", "done"), "e2": ("done", "failed")}, same={"e1", "e2"})
    assert lines[0].endswith("nothing to do: e1") and "failed: e2; `payrun retry email-2026-11-e2`" in lines[2]
    assert readdressed_notes("2026-11", {"e1": ("done", None)}, same={"e1"})[1:] == []


def test_a_new_address_names_the_failed_sends_of_months_not_in_the_file(runner, cfg, tmp_path):
    """HR walkthrough (session 41): a bad address failed both October's and November's
    sends; HR imported November's corrected row, as they would, and the import named only
    November's failed send (`payrun retry email-2026-11-…`): October's stayed failed, though
    an address is the employee's, not a month's. It names the other months' failed slips
    now, with the retry; a delivered slip of such a month is not named."""
    from payrun.cli import other_month_failed_note
    from payrun.ledger import Ledger

    runner.invoke(cli, ["import", "--companies", "docs/sample-companies.csv"])
    header, rows = read_csv("docs/sample-employees.csv")
    october = [dict(r, month="2026-10") for r in rows]
    path = tmp_path / "both.csv"
    write_csv(path, header, october + rows)
    assert runner.invoke(cli, ["import", str(path)]).exit_code == 0
    for m in ("2026-10", "2026-11"):
        assert runner.invoke(cli, ["run", "--month", m]).exit_code == 0
    e6, e7 = rows[6]["employee_id"], rows[7]["employee_id"]
    led = Ledger(cfg.ledger_path)
    with led.db.conn:  # both sends of e6 failed on its address; e7's October one was delivered
        led.db.conn.executemany("INSERT INTO jobs (id, kind, employee_id, month, status) VALUES (?, 'email', ?, ?, ?)",
                                [(f"email-{m}-{e6}", e6, m, "failed") for m in ("2026-10", "2026-11")]
                                + [(f"email-2026-10-{e7}", e7, "2026-10", "done")])
    led.close()
    rows[6]["email"], rows[7]["email"] = "fixed6@example.org", "fixed7@example.org"
    fixed = tmp_path / "fixed.csv"
    write_csv(fixed, header, rows)  # November's rows only
    out = runner.invoke(cli, ["import", str(fixed)])
    assert out.exit_code == 0, out.output
    assert f"`payrun retry email-2026-11-{e6}` sends it to the new address" in out.output, out.output
    assert (f"note: 1 2026-10 slip of an employee with a new email address failed (a month not in this file): "
            f"{e6}; `payrun retry email-2026-10-{e6}` sends it to the new address") in out.output, out.output
    assert f"2026-10-{e7}" not in out.output, out.output
    # the policy alone
    assert other_month_failed_note("2026-10", {"e1": ("done", "done"), "e2": ("queued", None)}) is None
    many = other_month_failed_note("2026-10", {f"e{i:02d}": ("done", "failed") for i in range(11)} | {"r": ("failed", None)})
    assert many.startswith("note: 12 2026-10 slips of employees with a new email address failed")
    assert "e09 and 2 more" in many and "email-2026-10-e09`" in many and "(the other 2: ids from" in many


def test_a_missed_pay_run_tick_is_named_by_status_until_the_month_is_run_by_hand(runner, cfg):
    """The scheduler was down over the 1st's tick and back past the catch-up window:
    `payrun status` showed the month before, complete, with no word of the month not run,
    and `payrun schedule` kept saying "run it by hand" after it had been."""
    from payrun.ledger import Ledger
    from scheduler.cli import missed_detail_text
    from scheduler.store import Store, missed_not_run

    ledger = Ledger(cfg.ledger_path)
    ledger.create_jobs([{"id": "render-2026-10-emp-1", "kind": "render", "month": "2026-10", "company_id": 1}])
    ledger.claim_run(1, "2026-10", "test")
    detail = ("no scheduler was running at the tick's time and none came back within the 6 h catch-up window "
              "(back at 2026-12-03 02:00 +06); run it by hand: payrun run --month 2026-11")
    store = Store(cfg.ledger_path)
    store.record_not_run("payroll", "payroll", ["2026-11-30T20:00:00+00:00"], "missed", detail)
    store.close()
    out = runner.invoke(cli, ["status"])
    assert out.exit_code == 0 and "Pay run 2026-10" in out.output, out.output
    assert ("note: the 2026-11 pay run has not run: its cron tick of 2026-12-01 02:00 Asia/Dhaka was missed (no "
            "scheduler ran within the catch-up window; `payrun schedule`): run it by hand: `payrun run --month "
            "2026-11`") in out.output, out.output
    msg = one_line_error(runner.invoke(cli, ["status", "--month", "2026-11"]))
    assert msg.startswith("payrun: no pay run for 2026-11: its cron tick of 2026-12-01 02:00 Asia/Dhaka was missed"), msg
    assert "`payrun run --month 2026-11`" in msg
    view = runner.invoke(cli, ["schedule"]).output
    assert "run it by hand: payrun run --month 2026-11" in view, view
    ledger.create_jobs([{"id": "render-2026-11-emp-1", "kind": "render", "month": "2026-11", "company_id": 1}])
    ledger.claim_run(1, "2026-11", "test")  # run by hand
    out = runner.invoke(cli, ["status", "--month", "2026-10"])
    assert out.exit_code == 0 and "has not run" not in out.output, out.output
    view = runner.invoke(cli, ["schedule"]).output
    assert "run it by hand" not in view and "run by hand since (the ledger has the month's run)" in view, view
    assert json.loads(runner.invoke(cli, ["schedule", "--json"]).output)["entries"][0]["missed_months_not_run"] == []
    # the policy alone
    rows = [("2026-10-31T20:00:00+00:00", "x; run it by hand: payrun run --month 2026-10, payrun run --month 2026-11"),
            ("2026-11-30T20:00:00+00:00", "x; run it by hand: payrun run --month 2026-11")]
    assert missed_not_run(rows, {"2026-10"}) == {"2026-11": "2026-11-30T20:00:00+00:00"}
    assert missed_not_run(rows, {"2026-10", "2026-11"}) == {}
    assert missed_detail_text(rows[0][1], ["2026-11"]) == "x; run it by hand: payrun run --month 2026-11"
    assert missed_detail_text("bank ticks missed", []) == "bank ticks missed"
    assert missed_detail_text(rows[1][1], None) == rows[1][1]


def test_a_reminder_reaches_a_leaver_in_the_month_whose_pay_it_is_about(runner, cfg, conn):
    """HR's eyes (session 43): a run of November pays one who left on 20 November (their
    final slip, on the 1st); the bank-details reminder "before payday" left them out, though
    that payday is theirs too. The plain reminder now goes to those the pay month's run pays
    (payroll.in_month_run): the month it is due in, or `--month M`; an October leaver gets
    none for November, and none of December's."""
    from datetime import datetime, timezone

    from scheduler.cli import reminder_month

    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=1, employees=5, seed=1, month="2026-11")
    final, october = sorted(payroll.employee_ids(db, "2026-11"))[:2]
    assert runner.invoke(cli, ["employee", "left", final, "--on", "2026-11-20"]).exit_code == 0
    assert runner.invoke(cli, ["employee", "left", october, "--on", "2026-10-31"]).exit_code == 0
    out = runner.invoke(cli, ["remind", "--company", "1", "--in", "1h", "--month", "2026-11", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["scheduled"] == 4 and data["month"] == "2026-11" and data["leavers"] == [final], data
    assert not any(october in j for j in data["jobs"]) and any(final in j for j in data["jobs"])
    out = runner.invoke(cli, ["remind", "--company", "1", "--in", "2h", "--month", "2026-11"])
    assert out.exit_code == 0 and "4 reminder(s) for company 1" in out.output, out.output
    assert (f"note: 1 who left in 2026-11 or later gets it too (the 2026-11 run pays them: their final slip): "
            f"{final} (left 2026-11-20)") in out.output, out.output
    data = json.loads(runner.invoke(cli, ["remind", "--company", "1", "--in", "3h", "--month", "2026-12",
                                          "--json"]).output)
    assert data["scheduled"] == 3 and data["leavers"] == []  # (December's pay is not theirs)
    # the default month: the one it is due in, in the configured zone (Asia/Dhaka: +06)
    assert reminder_month(datetime(2026, 11, 30, 17, 59, tzinfo=timezone.utc), "Asia/Dhaka") == "2026-11"
    assert reminder_month(datetime(2026, 11, 30, 18, 0, tzinfo=timezone.utc), "Asia/Dhaka") == "2026-12"
    bad = runner.invoke(cli, ["remind", "--company", "1", "--in", "1h", "--month", "2026-11", "--failed-slip",
                              "2026-11"])
    assert bad.exit_code == 2 and "leave out --month" in bad.output, bad.output
    assert runner.invoke(cli, ["remind", "--company", "1", "--in", "1h", "--month", "2026-13"]).exit_code == 2
