"""A/B of the render pool: two pools side by side, in alternating rounds, on this host.

This machine's speed drifts by several percent from minute to minute, so two separate
runs of bench/render.py cannot tell a 2 % change from noise. Here each side has its own
Redis, PAYRUN_HOME and pdf-render workers (one per core unless told otherwise), all
started at once; the rounds alternate A, B, B, A, A, B ... (each round the real
``start_run`` fan-out of its own companies, 100 slips by default) and the headline is the
median of the per-round-pair ratios B ÷ A. The idle side's workers wait in a blocking
dequeue meanwhile (no CPU).

  .venv/bin/python bench/ab_render.py --a-tree /path/to/old/checkout      # a change
  .venv/bin/python bench/ab_render.py --b-config '[render]\\njobs_per_horse = 1000'
  .venv/bin/python bench/ab_render.py --b-workers 3                       # pool size

A tree is a checkout of payrun (``git worktree add /tmp/base HEAD~1``): its workers run
``python -m payrun.cli worker pdf-render`` from it. The fan-out always runs this tree's
``payrun.runs.start_run`` (the job format both sides read). Ends with one line of JSON,
``ratio`` = median B ÷ A.
"""

from __future__ import annotations

import sys

# bench/email.py would shadow the stdlib's email package: this folder, first on
# sys.path for a script run from it, goes last (where _common is still found)
sys.path.append(sys.path.pop(0))

import argparse
import logging
import subprocess
import time
from pathlib import Path

from _common import (CORES, MONTH, PY, ROOT, Bench, finish, job_times, load_avg, median, r4,  # noqa: E402
                     makespan_rate, proc_cpu_s, run_main, say, seed_payroll)


def start_side(name: str, tree: Path, workers: int, niced: int, config: str, slips: int, companies: int) -> Bench:
    b = Bench(f"ab{name}", config_toml=config.replace("\\n", "\n"))
    b.conn_ = b.start_redis()
    b.db = seed_payroll(b.home, employees=slips, companies=companies)
    env = b.env(PYTHONPATH=str(tree))
    for i in range(workers + niced):
        cmd = [PY, "-m", "payrun.cli", "worker", "pdf-render"]
        if i >= workers:
            cmd = ["nice", "-n", "19", *cmd]
        log = open(b.log_dir / f"render-{i}.log", "ab")
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             cwd=str(tree))
        log.close()
        b.procs.append((f"render-{i}", p))
    return b


def side_cpu_s(b: Bench) -> float:
    """CPU seconds so far of the side's workers (with their horses and RQ scheduler) and
    its Redis."""
    pids = [p.pid for _, p in b.procs]
    return sum(proc_cpu_s(pid, children=True) for pid in pids) + proc_cpu_s(b.redis_proc.pid)


