"""Fault injection: a runtime that raises in prefill, decode or copy_kv_cache at chosen calls.

A failing call first scribbles garbage over every block it would have written (the worst a
half-finished device call can do), then raises. The requests the call served end with an
`error` event and `Result.error`; every other request finishes token-exact; invariants hold
after every step; at the end every block is free or cached; and the batcher keeps serving.
"""

from __future__ import annotations

import io
import random

import pytest
import torch

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.replay import replay
from atom_core.runtime import TorchReferenceRuntime

S, C, V = 256, 64, 128
_rng = random.Random(4242)
SYSTEM = [_rng.randrange(V) for _ in range(140)]


def _toks(n: int) -> list[int]:
    return [_rng.randrange(V) for _ in range(n)]


SHARED = [SYSTEM + _toks(n) for n in (4, 25, 50)]
OTHER = [_toks(n) for n in (10, 66, 150)]
POOL = SHARED + OTHER


class InjectedFault(RuntimeError):
    pass


class FaultyRuntime:
    """Delegates to `inner`; the calls of each kind whose index (from 0) is in `fail[kind]`
    scribble over their target blocks and raise `InjectedFault` instead of running."""

    KINDS = ("prefill", "decode", "copy")

    def __init__(self, inner: TorchReferenceRuntime, *, prefill=(), decode=(), copy=(),
                 scribble: bool = True) -> None:
        self.inner = inner
        self.fail = {"prefill": set(prefill), "decode": set(decode), "copy": set(copy)}
        self.count = dict.fromkeys(self.KINDS, 0)
        self.raised: list[tuple[str, int]] = []
        self.scribble = scribble
        self._gen = torch.Generator().manual_seed(0)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def arm(self, kind: str) -> None:
        """Fail the next call of `kind`."""
        self.fail[kind].add(self.count[kind])

    def _maybe_fail(self, kind: str, blocks: list[int]) -> None:
        i = self.count[kind]
        self.count[kind] += 1
        if i not in self.fail[kind]:
            return
        if self.scribble:
            for b in sorted(set(blocks)):
                junk = torch.randn(self.inner.new_host_buffer().shape, generator=self._gen) * 50
                self.inner.update_kv_cache(junk.to(self.inner.dtype), b)
        self.raised.append((kind, i))
        raise InjectedFault(f"injected {kind} fault at call {i}")

    def prefill(self, input_ids, cache_position, block_tables, local_block_tables,
                query_position):
        self._maybe_fail("prefill", [int(block_tables[0])])
        return self.inner.prefill(input_ids, cache_position, block_tables, local_block_tables,
                                  query_position)

    def decode(self, input_ids, cache_position, block_tables, local_block_tables):
        self._maybe_fail("decode", [int(x) for x in block_tables[:, 0]])
        return self.inner.decode(input_ids, cache_position, block_tables, local_block_tables)

    def copy_kv_cache(self, src, dst, num_tokens):
        self._maybe_fail("copy", [int(dst)])
        return self.inner.copy_kv_cache(src, dst, num_tokens)


def make(lanes: int, scratch: str, extra: int = 1, trace=None, **faults):
    """A batcher over a runtime failing the given calls; one block over the minimum by default,
    so that hits copy (at the minimum a hit whose entry is the last reusable block takes it
    over: nothing is copied)."""
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, scratch) + extra,
                 max_seq_len=S, prefill_chunk=C, prefix_cache=True, scratch=scratch)
    rt = FaultyRuntime(TorchReferenceRuntime.tiny(cfg), **faults)
    return AtomBatcher(cfg, rt, ghost=True, trace=trace), rt


def expected(b: AtomBatcher, rid: int) -> list[int]:
    r = b.requests[rid]
    return oracle_for(b.runtime.inner).generate(r.prompt, r.max_new_tokens)


def run_checked(b: AtomBatcher, rt: FaultyRuntime, log: list[Event]) -> dict[int, str]:
    """Step until idle; after each step check invariants and that a step whose runtime call
    failed errored exactly the requests that call served. Returns {request: failed kind}."""
    failed: dict[int, str] = {}
    for _ in range(2000):
        if not b.busy():
            return failed
        s = b.state
        decoding = {s.lane_req[ln] for ln in range(s.consts.B)
                    if s.busy[ln] and s.phase.get(s.lane_req[ln]) == core.PHASE_DECODE}
        n_raised = len(rt.raised)
        events = b.step()
        b.check_invariants()
        log.extend(events)
        errs = {e.request_id: e.error for e in events if e.kind == "error"}
        new = rt.raised[n_raised:]
        if not new:
            assert not errs, errs
            continue
        kinds = [k for k, _ in new]
        dec = {rid for rid, m in errs.items() if m.startswith("decode failed: InjectedFault")}
        if "decode" in kinds:
            assert kinds.count("decode") == 1
            assert dec == decoding and decoding  # every request of that call, and no other
        else:
            assert not dec
        # one request per failed prefill or copy (several copies may fail in one step)
        rest = {rid: m for rid, m in errs.items() if rid not in dec}
        assert len(rest) == len(kinds) - kinds.count("decode")
        for rid, m in rest.items():
            assert m.startswith(("prefill failed: InjectedFault",
                                 "copy_kv_cache failed: InjectedFault")), m
            assert b.requests[rid].tokens == []  # it never got its first token
        for rid, m in errs.items():
            failed[rid] = m.split()[0]
    raise AssertionError("not idle after 2000 steps")


