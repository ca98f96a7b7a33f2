"""The core state machine's tests: `atom_core.testing.machine` (a hypothesis
`RuleBasedStateMachine` over the generated core, checked against the lifecycle model of
`atom_core.testing.lifecycle` after every step; its docstring says what it checks) over every
feature combination and tier, with and without PD and preemption, and its teeth: the same
machine over mutant cores (`codegen.load(MODEL.without_guard(...))`) finds the expected
invariant violation (or lifecycle divergence, progress failure, policy refinement failure).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import run_state_machine_as_test

from atom_core._generated import core as committed
from atom_core.seq import seq
from atom_core.spec import codegen, lang
from atom_core.spec import model as spec
from atom_core.spec.model import HOST_ACTIONS, MODEL, PD_ACTIONS
from atom_core.testing.lifecycle import (
    DRAINS_END_TOGETHER,
    FEATURES,
    HYBRID_HIT_EVICTED,
    HYBRID_LATER_HIT,
    IMPORT_BLOCK_PREEMPTED,
    IMPORT_DRAINS,
    IMPORT_SHORT,
    IMPORT_WITH_PREEMPTION,
    IMPORTED_PREEMPTED,
    IMPORTED_PREEMPTED_FINISHED,
    LATER_LOAD_FAILED,
    MULTI_EXPORT,
    MULTI_IMPORT,
    NO_SLOT,
    SNAPSHOT_CAP,
    TIERS,
    Stats,
)
from atom_core.testing.machine import make_machine
from atom_core.testing.machine.errors import (
    InvariantViolation,
    LifecycleDivergence,
    MirrorDivergence,
    ModelDivergence,
    ProgressViolation,
    RefinementViolation,
)
from atom_core.testing.strategies import configs, min_blocks


class Tally(NamedTuple):
    """What one machine run applied, refused (per guard) and reached (Stats)."""

    pd: bool
    applied: Counter[str]
    rejected: Counter[tuple[str, str]]
    events: Counter[str]
    preempt: bool = False  # the configurations have PREEMPT


# Runs per configuration family for the coverage checks: the rarest situations they ask for
# (a preempt refused because no lane waits, an import_grow on a lane that is not importing)
# need more than the ci profile's 50 examples to be sure of.
COVERAGE_EXAMPLES = 100


def run_machine(config: st.SearchStrategy[Any], pd: bool, preempt: bool = False) -> Tally:
    Stats.reset()
    run_state_machine_as_test(
        make_machine(config=config, pd=pd, preempt=preempt),
        settings=settings(max_examples=max(settings().max_examples, COVERAGE_EXAMPLES)))
    return Tally(pd, Counter(Stats.applied), Counter(Stats.rejected), Counter(Stats.events),
                 preempt)


def check_coverage(tier: str, prefix: bool, *runs: Tally) -> None:
    """Not vacuous, over the runs of one configuration family: every action it can take was
    applied, and no run applied one it cannot (hits need the prefix cache, PD actions pd,
    snapshot the hybrid tier, the host actions (grow_host_hit too) the host tier, preempt
    PREEMPT; every tier grows tables of several blocks, and with the prefix cache hits past
    the first block); some lane reached the block end (decode refused until it finishes), and
    the table end; and the situations each feature exists for happened."""
    actions = set(committed.ACTIONS)
    cannot = set() if prefix else {"admit_hit", "copy_done", "grow_hit"}
    # (a hybrid hit restores the sliding state in its copy: a lane never takes one over)
    cannot |= {"admit_adopt", "grow_adopt"} if not prefix or tier == "hybrid" else set()
    cannot |= set() if tier == "hybrid" else {"snapshot"}
    cannot |= set() if tier == "host" else set(HOST_ACTIONS)
    for run in runs:
        off = cannot | (set() if run.pd else set(PD_ACTIONS))
        off |= set() if run.preempt else {"preempt"}
        assert not off & set(run.applied), (run.pd, run.preempt, off & set(run.applied))
    applied = {a for run in runs for a in run.applied}
    rejected = {k for run in runs for k, v in run.rejected.items() if v}
    events = {k for run in runs for k, v in run.events.items() if v}
    expected = actions - cannot - (set() if any(run.pd for run in runs) else set(PD_ACTIONS))
    expected -= set() if any(run.preempt for run in runs) else {"preempt"}
    assert expected <= applied, expected - applied
    assert ("decode", "no_block_overflow") in rejected
    # Each tier's actions are refused where they do not belong, and at wrong times.
    want = {("snapshot", "hybrid_prefix_cache")} if tier != "hybrid" else {
        ("snapshot", "lane_computing"), ("snapshot", "next_boundary"),
        ("admit_hit", "hybrid_snapshot_at_n")}
    want |= {("load_done", "load_in_flight")} if tier != "host" else {
        ("spill", "entry_cached"), ("spill", "entry_unpinned"), ("spill", "slot_empty"),
        ("host_evict", "slot_stored"), ("admit_host_hit", "slot_stored"),
        ("store_done", "slot_storing"), ("store_fail", "slot_storing"),
        ("load_done", "load_in_flight"), ("load_fail", "load_in_flight"),
        ("copy_done", "copy_in_flight")}
    # grow_hit (everywhere: `foreign_tier_calls`) and, with the host tier (without it there is
    # no slot to name), grow_host_hit: a lane that is not prefilling
    want |= {("grow_hit", "lane_prefilling")}
    want |= {("grow_host_hit", "lane_prefilling")} if tier == "host" else set()
    # paged tables (every tier: T in 1..3): grow refused by each of its guards, a prefill
    # past a full tail, a hit on an entry that starts later in its sequence
    want |= {("grow", "lane_computing"), ("grow", "tail_full"), ("grow", "table_not_full"),
             ("grow", "dst_reusable"), ("prefill", "chunk_within_block")}
    want |= {("admit_hit", "src_first_block")} if prefix else set()
    # with the prefix cache, a hit past the first block refused by each of its guards but
    # table_not_full (a prefilling lane has a token left to compute, so its full tail is
    # never the table's last block); hybrid: one past the entry's snapshots too
    want |= {("grow_hit", g) for g in (
        "no_copy_in_flight", "tail_full", "src_cached", "src_at_the_boundary",
        "n_whole_chunks", "n_within_block", "n_within_entry", "token_left_to_compute",
        "prefix_matches", "dst_not_src", "dst_reusable")} if prefix else set()
    want |= {("grow_hit", "hybrid_snapshot_at_n")} if tier == "hybrid" else set()
    # a decoding lane filled its whole table (decode refused until it finishes); with the
    # prefix cache, a table of several blocks became cache entries, a hit reached a full
    # first block, a hit went on past it (the lane's next block copied from the entry at
    # that position), and a miss was not blocked by a later block sharing its first chunk;
    # hybrid: a hit past the first block restored the sliding state at its end, and the
    # policy chose one (or none) where an entry's key went on past its snapshots (a hit on a
    # full first block shows a full block kept its lane's snapshots: hybrid_snapshot_at_n)
    paged = {"decode refused at a full table"}
    paged |= {"table of several blocks cached", "hit on a full first block",
              "hit past the first block", "miss beside a later block's entry"
              } if prefix else set()
    paged |= {HYBRID_LATER_HIT, SNAPSHOT_CAP} if tier == "hybrid" else set()
    assert paged <= events, paged - events
    if any(run.preempt for run in runs):
        # preempt refused by its guards (but preemption_on); preemptions for a lane's
        # next block (in a storm: every lane at a block boundary, no block left) and for a
        # decode call's padding target (dynamic scratch: B >= 2 lanes share K = T + 1);
        # preempted requests admitted again and finished, and drained at the end of a run
        # (requeue_fits needs a lane at its table end while another waits
        # for a block: reached in most runs, not all; its mutant, preempt-requeue_fits, shows
        # the machine gets there)
        want |= {("preempt", g) for g in ("lane_computing", "a_lane_waits_for_a_block",
                                          "no_block_reusable")}
        preempted = {"preempt for a next block", "preempt storm: every lane at a block boundary",
                     "preempted request finished", "preempted requests drained",
                     "victim is a lane that waits"}
        if any(run.preempt and run.pd for run in runs):
            # PD with preemption: an import refused while another importing table grows,
            # imports that landed, an importing table that grew by preempting a computing lane,
            # and imported requests preempted later (they decode) that were admitted again
            # and finished
            want |= {("admit_import", "one_import_table_growing")}
            preempted |= {IMPORT_WITH_PREEMPTION, IMPORT_BLOCK_PREEMPTED, IMPORTED_PREEMPTED,
                          IMPORTED_PREEMPTED_FINISHED}
        assert preempted <= events, preempted - events
    if not all(run.preempt for run in runs):
        want |= {("preempt", "preemption_on")}
    assert want <= rejected, want - rejected
    if tier != "host":  # a slot index, there being no slot (`foreign_tier_calls`)
        assert NO_SLOT in events
    if tier == "hybrid":
        # a miss is not blocked by an entry that shares its first chunk but has no snapshot;
        # and at the capacity rule one took its hit's entry, the only reusable block (with
        # preemption and dynamic scratch a request is admitted beside others only with a
        # padding block to spare, so there a hit always has a second block)
        assert "miss beside an entry without a snapshot" in events
        if not all(run.preempt for run in runs):
            assert HYBRID_HIT_EVICTED in events
    if tier == "host":
        # the batcher's flow (spill the victim, hit the host copy), a slot is never evicted
        # while a store writes it or a load reads it, a copy's source is never spilled, and a
        # cancelled load leaves its slot a host entry
        host = {"policy spill", "policy host hit", "host_evict of a STORING slot rejected",
                "host_evict of a LOADING slot rejected", "spill of a pinned entry rejected",
                "load cancelled"}
        # paged tables: a hit past the first block loaded from the host (the policy's too),
        # refused by each of its guards but table_not_full (as grow_hit's), a load into a
        # later block that failed, a host entry of a later block refused to an admission
        host |= {"host hit past the first block", "policy host hit past the first block",
                 LATER_LOAD_FAILED}
        assert host <= events, host - events
        want = {("grow_host_hit", g) for g in (
            "no_copy_in_flight", "tail_full", "slot_stored", "slot_at_the_boundary",
            "n_whole_chunks", "n_within_block", "n_within_entry", "token_left_to_compute",
            "prefix_matches", "dst_reusable")}
        want |= {("admit_host_hit", "slot_first_block")}
        assert want <= rejected, want - rejected
    for run in runs:
        if run.pd:
            check_pd_coverage(run)


def check_pd_coverage(run: Tally) -> None:
    """PD: blocks drained (abort or failure of a transferring lane) and were released by
    transfer_end; partial or mismatched payloads were refused; late, duplicate and misdirected
    events were refused by each guard that exists for them. Paged tables (T = 1..3): imports
    into tables of several blocks (grown by import_grow) landed, tables of several blocks were
    exported, an importing lane of several blocks was cancelled and one transfer_end freed
    every block draining for its request, an import_done was refused while the table was
    short of the prompt, and import_grow was refused by each guard that can refuse it
    (table_not_full cannot: a table short of a prompt of fewer than T * S tokens has room)."""
    paged = {MULTI_IMPORT, MULTI_EXPORT, IMPORT_DRAINS, DRAINS_END_TOGETHER, IMPORT_SHORT}
    assert all(run.events[k] for k in paged), {k: run.events[k] for k in paged}
    grow = [("import_grow", g) for g in ("lane_importing", "table_short_of_prompt",
                                         "dst_reusable")]
    grow += [("import_done", "table_covers_prompt")]
    assert all(run.rejected[k] for k in grow), {k: run.rejected[k] for k in grow}
    assert run.events["drain released"] > 0
    assert run.events["abort_running drains"] > 0 and run.events["fail drains"] > 0
    assert run.events["prefix import rejected"] > 0
    assert run.rejected["import_done", "covers_prompt"] > run.events["prefix import rejected"]
    late = [("import_done", "request_importing"), ("transfer_fail", "request_transferring"),
            ("export_done", "request_exporting"), ("transfer_end", "block_draining"),
            ("transfer_end", "transfer_of_request"), ("export", "lane_prefilled")]
    assert all(run.rejected[k] for k in late), {k: run.rejected[k] for k in late}


@pytest.mark.parametrize("pd", [False, True], ids=["colocated", "pd"])
@pytest.mark.parametrize("prefix,scratch", FEATURES,
                         ids=[f"{'prefix' if p else 'noprefix'}-{s}" for p, s in FEATURES])
def test_core_machine(prefix: bool, scratch: str, pd: bool) -> None:
    """Invariants, transition invariants, progress, the lifecycle model (every guard
    predicted), policy refinement and the ghost-off mirror, over B in 1..3, K from the proved
    minimum to minimum + 2: the colocated workload, and (pd) the same with prefill/decode
    disaggregation mixed in."""
    check_coverage("plain", prefix, run_machine(configs(committed, prefix, scratch), pd))


@pytest.mark.parametrize("pd", [False, True], ids=["colocated", "pd"])
@pytest.mark.parametrize("prefix,scratch", FEATURES,
                         ids=[f"{'prefix' if p else 'noprefix'}-{s}" for p, s in FEATURES])
def test_core_machine_preempt(prefix: bool, scratch: str, pd: bool) -> None:
    """The same checks with PREEMPT (T in 2..3, K from the preemption rule's minimum, T + 1
    with several lanes, to below every lane's whole table): preemptions as the adapter takes
    them (the policy's victim when a lane waits for a block and none is reusable; refinement:
    never the oldest lane while another may go) and with drawn lanes (every guard predicted),
    preempt storms (`storm`), and runs that end with every request finished
    (`run_to_completion`). pd: the same with prefill/decode disaggregation mixed in (one
    importing table grows at a time, taking blocks from computing lanes; an imported request
    that is preempted later is recomputed here)."""
    config = configs(committed, prefix, scratch, preempt=True)
    check_coverage("plain", prefix, run_machine(config, pd, preempt=True))


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("tier", TIERS)
def test_core_machine_tier_preempt(tier: str, scratch: str) -> None:
    """PREEMPT with a tier of the prefix cache, every check of the two families (the tier's,
    preemption's) over the same runs. Hybrid: a preempted lane's snapshots go with it (its
    full blocks are freed, never cached), and its restart takes new ones or a hit's. Host: a
    lane loading from the host is never preempted (`lane_computing`), and entries are
    spilled and loaded back between preemptions."""
    config = configs(committed, True, scratch, tier=tier, preempt=True)
    check_coverage(tier, True, run_machine(config, False, preempt=True))


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("tier", TIERS)
def test_core_machine_tier(tier: str, scratch: str) -> None:
    """The same checks with a tier of the prefix cache, colocated and then with PD mixed in,
    T in 1..3: hybrid (snapshots of the sliding state at chunk boundaries, taken at the right
    and wrong times; hits, at an admission or past the first block, only as deep as the
    entry's snapshots; misses beside entries without one) and host (entries spilled into 1..2
    host slots and loaded back, into a first block or a later one; stores and loads that fail;
    evictions, spills and hits refused while a slot is busy, spills while a copy reads the
    entry). The tier's coverage is over both runs."""
    config = configs(committed, True, scratch, tier=tier)
    check_coverage(tier, True, run_machine(config, False), run_machine(config, True))


def test_preempt_when_tables_fill_every_block() -> None:
    """B = 3, T = 2, S = 2, dynamic scratch, K = 4 (above the rule's T + 1 = 3): two lanes fill
    whole tables, one token short of their end, lane 2 idle. The decode call needs a padding
    target and there is none. Found by this machine when `requeue_fits` refused a sequence of
    T * S tokens (neither lane could go: stuck, at a K above a safe one); a restart of T * S
    tokens prefills them all and finishes at the table's end, so a lane may go."""
    c = committed.Consts(B=3, K=4, C=1, S=2, T=2, PREFIX=False, RESERVED=False, SCRATCH=3,
                         HYBRID=False, HOST=False, H=0, PREEMPT=True)
    assert c.K >= min_blocks(c.B, False, "dynamic", c.T, preempt=True)
    s = committed.init(c, True)
    steps = []
    for r in (0, 1):
        steps += [("submit", r, seq([1, 2, 3])), ("admit_miss", r, r, r), ("prefill", r, 1),
                  ("prefill", r, 1), ("grow", r, r + 2), ("prefill", r, 1)]
    for name, *args in steps:
        out = committed.ACTIONS[name][0](s, *args)
        assert out.rejected is None, (name, args, out.rejected)
        s = out.state
    assert committed.decode_guard(s, 3, 0, (0, 0, 0)) is not None  # no padding target
    assert committed.preempt_guard(s, 1) is None
    assert committed.progress_violations(s) == []


def test_core_machine_below_capacity() -> None:
    """One block below the proved minimum the core may get stuck, but stays safe."""
    config = st.one_of(*(configs(committed, p, s, extra=(-1, -1)) for p, s in FEATURES),
                       *(configs(committed, True, s, extra=(-1, -1), tier=t)
                         for t in TIERS for s in ("reserved", "dynamic")),
                       *(configs(committed, p, s, extra=(-1, -1), preempt=True)
                         for p, s in FEATURES))
    run_state_machine_as_test(make_machine(config=config, preempt=True))


def test_mirror_catches_a_ghost_off_divergence() -> None:
    """The ghost-off comparison has teeth: a mirror core that forgets `finish`'s key update
    (a non-ghost field) is caught by the field comparison, not by an invariant."""
    forgetful = codegen.load(MODEL.without_update("finish", "key"), "atom_core_mirror_mutant")
    machine = make_machine(config=configs(committed, True, "dynamic"), mirror_core=forgetful)
    with pytest.raises(MirrorDivergence) as info:
        run_state_machine_as_test(machine, settings=_search_settings())
    assert info.value.what == "key"


def _search_settings() -> settings:
    """Stop at the first failure, without shrinking: the failure is the point, and the test
    inspects it. The example budget is generous so random profiles find it too. Runs are long
    on purpose (the deep profile's 200 steps trip `large_base_example` on focused machines).
    No example database: a failure saved by an earlier version of the machine (or of the spec)
    replays as a different step sequence, which may trip another check than the expected one
    (every mutant run ends in a failure, so each one would be saved)."""
    return settings(settings.default, max_examples=1000, report_multiple_bugs=False,
                    phases=[Phase.explicit, Phase.generate], database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])


class Mutant(NamedTuple):
    """A planted bug: the spec variant, the features it shows in, the check that must catch
    it (an invariant's name, or `lifecycle:<guard>`: the core did not refuse a step the
    lifecycle model predicts that guard refuses, `lifecycle:accepted`: it refused one the
    model predicts it accepts, `progress:<property>`, `refinement:<action>`: the policy's
    choice was refused, `model:<action>`: after that step the core's state differs from the
    lifecycle model's; several when either may come first), the rules the search needs
    (None: every rule), whether the machine takes PD actions, the tier ("plain",
    "hybrid", "host"), the range of T (blocks per lane table) and PREEMPT (`configs`' preempt:
    None is PREEMPT off with K as low as with it)."""

    build: Callable[[], Any]
    features: tuple[bool, str]
    expected: str | tuple[str, ...]
    focus: set[str] | None
    pd: bool = False
    tier: str = "plain"
    tables: tuple[int, int] = (1, 1)
    preempt: bool | None = False


# Each mutant removes or weakens one guard or update. focus keeps only the rules the bug
# needs, so the search stays within a few seconds; the rules and every check are the same
# machine's.
HIT_RULES = {"submit", "advance", "admit_arbitrary"}
PD_FLOW = {"pd_flow"}
HYBRID_FLOW = {"hybrid_flow"}
HOST_FLOW = {"host_flow"}
GROW_RULES = {"submit", "advance", "grow"}
GROW_HIT_RULES = {"submit", "advance", "grow_hit"}
# (the grow_hit rule draws grow_host_hit calls too with the host tier; paged_flow's turns go on
# from conversations whose later blocks were spilled to the host)
HOST_GROW_RULES = {"submit", "advance", "grow_hit", "paged_flow"}
PREEMPT_RULES = {"submit", "advance", "storm", "preempt"}
MUTANTS: dict[str, Mutant] = {
    # A hit copying into its own source (or, when the source is pinned by another lane's copy,
    # dst_reusable refuses it where the lifecycle model expects dst_not_src).
    "admit_hit-dst_not_src": Mutant(
        lambda: MODEL.without_guard("admit_hit", "dst_not_src"),
        (True, "dynamic"), ("copy_source_cached", "lifecycle:dst_not_src"), HIT_RULES),
    "decode-scratch_target_ok": Mutant(
        lambda: MODEL.without_guard("decode", "scratch_target_ok"),
        (False, "dynamic"), "lane_holds_its_tokens", None),
    "finish-key": Mutant(
        lambda: MODEL.without_update("finish", "key"),
        (True, "dynamic"), "cache_key_is_content", None),
    # A miss beside a prefix hit: safe (the prefix is computed again), so no proof observes
    # it; the lifecycle model, which predicts every guard, does.
    "admit_miss-no_cache_hit": Mutant(
        lambda: MODEL.without_guard("admit_miss", "no_cache_hit"),
        (True, "dynamic"), "lifecycle:no_cache_hit", HIT_RULES),
    "admit_miss-dst_reusable": Mutant(
        lambda: MODEL.without_guard("admit_miss", "dst_reusable"),
        (False, "dynamic"), "no_block_in_two_tables",
        {"submit", "admit", "admit_arbitrary", "must_reject"}),
    "copy_done-copying": Mutant(
        lambda: MODEL.without_update("copy_done", "copying"),
        (True, "dynamic"), "copy_target_not_ready", None),
    "abort_running-copying": Mutant(
        lambda: MODEL.without_update("abort_running", "copying"),
        (True, "reserved"), "copy_only_while_prefilling",
        {"submit", "admit", "advance", "abort"}),
    "finish-keep_needs_prefix_cache": Mutant(
        lambda: MODEL.without_guard("finish", "keep_needs_prefix_cache"),
        (False, "reserved"), "cache_needs_prefix_cache", None),
    # A prompt that does not fit a table is accepted: past T * S tokens the invariant tells;
    # at exactly T * S (which waiting_prompt_fits allows: a preempted request's prompt may be
    # that long) only the lifecycle model does.
    "submit-prompt_fits": Mutant(
        lambda: MODEL.without_guard("submit", "prompt_fits"),
        (False, "dynamic"), ("waiting_prompt_fits", "lifecycle:prompt_fits"), None),
    # A hit of any n > 0 (not whole chunks) is accepted, and breaks the chunk boundary; the
    # lifecycle model, which predicts every guard, also notices when a later guard refuses it.
    "admit_hit-n_whole_chunks-weakened": Mutant(
        lambda: _weakened_chunk_guard(),
        (True, "dynamic"), ("prefill_on_chunk_boundary", "lifecycle:n_whole_chunks"),
        HIT_RULES),
    # PD (T = 1..3: imports and exports of one block or several). A partial or mismatched
    # payload is imported as if it were the prompt's KV.
    "import_done-covers_prompt": Mutant(
        lambda: MODEL.without_guard("import_done", "covers_prompt"),
        (False, "dynamic"), "lane_holds_its_tokens", PD_FLOW, pd=True, tables=(1, 3)),
    # covers_prompt off by one: the payload must hold the first token's KV too. The real
    # payload is refused (only the lifecycle model notices: a transfer may always fail, so no
    # progress property does), and an over-long one is imported.
    "import_done-covers_prompt-off-by-one": Mutant(
        lambda: _import_needs_first_token(),
        (False, "dynamic"), ("lane_holds_its_tokens", "lifecycle:accepted"), PD_FLOW, pd=True,
        tables=(1, 3)),
    # A late transfer_end naming another request frees a block whose transfer still runs: the
    # ghost says that transfer still uses the block (any block of its table, not only its
    # first), so the pin it lost breaks an invariant before the lifecycle model's check.
    "transfer_end-transfer_of_request": Mutant(
        lambda: MODEL.without_guard("transfer_end", "transfer_of_request"),
        (False, "reserved"), ("running_transfer_pins_its_block", "transfer_pins_what_it_uses",
                              "lifecycle:transfer_of_request"),
        PD_FLOW | {"late_pd_event"}, pd=True, tables=(1, 3)),
    # A transfer_end for a block that is not draining (named with its transfer's request) is
    # accepted: a running lane's block is freed (lane_block_owned); when the block is free or
    # cached the state stays consistent, and only the lifecycle model notices.
    "transfer_end-block_draining": Mutant(
        lambda: MODEL.without_guard("transfer_end", "block_draining"),
        (False, "dynamic"), ("lane_block_owned", "lifecycle:block_draining"),
        PD_FLOW | {"late_pd_event"}, pd=True, tables=(1, 3)),
    "admit_import-transfer": Mutant(
        lambda: MODEL.without_update("admit_import", "transfer"),
        (False, "dynamic"), "moving_lane_has_transfer", PD_FLOW, pd=True, tables=(1, 3)),
    "export_done-transfer": Mutant(
        lambda: MODEL.without_update("export_done", "transfer"),
        (True, "dynamic"), "transfer_block_held", PD_FLOW, pd=True, tables=(1, 3)),
    # Abort and failure free a transferring lane's blocks instead of draining them.
    "cancel-frees": Mutant(
        lambda: _cancel_frees(), (False, "reserved"), "transfer_block_held", PD_FLOW, pd=True,
        tables=(1, 3)),
    # export from any decoding lane, not only one that has just prefilled.
    "export-lane_prefilled-weakened": Mutant(
        lambda: _weakened_export_guard(),
        (False, "reserved"), "export_after_prefill", PD_FLOW | {"advance"}, pd=True, tables=(1, 3)),
    # An import may take a draining block (whose old transfer still writes into it). (As for
    # transfer_end-transfer_of_request: a draining block that is not its transfer's first one
    # is pinned by no invariant, and only the lifecycle model notices.)
    "admit_import-reuses-draining": Mutant(
        lambda: _import_reuses_draining(),
        (False, "dynamic"), ("running_transfer_pins_its_block", "lifecycle:dst_reusable"),
        PD_FLOW | {"admit_import", "must_reject"}, pd=True, tables=(1, 3)),
    # Hybrid prefix cache. A hit deeper than the entry's snapshots: the lane resumes with a
    # sliding state restored from no snapshot at its length; or, where a later guard refuses
    # the hit all the same (its dst), the lifecycle model notices the spec's guard is gone.
    "admit_hit-hybrid_snapshot_at_n": Mutant(
        lambda: MODEL.without_guard("admit_hit", "hybrid_snapshot_at_n"),
        (True, "dynamic"), ("hybrid_hit_has_snapshot", "lifecycle:hybrid_snapshot_at_n"),
        HYBRID_FLOW, tier="hybrid"),
    # A snapshot off the next boundary: one skipped (its state was never saved) or taken
    # where the lane is not (at the admission of a miss, mid-chunk while decoding).
    "snapshot-next_boundary": Mutant(
        lambda: MODEL.without_guard("snapshot", "next_boundary"),
        (True, "reserved"), ("lane_snapshots_are_its_own", "snapshots_on_chunk_boundaries"),
        HYBRID_FLOW, tier="hybrid"),
    # hit_ok without its hybrid clause: an entry without a snapshot at the first chunk blocks
    # a miss though no hit can use it, so a request may never be admitted (the policy's miss
    # is refused, or the lifecycle model's, or the state is stuck).
    # A hybrid miss evicts its hit's entry while another block is free (the exception without
    # its "only reusable block" condition): the hit's prefix is computed again for nothing.
    "admit_miss-hybrid-evicts-beside-a-free-block": Mutant(
        lambda: _hybrid_miss_evicts_any_hit(),
        (True, "dynamic"), "lifecycle:no_cache_hit", HYBRID_FLOW | HIT_RULES, tier="hybrid"),
    "admit_miss-no_cache_hit-ignores-snapshots": Mutant(
        lambda: _miss_ignores_snapshots(),
        (True, "dynamic"),
        ("progress:idle_lane_admits", "refinement:admit_miss", "lifecycle:accepted"),
        HYBRID_FLOW, tier="hybrid"),
    # Host tier. A hit on a slot without an entry: one a store is writing (the spilling block
    # loses its store), one a load reads (the other lane's load loses its slot), an empty one.
    "admit_host_hit-slot_stored": Mutant(
        lambda: MODEL.without_guard("admit_host_hit", "slot_stored"),
        (True, "dynamic"),
        ("host_key_is_content", "spilling_block_has_its_store", "load_reads_a_loading_slot",
         "loading_slot_has_its_lane", "lifecycle:slot_stored"), HOST_FLOW, tier="host"),
    # Eviction of a slot a store writes or a load reads.
    "host_evict-slot_stored": Mutant(
        lambda: MODEL.without_guard("host_evict", "slot_stored"),
        (True, "reserved"),
        ("spilling_block_has_its_store", "load_reads_a_loading_slot", "lifecycle:slot_stored"),
        HOST_FLOW, tier="host"),
    # A spill of an entry a device copy reads: it leaves the cache under the copy (or, into a
    # busy slot, slot_empty refuses it where the lifecycle model expects entry_unpinned).
    "spill-entry_unpinned": Mutant(
        lambda: MODEL.without_guard("spill", "entry_unpinned"),
        (True, "dynamic"), ("copy_source_cached", "lifecycle:entry_unpinned"), HOST_FLOW,
        tier="host"),
    # A spill into a slot that holds an entry, a store or a load.
    "spill-slot_empty": Mutant(
        lambda: MODEL.without_guard("spill", "slot_empty"),
        (True, "reserved"),
        ("spilling_block_has_its_store", "load_reads_a_loading_slot",
         "loading_slot_has_its_lane", "lifecycle:slot_empty"), HOST_FLOW, tier="host"),
    # A failed load leaves its slot loading, read by no lane (never evictable again).
    "load_fail-slot_state": Mutant(
        lambda: MODEL.without_update("load_fail", "slot_state"),
        (True, "dynamic"), "loading_slot_has_its_lane", HOST_FLOW, tier="host"),
    # Paged tables. A grow of a lane whose tail is not full: the next block starts mid-block
    # (the runtime's table[p // S] then names the wrong block), overlapping the tail (or, into
    # a block it may not take, a later guard refuses it where the lifecycle model expects
    # tail_full).
    "grow-tail_full": Mutant(
        lambda: MODEL.without_guard("grow", "tail_full"),
        (False, "dynamic"),
        ("blocks_do_not_overlap", "owned_block_in_table", "tables_are_dense",
         "lifecycle:tail_full"), GROW_RULES, tables=(2, 3)),
    # A grow past T blocks: the table outgrows the runtime's block_tables row (or, with no
    # block left to take, dst_reusable refuses it where the lifecycle model expects
    # table_not_full).
    "grow-table_not_full": Mutant(
        lambda: MODEL.without_guard("grow", "table_not_full"),
        (True, "reserved"), ("table_within_T", "lifecycle:table_not_full"), GROW_RULES,
        tables=(2, 2)),
    # The next block keeps a stale start (of its last use, or 0): the lane's tokens are
    # placed where another of its blocks is.
    "grow-start": Mutant(
        lambda: MODEL.without_update("grow", "start"),
        (False, "reserved"),
        ("blocks_do_not_overlap", "owned_block_in_table", "tables_are_dense",
         "length_within_block"), GROW_RULES, tables=(2, 3)),
    # The full block gets no key when the lane grows: cached at finish, its key is stale.
    "grow-key": Mutant(
        lambda: MODEL.without_update("grow", "key"),
        (True, "dynamic"), ("full_block_holds_its_key", "cache_key_is_content"), GROW_RULES,
        tables=(2, 3)),
    # A prefill chunk past a full tail: written beyond the block's end.
    "prefill-chunk_within_block": Mutant(
        lambda: MODEL.without_guard("prefill", "chunk_within_block"),
        (False, "dynamic"), "length_within_block", {"submit", "admit", "prefill"},
        tables=(2, 3)),
    # A hit on an entry that starts later in its sequence (a full block of a cached table, or a
    # tail after one): it is copied into the lane's first block as if it held the prompt's
    # first tokens. The ghost content of a block is its whole prefix, so the copy's own
    # invariant tells as soon as the copy starts (lane_holds_its_tokens only once it lands);
    # where a later guard refuses it, the lifecycle model does.
    "admit_hit-src_first_block": Mutant(
        lambda: MODEL.without_guard("admit_hit", "src_first_block"),
        (True, "dynamic"), ("copy_at_its_position", "lifecycle:src_first_block"), HIT_RULES,
        tables=(2, 3)),
    # Hits past the first block (`grow_hit`). From an entry at another position: one that
    # ends before the boundary holds too few tokens (n_within_entry), so a later block of a
    # chain that shares the prompt's prefix (T = 3), copied into the wrong positions; or,
    # where a later guard refuses the call, the lifecycle model notices; or the spec now
    # accepts a hit the policy does not look for (it is no longer the longest). (With the
    # lifecycle model and the longest-hit check taken out, copy_at_its_position catches it.)
    "grow_hit-src_at_the_boundary": Mutant(
        lambda: MODEL.without_guard("grow_hit", "src_at_the_boundary"),
        (True, "dynamic"),
        ("copy_at_its_position", "lifecycle:src_at_the_boundary", "refinement:grow_hit"),
        GROW_HIT_RULES, tables=(3, 3)),
    # From an entry at the boundary whose key goes another way (before the boundary, or in
    # the copied tokens): the lane's next block gets KV of other tokens. The spec's longest
    # hit is then often one the policy rightly does not take (or the lifecycle model notices
    # first; without both, copy_source_holds_prefix catches it).
    "grow_hit-prefix_matches": Mutant(
        lambda: MODEL.without_guard("grow_hit", "prefix_matches"),
        (True, "reserved"),
        ("copy_source_holds_prefix", "lifecycle:prefix_matches", "refinement:grow_hit"),
        GROW_HIT_RULES, tables=(2, 3)),
    # More tokens than the entry holds (a cached tail, partly filled). The generated core stays
    # safe: `take` of more tokens than a key has is the whole key, shorter than the lane's
    # prefix, so prefix_matches refuses the call (the proofs, over an uninterpreted `take`,
    # need the guard); only the lifecycle model notices, by the guard the core names.
    "grow_hit-n_within_entry": Mutant(
        lambda: MODEL.without_guard("grow_hit", "n_within_entry"),
        (True, "dynamic"), "lifecycle:n_within_entry", GROW_HIT_RULES, tables=(2, 3)),
    # The copy is not marked in flight: the lane computes (or is cached) from a block that
    # holds nothing yet, and its source is not pinned.
    "grow_hit-copying": Mutant(
        lambda: MODEL.without_update("grow_hit", "copying"),
        (True, "reserved"), "lane_holds_its_tokens", GROW_HIT_RULES, tables=(2, 3)),
    # Hybrid: a hit past the first block deeper than the entry's snapshots: copy_done restores
    # the sliding state from no snapshot at the lane's length (the lane takes the entry's
    # snapshots only as far as they go); or, where a later guard refuses the call, the
    # lifecycle model notices; or the spec now accepts a hit the policy does not look for
    # (`Policy.next_hit` stops at the snapshots: no longer the longest).
    "grow_hit-hybrid_snapshot_at_n": Mutant(
        lambda: MODEL.without_guard("grow_hit", "hybrid_snapshot_at_n"),
        (True, "dynamic"),
        ("hybrid_hit_has_snapshot", "lifecycle:hybrid_snapshot_at_n", "refinement:grow_hit"),
        GROW_HIT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3)),
    # Hybrid: a full block keeps none of the lane's snapshots when it fills (`extend` as before
    # paged hybrid tables: snap_upto 0). No hit restores a wrong state, but once cached a full
    # block serves none: no admission hit on a full first block, no hit past the first block
    # from a middle block, and a lane prefills again what the cache holds. The ghost says the
    # host still holds the lane's snapshots (`entry_snapshots_were_taken`: the count is
    # exactly what was taken); the lifecycle model hands them over as the spec says, so the
    # core's full block differs from it as soon as the lane grows.
    "extend-keeps-no-snapshots": Mutant(
        lambda: _extend_keeps_no_snapshots(),
        (True, "reserved"), ("entry_snapshots_were_taken", "model:grow", "model:grow_hit"),
        GROW_HIT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3)),
    # Hybrid: a full block claims snapshots at every boundary up to its end, whichever the
    # lane took. A later hit into it restores the sliding state from a snapshot the host
    # never took; the ghost count of snapshots taken catches the claim when the block fills.
    "extend-claims-snapshots-to-its-end": Mutant(
        lambda: _extend_claims_snapshots_to_its_end(),
        (True, "reserved"), ("entry_snapshots_were_taken", "model:grow", "model:grow_hit"),
        GROW_HIT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3)),
    # Host hits past the first block (`grow_host_hit`). From a host entry at another position
    # (a first block's, or another later block's): its tokens land at the wrong positions; or,
    # where a later guard refuses the call, the lifecycle model notices; or the spec now
    # accepts a hit the policy does not look for (it is no longer the longest).
    "grow_host_hit-slot_at_the_boundary": Mutant(
        lambda: MODEL.without_guard("grow_host_hit", "slot_at_the_boundary"),
        (True, "dynamic"),
        ("copy_at_its_position", "lifecycle:slot_at_the_boundary",
         "refinement:grow_host_hit"), HOST_GROW_RULES, tier="host", tables=(2, 3)),
    # From a host entry at the boundary whose key goes another way: the lane's next block gets
    # KV of other tokens (the load reads a slot that does not hold the lane's prefix).
    "grow_host_hit-prefix_matches": Mutant(
        lambda: MODEL.without_guard("grow_host_hit", "prefix_matches"),
        (True, "reserved"),
        ("load_reads_a_loading_slot", "lifecycle:prefix_matches", "refinement:grow_host_hit"),
        HOST_GROW_RULES, tier="host", tables=(2, 3)),
    # More than a block's worth of tokens. The generated core stays safe: a host entry at the
    # boundary holds at most a block's worth past it, so n_within_entry refuses the call (the
    # proofs, which do not know that bound, need the guard); only the lifecycle model
    # notices, by the guard the core names.
    "grow_host_hit-n_within_block": Mutant(
        lambda: MODEL.without_guard("grow_host_hit", "n_within_block"),
        (True, "dynamic"), "lifecycle:n_within_block", HOST_GROW_RULES, tier="host",
        tables=(2, 3)),
    # A failed load into a later block recomputes the prompt from the start (as a failed load
    # at an admission does): the lane's length falls below its tail block's start, whose
    # earlier blocks it would write again.
    "load_fail-recomputes-the-prompt": Mutant(
        lambda: _load_fail_from_start(),
        (True, "reserved"), ("length_within_block", "tables_are_dense"), HOST_GROW_RULES,
        tier="host", tables=(2, 3)),
    # PD with paged tables. An importing lane's next block is not pinned for its transfer:
    # a cancel would free it under the transfer's writes.
    "import_grow-transfer": Mutant(
        lambda: MODEL.without_update("import_grow", "transfer"),
        (False, "dynamic"), "moving_lane_has_transfer", PD_FLOW, pd=True, tables=(2, 3)),
    # The next block is pinned for the request its last transfer was (a stale transfer_req):
    # its drain would end with the wrong transfer.
    "import_grow-transfer_req": Mutant(
        lambda: MODEL.without_update("import_grow", "transfer_req"),
        (True, "reserved"), ("transfer_names_lane_request", "model:import_grow"), PD_FLOW,
        pd=True, tables=(2, 3)),
    # The next block keeps a stale start (of its last use, or 0): the transfer writes the
    # prompt's next block's worth where another block of the table is.
    "import_grow-start": Mutant(
        lambda: MODEL.without_update("import_grow", "start"),
        (False, "reserved"),
        ("blocks_do_not_overlap", "owned_block_in_table", "tables_are_dense",
         "import_target_untouched"), PD_FLOW, pd=True, tables=(2, 3)),
    # An importing lane grows past its prompt's end (a block no token lands in, pinned).
    "import_grow-table_short_of_prompt": Mutant(
        lambda: MODEL.without_guard("import_grow", "table_short_of_prompt"),
        (False, "dynamic"), ("import_target_untouched", "lifecycle:table_short_of_prompt"),
        PD_FLOW | {"must_reject"}, pd=True, tables=(2, 3)),
    # An import lands before its table covers the prompt: the lane's length passes its tail.
    "import_done-table_covers_prompt": Mutant(
        lambda: MODEL.without_guard("import_done", "table_covers_prompt"),
        (False, "reserved"), ("length_within_block", "lifecycle:table_covers_prompt"),
        PD_FLOW, pd=True, tables=(2, 3)),
    # An export pins only its lane's tail: the blocks before it are freed under the send when
    # the lane is cancelled (or, cancelled, never drain).
    "export-pins-only-the-tail": Mutant(
        lambda: _export_pins_tail_only(),
        (True, "dynamic"), "moving_lane_has_transfer", PD_FLOW, pd=True, tables=(2, 3)),
    # transfer_end frees only the block it names: the request's other draining blocks stay
    # pinned by a transfer that has ended (never freed: no event names them again).
    "transfer_end-frees-only-b": Mutant(
        lambda: _transfer_end_frees_only_b(),
        (False, "dynamic"), ("pinned_block_transfer_running", "model:transfer_end"),
        PD_FLOW, pd=True, tables=(2, 3)),
    # finish frees (or caches) only the tail: the lane's other blocks stay owned by an idle
    # lane, lost to every later admission.
    "finish-frees-only-the-tail": Mutant(
        lambda: _finish_frees_tail_only(),
        (True, "dynamic"), ("owned_block_in_table", "lane_blocks_are_its_table"), GROW_RULES,
        tables=(2, 3)),
    # Preemption. Without PREEMPT (K as low as with it): a lane is preempted all the same (the
    # state stays consistent, but a running request waits again: requeued_only_by_preemption).
    "preempt-preemption_on": Mutant(
        lambda: MODEL.without_guard("preempt", "preemption_on"),
        (False, "dynamic"), ("requeued_only_by_preemption", "lifecycle:preemption_on"),
        PREEMPT_RULES, tables=(2, 3), preempt=None),
    # An idle lane is preempted (its last request, ended, is waiting again; or none) or a
    # copying one (its copy lands in a free block); or, where some other guard refuses, the
    # lifecycle model notices.
    "preempt-lane_computing": Mutant(
        lambda: MODEL.without_guard("preempt", "lane_computing"),
        (True, "reserved"),
        ("ended_is_final", "copy_only_while_prefilling", "copy_target_not_ready",
         "unsubmitted_request_has_no_prompt", "waiting_prompt_fits",
         "lifecycle:lane_computing"), PREEMPT_RULES, tables=(2, 3), preempt=True),
    # A preemption while a block is free (or no lane waits for one): safe, but work is thrown
    # away; a lane running alone may be preempted (lone_lane_is_never_preempted).
    "preempt-no_block_reusable": Mutant(
        lambda: MODEL.without_guard("preempt", "no_block_reusable"),
        (False, "dynamic"),
        ("lifecycle:no_block_reusable", "progress:lone_lane_is_never_preempted"),
        PREEMPT_RULES, tables=(2, 3), preempt=True),
    "preempt-a_lane_waits_for_a_block": Mutant(
        lambda: MODEL.without_guard("preempt", "a_lane_waits_for_a_block"),
        (True, "dynamic"),
        ("lifecycle:a_lane_waits_for_a_block", "progress:lone_lane_is_never_preempted"),
        PREEMPT_RULES, tables=(2, 3), preempt=True),
    # A lane at its table end (its sequence T * S + 1 tokens) is preempted: its new prompt
    # cannot fit.
    "preempt-requeue_fits": Mutant(
        lambda: MODEL.without_guard("preempt", "requeue_fits"),
        (False, "reserved"), ("waiting_prompt_fits", "lifecycle:requeue_fits",
                              "refinement:preempt"), PREEMPT_RULES,
        tables=(2, 3), preempt=True),
    # The preempted lane's blocks stay its own (lost to every later admission and growth).
    "preempt-owner": Mutant(
        lambda: MODEL.without_update("preempt", "owner"),
        (False, "dynamic"), ("owned_block_in_table", "lane_blocks_are_its_table"),
        PREEMPT_RULES - {"preempt"}, tables=(2, 3), preempt=True),
    # The preempted lane's blocks become cache entries: its tail has no key (its content is a
    # partial block), and without the prefix cache there is no cache at all.
    "preempt-caches": Mutant(
        lambda: _preempt_caches(),
        (True, "dynamic"),
        ("cache_key_is_content", "cache_head_is_first_chunk", "cache_needs_prefix_cache"),
        PREEMPT_RULES - {"preempt"}, tables=(2, 3), preempt=True),
    # The request stays running, with no lane.
    "preempt-phase": Mutant(
        lambda: MODEL.without_update("preempt", "phase"),
        (False, "reserved"), ("running_request_has_lane", "busy_lane_runs_its_request"),
        PREEMPT_RULES - {"preempt"}, tables=(2, 3), preempt=True),
    # Hybrid: the preempted lane keeps its snapshot count while idle; its next request would
    # claim snapshots of another sequence (a hit restores from them).
    "preempt-lane_snap": Mutant(
        lambda: MODEL.without_update("preempt", "lane_snap"),
        (True, "dynamic"), ("idle_lane_has_no_snapshots", "model:preempt"),
        PREEMPT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3), preempt=True),
}


