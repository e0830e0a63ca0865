"""The scheduling commands of `payrun` (registered onto the main click group).

  payrun scheduler [--name N]                       rq-scheduler + the cron pass (run two)
  payrun schedule [--json]                          each entry: next fire time, last run, missed ticks
  payrun resend --employee ID --month M [--json]    one-off: re-render with current data, send again
  payrun remind --company ID --in 30m [--json]      delayed: reminder emails, no earlier than that
  payrun bank [--host H] [--port P]                 the simulated payroll bank (salary credits API)
"""

from __future__ import annotations

import errno
import json
import logging
import re

import click

from payrun.errors import InputError


from payrun.clitools import handle_errors, pass_ctx  # noqa: E402



def _setup_logging() -> None:
    from payrun import logs

    logs.setup("INFO")  # (every other program's lines: the UTC offset, or JSON with log.json)


def _local(iso: str, zone: str) -> str:
    from datetime import datetime, timezone
    from zoneinfo import ZoneInfo

    at = datetime.fromisoformat(iso)
    if at.tzinfo is None:  # (the ledger's times are UTC)
        at = at.replace(tzinfo=timezone.utc)
    return at.astimezone(ZoneInfo(zone)).strftime("%Y-%m-%d %H:%M")


def zone_and_utc(local: str, zone: str, utc_iso: str, utc_date: bool = True) -> str:
    """A time as `payrun schedule` prints it (pure): ``local`` ("YYYY-MM-DD HH:MM[:SS]", in
    ``zone``) followed by its UTC time in brackets, and UTC's date with ``utc_date``. When the
    two read the same (zone UTC) the brackets are left out: "02:00 UTC (02:00 UTC ...)" said
    the same time twice."""
    utc = utc_iso.replace("T", " ")[:len(local)]
    if utc == local:
        return f"{local} {zone}"
    return f"{local} {zone} ({utc[11:]} UTC" + (f" {utc[:10]})" if utc_date else ")")


def _maybe_redis(cfg):
    from payrun import redis_server

    conn = redis_server.connect(cfg, socket_timeout=2, socket_connect_timeout=2)
    return conn if redis_server.ping(conn) else None


def schedule_view(cfg, conn=None, now=None) -> list[dict]:
    """Each cron entry: next fire time (configured zone and UTC), last run, outcome, missed
    ticks. Used by `payrun schedule` (and usable by the console)."""
    from datetime import timezone
    from zoneinfo import ZoneInfo

    from scheduler import cron, service

    zone = ZoneInfo(cfg.timezone)
    now = now or service.clock()
    store = None
    if cfg.ledger_path.exists():
        from scheduler.store import Store

        store = Store(cfg.ledger_path)
    rows = []
    try:
        for e in cron.load_entries(cfg.scheduler.entries):
            nxt = cron.next_after(e.spec, zone, now)
            row = {
                "name": e.name, "cron": e.cron, "job": e.job, "zone": cfg.timezone,
                "next_local": nxt.astimezone(zone).isoformat(), "next_utc": nxt.astimezone(timezone.utc).isoformat(),
                "last_run": None, "outcome": None, "jobs": 0, "detail": None, "missed": 0, "last_missed": None,
                "coalesced": 0, "duplicates_stopped": 0, "handled_until": None,
            }
            if store is not None:
                row.update(store.summary(e.name))
            if conn is not None and e.job != "payroll" and row["outcome"] == "enqueued" and row["jobs"]:
                try:
                    row["work"] = tick_work(conn, e.name, row["last_run"])
                except Exception:  # (the rest of the view stands without it)
                    row["work"] = None
            if store is not None and row["missed"] and e.job == "payroll":
                from scheduler.store import missed_not_run

                named = store.db.conn.execute("SELECT scheduled_for, detail FROM cron_runs WHERE entry = ? AND "
                                              "status = 'missed'", (e.name,)).fetchall()
                row["missed_months_not_run"] = sorted(missed_not_run(named, set(store.ledger.months())))
            row["due_since"] = row["due_waiting"] = None
            # (Redis unreachable, as after `payrun down`: the ledger alone says which tick is due;
            # it read "next <tomorrow>, never run" of today's pay-run tick, due and not fired)
            if conn is not None or store is not None:
                raw = conn.get(service.cursor_key(e.name)) if conn is not None else None
                handled = None
                if raw is not None:
                    from datetime import datetime

                    handled = datetime.fromtimestamp(float(raw), timezone.utc)
                    row["handled_until"] = handled.isoformat(timespec="seconds")
                elif store is not None and cron.ledger_unsure(
                        service.LedgerMemory(cfg).role(), cfg.embedded_redis, True, store.ticks_recorded(),
                        service.LedgerMemory(cfg).ledger_here(conn)) is None:
                    # Redis lost the cursor: where the next pass resumes from (a ledger that cannot
                    # tell which ticks ran, not the control host's, says nothing)
                    reg, newest = store.recovery_facts(e.name)
                    if reg or newest:
                        handled = cron.recovered_cursor(now, reg and cron.from_iso(reg),
                                                        newest and cron.from_iso(newest))
                if handled is not None:
                    # a tick due and not fired yet (no scheduler ran at its time): "next" is
                    # the one after it, and read "next: next month" at 02:05 on the 1st
                    due = cron.next_after(e.spec, zone, handled)
                    if due <= now:
                        row["due_since"] = due.isoformat()
                        row["due_waiting"] = due_waiting(conn, e.name, due) if conn is not None else None
            rows.append(row)
    finally:
        if store is not None:
            store.close()
    return rows


