"""The HR view: slips per company and in total, from the ledger.

A slip is ``done`` when its email was delivered, ``failed`` when its render or its send
failed for good, otherwise in the state of its current job; ``stuck`` counts slips whose
job has been running longer than lease.stuck_after_s (10 minutes by default), or whose
worker is gone or lease lapsed in Redis (the reaper returns those within seconds).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from payrun import keys
from payrun.config import Config
from payrun.errors import InputError
from payrun.text import visible
from payrun.ledger import LEDGER_STALE_S, STATES, Ledger, backlog, backlog_age_s


def _company_names(cfg: Config) -> dict[int, str]:
    if not cfg.payroll_path.exists():
        return {}
    from payrun import payroll

    with payroll.PayrollDB(cfg.payroll_path) as db:
        return {int(c["id"]): c["name"] for c in payroll.companies(db)}


def missed_run_text(month: str, tick: str, tz: str) -> str:
    """The note on a pay month whose cron tick was missed and that was not run since."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    at = datetime.fromisoformat(tick).astimezone(ZoneInfo(tz))
    return (f"the {month} pay run has not run: its cron tick of {at:%Y-%m-%d %H:%M} {tz} was missed (no scheduler "
            f"ran within the catch-up window; `payrun schedule`): run it by hand: `payrun run --month {month}`")


def check_run_month(months: list[str], month: str, missed: dict[str, str] | None = None, tz: str = "UTC") -> None:
    """``month`` well formed and run (one of ``months``, the ledger's), or InputError;
    ``missed``: pay months whose cron tick was missed (month -> tick), named as such."""
    from payrun.runs import validate_month

    validate_month(month)
    if month not in months:
        if missed and month in missed:
            raise InputError(f"no pay run for {month}: " + missed_run_text(month, missed[month], tz).split(": ", 1)[1])
        # (an HR walkthrough: a month missed read "no pay run for 2026-10 (runs: 2026-11)", no way on)
        raise InputError(f"no pay run for {month}" + (f" (runs: {', '.join(months[-12:])})" if months else "")
                         + f": `payrun run --month {month}` starts it")


