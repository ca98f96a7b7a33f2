"""AtomBatcher on the torch reference runtime: token exactness against the cache-free oracle,
abort and submit semantics, `describe()`, stats, and the JSONL trace (replayed in-process and by
`atom-core check-trace`).

Sizes are small (max_seq_len 256, chunk 64, prompts up to ~250 tokens) and every request's
oracle continuation is memoised (`atom_core.demo.Oracle`), so the whole file runs in seconds.
The ghost state is on and `check_invariants()` runs after every step.
"""

from __future__ import annotations

import io
import json
import random
import re

import pytest
import torch

from atom_core import cli
from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.replay import replay
from atom_core.runtime import TorchReferenceRuntime

S, C, V = 256, 64, 128
_rng = random.Random(1234)
SYSTEM = [_rng.randrange(V) for _ in range(140)]  # shared system prompt: 2 whole chunks + 12


def _toks(n: int) -> list[int]:
    return [_rng.randrange(V) for _ in range(n)]


# A fixed pool, so the memoised oracle runs each prompt once for the whole file.
POOL: list[list[int]] = [
    SYSTEM + _toks(5),
    SYSTEM + _toks(30),
    SYSTEM + _toks(60),           # 200 tokens
    SYSTEM[:128],                 # exactly the first two chunks: may hit only 64
    SYSTEM[:100] + _toks(50),     # shares one whole chunk
    _toks(7),                     # unrelated, shorter than a chunk
    _toks(64),                    # exactly one chunk
    _toks(130),                   # unrelated, three chunks
    SYSTEM + _toks(113),          # 253 tokens: the block fills up (4 tokens < MAX_NEW)
]
POOL.append(list(POOL[1]))        # a duplicate prompt (the seeds' shape)
MAX_NEW = 6


def config(lanes: int, prefix: bool, scratch: str, extra: int = 0) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch) + extra,
                  max_seq_len=S, prefill_chunk=C, prefix_cache=prefix, scratch=scratch)


def make(lanes: int, prefix: bool, scratch: str, extra: int = 0, **kw) -> AtomBatcher:
    cfg = config(lanes, prefix, scratch, extra)
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True, **kw)


def oracle(b: AtomBatcher):
    return oracle_for(b.runtime)


def expected(b: AtomBatcher, rid: int) -> list[int]:
    r = b.requests[rid]
    return oracle(b).generate(r.prompt, r.max_new_tokens, r.eos_token_id)


def step_checked(b: AtomBatcher, log: list[Event] | None = None) -> list[Event]:
    events = b.step()
    b.check_invariants()
    json.dumps(b.describe())
    if log is not None:
        log.extend(events)
    return events


def drive(b: AtomBatcher, log: list[Event] | None = None, max_steps: int = 5000,
          rng: random.Random | None = None, abort_p: float = 0.0,
          partial: bool = False) -> list[int]:
    """Step until idle (at most `max_steps` steps when `partial`), checking invariants after
    every step; with `rng`, abort a random known request (waiting, running or ended) with
    probability `abort_p` before a step. Returns the ids aborted while still live."""
    aborted: list[int] = []
    for _ in range(max_steps):
        if not b.busy():
            return aborted
        if rng is not None and b.requests and rng.random() < abort_p:
            rid = rng.choice(sorted(b.requests))
            live = not b.requests[rid].ended
            assert b.abort(rid) is live
            b.check_invariants()
            if live:
                aborted.append(rid)
        step_checked(b, log)
    if partial:
        return aborted
    raise AssertionError(f"not idle after {max_steps} steps")


def assert_exact(b: AtomBatcher, aborted: list[int] = ()) -> None:
    """Every completed request equals the oracle; an aborted one is a prefix of it."""
    for rid, r in b.requests.items():
        assert r.ended, rid
        want = expected(b, rid)
        if rid in aborted:
            assert r.error == "aborted"
            assert r.tokens == want[:len(r.tokens)], rid
        else:
            assert r.error is None, (rid, r.error)
            assert r.tokens == want, (rid, r.prompt[:8], len(r.prompt))


