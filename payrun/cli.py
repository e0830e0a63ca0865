"""The `payrun` command. Every command has --help; bad input gives one line and exit 2."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from typing import Any

import click

from payrun import config as config_mod
from payrun import keys
from payrun.errors import InputError, PayrunError
from payrun.text import visible


from payrun.clitools import FilePath, handle_errors, local_time  # noqa: E402


class Ctx:
    def __init__(self, config_path: str | None):
        self.config_path = config_path
        self._cfg: config_mod.Config | None = None

    BRAKES = frozenset({"down", "drain", "resume", "ps", "status", "workers", "stop-worker"})
    """Commands an operator needs in an incident, even with a broken config file: they
    stop, pause or look, and need only the data directory and Redis."""

    @property
    def cfg(self) -> config_mod.Config:
        if self._cfg is None:
            try:
                self._cfg = config_mod.load(self.config_path)
            except config_mod.ConfigError as e:
                self._cfg = self._brakes_without_the_file(e)
        return self._cfg

    def _brakes_without_the_file(self, error: Exception) -> config_mod.Config:
        """A config file that does not load (a typo saved mid-run) blocked `payrun down`,
        `drain` and `ps` too (an on-call drill). For those commands, with PAYRUN_HOME set (the
        file could name another home), go on with the built-in defaults, and say so."""
        from payrun import redis_server

        ctx = click.get_current_context(silent=True)
        name = ctx.command.name if ctx is not None and ctx.command is not None else None
        file_given = self.config_path or os.environ.get("PAYRUN_CONFIG")
        if name not in self.BRAKES or not file_given or not os.environ.get("PAYRUN_HOME"):
            raise error
        cfg = config_mod.load(None, env={k: v for k, v in os.environ.items() if k != "PAYRUN_CONFIG"})
        # The file may have named an external Redis (redis.url): go on only with a Redis this
        # command can be sure of (PAYRUN_REDIS_URL, or the embedded one running in this home,
        # under supervisord or not), never one it would start (a review found `drain` starting
        # a new, empty Redis and reporting intake stopped while the real one ran on)
        if cfg.embedded_redis and not redis_server.supervisord_here(cfg) and not redis_server.ping(
                redis_server.connect(cfg, socket_timeout=2, socket_connect_timeout=2)):
            raise error
        which = "PAYRUN_REDIS_URL" if not cfg.embedded_redis else f"the embedded Redis running in {cfg.home}"
        click.echo(f"payrun: warning: {error}; `payrun {name}` goes on with the built-in defaults, "
                   f"PAYRUN_HOME={cfg.home} and {which} (fix the file before restarting anything)", err=True)
        return cfg

    def redis(self):
        from payrun import redis_server

        if self.cfg.embedded_redis:
            self.require_home()
        return redis_server.ensure_running(self.cfg)

    def running_redis(self):
        """The Redis of a payrun that is up, never started for a look: after `payrun down`,
        `failed` and `limits show` started the embedded Redis (and left it running) to
        report "no failed jobs" while `queues`, `workers` and `running` refused."""
        from payrun import redis_server
        from payrun.errors import RedisUnavailable

        if self.cfg.embedded_redis:
            self.require_home()
        try:
            up = redis_server.ping(redis_server.connect(self.cfg, socket_timeout=2, socket_connect_timeout=2))
        except Exception:  # noqa: BLE001 - an answer that is an error: not a Redis to read from
            up = False
        if not up:  # (said as `queues` says it)
            raise RedisUnavailable(f"Redis unreachable at {config_mod.redact_url(redis_server.url(self.cfg))} "
                                   f"({redis_server.unreachable_hint(self.cfg)})")
        return redis_server.connect(self.cfg)

    def ledger(self):
        from payrun.errors import SetupError
        from payrun.ledger import Ledger

        self.require_home()
        role = self.cfg.home / "supervisor.role"
        if not self.cfg.ledger_path.exists() and role.exists() and role.read_text().strip() == "worker":
            # (it made an empty ledger here and answered "no pay run yet" mid-run)
            from payrun import status

            given_up = status.programs_given_up(self.cfg)
            here = (f"; here, supervisord gave up on {', '.join(given_up[:6])}{' …' if len(given_up) > 6 else ''} "
                    f"(FATAL: their logs in {self.cfg.log_dir}): fix the cause, then `payrun up` starts them again"
                    if given_up else "; this host's own part: `payrun ps` (its programs), `payrun check`")
            raise SetupError(f"{self.cfg.home} is a worker host's (payrun up --role worker): the ledger, and with "
                             f"it the pay runs' status, is on the control host: run this command there{here}")
        return Ledger(self.cfg.ledger_path)

    HOME_MARKERS = ("payroll.db", "ledger.db", "supervisor.role", "supervisord.pid")
    """What a data directory in use holds (seed/import, the ledger, `payrun up`, a supervisord
    started by hand with `supervisor-env`, whose ledger may not have made ledger.db yet:
    `payrun down` then refused, and left it running); a directory that other commands merely
    created (logs, a Redis password) does not count."""

    def require_home(self) -> None:
        """Run from the wrong directory, a command would start a new, empty payrun in a new
        ./var (its own Redis, its own ledger) and report "no failed jobs" from it."""
        from payrun.errors import SetupError

        if os.environ.get("SUPERVISOR_ENABLED") or os.environ.get("PAYRUN_REDIS_SUPERVISED"):
            return  # supervisord's programs, or a shell with supervisor-env's PAYRUN_HOME: set on purpose
        home = self.cfg.home
        if not any((home / m).exists() for m in self.HOME_MARKERS):
            if any((home / "demo" / m).exists() for m in self.HOME_MARKERS):
                raise SetupError(f"no payrun data directory at {home}; `payrun demo` keeps its data in "
                                 f"{home / 'demo'}: PAYRUN_HOME={home / 'demo'} payrun ...")
            raise SetupError(f"no payrun data directory at {home} (no payroll.db or ledger.db there): set "
                             f"PAYRUN_HOME to it, or run this where you ran `payrun up` (a new one starts "
                             f"with `payrun seed`, `payrun import` or `payrun demo`)")

    def payroll(self):
        from payrun.payroll import PayrollDB

        return PayrollDB(self.cfg.payroll_path)


pass_ctx = click.make_pass_decorator(Ctx)


def _setup_logging(level: str = "INFO") -> None:
    from payrun import logs

    logs.setup(level)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="PAYRUN_CONFIG", type=FilePath(dir_okay=False),
              help="TOML configuration file (default: $PAYRUN_CONFIG; none = built-in defaults).")
@click.version_option(package_name="payrun")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """payrun — salary slips for every employee before 09:00.

    \b
    Quick start:   payrun demo
    One pay run:   payrun seed --month 2026-11 --employees 2000 && payrun up &&
                   payrun run --month 2026-11 && payrun status --month 2026-11
    Environment:   PAYRUN_HOME (data dir, ./var), PAYRUN_CONFIG (TOML file),
                   PAYRUN_REDIS_URL (external Redis; unset = embedded),
                   PAYRUN_EMAIL_URL (smtp://… or http://…; unset = local provider)
    """
    ctx.obj = Ctx(config_path)
    if os.environ.get("SUPERVISOR_ENABLED"):  # (every other command starts without the import)
        from payrun import supervise

        supervise.stop_with_supervisord(ctx.invoked_subcommand)


# ---- data in -------------------------------------------------------------------

@cli.command()
@click.option("--companies", default=60, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--employees", default=50_000, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--seed", "seed_", default=7, show_default=True, type=int, help="Random seed: same seed, same data.")
@click.option("--month", default=None, metavar="YYYY-MM", help="Month of the salary lines (default: this month).")
@pass_ctx
@handle_errors
def seed(c: Ctx, companies: int, employees: int, seed_: int, month: str | None) -> None:
    """Fill the payroll database with realistic, deterministic sample data."""
    from payrun import payroll
    from payrun.runs import validate_month

    month = validate_month(month or default_month())
    if employees < companies:
        raise PayrunError(f"--employees ({employees}) must be at least --companies ({companies})")
    db = c.payroll()
    if not sys.stderr.isatty():  # (click's bar prints its bare label, no newline, to a file or pipe)
        payroll.seed(db, companies=companies, employees=employees, seed=seed_, month=month)
    else:
        with click.progressbar(length=employees, label="seeding", file=sys.stderr) as bar:
            last = [0]

            def progress(n: int, total: int) -> None:
                bar.update(n - last[0])
                last[0] = n

            payroll.seed(db, companies=companies, employees=employees, seed=seed_, month=month, progress=progress)
    click.echo(f"seeded {_n(companies, 'company', 'companies')}, {_n(employees, 'employee')}, salary lines for "
               f"{month} into {c.cfg.payroll_path}")
    # seed adds: say what a run of the month will cover, counted as `payrun check` counts it (this
    # said "N employees with salary lines" and counted those the run pays: leavers of the month
    # or later in, those who left before it or on a day not recorded out, unsaid)
    held_c, held_e = len(list(payroll.companies(db))), payroll.count_employees(db, month)
    leavers = payroll.leavers_with_salary_line(db, month)
    final = sum(1 for _, _, paid in leavers if paid)
    left_out = len(leavers) - final
    if held_c > companies or held_e > employees or left_out:
        paid_c = len(payroll.company_ids_for(db, month))
        click.echo(f"note: the database holds more than this seed (seed adds and updates, never removes): "
                   f"{_n(held_c, 'company', 'companies')} in all; a run of {month} pays {_n(held_e, 'employee')} "
                   f"in {_n(paid_c, 'company', 'companies')}"
                   + (f" ({final:,} of them left in {month} or later: their final slip)" if final else "")
                   + (f"; {payroll.left_out_text(left_out, month)}" if left_out else ""))
    if c.cfg.ledger_path.exists():  # (re-seeding a month already run changed it without a word)
        from payrun.ledger import Ledger

        led = Ledger(c.cfg.ledger_path)
        try:
            run = led.runs(month)
        finally:
            led.close()
        if run:
            click.echo(f"note: {month} was already run: its slips keep the data they were made with (a `payrun "
                       f"resend` prints today's); employees new to {month} get theirs with `payrun run --month "
                       f"{month} --resume`")


def _months_kept(db) -> list[str]:
    """The months whose pay run kept its companies' names and addresses (company_months)."""
    return [r[0] for r in db.conn.execute("SELECT DISTINCT month FROM company_months ORDER BY month")]


def _n(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else many or one + 's'}"


@cli.command(name="import")
@click.argument("csv_file", type=FilePath(exists=True, dir_okay=False))
@click.option("--companies", "companies_csv", is_flag=True,
              help="The file lists companies (id,name,address) instead of employees.")
@click.option("--month", "months", multiple=True, metavar="YYYY-MM",
              help="With --companies: also correct the name and address kept for this month, already run "
                   "(a typo found after the run), so its resends print the file's. Repeatable.")
@pass_ctx
@handle_errors
def import_(c: Ctx, csv_file: str, companies_csv: bool, months: tuple[str, ...]) -> None:
    """Import payroll data from CSV. Any bad row: every problem is listed with its line
    number and nothing from the file is imported.

    \b
    Employees (a row per employee and month; amounts in taka: 45000 or 45000.50):
      company_id, employee_id, name_en, name_bn (may be empty), email, department,
      designation, bank_account, month (YYYY-MM), basic, house_rent, medical,
      conveyance, bonus, tax, provident_fund, loan
    Companies (--companies; import them first): id, name, address
    Optional in an employees file: left_on (YYYY-MM-DD, the day they left; marks
      them left, as `payrun employee left --on`; empty: no change)
    Samples: docs/sample-employees.csv, docs/sample-companies.csv

    A month's run keeps each company's name and address as they were when it started: a
    resend or retry of that month prints them, whatever is imported later. To correct
    them for a month already run, import the companies with --month."""
    from payrun import payroll

    if months and not companies_csv:
        raise click.UsageError("--month goes with --companies: it corrects the company names and addresses "
                               "kept for a month already run")
    from payrun.runs import validate_month

    for m in months:
        validate_month(m)

    path = c.cfg.payroll_path
    folders = [p for p in reversed(path.parents) if not p.exists()]  # what opening it creates
    db = c.payroll()
    try:
        r = (payroll.import_companies_csv(db, csv_file, months=months) if companies_csv
             else payroll.import_csv(db, csv_file, today=_today(c)))
    except BaseException:
        if db.created:  # refused (bad rows): leave no empty payroll.db behind, which would pass for a payrun home
            db.close()
            for p in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"), path):
                p.unlink(missing_ok=True)
            for d in reversed(folders):
                try:
                    d.rmdir()  # (only if still empty)
                except OSError:
                    break
        raise
    if companies_csv:
        from payrun import audit as actions

        fixed = "".join(f"; kept for {m} corrected: {_companies(ids)}" for m, ids in r.corrected.items())
        actions.audit(c.cfg, actions.Outcome(
            "import", f"payrun import --companies {csv_file}" + "".join(f" --month {m}" for m in months),
            r.companies, message=f"{_n(r.companies, 'company', 'companies')} ({len(r.updated)} updated){fixed}"), via="cli")
        new = r.companies - len(r.updated) - r.unchanged
        click.echo(f"imported {r.companies} compan{'y' if r.companies == 1 else 'ies'} from {csv_file}: "
                   f"{new} new, {len(r.updated)} updated, {r.unchanged} unchanged")
        if r.updated:  # an existing company's name or address replaced: say which
            click.echo(f"name or address replaced for {_companies(r.updated)} (pay runs started from now on "
                       "print the new one on slips)")
            kept = sorted({m for ms in r.kept_months.values() for m in ms} - set(months))
            if kept:
                shown = ", ".join(kept[-6:]) + (f" and {len(kept) - 6} earlier" if len(kept) > 6 else "")
                click.echo(f"slips of months already run ({shown}) keep the name and address they were run with, "
                           "a resend included (a typo to correct there: the same import with --month "
                           f"{kept[-1]})")
        for m in dict.fromkeys(months):
            if m in r.corrected:
                click.echo(f"{m}: corrected the name and address kept for {_companies(r.corrected[m])} (that "
                           "month's resends and retries print the file's)")
            elif m not in (run := _months_kept(db)):  # (a typo'd month read like a month with nothing wrong)
                click.echo(f"{m}: nothing to correct: no pay run of {m} keeps company details (months run: "
                           f"{', '.join(run[-6:]) or 'none'})")
            else:
                click.echo(f"{m}: nothing to correct (no company in the file was run that month with other "
                           "details)")
        return
    from payrun import audit as actions

    actions.audit(c.cfg, actions.Outcome("import", f"payrun import {csv_file}", r.employees,
                                         message=f"{_n(r.employees, 'employee')} ({len(r.changed_employees)} with changed "
                                                 f"details), {_n(r.salary_lines, 'salary line')}"
                                                 + (f"; {len(r.left)} marked as left" if r.left else "")), via="cli")
    known = len(r.existing_employees)
    there = f"{known} already there"
    if known:
        there += (f": {len(r.changed_employees)} with changed details, {known - len(r.changed_employees)} "
                  "unchanged")
    lines = ""  # (an HR walkthrough: a corrected salary line read "1 unchanged", of the employee's details)
    if known and r.salary_lines != r.new_lines:
        lines = f" ({r.new_lines} new, {r.changed_lines} with other figures, {r.salary_lines - r.new_lines - r.changed_lines} the same)"
    click.echo(f"imported {r.employees} employee{'' if r.employees == 1 else 's'} ({r.employees - known} new, "
               f"{there}) and {r.salary_lines} salary line{'' if r.salary_lines == 1 else 's'}{lines} from {csv_file}")
    if r.left:  # (an HR walkthrough: a file could not say who left; each needed `employee left`)
        by_day: dict[str, list[str]] = {}
        for emp, day in sorted(r.left.items()):
            by_day.setdefault(day, []).append(emp)
        click.echo(f"marked {_n(len(r.left), 'employee')} as left (left_on): "
                   + "; ".join(f"{_named(es)} on {day}" for day, es in sorted(by_day.items()))
                   + ": a month's run still pays them for the month they left in (their final slip, from its "
                     "salary line); runs of later months and reminders leave them out")
    if r.after_leaving:
        shown = ", ".join(f"{e} {m}" for e, m in r.after_leaving[:_NAMED]) + (
            f" and {len(r.after_leaving) - _NAMED} more" if len(r.after_leaving) > _NAMED else "")
        click.echo(f"note: {_n(len(r.after_leaving), 'salary line')} of a month after the one the employee left in: "
                   f"{shown}: no pay run makes a slip of {'it' if len(r.after_leaving) == 1 else 'them'} (if they "
                   "worked that month, correct left_on)")
    if r.ignored_columns:  # HR thinks an `active` or `overtime` column did something
        click.echo(f"note: column(s) not imported (payrun does not know them): {', '.join(r.ignored_columns)}")
    for emp, was, now in r.moved[:_NAMED]:
        click.echo(f"note: {emp} moved from company {was} to company {now} (for the months in this file; "
                   "other months' slips keep the company of their own salary line)")
    if len(r.moved) > _NAMED:
        click.echo(f"note: ... and {len(r.moved) - _NAMED} more employees moved to another company")
    ledger = _maybe_ledger(c)
    if ledger is not None and known:  # HR fixed data after a run: name whose slips are now out of date
        for month in sorted(set(r.months) & set(ledger.months())):
            had = sorted(set(r.changed_slips.get(month, ())) & ledger.employees_with_jobs(month))
            if had:
                more = f" and {len(had) - _NAMED} more" if len(had) > _NAMED else ""
                click.echo(f"note: {len(had)} {month} slip{'' if len(had) == 1 else 's'} already made "
                           f"{'reads' if len(had) == 1 else 'read'} differently now (made with the old data): "
                           f"{', '.join(had[:_NAMED])}{more}. `payrun resend --employee {had[0]} --month {month}` "
                           "sends one again with the new data (`payrun retry` re-renders a failed one)")
            moved_to = sorted(set(r.readdressed.get(month, ())) & ledger.employees_with_jobs(month))
            if moved_to:  # the slip does not print the address: nothing to render again
                st = ledger.statuses([f(month, e) for e in moved_to for f in (keys.render_job_id, keys.email_job_id)])
                conn = _maybe_redis(c)
                sent = send_addresses(conn, month, moved_to) if conn is not None else {}
                # Redis drops a finished job after a day: the ledger keeps the address its send had
                sends = {keys.email_job_id(month, e): e for e in moved_to}
                for job_id, to in ledger.recipients(sends).items():
                    sent.setdefault(sends[job_id], to)
                on_file = payroll.emails(db, moved_to)
                same = {e for e, to in sent.items() if on_file.get(e) == to}
                for line in readdressed_notes(month, {e: (st.get(keys.render_job_id(month, e)),
                                                          st.get(keys.email_job_id(month, e))) for e in moved_to},
                                              same):
                    click.echo(line)
    if ledger is not None and r.new_address:  # an address is not a month's: failed sends of other months
        for month in sorted(set(ledger.months()) - set(r.months)):
            st = ledger.statuses([f(month, e) for e in r.new_address for f in (keys.render_job_id, keys.email_job_id)])
            if line := other_month_failed_note(month, {e: (st.get(keys.render_job_id(month, e)),
                                                           st.get(keys.email_job_id(month, e)))
                                                       for e in r.new_address}):
                click.echo(line)
    if ledger is not None:  # salary lines for a month already run: `run` alone would skip them
        from payrun.runs import behind_for

        for month in sorted(set(r.months) & set(ledger.months())):
            if behind := behind_for(ledger, db, month, r.employee_ids):
                click.echo(f"note: {month} was already run for {_companies(behind)}, before some of these "
                           f"employees were added: `payrun run --month {month} --resume` creates their slips")


PERMANENT_HINT = ("failed for good on its data (a permanent error: the address refused, a name too long ...): "
                  "a retry alone fails again; fix the employee in the payroll data (`payrun import`), then "
                  "`payrun retry ID`")

_NAMED = 10
"""How many employees an import's notes name before "... and N more"."""


def _named(ids: list[str]) -> str:
    return ", ".join(ids[:_NAMED]) + (f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else "")


def readdressed_state(render: str | None, send: str | None) -> str:
    """Where a slip of a month already run stands, its employee's email address alone
    changed since, by its render's and its send's ledger states: "failed" (a retry reads
    the address again: to the new one), "delivered" (to the old one), else "on its way"
    (a job keeps the address it was made with: to the old one)."""
    if send == "done":
        return "delivered"
    if send == "failed" or (send is None and render == "failed"):
        return "failed"
    return "on its way"


def send_addresses(conn, month: str, emps: list[str]) -> dict[str, str]:
    """employee -> the address their slip's send of ``month`` has (its send job's, else
    the one its render job will give the send), for those Redis still holds (finished
    jobs are kept a day)."""
    from jobs.runtime import PayrunJob

    out: dict[str, str] = {}
    for e in emps:
        for job_id, pick in ((keys.email_job_id(month, e), lambda a: a.get("to")),
                             (keys.render_job_id(month, e), lambda a: (a.get("employee") or {}).get("email"))):
            try:
                job = PayrunJob.fetch(job_id, connection=conn)
                arg = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
            except Exception:  # gone from Redis, or not readable: not known from this one
                continue
            if isinstance(to := pick(arg), str):
                out[e] = to
                break
    return out


def readdressed_notes(month: str, states: dict[str, tuple[str | None, str | None]],
                      same: set[str] = frozenset()) -> list[str]:
    """`payrun import`'s note on slips whose employee's address alone changed: employee ->
    (render status, send status). The slip does not print the address, so none needs
    making again; what to do depends on the send (the note said the slip "reads
    differently" and offered a resend, then offered `payrun retry` of a send that had not
    failed, which retry refuses). ``same``: those whose send has the address on file now
    (changed A -> B -> A: it said "delivered to the old address ... resend" of a slip
    delivered to the address on file)."""
    back = sorted(e for e in states if e in same and readdressed_state(*states[e]) != "failed")
    lines = []
    if back:
        lines.append(f"note: {len(back)} {month} slip{'' if len(back) == 1 else 's'} already made "
                     f"{'has' if len(back) == 1 else 'have'} the address on file now (it changed and changed back; "
                     f"delivered or on its way to it): nothing to do: {_named(back)}")
    emps = sorted(e for e in states if e not in back)
    n = len(emps)
    if not n:
        return lines
    by: dict[str, list[str]] = {"failed": [], "delivered": [], "on its way": []}
    for e in emps:
        by[readdressed_state(*states[e])].append(e)
    lines.append(f"note: {n} {month} slip{'' if n == 1 else 's'} already made {'goes' if n == 1 else 'go'} to a new "
                 f"email address now (the slip does not print it: no new slip is needed): {_named(emps)}")
    if by["failed"]:
        ids = [keys.email_job_id(month, e) if states[e][1] == "failed" else keys.render_job_id(month, e)
               for e in by["failed"]]
        rest = f" (the other {len(ids) - _NAMED}: ids from `payrun failed --month {month}`)" if len(ids) > _NAMED else ""
        lines.append(f"  failed: {_named(by['failed'])}; `payrun retry {' '.join(ids[:_NAMED])}` sends "
                     f"{'it' if len(ids) == 1 else 'them'} to the new address{rest}")
    if by["delivered"]:
        lines.append(f"  delivered to the old address: {_named(by['delivered'])}; `payrun resend --employee "
                     f"{by['delivered'][0]} --month {month}` sends one to the new address too, if it should")
    if by["on its way"]:
        lines.append(f"  not delivered yet, on its way to the old address (a job keeps the address it was made "
                     f"with): {_named(by['on its way'])}; a send of it that fails goes to the new address with "
                     "`payrun retry`")
    return lines


def other_month_failed_note(month: str, states: dict[str, tuple[str | None, str | None]]) -> str | None:
    """`payrun import`'s note on a month already run that the file has no salary line of,
    for employees whose email address the file changed: employee -> (render status, send
    status). Their slips of that month that failed are named with the retry that sends
    them to the new address (an HR walkthrough: a bad address failed October's and
    November's sends; the import of November's corrected row named November's only, and
    October's stayed failed). Delivered or on-the-way slips of such a month are not named:
    they are another month's business. None when none failed."""
    failed = sorted(e for e, (render, send) in states.items() if readdressed_state(render, send) == "failed")
    if not failed:
        return None
    ids = [keys.email_job_id(month, e) if states[e][1] == "failed" else keys.render_job_id(month, e)
           for e in failed]
    rest = f" (the other {len(ids) - _NAMED}: ids from `payrun failed --month {month}`)" if len(ids) > _NAMED else ""
    n = len(failed)
    return (f"note: {n} {month} slip{'' if n == 1 else 's'} of {'an employee' if n == 1 else 'employees'} with a new "
            f"email address failed (a month not in this file): {_named(failed)}; `payrun retry "
            f"{' '.join(ids[:_NAMED])}` sends {'it' if n == 1 else 'them'} to the new address{rest}")


# ---- the pay run -----------------------------------------------------------------

def default_month() -> str:
    from datetime import datetime
    from zoneinfo import ZoneInfo

    return datetime.now(ZoneInfo("Asia/Dhaka")).strftime("%Y-%m")


@cli.command()
@click.option("--month", required=True, metavar="YYYY-MM", help="Month to pay.")
@click.option("--company", type=int, default=None, help="Only this company id.")
@click.option("--resume", is_flag=True,
              help="Complete a fan-out that died half-way (run row still 'fanning-out'): enqueue only "
                   "the missing jobs. Only once the process that started it is gone. For a company "
                   "already run: create the slips of employees added since (salary lines, no slip job).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
@pass_ctx
@handle_errors
def run(c: Ctx, month: str, company: int | None, resume: bool, as_json: bool) -> None:
    """Create one render job per employee for MONTH, once.

    Takes the lock lock:payroll:<month> and inserts one payroll_runs row per company;
    running it again (or on two servers at once) creates no second set of jobs.
    """
    from payrun import runs

    runs.validate_month(month)
    conn = c.redis()
    ledger = c.ledger()
    db = c.payroll()
    bar = None if as_json or not sys.stderr.isatty() else click.progressbar(length=1, label=f"fan-out {month}", file=sys.stderr)

    def progress(n: int, total: int) -> None:
        if bar is not None:
            bar.length = total
            bar.update(n - bar.pos)

    result = runs.start_run(c.cfg, conn, ledger, db, month, company, progress=progress, resume=resume)
    if bar is not None:
        bar.render_finish()
    if result.jobs:  # the action that emails everyone: in the audit log beside retries and resends
        from payrun import audit as actions

        command = (f"payrun run --month {month}" + (f" --company {company}" if company is not None else "")
                   + (" --resume" if resume else ""))
        actions.audit(c.cfg, actions.Outcome("run", command, result.jobs, ok=not result.aborted,
                                             message=f"created {result.jobs:,} render job(s) for {month}"),
                      via="cli")
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    elif result.locked_by:
        click.echo(f"another pay run for {month} is in progress (lock held by {result.locked_by}); nothing created")
    else:
        fresh = {c: n for c, n in result.created.items() if c not in result.added}
        if fresh:
            n = sum(fresh.values())
            click.echo(f"created {n:,} render job{'' if n == 1 else 's'} for {len(fresh)} "
                       f"compan{'y' if len(fresh) == 1 else 'ies'} ({month})")
        if result.resumed:
            click.echo(f"completed the interrupted fan-out of {_companies(result.resumed)}")
        if result.added:
            n = sum(result.created[c] for c in result.added)
            click.echo(f"created {n:,} render job{'' if n == 1 else 's'} for employees "
                       f"added since {month} was run: {_companies(result.added)}")
        if result.already:
            stuck = [r["company_id"] for r in ledger.runs(month)
                     if r["status"] == "fanning-out" and r["company_id"] in result.already]
            click.echo(f"already run for {month}, nothing created: {_companies(result.already)}")
            if not resume and (late := [cid for cid in runs.behind(ledger, db, month) if cid in result.already]):
                click.echo(f"note: {_companies(late)} {'has' if len(late) == 1 else 'have'} employees added since {month} was run, "
                           f"with no slip: payrun run --month {month} --resume")
            if stuck:
                click.echo(f"note: the fan-out of {_companies(stuck)} never finished; if the process "
                           f"that ran it is gone: payrun run --month {month} --resume")
        if result.aborted:
            click.echo(f"stopped early: {result.aborted}")
        if fresh or result.added:
            _note_without_salary_line(db, ledger, month, sorted(set(fresh) | set(result.added)))
    if result.jobs:
        from redis.exceptions import RedisError

        from payrun.status import intake_notes

        try:
            notes = intake_notes(conn)  # jobs created that nothing will take yet
        except (RedisError, OSError):  # the run itself is done: a failed look changes nothing
            notes = []
        for note in notes:
            click.echo(f"note: {note}", err=True)
    sys.exit(1 if result.aborted else 0)


def _note_without_salary_line(db, ledger, month: str, company_ids: list[int]) -> None:
    """At the run, not only in `payrun status` afterwards: employees of the companies just
    run whom the month pays (working here, or left in it or later) with no salary line for
    it get no slip (an HR drill: "299 sent" of 300 staff, and nothing said so)."""
    from payrun import payroll

    with_jobs = ledger.employees_with_jobs(month)
    unpaid = payroll.without_salary_line(db, month, company_ids, with_jobs)
    gone = payroll.left_with_salary_line(db, month, company_ids, with_jobs)
    if left := payroll.left_text(gone, month, payroll.left_on(db, [e for ids in gone.values() for e in ids])):
        click.echo(f"note: {left}", err=True)
    if ids := [e for cid in sorted(unpaid) for e in unpaid[cid]]:
        shown = " ".join(payroll.with_leaving_dates(db, ids[:10])) + (
            f" … ({len(ids) - 10:,} more: `payrun status --json`)" if len(ids) > 10 else "")
        click.echo(f"note: {len(ids):,} employee{'' if len(ids) == 1 else 's'} of {_companies(sorted(unpaid))} "
                   f"{'has' if len(ids) == 1 else 'have'} no salary line for {month}: no slip is made for "
                   f"them: {shown}. Paid this month: import the salary line, then "
                   f"`payrun run --month {month} --resume`; gone before {month}: `payrun employee left ID… --on DATE`",
                   err=True)


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:20])) + (f" … ({len(ids)} in all)" if len(ids) > 20 else "")


