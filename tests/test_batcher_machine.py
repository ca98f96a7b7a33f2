"""A hypothesis state machine over AtomBatcher and the tiny torch reference runtime.

Rules submit (from a small prompt pool with shared prefixes, random max_new_tokens and EOS),
step, drain (step until idle) and abort (waiting, running, ended and unknown ids); the core's
invariants (ghost ones included) are checked after every rule. At teardown the batcher runs to
completion: every completed request equals the oracle, every aborted one emitted a prefix of
it, and every request ended exactly once (one terminal event, or one successful abort).

Configurations: 1..3 lanes, prefix cache on or off, both scratch disciplines, at the minimum
legal K or one block more. Examples come from the loaded hypothesis profile.
"""

from __future__ import annotations

import json
import random

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime

S, C, V = 128, 64, 128
_rng = random.Random(77)
SYSTEM = [_rng.randrange(V) for _ in range(64)]


def _toks(n: int) -> list[int]:
    return [_rng.randrange(V) for _ in range(n)]


POOL: list[list[int]] = [
    SYSTEM + _toks(3),        # shared first chunk: hits of 64
    SYSTEM + _toks(40),
    SYSTEM + _toks(63),       # 127 tokens: the longest that fits; the block fills at once
    SYSTEM,                   # exactly the first chunk (never a hit itself)
    SYSTEM[:30] + _toks(50),  # shares less than a chunk
    _toks(5),
    _toks(90),
]
POOL.append(list(POOL[1]))    # the same prompt twice
MAX_NEW = 4


class BatcherMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.b: AtomBatcher | None = None
        self.events: dict[int, list[Event]] = {}
        self.aborted: set[int] = set()

    @initialize(lanes=st.integers(1, 3), prefix=st.booleans(),
                scratch=st.sampled_from(["reserved", "dynamic"]), extra=st.integers(0, 1))
    def setup(self, lanes, prefix, scratch, extra):
        cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch) + extra,
                     max_seq_len=S, prefill_chunk=C, prefix_cache=prefix, scratch=scratch)
        self.b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
        self.oracle = oracle_for(self.b.runtime)

    @rule(i=st.integers(0, len(POOL) - 1), n=st.integers(1, MAX_NEW),
          eos=st.one_of(st.none(), st.integers(0, MAX_NEW - 1)))
    def submit(self, i, n, eos):
        p = POOL[i]
        eos_id = None if eos is None else self.oracle.generate(p, MAX_NEW)[
            min(eos, len(self.oracle.generate(p, MAX_NEW)) - 1)]
        rid = self.b.submit(p, n, eos_id)
        assert rid not in self.events
        self.events[rid] = []

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            for e in self.b.step():
                self.events[e.request_id].append(e)
            self.b.check_invariants()

    @rule()
    def drain(self):
        """Serve everything submitted so far (later submits can then hit its cache entries)."""
        for _ in range(500):
            if not self.b.busy():
                return
            self.step(1)
        raise AssertionError("not idle after 500 steps")

    @precondition(lambda self: self.events)
    @rule(data=st.data())
    def abort_known(self, data):
        rid = data.draw(st.sampled_from(sorted(self.events)), label="request")
        live = not self.b.requests[rid].ended
        assert self.b.abort(rid) is live
        if live:
            assert rid not in self.aborted
            self.aborted.add(rid)
            assert self.b.requests[rid].error == "aborted"

    @rule(rid=st.integers(-2, 50))
    def abort_unknown(self, rid):
        if rid in self.events:
            return
        before = self.b.describe()
        assert self.b.abort(rid) is False
        assert self.b.describe() == before

    @invariant()
    def invariants_hold(self):
        if self.b is not None:
            self.b.check_invariants()
            json.dumps(self.b.describe())

    def teardown(self):
        b = self.b
        if b is None:
            return
        for _ in range(2000):
            if not b.busy():
                break
            for e in b.step():
                self.events[e.request_id].append(e)
            b.check_invariants()
        assert not b.busy(), "not idle after 2000 steps"
        d = b.describe()
        for blk, own in enumerate(d["blocks"]):
            assert own in ("free", "cache", "scratch"), (blk, own)
        for rid, r in b.requests.items():
            assert r.ended
            evs = self.events[rid]
            ends = [e for e in evs if e.kind != "token"]
            assert [e.token for e in evs if e.kind == "token"] == r.tokens
            want = self.oracle.generate(r.prompt, r.max_new_tokens, r.eos_token_id)
            if rid in self.aborted:  # ended exactly once: by the abort
                assert ends == [] and r.error == "aborted"
                assert r.tokens == want[:len(r.tokens)]
            else:  # ended exactly once: by its terminal event, the last one
                assert len(ends) == 1 and evs[-1] is ends[0] and ends[0].kind == "finished"
                assert r.error is None and r.tokens == want, (rid, r.tokens, want)
        assert b.stats.runtime_errors == 0


TestBatcherMachine = BatcherMachine.TestCase