def report(cfg: Config, ledger: Ledger, month: str | None = None, company: int | None = None,
           conn=None) -> dict[str, Any]:
    from scheduler.store import missed_pay_months

    months = ledger.months()
    missed = missed_pay_months(ledger.db.conn, set(months))  # (a tick missed: the month is not run)
    if month is None:
        month = ledger.latest_month()
    else:
        check_run_month(months, month, missed, cfg.timezone)
    counts = ledger.slip_counts(month, company) if month else {}
    # employees paid this month with no slip: added after their company's run (missing),
    # or of a company no run of the month covered (not_run); "all sent" must not hide them
    missing: dict[int, int] = {}
    not_run: dict[int, int] = {}
    unpaid: dict[int, list[str]] = {}  # the month's employees of the run's companies with no salary line
    unpaid_named: list[str] = []  # the first ten of them, a leaver with the day they left
    left: dict[int, list[str]] = {}  # employees marked left with a salary line and no slip
    left_dates: dict[str, str | None] = {}  # the day each of them left (as the note names them)
    readdressed: list[str] = []  # failed slips' employees with another address on file since
    finals: dict[int, list[str]] = {}  # of `missing`, leavers the month pays (their final slip) the run left out
    final_dates: dict[str, str | None] = {}
    if month and cfg.payroll_path.exists():
        from payrun import payroll
        from payrun.runs import missing_slip_ids, not_run as runs_not_run

        with payroll.PayrollDB(cfg.payroll_path) as db:
            not_run = runs_not_run(ledger, db, month, company)
            missing_ids = {c: ids for c, ids in missing_slip_ids(ledger, db, month).items()
                           if company is None or c == company}
            missing = {c: len(ids) for c, ids in missing_ids.items()}
            final_dates = payroll.left_on(db, sorted(e for ids in missing_ids.values() for e in ids))
            finals = {c: sorted(ids & set(final_dates)) for c, ids in missing_ids.items() if ids & set(final_dates)}
            unpaid = payroll.without_salary_line(db, month, [c for c in sorted(counts)
                                                             if company is None or c == company],
                                                 ledger.employees_with_jobs(month))
            left = payroll.left_with_salary_line(db, month, [c for c in sorted(counts)
                                                             if company is None or c == company],
                                                 ledger.employees_with_jobs(month))
            left_dates = payroll.left_on(db, [e for ids in left.values() for e in ids])
            unpaid_named = payroll.with_leaving_dates(db, [e for cid in sorted(unpaid) for e in unpaid[cid]][:10])
            # failed slips whose send's address HR has changed since (an HR walkthrough: after the
            # import that fixed it, the note still said "fix it with `payrun import`")
            readdressed = readdressed_failed(ledger, db, month, [c for c in sorted(counts)
                                                                 if counts[c].get("failed") and
                                                                 (company is None or c == company)])
    if month and company is not None and company not in counts and company not in not_run:
        known = sorted(ledger.slip_counts(month, None))
        if cfg.payroll_path.exists() and company not in _company_names(cfg):
            raise InputError(f"no company {company} in the payroll database"
                             + (f" (companies in the {month} run: {', '.join(map(str, known[:20]))}"
                                f"{' …' if len(known) > 20 else ''})" if known else ""))
        raise InputError(f"company {company} has no slips in the {month} run and no salary lines for {month}"
                         + (f" (companies: {', '.join(map(str, known[:20]))}{' …' if len(known) > 20 else ''})"
                            if known else ""))
    redis_failed = False
    redis_stuck: list[str] = []
    if month:
        if conn is not None:
            from jobs.reaper import find_stuck

            try:
                redis_stuck = [s.job_id for s in find_stuck(conn)]
            except Exception:  # Redis unreachable: the ledger's own rule still applies
                redis_stuck, redis_failed = [], True
        for job_id, cid in ledger.stuck_jobs(month, cfg.lease.stuck_after_s, redis_stuck).items():
            if cid in counts and (company is None or cid == company):
                counts[cid]["stuck"] += 1
    names = _company_names(cfg)
    zero = {s: 0 for s in STATES} | {"stuck": 0, "total": 0}
    total = dict(zero)
    companies = []
    for cid in sorted(counts):
        row = counts[cid]
        for k in total:
            total[k] += row.get(k, 0)
        companies.append({"id": cid, "name": names.get(cid, f"company {cid}"), **row})
    in_progress = total["queued"] + total["running"] + total["retrying"]
    lag, lag_age, notes = None, None, []
    notes += [missed_run_text(m, t, cfg.timezone) for m, t in sorted(missed.items()) if m > (month or "")]
    if month and redis_stuck:  # (an ops drill: the reaper stopped, a killed sender's 33 jobs held for 4 min, no note)
        n = len(redis_stuck)
        notes.append(f"{n:,} job{'s are' if n != 1 else ' is'} held by workers that are gone (or whose lease "
                     "lapsed): the reaper returns them within seconds; if this stays, is it running? (`payrun ps`: "
                     "reaper); `payrun reap` returns them now")
    for cid, n in sorted(not_run.items()):  # in the table too: everyone paid this month has a row
        companies.append({"id": cid, "name": names.get(cid, f"company {cid}"), **zero})
        missing[cid] = n
    total["no_slip"] = sum(missing.values())
    total["no_salary_line"] = sum(map(len, unpaid.values()))
    total["no_slip_final"] = sum(map(len, finals.values()))  # (of no_slip: leavers' final slips the run left out)
    for c in companies:
        c["no_slip"] = missing.get(c["id"], 0)
        c["no_slip_final"] = len(finals.get(c["id"], ()))
        c["no_salary_line"] = len(unpaid.get(c["id"], ()))
    if unpaid:  # (an HR drill: an employee with no November line read as "299 sent, 0 failed")
        n = total["no_salary_line"]
        ids = [e for cid in sorted(unpaid) for e in unpaid[cid]]
        shown = " ".join(unpaid_named) + (f" … ({n - 10:,} more: `--json`)" if n > 10 else "")
        notes.append(f"{n:,} employee{'' if n == 1 else 's'} of "
                     f"{'company' if len(unpaid) == 1 else 'companies'} {', '.join(map(str, sorted(unpaid)))} "
                     f"{'has' if n == 1 else 'have'} no salary line for {month}, so no slip was made: {shown}. "
                     f"Paid this month: import the salary line, then `payrun run --month {month} --resume`; "
                     f"gone before {month}: `payrun employee left ID… --on DATE`")
    if left:  # (an HR walkthrough: a missed October run after an October leaver was marked left)
        from payrun.payroll import left_text

        notes.append(left_text(left, month, left_dates))
    if not_run:
        n = sum(not_run.values())
        ids = sorted(not_run)
        notes.append(f"{'company' if len(ids) == 1 else 'companies'} {', '.join(map(str, ids))} "
                     f"({n:,} employee{'' if n == 1 else 's'}) {'has' if len(ids) == 1 else 'have'} salary lines "
                     f"for {month} and {'was' if len(ids) == 1 else 'were'} never run: payrun run --month {month}"
                     + (f" --company {ids[0]}" if len(ids) == 1 else ""))
    if finals:  # (they read "added after the run", which they were not: session 43)
        from payrun.payroll import final_missing_text

        notes.append(final_missing_text([e for c in sorted(finals) for e in finals[c]], month, final_dates,
                                        sorted(finals)))
    late = {c: n - len(finals.get(c, ())) for c, n in missing.items() if c not in not_run}
    late = {c: n for c, n in late.items() if n}
    if late:
        n_late = sum(late.values())
        notes.append(f"{n_late:,} employee{'' if n_late == 1 else 's'} of "
                     f"{'company' if len(late) == 1 else 'companies'} {', '.join(map(str, sorted(late)))} "
                     f"{'has' if n_late == 1 else 'have'} "
                     f"salary lines for {month} and no slip (added after the run): "
                     f"payrun run --month {month} --resume")
    if month and (n_failed := total.get("failed", 0)):  # (an HR walkthrough: "3 failed" and not a word on who)
        host = min(n_failed, ledger.failed_on_host_trouble(month, company))
        why = []
        if host:  # (a full slip store's were said to be "an address refused": session-42 drill)
            why.append(f"{'all' if host == n_failed else f'{host:,}'} on the host's trouble, not their data (a full "
                       f"or failing disk, Redis refusing writes): fix that, then `payrun retry --all --month {month}`")
        fixed = min(len(readdressed), n_failed - host)
        if fixed:
            ids = [keys.email_job_id(month, e) for e in readdressed]
            why.append(f"{'all' if fixed == n_failed else f'{fixed:,}'} with another address on file since the send: "
                       f"`payrun retry {' '.join(ids[:5])}{' …' if len(ids) > 5 else ''}` sends "
                       f"{'it' if fixed == 1 else 'them'} to the new one")
        if host + fixed < n_failed:
            why.append(f"{'' if not (host or fixed) else 'the rest: '}an address refused: fix it with "
                       "`payrun import`, then `payrun retry`")
        notes.append(f"{n_failed:,} slip{'' if n_failed == 1 else 's'} of {month} failed for good and "
                     f"{'was' if n_failed == 1 else 'were'} not delivered: `payrun failed --month {month}"
                     + (f" --company {company}" if company is not None else "")
                     + f"` names each employee and why ({'; '.join(why)})")
    if month and (n_resend := ledger.failed_resends(month, company)):
        notes.append(f"{n_resend:,} resend{'' if n_resend == 1 else 's'} (`payrun resend`) of {month} failed for "
                     f"good, not counted above (a slip counts once, sent by its first email): "
                     f"payrun failed --month {month}")
    from jobs import unrecorded

    if waiting := [e for e in unrecorded.pending(cfg.home) if f":{month}:" in str(e.get("key"))]:
        notes.append(f"{len(waiting):,} slip{'' if len(waiting) == 1 else 's'} delivered while Redis could not record "
                     f"{'it' if len(waiting) == 1 else 'them'} ({', '.join(str(e['key']) for e in waiting[:3])}"
                     f"{' …' if len(waiting) > 3 else ''}): noted on this host ({unrecorded.FILE}); this host's "
                     "send-email process records them within seconds of Redis answering (is it running? payrun "
                     "ps), and a next try here sends nothing")
    # a full or unwritable store holds renders only: with every slip of the run made and only
    # sends left (they read slips), it holds nothing of it, as the console's ETA says
    rendering = bool(month and in_progress and ledger.renders_left(month, company))
    idle_faults: list[str] = []  # (a fault holding none of the run: after what does)
    if rendering and (full := store_full_note(cfg.slips_dir)):
        notes.insert(0, full)
    if month and in_progress:  # (read-only, a failing disk: its renders wait, spending no attempt)
        from payrun import slipstore

        faults = slipstore.fault_notes(None if redis_failed else conn, cfg.slips_dir, cfg.timezone,
                                       sends_only=None if rendering else month, company=company,
                                       others_rendering=0 if rendering or company is None else
                                       ledger.renders_left(month))
        if rendering:
            notes[:0] = faults
        else:  # (session 44: still the first note, "its renders wait", with only sends left): last
            idle_faults = faults
    outage = refused = None
    paused: list[dict[str, Any]] = []
    if conn is not None and not redis_failed:
        from payrun import redis_server

        if (refused := redis_server.refusal(conn)) is not None:
            notes.insert(0, redis_server.refusal_text(refused, cfg))
        try:
            lag, lag_age = backlog(conn), round(backlog_age_s(conn), 1)
            intake = intake_notes(conn, waiting_only=not in_progress)  # (a resend waits too)
            if refused is not None:  # the workers are up, waiting for Redis to take writes: no record of
                intake = [n for n in intake if "worker is running" not in n]  # them to find (a drill read "is
            notes += intake                                                   # `payrun up` running?")
            if any("worker is running" in n for n in notes):
                notes[:] = starting_notes(cfg, notes)
            if any("worker is running" in n for n in notes) and (given_up := programs_given_up(cfg)):
                notes.append(f"supervisord gave up on {', '.join(given_up[:6])}{' …' if len(given_up) > 6 else ''} "
                             f"(FATAL: each failed its start again and again; `payrun ps`, their logs in "
                             f"{cfg.log_dir}): fix the cause (a config typo, a full disk), then `payrun up` "
                             f"starts them again")
            from jobs.senders import read_refused

            now_ms = time.time() * 1000  # (a send-email process paused for its own credentials: status
            paused = [dict(r, paused_s=round(max(0.0, now_ms - r["since_ms"]) / 1000, 1))  # said nothing;
                      for r in read_refused(conn, now_ms=now_ms)]  # workers, check and the console did)
            notes += [paused_sender_text(r, cfg.timezone, now_ms) for r in paused]
            from jobs.limits import read_outage

            outage = read_outage(conn)
            if outage and outage["pauses"]:
                notes.insert(0, outage_text(outage, cfg.timezone))
            elif (pause_ms := conn.pttl(keys.limit_pause("email"))) and pause_ms > 0:
                notes.insert(0, f"the email provider answered 429 (over its rate limit): every sender waits out "
                                f"its Retry-After ({pause_ms / 1000:.0f} s left); sending resumes by itself and "
                                f"no attempt is spent (`payrun limits show` counts the 429s)")
        except (RedisError, OSError):  # it went away after the first look: say so, as if never there
            conn, outage, paused = None, None, []
    notes += idle_faults
    salary_months: list[str] = []
    if not month and cfg.payroll_path.exists():  # nothing run yet: which months could be
        from payrun import payroll

        with payroll.PayrollDB(cfg.payroll_path) as db:
            salary_months = payroll.months(db)
    return {
        "month": month,
        "salary_months": salary_months,
        "total": total,
        "companies": companies,
        "ledger_backlog": lag,
        "ledger_backlog_age_s": lag_age,
        "redis_reachable": conn is not None and not redis_failed,
        "redis_refuses_writes": refused is not None,
        "notes": notes,
        "no_salary_line": [e for cid in sorted(unpaid) for e in unpaid[cid]],
        "months": months,
        "provider_outage": outage,
        "paused_senders": paused,
    }


