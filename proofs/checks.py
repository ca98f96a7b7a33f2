"""The proof obligations, one z3 query each, each naming its invariant and action.

  base        init & axioms & ~inv                              (per invariant)
  step        invs & axioms & guard(a) & ~inv[post(a)]          (per invariant x action)
  transition  invs & axioms & guard(a) & ~tinv[pre, post(a)]    (per transition inv x action)
  progress    invs & axioms & ~progress                         (per property x size)

Relational invariants are checked in the unbounded universe (all sizes at once); bounded
invariants (counting) and progress in bounded universes, one per size up to the cutoff;
arithmetic invariants (chunk and block positions) for all sizes at a fixed chunk and block size.
A query proves its
obligation only when z3 answers `unsat`; `sat` is a counterexample, anything else (`unknown`,
its resource limit: see proofs/limits.py) is reported as `unknown` and fails the run.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Iterator
from typing import Any

import attrs
import z3

from atom_core.proofs import limits
from atom_core.proofs.encode import Universe
from atom_core.spec import lang as L

# The budgets of the queries below, in z3's resource units (proofs/limits.py).
RLIMIT = limits.STEP


@attrs.frozen
class Check:
    invariant: str
    action: str
    kind: str
    status: str  # proved | counterexample | unknown
    seconds: float
    size: str = ""
    detail: str = ""
    rlimit: int = 0  # z3 resource units the obligation used (all its attempts)

    def as_json(self) -> dict[str, Any]:
        out = {"invariant": self.invariant, "action": self.action, "kind": self.kind,
               "status": self.status, "seconds": round(self.seconds, 4),
               "rlimit": self.rlimit}
        if self.size:
            out["size"] = self.size
        if self.detail:
            out["detail"] = self.detail
        return out


# z3's search over quantified hypotheses swings by orders of magnitude with its random seed
# (the same obligation: 0.01 s under one seed, no answer in 20 s under another) and with how it
# instantiates quantifiers: some obligations that e-matching loses itself in, model-based
# instantiation alone settles at once (decode over paged tables: 0.02 s against no answer in
# 20 s). A query is first tried briefly in a few such ways, then once with the whole budget
# (finding a counterexample can take that long); any `unsat` is a proof and any `sat` a
# counterexample, whichever attempt found it, so only a query every attempt gives up on is
# `unknown`. Every attempt is bounded by resource units, not time, so which attempt decides
# (and whether any does) is the same on every machine.
SEEDS = (0, 1, 2)
# Bounded queries are quantifier-free, and what makes one hard is integer arithmetic (chunk
# and block positions modulo C). z3's older arithmetic solver settles those steadily where the
# default swings with the seed: `finish` x `snapshots_on_chunk_boundaries` at B = 4, K = 8 took
# 1-2 s under every seed with it, against no answer in 30 s under two of three seeds without.
OLD_ARITH = {"arith.solver": 2}
NO_EMATCHING = {"smt.ematching": False}


def _attempts(rlimit: int, bounded: bool = False) -> list[tuple[int, int, dict[str, Any]]]:
    """(random seed, resource budget, solver parameters)."""
    short = max(1, rlimit // 5 if bounded else min(rlimit, limits.SHORT))
    if bounded:
        return ([(seed, short, OLD_ARITH) for seed in SEEDS] + [(SEEDS[0], short, {})]
                + [(SEEDS[0], rlimit, OLD_ARITH)])
    # model-based instantiation alone first. Measured over every step obligation, each way
    # with 2 s: relational 26 s against 53 s with e-matching, arithmetic 1.4 s against 36 s
    # (e-matching gave up on 4 and 12 of them, each proved in under 0.1 s the other way);
    # no obligation slower by more than 0.08 s.
    return ([(SEEDS[0], short, NO_EMATCHING), (SEEDS[0], short, {})]
            + [(seed, short, {}) for seed in SEEDS[1:]] + [(SEEDS[0], rlimit, {})])


def solve(facts: list[Any], rlimit: int = RLIMIT, bounded: bool = False,
          attempts: slice = slice(None)) -> tuple[str, Any, int]:
    """(status, model or the reason it is unknown, resource units used). `bounded`: the facts
    are quantifier-free (finite sorts), see `OLD_ARITH`. `attempts`: only these of `_attempts`
    (`decide_unbounded` asks the first, then the rest)."""
    reason, used = "", 0
    for seed, units, params in _attempts(rlimit, bounded)[attempts]:
        s = limits.new_solver(units, seed, **params)
        # (the counter is the context's, shared by every solver in it: only the difference
        # is this attempt's)
        before = limits.spent(s)
        s.add(*facts)
        r = s.check()
        used += limits.spent(s) - before
        if r == z3.unsat:
            return "proved", None, used
        if r == z3.sat:
            return "counterexample", s.model(), used
        reason = limits.why_unknown(s, units)
        if reason.startswith("wall-clock"):  # the machine, not the query: no use trying more
            break
    return "unknown", reason, used


def _timed(inv: str, action: str, kind: str, facts: list[Any], size: str = "",
           rlimit: int = RLIMIT, bounded: bool = False) -> Check:
    t0 = time.perf_counter()
    status, extra, used = solve(facts, rlimit, bounded)
    detail = "" if status != "unknown" else str(extra)
    return Check(inv, action, kind, status, time.perf_counter() - t0, size, detail, used)


# The check that an obligation's hypotheses can hold together where it is asked (at its size,
# chunk and block size, feature combination): over contradictory hypotheses every query is
# `unsat`, i.e. "proved" (a planted axiom `C > 2` made every progress query at C = 2 pass).
# Asked in the universe and with the very facts the obligations assume, so it cannot drift
# from them; the non-vacuity checks (proofs/nonvacuity.py) add guards and antecedents.
INHABITED = "hypotheses-satisfiable"
NONVACUITY = "nonvacuity"


def named_axioms(model: L.Model, u: Universe) -> list[tuple[str, Any]]:
    """`u.axioms()`, each with the name of the axiom (or law) it translates."""
    laws = model.laws if u.laws else []
    return list(zip([f"axiom {a.name}" for a in model.axioms] + [f"law {x.name}" for x in laws],
                    u.axioms(), strict=True))


@attrs.frozen
class Verdict:
    """A `NamedSolver`'s answer: `status` sat, unsat or unknown (z3's `unknown`, never read as
    either of the others: a check must fail on it); `core`: for unsat, the names of a minimal
    unsat core, in the order they were first added; `reason`: otherwise, why z3 gave no
    unsat (`limits.why_unknown`)."""

    status: str
    core: tuple[str, ...] = ()
    reason: str = ""


class NamedSolver:
    """A solver whose facts are tracked by name (facts of one name share one literal), asked
    under all of them as assumptions, so that an `unsat` names what clashes: a minimal core of
    names. The one way an unsat core is asked for here and in proofs/nonvacuity.py; `prefix`
    names the tracking literals (`prefix!N`)."""

    def __init__(self, rlimit: int, prefix: str = "hyp") -> None:
        self.rlimit, self.prefix = rlimit, prefix
        self.solver = limits.new_solver(rlimit)
        self.solver.set("core.minimize", True)
        self.lits: dict[str, Any] = {}

    def add(self, name: str, fact: Any) -> None:
        if name not in self.lits:
            self.lits[name] = z3.Bool(f"{self.prefix}!{len(self.lits)}")
        self.solver.add(z3.Implies(self.lits[name], fact))

    def check(self) -> Verdict:
        s = self.solver
        r = s.check(*self.lits.values())
        if r == z3.unsat:
            core = {str(c) for c in s.unsat_core()}
            return Verdict("unsat", tuple(n for n, lit in self.lits.items() if str(lit) in core))
        return Verdict(str(r), reason=limits.why_unknown(s, self.rlimit))


class Inhabitation:
    """A solver holding named hypotheses; `check(more, size)` asks whether they hold together
    with `more` (named facts), as a `Check` of kind `nonvacuity`: `proved` when a state
    satisfies them all, a `counterexample` naming a minimal unsat core when not."""

    def __init__(self, named: list[tuple[str, Any]], rlimit: int = RLIMIT) -> None:
        self.named = NamedSolver(rlimit)
        for name, fact in named:
            self.named.add(name, fact)

    def check(self, more: list[tuple[str, Any]], size: str) -> Check:
        s = self.named.solver
        t0, before = time.perf_counter(), limits.spent(s)
        s.push()
        for name, fact in more:
            self.named.add(name, fact)
        v = self.named.check()
        s.pop()
        detail = ""
        if v.status == "unsat":
            detail = ("the hypotheses every obligation here assumes contradict each other, so "
                      "each would be 'proved' vacuously: unsat core " + ", ".join(sorted(v.core)))
        elif v.status == "unknown":
            detail = v.reason
        status = {"sat": "proved", "unsat": "counterexample"}.get(v.status, "unknown")
        return Check(INHABITED, "*", NONVACUITY, status, time.perf_counter() - t0, size,
                     detail, limits.spent(s) - before)


def _at_init(model: L.Model, u: Universe, assume: list[L.Named]) -> list[tuple[str, Any]]:
    """The axioms, and `assume` in the initial state. The initial state is the witness looked
    for: satisfiable, these make the hypotheses over a free state satisfiable too (that state
    is one), and z3 finds it far sooner than a free one (measured: 0.06 s against 10 s for the
    24 combinations at B = 4, K = 8). Unsatisfiable, the axioms clash or an
    invariant fails initially, and either way the core names it."""
    init = u.init_state()
    return named_axioms(model, u) + [(f"invariant {i.name}", u.tr(i.expr, init, {}))
                                     for i in assume]


def inhabited(model: L.Model, u: Universe, assume: list[L.Named], size: str,
              more: list[tuple[str, Any]] | None = None) -> Check:
    """Whether the axioms, `assume` (invariants) and `more` hold together in `u`."""
    return Inhabitation(_at_init(model, u, assume)).check(more or [], size)


def _steps(model: L.Model, u: Universe, assume: list[L.Named],
           actions: Collection[str] | None = None) -> Iterator[
        tuple[L.Action, list[Any], Any, Any, list[Any]]]:
    """Per action (of `actions`, default all): the shared hypotheses (axioms, `assume` in the
    pre-state, the guard; in a finite universe the parameters taken canonically: see
    `Universe.canonical`), the pre-state, the post-state and the parameters' z3 terms."""
    ax = u.axioms()
    pre = u.fresh_state("pre")
    hyps = [u.tr(i.expr, pre, {}) for i in assume]
    for action in model.actions:
        if actions is not None and action.name not in actions:
            continue
        bound = u.params(action, "p")
        g = u.guard(action, pre, bound)
        params = list(bound.values())
        facts = ax + hyps + [g, *u.canonical(params)]
        yield action, facts, pre, u.post_state(action, pre, bound), params


