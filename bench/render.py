"""Render benchmark: warm single-process render time of one slip, HarfBuzz subsetting,
and slips/s through the full pool (one `payrun worker pdf-render` per core, real RQ jobs
from payrun.runs.start_run) vs the CPU limit = cores / warm render time.

    python bench/render.py [--quick]

"ratio" = pool slips/s / CPU limit (target >= 0.90): the median of several rounds, each
compared with warm renders timed just before and after it (this machine's speed drifts).
A round's CPU limit is cores / the *mean* of those renders, of slips spread over the
round's own employees: N slips take N x the mean render on one core, so that is the
ceiling a pool's slips/s can reach. (Up to session 11 it was the median of renders of
the first 8 slips; render times are skewed right, p90 ~1.17x the median, so the median
overstated the ceiling by ~4 %. The median-based ratio is still printed,
"ratio_median_based".) A round's slips/s is its slips / (its last end - its first
start), as a batch's wall time gives it. (Up to session 18 it was (slips - 1) / (last
end - first end), which overstated the rate by ~2.5 %: with two workers both first ends
come one render after the start ((N - 1) / (N - 2)), and a worker records a render's end
only after it has handed its horse the next slip, so the first end came up to a render
late and the last one at once; still printed, "ratio_first_to_last_end".)
"""

from __future__ import annotations

import sys

# bench/email.py would shadow the stdlib's email package: this folder, first on
# sys.path for a script run from it, goes last (where _common is still found)
sys.path.append(sys.path.pop(0))

import argparse
import logging
import time

