"""? — the keys of the view underneath, the : commands, and the rules behind the figures."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

COMMANDS = [
    (":failed [filter]", "failed jobs (filter: queue:Q company:N month:YYYY-MM text)"),
    (":running  :workers  :overview", "views (Esc goes back)"),
    (":retry ID…", "payrun retry ID…"),
    (":drain [queue]  :resume [queue]", "payrun drain / resume [--queue Q]"),
    (":stop WORKER", "payrun stop-worker WORKER"),
    (":limits cap=N rate=R", "payrun limits set --cap N --rate R"),
    (":month YYYY-MM | latest", "the pay run shown (m: the month before)"),
    (":audit", "the last actions (payrun audit)"),
    (":q", "quit"),
]

RULES = """stuck = its worker lost liveness (10 s), its lease lapsed, or running over lease.stuck_after_s
rq beat = age of RQ's heartbeat (renewed per job and every ~30 s when idle: not liveness; GONE/alive are)
why data = failed on the employee's data (an address refused): fix it first (payrun import), then retry
why fixed = its refused address has changed since in the payroll data: a retry sends it there
why resent = its slip was delivered by a `payrun resend` since: a retry emails it again
oldest = age of the job at the head of the queue; done/min from RQ's finished registry
ETA = slips left ÷ the month's slips delivered per second in the last 5 min (the last minute when faster),
never above the rate limit, nor (5 min after a change of the cap or rate) the pace since the change;
deadline the first 09:00 local after the run began
Nothing here writes to Redis unless you confirm an action; every action is in audit.log"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close"),
                Binding("colon", "command", "Command", show=False)]

    def action_command(self) -> None:
        """`:` here: close the help and open the command bar (a modal screen keeps the
        app's own `:` from it, and the help lists the commands)."""
        self.app.pop_screen()
        self.app.action_command_bar()

    def __init__(self, under):
        super().__init__()
        self.under = under

    def compose(self) -> ComposeResult:
        t = Text()
        t.append(f"Keys in {getattr(self.under, 'CRUMB', '') or 'this view'}\n", style="bold underline")
        seen = set()
        for b in [*getattr(self.under, "BINDINGS", []), *self.app.BINDINGS]:
            if b.action in seen:
                continue
            seen.add(b.action)
            if self.under.check_action(b.action, ()) is False:
                continue
            t.append(f"  {(b.key_display or b.key):<12}", style="bold")
            t.append(f" {b.description or b.action}\n")
        t.append("  Tab          next table\n", style="")
        t.append("\nCommands (:)\n", style="bold underline")
        for c, d in COMMANDS:
            if self.app.readonly and c.split()[0] in (":retry", ":drain", ":stop", ":limits"):
                continue
            t.append(f"  {c:<32}", style="bold")
            t.append(f" {d}\n")
        t.append("\n" + RULES + "\n", style="dim")
        if self.app.readonly:
            t.append("\nREAD-ONLY: actions are hidden and refused.\n", style="bold yellow")
        with VerticalScroll(id="help"):
            yield Static(t)
