"""AtomBatcher overhead per decode step, without the model: `python -m bench.batcher`.

The runtime is a stub whose prefill and decode return precomputed logits at once, so a step's
time is the batcher's own work: the policy's padding choice, the core's `decode_plan` and
`decode` transitions, building the input tensors, the host-side argmax over the logits, token
bookkeeping and events. The stub's own time is measured around each call and subtracted.

Configuration: B = 8 and B = 32 lanes, every lane decoding (prompts of 100 tokens, generation
until the KV block is full), K = B + 1 (prefix cache, dynamic scratch), max_seq_len 4096,
chunk 128, ghost state off (production) and on (verification), vocabularies of 128 (the tiny
model: bookkeeping only) and 32000 (a real model's argmax, ghost off); and paged tables
(128-token blocks: T = 32 per lane, K = 32 B, tables grown in decode; vocabulary 128, ghost
off). A round times `--steps`
decode steps; the report gives the median and quartiles over `--rounds` rounds, in
microseconds per step and per lane. The garbage collector is off during a round, and torch runs
single-threaded (`torch.set_num_threads(1)`): on a shared machine torch's intra-op pool makes
the host-side argmax over [B, 32000] logits some 30x slower (threads wait for each other), so
the report also times that argmax alone at the default thread count and at one thread.

Also: the scheduler's share of a decode step at B = 32 on the torch reference runtime (the tiny
model): the step's wall time less the runtime's decode call, over the step's wall time. And
tokens/s of the demo workload (`atom-core demo`, without its oracle check) on the torch
reference runtime, model time included.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from time import perf_counter_ns
from typing import Any

import torch

from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.runtime.protocol import smallest_decode_batch
from bench import emit

LANES = (8, 32)
VOCABS = (128, 32000)
MAX_SEQ, CHUNK, PROMPT = 4096, 128, 100
ROUNDS, STEPS = 15, 200
QUICK_ROUNDS, QUICK_STEPS = 3, 20
MODES = {"ghost_off": False, "ghost_on": True}
# Paged tables: the same workload with 128-token blocks (T = 32 blocks per lane, K = 32 B):
# every lane grows its table every 128 tokens, and every decode call takes a [B, T] table.
PAGED_BLOCK = 128


class StubRuntime:
    """The Runtime protocol with no model: logits are precomputed (token 1 everywhere).
    `ns` accumulates the time spent inside the stub's calls."""

    uses_local_block_tables = False

    def __init__(self, cfg: Config, vocab: int) -> None:
        self.num_blocks, self.block_size = cfg.kv_blocks, cfg.block_size
        self.max_seq_len, self.prefill_chunk = cfg.max_seq_len, cfg.prefill_chunk
        self.batch_size = cfg.lanes
        self.decoder_batch_sizes = (cfg.lanes,)
        self.vocab_size = vocab
        self._prefill = torch.zeros((1, 1, vocab))
        self._prefill[0, 0, 1] = 1.0
        self._decode = torch.zeros((cfg.lanes, 1, vocab))
        self._decode[:, 0, 1] = 1.0
        self.ns = 0

    def prefill(self, *args: Any) -> torch.Tensor:
        t = perf_counter_ns()
        out = self._prefill
        self.ns += perf_counter_ns() - t
        return out

    def decode(self, *args: Any) -> torch.Tensor:
        t = perf_counter_ns()
        out = self._decode
        self.ns += perf_counter_ns() - t
        return out

    def decode_batch_size(self, busy_rows: Iterable[int]) -> int:
        return smallest_decode_batch(self.decoder_batch_sizes, busy_rows)

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        pass


def decoding_batcher(lanes: int, vocab: int, ghost: bool,
                     block: int = MAX_SEQ) -> tuple[AtomBatcher, StubRuntime]:
    """A batcher with every lane decoding (and room for MAX_SEQ - PROMPT decode steps)."""
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, "dynamic", MAX_SEQ // block),
                 max_seq_len=MAX_SEQ, block_size=block, prefill_chunk=CHUNK,
                 prefix_cache=True, scratch="dynamic")
    rt = StubRuntime(cfg, vocab)
    b = AtomBatcher(cfg, rt, ghost=ghost)
    for i in range(lanes):
        b.submit([(i * 7 + j) % vocab for j in range(PROMPT)], MAX_SEQ)
    for _ in range(lanes):  # one prefill per step
        b.step()
    assert b.stats.decode_steps == 0 and len(b.requests) == lanes
    assert all(len(r.tokens) == 1 for r in b.requests.values())
    return b, rt


