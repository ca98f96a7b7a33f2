"""Mutation testing of the spec: plant systematic bugs, report which layer catches each one.

    python -m atom_core.proofs.mutants                 # every mutant, layers cheapest-first
    python -m atom_core.proofs.mutants --all-layers    # every layer on every mutant
    python -m atom_core.proofs.mutants --only 'drop-guard:admit_hit.*' --json out.json

Mutants are enumerated from the model, so a new action, guard or update gets its mutants
without a change here. Families:

  guard     drop one named guard conjunct of an action
  update    drop one assignment of an action
  swap      give one assignment of a flag, lane, block, request, slot or enum another value the
            action can name (the negation, another parameter or state term, another member)
  pin       skip a pin or an unpin (`copying`, `copy_src`, `transfer`, `transfer_req`): drop
            the assignment or give it a wrong value (the negation, or another term of the sort)
  free      free twice: an action that frees a block also frees another block it can name
  capacity  a capacity rule one block short (the proved table with one offset lowered)

Layers, cheapest first; a mutant stops at the first layer that kills it unless `--all-layers`:

  z3          the induction proofs (relational, arithmetic and bounded invariants, transition
              invariants)
              restricted to the mutated action: the other actions' obligations do not change
  bmc         explicit-state bounded model checking over the generated mutant core: every state
              reachable at one lane (two lanes up to a state bound), each feature combination at
              the mutant's capacity, checked against the invariants, transition invariants and
              progress (a stuck run is replayed in z3 against the mutant spec); and capacity
              tightness: a stuck run must exist one block below the minimum
  hypothesis  the core state machine (atom_core.testing.machine) over the mutant core, with
              a bounded, derandomized settings object (a mutant of a host-tier action over
              configurations with the host tier, paged tables included: only they take it; a
              mutant of hybrid state or guards over the hybrid tier too)
  simulation  atom_core.simulate over the mutant core, in a fresh subprocess that installs the
              mutant as atom_core._generated.core before importing it

A kill counts only where the unmutated model passes the same check (the control), so a spec
that is itself mid-edit does not inflate the kill rate. z3 `unknown` is never a kill and never a
pass: the layer reports `unknown`. Every mutant no layer kills needs an entry in EXPLAINED
("equivalent: ..." or "gap: ..."); one without is flagged and fails the run.

`--source-report` prints instead what mutmut (`make mutants-source`) left under mutants/: the
generic source mutants of the generated core, the policy and the adapter, per file.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fnmatch
import functools
import importlib.util
import json
import multiprocessing
import shutil
import subprocess
import sys
import time
import types
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from atom_core.spec import lang as L

LAYERS = ("z3", "bmc", "hypothesis", "simulation")
FAMILIES = ("guard", "update", "swap", "pin", "free", "capacity")
# State that pins a block (a copy's source, a PD transfer's block) and who holds the pin.
PIN_FNS = ("copying", "copy_src", "transfer", "transfer_req")
CONTROL = "control"  # the unmutated model, run through every layer like a mutant

# Small sizes keep the explicit-state search exhaustive at one lane: chunk 2, block 4 tokens
# (a 3-token prompt prefills in two chunks, is a prefix-hit candidate and reaches the block end).
BMC_CHUNK, BMC_SEQ_LEN = 2, 4
Z3_BOUNDED_SIZE = (2, 4)  # lanes, blocks: bounded invariants per size (as tests/test_proofs.py)

# One simulated run per entry (seed = index): colocated and PD, with and without the prefix
# cache, each at the proved minimum of blocks, where a planted bug has the least slack to hide
# in. The other dimensions (scratch, lanes, hybrid, faults) come from the seed.
SIM_RUNS: tuple[dict[str, Any], ...] = (
    {"mode": "colocated", "prefix_cache": True, "extra_blocks": 0},
    {"mode": "colocated", "prefix_cache": False, "extra_blocks": 0},
    {"mode": "pd", "prefix_cache": True, "extra_blocks": 0},
    {"mode": "pd", "prefix_cache": False, "extra_blocks": 0},
)

# Mutants no layer kills, each with the reason. "equivalent": no behaviour (or no observable
# state) changes; "gap": a real bug that nothing in the project catches yet. Written from a run
# (`make mutants`), never assumed: a listed mutant that some layer kills is reported as stale.
EXPLAINED: dict[str, str] = {
    # Ghost writes that no guard or invariant reads before something else overwrites them
    # (ghost state never changes what the executable core does). tests/test_proofs.py lists the
    # same drops in UNCAUGHT_UPDATES; the writes are tripwires for guard mutants.
    "drop-update:decode.junk":
        "equivalent: with the guard intact, padding rows only scribble on the scratch block or "
        "a free block, whose junk no invariant reads before an admission resets it",
    "drop-update:fail.junk":
        "equivalent: the failed lane's block is freed (or drains, and transfer_end marks it) in "
        "the same step; admission resets junk before it is read again",
    "drop-update:fail.local_junk":
        "equivalent: the failed lane is idle after the step and admission resets its slot",
    "drop-update:discard.junk":
        "equivalent: the discarded block is free or the scratch block afterwards; admission "
        "resets junk before it is read",
    "drop-update:transfer_fail.junk":
        "equivalent: the failed transfer's blocks (every block of its lane's table) are freed "
        "in the same step",
    "drop-update:transfer_end.junk":
        "equivalent: the drained blocks (b and every other block draining for the request) are "
        "freed in the same step",
    "drop-update:admit_import.local_holds":
        "equivalent: an importing lane's slot belongs to the transfer (the invariant exempts "
        "importing lanes) until import_done writes it",
    "drop-update:admit_hit.local_holds":
        "equivalent: a copying lane takes no step that reads its slot (prefill and snapshot "
        "wait for the copy, the invariant exempts copying lanes) and copy_done overwrites it",
    "drop-update:admit_hit.local_junk":
        "equivalent: as admit_hit's local_holds: copy_done sets local_junk before any read",
    "drop-update:snapshot.lane_snap_junk":
        "equivalent: under the invariants (a computing hybrid lane's slot holds its own state) "
        "and the next_boundary guard the new flag equals the old one; the write is a tripwire "
        "for mutants of snapshot's guards",
    "drop-update:admit_host_hit.local_holds":
        "equivalent: only hybrid invariants read a lane's slot, and hybrid models have no host "
        "cache (axiom hybrid_without_host_cache)",
    "drop-update:admit_host_hit.local_junk":
        "equivalent: as admit_host_hit's local_holds: no hybrid model takes a host hit",
    # Ghost flags set to the other value: the same writes as the drops above (a junk flag
    # cleared where it should be set, or set on a slot copy_done overwrites), equivalent for
    # the same reasons.
    "swap-value:fail.junk=False":
        "equivalent: as drop-update:fail.junk (the block is freed in the same step)",
    "swap-value:fail.local_junk=False":
        "equivalent: as drop-update:fail.local_junk (admission resets the slot)",
    "swap-value:discard.junk=False":
        "equivalent: as drop-update:discard.junk",
    "swap-value:admit_hit.local_junk=True":
        "equivalent: no step reads a copying lane's slot and copy_done sets local_junk",
    "swap-value:admit_host_hit.local_junk=True":
        "equivalent: as drop-update:admit_host_hit.local_junk (no hybrid host tier)",
    "drop-update:grow_host_hit.snap_upto":
        "equivalent: grow_host_hit needs the host tier, which hybrid models do not have (axiom "
        "hybrid_without_host_cache), and without them every lane_snap and snap_upto is 0 "
        "(snapshots_need_hybrid): the full block's boundary is already the 0 it would get",
    # Another term that the invariants make equal to the right one. A lane that grows is
    # busy, so its tail is its own block (lane_block_owned) and its request runs on it
    # (busy_lane_runs_its_request); an importing lane's tail is pinned for its request
    # (moving_lane_has_transfer, transfer_names_lane_request).
    "swap-value:grow.owner=owner(tail(l))":
        "equivalent: a growing lane computes, so it is busy and owner(tail(l)) is LANE "
        "(lane_block_owned)",
    "swap-value:grow.owner_lane=owner_lane(tail(l))":
        "equivalent: a growing lane is busy, so owner_lane(tail(l)) is l (lane_block_owned)",
    "swap-value:grow.owner_lane=req_lane(lane_req(l))":
        "equivalent: a growing lane is busy, so req_lane(lane_req(l)) is l "
        "(busy_lane_runs_its_request)",
    "swap-value:grow_hit.owner=owner(tail(l))":
        "equivalent: as swap-value:grow.owner=owner(tail(l)) (the lane prefills: it is busy)",
    "swap-value:grow_hit.owner_lane=owner_lane(tail(l))":
        "equivalent: as swap-value:grow.owner_lane=owner_lane(tail(l))",
    "swap-value:grow_hit.owner_lane=req_lane(lane_req(l))":
        "equivalent: as swap-value:grow.owner_lane=req_lane(lane_req(l))",
    "swap-value:grow_host_hit.owner=owner(tail(l))":
        "equivalent: as swap-value:grow.owner=owner(tail(l)) (the lane prefills: it is busy)",
    "swap-value:grow_host_hit.owner_lane=owner_lane(tail(l))":
        "equivalent: as swap-value:grow.owner_lane=owner_lane(tail(l))",
    "swap-value:grow_host_hit.owner_lane=req_lane(lane_req(l))":
        "equivalent: as swap-value:grow.owner_lane=req_lane(lane_req(l))",
    "swap-value:import_grow.owner=owner(tail(l))":
        "equivalent: an importing lane is busy, so owner(tail(l)) is LANE (lane_block_owned)",
    "swap-value:import_grow.owner_lane=owner_lane(tail(l))":
        "equivalent: an importing lane is busy, so owner_lane(tail(l)) is l (lane_block_owned)",
    "swap-value:import_grow.owner_lane=req_lane(lane_req(l))":
        "equivalent: an importing lane is busy, so req_lane(lane_req(l)) is l "
        "(busy_lane_runs_its_request)",
    "wrong-value:import_grow.transfer_req=transfer_req(tail(l))":
        "equivalent: an importing lane's tail is in its transfer (moving_lane_has_transfer), "
        "for its request (transfer_names_lane_request): transfer_req(tail(l)) is lane_req(l)",
    # Not equivalent: behaviour changes, but no stated property covers it.
    "drop-update:host_evict.slot_state":
        "gap: an eviction that keeps the host entry is safe (nothing is freed) but the slot is "
        "never reusable, so the host tier stops taking spills once full; spills are optional "
        "and no property says the tier makes room (a performance test would notice)",
}


# --------------------------------------------------------------------------- results


@attrs.frozen
class LayerResult:
    layer: str
    status: str  # killed | survived | unknown | unavailable | error | skipped
    detail: str = ""
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "status": self.status, "detail": self.detail,
                "seconds": round(self.seconds, 3)}


@attrs.frozen
class MutantResult:
    id: str
    family: str
    description: str
    layers: tuple[LayerResult, ...]
    seconds: float

    @property
    def killed_by(self) -> str | None:
        return next((r.layer for r in self.layers if r.status == "killed"), None)

    @property
    def status(self) -> str:
        """killed > error > unknown > survived: an error or an unknown is never a pass."""
        seen = {r.status for r in self.layers}
        for s in ("killed", "error", "unknown"):
            if s in seen:
                return s
        return "survived"

    @property
    def explanation(self) -> str | None:
        return EXPLAINED.get(self.id)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "family": self.family, "description": self.description,
                "status": self.status, "killed_by": self.killed_by,
                "explanation": self.explanation,
                "unexplained": (self.id != CONTROL and self.status in ("survived", "unknown")
                                and not self.explanation),
                "layers": [r.as_json() for r in self.layers],
                "seconds": round(self.seconds, 3)}


@attrs.frozen
class Options:
    layers: tuple[str, ...] = LAYERS
    all_layers: bool = False
    examples: int = 200  # hypothesis examples per mutant
    bmc_states: int = 50_000  # one lane: enough to exhaust every combination of the model
    bmc_wide_states: int = 5_000  # two lanes: a bounded prefix of breadth-first order
    sim_runs: int = len(SIM_RUNS)
    sim_steps: int = 100
    sim_timeout: float = 600.0


# --------------------------------------------------------------------------- mutants


@attrs.frozen
class Mutant:
    id: str
    family: str
    description: str
    actions: tuple[str, ...]  # the actions it changes (z3 re-checks only these)
    change: Callable[[L.Model], L.Model] = attrs.field(eq=False, repr=False)
    offsets: dict[tuple[bool, str], int] | None = None  # a capacity table replacing the proved


def only(model: L.Model, actions: tuple[str, ...]) -> L.Model:
    """`model` with only `actions`: a mutant of an action changes only that action's step and
    transition obligations (the restriction tests/test_proofs.py cross-checks)."""
    m = model.copy()
    m.actions = [a for a in m.actions if a.name in actions]
    return m


def edit_updates(model: L.Model, action: str,
                 edit: Callable[[list[L.Update]], list[L.Update]]) -> L.Model:
    """A copy of `model` whose `action` has the update list `edit` returns (Model.copy copies
    each action's lists, so the original is untouched)."""
    m = model.copy()
    a = m.get_action(action)
    a.updates = edit(list(a.updates))
    return m


def drop_update(model: L.Model, action: str, index: int) -> L.Model:
    return edit_updates(model, action, lambda us: us[:index] + us[index + 1:])


def with_value(model: L.Model, action: str, index: int, value: L.Expr) -> L.Model:
    """`action`'s index-th update assigns `value` instead (Model has with_guard for guards but
    nothing for an update's value)."""
    def edit(us: list[L.Update]) -> list[L.Update]:
        u = us[index]
        us[index] = L.Update(u.fn, u.args, value, u.whole)
        return us
    return edit_updates(model, action, edit)


def with_extra_update(model: L.Model, action: str, index: int, extra: L.Update) -> L.Model:
    """`extra` runs just before the index-th update, so where both write the same point the
    original still wins (later point updates win): the mutant differs only elsewhere."""
    return edit_updates(model, action, lambda us: us[:index] + [extra] + us[index:])


def same(a: Any, b: Any) -> bool:
    """Structural equality of terms (`==` on expressions builds a term)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, L.App):
        return (a.fn is b.fn and a.post == b.post and len(a.args) == len(b.args)
                and all(same(x, y) for x, y in zip(a.args, b.args, strict=True)))
    if isinstance(a, L.Lit):
        return a.sort is b.sort and a.value == b.value
    return False


def children(e: L.Expr) -> Iterator[L.Expr]:
    """Direct subterms, read from the node's slots (so new node types need nothing here)."""
    for cls in type(e).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name in ("sort", "fn", "var", "action"):
                continue
            v = getattr(e, name, None)
            vs = v.values() if isinstance(v, dict) else v if isinstance(v, tuple) else (v,)
            yield from (x for x in vs if isinstance(x, L.Expr))


def mentions(e: L.Expr, member: str) -> bool:
    if isinstance(e, L.Lit) and e.value == member:
        return True
    return any(mentions(c, member) for c in children(e))


def show(e: Any) -> str:
    """A short rendering for mutant ids and descriptions."""
    if isinstance(e, L.Var):
        return e.name
    if isinstance(e, L.Const):
        return e.name
    if isinstance(e, L.Lit):
        return str(e.value)
    if isinstance(e, L.App):
        return f"{e.fn.name}({', '.join(show(a) for a in e.args)})"
    if isinstance(e, L.Not):
        return f"~{show(e.arg)}"
    return f"<{type(e).__name__.lower()}>"


def terms(model: L.Model, action: L.Action, sort: L.Sort) -> list[L.Expr]:
    """Terms of `sort` an action can name: a parameter, or a state function applied to one,
    once or twice (`table(req_lane(r))`). The slips a planted bug makes: a wrong but
    well-typed argument. Ghost state is left out: no executable update may read it."""
    unary = [f for f in model.state if not f.ghost and len(f.args) == 1]
    level = [p for p in action.params if p.sort.kind != "fn"]
    found: list[L.Expr] = list(level)
    for _ in range(2):
        level = [f(t) for t in level for f in unary if f.args[0] is t.sort]
        found += level
    return [t for t in found if t.sort is sort]


def update_name(a: L.Action, i: int) -> str:
    """`fn`, or `fn#k` when the action assigns fn more than once."""
    u = a.updates[i]
    same_fn = [j for j, v in enumerate(a.updates) if v.fn is u.fn]
    return u.fn.name if len(same_fn) == 1 else f"{u.fn.name}#{same_fn.index(i) + 1}"


def target(u: L.Update) -> str:
    return f"{u.fn.name}" if u.whole else show(u.fn(*u.args))


def guard_drops(model: L.Model) -> Iterator[Mutant]:
    for a in model.actions:
        for g, _ in a.guards:
            yield Mutant(f"drop-guard:{a.name}.{g}", "guard", f"{a.name} without guard {g}",
                         (a.name,), functools.partial(L.Model.without_guard, action=a.name,
                                                      guard=g))


def update_drops(model: L.Model) -> Iterator[Mutant]:
    for a in model.actions:
        for i, u in enumerate(a.updates):
            family = "pin" if u.fn.name in PIN_FNS else "update"
            yield Mutant(f"drop-update:{a.name}.{update_name(a, i)}", family,
                         f"{a.name} skips {target(u)} := {show(u.value)}", (a.name,),
                         functools.partial(drop_update, action=a.name, index=i))


def wrong_values(model: L.Model, a: L.Action, u: L.Update) -> list[L.Expr]:
    """Wrong values for a pin update: the negation of a flag, another term of an index sort."""
    if u.value.sort is L.BOOL:
        flipped = (L.Lit(not u.value.value, L.BOOL) if isinstance(u.value, L.Lit)
                   else L.Not(u.value))
        return [flipped]
    if u.whole:
        return []
    lhs = u.fn(*u.args)
    return [t for t in terms(model, a, u.value.sort) if not same(t, u.value) and not same(t, lhs)]


def value_mutants(model: L.Model, prefix: str, family: str,
                  chosen: Callable[[L.Update], bool]) -> Iterator[Mutant]:
    """Each `chosen` update given each of its wrong values."""
    for a in model.actions:
        for i, u in enumerate(a.updates):
            if not chosen(u):
                continue
            for v in wrong_values(model, a, u):
                yield Mutant(f"{prefix}:{a.name}.{update_name(a, i)}={show(v)}", family,
                             f"{a.name} sets {target(u)} := {show(v)} (not {show(u.value)})",
                             (a.name,), functools.partial(with_value, action=a.name, index=i,
                                                          value=v))


def pin_values(model: L.Model) -> Iterator[Mutant]:
    return value_mutants(model, "wrong-value", "pin", lambda u: u.fn.name in PIN_FNS)


def swappable(u: L.Update) -> bool:
    """An update of a flag, an index or identity (a lane, block, request or slot) or an enum
    (an owner, phase or slot state), and not a pin (those are the pin family's): one of the
    other values the action can name is a plausible slip. Token sequences and integers are
    left to `update` (dropped) and to the source mutants: their wrong values are endless."""
    return u.fn.name not in PIN_FNS and (u.value.sort is L.BOOL
                                         or u.value.sort.kind in ("index", "ident", "enum"))


def swapped_values(model: L.Model) -> Iterator[Mutant]:
    return value_mutants(model, "swap-value", "swap", swappable)


def freeing(u: L.Update) -> bool:
    """A point update that may set an owner-like function (an enum with FREE) to FREE."""
    ret = u.fn.ret
    return (not u.whole and ret.kind == "enum" and "FREE" in ret.values and len(u.args) == 1
            and mentions(u.value, "FREE"))


def double_frees(model: L.Model) -> Iterator[Mutant]:
    for a in model.actions:
        for i, u in enumerate(a.updates):
            if not freeing(u):
                continue
            for t in terms(model, a, u.args[0].sort):
                if same(t, u.args[0]):
                    continue
                extra = L.Update(u.fn, (t,), L.Lit("FREE", u.fn.ret), False)
                yield Mutant(f"free-twice:{a.name}.{u.fn.name}({show(t)})", "free",
                             f"{a.name} releases {show(u.fn(*u.args))} and also frees "
                             f"{show(t)}", (a.name,),
                             functools.partial(with_extra_update, action=a.name, index=i,
                                               extra=extra))


def committed_capacity() -> types.ModuleType:
    from atom_core._generated import capacity

    return capacity


def capacity_short(model: L.Model) -> Iterator[Mutant]:
    cap = committed_capacity()
    for key, offset in cap.OFFSETS.items():
        offsets = {**cap.OFFSETS, key: offset - 1}
        rule = cap.RULE_NAMES[key]
        short = offset - 1
        yield Mutant(f"capacity:{rule}-1", "capacity",
                     f"{rule} one block short: kv_blocks >= lanes {'-' if short < 0 else '+'} "
                     f"{abs(short)}", (), lambda m: m, offsets)


def enumerate_mutants(model: L.Model) -> list[Mutant]:
    out = [*guard_drops(model), *update_drops(model), *swapped_values(model), *pin_values(model),
           *double_frees(model), *capacity_short(model)]
    ids = [m.id for m in out]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    return out


@functools.cache
def base_model() -> L.Model:
    from atom_core.spec.model import MODEL

    return MODEL


@functools.cache
def catalogue() -> dict[str, Mutant]:
    control = Mutant(CONTROL, "control", "the unmutated model", (), lambda m: m)
    return {m.id: m for m in [control, *enumerate_mutants(base_model())]}


def select(pattern: str | None, sample: int | None = None) -> list[Mutant]:
    """The mutants whose id matches `pattern` (a glob, or else a substring); with `sample`,
    that many spread evenly over them (every family, in catalogue order): a quick estimate."""
    ms = [m for m in catalogue().values() if m.id != CONTROL]
    if pattern:
        glob = any(ch in pattern for ch in "*?[")
        ms = [m for m in ms if (fnmatch.fnmatchcase(m.id, pattern) if glob else pattern in m.id)]
    if sample is not None and 0 < sample < len(ms):
        ms = [ms[i * len(ms) // sample] for i in range(sample)]
    return ms


def patched_table(offsets: dict[tuple[bool, str], int]) -> types.ModuleType:
    """The committed capacity module with `offsets` as its T = 1 offsets, and its rule for
    every T moved by the same number of blocks (a capacity mutant is one block short at
    every table size)."""
    cap = committed_capacity()
    table = types.ModuleType(cap.__name__)
    table.__dict__.update({k: v for k, v in vars(cap).items() if not k.startswith("__")})
    table.OFFSETS = dict(offsets)

    def min_kv_blocks(lanes: int, tables: int, key: tuple[bool, str]) -> int:
        return cap.min_kv_blocks(lanes, tables, key) + offsets[key] - cap.OFFSETS[key]

    table.min_kv_blocks = min_kv_blocks
    return table


def offsets_of(m: Mutant) -> dict[tuple[bool, str], int]:
    return m.offsets if m.offsets is not None else dict(committed_capacity().OFFSETS)


@functools.cache
def load_core(mutant_id: str) -> types.ModuleType:
    """The generated core of a mutant (cached: the layers of one mutant share it)."""
    from atom_core.spec import codegen

    m = catalogue()[mutant_id]
    return codegen.load(m.change(base_model()), "atom_core_mutant_core")


# --------------------------------------------------------------------------- layer: z3


def fresh_z3() -> None:
    """z3's answers depend on what its context has seen (see proofs/run.py): start afresh."""
    import z3

    z3.z3._main_ctx = None


def z3_obligations(model: L.Model, actions: tuple[str, ...]) -> Iterator[Any]:
    from atom_core.proofs import checks

    restricted = only(model, actions)
    yield from checks.relational(restricted)
    yield from checks.bounded(restricted, *Z3_BOUNDED_SIZE, kinds=("bounded", "arithmetic"))
    yield from checks.arithmetic(restricted)


def obligation(c: Any) -> tuple[str, str, str, str]:
    return (c.invariant, c.action, c.kind, c.size)


@functools.cache
def z3_control(actions: tuple[str, ...]) -> dict[tuple[str, str, str, str], str]:
    """The unmutated model's status per obligation of `actions`."""
    fresh_z3()
    return {obligation(c): c.status for c in z3_obligations(base_model(), actions)}


def z3_layer(m: Mutant, opts: Options) -> LayerResult:
    if not m.actions:
        return LayerResult("z3", "survived", "no action changed: no obligation to re-check")
    control = z3_control(m.actions)
    fresh_z3()
    model = m.change(base_model())
    # A counterexample over small finite sorts first: decisive, and milliseconds where the
    # unbounded query of a refutable obligation can end `unknown` after its whole timeout.
    from atom_core.proofs import checks

    for a in m.actions:
        c = checks.refute_action_small(only(model, (a,)), a)
        if c is not None and control.get(obligation(c)) == "proved":
            return LayerResult("z3", "killed", f"{c.kind} {c.invariant} @ {c.action} "
                               f"({c.detail})")
    unknown: list[str] = []
    for c in z3_obligations(model, m.actions):
        name = f"{c.kind} {c.invariant} @ {c.action}" + (f" [{c.size}]" if c.size else "")
        if c.status == "counterexample" and control.get(obligation(c)) == "proved":
            return LayerResult("z3", "killed", name)
        if c.status == "unknown":
            unknown.append(name)
    if unknown:
        return LayerResult("z3", "unknown", f"{len(unknown)} obligation(s) unknown: "
                           + "; ".join(unknown[:3]))
    return LayerResult("z3", "survived")


# --------------------------------------------------------------------------- layer: bmc


@attrs.frozen
class Config:
    label: str
    consts: Any
    progress: bool  # check progress too (not for hybrid: it changes no admission rule)


def bmc_configs(core: types.ModuleType, offsets: dict[tuple[bool, str], int],
                lanes: int, below: int = 0) -> list[Config]:
    """Each feature combination at `lanes` lanes and its capacity (minus `below`), and on top
    of each (not below) the hybrid (sliding-window) variant, and with the prefix cache the host
    tier with one slot: the proved rules hold for those too (capacity.COMBINATIONS)."""
    fields = attrs.fields_dict(core.Consts)
    out = []
    for (prefix, scratch), off in sorted(offsets.items()):
        k = lanes + off - below
        if k < 1:
            continue
        variants: list[dict[str, Any]] = [{}]
        if not below and "HYBRID" in fields:
            variants.append({"HYBRID": True})
        if not below and prefix and "HOST" in fields:
            variants.append({"HOST": True, "H": 1})
        for extra in variants:
            cs = {"B": lanes, "K": k, "C": BMC_CHUNK, "S": BMC_SEQ_LEN, "PREFIX": prefix,
                  "RESERVED": scratch == "reserved", "SCRATCH": 0, **extra}
            label = (f"B={lanes},K={k},{'prefix cache' if prefix else 'no cache'},{scratch}"
                     + (",hybrid" if "HYBRID" in extra else "")
                     + (",host tier" if "HOST" in extra else ""))
            out.append(Config(label, core.Consts(**cs), "HYBRID" not in extra))
    return out


def violations(core: types.ModuleType, pre: Any, post: Any, progress: bool) -> list[str]:
    try:
        bad = [f"invariant {n}" for n in core.check_invariants(post)]
        bad += [f"transition {n}" for n in core.check_transition(pre, post)]
        if progress:
            bad += [f"stuck {n}" for n in core.progress_violations(post)]
    except Exception as exc:  # a checker that crashes on a reachable state is a finding too
        bad = [f"crash in a checker: {type(exc).__name__}"]
    return bad


def explore(core: types.ModuleType, cfg: Config, max_states: int,
            ignore: frozenset[str] | None) -> tuple[dict[str, tuple], bool]:
    """Breadth-first over every state reachable with B + 1 requests (search.moves: every action,
    PD included, with its symmetry reduction). Returns the first run to each finding and
    whether the space was exhausted. With `ignore` (the control's findings) it stops at the
    first finding not in it; without, it collects all (the control itself)."""
    from atom_core.proofs import search

    c = cfg.consts
    requests, prompts = c.B + 1, search.menu(c.C)
    start = core.init(c, ghost=True)
    seen = {search.state_key(start, core)}
    frontier: deque[tuple[Any, tuple]] = deque([(start, ())])
    found: dict[str, tuple] = {}
    while frontier:
        s, path = frontier.popleft()
        try:
            succ = [(n, a, core.ACTIONS[n][0](s, **a).state)
                    for n, a in search.moves(s, requests, prompts, skip=(), core=core)]
        except Exception as exc:  # the mutant core crashes in a reachable state: a finding
            found.setdefault(f"crash: {type(exc).__name__}", path)
            if ignore is not None:
                return found, False
            continue
        for name, args, nxt in succ:
            step = (path, (name, args))
            try:
                key = search.state_key(nxt, core)
            except Exception as exc:  # a state the core should never build (e.g. a None key)
                found.setdefault(f"crash: {type(exc).__name__} in a state {name} built", step)
                if ignore is not None:
                    return found, False
                continue
            if key in seen:
                continue
            seen.add(key)
            new = [b for b in violations(core, s, nxt, cfg.progress)
                   if b not in found and (ignore is None or b not in ignore)]
            for b in new:
                found[b] = step
            if new and ignore is not None:
                return found, False
            if len(seen) >= max_states:
                return found, False
            frontier.append((nxt, step))
    return found, True


@functools.cache
def bmc_control(opts: Options) -> dict[str, Any]:
    """What the unmutated model's core shows in the same searches: its findings per config
    (excluded from kills) and whether a stuck run exists one block below each minimum."""
    core = load_core(CONTROL)
    offsets = offsets_of(catalogue()[CONTROL])
    out: dict[str, Any] = {}
    for lanes, cap in ((1, opts.bmc_states), (2, opts.bmc_wide_states)):
        for cfg in bmc_configs(core, offsets, lanes):
            out[cfg.label] = frozenset(explore(core, cfg, cap, None)[0])
    for cfg in tight_configs(core, offsets):
        out[f"tight {cfg.label}"] = stuck_below(core, cfg, opts) is True
    return out


def tight_configs(core: types.ModuleType, offsets: dict[tuple[bool, str], int]) -> list[Config]:
    """One block below each combination's minimum, at the fewest lanes where that is a block."""
    out = []
    for key in sorted(offsets):
        for lanes in (1, 2):
            cfgs = bmc_configs(core, {key: offsets[key]}, lanes, below=1)
            if cfgs:
                out += cfgs
                break
    return out


def stuck_below(core: types.ModuleType, cfg: Config, opts: Options) -> bool | None:
    """A colocated stuck run exists (True), provably none within the search (False), or the
    search hit its bound (None)."""
    from atom_core.proofs import search

    try:
        run = search.shortest_stuck_run(cfg.consts, max_states=opts.bmc_states, core=core)
    except RuntimeError:
        return None
    return run is not None


def confirmed(m: Mutant, cfg: Config, run: list[tuple[str, dict]], finding: str) -> bool | None:
    """A stuck run replayed in z3 against the mutant spec (as verify does for its runs), so the
    kill does not rest on the generator."""
    from atom_core.proofs import search

    fresh_z3()
    prop = finding.removeprefix("stuck ")
    try:
        return search.confirm(m.change(base_model()), cfg.consts, run, prop, cfg.consts.B + 1)
    except Exception:
        return None


def bmc_layer(m: Mutant, opts: Options) -> LayerResult:
    core = load_core(m.id)
    control = bmc_control(opts)
    offsets = offsets_of(m)
    # cheapest first: one lane (exhaustive), tightness, then two lanes (bounded)
    for cfg in bmc_configs(core, offsets, 1):
        found = explore(core, cfg, opts.bmc_states, control.get(cfg.label, frozenset()))[0]
        if found:
            return bmc_finding(m, cfg, found)
    for cfg in tight_configs(core, offsets):
        if not control.get(f"tight {cfg.label}"):
            continue  # the control has no stuck run here either: nothing to compare
        stuck = stuck_below(core, cfg, opts)
        if stuck is None:
            return LayerResult("bmc", "unknown", f"stuck-run search at {cfg.label} hit "
                               f"its bound of {opts.bmc_states} states")
        if not stuck:
            return LayerResult("bmc", "killed", f"not tight: no stuck run at {cfg.label}, "
                               "one block below the capacity rule")
    for cfg in bmc_configs(core, offsets, 2):
        found = explore(core, cfg, opts.bmc_wide_states,
                        control.get(cfg.label, frozenset()))[0]
        if found:
            return bmc_finding(m, cfg, found)
    return LayerResult("bmc", "survived")


def bmc_finding(m: Mutant, cfg: Config, found: dict[str, tuple]) -> LayerResult:
    from atom_core.proofs import search

    finding, path = next(iter(found.items()))
    run = search.unwind(path)
    detail = f"{finding} at {cfg.label} after {len(run)} steps"
    if finding.startswith("stuck "):
        ok = confirmed(m, cfg, run, finding)
        if ok is None:
            return LayerResult("bmc", "unknown", f"{detail}; the z3 replay did not answer")
        if not ok:
            return LayerResult("bmc", "error", f"{detail}; the run does not replay in z3")
        detail += " (replayed in z3)"
    return LayerResult("bmc", "killed", detail)


# --------------------------------------------------------------------------- layer: hypothesis


def core_machine_module() -> types.ModuleType | None:
    """`atom_core.testing.machine`, or None without hypothesis (the dev extra)."""
    if importlib.util.find_spec("hypothesis") is None:
        return None
    from atom_core.testing import machine

    return machine


def machine_settings(examples: int) -> Any:
    """Bounded and derandomized, so a verdict is reproducible; no shrinking: the first failure
    is the kill."""
    from hypothesis import HealthCheck, Phase, settings

    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    stateful_step_count=50, phases=[Phase.explicit, Phase.generate],
                    report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
                    print_blob=False)


@contextlib.contextmanager
def machine_capacity(offsets: dict[tuple[bool, str], int]) -> Iterator[None]:
    """The machine draws K from its capacity rule (`atom_core.testing.strategies.min_blocks`)
    and checks progress at or above it: give it the mutant's table (a capacity mutant claims
    one block fewer suffices)."""
    from atom_core.testing import strategies

    saved = strategies.min_blocks
    table = patched_table(offsets)

    def min_blocks(lanes: int, prefix: bool, scratch: str, tables: int = 1,
                   preempt: bool = False) -> int:
        if preempt:  # (the catalogue's capacity mutants move the rules without preemption)
            return saved(lanes, prefix, scratch, tables, preempt)
        return table.min_kv_blocks(lanes, tables, (prefix, scratch))

    strategies.min_blocks = min_blocks
    try:
        yield
    finally:
        strategies.min_blocks = saved


# The state only hybrid models change (their sliding state and its snapshots): without HYBRID
# every snapshot is refused and every boundary stays 0 (`snapshots_need_hybrid`).
HYBRID_STATE = ("lane_snap", "lane_snap_junk", "lane_snap_taken", "snap_upto", "snap_junk",
                "snap_taken", "local_holds", "local_junk")


def hybrid_mutant(m: Mutant) -> bool:
    """A mutant of `snapshot`, of a hybrid guard (`hybrid_...`) or of an update of hybrid state
    (the guard or function its id names after the action)."""
    name = m.id.partition(":")[2].partition(".")[2]
    name = name.split("=")[0].split("#")[0]
    return "snapshot" in m.actions or name.startswith("hybrid") or name in HYBRID_STATE


def machine_tier(m: Mutant) -> str:
    """The configurations the machine runs a mutant over: "host" (the host tier, with the prefix
    cache, T in 1..3) for a mutant of a host-tier action (elsewhere every call of it is refused
    early: no slot); "hybrid" (the hybrid tier, T in 1..3, beside every feature combination:
    a snapshot without HYBRID is refused, which a mutant may break) for a `hybrid_mutant`
    (elsewhere it changes nothing the machine sees); else "plain" (every feature
    combination)."""
    from atom_core.spec.model import HOST_ACTIONS

    if set(m.actions) & set(HOST_ACTIONS):
        return "host"
    return "hybrid" if hybrid_mutant(m) else "plain"


def run_machine(mutant_id: str, examples: int, tier: str = "plain") -> str | None:
    """None if the machine passes over `tier`'s configurations (`machine_tier`); else what
    failed (a kill)."""
    import hypothesis.errors
    import hypothesis.strategies as st
    from hypothesis.stateful import run_state_machine_as_test

    from atom_core.testing.lifecycle import FEATURES
    from atom_core.testing.machine import make_machine
    from atom_core.testing.strategies import configs as drawn

    core = load_core(mutant_id)
    with machine_capacity(offsets_of(catalogue()[mutant_id])):
        configs = [drawn(core, p, s) for p, s in FEATURES] if tier != "host" else []
        if tier != "plain":
            configs += [drawn(core, True, s, tier=tier) for s in ("reserved", "dynamic")]
        config = st.one_of(*configs)
        machine = make_machine(core, config, mirror=False, pd=True)
        try:
            run_state_machine_as_test(machine, settings=machine_settings(examples))
        except hypothesis.errors.HypothesisException:
            raise  # a harness problem (health check, flaky), never a kill
        except Exception as exc:  # an invariant, the lifecycle model or a crash of the core
            first = (str(exc).strip().splitlines() or [""])[0]  # a bare assert has no text
            return f"{type(exc).__name__}: {first[:160]}"
    return None


@functools.cache
def machine_control(examples: int, tier: str = "plain") -> str | None:
    return run_machine(CONTROL, examples, tier)


def hypothesis_layer(m: Mutant, opts: Options) -> LayerResult:
    if core_machine_module() is None:
        return LayerResult("hypothesis", "unavailable",
                           "atom_core.testing needs hypothesis (the dev extra)")
    tier = machine_tier(m)
    broken = machine_control(opts.examples, tier)
    if broken:
        return LayerResult("hypothesis", "error", f"the control fails: {broken}")
    failure = run_machine(m.id, opts.examples, tier)
    return LayerResult("hypothesis", "killed" if failure else "survived", failure or "")


# --------------------------------------------------------------------------- layer: simulation


def simulation_available() -> bool:
    return importlib.util.find_spec("atom_core.simulate") is not None


def install_core(core: types.ModuleType, offsets: dict[tuple[bool, str], int] | None) -> None:
    """Make `core` (and a capacity table) the project's generated modules: in sys.modules, and
    in every already-imported atom_core module that bound the committed ones (`config`,
    `policy` and `replay` import the core at import time)."""
    import atom_core._generated as pkg
    from atom_core._generated import capacity
    from atom_core._generated import core as committed

    swap = {id(committed): core}
    if offsets is not None:
        swap[id(capacity)] = patched_table(offsets)
    sys.modules["atom_core._generated.core"] = core
    pkg.core = core
    if offsets is not None:
        sys.modules["atom_core._generated.capacity"] = swap[id(capacity)]
        pkg.capacity = swap[id(capacity)]
    for name, mod in list(sys.modules.items()):
        if not name.startswith("atom_core") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in swap:
                setattr(mod, attr, swap[id(value)])


def simulate_one(mutant_id: str, runs: int, steps: int) -> dict[str, Any]:
    """In a fresh process: install the mutant core, then import and run the simulator."""
    m = catalogue()[mutant_id]
    install_core(load_core(mutant_id), m.offsets)
    import inspect

    from atom_core import simulate  # only now: it must bind the mutant core

    # no shrinking when the simulator offers it: the first failure is the kill
    quick = {"shrink": False} if "shrink" in inspect.signature(simulate.run).parameters else {}
    for seed, fixed in enumerate(SIM_RUNS[:runs]):
        try:
            report = simulate.run(seed, steps, **quick, **fixed)
        except Exception as exc:  # the mutant core or the adapter crashed: a failure seen
            return {"ok": False, "seed": seed, "detail": f"{type(exc).__name__}: {exc}"[:200]}
        if not report.ok:
            failures = getattr(report, "failures", ())
            detail = str(failures[0]) if failures else str(report)
            return {"ok": False, "seed": seed, "fixed": fixed, "detail": detail[:200]}
    return {"ok": True, "runs": runs, "steps": steps}


def run_simulation(mutant_id: str, opts: Options) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "atom_core.proofs.mutants", "--simulate-one", mutant_id,
           "--sim-runs", str(opts.sim_runs), "--sim-steps", str(opts.sim_steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.sim_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {opts.sim_timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


@functools.cache
def simulation_control(opts: Options) -> dict[str, Any]:
    return run_simulation(CONTROL, opts)


def simulation_layer(m: Mutant, opts: Options) -> LayerResult:
    if not simulation_available():
        return LayerResult("simulation", "unavailable", "atom_core/simulate.py does not exist")
    control = simulation_control(opts)
    if not control.get("ok"):
        return LayerResult("simulation", "error", f"the control fails: {control}")
    out = run_simulation(m.id, opts)
    if "error" in out:
        return LayerResult("simulation", "error", out["error"])
    if out["ok"]:
        return LayerResult("simulation", "survived")
    return LayerResult("simulation", "killed", f"seed {out['seed']}: {out['detail']}")


# --------------------------------------------------------------------------- running

LAYER_FNS: dict[str, Callable[[Mutant, Options], LayerResult]] = {
    "z3": z3_layer, "bmc": bmc_layer, "hypothesis": hypothesis_layer,
    "simulation": simulation_layer}


def run_layer(name: str, m: Mutant, opts: Options) -> LayerResult:
    t0 = time.perf_counter()
    try:
        r = LAYER_FNS[name](m, opts)
    except Exception as exc:  # a harness or generator failure is reported, never a verdict
        r = LayerResult(name, "error", f"{type(exc).__name__}: {exc}"[:300])
    return attrs.evolve(r, seconds=time.perf_counter() - t0)


def run_mutant(mutant_id: str, opts: Options) -> MutantResult:
    m = catalogue().get(mutant_id)
    if m is None:  # a worker imported a different spec than the one the run enumerated
        return MutantResult(mutant_id, "?", "", (LayerResult(
            "z3", "error", "the spec changed during the run: re-run"),), 0.0)
    t0 = time.perf_counter()
    out: list[LayerResult] = []
    for name in (x for x in LAYERS if x in opts.layers):
        if not opts.all_layers and any(r.status == "killed" for r in out):
            out.append(LayerResult(name, "skipped", "killed by an earlier layer"))
        else:
            out.append(run_layer(name, m, opts))
    load_core.cache_clear()  # one mutant's core in memory at a time
    return MutantResult(m.id, m.family, m.description, tuple(out), time.perf_counter() - t0)


def run_control(actions: tuple[str, ...], opts: Options) -> MutantResult:
    """The unmutated model through every layer: a layer that flags it ("killed") is looking at
    a spec that fails its own checks (mid-edit); z3 and bmc then discount those findings, and
    hypothesis and simulation report an error rather than kills."""
    t0 = time.perf_counter()
    out = []
    for name in (x for x in LAYERS if x in opts.layers):
        t1 = time.perf_counter()
        try:
            r = CONTROL_FNS[name](actions, opts)
        except Exception as exc:
            r = LayerResult(name, "error", f"{type(exc).__name__}: {exc}"[:300])
        out.append(attrs.evolve(r, seconds=time.perf_counter() - t1))
    return MutantResult(CONTROL, "control", "the unmutated model", tuple(out),
                        time.perf_counter() - t0)


def z3_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    bad = {k: v for a in actions for k, v in z3_control((a,)).items() if v != "proved"}
    if not bad:
        return LayerResult("z3", "survived", f"every obligation of {len(actions)} action(s) "
                           "proved")
    shown = "; ".join(f"{st} {k[2]} {k[0]} @ {k[1]}" for k, st in list(bad.items())[:4])
    status = "killed" if "counterexample" in bad.values() else "unknown"
    return LayerResult("z3", status, f"{len(bad)} obligation(s) not proved: {shown}")


def bmc_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    ctl = bmc_control(opts)
    bad = [f"{k}: {', '.join(sorted(v))}" for k, v in ctl.items()
           if isinstance(v, frozenset) and v]
    bad += [f"{k}: no stuck run" for k, v in ctl.items() if v is False]
    return LayerResult("bmc", "killed" if bad else "survived", "; ".join(bad)[:300])


def hypothesis_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    if core_machine_module() is None:
        return LayerResult("hypothesis", "unavailable",
                           "atom_core.testing needs hypothesis (the dev extra)")
    failure = machine_control(opts.examples)
    return LayerResult("hypothesis", "killed" if failure else "survived", failure or "")


def simulation_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    if not simulation_available():
        return LayerResult("simulation", "unavailable", "atom_core/simulate.py does not exist")
    out = simulation_control(opts)
    if "error" in out:
        return LayerResult("simulation", "error", out["error"])
    return LayerResult("simulation", "survived" if out["ok"] else "killed",
                       "" if out["ok"] else f"seed {out['seed']}: {out['detail']}")


CONTROL_FNS: dict[str, Callable[[tuple[str, ...], Options], LayerResult]] = {
    "z3": z3_control_layer, "bmc": bmc_control_layer, "hypothesis": hypothesis_control_layer,
    "simulation": simulation_control_layer}


def run_all(ids: list[str], opts: Options, jobs: int,
            progress: Callable[[MutantResult, int, int], None] | None = None
            ) -> list[MutantResult]:
    results: dict[str, MutantResult] = {}

    def done(r: MutantResult) -> None:
        results[r.id] = r
        if progress:
            progress(r, len(results), len(ids))

    if jobs <= 1:
        for i in ids:
            done(run_mutant(i, opts))
    else:
        # spawn: z3 and hypothesis state must not be shared through fork
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(run_mutant, i, opts) for i in ids]
            for f in concurrent.futures.as_completed(futures):
                done(f.result())
    return [results[i] for i in ids]


# --------------------------------------------------------------------------- report


@attrs.frozen
class Report:
    mode: str  # cheap-first | all-layers
    layers: tuple[str, ...]
    control: MutantResult
    results: list[MutantResult]
    seconds: float

    @property
    def killed(self) -> list[MutantResult]:
        return [r for r in self.results if r.status == "killed"]

    @property
    def survivors(self) -> list[MutantResult]:
        return [r for r in self.results if r.status in ("survived", "unknown")]

    @property
    def unexplained(self) -> list[str]:
        return [r.id for r in self.survivors if not r.explanation]

    @property
    def stale(self) -> list[str]:
        """Explained mutants that a layer now kills: the explanation is out of date."""
        return [r.id for r in self.results if r.status == "killed" and r.explanation]

    @property
    def errors(self) -> list[str]:
        return [r.id for r in self.results if r.status == "error"]

    def by_layer(self) -> dict[str, dict[str, Any]]:
        total = len(self.results)
        out = {}
        for name in self.layers:
            rs = [lr for r in self.results for lr in r.layers if lr.layer == name]
            counts = {s: sum(1 for lr in rs if lr.status == s) for s in
                      ("killed", "survived", "unknown", "unavailable", "error", "skipped")}
            out[name] = {**counts, "ran": len(rs) - counts["skipped"],
                         "rate": round(counts["killed"] / total, 4) if total else 0.0,
                         "seconds": round(sum(lr.seconds for lr in rs), 1)}
        return out

    def as_json(self) -> dict[str, Any]:
        total = len(self.results)
        return {"mode": self.mode, "layers": list(self.layers), "total": total,
                "killed": len(self.killed),
                "kill_rate": round(len(self.killed) / total, 4) if total else 0.0,
                "by_layer": self.by_layer(),
                "by_family": self.by_family(),
                "survivors": [r.id for r in self.survivors],
                "unexplained": self.unexplained, "stale_explanations": self.stale,
                "errors": self.errors, "control": self.control.as_json(),
                "seconds": round(self.seconds, 1),
                "mutants": [r.as_json() for r in self.results]}

    def by_family(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for r in self.results:
            row = out.setdefault(r.family, {"total": 0, "killed": 0})
            row["total"] += 1
            row["killed"] += r.status == "killed"
        return out


def pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.1f}%)" if d else "0/0"


def headline(rep: Report) -> list[str]:
    total = len(rep.results)
    lines = [f"kill rate: {pct(len(rep.killed), total)} ({rep.mode}, {rep.seconds:.0f} s)"]
    word = "kills" if rep.mode == "all-layers" else "first kills"
    for name, row in rep.by_layer().items():
        extra = [f"{row[s]} {s}" for s in ("unknown", "unavailable", "error") if row[s]]
        lines.append(f"  {name:<11} {word}: {pct(row['killed'], total)}, ran on {row['ran']}"
                     + (f", {', '.join(extra)}" if extra else "") + f", {row['seconds']} s")
    control = ", ".join(f"{lr.layer} {lr.status}" + (f" ({lr.detail})" if lr.detail else "")
                        for lr in rep.control.layers)
    lines.append(f"control (unmutated model): {control}")
    lines.append(f"survivors: {len(rep.survivors)} ({len(rep.unexplained)} unexplained)")
    if rep.unexplained:
        lines.append("UNEXPLAINED survivors (add them to EXPLAINED in proofs/mutants.py): "
                     + ", ".join(rep.unexplained))
    if rep.stale:
        lines.append("explained but killed (remove from EXPLAINED): " + ", ".join(rep.stale))
    if rep.errors:
        lines.append("errors: " + ", ".join(rep.errors))
    return lines


def render(rep: Report, verbose: bool) -> None:
    rows = rep.results if verbose else rep.survivors
    header = ["mutant", "status", "killed by", *rep.layers, "explanation"]
    body = []
    for r in rows:
        cells = {lr.layer: lr.status + (f": {lr.detail}" if verbose and lr.detail else "")
                 for lr in r.layers}
        body.append([r.id, r.status, r.killed_by or "-", *(cells.get(x, "-") for x in rep.layers),
                     r.explanation or ("UNEXPLAINED" if r in rep.survivors else "")])
    fam = [[f, str(v["total"]), pct(v["killed"], v["total"])] for f, v in rep.by_family().items()]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print_plain(header, body, fam)
    else:
        # a report, not a terminal widget: wide enough for ids and details when piped
        console = Console(width=max(140, shutil.get_terminal_size().columns))
        table = Table(title="mutants" if verbose else "survivors")
        for h in header:
            table.add_column(h, overflow="fold")
        for row in body:
            table.add_row(*row)
        families = Table(title="by family")
        for h in ("family", "mutants", "killed"):
            families.add_column(h)
        for row in fam:
            families.add_row(*row)
        console.print(families)
        if body:
            console.print(table)
    for line in headline(rep):
        print(line)


def print_plain(header: list[str], body: list[list[str]], fam: list[list[str]]) -> None:
    for row in [["family", "mutants", "killed"], *fam]:
        print("  ".join(f"{c:<14}" for c in row))
    print()
    print(" | ".join(header))
    for row in body:
        print(" | ".join(row))


def report(ids: list[str], opts: Options, jobs: int,
           progress: Callable[[MutantResult, int, int], None] | None = None) -> Report:
    t0 = time.perf_counter()
    actions = tuple(sorted({a for i in ids for a in catalogue()[i].actions}))
    control = run_control(actions, opts)
    results = run_all(ids, opts, jobs, progress)
    return Report("all-layers" if opts.all_layers else "cheap-first", opts.layers, control,
                  results, time.perf_counter() - t0)


# --------------------------------------------------------------------------- source mutants

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code in 3.8), for reading its results
# without importing it: a timeout is a mutant the tests stopped (it looped), so it counts as
# caught; "no tests" means no test of the selection calls the mutated function.
MUTMUT_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
                 34: "skipped", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout",
                 255: "timeout", 37: "killed", -11: "crashed", -9: "crashed", None: "not run"}
