"""Reuse WeasyPrint's CSS cascade between documents of the same shape.

Every salary slip is the same document with different text: the same elements, classes
and attributes in the same places, so the same CSS rules match the same elements and
every element gets the same computed style. WeasyPrint works the cascade out again for
each document (selector matching, then each property computed on first use during layout
and painting): about a third of a slip's render time (bench/README.md, session 16).

`render(html, stylesheets, font_config)` renders an `HTML` exactly as `HTML.render` does,
except that the styles computed for the first document of a given *shape* are kept and
handed to the next document of that shape, element for element (by position in document
order: no element, and so none of the first document's text, is kept). What a selector
or an inline stylesheet can see goes into the shape:

- each element in document order: its tag, its attributes with their values, whether it
  has text of its own, and how many children it has (so `:empty`, `:nth-child`,
  attribute selectors, `lang` and `style="..."` all see the same tree);
- the full text of `<style>` elements;
- the identity of the stylesheets, font configuration and options.

Left out: text (it never enters the cascade), `<meta content>` (our slip puts the company
name there; no stylesheet looks at it), and the contents of stylesheets a document loads
by `<link>` or `@import` (taken as unchanged for the life of the process; the slip loads
none). A document whose shape differs from every kept one is rendered the ordinary way and
its styles are kept (at most MAX_SHAPES, least recently used dropped): a miss costs time.
Not kept at all: a document that defines anchors (`id`, `name`: WeasyPrint collects them
while it computes styles), and one whose root or body `overflow` is not `visible`
(WeasyPrint moves that value to the page by writing `visible` into the style).

WeasyPrint writes a few other values back into computed styles as it builds boxes (zero
margins and padding on table parts, the position of a `::first-letter`, list markers and
leaders); each puts back the same value every time, so a kept style gives the same
result. tests/test_cascade.py checks both halves for the slip template: no kept value
changes from one slip to the next, and slips of both shapes (wrapping text, markup
characters, the widest amounts) are byte for byte the ordinary render's. Run it when
slip.html or slip.css changes.

This relies on WeasyPrint internals (`Document._render`'s layout context, `StyleFor`):
it is used only with the WeasyPrint version it was written against (WEASYPRINT_VERSIONS;
pinned in pyproject.toml); with any other, `render` is the ordinary render.

Callers render one document at a time per process (jobs.slip's render lock): the kept
styles are shared by the renders that use them.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, Sequence

import weasyprint
from weasyprint import DEFAULT_OPTIONS, Document
from weasyprint.css import StyleFor, get_all_computed_styles
from weasyprint.css.targets import TargetCollector
from weasyprint.images import get_image_from_uri
from weasyprint.layout import LayoutContext

MAX_SHAPES = 8
"""Shapes kept per process. A slip has two (with and without a Bengali name)."""

WEASYPRINT_VERSIONS = ("70.0",)
"""The WeasyPrint versions whose internals this was written and tested against."""

ENABLED = weasyprint.__version__ in WEASYPRINT_VERSIONS

_UNSEEN = ("meta", "content")  # (tag, attribute) whose value no selector looks at


def shape(html: Any) -> tuple:
    """What the cascade of `html` (a weasyprint.HTML) depends on, as a hashable value."""
    parts = []
    for element in html.etree_element.iter():
        tag = element.tag
        if not isinstance(tag, str):  # comments and processing instructions
            parts.append((repr(tag), element.text))
            continue
        attrs = tuple(sorted((name, value) for name, value in element.attrib.items()
                             if (tag, name) != _UNSEEN))
        text = element.text if tag == "style" else bool(element.text)
        parts.append((tag, attrs, text, len(element)))
    return tuple(parts)


class _Kept:
    """A shape's computed styles by element position (document order), and what StyleFor
    holds beside them; no element of the document they were computed for."""

    __slots__ = ("attributes", "by_position", "counter_style")

    def __init__(self, style_for: StyleFor, elements: list, counter_style: dict):
        position = {element: i for i, element in enumerate(elements)}
        self.by_position = [(position[element], pseudo, style)
                            for (element, pseudo), style in style_for._computed_styles.items()
                            if element in position]
        self.attributes = {name: value for name, value in style_for.__dict__.items()
                           if name not in ("_computed_styles", "_cascaded_styles")}
        self.counter_style = counter_style


def _keepable(style_for: StyleFor, html: Any) -> bool:
    """Whether WeasyPrint would leave this document's computed styles as they are: not if
    the root's or body's `overflow` is not `visible` (build.set_viewport_overflow writes
    `visible` into the style it took the value from)."""
    root = html.etree_element
    body = next((child for child in root if child.tag == "body"), None)
    for element in (root, body):
        if element is not None:
            style = style_for(element)
            if style is not None and style["overflow"] != "visible":
                return False
    return True


class CascadeCache:
    """Computed styles of the last MAX_SHAPES document shapes, with hit/miss counts."""

    def __init__(self, max_shapes: int = MAX_SHAPES):
        self.max_shapes = max_shapes
        self._kept: OrderedDict[tuple, _Kept] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self.hits = self.misses = 0

    def style_for(self, html: Any, stylesheets: Sequence[Any], options: dict,
                  font_config: Any, counter_style: Any, color_profiles: Any,
                  target_collector: TargetCollector) -> StyleFor:
        key = (shape(html), tuple(id(sheet) for sheet in stylesheets), id(font_config),
               bool(options["presentational_hints"]), bool(options["pdf_forms"]),
               html.base_url, html.media_type)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if kept is not None:
            counter_style.update(kept.counter_style)
            return _rebound(kept, html)

        style_for = get_all_computed_styles(
            html, list(stylesheets), options["presentational_hints"], font_config,
            counter_style, color_profiles, [], [], target_collector, options["pdf_forms"])
        if not target_collector.target_lookup_items and _keepable(style_for, html):
            with self._lock:
                self._kept[key] = _Kept(style_for, list(html.etree_element.iter()),
                                        dict(counter_style))
                while len(self._kept) > self.max_shapes:
                    self._kept.popitem(last=False)
        return style_for


def _rebound(kept: _Kept, html: Any) -> StyleFor:
    """A StyleFor for `html` with `kept`'s computed styles, element for element."""
    elements = list(html.etree_element.iter())
    style_for = object.__new__(StyleFor)
    style_for.__dict__.update(kept.attributes)
    # Page styles (keyed by page type) are computed for each page as it is made.
    style_for._computed_styles = {(elements[i], pseudo): style
                                  for i, pseudo, style in kept.by_position}
    style_for._cascaded_styles = {}
    return style_for


