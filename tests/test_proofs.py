"""The z3 proofs: the model proves, and planted bugs are caught by the obligation that should
catch them (named by invariant and action), in the very tasks `verify` runs (`run.invariant_tasks`,
`run.progress_task`, run here by `run.run_here`).

Expected (invariant, action) pairs were derived by running each mutant once and are the spec of
this file; a mutant may additionally break more invariants (a stronger model is fine), but it
must break these, only on the mutated action, and only with counterexamples (never `unknown`).
"""

from __future__ import annotations

import os

import pytest

from atom_core._generated import capacity as committed
from atom_core.proofs import capacity, checks, limits, run
from atom_core.proofs.capacity import Features
from atom_core.seq import seq
from atom_core.spec import codegen
from atom_core.spec import lang as L
from atom_core.spec import model as spec
from atom_core.spec.model import MODEL
from atom_core.testing.variants import mandatory_hits, seeds_semantics

ACTIONS = [a.name for a in MODEL.actions]
RELATIONAL = [i.name for i in MODEL.invariants if i.kind == "relational"]
BOUNDED = [i.name for i in MODEL.invariants if i.kind == "bounded"]
ARITHMETIC = [i.name for i in MODEL.invariants if i.kind == "arithmetic"]
TRANSITION = [t.name for t in MODEL.transition_invariants]

PREFIX_RESERVED = Features(True, "reserved")
PREFIX_DYNAMIC = Features(True, "dynamic")


pytestmark = pytest.mark.usefixtures("fresh_z3")


def _param(action: str, name: str) -> L.Var:
    return next(p for p in MODEL.get_action(action).params if p.name == name)


def _const(name: str) -> L.Const:
    return next(c for c in MODEL.consts if c.name == name)


def not_proved(cs) -> set[tuple[str, str, str]]:
    return {(c.invariant, c.action, c.status) for c in cs if c.status != "proved"}


def only(model: L.Model, action: str) -> L.Model:
    """`model` with `action` as its only action. The step and transition obligations of an
    action read only that action's guard and updates (and the invariants), so for a mutant of
    `action` these are the only obligations that can change; the others are the unmutated
    model's, proved in `test_unmutated_relational_all_proved`. (Cross-checked against full runs
    in `test_restriction_to_the_mutated_action_is_faithful`.)"""
    assert_only_action_differs(model, action)
    m = model.copy()
    m.actions = [m.get_action(action)]
    return m


def assert_only_action_differs(model: L.Model, action: str) -> None:
    """What makes `only` sound for a mutant: every other action, every invariant and every
    axiom is the unmutated model's own object, so its obligations are the very queries
    `test_unmutated_relational_all_proved` proves."""
    def pieces(a: L.Action) -> list[int]:
        return [id(x) for x in (*(e for _, e in a.guards), *a.updates, *a.effects)]

    others = [a.name for a in MODEL.actions if a.name != action]
    assert [a.name for a in model.actions] == [a.name for a in MODEL.actions]
    for name in others:
        assert pieces(model.get_action(name)) == pieces(MODEL.get_action(name)), name
    for got, want in ((model.invariants, MODEL.invariants), (model.axioms, MODEL.axioms),
                      (model.transition_invariants, MODEL.transition_invariants)):
        assert [id(x) for x in got] == [id(x) for x in want]


# Mutants run through `verify`'s tasks with a smaller first try (z3 resource units,
# proofs/limits.py): a refutable obligation spends its first try before its task searches
# small finite sorts for a counterexample, and a first try this size settles most proofs;
# the rest go on to the remaining tries, whose final budget is `verify`'s own, so no verdict
# changes, only how soon a refutation is found (measured: admit_miss without dst_reusable,
# 187 s with `verify`'s first try, 19 s with this, under a load of 9 on 2 cores).
MUTANT_FIRST_TRY = 500_000


@pytest.fixture
def quick_solver(monkeypatch):
    monkeypatch.setattr(limits, "SHORT", MUTANT_FIRST_TRY)


def relational_tasks(action: str) -> list[run.Task]:
    """`verify`'s relational tasks that decide `action`'s obligations (its step and transition
    tasks: each reads that action's guard and updates and nothing of the others)."""
    return [t for t in run.invariant_tasks(MODEL)
            if t.kind == "relational" and t.args[1] == action]


