"""Salary slip renderer: jobs/slip.py + jobs/templates/slip.html."""

from __future__ import annotations

import copy
import http.server
import io
import shutil
import logging
import os
import platform
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pypdf import PdfReader
from weasyprint import HTML

from jobs import slip
from jobs.errors import PermanentError

AMOUNT = st.integers(min_value=0, max_value=10**10)


def snapshot(**changes) -> dict:
    """A deep copy of SAMPLE_SNAPSHOT; changes like employee__name_en="x"."""
    snap = copy.deepcopy(slip.SAMPLE_SNAPSHOT)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = snap
        for part in parents:
            target = target[part]
        target[leaf] = value
    return snap


def pdf_text(pdf: bytes) -> str:
    reader = PdfReader(io.BytesIO(pdf))
    assert len(reader.pages) == 1
    return reader.pages[0].extract_text()


@pytest.fixture(scope="module", autouse=True)
def warm():
    slip.warm_up()


@pytest.fixture(scope="module")
def sample_pdf() -> bytes:
    return slip.render_pdf(slip.SAMPLE_SNAPSHOT)


# --------------------------------------------------------------------------- content

def test_sample_slip_text(sample_pdf):
    assert sample_pdf.startswith(b"%PDF-")
    text = pdf_text(sample_pdf)
    for expected in ("Meghna Textiles Ltd", "House 12, Road 4, Dhanmondi, Dhaka 1205",
                     "Salary slip — November 2026", "Tanvir Ahmed", "emp-00017", "Finance",
                     "Senior Accountant", "•••• 4821", "1 – 30 November 2026",
                     "Gross earnings", "Total deductions", "NET PAY", "৳ 65,000.00",
                     "73,000.00", "8,000.00",
                     "This is a computer-generated slip and needs no signature",
                     "slip:2026-11:emp-00017"):
        assert expected in text, expected


def test_sample_slip_is_a4_portrait_with_bundled_fonts_only(sample_pdf):
    page = PdfReader(io.BytesIO(sample_pdf)).pages[0]
    width, height = float(page.mediabox.width), float(page.mediabox.height)
    assert (round(width), round(height)) == (595, 842)  # A4 in points
    fonts = {str(f.get_object()["/BaseFont"]).split("+")[-1]
             for f in page["/Resources"]["/Font"].values()}
    # Every glyph comes from a bundled face (no system fallback), including Bengali and ৳.
    assert fonts == {"Slip-Sans", "Slip-Sans-Bold", "Slip-Bengali", "Slip-Bengali-Bold"}


def test_bundled_fonts():
    from fontTools.ttLib import TTFont

    fonts = sorted((slip.ASSETS_DIR / "fonts").glob("*.ttf"))
    assert sum(f.stat().st_size for f in fonts) < 2 * 1024 * 1024
    bengali = TTFont(slip.ASSETS_DIR / "fonts" / "NotoSansBengali-Regular.ttf")
    assert 0x09F3 in bengali.getBestCmap()  # ৳
    assert (slip.ASSETS_DIR / "fonts" / "OFL.txt").is_file()


def test_html_is_escaped_and_strict(sample_pdf):
    html = slip.render_html(snapshot(employee__name_en='<b>x</b> & "q"'))
    assert "&lt;b&gt;x&lt;/b&gt; &amp; &#34;q&#34;" in html
    assert "<b>x</b>" not in html
    with pytest.raises(PermanentError, match="template"):
        slip.render_html({**snapshot(), "company": {"name": "Only a name"}})


def test_html_in_name_is_printed_literally():
    name = '<b>HTML</b> & "quotes"'
    text = pdf_text(slip.render_pdf(snapshot(employee__name_en=name)))
    assert "<b>" in text
    assert name in text


