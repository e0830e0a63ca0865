"""The `:` command bar (k9s style): `:failed queue:send-email`, `:drain pdf-render`, `:q`."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Input


class CommandBar(Input):
    DEFAULT_CSS = """
    CommandBar { dock: bottom; height: 1; border: none; padding: 0 1; background: $boost; }
    CommandBar:focus { border: none; }
    """
    BINDINGS = [Binding("escape", "close", "Close", show=False),
                Binding("up", "history(-1)", show=False), Binding("down", "history(1)", show=False)]
    history: list[str] = []

    def __init__(self, return_to=None) -> None:
        super().__init__(placeholder=": failed | running | workers | overview | retry ID… | drain [Q] | resume [Q] | "
                                     "stop WORKER | limits cap=N rate=R | audit | help | q", id="command-bar",
                         select_on_focus=False)  # (selected, the text typed ahead went with the next key)
        self._pos = len(self.history)
        # the widget that had focus before `:`: it gets it back when the bar goes (focus
        # fell to the last table, the overview's processes, where d and u said "select a queue")
        self._return_to = return_to

    def on_mount(self) -> None:
        if getattr(self.app, "no_blink", False):
            self.cursor_blink = False
        self.focus()

    def on_focus(self) -> None:
        # what was typed after `:` until this bar had focus (ConsoleApp.on_event keeps it)
        take = getattr(self.app, "take_typeahead", None)
        early = take() if take else ""
        if "\x1b" in early:  # Esc among them: closed before it opened
            self.remove()
            return
        text, enter, _ = early.partition("\n")
        if text:
            self.value = text
            self.cursor_position = len(text)
        if enter:
            self.post_message(Input.Submitted(self, self.value))

    def on_unmount(self) -> None:
        take = getattr(self.app, "take_typeahead", None)
        if take:
            take()  # never keep keys for a bar that is gone
        back = self._return_to
        if back is not None and back.is_attached and back.screen is self.screen:
            self.screen.set_focus(back)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if text:
            CommandBar.history.append(text)
        self.remove()
        if text:
            # from the app, not from here: a dialog the command opens hands its answer to
            # whoever asked, and this bar is gone by then (the answer went nowhere)
            self.app.call_later(self.app.run_command, text)

    def on_blur(self) -> None:
        self.remove()

    def action_close(self) -> None:
        self.remove()

    def action_history(self, step: int) -> None:
        if not self.history:
            return
        self._pos = max(0, min(len(self.history) - 1, self._pos + step))
        self.value = self.history[self._pos]
        self.cursor_position = len(self.value)