def induction(model: L.Model, invariants: list[L.Named], u: Universe,
              assume: list[L.Named], size: str = "", base: bool = True,
              rlimit: int = RLIMIT,
              actions: Collection[str] | None = None) -> Iterator[Check]:
    """Base and step for each of `invariants` in the finite universe `u`, assuming all of
    `assume` in the pre-state (the queries are quantifier-free: see `solve`); steps of
    `actions` only when given. (Over unbounded sorts: `unbounded`.)"""
    assert u.bounded
    if base or actions is None or actions:
        yield inhabited(model, u, assume, size)
    if base:
        ax = u.axioms()
        init = u.init_state()
        for inv in invariants:
            yield _timed(inv.name, "init", "base", ax + [z3.Not(u.tr(inv.expr, init, {}))],
                         size, rlimit, True)
    if actions is not None and not actions:
        return
    for action, facts, _pre, post, params in _steps(model, u, assume, actions):
        yield from _bounded_steps(action.name, invariants, u, facts, post, params, size,
                                  rlimit)


def unbounded(model: L.Model, invariants: list[L.Named], assume: list[L.Named],
              fixed: dict[str, Any] | None = None, size: str = "", base: bool = True,
              actions: Collection[str] | None = None,
              transition: Collection[str] | None = None, refine: bool = True,
              rlimit: int = RLIMIT) -> list[Check]:
    """Base and step of each of `invariants` (steps of `actions` only, when given) and the
    transition invariants at `transition`'s actions (default none), over unbounded sorts with
    the constants `fixed` (the chunk and block size of the arithmetic proofs), assuming
    `assume` in the pre-state: decided by `decide_unbounded`."""
    fixed = fixed or {}
    u = Universe(model, None, fixed or None)
    queries: list[Query] = []
    if base:
        ax, init = u.axioms(), u.init_state()
        queries += [Query(i.name, "init", "base", ax + [z3.Not(u.tr(i.expr, init, {}))])
                    for i in invariants]
    if actions is None or actions:
        for action, facts, _pre, post, _params in _steps(model, u, assume, actions):
            queries += [Query(i.name, action.name, "step",
                              facts + [z3.Not(u.tr(i.expr, post, {}))]) for i in invariants]
    if transition:
        for action, facts, pre, post, _params in _steps(model, u, assume, transition):
            queries += [Query(t.name, action.name, "transition",
                              facts + [z3.Not(u.tr(t.expr, pre, {}, post))])
                        for t in model.transition_invariants]
    return decide_unbounded(model, queries, assume, fixed, size, refine, rlimit)


