"""Capacity rules: the fewest KV blocks with which no reachable state is stuck.

For each feature combination and scratch discipline, each table size T (blocks per lane: 1, and
2 for the plain combinations) and each lane count B up to the cutoff (B * T <= the lane cutoff):
  sufficient  at K = K_min(B) (and every K up to the cutoff above it), the progress properties
              follow from the proved invariants: z3 answers unsat for every stuck state (at
              chunk 2, block 8; `verify` proves K_min again at chunk 128, block 4096);
  tight       at K_min(B) - 1, a run from the initial state into a stuck state, found by search
              over the generated core (at chunk 2, block 8) and replayed step by step in z3
              against the spec.
The rule is K_min(B) = B * T + offset with one offset for every B and T checked; a combination
whose minimum is not of that form is reported as such rather than fitted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import attrs

from atom_core.proofs import bmc, search
from atom_core.proofs.checks import (
    CHUNK,
    NONVACUITY,
    SEQ_LEN,
    Check,
    bounded_universe,
    progress,
)
from atom_core.proofs.witness import Witness, replay
from atom_core.spec import lang as L

SCRATCH_MODES = ("reserved", "dynamic")


@attrs.frozen
class Features:
    prefix_cache: bool
    scratch: str
    hybrid: bool = False  # sliding-window layers (with the prefix cache: hits need snapshots)
    host: bool = False  # a host cache tier below the prefix cache
    tables: int = 1  # T: blocks per lane's table
    preempt: bool = False  # a lane waiting for a block may preempt another

    @property
    def name(self) -> str:
        return (f"{'prefix cache' if self.prefix_cache else 'no cache'}, {self.scratch} scratch"
                + (", hybrid" if self.hybrid else "") + (", host cache" if self.host else "")
                + (f", T={self.tables}" if self.tables != 1 else "")
                + (", preemption" if self.preempt else ""))

    @property
    def key(self) -> tuple[bool, str]:
        """The rule table's key: a hybrid model, or a host tier, must need what the plain
        prefix cache does."""
        return (self.prefix_cache, self.scratch)

    def consts(self, lanes: int, blocks: int) -> dict[str, Any]:
        return {"B": lanes, "K": blocks, "C": CHUNK, "S": SEQ_LEN, "PREFIX": self.prefix_cache,
                "RESERVED": self.scratch == "reserved", "SCRATCH": 0, "HYBRID": self.hybrid,
                "HOST": self.host, "T": self.tables, "PREEMPT": self.preempt}

    @property
    def plain(self) -> bool:
        """The row the committed table is read from; the others must agree with it."""
        return not (self.hybrid or self.host or self.preempt) and self.tables == 1

    @property
    def rule_name(self) -> str:
        return RULE_NAMES[self.key] + ("-preemption" if self.preempt else "")

    def max_lanes(self, cutoff: int) -> int:
        """Lane counts checked: lanes * T up to the cutoff, and at least one lane; with
        preemption every lane count up to it (the rule does not grow with lanes * T)."""
        return cutoff if self.preempt else max(1, cutoff // self.tables)


# Hybrid without the prefix cache takes the same steps as a plain model (no hit, no snapshot), and
# the host tier needs the prefix cache, so those are the combinations of their own. Paged tables
# (T = 2) for each of them. Preemption (T > 1, no host tier: axioms) at T = 2 and 3, with the
# hybrid prefix cache too (its snapshots are the one state preemption adds for hybrid lanes).
COMBINATIONS = (tuple(Features(p, s) for p in (False, True) for s in SCRATCH_MODES)
                + tuple(Features(True, s, hybrid=True, tables=t) for t in (1, 2)
                        for s in SCRATCH_MODES)
                + tuple(Features(True, s, host=True, tables=t) for t in (1, 2)
                        for s in SCRATCH_MODES)
                + tuple(Features(p, s, tables=2) for p in (False, True) for s in SCRATCH_MODES)
                + tuple(Features(p, s, tables=t, preempt=True)
                        for t in (2, 3) for p in (False, True) for s in SCRATCH_MODES)
                + tuple(Features(True, s, hybrid=True, tables=t, preempt=True)
                        for t in (2, 3) for s in SCRATCH_MODES)
                + tuple(Features(True, s, host=True, tables=t, preempt=True)
                        for t in (2, 3) for s in SCRATCH_MODES))


# The lane cutoff: `table` and `progress_by_features` check B * T up to it.
MAX_LANES_ANY = 4
# The sizes the table is proved at, for every K up to the cutoff: those the tight runs are
# searched at (chunk 2, block 8), so that each row has one configuration shown safe at K_min and
# stuck at K_min - 1. `verify` proves each row's minimum again at the typical eager artifact's
# sizes (checks.CHUNK, checks.SEQ_LEN); the table is the same at both (and small numbers are the
# cheaper queries: about two thirds of the time).
TABLE_CHUNK, TABLE_SEQ_LEN = search.TRACE_CHUNK, search.TRACE_SEQ_LEN


def progress_by_features(model: L.Model, lanes: int, blocks: int,
                         cutoff: int = MAX_LANES_ANY, seq_len: int = SEQ_LEN,
                         chunk: int = CHUNK, only: tuple[Features, ...] | None = None
                         ) -> dict[Features, list[Check]]:
    """Progress checks at one size for every feature combination (of `only`, default all) whose
    lanes * T is within the cutoff (one translation, shared). A block size `seq_len` that is not
    a multiple of the chunk checks the eager combinations only (the axioms allow no other)."""
    u = bounded_universe(model, lanes, blocks, {"C": chunk, "S": seq_len, "SCRATCH": 0})
    aligned = seq_len % chunk == 0
    label = "" if (seq_len, chunk) == (SEQ_LEN, CHUNK) else (
        f",S={seq_len}" if chunk == CHUNK else f",C={chunk},S={seq_len}")
    by_case = {f"B={lanes},K={blocks},{f.name}{label}": f for f in only or COMBINATIONS
               if lanes <= f.max_lanes(cutoff) and (aligned or f.tables == 1)}
    cases = {case: {"PREFIX": f.prefix_cache, "RESERVED": f.scratch == "reserved",
                    "HYBRID": f.hybrid, "HOST": f.host, "T": f.tables, "PREEMPT": f.preempt}
             for case, f in by_case.items()}
    out: dict[Features, list[Check]] = {f: [] for f in by_case.values()}
    for case, c in progress(model, u, cases):
        out[by_case[case]].append(c if c.kind == NONVACUITY else
                                  attrs.evolve(c, kind="capacity"))
    return out


def safe(model: L.Model, f: Features, lanes: int, blocks: int) -> tuple[bool, list[Check]]:
    cs = progress_by_features(model, lanes, blocks)[f]
    return all(c.status == "proved" for c in cs), cs


def stuck_trace(model: L.Model, f: Features, lanes: int, blocks: int) -> bmc.Trace | None:
    """A stuck run from the initial state, confirmed by z3 against the spec (see search.py).
    With preemption one request suffices (one table and a block short, a lane running alone
    already needs preempting) and keeps the search small: with more, every interleaving of
    preemptions and readmissions is a new state."""
    return search.stuck_run(model, lanes, blocks, f.prefix_cache, f.scratch == "reserved",
                            hybrid=f.hybrid, host=f.host, tables=f.tables, preempt=f.preempt,
                            requests=1 if f.preempt else None)


def min_blocks(model: L.Model, f: Features, lanes: int, max_blocks: int) -> int | None:
    for k in range(1, max_blocks + 1):
        if safe(model, f, lanes, k)[0]:
            return k
    return None


@attrs.frozen
class Row:
    features: Features
    offset: int | None  # K_min = B * T + offset, None when no single offset fits
    minimum: dict[int, int | None]  # B -> K_min
    checks: list[Check]
    traces: dict[int, bmc.Trace | None]  # B -> stuck trace at K_min - 1

    @property
    def key(self) -> tuple[bool, str]:
        return self.features.key



def assemble(f: Features, results: dict[tuple[int, int], dict[Features, list[Check]]],
             max_lanes: int, max_blocks: int) -> Row:
    """The row of `f` from the progress results per size: the minimum per lane count, and the
    checks that prove it sufficient (tightness is added by the caller)."""
    minimum: dict[int, int | None] = {}
    checks: list[Check] = []
    for b in range(1, f.max_lanes(max_lanes) + 1):
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
            elif any(c.status == "unknown" or c.kind == NONVACUITY and c.status != "proved"
                     for c in cs):  # (undecided, or proved over contradictory hypotheses)
                checks += [c for c in cs if c.status == "unknown" or c.kind == NONVACUITY]
        minimum[b] = k_min
    offsets = {k - b * f.tables for b, k in minimum.items() if k is not None}
    offset = offsets.pop() if len(offsets) == 1 and None not in minimum.values() else None
    return Row(f, offset, minimum, checks, {})


def in_table(f: Features, max_blocks: int) -> bool:
    """(a block cutoff below one table and a block checks nothing for preemption)"""
    return not (f.preempt and f.tables + 1 > max_blocks)


def tight_check(f: Features, lanes: int, blocks: int, tr: bmc.Trace | None, seconds: float,
                how: str) -> Check:
    """`how`: "replayed" (a committed witness) or "searched"."""
    return Check(f"tight:{f.rule_name}", "*", "capacity-tight",
                 "proved" if tr is not None else "counterexample", seconds,
                 f"B={lanes},K={blocks},{f.name}",
                 how if tr else "no stuck run one block below the minimum")


def expect(f: Features, lanes: int, blocks: int) -> dict[str, Any]:
    """The core constants a witness for `f` at this size must have: the chunk and block size
    too, those the table's progress is proved at (`TABLE_CHUNK`), so that the row is shown safe
    at K_min and stuck one block below in one configuration (a run at other sizes replays just
    as well and would certify a claim the table does not make)."""
    return {"B": lanes, "K": blocks, "C": TABLE_CHUNK, "S": TABLE_SEQ_LEN, "T": f.tables,
            "PREFIX": f.prefix_cache,
            "RESERVED": f.scratch == "reserved", "SCRATCH": 0, "HYBRID": f.hybrid,
            "HOST": f.host, "PREEMPT": f.preempt}


def find_witness(f: Features, lanes: int, blocks: int) -> Witness | None:
    """A stuck run (not yet confirmed: `witness.replay`); see `stuck_trace`."""
    return search.find_witness(lanes, blocks, f.prefix_cache, f.scratch == "reserved",
                               hybrid=f.hybrid, host=f.host, tables=f.tables,
                               preempt=f.preempt, requests=1 if f.preempt else None)


def table(model: L.Model, max_lanes: int = 4, max_blocks: int = 8,
          traces: bool = True) -> Iterator[Row]:
    """Rows one after the other, in this process (`verify` runs the same work as tasks);
    `traces`: search each tight run."""
    results = {(b, k): progress_by_features(model, b, k, max_lanes, TABLE_SEQ_LEN, TABLE_CHUNK)
               for b in range(1, max_lanes + 1) for k in range(1, max_blocks + 1)}
    for f in COMBINATIONS:
        if not in_table(f, max_blocks):
            continue
        row = assemble(f, results, max_lanes, max_blocks)
        for b, k_min in row.minimum.items():
            if traces and k_min is not None and k_min > 1:
                t0 = time.perf_counter()
                tr = stuck_trace(model, f, b, k_min - 1)
                row.traces[b] = tr
                row.checks.append(tight_check(f, b, k_min - 1, tr, time.perf_counter() - t0,
                                              "searched"))
        yield row


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
        return self.result(tr, time.perf_counter() - t0), tr

    def find_witness(self) -> Witness | None:
        return search.find_witness(self.lanes, 1, self.prefix_cache, False, self.role, self.want)

    def replay(self, model: L.Model, w: Witness) -> bmc.Trace | str:
        """A committed stuck run of this case, replayed (`witness.replay`), or why it fails."""
        return replay(model, w, {"B": self.lanes, "K": 1, "C": search.TRACE_CHUNK,
                                 "S": search.TRACE_SEQ_LEN, "PREFIX": self.prefix_cache,
                                 "RESERVED": False, "SCRATCH": 0, "T": 1, "HYBRID": False,
                                 "HOST": False, "PREEMPT": False},
                      avoid=search.ROLES[self.role], want=self.want)

    def result(self, tr: bmc.Trace | None, seconds: float, how: str = "") -> Check:
        ok = (tr is not None) == self.stuck
        detail = how if ok else ("unexpected stuck run" if tr else "expected a stuck run")
        return Check(f"single-block:{self.name}", "*", "capacity-single-block",
                     "proved" if ok else "counterexample", seconds,
                     f"B={self.lanes},K=1,{'prefix cache' if self.prefix_cache else 'no cache'},"
                     f"{self.role}", detail)


SINGLE_BLOCK = (
    SingleBlockCase("pd-decode-one-lane-safe", 1, False, "decode", None, False),
    SingleBlockCase("colocated-one-lane-safe", 1, False, "colocated", None, False),
    SingleBlockCase("second-lane-never-admitted", 2, False, "decode", "idle_lane_imports", True),
    # the seeds' "no simultaneous idle decoding lane": the idle row's padding has nowhere to go
    SingleBlockCase("second-lane-blocks-decode", 2, False, "decode",
                    "running_request_advances", True),
    # (the seeds' incident at one block: a request finished into block 0 and a later prompt of
    # the same prefix; the lane takes the entry over, `admit_adopt`)
    SingleBlockCase("prefix-cache-one-lane-safe", 1, True, "any", None, False),
)


def need(lanes: int, tables: int, scratch_blocks: int, copy_blocks: int) -> int:
    """The rule's form: every lane can hold a whole table, or, while an admission copies a hit
    into its first block, the other lanes' tables, that block and the pinned source (one block
    beyond a whole table only when T = 1); plus the scratch block."""
    return max(lanes * tables, (lanes - 1) * tables + 1 + copy_blocks) + scratch_blocks


def need_preempt(lanes: int, tables: int, lone: int, shared: int) -> int:
    """With preemption: one lane's whole table, plus `lone` blocks when it is the only lane and
    `shared` beside others (a padding target for their rows: the lane's own decode cannot wait
    for a block that only preempting it would free)."""
    return tables + (lone if lanes == 1 else shared)


def preempt_rule_text(lone: int, shared: int | None) -> str:
    def plus(n: int) -> str:
        return f"T + {n}" if n else "T"
    if shared is None:  # (a one-lane cutoff)
        return f"kv_blocks >= {plus(lone)} with one lane"
    if lone == shared:
        return f"kv_blocks >= {plus(lone)}"
    return f"kv_blocks >= {plus(shared)} ({plus(lone)} with one lane)"


def rule_text(scratch_blocks: int, copy_blocks: int) -> str:
    core = ("lanes * T" if not copy_blocks
            else f"max(lanes * T, (lanes - 1) * T + {1 + copy_blocks})")
    return f"kv_blocks >= {core}" + (f" + {scratch_blocks}" if scratch_blocks else "")


def fit_preempt(rows: list[Row]) -> tuple[dict[tuple[bool, str], tuple[int, Any]], list[str]]:
    """(lone, shared) per rule key for the preemption rows, read off the largest T's rows at
    one and two lanes, and every row whose minimum the rule does not give (must be none)."""
    out: dict[tuple[bool, str], tuple[int, int]] = {}
    wrong = []
    pre = [r for r in rows if r.features.preempt]
    for r in sorted(pre, key=lambda x: x.features.tables):
        lone, shared = r.minimum.get(1), r.minimum.get(2)
        if lone is None or (shared is None and 2 in r.minimum):
            wrong.append(f"{r.features.name}: no rule fits {r.minimum}")
            continue
        # (a cutoff of one lane says nothing about two: shared stays open, None)
        out[r.key] = (lone - r.features.tables,
                      None if shared is None else shared - r.features.tables)
    for r in pre:
        if r.key not in out:
            continue
        for b, k in r.minimum.items():
            if k != need_preempt(b, r.features.tables, *out[r.key]):
                wrong.append(f"{r.features.name}: K_min(B={b}) = {k}, the rule says "
                             f"{need_preempt(b, r.features.tables, *out[r.key])}")
    return out, wrong


def fit(rows: list[Row]) -> tuple[dict[tuple[bool, str], tuple[int, int]], list[str]]:
    """(scratch blocks, copy blocks) per rule key, read off the T = 1 and T = 2 rows, and every
    row whose minimum the rule does not give (must be none). Preemption rows: `fit_preempt`."""
    out: dict[tuple[bool, str], tuple[int, int]] = {}
    wrong = []
    rows = [r for r in rows if not r.features.preempt]
    for r in rows:
        if r.features.plain:
            t2 = next((x for x in rows if x.key == r.key and x.features.tables == 2
                       and not x.features.preempt), None)
            if r.offset is None or t2 is None or t2.offset is None:
                wrong.append(f"{r.features.name}: no rule fits {r.minimum}")
                continue
            out[r.key] = (t2.offset, r.offset - t2.offset)
    for r in rows:
        if r.key not in out:
            continue
        sb, cb = out[r.key]
        for b, k in r.minimum.items():
            if k != need(b, r.features.tables, sb, cb):
                wrong.append(f"{r.features.name}: K_min(B={b}) = {k}, the rule says "
                             f"{need(b, r.features.tables, sb, cb)}")
    return out, wrong


RULE_NAMES = {(False, "reserved"): "reserved-scratch", (False, "dynamic"): "dynamic-scratch",
              (True, "reserved"): "prefix-cache-reserved-scratch",
              (True, "dynamic"): "prefix-cache-dynamic-scratch"}


def render(rows: list[Row], max_lanes: int) -> str:
    """The generated capacity table module (`make generate`)."""
    fitted, wrong = fit(rows)
    pfitted, pwrong = fit_preempt(rows)
    wrong += pwrong
    if wrong:
        raise RuntimeError("no capacity rule fits: " + "; ".join(wrong))
    keys = [r.key for r in rows if r.features.plain]
    lines = [
        "# GENERATED by `make generate` from the capacity proofs (atom_core.proofs.capacity)."
        " Do not edit.",
        '"""Fewest KV blocks per feature combination, T = max_seq_len / block_size (blocks per',
        "lane's table): kv_blocks >= max(lanes * T, (lanes - 1) * T + 1 + COPY_BLOCKS[key])",
        "+ SCRATCH_BLOCKS[key], key = (prefix_cache, scratch); with T = 1, lanes + OFFSETS[key].",
        "`atom-core verify` proves each rule sufficient (z3: no state satisfying the invariants is",
        "stuck) for every lane count up to PROVED_LANES with T = 1 and lanes * T up to it with",
        "T = 2, and tight (a run into a stuck state with one block fewer). With preemption:",
        "kv_blocks >= T + PREEMPT_BLOCKS[key][0] for one lane, T + PREEMPT_BLOCKS[key][1] for",
        'more."""',
        "",
        f"PROVED_LANES = {max_lanes}",
        "",
        "SCRATCH_BLOCKS = {",
    ]
    lines += [f"    {k!r}: {fitted[k][0]}," for k in keys]
    lines += ["}", "", "COPY_BLOCKS = {"]
    lines += [f"    {k!r}: {fitted[k][1]}," for k in keys]
    lines += ["}", "", "OFFSETS = {"]
    lines += [f"    {k!r}: {sum(fitted[k])}," for k in keys]
    lines += ["}", "", "PREEMPT_BLOCKS = {"]
    lines += [f"    {k!r}: {pfitted[k]}," for k in keys]
    lines += ["}", "", "RULE_NAMES = {"]
    lines += [f"    {k!r}: {RULE_NAMES[k]!r}," for k in keys]
    lines += ["}", "", "RULES = {"]
    lines += [f"    {k!r}: (\n        {RULE_NAMES[k] + ': ' + rule_text(*fitted[k])!r}),"
              for k in keys]
    lines += ["}", "", "PREEMPT_RULES = {"]
    lines += [f"    {k!r}: (\n        "
              f"{RULE_NAMES[k] + '-preemption: ' + preempt_rule_text(*pfitted[k])!r}),"
              for k in keys]
    lines += ["}", "", "",
              "def min_kv_blocks(lanes: int, tables: int, key: tuple[bool, str],",
              "                  preempt: bool = False) -> int:",
              "    if preempt:",
              "        return tables + PREEMPT_BLOCKS[key][0 if lanes == 1 else 1]",
              "    return (max(lanes * tables, (lanes - 1) * tables + 1 + COPY_BLOCKS[key])",
              "            + SCRATCH_BLOCKS[key])", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table the proofs give (`make generate` writes it, with its witnesses:
    proofs/generate.py)."""
    import argparse

    from atom_core.spec.model import MODEL

    ap = argparse.ArgumentParser(description="prove the capacity rules and print the table")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    args = ap.parse_args(argv)
    rows = list(table(MODEL, args.lanes, args.blocks, traces=False))
    print(render(rows, args.lanes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
