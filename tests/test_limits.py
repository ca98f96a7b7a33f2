"""Solver budgets (proofs/limits.py): a verdict is a function of the spec, not of the machine.
Every query is bounded by z3's resource counter; the wall clock is only an outer guard, and a
query stopped by either is `unknown` (a failure, never a proof), saying which limit stopped it."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import z3

from atom_core.proofs import checks, limits, run
from atom_core.proofs.checks import Check
from atom_core.spec.model import MODEL

pytestmark = pytest.mark.usefixtures("fresh_z3")


def hard_query() -> list:
    """Nonlinear integer arithmetic z3 cannot settle in a few units."""
    x, y, z = z3.Ints("x y z")
    return [x > 1, y > 1, z > 1, x * x * x + y * y * y == z * z * z + 7 * x * y * z]


def test_budget_exhausted_is_unknown_naming_the_resource_limit():
    status, reason, used = checks.solve(hard_query(), rlimit=2_000)
    assert status == "unknown"
    assert "resource limit" in reason and "2,000" in reason
    assert used > 0


def test_wall_clock_guard_is_unknown_naming_the_machine(monkeypatch):
    """The guard stops a query the machine is too slow for, and says it was the machine; no
    further attempt is made (they would meet the same machine)."""
    monkeypatch.setattr(limits, "guard_ms", lambda rlimit: 1)
    status, reason, _used = checks.solve(hard_query(), rlimit=10**12)
    assert status == "unknown"
    assert reason.startswith("wall-clock guard") and "the machine" in reason


def test_budget_is_per_check_not_per_solver():
    """z3 pushes `count + rlimit` at each check: a solver asked twice gets the budget twice."""
    s = limits.new_solver(50_000)
    x = z3.Int("x")
    s.add(x > 0)
    assert s.check() == z3.sat
    first = limits.spent(s)
    s.push()
    s.add(x < 10)
    assert s.check() == z3.sat
    s.pop()
    assert limits.spent(s) >= first


def _burn(stop) -> None:
    while not stop.is_set():
        pass


def _obligations() -> list[tuple[str, str, str, str, int]]:
    """The bounded task at B = 2, K = 3, as `verify` runs it (in a process of its own)."""
    task = run.Task("bounded", run.t_bounded, (2, 3))
    with run.Runner(MODEL, jobs=2) as runner:
        (cs,) = runner.run([task])
    return [(c.invariant, c.action, c.status, c.size, c.rlimit) for c in cs]


def test_verdicts_are_the_same_under_load():
    """The same task, quiet and beside two CPU-bound processes per core: the same verdicts,
    and resource use of the same order (z3's units also depend on where its allocations land,
    so they are compared within a factor, the margin the budgets keep: limits.py)."""
    quiet = _obligations()
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True)
               for _ in range(2 * (os.cpu_count() or 1))]
    for p in burners:
        p.start()
    try:
        loaded = _obligations()
    finally:
        stop.set()
        for p in burners:
            p.join(5)
    assert [c[:4] for c in quiet] == [c[:4] for c in loaded]
    assert all(status == "proved" for _i, _a, status, _s, _u in quiet)
    total_quiet, total_loaded = sum(c[4] for c in quiet), sum(c[4] for c in loaded)
    assert total_quiet > 0 and 0.5 < total_loaded / total_quiet < 2


def test_report_shows_the_largest_use_per_kind_against_its_budget():
    cs = [Check("a", "x", "step", "proved", 0.1, "", rlimit=5),
          Check("b", "x", "step", "proved", 0.1, "", rlimit=9),
          Check("c", "x", "step", "proved", 0.1, "B=2,K=3", rlimit=4),
          Check("d", "*", "capacity", "proved", 0.1, "B=2,K=3,no cache", rlimit=7),
          Check("rule", "*", "capacity", "proved", 0.0)]  # (no query: not counted)
    r = run.Report(True, 1.0, cs, [])
    assert r.rlimits() == {"step": (2, 9, limits.STEP),
                           "bounded step": (1, 4, limits.BOUNDED),
                           "progress": (1, 7, limits.STEP)}
    assert r.as_json()["rlimit_by_kind"]["step"] == {"queries": 2, "largest": 9,
                                                     "budget": limits.STEP}


def test_no_proof_query_is_bounded_by_time_alone():
    """Every solver the proofs make gets its budget from `limits` (a bare `timeout` would make
    the verdict depend on the machine again)."""
    from pathlib import Path

    root = Path(checks.__file__).resolve().parent
    offenders = [f"{p.name}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "limits.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if 'set("timeout"' in line or "z3.Solver()" in line]
    assert offenders == []
