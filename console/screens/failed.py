"""Dead letters: a filtered, paged list (never the whole registry), selection, retry."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Input, Static

from console import actions
from console.data import PAGE_SIZE
from console.failed import FailedFilter, FailedPage, short_error
from console.screens.base import ConsoleScreen
from console.widgets.status import StatusBar
from console.widgets.table import LiveTable


class FailedScreen(ConsoleScreen):
    CRUMB = "failed"
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("enter", "open", "Detail"),
        Binding("space", "select", "Select"),
        Binding("r", "retry_one", "Retry"),
        Binding("R", "retry_selected", "Retry sel."),
        Binding("A", "retry_all", "Retry all"),
        Binding("n", "page(1)", "Next", show=False),
        Binding("p", "page(-1)", "Prev", show=False),
    ]

    def __init__(self, filter_text: str = "", page_size: int = PAGE_SIZE):
        super().__init__()
        self.flt = FailedFilter()
        self.filter_text = filter_text
        self.page_offset = 0
        self.page_size = page_size
        self.page: FailedPage | None = None
        self.selected: set[str] = set()
        self._loading = False

    def compose(self) -> ComposeResult:
        yield StatusBar(self.CRUMB)
        yield Static("", id="failed-summary")
        yield Input(placeholder="filter: queue:send-email company:3 month:2026-11 refused   (Enter applies, Esc closes)",
                    id="filter")
        yield LiveTable([("sel", " "), ("job", "job"), ("queue", "queue"), ("co", "co"), ("att", "att"),
                         ("why", "why"), ("error", "last error")], id="failed",
                        # at 80 columns: room for the error (a job id names its queue), then the
                        # error cut at a word (it ran off the edge behind a scrollbar; Enter shows it whole)
                        drop=("queue",), clip=("error",))
        yield Footer(compact=True)

    def on_mount(self) -> None:
        inp = self.query_one("#filter", Input)
        inp.display = False
        if self.app.no_blink:
            inp.cursor_blink = False
        self.query_one(LiveTable).focus()
        self.apply_filter(self.filter_text)

    def apply_filter(self, text: str) -> None:
        try:
            self.flt = FailedFilter.parse(text)
        except ValueError as e:
            self.notify(str(e), severity="error")
            return
        if odd := FailedFilter.unknown_keys(text):
            self.notify(f"{', '.join(odd)}: not a filter key (queue:, company:, month:), matched as text in the "
                        "last error", severity="warning", timeout=8)
        self.filter_text = text
        self.page_offset = 0
        self.selected.clear()
        self.reload()

    def reload(self) -> None:
        if not self._loading:
            self._loading = True
            self._load(self.flt, self.page_offset)

    @work(thread=True, exit_on_error=False, group="failed-page")
    def _load(self, flt: FailedFilter, offset: int) -> None:
        try:
            page = self.app.source.failed_page(flt, offset, self.page_size)
            err = None
        except Exception as e:
            page, err = None, f"{type(e).__name__}: {e}"
        try:
            self.app.call_from_thread(self._loaded, page, err)
        except RuntimeError:
            pass

    def _loaded(self, page: FailedPage | None, err: str | None) -> None:
        self._loading = False
        if page is None:
            self.query_one("#failed-summary", Static).update(Text(f"could not read failed jobs: {err}", style="red"))
            return
        if page.offset and page.offset >= page.total:
            # the list shrank under a later page (a retry, from here or the CLI): show its
            # last page, not an empty "0 failed · page 2/1"
            self.page_offset = max(0, (page.total - 1) // self.page_size * self.page_size)
            self.reload()
            return
        self.page = page
        rows = []
        for r in page.rows:
            err_text = Text(short_error(r["error"] or ""))
            if not r.get("in_redis", True):
                err_text = Text("(no longer failed in Redis) ", style="dim") + err_text
            # "data": the last try failed on the employee's data (an address refused): a retry
            # alone fails again; "" : a transient failure that ran out of attempts
            why = (Text("resent", style="bold cyan") if r.get("delivered_by_resend") else
                   Text("fixed", style="bold green") if r.get("address_changed") else
                   Text("data", style="bold yellow") if r.get("permanent") else Text(""))
            rows.append((r["id"], ("●" if r["id"] in self.selected else " ", r["id"], r["queue"] or "",
                                   "" if r.get("company") is None else str(r["company"]), str(r["attempts"]),
                                   why, err_text)))
        with self.app.batch_update():
            self.query_one(LiveTable).sync(rows)
        self._summary()

    def _summary(self) -> None:
        p = self.page
        if p is None:
            return
        pages = max(1, -(-p.total // self.page_size))
        t = Text()
        t.append(f"{p.total:,} failed", style="bold red" if p.total else "bold")
        t.append(f" · page {p.offset // self.page_size + 1}/{pages} (n/p)")
        t.append(f" · filter: {str(self.flt) or 'none (/ to set)'}")
        if self.selected:
            t.append(f" · {len(self.selected)} selected", style="bold")
        shown = [r for r in p.rows if not r.get("delivered_by_resend")]  # (their why reads "resent")
        if any(r.get("permanent") and not r.get("address_changed") for r in shown):
            t.append("\n")
            t.append("data", style="bold yellow")
            t.append(": failed on the employee's data; a retry alone fails again: fix it first (payrun import)")
        if any(r.get("delivered_by_resend") for r in p.rows):
            t.append("\n")
            t.append("resent", style="bold cyan")
            t.append(": its slip was delivered by a `payrun resend` since: a retry emails it again (A leaves it out)")
        if any(r.get("address_changed") for r in shown):
            t.append("\n")
            t.append("fixed", style="bold green")
            t.append(": its address was refused and has changed since in the payroll data: a retry sends it there")
        self.query_one("#failed-summary", Static).update(t)

    def show_snapshot(self, snap) -> None:  # keep the page live, one page read per refresh
        self.reload()

    def on_data_table_row_selected(self, event) -> None:
        """Enter on a row (the table consumes the key; this is its message)."""
        event.stop()
        self.action_open()

    # ---- keys -------------------------------------------------------------------------
    def action_back(self) -> None:
        inp = self.query_one("#filter", Input)
        if inp.display:
            inp.display = False
            self.query_one(LiveTable).focus()
        else:
            self.app.pop_screen()

    def action_filter(self) -> None:
        inp = self.query_one("#filter", Input)
        inp.display = True
        inp.value = self.filter_text
        inp.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "filter":
            return
        event.stop()
        event.input.display = False
        self.query_one(LiveTable).focus()
        self.apply_filter(event.value)

    def action_page(self, step: int) -> None:
        if self.page is None:
            return
        new = self.page_offset + step * self.page_size
        if 0 <= new < max(1, self.page.total):
            self.page_offset = new
            self.reload()

    def _current(self) -> str | None:
        return self.query_one(LiveTable).current_key

    def action_open(self) -> None:
        key = self._current()
        if key:
            from console.screens.job import JobScreen

            self.app.push_screen(JobScreen(key))

    def action_select(self) -> None:
        key = self._current()
        if not key:
            return
        self.selected.symmetric_difference_update({key})
        table = self.query_one(LiveTable)
        table.update_cell(key, "sel", "●" if key in self.selected else " ")
        table._cells[key] = ("●" if key in self.selected else " ",) + table._cells[key][1:]
        table.move_cursor(row=min(table.cursor_row + 1, table.row_count - 1))
        self._summary()

    def action_retry_one(self) -> None:
        key = self._current()
        if key:
            self._retry_one(key)

    def _retry_one(self, key: str) -> None:
        # as `:retry ID`: a job with no data (or data not JSON) is refused at once, with why
        # (r offered y/n on a row reading "job data missing … nothing to retry"); the
        # dialog says what retry_one_body says of it, read afresh off the keyboard's thread
        self.app.offer_retry([key])

    def action_retry_selected(self) -> None:
        ids = sorted(self.selected)
        if not ids:
            self.notify("nothing selected: space selects a row", severity="warning")
            return
        if len(ids) == 1:
            self._retry_one(ids[0])  # the selected row (space moved the cursor past it)
            return
        self._count_permanent_then_confirm(ids, "Retry the selected failed jobs?", actions.retry_command(ids))

    def action_retry_all(self) -> None:
        if self.app.refuse_if_readonly("retry all"):
            return
        self._count_then_confirm(self.flt)

    @work(thread=True, exit_on_error=False, group="failed-count")
    def _count_then_confirm(self, flt: FailedFilter) -> None:
        ids = self.app.source.failed_ids(flt)
        permanent = self.app.source.permanent_among(ids)
        self.app.call_from_thread(self._bulk, ids, f"Retry every failed job matching: {str(flt) or 'everything'}?",
                                  flt.command(), len(permanent))

    @work(thread=True, exit_on_error=False, group="failed-count")
    def _count_permanent_then_confirm(self, ids: list[str], title: str, command: str) -> None:
        permanent = self.app.source.permanent_among(ids)
        self.app.call_from_thread(self._bulk, ids, title, command, len(permanent))

    def _bulk(self, ids: list[str], title: str, command: str, permanent: int = 0) -> None:
        from console.dialogs.confirm import ConfirmTyped

        if self.app.refuse_if_readonly("retry"):
            return
        if not ids:
            self.notify("no failed job matches", severity="warning")
            return
        note = (f"{permanent:,} of them failed on the employee's data (an address refused): they fail again "
                "unless fixed first (payrun import)" if permanent else "")

        def done(ok: bool) -> None:
            if ok:
                self.selected.clear()
                self.app.act("retry", actions.retry, ids, command)

        self.app.push_screen(ConfirmTyped(title, len(ids), ids[:5], command, note=note), done)
