"""Sends the provider accepted while Redis could not record them, noted on this host's disk.

A send whose record waited past its job's timeout for a Redis that was away (restarting,
its disk full) gives up, and the job's next try would send the slip a second time: the
HTTP provider dedupes it, an SMTP server delivers a second email (13 of 600 in an
on-call drill with Redis away for 30 s). The first failed record now notes the key and
the message id here (a give-up, a forced stop or a crash while waiting all leave it; a
record that succeeds after waiting drops it); a try of the same key on this host finds
the note, records the key sent with that message id, and sends nothing. And the host's
send-email process records every note in Redis as soon as Redis answers again, at its
start (it exits when Redis fails under it and supervisord restarts it) and every few
seconds while notes are kept (``record_all``): from then on a try on *any* host finds
the key sent and sends nothing. Only a try on another host in the seconds before that
(its backoff is longer) still sends again.

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
        _rewrite(home, [e for e in _read(home) if e.get("key") != key])


def _rewrite(home: Path, kept: list[dict]) -> None:
    """Replace the notes with ``kept`` (under the lock); the file goes when empty."""
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


def drop(home: Path, recorded: list[tuple[str, str]]) -> None:
    """Drop the notes recorded in Redis: exactly those (key, message id) pairs (a note of
    the same key written meanwhile, by a later try, stays)."""
    if not recorded or not _path(home).exists():
        return
    gone = set(recorded)
    with _locked(home):
        _rewrite(home, [e for e in _read(home) if (e.get("key"), e.get("message_id")) not in gone])


def record_all(home: Path, mark) -> tuple[int, BaseException | None]:
    """Record every note with ``mark(key, message_id)`` (into Redis: jobs.tasks.record_noted)
    and drop the notes recorded. Stops at the first error (Redis still away): the notes not
    recorded stay. Returns (notes recorded, that error or None)."""
    done: list[tuple[str, str]] = []
    error = None
    for e in pending(home):
        key, message_id = e.get("key"), e.get("message_id")
        if not isinstance(key, str) or not isinstance(message_id, str):
            continue  # (not one of ours: left for a person to read)
        try:
            mark(key, message_id)
        except Exception as err:  # noqa: BLE001 - Redis away or refusing writes: try again later
            error = err
            break
        done.append((key, message_id))
    drop(home, done)
    return len(done), error


def pending(home: Path) -> list[dict]:
    """Every note (for `payrun status`): sends delivered and not yet recorded."""
    if not _path(home).exists():
        return []
    with _locked(home):
        return _read(home)
