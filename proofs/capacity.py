"""Capacity rules: the fewest KV blocks with which no reachable state is stuck.

For each feature combination and scratch discipline, and each lane count B up to the cutoff:
  sufficient  at K = K_min(B) (and every K up to the cutoff above it), the progress properties
              follow from the proved invariants: z3 answers unsat for every stuck state;
  tight       at K_min(B) - 1, a run from the initial state into a stuck state, found by search
              over the generated core and replayed step by step in z3 against the spec.
The rule is K_min(B) = B + offset with one offset for every B checked; a combination whose
minimum is not of that form is reported as such rather than fitted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import attrs

from atom_core.proofs import bmc, search
from atom_core.proofs.checks import CHUNK, SEQ_LEN, Check, bounded_universe, progress
from atom_core.spec import lang as L

SCRATCH_MODES = ("reserved", "dynamic")


@attrs.frozen
class Features:
    prefix_cache: bool
    scratch: str
    hybrid: bool = False  # sliding-window layers (with the prefix cache: hits need snapshots)
    host: bool = False  # a host cache tier below the prefix cache

    @property
    def name(self) -> str:
        return (f"{'prefix cache' if self.prefix_cache else 'no cache'}, {self.scratch} scratch"
                + (", hybrid" if self.hybrid else "") + (", host cache" if self.host else ""))

    @property
    def key(self) -> tuple[bool, str]:
        """The rule table's key: a hybrid model, or a host tier, must need what the plain
        prefix cache does."""
        return (self.prefix_cache, self.scratch)

    def consts(self, lanes: int, blocks: int) -> dict[str, Any]:
        return {"B": lanes, "K": blocks, "C": CHUNK, "S": SEQ_LEN, "PREFIX": self.prefix_cache,
                "RESERVED": self.scratch == "reserved", "SCRATCH": 0, "HYBRID": self.hybrid,
                "HOST": self.host}

    @property
    def plain(self) -> bool:
        return not (self.hybrid or self.host)


# Hybrid without the prefix cache takes the same steps as a plain model (no hit, no snapshot), and
# the host tier needs the prefix cache, so those are the combinations of their own.
COMBINATIONS = (tuple(Features(p, s) for p in (False, True) for s in SCRATCH_MODES)
                + tuple(Features(True, s, hybrid=True) for s in SCRATCH_MODES)
                + tuple(Features(True, s, host=True) for s in SCRATCH_MODES))


def progress_by_features(model: L.Model, lanes: int, blocks: int) -> dict[Features, list[Check]]:
    """Progress checks at one size for every feature combination (one translation, shared)."""
    u = bounded_universe(model, lanes, blocks, {"C": CHUNK, "S": SEQ_LEN, "SCRATCH": 0})
    cases = {f"B={lanes},K={blocks},{f.name}": {"PREFIX": f.prefix_cache,
                                                 "RESERVED": f.scratch == "reserved",
                                                 "HYBRID": f.hybrid, "HOST": f.host}
             for f in COMBINATIONS}
    out: dict[Features, list[Check]] = {f: [] for f in COMBINATIONS}
    by_case = dict(zip(cases, COMBINATIONS, strict=True))
    for case, c in progress(model, u, cases):
        out[by_case[case]].append(attrs.evolve(c, kind="capacity"))
    return out


def safe(model: L.Model, f: Features, lanes: int, blocks: int) -> tuple[bool, list[Check]]:
    cs = progress_by_features(model, lanes, blocks)[f]
    return all(c.status == "proved" for c in cs), cs


def stuck_trace(model: L.Model, f: Features, lanes: int, blocks: int) -> bmc.Trace | None:
    """A stuck run from the initial state, confirmed by z3 against the spec (see search.py)."""
    return search.stuck_run(model, lanes, blocks, f.prefix_cache, f.scratch == "reserved",
                            hybrid=f.hybrid, host=f.host)


def min_blocks(model: L.Model, f: Features, lanes: int, max_blocks: int) -> int | None:
    for k in range(1, max_blocks + 1):
        if safe(model, f, lanes, k)[0]:
            return k
    return None


@attrs.frozen
class Row:
    features: Features
    offset: int | None  # K_min = B + offset, None when no single offset fits
    minimum: dict[int, int | None]  # B -> K_min
    checks: list[Check]
    traces: dict[int, bmc.Trace | None]  # B -> stuck trace at K_min - 1

    @property
    def key(self) -> tuple[bool, str]:
        return self.features.key

    @property
    def rule(self) -> str:
        name = RULE_NAMES[self.key]
        return f"{name}: " + ("no linear rule" if self.offset is None else rule_text(self.offset))


def table(model: L.Model, max_lanes: int = 4, max_blocks: int = 8,
          traces: bool = True) -> Iterator[Row]:
    results = {(b, k): progress_by_features(model, b, k)
               for b in range(1, max_lanes + 1) for k in range(1, max_blocks + 1)}
    for f in COMBINATIONS:
        minimum: dict[int, int | None] = {}
        checks: list[Check] = []
        found: dict[int, bmc.Trace | None] = {}
        for b in range(1, max_lanes + 1):
            k_min = None
            for k in range(1, max_blocks + 1):
                cs = results[(b, k)][f]
                ok = all(c.status == "proved" for c in cs)
                if ok and k_min is None:
                    k_min = k
                if k_min is not None:
                    checks += cs  # sufficiency at K_min and every K above it
                    if not ok:  # not monotone: report, never hide
                        checks.append(Check("monotone", "*", "capacity", "counterexample", 0.0,
                                            f"B={b},K={k},{f.name}"))
                elif any(c.status == "unknown" for c in cs):
                    checks += [c for c in cs if c.status == "unknown"]
            minimum[b] = k_min
            if traces and k_min is not None and k_min > 1:
                t0 = time.perf_counter()
                tr = stuck_trace(model, f, b, k_min - 1)
                found[b] = tr
                status = "proved" if tr is not None else "counterexample"
                checks.append(Check(f"tight:{RULE_NAMES[f.key]}", "*",
                                    "capacity-tight", status, time.perf_counter() - t0,
                                    f"B={b},K={k_min - 1},{f.name}",
                                    "" if tr else "no stuck run one block below the minimum"))
        offsets = {k - b for b, k in minimum.items() if k is not None}
        offset = offsets.pop() if len(offsets) == 1 and None not in minimum.values() else None
        yield Row(f, offset, minimum, checks, found)


@attrs.frozen
class SingleBlockCase:
    """Single-block mode (kv_blocks = 1): block 0 serves the only lane. Each case either has no
    stuck run (breadth-first search over every state reachable with B + 1 requests, beside the
    z3 progress proof of the capacity table) or shows, with one, what breaks."""

    name: str
    lanes: int
    prefix_cache: bool
    role: str  # search.ROLES
    want: str | None  # the progress property the run should break
    stuck: bool  # expected: a stuck run exists

    def check(self, model: L.Model) -> tuple[Check, bmc.Trace | None]:
        t0 = time.perf_counter()
        tr = search.stuck_run(model, self.lanes, 1, self.prefix_cache, False, self.role,
                              self.want)
        ok = (tr is not None) == self.stuck
        detail = "" if ok else ("unexpected stuck run" if tr else "expected a stuck run")
        return Check(f"single-block:{self.name}", "*", "capacity-single-block",
                     "proved" if ok else "counterexample", time.perf_counter() - t0,
                     f"B={self.lanes},K=1,{'prefix cache' if self.prefix_cache else 'no cache'},"
                     f"{self.role}", detail), tr


SINGLE_BLOCK = (
    SingleBlockCase("pd-decode-one-lane-safe", 1, False, "decode", None, False),
    SingleBlockCase("colocated-one-lane-safe", 1, False, "colocated", None, False),
    SingleBlockCase("second-lane-never-admitted", 2, False, "decode", "idle_lane_imports", True),
    # the seeds' "no simultaneous idle decoding lane": the idle row's padding has nowhere to go
    SingleBlockCase("second-lane-blocks-decode", 2, False, "decode",
                    "running_request_advances", True),
    SingleBlockCase("prefix-cache-blocks-local-admission", 1, True, "any", "idle_lane_admits",
                    True),
)


def rule_text(offset: int) -> str:
    return "kv_blocks >= lanes" + (f" + {offset}" if offset else "")


RULE_NAMES = {(False, "reserved"): "reserved-scratch", (False, "dynamic"): "dynamic-scratch",
              (True, "reserved"): "prefix-cache-reserved-scratch",
              (True, "dynamic"): "prefix-cache-dynamic-scratch"}


def render(rows: list[Row], max_lanes: int) -> str:
    """The generated capacity table module (`make generate`)."""
    lines = [
        "# GENERATED by `make generate` from the capacity proofs (atom_core.proofs.capacity)."
        " Do not edit.",
        '"""Fewest KV blocks per feature combination:',
        "kv_blocks >= lanes + OFFSETS[(prefix_cache, scratch)]. `atom-core verify` proves each",
        "rule sufficient for every lane count up to PROVED_LANES (z3: no state satisfying the",
        'invariants is stuck) and tight (a run into a stuck state with one block fewer)."""',
        "",
        f"PROVED_LANES = {max_lanes}",
        "",
        "OFFSETS = {",
    ]
    plain = [r for r in rows if r.features.plain]
    for r in rows:
        if r.offset is None:
            raise RuntimeError(f"no linear capacity rule for {r.features.name}: {r.minimum}")
        same = next(p for p in plain if p.key == r.key)
        if r.offset != same.offset:  # one table serves both; a difference needs a key of its own
            raise RuntimeError(f"{r.features.name} needs offset {r.offset}, "
                               f"{same.features.name} {same.offset}")
    rows = plain
    for r in rows:
        lines.append(f"    {r.key!r}: {r.offset},")
    lines += ["}", "", "RULE_NAMES = {"]
    lines += [f"    {r.key!r}: {RULE_NAMES[r.key]!r}," for r in rows]
    lines += ["}", "", "RULES = {"]
    lines += [f"    {r.key!r}: {r.rule!r}," for r in rows]
    lines += ["}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import pathlib

    from atom_core.spec.model import MODEL

    ap = argparse.ArgumentParser(description="prove the capacity rules and write the table")
    ap.add_argument("--write", type=pathlib.Path, help="write the generated table module here")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    args = ap.parse_args(argv)
    rows = list(table(MODEL, args.lanes, args.blocks, traces=False))
    text = render(rows, args.lanes)
    if args.write:
        args.write.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
