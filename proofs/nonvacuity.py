"""Non-vacuity: the hypotheses of the proofs can hold, so an `unsat` means something.

Every induction and progress query assumes the axioms, the laws and the invariants; a step
query assumes an action's guard, a progress property is an implication. If those hypotheses
contradict each other, every query over them is `unsat`, i.e. "proved", and nothing notices
(a law `slen(push(q, t)) == slen(q) + 2` beside `push_adds_a_token` made all of `relational`
pass). So `verify` also asks, in a small finite universe per feature combination the capacity
proofs use (`capacity.COMBINATIONS`), for a state where they all hold:

  consistent  axioms + laws + every invariant                   (per combination)
  guard       the above + an action's guard, some parameters    (per action x combination)
  antecedent  the above + a progress property's hypothesis      (per property x combination)

`sat` is the check passing (a witness state exists: status `proved`); `unsat` in every universe
tried fails, naming a minimal unsat core (which axiom, law, invariant or guard conjunct clash);
`unknown` fails too.

A guard (or antecedent) may be dead by configuration: a host-tier action without `HOST`,
`grow` with one block per table. Which ones are is declared in the spec, not inferred: each
action (and progress property) says where it can fire with `live_when(...)` (an expression
over constants, default everywhere), and both sides are checked: satisfiable in every
combination where `live_when` holds, unsatisfiable in every other (the detail names the unsat
core). So a guard made dead where it should fire fails even when a configuration constant is
to blame (a gate `~HYBRID` planted in `admit_hit` reads only constants, and an unsat core
alone would take it for a feature), and so does a host action left live without a host tier;
an action or antecedent dead in every combination fails too.

The laws are quantified over values; these queries stay quantifier-free (finite sorts expand
the rest) by instantiating each law on the ground applications of its trigger
(`Universe.law_instances`) and at one fresh point, so a law that contradicts another law or an
axiom shows up even where no state term triggers it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import z3

from atom_core.proofs import capacity, limits
from atom_core.proofs.checks import CHUNK, SEQ_LEN, Check, NamedSolver, bounded_universe
from atom_core.proofs.encode import Env, Universe
from atom_core.spec import lang as L

KIND = "nonvacuity"
CONSISTENT = "axioms+laws+invariants-satisfiable"
GUARD = "guard-satisfiable"
ANTECEDENT = "antecedent-satisfiable"
LIVE = "action-live-somewhere"
ANTECEDENT_LIVE = "antecedent-live-somewhere"
DEAD = "dead by configuration"
# (lanes, blocks, requests, host slots): the first universe has a witness for nearly every
# query; an unexpected unsat there is asked again in the second before it fails.
SIZES = ((2, 4, 3, 2), (3, 7, 4, 2))
RLIMIT = limits.NONVACUITY  # resource units per query (proofs/limits.py)


def flags(f: capacity.Features) -> dict[str, Any]:
    """The constants a combination fixes (the sizes come from the universe)."""
    return {k: v for k, v in f.consts(0, 0).items() if k not in ("B", "K", "C", "S", "SCRATCH")}


# --------------------------------------------------------------------------- the spec, read
def antecedent(p: L.Named) -> tuple[list[L.Var], L.Expr] | None:
    """A progress property `forall xs. hyp -> concl` as (xs, hyp); None if it is not an
    implication (it then has no hypothesis to be vacuous about)."""
    e, vs = p.expr, []
    while isinstance(e, L.Quant) and e.kind == "forall":
        vs.append(e.var)
        e = e.body
    if not isinstance(e, L.Implies):
        return None
    return vs, e.hyp


def _conjuncts(e: L.Expr) -> list[L.Expr]:
    return [c for a in e.args for c in _conjuncts(a)] if isinstance(e, L.And) else [e]


# --------------------------------------------------------------------------- queries
@attrs.frozen
class Query:
    """One fact of a query, named for the unsat core (`gate`: it reads only constants)."""

    name: str
    fact: Any
    gate: bool = False


class Space:
    """One finite universe: the axioms, laws and invariants translated once; guards and
    antecedents translated on first use."""

    def __init__(self, model: L.Model, size: tuple[int, int, int, int],
                 chunk: int = CHUNK, seq_len: int = SEQ_LEN) -> None:
        lanes, blocks, reqs, slots = size
        self.model = model
        self.label = f"B={lanes}, K={blocks}, {reqs} requests, {slots} host slots" + (
            "" if (chunk, seq_len) == (CHUNK, SEQ_LEN) else f", C={chunk}, S={seq_len}")
        self.u: Universe = bounded_universe(model, lanes, blocks,
                                            {"C": chunk, "S": seq_len, "SCRATCH": 0},
                                            requests=reqs, slots=slots)
        u = self.u
        self.st: Env = u.fresh_state("nv")
        self.base = [Query(f"axiom {a.name}", u.tr(a.expr, {}, {})) for a in model.axioms]
        self.base += [Query(f"law {name}", fact) for name, fact in self._law_points()]
        self.invs = [Query(f"invariant {i.name}", u.tr(i.expr, self.st, {}))
                     for i in model.invariants]
        self._instances: dict[int, tuple[Query, list[Query]]] = {}
        self._memo: dict[str, list[Query]] = {}

    def _law_points(self) -> Iterator[tuple[str, Any]]:
        """Each law at one fresh point (its variables as fresh constants)."""
        for law in self.model.laws:
            e, vs = law.expr, []
            while isinstance(e, L.Quant) and e.kind == "forall":
                vs.append(e.var)
                e = e.body
            xs = [z3.FreshConst(self.u.zsort(v.sort), v.name) for v in vs]
            yield law.name, self.u.tr(e, {}, dict(zip(vs, xs, strict=True)))

    def feature(self, f: capacity.Features) -> list[Query]:
        sorts = {c.name: c.sort for c in self.model.consts}
        return [Query(f"constant {n} = {v}", self.u.consts[n] == self.u.value(v, sorts[n]))
                for n, v in flags(f).items() if n in sorts]

    def holds(self, cond: L.Expr, f: capacity.Features) -> bool:
        """Whether a condition over constants (a `live_when`) holds in combination `f`."""
        sorts = {c.name: c.sort for c in self.model.consts}
        fixed = [(self.u.consts[n], self.u.value(v, sorts[n])) for n, v in flags(f).items()
                 if n in sorts]
        e = z3.simplify(z3.substitute(self.u.tr(cond, {}, {}), *fixed))
        if not (z3.is_true(e) or z3.is_false(e)):
            raise ValueError(f"live_when {L.show(cond)} reads a constant a feature "
                             f"combination does not fix (left: {e}): use only "
                             f"{', '.join(sorted(flags(f)))}")
        return z3.is_true(e)

    def guard(self, action: L.Action) -> list[Query]:
        """The guard's conjuncts in the state, over fresh parameters."""
        key = f"guard {action.name}"
        if key not in self._memo:
            bound = self.u.params(action, "nv")
            self._memo[key] = [Query(f"guard {action.name}.{g}", self.u.tr(e, self.st, bound),
                                     L.reads_only_constants(e)) for g, e in action.guards]
        return self._memo[key]

    def antecedent(self, p: L.Named) -> list[Query]:
        """A progress property's hypothesis, existentially closed: its conjuncts that read no
        bound variable on their own (so a gate such as `~PREEMPT` is named as one)."""
        key = f"antecedent {p.name}"
        if key not in self._memo:
            a = antecedent(p)
            assert a is not None
            vs, hyp = a
            parts = _conjuncts(hyp)
            closed = [c for c in parts if L.reads_only_constants(c)]
            rest = [c for c in parts if not L.reads_only_constants(c)]
            e: L.Expr = L.And(*rest) if rest else L.TRUE
            for v in reversed(vs):
                e = L.Quant("exists", v, e)
            self._memo[key] = (
                [Query(f"antecedent of {p.name} (configuration part {i})",
                       self.u.tr(c, self.st, {}), True) for i, c in enumerate(closed)]
                + [Query(f"antecedent of {p.name}", self.u.tr(e, self.st, {}))])
        return self._memo[key]

    def instances(self, facts: list[Query]) -> list[Query]:
        """Law instances on the ground terms of `facts`, each named by its law."""
        out: list[Query] = []
        for q in facts:  # (per fact, memoized: the invariants' are the same every query)
            if id(q) not in self._instances:
                self._instances[id(q)] = (q, [
                    Query(f"law {law.name}", i) for law in self.model.laws
                    for i in self.u.law_instances([q.fact], [law])])
            out += self._instances[id(q)][1]
        return out


