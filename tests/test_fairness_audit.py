"""A fairness and preemption audit of the scheduler (`Policy` and `AtomBatcher`) against bug
classes public serving engines have had: starvation under steady load, requests preempted again
and again, recompute after preemption at the sequence's end, abort of a preempted request.
Directed cases beside tests/test_sched_audit.py's (which covers the lane and decode starvation
fixes and the random preemption storms); they found nothing in the adapter or the policy.

One finding needed the spec (`admit_adopt`, tested here): with preemption, a waiting request
whose prefix hit's source was the only reusable block waited until a running request ended
(admit_hit needs a second block; admit_miss refuses while a hit exists: `no_cache_hit`).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, min_kv_blocks
from atom_core.runtime import TorchReferenceRuntime
from tests.test_batcher_audit import at_rest, drive, oracle

S, C, V = 256, 64, 128


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


def batcher(lanes: int, kv_blocks: int, block: int, **kw: object) -> AtomBatcher:
    cfg = Config(lanes=lanes, kv_blocks=kv_blocks, max_seq_len=S, block_size=block,
                 prefill_chunk=C, preemption=True, **kw)  # type: ignore[arg-type]
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)


def exact(b: AtomBatcher, rid: int) -> bool:
    r = b.requests[rid]
    return r.error is None and r.tokens == oracle(b, rid)


def test_a_request_preempted_at_max_seq_len_resumes_token_exact() -> None:
    """The youngest lane holds max_seq_len tokens (its last sampled one has no KV yet) when the
    older lane needs a block: its restart prefills all max_seq_len tokens (the spec's
    `requeue_fits` boundary, one more than submit accepts), samples the token the decode would
    have, and ends there at max_seq_len, with the tokens an unpreempted run gives, each streamed
    once."""
    rng = random.Random(7)
    b = batcher(2, 4, 128, scratch="reserved")  # 3 usable blocks: one lane's table and one
    old = b.submit(_toks(rng, 123), 60)  # crosses its first block while the young one decodes
    young = b.submit(_toks(rng, 250), 20)  # 250 + 7 tokens reach max_seq_len
    seen: dict[int, int] = {}
    log: list[Event] = []
    while b.busy():
        s = b.state
        held = {s.lane_req[ln]: len(s.lane_seq[ln]) for ln in range(2) if s.busy[ln]}
        events = b.step()
        b.check_invariants()
        log += events
        seen.update({e.request_id: held[e.request_id] for e in events if e.kind == "preempted"})
    assert seen == {young: S}, seen
    assert len(b.requests[young].tokens) == S - 250 + 1  # max_new_tokens=20 counted past it
    for rid in (old, young):
        assert exact(b, rid), rid
        assert [e.token for e in log if e.kind == "token" and e.request_id == rid] \
            == b.requests[rid].tokens
    at_rest(b)


def test_admission_stays_first_come_first_served_through_preemptions() -> None:
    """Under steady arrivals at the preemption minimum, every request's first admission comes
    in submission order (a preempted request goes back to the queue's head: it never lets a
    later one overtake it, nor overtakes an earlier one), a long request submitted early ends
    before anything submitted after it has waited long, no request is preempted more than
    twice, and every answer is the oracle's."""
    rng = random.Random(3)
    lanes, t = 3, 4
    b = batcher(lanes, min_kv_blocks(lanes, True, "reserved", t, preemption=True), S // t,
                scratch="reserved", prefix_cache=True)
    long = b.submit(_toks(rng, 200), 56)
    rids = [long]
    first_admitted: list[int] = []
    preempted: dict[int, int] = {}
    for step in range(1500):
        if step < 90 and step % 3 == 0:
            rids.append(b.submit(_toks(rng, rng.randint(5, 80)), rng.randint(5, 40)))
        if step >= 90 and not b.busy():
            break
        waiting = sorted(r for r in rids if b.phase(r) == core.PHASE_WAITING)
        for e in b.step():
            if e.kind == "preempted":
                preempted[e.request_id] = preempted.get(e.request_id, 0) + 1
        b.check_invariants()
        # ids grow with submission, and an admitted request was submitted before every one
        # still waiting: so each step admits (again, after a preemption) the lowest waiting ids
        admitted = [r for r in waiting if b.phase(r) != core.PHASE_WAITING]
        assert admitted == waiting[:len(admitted)], (step, waiting, admitted)
        s = b.state
        for ln in range(lanes):
            if s.busy[ln] and s.lane_req[ln] not in first_admitted:
                first_admitted.append(s.lane_req[ln])
    assert not b.busy(), "not done after 1500 steps"
    assert first_admitted == rids
    assert max(preempted.values(), default=0) <= 2, preempted
    assert b.stats.preemptions > 0  # (the minimum forces some: the property is exercised)
    assert all(exact(b, r) for r in rids)
    at_rest(b)


