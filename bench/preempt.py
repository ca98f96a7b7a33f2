"""What preemption buys at a fixed KV budget: `python -m bench.preempt`.

Paged tables (T = max_seq_len / block_size blocks per lane) without preemption need every lane's
whole table in blocks (`min_kv_blocks(B, T)`, about B*T + 1), so a budget of K blocks runs only
the lanes that fit. With preemption the rule is one table and a block (T + 1), and B lanes share
the budget: a lane that needs a block and finds none takes it from the youngest lane, which goes
back to the queue and later prefills its prompt and tokens again.

For each budget K (from the preemption minimum up to the rule for B lanes without it), the same
workload (long decodes that cross several block boundaries) runs on the tiny torch reference
runtime twice: without preemption on the most lanes K allows, and with preemption on B lanes.
The report gives the model calls (prefill chunks and decode steps: what an NPU pays for, and
not noisy), the preemptions and the tokens they made the runtime compute again, and the wall
time (median over `--rounds`; the machine is shared, so read the calls first) as generated
tokens per second. Outputs are compared between the two runs: preemption never changes a token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.runtime import TorchReferenceRuntime

SEQ, BLOCK, CHUNK, VOCAB = 512, 64, 64, 128
PREFIX, SCRATCH = True, "dynamic"


def workload(requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts of 30-150 tokens, each generating 100-340: every request crosses block
    boundaries while it decodes, so lanes grow their tables and compete for blocks."""
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(30, 150))], rng.randint(100, 340))
            for _ in range(requests)]


class Counting(TorchReferenceRuntime):
    """The reference runtime, counting its model calls."""

    prefill_calls = 0

    def prefill(self, *args: Any, **kwargs: Any) -> Any:
        self.prefill_calls += 1
        return super().prefill(*args, **kwargs)


def lanes_without(budget: int, t: int, most: int) -> int:
    """The most lanes (up to `most`) whose rule without preemption fits `budget` blocks."""
    fit = [b for b in range(1, most + 1) if min_kv_blocks(b, PREFIX, SCRATCH, t) <= budget]
    return max(fit, default=0)


def run(work: list[tuple[list[int], int]], lanes: int, kv_blocks: int,
        preemption: bool) -> tuple[dict[str, Any], list[list[int]]]:
    cfg = Config(lanes=lanes, kv_blocks=kv_blocks, max_seq_len=SEQ, block_size=BLOCK,
                 prefill_chunk=CHUNK, prefix_cache=PREFIX, scratch=SCRATCH,
                 preemption=preemption)
    rt = Counting.tiny(cfg, seed=0, layers=2)
    b = AtomBatcher(cfg, rt)
    ids = [b.submit(p, n) for p, n in work]
    t0 = time.perf_counter()
    b.run_until_done()
    wall = time.perf_counter() - t0
    out = [b.requests[i].tokens for i in ids]
    if any(b.requests[i].error for i in ids):
        raise RuntimeError(f"a request failed: {[b.requests[i].error for i in ids]}")
    s = b.stats
    return ({"lanes": lanes, "kv_blocks": kv_blocks, "preemption": preemption,
             "prefill_calls": rt.prefill_calls, "decode_steps": s.decode_steps,
             "model_calls": rt.prefill_calls + s.decode_steps,
             "prefill_tokens": s.prefill_tokens, "generated_tokens": s.generated_tokens,
             "preemptions": s.preemptions, "recomputed_tokens": s.recomputed_tokens,
             "wall_s": wall}, out)


def measure(work: list[tuple[list[int], int]], lanes: int, kv_blocks: int, preemption: bool,
            rounds: int) -> tuple[dict[str, Any], list[list[int]]]:
    walls = []
    for _ in range(rounds):
        row, out = run(work, lanes, kv_blocks, preemption)
        walls.append(row.pop("wall_s"))
    row["wall_median_s"] = round(statistics.median(walls), 3)
    row["tokens_per_s"] = round(row["generated_tokens"] / statistics.median(walls), 1)
    return row, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--lanes", type=int, default=4, help="lanes with preemption")
    ap.add_argument("--rounds", type=int, default=3, help="wall-time rounds per run (median)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # a shared machine: torch's thread pool only adds noise here
    t = SEQ // BLOCK
    work = workload(args.requests)
    low = min_kv_blocks(args.lanes, PREFIX, SCRATCH, t, preemption=True)
    high = min_kv_blocks(args.lanes, PREFIX, SCRATCH, t)
    budgets = sorted({low, *(k for b in range(1, args.lanes + 1)
                             if (k := min_kv_blocks(b, PREFIX, SCRATCH, t)) >= low)})
    rows = []
    for k in budgets:
        with_p, out_p = measure(work, args.lanes, k, True, args.rounds)
        n = lanes_without(k, t, args.lanes)
        without = None
        if n:
            without, out_n = measure(work, n, k, False, args.rounds)
            if out_n != out_p:
                raise AssertionError(f"K={k}: preemption changed the generated tokens")
        ratio = (round(without["model_calls"] / with_p["model_calls"], 2) if without else None)
        rows.append({"kv_blocks": k, "with_preemption": with_p, "without_preemption": without,
                     "model_calls_ratio": ratio})
    report = {"requests": args.requests, "prompt_tokens": sum(len(p) for p, _ in work),
              "max_new_tokens": sum(n for _, n in work), "max_seq_len": SEQ,
              "block_size": BLOCK, "blocks_per_table": t, "chunk": CHUNK,
              "prefix_cache": PREFIX, "scratch": SCRATCH, "lanes": args.lanes,
              "rule_with_preemption": low, "rule_without_preemption": high, "budgets": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"preemption at a fixed KV budget: {args.requests} requests, "
          f"{report['prompt_tokens']} prompt tokens, {report['max_new_tokens']} to generate; "
          f"T = {t} blocks of {BLOCK}; rule for {args.lanes} lanes: {high} blocks without "
          f"preemption, {low} with")
    for r in rows:
        p, n = r["with_preemption"], r["without_preemption"]
        print(f"  K = {r['kv_blocks']:3}:")
        if n is None:
            print(f"    without preemption: no lane fits (the rule for one lane is "
                  f"{min_kv_blocks(1, PREFIX, SCRATCH, t)})")
        else:
            print(f"    without preemption, {n['lanes']} lane(s): {_line(n)}")
        print(f"    with preemption, {p['lanes']} lanes:  {_line(p)}; preemptions "
              f"{p['preemptions']}, tokens recomputed {p['recomputed_tokens']}")
        if r["model_calls_ratio"] is not None:
            print(f"    model calls without / with preemption: {r['model_calls_ratio']}x")
    return 0


def _line(r: dict[str, Any]) -> str:
    return (f"{r['model_calls']} model calls ({r['prefill_calls']} prefill, "
            f"{r['decode_steps']} decode), {r['prefill_tokens']} prefill tokens, "
            f"{r['tokens_per_s']} tokens/s (wall {r['wall_median_s']} s)")


if __name__ == "__main__":
    raise SystemExit(main())
