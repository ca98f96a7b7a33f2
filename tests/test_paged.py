"""Paged block tables (T = max_seq_len / block_size > 1) on the torch reference runtime: tokens
equal the cache-free oracle while lanes grow their tables across block boundaries, in prefill
and in decode, at the proved minimum K, with and without the prefix cache; the block tables the
runtime sees are the core's; nothing leaks.

Sizes: max_seq_len 256, chunk 64, block 128 (T = 2) or 64 (T = 4). The ghost state is on and
`check_invariants()` runs after every step.
"""

from __future__ import annotations

import random

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime

S, C, V = 256, 64, 128
_rng = random.Random(4321)
SYSTEM = [_rng.randrange(V) for _ in range(150)]  # longer than a block of 128: two blocks


def _toks(n: int) -> list[int]:
    return [_rng.randrange(V) for _ in range(n)]


POOL: list[list[int]] = [
    SYSTEM + _toks(10),      # 160: prefill crosses the first block (T = 2) or two (T = 4)
    SYSTEM + _toks(40),      # 190
    _toks(120),              # decode crosses 128 after 8 tokens
    _toks(60),               # decode crosses 64 after 4 tokens (T = 4)
    _toks(250),              # the table fills up: finishes at max_seq_len
    SYSTEM[:128] + _toks(3),  # the system prompt's first block, and a bit
    _toks(5),
]


def make(lanes: int, t: int, prefix: bool, scratch: str, extra: int = 0,
         **kw) -> AtomBatcher:
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, t) + extra,
                 max_seq_len=S, block_size=S // t, prefill_chunk=C, prefix_cache=prefix,
                 scratch=scratch)
    assert cfg.blocks_per_table == t
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True, **kw)


def expected(b: AtomBatcher, rid: int) -> list[int]:
    r = b.requests[rid]
    return oracle_for(b.runtime).generate(r.prompt, r.max_new_tokens, r.eos_token_id)