def test_abort_of_a_preempted_request_frees_it_and_the_rest_stay_exact() -> None:
    """A request preempted back to the queue is aborted while it waits: it ends once, aborted,
    with the tokens it had streamed (a prefix of its answer), nothing of it is admitted again,
    and the requests behind it run token-exact to rest."""
    rng = random.Random(5)
    b = batcher(2, min_kv_blocks(2, False, "dynamic", 2, preemption=True), 128,
                scratch="dynamic")
    old = b.submit(_toks(rng, 120), 100)
    b.step()
    young = b.submit(_toks(rng, 60), 100)
    later = b.submit(_toks(rng, 30), 5)
    while b.phase(young) != core.PHASE_WAITING or not b.requests[young].tokens:
        assert b.busy()
        b.step()
        b.check_invariants()
    had = list(b.requests[young].tokens)
    assert b.abort(young) is True and b.abort(young) is False
    assert young not in b.waiting
    log = drive(b)
    assert not [e for e in log if e.request_id == young]
    r = b.requests[young]
    want = oracle(b, young)
    assert r.error == "aborted" and r.tokens == had == want[:len(had)]
    assert exact(b, old) and exact(b, later)
    at_rest(b)


def _hit_beside_a_decoding_lane(kv_blocks: int) -> tuple[AtomBatcher, list[int], int]:
    """One lane decodes a long answer; a finished request's block is a cache entry; then a
    request whose prompt shares that entry's first 70 tokens arrives (a 64-token hit)."""
    rng = random.Random(7)
    b = batcher(2, kv_blocks, 128, scratch="reserved", prefix_cache=True)
    p = _toks(rng, 100)
    first = b.submit(p, 1)
    drive(b)
    long = b.submit([1, 2, 3], 100)
    b.step()
    w = b.submit(p[:70] + [5, 6], 3)
    return b, [first, long, w], w


def test_a_hit_whose_source_is_the_only_reusable_block_takes_it_over() -> None:
    """With preemption (one lane's table and a block), the only reusable block is the cache
    entry the waiting request's prompt hits: a copy needs a second block and a miss must not
    skip the hit (`no_cache_hit`), so it used to wait for the decoding request to end (100
    steps) with that block idle. The lane takes the entry over (`admit_adopt`): admitted at
    once, its 64 cached tokens reused in place, every answer token-exact."""
    b, rids, w = _hit_beside_a_decoding_lane(3)
    s = b.state
    (src,) = [x for x in range(s.consts.K) if s.owner[x] == core.OWNER_CACHE]
    hits = b.stats.prefix_hit_tokens
    b.step()
    s = b.state
    assert b.phase(w) != core.PHASE_WAITING, "the hit's request waits with its source idle"
    lane = s.req_lane.get(w)
    assert s.tail[lane] == src and s.owner[src] == core.OWNER_LANE
    assert b.stats.prefix_hit_tokens - hits == 64
    assert b.stats.prefill_tokens < 100 + 3 + 72  # its first chunk was not computed again
    drive(b)
    assert all(exact(b, r) for r in rids)
    at_rest(b)


