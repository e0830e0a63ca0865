"""Sends the provider accepted while Redis could not record them, noted on this host's disk.

A send whose record waited past its job's timeout for a Redis that was away (restarting,
its disk full) gives up, and the job's next try would send the slip a second time: the
HTTP provider dedupes it, an SMTP server delivers a second email (13 of 600 in an
on-call drill with Redis away for 30 s). The first failed record now notes the key and
the message id here (a give-up, a forced stop or a crash while waiting all leave it; a
record that succeeds after waiting drops it); a try of the same key on this host finds
the note, records the key sent with that message id, and sends nothing. A try on
another host has no note and sends again (documented).

One JSON object per line in ``$PAYRUN_HOME/sends-unrecorded.jsonl`` (0600), under an
flock shared by the lanes and processes of the host. No salary figure: a key
("slip:2026-11:emp-00021") and a message id.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

FILE = "sends-unrecorded.jsonl"


def _path(home: Path) -> Path:
    return Path(home) / FILE


@contextmanager
def _locked(home: Path):
    fd = os.open(Path(home) / (FILE + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _read(home: Path) -> list[dict]:
    try:
        text = _path(home).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a crash mid-write: skipped
            continue
    return out


def remember(home: Path, key: str, message_id: str) -> None:
    """Note that ``key`` was delivered as ``message_id`` and is not recorded in Redis."""
    data = (json.dumps({"key": key, "message_id": message_id, "at": round(time.time(), 3)}) + "\n").encode()
    with _locked(home):
        fd = os.open(_path(home), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a line cut short (a full disk): this one starts on its own
            while data:  # (a short write on a nearly full disk: the rest, or OSError)
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)


def find(home: Path, key: str) -> str | None:
    """The message id ``key`` was delivered as, if this host noted one."""
    if not _path(home).exists():  # (every send asks: one stat when there is nothing)
        return None
    with _locked(home):
        found = [e["message_id"] for e in _read(home) if e.get("key") == key]
    return found[-1] if found else None


def forget(home: Path, key: str) -> None:
    """Drop the notes of ``key`` (recorded in Redis now); the file goes when empty."""
    if not _path(home).exists():  # (one stat when there is nothing)
        return
    with _locked(home):
        kept = [e for e in _read(home) if e.get("key") != key]
        path = _path(home)
        if not kept:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(e) + "\n" for e in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def pending(home: Path) -> list[dict]:
    """Every note (for `payrun status`): sends delivered and not yet recorded."""
    if not _path(home).exists():
        return []
    with _locked(home):
        return _read(home)
