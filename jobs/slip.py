"""Salary slip rendering: snapshot (see docs/ARCHITECTURE.md) -> HTML (Jinja2) -> PDF (WeasyPrint).

Public API (other modules call these names):
    totals(snapshot)        -> {"gross", "deductions", "net"} in integer poisha (pure)
    format_bdt(poisha)      -> "৳ 45,000.00" (lakh and crore grouping: "৳ 1,23,456.00")
    validate(snapshot)      raises PermanentError with a reason HR can act on
    render_html(snapshot)   -> str (autoescaped, StrictUndefined)
    render_pdf(snapshot)    -> bytes (validates first)
    html_to_pdf(html)       -> bytes through the same restricted fetcher and fonts
    write_slip(path, pdf)   atomic write, file 0600, created dirs 0700
    stage_slip / commit_slip  its two halves (written; then durable and in place), for a
                            process that finishes what another rendered (sync_folder:
                            one folder sync for several commits)
    warm_up()               render SAMPLE_SNAPSHOT, with and without a Bengali name, once
                            per process (before forking): both cascades kept (jobs.cascade)

Privacy: nothing here logs snapshots, amounts or names. Error messages name the field
that is wrong, never its value.

Isolation: the only resources WeasyPrint may load are files inside jobs/assets/
(`AssetsOnlyFetcher`); anything else (http(s), file:// elsewhere, data:, local() system
fonts) is refused and WeasyPrint logs and skips it. Fontconfig knows the bundled fonts
only (FONTS_CONF): no system font file is read for a glyph they lack.
"""

from __future__ import annotations

import atexit
import calendar
import mimetypes
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import unicodedata
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit
from xml.sax.saxutils import escape
from urllib.request import url2pathname

import jinja2
from weasyprint import CSS, HTML
from weasyprint.text.fonts import FontConfiguration
from weasyprint.urls import URLFetcher, URLFetcherResponse

from jobs import cascade
from jobs.errors import PermanentError
from jobs.policy import DAY_RE, final_day
from payrun.procs import pid_alive

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
ASSETS_DIR = (PACKAGE_DIR / "assets").resolve()
ASSETS_BASE_URL = ASSETS_DIR.as_uri() + "/"
TEMPLATE_NAME = "slip.html"

# Display order and labels of the pay components. The snapshot must contain exactly these.
EARNINGS: tuple[tuple[str, str], ...] = (
    ("basic", "Basic salary"),
    ("house_rent", "House rent allowance"),
    ("medical", "Medical allowance"),
    ("conveyance", "Conveyance allowance"),
    ("bonus", "Bonus"),
)
DEDUCTIONS: tuple[tuple[str, str], ...] = (
    ("tax", "Income tax (TDS)"),
    ("provident_fund", "Provident fund"),
    ("loan", "Loan repayment"),
)

# Required text fields and their maximum lengths (longer values would not fit one page).
# All of them at their maximum at once overflow the normal layout; the render then uses
# slip-compact.css, which fits them (tests/test_slip.py).
COMPANY_FIELDS = {"name": 80, "address": 160}
EMPLOYEE_FIELDS = {"id": 32, "name_en": 80, "email": 254, "department": 60,
                   "designation": 80, "bank_account": 32}
NAME_BN_MAX = 80
KEY_MAX = 200
# 10^12 poisha = 10 billion taka per component: anything above is a data error.
MAX_AMOUNT = 10**12

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")
_MONTH_RE = re.compile(r"(\d{4})-(\d{2})")
_EMAIL_RE = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")

SAMPLE_SNAPSHOT: dict[str, Any] = {
    "month": "2026-11",
    "key": "slip:2026-11:emp-00017",
    "company": {"id": 3, "name": "Meghna Textiles Ltd",
                "address": "House 12, Road 4, Dhanmondi, Dhaka 1205"},
    "employee": {
        "id": "emp-00017", "name_en": "Tanvir Ahmed", "name_bn": "তানভীর আহমেদ",
        "email": "tanvir.ahmed@meghna.example", "department": "Finance",
        "designation": "Senior Accountant", "bank_account": "•••• 4821",
    },
    "earnings": {"basic": 4500000, "house_rent": 2250000, "medical": 300000,
                 "conveyance": 250000, "bonus": 0},
    "deductions": {"tax": 350000, "provident_fund": 450000, "loan": 0},
}


# --------------------------------------------------------------------------- pure helpers

