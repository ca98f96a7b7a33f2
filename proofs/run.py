"""Every proof `atom-core verify` runs, as one report."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import z3

from atom_core.proofs import capacity, checks
from atom_core.proofs.checks import Check
from atom_core.spec import lang as L

MAX_LANES, MAX_BLOCKS = 4, 8  # the cutoff for bounded invariants and capacity


@attrs.frozen
class Report:
    ok: bool
    seconds: float
    checks: list[Check]
    rows: list[capacity.Row]
    single_block: list[tuple[capacity.SingleBlockCase, Any]] = attrs.field(factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "seconds": round(self.seconds, 3),
                "checks": [c.as_json() for c in self.checks],
                "capacity": [row_json(r) for r in self.rows],
                "single_block": [
                    {"case": c.name, "lanes": c.lanes, "prefix_cache": c.prefix_cache,
                     "role": c.role, "stuck": tr is not None,
                     **({"violated": tr.violated, "trace": [s.as_json() for s in tr.steps],
                         "stuck_state": tr.final} if tr else {})}
                    for c, tr in self.single_block]}


def table_matches(rows: list[capacity.Row]) -> Check:
    """The committed capacity table (which Config validates against) is the proved one, and
    its rule gives every row's minimum (hybrid, host tier, T = 2 included)."""
    from atom_core._generated import capacity as committed

    found, wrong = capacity.fit(rows)
    pfound, pwrong = capacity.fit_preempt(rows)
    wrong += pwrong
    want = {k: (committed.SCRATCH_BLOCKS[k], committed.COPY_BLOCKS[k])
            for k in committed.SCRATCH_BLOCKS}
    pwant = {k: tuple(v) for k, v in getattr(committed, "PREEMPT_BLOCKS", {}).items()}
    # (a one-lane cutoff leaves the preemption rule's second term open: None matches any)
    pok = pfound.keys() == pwant.keys() and all(
        x is None or x == y for k in pfound for x, y in zip(pfound[k], pwant[k], strict=True))
    ok = found == want and pok and not wrong
    detail = "" if ok else ("; ".join(wrong) if wrong else
                            f"committed {want}, {pwant} != proved {found}, {pfound}: run "
                            "`make generate`")
    return Check("capacity-table-matches-proofs", "*", "capacity", "proved" if ok else
                 "counterexample", 0.0, detail=detail)


def row_json(r: capacity.Row) -> dict[str, Any]:
    return {"prefix_cache": r.features.prefix_cache, "scratch": r.features.scratch,
            "hybrid": r.features.hybrid, "host_cache": r.features.host,
            "blocks_per_table": r.features.tables, "preemption": r.features.preempt,
            "offset": r.offset,
            "min_kv_blocks": {str(b): k for b, k in r.minimum.items()},
            "tight": {str(b): (t is not None) for b, t in r.traces.items()}}


def verify(model: L.Model, max_lanes: int = MAX_LANES, max_blocks: int = MAX_BLOCKS,
           on_check: Callable[[Check], None] | None = None) -> Report:
    t0 = time.perf_counter()
    # z3's search depends on every declaration its context has seen: a query that proves in
    # 0.3 s in a fresh process can time out after unrelated queries in the same process (see
    # tests/test_proofs.py). Nothing keeps z3 terms across runs, so each run starts afresh.
    z3.z3._main_ctx = None
    out: list[Check] = []

    def add(c: Check) -> None:
        out.append(c)
        if on_check:
            on_check(c)

    for c in checks.relational(model):
        add(c)
    for c in checks.bounded(model, max_lanes, max_blocks):
        add(c)
    rows = []
    for row in capacity.table(model, max_lanes, max_blocks):
        rows.append(row)
        for c in row.checks:
            add(c)
        if row.offset is None and not row.features.preempt:  # (preemption: fit_preempt)
            add(Check(f"rule:{row.features.name}", "*", "capacity", "counterexample", 0.0,
                      detail=f"no single rule kv_blocks >= lanes * T + c fits {row.minimum}"))
    add(table_matches(rows))
    single = []
    for case in capacity.SINGLE_BLOCK:
        c, tr = case.check(model)
        add(c)
        single.append((case, tr))
    ok = all(c.status == "proved" for c in out)
    return Report(ok, time.perf_counter() - t0, out, rows, single)
