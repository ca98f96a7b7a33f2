"""Stateful fuzzing of the generated core (hypothesis `RuleBasedStateMachine`).

The machine drives `atom_core._generated.core` (ghost state on) through every action, with
choices from the policy and with arbitrary drawn parameters, over small configurations that
exercise chunked prefill, prefix hits, padding rows, paged block tables (T = 1..3 blocks per
lane: `grow` gives a lane whose tail block is full its next block, as the adapter does before
each prefill or decode call, and `grow_hit` copies it from the cache entry at that position
when the prompt goes on as the entry's key does: a hit past the first block) and the table
end. After every step it
checks the spec's invariants, transition invariants and (when quiescent: no copy or load in
flight, no block draining, no store in flight) progress, and compares the core against a
plain-Python model (`atom_core.testing.lifecycle.Life`): the request lifecycle, each lane's
block table, every
block's owner and start, the cache entries' keys and snapshot boundaries, the host slots.
The model predicts the guard that refuses each call (or that none does), and the core must
agree.
With `pd`, requests may also take the prefill/decode disaggregation path: import their KV by
transfer (decode side: the lane's table grows by `import_grow` until it covers the prompt, up
to T * S - 1 tokens, and only then may the import land) or export it after prefill (prefill
side: every block of the lane's table is sent), with transfers that fail, get cancelled (every
block of the lane drains until the transfer ends, and its one `transfer_end` frees them all)
and events that arrive late, twice or for the wrong request (refused, changing nothing).
With preemption too: one importing table grows at a time (a second import is refused until it
covers its prompt), taking its blocks from computing lanes (preempted: an importing lane never
is), and an imported request preempted later (it decodes) waits and is recomputed locally.
The prefix cache's tiers (`TIERS`, one per configuration):
* hybrid: sliding-window layers; the lane's sliding state is snapshotted at chunk boundaries
  (`snapshot`, at the right and at wrong times), a cache entry keeps its lane's snapshots, a
  hit is only as deep as they reach (`hybrid_snapshot_at_n`), and an entry without a snapshot
  at the first chunk does not block a miss; with paged tables (T = 1..3) a full block keeps
  the lane's snapshots when it fills, and a hit past the first block (`grow_hit`) goes only
  as far as the entry's snapshots, which the lane takes (its copy restores the sliding state
  at its new length);
* host: 1..2 host slots; entries are spilled there (the batcher's way: the victim of an
  admission or of a lane's next block, into the policy's slot) and loaded back by host hits;
  with paged tables (T = 1..3) a later block's entry too, loaded into a lane's later block
  when its prompt goes on as the entry's key does (`grow_host_hit`, a host hit past the first
  block; never by an admission: `slot_first_block`); stores and loads fail (a failed load
  into a later block recomputes only that block), requests are cancelled while their load is
  in flight, and a slot that a store writes or a load reads is never evicted, spilled into or
  hit, an entry a copy reads never spilled.

It also checks:
* refinement: every choice `Policy` makes (admissions, host hits, spills and the host
  evictions they need, the lanes that grow, their next blocks and the hits, device or host,
  that fill them) is
  accepted by the core's guard; the policy never declines an admission in a quiescent state
  with an idle lane (at or above capacity), grows exactly the lanes whose tail is full and
  that have room in their table, and never misses a scratch target, a next block or a longer
  hit past the first block (device or host) the spec would accept;
* ghost erasure: a ghost-off core fed the same steps has the same non-ghost fields;
* teeth: the same machine over mutant cores (`codegen.load(MODEL.without_guard(...))`)
  finds the expected invariant violation (or lifecycle divergence, progress failure, policy
  refinement failure).

Layout: `MachineBase` (base.py: setup, the checks of every step in `apply`, the natural
workload), errors.py (what each check raises), and mixins: actions.py (single actions with
drawn parameters, the calls that must be rejected), scheduled.py (steps of the real
`Scheduler`, hypothesis answering its block work and calls: every flow's growth, admission,
spills, preemptions, prefill and decode, `schedule`, `advance`, the tiers' flows, storms and
the teardown's drain, are its steps; the machine's own rules act between them),
policy_steps.py (refinement and refused calls around the policy's choices), teardown.py,
and one per feature tier (paged.py: paged tables and hits past the first block; hybrid.py;
host.py; pd.py; preempt.py). A new feature tier's rules go in a new mixin module here, listed
in `CoreMachine`'s bases; its rules that only some machines take go in a set like PD_RULES
that `make_machine` drops. The policy is drawn from `atom_core.policy.POLICIES` (every
registered one). `tests/test_core_machine.py` runs it, `proofs/mutants/` runs it over mutant
cores and `bench/stateful.py` measures its stateful steps per second.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize

from atom_core._generated import core as committed
from atom_core.policy import POLICIES
from atom_core.testing.lifecycle import FEATURES
from atom_core.testing.machine.actions import ActionRules
from atom_core.testing.machine.base import (
    PD_RULES,
    PREEMPT_MACHINE_RULES,
    MachineBase,
    to_committed,
)
from atom_core.testing.machine.host import HostRules
from atom_core.testing.machine.hybrid import HybridRules
from atom_core.testing.machine.paged import PagedRules
from atom_core.testing.machine.pd import PDRules
from atom_core.testing.machine.policy_steps import PolicySteps
from atom_core.testing.machine.preempt import PreemptRules
from atom_core.testing.machine.scheduled import SchedulerRules
from atom_core.testing.machine.teardown import TeardownRules
from atom_core.testing.strategies import Capacity, configs, min_blocks

__all__ = ["PD_RULES", "PREEMPT_MACHINE_RULES", "CoreMachine", "MachineBase", "make_machine",
           "rule_names"]


class CoreMachine(PagedRules, HybridRules, HostRules, PDRules, PreemptRules, SchedulerRules,
                  ActionRules, PolicySteps, TeardownRules, MachineBase):
    """Every tier's rules over the base (`make_machine` binds it to a core and configurations)."""