def _free_tries(held: int, returned: int) -> str:
    """" (+1 held, +2 returned)": the tries beside attempts= that spent none; "" if none."""
    free = ", ".join(f"+{n} {k}" for k, n in (("held", held), ("returned", returned)) if n)
    return f" ({free})" if free else ""


def _companies(ids: list[int]) -> str:
    """"company 4" or "companies 1, 2": the noun agrees with the count."""
    return f"{'company' if len(ids) == 1 else 'companies'} {_ids(ids)}"


@cli.command(name="check")
@click.option("--month", default=None, metavar="YYYY-MM",
              help="The pay month to check (default: the one the next pay-run tick pays).")
@click.option("--no-email", "no_email", is_flag=True, help="Do not contact the email provider.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def check_cmd(c: Ctx, month: str | None, no_email: bool, as_json: bool) -> None:
    """Is payrun ready for its next pay run? Run it the evening before the 1st.

    \b
    It checks, and says what to do about each problem:
      redis      reachable, appendonly on, memory for the run's jobs
      scheduler  a scheduler running for the next pay-run tick (two: one stands by)
      payroll    salary lines for the month; staff and companies without any; leavers
                 with a line (their final slip, or left out)
      render     a sample slip renders here (and fast: HarfBuzz font subsetting)
      intake     not drained
      workers    a live pdf-render, send-email and control worker
      ledger     `payrun ledger` applying the workers' events
      email      the provider reachable and our login or token accepted
      data       room in the data directory (ledger, payroll db, Redis's append-only file)
      slips      the slip store writable, with room for the month's slips
      estimate   how long the run takes, and whether it ends before 09:00

    Nothing is sent or enqueued: the provider gets an SMTP login then QUIT, or an HTTP
    request with no message, which it refuses. Exit 0 when ready (warnings allowed), 1
    when a check fails. On a worker host's data directory it checks what that host needs."""
    import shutil

    from payrun import preflight
    from payrun.runs import validate_month

    if month is not None:
        month = validate_month(month)
    c.require_home()
    role = c.cfg.home / "supervisor.role"
    worker_host = role.exists() and role.read_text().strip() == "worker"
    if worker_host and month is not None:
        raise InputError("--month is for the control host: this data directory is a worker host's (no payroll "
                         "data or ledger here)")
    from payrun import redis_server

    rep = preflight.check(c.cfg, month=month, worker_host=worker_host, email=not no_email,
                          connect=lambda: redis_server.connect(c.cfg, socket_timeout=5, socket_connect_timeout=5))
    if as_json:
        click.echo(json.dumps(rep.to_dict()))
    else:
        head = f"the {rep.month} pay run" if rep.month else "this worker host"
        if rep.tick and rep.tick_month == rep.month:
            head += f", by the tick of {preflight.local_text(rep.tick, c.cfg.timezone)}"
        elif rep.tick:
            head += (f", run by hand (the next tick, {preflight.local_text(rep.tick, c.cfg.timezone)}, pays "
                     f"{rep.tick_month})")
        # a terminal: each finding wrapped under its own text; a pipe or cron mail: one line each
        width = shutil.get_terminal_size().columns - 1 if sys.stdout.isatty() else None
        for line in preflight.wrapped("payrun check: ", head, width):
            click.echo(line)
        marks = {preflight.OK: "ok  ", preflight.WARN: "WARN", preflight.FAIL: "FAIL"}
        for f in rep.findings:
            for line in preflight.wrapped(f"  {marks[f.level]}  {f.area:<9}  ", f.text, width):
                click.echo(line)
        if rep.failures:
            click.echo(f"NOT READY: {_n(rep.failures, 'check')} failed"
                       + (f", {_n(rep.warnings, 'warning')}" if rep.warnings else ""))
        else:
            click.echo("ready" + (f", with {_n(rep.warnings, 'warning')}" if rep.warnings else ""))
    if rep.failures:
        sys.exit(1)


@cli.command()
@click.option("--month", default=None, metavar="YYYY-MM", help="The pay run to show (default: the latest run).")
@click.option("--company", type=int, default=None, help="Only this company id.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def status(c: Ctx, month: str | None, company: int | None, as_json: bool) -> None:
    """The HR line: per company and in total, how many slips were sent, stuck, failed."""
    from payrun import status as status_mod

    report = status_mod.report(c.cfg, c.ledger(), month, company, conn=_maybe_redis(c))
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(status_mod.format_report(report))


def _maybe_redis(c: Ctx):
    """A Redis client if one is reachable (without starting one), else None."""
    from payrun import redis_server

    conn = redis_server.connect(c.cfg, socket_timeout=2, socket_connect_timeout=2)
    return conn if redis_server.ping(conn) else None


@cli.command(name="failed")
@click.option("--queue", type=click.Choice(["pdf-render", "send-email", "control"]), default=None)
@click.option("--error", "error_text", default=None, help="Only jobs whose last error contains TEXT.")
@click.option("--company", type=int, default=None, help="Only jobs of this company id.")
@click.option("--month", default=None, metavar="YYYY-MM", help="Only jobs of this pay month.")
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def failed_cmd(c: Ctx, queue: str | None, error_text: str | None, company: int | None, month: str | None,
               limit: int, as_json: bool) -> None:
    """List failed jobs (dead letters), newest first, with their last error."""
    from jobs.events import attempts_spent
    from payrun import deadletters

    _known_company(c, company)
    _check_month_option(month)
    every = deadletters.failed(c.running_redis(), queue, error_text, None, company=company, ledger=_maybe_ledger(c),
                               month=month)
    rows = every[:limit]
    fixed: set[str] = set()
    if c.cfg.payroll_path.exists() and any(r.get("permanent") for r in every):
        with c.payroll() as db:
            fixed = deadletters.readdressed(c.running_redis(), [r["id"] for r in every if r.get("permanent") and
                                                                not r.get("delivered_by_resend")], db)
    for r in every:
        if r.get("permanent") and r.get("kind") == "email":
            r["address_changed"] = r["id"] in fixed
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no failed jobs")
        return
    names = _employee_names(c, [r["employee"] for r in rows if r.get("employee")])
    for r in rows:
        # tries held back by the provider or handed back by a stopping worker spent no attempt
        held, returned = r.get("held", 0), r.get("returned", 0)
        spent = attempts_spent(r["attempts"], held, returned)
        resent = "  [never ran: its data cannot be read; nothing to retry]" if r.get("never_ran") else (
            "  [slip delivered by a resend]" if r.get("delivered_by_resend") else (
            "  [address changed since: retry sends it to the new one]" if r.get("address_changed") else
            "  [permanent: fix the data, then retry]" if r.get("permanent") and r.get("employee") else ""))
        who = ""
        if r.get("employee"):  # HR asks "who did not get a slip?": the person, not only a job id
            who = f"  ({r['employee']}{' ' + names[r['employee']] if r['employee'] in names else ''}"
            who += f", company {r['company']})" if r.get("company") is not None else ")"
        click.echo(f"{r['id']:<36} {r['queue']:<10} attempts={spent:<2}{_free_tries(held, returned)} {visible(r['error'])}"
                   f"{who}{resent}")
    shown = (f"{len(every):,} failed job(s)" if len(rows) == len(every) else
             f"{len(every):,} failed jobs, the newest {len(rows):,} shown (--limit N for more)")
    resent = sum(1 for r in every if r.get("delivered_by_resend"))
    if resent:
        shown += (f" ({resent:,} of them delivered by a `payrun resend`: `payrun status` counts those "
                  "slips as sent, and retry --all leaves them out)")
    if resent == len(every):
        click.echo(f"{shown}; nothing left to retry: every one of these slips was delivered by a resend")
        return
    click.echo(f"{shown}; retry with: payrun retry ID… or {_retry_all(queue, error_text, company, month)}")
    permanent = sum(1 for r in every if r.get("permanent") and r.get("employee") and not r.get("delivered_by_resend")
                    and not r.get("address_changed"))
    if fixed:
        click.echo(f"note: {len(fixed):,} of them went to an address the payroll data has changed since: "
                   f"`payrun retry {' '.join(sorted(fixed)[:5])}{' …' if len(fixed) > 5 else ''}` sends "
                   f"{'it' if len(fixed) == 1 else 'them'} to the new one")
    if permanent:
        click.echo(f"note: {permanent:,} of them failed for good on the employee's data (an address refused, a name "
                   "too long): a retry alone fails again; fix the employee first (`payrun import`), then retry")


def _employee_names(c: Ctx, employee_ids: list[str]) -> dict[str, str]:
    """employee id -> name_en, from the payroll database if there is one."""
    if not employee_ids or not c.cfg.payroll_path.exists():
        return {}
    ids = sorted(set(employee_ids))
    out: dict[str, str] = {}
    conn = c.payroll().conn
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        out.update(conn.execute(f"SELECT id, name_en FROM employees WHERE id IN ({','.join('?' * len(chunk))})",
                                chunk).fetchall())
    return out


def _retry_all(queue: str | None, error_text: str | None, company: int | None, month: str | None = None) -> str:
    return "payrun retry --all" + _narrowing(queue, error_text, company, month)


def _check_month_option(month: str | None) -> None:
    """The words every other --month gives (`failed` and `retry` had their own)."""
    if month is not None:
        from payrun.runs import validate_month

        validate_month(month)


def _known_company(c: Ctx, company: int | None) -> None:
    """--company naming no company is bad input (it read as "no failed jobs", exit 0)."""
    if company is None or not c.cfg.payroll_path.exists():
        return
    from payrun import payroll

    with payroll.PayrollDB(c.cfg.payroll_path) as db:
        if not db.conn.execute("SELECT 1 FROM companies WHERE id = ?", (company,)).fetchone():
            raise InputError(f"no company {company} in the payroll database")


def _maybe_ledger(c: Ctx):
    return c.ledger() if c.cfg.ledger_path.exists() else None


def _no_slip_job(c: Ctx, job_id: str) -> str | None:
    """Why a slip's job (``render-`` or ``email-<month>-<employee>``) that does not exist was
    never made, when the month's run left its employee out as a leaver; else None."""
    import re

    from payrun import payroll

    m = re.fullmatch(r"(?:render|email)-(\d{4}-\d\d)-(.+)", job_id)
    if not m or not c.cfg.payroll_path.exists() or not c.ledger().runs(m[1]):
        return None
    with c.payroll() as db:
        return payroll.left_out_of_month(db, m[2], m[1])


@cli.command(name="job")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def job_cmd(c: Ctx, job_id: str, as_json: bool) -> None:
    """One job: its ledger row, whom its email is for (name and the address it was sent
    to; --json: recipient), every attempt (time, outcome, error, delay chosen) and the last
    traceback RQ kept."""
    from jobs.runtime import PayrunJob
    from jobs.events import NO_ATTEMPT_OUTCOMES
    from payrun.ledger import tries_counts, tries_text
    from payrun.recipient import recipient_text
    from payrun import deadletters

    row = c.ledger().job(job_id)
    conn = _maybe_redis(c)
    tb = rq_status = unreadable = job_data = None
    permanent = False
    if conn is not None:
        try:
            job = PayrunJob.fetch(job_id, connection=conn)
            rq_status = job.get_status()
            try:  # the name and address its email goes to (payrun.recipient reads those alone)
                job_data = job.args[0] if job.args else None
            except Exception:  # noqa: BLE001 - data not readable: said below
                job_data = None
            permanent = bool(job.meta.get("permanent"))
            result = job.latest_result()
            tb = result.exc_string if result is not None and result.exc_string else None
            # RQ's fetch reads the data only when asked: data that is not JSON passes it
            unreadable = deadletters.unreadable_job(conn, job_id)
        except Exception:
            try:  # a hash with no data, or data not JSON: there, but nothing RQ can read
                unreadable = deadletters.unreadable_job(conn, job_id)
            except Exception:  # noqa: BLE001 - Redis went away
                unreadable = None
            if unreadable is not None:
                rq_status = unreadable["rq_status"] or "?"
    if row is None and rq_status is None:
        if why := _no_slip_job(c, job_id):
            raise PayrunError(f"no job {job_id!r}: {why}")
        like = c.ledger().ids_like(job_id)
        if like and like[0].startswith(job_id):
            hint = "ids starting with it: " + ", ".join(like)
        elif own := c.ledger().ids_of_employee(job_id):
            hint = f"that is an employee; their jobs, newest first: {', '.join(own)}"
        else:
            hint = f"ids look like {like[0] if like else 'email-2026-11-emp-00017'}: render-… or email-<month>-<employee>"
        raise PayrunError(f"no job {job_id!r} in the ledger or in Redis ({hint})")
    to, send_id = _job_recipient(c, job_id, row, job_data)
    data = {"ledger": row, "rq_status": rq_status, "traceback": tb, "recipient": to}
    if unreadable is not None:
        data["unreadable"] = unreadable["unreadable"]
    if as_json:
        click.echo(json.dumps(data, default=str))
        return
    if row:
        # attempts= counts the attempts spent, as in `payrun failed`; tries that spent none beside
        spent, held, returned = tries_counts(row)
        # failed unread (its data missing or not JSON): it never ran, attempts=0 as `payrun failed`
        # says; a worker of the version before told the ledger of a try (attempts=1, a #1 line)
        never = row["status"] == "failed" and deadletters.never_ran({}, row.get("last_error") or "")
        if never:
            spent, held, returned = 0, 0, 0
        click.echo(f"{row['id']}  {row['kind']}  {row['status']}  attempts={spent}{_free_tries(held, returned)}  "
                   f"key={row['key']}")
        if to is not None:
            click.echo(visible(recipient_text(to, send_id)))
        if never and row["history"]:
            click.echo("never ran: its data cannot be read (a worker of an earlier version counted the try "
                       "below before reading it)")
        elif any(h.get("outcome") in NO_ATTEMPT_OUTCOMES for h in row["history"]):
            click.echo(tries_text(row))
        if row.get("last_error"):
            last = next((h for h in reversed(row["history"]) if h.get("error")), None)
            held_back = last is not None and last.get("outcome") in NO_ATTEMPT_OUTCOMES  # (drill 43: a held
            earlier = ((" (of an earlier try, held back: no attempt spent)" if held_back  # try read as an attempt)
                        else " (of an earlier attempt)") if row["status"] == "done" else "")
            click.echo(f"last error{earlier}: {visible(row['last_error'])}")
        for h in row["history"]:
            delay = f"  retry in {h['delay_s']:.1f} s" if h.get("delay_s") else ""
            ended = local_time(h["ended_at"], c.cfg.timezone) if h.get("ended_at") else "…"
            click.echo(f"  #{h['attempt']} {local_time(h.get('started_at'), c.cfg.timezone)} -> {ended} "
                       f"{h.get('outcome')}{delay}  {visible(h.get('error') or '')}".rstrip())
    if rq_status:
        if not row and to is not None:
            click.echo(visible(recipient_text(to, send_id)))
        if getattr(rq_status, "value", rq_status) == "queued":
            click.echo(_queued_text(conn, job_id))
        else:
            click.echo(f"in Redis: {getattr(rq_status, 'value', rq_status)}")
        if unreadable is not None:
            click.echo(f"{unreadable['unreadable']}: nothing to run or retry")
            if not row and unreadable["meta"].get("last_error"):
                click.echo(f"last error: {visible(unreadable['meta']['last_error'])}")
            click.echo(f"fields in its hash: {visible(', '.join(unreadable['fields']))}")
        if permanent and getattr(rq_status, "value", rq_status) == "failed":
            # (an HR walkthrough: after the address was fixed by an import, it still said "fix the
            # employee ... a retry alone fails again", where `payrun failed` said the retry goes to the new one)
            from payrun.recipient import readdressed_text

            now = None
            a_send = (row["kind"] in ("email", "reminder") if row else isinstance(job_data, dict) and "to" in job_data)
            if to is not None and to.get("employee_id") and a_send and c.cfg.payroll_path.exists():
                found = c.payroll().conn.execute("SELECT email FROM employees WHERE id = ?",
                                                 (to["employee_id"],)).fetchone()
                now = found[0] if found else None
            click.echo(visible(readdressed_text(to, now, job_id) or PERMANENT_HINT))
    if tb:
        click.echo("last traceback:\n" + "\n".join(visible(line) for line in tb.rstrip().splitlines()))


def _queued_text(conn, job_id: str) -> str:
    """`payrun job`'s line for a queued job: its place in its queue, and on send-email the
    rate in force (payrun.ledger.queued_text)."""
    from jobs.limits import limit_sources
    from payrun.ledger import queued_text

    try:
        raw = conn.hget(f"rq:job:{job_id}", "origin")
        queue = raw.decode() if isinstance(raw, bytes) else raw
        ahead = conn.execute_command("LPOS", f"rq:queue:{queue}", job_id) if queue else None
        rate = limit_sources(conn, "email")["rate_per_s"]["value"] if queue == keys.EMAIL_QUEUE else None
        from rq.suspension import WORKERS_SUSPENDED

        drained = bool(conn.exists(WORKERS_SUSPENDED) or (queue and conn.sismember(keys.PAUSED_QUEUES, queue)))
        return queued_text(ahead, queue or "?", float(rate) if rate else None, drained=drained)
    except Exception:  # noqa: BLE001 - an older Redis without LPOS, or Redis went away: the bare state
        return queued_text(None, "?", None)


def _job_recipient(c: Ctx, job_id: str, row: dict | None, job_data) -> tuple[dict | None, str | None]:
    """Whom a job's email is for (`payrun job`): payrun.recipient.job_recipient."""
    from payrun.recipient import job_recipient

    def on_file_of(employee: str):
        if not c.cfg.payroll_path.exists():
            return None
        return c.payroll().conn.execute("SELECT name_en, email FROM employees WHERE id = ?", (employee,)).fetchone()

    return job_recipient(c.ledger(), on_file_of, job_id, row, job_data)


@cli.group(name="employee")
def employee_group() -> None:
    """Mark employees who left (and back): pay runs and reminders leave them out."""


@employee_group.command(name="left")
@click.argument("employee_ids", nargs=-1, required=True)
@click.option("--on", "left_date", default=None, metavar="YYYY-MM-DD",
              help="The day they left (default: today, in the payroll's zone); not later than today. "
                   "Given for employees already marked left, it corrects their date.")
@pass_ctx
@handle_errors
def employee_left(c: Ctx, employee_ids: tuple[str, ...], left_date: str | None) -> None:
    """EMPLOYEE_IDS left the company on --on (default today). A run of the month they left in
    still pays them (their final slip, from its salary line); runs of later months, their
    "no slip yet" count and `payrun remind` leave them out. The date is recorded and shown
    where leavers are named (`run`, `status`, `check`, `resend`). Slips already made stay;
    `payrun resend` still works for them. Written to the audit log."""
    from payrun.payroll import leaving_date_problem

    today = _today(c)
    if left_date is not None and (why := leaving_date_problem(left_date, today)):
        raise InputError(f"--on {visible(left_date)}: {why}")
    _set_active(c, list(employee_ids), False, left_date or today, redate=left_date is not None)


def _today(c: Ctx) -> str:
    """Today in the payroll's zone, YYYY-MM-DD: the latest leaving date taken."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    return datetime.now(ZoneInfo(c.cfg.timezone)).strftime("%Y-%m-%d")


@employee_group.command(name="back")
@click.argument("employee_ids", nargs=-1, required=True)
@pass_ctx
@handle_errors
def employee_back(c: Ctx, employee_ids: tuple[str, ...]) -> None:
    """EMPLOYEE_IDS work here again (undoes `payrun employee left`). The day they left is
    cleared: it names that day, and the `payrun employee left ID --on DATE` that puts it back."""
    _set_active(c, list(employee_ids), True)


def _next_month(day: str) -> str:
    """'2026-11-20' -> '2026-12'."""
    y, m = int(day[:4]), int(day[5:7])
    return f"{y + m // 12}-{m % 12 + 1:02d}"


def _set_active(c: Ctx, ids: list[str], active: bool, left_date: str | None = None, redate: bool = False) -> None:
    """``left_date``: the day those marked left left; ``redate``: HR gave it (--on), so those
    already marked left get it too (a date corrected), else theirs is kept."""
    from payrun import audit as actions, payroll

    if not c.cfg.payroll_path.exists():
        raise InputError(f"no payroll database at {c.cfg.payroll_path}: import employees first")
    db = c.payroll()
    before = payroll.left_on(db, ids)
    # the date, in the mark's own transaction (two left a leaver undated if stopped between):
    # of those marked now, and with --on of those already marked too
    changed = payroll.set_active(db, ids, active, left_date if not active else None, redate=redate)
    redated = [i for i in ids if i in before and before[i] != left_date] if redate and not active else []
    word = "back" if active else "left"
    on = f" on {left_date}" if not active else ""
    actions.audit(c.cfg, actions.Outcome("employee", f"payrun employee {word} {' '.join(ids[:10])}"
                                         + (" …" if len(ids) > 10 else "") + (f" --on {left_date}" if redate else ""),
                                         len(changed),
                                         message=f"{len(changed)} marked {'active' if active else 'as left' + on}"
                                                 + (f"; {len(redated)} leaving date(s) set to {left_date}"
                                                    if redated else "")),
                  via="cli")
    same = len(ids) - len(changed)
    already = ""
    if same:
        already = f"; {same} already so"
        if not active and not redate:
            kept = sorted({payroll.left_label(before.get(i)) for i in ids if i in before})
            already += f" ({', '.join(kept[:3])}: `--on DATE` corrects it)" if kept else ""
        elif redated:
            already += f" ({len(redated)} now dated {left_date})"
    after = "" if active else (f": runs of {_next_month(left_date)} and later, and reminders about those months, leave "
                               f"them out (a run of {left_date[:7]} pays them: their final slip, from its salary line; "
                               f"a `payrun remind` about {left_date[:7]}, due in it or `--month {left_date[:7]}`, "
                               "reaches them)")
    click.echo(f"{len(changed)} employee{'' if len(changed) == 1 else 's'} marked "
               f"{'as working here again' if active else f'as left{on}'}{after}" + already)
    if active and (cleared := [i for i in changed if before.get(i)]):
        # (an HR walkthrough: `back` to make a leaver's last slip cleared the day they left, unsaid;
        # the `left` after it recorded today)
        shown = ", ".join(f"{i} (left {before[i]})" for i in cleared[:10]) + (" …" if len(cleared) > 10 else "")
        click.echo(f"the day they left is cleared: {shown}; to mark them left as before: "
                   f"{payroll.left_again(cleared, before)}")


@cli.group(name="limits")
def limits_group() -> None:
    """Show or change the global email limits (all workers, all hosts, at run time)."""


@limits_group.command(name="show")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def limits_show(c: Ctx, as_json: bool) -> None:
    """The limits in force, slots in use, waits, 429s seen and any provider outage (sends
    failing in a row: every sender pauses, then one send probes the provider)."""
    from jobs.limits import email_limiter, read_outage
    from payrun import keys

    conn = c.running_redis()
    lim = email_limiter(conn, c.cfg)
    st = lim.settings()
    outage = read_outage(conn)
    pause_ms = conn.pttl(keys.limit_pause("email"))
    from jobs.limits import limit_sources

    in_use = lim.in_use()
    data = {"email": {"cap": st.cap, "rate_per_s": st.rate_per_s, "in_use": in_use,
                      "waiting_for_rate": lim.waiting_for_rate(in_use), **lim.stats(),
                      "slots_for_rate": lim.slots_for_rate(st.rate_per_s),
                      "sources": limit_sources(conn, "email"),
                      "gate_margin_ms": round(lim.gate_margin_ms(), 1), "outage": outage,
                      "outage_after": c.cfg.limits.outage_after,
                      "paused_for_s": round(max(0, pause_ms or 0) / 1000, 1)}}
    if as_json:
        click.echo(json.dumps(data))
        return
    e = data["email"]
    for f, src in e["sources"].items():
        if src["set_at"]:  # an incident's override outlives restarts and config edits: say so
            label = "cap" if f == "cap" else "rate"
            click.echo(f"note: the {label} in force ({src['value']}) was set by `payrun limits set` or the console at "
                       f"{local_time(src['set_at'], c.cfg.timezone)}; the config says {src['config'] if src['config'] is not None else 'nothing yet'}: "
                       "`payrun limits reset` goes back to it")
    waiting = (f" ({e['waiting_for_rate']} of them waiting for their start under the rate: raising the cap would "
               "not help)" if e["waiting_for_rate"] else "")
    click.echo(f"email: {e['in_use']} / {e['cap']} in flight{waiting}, {e['rate_per_s']:g}/s, "
               f"{e.get('waits', 0):,} waits, {e.get('gated', 0):,} held by the send gate, "
               f"{e.get('regated', 0):,} passed it again after a stall, "
               f"{e.get('http_429', 0):,} 429s seen; send gate: 1 s + {e['gate_margin_ms']:g} ms"
               + (f"; {e['duplicates']:,} resends deduped by the provider (slips it already had: "
                  "a send whose reply was lost: a killed sender, a timeout, Redis gone)" if e.get("duplicates") else ""))
    if e["slots_for_rate"] is not None and e["slots_for_rate"] < e["cap"]:
        from jobs.policy import START_WAIT_FIT

        click.echo(f"at {e['rate_per_s']:g}/s at most {e['slots_for_rate']} slots are taken at once: a lane takes a "
                   f"send only while its start would come within {lim.start_wait_s * START_WAIT_FIT:g} s; the other jobs wait "
                   "in the queue (no attempt spent, not retried)")
    if outage and outage["pauses"]:
        from payrun.status import outage_text

        click.echo(outage_text(outage, c.cfg.timezone))
    elif e["paused_for_s"] > 0:
        click.echo(f"paused: the provider answered 429, every sender waits out its Retry-After "
                   f"({e['paused_for_s']:g} s left): no new send starts; the in-flight count includes the "
                   "senders holding a slot while they wait")
    if outage and not outage["pauses"]:
        click.echo(f"the provider failed the last {outage['failed_in_a_row']:,} sends (an outage pause after "
                   f"{c.cfg.limits.outage_after} in a row); last: {visible(outage['last_error'])[:120]}")
    click.echo(f"provider outages: {e.get('outages', 0):,} ended, {e.get('outage_pauses', 0):,} pauses"
               + ("" if c.cfg.limits.outage_after else " (this config turns the outage pause off: limits.outage_after = 0)"))


@limits_group.command(name="set")
@click.option("--cap", type=click.IntRange(1, 10_000), default=None, help="Sends in flight across all hosts.")
@click.option("--rate", type=click.FloatRange(0.1, 100_000), default=None, help="Sends started per second.")
@pass_ctx
@handle_errors
def limits_set(c: Ctx, cap: int | None, rate: float | None) -> None:
    """Change the email cap and/or rate now; every worker uses it on its next send."""
    from jobs.limits import set_limits

    if cap is None and rate is None:
        raise PayrunError("give --cap and/or --rate")
    from console import actions

    set_limits(c.redis(), "email", cap=cap, rate_per_s=rate)
    said = ", ".join(x for x in (f"cap {cap}" if cap else "", f"rate {rate:g}/s" if rate else "") if x)
    command = "payrun limits set" + (f" --cap {cap}" if cap else "") + (f" --rate {rate:g}" if rate else "")
    actions.audit(c.cfg, actions.Outcome("limits", command, 1, message=f"email limits now: {said}"), via="cli")
    click.echo(f"email limits now: {said}")


@limits_group.command(name="reset")
@pass_ctx
@handle_errors
def limits_reset(c: Ctx) -> None:
    """Put the config's email cap and rate back in force (limits.email_concurrency,
    limits.email_rate_per_s), ending any `payrun limits set` or console override."""
    from console import actions
    from jobs.limits import reset_limits

    cap, rate = c.cfg.limits.email_concurrency, c.cfg.limits.email_rate_per_s
    reset_limits(c.redis(), "email", cap, rate)
    said = f"cap {cap}, rate {rate:g}/s (the config's)"
    actions.audit(c.cfg, actions.Outcome("limits", "payrun limits reset", 1, message=f"email limits now: {said}"),
                  via="cli")
    click.echo(f"email limits now: {said}")


@cli.command(name="retry")
@click.argument("job_ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every failed job (narrow with --queue/--error/--company/--month).")
@click.option("--queue", type=click.Choice(["pdf-render", "send-email", "control"]), default=None)
@click.option("--error", "error_text", default=None, help="Only jobs whose last error contains TEXT.")
@click.option("--company", type=int, default=None, help="Only jobs of this company id.")
@click.option("--month", default=None, metavar="YYYY-MM", help="Only jobs of this pay month.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def retry_cmd(c: Ctx, job_ids: tuple[str, ...], all_: bool, queue: str | None, error_text: str | None,
              company: int | None, month: str | None, as_json: bool) -> None:
    """Requeue failed jobs with a fresh attempt budget. A render job re-reads the
    employee's data and a send job the email address from the payroll database, so data
    fixed since its failure is used. --all leaves out jobs whose slip a `payrun resend`
    has delivered since. Written to the audit log."""
    from console import actions
    from payrun import deadletters

    if not job_ids and not all_:
        raise PayrunError("name the failed jobs to retry (ids from `payrun failed`), or use --all "
                          "(narrowed by --queue/--error/--company/--month)")
    if job_ids and all_:
        raise PayrunError("name job ids, or use --all (with optional --queue/--error/--company/--month), not both")
    if (queue or error_text or company is not None or month) and not all_:
        raise PayrunError("--queue, --error, --company and --month narrow --all; with job ids they are not used")
    _known_company(c, company)
    _check_month_option(month)
    conn = c.redis()
    # --all leaves out failed jobs whose slip a resend has delivered since (HR's "send it
    # again" already reached the employee: a retry would email the slip a second time)
    matched = [] if job_ids else deadletters.failed(conn, queue, error_text, company=company, ledger=_maybe_ledger(c),
                                                    month=month)
    resent = [r["id"] for r in matched if r.get("delivered_by_resend")]
    ids = list(job_ids) or [r["id"] for r in matched if not r.get("delivered_by_resend")]
    unknown = [i for i in job_ids if not deadletters.is_failed(conn, i)]
    if unknown:
        # bad input: one line, exit 2, nothing requeued (not even the ids that were right)
        # and no audit entry
        right = len(job_ids) - len(unknown)
        some = "" if not right else f"; nothing was requeued ({right} of the ids {'was' if right == 1 else 'were'} right)"
        raise InputError(f"not among failed jobs: {', '.join(unknown)} (ids from `payrun failed`){some}")
    command = _retry_all(queue, error_text, company, month) if all_ else "payrun retry " + " ".join(job_ids)
    db = c.payroll() if c.cfg.payroll_path.exists() else None
    ids, same_slip = deadletters.one_per_slip(conn, ids)  # one email per slip, not one per dead letter
    from console.failed import permanent_among

    on_data = permanent_among(conn, ids)  # (read before the retry resets the jobs)
    fixed = deadletters.readdressed(conn, on_data, db)  # (of them, sends to an address changed since)
    again: list[str] = []
    refused: list[tuple[str, str]] = []
    requeued, missing = deadletters.retry(c.cfg, conn, ids, db, rendered_again=again, refused=refused,
                                          ledger=_maybe_ledger(c))
    same_slip = deadletters.still_left_out(same_slip, requeued, again)
    actions.audit(c.cfg, actions.Outcome("retry", command, len(requeued), ok=not missing and not refused,
                                         message=f"requeued {len(requeued)} job(s)",
                                         detail={"asked": len(ids), "not_found": missing[:20],
                                                 "rendered_again": again[:20],
                                                 "refused": [i for i, _ in refused[:20]]}), via="cli")
    if as_json:
        click.echo(json.dumps({"requeued": requeued, "not_found": missing, "left_out_resent": resent,
                               "left_out_same_slip": same_slip, "rendered_again": again,
                               "not_requeued": [{"id": i, "why": why} for i, why in refused]}))
    else:
        click.echo(f"requeued {len(requeued)} job(s)" + (f"; not among failed jobs: {', '.join(missing)}" if missing else "")
                   + (f"; {len(again)} of them render their slip again first (the file was missing from the slip "
                      "store): each send waits for its render, spending no attempt" if again else "")
                   + (f"; left out {len(resent)} whose slip a `payrun resend` delivered since" if resent else "")
                   + (f"; left out {len(same_slip)} older failure(s) of the same slip (one email per slip: "
                      f"{', '.join(same_slip[:5])}{' …' if len(same_slip) > 5 else ''})" if same_slip else "")
                   + ("; no failed job matched" + (f" (`payrun failed{_narrowing(queue, error_text, company, month)}` "
                                                   "lists what --all acts on)" if (queue or error_text or month or company
                                                                                   is not None) else "")
                      if all_ and not matched else ""))
        for job_id, why in refused:
            click.echo(f"not requeued: {why}", err=True)
        if requeued:
            from redis.exceptions import RedisError

            from payrun.status import intake_notes

            try:
                for note in intake_notes(conn):  # requeued where nothing takes them yet (drained, no worker)
                    click.echo(f"note: {note}", err=True)
            except (RedisError, OSError):
                pass
        if readdressed := [i for i in on_data if i in set(requeued) and i in fixed]:
            click.echo(f"note: {len(readdressed)} of them had an address refused that the payroll data has "
                       f"changed since: {'it goes' if len(readdressed) == 1 else 'they go'} to the new one")
        if on_data := [i for i in on_data if i in set(requeued) and i not in fixed]:
            click.echo(f"note: {len(on_data)} of them had failed on the employee's data (an address refused, a "
                       "name too long): they are read again from the payroll database, so if it was not fixed "
                       "first (`payrun import`) they fail again")
    sys.exit(1 if missing or refused else 0)


def _narrowing(queue: str | None, error_text: str | None, company: int | None, month: str | None = None) -> str:
    import shlex

    return ((f" --queue {queue}" if queue else "") + (f" --error {shlex.quote(error_text)}" if error_text else "")
            + (f" --company {company}" if company is not None else "") + (f" --month {month}" if month else ""))


@cli.command()
@click.option("--loop", is_flag=True, help="Keep reaping every lease.reap_every_s seconds (until SIGTERM).")
@click.option("--every", "every_s", type=click.IntRange(1, 3600), default=None,
              help="With --loop: seconds between passes (default: lease.reap_every_s, 5).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def reap(c: Ctx, loop: bool, every_s: int | None, as_json: bool) -> None:
    """Return jobs of dead workers (or with expired leases) to the front of their queue.
    Safe to run on several hosts at once: each job is returned exactly once.

    A job a worker took from its queue but never started (it died in between) is
    returned once a pass has seen it there for 10 s: run with --loop, or run again.
    Email slots held by senders with no liveness (killed) are given back too, rather
    than when their leases end."""
    import signal
    import time

    from redis import exceptions as redis_errors

    from jobs import limits, reaper
    from jobs.policy import redis_refuses_writes
    from jobs.runtime import OUTAGE_LOG_EVERY_S, RepeatedFailure

    if every_s is not None and not loop:  # (it made one pass and exited, the --every unread)
        raise InputError("--every sets the pause between passes of --loop: add --loop (without it, one pass)")
    conn = c.redis()
    every = every_s or c.cfg.lease.reap_every_s
    stopping: list[int] = []
    if loop:
        _setup_logging()
        signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
        signal.signal(signal.SIGINT, lambda *a: stopping.append(1))
    log = logging.getLogger("payrun.reaper")
    # Redis away: said at once, then every 30 s, and "answers again" once (it said two
    # lines every pass, every 5 s, for as long as Redis was away)
    outage = RepeatedFailure(OUTAGE_LOG_EVERY_S)
    while True:
        try:
            returned = reaper.reap(conn)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ResponseError) as e:
            if isinstance(e, redis_errors.ResponseError) and not redis_refuses_writes(e):
                raise
            if not loop:
                if isinstance(e, redis_errors.ResponseError):
                    raise  # (handle_errors says it in one line)
                raise PayrunError(f"Redis unavailable: {e}")
            if (line := outage.failed(time.monotonic(), e)) is not None:
                log.warning("reaper: Redis unavailable or refusing writes (%s); trying again every %d s", line, every)
            returned = []
            away = True
        else:
            away = False
            if (line := outage.ok(time.monotonic())) is not None:
                log.warning("reaper: Redis answers again: %s", line)
        try:
            freed = limits.free_dead_slots(conn)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ResponseError) as e:
            if isinstance(e, redis_errors.ResponseError) and not redis_refuses_writes(e):
                raise
            if not away:  # (Redis away is said above)
                log.warning("reaper: could not check the email slots (%s)", e)
            freed = []
        if freed and not (as_json and not loop):
            from jobs.policy import slot_lane

            lanes = sorted({slot_lane(h) for h in freed})
            (log.warning if loop else click.echo)(
                f"freed {len(freed)} email slot(s) held by senders with no liveness: {', '.join(lanes[:5])}"
                + (f" … ({len(lanes)} in all)" if len(lanes) > 5 else ""))
        if not away:
            # a worker killed with -9 is restarted by supervisord before its liveness lapses,
            # so the new worker's start kept its record: it read GONE for up to 8 minutes
            # (RQ's key expiry) beside its successor (drill, session 41). Once the liveness
            # has lapsed, the next pass on its host registers its death.
            from jobs.runtime import forget_dead_here

            try:
                forget_dead_here(conn)
            except (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ResponseError) as e:
                log.warning("reaper: could not clear exited workers' records (%s)", e)
        if as_json and not loop:
            click.echo(json.dumps([vars(s) for s in returned]))
        for s in returned:
            (log.warning if loop else click.echo)(f"returned {s.job_id} to {s.queue}: {s.reason}")
        if not loop:
            if not returned and not as_json:
                click.echo("nothing stuck" if not freed else "no job stuck")
                running = sum(int(conn.zcard(f"rq:wip:{q}")) for q in keys.QUEUES)
                if running:  # (right after a kill -9 it said "nothing stuck" and 34 came back 10 s later)
                    from jobs.runtime import ALIVE_TTL_S

                    click.echo(f"  {running:,} job{'s are' if running != 1 else ' is'} running on live workers; a "
                               f"worker killed in the last {ALIVE_TTL_S} s still counts as alive until its liveness "
                               "key lapses: run this again then (the reaper program does it every few seconds)")
            return
        deadline = time.monotonic() + every
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.2)
        if stopping:
            return


@cli.command()
@click.option("--before", required=True, metavar="YYYY-MM", help="Remove ledger history of months before this one.")
@click.option("--slips", is_flag=True, help="Also delete those months' slip PDFs.")
@click.option("--dry-run", is_flag=True, help="Say what would go, remove nothing.")
@click.option("--force", is_flag=True, help="Also the latest pay run and unfinished jobs Redis has forgotten (never a month still in Redis's queues).")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def prune(c: Ctx, before: str, slips: bool, dry_run: bool, force: bool, as_json: bool) -> None:
    """Remove old months from the ledger (and optionally their slips). Redis needs no
    pruning: finished jobs expire after a day, failed ones after 30 days. The latest pay
    run and months with jobs still queued, running or retrying are refused unless
    --force: their ledger is what says who got a slip. Even --force refuses a month whose
    jobs Redis still holds (a month still being made)."""
    from payrun import retention
    from payrun.runs import validate_month

    try:
        validate_month(before)
    except PayrunError as e:
        raise PayrunError(str(e).replace("--month", "--before", 1)) from None
    r = retention.prune(c.cfg, c.ledger(), before, slips=slips, dry_run=dry_run, force=force, redis=c.redis)
    if not dry_run and r.months:  # it deletes who-got-a-slip history (and PDFs): `payrun audit` left it out
        from payrun.audit import Outcome, audit

        command = f"payrun prune --before {before}" + (" --slips" if slips else "") + (" --force" if force else "")
        audit(c.cfg, Outcome("prune", command, r.jobs, message=(
            f"removed {_n(r.jobs, 'job')}, {_n(r.runs, 'pay-run row')}" + (f", {_n(r.slip_dirs, 'slip folder')}" if slips else "")
            + f" (months {', '.join(r.months)})"), detail={"months": list(r.months)}), via="cli")
    if as_json:
        click.echo(json.dumps({**vars(r), "dry_run": dry_run}))
        return
    verb = "would remove" if dry_run else "removed"
    click.echo(f"{verb} {_n(r.jobs, 'job')}, {_n(r.attempts, 'attempt')}, {_n(r.runs, 'pay-run row')}"
               + (f", {_n(r.slip_dirs, 'slip folder')}" if slips else "")
               + (f" (months {', '.join(r.months)})" if r.months else " (nothing before " + before + ")")
               + (f"; but without --dry-run: {r.refused}" if r.refused else ""))


# ---- processes -------------------------------------------------------------------

@cli.command()
@click.argument("queues", nargs=-1, required=True)
@click.option("--burst", is_flag=True, help="Quit when the queues are empty.")
@click.option("--lanes", type=click.IntRange(1, 500), default=None,
              help="send-email: concurrent sends in this process (default: email.lanes).")
@pass_ctx
@handle_errors
def worker(c: Ctx, queues: tuple[str, ...], burst: bool, lanes: int | None) -> None:
    """Run a worker on QUEUES: pdf-render (one forking process; run one per core),
    send-email (many concurrent sends as threads in one process) or control."""
    from payrun import keys

    unknown = [q for q in queues if q not in keys.QUEUES]
    if unknown:
        raise PayrunError(f"unknown queue {unknown[0]!r} (choose from {', '.join(keys.QUEUES)})")
    if keys.EMAIL_QUEUE in queues and len(queues) > 1:
        raise PayrunError("send-email runs in its own worker: `payrun worker send-email`")
    if lanes is not None and keys.EMAIL_QUEUE not in queues:
        raise PayrunError("--lanes is for send-email workers; a pdf-render or control worker runs one job "
                          "at a time (run one pdf-render worker per core: render.workers)")
    _setup_logging()
    from payrun import redis_server

    if not burst and not c.cfg.embedded_redis:  # a worker host: the control host's Redis may be restarting
        redis_server.wait_until_reachable(c.cfg, f"worker {'/'.join(queues)}", logging.getLogger("payrun.worker"))
    conn = c.redis()

    if not burst:  # (a burst worker is a script's: it fails at once, with the reason)
        redis_server.wait_for_writes(conn, f"worker {'/'.join(queues)}", logging.getLogger("payrun.worker"), c.cfg)
    from jobs import tasks
    from jobs.runtime import forget_dead_here, hosts_named_alike

    tasks.settings.cache_clear()
    os.environ.setdefault("PAYRUN_HOME", str(c.cfg.home))
    try:  # (a restart after Redis failed under its jobs: not GONE beside the live ones)
        forget_dead_here(conn)
        if alike := hosts_named_alike(conn):
            logging.getLogger("payrun.worker").warning("%s", alike)
    except Exception as e:  # noqa: BLE001 - housekeeping: RQ's key expiry clears them anyway
        logging.getLogger("payrun.worker").warning("could not clear exited workers' records: %s", e)
    if queues == (keys.EMAIL_QUEUE,):
        from jobs.runtime import run_lanes

        from jobs.limits import email_limiter

        limiter = email_limiter(conn, c.cfg)
        for field_, (value, at) in limiter.seed().items():
            logging.getLogger("payrun.limits").warning(
                "email limits: %s = %s was set by an operator at %s and stays in force (the config says %s): "
                "`payrun limits reset` goes back to the config",
                field_, value, at, limiter.default_cap if field_ == "cap" else limiter.default_rate)
        run_lanes(conn, list(queues), lanes or c.cfg.email.lanes, burst=burst, grace_s=c.cfg.lease.grace_s,
                  limiter=limiter)
        return
    from jobs.runtime import RenderWorker, make_queue, worker_name

    w = RenderWorker([make_queue(q, conn) for q in queues], connection=conn,
                     name=worker_name("render" if keys.RENDER_QUEUE in queues else "control"))
    w.grace_s = c.cfg.lease.grace_s
    w.jobs_per_horse = c.cfg.render.jobs_per_horse
    w.batch = c.cfg.render.batch
    w.work(burst=burst, with_scheduler=True, logging_level="INFO")


@cli.command()
@pass_ctx
@handle_errors
def ledger(c: Ctx) -> None:
    """Run the ledger: apply workers' state changes (Redis stream) to the SQLite ledger."""
    import signal

    from payrun import ledger as ledger_mod

    _setup_logging()
    log = logging.getLogger("payrun.ledger")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *a: stopping.append(1))
    # its own database first: one it cannot open fails now, not after Redis has come up (by
    # then `payrun up` had seen every program stay up its 5 s and said all was well); on a
    # full disk it waits for room instead, saying so
    store = ledger_mod.open_waiting(c.ledger, c.cfg.ledger_path, lambda: bool(stopping), log)
    if store is None:
        return
    conn = c.redis()
    from payrun import redis_server

    redis_server.wait_for_writes(conn, "ledger", log, c.cfg)
    log.info("ledger: applying events to %s", c.cfg.ledger_path)
    observer = None
    if c.cfg.metrics.port >= 0:
        from payrun import metrics

        try:
            observer, _server = metrics.serve(conn, c.cfg)
        except OSError as e:
            log.warning("ledger: metrics endpoint not started on 127.0.0.1:%d: %s", c.cfg.metrics.port, e)
    me = ledger_mod.owner_id(c.cfg.ledger_path)
    try:
        ledger_mod.serve(conn, store, stop=lambda: bool(stopping), log=log, observer=observer, me=me)
        n = ledger_mod.drain(conn, store) if ledger_mod.own_events(conn, me) is None else 0
        log.info("ledger: stopped (applied %d more on the way out)", n)
    finally:
        ledger_mod.let_go_of_events(conn, me)