def due_waiting(conn, entry: str, due) -> dict:
    """What holds back a due tick while schedulers run: rq-scheduler's pass lock (its owner
    and seconds left; a scheduler killed mid-pass keeps it until it lapses, 11 s) and the
    tick's claim (the scheduler that claimed it, seconds left; a claimer killed before it
    enqueued is taken over when it lapses, 30 s)."""
    from rq_scheduler import Scheduler

    from scheduler import cron, service

    out: dict = {"pass_lock": None, "pass_lock_ttl_s": None, "claimed_by": None, "claim_ttl_s": None}
    owner = conn.get(Scheduler.scheduler_lock_key)
    if owner is not None:
        name, host, pid = service.pass_lock_holder(owner.decode(errors="replace"))
        out["pass_lock"] = name + (f" (pid {pid}, host id {host})" if pid is not None else "")
        out["pass_lock_ttl_s"] = max(conn.ttl(Scheduler.scheduler_lock_key), 0)
    marker = service.marker_key(entry, cron.stamp(due))
    held = conn.get(marker)
    if held is not None and held.startswith(b"claimed:"):
        out["claimed_by"] = held.decode(errors="replace")[len("claimed:"):].rsplit(":", 1)[0]
        out["claim_ttl_s"] = max(conn.ttl(marker), 0)
    return out


def tick_work(conn, entry: str, scheduled_for: str) -> dict:
    """What became of the jobs a recurring tick enqueued (its cron_runs row says "enqueued"
    the moment they are queued, and kept saying so when every bank check had failed): how
    many failed for good (in the control queue's failed registry), are still to run (queued,
    running, or waiting for a retry), and the first failure's error. Job ids of a tick's work
    end in ``-<entry>-<stamp>`` or carry it before a suffix (``bank-<entry>-<stamp>-<month>-c<id>``)."""
    from rq.registry import FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry

    from jobs.runtime import PayrunJob, make_queue
    from payrun import keys
    from scheduler import cron

    mark = f"-{entry}-{cron.stamp(cron.from_iso(scheduled_for))}"

    def ours(job_id) -> bool:
        job_id = job_id.decode() if isinstance(job_id, bytes) else job_id
        return job_id.endswith(mark) or (mark + "-") in job_id

    q = make_queue(keys.CONTROL_QUEUE, conn)
    failed_reg = FailedJobRegistry(queue=q, job_class=PayrunJob, serializer=q.serializer)
    failed = [i for i in failed_reg.get_job_ids(cleanup=False) if ours(i)]
    pending = [i for i in q.get_job_ids() if ours(i)]
    for reg in (StartedJobRegistry, ScheduledJobRegistry):
        pending += [i for i in reg(queue=q, job_class=PayrunJob, serializer=q.serializer).get_job_ids(cleanup=False)
                    if ours(i)]
    error = None
    for job_id in failed[:1]:
        try:
            job = PayrunJob.fetch(job_id, connection=conn, serializer=q.serializer)
            error = (job.meta or {}).get("last_error") or None
        except Exception:  # (gone meanwhile: the count stands)
            pass
    return {"failed": len(failed), "pending": len(pending), "error": error}


def tick_work_text(jobs: int, work: dict | None) -> str:
    """The part of `payrun schedule`'s "last" line that says how a recurring tick's work went
    (pure): nothing when all of it ran, else how many of the tick's jobs failed, with the
    first error and where to look, and how many are still to run."""
    if not work or not jobs:
        return ""
    parts = []
    if work.get("failed"):
        err = work.get("error")
        parts.append(f"{work['failed']} of {jobs} failed" + (f" ({err})" if err else "")
                     + ": `payrun failed --queue control`")
    if work.get("pending"):
        parts.append(f"{work['pending']} still to run")
    return "; ".join(parts)


def due_text(due_when: str, window: str, alive: list[str] | None, waiting: dict | None) -> str:
    """`payrun schedule`'s DUE line (pure). With schedulers alive it said "no scheduler has
    run since" of a tick a killed scheduler held back for 11 s (its pass lock) or 30 s (its
    claim): the on-call read two live schedulers as none."""
    head = f"DUE since {due_when}, not fired yet: "
    if alive is None:
        return (head + "Redis is unreachable and the ledger has no row of it; schedulers back within the "
                f"catch-up window ({window}) fire it (`payrun up`), later it is recorded as missed")
    if not alive:
        return (head + "no scheduler has run since; one that starts within the catch-up window "
                f"({window}) fires it, later it is recorded as missed")
    waiting = waiting or {}
    why = []
    if waiting.get("claimed_by"):
        why.append(f"claimed by {waiting['claimed_by']}, which has not enqueued it: if it died, another "
                   f"scheduler takes it over when the claim lapses (in {waiting.get('claim_ttl_s')} s)")
    if waiting.get("pass_lock"):
        why.append(f"the pass lock (rq:scheduler_lock) is held by {waiting['pass_lock']} for "
                   f"{waiting.get('pass_lock_ttl_s')} s more (a scheduler killed mid-pass keeps it until it lapses, or until that scheduler restarts on its host)")
    return (head + f"{len(alive)} scheduler(s) alive fire it at a coming pass"
            + ("; " + "; ".join(why) if why else "") + ". If it stays DUE, read their logs")


def missed_detail_text(detail: str, not_run: list[str] | None) -> str:
    """A missed pay-run tick's detail as `payrun schedule` prints it: its "run it by hand:
    payrun run --month M" once M has run since (by hand) says so instead (it kept asking
    for a run that was done). ``not_run``: the months still not run (None: not a pay run)."""
    head, sep, _ = detail.partition("; run it by hand: ")
    if not sep or not_run is None:
        return detail
    if not not_run:
        return head + "; run by hand since (the ledger has the month's run)"
    return head + sep + ", ".join(f"payrun run --month {m}" for m in not_run)