def test_long_bengali_name_fits_one_page():
    name_bn = "মোহাম্মদ আব্দুল্লাহ আল মামুন চৌধুরী শ্রীমঙ্গল ক্ষেত্র"
    pdf = slip.render_pdf(snapshot(employee__name_bn=name_bn,
                                   employee__name_en="Mohammad Abdullah Al Mamun Chowdhury"))
    assert "Mohammad Abdullah Al Mamun" in pdf_text(pdf)



def _every_field_at_its_maximum(fill: str) -> dict:
    """SAMPLE_SNAPSHOT with every text field as long as validate() allows, of `fill`
    repeated, and every amount the largest allowed."""
    snap = snapshot()
    for field, limit in slip.COMPANY_FIELDS.items():
        snap["company"][field] = (fill * limit)[:limit].strip() or fill
    for field, limit in slip.EMPLOYEE_FIELDS.items():
        snap["employee"][field] = (fill * limit)[:limit].strip()
    snap["employee"]["email"] = "W" * 120 + "@" + "W" * 128 + ".bd"
    snap["employee"]["name_bn"] = (fill * slip.NAME_BN_MAX)[:slip.NAME_BN_MAX].strip()
    snap["earnings"] = {key: slip.MAX_AMOUNT for key, _ in slip.EARNINGS}
    snap["deductions"] = {key: slip.MAX_AMOUNT for key, _ in slip.DEDUCTIONS}
    slip.validate(snap)
    return snap


@pytest.mark.parametrize("fill", ["W", "WWWWWWW ", "ক"], ids=["unbroken", "words", "bengali"])
def test_a_slip_with_every_field_at_its_maximum_still_renders_on_one_page(fill):
    """Each field alone fits the normal layout, all of them at once do not: the render
    falls back to the compact stylesheet instead of failing the employee's slip."""
    snap = _every_field_at_its_maximum(fill)
    html = slip.render_html(snap)
    assert len(slip._document(html).pages) > 1  # the normal layout overflows
    before = slip.render_pdf(slip.SAMPLE_SNAPSHOT)
    text = pdf_text(slip.render_pdf(snap))  # one page (pdf_text asserts it)
    assert "20,00,00,00,000.00" in text  # the net pay
    assert "Reference" in text and "This is a computer-generated slip" in text
    # the compact layout leaves the kept cascade of normal slips alone
    assert slip.render_pdf(slip.SAMPLE_SNAPSHOT) == before
    # a re-issued one (`payrun resend`) has a line more, and still one page
    text = pdf_text(slip.render_pdf({**snap, "reissued": "2026-12-04"}))
    assert "Re-issued on 2026-12-04" in text and "20,00,00,00,000.00" in text


def test_only_a_date_marks_a_slip_re_issued():
    assert "Re-issued" not in slip.render_html({**slip.SAMPLE_SNAPSHOT, "reissued": "<b>x</b>"})
    assert "Re-issued" not in slip.render_html(slip.SAMPLE_SNAPSHOT)
    assert "Re-issued on 2026-12-04" in slip.render_html({**slip.SAMPLE_SNAPSHOT, "reissued": "2026-12-04"})

def _boxes(box):
    yield box
    for child in getattr(box, "children", ()):
        yield from _boxes(child)


def _box_of(page, css_class: str):
    """The outermost layout box of the element with that class."""
    return next(b for b in _boxes(page._page_box)
                if b.element is not None and css_class in (b.element.get("class") or "").split())