def verify_checks(model: L.Model, action: str) -> list[checks.Check]:
    """The checks of `action`'s relational tasks, run on `model` as `verify` runs them."""
    return [c for t in relational_tasks(action) for c in run.run_here(model, t)]


def refuted(model: L.Model, action: str) -> set[tuple[str, str, str]]:
    """The obligations of `action` a mutant of it does not prove, in `verify`'s tasks for the
    action (the rest are the model's)."""
    return not_proved(verify_checks(model, action))


def refutes(model: L.Model, action: str, invariant: str) -> checks.Check:
    """The check of `invariant` at `action` in `verify`'s task for it."""
    return next(c for c in verify_checks(model, action) if c.invariant == invariant)


# --------------------------------------------------------------------------- (a) the model


def test_unmutated_relational_all_proved():
    cs = list(checks.relational(MODEL))
    assert cs
    bad = [c for c in cs if c.status != "proved"]
    assert bad == [], bad
    named = set(RELATIONAL) | set(TRANSITION)
    for c in cs:
        assert c.invariant in named
        assert c.action in set(ACTIONS) | {"init"}
        assert c.kind in ("base", "step", "transition")
        assert (c.action == "init") == (c.kind == "base")
    # every obligation is there exactly once: base per invariant, step per invariant x action,
    # transition per transition invariant x action
    want = ({(i, "init", "base") for i in RELATIONAL}
            | {(i, a, "step") for i in RELATIONAL for a in ACTIONS}
            | {(t, a, "transition") for t in TRANSITION for a in ACTIONS})
    got = [(c.invariant, c.action, c.kind) for c in cs]
    assert len(got) == len(set(got)) == len(want)
    assert set(got) == want


def test_unmutated_bounded_small_sizes_all_proved():
    cs = list(checks.bounded(MODEL, 2, 3))
    assert [c for c in cs if c.status != "proved"] == []
    assert {c.invariant for c in cs} == set(BOUNDED) | {checks.INHABITED}
    assert {c.size for c in cs} == {f"B={b},K={k}" for b in (1, 2) for k in (1, 2, 3)}
    per_size = 1 + len(BOUNDED) * (1 + len(ACTIONS))  # (one: its hypotheses hold together)
    assert len(cs) == 6 * per_size


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("f", capacity.COMBINATIONS, ids=lambda f: f.name)
def test_capacity_table_matches_z3_at_small_sizes(f, lanes):
    """The committed rule: progress proved at the minimum, a z3 counterexample one below."""
    need = committed.min_kv_blocks(lanes, f.tables, (f.prefix_cache, f.scratch), f.preempt)
    ok, cs = capacity.safe(MODEL, f, lanes, need)
    assert ok, cs
    assert {c.invariant for c in cs} == {checks.INHABITED} | {p.name for p in MODEL.progress}
    if need > 1:
        ok_below, cs_below = capacity.safe(MODEL, f, lanes, need - 1)
        assert not ok_below
        assert {c.status for c in cs_below} <= {"proved", "counterexample"}


def test_solve_reports_the_units_of_its_own_query():
    """z3's resource counter belongs to the context, shared by all its solvers: `solve`
    reports what its own attempts used, not the context's total so far (which made the units
    a check reports grow with every query its task asked before it)."""
    import z3

    x, y = z3.Ints("x y")
    query = [x * x * x + y * y * y == 1729, x > 0, y > 0, x < 200, y < 200]
    status, _model, alone = checks.solve(query)
    assert status == "counterexample" and alone > 0
    for _ in range(3):  # more work in the same context
        checks.solve(query)
    _status, _model, again = checks.solve(query)
    assert 0 < again < 2 * alone, (alone, again)


# --------------------------------------------------------------------------- (b) planted bugs

