"""Email transports against real servers: aiosmtpd for SMTP, payrun.provider for HTTP,
and tiny raw-socket servers for the connection-drop cases."""

from __future__ import annotations

import asyncio
import email
import email.policy
import hashlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from jobs.errors import AccountRefused, OutcomeUnknown, PermanentError, TransientError
from jobs.policy import classify, counts_as_provider_failure
from jobs.mail import HttpTransport, Message, SmtpTransport, message_id_for, transport_for
from payrun.provider import Provider

PDF = b"%PDF-1.7\n" + bytes(range(256)) * 40 + b"\n.\n.leading dot line\n%%EOF\n"


def make_msg(to="tanvir.ahmed@meghna.example", key="slip:2026-11:emp-00017", **kw) -> Message:
    fields = dict(
        to_addr=to, to_name="Tanvir Ahmed (তানভীর আহমেদ)", subject="Salary slip November 2026",
        text_body="Dear Tanvir,\nyour salary slip for November 2026 is attached.\n",
        attachment_name="slip-2026-11-emp-00017.pdf", attachment_bytes=PDF,
        idempotency_key=key, sender="Payroll <payroll@payrun.localhost>",
    )
    fields.update(kw)
    return Message(**fields)


def wait_for(pred, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------ SMTP

class Recorder:
    """aiosmtpd handler: records messages; per-recipient canned RCPT/DATA replies."""

    def __init__(self):
        self.messages: list[tuple[list[str], bytes]] = []
        self.rcpt_reply: dict[str, str] = {}
        self.data_reply: dict[str, str] = {}
        self.data_delay_s = 0.0
        self.on_data = None  # called (no arguments) as each message's DATA arrives
        self.on_rcpt = None  # called (no arguments) as each RCPT arrives
        self.ehlo_names: list[str] = []  # the name each session's client gave in EHLO

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        self.ehlo_names.append(session.host_name)
        if self.on_rcpt is not None:
            self.on_rcpt()
        if address in self.rcpt_reply:
            return self.rcpt_reply[address]
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        if self.on_data is not None:
            self.on_data()
        for rcpt in envelope.rcpt_tos:
            if rcpt in self.data_reply:
                return self.data_reply[rcpt]
        self.messages.append((list(envelope.rcpt_tos), envelope.content))
        if self.data_delay_s:  # "delivered", but the reply is late
            await asyncio.sleep(self.data_delay_s)
        return "250 OK queued"


class EphemeralController(Controller):
    """Controller on port 0: learn the real port before aiosmtpd's readiness probe."""

    def _trigger_server(self):
        self.port = self.server.sockets[0].getsockname()[1]
        super()._trigger_server()


@pytest.fixture
def smtpd():
    handler = Recorder()
    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0)
    ctl.start()
    handler.url = f"smtp://127.0.0.1:{ctl.port}"
    yield handler
    ctl.stop()


def test_smtp_delivers_pdf_with_idempotency_headers(smtpd):
    t = transport_for(smtpd.url, timeout_s=5)
    assert isinstance(t, SmtpTransport)
    msg = make_msg()
    mid = t.send(msg)
    assert mid == message_id_for(msg.idempotency_key)
    assert len(smtpd.messages) == 1
    rcpts, raw = smtpd.messages[0]
    assert rcpts == ["tanvir.ahmed@meghna.example"]
    parsed = email.message_from_bytes(raw, policy=email.policy.default)
    assert parsed["Idempotency-Key"] == "slip:2026-11:emp-00017"
    expected = "<" + hashlib.sha256(b"slip:2026-11:emp-00017").hexdigest()[:32] + "@payrun>"
    assert parsed["Message-ID"] == expected
    assert parsed["Subject"] == "Salary slip November 2026"
    assert "তানভীর" in str(parsed["To"])
    atts = list(parsed.iter_attachments())
    assert len(atts) == 1
    assert atts[0].get_content_type() == "application/pdf"
    assert atts[0].get_filename() == "slip-2026-11-emp-00017.pdf"
    assert atts[0].get_content() == PDF  # incl. the lines starting with "."
    assert "salary slip for November" in parsed.get_body(("plain",)).get_content()


def test_smtp_resend_has_same_message_id(smtpd):
    t = transport_for(smtpd.url, timeout_s=5)
    t.send(make_msg())
    t.send(make_msg())
    t.send(make_msg(key="slip:2026-11:emp-00018"))
    ids = [email.message_from_bytes(raw)["Message-ID"] for _, raw in smtpd.messages]
    assert ids[0] == ids[1] != ids[2]


def test_smtp_4xx_recipient_is_transient(smtpd):
    smtpd.rcpt_reply["busy@meghna.example"] = "451 4.3.0 try again later"
    with pytest.raises(TransientError) as ei:
        transport_for(smtpd.url, 5).send(make_msg(to="busy@meghna.example"))
    assert not isinstance(ei.value, OutcomeUnknown)
    assert "451" in str(ei.value)
    assert smtpd.messages == []
    # one address's trouble (greylisting), not a sign the server is down: no outage pause
    from jobs.errors import RecipientDeferred
    from jobs.policy import counts_as_provider_failure

    assert isinstance(ei.value, RecipientDeferred) and not counts_as_provider_failure(ei.value)


def test_smtp_5xx_recipient_is_permanent(smtpd):
    smtpd.rcpt_reply["gone@meghna.example"] = "550 5.1.1 no such user"
    with pytest.raises(PermanentError) as ei:
        transport_for(smtpd.url, 5).send(make_msg(to="gone@meghna.example"))
    assert "550" in str(ei.value) and "gone@meghna.example" in str(ei.value)
    assert "Tanvir" not in str(ei.value) and "slip" not in str(ei.value).lower()


def test_smtp_refusing_our_sender_or_host_at_rcpt_is_an_account_problem_not_every_slips_permanent_failure(smtpd):
    """Postfix checks the sender (and whether we may relay) when the recipient is given
    (smtpd_delay_reject = yes, its default): a bad email.sender or a missing login is then
    refused at RCPT for every slip, and must pause the senders like a refused MAIL FROM,
    not fail the whole run slip by slip. A refusal about the recipient stays that slip's."""
    t = transport_for(smtpd.url, 5)
    postfix_like = {
        "a@meghna.example": "553 5.7.1 <payroll@payrun.example>: Sender address rejected: not owned by user payroll",
        "b@meghna.example": "450 4.1.8 <payroll@payrun.example>: Sender address rejected: Domain not found",
        "c@meghna.example": "554 5.7.1 <c@meghna.example>: Relay access denied",
        "d@meghna.example": "550 5.1.7 bad sender mailbox address syntax",
        "e@meghna.example": "530 5.7.0 Authentication required",
    }
    smtpd.rcpt_reply.update(postfix_like)
    for to, reply in postfix_like.items():
        with pytest.raises(AccountRefused) as ei:
            t.send(make_msg(to=to))
        assert reply.split()[0] in str(ei.value) and "check email.url and email.sender" in str(ei.value)
        assert counts_as_provider_failure(ei.value)
    smtpd.rcpt_reply["gone@meghna.example"] = "550 5.1.1 <gone@meghna.example>: Recipient address rejected: User unknown"
    with pytest.raises(PermanentError):
        t.send(make_msg(to="gone@meghna.example"))
    assert smtpd.messages == []


