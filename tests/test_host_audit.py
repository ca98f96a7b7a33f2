"""Audit of the host side of the cache: sliding-window snapshots and the malloc tuning.

- Snapshots are bounded by the config: with paged tables each cache entry (and lane) keeps only
  its own block's chunk boundaries, (lanes + kv_blocks) * block_size / chunk host buffers at
  most, however long the prompts, and every answer is still token-exact.
- keep_freed_memory leaves glibc's thresholds alone when the user set them through their
  environment aliases (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_), as for GLIBC_TUNABLES.
"""

from __future__ import annotations

import random
import sys

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime

C, V, W = 64, 128, 100  # W not a multiple of the chunk: a restore at the wrong boundary shows
PS, PB = 1024, 128  # tables of 8 blocks of 2 chunks


def hybrid_batcher(lanes: int = 2, extra: int = 8) -> AtomBatcher:
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, "dynamic", PS // PB) + extra,
                 max_seq_len=PS, block_size=PB, prefill_chunk=C, scratch="dynamic",
                 prefix_cache=True, sliding_window=W)
    rt = TorchReferenceRuntime.tiny(cfg, seed=0, sliding_window=W, layers=3, global_every=3)
    return AtomBatcher(cfg, rt, ghost=True)


def distinct_snapshots(b: AtomBatcher) -> int:
    """Host buffers the snapshot store keeps alive (lanes and entries share them)."""
    st = b._snaps
    assert st is not None
    return len({id(v) for sn in (*st.lanes.values(), *st.entries.values()) for v in sn.values()})


def test_snapshots_are_bounded_by_the_config_with_long_prompts() -> None:
    """Long prompts (up to 7 blocks) with a shared system prompt of 3 blocks: before the fix each
    entry kept every boundary of its prompt up to its end: over the bound (56 against 52)."""
    b = hybrid_batcher()
    cfg = b.config
    bound = (cfg.lanes + cfg.kv_blocks) * PB // C
    rng = random.Random(0)
    system = [rng.randrange(V) for _ in range(3 * PB + 20)]
    work = [((system if i % 2 else []) + [rng.randrange(V) for _ in range(rng.randint(420, 520))],
             2) for i in range(7)]
    rids = [b.submit(p, n) for p, n in work]
    most = 0
    steps = 0
    while b.busy():
        b.step()
        b.check_invariants()
        most = max(most, distinct_snapshots(b))
        steps += 1
        assert steps < 5000
    assert most <= bound, (most, bound)
    s = b.state
    assert set(core.describe_state(s)["owner"]) <= {"FREE", "CACHE", "SCRATCH"}
    assert b.stats.prefix_hit_tokens > PB and b.stats.snapshots > 0
    # an entry holds exactly its own block's boundaries the core says it has
    snaps = b.describe()["snapshots"]
    for blk in range(s.consts.K):
        want = (list(range(s.start[blk] + C, s.snap_upto[blk] + 1, C))
                if s.owner[blk] == core.OWNER_CACHE else [])
        assert snaps["entries"].get(blk, []) == want, blk
    o = oracle_for(b.runtime)
    for r in rids:
        req = b.requests[r]
        assert req.error is None
        assert req.tokens == o.generate(req.prompt, req.max_new_tokens, None), r


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
@pytest.mark.parametrize("var", ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"])
def test_a_threshold_in_its_environment_alias_is_the_users_choice(var: str) -> None:
    from test_host_memory import GLIBC, run
    if not GLIBC:
        pytest.skip("glibc's malloc only")
    kept, _faults = run("keep", **{var: "131072"})
    assert kept == "False"
