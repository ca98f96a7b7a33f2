"""Audit of the proof layer: ways `verify` could report success without deciding what it
claims, each closed in proofs/run.py, proofs/checks.py, proofs/capacity.py or the CLI.

- progress (the capacity table, at chunk 2 / block 8) assumed the arithmetic and bounded
  invariants, which were proved only at chunk 128 / block 4096 (and 4000);
- a committed tight witness at another chunk or block size certified a row proved at 2 / 8;
- a task that returned fewer checks than its obligations (or none) left the run OK;
- a task that raised or whose worker died surfaced as a bare traceback (BrokenProcessPool),
  not a failure naming what was not decided; and a run that decided nothing was OK.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import attrs
import pytest
from test_witness import CASES, FEATURES, ROW, SINGLE, TIGHT

from atom_core.cli import proofs as cli
from atom_core.proofs import capacity, checks, run, witness
from atom_core.proofs.bmc import Trace
from atom_core.spec.model import MODEL

pytestmark = pytest.mark.usefixtures("fresh_z3")

ANY = checks.bounded_label(1, 1, None, None)  # B=1, K=1, every chunk and block size


# --------------------------------------------------------------- invariants where assumed
def test_progress_assumes_only_invariants_proved_at_its_own_sizes() -> None:
    """The capacity table's progress queries run at chunk 2, block 8 and assume every
    invariant: `verify` must prove the bounded ones at each of those sizes (for every chunk
    and block size) and the arithmetic ones at that chunk and block size, and say so."""
    rep = run.verify(MODEL, 1, 1, parts=("bounded", "capacity"), jobs=1)
    by_size: dict[str, set[str]] = {}
    for c in rep.checks:
        if c.kind in ("base", "step"):
            by_size.setdefault(c.size, set()).add(c.status)
    assert by_size.get(ANY) == {"proved"}, sorted(by_size)
    assert by_size.get(checks.arithmetic_label(capacity.TABLE_CHUNK,
                                               capacity.TABLE_SEQ_LEN)) == {"proved"}
    bounded = {i.name for i in MODEL.invariants if i.kind == "bounded"}
    assert bounded and {c.invariant for c in rep.checks
                        if c.size == ANY and c.kind != checks.NONVACUITY} == bounded
    # (and the hypotheses they assume hold together there)
    assert [c.status for c in rep.checks if c.size == ANY and c.kind == checks.NONVACUITY] \
        == ["proved"]
    (assumed,) = [c for c in rep.checks if c.invariant == run.ASSUMED]
    assert assumed.status == "proved", assumed.detail


def test_progress_over_invariants_proved_elsewhere_fails() -> None:
    """The check itself: progress at the table's sizes with the invariants proved only at the
    artifact's (what `verify` planned before) is named as an unproved assumption; a run of
    the capacity part alone proves no invariant, and says so."""
    prog = run.Task("capacity", run.t_progress, (1, 2, 1, capacity.TABLE_SEQ_LEN,
                                                  capacity.TABLE_CHUNK))
    at_artifact = [run.Task("arithmetic", run.t_arithmetic, (checks.SEQ_LEN, checks.CHUNK)),
                   run.Task("bounded", run.t_bounded, (1, 2, checks.SEQ_LEN, checks.CHUNK))]
    c = run.assumed_where_proved([prog], at_artifact)
    assert c.status == "counterexample"
    assert "bounded invariants at B=1,K=2,C=2,S=8" in c.detail
    assert "arithmetic invariants at C=2,S=8" in c.detail
    at_table = [run.Task("arithmetic", run.t_arithmetic, (capacity.TABLE_SEQ_LEN,
                                                          capacity.TABLE_CHUNK)),
                run.Task("bounded", run.t_bounded, (1, 2, capacity.TABLE_SEQ_LEN,
                                                    capacity.TABLE_CHUNK))]
    assert run.assumed_where_proved([prog], at_artifact + at_table).status == "proved"
    any_size = [run.Task("bounded", run.t_bounded, (1, 2))]  # (C and S left to the axioms)
    assert run.assumed_where_proved([prog], at_table[:1] + any_size).status == "proved"


# --------------------------------------------------------------- witnesses at other sizes
@pytest.mark.parametrize("sizes", [{"C": 4, "S": 16}, {"C": 128, "S": 4096}])
def test_a_witness_at_other_chunk_or_block_sizes_certifies_nothing(sizes: dict) -> None:
    """The no-cache row's run (a single submit) replays at any chunk and block size; the row is
    proved safe at K_min at chunk 2 / block 8, so only a stuck run at those sizes shows it
    tight in one configuration. Likewise a single-block case's run."""
    w = TIGHT[ROW]
    f = FEATURES[ROW[0]]
    moved = attrs.evolve(w, consts={**w.consts, **sizes})
    assert isinstance(witness.replay(MODEL, w, capacity.expect(f, 1, w.consts["K"])), Trace)
    why = witness.replay(MODEL, moved, capacity.expect(f, 1, w.consts["K"]))
    assert isinstance(why, str) and f"C={sizes['C']}" in why, why
    name, sw = next(iter(SINGLE.items()))
    assert isinstance(CASES[name].replay(MODEL, sw), Trace)
    why = CASES[name].replay(MODEL, attrs.evolve(sw, consts={**sw.consts, **sizes}))
    assert isinstance(why, str) and f"C={sizes['C']}" in why, why