def test_which_rcpt_refusals_blame_our_side():
    from jobs.policy import rcpt_refusal_is_ours

    assert rcpt_refusal_is_ours("5.1.8 <x@y>: Sender address rejected: Domain not found")
    assert rcpt_refusal_is_ours("4.1.7 bad sender")
    assert rcpt_refusal_is_ours("Client host rejected: cannot find your hostname")
    assert not rcpt_refusal_is_ours("5.1.1 <gone@y>: Recipient address rejected: User unknown in virtual mailbox table")
    assert not rcpt_refusal_is_ours("5.2.2 mailbox full")
    assert rcpt_refusal_is_ours("4.1.8")  # the enhanced code alone says "the sender's system"
    assert not rcpt_refusal_is_ours("5.7.1 message content rejected")
    assert not rcpt_refusal_is_ours("5.1.10 recipient address has null MX")  # X.1.10 is not X.1.1's sender kin
    assert not rcpt_refusal_is_ours("no such user here")
    # Exchange's refusals of us
    assert rcpt_refusal_is_ours("5.7.1 Unable to relay for emp@gmail.example")
    assert rcpt_refusal_is_ours("5.7.54 SMTP; Unable to relay recipient in non-accepted domain")
    assert rcpt_refusal_is_ours("5.7.57 Client not authenticated to send mail")
    assert rcpt_refusal_is_ours("5.7.0 Authentication required")  # RFC 4954
    assert rcpt_refusal_is_ours("5.1.8: <payroll@payrun.example> domain of sender does not exist")
    # the recipient's after all: words quoted from the recipient's host, a restricted mailbox
    assert not rcpt_refusal_is_ours(
        "4.1.1 <emp@old.example>: Recipient address rejected: unverified address: host mx.old.example[192.0.2.7] "
        "said: 554 5.7.1 <emp@old.example>: Relay access denied (in reply to RCPT TO command)")
    assert not rcpt_refusal_is_ours("5.1.1 <emp@old.example>: Recipient address rejected: undeliverable address: "
                                    "host mx.old.example[192.0.2.7] said: 550 5.7.1 Relaying denied")
    assert not rcpt_refusal_is_ours("5.7.1 RESOLVER.RST.AuthRequired; authentication required")
    # review: our HELO name and our IP on a blocklist are ours; Exim quoting the recipient's host is not
    assert rcpt_refusal_is_ours("5.5.2 <payrun-worker>: Helo command rejected: need fully-qualified hostname")
    assert rcpt_refusal_is_ours("5.7.1 Service unavailable; Client host [192.0.2.9] blocked using zen.spamhaus.org")
    assert not rcpt_refusal_is_ours("5.0.0 <emp@old.example>: Recipient verify failed: SMTP error from remote mail "
                                    "server after RCPT TO:<emp@old.example>: Response: 550 Relaying denied")
    assert not rcpt_refusal_is_ours("550 host mx.old.example Response: 550 5.7.1 Relaying denied")
    # our sender, probed at our own host (Postfix's reject_unverified_sender)
    assert rcpt_refusal_is_ours("4.1.0 <payroll@payrun.example>: Sender address rejected: unverified address: "
                                "host mx.payrun.example[192.0.2.9] said: 550 5.1.1 no such user")


def test_smtp_data_replies_classified(smtpd):
    smtpd.data_reply["full@meghna.example"] = "452 4.2.2 mailbox full"
    smtpd.data_reply["spam@meghna.example"] = "554 5.7.1 rejected as spam"
    t = transport_for(smtpd.url, 5)
    with pytest.raises(TransientError) as ei:
        t.send(make_msg(to="full@meghna.example"))
    assert not isinstance(ei.value, OutcomeUnknown)
    with pytest.raises(PermanentError):
        t.send(make_msg(to="spam@meghna.example"))
    t.send(make_msg())  # the transport is still usable afterwards
    assert len(smtpd.messages) == 1


def test_smtp_server_down_is_transient():
    t = transport_for(f"smtp://127.0.0.1:{closed_port()}", 2)
    with pytest.raises(TransientError) as ei:
        t.send(make_msg())
    assert not isinstance(ei.value, OutcomeUnknown)


def test_smtp_timeout_after_data_is_outcome_unknown(smtpd):
    smtpd.data_delay_s = 2.0
    t = transport_for(smtpd.url, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(OutcomeUnknown):
        t.send(make_msg())
    assert time.monotonic() - start < 1.5
    assert len(smtpd.messages) == 1  # it WAS delivered: hence OutcomeUnknown, not Transient


def smtp_with_login(handler, tries: list | None = None) -> "EphemeralController":
    """A started SMTP server on 127.0.0.1 taking only the login payroll / s3cret-pw (aiosmtpd
    answers any other 535); ``tries`` collects the mechanisms clients tried."""
    def authenticator(server, session, envelope, mechanism, auth_data):
        if tries is not None:
            tries.append(mechanism)
        ok = (auth_data.login, auth_data.password) == (b"payroll", b"s3cret-pw")
        return AuthResult(success=ok, handled=False)  # handled=False: aiosmtpd answers 535

    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0, authenticator=authenticator,
                              auth_require_tls=False)
    ctl.start()
    return ctl


def test_smtp_auth_password_from_env_never_in_errors(monkeypatch):
    handler = Recorder()
    ctl = smtp_with_login(handler)
    try:
        monkeypatch.setenv("PAYRUN_SMTP_PASSWORD", "s3cret-pw")
        t = transport_for(f"smtp://payroll@127.0.0.1:{ctl.port}", 5)
        assert "s3cret" not in repr(t)
        t.send(make_msg())
        assert len(handler.messages) == 1

        bad = transport_for(f"smtp://payroll:wr0ng-pw@127.0.0.1:{ctl.port}", 5)
        assert "wr0ng" not in repr(bad)
        # a wrong password fails every send alike: an outage (pause, probe), not one slip's
        # permanent failure (a token expired at 02:00 failed the whole run, 40 slips a second)
        with pytest.raises(AccountRefused) as ei:
            bad.send(make_msg())
        assert "535" in str(ei.value) and "wr0ng" not in str(ei.value)
        assert "check PAYRUN_SMTP_PASSWORD" in str(ei.value) and counts_as_provider_failure(ei.value)
    finally:
        ctl.stop()


def test_a_wrong_smtp_password_is_one_failed_login_per_send_not_one_per_mechanism():
    """smtplib tried PLAIN, then LOGIN, after a refused password: two failed logins per
    send (and per `payrun check`), which mail servers count toward locking the account."""
    handler = Recorder()
    tries = []
    ctl = smtp_with_login(handler, tries)
    try:
        with pytest.raises(AccountRefused):
            transport_for(f"smtp://payroll:wr0ng-pw@127.0.0.1:{ctl.port}", 5).send(make_msg())
        assert len(tries) == 1, tries
        with pytest.raises(ValueError, match="login refused"):
            transport_for(f"smtp://payroll:wr0ng-pw@127.0.0.1:{ctl.port}", 5).probe()
        assert len(tries) == 2, tries
        transport_for(f"smtp://payroll:s3cret-pw@127.0.0.1:{ctl.port}", 5).send(make_msg())
        assert len(handler.messages) == 1 and len(tries) == 3
    finally:
        ctl.stop()


def test_a_mechanism_the_server_does_not_take_after_all_is_followed_by_the_next():
    """A server that offers a mechanism and then refuses it (504/534/538) still gets the
    next one; refused credentials (535) end the login."""
    import smtplib

    from jobs import mail

    class Server(mail._CutSocket):
        def __init__(self, replies):
            self.replies, self.asked = dict(replies), []
            self.esmtp_features = {"auth": "CRAM-MD5 PLAIN LOGIN"}

        def ehlo_or_helo_if_needed(self):
            pass

        def has_extn(self, name):
            return name == "auth"

        def auth(self, mechanism, authobject, *, initial_response_ok=True):
            self.asked.append(mechanism)
            code = self.replies[mechanism]
            if code not in (235, 503):
                raise smtplib.SMTPAuthenticationError(code, b"no")
            return code, b"ok"

    s = Server({"CRAM-MD5": 504, "PLAIN": 534, "LOGIN": 235})
    assert s.login("u", "p") == (235, b"ok") and s.asked == ["CRAM-MD5", "PLAIN", "LOGIN"]
    s = Server({"CRAM-MD5": 535, "PLAIN": 235, "LOGIN": 235})
    with pytest.raises(smtplib.SMTPAuthenticationError):
        s.login("u", "p")
    assert s.asked == ["CRAM-MD5"]
    s = Server({"CRAM-MD5": 538, "PLAIN": 538, "LOGIN": 538})
    with pytest.raises(smtplib.SMTPAuthenticationError) as ei:
        s.login("u", "p")
    assert ei.value.smtp_code == 538 and s.asked == ["CRAM-MD5", "PLAIN", "LOGIN"]


# ------------------------------------------------------------------ HTTP provider API

@pytest.fixture
def provider():
    p = Provider(latency_s=0.05, rate_per_s=1000).start()
    yield p
    p.stop()


def test_http_send_accepted(provider):
    t = transport_for(provider.url, 5)
    assert isinstance(t, HttpTransport)
    mid = t.send(make_msg())
    assert mid.startswith("msg-")
    rec = provider.delivery("slip:2026-11:emp-00017")
    assert rec["id"] == mid and rec["to"] == "tanvir.ahmed@meghna.example"
    [att] = rec["attachments"]
    assert att["filename"] == "slip-2026-11-emp-00017.pdf"
    assert att["size"] == len(PDF) and att["sha256"] == hashlib.sha256(PDF).hexdigest()
    t.close()


