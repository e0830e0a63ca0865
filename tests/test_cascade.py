"""jobs/cascade.py: a slip rendered with a kept cascade is the slip the ordinary path writes."""

from __future__ import annotations

import copy
import io
import os

import pytest
from pypdf import PdfReader
from weasyprint import HTML

from jobs import cascade, slip


def _snapshot(i: int, name_en: str, name_bn: str, company: str, bonus: int) -> dict:
    snap = copy.deepcopy(slip.SAMPLE_SNAPSHOT)
    snap["key"] = f"slip:2026-11:emp-{i:05d}"
    snap["employee"].update(id=f"emp-{i:05d}", name_en=name_en, name_bn=name_bn,
                            email=f"emp{i}@example.test")
    snap["company"]["name"] = company
    snap["earnings"]["bonus"] = bonus
    return snap


# Both shapes (with and without a Bengali name), interleaved; text that wraps, text with
# markup characters, the widest amounts, a company ending in a full stop.
SLIPS = [
    _snapshot(1, "Tanvir Ahmed", "তানভীর আহমেদ", "Meghna Textiles Ltd", 0),
    _snapshot(2, "A B", "", "X Ltd.", 12_345_678),
    _snapshot(3, "Md. Abdullah Al Mamun Chowdhury Md. Abdullah Al Mamun Chowdhury",
              "মোহাম্মদ আব্দুল্লাহ আল মামুন চৌধুরী মোহাম্মদ আব্দুল্লাহ আল মামুন চৌধুরী",
              "A very long company name, a very long company name, a very long one", 0),
    _snapshot(4, "<b>Rahim</b> & \"Karim\" 'O'Neil'", "", "<i>Jamuna</i> & Sons", 10**12),
    _snapshot(5, "W" * 80, "ক" * 80, "M" * 80, 999_999_999_999),
    _snapshot(6, "Nusrat Jahan", "নুসরাত জাহান", "Padma Foods.", 50_000),
]


def _ordinary(snap: dict) -> bytes:
    return slip._document(slip.render_html(snap)).write_pdf()


@pytest.fixture
def fresh_cache():
    cascade.CASCADES.clear()
    yield cascade.CASCADES
    cascade.CASCADES.clear()


def test_every_slip_is_byte_for_byte_the_ordinary_render(fresh_cache):
    expected = [_ordinary(snap) for snap in SLIPS]
    got = [slip.render_pdf(snap) for snap in SLIPS]
    again = [slip.render_pdf(snap) for snap in reversed(SLIPS)][::-1]

    for i, (want, first, second) in enumerate(zip(expected, got, again)):
        assert first == want, f"slip {i + 1} differs on its first render"
        assert second == want, f"slip {i + 1} differs when rendered from a kept cascade"
    # Two shapes: the first slip of each is worked out, every other reuses it.
    assert (fresh_cache.misses, fresh_cache.hits, len(fresh_cache)) == (2, 10, 2)
    # And the texts really are each employee's own (not the kept document's).
    for snap, pdf in zip(SLIPS, got):
        text = PdfReader(io.BytesIO(pdf)).pages[0].extract_text()
        assert snap["key"] in text


def test_warm_up_keeps_both_shapes_before_the_worker_forks(fresh_cache):
    slip._WARM_PID = None
    slip.warm_up()
    assert len(fresh_cache) == 2
    misses = fresh_cache.misses
    for snap in SLIPS:
        slip.render_pdf(snap)
    assert fresh_cache.misses == misses


def _html(body: str, head: str = "") -> HTML:
    return HTML(string=f"<html><head>{head}</head><body>{body}</body></html>")


def test_the_shape_ignores_text_and_meta_content_only():
    base = cascade.shape(_html("<p class='a'>one</p><p>two</p>",
                               "<meta name='author' content='Meghna'>"))
    assert cascade.shape(_html("<p class='a'>other text</p><p>x</p>",
                               "<meta name='author' content='Jamuna'>")) == base
    assert (cascade.shape(_html("<p><b>x</b> after</p>"))
            == cascade.shape(_html("<p><b>y</b> other text after</p>")))
    different = [
        _html("<p class='b'>one</p><p>two</p>", "<meta name='author' content='Meghna'>"),
        _html("<p class='a'>one</p><p></p>", "<meta name='author' content='Meghna'>"),
        _html("<p class='a'>one</p><p>two</p><p>three</p>",
              "<meta name='author' content='Meghna'>"),
        _html("<p class='a'>one</p><p><b>two</b></p>", "<meta name='author' content='Meghna'>"),
        _html("<p class='a' lang='bn'>one</p><p>two</p>",
              "<meta name='author' content='Meghna'>"),
        _html("<p class='a' style='color: red'>one</p><p>two</p>",
              "<meta name='author' content='Meghna'>"),
        _html("<p class='a'>one</p><p>two</p>",
              "<meta name='author' content='Meghna'><style>p { color: red }</style>"),
        _html("<p class='a'>one</p><p>two</p>", "<meta name='keywords' content='Meghna'>"),
    ]
    shapes = {cascade.shape(html) for html in different}
    assert base not in shapes and len(shapes) == len(different)
    # <style> text is part of the shape: it is a stylesheet, not content.
    assert (cascade.shape(_html("<p>x</p>", "<style>p { color: red }</style>"))
            != cascade.shape(_html("<p>x</p>", "<style>p { color: blue }</style>")))


