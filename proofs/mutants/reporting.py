"""Results and their report: per-layer verdicts (`LayerResult`, `MutantResult`, `Report`),
the explained survivors (`EXPLAINED`), text and JSON output, and mutmut's source report."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import attrs

from atom_core.proofs.mutants.enumeration import CONTROL

# Mutants no layer kills, each with the reason. "equivalent": no behaviour (or no observable
# state) changes; "gap": a real bug that nothing in the project catches yet. Written from a run
# (`make mutants`), never assumed: a listed mutant that some layer kills is reported as stale.
EXPLAINED: dict[str, str] = {
    # Ghost writes that no guard or invariant reads before something else overwrites them
    # (ghost state never changes what the executable core does). tests/test_proofs.py lists the
    # same drops in UNCAUGHT_UPDATES; the writes are tripwires for guard mutants.
    "drop-update:decode.junk":
        "equivalent: with the guard intact, padding rows only scribble on the scratch block or "
        "a free block, whose junk no invariant reads before an admission resets it",
    "drop-update:fail.junk":
        "equivalent: the failed lane's block is freed (or drains, and transfer_end marks it) in "
        "the same step; admission resets junk before it is read again",
    "drop-update:fail.local_junk":
        "equivalent: the failed lane is idle after the step and admission resets its slot",
    "drop-update:discard.junk":
        "equivalent: the discarded block is free or the scratch block afterwards; admission "
        "resets junk before it is read",
    "drop-update:transfer_fail.junk":
        "equivalent: the failed transfer's blocks (every block of its lane's table) are freed "
        "in the same step",
    "drop-update:transfer_end.junk":
        "equivalent: the drained blocks (b and every other block draining for the request) are "
        "freed in the same step",
    "drop-update:admit_import.local_holds":
        "equivalent: an importing lane's slot belongs to the transfer (the invariant exempts "
        "importing lanes) until import_done writes it",
    "drop-update:admit_hit.local_holds":
        "equivalent: a copying lane takes no step that reads its slot (prefill and snapshot "
        "wait for the copy, the invariant exempts copying lanes) and copy_done overwrites it",
    "drop-update:admit_hit.local_junk":
        "equivalent: as admit_hit's local_holds: copy_done sets local_junk before any read",
    "drop-update:snapshot.lane_snap_junk":
        "equivalent: under the invariants (a computing hybrid lane's slot holds its own state) "
        "and the next_boundary guard the new flag equals the old one; the write is a tripwire "
        "for mutants of snapshot's guards",
    "drop-update:admit_host_hit.local_holds":
        "equivalent: only hybrid invariants read a lane's slot, and hybrid models have no host "
        "cache (axiom hybrid_without_host_cache)",
    "drop-update:admit_host_hit.local_junk":
        "equivalent: as admit_host_hit's local_holds: no hybrid model takes a host hit",
    # Ghost flags set to the other value: the same writes as the drops above (a junk flag
    # cleared where it should be set, or set on a slot copy_done overwrites), equivalent for
    # the same reasons.
    "swap-value:fail.junk=False":
        "equivalent: as drop-update:fail.junk (the block is freed in the same step)",
    "swap-value:fail.local_junk=False":
        "equivalent: as drop-update:fail.local_junk (admission resets the slot)",
    "swap-value:discard.junk=False":
        "equivalent: as drop-update:discard.junk",
    "swap-value:admit_hit.local_junk=True":
        "equivalent: no step reads a copying lane's slot and copy_done sets local_junk",
    "swap-value:admit_host_hit.local_junk=True":
        "equivalent: as drop-update:admit_host_hit.local_junk (no hybrid host tier)",
    "drop-update:grow_host_hit.snap_upto":
        "equivalent: grow_host_hit needs the host tier, which hybrid models do not have (axiom "
        "hybrid_without_host_cache), and without them every lane_snap and snap_upto is 0 "
        "(snapshots_need_hybrid): the full block's boundary is already the 0 it would get",
    # Another term that the invariants make equal to the right one. A lane that grows is
    # busy, so its tail is its own block (lane_block_owned) and its request runs on it
    # (busy_lane_runs_its_request); an importing lane's tail is pinned for its request
    # (moving_lane_has_transfer, transfer_names_lane_request).
    "swap-value:grow.owner=owner(tail(l))":
        "equivalent: a growing lane computes, so it is busy and owner(tail(l)) is LANE "
        "(lane_block_owned)",
    "swap-value:grow.owner_lane=owner_lane(tail(l))":
        "equivalent: a growing lane is busy, so owner_lane(tail(l)) is l (lane_block_owned)",
    "swap-value:grow.owner_lane=req_lane(lane_req(l))":
        "equivalent: a growing lane is busy, so req_lane(lane_req(l)) is l "
        "(busy_lane_runs_its_request)",
    "swap-value:grow_hit.owner=owner(tail(l))":
        "equivalent: as swap-value:grow.owner=owner(tail(l)) (the lane prefills: it is busy)",
    "swap-value:grow_hit.owner_lane=owner_lane(tail(l))":
        "equivalent: as swap-value:grow.owner_lane=owner_lane(tail(l))",
    "swap-value:grow_hit.owner_lane=req_lane(lane_req(l))":
        "equivalent: as swap-value:grow.owner_lane=req_lane(lane_req(l))",
    "swap-value:grow_host_hit.owner=owner(tail(l))":
        "equivalent: as swap-value:grow.owner=owner(tail(l)) (the lane prefills: it is busy)",
    "swap-value:grow_host_hit.owner_lane=owner_lane(tail(l))":
        "equivalent: as swap-value:grow.owner_lane=owner_lane(tail(l))",
    "swap-value:grow_host_hit.owner_lane=req_lane(lane_req(l))":
        "equivalent: as swap-value:grow.owner_lane=req_lane(lane_req(l))",
    "swap-value:import_grow.owner=owner(tail(l))":
        "equivalent: an importing lane is busy, so owner(tail(l)) is LANE (lane_block_owned)",
    "swap-value:import_grow.owner_lane=owner_lane(tail(l))":
        "equivalent: an importing lane is busy, so owner_lane(tail(l)) is l (lane_block_owned)",
    "swap-value:import_grow.owner_lane=req_lane(lane_req(l))":
        "equivalent: an importing lane is busy, so req_lane(lane_req(l)) is l "
        "(busy_lane_runs_its_request)",
    "wrong-value:import_grow.transfer_req=transfer_req(tail(l))":
        "equivalent: an importing lane's tail is in its transfer (moving_lane_has_transfer), "
        "for its request (transfer_names_lane_request): transfer_req(tail(l)) is lane_req(l)",
    # Not equivalent: behaviour changes, but no stated property covers it.
    "drop-update:host_evict.slot_state":
        "gap: an eviction that keeps the host entry is safe (nothing is freed) but the slot is "
        "never reusable, so the host tier stops taking spills once full; spills are optional "
        "and no property says the tier makes room (a performance test would notice)",
}


# --------------------------------------------------------------------------- results


@attrs.frozen
class LayerResult:
    layer: str
    status: str  # killed | survived | unknown | unavailable | error | skipped
    detail: str = ""
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "status": self.status, "detail": self.detail,
                "seconds": round(self.seconds, 3)}


@attrs.frozen
class MutantResult:
    id: str
    family: str
    description: str
    layers: tuple[LayerResult, ...]
    seconds: float

    @property
    def killed_by(self) -> str | None:
        return next((r.layer for r in self.layers if r.status == "killed"), None)

    @property
    def status(self) -> str:
        """killed > error > unknown > survived: an error or an unknown is never a pass."""
        seen = {r.status for r in self.layers}
        for s in ("killed", "error", "unknown"):
            if s in seen:
                return s
        return "survived"

    @property
    def explanation(self) -> str | None:
        return EXPLAINED.get(self.id)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "family": self.family, "description": self.description,
                "status": self.status, "killed_by": self.killed_by,
                "explanation": self.explanation,
                "unexplained": (self.id != CONTROL and self.status in ("survived", "unknown")
                                and not self.explanation),
                "layers": [r.as_json() for r in self.layers],
                "seconds": round(self.seconds, 3)}


@attrs.frozen
class Report:
    mode: str  # cheap-first | all-layers
    layers: tuple[str, ...]
    control: MutantResult
    results: list[MutantResult]
    seconds: float

    @property
    def killed(self) -> list[MutantResult]:
        return [r for r in self.results if r.status == "killed"]

    @property
    def survivors(self) -> list[MutantResult]:
        return [r for r in self.results if r.status in ("survived", "unknown")]

    @property
    def unexplained(self) -> list[str]:
        return [r.id for r in self.survivors if not r.explanation]

    @property
    def stale(self) -> list[str]:
        """Explained mutants that a layer now kills: the explanation is out of date."""
        return [r.id for r in self.results if r.status == "killed" and r.explanation]

    @property
    def errors(self) -> list[str]:
        return [r.id for r in self.results if r.status == "error"]

    def by_layer(self) -> dict[str, dict[str, Any]]:
        total = len(self.results)
        out = {}
        for name in self.layers:
            rs = [lr for r in self.results for lr in r.layers if lr.layer == name]
            counts = {s: sum(1 for lr in rs if lr.status == s) for s in
                      ("killed", "survived", "unknown", "unavailable", "error", "skipped")}
            out[name] = {**counts, "ran": len(rs) - counts["skipped"],
                         "rate": round(counts["killed"] / total, 4) if total else 0.0,
                         "seconds": round(sum(lr.seconds for lr in rs), 1)}
        return out

    def as_json(self) -> dict[str, Any]:
        total = len(self.results)
        return {"mode": self.mode, "layers": list(self.layers), "total": total,
                "killed": len(self.killed),
                "kill_rate": round(len(self.killed) / total, 4) if total else 0.0,
                "by_layer": self.by_layer(),
                "by_family": self.by_family(),
                "survivors": [r.id for r in self.survivors],
                "unexplained": self.unexplained, "stale_explanations": self.stale,
                "errors": self.errors, "control": self.control.as_json(),
                "seconds": round(self.seconds, 1),
                "mutants": [r.as_json() for r in self.results]}

    def by_family(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for r in self.results:
            row = out.setdefault(r.family, {"total": 0, "killed": 0})
            row["total"] += 1
            row["killed"] += r.status == "killed"
        return out


def pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.1f}%)" if d else "0/0"


def headline(rep: Report) -> list[str]:
    total = len(rep.results)
    lines = [f"kill rate: {pct(len(rep.killed), total)} ({rep.mode}, {rep.seconds:.0f} s)"]
    word = "kills" if rep.mode == "all-layers" else "first kills"
    for name, row in rep.by_layer().items():
        extra = [f"{row[s]} {s}" for s in ("unknown", "unavailable", "error") if row[s]]
        lines.append(f"  {name:<11} {word}: {pct(row['killed'], total)}, ran on {row['ran']}"
                     + (f", {', '.join(extra)}" if extra else "") + f", {row['seconds']} s")
    control = ", ".join(f"{lr.layer} {lr.status}" + (f" ({lr.detail})" if lr.detail else "")
                        for lr in rep.control.layers)
    lines.append(f"control (unmutated model): {control}")
    lines.append(f"survivors: {len(rep.survivors)} ({len(rep.unexplained)} unexplained)")
    if rep.unexplained:
        lines.append("UNEXPLAINED survivors (add them to EXPLAINED in "
                     "proofs/mutants/reporting.py): " + ", ".join(rep.unexplained))
    if rep.stale:
        lines.append("explained but killed (remove from EXPLAINED): " + ", ".join(rep.stale))
    if rep.errors:
        lines.append("errors: " + ", ".join(rep.errors))
    return lines


def render(rep: Report, verbose: bool) -> None:
    rows = rep.results if verbose else rep.survivors
    header = ["mutant", "status", "killed by", *rep.layers, "explanation"]
    body = []
    for r in rows:
        cells = {lr.layer: lr.status + (f": {lr.detail}" if verbose and lr.detail else "")
                 for lr in r.layers}
        body.append([r.id, r.status, r.killed_by or "-", *(cells.get(x, "-") for x in rep.layers),
                     r.explanation or ("UNEXPLAINED" if r in rep.survivors else "")])
    fam = [[f, str(v["total"]), pct(v["killed"], v["total"])] for f, v in rep.by_family().items()]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print_plain(header, body, fam)
    else:
        # a report, not a terminal widget: wide enough for ids and details when piped
        console = Console(width=max(140, shutil.get_terminal_size().columns))
        table = Table(title="mutants" if verbose else "survivors")
        for h in header:
            table.add_column(h, overflow="fold")
        for row in body:
            table.add_row(*row)
        families = Table(title="by family")
        for h in ("family", "mutants", "killed"):
            families.add_column(h)
        for row in fam:
            families.add_row(*row)
        console.print(families)
        if body:
            console.print(table)
    for line in headline(rep):
        print(line)


def print_plain(header: list[str], body: list[list[str]], fam: list[list[str]]) -> None:
    for row in [["family", "mutants", "killed"], *fam]:
        print("  ".join(f"{c:<14}" for c in row))
    print()
    print(" | ".join(header))
    for row in body:
        print(" | ".join(row))


# --------------------------------------------------------------------------- source mutants

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code in 3.8), for reading its results
# without importing it: a timeout is a mutant the tests stopped (it looped), so it counts as
# caught; "no tests" means no test of the selection calls the mutated function.
MUTMUT_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
                 34: "skipped", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout",
                 255: "timeout", 37: "killed", -11: "crashed", -9: "crashed", None: "not run"}
SOURCE_COLUMNS = ("killed", "timeout", "survived", "no tests", "not run", "other")


def source_report(root: Path = Path("mutants")) -> list[dict[str, Any]]:
    """Per mutated file, mutmut's verdicts counted from its result files (`<file>.meta`)."""
    rows = []
    for meta in sorted(root.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        row: dict[str, Any] = {"file": str(meta.relative_to(root))[:-len(".meta")],
                               "mutants": len(codes), **dict.fromkeys(SOURCE_COLUMNS, 0)}
        for code in codes.values():
            status = MUTMUT_STATUS.get(code, "other")
            row[status if status in SOURCE_COLUMNS else "other"] += 1
        run = row["killed"] + row["timeout"] + row["survived"]
        row["kill_rate"] = round((row["killed"] + row["timeout"]) / run, 4) if run else None
        rows.append(row)
    return rows


def print_source_report(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no mutmut results under mutants/ (run `make mutants-source`)")
        return
    header = ("file", "mutants", *SOURCE_COLUMNS, "caught/run")
    print("  ".join(f"{h:>9}" if i else f"{h:<30}" for i, h in enumerate(header)))
    for r in rows:
        run = r["killed"] + r["timeout"] + r["survived"]
        rate = f"{100 * r['kill_rate']:.1f}%" if run else "-"
        cells = [r["file"], r["mutants"], *(r[c] for c in SOURCE_COLUMNS), rate]
        print("  ".join(f"{c:>9}" if i else f"{c:<30}" for i, c in enumerate(cells)))


def print_progress(r: MutantResult, n: int, total: int) -> None:
    verdict = f"killed by {r.killed_by}" if r.killed_by else r.status
    layers = ", ".join(f"{lr.layer} {lr.status}" for lr in r.layers if lr.status != "skipped")
    print(f"[{n}/{total}] {r.id}: {verdict} ({r.seconds:.1f} s; {layers})", file=sys.stderr,
          flush=True)
