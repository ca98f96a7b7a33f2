"""PD with preemption (paged tables, kv_blocks at the preemption rule's much lower minimum).

- Decode side: importing lanes are never victims (they compute nothing); an imported request
  that decodes and is later preempted resumes by recomputing its prompt and tokens here (its
  prefill worker knows none of the tokens decoded since). Token-exact against the oracle.
- With preemption one importing table grows at a time (`one_import_table_growing`): two
  imports each holding part of the pool, neither preemptable, would wait for each other.
- Prefill side: prefills for export are preempted like any prefill, an exporting lane (its
  blocks pinned by the send) never is; every payload still arrives whole.
"""

from __future__ import annotations

import random

import pytest

from atom_core._generated import core
from atom_core.batcher import Event
from atom_core.config import Config, min_kv_blocks
from atom_core.proofs import capacity
from atom_core.spec.model import MODEL
from tests.test_pd_batcher import Link, assert_exact, expected
from tests.test_pd_paged import S, batcher, paged

C = 64


def preempting(lanes: int, tables: int, prefix: bool = False, scratch: str = "dynamic",
               extra: int = 0) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, tables,
                                                       preemption=True) + extra,
                  max_seq_len=S, block_size=S // tables, prefill_chunk=C, prefix_cache=prefix,
                  scratch=scratch, preemption=True)


def work(n: int, lo: int, hi: int, new: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(128) for _ in range(rng.randint(lo, hi))], rng.randint(*new))
            for _ in range(n)]


def kinds(link: Link, rid: int) -> list[str]:
    return [e.kind for _, e in link.events.get(rid, [])]


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("prefix", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("tables", [2, 4])
def test_decode_side_preempts_imported_requests_token_exact(tables: int, prefix: bool,
                                                            scratch: str) -> None:
    d = batcher(preempting(3, tables, prefix, scratch))
    link = Link(batcher(paged(2, tables, True)), d)
    # prompts of one to several blocks, decoding far enough to need their next blocks
    rids = [d.submit(p, n, remote=True) for p, n in work(7, 20, S // 2, (40, 90), tables)]
    link.run()
    assert_exact(link, rids)
    assert d.stats.preemptions > 0
    # an imported request that was preempted later recomputed here: a local prefill
    resumed = [r for r in rids if "preempted" in kinds(link, r)]
    assert resumed and d.stats.prefill_tokens > 0
    assert all(not d.requests[r].remote for r in resumed)
    assert link.d.transfers() == {} and link.p.transfers() == {}
    assert all(o in (core.OWNER_FREE, core.OWNER_CACHE, core.OWNER_SCRATCH)
               for o in d.state.owner)


def test_one_import_table_grows_at_a_time() -> None:
    """Two imports of a whole table's prompt each at K = T + 1: the second is admitted only
    once the first's table covers its prompt (then the first's transfer runs)."""
    tables = 4
    d = batcher(preempting(2, tables))
    link = Link(batcher(paged(2, tables, True)), d)
    assert d.config.kv_blocks == tables + 1
    rids = [d.submit(p, 3, remote=True) for p, _ in work(2, S - 20, S - 2, (3, 3), 7)]
    waits_seen = 0
    for _ in range(400):
        if not (d.busy() or link.p.busy()):
            break
        link.step()
        s = d.state
        waiting = [ln for ln in range(s.consts.B) if core.import_waits(s, ln)]
        assert len(waiting) <= 1, waiting
        waits_seen += any(core.importing(s, ln) for ln in range(s.consts.B)) \
            and s.phase.get(rids[1]) == core.PHASE_WAITING
    assert waits_seen  # the second import waited for the first at least once
    assert_exact(link, rids)


def test_prefill_side_preempts_prefills_never_exports() -> None:
    """A prefill worker that also serves local requests: their decode needs blocks the
    exports' prefills hold, so lanes are preempted; never one whose send is running."""
    tables = 4
    p = batcher(preempting(3, tables, prefix=True))
    d = batcher(paged(3, tables))
    link = Link(p, d)
    log: list[Event] = []
    step = p.step

    def logged() -> list[Event]:
        events = step()
        log.extend(events)
        return events

    p.step = logged  # type: ignore[method-assign]
    local = [p.submit(q, n) for q, n in work(4, 20, 60, (120, 180), 5)]
    rids = [d.submit(q, n, remote=True) for q, n in work(8, S // 2, S - 2, (2, 6), 11)]
    link.run()
    assert_exact(link, rids)
    for rid in local:
        assert p.requests[rid].error is None and p.requests[rid].tokens == expected(p, rid)
    assert p.stats.preemptions > 0 and p.stats.exports == len(rids)
    exported = {e.request_id for e in log if e.kind == "export"}
    assert exported
    for pid in exported:  # never preempted once its send started
        seen = [e.kind for e in log if e.request_id == pid]
        assert "preempted" not in seen[seen.index("export"):], seen


def test_an_importing_lane_is_never_the_victim() -> None:
    """The core refuses to preempt an importing lane, whatever the policy asks."""
    tables = 2
    d = batcher(preempting(2, tables))
    rid = d.submit(list(range(1, 100)), 2, remote=True)
    d.step()  # admitted, its table grown to cover the prompt, the import asked for
    lane = d.state.req_lane.get(rid)
    assert core.importing(d.state, lane)
    assert core.preempt_guard(d.state, lane) == "lane_computing"
    assert core.enabled_preempt(d.state) is False
    # (nothing else runs: the import is still owed; end it cleanly)
    assert d.transfer_ended(rid, "test over") == [Event("error", rid, error="test over")]


def test_without_one_table_at_a_time_two_imports_deadlock() -> None:
    """The guard is what makes PD with preemption live: without it (and the invariant it
    keeps), z3 finds a state at the preemption minimum where two importing lanes each hold
    part of the pool and neither can grow (`import_table_grows` refuted); with it, proved."""
    tables, lanes = 3, 2  # (at T = 2 one block short of a table each leaves one free)
    k = min_kv_blocks(lanes, False, "dynamic", tables, preemption=True)
    f = capacity.Features(False, "dynamic", tables=tables, preempt=True)
    mut = MODEL.without_guard("admit_import", "one_import_table_growing")
    mut.invariants = [i for i in mut.invariants if i.name != "imports_grow_one_at_a_time"]
    verdict = {c.invariant: c.status
               for c in capacity.progress_by_features(mut, lanes, k)[f]}
    assert verdict["import_table_grows"] == "counterexample", verdict
    proved = {c.invariant: c.status
              for c in capacity.progress_by_features(MODEL, lanes, k)[f]}
    assert set(proved.values()) == {"proved"}, proved