@attrs.frozen
class Answer:
    status: str  # sat | unsat | unknown
    core: tuple[Query, ...] = ()  # unsat: a minimal unsat core
    reason: str = ""  # unknown: z3's reason
    held: tuple[int, ...] = ()  # sat: the probes (see `Session.check`) the witness satisfies

    def core_names(self) -> str:
        return ", ".join(q.name for q in self.core)


class Session:
    """An incremental solver holding `hyps` (and their law instances); `check` pushes more
    facts, asks, and pops. A query that comes back `unsat` is asked again on its own, each fact
    named, for the unsat core that says what clashes."""

    def __init__(self, sp: Space, hyps: list[Query], rlimit: int = RLIMIT) -> None:
        self.sp, self.hyps, self.rlimit = sp, hyps + sp.instances(hyps), rlimit
        self.solver = limits.new_solver(rlimit)
        self.solver.add(*[q.fact for q in self.hyps])

    def check(self, extra: list[Query], probes: tuple[list[Query], ...] = (),
              core: bool = True) -> Answer:
        """Whether the hypotheses and `extra` can hold together; if so, which of `probes`
        (lists of facts) the witness found also satisfies."""
        more = extra + self.sp.instances(extra)
        s = self.solver
        s.push()
        s.add(*[q.fact for q in more])
        r = s.check()
        reason = limits.why_unknown(s, self.rlimit) if r == z3.unknown else ""
        held: tuple[int, ...] = ()
        if r == z3.sat and probes:
            m = s.model()
            held = tuple(i for i, facts in enumerate(probes) if all(
                z3.is_true(m.eval(q.fact, model_completion=True)) for q in facts))
        s.pop()
        if r == z3.sat:
            return Answer("sat", held=held)
        if r == z3.unknown:
            return Answer("unknown", reason=reason)
        return unsat_core(self.hyps + more, self.rlimit) if core else Answer("unsat")