@attrs.frozen
class Query:
    invariant: str
    action: str
    kind: str  # base | step | transition
    facts: list[Any]


def decide_unbounded(model: L.Model, queries: list[Query], assume: list[L.Named],
                     fixed: dict[str, Any], size: str, refine: bool = True,
                     rlimit: int = RLIMIT) -> list[Check]:
    """Each query over unbounded sorts, in three rounds: every query's first attempt (most
    proofs need no more); then, for the steps and transitions it left open, counterexamples
    over small finite sorts (`refute_small`: z3 answers a refutable query over unbounded sorts
    `unknown` after its whole budget, where in a finite universe it finds the model in
    milliseconds, and a finite model is a model of the unbounded query); then the rest of the
    attempts for what is still open. `refine=False` skips the second round (a caller to whom
    `unknown` and a counterexample mean the same: the run fails)."""
    out: list[Check | None] = []
    open_: list[tuple[int, float, int]] = []  # (index, seconds, units) after the first
    for q in queries:
        t0 = time.perf_counter()
        status, _extra, used = solve(q.facts, rlimit, attempts=slice(0, 1))
        if status == "unknown":
            open_.append((len(out), time.perf_counter() - t0, used))
            out.append(None)
        else:
            out.append(Check(q.invariant, q.action, q.kind, status, time.perf_counter() - t0,
                             size, rlimit=used))
    found: dict[tuple[str, str, str], str] = {}
    if refine and open_:
        t0 = time.perf_counter()
        found = refute_small(model, [(queries[i].invariant, queries[i].action, queries[i].kind)
                                     for i, _s, _u in open_ if queries[i].kind != "base"],
                             assume, fixed)
        share = (time.perf_counter() - t0) / len(open_)
        open_ = [(i, s + share, used) for i, s, used in open_]
    for i, seconds, used in open_:
        q = queries[i]
        key = (q.invariant, q.action, q.kind)
        if key in found:
            out[i] = Check(*key, "counterexample", seconds, size, found[key], used)
            continue
        t0 = time.perf_counter()
        status, extra, more = solve(q.facts, rlimit, attempts=slice(1, None))
        out[i] = Check(*key, status, seconds + time.perf_counter() - t0, size,
                       str(extra) if status == "unknown" else "", used + more)
    return [c for c in out if c is not None]