def totals(snapshot: Mapping[str, Any]) -> dict[str, int]:
    """Gross, total deductions and net pay in integer poisha. Pure; sums the known components."""
    earnings = snapshot["earnings"]
    deductions = snapshot["deductions"]
    gross = sum(int(earnings[k]) for k, _ in EARNINGS)
    deducted = sum(int(deductions[k]) for k, _ in DEDUCTIONS)
    return {"gross": gross, "deductions": deducted, "net": gross - deducted}


def group_lakh(taka: int) -> str:
    """Digits grouped as Bangladesh writes amounts (lakh and crore): the last three, then
    pairs: 12345678 -> "1,23,45,678"; 45000 -> "45,000" (the same as Western below a lakh)."""
    digits = str(taka)
    if len(digits) <= 3:
        return digits
    head, tail = digits[:-3], digits[-3:]
    pairs = []
    while len(head) > 2:
        head, pair = head[:-2], head[-2:]
        pairs.append(pair)
    return ",".join([head, *reversed(pairs), tail])


def format_amount(poisha: int) -> str:
    """4500000 -> "45,000.00"; 12345678900 -> "12,34,56,789.00" (lakh and crore grouping,
    as the source story and Bangladeshi slips write them); no currency sign; a minus sign
    when negative."""
    sign = "-" if poisha < 0 else ""
    taka, paisa = divmod(abs(int(poisha)), 100)
    return f"{sign}{group_lakh(taka)}.{paisa:02d}"


def format_bdt(poisha: int) -> str:
    """4500000 -> "৳ 45,000.00"; -150 -> "-৳ 1.50"."""
    amount = format_amount(poisha)
    if amount.startswith("-"):
        return "-৳ " + amount[1:]
    return "৳ " + amount


_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
         "fourteen fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**7, "crore"), (10**5, "lakh"), (1000, "thousand"))
"""Bangladesh's scales, as its cheques and slips word an amount: "One crore twenty lakh
taka only". Above 99 crore the crores are counted in words ("two thousand crore")."""


def _words(n: int) -> str:
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{_ONES[hundreds]} hundred" + (f" {_words(rest)}" if rest else "")
    for scale, name in _SCALES:
        if n >= scale:
            high, rest = divmod(n, scale)
            return f"{_words(high)} {name}" + (f" {_words(rest)}" if rest else "")
    raise AssertionError(n)  # pragma: no cover


def amount_in_words(poisha: int) -> str:
    """4512345 -> "Forty-five thousand one hundred twenty-three taka and forty-five poisha only"."""
    taka, paisa = divmod(abs(int(poisha)), 100)
    text = f"{_words(taka)} taka"
    if paisa:
        text += f" and {_words(paisa)} poisha"
    text = ("minus " if poisha < 0 else "") + text + " only"
    return text[0].upper() + text[1:]


def month_label(month: str) -> str:
    """"2026-11" -> "November 2026" (English names, independent of the process locale)."""
    year, mon = _parse_month(month)
    return f"{_MONTHS[mon - 1]} {year}"


def pay_period(month: str, final: str | None = None) -> str:
    """"2026-11" -> "1 – 30 November 2026"; a leaver's final slip (``final``, the day they
    left, a date of the month: ``_final``) ends on that day: "1 – 20 November 2026"."""
    year, mon = _parse_month(month)
    last = int(final[8:10]) if final else calendar.monthrange(year, mon)[1]
    return f"1 {_MONTHS[mon - 1]} {year}" if last == 1 else f"1 – {last} {_MONTHS[mon - 1]} {year}"


def _parse_month(month: str) -> tuple[int, int]:
    match = _MONTH_RE.fullmatch(month) if isinstance(month, str) else None
    if not match or not 1 <= int(match[2]) <= 12 or int(match[1]) < 1900:
        raise PermanentError(f"snapshot field 'month' must look like 2026-11, got {month!r}")
    return int(match[1]), int(match[2])


# --------------------------------------------------------------------------- validation

