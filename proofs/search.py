"""Explicit-state search for the shortest stuck run, over the core generated from the spec.

z3's bounded model checker (`bmc.py`) finds the same runs, but its cost grows steeply with the
number of lanes (a stuck run at B lanes is about 3B steps long); breadth-first search over the
generated core stays fast and, being breadth-first, returns a shortest run. Each run it returns
is then replayed through z3 (`confirm`): every step's guard and update, and the stuck final
state, are checked against the spec itself, so a bug in the generator cannot fake a trace.

Runs are colocated (no PD action): the capacity rules are the same with PD (an import needs a
reusable block like a miss), and a colocated run is the one a reader recognises.

Symmetry: requests are submitted in id order, and of the interchangeable choices only one is
tried: the lowest idle lane, the lowest free block, the lowest waiting request with a given
prompt. They are interchangeable because no guard reads what an idle lane or a free block still
holds from its last use (it is overwritten on reuse), so the states they lead to are the same up
to renaming and lie at the same distance from a stuck state. Shortness relies on that argument;
correctness does not: `confirm` replays every run in z3 against the spec. Prompts come from a
small menu covering what admission can tell apart: a prompt long enough to be a prefix hit and
a one-token prompt that never is.

check-config shows a stuck run for the user's size (`check_config_run`), where the state space
can be far too large to search breadth-first (4 lanes of 2 blocks: 11 minutes, 1.9 GB and
counting). It replays the committed witness when there is one for the size, lifts one from two
lanes when T = 1, and otherwise searches (breadth-first while a shortest run takes few states,
then depth-first) among runs in which no request ends or is preempted first, all within a
`Budget` of states and seconds; past it the verdict is the rule's.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import z3

from atom_core import seq
from atom_core._generated import core as generated
from atom_core.pmap import PMap
from atom_core.proofs import limits
from atom_core.proofs.bmc import Trace
from atom_core.proofs.checks import bounded_universe
from atom_core.proofs.witness import CONSTS, Witness, replay
from atom_core.replay import plain
from atom_core.spec import lang as L
from atom_core.spec.model import PD_ACTIONS

# Small chunk and block sizes keep the runs short and readable; nothing in the model depends on
# their values beyond the axioms.
TRACE_CHUNK, TRACE_SEQ_LEN, TOKEN = 2, 8, 9


def menu(c: int) -> list[seq.TokSeq]:
    return [seq.seq(range(1, c + 2)), seq.seq([100])]


def state_key(s: generated.State, core: types.ModuleType = generated) -> tuple[Any, ...]:
    out = []
    for name in core.STATE_FIELDS:
        v = getattr(s, name)
        out.append(tuple(sorted(v.items())) if isinstance(v, PMap) else v)
    return tuple(out)


def moves(s: generated.State, requests: int, prompts: list[seq.TokSeq],
          skip: tuple[str, ...] = (*PD_ACTIONS, "forget"), *,
          core: types.ModuleType = generated) -> Iterator[tuple[str, dict]]:
    c = s.consts
    submitted = sum(1 for r in range(requests) if s.phase.get(r) != core.PHASE_NONE)
    idle = [ln for ln in range(c.B) if not s.busy[ln]]
    free = [b for b in range(c.K) if s.owner[b] == core.OWNER_FREE]
    empty = [x for x in range(c.H) if s.slot_state[x] == core.SLOTSTATE_EMPTY]
    slots = [x for x in range(c.H) if s.slot_state[x] != core.SLOTSTATE_EMPTY] + empty[:1]
    waiting: dict[Any, int] = {}
    for r in range(requests):
        if s.phase.get(r) == core.PHASE_WAITING:
            waiting.setdefault(s.prompt.get(r), r)
    lanes = [ln for ln in range(c.B) if s.busy[ln]] + idle[:1]
    blocks = [b for b in range(c.K) if s.owner[b] != core.OWNER_FREE] + free[:1]
    reqs = [r for r in range(requests) if s.phase.get(r) != core.PHASE_WAITING]
    reqs += sorted(waiting.values())
    domains: dict[str, Callable[[str], list[Any]]] = {
        "Lane": lambda _p: lanes,
        "Block": lambda _p: blocks,
        "Req": lambda _p: reqs,
        "Slot": lambda _p: slots,
        "Seq": lambda _p: prompts,
        "Bool": lambda _p: [False, True],
        "Int": lambda p: list(range(c.C, c.S + 1, c.C)) if p == "n" else [TOKEN],
    }
    for name, (_fn, guard, params, sorts) in core.ACTIONS.items():
        if name in skip:
            continue
        doms = []
        for p, srt in zip(params, sorts, strict=True):
            if srt.startswith("("):  # a per-lane function parameter: sampled tokens
                doms.append([(TOKEN,) * c.B])
            elif name == "submit" and srt == "Req":
                doms.append([submitted] if submitted < requests else [])
            else:
                doms.append(domains[srt](p))
        # Odometer over the argument domains. A guard that refuses some arguments refuses (or an
        # earlier guard does) every call that agrees with them on the parameters it reads
        # (GUARD_READS), so the odometer advances at the last of those, skipping the rest.
        last = _guard_levels(core, name)
        if not all(doms):
            continue
        pos = [0] * len(doms)
        while True:
            combo = [d[i] for d, i in zip(doms, pos, strict=True)]
            why = guard(s, *combo)
            if why is None:
                yield name, dict(zip(params, combo, strict=True))
            level = last.get(why, len(doms) - 1) if why is not None else len(doms) - 1
            while level >= 0:
                pos[level + 1:] = [0] * (len(doms) - level - 1)
                pos[level] += 1
                if pos[level] < len(doms[level]):
                    break
                level -= 1
            if level < 0:
                break


# Per core (weakly: the mutants tool searches over hundreds of mutant cores): the GUARD_READS
# it was built from, and per action its levels.
_LEVELS: weakref.WeakKeyDictionary[types.ModuleType, tuple[Any, dict[str, dict[str, int]]]] = \
    weakref.WeakKeyDictionary()


def _guard_levels(core: types.ModuleType, name: str) -> dict[str, int]:
    """guard name -> the last of action `name`'s parameters it reads (-1: none). Cached: it
    depends only on the core's GUARD_READS (a test swaps that table: the cache follows it), and
    building it for every state and action was a fifth of the search's time."""
    reads = getattr(core, "GUARD_READS", {})
    cached = _LEVELS.get(core)
    if cached is None or cached[0] is not reads:
        cached = _LEVELS[core] = (reads, {})
    per_action = cached[1]
    if name not in per_action:
        params = core.ACTIONS[name][2]
        per_action[name] = {gn: max((params.index(p) for p in ps), default=-1)
                            for gn, ps in reads.get(name, {}).items()}
    return per_action[name]


