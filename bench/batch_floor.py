"""Batching's floor: would a render worker that takes K jobs at a time reach 0.90 of the CPU limit?

    python bench/batch_floor.py [--quick] [--rounds N] [--slips N] [--ks 1,4,16,16o]

A measurement for a decision (session 44), not a benchmark with a target of its own. In
alternating rounds of one run, each variant's slips/s is compared with the CPU limit
(cores ÷ the mean of lone warm renders timed just before and just after it, as
bench/render.py does; a bracket is shared by the variants either side of it):

(a) ``pool``: the real pool, one ``payrun worker pdf-render`` per core fed by
    ``payrun.runs.start_run`` (as bench/render.py);
(b) ``bare``: one forked warm process per core rendering its half of the slips and writing
    each durably as the product does (``jobs.slip.write_slip`` with the store check:
    stage 0600, fsync, rename, fsync of the folder); no Redis: the ceiling of (c);
(c) ``batch K``: one forked warm process per core, against its own Redis holding the real
    render jobs (``start_run``), looping:
      1. take: one Lua script moves up to K ids from the queue into its intermediate list
         and returns their hashes (the product's take script, K times over; the
         suspension and drain checks once);
      2. start: one MULTI for the K, per job what the product's start transaction writes:
         RQ's execution record (HSET + EXPIRE), the job's executions set (ZADD + EXPIRE),
         the started (wip) registry entry, the job hash (status started, started_at,
         last_heartbeat, worker_name, meta with the attempt counted), PERSIST, the ledger's
         ``running`` event (XADD), LREM from the intermediate list; once per batch the
         worker's hash (state, current job, heartbeat, EXPIRE);
      3. per job: the job decoded as the horse decodes it (``PayrunJob.restore``, its
         args), ``jobs.tasks.slip_relpath``, ``jobs.slip.render_pdf`` (the call the horse's
         ``render_slip`` makes) and ``jobs.slip.write_slip`` into the slip store with the
         store check (the durable write the worker parent does: two fsyncs per slip);
      4. finish: one MULTI for the K, per job: the job hash (status finished, ended_at,
         last_heartbeat), RQ's result entry (XADD ``rq:results:<id>`` + EXPIRE), the
         finished registry ZADD, EXPIRE of the job, DEL of the execution record, ZREM
         from the wip registry and the executions set, the ledger's ``done`` event
         (XADD), and the send's enqueue: the product's own one-job script
         (``payrun.bulk.OneEnqueuer``'s, via EVALSHA inside the MULTI: EXISTS, the
         ``queued`` event XADD, SADD, the send job's full RQ hash, RPUSH) with the
         arguments ``jobs.tasks.enqueue_email`` builds; once per batch the worker's
         counters (HINCRBY, HINCRBYFLOAT);
      5. the three INFO log lines per slip a render worker writes (running, queued, done),
         through ``payrun.logs.setup``'s handler into the process's own log file.

What (c) does NOT do, so its figure is a floor of what batching's Redis and disk work
allows, not of a worker one could ship: no horse (the render runs in the process that
talks to Redis: no pipe hand-over, no second fetch of the job, no deadline monitor, no
way to kill a hung render), no RQ ``Worker``/``Job`` methods (the records are written by
hand, only the fields that change: RQ's success rewrites the whole job hash, data
included), no liveness thread, no RQ scheduler process, no worker registration
(``rq:workers``), no check of the dependents key, no store-room check, and no handling
of any failure (a failed render or write would leave its batch started; none fails here).
It does not overlap the fsyncs with the next render (the product's worker parent does
them while its horse renders): the write's wall time is printed per slip. Variant
``batch16o`` (``--ks 16o``) does: each slip is only staged after its render
(``jobs.slip.stage_slip``, as the horse does), and a thread of the same process makes
the batch durable (``jobs.slip.commit_slip`` per slip) and runs step 4 while the loop
takes and renders the next batch (at most one batch behind). The reply of
the send's script (0: the send existed) is not looked at. Each (b) and (c) process is
forked from this warm process per round and pays one fresh fork's page copies in its
first render, as the product's horse does once per ``render.jobs_per_horse`` (100) jobs.

Rates: ``makespan`` = slips ÷ (first start → last end), as bench/render.py; ``busy`` =
the sum over processes (workers, for the pool) of its slips ÷ its own first start → last
end: it leaves out each round's drain, which with K = 16 is up to one batch (~0.7 s) of
one process waiting for the other, paid once by a 50,000-slip run but each round here.
The headline ``ratio`` is the median over rounds of batch K=16's busy ratio; every
variant's median ratio, both ways, and the per-round (c) ÷ (a) are printed and in the
JSON, with (for (b) and (c)) the share of each process's busy time spent inside
``render_pdf``, which the host's drift moves little. CPU per slip: the pool's worker processes and their children (horses, RQ's
scheduler), (b)/(c)'s processes, and each side's Redis.
"""

