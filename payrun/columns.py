"""Terminal columns: how wide text is drawn, and its longest start that fits, for the
console and the CLI's tables (payrun status). Uses rich (Textual's measure), which Textual
brings on every host; the standard library has no display width.
"""

from __future__ import annotations

import unicodedata

from rich.cells import cell_len

try:
    from rich.cells import split_graphemes
except ImportError:  # rich before 15 (textual allows 14.2) measures a character at a time: so do we
    def split_graphemes(text: str) -> tuple[list[tuple[int, int, int]], int]:
        return [(i, i + 1, cell_len(ch)) for i, ch in enumerate(text)], cell_len(text)


def columns(text: str) -> int:
    """The columns ``text`` takes in a terminal: rich's measure (Textual's), plus one for each
    spacing vowel sign (Unicode Mc: া ি ো in Bengali) that rich counts as none and
    terminals (glibc's wcwidth, tmux) draw one column wide. Cut by rich's measure alone, a
    Bengali company row ran 11 columns past its cell in tmux at 80 columns."""
    n = cell_len(text)
    if not text.isascii():
        n += sum(1 for ch in text if unicodedata.category(ch) == "Mc" and not cell_len(ch))
    return n


def cells_head(text: str, width: int) -> str:
    """The longest start of ``text`` that takes at most ``width`` terminal columns
    (``columns``), each character with the combining marks after it (display width, not
    ``len``: a Bengali name's virama takes no column, a CJK character two). Measured by
    grapheme, as ``cell_len`` and Textual measure: "❤️" (U+FE0F after a one-column heart)
    takes two, a ZWJ emoji sequence is one; never cut inside one."""
    if columns(text) <= width:
        return text
    used = 0
    for start, end, cells in split_graphemes(text)[0]:
        used += cells + (columns(text[start:end]) - cell_len(text[start:end]))
        if used > width:
            return _whole_conjuncts(text[:start])
    return text


def _whole_conjuncts(head: str) -> str:
    """``head`` less a conjunct cut in two: a letter whose virama (hasanta, ্) joins it to
    the next one, cut off, prints as a half letter ("উদ্" of "উদ্দিন"); a ZWJ/ZWNJ there too."""
    while head and (unicodedata.combining(head[-1]) == 9 or head[-1] in "\u200c\u200d"):
        head = head[:-1] if head[-1] in "\u200c\u200d" else head[:-2]
    return head


def with_spacing_marks(widths) -> list[tuple[int, int, int]]:
    """rich's cell table (sorted ``(start, end, width)`` ranges) with every spacing vowel
    sign (Unicode Mc) it gives no column given one, as ``columns`` counts them (pure)."""
    marks = [cp for start, end, width in widths if width == 0 for cp in range(start, end + 1)
             if unicodedata.category(chr(cp)) == "Mc"]
    if not marks:
        return list(widths)
    marks_set = set(marks)
    out: list[tuple[int, int, int]] = []
    for start, end, width in widths:
        if width != 0 or not any(start <= cp <= end for cp in marks):
            out.append((start, end, width))
            continue
        run_start = start
        for cp in range(start, end + 1):
            if cp in marks_set:
                if run_start < cp:
                    out.append((run_start, cp - 1, 0))
                out.append((cp, cp, 1))
                run_start = cp + 1
        if run_start <= end:
            out.append((run_start, end, 0))
    return out


def teach_rich_spacing_marks() -> bool:
    """Make rich (so Textual) measure a spacing vowel sign as one column, as terminals draw
    it and ``columns`` counts it: Textual padded a cell by rich's count, so a console row
    holding a Bengali name ran a column past its cell per vowel sign, pushing the columns
    after it out of line. For the console's process only (``console.cli``); True if it
    changed rich now, False if it was done before. ``forget_rich_spacing_marks`` undoes it."""
    import functools

    import rich.cells as rc

    if not hasattr(rc, "load_cell_table"):  # (rich before 15: its table is another shape; left as it is)
        return False
    if getattr(rc.load_cell_table, "payrun_original", None) is not None:
        return False
    original = rc.load_cell_table

    @functools.cache
    def load(unicode_version: str = "auto"):
        table = original(unicode_version)
        return table._replace(widths=with_spacing_marks(table.widths))

    load.payrun_original = original
    rc.load_cell_table = load
    _clear_rich_caches(rc)
    return True


def forget_rich_spacing_marks() -> None:
    """Undo ``teach_rich_spacing_marks`` (tests)."""
    import rich.cells as rc

    original = getattr(rc.load_cell_table, "payrun_original", None)
    if original is not None:
        rc.load_cell_table = original
        _clear_rich_caches(rc)


def _clear_rich_caches(rc) -> None:
    """rich's caches of measures made with the table before: its cell sizes, and a
    segment's cut at a cell (``Segment._split_cells``: a cut made before served after)."""
    from rich.segment import Segment

    for fn in (getattr(rc, "get_character_cell_size", None), getattr(rc, "cached_cell_len", None),
               getattr(Segment, "_split_cells", None)):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
