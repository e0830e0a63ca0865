"""Email transports chosen by URL: SMTP (smtp://, smtps://) and the JSON provider API
(http://, https://). One call, ``Transport.send(msg)``, returns the provider's message id
or raises one of the errors in ``jobs.errors``:

  TransientError  worth retrying (SMTP 4xx, HTTP 429/5xx, connection refused, a timeout
                  before the message was handed over); ``retry_after_s`` is set from a
                  429's (or 5xx's) Retry-After header.
  OutcomeUnknown  the connection dropped or timed out AFTER the message was handed over:
                  it may have been delivered. Retry with the SAME idempotency key.
  AccountRefused  the provider refused us, not this message (HTTP 401/403, SMTP
                  authentication failed or MAIL FROM refused): a TransientError that counts
                  toward a provider outage, so a bad token pauses the run, not fails it.
  PermanentError  retrying cannot help (SMTP 5xx, HTTP 4xx other than 401/403/429: bad address).

Error messages are short and never contain the slip, the body, or credentials; at most
the recipient address and the provider's reason.

URLs
----
``smtp://[user[:pass]@]host[:port][?starttls=1]``   plain SMTP (default port 25; 587
                                                    with starttls=1), STARTTLS if asked.
``smtps://[user[:pass]@]host[:port]``               SMTP over TLS (default port 465).
``http://host[:port][/prefix]``, ``https://...``     the JSON provider API below.

To another host than this one's loopback, smtp:// needs starttls=1 and http:// is refused:
a slip carries every earning and the net pay (``payrun.config.email_url_problems``;
``?insecure=1`` sends slips, never credentials, in clear text to a relay the owner trusts).

Credentials: an SMTP password in the URL wins; otherwise ``PAYRUN_SMTP_PASSWORD`` is used
when the URL names a user (user without password = take it from the environment). The
provider API token comes from ``PAYRUN_EMAIL_TOKEN`` (sent as ``Authorization: Bearer``);
with no email URL, the local provider's token of the data directory (``transport_for``'s
``token``, from ``payrun.provider.email_token``: a ``TokenSource``, its file read again
when the provider refuses the token, so a replaced file needs no restart).
Neither is ever logged nor put in an exception message; ``repr(transport)`` shows the
URL with the password replaced by ***.

SMTP transport
--------------
A fresh connection per send (connect, EHLO, [STARTTLS], [AUTH], MAIL, RCPT, DATA, QUIT).
That costs a TCP (and TLS) handshake per message but has no shared state between threads
and no stale-connection corner cases. The message is a MIME ``EmailMessage``: text part
plus the PDF as ``application/pdf`` attachment, with headers
``Idempotency-Key: <key>`` and ``Message-ID: <sha256(key)[:32]@payrun>``, so a resend of
the same slip carries the same Message-ID (receiving systems and humans can dedupe).
``send`` returns that Message-ID (SMTP has no standard "provider id").
Classification: AUTH refused or MAIL FROM refused -> AccountRefused; otherwise any 4xx
reply -> TransientError, any 5xx reply -> PermanentError (RCPT refused, DATA refused; a
server that refuses our sender only at RCPT, as Postfix does by default, reads as one
recipient's problem); connection refused / reset /
timeout / disconnect before the message content is sent -> TransientError; a disconnect or
timeout after the server answered ``354`` to DATA (while sending the content or waiting
for the final reply) -> OutcomeUnknown.

Provider HTTP API (ours; ``payrun/provider.py`` implements it locally)
---------------------------------------------------------------------
``POST {prefix}/v1/messages``
  headers: ``Content-Type: application/json``, ``Idempotency-Key: <key>`` (required),
           ``Authorization: Bearer <token>`` (when the provider requires one)
  body:    {"to": "a@b.example", "to_name": "Tanvir Ahmed",
            "from": "Payroll <payroll@payrun.localhost>", "subject": "...", "text": "...",
            "attachments": [{"filename": "slip-2026-11.pdf", "content_type": "application/pdf",
                             "content_b64": "<base64>"}]}
  202 {"id": "...", "duplicate": false}  accepted for delivery
  200 {"id": "...", "duplicate": true}   this Idempotency-Key was already accepted: success,
                                         returns the id of the first acceptance
  400 {"error": "..."}                   malformed request / no Idempotency-Key -> PermanentError
  401 {"error": "..."}                   missing/wrong token -> AccountRefused (403 too)
  422 {"error": "invalid recipient address: ..."}                -> PermanentError
  429 + ``Retry-After: <seconds>``       rate limited -> Throttled (a TransientError) with retry_after_s
  5xx                                    provider trouble -> TransientError
The HTTP transport keeps one persistent HTTP/1.1 connection per thread (threading.local),
dropped and re-opened after any error. If a *reused* keep-alive connection turns out to be
dead (closed by the server while idle) the request is retried once on a fresh connection;
that is safe because the Idempotency-Key makes the provider dedupe. Connect errors ->
TransientError; errors while sending the request -> TransientError (the body was not
fully handed over, so the provider cannot have accepted it); timeout / reset / EOF while
waiting for or reading the response -> OutcomeUnknown.

Timeouts: ``timeout_s`` bounds one whole send (connect + request + reply): before each
blocking step the socket timeout is set to the time left, and a send still blocked
CUTOFF_MARGIN_S past its deadline (a server trickling its reply a byte at a time, each
read inside the socket timeout) has its socket shut (``_Cutoff``).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import os
import re
import select
import smtplib
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from email.message import EmailMessage
from email.policy import SMTP as SMTP_POLICY
from email.utils import formataddr, parseaddr
from collections.abc import Callable
from typing import Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from rq.timeouts import BaseTimeoutException

from jobs.errors import (AccountRefused, OutcomeUnknown, PermanentError, RateWait, RecipientDeferred,
                         TransientError, Throttled)
from jobs.policy import rcpt_refusal_is_ours
from payrun.text import header_safe, visible

log = logging.getLogger(__name__)

SMTP_PASSWORD_ENV = "PAYRUN_SMTP_PASSWORD"
EMAIL_TOKEN_ENV = "PAYRUN_EMAIL_TOKEN"


PROVIDER_ID_MAX = 200
"""The longest provider message id recorded (in Redis, a job's result, a host's note of an
unrecorded send); a longer one is cut with "…"."""


def provider_id(mid: str) -> str:
    """A message id as the provider returned it, made safe to record: its control
    characters (ESC, BEL, C1, the bidi controls ...) written as escapes, as a server's reply
    quoted in an error is (:func:`_short`), and at most PROVIDER_ID_MAX characters. An ESC
    sequence in an id reached Redis, the job's result and the host's notes as sent."""
    mid = visible(mid)
    return mid if len(mid) <= PROVIDER_ID_MAX else mid[: PROVIDER_ID_MAX - 1] + "…"


class CredentialsRefused(ValueError):
    """A probe's refusal of our credentials (HTTP 401/403, SMTP login refused): every send
    of this host would be refused too (``AccountRefused``), whoever the recipient."""


class SentId(str):
    """A provider's message id; ``duplicate``: the provider already had this
    Idempotency-Key and did not deliver it again (an earlier attempt was accepted, but
    its worker died or lost the reply). SMTP has no such answer: always False there."""

    duplicate: bool = False

    def __new__(cls, mid: str, duplicate: bool = False) -> "SentId":
        obj = super().__new__(cls, mid)
        obj.duplicate = duplicate
        return obj


@dataclass
class Message:
    to_addr: str
    to_name: str
    subject: str
    text_body: str
    attachment_name: str
    attachment_bytes: bytes
    """The PDF."""
    idempotency_key: str
    """e.g. "slip:2026-11:emp-00017": the same slip always has the same key."""
    sender: str
    """"Payroll <payroll@payrun.localhost>" or a bare address."""

    def __repr__(self) -> str:  # never dump the PDF or the body into logs/tracebacks
        return (f"Message(to={self.to_addr!r}, key={self.idempotency_key!r}, "
                f"attachment={self.attachment_name!r} {len(self.attachment_bytes)} bytes)")


class Transport(Protocol):
    """``send``'s ``before_write`` is called right before the message leaves (the
    limiter's recheck: a sender that stalled since its start time takes a new one);
    False from it means do not send now (RateWait). ``before_data`` is called at the
    last moment a send can still be called off without the message going out: over
    SMTP just before DATA (after the connection, EHLO, TLS, AUTH, MAIL and RCPT); over
    HTTP, where ``before_write`` is already the last step before the request, it is not
    called. It raises to call the send off (jobs.tasks.send_limited: the idempotency
    claim is no longer ours). ``until`` (monotonic): the send ends by then if that is
    sooner than its timeout (what its job has left, jobs.policy.send_window)."""

    def prepare(self, msg: Message) -> bytes: ...
    def send(self, msg: Message, prepared: bytes | None = None,
             before_write: Callable[[], bool] | None = None,
             before_data: Callable[[], None] | None = None, until: float | None = None) -> str: ...
    def close(self) -> None: ...


def _check_before_write(before_write: Callable[[], bool] | None) -> None:
    if before_write is not None and not before_write():
        raise RateWait()


def message_id_for(key: str) -> str:
    """The Message-ID header for an idempotency key: same key, same Message-ID."""
    return f"<{hashlib.sha256(key.encode('utf-8')).hexdigest()[:32]}@payrun>"


class TokenSource(Protocol):
    """A bearer token kept in a file (``payrun.provider.TokenFile``): named in the words of
    a refusal, and read again after one (a replaced file)."""

    path: object

    def current(self) -> str: ...

    def refresh(self) -> str: ...


def transport_for(url: str, timeout_s: float, token: "str | TokenSource | None" = None,
                  sender: str | None = None) -> Transport:
    """The transport for ``url`` (see the module docstring). ValueError on a bad URL.
    ``token``: the HTTP provider's bearer token (``payrun.provider.email_token``: the local
    provider's token file when no URL is configured); None = PAYRUN_EMAIL_TOKEN, if set.
    ``sender``: our From address (email.sender), which an SMTP probe offers as MAIL FROM."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("smtp", "smtps"):
        return SmtpTransport(url, timeout_s, sender=sender)
    if scheme in ("http", "https"):
        return HttpTransport(url, timeout_s, token=token)
    raise ValueError(f"unsupported email URL scheme {scheme!r} in {_redact(url)!r} "
                     f"(use smtp://, smtps://, http:// or https://)")


