"""Cron expressions and tick arithmetic: pure functions, the clock is always passed in.

A cron expression has five fields, written in the configured time zone (default
Asia/Dhaka) whatever the host's zone is::

    minute (0-59)  hour (0-23)  day of month (1-31)  month (1-12 or jan-dec)  day of week (0-7 or sun-sat; 0 and 7 = Sunday)

Each field is ``*``, a number, a range ``a-b``, a step ``*/n`` / ``a-b/n`` / ``a/n``, or a
comma list of those. ``@hourly``, ``@daily``, ``@weekly``, ``@monthly`` and ``@yearly``
are accepted. As in Vixie cron, when both day fields are restricted a day matching
either one fires.

Daylight saving (not observed in Asia/Dhaka, but the zone is configurable): a local
time that does not exist (spring forward) does not fire; a local time that happens twice
(fall back) fires once, at its first occurrence.

Times returned are aware ``datetime`` objects in UTC.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo

from payrun.errors import ConfigError

UTC = timezone.utc

JOBS = ("payroll", "bank-status", "reaper")
"""The kinds of tick a cron entry may run (`job = ...` in the config)."""

DEFAULT_ENTRIES = (
    {"name": "payroll", "cron": "0 2 1 * *", "job": "payroll"},
    {"name": "bank-status", "cron": "*/15 * * * *", "job": "bank-status"},
    {"name": "reaper", "cron": "*/5 * * * *", "job": "reaper"},
)

_MONTHS = {m: i for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split(), start=1)}
_DAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}
_MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
_FIELDS = (  # name, low, high, names
    ("minute", 0, 59, None),
    ("hour", 0, 23, None),
    ("day of month", 1, 31, None),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
MAX_TICKS = 100_000
"""Upper bound on ticks enumerated in one call (a */1 entry over ~70 days)."""


class CronError(ValueError):
    """An expression that cannot be parsed; the message names the field and the reason."""


@dataclass(frozen=True)
class CronSpec:
    expr: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    """0 = Sunday ... 6 = Saturday (7 is folded into 0)."""
    dom_any: bool
    dow_any: bool

    def day_matches(self, d: date) -> bool:
        if d.month not in self.months:
            return False
        dom = d.day in self.days
        dow = (d.isoweekday() % 7) in self.weekdays
        if self.dom_any and self.dow_any:
            return True
        if self.dom_any:
            return dow
        if self.dow_any:
            return dom
        return dom or dow


_NUMBER = re.compile(r"[0-9]{1,4}")
"""A number in a cron field: ASCII digits only (``str.isdigit`` takes '²', which int()
refuses, and '١٢', which it reads as 12), and short (a 5,000-digit one hits Python's limit
on int conversion: not a CronError)."""


def _value(text: str, name: str, low: int, high: int, names: dict[str, int] | None) -> int:
    t = text.lower()
    if names and t in names:
        return names[t]
    if not _NUMBER.fullmatch(t):
        raise CronError(f"{name}: {text!r} is not a number" + (f" or a name ({', '.join(names)})" if names else ""))
    v = int(t)
    if not low <= v <= high:
        raise CronError(f"{name}: {v} is out of range {low}-{high}")
    return v


def _field(text: str, name: str, low: int, high: int, names: dict[str, int] | None) -> tuple[set[int], bool]:
    out: set[int] = set()
    if not text:
        raise CronError(f"{name}: empty")
    for item in text.split(","):
        if not item:
            raise CronError(f"{name}: empty item in {text!r}")
        rng, _, step_text = item.partition("/")
        step = 1
        if _:
            if not _NUMBER.fullmatch(step_text) or int(step_text) < 1:
                raise CronError(f"{name}: step {step_text!r} must be a whole number >= 1")
            step = int(step_text)
            if step > high - low + 1 and rng == "*":
                raise CronError(f"{name}: step {step} is larger than the range {low}-{high}")
        if rng == "*":
            a, b = low, high
        elif "-" in rng:
            left, _, right = rng.partition("-")
            a, b = _value(left, name, low, high, names), _value(right, name, low, high, names)
            if a > b:
                raise CronError(f"{name}: range {rng!r} goes backwards")
        else:
            a = _value(rng, name, low, high, names)
            b = high if _ else a
        out.update(range(a, b + 1, step))
    return out, text == "*"


def parse(expr: str) -> CronSpec:
    """Parse a five-field cron expression (or an @macro); CronError says what is wrong."""
    if not isinstance(expr, str) or not expr.strip():
        raise CronError("empty cron expression")
    text = _MACROS.get(expr.strip().lower(), expr.strip())
    if text.startswith("@"):
        raise CronError(f"unknown macro {expr.strip()!r} (known: {', '.join(sorted(_MACROS))})")
    parts = text.split()
    if len(parts) != 5:
        raise CronError(f"needs 5 fields (minute hour day-of-month month day-of-week), got {len(parts)}")
    sets = [_field(p, *f) for p, f in zip(parts, _FIELDS)]
    weekdays = {d % 7 for d in sets[4][0]}
    spec = CronSpec(
        expr=expr.strip(), minutes=tuple(sorted(sets[0][0])), hours=tuple(sorted(sets[1][0])),
        days=frozenset(sets[2][0]), months=frozenset(sets[3][0]), weekdays=frozenset(weekdays),
        dom_any=sets[2][1], dow_any=sets[4][1],
    )
    if spec.dom_any is False and spec.dow_any:
        # a day of month that no allowed month has (e.g. 30 2 / 31 of 30-day months only)
        longest = max(_month_len(m) for m in spec.months)
        if min(spec.days) > longest:
            raise CronError(f"day of month {sorted(spec.days)} never occurs in month(s) {sorted(spec.months)}")
    return spec


def _month_len(month: int) -> int:
    return (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)[month - 1]


def _local(naive: datetime, zone: ZoneInfo) -> datetime | None:
    """The aware time for a local wall-clock time, or None when it does not exist (DST gap)."""
    aware = naive.replace(tzinfo=zone, fold=0)
    back = aware.astimezone(UTC).astimezone(zone).replace(tzinfo=None)
    return aware if back == naive else None


def next_after(spec: CronSpec, zone: ZoneInfo, after: datetime) -> datetime:
    """The first fire time strictly after ``after`` (aware), in UTC."""
    if after.tzinfo is None:
        raise ValueError("after must be timezone-aware")
    local_after = after.astimezone(zone)
    day = local_after.date()
    for _ in range(366 * 8 + 1):  # 8 years covers any valid expression (29 Feb on a Monday)
        if spec.day_matches(day):
            for h in spec.hours:
                for m in spec.minutes:
                    aware = _local(datetime.combine(day, time(h, m)), zone)
                    if aware is not None and aware > after:
                        return aware.astimezone(UTC)
        day += timedelta(days=1)
    raise CronError(f"{spec.expr!r} never fires")


def ticks_between(spec: CronSpec, zone: ZoneInfo, after: datetime, until: datetime,
                  limit: int = MAX_TICKS) -> list[datetime]:
    """Fire times t with after < t <= until, oldest first (at most ``limit``, the newest kept)."""
    out: list[datetime] = []
    t = after
    while True:
        t = next_after(spec, zone, t)
        if t > until:
            return out
        out.append(t)
        if len(out) > limit:
            del out[0]


@dataclass
class Plan:
    """What one scheduler pass does for one entry."""

    fire: datetime | None = None
    """The newest due tick inside the catch-up window: enqueue it."""
    coalesced: list[datetime] = field(default_factory=list)
    """Older due ticks inside the window: superseded by ``fire`` (recorded, not run)."""
    missed: list[datetime] = field(default_factory=list)
    """Due ticks older than the window: recorded as missed, not run."""


def plan(spec: CronSpec, zone: ZoneInfo, cursor: datetime, now: datetime, window_s: float) -> Plan:
    """Decide the due ticks of one entry since ``cursor`` (the last instant a scheduler
    handled) up to ``now``. Normally that is zero or one tick, fired. After the schedulers
    were all down, the newest tick within ``window_s`` fires once and every other due tick
    is recorded (coalesced, or missed when older than the window)."""
    due = ticks_between(spec, zone, cursor, now)
    p = Plan()
    horizon = now - timedelta(seconds=window_s)
    inside = [t for t in due if t >= horizon]
    p.missed = [t for t in due if t < horizon]
    if inside:
        p.fire = inside[-1]
        p.coalesced = inside[:-1]
    return p


def recovered_cursor(now: datetime, registered_at: datetime | None, newest_row: datetime | None) -> datetime:
    """Where an entry's cursor starts again when Redis has lost it (no persistence, a
    FLUSHALL, a new Redis after a failover): the newest instant durable knowledge says was
    handled — the newest tick with a ``cron_runs`` row (run, missed or coalesced), or the
    entry's registration time (its first scheduler's start) when it has no row — never
    later than ``now``. A row wins over the registration even when older: an entry whose
    registration was first written by an upgrade (after rows existed) must not start at
    the upgrade. Ticks due since then are planned as usual (``plan``: fired within
    the catch-up window, recorded missed past it). With no knowledge at all (first start
    ever) it is ``now``: no backfill. Restarting from "now" after a lost cursor skipped a
    pay-run tick due meanwhile with no DUE, no MISSED and no row."""
    start = newest_row if newest_row is not None else registered_at
    return now if start is None else min(start, now)


def ledger_unsure(role: str | None, embedded_redis: bool, ledger_exists: bool, ticks_recorded: bool,
                  ledger_here: bool = False) -> str | None:
    """Why a scheduler's own ledger cannot rebuild a lost cursor (None: it can).

    Ticks are recorded (``cron_runs`` rows) only in the ledger of the control worker that
    runs them, on the control host. A scheduler elsewhere (external Redis, started in a
    directory of its own) has an empty ledger whose only fact is its own start: resuming
    from it recorded a tick that ran as MISSED (started long ago), or skipped one due during
    the outage without a word (started since), whenever it rebuilt the cursor first. So a
    ledger judges only when it is sure to be the ticks' ledger:

    - its data directory is the control host's: ``payrun up`` wrote ``all`` to its
      supervisor.role (``role``; None when there is none), or its Redis is the embedded
      one (a unix socket in this directory: the control worker is here too);
    - or a tick was ever recorded in it (``ticks_recorded``);
    - or the `payrun ledger` that applies the workers' events runs on this host, on this
      ledger file (``ledger_here``: its lease in Redis, keys.LEDGER_OWNER, renewed every few
      seconds, so back soon after Redis lost everything): a control host started by hand,
      with plain supervisord and an external Redis, has no supervisor.role and, before its
      first tick, no row; without this its schedulers never made a cursor, so never fired.

    Any other scheduler leaves a lost cursor to one that can tell: its ticks wait (`payrun
    schedule` says DUE), and nothing is judged from what it cannot know."""
    if ticks_recorded or ledger_here or role == "all" or (embedded_redis and role != "worker"):
        return None
    if not ledger_exists and role == "worker":
        return "no ledger on this host (a worker host's data directory)"
    return ("this host's ledger cannot tell which ticks ran: none was ever recorded in it, its data directory is "
            "not the control host's (`payrun up` there writes supervisor.role), and no `payrun ledger` runs here on it")


# ---- entries from the config ---------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    name: str
    cron: str
    job: str
    spec: CronSpec
    month: str = "previous"
    """payroll only: which month a tick pays, relative to its local date ("previous" or "current")."""


def entry_problems(entries: object) -> list[str]:
    """Every problem in the configured entries, each naming the entry and the reason."""
    problems: list[str] = []
    if not isinstance(entries, list):
        return [f"scheduler.entries must be a list of tables, got {entries!r}"]
    seen: set[str] = set()
    for i, e in enumerate(entries):
        where = f"scheduler.entries[{i}]"
        if not isinstance(e, dict):
            problems.append(f"{where} must be a table with name, cron and job, got {e!r}")
            continue
        name = e.get("name")
        if isinstance(name, str) and name:
            where = f"cron entry '{name}'"
        unknown = sorted(set(e) - {"name", "cron", "job", "month"})
        if unknown:
            problems.append(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: name, cron, job, month)")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            problems.append(f"{where}: name must be 1-40 characters of a-z, 0-9, '-' or '_', got {name!r}")
        elif name in seen:
            problems.append(f"{where}: the name is used twice")
        else:
            seen.add(name)
        job = e.get("job")
        if job not in JOBS:
            problems.append(f"{where}: unknown job {job!r} (choose from {', '.join(JOBS)})")
        try:
            parse(e.get("cron"))
        except CronError as err:
            problems.append(f"{where}: invalid cron {e.get('cron')!r}: {err}")
        if "month" in e and (job != "payroll" or e["month"] not in ("previous", "current")):
            problems.append(f"{where}: month must be 'previous' or 'current', and only for job 'payroll'")
    return problems


def load_entries(entries: object) -> list[Entry]:
    """Parsed entries, or ConfigError naming each bad entry and why."""
    problems = entry_problems(entries)
    if problems:
        raise ConfigError("invalid schedule: " + "; ".join(problems))
    return [Entry(name=e["name"], cron=e["cron"], job=e["job"], spec=parse(e["cron"]),
                  month=e.get("month", "previous")) for e in entries]  # type: ignore[union-attr]


# ---- small helpers ---------------------------------------------------------------

def stamp(t: datetime) -> str:
    """A tick's compact UTC name, used in job ids and Redis keys: 20261130T2000Z."""
    return t.astimezone(UTC).strftime("%Y%m%dT%H%MZ")