def rule_names(machine: type[RuleBasedStateMachine]) -> set[str]:
    """The names of the machine's rules (its own and its bases')."""
    return {k for cls in machine.__mro__ for k, v in vars(cls).items()
            if hasattr(v, "hypothesis_stateful_rule")}


def make_machine(core: Any = committed, config: st.SearchStrategy[Any] | None = None, *,
                 mirror: bool = True, mirror_core: Any = None, check_progress: bool = True,
                 focus: set[str] | None = None, pd: bool = True,
                 preempt: bool = False,
                 capacity: Capacity = min_blocks) -> type[RuleBasedStateMachine]:
    """A state machine over `core` (ghost on), configurations drawn from `config`.

    mirror: apply each step to a ghost-off state too (of `mirror_core`, default `core`) and
    compare non-ghost fields. check_progress: assert progress whenever the state is
    quiescent (no copy or load in flight, no block draining, no store in flight) and K is at
    least the proved minimum. focus: keep only these rules (a focused search with the same
    rules and checks). pd: take the PD actions too (colocated serving never does): the PD
    rules (PD_RULES), and PD steps among `advance`'s moves. The tiers' rules (`hybrid_flow`,
    `host_flow`) only run in configurations with that tier. preempt: take the preemption rules
    (PREEMPT_MACHINE_RULES: drawn preemptions; `storm` with PREEMPT only);
    whatever it is, the policy's preemptions are taken in configurations with PREEMPT.
    capacity: the rule at or above which progress is checked (a mutant's table: give
    `config` the same).
    """
    config = config if config is not None else st.one_of(
        *(configs(core, p, s) for p, s in FEATURES))
    mcore = mirror_core or core
    name = f"CoreMachine_{core.__name__}"
    machine: type[CoreMachine] = type(name, (CoreMachine,), {
        "__qualname__": name,
        "core": core,
        "mcore": mcore,
        "plain_fields": [f for f in core.STATE_FIELDS if f not in core.GHOST_FIELDS],
        "convert": staticmethod((lambda e: e) if core is committed else to_committed),
        "mirroring": mirror,
        "check_progress": check_progress,
        "capacity": staticmethod(capacity),
        "pd": pd,
        # (one registered policy draws nothing: sampled_from of one is just it)
        "setup": initialize(c=config, policy=st.sampled_from(sorted(POLICIES)),
                            scene=st.booleans())(MachineBase.setup),
    })
    rules = rule_names(machine)
    assert PD_RULES | PREEMPT_MACHINE_RULES <= rules, PD_RULES - rules
    if focus is None and pd and preempt:
        return machine
    focus = (rules if focus is None else focus) - (set() if pd else PD_RULES)
    focus -= set() if preempt else PREEMPT_MACHINE_RULES
    assert focus <= rules, focus - rules
    # A rule attribute shadowed by None is no rule (hypothesis collects marked members).
    return type(f"Focused{name}", (machine,), dict.fromkeys(rules - focus))
