"""Preemption (Config.preemption) on the torch reference runtime: with kv_blocks at the proved
minimum for preemption (one lane's whole table and a block, far below every lane's), every
request still produces exactly the cache-free oracle's tokens, lanes are preempted and resume,
nothing leaks, and the batcher's choices are the ones the spec allows (the core rejects any
other, and `check_invariants()` runs after every step). Hybrid models too: a preempted lane's
sliding-window snapshots go with its blocks. The host tier too, with failed stores and loads.
"""

from __future__ import annotations

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, ConfigError, min_kv_blocks
from atom_core.policy import Policy
from atom_core.runtime import TorchReferenceRuntime
from tests import test_host_cache as hc
from tests import test_hybrid_prefix as hp
from tests.test_paged import POOL, SYSTEM, C, S, Tables, assert_exact, at_rest, drive


def make(lanes: int, t: int, prefix: bool, scratch: str, extra: int = 0,
         policy: Policy | None = None) -> AtomBatcher:
    k = min_kv_blocks(lanes, prefix, scratch, t, preemption=True) + extra
    cfg = Config(lanes=lanes, kv_blocks=k, max_seq_len=S, block_size=S // t, prefill_chunk=C,
                 prefix_cache=prefix, scratch=scratch, preemption=True)
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), policy=policy, ghost=True)


def test_preemption_lowers_the_rule() -> None:
    for t in (2, 4):
        for lanes in (2, 4):
            for scratch in ("reserved", "dynamic"):
                with_p = min_kv_blocks(lanes, True, scratch, t, preemption=True)
                without = min_kv_blocks(lanes, True, scratch, t)
                assert t < with_p <= t + 1 < without


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("t", [2, 4])
def test_token_exact_at_the_minimum(t: int, prefix: bool, scratch: str) -> None:
    b = make(3, t, prefix, scratch)
    Tables(b)
    log: list[Event] = []
    for i, p in enumerate(POOL):
        b.submit(p, max_new_tokens=12 + 3 * i)
    drive(b, log, max_steps=5000)
    assert_exact(b)
    at_rest(b)
    assert b.stats.preemptions > 0, "the minimum K should force preemptions"
    preempted = {e.request_id for e in log if e.kind == "preempted"}
    assert preempted and all(b.requests[r].error is None for r in preempted)


def test_preempted_request_resumes_with_its_tokens() -> None:
    """Two long decodes at T = 2 (blocks of 128) with one block beyond a table: the older
    lane grows into the spare block, so the younger has none when it crosses 128: it is
    preempted, waits until its prompt and tokens fit, and resumes by prefilling them."""
    b = make(2, 2, False, "dynamic")
    old = b.submit(POOL[2], max_new_tokens=100)  # 120 tokens: crosses 128 while decoding
    b.step()
    young = b.submit(POOL[3], max_new_tokens=100)  # 60 tokens: crosses 128 later
    log: list[Event] = []
    drive(b, log)
    assert_exact(b)
    kinds = [(e.kind, e.request_id) for e in log]
    assert ("preempted", young) in kinds and ("preempted", old) not in kinds
    assert b.stats.recomputed_tokens > 0


def test_oldest_lane_is_never_preempted_while_others_run() -> None:
    b = make(3, 4, True, "reserved")
    log: list[Event] = []
    for p in POOL:
        b.submit(p, max_new_tokens=20)
    admitted: list[int] = []
    for _ in range(5000):
        if not b.busy():
            break
        running = [b.state.lane_req[ln] for ln in range(b.config.lanes) if b.state.busy[ln]]
        oldest = min(running, key=lambda r: admitted.index(r)) if running else None
        events = b.step()
        b.check_invariants()
        log.extend(events)
        for ln in range(b.config.lanes):
            r = b.state.lane_req[ln] if b.state.busy[ln] else None
            if r is not None and r in admitted:
                admitted.remove(r)
            if r is not None:
                admitted.append(r)
        for e in events:
            if e.kind == "preempted" and len(running) > 1:
                assert e.request_id != oldest
    assert_exact(b)