def iso(t: datetime) -> str:
    """A tick's scheduled time as it travels in jobs and rows: UTC ISO 8601."""
    return t.astimezone(UTC).isoformat(timespec="seconds")


def from_iso(text: str) -> datetime:
    t = datetime.fromisoformat(text)
    if t.tzinfo is None:
        raise ValueError(f"scheduled time {text!r} has no zone")
    return t.astimezone(UTC)


def pay_month(scheduled_for: datetime, zone: ZoneInfo, which: str = "previous") -> str:
    """The month a pay-run tick pays: by default the month before the tick's local date
    (the tick of 1 December 02:00 pays November)."""
    local = scheduled_for.astimezone(zone)
    if which == "current":
        return f"{local.year:04d}-{local.month:02d}"
    y, m = (local.year, local.month - 1) if local.month > 1 else (local.year - 1, 12)
    return f"{y:04d}-{m:02d}"


_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_duration(text: str) -> timedelta:
    """'30m', '2h', '1h30m', '45s', '1d' -> timedelta. ValueError otherwise."""
    if "M" in (text or ""):  # ('1M' read as a minute: a reminder meant for next month went out at once)
        raise ValueError(f"{text!r}: M could mean minutes or months: write m for minutes "
                         f"(days are d; months are not a unit here)")
    t = (text or "").strip().lower()
    m = _DURATION.fullmatch(t)
    if not t or not m or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration like 30m, 2h, 1h30m or 45s")
    d, h, mi, s = (int(g or 0) for g in m.groups())
    if not (d or h or mi or s):
        raise ValueError(f"{text!r} is no time at all: give a duration like 30m, 2h, 1h30m or 45s")
    try:
        return timedelta(days=d, hours=h, minutes=mi, seconds=s)
    except OverflowError:
        raise ValueError(f"{text[:40]!r} is too long a time") from None