# Which actions a run may take: colocated serving, a PD decode worker (every request imported),
# or anything the spec allows (a decode worker that also prefills locally, e.g. as a fallback).
# `forget` is never taken: it only turns an ended request back into an unsubmitted one, a state
# the search already reaches with that request never submitted (up to its id), and it would let
# the fixed set of request ids be resubmitted over and over.
ROLES = {"colocated": PD_ACTIONS + ("forget",),
         "decode": ("admit_miss", "admit_hit", "grow_hit", "copy_done", "prefill", "export",
                    "export_done", "forget"),
         "any": ("forget",)}
# A decode worker admits only by import: whether a local admission could proceed is moot.
IGNORED = {"colocated": (), "decode": ("idle_lane_admits",), "any": ()}


def shortest_stuck_run(consts: generated.Consts, requests: int | None = None,
                       max_depth: int | None = 40, max_states: int = 2_000_000,
                       role: str = "colocated", want: str | None = None,
                       prompts: list[seq.TokSeq] | None = None, *,
                       core: types.ModuleType = generated, budget: Budget | None = None,
                       skip_more: tuple[str, ...] = ()
                       ) -> tuple[list[tuple[str, dict]], str] | None:
    """Breadth-first: the first stuck state found is at minimal depth. `role` restricts the
    actions (ROLES), and `skip_more` further; `want` counts only states that break that
    progress property; `prompts` replaces the menu (e.g. a prompt longer than a block, for
    imports that span blocks); `core`: the generated core to explore (the mutants tool passes a
    mutant's). None means no reachable state is stuck; if `max_depth` (None: no cap) left some
    state unvisited, the search raises `SearchCutOff` instead (and `max_states` a
    RuntimeError). `budget`: check-config's bounds, shared with its other searches
    (`SearchBound` when one runs out)."""
    skip = ROLES[role] + skip_more
    reqs = requests if requests is not None else consts.B + 1
    prompts = prompts if prompts is not None else menu(consts.C)
    start = core.init(consts, ghost=False)
    seen = {state_key(start, core)}
    # (every queued state is in `seen`: the states bound bounds the queue too)
    frontier: deque[tuple[generated.State, tuple, int]] = deque([(start, (), 0)])
    cut = 0  # states at the depth cap with a successor never reached
    while frontier:
        s, path, depth = frontier.popleft()
        if budget is not None:
            budget.visit(depth)
        bad = [p for p in core.progress_violations(s)
               if want in (None, p) and p not in IGNORED[role]]
        if bad:
            return unwind(path), bad[0]
        if max_depth is not None and depth >= max_depth:
            if any(state_key(core.ACTIONS[name][0](s, **args).state, core) not in seen
                   for name, args in moves(s, reqs, prompts, skip, core=core)):
                cut += 1
            continue
        for name, args in moves(s, reqs, prompts, skip, core=core):
            nxt = core.ACTIONS[name][0](s, **args).state
            k = state_key(nxt, core)
            if k not in seen:
                seen.add(k)
                if len(seen) > max_states:
                    raise RuntimeError(f"search exceeded {max_states} states")
                if budget is not None:
                    budget.add()
                frontier.append((nxt, (path, (name, args)), depth + 1))
    if cut:  # "no stuck run" holds only up to the cap: not a verdict
        raise SearchCutOff(f"no stuck run within {max_depth} steps, but the depth cap cut the "
                           f"search off ({cut} states at depth {max_depth} have successors "
                           "never reached): raise max_depth")
    return None


