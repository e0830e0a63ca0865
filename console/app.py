"""The on-call console: a small App; views in screens/, confirmations in dialogs/.

Refresh: one thread worker reads a snapshot (console.data.Source); the next poll is
scheduled when the last has returned, so a slow Redis delays data, never keys. A ticker
on the UI thread ages the "last refresh" line every second, so a stale view says so.
"""

from __future__ import annotations

import shlex
import time
from typing import Any, Callable

from textual import events, work
from textual.app import App
from textual.binding import Binding
from textual.timer import Timer
from textual.widgets import Input

from console import actions
from console.data import Snapshot, Source
from console.fmt import duration

WRITE_ACTIONS = frozenset({
    "retry_one", "retry_selected", "retry_all", "drain", "drain_all", "resume", "resume_all",
    "stop_worker", "limits",
})
"""Bindings that change something: hidden and refused with --readonly."""


TYPEAHEAD_MAX_S = 1.0
"""Keys after `:` wait for its bar this long at most (it takes focus in milliseconds)."""


class ConsoleApp(App):
    CSS_PATH = "console.tcss"
    TITLE = "payrun console"
    ENABLE_COMMAND_PALETTE = False  # `:` is the command bar; ctrl+p would take footer room
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("colon", "command_bar", "Cmd", key_display=":"),
    ]

    def __init__(self, source: Source, readonly: bool = False, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.time, poll: bool = True, no_blink: bool = False):
        super().__init__()
        self.source = source
        self.readonly = readonly
        self.interval_s = interval_s
        self.clock = clock
        self.poll_enabled = poll
        self.no_blink = no_blink
        self.snapshot: Snapshot | None = None
        self.last_ok_at: float | None = None
        self.polls = 0
        self._polling = False
        self._again = False
        self._next: Timer | None = None
        self.typeahead: list[str] | None = None
        """Keys typed after `:` before its bar had focus (mounting takes a moment): the
        command's text, not hotkeys. None when no bar is on its way."""
        self._typeahead_since = 0.0
        self._colon_at = -TYPEAHEAD_MAX_S
        """When a `:` last came in (its bar not yet on its way): the keys behind it belong
        to the command, and a read-only console must not refuse them on their way in."""

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Every notification as plain text (screens' ``self.notify`` pass markup=True):
        they carry what was typed (a job id, a filter) and what Redis or a provider said,
        and a message with ``[/]`` in it raised MarkupError as it was laid out (`:retry
        x[/]y` left a blank console)."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=False)

    # ---- lifecycle ------------------------------------------------------------------
    def on_mount(self) -> None:
        from console.screens.overview import OverviewScreen

        self.push_screen(OverviewScreen())
        self.set_interval(1.0, self._tick)
        self.refresh_now()

    def live_screen(self):
        """The view the operator is on: the top screen, or the one under a dialog (a
        confirmation, the limits): it goes on showing live figures and their age there,
        instead of freezing under it with a "● live" that no longer ages."""
        from textual.screen import ModalScreen

        for screen in reversed(self.screen_stack):
            if not isinstance(screen, ModalScreen):
                return screen
        return self.screen

    def _tick(self) -> None:
        from console.widgets.status import StatusBar

        for bar in self.live_screen().query(StatusBar):
            bar.update_text()

    # ---- polling ----------------------------------------------------------------------
    def refresh_now(self) -> None:
        """Poll now (after an action), or right after the poll in flight."""
        if self._polling:
            self._again = True
            return
        if self._next is not None:
            self._next.stop()
            self._next = None
        self._polling = True
        self._poll()

    @work(thread=True, exit_on_error=False, group="poll")
    def _poll(self) -> None:
        try:
            snap = self.source.snapshot()
        except Exception as e:  # Source.snapshot catches its own; this is the last guard
            snap = Snapshot(taken_at=self.clock(), error=f"refresh failed: {type(e).__name__}: {e}")
        try:
            self.call_from_thread(self._got, snap)
        except RuntimeError:  # the app is closing
            pass

    def _got(self, snap: Snapshot) -> None:
        self._polling = False
        self.polls += 1
        self.snapshot = snap
        if not snap.error or "Redis" not in snap.error:
            self.last_ok_at = snap.taken_at
        try:
            show = getattr(self.live_screen(), "show_snapshot", None)
            if show is not None:
                show(snap)
        except Exception as e:  # noqa: BLE001 - a view failing on one snapshot must not end the polling:
            # this ran in call_from_thread, the poll thread took the error with it and no next poll was
            # set: the console went on reading "last refresh 43s ago (Redis slow; still trying)" with
            # Redis fine (session 43, tmux). It says so, and polls again.
            from payrun.text import visible

            said = f"the {getattr(self.live_screen(), 'CRUMB', 'view')} view failed to show a refresh " \
                   f"({type(e).__name__}: {visible(str(e))[:160]})"
            snap.error = f"{snap.error}; {said}" if snap.error else said
        finally:
            if self._again:
                self._again = False
                self.refresh_now()
            elif self.poll_enabled:
                self._next = self.set_timer(self.interval_s, self.refresh_now)
            self._tick()

    def stale_reason(self, now: float) -> str | None:
        snap = self.snapshot
        if snap is None:
            return None
        ref = self.last_ok_at if self.last_ok_at is not None else snap.taken_at
        age = max(0.0, now - ref)
        if snap.error and "Redis" in snap.error:
            return f"last refresh {duration(age)} ago: {snap.error}"
        if age > max(3.0, 3 * self.interval_s):
            return f"last refresh {duration(age)} ago (Redis slow; still trying)"
        if snap.error:
            return snap.error
        return None

    # ---- actions: refused when read-only, run off the UI thread, audited ---------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.readonly and action in WRITE_ACTIONS:
            return False
        return True

    def refuse_if_readonly(self, what: str) -> bool:
        if self.readonly:
            self.notify(f"read-only console: {what} refused", severity="error")
            return True
        return False

    def act(self, label: str, fn: Callable[..., actions.Outcome], *args: Any, **kw: Any) -> None:
        """Run an action (console.actions) in a thread; tell the outcome and its command."""
        if self.refuse_if_readonly(label):
            return

        def run() -> None:
            try:
                out = fn(self.source.cfg, self.source.action_conn, *args, **kw)
                msg, sev = f"{out.message}\n(same as: {out.command})", "information" if out.ok else "warning"
            except Exception as e:
                msg, sev = f"{label} failed: {e}", "error"
            self.call_from_thread(self._acted, msg, sev)

        self.run_worker(run, thread=True, exit_on_error=False, group="actions", name=label)

    def _acted(self, msg: str, severity: str) -> None:
        self.notify(msg, severity=severity, timeout=8)
        self.refresh_now()
        reload = getattr(self.screen, "reload", None)
        if reload is not None:
            reload()

    # ---- navigation & commands -------------------------------------------------------
    def action_help(self) -> None:
        from console.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.screen))

    def action_command_bar(self) -> None:
        from console.widgets.command_bar import CommandBar

        if not self.screen.query(CommandBar):
            self.typeahead, self._typeahead_since = [], time.monotonic()
            self._colon_at = -TYPEAHEAD_MAX_S  # (its keys are kept from here on: typeahead)
            self.screen.mount(CommandBar(return_to=self.screen.focused))

    async def on_event(self, event: events.Event) -> None:
        # `:workers` typed or pasted in one burst: the keys after `:` arrive before the bar
        # has focus, and were taken as hotkeys (w opened the workers view, d a drain).
        # Until the bar takes them (CommandBar.on_focus) they are kept for it: caught on
        # their way in, or on their way back up (a key queued before `:`'s binding ran
        # was already forwarded, and would meet the screen's bindings here).
        if self.typeahead is not None and time.monotonic() - self._typeahead_since > TYPEAHEAD_MAX_S:
            self.typeahead = None  # the bar never took focus: never swallow keys for long
        if self.typeahead is not None and isinstance(event, events.Paste):
            # a paste right after `:` (on its way in, or back up, as keys are)
            self.typeahead.extend(event.text.replace("\r", "\n"))
            event.stop()
            return
        if (self.typeahead is None and isinstance(event, events.Paste) and not event.is_forwarded
                and event.text.startswith(":") and not isinstance(self.focused, Input)):
            # `:workers` pasted whole (a terminal sends a paste as one event, not as keys)
            self.action_command_bar()
            if self.typeahead is not None:
                self.typeahead.extend(event.text[1:].replace("\r", "\n"))
            event.stop()
            return
        if self.typeahead is not None and isinstance(event, events.Key):
            kept = True
            if event.key == "escape":
                self.typeahead.append("\x1b")
            elif event.key == "enter":
                self.typeahead.append("\n")
            elif event.key == "backspace":
                if self.typeahead:
                    self.typeahead.pop()
            elif event.is_printable and event.character:
                self.typeahead.append(event.character)
            else:
                kept = False  # ctrl+q and the like keep their meaning
            if kept:
                event.stop()
                return
        if (isinstance(event, events.Key) and not event.is_forwarded and event.character == ":"
                and self.typeahead is None and not isinstance(self.focused, Input)):
            self._colon_at = time.monotonic()
        colon_pending = self.typeahead is None and time.monotonic() - self._colon_at <= TYPEAHEAD_MAX_S
        if (self.readonly and isinstance(event, events.Key) and not event.is_forwarded and not colon_pending
                and not isinstance(self.focused, Input) and (what := self._write_key(event.key))):
            # hidden from the footer and refused by check_action, but a key that did nothing
            # at all read as a console that does not answer
            self.notify(f"read-only console: {event.key} ({what}) is disabled", severity="warning")
            event.stop()
            return
        await super().on_event(event)

    def _write_key(self, key: str) -> str | None:
        """What ``key`` would change on the view shown (its binding's description), if its
        action is one of WRITE_ACTIONS."""
        for b in type(self.screen).BINDINGS:
            if isinstance(b, Binding) and b.action in WRITE_ACTIONS and key in b.key.split(","):
                return b.description.lower() or b.action
        return None

    def take_typeahead(self) -> str:
        """The keys kept for the command bar now taking focus (and stop keeping them)."""
        text, self.typeahead = "".join(self.typeahead or ()), None
        return text

    def go(self, name: str, **kw: Any) -> None:
        """Show a view on top of the overview (Esc goes back to it)."""
        from console.screens.failed import FailedScreen
        from console.screens.overview import OverviewScreen
        from console.screens.running import RunningScreen, WorkersScreen

        while len(self.screen_stack) > 2 and not isinstance(self.screen, OverviewScreen):
            self.pop_screen()
        if name == "overview":
            return
        screen = {"failed": FailedScreen, "running": RunningScreen, "workers": WorkersScreen}[name](**kw)
        self.push_screen(screen)

    def run_command(self, text: str) -> None:
        try:
            words = shlex.split(text)
        except ValueError as e:
            self.notify(f"command: {e}", severity="error")
            return
        word, args = words[0].lower(), words[1:]
        word = {"q": "quit", "f": "failed", "r": "running", "w": "workers", "o": "overview", "h": "help",
                "?": "help", "m": "month"}.get(word, word)
        fn = getattr(self, f"command_{word}", None)
        if fn is None:
            self.notify(f"unknown command {word!r}: try :help", severity="error")
            return
        fn(args)

    def command_quit(self, args: list[str]) -> None:
        self.exit()

    def command_help(self, args: list[str]) -> None:
        self.action_help()

    def command_overview(self, args: list[str]) -> None:
        self.go("overview")

    def command_failed(self, args: list[str]) -> None:
        from console.failed import FailedFilter

        text = " ".join(args)
        try:
            FailedFilter.parse(text)
        except ValueError as e:  # (it opened every failed job, unfiltered, under the error)
            self.notify(f":failed: {e}", severity="error")
            return
        self.go("failed", filter_text=text)

    def command_running(self, args: list[str]) -> None:
        self.go("running")

    def command_workers(self, args: list[str]) -> None:
        self.go("workers")

    def command_retry(self, args: list[str]) -> None:
        if not args or any(a.startswith("-") for a in args):
            # (`:retry --all` was taken for a job id, behind a one-key confirmation)
            self.notify(":retry takes job ids. Every failed job, or those matching a filter: the failed view "
                        "(f), / to filter, then A (it shows the count and asks for it)", severity="warning",
                        timeout=8)
            return
        self.offer_retry(list(args))

    def offer_retry(self, job_ids: list[str]) -> None:
        """Look the ids up, then say at once those that cannot be retried and offer the
        rest (`:retry ID…`, and the failed list's r: on a job with no data it offered y/n)."""
        if self.refuse_if_readonly("retry"):
            return
        args = list(job_ids)

        def check() -> None:  # (off the keyboard's thread: Redis and payroll reads)
            try:
                preview = self.source.retry_preview(list(args))
            except Exception:  # noqa: BLE001 - cannot tell now: the dialog, and the action says
                preview = None
            self.call_from_thread(self._offer_retry, list(args), preview)

        self.run_worker(check, thread=True, exit_on_error=False, group="actions", name="retry-check")

    def _offer_retry(self, asked: list[str], preview: dict | None) -> None:
        """`:retry ID…`'s confirmation, for the ids that can be retried; the others are
        said at once: ids that are no failed job (`:retry nosuch-job` was offered, and
        refused only after the y), and failed jobs whose data is missing or not JSON (they
        were offered too: `payrun retry` refuses them, nothing to run). The dialog says what
        the failed list's r says: a send refused for an address changed since goes to the
        new one (`:retry` said only "requeue"), one failed on its data fails again."""
        from console.dialogs.confirm import ConfirmKey, ConfirmTyped
        from console.failed import retry_one_body

        p = preview or {}
        missing, unreadable = p.get("not_failed", []), p.get("unreadable", {})
        args = [a for a in asked if a not in missing and a not in unreadable]
        said = []
        if missing:
            names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            said.append(f"not among failed jobs: {names} (finished, retried already, or gone)")
        for job_id, why in list(unreadable.items())[:3]:
            said.append(f"{job_id} cannot be retried: {why}: there is nothing to run (`payrun retry` refuses "
                        "it too)")
        if len(unreadable) > 3:
            said.append(f"and {len(unreadable) - 3} more failed jobs whose data is missing or unreadable")
        if said:
            self.notify(":retry: " + "\n".join(said) + ("" if args else "; nothing to retry"),
                        severity="error" if not args else "warning", timeout=10)
        if not args:
            return
        cmd = actions.retry_command(args)
        fixed, on_data = set(p.get("address_changed", [])), set(p.get("permanent", []))
        resent = set(p.get("delivered_by_resend", []))
        if len(args) == 1:
            a = args[0]
            body = retry_one_body({"address_changed": a in fixed, "permanent": a in on_data,
                                   "delivered_by_resend": a in resent, "error": p.get("errors", {}).get(a, ""),
                                   "new_address": p.get("new_address", {}).get(a)})
            dialog = ConfirmKey(f"Retry {a}?", body, cmd)
        else:
            notes = []
            if n := len(on_data & set(args)):
                notes.append(f"{n:,} of them failed on the employee's data (an address refused): they fail again "
                             "unless fixed first (payrun import)")
            if n := len(fixed & set(args)):
                notes.append(f"{n:,} of them had an address refused that the payroll data has changed since: "
                             f"{'it goes' if n == 1 else 'they go'} to the new one")
            if n := len(resent & set(args)):
                notes.append(f"{n:,} of them had their slip delivered by a `payrun resend` since: a retry emails "
                             "it again")
            dialog = ConfirmTyped("Retry these failed jobs?", len(args), args[:5], cmd, note="\n".join(notes))
        self.push_screen(dialog, lambda ok: ok and self.act("retry", actions.retry, list(args), cmd))

    def _queue_arg(self, args: list[str], command: str) -> tuple[bool, str | None]:
        """(ok, queue) of `:drain [Q]` / `:resume [Q]`: an unknown queue is said at once
        (it was offered as "Drain nosuch?" and refused only after the y)."""
        if not args:
            return True, None
        if args[0] not in actions.keys.QUEUES:
            self.notify(f":{command}: unknown queue {args[0]!r} (choose from {', '.join(actions.keys.QUEUES)})",
                        severity="error")
            return False, None
        return True, args[0]

    def command_drain(self, args: list[str]) -> None:
        ok, queue = self._queue_arg(args, "drain")
        if ok:
            self.confirm_drain(queue)

    def command_resume(self, args: list[str]) -> None:
        ok, queue = self._queue_arg(args, "resume")
        if not ok:
            return
        if queue and self.snapshot is not None and self.snapshot.suspended:
            # (as u: `:resume send-email` offered "Resume send-email? Workers take new jobs
            # again", and nothing moved: the drain of every queue held)
            self.confirm_resume(None, why=f"Intake is stopped on every queue (a drain of all): resuming {queue} "
                                          "alone would move nothing.")
            return
        self.confirm_resume(queue)

    def command_stop(self, args: list[str]) -> None:
        if not args:
            self.notify(":stop WORKER (names in :workers)", severity="warning")
            return
        self.confirm_stop(args[0])

    def command_limits(self, args: list[str]) -> None:
        if not args:
            self.ask_limits()
            return
        kv = dict(a.split("=", 1) for a in args if "=" in a)
        try:
            cap = int(kv["cap"]) if "cap" in kv else None
            rate = float(kv["rate"]) if "rate" in kv else None
        except ValueError:
            self.notify(":limits cap=N rate=R (numbers)", severity="error")
            return
        problem = actions.limits_problem(cap, rate)
        if problem:
            self.notify(f":limits: {problem}", severity="error")
            return
        self.confirm_limits(cap, rate)

    def command_month(self, args: list[str]) -> None:
        if not args:
            self.next_month()
            return
        self.show_month(None if args[0].lower() == "latest" else args[0])

    # ---- the month shown -------------------------------------------------------------
    def next_month(self) -> None:
        """m: the month before the one shown. After the oldest: back to following the run
        started last, or, when a higher month exists than that one (an old month re-run
        last), to the highest month, pinned. Reads the last snapshot: no key waits on the
        refresh thread."""
        snap = self.snapshot
        months = snap.months if snap else []
        if not months:
            self.notify("no pay run in the ledger yet", severity="warning")
            return
        latest = snap.latest_month or months[-1]
        shown = self.source.month or latest
        earlier = [m for m in months if m < shown]
        if earlier:
            self.show_month(earlier[-1])
        else:
            self.show_month(None if months[-1] == latest else months[-1])

    def show_month(self, month: str | None) -> None:
        """Pin the overview to ``month`` (None: follow the run started last)."""
        months = self.snapshot.months if self.snapshot else []
        if month is not None and month not in months:
            self.notify(f"no pay run for {month!r}: runs in the ledger are {', '.join(months[-8:]) or 'none'}",
                        severity="error")
            return
        self.source.month = month
        if month is None:
            self.notify("following the pay run started last (m: the month before)")
        else:
            self.notify(f"showing {month}; m: the month before, `:month latest` follows new runs again")
        self.refresh_now()

    def command_audit(self, args: list[str]) -> None:
        from console.data import parse_ts
        from console.fmt import clock

        tz = self.source.cfg.timezone
        rows = actions.read_audit(self.source.cfg, 8)

        def when(ts: str) -> str:  # the console's clock, as everywhere else on screen (the log is UTC)
            at = parse_ts(ts)
            return clock(at, tz) if at else ts[11:19]

        text = "\n".join(f"{when(r['ts'])} {r['who']} {r['command']} ({r['count']})" for r in rows) or "no actions yet"
        self.notify(text, title=f"audit log ({tz} times): {actions.audit_path(self.source.cfg)}", timeout=15)

    # ---- confirmations shared by the screens ---------------------------------------
    def confirm_drain(self, queue: str | None) -> None:
        from console.dialogs.confirm import ConfirmKey, ConfirmTyped

        if self.refuse_if_readonly("drain"):
            return
        if queue:
            body = (f"Workers finish the {queue} jobs they hold and take no new ones from {queue}.\n"
                    "Jobs keep waiting in the queue; resume with u.")
            self.push_screen(ConfirmKey(f"Drain {queue}?", body, f"payrun drain --queue {queue}"),
                             lambda ok: ok and self.act("drain", actions.drain, queue))
        else:
            self.push_screen(ConfirmTyped("Drain EVERY queue (stop all intake)?", 3, list(actions.keys.QUEUES),
                                          "payrun drain", expect="all", what="queues stop taking work"),
                             lambda ok: ok and self.act("drain", actions.drain, None))

    def confirm_resume(self, queue: str | None, why: str = "") -> None:
        from console.dialogs.confirm import ConfirmKey

        if self.refuse_if_readonly("resume"):
            return
        what = queue or "every queue (lifts all drains)"
        cmd = "payrun resume" + (f" --queue {queue}" if queue else "")
        self.push_screen(ConfirmKey(f"Resume {what}?", (why + "\n" if why else "") + "Workers take new jobs again.", cmd),
                         lambda ok: ok and self.act("resume", actions.resume, queue))

    def confirm_stop(self, worker: str) -> None:
        from console.dialogs.confirm import ConfirmKey

        if self.refuse_if_readonly("stop worker"):
            return
        workers = self.snapshot.workers if self.snapshot is not None else []
        w = next((w for w in workers if w.name == worker), None)
        if workers and w is None:  # (`:stop nosuch` was refused only after its y)
            self.notify(f"no worker named {worker!r} (names in :workers)", severity="error")
            return
        body = ("It finishes the job in hand, then exits (supervisord starts a fresh one:\n"
                "drain first if it should take no more work). A send-email lane stops its whole process.")
        title = f"Stop worker {worker}?"
        if w is not None and w.kind == "email":
            # the title named one lane; the y stops every lane of the process
            lanes = [x for x in workers if x.process == w.process]
            busy = sum(1 for x in lanes if x.job_id and x.alive)
            title = (f"Stop the send-email process {w.pid} on {w.host} (all {len(lanes)} lanes, "
                     f"{busy} sending)?")
        self.push_screen(ConfirmKey(title, body, f"payrun stop-worker {worker}"),
                         lambda ok: ok and self.act("stop worker", actions.stop_worker, worker))

    def ask_limits(self) -> None:
        from console.dialogs.confirm import LimitsDialog

        if self.refuse_if_readonly("limits"):
            return
        lim = self.snapshot.limits if self.snapshot else None
        cfg = self.source.cfg
        self.push_screen(LimitsDialog(lim.cap if lim else cfg.limits.email_concurrency,
                                      lim.rate_per_s if lim else cfg.limits.email_rate_per_s, known=lim is not None,
                                      slots_for=self.slots_for_rate),
                         lambda v: v and self.confirm_limits(*v))

    def slots_for_rate(self, rate_per_s: float) -> int | None:
        """The sends in flight ``rate_per_s`` allows (jobs.limits.rate_slots), as the limits
        line's figure is read (console.data.read_limits)."""
        from jobs.limits import rate_slots
        from jobs.policy import start_wait_budget_s

        return rate_slots(rate_per_s, start_wait_budget_s(self.source.cfg.email.timeout_s))

    def confirm_limits(self, cap: int | None, rate: float | None) -> None:
        from console.dialogs.confirm import ConfirmKey

        if self.refuse_if_readonly("limits"):
            return
        cmd = "payrun limits set" + (f" --cap {cap}" if cap is not None else "") + (
            f" --rate {rate:g}" if rate is not None else "")
        lim = self.snapshot.limits if self.snapshot else None
        # old -> new, field by field: a digit typed right after Tab can land in the field
        # Tab was leaving (focus moves a moment later), and "--cap 9" alone reads like a rate
        change = "; ".join(
            f"{what} {old:g} → {new:g}{unit}" if old is not None else f"{what} → {new:g}{unit}"
            for what, old, new, unit in (("cap", lim.cap if lim else None, cap, " in flight"),
                                         ("rate", lim.rate_per_s if lim else None, rate, "/s"))
            if new is not None)
        from console.fmt import cap_over_rate_note

        # the cap and rate in force after the change (`:limits cap=80` comes here without the dialog)
        new_cap = cap if cap is not None else (lim.cap if lim else None)
        new_rate = rate if rate is not None else (lim.rate_per_s if lim else None)
        note = cap_over_rate_note(new_cap, new_rate, self.slots_for_rate(new_rate) if new_rate else None)
        self.push_screen(ConfirmKey(f"Change the email limits: {change}?",
                                    "Every sender on every host uses them on its next send."
                                    + (f"\nNote: {note}." if note else ""), cmd),
                         lambda ok: ok and self.act("limits", actions.set_limits, cap, rate))