def test_http_same_key_twice_is_one_delivery(provider):
    t = transport_for(provider.url, 5)
    first = t.send(make_msg())
    second = t.send(make_msg())
    assert first == second
    st = provider.stats()
    assert (st["received"], st["delivered"], st["duplicates_refused"]) == (2, 1, 1)


def test_http_keeps_one_connection_per_thread(provider):
    t = transport_for(provider.url, 5)
    t.send(make_msg(key="k1"))
    conn = t._local.conn
    t.send(make_msg(key="k2"))
    assert t._local.conn is conn
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: t.send(make_msg(key=f"t{i}")), range(8)))
    assert len(t._all) <= 5
    t.close()
    assert provider.stats()["delivered"] == 10


def test_http_429_is_transient_with_retry_after():
    p = Provider(latency_s=0.05, rate_per_s=2).start()
    try:
        t = transport_for(p.url, 5)

        def one(i):
            try:
                return t.send(make_msg(key=f"slip:2026-11:emp-{i:05d}"))
            except Exception as e:  # noqa: BLE001
                return e

        with ThreadPoolExecutor(5) as ex:
            results = list(ex.map(one, range(5)))
        throttled = [r for r in results if isinstance(r, TransientError)]
        assert len(throttled) >= 3, results
        for e in throttled:
            assert not isinstance(e, OutcomeUnknown)
            assert e.retry_after_s is not None and e.retry_after_s >= 1
            assert "429" in str(e)
        assert sum(isinstance(r, str) for r in results) == 2
        assert p.stats()["throttled_429"] == len(throttled)
    finally:
        p.stop()


def test_http_outage_is_transient(provider):
    provider.outage(60, 503)
    t = transport_for(provider.url, 5)
    with pytest.raises(TransientError) as ei:
        t.send(make_msg())
    assert not isinstance(ei.value, OutcomeUnknown) and "503" in str(ei.value)
    provider.end_outage()
    assert t.send(make_msg())
    assert provider.stats()["outage_5xx"] == 1


@pytest.mark.parametrize("addr", ["nobody@meghna.invalid", "no-at-sign.example", "a b@meghna.example"])
def test_http_invalid_address_is_permanent(provider, addr):
    with pytest.raises(PermanentError) as ei:
        transport_for(provider.url, 5).send(make_msg(to=addr))
    assert "422" in str(ei.value) and "invalid recipient address" in str(ei.value)
    assert provider.stats()["rejected"] == 1


def test_http_connection_refused_is_transient():
    with pytest.raises(TransientError) as ei:
        transport_for(f"http://127.0.0.1:{closed_port()}", 2).send(make_msg())
    assert not isinstance(ei.value, OutcomeUnknown)
    assert "refused" in str(ei.value)


def test_http_token_from_env(monkeypatch):
    p = Provider(latency_s=0, rate_per_s=100, token="tok-abc123").start()
    try:
        with pytest.raises(AccountRefused) as ei:
            transport_for(p.url, 5).send(make_msg())
        assert "401" in str(ei.value) and "refused our credentials" in str(ei.value)
        assert counts_as_provider_failure(ei.value) and classify(ei.value).transient
        monkeypatch.setenv("PAYRUN_EMAIL_TOKEN", "tok-abc123")
        t = transport_for(p.url, 5)
        assert "tok-abc123" not in repr(t)
        assert t.send(make_msg())
        monkeypatch.setenv("PAYRUN_EMAIL_TOKEN", "tok-abc123\nline-two")  # (http.client's error would quote it)
        with pytest.raises(ValueError) as ei:
            transport_for(p.url, 5)
        assert "not one line of printable ASCII" in str(ei.value) and "tok-abc" not in str(ei.value)
    finally:
        p.stop()


class RawServer:
    """Accepts connections and reads one HTTP request on each, then does ``mode``:
    'close' = hang up without answering; 'hang' = never answer;
    'once' = answer 202 (keep-alive, no Connection: close) then hang up."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _read_request(self, c: socket.socket) -> bool:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = c.recv(65536)
            if not chunk:
                return False
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(body) < length:
            chunk = c.recv(65536)
            if not chunk:
                return False
            body += chunk
        return True

    def _loop(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if not self._read_request(c):
                c.close()
                continue
            self.requests += 1
            if self.mode == "close":
                c.close()
            elif self.mode == "once":
                body = b'{"id": "raw-%d", "duplicate": false}' % self.requests
                c.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                c.close()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_http_closed_after_request_is_outcome_unknown():
    srv = RawServer("close")
    try:
        with pytest.raises(OutcomeUnknown) as ei:
            transport_for(f"http://127.0.0.1:{srv.port}", 5).send(make_msg())
        assert "may have been delivered" in str(ei.value)
        assert srv.requests == 1  # a fresh connection: not retried
    finally:
        srv.close()


def test_http_timeout_after_request_is_outcome_unknown():
    srv = RawServer("hang")
    try:
        start = time.monotonic()
        with pytest.raises(OutcomeUnknown):
            transport_for(f"http://127.0.0.1:{srv.port}", 0.5).send(make_msg())
        assert time.monotonic() - start < 1.5
    finally:
        srv.close()


class Trickler:
    """A server on 127.0.0.1 that answers one byte at a time, each well inside a socket
    timeout: an SMTP greeting, or (after reading a request) an HTTP status line, that
    never ends. Stops at close() or after 60 s. ``_serve`` is what it does with its one
    connection (QuitTrickler: an SMTP session whose QUIT reply trickles)."""

    def __init__(self, answer: bytes = b"", read_request: bool = False, every_s: float = 0.2):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.answer, self.read_request, self.every_s = answer, read_request, every_s
        self.stop = threading.Event()
        self.end = time.monotonic() + 60
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        try:
            c, _ = self.sock.accept()
        except OSError:
            return
        with c:
            self._serve(c)

    def _serve(self, c: socket.socket) -> None:
        if self.read_request:
            c.recv(65536)
        self.trickle(c, self.answer)

    def trickle(self, c: socket.socket, answer: bytes) -> None:
        for byte in answer * 1000:
            if self.stop.wait(self.every_s) or time.monotonic() > self.end:
                return
            try:
                c.sendall(bytes([byte]))
            except OSError:
                return

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("scheme", ["smtp", "http"])
def test_a_send_ends_at_its_timeout_however_slowly_the_server_trickles(scheme):
    """Security review (session 31): a socket timeout bounds each read, not a reply. A server
    answering a byte every 0.2 s (the SMTP greeting; the HTTP status line) held a 2 s send
    for minutes, and its lane with it. The send's socket is now shut at its deadline."""
    from jobs.mail import CUTOFF_MARGIN_S

    # a byte every 0.6 s: at the cut (1.5 s) the reply's code is torn ("22"), as a trickle's would be
    srv = Trickler(b"220 slow.example ESMTP " if scheme == "smtp" else b"HTTP/1.1 202 Accepted",
                   read_request=scheme == "http", every_s=0.6)
    try:
        start = time.monotonic()
        expected = TransientError if scheme == "smtp" else OutcomeUnknown  # (before / after the message)
        with pytest.raises(expected, match="timed out") as ei:
            transport_for(f"{scheme}://127.0.0.1:{srv.port}", 1.0).send(make_msg())
        took = time.monotonic() - start
        assert took < 1.0 + CUTOFF_MARGIN_S + 1.0, took
        assert isinstance(ei.value, OutcomeUnknown) == (scheme == "http")
    finally:
        srv.close()


class QuitTrickler(Trickler):
    """An SMTP server on 127.0.0.1 that takes the message at once, then answers QUIT a
    byte every 0.5 s (continuation lines, each byte inside the 2 s quit timeout).
    Stops at close() or after 60 s."""

    delivered = 0

    def __init__(self):
        super().__init__(every_s=0.5)

    def _serve(self, c: socket.socket) -> None:
        with c.makefile("rb") as f:
            c.sendall(b"220 ok\r\n")
            while not self.stop.is_set() and time.monotonic() < self.end:
                cmd = f.readline().strip().upper()
                if not cmd:
                    return
                if cmd.startswith((b"EHLO", b"HELO", b"MAIL", b"RCPT")):
                    c.sendall(b"250 ok\r\n")
                elif cmd == b"DATA":
                    c.sendall(b"354 go\r\n")
                    while f.readline() not in (b".\r\n", b""):
                        pass
                    self.delivered += 1
                    c.sendall(b"250 queued\r\n")
                elif cmd == b"QUIT":
                    return self.trickle(c, b"221-bye\r\n")