def _redact(url: str) -> str:
    from payrun.config import redact_url

    return redact_url(url)


def _port(parts, default: int, url: str) -> int:
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in email URL {_redact(url)!r}") from None
    return port or default


CUTOFF_MARGIN_S = 0.5
"""How long after its deadline a send's socket is shut (``_Cutoff``)."""


class _Cutoff:
    """Ends a send that its deadline did not: shuts its socket down CUTOFF_MARGIN_S after
    ``seconds``. A socket timeout bounds each read, not a reply: a server that trickles a
    byte a second (SMTP's greeting, an HTTP status line, a TLS handshake) held a send, and
    its lane, for minutes (a security review measured 52 s and 67 s for a 2 s timeout). The
    shutdown wakes the blocked read at once; the send then fails as timed out (before the
    message: TransientError; after it: OutcomeUnknown).

    ``adopt(sock)`` as each connection is made (and for a kept-alive one, as the send
    starts): the cutoff keeps a duplicate of its file descriptor, so a shutdown reaches the
    connection whatever wraps it meanwhile (TLS, STARTTLS), and a connection made after the
    deadline is shut as it is adopted. Runs on the process's one watchdog thread
    (jobs.watchdog)."""

    def __init__(self, seconds: float):
        from jobs.watchdog import WATCHDOG

        self.fired = self._closed = False
        self._dup: socket.socket | None = None
        self.deadline = time.monotonic() + seconds
        self._entry = WATCHDOG.arm_call(seconds + CUTOFF_MARGIN_S, self._cut)

    def adopt(self, sock: socket.socket | None) -> None:
        if sock is None or self._closed:  # (a connection made after its send: not this cutoff's)
            return
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))  # (an SSLSocket has no dup())
        except OSError:
            return
        old, self._dup = self._dup, dup  # (set before `fired` is read: _cut reads them the other way)
        if old is not None:
            old.close()
        if self.fired:
            self._shut(dup)

    def _cut(self) -> None:
        self.fired = True
        if self._dup is not None:
            self._shut(self._dup)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the connection itself, not just this descriptor
        except OSError:
            pass

    def close(self) -> None:
        """Disarm (once this returned it can no longer fire), and drop the duplicate."""
        from jobs.watchdog import WATCHDOG

        WATCHDOG.disarm(self._entry)
        self._closed = True
        if self._dup is not None:
            self._dup.close()
            self._dup = None


RESOLVER_THREADS = 4
"""Threads per process that look up the provider's name (``connect_within``)."""


class _Resolver:
    """``socket.getaddrinfo`` on a few daemon threads. getaddrinfo takes no timeout (glibc's
    own is 5 s per try, per nameserver, and a broken resolver can take longer), and a job's
    timeout cannot interrupt C code: a lane stuck in a lookup stayed stuck past its send's
    deadline. Lanes wait for a lookup's answer no longer than their send has left
    (``_Answers``); the lookup itself runs to its end on its thread, and its answer is kept
    even when no lane waits for it any more. Daemon threads: a hung lookup never holds the
    process's exit."""

    def __init__(self, threads: int = RESOLVER_THREADS):
        import queue

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._run, name=f"dns-{i}", daemon=True).start()

    def _run(self) -> None:
        while True:
            host, port, done = self._queue.get()
            try:
                infos, error = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM), None
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                infos, error = None, e
            try:
                done(infos, error)
            except Exception:  # (never lose the thread)
                log.exception("looking up %s: handing its answer over failed", host)

    def start(self, host: str, port: int, done: Callable[[list | None, BaseException | None], None]) -> None:
        """Look ``host`` up on a resolver thread: ``done(addresses, None)`` or
        ``done(None, error)`` is called there when the lookup ends."""
        self._queue.put((host, port, done))


DNS_REUSE_S = 30.0
"""A provider name's addresses are reused this long (per process) before it is looked up
again: one lookup per 30 s, not one per send (40 a second at the provider's limit)."""

DNS_STALE_S = 600.0
"""When a lookup fails or hangs, the addresses a lookup gave less than this long ago are
used instead: a resolver's blip in the middle of a run does not fail sends (serve-stale,
as RFC 8767 has caching resolvers do)."""

