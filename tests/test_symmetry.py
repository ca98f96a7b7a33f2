"""The symmetry reduction of the bounded queries (`Universe.canonical`, `Universe.refuting`).

A bounded query cannot tell two lanes (blocks, requests, host slots) apart unless the model
names one, so its action parameters and the culprits of a refutation are taken as the first
elements. These tests show that the reduction is used only where it is sound and that it
changes no verdict: a bug at a lane the model names is still found, and planted bugs get the
same counterexamples with and without it.
"""

from __future__ import annotations

import pytest
import z3

from atom_core.proofs import capacity, checks, encode
from atom_core.spec import lang as L
from atom_core.spec.model import MODEL

pytestmark = pytest.mark.usefixtures("fresh_z3")
# The invariants checked per size: the bounded ones, and the arithmetic ones (which `verify`
# proves for all sizes, but whose planted bugs show here as counterexamples at small sizes).
BOTH = ("bounded", "arithmetic")


def _param(action: str, name: str) -> L.Var:
    return next(p for p in MODEL.get_action(action).params if p.name == name)


def _const(name: str) -> L.Const:
    return next(c for c in MODEL.consts if c.name == name)


def _off_chunk_admit_hit() -> L.Model:
    """admit_hit copying a prefix that is not whole chunks: caught by the bounded invariants
    only (see tests/test_proofs.py)."""
    n, c = _param("admit_hit", "n"), _const("C")
    return MODEL.with_guard("admit_hit", "n_whole_chunks", n >= c)


def _adding_guard(model: L.Model, action: str, name: str, expr: L.Expr) -> L.Model:
    m = model.copy()
    m.get_action(action).guards.append((name, expr))
    return m


def _not_proved(cs) -> set[tuple[str, str, str, str]]:
    return {(c.invariant, c.action, c.status, c.size) for c in cs if c.status != "proved"}


def test_the_model_names_no_lane_block_request_or_slot():
    """Else the reduction is off for that sort (the next tests), and verify gets slower."""
    assert encode.literal_sorts(MODEL) == set()


def test_canonical_parameters():
    u = checks.bounded_universe(MODEL, 2, 3, {"C": 128, "S": 4096})
    a = MODEL.get_action("admit_hit")
    facts = u.canonical(list(u.params(a, "p").values()))
    text = " ".join(str(f) for f in facts)
    # SCRATCH (symbolic here) leads the block chain, so a block parameter has two choices
    assert "SCRATCH" in text and "block2" not in text
    assert all(z3.is_or(f) for f in facts)
    # a constant fixed to block 0 keeps it: the first block parameter is block 0 or block 1
    fixed = checks.bounded_universe(MODEL, 2, 3, {"C": 128, "S": 4096, "SCRATCH": 0})
    facts = fixed.canonical(list(fixed.params(a, "p").values()))
    assert "SCRATCH" not in " ".join(str(f) for f in facts)
    # unbounded sorts: nothing
    assert encode.Universe(MODEL).canonical([]) == []


def test_a_named_element_turns_the_reduction_off_for_its_sort():
    lane0 = L.Lit(0, _param("admit_hit", "l").sort)
    m = _adding_guard(MODEL, "admit_hit", "not_lane0",
                      L.Not(L.Eq(_param("admit_hit", "l"), lane0)))
    assert encode.literal_sorts(m) == {"Lane"}
    u = checks.bounded_universe(m, 2, 3, {"C": 128, "S": 4096})
    facts = u.canonical(list(u.params(m.get_action("admit_hit"), "p").values()))
    assert "lane" not in " ".join(str(f) for f in facts)
    assert "block" in " ".join(str(f) for f in facts)


def test_a_bug_only_at_a_named_lane_is_still_found():
    """The off-chunk admit_hit, allowed only on lane 1: pinning the acting lane to lane 0 would
    hide it. The literal keeps the lanes apart, so it is found at B = 2 (and not at B = 1)."""
    mut = _off_chunk_admit_hit()
    l = _param("admit_hit", "l")
    mut = _adding_guard(mut, "admit_hit", "lane1_only", L.Not(L.Eq(l, L.Lit(0, l.sort))))
    bad = _not_proved(checks.bounded(mut, 2, 2, kinds=BOTH))
    assert {(i, a, s) for i, a, s, _ in bad} == {
        ("prefill_on_chunk_boundary", "admit_hit", "counterexample"),
        ("snapshots_on_chunk_boundaries", "admit_hit", "counterexample")}
    assert {size for *_, size in bad} == {"B=2,K=2"}


def _plain_refuting(self, e, env, bound, post=None, chain=(), symmetric=True):
    return [z3.Not(self.tr(e, env, bound, post))]


# Planted bugs the bounded invariants catch (measured), two of them only with two lanes apart
# (an update of `owner_lane`, a request admitted twice): with the acting lane pinned, the other
# lane is the one the bug shows on.
BOUNDED_MUTANTS = {
    "admit_hit.n_whole_chunks>=C": lambda: _off_chunk_admit_hit(),
    "admit_hit-dst_reusable": lambda: MODEL.without_guard("admit_hit", "dst_reusable"),
    "admit_miss-request_waiting": lambda: MODEL.without_guard("admit_miss", "request_waiting"),
    "grow-owner_lane": lambda: MODEL.without_update("grow", "owner_lane"),
    "grow-tail": lambda: MODEL.without_update("grow", "tail"),
}


@pytest.mark.parametrize("mutant", list(BOUNDED_MUTANTS))
def test_verdicts_equal_without_the_reduction(mutant, monkeypatch):
    """Bounded induction over a planted bug, with the reduction and without it (every
    parameter free, every quantifier expanded): the same obligations fail at the same sizes."""
    m = BOUNDED_MUTANTS[mutant]()
    action = mutant.split("-")[0].split(".")[0]
    m.actions = [m.get_action(action)]  # (the other actions' obligations are the model's)
    with_it = _not_proved(checks.bounded(m, 2, 3, base=False, kinds=BOTH))
    monkeypatch.setattr(encode.Universe, "canonical", lambda self, terms: [])
    monkeypatch.setattr(encode.Universe, "refuting", _plain_refuting)
    without = _not_proved(checks.bounded(m, 2, 3, base=False, kinds=BOTH))
    assert with_it == without
    assert with_it, "the planted bug must be caught (else this compares nothing)"


def test_progress_verdicts_equal_without_the_reduction(monkeypatch):
    """Progress at sizes below and at a rule's minimum: the same properties fail."""
    def run():
        out = {}
        for k in (2, 3, 4):
            for f, cs in capacity.progress_by_features(MODEL, 2, k).items():
                out[(k, f.name)] = tuple(c.status for c in cs)
        return out
    with_it = run()
    monkeypatch.setattr(encode.Universe, "refuting", _plain_refuting)
    assert run() == with_it
    assert any("counterexample" in v for v in with_it.values())
    assert any(all(s == "proved" for s in v) for v in with_it.values())