def test_a_trickled_quit_holds_a_delivered_send_no_longer_than_its_quit_timeout():
    """Review (session 31): the QUIT after a delivered message ran after the send's cutoff
    was disarmed, so a server trickling its QUIT reply held the send (and its lane) for as
    long as it liked. The QUIT has a cutoff of its own; the send is still a success."""
    srv = QuitTrickler()
    try:
        start = time.monotonic()
        assert transport_for(f"smtp://127.0.0.1:{srv.port}", 2).send(make_msg())
        assert time.monotonic() - start < 2 + 0.5 + 1.5 and srv.delivered == 1
    finally:
        srv.close()


def test_a_connection_made_after_the_deadline_is_cut_before_its_greeting(monkeypatch):
    """Review (session 31): a cut that fired while smtplib was still connecting (a first
    address that black-holes for the whole timeout, then the next one answers) found no
    socket to shut, and the greeting was then read without bound. The connection is now
    adopted as it is made, and one made after the deadline is shut at once."""
    srv = Trickler(b"220 slow.example ESMTP ", read_request=False, every_s=0.6)
    real = socket.create_connection

    def slow_connect(address, timeout=None, *args, **kwargs):  # the simulated slow network
        time.sleep(1.0 + 0.7)  # past the 1 s deadline and its cutoff's margin
        return real(address, timeout, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", slow_connect)
    try:
        start = time.monotonic()
        with pytest.raises(TransientError, match="timed out before the message was sent"):
            transport_for(f"smtp://127.0.0.1:{srv.port}", 1.0).send(make_msg())
        assert time.monotonic() - start < 1.7 + 1.5
    finally:
        srv.close()


HANGING_NAME = "dns-hangs.example"


@pytest.fixture
def hanging_dns(monkeypatch):
    """A resolver that never answers for HANGING_NAME (until the test ends), as a broken
    nameserver behind glibc's retries does; every other lookup is the real one."""
    real = socket.getaddrinfo
    release = threading.Event()

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host == HANGING_NAME:
            if flags & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            release.wait(30)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    release.set()


@pytest.mark.parametrize("scheme", ["smtp", "http"])
def test_a_send_ends_at_its_timeout_when_the_name_lookup_hangs(hanging_dns, scheme):
    """getaddrinfo takes no timeout, and a job's timeout cannot interrupt it (C code): a
    lane stuck in a lookup stayed stuck past its send's deadline (session 31's note). The
    lookup now runs on a resolver thread, waited for until the deadline; the send fails as
    host trouble (retried, no attempt of the slip's lost to a permanent error)."""
    start = time.monotonic()
    with pytest.raises(TransientError, match="timed out"):
        transport_for(f"{scheme}://{HANGING_NAME}:2525", 1.0).send(make_msg())
    assert 0.9 < time.monotonic() - start < 1.0 + 1.0  # (it waited for the lookup, up to the deadline)


@pytest.mark.parametrize("scheme", ["smtp", "http"])
def test_a_slow_lookup_leaves_the_connects_only_what_is_left_of_the_send(monkeypatch, scheme):
    """Review (session 32): each address was given the whole send timeout to connect,
    counted from before the lookup. A name answered late, with two addresses that drop
    connection attempts, held the lane ~3x its timeout (the cutoff adopts a socket only
    once it is connected)."""
    real_lookup, real_connect = socket.getaddrinfo, socket.create_connection
    black_holes = {"127.0.0.3", "127.0.0.4"}

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host == "slow-name.example":
            if flags & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            time.sleep(0.5)  # the simulated slow nameserver
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in sorted(black_holes)]
        return real_lookup(host, port, family, type, proto, flags)

    def create_connection(address, timeout=None, *args, **kwargs):
        if address[0] in black_holes:  # the simulated network that drops the SYN: waits out its timeout
            time.sleep(timeout)
            raise TimeoutError("timed out")
        return real_connect(address, timeout, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    start = time.monotonic()
    with pytest.raises(TransientError, match="timed out"):
        transport_for(f"{scheme}://slow-name.example:2525", 1.0).send(make_msg())
    assert time.monotonic() - start < 1.0 + 0.5  # not 0.5 + 1 + 1


def test_a_send_to_a_name_tries_each_address_it_resolves_to(smtpd, monkeypatch):
    """A name (not an address) is looked up on the resolver threads, and its addresses are
    tried in turn as socket.create_connection does: the first one here refuses."""
    port = int(smtpd.url.rsplit(":", 1)[1])
    real = socket.getaddrinfo

    def getaddrinfo(host, port_, family=0, type=0, proto=0, flags=0):
        if host == "mail.payrun.test":
            if flags & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            tried.append(threading.current_thread().name)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", closed_port())),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port_))]
        return real(host, port_, family, type, proto, flags)

    tried: list[str] = []
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    transport_for(f"smtp://mail.payrun.test:{port}", 5).send(make_msg())
    assert len(smtpd.messages) == 1
    assert tried and tried[0].startswith("dns-")  # (on a resolver thread, not the lane's)


def test_a_send_that_ends_leaves_no_cutoff_armed(provider, smtpd):
    """Each send disarms its cutoff as it ends, however it ends (jobs.watchdog: once
    disarmed it cannot fire), so no connection kept alive is shut later."""
    from jobs.watchdog import WATCHDOG

    before = WATCHDOG.pending()
    t = transport_for(provider.url, 5)
    t.send(make_msg(key="slip:2026-11:a"))
    conn = t._local.conn
    t.send(make_msg(key="slip:2026-11:b"))
    assert t._local.conn is conn  # kept alive, not cut
    transport_for(smtpd.url, 5).send(make_msg(key="slip:2026-11:c"))
    with pytest.raises(TransientError):
        transport_for(f"smtp://127.0.0.1:{closed_port()}", 2).send(make_msg())
    assert WATCHDOG.pending() == before


@pytest.mark.parametrize("precheck", [True, False])
def test_http_dead_keepalive_connection_is_retried_once(monkeypatch, precheck):
    if not precheck:  # the server closes between our idle check and the request: retry path
        monkeypatch.setattr("jobs.mail._peer_closed", lambda sock: False)
    srv = RawServer("once")
    try:
        t = transport_for(f"http://127.0.0.1:{srv.port}", 5)
        assert t.send(make_msg(key="a")) == "raw-1"
        wait_for(lambda: srv.requests == 1)
        assert t.send(make_msg(key="b")) == "raw-2"  # old connection dead -> fresh one
    finally:
        srv.close()


def test_message_repr_has_no_body():
    r = repr(make_msg())
    assert "Dear Tanvir" not in r and "PDF" not in r


def test_transport_for_rejects_unknown_scheme_without_password():
    with pytest.raises(ValueError) as ei:
        transport_for("ftp://u:hunter2@host", 5)
    assert "hunter2" not in str(ei.value)
    with pytest.raises(ValueError):
        transport_for("smtp://user@host:25", 5)  # user without password, none in env


@pytest.fixture
def tls_files(tmp_path):
    import shutil
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("openssl binary not available to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.mark.parametrize("mode", ["starttls", "smtps"])
def test_smtp_tls_modes(tls_files, monkeypatch, mode):
    import ssl

    cert, key = tls_files
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    handler = Recorder()
    kw = {"tls_context": ctx, "require_starttls": True} if mode == "starttls" else {"ssl_context": ctx}
    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0, **kw)
    ctl.start()
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the test certificate
        url = (f"smtp://127.0.0.1:{ctl.port}?starttls=1" if mode == "starttls"
               else f"smtps://127.0.0.1:{ctl.port}")
        transport_for(url, 5).send(make_msg())
        assert len(handler.messages) == 1
    finally:
        ctl.stop()


# ------------------------------------------------------------------ Redis away after a send

class _AwayFor:
    """A Redis client that does not answer the first ``n`` scripts (restarting), then
    passes everything to the real one."""

    def __init__(self, conn, n: int):
        self.conn, self.n, self.refused = conn, n, 0

    def evalsha(self, *args):
        import redis

        if self.refused < self.n:
            self.refused += 1
            raise redis.ConnectionError("Error 2 connecting to redis.sock. No such file or directory.")
        return self.conn.evalsha(*args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_made_send_waits_for_redis_to_record_it_and_gives_up_only_when_its_job_has_no_time_left(conn, cfg, caplog):
    """The provider accepted the message, then Redis went away (a restart): the record is
    tried again with short waits until Redis answers, so the job ends done and its slip's
    key reads sent (the job is not failed and sent again by its next try). With no time
    left before the job's timeout, the Redis error goes up as before, and the log says the
    slip will be sent again."""
    from jobs import idempotency, tasks
    from jobs.limits import email_limiter
    from payrun import config as config_mod

    lim = email_limiter(conn, config_mod.load())
    key, token = "slip:2026-11:emp-00021", "email-2026-11-emp-00021:1"
    assert idempotency.claim(conn, key, token, 60) == idempotency.OK
    now = [100.0]
    waits: list[float] = []

    def pause(s):
        waits.append(s)
        now[0] += s

    away = _AwayFor(conn, n=8)  # (each record tries twice: a dropped connection gets one more go at once)
    with caplog.at_level("WARNING", logger="payrun.jobs"):
        tasks._record_sent(away, key, token, "<m1@payrun>", lim, record_by=130.0, clock=lambda: now[0], pause=pause)
    assert away.refused == 8 and waits == [0.1, 0.2, 0.4, 0.8]
    assert idempotency.state(conn, key)["state"] == "sent"
    assert "recording it once Redis is back" in caplog.text and "recorded as sent after waiting 1.5 s" in caplog.text
    assert "2026-11:emp-00021" in caplog.text and "salary" not in caplog.text.lower()

    key2, token2 = "slip:2026-11:emp-00022", "email-2026-11-emp-00022:1"
    assert idempotency.claim(conn, key2, token2, 60) == idempotency.OK
    now[0], waits[:] = 100.0, []
    import redis

    with caplog.at_level("WARNING", logger="payrun.jobs"), pytest.raises(redis.ConnectionError):
        tasks._record_sent(_AwayFor(conn, n=10**6), key2, token2, "<m2@payrun>", lim, record_by=102.5,
                           clock=lambda: now[0], pause=pause)
    assert sum(waits) == pytest.approx(2.5)  # up to the deadline, not past it
    assert idempotency.state(conn, key2)["state"] == "sending"  # unrecorded: its next try claims it again
    assert "delivered, but Redis did not answer to record it" in caplog.text
    # ... and finds this host's note of the delivery, rather than send it again
    from jobs import unrecorded

    assert "its send-email process records it once Redis answers" in caplog.text
    assert unrecorded.find(cfg.home, key2) == "<m2@payrun>" and unrecorded.find(cfg.home, key) is None
    assert oct((cfg.home / unrecorded.FILE).stat().st_mode & 0o777) == "0o600"


def test_a_stop_by_force_records_a_made_send_that_waits_for_redis_before_handing_it_back(conn):
    """Review of d3880c0/702521e: a forced stop (a second SIGTERM, the grace run out) in the
    moment between Redis coming back and the lane's next record try handed the job back
    and freed its claim: the next try sent the slip again. The forced stop now records the
    waiting send first (jobs.tasks.record_pending) and leaves the job to the reaper if
    Redis still does not answer."""
    from jobs import idempotency, tasks
    from jobs.limits import email_limiter
    from payrun import config as config_mod

    lim = email_limiter(conn, config_mod.load())
    job_id = "email-2026-11-emp-00031"
    key, token = "slip:2026-11:emp-00031", f"{job_id}:1"
    assert idempotency.claim(conn, key, token, 60) == idempotency.OK
    assert tasks.record_pending(job_id) is None  # nothing waits
    away = _AwayFor(conn, n=10**6)
    seen: list = []

    def pause(s):  # the lane waits; meanwhile the worker is stopped by force
        seen.append(tasks.record_pending(job_id))  # Redis away for the lane's connection...
        away.refused = away.n  # ... and back now
        raise SystemExit  # the lane dies with the process

    with pytest.raises(SystemExit):
        tasks._record_sent(away, key, token, "<m3@payrun>", lim, record_by=130.0, clock=lambda: 100.0, pause=pause)
    assert seen == [False]  # the first look: the waiting send's connection still refused
    assert idempotency.state(conn, key)["state"] == "sending"
    assert tasks.record_pending(job_id) is None  # forgotten once the lane gave up
    tasks._RECORDING[job_id] = (conn, key, token, "<m3@payrun>", lim.outage_keys())  # as left by a waiting lane
    assert tasks.record_pending(job_id) is True
    assert idempotency.state(conn, key)["state"] == "sent"
    idempotency.release(conn, key, token)  # what requeue_front does next: a sent key stays sent
    assert idempotency.state(conn, key)["state"] == "sent"
    tasks._RECORDING.clear()


def test_a_lanes_connection_dropped_by_a_redis_restart_costs_the_claim_no_attempt(conn):
    """A send lane holds one Redis connection; after a Redis restart its first command
    finds it closed. The claim (like every idempotency script: the same outcome when run
    twice for one owner) is tried once more on a new connection instead of failing the
    job's attempt. Redis really away: the error still goes up."""
    import redis

    from jobs import idempotency

    key, token = "slip:2026-11:emp-00023", "email-2026-11-emp-00023:1"
    stale = _AwayFor(conn, n=1)
    assert idempotency.claim(stale, key, token, 60) == idempotency.OK and stale.refused == 1
    assert idempotency.claim(_AwayFor(conn, n=1), key, token, 60) == idempotency.OK  # again, same owner: same answer
    with pytest.raises(redis.ConnectionError):
        idempotency.claim(_AwayFor(conn, n=2), key, "email-2026-11-emp-00023:2", 60)
    assert idempotency.state(conn, key)["owner"] == token


# ------------------------------------------------------------------ a stalled sender

def test_a_sender_that_stalled_past_its_claim_does_not_send_over_smtp(smtpd, cfg, conn, monkeypatch):
    """Attempt 1 claims the slip's key, then stalls (a paused VM, a stopped process) past
    the claim's TTL; attempt 2 claims the key and sends. When attempt 1 wakes, it must not
    write its message: over SMTP nobody would dedupe the second copy. (With a stall between
    the check before the connection and DATA, the check just before DATA stops it:
    tests/test_payrun.py has the stall inside a real lane, the reaper taking the job over.)"""
    from jobs import idempotency, tasks
    from jobs.errors import ClaimLost
    from payrun import keys

    monkeypatch.setenv("PAYRUN_EMAIL_URL", smtpd.url)
    tasks.settings.cache_clear()
    monkeypatch.setattr(tasks, "_limiters", {})
    monkeypatch.setattr(tasks, "_transports", {})
    settings = tasks.settings()
    key, first, second = "slip:2026-11:emp-00017", "email-2026-11-emp-00017:1", "email-2026-11-emp-00017:2"
    msg = make_msg(key=key)
    try:
        assert idempotency.claim(conn, key, first, 60) == idempotency.OK
        conn.delete(keys.idem_state(key))  # attempt 1's claim ran out while it stalled ...
        assert idempotency.claim(conn, key, second, 60) == idempotency.OK  # ... and attempt 2 took it
        with pytest.raises(ClaimLost):
            tasks.send_limited(conn, settings, msg, key, first)  # attempt 1 wakes up
        assert smtpd.messages == []
        lim = tasks.limiter(conn)  # and it is not the provider's doing: nobody pauses, no failure counted
        assert not conn.exists(lim.k_pause)
        assert not int(conn.hget(lim.k_outage, "streak") or 0)
        assert idempotency.state(conn, key) == {"state": "sending", "owner": second}  # left to attempt 2

        conn.expire(keys.idem_state(key), 5)  # attempt 2 holds its claim: renewed before DATA
        ttl_at_data = []
        smtpd.on_data = lambda: ttl_at_data.append(conn.ttl(keys.idem_state(key)))
        assert tasks.send_limited(conn, settings, msg, key, second)
        assert len(smtpd.messages) == 1
        assert ttl_at_data and ttl_at_data[0] > 60, ttl_at_data  # 90 s again, not the 5 left
        assert idempotency.state(conn, key)["state"] == "sent"
        with pytest.raises(ClaimLost):  # and a stalled attempt that wakes after the send: nothing either
            tasks.send_limited(conn, settings, msg, key, first)
        assert len(smtpd.messages) == 1

        # the stall comes later, during the SMTP exchange (after the check before the
        # connection): the check just before DATA calls it off, and the session ends
        key2, mine, theirs = "slip:2026-11:emp-00019", "email-2026-11-emp-00019:1", "email-2026-11-emp-00019:2"
        assert idempotency.claim(conn, key2, mine, 60) == idempotency.OK

        def taken_over_meanwhile():
            conn.delete(keys.idem_state(key2))
            idempotency.claim(conn, key2, theirs, 60)

        smtpd.on_rcpt = taken_over_meanwhile
        with pytest.raises(ClaimLost):
            tasks.send_limited(conn, settings, make_msg(key=key2), key2, mine)
        assert len(smtpd.messages) == 1  # still only attempt 2's of the first slip
        assert idempotency.state(conn, key2)["owner"] == theirs
    finally:
        tasks.settings.cache_clear()


def test_holding_a_claim_renews_only_its_owners(conn):
    from jobs import idempotency
    from payrun import keys

    key = "slip:2026-11:emp-00018"
    assert idempotency.claim(conn, key, "a:1", 5) == idempotency.OK
    assert idempotency.hold(conn, key, "a:1", 120)
    assert 100 < conn.ttl(keys.idem_state(key)) <= 120
    assert not idempotency.hold(conn, key, "b:1", 300)  # not its claim: untouched
    assert conn.ttl(keys.idem_state(key)) <= 120
    idempotency.mark_sent(conn, key, "a:1", "mid-1")
    assert not idempotency.hold(conn, key, "a:1", 120)  # sent: nothing left to hold
    conn.delete(keys.idem_state(key))
    assert not idempotency.hold(conn, key, "a:1", 120)  # ran out


def test_the_note_of_an_unrecorded_delivery_survives_a_line_cut_short(tmp_path):
    """A full disk cut the previous note short: the next note still starts on a line of its
    own and is found (it was appended to the torn line, and both were lost)."""
    from jobs import unrecorded

    unrecorded.remember(tmp_path, "slip:2026-11:emp-1", "<m1>")
    path = tmp_path / unrecorded.FILE
    path.write_bytes(path.read_bytes() + b'{"key": "slip:2026-11:emp-2", "mess')  # cut short
    unrecorded.remember(tmp_path, "slip:2026-11:emp-3", "<m3>")
    assert unrecorded.find(tmp_path, "slip:2026-11:emp-1") == "<m1>"
    assert unrecorded.find(tmp_path, "slip:2026-11:emp-3") == "<m3>"
    assert [e["key"] for e in unrecorded.pending(tmp_path)] == ["slip:2026-11:emp-1", "slip:2026-11:emp-3"]
    unrecorded.forget(tmp_path, "slip:2026-11:emp-1")
    unrecorded.forget(tmp_path, "slip:2026-11:emp-3")
    assert not path.exists()


def test_recording_the_notes_records_each_and_keeps_what_redis_did_not_take(tmp_path, conn):
    """The send-email process records a host's notes in Redis once it answers
    (jobs.tasks.record_noted): a key nobody recorded becomes sent with the noted message id,
    even under another attempt's claim (whose hold then fails: it stops unsent); a key
    recorded sent meanwhile keeps its own record. A Redis that fails part-way leaves the
    notes it did not take, for the next call."""
    import redis as redis_mod

    from jobs import idempotency, tasks, unrecorded

    k1, k2, k3 = (f"slip:2026-11:emp-0009{i}" for i in (1, 2, 3))
    for k, m in ((k1, "<m1>"), (k2, "<m2>"), (k3, "<m3>")):
        unrecorded.remember(tmp_path, k, m)
    assert idempotency.claim(conn, k2, "send-k2:2", 300) == idempotency.OK  # a retry about to send it again
    idempotency.mark_sent(conn, k3, "send-k3:2", "<m3-resent>")  # recorded sent meanwhile

    assert tasks.record_noted(conn, tmp_path) == 3
    assert not (tmp_path / unrecorded.FILE).exists()
    s1, s2, s3 = (idempotency.state(conn, k) for k in (k1, k2, k3))
    assert (s1["state"], s1["message_id"]) == ("sent", "<m1>") and s1["owner"].startswith("noted on ")
    assert (s2["state"], s2["message_id"]) == ("sent", "<m2>")
    assert not idempotency.hold(conn, k2, "send-k2:2", 300)  # that retry stops before it writes
    assert idempotency.claim(conn, k1, "another-host:3", 300) == idempotency.SENT  # any host: nothing to send
    assert (s3["message_id"], s3["owner"]) == ("<m3-resent>", "send-k3:2")

    # Redis fails after the first note: that one is recorded and dropped, the rest kept
    for k, m in ((k1, "<m1>"), (k2, "<m2>"), (k3, "<m3>")):
        conn.delete(f"payrun:idem:{k}")
        unrecorded.remember(tmp_path, k, m)
    calls = []
    real = idempotency.mark_noted

    def fails_after_one(conn_, key, message_id, owner):
        calls.append(key)
        if len(calls) > 1:
            raise redis_mod.ConnectionError("Error 111 connecting (test: Redis away again)")
        return real(conn_, key, message_id, owner)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(idempotency, "mark_noted", fails_after_one)
        assert tasks.record_noted(conn, tmp_path) == 1
    assert [e["key"] for e in unrecorded.pending(tmp_path)] == [k2, k3]
    assert idempotency.state(conn, k1)["state"] == "sent" and idempotency.state(conn, k2) == {}
    assert tasks.record_noted(conn, tmp_path) == 2
    assert unrecorded.pending(tmp_path) == []


def test_dropping_recorded_notes_keeps_a_later_note_of_the_same_key(tmp_path):
    from jobs import unrecorded

    unrecorded.remember(tmp_path, "slip:2026-11:emp-1", "<m1>")
    unrecorded.remember(tmp_path, "slip:2026-11:emp-1", "<m1-later>")
    unrecorded.drop(tmp_path, [("slip:2026-11:emp-1", "<m1>")])
    assert [e["message_id"] for e in unrecorded.pending(tmp_path)] == ["<m1-later>"]
    assert oct((tmp_path / unrecorded.FILE).stat().st_mode & 0o777) == "0o600"


# ---- the provider's name: looked up once per DNS_REUSE_S, kept for a failing resolver ----

@pytest.fixture(autouse=True)
def _fresh_addresses():
    """No test sees addresses another test's (patched) resolver gave."""
    from jobs import mail

    mail.forget_addresses()
    yield
    mail.forget_addresses()


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class _Start:
    """A resolver for _Answers (its ``start``): answers from ``self.answer`` (a list, or an
    exception), at once, or, with ``hold`` set, when the test calls ``land()``. Records
    each lookup started."""

    def __init__(self):
        self.answer: object = [("addr", 1)]
        self.hold = False
        self.calls: list[str] = []
        self.pending: list = []

    def __call__(self, host: str, port: int, done) -> None:
        self.calls.append(host)
        if self.hold:
            self.pending.append(done)
        else:
            self._answer(done)

    def _answer(self, done) -> None:
        if isinstance(self.answer, BaseException):
            done(None, self.answer)
        else:
            done(self.answer, None)

    def land(self) -> None:
        """The lookups held so far end now, with ``self.answer``."""
        pending, self.pending = self.pending, []
        for done in pending:
            self._answer(done)


class _Wait:
    """_Answers' wait on the fake clock: an answer already in is taken at once; otherwise the
    whole time passes (the clock moves on) with no answer. Records each wait's seconds."""

    def __init__(self, clock: _Clock):
        self.clock = clock
        self.seconds: list[float] = []

    def __call__(self, event: threading.Event, seconds: float) -> bool:
        self.seconds.append(seconds)
        if event.is_set():
            return True
        self.clock.t += seconds
        return False


def _answers():
    from jobs.mail import _Answers

    clock = _Clock()
    wait = _Wait(clock)
    return _Answers(clock, wait), clock, wait, _Start()


def test_a_name_is_looked_up_once_per_reuse_period_not_once_per_send():
    from jobs.mail import DNS_REUSE_S, DNS_STALE_WAIT_S

    answers, clock, wait, start = _answers()
    for _ in range(40):  # a second of sends at the provider's limit
        assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]
    assert len(start.calls) == 1
    assert answers.lookup("other.example", 25, 5.0, start) == [("addr", 1)]  # each name its own
    assert len(start.calls) == 2
    clock.t += DNS_REUSE_S - 0.1
    answers.lookup("mail.example", 25, 5.0, start)
    assert len(start.calls) == 2
    clock.t += 0.2
    start.answer = [("new-addr", 1)]
    assert answers.lookup("mail.example", 25, 5.0, start) == [("new-addr", 1)]  # looked up again
    assert wait.seconds[0] == 5.0  # the first: nothing to fall back on, the whole time left
    assert wait.seconds[-1] == DNS_STALE_WAIT_S  # then: the last addresses if it is slow


def test_a_failing_resolver_is_answered_from_the_last_addresses_then_retried_later(caplog):
    from jobs.mail import DNS_RETRY_S, DNS_REUSE_S, DNS_STALE_WAIT_S

    answers, clock, wait, start = _answers()
    answers.lookup("mail.example", 25, 5.0, start)
    clock.t += DNS_REUSE_S + 1
    start.answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    with caplog.at_level("WARNING", logger="jobs.mail"):
        assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]
    assert wait.seconds[-1] == DNS_STALE_WAIT_S  # not the send's whole 5 s
    assert "looking up mail.example failed" in caplog.text and "trying again in" in caplog.text
    calls = len(start.calls)
    for _ in range(100):  # the sends meanwhile: no lookup, no warning each
        assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]
    assert len(start.calls) == calls
    clock.t += DNS_RETRY_S
    start.answer = [("addr", 2)]
    assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 2)]  # the resolver is back
    assert len(start.calls) == calls + 1


