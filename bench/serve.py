"""Load generator for `atom-core serve`: `python -m bench.serve` (part of `make bench`).

Starts the real server (`atom-core serve --model tiny`, a subprocess on loopback) and replays
the demo workload (most prompts share a system prompt, as token ids, greedy, streamed) with the
`openai` async client at concurrency 1, 16 and 64: requests/s, tokens/s, time to first token
and inter-token latency percentiles. Every streamed token is checked against the batcher.

The server's overhead per token is measured against the same workload through an AtomBatcher
driven directly in this process (same model, same Config) with as many requests in flight as
the clients keep (a closed loop: the next request goes in when one ends), run right before each
server run, since the load of a shared machine drifts. Two ratios per level, medians over
`--rounds` rounds:

- CPU: the server process's CPU time (every thread: engine, HTTP, JSON, SSE) against the direct
  run's. This is the overhead the target (under 5% at concurrency 64) is about.
- serving: the server's CPU outside the batcher's steps (it reports the engine thread's CPU
  inside `step` in /metrics) against the CPU inside them, from the same run: what HTTP costs on
  top of the batcher, free of the drift between two runs (which the first ratio also carries,
  e.g. the client's own CPU on the other core slowing the server's).

Wall time is reported too; with the client on the same machine it mostly measures the machine.
`--stream-interval N` runs the server with that option (a stream sends its first token at once,
then every N tokens): fewer, larger writes, so less of the serving CPU per token.

What serving costs is mostly per request (HTTP, JSON, the client's connection: about 2 ms of
CPU here) and per token (an SSE frame, a wake-up of the event loop: about 0.1-0.2 ms), so its
share depends on what a step costs. The tiny model's step is about a millisecond of CPU per
token, the worst case; `--model small-llama` serves an 8-layer, 512-wide Llama (random weights,
the transformers runtime, `serve --runtime hf --model DIR`), whose step costs tens of
milliseconds, as a small real model's does. Both sides run torch on one thread, so the CPU inside
a step is the engine thread's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import Item, workload
from atom_core.runtime.host_memory import keep_freed_memory
from atom_core.runtime.reference import TorchReferenceRuntime
from atom_core.serve.tokenizer import ByteTokenizer

LANES, MAX_SEQ, BLOCK, CHUNK = 4, 256, 64, 64
SERVED = "bench"  # the served model name the clients ask for
# `--model small-llama`: a Llama of a size whose decode step costs what a small real model's
# does on this CPU (random weights, a locally trained tokenizer), served with `--runtime hf
# --model DIR` and driven directly through HFRuntime.from_pretrained(DIR): the overhead of
# serving against a step that is not unrealistically cheap
SMALL_LLAMA = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64)
SMALL_VOCAB = 320
LEVELS, ROUNDS = (1, 16, 64), 3
REQUESTS, NEW_TOKENS = 64, 32
QUICK_LEVELS, QUICK_REQUESTS, QUICK_TOKENS = (1, 4), 8, 8
TARGET_PCT, TARGET_LEVEL = 5.0, 64


def config() -> Config:
    return Config(lanes=LANES, kv_blocks=min_kv_blocks(LANES, True, "dynamic", MAX_SEQ // BLOCK),
                  max_seq_len=MAX_SEQ, block_size=BLOCK, prefill_chunk=CHUNK, prefix_cache=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def build_small_llama(path: str) -> str:
    """The `small-llama` model directory (weights and tokenizer) in `path`."""
    from atom_core.runtime.hf import HFRuntime
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    HFRuntime.tiny_llama_model(0, vocab_size=SMALL_VOCAB, max_position=MAX_SEQ,
                               **SMALL_LLAMA).save_pretrained(path)
    build_tiny_tokenizer(path, vocab_size=SMALL_VOCAB)
    return path


def runtime_for(model_dir: str | None) -> tuple[Any, int | None]:
    """(runtime, eos token id) of the served model: the tiny reference one, or `model_dir`'s."""
    cfg = config()
    if model_dir is None:
        return (TorchReferenceRuntime.tiny(cfg, seed=0, vocab_size=ByteTokenizer.vocab_size),
                ByteTokenizer.eos_token_id)
    from atom_core.runtime.hf import HFRuntime
    from atom_core.serve.runtimes import tokenizer_for

    return HFRuntime.from_pretrained(model_dir, cfg), tokenizer_for(model_dir).eos_token_id