@cli.group(invoke_without_command=True)
@click.option("--host", default=None, help="Listen address, this machine's loopback only (default: provider.host, "
              "127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port (default: provider.port, 8025).")
@click.option("--latency", type=click.FloatRange(0, 60), default=None, help="Seconds per accepted send (1.2).")
@click.option("--rate", type=click.FloatRange(0.1, 100_000), default=None, help="Accepted sends per second (40).")
@pass_ctx
@handle_errors
def provider(c: Ctx, host: str | None, port: int | None, latency: float | None, rate: float | None) -> None:
    """Run the local email provider simulator (HTTP JSON API): latency, a rate limit
    answered with 429 + Retry-After, injectable 503 outages, dedupe by Idempotency-Key.
    Every request needs the data directory's token ($PAYRUN_HOME/redis/provider-token,
    made on first use), which this host's senders show when PAYRUN_EMAIL_URL is unset;
    a replaced file is followed within a second, no restart needed.
    `payrun provider outage 90` and `payrun provider stats` talk to the running one."""
    from payrun import provider as provider_mod

    if click.get_current_context().invoked_subcommand is not None:
        return
    p = c.cfg.provider
    if host is not None and (why := config_mod.provider_host_problem(host)):
        raise click.BadParameter(why, param_hint="--host")
    _setup_logging()
    token = provider_mod.local_token_file(c.cfg)  # (followed when the file is replaced)
    try:
        provider_mod.run(host or p.host, port if port is not None else p.port,
                         latency if latency is not None else p.latency_s, rate if rate is not None else p.rate_per_s,
                         token=token)
    except OSError as e:  # the port is taken, or the address is not this host's
        taken = " (another payrun's provider? give this one another port: provider.port in the config file)" \
            if e.errno == errno.EADDRINUSE else ""
        raise InputError(f"cannot listen on {host or p.host}:{port if port is not None else p.port}: {e}{taken}")