# --------------------------------------------------------------- obligations accounted for
def test_a_task_that_loses_a_check_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bounded task that reports one check fewer than its obligations (a buggy task, a lost
    result): every check it does report is proved, and the run must still fail, naming the
    obligation nobody decided."""
    t_bounded = run.t_bounded
    monkeypatch.setattr(run, "t_bounded", lambda *args: t_bounded(*args)[:-1])
    rep = run.verify(MODEL, 1, 1, parts=("bounded",), jobs=1)
    assert rep.checks and all(x.status == "proved" for x in rep.checks
                              if x.invariant != getattr(run, "COMPLETE", None))
    assert not rep.ok
    (c,) = [c for c in rep.checks if c.invariant == run.COMPLETE]
    last_bounded = [i.name for i in MODEL.invariants if i.kind == "bounded"][-1]
    assert f"('{last_bounded}', '{MODEL.actions[-1].name}', 'step', '{ANY}')" in c.detail


def test_a_progress_result_missing_a_property_is_incomplete() -> None:
    args = (1, 1, 1, capacity.TABLE_SEQ_LEN, capacity.TABLE_CHUNK)
    task = run.Task("capacity", run.t_progress, args)
    got = run.t_progress(MODEL, *args)
    assert run.incomplete_result(MODEL, task, got) == []
    f = next(iter(got))
    lossy = {**got, f: got[f][:-1]}
    (why,) = run.incomplete_result(MODEL, task, lossy)
    assert f.name in why and "B=1,K=1,C=2,S=8" in why
    gone = {k: v for k, v in got.items() if k != f}
    assert run.incomplete_result(MODEL, task, gone) == [
        f"progress of {f.name} at B=1,K=1,C=2,S=8"]


def test_a_complete_run_has_no_missing_obligation() -> None:
    """The expectation is the tasks' own output (no false alarm), and a repeated check is
    flagged as well as a missing one."""
    task = run.Task("bounded", run.t_bounded, (1, 1))
    got = run.t_bounded(MODEL, 1, 1)
    assert run.incomplete_result(MODEL, task, got) == []
    assert len(got) == len(run.expected_obligations(MODEL, task) or [])
    twice = run.incomplete_result(MODEL, task, got + got[:1])
    assert len(twice) == 1 and "repeated" in twice[0]
    rel = run.Task("relational", run.t_relational, ("transition", MODEL.actions[0].name))
    want = run.expected_obligations(MODEL, rel)
    assert want and len(want) == len(MODEL.transition_invariants)
    assert len(run.incomplete_result(MODEL, rel, [])) == len(want)


def test_a_run_that_decides_nothing_is_not_ok() -> None:
    rep = run.verify(MODEL, 1, 1, parts=(), jobs=1)
    assert rep.checks == [] and not rep.ok


# --------------------------------------------------------------- tasks that raise or die
def _dies(_model: Any) -> None:
    os._exit(3)  # (as a z3 abort would take the worker down)


def _raises(_model: Any) -> None:
    raise z3_gave_up()


class z3_gave_up(Exception):  # noqa: N801 (reads as what happened)
    pass


def test_a_worker_that_dies_is_a_named_failure() -> None:
    task = run.Task("bounded", _dies, ())
    with run.Runner(MODEL, 2) as runner, pytest.raises(Exception) as info:
        runner.run([task])
    assert "bounded task _dies() failed" in str(info.value)  # (not a bare BrokenProcessPool)
    assert type(info.value).__name__ == "TaskFailed"


def test_a_task_that_raises_is_a_named_failure() -> None:
    with run.Runner(MODEL, 1) as runner, pytest.raises(Exception) as info:
        runner.run([run.Task("bounded", _raises, ())])
    assert "bounded task _raises() failed: z3_gave_up()" in str(info.value)


def test_the_cli_reports_a_failed_task_as_a_failed_run(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    def broken(*_a: Any, **_k: Any) -> None:
        raise run.TaskFailed("capacity task t_progress(4, 8) failed: BrokenProcessPool()")

    monkeypatch.setattr(run, "verify", broken)
    monkeypatch.setattr(cli, "z3_or_exit", lambda: None)
    args = argparse.Namespace(json=False, quiet=True, max_lanes=None, max_blocks=None,
                              deep=False, jobs=1)
    assert cli.cmd_verify(args) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "t_progress(4, 8)" in err and "not decided" in err



# --------------------------------------------------------------- every invariant has a mutant
# The guard/update sweep (tests/test_proofs.py) asks that every dropped guard or update be
# caught by *some* obligation, and `make mutants` the same; nothing asked that every invariant
# be the one that catches some planted bug. An invariant no mutant breaks may be proved only
# because it says nothing (true of every state) or assumed by the rest without being tested.
# Each mutant below (one dropped guard or update, enumerated as `make mutants` does) must be
# refuted at the named invariants by the very tasks `verify` runs (a real counterexample);
# together they name every invariant of the model (chosen greedily from a run of every
# single-drop mutant against every obligation: each invariant is broken by some).
RELATIONAL_MUTANTS: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("guard", "import_done", "request_importing"): (
        "cache_key_is_content", "cached_content_untouched", "copy_only_while_prefilling",
        "copy_source_holds_prefix", "draining_has_transfer", "ended_is_final",
        "entry_snapshots_were_taken", "full_block_holds_its_key", "hybrid_hit_has_snapshot",
        "import_target_untouched", "lane_computes_its_prompt", "lane_holds_its_tokens",
        "lane_seq_length", "lane_snapshots_are_its_own", "length_within_block",
        "load_reads_a_loading_slot", "moving_lane_has_transfer",
        "pinned_block_transfer_running", "prefill_before_prompt_end",
        "running_request_has_lane", "running_transfer_pins_its_block",
        "storing_slot_key_is_content", "submitted_request_has_prompt",
        "transfer_pins_what_it_uses"),
    ("guard", "admit_miss", "dst_reusable"): (
        "copy_at_its_position", "copy_source_cached", "copy_target_not_ready",
        "lane_block_owned", "no_block_in_two_tables", "owned_block_in_table",
        "scratch_is_reserved_block", "storing_slot_reads_a_spilling_block",
        "transfer_block_held", "transfer_names_lane_request"),
    ("guard", "load_fail", "load_in_flight"): (
        "decode_after_prompt", "export_after_prefill", "host_head_is_first_chunk",
        "host_key_is_content", "host_needs_host_cache", "lane_local_state_is_its_own",
        "spilling_block_has_its_store"),
    ("guard", "admit_import", "request_waiting"): (
        "busy_lane_runs_its_request", "import_blocks_untouched",
        "importing_blocks_have_no_snapshots", "imports_grow_one_at_a_time",
        "lane_prompt_fits"),
    ("guard", "grow_hit", "lane_prefilling"): (
        "entry_snapshots_are_its_own", "idle_lane_has_no_snapshots",
        "lane_blocks_start_in_table", "snapshots_need_hybrid"),
    ("guard", "admit_miss", "lane_idle"): ("blocks_do_not_overlap", "lane_snapshots_were_taken"),
    ("guard", "submit", "request_is_new"): ("requeued_only_by_preemption",),
    ("guard", "submit", "prompt_not_empty"): ("waiting_prompt_fits",),
    ("update", "submit", "phase"): ("unsubmitted_request_has_no_prompt",),
    ("update", "admit_miss", "nblocks"): ("table_within_T",),
    ("update", "admit_miss", "tail"): ("scratch_never_in_table",),
    ("guard", "admit_hit", "lane_idle"): ("loading_slot_has_its_lane",),
    ("guard", "finish", "lane_decoding"): ("cache_head_is_first_chunk",),
    ("guard", "finish", "keep_needs_prefix_cache"): ("cache_needs_prefix_cache",),
    ("guard", "store_done", "slot_storing"): ("host_content_untouched",),
    ("update", "admit_import", "transfer_req"): ("pinned_for_its_transfer",),
}
# The counting and arithmetic invariants, refuted by the bounded check at small sizes.
BOUNDED_MUTANTS: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("update", "admit_miss", "owner"): ("lane_blocks_are_its_table",),
    ("update", "admit_miss", "start"): ("tables_are_dense",),
    ("guard", "admit_hit", "n_whole_chunks"): ("prefill_on_chunk_boundary",
                                               "snapshots_on_chunk_boundaries"),
    ("guard", "grow", "dst_reusable"): ("one_scratch_block_when_reserved",),
}


def _mutant(kind: str, action: str, piece: str) -> Any:
    m = (MODEL.without_guard(action, piece) if kind == "guard"
         else MODEL.without_update(action, piece))
    m = m.copy()
    m.actions = [m.get_action(action)]  # (its obligations are the only ones that change)
    return m


def test_every_invariant_is_broken_by_some_mutant() -> None:
    named = {n for invs in (*RELATIONAL_MUTANTS.values(), *BOUNDED_MUTANTS.values())
             for n in invs}
    every = ({i.name for i in MODEL.invariants}
             | {t.name for t in MODEL.transition_invariants})
    assert every - named == set(), "invariants no planted bug is shown to break"
    assert named - every == set()
    assert all(i.kind in ("bounded", "arithmetic") for i in MODEL.invariants
               if i.name in {n for v in BOUNDED_MUTANTS.values() for n in v})


# A refutable obligation spends its task's first try before the task searches small finite
# sorts for a counterexample: a smaller first try finds the same counterexamples sooner (the
# final try keeps `verify`'s budget, so no verdict changes: tests/test_proofs.py, MUTANT_FIRST_TRY).
MUTANT_FIRST_TRY = 500_000


@pytest.fixture
def quick_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    from atom_core.proofs import limits

    monkeypatch.setattr(limits, "SHORT", MUTANT_FIRST_TRY)


def _broken(model: Any, tasks: list[run.Task]) -> set[str]:
    """The invariants `verify`'s own `tasks`, run on `model` as `verify` runs them
    (`run.run_here`), refute: a counterexample, not `unknown`."""
    return {c.invariant for t in tasks for c in run.run_here(model, t)
            if c.status == "counterexample"}


@pytest.mark.parametrize("key", list(RELATIONAL_MUTANTS), ids=lambda k: ".".join(k))
@pytest.mark.usefixtures("quick_solver")
def test_relational_mutant_breaks_its_invariants(key: tuple[str, str, str]) -> None:
    """Through `verify`'s step and transition tasks for the mutated action (their first try
    over unbounded sorts, then the search over small finite sorts, then the other tries)."""
    kind, action, piece = key
    tasks = [t for t in run.invariant_tasks(MODEL)
             if t.kind == "relational" and t.args[1] == action]
    left = set(RELATIONAL_MUTANTS[key]) - _broken(_mutant(kind, action, piece), tasks)
    assert left == set(), f"{key} no longer breaks {sorted(left)}"


@pytest.mark.parametrize("key", list(BOUNDED_MUTANTS), ids=lambda k: ".".join(k))
@pytest.mark.usefixtures("quick_solver")
def test_bounded_mutant_breaks_its_invariants(key: tuple[str, str, str]) -> None:
    """Through `verify`'s bounded tasks (up to B = 2, K = 3: the same tasks, fewer sizes, each
    over every chunk and block size) and its arithmetic tasks (every chunk and block size it
    proves them at)."""
    tasks = [t for t in run.invariant_tasks(MODEL)
             if t.kind == "arithmetic" or (t.kind == "bounded" and t.args[0] <= 2
                                           and t.args[1] <= 3)]
    broken = _broken(_mutant(*key), tasks)
    assert set(BOUNDED_MUTANTS[key]) <= broken, broken


def test_host_witnesses_are_stuck_with_the_host_slots_progress_is_proved_with():
    """Host-tier runs are searched with `search.SEARCH_SLOTS` host slots, the rows' progress is
    proved with `checks.SLOTS`: every committed host witness replays (core and z3) with that
    many too, so each row is shown safe and stuck one block below at one size."""
    import attrs

    from atom_core.proofs import capacity, checks, search, witness
    from atom_core.spec.model import MODEL

    tight, single = witness.committed()
    host = [(k, w) for k, w in tight.items() if w.consts["HOST"]]
    assert host and search.SEARCH_SLOTS != checks.SLOTS
    for (name, lanes), w in host:
        f = next(f for f in capacity.COMBINATIONS if f.name == name)
        wider = attrs.evolve(w, consts={**w.consts, "H": checks.SLOTS})
        tr = witness.replay(MODEL, wider, capacity.expect(f, lanes, w.consts["K"]))
        assert not isinstance(tr, str), (name, lanes, tr)