def unsat_core(facts: list[Query], rlimit: int) -> Answer:
    """A minimal unsat core of `facts` (facts of one name count as one)."""
    named = NamedSolver(rlimit, "nv")
    first: dict[str, Query] = {}
    for q in facts:
        first.setdefault(q.name, q)
        named.add(q.name, q.fact)
    v = named.check()
    if v.status != "unsat":  # (the same facts were unsat a moment ago: z3 gave up)
        return Answer("unknown", reason=f"no unsat core: {v.reason or v.status}")
    return Answer("unsat", tuple(first[n] for n in v.core))


# --------------------------------------------------------------------------- the checks
@attrs.frozen
class Item:
    """What one check asks to be satisfiable beside the hypotheses."""

    check: str  # GUARD | ANTECEDENT
    name: str  # the action or property
    facts: Callable[[Space], list[Query]]
    live_when: L.Expr  # the configurations where it must be satisfiable (dead in the others)


def items(model: L.Model) -> list[Item]:
    out = [Item(GUARD, a.name, lambda sp, a=a: sp.guard(a), a.live_when)
           for a in model.actions]
    out += [Item(ANTECEDENT, p.name, lambda sp, p=p: sp.antecedent(p), p.live_when)
            for p in model.progress if antecedent(p) is not None]
    return out


def label(f: capacity.Features, chunk: int = CHUNK, seq_len: int = SEQ_LEN) -> str:
    """A check's size: the combination, and the chunk and block size when not the default."""
    return f.name + ("" if (chunk, seq_len) == (CHUNK, SEQ_LEN) else f",C={chunk},S={seq_len}")