def decode_rounds(lanes: int, vocab: int, ghost: bool, rounds: int, steps: int,
                  block: int = MAX_SEQ) -> list[float]:
    """Microseconds per decode step (stub time subtracted), one value per round."""
    b, rt = decoding_batcher(lanes, vocab, ghost, block)
    for _ in range(min(steps, 20)):  # warm-up
        b.step()
    out = []
    for _ in range(rounds):
        d0 = b.stats.decode_steps
        gc.collect()
        gc.disable()
        try:
            rt.ns = 0
            t = perf_counter_ns()
            for _ in range(steps):
                b.step()
            total = perf_counter_ns() - t - rt.ns
        finally:
            gc.enable()
        assert b.stats.decode_steps - d0 == steps  # every step was one decode over B rows
        out.append(total / steps / 1000)
    assert not b.stats.decode_rows_padding
    return out


def summarize(xs: list[float], lanes: int) -> dict[str, float]:
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return {"median_us_per_step": round(med, 2), "q1_us": round(q1, 2), "q3_us": round(q3, 2),
            "median_us_per_lane": round(med / lanes, 3)}


def demo_throughput(requests: int, max_new_tokens: int) -> dict[str, Any]:
    from atom_core.demo import demo_config, serve, workload
    from atom_core.runtime.reference import TorchReferenceRuntime

    cfg = demo_config(4)
    rt = TorchReferenceRuntime.tiny(cfg)
    b = AtomBatcher(cfg, rt)
    _, wall = serve(b, workload(requests, max_new_tokens, 0, rt.vocab_size, cfg.max_seq_len))
    st = b.stats
    return {"lanes": cfg.lanes, "kv_blocks": cfg.kv_blocks, "requests": requests,
            "max_new_tokens": max_new_tokens, "generated_tokens": st.generated_tokens,
            "prefix_hit_tokens": st.prefix_hit_tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(st.generated_tokens / wall, 1)}


def scheduler_share(lanes: int, steps: int, rounds: int) -> dict[str, Any]:
    """The batcher's share of a decode step on the torch reference runtime (the tiny model, one
    torch thread): each step's wall time, and the time inside the runtime's decode call; the
    rest is the scheduler's (core, policy, adapter, argmax, bookkeeping). Median over rounds."""
    from atom_core.runtime.reference import TorchReferenceRuntime

    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, "dynamic"),
                 max_seq_len=MAX_SEQ, block_size=MAX_SEQ, prefill_chunk=CHUNK,
                 prefix_cache=True, scratch="dynamic")
    rt = TorchReferenceRuntime.tiny(cfg)
    b = AtomBatcher(cfg, rt)
    for i in range(lanes):
        b.submit([(i * 7 + j) % rt.vocab_size for j in range(PROMPT)], MAX_SEQ)
    while b.stats.decode_steps == 0 or any(len(r.tokens) < 1 for r in b.requests.values()):
        b.step()
    inner = rt.decode
    spent = [0]

    def timed(*args: Any, **kw: Any) -> Any:
        t = perf_counter_ns()
        try:
            return inner(*args, **kw)
        finally:
            spent[0] += perf_counter_ns() - t
    rt.decode = timed  # type: ignore[method-assign]
    for _ in range(10):  # warm-up
        b.step()
    step_us, model_us = [], []
    for _ in range(rounds):
        d0, spent[0] = b.stats.decode_steps, 0
        gc.collect()
        gc.disable()
        try:
            t = perf_counter_ns()
            for _ in range(steps):
                b.step()
            total = perf_counter_ns() - t
        finally:
            gc.enable()
        assert b.stats.decode_steps - d0 == steps
        step_us.append(total / steps / 1000)
        model_us.append(spent[0] / steps / 1000)
    shares = [(s - m) / s for s, m in zip(step_us, model_us, strict=True)]
    return {"lanes": lanes, "step_us": round(statistics.median(step_us), 1),
            "runtime_decode_us": round(statistics.median(model_us), 1),
            "scheduler_us": round(statistics.median(
                [s - m for s, m in zip(step_us, model_us, strict=True)]), 1),
            "scheduler_share": round(statistics.median(shares), 3)}


def argmax_us(lanes: int, vocab: int, threads: int, calls: int) -> float:
    """Median microseconds of the batcher's host-side argmax over [lanes, 1, vocab] logits."""
    x = torch.randn((lanes, 1, vocab))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ts = []
        for _ in range(calls):
            t = perf_counter_ns()
            torch.argmax(x[:, -1, :], dim=-1).tolist()
            ts.append((perf_counter_ns() - t) / 1000)
    finally:
        torch.set_num_threads(old)
    return round(statistics.median(ts), 1)