class SearchCutOff(RuntimeError):
    """A breadth-first search found no stuck state but did not visit every reachable state."""


class SearchBound(RuntimeError):
    """check-config's search ran out of its `Budget` before it found a stuck run."""

    def __init__(self, bound: str, states: int, seconds: float) -> None:
        super().__init__(f"the search stopped at its {bound} bound ({states} states, "
                         f"{seconds:.1f} s)")
        self.bound = bound  # "states" or "seconds"
        self.states = states
        self.seconds = seconds


@attrs.define
class Budget:
    """What check-config's searches for a stuck run may spend, all of them together: states
    (each one kept until the search ends, so this bounds its memory too, queue included) and
    seconds of wall clock. `on_progress(budget)` is called a few times a second."""

    max_states: int
    max_seconds: float
    on_progress: Callable[[Budget], None] | None = None
    states: int = 0
    depth: int = 0  # of the state the current search is at
    started: float = attrs.field(factory=time.monotonic)
    _shown: float = attrs.field(init=False, default=0.0)
    _share: float = attrs.field(init=False, default=float("inf"))  # where a share ends (`share`)

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def add(self) -> None:
        """One more state kept."""
        self.states += 1
        if self.states > self.max_states:
            raise SearchBound("states", self.max_states, self.seconds())
        if self.states > self._share:
            raise ShareSpent

    def visit(self, depth: int) -> None:
        """A state whose moves are tried next: the clock is read here, since a state that adds
        no new one still costs the time to try them."""
        self.depth = depth
        now = self.seconds()
        if now > self.max_seconds:
            raise SearchBound("seconds", self.states, now)
        if self.on_progress is not None and now - self._shown >= 0.1:
            self._shown = now
            self.on_progress(self)

    @contextlib.contextmanager
    def share(self, states: int) -> Iterator[None]:
        """Within: at most this many more states (then `ShareSpent`; states, not seconds, so
        that the run shown is the same on a slow machine), and still the whole budget's
        bounds."""
        self._share = self.states + states
        try:
            yield
        finally:
            self._share = float("inf")


class ShareSpent(Exception):
    """A search spent its share of the budget (`Budget.share`): the next one takes over."""


def unwind(path: tuple) -> list[tuple[str, dict]]:
    """The steps of a search path (nested (path, step) pairs), first to last."""
    out = []
    while path:
        path, step = path
        out.append(step)
    return out[::-1]


