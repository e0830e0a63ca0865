"""Owner-only files: what payrun keeps (salaries, bank accounts, the ledger) is readable by
the account that runs it and nobody else."""

from __future__ import annotations

import os
from pathlib import Path


def sqlite_owner_only(path: Path) -> None:
    """An existing SQLite database, its -wal and -shm beside it (SQLite creates them with the
    database's mode) and its folder made owner-only again, where they are ours: a database
    copied in or restored from a backup under another umask (0644) would otherwise stay
    readable by every local user. Files of another owner are left alone."""
    me = os.getuid()
    for p, mode in ((path.parent, 0o700), (path, 0o600), (path.with_name(path.name + "-wal"), 0o600),
                    (path.with_name(path.name + "-shm"), 0o600)):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if st.st_mode & 0o077 and st.st_uid == me:
            os.chmod(p, mode)