DNS_STALE_WAIT_S = 2.0
"""With such addresses in hand, a lookup is waited for this long at most."""

DNS_RETRY_S = 5.0
"""After a failed lookup answered from the stale addresses, the next lookup is tried this
much later (one warning per try, not one per send)."""

DNS_HUNG_S = 30.0
"""A lookup still unanswered this long after it started is taken for hung: the next send
that needs the name starts another (glibc gives up by then: 5 s x 2 tries x up to 3
nameservers)."""


class _Flight:
    """One lookup of a name, shared by every lane that needs its answer meanwhile."""

    __slots__ = ("started", "done", "infos", "error")

    def __init__(self, started: float):
        self.started = started
        self.done = threading.Event()
        self.infos: list | None = None
        self.error: BaseException | None = None


class _Answers:
    """The addresses of the names this process sends to, reused ``DNS_REUSE_S``, used up to
    ``DNS_STALE_S`` old when the lookup fails or hangs (``DNS_STALE_WAIT_S``; then tried again
    ``DNS_RETRY_S`` later). One lookup per name at a time (single flight): with addresses in
    hand the other lanes use them meanwhile; with none, they all wait for that one lookup,
    each as long as its send has left, rather than queue lookups of their own behind it on
    the resolver's few threads. A lookup's answer is kept when it comes, even after every
    lane waiting for it gave up: a slow resolver still refills the cache. A name never
    looked up successfully fails the sends that wait for it (as without this cache).
    ``clock``: monotonic seconds and ``wait(event, seconds) -> bool`` (tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[threading.Event, float], bool] = threading.Event.wait):
        self._clock = clock
        self._wait = wait
        self._lock = threading.Lock()
        self._got: dict[tuple[str, int], tuple[float, list]] = {}  # (host, port) -> (when, addresses)
        self._flights: dict[tuple[str, int], _Flight] = {}  # being looked up
        self._next_try: dict[tuple[str, int], float] = {}  # after a failure answered from stale ones

    def lookup(self, host: str, port: int, within_s: float,
               start: Callable[[str, int, Callable[[list | None, BaseException | None], None]], None]) -> list:
        """``host``'s addresses, within ``within_s`` seconds; ``start(host, port, done)``
        begins a lookup whose end calls ``done(addresses, error)`` (``_Resolver.start``)."""
        key = (host, port)
        with self._lock:
            now = self._clock()
            when, infos = self._got.get(key, (None, None))
            age = None if when is None else now - when
            if age is not None and age < DNS_REUSE_S:
                return infos
            stale = infos if age is not None and age < DNS_STALE_S else None
            flight = self._flights.get(key)
            if flight is not None and now - flight.started < DNS_HUNG_S:
                if stale is not None:
                    return stale  # (the lane that started it waits for it)
                ours = False
            else:
                if stale is not None and now < self._next_try.get(key, now):
                    return stale
                flight = self._flights[key] = _Flight(now)
                ours = True
        if ours:
            try:
                start(host, port, lambda got, error: self._landed(key, flight, got, error))
            except BaseException as e:  # (a job's timeout, raised right here): no lookup runs for it
                self._landed(key, flight, None, OSError(f"looking up {host} was not started ({type(e).__name__})"))
                raise
        answered = self._wait(flight.done, min(within_s, DNS_STALE_WAIT_S) if stale is not None else within_s)
        if answered and flight.error is None:
            return flight.infos
        if answered and (stale is None or not isinstance(flight.error, OSError)):
            raise _copy_error(flight.error)  # (not an OSError: not the resolver's failure but an unusable name)
        if stale is None:
            raise socket.timeout(f"looking up {host} took longer than the send's {within_s:.1f} s left")
        why = flight.error if answered else f"no answer in {min(within_s, DNS_STALE_WAIT_S):.1f} s"
        with self._lock:
            self._next_try[key] = self._clock() + DNS_RETRY_S
        log.warning("looking up %s failed (%s): using its addresses of %.0f s ago, trying again in %.0f s",
                    host, why, age, DNS_RETRY_S)
        return stale

    def _landed(self, key: tuple[str, int], flight: _Flight, infos: list | None, error: BaseException | None) -> None:
        with self._lock:
            if error is None:
                self._got[key] = (self._clock(), infos)
                self._next_try.pop(key, None)
            if self._flights.get(key) is flight:
                del self._flights[key]
        flight.infos, flight.error = infos, error
        flight.done.set()


def _copy_error(e: BaseException) -> BaseException:
    """``e`` anew, for one of the lanes that waited for it (one exception object raised in
    several threads at once would gather all their tracebacks)."""
    import copy

    try:
        return copy.copy(e)
    except Exception:
        return OSError(str(e))


_resolver: tuple[int, _Resolver, _Answers] | None = None
_resolver_lock = threading.Lock()


def _lookup(host: str, port: int, within_s: float) -> list:
    """``getaddrinfo(host, port)`` for a TCP connection, within ``within_s`` seconds: at once
    for an address; for a name on the resolver threads (``_Resolver``), its answer reused
    and kept for a failing resolver (``_Answers``)."""
    global _resolver
    try:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name
    if within_s <= 0:
        raise socket.timeout(f"no time left to look up {host}")
    with _resolver_lock:
        if _resolver is None or _resolver[0] != os.getpid():  # (a forked child has none of its threads)
            _resolver = (os.getpid(), _Resolver(), _Answers())
        _, resolver, answers = _resolver
    return answers.lookup(host, port, within_s, resolver.start)


def forget_addresses() -> None:
    """Drop this process's looked-up addresses (the next send to a name looks it up)."""
    global _resolver
    with _resolver_lock:
        if _resolver is not None:
            _resolver = (_resolver[0], _resolver[1], _Answers())


EHLO_NAME_WAIT_S = 2.0
"""How long the sends of a process wait, together, for the name this host gives in EHLO
while it is first looked up (from the first send's start; each no more than a quarter
of what it has left: jobs.policy.ehlo_wait_s)."""

EHLO_NAME_RETRY_S = 600.0
"""A lookup of that name that failed, or still hangs, is started again this much later
(no send waits for that one: its answer is used once it comes)."""


class _EhloLookup:
    """One lookup of this host's name for EHLO, on a daemon thread."""

    __slots__ = ("pid", "started", "window_ends", "done", "name", "failed")

    def __init__(self, started: float, window_s: float):
        self.pid = os.getpid()
        self.started = started
        self.window_ends = started + window_s
        self.done = threading.Event()
        self.name: str | None = None  # the host's FQDN; None: it has none (or not known)
        self.failed = False

    def run(self) -> None:
        try:
            fqdn = socket.getfqdn()
            self.name = fqdn if "." in fqdn else None
        except Exception as e:  # noqa: BLE001 - the connection's address serves instead
            log.warning("looking up this host's name for EHLO failed (%s): giving its address instead", e)
            self.failed = True
        self.done.set()


_ehlo: _EhloLookup | None = None
_ehlo_lock = threading.Lock()


def _ehlo_lookup(now: float) -> _EhloLookup:
    """This process's lookup of its name, started if there is none (or it failed or hung
    ``EHLO_NAME_RETRY_S`` ago: then with no window for sends to wait in)."""
    global _ehlo
    with _ehlo_lock:
        current = _ehlo
        fresh = current is None or current.pid != os.getpid()  # (a forked child has none of its threads)
        stale = (not fresh and now - current.started >= EHLO_NAME_RETRY_S
                 and (current.failed or not current.done.is_set()))
        if fresh or stale:
            current = _ehlo = _EhloLookup(now, EHLO_NAME_WAIT_S if fresh else 0.0)
            threading.Thread(target=current.run, name="ehlo-name", daemon=True).start()
        return current


