"""What an operator can do, shared by the console and its `payrun` commands, each written
to the audit log ($PAYRUN_HOME/audit.log, one JSON object a line: who, when, what, the
equivalent command, how many, outcome).

  retry        payrun.deadletters.retry (fresh attempt budget; a send picks up a fixed address)
  drain        stop intake: one queue (the set payrun:paused-queues, honoured by payrun's
               workers) or everywhere (RQ's global suspension, honoured by every RQ worker)
  resume       lift it
  stop-worker  graceful stop of one worker: it finishes the job in hand, then exits
               (RQ's shutdown command over pubsub for a forking worker; for a send-email
               process, whose lanes do not listen to pubsub, a stop key its intake polls:
               the whole process stops gracefully, on any host)
  limits       jobs.limits.set_limits (cap / rate, read by every sender on its next send)
"""

from __future__ import annotations

import shlex
from pathlib import Path

from console.data import SUSPENDED_KEY, paused_queues_key
from payrun import keys
from payrun.audit import Outcome, audit, audit_path, read_audit, who  # noqa: F401 (re-exported)
from payrun.errors import PayrunError


class ActionError(PayrunError):
    """An action that cannot be done as asked (the message says what to do instead)."""


# ---- the actions ----------------------------------------------------------------------

def retry_command(job_ids: list[str]) -> str:
    shown = job_ids[:3]
    return "payrun retry " + " ".join(shlex.quote(i) for i in shown) + (f" … ({len(job_ids)} ids)" if len(job_ids) > 3 else "")


def not_failed(conn, job_ids: list[str]) -> list[str]:
    """Of ``job_ids``, those in no queue's failed registry (finished, retried already, a
    typo): what `:retry` says before offering to retry. Reads only."""
    with conn.pipeline(transaction=False) as p:
        for job_id in job_ids:
            for q in keys.QUEUES:
                p.zscore(f"rq:failed:{q}", job_id)
        scores = p.execute()
    n = len(keys.QUEUES)
    return [j for i, j in enumerate(job_ids) if all(s is None for s in scores[i * n:(i + 1) * n])]


def retry(cfg, conn, job_ids: list[str], command: str | None = None, via: str = "console") -> Outcome:
    from payrun import deadletters

    if not job_ids:
        raise ActionError("nothing to retry: no job selected")
    db = None
    if Path(cfg.payroll_path).exists():
        from payrun.payroll import PayrollDB

        db = PayrollDB(cfg.payroll_path)
    ledger = None
    if Path(cfg.ledger_path).exists():
        from console.data import ReadOnlyLedger

        ledger = ReadOnlyLedger(cfg.ledger_path)  # (a month pruned from it is not rendered again)
    try:
        ids, same_slip = deadletters.one_per_slip(conn, list(job_ids))  # one email per slip
        again: list[str] = []
        refused: list[tuple[str, str]] = []
        requeued, missing = deadletters.retry(cfg, conn, ids, db, rendered_again=again, refused=refused,
                                              ledger=ledger)
        same_slip = deadletters.still_left_out(same_slip, requeued, again)
    finally:
        if db is not None:
            db.db.close()
        if ledger is not None:
            ledger.db.conn.close()
    if not requeued:  # nothing done: an error, as `payrun retry` says it, and nothing audited
        if refused:
            raise ActionError(f"not requeued: {refused[0][1]}" + (f" (and {len(refused) - 1} more)"
                                                                  if len(refused) > 1 else ""))
        raise ActionError("not among failed jobs: " + ", ".join(missing[:3]) + (" …" if len(missing) > 3 else "")
                          + " (finished, retried already, or gone)")
    out = Outcome("retry", command or retry_command(list(job_ids)), len(requeued), ok=not missing and not refused,
                  message=f"requeued {len(requeued)} job(s)" + (f"; {len(missing)} no longer failed" if missing else "")
                  + (f"; {len(again)} slip(s) missing from the store are rendered again first" if again else "")
                  + (f"; {len(refused)} not requeued: {refused[0][1]}" if refused else "")
                  + (f"; left out {len(same_slip)} older failure(s) of the same slip" if same_slip else ""),
                  detail={"asked": len(job_ids), "not_found": missing[:20], "same_slip": same_slip[:20],
                          "rendered_again": again[:20], "refused": [i for i, _ in refused[:20]]})
    audit(cfg, out, via)
    return out


def _check_queue(queue: str | None) -> None:
    if queue is not None and queue not in keys.QUEUES:
        raise ActionError(f"unknown queue {queue!r} (choose from {', '.join(keys.QUEUES)})")


