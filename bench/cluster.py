"""A PD cluster's throughput and latency by shape, and what its router costs:
`python -m bench.cluster`.

For each shape (prefill x decode workers: 1x1, 1x2, 2x2 by default) `atom-core pd-cluster`
runs the demo workload on the reference runtime, one process per worker plus the frontend, over
gloo on loopback with a key; reported: generated tokens per second (first submit to last end),
the median time to first token, and the router's median time per request inside that run.
Apart from that, the router alone: the median cost of `Router.assign` per request over a
realistic mix of prompts and 4 + 4 workers (prefix hashing, the policy, the bookkeeping).
Startup (processes, models, links) is not timed. On a shared 2-core machine the workers compete
for the cores: compare shapes on the same machine, not with other benches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from atom_core.cli.pd import PD_KEY_ENV  # noqa: E402
from atom_core.pd.router import Load, Router  # noqa: E402

SHAPES = ((1, 1), (1, 2), (2, 2))


def run_shape(prefill: int, decode: int, requests: int, max_new: int, lanes: int
              ) -> dict[str, Any]:
    env = {**os.environ, PD_KEY_ENV: secrets.token_hex(32), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "atom_core.cli", "pd-cluster", "--prefill", str(prefill),
            "--decode", str(decode), "--lanes", str(lanes), "--prefix-cache",
            "--requests", str(requests), "--max-new-tokens", str(max_new), "--timeout", "60",
            "--json"]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"pd-cluster {prefill}x{decode} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def router_cost(n: int = 20_000, workers: int = 4, seed: int = 0) -> dict[str, float]:
    """Median and p90 microseconds of one `Router.assign` (prompts of 40..250 tokens, half of
    them behind one of 8 shared 128-token prefixes; loads reported every 8 requests)."""
    rng = random.Random(seed)
    r = Router(64)
    systems = [[rng.randrange(32000) for _ in range(128)] for _ in range(8)]
    prompts = []
    for i in range(256):
        tail = [rng.randrange(32000) for _ in range(rng.randint(40, 120))]
        prompts.append(systems[i % 8] + tail if i % 2 else tail)
    times = []
    for i in range(n):
        if i % 8 == 0:
            for role in ("prefill", "decode"):
                for w in range(workers):
                    r.report(role, w, Load(True, rng.randrange(8), rng.randrange(4),
                                           rng.randrange(32)))
        t0 = time.perf_counter()
        r.assign(prompts[i % len(prompts)])
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_us": round(statistics.median(times) * 1e6, 2),
            "p90_us": round(times[int(0.9 * len(times))] * 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--shapes", default=",".join(f"{p}x{d}" for p, d in SHAPES),
                    help="comma-separated PxD shapes (default 1x1,1x2,2x2)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows: dict[str, Any] = {}
    for p, d in shapes:
        out = run_shape(p, d, args.requests, args.max_new_tokens, args.lanes)
        rows[f"{p}x{d}"] = {k: out[k] for k in ("tokens_per_s", "ttft_median_s",
                                                 "route_median_us", "generated_tokens",
                                                 "failed", "exact")}
    report = {"workload": {"requests": args.requests, "max_new_tokens": args.max_new_tokens,
                           "lanes": args.lanes, "runtime": "reference"},
              "shapes": rows, "router_assign": router_cost()}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"PD cluster, reference runtime, {args.requests} requests x "
              f"{args.max_new_tokens} new tokens, {args.lanes} lanes per worker")
        print(f"{'shape':>6} {'tokens/s':>10} {'TTFT median':>12} {'route median':>13}  exact")
        for name, r in rows.items():
            print(f"{name:>6} {r['tokens_per_s']:>10} {r['ttft_median_s']:>11}s "
                  f"{r['route_median_us']:>11}us  {r['exact']}")
        ra = report["router_assign"]
        print(f"router alone: {ra['median_us']} us per request (median), {ra['p90_us']} us p90")
    ok = all(r["exact"] for r in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
