"""A render worker runs under Linux's SCHED_BATCH (config render.batch_scheduling, on by
default): the worker, every thread it starts and its warm horse, which it forks after.
A real `payrun worker pdf-render` process, a real render."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_for
from payrun import keys, runs

MONTH = "2026-11"  # the month of conftest's `world`

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies only")


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of ``pid``."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            kids += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except FileNotFoundError:
            pass
    return kids


@pytest.mark.parametrize("batch", [True, False])
def test_a_render_worker_and_its_horse_run_under_sched_batch(world, tmp_path, batch):
    cfg, conn, db, ledger = world
    env = dict(os.environ)
    if not batch:
        toml = tmp_path / "payrun.toml"
        toml.write_text("[render]\nbatch_scheduling = false\n")
        env["PAYRUN_CONFIG"] = str(toml)
    want = os.SCHED_BATCH if batch else os.SCHED_OTHER
    w = subprocess.Popen([sys.executable, "-m", "payrun.cli", "worker", keys.RENDER_QUEUE], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: conn.scard("rq:workers") or w.poll() is not None, timeout_s=60,
                 what="the render worker to register")
        assert w.poll() is None, "the render worker exited"
        assert _policies(w.pid) == {want}
        runs.start_run(cfg, conn, ledger, db, MONTH)
        wait_for(lambda: conn.zcard("rq:finished:pdf-render") == 12, timeout_s=120, what="the renders")
        horses = _children(w.pid)  # the warm horse (and RQ's scheduler process, once it holds its lock)
        assert horses and all(_policies(h) == {want} for h in horses)
    finally:
        os.killpg(w.pid, signal.SIGTERM)
        w.wait(timeout=60)
