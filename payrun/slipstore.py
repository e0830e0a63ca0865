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


def unsafe(root: Path, path: Path, slip: bool = False, then: str = ", then `payrun retry --all`") -> str | None:
    """Why the slip store's folders from ``root`` down to ``path``'s folder (and, with
    ``slip``, the file ``path`` itself) are not this account's alone, or None
    (jobs.policy.store_entry_problem): each below the root is looked at without following
    symlinks. ``path`` must be inside ``root`` (as given, or resolved). ``then``: what to
    do once it is fixed (a job that failed on it: retry it)."""
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
            return _not_alone(entry, why, is_slip) + then
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
    if why := unsafe(root, root / "-", then=", then `payrun up` (and `payrun retry --all` if slips failed on it)"):
        return why  # (drill 43: at `up`, before any slip, it named the retry alone)
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


# ---- a slip store that cannot be written (read-only, a failing disk) -------------------------

PROBE_PREFIX = ".payrun-probe-"
FAULT_TTL_S = 30.0
"""A host's entry in keys.SLIP_STORE_FAULTS lapses this long after it was last written (its
render workers renew it at each look, once a second, while the store cannot be written)."""
FAULTS_KEY_TTL_S = 3600


def probe_write(store: Path) -> OSError | None:
    """Whether a slip could be written in ``store`` now: its file system not mounted
    read-only (one statvfs: ST_RDONLY, which ext4's errors=remount-ro sets), then a tiny
    file made, written, synced and removed at its root (a failing disk answers EIO there,
    mostly at the sync). None if all that worked, else the OSError met (EROFS for a
    read-only mount). A few hundred microseconds on a healthy disk; called after a failed
    write, and then at most once a second while the store fails (jobs.runtime.RenderWorker)."""
    import errno

    store = Path(store)
    try:
        if os.statvfs(store).f_flag & os.ST_RDONLY:
            return OSError(errno.EROFS, os.strerror(errno.EROFS), str(store))
        from payrun.procs import host_id

        probe = store / f"{PROBE_PREFIX}{host_id()}-{os.getpid()}-{secrets.token_hex(2)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            try:
                _probe_write(fd)
            finally:
                os.close(fd)
        finally:
            try:
                os.unlink(probe)
            except FileNotFoundError:
                pass
    except OSError as e:
        return e
    return None


def _probe_write(fd: int) -> None:
    """The probe's write and sync. Its own function: the tests inject a failing disk here."""
    os.write(fd, b"p")
    os.fsync(fd)


def mount_point(path: Path) -> Path:
    """The mount point of the file system ``path`` is on (itself, or its nearest parent that
    is one); for "mount -o remount,rw <it>"."""
    p = Path(path).absolute()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def _host() -> tuple[str, str]:
    import socket

    from payrun.procs import host_id

    return host_id(), socket.gethostname()


def report_fault(conn, store: Path, error: OSError, now: float | None = None) -> None:
    """Record in Redis that this host's slip store ``store`` cannot be written (``error``:
    EROFS or EIO), for `payrun status` and `payrun check` on any host, and for the render
    workers of this host (a render's horse meets it; its worker then takes no render until
    a test write succeeds). Since when is kept from a live entry. Redis away: nothing."""
    import json
    import time

    from jobs.policy import errno_text

    ident, hostname = _host()
    now_ms = (time.time() if now is None else now) * 1000
    try:
        old = read_fault_entry(conn.hget(keys.SLIP_STORE_FAULTS, ident))
        since = old["since_ms"] if old and old["until_ms"] >= now_ms else now_ms
        entry = {"host": hostname, "path": str(store), "mount": str(mount_point(store)), "errno": error.errno,
                 "error": errno_text(error),
                 "since_ms": since, "until_ms": now_ms + FAULT_TTL_S * 1000}
        with conn.pipeline(transaction=False) as p:
            p.hset(keys.SLIP_STORE_FAULTS, ident, json.dumps(entry))
            p.expire(keys.SLIP_STORE_FAULTS, FAULTS_KEY_TTL_S)
            p.execute()
    except Exception:  # noqa: BLE001 - Redis away: the worker's own log says it
        pass


def fault_reported(conn, now: float | None = None) -> bool:
    """Whether a live entry says this host's slip store cannot be written (one HGET);
    False when Redis does not answer."""
    import time

    try:
        e = read_fault_entry(conn.hget(keys.SLIP_STORE_FAULTS, _host()[0]))
    except Exception:  # noqa: BLE001
        return False
    return e is not None and e["until_ms"] >= (time.time() if now is None else now) * 1000


def clear_fault(conn) -> None:
    """This host's slip store can be written again: its entry goes."""
    try:
        conn.hdel(keys.SLIP_STORE_FAULTS, _host()[0])
    except Exception:  # noqa: BLE001 - it lapses by itself
        pass