from __future__ import annotations

import sys

# bench/email.py would shadow the stdlib's email package: this folder, first on
# sys.path for a script run from it, goes last (where _common is still found)
sys.path.append(sys.path.pop(0))

import argparse
import base64
import json
import logging
import os
import time
import uuid
from pathlib import Path

from _common import (CORES, MONTH, Bench, _in_warm_forks, finish, job_times, load_avg, makespan_rate, mean,  # noqa: E402
                     median, proc_cpu_s, r4, run_main, say, seed_payroll, warm_render_times)

# The take is the product's own since session 45 (jobs.runtime.RenderWorker._TAKE_K, up to
# K jobs and no more than a worker's share of those waiting: these processes are no
# registered workers, so the share is all of them). Returns {id, hash, id, hash, ...}.

PHASES = ("take", "start", "decode", "render", "write", "commit", "finish", "log", "wait")


def batched_loop(redis_url: str, k: int, log_path: Path, overlap: bool = False) -> dict:
    """Variant (c), in a forked warm process: take up to ``k`` jobs, start them, render and
    write each, finish them, until the queue is empty. Returns its figures.

    ``overlap``: the slips are only staged after their render (``jobs.slip.stage_slip``, as
    the horse does), and a thread of this process makes each batch durable
    (``jobs.slip.commit_slip`` per slip: fsync, rename, fsync of the folder) and finishes
    it (the same transaction) while the loop takes and renders the next batch: the
    product's overlap of the syncs with the next render (its worker parent does them
    while its horse renders), at most one batch behind."""
    t_fork = time.monotonic()
    import queue as queue_mod
    import threading

    import redis
    from rq.suspension import WORKERS_SUSPENDED
    from rq.utils import now as utcnow, utcformat

    from jobs import events, slip, tasks
    from jobs.runtime import PayrunJob, make_queue
    from payrun import keys, logs

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logs.setup("INFO")
    conn = redis.Redis.from_url(redis_url, socket_timeout=60)
    cfg = tasks.settings()
    queue = make_queue(keys.RENDER_QUEUE, conn)
    wip, fin = queue.started_job_registry.key, queue.finished_job_registry.key
    from jobs.runtime import RenderWorker

    take = conn.register_script(RenderWorker._TAKE_K)
    enq = tasks._email_enqueuer(conn, cfg)
    if enq is None:
        raise RuntimeError("this RQ's enqueue cannot be repeated by payrun.bulk: no one-script send enqueue")
    conn.script_load(enq._script.script)
    # the finishing thread's own connection (a redis-py connection pool is thread-safe too)
    fconn = redis.Redis.from_url(redis_url, socket_timeout=60) if overlap else conn
    worker = f"batch.{os.uname().nodename}.{os.getpid()}"
    wkey = f"rq:worker:{worker}"
    prefix = PayrunJob.redis_job_namespace_prefix
    ph = dict.fromkeys(PHASES, 0.0)
    done = batches = 0
    first = None
    last = [time.monotonic()]

    def finish_batch(out: list) -> None:
        """The batch made durable (with ``overlap``) and finished: one transaction for the K."""
        nonlocal done, batches
        t3 = time.perf_counter()
        if overlap:
            for job, rel, size, payload, staged in out:
                slip.commit_slip(staged, cfg.slips_dir / rel)
        t4 = time.perf_counter()
        ended = utcnow()
        ts = utcformat(ended)
        now_s = time.time()
        sends = []
        with fconn.pipeline() as pipe:
            for job, rel, size, payload, _ in out:
                pipe.hset(job.key, mapping={"status": "finished", "ended_at": ts, "last_heartbeat": ts})
                rkey = f"rq:results:{job.id}"
                ret = base64.encodebytes(json.dumps({"slip": rel, "bytes": size}).encode()).decode()
                pipe.xadd(rkey, {"type": 1, "worker_name": worker, "return_value": ret, "execution_id": job._eid,
                                 "execution_started_at": job._t0, "execution_ended_at": now_s},
                          maxlen=10, approximate=True)
                pipe.expire(rkey, 86400)
                pipe.zadd(fin, {job.id: now_s + 86400})
                pipe.xadd(keys.EVENTS_STREAM, events.event(job.id, "done", attempt=job.meta["attempt"]))
                pipe.expire(job.key, 86400)
                pipe.delete(f"rq:execution:{job.id}:{job._eid}")
                pipe.zrem(wip, f"{job.id}:{job._eid}")
                pipe.zrem(f"rq:executions:{job.id}", job._eid)
                sends.append(tasks.enqueue_email_in(pipe, fconn, cfg, payload))  # (the product's, since session 45)
            pipe.hincrby(wkey, "successful_job_count", len(out))
            pipe.hincrbyfloat(wkey, "total_working_time", now_s - out[0][0]._t0)
            pipe.execute()
        t5 = time.perf_counter()
        for (job, *_), (send_id, fields) in zip(out, sends):
            events.log_emitted(send_id, "queued", **fields)
            events.log_emitted(job.id, "done", duration_s=now_s - job._t0, attempt=job.meta["attempt"])
        ph["commit"] += t4 - t3
        ph["finish"] += t5 - t4
        ph["log"] += time.perf_counter() - t5
        last[0] = time.monotonic()
        done += len(out)
        batches += 1

    handed: "queue_mod.Queue[list | None]" = queue_mod.Queue(maxsize=1)
    failed: list[BaseException] = []

    def finisher() -> None:
        while (out := handed.get()) is not None:
            try:
                finish_batch(out)
            except BaseException as e:  # noqa: BLE001 - reported by the loop
                failed.append(e)
                return

    thread = threading.Thread(target=finisher, daemon=True) if overlap else None
    if thread is not None:
        thread.start()
    while not failed:
        t = time.perf_counter()
        t_take = time.monotonic()
        got = take(keys=[keys.PAUSED_QUEUES, WORKERS_SUSPENDED, queue.key, queue.intermediate_queue_key,
                         f"rq:workers:{queue.name}"],
                   args=[queue.name, prefix, k])
        if not got:
            break
        if first is None:
            first = t_take
        jobs = []
        for i in range(0, len(got), 2):
            job = PayrunJob(got[i].decode(), connection=conn)
            flat = got[i + 1]
            job.restore(dict(zip(flat[::2], flat[1::2])))
            jobs.append(job)
        t1 = time.perf_counter()
        ph["take"] += t1 - t
        # start: the K in one transaction
        ts = utcformat(utcnow())
        now_s = time.time()
        ttl = 61 + 30 * len(jobs)  # the lease covers the batch (RQ: the job's timeout + 31 s)
        with conn.pipeline() as pipe:
            for job in jobs:
                job.meta["attempt"] = int(job.meta.get("attempt", 0)) + 1
                job._eid = uuid.uuid4().hex
                job._t0 = now_s
                ekey = f"rq:execution:{job.id}:{job._eid}"
                pipe.hset(ekey, mapping={"id": job._eid, "created_at": now_s, "last_heartbeat": now_s,
                                         "worker_name": worker})
                pipe.expire(ekey, ttl)
                pipe.zadd(f"rq:executions:{job.id}", {job._eid: now_s + ttl})
                pipe.expire(f"rq:executions:{job.id}", ttl + 60)
                pipe.zadd(wip, {f"{job.id}:{job._eid}": now_s + ttl})
                pipe.hset(job.key, mapping={"last_heartbeat": ts, "status": "started", "started_at": ts,
                                            "worker_name": worker, "meta": json.dumps(job.meta)})
                pipe.persist(job.key)
                pipe.xadd(keys.EVENTS_STREAM, events.event(job.id, "running", attempt=job.meta["attempt"],
                                                           worker=worker))
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.hset(wkey, mapping={"state": "busy", "current_job": jobs[0].id, "last_heartbeat": ts})
            pipe.expire(wkey, 480)
            pipe.execute()
        t2 = time.perf_counter()
        ph["start"] += t2 - t1
        for job in jobs:
            events.log_emitted(job.id, "running", attempt=job.meta["attempt"], worker=worker)
        ph["log"] += time.perf_counter() - t2
        out = []
        for job in jobs:
            a = time.perf_counter()
            snapshot = job.args[0]
            rel = tasks.slip_relpath(snapshot["month"], snapshot["company"]["id"], snapshot["employee"]["id"])
            b = time.perf_counter()
            pdf = slip.render_pdf(snapshot)
            c = time.perf_counter()
            staged = None
            if overlap:
                staged = slip.stage_slip(cfg.slips_dir / rel, pdf, store=cfg.slips_dir)
            else:
                slip.write_slip(cfg.slips_dir / rel, pdf, store=cfg.slips_dir)
            d = time.perf_counter()
            ph["decode"] += b - a
            ph["render"] += c - b
            ph["write"] += d - c
            out.append((job, rel, len(pdf), tasks.email_payload(snapshot, rel), staged))
        if overlap:
            w0 = time.perf_counter()
            handed.put(out)  # waits while the batch before is still being finished
            ph["wait"] += time.perf_counter() - w0
        else:
            finish_batch(out)
    if thread is not None:
        handed.put(None)
        thread.join()
    if failed:
        raise failed[0]
    for h in logging.getLogger().handlers:
        h.flush()
    return {"n": done, "batches": batches, "first": first if first is not None else t_fork,
            "fork": t_fork, "last": last[0], "cpu": time.process_time(), "phases": ph}


