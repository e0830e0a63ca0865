"""Which directory is the slip store: an id in Redis and the same id in a file at the
store's root, so that a host pointed at another directory is told before its workers start.

A multi-host drill started a worker host with its own directory as the slip store: its
renders wrote there, and the control host's sends found no file (118 of 287 failed for
good as "bad data" within 10 s; 58 could not be recovered by a retry). The first render
worker to start writes the id (``claim``); `payrun up --role worker` compares its own
store with it (``mismatch``) and refuses to start when they differ.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from payrun import keys

ID_FILE = ".payrun-store-id"


def _read(slips_dir: Path) -> str | None:
    try:
        return (Path(slips_dir) / ID_FILE).read_text(encoding="ascii").strip() or None
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None


def claim(conn, slips_dir: Path) -> None:
    """Make ``slips_dir`` the slip store's if Redis names none yet (a render worker's start):
    its id file is written (0600) and the id kept in Redis. Nothing if Redis names one."""
    if conn.get(keys.SLIP_STORE_ID) is not None:
        return
    mine = _read(slips_dir)
    if mine is None:
        Path(slips_dir).mkdir(parents=True, exist_ok=True)
        mine = secrets.token_hex(8)
        path = Path(slips_dir) / ID_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(mine + "\n")
    conn.set(keys.SLIP_STORE_ID, mine, nx=True)


def mismatch(conn, slips_dir: Path) -> str | None:
    """Why ``slips_dir`` is not the store the other hosts use, or None (the same store, or
    none named yet: nothing rendered so far)."""
    theirs = conn.get(keys.SLIP_STORE_ID)
    if theirs is None:
        return None
    theirs = theirs.decode() if isinstance(theirs, bytes) else str(theirs)
    mine = _read(slips_dir)
    if mine == theirs:
        return None
    found = "has no slip store id" if mine is None else f"is another store (id {mine})"
    return (f"the slip store {slips_dir} {found}, not the one the other hosts render into (id {theirs}, its "
            f"{ID_FILE}): set PAYRUN_SLIPS_DIR to the shared store, mounted on this host")


def unsafe(root: Path, path: Path, slip: bool = False) -> str | None:
    """Why the slip store's folders from ``root`` down to ``path``'s folder (and, with
    ``slip``, the file ``path`` itself) are not this account's alone, or None
    (jobs.policy.store_entry_problem): each below the root is looked at without following
    symlinks. ``path`` must be inside ``root`` (as given, or resolved)."""
    from jobs.policy import store_entry_problem

    root, path = Path(root), Path(path)
    real = root.resolve()  # the root as configured may be a symlink (to a mount): followed, and checked
    parts = (path.relative_to(root) if path.is_relative_to(root) else path.relative_to(real)).parts
    entries = [real] + [real.joinpath(*parts[:i]) for i in range(1, len(parts))]
    if slip:
        entries.append(path)
    uid = os.getuid()
    for i, entry in enumerate(entries):
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            return None  # not there (yet): nothing of anyone's to trust
        is_slip = slip and i == len(entries) - 1
        if why := store_entry_problem(st.st_mode, st.st_uid, uid, slip=is_slip):
            return _not_alone(entry, why, is_slip) + ", then `payrun retry --all`"
    return None


def _not_alone(entry, why: str, is_slip: bool = False) -> str:
    return (f"the slip store's {'slip' if is_slip else 'folder'} {entry} {why}: another account could swap a slip "
            f"in it; make it this account's alone (chown, chmod {'600' if is_slip else 'go-w'})")


def not_a_directory(store: Path) -> str | None:
    """Why no slip store can be at ``store`` (a symlink to nothing, a file, or a path under
    a file: PAYRUN_SLIPS_DIR=/srv/slips.tar/slips; or missing under a directory this account
    cannot write), with what to do; None when it is a directory or can be made (`payrun up`
    makes a missing one)."""
    store = Path(store)
    try:
        return _not_a_directory(store)
    except PermissionError as e:  # (a folder on its way this account cannot enter: exists() raises)
        return (f"the slip store {store} cannot be reached by this account ({e.strerror}: {e.filename}): give the "
                "account payrun runs as access to it, or set PAYRUN_SLIPS_DIR to a directory it can reach")


def _not_a_directory(store: Path) -> str | None:
    if store.is_symlink() and not store.exists():
        return (f"the slip store {store} is a symlink to {os.readlink(store)}, which is not there: mount the "
                "shared store, or point the symlink at it")
    if store.exists():
        return None if store.is_dir() else (
            f"the slip store {store} is a file, not a directory: set PAYRUN_SLIPS_DIR to a directory (or move the file)")
    for parent in store.parents:
        if parent.exists() or parent.is_symlink():
            if parent.is_symlink() and not parent.exists():  # (not "a file": moving it loses the link)
                return (f"no slip store at {store}, and none can be made there: {parent} is a symlink to "
                        f"{os.readlink(parent)}, which is not there: mount the shared store, or point the "
                        "symlink at it")
            if not parent.is_dir():
                return (f"no slip store at {store}, and none can be made there: {parent} is a file, not a "
                        "directory; set PAYRUN_SLIPS_DIR to a directory (or move the file)")
            if not os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
                # (the render workers make it, as this account: each would fail on it)
                return (f"no slip store at {store}, and this account cannot make it: {parent} cannot be written "
                        "(read-only, or another account's): make the store there and give it to the account payrun "
                        "runs as, or set PAYRUN_SLIPS_DIR to a directory this account can write to")
            break
    return None


def store_problem(root: Path) -> str | None:
    """Why the slip store at ``root`` would make every render and send fail (its root, or a
    month or company folder in it, not this account's alone: ``unsafe``), or None; for
    `payrun up` to say before the night's run rather than each job after it. Slip files are
    not looked at (a month holds 50,000)."""
    from jobs.policy import store_entry_problem

    root = Path(root)
    if why := not_a_directory(root):
        return why
    if not root.exists():
        return None
    if why := unsafe(root, root / "-"):
        return why
    level, uid = [root.resolve()], os.getuid()
    for _depth in ("months", "companies"):
        below = []
        for folder in level:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for e in entries:
                if not (e.is_dir(follow_symlinks=False) or e.is_symlink()):
                    continue  # (the store's id file, a slip)
                st = e.stat(follow_symlinks=False)
                if why := store_entry_problem(st.st_mode, st.st_uid, uid):
                    return _not_alone(e.path, why)
                if not e.is_symlink():
                    below.append(e.path)
        level = below
    return None
