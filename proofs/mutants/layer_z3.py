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
    """The mutated actions' obligations in `verify`'s own tasks (proofs/run.py): each action's
    relational step and transition tasks, and the arithmetic and bounded tasks (these up to
    `Z3_BOUNDED_SIZE`) on the model restricted to the actions."""
    from atom_core.proofs import run

    restricted = only(model, actions)
    for task in run.invariant_tasks(model, *Z3_BOUNDED_SIZE):
        if task.kind == "relational" and task.args[0] != "base":
            if task.args[1] in actions:
                yield from run.run_here(model, task)
        elif task.kind != "relational":
            yield from run.run_here(restricted, task)


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
    unknown: list[str] = []
    for c in z3_obligations(model, m.actions):
        name = f"{c.kind} {c.invariant} @ {c.action}" + (f" [{c.size}]" if c.size else "")
        if c.status == "counterexample" and control.get(obligation(c)) == "proved":
            return LayerResult("z3", "killed", name + (f" ({c.detail})" if c.detail else ""))
        if c.status == "unknown":
            unknown.append(name)
    if unknown:
        return LayerResult("z3", "unknown", f"{len(unknown)} obligation(s) unknown: "
                           + "; ".join(unknown[:3]))
    return LayerResult("z3", "survived")
