"""The payroll bank: a local simulated salary-credit API, its client, and the job that
records per employee whether the salary reached the account.

API (HTTP JSON on 127.0.0.1, `payrun bank`)::

    GET /v1/credits?month=2026-11&company=3
    200 {"month": "2026-11", "company": 3,
         "credits": [{"employee": "emp-00017", "status": "credited", "amount": 6130000,
                      "credited_at": "2026-12-01T03:10:00+00:00", "reason": null}, ...]}
    GET /health  -> {"ok": true, "requests": n}

The simulation answers from the payroll database: each employee with a salary line in
the month is ``credited`` (most), ``pending`` or ``returned`` (account closed / name
mismatch), chosen deterministically from (seed, month, employee) so a test can predict it.
``fail_next`` makes the next requests answer 503 (a bank outage).

``check_company`` is the bank-status check's real job (control queue, ledger host): one
request per (month, company), one upsert per employee into ``bank_credits``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

log = logging.getLogger("payrun.bank")


def credit_status(seed: int, month: str, employee_id: str) -> tuple[str, str | None]:
    """The simulated outcome of one salary credit: 94% credited, 4% pending, 2% returned."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{month}:{employee_id}".encode()).digest()[:4], "big") % 100
    if h < 94:
        return "credited", None
    if h < 98:
        return "pending", "in clearing"
    return "returned", ("account closed" if h == 98 else "name does not match the account")


class Bank:
    """The simulated bank. ``start()`` serves in a thread (tests); ``serve_forever()``
    is the `payrun bank` process."""

    def __init__(self, payroll_path: Path | str, host: str = "127.0.0.1", port: int = 0, seed: int = 7,
                 token: str | None = None):
        self.payroll_path = Path(payroll_path)
        self.seed = seed
        self.requests = 0
        self.fail_next = 0
        self._lock = threading.Lock()
        bank = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # quiet; the process logs requests itself
                log.debug("bank: " + fmt, *args)

            def _reply(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(url.query))
                with bank._lock:
                    bank.requests += 1
                    failing = bank.fail_next > 0
                    if failing:
                        bank.fail_next -= 1
                if url.path == "/health":
                    return self._reply(200, {"ok": True, "requests": bank.requests})
                if url.path != "/v1/credits":
                    return self._reply(404, {"error": "not found"})
                if token and not hmac.compare_digest(self.headers.get("Authorization", "").encode("utf-8", "surrogateescape"),
                                                    f"Bearer {token}".encode()):
                    # the credits are every employee's net pay: not for any local user
                    return self._reply(401, {"error": "a bearer token is required"})
                if failing:
                    return self._reply(503, {"error": "bank unavailable, try later"})
                month, company = q.get("month", ""), q.get("company", "")
                if not company.isdigit() or len(month) != 7:
                    return self._reply(400, {"error": "month=YYYY-MM and company=ID are required"})
                try:
                    credits = bank.credits(month, int(company))
                except Exception as e:  # noqa: BLE001 — a simulator reports, it does not crash
                    return self._reply(500, {"error": str(e)})
                return self._reply(200, {"month": month, "company": int(company), "credits": credits})

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def credits(self, month: str, company_id: int) -> list[dict[str, Any]]:
        from payrun import payroll

        db = payroll.PayrollDB(self.payroll_path)
        try:
            out = []
            paid_at = datetime.strptime(month + "-01", "%Y-%m-%d").replace(tzinfo=timezone.utc)
            for snap in payroll.snapshots(db, month, company_id):
                emp = snap["employee"]["id"]
                status, reason = credit_status(self.seed, month, emp)
                net = sum(snap["earnings"].values()) - sum(snap["deductions"].values())
                credited_at = None
                if status == "credited":
                    credited_at = (paid_at + timedelta(days=31, hours=3)).replace(day=1).isoformat()
                out.append({"employee": emp, "status": status, "amount": net, "credited_at": credited_at,
                            "reason": reason})
            return out
        finally:
            db.close()

    def start(self) -> "Bank":
        self._thread = threading.Thread(target=self.server.serve_forever, name="bank", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def serve_forever(self) -> None:
        log.info("bank: salary-credit API on %s (payroll db %s)", self.url, self.payroll_path)
        try:
            self.server.serve_forever()
        finally:
            self.server.server_close()


def bank_token(cfg) -> str | None:
    """The token to show the bank: scheduler.bank_token (PAYRUN_BANK_TOKEN), else for a bank
    on this host's loopback (`payrun bank`) the data directory's own secret."""
    from payrun import redis_server
    from payrun.config import is_loopback

    if cfg.scheduler.bank_token:
        return cfg.scheduler.bank_token
    if is_loopback(urllib.parse.urlsplit(cfg.scheduler.bank_url).hostname or ""):
        return redis_server.local_secret(cfg, "bank-token")
    return None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows a 3xx and copies the request's headers, ``Authorization`` included, to
    whatever host the ``Location`` names: the bank token (every employee's net pay) would go
    along. A redirect is an answer here, never followed (``fetch_credits``)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_opener = urllib.request.build_opener(_NoRedirects)


def fetch_credits(base_url: str, month: str, company_id: int, timeout_s: float = 10.0,
                  token: str | None = None) -> list[dict[str, Any]]:
    """One company's credits for a month. TransientError on an outage, PermanentError on a 4xx
    or a redirect (not followed: the token would go wherever it points)."""
    from jobs.errors import PermanentError, TransientError
    from payrun.config import redact_url

    url = f"{base_url.rstrip('/')}/v1/credits?" + urllib.parse.urlencode({"month": month, "company": company_id})
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with _opener.open(request, timeout=timeout_s) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code >= 500 or e.code == 429:
            raise TransientError(f"bank answered {e.code} for {month} company {company_id}")
        if 300 <= e.code < 400:
            raise PermanentError(f"bank answered {e.code} (a redirect) for {month} company {company_id}: not followed, "
                                 "so the token goes nowhere else; set scheduler.bank_url to the address it names")
        raise PermanentError(f"bank refused the request for {month} company {company_id}: HTTP {e.code}")
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise TransientError(f"bank unreachable at {redact_url(base_url)}: {getattr(e, 'reason', e)}")
    return list(doc.get("credits") or [])


def check_company(month: str, company_id: int, scheduled_for: str | None = None) -> dict[str, Any]:
    """The bank-status check's real job: ask the bank, record each employee's credit."""
    from jobs.tasks import settings
    from scheduler.store import Store

    cfg = settings()
    credits = fetch_credits(cfg.scheduler.bank_url, month, int(company_id), token=bank_token(cfg))
    store = Store(cfg.ledger_path)
    try:
        store.record_credits(month, int(company_id), credits)
        counts = store.credit_counts(month, int(company_id))
    finally:
        store.close()
    return {"month": month, "company": company_id, "tick": scheduled_for, **counts}
