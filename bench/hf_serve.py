"""`atom-core serve --runtime hf` against vLLM's CPU engine, end to end: `make bench-serve-vllm`
(`python -m bench.hf_serve`; never in CI: it needs the vLLM venv `make vllm-venv` builds).

One model for both servers: a 26M-parameter random Llama (`bench.hf_call.BENCH_LLAMA`: hidden
512, 6 layers, 8 query / 4 KV heads, vocab 8192, float32, seeded weights) with a word-level
tokenizer whose token i reads "t{i}" (every id is a token, so prompts go in as ids), saved
offline into a temporary directory. Both servers get the same sizes: 16 sequences at once
(atom-core's lanes, vLLM's max_num_seqs), block 128 (vLLM's CPU attention takes multiples of
32), max_seq_len 512, atom-core's chunk 128; each its own defaults otherwise (atom-core: the
compiled core when built, HFRuntime's thread choice; vLLM: its CPU thread binding,
VLLM_CPU_KVCACHE_SPACE=1 GiB).

Workload: streamed greedy completions (`temperature 0`, `return_token_ids`) of 32-200 prompt
tokens (seeded) and 64 output tokens, at concurrency 1, 16 and 64 (`--requests` requests each,
default 8, 32 and 128), the servers alternated within each round (both stay up, the idle one
idle). Per level and server: output tokens/s (generated tokens / wall s), TTFT p50 and p99 and
ITL p50 (over every round's requests), and the server's CPU per output token (user + system
of the server's process tree, /proc): the median over `--rounds` rounds with the range, and the
ratios atom-core / vLLM of the medians. The two servers' tokens are compared request by request
(float32: rounding may part them at a near-tie; reported, not asserted).

Where atom-core's time goes (its /metrics, per level, medians): `engine_cpu_share`, the engine
thread's CPU inside the batcher's steps over the server's whole CPU (the rest is HTTP, SSE,
detokenization: what a frontend process of its own could take off the engine's core);
`engine_busy`, the steps' wall time over the level's (near 1: the engine stepped without a
pause, so the steps' speed is the throughput); `step_wait`, the steps' wall beyond their CPU
over their wall (the GIL, or a core another process holds). (The counters take in the
warm-up request's two steps, the wall does not.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import emit
from bench.hf_call import BENCH_LLAMA, BLOCK, CHUNK, LANES, MAX_SEQ, bench_model

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".vllm-venv" / "bin" / "python"
SERVED = "bench"
LEVELS = {1: 8, 16: 32, 64: 128}  # concurrency -> requests
PROMPT, NEW_TOKENS, ROUNDS = (32, 200), 64, 3
KEY = "bench-" + "k" * 32


def save_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer whose token i reads "t{i}" (bos t1, eos t2), as tests_vllm's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                            unk_token="t0").save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(kind: str, model_dir: str, vllm_py: Path = VLLM_PY
          ) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    if kind == "atom":
        cmd = [sys.executable, "-m", "atom_core.cli", "serve", "--runtime", "hf", "--model",
               model_dir, "--served-model-name", SERVED, "--port", str(port),
               "--lanes", str(LANES), "--max-seq-len", str(MAX_SEQ), "--block-size",
               str(BLOCK), "--prefill-chunk", str(CHUNK), "--max-queue", "100000",
               "--log-level", "warning"]
        env = {**os.environ, "ATOM_CORE_API_KEY": KEY}
    else:
        if not vllm_py.exists():
            raise SystemExit(f"{vllm_py} is missing: run `make vllm-venv` first")
        cmd = [str(vllm_py), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(LANES), "--block-size", str(BLOCK), "--max-model-len",
               str(MAX_SEQ), "--dtype", "float32", "--api-key", KEY,
               "--uvicorn-log-level", "warning"]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", "1"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(f"/tmp/bench-hf-serve-{kind}.log", "wb"))  # noqa: SIM115
    return proc, port


def wait_ready(proc: subprocess.Popen[bytes], port: int, kind: str, limit: float = 600) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"the {kind} server exited ({proc.returncode}): see "
                             f"/tmp/bench-hf-serve-{kind}.log")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the {kind} server was not ready after {limit:.0f} s")


def engine_counters(port: int) -> tuple[float, float]:
    """atom-core's (CPU seconds, wall seconds) inside the batcher's steps so far (/metrics)."""
    import re

    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics",
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    got = [re.search(rf"^{name} (\S+)$", text, re.M) for name in
           ("atom_engine_step_cpu_seconds_total", "atom_engine_step_seconds_total")]
    if got[0] is None or got[1] is None:
        raise SystemExit("the atom-core server reports no atom_engine_step_* counters")
    return float(got[0].group(1)), float(got[1].group(1))


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (Linux /proc)."""
    total, todo = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = BENCH_LLAMA["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT))] for _ in range(n)]


async def run_level(port: int, prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1",
                                max_retries=0, timeout=1200)
    await client.completions.create(model=SERVED, prompt=[5, 6, 7], max_tokens=2,
                                    temperature=0)  # warm-up
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    got: dict[int, list[int]] = {}

    async def one(i: int, p: list[int]) -> None:
        async with sem:
            t0 = last = time.perf_counter()
            ids: list[int] = []
            stream = await client.completions.create(
                model=SERVED, prompt=p, max_tokens=NEW_TOKENS, temperature=0, stream=True,
                extra_body={"return_token_ids": True})
            async for ch in stream:
                for choice in ch.choices:
                    for t in getattr(choice, "token_ids", None) or []:
                        now = time.perf_counter()
                        (itl if ids else ttft).append(now - (last if ids else t0))
                        last = now
                        ids.append(t)
            got[i] = ids

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"wall": wall, "ttft": ttft, "itl": itl, "tokens": got}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def engine_share(runs: list[dict[str, Any]]) -> dict[str, float]:
    """atom-core's engine against its whole server (module docstring), medians over rounds."""
    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 3)

    return {"engine_cpu_share": med([r["step_cpu"] / r["cpu"] for r in runs]),
            "engine_busy": med([r["step_wall"] / r["wall"] for r in runs]),
            "step_wait": med([1 - r["step_cpu"] / r["step_wall"] for r in runs])}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tps = [r["n_tokens"] / r["wall"] for r in runs]
    cpu = [r["cpu"] / r["n_tokens"] * 1e3 for r in runs]
    ttft = [x for r in runs for x in r["ttft"]]
    itl = [x for r in runs for x in r["itl"]]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(1e3 * x, 1)

    return {"tokens_per_s": round(statistics.median(tps), 1),
            "tokens_per_s_range": [round(min(tps), 1), round(max(tps), 1)],
            "ttft_ms": {"p50": ms(pct(ttft, 50)), "p99": ms(pct(ttft, 99))},
            "itl_ms_p50": ms(pct(itl, 50)),
            "cpu_ms_per_token": round(statistics.median(cpu), 2),
            "cpu_ms_per_token_range": [round(min(cpu), 2), round(max(cpu), 2)]}