def validate(snapshot: Any) -> None:
    """Raise PermanentError naming the first problem HR must fix. Never echoes amounts."""
    if not isinstance(snapshot, Mapping):
        raise PermanentError("slip snapshot is not a JSON object")
    who = _who(snapshot)
    _parse_month(snapshot.get("month"))
    key = snapshot.get("key")
    if not isinstance(key, str) or not key.strip() or len(key) > KEY_MAX:
        raise PermanentError(f"{who}: snapshot field 'key' (idempotency key) is missing "
                             f"or longer than {KEY_MAX} characters")

    company = snapshot.get("company")
    if not isinstance(company, Mapping):
        raise PermanentError(f"{who}: company details are missing from the payroll data")
    for field, max_len in COMPANY_FIELDS.items():
        _require_text(company, field, f"company {field}", max_len, who)

    employee = snapshot.get("employee")
    if not isinstance(employee, Mapping):
        raise PermanentError(f"{who}: employee details are missing from the payroll data")
    labels = {"name_en": "name (name_en)", "id": "ID"}
    for field, max_len in EMPLOYEE_FIELDS.items():
        label = "employee " + labels.get(field, field.replace("_", " "))
        _require_text(employee, field, label, max_len, who)
    name_bn = employee.get("name_bn", "")
    if not isinstance(name_bn, str) or len(name_bn) > NAME_BN_MAX:
        raise PermanentError(f"{who}: employee Bengali name (name_bn) must be text of at "
                             f"most {NAME_BN_MAX} characters (may be empty)")
    _refuse_controls(name_bn, "employee Bengali name (name_bn)", who)
    if not _EMAIL_RE.fullmatch(employee["email"].strip()):
        raise PermanentError(f"{who}: employee email address is not valid; "
                             "correct it in the payroll data")

    for section, components in (("earnings", EARNINGS), ("deductions", DEDUCTIONS)):
        amounts = snapshot.get(section)
        if not isinstance(amounts, Mapping):
            raise PermanentError(f"{who}: the {section} section is missing from the payroll data")
        known = {k for k, _ in components}
        unknown = sorted(set(amounts) - known)
        if unknown:
            raise PermanentError(
                f"{who}: unknown {section} component(s) {', '.join(map(repr, unknown))}; "
                f"the slip knows {', '.join(sorted(known))}")
        for field, label in components:
            if field not in amounts:
                raise PermanentError(f"{who}: {section} '{label}' ({field}) is missing; "
                                     "enter 0 if it does not apply")
            value = amounts[field]
            if isinstance(value, bool) or not isinstance(value, int):
                raise PermanentError(
                    f"{who}: {section} '{label}' ({field}) must be a whole number of poisha, "
                    f"got a {type(value).__name__}")
            if value < 0:
                raise PermanentError(f"{who}: {section} '{label}' ({field}) is negative; "
                                     "amounts must be zero or more")
            if value > MAX_AMOUNT:
                raise PermanentError(f"{who}: {section} '{label}' ({field}) is implausibly "
                                     "large; check the payroll data")


def _who(snapshot: Mapping[str, Any]) -> str:
    employee = snapshot.get("employee")
    emp_id = employee.get("id") if isinstance(employee, Mapping) else None
    month = snapshot.get("month")
    parts = [f"employee {emp_id}" if isinstance(emp_id, str) and emp_id else "employee (no id)"]
    if isinstance(month, str):
        parts.append(f"month {month}")
    return "salary slip for " + ", ".join(parts)


def _require_text(section: Mapping[str, Any], field: str, label: str, max_len: int,
                  who: str) -> None:
    value = section.get(field)
    if not isinstance(value, str) or not value.strip():
        raise PermanentError(f"{who}: {label} is missing; add it in the payroll data")
    if len(value) > max_len:
        raise PermanentError(f"{who}: {label} is longer than {max_len} characters; "
                             "shorten it in the payroll data")
    _refuse_controls(value, label, who)


def _refuse_controls(value: str, label: str, who: str) -> None:
    """A control character prints as nothing (the HTML parser drops NUL): a name made of
    one would leave a blank on the slip. The import refuses them too (payrun.payroll)."""
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
        raise PermanentError(f"{who}: {label} contains a control character; "
                             "correct it in the payroll data")


# --------------------------------------------------------------------------- fetcher

class ResourceRefused(ValueError):
    """The slip renderer refused to load a resource outside jobs/assets/."""


