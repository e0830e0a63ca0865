"""Confirmations whose friction grows with the action's reach.

- ``ConfirmKey``: one job, one queue, one worker: a keypress (y), anything else cancels.
- ``ConfirmTyped``: a bulk action: the count, a sample, the equivalent `payrun` command,
  confirmed only by typing the count (or the word shown) and Enter.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static


def _same_as(command: str) -> Text:
    """"same as: <command>", the command in bold and as written (it holds a filter typed)."""
    return Text.assemble("same as: ", (command, "bold"))


class ConfirmKey(ModalScreen[bool]):
    BINDINGS = [
        Binding("y", "answer(True)", "Yes, do it"),
        Binding("n,escape", "answer(False)", "Cancel"),
    ]

    def __init__(self, title: str, body: str, command: str):
        super().__init__()
        self.title_text, self.body, self.command = title, body, command

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="confirm"):
            # as plain text: the body holds a provider's error, the title and the command a
            # job id or a filter typed ("[/]" in one stopped the console with a MarkupError)
            yield Static(self.title_text, classes="dialog-title", markup=False)
            yield Static(self.body, classes="dialog-body", markup=False)
            yield Static(_same_as(self.command), classes="dialog-command")
            yield Static("[b]y[/b] do it · [b]n[/b]/Esc cancel", classes="dialog-keys", markup=True)

    def on_key(self, event) -> None:
        if event.key not in ("y", "n", "escape"):
            event.stop()
            self.dismiss(False)

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ConfirmTyped(ModalScreen[bool]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, count: int, sample: list[str], command: str, expect: str | None = None,
                 what: str = "jobs", note: str = ""):
        super().__init__()
        self.title_text, self.count, self.sample, self.command = title, count, sample, command
        self.note = note
        """A warning shown under the count (the retry dialogs: how many will fail again)."""
        self.expect = expect if expect is not None else str(count)
        self.what = what

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="confirm bulk"):
            yield Static(self.title_text, classes="dialog-title", markup=False)
            what = self.what[:-1] if self.count == 1 and self.what.endswith("s") else self.what
            yield Static(f"{self.count:,} {what}", classes="dialog-count")
            if self.note:
                yield Static(self.note, classes="dialog-note", markup=False)
            if self.sample:
                more = f"\n  … and {self.count - len(self.sample):,} more" if self.count > len(self.sample) else ""
                yield Static("  " + "\n  ".join(self.sample) + more, classes="dialog-sample", markup=False)
            yield Static(_same_as(self.command), classes="dialog-command")
            yield Static(f"Type [b]{self.expect}[/b] and Enter to confirm · Esc cancels", classes="dialog-keys",
                         markup=True)
            yield Input(placeholder=self.expect, id="typed")

    def on_mount(self) -> None:
        inp = self.query_one("#typed", Input)
        inp.cursor_blink = False if getattr(self.app, "no_blink", False) else inp.cursor_blink
        inp.focus()
        self.call_after_refresh(self._fit)

    def on_resize(self) -> None:
        # in a short terminal (a tmux pane of 14 rows) the dialog was cut at the bottom: the
        # box the count is typed into and "Type 169 and Enter" were gone, and what was typed
        # went in blind. The sample goes first; the count, the command and the box stay.
        # the blank lines between its parts go next
        self.query_one("#dialog").remove_class("no-sample", "tight")
        self.call_after_refresh(self._fit)

    def _fit(self) -> None:
        dialog = self.query_one("#dialog")
        for step in ("no-sample", "tight"):
            if dialog.virtual_size.height <= dialog.scrollable_content_region.height or dialog.has_class(step):
                continue
            dialog.add_class(step)
            self.call_after_refresh(self._fit)  # (measured again once laid out)
            return

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip().replace(",", "") == self.expect.replace(",", ""):
            self.dismiss(True)
        else:
            self.query_one("#typed", Input).value = ""
            self.notify(f"not confirmed: type {self.expect} exactly", severity="warning")

    def action_cancel(self) -> None:
        self.dismiss(False)


class LimitsDialog(ModalScreen[tuple | None]):
    """Ask for a new cap and/or rate; returns (cap, rate) with None for unchanged."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, cap: int, rate: float, known: bool = True, slots_for=None):
        """``known``: ``cap`` and ``rate`` are the limits in force as the last refresh read
        them; False: that refresh could not read them (Redis unreachable), and they are the
        config's, which a `payrun limits set` may have overridden (the dialog said "in
        force: cap 50" from the config while cap 10 was in force). ``slots_for(rate)``: the
        sends in flight a rate allows (jobs.limits.rate_slots), for the note under the
        fields, said as the values are typed, when the cap is above it."""
        super().__init__()
        self.cap, self.rate, self.known = cap, rate, known
        self.slots_for = slots_for

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="confirm"):
            yield Static("Change the email limits (every sender, every host, next send)", classes="dialog-title")
            if self.known:
                yield Static(f"in force: cap {self.cap} in flight, rate {self.rate:g}/s", classes="dialog-body")
                now_cap, now_rate = f"now {self.cap}; ", f"now {self.rate:g}; "
            else:
                yield Static(f"in force: unknown (the last refresh could not read them: Redis unreachable?); "
                             f"the config says cap {self.cap}, rate {self.rate:g}/s, which `payrun limits set` "
                             "may have overridden", classes="dialog-body")
                now_cap = now_rate = ""
            yield Input(placeholder=f"cap ({now_cap}empty = unchanged)", id="cap")
            yield Input(placeholder=f"rate per s ({now_rate}empty = unchanged)", id="rate")
            yield Static(self.rate_note(), id="rate-note", classes="dialog-note", markup=False)
            yield Static("Enter to continue · Esc cancels", classes="dialog-keys")

    def rate_note(self, cap_s: str = "", rate_s: str = "") -> str:
        """cap_over_rate_note for the cap and rate typed (``cap_s``, ``rate_s``), the ones in
        force for a field left empty (unknown with Redis unreachable: no note then)."""
        from console.fmt import cap_over_rate_note

        try:
            cap = int(cap_s) if cap_s.strip() else (self.cap if self.known else None)
            rate = float(rate_s) if rate_s.strip() else (self.rate if self.known else None)
        except ValueError:
            return ""
        if self.slots_for is None or cap is None or rate is None or not 0 < rate < float("inf"):
            return ""
        return cap_over_rate_note(cap, rate, self.slots_for(rate))

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        note = self.rate_note(self.query_one("#cap", Input).value, self.query_one("#rate", Input).value)
        self.query_one("#rate-note", Static).update(note)

    def on_mount(self) -> None:
        for inp in self.query(Input):
            if getattr(self.app, "no_blink", False):
                inp.cursor_blink = False
        self.query_one("#cap", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id == "cap":
            self.query_one("#rate", Input).focus()
            return
        cap_s, rate_s = self.query_one("#cap", Input).value.strip(), self.query_one("#rate", Input).value.strip()
        try:
            cap = int(cap_s) if cap_s else None
            rate = float(rate_s) if rate_s else None
        except ValueError:
            self.notify("cap must be a whole number, rate a number", severity="error")
            return
        if cap is None and rate is None:
            self.dismiss(None)
            return
        from console.actions import limits_problem

        problem = limits_problem(cap, rate)
        if problem:  # said now, not after the confirmation
            self.notify(problem, severity="error")
            return
        self.dismiss((cap, rate))

    def action_cancel(self) -> None:
        self.dismiss(None)
