"""What two renders at once cost against one alone, on this host, free of its drift.

    python bench/pairs.py [--quick]

Two warm worker processes (forked from one warm parent, each past its first renders) are
told in turn: A alone, A and B at once, B alone, and so on, a few renders per step, so
that each "both at once" step is compared with the lone steps right before and after it
(this host's speed drifts by up to 2x within seconds; a step takes ~0.5 s). The same is
done with a pure-Python loop as a control: it touches almost no memory, so a penalty
there would mean the two vCPUs share one core; a penalty for renders only means they
share caches or memory bandwidth.

Diagnostic, not a target: the render pool's ceiling is cores / (lone render x this
ratio). "ratio" = the median per-step render pair / lone time.
"""

from __future__ import annotations

import sys

# bench/email.py would shadow the stdlib's email package: this folder, first on
# sys.path for a script run from it, goes last (where _common is still found)
sys.path.append(sys.path.pop(0))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from _common import finish, median, r4, run_main, say  # noqa: E402


def spin(_: int) -> None:
    n = 0
    for k in range(400_000):
        n += k * k


class Pair:
    """Two forked children that run ``work`` n times on request and report each time."""

    def __init__(self, work) -> None:
        self.kids = []
        for _ in range(2):
            r1, w1 = os.pipe()
            r2, w2 = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    for _, w, r in self.kids:  # the earlier child's ends: it must see its EOF
                        os.close(w)
                        r.close()
                    os.close(w1)
                    os.close(r2)
                    for line in os.fdopen(r1, "rb"):
                        times = []
                        for i in range(int(line)):
                            t = time.perf_counter()
                            work(i)
                            times.append(time.perf_counter() - t)
                        os.write(w2, (json.dumps(times) + "\n").encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(r1)
            os.close(w2)
            self.kids.append((pid, w1, os.fdopen(r2, "rb")))

    def run(self, which: list[int], n: int) -> list[list[float]]:
        for k in which:
            os.write(self.kids[k][1], f"{n}\n".encode())
        return [json.loads(self.kids[k][2].readline()) for k in which]

    def close(self) -> None:
        for _, w, r in self.kids:
            os.close(w)
            r.close()
        for pid, _, _ in self.kids:
            os.waitpid(pid, 0)


def measure(work, steps: int, per: int) -> dict[str, float]:
    pair = Pair(work)
    try:
        pair.run([0, 1], 3)  # past the first renders (copy-on-write faults, caches)
        ratios, lone, both = [], [], []
        for _ in range(steps):
            a = median(pair.run([0], per)[0])
            pa, pb = pair.run([0, 1], per)
            p = median(pa + pb)
            b = median(pair.run([1], per)[0])
            ratios.append(p / ((a + b) / 2))
            lone += [a, b]
            both.append(p)
    finally:
        pair.close()
    ratios.sort()
    return {"lone_s": r4(median(lone)), "both_s": r4(median(both)), "ratio": r4(median(ratios)),
            "p25": r4(ratios[len(ratios) // 4]), "p75": r4(ratios[3 * len(ratios) // 4]), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="alone / both / alone steps (default 30; quick 10)")
    a = ap.parse_args()
    steps = a.steps or (10 if a.quick else 30)
    logging.getLogger("weasyprint").setLevel(logging.ERROR)
    from jobs import slip

    slip.tune_gc()
    slip.tune_malloc()
    slip.warm_up()
    gc.collect()
    gc.freeze()
    out = {}
    for name, work in (("render", lambda i: slip.render_pdf(slip.SAMPLE_SNAPSHOT)), ("pure_python", spin)):
        m = measure(work, steps, 3)
        out[name] = m
        say(f"{name}: alone {m['lone_s'] * 1000:.1f} ms, both at once {m['both_s'] * 1000:.1f} ms; per step both / "
            f"alone: median {m['ratio']:.3f} (p25 {m['p25']:.3f}, p75 {m['p75']:.3f}, {steps} steps)")
    say(f"the render pool's ceiling on this host: {1 / out['render']['ratio']:.3f} of cores / lone render")
    finish({"bench": "pairs", "quick": a.quick, "ratio": out["render"]["ratio"], **out})


if __name__ == "__main__":
    run_main(main)
