"""Render benchmark: warm single-process render time of one slip, HarfBuzz subsetting,
and slips/s through the full pool (one `payrun worker pdf-render` per core, real RQ jobs
from payrun.runs.start_run) vs the CPU limit = cores / warm render time.

    python bench/render.py [--quick]

"ratio" = pool slips/s / CPU limit (target >= 0.90).
"""

from __future__ import annotations

import importlib.util as _ilu
import os as _os
import sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
# bench/email.py must not shadow the stdlib "email" package: drop bench/ from sys.path and
# load the shared helpers by file path instead
sys.path[:] = [p for p in sys.path if _os.path.abspath(p or _os.curdir) != _HERE]
if "_common" not in sys.modules:
    _spec = _ilu.spec_from_file_location("_common", _os.path.join(_HERE, "_common.py"))
    sys.modules["_common"] = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["_common"])

import argparse
import logging
import time
from pathlib import Path

from _common import (CORES, proc_cpu_s, MONTH, Bench, finish, harfbuzz_subset_info, job_times, load_avg, median,  # noqa: E402
                     parallel_render_times, r4, run_main, say, seed_payroll, span_rate, warm_render_times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--slips", type=int, default=None, help="pool jobs (default 600; quick 200)")
    ap.add_argument("--workers", type=int, default=None, help="pool size (default: one per core)")
    ap.add_argument("--renders", type=int, default=None, help="warm renders to time (default 40; quick 15)")
    a = ap.parse_args()
    n_pool = a.slips or (200 if a.quick else 600)
    n_warm = a.renders or (15 if a.quick else 40)
    logging.getLogger("weasyprint").setLevel(logging.ERROR)

    with Bench("render") as b:
        load0 = load_avg()
        say(f"render bench: {CORES} cores, load {load0}, pool {n_pool} slips, {n_warm} warm renders")
        conn = b.start_redis()
        b.apply_env()
        db = seed_payroll(b.home, employees=n_pool, companies=3)
        from payrun import payroll

        snaps = list(payroll.snapshots(db, MONTH))

        # 1. warm single-process render time (nothing else of ours running)
        hb = harfbuzz_subset_info()
        t0 = time.perf_counter()
        from jobs import slip

        slip.warm_up()
        first = time.perf_counter() - t0
        c0 = time.process_time()
        times = warm_render_times(n_warm, snaps)
        warm_cpu = (time.process_time() - c0) / n_warm
        warm = median(times)
        say(f"import + first render: {first:.2f} s")
        say(f"warm render (median of {n_warm}): {warm * 1000:.0f} ms  (min {min(times) * 1000:.0f}, "
            f"max {max(times) * 1000:.0f})")
        say(f"warm render CPU (mean): {warm_cpu * 1000:.0f} ms")
        say(f"HarfBuzz subsetting in use: {hb['harfbuzz_subset']} (libharfbuzz-subset loaded: "
            f"{hb['libharfbuzz_subset_loaded']} from {hb['library']}, harfbuzz >= 4.1: {hb['harfbuzz_ge_4_1']})")
        cpu_limit = CORES / warm
        say(f"CPU limit = {CORES} cores / {warm:.3f} s = {cpu_limit:.1f} slips/s")
        par = median(parallel_render_times(CORES, n_warm * 2, snaps))
        par_limit = CORES / par
        say(f"the same render with {CORES} processes rendering at once (no RQ): {par * 1000:.0f} ms median "
            f"({par / warm:.2f}x the lone render): parallel ceiling {par_limit:.1f} slips/s")

        # 2. the pool: one pdf-render worker per core, fed by the real fan-out
        pool = a.workers or CORES
        workers = [b.spawn(f"render-{i}", ["worker", "pdf-render"]) for i in range(pool)]
        ready_s = b.wait_workers(conn, pool)
        say(f"{pool} pdf-render workers warm and registered after {ready_s:.1f} s")
        from payrun import runs
        from payrun.ledger import Ledger

        ledger = Ledger(b.home / "ledger.db")
        cpu0 = sum(proc_cpu_s(w.pid, children=True) for w in workers)
        t_run = time.monotonic()
        res = runs.start_run(b.config(), conn, ledger, db, MONTH)
        say(f"fan-out: {res.jobs} jobs in {time.monotonic() - t_run:.2f} s")
        ids = [f"render-{MONTH}-{s['employee']['id']}" for s in snaps]
        deadline = time.monotonic() + 60 + n_pool * warm * 4
        last_print = 0.0
        while True:
            done = conn.zcard("rq:finished:pdf-render")
            failed = conn.zcard("rq:failed:pdf-render")
            if done + failed >= n_pool:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"pool did not finish: {done} done, {failed} failed")
            if time.monotonic() - last_print > 5:
                say(f"  ... {done}/{n_pool} rendered")
                last_print = time.monotonic()
            b.check_alive()
            time.sleep(0.2)
        time.sleep(0.5)  # let the parents reap the last horses
        pool_cpu = (sum(proc_cpu_s(w.pid, children=True) for w in workers) - cpu0) / n_pool
        ends = job_times(conn, ids, "ended_at")
        starts = job_times(conn, ids, "started_at")
        pool_rate, span = span_rate(ends)
        # per-job time inside the work horse (render + write + enqueue send)
        in_horse = []
        with conn.pipeline(transaction=False) as p:
            for jid in ids:
                p.hmget(f"rq:job:{jid}", "started_at", "ended_at")
            from _common import parse_ts

            for s, e in p.execute():
                if s and e:
                    in_horse.append(parse_ts(e) - parse_ts(s))
        horse = median(in_horse)
        ratio = pool_rate / cpu_limit
        say(f"pool: {len(ends)} slips done ({failed} failed), {pool_rate:.2f} slips/s between first and last "
            f"completion ({span:.1f} s)")
        say(f"per job inside the work horse (started_at -> ended_at, median): {horse * 1000:.0f} ms; "
            f"between jobs per worker: {(CORES / pool_rate - horse) * 1000:.0f} ms")
        say(f"pool CPU per slip (worker parents + horses): {pool_cpu * 1000:.0f} ms vs warm render CPU "
            f"{warm_cpu * 1000:.0f} ms in-process ({pool_cpu / warm_cpu:.2f}x)")
        say(f"pool / CPU limit = {ratio:.3f}  (target >= 0.90); pool / parallel ceiling = {pool_rate / par_limit:.3f}")
        for w in workers:
            b.stop(w)

        # 3. for reference: the same renders with fontTools subsetting (as without libharfbuzz-subset)
        from weasyprint.pdf import fonts as wp_fonts

        saved = wp_fonts.harfbuzz_subset
        wp_fonts.harfbuzz_subset = None
        try:
            ft_times = warm_render_times(max(5, n_warm // 4), snaps)
        finally:
            wp_fonts.harfbuzz_subset = saved
        ft = median(ft_times)
        say(f"for reference, fontTools subsetting instead: {ft * 1000:.0f} ms/render ({ft / warm:.2f}x)")

        finish({
            "bench": "render", "quick": a.quick, "cores": CORES, "load_at_start": load0,
            "warm_render_s": r4(warm), "warm_render_min_s": r4(min(times)), "first_render_s": r4(first),
            "harfbuzz_subset": hb["harfbuzz_subset"], "harfbuzz_subset_library": hb["library"],
            "warm_render_cpu_s": r4(warm_cpu), "pool_cpu_per_slip_s": r4(pool_cpu),
            "pool_cpu_vs_warm_cpu": r4(pool_cpu / warm_cpu),
            "fonttools_render_s": r4(ft), "cpu_limit_slips_per_s": r4(cpu_limit),
            "pool_slips": len(ends), "pool_failed": failed, "pool_span_s": r4(span),
            "pool_slips_per_s": r4(pool_rate), "horse_job_median_s": r4(horse),
            "first_start_to_last_end_s": r4(ends[-1] - starts[0]) if ends and starts else None,
            "parallel_render_s": r4(par), "parallel_ceiling_slips_per_s": r4(par_limit),
            "pool_vs_parallel_ceiling": r4(pool_rate / par_limit),
            "ratio": r4(ratio), "target": ">= 0.90",
        })


if __name__ == "__main__":
    run_main(main)