class Tables:
    """Records the block tables of every runtime call: each row must be the lane's table as the
    core's effects built it (admit, then grow), with no block in two live rows."""

    def __init__(self, b: AtomBatcher) -> None:
        self.b, self.rows_seen = b, 0
        rt = b.runtime
        prefill, decode = rt.prefill, rt.decode

        def checked_prefill(ids, pos, tables, local, qpos):
            self.rows_seen += 1
            p = int(pos[0, 0])
            assert tables.shape == (b.config.blocks_per_table,)
            # the lane plan() chose (two prefilling lanes may be at the same position)
            (lane,) = b._plan.lanes
            assert b.state.busy[lane] and b.state.length[lane] == p
            assert b.state.phase.get(b.state.lane_req[lane]) == core.PHASE_PREFILL
            assert int(tables[p // b.config.block_size]) == b.state.tail[lane]
            return prefill(ids, pos, tables, local, qpos)

        def checked_decode(ids, pos, tables, local):
            self.rows_seen += 1
            assert tables.shape == (b.config.lanes, b.config.blocks_per_table)
            live = {}
            for ln in range(b.config.lanes):
                if b.state.busy[ln] and b.state.phase.get(b.state.lane_req[ln]) == \
                        core.PHASE_DECODE:
                    p = int(pos[ln, 0])
                    assert int(tables[ln, p // b.config.block_size]) == b.state.tail[ln]
                    n = b.state.nblocks[ln]
                    for blk in tables[ln, :n].tolist():
                        assert live.setdefault(blk, ln) == ln, (blk, tables)
            return decode(ids, pos, tables, local)

        rt.prefill, rt.decode = checked_prefill, checked_decode


def drive(b: AtomBatcher, log: list[Event] | None = None, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not b.busy():
            return
        events = b.step()
        b.check_invariants()
        if log is not None:
            log.extend(events)
    raise AssertionError(f"not idle after {max_steps} steps")


def assert_exact(b: AtomBatcher) -> None:
    for rid, r in b.requests.items():
        assert r.ended and r.error is None, (rid, r.error)
        assert r.tokens == expected(b, rid), (rid, len(r.prompt))


def at_rest(b: AtomBatcher) -> None:
    d = b.describe()
    for blk, own in enumerate(d["blocks"]):
        if b.config.scratch == "reserved" and blk == b.config.scratch_id:
            assert own == "scratch"
        else:
            assert own in (("free", "cache") if b.config.prefix_cache else ("free",)), d
    assert all(ln["blocks"] == [] for ln in d["lanes"])


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("lanes,t", [(1, 2), (2, 2), (3, 2), (1, 4), (2, 4)])
def test_token_exact_at_minimum_k(lanes, t, prefix, scratch):
    """The pool twice over in random order at the proved minimum K: every lane's table grows in
    prefill and decode, tables fill to max_seq_len, and tokens equal the oracle."""
    rng = random.Random(lanes * 1000 + t * 100 + prefix * 10 + (scratch == "dynamic"))
    b = make(lanes, t, prefix, scratch)
    tables = Tables(b)
    order = POOL * 2
    rng.shuffle(order)
    for p in order:
        b.submit(p, rng.randint(1, 24))
    log: list[Event] = []
    drive(b, log)
    assert_exact(b)
    at_rest(b)
    assert b.stats.table_grows > 0 and tables.rows_seen > 0
    assert b.stats.runtime_errors == 0
    assert (b.stats.prefix_hit_tokens > 0) == prefix
    # every token event is its request's, in order
    for rid, r in b.requests.items():
        assert [e.token for e in log if e.request_id == rid and e.kind == "token"] == r.tokens


@pytest.mark.parametrize("t", [2, 4])
def test_a_table_that_fills_finishes_at_max_seq_len(t):
    """A 250-token prompt asking for 20 tokens: the table holds 256 positions, so it stops at
    the 7th token (KV for 256 positions, the last sampled token needs none), exactly where the
    oracle stops."""
    b = make(1, t, False, "dynamic")
    rid = b.submit(POOL[4], 20)
    drive(b)
    assert len(b.requests[rid].tokens) == S - len(POOL[4]) + 1
    assert_exact(b)
    assert b.stats.table_grows == t - 1


@pytest.mark.parametrize("t", [2, 4])
def test_prefix_hit_spans_blocks(t):
    """A second request with the same 160-token prompt hits every whole chunk below its last
    token, 128 tokens: the admission copies the first block's (one block at T = 2, half of it
    at T = 4), and at T = 4 the lane's next block copies the rest from the entry at that
    position (`grow_hit`); only the last 32 tokens are computed."""
    b = make(1, t, True, "dynamic")
    first = b.submit(POOL[0], 4)
    drive(b)
    second = b.submit(POOL[0], 4)
    copies = b.runtime.calls["copy"]
    drive(b)
    assert_exact(b)
    assert b.requests[first].tokens == b.requests[second].tokens
    assert b.stats.prefix_hit_tokens == 128
    assert b.runtime.calls["copy"] - copies == 128 // (S // t)  # one copy per block
    assert b.stats.prefill_tokens == 2 * len(POOL[0]) - 128


def test_hit_reaches_a_later_block_after_computing_the_first():
    """Hits are per block: an entry's key is the whole prefix up to its end, so a lane that
    computed its first block can still copy its second. At T = 4 (blocks of 64) POOL[0] is
    cached as three blocks; its first-block entry is dropped (`discard`); the same prompt again
    computes its first 64 tokens and copies the next 64 from the second-block entry."""
    b = make(1, 4, True, "dynamic", extra=2)
    first = b.submit(POOL[0], 4)
    drive(b)
    entries = {b.state.start[x]: x for x in range(b.config.kv_blocks)
               if b.state.owner[x] == core.OWNER_CACHE}
    assert set(entries) >= {0, 64}, entries
    b._apply("discard", b=entries[0])
    again = b.submit(POOL[0], 4)
    hits, computed = b.stats.prefix_hit_tokens, b.stats.prefill_tokens
    drive(b)
    assert_exact(b)
    assert b.requests[again].tokens == b.requests[first].tokens
    assert b.stats.prefix_hit_tokens - hits == 64  # the second block only
    assert b.stats.prefill_tokens - computed == len(POOL[0]) - 64


def test_failed_copy_into_a_later_block_fails_that_request_only():
    """The runtime fails the copy into a lane's second block (a `grow_hit`): that request fails
    with the runtime's message, the lane and both its blocks are released (nothing leaks, the
    entry it read is still cached), and the next request with the same prompt is token-exact."""
    b = make(1, 4, True, "dynamic", extra=2)
    b.submit(POOL[0], 4)
    drive(b)
    copy, calls = b.runtime.copy_kv_cache, []

    def flaky(src: int, dst: int, n: int) -> None:
        calls.append(src)
        if len(calls) == 2:  # the admission's copy works, the next block's does not
            raise RuntimeError("DMA error")
        copy(src, dst, n)

    b.runtime.copy_kv_cache = flaky
    bad = b.submit(POOL[0], 4)
    log: list[Event] = []
    drive(b, log)
    assert "copy_kv_cache failed" in (b.requests[bad].error or "")
    assert ("error", bad) in [(e.kind, e.request_id) for e in log]
    at_rest(b)
    assert b.state.owner[calls[1]] == core.OWNER_CACHE
    ok = b.submit(POOL[0], 4)
    drive(b)
    assert b.requests[ok].error is None and b.requests[ok].tokens == expected(b, ok)
    at_rest(b)


def test_full_blocks_become_cache_entries_keyed_by_their_prefix():
    """When a request finishes, each block of its table is cached under the prefix up to its
    end: the first block's entry serves a later prompt that shares only that block."""
    b = make(1, 2, True, "reserved", extra=1)
    b.submit(POOL[0], 2)
    drive(b)
    s = b.state
    keys = sorted(len(s.key[blk]) for blk in range(s.consts.K) if s.owner[blk] ==
                  core.OWNER_CACHE)
    assert keys == [128, len(POOL[0]) + 1]  # the full first block; the tail up to its length
    b.submit(POOL[5], 2)  # shares the first block of 128 tokens
    drive(b)
    assert_exact(b)
    assert b.stats.prefix_hit_tokens == 128


def test_abort_and_failure_free_every_block_of_the_table():
    b = make(2, 4, False, "dynamic")
    r0 = b.submit(POOL[1], 30)
    r1 = b.submit(POOL[2], 30)
    for _ in range(500):
        if b.state.phase.get(r0) == core.PHASE_DECODE and b.state.nblocks[
                b.state.req_lane.get(r0)] == 3:
            break
        b.step()
        b.check_invariants()
    lane = b.state.req_lane.get(r0)
    held = b.describe()["lanes"][lane]["blocks"]
    assert len(held) == 3
    assert b.abort(r0)
    b.check_invariants()
    d = b.describe()
    assert all(d["blocks"][blk] == "free" for blk in held)
    drive(b)
    assert b.requests[r1].error is None and b.requests[r1].tokens == expected(b, r1)
    at_rest(b)


def test_pd_request_over_one_block_gets_its_whole_table_before_its_import_event():
    """PD with paged tables: an import's table grows to cover its prompt before the batcher asks
    for its KV (tests/test_pd_paged.py runs it end to end)."""
    b = make(1, 2, False, "dynamic")
    rid = b.submit(POOL[0], 4, remote=True)
    events = b.step()
    assert [e.kind for e in events] == ["import"] and b.awaits_kv(rid)
    table = b.describe()["lanes"][0]["blocks"]
    assert len(table) == -(-len(POOL[0]) // b.config.block_size) == 2
    assert b.export_done(rid) == [] and b.stats.stale_events == 1  # not an export


def test_growth_waits_for_a_draining_block():
    """One lane, T = 2, K = 2: a PD import aborted mid-transfer leaves its block draining, so a
    local request that fills its first block finds no block for its second. It waits (as an
    admission would) until the transfer's end frees the block, then finishes exactly."""
    b = make(1, 2, False, "dynamic")
    r0 = b.submit(POOL[6], 4, remote=True)
    b.step()
    assert b.state.phase.get(r0) == core.PHASE_IMPORTING
    assert b.abort(r0)
    r1 = b.submit(POOL[2], 12)  # 120 tokens: decode crosses the block end after 8 tokens
    for _ in range(40):
        b.step()
        b.check_invariants()
    assert b.requests[r1].tokens and not b.requests[r1].ended  # stalled at the block end
    assert b.state.length[b.state.req_lane.get(r1)] == 128
    b.transfer_ended(r0, "transfer cancelled")  # the drained block is freed
    drive(b)
    assert b.requests[r1].error is None and b.requests[r1].tokens == expected(b, r1)
    assert b.stats.table_grows == 1


def test_growing_by_hits_keeps_the_entries_the_lane_copies_next():
    """A 352-token prompt served twice with blocks of 128 (T = 3) and one block to spare: the
    second run copies its first block, then its second, whose destination must not be the
    third block's entry it copies next (`Policy.reusable` keeps entries a prefilling lane will
    copy for last): it hits every whole chunk below its last token, 320 tokens."""
    cfg = Config(lanes=1, kv_blocks=4, max_seq_len=384, block_size=128, prefill_chunk=64,
                 prefix_cache=True, scratch="dynamic")
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    prompt = [(7 * i) % V for i in range(1, 353)]
    first = b.submit(prompt, 1)
    drive(b)
    again = b.submit(prompt, 1)
    drive(b)
    assert_exact(b)
    assert b.requests[again].tokens == b.requests[first].tokens
    assert b.stats.prefix_hit_tokens == 320


def test_check_invariants_compares_the_kept_tables_with_the_core():
    """The batcher's tables (kept from the core's effects, given to the runtime) are checked
    against the core's state: a lane's blocks, owned by it, in token order. A table with two
    blocks swapped, one block fewer or another lane's block is reported, naming the lane."""
    from atom_core.batcher import InvariantViolation

    b = make(2, 4, False, "dynamic")
    b.submit(POOL[2], 12)  # 120 tokens: two blocks of 64 after prefill, a third in decode
    b.submit(POOL[3], 8)
    while not all(len(t) >= 2 for t in b._tables):
        b.step()
    b.check_invariants()
    good = [list(t) for t in b._tables]
    for planted in ([good[0][1], good[0][0], *good[0][2:]], good[0][:-1],
                    [*good[0][:-1], good[1][0]]):
        b._tables[0] = planted
        with pytest.raises(InvariantViolation, match="lane 0's block table"):
            b.check_invariants()
    b._tables[0] = good[0]
    b.check_invariants()