def test_addresses_too_old_are_not_used_and_a_name_never_resolved_fails_its_send():
    from jobs.mail import DNS_STALE_S

    answers, clock, wait, start = _answers()
    start.answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    with pytest.raises(socket.gaierror):
        answers.lookup("never.example", 25, 5.0, start)
    with pytest.raises(socket.gaierror):  # no answer kept from a failure: the next send looks it up too
        answers.lookup("never.example", 25, 5.0, start)
    assert len(start.calls) == 2
    start.answer = [("addr", 1)]
    answers.lookup("mail.example", 25, 5.0, start)
    clock.t += DNS_STALE_S + 1
    start.hold = True  # (a resolver that does not answer)
    with pytest.raises(socket.timeout, match="took longer than the send's 5.0 s left"):
        answers.lookup("mail.example", 25, 5.0, start)
    start.land()
    start.hold = False
    assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]  # (fresh again)
    clock.t += 31
    start.answer = UnicodeError("label too long")  # not a resolver's failure: not answered from stale ones
    with pytest.raises(UnicodeError):
        answers.lookup("mail.example", 25, 5.0, start)


def test_while_one_lane_looks_a_name_up_again_the_others_use_the_last_addresses():
    from jobs.mail import DNS_REUSE_S, _Answers

    clock, start = _Clock(), _Start()
    answers = _Answers(clock)  # (real waits)
    answers.lookup("mail.example", 25, 5.0, start)
    clock.t += DNS_REUSE_S + 1
    start.hold = True
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(answers.lookup, "mail.example", 25, 5.0, start)
        deadline = time.monotonic() + 5
        while not start.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert start.pending
        assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]  # at once, not queued
        assert len(start.calls) == 2
        start.answer = [("addr", 2)]
        start.land()
        assert first.result(5) == [("addr", 2)]
    assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 2)]