# (mutation, action, piece) -> the (invariant, action) pairs z3 must refute, all on `action`
PLANTED = {
    ("guard", "admit_hit", "dst_not_src"): {"copy_source_cached"},
    ("guard", "admit_hit", "prefix_matches"): {"copy_source_holds_prefix"},
    ("guard", "admit_hit", "src_cached"): {"copy_source_cached"},
    ("guard", "decode", "scratch_target_ok"): {
        "lane_holds_its_tokens", "cache_key_is_content", "copy_source_cached",
        "cached_content_untouched"},
    ("update", "decode", "owner"): {"cache_key_is_content", "cached_content_untouched"},
    ("update", "finish", "key"): {"cache_key_is_content"},
    ("guard", "admit_miss", "dst_reusable"): {
        "lane_block_owned", "scratch_is_reserved_block",
        "lane_holds_its_tokens", "copy_source_cached", "copy_target_not_ready"},
    ("update", "abort_running", "copying"): {"copy_only_while_prefilling"},
    ("update", "fail", "copying"): {"copy_only_while_prefilling"},
    ("guard", "prefill", "no_copy_in_flight"): {
        "copy_only_while_prefilling", "copy_source_holds_prefix"},
    ("guard", "decode", "no_block_overflow"): {"length_within_block"},
    ("guard", "decode", "local_pad_ok"): {"lane_local_state_is_its_own"},
    ("guard", "finish", "keep_needs_prefix_cache"): {"cache_needs_prefix_cache"},
}


def mutant(kind: str, action: str, piece: str) -> L.Model:
    if kind == "guard":
        return MODEL.without_guard(action, piece)
    return MODEL.without_update(action, piece)


# Beyond the brief's list; the guard/update sweep below catches these too, so the exact-pair
# check for them runs in the slow tier only.
EXTRA = {("guard", "admit_hit", "src_cached"), ("update", "fail", "copying"),
         ("guard", "finish", "keep_needs_prefix_cache")}


@pytest.mark.parametrize("key", [
    pytest.param(k, marks=[pytest.mark.slow] if k in EXTRA else [],
                 id=f"{k[1]}-no-{k[0]}-{k[2]}") for k in PLANTED])
@pytest.mark.usefixtures("quick_solver")
def test_planted_bug_fails_the_task_verify_runs(key):
    """The mutant through `verify`'s own tasks for the action (its step and its transition
    task, at their budgets): each named obligation ends a counterexample (`unknown` is never
    caught, and `proved` is what a contradictory law would make of it:
    tests/test_nonvacuity.py); every check that fails is the mutated action's."""
    kind, action, piece = key
    cs = verify_checks(mutant(kind, action, piece), action)
    assert {c.action for c in cs} == {action}
    broken = {c.invariant for c in cs if c.status == "counterexample"}
    assert PLANTED[key] <= broken, [c for c in cs if c.invariant in PLANTED[key]]


def test_unmutated_arithmetic_all_proved_for_all_sizes():
    """The arithmetic invariants over unbounded sorts at the bounded checks' chunk and block
    size: every obligation once (base, and one step per action), each proved."""
    cs = list(checks.arithmetic(MODEL))
    assert [c for c in cs if c.status != "proved"] == []
    got = [(c.invariant, c.action, c.kind) for c in cs]
    want = ({(i, "init", "base") for i in ARITHMETIC}
            | {(i, a, "step") for i in ARITHMETIC for a in ACTIONS})
    assert len(got) == len(set(got)) == len(want) and set(got) == want
    assert {c.size for c in cs} == {f"all sizes,C={checks.CHUNK},S={checks.SEQ_LEN}"}


def arithmetic_tasks() -> list[run.Task]:
    """`verify`'s arithmetic tasks: every chunk and block size it proves them at."""
    return [t for t in run.invariant_tasks(MODEL) if t.kind == "arithmetic"]


def bounded_tasks(max_lanes: int = 2, max_blocks: int = 4) -> list[run.Task]:
    """`verify`'s bounded tasks up to a smaller size (the same tasks, fewer of them)."""
    return [t for t in run.invariant_tasks(MODEL) if t.kind == "bounded"
            and t.args[0] <= max_lanes and t.args[1] <= max_blocks]


