"""The seeds' configuration: one lane, two KV blocks, prefix cache, reserved scratch.

The seeds' scheduler (../shared/seeds/002) stuck there: the same prompt submitted twice, the
first request runs in lane 0 and is cached when it finishes; the second has a mandatory prefix
hit (a miss is forbidden), but a copy needs a destination other than the cached source, and the
only other block is the scratch block. The lane is idle, a request waits, and nothing can be
admitted: `idle_lane_admits` fails. The seeds fixed it by asking for one block more (K = lanes +
2) and declined the alternative, reusing the source block in place, as too many special cases
for a hand-written scheduler.

The model takes that alternative, proved: the lane takes the entry over (`admit_adopt`: its
first n tokens are already the prompt's KV), so the seeds' run ends with the second request
admitted, and the prefix cache needs no block beyond the lanes' (lanes + 1 with a reserved
scratch block, lanes with dynamic scratch). The tests below find the seeds' stuck run in the
seeds' semantics (`seeds_semantics`: the model without taking entries over), by z3's BMC and by
the breadth-first search, and show the model past it.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import z3

from atom_core import seq
from atom_core._generated import core as g
from atom_core.batcher import AtomBatcher
from atom_core.config import Config
from atom_core.proofs import bmc, capacity, checks, search
from atom_core.proofs.capacity import Features
from atom_core.runtime import TorchReferenceRuntime
from atom_core.spec import codegen
from atom_core.spec import lang as L
from atom_core.spec.model import MODEL, PD_ACTIONS
from atom_core.testing.variants import seeds_semantics
from tests.test_batcher_audit import at_rest, drive, oracle

C, S = 2, 6  # small chunk and block sizes keep BMC cheap; the shape is the same at any size
SEEDS = {"B": 1, "K": 2, "C": C, "S": S, "T": 1, "PREFIX": True, "RESERVED": True,
         "SCRATCH": 0}
SCRATCH = 0
# The seeds' incident is colocated serving; with PD a decode worker reaches the same stuck state
# by importing the first request instead of prefilling it (test_pd_single_block.py).
COLOCATED = bmc.avoiding(*PD_ACTIONS)
SEEDS_MODEL = seeds_semantics()


pytestmark = pytest.mark.usefixtures("fresh_z3")


@functools.cache
def seeds_core():
    """The core generated from the seeds' semantics (the breadth-first search runs a core)."""
    return codegen.load(SEEDS_MODEL, name="atom_core._generated.seeds_variant")


def seeds_universe(model: L.Model = SEEDS_MODEL):
    return checks.bounded_universe(model, 1, 2, SEEDS, concrete_seqs=True)


@functools.cache
def same_prompt_run() -> bmc.Trace | None:
    return shortest_with(SEEDS_MODEL, seeds_universe(),
                         lambda un: bmc.same_prompts(un) + COLOCATED(un))


def shortest_with(model: L.Model, u, hard, max_depth: int = 10) -> bmc.Trace | None:
    """bmc.shortest_stuck_trace with `hard(unrolling)` as constraints rather than preferences:
    the shortest stuck run among those satisfying them."""
    un = bmc.Unrolling(model, u)
    for depth in range(max_depth + 1):
        if depth:
            un.extend()
        for name, bad in un.stuck():
            s = z3.Solver()
            s.set("timeout", 60_000)
            s.add(*un.facts, *u.seq_facts, *hard(un), bad)
            r = s.check()
            assert r != z3.unknown, s.reason_unknown()
            if r == z3.sat:
                return bmc.decode_trace(model, un, s.model(), name, 0.0)
    return None


def assert_seed_shape(steps) -> tuple[int, int]:
    """Two submits; one request (`first`) admitted by a miss into lane 0's non-scratch block and
    finished into the cache; the other (`second`) never admitted (its submit may come at any
    point: which of two waiting requests is admitted is z3's choice, and a solver may pick either
    order). Returns (first, second) request ids."""
    names = [s.action for s in steps]
    assert names.count("submit") == 2
    assert "admit_hit" not in names and "copy_done" not in names
    admits = [s for s in steps if s.action == "admit_miss"]
    assert len(admits) == 1
    submitted = [s.args["r"] for s in steps if s.action == "submit"]
    first = admits[0].args["r"]
    (second,) = [r for r in submitted if r != first]
    assert admits[0].args == {"l": 0, "r": first, "dst": 1 - SCRATCH}
    # the last step other than the second submit caches the run: finish with keep
    last = [s for s in steps if not (s.action == "submit" and s.args["r"] == second)][-1]
    assert last.action == "finish" and last.args == {"l": 0, "keep": True}
    assert names.count("finish") == 1
    assert set(names) <= {"submit", "admit_miss", "prefill", "finish"}
    return first, second