SOURCE_COLUMNS = ("killed", "timeout", "survived", "no tests", "not run", "other")


def source_report(root: Path = Path("mutants")) -> list[dict[str, Any]]:
    """Per mutated file, mutmut's verdicts counted from its result files (`<file>.meta`)."""
    rows = []
    for meta in sorted(root.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        row: dict[str, Any] = {"file": str(meta.relative_to(root))[:-len(".meta")],
                               "mutants": len(codes), **dict.fromkeys(SOURCE_COLUMNS, 0)}
        for code in codes.values():
            status = MUTMUT_STATUS.get(code, "other")
            row[status if status in SOURCE_COLUMNS else "other"] += 1
        run = row["killed"] + row["timeout"] + row["survived"]
        row["kill_rate"] = round((row["killed"] + row["timeout"]) / run, 4) if run else None
        rows.append(row)
    return rows


def print_source_report(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no mutmut results under mutants/ (run `make mutants-source`)")
        return
    header = ("file", "mutants", *SOURCE_COLUMNS, "caught/run")
    print("  ".join(f"{h:>9}" if i else f"{h:<30}" for i, h in enumerate(header)))
    for r in rows:
        run = r["killed"] + r["timeout"] + r["survived"]
        rate = f"{100 * r['kill_rate']:.1f}%" if run else "-"
        cells = [r["file"], r["mutants"], *(r[c] for c in SOURCE_COLUMNS), rate]
        print("  ".join(f"{c:>9}" if i else f"{c:<30}" for i, c in enumerate(cells)))


def print_progress(r: MutantResult, n: int, total: int) -> None:
    verdict = f"killed by {r.killed_by}" if r.killed_by else r.status
    layers = ", ".join(f"{lr.layer} {lr.status}" for lr in r.layers if lr.status != "skipped")
    print(f"[{n}/{total}] {r.id}: {verdict} ({r.seconds:.1f} s; {layers})", file=sys.stderr,
          flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atom_core.proofs.mutants",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--all-layers", action="store_true",
                    help="run every layer on every mutant (per-layer kill rates)")
    ap.add_argument("--layers", default=",".join(LAYERS),
                    help=f"comma-separated subset of {','.join(LAYERS)}")
    ap.add_argument("--only", metavar="PATTERN",
                    help="mutant ids matching this glob (or containing this text)")
    ap.add_argument("--sample", type=int, metavar="N",
                    help="only N mutants, spread evenly over the selection (a quick estimate)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--json", metavar="PATH", type=Path, help="write the results as JSON")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="a row per mutant")
    defaults = Options()
    ap.add_argument("--examples", type=int, default=defaults.examples,
                    help="hypothesis examples per mutant")
    ap.add_argument("--sim-runs", type=int, default=defaults.sim_runs,
                    help="simulated runs per mutant (SIM_RUNS)")
    ap.add_argument("--sim-steps", type=int, default=defaults.sim_steps,
                    help="simulated ticks per seed")
    ap.add_argument("--source-report", action="store_true",
                    help="print mutmut's results under mutants/ per file (`make mutants-source`)")
    ap.add_argument("--simulate-one", metavar="ID", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.source_report:
        rows = source_report()
        print_source_report(rows)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")
        return 0

    if args.simulate_one:  # the simulation layer's subprocess
        print(json.dumps(simulate_one(args.simulate_one, args.sim_runs, args.sim_steps)))
        return 0
    layers = tuple(x for x in args.layers.split(",") if x)
    unknown = set(layers) - set(LAYERS)
    if unknown:
        ap.error(f"unknown layer(s): {', '.join(sorted(unknown))}")
    mutants = select(args.only, args.sample)
    if args.list:
        for m in mutants:
            print(f"{m.id:<60} {m.family:<9} {m.description}")
        return 0
    if not mutants:
        ap.error(f"no mutant matches {args.only!r}")
    opts = Options(layers=layers, all_layers=args.all_layers, examples=args.examples,
                   sim_runs=args.sim_runs, sim_steps=args.sim_steps)
    rep = report([m.id for m in mutants], opts, args.jobs, print_progress)
    if args.json:
        args.json.write_text(json.dumps(rep.as_json(), indent=2) + "\n")
    render(rep, args.verbose)
    return 1 if rep.unexplained or rep.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
