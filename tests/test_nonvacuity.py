"""Non-vacuity (proofs/nonvacuity.py): the hypotheses of the proofs can hold, and `verify`
fails, naming the culprit, when they cannot (a contradictory law, a dead guard)."""

from __future__ import annotations

import pytest
import z3

from atom_core.proofs import capacity, checks, encode, nonvacuity, run
from atom_core.proofs.capacity import Features
from atom_core.spec import lang as L
from atom_core.spec import model as spec
from atom_core.spec.model import MODEL

# A few combinations that between them turn every feature on and off (the full list runs in
# `verify`): plain, the host tier with paged tables, hybrid with preemption, the prefix cache
# with preemption.
SOME = (Features(False, "reserved"), Features(True, "dynamic", host=True, tables=2),
        Features(True, "reserved", hybrid=True, tables=3, preempt=True),
        Features(True, "reserved", tables=2, preempt=True))


pytestmark = pytest.mark.usefixtures("fresh_z3")


@pytest.fixture
def few_combinations(monkeypatch):
    """`verify`'s non-vacuity section over `SOME` only (it runs every combination)."""
    monkeypatch.setattr(capacity, "COMBINATIONS", SOME)


def nonvacuity_report(model: L.Model) -> run.Report:
    return run.verify(model, parts=("nonvacuity",), jobs=1)


@pytest.fixture(scope="module")
def model_report() -> run.Report:
    """The unmutated model's section over `SOME` (plain data: shared by the tests below)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capacity, "COMBINATIONS", SOME)
        z3.z3._main_ctx = None
        encode.reset_names()
        return nonvacuity_report(MODEL)


def failing(report: run.Report) -> list:
    return [c for c in report.checks if c.status != "proved"]


def test_model_hypotheses_are_satisfiable(model_report):
    report = model_report
    assert failing(report) == []
    assert report.ok
    cs = report.checks
    assert {c.kind for c in cs} == {nonvacuity.KIND}
    # every combination, action and antecedent was checked, each by name, at every chunk and
    # block size proofs are asked at (the unaligned block: eager combinations only)
    names = {nonvacuity.label(f, c, s) for c, s in [(checks.CHUNK, checks.SEQ_LEN),
                                                   (capacity.TABLE_CHUNK, capacity.TABLE_SEQ_LEN)]
             for f in SOME}
    names |= {nonvacuity.label(f, checks.CHUNK, checks.UNALIGNED_SEQ_LEN)
              for f in SOME if f.tables == 1}
    assert {c.size for c in cs if c.invariant == nonvacuity.CONSISTENT} == names
    for a in MODEL.actions:
        assert {c.size for c in cs if c.invariant == nonvacuity.GUARD and c.action == a.name} \
            == names, a.name
    with_hyp = [p.name for p in MODEL.progress if nonvacuity.antecedent(p) is not None]
    assert with_hyp
    for p in with_hyp:
        assert {c.size for c in cs if c.invariant == nonvacuity.ANTECEDENT
                and c.action == p} == names, p
    assert {c.action for c in cs if c.invariant == nonvacuity.LIVE} == {
        a.name for a in MODEL.actions}


def test_dead_by_configuration_is_where_the_spec_says(model_report):
    """Host-tier actions are dead without `HOST` and live with it, as their `live_when(HOST)`
    says; each dead one names its reason, an unsat core with a constant. (PD imports, once dead
    with preemption, are live with it now.) Taking an entry over is live only with the prefix
    cache, on a model without sliding layers."""
    cs = model_report.checks
    plain, host, hybrid_preempt, prefix_preempt = (f.name for f in SOME)

    def guard(action: str, where: str):
        return next(c for c in cs if c.invariant == nonvacuity.GUARD and c.action == action
                    and c.size == where)

    for a in spec.HOST_ACTIONS:
        dead = guard(a, plain)
        assert dead.detail.startswith(nonvacuity.DEAD), (a, dead.detail)
        assert "constant " in dead.detail
        assert guard(a, host).detail.startswith("witness"), a
    assert guard("admit_import", hybrid_preempt).detail.startswith("witness")
    assert guard("admit_import", plain).detail.startswith("witness")
    for where in (host, prefix_preempt):
        assert guard("admit_adopt", where).detail.startswith("witness"), where
    for where in (plain, hybrid_preempt):
        dead = guard("admit_adopt", where)
        assert dead.detail.startswith(nonvacuity.DEAD) and "constant " in dead.detail, dead


def with_law(model: L.Model, name: str, expr: L.Expr) -> L.Model:
    m = model.copy()
    m.laws = [*m.laws, L.Named(name, expr, "law", "planted")]
    return m


def test_contradictory_law_fails_verify_naming_it(few_combinations):
    """The issue's plant: beside `push_adds_a_token`, a law that a push adds two tokens. Every
    relational obligation is then "proved"; the non-vacuity section fails, naming both."""
    planted = with_law(MODEL, "push_adds_two_tokens", L.forall(
        (spec.Seq, L.INT), lambda q, t: spec.slen(spec.push(q, t)) == spec.slen(q) + 2))
    report = nonvacuity_report(planted)
    assert not report.ok
    bad = [c for c in failing(report) if c.invariant == nonvacuity.CONSISTENT]
    assert {f.name for f in SOME} <= {c.size for c in bad}  # (and at the other C and S)
    for c in bad:
        assert c.status == "counterexample"
        assert "law push_adds_two_tokens" in c.detail and "law push_adds_a_token" in c.detail


def test_the_issue_plant_is_proved_vacuously_and_caught_here(few_combinations):
    """The audit's finding: with that law and `dst_not_src` dropped from `admit_hit`, the
    relational check calls the broken step proved (every hypothesis set is contradictory);
    the non-vacuity section is what fails."""
    planted = with_law(MODEL.without_guard("admit_hit", "dst_not_src"), "push_adds_two_tokens",
                       L.forall((spec.Seq, L.INT), lambda q, t:
                                spec.slen(spec.push(q, t)) == spec.slen(q) + 2))
    (task,) = [t for t in run.invariant_tasks(planted) if t.args == ("step", "admit_hit")]
    cs = run.run_here(planted, task)  # (`verify`'s task for the step)
    assert [c.status for c in cs if c.invariant == "copy_source_cached"] == ["proved"]
    bad = failing(nonvacuity_report(planted))
    assert bad and all(c.invariant in (nonvacuity.CONSISTENT, nonvacuity.LIVE,
                                       nonvacuity.ANTECEDENT_LIVE)
                       or "unsatisfiable" in c.detail for c in bad)
    assert any("law push_adds_two_tokens" in c.detail for c in bad)


def test_law_contradicting_an_axiom_fails_verify(few_combinations):
    """A law no ground term of the state triggers: `empty_has_no_tokens` is an axiom, so a law
    that every sequence has a token clashes with it through the axiom's own term."""
    planted = with_law(MODEL, "every_seq_has_a_token",
                       L.forall(spec.Seq, lambda q: spec.slen(q) > 0))
    bad = [c for c in failing(nonvacuity_report(planted))
           if c.invariant == nonvacuity.CONSISTENT]
    assert bad and all("law every_seq_has_a_token" in c.detail
                       and "axiom empty_has_no_tokens" in c.detail for c in bad)