class AssetsOnlyFetcher(URLFetcher):
    """WeasyPrint URL fetcher that serves only regular files inside jobs/assets/.

    Everything else raises ResourceRefused; WeasyPrint (fail_on_errors=False) logs a
    warning and skips the resource. No network, no other file access.
    """

    def __init__(self, root: Path = ASSETS_DIR):
        super().__init__(allowed_protocols=("file",), allow_redirects=False)
        self.root = Path(root).resolve()

    def fetch(self, url: str, headers: Any = None) -> URLFetcherResponse:
        path = self.resolve(url)
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return URLFetcherResponse(path.as_uri(), path.read_bytes(),
                                  {"Content-Type": content_type})

    def resolve(self, url: str) -> Path:
        """The asset file `url` points at, or raise ResourceRefused."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost"):
            raise ResourceRefused(f"slip renderer loads only bundled assets, refused {url[:200]!r}")
        path = Path(url2pathname(unquote(parts.path))).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            raise ResourceRefused(f"slip renderer loads only bundled assets, refused {url[:200]!r}")
        return path


# --------------------------------------------------------------------------- rendering

FONTS_CONF = """<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">
<fontconfig>
  <dir>{fonts}</dir>
</fontconfig>
"""


class _ProcessFontConfiguration(FontConfiguration):
    """FontConfiguration shared by every render in a process.

    WeasyPrint's __del__ deletes the temporary folder holding the @font-face copies; a
    forked worker child inherits this object, so only the creating process may delete it.
    """

    def __init__(self) -> None:
        self._owner_pid = os.getpid()
        # Fontconfig's configuration lists our bundled fonts only: with the system's, a
        # glyph the Noto fonts lack (a Hebrew or Cyrillic name) was drawn from a system
        # font file (DejaVu from /usr/share/fonts), a file outside jobs/assets/ read inside
        # a render. Now such a glyph prints as an empty box. FONTCONFIG_FILE is read by
        # FcInitLoadConfigAndFonts (WeasyPrint's __init__), so it is set around that only.
        conf_dir = Path(tempfile.mkdtemp(prefix=f"{FONT_CONF_PREFIX}{self._owner_pid}-"))  # 0700
        # (named by pid: one killed in the few ms it exists is swept as the copies below are)
        conf = conf_dir / "fonts.conf"
        conf.write_text(FONTS_CONF.format(fonts=escape(str(ASSETS_DIR / "fonts"))), encoding="utf-8")
        saved = os.environ.get("FONTCONFIG_FILE")
        os.environ["FONTCONFIG_FILE"] = str(conf)
        try:
            super().__init__()
        finally:
            if saved is None:
                os.environ.pop("FONTCONFIG_FILE", None)
            else:
                os.environ["FONTCONFIG_FILE"] = saved
            # read and the fonts scanned: gone at once, so a killed process leaves nothing
            shutil.rmtree(conf_dir, ignore_errors=True)

        # WeasyPrint copies each @font-face file into a temporary folder of its own, on
        # the first render, and deletes it only in __del__: never for a worker killed by
        # signal, and not reliably at interpreter exit (71 folders of ~1.4 MB in /tmp after
        # one test run; /tmp is often RAM). Ours is named by this process's pid, deleted at
        # exit, and swept by the next process to start once that pid is gone.
        sweep_font_faces()
        self._folder = Path(tempfile.mkdtemp(prefix=f"{FONT_FACES_PREFIX}{self._owner_pid}-"))  # 0700
        atexit.register(self._remove_folder)

    def _remove_folder(self) -> None:
        if getattr(self, "_owner_pid", None) == os.getpid() and self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)

    def __del__(self) -> None:
        if getattr(self, "_owner_pid", None) == os.getpid():
            super().__del__()


FONT_FACES_PREFIX = "payrun-fontfaces-"
FONT_CONF_PREFIX = "payrun-fonts-"
"""The folder of a process's fonts.conf, removed as soon as fontconfig has read it."""
"""Temporary folders of the @font-face copies: ``payrun-fontfaces-<pid>-<random>``."""


def sweep_font_faces(tmp: str | None = None) -> list[Path]:
    """Delete the @font-face and fonts.conf folders (ours: this user's) of processes that
    are gone, e.g. a worker killed by SIGKILL. Returns what it deleted."""
    gone = []
    folders = [(prefix, path) for prefix in (FONT_FACES_PREFIX, FONT_CONF_PREFIX)
               for path in Path(tmp or tempfile.gettempdir()).glob(f"{prefix}*")]
    for prefix, path in folders:
        try:
            pid = int(path.name[len(prefix):].split("-", 1)[0])
            st = os.lstat(path)
        except (ValueError, OSError):
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or pid_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


_ENV: jinja2.Environment | None = None
_FONT_CONFIG: _ProcessFontConfiguration | None = None
_FETCHER: AssetsOnlyFetcher | None = None
_STYLESHEET: CSS | None = None
_COMPACT_STYLESHEET: CSS | None = None
_WARM_PID: int | None = None


