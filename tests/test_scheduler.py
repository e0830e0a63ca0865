"""Cron that fires once, with real processes: two `payrun scheduler` processes on a
controllable clock (PAYRUN_CLOCK_FILE, test-only), real control workers, real signals;
plus the one-off (resend) and delayed (remind) jobs and the simulated bank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
from rq.registry import ScheduledJobRegistry

from conftest import wait_for
from jobs import reaper
from jobs.runtime import PayrunJob, make_queue
from payrun import keys, payroll, runs
from payrun.ledger import Ledger
from scheduler import cron, service, ticks
from scheduler.bank import Bank, credit_status
from scheduler.store import Store

UTC = timezone.utc
MONTH = "2026-11"
PAY_TICK = datetime(2026, 11, 30, 20, 0, tzinfo=UTC)  # 1 December 02:00 Asia/Dhaka


def utc(*a) -> datetime:
    return datetime(*a, tzinfo=UTC)


@pytest.fixture
def world(cfg, conn, tmp_path, monkeypatch):
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=2, employees=12, seed=3, month=MONTH)
    db.close()
    bank = Bank(cfg.payroll_path).start()
    (cfg.home / "supervisor.role").write_text("all")  # the control host's data directory, as `payrun up` marks it
    clock_file = tmp_path / "clock"
    yield {"cfg": cfg, "conn": conn, "tmp": tmp_path, "bank": bank, "clock": clock_file, "mp": monkeypatch}
    bank.stop()


def set_clock(path, t: datetime) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(repr(t.timestamp()))
    os.replace(tmp, path)


def write_config(w, entries: list[dict], **sched) -> dict:
    lines = ["[scheduler]", f'bank_url = "{w["bank"].url}"', "poll_s = 0.1"]
    lines += [f"{k} = {v!r}" for k, v in sched.items()]
    for e in entries:
        lines += ["[[scheduler.entries]]"] + [f'{k} = "{v}"' for k, v in e.items()]
    conf = w["tmp"] / "payrun.toml"
    conf.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PAYRUN_CONFIG=str(conf), PAYRUN_CLOCK_FILE=str(w["clock"]))
    w["mp"].setenv("PAYRUN_CONFIG", str(conf))  # this process too (ticks run in-process here and there)
    from jobs import tasks
    from payrun import config as config_mod

    tasks.settings.cache_clear()
    w["cfg"] = config_mod.load()
    return env


def spawn(env, *args, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "payrun.cli", *args], env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def stop(p: subprocess.Popen, timeout: float = 30) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def marker(conn, entry: str, t: datetime) -> bytes | None:
    return conn.get(service.marker_key(entry, cron.stamp(t)))


def job_ids(conn, prefix: str) -> set[str]:
    return {k.decode()[len("rq:job:"):] for k in conn.scan_iter(f"rq:job:{prefix}*", count=1000)}


def rows(w, entry: str | None = None) -> list[dict]:
    s = Store(w["cfg"].ledger_path)
    try:
        return s.ticks(entry)
    finally:
        s.close()


ENTRIES = [
    {"name": "payroll", "cron": "0 2 1 * *", "job": "payroll"},
    {"name": "bank-status", "cron": "*/15 * * * *", "job": "bank-status"},
    {"name": "reaper", "cron": "*/5 * * * *", "job": "reaper"},
]


def test_two_schedulers_each_tick_once_in_the_ledger_and_one_set_of_jobs_in_redis(world):
    w, conn = world, world["conn"]
    env = write_config(w, ENTRIES)
    start = PAY_TICK - timedelta(minutes=2, seconds=30)
    set_clock(w["clock"], start)
    scheds = [spawn(env, "scheduler", "--name", f"sched-{c}", log=w["tmp"] / f"sched-{c}.log") for c in "ab"]
    control = spawn(env, "worker", "control", log=w["tmp"] / "control.log")
    try:
        wait_for(lambda: all(conn.exists(service.cursor_key(e["name"])) for e in ENTRIES), timeout_s=30,
                 what="the schedulers' first pass")
        expected: dict[str, list[datetime]] = {"payroll": [], "bank-status": [], "reaper": []}
        for step in range(12):  # 01:57:30 .. 02:57:30 Dhaka, one reaper tick per step
            tick = PAY_TICK + timedelta(minutes=5 * step)
            set_clock(w["clock"], tick + timedelta(seconds=7))
            due = ["reaper"] + (["bank-status"] if tick.minute % 15 == 0 else []) + (["payroll"] if step == 0 else [])
            for name in due:
                expected[name].append(tick)
                wait_for(lambda: (marker(conn, name, tick) or b"").startswith(b"fired:"), timeout_s=15,
                         what=f"{name} tick {tick}")
        # every tick job ran, and everything it created was made once
        total = sum(len(v) for v in expected.values())
        wait_for(lambda: sum(1 for r in rows(w) if r["status"] == "enqueued") == total, timeout_s=90,
                 interval_s=0.3, what="every tick to finish")
        wait_for(lambda: make_queue(keys.CONTROL_QUEUE, conn).count == 0 and conn.zcard("rq:wip:control") == 0,
                 timeout_s=60, what="control queue empty and nothing running")
    finally:
        for p in scheds + [control]:
            stop(p)
    ledger_rows = rows(w)
    assert len(ledger_rows) == total  # exactly one row per tick, no extras
    for name, times in expected.items():
        assert sorted(r["scheduled_for"] for r in rows(w, name)) == [cron.iso(t) for t in times]
    assert all(r["duplicates_stopped"] == 0 and r["status"] == "enqueued" for r in ledger_rows)
    # Redis: one tick job per tick, each run once
    tick_ids = job_ids(conn, "tick-")
    assert tick_ids == {ticks.tick_job_id(n, cron.stamp(t)) for n, ts in expected.items() for t in ts}
    for jid in tick_ids:
        job = PayrunJob.fetch(jid, connection=conn)
        assert job.get_status() == "finished" and job.meta["attempt"] == 1, jid
    # ... and one set of real jobs: one reaper job per reaper tick, 12 render jobs, bank
    # checks (2 companies) for the bank ticks after the pay run
    assert len(job_ids(conn, "reap-")) == 12
    assert make_queue(keys.RENDER_QUEUE, conn).count == 12 and len(job_ids(conn, "render-")) == 12
    bank_jobs = job_ids(conn, "bank-")
    # the 02:15 tick surely comes after the pay run: it checks both companies. Later ticks
    # skip a company whose every salary already reached its account, which depends on
    # whether the earlier checks had run by then (and the 02:00 tick may precede the pay run)
    by_tick = {r["scheduled_for"]: r["jobs"] for r in rows(w, "bank-status")}
    assert by_tick[cron.iso(PAY_TICK + timedelta(minutes=15))] == 2, by_tick
    assert len(bank_jobs) == sum(by_tick.values()) and len(bank_jobs) in (4, 6, 8), by_tick
    # the bank check recorded, per employee, whether the salary reached the account
    s = Store(w["cfg"].ledger_path)
    try:
        got = {r["employee_id"]: r["status"] for r in s.db.query("SELECT * FROM bank_credits WHERE month = ?", (MONTH,))}
    finally:
        s.close()
    assert len(got) == 12 and all(st == credit_status(7, MONTH, e)[0] for e, st in got.items())
    fired_by = {(conn.get(service.marker_key(n, cron.stamp(t))) or b"").decode() for n, ts in expected.items() for t in ts}
    print("ticks fired by:", sorted(fired_by))


def test_concurrent_cron_passes_claim_each_tick_once(world):
    """Many passes at once, same clock (no rq-scheduler lock): the markers alone decide."""
    import threading

    w, conn = world, world["conn"]
    write_config(w, [{"name": "reaper", "cron": "* * * * *", "job": "reaper"}])
    t0 = utc(2026, 11, 30, 20, 0, 30)
    passes = [service.CronPass(conn, w["cfg"], name=f"p{i}") for i in range(8)]
    passes[0].run(t0)  # the cursor starts here
    for minute in range(1, 11):
        now = t0 + timedelta(minutes=minute)
        barrier = threading.Barrier(len(passes))

        def go(p, now=now):
            barrier.wait()
            p.run(now)

        threads = [threading.Thread(target=go, args=(p,)) for p in passes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert make_queue(keys.CONTROL_QUEUE, conn).count == 10
    assert len(set(make_queue(keys.CONTROL_QUEUE, conn).get_job_ids())) == 10


def pause_pids(paths) -> list[int]:
    return [int(p.read_text()) for p in paths]


def test_paused_owner_lock_expires_unique_row_stops_second_run_and_owner_enqueues_nothing(world):
    w, conn = world, world["conn"]
    env = write_config(w, [{"name": "bank-status", "cron": "*/15 * * * *", "job": "bank-status"}], lock_ttl_s=2)
    ledger = Ledger(w["cfg"].ledger_path)
    for cid in (1, 2):  # a pay run exists, so the bank check has work to create
        ledger.claim_run(cid, MONTH, "earlier")
        ledger.finish_run(cid, MONTH, 6)
    ledger.close()
    tick = utc(2026, 12, 1, 4, 0)
    entry = service.CronPass(conn, w["cfg"]).entries[0]
    assert service.CronPass(conn, w["cfg"]).fire(entry, tick) == "fired"
    lock = ticks.lock_key("bank-status", cron.stamp(tick))
    pause_dir = w["tmp"] / "pause"
    pause_dir.mkdir()
    a = spawn(dict(env, PAYRUN_TEST_TICK_PAUSE=str(pause_dir)), "worker", "control", log=w["tmp"] / "a.log")
    b, horse = None, None
    try:
        reached = pause_dir / "reached-bank-status-after-row"
        wait_for(reached.exists, timeout_s=30, what="the first run to insert its row")
        horse = int(reached.read_text())
        assert conn.get(lock)  # the owner holds the lock, and its row is in
        for pid in (a.pid, horse):  # the whole server pauses (GC, VM, SIGSTOP)
            os.kill(pid, signal.SIGSTOP)
        (pause_dir / "go").write_text("")
        wait_for(lambda: not conn.exists(lock), timeout_s=10, what="the paused owner's lock to expire")
        # its liveness lapses; the reaper hands the tick to another control worker
        returned = wait_for(lambda: reaper.reap(conn), timeout_s=30, interval_s=0.5, what="the reaper")
        assert [s.job_id for s in returned] == [ticks.tick_job_id("bank-status", cron.stamp(tick))]
        b = spawn(env, "worker", "control", log=w["tmp"] / "b.log")
        wait_for(lambda: (rows(w, "bank-status") or [{}])[0].get("duplicates_stopped") == 1, timeout_s=30,
                 what="the second run to be stopped by the unique row")
        assert job_ids(conn, "bank-") == set()
        for pid in (horse, a.pid):
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: rows(w, "bank-status")[0]["status"] == "aborted", timeout_s=30,
                 what="the woken owner to give up")
    finally:  # (a failed assertion above must not leave the horse stopped for good)
        for pid in (a.pid, horse):
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop(a)
        if b is not None:
            stop(b)
    row = rows(w, "bank-status")[0]
    assert row["duplicates_stopped"] == 1 and row["jobs"] == 0 and "paused" in row["detail"]
    assert job_ids(conn, "bank-") == set()  # nobody enqueued the tick's work twice — or at all
    assert make_queue(keys.CONTROL_QUEUE, conn).count == 0


def test_catch_up_fires_a_missed_tick_once_within_the_window_and_records_it_past_the_window(world):
    w, conn = world, world["conn"]
    env = write_config(w, [ENTRIES[0], ENTRIES[1]])
    set_clock(w["clock"], PAY_TICK - timedelta(hours=1))  # 01:00 Dhaka
    s = spawn(env, "scheduler", log=w["tmp"] / "s1.log")
    wait_for(lambda: conn.exists(service.cursor_key("payroll")), timeout_s=30, what="the first pass")
    stop(s)
    # 02:30 and no scheduler ran at 02:00: `payrun schedule` says the tick is due, not
    # "next 1 January" (a walkthrough read that at a tick overdue)
    set_clock(w["clock"], PAY_TICK + timedelta(minutes=30))
    view = subprocess.run([sys.executable, "-m", "payrun.cli", "schedule"], env=env, timeout=60,
                          capture_output=True, text=True, check=True).stdout
    assert "DUE since 2026-12-01 02:00 Asia/Dhaka (20:00 UTC), not fired yet" in view, view
    assert "catch-up window (6 h)" in view
    # nobody runs at 02:00; one scheduler is back at 07:30 (5 h 30 late, inside 6 h)
    set_clock(w["clock"], PAY_TICK + timedelta(hours=5, minutes=30))
    s = spawn(env, "scheduler", log=w["tmp"] / "s2.log")
    try:
        wait_for(lambda: (marker(conn, "payroll", PAY_TICK) or b"").startswith(b"fired:"), timeout_s=30,
                 what="the missed pay-run tick to fire on return")
        wait_for(lambda: float(conn.get(service.cursor_key("payroll"))) >= (PAY_TICK + timedelta(hours=5)).timestamp(),
                 timeout_s=10, what="the pass to finish")
    finally:
        stop(s)
    assert job_ids(conn, "tick-payroll-") == {ticks.tick_job_id("payroll", cron.stamp(PAY_TICK))}
    # bank-status every 15 min: the newest due tick fires once, the others are superseded
    bank_ticks = job_ids(conn, "tick-bank-status-")
    assert bank_ticks == {ticks.tick_job_id("bank-status", cron.stamp(PAY_TICK + timedelta(hours=5, minutes=30)))}
    tick_job = PayrunJob.fetch(ticks.tick_job_id("payroll", cron.stamp(PAY_TICK)), connection=conn)
    assert tick_job.args[2] == "2026-11-30T20:00:00+00:00"  # it carries the time it stands for
    # down again until 1 January 11:00 Dhaka: the 02:00 tick is 9 h old, past the window
    jan = utc(2026, 12, 31, 20, 0)
    set_clock(w["clock"], jan + timedelta(hours=9))
    s = spawn(env, "scheduler", log=w["tmp"] / "s3.log")
    try:
        wait_for(lambda: conn.get(service.marker_key("payroll", "missed-" + cron.stamp(jan))), timeout_s=30,
                 what="the missed tick to be recorded")
    finally:
        stop(s)
    assert ticks.tick_job_id("payroll", cron.stamp(jan)) not in job_ids(conn, "tick-payroll-")
    assert "MISSED 1 tick(s)" in (w["tmp"] / "s3.log").read_text()  # on the console
    subprocess.run([sys.executable, "-m", "payrun.cli", "worker", "control", "--burst"], env=env, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    by_time = {r["scheduled_for"]: r for r in rows(w, "payroll")}  # and in the ledger
    assert by_time[cron.iso(PAY_TICK)]["status"] == "enqueued" and by_time[cron.iso(PAY_TICK)]["jobs"] == 12, by_time
    missed = by_time[cron.iso(jan)]
    assert missed["status"] == "missed" and "payrun run --month 2026-12" in missed["detail"]
    view = subprocess.run([sys.executable, "-m", "payrun.cli", "schedule", "--json"], env=env, timeout=60,
                          capture_output=True, text=True, check=True)
    payroll_view = next(e for e in json.loads(view.stdout)["entries"] if e["name"] == "payroll")
    assert payroll_view["missed"] == 1 and payroll_view["last_run"] == cron.iso(PAY_TICK)
    assert "payrun run --month 2026-12" in payroll_view["missed_detail"] and payroll_view["due_since"] is None
    from payrun.audit import read_audit

    runs_audited = [e for e in read_audit(w["cfg"]) if e["what"] == "run"]  # who started the run: cron
    assert [(e["via"], e["count"]) for e in runs_audited] == [("cron", 12)], runs_audited
    assert runs_audited[0]["command"] == f"cron payroll ({cron.iso(PAY_TICK)}): payrun run --month 2026-11"
    text = subprocess.run([sys.executable, "-m", "payrun.cli", "schedule"], env=env, timeout=60,
                          capture_output=True, text=True, check=True).stdout
    assert "MISSED 1 tick(s), newest 2027-01-01 02:00 Asia/Dhaka (20:00 UTC 2026-12-31) — " in text and "payrun run --month 2026-12" in text, text
    assert payroll_view["next_local"].startswith("2027-02-01T02:00:00+06:00")
    assert payroll_view["next_utc"].startswith("2027-01-31T20:00:00+00:00")


def test_cron_and_payrun_run_for_the_same_month_make_one_set_of_jobs(world):
    w, conn = world, world["conn"]
    env = write_config(w, [ENTRIES[0]])
    entry = service.CronPass(conn, w["cfg"]).entries[0]
    assert service.CronPass(conn, w["cfg"]).fire(entry, PAY_TICK) == "fired"
    procs = [
        subprocess.Popen([sys.executable, "-m", "payrun.cli", "run", "--month", MONTH, "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL),
        subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", "control", "--burst"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    for p in procs:
        p.wait(timeout=120)
    wait_for(lambda: rows(w, "payroll") and rows(w, "payroll")[0]["status"] != "running", timeout_s=30,
             what="the tick's outcome")
    assert make_queue(keys.RENDER_QUEUE, conn).count == 12 and len(job_ids(conn, "render-")) == 12
    ledger = Ledger(w["cfg"].ledger_path)
    assert len(ledger.jobs(kind="render", limit=100)) == 12 and len(ledger.runs(MONTH)) == 2
    ledger.close()
    # either side may have won; together they made one set
    run_out = json.loads(procs[0].stdout.read() or b"{}")
    assert run_out["jobs_created"] + rows(w, "payroll")[0]["jobs"] == 12


def test_a_delayed_reminder_is_not_runnable_before_its_time_and_runs_soon_after(world, monkeypatch):
    from console.data import read_queues
    from payrun.provider import Provider

    w, conn = world, world["conn"]
    provider = Provider(latency_s=0.01, rate_per_s=1000).start()
    try:
        env = write_config(w, [ENTRIES[0]])
        env["PAYRUN_EMAIL_URL"] = provider.url
        sender = spawn(env, "worker", "send-email", "--lanes", "4", log=w["tmp"] / "send.log")
        try:
            out = subprocess.run([sys.executable, "-m", "payrun.cli", "remind", "--company", "1", "--in", "4s",
                                  "--json"], env=env, capture_output=True, text=True, timeout=60, check=True)
            res = json.loads(out.stdout)
            due = datetime.fromisoformat(res["due_at"])
            n = res["scheduled"]
            assert n >= 1
            queue = make_queue(keys.EMAIL_QUEUE, conn)
            registry = ScheduledJobRegistry(queue=queue)
            assert set(registry.get_job_ids()) == set(res["jobs"]) and queue.count == 0
            # `payrun queues` counts them as "later", not as retrying (both wait in that registry)
            (row,) = [r for r in read_queues(conn, time.time())[0] if r.name == keys.EMAIL_QUEUE]
            assert (row.retrying, row.later) == (0, n)
            assert all(PayrunJob.fetch(j, connection=conn).get_status() == "scheduled" for j in res["jobs"])
            while datetime.now(UTC) < due - timedelta(seconds=0.5):  # not runnable before its time
                assert provider.stats()["delivered"] == 0 and queue.count == 0
                time.sleep(0.1)
            wait_for(lambda: provider.stats()["delivered"] == n, timeout_s=10, what="the reminders to go out")
            assert datetime.now(UTC) - due < timedelta(seconds=8)
            # the provider counts a delivery before it replies: the job ends a moment later
            wait_for(lambda: all(PayrunJob.fetch(j, connection=conn).get_status() == "finished" for j in res["jobs"]),
                     timeout_s=10, what="the reminder jobs to finish")
            for j in res["jobs"]:
                job = PayrunJob.fetch(j, connection=conn)
                assert job.started_at.replace(tzinfo=UTC) >= due - timedelta(seconds=1)  # RQ stamps whole seconds
            # they finished on the send-email queue, but are no slips: the console's delivery
            # rate (its ETA) leaves them out
            (row,) = [r for r in read_queues(conn, time.time())[0] if r.name == keys.EMAIL_QUEUE]
            assert sum(row.per_min) == sum(row.reminders_per_min) == n and row.slips_finished(10) == 0
            assert set(m.decode() for m in conn.zrange(keys.REMINDERS_SENT, 0, -1)) == set(res["jobs"])
            text = subprocess.run([sys.executable, "-m", "payrun.cli", "remind", "--company", "1", "--in", "2h"],
                                  env=env, capture_output=True, text=True, timeout=60, check=True).stdout
            assert "Asia/Dhaka (" in text and " UTC) (batch " in text, text  # the operator's clock first
        finally:
            stop(sender)
    finally:
        provider.stop()


def test_resend_rerenders_current_data_and_sends_with_a_new_key(world, monkeypatch):
    from jobs.runtime import RenderWorker, run_lanes
    from payrun.provider import Provider
    from scheduler.cli import resend

    conn = world["conn"]
    provider = Provider(latency_s=0.01, rate_per_s=1000).start()
    monkeypatch.setenv("PAYRUN_EMAIL_URL", provider.url)
    from jobs import tasks

    tasks.settings.cache_clear()
    cfg = tasks.settings()
    try:
        db = payroll.PayrollDB(cfg.payroll_path)
        ledger = Ledger(cfg.ledger_path)
        runs.start_run(cfg, conn, ledger, db, MONTH, company_id=1)

        def work():
            RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
            run_lanes(conn, [keys.EMAIL_QUEUE], lanes=2, burst=True)

        work()
        emp = db.conn.execute("SELECT id FROM employees WHERE company_id = 1 ORDER BY id").fetchone()[0]
        original = f"slip:{MONTH}:{emp}"
        assert provider.delivery(original) is not None
        db.conn.execute("UPDATE employees SET name_en = 'Renamed Person' WHERE id = ?", (emp,))
        db.conn.commit()
        first = resend(cfg, conn, ledger, db, emp, MONTH)
        second = resend(cfg, conn, ledger, db, emp, MONTH)
        assert (first["key"], second["key"]) == (f"{original}:resend-1", f"{original}:resend-2")
        work()
        stats = provider.stats()
        assert provider.delivery(first["key"]) and provider.delivery(second["key"])
        assert stats["duplicates_refused"] == 0
        import pypdf

        path = cfg.slips_dir / MONTH / "1" / f"{emp}.resend-1.pdf"
        text = "\n".join(p.extract_text() for p in pypdf.PdfReader(str(path)).pages)
        assert "Renamed Person" in text
        # a corrected slip says it replaces the one before (it looked the same as the wrong one)
        assert "Re-issued on" in text and "replaces any slip for" in text
        sent = provider.delivery(first["key"])
        assert sent["subject"].startswith("Re-issued: Your salary slip for"), sent
        assert "Re-issued" not in provider.delivery(original)["subject"]
        ledger.close()
        db.close()
    finally:
        provider.stop()


def test_the_bank_simulator_answers_credits_only_with_its_token(cfg, monkeypatch):
    """Security review: `payrun bank` served every employee's net pay to any local user on
    127.0.0.1:8026. It now wants the data directory's token, which the bank check sends for
    a bank on loopback (PAYRUN_BANK_TOKEN for a real one)."""
    import urllib.error
    import urllib.request

    from jobs.errors import PermanentError
    from payrun import config as config_mod
    from payrun import redis_server
    from scheduler.bank import bank_token, fetch_credits

    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=1, employees=3, seed=3, month=MONTH)
    db.close()
    token = redis_server.local_secret(cfg, "bank-token")
    assert oct((cfg.redis_dir / "bank-token").stat().st_mode & 0o777) == "0o600"
    bank = Bank(cfg.payroll_path, token=token).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as e:  # any local user, no token
            urllib.request.urlopen(f"{bank.url}/v1/credits?month={MONTH}&company=1", timeout=10)
        assert e.value.code == 401 and b"amount" not in e.value.read()
        with pytest.raises(PermanentError, match="HTTP 401"):
            fetch_credits(bank.url, MONTH, 1, token="wrong")
        # a token that is not ASCII is refused too (compare_digest raised on it: no answer at all)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"{bank.url}/v1/credits?month={MONTH}&company=1",
                                                          headers={"Authorization": "Bearer \xe9t\xe9"}), timeout=10)
        assert e.value.code == 401
        monkeypatch.setenv("PAYRUN_CONFIG", "")
        local = config_mod.load(env={**os.environ})
        local.scheduler.bank_url = bank.url
        assert bank_token(local) == token
        assert len(fetch_credits(bank.url, MONTH, 1, token=bank_token(local))) == 3
        local.scheduler.bank_url = "https://bank.example/api"
        assert bank_token(local) is None  # the local secret never goes to another host
        monkeypatch.setenv("PAYRUN_BANK_TOKEN", "t0ken")
        shown = config_mod.load(env={**os.environ})
        assert shown.scheduler.bank_token == "t0ken" and "t0ken" not in json.dumps(shown.to_dict())
    finally:
        bank.stop()


def test_the_bank_token_never_follows_a_redirect_to_another_address():
    """Security review (session 31): urllib follows a 302 and copies every header,
    Authorization included, to the address in its Location. A bank (or anyone on the path
    of an http:// bank URL) answering with a redirect would have been sent the token that
    reads every employee's net pay. The check now answers PermanentError and sends nothing
    further."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from jobs.errors import PermanentError
    from scheduler.bank import fetch_credits

    seen: list[tuple[str, str | None]] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"credits": []}')

        def log_message(self, *a):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    target = f"http://localhost:{other.server_address[1]}/steal"

    class Redirecting(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", target)
            self.end_headers()

        def log_message(self, *a):
            pass

    bank = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    servers = [threading.Thread(target=s.serve_forever, daemon=True) for s in (other, bank)]
    for t in servers:
        t.start()
    try:
        with pytest.raises(PermanentError, match="302.*not followed"):
            fetch_credits(f"http://127.0.0.1:{bank.server_address[1]}", MONTH, 1, timeout_s=10, token="SECRET-BANK-TOKEN")
        # the other address answers at once, so a followed redirect would have reached it by now
        assert seen == []
    finally:
        for s in (other, bank):
            s.shutdown()
            s.server_close()


def test_a_scheduler_record_lapsed_while_redis_was_away_is_made_again(cfg, conn):
    """Ops walkthrough: after a 35 s Redis restart `payrun schedule` said "schedulers alive: 0"
    while two schedulers fired ticks: rq-scheduler's heartbeat only extends its record's
    expiry, and the record had lapsed."""
    from scheduler.cli import schedulers_alive
    from scheduler.service import PayrunScheduler

    s = PayrunScheduler(cfg, conn, name="sched-x")
    s.register_birth()
    assert schedulers_alive(conn) == ["sched-x"]
    conn.delete(s.key)  # lapsed while Redis was away (or lost with its data)
    assert schedulers_alive(conn) == []
    s.heartbeat()
    assert schedulers_alive(conn) == ["sched-x"] and 0 < conn.ttl(s.key) <= int(cfg.scheduler.poll_s) + 10
    s.heartbeat()  # (the usual beat: the expiry only)
    assert schedulers_alive(conn) == ["sched-x"]


def test_a_scheduler_does_not_take_over_the_live_record_of_another_machine_with_its_name(cfg, conn):
    """supervisor.conf names the schedulers scheduler-a.<hostname>: on two control hosts
    with one hostname (containers, a cloned image) the second took the first's live record
    over (registered its death) and both went on under one name: `payrun schedule` counted
    one of two. A record of another host id is left alone, and this one takes a name of
    its own; its own host's (a restart after a crash) is taken over as before."""
    from payrun.procs import host_id
    from scheduler.cli import schedulers_alive
    from scheduler.service import PayrunScheduler

    theirs = PayrunScheduler(cfg, conn, name="scheduler-a.vm")
    theirs.register_birth()
    assert conn.hget(theirs.key, "host_id") == host_id().encode()
    conn.hset(theirs.key, "host_id", "0badcafe")  # (as the other machine wrote it)
    ours = PayrunScheduler(cfg, conn, name="scheduler-a.vm")
    ours.register_birth()
    assert ours.name == ours.cron.name == f"scheduler-a.vm.{host_id()}"
    assert not conn.hexists(theirs.key, "death")
    assert sorted(schedulers_alive(conn)) == sorted(["scheduler-a.vm", f"scheduler-a.vm.{host_id()}"])
    conn.delete(ours.key)
    again = PayrunScheduler(cfg, conn, name=f"scheduler-a.vm.{host_id()}")
    conn.hset(again.key, mapping={"birth": 1, "host_id": host_id()})  # its own stale record: taken over
    again.register_birth()
    assert again.name == f"scheduler-a.vm.{host_id()}" and conn.hget(again.key, "host_id") == host_id().encode()
    conn.delete(theirs.key, again.key)


def test_schedule_says_when_the_running_schedulers_loaded_another_schedule(cfg, conn):
    """Ops walkthrough: the pay run's time edited in the file, schedulers not restarted:
    `payrun schedule` showed the new time, and the tick at it never fired."""
    from click.testing import CliRunner

    from payrun.cli import cli
    from scheduler import cron
    from scheduler.cli import running_entries_differ
    from scheduler.service import CronPass, PayrunScheduler

    assert running_entries_differ(cfg, conn) == []  # none running: nothing to compare
    CronPass(conn, cfg, name="s1").register(service.clock())
    PayrunScheduler(cfg, conn, name="s1").register_birth()  # (only schedulers alive are compared)
    assert running_entries_differ(cfg, conn) == []  # as the file says
    first = cron.load_entries(cfg.scheduler.entries)[0]
    conn.hset(service.entries_key("s1"), first.name,
              json.dumps({"cron": "1 2 3 4 *", "job": first.job, "zone": cfg.timezone}))
    conn.hset(service.entries_key("s1"), "old-entry", json.dumps({"cron": "0 1 * * *", "job": "reaper",
                                                                 "zone": cfg.timezone}))
    differ = running_entries_differ(cfg, conn)
    assert differ == sorted([f"{first.name}: running with cron '1 2 3 4 *'", "old-entry: running, not in this file"])
    (cfg.home / "payroll.db").touch()
    out = CliRunner().invoke(cli, ["schedule"])
    assert "the schedulers running now loaded another schedule at their start" in out.output, out.output
    assert "supervisorctl restart scheduler-a scheduler-b" in out.output
    assert json.loads(CliRunner().invoke(cli, ["schedule", "--json"]).output)["running_differs"] == differ


def test_a_catch_up_window_reads_as_people_write_it():
    from scheduler.service import window_text

    assert [window_text(x) for x in (60, 900, 6 * 3600, 90 * 60)] == ["60 s", "15 min", "6 h", "90 min"]


def test_schedule_names_the_scheduler_still_on_the_old_schedule(cfg, conn):
    """Ops walkthrough: a deploy restarts scheduler-a with an edited pay-run time while
    scheduler-b still runs the old one. Each start overwrote one shared copy of the
    entries, so `payrun schedule` compared the file with whichever started last and
    said all was well, or told to restart both. Each scheduler's own copy is compared."""
    from click.testing import CliRunner

    from payrun.cli import cli
    from scheduler import cron
    from scheduler.cli import running_entries_differ
    from scheduler.service import CronPass, PayrunScheduler

    first = cron.load_entries(cfg.scheduler.entries)[0]
    old = json.dumps({"cron": "1 2 3 4 *", "job": first.job, "zone": cfg.timezone})
    for name in ("scheduler-b.h2", "scheduler-a.h1"):  # b started first, on the old file
        PayrunScheduler(cfg, conn, name=name).register_birth()
        CronPass(conn, cfg, name=name).register(service.clock())
        if name == "scheduler-b.h2":
            conn.hset(service.entries_key(name), first.name, old)
    # the shared copy is scheduler-a's, as the file says: it alone would say nothing differs
    assert json.loads(conn.hget(service.ENTRIES_KEY, first.name))["cron"] == first.cron
    assert running_entries_differ(cfg, conn) == [f"scheduler-b.h2: {first.name}: running with cron '1 2 3 4 *'"]
    (cfg.home / "payroll.db").touch()
    out = CliRunner().invoke(cli, ["schedule"]).output
    assert "not every scheduler runs the same schedule: scheduler-b.h2 loaded another one" in out, out
    assert "supervisorctl restart scheduler-b` on its host" in out
    # a scheduler of an older payrun (no copy of its own) is compared through the shared one
    conn.delete(service.entries_key("scheduler-b.h2"), service.entries_key("scheduler-a.h1"))
    assert running_entries_differ(cfg, conn) == []
    # a stopped scheduler's copy goes with it; a lapsed one is written again by its next beat
    s = PayrunScheduler(cfg, conn, name="scheduler-a.h1")
    s.heartbeat()
    assert conn.hget(service.entries_key("scheduler-a.h1"), first.name) is not None
    assert 0 < conn.ttl(service.entries_key("scheduler-a.h1")) <= service.ENTRIES_TTL_S
    s.cron.unregister()
    assert not conn.exists(service.entries_key("scheduler-a.h1"))


def test_schedule_with_no_scheduler_alive_names_how_to_start_them(cfg, conn):
    """Ops drill: both supervised schedulers stopped, `payrun schedule` said "no tick fires
    until one runs: payrun scheduler", i.e. a third one in the operator's terminal, outside
    supervisord, dying with the shell."""
    from click.testing import CliRunner

    from payrun.cli import cli

    (cfg.home / "payroll.db").touch()
    out = CliRunner().invoke(cli, ["schedule"]).output
    assert "schedulers alive: 0" in out and "`supervisorctl start scheduler-a scheduler-b`" in out, out


def test_ticks_missed_past_the_window_are_an_error_for_the_pay_run_and_nothing_to_do_for_a_check(cfg, conn, caplog):
    """Back two days late: the pay run's missed tick is an ERROR with the run to make by
    hand; a reaper's thousands of missed ticks, covered by the one fired on return, were
    ERROR "MISSED" lines too, and `payrun schedule` listed them as if work was left."""
    import logging

    from jobs.runtime import PayrunJob

    (cfg.home / "supervisor.role").write_text("all")  # the control host's directory (its ledger may judge)
    p = service.CronPass(conn, cfg, name="drill")
    p.run(PAY_TICK - timedelta(hours=1))  # the cursor: 01:00 on the 1st
    caplog.set_level(logging.WARNING, logger="payrun.scheduler")
    back = PAY_TICK + timedelta(days=2)
    p.run(back)
    missed = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records if "MISSED" in r.getMessage()}
    assert missed == {"cron payroll": logging.ERROR, "cron reaper": logging.WARNING,
                      "cron bank-status": logging.WARNING}, missed
    reaper_rec = PayrunJob.fetch(f"missed-reaper-{cron.stamp(back - timedelta(hours=6, minutes=5))}", connection=conn)
    assert reaper_rec.args[4].endswith("; the tick fired on return does their work: nothing to do"), reaper_rec.args[4]
    pay_rec = PayrunJob.fetch(f"missed-payroll-{cron.stamp(PAY_TICK)}", connection=conn)
    assert pay_rec.args[4].endswith("run it by hand: payrun run --month 2026-11"), pay_rec.args[4]
    assert not service.missed_superseded("payroll", back) and not service.missed_superseded("reaper", None)