def running_entries_differ(cfg, conn, alive: list[str] | None = None) -> list[str]:
    """The entries whose schedule the running schedulers loaded (at their start, written to
    Redis: scheduler.service.entries_key) differ from this config file's, one line each: an
    edited file is used only after a restart, and `payrun schedule` showed the file's time
    while the tick at it never fired (a walkthrough moved a pay run's time: no run, no
    missed tick). When the schedulers alive (``alive``; default: looked up) loaded different
    schedules from each other (a deploy restarted one of two), each line names the
    scheduler it is about."""
    from scheduler import cron, service

    if alive is None:
        alive = schedulers_alive(conn)
    if not alive:
        return []
    mine = {e.name: service.entry_record(e, cfg.timezone) for e in cron.load_entries(cfg.scheduler.entries)}
    legacy = None
    per: dict[str, list[str]] = {}
    for sched in alive:
        raw = conn.hgetall(service.entries_key(sched))
        if not raw:  # a scheduler of an older payrun: the one shared copy
            legacy = conn.hgetall(service.ENTRIES_KEY) if legacy is None else legacy
            raw = legacy
        if not raw:
            continue
        per[sched] = _entries_differ({k.decode(): json.loads(v) for k, v in raw.items()}, mine)
    kinds = {tuple(lines) for lines in per.values()}
    if len(kinds) <= 1:
        return list(next(iter(kinds), ()))
    return [f"{sched}: {line}" for sched, lines in sorted(per.items()) for line in lines]


def _entries_differ(running: dict[str, dict], mine: dict[str, dict]) -> list[str]:
    out = []
    for name in sorted(set(running) | set(mine)):
        r, m = running.get(name), mine.get(name)
        if r == m:
            continue
        if m is None:
            out.append(f"{name}: running, not in this file")
        elif r is None:
            out.append(f"{name}: in this file, not running")
        else:
            now_ = ", ".join(f"{k} {r.get(k)!r}" for k in ("cron", "job", "zone") if r.get(k) != m.get(k))
            out.append(f"{name}: running with {now_}")
    return out


def schedulers_alive(conn) -> list[str]:
    names = []
    for k in conn.scan_iter("rq:scheduler_instance:*"):
        if not conn.hexists(k, "death"):
            names.append(k.decode().split(":", 2)[2])
    return sorted(names)