def prompts(steps) -> list[list[int]]:
    return [list(s.args["p"]) for s in steps if s.action == "submit"]


def prompts_of(steps, first: int, second: int) -> tuple[list[int], list[int]]:
    """The prompts of the admitted request and of the one left waiting."""
    by_req = {s.args["r"]: list(s.args["p"]) for s in steps if s.action == "submit"}
    return by_req[first], by_req[second]


def replay(tr: bmc.Trace, consts: g.Consts, core=g) -> g.State:
    s = core.init(consts, ghost=True)
    for st in tr.steps:
        args = {k: seq.seq(v) if k == "p" else v for k, v in st.args.items()}
        step = core.ACTIONS[st.action][0](s, **args)
        assert step.rejected is None, (st, step.rejected)
        s = step.state
    return s


def assert_model_takes_the_entry_over(tr: bmc.Trace, consts: g.Consts) -> None:
    """The seeds' stuck run, replayed on the committed core: every step is the model's too, and
    at its end the waiting request is admitted into lane 0 by taking the cached block over
    (nothing copied: the shared whole chunks are already the block's KV); the state is not
    stuck."""
    first, second = assert_seed_shape(tr.steps)
    end = replay(tr, consts)
    assert g.progress_violations(end) == []
    src = 1 - SCRATCH
    # the hit: whole chunks of the entry's key, a token of the prompt left to compute
    p2, key = list(end.prompt.get(second)), list(end.key[src])
    n = min(len(p2) - 1, len(key)) // consts.C * consts.C
    assert n >= consts.C and p2[:n] == key[:n]
    assert g.admit_miss_guard(end, 0, second, src) == "no_cache_hit"  # the hit is still taken
    step = g.admit_adopt(end, 0, second, src, n)
    assert step.rejected is None, step.rejected
    assert step.state.owner[src] == g.OWNER_LANE and step.state.length[0] == n
    assert [type(e).__name__ for e in step.effects] == ["Admit"]  # no copy
    assert not g.check_invariants(step.state)


# --------------------------------------------------------------------------- (a) z3's BMC


def test_bmc_shortest_stuck_run_same_prompt_twice():
    """Asking for identical prompts as a hard constraint: the shortest such run of the seeds'
    semantics is the seeds' incident, six steps; the model takes it past the stuck state."""
    tr = same_prompt_run()
    assert tr is not None
    assert tr.violated == "idle_lane_admits"
    first, second = assert_seed_shape(tr.steps)
    p1, p2 = prompts(tr.steps)
    assert p1 == p2
    assert len(p1) > C  # a hit needs a token left to compute
    assert len(tr.steps) == 6  # 2 submits, admit, 2 prefill chunks, finish
    f = tr.final
    assert f["busy"] == [False]
    assert f["owner"] == ["SCRATCH", "CACHE"]
    assert f["key"][1] == p1  # cached the whole prompt
    assert f["phase"][first] == "FINISHED" and f["phase"][second] == "WAITING"
    assert f["prompt"][second] == p1
    assert_model_takes_the_entry_over(tr, g.Consts(B=1, K=2, C=C, S=S, PREFIX=True,
                                                   RESERVED=True, SCRATCH=SCRATCH))


def test_bmc_finds_no_stuck_run_of_the_model():
    """The model, asked the same question (same prompts, colocated, up to the same depth as the
    seeds' run): no stuck run."""
    tr = same_prompt_run()
    assert tr is not None
    assert shortest_with(MODEL, seeds_universe(MODEL),
                         lambda un: bmc.same_prompts(un) + COLOCATED(un),
                         max_depth=len(tr.steps)) is None


def test_bmc_prefer_same_prompts_at_minimal_depth():
    """With `prefer`, bmc keeps the minimal depth, which is one step shorter than any
    same-prompt run: a first prompt of exactly one chunk needs a single prefill (it can never be
    a hit itself, `slen(prompt) > C`), and a longer second prompt sharing that chunk is a
    mandatory hit on it. So the preference cannot hold; the prompts share their first chunk."""
    tr = bmc.shortest_stuck_trace(SEEDS_MODEL, seeds_universe(), prefer=[bmc.same_prompts],
                                  hard=[COLOCATED])
    assert tr is not None
    assert tr.violated == "idle_lane_admits"
    first, second = assert_seed_shape(tr.steps)
    assert len(tr.steps) == 5
    p1, p2 = prompts_of(tr.steps, first, second)
    assert p1 != p2 and p1[:C] == p2[:C] and len(p2) > C
    f = tr.final
    assert f["owner"] == ["SCRATCH", "CACHE"] and f["busy"] == [False]
    assert f["key"][1][:C] == p2[:C]
    assert f["phase"][first] == "FINISHED" and f["phase"][second] == "WAITING"
    assert_model_takes_the_entry_over(tr, g.Consts(B=1, K=2, C=C, S=S, PREFIX=True,
                                                   RESERVED=True, SCRATCH=SCRATCH))