def _bounded_steps(action: str, invariants: list[L.Named], u: Universe, facts: list[Any],
                   post: Any, params: list[Any], size: str, rlimit: int) -> Iterator[Check]:
    """One action's step obligations in a finite universe: one solver holds the shared
    hypotheses and each invariant's refutation is pushed and popped (measured: a fifth faster
    than a solver per obligation)."""
    solver = _first_try_solver(facts)
    for inv in invariants:
        t0 = time.perf_counter()
        fails = u.refuting(inv.expr, post, {}, chain=params)
        status, detail, used = _decide(solver, facts, fails, rlimit)
        yield Check(inv.name, action, "step", status, time.perf_counter() - t0, size, detail,
                    used)


def _first_try_solver(facts: list[Any], rlimit: int | None = None) -> Any:
    """A solver holding `facts` for `_decide`'s first tries (`FIRST_TRY`, `OLD_ARITH`)."""
    solver = limits.new_solver(rlimit or FIRST_TRY, **OLD_ARITH)
    solver.add(*facts)
    return solver


def _decide(solver: Any, facts: list[Any], goal: list[Any],
            rlimit: int) -> tuple[str, str, int]:
    """(status, detail, resource units used) of `facts` + `goal` in a finite universe: first in
    `solver` (which holds `facts`) with `goal` pushed and popped; past its first try,
    `solve`'s attempts with the whole budget (each obligation is still decided)."""
    before = limits.spent(solver)
    solver.push()
    solver.add(*goal)
    r = solver.check()
    solver.pop()
    used = limits.spent(solver) - before
    if r == z3.unsat:
        return "proved", "", used
    if r == z3.sat:
        return "counterexample", "", used
    status, extra, more = solve(facts + goal, rlimit, bounded=True)
    return status, str(extra) if status == "unknown" else "", used + more