def confirm(model: L.Model, consts: generated.Consts, run: list[tuple[str, dict]], violated: str,
            requests: int) -> bool:
    """z3 replays the run on the spec: each step's guard holds and its updates are the spec's,
    and the final state breaks the named progress property."""
    cs = {"B": consts.B, "K": consts.K, "C": consts.C, "S": consts.S, "T": consts.T,
          "PREFIX": consts.PREFIX,
          "RESERVED": consts.RESERVED, "SCRATCH": consts.SCRATCH, "HYBRID": consts.HYBRID,
          "HOST": consts.HOST, "H": max(consts.H, 1), "PREEMPT": consts.PREEMPT}
    u = bounded_universe(model, consts.B, consts.K, cs, requests=requests, concrete_seqs=True,
                         slots=max(consts.H, 1))
    env = u.init_state("c0")
    facts = list(u.axioms())
    for i, (name, args) in enumerate(run):
        a = model.get_action(name)
        bound = {p: _z3_value(u, p.sort, args[p.name]) for p in a.params}
        facts.append(u.guard(a, env, bound))
        post = u.post_state(a, env, bound)
        # Name each state: a post-state is a chain of lazy reads of the one before, and
        # naming it after every step keeps each read one step deep (measured: 2.6 times
        # faster than naming every fourth state for an 18-step run). Only what the action
        # updates is new (the rest is the pre-state's names: half the replay time).
        changed = [f for f in model.state if post[f.name] is not env[f.name]]
        env = {**post, **_materialize(u, changed, post, f"c{i}", facts)}
    prop = next(p for p in model.progress if p.name == violated)
    facts += u.refuting(prop.expr, env, {}, symmetric=False)
    s = limits.new_solver(limits.REPLAY)
    s.add(*facts)
    return s.check() == z3.sat


def _materialize(u: Any, fns: list[L.StateFn], env: Any, tag: str,
                 facts: list[Any]) -> dict[str, Any]:
    """Fresh names for the state functions `fns`, equal to their values in `env` (facts). A
    read at a literal point gets the value itself, simplified: in a replayed run most values
    are literals, and the next step then computes on literals (see `TokenWindow`)."""
    fresh = u.fresh_state(tag, fns)
    out: dict[str, Any] = {}
    for f in fns:
        table: dict[tuple[int, ...], Any] = {}
        for pt in itertools.product(*[u.domain[a.name] for a in f.args]):
            v = z3.simplify(env[f.name](*pt))
            facts.append(fresh[f.name](*pt) == v)
            table[tuple(a.get_id() for a in pt)] = v
        out[f.name] = _tabled(table, fresh[f.name])
    return out


def _tabled(table: dict[tuple[int, ...], Any], named: Any) -> Any:
    def fn(*args: Any) -> Any:
        v = table.get(tuple(a.get_id() for a in args))
        return v if v is not None else named(*args)
    return fn


def _z3_value(u: Any, sort: L.Sort, v: Any) -> Any:
    if sort.kind == "fn":
        table = [_z3_value(u, sort.ret, x) for x in v]
        dom = u.domain[sort.args[0].name]
        return lambda x: _select(dom, table, x)
    if sort.kind == "value":
        toks = list(v)
        w = u.tokens
        return w.mk(len(toks), *(toks + [0] * (w.width - len(toks))))
    return u.value(v, sort)


def _select(dom: list[Any], table: list[Any], x: Any) -> Any:
    for d, t in zip(dom, table, strict=True):
        if x.eq(d):  # a literal argument: its entry
            return t
    out = table[-1]
    for d, t in zip(dom[:-1], table[:-1], strict=True):
        out = z3.If(x == d, t, out)
    return out


# Host slots in the searched runs: one is enough to take every host action.
SEARCH_SLOTS = 1

# Lanes up to which the search itself runs; above, runs are lifted (see `lift`).
SEARCH_LANES = 2


