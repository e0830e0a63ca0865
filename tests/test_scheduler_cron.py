"""Cron arithmetic (pure functions, the clock passed in) and schedule configuration."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from payrun import config as config_mod
from payrun.errors import ConfigError
from scheduler import cron

UTC = timezone.utc
DHAKA = ZoneInfo("Asia/Dhaka")


def utc(*a) -> datetime:
    return datetime(*a, tzinfo=UTC)


def test_pay_run_fires_at_two_in_dhaka_whatever_the_host_zone():
    t = cron.next_after(cron.parse("0 2 1 * *"), DHAKA, utc(2026, 11, 15))
    assert t == utc(2026, 11, 30, 20, 0)  # 1 December 02:00 +06
    assert t.astimezone(DHAKA).strftime("%d %H:%M") == "01 02:00"
    assert cron.pay_month(t, DHAKA) == "2026-11" and cron.pay_month(t, DHAKA, "current") == "2026-12"
    # the same expression in another zone is another instant
    assert cron.next_after(cron.parse("0 2 1 * *"), ZoneInfo("UTC"), utc(2026, 11, 15)) == utc(2026, 12, 1, 2, 0)


def test_steps_ranges_lists_names_and_day_or_semantics():
    z = ZoneInfo("UTC")
    assert [t.minute for t in cron.ticks_between(cron.parse("*/15 * * * *"), z, utc(2026, 1, 1), utc(2026, 1, 1, 1))] \
        == [15, 30, 45, 0]
    assert cron.parse("10-20/5,58 * * * *").minutes == (10, 15, 20, 58)
    assert cron.parse("0 0 * jan-mar mon").months == frozenset({1, 2, 3})
    assert cron.parse("0 0 * * 7").weekdays == frozenset({0})  # 7 = Sunday
    # both day fields restricted: either matches (1st of the month OR a Monday)
    days = {t.day for t in cron.ticks_between(cron.parse("0 0 1 * mon"), z, utc(2026, 6, 1), utc(2026, 6, 30))}
    assert days == {8, 15, 22, 29}  # the 1st is excluded by after=00:00 exactly
    assert cron.next_after(cron.parse("@monthly"), z, utc(2026, 6, 2)) == utc(2026, 7, 1)
    assert cron.next_after(cron.parse("0 0 29 2 *"), z, utc(2026, 3, 1)) == utc(2028, 2, 29)


@pytest.mark.parametrize("expr, reason", [
    ("0 25 * * *", "hour: 25 is out of range 0-23"),
    ("* * *", "needs 5 fields"),
    ("*/0 * * * *", "step '0'"),
    ("0 0 31 2 *", "never occurs"),
    ("x * * * *", "minute: 'x' is not a number"),
    ("5-1 * * * *", "goes backwards"),
    ("@often", "unknown macro"),
    ("", "empty"),
    # security review (session 31): str.isdigit() took these, and int() raised a bare
    # ValueError (a traceback from every command) or read Arabic-Indic digits as 12
    ("² * * * *", "minute: '²' is not a number"),
    ("*/² * * * *", "step '²'"),
    ("١٢ * * * *", "minute: '١٢' is not a number"),
    ("1" + "0" * 5000 + " * * * *", "is not a number"),
    ("0 0 1 * */99999", "step '99999'"),
])
def test_bad_expressions_say_why(expr, reason):
    with pytest.raises(cron.CronError, match=reason):
        cron.parse(expr)


def test_daylight_saving_gap_skips_and_overlap_fires_once():
    ny = ZoneInfo("America/New_York")
    gap = cron.ticks_between(cron.parse("30 2 * * *"), ny, utc(2026, 3, 7), utc(2026, 3, 10))
    assert [t.astimezone(ny).day for t in gap] == [7, 9]  # 8 March 02:30 does not exist
    overlap = cron.ticks_between(cron.parse("30 1 * * *"), ny, utc(2026, 10, 31), utc(2026, 11, 3))
    assert [t.astimezone(ny).day for t in overlap] == [31, 1, 2]  # 1 November 01:30 happens twice, fires once


def test_plan_fires_the_due_tick_then_nothing():
    spec = cron.parse("0 2 1 * *")
    p = cron.plan(spec, DHAKA, utc(2026, 11, 30, 19, 59), utc(2026, 11, 30, 20, 0, 1), 21600)
    assert p.fire == utc(2026, 11, 30, 20) and not p.missed and not p.coalesced
    p = cron.plan(spec, DHAKA, utc(2026, 11, 30, 20, 0, 1), utc(2026, 11, 30, 20, 5), 21600)
    assert p.fire is None and not p.missed


def test_plan_catch_up_within_the_window_and_missed_past_it():
    spec = cron.parse("0 2 1 * *")
    down = utc(2026, 11, 30, 19, 0)  # last pass: 01:00 Dhaka; nobody ran at 02:00
    back = cron.plan(spec, DHAKA, down, utc(2026, 12, 1, 1, 59), 21600)  # 07:59 Dhaka: 5 h 59 late
    assert back.fire == utc(2026, 11, 30, 20) and not back.missed
    late = cron.plan(spec, DHAKA, down, utc(2026, 12, 1, 2, 1), 21600)  # 6 h 1 min late
    assert late.fire is None and late.missed == [utc(2026, 11, 30, 20)]


def test_a_lost_cursor_resumes_from_the_newest_row_or_the_registration_never_from_now():
    """Ops drill: Redis lost the cursor while the 1st's 02:00 tick passed; restarting from
    "now" skipped the pay run with no DUE, no MISSED and no row."""
    now = utc(2026, 11, 30, 21, 0)  # 03:00 Dhaka on the 1st
    registered, row = utc(2026, 10, 2, 4, 0), utc(2026, 10, 31, 20, 0)
    assert cron.recovered_cursor(now, None, None) == now                 # first start ever: no backfill
    assert cron.recovered_cursor(now, registered, None) == registered    # no row yet: since registration
    assert cron.recovered_cursor(now, registered, row) == row            # the newest tick with a row
    # a row wins over a later registration (first written by an upgrade, after rows existed)
    assert cron.recovered_cursor(now, utc(2026, 11, 30, 20, 30), row) == row
    assert cron.recovered_cursor(now, now + timedelta(hours=1), None) == now  # never in the future


def test_only_a_ledger_sure_to_be_the_control_hosts_rebuilds_a_lost_cursor():
    """A scheduler in a directory of its own (external Redis) rebuilt a lost cursor from its
    empty ledger: a tick that ran recorded MISSED, or one due during the outage skipped."""
    sure = [
        ("all", False, True, False),      # `payrun up` on the control host, before any tick
        (None, True, True, False),        # the embedded Redis: a unix socket in this directory
        (None, False, True, True),        # a tick was recorded in it: the control worker writes here
        ("worker", False, True, True),
        (None, False, True, False, True),  # `payrun ledger` runs here on this file: a control host by hand
    ]
    for args in sure:
        assert cron.ledger_unsure(*args) is None, args
    foreign = cron.ledger_unsure(None, False, True, False)  # its own empty ledger, external Redis
    assert foreign and "cannot tell which ticks ran" in foreign and "supervisor.role" in foreign
    assert cron.ledger_unsure(None, False, False, False) == foreign
    assert cron.ledger_unsure("worker", True, True, False) == foreign  # (a worker host's ledger, no tick in it)
    assert "no ledger on this host" in cron.ledger_unsure("worker", False, False, False)


def test_a_lost_cursor_catches_up_the_pay_run_within_the_window_and_records_it_missed_past_it():
    spec = cron.parse("0 2 1 * *")
    row = utc(2026, 10, 31, 20, 0)  # November's tick ran (its row); Redis lost the cursor since
    inside = utc(2026, 12, 1, 1, 0)  # 07:00 Dhaka on 1 December: 5 h late
    p = cron.plan(spec, DHAKA, cron.recovered_cursor(inside, None, row), inside, 21600)
    assert p.fire == utc(2026, 11, 30, 20) and not p.missed and not p.coalesced
    past = utc(2026, 12, 1, 3, 0)  # 09:00 Dhaka: 7 h late
    p = cron.plan(spec, DHAKA, cron.recovered_cursor(past, None, row), past, 21600)
    assert p.fire is None and p.missed == [utc(2026, 11, 30, 20)]
    # the tick that has a row is not due again: a month already run by cron does not fire twice
    ran = utc(2026, 11, 30, 20, 0)
    p = cron.plan(spec, DHAKA, cron.recovered_cursor(inside, None, ran), inside, 21600)
    assert p.fire is None and not p.missed


def test_plan_coalesces_frequent_ticks_after_downtime():
    spec = cron.parse("*/15 * * * *")
    p = cron.plan(spec, DHAKA, utc(2026, 1, 1, 0, 0), utc(2026, 1, 1, 8, 7), 6 * 3600)
    assert p.fire == utc(2026, 1, 1, 8, 0)
    assert len(p.coalesced) == 23 and p.coalesced[0] == utc(2026, 1, 1, 2, 15)  # inside the 6 h window
    assert len(p.missed) == 8 and p.missed[-1] == utc(2026, 1, 1, 2, 0)          # 00:15 .. 02:00


def test_entries_are_validated_by_name_with_the_reason():
    problems = cron.entry_problems([
        {"name": "payroll", "cron": "0 2 1 * *", "job": "payrol"},
        {"name": "bank", "cron": "61 * * * *", "job": "bank-status"},
        {"name": "bank", "cron": "* * * * *", "job": "reaper", "extra": 1},
        {"name": "sup", "cron": "0 ² 1 * *", "job": "payroll"},
    ])
    assert "cron entry 'payroll': unknown job 'payrol'" in problems[0]
    assert "cron entry 'bank': invalid cron '61 * * * *': minute: 61 is out of range 0-59" in problems[1]
    assert any("used twice" in p for p in problems) and any("unknown key(s) extra" in p for p in problems)
    assert "cron entry 'sup': invalid cron '0 ² 1 * *': hour: '²' is not a number" in problems[-1]
    assert [e.name for e in cron.load_entries(config_mod.Config().scheduler.entries)] == \
        ["payroll", "bank-status", "reaper"]


def test_config_refuses_a_bad_entry(tmp_path):
    conf = tmp_path / "p.toml"
    conf.write_text('[[scheduler.entries]]\nname = "payroll"\ncron = "0 2 31 2 *"\njob = "payroll"\n')
    with pytest.raises(ConfigError, match="cron entry 'payroll': invalid cron '0 2 31 2 \\*': day of month"):
        config_mod.load(conf, env={})


def test_payrun_scheduler_refuses_a_bad_entry_in_one_line(tmp_path):
    conf = tmp_path / "p.toml"
    conf.write_text('[[scheduler.entries]]\nname = "nightly"\ncron = "0 2 * * *"\njob = "backup"\n')
    out = subprocess.run([sys.executable, "-m", "payrun.cli", "--config", str(conf), "scheduler"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                         "PAYRUN_HOME": str(tmp_path)})
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("payrun: ") and "cron entry 'nightly': unknown job 'backup'" in lines[0]


def test_durations():
    assert cron.parse_duration("30m") == timedelta(minutes=30)
    assert cron.parse_duration("1h30m") == timedelta(hours=1, minutes=30)
    for bad in ("", "30", "m", "1x"):
        with pytest.raises(ValueError):
            cron.parse_duration(bad)


def test_a_capital_m_in_a_duration_is_refused_as_minutes_or_months():
    """`payrun remind --in 1M` (a month, meant) scheduled the reminders a minute away."""
    for text in ("1M", "30M", "1h30M"):
        with pytest.raises(ValueError, match="M could mean minutes or months"):
            cron.parse_duration(text)
    assert cron.parse_duration("2H") == timedelta(hours=2)  # the other units are not ambiguous
    assert cron.parse_duration("30m") == timedelta(minutes=30)
