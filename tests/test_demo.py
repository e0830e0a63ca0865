"""`payrun demo`, the first command a new user runs: the whole system on one machine
(embedded Redis, local provider, ledger, reaper, render workers, send-email lanes).

In a calm run nothing is interrupted, so the provider must see every slip exactly once:
its Idempotency-Key dedupe would hide a second send from the "delivered" count (over SMTP
it would be a second email), so the duplicates it refused are asserted too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys


def _demo(tmp_path, employees: int, *, timeout_s: int) -> tuple[str, int]:
    """`payrun demo` as a new user runs it: a fresh home, no Redis, provider or config from
    the test session's environment. Returns its output and exit code."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAYRUN_REDIS_URL", "PAYRUN_EMAIL_URL", "PAYRUN_CONFIG")}
    env["PAYRUN_HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-m", "payrun.cli", "demo", "--employees", str(employees), "--companies", "2",
                        "--timeout", str(timeout_s)], env=env, capture_output=True, text=True, timeout=300)
    return r.stdout + r.stderr, r.returncode


def test_demo_delivers_every_slip_once_with_no_429(tmp_path):
    out, rc = _demo(tmp_path, 60, timeout_s=240)
    assert rc == 0, out[-3000:]
    m = re.search(r"provider: (\d+) delivered, (\d+) duplicates refused, (\d+) throttled \(429\), (\d+) rejected", out)
    assert m, out[-3000:]
    assert tuple(map(int, m.groups())) == (60, 0, 0, 0), out[-3000:]
    assert "warning" not in out
    assert "Redis unreachable" not in out  # the summary comes from the ledger, after the shutdown, on purpose
    slips = list((tmp_path / "home" / "demo").rglob("*.pdf"))
    assert len(slips) == 60 and all(p.stat().st_mode & 0o777 == 0o600 for p in slips)


def test_the_progress_bar_counts_what_the_status_report_counts(tmp_path):
    """The bar reads one cheap count per poll (kind x state), not `payrun status`'s per-slip
    join, which at 50,000 slips cost 0.4-0.5 CPU-s a call, every 0.5 s."""
    from payrun.demo import _progress
    from payrun.ledger import Ledger

    month = "2026-11"
    led = Ledger(tmp_path / "ledger.db")
    states = [("done", "done"), ("done", "failed"), ("failed", None), ("done", "running"), ("done", None),
              ("queued", None), ("done", "retrying"), ("running", None)]
    with led.db.conn:
        for i, (render, email) in enumerate(states):
            key = f"slip:{month}:emp-{i}"
            led.db.conn.execute("INSERT INTO jobs (id, kind, company_id, month, key, status) VALUES (?,?,?,?,?,?)",
                                (f"render-{i}", "render", 1, month, key, render))
            if email:
                led.db.conn.execute("INSERT INTO jobs (id, kind, company_id, month, key, status)"
                                    " VALUES (?,?,?,?,?,?)", (f"email-{i}", "email", 1, month, key, email))
    slips = led.slip_counts(month)[1]
    assert _progress(led, month) == {"done": slips["done"], "failed": slips["failed"], "rendered": 5}
    assert (slips["done"], slips["failed"]) == (1, 2)


def test_the_demo_waits_long_enough_for_the_run_it_was_asked_for():
    """A flat 900 s gave up on a healthy 50,000-slip demo (at 40/s the sends alone take
    1,250 s): the default now grows with the slips and the email rate limit."""
    from payrun.demo import DEMO_TIMEOUT_S, default_timeout_s

    assert default_timeout_s(600, 40.0) == DEMO_TIMEOUT_S == 900
    assert default_timeout_s(50_000, 40.0) == 2 * 1_250 + 300
    assert default_timeout_s(50_000, 10.0) == 2 * 5_000 + 300
    assert default_timeout_s(20_000, 40.0) == 1_300