def register(cli) -> None:
    """Add this package's commands to the `payrun` group."""

    @cli.command(name="scheduler")
    @click.option("--name", default=None, help="This scheduler's name (default: host.pid).")
    @pass_ctx
    @handle_errors
    def scheduler_cmd(c, name: str | None) -> None:
        """Run rq-scheduler plus the cron pass: each configured entry (in the configured
        time zone) enqueues one tick job per scheduled time on the control queue, however
        many schedulers run. Missed ticks fire once on return within
        scheduler.catchup_window_s; older ones are recorded as missed."""
        from scheduler import cron
        from scheduler.service import PayrunScheduler

        cron.load_entries(c.cfg.scheduler.entries)  # refuse a bad entry before touching Redis
        _setup_logging()
        PayrunScheduler(c.cfg, c.redis(), name=name).run()

    @cli.command(name="schedule")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable.")
    @pass_ctx
    @handle_errors
    def schedule_cmd(c, as_json: bool) -> None:
        """List the cron entries: next fire time (configured zone and UTC), last run,
        its outcome, and missed ticks."""
        # (from the wrong directory it said "never run" of a pay run that ran elsewhere, and
        # left a ./var/redis/password behind, as `payrun down` said "not running")
        c.require_home()
        conn = _maybe_redis(c.cfg)
        rows = schedule_view(c.cfg, conn)
        alive = schedulers_alive(conn) if conn is not None else None
        differ = running_entries_differ(c.cfg, conn, alive) if conn is not None and alive else []
        if as_json:
            click.echo(json.dumps({"timezone": c.cfg.timezone, "schedulers": alive, "entries": rows,
                                   "running_differs": differ}))
            return
        for r in rows:
            nl, nu = r["next_local"], r["next_utc"]
            click.echo(f"{r['name']:<12} {r['cron']:<14} {r['job']:<11} next "
                       + zone_and_utc(nl[:16].replace('T', ' '), r['zone'], nu))
            last = (f"last {zone_and_utc(_local(r['last_run'], r['zone']), r['zone'], r['last_run'], False)}: "
                    f"{r['outcome']}, {r['jobs']} job(s)" if r["last_run"] else "never run")
            if r["detail"]:
                last += f" — {r['detail']}"
            work = tick_work_text(r["jobs"], r.get("work"))
            if work:
                last += f"; {work}"
            if r["duplicates_stopped"]:
                last += f"; {r['duplicates_stopped']} duplicate run(s) stopped"
            click.echo(f"{'':<12} {last}")
            if r["due_since"]:
                from scheduler.service import window_text

                due = r["due_since"]
                click.echo(f"{'':<12} " + due_text(zone_and_utc(_local(due, r['zone']), r['zone'], due, False),
                                                   window_text(float(c.cfg.scheduler.catchup_window_s)),
                                                   alive, r.get("due_waiting")))
            if r["missed"]:
                click.echo(f"{'':<12} MISSED {r['missed']} tick(s), newest "
                           + zone_and_utc(_local(r['last_missed'], r['zone']), r['zone'], r['last_missed'])
                           + (f" — {missed_detail_text(r['missed_detail'], r.get('missed_months_not_run'))}"
                              if r.get("missed_detail") else ""))
        if differ:
            named = sorted({line.split(": ", 1)[0] for line in differ} & set(alive or []))
            if named:  # two schedules at once (a deploy restarted some schedulers): these are on another
                programs = " ".join(sorted({n.split(".", 1)[0] for n in named}))
                click.echo(f"not every scheduler runs the same schedule: {', '.join(named)} loaded another one "
                           "at its start (the file is read only then): " + "; ".join(differ) +
                           f". Restart it to use this file's (`supervisorctl restart {programs}` on its host)")
            else:
                click.echo("the schedulers running now loaded another schedule at their start (the file is read "
                           "only then): " + "; ".join(differ) + ". Restart them to use this file's "
                           "(`supervisorctl restart scheduler-a scheduler-b`, or `payrun down && payrun up`)")
        if alive is None:
            click.echo("schedulers: Redis not reachable")
        else:
            click.echo(f"schedulers alive: {len(alive)}" + (f" ({', '.join(alive)})" if alive else
                                                              (" — no tick fires until one runs: on the control host, "
                                                               "`supervisorctl start scheduler-a scheduler-b` (after "
                                                               "`eval \"$(payrun supervisor-env)\"`; `payrun up` "
                                                               "starts only programs that failed)")))

    @cli.command(name="resend")
    @click.option("--employee", "employee_id", required=True, help="Employee id, e.g. emp-00017.")
    @click.option("--month", required=True, metavar="YYYY-MM", help="The pay month of the slip.")
    @click.option("--json", "as_json", is_flag=True)
    @pass_ctx
    @handle_errors
    def resend_cmd(c, employee_id: str, month: str, as_json: bool) -> None:
        """Send an employee's slip again (HR's button): re-rendered from the current
        payroll data and sent with a new key slip:<month>:<employee>:resend-<n>, even
        though the original was sent. The slip and email say it replaces the one sent on
        <date>; when an import changed its figures since, it is a "Corrected slip"."""
        resend_refusal(c.ledger(), c.payroll(), employee_id, month)  # before c.redis(): a refused resend
        # started the embedded Redis in the background and left it running
        out = resend(c.cfg, c.redis(), c.ledger(), c.payroll(), employee_id, month)
        _audit(c.cfg, "resend", f"payrun resend --employee {employee_id} --month {month}", 1,
               f"queued resend {out['key']} (job {out['job']})")
        if as_json:
            click.echo(json.dumps(out))
        else:
            click.echo(f"queued resend {out['key']} for {out['email']} (job {out['job']}; its send: "
                       f"{out['send_job']})")
            if out["replaces"]:  # what the employee will read on it
                click.echo(f"{'a corrected slip (its figures changed since)' if out['corrected'] else 'the slip'}: "
                           f"it says it replaces the one sent on {out['replaces']}")
            if refused := refused_address_note(c.redis(), c.ledger(), employee_id, month, out["email"]):
                click.echo(f"note: {refused}")
            from payrun.status import intake_notes

            for note in intake_notes(c.redis()):  # HR promised it: say if nothing will take it (a drain too,
                                                   # though its render was taken at once)
                click.echo(f"note: {note}")

    @cli.command(name="remind")
    @click.option("--company", "company_id", type=int, default=None, help="Company id.")
    @click.option("--in", "delay", default=None, help="Delay: now, 30m, 2h, 1h30m, 45s, 2d (at most 31 days).")
    @click.option("--message", default=None, help="The reminder text (default: a bank-details reminder; with "
                  "--failed-slip, that the slip could not be emailed).")
    @click.option("--month", "pay_month", default=None, metavar="YYYY-MM",
                  help="The pay month the reminder is about (default: the month it is due in, whose pay the next "
                       "1st brings): those who left in it or later get it too, as its run pays them (their final "
                       "slip). Not with --failed-slip, which names its month.")
    @click.option("--failed-slip", "failed_slip", default=None, metavar="YYYY-MM",
                  help="Only the company's employees whose slip for YYYY-MM failed for good and was not "
                       "delivered since (the `failed` of `payrun status --month YYYY-MM`), chosen now, when "
                       "scheduled: a slip retried before the reminder is due still gets it. Slips still on "
                       "their way are not chosen.")
    @click.option("--cancel", "cancel_batch", default=None, metavar="BATCH",
                  help="Cancel a scheduled batch instead (the batch `payrun remind` printed, like "
                       "c3-20261202T180000Z): its reminders not yet due are never sent.")
    @click.option("--json", "as_json", is_flag=True)
    @pass_ctx
    @handle_errors
    def remind_cmd(c, company_id: int | None, delay: str | None, message: str | None, pay_month: str | None,
                   failed_slip: str | None, cancel_batch: str | None, as_json: bool) -> None:
        """Email every employee of a company whom the pay month's run pays a reminder (those
        working here, and those who left in that month or later: their final slip), no
        earlier than --in from now (--failed-slip M: only those whose slip for M failed). The jobs wait in RQ's
        scheduled registry (not in a sleeping worker); the send-email worker's scheduler
        moves them to the queue when due.

        `payrun remind --cancel BATCH` takes a batch back: every reminder of it due more
        than a few seconds from now is removed (job and ledger row); those already due
        are sent as planned, and the command says how many."""
        if cancel_batch is not None:
            if company_id is not None or delay is not None or message is not None or failed_slip is not None \
                    or pay_month is not None:
                raise InputError("--cancel takes no --company, --in, --message, --month or --failed-slip")
            out = cancel_reminders(c.cfg, c.redis(), c.ledger(), cancel_batch)
            _audit(c.cfg, "remind-cancel", f"payrun remind --cancel {cancel_batch}", out["cancelled"],
                   f"cancelled {out['cancelled']} reminder(s) of batch {cancel_batch}"
                   f"; {out['already_due']} already due")
            if as_json:
                click.echo(json.dumps(out))
                return
            msg = f"cancelled {out['cancelled']} reminder(s) of batch {cancel_batch}"
            if out["already_due"]:
                msg += (f"; {out['already_due']} already due (sent or being sent: "
                        f"a reminder due within {CANCEL_MARGIN_S:.0f} s is not taken back)")
            click.echo(msg)
            return
        if company_id is None or delay is None:
            raise InputError("payrun remind needs --company and --in (or --cancel BATCH)")
        from datetime import timedelta

        from scheduler.cron import parse_duration

        try:  # "now": due at once (the scheduler moves it to the queue within a few seconds)
            delta = timedelta(seconds=1) if delay.strip().lower() == "now" else parse_duration(delay)
        except ValueError as e:
            raise InputError(f"--in: {e}")
        if delta.total_seconds() < 1:
            raise InputError("--in must be at least 1s")
        if delta.total_seconds() > 31 * 86400:
            raise InputError(f"--in {delay} is more than 31 days away: schedule reminders within a month")
        if message is not None and not message.strip():
            raise InputError("--message is empty: leave it out for the default text")
        if message is not None:
            from payrun.text import message_problem, visible

            problem = message_problem(message)
            if problem:  # every employee of the company would get it: refused, nothing scheduled
                shown = visible(message[:60]) + ("…" if len(message) > 60 else "")
                raise InputError(f"--message {problem}: {shown}; nothing was scheduled")
        if pay_month is not None and failed_slip is not None:
            raise InputError(f"--failed-slip {failed_slip} names the month: leave out --month")
        if pay_month is not None:
            from payrun.runs import validate_month

            validate_month(pay_month)
        if failed_slip is not None:
            from payrun.runs import validate_month

            validate_month(failed_slip)
            # before c.redis(): a refused one would have started the embedded Redis for nothing
            failed_reminder_targets(c.ledger(), c.payroll(), company_id, failed_slip)
        out = remind(c.cfg, c.redis(), c.ledger(), c.payroll(), company_id, delta, message, failed_slip=failed_slip,
                     month=pay_month)
        import shlex

        _audit(c.cfg, "remind", f"payrun remind --company {company_id} --in {shlex.quote(delay)}"
               + (f" --failed-slip {failed_slip}" if failed_slip is not None else "")
               + (f" --month {pay_month}" if pay_month is not None else "")
               + (f" --message {shlex.quote(message)}" if message is not None else ""), out["scheduled"],
               f"scheduled {out['scheduled']} reminder(s) for {out['due_at']} (batch {out['batch']})")
        if as_json:
            click.echo(json.dumps(out))
        else:
            from datetime import datetime
            from zoneinfo import ZoneInfo

            if gone := out.get("left_out_left"):  # (an HR walkthrough: the count was less than `failed`, unsaid)
                from payrun import payroll

                dates = payroll.left_on(c.payroll(), gone)
                click.echo(f"note: {len(gone)} whose {failed_slip} slip failed {'is' if len(gone) == 1 else 'are'} "
                           f"marked as left before {failed_slip} (or on a day not recorded) and "
                           f"get{'s' if len(gone) == 1 else ''} no reminder: "
                           + " ".join(f"{e} ({payroll.left_label(dates.get(e))})" for e in gone[:10])
                           + (" …" if len(gone) > 10 else ""))
            if finals := out.get("leavers"):  # (their final month: the reminder of its payday reaches them)
                from payrun import payroll

                dates = payroll.left_on(c.payroll(), finals)
                gets = "gets" if len(finals) == 1 else "get"
                click.echo(f"note: {len(finals)} who left in {out['month']} or later {gets} it too (the "
                           f"{out['month']} run pays them: their final slip): "
                           + " ".join(f"{e} ({payroll.left_label(dates.get(e))})" for e in finals[:10])
                           + (" …" if len(finals) > 10 else ""))
            due = datetime.fromisoformat(out["due_at"])
            local = due.astimezone(ZoneInfo(c.cfg.timezone))
            whose = f" (employees whose {failed_slip} slip failed)" if failed_slip else ""
            click.echo(f"{out['scheduled']} reminder(s) for company {company_id}{whose} scheduled for "
                       + zone_and_utc(f"{local:%Y-%m-%d %H:%M:%S}", c.cfg.timezone,
                                      due.astimezone(ZoneInfo("UTC")).isoformat(), False)
                       + f" (batch {out['batch']}); "
                       "`payrun queues` counts them as later until then")
            # (an HR walkthrough: the batch was named, not how to take it back; that was in --help alone)
            if delta.total_seconds() > CANCEL_MARGIN_S:  # (`--in now`: due at once, nothing to take back)
                click.echo(f"to take them back before they are due: payrun remind --cancel {out['batch']}")
            if same := out.get("same_address"):
                click.echo(f"note: {same_address_text(same, failed_slip, out.get('same_address_refused', 0))}")

    @cli.command(name="bank")
    @click.option("--host", default=None, help="Listen address (default: from scheduler.bank_url).")
    @click.option("--port", type=click.IntRange(1, 65535), default=None,
                  help="Port (default: from scheduler.bank_url, 8026).")
    @pass_ctx
    @handle_errors
    def bank_cmd(c, host: str | None, port: int | None) -> None:
        """Serve the simulated payroll bank: GET /v1/credits?month=M&company=ID answers
        whether each employee's salary reached the account (from the payroll database)."""
        from urllib.parse import urlsplit

        from payrun import redis_server
        from scheduler.bank import Bank

        u = urlsplit(c.cfg.scheduler.bank_url)
        _setup_logging()
        where = (host or u.hostname or "127.0.0.1", port if port is not None else (u.port or 8026))
        try:
            bank = Bank(c.cfg.payroll_path, *where, token=redis_server.local_secret(c.cfg, "bank-token"))
        except OSError as e:  # (it said "cannot listen" without where: the provider's line beside it did)
            taken = " (another payrun's bank? give this one another port in scheduler.bank_url)" \
                if e.errno == errno.EADDRINUSE else ""
            raise InputError(f"cannot listen on {where[0]}:{where[1]}: {e}{taken}")
        bank.serve_forever()