class OldestFirst(Policy):
    """Another legal policy: the victim is the oldest lane the core allows."""

    def victim(self, s: core.State) -> int | None:
        lanes = sorted(range(s.consts.B), key=lambda ln: self.admitted.get(ln, 0))
        return next((ln for ln in lanes if core.preempt_guard(s, ln) is None), None)


def test_any_victim_the_core_allows_is_safe() -> None:
    """Any victim the core allows is safe (tokens exact, nothing leaks): the policy only
    decides who waits."""
    b = make(2, 2, False, "reserved", policy=OldestFirst())
    for p in POOL[2:5]:
        b.submit(p, max_new_tokens=16)
    drive(b, max_steps=5000)
    assert_exact(b)
    at_rest(b)


def test_no_preemption_below_the_rule_is_refused() -> None:
    with pytest.raises(ConfigError, match="preemption"):
        Config(lanes=4, kv_blocks=3, max_seq_len=S, block_size=S // 2, prefill_chunk=C,
               prefix_cache=True)


def test_preemption_needs_paged_tables() -> None:
    with pytest.raises(ConfigError, match="paged tables"):
        Config(lanes=2, kv_blocks=4, max_seq_len=S, prefill_chunk=C, preemption=True)


@pytest.mark.parametrize("fault", [None, "fetch_kv_cache", "update_kv_cache"],
                         ids=["clean", "failed-stores", "failed-loads"])
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
def test_host_tier_token_exact_at_the_minimum(scratch: str, fault: str | None) -> None:
    """The host tier with preemption, at the preemption rule's minimum (tables of 4 blocks):
    entries spilled to the host and loaded back into first and later blocks while lanes are
    preempted (a lane loading from the host never is: `lane_computing`). A failed store drops
    only its entry, a failed load makes only its lane recompute that block; every answer is
    the oracle's, the invariants hold after every step, and at rest nothing is pinned and no
    slot is mid-store or mid-load."""
    t = hc.PS // hc.PB
    cfg = Config(lanes=3, kv_blocks=min_kv_blocks(3, True, scratch, t, preemption=True),
                 max_seq_len=hc.PS, block_size=hc.PB, prefill_chunk=hc.C, prefix_cache=True,
                 scratch=scratch, host_cache_blocks=8, preemption=True)
    b = hc.batcher(cfg)
    if fault is not None:
        b.runtime = hc.Flaky(b.runtime, fault, {1, 3})  # type: ignore[assignment]
    rids = hc.run_checked(b, hc.paged_workload(3))
    assert all(b.requests[r].error is None for r in rids)
    assert hc.mismatches(b, rids) == []
    assert b.stats.preemptions > 0 and b.stats.host_stores > 0 and b.stats.host_hit_tokens > 0
    failures = {None: 0, "fetch_kv_cache": b.stats.host_store_failures,
                "update_kv_cache": b.stats.host_load_failures}[fault]
    assert failures == (0 if fault is None else 2)
    hc.assert_at_rest(b)


@pytest.mark.parametrize("window", [16, 100], ids=["W<C", "W>C"])
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
def test_hybrid_token_exact_at_the_minimum(prefix: bool, scratch: str, window: int) -> None:
    """A hybrid model (sliding-window layers in each lane's local slot) at the preemption
    rule's minimum, tables of 4 blocks: lanes are preempted when another needs a block, their
    snapshots dropped with their blocks, and each restart recomputes its sliding state from
    its first token (or restores it at a hit's end, with the prefix cache). Every answer is
    the oracle's; the invariants (ghost included) hold after every step, and at the end the
    host holds snapshots only for the cache entries the core says have them."""
    t = hp.PS // hp.PB
    cfg = Config(lanes=3, kv_blocks=min_kv_blocks(3, prefix, scratch, t, preemption=True),
                 max_seq_len=hp.PS, block_size=hp.PB, prefill_chunk=hp.C, scratch=scratch,
                 prefix_cache=prefix, sliding_window=window, preemption=True)
    b = hp.batcher(cfg)
    rids = hp.run_checked(b, hp.shared_prompts(5, n=8, system=300))
    assert hp.mismatches(b, rids) == []
    assert all(b.requests[r].error is None for r in rids)
    assert b.stats.preemptions > 0 and b.stats.recomputed_tokens > 0
    if prefix:
        assert b.stats.snapshots > 0 and b.stats.prefix_hit_tokens > 0
        hp.assert_settled(b)
    else:
        at_rest(b)


