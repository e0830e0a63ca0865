"""The local provider simulator over real HTTP (http.client), mostly with a fake clock."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import quote

import pytest

from payrun.provider import Provider, address_problem

PDF = b"%PDF-1.7\nfake slip\n%%EOF\n"


class FakeClock:
    def __init__(self):
        self.t = 1000.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            return self.t

    def advance(self, s: float) -> None:
        with self.lock:
            self.t += s


def body(to="tanvir.ahmed@meghna.example", pdf=PDF) -> dict:
    return {"to": to, "to_name": "Tanvir Ahmed", "from": "Payroll <payroll@payrun.localhost>",
            "subject": "Salary slip", "text": "attached",
            "attachments": [{"filename": "slip.pdf", "content_type": "application/pdf",
                             "content_b64": base64.b64encode(pdf).decode()}]}


class Client:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, p: Provider, token: str | None = None, timeout: float = 10):
        self.conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=timeout)
        self.token = token

    def call(self, method, path, doc=None, headers=None):
        h = dict(headers or {})
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        data = None
        if doc is not None:
            data = json.dumps(doc).encode()
            h["Content-Type"] = "application/json"
        self.conn.request(method, path, body=data, headers=h)
        r = self.conn.getresponse()
        raw = r.read()
        return r.status, r, (json.loads(raw) if raw else None)

    def send(self, key: str | None, **kw):
        headers = {"Idempotency-Key": key} if key is not None else {}
        return self.call("POST", "/v1/messages", body(**kw), headers)

    def stats(self):
        return self.call("GET", "/v1/stats")[2]

    def close(self):
        self.conn.close()


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def prov(clock):
    p = Provider(latency_s=0, rate_per_s=3, clock=clock).start()
    yield p
    p.stop()


def test_accept_then_duplicate(prov):
    c = Client(prov)
    status, _, doc = c.send("slip:2026-11:emp-00017")
    assert status == 202 and doc["duplicate"] is False
    status, _, dup = c.send("slip:2026-11:emp-00017")
    assert status == 200 and dup == {"id": doc["id"], "duplicate": True}
    st = c.stats()
    assert (st["received"], st["delivered"], st["duplicates_refused"]) == (2, 1, 1)

    status, _, rec = c.call("GET", "/v1/messages/" + quote("slip:2026-11:emp-00017"))
    assert status == 200
    assert rec["to"] == "tanvir.ahmed@meghna.example" and rec["subject"] == "Salary slip"
    assert rec["attachments"] == [{"filename": "slip.pdf", "content_type": "application/pdf",
                                   "size": len(PDF), "sha256": hashlib.sha256(PDF).hexdigest()}]
    assert "content_b64" not in json.dumps(rec)
    assert c.call("GET", "/v1/messages/slip:nope")[0] == 404
    c.close()


def test_missing_key_and_malformed_are_400(prov):
    c = Client(prov)
    status, _, doc = c.send(None)
    assert status == 400 and "Idempotency-Key" in doc["error"]
    status, _, _ = c.call("POST", "/v1/messages", {"to": "a@b.example", "attachments": [{"content_b64": "!!"}]},
                          {"Idempotency-Key": "k"})
    assert status == 400
    assert c.stats()["bad_request"] == 2 and c.stats()["delivered"] == 0


@pytest.mark.parametrize("addr", ["no-at-sign", "two@@example.com", "with space@x.example",
                                  "x@nowhere.invalid", "x@", "@x.example", "x@-bad-.example", ""])
def test_invalid_addresses_are_422(prov, addr):
    c = Client(prov)
    status, _, doc = c.send("k1", to=addr)
    assert status in (422,) and ("invalid recipient address" in doc["error"] or "missing" in doc["error"])
    assert c.stats()["rejected"] == 1


def test_address_problem_accepts_ordinary_addresses():
    for ok in ("tanvir.ahmed@meghna.example", "a+b@x.co", "payroll@payrun.localhost", "x@localhost"):
        assert address_problem(ok) is None, ok


def test_rate_limit_rolling_window_with_fake_clock(prov, clock):
    c = Client(prov)
    assert [c.send(f"k{i}")[0] for i in range(3)] == [202, 202, 202]
    status, resp, _ = c.send("k3")
    assert status == 429 and resp.getheader("Retry-After") == "1"
    clock.advance(0.5)
    assert c.send("k4")[0] == 429
    clock.advance(0.5)  # the first three are now a full second old
    assert c.send("k5")[0] == 202
    st = c.stats()
    assert st["throttled_429"] == 2 and st["delivered"] == 4 and st["max_rate_1s"] == 3
    assert sum(st["per_second"].values()) == 4


def test_outage_window(prov, clock):
    c = Client(prov)
    status, _, doc = c.call("POST", "/v1/admin/outage", {"seconds": 10, "status": 503})
    assert status == 200 and doc["outage"] is True
    assert c.send("k1")[0] == 503
    clock.advance(9.9)
    assert c.send("k1")[0] == 503
    clock.advance(0.2)
    assert c.send("k1")[0] == 202
    c.call("POST", "/v1/admin/outage", {"seconds": 100, "status": 500})
    assert c.send("k2")[0] == 500
    assert c.call("DELETE", "/v1/admin/outage")[0] == 200
    assert c.send("k2")[0] == 202
    st = c.stats()
    assert st["outage_5xx"] == 3 and st["delivered"] == 2 and st["received"] == 5
    assert c.call("POST", "/v1/admin/outage", {"seconds": 1, "status": 200})[0] == 400


def test_reset_and_config(prov):
    c = Client(prov)
    c.send("k1")
    assert c.call("POST", "/v1/admin/reset")[0] == 200
    st = c.stats()
    assert st["received"] == 0 and st["delivered"] == 0 and st["per_second"] == {}
    assert c.send("k1")[2]["duplicate"] is False  # dedupe forgotten
    status, _, doc = c.call("POST", "/v1/admin/config", {"rate_per_s": 50, "latency_s": 0.01})
    assert status == 200 and doc == {"latency_s": 0.01, "rate_per_s": 50.0}
    assert c.stats()["rate_per_s"] == 50.0
    assert c.call("GET", "/v1/nothing")[0] == 404


def test_token_required():
    p = Provider(latency_s=0, rate_per_s=10, token="tok-1").start()
    try:
        c = Client(p)
        status, resp, _ = c.send("k1")
        assert status == 401 and resp.getheader("WWW-Authenticate") == "Bearer"
        assert c.call("GET", "/v1/stats")[0] == 401
        authed = Client(p, token="tok-1")
        assert authed.send("k1")[0] == 202
        st = authed.stats()
        assert st["unauthorized"] == 1 and st["delivered"] == 1
    finally:
        p.stop()


def test_rate_limit_under_concurrent_load():
    """30 clients hammer a rate-20 provider for ~1.5 s: no wall-clock second admits > 20."""
    p = Provider(latency_s=0.05, rate_per_s=20).start()
    stop_at = time.monotonic() + 1.5
    counts = {"202": 0, "429": 0, "other": 0}
    lock = threading.Lock()

    def client(n):
        c = Client(p)
        i = 0
        while time.monotonic() < stop_at:
            status = c.send(f"load:{n}:{i}")[0]
            i += 1
            with lock:
                counts[str(status) if status in (202, 429) else "other"] += 1
            if status == 429:
                time.sleep(0.02)  # pacing, like a polite client; keeps the test's CPU down
        c.close()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(30)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        st = p.stats()
    finally:
        p.stop()
    assert counts["other"] == 0
    assert st["max_rate_1s"] <= 20
    assert all(n <= 20 for n in st["per_second"].values()), st["per_second"]
    assert st["throttled_429"] == counts["429"] > 0
    assert st["delivered"] == counts["202"] == sum(st["per_second"].values())
    assert st["delivered"] >= 20  # it did admit at the rate, not less


def test_sixty_concurrent_requests_are_served_concurrently():
    p = Provider(latency_s=1.5, rate_per_s=1000).start()  # (room for 60 threads to start on a loaded host)
    n = 60
    barrier = threading.Barrier(n)
    statuses: list[int] = []
    lock = threading.Lock()

    def one(i):
        c = Client(p)
        barrier.wait(timeout=10)
        status = c.send(f"conc:{i}")[0]
        with lock:
            statuses.append(status)
        c.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        # a client has its reply a moment before the server thread leaves its handler
        deadline = time.monotonic() + 10
        while p.stats()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.01)
        st = p.stats()
    finally:
        p.stop()
    assert statuses == [202] * n
    assert st["delivered"] == n and st["in_flight"] == 0
    assert st["max_in_flight"] >= 50, st["max_in_flight"]  # serial handling would give 1


def test_keep_alive_and_stop_closes_connections():
    p = Provider(latency_s=0, rate_per_s=100).start()
    c = Client(p)
    for i in range(5):
        assert c.send(f"ka{i}")[0] == 202
    sock = c.conn.sock
    assert sock is not None  # still the same connection: HTTP/1.1 keep-alive
    port = p.port
    p.stop()
    with pytest.raises((OSError, http.client.HTTPException)):
        c.send("after-stop")
    c.close()
    # the port is free again
    p2 = Provider(port=port, latency_s=0, rate_per_s=1).start()
    p2.stop()


def test_run_stops_on_sigterm():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    code = f"from payrun.provider import run; run('127.0.0.1', {port}, 0.0, 40.0)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/v1/stats")
                assert conn.getresponse().status == 200
                conn.close()
                break
            except OSError:
                assert proc.poll() is None, "provider exited early"
                assert time.monotonic() < deadline, "provider did not come up"
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopping_provider_answers_the_sends_in_flight_before_it_closes():
    """supervisord killed: every program gets SIGTERM at once (supervise.stop_with_supervisord).
    The provider dropped its connections within 0.5 s, while a sender's request it had
    already delivered was in its latency: the sender got no answer, sent again after the next
    `payrun up`, and the new provider (its dedupe lost with the old one's memory) delivered
    that slip a second time. It now answers the requests in flight first."""
    from conftest import wait_for

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    code = f"from payrun.provider import run; run('127.0.0.1', {port}, 1.5, 40.0)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    got: list = []

    def stats():
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/stats")
            return json.loads(conn.getresponse().read())
        except OSError:
            assert proc.poll() is None, "provider exited early"
            return None

    def send():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/messages", body=json.dumps(body()).encode(),
                         headers={"Idempotency-Key": "in-flight", "Content-Type": "application/json"})
            got.append(conn.getresponse().status)
        except (OSError, http.client.HTTPException) as e:
            got.append(type(e).__name__)

    try:
        wait_for(stats, timeout_s=15, what="the provider to listen")
        sender = threading.Thread(target=send)
        sender.start()
        wait_for(lambda: (st := stats()) and st["delivered"] == 1 and st["in_flight"] == 1, timeout_s=15,
                 what="the send delivered, its answer not yet given (the latency)")
        proc.send_signal(signal.SIGTERM)
        sender.join(timeout=30)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got == [202] and proc.returncode == 0, (got, out)


def test_a_stopping_provider_waits_one_latency_and_5_s_for_its_sends_within_supervisords_10_s():
    from payrun.provider import stop_drain_s

    assert stop_drain_s(1.2) == 6.2 and stop_drain_s(0) == 5.0 and stop_drain_s(60) == 8.0


def test_a_send_that_comes_to_a_provider_past_its_drain_is_refused_not_delivered():
    """A request read just as the drain ended (on a kept-alive connection) could be delivered
    and then lose its answer to the dropped connection: it is answered 503 instead."""
    p = Provider(latency_s=0, rate_per_s=100).start()
    try:
        c = Client(p)
        assert c.send("before")[0] == 202
        with p.state.lock:
            p.state.stopping = True  # (as Provider.stop sets it once nothing is in flight)
        status, _, doc = c.send("after")
        assert status == 503 and doc == {"error": "provider stopping"}
        assert p.stats()["delivered"] == 1 and p.delivery("after") is None
        c.close()
    finally:
        p.stop()


def test_the_provider_process_says_its_counters_when_it_stops(tmp_path):
    """Its counters are in memory: a `payrun down`/`up` mid-run took the only record of
    delivered and duplicate sends with it. They are logged on the way out."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from conftest import wait_for

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "PAYRUN_HOME": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-m", "payrun.cli", "provider", "--port", str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up():
            token = tmp_path / "redis" / "provider-token"
            if not token.exists():
                return False
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/stats",
                                         headers={"Authorization": f"Bearer {token.read_text().strip()}"})
            try:
                return urllib.request.urlopen(req, timeout=2).status == 200
            except OSError:
                return False

        wait_for(up, timeout_s=30, what="the provider to listen")
    finally:
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=30)[0]
    assert p.returncode == 0, out
    assert "provider counters at stop: " in out and "delivered=0" in out and "duplicates_refused=0" in out