def _audit(cfg, what: str, command: str, count: int, message: str) -> None:
    """HR's actions that email employees go to the audit log, as retries and drains do."""
    from payrun import audit

    audit.audit(cfg, audit.Outcome(what, command, count, message=message), via="cli")


# ---- the one-off and delayed jobs ----------------------------------------------------

def resend_refusal(ledger, db, employee_id: str, month: str) -> dict:
    """Raise InputError if this slip cannot be sent again (bad month, no such employee or
    salary line, no slip made yet); else the employee's snapshot. Needs no Redis."""
    from payrun import payroll
    from payrun.runs import validate_month

    validate_month(month)
    if no_line := _no_salary_line(ledger, db, employee_id, month):
        from payrun.errors import InputError

        raise InputError(no_line)
    snap = payroll.employee_snapshot(db, month, employee_id)
    if not ledger.has_slip_job(employee_id, month):
        # a resend sent before the run would be followed by the run's own slip: two emails,
        # and `status` would count neither until the run
        from payrun.errors import InputError

        company = snap["company"]["id"]
        day = payroll.left_on(db, [employee_id]).get(employee_id)
        if payroll.is_active(db, employee_id) is False and not payroll.in_month_run(False, day, month) \
                and any(r["company_id"] == company for r in ledger.runs(month)):
            # (an HR walkthrough: it said "added after the run ... --resume makes the slip" of a
            # leaver the late run left out, and `--resume` leaves them out again)
            gone = payroll.left_label(day)
            raise InputError(f"{employee_id} has no {month} slip to send again: they are marked as left "
                             f"(`payrun employee left`; {gone}), before {month} or on a day not recorded, so company "
                             f"{company}'s {month} run left them out; worked in {month}: `payrun employee left "
                             f"{employee_id} --on DATE` (the day they left, {month}-01 or later), then `payrun run "
                             f"--month {month} --company {company} --resume`")
        if any(r["company_id"] == company for r in ledger.runs(month)):
            raise InputError(f"{employee_id} has no {month} slip to send again: company {company}'s {month} run "
                             f"was made before this employee was added; `payrun run --month {month} "
                             f"--company {company} --resume` makes the slip")
        raise InputError(f"{employee_id} has no {month} slip to send again: {month} has not been run for company "
                         f"{company}; `payrun run --month {month} --company {company}` makes and sends it")
    return snap


