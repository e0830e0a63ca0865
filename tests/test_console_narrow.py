"""The console in small terminals, and resized under a dialog (session-39 drill: tmux at
80x24 and smaller, a failed list of 5,000). Fixed data, no polling; a dead Redis for the
unreachable line."""

from __future__ import annotations

import asyncio
import functools

import pytest
from rich.text import Text

from console.app import ConsoleApp
from console.data import Source
from console.widgets.status import fit
from console.widgets.table import RESERVED

from test_console_snapshots import NOW, FixedSource


def sync(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def fixed_app() -> ConsoleApp:
    return ConsoleApp(FixedSource(), clock=lambda: NOW, poll=False, no_blink=True)


async def ready(pilot, until=lambda: True, what: str = "the console") -> None:
    for _ in range(200):
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()
        if until():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def right_edge(table, key: str) -> int:
    """The last cell column (in the table) of column ``key``; -1 when it is not shown."""
    x = 0
    for col in table.ordered_columns:
        x += col.get_render_width(table)
        if col.key.value == key:
            return x
    return -1


@sync
async def test_the_limits_line_says_the_rate_is_a_limit_not_a_speed():
    app = fixed_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        line = str(app.screen.query_one("#limits").render())
        assert "limit 40/s" in line, line


@sync
async def test_the_failed_list_and_the_workers_keep_their_key_columns_at_80_columns():
    """At 80 columns the last error was cut to "HTTP 422 invalid recip" (the queue column,
    which the job id names, took its room) and the workers' alive/rq beat were off screen."""
    app = fixed_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        await pilot.press("f")
        await ready(pilot, lambda: app.screen.CRUMB == "failed" and app.screen.page is not None)
        table = app.screen.query_one("#failed")
        room = table.size.width - RESERVED
        assert right_edge(table, "queue") == -1
        assert right_edge(table, "why") + 1 + len("HTTP 422 invalid recipient") <= room
        await pilot.press("escape")
        await pilot.press("w")
        await ready(pilot, lambda: app.screen.CRUMB == "workers")
        table = app.screen.query_one("#workers")
        assert 0 < right_edge(table, "alive") <= table.size.width - RESERVED
        assert right_edge(table, "state") > 0 and right_edge(table, "job") > 0
        # wider again: every column comes back, in its place
        await pilot.resize_terminal(160, 24)
        await ready(pilot, lambda: right_edge(app.screen.query_one("#workers"), "queues") > 0, "the columns back")
        assert [c.key.value for c in app.screen.query_one("#workers").ordered_columns] == [
            "name", "proc", "queues", "state", "job", "for", "beat", "alive"]
        await pilot.press("escape")
        await pilot.press("f")
        await ready(pilot, lambda: app.screen.CRUMB == "failed" and right_edge(app.screen.query_one("#failed"),
                                                                                "queue") > 0)


@sync
async def test_a_bulk_confirmation_keeps_its_typed_box_in_a_short_terminal_and_a_resize():
    """In a 14-row tmux pane the retry-all dialog was cut at the bottom: no "Type 12 and
    Enter" and no box to type it in. The sample goes first."""
    app = fixed_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        await pilot.press("f")
        await ready(pilot, lambda: app.screen.CRUMB == "failed" and app.screen.page is not None)
        await pilot.press("A")
        await ready(pilot, lambda: type(app.screen).__name__ == "ConfirmTyped", "the dialog")
        dialog = app.screen
        assert not dialog.query_one("#dialog").has_class("no-sample")
        for size in ((80, 14), (60, 16), (80, 12)):
            await pilot.resize_terminal(*size)
            await ready(pilot, lambda: app.size == size and dialog.query_one("#typed").region.bottom <= size[1]
                        and dialog.query_one("#typed").region.height == 3, f"the box on screen at {size}")
            box = dialog.query_one("#typed").region
            keys = dialog.query_one(".dialog-keys").region
            assert keys.height and keys.bottom <= box.y, (size, box, keys)
            assert dialog.query_one("#dialog").has_class("no-sample")
            assert dialog.query_one(".dialog-count").region.height  # the count stays
        await pilot.resize_terminal(100, 30)
        await ready(pilot, lambda: not dialog.query_one("#dialog").has_class("no-sample"), "the sample back")
        await pilot.press(*"12", "enter")
        await ready(pilot, lambda: type(app.screen).__name__ == "FailedScreen", "the dialog to close")


def test_a_status_too_long_for_its_line_is_shortened_not_cut_mid_message():
    s = ("last refresh 12s ago: Redis unreachable (ConnectionError: Error 111 connecting to "
         "redis.internal:6379. Connection refused.)")
    assert fit(s, 200) == s
    assert fit(s, 60) == "last refresh 12s ago: Redis unreachable"
    assert fit(s, 30) == "12s ago: Redis unreachable"
    assert fit(s, 20) == "12s ago: Redis…"


@pytest.mark.parametrize("size,crumb_key", [((120, 24), None), ((80, 24), "f")])
def test_redis_unreachable_is_said_whole_at_120_and_80_columns(cfg, tmp_path, size, crumb_key):
    """At 120 columns the status line read "Redis unreachable (ConnectionError: Error 111
    connecting to" and stopped."""
    from console.data import connect

    async def run():
        dead = connect(cfg, f"unix://{tmp_path / 'no.sock'}")
        app = ConsoleApp(Source(cfg, dead), no_blink=True, poll=False)
        async with app.run_test(size=size) as pilot:
            await ready(pilot, lambda: app.snapshot is not None and app.snapshot.redis_down)
            if crumb_key:
                await pilot.press(crumb_key)
                await ready(pilot, lambda: app.screen.CRUMB == "failed")
            app._tick()
            await pilot.pause()
            line = str(app.screen.query_one("StatusBar").render())
            assert Text(line).cell_len <= size[0], line
            assert line.rstrip().endswith("Redis unreachable") or "Redis unreachable (" in line and line.rstrip(
            ).endswith(")"), line

    asyncio.run(run())


def test_a_long_company_name_is_cut_at_a_word():
    from console.fmt import clip

    assert clip("Mahananda Tea Estates Limited", 24) == "Mahananda Tea Estates…"
    assert clip("Padma Packaging", 24) == "Padma Packaging"
    assert clip("Supercalifragilisticexpialidocious Ltd", 10) == "Supercali…"


@sync
async def test_the_running_views_rule_for_stuck_is_whole_at_80_columns():
    """It read "1 stuck (dead worker, lapsed lease," and stopped at the edge."""
    app = fixed_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        await pilot.press("r")
        await ready(pilot, lambda: app.screen.CRUMB == "running" and app.screen.query_one("#summary").region.height == 2,
                    "the summary on two lines")
        assert "or over 10 min)" in str(app.screen.query_one("#summary").render())


@sync
async def test_the_overviews_worker_processes_leave_out_the_program_rather_than_cut_rq_beat_at_80_columns():
    """A supervised worker's program and a send's longest job leave no room for rq beat at 80
    columns: it was cut to its first character ("1" for "12s"), a number that reads wrong.
    The program (which `payrun ps` names) goes first; a wider terminal shows it again."""
    class Supervised(FixedSource):  # as supervisord runs them: the program beside host:pid
        def snapshot(self):
            snap = super().snapshot()
            for w in snap.workers:
                w.program = "send-email" if w.kind == "email" else f"pdf-render:pdf-render-{w.pid % 100:02d}"
                w.heartbeat_age_s = 12.0
            return snap

    app = ConsoleApp(Supervised(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        table = app.screen.query_one("#procs")
        await ready(pilot, lambda: table.row_count > 0, "the worker processes")
        room = table.size.width - RESERVED
        last = [c.key.value for c in table.ordered_columns][-1]
        assert right_edge(table, last) <= room, [c.key.value for c in table.ordered_columns]
        assert right_edge(table, "job") > 0 and right_edge(table, "beat") > 0 and right_edge(table, "program") == -1
        await pilot.resize_terminal(120, 30)
        await ready(pilot, lambda: right_edge(app.screen.query_one("#procs"), "program") > 0, "the program back")
        assert [c.key.value for c in app.screen.query_one("#procs").ordered_columns] == [
            "proc", "program", "kind", "busy", "job", "beat"]


class Drained(FixedSource):
    """Every queue drained (`payrun drain --queue Q` for each): each name carries "⏸"."""

    def snapshot(self):
        snap = super().snapshot()
        for q in snap.queues:
            q.paused = True
        snap.paused_queues = sorted(q.name for q in snap.queues)
        return snap


@sync
async def test_a_drained_queues_marker_adds_no_scrollbar_row_to_the_queues_table_at_80_columns():
    """Console drill (session 40): at 80 columns "pdf-render ⏸" made the queues table one
    column too wide, and a horizontal scrollbar took a row under it. The reminders column
    (later) goes instead, and comes back in a wider terminal; undrained, it stays at 80
    (a table whose three rows fit keeps no room for a vertical scrollbar it never shows)."""
    app = ConsoleApp(Drained(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        table = app.screen.query_one("#queues")
        await ready(pilot, lambda: table.row_count == 3, "the queues")
        assert "⏸" in str(table.get_cell("pdf-render", "queue"))
        assert not table.show_horizontal_scrollbar and table.virtual_size.width <= table.size.width
        assert table.size.height == 4  # the header and three queues, no scrollbar row
        assert right_edge(table, "later") == -1 and right_edge(table, "rate") > 0
        await pilot.resize_terminal(120, 40)
        await ready(pilot, lambda: right_edge(app.screen.query_one("#queues"), "later") > 0, "later back")
    app = fixed_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        table = app.screen.query_one("#queues")
        await ready(pilot, lambda: table.row_count == 3, "the queues")
        assert right_edge(table, "later") > 0 and not table.show_horizontal_scrollbar


@sync
async def test_the_running_views_stuck_reason_is_cut_at_a_word_not_at_the_edge_at_80_columns():
    """Console drill (session 40): "worker email.app1.4200.07 is" and the edge, behind a
    horizontal scrollbar. The worker's column goes first (the reason no longer repeats its
    name), then the reason is cut at a word; at 120 columns all of it and the worker."""
    app = fixed_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        await pilot.press("r")
        await ready(pilot, lambda: app.screen.CRUMB == "running" and app.screen.query_one("#running").row_count == 1)
        table = app.screen.query_one("#running")
        stuck = str(table.get_cell("email-2026-11-emp-00017", "stuck"))
        assert stuck.startswith("worker gone") and stuck.endswith("…"), stuck
        assert right_edge(table, "worker") == -1 and right_edge(table, "stuck") <= table.room()
        assert not table.show_horizontal_scrollbar
        await pilot.resize_terminal(120, 40)
        await ready(pilot, lambda: right_edge(app.screen.query_one("#running"), "worker") > 0, "the worker back")
        table = app.screen.query_one("#running")
        assert str(table.get_cell("email-2026-11-emp-00017", "stuck")) == "worker gone (no liveness for 10 s)"
        assert str(table.get_cell("email-2026-11-emp-00017", "worker")) == "email.app1.4200.07"
        assert not table.show_horizontal_scrollbar


def test_a_stuck_reason_leaves_out_the_name_its_worker_column_shows():
    from console.fmt import stuck_text

    w = "email.app1.4200.07"
    assert stuck_text(f"worker {w} is gone (no liveness for 10 s)", w) == "worker gone (no liveness for 10 s)"
    assert stuck_text(f"its lease expired: worker {w} stopped renewing it", w) == (
        "its lease expired: worker stopped renewing it")
    assert stuck_text("worker other.1 is gone (no liveness for 10 s)", w) == (
        "worker other.1 is gone (no liveness for 10 s)")  # (not the row's worker: named)
    assert stuck_text("running 12 min (over 10 min)", w) == "running 12 min (over 10 min)"


BENGALI = "রহিম উদ্দিন"  # 11 code points (a spacing vowel sign twice, a virama): 10 terminal columns (rich: 8)
CJK = "山田太郎"  # 4 characters: 8 columns


def test_clip_cuts_by_terminal_columns_not_characters():
    """Employee and company names can be Bengali (marks that take no column of their own)
    or CJK (two columns a character): cut by len, a Bengali name that fits was cut early
    and a CJK one ran past its column."""
    from rich.cells import cell_len

    from console.fmt import cells_head, clip, columns

    assert clip(BENGALI, 10) == BENGALI  # 11 characters, 10 columns in a terminal: it fits
    assert clip(BENGALI, 9) == "রহিম…"  # cut at a word
    # terminals (glibc's wcwidth, tmux) draw a spacing vowel sign (Mc: ি) one column wide, rich none
    assert columns(BENGALI) == 10 and cell_len(BENGALI) == 8 and columns(CJK) == 8 and columns("abc") == 3
    assert clip("রহিম উদ্দিন চৌধুরী লিমিটেড", 12) == "রহিম উদ্দিন…"
    assert clip(CJK, 8) == CJK
    assert clip(CJK, 6) == "山田…" and clip(CJK, 7) == "山田太…"  # (a wide character is not split)
    assert clip("山田太郎 株式会社 東京支店", 24) == "山田太郎 株式会社…"
    assert clip("Mahananda Tea Estates Limited", 24) == "Mahananda Tea Estates…"
    for text in (BENGALI, CJK, "রহিম উদ্দিন চৌধুরী লিমিটেড", "山田太郎 株式会社 東京支店", "Padma Packaging Ltd"):
        for width in range(2, 30):
            out = clip(text, width)
            assert columns(out) <= width, (text, width, out)
            assert out == text or out.endswith("…"), (text, width, out)
    # a vowel sign stays with its letter; a cut never starts the next cell with one, nor ends
    # in half of a conjunct (a letter and its virama, joined to the next letter)
    # (terminal columns: রহি takes 3, its vowel sign one; দ্দি 3 with its virama none)
    assert cells_head("উদ্দিন", 3) == "উ" and cells_head("উদ্দিন", 4) == "উদ্দি"
    assert cells_head("রহিম", 2) == "র" and cells_head("রহিম", 3) == "রহি"
    assert cells_head("লক্ষ্মী", 4) == "ল" and cells_head("লক্ষ্মী", 5) == "লক্ষ্মী"  # (ক্ষ্ম: three letters, one glyph)
    assert cells_head(CJK, 3) == "山" and cells_head("abc", 2) == "ab"


def test_cells_head_measures_as_rich_does_an_emoji_with_its_variation_selector_or_joiner():
    """rich (and so Textual) measures by grapheme: "❤" is one column but "❤️" (with
    U+FE0F) two, a ZWJ family one emoji of two. Counted a character at a time, a name of
    hearts cut to 5 columns came out 9 wide, and a cut could fall inside one emoji."""
    from rich.cells import cell_len

    from console.fmt import cells_head, clip
    from console.widgets.status import fit

    hearts = "\u2764\ufe0f" * 5  # 10 columns
    family = "\U0001F468\u200d\U0001F469\u200d\U0001F467"  # 2 columns
    for text in (hearts, "Love \u2764\ufe0f\u2764\ufe0f Ltd", family * 4, "a" + family + "b" + family):
        for width in range(1, 12):
            for f in (cells_head, clip, fit):
                out = f(text, width)
                assert cell_len(out) <= width, (f.__name__, text, width, out)
            head = cells_head(text, width)
            assert text[len(head):len(head) + 1] not in ("\ufe0f", "\u200d"), (text, width, head)
    assert cells_head(hearts, 5) == "\u2764\ufe0f" * 2
    assert cells_head(family * 2, 3) == family  # a whole emoji, not its first person


def test_the_status_line_and_a_retry_errors_head_are_fitted_by_columns():
    from rich.cells import cell_len

    from console.data import error_head

    s = "last refresh 12s ago: Redis unreachable at /home/山田太郎/payrun/redis.sock"
    for width in range(2, 70):
        assert cell_len(fit(s, width)) <= width, (width, fit(s, width))
    head = error_head("provider 127.0.0.1:8025: HTTP 550 宛先の受信箱が存在しません（山田太郎 様の受信箱は満杯です） 再送不可: later")
    assert cell_len(head) <= 48 and head.startswith("HTTP 550 宛先"), head
    assert error_head("provider 127.0.0.1:8025: HTTP 550 রহিম উদ্দিন চৌধুরী লিমিটেড mailbox full: x") == (
        "HTTP 550 রহিম উদ্দিন চৌধুরী লিমিটেড mailbox full")  # 48 characters, 46 terminal columns: whole


class WideNames(FixedSource):
    """A CJK company name and a Bengali one."""

    def snapshot(self):
        snap = super().snapshot()
        snap.status["companies"][0]["name"] = "山田太郎株式会社東京支店第二製造部門"
        snap.status["companies"][1]["name"] = "রহিম উদ্দিন চৌধুরী টেক্সটাইল লিমিটেড"
        return snap


@sync
async def test_a_cjk_or_bengali_company_name_is_cut_to_its_columns_at_80():
    """The overview cut company names to 24 characters: a CJK one took 47 columns and the
    companies table ran off the edge; a Bengali one was cut short of its room."""
    from console.fmt import columns

    app = ConsoleApp(WideNames(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        table = app.screen.query_one("#companies")
        await ready(pilot, lambda: table.row_count == 3, "the companies")
        assert str(table.get_cell("1", "company")) == "山田太郎株式会社東京支…"  # 23 columns of 24
        # 36 characters, 24 columns as rich counts, 33 in a terminal (its spacing vowel signs):
        # cut, or the row ran 9 columns past its cell in tmux
        assert str(table.get_cell("2", "company")) == "রহিম উদ্দিন চৌধুরী…"
        for row in ("1", "2"):
            assert columns(str(table.get_cell(row, "company"))) <= 24
        assert not table.show_horizontal_scrollbar and table.virtual_size.width <= table.size.width


class NamesInErrors(FixedSource):
    """Failed jobs whose last errors hold a Bengali section label and a CJK name."""

    def failed_page(self, flt, offset=0, limit=50):
        page = super().failed_page(flt, offset, limit)
        errs = ["salary slip for employee E00017, month 2026-11: earnings 'মূল বেতন ও বাড়ি ভাড়া ভাতা' (amount) "
                "is negative; fix it in the payroll data",
                # (no space to cut at: cut by characters, 2 columns each, it ran past the edge)
                "provider 127.0.0.1:8025: 山田太郎様の受信箱は満杯です。後でもう一度お試しください（容量超過）"]
        for i, r in enumerate(page.rows):
            r["error"] = errs[i % 2]
        return page


@sync
async def test_the_failed_lists_error_with_bengali_or_cjk_text_is_cut_to_its_columns_at_80():
    """The last error was cut to as many characters as its column has cells: a CJK error
    ran past the edge (a horizontal scrollbar under the list)."""
    from rich.cells import cell_len

    app = ConsoleApp(NamesInErrors(), clock=lambda: NOW, poll=False, no_blink=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, lambda: app.snapshot is not None)
        await pilot.press("f")
        await ready(pilot, lambda: app.screen.CRUMB == "failed" and app.screen.page is not None
                    and app.screen.query_one("#failed").row_count == 12)
        table = app.screen.query_one("#failed")
        await ready(pilot, lambda: table._clip_w.get("error"), "the error column cut")
        width = table._clip_w["error"]
        for key in table.keys():
            cell = str(table.get_cell(key, "error"))
            assert cell.endswith("…") and cell_len(cell) <= width, (cell, width)
        assert right_edge(table, "error") <= table.room()
        assert not table.show_horizontal_scrollbar and table.virtual_size.width <= table.size.width


class ShortBengaliName(FixedSource):
    """A Bengali company name that fits its cell uncut."""

    def snapshot(self):
        snap = super().snapshot()
        snap.status["companies"][1]["name"] = BENGALI
        return snap


@sync
async def test_a_row_holding_a_bengali_name_takes_its_tables_width_in_a_terminal():
    """Textual pads a cell by rich's measure, which gave a spacing vowel sign (ি) no column:
    a row holding an uncut Bengali name ran a column past its table per vowel sign in tmux,
    and every column after the name moved right. The console's process teaches rich the
    terminal's measure (``payrun console`` does it before the app starts)."""
    from rich.cells import cell_len

    from console.fmt import columns
    from payrun.columns import forget_rich_spacing_marks, teach_rich_spacing_marks

    async def row_columns() -> tuple[int, int]:
        app = ConsoleApp(ShortBengaliName(), clock=lambda: NOW, poll=False, no_blink=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot, lambda: app.snapshot is not None)
            table = app.screen.query_one("#companies")
            await ready(pilot, lambda: table.row_count == 3, "the companies")
            await pilot.pause()
            lines = [table.render_line(y).text for y in range(table.size.height)]
            row = [line for line in lines if BENGALI in line]
            assert len(row) == 1, lines
            return columns(row[0]), table.size.width

    drawn, width = await row_columns()
    assert drawn == width + 2, (drawn, width)  # rich's measure: two columns too many in a terminal
    assert teach_rich_spacing_marks()
    try:
        assert cell_len(BENGALI) == columns(BENGALI) == 10
        drawn, width = await row_columns()
        assert drawn == width, (drawn, width)
        assert not teach_rich_spacing_marks()  # (once)
    finally:
        forget_rich_spacing_marks()
    assert cell_len(BENGALI) == 8


def test_the_spacing_marks_table_gives_only_spacing_vowel_signs_a_column():
    from payrun.columns import with_spacing_marks

    # U+0981 candrabindu (Mn) 0; U+09BE-U+09C0 aa, i, ii (Mc) 1; U+09C1-U+09C4 u, uu... (Mn) 0
    table = [(0x0300, 0x036F, 0), (0x0981, 0x0981, 0), (0x09BC, 0x09C4, 0), (0x1100, 0x115F, 2)]
    assert with_spacing_marks(table) == [(0x0300, 0x036F, 0), (0x0981, 0x0981, 0), (0x09BC, 0x09BD, 0),
                                         (0x09BE, 0x09BE, 1), (0x09BF, 0x09BF, 1), (0x09C0, 0x09C0, 1),
                                         (0x09C1, 0x09C4, 0), (0x1100, 0x115F, 2)]


def test_teaching_rich_spacing_marks_and_forgetting_them_leaves_no_stale_cut_in_richs_caches():
    """rich caches a segment's cut at a cell (``Segment._split_cells``, 16,384 entries, for
    the whole process): a cut made before ``teach_rich_spacing_marks`` was served after it
    (a 5-column cut of a Bengali name gave 7 columns), and a taught cut after
    ``forget_rich_spacing_marks``, so a test's outcome hung on what ran before it."""
    from rich.cells import cell_len
    from rich.segment import Segment

    from payrun.columns import columns, forget_rich_spacing_marks, teach_rich_spacing_marks

    name = "রহিমা খাতুন"
    before = Segment.split_cells(Segment(name), 5)
    assert cell_len(before[0].text) <= 5
    assert teach_rich_spacing_marks()
    try:
        head = Segment.split_cells(Segment(name), 5)[0].text
        assert cell_len(head) <= 5 and columns(head) <= 5, head
    finally:
        forget_rich_spacing_marks()
    assert Segment.split_cells(Segment(name), 5) == before