def _env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            auto_reload=False,
        )
        env.filters["amount"] = format_amount
        env.filters["bdt"] = format_bdt
        _ENV = env
    return _ENV


def _renderer() -> tuple[_ProcessFontConfiguration, AssetsOnlyFetcher]:
    global _FONT_CONFIG, _FETCHER
    if _FONT_CONFIG is None:
        _FONT_CONFIG = _ProcessFontConfiguration()
    if _FETCHER is None:
        _FETCHER = AssetsOnlyFetcher()
    return _FONT_CONFIG, _FETCHER




def _reissued(snapshot: Mapping[str, Any]) -> str | None:
    """A resend's date (``reissued``, YYYY-MM-DD, set by `payrun resend`): the slip says it
    replaces any earlier one of its month (a corrected slip looked the same as the wrong
    one). Anything else there is ignored."""
    value = snapshot.get("reissued")
    return value if isinstance(value, str) and DAY_RE.fullmatch(value) else None


def _reissue(snapshot: Mapping[str, Any]) -> tuple[str | None, str | None, bool]:
    """(reissued, replaces, corrected) as the slip prints them (jobs.policy.reissue_marks):
    a date where a date belongs, else nothing; ``corrected`` only with both dates (it names
    the slip it replaces)."""
    reissued = _reissued(snapshot)
    value = snapshot.get("replaces") if reissued else None
    replaces = value if isinstance(value, str) and DAY_RE.fullmatch(value) else None
    return reissued, replaces, bool(replaces and snapshot.get("corrected") is True)


def _final(snapshot: Mapping[str, Any]) -> str | None:
    """The day a leaver left, on their slip of the month they left in (``final``, set by
    payrun.payroll's snapshot): the slip says it is their final one. A date of that month,
    else nothing."""
    return final_day(snapshot.get("month"), snapshot.get("final"))


def render_html(snapshot: Mapping[str, Any]) -> str:
    """The slip as a complete HTML document (CSS inlined; fonts relative to jobs/assets/)."""
    t = totals(snapshot)
    earnings = [(label, snapshot["earnings"][k]) for k, label in EARNINGS]
    deductions = [(label, snapshot["deductions"][k]) for k, label in DEDUCTIONS]
    reissued, replaces, corrected = _reissue(snapshot)
    rows = max(len(earnings), len(deductions))
    earnings += [None] * (rows - len(earnings))
    deductions += [None] * (rows - len(deductions))
    try:
        return _env().get_template(TEMPLATE_NAME).render(
            snapshot=snapshot,
            company=snapshot["company"],
            employee=snapshot["employee"],
            month=month_label(snapshot["month"]),
            period=pay_period(snapshot["month"], _final(snapshot)),
            rows=list(zip(earnings, deductions)),
            totals=t,
            net_words=amount_in_words(t["net"]),
            key=snapshot["key"],
            reissued=reissued,
            replaces=replaces,
            corrected=corrected,
            final=_final(snapshot),
        )
    except jinja2.TemplateError as exc:
        # Message only: Jinja's messages name the template variable, not its value.
        raise PermanentError(f"slip template error: {type(exc).__name__}: {exc}") from None


def _stylesheet() -> CSS:
    """slip.css, parsed and its selectors compiled once per process (a forked job child
    inherits it): re-parsing it was about a fifth of every render."""
    global _STYLESHEET
    if _STYLESHEET is None:
        font_config, fetcher = _renderer()
        _STYLESHEET = CSS(string=(TEMPLATES_DIR / "slip.css").read_text(encoding="utf-8"),
                          base_url=ASSETS_BASE_URL, url_fetcher=fetcher, font_config=font_config)
    return _STYLESHEET


def _compact_stylesheet() -> CSS:
    """slip-compact.css (smaller type, tighter spacing), laid over slip.css for a slip whose
    data overflows one page at the normal size; parsed on first use only."""
    global _COMPACT_STYLESHEET
    if _COMPACT_STYLESHEET is None:
        font_config, fetcher = _renderer()
        _COMPACT_STYLESHEET = CSS(
            string=(TEMPLATES_DIR / "slip-compact.css").read_text(encoding="utf-8"),
            base_url=ASSETS_BASE_URL, url_fetcher=fetcher, font_config=font_config)
    return _COMPACT_STYLESHEET