def ehlo_name(send_left_s: float, lookup: _EhloLookup | None = None) -> str | None:
    """The name this host gives in EHLO: its FQDN, looked up once per process on a daemon
    thread; None when it has none (a name with no dot, as in many containers), its lookup
    failed, or it is not known yet, for the caller to give the connection's own address
    instead (``address_literal``), as RFC 5321 has a client with no FQDN do. Sends wait
    for the first lookup together, ``EHLO_NAME_WAIT_S`` from its start at most (and each
    a quarter of what it has left); after that no send waits for it. smtplib looked the
    name up on every connection, outside the send's deadline and the resolver's cache (a
    resolver's blip hung or failed every send), and its fallback, the host name, is
    refused by relays that want an FQDN (Postfix's reject_non_fqdn_helo_hostname).
    ``lookup``: the one ``_ehlo_lookup`` gave this send before it connected."""
    from jobs.policy import ehlo_wait_s

    now = time.monotonic()
    if lookup is None:
        lookup = _ehlo_lookup(now)
    if not lookup.done.is_set():
        wait = ehlo_wait_s(now, lookup.window_ends, send_left_s)
        if wait <= 0 or not lookup.done.wait(wait):
            return None
    return lookup.name


def address_literal(sock: socket.socket) -> str:
    """The EHLO name of a host with no FQDN: the address of its end of ``sock`` in brackets
    (RFC 5321 4.1.3: ``[192.0.2.1]``, ``[IPv6:2001:db8::1]``)."""
    addr = sock.getsockname()
    ip = addr[0] if isinstance(addr, tuple) else "127.0.0.1"  # (a unix socket: no address of its own)
    if sock.family == socket.AF_INET6:
        return f"[IPv6:{ip.split('%')[0]}]"
    return f"[{ip}]"


def connect_within(address: tuple[str, int], timeout, source_address=None, *, deadline: float) -> socket.socket:
    """``socket.create_connection(address, timeout, source_address)`` that ends by
    ``deadline`` (monotonic), name lookup included (``_lookup``): then each address found in
    turn, as create_connection tries them, each connect given no more than what is left."""
    host, port = address[0], address[1]
    error: OSError | None = None
    for family, _type, _proto, _canon, sa in _lookup(host, port, deadline - time.monotonic()):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"no time left to connect to {host}")
        ip = sa[0] if family != socket.AF_INET6 or not sa[3] else f"{sa[0]}%{sa[3]}"
        wait = left if timeout is None or timeout is socket._GLOBAL_DEFAULT_TIMEOUT else min(timeout, left)
        try:
            sock = socket.create_connection((ip, sa[1]), wait, source_address)
        except OSError as e:
            error = e
            continue
        sock.settimeout(timeout if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT else socket.getdefaulttimeout())
        return sock
    raise error if error is not None else OSError(f"no address found for {host}")


_EHLO_LATER = "[set-after-connect]"  # (smtplib's SMTP looks the name up itself when given None)


MECHANISM_NOT_TAKEN = frozenset({504, 534, 538})
"""AUTH replies that refuse the mechanism, not the credentials (RFC 4954: 504 unrecognized
mechanism, 534 mechanism too weak, 538 encryption required for it)."""


class _CutSocket(smtplib.SMTP):
    """smtplib's SMTP whose TCP connection is adopted by ``self.cutoff`` as it is made, before
    the greeting is read (in the constructor) and before SMTP_SSL's handshake, and whose
    name lookup ends by the send's deadline (``connect_within``)."""

    cutoff: _Cutoff

    def _get_socket(self, host, port, timeout):
        if timeout is not None and not timeout:
            raise ValueError("Non-blocking socket (timeout=0) is not supported")  # (as smtplib's)
        sock = connect_within((host, port), timeout, self.source_address, deadline=self.cutoff.deadline)
        self.cutoff.adopt(sock)
        return sock

    def login(self, user, password, *, initial_response_ok=True):
        """smtplib's login, less its second guess: smtplib tries each mechanism the server
        offers (CRAM-MD5, PLAIN, LOGIN) after a refusal, so one wrong password was two or
        three failed logins per send (and per check), which mail servers count toward
        locking the account. A mechanism the server does not take after all (504, 534, 538)
        is still followed by the next; credentials refused (535 and any other) end it."""
        self.ehlo_or_helo_if_needed()
        if not self.has_extn("auth"):
            raise smtplib.SMTPNotSupportedError("SMTP AUTH extension not supported by server.")
        offered = self.esmtp_features["auth"].split()
        mechanisms = [m for m in ("CRAM-MD5", "PLAIN", "LOGIN") if m in offered]
        if not mechanisms:
            raise smtplib.SMTPException("No suitable authentication method found.")
        self.user, self.password = user, password
        for i, mechanism in enumerate(mechanisms):
            try:
                code, resp = self.auth(mechanism, getattr(self, "auth_" + mechanism.lower().replace("-", "_")),
                                       initial_response_ok=initial_response_ok)
            except smtplib.SMTPAuthenticationError as e:
                if e.smtp_code in MECHANISM_NOT_TAKEN and i + 1 < len(mechanisms):
                    continue
                raise
            if code in (235, 503):  # authenticated (503: already)
                return code, resp
        raise smtplib.SMTPAuthenticationError(code, resp)


class _CutSMTP(_CutSocket):
    def __init__(self, *args, cutoff: _Cutoff, **kwargs):
        self.cutoff = cutoff
        super().__init__(*args, **kwargs)


class _CutSMTPS(smtplib.SMTP_SSL, _CutSocket):  # (SMTP_SSL's _get_socket wraps what _CutSocket's returns)
    def __init__(self, *args, cutoff: _Cutoff, **kwargs):
        self.cutoff = cutoff
        super().__init__(*args, **kwargs)


def _cut_connections(conn: http.client.HTTPConnection, cutoff: _Cutoff) -> None:
    """``conn``'s next connection (and an HTTPS one's handshake) adopted by ``cutoff``, its
    name lookup ended by the cutoff's deadline (``connect_within``)."""

    def create(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None):
        sock = connect_within(address, timeout, source_address, deadline=cutoff.deadline)
        cutoff.adopt(sock)
        return sock

    conn._create_connection = create


class _Deadline:
    """A send's deadline: ``seconds`` from now, or ``until`` (monotonic) if that is sooner."""

    def __init__(self, seconds: float, until: float | None = None):
        self.end = time.monotonic() + seconds
        if until is not None:
            self.end = min(self.end, until)

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise socket.timeout("send deadline passed")
        return left


# ---------------------------------------------------------------- SMTP

_DOTS = re.compile(rb"(?m)^\.")


