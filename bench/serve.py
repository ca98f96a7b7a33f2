"""Load generator for `atom-core serve`: `python -m bench.serve` (part of `make bench`).

Starts the real server (`atom-core serve --model tiny`, a subprocess on loopback) and replays
the demo workload (most prompts share a system prompt, as token ids, greedy, streamed) with the
`openai` async client at several concurrency levels: requests/s, tokens/s, time to first token
and inter-token latency percentiles. The same workload is then run through an AtomBatcher driven
directly in this process (same model, same Config): the server's overhead per token is its wall
time per generated token against that (target: under 5% once the server sees as many requests
at once as the direct run). Every streamed token is also checked against the direct run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import workload
from atom_core.runtime.reference import TorchReferenceRuntime
from atom_core.serve.tokenizer import ByteTokenizer

LANES, MAX_SEQ, BLOCK, CHUNK = 4, 256, 64, 64
LEVELS = (1, 4, 16, 64)
REQUESTS, NEW_TOKENS = 64, 32
QUICK_LEVELS, QUICK_REQUESTS, QUICK_TOKENS = (1, 4), 8, 8


def config() -> Config:
    return Config(lanes=LANES, kv_blocks=min_kv_blocks(LANES, True, "dynamic", MAX_SEQ // BLOCK),
                  max_seq_len=MAX_SEQ, block_size=BLOCK, prefill_chunk=CHUNK, prefix_cache=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def direct(items: list[Any]) -> tuple[dict[int, list[int]], float, float, int]:
    """The workload through the batcher, no server: (tokens by item, wall s, CPU s, tokens)."""
    cfg = config()
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg, seed=0,
                                                    vocab_size=ByteTokenizer.vocab_size))
    t0, c0 = time.perf_counter(), time.process_time()
    rids = [b.submit(it.prompt, it.max_new_tokens, ByteTokenizer.eos_token_id) for it in items]
    out = b.run_until_done()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    toks = {i: out[r].tokens for i, r in enumerate(rids)}
    return toks, wall, cpu, sum(len(t) for t in toks.values())


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), or None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(key: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "atom_core.cli", "serve", "--model", "tiny", "--port", "0",
         "--lanes", str(LANES), "--max-seq-len", str(MAX_SEQ), "--block-size", str(BLOCK),
         "--prefill-chunk", str(CHUNK), "--prefix-cache", "--max-queue", "100000",
         "--log-level", "info"],
        env={**os.environ, "ATOM_CORE_API_KEY": key}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
            # keep reading its log (access lines), or a full pipe would block the server
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    proc.wait()
    raise RuntimeError("the server did not start")


async def run_level(client: Any, items: list[Any], concurrency: int,
                    progress: Any) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    got: dict[int, list[int]] = {}

    async def one(i: int, it: Any) -> None:
        async with sem:
            t0 = last = time.perf_counter()
            ids: list[int] = []
            stream = await client.completions.create(
                model="tiny", prompt=it.prompt, max_tokens=it.max_new_tokens, temperature=0,
                stream=True, extra_body={"return_token_ids": True})
            async for ch in stream:
                for choice in ch.choices:
                    for t in choice.token_ids or []:
                        now = time.perf_counter()
                        (itl if ids else ttft).append(now - (last if ids else t0))
                        last = now
                        ids.append(t)
            got[i] = ids
            progress()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in got.values())
    ms = 1000.0
    return {"concurrency": concurrency, "requests": len(items), "wall_s": round(wall, 3),
            "requests_per_s": round(len(items) / wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "tokens": tokens,
            "ttft_ms": {f"p{q}": round(pct(ttft, q) * ms, 2) for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": round(pct(itl, q) * ms, 2) for q in (50, 90, 99)}
            if itl else None,
            "_tokens": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a few requests (smoke test)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    import openai

    levels = QUICK_LEVELS if args.quick else LEVELS
    n, new = (QUICK_REQUESTS, QUICK_TOKENS) if args.quick else (REQUESTS, NEW_TOKENS)
    items = workload(n, new, seed=0, vocab=256, max_seq_len=MAX_SEQ)
    direct(items[:LANES])  # warm-up: the first calls of a process are slower
    want, direct_wall, direct_cpu, direct_tokens = direct(items)
    key = secrets.token_hex(16)
    proc, port = start_server(key)
    bar = None
    if not args.json:
        try:
            from rich.progress import Progress
            bar = Progress(transient=True)
        except ImportError:
            bar = None
    rows = []

    async def run_all() -> None:
        client = openai.AsyncOpenAI(api_key=key, base_url=f"http://127.0.0.1:{port}/v1",
                                    max_retries=0, timeout=600)
        # one warm-up request (the server's first calls are slower)
        await client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2,
                                        temperature=0)
        for c in levels:
            task = bar.add_task(f"concurrency {c}", total=len(items)) if bar else None

            def advance(task: Any = task) -> None:
                if bar is not None:
                    bar.advance(task)

            # the direct run again right before: on a shared machine the load drifts, so each
            # level is compared with a direct run taken next to it
            _, d_wall, d_cpu, _ = direct(items)
            cpu0 = cpu_seconds(proc.pid)
            row = await run_level(client, items, c, advance)
            cpu1 = cpu_seconds(proc.pid)
            got = row.pop("_tokens")
            row["exact"] = all(got[i] == want[i] for i in range(len(items)))
            row["direct_tokens_per_s"] = round(direct_tokens / d_wall, 1)
            row["overhead_wall_pct"] = round(100.0 * (row["wall_s"] / d_wall - 1), 1)
            row["server_cpu_s"] = None if cpu0 is None else round(cpu1 - cpu0, 3)
            row["direct_cpu_s"] = round(d_cpu, 3)
            # the server's CPU per token (engine, HTTP, JSON, SSE) against the batcher's alone
            row["overhead_cpu_pct"] = None if cpu0 is None else \
                round(100.0 * ((cpu1 - cpu0) / d_cpu - 1), 1)
            rows.append(row)
        await client.close()

    try:
        if bar is not None:
            bar.start()
        asyncio.run(run_all())
    finally:
        if bar is not None:
            bar.stop()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    report = {"config": {"lanes": LANES, "max_seq_len": MAX_SEQ, "block_size": BLOCK,
                         "prefill_chunk": CHUNK, "prefix_cache": True,
                         "requests": len(items), "max_new_tokens": new},
              "direct": {"wall_s": round(direct_wall, 3), "cpu_s": round(direct_cpu, 3),
                         "tokens": direct_tokens,
                         "tokens_per_s": round(direct_tokens / direct_wall, 1)},
              "levels": rows, "server_exit_code": code}
    if args.json:
        print(json.dumps(report))
    else:
        d = report["direct"]
        print(f"atom-core serve under load ({len(items)} requests, {new} new tokens each, "
              f"lanes={LANES}, tiny reference model)")
        print(f"  batcher driven directly: {d['tokens_per_s']} tokens/s ({d['wall_s']} s)")
        for r in rows:
            itl = r["itl_ms"] or {}
            print(f"  concurrency {r['concurrency']:>3}: {r['requests_per_s']:>7} req/s "
                  f"{r['tokens_per_s']:>8} tok/s  TTFT p50/p99 {r['ttft_ms']['p50']}/"
                  f"{r['ttft_ms']['p99']} ms  ITL p50/p99 {itl.get('p50')}/{itl.get('p99')} ms"
                  f"  exact={r['exact']}")
            print(f"{'':19}vs direct ({r['direct_tokens_per_s']} tok/s next to it): wall "
                  f"{r['overhead_wall_pct']:+}%, server CPU {r['server_cpu_s']} s vs "
                  f"{r['direct_cpu_s']} s ({r['overhead_cpu_pct']:+}%)")
        print("  (overheads compare the same workload; at concurrency < requests the server "
              "also batches less than the direct run, which submits everything at once)")
    return 0 if all(r["exact"] for r in rows) and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
