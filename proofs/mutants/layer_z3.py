"""Layer z3: the induction proofs restricted to the mutated actions."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from atom_core.proofs.mutants.enumeration import Mutant, base_model, only
from atom_core.proofs.mutants.options import Z3_BOUNDED_SIZE, Options
from atom_core.proofs.mutants.reporting import LayerResult
from atom_core.spec import lang as L


def fresh_z3() -> None:
    """z3's answers depend on what its context has seen (see proofs/run.py): start afresh."""
    import z3

    z3.z3._main_ctx = None


def z3_obligations(model: L.Model, actions: tuple[str, ...]) -> Iterator[Any]:
    from atom_core.proofs import checks

    restricted = only(model, actions)
    yield from checks.relational(restricted)
    yield from checks.bounded(restricted, *Z3_BOUNDED_SIZE, kinds=("bounded", "arithmetic"))
    yield from checks.arithmetic(restricted)


def obligation(c: Any) -> tuple[str, str, str, str]:
    return (c.invariant, c.action, c.kind, c.size)


@functools.cache
def z3_control(actions: tuple[str, ...]) -> dict[tuple[str, str, str, str], str]:
    """The unmutated model's status per obligation of `actions`."""
    fresh_z3()
    return {obligation(c): c.status for c in z3_obligations(base_model(), actions)}


def z3_layer(m: Mutant, opts: Options) -> LayerResult:
    if not m.actions:
        return LayerResult("z3", "survived", "no action changed: no obligation to re-check")
    control = z3_control(m.actions)
    fresh_z3()
    model = m.change(base_model())
    # A counterexample over small finite sorts first: decisive, and milliseconds where the
    # unbounded query of a refutable obligation can end `unknown` after its whole timeout.
    from atom_core.proofs import checks

    for a in m.actions:
        c = checks.refute_action_small(only(model, (a,)), a)
        if c is not None and control.get(obligation(c)) == "proved":
            return LayerResult("z3", "killed", f"{c.kind} {c.invariant} @ {c.action} "
                               f"({c.detail})")
    unknown: list[str] = []
    for c in z3_obligations(model, m.actions):
        name = f"{c.kind} {c.invariant} @ {c.action}" + (f" [{c.size}]" if c.size else "")
        if c.status == "counterexample" and control.get(obligation(c)) == "proved":
            return LayerResult("z3", "killed", name)
        if c.status == "unknown":
            unknown.append(name)
    if unknown:
        return LayerResult("z3", "unknown", f"{len(unknown)} obligation(s) unknown: "
                           + "; ".join(unknown[:3]))
    return LayerResult("z3", "survived")