def relational(model: L.Model, *, base: bool = True, refine: bool = True,
               steps: Collection[str] | None = None,
               transition: Collection[str] | None = None) -> Iterator[Check]:
    """Relational invariants and transition invariants, for all sizes (`unbounded`: an
    obligation its first attempt leaves open is searched for a counterexample over small finite
    sorts before the rest of its attempts).

    `base=False` skips the base cases (they read no action: a mutant of an action has the
    model's), `refine=False` the small-sort search. `steps`, `transition`: only the step
    (transition) obligations of these actions (`verify` runs each action as its own task);
    default every action."""
    rel = [i for i in model.invariants if i.kind == "relational"]
    every = [a.name for a in model.actions]
    yield from unbounded(model, rel, rel, base=base, actions=steps,
                         transition=every if transition is None else transition,
                         refine=refine)


# The finite sizes `refute_small` searches: (lanes, blocks, requests, slots).
SMALL = ((1, 2, 2, 1), (2, 2, 2, 1), (2, 3, 3, 1), (2, 3, 3, 2))


def _small_steps(model: L.Model, action: str, assume: list[L.Named] | None = None,
                 fixed: dict[str, Any] | None = None) -> Iterator[
        tuple[str, Universe, list[Any], Any, Any]]:
    """`action`'s step hypotheses in each universe of `SMALL`: (size label, universe, facts,
    pre-state, post-state), assuming `assume` (default every relational invariant), with the
    constants `fixed`."""
    if assume is None:
        assume = [i for i in model.invariants if i.kind == "relational"]
    for lanes, blocks, reqs, slots in SMALL:
        u = Universe(model, {"Lane": lanes, "Block": blocks, "Req": reqs, "Slot": slots},
                     fixed or None, ctx_name=f"_small_{lanes}_{blocks}")
        size = f"B={lanes}, K={blocks}, {reqs} requests, {slots} host slots"
        for _a, facts, pre, post, _params in _steps(model, u, assume, (action,)):
            yield size, u, facts, pre, post


def refute_small(model: L.Model, wanted: list[tuple[str, str, str]], assume: list[L.Named],
                 fixed: dict[str, Any] | None = None,
                 rlimit: int = RLIMIT) -> dict[tuple[str, str, str], str]:
    """Of the step and transition obligations `wanted` ((invariant, action, kind)), those with
    a counterexample over the small finite sorts of `SMALL` (with the constants `fixed`),
    each with the size it was found at. Per action and size one query asks for any of them
    broken (the disjunction of their negations); each one a model breaks is taken out and the
    rest asked again. Finite sorts make every quantifier a finite conjunction, so z3 decides
    these queries, and a model found is a model of the unbounded query too; finding none
    proves nothing."""
    found: dict[tuple[str, str, str], str] = {}
    exprs = {i.name: i.expr for i in model.invariants}
    trans = {t.name: t.expr for t in model.transition_invariants}
    for action in dict.fromkeys(a for _i, a, _k in wanted):
        left = [(i, k) for i, a, k in wanted if a == action]
        for size, u, facts, pre, post in _small_steps(model, action, assume, fixed):
            goals = {(i, k): (u.tr(exprs[i], post, {}) if k == "step"
                              else u.tr(trans[i], pre, {}, post)) for i, k in left}
            while left:
                query = facts + [z3.Or(*[z3.Not(goals[g]) for g in left])]
                status, zm, _ = solve(query + u.law_instances(query), rlimit)
                if status != "counterexample":
                    break
                broken = [g for g in left
                          if z3.is_false(zm.eval(goals[g], model_completion=True))]
                for i, k in broken:
                    found[(i, action, k)] = f"found with {size}"
                left = [g for g in left if g not in broken]
            if not left:
                break
    return found


