"""Single-block mode (kv_blocks=1): block 0 serves the only lane.

- The verify cases (`capacity.SINGLE_BLOCK`) have their expected outcomes; each stuck run
  replays through the generated core into a state breaking the named progress property, and
  shows what breaks: a second lane that never gets a block, a second lane whose padding row
  blocks decoding. A cache entry in block 0 no longer blocks a same-prefix admission: the lane
  takes the entry over (`admit_adopt`).
- Config accepts kv_blocks=1 exactly where the z3 progress proof at B lanes, K=1 passes, and
  otherwise names rule 'single-block' and the reason.
- A single-block PD decode worker fed by a prefill batcher serves requests one after another
  in block 0, token-exact against the oracle, through failed and aborted imports.
"""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pytest
import torch

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, ConfigError, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.pd import payload as pd
from atom_core.proofs import capacity, search
from atom_core.proofs.capacity import Features
from atom_core.proofs.checks import INHABITED
from atom_core.replay import replay
from atom_core.runtime import TorchReferenceRuntime
from atom_core.seq import seq
from atom_core.spec.model import MODEL

CASES = {c.name: c for c in capacity.SINGLE_BLOCK}


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[Any, Any]]:
    return {c.name: c.check(MODEL) for c in capacity.SINGLE_BLOCK}


def _core_args(action: str, raw: dict[str, Any]) -> dict[str, Any]:
    sorts = dict(zip(core.ACTIONS[action][2], core.ACTIONS[action][3], strict=True))
    return {k: seq(v) if sorts[k] == "Seq" else tuple(v) if sorts[k].startswith("(") else v
            for k, v in raw.items()}


def replay_trace(case: capacity.SingleBlockCase, tr: Any) -> core.State:
    """The trace's run through the generated core, every step accepted; the final state."""
    s = core.init(core.Consts(B=case.lanes, K=1, C=search.TRACE_CHUNK, S=search.TRACE_SEQ_LEN,
                              PREFIX=case.prefix_cache, RESERVED=False, SCRATCH=0), ghost=True)
    for st in tr.steps:
        step = core.ACTIONS[st.action][0](s, **_core_args(st.action, st.args))
        assert step.rejected is None, (st, step.rejected)
        s = step.state
        assert core.check_invariants(s) == [], st
    return s


# --------------------------------------------------------------------------- verify cases
def test_the_cases() -> None:
    """Three safe one-lane roles (the prefix cache too), and the two ways single-block mode
    breaks."""
    assert len(CASES) == len(capacity.SINGLE_BLOCK)
    safe = {(c.lanes, c.prefix_cache, c.role) for c in CASES.values() if not c.stuck}
    assert safe == {(1, False, "decode"), (1, False, "colocated"), (1, True, "any")}
    stuck = {(c.lanes, c.prefix_cache, c.want) for c in CASES.values() if c.stuck}
    assert stuck == {(2, False, "idle_lane_imports"), (2, False, "running_request_advances")}


@pytest.mark.parametrize("name", list(CASES))
def test_case_has_its_expected_outcome(name: str, results: dict[str, Any]) -> None:
    case = CASES[name]
    chk, tr = results[name]
    assert chk.status == "proved" and chk.detail == "", chk
    assert chk.invariant == f"single-block:{name}" and chk.kind == "capacity-single-block"
    assert chk.size.startswith(f"B={case.lanes},K=1,")
    if not case.stuck:
        assert tr is None
        return
    assert tr is not None and tr.violated == case.want
    final = replay_trace(case, tr)
    assert case.want in core.progress_violations(final)
    assert search.summary(final) == tr.final
    json.dumps([s.as_json() for s in tr.steps])  # the trace is reportable as is


def test_second_lane_blocks_decode(results: dict[str, Any]) -> None:
    """One request imported into lane 0's block 0; lane 1 idle. Its decode row is padding and
    would have to write somewhere: block 0 is lane 0's, there is no other."""
    case = CASES["second-lane-blocks-decode"]
    _, tr = results[case.name]
    assert [s.action for s in tr.steps] == ["submit", "admit_import", "import_done"]
    sub, adm, imp = (s.args for s in tr.steps)
    assert adm == {"l": 0, "r": sub["r"], "dst": 0}
    assert imp["r"] == sub["r"] and imp["p"] == sub["p"]  # the whole prompt's KV arrived
    assert tr.violated == "running_request_advances"
    assert tr.final == {"lanes": ["r0", "idle"], "blocks": ["lane 0"], "waiting": {}}
    final = replay_trace(case, tr)
    assert final.phase.get(sub["r"]) == core.PHASE_DECODE
    tok = (search.TOKEN,) * case.lanes
    assert core.decode_guard(final, 0, 1, tok) == "scratch_target_ok"


