"""The audit log: $PAYRUN_HOME/audit.log, one JSON object a line (when, who, via, what,
the equivalent command, how many, outcome). Written by the operator's actions
(console.actions: retry, drain, resume, stop-worker, limits) and by HR's actions that
email employees (`payrun resend`, `payrun remind`). Plain Python: the scheduler's and
payrun's commands use it without the console."""

from __future__ import annotations

import getpass
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    what: str
    command: str
    count: int
    ok: bool = True
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def who() -> str:
    return os.environ.get("USER") or getpass.getuser()


def audit_path(cfg) -> Path:
    return Path(cfg.home) / "audit.log"


def audit(cfg, outcome: Outcome, via: str) -> None:
    """Append one line; the file is created 0600 (its directory is PAYRUN_HOME, 0700)."""
    line = json.dumps({
        "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "who": who(), "via": via,
        "what": outcome.what, "command": outcome.command, "count": outcome.count, "ok": outcome.ok,
        "message": outcome.message, **({"detail": outcome.detail} if outcome.detail else {}),
    })
    path = audit_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(line + "\n")


def read_audit(cfg, last: int = 50) -> list[dict[str, Any]]:
    path = audit_path(cfg)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()[-last:]
    return [json.loads(x) for x in lines if x.strip()]
