"""Email benchmark: N pre-rendered slips (one real PDF copied to N slip-store paths) sent
by `payrun worker send-email` (default config: 50 lanes, email_concurrency 50, 40/s)
through the local provider in its own process (latency 1.2 s, limit 40/s).

Then the same with the seed's email_concurrency = 45 and 45 lanes (--cap): 45 in flight
x 1.2 s can only reach 37.5/s, 0.94 of the limit, whatever the rate limiter does.

    python bench/email.py [--quick]        (2,000 slips; --quick 600)

Figures per variant: sustained sends/s between 10% and 90% of deliveries (provider's
accepted_at times) / 40 -> "ratio" (headline: the default config), HTTP 429s, CPU-seconds
and peak RSS of the sending worker, CPU cores used = CPU-seconds / wall seconds.
Targets: >= 97% of the limit, zero 429s, sending workers <= 0.25 core.
"""

from __future__ import annotations

import sys

# bench/email.py would shadow the stdlib's email package: this folder, first on
# sys.path for a script run from it, goes last (where _common is still found)
sys.path.append(sys.path.pop(0))

import argparse
import json
import shutil
import time
from pathlib import Path

from _common import (MONTH, Bench, finish, load_avg, peak_rss_mb, proc_cpu_s, r4, run_main, say,  # noqa: E402
                     seed_payroll)

LATENCY_S = 1.2
RATE = 40.0


def one_pdf() -> bytes:
    import logging

    logging.getLogger("weasyprint").setLevel(logging.ERROR)
    from jobs import slip

    return slip.render_pdf(slip.SAMPLE_SNAPSHOT)


def _pcts(v: list[float]) -> list[float]:
    v = sorted(v)
    return [r4(v[int(0.5 * (len(v) - 1))]), r4(v[int(0.99 * (len(v) - 1))]), r4(v[-1])] if v else []


def trace_report(label: str, lines: list[str], records: list[dict], throttles: list[dict]) -> dict:
    """``--trace``: where each request's time went between its start (the send gate's
    stamp, Redis clock) and the provider's admission, from the senders' ``payrun.sends``
    lines and the provider's records (one host: one clock). A 429 means the provider saw
    41 admissions inside 1 s although the gate spaced their starts by 1 s + its margin:
    for each, the request of the refused window admitted latest after its start, split
    into gate -> write (our side), write -> headers read (kernel, the provider's thread
    waking) and headers -> admission (the provider reading and parsing the body)."""
    writes: dict[str, list[tuple[float, float]]] = {}
    for line in lines:
        parts = line.split("payrun.sends: send ", 1)[-1].split()
        if len(parts) == 5 and parts[1] == "gate" and parts[3] == "written":
            writes.setdefault(parts[0].rstrip(":"), []).append((float(parts[4]) / 1000, float(parts[2]) / 1000))
    admitted, refused = [], []  # (admission, headers, write, stamp) / (write, stamp)
    for r in records:
        ws = sorted(writes.get(r["key"], []))
        before = [w for w in ws if w[0] <= r["accepted_at"] + 0.0005]
        if not before:
            continue
        admitted.append((r["accepted_at"], r["received_at"], before[-1][0], before[-1][1]))
        refused += [w for w in ws if w is not before[-1]]
    admitted.sort()
    ms = lambda a, b: (a - b) * 1000  # noqa: E731
    out = {"requests_traced": len(admitted) + len(refused),
           "gate_to_write_ms_p50_p99_max": _pcts([ms(w, g) for a, h, w, g in admitted]),
           "write_to_headers_ms_p50_p99_max": _pcts([ms(h, w) for a, h, w, g in admitted]),
           "headers_to_admission_ms_p50_p99_max": _pcts([ms(a, h) for a, h, w, g in admitted]),
           "first_three_gate_to_admission_ms": [r4(ms(a, g)) for a, h, w, g in sorted(admitted, key=lambda x: x[3])[:3]],
           "429s": []}
    say(f"[{label}] trace of {out['requests_traced']} requests (p50/p99/max ms): gate -> write "
        f"{out['gate_to_write_ms_p50_p99_max']}, write -> headers read {out['write_to_headers_ms_p50_p99_max']}, "
        f"headers -> admission {out['headers_to_admission_ms_p50_p99_max']}; the first three requests, gate -> "
        f"admission: {out['first_three_gate_to_admission_ms']}")
    for t in throttles[:6]:
        at = t["at"]
        window = [x for x in admitted if at - 1.0 < x[0] <= at]
        mine = [w for w in refused if w[0] <= at + 0.002]
        if not window or not mine:
            continue
        rw, rg = max(mine)
        split = lambda x: {"gate_to_write_ms": r4(ms(x[2], x[3])), "write_to_headers_ms": r4(ms(x[1], x[2])),  # noqa: E731
                           "headers_to_admission_ms": r4(ms(x[0], x[1]))}
        latest = max(window, key=lambda x: x[0] - x[3])  # the request of the window admitted latest after its start
        cause = {"at": at, "provider_window_ms": r4(ms(at, window[0][0])),
                 "our_starts_ms": r4(ms(rg, min(x[3] for x in window))),
                 "first": split(window[0]), "latest": split(latest),
                 "refused_gate_to_write_ms": r4(ms(rw, rg))}
        out["429s"].append(cause)
        say(f"[{label}] 429 at {at:.3f}: the provider's admissions in the second before it spanned "
            f"{cause['provider_window_ms']} ms, their starts (gate) {cause['our_starts_ms']} ms; the one admitted "
            f"latest after its start took gate -> write {cause['latest']['gate_to_write_ms']}, write -> headers "
            f"{cause['latest']['write_to_headers_ms']}, headers -> admission {cause['latest']['headers_to_admission_ms']} ms")
    return out