def test_second_lane_never_admitted(results: dict[str, Any]) -> None:
    """Lane 0 holds block 0 for an import; lane 1 is idle and a request waits: no block."""
    case = CASES["second-lane-never-admitted"]
    _, tr = results[case.name]
    assert [s.action for s in tr.steps] == ["submit", "submit", "admit_import"]
    first, second, adm = (s.args for s in tr.steps)
    assert adm == {"l": 0, "r": first["r"], "dst": 0}
    assert tr.violated == "idle_lane_imports"
    assert tr.final == {"lanes": ["r0", "idle"], "blocks": ["lane 0"],
                        "waiting": {f"r{second['r']}": second["p"]}}
    final = replay_trace(case, tr)
    assert core.admit_import_guard(final, 1, second["r"], 0) == "dst_reusable"


def test_prefix_cache_entry_in_block_0_is_taken_over() -> None:
    """The seeds' incident at one block: a finished request cached in block 0, and a waiting
    prompt with the same first chunk. A miss is refused (the hit is taken) and a copy has no
    second block; the lane takes the entry over, and the prompt's prefix is not computed
    again."""
    c, n = search.TRACE_CHUNK, 2 * search.TRACE_CHUNK
    p = tuple(range(1, n + 2))  # two chunks and a token
    s = core.init(core.Consts(B=1, K=1, C=c, S=search.TRACE_SEQ_LEN, PREFIX=True,
                              RESERVED=False, SCRATCH=0), ghost=True)

    def run(name: str, *args: Any) -> None:
        nonlocal s
        step = core.ACTIONS[name][0](s, *args)
        assert step.rejected is None, (name, step.rejected)
        s = step.state

    run("submit", 0, seq(p))
    run("submit", 1, seq(p))
    run("admit_miss", 0, 0, 0)
    while s.phase.get(0) == core.PHASE_PREFILL:
        run("prefill", 0, 7)
    run("finish", 0, True)
    assert s.owner == (core.OWNER_CACHE,) and s.busy == (False,)
    assert core.admit_miss_guard(s, 0, 1, 0) == "no_cache_hit"
    assert core.admit_hit_guard(s, 0, 1, 0, 0, n) == "dst_not_src"
    step = core.admit_adopt(s, 0, 1, 0, n)
    assert step.rejected is None, step.rejected
    assert step.state.length == (n,) and step.state.owner == (core.OWNER_LANE,)
    assert core.progress_violations(s) == [] and not core.check_invariants(step.state)


# --------------------------------------------------------------------------- config
def test_single_block_config_accepted() -> None:
    cfg = Config(lanes=1, kv_blocks=1, max_seq_len=256, prefill_chunk=64)
    assert cfg.prefix_cache is False and cfg.scratch == "dynamic"
    assert cfg.consts().K == 1 and cfg.consts().B == 1 and not cfg.consts().RESERVED
    assert min_kv_blocks(1, False, "dynamic") == 1


@pytest.mark.parametrize(("kw", "reasons"), [
    ({"lanes": 2}, ["lanes=2", "a second lane never gets a block", "padding"]),
    ({"scratch": "reserved"}, ["scratch='reserved'", "the only block would be the scratch"]),
    ({"scratch": "reserved", "scratch_block": 0}, ["scratch='reserved'"]),
    ({"lanes": 3, "prefix_cache": True}, ["lanes=3"]),
], ids=["lanes", "reserved", "reserved-explicit", "lanes+prefix"])
def test_single_block_config_rejected(kw: dict[str, Any], reasons: list[str]) -> None:
    args = {"lanes": 1, "kv_blocks": 1, "max_seq_len": 256, "prefill_chunk": 64} | kw
    with pytest.raises(ConfigError) as exc:
        Config(**args)
    msg = str(exc.value)
    assert "rule 'single-block'" in msg
    for why in reasons:
        assert why in msg, (why, msg)
    need = min_kv_blocks(args["lanes"], args.get("prefix_cache", False),
                         args.get("scratch", "dynamic"))
    assert need > 1 and f"needs {need}" in msg
    # the fix it names works
    assert Config(**(args | {"kv_blocks": need})).kv_blocks == need


