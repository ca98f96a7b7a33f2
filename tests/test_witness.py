"""Committed stuck runs as certificates (proofs/witness.py): `verify` replays them, rejects a
tampered one, and searches again (failing `witnesses-current`) when one is stale."""

from __future__ import annotations

import attrs
import pytest

from atom_core._generated import witnesses as generated
from atom_core.proofs import capacity, run, witness
from atom_core.proofs.bmc import Trace
from atom_core.spec.model import MODEL

TIGHT, SINGLE = witness.committed()
FEATURES = {f.name: f for f in capacity.COMBINATIONS}
CASES = {c.name: c for c in capacity.SINGLE_BLOCK}
# A small row whose witness is cheap to replay: no cache, reserved scratch, one lane.
ROW = ("no cache, reserved scratch", 1)


def test_every_row_and_stuck_case_has_a_witness():
    f = FEATURES[ROW[0]]
    assert ROW in TIGHT and TIGHT[ROW].consts["B"] == 1
    assert set(SINGLE) == {c.name for c in capacity.SINGLE_BLOCK if c.stuck}
    assert all(n in FEATURES for n, _b in TIGHT)
    assert generated.__doc__ and "GENERATED" in open(generated.__file__).readline()
    assert capacity.expect(f, 1, TIGHT[ROW].consts["K"]).items() <= TIGHT[ROW].consts.items()


def test_committed_witness_replays():
    w = TIGHT[ROW]
    tr = witness.replay(MODEL, w, capacity.expect(FEATURES[ROW[0]], 1, w.consts["K"]))
    assert isinstance(tr, Trace), tr
    assert tr.violated == w.violated and len(tr.steps) == len(w.run)
    for name, w in SINGLE.items():
        tr = CASES[name].replay(MODEL, w)
        assert isinstance(tr, Trace), (name, tr)
        assert tr.violated == CASES[name].want


def test_witness_with_a_step_removed_is_rejected():
    w = TIGHT[ROW]
    f = FEATURES[ROW[0]]
    for i in range(len(w.run)):
        cut = attrs.evolve(w, run=w.run[:i] + w.run[i + 1:])
        assert isinstance(witness.replay(MODEL, cut, capacity.expect(f, 1, w.consts["K"])),
                          str), i


def test_witness_with_one_block_more_is_rejected():
    """The same run with one block more is no stuck run (at K_min the rule is proved): the
    replay says so, whether the witness claims the larger size or not."""
    w = TIGHT[ROW]
    f = FEATURES[ROW[0]]
    k = w.consts["K"]
    more = attrs.evolve(w, consts={**w.consts, "K": k + 1})
    assert "K=" in witness.replay(MODEL, more, capacity.expect(f, 1, k))
    why = witness.replay(MODEL, more, capacity.expect(f, 1, k + 1))
    assert isinstance(why, str) and "does not break" in why, why


def test_witness_of_the_wrong_case_is_rejected():
    a, b = "second-lane-never-admitted", "second-lane-blocks-decode"
    assert isinstance(CASES[b].replay(MODEL, SINGLE[a]), str)


def _capacity_only(tight, single, jobs=1):
    return run.verify(MODEL, 1, 3, jobs=jobs, witnesses=(tight, single), parts=("capacity",))


def test_committed_witnesses_certify_small_cutoff():
    """At a small cutoff every tight check comes from a replayed witness: nothing searched."""
    rep = _capacity_only(TIGHT, SINGLE)
    cur = next(c for c in rep.checks if c.invariant == "witnesses-current")
    assert cur.status == "proved", cur.detail
    tight = [c for c in rep.checks if c.kind == "capacity-tight" and c.invariant != cur.invariant]
    assert tight and all(c.status == "proved" and c.detail == "witness replayed" for c in tight)
    assert "capacity-tight-search" not in rep.tasks
    assert rep.stale == []


def test_stale_witness_is_searched_again_and_fails_witnesses_current():
    w = TIGHT[ROW]
    tampered = {**TIGHT, ROW: attrs.evolve(w, run=w.run[:-1])}
    rep = _capacity_only(tampered, SINGLE)
    cur = next(c for c in rep.checks if c.invariant == "witnesses-current")
    assert cur.status == "counterexample"
    assert ROW[0] in cur.detail and "make generate" in cur.detail
    # the row is still decided (by the search), and the search found the committed run again
    row = next(c for c in rep.checks if c.kind == "capacity-tight" and c.size.endswith(ROW[0])
               and c.size.startswith("B=1,"))
    assert row.status == "proved" and row.detail == "searched"
    assert rep.tasks["capacity-tight-search"] == 1
    assert rep.found["tight"][ROW] == w
    assert not rep.ok


def test_missing_single_block_witness_is_stale():
    single = dict(SINGLE)
    name = next(iter(single))
    del single[name]
    rep = _capacity_only(TIGHT, single)
    cur = next(c for c in rep.checks if c.invariant == "witnesses-current")
    assert cur.status == "counterexample" and name in cur.detail
    sb = next(c for c in rep.checks if c.invariant == f"single-block:{name}")
    assert sb.status == "proved" and sb.detail == "searched"


@pytest.mark.parametrize("jobs", [2])
def test_same_report_for_any_jobs(jobs):
    """The checks (names, sizes, statuses, order) do not depend on the number of processes."""
    def key(rep):
        return [(c.invariant, c.action, c.kind, c.status, c.size, c.detail) for c in rep.checks]
    assert key(_capacity_only(TIGHT, SINGLE, 1)) == key(_capacity_only(TIGHT, SINGLE, jobs))
