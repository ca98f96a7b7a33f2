"""Hybrid prefix caching: a hit restores the sliding-window state from a snapshot at its length.

A prefix hit copies the global layers' KV; a hybrid model's sliding layers keep theirs in the
lane's local ring, which a hit must restore at exactly the hit's length. The host keeps a
snapshot of the ring at each chunk boundary of a prompt (`snapshot`), a cache entry inherits its
lane's, and a hit is only as long as the entry's snapshots reach (`hybrid_snapshot_at_n`).

- Token-exact against the oracle on shared-system-prompt workloads for 1..3 lanes, both scratch
  modes and windows below, equal to and above the chunk, with hits actually taken; invariants
  (ghost included) after every step; nothing left over but cache entries and their snapshots.
- Teeth: a restore skipped, or one from the previous boundary, is not token-exact.
- Faults: a failed snapshot fetch costs only later hits (outputs stay exact); a failed restore
  fails only the request that hit, and nothing leaks.
- Config and runtime: the prefix cache is accepted with a window; a runtime that cannot move a
  local slot to and from the host is refused for it.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime

S, C, V = 256, 64, 128
MODEL = {"layers": 3, "global_every": 3}


def config(lanes: int, window: int, scratch: str = "dynamic", extra: int = 1,
           block: int | None = None, seq_len: int = S, prefix: bool = True) -> Config:
    """One block per sequence, or (block) paged tables of seq_len / block blocks."""
    t = seq_len // (block or seq_len)
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, t) + extra,
                  max_seq_len=seq_len, block_size=block or seq_len, prefill_chunk=C,
                  scratch=scratch, prefix_cache=prefix, sliding_window=window)


def batcher(cfg: Config, ghost: bool = True) -> AtomBatcher:
    rt = TorchReferenceRuntime.tiny(cfg, seed=0, sliding_window=cfg.sliding_window, **MODEL)
    return AtomBatcher(cfg, rt, ghost=ghost)


def shared_prompts(seed: int, n: int = 8, system: int = 140) -> list[tuple[list[int], int]]:
    """A system prompt (two whole chunks and a bit) shared by most requests, each with its own
    suffix; a few unrelated ones and one shorter than a chunk. With max_new_tokens."""
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(V) for _ in range(system)]
    out = []
    for i in range(n):
        if i % 4 == 3:
            p = [rng.randrange(V) for _ in range(rng.choice([5, 70, 150]))]
        else:
            p = sys_prompt + [rng.randrange(V) for _ in range(rng.randint(1, 60))]
        out.append((p, rng.randint(1, 12)))
    return out


def run_checked(b: AtomBatcher, work: list[tuple[list[int], int]]) -> list[int]:
    rids = [b.submit(p, n) for p, n in work]
    steps = 0
    while b.busy():
        b.step()
        b.check_invariants()
        steps += 1
        assert steps < 5000
    return rids


def mismatches(b: AtomBatcher, rids: list[int]) -> list[int]:
    o = oracle_for(b.runtime)
    return [r for r in rids if b.requests[r].error is None
            and b.requests[r].tokens != o.generate(b.requests[r].prompt,
                                                   b.requests[r].max_new_tokens, None)]


def assert_settled(b: AtomBatcher) -> None:
    """Only cache entries are left, and the host holds snapshots for exactly the entries the
    core says have them (none for a lane: every lane is idle)."""
    s = b.state
    owners = core.describe_state(s)["owner"]
    assert set(owners) <= {"FREE", "CACHE", "SCRATCH"}, owners
    snaps = b.describe()["snapshots"]
    assert snaps is not None and snaps["lanes"] == {}
    for blk in range(s.consts.K):
        # (only the entry's own block's boundaries: no hit on it reads an earlier one)
        want = (list(range(s.start[blk] + C, s.snap_upto[blk] + 1, C))
                if s.owner[blk] == core.OWNER_CACHE else [])
        assert snaps["entries"].get(blk, []) == want, blk


@pytest.mark.parametrize("window", [16, 64, 100], ids=["W<C", "W=C", "W>C"])
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_hits_restore_the_sliding_state_token_exact(lanes: int, scratch: str,
                                                    window: int) -> None:
    b = batcher(config(lanes, window, scratch))
    rids = run_checked(b, shared_prompts(window))
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    assert b.stats.prefix_hit_tokens >= 2 * C and b.stats.snapshots > 0
    assert_settled(b)


def test_hits_save_prefill_tokens() -> None:
    work = shared_prompts(7, n=12)
    total = sum(len(p) for p, _ in work)
    b = batcher(config(2, 16))
    rids = run_checked(b, work)
    assert mismatches(b, rids) == []
    assert b.stats.prefill_tokens + b.stats.prefix_hit_tokens == total
    # 9 of 12 prompts share 140 tokens: each hit after the first reuses 128 of them
    assert b.stats.prefix_hit_tokens >= 6 * 2 * C


@pytest.mark.parametrize("how", ["skip", "previous-boundary"])
def test_a_wrong_restore_is_not_token_exact(how: str) -> None:
    """Why the snapshot must be the one at the hit's length: without a restore the lane resumes
    with its slot's stale ring; with the snapshot one chunk earlier, with another position's."""
    b = batcher(config(1, 16), ghost=False)
    snaps = b._snaps
    assert snaps is not None
    if how == "skip":
        b.runtime.update_local_cache = lambda host, slot: None  # type: ignore[method-assign]
    else:
        snaps.restore_source = (  # type: ignore[method-assign]
            lambda src, n: snaps.entries[src].get(n - C, snaps.entries[src][n]))
    rids = run_checked(b, shared_prompts(16))
    assert b.stats.prefix_hit_tokens > 0
    assert mismatches(b, rids) != []


class FlakyLocal:
    """Runtime wrapper failing chosen calls of fetch_local_cache / update_local_cache."""

    def __init__(self, inner: TorchReferenceRuntime, op: str, fail_calls: set[int]) -> None:
        self.inner, self.op, self.fail_calls, self.calls = inner, op, fail_calls, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.op:
            return attr

        def call(*args: Any) -> Any:
            self.calls += 1
            if self.calls in self.fail_calls:
                raise RuntimeError(f"injected {name} failure")
            return attr(*args)
        return call


def test_failed_snapshot_costs_only_later_hits() -> None:
    cfg = config(2, 16)
    work = shared_prompts(3)
    clean = batcher(cfg)
    run_checked(clean, work)
    b = batcher(cfg)
    b.runtime = FlakyLocal(b.runtime, "fetch_local_cache", {1})  # the first request's first
    rids = run_checked(b, work)
    assert b.stats.snapshot_failures == 1
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    assert b.stats.snapshots < clean.stats.snapshots
    assert_settled(b)


def test_failed_restore_fails_only_the_request_that_hit() -> None:
    b = batcher(config(2, 16))
    b.runtime = FlakyLocal(b.runtime, "update_local_cache", {1})
    rids = run_checked(b, shared_prompts(5))
    failed = [r for r in rids if b.requests[r].error is not None]
    assert len(failed) == 1 and "update_local_cache failed" in str(b.requests[failed[0]].error)
    assert mismatches(b, [r for r in rids if r not in failed]) == []
    assert_settled(b)


# ------------------------------------------------------------------ paged tables (T > 1)
PS, PB = 512, 128  # tables of 4 blocks of 2 chunks


def count_grow_hits(b: AtomBatcher) -> list[int]:
    """The n of every `grow_hit` the batcher applies (hits past a table's first block)."""
    seen: list[int] = []
    apply = b.scheduler._apply  # (the scheduler applies every transition)

    def counting(action: str, **args: Any) -> Any:
        if action == "grow_hit":
            seen.append(args["n"])
        return apply(action, **args)
    b.scheduler._apply = counting  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("window", [16, 100], ids=["W<C", "W>C"])
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("lanes", [1, 3])
def test_paged_hits_restore_the_sliding_state_token_exact(lanes: int, scratch: str,
                                                          window: int) -> None:
    """Tables of 4 blocks: a hit on the 300-token system prompt copies the first block at
    admission and the next ones with `grow_hit`, each restoring the sliding state at its end
    from the entry's snapshot there (a full block keeps the lane's snapshots when it fills)."""
    b = batcher(config(lanes, window, scratch, block=PB, seq_len=PS))
    later = count_grow_hits(b)
    rids = run_checked(b, shared_prompts(window, n=10, system=300))
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    assert later and b.stats.prefix_hit_tokens > sum(later) > 0 and b.stats.table_grows > 0
    assert_settled(b)


def test_paged_hits_reach_only_as_far_as_snapshots() -> None:
    """No snapshots past the first block (the policy takes none there): hits stop at the first
    block's end, and every answer is still exact."""
    b = batcher(config(2, 16, block=PB, seq_len=PS))
    take = b.policy.snapshot
    b.policy.snapshot = lambda s, lane: take(s, lane) and s.length[lane] <= PB  # type: ignore
    later = count_grow_hits(b)
    rids = run_checked(b, shared_prompts(4, n=8, system=300))
    assert mismatches(b, rids) == []
    assert later == [] and b.stats.prefix_hit_tokens > 0
    assert_settled(b)


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
def test_paged_hybrid_without_prefix_cache_token_exact(scratch: str) -> None:
    b = batcher(config(3, 16, scratch, block=PB, seq_len=PS, prefix=False))
    rids = run_checked(b, shared_prompts(9, n=8, system=300))
    assert mismatches(b, rids) == [] and b.stats.table_grows > 0


def test_prefix_cache_is_accepted_with_a_window() -> None:
    cfg = config(2, 16)
    assert cfg.prefix_cache and cfg.consts().HYBRID and cfg.consts().PREFIX


def test_runtime_without_local_host_transfers_is_refused_for_a_hybrid_prefix_cache() -> None:
    cfg = config(1, 16)
    rt = TorchReferenceRuntime.tiny(cfg, seed=0, sliding_window=16, **MODEL)

    class NoLocalHost:
        def __getattr__(self, name: str) -> Any:
            if name in ("fetch_local_cache", "update_local_cache", "new_local_host_buffer"):
                raise AttributeError(name)
            return getattr(rt, name)

    with pytest.raises(ValueError, match="fetch_local_cache/update_local_cache"):
        AtomBatcher(cfg, NoLocalHost())
    # the same runtime without the prefix cache is fine
    AtomBatcher(Config(lanes=1, kv_blocks=cfg.kv_blocks, max_seq_len=S, prefill_chunk=C,
                       sliding_window=16), NoLocalHost())