def test_the_widest_values_stay_inside_their_fixed_layout_boxes():
    """The masthead and net-pay rows are fixed-layout tables (set widths, no content
    measuring): the largest amounts validation allows and the longest company name and
    address must still fit inside them."""
    snap = snapshot(company__name="M" * slip.COMPANY_FIELDS["name"],
                    company__address="Dhanmondi " * (slip.COMPANY_FIELDS["address"] // 10))
    for section in ("earnings", "deductions"):
        for k in snap[section]:
            snap[section][k] = slip.MAX_AMOUNT if section == "earnings" else 0
    with slip._RENDER_LOCK:
        doc = slip._document(slip.render_html(snap))
    (page,) = doc.pages
    net = _box_of(page, "net")
    amount = _box_of(page, "net-amount")
    label = _box_of(page, "net-label")
    text_right = max(b.position_x + b.width for b in _boxes(amount) if type(b).__name__ == "TextBox")
    assert text_right <= net.content_box_x() + net.width + 0.01
    assert label.position_x + label.margin_width() <= min(b.position_x for b in _boxes(amount)
                                                           if type(b).__name__ == "TextBox")
    masthead = _box_of(page, "masthead")
    for cls in ("company-name", "company-address", "doc-month"):
        box = _box_of(page, cls)
        assert box.position_x + box.margin_width() <= masthead.content_box_x() + masthead.width + 0.01


def test_format_bdt_and_words():
    assert slip.format_bdt(4500000) == "৳ 45,000.00"
    assert slip.format_bdt(0) == "৳ 0.00"
    assert slip.format_bdt(5) == "৳ 0.05"
    assert slip.format_bdt(123456789) == "৳ 12,34,567.89"  # lakh and crore, as the source story writes ১,০০,০০০
    assert slip.format_bdt(10000000) == "৳ 1,00,000.00" and slip.format_bdt(9999900) == "৳ 99,999.00"
    assert slip.format_amount(12345678900) == "12,34,56,789.00"
    assert slip.amount_in_words(12345678900) == ("Twelve crore thirty-four lakh fifty-six thousand seven hundred "
                                                 "eighty-nine taka only")
    assert slip.amount_in_words(10000000) == "One lakh taka only"
    assert slip.amount_in_words(2000000000000) == "Two thousand crore taka only"
    assert slip.format_bdt(-150) == "-৳ 1.50"
    assert slip.amount_in_words(6500000) == "Sixty-five thousand taka only"
    assert slip.amount_in_words(10101) == "One hundred one taka and one poisha only"
    assert slip.month_label("2026-02") == "February 2026"
    assert slip.pay_period("2028-02") == "1 – 29 February 2028"


@given(st.integers(min_value=0, max_value=10**15))
def test_lakh_grouping_keeps_every_digit_in_groups_of_two_above_the_last_three(taka):
    text = slip.group_lakh(taka)
    assert int(text.replace(",", "")) == taka
    groups = text.split(",")
    assert len(groups[-1]) == 3 or len(groups) == 1
    assert all(len(g) == 2 for g in groups[1:-1]) and 1 <= len(groups[0]) <= (3 if len(groups) == 1 else 2)


def _amounts(components):
    return st.fixed_dictionaries({k: AMOUNT for k, _ in components})


@settings(max_examples=200)
@given(_amounts(slip.EARNINGS), _amounts(slip.DEDUCTIONS))
def test_totals_property(earnings, deductions):
    t = slip.totals(snapshot(earnings=earnings, deductions=deductions))
    assert all(type(v) is int for v in t.values())
    assert t["gross"] == sum(earnings.values())
    assert t["deductions"] == sum(deductions.values())
    assert t["net"] == t["gross"] - t["deductions"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_amounts(slip.EARNINGS), _amounts(slip.DEDUCTIONS))
def test_rendered_totals_property(earnings, deductions):
    snap = snapshot(earnings=earnings, deductions=deductions)
    t = slip.totals(snap)
    text = pdf_text(slip.render_pdf(snap))
    assert slip.format_bdt(t["net"]) in text
    assert slip.format_amount(t["gross"]) in text
    assert slip.format_amount(t["deductions"]) in text


def test_nothing_logged_about_the_employee(caplog):
    snap = snapshot(employee__name_en="Zubaida Rahman")
    with caplog.at_level(logging.DEBUG):
        slip.render_pdf(snap)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in ("Zubaida", "65,000", "6500000", "4500000", "45,000"):
        assert secret not in logged


# --------------------------------------------------------------------------- fetcher

class _RecordingHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.server.paths.append(self.path)
        body = b"body { color: red }"
        self.send_response(200)
        self.send_header("Content-Type", "text/css")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RecordingHandler)
    server.paths = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_rendering_makes_no_network_requests(http_server):
    base = f"http://127.0.0.1:{http_server.server_port}"
    html = textwrap.dedent(f"""\
        <html><head>
        <link rel=stylesheet href={base}/x.css>
        <style>@import url({base}/import.css);
          @font-face {{ font-family: Remote; src: url({base}/font.ttf); }}
          body {{ background: url({base}/bg.png); font-family: Remote }}</style>
        </head><body><img src="{base}/img.png"><img src="file:///etc/passwd">
        <p>hello</p></body></html>""")
    assert slip.html_to_pdf(html).startswith(b"%PDF-")
    # A name carrying a URL is escaped text anyway; still no request.
    pdf = slip.render_pdf(snapshot(employee__name_en=f'<img src="{base}/name.png">'))
    assert "<img src=" in pdf_text(pdf)
    assert http_server.paths == []

    # Control: the same HTML through WeasyPrint's default fetcher does hit the server,
    # so the empty list above is not vacuous. (Requests complete before write_pdf returns.)
    from weasyprint.text.fonts import FontConfiguration

    font_config = FontConfiguration()  # (its @font-face folder removed here, not at some later GC)
    try:
        HTML(string=html).write_pdf(font_config=font_config)
    finally:
        if font_config._folder:
            shutil.rmtree(font_config._folder, ignore_errors=True)
    assert "/x.css" in http_server.paths


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/x.css",
    "https://example.com/x.css",
    "file:///etc/passwd",
    "data:text/css,body{}",
    "ftp://127.0.0.1/x",
    slip.ASSETS_BASE_URL + "../slip.py",
    slip.ASSETS_BASE_URL + "%2e%2e/slip.py",
    slip.ASSETS_BASE_URL + "fonts",  # a directory
    slip.ASSETS_BASE_URL.replace("file:///", "file://evil.example/") + "fonts/OFL.txt",
])
def test_fetcher_refuses_outside_assets(url):
    fetcher = slip.AssetsOnlyFetcher()
    with pytest.raises(slip.ResourceRefused):
        fetcher.fetch(url)
    with pytest.raises(slip.ResourceRefused):
        fetcher(url)


