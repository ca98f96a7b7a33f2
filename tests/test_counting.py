"""The capacity rules for every size (proofs/counting.py): each part proves on the model, and
a planted bug (the rule one block short, an abstraction that forgets a block or claims one
slot too few, a capacity hypothesis stronger than the counting proves, a progress proof
without it) fails the very check `verify` runs, naming it."""

from __future__ import annotations

import pytest
import z3

from atom_core._generated import capacity as committed
from atom_core.proofs import capacity, counting, run
from atom_core.spec import model as spec
from atom_core.spec.lang import forall, implies
from atom_core.spec.model import MODEL

pytestmark = pytest.mark.usefixtures("fresh_z3")


@pytest.mark.parametrize("rule", counting.RULES, ids=lambda r: r.name)
def test_each_rule_holds_on_the_abstraction_for_every_size(rule):
    c = counting.rule_check(rule)
    assert (c.invariant, c.status) == (f"count:{rule.name}", "proved"), c.detail
    t = counting.tight_check(rule)
    assert (t.invariant, t.status) == (f"tight-abstraction:{rule.name}", "proved")


@pytest.mark.parametrize("rule", counting.RULES, ids=lambda r: r.name)
def test_one_block_fewer_fails_naming_the_rule(rule):
    c = counting.rule_check(rule, fewer=1)
    assert c.invariant == f"count:{rule.name}"
    assert c.status == "counterexample"
    assert "no reusable block at B=" in c.detail


def test_the_rule_checked_is_the_committed_table(monkeypatch):
    """A table one scratch block short (as `make generate` would write from a wrong proof)
    fails `count:` with a state: the rule is read from the generated module, not restated."""
    rule = counting.Rule((True, "reserved"), False)
    monkeypatch.setitem(committed.SCRATCH_BLOCKS, rule.key, 0)
    c = counting.rule_check(rule)
    assert (c.invariant, c.status) == ("count:prefix-cache-reserved-scratch", "counterexample")


def test_the_stuck_counts_do_not_fit_at_the_minimum():
    """`tight-abstraction` is not vacuous: the same explicit counts at K_min itself (no block
    fewer) fail, since there the rule leaves a reusable block."""
    for rule in counting.RULES:
        c = counting.tight_check(rule, fewer=0)
        assert (c.invariant, c.status) == (f"tight-abstraction:{rule.name}", "counterexample")


def test_the_abstraction_facts_hold_for_all_sizes():
    cs = list(counting.abstraction_checks(MODEL))
    assert [c.invariant for c in cs] == [f"abstraction:{n}" for n in counting.ABSTRACTION_NAMES]
    assert all(c.status == "proved" for c in cs), [(c.invariant, c.detail) for c in cs]


def test_an_abstraction_fact_one_slot_short_fails_naming_it():
    """Claiming every lane block sits below nblocks - 1 (one table slot fewer) is refuted."""
    def short(u, st):
        facts = dict(counting.abstraction_facts(u, st))
        b = z3.Const("b!short", u.z3sorts["Block"])
        lane = u.value("LANE", spec.Owner)
        nb = st["nblocks"](st["owner_lane"](b))
        facts["lane-blocks-in-table-slots"] = z3.ForAll([b], z3.Implies(
            st["owner"](b) == lane, counting._slot(u, st, b) < nb - 1))
        return list(facts.items())
    # (at a budget the true facts need a tenth of: over unbounded sorts z3 answers a false one
    # `unknown`, which fails the run like a counterexample)
    budget = 500_000
    assert all(c.status == "proved" for c in counting.abstraction_checks(MODEL, rlimit=budget))
    bad = [c for c in counting.abstraction_checks(MODEL, short, budget) if c.status != "proved"]
    assert [c.invariant for c in bad] == ["abstraction:lane-blocks-in-table-slots"]


def test_an_abstraction_that_forgets_the_scratch_block_fails_the_cross_check():
    rule = counting.Rule((False, "reserved"), False)

    def forgets(a, r):  # the partition without the scratch block: one block more to reuse
        return [f for f in counting.abstraction(a, r)
                if not z3.eq(f, a.free + a.cache + a.R + a.held_l + a.held_o == a.K)] + [
            a.free + a.cache + a.held_l + a.held_o == a.K]
    ok = counting.soundness_at(MODEL, rule, *counting.SOUND_AT)
    assert ok.status == "proved", ok.detail
    c = counting.soundness_at(MODEL, rule, *counting.SOUND_AT, constraints=forgets)
    assert (c.invariant, c.status) == ("abstraction-sound-at:reserved-scratch", "counterexample")
    # ... and with it the rule would "prove" one block fewer: the cross-check is what stops it
    assert counting.rule_check(rule, fewer=1, constraints=forgets).status == "proved"


def test_a_capacity_fact_stronger_than_the_counting_fails_where_it_is_checked():
    """Part 3 may assume only what part 2 proves: a fact that also promises a reusable block
    to a lane whose table is full (one the rule does not count) is refuted by a state."""
    stronger = forall(spec.Lane, lambda ln: implies(spec.quiescent(), counting.ANY_REUSABLE))
    ok = counting.fact_holds_at(MODEL, False, True, 2, 2)
    assert ok.status == "proved", ok.detail
    c = counting.fact_holds_at(MODEL, False, True, 2, 2, fact=stronger)
    assert (c.invariant, c.status) == ("capacity-fact-at:reserved-scratch", "counterexample")


def test_progress_without_the_capacity_fact_is_not_proved(monkeypatch):
    """The progress check of part 3, at one budget: with the capacity fact it proves
    `idle_lane_admits` for every size; with only a fact that promises nothing about blocks it
    does not (an idle lane among full ones has no block to take)."""
    monkeypatch.setattr(counting, "SPLITS", ())  # (the whole query once more: fast to fail)
    case = counting.Case(False, "reserved")
    budget = 1_000_000
    good = list(counting.progress_checks(MODEL, case, rlimit=budget,
                                         props=("idle_lane_admits",)))
    assert [(c.invariant, c.status) for c in good] == [
        ("hypotheses-satisfiable", "proved"), ("idle_lane_admits", "proved")]
    nothing = forall(spec.Lane, lambda ln: implies(spec.busy(ln), spec.busy(ln)))
    bad = list(counting.progress_checks(MODEL, case, nothing, rlimit=budget,
                                        props=("idle_lane_admits",)))
    assert bad[1].invariant == "idle_lane_admits"
    assert bad[1].status != "proved"
    assert bad[1].size == case.size


def test_every_combination_is_proved_for_every_size_or_named_bounded():
    for f in capacity.COMBINATIONS:
        assert sum(c.covers(f) for c in counting.CASES + counting.BOUNDED_ONLY) == 1, f.name
    scope = counting.t_scope(MODEL)
    assert [c.invariant for c in scope] == [f"bounded-only:{c.name}"
                                            for c in counting.BOUNDED_ONLY]
    assert all(counting.WHY_BOUNDED in c.detail for c in scope)


def test_verify_plans_the_counting_tasks_and_their_obligations(monkeypatch):
    # (two rules of the eight, one with preemption: `verify` runs them all)
    monkeypatch.setattr(counting, "RULES", (counting.RULES[0], counting.RULES[5]))
    task = run.Task("counting", counting.t_rules, ())
    cs = counting.t_rules(MODEL)
    assert all(c.status == "proved" for c in cs), [(c.invariant, c.detail) for c in cs
                                                   if c.status != "proved"]
    assert run.incomplete_result(MODEL, task, cs) == []
    assert run.incomplete_result(MODEL, task, cs[1:])  # a missing one is named
