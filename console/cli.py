"""The console's commands of `payrun` (registered onto the main click group). Importing
this module must not import textual: the TUI is loaded only by `payrun console`.

  payrun console [--readonly]          the TUI
  payrun queues|workers|running [--json]   the console's views as text or JSON
  payrun drain [--queue Q] / payrun resume [--queue Q]
  payrun stop-worker NAME               graceful: finish the job in hand, then exit
  payrun audit [--last N] [--json]      who did what from the console and these commands
"""

from __future__ import annotations

import json

import click

QUEUE_CHOICE = click.Choice(["pdf-render", "send-email", "control"])


def _age(s: float | None) -> str:
    from console.fmt import duration

    return duration(s)


from payrun.clitools import handle_errors, pass_ctx  # noqa: E402


def collapse_gone_lanes(workers: list) -> list[tuple]:
    """(worker, lanes): the GONE lanes of one send-email process that held no job as one
    row (the first of them, and how many), where they were one line each: a restarted
    sender read as "50 worker(s) GONE (killed or hung)" in an on-call drill. Lanes that
    held or handed back a job keep their own row (they say which job)."""
    out: list[tuple] = []
    groups: dict[tuple, list] = {}
    for w in workers:
        if not w.alive and w.kind == "email" and not w.job_id and not w.job_returned:
            key = (w.process, w.queues)
            if key not in groups:
                groups[key] = []
                out.append(key)
            groups[key].append(w)
        else:
            out.append(w)
    return [(groups[k][0], len(groups[k])) if isinstance(k, tuple) else (k, 1) for k in out]


WORKER_COLUMNS_MIN = {"worker": 34, "queues": 10, "state": 9, "job": 30, "for": 6}
"""`payrun workers`' usual widths: a column is wider when an entry is (never cut)."""


def worker_table(workers: list, store_full: bool = False, store_faults: list | None = None) -> list[str]:
    """`payrun workers`' header and rows (none with no worker). Every column is as wide as
    its longest entry, the header's included: the host:pid column was not padded, so under
    supervisord (its program names), or with a host name of another length, each row's
    queues, state and job sat right of their headings; a long job id (a reminder's, a bank
    check's) or a worker of several queues pushed the columns after it.

    The processes first (console.fmt.by_process: the render workers, each send-email
    process, the control worker), then the send-email lanes: a send-email process of
    several lanes is one row (``email.<host>.<pid>.* (50 lanes)``, its state "43/50 busy"
    or PAUSED, its longest job) and its lanes come after every process. With two
    send-email processes the render workers were listed after 100 lane rows. ``store_full``,
    ``store_faults``: a render worker taking none reads why (console.fmt.store_wait)."""
    from console.fmt import by_process, longest_job, process_name, process_state, store_wait, tagged, worker_state

    def where(w) -> str:
        return f"{tagged(w.host, w.host_tag)}:{w.pid}" + (f" {w.program}" if w.program else "")

    def row(w, lanes: int = 1) -> dict:
        return {
            "worker": w.name if lanes == 1 else f"{w.name.rsplit('.', 1)[0]}.* ({lanes} lanes)",
            "where": where(w),
            "queues": w.queues,
            "state": "GONE" if not w.alive else "PAUSED" if getattr(w, "paused_s", None) is not None
                     else worker_state(w.state, w.kind, store_full, store_wait(w, store_full, store_faults)),
            "job": w.job_id or "-",
            "for": _age(w.job_elapsed_s),
            "tail": f"beat {_age(w.heartbeat_age_s)} ago" + ("" if w.alive else "  NO LIVENESS")
                    + (f"  (its job {w.job_returned} was handed back)" if w.job_returned else "")
                    + ("  stopping" if w.stopping else ""),
        }

    def process_row(lanes: list) -> dict:
        top = longest_job(lanes)
        beat = min((w.heartbeat_age_s for w in lanes if w.heartbeat_age_s is not None), default=None)
        return {"worker": f"{process_name(lanes)}.* ({len(lanes)} lanes)", "where": where(lanes[0]),
                "queues": lanes[0].queues, "state": process_state(lanes), "job": top.job_id if top else "-",
                "for": _age(top.job_elapsed_s if top else None),
                "tail": f"beat {_age(beat)} ago (its freshest lane)"
                        + ("" if any(w.alive for w in lanes) else "  NO LIVENESS")}

    rows, lane_rows = [], []
    for group in by_process(workers):
        if len(group) == 1:
            rows.append(row(group[0]))
            continue
        rows.append(process_row(group))
        for w, lanes in collapse_gone_lanes(group):
            if lanes < len(group):  # (every lane GONE with no job: its process row says it)
                lane_rows.append(row(w, lanes))
    rows += lane_rows
    if not rows:
        return []
    head = {"worker": "worker", "where": "host:pid program" if any(w.program for w in workers) else "host:pid",
            "queues": "queues", "state": "state", "job": "job", "for": "for",
            "tail": "RQ heartbeat (an idle send lane beats every 30 s; liveness is separate)"}
    width = {k: max(WORKER_COLUMNS_MIN.get(k, 0), *(len(r[k]) for r in (head, *rows)))
             for k in ("worker", "where", "queues", "state", "job", "for")}

    def line(r: dict) -> str:
        return (" ".join(f"{r[k]:<{width[k]}}" for k in ("worker", "where", "queues", "state", "job"))
                + f" {r['for']:>{width['for']}}  {r['tail']}")

    return [line(head)] + [line(r) for r in rows]