# --------------------------------------------------------------------------- z3 progress
@pytest.mark.parametrize("lanes", [1, 2])
def test_z3_progress_at_one_block_matches_config(lanes: int) -> None:
    """At K=1 the progress proof passes exactly for one lane with dynamic scratch and one block
    per table (with or without the prefix cache), and Config accepts kv_blocks=1 exactly
    there."""
    by = capacity.progress_by_features(MODEL, lanes, 1)
    assert set(by) == set(capacity.COMBINATIONS)
    for f, checks in by.items():
        assert checks and all(c.status in ("proved", "counterexample") for c in checks)
        proved = all(c.status == "proved" for c in checks)
        assert proved == (lanes == 1 and f.scratch == "dynamic" and f.tables == 1), (f, checks)
        try:  # (the artifact of the features: block size 256 / T)
            Config(lanes=lanes, kv_blocks=1, max_seq_len=256, block_size=256 // f.tables,
                   prefill_chunk=64, prefix_cache=f.prefix_cache, scratch=f.scratch)
            accepted = True
        except ConfigError:
            accepted = False
        assert accepted == proved, f


def test_z3_two_lanes_one_block_counterexamples_are_the_traced_ones() -> None:
    checks = capacity.progress_by_features(MODEL, 2, 1)[Features(False, "dynamic")]
    failed = {c.invariant for c in checks if c.status == "counterexample"}
    # the two properties the second-lane runs break are refuted by z3 too
    assert {"idle_lane_imports", "running_request_advances"} <= failed
    assert {c.invariant for c in checks} == {p.name for p in MODEL.progress} | {INHABITED}


# --------------------------------------------------------------------------- the batcher
S, C = 256, 64
SINGLE = Config(lanes=1, kv_blocks=1, max_seq_len=S, prefill_chunk=C)
_rng = random.Random(31)
SYSTEM = [_rng.randrange(128) for _ in range(100)]


def _toks(n: int) -> list[int]:
    return [_rng.randrange(128) for _ in range(n)]


class Worker:
    """A single-block decode batcher D and a single-block prefill batcher P, pumped by direct
    calls; `bad` maps a D request to the (wrong) prompt its KV is delivered for."""

    def __init__(self, bad: dict[int, list[int]] | None = None) -> None:
        self.trace = io.StringIO()
        self.d = AtomBatcher(SINGLE, TorchReferenceRuntime.tiny(SINGLE), ghost=True,
                             trace=self.trace)
        self.p = AtomBatcher(SINGLE, TorchReferenceRuntime.tiny(SINGLE), ghost=True)
        self.bad = bad or {}
        self.wire: dict[int, int] = {}
        self.events: dict[int, list[Event]] = {}
        self.blocks: dict[int, int] = {}  # D request -> its block at the import event
        self.admitted: list[int] = []  # D requests, in admission order
        self.held: dict[int, tuple[list[int], int, torch.Tensor]] = {}
        self.hold: set[int] = set()

    def _log(self, events: list[Event]) -> None:
        for e in events:
            self.events.setdefault(e.request_id, []).append(e)

    def step(self) -> None:
        events = self.d.step()
        self.d.check_invariants()
        self._log(events)
        for e in events:
            if e.kind == "import":
                self.blocks[e.request_id] = self.d.transfers()[e.request_id]
                self.admitted.append(e.request_id)
                self.wire[self.p.submit(self.d.requests[e.request_id].prompt, 1,
                                        export=True)] = e.request_id
        p_events = self.p.step()
        self.p.check_invariants()
        for e in p_events:
            if e.kind != "export":
                continue
            did = self.wire[e.request_id]
            ex = self.p.take_export(e.request_id)
            payload = pd.make_payload(str(did), ex.prompt, ex.first_token, ex.host,
                                      pd.model_fingerprint(self.p.runtime))
            assert self.p.export_done(e.request_id) == [Event("finished", e.request_id)]
            buf = pd.write_into(payload, self.d.runtime.new_host_buffer())
            if did in self.hold:
                self.held[did] = (list(payload.prompt), payload.first_token, buf)
            else:
                self._log(self.d.import_kv(did, self.bad.get(did, list(payload.prompt)),
                                           payload.first_token, buf))
                self.d.check_invariants()

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not (self.d.busy() or self.p.busy()):
                return
            self.step()
        raise AssertionError("not done")

    def assert_exact(self, rid: int) -> None:
        r = self.d.requests[rid]
        assert r.error is None and r.ended, (rid, r.error)
        assert r.tokens == oracle_for(self.d.runtime).generate(r.prompt, r.max_new_tokens)
        assert [e.kind for e in self.events[rid]][-1] == "finished"


