"""Capacity rules for every size: a counting abstraction of the relational model.

The bounded capacity proofs (proofs/capacity.py) decide progress in finite universes up to
B <= 4 lanes; first-order logic over unbounded sorts cannot count, so they cannot say "K blocks
are enough for B lanes" for every B. This module proves each row of the committed capacity
table (atom_core/_generated/capacity.py) sufficient for every B >= 1, every K >= K_min(B, T) and
every T (T = 1, and every T >= 2 for paged tables), in three parts:

1. The abstraction (kind `counting`, checks `abstraction:*`): in every state satisfying the
   invariants (relational ones, proved for all sizes; arithmetic ones, proved for all sizes at
   the capacity table's chunk and block size), z3 proves over unbounded sorts the facts that
   bound each owner kind's count:
     lane-blocks-in-table-slots   a block a lane owns sits in one of that busy lane's table
                                  slots 0 .. nblocks - 1 (slot = start // S);
     table-slots-distinct         two blocks of one lane are in different slots;
     table-within-T               a busy lane's table has 1 .. T slots;
     scratch-is-one-block         a scratch block is the SCRATCH constant, which is one iff
                                  RESERVED;
     quiescent-holds-nothing-else with no copy, store or drain in flight no block is pinned,
                                  draining or spilling.
   So the first two make (lane, slot) an injection from a lane's blocks into its table: with
   `owner` a function (every block has exactly one owner kind), the counts of a quiescent state
   satisfy, for any lane l, with o the other busy lanes (o <= B - 1):
     free + cache + R + held_l + held_others = K,  held_others <= o * T,
     held_l <= nblocks(l) <= T (0 when l is idle),  R = 1 if the scratch is reserved else 0,
   and every cache entry is unpinned, so free + cache is the number of reusable blocks.
   The step from injections to these sums is the elementary one (an injection into a set of n
   elements has at most n elements); everything else is a z3 query. `abstraction-sound-at`
   cross-checks the integer constraints against the counts themselves (z3 sums over every
   block) in small finite universes, so a constraint the relational facts do not give (a
   partition that forgot the scratch block, say) fails there.
2. The rule on the abstraction (checks `count:<rule>`): over unbounded integers B, T, K and the
   counts, z3 proves that K >= K_min(B, T) (the committed rule, read from the generated
   table) leaves a reusable block in the one situation the rule is about: without
   preemption, a lane that is idle or whose table can still grow; with preemption, such a
   lane running alone (or, dynamic scratch, one busy lane beside an idle one: a padding
   target). `tight-abstraction:<rule>` shows, for every B and T, the abstract state one block
   below (explicit counts as terms of B and T) where none is: the counting argument gives no
   smaller rule. (That such a state is reachable is what the committed witnesses replay, for
   B <= 4; the runs generalize, see README, but are not replayed for every B.)
3. Progress on the relational model with that conclusion as a hypothesis (checks named by
   progress property, size "all sizes,<features>,C=2,S=8"): over unbounded lanes, blocks,
   requests and slots, with T left symbolic (T = 1, or T >= 2), every progress property holds
   in every state satisfying the invariants and the capacity fact of part 2 (stated
   relationally: `capacity_fact`). An `unsat` holds for every finite model, i.e. every B and K.
   `capacity-fact-at` checks that relational form against every invariant at small finite
   sizes with K = K_min, so part 3 assumes no more than part 2 proves (the link between the
   integer statement and the relational one is otherwise the reading of the counts above).
   A query z3 does not settle at once is split into cases (a copy in flight, a store, a drain,
   a reusable block, a lane needing a block, ...), each proved on its own; the cases are
   exhaustive by construction (each assumes the negations of those before it). Hybrid
   combinations are not proved here (`BOUNDED_ONLY`, reported as `bounded-only:*`): their rows
   rest on the bounded proofs (B <= 4).

Only `unsat` counts; `unknown` (its budget, proofs/limits.py) fails the run like everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import z3

from atom_core._generated import capacity as committed
from atom_core.proofs import capacity, checks, limits
from atom_core.proofs.checks import Check
from atom_core.proofs.encode import Universe
from atom_core.spec import lang as L
from atom_core.spec import model as M
from atom_core.spec.lang import exists, forall, implies

KIND = "counting"
# The capacity table's chunk and block size: the arithmetic invariants the queries assume are
# proved for all sizes there (`verify`'s arithmetic task at capacity.TABLE_*).
CHUNK, SEQ_LEN = capacity.TABLE_CHUNK, capacity.TABLE_SEQ_LEN
RLIMIT = limits.STEP


# --------------------------------------------------------------------------- the rules
@attrs.frozen
class Rule:
    """One row of the committed table: key (prefix cache, scratch) and preemption."""

    key: tuple[bool, str]
    preempt: bool

    @property
    def name(self) -> str:
        return capacity.RULE_NAMES[self.key] + ("-preemption" if self.preempt else "")

    @property
    def reserved(self) -> bool:
        return self.key[1] == "reserved"

    def k_min(self, b: Any, t: Any, fewer: int = 0) -> Any:
        """The committed K_min(B, T) as a z3 term (the generated `min_kv_blocks`), minus
        `fewer` blocks (a planted bug: the rule one block short)."""
        if self.preempt:
            lone, shared = committed.PREEMPT_BLOCKS[self.key]
            return t + z3.If(b == 1, lone, shared) - fewer
        a, c = b * t, (b - 1) * t + 1 + committed.COPY_BLOCKS[self.key]
        return z3.If(a >= c, a, c) + committed.SCRATCH_BLOCKS[self.key] - fewer


RULES = tuple(Rule(k, p) for p in (False, True) for k in capacity.RULE_NAMES)


# --------------------------------------------------------------------------- part 1
def _slot(u: Universe, st: Any, b: Any) -> Any:
    return st["start"](b) / u.consts["S"]  # (z3 integer division: S is a number here)


def abstraction_facts(u: Universe, st: Any) -> list[tuple[str, Any]]:
    """(name, fact) of part 1, in state `st` of the unbounded universe `u`."""
    blk, lane = u.z3sorts["Block"], u.z3sorts["Lane"]
    b, c, ln = z3.Const("b!abs", blk), z3.Const("c!abs", blk), z3.Const("l!abs", lane)
    own, ol, nb = st["owner"], st["owner_lane"], st["nblocks"]
    lane_o = u.value("LANE", M.Owner)

    def tr(e: L.Expr) -> Any:
        return u.tr(e, st, {})

    return [
        ("lane-blocks-in-table-slots", z3.ForAll([b], z3.Implies(
            own(b) == lane_o, z3.And(st["busy"](ol(b)), _slot(u, st, b) >= 0,
                                     _slot(u, st, b) < nb(ol(b)))))),
        ("table-slots-distinct", z3.ForAll([b, c], z3.Implies(
            z3.And(own(b) == lane_o, own(c) == lane_o, ol(b) == ol(c), b != c),
            _slot(u, st, b) != _slot(u, st, c)))),
        ("table-within-T", z3.ForAll([ln], z3.Implies(
            st["busy"](ln), z3.And(nb(ln) >= 1, nb(ln) <= u.consts["T"])))),
        ("scratch-is-one-block", tr(forall(M.Block, lambda x: implies(
            M.owner(x) == M.Owner.SCRATCH, (x == M.SCRATCH) & M.RESERVED))
            & implies(M.RESERVED, M.owner(M.SCRATCH) == M.Owner.SCRATCH))),
        ("quiescent-holds-nothing-else", tr(implies(M.quiescent(), forall(M.Block, lambda x: (
            ~M.pinned(x) & (M.owner(x) != M.Owner.DRAINING)
            & (M.owner(x) != M.Owner.SPILLING)))))),
    ]


def _assumed(model: L.Model) -> list[L.Named]:
    """The invariants proved for all sizes (relational; arithmetic at CHUNK, SEQ_LEN)."""
    return [i for i in model.invariants if i.kind in ("relational", "arithmetic")]


def all_sizes_universe(model: L.Model, fixed: dict[str, Any] | None = None) -> Universe:
    return Universe(model, None, {"C": CHUNK, "S": SEQ_LEN, **(fixed or {})})


def abstraction_checks(model: L.Model) -> Iterator[Check]:
    """Each fact of part 1 in every state satisfying the invariants, for all sizes. (What this
    module's checks use, `abstraction_facts`, `abstraction`, `capacity_fact` and `RLIMIT`, is
    looked up when they run: a test plants a wrong one and runs `verify`'s task.)"""
    facts, rlimit = abstraction_facts, RLIMIT
    u = all_sizes_universe(model)
    st = u.fresh_state("s")
    hyps = u.axioms() + [u.tr(i.expr, st, {}) for i in _assumed(model)]
    for name, fact in facts(u, st):
        t0 = time.perf_counter()
        status, extra, used = checks.solve(hyps + [z3.Not(fact)], rlimit)
        yield Check(f"abstraction:{name}", "*", KIND, status, time.perf_counter() - t0,
                    f"all sizes,C={CHUNK},S={SEQ_LEN}",
                    str(extra) if status == "unknown" else "", used)


# --------------------------------------------------------------------------- part 2
@attrs.frozen
class Counts:
    """The abstract state (z3 integers) around one distinguished lane l."""

    B: Any
    T: Any
    K: Any
    R: Any  # scratch blocks: 1 reserved, 0 dynamic
    free: Any
    cache: Any  # cache entries (all unpinned: quiescent)
    held_l: Any  # blocks lane l holds
    nb_l: Any  # lane l's table size (when busy)
    l_busy: Any
    others: Any  # busy lanes other than l
    held_o: Any  # blocks they hold
    other_idle: Any  # some lane other than l is idle

    @staticmethod
    def fresh(tag: str) -> Counts:
        i = lambda n: z3.Int(f"{n}!{tag}")  # noqa: E731
        return Counts(i("B"), i("T"), i("K"), i("R"), i("free"), i("cache"), i("held_l"),
                      i("nb_l"), z3.Bool(f"l_busy!{tag}"), i("others"), i("held_o"),
                      z3.Bool(f"other_idle!{tag}"))

    def reusable(self) -> Any:
        return self.free + self.cache


def abstraction(a: Counts, rule: Rule) -> list[Any]:
    """What part 1 gives about the counts of a quiescent state (see the module docstring)."""
    return [a.B >= 1, a.T >= 1 if not rule.preempt else a.T >= 2,  # (axiom: preemption T > 1)
            a.R == (1 if rule.reserved else 0),
            a.free >= 0, a.cache >= 0, a.held_l >= 0, a.held_o >= 0,
            a.free + a.cache + a.R + a.held_l + a.held_o == a.K,  # owner is a function
            a.others >= 0, a.others <= a.B - 1, z3.Implies(a.other_idle, a.others <= a.B - 2),
            a.held_o <= a.others * a.T,  # (lane, slot) injective, slots < nblocks <= T
            z3.If(a.l_busy, z3.And(a.nb_l >= 1, a.nb_l <= a.T, a.held_l <= a.nb_l),
                  a.held_l == 0)]


def situation(a: Counts, rule: Rule) -> Any:
    """Where the rule promises a reusable block (the relational form: `capacity_fact`)."""
    needs = z3.Or(z3.Not(a.l_busy), a.nb_l <= a.T - 1)
    if not rule.preempt:
        return needs
    return z3.And(a.others == 0, z3.Or(needs, z3.And(a.R == 0, a.other_idle)))


def rule_check(rule: Rule) -> Check:
    """`count:<rule>`: K >= K_min(B, T) (the committed table's) leaves a reusable block, for
    every B and T, on the counts `abstraction` allows."""
    a = Counts.fresh("rule")
    t0 = time.perf_counter()
    facts = [*abstraction(a, rule), a.K >= rule.k_min(a.B, a.T), situation(a, rule)]
    status, zm, used = checks.solve(facts + [a.reusable() == 0], RLIMIT)
    detail = ""
    if status == "counterexample":
        detail = "no reusable block at " + ", ".join(
            f"{n}={zm.eval(getattr(a, n), model_completion=True)}"
            for n in ("B", "T", "K", "held_l", "others", "held_o"))
    elif status == "unknown":
        detail = str(zm)
    if status == "proved":  # (and not vacuously: the hypotheses hold somewhere)
        inh, _, more = checks.solve(facts, RLIMIT)
        used += more
        if inh != "counterexample":
            status, detail = "counterexample", "the rule's hypotheses are unsatisfiable"
    return Check(f"count:{rule.name}", "*", KIND, status, time.perf_counter() - t0,
                 "all B>=1,T,K>=K_min", detail, used)


def tight_witness(a: Counts, rule: Rule) -> dict[str, Any]:
    """The abstract state one block below the rule, for every B and T, with no reusable
    block: the distinguished lane's table one block short of full (idle when T = 1), every
    other lane's full; with preemption the lane alone (dynamic scratch, two lanes or more: its
    table full beside an idle lane)."""
    b, t = a.B, a.T
    scratch = {"R": z3.IntVal(1 if rule.reserved else 0)}
    if not rule.preempt:
        grow = t >= 2
        return {**scratch, "l_busy": grow, "nb_l": z3.If(grow, t - 1, 1),
                "held_l": z3.If(grow, t - 1, 0), "others": b - 1, "held_o": (b - 1) * t,
                "other_idle": z3.BoolVal(False)}
    pad = z3.And(not rule.reserved, b >= 2)  # (dynamic: a full table beside an idle lane)
    return {**scratch, "l_busy": z3.BoolVal(True), "nb_l": z3.If(pad, t, t - 1),
            "held_l": z3.If(pad, t, t - 1), "others": z3.IntVal(0), "held_o": z3.IntVal(0),
            "other_idle": pad}


def tight_check(rule: Rule, fewer: int = 1) -> Check:
    """`tight-abstraction:<rule>`: for every B >= 1 and T, the explicit counts of
    `tight_witness` at K_min - `fewer` satisfy the abstraction and the situation with no
    reusable block (so the counting argument gives no smaller rule)."""
    a = Counts.fresh("tight")
    w = tight_witness(a, rule)
    sub = [(getattr(a, n), v) for n, v in w.items()]
    k = rule.k_min(a.B, a.T, fewer)
    claim = z3.And(*[z3.substitute(f, *sub) for f in abstraction(
        attrs.evolve(a, K=k, free=z3.IntVal(0), cache=z3.IntVal(0)), rule)],
        z3.substitute(situation(a, rule), *sub))
    t0 = time.perf_counter()
    domain = [a.B >= 1, a.T >= (2 if rule.preempt else 1)]
    status, _, used = checks.solve([*domain, z3.Not(claim)], RLIMIT)
    return Check(f"tight-abstraction:{rule.name}", "*", KIND, status,
                 time.perf_counter() - t0, f"all B>=1,T,K=K_min-{fewer}",
                 "" if status == "proved" else "the explicit stuck counts fail for some B, T",
                 used)


# --------------------------------------------------------------------------- cross-check
def soundness_at(model: L.Model, rule: Rule, lanes: int, blocks: int) -> Check:
    """`abstraction-sound-at`: in a finite universe, the counts z3 sums over every block of a
    quiescent state satisfying every invariant meet `abstraction` (for each lane as l)."""
    constraints = abstraction
    u = checks.bounded_universe(model, lanes, blocks, {"C": CHUNK, "S": SEQ_LEN, "SCRATCH": 0,
                                                      "RESERVED": rule.reserved,
                                                      "PREEMPT": rule.preempt,
                                                      "PREFIX": rule.key[0]})
    st = u.fresh_state("s")
    facts = u.axioms() + [u.tr(i.expr, st, {}) for i in model.invariants]
    facts.append(u.tr(M.quiescent(), st, {}))
    lanes_z, blocks_z = u.domain["Lane"], u.domain["Block"]
    own, ol, nb, busy = st["owner"], st["owner_lane"], st["nblocks"], st["busy"]

    def n(cond: Callable[[Any], Any]) -> Any:
        return z3.Sum([z3.If(cond(x), 1, 0) for x in blocks_z])

    bad = []
    for ln in lanes_z:
        def mine(x: Any, ln: Any = ln) -> Any:
            return z3.And(own(x) == u.value("LANE", M.Owner), ol(x) == ln)
        a = Counts(u.consts["B"], u.consts["T"], u.consts["K"], z3.IntVal(1 if rule.reserved
                                                                          else 0),
                   n(lambda x: own(x) == u.value("FREE", M.Owner)),
                   n(lambda x: own(x) == u.value("CACHE", M.Owner)), n(mine), nb(ln), busy(ln),
                   z3.Sum([z3.If(z3.And(busy(o), o != ln), 1, 0) for o in lanes_z]),
                   n(lambda x, ln=ln: z3.And(own(x) == u.value("LANE", M.Owner), ol(x) != ln)),
                   z3.Or([z3.And(z3.Not(busy(o)), o != ln) for o in lanes_z]))
        bad.append(z3.Not(z3.And(*constraints(a, rule))))
    t0 = time.perf_counter()
    status, extra, used = checks.solve(facts + [z3.Or(*bad)], limits.BOUNDED, bounded=True)
    return Check(f"abstraction-sound-at:{rule.name}", "*", KIND, status,
                 time.perf_counter() - t0, f"B={lanes},K={blocks}",
                 str(extra) if status == "unknown" else
                 "" if status == "proved" else "a state's counts break the abstraction", used)


def fact_holds_at(model: L.Model, preempt: bool, reserved: bool, lanes: int,
                  tables: int) -> Check:
    """`capacity-fact-at`: part 2's conclusion in its relational form (`capacity_fact`, what
    part 3 assumes) holds in every state satisfying every invariant at one finite size with
    K = K_min (bounded invariants included: proved there by `verify`), so part 3 cannot
    assume more than part 2 proves (a stronger fact fails here with a state)."""
    rule = Rule((False, "reserved" if reserved else "dynamic"), preempt)
    k = z3.simplify(rule.k_min(z3.IntVal(lanes), z3.IntVal(tables))).as_long()
    u = checks.bounded_universe(model, lanes, k, {"C": CHUNK, "S": SEQ_LEN, "SCRATCH": 0,
                                                  "T": tables, "RESERVED": reserved,
                                                  "PREEMPT": preempt})
    st = u.fresh_state("s")
    facts = u.axioms() + [u.tr(i.expr, st, {}) for i in model.invariants]
    fact = capacity_fact(preempt)
    t0 = time.perf_counter()
    status, extra, used = checks.solve(facts + u.refuting(fact, st, {}), limits.BOUNDED,
                                       bounded=True)
    return Check(f"capacity-fact-at:{rule.name}", "*", KIND, status,
                 time.perf_counter() - t0, f"B={lanes},K={k},T={tables}",
                 str(extra) if status == "unknown" else
                 "" if status == "proved" else "a state without the reusable block", used)


# The finite sizes of `fact_holds_at` (lanes, T): within the bounded invariants' cutoff.
FACT_AT = ((2, 1), (3, 1), (2, 2))


# --------------------------------------------------------------------------- part 3
def _others_idle(ln: Any) -> L.Expr:
    return forall(M.Lane, lambda n: implies(n != ln, ~M.busy(n)))


ANY_REUSABLE = exists(M.Block, lambda b: M.reusable(b))


def capacity_fact(preempt: bool) -> L.Expr:
    """Part 2's conclusion, relationally: in a quiescent state, a lane that is idle or whose
    table can grow finds a reusable block (with preemption: when it runs alone, or, dynamic
    scratch, when one busy lane runs beside an idle one)."""
    def needs(ln: Any) -> L.Expr:
        return ~M.busy(ln) | (M.nblocks(ln) < M.T)
    if not preempt:
        return forall(M.Lane, lambda ln: implies(M.quiescent() & needs(ln), ANY_REUSABLE))
    return forall(M.Lane, lambda ln: implies(
        M.quiescent() & _others_idle(ln)
        & (needs(ln) | (~M.RESERVED & exists(M.Lane, lambda n: ~M.busy(n)))), ANY_REUSABLE))


# The case split of a query z3 does not settle whole (each case assumes the negations of the
# ones before it, and the last all of them: exhaustive by construction).
SPLITS: tuple[tuple[str, L.Expr], ...] = (
    ("a copy or load in flight", exists(M.Lane, lambda ln: M.copying(ln))),
    ("a store in flight", exists(M.Slot, lambda h: M.slot_state(h) == M.SlotState.STORING)),
    ("a block draining", exists(M.Block, lambda b: M.owner(b) == M.Owner.DRAINING)),
    ("a lane at its table's end", exists(M.Lane, lambda ln: M.at_table_end(ln))),
    ("a lane prefilling", exists(M.Lane, lambda ln: M.prefilling(ln))),
    ("a lane moving", exists(M.Lane, lambda ln: M.moving(ln))),
    # (so far without counting; from here every busy lane decodes, nothing in flight)
    ("a reusable block", ANY_REUSABLE),
    ("a lane needs a block", exists(M.Lane, lambda ln: M.needs_block(ln))),
    ("an import waits", exists(M.Lane, lambda ln: M.import_waits(ln))),
)


@attrs.frozen
class Case:
    """Feature combinations of the capacity table with T left symbolic: T = 1, or every
    T >= 2 (`paged`). None leaves a feature symbolic too (the case covers it on and off)."""

    prefix_cache: bool | None
    scratch: str
    hybrid: bool = False
    host: bool | None = False
    paged: bool = False
    preempt: bool = False

    @property
    def name(self) -> str:
        if self.prefix_cache is None:  # (host None too: the axioms tie it to the prefix cache)
            return (f"with or without the prefix cache and host tier, {self.scratch} scratch"
                    + (", every T>=2" if self.paged else ", T=1")
                    + (", preemption" if self.preempt else ""))
        return capacity.Features(self.prefix_cache, self.scratch, self.hybrid, bool(self.host),
                                 1, self.preempt).name + (", every T>=2" if self.paged
                                                          else "")

    def fixed(self) -> dict[str, Any]:
        out = {"PREFIX": self.prefix_cache, "RESERVED": self.scratch == "reserved",
               "HYBRID": self.hybrid, "HOST": self.host, "PREEMPT": self.preempt}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def size(self) -> str:
        return f"all sizes,{self.name},C={CHUNK},S={SEQ_LEN}"

    def covers(self, f: capacity.Features) -> bool:
        return ((self.prefix_cache is None or self.prefix_cache == f.prefix_cache)
                and self.scratch == f.scratch and self.hybrid == f.hybrid
                and (self.host is None or self.host == f.host)
                and self.paged == (f.tables > 1) and self.preempt == f.preempt)


# With T = 1 one case per scratch mode covers the prefix cache and the host tier on and off (as
# cheap as one of them: measured 1-2 s); with paged tables such a case is far harder for z3
# (`running_request_advances` unknown after 20M units), so each combination is its own case.
CASES = (tuple(Case(None, s, host=None) for s in capacity.SCRATCH_MODES)
         + tuple(dict.fromkeys(
             Case(f.prefix_cache, f.scratch, f.hybrid, f.host, True, f.preempt)
             for f in capacity.COMBINATIONS if f.tables > 1 and not f.hybrid)))
# Hybrid models are left to the bounded proofs: over unbounded sorts z3 does not settle their
# admissions (a hit's snapshots, a miss that evicts its own hit: `hybrid_evicts_its_hit`)
# within the budget (measured: `idle_lane_admits` with dynamic scratch and
# `running_request_advances` with paged tables still `unknown` after 20M units per case).
BOUNDED_ONLY = tuple(dict.fromkeys(
    Case(f.prefix_cache, f.scratch, f.hybrid, f.host, f.tables > 1, f.preempt)
    for f in capacity.COMBINATIONS if f.hybrid))
WHY_BOUNDED = ("hybrid models: parts 1 and 2 cover them (the abstraction is proved with "
               "HYBRID free, and a hybrid row's rule is its prefix-cache row's), but part 3 "
               "does not: over unbounded sorts z3 does not settle their admissions (a hit's "
               "sliding-window snapshots, a miss evicting its own hit) within the budget, so "
               "their rows are proved sufficient for B <= 4 only")


def progress_checks(model: L.Model, case: Case, fact: L.Expr | None = None,
                    rlimit: int = RLIMIT, props: tuple[str, ...] | None = None
                    ) -> Iterator[Check]:
    """Part 3 for one case: the hypotheses' satisfiability, then each progress property (of
    `props`, default all) alone, and by `SPLITS` when z3 does not settle it within `FIRST`
    units. `fact`: the capacity hypothesis (default `capacity_fact`; a test plants a weaker
    one)."""
    fact = capacity_fact(case.preempt) if fact is None else fact
    yield inhabited(model, case, fact)
    u = all_sizes_universe(model, case.fixed())
    t_ok = (u.consts["T"] > 1) if case.paged else (u.consts["T"] == 1)
    st = u.fresh_state("s")
    facts = (u.axioms() + [u.tr(i.expr, st, {}) for i in _assumed(model)]
             + [u.tr(fact, st, {}), t_ok])
    splits = [(label, u.tr(e, st, {})) for label, e in SPLITS]
    for p in model.progress:
        if props is not None and p.name not in props:
            continue
        goal = u.refuting(p.expr, st, {})
        t0 = time.perf_counter()
        status, used, how = "unknown", 0, ""
        if p.name not in BY_CASES:
            status, _extra, used = checks.solve(facts + goal, min(rlimit, FIRST))
        if status != "proved":  # (a counterexample over unbounded sorts may be spurious too)
            status, how, more = _split(facts + goal, splits, SPLIT_FACTOR * rlimit)
            used += more
        yield Check(p.name, "*", KIND, status, time.perf_counter() - t0, case.size, how, used)


# A property's first try, whole; past it, by cases. (z3 never settles these whole within a
# useful budget: straight to the cases.)
FIRST = 1_000_000
BY_CASES = frozenset({"running_request_advances"})
# Each case's budget, in units of the query budget: a case that proves stops there, so only a
# failing one spends it, and the margin is what keeps a verdict the same in every process (the
# units a query uses vary 5-30% with its process's history: proofs/limits.py). Measured with
# an earlier order of `SPLITS`: one case (preemption, prefix cache, reserved scratch, "a
# reusable block") ran out of 20M units in one run of three.
SPLIT_FACTOR = 2
# The finite universe the hypotheses of part 3 are shown satisfiable in (lanes, blocks, T):
# a model of them there is one of the unbounded hypotheses (z3 finds none over unbounded
# sorts: their quantifiers leave it `unknown`).
INHABITED_AT = (2, 4)


def inhabited(model: L.Model, case: Case, fact: L.Expr) -> Check:
    """`hypotheses-satisfiable` of part 3: the axioms, the invariants it assumes and the
    capacity fact hold together (in the initial state of a small finite universe, with the
    laws instantiated)."""
    lanes, blocks = INHABITED_AT
    u = checks.bounded_universe(model, lanes, blocks, {"C": CHUNK, "S": SEQ_LEN,
                                                      "T": 2 if case.paged else 1,
                                                      **case.fixed()})
    named = checks._at_init(model, u, _assumed(model))
    init = u.init_state("init2")
    more = [("capacity fact", u.tr(fact, init, {}))]
    named += [(f"law instance {i}", f) for i, f in
              enumerate(u.law_instances([f for _, f in named + more]))]
    c = checks.Inhabitation(named, limits.BOUNDED).check(more, case.size)
    return attrs.evolve(c, size=case.size)


def _split(facts: list[Any], splits: list[tuple[str, Any]],
           rlimit: int) -> tuple[str, str, int]:
    used, before = 0, []
    for label, cond in [*splits, ("none of those", None)]:
        case = before + ([cond] if cond is not None else [])
        status, extra, more = checks.solve(facts + case, rlimit)
        used += more
        if status != "proved":
            return status, f"case '{label}': " + (str(extra) if status == "unknown" else
                                                   "a state refutes it"), used
        before.append(z3.Not(cond) if cond is not None else z3.BoolVal(True))
    return "proved", f"by cases ({len(splits) + 1})", used


# --------------------------------------------------------------------------- verify's tasks
def t_rules(model: L.Model) -> list[Check]:
    """Parts 1 and 2: the abstraction's facts, each rule on it, its tightness, and the
    cross-check of the abstraction in small finite universes."""
    out = list(abstraction_checks(model))
    for rule in RULES:
        out.append(rule_check(rule))
        out.append(tight_check(rule))
        out.append(soundness_at(model, rule, *SOUND_AT))
        if rule.key[0]:  # (the fact does not read the prefix cache: once per scratch mode)
            continue
        for lanes, tables in FACT_AT if not rule.preempt else ((1, 2), (2, 2), (3, 2)):
            out.append(fact_holds_at(model, rule.preempt, rule.reserved, lanes, tables))
    return out


# The finite size of the cross-check (every lane as the distinguished one).
SOUND_AT = (3, 5)


def t_progress(model: L.Model, case: Case) -> list[Check]:
    return list(progress_checks(model, case))


def t_scope(model: L.Model) -> list[Check]:
    """What stays bounded: one check per case left to the bounded proofs, saying why (their
    rows are proved for B <= 4 by the capacity checks, not for every B)."""
    return [Check(f"bounded-only:{c.name}", "*", KIND, "proved", 0.0, c.size,
                  WHY_BOUNDED) for c in BOUNDED_ONLY]


def expected(model: L.Model, fn: Callable[..., Any], args: tuple[Any, ...]
             ) -> list[tuple[str, str, str, str]]:
    """The checks a counting task must report (`run.expected_obligations`)."""
    if fn is t_rules:
        at = f"all sizes,C={CHUNK},S={SEQ_LEN}"
        out = [(f"abstraction:{n}", "*", KIND, at) for n in ABSTRACTION_NAMES]
        for r in RULES:
            out += [(f"count:{r.name}", "*", KIND, "all B>=1,T,K>=K_min"),
                    (f"tight-abstraction:{r.name}", "*", KIND, "all B>=1,T,K=K_min-1"),
                    (f"abstraction-sound-at:{r.name}", "*", KIND,
                     f"B={SOUND_AT[0]},K={SOUND_AT[1]}")]
            if r.key[0]:
                continue
            for lanes, tables in FACT_AT if not r.preempt else ((1, 2), (2, 2), (3, 2)):
                k = z3.simplify(r.k_min(z3.IntVal(lanes), z3.IntVal(tables))).as_long()
                out.append((f"capacity-fact-at:{r.name}", "*", KIND,
                            f"B={lanes},K={k},T={tables}"))
        return out
    if fn is t_progress:
        (case,) = args
        return ([(checks.INHABITED, "*", checks.NONVACUITY, case.size)]
                + [(p.name, "*", KIND, case.size) for p in model.progress])
    return [(f"bounded-only:{c.name}", "*", KIND, c.size) for c in BOUNDED_ONLY]


ABSTRACTION_NAMES = ("lane-blocks-in-table-slots", "table-slots-distinct", "table-within-T",
                     "scratch-is-one-block", "quiescent-holds-nothing-else")
