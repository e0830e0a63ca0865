"""Logging for every payrun process: plain lines, or one JSON object per line when
``log.json = true`` (or PAYRUN_LOG_JSON=1). Job events add job_id, queue, attempt and
outcome as fields. Nothing here ever formats a snapshot: no salary, no bank account."""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone
from pathlib import Path

JOB_FIELDS = ("job_id", "queue", "attempt", "outcome", "error", "worker", "duration_s")

TEST_HOOKS = {
    "PAYRUN_TEST_JOBS": "workers also run the test suite's jobs (hang, spin, crash) named in Redis",
    "PAYRUN_CLOCK_FILE": "the scheduler reads the time from a file",
    "PAYRUN_TEST_TICK_PAUSE": "scheduler ticks pause for the test suite",
}
"""Environment variables the test suite sets to steer payrun's processes: never for a real run."""


def test_hooks_set(env=os.environ) -> list[str]:
    """The test hooks set in ``env`` (pure), each as 'NAME: what it does'."""
    return [f"{k}: {what}" for k, what in TEST_HOOKS.items() if env.get(k)]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for f in JOB_FIELDS:
            v = getattr(record, f, None)
            if v is not None:
                out[f] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """``2026-12-04 14:36:06,708 +0000 INFO name: message``: the host's local time with its
    UTC offset, so a log line can be matched with `payrun job`'s and the console's times
    (shown in the configured timezone) at 02:00 without guessing the zone."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        local = datetime.fromtimestamp(record.created).astimezone()
        return f"{local:%Y-%m-%d %H:%M:%S},{int(record.msecs):03d} {local:%z}"


def debug_loggers() -> list[str]:
    """Loggers named in PAYRUN_LOG_DEBUG (comma-separated) log at DEBUG, the rest at the
    process's level. ``payrun.sends``: one line per email request, when it passed the
    send gate and when it was written (for tracing 429s: ``bench/email.py --trace``)."""
    return [n.strip() for n in os.environ.get("PAYRUN_LOG_DEBUG", "").split(",") if n.strip()]


def supervised_log_file(env=os.environ) -> Path | None:
    """The log file supervisord writes this program's output to (supervisor.conf:
    ``$PAYRUN_HOME/log/<process name>.log``), if this process is a supervised program and
    the file is there; else None (pure but for the existence check)."""
    name, home = env.get("SUPERVISOR_PROCESS_NAME"), env.get("PAYRUN_HOME")
    if not env.get("SUPERVISOR_ENABLED") or not name or not home or "/" in name or name.startswith("."):
        return None
    path = Path(home) / "log" / f"{name}.log"
    return path if path.is_file() else None


class SupervisedStreamHandler(logging.StreamHandler):
    """Standard error, as supervisord captures it; once that pipe is gone (supervisord
    died: its programs finish their jobs in hand, jobs.runtime / payrun.supervise
    ``stop_with_supervisord``), the lines go straight to the end of the same log file
    supervisord wrote, so the last lines of a program that outlived it are not lost."""

    def __init__(self, fallback: Path | None = None):
        super().__init__()
        self.fallback = fallback
        self.switched = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        import sys

        err = sys.exc_info()[1]
        if self.fallback is not None and not self.switched and isinstance(err, (BrokenPipeError, ConnectionError)):
            try:  # (not setStream: it flushes the broken pipe first)
                self.stream = open(self.fallback, "a", encoding="utf-8", buffering=1)
            except OSError:
                self.fallback = None
            else:
                self.switched = True
                self.emit(record)  # (into the file now)
                return
        super().handleError(record)


def setup(level: str = "INFO", as_json: bool | None = None) -> None:
    if as_json is None:
        as_json = os.environ.get("PAYRUN_LOG_JSON") == "1"
    handler = SupervisedStreamHandler(supervised_log_file())
    handler.setFormatter(JsonFormatter() if as_json else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # WeasyPrint logs 7 "Step n - ..." lines per render at INFO: two thirds of a render
    # worker's log, none of it news. Its warnings (a missing font, a bad CSS rule) stay.
    logging.getLogger("weasyprint.progress").setLevel(logging.WARNING)
    for name in debug_loggers():  # e.g. PAYRUN_LOG_DEBUG=payrun.sends: one topic, not RQ's chatter
        logging.getLogger(name).setLevel(logging.DEBUG)
    for hook in test_hooks_set():  # set by the test suite; in production a mistake to see at once
        logging.getLogger("payrun").warning("test hook set, never for a real run: %s", hook)
    if as_json:  # RQ installs its own handlers on its loggers: route them through ours
        for name in ("rq.worker", "rq.job", "rq.scheduler"):
            lg = logging.getLogger(name)
            lg.handlers[:] = []
            lg.propagate = True