def check_outcome(b: AtomBatcher, log: list[Event], failed: dict[int, str]) -> None:
    for rid, r in b.requests.items():
        assert r.ended
        ends = [e for e in log if e.request_id == rid and e.kind != "token"]
        assert len(ends) == 1, (rid, ends)
        if rid in failed:
            assert ends[0].kind == "error" and r.error == ends[0].error
            want = expected(b, rid)
            assert r.tokens == want[:len(r.tokens)]  # what it emitted before the fault was right
        else:
            assert ends[0].kind == "finished" and r.error is None
            assert r.tokens == expected(b, rid), rid
    assert b.stats.runtime_errors == len(failed)
    d = b.describe()
    for blk, own in enumerate(d["blocks"]):
        want = {"scratch"} if (b.config.scratch == "reserved"
                               and blk == b.config.scratch_id) else {"free", "cache"}
        assert own in want, (blk, own)


def keeps_serving(b: AtomBatcher, rt: FaultyRuntime) -> None:
    """New submissions after the faults, half of them prefix hits on what is cached: exact."""
    log: list[Event] = []
    first = len(b.requests)
    for p in (SHARED[0], OTHER[1], SHARED[2] + [3], OTHER[2][:100]):
        b.submit(p, 5)
    failed = run_checked(b, rt, log)
    assert not failed
    for rid in range(first, len(b.requests)):
        assert b.requests[rid].tokens == expected(b, rid)


# --------------------------------------------------------------------------- scenarios
SCENARIOS = {
    "prefill": {"prefill": (0, 3, 7)},
    "decode": {"decode": (1, 6)},
    "copy": {"copy": (0, 2)},
    "mixed": {"prefill": (1, 9), "decode": (4,), "copy": (0,)},
}


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("kind", list(SCENARIOS))
def test_faults_fail_only_the_requests_they_touch(kind, scratch):
    buf = io.StringIO()
    lanes = 3 if kind == "mixed" else 2
    b, rt = make(lanes, scratch, trace=buf, **SCENARIOS[kind])
    rng = random.Random(len(kind) + (scratch == "dynamic"))
    prompts = POOL * 2
    rng.shuffle(prompts)
    for p in prompts:
        b.submit(p, rng.randint(2, 6))
    log: list[Event] = []
    failed = run_checked(b, rt, log)
    assert len(rt.raised) == sum(len(v) for v in SCENARIOS[kind].values())
    assert failed and set(failed.values()) >= ({"prefill", "copy_kv_cache", "decode"}
                                               if kind == "mixed" else set())
    check_outcome(b, log, failed)
    keeps_serving(b, rt)
    # the trace, faults included (`fail`, `discard`), replays through the spec
    v = replay(buf.getvalue().splitlines())
    assert v.ok, (v.line, v.error)
    assert v.counts["fail"] == len(failed)


def test_every_call_failing_once_in_turn_never_poisons_the_batcher():
    """Fail each runtime call of a whole run in turn (the i-th call of any kind, one per run):
    always invariants, exactness of the others, blocks at rest, and further service."""
    cfg_runs = 0
    for i in range(0, 18, 3):
        for kind in ("prefill", "decode", "copy"):
            b, rt = make(2, "dynamic" if i % 2 else "reserved", extra=i % 2,
                         **{kind: (i // 3,)})
            for p in (SHARED[0], OTHER[0], SHARED[1], SHARED[2], OTHER[1]):
                b.submit(p, 3)
            log: list[Event] = []
            failed = run_checked(b, rt, log)
            check_outcome(b, log, failed)
            assert len(failed) >= len(rt.raised)
            cfg_runs += bool(rt.raised)
    assert cfg_runs >= 8


def test_decode_failure_drops_the_cache_entry_used_as_padding_target():
    """Dynamic scratch, no free block: the idle row of a decode writes into the least recently
    used cache entry. That decode fails after scribbling over its targets: the spec's `discard`
    drops the entry, so a later request with the same prefix misses it (recomputes) and is
    token-exact, while the other entry still serves hits."""
    b, rt = make(2, "dynamic")  # K = 3
    a, c = SHARED[0], OTHER[2]  # two long prompts with different first chunks
    b.submit(a, 2)
    b.submit(c, 2)
    log: list[Event] = []
    assert not run_checked(b, rt, log)
    s = b.state
    keys = {blk: list(s.key[blk]) for blk in range(3) if s.owner[blk] == core.OWNER_CACHE}
    assert len(keys) == 2
    victim = b.submit(OTHER[0], 5)  # a miss into the free block; lane 1 idle, nothing free
    while b.state.phase.get(victim) != core.PHASE_DECODE:
        log.extend(b.step())
        b.check_invariants()
    pad = b.policy.pad(b.state)
    assert b.state.owner[pad] == core.OWNER_CACHE
    survivor = next(blk for blk in keys if blk != pad)
    before = rt.inner.read_block(pad)
    rt.arm("decode")
    events = b.step()
    b.check_invariants()
    log.extend(events)
    assert [e.kind for e in events] == ["error"] and events[0].request_id == victim
    assert b.requests[victim].error.startswith("decode failed")
    assert not torch.equal(rt.inner.read_block(pad), before)  # the entry's KV is garbage now
    d = b.describe()
    assert d["blocks"][pad] == "free" and d["blocks"][survivor] == "cache"
    # later requests sharing each entry's first chunks: one misses, one hits; both exact
    hits = b.stats.prefix_hit_tokens
    ids = [b.submit(key[:130] + [7, 7, 7], 6) for key in keys.values()]
    assert not run_checked(b, rt, log)
    for rid in ids:
        assert b.requests[rid].tokens == expected(b, rid), rid
    assert b.stats.prefix_hit_tokens - hits == 128  # only the survivor was hit
    check_outcome(b, log, {victim: "decode"})
