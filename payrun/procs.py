"""Processes of this host (a light module: no WeasyPrint, no RQ)."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


HOST_ID_CHARS = 8
"""Hex characters of :func:`host_id`: short enough for a file name, and two machines'
ids alike by chance once in 4 billion."""


def host_id_of(boot_id: str, pid_namespace: str, hostname: str) -> str:
    """The host id of a kernel boot (``/proc/sys/kernel/random/boot_id``), a pid namespace
    in it (``/proc/self/ns/pid``'s link) and a hostname: 8 hex characters, the same for
    every process that sees the same pids. Pure."""
    import hashlib

    text = "\0".join((boot_id.strip(), pid_namespace.strip(), hostname.strip()))
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:HOST_ID_CHARS]


_HOST_ID: str | None = None


def host_id() -> str:
    """Which host this process is, as its pids go: a pid means a process only to the
    processes of one kernel boot and one pid namespace, whatever the hostname says. Two
    machines (or containers) with one hostname (``localhost``, a cloned VM image) have
    different ids, so a pid of one is never judged alive or dead by the other (worker
    records, scheduler locks, slip stages, stop requests); a host's next boot has another.
    Read once per process (a fork shares its parent's)."""
    import socket

    global _HOST_ID
    if _HOST_ID is None:
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text()
        except OSError:
            boot = ""
        try:
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = ""
        _HOST_ID = host_id_of(boot, namespace, socket.gethostname())
    return _HOST_ID