def _render(html: HTML, cache: cascade.CascadeCache) -> bytes:
    font_config, _ = slip._renderer()
    saved = cascade.CASCADES
    cascade.CASCADES = cache
    try:
        with slip._RENDER_LOCK:
            return cascade.render(html, [slip._stylesheet()], font_config).write_pdf()
    finally:
        cascade.CASCADES = saved


def test_the_cache_keeps_the_most_recent_shapes_only():
    cache = cascade.CascadeCache(max_shapes=2)
    for i in range(4):
        _render(_html("<p>x</p>" * (i + 1)), cache)
    assert (len(cache), cache.misses, cache.hits) == (2, 4, 0)
    _render(_html("<p>y</p>" * 4), cache)  # kept: the most recent
    _render(_html("<p>y</p>"), cache)      # dropped long ago: worked out again
    assert (cache.misses, cache.hits) == (5, 1)


def _plain(html: HTML) -> bytes:
    font_config, _ = slip._renderer()
    with slip._RENDER_LOCK:
        return html.render(stylesheets=[slip._stylesheet()], font_config=font_config).write_pdf()


@pytest.mark.parametrize("body, head", [
    ("<p id='top'>x</p><p>y</p>", ""),  # anchors: collected while styles are computed
    ("<p>x</p><p>y</p>", "<style>body { overflow: hidden }</style>"),  # moved to the page
    ("<p>x</p><p>y</p>", "<style>html { overflow: hidden }</style>"),
])
def test_documents_whose_styles_weasyprint_would_change_are_never_kept(body, head):
    cache = cascade.CascadeCache()
    pdfs = [_render(_html(body, head), cache) for _ in range(3)]
    assert (len(cache), cache.hits, cache.misses) == (0, 0, 3)
    assert pdfs == [_plain(_html(body, head))] * 3


def test_no_kept_value_changes_from_one_slip_to_the_next(fresh_cache):
    """What makes a kept cascade safe: WeasyPrint may compute more values into a kept
    style as slips need them, but never changes one it already has."""
    slip._WARM_PID = None
    slip.warm_up()
    kept = [(style, dict(style)) for entry in fresh_cache._kept.values()
            for _, _, style in entry.by_position]
    for snap in SLIPS * 2:
        slip.render_pdf(snap)
    changed = [(key, before[key], style[key]) for style, before in kept
               for key in before if style[key] != before[key]]
    assert changed == []


def test_no_element_of_the_first_document_is_kept(fresh_cache):
    import gc
    import weakref

    html = HTML(string=slip.render_html(SLIPS[1]), base_url=slip.ASSETS_BASE_URL,
                url_fetcher=slip._renderer()[1])
    root = weakref.ref(html.etree_element)
    font_config, _ = slip._renderer()
    with slip._RENDER_LOCK:
        document = cascade.render(html, [slip._stylesheet()], font_config)
    assert len(fresh_cache) == 1
    del html, document
    gc.collect()
    assert root() is None  # the employee's name, amounts and account went with it


def test_with_another_weasyprint_it_is_the_ordinary_render(fresh_cache, monkeypatch):
    monkeypatch.setattr(cascade, "ENABLED", False)
    assert [slip.render_pdf(snap) for snap in SLIPS[:3]] == [_ordinary(snap) for snap in SLIPS[:3]]
    assert (fresh_cache.hits, fresh_cache.misses, len(fresh_cache)) == (0, 0, 0)


def test_a_kept_cascade_gives_each_document_its_own_text():
    cache = cascade.CascadeCache()
    pdfs = [_render(_html(f"<p class='a'>{word}</p>"), cache) for word in ("alpha", "beta")]
    assert cache.hits == 1
    texts = [PdfReader(io.BytesIO(pdf)).pages[0].extract_text() for pdf in pdfs]
    assert "alpha" in texts[0] and "beta" in texts[1] and "alpha" not in texts[1]


def test_a_forked_child_renders_from_the_parents_kept_cascade(tmp_path, fresh_cache):
    slip._WARM_PID = None
    slip.warm_up()
    want = _ordinary(SLIPS[2])
    out = tmp_path / "child.pdf"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            misses = cascade.CASCADES.misses
            out.write_bytes(slip.render_pdf(SLIPS[2]))
            code = 0 if cascade.CASCADES.misses == misses else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.read_bytes() == want


def test_re_issued_and_corrected_slips_from_a_kept_cascade_are_the_ordinary_render(fresh_cache):
    """A resend's line (jobs.policy.reissue_marks) makes a third shape; a corrected slip
    shares it with a re-issued one, its heading and credit line other text."""
    marks = [{"reissued": "2026-12-04"}, {"reissued": "2026-12-04", "replaces": "2026-12-01"},
             {"reissued": "2026-12-04", "replaces": "2026-12-01", "corrected": True}]
    snaps = [{**SLIPS[i % 2], **m} for i, m in enumerate(marks * 2)]
    for snap in snaps:
        assert slip.render_pdf(snap) == _ordinary(snap)
    assert fresh_cache.hits >= 4