def bare_loop(snapshots: list[dict], store: Path) -> dict:
    """Variant (b), in a forked warm process: render and write each slip durably."""
    t_fork = time.monotonic()
    from jobs import slip, tasks

    ph = dict.fromkeys(PHASES, 0.0)
    for s in snapshots:
        rel = tasks.slip_relpath(s["month"], s["company"]["id"], s["employee"]["id"])
        b = time.perf_counter()
        pdf = slip.render_pdf(s)
        c = time.perf_counter()
        slip.write_slip(store / rel, pdf, store=store)
        ph["render"] += c - b
        ph["write"] += time.perf_counter() - c
    return {"n": len(snapshots), "batches": 0, "first": t_fork, "fork": t_fork, "last": time.monotonic(),
            "cpu": time.process_time(), "phases": ph}


def in_forks(work) -> tuple[list[dict], float]:
    """``work(p) -> dict`` in one warm forked process per core (bench._common._in_warm_forks)."""
    outs, failed, elapsed = _in_warm_forks(CORES, lambda p: json.dumps(work(p)).encode())
    if failed:
        raise RuntimeError(f"{failed} of {CORES} forked processes failed")
    return [json.loads(o) for o in outs], elapsed


def render_share(stats: list[dict]) -> float:
    """The share of the forked processes' busy time (first take -> last end) spent inside
    render_pdf: what the job's other work leaves of a core, free of the host's drift
    (which moves the render and the rest alike); times the parallel render's speed
    against a lone one, it is the busy ratio."""
    return sum(s["phases"]["render"] for s in stats) / sum(s["last"] - s["first"] for s in stats)


