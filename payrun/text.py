"""Text that can change how other text looks: refused in payroll data, made visible in
text from outside (a mail server's reply) before it reaches a terminal.

Standard library only: worker-host code (jobs/) imports it too.
"""

from __future__ import annotations

import re
import unicodedata

LAYOUT_CONTROLS: dict[str, str] = {
    "\u2028": "line separator",
    "\u2029": "paragraph separator",
    "\u200e": "left-to-right mark",
    "\u200f": "right-to-left mark",
    "\u061c": "Arabic letter mark",
    "\u202a": "left-to-right embedding",
    "\u202b": "right-to-left embedding",
    "\u202c": "pop directional formatting",
    "\u202d": "left-to-right override",
    "\u202e": "right-to-left override",
    "\u2066": "left-to-right isolate",
    "\u2067": "right-to-left isolate",
    "\u2068": "first strong isolate",
    "\u2069": "pop directional isolate",
}
"""Characters that break a line or reorder the text around them (Unicode bidi controls):
a name holding one can read differently on the slip, in a terminal or in a log than it
is. A Bengali/English payroll needs none of them. The zero-width joiner and non-joiner
(U+200D, U+200C) are not here: Bengali script needs them (ক্‌ষ, র‍্যা)."""

_UNSAFE_RE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff" + "".join(LAYOUT_CONTROLS) + "]")
"""Control characters (C0, DEL, C1), lone surrogates and LAYOUT_CONTROLS."""


def text_problem(s: str) -> str | None:
    """Why a name or address cannot be taken as it is (the first such character), or None."""
    for ch in s:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            return "contains a control character"
        if ch in LAYOUT_CONTROLS:
            return (f"contains U+{ord(ch):04X} ({LAYOUT_CONTROLS[ch]}), which can change how the text "
                    "around it reads; remove it")
    return None


MESSAGE_MAX_CHARS = 5000
"""The longest reminder text `payrun remind --message` takes: a reminder is a few lines."""


def message_problem(s: str) -> str | None:
    """Why a text an operator typed for employees' emails (a reminder's message) cannot be
    sent as it is, or None: as a name, but line breaks and tabs are allowed."""
    if len(s) > MESSAGE_MAX_CHARS:
        return f"is {len(s):,} characters long; a reminder takes at most {MESSAGE_MAX_CHARS:,}"
    return text_problem(s.replace("\r\n", "").replace("\n", "").replace("\t", ""))


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with every control character (ESC, CR, BEL, C1 …), lone surrogate and
    LAYOUT_CONTROLS character written as an escape (``\\x1b``, ``\\u202e``): text from
    outside (a provider's error reply) shown to an operator cannot move the cursor, clear
    the screen, retitle the terminal or reorder what it prints."""
    return _UNSAFE_RE.sub(_escape, text) if _UNSAFE_RE.search(text) else text


def header_safe(secret: str) -> bool:
    """Whether a token or password can go in an HTTP header (or an AUTH line) as it is: one
    line of printable ASCII. http.client refuses any other, quoting the whole header (the
    token) in its error, which a failed send keeps as its error: in the ledger, `payrun
    failed` and the logs."""
    return secret.isascii() and secret.isprintable()
