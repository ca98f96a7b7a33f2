"""PD with paged block tables (T = max_seq_len / block_size > 1): a prompt's KV spans several
blocks on both sides.

- Round trips are token-exact against the oracle at T = 2 and 4, with prompts ending inside a
  block, exactly at a block's end, and filling the whole table but one position.
- The decode side asks for the KV ("import") only once the lane's table covers the prompt, and
  writes every block; imported full blocks become prefix-cache entries that a later local
  request hits past its first block.
- An abort mid-import drains every block of the table until the transfer ends, which frees
  them all at once; a fault writing or reading any one block fails only its request and leaks
  no block; a payload shorter than the prompt fails only its request.
- z3 ties a running transfer to every block it uses, not only to one witness block.
- The workers over an in-process transport serve multi-block prompts token-exactly.
"""

from __future__ import annotations

import io
import math
import random
from typing import Any

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.pd import payload as pd
from atom_core.pd.transport import InProcessTransport
from atom_core.pd.workers import DecodeWorker, PrefillWorker
from atom_core.proofs import capacity, checks, search
from atom_core.replay import replay
from atom_core.runtime import TorchReferenceRuntime
from atom_core.seq import seq
from atom_core.spec import lang
from atom_core.spec import model as spec
from atom_core.spec.model import MODEL
from tests.test_pd_batcher import (
    LOST,
    SYSTEM,
    C,
    FaultyPDRuntime,
    Link,
    assert_exact,
    expected,
    inner,
    owners,
)

S = 256  # max_seq_len
_rng = random.Random(77)


def _toks(n: int) -> list[int]:
    return [_rng.randrange(128) for _ in range(n)]


def paged(lanes: int, tables: int, prefix: bool = False, scratch: str = "dynamic",
          extra: int = 0) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, tables) + extra,
                  max_seq_len=S, block_size=S // tables, prefill_chunk=C, prefix_cache=prefix,
                  scratch=scratch)


def batcher(cfg: Config, runtime: Any = None, trace: io.StringIO | None = None) -> AtomBatcher:
    # one model (seed) for every configuration: the oracle is the same on both sides
    rt = runtime if runtime is not None else TorchReferenceRuntime.tiny(cfg)
    return AtomBatcher(cfg, rt, ghost=True, trace=trace)


def table_of(b: AtomBatcher, rid: int) -> list[int]:
    return b.describe()["lanes"][b.state.req_lane.get(rid)]["blocks"]