def with_dead_guard(model: L.Model, action: str) -> tuple[L.Model, str]:
    """A guard that contradicts an invariant (so the action never runs, and every step
    obligation of it is vacuous): the negation of the first relational invariant."""
    inv = next(i for i in model.invariants if i.kind == "relational")
    m = model.copy()
    a = m.get_action(action)
    a.guards = [*a.guards, ("planted_dead", L.Not(inv.expr))]
    return m, inv.name


def test_dead_guard_fails_verify_naming_it(few_combinations):
    action = "admit_hit"
    planted, inv = with_dead_guard(MODEL, action)
    report = nonvacuity_report(planted)
    assert not report.ok
    bad = failing(report)
    assert {(c.invariant, c.action) for c in bad} >= {(nonvacuity.GUARD, action)}
    assert {c.action for c in bad if c.invariant == nonvacuity.GUARD} == {action}
    for c in bad:
        if c.invariant == nonvacuity.GUARD:
            assert c.status == "counterexample"
            assert f"guard {action}.planted_dead" in c.detail and f"invariant {inv}" in c.detail


def test_configuration_mixed_into_a_state_condition_is_not_expected():
    """A guard killed by a constant inside a state condition (no invariant involved, not a
    gate on its own) is reported, not excused as dead by configuration."""
    m = MODEL.copy()
    a = m.get_action("decode")
    a.guards = [*a.guards, ("planted", ~spec.HOST & L.exists(spec.Lane, lambda l: spec.busy(l)))]
    f = Features(True, "reserved", host=True)
    cs = nonvacuity.check(m, (f,))
    c = next(c for c in cs if c.invariant == nonvacuity.GUARD and c.action == "decode")
    assert c.status == "counterexample", c
    assert "guard decode.planted" in c.detail and "constant HOST = True" in c.detail