def test_a_hit_with_a_block_to_spare_copies_and_keeps_the_entry() -> None:
    """The same arrival with one block more: the hit is copied into the free block and the
    entry stays cached for the next request (taking it over is only for when nothing else is
    left)."""
    b, rids, w = _hit_beside_a_decoding_lane(4)
    s = b.state
    (src,) = [x for x in range(s.consts.K) if s.owner[x] == core.OWNER_CACHE]
    b.step()
    s = b.state
    assert s.owner[src] == core.OWNER_CACHE and s.tail[s.req_lane.get(w)] != src
    drive(b)
    assert all(exact(b, r) for r in rids)
    at_rest(b)


def _shared_prefix_runs(scratch: str, host: int, t: int, extra: int, stem: int, steps: int,
                        watch: str) -> list[str]:
    """Six seeds of bursts of prompts that go on from two stems (one to `stem` whole chunks of
    64 tokens), 2 lanes with T = t at the preemption minimum plus `extra` blocks: every run
    ends within `steps` steps, every answer is the oracle's, nothing leaks. The actions the
    policy's `watch` choices (admission or grow) took, in order."""
    taken: list[str] = []
    for seed in range(6):
        rng = random.Random(seed)
        lanes = 2
        b = batcher(lanes, min_kv_blocks(lanes, True, scratch, t, preemption=True) + extra,
                    S // t, scratch=scratch, prefix_cache=True, host_cache_blocks=host)

        original = getattr(b.policy, watch)

        def chosen(*a: object, choose: Any = original, **k: object) -> object:
            c = choose(*a, **k)
            if c is not None:
                taken.append(c.action)
            return c

        setattr(b.policy, watch, chosen)
        stems = [_toks(rng, C * rng.randint(1, stem)) for _ in range(2)]
        rids = []
        for step in range(steps):
            if step < 60 and step % 4 == 0:
                p = rng.choice(stems) + _toks(rng, rng.randint(1, 40))
                rids.append(b.submit(p, rng.randint(1, 30)))
            if step >= 60 and not b.busy():
                break
            b.step()
            b.check_invariants()
        assert not b.busy(), (seed, "not done")
        assert all(exact(b, r) for r in rids), seed
        at_rest(b)
    return taken


@pytest.mark.parametrize("scratch,host", [("reserved", 0), ("dynamic", 0), ("reserved", 2)],
                         ids=["reserved", "dynamic", "reserved-host"])
def test_shared_prefixes_at_the_preemption_minimum_adopt_and_stay_exact(scratch: str,
                                                                         host: int) -> None:
    """Bursts of prompts sharing their first chunks, at the preemption minimum with the prefix
    cache, over several seeds: every answer is the oracle's, each request ends, nothing leaks;
    with a reserved scratch block, entries are taken over when they are the last reusable
    block (counted from the policy's choices), a host tier beside them too (hits loaded from
    it). (With dynamic scratch a request is admitted beside running ones only with a padding
    block to spare, so a hit always has a second block to copy into.)"""
    taken = _shared_prefix_runs(scratch, host, 2, 0, 2, 2000, "admission")
    # (the situation happened: the property is exercised)
    assert ("admit_adopt" in taken) == (scratch == "reserved")


@pytest.mark.parametrize("scratch,extra", [("dynamic", 0), ("reserved", 1)])
def test_hits_past_the_first_block_take_their_last_block_over_and_stay_exact(
        scratch: str, extra: int) -> None:
    """Conversations that go on past a first block (blocks of 64 tokens, stems of one to three
    of them), at or just above the preemption minimum: when the next block's cached
    continuation is the only reusable block, the lane takes it over (`grow_adopt`: counted
    from the policy's choices) instead of computing its tokens again; every answer is still
    the oracle's, each request ends, nothing leaks."""
    taken = _shared_prefix_runs(scratch, 0, 4, extra, 3, 3000, "grow")
    assert "grow_adopt" in taken and "grow_hit" in taken  # (both happened)