PROMPTS = [(_toks(5), 4), (SYSTEM + _toks(40), 6), (_toks(64), 1), (SYSTEM + _toks(3), 5),
           (_toks(200), 3), (_toks(255), 4)]


def test_single_block_decode_worker_serves_requests_in_sequence() -> None:
    w = Worker()
    rids = [w.d.submit(p, n, remote=True) for p, n in PROMPTS]
    w.run()
    for rid in rids:
        w.assert_exact(rid)
    assert w.admitted == rids  # one at a time, in order
    assert w.blocks == dict.fromkeys(rids, 0)  # every one in block 0
    assert w.d.stats.imported_tokens == sum(len(p) for p, _ in PROMPTS)
    assert w.d.stats.prefill_tokens == 0 and w.d.stats.decode_rows_padding == 0
    assert w.p.stats.exports == len(PROMPTS)
    assert core.describe_state(w.d.state)["owner"] == ["FREE"]
    assert replay(io.StringIO(w.trace.getvalue())).ok


def test_single_block_worker_also_serves_local_requests() -> None:
    """colocated-one-lane-safe: remote and local requests interleave in block 0."""
    w = Worker()
    rids = [w.d.submit(p, n, remote=(i % 2 == 0)) for i, (p, n) in enumerate(PROMPTS)]
    w.run()
    for rid in rids:
        w.assert_exact(rid)
    local = sum(len(p) for i, (p, _) in enumerate(PROMPTS) if i % 2)
    assert w.d.stats.prefill_tokens == local
    assert w.d.stats.imported_tokens == sum(len(p) for p, _ in PROMPTS) - local


def test_failed_import_in_the_middle_does_not_stop_later_ones() -> None:
    bad_rid = 2
    prompt = PROMPTS[bad_rid][0]
    w = Worker(bad={bad_rid: prompt[:-1]})  # partial KV: the prompt's prefix
    rids = [w.d.submit(p, n, remote=True) for p, n in PROMPTS]
    assert rids[bad_rid] == bad_rid
    w.run()
    err = w.d.requests[bad_rid].error
    assert err is not None and "covers_prompt" in err and f"covers {len(prompt) - 1}" in err
    assert [e.kind for e in w.events[bad_rid]] == ["import", "error"]
    assert w.d.requests[bad_rid].tokens == []
    for rid in rids:
        if rid != bad_rid:
            w.assert_exact(rid)
    assert w.blocks == dict.fromkeys(rids, 0)
    assert w.d.stats.transfer_failures == 1
    assert core.describe_state(w.d.state)["owner"] == ["FREE"]


def test_abort_during_import_blocks_the_only_block_until_the_transfer_ends() -> None:
    """With one block an aborted import's block drains, so the next request (lane idle) waits
    for the transfer's end, and then gets block 0."""
    w = Worker()
    first = w.d.submit(SYSTEM + _toks(20), 4, remote=True)
    nxt = w.d.submit(_toks(30), 4, remote=True)
    w.hold.add(first)
    while first not in w.held:
        w.step()
    assert w.d.abort(first) is True
    w.d.check_invariants()
    d = core.describe_state(w.d.state)
    assert d["owner"] == ["DRAINING"] and d["busy"] == [False]
    for _ in range(3):  # the lane is idle, but the only block is draining: nxt waits
        w.step()
        assert w.d.state.phase.get(nxt) == core.PHASE_WAITING
        assert w.d.busy()
    assert w.d.transfer_ended(first, "cancelled") == []
    assert core.describe_state(w.d.state)["owner"] == ["FREE"]
    w.run()
    w.assert_exact(nxt)
    assert w.blocks == {first: 0, nxt: 0}
    assert w.d.requests[first].tokens == [] and w.d.requests[first].error == "aborted"
    assert w.d.stats.imported_tokens == len(w.d.requests[nxt].prompt)
