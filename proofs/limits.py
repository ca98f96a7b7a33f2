"""How long a z3 query may run: a deterministic resource limit, with the wall clock only as an
outer guard.

A wall-clock timeout makes a verdict a function of the machine: under load the same query runs
out of time and `verify` fails (closed, but for no reason in the spec). z3's resource counter
(`rlimit`) counts the solver's own work, so a query given the same facts, seed and parameters
uses the same amount on any machine and at any load, and a budget in those units gives the
same verdict everywhere. The budget is relative to the counter when `check()` starts (z3
pushes `count + rlimit`), so one solver asked several times gets the budget each time.

The wall-clock guard only stops a query the machine is far too slow for; hitting it is reported
as such (`unknown`, never a proof), naming the guard, so a reader knows the verdict came from
the machine and not from the budget.
"""

from __future__ import annotations

from typing import Any

import z3

# About how many resource units z3 spends per second of CPU on these queries (measured on this
# project's obligations, 2-core x86_64 machine: median 2.0e6 per second over every query that
# ran longer than 50 ms; the slowest 0.3e6). Only the wall-clock guard is derived from it.
UNITS_PER_SECOND = 2_000_000
# The guard allows this many times the budget's expected time: a machine loaded ten times over
# still decides each query by its budget (the slowest query per unit included).
GUARD_FACTOR = 20
MIN_GUARD_MS = 60_000

# The budgets (resource units). A query's verdict is the same wherever its use is well inside
# its budget: the units are not a function of the query alone, since z3's search also depends
# on where its allocations land (the same query measured 5-30% apart in processes with other
# histories), so each final budget is kept several times the largest use measured (`verify`
# reports the largest per kind: 1.0M for a step, 0.44M for a bounded step), and a query is
# first tried with a fraction of it. (A query that ends `unknown` spends every try: the ladder
# below is what the 2 s tries and 10 s timeout were, at the measured rate.)
STEP = 20_000_000  # a query over unbounded sorts (base, step, transition, arithmetic)
SHORT = 4_000_000  # each first try of such a query (most need well under a tenth of it)
BOUNDED = 120_000_000  # a quantifier-free query in a finite universe
FIRST_TRY = 4_000_000  # a bounded query's first try in its action's shared solver
TOGETHER = 30_000_000  # every feature combination's progress at one size, in one query
NONVACUITY = 20_000_000
BMC = 120_000_000  # one depth of the bounded model checker
REPLAY = 60_000_000  # a committed witness replayed in z3

# The final attempt's budget of each kind of obligation (`kind_of`), for the report.
BUDGETS = {"base": STEP, "step": STEP, "transition": STEP, "bounded base": BOUNDED,
           "bounded step": BOUNDED, "progress": STEP}
# (the capacity proofs' progress obligations are reported under the kind "capacity")

# What z3 says when a query stopped for either limit.
RLIMIT_REASON = "canceled"
WALL_REASON = "timeout"


def guard_ms(rlimit: int) -> int:
    return max(MIN_GUARD_MS, GUARD_FACTOR * 1000 * rlimit // UNITS_PER_SECOND)


def limit(solver: Any, rlimit: int) -> Any:
    """`solver` with `rlimit` per check and the wall-clock guard for it."""
    solver.set("rlimit", rlimit)
    solver.set("timeout", guard_ms(rlimit))
    return solver


def new_solver(rlimit: int, seed: int | None = None, **params: Any) -> Any:
    s = z3.Solver()
    limit(s, rlimit)
    if seed is not None:
        s.set("random_seed", seed)
    for name, value in params.items():
        s.set(name, value)
    return s


def spent(solver: Any) -> int:
    """The solver context's resource counter so far: it is the context's, shared by every
    solver in it (a fresh solver reads what the context's earlier queries used), so one
    query's units are the difference of two readings around it, never one reading."""
    st = solver.statistics()
    return int(st.get_key_value("rlimit count")) if "rlimit count" in st.keys() else 0


def why_unknown(solver: Any, rlimit: int) -> str:
    """The reason a query came back `unknown`, saying which limit stopped it."""
    reason = solver.reason_unknown()
    if reason == RLIMIT_REASON:
        return f"resource limit of {rlimit:,} units exhausted"
    if reason == WALL_REASON:
        return (f"wall-clock guard of {guard_ms(rlimit) / 1000:.0f} s hit before the resource "
                f"limit of {rlimit:,} units (the machine, not the query: rerun it quieter)")
    return reason


def kind_of(kind: str, size: str) -> str:
    """A check's kind for the budget report: base and step obligations in a finite universe
    (their size names B and K) have the bounded budget."""
    if kind == "capacity":
        return "progress"
    return f"bounded {kind}" if kind in ("base", "step") and size.startswith("B=") else kind