# ---- `payrun provider`: the data directory's token ---------------------------------------

def _status(port: int, method: str, path: str, token: str | None = None, doc=None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request(method, path, body=None if doc is None else json.dumps(doc).encode(), headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_payrun_provider_wants_its_token_and_this_hosts_senders_show_it(tmp_path, monkeypatch):
    """It had no token: any user of the machine read a slip's recipient and subject from it
    (GET /v1/messages/<key>), reset its dedupe or started an outage. `payrun provider`, as
    supervisord starts it (no option), now requires the data directory's token, which a
    sender with PAYRUN_EMAIL_URL unset shows; `payrun provider outage` and `stats` use it."""
    from conftest import wait_for

    from jobs import mail, tasks

    home = tmp_path / "home"
    home.mkdir()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    conf = tmp_path / "payrun.toml"
    conf.write_text(f"[provider]\nport = {port}\nlatency_s = 0.0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYRUN_")}
    env.update(PAYRUN_HOME=str(home), PAYRUN_CONFIG=str(conf))

    def payrun(*args):
        return subprocess.run([sys.executable, "-m", "payrun.cli", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    proc = subprocess.Popen([sys.executable, "-m", "payrun.cli", "provider"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    try:
        def listening():
            try:
                return _status(port, "GET", "/v1/stats")
            except OSError:
                assert proc.poll() is None, "the provider exited"
                return None

        # no token: every endpoint refuses, the admin ones and the reads of deliveries too
        assert wait_for(listening, timeout_s=30, what="the provider to listen") == 401
        for method, path, doc in (("GET", "/v1/messages/slip:2026-11:e1", None), ("POST", "/v1/admin/reset", {}),
                                  ("POST", "/v1/admin/outage", {"seconds": 60}), ("DELETE", "/v1/admin/outage", {}),
                                  ("POST", "/v1/admin/config", {"rate_per_s": 1}), ("POST", "/v1/messages", body())):
            assert _status(port, method, path, doc=doc) == 401, path
            assert _status(port, method, path, token="a-guess", doc=doc) == 401, path
        token_file = home / "redis" / "provider-token"
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        token = token_file.read_text().strip()
        assert len(token) >= 24 and _status(port, "GET", "/v1/stats", token=token) == 200

        # a sender of this host, PAYRUN_EMAIL_URL unset (a worker's transport): delivered
        for k in ("PAYRUN_EMAIL_URL", "PAYRUN_EMAIL_TOKEN", "PAYRUN_REDIS_URL"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("PAYRUN_HOME", str(home))
        monkeypatch.setenv("PAYRUN_CONFIG", str(conf))
        tasks.settings.cache_clear()
        tasks._transports.clear()
        try:
            t = tasks.transport()
            assert f"127.0.0.1:{port}" in repr(t) and token not in repr(t)
            sent = t.send(mail.Message(to_addr="tanvir.ahmed@meghna.example", to_name="Tanvir Ahmed",
                                       subject="Salary slip", text_body="attached", attachment_name="slip.pdf",
                                       attachment_bytes=PDF, idempotency_key="slip:2026-11:e1",
                                       sender="Payroll <payroll@payrun.localhost>"))
            assert sent.startswith("msg-") and not sent.duplicate
            t.close()
        finally:
            tasks._transports.clear()
            tasks.settings.cache_clear()

        # the operator's outage rehearsal and counters, with no token to copy
        said = payrun("provider", "outage", "90")
        assert said.returncode == 0 and "answered 503 for 90 s" in said.stdout, said.stderr
        stats = json.loads(payrun("provider", "stats").stdout)
        assert stats["delivered"] == 1 and stats["unauthorized"] == 2 and 0 < stats["outage_s_left"] <= 90
        assert payrun("provider", "outage", "0").returncode == 0
        assert json.loads(payrun("provider", "stats").stdout)["outage_s_left"] == 0
        shown = payrun("config", "show").stdout + payrun("config", "show", "--json").stdout
        assert shown and token not in shown and token not in said.stdout + said.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "bearer token required" in out and token not in out


def test_the_outage_command_makes_no_token_where_no_provider_ran(tmp_path):
    """Run from the wrong data directory it would make a new token and be refused (401):
    it says which file is missing instead, and makes nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYRUN_")}
    env["PAYRUN_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-m", "payrun.cli", "provider", "outage", "90"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and f"no provider token at {tmp_path / 'redis' / 'provider-token'}" in out.stderr
    assert not (tmp_path / "redis").exists()


def test_a_senders_token_the_environment_first_then_the_local_providers(tmp_path):
    import dataclasses

    from payrun import config as config_mod
    from payrun.provider import email_token, local_token

    cfg = config_mod.load(None, env={"PAYRUN_HOME": str(tmp_path)})
    assert email_token(cfg, {"PAYRUN_EMAIL_TOKEN": "theirs"}) == "theirs"
    assert not (tmp_path / "redis").exists()
    mine = email_token(cfg, {})  # no email URL: the local provider's file, made on first use
    assert mine.path == tmp_path / "redis" / "provider-token"
    assert mine.current() == local_token(cfg) == (tmp_path / "redis" / "provider-token").read_text().strip()
    assert mine.current() not in repr(mine)
    real = dataclasses.replace(cfg, email=dataclasses.replace(cfg.email, url="https://api.mail.example"))
    assert email_token(real, {}) is None  # never shown to another provider



# ---- the token file replaced: followed by `payrun provider` and its senders ------------

def _replace_token(path, token: str) -> None:
    """Replace a token file as payrun's rule for secrets wants it (``_create_secret``): the
    new one written beside, 0600, then moved into place in one step."""
    tmp = path.with_name(f".{path.name}.test")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)


def _slip(key: str):
    from jobs import mail

    return mail.Message(to_addr="tanvir.ahmed@meghna.example", to_name="Tanvir Ahmed", subject="Salary slip",
                        text_body="attached", attachment_name="slip.pdf", attachment_bytes=PDF,
                        idempotency_key=key, sender="Payroll <payroll@payrun.localhost>")


class _PayrunProvider:
    """`payrun provider` as supervisord starts it (no option), in its own process, for the
    data directory ``home``; senders of this host in this process (``sender``)."""

    def __init__(self, tmp_path, monkeypatch):
        from conftest import wait_for

        self.home = tmp_path / "home"
        self.home.mkdir()
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.conf = tmp_path / "payrun.toml"
        self.conf.write_text(f"[provider]\nport = {self.port}\nlatency_s = 0.0\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAYRUN_")}
        env.update(PAYRUN_HOME=str(self.home), PAYRUN_CONFIG=str(self.conf))
        self.monkeypatch = monkeypatch
        self.proc = subprocess.Popen([sys.executable, "-m", "payrun.cli", "provider"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.out = ""

        def listening():
            try:
                return _status(self.port, "GET", "/v1/stats")
            except OSError:
                assert self.proc.poll() is None, "the provider exited"
                return None

        try:
            assert wait_for(listening, timeout_s=30, what="the provider to listen") == 401
        except BaseException:
            self.stop()
            raise
        self.token_file = self.home / "redis" / "provider-token"

    def sender(self, home=None, **env):
        """A send-email worker's transport (``tasks.transport``), PAYRUN_EMAIL_URL unset."""
        from jobs import tasks

        for k in ("PAYRUN_EMAIL_URL", "PAYRUN_EMAIL_TOKEN", "PAYRUN_REDIS_URL"):
            self.monkeypatch.delenv(k, raising=False)
        self.monkeypatch.setenv("PAYRUN_HOME", str(home or self.home))
        self.monkeypatch.setenv("PAYRUN_CONFIG", str(self.conf))
        for k, v in env.items():
            self.monkeypatch.setenv(k, v)
        tasks.settings.cache_clear()
        tasks._transports.clear()
        try:
            return tasks.transport()
        finally:
            tasks._transports.clear()
            tasks.settings.cache_clear()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.out = self.proc.communicate(timeout=30)[0]


def test_a_refused_senders_words_name_where_its_token_came_from(tmp_path, monkeypatch):
    """It said "check PAYRUN_EMAIL_TOKEN" when that was not set and the token came from the
    data directory's file: now the file and the rule (one PAYRUN_HOME for `payrun provider`
    and its senders), or the variable when that was the source; never the token."""
    from jobs.errors import AccountRefused

    prov = _PayrunProvider(tmp_path, monkeypatch)
    try:
        # a sender run with another data directory: its own file's token, refused
        other = tmp_path / "other-home"
        t = prov.sender(home=other)
        mine = (other / "redis" / "provider-token").read_text().strip()
        with pytest.raises(AccountRefused) as ei:
            t.send(_slip("slip:2026-11:e1"))
        said = str(ei.value)
        assert said.startswith(f"the provider refused our credentials, the local provider's token in "
                               f"{other / 'redis' / 'provider-token'} (`payrun provider` and its senders must share "
                               f"one data directory, PAYRUN_HOME): provider 127.0.0.1:{prov.port}: HTTP 401"), said
        assert "PAYRUN_EMAIL_TOKEN" not in said and mine not in said
        with pytest.raises(ValueError) as ei:
            t.probe()  # `payrun check`: the same source named
        assert str(ei.value) == (f"the provider refused our token (401), the local provider's token in "
                                 f"{other / 'redis' / 'provider-token'} (PAYRUN_EMAIL_TOKEN is not set): "
                                 f"`payrun provider` and its senders must share one data directory, PAYRUN_HOME")
        t.close()

        # PAYRUN_EMAIL_TOKEN set (and wrong): the variable, not the file
        t = prov.sender(PAYRUN_EMAIL_TOKEN="a-stale-token")
        with pytest.raises(AccountRefused) as ei:
            t.send(_slip("slip:2026-11:e1"))
        said = str(ei.value)
        assert said.startswith("the provider refused our credentials, check PAYRUN_EMAIL_TOKEN (the provider's "
                               f"token): provider 127.0.0.1:{prov.port}: HTTP 401"), said
        assert "provider-token" not in said and "a-stale-token" not in said
        t.close()
        token = prov.token_file.read_text().strip()
        stats = json.loads(_body(prov.port, "/v1/stats", token))
        assert stats["delivered"] == 0 and stats["unauthorized"] == 3  # (two sends and the probe)
    finally:
        prov.stop()
    assert prov.proc.returncode == 0, prov.out


def _body(port: int, path: str, token: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200, (path, resp.status)
        return raw
    finally:
        conn.close()


def test_a_replaced_token_file_is_followed_by_the_provider_and_its_senders(tmp_path, monkeypatch):
    """Both read the file once, as they started: a new token (the old one leaked, say)
    meant restarting the provider and every sender, or each send was refused. Now the
    provider looks at the file (one stat) at most once a second and its senders read it
    again when refused: the next send after the change goes through, neither restarted,
    and the old token is refused."""
    from conftest import wait_for

    prov = _PayrunProvider(tmp_path, monkeypatch)
    try:
        t = prov.sender()
        old = prov.token_file.read_text().strip()
        first = t.send(_slip("slip:2026-11:e1"))
        assert first.startswith("msg-")

        new = "replaced-" + os.urandom(18).hex()
        _replace_token(prov.token_file, new)
        assert oct(prov.token_file.stat().st_mode & 0o777) == "0o600"

        def follows():  # the old token refused, the new one taken: without a restart
            return (_status(prov.port, "GET", "/v1/stats", token=old) == 401
                    and _status(prov.port, "GET", "/v1/stats", token=new) == 200)

        wait_for(follows, timeout_s=10, what="the provider to take the replaced token file")
        before = json.loads(_body(prov.port, "/v1/stats", new))["unauthorized"]
        # the sender still holds the old token: refused once, reads the file, sends again
        second = t.send(_slip("slip:2026-11:e2"))
        assert second.startswith("msg-") and not second.duplicate
        third = t.send(_slip("slip:2026-11:e3"))  # and goes on with the new one
        assert third.startswith("msg-")
        stats = json.loads(_body(prov.port, "/v1/stats", new))
        assert stats["delivered"] == 3 and stats["duplicates_refused"] == 0
        assert stats["unauthorized"] == before + 1, stats  # that one refusal, no more
        assert prov.proc.poll() is None
        t.close()
    finally:
        prov.stop()
    assert prov.proc.returncode == 0, prov.out
    assert old not in prov.out and new not in prov.out
    assert f"the token in {prov.token_file} was replaced: using the new one" in prov.out


def test_a_token_file_is_looked_at_once_a_second_or_when_asked(tmp_path, caplog):
    """``TokenFile``: no look at the file (no stat) before its second is up; a replaced
    file read then, or at once by ``refresh``; a file gone, empty or readable by others
    keeps the token read last (fixed to 0600 when ours), and the words never show it."""
    import logging

    from payrun.provider import TokenFile

    clock = FakeClock()
    path = tmp_path / "provider-token"
    _replace_token(path, "first-token")
    tf = TokenFile(path, clock=clock)
    assert tf.current() == "first-token"
    _replace_token(path, "second-token")
    assert tf.current() == "first-token"  # not looked at yet
    clock.advance(1.0)
    assert tf.current() == "second-token"
    _replace_token(path, "third-token")
    assert tf.refresh() == "third-token"  # looked at now (after a refusal)

    with caplog.at_level(logging.WARNING, logger="payrun.provider"):
        path.unlink()
        assert tf.refresh() == "third-token"  # gone: the last one kept
        path.write_text("")
        os.chmod(path, 0o600)
        assert tf.refresh() == "third-token"  # empty (a writer mid-way): kept
        path.write_text("fourth-token\n")
        os.chmod(path, 0o644)
        assert tf.refresh() == "fourth-token" and path.stat().st_mode & 0o777 == 0o600
    said = caplog.text
    assert f"cannot read {path}" in said and f"{path} is empty" in said
    assert "token" in said and not any(t in said for t in ("first-token", "third-token", "fourth-token"))
    assert "fourth-token" not in repr(tf)


def test_the_provider_takes_a_replaced_token_at_once_and_drops_the_old_within_a_second(tmp_path):
    """A sender that read the new file before the provider looked is not refused (the
    provider looks at once when shown another token); the old token works until the
    provider's next look, at most a second later, then never again."""
    from payrun.provider import TokenFile

    clock = FakeClock()
    path = tmp_path / "provider-token"
    _replace_token(path, "old-token")
    p = Provider(latency_s=0, rate_per_s=100, token=TokenFile(path, clock=clock)).start()
    try:
        assert Client(p, "old-token").stats()["unauthorized"] == 0
        _replace_token(path, "new-token")
        assert Client(p, "new-token").call("GET", "/v1/stats")[0] == 200  # at once
        assert Client(p, "a-guess").call("GET", "/v1/stats")[0] == 401
        clock.advance(1.0)
        assert Client(p, "old-token").call("GET", "/v1/stats")[0] == 401
        assert Client(p, "new-token").call("GET", "/v1/stats")[0] == 200
    finally:
        p.stop()


def test_a_sender_with_a_token_file_does_not_look_at_it_while_its_token_is_taken():
    """The send path is benchmarked: an accepted token costs no look at the file, not
    even a stat; only a refusal reads it again (and a token it did not change is refused
    once, with the file named)."""
    from jobs import mail
    from jobs.errors import AccountRefused

    class Counted:
        path = "/data/redis/provider-token"

        def __init__(self, token):
            self.token, self.looks = token, 0

        def current(self):
            self.looks += 1
            return self.token

        def refresh(self):
            self.looks += 1
            return self.token

    p = Provider(latency_s=0, rate_per_s=1000, token="right").start()
    try:
        src = Counted("right")
        t = mail.transport_for(p.url, 5, token=src)
        assert src.looks == 1  # the first read
        for i in range(20):
            assert t.send(_slip(f"slip:2026-11:e{i}")).startswith("msg-")
        assert src.looks == 1
        wrong = Counted("wrong")
        t2 = mail.transport_for(p.url, 5, token=wrong)
        with pytest.raises(AccountRefused, match="the local provider's token in /data/redis/provider-token"):
            t2.send(_slip("slip:2026-11:x"))
        assert wrong.looks == 2 and p.stats()["unauthorized"] == 1  # read again; not sent again
        t.close()
        t2.close()
    finally:
        p.stop()


def test_a_token_file_with_a_line_break_is_not_taken_and_the_token_never_reaches_an_error(tmp_path, caplog):
    """A replaced token file written by hand with a second line (or another control or a
    non-ASCII character) was taken: every send then failed with http.client's "Invalid
    header value b'Bearer <the token>...'", the token in the job's error, the ledger,
    `payrun failed` and `payrun check`'s output. It is not a token: the last one is kept
    (the file named, never its text), and a first read refuses it the same way."""
    import logging

    from payrun.errors import ConfigError
    from payrun.provider import TokenFile

    path = tmp_path / "provider-token"
    _replace_token(path, "good-token")
    p = Provider(latency_s=0, rate_per_s=1000, token="good-token").start()
    try:
        tf = TokenFile(path)
        from jobs import mail

        t = mail.transport_for(p.url, 5, token=tf)
        with caplog.at_level(logging.WARNING, logger="payrun.provider"):
            for bad in ("SECRETabc\nsecond line", "SECRET\rabc", "SECRET\x1b[2Jabc", "SECRET\u09aeabc"):
                _replace_token(path, bad)
                assert tf.refresh() == "good-token", repr(bad)
                assert t.send(_slip(f"slip:2026-11:{len(bad)}-{ord(bad[6])}")).startswith("msg-")
                with pytest.raises(ConfigError) as ei:
                    TokenFile(path)
                assert str(path) in str(ei.value) and "SECRET" not in str(ei.value)
            path.with_name("raw").write_bytes(b"SECRET\xffabc")  # not even UTF-8
            os.chmod(path.with_name("raw"), 0o600)
            os.replace(path.with_name("raw"), path)
            assert tf.refresh() == "good-token"
            with pytest.raises(ConfigError, match="not one line of printable ASCII"):
                TokenFile(path)
        assert str(path) in caplog.text and "SECRET" not in caplog.text
        _replace_token(path, "next-token with a space")  # odd but a valid header value: taken
        assert tf.refresh() == "next-token with a space"
        t.close()
    finally:
        p.stop()