def assert_events(b: AtomBatcher, log: list[Event], aborted: list[int] = ()) -> None:
    """Token events are the request's tokens, in order; each request not aborted has exactly
    one terminal event, after its tokens."""
    for rid, r in b.requests.items():
        mine = [e for e in log if e.request_id == rid]
        assert [e.token for e in mine if e.kind == "token"] == r.tokens
        ends = [e for e in mine if e.kind != "token"]
        if rid in aborted:
            assert ends == []
        else:
            assert len(ends) == 1 and mine[-1] is ends[0]
            assert ends[0].kind == ("finished" if r.error is None else "error")


def blocks_at_rest(b: AtomBatcher) -> None:
    """Idle: every block is free or a cache entry (or the reserved scratch block)."""
    d = b.describe()
    for blk, own in enumerate(d["blocks"]):
        if b.config.scratch == "reserved" and blk == b.config.scratch_id:
            assert own == "scratch"
        else:
            assert own in ("free", "cache") if b.config.prefix_cache else own == "free", d
    assert all(ln["request"] is None for ln in d["lanes"]) and d["waiting"] == []


# --------------------------------------------------------------------------- exactness matrix
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_token_exact_matrix(lanes, prefix, scratch):
    """Minimum legal K; the pool in random order, twice over, with random max_new_tokens and EOS
    and random aborts (of waiting, running and ended requests) between steps."""
    seed = lanes * 100 + prefix * 10 + (scratch == "dynamic")
    rng = random.Random(seed)
    b = make(lanes, prefix, scratch)
    log: list[Event] = []
    order = POOL * 2
    rng.shuffle(order)
    late = order[len(order) // 2:]
    for p in order[:len(order) // 2]:
        eos = None
        if rng.random() < 0.25:  # an EOS the oracle emits (so the request stops early)
            eos = oracle(b).generate(p, MAX_NEW)[rng.randrange(3)]
        b.submit(p, rng.randint(1, MAX_NEW), eos)
    aborted = drive(b, log, rng=rng, abort_p=0.08, max_steps=30,
                    partial=True)  # part of the way
    for p in late:  # more arrive while the first ones run
        b.submit(p, rng.randint(1, MAX_NEW))
    aborted += drive(b, log, rng=rng, abort_p=0.05)
    assert_exact(b, aborted)
    assert_events(b, log, aborted)
    blocks_at_rest(b)
    assert b.stats.runtime_errors == 0
    if prefix:
        assert b.stats.prefix_hit_tokens > 0
    else:
        assert b.stats.prefix_hit_tokens == 0
    assert len(b.requests) - len(aborted) >= len(order) // 2  # most requests completed


@pytest.mark.parametrize("prefix,scratch", [(True, "reserved"), (True, "dynamic"),
                                            (False, "reserved"), (False, "dynamic")])
def test_seeds_case_same_prompt_twice_one_lane_minimum_k(prefix, scratch):
    """The seeds' incident: B = 1, the same prompt twice. At the minimum legal K (2 with prefix
    cache and reserved scratch, where the seeds' scheduler was stuck) the second request is
    admitted (a mandatory prefix hit: its lane takes the cache entry over, nothing copied) and
    both equal the oracle."""
    b = make(1, prefix, scratch)
    assert b.config.kv_blocks == 1 + {(True, "reserved"): 1, (True, "dynamic"): 0,
                                      (False, "reserved"): 1, (False, "dynamic"): 0}[
        (prefix, scratch)]
    p = POOL[1]
    r1, r2 = b.submit(p, MAX_NEW), b.submit(p, MAX_NEW)
    drive(b)
    assert_exact(b)
    assert b.requests[r1].tokens == b.requests[r2].tokens
    # the second is a hit of both whole chunks of the 170-token prompt, iff the cache is on
    assert b.stats.prefix_hit_tokens == (128 if prefix else 0)
    assert b.stats.prefill_tokens == 2 * len(p) - b.stats.prefix_hit_tokens
    assert b.runtime.calls["copy"] == 0  # (taken over: the only block is the entry)
    blocks_at_rest(b)
    # with a block to spare the hit is copied and the entry kept
    b = make(1, prefix, scratch, extra=1)
    r1, r2 = b.submit(p, MAX_NEW), b.submit(p, MAX_NEW)
    drive(b)
    assert_exact(b)
    assert b.stats.prefix_hit_tokens == (128 if prefix else 0)
    assert b.runtime.calls["copy"] == (1 if prefix else 0)
    blocks_at_rest(b)


def test_many_shared_prefix_requests_many_hits_exact():
    """Four lanes and two spare blocks: the shared system prompt is copied, not recomputed."""
    b = make(4, True, "dynamic", extra=2)
    rng = random.Random(7)
    shared = [p for p in POOL if p[:128] == SYSTEM[:128] and len(p) > 128]
    ids = [b.submit(rng.choice(shared), rng.randint(1, MAX_NEW)) for _ in range(12)]
    log: list[Event] = []
    drive(b, log)
    assert_exact(b)
    assert_events(b, log)
    # all but the first admissions (4 lanes start at once, before anything is cached) hit
    assert b.runtime.calls["copy"] >= len(ids) - 4
    assert b.stats.prefix_hit_tokens >= 128 * b.runtime.calls["copy"]  # the system prompt
    assert b.stats.prefix_hit_tokens % C == 0


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
def test_second_turn_hits_the_first_turns_generated_tokens(scratch):
    """A cache entry's key is prompt + generated tokens: a follow-up whose prompt is the whole
    first turn plus more hits chunks that the first turn generated (not only its prompt)."""
    b = make(1, True, scratch)
    first = b.submit(POOL[1], 40)  # 170 prompt tokens; its entry holds 209 tokens
    drive(b)
    turn = POOL[1] + b.requests[first].tokens + _toks(21)  # 231 tokens
    second = b.submit(turn, 8)
    drive(b)
    assert_exact(b)
    assert b.stats.prefix_hit_tokens == 192  # three chunks, the third partly generated
    assert b.stats.prefill_tokens == len(POOL[1]) + len(turn) - 192
    assert b.requests[second].tokens


# --------------------------------------------------------------------------- abort
def test_abort_unknown_or_ended_is_a_noop_returning_false():
    b = make(2, True, "dynamic")
    assert b.abort(0) is False and b.abort(-1) is False and b.abort(12345) is False
    rid = b.submit(POOL[5], 2)
    drive(b)
    before = b.describe()
    assert b.requests[rid].error is None
    assert b.abort(rid) is False
    assert b.describe() == before and b.requests[rid].error is None
    b.check_invariants()


def test_abort_waiting_request_ends_it():
    b = make(1, False, "dynamic")
    r0, r1 = b.submit(POOL[0], 3), b.submit(POOL[5], 3)
    step_checked(b)  # r0 admitted; r1 waits
    assert b.describe()["waiting"] == [r1]
    assert b.abort(r1) is True
    assert b.abort(r1) is False  # ended now
    b.check_invariants()
    assert b.state.phase.get(r1) == core.PHASE_ABORTED
    assert b.describe()["waiting"] == [] and r1 not in b.waiting
    res = b.run_until_done(max_steps=100)
    assert res[r1].error == "aborted" and res[r1].tokens == []
    assert res[r0].error is None and res[r0].tokens == expected(b, r0)
    assert b.runtime.calls["prefill"] == 3  # r0's three chunks; r1 never ran


@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
def test_abort_running_request_frees_its_block(when, scratch):
    b = make(2, True, scratch)
    r0, r1 = b.submit(POOL[2], 20), b.submit(POOL[7], 4)
    step_checked(b)  # both admitted; r0's first chunk
    if when == "decode":
        while len(b.requests[r0].tokens) < 2:
            step_checked(b)
        assert b.state.phase.get(r0) == core.PHASE_DECODE
    else:
        assert b.state.phase.get(r0) == core.PHASE_PREFILL  # one of its four chunks done
        assert b.state.length[b.state.req_lane.get(r0)] == C
    lane = b.state.req_lane.get(r0)
    blk = b.state.tail[lane]
    assert b.describe()["blocks"][blk] == f"lane:{lane}"
    got = list(b.requests[r0].tokens)
    assert b.abort(r0) is True
    b.check_invariants()
    d = b.describe()
    assert d["blocks"][blk] == "free"  # partial KV is dropped, never cached
    assert d["lanes"][lane] == {"lane": lane, "request": None, "length": 0, "blocks": []}
    assert b.state.phase.get(r0) == core.PHASE_ABORTED
    drive(b)
    assert b.requests[r0].tokens == got and b.requests[r0].error == "aborted"
    assert got == expected(b, r0)[:len(got)]
    assert b.requests[r1].tokens == expected(b, r1)
    # the aborted request's block is reused by a later request, which is exact
    r2 = b.submit(POOL[0], 3)
    drive(b)
    assert b.requests[r2].tokens == expected(b, r2)
    blocks_at_rest(b)


# --------------------------------------------------------------------------- submit errors
def test_submit_rejects_bad_requests_with_clear_messages():
    b = make(1, True, "reserved")
    before = b.describe()
    with pytest.raises(ValueError, match="empty prompt"):
        b.submit([], 4)
    with pytest.raises(ValueError, match=r"256 tokens can never fit: max_seq_len=256 holds at "
                                         r"most 255 prompt tokens"):
        b.submit([1] * S, 4)
    with pytest.raises(ValueError, match="can never fit"):
        b.submit([1] * (S + 50), 4)
    with pytest.raises(ValueError, match=r"outside the vocabulary 0\.\.127"):
        b.submit([1, 2, V], 4)
    with pytest.raises(ValueError, match=r"outside the vocabulary 0\.\.127"):
        b.submit([-1, 2], 4)
    for eos in (V, -1):  # never sampled: the request could not end on it
        with pytest.raises(ValueError, match=rf"eos_token_id {eos} is outside the vocabulary"):
            b.submit([1, 2], 4, eos)
    for bad in (0, -3, 2.5, "4", None):
        with pytest.raises(ValueError, match=f"max_new_tokens must be an integer >= 1, got "
                                             f"{re.escape(repr(bad))}"):
            b.submit([1, 2], bad)
    for bad_ids in ([1, 2.0], [1.7], ["5"], [None]):  # never truncated or parsed
        with pytest.raises(ValueError, match="prompt token ids must be integers"):
            b.submit(bad_ids, 4)
    # nothing changed: no id consumed, nothing waits
    assert b.describe() == before and b.requests == {} and not b.busy()
    # the longest prompt that fits is accepted and served: 1 token from prefill, 1 from decode
    rid = b.submit(torch.tensor(POOL[3] + POOL[7][:S - 1 - 128]), 16)  # any integer sequence
    assert rid == 0 and b.requests[rid].prompt == POOL[3] + POOL[7][:S - 1 - 128]
    assert all(type(t) is int for t in b.requests[rid].prompt)
    drive(b)
    assert b.requests[rid].tokens == expected(b, rid) and len(b.requests[rid].tokens) == 2


# --------------------------------------------------------------------------- describe, stats
def test_describe_is_json_and_consistent():
    b = make(2, True, "reserved", extra=1)
    for p in POOL[:6]:
        b.submit(p, 4)
    seen_cache = False
    while b.busy():
        step_checked(b)
        d = json.loads(json.dumps(b.describe()))
        assert d["waiting"] == list(b.waiting)
        assert d["stats"] == {k: getattr(b.stats, k) for k in d["stats"]}
        assert len(d["blocks"]) == b.config.kv_blocks
        assert d["blocks"][b.config.scratch_id] == "scratch"
        busy = [ln for ln in d["lanes"] if ln["request"] is not None]
        for ln in busy:
            blk = b.state.tail[ln["lane"]]
            assert d["blocks"][blk] == f"lane:{ln['lane']}"
            assert not b.requests[ln["request"]].ended
            assert 0 <= ln["length"] <= S
        assert sum(o.startswith("lane:") for o in d["blocks"]) == len(busy)
        cached = [blk for blk, o in enumerate(d["blocks"]) if o == "cache"]
        assert [c["block"] for c in d["cache"]] == cached
        for c in d["cache"]:
            assert c["tokens"] == len(b.state.key[c["block"]]) > 0
            seen_cache = True
    assert seen_cache


def test_stats_add_up():
    b = make(2, True, "dynamic", extra=1)
    rng = random.Random(3)
    ps = [rng.choice(POOL) for _ in range(10)]
    ids = [b.submit(p, rng.randint(1, MAX_NEW)) for p in ps]
    padding = 0
    while b.busy():
        dec = b.runtime.calls["decode"]
        idle = sum(1 for ln in range(2)
                   if not (b.state.busy[ln]
                           and b.state.phase.get(b.state.lane_req[ln]) == core.PHASE_DECODE))
        step_checked(b)
        if b.runtime.calls["decode"] > dec:
            padding += idle
    assert_exact(b)
    st = b.stats
    assert st.prefill_tokens + st.prefix_hit_tokens == sum(len(p) for p in ps)
    assert st.prefix_hit_tokens > 0 and st.prefix_hit_tokens % C == 0
    assert st.generated_tokens == sum(len(b.requests[r].tokens) for r in ids)
    assert st.decode_steps == b.runtime.calls["decode"]
    # each request: one token from its last prefill chunk, the rest from decode steps
    assert st.decode_rows_padding == padding
    assert st.decode_steps * 2 - st.decode_rows_padding == st.generated_tokens - len(ids)
    assert st.runtime_errors == 0


# --------------------------------------------------------------------------- trace
def traced_run() -> tuple[AtomBatcher, str]:
    buf = io.StringIO()
    b = make(2, True, "dynamic", extra=1, trace=buf)  # (a spare block: hits copy)
    rng = random.Random(11)
    for p in POOL:
        b.submit(p, rng.randint(1, 4))
    aborted = drive(b, rng=rng, abort_p=0.1)
    assert_exact(b, aborted)
    return b, buf.getvalue()


def test_trace_replays_ok_in_process_and_by_cli(tmp_path, capsys):
    b, text = traced_run()
    lines = text.splitlines()
    assert json.loads(lines[0]) == {"consts": {"B": 2, "K": 3, "C": C, "S": S, "PREFIX": True,
                                               "RESERVED": False, "SCRATCH": 2, "T": 1,
                                               "HYBRID": False, "HOST": False, "H": 0,
                                               "PREEMPT": False}}
    v = replay(lines)
    assert v.ok, (v.line, v.error)
    assert v.steps == len(lines) - 1
    for action in ("submit", "admit_miss", "admit_hit", "copy_done", "prefill", "decode",
                   "finish"):
        assert v.counts.get(action, 0) > 0, (action, v.counts)
    assert v.counts["submit"] == len(POOL)
    assert v.counts["decode"] == b.stats.decode_steps
    assert v.counts["admit_hit"] == b.runtime.calls["copy"]
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    assert cli.main(["check-trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {v.steps} steps") and "decode " in out
    assert cli.main(["check-trace", str(path), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["ok"] is True and js["steps"] == v.steps and js["counts"] == v.counts


def test_tampered_trace_is_reported_at_its_line(tmp_path, capsys):
    _, text = traced_run()
    lines = text.splitlines()
    # the second admission's block changed to the first one's, which a lane still holds
    admits = [i for i, ln in enumerate(lines)
              if json.loads(ln).get("action") in ("admit_miss", "admit_hit")]
    first, second = (json.loads(lines[i]) for i in admits[:2])
    assert first["args"]["dst"] != second["args"]["dst"]
    second["args"]["dst"] = first["args"]["dst"]
    bad = list(lines)
    bad[admits[1]] = json.dumps(second)
    v = replay(bad)
    assert not v.ok and v.line == admits[1] + 1
    assert "dst_reusable" in v.error
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(bad) + "\n")
    assert cli.main(["check-trace", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"line {admits[1] + 1}: ") and "dst_reusable" in out
    # a recorded effect that differs from the spec's (a decode row aimed elsewhere)
    dec = next(i for i, ln in enumerate(lines) if json.loads(ln).get("action") == "decode")
    rec = json.loads(lines[dec])
    rec["effects"][0][1][0][0] = (rec["effects"][0][1][0][0] + 1) % 3
    bad = list(lines)
    bad[dec] = json.dumps(rec)
    v = replay(bad)
    assert not v.ok and v.line == dec + 1 and "differ" in v.error