def test_lanes_with_no_addresses_yet_share_one_lookup_not_one_each():
    """Review (session 34): with no answer in hand, each of 50 lanes queued a lookup of its
    own on the resolver's 4 threads; behind a 5 s resolver half of them ran out of time,
    enough failed sends in a row to pause every sender as if the provider were down."""
    from jobs.mail import _Answers

    clock, start = _Clock(), _Start()
    waiting = []

    def wait(event, seconds):
        waiting.append(seconds)
        return event.wait(seconds)

    answers = _Answers(clock, wait)
    start.hold = True
    with ThreadPoolExecutor(50) as pool:
        lanes = [pool.submit(answers.lookup, "mail.example", 25, 10.0, start) for _ in range(50)]
        deadline = time.monotonic() + 10
        while len(waiting) < 50 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(waiting) == 50  # every lane waits...
        assert start.calls == ["mail.example"]  # ...for the one lookup
        start.land()
        assert [lane.result(5) for lane in lanes] == [[("addr", 1)]] * 50


def test_a_job_timeout_before_its_lookup_starts_leaves_no_flight_behind():
    """Review (session 35): a job's timeout raised between registering a lookup and
    starting it left a flight nobody would end: every send to that name then waited for it
    and failed, for DNS_HUNG_S (30 s)."""
    answers, clock, wait, start = _answers()

    class JobTimeoutException(Exception):  # (RQ's, raised in the lane's thread)
        pass

    def cut(host, port, done):
        raise JobTimeoutException("job exceeded its timeout")

    with pytest.raises(JobTimeoutException):
        answers.lookup("mail.example", 25, 5.0, cut)
    assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]  # the next send looks it up
    assert start.calls == ["mail.example"]