def test_fetcher_refuses_symlink_escaping_assets(tmp_path):
    root = tmp_path / "assets"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("secret")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    (root / "ok.txt").write_text("ok")
    fetcher = slip.AssetsOnlyFetcher(root)
    with pytest.raises(slip.ResourceRefused):
        fetcher.fetch((root / "link.txt").as_uri())
    assert fetcher.fetch((root / "ok.txt").as_uri()).read() == b"ok"


def test_fetcher_serves_bundled_font():
    response = slip.AssetsOnlyFetcher().fetch(slip.ASSETS_BASE_URL + "fonts/NotoSans-Regular.ttf")
    assert response.read()[:4] == b"\x00\x01\x00\x00"
    response.close()


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("change, message", [
    ({"employee__email": ""}, "email"),
    ({"employee__email": "not-an-address"}, "email"),
    ({"employee__name_en": "  "}, "name"),
    ({"employee__department": None}, "department"),
    ({"company__name": ""}, "company name"),
    ({"earnings__basic": -4500000}, "negative"),
    ({"earnings__basic": 45000.0}, "whole number"),
    ({"deductions__tax": "350000"}, "whole number"),
    ({"deductions__loan": True}, "whole number"),
    ({"earnings__overtime": 100}, "unknown"),
    ({"month": "2026-13"}, "month"),
    ({"key": ""}, "key"),
    ({"employee__name_en": "x" * 500}, "longer than"),
    ({"employee__name_en": "\x00"}, "control character"),
    ({"employee__name_bn": "ক\x1b[31m"}, "control character"),
    ({"company__address": "Road 4\x7f"}, "control character"),
])
def test_validate_rejects_bad_data(change, message):
    snap = snapshot(**change)
    with pytest.raises(PermanentError, match=message) as excinfo:
        slip.validate(snap)
    assert "4500000" not in str(excinfo.value) and "350000" not in str(excinfo.value)
    with pytest.raises(PermanentError):
        slip.render_pdf(snap)