# --------------------------------------------------------------------------- (b) BFS search


def test_search_stuck_run_has_the_same_shape():
    tr = search.stuck_run(SEEDS_MODEL, 1, 2, prefix=True, reserved=True, core=seeds_core())
    assert tr is not None and tr.violated == "idle_lane_admits"
    first, second = assert_seed_shape(tr.steps)
    p1, p2 = prompts(tr.steps)
    assert p1 == p2
    assert [s.action for s in tr.steps] == [
        "submit", "submit", "admit_miss", "prefill", "prefill", "finish"]
    bmc_tr = same_prompt_run()
    assert len(bmc_tr.steps) == len(tr.steps)  # both are shortest
    consts = g.Consts(B=1, K=2, C=search.TRACE_CHUNK, S=search.TRACE_SEQ_LEN, PREFIX=True,
                      RESERVED=True, SCRATCH=SCRATCH)
    end = replay(tr, consts, seeds_core())
    assert seeds_core().progress_violations(end) == ["idle_lane_admits"]
    assert end.owner == (g.OWNER_SCRATCH, g.OWNER_CACHE)
    assert end.busy == (False,)
    assert end.phase.get(first) == g.PHASE_FINISHED
    assert end.phase.get(second) == g.PHASE_WAITING
    assert_model_takes_the_entry_over(tr, consts)
    assert search.stuck_run(MODEL, 1, 2, prefix=True, reserved=True) is None


# --------------------------------------------------------------------------- (c), (d) capacity


def progress_statuses(model: L.Model, lanes: int, blocks: int, f: Features) -> dict[str, str]:
    cs = capacity.progress_by_features(model, lanes, blocks)[f]
    return {c.invariant: c.status for c in cs}


def test_the_seeds_need_one_more_block_than_the_model():
    f = Features(True, "reserved")
    assert set(progress_statuses(SEEDS_MODEL, 1, 3, f).values()) == {"proved"}
    assert progress_statuses(SEEDS_MODEL, 1, 2, f)["idle_lane_admits"] == "counterexample"
    assert capacity.min_blocks(SEEDS_MODEL, f, 1, 6) == 3
    assert set(progress_statuses(MODEL, 1, 2, f).values()) == {"proved"}
    assert capacity.min_blocks(MODEL, f, 1, 6) == 2  # the lane's block and the scratch block
    assert search.stuck_run(SEEDS_MODEL, 1, 3, prefix=True, reserved=True,
                            core=seeds_core()) is None


def test_dynamic_scratch_the_seeds_stick_with_one_block_the_model_does_not():
    f = Features(True, "dynamic")
    assert set(progress_statuses(SEEDS_MODEL, 1, 2, f).values()) == {"proved"}
    assert progress_statuses(SEEDS_MODEL, 1, 1, f)["idle_lane_admits"] == "counterexample"
    tr = search.stuck_run(SEEDS_MODEL, 1, 1, prefix=True, reserved=False, core=seeds_core())
    assert tr is not None and tr.violated == "idle_lane_admits"
    # the same incident: the only block is the cache entry the hit must copy from
    assert [s.action for s in tr.steps] == [
        "submit", "submit", "admit_miss", "prefill", "prefill", "finish"]
    p1, p2 = prompts(tr.steps)
    assert p1 == p2
    assert set(progress_statuses(MODEL, 1, 1, f).values()) == {"proved"}
    assert search.stuck_run(MODEL, 1, 1, prefix=True, reserved=False) is None


# --------------------------------------------------------------------------- (e) lifting


def _bfs(lanes: int, blocks: int, f: Features) -> list[tuple[str, dict]]:
    c = g.Consts(B=lanes, K=blocks, C=search.TRACE_CHUNK, S=search.TRACE_SEQ_LEN,
                 PREFIX=f.prefix_cache, RESERVED=f.scratch == "reserved", SCRATCH=0)
    found = search.shortest_stuck_run(c)
    assert found is not None
    return found[0]


def _below(lanes: int, f: Features) -> int:
    from atom_core.config import min_kv_blocks

    return min_kv_blocks(lanes, f.prefix_cache, f.scratch) - 1


@pytest.mark.parametrize("f", [
    pytest.param(f, id=f.name.replace(" ", "-").replace(",", ""),
                 marks=[pytest.mark.slow] if f.prefix_cache else [])
    # the one-block rules of plain models: the BFS here builds plain constants, so the other
    # combinations (hybrid, host, paged tables, preemption) would only repeat these runs
    for f in capacity.COMBINATIONS
    if not (f.hybrid or f.host or f.preempt) and f.tables == 1])
