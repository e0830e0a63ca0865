"""Runtime overhead benchmark: a no-op job (jobs.tasks.noop) through payrun's worker
runtime vs bare RQ with the same worker class family, burst mode, one worker process.

  fork:    `payrun worker pdf-render --burst` (RenderWorker: events, retry policy, liveness,
           scheduler; warms WeasyPrint at start, excluded) vs rq.Worker (JSON serializer,
           fork per job, jobs.tasks pre-imported in the parent like payrun's)
  threads: run_lanes(burst=True) with 1 lane (and 45, the default) vs rq.SimpleWorker

Jobs/s between the first and the last completion (RQ's ended_at), CPU per job of the
worker process tree (work horses included) from the first completion to exit.

    python bench/overhead.py [--quick]     (2,000 jobs; --quick 500)

"ratio" = payrun fork jobs/s / bare rq.Worker jobs/s (target >= 0.8), payrun as configured
by default (one warm horse per `render.jobs_per_horse` jobs, 1000); "fork_per_job_ratio" the same with
render.jobs_per_horse = 1, RQ's own execution model.
"""

from __future__ import annotations

import sys

# bench/email.py would shadow the stdlib's email package: this folder, first on
# sys.path for a script run from it, goes last (where _common is still found)
sys.path.append(sys.path.pop(0))

import argparse  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from _common import Bench, finish, job_times, load_avg, proc_cpu_s, r4, run_main, say, span_rate  # noqa: E402

QUEUE = "pdf-render"

BARE_FORK = """
import os, sys, logging, redis
import jobs.tasks  # the parent has the job's module, like payrun's worker
from rq import Queue, Worker
from rq.serializers import JSONSerializer
conn = redis.Redis.from_url(os.environ["PAYRUN_REDIS_URL"])  # (not an argument: ps shows those)
q = Queue(sys.argv[1], connection=conn, serializer=JSONSerializer)
Worker([q], connection=conn, serializer=JSONSerializer).work(burst=True, logging_level="WARNING")
"""
BARE_SIMPLE = BARE_FORK.replace("Worker([q]", "SimpleWorker([q]").replace("import Queue, Worker", "import Queue, SimpleWorker")
LANES = """
import os, sys, logging, redis
logging.basicConfig(level=logging.WARNING)
from jobs.runtime import run_lanes
conn = redis.Redis.from_url(os.environ["PAYRUN_REDIS_URL"])
run_lanes(conn, [sys.argv[1]], lanes=int(sys.argv[2]), burst=True)
"""


def enqueue(conn, n: int, payrun: bool) -> list[str]:
    from rq import Queue, Retry
    from rq.serializers import JSONSerializer

    from jobs.runtime import make_queue

    conn.flushall()
    q = make_queue(QUEUE, conn) if payrun else Queue(QUEUE, connection=conn, serializer=JSONSerializer)
    ids = [f"noop-{i:06d}" for i in range(n)]
    for i in range(0, n, 1000):
        with conn.pipeline() as pipe:
            q.enqueue_many([
                q.prepare_data("jobs.tasks.noop", args=(i,), job_id=jid, timeout=30,
                               retry=Retry(max=5) if payrun else None,
                               meta={"kind": "noop", "retry": {"base_s": 1.0, "cap_s": 300.0, "attempts": 6}}
                               if payrun else None)
                for jid in ids[i:i + 1000]
            ], pipeline=pipe)
            pipe.execute()
    return ids