def _weakened_chunk_guard() -> Any:
    """admit_hit accepts any positive n, not only whole chunks (with_guard)."""
    (n,) = [p for p in MODEL.get_action("admit_hit").params if p.name == "n"]
    return MODEL.with_guard("admit_hit", "n_whole_chunks", n > 0)


def _param(action: str, name: str) -> Any:
    (v,) = [p for p in MODEL.get_action(action).params if p.name == name]
    return v


def _import_needs_first_token() -> Any:
    """import_done's covers_prompt compares p with the prompt and the first token (with_guard)."""
    r, p, tok = (_param("import_done", x) for x in ("r", "p", "tok"))
    return MODEL.with_guard("import_done", "covers_prompt",
                            p == spec.push(spec.lane_seq(spec.req_lane(r)), tok))


def _weakened_export_guard() -> Any:
    """export accepts any decoding lane (with_guard)."""
    return MODEL.with_guard("export", "lane_prefilled", spec.decoding(_param("export", "l")))


def _import_reuses_draining() -> Any:
    """admit_import's dst may be a draining block too (with_guard)."""
    dst = _param("admit_import", "dst")
    return MODEL.with_guard("admit_import", "dst_reusable", lang.one_of(
        spec.owner(dst), spec.Owner.FREE, spec.Owner.CACHE, spec.Owner.DRAINING)
        & ~spec.pinned(dst))


