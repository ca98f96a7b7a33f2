"""No cross-request corruption, checked on the device's KV itself (`read_block`).

* A cached block's KV is bit-identical before and after any number of decode steps whose idle
  (padding) rows write somewhere, under both scratch disciplines; and it holds exactly the KV of
  its key (compared with a fresh recompute).
* A busy lane's block holds, at every position below the lane's length, exactly the KV its own
  request's tokens give when computed alone on a fresh runtime: it never receives another
  request's KV.

The reference KV of a token sequence comes from prefilling it alone into block 0 of a fresh
one-lane runtime: the arithmetic is exact, so prefill and decode write the same bits for the
same tokens at the same positions.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime

S, C, V = 256, 64, 128
_rng = random.Random(99)
SYSTEM = [_rng.randrange(V) for _ in range(130)]


def _toks(n: int) -> list[int]:
    return [_rng.randrange(V) for _ in range(n)]


SHARED = [SYSTEM + _toks(n) for n in (3, 20, 41)]
OTHER = [_toks(n) for n in (9, 70, 140)]


def make(lanes: int, scratch: str, extra: int = 0) -> AtomBatcher:
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, scratch) + extra,
                 max_seq_len=S, prefill_chunk=C, prefix_cache=True, scratch=scratch)
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)


@functools.cache
def _ref_runtime() -> TorchReferenceRuntime:
    cfg = Config(lanes=1, kv_blocks=1, max_seq_len=S, prefill_chunk=C)
    return TorchReferenceRuntime.tiny(cfg)


@functools.cache
def reference_kv(tokens: tuple[int, ...]) -> torch.Tensor:
    """KV [layers, 2, kv_heads, len(tokens), head_dim] of `tokens` computed alone."""
    rt = _ref_runtime()
    for start in range(0, len(tokens), C):
        chunk = tokens[start:start + C]
        ids = torch.zeros((1, C), dtype=torch.int64)
        ids[0, :len(chunk)] = torch.tensor(chunk)
        pos = torch.arange(start, start + C, dtype=torch.int32)[None]
        rt.prefill(ids, pos, torch.tensor([0], dtype=torch.int16), None,
                   torch.tensor(len(chunk) - 1, dtype=torch.int16))
    return rt.read_block(0)[:, :, :, :len(tokens)].clone()


def full_sequence(b: AtomBatcher, rid: int) -> tuple[int, ...]:
    r = b.requests[rid]
    return tuple(r.prompt + r.tokens)[:S]


def cached(b: AtomBatcher) -> dict[int, tuple[tuple[int, ...], torch.Tensor]]:
    s = b.state
    return {blk: (tuple(s.key[blk]), b.runtime.read_block(blk))
            for blk in range(s.consts.K) if s.owner[blk] == core.OWNER_CACHE}


def padded_decode(b: AtomBatcher) -> bool:
    """The next step is a decode call with at least one padding row."""
    s = b.state
    if b.waiting and any(not x for x in s.busy):
        return False
    live = [s.busy[ln] and s.phase.get(s.lane_req[ln]) == core.PHASE_DECODE
            for ln in range(s.consts.B)]
    prefilling = any(s.busy[ln] and not live[ln] for ln in range(s.consts.B))
    return any(live) and not all(live) and not prefilling


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("extra", [0, 2])  # (2: a block stays free while the long one decodes)
def test_cached_blocks_bit_identical_across_padded_decodes(scratch, extra):
    """Cache three prompts, then decode one long request alone (the other lanes idle, their rows
    padding) for many steps, then a second wave: every block that is a cache entry before and
    after a step is bit-identical (the whole block, not only its key's positions), and holds
    exactly its key's KV. With dynamic scratch and no free block the padding target is a cache
    entry, which the decode evicts (the spec's `decode`): it must not be cached afterwards."""
    b = make(3, scratch, extra)
    for p in (SHARED[0], OTHER[1], OTHER[0]):
        b.submit(p, 2)
    b.run_until_done(max_steps=100)
    assert len(cached(b)) == 3  # and extra free blocks
    b.submit(SHARED[1], 60)  # a hit: copies the system prompt's chunks out of a cache entry
    steps = padded = evicted = 0
    for wave in range(2):
        if wave:
            for p in (SHARED[0], SHARED[2], OTHER[2]):
                b.submit(p, 5)
        while b.busy():
            before = cached(b)
            pad = padded_decode(b)
            pad_block = b.policy.pad(b.state) if pad else None
            b.step()
            b.check_invariants()
            steps += 1
            after = cached(b)
            padded += pad
            for blk, (key, kv) in before.items():
                if blk in after and after[blk][0] == key:
                    assert torch.equal(after[blk][1], kv), (blk, steps)
                elif pad and blk == pad_block:
                    evicted += 1
                    assert scratch == "dynamic"
            for blk, (key, kv) in after.items():
                assert torch.equal(kv[:, :, :, :len(key)], reference_kv(key)), blk
    assert padded >= 50  # the long request decoded alone for most of its 60 tokens
    assert b.stats.prefix_hit_tokens >= 128
    if scratch == "dynamic" and extra == 0:
        assert evicted >= 1  # no free block: some padding row went to a cache entry
    if scratch == "reserved" or extra:
        assert evicted == 0
    ora = oracle_for(b.runtime)
    for r in b.requests.values():
        assert r.error is None and r.tokens == ora.generate(r.prompt, r.max_new_tokens)


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
def test_lane_blocks_hold_only_their_own_requests_kv(scratch):
    """Random interleaving of shared-prefix and unrelated requests over three lanes at the
    minimum K: after every step, every busy lane's block equals its own request's KV, alone,
    at every position below the lane's length."""
    b = make(3, scratch)
    rng = random.Random(5 if scratch == "dynamic" else 6)
    prompts = SHARED * 3 + OTHER * 2
    rng.shuffle(prompts)
    wants = {b.submit(p, n): n for p in prompts for n in [rng.randint(1, 8)]}
    snaps: list[tuple[int, int, torch.Tensor]] = []  # (request, length, block content)
    while b.busy():
        b.step()
        b.check_invariants()
        s = b.state
        for ln in range(s.consts.B):
            if s.busy[ln] and s.length[ln]:
                snaps.append((s.lane_req[ln], s.length[ln],
                              b.runtime.read_block(s.tail[ln])[:, :, :, :s.length[ln]].clone()))
    assert b.stats.prefix_hit_tokens > 0
    # every request seen busy after some step, but one whose prefill ends it (one token
    # wanted) may start and end within a step
    assert {rid for rid, _, _ in snaps} >= {rid for rid, n in wants.items() if n > 1}
    for rid, n, kv in snaps:
        ref = reference_kv(full_sequence(b, rid))
        assert torch.equal(kv, ref[:, :, :, :n]), (rid, n)