def _no_salary_line(ledger, db, employee_id: str, month: str) -> str | None:
    """Why a known employee with no salary line for ``month`` has no slip to send again, and
    what makes one; None if they have that line (or are not known: the snapshot says so).
    A fresh-clone walkthrough (session 43): `resend` of such an employee said only "has no
    salary line for 2026-12", with no word on what to do."""
    from payrun import payroll

    row = db.conn.execute("SELECT company_id FROM employees WHERE id = ?", (employee_id,)).fetchone()
    if row is None or db.conn.execute("SELECT 1 FROM salary_lines WHERE employee_id = ? AND month = ?",
                                      (employee_id, month)).fetchone():
        return None
    company = row[0]
    run = (f"`payrun run --month {month} --company {company} --resume`"
           if any(r["company_id"] == company for r in ledger.runs(month))
           else f"`payrun run --month {month} --company {company}`")
    head = (f"{employee_id} has no salary line for {month}, so no {month} slip was made for them and there is "
            f"none to send again")
    if payroll.is_active(db, employee_id) is False:
        day = payroll.left_on(db, [employee_id]).get(employee_id)
        return (f"{head} (they are marked as left: {payroll.left_label(day)}); paid that month: import the "
                f"salary line (`payrun import FILE.csv`), `payrun employee back {employee_id}`, {run}, then "
                f"{payroll.left_again([employee_id], {employee_id: day})}")
    return f"{head}; paid that month: import the salary line (`payrun import FILE.csv`), then {run} makes and sends it"


def refused_address_note(conn, ledger, employee_id: str, month: str, to: str) -> str | None:
    """`payrun resend` to the very address this slip's send was refused at for good (an HR
    walkthrough: a resend of a slip refused for a mistyped address went there again, with
    no word, and failed again): what to do instead. None otherwise."""
    from payrun import keys
    from payrun.deadletters import refused_for_good

    send = ledger.send_of(keys.idem_key(month, employee_id))
    if send is None or send[1] != to or not refused_for_good(conn, [send[0]]):
        return None
    return (f"its {month} slip's send ({send[0]}) was refused at this very address, {to}: this resend will be "
            f"refused too; fix the address (`payrun import`), then `payrun retry {send[0]}` sends the slip to the "
            f"new one")


def resend(cfg, conn, ledger, db, employee_id: str, month: str) -> dict:
    from jobs import idempotency
    from jobs.runtime import make_queue
    from payrun import keys

    from jobs import oneoff

    snap = resend_refusal(ledger, db, employee_id, month)
    queue = make_queue(keys.RENDER_QUEUE, conn)
    while True:  # n: a counter in Redis; never reuse a key that exists
        n = int(conn.incr(f"payrun:resend:{month}:{employee_id}"))
        key = f"{keys.idem_key(month, employee_id)}:resend-{n}"
        job_id = oneoff.resend_render_job_id(month, employee_id, n)
        if not idempotency.state(conn, key) and not conn.exists(queue.job_class.key_for(job_id)) \
                and ledger.job(job_id) is None:
            break
    snap["key"] = key
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from jobs.policy import reissue_marks
    from payrun import payroll

    zone = ZoneInfo(cfg.timezone)
    # the slip and email say it replaces the one delivered on <date>, corrected if an import
    # changed its figures since (HR walkthrough: a corrected slip read as the wrong one did)
    snap.update(reissue_marks(datetime.now(zone).strftime("%Y-%m-%d"), ledger.delivered_at(keys.idem_key(month, employee_id)),
                              payroll.corrected_at(db, month, employee_id),
                              lambda iso: datetime.fromisoformat(iso).astimezone(zone).strftime("%Y-%m-%d")))
    ledger.create_jobs([{"id": job_id, "kind": "resend", "company_id": snap["company"]["id"],
                         "employee_id": employee_id, "month": month, "key": key, "queue": keys.RENDER_QUEUE}])
    retry = cfg.render.retry
    from rq import Retry

    queue.enqueue_call("jobs.oneoff.resend_slip", args=(snap,), job_id=job_id, timeout=cfg.render.timeout_s,
                       retry=Retry(max=retry.attempts - 1) if retry.attempts > 1 else None,
                       result_ttl=24 * 3600, failure_ttl=30 * 24 * 3600, description=f"resend slip {key}",
                       meta={"kind": "resend", "key": key, "company": snap["company"]["id"], "retry": vars(retry)})
    return {"job": job_id, "key": key, "n": n, "email": snap["employee"]["email"], "month": month,
            "employee": employee_id, "send_job": oneoff.resend_email_job_id(month, employee_id, n),
            "replaces": snap.get("replaces"), "corrected": bool(snap.get("corrected"))}


