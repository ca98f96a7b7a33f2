"""One HFRuntime decode call, timed: `python -m bench.hf_call` (part of `make bench`).

The model of the end-to-end comparison with vLLM (`bench.hf_serve`: a 26M-parameter random
Llama, hidden 512, 6 layers, 8 query / 4 KV heads, vocab 8192, float32) in a runtime of 16
lanes, block 128, chunk 128; every lane holds a prompt of `--context` tokens (prefilled first),
then decode calls run at 1, 4 and 16 live rows and at torch thread counts 1 and 2, the
settings alternated within each round. A runtime with static shapes (`static_batch`, the
RBLN graphs' semantics, and HFRuntime before it had the capability) is given all 16 rows, the
padding rows aimed at a spare block, as the batcher does; one without computes the live rows
only. Reported: each setting's median call time over `--rounds` rounds (each round's median
of `--calls` calls), with the range.

`--profile`: also a torch profile of 16-row decode calls at one thread: where the time goes,
by operator (self CPU time, the top rows).

To measure another checkout's runtime with the same harness, put its atom_core first on the
path: `PYTHONPATH=/path/to/other python -m bench.hf_call` (one whose runtime protocol has
`capabilities`, which this harness reads the runtime's static shapes and vocabulary from).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from bench import emit

# the model of bench.hf_serve (and of issue 50's measurements)
BENCH_LLAMA = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                   num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64)
LANES, BLOCK, CHUNK, MAX_SEQ = 16, 128, 128, 512
ROWS, THREADS = (1, 4, 16), (1, 2)


def bench_model(path: str, seed: int = 0) -> str:
    """Save the benchmark Llama (seeded random weights, float32) into `path`; returns it."""
    from atom_core.runtime.hf import HFRuntime

    HFRuntime.tiny_llama_model(seed, max_position=MAX_SEQ, **BENCH_LLAMA).save_pretrained(path)
    return path


def run(context: int, rounds: int, calls: int, profile: bool,
        threads: tuple[int, ...] = THREADS) -> dict[str, Any]:
    from atom_core.config import Config
    from atom_core.runtime.hf import HFRuntime
    from atom_core.runtime.protocol import capabilities

    t0 = time.perf_counter()
    per_table = MAX_SEQ // BLOCK
    cfg = Config(lanes=LANES, kv_blocks=LANES * per_table + 2, max_seq_len=MAX_SEQ,
                 block_size=BLOCK, prefill_chunk=CHUNK)
    with tempfile.TemporaryDirectory(prefix="atom-bench-llama-") as tmp:
        rt = HFRuntime.from_pretrained(bench_model(tmp), cfg, num_threads=1)
    caps = capabilities(rt)  # what the runtime is, read once (as the batcher reads it)
    static = caps.static_batch
    assert caps.vocab_size is not None  # (a transformers model always has one)
    spare = cfg.kv_blocks - 1  # no lane's: the padding rows' target
    tables = torch.tensor([[lane * per_table + j for j in range(per_table)]
                           for lane in range(LANES)], dtype=torch.int16)
    gen = torch.Generator().manual_seed(1)
    for lane in range(LANES):
        ids = torch.randint(0, caps.vocab_size, (context,), generator=gen)
        for s in range(0, context, CHUNK):
            part = ids[s:s + CHUNK]
            pad = torch.zeros(CHUNK, dtype=torch.int64)
            pad[:len(part)] = part
            rt.prefill(pad[None], torch.arange(s, s + CHUNK, dtype=torch.int32)[None],
                       tables[lane], None, torch.tensor(len(part) - 1, dtype=torch.int16))

    def args(rows: int) -> tuple[Any, ...]:
        n = LANES if static else rows
        live = torch.arange(n) < rows
        ids = torch.where(live, 7, 0)[:, None]
        pos = torch.where(live, context, 0).to(torch.int32)[:, None]
        tab = torch.where(live[:, None], tables[:n], spare).to(torch.int16)
        return ids, pos, tab, None

    settings = [(th, r) for th in threads for r in ROWS]
    times: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
    for th, r in settings:  # warm-up, untimed
        rt.num_threads = th
        rt.decode(*args(r))
    for _ in range(rounds):
        for th, r in settings:
            rt.num_threads = th
            a = args(r)
            one = []
            for _ in range(calls):
                t = time.perf_counter()
                rt.decode(*a)
                one.append(time.perf_counter() - t)
            times[th, r].append(statistics.median(one))
    report: dict[str, Any] = {
        "model": "bench-llama (26M parameters, float32)", "lanes": LANES, "context": context,
        "static_batch": static, "rounds": rounds, "calls_per_round": calls,
        "decode_ms": {f"threads_{th}_rows_{r}": {
            "median": round(1e3 * statistics.median(times[th, r]), 2),
            "range": [round(1e3 * min(times[th, r]), 2), round(1e3 * max(times[th, r]), 2)]}
            for th, r in settings},
        "machine": {"torch": torch.__version__, "torch_threads_default": torch.get_num_threads()},
    }
    if profile:
        report["profile"] = _profile(rt, args(LANES))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def _profile(rt: Any, args: tuple[Any, ...], calls: int = 5) -> list[dict[str, Any]]:
    """Self CPU time per operator over `calls` 16-row decode calls at one thread, per call."""
    from torch.profiler import ProfilerActivity, profile

    rt.num_threads = 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            rt.decode(*args)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [{"op": e.key, "ms_per_call": round(e.self_cpu_time_total / 1e3 / calls, 2),
             "share": round(e.self_cpu_time_total / total, 3), "count_per_call":
             e.count // calls} for e in rows[:12]]


def print_report(r: dict[str, Any]) -> None:
    print(f"HFRuntime decode call: {r['model']}, {r['lanes']} lanes at context {r['context']}, "
          f"static_batch={r['static_batch']}; median of {r['rounds']} rounds x "
          f"{r['calls_per_round']} calls (range)")
    for k, v in r["decode_ms"].items():
        print(f"  {k.replace('_', ' ')}: {v['median']} ms ({v['range'][0]}-{v['range'][1]})")
    for row in r.get("profile", []):
        print(f"    {row['op']}: {row['ms_per_call']} ms/call ({100 * row['share']:.0f}%, "
              f"{row['count_per_call']} calls)")
    print(f"  ({r['seconds']} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_call",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=list(THREADS),
                    help="torch thread counts to measure (default 1 2)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    return emit(run(a.context, a.rounds, a.calls, a.profile, tuple(a.threads)), a.json,
                print_report)


if __name__ == "__main__":
    sys.exit(main())
