"""Fan-out benchmark: `payrun run` for 50,000 employees (60 companies; --quick 10,000).

payrun: payrun.runs.start_run in-process (lock, unique rows, ledger rows, snapshots read
from the payroll db, RQ's job records written by one script per chunk of 1,000 —
payrun.bulk), timed; also the CLI
`payrun run --month M` wall time (a fresh ledger and a flushed Redis).
bare:   rq Queue.enqueue_many of the same jobs (same function name, same snapshot args,
JSON serializer, same job ids / ttls / retry, pipelined in chunks of 1,000) on a flushed
Redis, snapshots already in memory.

    python bench/fanout.py [--quick]

"ratio" = payrun jobs/s / bare jobs/s (target: 50,000 in <= 10 s; the issue expected about
0.7x bare, payrun.bulk makes it faster than bare).
"""

from __future__ import annotations

import sys

# bench/email.py would shadow the stdlib's email package: this folder, first on
# sys.path for a script run from it, goes last (where _common is still found)
sys.path.append(sys.path.pop(0))

import argparse
import subprocess
import time
from pathlib import Path

from _common import PY, ROOT, MONTH, Bench, finish, load_avg, median, r4, run_main, say, seed_payroll  # noqa: E402

CHUNK = 1000


def bare_enqueue(conn, snaps: list[dict], cfg) -> float:
    from rq import Queue, Retry
    from rq.serializers import JSONSerializer

    conn.flushall()
    q = Queue("pdf-render", connection=conn, serializer=JSONSerializer)
    retry = Retry(max=cfg.render.retry.attempts - 1)
    meta_retry = vars(cfg.render.retry)
    t = time.perf_counter()
    for i in range(0, len(snaps), CHUNK):
        with conn.pipeline() as pipe:
            q.enqueue_many([
                q.prepare_data("jobs.tasks.render_slip", args=(s,), job_id=f"render-{MONTH}-{s['employee']['id']}",
                               timeout=cfg.render.timeout_s, retry=retry, result_ttl=24 * 3600,
                               failure_ttl=30 * 24 * 3600, description=f"render slip {s['key']}",
                               meta={"kind": "render", "key": s["key"], "company": s["company"]["id"],
                                     "retry": meta_retry})
                for s in snaps[i:i + CHUNK]
            ], pipeline=pipe)
            pipe.execute()
    el = time.perf_counter() - t
    assert q.count == len(snaps), (q.count, len(snaps))
    return el


def payrun_run(b: Bench, conn, db, n: int, tag: str) -> tuple[float, dict]:
    from payrun import runs
    from payrun.ledger import Ledger

    conn.flushall()
    path = b.dir / f"ledger-{tag}.db"
    ledger = Ledger(path)
    t = time.perf_counter()
    res = runs.start_run(b.config(), conn, ledger, db, MONTH)
    el = time.perf_counter() - t
    rows = ledger.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    qn = conn.llen("rq:queue:pdf-render")
    ledger.close()
    assert res.jobs == n and rows == n and qn == n, (res.jobs, rows, qn)
    return el, {"jobs": res.jobs, "ledger_rows": rows, "queued": qn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--employees", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=None, help="rounds of (bare, payrun) (default 2; quick 2)")
    ap.add_argument("--no-cli", action="store_true")
    a = ap.parse_args()
    n = a.employees or (10_000 if a.quick else 50_000)
    rounds = a.repeat or 2
    with Bench("fanout") as b:
        say(f"fan-out bench: {n:,} employees / 60 companies, load {load_avg()}")
        conn = b.start_redis()
        b.apply_env()
        cfg = b.config()
        t = time.perf_counter()
        db = seed_payroll(b.home, employees=n, companies=60)
        say(f"seeded in {time.perf_counter() - t:.1f} s")
        from payrun import payroll

        t = time.perf_counter()
        snaps = list(payroll.snapshots(db, MONTH))
        read_s = time.perf_counter() - t
        say(f"reading {len(snaps):,} snapshots from the payroll db alone: {read_s:.2f} s")
        # the ledger rows alone (same rows as start_run writes), for the breakdown
        from payrun.ledger import Ledger

        lg = Ledger(b.dir / "ledger-rows-only.db")
        t = time.perf_counter()
        for i in range(0, len(snaps), CHUNK):
            lg.create_jobs({"id": f"render-{MONTH}-{s['employee']['id']}", "kind": "render",
                            "company_id": s["company"]["id"], "employee_id": s["employee"]["id"], "month": MONTH,
                            "key": s["key"], "queue": "pdf-render"} for s in snaps[i:i + CHUNK])
        rows_s = time.perf_counter() - t
        lg.close()
        say(f"writing {n:,} ledger rows alone (chunks of {CHUNK}): {rows_s:.2f} s")

        bare_t, pay_t = [], []
        for r in range(rounds):
            el = bare_enqueue(conn, snaps, cfg)
            bare_t.append(el)
            say(f"round {r + 1}: bare RQ enqueue_many: {el:.2f} s = {n / el:,.0f} jobs/s")
            el, info = payrun_run(b, conn, db, n, f"r{r}")
            pay_t.append(el)
            say(f"round {r + 1}: payrun start_run:     {el:.2f} s = {n / el:,.0f} jobs/s  ({info})")
        bare = median(bare_t)
        pay = median(pay_t)
        ratio = (n / pay) / (n / bare)
        say(f"median: payrun {pay:.2f} s ({n / pay:,.0f} jobs/s), bare {bare:.2f} s ({n / bare:,.0f} jobs/s), "
            f"ratio {ratio:.3f}; extrapolated to 50,000: payrun {pay * 50_000 / n:.1f} s (target <= 10 s)")
        say(f"breakdown of payrun's {pay:.2f} s: snapshot reads {read_s:.2f} s, ledger rows {rows_s:.2f} s, "
            f"building and writing the RQ jobs (payrun.bulk) {pay - read_s - rows_s:.2f} s")
        cli_s = None
        if not a.no_cli:
            conn.flushall()
            for f in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
                (b.home / f).unlink(missing_ok=True)
            t = time.perf_counter()
            out = subprocess.run([PY, "-m", "payrun.cli", "run", "--month", MONTH, "--json"], env=b.env(),
                                 cwd=str(ROOT), capture_output=True, text=True, timeout=600)
            cli_s = time.perf_counter() - t
            if out.returncode != 0:
                raise RuntimeError(f"payrun run failed: {out.stderr[-500:]}")
            say(f"CLI `payrun run --month {MONTH}` wall time (imports included): {cli_s:.2f} s; "
                f"queued {conn.llen('rq:queue:pdf-render'):,}")
        finish({"bench": "fanout", "quick": a.quick, "employees": n, "rounds": rounds,
                "payrun_s": r4(pay), "payrun_jobs_per_s": r4(n / pay), "bare_s": r4(bare),
                "bare_jobs_per_s": r4(n / bare), "payrun_runs_s": [r4(x) for x in pay_t],
                "bare_runs_s": [r4(x) for x in bare_t], "snapshot_read_s": r4(read_s),
                "ledger_rows_s": r4(rows_s), "cli_wall_s": r4(cli_s) if cli_s else None,
                "payrun_s_per_50k": r4(pay * 50_000 / n), "ratio": r4(ratio),
                "target": "50,000 jobs <= 10 s, ratio about 0.7"})


if __name__ == "__main__":
    run_main(main)
