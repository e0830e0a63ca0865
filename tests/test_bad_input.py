"""Bad input everywhere (property-based): a clear one-line error and a non-zero exit,
nothing half-written, never a traceback shown to the user."""

from __future__ import annotations

import json

from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from payrun import config
from payrun.cli import cli
from payrun.errors import ConfigError

SECTIONS = {
    "": ["home", "timezone", "slips", "bogus"],
    "render": ["workers", "timeout_s", "nope"],
    "email": ["url", "lanes", "timeout_s", "sender"],
    "limits": ["email_concurrency", "email_rate_per_s", "db_concurrency"],
    "lease": ["visibility_s", "grace_s", "stuck_after_s", "reap_every_s"],
    "metrics": ["port"],
    "render.retry": ["base_s", "cap_s", "attempts", "jitter"],
}
values = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False, width=32),
                   st.booleans(), st.text(alphabet=st.characters(blacklist_categories=["Cs", "Cc"]), max_size=20))


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is JSON-compatible for these characters
    return repr(v)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(list(SECTIONS)), st.dictionaries(st.integers(0, 3), values, max_size=3),
                       max_size=4), st.text(max_size=30))
def test_config_loader_accepts_or_explains(tmp_path_factory, tables, garbage):
    d = tmp_path_factory.mktemp("cfg")
    lines = []
    for section, entries in tables.items():
        if section:
            lines.append(f"[{section}]")
        for i, v in entries.items():
            names = SECTIONS[section]
            lines.append(f"{names[i % len(names)]} = {toml_value(v)}")
    for text in ("\n".join(lines), garbage):
        p = d / "payrun.toml"
        p.write_text(text, encoding="utf-8")
        try:
            config.load(p, env={"PAYRUN_HOME": str(d)})
        except ConfigError as e:
            assert str(e) and "\n" not in str(e)


month_like = st.one_of(st.text(max_size=12), st.from_regex(r"\d{4}-\d{2}", fullmatch=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(st.one_of(st.sampled_from(["--month", "--company", "--json", "--employees", "--companies",
                                                "--before", "--cap", "--rate", "--queue", "--error"]),
                               month_like), max_size=4),
       command=st.sampled_from([["run"], ["status"], ["seed"], ["prune"], ["failed"], ["retry"],
                                ["limits", "set"], ["worker"], ["import"]]))
@example(args=["\x00"], command=["import"])  # click's own path check raised ValueError (found by hypothesis)
def test_cli_arguments_never_show_a_traceback(cfg, args, command):
    if command == ["seed"] and "--employees" not in args:
        args = [*args, "--employees", "3", "--companies", "1"]  # keep a valid seed small
    result = CliRunner().invoke(cli, [*command, *args])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    if result.exit_code not in (0,):
        assert result.exit_code in (1, 2)
        assert result.output.strip(), "a failure must say why"


cron_field = st.one_of(st.just("*"), st.integers(-5, 70).map(str), st.text(alphabet="0123456789*/-,abcxyzJANMON ",
                                                                         max_size=8))


@settings(max_examples=300, deadline=None)
@example("0 0 30 2 *")  # a valid form that never fires
@example("61 * * * *")
@given(st.one_of(st.lists(cron_field, min_size=0, max_size=7).map(" ".join), st.text(max_size=40)))
def test_cron_expressions_parse_or_say_why(expr):
    """Any string: a valid cron spec whose next fire time exists, or a CronError naming why."""
    from datetime import datetime, timezone
    from zoneinfo import ZoneInfo

    from scheduler.cron import CronError, next_after, parse

    try:
        spec = parse(expr)
    except CronError as e:
        assert str(e) and "\n" not in str(e)
        return
    try:
        nxt = next_after(spec, ZoneInfo("Asia/Dhaka"), datetime(2026, 11, 29, tzinfo=timezone.utc))
    except CronError as e:  # e.g. "30 of February": a valid form that never fires
        assert "never" in str(e).lower() or str(e)
        return
    assert nxt > datetime(2026, 11, 29, tzinfo=timezone.utc)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=12))
