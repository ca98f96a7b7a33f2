"""Smoke test of the spec mutation harness (`atom_core.proofs.mutants`).

`make mutants` runs every mutant through every layer (minutes, never in CI); here a few chosen
mutants go through the two cheapest layers, with both searches kept small (3,000 one-lane and
500 two-lane states: the default one-lane budget of 50,000 made this test take over ten minutes
of CI), and still shows each verdict is computed: a dropped guard refuted by z3, a
capacity rule one block short caught by a stuck run, an equivalent mutant surviving with its
explanation, and z3 `unknown` counted as neither a kill nor a pass.
"""

from __future__ import annotations

import json

import pytest

from atom_core.proofs import checks
from atom_core.proofs import mutants as M

QUICK = M.Options(layers=("z3", "bmc"), bmc_states=3_000, bmc_wide_states=500)

GUARD = "drop-guard:admit_hit.dst_not_src"  # the copy would read the block it writes
CAPACITY = "capacity:prefix-cache-reserved-scratch-1"  # the seeds' rule, one block short
EQUIVALENT = "drop-update:transfer_end.junk"  # the drained block is freed in the same step


def test_every_guard_and_update_has_a_mutant() -> None:
    """Mutants come from the model: every named guard and every assignment of every action."""
    ids = set(M.catalogue())
    for a in M.base_model().actions:
        for g, _ in a.guards:
            assert f"drop-guard:{a.name}.{g}" in ids
        for i in range(len(a.updates)):
            assert f"drop-update:{a.name}.{M.update_name(a, i)}" in ids
    assert {m.family for m in M.catalogue().values()} == {*M.FAMILIES, "control"}


def test_explanations_name_current_mutants() -> None:
    assert set(M.EXPLAINED) <= set(M.catalogue()), set(M.EXPLAINED) - set(M.catalogue())
    assert all(r.startswith(("equivalent: ", "gap: ")) for r in M.EXPLAINED.values())


def test_chosen_mutants_are_classified() -> None:
    rep = M.report([GUARD, CAPACITY, EQUIVALENT], QUICK, jobs=1)
    by_id = {r.id: r for r in rep.results}
    assert rep.control.status == "survived", rep.control

    guard = by_id[GUARD]
    assert guard.status == "killed" and guard.killed_by == "z3"
    assert "copy_source_cached" in guard.layers[0].detail
    assert guard.layers[1].status == "skipped"  # cheapest first: stops at the first kill

    cap = by_id[CAPACITY]
    assert cap.killed_by == "bmc", cap.layers
    assert cap.layers[0].status == "survived"  # no action changed: nothing for z3
    assert cap.layers[1].detail.startswith("stuck idle_lane_admits")
    assert "replayed in z3" in cap.layers[1].detail

    eq = by_id[EQUIVALENT]
    assert eq.status == "survived" and [lr.status for lr in eq.layers] == ["survived"] * 2
    assert eq.explanation and eq.explanation.startswith("equivalent: ")
    assert rep.unexplained == [] and rep.stale == []
    assert len(rep.killed) == 2


def test_json_has_the_fields(tmp_path) -> None:
    out = tmp_path / "mutants.json"
    assert M.main(["--only", "drop-guard:submit.prompt_fits", "--layers", "z3",
                   "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"mode", "layers", "total", "killed", "kill_rate", "by_layer", "by_family",
            "survivors", "unexplained", "stale_explanations", "errors", "control",
            "mutants", "seconds"} <= set(data)
    assert data["mode"] == "cheap-first" and data["total"] == data["killed"] == 1
    assert data["kill_rate"] == 1.0 and data["by_layer"]["z3"]["killed"] == 1
    (m,) = data["mutants"]
    assert {"id", "family", "description", "status", "killed_by", "explanation",
            "unexplained", "layers", "seconds"} <= set(m)
    assert (m["id"], m["family"], m["status"], m["killed_by"]) == (
        "drop-guard:submit.prompt_fits", "guard", "killed", "z3")
    # refuted over small finite sorts first (a real counterexample, named with its size)
    assert m["layers"][0]["detail"].startswith("step waiting_prompt_fits @ submit (found with B=")


@pytest.fixture
def z3_gives_up(monkeypatch):
    """Every z3 query answers `unknown` (as on a timeout)."""
    M.z3_control.cache_clear()
    monkeypatch.setattr(checks, "solve", lambda facts, rlimit=0, bounded=False, **_kw: (
        "unknown", "resource limit exhausted", rlimit))
    yield
    M.z3_control.cache_clear()  # the control computed here must not be reused


def test_z3_unknown_is_neither_a_kill_nor_a_pass(z3_gives_up) -> None:
    r = M.z3_layer(M.catalogue()["drop-guard:submit.prompt_fits"], QUICK)
    assert r.status == "unknown" and "unknown" in r.detail
    result = M.MutantResult("x", "guard", "", (r,), 0.0)
    assert result.status == "unknown" and result.killed_by is None


def test_the_machine_is_given_a_capacity_mutants_rule() -> None:
    """The hypothesis layer hands the machine the mutant's table (no module patched): K is
    drawn around it and progress checked at or above it, one block below the proved rule for
    the mutated feature combination and equal to it elsewhere."""
    from hypothesis import find

    from atom_core._generated import core
    from atom_core.proofs.mutants.enumeration import offsets_of
    from atom_core.proofs.mutants.layer_hypothesis import machine_capacity
    from atom_core.testing.strategies import configs, min_blocks

    cap = machine_capacity(offsets_of(M.catalogue()[CAPACITY]))
    for lanes in (1, 2, 3):
        for prefix, scratch in ((True, "reserved"), (True, "dynamic"), (False, "reserved")):
            short = (prefix, scratch) == (True, "reserved")
            assert cap(lanes, prefix, scratch, 1, False) == \
                min_blocks(lanes, prefix, scratch) - short
    # a configuration the mutant's rule calls enough and the proved rule does not
    c = find(configs(core, True, "reserved", extra=(0, 0), capacity=cap), lambda c: True)
    assert c.K == cap(c.B, True, "reserved", c.T, False) < min_blocks(c.B, True, "reserved", c.T)
