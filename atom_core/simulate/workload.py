"""The requests a seed submits (`make_workload`)."""

from __future__ import annotations

import random

import attrs

from atom_core.simulate.dimensions import PREFILL_CHUNK, SimConfig
from atom_core.simulate.model import VOCAB


@attrs.frozen
class Item:
    """A request of the workload."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    eos: int | None


def make_workload(cfg: SimConfig, n: int) -> list[Item]:
    """`n` requests: many share one of two system prompts longer than a chunk (prefix hits),
    some repeat an earlier prompt exactly, some sit on chunk, window and length edges. With a
    host tier, more system prompts (3 + its slots) and more requests sharing them: more shared
    prefixes than the device cache holds, so that entries are stored and hit on the host."""
    rng = random.Random(f"atom-core-simulate-workload-{cfg.seed}")
    s, c = cfg.max_seq_len, PREFILL_CHUNK
    host = max(cfg.host_cache_blocks, cfg.prefill_host_cache_blocks or 0)
    n_systems, shared = (3 + host, 0.6) if host else (2, 0.4)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(c, c + 40))]
               for _ in range(n_systems)]
    edges = [1, 2, c - 1, c, c + 1, s - 1]
    if cfg.sliding_window is not None:
        w = cfg.sliding_window
        edges += [w - 1, w, w + 1]
    edges = [e for e in edges if 1 <= e < s]
    items: list[Item] = []
    for _ in range(n):
        r = rng.random()
        if r < shared:
            sysp = systems[rng.randrange(n_systems)]
            prompt = (sysp + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))])[:s - 1]
        elif r < shared + 0.1 and items:
            prompt = list(items[rng.randrange(len(items))].prompt)
        else:
            length = rng.choice(edges) if r < shared + 0.3 else rng.randint(1, s - 1)
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
        eos = rng.randrange(VOCAB) if rng.random() < 0.15 else None
        items.append(Item(tuple(prompt), rng.choice((1, 1, 2, 3, 5, 8, 12)), eos))
    return items