@pytest.mark.parametrize("drop", ["employee.email", "employee.name_en", "earnings.bonus",
                                  "deductions", "company"])
def test_validate_rejects_missing_fields(drop):
    snap = snapshot()
    section, _, field = drop.partition(".")
    if field:
        del snap[section][field]
    else:
        del snap[section]
    with pytest.raises(PermanentError, match="emp-00017"):
        slip.validate(snap)


def test_validate_accepts_sample_and_empty_bengali_name():
    slip.validate(slip.SAMPLE_SNAPSHOT)
    slip.validate(snapshot(employee__name_bn=""))


# --------------------------------------------------------------------------- storage

def test_write_slip_modes(tmp_path):
    old_umask = os.umask(0o022)
    try:
        target = tmp_path / "2026-11" / "co-3" / "emp-00017.pdf"
        slip.write_slip(target, b"%PDF-one")
        assert target.read_bytes() == b"%PDF-one"
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        for directory in (target.parent, target.parent.parent):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700

        target.chmod(0o644)  # an existing file is replaced by a fresh 0600 one
        slip.write_slip(target, b"%PDF-two")
        assert target.read_bytes() == b"%PDF-two"
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        assert sorted(p.name for p in target.parent.iterdir()) == ["emp-00017.pdf"]
    finally:
        os.umask(old_umask)


def test_write_slip_leaves_existing_dir_modes(tmp_path):
    existing = tmp_path / "store"
    existing.mkdir(mode=0o755)
    existing.chmod(0o755)
    slip.write_slip(existing / "new" / "a.pdf", b"x")
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755
    assert stat.S_IMODE((existing / "new").stat().st_mode) == 0o700


# --------------------------------------------------------------------------- warm-up + fork