from _common import (CORES, proc_cpu_s, MONTH, Bench, bare_pool_rate, finish, harfbuzz_subset_info, job_times, load_avg, mean,  # noqa: E402
                     makespan_rate, median, parallel_render_times, per_cpu_limit, r4, run_main, say, seed_payroll,
                     span_rate, warm_render_times, warm_render_times_per_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--slips", type=int, default=None, help="pool jobs (default 600; quick 200)")
    ap.add_argument("--workers", type=int, default=None, help="pool size (default: one per core)")
    ap.add_argument("--renders", type=int, default=None, help="warm renders to time (default 40; quick 15)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="pool rounds, each bracketed by warm renders (default 8; quick 4)")
    ap.add_argument("--jobs-per-horse", type=int, default=None,
                    help="render.jobs_per_horse for the pool (default: payrun's default)")
    ap.add_argument("--batch", type=int, default=None, help="render.batch for the pool (default: payrun's default)")
    a = ap.parse_args()
    n_pool = a.slips or (200 if a.quick else 600)
    n_warm = a.renders or (15 if a.quick else 40)
    rounds = max(1, a.rounds or (4 if a.quick else 8))
    n_bracket = 8 if a.quick else 12  # warm renders before and after each round
    logging.getLogger("weasyprint").setLevel(logging.ERROR)

    conf = "[render]\n" + (f"jobs_per_horse = {a.jobs_per_horse}\n" if a.jobs_per_horse else "") + \
        (f"batch = {a.batch}\n" if a.batch else "")
    with Bench("render", config_toml=conf) as b:
        load0 = load_avg()
        say(f"render bench: {CORES} cores, load {load0}, pool {n_pool} slips in {rounds} rounds, "
            f"{n_warm} warm renders")
        conn = b.start_redis()
        b.apply_env()
        # each round runs the real `start_run` fan-out for its own companies (grouped to
        # about the same number of slips per round)
        db = seed_payroll(b.home, employees=n_pool, companies=rounds * 4)
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
        say(f"warm render CPU (mean): {warm_cpu * 1000:.0f} ms; wall mean {mean(times) * 1000:.1f} ms")
        say(f"HarfBuzz subsetting in use: {hb['harfbuzz_subset']} (libharfbuzz-subset loaded: "
            f"{hb['libharfbuzz_subset_loaded']} from {hb['library']}, harfbuzz >= 4.1: {hb['harfbuzz_ge_4_1']})")
        cpu_limit = CORES / mean(times)
        say(f"CPU limit = {CORES} cores / {mean(times):.4f} s (mean) = {cpu_limit:.1f} slips/s")
        par = median(parallel_render_times(CORES, n_warm * 2, snaps))
        par_limit = CORES / par
        say(f"the same render with {CORES} processes rendering at once (no RQ): {par * 1000:.0f} ms median "
            f"({par / warm:.2f}x the lone render): parallel ceiling {par_limit:.1f} slips/s")

        # 1b. bare processes, one per core, no RQ: rendering only, then rendering and
        # writing each slip durably as a job does. The gap between the second and the pool
        # is what the job runtime costs; the gap between the first and the CPU limit is
        # what two cores rendering at once lose.
        bare_n = 25 if a.quick else 75
        bare_dir = b.home / "bare-slips"
        bare_dir.mkdir(mode=0o700)
        spread = snaps[::max(1, len(snaps) // n_bracket)][:n_bracket]
        lone0 = mean(warm_render_times(n_bracket, spread))
        bare_render = bare_pool_rate(CORES, bare_n, snaps)
        bare_write = bare_pool_rate(CORES, bare_n, snaps, bare_dir)
        lone1 = mean(warm_render_times(n_bracket, spread))
        bare_limit = CORES / ((lone0 + lone1) / 2)
        bare_render_r, bare_write_r = bare_render / bare_limit, bare_write / bare_limit
        say(f"{CORES} bare processes, {bare_n} slips each (no RQ, no Redis): rendering only {bare_render:.1f} slips/s "
            f"({bare_render_r:.3f} of the CPU limit {bare_limit:.1f}); rendering and writing each slip durably "
            f"{bare_write:.1f} slips/s ({bare_write_r:.3f})")

        # 2. the pool: one pdf-render worker per core, fed by the real fan-out, in rounds.
        # This machine's speed drifts (a lone render takes 80 ms for some seconds, 160 ms
        # for the next): each round's rate is compared with warm renders timed just before
        # and just after it, and the headline is the median of the rounds' ratios.
        pool = a.workers or CORES
        workers = [b.spawn(f"render-{i}", ["worker", "pdf-render"]) for i in range(pool)]
        ready_s = b.wait_workers(conn, pool)
        jph, batch = b.config().render.jobs_per_horse, b.config().render.batch
        say(f"{pool} pdf-render workers warm and registered after {ready_s:.1f} s (a horse serves {jph} jobs; "
            f"render.batch {batch})")
        from payrun import runs
        from payrun.ledger import Ledger

        ledger = Ledger(b.home / "ledger.db")
        by_company: dict[int, list[str]] = {}
        for s in snaps:
            by_company.setdefault(int(s["company"]["id"]), []).append(f"render-{MONTH}-{s['employee']['id']}")
        groups: list[tuple[list[int], list[str]]] = [([], []) for _ in range(rounds)]
        for company, ids in sorted(by_company.items(), key=lambda kv: -len(kv[1])):
            smallest = min(groups, key=lambda g: len(g[1]))
            smallest[0].append(company)
            smallest[1].extend(ids)
        cpu0 = sum(proc_cpu_s(w.pid, children=True) for w in workers)
        parent0 = sum(proc_cpu_s(w.pid) for w in workers)
        rows, all_ids, gaps, in_horse, cycles = [], [], [], [], []
        failed_total = 0
        pool_wall = 0.0
        by_id = {f"render-{MONTH}-{s['employee']['id']}": s for s in snaps}
        rows_med = []
        for rnd, (companies, ids) in enumerate(groups, 1):
            # bracket renders: slips spread over this round's own employees
            own = [by_id[i] for i in ids]
            sample = own[::max(1, len(own) // n_bracket)][:n_bracket]
            t_before = warm_render_times(n_bracket, sample)
            p_before = parallel_render_times(CORES, n_bracket, sample)
            c_before = warm_render_times_per_cpu(n_bracket, sample)
            before, par_before = mean(t_before), mean(p_before)
            fin0 = conn.zcard("rq:finished:pdf-render")
            fail0 = conn.zcard("rq:failed:pdf-render")
            t_run = time.monotonic()
            queued = sum(runs.start_run(b.config(), conn, ledger, db, MONTH, company_id=c).jobs for c in companies)
            deadline = time.monotonic() + 60 + len(ids) * warm * 4
            while True:
                done = conn.zcard("rq:finished:pdf-render") - fin0
                failed = conn.zcard("rq:failed:pdf-render") - fail0
                if done + failed >= len(ids):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"round {rnd} did not finish: {done} done, {failed} failed")
                b.check_alive()
                time.sleep(0.05)
            pool_wall += time.monotonic() - t_run
            failed_total += failed
            t_after = warm_render_times(n_bracket, sample)
            p_after = parallel_render_times(CORES, n_bracket, sample)
            c_after = warm_render_times_per_cpu(n_bracket, sample)
            after, par_after = mean(t_after), mean(p_after)
            limit_cpus = per_cpu_limit(c_before, c_after)
            per_cpu_ms = {c: mean(c_before[c] + c_after[c]) * 1000 for c in sorted(c_before)}
            ends = job_times(conn, ids, "ended_at")
            rate, span = makespan_rate(job_times(conn, ids, "started_at"), ends)
            old_rate, _ = span_rate(ends)  # sessions up to 18: first end -> last end
            bracket = (before + after) / 2
            busy = busy_rate(conn, ids)
            rows_med.append(rate / (CORES / ((median(t_before) + median(t_after)) / 2)))
            row = {"round": rnd, "slips": queued, "slips_per_s": r4(rate), "span_s": r4(span),
                   "warm_before_s": r4(before), "warm_after_s": r4(after),
                   "parallel_before_s": r4(par_before), "parallel_after_s": r4(par_after),
                   "ratio": r4(rate / (CORES / bracket)),
                   "busy_slips_per_s": r4(busy), "ratio_busy": r4(busy / (CORES / bracket)),
                   "ratio_first_to_last_end": r4(old_rate / (CORES / bracket)),
                   "vs_parallel": r4(rate / (CORES / ((par_before + par_after) / 2))),
                   "warm_per_cpu_s": {str(c): r4(v / 1000) for c, v in per_cpu_ms.items()},
                   "ratio_per_cpu": r4(rate / limit_cpus)}
            rows.append(row)
            all_ids += ids
            g, h, c = worker_gaps(conn, ids)
            gaps += g
            in_horse += h
            cycles += c
            say(f"  round {rnd}: {queued} slips, {rate:.2f} slips/s; warm render (mean) {before * 1000:.1f} ms "
                f"before, {after * 1000:.1f} ms after (both cores at once: {par_before * 1000:.1f} / "
                f"{par_after * 1000:.1f} ms) -> pool / CPU limit {row['ratio']:.3f}, pool / parallel ceiling "
                f"{row['vs_parallel']:.3f} (median-based: {rows_med[-1]:.3f}; first end -> last end, as up to "
                f"session 18: {row['ratio_first_to_last_end']:.3f}; while every worker had work: "
                f"{row['ratio_busy']:.3f}); lone renders pinned to each CPU "
                f"{' / '.join(f'{v:.1f}' for v in per_cpu_ms.values())} ms -> pool / the CPUs' own limit "
                f"{row['ratio_per_cpu']:.3f}")
        time.sleep(0.5)  # let the parents reap the last horses
        n_done = len(all_ids)
        pool_cpu = (sum(proc_cpu_s(w.pid, children=True) for w in workers) - cpu0) / n_done
        parent_cpu = (sum(proc_cpu_s(w.pid) for w in workers) - parent0) / n_done
        ratios = [row["ratio"] for row in rows]
        ratio = median(ratios)
        horse = median(in_horse)
        gap = median(gaps)
        gap_p90 = sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else float("nan")
        vs_par = median([row["vs_parallel"] for row in rows])
        say(f"pool: {n_done} slips ({failed_total} failed) in {rounds} rounds; round ratios "
            f"{', '.join(f'{x:.3f}' for x in ratios)}")
        cycle = median(cycles)
        if batch > 1:
            say(f"(render.batch {batch}: a job's started_at is its batch's start and its ended_at the finish of its "
                "group, so the per-job cycle and gap figures below describe batches, not single renders)")
        say(f"one worker's cycle per slip (one job's started_at -> its next job's, median): {cycle * 1000:.1f} ms, "
            f"against the warm render's {mean(times) * 1000:.1f} ms; per job from its start to its recorded end: "
            f"{horse * 1000:.0f} ms; from one job's end to the next one's start: median {gap * 1000:.1f} ms, "
            f"p90 {gap_p90 * 1000:.1f} ms (below 0: the worker records a render's end after it has handed its "
            f"horse the next job, jobs.runtime.RenderWorker._finish_rendered)")
        cyc = sorted(cycles)
        cycle_mean = mean(cycles)
        slow = [c for c in cyc if c > 1.5 * cycle]
        say(f"the same cycle: mean {cycle_mean * 1000:.1f} ms, p90 {cyc[int(0.9 * (len(cyc) - 1))] * 1000:.1f} ms, "
            f"p99 {cyc[int(0.99 * (len(cyc) - 1))] * 1000:.1f} ms, max {cyc[-1] * 1000:.1f} ms; {len(slow)} of "
            f"{len(cyc)} above 1.5x the median, adding {sum(c - cycle for c in slow) / len(cyc) * 1000:.2f} ms per slip")
        say(f"pool CPU per slip (worker parents + horses): {pool_cpu * 1000:.0f} ms vs warm render CPU "
            f"{warm_cpu * 1000:.0f} ms in-process ({pool_cpu / warm_cpu:.2f}x); of it in the worker parents "
            f"(dequeue, hand-over, liveness, scheduler checks): {parent_cpu * 1000:.1f} ms")
        ratio_med = median(rows_med)
        ratio_old = median([row["ratio_first_to_last_end"] for row in rows])
        say(f"the same measured from the round's first end to its last, as up to session 18: {ratio_old:.3f} "
            "(overstated: both workers' first ends come a render after the start, and a render's end is recorded "
            "up to a render late, the round's last one at once)")
        say(f"the same with the median render as the ceiling (sessions up to 11): {ratio_med:.3f}")
        ratio_busy = median([row["ratio_busy"] for row in rows])
        ratio_cpus = median([row["ratio_per_cpu"] for row in rows])
        say(f"the same while every worker had work (per worker, its slips / its first start -> its last end, "
            f"summed; leaves out each round's drain, when one worker waits for the other's last slip: "
            f"a 50,000-slip run drains once, these rounds {rounds} times): {ratio_busy:.3f}")
        say(f"the same against each CPU's own lone render, timed pinned to it (the sum of 1 / its mean: this "
            f"VM's vCPUs change speed each on its own, so a lone render timed wherever the bench runs can "
            f"over- or understate the pair): {ratio_cpus:.3f}")
        say(f"pool / CPU limit = {ratio:.3f} (median of {rounds} rounds; target >= 0.90); "
            f"pool / parallel ceiling = {vs_par:.3f} (median; what the pool itself loses against {CORES} bare "
            f"processes rendering at once)")
        say(f"pool / (rendering and writing durably, bare) = {ratio / bare_write_r:.3f}: what the job runtime "
            "(hand-over, RQ's bookkeeping, the send's enqueue, the events) costs")
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
            "parent_cpu_per_slip_s": r4(parent_cpu),
            "fonttools_render_s": r4(ft), "cpu_limit_slips_per_s": r4(cpu_limit),
            "pool_slips": n_done, "pool_failed": failed_total, "pool_wall_s": r4(pool_wall),
            "rounds": rows, "round_ratio_min": r4(min(ratios)), "round_ratio_max": r4(max(ratios)),
            "horse_job_median_s": r4(horse), "worker_cycle_median_s": r4(cycle), "gap_between_jobs_median_s": r4(gap),
            "worker_cycle_mean_s": r4(cycle_mean),
            "gap_between_jobs_p90_s": r4(gap_p90),
            "parallel_render_s": r4(par), "parallel_ceiling_slips_per_s": r4(par_limit),
            "pool_vs_parallel_ceiling": r4(vs_par),
            "bare_render_vs_cpu_limit": r4(bare_render_r), "bare_render_write_vs_cpu_limit": r4(bare_write_r),
            "pool_vs_bare_render_write": r4(ratio / bare_write_r),
            "jobs_per_horse": jph, "batch": batch, "ratio_median_based": r4(ratio_med), "ratio_first_to_last_end": r4(ratio_old),
            "ratio_busy": r4(ratio_busy), "ratio_per_cpu": r4(ratio_cpus),
            "ratio": r4(ratio), "target": ">= 0.90",
        })


def busy_rate(conn, ids: list[str]) -> float:
    """The pool's slips/s while every worker had work: per worker, its slips over its own
    first start -> its last end, summed over the workers. Unlike the round's makespan it
    leaves out the drain at the round's end (a worker with nothing left waits for the
    other's last slip); a real run of 50,000 slips pays it once. (Up to session 44: the
    slips started after the first over first start -> last start, which a worker taking
    its jobs in batches (render.batch) overstates: a batch's jobs share one started_at.)"""
    from _common import parse_ts

    spans: dict[str, list[float]] = {}
    with conn.pipeline(transaction=False) as p:
        for jid in ids:
            p.hmget(f"rq:job:{jid}", "worker_name", "started_at", "ended_at")
        for w, s, e in p.execute():
            if w and s and e:
                span = spans.setdefault(w.decode(), [float("inf"), float("-inf"), 0])
                span[0], span[1], span[2] = min(span[0], parse_ts(s)), max(span[1], parse_ts(e)), span[2] + 1
    return sum(n / (last - first) for first, last, n in spans.values() if last > first)


def worker_gaps(conn, ids: list[str]) -> tuple[list[float], list[float], list[float]]:
    """Per worker, the time from one job's ended_at to its next job's started_at, each
    job's started_at -> ended_at, and the time from one job's started_at to the next's
    (the worker's whole cycle per slip). Each worker's own clock: drift does not enter."""
    from _common import parse_ts

    per_worker: dict[str, list[tuple[float, float]]] = {}
    in_horse = []
    with conn.pipeline(transaction=False) as p:
        for jid in ids:
            p.hmget(f"rq:job:{jid}", "worker_name", "started_at", "ended_at")
        for w, s, e in p.execute():
            if w and s and e:
                s, e = parse_ts(s), parse_ts(e)
                per_worker.setdefault(w.decode(), []).append((s, e))
                in_horse.append(e - s)
    gaps, cycles = [], []
    for jobs_ in per_worker.values():
        jobs_.sort()
        gaps += [nxt[0] - cur[1] for cur, nxt in zip(jobs_, jobs_[1:])]
        cycles += [nxt[0] - cur[0] for cur, nxt in zip(jobs_, jobs_[1:])]
    return gaps, in_horse, cycles


if __name__ == "__main__":
    run_main(main)
