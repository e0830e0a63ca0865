"""Tests leave the checkout as they found it: every test has a PAYRUN_HOME of its own
(tests/conftest.py), and a test that writes into the checkout's ./var fails
(tests/repo_guard.py). A run left var/sends-unrecorded.jsonl and
var/slips/.payrun-store-id in the checkout, found there by the next run and by any
`payrun` command run from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import repo_guard

REPO = Path(__file__).resolve().parent.parent


def test_every_test_runs_with_an_empty_payrun_home_of_its_own(tmp_path, request):
    from jobs import tasks
    from payrun import config as config_mod

    home = Path(os.environ["PAYRUN_HOME"])
    assert home.is_dir() and list(home.iterdir()) == []
    assert not home.is_relative_to(request.config.rootpath) and not home.is_relative_to(tmp_path)
    assert "PAYRUN_SLIPS_DIR" not in os.environ
    cfg = config_mod.load()
    assert cfg.home == home and cfg.slips_dir == home / "slips"
    assert tasks.settings().home == home  # (loaded again for this test: not an earlier test's home)


def test_a_send_noted_by_a_test_without_cfg_lands_in_its_own_home(conn):
    """tests/test_mail.py's forced-stop test records through jobs.tasks with the session
    Redis alone (no ``cfg``): the note of the delivery Redis could not record went to
    ./var/sends-unrecorded.jsonl of the checkout (or was lost, with no ./var)."""
    from jobs import tasks, unrecorded

    said = tasks._note_unrecorded("slip:2026-11:emp-00031", "<m3@payrun>")
    assert "noted on this host" in said
    home = Path(os.environ["PAYRUN_HOME"])
    assert unrecorded.find(home, "slip:2026-11:emp-00031") == "<m3@payrun>"


def test_what_the_guard_compares(tmp_path):
    var = tmp_path / "var"
    assert repo_guard.top_level(var) == {}
    var.mkdir()
    (var / "demo").mkdir()
    before = repo_guard.top_level(var)
    assert set(before) == {".", "demo"}
    (var / "demo" / "slips").mkdir()  # (the folder's mtime moves)
    (var / "sends-unrecorded.jsonl").write_text("{}\n")
    after = repo_guard.top_level(var)
    assert repo_guard.changed(before, after) == [".", "demo", "sends-unrecorded.jsonl"]
    assert repo_guard.changed(after, after) == []
    assert repo_guard.describe(var, ["demo", "sends-unrecorded.jsonl"]) == "demo/ (slips), sends-unrecorded.jsonl"
    assert repo_guard.files_under(var) == {"demo", "demo/slips", "sends-unrecorded.jsonl"}


INNER_TESTS = '''
from pathlib import Path


def test_writes_into_var():
    Path("var").mkdir(exist_ok=True)
    Path("var/leak.txt").write_text("x")


def test_payrun_code_with_no_home_of_its_own():
    from jobs import tasks

    tasks._note_unrecorded("slip:2026-11:emp-00031", "<m3@payrun>")
    assert (tasks.settings().home / "sends-unrecorded.jsonl").exists()


def test_writes_deep_into_a_folder_already_there():
    Path("var/deep/a/b.txt").write_text("x")
'''


def test_a_test_that_writes_into_var_fails_and_so_does_the_run(tmp_path):
    """A pytest run of the project's conftest in a checkout of its own: the test that
    writes into its ./var errors at teardown, naming the file; payrun code run with no
    PAYRUN_HOME set by the test writes into the test's own home; a file written deep
    inside a folder already there (not seen after the test) fails the run at its end."""
    root = tmp_path / "checkout"
    (root / "var" / "deep" / "a").mkdir(parents=True)
    (root / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (root / "test_inner.py").write_text(INNER_TESTS)
    (root / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYRUN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_inner.py"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "3 passed, 1 error" in text, text  # (an error at its teardown: a test that passed)
    assert f"this test wrote into {root / 'var'}: leak.txt: payrun code ran without" in text, text
    assert "ERROR test_inner.py::test_writes_into_var" in text, text
    assert "written into the checkout's ./var (PAYRUN_HOME unset)" in text, text
    assert f"  {root / 'var' / 'deep' / 'a' / 'b.txt'}" in text and f"  {root / 'var' / 'leak.txt'}" in text, text
    assert sorted(p.name for p in (root / "var").iterdir()) == ["deep", "leak.txt"]  # no sends-unrecorded.jsonl