def forks_rates(stats: list[dict]) -> tuple[float, float]:
    """(makespan slips/s, busy slips/s) of forked processes' figures: makespan from the first
    fork to the last end; busy per process from its first take (after its connection and
    logging are set up, once per process in a real worker) to its last end."""
    n = sum(s["n"] for s in stats)
    span = max(s["last"] for s in stats) - min(s["fork"] for s in stats)
    busy = sum(s["n"] / (s["last"] - s["first"]) for s in stats if s["n"] and s["last"] > s["first"])
    return n / span, busy


def redis_counts(conn) -> dict[str, int]:
    """What (c) leaves per slip, counted: finished renders, queued sends, ledger events, the
    started registry and intermediate list (empty after a round), slips in the store."""
    from jobs import tasks

    return {"finished": conn.zcard("rq:finished:pdf-render"), "sends": conn.llen("rq:queue:send-email"),
            "events": conn.xlen("payrun:events"), "wip": conn.zcard("rq:wip:pdf-render"),
            "intermediate": conn.llen("rq:queue:pdf-render:intermediate"),
            "slips": sum(1 for _ in tasks.settings().slips_dir.rglob("*.pdf"))}


def pool_busy_rate(conn, ids: list[str]) -> float:
    """The pool's busy rate: per worker, its slips ÷ its first started_at → its last ended_at, summed."""
    from _common import parse_ts

    per: dict[str, list[tuple[float, float]]] = {}
    with conn.pipeline(transaction=False) as p:
        for jid in ids:
            p.hmget(f"rq:job:{jid}", "worker_name", "started_at", "ended_at")
        for w, s, e in p.execute():
            if w and s and e:
                per.setdefault(w.decode(), []).append((parse_ts(s), parse_ts(e)))
    return sum(len(v) / (max(e for _, e in v) - min(s for s, _ in v)) for v in per.values() if len(v) > 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 96 slips")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 7; quick 3)")
    ap.add_argument("--slips", type=int, default=None, help="slips per variant per round (default 192; quick 96)")
    ap.add_argument("--ks", default="1,4,16,16o",
                    help="batch sizes of (c); a trailing o: the syncs and the finish overlap the next batch's "
                         "renders (default 1,4,16,16o)")
    ap.add_argument("--no-pool", action="store_true", help="leave out (a) (development)")
    a = ap.parse_args()
    rounds = max(1, a.rounds or (3 if a.quick else 7))
    slips = a.slips or (96 if a.quick else 192)
    specs = [x.strip() for x in a.ks.split(",") if x.strip()]
    ks = [int(x.rstrip("o")) for x in specs]
    variants = ([] if a.no_pool else ["pool"]) + ["bare"] + [f"batch{x}" for x in specs]
    n_bracket = 8 if a.quick else 12
    logging.getLogger("weasyprint").setLevel(logging.ERROR)

    with Bench("bfa") as side_a, Bench("bfc") as side_c:
        load0 = load_avg()
        say(f"batch floor: {CORES} cores, load {load0}, {rounds} rounds x {len(variants)} variants "
            f"({', '.join(variants)}) x ~{slips} slips, brackets of {n_bracket} lone renders")
        conn_a, conn_c = side_a.start_redis(), side_c.start_redis()
        per_company = 48
        companies = rounds * len(variants) * max(1, slips // per_company)
        t = time.monotonic()
        db_a = seed_payroll(side_a.home, employees=rounds * len(variants) * slips, companies=companies)
        db_c = seed_payroll(side_c.home, employees=rounds * len(variants) * slips, companies=companies)
        from payrun import payroll, runs
        from payrun.ledger import Ledger

        snaps = list(payroll.snapshots(db_a, MONTH))
        say(f"seeded {len(snaps)} employees in {companies} companies twice in {time.monotonic() - t:.1f} s")
        by_company: dict[int, list[dict]] = {}
        for s in snaps:
            by_company.setdefault(int(s["company"]["id"]), []).append(s)
        groups: list[tuple[list[int], list[dict]]] = [([], []) for _ in range(rounds * len(variants))]
        for company, ss in sorted(by_company.items(), key=lambda kv: -len(kv[1])):
            smallest = min(groups, key=lambda g: len(g[1]))
            smallest[0].append(company)
            smallest[1].extend(ss)
        sizes = [len(g[1]) for g in groups]
        say(f"{len(groups)} groups of companies, {min(sizes)}-{max(sizes)} slips each (one per variant and round)")
        ledger_a, ledger_c = Ledger(side_a.home / "ledger.db"), Ledger(side_c.home / "ledger.db")
        bare_store = side_c.home / "bare-store"
        bare_store.mkdir(mode=0o700)

        workers = []
        if "pool" in variants:
            workers = [side_a.spawn(f"render-{i}", ["worker", "pdf-render"]) for i in range(CORES)]
            say(f"{CORES} pdf-render workers warm after {side_a.wait_workers(conn_a, CORES):.1f} s "
                f"(a horse serves {side_a.config().render.jobs_per_horse} jobs)")
        from jobs import slip

        slip.tune_gc()
        slip.tune_malloc()
        slip.warm_up()
        bracket_no = [0]

        lone_cpu: list[float] = []

        def bracket() -> float:
            """The mean of lone warm renders in this process (a different spread sample each time)."""
            j = bracket_no[0]
            bracket_no[0] += 1
            step = max(1, len(snaps) // n_bracket)
            sample = snaps[(j * 7) % step::step][:n_bracket]
            c0 = time.process_time()
            wall = mean(warm_render_times(n_bracket, sample))
            lone_cpu.append((time.process_time() - c0) / n_bracket)
            return wall

        rows: list[dict] = []
        lone = bracket()
        for rnd in range(rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for vi, v in enumerate(order):
                companies_v, ss = groups[rnd * len(variants) + variants.index(v)]
                row = {"round": rnd + 1, "variant": v, "slips": len(ss), "load": load_avg()}
                idle0, idle_t0 = sum(proc_cpu_s(w.pid, children=True) for w in workers), time.monotonic()
                if v == "pool":
                    side_a.apply_env()
                    cpu0 = sum(proc_cpu_s(w.pid, children=True) for w in workers)
                    par0 = sum(proc_cpu_s(w.pid) for w in workers)
                    r0 = proc_cpu_s(side_a.redis_proc.pid)
                    fin0 = conn_a.zcard("rq:finished:pdf-render")
                    n = sum(runs.start_run(side_a.config(), conn_a, ledger_a, db_a, MONTH, company_id=c).jobs
                            for c in companies_v)
                    deadline = time.monotonic() + 120 + n
                    while conn_a.zcard("rq:finished:pdf-render") - fin0 < n:
                        if conn_a.zcard("rq:failed:pdf-render"):
                            raise RuntimeError(f"pool renders failed; see {side_a.log_dir}")
                        if time.monotonic() > deadline:
                            raise RuntimeError("a pool round did not finish")
                        side_a.check_alive()
                        time.sleep(0.05)
                    time.sleep(0.1)  # the parents' last finish and the horses' idle turn
                    ids = [f"render-{MONTH}-{s['employee']['id']}" for s in ss]
                    rate, _ = makespan_rate(job_times(conn_a, ids, "started_at"), job_times(conn_a, ids, "ended_at"))
                    busy = pool_busy_rate(conn_a, ids)
                    row.update(cpu_s=(sum(proc_cpu_s(w.pid, children=True) for w in workers) - cpu0) / n,
                               parent_cpu_s=(sum(proc_cpu_s(w.pid) for w in workers) - par0) / n,
                               redis_cpu_s=(proc_cpu_s(side_a.redis_proc.pid) - r0) / n)
                elif v == "bare":
                    halves = [ss[p::CORES] for p in range(CORES)]
                    stats, _ = in_forks(lambda p: bare_loop(halves[p], bare_store))
                    rate, busy = forks_rates(stats)
                    n = sum(s["n"] for s in stats)
                    row.update(cpu_s=sum(s["cpu"] for s in stats) / n, render_share=render_share(stats),
                               phases_ms={k_: 1000 * sum(s["phases"][k_] for s in stats) / n for k_ in PHASES})
                else:
                    spec = v[len("batch"):]
                    k, overlap = int(spec.rstrip("o")), spec.endswith("o")
                    side_c.apply_env()
                    n = sum(runs.start_run(side_c.config(), conn_c, ledger_c, db_c, MONTH, company_id=c).jobs
                            for c in companies_v)
                    before_c = redis_counts(conn_c)
                    r0 = proc_cpu_s(side_c.redis_proc.pid)
                    url = side_c.redis_url
                    stats, _ = in_forks(lambda p: batched_loop(url, k, side_c.log_dir / f"batch{spec}-{rnd}-{p}.log",
                                                                  overlap))
                    rate, busy = forks_rates(stats)
                    got = sum(s["n"] for s in stats)
                    if got != n or conn_c.llen("rq:queue:pdf-render"):
                        raise RuntimeError(f"batch {k}: {got} of {n} slips done")
                    grew = {key: x - before_c[key] for key, x in redis_counts(conn_c).items()}
                    want = {"finished": n, "sends": n, "events": 3 * n, "wip": 0, "intermediate": 0, "slips": n}
                    if grew != want:  # the records a real worker leaves: as many as the slips
                        raise RuntimeError(f"batch {k}: Redis records grew by {grew}, not {want}")
                    with conn_c.pipeline(transaction=False) as p_:
                        for s_ in ss:
                            p_.hget(f"rq:job:render-{MONTH}-{s_['employee']['id']}", "status")
                        if set(p_.execute()) != {b"finished"}:
                            raise RuntimeError(f"batch {k}: a render job is not finished")
                    row.update(cpu_s=sum(s["cpu"] for s in stats) / n, render_share=render_share(stats),
                               redis_cpu_s=(proc_cpu_s(side_c.redis_proc.pid) - r0) / n,
                               batches=sum(s["batches"] for s in stats),
                               phases_ms={k_: 1000 * sum(s["phases"][k_] for s in stats) / n for k_ in PHASES})
                if v != "pool" and workers:  # what the idle pool (its workers, horses, schedulers) took meanwhile
                    row["pool_idle_cores"] = ((sum(proc_cpu_s(w.pid, children=True) for w in workers) - idle0)
                                              / (time.monotonic() - idle_t0))
                before, after = lone, bracket()
                lone = after
                limit = CORES / ((before + after) / 2)
                row.update(lone_before_s=r4(before), lone_after_s=r4(after), slips_per_s=r4(rate),
                           busy_slips_per_s=r4(busy), ratio=r4(rate / limit), ratio_busy=r4(busy / limit))
                rows.append(row)
                extra = ""
                if "phases_ms" in row:
                    extra = (f"; in render_pdf {row['render_share']:.3f} of the busy time; per slip ms: "
                             + " ".join(f"{k_} {x:.2f}" for k_, x in row["phases_ms"].items() if x >= 0.005))
                say(f"  round {rnd + 1} {v:>8}: {row['slips']} slips, {rate:.2f}/s (busy {busy:.2f}/s); lone "
                    f"{before * 1000:.1f} / {after * 1000:.1f} ms -> ratio {row['ratio']:.3f}, busy "
                    f"{row['ratio_busy']:.3f}; CPU {row['cpu_s'] * 1000:.1f} ms/slip"
                    + (f" (worker parents {row['parent_cpu_s'] * 1000:.1f})" if "parent_cpu_s" in row else "")
                    + (f" + Redis {row['redis_cpu_s'] * 1000:.2f}" if "redis_cpu_s" in row else "")
                    + f"; load {row['load']}{extra}")

        for w in workers:
            side_a.stop(w)
        summary: dict[str, dict] = {}
        for v in variants:
            vr = [r for r in rows if r["variant"] == v]
            summary[v] = {"ratio": r4(median([r["ratio"] for r in vr])),
                          "ratio_busy": r4(median([r["ratio_busy"] for r in vr])),
                          "ratio_busy_min": r4(min(r["ratio_busy"] for r in vr)),
                          "ratio_busy_max": r4(max(r["ratio_busy"] for r in vr)),
                          "cpu_ms_per_slip": r4(1000 * median([r["cpu_s"] for r in vr])),
                          "rounds_busy": [r4(r["ratio_busy"]) for r in vr]}
            if "parent_cpu_s" in vr[0]:
                summary[v]["parent_cpu_ms_per_slip"] = r4(1000 * median([r["parent_cpu_s"] for r in vr]))
            if "redis_cpu_s" in vr[0]:
                summary[v]["redis_cpu_ms_per_slip"] = r4(1000 * median([r["redis_cpu_s"] for r in vr]))
            if "render_share" in vr[0]:
                summary[v]["render_share"] = r4(median([r["render_share"] for r in vr]))
            if "phases_ms" in vr[0]:
                summary[v]["phases_ms"] = {k_: r4(median([r["phases_ms"][k_] for r in vr])) for k_ in PHASES}
        lone_all = [r["lone_before_s"] for r in rows]
        idle = [r["pool_idle_cores"] for r in rows if "pool_idle_cores" in r]
        if idle:
            say(f"the idle pool's CPU while the other variants ran: {median(idle):.4f} cores (median; max "
                f"{max(idle):.4f})")
        say(f"lone warm render (bracket means): {min(lone_all) * 1000:.1f}-{max(lone_all) * 1000:.1f} ms, "
            f"median {median(lone_all) * 1000:.1f} ms, CPU {median(lone_cpu) * 1000:.1f} ms (median of the brackets); "
            f"load at start {load0}, at end {load_avg()}")
        for v, s in summary.items():
            say(f"{v:>8}: ratio (makespan) {s['ratio']:.3f}, busy {s['ratio_busy']:.3f} (rounds "
                f"{s['ratio_busy_min']:.3f}-{s['ratio_busy_max']:.3f}); CPU {s['cpu_ms_per_slip']:.1f} ms/slip"
                + (f" (worker parents {s['parent_cpu_ms_per_slip']:.1f})" if "parent_cpu_ms_per_slip" in s else "")
                + (f" + Redis {s['redis_cpu_ms_per_slip']:.2f}" if "redis_cpu_ms_per_slip" in s else "")
                + (f"; in render_pdf {s['render_share']:.3f} of the busy time" if "render_share" in s else "")
                + (f"; per slip ms: " + " ".join(f"{k_} {x:.2f}" for k_, x in s["phases_ms"].items() if x >= 0.005)
                   if "phases_ms" in s else ""))
        paired = {}
        if "pool" in variants:
            for v in variants:
                if v == "pool":
                    continue
                per_round = []
                for rnd in range(1, rounds + 1):
                    p_ = next(r for r in rows if r["round"] == rnd and r["variant"] == "pool")
                    q_ = next(r for r in rows if r["round"] == rnd and r["variant"] == v)
                    per_round.append(q_["ratio_busy"] / p_["ratio_busy"])
                paired[v] = r4(median(per_round))
            say("per round, busy ratio over the pool's (median): "
                + ", ".join(f"{v} {x:.3f}" for v, x in paired.items()))
        plain = [int(x) for x in specs if not x.endswith("o")]
        head = f"batch{max(plain)}" if plain else "bare"
        finish({"bench": "batch_floor", "quick": a.quick, "cores": CORES, "load_at_start": load0,
                "load_at_end": load_avg(), "rounds": rounds, "slips_per_variant_round": slips, "ks": specs,
                "lone_render_median_s": r4(median(lone_all)), "lone_render_cpu_median_s": r4(median(lone_cpu)),
                "pool_idle_cores": r4(median(idle)) if idle else None,
                "variants": summary, "vs_pool_busy": paired,
                "round_rows": rows, "ratio_makespan": summary[head]["ratio"],
                "ratio": summary[head]["ratio_busy"], "headline": f"{head} busy ratio", "target": ">= 0.90"})


if __name__ == "__main__":
    run_main(main)