def run_variant(label: str, n: int, pdf: bytes, concurrency: int | None, processes: int = 1,
                trace: bool = False) -> dict:
    toml = f"[limits]\nemail_concurrency = {concurrency}\n[email]\nlanes = {concurrency}\n" if concurrency else ""
    with Bench(f"email-{label}", config_toml=toml) as b:
        conn = b.start_redis()
        b.start_provider(LATENCY_S, RATE)
        b.apply_env()
        cfg = b.config()
        say(f"[{label}] email_concurrency {cfg.limits.email_concurrency}, lanes {cfg.email.lanes}, "
            f"rate {cfg.limits.email_rate_per_s:g}/s; provider {LATENCY_S} s, {RATE:g}/s; load {load_avg()}")
        db = seed_payroll(b.home, employees=n, companies=3)
        from jobs import tasks
        from payrun import payroll

        payloads = []
        for s in payroll.snapshots(db, MONTH):
            rel = tasks.slip_relpath(MONTH, s["company"]["id"], s["employee"]["id"])
            dest = cfg.slips_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            dest.write_bytes(pdf)
            dest.chmod(0o600)  # as a render writes it (a send reads only a slip that is ours alone)
            payloads.append(tasks.email_payload(s, rel))

        per = cfg.email.lanes // processes
        env = b.env(PAYRUN_LOG_DEBUG="payrun.sends") if trace else None
        ws = [b.spawn(f"send-email-{i}", ["worker", "send-email"] + (["--lanes", str(per)] if processes > 1 else []),
                      env=env)
              for i in range(processes)]
        ready = b.wait_workers(conn, per * processes)
        time.sleep(1.0)  # lanes settle into their blocking dequeue
        say(f"[{label}] {processes} send-email process(es) ready ({per} lanes each) after {ready:.1f} s")
        cpu0 = sum(proc_cpu_s(w.pid) for w in ws)
        t0 = time.time()
        te = time.monotonic()
        for p in payloads:
            tasks.enqueue_email(conn, cfg, p)
        say(f"[{label}] enqueued {n} send jobs in {time.monotonic() - te:.1f} s")
        conn.config_resetstat()  # from here on, the senders are Redis's only clients
        deadline = time.monotonic() + 120 + n / RATE * 3
        last = 0.0
        while True:
            st = b.provider_stats()
            if st["delivered"] >= n:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"[{label}] only {st['delivered']} of {n} delivered")
            if time.monotonic() - last > 10:
                say(f"[{label}]  ... {st['delivered']}/{n} delivered, 429s {st['throttled_429']}, "
                    f"in flight {st['in_flight']}")
                last = time.monotonic()
            b.check_alive()
            time.sleep(0.2)
        t_end = time.time()
        cpu = sum(proc_cpu_s(w.pid) for w in ws) - cpu0
        rss = sum(peak_rss_mb(w.pid) for w in ws)
        threads = sum(len(__import__("psutil").Process(w.pid).threads()) for w in ws)
        st = b.provider_stats()
        if st.get("throttles"):
            say(f"[{label}] first 429s (time, span of the window's admissions, last gaps in ms, the provider's "
                f"own delay from headers to admission): {st['throttles'][:4]}")
            for w in ws:  # the senders' side of each 429: how long after its gate pass it left
                log_path = b.log_dir / f"send-email-{ws.index(w)}.log"
                if log_path.exists():
                    for line in log_path.read_text(errors="replace").splitlines():
                        if "provider 429 for" in line:
                            say(f"[{label}] worker: {line.split('payrun.jobs: ')[-1][:200]}")
        records = [b.provider_get(f"/v1/messages/{p['key']}") for p in payloads]
        accepted = sorted(r["accepted_at"] for r in records)
        # the provider's own delay from a request's headers to its admission (reading the
        # body, parsing the JSON, decoding and hashing the attachment, in a thread): its
        # jitter counts as arrival jitter in the provider's window, whatever the senders do
        admit_ms = sorted((r["accepted_at"] - r["received_at"]) * 1000 for r in records if "received_at" in r)
        admit_p = {q: admit_ms[int(q / 100 * (len(admit_ms) - 1))] for q in (50, 99)} if admit_ms else {}
        i10, i90 = int(0.1 * n), int(0.9 * n) - 1
        sustained = (i90 - i10) / (accepted[i90] - accepted[i10])
        overall = (n - 1) / (accepted[-1] - accepted[0])
        wall = t_end - t0
        # how much room the admitted stream left: the shortest span of limit+1 consecutive
        # admissions. The provider refuses the (limit+1)th inside 1000 ms, so this never goes
        # below ~1000 ms (a refused request is not in it): near 1000, the senders were at the
        # edge; the 429s themselves are counted separately
        k = int(RATE)
        tightest_ms = min((accepted[i + k] - accepted[i] for i in range(len(accepted) - k)), default=0.0) * 1000
        gaps_ms = sorted((b2 - a2) * 1000 for a2, b2 in zip(accepted[i10:i90], accepted[i10 + 1:i90 + 1]))
        gap_p = {q: gaps_ms[int(q / 100 * (len(gaps_ms) - 1))] for q in (1, 50, 99)} if gaps_ms else {}
        last_delivery = accepted[-1] + LATENCY_S - t0
        calls = {c.removeprefix("cmdstat_"): v["calls"] for c, v in conn.info("commandstats").items()}
        per_send = sum(calls.values()) / n
        top = ", ".join(f"{c} {v / n:.1f}" for c, v in sorted(calls.items(), key=lambda kv: -kv[1])[:8])
        say(f"[{label}] Redis commands run per send (those inside scripts and transactions too): {per_send:.1f} ({top})")
        lim = json.loads(json.dumps({k.decode(): v.decode() for k, v in conn.hgetall("payrun:limit:email:stats").items()}))
        say(f"[{label}] sustained (10%-90%): {sustained:.2f} sends/s = {sustained / RATE:.3f} of {RATE:g}/s; "
            f"first-to-last admission {overall:.2f}/s; max in any 1 s bucket {st['max_rate_1s']}")
        say(f"[{label}] provider's tightest {k + 1} consecutive admissions: {tightest_ms:.1f} ms (at 1000 the edge); "
            f"gaps between admissions p1/p50/p99 {gap_p.get(1, 0):.1f}/{gap_p.get(50, 0):.1f}/{gap_p.get(99, 0):.1f} ms")
        if admit_ms:
            say(f"[{label}] provider's own delay from headers to admission: p50 {admit_p[50]:.1f}, "
                f"p99 {admit_p[99]:.1f}, max {admit_ms[-1]:.1f} ms")
        say(f"[{label}] http_429 {st['throttled_429']}, provider max_in_flight {st['max_in_flight']}, "
            f"duplicates {st['duplicates_refused']}, limiter stats {lim}")
        say(f"[{label}] worker: {cpu:.2f} CPU-s over {wall:.1f} s wall = {cpu / wall:.3f} cores; "
            f"{cpu / n * 1000:.1f} ms CPU per send; peak RSS {rss:.0f} MiB; {threads} threads")
        for w in ws:
            b.stop(w)
        traced = None
        if trace:
            lines = [line for i in range(processes) if (b.log_dir / f"send-email-{i}.log").exists()
                     for line in (b.log_dir / f"send-email-{i}.log").read_text(errors="replace").splitlines()
                     if "payrun.sends: send " in line]
            traced = trace_report(label, lines, records, st.get("throttles") or [])
        return {"processes": processes, "trace": traced,
            "email_concurrency": cfg.limits.email_concurrency, "lanes": cfg.email.lanes, "slips": n,
            "sustained_per_s": r4(sustained), "ratio": r4(sustained / RATE), "overall_per_s": r4(overall),
            "http_429": st["throttled_429"], "max_rate_1s": st["max_rate_1s"],
            "provider_max_in_flight": st["max_in_flight"], "delivered": st["delivered"],
            "duplicates_refused": st["duplicates_refused"], "worker_cpu_s": r4(cpu), "wall_s": r4(wall),
            "cores_used": r4(cpu / wall), "cpu_ms_per_send": r4(cpu / n * 1000), "peak_rss_mb": r4(rss),
            "threads": threads, "enqueue_to_last_reply_s": r4(last_delivery), "limiter_stats": lim,
            "redis_commands_per_send": r4(per_send), "tightest_window_ms": r4(tightest_ms),
            "gap_ms_p1_p50_p99": [r4(gap_p.get(q, 0)) for q in (1, 50, 99)],
            "provider_admit_ms_p50_p99_max": [r4(admit_p.get(50, 0)), r4(admit_p.get(99, 0)),
                                              r4(admit_ms[-1] if admit_ms else 0)],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--slips", type=int, default=None)
    ap.add_argument("--cap", type=int, default=45, help="email_concurrency (and lanes) of the second variant")
    ap.add_argument("--skip-default", action="store_true", help="run only the --cap variant (experiments)")
    ap.add_argument("--trace", action="store_true",
                    help="log every request's gate stamp and write (PAYRUN_LOG_DEBUG=payrun.sends) and print where "
                         "each 429's window lost its time (costs the sender some CPU: not for the headline figures)")
    ap.add_argument("--processes", type=int, default=1,
                    help="split the lanes over this many send-email processes (experiments; default 1)")
    a = ap.parse_args()
    n = a.slips or (600 if a.quick else 2000)
    say(f"email bench: {n} slips per variant, load {load_avg()}")
    pdf = one_pdf()
    say(f"one real slip PDF: {len(pdf):,} bytes, copied to {n} slip-store paths per variant")
    default = None if a.skip_default else run_variant("default-50", n, pdf, None, a.processes, a.trace)
    capped = run_variant(f"cap-{a.cap}", n, pdf, a.cap, a.processes, a.trace)
    if default:
        say(f"default: {default['ratio']:.3f} of the limit, 429s {default['http_429']}, {default['cores_used']:.3f} cores")
    say(f"cap {a.cap}: {capped['ratio']:.3f}, 429s {capped['http_429']}, {capped['cores_used']:.3f} cores")
    head = default or capped
    finish({"bench": "email", "quick": a.quick, "slips": n, "pdf_bytes": len(pdf),
            "ratio": head["ratio"], "http_429": head["http_429"], "cores_used": head["cores_used"],
            "worker_cpu_s": head["worker_cpu_s"], "peak_rss_mb": head["peak_rss_mb"],
            "target": "ratio >= 0.97, http_429 == 0, cores_used <= 0.25",
            "default_50": default, f"cap_{a.cap}": capped})


if __name__ == "__main__":
    run_main(main)