def prompts_for(block: int) -> list[tuple[list[int], int]]:
    """Prompt lengths around the block edges: inside the first block, exactly one block, one
    past it, exactly two, the whole table but one position (the import leaves one to decode)."""
    lengths = [block - 1, block, block + 1, min(2 * block, S - 2), S - 1, 3]
    return [(_toks(n), 1 + i % 4) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("prefix", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("tables,lanes", [(2, 1), (2, 2), (4, 2)])
def test_round_trip_token_exact(tables: int, lanes: int, prefix: bool, scratch: str) -> None:
    trace = io.StringIO()
    d = batcher(paged(lanes, tables, prefix, scratch), trace=trace)
    p = batcher(paged(2, tables, True))
    link = Link(p, d)
    work = prompts_for(S // tables)
    rids = [d.submit(prompt, n, remote=True) for prompt, n in work]
    link.run()
    assert_exact(link, rids)
    assert d.stats.prefill_tokens == 0 and d.transfers() == {} and p.transfers() == {}
    assert d.stats.imported_tokens == sum(len(prompt) for prompt, _ in work)
    assert p.stats.exports == len(work) and d.stats.transfer_failures == 0
    blocks = [math.ceil(len(prompt) / (S // tables)) for prompt, _ in work]
    assert max(blocks) == tables  # some import filled the whole table
    assert all(own in ("FREE", "CACHE", "SCRATCH") for own in owners(d))
    assert replay(io.StringIO(trace.getvalue())).ok


def test_import_is_asked_for_once_the_table_covers_the_prompt() -> None:
    d = batcher(paged(2, 4))  # blocks of 64
    link = Link(batcher(paged(2, 4, True)), d)
    rid = d.submit(_toks(150), 3, remote=True)
    events = d.step()
    assert [e.kind for e in events] == ["import"]
    assert len(table_of(d, rid)) == 3  # 150 positions: three blocks, pinned for the transfer
    assert d.stats.table_grows == 2
    assert {owners(d)[b] for b in table_of(d, rid)} == {"LANE"}
    link.imports.append(rid)
    link.wire[link.p.submit(d.requests[rid].prompt, 1, export=True)] = rid
    link.run()
    assert_exact(link, [rid])


def test_imported_blocks_are_cache_entries_a_local_request_hits_past_its_first_block() -> None:
    """An import keys its full blocks as a local prefill would: a local request sharing the
    first two blocks copies both (admission, then `grow_hit`) instead of prefilling them."""
    d = batcher(paged(2, 4, prefix=True))  # blocks of 64; SYSTEM spans two of them
    link = Link(batcher(paged(2, 4, True)), d)
    seed = d.submit(SYSTEM + _toks(5), 2, remote=True)
    link.run()
    local = d.submit(SYSTEM[:128] + _toks(40), 4)
    link.run()
    assert_exact(link, [seed, local])
    assert d.stats.prefix_hit_tokens == 128
    assert d.stats.prefill_tokens == 40


@pytest.mark.parametrize("end", ["transfer_ended", "late_import_kv"])
def test_abort_mid_import_drains_every_block_until_the_transfer_ends(end: str) -> None:
    d = batcher(paged(1, 4, extra=1))  # one block beyond the table: for the next request
    link = Link(batcher(paged(2, 4, True)), d, hold=[0])
    rid = d.submit(_toks(200), 4, remote=True)
    link.step_until(lambda: rid in link.ready)
    table = table_of(d, rid)
    assert len(table) == 4
    assert d.abort(rid) is True
    d.check_invariants()
    assert [owners(d)[b] for b in table] == ["DRAINING"] * 4
    # the lane is free: a local request takes it with the blocks that are left
    new = d.submit(_toks(30), 2)
    link.step()
    assert d.state.phase.get(new) is not None and not set(table_of(d, new)) & set(table)
    r = link.ready.pop(rid)
    if end == "transfer_ended":
        assert d.transfer_ended(rid, LOST) == []
    else:
        assert d.import_kv(rid, r.prompt, r.first_token, r.host) == []
    d.check_invariants()
    assert [owners(d)[b] for b in table] == ["FREE"] * 4 and d.transfers() == {}
    assert d.stats.imported_tokens == 0 and d.requests[rid].error == "aborted"
    link.run()
    assert d.requests[new].tokens == expected(d, new)


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_a_fault_writing_any_block_fails_only_that_import(fail_at: int) -> None:
    cfg = paged(2, 4)
    rt = FaultyPDRuntime(TorchReferenceRuntime.tiny(cfg), update=[fail_at])
    d = batcher(cfg, rt)
    link = Link(batcher(paged(2, 4, True)), d)
    bad = d.submit(_toks(180), 3, remote=True)  # three blocks: update calls 0, 1, 2
    good = [d.submit(_toks(n), 3, remote=True) for n in (70, 20)]
    link.run()
    assert rt.raised == [("update", fail_at)]
    assert "update_kv_cache failed" in (d.requests[bad].error or "")
    assert d.requests[bad].tokens == []
    assert_exact(link, good)
    assert d.transfers() == {} and all(o in ("FREE", "SCRATCH") for o in owners(d))


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_fault_reading_any_block_fails_only_that_export(fail_at: int) -> None:
    pcfg = paged(2, 2, True)
    prt = FaultyPDRuntime(TorchReferenceRuntime.tiny(pcfg), fetch=[fail_at])
    p = batcher(pcfg, prt)
    d = batcher(paged(2, 2))
    link = Link(p, d)
    bad = d.submit(_toks(200), 3, remote=True)  # two blocks: fetch calls 0 and 1
    link.run()
    assert prt.raised == [("fetch", fail_at)] and len(link.p_errors) == 1
    assert "export failed" in (d.requests[bad].error or "")
    good = d.submit(_toks(190), 3, remote=True)
    link.run()
    assert_exact(link, [good])
    assert p.transfers() == {} and d.transfers() == {}
    assert set(owners(p)) <= {"FREE", "CACHE", "SCRATCH"}


def test_a_payload_shorter_than_the_prompt_fails_only_its_request() -> None:
    d = batcher(paged(2, 2))
    link = Link(batcher(paged(2, 2, True)), d, hold=[0])
    rid = d.submit(_toks(180), 3, remote=True)
    other = d.submit(_toks(40), 3, remote=True)
    link.step_until(lambda: rid in link.ready)
    r = link.ready.pop(rid)
    events = d.import_kv(rid, r.prompt, r.first_token, r.host[:, :, :, :100])
    assert [e.kind for e in events] == ["error"]
    assert "import rejected (host_kv)" in events[0].error and ", 100, " in events[0].error
    link.run()
    assert_exact(link, [other])
    assert d.transfers() == {} and set(owners(d)) <= {"FREE", "SCRATCH"}


def pump(dw: DecodeWorker, pw: PrefillWorker, rounds: int = 5000) -> None:
    """Step both workers alternately until the decode side is done."""
    for _ in range(rounds):
        if not dw.busy():
            return
        dw.step()
        pw.step_once()
    raise AssertionError(f"not done after {rounds} rounds")


def test_workers_serve_multi_block_prompts_exactly() -> None:
    dcfg, pcfg = paged(2, 4), paged(2, 2, True)  # block sizes may differ between the sides
    td, tp = InProcessTransport.pair()
    pw = PrefillWorker(pcfg, TorchReferenceRuntime.tiny(pcfg, seed=0), tp,
                       insecure=True)
    dw = DecodeWorker(dcfg, TorchReferenceRuntime.tiny(dcfg, seed=0), td, prefetch=1,
                      insecure=True)
    work = prompts_for(64)
    wids = [dw.submit(prompt, n) for prompt, n in work]
    pump(dw, pw)
    results = dw.results()
    for wid in wids:
        assert results[wid].error is None, results[wid].error
        assert results[wid].tokens == expected(dw.batcher, dw.requests[wid].brid)
    assert dw.summary()["imported_tokens"] == sum(len(prompt) for prompt, _ in work)
    assert pw.stats.exports == len(work)
    assert pd.layout_of(dw.batcher.new_import_buffer()) == pd.layout_of(
        inner(dw.runtime).new_host_buffer())


def _short_table() -> tuple[Link, int, int, int]:
    """D (two lanes, tables of four blocks of 64, the minimum of blocks) with a local request
    decoding in three blocks and an aborted import draining four: remote R2 is admitted with
    the block left and its table cannot grow. Returns (link, local, aborted, r2)."""
    d = batcher(paged(2, 4))
    assert d.config.kv_blocks == 8
    link = Link(batcher(paged(2, 4, True)), d, hold=[1])
    local = d.submit(_toks(150), 40)
    r1 = d.submit(_toks(200), 3, remote=True)
    link.step_until(lambda: r1 in link.ready and d.state.phase.get(local) == core.PHASE_DECODE)
    assert d.abort(r1) is True
    r2 = d.submit(_toks(200), 3, remote=True)
    link.step()
    assert d.state.phase.get(r2) == core.PHASE_IMPORTING and len(table_of(d, r2)) == 1
    assert r2 not in link.imports and not d.awaits_kv(r2)  # nobody asked for its KV yet
    return link, local, r1, r2


def _drain_and_finish(link: Link, local: int, aborted: int) -> None:
    """The aborted import's drain ends; the local request finishes exactly and nothing is
    held."""
    d = link.d
    assert d.transfer_ended(aborted, LOST) == []
    link.run()
    assert d.requests[local].tokens == expected(d, local)
    assert d.transfers() == {} and set(owners(d)) <= {"FREE", "SCRATCH"}


def test_an_import_whose_table_is_still_growing_ends_at_once_when_aborted() -> None:
    """No one was asked for its KV, so no end of its transfer will ever be reported: its block
    is free at once (it would otherwise drain forever)."""
    link, local, r1, r2 = _short_table()
    d = link.d
    (block,) = table_of(d, r2)
    assert d.abort(r2) is True
    d.check_invariants()
    assert owners(d)[block] == "FREE" and set(d.transfers()) == {r1}
    _drain_and_finish(link, local, r1)


def test_kv_for_an_import_whose_table_is_still_growing_is_refused_by_name() -> None:
    link, local, r1, r2 = _short_table()
    d = link.d
    events = d.import_kv(r2, d.requests[r2].prompt, 1, d.new_import_buffer())
    assert [e.kind for e in events] == ["error"]
    assert "table_covers_prompt" in events[0].error and "import event" in events[0].error
    d.check_invariants()
    _drain_and_finish(link, local, r1)


def test_a_waiting_import_is_asked_for_once_its_table_grows() -> None:
    link, local, r1, r2 = _short_table()
    d = link.d
    assert d.transfer_ended(r1, LOST) == []  # four blocks free: r2's table grows
    link.step()
    assert r2 in link.imports and len(table_of(d, r2)) == 4
    link.run()
    assert_exact(link, [local, r2])


def test_prefetched_kv_waits_for_the_whole_table() -> None:
    """The decode worker prefetches r2's KV; it arrives while r2's lane is admitted but its
    table cannot grow yet (an aborted import's blocks drain until the prefill worker answers
    the cancel). It is kept, not imported into a partial table (which the core would refuse,
    failing r2), and imported once the table is whole."""
    dcfg, pcfg = paged(2, 4), paged(2, 4, True)
    td, tp = InProcessTransport.pair()
    pw = PrefillWorker(pcfg, TorchReferenceRuntime.tiny(pcfg, seed=0), tp,
                       insecure=True)
    dw = DecodeWorker(dcfg, TorchReferenceRuntime.tiny(dcfg, seed=0), td, prefetch=1,
                      insecure=True)
    w0, w1, w2 = dw.submit(_toks(150), 30), dw.submit(_toks(200), 3), dw.submit(_toks(200), 3)
    dw.step()  # w0 (three blocks) and w1 (four) are asked for, w2 prefetched
    b = dw.batcher
    r1, r2 = dw.requests[w1].brid, dw.requests[w2].brid
    assert b.awaits_kv(r1) and dw.requests[w2].wire is not None
    assert dw.abort(w1) is True  # its four blocks drain until the prefill worker answers
    dw.step()
    assert b.state.phase.get(r2) == core.PHASE_IMPORTING and not b.awaits_kv(r2)
    for _ in range(50):  # the prefill side only: it answers the cancel, ships w0's and w2's KV
        pw.step_once()
        if pw.stats.exports == 2:
            break
    assert pw.stats.exports == 2 and pw.stats.cancelled == 1
    dw.step()  # the cancel's answer frees the blocks, w2's KV arrives: kept, then imported
    pump(dw, pw)
    res = dw.results()
    for wid in (w0, w2):
        assert res[wid].error is None, res[wid].error
        assert res[wid].tokens == expected(b, dw.requests[wid].brid)
    assert res[w1].error is not None


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
def test_the_capacity_rule_is_tight_for_imports_that_span_blocks(scratch: str) -> None:
    """At the proved minimum (two lanes, tables of two blocks) z3 shows every import table can
    grow (`import_table_grows`) from any state the invariants allow; one block fewer, a decode
    worker that only imports gets stuck: two imports of two-block prompts each hold part of
    the blocks, found by search over the generated core and replayed in z3 against the spec."""
    reserved = scratch == "reserved"
    k = min_kv_blocks(2, False, scratch, 2)
    f = capacity.Features(False, scratch, tables=2)
    at_min = {c.invariant: c.status for c in capacity.progress_by_features(MODEL, 2, k)[f]}
    below = {c.invariant: c.status for c in capacity.progress_by_features(MODEL, 2, k - 1)[f]}
    assert at_min["import_table_grows"] == "proved" and set(at_min.values()) == {"proved"}
    assert below["import_table_grows"] == "counterexample"
    two_blocks = [seq(range(1, 2 * search.TRACE_SEQ_LEN - 4)), seq([100])]
    tr = search.stuck_run(MODEL, 2, k - 1, False, reserved, role="decode", tables=2,
                          want="import_table_grows", prompts=two_blocks, requests=2)
    assert tr is not None and tr.violated == "import_table_grows"
    actions = [s.action for s in tr.steps]
    assert actions.count("admit_import") == 2 and "import_done" not in actions


def _transfer_end_frees_other_transfers_blocks_but_their_first() -> Any:
    """`transfer_end(r, b)` also frees blocks draining for other requests, sparing the one the
    ghost `xfer_block` names for each (the first block of an import, the tail of an export):
    the bug a one-block witness cannot see. Its owner, transfer and junk updates (over every
    block c) are replaced on a copy of the model."""
    m = MODEL.copy()
    a = m.get_action("transfer_end")
    r, b = a.params

    def drained(c: Any) -> Any:
        return (c == b) | ((spec.owner(c) == spec.Owner.DRAINING) & (
            (spec.transfer_req(c) == r) | (c != spec.xfer_block(spec.transfer_req(c)))))

    value = {"owner": lambda c: lang.ite(drained(c), spec.Owner.FREE, spec.owner(c)),
             "transfer": lambda c: lang.ite(drained(c), lang.Lit(False, lang.BOOL),
                                            spec.transfer(c)),
             "junk": lambda c: spec.junk(c) | drained(c)}
    a.updates = [lang.Update(u.fn, u.args, value[u.fn.name](u.args[0]), u.whole)
                 if u.fn.name in value and u.whole else u for u in a.updates]
    return m


def test_the_proofs_tie_a_running_transfer_to_every_block_it_uses() -> None:
    """A transfer of a table of several blocks pins all of them until it ends, and z3 proves
    it: the ghost `xfer_on`/`xfer_of` records every block a running transfer uses, so freeing
    any one of them early breaks `transfer_pins_what_it_uses` at the step that does it. Without
    those two invariants the same bug proves, because the one-block witness (`xfer_block`,
    `running_transfer_pins_its_block`) stays pinned."""
    mut = _transfer_end_frees_other_transfers_blocks_but_their_first()
    by_block = {"transfer_pins_what_it_uses", "pinned_for_its_transfer"}

    def refuted(m: Any) -> set[tuple[str, str]]:
        only = m.copy()
        only.actions = [only.get_action("transfer_end")]
        found = [c for c in checks.relational(only, base=False) if c.status != "proved"]
        assert all(c.status == "counterexample" for c in found), found  # never `unknown`
        return {(c.invariant, c.action) for c in found}

    assert refuted(mut) == {("transfer_pins_what_it_uses", "transfer_end")}
    witness_only = mut.copy()
    witness_only.invariants = [i for i in mut.invariants if i.name not in by_block]
    assert refuted(witness_only) == set()
