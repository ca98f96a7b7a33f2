"""An audit of the scheduling layer (`Policy` and the batcher's choice of what each step runs)
against bug classes public serving engines have had in their schedulers: starvation and
fairness, preemption and recompute, prefix hits at edge lengths, and request lifecycle edges.
The tests that failed before their fix:

- a long prompt in a higher-numbered lane never prefilled while requests that end at their
  prefill (max_new_tokens=1 here) kept arriving: the step's prefill went to the lowest-numbered
  lane that could prefill, and each new request took the lowest idle lane. Now the earliest
  admitted prefilling lane goes first (`Policy.prefill_lane`);
- a decoding request never got another token while such requests kept arriving: a prefill
  always went before a decode call. Now decoding lanes wait at most `max_decode_wait` prefill
  calls in a row (default: the chunks of the longest prompt), then a decode call goes first
  (`Policy.prefill_first`).

The rest are properties that found nothing: preemption storms at the proved minimum of blocks
with random arrivals and aborts stay token-exact, emit every token once, end every request
once, leak nothing and finish (every policy choice accepted by the core, or `CoreRejected`
would fail the run); lifecycle and prefix-hit edges.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.policy import Policy
from atom_core.runtime import TorchReferenceRuntime
from tests.test_batcher_audit import at_rest as settled
from tests.test_paged import at_rest

V = 128
_rng = random.Random(2024)


@pytest.fixture(autouse=True)
def _same_tokens_in_every_run() -> None:
    # each test draws the same prompts whichever tests ran before it in this process (xdist)
    _rng.seed(2024)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(V) for _ in range(n)]


def eager(lanes: int = 2, policy: Policy | None = None, **kw: object) -> AtomBatcher:
    """One block per sequence (max_seq_len 256, chunk 64): lanes + 1 blocks, reserved scratch."""
    cfg = Config(lanes=lanes, kv_blocks=lanes + 1 + (1 if kw.get("prefix_cache") else 0),
                 max_seq_len=256, prefill_chunk=64, **kw)  # type: ignore[arg-type]
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), policy=policy, ghost=True)


def record_calls(b: AtomBatcher) -> list[str]:
    """The runtime calls of `b` from now on, in order: "p" a prefill, "d" a decode."""
    calls: list[str] = []
    rt = b.runtime
    decode, prefill = rt.decode, rt.prefill

    def rec_decode(*a: object) -> object:
        calls.append("d")
        return decode(*a)

    def rec_prefill(*a: object) -> object:
        calls.append("p")
        return prefill(*a)

    rt.decode, rt.prefill = rec_decode, rec_prefill  # type: ignore[method-assign]
    return calls


def oracle(b: AtomBatcher, rid: int) -> list[int]:
    r = b.requests[rid]
    return oracle_for(b.runtime).generate(r.prompt, r.max_new_tokens, r.eos_token_id)


# ------------------------------------------------------------------ starvation and fairness
LONG = _toks(200)  # four chunks


def test_a_long_prompt_is_not_starved_by_requests_that_end_at_prefill() -> None:
    """Lane 0 takes a one-token request per step, each ending in its prefill (max_new_tokens=1:
    embeddings, classification, a scoring call), while a four-chunk prompt waits in lane 1.
    Before: the prefill went to the lowest lane, so the long prompt stayed at length 0 for as
    long as short requests came (all 60 steps here). Now it prefills (FCFS among prefilling
    lanes) and finishes, token-exact, while the short ones keep being served."""
    b = eager()
    first = b.submit(_toks(10), 1)
    long = b.submit(LONG, 4)
    done_at = None
    for step in range(60):
        b.submit([2, 3, step], 1)
        b.step()
        b.check_invariants()
        if done_at is None and b.requests[long].ended:
            done_at = step
    assert done_at is not None, \
        f"long request not done after 60 steps: length {b.state.length[1]} of {len(LONG)}"
    # its 4 chunks in a row, then 3 decodes, each after at most 4 short prefills
    assert done_at <= 4 + 3 * 5, done_at
    assert b.requests[long].error is None and b.requests[long].tokens == oracle(b, long)
    assert b.requests[first].tokens == oracle(b, first)


def test_a_decoding_request_is_not_starved_by_requests_that_end_at_prefill() -> None:
    """A request decodes in lane 0 while one-step requests (max_new_tokens=1) arrive, one per
    step, into lane 1. Before: a prefill always went first, so the decoding request had its
    first token only, after 60 steps (no decode call at all). Now it decodes at least once per
    `max_decode_wait` prefill calls in a row (the chunks of the longest prompt: 4 here)."""
    b = eager()
    d = b.submit(_toks(10), 10)
    b.step()  # its prefill: it decodes from now on
    calls = record_calls(b)
    shorts, ended_at = [], None
    for step in range(60):
        shorts.append(b.submit([2, 3, step], 1))
        b.step()
        b.check_invariants()
        if ended_at is None and b.requests[d].ended:
            ended_at = len(calls)
    assert ended_at is not None, \
        f"decode starved: {len(b.requests[d].tokens)} tokens, calls {''.join(calls)}"
    assert b.requests[d].tokens == oracle(b, d)
    # never more than 4 prefill calls in a row while it could decode
    assert "ppppp" not in "".join(calls[:ended_at]), "".join(calls)
    assert all(b.requests[r].tokens == oracle(b, r) for r in shorts if b.requests[r].ended)


def test_one_prompt_prefills_without_a_decode_in_between() -> None:
    """The default bound lets one prompt of any length prefill in one run (its first token as
    soon as before): a max-length prompt admitted beside a decoding lane takes its 4 chunks in
    a row. `max_decode_wait=1` alternates instead (a choice: both are token-exact); 0 would
    starve prefill (no request would start while another decodes) and is refused."""
    for wait, want in ((None, "pppp"), (1, "pdpdpdp")):
        b = eager(policy=Policy(max_decode_wait=wait))
        d = b.submit(_toks(10), 30)
        b.step()
        calls = record_calls(b)
        long = b.submit(_toks(255), 2)
        while not b.requests[long].tokens:
            b.step()
        assert "".join(calls) == want, (wait, calls)
        while b.busy():
            b.step()
        assert b.requests[d].tokens == oracle(b, d)
        assert b.requests[long].tokens == oracle(b, long)
    with pytest.raises(ValueError, match="max_decode_wait"):
        Policy(max_decode_wait=0)


def test_waiting_requests_are_admitted_in_submission_order() -> None:
    """Admission is FCFS (head of line: a request that does not fit waits, and so does every
    one behind it), so a long prompt is never overtaken: each request's admission order is its
    submission order, with one lane and requests of every length."""
    b = eager(lanes=1)
    rids = [b.submit(_toks(n), 2) for n in (200, 1, 130, 64, 3, 255)]
    admitted: list[int] = []
    while b.busy():
        b.step()
        lane_req = b.state.lane_req[0] if b.state.busy[0] else None
        if lane_req is not None and lane_req not in admitted:
            admitted.append(lane_req)
    assert admitted == rids


# ------------------------------------------------------------------ preemption storms
S, C = 256, 64  # (as tests/test_paged.py; a chunk is a multiple of 64)
PREFIXES = [_toks(140), _toks(70)]


@st.composite
def workloads(draw: st.DrawFn) -> list[tuple[int, list[int], int, int | None, int | None]]:
    """Requests as (arrival step, prompt, max_new_tokens, eos index or None, abort step or
    None): prompts at the edges (one token, a chunk, a block of 64, max_seq_len - 1) or sharing
    a prefix (hits), some long enough to reach max_seq_len exactly."""
    out = []
    for _ in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["edge", "shared", "random"]))
        if kind == "edge":
            prompt = _toks(draw(st.sampled_from([1, C - 1, C, C + 1, 64, 65, S - 1])))
        elif kind == "shared":
            prompt = draw(st.sampled_from(PREFIXES)) + _toks(draw(st.integers(0, 40)))
        else:
            prompt = _toks(draw(st.integers(1, S - 1)))
        out.append((draw(st.integers(0, 12)), prompt, draw(st.sampled_from([1, 2, 8, 30, S])),
                    draw(st.one_of(st.none(), st.integers(0, 2))),
                    draw(st.one_of(st.none(), st.none(), st.integers(0, 40)))))
    return out


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lanes=st.integers(2, 3), t=st.sampled_from([2, 4]), prefix=st.booleans(),
       scratch=st.sampled_from(["reserved", "dynamic"]), work=workloads())
def test_preemption_storms_are_token_exact_and_finish(
        lanes: int, t: int, prefix: bool, scratch: str,
        work: list[tuple[int, list[int], int, int | None, int | None]]) -> None:
    """At the preemption rule's minimum of blocks, requests arrive over several steps and some
    are aborted in whatever phase they are in (waiting, mid-prefill, decoding, preempted, or
    already ended). Every step's choices are accepted by the core (else `CoreRejected`), the
    invariants (ghost included) hold after every step, the run finishes within a step bound (no
    livelock), a preempted request's tokens are exactly the oracle's with none streamed twice,
    every request ends once, an aborted one emitted a prefix of its answer, and at rest no
    block is held."""
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, t, preemption=True),
                 max_seq_len=S, block_size=S // t, prefill_chunk=C, prefix_cache=prefix,
                 scratch=scratch, preemption=True)
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    o = oracle_for(b.runtime)
    rids: dict[int, int] = {}
    streamed: dict[int, list[int]] = {}
    ends: dict[int, list[str]] = {}
    aborted: set[int] = set()
    step = 0
    while step <= 12 or b.busy():
        assert step < 1500, "not done after 1500 steps"
        for j, (at, prompt, n, eos_at, abort_at) in enumerate(work):
            if at == step:
                want = o.generate(prompt, 3)
                eos = None if eos_at is None else want[min(eos_at, len(want) - 1)]
                rids[j] = b.submit(prompt, n, eos)
                streamed[rids[j]], ends[rids[j]] = [], []
            if abort_at == step and j in rids:
                live = not b.requests[rids[j]].ended
                assert b.abort(rids[j]) is live
                if live:
                    aborted.add(rids[j])
        for e in b.step():
            if e.kind == "token":
                streamed[e.request_id].append(e.token)  # type: ignore[arg-type]
            elif e.kind in ("finished", "error"):
                ends[e.request_id].append(e.kind)
        b.check_invariants()
        step += 1
    for rid in rids.values():
        r = b.requests[rid]
        want = o.generate(r.prompt, r.max_new_tokens, r.eos_token_id)
        assert streamed[rid] == r.tokens, rid  # nothing streamed twice or lost
        if rid in aborted:
            assert ends[rid] == [] and r.error == "aborted" and r.tokens == want[:len(r.tokens)]
        else:
            assert ends[rid] == ["finished"] and r.error is None and r.tokens == want, \
                (rid, r.error, len(r.prompt), r.tokens, want)
    at_rest(b)


def test_victims_are_the_most_recently_admitted_and_the_oldest_progresses() -> None:
    """The victim order as documented (`Policy.victim`: the most recently admitted lane the
    core allows): every preemption's victim is the youngest running request at that moment,
    and the oldest running request is never preempted while another runs."""
    cfg = Config(lanes=3, kv_blocks=min_kv_blocks(3, False, "reserved", 4, preemption=True),
                 max_seq_len=S, block_size=S // 4, prefill_chunk=C, scratch="reserved",
                 preemption=True)
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    for n in (90, 60, 100, 30, 70):
        b.submit(_toks(n), 30)
    order: list[int] = []  # running requests, oldest admission first
    preempted = 0
    while b.busy():
        running = [r for r in order if b.phase(r) in (core.PHASE_PREFILL, core.PHASE_DECODE)]
        events = b.step()
        b.check_invariants()
        victims = [e.request_id for e in events if e.kind == "preempted"]
        for v in victims:
            assert v == running[-1], (v, running)
            assert len(running) == 1 or v != running[0]
            running.remove(v)
            preempted += 1
        order = [r for r in order if b.phase(r) in (core.PHASE_PREFILL, core.PHASE_DECODE)]
        for ln in range(cfg.lanes):
            if b.state.busy[ln] and b.state.lane_req[ln] not in order:
                order.append(b.state.lane_req[ln])
    assert preempted > 0
    assert all(b.requests[r].tokens == oracle(b, r) for r in b.requests)
    at_rest(b)


# ------------------------------------------------------------------ lifecycle and hit edges
def test_lifecycle_edges_are_token_exact_and_leak_nothing() -> None:
    """max_new_tokens=1; an end token as the first token; a prompt of max_seq_len - 1 (two
    tokens: the last one needs no KV); a request that reaches max_seq_len exactly; a prompt of
    exactly one chunk (never a hit) and its full-prompt repeat (a hit leaves at least one token
    to compute); the same prompt twice in one step; abort twice, abort after the end and after
    forget. Every answer is the oracle's, and at rest every block is free, cached or scratch."""
    b = eager(prefix_cache=True)
    p = _toks(100)
    first_tok = oracle_for(b.runtime).generate(p, 1)[0]
    rids = [b.submit(p, 1), b.submit(p, 5, eos_token_id=first_tok), b.submit(_toks(255), 9),
            b.submit(_toks(200), 100), b.submit(LONG[:64], 3)]
    while b.busy():
        b.step()
        b.check_invariants()
    lens = [len(b.requests[r].tokens) for r in rids]
    assert lens == [1, 1, 2, 57, 3]
    hits = b.stats.prefix_hit_tokens
    again = [b.submit(LONG[:64], 3), b.submit(p, 2), b.submit(p, 2)]  # same step, same prompt
    while b.busy():
        b.step()
        b.check_invariants()
    assert b.stats.prefix_hit_tokens - hits >= 64  # the repeats of p hit; LONG[:64] cannot
    for r in rids + again:
        assert b.requests[r].error is None and b.requests[r].tokens == oracle(b, r), r
    assert b.abort(again[0]) is False
    assert b.forget(again[0]) and b.abort(again[0]) is False
    w = b.submit(p, 3)
    assert b.abort(w) is True and b.abort(w) is False
    settled(b)