def _provider_admin(c: Ctx, method: str, path: str, doc=None):
    """A running local provider's answer (the group's --host/--port, else the config's)."""
    from payrun import provider as provider_mod

    if c.cfg.email.url:
        raise InputError("PAYRUN_EMAIL_URL (email.url) is set: sends go to that provider, not the local simulator "
                         "(`payrun up` does not run it)")
    parent = click.get_current_context().parent
    host, port = (parent.params.get("host"), parent.params.get("port")) if parent is not None else (None, None)
    try:
        return provider_mod.admin(c.cfg, method, path, doc, host=host, port=port)
    except provider_mod.AdminError as e:
        raise InputError(str(e)) from None


@provider.command(name="outage")
@click.argument("seconds", type=click.FloatRange(0, 86_400))
@click.option("--status", type=click.IntRange(400, 599), default=503, show_default=True,
              help="What every send is answered meanwhile.")
@pass_ctx
@handle_errors
def provider_outage(c: Ctx, seconds: float, status: int) -> None:
    """Rehearse a provider outage: the running local provider answers every send with
    STATUS (503) for SECONDS; `payrun provider outage 0` ends one now."""
    if seconds == 0:
        _provider_admin(c, "DELETE", "/v1/admin/outage", {})
        click.echo("provider outage ended")
        return
    out = _provider_admin(c, "POST", "/v1/admin/outage", {"seconds": seconds, "status": status})
    click.echo(f"provider outage: every send is answered {out['status']} for {out['seconds']:g} s "
               "(`payrun provider outage 0` ends it)")