def one_round(b: Bench, companies: list[int]) -> tuple[float, float]:
    """Run these companies' slips through the side's pool: slips/s (first start to last
    end) and CPU seconds per slip of its workers, horses and Redis (from the fan-out to
    the last end: the host's drift moves it less than the rate)."""
    from payrun import runs
    from payrun.ledger import Ledger

    conn = b.conn_
    b.apply_env()
    ledger = Ledger(b.home / "ledger.db")
    done_before = set(conn.zrange("rq:finished:pdf-render", 0, -1))
    cpu0 = side_cpu_s(b)
    n = sum(runs.start_run(b.config(), conn, ledger, b.db, MONTH, company_id=c).jobs for c in companies)
    deadline = time.monotonic() + 120 + n
    while conn.zcard("rq:finished:pdf-render") + conn.zcard("rq:failed:pdf-render") - len(done_before) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"side {b.name}: the round did not finish")
        b.check_alive()
        time.sleep(0.05)
    cpu = (side_cpu_s(b) - cpu0) / n
    if conn.zcard("rq:failed:pdf-render"):
        raise RuntimeError(f"side {b.name}: renders failed; see {b.log_dir}")
    ids = [i.decode() for i in set(conn.zrange("rq:finished:pdf-render", 0, -1)) - done_before]
    rate, _ = makespan_rate(job_times(conn, ids, "started_at"), job_times(conn, ids, "ended_at"))
    return rate, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a-tree", type=Path, default=ROOT, help="checkout side A's workers run (default: this one)")
    ap.add_argument("--b-tree", type=Path, default=ROOT, help="checkout side B's workers run (default: this one)")
    ap.add_argument("--a-workers", type=int, default=CORES)
    ap.add_argument("--b-workers", type=int, default=CORES)
    ap.add_argument("--a-niced", type=int, default=0, help="extra workers at nice 19 on side A")
    ap.add_argument("--b-niced", type=int, default=0, help="extra workers at nice 19 on side B")
    ap.add_argument("--a-config", default="", help="TOML for side A (\\n for new lines)")
    ap.add_argument("--b-config", default="", help="TOML for side B (\\n for new lines)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side (default 8)")
    ap.add_argument("--slips", type=int, default=100, help="slips per round (default 100)")
    ap.add_argument("--quick", action="store_true", help="4 rounds per side")
    a = ap.parse_args()
    rounds = 4 if a.quick else max(1, a.rounds)
    logging.getLogger("weasyprint").setLevel(logging.ERROR)
    for t in (a.a_tree, a.b_tree):
        if not (t / "payrun" / "cli.py").is_file():
            ap.error(f"{t} is not a payrun checkout (no payrun/cli.py)")
    say(f"render A/B: {CORES} cores, load {load_avg()}, {rounds} rounds of {a.slips} slips per side; "
        f"A: {a.a_tree} ({a.a_workers} workers + {a.a_niced} niced) {a.a_config!r}; "
        f"B: {a.b_tree} ({a.b_workers} workers + {a.b_niced} niced) {a.b_config!r}")
    sides: dict[str, Bench] = {}
    try:
        per_company = 50
        companies = rounds * max(1, a.slips // per_company)
        for name, tree, workers, niced, config in (("A", a.a_tree, a.a_workers, a.a_niced, a.a_config),
                                                   ("B", a.b_tree, a.b_workers, a.b_niced, a.b_config)):
            sides[name] = start_side(name, tree.resolve(), workers, niced, config, rounds * a.slips, companies)
        for name, b in sides.items():
            n = (a.a_workers + a.a_niced) if name == "A" else (a.b_workers + a.b_niced)
            say(f"side {name}: {n} workers warm after {b.wait_workers(b.conn_, n):.1f} s")
        per_round = companies // rounds
        rates: dict[str, list[float]] = {"A": [], "B": []}
        cpus: dict[str, list[float]] = {"A": [], "B": []}
        for rnd in range(rounds):
            group = list(range(rnd * per_round + 1, (rnd + 1) * per_round + 1))
            for name in ("AB" if rnd % 2 == 0 else "BA"):
                rate, cpu = one_round(sides[name], group)
                rates[name].append(rate)
                cpus[name].append(cpu)
            say(f"  round {rnd + 1}: A {rates['A'][-1]:.2f} slips/s, B {rates['B'][-1]:.2f} slips/s, "
                f"B/A {rates['B'][-1] / rates['A'][-1]:.3f}; CPU per slip (workers, horses, Redis) "
                f"A {cpus['A'][-1] * 1000:.1f} ms, B {cpus['B'][-1] * 1000:.1f} ms")
        ratios = [b_ / a_ for a_, b_ in zip(rates["A"], rates["B"])]
        ratio = median(ratios)
        say(f"median A {median(rates['A']):.2f} slips/s, B {median(rates['B']):.2f} slips/s; "
            f"B/A median {ratio:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
        cpu_ratios = [b_ / a_ for a_, b_ in zip(cpus["A"], cpus["B"])]
        say(f"CPU per slip: A {median(cpus['A']) * 1000:.1f} ms, B {median(cpus['B']) * 1000:.1f} ms (medians); "
            f"B/A median {median(cpu_ratios):.3f} (rounds {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")
        finish({"bench": "ab_render", "rounds": rounds, "slips_per_round": a.slips,
                "a": {"tree": a.a_tree, "workers": a.a_workers, "niced": a.a_niced, "config": a.a_config,
                      "slips_per_s": [r4(x) for x in rates["A"]]},
                "b": {"tree": a.b_tree, "workers": a.b_workers, "niced": a.b_niced, "config": a.b_config,
                      "slips_per_s": [r4(x) for x in rates["B"]]},
                "round_ratios": [r4(x) for x in ratios], "ratio": r4(ratio),
                "cpu_per_slip_s": {k: [r4(x) for x in v] for k, v in cpus.items()},
                "cpu_ratio": r4(median(cpu_ratios))})
    finally:
        for b in sides.values():
            b.close()


if __name__ == "__main__":
    run_main(main)
