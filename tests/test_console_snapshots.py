"""SVG snapshots of the console (pytest-textual-snapshot): fixed data, fixed clock, no
cursor blink, no polling after the first refresh. Update after a deliberate change with
`pytest tests/test_console_snapshots.py --snapshot-update` and look at the SVGs."""

from __future__ import annotations

import pytest

from console.app import ConsoleApp
from console.data import Limits, QueueRow, RunningRow, Snapshot, Source, WorkerRow, eta
from console.failed import FailedFilter, FailedPage
from payrun import config as config_mod

NOW = 1_793_478_300.0  # 2026-11-01 02:25:00 in Asia/Dhaka (UTC+6)
SIZE = (80, 24)

pytest.importorskip("pytest_textual_snapshot")


def fixed_snapshot(more_companies: int = 0) -> Snapshot:
    companies = [
        {"id": 1, "name": "Meghna Textiles Ltd", "queued": 0, "running": 3, "retrying": 1, "done": 16_402,
         "failed": 2, "stuck": 1, "total": 16_408, "no_slip": 0},
        {"id": 2, "name": "Padma Pharmaceuticals", "queued": 1_204, "running": 20, "retrying": 0, "done": 15_100,
         "failed": 0, "stuck": 0, "total": 16_324, "no_slip": 0},
        {"id": 3, "name": "Jamuna Steel Works", "queued": 4_070, "running": 22, "retrying": 5, "done": 13_171,
         "failed": 0, "stuck": 0, "total": 17_268, "no_slip": 0},
    ]
    companies += [{"id": 4 + i, "name": f"Sample Company {4 + i}", "queued": 0, "running": 0, "retrying": 0,
                   "done": 800 + i, "failed": 0, "stuck": 0, "total": 800 + i, "no_slip": 2 if i == 5 else 0}
                  for i in range(more_companies)]
    total = {k: sum(c[k] for c in companies) for k in ("queued", "running", "retrying", "done", "failed", "stuck",
                                                         "total", "no_slip")}
    queues = [
        QueueRow("pdf-render", 5_274, 2, 0, 0, 312.0, [90, 118, 120, 119, 121, 120, 118, 122, 120, 119], False),
        QueueRow("send-email", 4, 43, 6, 2, 1.0, [2100, 2350, 2390, 2395, 2400, 2398, 2392, 2401, 2399, 2394],
                 False, 120),
        QueueRow("control", 0, 0, 0, 0, None, [0] * 10, False),
    ]
    workers = [WorkerRow("render.app1.4101", "app1", 4101, "pdf-render", "busy", "render-2026-11-emp-31877", 0.4,
                         1.0, True, False, "render"),
               WorkerRow("render.app1.4102", "app1", 4102, "pdf-render", "busy", "render-2026-11-emp-31878", 0.2,
                         1.0, True, False, "render")]
    workers += [WorkerRow(f"email.app1.4200.{i:02d}", "app1", 4200, "send-email", "busy" if i < 43 else "idle",
                          f"email-2026-11-emp-{10000 + i:05d}" if i < 43 else None, 1.0 + i % 3, 0.5, True, False,
                          "email") for i in range(45)]
    running = [RunningRow("email-2026-11-emp-00017", "send-email", "email.app1.4200.07", 700.0, 30.0, -20.0,
                          "worker email.app1.4200.07 is gone (no liveness for 10 s)")]
    status = {"month": "2026-11", "total": total, "companies": companies}
    return Snapshot(taken_at=NOW, queues=queues, workers=workers, running=running,
                    limits=Limits(cap=45, rate_per_s=40.0, in_use=43, waits=1_812, http_429=3, paused_for_s=0),
                    status=status, eta=eta(total, 39.9, NOW, "Asia/Dhaka"), took_s=0.021)


def fixed_page(flt: FailedFilter, offset: int, limit: int) -> FailedPage:
    errors = ["provider 127.0.0.1:8025: HTTP 422 invalid recipient address: 'rahim@meghna.invalid'",
              "TemplateError: 'designation' is undefined"]
    rows = [{"id": f"email-2026-11-emp-{i:05d}", "queue": "send-email", "company": 1 + i % 3, "kind": "email",
             "attempts": 1, "error": errors[i % 2], "ended_at": "2026-10-31T20:10:00.000+00:00", "in_redis": True,
             "permanent": i % 2 == 0}
            for i in range(12)]
    return FailedPage(rows, 12, 0, flt, "redis", 0.004)


class FixedSource(Source):
    def __init__(self, more_companies: int = 0):
        cfg = config_mod.Config()
        super().__init__(cfg, conn=object(), clock=lambda: NOW)
        self.more_companies = more_companies

    def snapshot(self) -> Snapshot:
        return fixed_snapshot(self.more_companies)

    def failed_page(self, flt, offset=0, limit=50):
        return fixed_page(flt, offset, limit)

    def failed_ids(self, flt):
        return [r["id"] for r in fixed_page(flt, 0, 50).rows]

    def permanent_among(self, ids):
        return [r["id"] for r in fixed_page(FailedFilter(), 0, 50).rows if r["permanent"] and r["id"] in ids]


def app(more_companies: int = 0) -> ConsoleApp:
    return ConsoleApp(FixedSource(more_companies), clock=lambda: NOW, poll=False, no_blink=True)


async def ready(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_overview_snapshot(snap_compare):
    assert snap_compare(app(), terminal_size=SIZE, run_before=ready)


def test_overview_snapshot_large(snap_compare):
    """A tall screen gives 30 companies the rows it has spare; 2 employees of one have no slip yet."""
    assert snap_compare(app(more_companies=27), terminal_size=(200, 50), run_before=ready)


def test_failed_list_snapshot(snap_compare):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f")
        await ready(pilot)

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)


def test_bulk_confirmation_snapshot(snap_compare):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("f")
        await ready(pilot)
        await pilot.press("slash", *"refused", "enter")
        await ready(pilot)
        await pilot.press("A")
        await ready(pilot)

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)


def test_running_snapshot(snap_compare):
    async def run_before(pilot):
        await ready(pilot)
        await pilot.press("r")
        await ready(pilot)

    assert snap_compare(app(), terminal_size=SIZE, run_before=run_before)