@pytest.mark.usefixtures("quick_solver")
def test_arithmetic_invariant_mutant_needs_the_arithmetic_proof():
    """admit_hit copying a non-chunk-multiple prefix (n >= C, no `n % C == 0`) resumes prefill
    off a chunk boundary (and would give the lane a snapshot boundary off the chunk grid):
    invisible to the relational proof (which has no `%`), and refuted by `verify`'s arithmetic
    task at every chunk and block size it runs (over unbounded sorts z3 leaves the query
    open, and the task's search over small finite sorts finds the state)."""
    n, c = _param("admit_hit", "n"), _const("C")
    mut = MODEL.with_guard("admit_hit", "n_whole_chunks", n >= c)
    assert refuted(mut, "admit_hit") == set()
    for task in arithmetic_tasks():
        bad = {(cc.invariant, cc.action, cc.status)
               for cc in run.run_here(only(mut, "admit_hit"), task) if cc.status != "proved"}
        assert bad == {("prefill_on_chunk_boundary", "admit_hit", "counterexample"),
                       ("snapshots_on_chunk_boundaries", "admit_hit", "counterexample")}, task


# --------------------------------------------------------------------------- every guard

GUARDS = [(a.name, g) for a in MODEL.actions for g, _ in a.guards]
UPDATES = [(a.name, fn) for a in MODEL.actions for fn in sorted({u.fn.name for u in a.updates})]

# Guards whose removal no proof catches, each with the reason. Every other guard is needed by
# a safety proof or the capacity tier.
EQUIVALENT_GUARDS: dict[tuple[str, str], str] = {
    # a policy (a prefix hit is taken): a miss beside a hit computes the prefix again, which is
    # safe, and since a hit's entry can always be taken over (`admit_adopt`) or, for a hybrid
    # model, evicted by the miss when it is the only reusable block, the guard costs no block
    # either. The core state machine's lifecycle model catches its removal
    # (tests/test_core_machine.py, admit_miss-no_cache_hit).
    ("admit_miss", "no_cache_hit"): "policy: a hit is taken; safe and block-neutral without",
    # (shared with admit_hit, where the copy's invariant reads the entry's key up to the
    # lane's length): for real sequences prefix_matches with token_left_to_compute implies it
    # (take(key, n) has n tokens only if key has); the model leaves take uninterpreted, and a
    # lane that takes the entry over reads only its KV (holds), never its key again
    ("admit_adopt", "n_within_entry"): "implied for real sequences; the key is not read after",
    ("grow_adopt", "n_within_entry"): "implied for real sequences; the key is not read after",
}