def test_a_late_answer_is_kept_though_no_lane_waited_for_it(caplog):
    """Review (session 34): a lookup slower than the wait was thrown away when it came, so a
    slow resolver never refilled the cache: the lanes went on with older and older addresses
    until they were too old to use, and then every lane looked the name up again at once."""
    from jobs.mail import DNS_REUSE_S

    answers, clock, wait, start = _answers()
    start.hold = True
    with pytest.raises(socket.timeout):  # nothing in hand: that send fails...
        answers.lookup("mail.example", 25, 5.0, start)
    start.land()  # ...but its answer, coming later, is kept
    assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]
    assert len(start.calls) == 1
    clock.t += DNS_REUSE_S + 1
    with caplog.at_level("WARNING", logger="jobs.mail"):
        assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]  # slow: the last ones
    assert "no answer in 2.0 s" in caplog.text
    for _ in range(10):  # while it runs: no other lookup
        assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]
    assert len(start.calls) == 2
    start.answer = [("addr", 2)]
    start.land()
    assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 2)]  # the late answer, no new lookup
    assert len(start.calls) == 2


def test_a_lookup_that_hangs_is_started_again_after_a_while():
    from jobs.mail import DNS_HUNG_S

    answers, clock, wait, start = _answers()
    start.hold = True
    with pytest.raises(socket.timeout):
        answers.lookup("mail.example", 25, 5.0, start)
    with pytest.raises(socket.timeout):  # waits for the same lookup
        answers.lookup("mail.example", 25, 5.0, start)
    assert len(start.calls) == 1
    clock.t += DNS_HUNG_S
    with pytest.raises(socket.timeout):  # that one is hung: another is started
        answers.lookup("mail.example", 25, 5.0, start)
    assert len(start.calls) == 2
    start.land()  # both end: the answer is kept, and nothing is left in flight
    assert answers.lookup("mail.example", 25, 5.0, start) == [("addr", 1)]
    assert answers._flights == {}