def run_one(b: Bench, conn, label: str, n: int, payrun: bool, args: list[str], module: bool,
            env: dict[str, str] | None = None) -> dict:
    ids = enqueue(conn, n, payrun)
    p = b.spawn(label, args, env=env, module=module)
    c1 = n1 = None
    rusage = None
    deadline = time.monotonic() + 120 + n * 0.2
    while True:
        done = conn.zcard(f"rq:finished:{QUEUE}")
        if c1 is None and done > 0:
            c1, n1 = proc_cpu_s(p.pid, children=True), done
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            rusage = ru
            p.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label}: not done ({done}/{n})")
        time.sleep(0.05)
    done = conn.zcard(f"rq:finished:{QUEUE}")
    if p.returncode != 0:
        say(f"{label}: exited {p.returncode}; log ends:\n{b.log_tail(label)}")
    failed = conn.zcard(f"rq:failed:{QUEUE}")
    total_cpu = rusage.ru_utime + rusage.ru_stime
    cpu_per_job = (total_cpu - c1) / max(1, done - n1) if c1 is not None else float("nan")
    rate, span = span_rate(job_times(conn, ids, "ended_at"))
    say(f"{label:>24}: {rate:8.1f} jobs/s over {span:5.1f} s; {cpu_per_job * 1000:6.2f} ms CPU/job; "
        f"{done} done, {failed} failed; exit {p.returncode}")
    return {"jobs_per_s": r4(rate), "span_s": r4(span), "cpu_ms_per_job": r4(cpu_per_job * 1000),
            "done": done, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args()
    n = a.jobs or (500 if a.quick else 2000)
    with Bench("overhead") as b:
        say(f"overhead bench: {n} no-op jobs per worker kind, one worker process each, load {load_avg()}")
        conn = b.start_redis()
        b.apply_env()
        res = {}
        # bare and payrun alternate so that noise hits both alike
        res["bare_fork"] = run_one(b, conn, "bare rq.Worker (fork)", n, False, ["-c", BARE_FORK, QUEUE], False)
        res["payrun_fork"] = run_one(b, conn, "payrun RenderWorker", n, True, ["worker", QUEUE, "--burst"], True)
        # like for like with RQ's execution model: a fork per job (render.jobs_per_horse = 1)
        fork_conf = b.dir / "fork-per-job.toml"
        fork_conf.write_text("[render]\njobs_per_horse = 1\n")
        res["payrun_fork_per_job"] = run_one(b, conn, "payrun, fork per job", n, True, ["worker", QUEUE, "--burst"],
                                             True, env=dict(b.env(), PAYRUN_CONFIG=str(fork_conf)))
        res["bare_simple"] = run_one(b, conn, "bare rq.SimpleWorker", n, False, ["-c", BARE_SIMPLE, QUEUE], False)
        res["payrun_lanes_1"] = run_one(b, conn, "payrun run_lanes x1", n, True, ["-c", LANES, QUEUE, "1"], False)
        res["payrun_lanes_45"] = run_one(b, conn, "payrun run_lanes x45", n, True, ["-c", LANES, QUEUE, "45"], False)
        ratio = res["payrun_fork"]["jobs_per_s"] / res["bare_fork"]["jobs_per_s"]
        lanes_ratio = res["payrun_lanes_1"]["jobs_per_s"] / res["bare_simple"]["jobs_per_s"]
        fpj_ratio = res["payrun_fork_per_job"]["jobs_per_s"] / res["bare_fork"]["jobs_per_s"]
        say(f"fork:    payrun (default: a warm horse, render.batch 16) / bare = {ratio:.3f} (target >= 0.8); CPU/job "
            f"{res['payrun_fork']['cpu_ms_per_job']:.1f} vs {res['bare_fork']['cpu_ms_per_job']:.1f} ms")
        say(f"fork:    payrun with a fork per job, like RQ / bare = {fpj_ratio:.3f}; CPU/job "
            f"{res['payrun_fork_per_job']['cpu_ms_per_job']:.1f} vs {res['bare_fork']['cpu_ms_per_job']:.1f} ms")
        say(f"threads: payrun 1 lane / SimpleWorker = {lanes_ratio:.3f}; CPU/job "
            f"{res['payrun_lanes_1']['cpu_ms_per_job']:.1f} vs {res['bare_simple']['cpu_ms_per_job']:.1f} ms; "
            f"45 lanes: {res['payrun_lanes_45']['jobs_per_s']:.0f} jobs/s")
        finish({"bench": "overhead", "quick": a.quick, "jobs": n, "ratio": r4(ratio),
                "fork_per_job_ratio": r4(fpj_ratio), "lanes_ratio": r4(lanes_ratio), "target": ">= 0.8", **res})


if __name__ == "__main__":
    run_main(main)