def store_full_note(store: Path, free: int | None = None) -> str | None:
    """The note for a slip store with no room for a slip (jobs.policy.STORE_ROOM_MIN_BYTES),
    None otherwise. In the session-42 drill `payrun status` said nothing of it: only slips
    "in progress", then failed for good, under a note that blamed their addresses."""
    from jobs.policy import STORE_ROOM_MIN_BYTES
    from payrun import diskspace

    if free is None:
        if not store.is_dir():
            return None
        free = diskspace.free_bytes(store)
    if free is None or free >= STORE_ROOM_MIN_BYTES:
        return None
    return (f"the slip store {store} is full ({diskspace.size_text(free)} free): every render waits, spending no "
            f"attempt, and the run goes on by itself once there is room: free space there (`df -h {store}`; "
            f"`payrun prune --before YYYY-MM --slips` removes old months' slips)")


def paused_sender_text(r: dict[str, Any], tz: str, now_ms: float) -> str:
    """The note on a send-email process paused because the provider refuses its own
    credentials while other send-email processes send (jobs.senders.read_refused): which
    process on which host, since when, why, and what to do, in one line. `payrun workers`,
    `payrun check` and the console named it; `payrun status` said nothing (session 42)."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    since = datetime.fromtimestamp(r["since_ms"] / 1000, ZoneInfo(tz)).strftime("%H:%M:%S %Z")
    for_s = max(0.0, (now_ms - r["since_ms"]) / 1000)
    return (f"send-email process {r['pid']} on {r['host']} is PAUSED since {since} ({for_s:.0f} s): the provider "
            f"refuses its own credentials ({r['where']}) while the other send-email processes send; they take its "
            f"sends, spending no attempt: fix its credentials on {r['host']}, and it takes sends again by itself "
            f"once the provider accepts them (`payrun workers` lists its lanes)")


def outage_text(out: dict[str, Any], tz: str) -> str:
    """One line on a provider outage (jobs.limits.read_outage), for the on-call engineer."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from jobs.policy import OUTAGE_HOLDS_PER_JOB

    since = datetime.fromtimestamp(out["outage_since"] or out["since"], ZoneInfo(tz)).strftime("%H:%M:%S %Z")
    now = (f"every sender paused for {out['paused_for_s']:.0f} s more, then one send probes it"
           if out["state"] == "paused" else "one send at a time probes it")
    if out["last_error"].startswith("AccountRefused"):  # not down: it refuses us until someone fixes it
        # the action first: the engineer at 02:00 reads the start of the line; the token
        # where it came from (jobs.mail names the local provider's file when it was that)
        fix = ("the local provider's token file (`payrun provider` and its senders must share one PAYRUN_HOME)"
               if "the local provider's token in " in out["last_error"] else
               "the token or login (PAYRUN_EMAIL_TOKEN; SMTP: PAYRUN_SMTP_PASSWORD)")
        return (f"the email provider refuses our credentials since {since}: fix {fix}, and the sends held back go out (each spends "
                f"no attempt for its first {OUTAGE_HOLDS_PER_JOB} holds); {now}; {out['failed_in_a_row']:,} sends "
                f"in a row refused, last: {cut(visible(out['last_error']), 160)}")
    return (f"the email provider is down since {since} ({out['failed_in_a_row']:,} sends in a row failed, last: "
            f"{cut(visible(out['last_error']), 120)}): {now}; the sends held back spend no attempt and go out once it answers")


def cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, cut at a word's end with "…" (a cut
    mid-word, "(simul)", read like a typo)."""
    if len(text) <= limit:
        return text
    head = text[:limit - 1]
    if " " in head[limit // 2:]:
        head = head[:head.rindex(" ")]
    return head.rstrip(" ,;:") + "…"


_GIVEN_UP: dict[str, tuple[float, list[str]]] = {}
GIVEN_UP_CACHE_S = 30.0


def starting_notes(cfg, notes: list[str]) -> list[str]:
    """``notes`` with each "N jobs wait on Q and no Q worker is running" whose program
    supervisord here is (re)starting (``starting_programs``) said as such: a deploy, not an
    outage. One `supervisorctl status`, only when such a note is there."""
    from payrun import keys, supervise

    out = supervise.status_here(cfg)
    if out is None:
        return notes
    fixed = []
    for n in notes:
        for q in (keys.RENDER_QUEUE, keys.EMAIL_QUEUE):
            if f"no {q} worker is running" in n and (how := starting_programs(out, q)) is not None:
                n = (n.split(" and no ", 1)[0] + f": its worker is starting here (supervisord: {how}) and takes "
                     f"them once it has registered; still so after a minute: `payrun ps` and {cfg.log_dir}")
        fixed.append(n)
    return fixed


def programs_given_up(cfg, clock=time.monotonic) -> list[str]:
    """The programs supervisord runs here and gave up on (FATAL), asked at most every 30 s
    (the console refreshes every 2 s; supervisorctl is a Python process of its own). []
    without a supervisord here; a worker host's (`payrun up --role worker`) is asked too (it
    was not: only one running the embedded Redis). The notes said only "no worker is
    running: is `payrun up` running?" while supervisord ran with every worker FATAL
    (on-call drill)."""
    from payrun import supervise

    key = str(cfg.home)
    cached = _GIVEN_UP.get(key)
    if cached is not None and clock() - cached[0] < GIVEN_UP_CACHE_S:
        return cached[1]
    names: list[str] = []
    if (out := supervise.status_here(cfg)) is not None:
        names = supervise.gave_up(out, ("FATAL",))
    _GIVEN_UP[key] = (clock(), names)
    return names


STARTING_UP_S = 60.0
"""A worker program supervisord (re)started less than this long ago may not have
registered yet (a loaded host's took ~12 s): said as starting, not as "not running"."""


def starting_programs(status: str, queue: str, within_s: float = STARTING_UP_S) -> str | None:
    """What a `supervisorctl status` output says of ``queue``'s worker program(s) when one
    is being (re)started: STARTING, STOPPING, BACKOFF, or RUNNING for less than
    ``within_s`` ("send-email RUNNING for 4 s"); None otherwise. A deploy's `supervisorctl
    restart send-email` read "135 jobs wait on send-email and no send-email worker is
    running: is `payrun up` running?" for the seconds the new process took to register
    (drill 43). Pure."""
    from payrun.supervise import _uptime_s

    said = []
    for ln in status.splitlines():
        parts = ln.split()
        if len(parts) < 2 or parts[0].split(":")[0] != queue:
            continue
        if parts[1] in ("STARTING", "STOPPING", "BACKOFF"):
            said.append(f"{parts[0]} {parts[1]}")
        elif parts[1] == "RUNNING" and (up := _uptime_s(ln)) is not None and up < within_s:
            said.append(f"{parts[0]} RUNNING for {up:.0f} s")
    return ", ".join(said) or None


def intake_notes(conn, waiting_only: bool = False) -> list[str]:
    """Why waiting jobs may not move: intake drained (`payrun drain`, which outlives `payrun
    down`/`up`), or no live worker takes from a queue that has jobs. One round trip, plus
    one per queue with jobs waiting. ``waiting_only``: the drain too only if jobs wait (a
    run is over, but a resend or a reminder may be waiting)."""
    from rq.suspension import WORKERS_SUSPENDED

    from payrun import keys

    queues = (keys.RENDER_QUEUE, keys.EMAIL_QUEUE)
    with conn.pipeline(transaction=False) as p:
        p.exists(WORKERS_SUSPENDED)
        p.smembers(keys.PAUSED_QUEUES)
        for q in queues:
            p.llen(f"rq:queue:{q}")
            p.smembers(f"rq:workers:{q}")
        suspended, paused, *per = p.execute()
    notes = []
    drained = sorted(m.decode() if isinstance(m, bytes) else m for m in paused)
    if waiting_only and not any(per[0::2]):
        return notes
    if suspended:
        notes.append("intake is drained everywhere (`payrun drain`): no worker takes a new job until `payrun resume`")
    elif drained:
        notes.append(f"intake is drained on {', '.join(drained)} (`payrun drain --queue`): "
                     f"`payrun resume` restarts it")
    for q, waiting, members in zip(queues, per[0::2], per[1::2]):
        if not waiting or q in drained or suspended:
            continue
        names = [(m.decode() if isinstance(m, bytes) else m).split(":", 2)[-1] for m in members]
        with conn.pipeline(transaction=False) as p:
            for n in names:
                p.exists(keys.alive(n))
            live = sum(map(bool, p.execute())) if names else 0
        if not live:
            notes.append(f"{waiting:,} {'job waits' if waiting == 1 else 'jobs wait'} on {q} and no {q} worker is running: "
                         f"is `payrun up` running (`payrun ps`)?")
    return notes


def readdressed_failed(ledger, db, month: str, company_ids: list[int]) -> list[str]:
    """Employees of ``company_ids`` whose ``month`` slip failed for good (Ledger.failed_slips)
    and whose address on file is not the one its send was made with: HR fixed it since, and
    `payrun retry` of the send goes to the new one. Ids ascending."""
    from payrun import payroll

    tried: dict[str, str | None] = {}
    for cid in company_ids:
        tried.update(ledger.failed_slips(month, cid))
    now = payroll.emails(db, sorted(e for e, to in tried.items() if to))
    return sorted(e for e, to in tried.items() if to and now.get(e) not in (None, to))


def hr_line(c: dict[str, int]) -> str:
    waiting = c["queued"] + c["running"] + c["retrying"]
    parts = [f"{c['done']:,} sent"]
    # stuck slips are among those in progress (the company rows count them in their
    # state's column too): "in progress" is the sum of those columns, as in each row
    if waiting:
        parts.append(f"{waiting:,} in progress" + (f" ({c['stuck']:,} stuck)" if c["stuck"] else ""))
    elif c["stuck"]:
        parts.append(f"{c['stuck']:,} stuck")
    parts.append(f"{c['failed']:,} failed")
    if c.get("no_slip"):
        parts.append(f"{c['no_slip']:,} with no slip yet")
    if c.get("no_salary_line"):
        parts.append(f"{c['no_salary_line']:,} with no salary line")
    return ", ".join(parts)


def _fit(text: str, width: int) -> str:
    """``text`` in exactly ``width`` terminal columns, padded, a cut one ending in "…" (it was
    cut mid-word, bare). Counted as a terminal draws it (console.fmt.columns), not in
    characters: a Bengali company's row (its virama takes no column) ended two columns
    short of the others, its figures out of line with the header (an HR walkthrough)."""
    from payrun.columns import cells_head, columns

    if columns(text) > width:
        text = cells_head(text, width - 1) + "…"
    return text + " " * max(0, width - columns(text))


def format_report(r: dict[str, Any]) -> str:
    if not r["month"]:
        ready = r.get("salary_months") or []
        if ready:
            return (f"no pay run yet; salary lines are in for {', '.join(ready[-6:])}: "
                    f"`payrun run --month {ready[-1]}` starts {'it' if len(ready) == 1 else 'the latest'}")
        return "no pay run yet: `payrun run --month YYYY-MM` starts one"
    others = [m for m in r.get("months", []) if m != r["month"]]
    lines = [f"Pay run {r['month']}: {r['total']['total']:,} slip{'' if r['total']['total'] == 1 else 's'}"
             + (f"  (other runs: {'…, ' if len(others) > 6 else ''}{', '.join(others[-6:])}; --month picks one"
                f"{f', --json lists all {len(others)}' if len(others) > 6 else ''})" if others else "")]
    no_slip = bool(r["total"].get("no_slip"))  # the column only when someone has no slip
    head = f"{'id':>4}  {'company':<30} {'sent':>7} {'queued':>7} {'running':>7} {'retrying':>8} {'failed':>7} {'stuck':>6}"
    lines.append(head + (f" {'no slip':>8}" if no_slip else ""))
    for c in r["companies"]:
        lines.append(
            f"{c['id']:>4}  {_fit(c['name'], 30)} {c['done']:>7,} {c['queued']:>7,} {c['running']:>7,} "
            f"{c['retrying']:>8,} {c['failed']:>7,} {c['stuck']:>6,}"
            + (f" {c.get('no_slip', 0):>8,}" if no_slip else "")
        )
    lines.append(f"Total: {hr_line(r['total'])}")
    if r.get("ledger_backlog") and (r.get("ledger_backlog_age_s") or 0) >= LEDGER_STALE_S:  # a few are normal
        lines.append(f"(ledger is {r['ledger_backlog']:,} updates behind, the oldest from "
                     f"{r['ledger_backlog_age_s']:.0f} s ago: "
                     + ("it cannot take them while Redis refuses writes)" if r.get("redis_refuses_writes")
                        else "is `payrun ledger` running?)"))
    if r.get("redis_reachable") is False:
        lines.append("(Redis unreachable: figures are the ledger's; stuck jobs and its backlog were not checked)")
    lines += [f"note: {n}" for n in r.get("notes", [])]
    return "\n".join(lines)