def _document(html: str, *, reuse_cascade: bool = False, compact: bool = False) -> Any:
    """Lay `html` out. With reuse_cascade, the styles computed for an earlier document of
    the same shape are reused (jobs.cascade: same PDF, about a third less time); only for
    our own slip template, whose shape is one of two. ``compact`` adds slip-compact.css
    (always the ordinary render: it is the rare path)."""
    font_config, fetcher = _renderer()
    parsed = HTML(string=html, base_url=ASSETS_BASE_URL, url_fetcher=fetcher)
    if compact:
        return parsed.render(stylesheets=[_stylesheet(), _compact_stylesheet()],
                             font_config=font_config)
    if reuse_cascade:
        return cascade.render(parsed, [_stylesheet()], font_config)
    return parsed.render(stylesheets=[_stylesheet()], font_config=font_config)


_RENDER_LOCK = threading.RLock()
"""One render at a time per process. The font configuration and stylesheet are shared, and
fontconfig/WeasyPrint are not safe to drive from several threads at once (two threads
building the stylesheet together crashed the process). Render workers fork one job at a
time, so this lock is never contended there."""


def on_a_stack_chunk_of_its_own(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, with every Python frame it stacks inside one big chunk of CPython's
    frame stack (see STACK_PAD_SLOTS).

    CPython 3.11 keeps Python frames on a data stack of 16 KiB chunks, and frees a chunk
    as soon as the frame that opened it returns. A deep recursion that keeps going back
    and forth across a chunk's edge (WeasyPrint's layout does) maps and unmaps a 16 KiB
    chunk at every crossing: 60 to 490 times per slip here, depending only on how deep
    the caller's stack happens to be (a render worker's horse, under RQ: ~490), each a
    mmap, a munmap and the page faults between, all in the kernel: ~1 ms of a 28 ms
    render at the lone render's depth, ~3 ms at the horse's (bench/README.md). A frame
    too big for the chunk in hand gets a chunk of its own, sized in doublings of 16 KiB
    until it fits: this function's frame is padded (``co_stacksize``: value-stack slots
    that are never touched, so never paged in) to open a 1 MiB chunk, and the ~500 KiB
    left in it holds the render's frames. One mmap per call instead of hundreds."""
    return fn(*args)


STACK_PAD_SLOTS = 65_536
"""Extra value-stack slots in on_a_stack_chunk_of_its_own's frame: 512 KiB, so its chunk
is 1 MiB (the frame plus CPython's 1,000-slot margin no longer fits 512 KiB)."""

on_a_stack_chunk_of_its_own.__code__ = on_a_stack_chunk_of_its_own.__code__.replace(
    co_stacksize=on_a_stack_chunk_of_its_own.__code__.co_stacksize + STACK_PAD_SLOTS)


def html_to_pdf(html: str) -> bytes:
    """Any HTML -> PDF through the slip fonts and the assets-only fetcher."""
    return on_a_stack_chunk_of_its_own(_html_to_pdf, html)


def _html_to_pdf(html: str) -> bytes:
    with _RENDER_LOCK:
        return _document(html).write_pdf()


def render_pdf(snapshot: Mapping[str, Any]) -> bytes:
    """Validate the snapshot, then render the one-page A4 slip to PDF bytes."""
    return on_a_stack_chunk_of_its_own(_render_pdf, snapshot)


def _render_pdf(snapshot: Mapping[str, Any]) -> bytes:
    validate(snapshot)
    html = render_html(snapshot)
    with _RENDER_LOCK:
        document = _document(html, reuse_cascade=True)
        if len(document.pages) != 1:
            # Every field near its maximum length at once (validate() caps each one, not
            # their sum): the same slip in smaller type rather than no slip on the night.
            document = _document(html, compact=True)
        if len(document.pages) != 1:
            raise PermanentError(f"{_who(snapshot)}: the slip does not fit on one page; "
                                 "shorten the longest names or addresses in the payroll data")
        return document.write_pdf()


RENDER_GC_THRESHOLDS = (20_000, 10, 10)
"""Python's collector thresholds in a render process. A render builds a box tree of tens
of thousands of objects that all live until it ends; with the default young-generation
threshold (700 allocations) the collector runs dozens of times per render, each pass
walking objects that cannot be garbage yet, and promotes the tree so that a full
collection follows every ~10 renders. 20,000 makes it a few passes: 7-10% less CPU per
render, measured by alternating both settings render by render in one process
(bench/README.md); a few MB more memory between collections."""


