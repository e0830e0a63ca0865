"""Who a job's email is (or was) for: HR's "which address did it go to?" (`payrun job`).

A job's recipient is read from the best of three places, in this order:

  sent_with   the ledger's ``recipient`` of the send (migration 4): the address the send
              was made with, or its last `payrun retry` read. What it went to.
  job         the job's own copy in Redis (kept a day after it finishes): a send's ``to``,
              or a render's snapshot (its send is made with that address).
  on_file_now the payroll database today: the job's own address is known nowhere (a send
              made before migration 4, gone from Redis); it may have gone elsewhere.

Only the name and the address are picked out of a job's data: a render's snapshot holds the
salary lines and the bank account, and nothing else of it is returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SOURCES = ("sent_with", "job", "on_file_now")


def from_job_data(data: Any) -> tuple[str | None, str | None]:
    """(name, address) out of a job's first argument: a send's or reminder's payload
    (``to_name``, ``to``) or a render's snapshot (``employee.name_en``, ``employee.email``);
    (None, None) for anything else. Reads those two fields only."""
    if not isinstance(data, Mapping):
        return None, None
    if "to" in data:
        return _str(data.get("to_name")), _str(data.get("to"))
    emp = data.get("employee")
    if isinstance(emp, Mapping):
        return _str(emp.get("name_en")), _str(emp.get("email"))
    return None, None


def recipient(employee_id: str | None, sent_with: str | None, job_data: Any,
              on_file: tuple[str, str] | None) -> dict[str, Any] | None:
    """The recipient `payrun job` shows: ``{"employee_id", "name", "email", "source"}``,
    ``source`` one of SOURCES (where the address was read; the name is the job's, else the
    one on file now). None when nothing names anyone (a control job)."""
    name, address = from_job_data(job_data)
    source = None
    if sent_with:
        address, source = sent_with, "sent_with"
    elif address:
        source = "job"
    if on_file is not None:
        name = name or on_file[0]
        if not address:
            address, source = on_file[1], "on_file_now"
    if not (employee_id or name or address):
        return None
    return {"employee_id": employee_id, "name": name, "email": address, "source": source}


def recipient_text(r: Mapping[str, Any], send_id: str | None = None) -> str:
    """One line for `payrun job`: ``to: Name <address> (emp-…; where the address is from)``.
    ``send_id``: a render's send job (the address is that send's), said as ``for:``."""
    this = f"its send {send_id}" if send_id else "this send"
    why = {"sent_with": f"the address {this} was made with",
           "job": f"the address in the job's data: {this} goes there" if send_id else "the address in the job's data",
           "on_file_now": "the address on file now; the one this job was made with is no longer known"}
    name = r.get("name") or "?"
    address = f" <{r['email']}>" if r.get("email") else " (no address known)"
    where = "; ".join(p for p in (r.get("employee_id"), why.get(r.get("source") or "")) if p)
    return f"{'for' if send_id else 'to'}: {name}{address}" + (f" ({where})" if where else "")


def readdressed_text(to: Mapping[str, Any] | None, on_file_email: str | None, job_id: str) -> str | None:
    """`payrun job` of a send that failed for good on its data: when the address it was
    made with (``to``, :func:`recipient`) is no longer the one on file, HR fixed it since,
    and a retry goes to the new one. None otherwise (no address on file, or the same one)."""
    if not to or not to.get("email") or to.get("source") == "on_file_now" or not on_file_email:
        return None
    if on_file_email == to["email"]:
        return None
    return (f"the address on file now is {on_file_email} (changed since this send was made): "
            f"`payrun retry {job_id}` sends it there")


def job_recipient(ledger, on_file_of, job_id: str, row: Mapping[str, Any] | None,
                  job_data: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Whom a job's email is for (`payrun job`, the console's job view): its ``recipient``
    and, for a render, its send's job id (None for a send, whose own address it is).
    ``ledger``: payrun.ledger.Ledger (or the console's read-only one); ``on_file_of``:
    employee id -> (name, address) on file now, or None."""
    kind = (row or {}).get("kind")
    if row is None and not isinstance(job_data, Mapping):
        return None, None
    employee = (row or {}).get("employee_id")
    if employee is None and isinstance(job_data, Mapping):
        emp = job_data.get("employee")
        employee = job_data.get("employee_id") or (emp.get("id") if isinstance(emp, Mapping) else None)
    if employee is None and from_job_data(job_data) == (None, None):
        return None, None
    send_id = sent_with = None
    if ledger is not None and row is not None and kind in ("render", "resend") and row.get("key"):
        if (send := ledger.send_of(row["key"])) is not None:
            send_id, sent_with = send
    elif ledger is not None and row is not None:
        sent_with = ledger.recipients([job_id]).get(job_id)
    on_file = on_file_of(employee) if employee else None
    to = recipient(employee, sent_with, job_data, tuple(on_file) if on_file else None)
    if to is not None and row is not None and kind in ("render", "resend") and send_id is None:
        from jobs.oneoff import resend_email_job_id, resend_number
        from payrun import keys

        send_id = (resend_email_job_id(row["month"], employee, resend_number(row["key"])) if kind == "resend"
                   else keys.email_job_id(row["month"], employee))  # (its send is not made yet)
    return to, send_id


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None