BATCH_RE = re.compile(r"c[0-9]+-[0-9]{8}T[0-9]{6}Z")
CANCEL_MARGIN_S = 5.0
"""A reminder due sooner than this is not cancelled: the send-email worker's scheduler may
be moving it to the queue already (it takes only reminders that are due)."""
CANCEL_CHUNK = 1000
# KEYS[1]: RQ's scheduled registry; ARGV[1]: the horizon, ARGV[2..]: job ids. Each id still
# scheduled after the horizon is removed, and returned: the removal owns the reminder.
_TAKE_BACK = """
local out, horizon = {}, tonumber(ARGV[1])
for i = 2, #ARGV do
  local at = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if at and tonumber(at) > horizon then
    redis.call('ZREM', KEYS[1], ARGV[i])
    out[#out + 1] = ARGV[i]
  end
end
return out
"""


def cancel_reminders(cfg, conn, ledger, batch: str, now: float | None = None) -> dict:
    """Take back the reminders of ``batch`` not yet due: each is removed from RQ's scheduled
    registry (the removal that succeeds owns it), then its job and ledger row go. Those due
    within CANCEL_MARGIN_S, or moved on already, are left to be sent."""
    import time

    from jobs.runtime import make_queue
    from payrun import keys

    if not BATCH_RE.fullmatch(batch or ""):
        raise InputError(f"--cancel {batch!r}: a batch looks like c3-20261202T180000Z "
                         "(as `payrun remind` printed it, or the audit log)")
    ids = ledger.reminder_ids(batch)
    if not ids:
        raise InputError(f"no reminder batch {batch} (none scheduled, or cancelled already)")
    queue = make_queue(keys.EMAIL_QUEUE, conn)
    registry = queue.scheduled_job_registry.key
    horizon = (time.time() if now is None else now) + CANCEL_MARGIN_S
    take_back = conn.register_script(_TAKE_BACK)
    cancelled: list[str] = []
    for i in range(0, len(ids), CANCEL_CHUNK):  # one round trip per chunk, not two per reminder
        chunk = ids[i:i + CANCEL_CHUNK]
        cancelled += [j.decode() if isinstance(j, bytes) else j
                      for j in take_back(keys=[registry], args=[repr(horizon), *chunk])]
    due = len(ids) - len(cancelled)
    if cancelled:
        with conn.pipeline(transaction=False) as p:
            for job_id in cancelled:
                p.delete(queue.job_class.key_for(job_id))
                p.zrem(keys.delayed(keys.EMAIL_QUEUE), job_id)
            p.execute()
        ledger.remove_jobs(cancelled)
    return {"batch": batch, "cancelled": len(cancelled), "already_due": due, "jobs": cancelled}


def failed_reminder_targets(ledger, db, company_id: int, month: str) -> dict[str, str | None]:
    """`payrun remind --failed-slip`: the company's employees whose ``month`` slip failed for
    good (Ledger.failed_slips), less those marked left before ``month`` or on a day not
    recorded (a leaver of that month is reached: it was their final slip); employee id ->
    the address their slip's send was made with. InputError when there are none (nothing to schedule)."""
    from payrun import payroll

    failed = ledger.failed_slips(month, company_id)
    # those the month paid: working here, or left in it or later (their final slip failed)
    active = {r[0] for r in db.conn.execute(
        f"SELECT id FROM employees e WHERE {payroll.in_month_run_sql('?')} AND id IN ({','.join('?' * len(failed))})",
        [month, *failed])} if failed else set()
    chosen = {e: to for e, to in failed.items() if e in active}
    if not chosen:
        from payrun import payroll

        dates = payroll.left_on(db, sorted(failed))  # (named with the day they left, as run and status do)
        left = (f" ({len(failed)} failed, of employees marked left before {month} or on a day not recorded: "
                + " ".join(f"{e} ({payroll.left_label(dates.get(e))})" for e in sorted(failed)[:10])
                + (" …" if len(failed) > 10 else "") + ")") if failed else ""
        raise InputError(f"no employee of company {company_id} has a {month} slip that failed for good{left}: "
                         f"nothing scheduled (`payrun status --month {month} --company {company_id}`)")
    return chosen


def same_address_text(n: int, month: str, refused: int = 0) -> str:
    """The note of `remind --failed-slip` for reminders going to the address their slip's
    send failed at (the payroll data has no other one since); ``refused`` of them were
    refused there for good (the address itself: their reminders will be refused too)."""
    one = n == 1
    fix = (f"fix the address (`payrun import`), then `payrun retry` sends the slip itself "
           f"(`payrun failed --month {month}`)")
    if refused == n:  # (an HR walkthrough: "if it was refused" of slips payrun knew were refused)
        return (f"{n} of them {'goes' if one else 'go'} to the address {'its' if one else 'their'} {month} slip was "
                f"refused at (not changed since): {'it' if one else 'they'} will be refused too and reach no one; "
                f"{fix}")
    if refused:
        return (f"{n} of them go to the address their {month} slip's send failed at (not changed since), {refused} "
                f"of those to an address refused for good (their reminders will be refused too); {fix}")
    return (f"{n} of them {'goes' if one else 'go'} to the address {'its' if one else 'their'} {month} slip's send "
            f"failed at (not changed since): if it was refused, so will the reminder be; {fix}")


def failed_slip_text(company_name: str, month: str) -> str:
    """The default text of `remind --failed-slip`."""
    from jobs.tasks import month_label

    return (f"This is a message from {company_name} payroll: we could not email you your salary slip for "
            f"{month_label(month)}. Please contact the HR department to check the email address we have "
            "for you, so that we can send it again.")