CASCADES = CascadeCache()
"""The process's cache (render processes hold it under jobs.slip's render lock; a forked
job child inherits the parent's, warmed by jobs.slip.warm_up)."""


class _CascadeDocument(Document):
    """Document whose layout context takes its styles from CASCADES."""

    @classmethod
    def _build_layout_context(cls, html, font_config, counter_style, color_profiles,
                              options):
        # Document._build_layout_context with the style step through the cache. Images
        # are cached per document, as there.
        target_collector = TargetCollector()
        style_for = CASCADES.style_for(html, options["stylesheets"] or [], options,
                                       font_config, counter_style, color_profiles,
                                       target_collector)
        image_cache = options["cache"] if isinstance(options["cache"], dict) else {}
        get_image = functools.partial(get_image_from_uri, cache=image_cache,
                                      url_fetcher=html.url_fetcher, options=options)
        return LayoutContext(style_for, get_image, font_config, counter_style,
                             target_collector)


def render(html: Any, stylesheets: Sequence[Any], font_config: Any) -> Document:
    """`html.render(stylesheets=..., font_config=...)` with the cascade reused by shape.

    `stylesheets` must be `weasyprint.CSS` objects kept for the process (their identity is
    part of the shape). With a WeasyPrint this was not written for: the ordinary render.
    """
    if not ENABLED:
        return html.render(stylesheets=list(stylesheets), font_config=font_config)
    options = dict(DEFAULT_OPTIONS)
    options["stylesheets"] = list(stylesheets)
    with _RENDER_LOCK:
        return _CascadeDocument._render(html, font_config, None, None, options)


_RENDER_LOCK = threading.RLock()
"""One reusing render at a time in this process (jobs.slip holds its own lock around it
too): the kept styles are shared by the renders that use them."""
