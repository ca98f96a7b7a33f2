"""PD (prefill/decode disaggregation) in AtomBatcher: a prefill batcher exports, a decode batcher
imports, by direct calls (no transport).

- Round trips are token-exact against the oracle (`runtime.generate`, memoised) for every decode
  side configuration at its minimum kv_blocks, with prompts of one token up to a full block,
  and with max_new_tokens=1 (the imported first token is the whole output).
- While an import is held back the other lanes keep decoding, given a block for the importing
  lane's padding row.
- Transfer semantics: partial or mismatched KV fails only its request; late, duplicate and
  unknown transfer events change nothing but `stale_events`; an abort during a transfer leaves
  the block draining until the transfer's end is reported; runtime faults in update/fetch fail
  only their request.
- A hypothesis state machine mixes all of the above with runtime faults; the core's invariants
  (ghost ones included), block accounting and exactly-once request endings are checked after
  every rule, and every finished request is token-exact at teardown.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterable
from typing import Any

import attrs
import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.pd import payload as pd
from atom_core.replay import replay
from atom_core.runtime import TorchReferenceRuntime

S, C, V = 256, 64, 128
_rng = random.Random(2024)
SYSTEM = [_rng.randrange(V) for _ in range(140)]  # two whole chunks + 12


def _toks(n: int) -> list[int]:
    return [_rng.randrange(V) for _ in range(n)]


# (prompt, max_new_tokens): one token, less than a chunk, exactly one chunk, one past it, three
# chunks, a prompt that fills the block (255 tokens: the import leaves one position, so the
# oracle gives 2 tokens), shared prefixes and a duplicate prompt; three of them have
# max_new_tokens=1.
ROUND_TRIP: list[tuple[list[int], int]] = [
    (_toks(1), 5),
    (SYSTEM + _toks(10), 6),
    (_toks(64), 1),
    (_toks(65), 4),
    (SYSTEM + _toks(30), 1),
    (_toks(150), 5),
    (SYSTEM[:128] + _toks(127), 6),  # 255 tokens
    (_toks(20), 1),
]
ROUND_TRIP.append((list(ROUND_TRIP[1][0]), 3))  # the same prompt again
LOCAL_AFTER = SYSTEM + _toks(7)  # shares SYSTEM's two whole chunks with imported prompts

LOST = "prefill worker lost"


def config(lanes: int, prefix: bool = False, scratch: str = "dynamic", extra: int = 0,
           seq_len: int = S) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch) + extra,
                  max_seq_len=seq_len, prefill_chunk=C, prefix_cache=prefix, scratch=scratch)


def batcher(cfg: Config, runtime: Any = None, trace: io.StringIO | None = None) -> AtomBatcher:
    rt = runtime if runtime is not None else TorchReferenceRuntime.tiny(cfg)
    return AtomBatcher(cfg, rt, ghost=True, trace=trace)


def inner(rt: Any) -> TorchReferenceRuntime:
    return rt.inner if isinstance(rt, FaultyPDRuntime) else rt


def expected(b: AtomBatcher, rid: int) -> list[int]:
    r = b.requests[rid]
    return oracle_for(inner(b.runtime)).generate(r.prompt, r.max_new_tokens, r.eos_token_id)


def owners(b: AtomBatcher) -> list[str]:
    return core.describe_state(b.state)["owner"]


def checked_step(b: AtomBatcher) -> list[Event]:
    events = b.step()
    b.check_invariants()
    assert_no_block_leaked(b)
    return events


def assert_no_block_leaked(b: AtomBatcher) -> None:
    """Every block is free, cached or scratch, or owned by the busy lane whose table names it, or
    draining for an ended request with an unfinished transfer in `transfers()`; and every
    transfer's recorded block is its importing/exporting lane's first one, or draining."""
    d = core.describe_state(b.state)
    xfers = b.transfers()
    tables = {row["lane"]: row["blocks"] for row in b.describe()["lanes"]}
    for blk, own in enumerate(d["owner"]):
        if own == "LANE":
            ln = d["owner_lane"][blk]
            assert d["busy"][ln] and blk in tables[ln], (blk, d)
        elif own == "DRAINING":
            rid = d["transfer_req"][blk]
            assert rid in xfers and b.requests[rid].ended, (blk, rid, xfers)
        else:
            assert own in ("FREE", "CACHE", "SCRATCH"), (blk, own)
    for rid, blk in xfers.items():
        phase = d["phase"][rid]
        if phase in ("IMPORTING", "EXPORTING"):
            ln = d["req_lane"][rid]
            assert d["owner"][blk] == "LANE" and blk in tables[ln], (rid, blk, d)
        else:
            assert phase in ("ABORTED", "FAILED") and d["owner"][blk] == "DRAINING", (rid, d)
            assert d["transfer_req"][blk] == rid, (rid, blk, d)


def release_count(trace: io.StringIO, block: int) -> int:
    """How many applied transitions gave `block` back (a release effect, or a drain's end)."""
    n = 0
    for line in trace.getvalue().splitlines()[1:]:
        rec = json.loads(line)
        if rec["action"] == "transfer_end" and rec["args"]["b"] == block:
            n += 1
        n += sum(1 for name, vals in rec["effects"] if name == "Release" and vals[1] == block)
    return n


def snapshot(b: AtomBatcher) -> tuple[Any, ...]:
    """Everything a transfer event may change: core state, requests, transfers, waiting."""
    return (b.state, [attrs.asdict(r) for r in b.requests.values()], b.transfers(),
            list(b.waiting), attrs.evolve(b.stats, stale_events=0))


# --------------------------------------------------------------------------- fault injection
class InjectedFault(RuntimeError):
    pass


class FaultyPDRuntime:
    """Delegates to `inner`; the calls of each kind whose index (from 0) is in `fail[kind]`
    raise `InjectedFault`. A failing write (update, prefill, decode, copy) first scribbles
    garbage over the block(s) it targets, the worst a half-finished device call can do."""

    KINDS = ("prefill", "decode", "copy", "update", "fetch")

    def __init__(self, inner: TorchReferenceRuntime, **fail: Iterable[int]) -> None:
        self.inner = inner
        self.fail = {k: set(fail.get(k, ())) for k in self.KINDS}
        self.count = dict.fromkeys(self.KINDS, 0)
        self.raised: list[tuple[str, int]] = []
        self._gen = torch.Generator().manual_seed(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, kind: str) -> None:
        """Fail the next call of `kind`."""
        self.fail[kind].add(self.count[kind])

    def armed(self, kind: str) -> bool:
        return any(i >= self.count[kind] for i in self.fail[kind])

    def _maybe_fail(self, kind: str, blocks: list[int]) -> None:
        i = self.count[kind]
        self.count[kind] += 1
        if i not in self.fail[kind]:
            return
        for b in sorted(set(blocks)):
            junk = torch.randn(self.inner.new_host_buffer().shape, generator=self._gen) * 50
            self.inner.update_kv_cache(junk.to(self.inner.dtype), b)
        self.raised.append((kind, i))
        raise InjectedFault(f"injected {kind} fault at call {i}")

    def prefill(self, ids: Any, pos: Any, tables: Any, local: Any, qpos: Any) -> Any:
        self._maybe_fail("prefill", [int(tables[0])])
        return self.inner.prefill(ids, pos, tables, local, qpos)

    def decode(self, ids: Any, pos: Any, tables: Any, local: Any) -> Any:
        self._maybe_fail("decode", [int(x) for x in tables[:, 0]])
        return self.inner.decode(ids, pos, tables, local)

    def copy_kv_cache(self, src: int, dst: int, n: int) -> None:
        self._maybe_fail("copy", [int(dst)])
        self.inner.copy_kv_cache(src, dst, n)

    def update_kv_cache(self, host: Any, block: int) -> None:
        self._maybe_fail("update", [int(block)])
        self.inner.update_kv_cache(host, block)

    def fetch_kv_cache(self, host: Any, block: int) -> None:
        self._maybe_fail("fetch", [])
        self.inner.fetch_kv_cache(host, block)


# --------------------------------------------------------------------------- the link
@attrs.define
class Ready:
    prompt: list[int]
    first_token: int
    host: torch.Tensor


class Link:
    """A prefill batcher P feeding a decode batcher D by direct calls: what the PD workers do
    over a transport, minus the transport. Each "import" event of D becomes an export request
    on P; each "export" event of P is taken, packed with `pd.make_payload`, checked with
    `pd.validate`, written with `pd.write_into` and imported into D, unless D's request is in
    `hold` (then it waits in `ready` until `deliver`). A failed export ends D's transfer."""

    def __init__(self, p: AtomBatcher, d: AtomBatcher, hold: Iterable[int] = ()) -> None:
        self.p, self.d = p, d
        self.hold = set(hold)
        self.wire: dict[int, int] = {}  # P request -> D request
        self.ready: dict[int, Ready] = {}  # D request -> its KV, held back
        self.events: dict[int, list[tuple[str, Event]]] = {}  # D request -> (source, event)
        self.imports: list[int] = []  # D requests, in the order of their import events
        self.p_errors: dict[int, str] = {}  # P request -> export error

    def _log(self, source: str, events: list[Event]) -> None:
        for e in events:
            self.events.setdefault(e.request_id, []).append((source, e))

    def step(self) -> None:
        events = checked_step(self.d)
        self._log("step", events)
        for e in events:
            if e.kind == "import":
                self.imports.append(e.request_id)
                pid = self.p.submit(self.d.requests[e.request_id].prompt, 1, export=True)
                self.wire[pid] = e.request_id
        for e in checked_step(self.p):
            if e.kind == "export":
                self._export(e.request_id)
            elif e.kind == "error":  # a prefill-side runtime fault: that transfer failed
                self._end_failed(e.request_id, e.error or "")

    def _export(self, pid: int) -> None:
        did = self.wire[pid]
        try:
            exp = self.p.take_export(pid)
            payload = pd.make_payload(str(did), exp.prompt, exp.first_token, exp.host,
                                      pd.model_fingerprint(self.p.runtime))
        except Exception as exc:  # noqa: BLE001 - the export of this request failed
            self.p_errors[pid] = repr(exc)
            assert self.p.export_done(pid, error=repr(exc)) == [
                Event("error", pid, error=repr(exc))]
            self.p.check_invariants()
            self._log("transfer_ended", self.d.transfer_ended(did, f"export failed: {exc!r}"))
            return
        assert self.p.export_done(pid) == [Event("finished", pid)]
        self.p.check_invariants()
        drt = self.d.runtime
        pd.validate(payload, request_id=str(did), prompt=self.d.requests[did].prompt,
                    fingerprint=pd.model_fingerprint(drt), layout=pd.layout_of(
                        drt.new_host_buffer()), dtype=pd.dtype_name(inner(drt).dtype),
                    vocab_size=drt.vocab_size)
        ready = Ready(list(payload.prompt), payload.first_token,
                      pd.write_into(payload, self.d.new_import_buffer()))
        if did in self.hold:
            self.ready[did] = ready
        else:
            self._import(did, ready)

    def _end_failed(self, pid: int, error: str) -> None:
        self.p_errors[pid] = error
        self._log("transfer_ended", self.d.transfer_ended(self.wire[pid], error))

    def _import(self, did: int, r: Ready) -> None:
        self._log("import_kv", self.d.import_kv(did, r.prompt, r.first_token, r.host))
        self.d.check_invariants()
        assert_no_block_leaked(self.d)

    def deliver(self, did: int) -> None:
        self.hold.discard(did)
        self._import(did, self.ready.pop(did))

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not (self.d.busy() or self.p.busy()):
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def step_until(self, cond: Any, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if cond():
                return
            self.step()
        raise AssertionError("condition not reached")


def prefill_side(prefix: bool = True, seq_len: int = S, runtime: Any = None) -> AtomBatcher:
    """Two lanes, with the prefix cache on by default: later exports of a shared prompt start
    from a cache hit on the prefill side too."""
    return batcher(config(2, prefix, "dynamic", seq_len=seq_len), runtime)


def assert_exact(link: Link, rids: Iterable[int]) -> None:
    d = link.d
    for rid in rids:
        r = d.requests[rid]
        assert r.ended and r.error is None, (rid, r.error)
        assert r.tokens == expected(d, rid), rid
        toks = [e.token for _, e in link.events[rid] if e.kind == "token"]
        assert toks == r.tokens
        ends = [e for _, e in link.events[rid] if e.kind in ("finished", "error")]
        assert [e.kind for e in ends] == ["finished"]


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("prefix", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_round_trip_token_exact(lanes: int, prefix: bool, scratch: str) -> None:
    p = prefill_side(prefix)
    trace = io.StringIO()
    d = batcher(config(lanes, prefix, scratch), trace=trace)
    assert d.config.kv_blocks == min_kv_blocks(lanes, prefix, scratch)
    link = Link(p, d)
    rids = [d.submit(prompt, n, remote=True) for prompt, n in ROUND_TRIP]
    link.run()
    assert_exact(link, rids)
    assert sorted(link.imports) == rids  # every remote request was imported, none prefilled
    assert d.stats.prefill_tokens == 0
    assert d.stats.imported_tokens == sum(len(prompt) for prompt, _ in ROUND_TRIP)
    assert p.stats.exports == len(ROUND_TRIP) and d.stats.transfer_failures == 0
    assert d.stats.stale_events == p.stats.stale_events == 0
    assert d.transfers() == {} and p.transfers() == {}
    # max_new_tokens=1: the imported first token is the whole output, ended by import_kv
    for rid, (_, n) in zip(rids, ROUND_TRIP, strict=True):
        if n == 1:
            assert [(src, e.kind) for src, e in link.events[rid]] == [
                ("step", "import"), ("import_kv", "token"), ("import_kv", "finished")]
    assert all(own in ("FREE", "CACHE", "SCRATCH") for own in owners(d))
    if prefix:  # a finished import is cached: a local prompt sharing two chunks hits it
        seed = d.submit(SYSTEM + _toks(2), 2, remote=True)
        link.run()
        local = d.submit(LOCAL_AFTER, 4)
        link.run()
        assert_exact(link, [seed, local])
        assert d.stats.prefix_hit_tokens == 2 * C
        assert p.stats.prefix_hit_tokens > 0  # exports of shared prompts hit on P too
    assert replay(io.StringIO(trace.getvalue())).ok


# --------------------------------------------------------------------------- overlap
def _overlap(kv_extra: int) -> tuple[Link, int, int, int]:
    """D has 2 lanes and dynamic scratch: a local request decodes in lane 0 while remote R's
    import into lane 1 is held back. Returns (link, local, remote, decode_steps at hold)."""
    d = batcher(config(2, extra=kv_extra))
    link = Link(prefill_side(), d)
    local = d.submit(_toks(20), 12)
    remote = d.submit(SYSTEM + _toks(10), 5, remote=True)
    link.hold.add(remote)
    link.step_until(lambda: remote in link.ready and len(d.requests[local].tokens) >= 1)
    assert d.state.phase.get(remote) == core.PHASE_IMPORTING
    return link, local, remote, d.stats.decode_steps


def test_other_lanes_decode_while_an_import_is_held_back() -> None:
    """kv_blocks = lanes + 1 with dynamic scratch. A decode call computes every row; the
    importing lane's row is padding, and padding must land in a block nobody's KV lives in. The
    importing lane's own block is out (the transfer writes it, and the core forbids any other
    write there: `import_target_untouched`), and the decoding lane's block is out, so a third
    block is needed for the decode to run while the import is pending."""
    link, local, remote, steps0 = _overlap(kv_extra=1)
    d = link.d
    toks0, pad0 = len(d.requests[local].tokens), d.stats.decode_rows_padding
    for _ in range(5):
        link.step()
    assert d.stats.decode_steps == steps0 + 5
    assert len(d.requests[local].tokens) == toks0 + 5
    assert d.stats.decode_rows_padding == pad0 + 5  # the importing lane's row
    assert d.state.phase.get(remote) == core.PHASE_IMPORTING and d.requests[remote].tokens == []
    assert remote in link.ready
    link.deliver(remote)
    link.run()
    assert_exact(link, [local, remote])


def test_at_kv_blocks_equal_lanes_decode_waits_for_the_import() -> None:
    """The contrast: kv_blocks = lanes (the dynamic-scratch minimum, safe: nothing gets stuck)
    leaves no block for the importing lane's padding row, so decoding pauses until the import
    lands; then everything completes exactly."""
    link, local, remote, steps0 = _overlap(kv_extra=0)
    d = link.d
    toks0 = len(d.requests[local].tokens)
    for _ in range(5):
        link.step()
    assert d.stats.decode_steps == steps0
    assert len(d.requests[local].tokens) == toks0
    assert d.busy() and d.state.phase.get(remote) == core.PHASE_IMPORTING
    link.deliver(remote)
    link.step()
    assert d.stats.decode_steps == steps0 + 1
    link.run()
    assert_exact(link, [local, remote])


# --------------------------------------------------------------------------- semantics
def _held(lanes: int = 2, extra: int = 1, prefix: bool = False,
          prompts: tuple[int, ...] = (150, 70)) -> tuple[Link, list[int], io.StringIO]:
    """D with remote requests of the given prompt lengths, each import held until delivered."""
    trace = io.StringIO()
    d = batcher(config(lanes, prefix, extra=extra), trace=trace)
    link = Link(prefill_side(), d)
    rids = [d.submit(_toks(n), 5, remote=True) for n in prompts]
    link.hold.update(rids)
    link.step_until(lambda: all(r in link.ready for r in rids[:lanes]))
    return link, rids, trace


def _bad_prompt(kind: str, prompt: list[int]) -> list[int]:
    if kind == "partial":
        return prompt[:-1]
    if kind == "mismatched":
        bad = list(prompt)
        bad[10] = (bad[10] + 1) % V
        return bad
    return prompt + [prompt[0]]  # "longer"


@pytest.mark.parametrize("kind", ["partial", "mismatched", "longer"])
def test_bad_import_fails_only_its_request(kind: str) -> None:
    link, (bad, good), trace = _held()
    d = link.d
    block = d.transfers()[bad]
    updates = inner(d.runtime).calls["update"]
    r = link.ready.pop(bad)
    wrong = _bad_prompt(kind, r.prompt)
    events = d.import_kv(bad, wrong, r.first_token, r.host)
    d.check_invariants()
    assert_no_block_leaked(d)
    assert [e.kind for e in events] == ["error"] and events[0].request_id == bad
    err = events[0].error
    assert err == d.requests[bad].error
    assert "import rejected (covers_prompt)" in err and f"covers {len(wrong)} tokens" in err
    assert inner(d.runtime).calls["update"] == updates  # refused before anything was written
    assert d.requests[bad].ended and d.requests[bad].tokens == []
    assert owners(d)[block] == "FREE" and bad not in d.transfers()
    assert d.stats.transfer_failures == 1 and d.stats.imported_tokens == 0
    assert release_count(trace, block) == 1
    # the correct KV arriving afterwards is stale: nothing is imported, nothing freed again
    before = snapshot(d)
    assert d.import_kv(bad, r.prompt, r.first_token, r.host) == []
    assert snapshot(d) == before and d.stats.stale_events == 1
    assert release_count(trace, block) == 1
    link.hold.discard(bad)
    link.deliver(good)
    link.run()
    assert_exact(link, [good])
    assert d.requests[bad].tokens == [] and d.stats.transfer_failures == 1
    assert all(own == "FREE" for own in owners(d))


def test_stale_transfer_events_change_nothing() -> None:
    """Unknown ids, ended requests, duplicates, a request still waiting for a lane, a local
    request and export_done on the decode side: each counts as stale, and the core state (the
    same object), the requests, the transfers and the other stats are untouched."""
    link, (imp, fin), _ = _held(lanes=2, extra=1, prompts=(40, 90))
    d = link.d
    link.deliver(fin)
    link.step_until(lambda: d.requests[fin].ended)
    assert d.requests[fin].error is None
    waiting = d.submit(_toks(30), 4, remote=True)  # no step follows: both stay waiting
    local = d.submit(_toks(12), 3)
    assert d.state.phase.get(waiting) == core.PHASE_WAITING
    r_imp, host = link.ready[imp], link.ready[imp].host
    calls: list[tuple[str, Any]] = [
        ("import_kv unknown", lambda: d.import_kv(999, [1, 2], 3, host)),
        ("transfer_ended unknown", lambda: d.transfer_ended(999, "lost")),
        ("export_done unknown", lambda: d.export_done(999)),
        ("import_kv negative id", lambda: d.import_kv(-1, [1], 3, host)),
        ("import_kv finished", lambda: d.import_kv(
            fin, d.requests[fin].prompt, d.requests[fin].tokens[0], host)),
        ("transfer_ended finished", lambda: d.transfer_ended(fin, "late")),
        ("export_done finished", lambda: d.export_done(fin, error="late")),
        ("export_done importing", lambda: d.export_done(imp)),
        ("import_kv waiting", lambda: d.import_kv(waiting, d.requests[waiting].prompt, 1, host)),
        ("transfer_ended waiting", lambda: d.transfer_ended(waiting, "early")),
        ("transfer_ended local", lambda: d.transfer_ended(local, "not a transfer")),
    ]
    for n, (what, call) in enumerate(calls, start=1):
        before = snapshot(d)
        state = d.state
        assert call() == [], what
        assert d.state is state, what
        assert snapshot(d) == before, what
        assert d.stats.stale_events == n, what
        d.check_invariants()
    # a duplicate delivery after a successful import
    link.deliver(imp)
    assert d.requests[imp].tokens == [r_imp.first_token]
    before, n = snapshot(d), d.stats.stale_events
    assert d.import_kv(imp, r_imp.prompt, r_imp.first_token, r_imp.host) == []
    assert d.transfer_ended(imp, "late") == []
    assert snapshot(d) == before and d.stats.stale_events == n + 2
    assert d.stats.imported_tokens == len(r_imp.prompt) + len(d.requests[fin].prompt)
    link.hold.clear()
    link.run()
    assert_exact(link, [imp, fin, waiting, local])


@pytest.mark.parametrize("end", ["transfer_ended", "late_import_kv"])
def test_abort_during_import_drains_until_the_transfer_ends(end: str) -> None:
    link, (rid,), trace = _held(lanes=1, extra=1, prompts=(100,))
    d = link.d
    block = d.transfers()[rid]
    updates = inner(d.runtime).calls["update"]
    assert d.abort(rid) is True
    d.check_invariants()
    assert_no_block_leaked(d)
    assert owners(d)[block] == "DRAINING" and d.transfers() == {rid: block}
    assert d.busy() and d.requests[rid].error == "aborted"
    assert d.abort(rid) is False
    # the lane is free at once: a new request takes it, with another block, in the next step
    new = d.submit(_toks(30), 4)
    events = checked_step(d)
    lane = d.state.req_lane.get(new)
    assert lane == 0 and d.state.tail[lane] != block
    assert d.state.phase.get(new) == core.PHASE_DECODE  # admitted and prefilled in that step
    assert [e.kind for e in events] == ["token"]
    assert owners(d)[block] == "DRAINING"
    r = link.ready.pop(rid)
    if end == "transfer_ended":
        assert d.transfer_ended(rid, LOST) == []
    else:
        assert d.import_kv(rid, r.prompt, r.first_token, r.host) == []
    d.check_invariants()
    assert_no_block_leaked(d)
    assert owners(d)[block] == "FREE" and d.transfers() == {}
    assert release_count(trace, block) == 2  # the abort's release (to DRAINING), the drain's end
    # never imported
    assert inner(d.runtime).calls["update"] == updates
    assert d.stats.imported_tokens == 0 and d.requests[rid].tokens == []
    assert d.stats.stale_events == 0 and d.stats.transfer_failures == 0
    assert d.requests[rid].error == "aborted"  # the drain does not re-end the request
    # a second end of that transfer is stale
    before = snapshot(d)
    assert d.transfer_ended(rid, "again") == [] and d.stats.stale_events == 1
    assert snapshot(d) == before
    link._log("step", events)
    link.run()
    assert_exact(link, [new])
    assert [e for _, e in link.events.get(rid, []) if e.kind != "import"] == []


@pytest.mark.parametrize("taken", [False, True], ids=["before_take", "after_take"])
def test_abort_during_export_drains_until_export_done(taken: bool) -> None:
    p = prefill_side(prefix=True)
    x = p.submit(SYSTEM + _toks(3), 1, export=True)
    for _ in range(10):
        events = checked_step(p)
        if events:
            break
    assert [e.kind for e in events] == ["export"]
    block = p.transfers()[x]
    if taken:
        exp = p.take_export(x)
        assert exp.prompt == p.requests[x].prompt and exp.first_token == events[0].token
    assert p.abort(x) is True
    p.check_invariants()
    assert owners(p)[block] == "DRAINING" and p.transfers() == {x: block}
    with pytest.raises(KeyError):
        p.take_export(x)
    assert p.export_done(x) == []
    p.check_invariants()
    assert_no_block_leaked(p)
    assert owners(p)[block] == "FREE"  # aborted: drained, never cached
    assert p.transfers() == {} and not p.busy()
    assert p.stats.exports == 0 and p.stats.stale_events == 0
    before = snapshot(p)
    assert p.export_done(x) == [] and p.stats.stale_events == 1 and snapshot(p) == before
    # the prefill side keeps exporting
    d = batcher(config(1))
    link = Link(p, d)
    rid = d.submit(p.requests[x].prompt, 3, remote=True)
    link.run()
    assert_exact(link, [rid])


def test_update_kv_cache_fault_fails_only_that_import() -> None:
    """The update of the first import raises after scribbling over its block; that request
    fails, the other one and a later request reusing the scribbled block are exact."""
    cfg = config(2)  # kv_blocks = lanes: the failed block must come back for the third request
    rt = FaultyPDRuntime(TorchReferenceRuntime.tiny(cfg), update=[0])
    d = batcher(cfg, rt)
    link = Link(prefill_side(), d)
    a = d.submit(_toks(80), 5, remote=True)
    b = d.submit(_toks(30), 5, remote=True)
    link.run()
    assert rt.raised == [("update", 0)]
    first = link.imports[0]
    other = b if first == a else a
    assert "update_kv_cache failed" in (d.requests[first].error or "")
    assert "InjectedFault" in d.requests[first].error
    assert [e.kind for _, e in link.events[first]] == ["import", "error"]
    assert d.requests[first].tokens == [] and d.stats.transfer_failures == 1
    assert_exact(link, [other])
    assert all(own == "FREE" for own in owners(d)) and d.transfers() == {}
    c = d.submit(_toks(50), 5, remote=True)
    link.run()
    assert_exact(link, [c])
    assert d.stats.imported_tokens == len(d.requests[other].prompt) + len(d.requests[c].prompt)


def test_fetch_fault_in_take_export_fails_only_that_request() -> None:
    """take_export raises: the caller reports export_done(rid, error), which fails that export
    and frees its block; the decode side ends that transfer; the next request is exact."""
    cfg_p = config(2, True, extra=0)
    prt = FaultyPDRuntime(TorchReferenceRuntime.tiny(cfg_p), fetch=[0])
    p = batcher(cfg_p, prt)
    d = batcher(config(2))
    link = Link(p, d)
    a = d.submit(_toks(40), 4, remote=True)
    b = d.submit(_toks(100), 4, remote=True)
    link.run()
    assert prt.raised == [("fetch", 0)]
    (pid, err), = link.p_errors.items()
    failed = link.wire[pid]
    other = b if failed == a else a
    assert p.requests[pid].error == err and "InjectedFault" in err
    assert p.stats.transfer_failures == 1 and p.stats.exports == 1
    assert "InjectedFault" in (d.requests[failed].error or "")
    assert d.requests[failed].tokens == [] and d.stats.transfer_failures == 1
    assert_exact(link, [other])
    for x in (p, d):
        assert x.transfers() == {} and not x.busy()
        assert all(own in ("FREE", "CACHE") for own in owners(x))
    ps = core.describe_state(p.state)
    cached = [k for k, own in zip(ps["key"], ps["owner"], strict=True) if own == "CACHE"]
    assert d.requests[other].prompt in cached  # a sent export is kept, a failed one is not
    assert d.requests[failed].prompt not in cached


@pytest.mark.parametrize("first", [V + 5, -1, 2.0], ids=["too_big", "negative", "float"])
def test_import_with_a_first_token_outside_the_vocabulary_fails_only_that_request(
        first: Any) -> None:
    """A first token the model cannot embed (V + 5 would fail the next decode call for every
    lane; -1 would decode as token V - 1) or that is no integer fails that request alone, before
    anything is written."""
    d = batcher(config(2, extra=1))
    local = d.submit(_toks(10), 6)
    link = Link(prefill_side(), d)
    rid = d.submit(_toks(20), 6, remote=True)
    link.hold.add(rid)
    link.step_until(lambda: rid in link.ready)
    r = link.ready.pop(rid)
    link.hold.clear()
    events = d.import_kv(rid, r.prompt, first, r.host)
    link.run()
    assert d.requests[local].error is None and d.requests[local].tokens == expected(d, local)
    assert [e.kind for e in events] == ["error"] and d.requests[rid].error is not None


# --------------------------------------------------------------------------- state machine
MS = 128  # the machine's max_seq_len: smaller blocks, faster steps
_mrng = random.Random(99)
_MSYS = [_mrng.randrange(V) for _ in range(64)]
M_POOL: list[list[int]] = [
    _MSYS + [_mrng.randrange(V) for _ in range(5)],   # shared first chunk
    _MSYS + [_mrng.randrange(V) for _ in range(40)],
    _MSYS + [_mrng.randrange(V) for _ in range(63)],  # 127 tokens: the block fills at import
    list(_MSYS),                                      # exactly one chunk
    [_mrng.randrange(V) for _ in range(1)],
    [_mrng.randrange(V) for _ in range(30)],
]
M_MAX_NEW = 4
_M_READY: dict[tuple[int, ...], Ready] = {}
_M_PREFILL: list[AtomBatcher] = []


def machine_payload(prompt: list[int]) -> Ready:
    """KV and first token of `prompt` from a single-block prefill batcher (memoised: the
    prefill of a prompt is a function of the prompt)."""
    key = tuple(prompt)
    if key not in _M_READY:
        if not _M_PREFILL:
            cfg = Config(lanes=1, kv_blocks=1, max_seq_len=MS, prefill_chunk=C)
            _M_PREFILL.append(batcher(cfg))
        p = _M_PREFILL[0]
        pid = p.submit(prompt, 1, export=True)
        while pid not in p.transfers():
            checked_step(p)
        exp = p.take_export(pid)
        payload = pd.make_payload(str(pid), exp.prompt, exp.first_token, exp.host,
                                  pd.model_fingerprint(p.runtime))
        assert p.export_done(pid) == [Event("finished", pid)]
        buf = pd.write_into(payload, p.runtime.new_host_buffer())
        _M_READY[key] = Ready(list(payload.prompt), payload.first_token, buf)
    return _M_READY[key]


RUNTIME_FAILURES = ("prefill failed", "decode failed", "copy_kv_cache failed",
                    "update_kv_cache failed")


class PDDecodeMachine(RuleBasedStateMachine):
    """A decode batcher with remote and local requests; imports are delivered (or not) by the
    rules, in any order, correct or wrong. Tables of one or two blocks (T = 2: an import's
    table grows before its import event, and may wait for blocks that drain)."""

    def __init__(self) -> None:
        super().__init__()
        self.d: AtomBatcher | None = None
        self.rt: FaultyPDRuntime | None = None
        self.events: dict[int, list[Event]] = {}
        self.pending: set[int] = set()  # import event seen, transfer not ended, request live
        self.draining: set[int] = set()  # aborted while importing, transfer not ended yet
        self.aborted: set[int] = set()
        self.bad: dict[int, str] = {}  # requests failed by a bad delivery -> expected message

    @initialize(lanes=st.integers(1, 3), prefix=st.booleans(),
                scratch=st.sampled_from(["reserved", "dynamic"]), extra=st.integers(0, 1),
                tables=st.integers(1, 2),
                first=st.lists(st.integers(0, len(M_POOL) - 1), min_size=1, max_size=4))
    def setup(self, lanes: int, prefix: bool, scratch: str, extra: int, tables: int,
              first: list[int]) -> None:
        """The decode batcher, and remote requests admitted in one step: imports are pending
        from the start."""
        cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, tables) + extra,
                     max_seq_len=MS, block_size=MS // tables, prefill_chunk=C,
                     prefix_cache=prefix, scratch=scratch)
        self.rt = FaultyPDRuntime(TorchReferenceRuntime.tiny(cfg))
        self.d = batcher(cfg, self.rt)
        self.oracle = oracle_for(self.rt.inner)
        for i in first:
            self.submit(i, M_MAX_NEW, remote=True)
        self.step(1)
        assert self.pending

    # ------------------------------------------------------------ helpers
    def _take(self, events: list[Event]) -> None:
        for e in events:
            self.events[e.request_id].append(e)
            if e.kind == "import":
                assert e.request_id not in self.pending
                self.pending.add(e.request_id)
            elif e.kind in ("finished", "error"):
                self.pending.discard(e.request_id)

    def _growing(self) -> set[int]:
        """Imports admitted whose table still grows: no import event yet."""
        d = self.d
        return {r for r in self.events
                if d.state.phase.get(r) == core.PHASE_IMPORTING and not d.awaits_kv(r)}

    def _terminal(self, rid: int) -> int:
        return sum(1 for e in self.events[rid] if e.kind in ("finished", "error"))

    # ------------------------------------------------------------ rules
    @rule(i=st.integers(0, len(M_POOL) - 1), n=st.integers(1, M_MAX_NEW), remote=st.booleans())
    def submit(self, i: int, n: int, remote: bool) -> None:
        rid = self.d.submit(M_POOL[i], n, remote=remote)
        assert rid not in self.events
        self.events[rid] = []

    @rule(k=st.integers(1, 3))
    def step(self, k: int) -> None:
        for _ in range(k):
            self._take(self.d.step())

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), how=st.sampled_from(["ok", "ok", "partial", "wrong", "error"]))
    def deliver(self, data: st.DataObject, how: str) -> None:
        d = self.d
        rid = data.draw(st.sampled_from(sorted(self.pending)), label="request")
        r = machine_payload(d.requests[rid].prompt)
        fails_update = self.rt.armed("update")
        imported = d.stats.imported_tokens
        if how == "error":
            events = d.transfer_ended(rid, "transfer lost")
            want = "transfer lost"
        elif how == "ok":
            events = d.import_kv(rid, r.prompt, r.first_token, r.host)
            want = "update_kv_cache failed" if fails_update else None
        else:
            wrong = (r.prompt[:-1] if how == "partial"
                     else r.prompt[:-1] + [(r.prompt[-1] + 1) % V])
            events = d.import_kv(rid, wrong, r.first_token, r.host)
            want = "import rejected (covers_prompt)"
        self._take(events)
        self.pending.discard(rid)  # the transfer is over, whatever its outcome
        assert rid not in d.transfers()
        event(f"deliver {how}: {'imported' if want is None else 'failed'}")
        if want is None:
            assert events[0] == Event("token", rid, token=r.first_token)
            assert d.stats.imported_tokens == imported + len(r.prompt)
            assert d.requests[rid].tokens == [r.first_token]
        else:
            assert [e.kind for e in events] == ["error"] and want in events[0].error
            assert d.stats.imported_tokens == imported
            if how != "ok":
                self.bad[rid] = want

    @rule(data=st.data(), call=st.sampled_from(["import_kv", "transfer_ended", "export_done"]))
    def late_event(self, data: st.DataObject, call: str) -> None:
        """A transfer event for a request not importing (ended, waiting, local, unknown, or
        aborted with its transfer still draining)."""
        d = self.d
        known = [r for r in sorted(self.events)
                 if r not in self.pending and r not in self._growing()]
        rid = data.draw(st.sampled_from(known + [len(self.events) + 5]), label="request")
        prompt = d.requests[rid].prompt if rid in d.requests else [1, 2, 3]
        r = machine_payload(prompt)
        drained = rid in self.draining
        block = d.transfers().get(rid)
        stale, before = d.stats.stale_events, snapshot(d)
        if call == "import_kv":
            events = d.import_kv(rid, r.prompt, r.first_token, r.host)
        elif call == "transfer_ended":
            events = d.transfer_ended(rid, "late")
        else:
            events = d.export_done(rid)
        assert events == []
        event(f"late {call}: {'drained' if drained else 'stale'}")
        if drained:
            self.draining.discard(rid)
            assert block is not None and owners(d)[block] == "FREE"
            assert rid not in d.transfers() and d.stats.stale_events == stale
        else:
            assert d.stats.stale_events == stale + 1 and snapshot(d) == before

    @precondition(lambda self: self.events)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        d = self.d
        rid = data.draw(st.sampled_from(sorted(self.events)), label="request")
        live = not d.requests[rid].ended
        importing = rid in self.pending
        growing = rid in self._growing()
        assert d.abort(rid) is live
        if growing:  # nobody was asked for its KV: no end will be reported, none is waited for
            event("abort while the import table grows")
            assert rid not in d.transfers()
        if live:
            self.aborted.add(rid)
            assert d.requests[rid].error == "aborted"
        if importing:
            event("abort while importing")
            self.pending.discard(rid)
            self.draining.add(rid)
            assert owners(d)[d.transfers()[rid]] == "DRAINING"

    @rule(kind=st.sampled_from(["prefill", "decode", "update", "copy"]))
    def inject_fault(self, kind: str) -> None:
        self.rt.arm(kind)

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        d = self.d
        if d is None:
            return
        d.check_invariants()
        assert_no_block_leaked(d)
        importing = {r for r in self.events if d.state.phase.get(r) == core.PHASE_IMPORTING}
        growing = self._growing()
        assert importing == self.pending | growing and not self.pending & growing
        assert set(d.transfers()) == self.pending | self.draining | growing
        if growing:
            event("an import table waits for blocks")
        for rid, req in d.requests.items():
            ends = self._terminal(rid) + (rid in self.aborted)
            assert ends <= 1, (rid, self.events[rid])
            assert req.ended == (ends == 1), rid

    def teardown(self) -> None:
        d = self.d
        if d is None:
            return
        for _ in range(2000):
            if not d.busy():
                break
            for rid in sorted(self.pending):
                r = machine_payload(d.requests[rid].prompt)
                self._take(d.import_kv(rid, r.prompt, r.first_token, r.host))
                self.pending.discard(rid)
            for rid in sorted(self.draining):
                assert d.transfer_ended(rid, "late") == []
            self.draining.clear()
            self._take(d.step())
            self.consistent()
        assert not d.busy(), "not idle after 2000 rounds"
        assert all(own in ("FREE", "CACHE", "SCRATCH") for own in owners(d))
        raised = {kind for kind, _ in self.rt.raised}
        for kind in sorted(raised):
            event(f"runtime fault raised: {kind}")
        for rid, req in d.requests.items():
            assert req.ended and self._terminal(rid) + (rid in self.aborted) == 1
            evs = self.events[rid]
            assert [e.token for e in evs if e.kind == "token"] == req.tokens
            want = self.oracle.generate(req.prompt, req.max_new_tokens)
            if req.error is None:
                assert evs[-1].kind == "finished" and req.tokens == want, (rid, req.tokens, want)
            else:
                assert req.tokens == want[:len(req.tokens)]
                if rid in self.bad:
                    assert self.bad[rid] in req.error
                elif rid not in self.aborted:
                    kind = next(k for k in RUNTIME_FAILURES if req.error.startswith(k))
                    assert kind.split()[0].removesuffix("_kv_cache") in raised, req.error


TestPDDecodeMachine = PDDecodeMachine.TestCase
