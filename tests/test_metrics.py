"""The Prometheus endpoint, scraped over HTTP during a run, agrees with the ledger."""

from __future__ import annotations

import dataclasses
import urllib.request

from payrun import keys, metrics, payroll, runs
from payrun import ledger as ledger_mod
from payrun.ledger import Ledger


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_follow_the_run(cfg, conn, monkeypatch):
    from jobs.runtime import RenderWorker, make_queue

    cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, port=0))
    db = payroll.PayrollDB(cfg.payroll_path)
    payroll.seed(db, companies=1, employees=5, seed=2, month="2026-11")
    ledger = Ledger(cfg.ledger_path)
    observer, server = metrics.serve(conn, cfg)
    try:
        port = server.server_port
        runs.start_run(cfg, conn, ledger, db, "2026-11")
        before = scrape(port)
        assert before['payrun_queue_depth{queue="pdf-render"}'] == 5
        assert before['payrun_jobs{kind="render",state="queued"}'] == 5
        RenderWorker([make_queue(keys.RENDER_QUEUE, conn)], connection=conn).work(burst=True, logging_level="WARNING")
        ledger_mod.drain(conn, ledger)  # without an observer: the events below are replayed to it
        after = scrape(port)
        assert after['payrun_queue_depth{queue="pdf-render"}'] == 0
        assert after['payrun_queue_depth{queue="send-email"}'] == 5
        assert after['payrun_jobs{kind="render",state="done"}'] == 5
        assert after['payrun_jobs{kind="email",state="queued"}'] == 5
        assert after["payrun_redis_up"] == 1 and after["payrun_ledger_backlog"] == 0
        # the observer counts attempts as the ledger applies them
        from jobs import events

        events.emit(conn, "render-x", "running", attempt=1)
        events.emit(conn, "render-x", "done", attempt=1)
        ledger_mod.apply_pending(conn, ledger, observer=observer)
        final = scrape(port)
        assert final['payrun_job_attempts_total{outcome="done",queue="pdf-render"}'] == 1
        assert final['payrun_job_duration_seconds_count{queue="pdf-render"}'] == 1
    finally:
        server.shutdown()


def test_json_logs_carry_job_fields_and_no_salary(conn, capsys):
    import json
    import logging

    from jobs import events
    from payrun import logs

    logs.setup("INFO", as_json=True)
    try:
        events.emit(conn, "email-2026-11-emp-00001", "failed", attempt=1, error="invalid recipient address")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        logging.getLogger().handlers[:] = []
    rec = json.loads(line)
    assert rec["job_id"] == "email-2026-11-emp-00001" and rec["queue"] == "send-email"
    assert rec["attempt"] == 1 and rec["outcome"] == "failed" and rec["level"] == "info"


def test_payrun_log_debug_turns_one_topic_to_debug_and_leaves_the_rest(monkeypatch):
    import logging

    from payrun import logs

    monkeypatch.setenv("PAYRUN_LOG_DEBUG", "payrun.sends, ")
    sends, rq_worker = logging.getLogger("payrun.sends"), logging.getLogger("rq.worker")
    before = sends.level, rq_worker.level
    logs.setup("INFO")
    try:
        assert sends.isEnabledFor(logging.DEBUG)
        assert not rq_worker.isEnabledFor(logging.DEBUG) and not logging.getLogger("payrun.jobs").isEnabledFor(logging.DEBUG)
        # WeasyPrint's seven "Step n" lines per render stay out of an INFO log; its warnings do not
        progress = logging.getLogger("weasyprint.progress")
        assert not progress.isEnabledFor(logging.INFO) and progress.isEnabledFor(logging.WARNING)
    finally:
        logging.getLogger().handlers[:] = []
        sends.setLevel(before[0])
        rq_worker.setLevel(before[1])


def test_a_process_started_with_a_test_hook_says_so_in_its_log(monkeypatch, capsys):
    """Security review (session 31): PAYRUN_TEST_JOBS (workers run the suite's hang/crash
    jobs named in Redis), PAYRUN_CLOCK_FILE and PAYRUN_TEST_TICK_PAUSE steer production
    code; set by mistake on a real host they now show in every process's log at its start."""
    import logging

    from payrun import logs

    assert logs.test_hooks_set({}) == [] and logs.test_hooks_set({"PAYRUN_TEST_JOBS": ""}) == []
    assert logs.test_hooks_set({"PAYRUN_CLOCK_FILE": "/x"}) == ["PAYRUN_CLOCK_FILE: the scheduler reads the time from a file"]
    for k in logs.TEST_HOOKS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PAYRUN_TEST_JOBS", "1")
    logs.setup("INFO")
    try:
        err = capsys.readouterr().err
    finally:
        logging.getLogger().handlers[:] = []
    assert "WARNING payrun: test hook set, never for a real run: PAYRUN_TEST_JOBS: workers also run the test suite's jobs" in err