class SmtpTransport:
    def __init__(self, url: str, timeout_s: float, *, password: str | None = None, sender: str | None = None):
        self.sender = (parseaddr(sender)[1] or sender) if sender else None
        """The envelope address the probe offers (MAIL FROM, then RSET): a server that takes
        our login but not our sender refuses every send all the same."""
        parts = urlsplit(url)
        self.ssl = parts.scheme.lower() == "smtps"
        query = parse_qs(parts.query)
        self.starttls = (query.get("starttls", ["0"])[-1].lower() in ("1", "true", "yes"))
        if self.ssl and self.starttls:
            raise ValueError(f"smtps:// is already TLS; drop starttls=1 from {_redact(url)!r}")
        if not parts.hostname:
            raise ValueError(f"no host in email URL {_redact(url)!r}")
        self.host = parts.hostname
        self.port = _port(parts, 465 if self.ssl else (587 if self.starttls else 25), url)
        self.user = unquote(parts.username) if parts.username else None
        self._password_from = "the password given" if password is not None else None
        if password is None:
            password = unquote(parts.password) if parts.password is not None else None
            if password is not None:
                self._password_from = "the password in email.url"
        if password is None and self.user:
            password = os.environ.get(SMTP_PASSWORD_ENV)
            self._password_from = SMTP_PASSWORD_ENV
        if self.user and password is None:
            raise ValueError(f"email URL {_redact(url)!r} names a user but no password "
                             f"(put it in the URL or in {SMTP_PASSWORD_ENV})")
        self._password = password
        self._ssl = ssl.create_default_context() if (self.ssl or self.starttls) else None
        self.timeout_s = float(timeout_s)
        self._url = _redact(url)

    def __repr__(self) -> str:
        return f"SmtpTransport({self._url!r})"

    def credentials_source(self) -> str:
        """Where this transport's credentials come from, in words an operator can act on
        (never the password itself)."""
        if self.user:
            return f"{self._password_from} (login {self.user!r} at {self.host}:{self.port})"
        return "no login (email.url names no user): the sender address email.sender or this host's address"

    def probe(self) -> str:
        """Connect, EHLO, STARTTLS and log in as a send would, then (with ``sender``) offer
        our sender, ``MAIL FROM:<sender>``, and take it back with ``RSET``, then QUIT: what
        `payrun check` says of the server ("connected, STARTTLS, login accepted, sender
        <address> accepted"), or ValueError saying what refused us: CredentialsRefused for
        the login, or for the sender refused with a 5xx (5.7.1 sender not allowed: every
        send would be refused, AccountRefused; a probe that stopped at the login resumed a
        paused send-email process, and each resume refused one lane's worth of sends
        again). No RCPT, no DATA: nothing is sent. The whole probe ends within
        ``timeout_s``, as a send does (``_Cutoff``): a server that takes the connection and
        never answers, or trickles its replies, held the check for a timeout per reply."""
        deadline = _Deadline(self.timeout_s)
        cutoff = _Cutoff(max(0.0, self.timeout_s - CUTOFF_MARGIN_S))  # (it fires that margin late)
        smtp: smtplib.SMTP | None = None
        done: list[str] = []
        waiting = ["its TLS handshake and greeting" if self.ssl else "its greeting"]

        def step(what: str, fn, *args, **kwargs):
            waiting[0] = what
            if smtp is not None and smtp.sock is not None:
                smtp.sock.settimeout(deadline.left())
            return fn(*args, **kwargs)

        try:
            # the host given to the constructor is the name TLS checks (STARTTLS and smtps://)
            if self.ssl:
                smtp = _CutSMTPS(self.host, self.port, _EHLO_LATER, timeout=deadline.left(), context=self._ssl,
                                 cutoff=cutoff)
            else:
                smtp = _CutSMTP(self.host, self.port, _EHLO_LATER, timeout=deadline.left(), cutoff=cutoff)
            if cutoff.fired:  # (a greeting cut short by the cutoff can still read as a 220)
                raise socket.timeout("the probe's deadline passed")
            done.append("connected over TLS" if self.ssl else "connected")
            smtp.local_hostname = address_literal(smtp.sock)
            step("EHLO", smtp.ehlo_or_helo_if_needed)
            if self.starttls:
                step("STARTTLS", smtp.starttls, context=self._ssl)
                step("EHLO after STARTTLS", smtp.ehlo)
                done.append("STARTTLS")
            if self.user:
                step("the login", smtp.login, self.user, self._password)
                done.append("login accepted")
            if self.sender:
                code, reply = step("MAIL FROM", smtp.mail, self.sender)
                if code != 250:
                    refused = (f"{', '.join(done)}, then our sender {self.sender} refused ({code} {_short(reply)})")
                    try:
                        step("QUIT", smtp.quit)
                    except (OSError, smtplib.SMTPException):
                        pass
                    if 500 <= code < 600:  # every send would be refused alike: as a refused login
                        raise CredentialsRefused(f"{refused}: set email.sender to an address this login may send "
                                                 "as, or let it send as this one")
                    raise ValueError(f"{refused}, for now")
                step("RSET", smtp.rset)
                done.append(f"sender {self.sender} accepted")
            try:
                step("QUIT", smtp.quit)
            except (OSError, smtplib.SMTPException):
                pass
            return ", ".join(done)
        except smtplib.SMTPAuthenticationError as e:
            raise CredentialsRefused(f"login refused ({e.smtp_code} {_short(e.smtp_error)}): check "
                             f"{SMTP_PASSWORD_ENV} or the login in email.url") from None
        except smtplib.SMTPResponseException as e:
            raise ValueError(f"{', '.join(done) or 'connected'}, then refused: {e.smtp_code} "
                             f"{_short(e.smtp_error)}") from None
        except (OSError, smtplib.SMTPException) as e:
            connected = cutoff._dup is not None  # (the TCP connection was made and adopted)
            then = f"{', '.join(done) or 'connected'}, then"
            if cutoff.fired or _is_timeout(e) or (isinstance(e, smtplib.SMTPServerDisconnected)
                                                  and "timed out" in str(e)):
                raise ValueError(f"{then} no answer to {waiting[0]} within {self.timeout_s:g} s" if connected
                                 else f"cannot connect (no answer within {self.timeout_s:g} s)") from None
            if isinstance(e, ssl.SSLCertVerificationError):
                raise ValueError(f"the server's certificate is not trusted ({_short(e.verify_message or str(e))}): "
                                 f"a private CA's certificate goes in SSL_CERT_FILE") from None
            if isinstance(e, smtplib.SMTPNotSupportedError) and waiting[0] == "STARTTLS":
                raise ValueError(f"{then} the server does not offer STARTTLS (smtps:// if it takes TLS from "
                                 f"the start)") from None
            if isinstance(e, smtplib.SMTPNotSupportedError) and waiting[0] == "the login":
                raise ValueError(f"{then} the server offers no login (SMTP AUTH) on this connection"
                                 + ("" if self.ssl or self.starttls else ": does it want STARTTLS first (?starttls=1)?")
                                 ) from None
            if isinstance(e, ssl.SSLError):
                hint = ": is it a STARTTLS port (smtp://…?starttls=1)?" if self.ssl else ""
                raise ValueError(f"{then} TLS failed ({_short(e.reason or str(e))}){hint}" if connected
                                 else f"cannot connect (TLS: {_short(e.reason or str(e))})") from None
            if isinstance(e, smtplib.SMTPServerDisconnected):
                raise ValueError(f"{then} the server closed the connection") from None
            raise ValueError(f"{then} {_oserr(e)}" if connected and done else f"cannot connect ({_oserr(e)})") from None
        finally:
            cutoff.close()
            if smtp is not None:
                try:
                    smtp.close()
                except OSError:
                    pass

    def close(self) -> None:
        pass  # nothing kept between sends

    @staticmethod
    def build(msg: Message) -> EmailMessage:
        em = EmailMessage(policy=SMTP_POLICY)
        em["From"] = msg.sender
        em["To"] = formataddr((msg.to_name, msg.to_addr)) if msg.to_name else msg.to_addr
        em["Subject"] = msg.subject
        em["Message-ID"] = message_id_for(msg.idempotency_key)
        em["Idempotency-Key"] = msg.idempotency_key
        em.set_content(msg.text_body)
        em.add_attachment(msg.attachment_bytes, maintype="application", subtype="pdf",
                          filename=msg.attachment_name)
        return em

    def prepare(self, msg: Message) -> bytes:
        """The DATA bytes (dot-stuffed, terminated): build them before waiting for the
        rate limiter's start time, so the send leaves right at it."""
        data = _DOTS.sub(b"..", self.build(msg).as_bytes())
        if not data.endswith(b"\r\n"):
            data += b"\r\n"
        return data + b".\r\n"

    def send(self, msg: Message, prepared: bytes | None = None,
             before_write: Callable[[], bool] | None = None,
             before_data: Callable[[], None] | None = None, until: float | None = None) -> str:
        deadline = _Deadline(self.timeout_s, until)
        envelope_from = parseaddr(msg.sender)[1] or msg.sender
        to = msg.to_addr
        if not to.isascii() or not envelope_from.isascii():
            raise PermanentError(f"recipient address {to!r} is not plain ASCII (SMTPUTF8 unsupported)")
        data = prepared if prepared is not None else self.prepare(msg)
        _check_before_write(before_write)
        mid = message_id_for(msg.idempotency_key)

        handed_over = False  # True once the server said 354 and we start sending content
        healthy = True  # the connection can still take a QUIT
        smtp: smtplib.SMTP | None = None

        def step(fn, *args):
            if smtp is not None and smtp.sock is not None:
                smtp.sock.settimeout(deadline.left())
            try:
                out = fn(*args)
            except Exception as e:
                # whatever smtplib made of a reply cut short (a torn code, "22", a closed
                # connection); a complete reply read before the cut (a 550, a 535) keeps its meaning
                complete = isinstance(e, smtplib.SMTPResponseException) and 200 <= e.smtp_code < 600
                if cutoff.fired and not complete:
                    raise TimeoutError("the send's deadline passed") from None
                raise
            if cutoff.fired and isinstance(out, tuple) and out and isinstance(out[0], int) and not 200 <= out[0] < 600:
                raise TimeoutError("the send's deadline passed")  # a reply cut short: no real code in it
            return out

        where = f"{self.host}:{self.port}"
        cutoff = _Cutoff(deadline.end - time.monotonic())  # (from the send's start, not from here)
        try:
            try:
                named = _ehlo_lookup(time.monotonic())  # (under way while we connect)
                if self.ssl:
                    smtp = step(lambda: _CutSMTPS(self.host, self.port, _EHLO_LATER,
                                                  timeout=deadline.left(), context=self._ssl, cutoff=cutoff))
                else:
                    smtp = step(lambda: _CutSMTP(self.host, self.port, _EHLO_LATER,
                                                 timeout=deadline.left(), cutoff=cutoff))
                smtp.local_hostname = ehlo_name(deadline.left(), named) or address_literal(smtp.sock)
                step(smtp.ehlo_or_helo_if_needed)
                if self.starttls:
                    step(lambda: smtp.starttls(context=self._ssl))
                    step(smtp.ehlo)
                if self.user:
                    step(smtp.login, self.user, self._password)
                code, reply = step(smtp.mail, envelope_from)
                if code != 250:
                    raise smtplib.SMTPSenderRefused(code, reply, envelope_from)
                code, reply = step(smtp.rcpt, to)
                if code not in (250, 251):
                    raise smtplib.SMTPRecipientsRefused({to: (code, reply)})
                if before_data is not None:
                    before_data()  # raises to call it off (the session still ends with QUIT)
                step(smtp.putcmd, "data")
                code, reply = step(smtp.getreply)
                if code != 354:
                    raise smtplib.SMTPDataError(code, reply)
                handed_over = True
                step(smtp.send, data)
                code, reply = step(smtp.getreply)
                if code != 250:
                    raise smtplib.SMTPDataError(code, reply)
            except smtplib.SMTPRecipientsRefused as e:
                code, reply = next(iter(e.recipients.values()))
                if rcpt_refusal_is_ours(_short(reply, 10_000)):
                    raise AccountRefused(f"the server refused our sender or host when given the recipient, check "
                                         f"email.url and email.sender: {code} {_short(reply)}") from None
                if 400 <= code < 500:  # this address, for now: no sign the server is down
                    raise RecipientDeferred(f"SMTP deferred recipient {to!r}: {code} {_short(reply)}") from None
                raise _classify_smtp(code, reply, f"SMTP refused recipient {to!r}") from None
            except smtplib.SMTPResponseException as e:
                # SMTPSenderRefused, SMTPDataError, SMTPAuthenticationError, SMTPConnectError, ...
                what = {smtplib.SMTPSenderRefused: "SMTP refused sender",
                        smtplib.SMTPDataError: "SMTP refused message",
                        smtplib.SMTPAuthenticationError: "SMTP authentication failed",
                        smtplib.SMTPConnectError: "SMTP refused connection"}.get(type(e), "SMTP error")
                if isinstance(e, (smtplib.SMTPAuthenticationError, smtplib.SMTPSenderRefused)):
                    # our login or our sender address, not this slip: every send would fail
                    raise AccountRefused(f"the server refused our login or sender, check PAYRUN_SMTP_PASSWORD (or the "
                                         f"login in email.url) and email.sender: {what}: {e.smtp_code} "
                                         f"{_short(e.smtp_error)}") from None
                raise _classify_smtp(e.smtp_code, e.smtp_error, what) from None
            except (smtplib.SMTPServerDisconnected, socket.timeout, TimeoutError) as e:
                healthy = False
                kind = "connection closed" if isinstance(e, smtplib.SMTPServerDisconnected) else "timed out"
                if handed_over:
                    raise OutcomeUnknown(f"SMTP {where}: {kind} after the message was sent; "
                                         f"it may have been delivered") from None
                raise TransientError(f"SMTP {where}: {kind} before the message was sent") from None
            except smtplib.SMTPException as e:
                # no AUTH / STARTTLS support, no usable auth method: configuration, not luck
                raise PermanentError(f"SMTP {where}: {_short(str(e), 120)}") from None
            except BaseTimeoutException:  # the job's timeout, anywhere (mid-DATA too): no QUIT on it
                healthy = False
                raise
            except OSError as e:  # refused, reset, unreachable, TLS failure
                healthy = False
                why = "timed out" if cutoff.fired else _oserr(e)
                if handed_over:
                    raise OutcomeUnknown(f"SMTP {where}: {why} after the message was sent; "
                                         f"it may have been delivered") from None
                raise TransientError(f"SMTP {where}: {why} before the message was sent") from None
        finally:
            cutoff.close()
            if smtp is not None:
                # QUIT only within what is left of the send's deadline (``until``: its job's time),
                # never past it: a delivered message must have its time to be recorded
                quit_s = min(2.0, self.timeout_s, deadline.end - time.monotonic() - CUTOFF_MARGIN_S)
                if healthy and smtp.sock is not None and quit_s > 0:
                    quit_cut = _Cutoff(quit_s)  # a trickled QUIT reply holds nothing either
                    quit_cut.adopt(smtp.sock)
                    try:
                        smtp.sock.settimeout(quit_s)
                        smtp.quit()
                    except BaseTimeoutException:  # the job's timeout: not swallowed
                        raise
                    except Exception:
                        pass
                    finally:
                        quit_cut.close()
                try:
                    smtp.close()
                except Exception:
                    pass
        log.debug("smtp sent key=%s to=%s", msg.idempotency_key, to)
        return mid