def test_action_dead_in_every_combination_fails():
    m = MODEL.copy()
    a = m.get_action("decode")
    a.guards = [*a.guards, ("planted_gate", spec.HOST & ~spec.PREFIX)]
    fs = SOME[:2]
    cs = nonvacuity.check(m, fs)
    cs += nonvacuity.live_somewhere(m, cs, fs)
    live = next(c for c in cs if c.invariant == nonvacuity.LIVE and c.action == "decode")
    assert live.status == "counterexample"
    assert "no witness" in live.detail


def test_every_dead_action_declares_where_it_is_live():
    """The spec declares where each action and antecedent can hold, and only host, prefix,
    hybrid, preemption and paged-table features are named."""
    declared = {a.name: a.live_when for a in MODEL.actions if a.live_when is not L.TRUE}
    assert set(spec.HOST_ACTIONS) <= set(declared)
    assert {"admit_hit", "grow", "preempt", "snapshot", "import_grow"} <= set(declared)
    for a in MODEL.actions:
        assert L.reads_only_constants(a.live_when), a.name


def test_gate_planted_where_the_action_should_fire_fails():
    """The plant an inferred rule let through: a gate `~HYBRID` in `admit_hit` reads only
    constants, so an unsat core naming `HYBRID = True` looked like a feature turned off. The
    spec says admit_hit fires wherever the prefix cache is on, so verify fails with a hybrid
    model, and only there."""
    m = MODEL.copy()
    a = m.get_action("admit_hit")
    a.guards = [*a.guards, ("planted_gate", ~spec.HYBRID)]
    cs = nonvacuity.check(m, SOME)
    bad = [c for c in cs if c.status != "proved"]
    assert [(c.invariant, c.action, c.size) for c in bad] == [
        (nonvacuity.GUARD, "admit_hit", SOME[2].name)]
    assert bad[0].status == "counterexample"
    assert "live_when" in bad[0].detail and "guard admit_hit.planted_gate" in bad[0].detail
    assert "constant HYBRID = True" in bad[0].detail


def test_action_live_where_the_spec_says_dead_fails():
    """`spill` without its `host_cache_on` gate can fire with no host tier (every slot is
    empty): its live_when(HOST) says it must not, so verify fails there."""
    m = MODEL.copy()
    a = m.get_action("spill")
    a.guards = [g for g in a.guards if g[0] != "host_cache_on"]
    no_host, host = Features(True, "dynamic"), Features(True, "dynamic", host=True)
    cs = nonvacuity.check(m, (no_host, host))
    bad = [c for c in cs if c.status != "proved"]
    assert [(c.invariant, c.action, c.size) for c in bad] == [
        (nonvacuity.GUARD, "spill", no_host.name)]
    assert "satisfiable" in bad[0].detail and "live_when (HOST)" in bad[0].detail


def test_live_when_reads_only_constants():
    m = MODEL.copy()

    def planted(l):
        """A live_when over the state."""
        L.live_when(spec.busy(l))

    planted.__annotations__ = {"l": spec.Lane}
    saved = list(L._MODEL)
    L.use_model(m)
    try:
        with pytest.raises(TypeError, match="only configuration constants"):
            m.action(planted)
    finally:
        L._MODEL[:] = saved


def test_live_when_is_shown_as_written():
    assert L.show(MODEL.get_action("grow_host_hit").live_when) == "HOST & (1 < T)"
    assert L.show(MODEL.get_action("snapshot").live_when) == "HYBRID & PREFIX"


# --------------------------------------------------------------------------- every size
# Every hypothesis set an obligation assumes is checked where it is assumed: the capacity
# table's chunk and block size (C = 2, S = 8), the unaligned eager block (S = 4000), each
# bounded size, each progress case. A planted axiom that holds at the artifact's sizes only
# (C = 128, S = 4096, where the non-vacuity universes used to be alone) makes every progress
# obligation at C = 2 "proved"; these tests show each place fails `verify` naming it.

def with_axiom(model: L.Model, name: str, expr: L.Expr) -> L.Model:
    m = model.copy()
    m.axioms = [*m.axioms, L.Named(name, L.lift(expr, L.BOOL), "axiom", "planted")]
    return m


NOT_THE_TABLE_CHUNK = with_axiom(MODEL, "planted_chunk_above_2", spec.C > 2)
NOT_UNALIGNED = with_axiom(MODEL, "planted_block_not_4000", spec.S != 4000)