def test_sends_to_a_name_go_on_through_a_resolver_outage(smtpd, monkeypatch):
    """Through a real SMTP server: the name is looked up once for many sends, and when the
    resolver then fails, the sends still go to the addresses it gave last."""
    from jobs import mail

    port = int(smtpd.url.rsplit(":", 1)[1])
    real = socket.getaddrinfo
    state = {"up": True, "lookups": 0}

    def getaddrinfo(host, port_, family=0, type=0, proto=0, flags=0):
        if host == "relay.payrun.test":
            if flags & socket.AI_NUMERICHOST:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            state["lookups"] += 1
            if not state["up"]:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port_))]
        return real(host, port_, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    t = transport_for(f"smtp://relay.payrun.test:{port}", 5)
    for i in range(3):
        t.send(make_msg(key=f"slip:2026-11:dns-{i}"))
    assert state["lookups"] == 1
    monkeypatch.setattr(mail, "DNS_REUSE_S", 0.0)  # every send looks it up again from here on
    state["up"] = False
    t.send(make_msg(key="slip:2026-11:dns-outage"))
    assert state["lookups"] == 2
    assert len(smtpd.messages) == 4


# ---- the name this host gives in EHLO: worked out once per process, never holding a send ----

@pytest.fixture
def ehlo_lookup(monkeypatch):
    """socket.getfqdn counted, answering ``state["name"]`` once ``state["go"]`` is set (set
    at the start; a test clears it to hang the lookup); a fresh process's EHLO name."""
    from jobs import mail

    state = {"calls": 0, "name": "sender.payrun.test", "go": threading.Event(), "fail": False}
    state["go"].set()

    def getfqdn(name=""):
        if threading.current_thread().name != "ehlo-name":
            return real(name)  # (aiosmtpd's, for its own greeting)
        state["calls"] += 1
        state["go"].wait(30)
        if state["fail"]:
            raise OSError("resolver gone")
        return state["name"]

    real = socket.getfqdn

    monkeypatch.setattr(mail, "_ehlo", None)
    monkeypatch.setattr(socket, "getfqdn", getfqdn)
    yield state
    state["go"].set()


def test_the_ehlo_name_is_worked_out_once_per_process_not_once_per_send(smtpd, ehlo_lookup):
    """Review (session 34): smtplib looked this host's name up (socket.getfqdn) on every
    connection, outside the send's deadline and the resolver's cache."""
    t = transport_for(smtpd.url, 5)
    for i in range(3):
        t.send(make_msg(key=f"slip:2026-11:ehlo-{i}"))
    assert ehlo_lookup["calls"] == 1
    assert smtpd.ehlo_names == ["sender.payrun.test"] * 3


def test_a_hanging_host_name_lookup_does_not_hold_a_send(smtpd, ehlo_lookup):
    from jobs import mail

    ehlo_lookup["go"].clear()  # the lookup hangs
    start = time.monotonic()
    t = transport_for(smtpd.url, 5)
    t.send(make_msg(key="slip:2026-11:ehlo-hangs"))
    assert time.monotonic() - start < mail.EHLO_NAME_WAIT_S + 1.5  # waited 2 s for it, not the send's 5 or more
    assert smtpd.ehlo_names == ["[127.0.0.1]"]  # (the connection's own address, no lookup)
    start = time.monotonic()
    t.send(make_msg(key="slip:2026-11:ehlo-hangs-2"))  # still hung: the next send does not wait for it again
    assert time.monotonic() - start < mail.EHLO_NAME_WAIT_S / 2
    assert smtpd.ehlo_names[-1] == "[127.0.0.1]"
    ehlo_lookup["go"].set()  # the lookup ends: the next send gives its answer, without another
    assert mail._ehlo.done.wait(5)
    t.send(make_msg(key="slip:2026-11:ehlo-later"))
    assert smtpd.ehlo_names[-1] == "sender.payrun.test"
    assert ehlo_lookup["calls"] == 1


def test_sends_made_at_once_all_wait_for_the_first_lookup_of_the_ehlo_name(smtpd, ehlo_lookup):
    """Review (session 35): only the first send of a process waited for the name; the
    others made at the same moment (a worker's 45 lanes at its start) gave the host name,
    dotless in most containers, which relays wanting an FQDN refuse."""
    ehlo_lookup["go"].clear()
    answer = threading.Timer(0.5, ehlo_lookup["go"].set)  # a resolver answering in 0.5 s
    answer.start()
    t = transport_for(smtpd.url, 10)
    errors: list[BaseException] = []

    def send(i: int) -> None:
        try:
            t.send(make_msg(key=f"slip:2026-11:ehlo-at-once-{i}"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    answer.cancel()
    assert errors == []
    assert smtpd.ehlo_names == ["sender.payrun.test"] * 8
    assert ehlo_lookup["calls"] == 1


def test_a_host_with_no_fqdn_gives_its_address_in_ehlo_not_a_bare_name(smtpd, ehlo_lookup):
    ehlo_lookup["name"] = "payrun-7f9c2"  # a container's host name: no dot
    transport_for(smtpd.url, 5).send(make_msg(key="slip:2026-11:ehlo-dotless"))
    assert smtpd.ehlo_names == ["[127.0.0.1]"]


def test_a_failed_lookup_of_the_ehlo_name_is_tried_again_later(smtpd, ehlo_lookup, monkeypatch):
    """Review (session 35): a name that could not be looked up was given up for the
    process's life (weeks under supervisord). It is looked up again EHLO_NAME_RETRY_S later,
    without holding a send."""
    from jobs import mail

    ehlo_lookup["fail"] = True
    t = transport_for(smtpd.url, 5)
    t.send(make_msg(key="slip:2026-11:ehlo-failed"))
    assert smtpd.ehlo_names == ["[127.0.0.1]"] and ehlo_lookup["calls"] == 1
    t.send(make_msg(key="slip:2026-11:ehlo-failed-2"))  # not yet due: not looked up again
    assert ehlo_lookup["calls"] == 1
    monkeypatch.setattr(mail, "EHLO_NAME_RETRY_S", 0.0)  # (its ten minutes have passed)
    ehlo_lookup["fail"] = False
    ehlo_lookup["go"].clear()  # the new lookup takes its time: the send does not wait for it
    start = time.monotonic()
    t.send(make_msg(key="slip:2026-11:ehlo-retry"))
    assert time.monotonic() - start < mail.EHLO_NAME_WAIT_S / 2
    assert smtpd.ehlo_names[-1] == "[127.0.0.1]" and ehlo_lookup["calls"] == 2
    monkeypatch.setattr(mail, "EHLO_NAME_RETRY_S", 600.0)
    ehlo_lookup["go"].set()
    assert mail._ehlo.done.wait(5)
    t.send(make_msg(key="slip:2026-11:ehlo-retried"))
    assert smtpd.ehlo_names[-1] == "sender.payrun.test" and ehlo_lookup["calls"] == 2


def test_the_quit_after_a_delivery_ends_within_the_sends_deadline():
    """Review (session 35): QUIT had 2 s (+ the cutoff's margin) of its own after the
    server's 250, whatever the send had left: a delivered send ran past its ``until``,
    into the time its job keeps for recording it."""
    class SlowQuit(Recorder):
        async def handle_QUIT(self, server, session, envelope):
            await asyncio.sleep(10)
            return "221 Bye"

    handler = SlowQuit()
    ctl = EphemeralController(handler, hostname="127.0.0.1", port=0)
    ctl.start()
    try:
        t = transport_for(f"smtp://127.0.0.1:{ctl.port}", 30)
        t.send(make_msg(key="slip:2026-11:warm"))  # (the EHLO name known: not part of this)
        until = time.monotonic() + 1.0
        t.send(make_msg(key="slip:2026-11:slow-quit"), until=until)
        assert time.monotonic() < until + 0.1
        assert len(handler.messages) == 2
    finally:
        ctl.stop()


class _HostileIdProvider:
    """A stub HTTP provider on 127.0.0.1 that accepts every message and answers with
    ``mid`` as its message id (``duplicate`` as asked)."""

    def __init__(self, mid: str, duplicate: bool = False):
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        answer = json.dumps({"id": mid, "duplicate": duplicate}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(202)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):  # (quiet)
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("duplicate", [False, True])
def test_a_providers_message_id_is_recorded_with_its_control_characters_escaped(conn, duplicate):
    """The id an HTTP provider returns was recorded as sent (in the slip's idempotency
    record, the job's result, a host's note of an unrecorded send): an ESC sequence in it
    reached whoever read those back in a terminal. Escaped as a server's reply quoted in an
    error is, and cut at PROVIDER_ID_MAX."""
    from jobs import idempotency
    from jobs.mail import PROVIDER_ID_MAX
    from payrun import keys

    hostile = "msg-1\x1b]0;owned\x07\x1b[2J\u202edi-\x9b\r\nX"
    srv = _HostileIdProvider(hostile, duplicate)
    try:
        got = transport_for(srv.url, 5).send(make_msg())
    finally:
        srv.close()
    assert got == "msg-1\\x1b]0;owned\\x07\\x1b[2J\\u202edi-\\x9b\\x0d\\x0aX", got
    assert getattr(got, "duplicate", None) is duplicate  # (still the provider's answer)
    key = "slip:2026-11:emp-00017"
    assert idempotency.claim(conn, key, "email-2026-11-emp-00017:1", 60) == idempotency.OK
    idempotency.mark_sent(conn, key, "email-2026-11-emp-00017:1", got)
    stored = conn.hget(keys.idem_state(key), "message_id").decode()
    assert stored == got and "\x1b" not in stored and "\u202e" not in stored
    srv = _HostileIdProvider("x" * 5000)
    try:
        long_id = transport_for(srv.url, 5).send(make_msg())
    finally:
        srv.close()
    assert len(long_id) == PROVIDER_ID_MAX and long_id.endswith("…")
