"""A DataTable keyed by id whose rows are synced in place from each snapshot."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import DataTable

from console.fmt import clip, columns

RESERVED = 3
"""Columns of a table's width its cells never get when its rows overflow its height: the
focus bar (1) and a vertical scrollbar (2). A table whose rows all fit keeps no room for a
scrollbar it does not show (at 80 columns the queues table, three rows, had 2 columns less
than it has, and a drained queue's "⏸" added a scrollbar row to it)."""
FOCUS_BAR = 1
MIN_CLIPPED = 8
"""A ``clip`` column keeps at least this many columns (terminal cells)."""


def _plain(cell: Any) -> Any:
    """A str cell as plain text: DataTable reads a str as Rich markup, so a company name
    from the payroll import holding ``[/]`` crashed the console (MarkupError), and
    ``[@click=app.…]`` or ``[link=…]`` made a name a clickable action or link."""
    return Text(cell) if isinstance(cell, str) else cell


class LiveTable(DataTable):
    """Rows keyed by a stable id (job id, worker name, queue). ``sync`` updates changed
    cells in place, removes rows gone, appends new ones; a reorder rebuilds once and keeps
    the cursor on the same key.

    ``drop``: column keys to leave out, first to last, while the columns would not fit
    the table's width (at 80 columns the failed list's last error and the workers' alive
    were cut off the right edge); a column comes back when the table is wide enough. A
    ``drop`` column empty in every row is left out at any width.

    ``clip``: column keys whose text, when the columns still do not fit once the ``drop``
    ones are out, is cut at a word with "…" (console.fmt.clip) to the room the others
    leave, instead of running off the right edge behind a scrollbar (the running view's
    stuck reason); whole again when there is room."""

    DEFAULT_CSS = """
    LiveTable { height: auto; max-height: 100%; }
    """

    def __init__(self, columns: list[tuple[str, str]], drop: tuple[str, ...] = (), clip: tuple[str, ...] = (),
                 **kw: Any):
        kw.setdefault("cursor_type", "row")
        kw.setdefault("zebra_stripes", False)
        super().__init__(**kw)
        self._columns = columns
        self._drop = drop
        self._clip = clip
        self._clip_w: dict[str, int] = {}
        """Terminal columns each ``clip`` column is cut to now (none: whole)."""
        self._shown = [k for k, _ in columns]
        self._cells: dict[str, tuple] = {}
        """Every row's cells, one per column in ``columns`` (shown or not)."""

    def on_mount(self) -> None:
        for key, label in self._columns:
            self.add_column(label, key=key)

    def on_resize(self) -> None:
        self._fit_columns()

    def room(self) -> int:
        """The cells' width: the table's, less the focus bar (there or not), less a
        vertical scrollbar when the rows (and the header) are more than its height holds."""
        rows = self.row_count + (1 if self.show_header else 0)
        scrollbar = RESERVED - FOCUS_BAR if rows > self.size.height else 0
        return self.outer_size.width - FOCUS_BAR - scrollbar

    def _fit_columns(self) -> None:
        """Leave out the ``drop`` columns, in their order, that the width has no room for;
        then cut the ``clip`` columns to the room left."""
        if not (self._drop or self._clip) or not self.size.width:
            return
        widths = {}
        for i, (key, label) in enumerate(self._columns):
            cells = [columns(Text.from_markup(label).plain)] + [  # (terminal columns: a Bengali name's more)
                columns(c.plain if isinstance(c, Text) else str(c)) for c in
                (row[i] for row in self._cells.values())]
            widths[key] = max(cells) + 2 * self.cell_padding
        room = self.room()
        # a droppable column empty in every row says nothing (the program of workers not run by supervisord)
        empty = {k for i, (k, _) in enumerate(self._columns) if k in self._drop and self._cells
                 and all(str(row[i]) == "" for row in self._cells.values())}
        shown = [k for k, _ in self._columns if k not in empty]
        for key in self._drop:
            if sum(widths[k] for k in shown) <= room:
                break
            if key in shown:
                shown.remove(key)
        clip_w: dict[str, int] = {}
        over = sum(widths[k] for k in shown) - room
        for key in self._clip:
            if over <= 0:
                break
            if key in shown:
                whole = widths[key] - 2 * self.cell_padding
                clip_w[key] = max(MIN_CLIPPED, whole - over)
                over -= whole - clip_w[key]
        if shown != self._shown or clip_w != self._clip_w:
            self._shown, self._clip_w = shown, clip_w
            self._rebuild()

    def _rebuild(self) -> None:
        keep = self.current_key
        self.clear(columns=True)
        for key, label in self._columns:
            if key in self._shown:
                self.add_column(label, key=key)
        for key, cells in self._cells.items():
            self.add_row(*self._visible(cells), key=key)
        if keep is not None and keep in self._cells:
            self.move_cursor(row=self.get_row_index(keep), animate=False)

    def _visible(self, cells: tuple) -> tuple:
        """The shown columns' cells, as plain text (:func:`_plain`), cut where ``clip`` says."""
        return tuple(self._cell(k, c) for (k, _), c in zip(self._columns, cells) if k in self._shown)

    def _cell(self, key: str, cell: Any) -> Any:
        """One cell as shown in column ``key``: plain text, cut to ``_clip_w`` if it says so."""
        width = self._clip_w.get(key)
        if width is None:
            return _plain(cell)
        text = cell.plain if isinstance(cell, Text) else str(cell)
        if columns(text) <= width:  # (terminal columns, not len: a Bengali or CJK name)
            return _plain(cell)
        return Text(clip(text, width), style=cell.style if isinstance(cell, Text) else "")

    @property
    def current_key(self) -> str | None:
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key.value
        except Exception:
            return None

    def keys(self) -> list[str]:
        return list(self._cells)

    def sync(self, rows: list[tuple[str, tuple]]) -> None:
        wanted = [k for k, _ in rows]
        if wanted == list(self._cells):
            cols = [k for k, _ in self._columns]
            for key, cells in rows:
                old = self._cells[key]
                for i, (a, b) in enumerate(zip(old, cells)):
                    if (str(a) != str(b) or type(a) is not type(b)) and cols[i] in self._shown:
                        self.update_cell(key, cols[i], self._cell(cols[i], b), update_width=True)
                self._cells[key] = cells
            self._fit_columns()
            return
        keep = self.current_key
        gone = set(self._cells) - set(wanted)
        order_same = [k for k in self._cells if k not in gone] == wanted[: len(self._cells) - len(gone)]
        if order_same:  # only removals at any place and additions at the end
            for k in gone:
                self.remove_row(k)
                del self._cells[k]
            cols = [k for k, _ in self._columns]
            for key, cells in rows:
                if key in self._cells:
                    if tuple(map(str, self._cells[key])) != tuple(map(str, cells)):
                        for i, (a, b) in enumerate(zip(self._cells[key], cells)):
                            if str(a) != str(b) and cols[i] in self._shown:
                                self.update_cell(key, cols[i], self._cell(cols[i], b), update_width=True)
                else:
                    self.add_row(*self._visible(cells), key=key)
                self._cells[key] = cells
        else:
            self.clear()
            self._cells = {}
            for key, cells in rows:
                self.add_row(*self._visible(cells), key=key)
                self._cells[key] = cells
        self._fit_columns()
        if keep is not None and keep in self._cells:
            self.move_cursor(row=self.get_row_index(keep), animate=False)