def lift(consts: generated.Consts, run: list[tuple[str, dict]], lanes: int, blocks: int, *,
         core: types.ModuleType = generated) -> tuple[generated.Consts, list[tuple[str, dict]]]:
    """A stuck run at (B, K) becomes one at (B + n, K + n): first n extra requests, with a one-token
    prompt that never hits, take the extra lanes with the extra blocks and stay there. The result
    is replayed through z3 like any other run, so this needs no proof of its own."""
    extra = lanes - consts.B
    assert extra >= 0 and blocks - consts.K == extra and consts.T == 1
    first = sum(1 for name, _ in run if name == "submit")
    pre: list[tuple[str, dict]] = []
    renum = {r: r + extra for r in range(first)}
    for i in range(extra):
        pre.append(("submit", {"r": i, "p": menu(consts.C)[1]}))
        pre.append(("admit_miss", {"l": consts.B + i, "r": i, "dst": consts.K + i}))
    body = []
    for name, args in run:
        sorts = dict(zip(core.ACTIONS[name][2], core.ACTIONS[name][3], strict=True))
        body.append((name, {k: (renum[v] if sorts[k] == "Req" else v) for k, v in args.items()}))
    big = core.Consts(B=lanes, K=blocks, C=consts.C, S=consts.S, PREFIX=consts.PREFIX,
                   RESERVED=consts.RESERVED, SCRATCH=consts.SCRATCH, HYBRID=consts.HYBRID,
                   HOST=consts.HOST, H=consts.H)
    return big, pre + body


def find_witness(lanes: int, blocks: int, prefix: bool, reserved: bool,
                 role: str = "colocated", want: str | None = None,
                 hybrid: bool = False, host: bool = False, tables: int = 1,
                 preempt: bool = False, requests: int | None = None,
                 prompts: list[seq.TokSeq] | None = None, *,
                 core: types.ModuleType = generated) -> Witness | None:
    """A stuck run at this size, not yet confirmed (see `witness.replay`): the shortest for up
    to SEARCH_LANES lanes, else one lifted from the largest searched size. `requests`: how many
    requests the runs submit (default one per lane and one more)."""
    # (`lift` is for T = 1, and parks requests in extra lanes, which preemption would free)
    base_b = min(lanes, SEARCH_LANES) if tables == 1 and not preempt else lanes
    base_k = blocks - (lanes - base_b)
    if base_k < 1:
        base_b, base_k = lanes, blocks
    c = core.Consts(B=base_b, K=base_k, C=TRACE_CHUNK, S=TRACE_SEQ_LEN, T=tables, PREFIX=prefix,
                 RESERVED=reserved, SCRATCH=0, HYBRID=hybrid, HOST=host,
                 H=SEARCH_SLOTS if host else 0, PREEMPT=preempt)
    found = shortest_stuck_run(c, requests=requests, role=role, want=want, prompts=prompts,
                               core=core)
    if found is None:
        return None
    run, violated = found
    if base_b != lanes:
        c, run = lift(c, run, lanes, blocks, core=core)
    reqs = requests if requests is not None else lanes + 1
    return Witness({k: getattr(c, k) for k in CONSTS}, reqs, violated,
                   tuple((name, {k: plain(v) for k, v in args.items()}) for name, args in run))


def stuck_run(model: L.Model, lanes: int, blocks: int, prefix: bool, reserved: bool,
              role: str = "colocated", want: str | None = None,
              hybrid: bool = False, host: bool = False, tables: int = 1,
              preempt: bool = False, requests: int | None = None,
              prompts: list[seq.TokSeq] | None = None, *,
              core: types.ModuleType = generated) -> Trace | None:
    """A confirmed stuck run at this size (`find_witness`, then `witness.replay`)."""
    t0 = time.perf_counter()
    w = find_witness(lanes, blocks, prefix, reserved, role, want, hybrid, host, tables, preempt,
                     requests, prompts, core=core)
    if w is None:
        return None
    tr = replay(model, w, {}, avoid=ROLES[role], core=core)
    if isinstance(tr, str):
        raise RuntimeError(f"the stuck run for B={lanes}, K={blocks} does not replay: {tr}")
    return attrs.evolve(tr, seconds=time.perf_counter() - t0)