def control_burst(env) -> None:
    subprocess.run([sys.executable, "-m", "payrun.cli", "worker", "control", "--burst"], env=env, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


def test_a_cursor_lost_with_redis_catches_up_the_pay_run_once_or_records_it_missed(world, caplog):
    """Ops drill: Redis (no persistence) lost everything while the 1st's 02:00 tick passed;
    the first pass back started its cursor at "now": no DUE, no MISSED, no row, no payday.
    The cursor is rebuilt from the ledger: registration, then the newest tick row."""
    import logging

    w, conn = world, world["conn"]
    env = write_config(w, [ENTRIES[0]])
    a, b = (service.CronPass(conn, w["cfg"], name=n) for n in ("scheduler-a", "scheduler-b"))
    start = PAY_TICK - timedelta(days=3)
    a.register(start)  # (at the scheduler's start)
    b.register(start + timedelta(hours=1))  # (a later start keeps the first registration)
    assert a.run(start) == [] and conn.exists(service.cursor_key("payroll"))
    conn.flushdb()  # Redis lost: cursor, markers, queues — 01:00 on the 1st
    # 02:30: `payrun schedule` knows the tick is due, from the ledger
    from scheduler.cli import schedule_view

    view = schedule_view(w["cfg"], conn, now=PAY_TICK + timedelta(minutes=30))[0]
    assert view["due_since"] == PAY_TICK.isoformat() and view["handled_until"] is None, view
    # both schedulers come back at 07:00 (5 h late, inside the 6 h window): one fires
    back = PAY_TICK + timedelta(hours=5)
    caplog.set_level(logging.WARNING, logger="payrun.scheduler")
    assert [o["outcome"] for o in a.run(back)] == ["fired"]
    assert b.run(back) == []  # (the cursor a moved)
    conn.delete(service.cursor_key("payroll"))  # b rebuilt it too before a moved it: the marker decides
    assert [o["outcome"] for o in b.run(back)] == ["done-elsewhere"]
    assert any("no cursor in Redis" in r.getMessage() and "its registration" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert job_ids(conn, "tick-payroll-") == {ticks.tick_job_id("payroll", cron.stamp(PAY_TICK))}
    assert float(conn.get(service.cursor_key("payroll"))) == back.timestamp()
    control_burst(env)
    row = {r["scheduled_for"]: r for r in rows(w, "payroll")}[cron.iso(PAY_TICK)]
    assert row["status"] == "enqueued" and row["jobs"] == 12, row
    render = make_queue(keys.RENDER_QUEUE, conn).count
    assert render == 12
    # lost again the same morning: the tick's row says it ran; nothing fires twice
    conn.flushdb()
    for p in (a, b):
        assert p.run(back + timedelta(hours=1)) == []
    assert make_queue(keys.CONTROL_QUEUE, conn).count == 0 and make_queue(keys.RENDER_QUEUE, conn).count == 0
    # lost once more, and no scheduler back until 1 January 11:00 (9 h late): recorded missed
    conn.flushdb()
    jan = utc(2026, 12, 31, 20, 0)
    caplog.clear()
    acts = a.run(jan + timedelta(hours=9)) + b.run(jan + timedelta(hours=9))
    assert [x.get("missed") for x in acts if x.get("outcome") == "fired"] == [[cron.iso(jan)]], acts
    assert not job_ids(conn, "tick-payroll-")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "cron payroll: MISSED 1 tick(s)" in errors[0] and \
        "run it by hand: payrun run --month 2026-12" in errors[0], errors
    control_burst(env)
    missed = {r["scheduled_for"]: r for r in rows(w, "payroll")}[cron.iso(jan)]
    assert missed["status"] == "missed" and "payrun run --month 2026-12" in missed["detail"]
    assert {r["month"] for r in Ledger(w["cfg"].ledger_path).runs()} == {MONTH}  # November paid once


def test_a_lost_cursor_never_pays_a_month_already_run_by_hand(world):
    """The month ran by hand (no cron row); Redis lost the cursor before the tick: the tick
    fires on return and the pay run's own guard (payroll_runs rows) creates nothing."""
    w, conn = world, world["conn"]
    env = write_config(w, [ENTRIES[0]])
    p = service.CronPass(conn, w["cfg"], name="scheduler-a")
    p.register(PAY_TICK - timedelta(days=3))
    ledger = Ledger(w["cfg"].ledger_path)
    for cid in (1, 2):
        ledger.claim_run(cid, MONTH, "by-hand")
        ledger.finish_run(cid, MONTH, 6)
    ledger.close()
    p.run(PAY_TICK + timedelta(hours=1))
    control_burst(env)
    row = {r["scheduled_for"]: r for r in rows(w, "payroll")}[cron.iso(PAY_TICK)]
    assert row["jobs"] == 0 and "already run" in row["detail"], row
    assert make_queue(keys.RENDER_QUEUE, conn).count == 0


def test_a_scheduler_without_the_ledger_leaves_a_lost_cursor_to_the_control_host(cfg, conn, caplog):
    """A scheduler on a worker host (no ledger there) must not restart a lost cursor at
    "now": that would skip the tick for the control host's schedulers too."""
    import logging

    (cfg.home / "supervisor.role").write_text("worker\n")
    p = service.CronPass(conn, cfg, name="remote")
    caplog.set_level(logging.ERROR, logger="payrun.scheduler")
    p.register(PAY_TICK - timedelta(hours=1))
    assert p.run(PAY_TICK - timedelta(hours=1)) == [] and p.run(PAY_TICK) == []
    assert not conn.exists(service.cursor_key("payroll")) and not cfg.ledger_path.exists()
    logged = [r.getMessage() for r in caplog.records if "no ledger on this host" in r.getMessage()]
    assert len(logged) == 3, logged  # once per entry, not every pass


def test_a_scheduler_in_a_directory_of_its_own_never_judges_a_lost_cursor(world, caplog):
    """A scheduler on another host (external Redis) in a data directory of its own rebuilt a
    lost cursor from its own empty ledger when it looked first: from its start months ago
    it recorded the pay run that ran as MISSED; started during the outage, it started the
    cursor after the tick and payday was skipped without a word. It now leaves the cursor
    to the control host's scheduler, whose ledger records the ticks."""
    import dataclasses
    import logging

    from scheduler.cli import schedule_view

    w, conn = world, world["conn"]
    env = write_config(w, [ENTRIES[0]])
    control = service.CronPass(conn, w["cfg"], name="scheduler-a")  # (its directory: supervisor.role = all)

    def elsewhere(name: str) -> service.CronPass:
        home = w["tmp"] / name
        home.mkdir()
        return service.CronPass(conn, dataclasses.replace(w["cfg"], home=home), name=name)

    remote = elsewhere("remote")
    control.register(PAY_TICK - timedelta(days=2))
    remote.register(PAY_TICK - timedelta(days=90))  # (its own ledger, made in its own directory, long ago)
    assert remote.memory.cfg.ledger_path.exists()
    control.run(PAY_TICK - timedelta(hours=1))
    assert [o["outcome"] for o in control.run(PAY_TICK + timedelta(seconds=30))] == ["fired"]
    control_burst(env)  # November paid: the tick's row is in the control host's ledger
    assert {r["scheduled_for"]: r["status"] for r in rows(w, "payroll")} == {cron.iso(PAY_TICK): "enqueued"}

    # 1. Redis loses everything; at 09:00 (7 h after the tick) the remote scheduler looks first
    conn.flushdb()
    caplog.set_level(logging.WARNING, logger="payrun.scheduler")
    caplog.clear()
    morning = PAY_TICK + timedelta(hours=7)
    assert remote.run(morning) == [] and remote.run(morning + timedelta(seconds=1)) == []
    assert not conn.exists(service.cursor_key("payroll"))
    said = [r for r in caplog.records if "no cursor in Redis" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in said]
    assert "cannot tell which ticks ran" in said[0].getMessage() and "left to a scheduler on the control host" \
        in said[0].getMessage()
    assert control.run(morning) == []  # its ledger: November's tick ran; nothing due, nothing missed
    assert remote.run(morning + timedelta(minutes=1)) == []
    assert not any("MISSED" in r.getMessage() for r in caplog.records)
    assert not job_ids(conn, "missed-") and not job_ids(conn, "tick-")

    # 2. lost again before January's tick; a scheduler first started during the outage looks first
    conn.flushdb()
    caplog.clear()
    jan = utc(2026, 12, 31, 20, 0)  # 1 January 02:00 Dhaka
    late = elsewhere("late")
    late.register(jan + timedelta(hours=1))
    assert late.run(jan + timedelta(hours=1)) == [] and remote.run(jan + timedelta(hours=1)) == []
    assert not conn.exists(service.cursor_key("payroll"))
    assert len([r for r in caplog.records if "no cursor in Redis" in r.getMessage()]) == 2  # (once per loss each)
    # `payrun schedule` on the control host says the tick is due; in the other directory it claims nothing
    assert schedule_view(w["cfg"], conn, now=jan + timedelta(hours=1))[0]["due_since"] == jan.isoformat()
    assert schedule_view(late.cfg, conn, now=jan + timedelta(hours=1))[0]["due_since"] is None
    assert [o["outcome"] for o in control.run(jan + timedelta(hours=1))] == ["fired"]  # 1 h late: caught up
    assert job_ids(conn, "tick-payroll-") == {ticks.tick_job_id("payroll", cron.stamp(jan))}
    assert late.run(jan + timedelta(hours=1, seconds=1)) == []


def test_a_control_host_started_by_hand_fires_once_its_ledger_writer_runs_here(world):
    """A control host started with plain supervisord (`payrun supervisor-env`) on an external
    Redis has no supervisor.role, and before its first tick no row: its schedulers never
    made a cursor, so never fired. The `payrun ledger` holding the events' lease on this
    host and ledger file is a sure sign this ledger is the ticks' one; a lease held on
    another host, or for another ledger file, is not."""
    import socket

    from payrun import ledger as ledger_mod

    w, conn = world, world["conn"]
    write_config(w, [ENTRIES[0]])
    (w["cfg"].home / "supervisor.role").unlink()
    p = service.CronPass(conn, w["cfg"], name="scheduler-a")
    p.register(PAY_TICK - timedelta(days=3))
    before = PAY_TICK - timedelta(hours=1)
    assert p.run(before) == [] and not conn.exists(service.cursor_key("payroll"))  # not sure: waits
    for other in (f"elsewhere 4242 {w['cfg'].ledger_path}", f"{socket.gethostname()} 4242 /other/ledger.db"):
        conn.set(keys.LEDGER_OWNER, other)
        assert p.run(before) == [] and not conn.exists(service.cursor_key("payroll")), other
    conn.set(keys.LEDGER_OWNER, ledger_mod.owner_id(w["cfg"].ledger_path))  # `payrun ledger` here
    p.run(before)
    assert conn.exists(service.cursor_key("payroll"))
    assert [o["outcome"] for o in p.run(PAY_TICK + timedelta(seconds=30))] == ["fired"]


def test_a_cursor_lost_in_the_middle_of_a_pass_is_rebuilt_not_made_at_now(world):
    """Redis lost everything between a pass's enqueue of the tick and its move of the cursor:
    the move made the cursor anew at "now", and the tick, whose job the loss took, never ran."""
    w, conn = world, world["conn"]
    write_config(w, [ENTRIES[0]])
    p = service.CronPass(conn, w["cfg"], name="scheduler-a")
    p.register(PAY_TICK - timedelta(days=3))
    p.run(PAY_TICK - timedelta(hours=1))
    fire = p.fire

    def fire_then_lose_redis(*a, **kw):
        outcome = fire(*a, **kw)
        conn.flushdb()
        return outcome

    p.fire = fire_then_lose_redis
    assert [o["outcome"] for o in p.run(PAY_TICK + timedelta(minutes=1))] == ["fired"]
    assert not conn.exists(service.cursor_key("payroll")) and not job_ids(conn, "tick-")
    del p.fire
    assert [o["outcome"] for o in p.run(PAY_TICK + timedelta(minutes=2))] == ["fired"]
    assert job_ids(conn, "tick-payroll-") == {ticks.tick_job_id("payroll", cron.stamp(PAY_TICK))}


def test_how_late_a_tick_fired_is_read_from_the_pass_clock(cfg, conn, caplog):
    """`fire()` said "caught up N min late" from the system clock, not the pass's: with a
    test clock (or PAYRUN_CLOCK_FILE) an on-time tick read years late, a late one on time."""
    import dataclasses
    import logging

    (cfg.home / "supervisor.role").write_text("all")
    one = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, entries=[ENTRIES[0]]))
    p = service.CronPass(conn, one, name="scheduler-a")
    caplog.set_level(logging.INFO, logger="payrun.scheduler")
    for tick, late_by, said in ((utc(2020, 11, 30, 20), timedelta(seconds=30), None),
                                (utc(2040, 11, 30, 20), timedelta(hours=3), "caught up 180 min late")):
        conn.flushdb()
        caplog.clear()
        p.run(tick - timedelta(hours=1))
        assert [o["outcome"] for o in p.run(tick + late_by)] == ["fired"]
        line = [r for r in caplog.records if "enqueued" in r.getMessage()]
        assert len(line) == 1, [r.getMessage() for r in caplog.records]
        if said is None:
            assert line[0].levelno == logging.INFO and "caught up" not in line[0].getMessage(), line[0].getMessage()
        else:
            assert line[0].levelno == logging.WARNING and said in line[0].getMessage(), line[0].getMessage()


