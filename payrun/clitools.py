"""What every `payrun` command shares, wherever it is defined (payrun/, scheduler/,
console/). Its own module, not payrun.cli: under `python -m payrun.cli` that module is
__main__, and importing it again would make a second copy."""

from __future__ import annotations

import functools
import sys

import click

class FilePath(click.Path):
    """click.Path that turns a name no file can have (a NUL byte) into a usage error:
    click's own check passes it to os.stat, which raises ValueError (a traceback)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and "\x00" in value:
            self.fail("a file name cannot contain a NUL byte", param, ctx)
        return super().convert(value, param, ctx)


pass_ctx = click.pass_obj
"""The group's context object (payrun.cli.Ctx: .cfg, .redis(), .ledger(), .payroll())."""


def handle_errors(fn):
    """A PayrunError becomes one line `payrun: …` on stderr and exit 2 (bad input, bad
    configuration), or exit 1 when Redis cannot be reached (the system is down, not the
    command wrong: a script can tell the two apart); Ctrl-C exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from payrun.errors import PayrunError, RedisUnavailable

        try:
            return fn(*args, **kwargs)
        except PayrunError as e:
            click.echo(f"payrun: {e}", err=True)
            sys.exit(1 if isinstance(e, RedisUnavailable) else 2)
        except KeyboardInterrupt:
            click.echo("payrun: interrupted", err=True)
            sys.exit(130)
        except Exception as e:
            from jobs.policy import redis_refusal_reason, redis_refuses_writes
            from payrun.redis_server import refusal_text

            if (said := no_room_text(e)) is not None:
                click.echo(f"payrun: {said}", err=True)
                sys.exit(1)
            if not redis_refuses_writes(e):
                raise
            click.echo(f"payrun: {refusal_text(redis_refusal_reason(e))}", err=True)
            sys.exit(1)

    return wrapper


def no_room_text(e: BaseException, home=None) -> str | None:
    """The one line for a command that met a full disk under the data directory (SQLite
    could not write, or make its journal, in the ledger or payroll database; a file could
    not be written): where, how much room is left, what to do. None for any other error.
    (A `payrun status` or `payrun check` on a full data directory ended in a 40-line
    traceback, "sqlite3.OperationalError: disk I/O error", session-42 drill.)"""
    from payrun import diskspace

    if home is None:
        try:
            ctx = click.get_current_context(silent=True)
            home = ctx.obj.cfg.home if ctx is not None and ctx.obj is not None else None
        except Exception:  # noqa: BLE001 - no configuration to find the data directory by: not ours to say
            home = None
    if home is None:
        return None
    where = getattr(e, "filename", None) if isinstance(e, OSError) and getattr(e, "filename", None) else home
    free = diskspace.free_bytes(where)
    if not diskspace.no_room(e, free):
        return None
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    room = "" if free is None else f"; {diskspace.size_text(free)} free there"
    return (f"no space left on the disk of {where} ({why}{room}): free space there ({diskspace.what_to_free(home)}), "
            f"then run this again. Meanwhile the workers go on, and the ledger applies their events once there is room")


def local_time(iso: str | None, tz: str) -> str:
    """An ISO timestamp (UTC, as the ledger and the audit log keep them) in the payroll's
    zone, with its offset: "2026-12-04 13:14:16 +06". Status notes and the console speak
    in that zone; `payrun job` and `payrun audit` showed UTC ("07:14:51+00:00" for the same
    moment). Anything unreadable comes back as it was."""
    if not iso:
        return "?"
    from datetime import datetime, timezone
    from zoneinfo import ZoneInfo

    try:
        when = datetime.fromisoformat(str(iso).replace("Z", "+00:00"))
    except ValueError:
        return str(iso)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(ZoneInfo(tz)).strftime("%Y-%m-%d %H:%M:%S %z")[:-2]