def first_stuck_run(consts: generated.Consts, *, skip: tuple[str, ...], budget: Budget,
                    core: types.ModuleType = generated
                    ) -> tuple[list[tuple[str, dict]], str] | None:
    """Depth-first, each state's moves in the spec's order of actions (submit, admit, prefill,
    grow, decode, ...): a serving run that takes every block it can comes first, and below the
    capacity rule's minimum it ends stuck within a few dozen states where a breadth-first
    search keeps tens of thousands (B=2, K=5, T=3: 26 states, against 11,741). Not a shortest
    run (`shrink` then drops the steps it does not need). None: no reachable state is stuck
    (with the actions in `skip` left out)."""
    reqs = consts.B + 1
    prompts = menu(consts.C)
    start = core.init(consts, ghost=False)
    if core.progress_violations(start):
        return [], core.progress_violations(start)[0]
    seen = {state_key(start, core)}
    # (the stack holds one state per step of the current path, each in `seen`: bounded too)
    stack = [(start, moves(start, reqs, prompts, skip, core=core))]
    path: list[tuple[str, dict]] = []
    while stack:
        s, todo = stack[-1]
        budget.visit(len(path))
        for name, args in todo:
            nxt = core.ACTIONS[name][0](s, **args).state
            k = state_key(nxt, core)
            if k in seen:
                continue
            seen.add(k)
            budget.add()
            path.append((name, args))
            bad = core.progress_violations(nxt)
            if bad:
                return path, bad[0]
            stack.append((nxt, moves(nxt, reqs, prompts, skip, core=core)))
            break
        else:
            stack.pop()
            if path:
                path.pop()
    return None


def shrink(consts: generated.Consts, run: list[tuple[str, dict]], violated: str, *,
           budget: Budget | None = None,
           core: types.ModuleType = generated) -> list[tuple[str, dict]]:
    """The run without each step it still reaches a state breaking `violated` without (last
    step first: a request submitted but never admitted, a decode more than needed), checked in
    the core. A run with no step left to drop, not a shortest one. Its time counts against
    `budget` (a replay per step: quadratic in the run's length)."""
    for i in range(len(run) - 1, -1, -1):
        if budget is not None:
            budget.visit(i)
        shorter = run[:i] + run[i + 1:]
        end = _replay(consts, shorter, core=core)
        if end is not None and violated in core.progress_violations(end):
            run = shorter
    return run


# The actions that end a request or undo its progress. check-config's search leaves them out
# first: its graph is then several times smaller (B=2, K=3, T=2: 2.4 s instead of 60), a
# depth-first search does not wander through preemptions (B=2, K=4, T=4: a run of 571 steps),
# no committed witness takes one, and a stuck state it reaches is one of the full system all
# the same (being stuck is a property of the state; z3 confirms it). Only when that finds none
# does it take them too.
DETOURS = ("finish", "abort_waiting", "abort_running", "fail", "preempt")
# check-config's breadth-first search, for a shortest run up to SEARCH_LANES lanes, keeps at
# most this many states before the depth-first one takes over: where it finds one it takes a
# few hundred (B=2, K=2, T=2: 715), and past this it takes seconds, for a run a few steps
# shorter than the depth-first one.
SHORTEST_STATES = 1_000


def check_config_run(model: L.Model, lanes: int, blocks: int, prefix: bool, reserved: bool, *,
                     host: bool = False, tables: int = 1, preempt: bool = False,
                     budget: Budget, core: types.ModuleType = generated) -> Trace | None:
    """check-config's stuck run at this size, confirmed (`witness.replay`), within `budget`
    (`SearchBound` when it runs out). In order: the committed witness for this size, where
    there is one (the run `verify` replays, a shortest one); with T = 1, a run at SEARCH_LANES
    lanes lifted to this size (`lift`), itself committed or searched; a search at this size
    (`_search`). None: no reachable state is stuck (below the capacity rule's minimum, a bug).
    Unlike `stuck_run`, the run need not be a shortest one; every one is confirmed in z3."""
    t0 = time.perf_counter()
    c = core.Consts(B=lanes, K=blocks, C=TRACE_CHUNK, S=TRACE_SEQ_LEN, T=tables, PREFIX=prefix,
                    RESERVED=reserved, SCRATCH=0, HYBRID=False, HOST=host,
                    H=SEARCH_SLOTS if host else 0, PREEMPT=preempt)
    for find in (_committed, _lifted, _search):
        found = find(c, budget, core)
        if found is None:
            continue
        big, run, violated = found
        w = Witness({k: getattr(big, k) for k in CONSTS}, lanes + 1, violated,
                    tuple((name, {k: plain(v) for k, v in args.items()}) for name, args in run))
        tr = replay(model, w, {}, avoid=ROLES["colocated"], core=core)
        if isinstance(tr, str):
            if find is _search:
                raise RuntimeError(f"the stuck run for B={lanes}, K={blocks} does not replay: "
                                   f"{tr}")
            continue  # (a stale witness: the search decides)
        return attrs.evolve(tr, seconds=time.perf_counter() - t0)
    return None


