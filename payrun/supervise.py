"""`payrun up/down/ps`: supervisord with the repository's supervisor.conf."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from payrun import redis_server
from payrun.config import Config
from payrun.errors import SetupError

CONF = Path(__file__).resolve().parent.parent / "supervisor.conf"


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise SetupError(f"{name} not found: run scripts/setup (it installs supervisor into the venv)")
    return found


def env(cfg: Config) -> dict[str, str]:
    redis_server.private_dir(cfg.home)
    redis_server.private_dir(cfg.log_dir)
    e = dict(os.environ)
    e.update(
        PAYRUN_HOME=str(cfg.home),
        PAYRUN_BIN=_bin("payrun"),
        PAYRUN_REDIS_SUPERVISED="1" if cfg.embedded_redis else "",
        PAYRUN_RENDER_WORKERS=str(cfg.render_workers),
        PAYRUN_REDIS_AUTOSTART="true" if cfg.embedded_redis else "false",
        PAYRUN_PROVIDER_AUTOSTART="false" if cfg.email.url else "true",
    )
    return e


def ctl(cfg: Config, *args: str) -> tuple[str, int]:
    p = subprocess.run([_bin("supervisorctl"), "-c", str(CONF), *args], env=env(cfg),
                       capture_output=True, text=True)
    return p.stdout + p.stderr, p.returncode


def up(cfg: Config, wait: bool = True, timeout_s: float = 60) -> str:
    if not CONF.exists():
        raise SetupError(f"{CONF} is missing")
    out, code = ctl(cfg, "status")
    if "no such file" not in out and "refused" not in out.lower() and code in (0, 3):
        return "supervisord is already running:\n" + out.rstrip()
    p = subprocess.run([_bin("supervisord"), "-c", str(CONF)], env=env(cfg), capture_output=True, text=True)
    if p.returncode != 0:
        raise SetupError(f"supervisord failed to start: {(p.stderr or p.stdout).strip()}")
    if not wait:
        return "supervisord started"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out, code = ctl(cfg, "status")
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if lines and all(" RUNNING " in ln or " STOPPED " in ln for ln in lines):
            return out.rstrip()
        if any(" FATAL " in ln or " BACKOFF " in ln for ln in lines):
            raise SetupError("a program failed to start:\n" + out.rstrip() + f"\nlogs: {cfg.log_dir}")
        time.sleep(0.5)
    raise SetupError(f"not everything was running after {timeout_s:.0f} s:\n{out.rstrip()}")


def down(cfg: Config) -> str:
    out, code = ctl(cfg, "status")
    if code not in (0, 3):
        stopped = redis_server.stop(cfg)
        return "supervisord is not running" + ("; stopped the embedded Redis" if stopped else "")
    # workers first (they finish their jobs within the grace), the ledger drains, Redis last
    ctl(cfg, "stop", "pdf-render:*", "send-email", "control")
    ctl(cfg, "stop", "ledger", "provider")
    ctl(cfg, "stop", "redis")
    out, _ = ctl(cfg, "shutdown")
    redis_server.stop(cfg)  # an embedded server started outside supervisord, if any
    return out.strip() or "stopped"
