"""Pure text formatting for the console and its commands (no textual)."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from payrun.columns import cells_head, columns  # noqa: F401 - (the console's names for them)
from payrun.status import hr_line

BARS = "▁▂▃▄▅▆▇█"


def spark(values: list[int]) -> str:
    """A text sparkline, one character per value (0 is the lowest bar, max the highest)."""
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return BARS[0] * len(values)
    return "".join(BARS[min(len(BARS) - 1, round(v / top * (len(BARS) - 1)))] for v in values)


def clip(text: str, width: int) -> str:
    """``text`` in ``width`` terminal columns: whole, or cut at a word with "…" ("Mahananda
    Tea Estates Li" at 80 columns read as a name of its own). Columns, not characters:
    cut by ``len`` a Bengali name (marks with no column) left its column short and
    "…" too early, a CJK one (two columns a character) ran past it."""
    if columns(text) <= width:
        return text
    cut = cells_head(text, max(0, width - 1))
    if " " in cut.strip() and text[len(cut)] != " " and not cut.endswith(" "):  # (a cut after a space: a whole word)
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:-") + "…"


def stuck_text(reason: str, worker: str | None) -> str:
    """Why a job is stuck as the running view's row says it, beside its worker's column:
    without the worker's name, which is most of the reason ("worker email.app1.4200.07 is
    gone (no liveness for 10 s)" left "worker email.app1.4200.07 is" at 80 columns)."""
    if worker:
        reason = reason.replace(f"worker {worker} is gone", "worker gone").replace(f"worker {worker} ", "worker ")
    return reason


def store_full(eta: dict[str, Any] | None) -> bool:
    """The slip store has no room for a slip while slips are left to make (console.data.eta)."""
    return bool(eta) and eta.get("store_full_free") is not None


def store_fault_of(worker, faults: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The entry of ``faults`` (console.data.Snapshot.store_faults) for ``worker``'s host:
    by host id (payrun.slipstore keys them so), by hostname for a worker with none (before
    session 42). Pure."""
    for f in faults or ():
        if (f.get("id") == worker.host_id) if worker.host_id else f.get("host") == worker.host:
            return f
    return None


def store_wait(worker, full: bool, faults: list[dict[str, Any]] | None = None) -> str | None:
    """Why a render worker takes no render, if its slip store is the reason: "read-only" or
    "failing" (jobs.policy.store_fault_word: its host's store cannot be written, as its
    render workers found, payrun.slipstore.report_fault), or "full" (``full``,
    :func:`store_full`). None for any other worker. Pure."""
    from jobs.policy import store_fault_word

    if worker.kind != "render":
        return None
    if (f := store_fault_of(worker, faults)) is not None:
        return store_fault_word(f.get("errno"))
    return "full" if full else None


STORE_WAIT_STATE = {"full": "waits: store full", "read-only": "waits: read-only", "failing": "waits: disk error"}
"""A render worker's state, by :func:`store_wait`'s word. Short: at 80 columns "waits: store
read-only" pushed the workers view's `alive` off the screen (17 columns at most)."""


def worker_state(state: str, kind: str, full: bool, wait: str | None = None) -> str:
    """A worker's RQ state as the on-call reads it: a render worker taking no render while
    the slip store is full, read-only or failing reads "suspended" (RQ's word, as for `rq
    suspend`): "waits: store full", "waits: read-only", "waits: disk error" (``wait``:
    :func:`store_wait`'s word, "full" by default when ``full``)."""
    if kind == "render" and state == "suspended" and (wait or full):
        return STORE_WAIT_STATE.get(wait or "full", f"waits: {wait}")
    return state


HOST_TAG_MIN = 4
"""Hex characters of a host id (payrun.procs.host_id) shown after a hostname that two live
hosts share ("app1/3f2a"); more when that few do not tell their ids apart."""


def host_tags(workers) -> dict[tuple[str, str], str]:
    """(hostname, host id) -> the short suffix of the id to show after that hostname, for
    the hostnames that live ``workers`` (console.data.WorkerRow) of two or more host ids
    bear: containers and cloned VMs share one, and the console and `payrun workers` showed
    their workers as one host's. Also for a hostname under which two ids ran a process of
    one pid (one of them gone): "app1:4200" would name two processes. The suffix is the
    shortest prefix of the id, at least HOST_TAG_MIN characters, that tells that
    hostname's ids apart. A worker with no host id (before session 42) gets none. Pure."""
    ids: dict[str, set[str]] = {}
    live: dict[str, set[str]] = {}
    pids: dict[tuple[str, Any], set[str]] = {}
    for w in workers:
        if not w.host_id:
            continue
        ids.setdefault(w.host, set()).add(w.host_id)
        if w.alive:
            live.setdefault(w.host, set()).add(w.host_id)
        pids.setdefault((w.host, w.pid), set()).add(w.host_id)
    alike = {h for h, s in live.items() if len(s) > 1} | {h for (h, _), s in pids.items() if len(s) > 1}
    out: dict[tuple[str, str], str] = {}
    for host in sorted(alike):
        known = sorted(ids[host])
        longest = max(map(len, known))
        n = next((n for n in range(HOST_TAG_MIN, longest + 1) if len({i[:n] for i in known}) == len(known)), longest)
        out.update({(host, i): i[:n] for i in known})
    return out


def tagged(host: str, tag: str | None, width: int | None = None) -> str:
    """A hostname as shown: with its host id's suffix when it has one ("app1/3f2a"); the
    hostname cut to ``width`` characters first (the suffix is what tells two apart)."""
    name = host if width is None else host[:width]
    return f"{name}/{tag}" if tag else name


def tagged_name(name: str, host: str, tag: str | None) -> str:
    """A worker's name (kind.<host>.<pid>[.<lane>]) with its hostname tagged as
    :func:`tagged` does ("render.app1/3f2a.4101"): at 80 columns the workers view leaves
    out the host:pid column, and the name is all that tells two hosts' workers apart.
    Only shown: `payrun stop-worker` takes the name RQ knows (the s key's dialog says it)."""
    if not tag or f".{host}." not in name:
        return name
    return name.replace(f".{host}.", f".{host}/{tag}.", 1)


def short_where(where: str) -> list[str]:
    """Where a paused send-email process's credentials come from (jobs.senders' ``where``),
    in shorter and shorter words, the longest first; the variable or the file is named in
    each: "PAYRUN_EMAIL_TOKEN in this process's environment (a restart takes a new value)"
    down to "its PAYRUN_EMAIL_TOKEN", a token file's path down to its last two parts."""
    head = where.split(" (")[0]  # ("… (a restart takes a new value)", "… (login 'u' at host:port)")
    out = [head]
    if head.startswith("PAYRUN_") and head.endswith(" in this process's environment"):
        var = head.split(" ", 1)[0]
        out += [f"{var} in its environment", f"its {var}"]
    elif "token file " in head:
        path = head.split("token file ", 1)[1]
        out.append(f"token file {path}")
        parts = path.rstrip("/").split("/")
        if len(parts) > 3:
            out.append(f"token file …/{'/'.join(parts[-2:])}")
    elif head.startswith("no token: "):
        out.append(head[len("no token: "):].replace(" is not set", " not set"))
    return list(dict.fromkeys(out))


def paused_sender_alerts(r: dict[str, Any], now: float) -> list[str]:
    """The overview's alert for a send-email process paused because the provider refuses its
    own credentials (jobs.senders.read_refused, console.data.read_paused_senders), longest
    first. Each shorter form drops a less important part first: the provider's wording,
    then the long words of where the credentials come from, how long, "send-email"; which
    process (host:pid) and where its credentials come from stay to the last. At 80 columns
    the alert lost its "(where)", the part that says what to fix."""
    for_s = max(0.0, now - r["since_ms"] / 1000)
    who = f"{tagged(r['host'], r.get('host_tag'))}:{r['pid']}"
    wheres = short_where(r["where"])
    return ([f"send-email {who} PAUSED {duration(for_s)}: provider refuses its credentials ({wheres[0]})"]
            + [f"send-email {who} PAUSED {duration(for_s)}: credentials refused ({w})" for w in wheres]
            + [f"send-email {who} PAUSED: credentials refused ({wheres[-1]})",
               f"{who} PAUSED: credentials refused ({wheres[-1]})",
               f"{who} PAUSED ({wheres[-1]})"])


def in_flight_notes(in_use: int, cap: int, rate_per_s: float, waiting: int, slots: int | None) -> list[str]:
    """What the limits line says after "email 13/50 in flight", longest first (for
    :func:`longest_fitting`). At a rate that lets fewer slots be taken than the cap
    (``slots``: jobs.limits.rate_slots; 22 at 2/s) it says the rate, not the cap, holds the
    sends back: "13/50 in flight" read as idle lanes and invited raising the cap. Each
    shorter form drops the count of senders ``waiting`` for their start first; the last
    says nothing (the line's other figures stay on an 80-column screen). Otherwise the one
    form as before: the ``waiting`` count, if any. Pure."""
    waits = f"{waiting} waiting for the rate" if waiting else ""
    if slots is None or slots >= cap:
        return [f" ({waits})" if waits else ""]
    rate = f"{rate_per_s:g}/s"
    out = [f" ({waits + '; ' if waits else ''}at {rate} at most {slots} at once: the rate holds sends back, "
           "not the cap)"]
    if waits:
        out.append(f" ({waits}; the rate, not the cap, allows {slots})")
    return out + [f" (the rate, not the cap, allows {slots})", f" (the rate allows {slots})",
                  f" (rate allows {slots})", ""]


def cap_over_rate_note(cap: int | None, rate_per_s: float | None, slots: int | None) -> str:
    """What the limits dialog (and its confirmation) says when ``cap`` is above the sends
    in flight ``rate_per_s`` allows (``slots``: jobs.limits.rate_slots; 22 at 2/s): raising
    the cap there sends no faster, only a higher rate does. The limits line and `payrun
    limits show` said it, the dialog where the cap is raised did not (an operator raised
    the cap to 100 at 2/s to clear a backlog: still 22 in flight). "" when the cap binds, or
    a figure is unknown. Pure."""
    if cap is None or rate_per_s is None or slots is None or slots >= cap:
        return ""
    return (f"the rate {rate_per_s:g}/s allows only {slots} in flight: a cap above that ({cap}) sends no "
            "faster; raise the rate to send faster")


def longest_fitting(forms: list[str], room: int | None) -> str:
    """The first (longest) of ``forms`` that takes at most ``room`` terminal columns; the
    last when none does; the first when ``room`` is None (no limit)."""
    if room is None:
        return forms[0]
    return next((f for f in forms if columns(f) <= room), forms[-1])


KIND_ORDER = {"render": 0, "email": 1, "control": 2}
"""The order of the processes in the workers view and `payrun workers`: the render pool
first, then each send-email process, then the control worker."""


def by_process(workers: list) -> list[list]:
    """``workers`` (console.data.WorkerRow) one list per process, as the on-call reads them:
    the render workers first, then each send-email process (its lanes together, by name),
    then the control worker; by hostname, host id and pid within a kind. A render or control
    worker is a process of its own; a send-email process runs many lanes, each an RQ
    worker. The workers view and `payrun workers` listed every worker by name: with two
    send-email processes the render pool came after their 100 lanes. Pure."""
    groups: dict[tuple, list] = {}
    for w in workers:
        key = ((w.kind, w.host, w.host_id or "", w.pid or 0, "") if w.kind == "email"
               else (w.kind, w.host, w.host_id or "", w.pid or 0, w.name))
        groups.setdefault(key, []).append(w)
    order = sorted(groups, key=lambda k: (KIND_ORDER.get(k[0], len(KIND_ORDER)), *k[1:]))
    return [sorted(groups[k], key=lambda w: w.name) for k in order]


def process_name(lanes: list) -> str:
    """A send-email process's name from its lanes' (email.<host>.<pid>.<lane>): as
    jobs.senders names it, "email.<host>.<pid>"."""
    return lanes[0].name.rsplit(".", 1)[0] if lanes[0].name.count(".") >= 3 else lanes[0].name


def process_state(lanes: list) -> str:
    """A send-email process's state, from its lanes' (console.data.WorkerRow): GONE when
    none has liveness; PAUSED while the provider refuses its own credentials; else how many
    lanes hold a send ("43/50 busy"); "(stopping)" and how many lanes are GONE after it."""
    dead = sum(1 for w in lanes if not w.alive)
    if dead == len(lanes):
        return "GONE"
    if any(w.paused_s is not None for w in lanes):
        text = "PAUSED"
    else:
        text = f"{sum(1 for w in lanes if w.alive and w.job_id)}/{len(lanes)} busy"
    if any(w.stopping for w in lanes):
        text += " (stopping)"
    return text + (f", {dead} GONE" if dead else "")


def longest_job(lanes: list):
    """The live lane (console.data.WorkerRow) whose job has run longest, or None."""
    return max((w for w in lanes if w.alive and w.job_id), key=lambda w: w.job_elapsed_s or 0, default=None)


def duration(s: float | None) -> str:
    """3s, 4m05s, 2h03m; '-' for unknown."""
    if s is None:
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def clock(ts: float, tz: str) -> str:
    return datetime.fromtimestamp(ts, ZoneInfo(tz)).strftime("%H:%M:%S")


def eta_text(eta: dict[str, Any] | None) -> str:
    if not eta:
        return ""
    if eta["remaining"] == 0:
        if eta.get("failed"):  # finished, but not everyone got a slip: never "all delivered"
            return f"finished: {eta['failed']:,} failed for good (f lists them)"
        return ("all slips made are delivered" if eta.get("no_slip") or eta.get("no_salary_line")
                else "all delivered")
    if eta.get("drained"):
        return "no ETA: intake drained (resume with u or `payrun resume`)"
    if eta.get("no_worker"):
        return f"no ETA: no {' or '.join(eta['no_worker'])} worker running (`payrun up`? `payrun ps`)"
    if f := eta.get("store_fault"):  # (read-only, a failing disk: it read "ETA 17:51 — on time")
        from jobs.policy import store_fault_step, store_fault_word

        more = eta.get("store_faults", 1) - 1
        return (f"no ETA: slip store {f['path']} {store_fault_word(f.get('errno'))} on {f['host']} ({f['error']})"
                + (f" and {more} more host{'' if more == 1 else 's'}'s (`payrun status`)" if more > 0 else "")
                + f": every render waits, spending no attempt; {store_fault_step(f.get('errno'), f['mount'])}; "
                  "the run goes on by itself")
    if eta.get("store_full_free") is not None and eta.get("store_full_at"):
        # (it said "`payrun status` says where": at 02:00, a second command to learn what to free)
        return (f"no ETA: slip store full ({eta['store_full_free'] // 1024:,} KiB free): every render waits, "
                f"spending no attempt; free space in {eta['store_full_at']} and the run goes on by itself")
    if eta.get("store_full_free") is not None:
        return (f"no ETA: slip store full ({eta['store_full_free'] // 1024:,} KiB free): no render until space is "
                "freed (`payrun status` says where)")
    if eta.get("redis_down"):
        return "ETA unknown: Redis unreachable (the figures are the ledger's)"
    if eta.get("provider_down_s") is not None:
        text = f"no ETA: email provider down {duration(eta['provider_down_s'])}"
        if eta.get("if_back_now"):
            back = datetime.fromisoformat(eta["if_back_now"])
            deadline = datetime.fromisoformat(eta["deadline"])
            # (within the minute: "done 07:07" read at 07:07:41 looked like a time gone by)
            done = "in under a minute" if eta.get("back_within_a_minute") else f"{back:%H:%M}"
            text += (f" (if back now: done {done}, "
                     f"{'on time for' if eta['on_time_if_back_now'] else 'LATE for'} "
                     f"{_deadline(deadline, back)})")
        return text
    if eta.get("stalled"):
        return "no ETA: no slip delivered for 2 minutes (running? failed? limits?)"
    if not eta.get("at"):
        return "ETA unknown: nothing delivered in the last 5 min"
    at = datetime.fromisoformat(eta["at"])
    deadline = datetime.fromisoformat(eta["deadline"])
    verdict = "on time for" if eta["on_time"] else "LATE for"
    day = "" if at.date() == deadline.date() or at.date() < deadline.date() else f" {at:%d %b}"
    return f"ETA {at:%H:%M}{day} — {verdict} {_deadline(deadline, at)}"


def _deadline(deadline: datetime, seen_from: datetime) -> str:
    """"09:00", or "09:00 tomorrow" / "09:00 05 Dec" when the deadline is on a later day
    than the time it is set against (a run begun after 09:00 has until the next
    morning's: at 10:09 "on time for 09:00" alone reads as this morning's)."""
    days = (deadline.date() - seen_from.date()).days
    if days <= 0:
        return f"{deadline:%H:%M}"
    return f"{deadline:%H:%M} tomorrow" if days == 1 else f"{deadline:%H:%M} {deadline:%d %b}"


def ledger_behind_text(backlog: int, age_s: float) -> str:
    """The note under the HR line when the ledger is not keeping up (as `payrun status`
    says it): its figures are behind the workers' by ``backlog`` events."""
    from payrun.ledger import LEDGER_STALE_S

    if not backlog or age_s < LEDGER_STALE_S:
        return ""
    return (f"the ledger is {backlog:,} update{'' if backlog == 1 else 's'} behind (the oldest from {duration(age_s)} ago): these figures lag; "
            "is `payrun ledger` running? (`payrun ps`)")


def no_run_text(home, ledger_path) -> str:
    """The overview's line when the ledger has no pay run: on a worker host's data
    directory (`payrun up --role worker`, no ledger here) the ledger is the control host's,
    as `payrun status` there says; elsewhere, how to start one. A multi-host drill (s41) saw
    a worker host's console say "no pay run in the ledger yet: `payrun run` starts one" in
    the middle of the control host's run."""
    from pathlib import Path

    role = Path(home) / "supervisor.role"
    try:
        worker = not Path(ledger_path).exists() and role.read_text().strip() == "worker"
    except OSError:
        worker = False
    if worker:
        return ("this is a worker host (payrun up --role worker): the ledger, and with it the pay runs' "
                "progress, is on the control host: its `payrun console` or `payrun status`")
    return "no pay run in the ledger yet: `payrun run --month YYYY-MM` starts one"


def answer(counts: dict[str, int], eta: dict[str, Any] | None = None) -> str:
    """The HR line: "49,992 sent, 8 in progress (1 stuck), 0 failed — ETA 02:31 — on time for 09:00"."""
    line = hr_line(counts)
    e = eta_text(eta)
    return f"{line} — {e}" if e else line
