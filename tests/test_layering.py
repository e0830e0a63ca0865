"""Worker-host code stays free of the console toolkit and of the SQLite ledger."""

import subprocess
import sys


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_jobs_and_scheduler_never_import_textual():
    for module in ("jobs.tasks", "jobs.runtime", "jobs.slip", "jobs.mail", "scheduler"):
        mods = imported_after(module)
        assert not any(m == "textual" or m.startswith("textual.") for m in mods), module


def test_worker_runtime_does_not_load_the_ledger():
    mods = imported_after("jobs.runtime")
    assert "payrun.ledger" not in mods and "sqlite_utils" not in mods