def run(rounds: int, levels: dict[int, int], vllm_py: Path = VLLM_PY) -> dict[str, Any]:
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="atom-bench-serve-") as tmp:
        bench_model(tmp)
        save_tokenizer(tmp, BENCH_LLAMA["vocab_size"])
        servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        try:
            for k in ("atom", "vllm"):
                servers[k] = start(k, tmp, vllm_py)
            for k, (proc, port) in servers.items():
                wait_ready(proc, port, k)
            runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
            same: dict[int, list[int]] = {c: [] for c in levels}
            for rnd in range(rounds):
                for c, n in levels.items():
                    prompts = workload(n, seed=c)
                    order = ("atom", "vllm") if rnd % 2 == 0 else ("vllm", "atom")
                    toks = {}
                    for k in order:
                        proc, port = servers[k]
                        e0 = engine_counters(port) if k == "atom" else (0.0, 0.0)
                        c0 = tree_cpu(proc.pid)
                        r = asyncio.run(run_level(port, prompts, c))
                        r["cpu"] = tree_cpu(proc.pid) - c0
                        if k == "atom":
                            e1 = engine_counters(port)
                            r["step_cpu"], r["step_wall"] = e1[0] - e0[0], e1[1] - e0[1]
                        toks[k] = r.pop("tokens")
                        r["n_tokens"] = sum(len(v) for v in toks[k].values())
                        runs.setdefault((c, k), []).append(r)
                        print(f"round {rnd + 1} concurrency {c} {k}: "
                              f"{r['n_tokens'] / r['wall']:.1f} tokens/s", file=sys.stderr)
                    same[c].append(sum(toks["atom"][i] == toks["vllm"][i] for i in range(n)))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
            for proc, _ in servers.values():
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    table = []
    for c, n in levels.items():
        a, v = summarize(runs[c, "atom"]), summarize(runs[c, "vllm"])
        table.append({
            "concurrency": c, "requests": n, "atom": a, "vllm": v,
            "requests_with_equal_tokens": same[c],
            "atom_engine": engine_share(runs[c, "atom"]),
            "ratio_atom_over_vllm": {
                "tokens_per_s": round(a["tokens_per_s"] / v["tokens_per_s"], 2),
                "cpu_per_token": round(a["cpu_ms_per_token"] / v["cpu_ms_per_token"], 2),
                "ttft_p99": round(a["ttft_ms"]["p99"] / v["ttft_ms"]["p99"], 2),
                "itl_p50": round(a["itl_ms_p50"] / v["itl_ms_p50"], 2)}})
    return {"model": "bench-llama (26M parameters, float32, random weights)",
            "sizes": {"lanes_or_max_num_seqs": LANES, "block_size": BLOCK,
                      "max_seq_len": MAX_SEQ, "prefill_chunk": CHUNK},
            "workload": {"prompt_tokens": list(PROMPT), "new_tokens": NEW_TOKENS,
                         "greedy": True, "streamed": True},
            "rounds": rounds, "levels": table, "load_avg": os.getloadavg(),
            "cpus": os.cpu_count(), "seconds": round(time.perf_counter() - t_start, 1)}