def register(cli) -> None:
    """Add this package's commands to the `payrun` group."""

    def source(c):
        from console.data import Source

        c.require_home()
        return Source(c.cfg)

    def snapshot_or_fail(c):
        from payrun.errors import RedisUnavailable

        snap = source(c).snapshot()
        if snap.error and "Redis" in snap.error:
            from payrun import redis_server

            raise RedisUnavailable(f"{snap.error} ({redis_server.unreachable_hint(c.cfg)})")
        return snap

    @cli.command()
    @click.option("--readonly", is_flag=True, help="Look only: every action is hidden and refused.")
    @click.option("--interval", "interval_s", type=click.FloatRange(0.2, 60), default=1.0, show_default=True,
                  help="Seconds between refreshes (the next starts when the last has returned).")
    @click.option("--month", default=None, metavar="YYYY-MM",
                  help="The pay run whose HR line is shown (default: the run started last, followed as new "
                       "runs start; m in the console steps to the month before).")
    @pass_ctx
    @handle_errors
    def console(c, readonly: bool, interval_s: float, month: str | None) -> None:
        """The on-call console: live queues, workers, running and failed jobs, the HR line
        with its ETA; retry, drain, resume, stop a worker, change limits (each audited)."""
        from console.app import ConsoleApp
        from payrun import redis_server

        if readonly:
            redis_server.url(c.cfg, readonly=True, strict=True)  # no read-only user: refuse, not write
        src = source(c)
        if month is not None:
            from payrun.status import check_run_month

            check_run_month(src.months(), month)
            src.month = month
        from payrun.columns import teach_rich_spacing_marks

        teach_rich_spacing_marks()  # (Bengali names: pad cells by the columns a terminal draws)
        ConsoleApp(src, readonly=readonly, interval_s=interval_s).run()

    @cli.command()
    @click.option("--json", "as_json", is_flag=True)
    @pass_ctx
    @handle_errors
    def queues(c, as_json: bool) -> None:
        """Per queue: waiting, running, retrying (waiting out a backoff), later (scheduled
        on purpose: reminders not yet due), failed, oldest waiting job's age, jobs finished
        per minute (last 10 min), drained or not. Reads only."""
        from console.fmt import spark

        snap = snapshot_or_fail(c)
        if as_json:
            d = snap.to_dict()
            click.echo(json.dumps({"taken_at": d["taken_at"], "suspended": d["suspended"],
                                   "paused_queues": d["paused_queues"], "queues": d["queues"],
                                   "limits": d["limits"]}))
            return
        click.echo(f"{'queue':<11} {'waiting':>8} {'running':>8} {'retrying':>8} {'later':>6} {'failed':>7} "
                   f"{'oldest':>7}  per min (10 min)")
        for q in snap.queues:
            click.echo(f"{q.name:<11} {q.depth:>8,} {q.running:>8,} {q.retrying:>8,} {q.later:>6,} {q.failed:>7,} "
                       f"{_age(q.oldest_age_s):>7}  {spark(q.per_min)} {q.per_min[-1]}/min"
                       + ("  DRAINED" if q.paused or snap.suspended else ""))
        if snap.suspended:
            click.echo("all intake stopped (RQ suspended): `payrun resume`")
        if snap.limits:
            lim = snap.limits
            waiting = f" ({lim.waiting_for_rate} waiting for the rate)" if lim.waiting_for_rate else ""
            click.echo(f"email limits: {lim.in_use} / {lim.cap} in flight{waiting}, {lim.rate_per_s:g}/s, "
                       f"{lim.http_429:,} 429s seen"
                       + (f", {lim.duplicates:,} resends deduped by the provider" if lim.duplicates else ""))
            if lim.outage and lim.outage["pauses"]:
                from payrun.status import outage_text

                click.echo(outage_text(lim.outage, c.cfg.timezone))

    @cli.command()
    @click.option("--json", "as_json", is_flag=True)
    @pass_ctx
    @handle_errors
    def workers(c, as_json: bool) -> None:
        """Every RQ worker: host, pid, its supervisord program (when run by one), queues,
        state, current job and for how long, last heartbeat, whether its liveness key is
        alive. Reads only."""
        snap = snapshot_or_fail(c)
        if as_json:
            click.echo(json.dumps(snap.to_dict()["workers"]))
            return
        if not snap.workers:
            click.echo("no workers registered (`payrun up` starts them)")
        gone = [w for w in snap.workers if not w.alive]
        from console.fmt import store_full

        for line in worker_table(snap.workers, store_full(snap.eta), snap.store_faults):
            click.echo(line)
        from jobs.senders import refused_line

        for r in snap.refused_senders:  # (a process whose own credentials the provider refuses)
            click.echo(refused_line(r, snap.taken_at * 1000))
        if gone:
            procs = len({w.process for w in gone})
            click.echo(f"{len(gone)} worker(s) GONE{f' in {procs} processes' if procs > 1 else ''}: no liveness "
                       "for over 10 s (killed, hung, or restarted: a process that exits leaves its workers' "
                       "records). The reaper hands their jobs back, and its next pass on their host clears the "
                       "records of a process that exited; a hung one, or one on a host with no reaper, RQ forgets "
                       "within 8 min (`rq info` lists them until then).")

    @cli.command()
    @click.option("--json", "as_json", is_flag=True)
    @pass_ctx
    @handle_errors
    def running(c, as_json: bool) -> None:
        """Jobs being worked on now: elapsed against timeout, lease left, stuck (dead worker,
        lapsed lease, or running over lease.stuck_after_s). Reads only."""
        snap = snapshot_or_fail(c)
        if as_json:
            click.echo(json.dumps(snap.to_dict()["running"]))
            return
        if not snap.running:
            click.echo("nothing running")
        else:
            click.echo(f"{'job':<36} {'queue':<10} {'worker':<34} {'elapsed / timeout':>17}")
        for r in snap.running:
            to = f"{r.timeout_s:g}" if r.timeout_s else "?"
            click.echo(f"{r.job_id:<36} {r.queue:<10} {r.worker:<34} {_age(r.elapsed_s):>6} / {to} s"
                       + ("  PAST TIMEOUT" if r.past_timeout else "  NEAR TIMEOUT" if r.near_timeout else "")
                       + (f"  STUCK: {r.stuck}" if r.stuck else ""))

    @cli.command()
    @click.option("--queue", type=QUEUE_CHOICE, default=None, help="Only this queue (default: every queue).")
    @pass_ctx
    @handle_errors
    def drain(c, queue: str | None) -> None:
        """Stop intake: workers finish the jobs they hold and take no new ones (from QUEUE,
        or from every queue). Undo with `payrun resume`."""
        from console import actions

        click.echo(actions.drain(c.cfg, c.redis(), queue, via="cli").message)

    @cli.command()
    @click.option("--queue", type=QUEUE_CHOICE, default=None, help="Only this queue (default: everything).")
    @pass_ctx
    @handle_errors
    def resume(c, queue: str | None) -> None:
        """Resume intake on QUEUE, or everywhere (lifts every drain)."""
        from console import actions

        click.echo(actions.resume(c.cfg, c.redis(), queue, via="cli").message)

    @cli.command(name="stop-worker")
    @click.argument("name")
    @pass_ctx
    @handle_errors
    def stop_worker(c, name: str) -> None:
        """Gracefully stop one worker (names: `payrun workers`): it finishes its job, then exits.

        A send-email lane's whole process stops (every lane finishes its send), on
        whatever host it runs; supervisord then starts a fresh one (`payrun drain` first
        if it should not take work again)."""
        from console import actions

        click.echo(actions.stop_worker(c.cfg, c.redis(), name, via="cli").message)

    @cli.command()
    @click.option("--last", type=click.IntRange(1, 100_000), default=20, show_default=True)
    @click.option("--json", "as_json", is_flag=True)
    @pass_ctx
    @handle_errors
    def audit(c, last: int, as_json: bool) -> None:
        """The audit log: every action from the console and the CLI (runs, imports, retries,
        resends, reminders, drains, limits, worker stops, prunes) and the pay runs a cron
        tick started, newest last, times in the payroll's zone."""
        from console import actions

        if not actions.audit_path(c.cfg).exists():  # (elsewhere: "no actions recorded", of a payrun run elsewhere)
            c.require_home()
        rows = actions.read_audit(c.cfg, last)
        if as_json:
            click.echo(json.dumps(rows))
            return
        if not rows:
            click.echo(f"no actions recorded in {actions.audit_path(c.cfg)}")
        from payrun.clitools import local_time

        for r in rows:
            click.echo(f"{local_time(r['ts'], c.cfg.timezone)}  {r['who']:<10} {r['via']:<7} {r['command']}  "
                       f"({r['count']}) {r['message']}")