def tune_gc() -> None:
    """Set RENDER_GC_THRESHOLDS: in every process that renders (the render worker, and
    the benchmarks timing a warm render as the worker does it)."""
    import gc

    gc.set_threshold(*RENDER_GC_THRESHOLDS)


RENDER_MALLOC_THRESHOLD = 32 * 1024 * 1024
"""glibc malloc's mmap and trim thresholds in a render process (``mallopt``). By default
glibc gives a render's larger blocks (the PDF's buffers, cairo's and HarfBuzz's tables)
back to the kernel as soon as they are freed, and the next render faults the same pages
in again, zero-filled: ~300 page faults and ~1 ms of kernel time per ~35 ms render,
measured (bench/README.md, session 46). With both thresholds at 32 MiB the process keeps
that memory between renders: ~25 faults per render. The cost is that a horse holds its
peak heap until it is replaced (``render.jobs_per_horse``)."""


def tune_malloc() -> bool:
    """Set RENDER_MALLOC_THRESHOLD as glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, in
    every process that renders (the render worker before it forks its horses, and the
    benchmarks timing a warm render as the worker does it). Returns whether glibc took
    both (False on a C library without ``mallopt``, or one that refuses a value: its
    defaults stay for what it refused, nothing else changes)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = [mallopt(option, RENDER_MALLOC_THRESHOLD) for option in (m_mmap_threshold, m_trim_threshold)]
    return all(took)


def harfbuzz_subsetting() -> dict[str, Any]:
    """Whether WeasyPrint subsets fonts with HarfBuzz: weasyprint/pdf/fonts.py Font.subset()
    uses it when weasyprint.text.ffi.harfbuzz_subset (dlopen of libharfbuzz-subset.so.0,
    allow_fail=True) loaded and harfbuzz.hb_version_atleast(4, 1, 0); else fontTools, several
    times slower per slip (bench/render.py prints both). ``harfbuzz_subset`` is the answer."""
    from weasyprint.pdf import fonts as wp_fonts
    from weasyprint.text import ffi as wp_ffi

    loaded = wp_ffi.harfbuzz_subset is not None
    recent = bool(wp_ffi.harfbuzz.hb_version_atleast(4, 1, 0))
    path = None
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libharfbuzz-subset" in line:
                path = line.split()[-1]
                break
    except OSError:
        pass
    return {"harfbuzz_subset": bool(loaded and recent and wp_fonts.harfbuzz_subset is not None),
            "libharfbuzz_subset_loaded": loaded, "harfbuzz_ge_4_1": recent, "library": path}


def warm_up() -> None:
    """Load template, fonts and WeasyPrint by rendering SAMPLE_SNAPSHOT (once per process),
    with and without a Bengali name: the slip's two shapes, so both cascades are kept
    (jobs.cascade) before the worker parent forks its job children.
    """
    global _WARM_PID
    if _WARM_PID == os.getpid():
        return
    render_pdf(SAMPLE_SNAPSHOT)
    render_pdf({**SAMPLE_SNAPSHOT,
                "employee": {**SAMPLE_SNAPSHOT["employee"], "name_bn": ""}})
    _WARM_PID = os.getpid()


# --------------------------------------------------------------------------- storage

def write_slip(path: Path, pdf: bytes, store: Path | None = None) -> None:
    """Write `pdf` to `path` atomically and durably: file mode 0600, parent dirs it creates
    0700; on disk (data and name) when it returns."""
    commit_slip(stage_slip(path, pdf, durable=True, store=store), path, synced=True)


def stage_name(slip_name: str, host: str, pid: int, nonce: str) -> str:
    """The name of a slip staged beside ``slip_name`` by process ``pid`` of ``host`` (its
    payrun.procs.host_id: 8 hex characters): ``.<slip>.<host>-<pid>.<nonce>.tmp``. The
    host says whose pid it is: the slip store is shared by hosts (remove_dead_stages).
    Until session 42 it was ``.<slip>.<pid>.<nonce>.tmp``. Pure."""
    return f".{slip_name}.{host}-{pid}.{nonce}.tmp"


_STAGED_BY = re.compile(r"([0-9a-f]{8})-([0-9]{1,10})")


def staged_by(stage: str, slip_name: str) -> tuple[str | None, int] | None:
    """Who staged the file named ``stage`` beside ``slip_name``: ``(host, pid)``; ``(None,
    pid)`` for a stage named before hosts were (``.<slip>.<pid>.<nonce>.tmp``); None when
    it is no stage of that slip. Pure."""
    prefix = f".{slip_name}."
    if not (stage.startswith(prefix) and stage.endswith(".tmp")):
        return None
    who = stage[len(prefix):].split(".", 1)[0]
    if who.isdigit():
        return None, int(who)
    if match := _STAGED_BY.fullmatch(who):
        return match[1], int(match[2])
    return None


def stage_slip(path: Path, pdf: bytes, durable: bool = False, store: Path | None = None,
               host: str | None = None) -> Path:
    """The first half of write_slip: `pdf` in a new temporary file (mode 0600) beside
    `path`, which is not touched yet, named for this process and ``host`` (stage_name;
    default this host's id). ``durable`` syncs the data before it returns;
    otherwise commit_slip does. Returns the temporary file's path. With ``store`` (the slip
    store's root, `path` inside it) every folder from it down must be this account's alone,
    or StoreUnsafe is raised before anything is written (payrun.slipstore.unsafe)."""
    from payrun.procs import host_id

    path = Path(path)

    def check() -> None:
        if store is not None:
            from jobs.errors import StoreUnsafe
            from payrun import slipstore

            if why := slipstore.unsafe(store, path):
                raise StoreUnsafe(why)

    check()  # before a folder is made in one that is not ours alone
    parent = path.parent
    missing = []
    probe = parent
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue  # created concurrently by another worker: leave its mode alone
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
        sync_folder(directory.parent)  # the new folder's own entry durable (once per new month or company)
    if missing:
        check()  # (one another process made meanwhile, too)

    tmp = parent / stage_name(path.name, host or host_id(), os.getpid(), secrets.token_hex(4))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, pdf)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (a short write on a nearly full disk: the rest, or
    OSError ENOSPC). Its own function: the tests inject a full disk here."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def free_bytes(path: Path) -> int | None:
    """Room left for this account on ``path``'s file system (statvfs), None if it cannot be
    told (the path gone, a failing mount)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def remove_dead_stages(path: Path, host: str | None = None, lease: tuple[float, float] | None = None,
                       now: float | None = None) -> list[Path]:
    """Remove the files stage_slip left beside `path` for a process that is gone: a render
    worker killed (`kill -9`) between its horse's stage and its own commit left a copy of
    the slip (`.<slip>.<host>-<pid>.<hex>.tmp`) for good (on-call drill, session 41).

    Only a stage of this host (``host``, default payrun.procs.host_id()) is judged by its
    pid: one of a live process (another render of this slip under way) stays; so does one
    of a pid reused since. The slip store is shared: another host's pid says nothing here,
    and its stage (a try still finishing there, whose job's lease ran out and was handed
    here) is removed only once abandoned: older, by its mtime against ``now`` (default
    the clock), than its render's timeout and lease (``lease``: ``(render timeout_s,
    visibility_s)``; jobs.policy.stage_abandoned); never without ``lease``.
    A stage named before hosts were (`.<slip>.<pid>.<hex>.tmp`) is judged by its pid here,
    as it was. Scans the slip's folder: call it for a slip's later tries only. Returns
    what it removed."""
    import time

    from jobs.policy import stage_abandoned
    from payrun.procs import host_id, pid_alive

    path = Path(path)
    here = host or host_id()
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return []
    for e in entries:
        who = staged_by(e.name, path.name)
        if who is None:
            continue
        by, pid = who
        if by is None or by == here:
            gone = not pid_alive(pid)
        elif lease is None:
            continue
        else:
            try:
                age = (time.time() if now is None else now) - e.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue  # committed meanwhile
            gone = stage_abandoned(age, *lease)
        if gone:
            _unlink_quietly(Path(e.path))
            removed.append(Path(e.path))
    return removed


def commit_slip(tmp: Path, path: Path, synced: bool = False, folder: bool = True) -> None:
    """The second half of write_slip: the staged file's data made durable (unless
    ``synced``: stage_slip did), then renamed over `path`, then the rename made durable
    (the folder synced; ``folder`` False: the caller syncs it, once for several slips,
    with sync_folder, before it counts on them). Any process may do it (the render worker
    does it for its horse: jobs.runtime.RenderWorker). A failure removes the staged file."""
    tmp, path = Path(tmp), Path(path)
    try:
        if not synced:
            fd = os.open(tmp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if folder:
        sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Make the renames into ``folder`` durable (fsync of the folder)."""
    dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