def test_every_chunk_and_block_size_is_a_nonvacuity_setting():
    """The settings cover every (C, S) the plan proves anything at."""
    settings = {(c, s) for c, s, _fs in run.nonvacuity_settings()}
    assert settings == {(checks.CHUNK, checks.SEQ_LEN),
                        (capacity.TABLE_CHUNK, capacity.TABLE_SEQ_LEN),
                        (checks.CHUNK, checks.UNALIGNED_SEQ_LEN)}
    unaligned = next(fs for c, s, fs in run.nonvacuity_settings()
                     if s == checks.UNALIGNED_SEQ_LEN)
    assert unaligned and all(f.tables == 1 for f in unaligned)


@pytest.mark.parametrize("planted, chunk, seq_len, axiom", [
    (NOT_THE_TABLE_CHUNK, capacity.TABLE_CHUNK, capacity.TABLE_SEQ_LEN, "planted_chunk_above_2"),
    (NOT_UNALIGNED, checks.CHUNK, checks.UNALIGNED_SEQ_LEN, "planted_block_not_4000"),
], ids=["table-chunk", "unaligned-block"])
def test_axiom_false_at_one_chunk_or_block_size_fails_nonvacuity_there(planted, chunk, seq_len,
                                                                        axiom):
    f = Features(False, "reserved")
    assert all(c.status == "proved"
               for c in nonvacuity.check(planted, (f,), checks.CHUNK, checks.SEQ_LEN))
    bad = [c for c in nonvacuity.check(planted, (f,), chunk, seq_len) if c.status != "proved"]
    consistent = [c for c in bad if c.invariant == nonvacuity.CONSISTENT]
    assert [c.size for c in consistent] == [nonvacuity.label(f, chunk, seq_len)]
    assert consistent[0].status == "counterexample"
    assert f"axiom {axiom}" in consistent[0].detail


def test_axiom_false_at_the_table_chunk_fails_every_progress_case_naming_it():
    """The issue's plant: every progress obligation at C = 2 comes back proved, but each
    case's inhabitation check fails, naming the axiom and the constant it clashes with."""
    found = capacity.progress_by_features(NOT_THE_TABLE_CHUNK, 2, 2, 4, capacity.TABLE_SEQ_LEN,
                                          capacity.TABLE_CHUNK)
    assert found
    for f, cs in found.items():
        prog = [c for c in cs if c.kind == "capacity"]
        assert prog and all(c.status == "proved" for c in prog), f.name  # vacuously
        (inh,) = [c for c in cs if c.invariant == checks.INHABITED]
        assert inh.status == "counterexample" and inh.kind == checks.NONVACUITY
        assert "axiom planted_chunk_above_2" in inh.detail, inh.detail
    # and the row built from them neither counts the size as safe nor hides why
    f = Features(False, "reserved")
    one = capacity.progress_by_features(NOT_THE_TABLE_CHUNK, 1, 1, 4, capacity.TABLE_SEQ_LEN,
                                        capacity.TABLE_CHUNK, (f,))
    row = capacity.assemble(f, {(1, 1): one}, 1, 1)
    assert row.minimum == {1: None}
    assert [c.status for c in row.checks if c.invariant == checks.INHABITED] == \
        ["counterexample"]


def test_model_is_inhabited_at_every_progress_case():
    found = capacity.progress_by_features(MODEL, 2, 3, 4, capacity.TABLE_SEQ_LEN,
                                          capacity.TABLE_CHUNK)
    inh = [c for cs in found.values() for c in cs if c.invariant == checks.INHABITED]
    assert len(inh) == len(found) and all(c.status == "proved" for c in inh)


def test_axiom_false_at_one_bounded_size_fails_that_size_naming_it():
    """A bounded size whose hypotheses clash (here K = 3 excluded by a planted axiom) is
    caught at that size only, by the task `verify` runs for it."""
    planted = with_axiom(MODEL, "planted_not_three_blocks", spec.K != 3)
    cs = run.t_bounded(planted, 1, 3)
    (inh,) = [c for c in cs if c.invariant == checks.INHABITED]
    assert inh.status == "counterexample" and "axiom planted_not_three_blocks" in inh.detail
    task = run.Task("bounded", run.t_bounded, (1, 3))
    assert run.incomplete_result(planted, task, cs) == []
    assert [c.status for c in run.t_bounded(planted, 1, 2)
            if c.invariant == checks.INHABITED] == ["proved"]