# Updates whose removal no proof catches.
UNCAUGHT_UPDATES: dict[tuple[str, str], str] = {
    # Equivalent mutants (ghost-only): the dropped write only marks blocks that are free or
    # the scratch block after the step, and no guard or invariant reads `junk` of such a block
    # before an admission resets it. The write exists as a tripwire for mutants of decode's
    # `scratch_target_ok` (which it does catch).
    ("decode", "junk"): "ghost: padding rows only scribble on scratch/free blocks when correct",
    ("fail", "junk"): "ghost: the failed lane's block is freed in the same step",
    ("discard", "junk"): "ghost: the discarded block is free or the scratch block afterwards",
    ("transfer_fail", "junk"): "ghost: the failed transfer's blocks (its lane's whole table) "
                               "are freed in the same step",
    ("transfer_end", "junk"): "ghost: the drained blocks (every block draining for the "
                              "request) are freed in the same step",
    # The tripwire for mutants of decode's local_pad_ok (which it catches): with the guard,
    # padding rows write only idle lanes' local slots, and admission resets those.
    ("decode", "local_junk"): "ghost: with local_pad_ok, padding only hits idle lanes' slots",
    # Hybrid ghost state where no hybrid run can observe it.
    ("admit_hit", "local_holds"): "ghost: hybrid models have no prefix cache, so no hit",
    ("admit_hit", "local_junk"): "ghost: hybrid models have no prefix cache, so no hit",
    ("fail", "local_junk"): "ghost: the failed lane is freed in the same step, and admission "
                            "resets its slot",
    ("admit_import", "local_holds"): "ghost: an importing lane's slot is the transfer's until "
                                     "import_done writes it",
    ("admit_host_hit", "local_holds"): "ghost: hybrid models have no host tier (axiom)",
    ("admit_host_hit", "local_junk"): "ghost: hybrid models have no host tier (axiom)",
    # `extend`'s snapshot hand-over, shared with grow and grow_hit (where dropping it is
    # caught): a host-tier lane is a plain model's, whose blocks have no snapshots.
    ("grow_host_hit", "snap_upto"): "unobservable: hybrid models have no host tier (axiom), "
                                    "and a plain model's snap_upto is 0 (snapshots_need_hybrid)",
    # A host eviction that does nothing is safe (the entry stays valid); the host tier then
    # never takes another entry once full, which tests/test_host_cache.py catches.
    ("host_evict", "slot_state"): "gap: performance only, caught by the host cache tests",
    # Hybrid prefix cache. The junk write is the tripwire for mutants of snapshot's guards (it
    # catches them); with the guards in place the snapshot it marks is sound.
    ("snapshot", "lane_snap_junk"): "ghost: with snapshot's guards, the new snapshot is sound",
    # admit_adopt shares `occupy` with the other admissions; it is not for hybrid models
    # (not_hybrid), so their sliding-state ghost is never read after it, and its entry starts
    # a sequence already (src_first_block), so the start it writes is the one it had.
    ("admit_adopt", "lane_snap"): "ghost: admit_adopt is not for hybrid models (not_hybrid)",
    ("admit_adopt", "local_holds"): "ghost: admit_adopt is not for hybrid models (not_hybrid)",
    ("admit_adopt", "local_junk"): "ghost: admit_adopt is not for hybrid models (not_hybrid)",
    ("admit_adopt", "start"): "equivalent: src_first_block says the entry starts at 0",
    # the tripwire for mutants of src_first_block (which it catches): with the guard the entry
    # starts at 0 and, cached, is not junk, so the write leaves junk as it was
    ("admit_adopt", "junk"): "ghost: with src_first_block the block is not junk already",
    # grow_adopt: the same for src_at_the_boundary (the entry's start is the lane's length,
    # which `extend` writes); the full tail's snapshot hand-over is a hybrid model's only
    ("grow_adopt", "junk"): "ghost: with src_at_the_boundary the block is not junk already",
    ("grow_adopt", "start"): "equivalent: src_at_the_boundary says it starts at the length",
    ("grow_adopt", "snap_upto"): "unobservable: grow_adopt is not for hybrid models, and a "
                                 "plain model's snap_upto is 0 (snapshots_need_hybrid)",
    # Not equivalent, but outside what the model states: the update is the whole action, and
    # an abort that does nothing is safe (no block is misused); the batcher tests catch it
    # (an aborted request must end).
    ("abort_waiting", "phase"): "gap: no property says an aborted request stops waiting",
}


def first_failing(model: L.Model, tasks: list[run.Task]) -> tuple[str, str] | None:
    """(invariant, action) of the first check of `tasks`, run on `model` as `verify` runs
    them, that is not proved (a counterexample, or `unknown`: `verify` fails on either)."""
    for task in tasks:
        for c in run.run_here(model, task):
            if c.status != "proved":
                return c.invariant, c.action
    return None


def caught_relational(model: L.Model, action: str) -> tuple[str, str] | None:
    """A relational obligation of `action` its `verify` tasks do not prove."""
    return first_failing(model, relational_tasks(action))


def caught_bounded(model: L.Model, action: str) -> tuple[str, str] | None:
    """An obligation of `action` that `verify`'s bounded tasks (up to B = 2, K = 4) or its
    arithmetic tasks do not prove (run on the model restricted to the action: `only`)."""
    return first_failing(only(model, action), bounded_tasks() + arithmetic_tasks())


def caught_capacity(model: L.Model) -> tuple[str, str] | None:
    """In `verify`'s progress tasks, the mutant's progress is proved one block below the
    committed minimum (so the committed table is not tight for it and `verify`'s table check
    fails), or, for a progress property that says an action is *not* enabled
    (`lone_lane_is_never_preempted`), not proved at the minimum. A dropped guard only enables
    more transitions, so these are the ways it can move capacity."""
    for lanes in (1, 2):
        at: dict[int, list[tuple[Features, bool]]] = {}
        for f in capacity.COMBINATIONS:
            if lanes > f.max_lanes(run.MAX_LANES):
                continue
            k = committed.min_kv_blocks(lanes, f.tables, f.key, f.preempt)
            if k > 1:
                at.setdefault(k - 1, []).append((f, True))
            at.setdefault(k, []).append((f, False))
        for k, fs in at.items():
            if k > run.MAX_BLOCKS:
                continue
            by_f = run.run_here(model, run.progress_task(lanes, k))
            for f, below in fs:
                proved = all(c.status == "proved" for c in by_f[f])
                if proved == below:
                    return f"capacity B={lanes},K={k},{f.name}", "*"
    return None