@example("0S")  # zero passed as a duration (found by hypothesis)
@example("0h0m")
@example("9999999999d")  # OverflowError from timedelta (found in review)
def test_durations_parse_or_say_why(text):
    from scheduler.cron import parse_duration
    from payrun.errors import PayrunError

    try:
        d = parse_duration(text)
    except (PayrunError, ValueError) as e:
        assert str(e)
        return
    assert d.total_seconds() > 0


def test_a_read_command_in_a_directory_with_no_payrun_refuses_instead_of_starting_an_empty_one(tmp_path, monkeypatch):
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.setenv("PAYRUN_HOME", str(tmp_path / "elsewhere" / "var"))
    # (`down`, `ps` and `drain` too: `down` said "supervisord is not running", exit 0, and
    # left a ./var behind, to an on-call engineer in the wrong shell while payrun ran elsewhere)
    for args in (["failed"], ["status"], ["queues"], ["down"], ["ps"], ["drain"], ["limits", "show"]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 2, (args, out.output)
        assert f"no payrun data directory at {tmp_path / 'elsewhere' / 'var'} (no payroll.db" in out.output
    assert not (tmp_path / "elsewhere").exists()  # no new Redis, no new ledger
    # a command that creates the directory without using it (`supervisor-env`: its logs
    # folder) does not make it count; nor does an external Redis make a ledger appear
    assert CliRunner().invoke(cli, ["supervisor-env"]).exit_code == 0
    assert (tmp_path / "elsewhere" / "var").exists()
    assert CliRunner().invoke(cli, ["status"]).exit_code == 2
    monkeypatch.setenv("PAYRUN_REDIS_URL", "redis://:pw@127.0.0.1:1/0")
    assert "no payrun data directory" in CliRunner().invoke(cli, ["status"]).output
    assert not (tmp_path / "elsewhere" / "var" / "ledger.db").exists()
    # `payrun demo` ran here: its data is one level down, and the message says so
    (tmp_path / "elsewhere" / "var" / "demo").mkdir()
    (tmp_path / "elsewhere" / "var" / "demo" / "ledger.db").touch()
    out = CliRunner().invoke(cli, ["status"]).output
    assert f"`payrun demo` keeps its data in {tmp_path / 'elsewhere' / 'var' / 'demo'}" in out, out


def test_the_wrong_shell_is_refused_and_left_as_it_was(tmp_path, monkeypatch):
    """New-user walkthrough: in a directory with no payrun data and no PAYRUN_HOME set,
    `payrun down` said "supervisord is not running", exit 0, and left ./var/log and
    ./var/redis/password there, to an on-call engineer in the wrong shell while payrun ran
    elsewhere. `ps` and `drain` alike, and `schedule` said "never run" of a pay run that ran
    elsewhere. `config redis-url` and `config rq-env` minted a password for a Redis that is
    not there (`rq info` then failed on a missing socket); `audit` said "no actions
    recorded". Each refuses, and creates
    nothing; `config show`, a look at the settings, answers and creates nothing either."""
    for name in ("PAYRUN_HOME", "PAYRUN_REDIS_URL", "PAYRUN_CONFIG", "SUPERVISOR_ENABLED", "PAYRUN_REDIS_SUPERVISED"):
        monkeypatch.delenv(name, raising=False)
    wrong = tmp_path / "wrong-shell"
    wrong.mkdir()
    monkeypatch.chdir(wrong)
    for args in (["down"], ["ps"], ["drain"], ["schedule"], ["schedule", "--json"], ["config", "redis-url"],
                 ["config", "redis-url", "--readonly"], ["config", "rq-env"], ["audit"]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 2, (args, out.output)
        assert out.output.count("\n") == 1 and "not running" not in out.output, (args, out.output)
        assert f"no payrun data directory at {wrong / 'var'} (no payroll.db" in out.output, (args, out.output)
        assert "set PAYRUN_HOME" in out.output
        assert list(wrong.iterdir()) == [], args  # no ./var/log, no ./var/redis/password
    out = CliRunner().invoke(cli, ["config", "show", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["effective"]["redis_url"] == f"unix://{wrong / 'var' / 'redis' / 'redis.sock'}?password=***"
    assert list(wrong.iterdir()) == []


def test_a_look_after_payrun_down_does_not_start_redis(tmp_path, monkeypatch):
    """New-user walkthrough (session 35): after `payrun down`, `payrun failed` and `payrun
    limits show` started the embedded Redis, left it running, and answered from it ("no
    failed jobs"), while `queues`, `workers` and `running` refused."""
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.delenv("PAYRUN_CONFIG", raising=False)
    home = tmp_path / "var"
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    assert CliRunner().invoke(cli, ["seed", "--month", "2026-11", "--employees", "60"]).exit_code == 0
    for args in (["failed"], ["limits", "show"], ["queues"], ["workers"], ["running"]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 1 and "Redis unreachable" in out.output, (args, out.output)
        assert "password=***" in out.output or "Redis unreachable (" in out.output  # (never the password)
    # every other look answers from the ledger, and says Redis is not there, without starting it
    assert "schedulers: Redis not reachable" in CliRunner().invoke(cli, ["schedule"]).output
    for args in (["status"], ["job", "render-2026-11-emp-00001"], ["config", "show"]):
        CliRunner().invoke(cli, args)
    assert not (home / "redis" / "redis.sock").exists() and not (home / "redis" / "redis.pid").exists()


def test_a_refused_import_in_a_directory_with_no_payrun_leaves_none_behind(tmp_path, monkeypatch):
    """Bad rows: nothing imported, and no empty payroll.db made on the way, which would make
    the next `payrun status` here report "no pay run yet" instead of refusing."""
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    home = tmp_path / "elsewhere" / "var"
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    # docs/sample-employees.csv is of companies 1 and 2, which are not there: every row refused
    out = CliRunner().invoke(cli, ["import", "docs/sample-employees.csv"])
    assert out.exit_code == 2 and "nothing imported" in out.output, out.output
    assert not (tmp_path / "elsewhere").exists()
    assert CliRunner().invoke(cli, ["status"]).exit_code == 2
    home.mkdir(parents=True)  # an existing directory stays, and so does a database already there
    assert CliRunner().invoke(cli, ["import", "docs/sample-employees.csv"]).exit_code == 2
    assert home.exists() and list(home.iterdir()) == []
    assert CliRunner().invoke(cli, ["import", "--companies", "docs/sample-companies.csv"]).exit_code == 0
    (tmp_path / "bad.csv").write_text("company_id,employee_id\n1,x\n", encoding="utf-8")
    assert CliRunner().invoke(cli, ["import", str(tmp_path / "bad.csv")]).exit_code == 2
    assert (home / "payroll.db").exists()


def test_retry_with_nothing_named_says_what_to_give():
    out = CliRunner().invoke(cli, ["retry"])
    assert out.exit_code == 2
    assert "name the failed jobs to retry (ids from `payrun failed`), or use --all" in out.output
    both = CliRunner().invoke(cli, ["retry", "--all", "some-id"])
    assert both.exit_code == 2 and "not both" in both.output


def test_seed_twice_says_it_adds_and_worker_env_needs_the_control_hosts_redis(tmp_path, monkeypatch):
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.setenv("PAYRUN_HOME", str(tmp_path / "h"))
    runner = CliRunner()
    first = runner.invoke(cli, ["seed", "--companies", "1", "--employees", "3", "--month", "2026-11"])
    assert "seeded 1 company, 3 employees" in first.output and "note:" not in first.output
    again = runner.invoke(cli, ["seed", "--companies", "1", "--employees", "2", "--month", "2026-11", "--seed", "8"])
    assert ("note: the database holds more than this seed (seed adds and updates, never removes): "
            "1 company in all; a run of 2026-11 pays 3 employees in 1 company\n") in again.output
    env = runner.invoke(cli, ["supervisor-env", "--role", "worker"])
    assert env.exit_code == 2 and "a worker-only host needs PAYRUN_REDIS_URL" in env.output


def test_a_file_name_with_a_nul_byte_is_a_usage_error(cfg):
    for argv in (["import", "a\x00b.csv"], ["--config", "a\x00b.toml", "status"]):
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 2 and "cannot contain a NUL byte" in result.output, (argv, result.output)


def test_failed_and_retry_say_a_bad_month_as_every_other_command_does(tmp_path, monkeypatch):
    monkeypatch.setenv("PAYRUN_HOME", str(tmp_path / "h"))
    runner = CliRunner()
    assert runner.invoke(cli, ["seed", "--companies", "1", "--employees", "1", "--month", "2026-11"]).exit_code == 0
    for argv in (["failed", "--month", "2026-13"], ["retry", "--all", "--month", "2026-13"]):
        out = runner.invoke(cli, argv)
        assert out.exit_code == 2, (argv, out.output)
        assert "--month must look like 2026-11 (YYYY-MM): '2026-13' has no month 13" in out.output, (argv, out.output)
    assert "got '2026-1'" in runner.invoke(cli, ["failed", "--month", "2026-1"]).output


def test_reap_every_without_loop_is_refused_and_the_helps_state_what_they_left_out(tmp_path, monkeypatch):
    """`payrun reap --every 30` made one pass and exited, the --every unread; `status --company`
    had no help line and `up --help` did not say that it waits by default."""
    monkeypatch.setenv("PAYRUN_HOME", str(tmp_path / "h"))
    runner = CliRunner()
    assert runner.invoke(cli, ["seed", "--companies", "1", "--employees", "1", "--month", "2026-11"]).exit_code == 0
    out = runner.invoke(cli, ["reap", "--every", "30"])
    assert out.exit_code == 2 and "add --loop" in out.output, out.output
    assert "Only this company id." in runner.invoke(cli, ["status", "--help"]).output
    assert "[default: wait]" in runner.invoke(cli, ["up", "--help"]).output
    assert "lease.reap_every_s, 5)" in " ".join(runner.invoke(cli, ["reap", "--help"]).output.split())


def test_seed_into_a_month_already_run_says_its_slips_keep_their_data(tmp_path, monkeypatch):
    from payrun import config as config_mod
    from payrun.ledger import Ledger

    monkeypatch.setenv("PAYRUN_HOME", str(tmp_path / "h"))
    runner = CliRunner()
    first = runner.invoke(cli, ["seed", "--companies", "1", "--employees", "3", "--month", "2026-11"])
    assert first.exit_code == 0 and "already run" not in first.output
    led = Ledger(config_mod.load().ledger_path)
    led.claim_run(1, "2026-11", "test")
    led.close()
    again = runner.invoke(cli, ["seed", "--companies", "2", "--employees", "5", "--month", "2026-11"])
    assert again.exit_code == 0
    assert "note: 2026-11 was already run: its slips keep the data they were made with" in again.output, again.output
    other = runner.invoke(cli, ["seed", "--companies", "2", "--employees", "5", "--month", "2026-12"])
    assert "already run" not in other.output


def test_a_refused_resend_does_not_start_redis(tmp_path, monkeypatch):
    """`payrun resend` for a month not run, or an employee not there, was refused after it
    had started the embedded Redis in the background, which it left running."""
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.delenv("PAYRUN_CONFIG", raising=False)
    home = tmp_path / "var"
    monkeypatch.setenv("PAYRUN_HOME", str(home))
    assert CliRunner().invoke(cli, ["seed", "--month", "2026-11", "--companies", "1", "--employees", "2"]).exit_code == 0
    for args, why in ((["--employee", "emp-00001", "--month", "2026-11"], "has not been run for company 1"),
                      (["--employee", "emp-99999", "--month", "2026-11"], "no employee 'emp-99999'"),
                      (["--employee", "emp-00001", "--month", "2026-10"], "no salary line for 2026-10")):
        out = CliRunner().invoke(cli, ["resend", *args])
        assert out.exit_code == 2 and why in out.output, (args, out.output)
    assert not (home / "redis" / "redis.sock").exists() and not (home / "redis" / "redis.pid").exists()


def test_status_of_a_month_not_run_names_that_month_in_its_hint(tmp_path, monkeypatch):
    """It said "`payrun run --month YYYY-MM` starts one" for the month the user had just typed."""
    monkeypatch.delenv("PAYRUN_REDIS_URL", raising=False)
    monkeypatch.setenv("PAYRUN_HOME", str(tmp_path / "var"))
    assert CliRunner().invoke(cli, ["seed", "--month", "2026-11", "--companies", "1", "--employees", "2"]).exit_code == 0
    out = CliRunner().invoke(cli, ["status", "--month", "2026-11"])
    assert out.exit_code == 2 and "no pay run for 2026-11: `payrun run --month 2026-11` starts it" in out.output, \
        out.output
