"""HFRuntime against transformers' own generate(): `python -m bench.hf` (part of `make bench`).

The demo workload (`atom-core demo`: most prompts share a 160-token system prompt, the rest
unrelated; greedy, a fixed number of new tokens each) on one transformers model (tiny-llama by
default, float32, `--model DIR|tiny-llama|tiny-gemma3`), served four ways:

- `hf_runtime`: AtomBatcher over HFRuntime (the demo's Config: `--lanes` lanes, prefix cache on,
  dynamic scratch): continuous batching through the paged KV layout;
- `hf_runtime_no_prefix`: the same with the prefix cache off (what batching alone buys);
- `generate_serial`: `model.generate(do_sample=False)` one request at a time (transformers'
  default attention, its own cache);
- `generate_batched`: transformers' batched generate over the same prompts in batches of
  `--lanes` (left padding with an attention mask: the same concurrency as the lanes).

With `--mixed`, the requests' output lengths differ (a quarter to twice `--max-new-tokens`,
seeded), as end-of-sequence tokens make them in real traffic: batched generate runs each batch
to its longest member, continuous batching refills a lane as soon as its request ends.

Tokens/s = generated tokens / wall seconds of the whole workload; each method's median over
`--rounds` rounds (one untimed warm-up call first), and the ratios hf_runtime / generate_* from
the same run. All four at two torch thread counts: 1 and torch's default (HFRuntime through its
`num_threads`, generate through `torch.set_num_threads`), which is how HFRuntime's default of
the "auto" default (`atom_core.runtime.hf.DEFAULT_THREADS`: one thread for the tiny models,
torch's setting for `--model small-llama` and larger) was chosen. Also reported: how many
requests' tokens equal `generate_serial`'s (float32: the paged attention rounds differently,
so a near-tie may flip; the float64 token-exact checks are the tests' and the demo's).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from atom_core.batcher import AtomBatcher
from atom_core.demo import MODEL_SEED, demo_config, workload
from atom_core.runtime.hf import (
    TINY_MODELS,
    HFRuntime,
    tiny_model,
    with_model_window,
)
from bench import emit

LANES, REQUESTS, NEW_TOKENS, ROUNDS = 4, 24, 16, 3
QUICK_REQUESTS, QUICK_TOKENS, QUICK_ROUNDS = 4, 4, 1
METHODS = ("hf_runtime", "hf_runtime_no_prefix", "generate_serial", "generate_batched")


# `--model small-llama`: an 18M-parameter Llama (seeded weights), where a call's compute, not its
# fixed cost, dominates; the tiny models show the opposite end
SMALL_LLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64)


def load(name: str, lanes: int) -> tuple[Any, Any]:
    """(the model with the paged attention, the Config of the demo for it)."""
    cfg = with_model_window(demo_config(lanes), name)
    if name == "small-llama":
        import tempfile

        from transformers import AutoModelForCausalLM

        from atom_core.runtime.hf import ATTENTION
        m = HFRuntime.tiny_llama_model(MODEL_SEED, max_position=cfg.max_seq_len, **SMALL_LLAMA)
        with tempfile.TemporaryDirectory(prefix="atom-small-llama-") as tmp:
            m.save_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True,
                                                         attn_implementation=ATTENTION)
        return model, cfg
    if name in TINY_MODELS:
        model = tiny_model(name, cfg.max_seq_len, window=cfg.sliding_window, seed=MODEL_SEED)
    else:
        model = HFRuntime.from_pretrained(name, cfg).model
    return model, cfg


def mixed(items: list[Any], new_tokens: int, max_seq_len: int, seed: int = 1) -> list[Any]:
    """The items with output lengths of a quarter to twice `new_tokens` (seeded), each within
    max_seq_len."""
    rng = random.Random(seed)
    choices = sorted({max(1, new_tokens // 4), max(1, new_tokens // 2), new_tokens,
                      2 * new_tokens})
    return [attrs.evolve(it, max_new_tokens=min(rng.choice(choices),
                                                max_seq_len - len(it.prompt)))
            for it in items]


def run_runtime(model: Any, cfg: Any, items: list[Any], threads: int | None) -> list[list[int]]:
    rt = HFRuntime.for_config(model, cfg, num_threads=threads)
    b = AtomBatcher(cfg, rt)
    rids = [b.submit(it.prompt, it.max_new_tokens) for it in items]
    out = b.run_until_done()
    return [out[r].tokens for r in rids]


def run_serial(gen: Any, items: list[Any]) -> list[list[int]]:
    toks = []
    for it in items:
        ids = torch.tensor([it.prompt])
        out = gen.generate(ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=it.max_new_tokens, min_new_tokens=it.max_new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        toks.append(out[0, ids.shape[1]:].tolist())
    return toks


def run_batched(gen: Any, items: list[Any], batch: int) -> list[list[int]]:
    """Batches of `batch` prompts, left-padded (pad id 0, masked), as transformers does it."""
    toks = []
    for i in range(0, len(items), batch):
        group = items[i:i + batch]
        width = max(len(it.prompt) for it in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, it in enumerate(group):
            ids[row, width - len(it.prompt):] = torch.tensor(it.prompt)
            mask[row, width - len(it.prompt):] = 1
        n = max(it.max_new_tokens for it in group)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        toks += [out[row, width:width + it.max_new_tokens].tolist()
                 for row, it in enumerate(group)]
    return toks


def timed(fn: Callable[[], list[list[int]]], threads: int | None) -> tuple[float, list[list[int]]]:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            toks = fn()
        return time.perf_counter() - t0, toks
    finally:
        torch.set_num_threads(before)


def run(model_name: str, lanes: int, requests: int, new_tokens: int,
        rounds: int, lengths: str = "fixed") -> dict[str, Any]:
    t_start = time.perf_counter()
    default_threads = torch.get_num_threads()
    model, cfg = load(model_name, lanes)
    no_prefix = with_model_window(demo_config(lanes, prefix_cache=False), model_name)
    gen = _generate_copy(model)
    items = workload(requests, new_tokens, 0, int(model.config.vocab_size), cfg.max_seq_len)
    if lengths == "mixed":
        items = mixed(items, new_tokens, cfg.max_seq_len)
    total = sum(it.max_new_tokens for it in items)
    warm = items[:1]
    fns: dict[str, Callable[[int | None], list[list[int]]]] = {
        "hf_runtime": lambda th: run_runtime(model, cfg, items, th),
        "hf_runtime_no_prefix": lambda th: run_runtime(model, no_prefix, items, th),
        "generate_serial": lambda th: run_serial(gen, items),
        "generate_batched": lambda th: run_batched(gen, items, lanes),
    }
    settings: dict[str, int | None] = {"threads_1": 1, f"threads_{default_threads}": None}
    if default_threads == 1:
        settings = {"threads_1": 1}
    by_setting: dict[str, Any] = {}
    for label, th in settings.items():
        timed(lambda th=th: run_runtime(model, cfg, warm, th), th)  # warm-up, untimed
        timed(lambda: run_serial(gen, warm), th)
        walls: dict[str, list[float]] = {m: [] for m in METHODS}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(rounds):
            for m in METHODS:
                wall, tokens[m] = timed(lambda m=m, th=th: fns[m](th), th)
                walls[m].append(wall)
        tps = {m: round(total / statistics.median(walls[m]), 1) for m in METHODS}
        ref = tokens["generate_serial"]
        by_setting[label] = {
            "tokens_per_s": tps,
            "wall_s_median": {m: round(statistics.median(walls[m]), 3) for m in METHODS},
            "ratio_vs_generate_serial": round(tps["hf_runtime"] / tps["generate_serial"], 2),
            "ratio_vs_generate_batched": round(tps["hf_runtime"] / tps["generate_batched"], 2),
            "tokens": {m: sum(map(len, tokens[m])) for m in METHODS},
            "requests_equal_to_generate_serial": {
                m: sum(a == b for a, b in zip(tokens[m], ref, strict=True)) for m in METHODS},
        }
    thread_effect = None
    if len(settings) == 2:
        one, dflt = (by_setting[k]["tokens_per_s"] for k in settings)
        thread_effect = {m: round(one[m] / dflt[m], 2) for m in METHODS}
    return {
        "method": f"demo workload, tokens/s = generated tokens / wall s, median of {rounds} "
                  "rounds; ratios hf_runtime / generate_* from the same run",
        "model": model_name, "dtype": "float32",
        "config": {"lanes": cfg.lanes, "kv_blocks": cfg.kv_blocks,
                   "max_seq_len": cfg.max_seq_len, "prefill_chunk": cfg.prefill_chunk,
                   "prefix_cache": cfg.prefix_cache, "sliding_window": cfg.sliding_window},
        "requests": requests, "max_new_tokens": new_tokens, "lengths": lengths,
        "generated_tokens": total,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads_default": default_threads},
        "by_threads": by_setting,
        "threads_1_over_default": thread_effect,
        "seconds": round(time.perf_counter() - t_start, 1),
    }


def _generate_copy(model: Any) -> Any:
    """The same weights with transformers' default attention (generate's own path)."""
    import copy

    gen = copy.deepcopy(model)
    gen.set_attn_implementation("sdpa")
    return gen.eval()


def print_report(r: dict[str, Any]) -> None:
    each = (f"{r['max_new_tokens']} tokens" if r["lengths"] == "fixed" else
            f"{r['generated_tokens']} tokens in all (mixed lengths around {r['max_new_tokens']})")
    print(f"HFRuntime vs transformers generate: {r['model']} ({r['dtype']}), {r['requests']} "
          f"requests x {each}, {r['config']['lanes']} lanes; "
          f"{r['method']}")
    for label, s in r["by_threads"].items():
        tps = ", ".join(f"{m} {v:.0f}" for m, v in s["tokens_per_s"].items())
        print(f"  {label.replace('_', ' ')}: tokens/s {tps}")
        print(f"    hf_runtime / generate_serial = {s['ratio_vs_generate_serial']}x, "
              f"hf_runtime / generate_batched = {s['ratio_vs_generate_batched']}x; requests "
              f"equal to generate_serial: {s['requests_equal_to_generate_serial']}")
    if r["threads_1_over_default"]:
        eff = ", ".join(f"{m} {v}x" for m, v in r["threads_1_over_default"].items())
        print(f"  one thread / torch's default ({r['machine']['torch_threads_default']}): {eff}")
    print(f"  ({r['seconds']} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama",
                    metavar="DIR|tiny-llama|tiny-gemma3|small-llama")
    ap.add_argument("--lanes", type=int, default=LANES)
    ap.add_argument("--requests", type=int, default=None, help=f"default {REQUESTS}")
    ap.add_argument("--max-new-tokens", type=int, default=None, help=f"default {NEW_TOKENS}")
    ap.add_argument("--rounds", type=int, default=None, help=f"default {ROUNDS}")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_REQUESTS} requests x {QUICK_TOKENS} tokens, {QUICK_ROUNDS} "
                         "round (smoke)")
    ap.add_argument("--mixed", action="store_true",
                    help="output lengths from a quarter to twice --max-new-tokens (seeded)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    report = run(args.model, args.lanes,
                 args.requests or (QUICK_REQUESTS if args.quick else REQUESTS),
                 args.max_new_tokens or (QUICK_TOKENS if args.quick else NEW_TOKENS),
                 args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS),
                 "mixed" if args.mixed else "fixed")
    return emit(report, args.json, print_report)


if __name__ == "__main__":
    sys.exit(main())