def print_report(r: dict[str, Any]) -> None:
    print(f"atom-core serve --runtime hf vs vLLM CPU: {r['model']}, {r['rounds']} alternated "
          f"rounds, medians (range); {r['cpus']} CPUs, load {r['load_avg'][0]:.1f}")
    for row in r["levels"]:
        a, v, q = row["atom"], row["vllm"], row["ratio_atom_over_vllm"]
        print(f"  concurrency {row['concurrency']} ({row['requests']} requests):")
        for name, s in (("atom", a), ("vllm", v)):
            print(f"    {name:5} {s['tokens_per_s']:7.1f} tok/s {s['tokens_per_s_range']}  "
                  f"TTFT p50/p99 {s['ttft_ms']['p50']}/{s['ttft_ms']['p99']} ms  ITL p50 "
                  f"{s['itl_ms_p50']} ms  CPU {s['cpu_ms_per_token']} ms/token "
                  f"{s['cpu_ms_per_token_range']}")
        print(f"    atom/vLLM: tokens/s {q['tokens_per_s']}x, CPU/token {q['cpu_per_token']}x, "
              f"TTFT p99 {q['ttft_p99']}x, ITL p50 {q['itl_p50']}x; requests with equal "
              f"tokens per round {row['requests_with_equal_tokens']}/{row['requests']}")
        e = row["atom_engine"]
        print(f"    atom's engine: {e['engine_cpu_share']:.0%} of its server's CPU, busy "
              f"{e['engine_busy']:.0%} of the wall, its steps waiting {e['step_wait']:.0%} "
              "of theirs")
    print(f"  ({r['seconds']} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_serve",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--levels", type=int, nargs="+", default=list(LEVELS),
                    choices=list(LEVELS), help="concurrency levels to run (default 1 16 64)")
    ap.add_argument("--requests", type=int, nargs=3, default=list(LEVELS.values()),
                    metavar=("C1", "C16", "C64"), help="requests at each concurrency")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PY,
                    help="the vLLM venv's python (default: .vllm-venv/bin/python)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    levels = {c: n for c, n in zip(LEVELS, a.requests, strict=True) if c in a.levels}
    return emit(run(a.rounds, levels, a.vllm_python), a.json, print_report)


if __name__ == "__main__":
    sys.exit(main())