@provider.command(name="stats")
@pass_ctx
@handle_errors
def provider_stats(c: Ctx) -> None:
    """The running local provider's counters as JSON (GET /v1/stats): delivered, 429s,
    duplicates refused, in flight; kept in memory, so they restart with it."""
    click.echo(json.dumps(_provider_admin(c, "GET", "/v1/stats"), indent=2))


@cli.command(name="redis")
@pass_ctx
@handle_errors
def redis_cmd(c: Ctx) -> None:
    """Run the embedded Redis in the foreground (what supervisord runs)."""
    from payrun import redis_server

    redis_server.serve_foreground(c.cfg)


@cli.command()
@click.option("--employees", default=600, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--companies", default=3, show_default=True, type=click.IntRange(1, 1_000))
@click.option("--month", default=None, metavar="YYYY-MM", help="Month to run (default: this month).")
@click.option("--timeout", "timeout_s", default=None, type=click.IntRange(10, 86_400),
              help="Give up after this many seconds (default: twice what the email rate limit "
                   "needs for the slips, plus 5 minutes; at least 900).")
@pass_ctx
@handle_errors
def demo(c: Ctx, employees: int, companies: int, month: str | None, timeout_s: int | None) -> None:
    """Seed sample data, start Redis, the provider, the ledger and the workers, run a
    month's payroll with a live progress bar, print the status, shut everything down.
    Exit 0 only if every slip was delivered. Data goes to $PAYRUN_HOME/demo."""
    from payrun import demo as demo_mod
    from payrun.runs import validate_month

    if employees < companies:
        raise PayrunError(f"--employees ({employees}) must be at least --companies ({companies})")
    if timeout_s is None:
        timeout_s = demo_mod.default_timeout_s(employees, c.cfg.limits.email_rate_per_s)
    ok = demo_mod.run_demo(c.cfg, employees=employees, companies=companies,
                           month=validate_month(month or default_month()), timeout_s=timeout_s)
    sys.exit(0 if ok else 1)


@cli.command()
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Return only once every program has stayed up (--no-wait: once supervisord started).")
@click.option("--role", type=click.Choice(["all", "worker"]), default=None,
              help="all = the control host (everything); worker = render and send workers only, "
                   "against PAYRUN_REDIS_URL and a shared PAYRUN_SLIPS_DIR. Default: the role this "
                   "data directory was last started with (all the first time).")
@pass_ctx
@handle_errors
def up(c: Ctx, wait: bool, role: str | None) -> None:
    """Start supervisord in the background: supervisor.conf (role all) or
    supervisor-worker.conf (role worker)."""
    from payrun import supervise

    role = role or supervise._role(c.cfg)
    home = c.cfg.home
    fresh = role == "all" and not any((home / m).exists() for m in Ctx.HOME_MARKERS)
    click.echo(supervise.up(c.cfg, wait=wait, role=role))
    _say_drained(c)
    if fresh:  # (run from the wrong directory, it started a whole empty payrun there, ports and all)
        demo = " (`payrun demo` keeps its data in its demo/ folder)" if (home / "demo" / "payroll.db").exists() else ""
        click.echo(f"note: {home} held no payrun data, so this is a new, empty payrun: `payrun seed` or "
                   f"`payrun import` next. If your data is elsewhere{demo}: `payrun down` here, then set PAYRUN_HOME "
                   f"to it", err=True)


def _say_drained(c: Ctx) -> None:
    """A drain outlives `payrun down`/`up`: `up` reported every program RUNNING and said
    nothing of it, and nothing moved until someone read `payrun status`'s note."""
    from payrun.status import intake_notes

    try:
        conn = _maybe_redis(c)
        notes = [n for n in intake_notes(conn) if "drained" in n] if conn is not None else []
    except Exception:  # (a note only: `up` itself went well)
        notes = []
    for n in notes:
        click.echo(f"note: {n}", err=True)


@cli.command()
@click.option("--force", is_flag=True,
              help="Stop this host even while workers it does not run (another host's) hold jobs.")
@pass_ctx
@handle_errors
def down(c: Ctx, force: bool) -> None:
    """Stop every program gracefully (workers finish their jobs), then supervisord.

    On a control host, refused while workers of another host hold jobs and it runs what
    they send through (the embedded Redis, the local provider): stop those first, or --force."""
    from payrun import supervise

    # from the wrong directory it said "supervisord is not running", exit 0, and left a
    # ./var behind: an on-call engineer in the wrong shell was told payrun was stopped
    c.require_home()
    if (not force and supervise._role(c.cfg) == "all" and (under := supervise.beneath(c.cfg))
            and (busy := _busy_elsewhere(c))):
        from payrun.errors import SetupError

        raise SetupError(supervise.busy_elsewhere_line(busy, under))
    left = _run_left(c)  # (while Redis still answers)
    click.echo(supervise.down(c.cfg, say=lambda m: click.echo(m, err=True)))
    if left:
        month, n = left
        click.echo(f"the {month} pay run was in progress: at most {n:,} slip{'' if n == 1 else 's'} not sent yet wait "
                   "in Redis (counted as the stop began: sends in hand finished meanwhile); `payrun up` goes on with "
                   "them (nothing is lost or sent twice)")


def _busy_elsewhere(c: Ctx) -> list:
    """Workers alive with a job in hand that this data directory's supervisord does not run
    (supervise.busy_elsewhere); none when Redis does not answer (nothing to stop beneath)."""
    import socket
    import time

    from console.data import read_workers
    from payrun import supervise

    try:
        conn = _maybe_redis(c)
        if conn is None:
            return []
        rows = read_workers(conn, time.time())
    except Exception:  # noqa: BLE001 - a look only: Redis away, nothing is sending through it
        return []
    from payrun.procs import host_id

    return supervise.busy_elsewhere(rows, set(supervise.processes(c.cfg)), socket.gethostname(), host_id())


def _run_left(c: Ctx) -> tuple[str, int] | None:
    """(month, slips queued, running or retrying) of the latest pay run, if some are."""
    try:
        from payrun import status as status_mod

        if not c.cfg.ledger_path.exists():
            return None
        r = status_mod.report(c.cfg, c.ledger(), None, None, conn=_maybe_redis(c))
        t = r.get("total") or {}
        n = int(t.get("queued", 0)) + int(t.get("running", 0)) + int(t.get("retrying", 0))
        return (r["month"], n) if r.get("month") and n else None
    except Exception:  # noqa: BLE001 - a courtesy line: never in the way of stopping
        return None


@cli.command(name="supervisor-env")
@click.option("--role", type=click.Choice(["all", "worker"]), default=None,
              help="default: the role the data directory was last started in (`payrun up --role`), else all")
@pass_ctx
@handle_errors
def supervisor_env(c: Ctx, role: str | None) -> None:
    """Print the environment supervisor.conf expects, for plain supervisord/supervisorctl:
    sv="$(payrun supervisor-env)" && eval "$sv" && supervisord -c "$PAYRUN_SUPERVISOR_CONF" (the file's
    whole path, also exported, so that supervisorctl works from any directory)."""
    import shlex

    from payrun import supervise

    # the data directory's role: on a worker host the deploy steps' plain `supervisor-env`
    # took it for a control host, refused ("another ledger applies this Redis's events ...
    # start it with `payrun up --role worker`", which it was) and printed nothing, and the
    # `eval "$(...)" &&` went on to a supervisorctl with no file (multi-host drill, s41)
    role = role or supervise._role(c.cfg)
    supervise.check_role(c.cfg, role)
    e = supervise.env(c.cfg)
    for k in supervise.ENV_KEYS:
        click.echo(f"export {k}={shlex.quote(e[k])}")
    # the file's whole path, for supervisorctl run from any directory (the deploy steps use it)
    click.echo(f"export PAYRUN_SUPERVISOR_CONF={shlex.quote(str(supervise.CONFS[role]))}")
    click.echo(f'# then: supervisord -c "$PAYRUN_SUPERVISOR_CONF" ; supervisorctl -c "$PAYRUN_SUPERVISOR_CONF" status')


@cli.command()
@pass_ctx
@handle_errors
def ps(c: Ctx) -> None:
    """Show the supervised programs (supervisorctl status)."""
    from payrun import supervise

    c.require_home()  # (from the wrong directory: "supervisord is not running" while it runs elsewhere)
    out, code = supervise.ctl(c.cfg, "status", timeout_s=supervise.STATUS_TIMEOUT_S)
    if supervise.absent(out):
        found = supervise.orphans(c.cfg)
        click.echo(f"supervisord is not running for {c.cfg.home} (`payrun up` starts it)"
                   + (f", but {supervise.orphans_line(found)}" if found else ""), err=True)
        sys.exit(3)
    click.echo(out.rstrip())
    sys.exit(3 if code not in (0, 3) else supervise.ps_code(out))


# ---- configuration ---------------------------------------------------------------

@cli.group(name="config")
def config_group() -> None:
    """Show the effective configuration."""


@config_group.command(name="show")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
@handle_errors
def config_show(c: Ctx, as_json: bool) -> None:
    """Print the effective configuration (defaults < TOML file < environment), secrets redacted."""
    d = c.cfg.to_dict(redact=True)
    from payrun import redis_server

    d["effective"]["redis_url"] = redis_server.shown_url(c.cfg)
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    _print_tree(d)


def _print_tree(d: dict[str, Any], prefix: str = "") -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _print_tree(v, f"{prefix}{k}.")
        else:
            click.echo(f"{prefix}{k} = {v}")


@config_group.command(name="redis-url")
@click.option("--readonly", is_flag=True, help="The read-only user's URL (it cannot write).")
@pass_ctx
@handle_errors
def config_redis_url(c: Ctx, readonly: bool) -> None:
    """Print the Redis URL with credentials.

    \b
    For rq's commands use `eval "$(payrun config rq-env)"` instead: rq info -u URL
    shows the password in every user's `ps`, and plain rq info uses pickle."""
    from payrun import redis_server

    if c.cfg.embedded_redis:  # (elsewhere it minted a password for a Redis that is not there)
        c.require_home()
    click.echo(redis_server.url(c.cfg, readonly=readonly, strict=True))


@config_group.command(name="rq-env")
@pass_ctx
@handle_errors
def config_rq_env(c: Ctx) -> None:
    """Print the variables rq's own commands need, as shell exports.

    \b
    eval "$(payrun config rq-env)" && rq info
    RQ_REDIS_URL: the URL with credentials (in the environment, not in `ps`);
    RQ_QUEUE_CLASS, RQ_JOB_CLASS, RQ_WORKER_CLASS: our JSON classes, so rq's registry
    cleanup, `rq requeue` and a worker's scheduler read jobs with JSON: plain `rq info`
    unpickles what it finds in Redis."""
    import shlex

    from payrun import redis_server

    if c.cfg.embedded_redis:  # (elsewhere: a new password, and `rq info` then said the socket is not there)
        c.require_home()
    for name, value in (("RQ_REDIS_URL", redis_server.url(c.cfg)),
                        ("RQ_QUEUE_CLASS", "jobs.runtime.PayrunQueue"),
                        ("RQ_JOB_CLASS", "jobs.runtime.PayrunJob"),
                        ("RQ_WORKER_CLASS", "jobs.runtime.PayrunRqWorker")):
        click.echo(f"export {name}={shlex.quote(value)}")


def _register_packages() -> None:
    from console.cli import register as register_console
    from scheduler.cli import register as register_scheduler

    register_scheduler(cli)
    register_console(cli)


_register_packages()


def main() -> None:
    # payroll data: every file payrun or a server it starts creates (the Redis AOF holds the
    # jobs' salary figures, logs, locks) is readable by its owner only, as under supervisord
    os.umask(0o077)
    cli(prog_name="payrun")


if __name__ == "__main__":
    main()
