"""Nothing a test does may land in the repository's ./var (payrun's default data
directory, PAYRUN_HOME unset): tests/conftest.py gives every test a temporary PAYRUN_HOME,
and this checks that it worked.

A test that ran payrun code with no PAYRUN_HOME wrote into the checkout's ./var: a send's
note `sends-unrecorded.jsonl` (jobs.unrecorded, from tests/test_mail.py), a slip store id
`slips/.payrun-store-id` (a render worker's start, payrun.slipstore). The next test run,
or a `payrun` command run from the checkout, then found them there.

Two checks, the same rule: after each test, the data directory and each entry directly
in it (one scandir, however many slips `payrun demo` left in var/demo): the test that
wrote there fails, naming what; at the end of the session, every file under it (a write
deep inside an existing folder, or by a process that outlived its test): the run fails,
as it does for leftovers in the temp directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def var_dirs(config: pytest.Config) -> list[Path]:
    """The ./var a test could write into: the repository's, and the one of the directory
    pytest was started from (the default resolves against the current directory)."""
    return sorted({Path(config.rootpath) / "var", Path(config.invocation_params.dir) / "var"})


def top_level(var: Path) -> dict[str, int]:
    """``var`` itself (".") and each entry directly in it, with its mtime in ns; {} when
    there is no ``var``. A file made or removed anywhere in a folder changes that folder's
    mtime."""
    try:
        out = {".": var.stat().st_mtime_ns}
    except FileNotFoundError:
        return {}
    with os.scandir(var) as entries:
        for e in entries:
            try:
                out[e.name] = e.stat(follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:
                continue
    return out


def changed(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The entries that appeared, went or changed between two ``top_level`` looks (pure)."""
    return sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))


def files_under(var: Path) -> set[str]:
    """Every file and folder under ``var``, relative to it."""
    found = set()
    for root, dirs, files in os.walk(var):
        for name in dirs + files:
            found.add(os.path.relpath(os.path.join(root, name), var))
    return found


def describe(var: Path, names: list[str]) -> str:
    """What a test made under ``var``: the changed entries, each folder's files listed."""
    shown = []
    for name in names:
        if name == ".":
            continue
        p = var / name
        if p.is_dir() and not p.is_symlink():
            inside = sorted(files_under(p))
            shown.append(f"{name}/" + (f" ({', '.join(inside[:5])}{' …' if len(inside) > 5 else ''})" if inside else ""))
        else:
            shown.append(name + ("" if p.exists() or p.is_symlink() else " (removed)"))
    return ", ".join(shown) or "(an entry made and removed again)"


@pytest.fixture(autouse=True)
def nothing_written_under_var(request):
    """Fails the test (at its teardown) that made, changed or removed anything directly
    in the repository's ./var. Autouse, and set up before the other fixtures: its check
    runs after their teardowns (a worker stopped there)."""
    dirs = var_dirs(request.config)
    before = {d: top_level(d) for d in dirs}
    yield
    for d in dirs:
        if names := changed(before[d], top_level(d)):
            pytest.fail(f"this test wrote into {d}: {describe(d, names)}: payrun code ran without the test's "
                        f"PAYRUN_HOME (tests/conftest.py sets one for every test; a test that removes it must "
                        f"chdir to a temporary directory), unless a payrun of this checkout wrote there meanwhile "
                        f"(`payrun up` or `payrun demo` run from it)", pytrace=False)


def session_start(config: pytest.Config) -> None:
    config._payrun_var_before = {d: files_under(d) for d in var_dirs(config)}


def session_new_files(config: pytest.Config) -> list[Path]:
    """Files under ./var that were not there when the session started."""
    before = getattr(config, "_payrun_var_before", None)
    if before is None:
        return []
    return [d / name for d in before for name in sorted(files_under(d) - before[d])]