def _short(text: str | bytes, limit: int = 200) -> str:
    """A server's reply as our error quotes it: one line, control characters as escapes
    (an ESC in a reply reached the operator's terminal through `payrun failed`)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = visible(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _classify_smtp(code: int, reply, what: str) -> Exception:
    text = f"{what}: {code} {_short(reply)}"
    if 400 <= code < 500:
        return TransientError(text)
    if 500 <= code < 600:
        return PermanentError(text)
    return TransientError(text)  # unexpected code (e.g. -1): assume trouble, retry


# ---------------------------------------------------------------- HTTP provider API

def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # HTTP-date form
        from email.utils import parsedate_to_datetime
        when = parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class HttpTransport:
    def __init__(self, url: str, timeout_s: float, *, token: "str | TokenSource | None" = None):
        """``token``: a str (PAYRUN_EMAIL_TOKEN's), a ``TokenSource`` (the local provider's
        file: read again when the provider refuses it, the send then tried once more with
        the new token: no restart after the file is replaced, and nothing more per send
        while it is accepted), or None (PAYRUN_EMAIL_TOKEN, if set)."""
        parts = urlsplit(url)
        self.https = parts.scheme.lower() == "https"
        if not parts.hostname:
            raise ValueError(f"no host in email URL {_redact(url)!r}")
        self.host = parts.hostname
        self.port = _port(parts, 443 if self.https else 80, url)
        self.path = parts.path.rstrip("/") + "/v1/messages"
        self.timeout_s = float(timeout_s)
        if token is None:
            token = os.environ.get(EMAIL_TOKEN_ENV) or None
        self._token_file: TokenSource | None = None if token is None or isinstance(token, str) else token
        if self._token_file is not None:
            token = self._token_file.current()
        if token and not header_safe(token):
            # (http.client's refusal quotes the whole header, the token, in the send's error)
            raise ValueError(f"the provider's token ({EMAIL_TOKEN_ENV} or the token file) is not one line of "
                             f"printable ASCII: set the token alone")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._ssl = ssl.create_default_context() if self.https else None
        self._local = threading.local()
        self._all: set[http.client.HTTPConnection] = set()
        self._all_lock = threading.Lock()
        self._url = _redact(url)

    def __repr__(self) -> str:
        return f"HttpTransport({self._url!r})"

    def credentials_source(self) -> str:
        """Where this transport's token comes from, in words an operator can act on (never
        the token itself)."""
        if self._token_file is not None:
            return (f"the local provider's token file {self._token_file.path} ({EMAIL_TOKEN_ENV} not set; "
                    f"read again before each probe)")
        if "Authorization" not in self._headers:
            return f"no token: {EMAIL_TOKEN_ENV} is not set"
        return f"{EMAIL_TOKEN_ENV} in this process's environment (a restart takes a new value)"

    def _token_replaced(self, shown: dict[str, str]) -> bool:
        """After a refusal of the token in ``shown``: read the token file again (if ours is
        one); True if it now holds another token than the refused one (then in
        ``self._headers``: a new dict, so other threads' sends see one or the other)."""
        if self._token_file is None:
            return False
        auth = f"Bearer {self._token_file.refresh()}"
        if auth != self._headers.get("Authorization"):
            self._headers = {**self._headers, "Authorization": auth}
        return auth != shown.get("Authorization")

    def _refused(self, status: int) -> str:
        """Where to look when the provider refuses our token: the file it came from, or
        PAYRUN_EMAIL_TOKEN (never the token itself)."""
        if self._token_file is not None:
            return (f"the provider refused our token ({status}), the local provider's token in "
                    f"{self._token_file.path} ({EMAIL_TOKEN_ENV} is not set): `payrun provider` and its senders "
                    f"must share one data directory, PAYRUN_HOME")
        if "Authorization" not in self._headers:
            return f"the provider wants a token ({status}) and {EMAIL_TOKEN_ENV} is not set"
        return f"the provider refused our token ({status}): check {EMAIL_TOKEN_ENV}"

    def probe(self) -> str:
        """POST an empty request, with our token and no Idempotency-Key, to the messages
        endpoint: the provider checks the token first and refuses the request as malformed
        (400), so nothing is sent. What `payrun check` says, or ValueError saying what refused
        us. The whole probe ends within ``timeout_s`` (``_Cutoff``), as a send does."""
        deadline = _Deadline(self.timeout_s)
        shown = self._headers
        resp, raw = self._probe_once(deadline)
        if resp.status in (401, 403) and self._token_replaced(shown):
            resp, raw = self._probe_once(deadline)  # the token file was replaced: its new token
        if resp.status in (401, 403):
            raise CredentialsRefused(self._refused(resp.status))
        token = "Authorization" in self._headers
        if resp.status == 400:
            return "reachable" + (", token accepted" if token else "")
        if resp.status == 429:
            return "reachable (it answered 429: over its rate limit just now)"
        if resp.status >= 500:
            raise ValueError(f"the provider is in trouble: {resp.status} {_short(raw)}")
        if resp.status == 404:
            raise ValueError(f"no messages endpoint at {self.path} (404): check the URL's path")
        return f"reachable (it answered {resp.status} to a request with no message)"

    def _probe_once(self, deadline: "_Deadline") -> tuple[http.client.HTTPResponse, bytes]:
        cutoff = _Cutoff(max(0.0, deadline.left() - CUTOFF_MARGIN_S))  # (it fires that margin late)
        conn = self._new_conn()
        _cut_connections(conn, cutoff)
        try:
            try:
                conn.timeout = deadline.left()
                conn.connect()
                conn.sock.settimeout(deadline.left())
                conn.request("POST", self.path, body=b"{}", headers=self._headers)
                conn.sock.settimeout(deadline.left())
                resp = conn.getresponse()
                raw = resp.read(2000)
            except (OSError, http.client.HTTPException) as e:
                connected = cutoff._dup is not None  # (the TCP connection was made and adopted)
                if cutoff.fired or _is_timeout(e):
                    raise ValueError(f"the provider took the connection, then did not answer within "
                                     f"{self.timeout_s:g} s" if connected else
                                     f"cannot reach the provider (no answer within {self.timeout_s:g} s)") from None
                if isinstance(e, ssl.SSLCertVerificationError):
                    raise ValueError(f"the provider's certificate is not trusted "
                                     f"({_short(e.verify_message or str(e))}): a private CA's certificate goes "
                                     f"in SSL_CERT_FILE") from None
                if isinstance(e, ssl.SSLError) and connected:
                    raise ValueError(f"the provider took the connection, then TLS failed "
                                     f"({_short(e.reason or str(e))}): does it speak https:// on that port?") from None
                raise ValueError(f"cannot reach the provider ({_oserr(e)})") from None
        finally:
            cutoff.close()
            self._drop(conn)
        return resp, raw

    # -- connections
    def _new_conn(self) -> http.client.HTTPConnection:
        if self.https:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                               context=self._ssl)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        with self._all_lock:
            self._all.add(conn)
        return conn

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._all_lock:
            self._all.discard(conn)
        try:
            conn.close()
        except Exception:
            pass

    def close(self) -> None:
        """Close every thread's connection (call once the senders have stopped)."""
        with self._all_lock:
            conns, self._all = list(self._all), set()
        for conn in conns:
            try:
                conn.close()
            except Exception:
                pass

    # -- sending
    def body(self, msg: Message) -> bytes:
        return json.dumps({
            "to": msg.to_addr,
            "to_name": msg.to_name,
            "from": msg.sender,
            "subject": msg.subject,
            "text": msg.text_body,
            "attachments": [{
                "filename": msg.attachment_name,
                "content_type": "application/pdf",
                "content_b64": base64.b64encode(msg.attachment_bytes).decode("ascii"),
            }],
        }, ensure_ascii=False).encode("utf-8")

    def prepare(self, msg: Message) -> bytes:
        """The request body, and this thread's connection if it has none: both before
        waiting for the rate limiter's start time, so that at that moment only the request
        leaves (a first send that also connects arrives late, and the provider counts
        arrivals). A failed connect is left to send(), which reports it."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and (conn.sock is None or _peer_closed(conn.sock)):
            self._drop(conn)  # closed by the server while idle: reconnect now, not at the start time
        if getattr(self._local, "conn", None) is None:
            conn = self._new_conn()
            cutoff = _Cutoff(self.timeout_s)  # (a trickled TLS handshake holds nothing either)
            _cut_connections(conn, cutoff)
            try:
                conn.connect()
                self._local.conn = conn
            except (OSError, http.client.HTTPException):
                self._drop(conn)
            finally:
                cutoff.close()
        return self.body(msg)

    def send(self, msg: Message, prepared: bytes | None = None,
             before_write: Callable[[], bool] | None = None,
             before_data: Callable[[], None] | None = None, until: float | None = None) -> str:
        """``before_data`` is not called: ``before_write`` runs just before the request."""
        deadline = _Deadline(self.timeout_s, until)
        body = prepared if prepared is not None else self.body(msg)
        shown = self._headers
        headers = dict(shown)
        headers["Idempotency-Key"] = msg.idempotency_key
        where = f"provider {self.host}:{self.port}"
        cutoff = _Cutoff(deadline.end - time.monotonic())
        try:
            try:
                return self._send(body, headers, where, deadline, cutoff, before_write)
            except AccountRefused:
                if not self._token_replaced(shown):
                    raise
            # the token file was replaced (the provider follows it): once more with its new
            # token, same Idempotency-Key (a refused request was not accepted)
            headers = dict(self._headers)
            headers["Idempotency-Key"] = msg.idempotency_key
            return self._send(body, headers, where, deadline, cutoff, before_write)
        finally:
            cutoff.close()

    def _send(self, body: bytes, headers: dict[str, str], where: str, deadline: _Deadline, cutoff: _Cutoff,
              before_write: Callable[[], bool] | None) -> str:
        for attempt in (1, 2):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None and conn.sock is not None
            if reused and _peer_closed(conn.sock):
                self._drop(conn)  # the server closed it while idle: don't even try
                conn, reused = None, False
            if not reused:
                if conn is not None:
                    self._drop(conn)
                conn = self._new_conn()
                self._local.conn = conn
                _cut_connections(conn, cutoff)
                try:
                    conn.timeout = deadline.left()
                    conn.connect()
                except (OSError, http.client.HTTPException) as e:
                    self._drop(conn)
                    raise TransientError(f"{where}: cannot connect ({_oserr(e)})") from None
                except BaseException:
                    self._drop(conn)
                    raise
            if reused:
                cutoff.adopt(conn.sock)
            _check_before_write(before_write)
            try:
                conn.sock.settimeout(deadline.left())
                conn.request("POST", self.path, body=body, headers=headers)
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                if reused and attempt == 1 and not _is_timeout(e) and not cutoff.fired:
                    continue  # a dead keep-alive connection: retry once on a fresh one
                raise TransientError(f"{where}: request not sent ({'timed out' if cutoff.fired else _oserr(e)})") from None
            except BaseException:  # interrupted mid-request: the connection is unusable
                self._drop(conn)
                raise
            try:
                conn.sock.settimeout(deadline.left())
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                if reused and attempt == 1 and isinstance(e, _STALE) and not cutoff.fired:
                    # closed/reset with no byte of reply on a reused connection: the classic
                    # idle keep-alive race; retrying is safe (same Idempotency-Key)
                    continue
                raise OutcomeUnknown(f"{where}: {'timed out' if cutoff.fired else _oserr(e)} after the request "
                                     f"was sent; it may have been delivered") from None
            except BaseException:  # never leave an unread reply on a reusable connection
                self._drop(conn)
                raise
            if resp.will_close:
                self._drop(conn)
            return self._result(resp, raw, where)
        raise AssertionError("unreachable")

    def _result(self, resp: http.client.HTTPResponse, raw: bytes, where: str) -> str:
        status = resp.status
        try:
            doc = json.loads(raw) if raw else {}
            if not isinstance(doc, dict):
                doc = {}
        except ValueError:
            doc = {}
        if status in (200, 201, 202):
            mid = doc.get("id")
            if not isinstance(mid, str) or not mid:
                raise OutcomeUnknown(f"{where}: HTTP {status} without a message id")
            return SentId(provider_id(mid), duplicate=doc.get("duplicate") is True)
        reason = _short(str(doc.get("error") or resp.reason or ""), 200)
        text = f"{where}: HTTP {status}" + (f" {reason}" if reason else "")
        if status == 429:
            after = _retry_after(resp.getheader("Retry-After"))
            raise Throttled(text, retry_after_s=after if after is not None else 1.0)
        if status >= 500 or status == 408:
            raise TransientError(text, retry_after_s=_retry_after(resp.getheader("Retry-After")))
        if status in (401, 403):  # our token or account, not this slip: every send would fail
            if self._token_file is not None:
                raise AccountRefused(f"the provider refused our credentials, the local provider's token in "
                                     f"{self._token_file.path} (`payrun provider` and its senders must share one "
                                     f"data directory, PAYRUN_HOME): {text}")  # (the hint first: status shows the start)
            raise AccountRefused(f"the provider refused our credentials, check {EMAIL_TOKEN_ENV} (the provider's "
                                 f"token): {text}")
        if 400 <= status < 500:
            raise PermanentError(text)
        raise TransientError(f"{where}: unexpected HTTP {status}")


_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def _peer_closed(sock: socket.socket) -> bool:
    """An idle keep-alive socket that is readable has been closed (or reset) by the peer."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, (socket.timeout, TimeoutError))


def _oserr(e: BaseException) -> str:
    if _is_timeout(e):
        return "timed out"
    if isinstance(e, http.client.RemoteDisconnected):
        return "connection closed without a reply"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, ConnectionResetError):
        return "connection reset"
    return type(e).__name__
