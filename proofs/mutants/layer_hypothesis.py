"""Layer hypothesis: the core state machine (`atom_core.testing.machine`) over the mutant
core."""

from __future__ import annotations

import functools
import importlib.util
import types
from collections.abc import Callable
from typing import Any

from atom_core.proofs.mutants.enumeration import (
    CONTROL,
    Mutant,
    catalogue,
    load_core,
    offsets_of,
    patched_table,
)
from atom_core.proofs.mutants.options import Options
from atom_core.proofs.mutants.reporting import LayerResult


def core_machine_module() -> types.ModuleType | None:
    """`atom_core.testing.machine`, or None without hypothesis (the dev extra)."""
    if importlib.util.find_spec("hypothesis") is None:
        return None
    from atom_core.testing import machine

    return machine


def machine_settings(examples: int) -> Any:
    """Bounded and derandomized, so a verdict is reproducible; no shrinking: the first failure
    is the kill."""
    from hypothesis import HealthCheck, Phase, settings

    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    stateful_step_count=50, phases=[Phase.explicit, Phase.generate],
                    report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
                    print_blob=False)


def machine_capacity(offsets: dict[tuple[bool, str], int]
                     ) -> Callable[[int, bool, str, int, bool], int]:
    """The capacity rule the machine draws K around and checks progress at or above: the
    mutant's table (a capacity mutant claims one block fewer suffices)."""
    from atom_core.testing.strategies import min_blocks as proved

    table = patched_table(offsets)

    def min_blocks(lanes: int, prefix: bool, scratch: str, tables: int = 1,
                   preempt: bool = False) -> int:
        if preempt:  # (the catalogue's capacity mutants move the rules without preemption)
            return proved(lanes, prefix, scratch, tables, preempt)
        return table.min_kv_blocks(lanes, tables, (prefix, scratch))

    return min_blocks


# The state only hybrid models change (their sliding state and its snapshots): without HYBRID
# every snapshot is refused and every boundary stays 0 (`snapshots_need_hybrid`).
HYBRID_STATE = ("lane_snap", "lane_snap_junk", "lane_snap_taken", "snap_upto", "snap_junk",
                "snap_taken", "local_holds", "local_junk")


def hybrid_mutant(m: Mutant) -> bool:
    """A mutant of `snapshot`, of a hybrid guard (`hybrid_...`) or of an update of hybrid state
    (the guard or function its id names after the action)."""
    name = m.id.partition(":")[2].partition(".")[2]
    name = name.split("=")[0].split("#")[0]
    return "snapshot" in m.actions or name.startswith("hybrid") or name in HYBRID_STATE


def machine_tier(m: Mutant) -> str:
    """The configurations the machine runs a mutant over: "host" (the host tier, with the prefix
    cache, T in 1..3) for a mutant of a host-tier action (elsewhere every call of it is refused
    early: no slot); "hybrid" (the hybrid tier, T in 1..3, beside every feature combination:
    a snapshot without HYBRID is refused, which a mutant may break) for a `hybrid_mutant`
    (elsewhere it changes nothing the machine sees); else "plain" (every feature
    combination)."""
    from atom_core.spec.model import HOST_ACTIONS

    if set(m.actions) & set(HOST_ACTIONS):
        return "host"
    return "hybrid" if hybrid_mutant(m) else "plain"


def run_machine(mutant_id: str, examples: int, tier: str = "plain") -> str | None:
    """None if the machine passes over `tier`'s configurations (`machine_tier`); else what
    failed (a kill)."""
    import hypothesis.errors
    import hypothesis.strategies as st
    from hypothesis.stateful import run_state_machine_as_test

    from atom_core.testing.lifecycle import FEATURES
    from atom_core.testing.machine import make_machine
    from atom_core.testing.strategies import configs as drawn

    core = load_core(mutant_id)
    cap = machine_capacity(offsets_of(catalogue()[mutant_id]))
    configs = [drawn(core, p, s, capacity=cap) for p, s in FEATURES] if tier != "host" else []
    if tier != "plain":
        configs += [drawn(core, True, s, tier=tier, capacity=cap)
                    for s in ("reserved", "dynamic")]
    machine = make_machine(core, st.one_of(*configs), mirror=False, pd=True, capacity=cap)
    try:
        run_state_machine_as_test(machine, settings=machine_settings(examples))
    except hypothesis.errors.HypothesisException:
        raise  # a harness problem (health check, flaky), never a kill
    except Exception as exc:  # an invariant, the lifecycle model or a crash of the core
        first = (str(exc).strip().splitlines() or [""])[0]  # a bare assert has no text
        return f"{type(exc).__name__}: {first[:160]}"
    return None


@functools.cache
def machine_control(examples: int, tier: str = "plain") -> str | None:
    return run_machine(CONTROL, examples, tier)


def hypothesis_layer(m: Mutant, opts: Options) -> LayerResult:
    if core_machine_module() is None:
        return LayerResult("hypothesis", "unavailable",
                           "atom_core.testing needs hypothesis (the dev extra)")
    tier = machine_tier(m)
    broken = machine_control(opts.examples, tier)
    if broken:
        return LayerResult("hypothesis", "error", f"the control fails: {broken}")
    failure = run_machine(m.id, opts.examples, tier)
    return LayerResult("hypothesis", "killed" if failure else "survived", failure or "")