def test_pd_requests_are_served_with_preemption() -> None:
    """(tests/test_pd_preempt.py runs them end to end)"""
    b = make(2, 2, False, "dynamic")
    rid = b.submit([1, 2, 3], max_new_tokens=2, remote=True)
    assert [(e.kind, e.request_id) for e in b.step()] == [("import", rid)]


def test_too_few_blocks_even_with_preemption() -> None:
    t = 2
    need = min_kv_blocks(2, False, "reserved", t, preemption=True)
    with pytest.raises(ConfigError, match=f"needs {need}"):
        Config(lanes=2, kv_blocks=need - 1, max_seq_len=S, block_size=S // t,
               prefill_chunk=C, scratch="reserved", preemption=True)


def test_system_prompt_hit_after_preemption() -> None:
    """A preempted request whose prompt shares the cached system prompt hits it again."""
    b = make(2, 2, True, "dynamic", extra=1)
    b.submit(SYSTEM + [1, 2, 3], max_new_tokens=4)
    drive(b)
    hits = b.stats.prefix_hit_tokens
    for p in POOL[:3]:
        b.submit(p, max_new_tokens=30)
    drive(b, max_steps=5000)
    assert_exact(b)
    assert b.stats.prefix_hit_tokens > hits


class AdmitsWithoutRoom(Policy):
    """A planted bug: admission beside running lanes ignores whether the prompt fits."""

    @staticmethod
    def _blocks_for(s: core.State, prompt: object) -> int:
        return 0


def test_planted_admission_without_room_livelocks() -> None:
    """Every step is safe (the core accepts each one), but a request admitted into the last
    block is preempted by its own prefill and admitted again, forever, while the lane it keeps
    from decoding never finishes: caught by the step limit."""
    # (decode never forced ahead of prefill: the bounded wait lets the displaced lanes decode
    # and finish, which hides the livelock behind the bug rather than the bug itself)
    b = make(3, 2, True, "reserved", policy=AdmitsWithoutRoom(max_decode_wait=10**9))
    for i, p in enumerate(POOL):
        b.submit(p, max_new_tokens=12 + 3 * i)
    with pytest.raises(AssertionError, match="not idle"):
        drive(b, max_steps=3000)
    assert b.stats.preemptions > 1000


def test_an_import_counts_as_an_admission_for_the_victim_order() -> None:
    """A lane imported from a prefill worker (`Inbound`) is younger than one admitted before it;
    counting only `Admit` made an imported lane look older than every admitted one, so the
    oldest lane could be picked as victim beside it (found by the core machine, seed 1)."""
    p = Policy()
    p.observe([core.Admit(lane=0, request=0, block=0), core.Inbound(lane=1, request=1, block=1)])
    assert p.admitted[1] > p.admitted[0]
    p.observe([core.Admit(lane=0, request=2, block=2)])
    assert p.admitted[0] > p.admitted[1]


def test_too_few_blocks_suggests_preemption() -> None:
    """Below every lane's whole table, the error names preemption as a fix, with the blocks it
    needs: plain, hybrid and with a host tier (the same rule is proved for each)."""
    kw: dict[str, object] = dict(lanes=3, max_seq_len=S, block_size=S // 4, prefill_chunk=C,
                                 prefix_cache=True)
    need = min_kv_blocks(3, True, "dynamic", 4, preemption=True)
    for extra in ({}, {"sliding_window": 16}, {"host_cache_blocks": 2}):
        with pytest.raises(ConfigError, match=f"turn preemption on .* which needs {need}"):
            Config(kv_blocks=need, **extra, **kw)  # type: ignore[arg-type]
        Config(kv_blocks=need, preemption=True, **extra, **kw)  # type: ignore[arg-type]