def sizes(max_lanes: int, max_blocks: int) -> Iterator[tuple[int, int]]:
    yield from itertools.product(range(1, max_lanes + 1), range(1, max_blocks + 1))


# Host cache slots in the bounded universes: two, so that a store and a load can be in flight
# at once (the relational proofs cover every number).
SLOTS = 2


def bounded_universe(model: L.Model, lanes: int, blocks: int, consts: dict[str, Any] | None = None,
                     requests: int | None = None, concrete_seqs: bool = False,
                     slots: int = SLOTS) -> Universe:
    req = requests if requests is not None else lanes + 1
    return Universe(model, {"Lane": lanes, "Block": blocks, "Req": req, "Slot": slots}, consts,
                    ctx_name=f"_{lanes}_{blocks}", concrete_seqs=concrete_seqs)


# The concrete chunk and block sizes of the bounded universes: the typical eager artifact.
# Nothing in the model depends on their values beyond the axioms, so any would do.
CHUNK, SEQ_LEN = 128, 4096
# An eager block (T = 1, max_seq_len positions) need not be a multiple of the chunk: the last
# chunk of a prompt is padded (as optimum-rbln does). The relational proofs cover every size; the
# bounded invariants and the capacity rules are checked again at such a block size, for the eager
# feature combinations, up to a smaller cutoff (`verify`'s "unaligned" part).
UNALIGNED_SEQ_LEN = 4000
UNALIGNED_LANES, UNALIGNED_BLOCKS = 2, 5
# Bounded queries are decidable (finite sorts, no quantifiers), so a hard one only needs a
# larger budget (paged tables' per-lane counts at B = 4, K = 8).
BOUNDED_RLIMIT = limits.BOUNDED
# A bounded step or progress query's first try, in the solver shared by its action's (its
# case's) obligations. Most need a small part of it; a rare one runs long under one search
# order and settles at once under another (measured: 11.4 s in the shared solver, 1.4 s in
# `solve`'s attempts), so a try past this goes to those attempts, with their full budget.
FIRST_TRY = limits.FIRST_TRY
# The query for all of a size's feature combinations at once (`progress`): past this, each
# combination is decided on its own.
TOGETHER = limits.TOGETHER


def bounded(model: L.Model, max_lanes: int, max_blocks: int, *, base: bool = True,
            kinds: tuple[str, ...] = ("bounded",)) -> Iterator[Check]:
    """Bounded invariants (of `kinds`) for every size up to the cutoff, assuming every
    invariant. (The mutation runs add "arithmetic": a counterexample at a small size is
    decisive where the query over unbounded sorts may end `unknown`.)"""
    bnd = [i for i in model.invariants if i.kind in kinds]
    for b, k in sizes(max_lanes, max_blocks):
        u = bounded_universe(model, b, k, {"C": CHUNK, "S": SEQ_LEN})
        yield from induction(model, bnd, u, model.invariants, size=f"B={b},K={k}", base=base,
                             rlimit=BOUNDED_RLIMIT)


def arithmetic(model: L.Model, seq_len: int = SEQ_LEN, *, base: bool = True,
               actions: Collection[str] | None = None, chunk: int = CHUNK) -> Iterator[Check]:
    """Arithmetic invariants (`Model.invariant(arithmetic=True)`) for all sizes, over unbounded
    sorts like the relational ones, with the chunk and block size fixed (`chunk`, `seq_len`) so
    that positions modulo C and multiples of S are linear; assuming the relational invariants
    and themselves. `actions`: only these actions' steps."""
    rel = [i for i in model.invariants if i.kind == "relational"]
    ar = [i for i in model.invariants if i.kind == "arithmetic"]
    yield from unbounded(model, ar, rel + ar, {"C": chunk, "S": seq_len},
                         arithmetic_label(chunk, seq_len), base=base, actions=actions)