def caught(model: L.Model, action: str, guard: bool) -> tuple[str, str] | None:
    return (caught_relational(model, action) or caught_bounded(model, action)
            or (caught_capacity(model) if guard else None))


def test_guard_and_update_lists_are_complete():
    assert len(GUARDS) == sum(len(a.guards) for a in MODEL.actions)
    assert set(EQUIVALENT_GUARDS) <= set(GUARDS)
    assert set(UNCAUGHT_UPDATES) <= set(UPDATES)


@pytest.mark.parametrize("action,guard", GUARDS, ids=[f"{a}.{g}" for a, g in GUARDS])
def test_dropping_any_guard_is_caught(action, guard, quick_solver):
    found = caught(MODEL.without_guard(action, guard), action, guard=True)
    if (action, guard) in EQUIVALENT_GUARDS:
        assert found is None, f"allow-listed but caught by {found}: remove it from the list"
    else:
        assert found is not None, f"dropping {action}.{guard} is caught by no proof"


def test_hybrid_miss_that_may_not_evict_its_hit_is_caught_by_capacity(quick_solver):
    """no_cache_hit without its hybrid exception (`hybrid_evicts_its_hit`): a hybrid model's
    request whose hit's entry is the only reusable block waits for ever at the rule's
    minimum: the capacity tier finds the hybrid rows stuck where the plain ones are not."""
    mut = MODEL.with_guard("admit_miss", "no_cache_hit", mandatory_hits())
    assert caught_relational(mut, "admit_miss") is None
    found = caught_capacity(mut)
    assert found is not None and "hybrid" in found[0], found


@pytest.mark.parametrize("action,fn", UPDATES, ids=[f"{a}.{f}" for a, f in UPDATES])
def test_dropping_any_update_is_caught(action, fn, quick_solver):
    found = caught(MODEL.without_update(action, fn), action, guard=False)
    if (action, fn) in UNCAUGHT_UPDATES:
        assert found is None, f"allow-listed but caught by {found}: remove it from the list"
    else:
        assert found is not None, f"dropping {action}'s {fn} update is caught by no proof"


