"""A local email provider: the JSON HTTP API of ``jobs/mail.py`` (see its docstring),
behaving like the seed's provider: each accepted message takes ``latency_s`` (1.2 s) to
answer, at most ``rate_per_s`` (40) message requests are admitted per rolling second,
the rest get ``429 Retry-After: 1`` at once. Nothing is emailed; deliveries are recorded
in memory (address, subject, attachment name/size/sha256 — never the bytes or the body).

Endpoints (all JSON; with ``token=...`` every endpoint needs ``Authorization: Bearer``;
``payrun provider`` always has one, the data directory's ``provider-token``, see
``local_token``; ``payrun provider outage`` / ``stats`` call the admin endpoints with it):
  POST   /v1/messages          send (Idempotency-Key header required)
           202 {"id", "duplicate": false}   accepted (after latency_s)
           200 {"id", "duplicate": true}    key already accepted (at once; counts duplicates_refused)
           400 malformed / no Idempotency-Key (counts bad_request)
           401 missing or wrong token
           422 {"error": "invalid recipient address: ..."} (counts rejected)
           429 Retry-After: 1                rate limited (at once; counts throttled_429)
           5xx                               during an injected outage (counts outage_5xx)
  GET    /v1/messages/<key>    what was delivered for that key, or 404 (with received_at,
                               when its headers were read, and accepted_at, its admission:
                               the difference is this server's own processing delay)
  GET    /v1/stats             counters (below)
  POST   /v1/admin/outage      {"seconds": 180, "status": 503}: message requests answer that
                               status for the window
  DELETE /v1/admin/outage      end the outage now
  POST   /v1/admin/config      {"latency_s": .., "rate_per_s": ..}: change behaviour live
  POST   /v1/admin/reset       clear counters, deliveries (dedupe), rate window and outage

Order of checks for a message request: token -> outage -> well-formed + key -> rate limit
-> address -> dedupe -> accept. The rate limit therefore counts every request that gets
past an outage and parsing (also duplicates and 422s), like a real provider's API limit.

Stats: received (all message POSTs), delivered (unique keys accepted), duplicates_refused,
rejected (422), bad_request (400), unauthorized (401), throttled_429, outage_5xx,
in_flight / max_in_flight (message requests inside the server right now / at most),
max_rate_1s (the most requests admitted by the limiter in any one wall-clock second),
per_second {"<unix second>": admitted} and received_per_second {"<unix second>": requests,
refused ones included} for the last 600 s.

Rate limit: a rolling one-second window of admission times (a deque); a request is
admitted while fewer than ``max(1, int(rate_per_s))`` were admitted in the last second.
That guarantees no 1-second interval — hence no per_second bucket — exceeds the rate (a
token bucket would allow up to 2x rate inside one second). Fractional rates round down.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import http.server
import json
import logging
import os
import re
import signal
import sys
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

MAX_BODY = 20 * 1024 * 1024
KEEPALIVE_IDLE_S = 120.0
"""An idle keep-alive connection is closed after this long (clients re-open)."""

_ADDR = re.compile(
    r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)


def address_problem(addr: Any) -> str | None:
    """Why ``addr`` is refused, or None if it is deliverable."""
    if not isinstance(addr, str) or not addr:
        return "missing recipient address"
    if len(addr) > 254 or not _ADDR.match(addr):
        return f"invalid recipient address: {addr[:100]!r}"
    domain = addr.rsplit("@", 1)[1].lower()
    if domain == "invalid" or domain.endswith(".invalid"):
        return f"invalid recipient address: {addr!r} (domain does not exist)"
    return None


class _State:
    """Counters, deliveries, rate window and outage; every access under ``lock``."""

    def __init__(self, clock: Callable[[], float]):
        self.lock = threading.Lock()
        self.clock = clock
        self.wall_offset = time.time() - clock()
        self.reset()

    def reset(self) -> None:
        self.counts = dict.fromkeys(
            ("received", "delivered", "duplicates_refused", "rejected", "bad_request",
             "unauthorized", "throttled_429", "outage_5xx"), 0)
        self.in_flight = 0
        self.max_in_flight = 0
        self.max_rate_1s = 0
        self.throttles: list[dict[str, Any]] = []
        self.per_second: dict[int, int] = {}
        self.received_per_second: dict[int, int] = {}
        self.window: collections.deque[float] = collections.deque()
        self.delivered: dict[str, dict[str, Any]] = {}
        self.outage_until = 0.0
        self.outage_status = 503
        self.stopping = False


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, addr, handler, provider: "Provider"):
        self.provider = provider
        self.open_sockets: set[socket.socket] = set()
        self.open_lock = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request, client_address):
        with self.open_lock:
            self.open_sockets.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self.open_lock:
            self.open_sockets.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address):
        # a client that hangs up mid-reply is normal (timeouts); anything else is logged
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, type(exc).__name__)
        else:
            log.exception("provider: error while handling a request from %s", client_address)

    def close_all_connections(self) -> None:
        with self.open_lock:
            socks = list(self.open_sockets)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "payrun-provider/1"
    disable_nagle_algorithm = True  # headers and body are two writes: avoid the 40 ms delayed-ACK stall
    timeout = KEEPALIVE_IDLE_S
    server: _Server

    # -- plumbing
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        # method, path and status only: never headers or bodies
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, status: int, doc: Any = None, headers: dict[str, str] | None = None) -> None:
        body = b"" if doc is None else json.dumps(doc).encode("utf-8")
        self.send_response(status)
        if doc is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _read_body(self) -> bytes | None:
        """The request body; None after answering 400/413 (and closing) if it is unreadable."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            self._reply(400, {"error": "chunked bodies not supported; send Content-Length"})
            return None
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0 or n > MAX_BODY:
            self.close_connection = True
            self._reply(413 if n > MAX_BODY else 400, {"error": "bad Content-Length"})
            return None
        return self.rfile.read(n) if n else b""

    def _json_body(self) -> Any:
        raw = self._read_body()
        if raw is None:
            return None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            self._reply(400, {"error": "body is not JSON"})
            return None

    def _authorized(self) -> bool:
        p = self.server.provider
        token = p.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "").encode("utf-8", "replace")
        if hmac.compare_digest(given, f"Bearer {token}".encode("utf-8")):  # (no timing to guess it by)
            return True
        # a sender that read a replaced token file before we looked at it: look now (a stat)
        now = p.token_now()
        return now != token and hmac.compare_digest(given, f"Bearer {now}".encode("utf-8"))

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path
        p = self.server.provider
        if not self._authorized():
            if method == "POST" and path == "/v1/messages":
                with p.state.lock:
                    p.state.counts["received"] += 1
                    p.state.counts["unauthorized"] += 1
            self._read_body()
            self._reply(401, {"error": "missing or wrong bearer token"},
                        {"WWW-Authenticate": "Bearer"})
            return
        if method == "POST" and path == "/v1/messages":
            return self._message()
        if method == "GET" and path == "/v1/stats":
            return self._reply(200, p.stats())
        if method == "GET" and path.startswith("/v1/messages/"):
            rec = p.delivery(unquote(path[len("/v1/messages/"):]))
            return self._reply(200, rec) if rec else self._reply(404, {"error": "no such message"})
        if path == "/v1/admin/outage" and method in ("POST", "DELETE"):
            doc = self._json_body()
            if doc is None:
                return
            if method == "DELETE":
                p.end_outage()
                return self._reply(200, {"outage": False})
            try:
                seconds = float(doc.get("seconds", 60))
                status = int(doc.get("status", 503))
                if not (seconds >= 0 and 400 <= status <= 599):
                    raise ValueError
            except (TypeError, ValueError, AttributeError):
                return self._reply(400, {"error": "want {\"seconds\": >= 0, \"status\": 400..599}"})
            p.outage(seconds, status)
            return self._reply(200, {"outage": True, "seconds": seconds, "status": status})
        if method == "POST" and path == "/v1/admin/reset":
            if self._read_body() is None:
                return
            p.reset()
            return self._reply(200, {"reset": True})
        if method == "POST" and path == "/v1/admin/config":
            doc = self._json_body()
            if doc is None:
                return
            try:
                if "latency_s" in doc:
                    p.latency_s = max(0.0, float(doc["latency_s"]))
                if "rate_per_s" in doc:
                    rate = float(doc["rate_per_s"])
                    if rate <= 0:
                        raise ValueError
                    p.rate_per_s = rate
            except (TypeError, ValueError, AttributeError):
                return self._reply(400, {"error": "latency_s >= 0 and rate_per_s > 0"})
            return self._reply(200, {"latency_s": p.latency_s, "rate_per_s": p.rate_per_s})
        self._read_body()
        self._reply(404, {"error": f"no route {method} {path[:100]}"})

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    # -- the message endpoint
    def _message(self) -> None:
        self._received_at = time.time()  # headers read; the admission comes after the body
        p = self.server.provider
        st = p.state
        with st.lock:
            st.counts["received"] += 1
            rsec = int(st.clock() + st.wall_offset)
            st.received_per_second[rsec] = st.received_per_second.get(rsec, 0) + 1
            if len(st.received_per_second) > 660:
                for old in [x for x in st.received_per_second if x < rsec - 600]:
                    del st.received_per_second[old]
            st.in_flight += 1
            st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            self._message_inner(p, st)
        finally:
            with st.lock:
                st.in_flight -= 1

    def _message_inner(self, p: "Provider", st: _State) -> None:
        raw = self._read_body()
        if raw is None:
            with st.lock:
                st.counts["bad_request"] += 1
            return
        with st.lock:
            now = st.clock()
            if now < st.outage_until:
                st.counts["outage_5xx"] += 1
                status = st.outage_status
            else:
                status = 0
        if status:
            return self._reply(status, {"error": "provider outage (simulated)"})

        key = (self.headers.get("Idempotency-Key") or "").strip()
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            attachments = []
            for a in doc.get("attachments") or []:
                data = base64.b64decode(a["content_b64"], validate=True)
                attachments.append({
                    "filename": str(a.get("filename", "")),
                    "content_type": str(a.get("content_type", "application/octet-stream")),
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                })
            if not key:
                raise ValueError("Idempotency-Key header is required")
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as e:
            with st.lock:
                st.counts["bad_request"] += 1
            why = str(e) if "Idempotency-Key" in str(e) else "malformed message request"
            return self._reply(400, {"error": why})

        problem = first = rec = None
        with st.lock:
            stopping = st.stopping  # (past its stop's drain: a delivery now could get no reply, see stop)
            if stopping:
                throttled = False
            elif not p._admit_locked(getattr(self, "_received_at", None)):
                st.counts["throttled_429"] += 1
                throttled = True
            else:
                throttled = False
                problem = address_problem(doc.get("to"))
                if problem:
                    st.counts["rejected"] += 1
                else:
                    first = st.delivered.get(key)
                    if first is not None:
                        st.counts["duplicates_refused"] += 1
                    else:
                        rec = {
                            "id": "msg-" + uuid.uuid4().hex[:20],
                            "key": key,
                            "to": doc.get("to"),
                            "subject": str(doc.get("subject", ""))[:500],
                            "attachments": attachments,
                            "accepted_at": time.time(),
                            "received_at": self._received_at,
                        }
                        st.delivered[key] = rec
                        st.counts["delivered"] += 1
        if stopping:
            return self._reply(503, {"error": "provider stopping"})
        if throttled:
            return self._reply(429, {"error": "rate limit exceeded"}, {"Retry-After": "1"})
        if problem:
            return self._reply(422, {"error": problem})
        if first is not None:
            return self._reply(200, {"id": first["id"], "duplicate": True})
        if p.latency_s > 0:
            time.sleep(p.latency_s)
        self._reply(202, {"id": rec["id"], "duplicate": False})