def test_a_demo_that_gives_up_counts_what_the_provider_delivered(tmp_path):
    """New-user walkthrough (session 35): `demo --timeout 10` gave up and printed "164 sent"
    beside the provider's "196 delivered": the table was taken while sends were in flight
    and before the ledger had caught up. It now stops the workers first (they finish and
    record what they hold) and applies the ledger's backlog, then counts."""
    out, rc = _demo(tmp_path, 1500, timeout_s=10)
    assert rc != 0 and "gave up after 10 s" in out, out[-3000:]
    total = re.search(r"Total: ([\d,]+) sent, ([\d,]+) in progress", out)
    delivered = re.search(r"provider: ([\d,]+) delivered", out)
    assert total and delivered, out[-3000:]
    sent = int(total.group(1).replace(",", ""))
    assert 0 < sent < 1500 and sent == int(delivered.group(1).replace(",", "")), out[-3000:]


def test_the_demos_provider_refuses_anyone_without_its_token(tmp_path):
    """The demo's provider holds a run's recipients and subjects, and takes an outage or a
    reset of its dedupe: asked while the demo runs, without its token or with a wrong
    one, every endpoint answers 401, and nothing asked that way was accepted or done (the
    run delivers each slip once, its counts untouched)."""
    import http.client
    import json

    env = {k: v for k, v in os.environ.items()
           if k not in ("PAYRUN_REDIS_URL", "PAYRUN_EMAIL_URL", "PAYRUN_CONFIG", "PAYRUN_EMAIL_TOKEN")}
    env["PAYRUN_HOME"] = str(tmp_path / "home")
    proc = subprocess.Popen([sys.executable, "-m", "payrun.cli", "demo", "--employees", "12", "--companies", "2",
                             "--timeout", "240"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    try:
        for line in proc.stderr:  # (ends if the demo exits: then the assertion below says so)
            seen.append(line)
            if m := re.match(r"local email provider at http://127\.0\.0\.1:(\d+) ", line):
                port = int(m.group(1))
                break
        else:
            raise AssertionError("the demo named no local provider:\n" + "".join(seen))

        def ask(method, path, doc=None, token=None, key=None):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                headers = {"Content-Type": "application/json"}
                if token is not None:
                    headers["Authorization"] = f"Bearer {token}"
                if key is not None:
                    headers["Idempotency-Key"] = key
                conn.request(method, path, body=None if doc is None else json.dumps(doc).encode(), headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                return resp.status, resp.getheader("WWW-Authenticate"), raw
            finally:
                conn.close()

        slip = {"to": "intruder@meghna.example", "to_name": "X", "from": "x@payrun.localhost", "subject": "x",
                "text": "x", "attachments": []}
        asks = [("POST", "/v1/messages", slip, "slip:2026-11:intruder"), ("GET", "/v1/messages/slip:2026-11:e1", None, None),
                ("GET", "/v1/stats", None, None), ("POST", "/v1/admin/reset", {}, None),
                ("POST", "/v1/admin/outage", {"seconds": 600}, None), ("POST", "/v1/admin/config", {"rate_per_s": 0.5}, None)]
        for method, path, doc, key in asks:
            for token in (None, "a-guess", ""):
                status, challenge, raw = ask(method, path, doc, token, key)
                assert (status, challenge) == (401, "Bearer"), (method, path, token, status)
                assert b"intruder" not in raw and b"meghna" not in raw
        # with the demo's own token (the data directory's file; the test is its owner):
        # nothing of the above was taken
        token = (tmp_path / "home" / "demo" / "redis" / "provider-token").read_text().strip()
        assert ask("GET", "/v1/messages/slip:2026-11:intruder", token=token)[0] == 404
        stats = json.loads(ask("GET", "/v1/stats", token=token)[2])
        assert stats["unauthorized"] == 3 and stats["outage_s_left"] == 0 and stats["rate_per_s"] > 0.5, stats
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # (an assertion failed) SIGINT: the demo stops its workers and Redis
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, ("".join(seen) + err)[-3000:]
    m = re.search(r"provider: (\d+) delivered, (\d+) duplicates refused, (\d+) throttled \(429\), (\d+) rejected", out)
    assert m and tuple(map(int, m.groups())) == (12, 0, 0, 0), out[-3000:]
    assert token not in out + err + "".join(seen)