def reminder_month(due, tz: str) -> str:
    """The pay month a reminder due at ``due`` (an aware datetime) is about, unless HR names
    one (`remind --month`): the month it is due in, in the configured zone; its pay comes
    with the next 1st's run (the default bank-details reminder is "before payday"). Pure."""
    from zoneinfo import ZoneInfo

    return due.astimezone(ZoneInfo(tz)).strftime("%Y-%m")


def remind(cfg, conn, ledger, db, company_id: int, delta, message: str | None, now=None,
           failed_slip: str | None = None, month: str | None = None) -> dict:
    """Schedule one reminder email per employee of ``company_id`` whom ``month``'s run pays
    (payroll.in_month_run: working here, or left in that month or later, whose final slip
    it is; ``month`` None: :func:`reminder_month`), due ``delta`` from ``now`` (a UTC
    datetime; default the current time); with ``failed_slip`` (a month), only those whose
    slip of it failed for good (failed_reminder_targets). The batch is named by the company
    and the due second; a second batch for the same company and second is refused (nothing
    written): its jobs would have replaced the first one's, silently. Before session 43 a
    leaver got none even in their final month, whose payday the reminder is about."""
    from datetime import datetime, timezone

    from rq import Retry

    from jobs.runtime import make_queue
    from payrun import keys

    company = db.conn.execute("SELECT name FROM companies WHERE id = ?", (company_id,)).fetchone()
    if company is None:
        raise InputError(f"no company {company_id} in the payroll database")
    from payrun import payroll

    due = (now or datetime.now(timezone.utc)) + delta
    month = failed_slip or month or reminder_month(due, cfg.timezone)  # (--failed-slip: those its month paid)
    employees = db.conn.execute(f"SELECT e.id, e.name_en, e.email, e.active FROM employees e WHERE e.company_id = ? "
                                f"AND {payroll.in_month_run_sql('?')} ORDER BY e.id", (company_id, month)).fetchall()
    if not employees:
        raise InputError(f"company {company_id} has no employee working here or who left in {month} or later")
    finals = [emp_id for emp_id, _, _, active in employees if not active]
    employees = [(emp_id, name, email) for emp_id, name, email, _ in employees]
    name = company[0]
    sent_with: dict[str, str | None] = {}
    if failed_slip is not None:  # (the slip's company: an employee moved since is chosen by it)
        sent_with = failed_reminder_targets(ledger, db, company_id, failed_slip)
        from payrun import payroll

        # the failed slips of employees marked left get none: named, with the day they left
        gone = payroll.left_on(db, sorted(set(ledger.failed_slips(failed_slip, company_id)) - set(sent_with)))
        employees = db.conn.execute(
            f"SELECT id, name_en, email FROM employees WHERE id IN ({','.join('?' * len(sent_with))}) ORDER BY id",
            list(sent_with)).fetchall()
    batch = f"c{company_id}-{due.strftime('%Y%m%dT%H%M%SZ')}"
    if ledger.reminder_ids(batch):
        raise InputError(f"a reminder batch {batch} is already scheduled for company {company_id} at that "
                         f"second; run again a second later for another one, or `payrun remind --cancel {batch}` "
                         "first to replace it")
    subject = f"Reminder from {name} payroll"
    text = message or (failed_slip_text(name, failed_slip) if failed_slip else
                       f"This is a reminder from {name} payroll: please check that your bank account details "
                       f"are up to date before payday.")
    queue = make_queue(keys.EMAIL_QUEUE, conn)
    retry = cfg.email.retry
    rows, ids = [], []
    for emp_id, emp_name, email in employees:
        job_id = f"remind-{batch}-{emp_id}"
        key = f"remind:{batch}:{emp_id}"
        payload = {"key": key, "to": email, "to_name": emp_name, "employee_id": emp_id, "company_name": name,
                   "subject": subject, "text": f"Dear {emp_name},\n\n{text}\n", "due_at": due.isoformat()}
        rows.append({"id": job_id, "kind": "reminder", "company_id": company_id, "employee_id": emp_id,
                     "key": key, "queue": keys.EMAIL_QUEUE, "recipient": email})  # (`payrun job` names it)
        ids.append((job_id, payload, key))
    ledger.create_jobs(rows)
    with conn.pipeline(transaction=False) as p:  # counted as "later", not as retrying (payrun queues)
        p.zadd(keys.delayed(keys.EMAIL_QUEUE), {job_id: due.timestamp() for job_id, _, _ in ids})
        p.zremrangebyscore(keys.delayed(keys.EMAIL_QUEUE), "-inf", datetime.now(timezone.utc).timestamp() - 86400)
        p.execute()
    for job_id, payload, key in ids:
        queue.enqueue_at(due, "jobs.oneoff.send_reminder", payload, job_id=job_id, job_timeout=cfg.email.timeout_s,
                         retry=Retry(max=retry.attempts - 1) if retry.attempts > 1 else None,
                         result_ttl=24 * 3600, failure_ttl=30 * 24 * 3600, description=f"reminder {key}",
                         meta={"kind": "email", "key": key, "retry": vars(retry)})
    out = {"company": company_id, "scheduled": len(ids), "due_at": due.isoformat(timespec="seconds"),
           "batch": batch, "jobs": [i[0] for i in ids]}
    if failed_slip is None:
        out["month"] = month
        out["leavers"] = finals  # (left in the month or later: the month's run pays them, their final slip)
    if failed_slip is not None:
        out["failed_slip"] = failed_slip
        out["left_out_left"] = sorted(gone)  # (marked `payrun employee left`: no reminder)
        same = [emp_id for emp_id, _, email in employees if sent_with.get(emp_id) == email]
        out["same_address"] = len(same)
        from payrun.deadletters import refused_for_good

        # of those, the ones whose send was refused for good there (the address itself)
        out["same_address_refused"] = len(refused_for_good(conn, [keys.email_job_id(failed_slip, e) for e in same]))
    return out