def arithmetic_label(chunk: int, seq_len: int) -> str:
    """The size label of the arithmetic obligations at this chunk and block size."""
    return f"all sizes,C={chunk},S={seq_len}"


def bounded_label(lanes: int, blocks: int, seq_len: int | None = SEQ_LEN,
                  chunk: int | None = CHUNK) -> str:
    """The size label of the bounded obligations at one size (the chunk and block size named
    when they are not the default `CHUNK`, `SEQ_LEN`; None: every chunk and block size)."""
    if seq_len is None or chunk is None:
        return f"B={lanes},K={blocks},any C,S"
    return f"B={lanes},K={blocks}" + ("" if (seq_len, chunk) == (SEQ_LEN, CHUNK) else
                                      f",S={seq_len}" if chunk == CHUNK else
                                      f",C={chunk},S={seq_len}")


def progress(model: L.Model, u: Universe, cases: dict[str, dict[str, Any]]) -> Iterator[
        tuple[str, Check]]:
    """Each progress property holds in every state satisfying the (proved) invariants, in each
    case (some config constants fixed by name). The invariants are translated once per
    universe. First one query for every case and property together: no state of any case
    refutes any property decides all of them (measured: 2.3 s against 11.5 s for the 24 cases
    of B = 4, K = 8, 0.2 s against 2.9 s at B = 2, K = 5). Otherwise, per case, in a solver
    of its own holding the case's hypotheses, all its properties at once, then each alone,
    pushed and popped, which names the ones that fail."""
    ax = u.axioms()
    st = u.fresh_state("s")
    hyps = [u.tr(i.expr, st, {}) for i in model.invariants]
    goals = [(p.name, u.refuting(p.expr, st, {})) for p in model.progress]
    any_goal = z3.Or([z3.And(*goal) for _name, goal in goals])
    assumes = {case: [u.consts[n] == u.value(v, _const_sort(model, n)) for n, v in fixed.items()]
               for case, fixed in cases.items()}
    inh = Inhabitation(_at_init(model, u, model.invariants))
    for case, fixed in cases.items():
        yield case, inh.check([(f"constant {n} = {v}", eq) for (n, v), eq in
                               zip(fixed.items(), assumes[case], strict=True)], case)
    if len(cases) > 1:
        t0 = time.perf_counter()
        solver = _first_try_solver([*ax, *hyps, z3.Or([z3.And(*a) for a in assumes.values()])],
                                   TOGETHER)
        before = limits.spent(solver)
        solver.add(any_goal)
        if solver.check() == z3.unsat:
            n = len(cases) * len(goals)
            share = (time.perf_counter() - t0) / n
            units = (limits.spent(solver) - before) // n
            for case in cases:
                for name, _goal in goals:
                    yield case, Check(name, "*", "progress", "proved", share, case,
                                      rlimit=units)
            return
    for case, assume in assumes.items():
        facts = [*ax, *hyps, *assume]
        solver = _first_try_solver(facts)  # (the older arithmetic: 1.0-1.7 times faster here)
        t0, before = time.perf_counter(), limits.spent(solver)
        solver.push()
        solver.add(any_goal)
        together = solver.check()
        solver.pop()
        if together == z3.unsat:
            share = (time.perf_counter() - t0) / len(goals)
            units = (limits.spent(solver) - before) // len(goals)
            for name, _goal in goals:
                yield case, Check(name, "*", "progress", "proved", share, case, rlimit=units)
            continue
        for name, goal in goals:
            t0 = time.perf_counter()
            status, detail, used = _decide(solver, facts, goal, RLIMIT)
            yield case, Check(name, "*", "progress", status, time.perf_counter() - t0,
                              case, detail, used)


def _const_sort(model: L.Model, name: str) -> L.Sort:
    return next(c.sort for c in model.consts if c.name == name)