def _export_pins_tail_only() -> Any:
    """`export` pins (transfer, transfer_req) only its lane's tail, not every block of its
    table: those updates over every block b are replaced on a copy of the model (see
    _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("export")
    l = _param("export", "l")
    a.updates = [lang.Update(u.fn, u.args, lang.ite(
        u.args[0] == spec.tail(l), {"transfer": lang.Lit(True, lang.BOOL),
                                    "transfer_req": spec.lane_req(l)}[u.fn.name],
        u.fn(u.args[0])), u.whole)
        if u.fn.name in ("transfer", "transfer_req") else u for u in a.updates]
    return m


def _transfer_end_frees_only_b() -> Any:
    """`transfer_end(r, b)` frees (owner, transfer, junk) only b, not every block draining for
    r: those updates over every block c are replaced on a copy of the model (see
    _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("transfer_end")
    b = _param("transfer_end", "b")
    value = {"owner": lambda c: lang.ite(c == b, spec.Owner.FREE, spec.owner(c)),
             "transfer": lambda c: lang.ite(c == b, lang.Lit(False, lang.BOOL),
                                            spec.transfer(c)),
             "junk": lambda c: spec.junk(c) | (c == b)}
    a.updates = [lang.Update(u.fn, u.args, value[u.fn.name](u.args[0]), u.whole)
                 if u.fn.name in value and u.whole else u for u in a.updates]
    return m


def _miss_ignores_snapshots() -> Any:
    """admit_miss's no_cache_hit refuses a miss beside any entry sharing the first chunk, with
    or without a snapshot there (hit_ok without its HYBRID clause; with_guard)."""
    r = _param("admit_miss", "r")
    return MODEL.with_guard("admit_miss", "no_cache_hit", lang.implies(spec.PREFIX, lang.forall(
        spec.Block, lambda b: ~(
            (spec.slen(spec.prompt(r)) > spec.C) & (spec.owner(b) == spec.Owner.CACHE)
            & (spec.head(b) == spec.take(spec.prompt(r), spec.C))
            & (spec.slen(spec.key(b)) >= spec.C)))))


def _hybrid_miss_evicts_any_hit() -> Any:
    """no_cache_hit whose hybrid exception lets a miss take its hit's entry whatever else is
    reusable (hybrid_evicts_its_hit without its only-reusable-block clause)."""
    r, dst = _param("admit_miss", "r"), _param("admit_miss", "dst")
    return MODEL.with_guard("admit_miss", "no_cache_hit", lang.implies(spec.PREFIX, lang.forall(
        spec.Block, lambda b: ~(spec.hit_ok(r, b) & ~(spec.HYBRID & (b == dst))))))


def _cancel_frees() -> Any:
    """`cancel` (abort_running, fail) frees the lane's blocks even while a transfer uses one.
    The mutant API removes guards and updates or replaces a guard, not an update's value, so
    the owner update (over every block b) is replaced here on a copy of the model."""
    m = MODEL.copy()
    for name in ("abort_running", "fail"):
        a = m.get_action(name)
        (l,) = [p for p in a.params if p.name == "l"]
        a.updates = [lang.Update(u.fn, u.args, lang.ite(spec.lane_block(u.args[0], l),
                                                        spec.Owner.FREE, spec.owner(u.args[0])),
                                 u.whole)
                     if u.fn.name == "owner" else u for u in a.updates]
    return m


def _finish_frees_tail_only() -> Any:
    """`finish` caches (keep) or frees only the lane's tail, not its whole table: its owner
    update over every block b is replaced on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("finish")
    l, keep = (_param("finish", x) for x in ("l", "keep"))
    a.updates = [lang.Update(u.fn, u.args, lang.ite(
        u.args[0] == spec.tail(l), lang.ite(keep, spec.Owner.CACHE, spec.Owner.FREE),
        spec.owner(u.args[0])), u.whole) if u.fn.name == "owner" else u for u in a.updates]
    return m


def _load_fail_from_start() -> Any:
    """`load_fail` sets the lane's length (and its tail's content) to the prompt's start, 0,
    not its tail block's start: the length and holds updates are replaced on a copy of the
    model (see _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("load_fail")
    l = _param("load_fail", "l")
    zero = {"length": lang.Lit(0, lang.INT),
            "holds": spec.take(spec.lane_seq(l), lang.Lit(0, lang.INT))}
    a.updates = [lang.Update(u.fn, u.args, zero[u.fn.name], u.whole) if u.fn.name in zero
                 else u for u in a.updates]
    return m


def _extend_claims_snapshots_to_its_end() -> Any:
    """`extend` gives the full block snapshots up to its end (snap_upto := the lane's length)
    instead of the lane's: the update is replaced on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    for name in ("grow", "grow_hit", "grow_host_hit"):
        a = m.get_action(name)
        (l,) = [p for p in a.params if p.name == "l"]
        a.updates = [lang.Update(u.fn, u.args, lang.ite(spec.HYBRID, spec.length(l), 0), u.whole)
                     if u.fn.name == "snap_upto" else u for u in a.updates]
    return m


def _extend_keeps_no_snapshots() -> Any:
    """`extend` (the updates grow, grow_hit and grow_host_hit share) gives the full block no
    snapshots (snap_upto 0, snap_junk False) instead of the lane's: those updates are replaced
    on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    none = {"snap_upto": lang.Lit(0, lang.INT), "snap_junk": lang.Lit(False, lang.BOOL)}
    for name in ("grow", "grow_hit", "grow_host_hit"):
        a = m.get_action(name)
        a.updates = [lang.Update(u.fn, u.args, none[u.fn.name], u.whole)
                     if u.fn.name in none else u for u in a.updates]
    return m


def _preempt_caches() -> Any:
    """`preempt` makes its lane's blocks cache entries instead of freeing them: its owner update
    over every block b is replaced on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("preempt")
    l = _param("preempt", "l")
    a.updates = [lang.Update(u.fn, u.args, lang.ite(
        spec.lane_block(u.args[0], l), spec.Owner.CACHE, spec.owner(u.args[0])), u.whole)
        if u.fn.name == "owner" else u for u in a.updates]
    return m


def caught_by(exc: AssertionError) -> list[str]:
    """The checks that reported `exc`, as MUTANTS names them."""
    if isinstance(exc, LifecycleDivergence):
        return [f"lifecycle:{exc.expected or 'accepted'}"]
    if isinstance(exc, ProgressViolation):
        return [f"progress:{x}" for x in exc.names]
    if isinstance(exc, RefinementViolation):
        return [f"refinement:{exc.action}"]
    if isinstance(exc, ModelDivergence):
        return [f"model:{exc.action}"]
    assert isinstance(exc, InvariantViolation)
    assert exc.kind != "checker crash", str(exc)  # checkers report, never raise
    return exc.names


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_machine_catches_mutant(name: str) -> None:
    """The same machine over a mutant core reports the expected invariant (or lifecycle
    guard). Each search starts from fresh `Stats`, so what the machine does "once a run"
    (e.g. `storm_once`) does not depend on the tests that ran before it in the process; a
    failure in such a step is not replayed (the replay has it counted already), so hypothesis
    reports it as flaky: the failure it saw is the one checked."""
    m = MUTANTS[name]
    Stats.reset()
    mutant = codegen.load(m.build(), f"atom_core_mutant_{name.replace('-', '_')}")
    config = configs(mutant, *m.features, lanes=(2, 2), tier=m.tier, tables=m.tables,
                     preempt=m.preempt)
    if name == "admit_hit-n_whole_chunks-weakened":
        config = config.filter(lambda c: c.C == 2)
    machine = make_machine(mutant, config, mirror=False, focus=m.focus, pd=m.pd,
                           preempt=m.preempt is not False)
    kinds = (InvariantViolation, LifecycleDivergence, ProgressViolation, RefinementViolation,
             ModelDivergence)
    with pytest.raises((*kinds, FlakyFailure)) as info:
        run_state_machine_as_test(machine, settings=_search_settings())
    exc = info.value
    if isinstance(exc, FlakyFailure):
        (exc,) = exc.exceptions
        assert isinstance(exc, kinds), repr(exc)
    expected = {m.expected} if isinstance(m.expected, str) else set(m.expected)
    assert expected & set(caught_by(exc)), (caught_by(exc), str(exc))