def test_lifting_adds_two_steps_per_lane_and_is_shortest(f):
    """Measured: the run lifted from B=2 is as short as BFS's own shortest run at B=3, and each
    lane adds exactly two steps (a submit and an admission). The prefix-cache cases are slow
    (BFS at B=3 explores ~10 s of states)."""
    assert search.SEARCH_LANES == 2
    k2, k3 = _below(2, f), _below(3, f)
    run2, run3 = _bfs(2, k2, f), _bfs(3, k3, f)
    lifted = search.stuck_run(MODEL, 3, k3, f.prefix_cache, f.scratch == "reserved")
    assert lifted is not None
    assert len(lifted.steps) == len(run2) + 2 == len(run3)
    assert [s.action for s in lifted.steps[:2]] == ["submit", "admit_miss"]
    assert lifted.steps[1].args["l"] == 2  # the extra lane is taken first and stays busy


# --------------------------------------------------------------------------- search moves
@pytest.mark.parametrize("consts", [
    dict(B=2, K=3, PREFIX=True, RESERVED=True),
    dict(B=2, K=4, PREFIX=True, RESERVED=False, T=2, S=4),
    dict(B=2, K=3, PREFIX=False, RESERVED=False, T=2, S=4, PREEMPT=True),
], ids=["one-block", "paged-prefix", "paged-preempt"])
def test_search_moves_skip_only_refused_calls(consts, monkeypatch):
    """The search skips the calls a refusing guard decides from the parameters it reads
    (GUARD_READS): over the first few hundred states of a breadth-first search, it yields exactly
    the moves of trying every call. A guard reading a parameter GUARD_READS misses would make
    some state's lists differ (planted below)."""
    from collections import deque

    c = g.Consts(**{"C": search.TRACE_CHUNK, "S": search.TRACE_SEQ_LEN, "SCRATCH": 0,
                    **consts})
    prompts = search.menu(c.C)

    def every(s: g.State, reads: dict) -> list:
        monkeypatch.setattr(g, "GUARD_READS", reads)
        return list(search.moves(s, c.B + 1, prompts))

    real = g.GUARD_READS
    # planted: admit_miss's dst_reusable said to read only the lane (it reads dst)
    wrong = {**real, "admit_miss": {**real["admit_miss"], "dst_reusable": ("l",)}}
    frontier, seen, states, differ = deque([g.init(c, ghost=False)]), set(), 0, 0
    while frontier and states < 300:
        s = frontier.popleft()
        states += 1
        brute = every(s, {})
        assert every(s, real) == brute
        differ += every(s, wrong) != brute
        for name, args in brute:
            nxt = g.ACTIONS[name][0](s, **args).state
            k = search.state_key(nxt)
            if k not in seen:
                seen.add(k)
                frontier.append(nxt)
    assert states == 300 and differ > 0


# --------------------------------------------------------------------------- the batcher
def _batcher(**kw: Any) -> AtomBatcher:
    cfg = Config(lanes=1, kv_blocks=2, max_seq_len=256, prefill_chunk=64, prefix_cache=True,
                 scratch="reserved", **kw)
    model = {"layers": 3, "global_every": 3} if cfg.sliding_window else {}  # both kinds
    rt = TorchReferenceRuntime.tiny(cfg, seed=0, sliding_window=cfg.sliding_window, **model)
    return AtomBatcher(cfg, rt, ghost=True)


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_the_seeds_configuration_serves_the_same_prompt_twice(hybrid: bool) -> None:
    """The seeds' repro (batch 1, two blocks, prefix cache; the same prompt twice), through
    the batcher on the reference runtime: both answers are the unbatched oracle's and nothing
    leaks. The second request reuses the first's KV in place (`admit_adopt`); a hybrid model's
    evicts the entry and computes its prompt again (its hit would restore the sliding state
    with a copy)."""
    b = _batcher(**({"sliding_window": 32} if hybrid else {}))
    rng = random.Random(3)
    p = [rng.randrange(100) for _ in range(150)]
    first = b.submit(p, 5)
    drive(b)
    assert b.phase(first) == g.PHASE_FINISHED and b.state.owner.count(g.OWNER_CACHE) == 1
    second = b.submit(p, 5)
    drive(b)
    for rid in (first, second):
        r = b.requests[rid]
        assert r.error is None and r.tokens == oracle(b, rid), rid
    assert b.stats.prefix_hit_tokens == (0 if hybrid else 128)  # two chunks, a token left
    assert b.stats.prefill_tokens == (300 if hybrid else 150 + 150 - 128)
    at_rest(b)