def drain(cfg, conn, queue: str | None = None, via: str = "console") -> Outcome:
    _check_queue(queue)
    if queue:
        conn.sadd(paused_queues_key(), queue)
        msg = f"intake stopped on {queue}: workers finish what they hold and take nothing new from it"
    else:
        from rq.suspension import suspend

        suspend(conn)
        msg = "intake stopped everywhere (RQ suspended): workers finish what they hold and wait"
    out = Outcome("drain", "payrun drain" + (f" --queue {queue}" if queue else ""), 1, message=msg,
                  detail={"queue": queue or "*"})
    audit(cfg, out, via)
    return out


def resume(cfg, conn, queue: str | None = None, via: str = "console") -> Outcome:
    """One queue, or (no queue) everything: the global suspension and every paused queue."""
    _check_queue(queue)
    if queue:
        n = conn.srem(paused_queues_key(), queue)
        msg = f"intake resumed on {queue}" if n else f"{queue} was not drained"
        if conn.exists(SUSPENDED_KEY):  # (it said "intake resumed" and nothing moved)
            msg += ("; but intake stays stopped on every queue (a drain of all: `payrun drain` without "
                    "--queue): `payrun resume` (the console's U) lifts it")
    else:
        from rq.suspension import resume as rq_resume

        paused = sorted(m.decode() if isinstance(m, bytes) else m for m in conn.smembers(paused_queues_key()))
        was = bool(conn.exists(SUSPENDED_KEY))
        rq_resume(conn)
        conn.delete(paused_queues_key())
        n = int(was) + len(paused)
        msg = "intake resumed everywhere" + (f" (was drained: {', '.join((['all'] if was else []) + paused)})" if n else " (nothing was drained)")
    out = Outcome("resume", "payrun resume" + (f" --queue {queue}" if queue else ""), int(n), message=msg,
                  detail={"queue": queue or "*"})
    audit(cfg, out, via)
    return out


STOP_REQUEST_TTL_S = 60
"""A stop request for a send-email process that nobody picked up (the process died
meanwhile) lapses, so a later process reusing that pid is not stopped by it."""


def stop_worker(cfg, conn, name: str, via: str = "console") -> Outcome:
    """Finish the job in hand, then exit (supervisord's autorestart starts a fresh one;
    `payrun drain` first if it should not take work again)."""
    raw = conn.hgetall(f"rq:worker:{name}")
    h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()}
    if not h or h.get("death"):
        raise ActionError(f"no live worker named {name!r} (see `payrun workers`)")
    queues = h.get("queues", "").split(",")
    command = f"payrun stop-worker {name}"
    if keys.EMAIL_QUEUE in queues:
        # a send-email process runs many lanes and does not listen to RQ's shutdown command;
        # its intake polls this key (20 times a second) on whatever host it runs
        host, pid = h.get("hostname"), int(h.get("pid") or 0)
        if not host or not pid:
            raise ActionError(f"{name} does not say which process it is (no hostname/pid in rq:worker:{name})")
        conn.set(keys.stop_process(host, pid, h.get("host_id")), f"{name} via {via}", ex=STOP_REQUEST_TTL_S)
        msg = (f"send-email process {pid} on {host} asked to stop: all its lanes finish their sends, "
               f"then it exits")
    else:
        from rq.command import send_shutdown_command

        send_shutdown_command(conn, name)
        msg = f"{name}: shutdown requested; it finishes its job, then exits"
    out = Outcome("stop-worker", command, 1, message=msg, detail={"worker": name, "pid": h.get("pid"),
                                                                   "host": h.get("hostname")})
    audit(cfg, out, via)
    return out


def limits_problem(cap: int | None, rate_per_s: float | None) -> str | None:
    """Why these email limits cannot be set, or None: asked before the confirmation too."""
    if cap is None and rate_per_s is None:
        return "give a cap and/or a rate"
    if cap is not None and not 1 <= cap <= 10_000:
        return f"cap {cap} is not in the range 1<=cap<=10000"
    if rate_per_s is not None and not 0.1 <= rate_per_s <= 100_000:
        return f"rate {rate_per_s:g} is not in the range 0.1<=rate<=100000"
    return None


def set_limits(cfg, conn, cap: int | None = None, rate_per_s: float | None = None, via: str = "console") -> Outcome:
    from jobs.limits import set_limits as _set

    problem = limits_problem(cap, rate_per_s)
    if problem:
        raise ActionError(problem)
    _set(conn, "email", cap=cap, rate_per_s=rate_per_s)
    cmd = "payrun limits set" + (f" --cap {cap}" if cap is not None else "") + (f" --rate {rate_per_s:g}" if rate_per_s is not None else "")
    out = Outcome("limits", cmd, 1, message="email limits now " + cmd.split("set ", 1)[1],
                  detail={"cap": cap, "rate_per_s": rate_per_s})
    audit(cfg, out, via)
    return out