def test_warm_up_survives_fork_children_exiting(tmp_path):
    """The parent's shared font configuration outlives forked children that exit normally."""
    script = textwrap.dedent("""\
        import os, sys
        from jobs import slip
        slip.warm_up()
        folder = slip._FONT_CONFIG._folder
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                ok = slip.render_pdf(slip.SAMPLE_SNAPSHOT).startswith(b"%PDF-")
                sys.exit(0 if ok else 3)  # normal interpreter exit: finalizers may run
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        assert folder.is_dir(), "child deleted the parent's font folder"
        assert slip.render_pdf(slip.SAMPLE_SNAPSHOT).startswith(b"%PDF-")
        print("ok")
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, cwd=Path(slip.__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_company_name_ending_in_a_full_stop_gets_no_second_one():
    """"Contact the HR department of Sundarban Steel Mills Ltd.." on every slip of a company."""
    html = slip.render_html(snapshot(company__name="Sundarban Steel Mills Ltd."))
    assert "of Sundarban Steel Mills Ltd.</p>" in html
    assert "of Acme Garments.</p>" in slip.render_html(snapshot(company__name="Acme Garments"))


def _down(k: int) -> int:
    return 0 if k == 0 else _down(k - 1) + 1


def _back_and_forth(times: int) -> None:
    for _ in range(times):
        _down(400)  # ~35 KiB of frames: across at least two 16 KiB chunk edges and back


def _minor_faults(fn, *args) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn(*args)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_deep_recursion_runs_in_one_stack_chunk_of_its_own():
    """CPython 3.11 frees a 16 KiB chunk of its frame stack as soon as the frame that
    opened it returns, so a recursion going back and forth across a chunk's edge maps,
    touches and unmaps a fresh chunk at every crossing (a render did 60-490 of them,
    by the caller's depth). Inside on_a_stack_chunk_of_its_own the frames live in one
    1 MiB chunk: paged in once, not at every crossing."""
    code = slip.on_a_stack_chunk_of_its_own.__code__
    assert code.co_stacksize >= slip.STACK_PAD_SLOTS  # its frame alone takes over 512 KiB
    assert slip.on_a_stack_chunk_of_its_own(lambda a, b: a + b, 2, 3) == 5
    inside = min(_minor_faults(slip.on_a_stack_chunk_of_its_own, _back_and_forth, 300) for _ in range(3))
    assert inside < 100  # the chunk's touched pages, once (~9 pages), and some slack
    if sys.version_info[:2] == (3, 11):  # the behaviour it works around (3.11's frame stack)
        outside = min(_minor_faults(_back_and_forth, 300) for _ in range(3))
        assert outside > 5 * inside and outside > 600


def test_render_pdf_runs_on_a_stack_chunk_of_its_own(monkeypatch):
    seen = []
    real = slip.on_a_stack_chunk_of_its_own
    monkeypatch.setattr(slip, "on_a_stack_chunk_of_its_own", lambda fn, *a: seen.append(fn) or real(fn, *a))
    assert slip.render_pdf(slip.SAMPLE_SNAPSHOT).startswith(b"%PDF")
    assert slip.html_to_pdf("<p>x</p>").startswith(b"%PDF")
    assert [f.__name__ for f in seen] == ["_render_pdf", "_html_to_pdf"]


def test_a_glyph_the_bundled_fonts_lack_is_not_drawn_from_a_system_font():
    """Security review: fontconfig knew the system's fonts, so a Hebrew name embedded
    DejaVu from /usr/share/fonts: a file outside jobs/assets/ read inside a render."""
    pdf = slip.render_pdf(snapshot(employee__name_en="Ωμέγα עברית Привет 王"))
    (page,) = PdfReader(io.BytesIO(pdf)).pages
    fonts = {str(f.get_object()["/BaseFont"]).split("+", 1)[-1] for f in page["/Resources"]["/Font"].values()}
    assert fonts <= {"Slip-Sans", "Slip-Sans-Bold", "Slip-Bengali", "Slip-Bengali-Bold"}, fonts


def test_the_font_configuration_leaves_no_file_behind():
    """Its fonts.conf is read once at start and removed: a worker killed by signal (no
    exit handlers) left a folder in the temp directory at every start."""
    import glob
    import tempfile

    pattern = str(Path(tempfile.gettempdir()) / "payrun-fonts-*")
    before = set(glob.glob(pattern))
    slip._ProcessFontConfiguration()
    assert set(glob.glob(pattern)) == before


def test_a_fonts_conf_folder_of_a_process_killed_while_it_existed_is_swept(tmp_path):
    """The fonts.conf folder lives a few ms at a process's start; one killed then left it
    for good (an empty payrun-fonts-* folder, which the suite's leftover check counts)."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    left = tmp_path / f"{slip.FONT_CONF_PREFIX}{int(dead.stdout)}-abc"
    mine = tmp_path / f"{slip.FONT_CONF_PREFIX}{os.getpid()}-def"
    left.mkdir()
    mine.mkdir()
    assert slip.sweep_font_faces(str(tmp_path)) == [left]
    assert not left.exists() and mine.is_dir()


def test_a_killed_renderer_leaves_its_font_copies_only_until_the_next_start():
    """WeasyPrint copies the @font-face files (~1.4 MB) into a temporary folder and deletes
    it only from __del__: every worker killed by signal, and most that exited, left one
    (71 in /tmp after one test run). Ours is named by its pid and swept by the next
    process that starts a font configuration once that pid is gone; a clean exit removes
    its own."""
    import glob
    import signal
    import subprocess
    import sys
    import tempfile

    tmp = tempfile.gettempdir()
    weasy_before = set(glob.glob(str(Path(tmp) / "weasyprint-*")))
    code = ("import sys\nfrom jobs import slip\nslip.warm_up()\n"
            "print(slip._FONT_CONFIG._folder, flush=True)\n"
            "sys.stdin.read() if sys.argv[1] == 'wait' else None\n")
    root = str(Path(slip.__file__).resolve().parent.parent)
    killed = subprocess.Popen([sys.executable, "-c", code, "wait"], cwd=root, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    folder = Path(killed.stdout.readline().strip())
    assert folder.name.startswith(f"{slip.FONT_FACES_PREFIX}{killed.pid}-") and any(folder.iterdir())
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    assert folder.is_dir()  # nothing ran in it
    fresh = slip._ProcessFontConfiguration()  # the next worker's start
    assert not folder.exists()
    assert fresh._folder.is_dir() and fresh._folder.name.startswith(f"{slip.FONT_FACES_PREFIX}{os.getpid()}-")
    # a process that exits cleanly takes its own along
    done = subprocess.run([sys.executable, "-c", code, "exit"], cwd=root, capture_output=True, text=True,
                          timeout=120, check=True)
    assert not Path(done.stdout.strip()).exists()
    assert set(glob.glob(str(Path(tmp) / "weasyprint-*"))) == weasy_before  # WeasyPrint's own: none
    fresh._remove_folder()


def test_a_reminder_pdf_shows_bengali_and_wraps_its_lines():
    """HR walkthrough: the reminder's PDF used the PDF's built-in Helvetica, so a Bengali
    reminder printed as "????" and a long sentence ran off the page."""
    from jobs import oneoff

    text = ("অনুগ্রহ করে আপনার ব্যাংক হিসাবের তথ্য ৩০ তারিখের মধ্যে হালনাগাদ করুন। "
            + "Please update your bank details before the 30th so that your salary reaches you on time. " * 3
            + "\n<b>not bold</b> & done")
    pdf = oneoff.notice_pdf("বেতন — Reminder", text)
    assert oneoff.notice_pdf("বেতন — Reminder", text) is pdf  # a batch renders it once
    reader = PdfReader(io.BytesIO(pdf))
    (page,) = reader.pages
    got = page.extract_text()
    assert "?" not in got and "<b>not bold</b> & done" in got
    fonts = {str(f.get_object()["/BaseFont"]).split("+", 1)[-1] for f in page["/Resources"]["/Font"].values()}
    assert "Slip-Bengali" in fonts, fonts
    lines = [ln for ln in got.splitlines() if ln.strip()]
    assert len(lines) >= 5 and max(map(len, lines)) < 100, lines  # wrapped (it was one 300-character line)


# --------------------------------------------------------------------------- memory

_REFAULTS = """
import ctypes, resource, sys
from jobs import slip
if sys.argv[1] == "tuned":
    assert slip.tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
CHUNK, N = 64 * 1024, 256  # 16 MiB in blocks below glibc's default mmap threshold: from the heap

def fill():
    blocks = [libc.malloc(CHUNK) for _ in range(N)]
    for b in blocks:
        ctypes.memset(b, 1, CHUNK)  # (pages the kernel must back)
    for b in reversed(blocks):
        libc.free(b)

fill()  # a render's peak, then all of it freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fill()  # the next render
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or sys.maxsize <= 2**32,
                    reason="glibc's mallopt on a 64-bit system (32 MiB thresholds)")
def test_a_render_process_keeps_its_heap_between_renders():
    """slip.tune_malloc (called where a render worker warms up, before it forks its
    horse): glibc keeps what a render freed instead of giving it back to the kernel, so
    the next render does not fault the same pages in again (~300 faults and ~1 ms of
    kernel time a render, session 46). Here 16 MiB taken, touched and freed twice in a
    fresh process, the faults of the second pass counted (not time): given back, every
    page faults again (~4,096); kept, almost none."""
    def refaults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _REFAULTS, mode], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).resolve().parents[1], check=True)
        return int(out.stdout.split()[-1])

    kept, given_back = refaults("tuned"), refaults("default")
    assert given_back > 3_000 and kept < 300, (kept, given_back)