class Provider:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, latency_s: float = 1.2,
                 rate_per_s: float = 40.0, clock: Callable[[], float] = time.monotonic,
                 token: "str | TokenFile | None" = None):
        """``token``: what every request must show (``Authorization: Bearer``); a
        ``TokenFile`` (`payrun provider`'s) is followed when the file is replaced."""
        self.host = host
        self.latency_s = float(latency_s)
        self.rate_per_s = float(rate_per_s)
        if self.rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0 (got {rate_per_s})")
        self._token = token
        self.state = _State(clock)
        self._server = _Server((host, port), _Handler, self)
        self.port: int = self._server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread: threading.Thread | None = None

    @property
    def token(self) -> str | None:
        """The token required now (a token file is looked at, one stat, at most once a second)."""
        t = self._token
        return t if t is None or isinstance(t, str) else t.current()

    def token_now(self) -> str | None:
        """The token required, the token file looked at now (after a refused request)."""
        t = self._token
        return t if t is None or isinstance(t, str) else t.refresh()

    # -- lifecycle
    def start(self) -> "Provider":
        """Serve in a background (daemon) thread; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"provider:{self.port}",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        log.info("provider listening on %s (latency %.2f s, rate %g/s; %s)",
                 self.url, self.latency_s, self.rate_per_s,
                 "bearer token required" if self.token else "no token")
        self._server.serve_forever(poll_interval=0.05)

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop accepting, let the requests in flight get their reply (up to ``drain_s``),
        drop open keep-alive connections, release the port. A request cut off after its
        message was delivered leaves its sender without an answer: it sends again, and
        this provider's dedupe is gone with it (its memory), so the slip goes out twice.
        A request that comes to deliver after the drain is answered 503 (sent nothing)."""
        self._server.shutdown()  # returns once serve_forever has exited
        st = self.state
        deadline = time.monotonic() + max(0.0, drain_s)
        while True:
            with st.lock:
                if st.in_flight == 0 or time.monotonic() >= deadline:
                    st.stopping = True
                    cut = st.in_flight
                    break
            time.sleep(0.02)
        if cut and drain_s > 0:
            log.warning("provider stopping with %d request(s) still in flight after %.1f s", cut, drain_s)
        self._server.close_all_connections()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "Provider":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- state (also usable in-process by tests)
    def _admit_locked(self, received_at: float | None = None) -> bool:
        st = self.state
        now = st.clock()
        limit = max(1, int(self.rate_per_s))
        w = st.window
        while w and w[0] <= now - 1.0:
            w.popleft()
        if len(w) >= limit:
            if len(st.throttles) < 100:  # what the window looked like: for diagnosing 429s
                last = list(w)[-12:]
                gaps = [round((b - a) * 1000, 1) for a, b in zip(last, last[1:])]
                st.throttles.append({"at": round(now + st.wall_offset, 3), "window_span_ms": round((now - w[0]) * 1000, 1),
                                     "last_gaps_ms": gaps,
                                     "admit_delay_ms": round((time.time() - received_at) * 1000, 1)
                                     if received_at is not None else None})
            return False
        w.append(now)
        sec = int(now + st.wall_offset)
        n = st.per_second.get(sec, 0) + 1
        st.per_second[sec] = n
        if n > st.max_rate_1s:
            st.max_rate_1s = n
        if len(st.per_second) > 660:
            for old in [s for s in st.per_second if s < sec - 600]:
                del st.per_second[old]
        return True

    def stats(self) -> dict[str, Any]:
        st = self.state
        with st.lock:
            now = st.clock()
            sec = int(now + st.wall_offset)
            out: dict[str, Any] = dict(st.counts)
            out.update(
                in_flight=st.in_flight,
                max_in_flight=st.max_in_flight,
                max_rate_1s=st.max_rate_1s,
                per_second={str(s): n for s, n in sorted(st.per_second.items()) if s > sec - 600},
                received_per_second={str(s): n for s, n in sorted(st.received_per_second.items()) if s > sec - 600},
                outage_s_left=round(max(0.0, st.outage_until - now), 3),
                throttles=list(st.throttles),
                latency_s=self.latency_s,
                rate_per_s=self.rate_per_s,
            )
        return out

    def delivery(self, key: str) -> dict[str, Any] | None:
        with self.state.lock:
            rec = self.state.delivered.get(key)
            return None if rec is None else json.loads(json.dumps(rec))

    def outage(self, seconds: float, status: int = 503) -> None:
        with self.state.lock:
            self.state.outage_until = self.state.clock() + seconds
            self.state.outage_status = status
        log.info("provider outage: %s for %.0f s", status, seconds)

    def end_outage(self) -> None:
        with self.state.lock:
            self.state.outage_until = 0.0
        log.info("provider outage ended")

    def reset(self) -> None:
        with self.state.lock:
            self.state.reset()