def test_schedule_counts_the_missed_ticks_the_scheduler_logged(world, caplog):
    """Two days down: the scheduler logged "MISSED 503 tick(s)" of the reaper and wrote rows
    for the newest 50; `payrun schedule` said "MISSED 50"."""
    import logging

    from scheduler.cli import schedule_view

    w, conn = world, world["conn"]
    env = write_config(w, [ENTRIES[2]])
    p = service.CronPass(conn, w["cfg"], name="scheduler-a")
    start = PAY_TICK - timedelta(hours=1)
    p.register(start)
    p.run(start)
    caplog.set_level(logging.WARNING, logger="payrun.scheduler")
    p.run(start + timedelta(days=2))
    said = [r.getMessage() for r in caplog.records if "MISSED" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("cron reaper: MISSED 503 tick(s)"), said
    assert "453 older tick(s) not listed" in said[0]
    control_burst(env)
    assert len([r for r in rows(w, "reaper") if r["status"] == "missed"]) == service.MISSED_CAP
    view = schedule_view(w["cfg"], conn, now=start + timedelta(days=2))[0]
    assert view["missed"] == 503, view
    # a second recording of the same ticks (a retried job) counts them once
    s = Store(w["cfg"].ledger_path)
    try:
        missed = sorted(r["scheduled_for"] for r in s.ticks("reaper") if r["status"] == "missed")
        assert s.record_not_run("reaper", "reaper", missed, "missed", "again", unlisted=453) == 0
        assert s.summary("reaper")["missed"] == 503
    finally:
        s.close()


def test_a_ledger_from_before_the_unlisted_count_gets_its_column(tmp_path):
    """cron_runs made by the version before (no ``unlisted``): CREATE TABLE IF NOT EXISTS
    keeps it as it was; the column is added, and its old missed rows count as before."""
    import sqlite3

    path = tmp_path / "ledger.db"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE cron_runs (entry TEXT NOT NULL, scheduled_for TEXT NOT NULL, job TEXT, owner TEXT,"
                " status TEXT NOT NULL, jobs INTEGER NOT NULL DEFAULT 0, detail TEXT, duplicates_stopped INTEGER"
                " NOT NULL DEFAULT 0, created_at TEXT, updated_at TEXT, PRIMARY KEY (entry, scheduled_for))")
    old.execute("INSERT INTO cron_runs (entry, scheduled_for, job, status) VALUES ('reaper', '2026-11-30T20:00:00+00:00',"
                " 'reaper', 'missed')")
    old.commit()
    old.close()
    for _ in range(2):  # (a second open finds the column)
        s = Store(path)
        try:
            assert s.summary("reaper")["missed"] == 1
        finally:
            s.close()
    s = Store(path)
    try:
        s.record_not_run("reaper", "reaper", ["2026-11-30T21:00:00+00:00"], "missed", "d", unlisted=7)
        assert s.summary("reaper")["missed"] == 9
    finally:
        s.close()


def test_payrun_scheduler_back_after_redis_lost_everything_fires_the_pay_run_tick(world):
    """The same drill with real `payrun scheduler` processes: one ran at 01:00, Redis was
    flushed, the next one starts at 07:30 and fires the 02:00 tick."""
    w, conn = world, world["conn"]
    env = write_config(w, [ENTRIES[0]])
    set_clock(w["clock"], PAY_TICK - timedelta(hours=1))
    s = spawn(env, "scheduler", log=w["tmp"] / "s1.log")
    try:
        wait_for(lambda: conn.exists(service.cursor_key("payroll")), timeout_s=30, what="the first pass")
    finally:
        stop(s)
    conn.flushdb()
    set_clock(w["clock"], PAY_TICK + timedelta(hours=5, minutes=30))
    s = spawn(env, "scheduler", log=w["tmp"] / "s2.log")
    try:
        wait_for(lambda: (marker(conn, "payroll", PAY_TICK) or b"").startswith(b"fired:"), timeout_s=30,
                 what="the pay-run tick to fire after Redis lost the cursor")
    finally:
        stop(s)
    assert job_ids(conn, "tick-payroll-") == {ticks.tick_job_id("payroll", cron.stamp(PAY_TICK))}
    assert "no cursor in Redis" in (w["tmp"] / "s2.log").read_text()


def test_a_scheduler_says_redis_is_away_once_then_every_30_s_and_back_once(cfg, conn, caplog, monkeypatch):
    """Ops drill (session 39): with Redis stopped for 20 s each scheduler logged "pass failed"
    every poll, once a second. The clock is faked: 1 s per pass, 120 passes failing, then 3 working."""
    import redis as redis_mod
    from types import SimpleNamespace

    from scheduler.service import PayrunScheduler

    now = [0.0]
    passes = [0]

    def monotonic():
        return now[0]

    def sleep(s):
        now[0] += s

    monkeypatch.setattr(service, "time", SimpleNamespace(monotonic=monotonic, sleep=sleep, time=time.time))
    s = PayrunScheduler(cfg, conn, name="sched-away")
    real_beat = s.heartbeat

    def beat():
        passes[0] += 1
        if passes[0] > 123:
            s._stopping = True
        if passes[0] <= 120:
            raise redis_mod.ConnectionError("Error 2 connecting to redis.sock. No such file or directory.")
        real_beat()

    s.heartbeat = beat
    caplog.set_level("WARNING", logger="payrun.scheduler")
    s.run()
    failed = [r.getMessage() for r in caplog.records if "pass failed" in r.getMessage()]
    back = [r.getMessage() for r in caplog.records if "work again" in r.getMessage()]
    assert passes[0] == 124
    assert 2 <= len(failed) <= 5, failed  # at once, then every 30 s of the ~120 s
    assert "still failing" in failed[1]
    assert len(back) == 1 and "back after" in back[0], back


def test_schedule_says_what_holds_a_due_tick_while_schedulers_are_alive(cfg, conn):
    """Drill (session 41): scheduler-b was kill -9'd holding rq-scheduler's pass lock at the
    pay-run tick; for the lock's 11 s `payrun schedule` read "DUE …: no scheduler has run
    since" beside "schedulers alive: 2". It names the lock and the claim instead."""
    from scheduler.cli import due_text, schedule_view

    entries = [{"name": "payroll", "cron": "0 2 1 * *", "job": "payroll"}]
    cfg.scheduler.entries = entries
    conn.set(service.cursor_key("payroll"), repr((PAY_TICK - timedelta(minutes=1)).timestamp()))
    conn.hset("rq:scheduler_instance:scheduler-a.vm", "birth", "1")
    conn.set("rq:scheduler_lock", "scheduler-b.vm", ex=11)
    conn.set(service.marker_key("payroll", cron.stamp(PAY_TICK)), "claimed:scheduler-b.vm:0a1b2c3d", ex=30)
    row = schedule_view(cfg, conn, now=PAY_TICK + timedelta(seconds=5))[0]
    assert row["due_since"] == PAY_TICK.isoformat()
    waiting = row["due_waiting"]
    assert waiting["pass_lock"] == "scheduler-b.vm" and 0 < waiting["pass_lock_ttl_s"] <= 11, waiting
    assert waiting["claimed_by"] == "scheduler-b.vm" and 0 < waiting["claim_ttl_s"] <= 30, waiting
    line = due_text("2026-12-01 02:00 Asia/Dhaka (20:00 UTC)", "6 h", ["scheduler-a.vm"], waiting)
    assert "no scheduler has run since" not in line, line
    assert "1 scheduler(s) alive" in line and "claimed by scheduler-b.vm" in line, line
    assert "rq:scheduler_lock) is held by scheduler-b.vm" in line, line
    # none alive: as before, start one within the window
    line = due_text("2026-12-01 02:00 Asia/Dhaka (20:00 UTC)", "6 h", [], None)
    assert "no scheduler has run since; one that starts within the catch-up window (6 h)" in line
    # fired since: nothing waits
    conn.set(service.cursor_key("payroll"), repr((PAY_TICK + timedelta(seconds=1)).timestamp()))
    row = schedule_view(cfg, conn, now=PAY_TICK + timedelta(seconds=5))[0]
    assert row["due_since"] is None and row["due_waiting"] is None


def test_a_fresh_install_does_not_warn_of_a_lost_cursor(world, caplog):
    """Drill (session 41): the very first `payrun up` logged, from one scheduler per entry,
    WARNING "no cursor in Redis (lost, flushed or a new Redis): resuming from …" — nothing
    was lost. The first start says so at INFO; a cursor lost later still warns."""
    import logging

    w, conn = world, world["conn"]
    write_config(w, [ENTRIES[0]])
    start = PAY_TICK - timedelta(days=3) + timedelta(microseconds=700_000)
    a = service.CronPass(conn, w["cfg"], name="scheduler-a")
    a.register(start)
    caplog.set_level(logging.INFO, logger="payrun.scheduler")
    assert a.run(start + timedelta(seconds=1)) == []
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert not [m for lvl, m in said if lvl >= logging.WARNING], said
    assert any("first start of this entry" in m for _, m in said), said
    caplog.clear()
    conn.delete(service.cursor_key("payroll"))  # lost later: still a WARNING
    a.run(start + timedelta(hours=1))
    assert any(r.levelno == logging.WARNING and "no cursor in Redis" in r.getMessage() for r in caplog.records)


def test_a_missed_recurring_tick_names_a_short_window_and_is_a_warning_with_no_tick_fired_in_its_pass(
        world, caplog, monkeypatch):
    """Drill (session 41, catchup_window_s = 60, the scheduler back 170 s late, the next
    reaper tick 5 min away, so no tick fired in that pass): the MISSED line and row read
    "within the 0.0166667 h catch-up window" (`payrun schedule`'s DUE line already said
    "60 s"); and the missed reaper tick was an ERROR "MISSED" in the scheduler's log and
    again in the control worker's, though the next tick does its work."""
    import logging

    w, conn = world, world["conn"]
    write_config(w, [ENTRIES[2]], catchup_window_s=60)
    a = service.CronPass(conn, w["cfg"], name="scheduler-a")
    tick = utc(2026, 12, 6, 6, 10)
    a.register(tick - timedelta(minutes=3))
    a.run(tick - timedelta(minutes=3))
    caplog.set_level(logging.WARNING)
    out = a.run(tick + timedelta(seconds=170))
    assert [o.get("outcome") for o in out] == ["fired"] and out[0]["missed"] == [cron.iso(tick)], out
    job = PayrunJob.fetch(f"missed-reaper-{cron.stamp(tick)}", connection=conn)
    assert "within the 60 s catch-up window" in job.args[4], job.args[4]
    lines = [r for r in caplog.records if "MISSED" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING], [(r.levelname, r.getMessage()) for r in lines]
    assert job.args[4].endswith("; the next tick does their work: nothing to do"), job.args[4]
    caplog.clear()
    monkeypatch.setenv("PAYRUN_HOME", str(w["cfg"].home))
    ticks.record_not_run(*job.args)  # what the control worker runs
    rows = [r for r in caplog.records if "missed" in r.getMessage()]
    assert [r.levelno for r in rows] == [logging.WARNING], [(r.levelname, r.getMessage()) for r in rows]
    assert service.missed_is_error("payroll") and not service.missed_is_error("reaper")
    assert not service.missed_is_error("bank-status")


def test_schedule_with_redis_down_says_a_tick_is_due_from_the_ledger(world):
    """Drill (session 41): everything down over the pay-run tick (`payrun down`); at the tick
    plus 16 s `payrun schedule` read "next <tomorrow>, never run" and "schedulers: Redis not
    reachable", as if today's tick were done. The ledger says it has no row: DUE."""
    from scheduler.cli import due_text, schedule_view

    w, conn = world, world["conn"]
    write_config(w, [ENTRIES[0]])
    a = service.CronPass(conn, w["cfg"], name="scheduler-a")
    a.register(PAY_TICK - timedelta(days=3))
    a.run(PAY_TICK - timedelta(days=3))
    row = schedule_view(w["cfg"], None, now=PAY_TICK + timedelta(seconds=16))[0]  # Redis unreachable
    assert row["due_since"] == PAY_TICK.isoformat() and row["due_waiting"] is None, row
    line = due_text("2026-12-01 02:00 Asia/Dhaka (20:00 UTC)", "6 h", None, None)
    assert "Redis is unreachable and the ledger has no row of it" in line and "`payrun up`" in line, line
    assert schedule_view(w["cfg"], None, now=PAY_TICK - timedelta(seconds=1))[0]["due_since"] is None


def test_schedule_prints_a_time_in_utc_once():
    """With zone UTC, `payrun schedule` printed "02:00 UTC (02:00 UTC 2026-12-01)"."""
    from scheduler.cli import zone_and_utc

    assert zone_and_utc("2026-12-01 08:00", "Asia/Dhaka", "2026-12-01T02:00:00+00:00") == \
        "2026-12-01 08:00 Asia/Dhaka (02:00 UTC 2026-12-01)"
    assert zone_and_utc("2026-12-01 02:00", "Asia/Dhaka", "2026-11-30T20:00:00+00:00", False) == \
        "2026-12-01 02:00 Asia/Dhaka (20:00 UTC)"
    assert zone_and_utc("2026-12-01 02:00", "UTC", "2026-12-01T02:00:00+00:00") == "2026-12-01 02:00 UTC"
    assert zone_and_utc("2026-12-01 02:00:30", "UTC", "2026-12-01 02:00:30+00:00", False) == \
        "2026-12-01 02:00:30 UTC"
    assert zone_and_utc("2026-12-01 02:00:30", "Asia/Dhaka", "2026-11-30 20:00:30+00:00", False) == \
        "2026-12-01 02:00:30 Asia/Dhaka (20:00:30 UTC)"


def test_schedule_says_when_a_bank_status_ticks_checks_failed(world):
    """Drill (session 41): with the bank down, every check of a bank-status tick failed for
    good and `payrun schedule` still read "enqueued, 2 job(s)", as if the credits were known."""
    from rq.registry import FailedJobRegistry

    from scheduler.cli import schedule_view, tick_work_text

    w, conn = world, world["conn"]
    write_config(w, [ENTRIES[1]])
    tick = utc(2026, 12, 6, 6, 15)
    at = cron.iso(tick)
    store = Store(w["cfg"].ledger_path)
    try:
        assert store.claim_tick("bank-status", at, "bank-status", "owner-1")
        store.finish_tick("bank-status", at, "enqueued", 2, "2026-11: 2 companies to check", owner="owner-1")
    finally:
        store.close()
    q = make_queue(keys.CONTROL_QUEUE, conn)
    st = cron.stamp(tick)
    dead = q.enqueue_call("scheduler.bank.check_company", args=("2026-11", 1, at), job_id=f"bank-bank-status-{st}-2026-11-c1",
                          meta={"last_error": "TransientError: the bank did not answer (connection refused)"})
    q.remove(dead)
    FailedJobRegistry(queue=q, job_class=PayrunJob, serializer=q.serializer).add(dead, ttl=3600)
    q.enqueue_call("scheduler.bank.check_company", args=("2026-11", 2, at), job_id=f"bank-bank-status-{st}-2026-11-c2")
    q.enqueue_call("scheduler.bank.check_company", args=("2026-11", 3, at),  # another tick's: not counted
                   job_id=f"bank-bank-status-{cron.stamp(tick - timedelta(minutes=15))}-2026-11-c3")
    row = schedule_view(w["cfg"], conn, now=tick + timedelta(minutes=5))[0]
    assert row["outcome"] == "enqueued" and row["work"] == {
        "failed": 1, "pending": 1, "error": "TransientError: the bank did not answer (connection refused)"}, row
    text = tick_work_text(row["jobs"], row["work"])
    assert text == ("1 of 2 failed (TransientError: the bank did not answer (connection refused)): "
                    "`payrun failed --queue control`; 1 still to run"), text
    assert tick_work_text(2, {"failed": 0, "pending": 0, "error": None}) == ""
    assert tick_work_text(0, None) == ""


def test_a_scheduler_restarted_after_a_kill_mid_pass_takes_over_its_own_dead_pass_lock(cfg, conn):
    """Drill (session 41): scheduler-a killed (-9) inside its pass; supervisord restarted it
    within a second, and it waited out the pass lock its dead self held (11 s), holding
    every tick back. Its restart now takes that lock over; another scheduler's, or a live
    process's, it leaves alone."""
    from scheduler.service import PayrunScheduler, own_dead_pass_lock, pass_lock_holder, pass_lock_value

    from payrun.procs import host_id

    host = host_id()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    s = PayrunScheduler(cfg, conn, name="scheduler-a")
    conn.set("rq:scheduler_lock", pass_lock_value("scheduler-a", host, gone.pid), ex=11)
    assert s.acquire_lock()
    assert pass_lock_holder(conn.get("rq:scheduler_lock").decode()) == ("scheduler-a", host, os.getpid())
    s.remove_lock()
    assert conn.get("rq:scheduler_lock") is None
    # another scheduler's lock, a live earlier self (pid 1 stands in), another host's, a bare name: kept
    for held in (pass_lock_value("scheduler-b", host, gone.pid), pass_lock_value("scheduler-a", host, 1),
                 pass_lock_value("scheduler-a", "other-host", gone.pid), "scheduler-a"):
        conn.set("rq:scheduler_lock", held, ex=11)
        assert not s.acquire_lock(), held
        assert conn.get("rq:scheduler_lock").decode() == held
    # the rule alone
    dead = lambda pid: False  # noqa: E731
    assert own_dead_pass_lock("scheduler-a|h|10", "scheduler-a", "h", 11, dead) == 10
    assert own_dead_pass_lock("scheduler-a|h|11", "scheduler-a", "h", 11, dead) is None  # (its own)
    assert own_dead_pass_lock("scheduler-a|h|10", "scheduler-a", "h", 11, lambda pid: True) is None
    assert pass_lock_holder("scheduler-b.vm") == ("scheduler-b.vm", None, None)
