"""The seeds' configuration: one lane, two KV blocks, prefix cache, reserved scratch.

The same prompt submitted twice: the first request runs in lane 0 and is cached when it
finishes; the second now has a mandatory prefix hit (admit_miss is forbidden), but admit_hit needs
a destination other than the cached source, and the only other block is the scratch block. The
lane is idle, a request waits, and nothing can be admitted: `idle_lane_admits` fails. One block
more (K = lanes + 2) and the state is unreachable; with dynamic scratch K = lanes + 1 suffices.
"""

from __future__ import annotations

import functools

import pytest
import z3

from atom_core import seq
from atom_core._generated import core as g
from atom_core.proofs import bmc, capacity, checks, search
from atom_core.proofs.capacity import Features
from atom_core.spec import lang as L
from atom_core.spec.model import MODEL, PD_ACTIONS

C, S = 2, 6  # small chunk and block sizes keep BMC cheap; the shape is the same at any size
SEEDS = {"B": 1, "K": 2, "C": C, "S": S, "T": 1, "PREFIX": True, "RESERVED": True,
         "SCRATCH": 0}
SCRATCH = 0
# The seeds' incident is colocated serving; with PD a decode worker reaches the same stuck state
# by importing the first request instead of prefilling it (test_pd_single_block.py).
COLOCATED = bmc.avoiding(*PD_ACTIONS)


pytestmark = pytest.mark.usefixtures("fresh_z3")


def seeds_universe():
    return checks.bounded_universe(MODEL, 1, 2, SEEDS, concrete_seqs=True)


@functools.cache
def same_prompt_run() -> bmc.Trace | None:
    return shortest_with(MODEL, seeds_universe(), lambda un: bmc.same_prompts(un) + COLOCATED(un))


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


# --------------------------------------------------------------------------- (a) z3's BMC


def test_bmc_shortest_stuck_run_same_prompt_twice():
    """Asking for identical prompts as a hard constraint: the shortest such run is the seeds'
    incident, six steps."""
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


def test_bmc_prefer_same_prompts_at_minimal_depth():
    """With `prefer`, bmc keeps the minimal depth, which is one step shorter than any
    same-prompt run: a first prompt of exactly one chunk needs a single prefill (it can never be
    a hit itself, `slen(prompt) > C`), and a longer second prompt sharing that chunk is a
    mandatory hit on it. So the preference cannot hold; the prompts share their first chunk."""
    tr = bmc.shortest_stuck_trace(MODEL, seeds_universe(), prefer=[bmc.same_prompts],
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


# --------------------------------------------------------------------------- (b) BFS search


def replay(tr: bmc.Trace, consts: g.Consts) -> g.State:
    s = g.init(consts, ghost=True)
    for st in tr.steps:
        args = {k: seq.seq(v) if k == "p" else v for k, v in st.args.items()}
        step = g.ACTIONS[st.action][0](s, **args)
        assert step.rejected is None, (st, step.rejected)
        s = step.state
    return s


def test_search_stuck_run_has_the_same_shape():
    tr = search.stuck_run(MODEL, 1, 2, prefix=True, reserved=True)
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
    end = replay(tr, consts)
    assert g.progress_violations(end) == ["idle_lane_admits"]
    assert end.owner == (g.OWNER_SCRATCH, g.OWNER_CACHE)
    assert end.busy == (False,)
    assert end.phase.get(first) == g.PHASE_FINISHED
    assert end.phase.get(second) == g.PHASE_WAITING


# --------------------------------------------------------------------------- (c), (d) capacity


def progress_statuses(lanes: int, blocks: int, f: Features) -> dict[str, str]:
    cs = capacity.progress_by_features(MODEL, lanes, blocks)[f]
    return {c.invariant: c.status for c in cs}


def test_one_more_block_is_enough():
    f = Features(True, "reserved")
    assert set(progress_statuses(1, 3, f).values()) == {"proved"}
    assert progress_statuses(1, 2, f)["idle_lane_admits"] == "counterexample"
    assert capacity.min_blocks(MODEL, f, 1, 6) == 3
    assert search.stuck_run(MODEL, 1, 3, prefix=True, reserved=True) is None


def test_dynamic_scratch_two_blocks_are_enough_one_is_stuck():
    f = Features(True, "dynamic")
    assert set(progress_statuses(1, 2, f).values()) == {"proved"}
    assert progress_statuses(1, 1, f)["idle_lane_admits"] == "counterexample"
    assert search.stuck_run(MODEL, 1, 2, prefix=True, reserved=False) is None
    tr = search.stuck_run(MODEL, 1, 1, prefix=True, reserved=False)
    assert tr is not None and tr.violated == "idle_lane_admits"
    # the same incident: the only block is the cache entry the hit must copy from
    assert [s.action for s in tr.steps] == [
        "submit", "submit", "admit_miss", "prefill", "prefill", "finish"]
    p1, p2 = prompts(tr.steps)
    assert p1 == p2


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