TOKEN_NAME = "provider-token"
"""The local provider's bearer token: a file beside the embedded Redis's password
(``$PAYRUN_HOME/redis/provider-token``, 0600, made once on first use, never printed).
Replaced (atomically: written beside, 0600, then renamed into place), `payrun provider`
and this host's senders take the new one without a restart (``TokenFile``)."""

TOKEN_CHECK_S = 1.0
"""How often, at most, a running `payrun provider` looks (one stat) whether its token file
was replaced; it also looks at once when a request shows another token."""


class TokenFile:
    """A token read from its file and re-read when the file was replaced or rewritten
    (its inode, size or times changed: ``redis_server.secret_signature``), so a new token
    needs no restart. ``current()`` looks at the file (one stat) at most every
    ``check_every_s``; ``refresh()`` looks now (after a refusal). A file gone missing, empty,
    or readable by others and not ours to fix keeps the token read last (logged, with the
    path, never the token). The first read happens here and raises as ``local_token`` would."""

    def __init__(self, path: Path, *, check_every_s: float = TOKEN_CHECK_S,
                 clock: Callable[[], float] = time.monotonic):
        from payrun import redis_server

        self.path = Path(path)
        self.check_every_s = float(check_every_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._token, self._sig = redis_server.read_secret(self.path)
        if not self._token:
            from payrun.errors import ConfigError

            raise ConfigError(f"{self.path} is empty: remove it (a new token is made) or write one into it")
        self._next = clock() + self.check_every_s
        self._trouble: str | None = None

    def __repr__(self) -> str:  # never the token
        return f"TokenFile({str(self.path)!r})"

    def current(self) -> str:
        if self._clock() >= self._next:
            with self._lock:
                if self._clock() >= self._next:
                    self._look()
        return self._token

    def refresh(self) -> str:
        with self._lock:
            self._look()
        return self._token

    def _look(self) -> None:
        from payrun import redis_server
        from payrun.errors import ConfigError

        self._next = self._clock() + self.check_every_s
        try:
            if redis_server.secret_signature(os.stat(self.path)) == self._sig:
                return
            token, sig = redis_server.read_secret(self.path)
        except (OSError, ConfigError) as e:
            why = f"{e.strerror}" if isinstance(e, OSError) and e.strerror else str(e)
            self._keep(f"cannot read {self.path} ({why})")
            return
        if not token:
            self._keep(f"{self.path} is empty")  # (a writer mid-way: looked at again, as it changes)
            return
        changed = token != self._token
        self._token, self._sig, self._trouble = token, sig, None
        if changed:
            log.info("the token in %s was replaced: using the new one", self.path)

    def _keep(self, trouble: str) -> None:
        if trouble != self._trouble:
            log.warning("%s: keeping the token read before", trouble)
            self._trouble = trouble


def token_path(cfg) -> Path:
    return cfg.redis_dir / TOKEN_NAME


def local_token(cfg) -> str:
    """The data directory's token for its local provider (made on first use): what
    ``payrun provider`` requires and its senders show. Without it any user of the machine
    read every slip's recipient and subject (``GET /v1/messages/<key>``), reset the dedupe
    or started an outage."""
    from payrun import redis_server

    return redis_server.local_secret(cfg, TOKEN_NAME)


def local_token_file(cfg) -> TokenFile:
    """The data directory's token (made on first use) as a ``TokenFile``: what `payrun
    provider` requires and its senders show, followed when the file is replaced."""
    local_token(cfg)  # (made if missing, owner-only checked)
    return TokenFile(token_path(cfg))


def email_token(cfg, environ: dict[str, str] | None = None) -> str | TokenFile | None:
    """The token a sender shows the provider (pure but for the file): PAYRUN_EMAIL_TOKEN
    when set (a str); else, with no email URL (the local provider of this host's ``payrun
    up``), the data directory's own (a ``TokenFile``: its path is named when the provider
    refuses it, and a replaced file is read again); else none. A worker-only host always
    has an email URL (`up --role worker` refuses one without), so it never makes or reads
    the local token."""
    env = os.environ if environ is None else environ
    if env.get("PAYRUN_EMAIL_TOKEN"):
        return env["PAYRUN_EMAIL_TOKEN"]
    if not cfg.email.url:
        return local_token_file(cfg)
    return None


class AdminError(Exception):
    """A running local provider could not be told (``admin``): the words say why."""


def admin(cfg, method: str, path: str, doc: Any = None, *, host: str | None = None,
          port: int | None = None, timeout_s: float = 10.0) -> Any:
    """Call a running local provider's API with the data directory's token (`payrun provider
    outage` / `stats`); its JSON answer, or AdminError. Never makes a token: one missing
    means no provider of this data directory has run (the wrong PAYRUN_HOME)."""
    import http.client

    host = host or cfg.provider.host
    port = port or cfg.provider.port
    tf = token_path(cfg)
    if not tf.exists():
        raise AdminError(f"no provider token at {tf}: no `payrun provider` has run with this data directory "
                         f"(set PAYRUN_HOME to the one `payrun up` runs in)")
    token = local_token(cfg)  # (through local_secret: owner-only checked)
    body = None if doc is None else json.dumps(doc).encode("utf-8")
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {token}",
                                                       "Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise AdminError(f"no local provider answers at {host}:{port} ({e.__class__.__name__}: "
                         f"{getattr(e, 'strerror', None) or e}): is `payrun up` running (`payrun ps`)?") from None
    finally:
        conn.close()
    if resp.status == 401:
        raise AdminError(f"the provider at {host}:{port} refused {tf}: it is another data directory's (run this "
                         f"with the PAYRUN_HOME `payrun up` runs in), or one too old to follow a replaced token "
                         f"file (restart it: `supervisorctl restart provider` after "
                         f"`eval \"$(payrun supervisor-env)\"`)")
    try:
        out = json.loads(raw) if raw else {}
    except ValueError:
        out = None
    if resp.status >= 400 or out is None:
        what = out.get("error") if isinstance(out, dict) else raw[:200].decode("utf-8", "replace")
        raise AdminError(f"the provider at {host}:{port} answered {resp.status}: {what}")
    return out


def stop_drain_s(latency_s: float) -> float:
    """How long a stopping `payrun provider` lets the requests in flight finish: one
    latency and 5 s, at most 8 s (supervisord's stopwaitsecs for it is 10 s)."""
    return min(max(0.0, latency_s) + 5.0, 8.0)


def run(host: str, port: int, latency_s: float, rate_per_s: float, token: "str | TokenFile | None" = None) -> None:
    """Serve until SIGTERM/SIGINT (for ``payrun provider``); must run in the main thread."""
    provider = Provider(host=host, port=port, latency_s=latency_s, rate_per_s=rate_per_s, token=token)
    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        provider.start()
        while not stop.wait(0.5):
            pass
        log.info("provider stopping")
        # the sends in flight get their answer first (supervisord killed, every program is
        # sent SIGTERM at once: the senders finish theirs, see supervise.stop_with_supervisord)
        provider.stop(drain_s=stop_drain_s(provider.latency_s))
    finally:
        # its counters live in memory: said once more on the way out, so a restart (a
        # deploy) does not take the evidence of a run (delivered, duplicates) with it
        counts = {k: v for k, v in provider.stats().items() if isinstance(v, int) and not isinstance(v, bool)}
        log.info("provider counters at stop: %s", ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        provider.stop()  # (again: a no-op after the drain above, unless that raised)
        for s, h in previous.items():
            signal.signal(s, h)