def run(rounds: int, steps: int, quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    default_threads = torch.get_num_threads()
    rows: dict[str, Any] = {}
    argmax: dict[str, Any] = {}
    torch.set_num_threads(1)
    try:
        for lanes in LANES:
            for vocab in VOCABS:
                modes = MODES if vocab == VOCABS[0] else {"ghost_off": False}
                row = {mode: summarize(decode_rounds(lanes, vocab, ghost, rounds, steps), lanes)
                       for mode, ghost in modes.items()}
                if vocab == VOCABS[0]:
                    row["paged_ghost_off"] = summarize(decode_rounds(
                        lanes, vocab, False, rounds, steps, PAGED_BLOCK), lanes)
                rows[f"B={lanes},V={vocab}"] = {"lanes": lanes, "vocab": vocab, **row}
            calls = 5 if quick else 30
            argmax[f"B={lanes},V={VOCABS[-1]}"] = {
                f"threads_{default_threads}": argmax_us(lanes, VOCABS[-1], default_threads,
                                                        calls),
                "threads_1": argmax_us(lanes, VOCABS[-1], 1, calls)}
        share = scheduler_share(32, steps, rounds)
    finally:
        torch.set_num_threads(default_threads)
    demo = demo_throughput(8, 4) if quick else demo_throughput(24, 16)
    return {
        "method": "stub runtime (precomputed logits), its call time subtracted; "
                  f"median of {rounds} rounds of {steps} decode steps, every lane decoding",
        "config": {"kv_blocks": "lanes + 1 (paged: 32 * lanes)", "max_seq_len": MAX_SEQ,
                   "paged_block_size": PAGED_BLOCK, "prefill_chunk": CHUNK,
                   "prefix_cache": True, "scratch": "dynamic", "prompt_tokens": PROMPT},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads_default": default_threads, "torch_threads_timed": 1},
        "decode_overhead": rows,
        "argmax_alone_us": argmax,
        "scheduler_share": share,
        "demo": demo,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def print_table(report: dict[str, Any]) -> None:
    cols = ["lanes", "vocab", "mode", "us/step (median)", "Q1-Q3", "us/lane"]
    rows = []
    for r in report["decode_overhead"].values():
        for mode in (*MODES, "paged_ghost_off"):
            if mode not in r:
                continue
            s = r[mode]
            rows.append([str(r["lanes"]), str(r["vocab"]), mode,
                         f"{s['median_us_per_step']:.1f}", f"{s['q1_us']:.1f}-{s['q3_us']:.1f}",
                         f"{s['median_us_per_lane']:.2f}"])
    d = report["demo"]
    note = (f"demo workload on the torch reference runtime (model included): "
            f"{d['generated_tokens']} tokens from {d['requests']} requests on {d['lanes']} "
            f"lanes in {d['wall_s']:.2f} s = {d['tokens_per_s']:.0f} tokens/s")
    am = "; ".join(f"{k}: " + ", ".join(f"{t.replace('_', ' ')} {v} us" for t, v in x.items())
                   for k, x in report["argmax_alone_us"].items())
    sh = report["scheduler_share"]
    note = (f"host argmax alone (median): {am}\n{note}\n"
            f"scheduler's share of a decode step on the reference runtime (tiny model, B = "
            f"{sh['lanes']}, one thread): {sh['scheduler_us']:.0f} us of {sh['step_us']:.0f} us "
            f"per step = {sh['scheduler_share']:.1%} (runtime decode {sh['runtime_decode_us']:.0f} "
            f"us)")
    title = "AtomBatcher overhead per decode step, runtime call excluded"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(cols))
        for r in rows:
            print("  ".join(r))
        print(report["method"])
        print(note)
        return
    t = Table(title=title, caption=report["method"])
    for c in cols:
        t.add_column(c, justify="left" if c == "mode" else "right")
    for r in rows:
        t.add_row(*r)
    Console().print(t)
    print(note)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batcher",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_ROUNDS} rounds of {QUICK_STEPS} steps, a small demo (smoke)")
    ap.add_argument("--rounds", type=int, help=f"timed rounds (default {ROUNDS})")
    ap.add_argument("--steps", type=int, help=f"decode steps per round (default {STEPS})")
    args = ap.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if (rounds * steps + 20) > MAX_SEQ - PROMPT:
        ap.error(f"rounds * steps must stay below {MAX_SEQ - PROMPT - 20} "
                 "(a lane's KV block fills up)")
    report = run(rounds, steps, args.quick)
    return emit(report, args.json, print_table)


if __name__ == "__main__":
    sys.exit(main())
