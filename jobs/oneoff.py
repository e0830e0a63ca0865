"""One-off and delayed job functions (enqueued by `payrun resend` and `payrun remind`).

resend_slip(snapshot)   pdf-render: HR's "send the slip again". The snapshot is taken now
                        (current data) and carries the key slip:<month>:<employee>:resend-<n>;
                        renders to <employee>.resend-<n>.pdf, then enqueues the usual
                        send_slip job under that new key, so it is sent even though the
                        original key was sent (and a retried resend is still sent once).
send_reminder(payload)  send-email: a short reminder email, enqueued with RQ's enqueue_in
                        (it waits in the scheduled registry, not in a sleeping worker).
                        Same idempotency claim and global limits as a slip.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rq import get_current_job

from jobs import idempotency
from jobs.errors import TransientError
from jobs.policy import send_claim_ttl_s
from payrun import keys

log = logging.getLogger("payrun.worker")


def resend_path(month: str, company_id: int, employee_id: str, n: int) -> str:
    """Beside the pay run's slip (its checks: jobs.tasks.slip_relpath)."""
    from jobs.tasks import slip_relpath

    return slip_relpath(month, company_id, employee_id).removesuffix(".pdf") + f".resend-{int(n)}.pdf"


def resend_number(key: str) -> int:
    return int(key.rsplit("resend-", 1)[1])


def resend_render_job_id(month: str, employee_id: str, n: int) -> str:
    return f"resend-{month}-{employee_id}-{n}"


def resend_email_job_id(month: str, employee_id: str, n: int) -> str:
    return f"email-{month}-{employee_id}-resend-{n}"


def resend_slip(snapshot: dict[str, Any]) -> dict[str, Any]:
    from jobs import slip, tasks
    from jobs.events import emit
    from jobs.runtime import make_queue
    from payrun import keys

    cfg = tasks.settings()
    job = get_current_job()
    n = resend_number(snapshot["key"])
    month, emp = snapshot["month"], snapshot["employee"]["id"]
    rel = resend_path(month, snapshot["company"]["id"], emp, n)
    slip.write_slip(cfg.slips_dir / rel, slip.render_pdf(snapshot), store=cfg.slips_dir)
    if job is None:
        return {"slip": rel}
    conn = job.connection
    payload = tasks.email_payload(snapshot, rel)
    email_id = resend_email_job_id(month, emp, n)
    queue = make_queue(keys.EMAIL_QUEUE, conn)
    if not conn.exists(queue.job_class.key_for(email_id)):
        with conn.pipeline() as pipe:
            pipe.multi()
            emit(pipe, email_id, "queued", kind="email", company=payload["company_id"], employee=emp,
                 month=month, key=payload["key"], queue=keys.EMAIL_QUEUE, to=payload.get("to"))  # (the ledger's recipient)
            queue.enqueue_call(
                "jobs.tasks.send_slip", args=(payload,), job_id=email_id, timeout=cfg.email.timeout_s,
                retry=tasks._retry(cfg.email.retry), description=f"resend slip {payload['key']}",
                meta={"kind": "email", "key": payload["key"], "retry": vars(cfg.email.retry)},
                result_ttl=24 * 3600, failure_ttl=30 * 24 * 3600, pipeline=pipe,
            )
            pipe.execute()
    return {"slip": rel, "email_job": email_id}


# A reminder has no slip. jobs.mail.Message always carries one attachment, so the
# reminder carries a one-page PDF notice built here without WeasyPrint (send-email
# hosts do not load it). Latin text only (the PDF uses a standard font).
_NOTICE_LOCK = threading.Lock()
_NOTICES: dict[tuple[str, str], bytes] = {}
"""Reminder PDFs made in this process, by (subject, text): a batch's reminders share one
text, so a send-email process renders it once per batch (the few most recent kept)."""

NOTICE_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{subject}</title></head>
<body style="font-size: 12pt; line-height: 1.5">
<h1 style="font-size: 15pt; margin: 0 0 6mm 0">{subject}</h1>
<div style="white-space: pre-wrap; overflow-wrap: anywhere">{text}</div>
</body></html>
"""


def notice_pdf(subject: str, text: str) -> bytes:
    """The reminder as a one-page PDF, through the slip's renderer: its bundled fonts (a
    Bengali text printed as "????" with the PDF's built-in Helvetica) and its layout
    (lines wrap; they ran off the page), the assets-only fetcher, the text escaped."""
    import html

    with _NOTICE_LOCK:
        pdf = _NOTICES.get((subject, text))
        if pdf is None:
            from jobs import slip

            pdf = slip.html_to_pdf(NOTICE_HTML.format(subject=html.escape(subject), text=html.escape(text)))
            while len(_NOTICES) >= 8:
                _NOTICES.pop(next(iter(_NOTICES)))
            _NOTICES[(subject, text)] = pdf
    return pdf


def send_reminder(payload: dict[str, Any]) -> dict[str, Any]:
    """payload: key, to, to_name, employee_id, company_name, subject, text, due_at."""
    from jobs import mail, tasks

    cfg = tasks.settings()
    job = get_current_job()
    # its own timeout, set when it was scheduled (days ago, perhaps under another config)
    started = time.monotonic()
    conn = job.connection
    key = payload["key"]
    token = f"{job.id}:{job.meta.get('attempt', 0)}"
    state = idempotency.claim(conn, key, token, send_claim_ttl_s(cfg.email.timeout_s, cfg.lease.visibility_s))
    if state == idempotency.SENT:  # a try before this one sent it (and failed after)
        tasks.unrecorded.forget(cfg.home, key)  # (recorded since: a note of it is done)
        _count_reminder_sent(conn, job.id, time.time())
        return {"skipped": "already sent", "key": key}
    if state == idempotency.BUSY:
        raise TransientError(f"another attempt is sending {key} right now")
    if (earlier := tasks.delivered_earlier(conn, cfg, key, token)) is not None:  # (noted: not sent again)
        sent_at = time.time()
        _count_reminder_sent(conn, job.id, sent_at)
        return {"sent": key, "message_id": earlier, "sent_at": sent_at, "recorded_late": True}
    try:
        pdf = notice_pdf(payload["subject"], payload["text"])
    except BaseException:  # (not sent: the claim is given back, for the next try to send at once)
        idempotency.release(conn, key, token)
        raise
    msg = mail.Message(
        to_addr=payload["to"], to_name=payload["to_name"], subject=payload["subject"],
        text_body=payload["text"], attachment_name="reminder.pdf", attachment_bytes=pdf,
        idempotency_key=key, sender=cfg.email.sender,
    )
    message_id = tasks.send_limited(conn, cfg, msg, key, token, started=started, job_timeout_s=job.timeout)
    sent_at = time.time()
    _count_reminder_sent(conn, job.id, sent_at)
    return {"sent": key, "message_id": message_id, "sent_at": sent_at}


def _count_reminder_sent(conn, job_id: str, at: float) -> None:
    """For the console's delivery rate, which counts slips only (keys.REMINDERS_SENT; one
    member per job, so a retry's record replaces the first). Bookkeeping: a Redis error
    here does not fail a reminder that went out."""
    try:
        with conn.pipeline(transaction=False) as pipe:
            pipe.zadd(keys.REMINDERS_SENT, {job_id: at})
            pipe.zremrangebyscore(keys.REMINDERS_SENT, "-inf", at - keys.REMINDERS_KEPT_S)
            pipe.execute()
    except Exception as e:  # noqa: BLE001
        log.warning("reminder %s sent, but not counted for the console's delivery rate: %s", job_id, e)