def check(model: L.Model, features: tuple[capacity.Features, ...], chunk: int = CHUNK,
          seq_len: int = SEQ_LEN) -> list[Check]:
    """The non-vacuity checks for these combinations, each a `Check` of kind `nonvacuity`.

    Each guard and antecedent is asked where the spec says it can hold (its `live_when`) and
    where it says it cannot: `proved` when satisfiable in the first (a witness state exists) and
    unsatisfiable in the second (dead by configuration: the detail names the unsat core); a
    guard dead where it should fire, or satisfiable where it should be dead, is a
    `counterexample`. A witness found for one item settles every other item it satisfies too.
    An expected-dead item's unsat core is reused in every later combination that agrees on the
    constants it names (the same facts are unsat there)."""
    out: list[Check] = []
    spaces: list[Space] = []
    todo = items(model)
    cores: dict[tuple[int, str, str], tuple[Query, ...]] = {}  # (space, check, name) -> core

    def space(i: int) -> Space:
        while len(spaces) <= i:
            spaces.append(Space(model, SIZES[len(spaces)], chunk, seq_len))
        return spaces[i]

    for f in features:
        where_f = label(f, chunk, seq_len)
        t0 = time.perf_counter()
        sessions = [Session(space(0), space(0).base + space(0).feature(f) + space(0).invs)]
        live = {(it.check, it.name): space(0).holds(it.live_when, f) for it in todo}
        done: dict[tuple[str, str], tuple[str, str]] = {}  # (check, name) -> status, detail
        spent: dict[tuple[str, str], float] = {}  # seconds (0: settled by another's witness)
        status, detail = "counterexample", ""
        for i in range(len(SIZES)):
            if i >= len(sessions):
                sp = space(i)
                sessions.append(Session(sp, sp.base + sp.feature(f) + sp.invs))
            sess = sessions[i]
            where = f"with {sess.sp.label}"
            ans = sess.check([])
            if ans.status != "unsat":
                status = "proved" if ans.status == "sat" else "unknown"
                detail = f"witness {where}" if ans.status == "sat" else f"{ans.reason} ({where})"
                break
            detail = f"unsat core ({where}): {ans.core_names()}"
        out.append(Check(CONSISTENT, "*", KIND, status, time.perf_counter() - t0, where_f,
                         detail))
        if status != "proved":  # every item is vacuous too; the consistency check says why
            why = "unsatisfiable" if status == "counterexample" else "undecided"
            for it in todo:
                out.append(Check(it.check, it.name, KIND, status, 0.0, where_f,
                                 f"not asked: the hypotheses alone are {why} ({CONSISTENT})"))
            continue

        def witnessed(it: Item, where: str,
                      live: dict[tuple[str, str], bool] = live) -> tuple[str, str]:
            if live[(it.check, it.name)]:
                return ("proved", f"witness {where}")
            return ("counterexample",
                    f"satisfiable ({where}) where the spec says it is dead: its live_when "
                    f"({L.show(it.live_when)}) is false in this combination; "
                    f"correct live_when, or add the guard conjunct that rules it out")

        for i, sess in enumerate(sessions):
            sp = sess.sp
            where = f"with {sp.label}"
            feats = {q.name for q in sp.feature(f)}
            pending = [it for it in todo if (it.check, it.name) not in done]
            for it in list(pending):  # dead for a reason found in an earlier combination
                core = cores.get((i, it.check, it.name))
                if (core is not None and not live[(it.check, it.name)]
                        and all(q.name in feats for q in core
                                if q.name.startswith("constant "))):
                    done[(it.check, it.name)] = ("proved", f"{DEAD} ({where}): "
                                                 + ", ".join(q.name for q in core))
                    pending.remove(it)
            while pending:
                it = pending.pop(0)
                probes = tuple(x.facts(sp) for x in pending)
                t1 = time.perf_counter()
                ans = sess.check(it.facts(sp), probes)
                spent[(it.check, it.name)] = (spent.get((it.check, it.name), 0.0)
                                              + time.perf_counter() - t1)
                if ans.status == "sat":
                    done[(it.check, it.name)] = witnessed(it, where)
                    for j in ans.held:  # (the same state and parameters witness these too)
                        done[(pending[j].check, pending[j].name)] = witnessed(pending[j], where)
                    pending = [x for j, x in enumerate(pending) if j not in ans.held]
                elif ans.status == "unknown":
                    done[(it.check, it.name)] = ("unknown", f"{ans.reason} ({where})")
                elif not live[(it.check, it.name)]:
                    cores[(i, it.check, it.name)] = ans.core
                    done[(it.check, it.name)] = ("proved",
                                                 f"{DEAD} ({where}): {ans.core_names()}")
                elif i == len(SIZES) - 1:
                    done[(it.check, it.name)] = (
                        "counterexample",
                        f"unsatisfiable ({where}) where the spec says it can hold (live_when "
                        f"{L.show(it.live_when)}): unsat core {ans.core_names()}")
            if all((it.check, it.name) in done for it in todo):
                break
            if i + 1 < len(SIZES):  # an unexpected unsat: ask again in a larger universe
                sp = space(i + 1)
                sessions.append(Session(sp, sp.base + sp.feature(f) + sp.invs))
        for it in todo:
            status, detail = done[(it.check, it.name)]
            out.append(Check(it.check, it.name, KIND, status,
                             spent.get((it.check, it.name), 0.0), where_f, detail))
    return out


def live_somewhere(model: L.Model, checks: list[Check],
                   features: tuple[capacity.Features, ...]) -> list[Check]:
    """Per action and antecedent: it has a witness in some combination (an action that can
    fire nowhere makes every proof about it vacuous, whatever its `live_when` says). Read off
    `check`'s results over all of `features`."""
    names = {f.name for f in features}
    out = []
    for what, kind, names_of in ((LIVE, GUARD, [a.name for a in model.actions]),
                                 (ANTECEDENT_LIVE, ANTECEDENT,
                                  [p.name for p in model.progress if antecedent(p) is not None])):
        for name in names_of:
            mine = [c for c in checks if c.invariant == kind and c.action == name
                    and c.size in names]
            live = sorted({c.size for c in mine if c.detail.startswith("witness")})
            dead = sorted({c.size for c in mine if c.detail.startswith(DEAD)})
            detail = (f"no witness in any of {len(names)} combinations checked"
                      if not live else
                      f"dead by configuration in {len(dead)} of {len(names)} combinations"
                      if dead else "")
            out.append(Check(what, name, KIND, "proved" if live else "counterexample",
                             0.0, detail=detail))
    return out
