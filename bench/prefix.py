"""Prefill tokens the prefix cache and its host tier save: `python -m bench.prefix`.

Prefix cache: requests sharing a system prompt (several whole chunks and a bit), each with its
own suffix, plus some unrelated prompts, on the tiny torch reference runtime. For a plain model
(one block per sequence, and paged tables of 128-token blocks, where a hit spans several
blocks) and a hybrid one (sliding window W, where a hit also restores a sliding-state snapshot), it
reports the prompt tokens computed by prefill with and without the prefix cache, the tokens
hits copied instead, the snapshots taken and their host memory, and the wall time (model
included; a shared machine is noisy, so the token counts are the figures to read).

Host tier: requests drawn from more system prompts than the device cache holds entries (at the
proved minimum of blocks), served with host_cache_blocks = 0 and = H: prefill tokens computed,
tokens copied from device entries and loaded from host slots, stores. Once with one block per
sequence, once with paged tables (each host entry one block at its position: a hit past a
table's first block loads it with `grow_host_hit`; 2H slots).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.runtime import TorchReferenceRuntime

SEQ, CHUNK, VOCAB = 1024, 64, 128
# Paged tables (T = 8 by default): a hit on the shared system prompt spans several blocks, each
# copied from the entry at its position (`grow_hit`)
PAGED_BLOCK = 128


def workload(requests: int, system: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(VOCAB) for _ in range(system)]
    out = []
    for i in range(requests):
        if i % 8 == 7:  # an unrelated prompt now and then
            p = [rng.randrange(VOCAB) for _ in range(rng.randint(20, system))]
        else:
            p = sys_prompt + [rng.randrange(VOCAB) for _ in range(rng.randint(20, 100))]
        out.append((p, rng.randint(4, 16)))
    return out


def many_systems(requests: int, systems: int, seed: int = 1) -> list[tuple[list[int], int]]:
    """Requests over `systems` system prompts of 2-4 chunks and a bit, in random order."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 4) * CHUNK + 10)]
               for _ in range(systems)]
    return [(rng.choice(prompts) + [rng.randrange(VOCAB) for _ in range(rng.randint(5, 40))],
             rng.randint(2, 8)) for _ in range(requests)]


def run(work: list[tuple[list[int], int]], lanes: int, prefix: bool,
        window: int | None, host: int = 0, extra: int = 2, block: int = SEQ) -> dict[str, Any]:
    t = SEQ // block
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, "dynamic", t) + extra * t,
                 max_seq_len=SEQ, block_size=block, prefill_chunk=CHUNK, prefix_cache=prefix,
                 sliding_window=window, host_cache_blocks=host)
    model: dict[str, Any] = {"layers": 3}
    if window is not None:
        model.update(sliding_window=window, global_every=3)
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg, seed=0, **model))
    for p, n in work:
        b.submit(p, n)
    t0 = time.perf_counter()
    b.run_until_done()
    wall = time.perf_counter() - t0
    snap_bytes = 0
    if b.stats.snapshots:
        one = b.runtime.new_local_host_buffer()
        snap_bytes = one.numel() * one.element_size()
    return {"prefill_tokens": b.stats.prefill_tokens,
            "prefix_hit_tokens": b.stats.prefix_hit_tokens,
            "host_hit_tokens": b.stats.host_hit_tokens, "host_stores": b.stats.host_stores,
            "snapshots": b.stats.snapshots, "snapshot_bytes_each": snap_bytes,
            "wall_s": round(wall, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system", type=int, default=300, help="shared system prompt tokens")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--block", type=int, default=PAGED_BLOCK,
                    help="block size of the paged-tables run (a divisor of 1024)")
    ap.add_argument("--systems", type=int, default=8,
                    help="host tier: distinct system prompts (more than the device cache holds)")
    ap.add_argument("--host-blocks", type=int, default=8, help="host tier: slots")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = workload(args.requests, args.system)
    total = sum(len(p) for p, _ in work)
    rows = {}
    for name, window, block in (("plain", None, SEQ),
                                (f"plain, blocks of {args.block}", None, args.block),
                                (f"hybrid W={args.window}", args.window, SEQ)):
        off = run(work, args.lanes, False, window, block=block)
        on = run(work, args.lanes, True, window, block=block)
        rows[name] = {"cache_off": off, "cache_on": on,
                      "saved": off["prefill_tokens"] - on["prefill_tokens"],
                      "saved_fraction": round(1 - on["prefill_tokens"] / off["prefill_tokens"],
                                              3)}
    hwork = many_systems(args.requests, args.systems)
    host_rows = {}
    # (a paged entry is one block of `--block` tokens, a prompt holds several: twice the slots)
    for name, block, slots in (("one block", SEQ, args.host_blocks),
                               (f"blocks of {args.block}", args.block, 2 * args.host_blocks)):
        tiers = {f"host_cache_blocks={h}": run(hwork, args.lanes, True, None, host=h, extra=0,
                                               block=block) for h in (0, slots)}
        base, tier = tiers["host_cache_blocks=0"], tiers[f"host_cache_blocks={slots}"]
        host_rows[name] = {"kv_blocks": min_kv_blocks(args.lanes, True, "dynamic", SEQ // block),
                           "runs": tiers, "saved": base["prefill_tokens"] - tier["prefill_tokens"]}
    out = {"requests": args.requests, "prompt_tokens": total, "system": args.system,
           "lanes": args.lanes, "chunk": CHUNK, "models": rows,
           "host_tier": {"systems": args.systems,
                         "prompt_tokens": sum(len(p) for p, _ in hwork),
                         "tables": host_rows}}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"prefix cache on a shared-system-prompt workload: {args.requests} requests, "
          f"{total} prompt tokens, system prompt {args.system}, {args.lanes} lanes, "
          f"chunk {CHUNK}")
    for name, r in rows.items():
        on, off = r["cache_on"], r["cache_off"]
        print(f"  {name:20} prefill tokens {off['prefill_tokens']:6} -> "
              f"{on['prefill_tokens']:6} ({r['saved_fraction']:.0%} saved; hits copied "
              f"{on['prefix_hit_tokens']}; snapshots {on['snapshots']} x "
              f"{on['snapshot_bytes_each']} B); wall {off['wall_s']} s -> {on['wall_s']} s")
    ht = out["host_tier"]
    print(f"host tier: {args.requests} requests over {args.systems} system prompts, "
          f"{ht['prompt_tokens']} prompt tokens, KV blocks at the minimum")
    for tables, row in ht["tables"].items():
        print(f"  {tables}, {row['kv_blocks']} KV blocks:")
        for name, r in row["runs"].items():
            print(f"    {name:22} prefill tokens {r['prefill_tokens']:6}; copied from device "
                  f"entries {r['prefix_hit_tokens']:5}; loaded from host "
                  f"{r['host_hit_tokens']:5}; stores {r['host_stores']}; wall {r['wall_s']} s")
        print(f"    the host tier saves {row['saved']} prefill tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
