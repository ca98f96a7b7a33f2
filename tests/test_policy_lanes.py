"""The policy asks its per-lane questions of the busy lanes only (`policy.busy_lanes`): that is
exact only because each of those guards requires its lane busy. Proved here on the spec itself
(z3, every size): the guard (or definition) with its lane idle is unsatisfiable. A spec change
that let an idle lane prefill, grow or decode fails this test instead of being skipped by the
scheduler."""

from __future__ import annotations

import pytest
import z3

from atom_core.proofs import encode
from atom_core.proofs.limits import STEP
from atom_core.spec.model import MODEL

# the actions whose lane the policy takes from `busy_lanes`, and the definitions it asks so
ACTIONS = ["prefill", "grow", "import_grow"]
DEFINITIONS = ["decoding"]


def _idle_and(u: encode.Universe, pre: encode.Env, lane: z3.ExprRef, fact: z3.ExprRef) -> str:
    s = z3.Solver()
    s.set("rlimit", STEP)
    s.add(*u.axioms(), fact, z3.Not(pre["busy"](lane)))
    return str(s.check())


@pytest.mark.parametrize("action", ACTIONS)
def test_the_guard_needs_its_lane_busy(action: str) -> None:
    u = encode.Universe(MODEL)
    pre = u.fresh_state("pre")
    a = MODEL.get_action(action)
    bound = u.params(a, "p")
    lane = next(t for p, t in bound.items() if p.name == "l")
    assert _idle_and(u, pre, lane, u.guard(a, pre, bound)) == "unsat", \
        f"{action}'s guard holds for an idle lane: policy.busy_lanes would skip it"


@pytest.mark.parametrize("name", DEFINITIONS)
def test_the_definition_needs_its_lane_busy(name: str) -> None:
    u = encode.Universe(MODEL)
    pre = u.fresh_state("pre")
    d = next(d for d in MODEL.definitions if d.name == name)
    lane = z3.Const("l", u.zsort(d.params[0].sort))
    body = u.tr(d.body, pre, {d.params[0]: lane})
    assert _idle_and(u, pre, lane, body) == "unsat"


def test_a_guard_without_its_busy_conjunct_is_caught() -> None:
    """The check can fail: `grow` with its `lane_computing` conjunct dropped holds for an idle
    lane in some state (found in a small finite universe, where z3 decides satisfiability)."""
    model = MODEL.without_guard("grow", "lane_computing")
    u = encode.Universe(model, sizes={"Lane": 2, "Block": 3, "Req": 2, "Slot": 1})
    pre = u.fresh_state("pre")
    a = model.get_action("grow")
    bound = u.params(a, "p")
    lane = next(t for p, t in bound.items() if p.name == "l")
    assert _idle_and(u, pre, lane, u.guard(a, pre, bound)) == "sat"


# The policy asks a guard only of the busy lanes that pass one of its conjuncts, read directly
# from the state (`Policy.prefill_lanes`, `Policy.growth`): exact only because the conjuncts of
# the guard that read only the lane imply that definition (`ready_*` asks exactly those).
NARROWED = [("prefill", "prefilling"), ("grow", "tail_full"), ("import_grow", "importing")]


def _lane_only_guard(u: encode.Universe, a: object, pre: encode.Env, lane: z3.ExprRef,
                     lane_var: object) -> z3.ExprRef:
    """The conjuncts of `a`'s guard that read no parameter but the lane (a conjunct that reads
    another fails to translate without it)."""
    parts = []
    for _name, g in a.guards:  # type: ignore[attr-defined]
        try:
            parts.append(u.tr(g, pre, {lane_var: lane}))
        except KeyError:
            continue
    return z3.And(parts)


@pytest.mark.parametrize(("action", "name"), NARROWED)
def test_the_lane_guard_implies_the_narrowing(action: str, name: str) -> None:
    u = encode.Universe(MODEL)
    pre = u.fresh_state("pre")
    a = MODEL.get_action(action)
    bound = u.params(a, "p")
    lane_var, lane = next((p, t) for p, t in bound.items() if p.name == "l")
    d = next(d for d in MODEL.definitions if d.name == name)
    s = z3.Solver()
    s.set("rlimit", STEP)
    s.add(*u.axioms(), _lane_only_guard(u, a, pre, lane, lane_var),
          z3.Not(u.tr(d.body, pre, {d.params[0]: lane})))
    assert str(s.check()) == "unsat", f"{action}'s guard holds for a lane that is not {name}"


def test_a_guard_without_its_narrowing_conjunct_is_caught() -> None:
    """The check can fail: `grow` without its `tail_full` conjunct holds for a lane whose tail
    is not full."""
    model = MODEL.without_guard("grow", "tail_full")
    u = encode.Universe(model, sizes={"Lane": 2, "Block": 3, "Req": 2, "Slot": 1})
    pre = u.fresh_state("pre")
    a = model.get_action("grow")
    bound = u.params(a, "p")
    lane_var, lane = next((p, t) for p, t in bound.items() if p.name == "l")
    d = next(d for d in model.definitions if d.name == "tail_full")
    s = z3.Solver()
    s.set("rlimit", STEP)
    s.add(*u.axioms(), _lane_only_guard(u, a, pre, lane, lane_var),
          z3.Not(u.tr(d.body, pre, {d.params[0]: lane})))
    assert str(s.check()) == "sat"
