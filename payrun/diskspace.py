"""A full disk under payrun's own files (the SQLite ledger and payroll database, the data
directory): how to tell it from an error, and how to say it to the operator. Pure, except
``free_bytes`` (one statvfs).

SQLite says a full disk two ways: SQLITE_FULL ("database or disk is full") when a write
finds no room, and SQLITE_IOERR ("disk I/O error") when the room it could not get was for
its shared-memory index (``-shm``) or journal as it opens a database: a `payrun status`
on a full data directory ended in a 40-line traceback of the latter (session-42 drill).
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

SQLITE_NO_ROOM = ("database or disk is full", "disk I/O error")

NEARLY_FULL_BYTES = 1024 * 1024
"""Below this much room a "disk I/O error" from SQLite is taken for a full disk."""


def free_bytes(path: Path | str) -> int | None:
    """Room left for this account on the file system of ``path`` (or of its nearest existing
    parent); None if it cannot be told."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def no_room(exc: BaseException, free: int | None = None) -> bool:
    """Whether ``exc`` says a disk is full: ENOSPC or EDQUOT, SQLite's SQLITE_FULL, or its
    "disk I/O error" while ``free`` (the file system's room, if known) is nearly nothing."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    text = str(exc)
    if text == SQLITE_NO_ROOM[0]:
        return True
    return text == SQLITE_NO_ROOM[1] and free is not None and free < NEARLY_FULL_BYTES


def full_text(path: Path | str, exc: BaseException, free: int | None) -> str:
    """"<path>: No space left on device (database or disk is full; 0 B free there): free
    space in <folder>" for the operator: what failed, where, and what to do."""
    folder = Path(path).parent
    room = "" if free is None else f"; {size_text(free)} free there"
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{path}: No space left on device ({why}{room}): free space in {folder} ({what_to_free(folder)})"


def what_to_free(home: Path | str) -> str:
    """Where room can come from in a full data directory. `payrun prune` deletes ledger rows,
    which SQLite must first write to its journal: it needs a little room itself."""
    return (f"`df -h {home}`; old logs in {Path(home) / 'log'} can go, then `payrun prune --before YYYY-MM` "
            "for old months")