def _first_per_action(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [next(p for p in pairs if p[0] == a.name) for a in MODEL.actions
            if any(p[0] == a.name for p in pairs)]


# A full relational run per mutant costs tens of seconds (about 2,000 obligations); CI
# cross-checks a guard and an update, ATOM_CORE_FULL_SWEEP=1 every guard and update.
_FULL = os.environ.get("ATOM_CORE_FULL_SWEEP") == "1"
_SAMPLE_GUARDS = ("decode",)
_SAMPLE_UPDATES = ("finish",)
RESTRICTION_CASES = (
    [("guard", a, g) for a, g in
     (GUARDS if _FULL else [p for p in _first_per_action(GUARDS) if p[0] in _SAMPLE_GUARDS])]
    + [("update", a, f) for a, f in
       (UPDATES if _FULL else [p for p in _first_per_action(UPDATES)
                               if p[0] in _SAMPLE_UPDATES])])


@pytest.mark.slow
@pytest.mark.parametrize("kind,action,piece", RESTRICTION_CASES,
                         ids=[f"{a}{'.' if k == 'guard' else ':='}{p}"
                              for k, a, p in RESTRICTION_CASES])
def test_restriction_to_the_mutated_action_is_faithful(kind, action, piece, quick_solver):
    """The full relational run of a mutant (every action's steps and transitions at once)
    refutes only obligations of the mutated action, and refutes one exactly when `verify`'s
    tasks for the action do. (Both with the mutants' first try: an obligation that does not
    answer counts as not proved, as in `verify`.)"""
    m = mutant(kind, action, piece)
    full = not_proved(checks.relational(m))
    assert {a for _, a, _ in full} <= {action}
    assert bool(full) == (caught_relational(m, action) is not None)


# --------------------------------------------------------------------------- (c) capacity


@pytest.mark.usefixtures("quick_solver")
def test_hybrid_prefix_hits_need_a_snapshot_at_their_length():
    """A hybrid prefix hit copies global KV only; the sliding state comes from the entry's
    snapshot at the hit's length. Without the guard that such a snapshot exists, the restore
    reads another position's state (or none), which `lane_local_state_is_its_own` refutes at
    copy_done. `hybrid_hit_has_snapshot` states the guard's consequence for the copy in
    flight, so it fails first; without it, the content invariant fails."""
    mut = MODEL.without_guard("admit_hit", "hybrid_snapshot_at_n")
    bad = refuted(mut, "admit_hit")
    assert bad == {("hybrid_hit_has_snapshot", "admit_hit", "counterexample")}, bad
    # The run it allows, on the mutant's generated core: an entry without snapshots is hit, and
    # the lane resumes with a sliding state that is not its prefix's.
    g = codegen.load(mut)
    s = g.init(g.Consts(B=1, K=3, C=2, S=8, PREFIX=True, RESERVED=False, SCRATCH=0,
                        HYBRID=True), ghost=True)
    p = seq([1, 2, 3])
    run = [("submit", {"r": 0, "p": p}), ("admit_miss", {"l": 0, "r": 0, "dst": 0}),
           ("prefill", {"l": 0, "tok": 7}), ("prefill", {"l": 0, "tok": 7}),
           ("finish", {"l": 0, "keep": True}), ("submit", {"r": 1, "p": p}),
           ("admit_hit", {"l": 0, "r": 1, "src": 0, "dst": 1, "n": 2}),
           ("copy_done", {"l": 0})]
    for name, args in run:
        step = g.ACTIONS[name][0](s, **args)
        assert step.rejected is None, (name, step.rejected)
        s = step.state
        want = {"admit_hit": ["hybrid_hit_has_snapshot"],
                "copy_done": ["lane_local_state_is_its_own"]}.get(name, [])
        assert g.check_invariants(s) == want, name
    assert s.snap_upto[0] == 0


@pytest.mark.usefixtures("quick_solver")
def test_hybrid_snapshots_must_not_skip_a_boundary():
    """A snapshot taken past the next chunk boundary would leave a boundary without one that
    the entry claims (snapshots are kept at every boundary up to snap_upto)."""
    c = refutes(MODEL.without_guard("snapshot", "next_boundary"), "snapshot",
                "lane_snapshots_are_its_own")
    assert c.status == "counterexample", c


def test_a_full_block_claims_exactly_the_snapshots_its_lane_took():
    """When a hybrid lane's block fills (`extend`, shared by grow and grow_hit) it keeps the
    lane's snapshots. Claiming more (up to the block's end, whichever the lane took) lets a
    later hit restore the sliding state from a snapshot the host never took; claiming none
    serves no hit. The ghost count of snapshots taken (`snap_taken`) refutes both at the step
    that fills the block; without `entry_snapshots_were_taken` the first proves (no other
    invariant ties the count to the snapshots the host holds)."""
    def extend_claims(value):
        m = MODEL.copy()
        for name in ("grow", "grow_hit"):
            a = m.get_action(name)
            (l,) = [p for p in a.params if p.name == "l"]
            a.updates = [L.Update(u.fn, u.args, value(l), u.whole) if u.fn.name == "snap_upto"
                         else u for u in a.updates]
        m.actions = [m.get_action("grow"), m.get_action("grow_hit")]
        return m

    def refuted_by(m):
        bad = [c for c in checks.relational(m, base=False) if c.status != "proved"]
        assert all(c.status == "counterexample" for c in bad), bad
        return {(c.invariant, c.action) for c in bad}

    want = {("entry_snapshots_were_taken", "grow"), ("entry_snapshots_were_taken", "grow_hit")}
    to_its_end = extend_claims(lambda l: L.ite(spec.HYBRID, spec.length(l), 0))
    assert refuted_by(to_its_end) == want
    assert refuted_by(extend_claims(lambda l: L.Lit(0, L.INT))) == want
    to_its_end.invariants = [i for i in to_its_end.invariants
                             if i.name not in ("entry_snapshots_were_taken",
                                               "lane_snapshots_were_taken")]
    assert refuted_by(to_its_end) == set()


@pytest.mark.usefixtures("quick_solver")
def test_a_padding_row_aimed_at_its_own_local_slot_is_refuted():
    """The rule a ring allowed (a busy lane that is not decoding pads in its own local slot, at
    its next position) under the kernel's window: the write shifts the lane's live window, so
    z3 refutes `lane_local_state_is_its_own` at decode. The spec's rule (an idle lane's slot,
    `local_pad_ok`) proves, and dropping that guard is refuted the same way."""
    m = MODEL.copy()
    a = m.get_action("decode")

    def own_slot(u: L.Update) -> L.Update:
        (n,) = u.args
        return L.Update(u.fn, u.args, spec.local_junk(n) | (spec.HYBRID & L.exists(
            spec.Lane, lambda l: (l == n) & ~spec.decoding(l))), u.whole)

    a.updates = [own_slot(u) if u.fn.name == "local_junk" else u for u in a.updates]
    assert refutes(m, "decode", "lane_local_state_is_its_own").status == "counterexample"
    assert refutes(MODEL.without_guard("decode", "local_pad_ok"), "decode",
                   "lane_local_state_is_its_own").status == "counterexample"
    assert refuted(MODEL, "decode") == set()


@pytest.mark.usefixtures("quick_solver")
def test_copy_into_the_source_is_unsafe():
    """Dropping admit_hit's dst_not_src would let the seeds' scheduler (no entry taken over) run
    a 1-lane prefix cache in lanes + 1 blocks (copy the entry onto itself), but z3 refutes it:
    the copy source is no longer a pinned cache entry while the copy is in flight. (Taking the
    entry over, `admit_adopt`, is the safe way to the same block count.)"""
    mut = MODEL.without_guard("admit_hit", "dst_not_src")
    assert refutes(mut, "admit_hit", "copy_source_cached").status == "counterexample"
    seeds = seeds_semantics()
    assert capacity.min_blocks(seeds, PREFIX_RESERVED, 1, 4) == 3
    assert capacity.min_blocks(seeds.without_guard("admit_hit", "dst_not_src"),
                               PREFIX_RESERVED, 1, 4) == 2


def test_taking_the_entry_over_saves_the_seeds_block():
    """The seeds' rule (prefix cache, reserved scratch: lanes + 2) is what mandatory hits cost
    when a hit's entry cannot be taken over: with one block fewer, the request whose hit's
    entry is the only reusable block waits for ever (the seeds' incident). The model takes the
    entry over (`admit_adopt`; a hybrid model's miss evicts it), so the prefix cache costs no
    block: the no-cache rules apply, and the committed table says so."""
    seeds = seeds_semantics()
    # (safe: its guards only refuse more; the miss's is checked alone, as `only` needs)
    assert refuted(MODEL.with_guard("admit_miss", "no_cache_hit", mandatory_hits()),
                   "admit_miss") == set()
    for lanes in (1, 2):
        assert capacity.min_blocks(seeds, PREFIX_RESERVED, lanes, 6) == lanes + 2
        assert capacity.min_blocks(MODEL, PREFIX_RESERVED, lanes, 6) == lanes + 1
        assert capacity.min_blocks(seeds, PREFIX_DYNAMIC, lanes, 6) == lanes + 1
        assert capacity.min_blocks(MODEL, PREFIX_DYNAMIC, lanes, 6) == lanes
    assert committed.OFFSETS == {(False, "reserved"): 1, (False, "dynamic"): 0,
                                 (True, "reserved"): 1, (True, "dynamic"): 0}


def test_capacity_table_of_the_model_is_the_committed_one():
    rows = list(capacity.table(MODEL, 2, 5, traces=False))
    offsets = {(r.features.prefix_cache, r.features.scratch): r.offset
               for r in rows if r.features.plain}
    assert offsets == committed.OFFSETS
    fitted, wrong = capacity.fit(rows)
    assert wrong == []
    assert fitted == {k: (committed.SCRATCH_BLOCKS[k], committed.COPY_BLOCKS[k])
                      for k in committed.OFFSETS}