def read_fault_entry(raw) -> dict | None:
    """An entry of keys.SLIP_STORE_FAULTS, or None (missing, unreadable). Pure."""
    import json

    if not raw:
        return None
    try:
        e = json.loads(raw)
        return {"host": str(e["host"]), "path": str(e["path"]), "mount": str(e.get("mount") or e["path"]),
                "errno": int(e["errno"]), "error": str(e["error"]),
                "since_ms": float(e["since_ms"]), "until_ms": float(e["until_ms"])}
    except (ValueError, TypeError, KeyError):
        return None


def read_faults(conn, now: float | None = None) -> list[dict]:
    """The hosts whose slip store cannot be written now (live entries), oldest first."""
    import time

    now_ms = (time.time() if now is None else now) * 1000
    entries = [(k, read_fault_entry(v)) for k, v in conn.hgetall(keys.SLIP_STORE_FAULTS).items()]
    return sorted(({**e, "id": k.decode() if isinstance(k, bytes) else str(k)} for k, e in entries
                   if e is not None and e["until_ms"] >= now_ms), key=lambda e: e["since_ms"])


def fault_notes(conn, store: Path, tz: str = "UTC", sends_only: str | None = None, company: int | None = None,
                others_rendering: int = 0) -> list[str]:
    """`payrun status`'s notes on slip stores that cannot be written (``store_faults``);
    ``sends_only``: the run (month), or ``company``'s part of it, has no render left, only
    sends; ``others_rendering``: renders of the run's other companies left (``fault_text``)."""
    return [fault_text(e, tz, sends_only, company, others_rendering) for e in store_faults(conn, store)]


def store_faults(conn, store: Path, now: float | None = None) -> list[dict]:
    """The slip stores that cannot be written, for `payrun status` and the console: each
    host its render workers found so (``read_faults``; ``conn`` None: none), and this
    host's own store if its file system is mounted read-only (one statvfs, no write: a
    store gone read-only with no render worker up to find it; ``since_ms`` None)."""
    import errno

    from jobs.policy import errno_text

    entries = []
    if conn is not None:
        try:
            entries = read_faults(conn, now)
        except Exception:  # noqa: BLE001 - Redis away: status and the console say that themselves
            entries = []
    ident, hostname = _host()
    if not any(e["id"] == ident for e in entries):
        try:
            read_only = Path(store).is_dir() and bool(os.statvfs(store).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        if read_only:
            err = OSError(errno.EROFS, os.strerror(errno.EROFS))
            entries.append({"id": ident, "host": hostname, "path": str(store), "mount": str(mount_point(store)),
                            "errno": errno.EROFS, "error": errno_text(err), "since_ms": None})
    return entries


def fault_text(entry: dict, tz: str = "UTC", sends_only: str | None = None, company: int | None = None,
               others_rendering: int = 0) -> str:
    """One line on a host whose slip store cannot be written, for `payrun status` and
    `payrun check`: where, what the system said, since when, what it means, what to do.
    ``sends_only``: the month whose run has every slip made and only sends left, which only
    read slips: it holds none of them, only renders to come (a retry, a resend).
    ``company`` (`payrun status --company`): ``sends_only`` is of that company's part of the
    run, every slip of it made; the renders of the run's other companies it still holds
    (``others_rendering``) are counted, so that the company's line does not read as the run's."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from jobs.policy import store_fault_todo

    since = "" if not entry.get("since_ms") else (
        " since " + datetime.fromtimestamp(entry["since_ms"] / 1000, ZoneInfo(tz)).strftime("%H:%M:%S %Z"))
    head = f"the slip store {entry['path']} cannot be written on {entry['host']} ({entry['error']}){since}: "
    todo = store_fault_todo(entry['errno'], entry['mount'])
    if sends_only and company is not None:  # (session 45: `--company` read "every slip is made" of the run)
        others = (f"; {others_rendering:,} render{'' if others_rendering == 1 else 's'} of the run's other companies "
                  f"wait{'s' if others_rendering == 1 else ''} in their queue, spending no attempt, and go on by "
                  "themselves once it can be written (`payrun status` without --company)" if others_rendering else "")
        return (head + f"it holds none of company {company}'s sends of the {sends_only} run (every slip of company "
                       f"{company} is made; a send only reads its slip), only a render of it to come (a retry, a "
                       f"resend){others}; {todo}")
    if sends_only:  # (session 44: it read "its renders wait" with every slip made and only sends left)
        return (head + f"it holds none of the {sends_only} run's sends (every slip is made; a send only reads its "
                       f"slip), only a render to come (a retry, a resend); {todo}")
    return (head + "its renders wait in their queue, spending no attempt, and go on by themselves once it can be "
                   f"written; {todo}")
