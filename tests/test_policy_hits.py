"""The policy's hit search (`Policy.best_hit`, `best_host_hit`, `common_chunks`) against a brute
force over every block and slot, on states reached by the core from prompts over a two-token
alphabet (so that heads collide, keys share a few chunks and hits are partial), on the pure
`State` and on the in-place `MState` (whose `where_head` reads an index)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from atom_core._generated import core as g
from atom_core._generated import inplace as ip
from atom_core.policy import Policy, common_chunks
from atom_core.seq import TokSeq, seq

C = 2  # chunk
tokens = st.lists(st.integers(0, 1), min_size=1, max_size=12)


@given(a=tokens, b=tokens, chunk=st.integers(1, 3), limit=st.integers(-1, 12),
       at=st.integers(0, 4))
def test_common_chunks_is_the_longest_agreeing_run_of_whole_chunks(
        a: list[int], b: list[int], chunk: int, limit: int, at: int) -> None:
    n = 0
    while (n + chunk <= limit and at + n + chunk <= min(len(a), len(b))
           and a[at + n:at + n + chunk] == b[at + n:at + n + chunk]):
        n += chunk
    assert common_chunks(seq(a), seq(b), chunk, limit, at) == n
    assert common_chunks(tuple(a), seq(b), chunk, limit, at) == n


def _reference(s: Any, prompt: TokSeq, blocks: range, cached: Any, key: Any, upto: Any,
               use: dict[int, int]) -> tuple[int, int] | None:
    """The longest hit into a first block: every candidate, chunk by chunk."""
    p = prompt.tokens()
    limit = (len(p) - 1) // C * C
    best = None
    for b in blocks:
        k = key[b].tokens()
        if not cached(b) or k[:C] != p[:C] or len(p) <= C:
            continue
        most, n = min(limit, len(k) // C * C, upto(b)), 0
        while n + C <= most and k[n:n + C] == p[n:n + C]:
            n += C
        if n and (best is None or (n, use.get(b, 0)) > (best[1], use.get(best[0], 0))):
            best = (b, n)
    return best


def _step(s: Any, policy: Policy, action: str, **args: Any) -> Any:
    st_ = g.ACTIONS[action][0](s, **args)
    assert st_.rejected is None, (action, args, st_.rejected)
    policy.observe(st_.effects)
    return st_.state


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(served=st.lists(tokens.filter(lambda p: len(p) > 1), min_size=1, max_size=8),
       spills=st.lists(st.integers(0, 4), max_size=3), probes=st.lists(tokens, min_size=1,
                                                                         max_size=6))
def test_best_hits_are_the_brute_force_longest(served: list[list[int]], spills: list[int],
                                                probes: list[list[int]]) -> None:
    # (a chunk of 2 tokens: below what RBLN compiles, so the constants are the spec's own)
    consts = g.Consts(B=1, K=5, C=C, S=16, T=1, PREFIX=True, RESERVED=False, SCRATCH=0,
                      HYBRID=False, HOST=True, H=3, PREEMPT=False)
    s, policy, r = g.init(consts, False), Policy(), 0
    for p in served:  # each prompt served to its end and kept as a cache entry
        s = _step(s, policy, "submit", r=r, p=seq(p))
        choice = policy.admission(s, r)
        assert choice is not None
        s = _step(s, policy, choice.action, **choice.args)
        lane = choice.args["l"]
        if choice.action in ("admit_hit", "admit_host_hit"):
            s = _step(s, policy, "load_done" if choice.action == "admit_host_hit"
                      else "copy_done", l=lane)
        while s.phase.get(r) == g.PHASE_PREFILL:
            s = _step(s, policy, "prefill", l=lane, tok=1)
        s = _step(s, policy, "finish", l=lane, keep=True)
        r += 1
    for b in spills:  # some entries stored to the host tier
        place = policy.spill_slot(s, b) if s.owner[b] == g.OWNER_CACHE else None
        if place is not None and not place[1]:  # an empty slot
            s = _step(s, policy, "spill", b=b, h=place[0])
            s = _step(s, policy, "store_done", h=place[0])
    k, h = s.consts.K, s.consts.H
    # the served prompts, one token longer (a whole-prompt hit), are probes too
    for p in map(seq, probes + [q + [0] for q in served]):
        device = _reference(s, p, range(k), lambda b: s.owner[b] == g.OWNER_CACHE
                            and s.start[b] == 0, s.key, lambda b: len(s.key[b]),
                            policy.last_use)
        host = _reference(s, p, range(h), lambda x: s.slot_state[x] == g.SLOTSTATE_STORED
                          and s.slot_start[x] == 0, s.slot_key,
                          lambda x: len(s.slot_key[x]), policy.slot_use)
        event(f"device hit {device is not None}, host hit {host is not None}")
        for state in (s, ip.thaw(s)):
            assert policy.best_hit(state, p) == device, (p, device)
            assert policy.best_host_hit(state, p) == host, (p, host)


def _reference_reusable(policy: Policy, s: Any, exclude: int | None) -> int | None:
    """The policy's preference as a definition: the lowest free block, else among the reusable
    cache entries those no prefilling lane will copy next, past a table's first block, least
    recently used, lowest; every block and lane checked one by one."""
    k, c = s.consts.K, s.consts.C
    ok = [b for b in range(k) if b != exclude and g.reusable(s, b)]
    free = [b for b in ok if s.owner[b] == g.OWNER_FREE]
    if free:
        return free[0]
    prefilling = [ln for ln in range(s.consts.B) if s.busy[ln]
                  and s.phase.get(s.lane_req[ln]) == g.PHASE_PREFILL]

    def ahead(b: int) -> bool:
        return any(s.start[b] >= s.length[ln] and
                   s.key[b].tokens()[:s.start[b] + c] == s.lane_seq[ln].tokens()[:s.start[b] + c]
                   and len(s.key[b]) >= s.start[b] + c and len(s.lane_seq[ln]) >= s.start[b] + c
                   for ln in prefilling)

    return min(ok, key=lambda b: (ahead(b), s.start[b] == 0, policy.last_use.get(b, 0)),
               default=None)


def _reference_order_without_ahead(policy: Policy, s: Any, exclude: int | None) -> int | None:
    ok = [b for b in range(s.consts.K) if b != exclude and g.reusable(s, b)]
    free = [b for b in ok if s.owner[b] == g.OWNER_FREE]
    return free[0] if free else min(
        ok, key=lambda b: (s.start[b] == 0, policy.last_use.get(b, 0)), default=None)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(served=st.lists(st.lists(st.integers(0, 1), min_size=2, max_size=11), min_size=1,
                       max_size=6),
       last=st.lists(st.integers(0, 1), min_size=2, max_size=11), continues=st.booleans(),
       prefill=st.integers(0, 5), copy=st.booleans(), exclude=st.none() | st.integers(0, 7))
# (the ahead tier decides: the later blocks of the first entry are the least recently used, and
# the admitted lane, whose prompt extends that entry's, will copy them next; found by search)
@example(served=[[0] * 6] + [[0, 0]] * 5, last=[0, 0], continues=True, prefill=0, copy=False,
         exclude=None)
def test_eviction_order_is_the_reference_order(served: list[list[int]], last: list[int],
                                               continues: bool, prefill: int, copy: bool,
                                               exclude: int | None) -> None:
    """`Policy.reusable` (C-speed selection) against its definition, on paged tables (entries
    that start past a table's first block), after hits (use times), with a lane prefilling a
    prompt that entries continue (`ahead`) and maybe a copy in flight (a pinned entry)."""
    if continues:  # the last prompt extends a served one: its later blocks are ahead of it
        last = (served[0] + last)[:11]  # (a prompt fits T * S = 12 tokens with one to spare)
    consts = g.Consts(B=2, K=8, C=C, S=4, T=3, PREFIX=True, RESERVED=False, SCRATCH=0,
                      HYBRID=False, HOST=False, H=0, PREEMPT=False)
    s, policy = g.init(consts, False), Policy()
    for r, p in enumerate(served + [last]):
        s = _step(s, policy, "submit", r=r, p=seq(p))
        choice = policy.admission(s, r)
        if choice is None:
            break
        s = _step(s, policy, choice.action, **choice.args)
        lane, final = choice.args["l"], r == len(served)
        if choice.action == "admit_hit" and (not final or not copy):
            s = _step(s, policy, "copy_done", l=lane)
        steps = prefill if final else 99
        while steps and s.phase.get(r) == g.PHASE_PREFILL and not s.copying[lane]:
            grow = policy.growth(s)
            if grow:
                step = policy.grow(s, grow[0])
                if step is None:
                    break
                s = _step(s, policy, step.action, **step.args)
                if step.action == "grow_hit":
                    s = _step(s, policy, "copy_done", l=lane)
                continue
            s = _step(s, policy, "prefill", l=lane, tok=1)
            steps -= 1
        if not final and s.phase.get(r) == g.PHASE_DECODE:
            s = _step(s, policy, "finish", l=lane, keep=True)
        elif not final:
            break
    want = _reference_reusable(policy, s, exclude)
    kind = "none" if want is None else "free" if s.owner[want] == g.OWNER_FREE else \
        "a later block" if s.start[want] else "a first block"
    event(f"pick: {kind}")
    event(f"pinned entry: {any(s.copying)}")
    tier = want != _reference_order_without_ahead(policy, s, exclude)
    event(f"an entry a prefilling lane continues is kept: {tier}")
    for state in (s, ip.thaw(s)):
        assert policy.reusable(state, exclude) == want, (want, exclude)