Found = tuple[generated.Consts, list[tuple[str, dict]], str]


def _committed(c: generated.Consts, _budget: Budget, core: types.ModuleType) -> Found | None:
    """The committed witness (atom_core/_generated/witnesses.py) for exactly these constants,
    if there is one."""
    from atom_core.proofs.witness import committed
    from atom_core.replay import _args

    want = {k: getattr(c, k) for k in CONSTS}
    tight, _single = committed()
    for w in tight.values():
        if w.consts == want and w.requests <= c.B + 1 and not any(
                name in ROLES["colocated"] for name, _ in w.run):
            try:
                return c, [(name, _args(name, raw, c)) for name, raw in w.run], w.violated
            except (KeyError, ValueError):
                return None  # (stale: the search decides)
    return None


def _lifted(c: generated.Consts, budget: Budget, core: types.ModuleType) -> Found | None:
    """With T = 1 (as `find_witness`), a run at SEARCH_LANES lanes, committed or searched,
    lifted to c's size; None when there is none to lift or it does not end stuck."""
    base_k = c.K - (c.B - SEARCH_LANES)
    if c.T != 1 or c.PREEMPT or c.B <= SEARCH_LANES or base_k < 1:
        return None
    found = _committed(attrs.evolve(c, B=SEARCH_LANES, K=base_k), budget, core) \
        or _search(attrs.evolve(c, B=SEARCH_LANES, K=base_k), budget, core)
    if found is None:
        return None
    base, run, violated = found
    big, run = lift(base, run, c.B, c.K, core=core)
    end = _replay(big, run, core=core)
    if end is None or violated not in core.progress_violations(end):
        return None
    return big, run, violated


def _search(c: generated.Consts, budget: Budget, core: types.ModuleType) -> Found | None:
    """A stuck run at c's size within the budget, first among runs without `DETOURS`: up to
    SEARCH_LANES lanes a shortest one, breadth-first, if that takes few states; else
    depth-first (`first_stuck_run`, then `shrink`); then among all runs, depth-first."""
    colocated = ROLES["colocated"]
    if c.B <= SEARCH_LANES:
        try:
            # (at most half a small budget: the depth-first search needs the rest)
            with budget.share(min(SHORTEST_STATES, budget.max_states // 2)):
                found = shortest_stuck_run(c, max_depth=None, core=core, budget=budget,
                                           skip_more=DETOURS)
        except ShareSpent:
            pass
        else:
            if found is not None:
                return c, *found
            return _depth_first(c, colocated, budget, core)  # (none without detours)
    return (_depth_first(c, colocated + DETOURS, budget, core)
            or _depth_first(c, colocated, budget, core))


def _depth_first(c: generated.Consts, skip: tuple[str, ...], budget: Budget,
                 core: types.ModuleType) -> Found | None:
    found = first_stuck_run(c, skip=skip, budget=budget, core=core)
    if found is None:
        return None
    run, violated = found
    return c, shrink(c, run, violated, budget=budget, core=core), violated


def _replay(c: generated.Consts, run: list[tuple[str, dict]], *,
            core: types.ModuleType = generated) -> generated.State | None:
    s = core.init(c, ghost=True)
    for name, args in run:
        step = core.ACTIONS[name][0](s, **args)
        if step.rejected is not None:
            return None
        s = step.state
    return s


def summary(s: generated.State, core: types.ModuleType = generated) -> dict[str, Any]:
    """What a reader needs to see why a state is stuck: lanes, blocks, waiting requests."""
    d = core.describe_state(s)
    blocks = []
    for b, own in enumerate(d["owner"]):
        if own == "CACHE":
            blocks.append(f"cache{d['key'][b]}")
        elif own == "LANE":
            blocks.append(f"lane {d['owner_lane'][b]}")
        else:
            blocks.append(own.lower())
    lanes = [f"r{d['lane_req'][ln]}" if busy else "idle" for ln, busy in enumerate(d["busy"])]
    waiting = {f"r{r}": d["prompt"][r] for r, ph in d["phase"].items() if ph == "WAITING"}
    return {"lanes": lanes, "blocks": blocks, "waiting": waiting}
