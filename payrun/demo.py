"""`payrun demo`: a whole month's pay run on one machine, then a clean shutdown.

Everything lives under $PAYRUN_HOME/demo (wiped at the start: it is sample data), with
the real parts: the embedded Redis (unless PAYRUN_REDIS_URL is set), the local provider
(unless PAYRUN_EMAIL_URL is set), one ledger process, one pdf-render worker per core and
one send-email worker process with concurrent lanes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from payrun import keys, redis_server
from payrun.config import Config


def _spawn(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "payrun.cli", *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _bar(done: int, failed: int, rendered: int, total: int, rate: float, width: int = 30) -> str:
    frac = (done + failed) / total if total else 1.0
    fill = int(width * frac)
    eta = ""
    if rate > 0 and done + failed < total:
        left = (total - done - failed) / rate
        eta = f"  ETA {int(left // 60)}:{int(left % 60):02d}"
    return (f"\r[{'#' * fill}{'-' * (width - fill)}] {done + failed:>6,}/{total:,}  "
            f"rendered {rendered:,}  sent {done:,}  failed {failed:,}  {rate:5.1f}/s{eta}   ")


DEMO_TIMEOUT_S = 900
"""The least time `payrun demo` waits for its run before it gives up."""


def default_timeout_s(employees: int, rate_per_s: float) -> int:
    """How long `payrun demo` waits by default: twice what the email limit alone needs for
    this many slips, plus five minutes, and never under DEMO_TIMEOUT_S. A flat 900 s gave
    up on a healthy 50,000-slip run (1,250 s at 40/s at the very least)."""
    return max(DEMO_TIMEOUT_S, math.ceil(2 * employees / rate_per_s) + 300)


def run_demo(base: Config, employees: int, companies: int, month: str, timeout_s: int) -> bool:
    from payrun import ledger as ledger_mod
    from payrun import payroll, runs, status
    from payrun.ledger import Ledger

    home = base.home / "demo"
    if home.exists():
        if base.embedded_redis:
            redis_server.stop(dataclasses.replace(base, home=home))
        shutil.rmtree(home)
    home.mkdir(parents=True)
    os.chmod(home, 0o700)
    (home / "log").mkdir()
    cfg = dataclasses.replace(base, home=home)
    say = lambda msg: click.echo(msg, err=True)  # noqa: E731

    say(f"payrun demo: {companies} companies, {employees:,} employees, month {month}, data in {home}")
    started_redis = cfg.embedded_redis
    conn = redis_server.ensure_running(cfg)
    if not cfg.embedded_redis:
        say("using the Redis at PAYRUN_REDIS_URL")
    provider = None
    email_env: dict[str, str] = {}
    if not cfg.email.url:
        from payrun.provider import Provider, local_token

        # with a token, as `payrun provider`: any user of the machine could otherwise read
        # each slip's recipient and subject from it; its senders get it in their environment
        token = local_token(cfg)
        provider = Provider(host="127.0.0.1", port=0, latency_s=cfg.provider.latency_s,
                            rate_per_s=cfg.provider.rate_per_s, token=token).start()
        email_url = provider.url
        email_env["PAYRUN_EMAIL_TOKEN"] = token
        say(f"local email provider at {email_url} (latency {cfg.provider.latency_s} s, limit {cfg.provider.rate_per_s:g}/s)")
    else:
        email_url = cfg.email.url
        say("sending through PAYRUN_EMAIL_URL")

    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=companies, employees=employees, seed=7, month=month)
    env = dict(os.environ, PAYRUN_HOME=str(home), PAYRUN_REDIS_URL=redis_server.url(cfg),
               PAYRUN_EMAIL_URL=email_url, **email_env)
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        procs.append(("ledger", _spawn(["ledger"], env, home / "log" / "ledger.log")))
        procs.append(("reaper", _spawn(["reap", "--loop"], env, home / "log" / "reaper.log")))
        for i in range(cfg.render_workers):
            procs.append((f"render-{i}", _spawn(["worker", keys.RENDER_QUEUE], env, home / "log" / f"render-{i}.log")))
        procs.append(("email", _spawn(["worker", keys.EMAIL_QUEUE], env, home / "log" / "email.log")))
        say(f"started ledger, {cfg.render_workers} pdf-render workers, 1 send-email worker "
            f"({cfg.email.lanes} lanes); logs in {home / 'log'}")

        ledger = Ledger(cfg.ledger_path)
        t0 = time.monotonic()
        result = runs.start_run(cfg, conn, ledger, db, month)
        total = result.jobs
        say(f"fan-out: {total:,} jobs in {time.monotonic() - t0:.1f} s")
        deadline = time.monotonic() + timeout_s
        samples: list[tuple[float, int]] = []
        final = None
        tty = sys.stderr.isatty()
        last_line = 0.0
        poll_s = POLL_S
        while time.monotonic() < deadline:
            c0 = time.process_time()
            t = _progress(ledger, month)
            rendered = t["rendered"]
            # the bar's own cost stays under ~5% of one core: at 50,000 slips a count
            # takes tens of ms, and the full status report (computed once, at the end)
            # took 0.4-0.5 CPU-s, which every 0.5 s was a quarter of the renders' 2 cores
            poll_s = max(POLL_S, 20 * (time.process_time() - c0))
            now = time.monotonic()
            samples.append((now, t["done"]))
            samples = [s for s in samples if now - s[0] <= 10]
            rate = (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0]) if len(samples) > 1 and samples[-1][0] > samples[0][0] else 0.0
            if tty:
                sys.stderr.write(_bar(t["done"], t["failed"], rendered, total, rate))
                sys.stderr.flush()
            elif now - last_line >= 5 or t["done"] + t["failed"] >= total:  # a log, not a redraw
                sys.stderr.write(_bar(t["done"], t["failed"], rendered, total, rate).strip("\r ") + "\n")
                last_line = now
            if t["done"] + t["failed"] >= total:
                final = status.report(cfg, ledger, month)
                break
            for name, p in procs:
                if p.poll() is not None:
                    raise click.ClickException(f"{name} exited with {p.returncode}; see {home / 'log'}")
            time.sleep(poll_s)
        if tty:
            sys.stderr.write("\n")
        elapsed = time.monotonic() - t0
        if final is None:
            # the ledger follows Redis by a moment and sends were in flight: a table taken
            # now said "164 sent" beside the provider's "196 delivered". Stop the workers
            # (they finish what they hold and record it), apply what the ledger has not
            # yet, and then count
            say(f"gave up after {timeout_s} s: stopping the workers (they finish the sends they hold)")
            _stop([p for name, p in procs if name != "ledger"], cfg.lease.grace_s)
            ledger_mod.drain(conn, ledger)
            final = status.report(cfg, ledger, month)
        final["redis_reachable"] = None  # the ledger's figures, by design: not "Redis unreachable"
        click.echo(status.format_report(final))
        ok = final["total"]["done"] == total and total > 0
        if provider is not None:
            st = provider.stats()
            ok = ok and st["delivered"] == total
            click.echo(f"provider: {st['delivered']:,} delivered, {st['duplicates_refused']} duplicates refused, "
                       f"{st['throttled_429']} throttled (429), {st['rejected']} rejected")
            if st["duplicates_refused"]:
                # nothing was stopped or killed here: every second send of a slip is a bug,
                # which the provider's Idempotency-Key dedupe hid (over SMTP: two emails)
                say(f"warning: {st['duplicates_refused']} slip(s) were sent twice in a calm run; "
                    f"the logs in {home / 'log'} say which")
        click.echo(f"slips: {cfg.slips_dir / month}   ledger: {cfg.ledger_path}   time: {elapsed:.1f} s")
        return ok
    finally:
        _stop([p for _, p in procs], cfg.lease.grace_s)
        if provider is not None:
            provider.stop()
        if started_redis:
            redis_server.stop(cfg)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each process still running, then wait for each (its grace period and 5 s
    more) or kill it."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s + 5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


POLL_S = 0.5
"""How often the progress bar looks at the ledger, at least (longer when a count is slow)."""


def _progress(ledger, month: str) -> dict[str, int]:
    """The bar's figures from one count of the month's jobs by kind and state (read from
    the ledger's covering index, not the per-slip join of `payrun status`): slips
    delivered (email done), failed for good (render or email failed) and rendered."""
    n = {(kind, st): c for kind, st, c in ledger.db.execute(
        "SELECT kind, status, COUNT(*) FROM jobs WHERE month = ? AND kind IN ('render', 'email')"
        " GROUP BY kind, status", (month,)).fetchall()}
    return {"done": n.get(("email", "done"), 0),
            "failed": n.get(("render", "failed"), 0) + n.get(("email", "failed"), 0),
            "rendered": n.get(("render", "done"), 0)}