def direct(items: list[Item], concurrency: int | None = None, model_dir: str | None = None
           ) -> tuple[dict[int, list[int]], float, float, int]:
    """The workload through the batcher, no server, at most `concurrency` requests submitted at
    once (None: all), the next in item order when one ends, as the load generator's clients do:
    (tokens by item, wall s, CPU s, tokens)."""
    rt, eos = runtime_for(model_dir)
    b = AtomBatcher(config(), rt)
    limit = len(items) if concurrency is None else concurrency
    t0, c0 = time.perf_counter(), time.process_time()
    item_of: dict[int, int] = {}
    nxt = 0
    toks: dict[int, list[int]] = {}
    while nxt < len(items) or b.busy():
        while nxt < len(items) and len(item_of) - len(toks) < limit:
            item_of[b.submit(items[nxt].prompt, items[nxt].max_new_tokens, eos)] = nxt
            nxt += 1
        for ev in b.step():
            if ev.kind in ("finished", "error"):
                toks[item_of[ev.request_id]] = b.requests[ev.request_id].tokens
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return toks, wall, cpu, sum(len(t) for t in toks.values())


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, every thread (Linux /proc), or None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(key: str, interval: int = 1, model_dir: str | None = None
                 ) -> tuple[subprocess.Popen[str], int]:
    model = ["--model", "tiny"] if model_dir is None else ["--runtime", "hf", "--model",
                                                           model_dir]
    proc = subprocess.Popen(
        [sys.executable, "-m", "atom_core.cli", "serve", *model, "--served-model-name", SERVED,
         "--port", "0",
         "--lanes", str(LANES), "--max-seq-len", str(MAX_SEQ), "--block-size", str(BLOCK),
         "--prefill-chunk", str(CHUNK), "--prefix-cache", "--max-queue", "100000",
         "--stream-interval", str(interval), "--log-level", "info"],
        env={**os.environ, "ATOM_CORE_API_KEY": key, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
            # keep reading its log (access lines), or a full pipe would block the server
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    proc.wait()
    raise RuntimeError("the server did not start")


async def step_cpu(client: Any) -> float:
    """The engine thread's CPU seconds inside the batcher's steps, from the server's /metrics."""
    r = await client.get("/metrics")
    r.raise_for_status()
    m = re.search(r"^atom_engine_step_cpu_seconds_total (\S+)$", r.text, re.M)
    assert m is not None, "the server reports no atom_engine_step_cpu_seconds"
    return float(m.group(1))


async def run_level(client: Any, items: list[Item], concurrency: int,
                    progress: Callable[[], None]) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    got: dict[int, list[int]] = {}

    async def one(i: int, it: Item) -> None:
        async with sem:
            t0 = last = time.perf_counter()
            ids: list[int] = []
            stream = await client.completions.create(
                model=SERVED, prompt=it.prompt, max_tokens=it.max_new_tokens, temperature=0,
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
    return {"wall": time.perf_counter() - t0, "ttft": ttft, "itl": itl, "tokens": got}


def summarize(c: int, runs: list[dict[str, Any]], n_items: int) -> dict[str, Any]:
    """One level's row from its rounds: medians of each round's ratios against the direct run
    taken next to it."""
    med = statistics.median
    ms = 1000.0
    ttft = [x for r in runs for x in r["ttft"]]
    itl = [x for r in runs for x in r["itl"]]
    tokens = runs[0]["n_tokens"]
    cpu_ratios = [r["server_cpu"] / r["direct_cpu"] for r in runs if r["server_cpu"] is not None]
    serving = [(r["server_cpu"] - r["step_cpu"]) / r["step_cpu"] for r in runs
               if r["server_cpu"] is not None and r["step_cpu"] > 0]
    return {
        "concurrency": c, "requests": n_items, "rounds": len(runs), "tokens": tokens,
        "exact": all(r["exact"] for r in runs),
        "requests_per_s": round(med(n_items / r["wall"] for r in runs), 2),
        "tokens_per_s": round(med(tokens / r["wall"] for r in runs), 1),
        "ttft_ms": {f"p{q}": round(pct(ttft, q) * ms, 2) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": round(pct(itl, q) * ms, 2) for q in (50, 90, 99)} if itl else None,
        "direct_tokens_per_s": round(med(tokens / r["direct_wall"] for r in runs), 1),
        "overhead_wall_pct": round(100.0 * (med(r["wall"] / r["direct_wall"] for r in runs) - 1),
                                   1),
        # the server's CPU per token against the direct run's (same workload, same concurrency)
        "overhead_cpu_pct": round(100.0 * (med(cpu_ratios) - 1), 1) if cpu_ratios else None,
        "overhead_cpu_pct_rounds": [round(100.0 * (x - 1), 1) for x in cpu_ratios],
        # the server's CPU outside the batcher's steps against the CPU inside them (same run)
        "serving_cpu_pct": round(100.0 * med(serving), 1) if serving else None,
        "server_cpu_us_per_token": round(med(r["server_cpu"] for r in runs) / tokens * 1e6)
        if cpu_ratios else None,
        "direct_cpu_us_per_token": round(med(r["direct_cpu"] for r in runs) / tokens * 1e6),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few requests, one round (smoke test)")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"rounds per level (default {ROUNDS}; --quick: 1); the ratios are "
                         "medians over them")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="the server's --stream-interval (default 1: every token as it comes)")
    ap.add_argument("--model", choices=("tiny", "small-llama"), default="tiny",
                    help="tiny: the built-in reference model (a step costs about a "
                         "millisecond: the worst case for the overhead); small-llama: an "
                         "8-layer, 512-wide Llama with random weights through the "
                         "transformers runtime (`serve --runtime hf --model DIR`)")
    args = ap.parse_args(argv)
    # the allocator settings `atom-core serve` runs with, so that the direct runs are not
    # cheaper or dearer by where malloc's thresholds happened to drift (see host_memory)
    keep_freed_memory()
    if args.model == "small-llama":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="atom-bench-llama-") as tmp:
            return run(args, build_small_llama(tmp))
    return run(args, None)


def run(args: argparse.Namespace, model_dir: str | None) -> int:
    import httpx
    import openai
    import torch

    # one torch thread here and in the server (OMP_NUM_THREADS): the CPU inside a step is then
    # the engine thread's own (what the server reports), and the client has the other core
    torch.set_num_threads(1)

    levels = QUICK_LEVELS if args.quick else LEVELS
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    n, new = (QUICK_REQUESTS, QUICK_TOKENS) if args.quick else (REQUESTS, NEW_TOKENS)
    items = workload(n, new, seed=0, vocab=256, max_seq_len=MAX_SEQ)
    direct(items[:LANES], model_dir=model_dir)  # warm-up: a process's first calls are slower
    want, direct_wall, direct_cpu, direct_tokens = direct(items, model_dir=model_dir)
    key = secrets.token_hex(16)
    proc, port = start_server(key, args.stream_interval, model_dir)
    bar = None
    if not args.json:
        try:
            from rich.progress import Progress
            # refreshed by hand, not by rich's own thread: that would add its CPU to the
            # direct runs, which are measured in this process
            bar = Progress(transient=True, auto_refresh=False)
        except ImportError:
            bar = None
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in levels}

    async def run_all() -> None:
        base = f"http://127.0.0.1:{port}"
        metrics = httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"})
        for rnd in range(rounds):
            for c in levels:
                task = bar.add_task(f"round {rnd + 1}/{rounds}, concurrency {c}",
                                    total=len(items)) if bar else None

                def advance(task: Any = task) -> None:
                    if bar is not None:
                        bar.advance(task)
                        bar.refresh()

                # the direct run right before, at the same concurrency
                d_toks, d_wall, d_cpu, _ = direct(items, c, model_dir)
                # a fresh client per run: a pooled connection idle longer than the server's
                # keep-alive (5 s) would be closed under the next run's first request
                client = openai.AsyncOpenAI(api_key=key, base_url=f"{base}/v1", max_retries=0,
                                            timeout=600)
                # one warm-up request (a new client's first calls are slower)
                await client.completions.create(model=SERVED, prompt=[1, 2, 3], max_tokens=2,
                                                temperature=0)
                s0, cpu0 = await step_cpu(metrics), cpu_seconds(proc.pid)
                run = await run_level(client, items, c, advance)
                cpu1, s1 = cpu_seconds(proc.pid), await step_cpu(metrics)
                await client.close()
                got = run.pop("tokens")
                run.update(
                    exact=all(got[i] == want[i] == d_toks[i] for i in range(len(items))),
                    n_tokens=sum(len(v) for v in got.values()), direct_wall=d_wall,
                    direct_cpu=d_cpu, server_cpu=None if cpu0 is None else cpu1 - cpu0,
                    step_cpu=s1 - s0)
                runs[c].append(run)
                if bar is not None:
                    bar.remove_task(task)
                    bar.refresh()
        await metrics.aclose()

    try:
        if bar is not None:
            bar.start()
        asyncio.run(run_all())
    finally:
        if bar is not None:
            bar.stop()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    rows = [summarize(c, runs[c], len(items)) for c in levels]
    report = {"config": {"lanes": LANES, "max_seq_len": MAX_SEQ, "block_size": BLOCK,
                         "prefill_chunk": CHUNK, "prefix_cache": True,
                         "requests": len(items), "max_new_tokens": new, "rounds": rounds,
                         "stream_interval": args.stream_interval, "model": args.model},
              "direct": {"wall_s": round(direct_wall, 3), "cpu_s": round(direct_cpu, 3),
                         "tokens": direct_tokens,
                         "tokens_per_s": round(direct_tokens / direct_wall, 1)},
              "levels": rows, "server_exit_code": code}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"atom-core serve under load ({len(items)} requests, {new} new tokens each, "
              f"lanes={LANES}, model {args.model}, stream interval {args.stream_interval}, "
              f"{rounds} round(s), medians)")
        for r in rows:
            itl = r["itl_ms"] or {}
            print(f"  concurrency {r['concurrency']:>3}: {r['requests_per_s']:>7} req/s "
                  f"{r['tokens_per_s']:>8} tok/s  TTFT p50/p99 {r['ttft_ms']['p50']}/"
                  f"{r['ttft_ms']['p99']} ms  ITL p50/p99 {itl.get('p50')}/{itl.get('p99')} ms"
                  f"  exact={r['exact']}")
            print(f"{'':19}overhead per token against the batcher driven directly at the same "
                  f"concurrency: CPU {r['overhead_cpu_pct']:+}% ({r['server_cpu_us_per_token']} "
                  f"vs {r['direct_cpu_us_per_token']} us; rounds "
                  f"{r['overhead_cpu_pct_rounds']}), wall {r['overhead_wall_pct']:+}%; "
                  f"serving beyond the steps {r['serving_cpu_pct']}% of their CPU")
        top = next((r for r in rows if r["concurrency"] == TARGET_LEVEL), None)
        if top is not None and top["overhead_cpu_pct"] is not None:
            met = "met" if top["overhead_cpu_pct"] < TARGET_PCT else "NOT met"
            print(f"  target: CPU overhead under {TARGET_PCT:g}% at concurrency {TARGET_LEVEL}: "
                  f"{met} ({top['overhead_cpu_pct']:+}%)")
    return 0 if all(r["exact"] for r in rows) and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
