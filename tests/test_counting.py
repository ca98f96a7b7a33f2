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


def one_block_short(monkeypatch, rule: counting.Rule) -> None:
    """The committed table (as `make generate` would write it from a wrong proof) one block
    short for `rule`: the rule is read from the generated module, not restated."""
    if rule.preempt:
        lone, shared = committed.PREEMPT_BLOCKS[rule.key]
        monkeypatch.setitem(committed.PREEMPT_BLOCKS, rule.key, (lone - 1, shared - 1))
    else:
        monkeypatch.setitem(committed.SCRATCH_BLOCKS, rule.key,
                            committed.SCRATCH_BLOCKS[rule.key] - 1)


def rules_task(monkeypatch, *rules: counting.Rule) -> list:
    """`verify`'s task for parts 1 and 2 (`counting.t_rules`), run as `verify` runs it, with
    only `rules` (it runs every rule the same way)."""
    monkeypatch.setattr(counting, "RULES", rules)
    task = next(t for t in run.counting_tasks() if t.fn is counting.t_rules)
    return run.run_here(MODEL, task)


def failing(cs) -> dict[str, str]:
    return {c.invariant: c.status for c in cs if c.status != "proved"}


@pytest.mark.parametrize("rule", counting.RULES, ids=lambda r: r.name)
def test_one_block_fewer_fails_naming_the_rule(rule, monkeypatch):
    one_block_short(monkeypatch, rule)
    cs = rules_task(monkeypatch, rule)
    bad = failing(cs)
    assert bad[f"count:{rule.name}"] == "counterexample", bad
    (c,) = [c for c in cs if c.invariant == f"count:{rule.name}"]
    assert "no reusable block at B=" in c.detail
    assert not any(n.startswith("abstraction") for n in bad), bad


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


def test_an_abstraction_fact_one_slot_short_fails_naming_it(monkeypatch):
    """Claiming every lane block sits below nblocks - 1 (one table slot fewer) is refuted."""
    true_facts = counting.abstraction_facts

    def short(u, st):
        facts = dict(true_facts(u, st))
        b = z3.Const("b!short", u.z3sorts["Block"])
        lane = u.value("LANE", spec.Owner)
        nb = st["nblocks"](st["owner_lane"](b))
        facts["lane-blocks-in-table-slots"] = z3.ForAll([b], z3.Implies(
            st["owner"](b) == lane, counting._slot(u, st, b) < nb - 1))
        return list(facts.items())
    # (at a budget the true facts need a tenth of: over unbounded sorts z3 answers a false one
    # `unknown`, which fails the run like a counterexample)
    monkeypatch.setattr(counting, "RLIMIT", 500_000)
    assert failing(rules_task(monkeypatch)) == {}
    monkeypatch.setattr(counting, "abstraction_facts", short)
    assert list(failing(rules_task(monkeypatch))) == ["abstraction:lane-blocks-in-table-slots"]


def test_an_abstraction_that_forgets_the_scratch_block_fails_the_cross_check(monkeypatch):
    """The partition without the scratch block (one block more to reuse): with it the rule
    would "prove" one block fewer, and the cross-check is what fails `verify`'s task."""
    rule = counting.Rule((False, "reserved"), False)
    true_abstraction = counting.abstraction

    def forgets(a, r):
        return [f for f in true_abstraction(a, r)
                if not z3.eq(f, a.free + a.cache + a.R + a.held_l + a.held_o == a.K)] + [
            a.free + a.cache + a.held_l + a.held_o == a.K]
    monkeypatch.setattr(counting, "abstraction", forgets)
    one_block_short(monkeypatch, rule)
    bad = failing(rules_task(monkeypatch, rule))
    assert f"count:{rule.name}" not in bad
    assert bad[f"abstraction-sound-at:{rule.name}"] == "counterexample", bad


def test_a_capacity_fact_stronger_than_the_counting_fails_where_it_is_checked(monkeypatch):
    """Part 3 may assume only what part 2 proves: a fact that also promises a reusable block
    to a lane whose table is full (one the rule does not count) is refuted by a state."""
    stronger = forall(spec.Lane, lambda ln: implies(spec.quiescent(), counting.ANY_REUSABLE))
    rule = counting.Rule((False, "reserved"), False)
    monkeypatch.setattr(counting, "capacity_fact", lambda preempt: stronger)
    bad = failing(rules_task(monkeypatch, rule))
    assert bad == {"capacity-fact-at:reserved-scratch": "counterexample"}, bad


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
