"""Reuse WeasyPrint's CSS cascade between documents of the same shape.

Every salary slip is the same document with different text: the same elements, classes
and attributes in the same places, so the same CSS rules match the same elements and
every element gets the same computed style. WeasyPrint works the cascade out again for
each document (selector matching, then each property computed on first use during layout
and painting): about a third of a slip's render time (bench/README.md, session 16).

`render(html, stylesheets, font_config)` renders an `HTML` exactly as `HTML.render` does,
except that the styles computed for the first document of a given *shape* are kept and
handed to the next document of that shape, element for element. Only what a selector or
an author stylesheet can see goes into the shape:

- each element in document order: its tag, its attributes with their values, whether it
  has text of its own, and how many children it has (so `:empty`, `:nth-child`,
  attribute selectors, `lang` and `style="..."` all see the same tree);
- the full text of `<style>` elements;
- the identity of the stylesheets, font configuration and options.

The one attribute left out is `<meta content>`, which our slip fills with the company name
and no stylesheet looks at. Text itself never enters the cascade, and it is not part of
the shape. A document whose shape differs from every kept one is rendered the ordinary
way and its styles are kept (at most MAX_SHAPES, least recently used dropped): a wrong
guess costs time, never a different slip. A document that defines anchors (`id`, `name`)
is not kept, because WeasyPrint collects those for cross-references while it computes
styles.

This relies on WeasyPrint internals (`Document._render`'s layout context, `StyleFor`):
the version is pinned in pyproject.toml, and tests/test_cascade.py proves, for slips of
every shape we make, that the PDF is byte for byte the one the ordinary path writes.
That test is also the guard for template changes: WeasyPrint writes a few computed values
back in place while it builds boxes (a collapsed table's padding, the body's `overflow`,
`::first-line` styles). For slip.css every such write puts back the value already there,
so a kept style gives the same slip the next time; a new rule that made one differ would
show as a kept-cascade slip that differs from the ordinary render.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, Sequence

from weasyprint import DEFAULT_OPTIONS, Document
from weasyprint.css import StyleFor, get_all_computed_styles
from weasyprint.css.targets import TargetCollector
from weasyprint.images import get_image_from_uri
from weasyprint.layout import LayoutContext

MAX_SHAPES = 8
"""Shapes kept per process. A slip has two (with and without a Bengali name)."""

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
    __slots__ = ("style_for", "elements", "counter_style")

    def __init__(self, style_for: StyleFor, elements: list, counter_style: dict):
        self.style_for = style_for
        self.elements = elements
        self.counter_style = counter_style


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
        if kept is not None:
            counter_style.update(kept.counter_style)
            return _rebound(kept, html)

        self.misses += 1
        style_for = get_all_computed_styles(
            html, list(stylesheets), options["presentational_hints"], font_config,
            counter_style, color_profiles, [], [], target_collector, options["pdf_forms"])
        if not target_collector.target_lookup_items:
            with self._lock:
                self._kept[key] = _Kept(style_for, list(html.etree_element.iter()),
                                        dict(counter_style))
                while len(self._kept) > self.max_shapes:
                    self._kept.popitem(last=False)
        return style_for


def _rebound(kept: _Kept, html: Any) -> StyleFor:
    """A StyleFor for `html` sharing `kept`'s computed styles, element for element."""
    new_for_old = dict(zip(kept.elements, html.etree_element.iter()))
    style_for = object.__new__(StyleFor)
    style_for.__dict__.update(kept.style_for.__dict__)
    # Keys are (element, pseudo type); pages are keyed by page types, not elements.
    style_for._computed_styles = {(new_for_old.get(element, element), pseudo): style
                                  for (element, pseudo), style
                                  in kept.style_for._computed_styles.items()}
    style_for._cascaded_styles = dict(kept.style_for._cascaded_styles)
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
    part of the shape).
    """
    options = dict(DEFAULT_OPTIONS)
    options["stylesheets"] = list(stylesheets)
    return _CascadeDocument._render(html, font_config, None, None, options)
