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
plain-Python model kept here (`Life`): the request lifecycle, each lane's block table, every
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

`bench/stateful.py` reuses `make_machine` to measure stateful steps per second.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from atom_core._generated import core as committed
from atom_core.config import min_kv_blocks
from atom_core.policy import Policy, common_chunks, prefer_host
from atom_core.seq import TokSeq, seq
from atom_core.spec import codegen, lang
from atom_core.spec import model as spec
from atom_core.spec.model import HOST_ACTIONS, MODEL, PD_ACTIONS

FEATURES = [(p, s) for p in (False, True) for s in ("reserved", "dynamic")]
ALPHABET = (1, 2, 3)
# Prompts start with a prefix of one of these stems, so prefix hits (first chunk equal) and
# long shared prefixes are common.
STEMS = ((1,) * 12, (1, 2) * 6, (2, 3, 3) * 4)
CRASH = "check_invariants crashed"
MOVING = ("importing", "exporting")  # PD: the lane's blocks are in a transfer
RUNNING = ("prefill", "decode", *MOVING)
ENDED = ("finished", "aborted", "failed")
PHASE_OF = {"waiting": "WAITING", "prefill": "PREFILL", "decode": "DECODE",
            "importing": "IMPORTING", "exporting": "EXPORTING",
            "finished": "FINISHED", "aborted": "ABORTED", "failed": "FAILED"}
# The prefix-cache tiers beside the plain one: "hybrid" (sliding-window layers, hits restore
# sliding-state snapshots) and "host" (a host cache tier of 1..2 slots). Both need the prefix
# cache, and a model has at most one of them (axiom hybrid_without_host_cache).
TIERS = ("hybrid", "host")
# A situation the host tier with paged tables exists for (`Stats.events`).
LATER_LOAD_FAILED = "load into a later block failed (recomputes only that block)"
# ... and the hybrid tier with paged tables: a hit past the first block (`grow_hit`) landed and
# restored the sliding state at the lane's new length from the entry's snapshot there.
HYBRID_LATER_HIT = "hybrid hit past the first block"
# ... and the policy's next hit chosen where an entry's key goes on further than its snapshots.
SNAPSHOT_CAP = "policy's hit past the first block capped by the entry's snapshots"
# ... and PD with paged tables: an import into a table of several blocks (grown by import_grow
# until it covered the prompt) landed, a table of several blocks was exported, an importing
# (exporting) lane of several blocks was cancelled (every block drains), one transfer_end freed
# several draining blocks, and an import_done came while the table was still short.
MULTI_IMPORT = "import into several blocks landed"
MULTI_EXPORT = "export of several blocks"
IMPORT_DRAINS = "importing lane of several blocks cancelled: every block drains"
EXPORT_DRAINS = "exporting lane of several blocks cancelled: every block drains"
DRAINS_END_TOGETHER = "one transfer_end freed several draining blocks"
IMPORT_SHORT = "import_done refused: the table does not cover the prompt yet"
# ... and PD with preemption: an import landed (with PREEMPT), an importing lane's table grew
# by preempting a computing lane (`import_grow_by_policy`), and an imported request (decoding
# since its import landed) was preempted, and finished later (recomputed here: admitted again
# as any preempted request).
IMPORT_WITH_PREEMPTION = "import with preemption landed"
IMPORT_BLOCK_PREEMPTED = "preempt for a block of an import"
IMPORTED_PREEMPTED = "imported request preempted"
IMPORTED_PREEMPTED_FINISHED = "preempted imported request finished"
# Without the host tier (H = 0) a spill or a host hit names a slot that does not exist: the core
# refuses the index itself.
NO_SLOT = "slot index refused without the host tier"


class Stats:
    """Counts over every machine run in the process (read by bench/stateful.py)."""

    steps = 0  # rule executions (hypothesis stateful steps)
    calls = 0  # core action calls (a rule may make several, or none)
    applied = Counter()  # successful transitions per action
    rejected = Counter()  # rejections per (action, guard)
    policy_idle = 0  # policy returned no admission (copy in flight or no idle lane)
    events = Counter()  # situations worth reaching (PD: drains, stale events, ...)

    @classmethod
    def reset(cls) -> None:
        cls.steps, cls.calls, cls.policy_idle = 0, 0, 0
        cls.applied, cls.rejected, cls.events = Counter(), Counter(), Counter()


class InvariantViolation(AssertionError):
    """A step of the core led to a state (or transition) the spec's invariants forbid."""

    def __init__(self, kind: str, names: list[str], action: str, args: tuple[Any, ...],
                 core: Any, pre: Any, post: Any) -> None:
        self.kind, self.names, self.action, self.args = kind, names, action, args
        super().__init__(
            f"{kind} {names} violated by {action}{args}\n"
            f"pre:  {core.describe_state(pre)}\npost: {core.describe_state(post)}")


class LifecycleDivergence(AssertionError):
    """The core accepted or refused a step against the lifecycle model's prediction (a guard
    no invariant protects, e.g. one that only rejects late events)."""

    def __init__(self, action: str, args: tuple[Any, ...], expected: str | None,
                 got: str | None) -> None:
        self.action, self.args, self.expected, self.got = action, args, expected, got
        super().__init__(f"{action}{args}: the lifecycle model expects "
                         f"{'acceptance' if expected is None else expected!r}, "
                         f"the core {'accepted' if got is None else f'rejected ({got})'}")


class ProgressViolation(AssertionError):
    """A quiescent state at or above the proved capacity in which a progress property fails
    (e.g. an idle lane and a waiting request that no admission accepts)."""

    def __init__(self, names: list[str], action: str, args: tuple[Any, ...], core: Any,
                 state: Any) -> None:
        self.names, self.action, self.args = names, action, args
        super().__init__(f"progress {names} fails after {action}{args}\n"
                         f"state: {core.describe_state(state)}")


class RefinementViolation(AssertionError):
    """The policy chose a step the spec refuses, or declined (or missed) one the spec allows
    where it must not."""

    def __init__(self, action: str, what: str, core: Any, state: Any) -> None:
        self.action = action
        super().__init__(f"policy refinement ({action}): {what}\n"
                         f"state: {core.describe_state(state)}")


class ModelDivergence(AssertionError):
    """After a step the core applied as the lifecycle model predicted, its state differs from
    the model's (`Life.compare`): an update the spec makes (a key, an owner, a snapshot
    boundary) that the core made otherwise, or not at all."""

    def __init__(self, action: str, args: tuple[Any, ...], detail: str) -> None:
        self.action, self.args = action, args
        super().__init__(f"after {action}{args} the core's state differs from the lifecycle "
                         f"model's: {detail}")


class MirrorDivergence(AssertionError):
    """The ghost-off core disagrees with the ghost-on core on a step."""

    def __init__(self, what: str, action: str, args: tuple[Any, ...], on: Any, off: Any) -> None:
        self.what = what
        super().__init__(f"ghost-off core differs in {what} after {action}{args}: "
                         f"on={on!r} off={off!r}")


def min_blocks(lanes: int, prefix: bool, scratch: str, tables: int = 1,
               preempt: bool = False) -> int:
    """The proved capacity rule (`config.min_kv_blocks`, T = tables): every lane can hold a
    whole table, plus the features' blocks (scratch, a prefix hit's source); with preemption,
    one lane's whole table plus a scratch or padding block."""
    return min_kv_blocks(lanes, prefix, scratch, tables, preemption=preempt)


@st.composite
def configs(draw: Any, core: Any, prefix: bool, scratch: str, extra: tuple[int, int] = (0, 2),
            lanes: tuple[int, int] = (1, 3), tier: str = "plain",
            tables: tuple[int, int] = (1, 3), preempt: bool | None = False) -> Any:
    """Small configurations: T blocks per lane table from tables[0] to tables[1] (every
    tier), K from min_blocks + extra[0] to min_blocks + extra[1]; tier "hybrid" turns on
    HYBRID, "host" HOST with H in 1..2 (both with the prefix cache). With T > 1 the block size
    S is small (2..8), so that tables fill within a run.
    preempt: PREEMPT on (any tier, T >= 2: axiom preemption_with_tables),
    K from the preemption rule's minimum + extra[0] up to below the rule without it (or to the
    minimum + extra[1]), so that lanes often wait for a block and preempt; None: the same
    K, with PREEMPT off (below capacity: for a mutant that preempts without PREEMPT)."""
    assert tier == "plain" or (tier in TIERS and prefix), (tier, prefix)
    if preempt is not False:
        tables = (max(2, tables[0]), max(2, tables[1]))
    t = draw(st.integers(*tables))
    b = draw(st.integers(*lanes))
    lo = min_blocks(b, prefix, scratch, t, preempt is not False)
    hi = lo + extra[1]
    if preempt is not False and extra[1] >= 0:  # up to just below the rule without preemption
        hi = max(hi, min_blocks(b, prefix, scratch, t) - 1)
    k = draw(st.integers(max(1, lo + extra[0]), max(1, hi)))
    if preempt is not False and extra[0] >= 0:
        # often K = m * B (+ the reserved scratch block): B lanes of m < T blocks each hold
        # every block (a storm: `storm` prompts of m blocks reach their boundaries at once)
        even = [x for m in range(1, t) if lo <= (x := m * b + (scratch == "reserved")) <= hi]
        if even and draw(st.booleans()):
            k = draw(st.sampled_from(even))
    c = draw(st.sampled_from((1, 2)))
    sizes = range(6, 13) if t == 1 else range(2, 9)
    s = draw(st.sampled_from([x for x in sizes if x % c == 0]))
    h = draw(st.integers(1, 2)) if tier == "host" else 0
    return core.Consts(B=b, K=k, C=c, S=s, T=t, PREFIX=prefix, RESERVED=scratch == "reserved",
                       SCRATCH=k - 1, HYBRID=tier == "hybrid", HOST=tier == "host", H=h,
                       PREEMPT=preempt is True)


@functools.cache
def prompts(max_len: int) -> st.SearchStrategy[TokSeq]:
    """1..max_len tokens: a prefix of a stem, then a random tail."""
    def build(stem: tuple[int, ...], k: int, tail: list[int]) -> TokSeq:
        toks = (stem[:k] + tuple(tail))[:max_len]
        return seq(toks or stem[:1])
    return st.builds(build, st.sampled_from(STEMS), st.integers(0, max_len),
                     st.lists(st.sampled_from(ALPHABET), max_size=max_len))


tokens = st.sampled_from(ALPHABET)


@functools.cache
def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


_BOOLS = st.booleans()


# Draw helpers with cached strategies: building a fresh strategy per draw (sampled_from over a
# new list) costs hypothesis a validation each time, a large share of a step.
def pick(data: Any, xs: Any, label: str | None = None) -> Any:
    """One of the (non-empty) sequence xs; shrinks towards xs[0]."""
    xs = tuple(xs)
    return xs[data.draw(_ints(0, len(xs) - 1), label=label)]


@functools.cache
def _token_lists(lo: int, hi: int) -> st.SearchStrategy[list[int]]:
    return st.lists(tokens, min_size=lo, max_size=hi)


def coin(data: Any, label: str | None = None) -> bool:
    return data.draw(_BOOLS, label=label)


def num(data: Any, lo: int, hi: int, label: str | None = None) -> int:
    return data.draw(_ints(lo, hi), label=label)


# ------------------------------------------------------------------------ lifecycle model


def _first(*checks: tuple[str, Callable[[], bool]]) -> str | None:
    """The first guard whose check fails, in order (later checks are not evaluated)."""
    for guard, ok in checks:
        if not ok():
            return guard
    return None


class Life:
    """The request lifecycle, the blocks' owners and the host slots in plain Python: what the
    core must agree with, and the guard that must refuse each call.

    With PD a request runs importing (decode side: its KV arrives by transfer, once its table,
    grown by `import_grow`, covers the prompt) or exporting (prefill side: its KV, every block
    of its table, is being sent), and a transferring lane that is aborted or fails leaves every
    block of its table draining until the transfer ends (`draining`, block -> request; one
    `transfer_end` frees all of a request's).
    Tables: each busy lane's blocks in token order (`tables`; the last one, its tail, is the
    only one written; a full tail gets the next block by `grow`, up to T blocks, or by
    `grow_hit`, which copies its first tokens from the cache entry at that position).
    Blocks: each block's owner (`owner`, the spec's Owner names), the position of its first
    token in its sequence (`start`, for lane blocks and cache entries), the cache entries' keys
    and snapshot boundaries (`entries`, block -> (key, snap_upto)), the entry an in-flight copy
    reads (`copy_src`, which pins it) or the slot an in-flight load reads (`load_slot`).
    Hybrid prefix cache: each lane's last snapshot boundary (`snap`, the spec's lane_snap),
    and each lane's full block's (`filled_snap`: the lane's when the block filled; it keeps
    them when it is cached, so a hit into it restores the sliding state up to its end).
    Host tier: each slot's state, key, start (its block's: a host entry of a later block is
    loaded into a lane's later block, by `grow_host_hit`), the block a store reads and the lane
    a load writes.
    """

    def __init__(self, c: Any) -> None:
        self.c = c
        self.status: dict[int, str] = {}
        self.prompt: dict[int, tuple[int, ...]] = {}
        self.ends: Counter[int] = Counter()
        self.lane: list[int | None] = [None] * c.B
        self.length = [0] * c.B
        self.seq: list[tuple[int, ...]] = [()] * c.B
        self.tables: list[list[int]] = [[] for _ in range(c.B)]  # the lane's blocks, in order
        self.start = [0] * c.K  # a lane block's or cache entry's first token's position
        self.copy_src: list[int | None] = [None] * c.B
        self.load_slot: list[int | None] = [None] * c.B
        self.snap = [0] * c.B
        self.filled_snap: dict[int, int] = {}  # a lane's full block -> its snap_upto
        self.owner = ["SCRATCH" if c.RESERVED and b == c.SCRATCH else "FREE"
                      for b in range(c.K)]
        self.entries: dict[int, tuple[tuple[int, ...], int]] = {}
        self.draining: dict[int, int] = {}
        self.drained: list[tuple[int, int]] = []  # (request, block) drains that ended
        self.slot_state = ["EMPTY"] * c.H
        self.slot_key: list[tuple[int, ...]] = [()] * c.H
        self.slot_start = [0] * c.H  # the position of its first token (its block's start)
        self.slot_block: dict[int, int] = {}  # storing slot -> the spilling block it reads
        self.slot_lane: dict[int, int] = {}  # loading slot -> the lane it is read into
        self.admitted = [0] * c.B  # when each lane's request was admitted (a clock)
        self.clock = 0
        self.preempted: set[int] = set()  # requests preempted at least once
        self.imported: set[int] = set()  # requests whose import landed (PD, decode side)
        self.preempted_imports: set[int] = set()  # ... and were preempted after it

    # queries -------------------------------------------------------------------------
    @property
    def copying(self) -> list[bool]:
        """Lanes with a copy (device entry) or a load (host slot) in flight."""
        return [self.copy_src[l] is not None or self.load_slot[l] is not None
                for l in range(self.c.B)]

    def tail(self, l: int) -> int:
        """Busy lane l's last block: the one its next token's KV goes to."""
        return self.tables[l][-1]

    def tail_full(self, l: int) -> bool:
        """Busy lane l's tail block holds S tokens: nothing more fits until it grows."""
        return self.length[l] == self.start[self.tail(l)] + self.c.S

    def computing(self, l: int) -> bool:
        """Lane l prefills or decodes (no copy or load in flight): it may grow."""
        return (self.prefilling(l) or self.decoding(l)) and not self.copying[l]

    def needs_block(self, l: int) -> bool:
        """Lane l has more to compute, a full tail and room in its table: it grows before
        its next prefill or decode call."""
        return (self.computing(l) and self.tail_full(l)
                and len(self.tables[l]) < self.c.T)

    def table_end(self, l: int) -> bool:
        """Decoding lane l's table is full (T blocks, the last one full): it must finish."""
        return (self.decoding(l) and self.tail_full(l)
                and len(self.tables[l]) == self.c.T)

    def decoding(self, l: int) -> bool:
        r = self.lane[l]
        return r is not None and self.status[r] == "decode"

    def prefilling(self, l: int) -> bool:
        r = self.lane[l]
        return r is not None and self.status[r] == "prefill"

    def prefilled(self, l: int) -> bool:
        """Lane l has just computed its prompt (and sampled the first token): it may export."""
        r = self.lane[l]
        return self.decoding(l) and r is not None and self.length[l] == len(self.prompt[r])

    def importing(self, l: int) -> bool:
        r = self.lane[l]
        return r is not None and self.status[r] == "importing"

    def covers_prompt(self, l: int) -> bool:
        """Busy lane l's table has a block for every prompt position (an import can land)."""
        return self.start[self.tail(l)] + self.c.S >= len(self.prompt[self.lane[l]])

    def needs_import_block(self, l: int) -> bool:
        """Importing lane l's table does not cover its prompt yet: it grows (`import_grow`)
        before its transfer can start."""
        return self.importing(l) and not self.covers_prompt(l)

    def in_phase(self, *phases: str) -> list[int]:
        return sorted(r for r, x in self.status.items() if x in phases)

    def slots(self, *states: str) -> list[int]:
        return [h for h in range(self.c.H) if self.slot_state[h] in states]

    def pinned(self, b: int) -> bool:
        return b in self.copy_src

    def reusable(self, b: int) -> bool:
        return self.owner[b] in ("FREE", "CACHE") and not self.pinned(b)

    def hit_ok(self, p: tuple[int, ...], b: int) -> bool:
        """Entry b shares p's first chunk (and, hybrid, has a snapshot there): a miss is
        refused."""
        c = self.c
        if len(p) <= c.C or b not in self.entries or self.start[b] != 0:
            return False  # a hit copies into the lane's first block: from a first block only
        key, snap = self.entries[b]
        return (len(key) >= c.C and key[:c.C] == p[:c.C]
                and (not c.HYBRID or snap >= c.C))

    def shares_first_chunk(self, p: tuple[int, ...], first: bool = True) -> bool:
        """Some entry (starting its sequence; `first` False: starting later in it) shares p's
        first chunk (a hit, but for the hybrid snapshot clause)."""
        c = self.c
        return len(p) > c.C and any(
            len(key) >= c.C and key[:c.C] == p[:c.C] and (self.start[b] == 0) == first
            for b, (key, _) in self.entries.items())

    def snapshot_ok(self, l: int) -> bool:
        c = self.c
        return (c.HYBRID and c.PREFIX and (self.prefilling(l) or self.decoding(l))
                and not self.copying[l] and self.length[l] == self.snap[l] + c.C)

    def needs_scratch(self) -> bool:
        return not all(self.decoding(l) for l in range(self.c.B))

    def waits_for_block(self) -> bool:
        """Some lane needs its next block (an importing lane too, until its table covers the
        prompt), or (dynamic scratch) a decode call needs a padding target: what preemption
        may make room for."""
        c = self.c
        return any(self.needs_block(l) or self.needs_import_block(l) for l in range(c.B)) or (
            not c.RESERVED and self.needs_scratch() and any(map(self.decoding, range(c.B))))

    def import_table_grows(self) -> bool:
        """With PREEMPT, an importing lane's table is short of its prompt: no other import is
        admitted until it covers it (one importing table grows at a time)."""
        return self.c.PREEMPT and any(map(self.needs_import_block, range(self.c.B)))

    def transfer_in_flight(self, l: int) -> bool:
        """Lane l's transfer runs: it exports, or it imports and its table covers the prompt
        (an import short of it has not asked for its KV yet). Its blocks free, or it decodes
        (and can be preempted), when the transfer ends."""
        r = self.lane[l]
        return (r is not None and self.status[r] in MOVING
                and not self.needs_import_block(l))

    def oldest(self) -> int | None:
        """The busy lane admitted first."""
        busy = [l for l in range(self.c.B) if self.lane[l] is not None]
        return min(busy, key=self.admitted.__getitem__) if busy else None

    # prediction ----------------------------------------------------------------------
    def predict(self, name: str, args: tuple[Any, ...]) -> str | None:
        """The guard the core must report, or None (it must apply the step)."""
        c = self.c
        if name == "submit":
            r, p = args
            if r in self.status:
                return "request_is_new"
            if len(p) <= 0:
                return "prompt_not_empty"
            return "prompt_fits" if len(p) >= c.T * c.S else None
        if name in ("admit_miss", "admit_hit", "admit_host_hit", "admit_import"):
            l, r = args[:2]
            if self.lane[l] is not None:
                return "lane_idle"
            if self.status.get(r) != "waiting":
                return "request_waiting"
            p = self.prompt[r]
            if name == "admit_miss":
                return _first(("dst_reusable", lambda: self.reusable(args[2])),
                              ("no_cache_hit", lambda: not c.PREFIX or not any(
                                  self.hit_ok(p, b) for b in self.entries)))
            if name == "admit_import":
                # An importing lane computes nothing, so it is never preempted: with
                # preemption's smaller pool two of them, each holding part of a table, could
                # wait for each other forever. One importing table grows at a time.
                return _first(("one_import_table_growing", lambda: not self.import_table_grows()),
                              ("dst_reusable", lambda: self.reusable(args[2])))
            src, dst, n = args[2:]
            whole = ("n_whole_chunks", lambda: n >= c.C and n % c.C == 0)
            left = ("token_left_to_compute", lambda: n < len(p))
            reuse = ("dst_reusable", lambda: self.reusable(dst))
            # a hit copies into the lane's first block
            one_block = ("n_within_block", lambda: n <= c.S)
            if name == "admit_host_hit":
                key = self.slot_key[src]
                # (a host entry of a later block holds its whole prefix as its key: the
                # prefix may match, but it is loaded into a first block only from a first one)
                return _first(("slot_stored", lambda: self.slot_state[src] == "STORED"), whole,
                              ("n_within_entry", lambda: n <= len(key)), left,
                              ("prefix_matches", lambda: key[:n] == p[:n]),
                              ("slot_first_block", lambda: self.slot_start[src] == 0),
                              one_block, reuse)
            key, snap = self.entries.get(src, ((), 0))
            return _first(("src_cached", lambda: src in self.entries), whole,
                          ("n_within_entry", lambda: n <= len(key)), left,
                          ("prefix_matches", lambda: key[:n] == p[:n]),
                          ("hybrid_snapshot_at_n", lambda: not c.HYBRID or n <= snap),
                          ("src_first_block", lambda: self.start[src] == 0), one_block,
                          ("dst_not_src", lambda: dst != src), reuse)
        if name == "copy_done":
            return None if self.copy_src[args[0]] is not None else "copy_in_flight"
        if name in ("load_done", "load_fail"):
            return None if self.load_slot[args[0]] is not None else "load_in_flight"
        if name == "snapshot":
            l = args[0]
            return _first(("hybrid_prefix_cache", lambda: c.HYBRID and c.PREFIX),
                          ("lane_computing", lambda: (self.prefilling(l) or self.decoding(l))
                           and not self.copying[l]),
                          ("next_boundary", lambda: self.length[l] == self.snap[l] + c.C))
        if name == "prefill":
            l = args[0]
            if not self.prefilling(l):
                return "lane_prefilling"
            if self.copying[l]:
                return "no_copy_in_flight"
            end = min(self.length[l] + c.C, len(self.prompt[self.lane[l]]))
            return None if end <= self.start[self.tail(l)] + c.S else "chunk_within_block"
        if name == "grow":
            l, dst = args
            return _first(("lane_computing", lambda: self.computing(l)),
                          ("tail_full", lambda: self.tail_full(l)),
                          ("table_not_full", lambda: len(self.tables[l]) < c.T),
                          ("dst_reusable", lambda: self.reusable(dst)))
        if name == "grow_hit":
            l, src, dst, n = args
            key, snap = self.entries.get(src, ((), 0))
            end = self.length[l] + n
            return _first(("lane_prefilling", lambda: self.prefilling(l)),
                          ("no_copy_in_flight", lambda: not self.copying[l]),
                          ("tail_full", lambda: self.tail_full(l)),
                          ("table_not_full", lambda: len(self.tables[l]) < c.T),
                          ("src_cached", lambda: src in self.entries),
                          # the entry holds the tokens at the next block's own positions
                          ("src_at_the_boundary", lambda: self.start[src] == self.length[l]),
                          ("n_whole_chunks", lambda: n > 0 and n % c.C == 0),
                          ("n_within_block", lambda: n <= c.S),
                          ("n_within_entry", lambda: end <= len(key)),
                          ("token_left_to_compute",
                           lambda: end < len(self.prompt[self.lane[l]])),
                          # the whole prefix, not only the copied tokens: the KV of a token
                          # depends on every token before it
                          ("prefix_matches", lambda: key[:end] == self.seq[l][:end]),
                          # hybrid: copy_done restores the sliding state at the hit's end
                          ("hybrid_snapshot_at_n", lambda: not c.HYBRID or end <= snap),
                          ("dst_not_src", lambda: dst != src),
                          ("dst_reusable", lambda: self.reusable(dst)))
        if name == "grow_host_hit":
            # grow_hit's guards, from host slot h (read, not pinned: no dst_not_src)
            l, h, dst, n = args
            end = self.length[l] + n
            return _first(("lane_prefilling", lambda: self.prefilling(l)),
                          ("no_copy_in_flight", lambda: not self.copying[l]),
                          ("tail_full", lambda: self.tail_full(l)),
                          ("table_not_full", lambda: len(self.tables[l]) < c.T),
                          ("slot_stored", lambda: self.slot_state[h] == "STORED"),
                          ("slot_at_the_boundary", lambda: self.slot_start[h] == self.length[l]),
                          ("n_whole_chunks", lambda: n > 0 and n % c.C == 0),
                          ("n_within_block", lambda: n <= c.S),
                          ("n_within_entry", lambda: end <= len(self.slot_key[h])),
                          ("token_left_to_compute",
                           lambda: end < len(self.prompt[self.lane[l]])),
                          ("prefix_matches", lambda: self.slot_key[h][:end] == self.seq[l][:end]),
                          ("dst_reusable", lambda: self.reusable(dst)))
        if name == "decode":
            pad, lpad = args[0], args[1]
            return _first(("no_block_overflow", lambda: not any(
                self.decoding(l) and self.tail_full(l) for l in range(c.B))),
                ("scratch_target_ok", lambda: not self.needs_scratch() or (
                    self.owner[pad] == "SCRATCH" if c.RESERVED else self.reusable(pad))),
                # hybrid: padding rows write an idle lane's local slot (a busy one's window
                # would shift)
                ("local_pad_ok", lambda: not (c.HYBRID and self.needs_scratch())
                 or self.lane[lpad] is None))
        if name == "preempt":
            l = args[0]
            return _first(("preemption_on", lambda: c.PREEMPT),
                          ("lane_computing", lambda: self.computing(l)),
                          ("a_lane_waits_for_a_block", self.waits_for_block),
                          ("no_block_reusable", lambda: not any(map(self.reusable,
                                                                    range(c.K)))),
                          ("requeue_fits", lambda: len(self.seq[l]) <= c.T * c.S))
        if name == "finish":
            l, keep = args
            if not self.decoding(l):
                return "lane_decoding"
            return "keep_needs_prefix_cache" if keep and not c.PREFIX else None
        if name == "abort_waiting":
            return None if self.status.get(args[0]) == "waiting" else "request_waiting"
        if name == "forget":
            r = args[0]
            if self.status.get(r) not in ENDED:
                return "request_ended"
            return None if r not in self.draining.values() else "no_transfer_of_request"
        if name in ("abort_running", "fail"):
            return None if self.lane[args[0]] is not None else "lane_busy"
        if name == "discard":
            b = args[0]
            return _first(("not_a_lane_block", lambda: self.owner[b] in (
                "FREE", "CACHE", "SCRATCH")), ("not_pinned", lambda: not self.pinned(b)))
        if name == "spill":
            b, h = args
            return _first(("host_cache_on", lambda: c.HOST),
                          ("entry_cached", lambda: b in self.entries),
                          ("entry_unpinned", lambda: not self.pinned(b)),
                          ("slot_empty", lambda: self.slot_state[h] == "EMPTY"))
        if name in ("store_done", "store_fail"):
            return None if self.slot_state[args[0]] == "STORING" else "slot_storing"
        if name == "host_evict":
            return None if self.slot_state[args[0]] == "STORED" else "slot_stored"
        if name == "import_grow":
            l, dst = args
            return _first(("lane_importing", lambda: self.importing(l)),
                          ("table_short_of_prompt", lambda: not self.covers_prompt(l)),
                          ("table_not_full", lambda: len(self.tables[l]) < c.T),
                          ("dst_reusable", lambda: self.reusable(dst)))
        if name == "import_done":
            r, p, _ = args
            if self.status.get(r) != "importing":
                return "request_importing"
            return _first(("table_covers_prompt", lambda: self.covers_prompt(self.lane.index(r))),
                          ("covers_prompt", lambda: tuple(p) == self.prompt[r]))
        if name == "export":  # (every block of its table is sent)
            return None if self.prefilled(args[0]) else "lane_prefilled"
        if name == "export_done":
            r, keep = args
            if self.status.get(r) != "exporting":
                return "request_exporting"
            return "keep_needs_prefix_cache" if keep and not c.PREFIX else None
        if name == "transfer_fail":
            return None if self.status.get(args[0]) in MOVING else "request_transferring"
        if name == "transfer_end":
            r, b = args
            if b not in self.draining:
                return "block_draining"
            return None if self.draining[b] == r else "transfer_of_request"
        raise KeyError(name)

    # transitions ---------------------------------------------------------------------
    def _end(self, r: int, how: str) -> None:
        assert self.status[r] not in ENDED, f"request {r} ends twice"
        self.status[r] = how
        self.ends[r] += 1

    def _set_free(self, b: int) -> None:
        """Block b no longer holds anything (a cache entry there is gone)."""
        self.entries.pop(b, None)
        self.owner[b] = "FREE"

    def _release(self, l: int, keep: bool) -> int:
        """Lane l gives all its blocks back: cache entries (keep; a full block's key is the
        lane's tokens up to its end, with the lane's snapshots when it filled, the tail's up to
        the lane's length, with its snapshots now) or free; a load into it stops (its slot is a
        host entry again). Its tail block."""
        table, b = self.tables[l], self.tail(l)
        for x in table:
            snap = self.snap[l] if x == b else self.filled_snap.pop(x)
            if keep:
                end = self.length[l] if x == b else self.start[x] + self.c.S
                self.entries[x] = (self.seq[l][:end], snap)
                self.owner[x] = "CACHE"
            else:
                self._set_free(x)
        if keep and len(table) > 1:
            Stats.events["table of several blocks cached"] += 1
        h = self.load_slot[l]
        if h is not None:  # cancelled (abort, failure): its slot is a host entry again
            self.slot_state[h] = "STORED"
            del self.slot_lane[h]
            Stats.events["load cancelled"] += 1
        self.lane[l], self.copy_src[l], self.load_slot[l], self.snap[l] = None, None, None, 0
        self.tables[l] = []
        return b

    def _extend(self, l: int, dst: int) -> None:
        """The spec's `extend` (grow, grow_hit, grow_host_hit): lane l's full tail keeps the
        lane's snapshots so far (its snap_upto), and dst (a cache entry there is evicted)
        becomes its next block, starting at the lane's length."""
        self.filled_snap[self.tail(l)] = self.snap[l]
        self._set_free(dst)
        self.owner[dst], self.start[dst] = "LANE", self.length[l]
        self.tables[l].append(dst)

    def apply(self, name: str, args: tuple[Any, ...], effects: tuple[Any, ...],
              pre: Any) -> None:
        """Advance the model by a step the core applied; check its effects on the way."""
        c = self.c
        kinds = [type(e).__name__ for e in effects]
        if name == "submit":
            r, p = args
            self.status[r], self.prompt[r] = "waiting", tuple(p)
            assert kinds == []
        elif name in ("admit_miss", "admit_hit", "admit_host_hit", "admit_import"):
            l, r = args[:2]
            hit = name in ("admit_hit", "admit_host_hit")
            dst, n = (args[3], args[4]) if hit else (args[2], 0)
            if hit:
                assert c.C <= n < len(self.prompt[r]) and n % c.C == 0, args
            assert self.lane[l] is None and self.status[r] == "waiting"
            assert self.reusable(dst) and dst not in self.draining, (name, args, self.owner)
            if name == "admit_miss" and c.HYBRID and self.shares_first_chunk(self.prompt[r]):
                # an entry shares the first chunk but has no snapshot there: not a hit
                Stats.events["miss beside an entry without a snapshot"] += 1
            if name == "admit_miss" and self.shares_first_chunk(self.prompt[r], first=False):
                # an entry of a later block shares the first chunk: a hit cannot use it
                Stats.events["miss beside a later block's entry"] += 1
            if name == "admit_hit":
                src = args[2]
                if len(self.entries[src][0]) == c.S and c.T > 1:
                    Stats.events["hit on a full first block"] += 1
                self.copy_src[l] = src
                # the entry's snapshots up to the hit's length (hybrid_snapshot_at_n: all of it)
                self.snap[l] = min(n, self.entries[src][1])
                assert kinds == ["Admit", "Copy"] and effects[1] == (l, src, dst, n), effects
            elif name == "admit_host_hit":
                h = args[2]
                self.load_slot[l], self.slot_state[h], self.slot_lane[h] = h, "LOADING", l
                assert kinds == ["Admit", "Load"] and effects[1] == (l, h, dst, n), effects
            else:
                assert kinds == ["Inbound" if name == "admit_import" else "Admit"], kinds
            assert effects[0] == (l, r, dst), effects
            self._set_free(dst)  # a cache entry there is evicted
            self.owner[dst], self.tables[l], self.start[dst] = "LANE", [dst], 0
            self.lane[l] = r
            self.clock += 1
            self.admitted[l] = self.clock
            self.status[r] = "importing" if name == "admit_import" else "prefill"
            self.length[l], self.seq[l] = n, self.prompt[r]
        elif name == "copy_done":
            l = args[0]
            self.copy_src[l] = None
            if c.HYBRID and self.start[self.tail(l)] > 0:
                # a hit past the first block landed, restoring the sliding state at the lane's
                # length (the entry's snapshot there, now the lane's)
                assert self.snap[l] == self.length[l], (l, self.snap, self.length)
                Stats.events[HYBRID_LATER_HIT] += 1
            assert kinds == []
        elif name in ("load_done", "load_fail"):
            l = args[0]
            h = self.load_slot[l]
            assert h is not None
            self.load_slot[l], self.slot_state[h] = None, "STORED"
            del self.slot_lane[h]
            if name == "load_fail":  # the request recomputes the loaded block's tokens
                start = self.start[self.tail(l)]
                if start > 0:  # the blocks before it keep theirs
                    Stats.events[LATER_LOAD_FAILED] += 1
                self.length[l] = start
                assert kinds == ["Recompute"] and effects[0] == (l,), effects
            else:
                assert kinds == []
        elif name == "snapshot":
            l = args[0]
            assert self.snapshot_ok(l)
            self.snap[l] = self.length[l]
            assert kinds == ["Snapshot"] and effects[0] == (l, self.length[l]), effects
        elif name == "prefill":
            l, tok = args
            start = self.length[l]
            plen = len(self.prompt[self.lane[l]])
            end = min(start + c.C, plen)
            self.length[l] = end
            if end == plen:
                self.seq[l] += (tok,)
                self.status[self.lane[l]] = "decode"
            assert kinds == ["Prefill"] and effects[0] == (l, self.tail(l), start, end)
        elif name == "grow":
            l, dst = args
            assert self.needs_block(l) and self.reusable(dst), (args, self.owner)
            assert kinds == ["Grow"] and effects[0] == (l, dst, len(self.tables[l])), effects
            self._extend(l, dst)
        elif name == "grow_hit":
            # like grow (the full tail gets its key: `compare` checks it), and the lane's next
            # n tokens are copied from src, at the same positions of its sequence
            l, src, dst, n = args
            assert self.prefilling(l) and self.needs_block(l), (args, self.tables[l])
            assert src in self.entries and self.start[src] == self.length[l], (args, self.start)
            assert self.reusable(dst) and dst != src, (args, self.owner)
            assert kinds == ["Grow", "Copy"] and effects[0] == (l, dst, len(self.tables[l])) \
                and effects[1] == (l, src, dst, n), effects
            if len(self.tables[l]) >= 2:  # a third block (or later) copied
                Stats.events["hit past the second block"] += 1
            if dst in self.entries:
                Stats.events["hit past the first block evicts an entry"] += 1
            Stats.events["hit past the first block"] += 1
            # hybrid: the lane takes the entry's snapshots up to the hit's end (all of them up
            # to there: hybrid_snapshot_at_n), so copy_done restores the state at its length
            snap = min(self.length[l] + n, self.entries[src][1])
            assert not c.HYBRID or snap == self.length[l] + n, (args, self.entries[src])
            self._extend(l, dst)
            self.length[l] += n
            self.copy_src[l], self.snap[l] = src, snap
        elif name == "grow_host_hit":
            # like grow_hit, its next n tokens loaded from host slot h (the slot is read: it
            # stays a host entry, loading until load_done or load_fail)
            l, h, dst, n = args
            assert self.prefilling(l) and self.needs_block(l), (args, self.tables[l])
            assert self.slot_state[h] == "STORED" and self.slot_start[h] == self.length[l], (
                args, self.slot_state, self.slot_start)
            assert self.reusable(dst), (args, self.owner)
            assert kinds == ["Grow", "Load"] and effects[0] == (l, dst, len(self.tables[l])) \
                and effects[1] == (l, h, dst, n), effects
            if len(self.tables[l]) >= 2:  # a third block (or later) loaded
                Stats.events["host hit past the second block"] += 1
            Stats.events["host hit past the first block"] += 1
            self._extend(l, dst)
            self.length[l] += n
            self.load_slot[l], self.slot_state[h], self.slot_lane[h] = h, "LOADING", l
        elif name == "decode":
            pad, lpad, toks = args
            live = tuple(self.decoding(l) for l in range(c.B))
            rows = tuple(self.tail(l) if live[l] else pad for l in range(c.B))
            # a decoding row at its next position in its own local slot; a padding row at 0 in
            # the idle lane lpad's slot (never a busy lane's: its window would shift)
            positions = tuple(self.length[l] if live[l] else 0 for l in range(c.B))
            local = tuple(l if live[l] else lpad for l in range(c.B))
            (e,) = effects
            assert kinds == ["Decode"] and (e.rows, e.positions) == (rows, positions), (
                effects, rows, positions)
            assert (e.live, e.local) == (live, local), (effects, live, local)
            if c.HYBRID and not all(live):
                assert self.lane[lpad] is None, (lpad, self.lane)
            if not all(live) and not c.RESERVED and pad in self.entries:
                self._set_free(pad)  # a dynamic padding target that was an entry is evicted
            for l in range(c.B):
                if live[l]:
                    self.seq[l] += (toks[l],)
                    self.length[l] += 1
        elif name in ("finish", "abort_running", "fail"):
            l = args[0]
            r = self.lane[l]
            assert r is not None
            how = {"finish": "finished", "abort_running": "aborted", "fail": "failed"}[name]
            if name == "finish":
                assert self.status[r] == "decode"
                if r in self.preempted:
                    Stats.events["preempted request finished"] += 1
                if r in self.preempted_imports:
                    Stats.events[IMPORTED_PREEMPTED_FINISHED] += 1
            moving = self.status[r] in MOVING
            if moving and len(self.tables[l]) > 1:
                Stats.events[IMPORT_DRAINS if self.status[r] == "importing"
                             else EXPORT_DRAINS] += 1
            self._end(r, how)
            table = list(self.tables[l])
            b = self._release(l, name == "finish" and args[1])
            if moving:  # the transfer still uses every block of the table: they drain
                for x in table:
                    self.draining[x], self.owner[x] = r, "DRAINING"
            assert kinds == ["Release"] and effects[0] == (l, b), effects
        elif name == "preempt":
            l = args[0]
            r = self.lane[l]
            assert r is not None and self.computing(l) and self.copy_src[l] is None
            assert kinds == ["Preempt"] and effects[0] == (l, r), effects
            # back to waiting, its prompt everything it has (the restart recomputes it and
            # samples its next token); its blocks are freed, never cached
            self.status[r], self.prompt[r] = "waiting", self.seq[l]
            self.preempted.add(r)
            if r in self.imported:  # it decodes since its import landed: recomputed here
                self.preempted_imports.add(r)
                Stats.events[IMPORTED_PREEMPTED] += 1
            for x in self.tables[l]:
                assert self.owner[x] == "LANE" and x not in self.entries, (x, self.owner)
                self.filled_snap.pop(x, None)
                self._set_free(x)
            self.lane[l], self.snap[l], self.tables[l] = None, 0, []
        elif name == "abort_waiting":
            self._end(args[0], "aborted")
            assert kinds == []
        elif name == "forget":  # the id reads as never submitted
            del self.status[args[0]], self.prompt[args[0]]
            self.ends.pop(args[0], None)  # (a new request may take the id)
            Stats.events["request forgotten"] += 1
            assert kinds == []
        elif name == "discard":
            if args[0] in self.entries:
                self._set_free(args[0])
            assert kinds == []  # no lifecycle change
        elif name == "spill":
            b, h = args
            key, _ = self.entries.pop(b)
            self.owner[b] = "SPILLING"
            self.slot_state[h], self.slot_key[h], self.slot_block[h] = "STORING", key, b
            self.slot_start[h] = self.start[b]
            assert kinds == ["Store"] and effects[0] == (b, h), effects
        elif name in ("store_done", "store_fail"):
            h = args[0]
            self._set_free(self.slot_block.pop(h))
            self.slot_state[h] = "STORED" if name == "store_done" else "EMPTY"
            assert kinds == []
        elif name == "host_evict":
            self.slot_state[args[0]] = "EMPTY"
            assert kinds == []
        elif name == "import_grow":
            # the lane's next block, at the next block boundary, pinned for its transfer (the
            # full block gets its key and no snapshots when the import lands: `compare`)
            l, dst = args
            assert self.needs_import_block(l) and self.reusable(dst), (args, self.owner)
            assert kinds == ["Grow"] and effects[0] == (l, dst, len(self.tables[l])), effects
            at = self.start[self.tail(l)] + c.S
            self.filled_snap[self.tail(l)] = 0
            self._set_free(dst)
            self.owner[dst], self.start[dst] = "LANE", at
            self.tables[l].append(dst)
            Stats.events["import table grown"] += 1
        elif name == "import_done":
            r, p, tok = args
            l = self.lane.index(r)
            assert self.seq[l] == self.prompt[r] == tuple(p) and self.length[l] == 0
            assert self.covers_prompt(l), (l, self.tables[l])
            if len(self.tables[l]) > 1:
                Stats.events[MULTI_IMPORT] += 1
            self.length[l], self.seq[l] = len(p), self.seq[l] + (tok,)
            self.status[r] = "decode"
            self.imported.add(r)
            if c.PREEMPT:
                Stats.events[IMPORT_WITH_PREEMPTION] += 1
            assert kinds == ["Imported"] and effects[0] == (l, r, self.tail(l)), effects
        elif name == "export":
            l = args[0]
            r = self.lane[l]
            assert r is not None and self.prefilled(l)
            self.status[r] = "exporting"
            if len(self.tables[l]) > 1:
                Stats.events[MULTI_EXPORT] += 1
            assert kinds == ["Outbound"] and effects[0] == (l, r, self.tail(l), self.length[l])
        elif name in ("export_done", "transfer_fail"):
            r = args[0]
            l = self.lane.index(r)
            self._end(r, "finished" if name == "export_done" else "failed")
            b = self._release(l, name == "export_done" and args[1])
            assert kinds == ["Release"] and effects[0] == (l, b), effects
        elif name == "transfer_end":
            # r's transfer ended: b and every other block draining for it are free (one
            # transfer, one end)
            r, b = args
            assert self.draining[b] == r
            ended = [x for x, q in sorted(self.draining.items()) if q == r]
            if len(ended) > 1:
                Stats.events[DRAINS_END_TOGETHER] += 1
            for x in ended:
                del self.draining[x]
                self._set_free(x)
                self.drained.append((r, x))
            assert kinds == []
        else:
            raise KeyError(name)

    def compare(self, core: Any, s: Any) -> None:
        """The core state agrees with the model."""
        c = self.c
        names = core.PHASE_NAMES
        for r, st_ in self.status.items():
            assert names[s.phase.get(r)] == PHASE_OF[st_], (r, st_, names[s.phase.get(r)])
            assert tuple(s.prompt.get(r)) == self.prompt[r]
            assert self.ends[r] == (1 if st_ in ENDED else 0), (r, st_, self.ends[r])
        assert len(s.phase) == len(self.status)  # nothing else was ever submitted
        copying = self.copying
        for l in range(c.B):
            r = self.lane[l]
            assert s.busy[l] == (r is not None), l
            assert s.lane_snap[l] == self.snap[l], (l, s.lane_snap, self.snap)
            assert s.copying[l] == copying[l], l
            if r is None:
                continue
            assert self.status[r] in RUNNING  # ended requests hold no lane
            assert s.lane_req[l] == r and s.req_lane.get(r) == l
            table = self.tables[l]
            assert s.tail[l] == table[-1] and s.nblocks[l] == len(table), (l, s.tail, table)
            for x in table:
                assert s.owner_lane[x] == l and s.start[x] == self.start[x], (l, x, table)
                # a full block has its key already (taken at grow; an importing lane's when
                # its import lands)
                if x != table[-1] and self.status[r] != "importing":
                    key = self.seq[l][:self.start[x] + c.S]
                    assert (tuple(s.key[x]), tuple(s.head[x])) == (key, key[:c.C]), (l, x)
                    # and the lane's snapshots then
                    assert s.snap_upto[x] == self.filled_snap[x], (
                        f"lane {l}'s full block {x} has snapshots up to {s.snap_upto[x]}, the "
                        f"lane's when it filled were up to {self.filled_snap[x]}")
            assert s.length[l] == self.length[l]
            assert tuple(s.lane_seq[l]) == self.seq[l]
            assert s.lane_plen[l] == len(self.prompt[r])
            if self.copy_src[l] is not None:
                assert not s.copy_host[l] and s.copy_src[l] == self.copy_src[l], l
            if self.load_slot[l] is not None:
                assert s.copy_host[l] and s.copy_slot[l] == self.load_slot[l], l
        held = [r for r in self.lane if r is not None]
        assert len(held) == len(set(held))
        owners = [core.OWNER_NAMES[o] for o in s.owner]
        assert owners == self.owner, (owners, self.owner)
        for b, (key, snap) in self.entries.items():
            assert (tuple(s.key[b]), s.snap_upto[b]) == (key, snap), (b, key, snap)
            assert s.start[b] == self.start[b], (b, s.start[b], self.start[b])
            assert tuple(s.head[b]) == key[:c.C], b
        slots = [core.SLOTSTATE_NAMES[x] for x in s.slot_state]
        assert slots == self.slot_state, (slots, self.slot_state)
        for h in self.slots("STORING", "STORED", "LOADING"):
            assert tuple(s.slot_key[h]) == self.slot_key[h], h
            assert s.slot_start[h] == self.slot_start[h], (h, s.slot_start, self.slot_start)
            assert tuple(s.slot_head[h]) == self.slot_key[h][:c.C], h
        for h, b in self.slot_block.items():
            assert s.slot_block[h] == b and s.spill_slot[b] == h, (h, b)
        for h, l in self.slot_lane.items():
            assert s.load_lane[h] == l, (h, l)
        # PD: exactly the transferring lanes' blocks and the draining ones are in a transfer,
        # each for its own request; a block drains exactly while its ended request's transfer
        # has not ended.
        moving = {x: r for l, r in enumerate(self.lane)
                  if r is not None and self.status[r] in MOVING for x in self.tables[l]}
        for b in range(c.K):
            assert s.transfer[b] == (b in moving or b in self.draining), (b, moving,
                                                                           self.draining)
            if s.transfer[b]:
                assert s.transfer_req[b] == self.draining.get(b, moving.get(b)), b


# ------------------------------------------------------------------------------- machine

# The rules that take PD actions (make_machine(pd=False) drops them).
PD_RULES = {"admit_import", "pd_flow", "late_pd_event"}
# The rules that preempt with drawn parameters or storm (make_machine(preempt=False) drops
# them: a machine without them draws its steps as before they existed).
PREEMPT_MACHINE_RULES = {"preempt", "storm"}


def _to_committed(e: Any) -> Any:
    """An effect of a loaded variant core as the committed core's class (Policy.observe
    dispatches on the committed classes)."""
    cls = committed.EFFECTS.get(type(e).__name__.lower())
    return cls(*e) if cls is not None and cls._fields == e._fields else e


def make_machine(core: Any = committed, config: st.SearchStrategy[Any] | None = None, *,
                 mirror: bool = True, mirror_core: Any = None, check_progress: bool = True,
                 focus: set[str] | None = None, pd: bool = True,
                 preempt: bool = False) -> type[RuleBasedStateMachine]:
    """A state machine over `core` (ghost on), configurations drawn from `config`.

    mirror: apply each step to a ghost-off state too (of `mirror_core`, default `core`) and
    compare non-ghost fields. check_progress: assert progress whenever the state is
    quiescent (no copy or load in flight, no block draining, no store in flight) and K is at
    least the proved minimum. focus: keep only these rules (a focused search with the same
    rules and checks). pd: take the PD actions too (colocated serving never does): the PD
    rules (PD_RULES), and PD steps among `advance`'s moves. The tiers' rules (`hybrid_flow`,
    `host_flow`) only run in configurations with that tier. preempt: take the preemption rules
    (PREEMPT_MACHINE_RULES: drawn preemptions, `storm` with PREEMPT only); whatever it is, the
    policy's preemptions are taken in configurations with PREEMPT.
    """
    config = config if config is not None else st.one_of(
        *(configs(core, p, s) for p, s in FEATURES))
    mcore = mirror_core or core
    plain = [f for f in core.STATE_FIELDS if f not in core.GHOST_FIELDS]
    convert = (lambda e: e) if core is committed else _to_committed

    class CoreMachine(RuleBasedStateMachine):
        @initialize(c=config)
        def setup(self, c: Any) -> None:
            self.c = c
            self.s = core.init(c, True)
            self.s2 = mcore.init(mcore.Consts(**attrs.asdict(c)), False) if mirror else None
            self.policy = Policy()
            self.life = Life(c)
            self.diverged = False  # the core's state differs from the lifecycle model's
            self.next_id = 0
            scratch = "reserved" if c.RESERVED else "dynamic"
            self.at_capacity = c.K >= min_blocks(c.B, c.PREFIX, scratch, c.T, c.PREEMPT)
            assert core.check_axioms(c) == []
            assert core.check_invariants(self.s) == []

        # helpers ---------------------------------------------------------------
        def admission_room(self) -> bool:
            """The spec's `admission_room`: an idle lane can always admit (at capacity), with
            preemption only when no lane is busy (the others may hold every block)."""
            return not self.c.PREEMPT or not any(self.s.busy)

        def quiescent(self) -> bool:
            """The spec's `quiescent`: no copy or load in flight, no block draining and no
            store to the host tier in flight."""
            return (not any(self.s.copying) and core.OWNER_DRAINING not in self.s.owner
                    and core.SLOTSTATE_STORING not in self.s.slot_state)

        def apply(self, name: str, *args: Any) -> Any:
            """Run one action on the core and check everything about the step."""
            act, guard, _, _ = core.ACTIONS[name]
            Stats.calls += 1
            pre = self.s
            expect = self.life.predict(name, args)
            out = act(pre, *args)
            if out.rejected is None:
                post = out.state
                try:
                    bad = core.check_invariants(post)
                except Exception as exc:  # a checker must report, not crash
                    raise InvariantViolation("checker crash", [f"{CRASH}: {exc!r}"], name, args,
                                             core, pre, post) from exc
                if bad:
                    raise InvariantViolation("invariant", bad, name, args, core, pre, post)
                bad = core.check_transition(pre, post)
                if bad:
                    raise InvariantViolation("transition invariant", bad, name, args, core,
                                             pre, post)
            assert guard(pre, *args) == out.rejected, (name, args)
            plan = getattr(core, f"{name}_plan", None)
            if plan is not None:  # the effects the action would have, or the guard
                assert plan(pre, *args) == (out.effects if out.rejected is None
                                            else out.rejected), (name, args)
            if out.rejected != expect:
                raise LifecycleDivergence(name, args, expect, out.rejected)
            if out.rejected is None:
                Stats.applied[name] += 1
                self.s = out.state
                self.policy.observe(convert(e) for e in out.effects)
                self.life.apply(name, args, out.effects, pre)
            else:
                Stats.rejected[name, out.rejected] += 1
                assert out.state is pre and out.effects == ()
                if (out.rejected == "no_block_overflow" and self.c.T > 1
                        and any(map(self.life.table_end, range(self.c.B)))):
                    Stats.events["decode refused at a full table"] += 1
            try:
                self.life.compare(core, self.s)
            except AssertionError as exc:
                self.diverged = True
                raise ModelDivergence(name, args, str(exc)) from exc
            if mirror:
                self.mirror(name, args, out)
            if check_progress and self.at_capacity and self.quiescent():
                stuck = core.progress_violations(self.s)
                if stuck:
                    raise ProgressViolation(stuck, name, args, core, self.s)
            return out

        def mirror(self, name: str, args: tuple[Any, ...], out: Any) -> None:
            pre2 = self.s2
            out2 = mcore.ACTIONS[name][0](pre2, *args)
            if out2.rejected != out.rejected:
                raise MirrorDivergence("rejected", name, args, out.rejected, out2.rejected)
            if tuple(map(tuple, out2.effects)) != tuple(map(tuple, out.effects)):
                raise MirrorDivergence("effects", name, args, out.effects, out2.effects)
            if out2.rejected is not None:
                assert out2.state is pre2
                return
            s2 = self.s2 = out2.state
            assert all(getattr(s2, f) is None for f in mcore.GHOST_FIELDS)
            for f in plain:
                if getattr(s2, f) != getattr(self.s, f):
                    raise MirrorDivergence(f, name, args, getattr(self.s, f), getattr(s2, f))
            assert mcore.check_invariants(s2) == []
            assert mcore.check_transition(pre2, s2) == []

        def lanes(self, data: Any, pred: Any) -> int:
            """A lane, from those satisfying `pred` when there are any."""
            good = [l for l in range(self.c.B) if pred(l)]
            if good and num(data, 0, 3, "any lane (0)"):
                return pick(data, good, "lane")
            return num(data, 0, self.c.B - 1, "lane")

        def any_request(self, data: Any) -> int:
            """A known request id (any phase) or one never submitted."""
            ids = sorted(self.life.status) + [self.next_id + 7]
            return pick(data, ids, "request")

        def waiting(self) -> list[int]:
            return sorted(r for r, x in self.life.status.items() if x == "waiting")

        def decode_tokens(self, data: Any) -> tuple[int, ...]:
            return tuple(data.draw(_token_lists(self.c.B, self.c.B),
                                   label="tokens"))

        # rules: the natural workload -----------------------------------------------
        @rule(data=st.data())
        def submit(self, data: Any) -> None:
            self.new_request(data)

        def new_request(self, data: Any, host: bool = False, short: bool = False) -> None:
            """A fresh prompt, or (multi-turn) a prefix of an earlier prompt or cache key
            (device or host) with a new tail, so deep prefix hits happen. host: a prompt
            that shares at least a chunk with a host entry, when there is one. Hybrid: often
            the next turn of a cached conversation (its whole key, generated tokens too), which
            matches further than the snapshots (taken over the prompt) reach. Paged tables:
            often the next turn of a conversation cached past its first block (the whole key
            of a later block's entry: the prefix up to its end), so that a hit goes on past
            the first block (`grow_hit`). short: a prompt that fits one block, else up to
            T * S - 1 tokens."""
            s, c = self.s, self.c
            m = c.S - 1 if short else c.T * c.S - 1
            stored = sorted({tuple(s.slot_key[h]) for h in range(c.H)
                             if s.slot_state[h] != core.SLOTSTATE_EMPTY})
            if host and stored:
                base = pick(data, stored, "host key")
                k = num(data, min(c.C, len(base)), len(base), "keep")
                p = seq((base[:k] + tuple(data.draw(_token_lists(1, m), label="tail")))[:m])
            else:
                cached = sorted(set(stored) | {tuple(s.key[b]) for b in range(c.K)
                                               if s.owner[b] == core.OWNER_CACHE})
                earlier = sorted({tuple(p) for p in self.life.prompt.values()})
                how = num(data, 0, 2, "fresh, extend a cache key, extend an earlier prompt")
                # (a uniform draw among the keys rarely picks one past a first block, and a
                # uniform cut rarely keeps more than its first block)
                later = sorted({tuple(s.key[b]) for b in range(c.K) if s.start[b] > 0
                                and s.owner[b] == core.OWNER_CACHE}) if how == 1 else []
                if later and coin(data, "a later block's key"):
                    base = pick(data, later, "later block's key")
                else:
                    base = pick(data, cached, "cache key") if how == 1 and cached else (
                        pick(data, earlier, "earlier prompt") if how and earlier else None)
                if base:
                    whole = how == 1 and (c.HYBRID or c.T > 1) and coin(data, "next turn")
                    k = len(base) if whole else num(data, 1, len(base), "keep")
                    tail = data.draw(_token_lists(0, m), label="tail")
                    p = seq((base[:k] + tuple(tail))[:m])
                else:
                    p = data.draw(prompts(m), label="prompt")
            r = self.next_id
            self.next_id += 1
            assert self.apply("submit", r, p).rejected is None

        def admit_by_policy(self, r: int, data: Any = None) -> bool:
            """Admit r as the policy chooses; False if the policy declines. With the host tier
            (and data to draw from), often as the batcher does: a cache entry the admission
            would evict is spilled to the host first (`spill_by_policy`), then it chooses
            again."""
            choice = self.policy.admission(self.s, r)
            if choice is None:
                Stats.policy_idle += 1
                idle = [l for l in range(self.c.B) if not self.s.busy[l]]
                if idle and self.quiescent() and self.at_capacity and self.admission_room():
                    raise RefinementViolation("admission", f"refuses a quiescent admission "
                                              f"of {r}", core, self.s)
                return False
            # Refinement: the policy picks only what the spec allows.
            self.refine(choice.action, choice.args)
            dst = choice.args["dst"]
            if (data is not None and self.c.HOST and self.s.owner[dst] == core.OWNER_CACHE
                    and num(data, 0, 3, "spill the victim (>0)")
                    and self.spill_by_policy(data, dst)):
                return self.admit_by_policy(r, data)
            names = core.ACTIONS[choice.action][2]
            assert self.apply(choice.action, *(choice.args[k] for k in names)).rejected is None
            if choice.action == "admit_host_hit":
                Stats.events["policy host hit"] += 1
            return True

        def spill_by_policy(self, data: Any, b: int) -> bool:
            """Store cache entry b into the slot the policy picks (evicting the least recently
            used host entry when every slot is full); the store then lands, fails or stays in
            flight (without data: it lands, as the batcher's stores do). False if the policy
            keeps no copy of b."""
            place = self.policy.spill_slot(self.s, b)
            if place is None:
                return False
            h, evict = place
            # Refinement: the policy's slot (after its eviction) takes b.
            if evict:
                self.refine("host_evict", {"h": h})
                assert self.apply("host_evict", h).rejected is None
            self.refine("spill", {"b": b, "h": h})
            assert self.apply("spill", b, h).rejected is None
            how = "done" if data is None else pick(data, ("done", "fail", "in flight"), "store")
            if how == "in flight":
                self.busy_store(data, h)
            else:
                assert self.apply(f"store_{how}", h).rejected is None
            Stats.events["policy spill"] += 1
            return True

        def complete_copy(self, data: Any, l: int) -> Any:
            """The copy into lane l lands (copy_done), or its load lands or fails."""
            if self.life.load_slot[l] is None:
                return self.apply("copy_done", l)
            return self.apply("load_fail" if num(data, 0, 2, "load fails (0)") == 0
                              else "load_done", l)

        def refine(self, action: str, args: dict[str, Any]) -> None:
            """The policy's choice is a step the spec allows."""
            why = core.ACTIONS[action][1](self.s, **args)
            if why is not None:
                raise RefinementViolation(action, f"chose {args}, refused by {why}", core,
                                          self.s)

        def decode_by_policy(self, toks: tuple[int, ...], data: Any = None,
                             preempt: bool = True) -> Any:
            """A decode call with the policy's padding target. With preemption (and
            `preempt`), as the adapter does: when there is no padding target (every block
            held), the policy's victim is preempted (`preempt_by_policy`) and the call is made
            again, while some lane decodes."""
            pad, lpad = self.policy.pad(self.s), self.policy.local_pad(self.s)
            why = core.decode_guard(self.s, pad, lpad, toks)
            if why == "scratch_target_ok":
                # Refinement the other way: the policy found no target, so none exists
                # (every block is a lane's, pinned by a copy, draining or spilling).
                ok = [b for b in range(self.c.K)
                      if core.decode_guard(self.s, b, lpad, toks) in (None, "local_pad_ok")]
                if ok:
                    raise RefinementViolation("decode", f"missed the scratch targets {ok}",
                                              core, self.s)
            if why == "local_pad_ok":
                # ... and no local slot may take the padding rows (every lane is busy)
                ok = [x for x in range(self.c.B)
                      if core.decode_guard(self.s, pad, x, toks) is None]
                if ok:
                    raise RefinementViolation("decode", f"missed the idle local slots {ok}",
                                              core, self.s)
                Stats.events["decode waits for an idle local slot"] += 1
            out = self.apply("decode", pad, lpad, toks)
            if (out.rejected == "scratch_target_ok" and preempt and self.c.PREEMPT
                    and self.preempt_by_policy(data, "padding target") is not None
                    and any(map(self.life.decoding, range(self.c.B)))):
                return self.decode_by_policy(toks, data, preempt)
            return out

        def preempt_by_policy(self, data: Any = None, why: str = "") -> int | None:
            """Preempt the policy's victim (`Policy.victim`), as the adapter does when a lane
            waits for a block (`why`) and none is reusable; None if the policy finds none.
            Refinement: the victim passes the guard, the policy finds one whenever the spec
            accepts any, and with several busy lanes the oldest-admitted one is the victim only
            when no other lane may be. With data, often a call that must be refused first
            (`refuse_preempt`)."""
            life, c = self.life, self.c
            victim = self.policy.victim(self.s)
            ok = [l for l in range(c.B) if core.preempt_guard(self.s, l) is None]
            if victim is None:
                if ok:
                    raise RefinementViolation("preempt", f"no victim, the spec accepts {ok}",
                                              core, self.s)
                return None
            self.refine("preempt", {"l": victim})
            busy = [l for l in range(c.B) if life.lane[l] is not None]
            if len(busy) > 1 and victim == life.oldest():
                if ok != [victim]:
                    raise RefinementViolation("preempt", f"preempts the oldest lane {victim} "
                                              f"(the spec accepts {ok})", core, self.s)
                Stats.events["oldest lane preempted: the only choice"] += 1
            if data is None or num(data, 0, 2, "refused first (0)") == 0:
                self.refuse_preempt(data)
            if len(busy) == c.B > 1 and all(life.computing(l) and life.tail_full(l)
                                            for l in busy):
                Stats.events["preempt storm: every lane at a block boundary"] += 1
            Stats.events[f"preempt for a {why}"] += 1
            if life.needs_block(victim):
                Stats.events["victim is a lane that waits"] += 1
            assert self.apply("preempt", victim).rejected is None
            return victim

        def refuse_preempt(self, data: Any) -> None:
            """Before the policy's preemption: preempting an idle or copying lane, or one whose
            sequence would not fit a prompt, must be refused (without data: the first lane
            whose sequence would not fit, if any)."""
            life, c = self.life, self.c
            calls = [(l, "requeue_fits") for l in range(c.B)
                     if life.computing(l) and len(life.seq[l]) > c.T * c.S]
            if data is None:
                if calls:
                    assert self.apply("preempt", calls[0][0]).rejected == "requeue_fits"
                return
            calls += [(l, "lane_computing") for l in range(c.B) if not life.computing(l)]
            if calls:
                l, expect = pick(data, calls, "refused preempt")
                assert self.apply("preempt", l).rejected == expect, (l, expect)

        def grow_by_policy(self, data: Any = None, preempt: bool = True) -> bool:
            """As the adapter does before each prefill or decode call: every lane the policy
            says needs its next block (`Policy.growth`, the oldest first) gets it: with the host
            tier, loaded from a host entry when `Policy.next_host_hit` finds a longer one than
            the device hit (`grow_host_hit_by_policy`, after spilling the entry in the block it
            takes, as the batcher does); else copied from a cache entry when `Policy.next_hit`
            finds one and a block besides it (`grow_hit_by_policy`), else the block
            `Policy.reusable` picks (`grow`); with
            preemption (and `preempt`), when there is none, the policy's victims are preempted
            (`preempt_by_policy`) until there is one or the lane itself is gone. A lane whose
            hit filled its next block (its copy landed) needs another one: it grows again, as
            the adapter's loop takes the oldest lane first. An importing lane whose table does
            not cover its prompt gets its next block too (`import_grow_by_policy`, preempting
            likewise). Refinement: the policy's lanes are exactly those the lifecycle model says
            need a block (in admission order; importing lanes short of their prompt too), its
            block and hit are ones the spec accepts, and it finds a block whenever the spec
            would accept any, and the longest hit. With data, often a call that must be
            refused first (`refuse_full_tail`). False if some lane gets none (a copy pins the
            only candidate, a block drains, or K is below the capacity rule)."""
            life, c = self.life, self.c
            lanes = self.policy.growth(self.s)
            need = sorted((l for l in range(c.B)
                           if life.needs_block(l) or life.needs_import_block(l)),
                          key=life.admitted.__getitem__)
            if sorted(lanes) != sorted(need) or (c.PREEMPT and lanes != need):
                raise RefinementViolation("grow", f"grows lanes {lanes}, the lifecycle model "
                                          f"says {need} (oldest first)", core, self.s)
            for l in lanes:
                if life.importing(l):
                    if not self.import_grow_by_policy(data, l, preempt):
                        return False
                    continue
                # (not a lane preempted to make room for an older lane; a lane whose copy is
                # in flight grows once it lands)
                while life.needs_block(l):
                    self.refine_grow(l)
                    if data is not None and num(data, 0, 2, "refused first (0)") == 0:
                        self.refuse_full_tail(data, l)
                    if c.HOST and self.grow_host_hit_by_policy(data, l):
                        continue
                    if self.grow_hit_by_policy(data, l):
                        continue
                    dst = self.policy.reusable(self.s)
                    while (dst is None and preempt and c.PREEMPT
                           and self.preempt_by_policy(data, "next block") is not None
                           and life.needs_block(l)):
                        dst = self.policy.reusable(self.s)
                    if not life.needs_block(l):
                        continue  # it was the victim itself
                    if c.PREEMPT and dst is not None and (data is None or num(
                            data, 0, 3, "preempt refused first (0)") == 0):
                        # never while a block is free (the lane waiting for it, the first one
                        # every other guard accepts)
                        assert self.apply("preempt", l).rejected == "no_block_reusable"
                    if dst is None:
                        ok = [b for b in range(c.K) if core.grow_guard(self.s, l, b) is None]
                        if ok or (self.quiescent() and self.at_capacity
                                  and (preempt or not c.PREEMPT)):
                            raise RefinementViolation("grow", f"no block for lane {l} (the "
                                                      f"spec accepts {ok})", core, self.s)
                        Stats.events["grow waits for a block"] += 1
                        return False
                    self.refine("grow", {"l": l, "dst": dst})
                    assert self.apply("grow", l, dst).rejected is None
            return True

        def refine_grow(self, l: int) -> None:
            """Refinement: the batcher's choice for lane l's next block (`Policy.grow`: a
            block, a hit, a victim to preempt) is a step the spec allows."""
            choice = self.policy.grow(self.s, l)
            if choice is not None:
                self.refine(choice.action, choice.args)

        def import_grow_by_policy(self, data: Any, l: int, preempt: bool = True) -> bool:
            """Importing lane l's table grows until it covers the prompt (`import_grow`, the
            block `Policy.reusable` picks), as the adapter does before it asks for the KV; with
            preemption (and `preempt`), when there is none, the policy's victims are preempted
            (`preempt_by_policy`: computing lanes, never l, which computes nothing) until there
            is one. With data, often an import_done first, refused while the table is short
            (even with the whole prompt: `table_covers_prompt`), or a grow into a block it may
            not take. Refinement: it finds a block whenever the spec would accept any, and
            (quiescent, at capacity) waits only where the spec lets it: with preemption, for
            another lane's transfer in flight or a lane at its table's end (`import_may_wait`).
            False if it gets none (a copy pins the only candidate, a block drains, such a wait,
            or K is below the capacity rule)."""
            life, c = self.life, self.c
            while life.needs_import_block(l):
                self.refine_grow(l)
                if data is not None and num(data, 0, 3, "refused first (0)") == 0:
                    self.refuse_short_import(data, l)
                dst = self.policy.reusable(self.s)
                # (the event preempt_by_policy counts is IMPORT_BLOCK_PREEMPTED)
                while (dst is None and preempt and c.PREEMPT
                       and self.preempt_by_policy(data, "block of an import") is not None):
                    dst = self.policy.reusable(self.s)
                if dst is None:
                    ok = [b for b in range(c.K) if core.import_grow_guard(self.s, l, b) is None]
                    if ok or (self.quiescent() and self.at_capacity and (preempt or not c.PREEMPT)
                              and not self.import_may_wait(l)):
                        raise RefinementViolation("import_grow", f"no block for lane {l} (the "
                                                  f"spec accepts {ok})", core, self.s)
                    Stats.events["import_grow waits for a block"] += 1
                    return False
                self.refine("import_grow", {"l": l, "dst": dst})
                assert self.apply("import_grow", l, dst).rejected is None
            return True

        def import_may_wait(self, l: int) -> bool:
            """With preemption, importing lane l may wait for its next block though no block is
            reusable and no lane can be preempted (`import_table_grows`): another lane's
            transfer is in flight (its blocks free, or it decodes and can be preempted, when it
            ends), or a lane at its table's end must finish first (its blocks free then)."""
            life = self.life
            return self.c.PREEMPT and any(
                x != l and (life.transfer_in_flight(x) or life.table_end(x))
                for x in range(self.c.B))

        def refuse_short_import(self, data: Any, l: int) -> None:
            """Importing lane l's table does not cover its prompt: its import_done (even with
            the whole prompt) is refused, and (with data) a grow into a block it may not take
            (a lane's, its own included, the scratch block, a pinned, draining or spilling
            one)."""
            life, c = self.life, self.c
            r = life.lane[l]
            tok = ALPHABET[0] if data is None else data.draw(tokens, label="first token")
            out = self.apply("import_done", r, seq(life.prompt[r]), tok)
            assert out.rejected == "table_covers_prompt", out.rejected
            Stats.events[IMPORT_SHORT] += 1
            if data is not None:
                bad = [b for b in range(c.K) if not life.reusable(b)]  # (its own blocks)
                dst = pick(data, bad, "dst")
                assert self.apply("import_grow", l, dst).rejected == "dst_reusable", dst

        def grow_hit_by_policy(self, data: Any, l: int) -> bool:
            """Lane l needs its next block: when `Policy.next_hit` finds a cached continuation
            of its prompt and `Policy.reusable` a block besides its source, the block is
            copied from it (`grow_hit`), as the adapter does; the copy lands at once (the
            adapter's way: without data, or most draws) or stays in flight. Refinement: the
            hit passes the guard, and it is the longest the spec accepts (`longest_hits`: a
            hit is worth a block of prefill compute; hybrid: no further than the entry's
            snapshots, where `Policy.next_hit` caps it). False if the lane is to take a plain
            block: no hit, or no block but the hit's source (the adapter then grows into
            whatever `reusable` picks, evicting the source)."""
            hit = self.policy.next_hit(self.s, l)
            longest = self.longest_hits(l)
            if (hit is None) != (not longest) or hit is not None and hit not in longest:
                raise RefinementViolation("grow_hit", f"lane {l}'s next hit is {hit}, the "
                                          f"longest the spec accepts {longest}", core, self.s)
            if self.c.HYBRID and any(x == l for x, _, _ in self.later_hits_past_snapshot()):
                # an entry goes on as the prompt does further than its snapshots reach: the
                # policy's hit (checked above) stops at them, or there is none
                Stats.events[SNAPSHOT_CAP] += 1
            if hit is None:
                return False
            src, n = hit
            dst = self.policy.reusable(self.s, exclude=src)
            if dst is None:
                Stats.events["hit given up: no block but its source"] += 1
                return False
            self.refine("grow_hit", {"l": l, "src": src, "dst": dst, "n": n})
            assert self.apply("grow_hit", l, src, dst, n).rejected is None
            if data is None or num(data, 0, 3, "copy in flight (0)"):
                assert self.apply("copy_done", l).rejected is None
            return True

        def grow_host_hit_by_policy(self, data: Any, l: int) -> bool:
            """Host tier: lane l needs its next block, taken as the batcher takes it (its
            `_grow`): first the block `Policy.reusable` picks besides the device hit's source
            (`Policy.next_hit`), a cache entry there spilled to the host first
            (`spill_by_policy`: always without data, else often; a store may then stay in
            flight, pinning that block: another is picked); then, when `Policy.next_host_hit`
            finds a host entry that goes on as the prompt does, longer than the device hit, the
            block is loaded from it (`grow_host_hit`). The load lands (without data, but for
            the first of a run, which fails: so that coverage does not hang on the draws),
            fails (the lane recomputes that block only) or stays in flight (`busy_copy`).
            Refinement: the host hit passes the guard, and it is the longest the spec accepts
            (`longest_host_hits`). False if the lane is to take the device hit or a plain block
            (or there is no block: the caller finds none either)."""
            hit = self.policy.next_hit(self.s, l)
            while True:
                dst = self.policy.reusable(self.s, exclude=None if hit is None else hit[0])
                if dst is None and hit is not None:  # the hit's source is the only block left
                    hit = None
                    continue
                if (dst is None or self.s.owner[dst] != core.OWNER_CACHE
                        or data is not None and num(data, 0, 3, "spill it first (>0)") == 0
                        or not self.spill_by_policy(data, dst)):
                    break
            host = self.policy.next_host_hit(self.s, l)
            longest = self.longest_host_hits(l)
            if (host is None) != (not longest) or host is not None and host not in longest:
                raise RefinementViolation("grow_host_hit", f"lane {l}'s next host hit is "
                                          f"{host}, the longest the spec accepts {longest}",
                                          core, self.s)
            if not prefer_host(hit, host):  # (the one rule, admission's too)
                if host is not None:
                    Stats.events["host hit shorter than the device hit"] += 1
                return False
            if dst is None:
                return False
            assert host is not None
            h, n = host
            self.refine("grow_host_hit", {"l": l, "h": h, "dst": dst, "n": n})
            assert self.apply("grow_host_hit", l, h, dst, n).rejected is None
            Stats.events["policy host hit past the first block"] += 1
            if data is None:
                how = 2 if Stats.events[LATER_LOAD_FAILED] else 0
            else:
                how = num(data, 0, 4, "load: fails, in flight, lands")
            if how == 1:
                self.busy_copy(data, l)
            else:
                assert self.apply("load_done" if how else "load_fail", l).rejected is None
            return True

        def longest_host_hits(self, l: int) -> list[tuple[int, int]]:
            """The (slot, n) of the longest host hits past the first block the spec accepts for
            lane l (any dst: with lane l's own tail, never reusable, `grow_host_hit`'s guard
            reports dst_reusable, its last, exactly when every guard before it holds)."""
            c = self.c
            ok = [(h, n) for h in range(c.H) for n in range(c.C, c.S + 1, c.C)
                  if core.grow_host_hit_guard(self.s, l, h, self.s.tail[l], n) == "dst_reusable"]
            top = max((n for _, n in ok), default=0)
            return [(h, n) for h, n in ok if n == top]

        def longest_hits(self, l: int) -> list[tuple[int, int]]:
            """The (src, n) of the longest hits past the first block the spec accepts for lane
            l (any dst: `grow_hit`'s guard reports dst_not_src, its second to last, for
            dst == src exactly when every guard before it holds, hybrid_snapshot_at_n too)."""
            c = self.c
            ok = [(src, n) for src in range(c.K) for n in range(c.C, c.S + 1, c.C)
                  if core.grow_hit_guard(self.s, l, src, src, n) == "dst_not_src"]
            top = max((n for _, n in ok), default=0)
            return [(src, n) for src, n in ok if n == top]

        def refuse_full_tail(self, data: Any, l: int) -> None:
            """Lane l's tail is full: before it grows, its next prefill chunk (or any decode
            call), a grow into a block it may not take (a lane's, the scratch block, a pinned,
            draining or spilling one) or, at the table end, any grow must be refused."""
            life, c = self.life, self.c
            bad = [b for b in range(c.K) if not life.reusable(b)]
            calls = []
            if len(life.tables[l]) == c.T:
                dst = self.policy.reusable(self.s)
                calls.append(("grow", (l, 0 if dst is None else dst), "table_not_full"))
            elif bad:
                calls.append(("grow", (l, pick(data, bad, "dst")), "dst_reusable"))
            if life.prefilling(l):
                calls.append(("prefill", (l, 1), "chunk_within_block"))
            else:
                calls.append(("decode", (0, 0, self.decode_tokens(data)), "no_block_overflow"))
            call, args, expect = pick(data, calls, "refused")
            assert self.apply(call, *args).rejected == expect, (call, args, expect)

        def refuse_later_hit(self, data: Any, r: int) -> None:
            """Waiting r's prefix matches a cache entry that starts later in its sequence: a
            hit on it is refused (src_first_block). Without data, the first such entry."""
            c = self.c
            later = [(src, n) for x, src, n in self.hits_on_later_blocks() if x == r]
            idle = [l for l in range(c.B) if not self.s.busy[l]]
            if later and idle:
                src, n = later[0] if data is None else pick(data, later, "entry, n")
                dst = self.policy.reusable(self.s, exclude=src)
                args = (idle[0], r, src, (src + 1) % c.K if dst is None else dst, n)
                assert self.apply("admit_hit", *args).rejected == "src_first_block"

        def finish_full(self, data: Any, decoding: list[int]) -> bool:
            """After a refused decode call: finish a lane that must (its table is full, or it
            waits for a block; often after a grow, refused at the table end); False if there
            is none (the refusal was the padding target)."""
            life = self.life
            full = [l for l in decoding if life.decoding(l) and life.tail_full(l)]
            if not full:
                return False
            if life.table_end(full[0]) and num(data, 0, 2, "grow first (0)") == 0:
                self.refuse_full_tail(data, full[0])
            self.apply("finish", full[0], coin(data, "keep"))  # keep: refused without the cache
            return True

        @precondition(lambda self: self.waiting())
        @rule(data=st.data())
        def admit(self, data: Any) -> None:
            r = pick(data, self.waiting(), "request")
            if self.c.T > 1 and self.c.PREFIX:
                how = num(data, 0, 2, "plain, a later block first, a miss beside one")
                if how == 1:
                    self.refuse_later_hit(data, r)
                elif how == 2 and self.miss_beside_later_block(data):
                    return
            self.admit_by_policy(r)

        def miss_beside_later_block(self, data: Any = None) -> bool:
            """A miss beside an entry that starts later in its sequence (a full block of a
            cached table, or a tail after one) and shares the prompt's first chunk: the
            entries that start a sequence with that chunk are discarded, a prompt with it is
            submitted, a hit on the later entry is refused (src_first_block) and the policy
            admits it: a miss, which the later entry must not block (no hit can use it).
            Without data, the first such entry and a one-token tail. False if there is no such
            entry or no idle lane (or an entry to discard is pinned)."""
            s, c = self.s, self.c
            later = [b for b in range(c.K)
                     if s.owner[b] == core.OWNER_CACHE and s.start[b] != 0]
            if not later or all(s.busy) or "discard" not in core.ACTIONS:
                return False
            head = tuple(s.key[later[0] if data is None else pick(data, later, "entry")][:c.C])
            firsts = [b for b in range(c.K) if s.owner[b] == core.OWNER_CACHE
                      and s.start[b] == 0 and tuple(s.head[b]) == head]
            if any(self.life.pinned(b) for b in firsts):
                return False
            for b in firsts:
                assert self.apply("discard", b).rejected is None
            tail = ((ALPHABET[0],) if data is None
                    else data.draw(_token_lists(1, c.T * c.S - 1 - c.C), label="tail"))
            r = self.next_id
            assert self.apply("submit", r, seq(head + tuple(tail))).rejected is None
            self.next_id += 1
            self.refuse_later_hit(data, r)
            if self.admit_by_policy(r):  # (no block yet while a copy or a drain runs)
                l = self.life.lane.index(r)
                # (no device hit; a host entry of a first block may still hit: a load)
                assert self.life.status[r] == "prefill" and self.life.copy_src[l] is None, r
            return True

        @rule(data=st.data(), k=st.integers(1, 16))
        def advance(self, data: Any, k: int) -> None:
            """Up to k productive steps, as a scheduler would take them: admit (with the host
            tier, often spilling the entry the admission evicts first), complete a copy or a
            load, prefill (hybrid: then a snapshot at a boundary, as the policy takes them),
            snapshot a lane at its next boundary, decode (policy pad) or finish, with paged
            tables and the prefix cache a conversation's turn (`turn`), whichever the draw
            picks, growing the lanes whose tail is full before each prefill or decode (as
            the adapter does; a decode refused at a full table finishes that lane); with pd,
            also a PD step (`pd_step`: import, export, end a transfer or a drain); with the
            host tier, a host step (`host_step`)."""
            for _ in range(k):
                life, c = self.life, self.c
                moves = []
                if self.waiting() and None in life.lane:
                    moves.append("admit")
                if any(life.copying):
                    moves.append("copy_done")  # or a load's end
                prefilling = [l for l in range(c.B) if life.lane[l] is not None
                              and life.status[life.lane[l]] == "prefill" and not life.copying[l]]
                if prefilling:
                    moves.append("prefill")
                decoding = [l for l in range(c.B) if life.decoding(l)]
                if decoding:
                    moves += ["decode", "decode", "finish"]
                if pd and (life.draining or life.in_phase(*MOVING) or moves and moves[0] == "admit"
                           or any(map(life.prefilled, range(c.B)))):
                    moves.append("pd")
                if c.HOST and (life.entries or life.slots("STORING", "STORED", "LOADING")):
                    moves.append("host")
                if any(map(life.snapshot_ok, range(c.B))):
                    moves.append("snapshot")  # e.g. a decoding lane at a chunk boundary
                if c.T > 1 and c.PREFIX and None in life.lane:
                    moves.append("turn")  # a conversation's turn: hits past the first block
                if not moves:
                    return
                move = pick(data, moves, "move")
                if move == "admit":
                    r = pick(data, self.waiting(), "request")
                    if c.T > 1 and c.PREFIX and num(data, 0, 2, "a later block first (0)") == 0:
                        self.refuse_later_hit(data, r)
                    if not self.admit_by_policy(r, data):
                        return
                elif move == "copy_done":
                    self.complete_copy(data, life.copying.index(True))
                elif move == "prefill":
                    l = pick(data, prefilling, "lane")
                    if not self.grow_by_policy(data) and life.needs_block(l):
                        return  # no block until a copy lands or a drain ends
                    if not life.prefilling(l) or life.copying[l]:
                        continue  # preempted to make room for an older lane, or its hit's
                        # copy is in flight
                    self.apply("prefill", l, data.draw(tokens, label="tok"))
                    # hybrid: a snapshot at each boundary of the prompt, as the policy takes
                    # them (a failed fetch skips one: that lane then has no later snapshot)
                    if self.policy.snapshot(self.s, l) and num(data, 0, 7, "skip (0)"):
                        assert self.apply("snapshot", l).rejected is None
                elif move == "snapshot":
                    l = pick(data, [l for l in range(c.B) if life.snapshot_ok(l)], "lane")
                    assert self.apply("snapshot", l).rejected is None
                elif move == "host":
                    self.host_step(data, feed=False)
                elif move == "decode":
                    self.grow_by_policy(data)
                    if not any(map(life.decoding, range(c.B))):
                        continue  # every decoding lane was preempted to make room
                    if self.decode_by_policy(self.decode_tokens(data),
                                             data).rejected is not None:
                        if not self.finish_full(data, decoding):
                            return  # no scratch target until a prefill or copy completes
                elif move == "pd":
                    if not self.pd_step(data, feed=False):
                        return
                elif move == "turn":
                    if not self.turn(data):
                        return
                else:
                    l = pick(data, decoding, "lane")
                    self.apply("finish", l, coin(data, "keep"))

        # rules: single actions, arbitrary parameters ----------------------------------
        def block(self, data: Any, label: str, *prefer: int) -> int:
            """Any block, often an interesting one: `prefer`, a copy source, a lane's block,
            a cache entry, the reserved scratch block, a draining or a spilling one."""
            s, c = self.s, self.c
            special = set(prefer) | {s.copy_src[l] for l in range(c.B) if s.copying[l]}
            special |= {b for b in range(c.K)
                        if s.owner[b] in (core.OWNER_LANE, core.OWNER_CACHE,
                                          core.OWNER_DRAINING, core.OWNER_SPILLING)}
            special |= {c.SCRATCH} if c.RESERVED else set()
            how = num(data, 0, 2, f"{label}: any, preferred, special")
            if how == 1 and prefer:
                return pick(data, prefer, label)
            if how and special:
                return pick(data, sorted(special), label)
            return num(data, 0, c.K - 1, label)

        @rule(data=st.data())
        def admit_arbitrary(self, data: Any) -> None:
            """Admit with drawn parameters: rejected (nothing changes) or applied."""
            c = self.c
            w = self.waiting()
            later = self.hits_on_later_blocks() if c.T > 1 else []
            if later and num(data, 0, 2, "a later block (0)") == 0:
                # The prefix matches an entry that starts later in its sequence (a full block
                # of a table, or its tail): a hit copies into the first block, so refused.
                r, src, n = pick(data, later, "request, entry, n")
                l = self.lanes(data, lambda l: not self.s.busy[l])
                self.apply("admit_hit", l, r, src, self.block(data, "dst", src), n)
                return
            past = self.hits_past_snapshot() if c.HYBRID else []
            if past and num(data, 0, 2, "past the snapshots (0)") == 0:
                # Hybrid: the prefix matches further than the entry's snapshots reach: the
                # whole match (refused), or as far as the snapshots go (a legal hit).
                r, src, n = pick(data, past, "request, entry, n")
                n = pick(data, (n, self.s.snap_upto[src]), "n")
                l = self.lanes(data, lambda l: not self.s.busy[l])
                self.apply("admit_hit", l, r, src, self.block(data, "dst", src), n)
                return
            hits = [(r, h) for r in w if c.PREFIX
                    and (h := self.policy.best_hit(self.s, self.s.prompt.get(r)))]
            if hits and num(data, 0, 3, "near a hit (>0)"):
                # The policy's (src, n) for a hit, with any lane and dst and a nearby n.
                r, (src, n) = pick(data, hits, "request, hit")
                n = pick(data, (n, n - 1, n + 1, c.C, n + c.C), "n")
                l = self.lanes(data, lambda l: not self.s.busy[l])
                self.apply("admit_hit", l, r, src, self.block(data, "dst", src), n)
                return
            l = self.lanes(data, lambda l: not self.s.busy[l])
            r = pick(data, w, "request") if w and coin(data, "waiting") else self.any_request(data)
            if coin(data, "hit"):
                src = self.block(data, "src")
                dst = self.block(data, "dst", src)
                n = num(data, 0, c.T * c.S, "n")
                self.apply("admit_hit", l, r, src, dst, n)
            else:
                self.apply("admit_miss", l, r, self.block(data, "dst"))

        @rule(data=st.data())
        def copy_done(self, data: Any) -> None:
            """copy_done (or, host tier, load_done / load_fail) for a lane, often one copying:
            each is refused for the other kind of copy."""
            name = pick(data, ("copy_done", "load_done", "load_fail") if self.c.HOST
                        else ("copy_done",), "action")
            self.apply(name, self.lanes(data, lambda l: self.s.copying[l]))

        # rules: hybrid prefix cache ---------------------------------------------------
        @precondition(lambda self: self.c.HYBRID)
        @rule(data=st.data(), k=st.integers(1, 8))
        def hybrid_flow(self, data: Any, k: int) -> None:
            """Up to k hybrid steps (`hybrid_step`)."""
            for _ in range(k):
                if not self.hybrid_step(data):
                    return

        def hybrid_step(self, data: Any) -> bool:
            """One hybrid prefix cache step, whichever the draw picks among the possible ones:
            a snapshot of a lane at its next chunk boundary (accepted) or at a wrong time
            (refused: an idle, copying, importing or exporting lane, one short of its next
            boundary or past it, a boundary having been skipped); the next turn of a cached
            conversation (it matches further than the entry's snapshots reach); a hit past
            the snapshots (refused) or as deep as they go, at an admission or (paged tables)
            past the first block (`grow_hit`, from the entry at a lane's boundary); or to get
            there: submit, admit as the policy chooses, complete a copy, prefill (growing the
            lanes first, as the adapter does; snapshot as the policy does), decode (generated
            tokens have no snapshots) or finish into the cache. False if no step is
            possible."""
            life, c = self.life, self.c
            ready = [l for l in range(c.B) if life.snapshot_ok(l)]
            past = self.hits_past_snapshot()
            later_past = self.later_hits_past_snapshot()
            beyond = [b for b, (key, snap) in life.entries.items() if len(key) >= snap + c.C]
            waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
            prefilling = [l for l in range(c.B) if life.prefilling(l) and not life.copying[l]]
            decoding = [l for l in range(c.B) if life.decoding(l)]
            moves = ["snapshot"] * 3 if ready else []
            moves += ["bad_snapshot"]
            moves += ["past"] * 3 if past and idle else []
            moves += ["later_past"] * 3 if later_past else []
            moves += ["next_turn"] * 2 if beyond else []
            moves += ["submit"] if not waiting else []
            moves += ["admit"] * 2 if waiting and idle else []
            moves += ["copy_done"] if any(x is not None for x in life.copy_src) else []
            moves += ["prefill"] * 2 if prefilling else []
            moves += ["decode", "finish", "finish"] if decoding else []
            move = pick(data, moves, "hybrid move")
            if move == "snapshot":
                assert self.apply("snapshot", pick(data, ready, "lane")).rejected is None
            elif move == "bad_snapshot":
                l = self.lanes(data, lambda l: not life.snapshot_ok(l))
                ok = life.snapshot_ok(l)
                assert (self.apply("snapshot", l).rejected is None) == ok
            elif move == "past":
                r, src, n = pick(data, past, "request, entry, n")
                snap = self.s.snap_upto[src]
                if coin(data, "as deep as the snapshots go"):
                    n = snap  # 0: no snapshot at all (n_whole_chunks)
                dst = self.policy.reusable(self.s, exclude=src)
                dst = self.block(data, "dst", src) if dst is None else dst
                out = self.apply("admit_hit", pick(data, idle, "lane"), r, src, dst, n)
                if n > snap:  # every other guard holds
                    assert out.rejected == "hybrid_snapshot_at_n", out.rejected
            elif move == "later_past":
                l, src, n = pick(data, later_past, "lane, entry, n")
                upto = self.s.snap_upto[src] - life.length[l]
                if coin(data, "as deep as the snapshots go"):
                    n = upto  # <= 0: no snapshot past the boundary (n_whole_chunks)
                dst = self.policy.reusable(self.s, exclude=src)
                dst = self.block(data, "dst", src) if dst is None else dst
                out = self.apply("grow_hit", l, src, dst, n)
                if n > upto:  # every guard before it holds
                    assert out.rejected == "hybrid_snapshot_at_n", out.rejected
            elif move == "next_turn":
                key = life.entries[pick(data, beyond, "entry")][0]
                tail = data.draw(_token_lists(1, c.S), label="tail")
                p = seq((key + tuple(tail))[:c.T * c.S - 1])
                assert self.apply("submit", self.next_id, p).rejected is None
                self.next_id += 1
            elif move == "submit":
                self.new_request(data)
            elif move == "admit":
                self.admit_by_policy(pick(data, waiting, "request"), data)
            elif move == "copy_done":
                self.apply("copy_done", next(l for l in range(c.B)
                                             if life.copy_src[l] is not None))
            elif move == "prefill":
                l = pick(data, prefilling, "lane")
                if not self.grow_by_policy(data) and life.needs_block(l):
                    return False  # no block until a copy lands
                if not life.prefilling(l) or life.copying[l]:
                    return True  # its hit past the first block is being copied
                self.apply("prefill", l, data.draw(tokens))
                if self.policy.snapshot(self.s, l) and num(data, 0, 7, "skip (0)"):
                    assert self.apply("snapshot", l).rejected is None
            elif move == "decode":
                self.grow_by_policy(data)
                self.decode_by_policy(self.decode_tokens(data))
            else:
                self.apply("finish", pick(data, decoding, "lane"), True)
            return True

        @rule(data=st.data(), tok=tokens)
        def prefill(self, data: Any, tok: int) -> None:
            l = self.lanes(data, lambda l: self.life.lane[l] is not None
                           and self.life.status[self.life.lane[l]] == "prefill")
            self.apply("prefill", l, tok)

        @rule(data=st.data())
        def grow(self, data: Any) -> None:
            """grow with drawn parameters: a lane (often one whose tail is full, or one that
            needs its next block) and a block (often the policy's): applied, or refused by the
            guard the lifecycle model names."""
            life = self.life
            full = [life.computing, lambda l: life.lane[l] is not None and life.tail_full(l),
                    life.needs_block][num(data, 0, 2, "lane: computing, full tail, needs one")]
            l = self.lanes(data, full)
            dst = self.policy.reusable(self.s)
            self.apply("grow", l, self.block(data, "dst", *(() if dst is None else (dst,))))

        @precondition(lambda self: self.c.T > 1 and self.c.PREFIX)
        @rule(data=st.data())
        def grow_hit(self, data: Any) -> None:
            """grow_hit with drawn parameters (`drawn_grow_hit`), or with the host tier often
            grow_host_hit (`drawn_grow_host_hit`: one rule, so that the other tiers' machines
            draw as before it). Only with paged tables and the prefix cache: elsewhere every
            call is refused early (no entry to copy from, a table of one block; without the
            host tier no slot to name), which `foreign_tier_calls` shows at the end of each
            run."""
            self.drawn_hit_past_first_block(data)

        def drawn_grow_hit(self, data: Any, lane: int | None = None) -> None:
            """grow_hit with drawn parameters: a lane (often one that prefills and needs its
            next block, or one that prefills) and, often, the policy's hit for it
            (`Policy.next_hit`, into the block `Policy.reusable` picks besides its source:
            accepted, refinement); else (always for a given `lane`, which the caller grows as
            the policy does next) a call aimed at one guard: the calls `grow_hit_calls` makes
            are grouped by the guard the lifecycle model says refuses them (or none: a legal
            hit), and the group is drawn first, so that each guard that can refuse the lane
            now is as likely as any other."""
            life, s = self.life, self.s
            hit = None
            if lane is None:
                pred = pick(data, (lambda l: life.prefilling(l) and life.needs_block(l),
                                   life.prefilling, lambda l: life.lane[l] is not None),
                            "lane: needs a block, prefills, busy")
                lane = self.lanes(data, pred)
                hit = (self.policy.next_hit(s, lane)
                       if life.prefilling(lane) and life.needs_block(lane) else None)
            l = lane
            if hit is not None and num(data, 0, 2, "the policy's hit (>0)"):
                src, n = hit
                dst = self.policy.reusable(s, exclude=src)
                if dst is not None:
                    self.refine("grow_hit", {"l": l, "src": src, "dst": dst, "n": n})
                    assert self.apply("grow_hit", l, src, dst, n).rejected is None
                    return
            calls = self.grow_hit_calls(l)
            guard = pick(data, sorted(calls, key=lambda g: g or ""), "guard (None: accepted)")
            args = pick(data, calls[guard], "src, dst, n")
            assert self.apply("grow_hit", *args).rejected == guard, (args, guard)

        def grow_hit_calls(self, l: int) -> dict[str | None, list[tuple[int, int, int, int]]]:
            """grow_hit calls for lane l over every source, n (whole chunks up to past the
            block, 0, and 1) and dst (the policy's, the source itself, one no hit may take),
            by the guard the lifecycle model says refuses them (None: a legal hit)."""
            life, c, s = self.life, self.c, self.s
            taken = [b for b in range(c.K) if not life.reusable(b)]  # a lane's, pinned, ...
            calls: dict[str | None, list[tuple[int, int, int, int]]] = {}
            for src in range(c.K):
                dst = self.policy.reusable(s, exclude=src)
                dsts = {(src + 1) % c.K if dst is None else dst, src, *taken[:1]}
                for n in sorted({0, 1, *range(c.C, c.S + c.C + 1, c.C)}):
                    for d in sorted(dsts):
                        args = (l, src, d, n)
                        calls.setdefault(life.predict("grow_hit", args), []).append(args)
            return calls

        def drawn_grow_host_hit(self, data: Any, lane: int | None = None) -> None:
            """`drawn_grow_hit` from the host tier: a lane (often one that prefills and needs
            its next block) and, often, the policy's host hit for it (`Policy.next_host_hit`,
            into the block `Policy.reusable` picks: accepted, refinement; the load is then
            busy, `busy_copy`); else a call aimed at one guard (`grow_host_hit_calls`, grouped
            by the guard the lifecycle model says refuses them)."""
            life, s = self.life, self.s
            hit = None
            if lane is None:
                pred = pick(data, (lambda l: life.prefilling(l) and life.needs_block(l),
                                   life.prefilling, lambda l: life.lane[l] is not None),
                            "lane: needs a block, prefills, busy")
                lane = self.lanes(data, pred)
                hit = (self.policy.next_host_hit(s, lane)
                       if life.prefilling(lane) and life.needs_block(lane) else None)
            l = lane
            if hit is not None and num(data, 0, 2, "the policy's host hit (>0)"):
                h, n = hit
                dst = self.policy.reusable(s)
                if dst is not None:
                    self.refine("grow_host_hit", {"l": l, "h": h, "dst": dst, "n": n})
                    assert self.apply("grow_host_hit", l, h, dst, n).rejected is None
                    self.busy_copy(data, l)
                    return
            calls = self.grow_host_hit_calls(l)
            guard = pick(data, sorted(calls, key=lambda g: g or ""), "guard (None: accepted)")
            args = pick(data, calls[guard], "slot, dst, n")
            assert self.apply("grow_host_hit", *args).rejected == guard, (args, guard)
            if guard is None:
                self.busy_copy(data, l)

        def grow_host_hit_calls(self, l: int) -> dict[str | None, list[tuple[int, int, int, int]]]:
            """grow_host_hit calls for lane l over every slot, n (whole chunks up to past the
            block, 0, and 1) and dst (the policy's, one no load may write), by the guard the
            lifecycle model says refuses them (None: a legal hit)."""
            life, c = self.life, self.c
            taken = [b for b in range(c.K) if not life.reusable(b)]  # a lane's, pinned, ...
            dst = self.policy.reusable(self.s)
            dsts = sorted({0 if dst is None else dst, *taken[:1]})
            calls: dict[str | None, list[tuple[int, int, int, int]]] = {}
            for h in range(c.H):
                for n in sorted({0, 1, *range(c.C, c.S + c.C + 1, c.C)}):
                    for d in dsts:
                        args = (l, h, d, n)
                        calls.setdefault(life.predict("grow_host_hit", args), []).append(args)
            return calls

        # rules: paged tables with the prefix cache --------------------------------------
        @precondition(lambda self: self.c.T > 1 and self.c.PREFIX)
        @rule(data=st.data(), k=st.integers(1, 4))
        def paged_flow(self, data: Any, k: int) -> None:
            """Up to k turns of conversations (`turn`)."""
            for _ in range(k):
                if not self.turn(data):
                    return

        def turn(self, data: Any) -> bool:
            """One turn of a conversation served into the cache, so that hits go on past the
            first block. The prompt goes on from a conversation cached past its first block
            (the whole key of a later block's entry: its prefix up to its end; or a cut past
            its first block, where the new tail goes another way), else it is a fresh one of
            several blocks. It is admitted as the policy chooses (a hit copies the first
            block's part), then driven as the adapter drives it: its copies land, its next
            block is grown before each prefill (`grow_by_policy`: a hit past the first block
            when the entry at that position goes on as the prompt does; hybrid: as far as
            the entry's snapshots reach), its chunks are prefilled (hybrid: a snapshot at each
            boundary, as the policy takes them); then it decodes a few tokens and finishes
            into the cache, so the next turn has a longer conversation to go on from. On the
            way, drawn grow_hit calls (`drawn_grow_hit`, refused by the guard the lifecycle
            model names, or a legal hit): while its copy is in flight, mid-block, and at each
            boundary (often one call for each guard that refuses some call there).
            Often the other entries are dropped first (`discard`, unpinned ones, until a
            table's worth of blocks is free): the policy evicts the entries past a first block
            first (the conversation's own, its middle blocks before its end: they have no use
            time), so with few blocks the hit would often find its next block gone. False if
            no turn could start (no idle lane, or the policy declines), or the lane got no
            block or was preempted."""
            life, c, s = self.life, self.c, self.s
            if None not in life.lane:
                return False
            later = [tuple(s.key[b]) for b in range(c.K)
                     if s.owner[b] == core.OWNER_CACHE and s.start[b] > 0]
            # (host tier: a conversation whose later block is a host entry goes on too)
            later += [tuple(s.slot_key[h]) for h in range(c.H)
                      if s.slot_state[h] == core.SLOTSTATE_STORED and s.slot_start[h] > 0]
            m = c.T * c.S - 1
            if later and num(data, 0, 3, "a fresh conversation (0)"):
                key = pick(data, later, "conversation")
                ours = [b for b, (k, _) in sorted(life.entries.items())
                        if len(k) <= len(key) and k == key[:len(k)]]
                if coin(data, "room for it") and "discard" in core.ACTIONS:
                    others = [b for b in sorted(life.entries)
                              if b not in ours and not life.pinned(b)]
                    for b in others[:max(0, c.T - life.owner.count("FREE"))]:
                        assert self.apply("discard", b).rejected is None
                if c.HOST and coin(data, "its later blocks to the host"):
                    # evicted from the device since (the batcher spills an entry it evicts):
                    # the turn's next blocks are then loaded from the host (`grow_host_hit`)
                    for b in ours:
                        if life.start[b] > 0 and not life.pinned(b):
                            self.spill_by_policy(None, b)
                tail = data.draw(_token_lists(1, c.S), label="next turn")
                if coin(data, "a cut past the first block"):  # then it goes another way
                    whole, key = key, key[:num(data, min(c.S + 1, len(key)), len(key), "keep")]
                    if len(key) < len(whole) and tail[0] == whole[len(key)]:
                        tail[0] = ALPHABET[(ALPHABET.index(tail[0]) + 1) % len(ALPHABET)]
                p = seq((key + tuple(tail))[:m])
            else:
                p = seq(data.draw(_token_lists(c.S + 1, m), label="prompt"))
            r = self.next_id
            self.next_id += 1
            assert self.apply("submit", r, p).rejected is None
            if c.HOST and num(data, 0, 2, "a later block's host entry first (0)") == 0:
                self.refuse_later_host_hit(data, r)
            if not self.admit_by_policy(r, data):
                return False
            l = life.lane.index(r)
            for _ in range(4 * c.T * c.S):  # (each pass lands a copy, grows or prefills)
                if life.lane[l] != r or not life.prefilling(l):
                    break
                if life.copying[l]:
                    if num(data, 0, 3, "a drawn grow_hit first (0)") == 0:
                        self.drawn_hit_past_first_block(data, l)  # no_copy_in_flight, ...
                    self.complete_copy(data, l)
                    continue
                if life.needs_block(l):
                    # (a boundary with entries about is the rare state a refusal needs: often
                    # one call for each guard that refuses some call here)
                    if coin(data, "each refusal first"):
                        for action, calls in self.hit_calls(l):
                            for guard in sorted(g for g in calls if g is not None):
                                args = pick(data, calls[guard], "src, dst, n")
                                assert self.apply(action, *args).rejected == guard, args
                    for _ in range(num(data, 0, 2, "drawn grow_hit calls first")):
                        if life.needs_block(l):  # (until one is accepted)
                            self.drawn_hit_past_first_block(data, l)
                    if life.needs_block(l) and not self.grow_by_policy(data):
                        return False  # no block until a copy lands or a drain ends
                    continue
                if num(data, 0, 3, "a drawn grow_hit mid-block (0)") == 0:
                    self.drawn_hit_past_first_block(data, l)  # tail_full
                self.apply("prefill", l, data.draw(tokens, label="tok"))
                # hybrid: a snapshot at each boundary of the prompt, as the policy takes them
                # (a skipped one leaves the entries the turn is cached into without snapshots
                # past it: the next turn's hit stops there)
                if self.policy.snapshot(self.s, l) and num(data, 0, 7, "skip (0)"):
                    assert self.apply("snapshot", l).rejected is None
            for _ in range(pick(data, (0, 1, c.S, c.T * c.S), "tokens")):
                if not life.decoding(l) or life.lane[l] != r:
                    break
                self.grow_by_policy(data)
                if self.decode_by_policy(self.decode_tokens(data), data).rejected is not None:
                    break  # the table is full, or no padding target until a copy lands
            if life.lane[l] != r or not life.decoding(l):
                return False  # preempted to make room (or still prefilling: no block)
            assert self.apply("finish", l, True).rejected is None
            return True

        def drawn_hit_past_first_block(self, data: Any, lane: int | None = None) -> None:
            """A drawn grow_hit (`drawn_grow_hit`), or with the host tier often a drawn
            grow_host_hit (`drawn_grow_host_hit`), for `lane` if given."""
            if self.c.HOST and coin(data, "from the host"):
                self.drawn_grow_host_hit(data, lane)
            else:
                self.drawn_grow_hit(data, lane)

        def hit_calls(self, l: int) -> list[tuple[str, dict[str | None, list[Any]]]]:
            """(action, its calls by guard) for lane l's hits past the first block: grow_hit's
            (`grow_hit_calls`), with the host tier grow_host_hit's too."""
            out: list[tuple[str, dict[str | None, list[Any]]]] = [
                ("grow_hit", self.grow_hit_calls(l))]
            if self.c.HOST:
                out.append(("grow_host_hit", self.grow_host_hit_calls(l)))
            return out

        def refuse_later_host_hit(self, data: Any, r: int) -> None:
            """Waiting r's prefix matches a host entry of a later block (its key is the whole
            prefix up to its block's end): a host hit on it, which would load into the lane's
            first block, is refused (slot_first_block)."""
            life, c = self.life, self.c
            p = life.prompt[r]
            later = [(h, n) for h in life.slots("STORED") if life.slot_start[h] > 0
                     and (n := common_chunks(life.slot_key[h], p, c.C,
                                             min(len(life.slot_key[h]), len(p) - 1)))]
            idle = [l for l in range(c.B) if life.lane[l] is None]
            if later and idle:
                h, n = pick(data, later, "slot, n")
                dst = self.policy.reusable(self.s)
                args = (idle[0], r, h, 0 if dst is None else dst, n)
                assert self.apply("admit_host_hit", *args).rejected == "slot_first_block"
                Stats.events["host hit on a later block's entry refused"] += 1

        @rule(data=st.data())
        def decode(self, data: Any) -> None:
            toks = self.decode_tokens(data)
            if coin(data, "policy pad"):
                self.decode_by_policy(toks)
            else:
                self.apply("decode", self.block(data, "pad"), self.policy.local_pad(self.s), toks)

        @rule(data=st.data(), keep=st.booleans())
        def finish(self, data: Any, keep: bool) -> None:
            self.apply("finish", self.lanes(data, self.life.decoding), keep)

        # rules: preemption ------------------------------------------------------------
        @rule(data=st.data())
        def preempt(self, data: Any) -> None:
            """preempt with a drawn lane (often a computing one, one that waits for a block,
            one whose sequence would not fit a prompt, or an idle or copying one): applied, or
            refused by the guard the lifecycle model names (without PREEMPT: preemption_on)."""
            life, c = self.life, self.c
            pred = pick(data, (life.computing, life.needs_block,
                               lambda l: life.computing(l) and len(life.seq[l]) > c.T * c.S,
                               lambda l: not life.computing(l)), "lane: computing, ...")
            self.apply("preempt", self.lanes(data, pred))

        @precondition(lambda self: self.c.PREEMPT)
        @rule(data=st.data(), k=st.integers(1, 8))
        def storm(self, data: Any, k: int) -> None:
            """A preempt storm: a request whose prompt ends on a block boundary (1..T-1 whole
            blocks, or one token short of one; often the same length for every lane) for each
            idle lane, admitted as the policy chooses, then scheduler steps (`schedule_step`)
            for their prefill and k more: lanes reach their block boundaries together, with few
            blocks left (K near the preemption rule's minimum), and the policy preempts to make
            room;
            the run's end drains them (`run_to_completion`). Often every other request is
            aborted first, and when the B lanes can share the K blocks (but the reserved
            scratch block) evenly, m < T blocks each, every prompt is m blocks long: every lane
            reaches its boundary at once, no block left."""
            c, life = self.c, self.life
            if coin(data, "from idle"):  # (the client gives up on everything else)
                for l in range(c.B):
                    if life.lane[l] is not None:
                        assert self.apply("abort_running", l).rejected is None
                for r in self.waiting():
                    assert self.apply("abort_waiting", r).rejected is None
            n = num(data, 1, c.T - 1, "blocks") * c.S - num(data, 0, 1, "short (1)")
            same = coin(data, "the same length")
            m, rest = divmod(c.K - c.RESERVED, c.B)
            if (same and not rest and 1 <= m < c.T and c.B > 1
                    and all(r is None for r in life.lane)):
                n = m * c.S
            for _ in range(self.s.busy.count(False)):
                if not same:
                    n = num(data, 1, c.T - 1, "blocks") * c.S - num(data, 0, 1, "short (1)")
                p = seq(data.draw(_token_lists(n, n), label="prompt"))
                assert self.apply("submit", self.next_id, p).rejected is None
                self.next_id += 1
                if not self.admit_by_policy(self.next_id - 1):
                    break
            for _ in range(n // c.C + k):  # (the prompts' prefill, then k more steps)
                if not self.schedule_step(data):
                    return

        def schedule_step(self, data: Any = None) -> bool:
            """One scheduler step with preemption, as the adapter takes it: copies, loads and
            stores land; with PD, a drain ends, then a transfer (an import whose table covers
            its prompt lands, an export ends); the lanes that need a block grow (the oldest
            first, importing lanes too; preempting when there is none);
            the oldest waiting request is admitted if the policy finds room; lanes grow again;
            each prefilling lane prefills a chunk; lanes at their table end finish (with data,
            sometimes lanes after a few tokens); then a decode call (preempting for a padding
            target). False if there is nothing to do."""
            life, c = self.life, self.c
            if any(life.copying):  # a device copy, or a load from the host tier
                l = life.copying.index(True)
                self.apply("copy_done" if life.load_slot[l] is None else "load_done", l)
                return True
            for h in life.slots("STORING"):  # a spill's store lands (the adapter's: at once)
                self.apply("store_done", h)
                return True
            if life.draining:  # a cancelled transfer ends: every block draining for it frees
                b = min(life.draining)
                self.apply("transfer_end", life.draining[b], b)
                return True
            moving = [l for l in range(c.B) if life.transfer_in_flight(l)]
            if moving:  # (an import short of its prompt grows first: its KV is not asked for)
                l = moving[0]
                r = life.lane[l]
                if life.importing(l):
                    self.apply("import_done", r, seq(life.prompt[r]), ALPHABET[l % len(ALPHABET)])
                else:
                    self.apply("export_done", r, c.PREFIX and r % 4 < 2)
                return True
            if not self.waiting() and all(r is None for r in life.lane):
                return False
            self.grow_by_policy(data)
            if self.waiting() and None in life.lane:
                self.admit_by_policy(self.waiting()[0])
                if any(life.copying):
                    return True
            self.grow_by_policy(data)
            for l in range(c.B):
                if life.prefilling(l) and not life.copying[l] and not life.needs_block(l):
                    self.apply("prefill", l, ALPHABET[l % len(ALPHABET)])
            for l in range(c.B):  # a lane finishes at its table end, or (odd requests) a
                r = life.lane[l]  # block's worth of tokens past its prompt
                if (life.table_end(l) and life.waits_for_block()
                        and not any(map(life.reusable, range(c.K)))):
                    # its sequence would not fit a prompt: not a victim (it finishes instead)
                    assert self.apply("preempt", l).rejected == "requeue_fits"
                if life.table_end(l) and not Stats.rejected["grow", "table_not_full"]:
                    # no next block there (once a run: teardown's drain may never see one)
                    assert self.apply("grow", l, 0).rejected == "table_not_full"
                if life.table_end(l) or (life.decoding(l) and r % 2 and life.length[l] >= len(
                        life.prompt[r]) + c.S):
                    self.apply("finish", l, c.PREFIX and r % 4 < 2)
            self.grow_by_policy(data)
            if any(map(life.decoding, range(c.B))):
                toks = (tuple(data.draw(_token_lists(c.B, c.B), label="tokens"))
                        if data is not None else (ALPHABET[0],) * c.B)
                self.decode_by_policy(toks, data)
            return True

        def run_to_completion(self) -> None:
            """With preemption, at capacity: the scheduler (`schedule_step`) runs every waiting
            and running request to its end: each one finishes (preempted ones too, admitted
            again; with PD, imports land and exports end), none is abandoned, and it does not
            hang (a bound on the steps: the oldest lane always advances)."""
            life, c = self.life, self.c
            todo = life.in_phase("waiting", "prefill", "decode", *MOVING)
            bound = 4 * (len(todo) + 1) * (c.T * c.S + 2) * c.B
            for _ in range(bound):
                if not self.schedule_step():
                    break
            else:
                raise AssertionError(f"the scheduler did not drain {todo} in {bound} steps: "
                                     f"{core.describe_state(self.s)}")
            assert all(life.status[r] == "finished" for r in todo), {
                r: life.status[r] for r in todo}
            if any(r in life.preempted for r in todo):
                Stats.events["preempted requests drained"] += 1

        def storm_once(self) -> None:
            """After `run_to_completion` (every lane idle): a preempt storm as `storm` makes
            one, without draws, once a run, when the configuration has room for one (B >= 2
            lanes share the K blocks but the reserved scratch block evenly, m < T blocks each):
            the cache entries are dropped (no hit puts a lane ahead of the others), B prompts of
            m blocks are admitted at once and the scheduler runs them to their end
            (`run_to_completion`): at their last boundary every lane waits for a block. (So that
            coverage does not hang on `storm`'s draws.)"""
            life, c = self.life, self.c
            m, rest = divmod(c.K - c.RESERVED, c.B)
            if (Stats.events["preempt storm: every lane at a block boundary"] or c.B < 2 or rest
                    or not 1 <= m < c.T or "discard" not in core.ACTIONS):
                return
            for b in sorted(life.entries):
                assert self.apply("discard", b).rejected is None
            for l in range(c.B):
                p = seq((ALPHABET[l % len(ALPHABET)],) * (m * c.S))
                assert self.apply("submit", self.next_id, p).rejected is None
                self.next_id += 1
                if not self.admit_by_policy(self.next_id - 1):
                    break  # (dynamic scratch: room for a padding block too)
            self.run_to_completion()

        def imports_with_preemption(self) -> None:
            """After `run_to_completion` (every lane idle), with PD: the situations PD with
            preemption exists for, without draws, once a run each, when the configuration has
            them (B >= 2 lanes, fewer reusable blocks than B whole tables), each run to its end
            by the scheduler (`run_to_completion`). (So that coverage does not hang on the
            flows' draws.) The cache entries are dropped first (no hit).
            1. A prompt of T * S - 1 tokens is imported; while its table is short a second
            import is refused (`one_import_table_growing`); local requests then hold every
            block left (up to B - 1 whole tables), so its table grows by preempting them
            (`import_grow_by_policy`), and it lands.
            2. A local request whose prompt ends on a block boundary, local ones holding the
            blocks but the import's, then an import into those: it lands, and when the older
            lane grows the import is the victim (the most recently admitted lane); it waits
            again, is recomputed here and finishes."""
            life, c = self.life, self.c
            room = c.K - c.RESERVED  # (every block but the reserved scratch one is reusable)
            if not pd or c.B < 2 or room >= c.B * c.T or "discard" not in core.ACTIONS:
                return
            if not Stats.events[IMPORT_BLOCK_PREEMPTED]:
                self.drop_entries()
                l = self.import_prompt(c.T * c.S - 1)
                r = self.next_id
                self.next_id += 1
                assert self.apply("submit", r, seq(STEMS[0][:1])).rejected is None
                out = self.apply("admit_import", life.lane.index(None), r, 0)
                assert out.rejected == "one_import_table_growing", out.rejected
                assert self.apply("abort_waiting", r).rejected is None
                held = min(room - 1, (c.B - 1) * c.T)
                self.hold_blocks([min(c.T, held - i) for i in range(0, held, c.T)])
                assert self.import_grow_by_policy(None, l)
                assert Stats.events[IMPORT_BLOCK_PREEMPTED]
                self.land(l)
                self.run_to_completion()
            if not Stats.events[IMPORTED_PREEMPTED_FINISHED]:
                self.drop_entries()
                k = min(c.T - 1, room - 1)  # the older lane's blocks (it needs its next one)
                q = min(c.T, room - k)  # the import's
                rest = room - k - q  # (in at most B - 2 lanes: room < B * T)
                self.hold_blocks([k], boundary=True)
                self.hold_blocks([min(c.T, rest - i) for i in range(0, rest, c.T)])
                l = self.import_prompt(q * c.S - 1)
                r = life.lane[l]
                assert self.import_grow_by_policy(None, l)  # (the blocks left: no preemption)
                self.land(l)
                assert self.grow_by_policy() and life.lane[l] is None, (l, life.lane)
                assert r in life.preempted_imports, r
                self.run_to_completion()
                assert Stats.events[IMPORTED_PREEMPTED_FINISHED]

        def drop_entries(self) -> None:
            """Every lane idle: the cache entries are discarded (no admission or growth hits)."""
            for b in sorted(self.life.entries):
                assert self.apply("discard", b).rejected is None

        def import_prompt(self, n: int) -> int:
            """A prompt of n tokens is imported into an idle lane (the policy's lane and
            block); its lane."""
            r, l = self.next_id, self.policy.idle_lane(self.s)
            self.next_id += 1
            p = seq(tuple(ALPHABET[i % len(ALPHABET)] for i in range(n)))
            assert self.apply("submit", r, p).rejected is None
            dst = self.policy.reusable(self.s)
            assert l is not None and dst is not None
            assert self.apply("admit_import", l, r, dst).rejected is None
            return l

        def land(self, l: int) -> None:
            """Importing lane l's table covers its prompt: its import lands."""
            r = self.life.lane[l]
            out = self.apply("import_done", r, seq(self.life.prompt[r]), ALPHABET[0])
            assert out.rejected is None, out.rejected

        def hold_blocks(self, sizes: list[int], boundary: bool = False) -> None:
            """For each size j: a local request of j blocks' worth of tokens (one token short
            of their end; `boundary`: up to it, so it needs its next block) is admitted into
            an idle lane (a miss: no entry) and prefilled, its table grown by `grow` into the
            policy's blocks (not `grow_by_policy`: an older importing lane would take them)."""
            life, c = self.life, self.c
            for j in sizes:
                r, l = self.next_id, self.policy.idle_lane(self.s)
                self.next_id += 1
                p = seq((ALPHABET[r % len(ALPHABET)],) * (j * c.S - (not boundary)))
                assert self.apply("submit", r, p).rejected is None
                dst = self.policy.reusable(self.s)
                assert l is not None and dst is not None
                assert self.apply("admit_miss", l, r, dst).rejected is None
                while life.prefilling(l):
                    if life.tail_full(l):
                        dst = self.policy.reusable(self.s)
                        assert dst is not None and self.apply("grow", l, dst).rejected is None
                    assert self.apply("prefill", l, ALPHABET[0]).rejected is None

        @rule(data=st.data())
        def abort(self, data: Any) -> None:
            """The client aborts (waiting or running) or the runtime fails a lane or, when
            the spec has `discard`, scribbles on a block no lane owns."""
            kinds = ["abort_waiting", "abort_running", "fail"]
            kinds += ["discard"] if "discard" in core.ACTIONS else []
            kind = pick(data, kinds, "kind")
            if kind == "abort_waiting":
                w = self.waiting()
                r = (pick(data, w, "request")
                     if w and coin(data, "a waiting one")
                     else self.any_request(data))
                self.apply("abort_waiting", r)
            elif kind == "discard":  # often a free block or an entry (discarded)
                life = self.life
                self.apply("discard", self.block(data, "block", *(
                    b for b in range(self.c.K) if life.owner[b] in ("FREE", "CACHE"))))
            else:
                # Often a lane with a copy or a PD transfer in flight: its blocks must drain.
                life = self.life
                moving = [l for l, r in enumerate(life.lane)
                          if r is not None and life.status[r] in MOVING]
                how = num(data, 0, 2, "busy, copying, moving")
                copying = how == 1 and any(self.s.copying)
                if how == 2 and moving:
                    l = pick(data, moving, "lane")
                else:
                    l = self.lanes(data, lambda l: self.s.copying[l] if copying
                                   else self.s.busy[l])
                table = list(life.tables[l])
                if self.apply(kind, l).rejected is None and l in moving:
                    assert all(self.s.owner[b] == core.OWNER_DRAINING and self.s.transfer[b]
                               for b in table), table
                    Stats.events[f"{kind} drains"] += 1

        # rules: host cache tier -------------------------------------------------------
        def slot(self, data: Any, label: str, among: list[int] | None = None) -> int:
            """A host slot: one of `among` when there are any, else any."""
            if among and num(data, 0, 3, f"{label}: any (0)"):
                return pick(data, among, label)
            return num(data, 0, self.c.H - 1, label)

        @precondition(lambda self: self.c.HOST)
        @rule(data=st.data(), k=st.integers(1, 8))
        def host_flow(self, data: Any, k: int) -> None:
            """Up to k host-tier steps (`host_step`)."""
            for _ in range(k):
                if not self.host_step(data, feed=True):
                    return

        def host_step(self, data: Any, feed: bool) -> bool:
            """One host-tier step, whichever the draw picks among the possible ones: spill an
            entry (the policy's slot, or a drawn one) and let the store land, fail or stay in
            flight; a host hit (the policy's, or drawn parameters near one); end a store or a
            load in flight (it lands or fails: the request recomputes the loaded block); evict a
            host entry; a late or misdirected event (`late_host_event`). Whatever is left in
            flight is busy meanwhile (`busy_store`, `busy_load`, `busy_copy`). feed: also serve
            a request into the cache (`serve`). False if no step is possible."""
            life, c = self.life, self.c
            unpinned = [b for b in sorted(life.entries) if not life.pinned(b)]
            storing, stored = life.slots("STORING"), life.slots("STORED")
            loading = life.slots("LOADING")
            waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
            moves = ["late"] * 2 if life.entries or storing or stored or loading else []
            moves += ["spill"] * 3 if unpinned else []
            moves += ["store_done", "store_fail"] if storing else []
            moves += ["host_hit"] * 3 if stored and waiting and idle else []
            moves += ["load_done", "load_fail"] if loading else []
            moves += ["host_evict"] if stored else []
            if feed and idle:
                moves += ["serve"] * (3 if stored or not life.entries else 1)
            if not moves:
                return False
            move = pick(data, moves, "host move")
            if move == "spill":
                b = pick(data, unpinned, "entry")
                if not (coin(data, "the policy's slot") and self.spill_by_policy(data, b)):
                    h = self.slot(data, "slot", life.slots("EMPTY"))
                    if self.apply("spill", b, h).rejected is None:
                        self.busy_store(data, h)
            elif move in ("store_done", "store_fail"):
                h = pick(data, storing, "slot")
                b = life.slot_block[h]
                assert self.apply(move, h).rejected is None
                assert self.s.owner[b] == core.OWNER_FREE, b
            elif move == "host_hit":  # often a request that has one
                hits = [r for r in waiting
                        if self.policy.best_host_hit(self.s, self.s.prompt.get(r))]
                self.host_hit(data, pick(data, hits or waiting, "request"), idle)
            elif move in ("load_done", "load_fail"):
                l = life.slot_lane[pick(data, loading, "slot")]
                assert self.apply(move, l).rejected is None
            elif move == "host_evict":
                assert self.apply("host_evict", pick(data, stored, "slot")).rejected is None
            elif move == "late":
                self.late_host_event(data)
            else:
                self.serve(data)
            return True

        def serve(self, data: Any) -> None:
            """Serve one request into the cache: a waiting one, or a new one (usually extending
            a host entry's key, when there is one); admit it as the policy chooses (spilling
            the entry it evicts), complete its copy or load (which may fail; meanwhile it is
            busy), prefill its prompt, decode a few tokens (sometimes to the block end) and
            finish it, keeping its KV (paged tables: its next blocks are grown as the batcher
            grows them, `grow_by_policy`, from the host tier when it holds more)."""
            life, c = self.life, self.c
            if not self.waiting() or (life.slots("STORED") and num(data, 0, 3, "waiting (0)")):
                self.new_request(data, host=True)
                r = self.next_id - 1
            else:
                r = pick(data, self.waiting(), "request")
            if not self.admit_by_policy(r, data):
                return
            l = life.lane.index(r)
            self.busy_copy(data, l)
            if life.lane[l] != r:
                return  # cancelled
            while life.copying[l]:
                self.complete_copy(data, l)
            while life.prefilling(l) and life.lane[l] == r:
                if not self.grow_by_policy() and life.needs_block(l):
                    return  # no block until a store lands (paged tables): it stays busy
                if life.lane[l] == r:  # (with PREEMPT, the growth may have preempted it)
                    self.apply("prefill", l, data.draw(tokens))
            for _ in range(pick(data, (0, 1, 2, c.T * c.S), "tokens")):
                if life.lane[l] != r or not life.decoding(l):
                    break
                self.grow_by_policy()
                if self.decode_by_policy(self.decode_tokens(data)).rejected is not None:
                    break  # the table is full, or no padding target until a copy lands
            if life.lane[l] != r or not life.decoding(l):
                return  # preempted to make room (it waits again)
            assert self.apply("finish", l, True).rejected is None

        def host_hit(self, data: Any, r: int, idle: list[int]) -> None:
            """Admit waiting r from the host tier: the policy's choice when it is a host hit
            (accepted), else drawn parameters near the longest host hit (another n, lane or
            dst, a slot without an entry; refused unless legal). The load it starts is busy
            (`busy_copy`). Paged tables: often a hit on a later block's host entry first
            (`refuse_later_host_hit`)."""
            s, c = self.s, self.c
            if c.T > 1 and num(data, 0, 3, "a later block's entry first (0)") == 0:
                self.refuse_later_host_hit(data, r)
            choice = self.policy.admission(s, r)
            if choice is not None and choice.action == "admit_host_hit" and coin(data, "policy"):
                assert self.admit_by_policy(r)
                self.busy_copy(data, choice.args["l"])
                return
            best = self.policy.best_host_hit(s, s.prompt.get(r))
            h, n = best if best is not None else (self.slot(data, "slot"), c.C)
            busy = [x for x in range(c.H) if s.slot_state[x] != core.SLOTSTATE_STORED]
            if busy and coin(data, "a slot without an entry"):  # refused: slot_stored
                h = pick(data, busy, "slot")
            n = pick(data, (n, n - c.C, n + c.C, n + 1, c.C), "n")
            l = pick(data, idle, "lane") if coin(data, "an idle lane") else self.lanes(
                data, lambda l: not s.busy[l])
            dst = self.policy.reusable(s)
            dst = dst if dst is not None and coin(data, "a reusable dst") else self.block(
                data, "dst")
            if self.apply("admit_host_hit", l, r, h, dst, n).rejected is None:
                self.busy_copy(data, l)

        def busy_store(self, data: Any, h: int) -> None:
            """A store into slot h is in flight: the slot may not be evicted, spilled into or
            hit (`busy_slot`)."""
            assert self.life.slot_state[h] == "STORING"
            self.busy_slot(data, h)

        def busy_slot(self, data: Any, h: int) -> None:
            """One of the calls a busy slot h refuses: an eviction, a spill into it, a hit on
            it."""
            life, c = self.life, self.c
            unpinned = [b for b in sorted(life.entries) if not life.pinned(b)]
            waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
            options = ["host_evict"] + (["spill"] if unpinned else [])
            options += ["admit_host_hit"] if waiting and idle else []
            what = pick(data, options, "while busy")
            state = life.slot_state[h]
            args = {"host_evict": (h,), "spill": (pick(data, unpinned or [0], "entry"), h),
                    "admit_host_hit": (idle[0] if idle else 0, waiting[0] if waiting else 0, h,
                                       0, c.C)}[what]
            expect = "slot_empty" if what == "spill" else "slot_stored"
            assert self.apply(what, *args).rejected == expect
            Stats.events[f"{what} of a {state} slot rejected"] += 1

        def busy_copy(self, data: Any, l: int) -> None:
            """Lane l has just been admitted (or has grown by a hit past its first block).
            While its copy reads a device entry, the entry
            may not be spilled (nor discarded). While its load reads a slot, the slot may not
            be evicted, spilled into or hit (`busy_slot`), and copy_done is no way to end it;
            or the request ends (abort, failure) and the slot is a host entry again. Or nothing
            happens yet."""
            life = self.life
            src, h = life.copy_src[l], life.load_slot[l]
            if src is not None:
                what = pick(data, ("spill", "spill", "discard", "later"), "while copying")
                if what != "later":
                    args = ((src, self.slot(data, "slot", life.slots("EMPTY")))
                            if what == "spill" else (src,))
                    expect = "entry_unpinned" if what == "spill" else "not_pinned"
                    assert self.apply(what, *args).rejected == expect
                    Stats.events[f"{what} of a pinned entry rejected"] += 1
                return
            if h is None:
                return
            assert life.slot_state[h] == "LOADING"
            self.busy_slot(data, h)
            what = pick(data, ("copy_done", "cancel", "later"), "then")
            if what == "cancel":
                how = pick(data, ("abort_running", "fail"), "how")
                assert self.apply(how, l).rejected is None
                assert self.s.slot_state[h] == core.SLOTSTATE_STORED, h  # intact, evictable
            elif what == "copy_done":  # a load ends by load_done or load_fail
                assert self.apply("copy_done", l).rejected == "copy_in_flight"
                Stats.events["copy_done of a load rejected"] += 1

        def late_host_event(self, data: Any) -> None:
            """A store or load event for a slot or lane that has none in flight, an eviction
            of an empty slot, a hit on a slot that holds no entry, a spill of a block that is
            no cache entry: refused, changing nothing."""
            life, c = self.life, self.c
            quiet = [h for h in range(c.H) if life.slot_state[h] != "STORING"]
            unloaded = [l for l in range(c.B) if life.load_slot[l] is None]
            empty = life.slots("EMPTY")
            waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
            options = ["store"] if quiet else []
            options += ["load"] if unloaded else []
            options += ["evict"] if empty else []
            options += ["hit"] if waiting and idle and len(life.slots("STORED")) < c.H else []
            options += ["not_an_entry"] if len(life.entries) < c.K else []
            kind = pick(data, options, "late host event")
            if kind == "store":
                call, args, expect = pick(data, ("store_done", "store_fail")), (
                    pick(data, quiet, "slot"),), "slot_storing"
            elif kind == "load":
                call, args, expect = pick(data, ("load_done", "load_fail")), (
                    pick(data, unloaded, "lane"),), "load_in_flight"
            elif kind == "evict":
                call, args, expect = "host_evict", (pick(data, empty, "slot"),), "slot_stored"
            elif kind == "hit":  # an empty, storing or loading slot, with its key's first chunk
                h = pick(data, [h for h in range(c.H) if life.slot_state[h] != "STORED"])
                r, l = pick(data, waiting, "request"), pick(data, idle, "lane")
                call, args = "admit_host_hit", (l, r, h, 0, c.C)
                expect = "slot_stored"
            else:  # a lane's, free, scratch, draining or spilling block
                b = pick(data, [b for b in range(c.K) if b not in life.entries], "block")
                call, args, expect = "spill", (b, self.slot(data, "slot")), "entry_cached"
            out = self.apply(call, *args)
            assert out.rejected == expect, (call, args, out.rejected, expect)
            Stats.events[f"late {call} rejected"] += 1

        # rules: prefill/decode disaggregation -----------------------------------------
        @precondition(lambda self: self.waiting())
        @rule(data=st.data())
        def admit_import(self, data: Any) -> None:
            """Decode side: a waiting request takes an idle lane and a block the policy would
            reuse, its table's first, to receive its KV by transfer (accepted; with PREEMPT,
            refused while another importing table grows: `one_import_table_growing`); or drawn
            parameters (rejected unless legal)."""
            s, c = self.s, self.c
            idle = [l for l in range(c.B) if not s.busy[l]]
            dst = self.policy.reusable(s)
            if idle and dst is not None and num(data, 0, 3, "drawn (0)"):
                r = pick(data, self.waiting(), "request")
                expect = "one_import_table_growing" if self.life.import_table_grows() else None
                out = self.apply("admit_import", pick(data, idle), r, dst)
                assert out.rejected == expect, out.rejected
                return
            l = self.lanes(data, lambda l: not self.s.busy[l])
            w = self.waiting()
            r = pick(data, w, "request") if coin(data, "waiting") else self.any_request(data)
            self.apply("admit_import", l, r, self.block(data, "dst"))

        @rule(data=st.data(), k=st.integers(1, 8))
        def pd_flow(self, data: Any, k: int) -> None:
            """Up to k PD steps (`pd_step`), submitting and prefilling to get there."""
            for _ in range(k):
                if not self.pd_step(data, feed=True):
                    return

        def pd_step(self, data: Any, feed: bool) -> bool:
            """One PD step, whichever the draw picks among the possible ones: import a waiting
            request (the policy's lane and block; with PREEMPT, refused while another importing
            table grows), grow an importing lane's table toward its prompt's end (`import_grow`,
            as the adapter does before it asks for the KV; with PREEMPT, preempting computing
            lanes for its blocks), export a prefilled lane (every block of its table), deliver
            an import (the whole prompt, or a payload `covers_prompt` rejects; refused while
            the table is short), end an export, fail a transfer, cancel one (abort or failure
            of its lane: every block drains) or end a drain (every block draining for the
            request). feed: also submit, complete a copy or prefill (growing first, as the
            adapter does). False if none is possible."""
            life, c, s = self.life, self.c, self.s
            prefilled = [l for l in range(c.B) if life.prefilled(l)]
            prefilling = [l for l, r in enumerate(life.lane)
                          if r is not None and life.status[r] == "prefill"]
            importing, exporting = life.in_phase("importing"), life.in_phase("exporting")
            moving = importing + exporting
            short = [l for l in range(c.B) if life.needs_import_block(l)]
            moves = ["import"] if self.waiting() and not all(s.busy) else []
            moves += ["import_grow"] * 2 if short else []
            moves += ["export"] * 2 if prefilled else []
            # An export of a lane that has decoded past its prompt is refused.
            decoded = [l for l in range(c.B) if life.decoding(l) and not life.prefilled(l)]
            moves += ["late_export"] if decoded else []
            moves += ["import_done"] * 2 if importing else []
            moves += ["export_done"] * 2 if exporting else []
            moves += ["transfer_fail", "cancel"] if moving else []
            moves += ["transfer_end", "late"] if life.draining else []
            if feed:
                moves += ["submit"] if not self.waiting() else []
                moves += ["prefill"] if prefilling else []
            if not moves:
                return False
            move = pick(data, moves, "pd move")
            if move == "import":
                dst = self.policy.reusable(s)
                if dst is None:  # refinement: only while a copy runs or a block drains
                    assert not (self.quiescent() and self.at_capacity
                                and self.admission_room()), "no block to import to"
                    return False
                # often a prompt past one block (its table grows before the import lands)
                w = self.waiting()
                long = [r for r in w if len(life.prompt[r]) > c.S]
                l = self.policy.idle_lane(s)
                r = pick(data, long if long and coin(data, "past one block") else w, "request")
                if life.import_table_grows():  # one importing table grows at a time
                    assert self.apply("admit_import", l, r, dst).rejected == (
                        "one_import_table_growing")
                    return True
                if life.draining and coin(data, "a draining block first"):  # refused
                    b = pick(data, sorted(life.draining), "draining")
                    assert self.apply("admit_import", l, r, b).rejected == "dst_reusable"
                assert self.apply("admit_import", l, r, dst).rejected is None
                if life.needs_import_block(l) and coin(data, "grow now"):  # (else a later step)
                    return self.import_grow_by_policy(data, l)
            elif move == "import_grow":  # often a refused call first, and one more after
                l = pick(data, short, "lane")
                if coin(data, "refused first"):
                    self.refuse_short_import(data, l)
                if not self.import_grow_by_policy(data, l):
                    return False
                if num(data, 0, 2, "once more (0)") == 0:  # its table covers the prompt now
                    dst = self.policy.reusable(self.s)
                    assert self.apply("import_grow", l, 0 if dst is None else dst).rejected \
                        == "table_short_of_prompt"
            elif move == "export":
                assert self.apply("export", pick(data, prefilled, "lane")).rejected is None
            elif move == "late_export":
                l = pick(data, decoded, "lane")
                assert self.apply("export", l).rejected == "lane_prefilled"
            elif move == "import_done":
                self.deliver(data, pick(data, importing, "request"))
            elif move == "export_done":  # keep without the prefix cache is rejected
                r, keep = pick(data, exporting, "request"), coin(data, "keep")
                out = self.apply("export_done", r, keep)
                assert (out.rejected is None) == (c.PREFIX or not keep), out.rejected
            elif move == "transfer_fail":
                r = pick(data, moving, "request")
                table = list(life.tables[life.lane.index(r)])
                assert self.apply("transfer_fail", r).rejected is None
                assert all(self.s.owner[b] == core.OWNER_FREE and not self.s.transfer[b]
                           for b in table), table
            elif move == "cancel":
                l = life.lane.index(pick(data, moving, "request"))
                kind, table = pick(data, ("abort_running", "fail"), "how"), list(life.tables[l])
                assert self.apply(kind, l).rejected is None
                assert all(self.s.owner[b] == core.OWNER_DRAINING and self.s.transfer[b]
                           for b in table), table
                Stats.events[f"{kind} drains"] += 1
            elif move == "transfer_end":
                b = pick(data, sorted(life.draining), "block")
                r = life.draining[b]
                ended = [x for x, q in life.draining.items() if q == r]
                self.misdirected_transfer_end(b)
                assert self.apply("transfer_end", r, b).rejected is None
                assert all(self.s.owner[x] == core.OWNER_FREE and not self.s.transfer[x]
                           for x in ended), ended
                Stats.events["drain released"] += 1
            elif move == "late":  # e.g. a duplicate of the event that just ended a drain
                self.late_event(data)
            elif move == "submit":
                self.new_request(data, short=num(data, 0, 3, "any length (0)") == 0)
            elif any(self.s.copying[l] for l in prefilling):
                self.complete_copy(data, next(l for l in prefilling if self.s.copying[l]))
            else:
                l = pick(data, prefilling, "lane")
                if not self.grow_by_policy() and life.needs_block(l):
                    return False
                self.apply("prefill", l, data.draw(tokens))
            return True

        def misdirected_transfer_end(self, b: int) -> None:
            """Before block b's drain ends: its transfer_end named with a request that never
            was, refused (transfer_of_request). Once a run (`late_event` draws such events; so
            that coverage does not hang on its draws: drains are rare)."""
            if not Stats.rejected["transfer_end", "transfer_of_request"]:
                assert self.apply("transfer_end", self.next_id + 5, b).rejected == (
                    "transfer_of_request")
                Stats.events["misdirected transfer_end rejected"] += 1

        def deliver(self, data: Any, r: int) -> None:
            """r's import ends: the whole prompt (accepted), or a partial, mismatched or
            over-long payload, which `covers_prompt` rejects, changing nothing (the adapter
            then fails the request: transfer_fail). While r's table does not cover its prompt
            every payload is refused (`table_covers_prompt`: the adapter has not asked for
            the KV yet)."""
            p, tok = self.life.prompt[r], data.draw(tokens, label="first token")
            kind = pick(data, ("whole", "whole", "prefix", "mismatch", "longer"), "payload")
            if kind == "prefix":
                payload = p[:num(data, 0, len(p) - 1, "prefix length")]
            elif kind == "mismatch":
                i = num(data, 0, len(p) - 1, "position")
                payload = p[:i] + ((p[i] % len(ALPHABET)) + 1,) + p[i + 1:]
            elif kind == "longer":  # the first token too, as if it had KV
                payload = p + (tok,)
            else:
                payload = p
            out = self.apply("import_done", r, seq(payload), tok)
            if not self.life.covers_prompt(self.life.lane.index(r)):
                # the table is short of the prompt: no transfer runs yet (any payload is
                # refused before it is looked at)
                assert out.rejected == "table_covers_prompt", (kind, payload, out.rejected)
                Stats.events[IMPORT_SHORT] += 1
            elif kind != "whole":
                assert out.rejected == "covers_prompt", (kind, payload, out.rejected)
                Stats.events[f"{kind} import rejected"] += 1
                if coin(data, "then fail it"):
                    self.apply("transfer_fail", r)

        @rule(data=st.data())
        def late_pd_event(self, data: Any) -> None:
            """A late, duplicate or misdirected transfer event (for a request that is unknown,
            ended or not transferring, or a block that is not draining for it): the core
            must refuse it and change nothing."""
            self.late_event(data)

        def late_event(self, data: Any) -> None:
            """See late_pd_event (pd_step takes one too, right where drains come and go)."""
            life = self.life
            ended = life.in_phase(*ENDED)
            other = life.in_phase("waiting", "prefill", "decode")
            drained = [x for x in life.drained
                       if life.draining.get(x[1], x[0]) != x[0]]  # its block drains again
            options = ["unknown", "wrong_block"]
            options += ["ended"] * 3 if ended else []
            options += ["other"] if other else []
            options += ["drained"] * 2 if life.drained else []
            options += ["redrained"] * 2 if drained else []
            options += ["other_drain"] * 2 if life.draining else []
            kind = pick(data, options, "kind")
            if kind in ("drained", "redrained"):  # a duplicate transfer_end
                r, b = pick(data, drained if kind == "redrained" else life.drained)
                expect = "transfer_of_request" if b in life.draining else "block_draining"
                assert self.apply("transfer_end", r, b).rejected == expect
                Stats.events[f"{kind} transfer_end rejected"] += 1
                return
            if kind == "wrong_block":  # a block not draining, named with its (last) transfer's
                # request: one still transferring, or whose transfer ended normally
                s = self.s
                b = pick(data, [b for b in range(self.c.K) if b not in life.draining] or [0])
                r = s.transfer_req[b] if s.transfer_req[b] is not None else self.next_id
                if b not in life.draining:
                    assert self.apply("transfer_end", r, b).rejected == "block_draining"
                return
            if kind == "other_drain":  # a draining block, named with another request
                b = pick(data, sorted(life.draining), "block")
                r = pick(data, [x for x in (*life.draining.values(), *life.in_phase(*MOVING),
                                            *life.status, self.next_id + 5)
                                if x != life.draining[b]], "request")
                assert self.apply("transfer_end", r, b).rejected == "transfer_of_request"
                Stats.events["misdirected transfer_end rejected"] += 1
                return
            if kind == "unknown":
                r = self.next_id + 5
            else:
                r = pick(data, ended if kind == "ended" else other, "request")
            p = seq(life.prompt.get(r, (1,)))  # what r's import would have had to deliver
            call, args, expect = pick(data, (
                ("import_done", (r, p, 1), "request_importing"),
                ("transfer_fail", (r,), "request_transferring"),
                ("export_done", (r, False), "request_exporting")), "event")
            out = self.apply(call, *args)
            assert out.rejected == expect, (kind, call, args, out.rejected)
            Stats.events[f"late {call} rejected"] += 1

        # rules: calls that must be rejected ------------------------------------------
        @rule(data=st.data())
        def must_reject(self, data: Any) -> None:
            """Unknown or ended ids, idle or busy lanes, blocks the action may not use, bad
            prompts; paged tables: a grow of a lane that needs no block (or into a block it may
            not use), a prefill or decode past a full tail, a hit on an entry that starts later
            in its sequence; PD: an import_grow of a lane that needs none, an import_done while
            the table does not cover the prompt, with PREEMPT a second import while one
            importing table grows; hybrid: a snapshot at a wrong time, a hit past the entry's
            snapshots; host: a load ended as a copy or a copy as a load: the core must refuse,
            naming the guard the lifecycle model says."""
            c, s, life = self.c, self.s, self.life
            idle = [l for l in range(c.B) if life.lane[l] is None]
            busy = [l for l in range(c.B) if life.lane[l] is not None]
            ended = [r for r, x in life.status.items() if x in ENDED]
            waiting = self.waiting()
            options = ["unknown_id", "bad_prompt"]
            uncached = [b for b in range(c.K) if s.owner[b] != core.OWNER_CACHE]
            options += ["known_id"] if life.status else []
            options += ["ended_id"] if ended else []
            options += ["idle_lane"] if idle else []
            options += ["busy_lane"] if busy and waiting else []
            options += ["owned_dst"] if busy and idle and waiting else []
            options += ["scratch_dst"] if c.RESERVED and idle and waiting else []
            options += ["uncached_src"] if idle and waiting and uncached else []
            options += ["owned_pad"] if busy else []
            options += ["discard_lane_block"] if busy and "discard" in core.ACTIONS else []
            options += ["not_prefilled"] if pd and not all(map(life.prefilled, range(c.B))) else []
            options += ["draining_block"] if life.draining else []
            # hybrid prefix cache and host tier (or a configuration without them)
            options += ["bad_snapshot"] if c.HYBRID else []
            options += ["other_copy"] if c.HOST and any(life.copying) else []
            past = self.hits_past_snapshot() if c.HYBRID and idle else []
            options += ["hit_past_snapshot"] * 2 if past else []
            # paged tables (grow is refused everywhere when T = 1: table_not_full at the latest)
            options += ["grow_not_needed"]
            needy = [l for l in range(c.B) if life.needs_block(l)]
            options += ["grow_owned_dst"] if needy else []
            full_tails = [l for l in range(c.B) if life.prefilling(l) and not life.copying[l]
                          and life.tail_full(l)]
            options += ["full_tail_prefill"] * 2 if full_tails else []
            later = self.hits_on_later_blocks() if idle and c.T > 1 else []
            options += ["later_block_hit"] * 2 if later else []
            # PD: an import_grow of a lane that needs none (idle, computing, its table covers
            # the prompt), an import_done while the table is short, with PREEMPT a second
            # import while one importing table grows
            options += ["import_grow_not_needed"] if pd else []
            short = [l for l in range(c.B) if life.needs_import_block(l)]
            options += ["short_import_done"] * 2 if pd and short else []
            options += ["second_import"] if (pd and idle and waiting
                                             and life.import_table_grows()) else []
            kind = pick(data, options, "kind")
            block = _ints(0, c.K - 1)
            expect: str | None
            if kind in ("unknown_id", "ended_id"):
                r = self.next_id + 3 if kind == "unknown_id" else pick(data, sorted(ended))
                call = pick(data, ("abort_waiting", "admit_miss", "admit_hit"))
                l = pick(data, idle) if idle else 0
                expect = "request_waiting" if idle or call == "abort_waiting" else "lane_idle"
                args: tuple[Any, ...] = {
                    "abort_waiting": (r,), "admit_miss": (l, r, data.draw(block)),
                    "admit_hit": (l, r, data.draw(block), data.draw(block), c.C)}[call]
            elif kind == "known_id":
                r = pick(data, sorted(life.status), "request")
                call, args, expect = "submit", (r, seq([1])), "request_is_new"
            elif kind == "bad_prompt":
                n = pick(data, (0, c.T * c.S, c.T * c.S + 1), "prompt length")
                call, args = "submit", (self.next_id, seq([1] * n))
                expect = "prompt_fits" if n else "prompt_not_empty"
            elif kind == "idle_lane":
                l = pick(data, idle)
                call, args, expect = pick(data, (
                    ("copy_done", (l,), "copy_in_flight"),
                    ("prefill", (l, 1), "lane_prefilling"),
                    ("finish", (l, False), "lane_decoding"),
                    ("abort_running", (l,), "lane_busy"),
                    ("fail", (l,), "lane_busy")))
            elif kind == "busy_lane":
                l, r = pick(data, busy), pick(data, waiting)
                call, args, expect = "admit_miss", (l, r, data.draw(block)), "lane_idle"
            elif kind == "owned_dst":  # any block of a lane's table
                l, r = pick(data, idle), pick(data, waiting)
                dst = pick(data, life.tables[pick(data, busy)], "block")
                call, args, expect = "admit_miss", (l, r, dst), "dst_reusable"
            elif kind == "scratch_dst":
                l, r = pick(data, idle), pick(data, waiting)
                call, args, expect = "admit_miss", (l, r, c.SCRATCH), "dst_reusable"
            elif kind == "uncached_src":
                l, r = pick(data, idle), pick(data, waiting)
                src = pick(data, uncached)
                call, args = "admit_hit", (l, r, src, data.draw(block), c.C)
                expect = "src_cached"
            elif kind == "discard_lane_block":
                b = pick(data, life.tables[pick(data, busy)], "block")
                call, args, expect = "discard", (b,), "not_a_lane_block"
            elif kind == "not_prefilled":  # idle, prefilling, transferring or decoded on
                l = pick(data, [l for l in range(c.B) if not life.prefilled(l)])
                call, args, expect = "export", (l,), "lane_prefilled"
            elif kind == "draining_block":  # no admission, padding row or discard uses it
                b = pick(data, sorted(life.draining))
                toks = self.decode_tokens(data)
                l, r = (idle or [0])[0], (waiting or [self.next_id])[0]
                calls = [("discard", (b,), "not_a_lane_block")]
                calls += [("admit_miss", (l, r, b), "dst_reusable"),
                          # (while an importing table grows with PREEMPT, refused first by
                          # one_import_table_growing)
                          ("admit_import", (l, r, b), "one_import_table_growing"
                           if life.import_table_grows() else "dst_reusable")
                          ] if idle and waiting else []
                calls += [("import_grow", (x, b), "dst_reusable")
                          for x in range(c.B) if life.needs_import_block(x)]
                calls += [("decode", (b, self.policy.local_pad(self.s), toks),
                           "scratch_target_ok")] if not all(
                    map(life.decoding, range(c.B))) and not any(
                    life.decoding(l) and life.tail_full(l) for l in range(c.B)) else []
                call, args, expect = pick(data, calls)
            elif kind == "bad_snapshot":  # a lane with no sliding state to save right now
                l = num(data, 0, c.B - 1, "lane")
                if life.snapshot_ok(l):
                    return
                computing = (life.prefilling(l) or life.decoding(l)) and not life.copying[l]
                call, args = "snapshot", (l,)
                expect = "next_boundary" if computing else "lane_computing"
            elif kind == "other_copy":  # copy_done ends a device copy, load_done a load
                l = pick(data, [l for l in range(c.B) if life.copying[l]], "lane")
                call, args, expect = (("load_done", (l,), "load_in_flight")
                                      if life.load_slot[l] is None
                                      else ("copy_done", (l,), "copy_in_flight"))
            elif kind == "grow_not_needed":  # idle, copying, moving, or room left / none
                l = num(data, 0, c.B - 1, "lane")
                if life.needs_block(l):
                    return
                dst = self.policy.reusable(s)
                call, args = "grow", (l, 0 if dst is None else dst)
                expect = ("lane_computing" if not life.computing(l) else "tail_full"
                          if not life.tail_full(l) else "table_not_full")
            elif kind == "grow_owned_dst":  # a block of a table, the scratch block, ...
                l = pick(data, needy, "lane")
                bad = [b for b in range(c.K) if not life.reusable(b)]
                if not bad:
                    return
                call, args, expect = "grow", (l, pick(data, bad, "dst")), "dst_reusable"
            elif kind == "full_tail_prefill":  # the adapter grows the lane first
                l = pick(data, full_tails, "lane")
                call, args, expect = "prefill", (l, 1), "chunk_within_block"
            elif kind == "later_block_hit":
                r, src, n = pick(data, later, "request, entry, n")
                dst = self.policy.reusable(s, exclude=src)
                dst = (src + 1) % c.K if dst is None else dst
                call, args, expect = ("admit_hit", (pick(data, idle, "lane"), r, src, dst, n),
                                      "src_first_block")
            elif kind == "import_grow_not_needed":  # not importing, or covered already
                covered = [l for l in range(c.B) if life.importing(l)
                           and not life.needs_import_block(l)]
                l = (pick(data, covered, "lane") if covered and coin(data, "covered")
                     else num(data, 0, c.B - 1, "lane"))
                if life.needs_import_block(l):
                    return
                dst = self.policy.reusable(s)
                call, args = "import_grow", (l, 0 if dst is None else dst)
                expect = "lane_importing" if not life.importing(l) else "table_short_of_prompt"
            elif kind == "short_import_done":  # the whole prompt, before the table covers it
                r = life.lane[pick(data, short, "lane")]
                call, args = "import_done", (r, seq(life.prompt[r]), data.draw(tokens))
                expect = "table_covers_prompt"
                Stats.events[IMPORT_SHORT] += 1
            elif kind == "second_import":  # with PREEMPT one importing table grows at a time
                dst = self.policy.reusable(s)
                call, args = "admit_import", (pick(data, idle, "lane"), pick(data, waiting),
                                              0 if dst is None else dst)
                expect = "one_import_table_growing"
            elif kind == "hit_past_snapshot":  # the prefix matches, the snapshots stop short
                r, src, n = pick(data, past, "request, entry, n")
                l = pick(data, idle, "lane")
                dst = self.policy.reusable(self.s, exclude=src)
                dst = (src + 1) % c.K if dst is None else dst  # a refused dst comes later
                call, args, expect = "admit_hit", (l, r, src, dst, n), "hybrid_snapshot_at_n"
            else:  # owned_pad: a padding row must not write a lane's block (any of its table)
                pad = pick(data, life.tables[pick(data, busy)], "pad")
                call, args = "decode", (pad, self.policy.local_pad(self.s),
                                        self.decode_tokens(data))
                overflow = any(life.decoding(l) and life.tail_full(l) for l in range(c.B))
                if not overflow and all(life.decoding(l) for l in range(c.B)):
                    return  # every row decodes: any pad is fine, nothing to reject
                expect = "no_block_overflow" if overflow else "scratch_target_ok"
            out = self.apply(call, *args)
            assert out.rejected == expect, (kind, call, args, out.rejected, expect)
            Stats.events[f"{call} {expect} rejected"] += 1

        def hits_on_later_blocks(self) -> list[tuple[int, int, int]]:
            """(waiting request, cache entry, n): hits of whole chunks whose prefix matches
            (n within the entry and below the prompt's length; hybrid: within its snapshots,
            which hybrid_snapshot_at_n checks first) on an entry that does not start its
            sequence (a full block of a table, or a tail after it): refused."""
            s, c = self.s, self.c
            out = []
            for r in self.waiting():
                p = s.prompt.get(r)
                for b in range(c.K):
                    if s.owner[b] != core.OWNER_CACHE or s.start[b] == 0:
                        continue
                    key = s.key[b]
                    most = min(len(key), len(p) - 1)
                    n = common_chunks(key, p, c.C, min(most, s.snap_upto[b]) if c.HYBRID
                                      else most)
                    if n:
                        out.append((r, b, n))
            return out

        def hits_past_snapshot(self) -> list[tuple[int, int, int]]:
            """(waiting request, cache entry, n): hybrid hits of whole chunks whose prefix
            matches (n within the entry and below the prompt's length) but that reach past
            the entry's snapshots."""
            s, c = self.s, self.c
            out = []
            for r in self.waiting():
                p = s.prompt.get(r)
                for b in range(c.K):
                    if s.owner[b] != core.OWNER_CACHE:
                        continue
                    key = s.key[b]
                    n = common_chunks(key, p, c.C, min(len(key), len(p) - 1))
                    if n > s.snap_upto[b]:
                        out.append((r, b, n))
            return out

        def later_hits_past_snapshot(self) -> list[tuple[int, int, int]]:
            """(lane, cache entry, n): hybrid hits past the first block (a prefilling lane that
            needs its next block, an entry at its boundary whose key agrees with its prompt up
            to there and n more tokens: whole chunks, within a block, a prompt token left) that
            reach past the entry's snapshots."""
            s, c, life = self.s, self.c, self.life
            out = []
            for l in range(c.B):
                if not (life.prefilling(l) and life.needs_block(l)):
                    continue
                at, p = life.length[l], life.seq[l]
                for b in range(c.K):
                    key = s.key[b]
                    if (s.owner[b] != core.OWNER_CACHE or s.start[b] != at
                            or tuple(key[:at]) != p[:at]):
                        continue
                    limit = min(c.S, len(key) - at, len(p) - 1 - at)
                    n = common_chunks(key, p, c.C, limit, at)
                    if n and at + n > s.snap_upto[b]:
                        out.append((l, b, n))
            return out

        def foreign_tier_calls(self) -> None:
            """Whatever state a run ends in, a configuration refuses the actions of a tier it
            does not have: without the hybrid prefix cache every snapshot, without the host
            tier every spill and host hit past the first block (H = 0: the core refuses the
            slot index, there being none) and every load event (no lane is loading), without
            PREEMPT every preemption, without the prefix cache or with tables of one block
            every hit past the first block (by the guard the lifecycle model names: an idle,
            decoding or copying lane, a tail not full (T = 1: a prefilling lane's never is), no
            entry). With PREEMPT (PD runs with it too), an import of a request submitted for it
            (and aborted): refused while an importing table grows (one grows at a time), else
            into a block it may not take (refused by dst_reusable alone, so no run without PD
            admits one)."""
            c, life = self.c, self.life
            if not (c.PREFIX and c.T > 1):
                for l in range(c.B):
                    assert self.apply("grow_hit", l, 0, 0, c.C).rejected is not None
            if not (c.HYBRID and c.PREFIX):
                for l in range(c.B):
                    assert self.apply("snapshot", l).rejected == "hybrid_prefix_cache"
            if not c.HOST:
                # (H = 0: there is no slot to name, and the core refuses the index by name
                # before any guard runs, in the action, its guard and its plan alike)
                for b in range(c.K):
                    for fn in (core.spill, core.spill_guard, core.spill_plan):
                        with pytest.raises(IndexError, match="spill: h=0 is not a Slot"):
                            fn(self.s, b, 0)
                for l in range(c.B):
                    assert life.load_slot[l] is None  # nothing to load from
                    assert self.apply(("load_done", "load_fail")[l % 2], l).rejected == (
                        "load_in_flight")
                    with pytest.raises(IndexError, match="grow_host_hit: h=0 is not a Slot"):
                        core.grow_host_hit(self.s, l, 0, 0, c.C)
                Stats.events[NO_SLOT] += 1
            if not c.PREEMPT:
                for l in range(c.B):
                    assert self.apply("preempt", l).rejected == "preemption_on"
            elif None in life.lane and (life.import_table_grows() or not all(
                    map(life.reusable, range(c.K)))):
                # (a request of its own, aborted at once: an id the run's steps never name, so
                # that the rest of the teardown runs as it would without it)
                r = 10**6 + self.next_id
                assert self.apply("submit", r, seq(STEMS[0][:1])).rejected is None
                grows = life.import_table_grows()
                dst = 0 if grows else min(b for b in range(c.K) if not life.reusable(b))
                out = self.apply("admit_import", life.lane.index(None), r, dst)
                assert out.rejected == ("one_import_table_growing" if grows
                                        else "dst_reusable"), out.rejected
                assert self.apply("abort_waiting", r).rejected is None

        def teardown(self) -> None:
            """Drain as a scheduler runs until idle: end every transfer, copy, load and store
            (some loads and stores fail), complete imports and exports, run each request to
            its end (prefill; with pd, some are exported; some decode to the table end; finish
            into the cache; a quarter are aborted or failed instead) and admit the waiting ones
            as the policy chooses (every third abandoned instead); paged tables with the prefix
            cache: then a miss beside a cached later block (`miss_beside_later_block`), drained
            too; with pd and paged tables, two transfers of several blocks
            (`paged_transfers`); then check each request ended exactly once and nothing is left
            in flight.
            With preemption, at capacity, first every request runs to its end as the scheduler
            runs it, preempting (`run_to_completion`): none is abandoned. Not after a
            `ModelDivergence` (hypothesis tears down a failed run too): every later step would
            report the same divergence, under its own name."""
            if not hasattr(self, "life") or self.diverged:
                return
            self.foreign_tier_calls()
            life = self.life
            if self.c.PREEMPT and self.at_capacity:
                self.run_to_completion()
                self.storm_once()
                self.imports_with_preemption()
            self.drain()
            if self.c.T > 1 and self.c.PREFIX and self.miss_beside_later_block():
                self.drain()
            if pd:
                self.paged_transfers()
            assert all(x in ENDED and life.ends[r] == 1 for r, x in life.status.items())
            assert not any(self.s.busy) and self.quiescent() and not any(self.s.transfer)
            assert set(life.slot_state) <= {"EMPTY", "STORED"}, life.slot_state
            assert not any(self.s.lane_snap), self.s.lane_snap  # idle lanes have no snapshots
            self.forget_all()

        def forget_all(self) -> None:
            """After the drain, without draws: a request never submitted is refused, every
            ended one is forgotten, and then the core holds no request at all (a long-running
            scheduler's state does not grow with the requests it served)."""
            if "forget" not in core.ACTIONS:
                return
            assert self.apply("forget", self.next_id + 3).rejected == "request_ended"
            for r in sorted(self.life.status):
                assert self.apply("forget", r).rejected is None
            assert len(self.s.phase) == 0 and len(self.s.prompt) == 0, self.s.phase

        def paged_transfers(self) -> None:
            """After the drain (every lane idle, nothing in flight), with paged tables (T > 1)
            and at capacity (with preemption too: no other table grows, and one lane's whole
            table is free), the PD situations tables of several blocks exist for, without draws
            (so that coverage does not hang on the rules' draws): a prompt of T * S - 1 tokens
            is imported into an idle lane whose table grows to cover it (before, its
            import_done is refused, and so are an export and a grow into its own block; after,
            one more grow), lands, is exported again (every block pinned) and cancelled (every
            block drains, and one transfer_end, after a misdirected one, frees them all); a
            second is cancelled mid-import, drained and freed the same way; then late events
            for it are refused by each guard that exists for them."""
            c, life = self.c, self.life
            if c.T < 2 or not self.at_capacity:
                return
            p = seq(tuple(ALPHABET[i % len(ALPHABET)] for i in range(c.T * c.S - 1)))
            for lands in (True, False):
                r = self.next_id
                self.next_id += 1
                assert self.apply("submit", r, p).rejected is None
                l, dst = life.lane.index(None), self.policy.reusable(self.s)
                assert dst is not None and self.apply("admit_import", l, r, dst).rejected is None
                self.refuse_short_import(None, l)
                assert self.apply("export", l).rejected == "lane_prefilled"
                assert self.apply("import_grow", l, dst).rejected == "dst_reusable"
                assert self.import_grow_by_policy(None, l)
                assert self.apply("import_grow", l, dst).rejected == "table_short_of_prompt"
                if lands:
                    assert self.apply("import_done", r, p, ALPHABET[0]).rejected is None
                    assert self.apply("export", l).rejected is None
                assert len(life.tables[l]) > 1, life.tables[l]
                assert self.apply("fail" if lands else "abort_running", l).rejected is None
                assert self.apply("transfer_end", self.next_id + 5, dst).rejected == (
                    "transfer_of_request")
                assert self.apply("transfer_end", r, dst).rejected is None
                assert not life.draining, life.draining
            for call, args, expect in (
                    ("transfer_end", (r, dst), "block_draining"),
                    ("import_done", (r, p, ALPHABET[0]), "request_importing"),
                    ("transfer_fail", (r,), "request_transferring"),
                    ("export_done", (r, False), "request_exporting")):
                assert self.apply(call, *args).rejected == expect, (call, expect)

        def drain(self) -> None:
            """teardown's scheduler loop, until every request has ended. It never preempts
            (with preemption, `run_to_completion` ran first; below capacity a preempted lane
            could be admitted and preempted forever): a lane with no block is cancelled."""
            life = self.life
            while True:
                if life.draining:
                    b = min(life.draining)
                    if "forget" in core.ACTIONS:  # its transfer's end will name it
                        assert self.apply("forget", life.draining[b]).rejected == \
                            "no_transfer_of_request"
                    self.misdirected_transfer_end(b)
                    self.apply("transfer_end", life.draining[b], b)
                elif life.slot_block:
                    h = min(life.slot_block)
                    self.apply(("store_done", "store_fail")[h % 2], h)
                elif any(life.copying):
                    l = life.copying.index(True)
                    load = ("load_done", "load_fail")[life.lane[l] % 2]
                    self.apply("copy_done" if life.load_slot[l] is None else load, l)
                elif life.in_phase("importing"):
                    r = life.in_phase("importing")[0]
                    l = life.lane.index(r)
                    if not life.covers_prompt(l):
                        # its KV is not asked for before the table covers the prompt (an
                        # import_done now is refused): it grows, as the adapter does (below
                        # capacity there may be no block for it: the request is cancelled)
                        if not Stats.events[IMPORT_SHORT]:  # (once a run)
                            self.refuse_short_import(None, l)
                        if not self.grow_by_policy(preempt=False) and life.needs_import_block(l):
                            self.apply(("abort_running", "fail")[r % 2], l)
                        continue
                    if r % 4 == 3:  # a quarter are cancelled mid-import: every block drains
                        self.apply(("abort_running", "fail")[r // 4 % 2], l)
                        continue
                    # a payload one token short first: refused (covers_prompt), nothing changes
                    short = life.prompt[r][:-1]
                    assert self.apply("import_done", r, seq(short), ALPHABET[0]).rejected \
                        == "covers_prompt"
                    Stats.events["prefix import rejected"] += 1
                    longer = life.prompt[r] + (ALPHABET[0],)  # the first token's KV too
                    assert self.apply("import_done", r, seq(longer), ALPHABET[0]).rejected \
                        == "covers_prompt"
                    Stats.events["longer import rejected"] += 1
                    self.apply("import_done", r, seq(life.prompt[r]), ALPHABET[0])
                elif life.in_phase("exporting"):
                    self.apply("export_done", life.in_phase("exporting")[0], self.c.PREFIX)
                elif any(r is not None for r in life.lane):
                    l = next(l for l in range(self.c.B) if life.lane[l] is not None)
                    r = life.lane[l]
                    # the adapter's growth before each call (below capacity there may be no
                    # block for it: the request is cancelled); before it, a prefill and a grow
                    # into a lane's block are refused
                    if life.needs_block(l):
                        if life.prefilling(l):
                            assert self.apply("prefill", l, 1).rejected == "chunk_within_block"
                        assert self.apply("grow", l, life.tail(l)).rejected == "dst_reusable"
                    elif (life.computing(l) and not life.tail_full(l)
                          and not Stats.rejected["grow", "tail_full"]):
                        # room left in its tail: no next block yet (once a run, so that
                        # coverage does not hang on the rules' draws)
                        dst = self.policy.reusable(self.s)
                        assert self.apply("grow", l, 0 if dst is None else dst
                                          ).rejected == "tail_full"
                    grown = self.grow_by_policy(preempt=False) or not life.needs_block(l)
                    if r % 4 == 3 or not grown:  # a quarter are cancelled: aborted or failed
                        self.apply(("abort_running", "fail")[r // 4 % 2], l)
                    elif pd and life.prefilled(l) and r % 2:
                        self.apply("export", l)  # a prefill worker's: sent (every block)
                    elif life.decoding(l) and (r % 3 == 1 or self.c.T > 1 and not Stats.events[
                            "decode refused at a full table"]) and self.decode_by_policy(
                            tuple(ALPHABET[:1]) * self.c.B, preempt=False).rejected is None:
                        # a long answer: decoded to the table end (then refused); with paged
                        # tables at least once per run, so a full table is always reached
                        pass
                    elif life.table_end(l) and (r % 3 == 1 or not Stats.rejected[
                            "grow", "table_not_full"]):  # no next block there (once a run)
                        dst = self.policy.reusable(self.s)
                        assert self.apply("grow", l, 0 if dst is None else dst
                                          ).rejected == "table_not_full"
                        self.apply("finish", l, self.c.PREFIX)
                    elif life.decoding(l):
                        self.apply("finish", l, self.c.PREFIX)
                    else:  # the next chunk (a snapshot at a boundary, as the policy takes them)
                        self.apply("prefill", l, ALPHABET[r % len(ALPHABET)])
                        if self.policy.snapshot(self.s, l):
                            self.apply("snapshot", l)
                elif self.waiting():
                    r = self.waiting()[0]
                    # every third is abandoned; the others are admitted, unless the policy
                    # declines (only below capacity)
                    if r % 3 == 2 or not self.admit_by_policy(r):
                        self.apply("abort_waiting", r)
                else:
                    break

        @invariant()
        def count_step(self) -> None:
            Stats.steps += 1

    CoreMachine.__name__ = CoreMachine.__qualname__ = f"CoreMachine_{core.__name__}"
    rules = {k for k, v in vars(CoreMachine).items() if hasattr(v, "hypothesis_stateful_rule")}
    assert PD_RULES | PREEMPT_MACHINE_RULES <= rules, PD_RULES - rules
    if focus is None and pd and preempt:
        return CoreMachine
    focus = (rules if focus is None else focus) - (set() if pd else PD_RULES)
    focus -= set() if preempt else PREEMPT_MACHINE_RULES
    assert focus <= rules, focus - rules
    # A rule attribute shadowed by None is no rule (hypothesis collects marked members).
    return type(f"Focused{CoreMachine.__name__}", (CoreMachine,),
                dict.fromkeys(rules - focus))


# --------------------------------------------------------------------------------- tests


class Tally(NamedTuple):
    """What one machine run applied, refused (per guard) and reached (Stats)."""

    pd: bool
    applied: Counter[str]
    rejected: Counter[tuple[str, str]]
    events: Counter[str]
    preempt: bool = False  # the configurations have PREEMPT


def run_machine(config: st.SearchStrategy[Any], pd: bool, preempt: bool = False) -> Tally:
    Stats.reset()
    run_state_machine_as_test(make_machine(config=config, pd=pd, preempt=preempt))
    return Tally(pd, Counter(Stats.applied), Counter(Stats.rejected), Counter(Stats.events),
                 preempt)


def check_coverage(tier: str, prefix: bool, *runs: Tally) -> None:
    """Not vacuous, over the runs of one configuration family: every action it can take was
    applied, and no run applied one it cannot (hits need the prefix cache, PD actions pd,
    snapshot the hybrid tier, the host actions (grow_host_hit too) the host tier, preempt
    PREEMPT; every tier grows tables of several blocks, and with the prefix cache hits past
    the first block); some lane reached the block end (decode refused until it finishes), and
    the table end; and the situations each feature exists for happened."""
    actions = set(committed.ACTIONS)
    cannot = set() if prefix else {"admit_hit", "copy_done", "grow_hit"}
    cannot |= set() if tier == "hybrid" else {"snapshot"}
    cannot |= set() if tier == "host" else set(HOST_ACTIONS)
    for run in runs:
        off = cannot | (set() if run.pd else set(PD_ACTIONS))
        off |= set() if run.preempt else {"preempt"}
        assert not off & set(run.applied), (run.pd, run.preempt, off & set(run.applied))
    applied = {a for run in runs for a in run.applied}
    rejected = {k for run in runs for k, v in run.rejected.items() if v}
    events = {k for run in runs for k, v in run.events.items() if v}
    expected = actions - cannot - (set() if any(run.pd for run in runs) else set(PD_ACTIONS))
    expected -= set() if any(run.preempt for run in runs) else {"preempt"}
    assert expected <= applied, expected - applied
    assert ("decode", "no_block_overflow") in rejected
    # Each tier's actions are refused where they do not belong, and at wrong times.
    want = {("snapshot", "hybrid_prefix_cache")} if tier != "hybrid" else {
        ("snapshot", "lane_computing"), ("snapshot", "next_boundary"),
        ("admit_hit", "hybrid_snapshot_at_n")}
    want |= {("load_done", "load_in_flight")} if tier != "host" else {
        ("spill", "entry_cached"), ("spill", "entry_unpinned"), ("spill", "slot_empty"),
        ("host_evict", "slot_stored"), ("admit_host_hit", "slot_stored"),
        ("store_done", "slot_storing"), ("store_fail", "slot_storing"),
        ("load_done", "load_in_flight"), ("load_fail", "load_in_flight"),
        ("copy_done", "copy_in_flight")}
    # grow_hit (everywhere: `foreign_tier_calls`) and, with the host tier (without it there is
    # no slot to name), grow_host_hit: a lane that is not prefilling
    want |= {("grow_hit", "lane_prefilling")}
    want |= {("grow_host_hit", "lane_prefilling")} if tier == "host" else set()
    # paged tables (every tier: T in 1..3): grow refused by each of its guards, a prefill
    # past a full tail, a hit on an entry that starts later in its sequence
    want |= {("grow", "lane_computing"), ("grow", "tail_full"), ("grow", "table_not_full"),
             ("grow", "dst_reusable"), ("prefill", "chunk_within_block")}
    want |= {("admit_hit", "src_first_block")} if prefix else set()
    # with the prefix cache, a hit past the first block refused by each of its guards but
    # table_not_full (a prefilling lane has a token left to compute, so its full tail is
    # never the table's last block); hybrid: one past the entry's snapshots too
    want |= {("grow_hit", g) for g in (
        "no_copy_in_flight", "tail_full", "src_cached", "src_at_the_boundary",
        "n_whole_chunks", "n_within_block", "n_within_entry", "token_left_to_compute",
        "prefix_matches", "dst_not_src", "dst_reusable")} if prefix else set()
    want |= {("grow_hit", "hybrid_snapshot_at_n")} if tier == "hybrid" else set()
    # a decoding lane filled its whole table (decode refused until it finishes); with the
    # prefix cache, a table of several blocks became cache entries, a hit reached a full
    # first block, a hit went on past it (the lane's next block copied from the entry at
    # that position), and a miss was not blocked by a later block sharing its first chunk;
    # hybrid: a hit past the first block restored the sliding state at its end, and the
    # policy chose one (or none) where an entry's key went on past its snapshots (a hit on a
    # full first block shows a full block kept its lane's snapshots: hybrid_snapshot_at_n)
    paged = {"decode refused at a full table"}
    paged |= {"table of several blocks cached", "hit on a full first block",
              "hit past the first block", "miss beside a later block's entry"
              } if prefix else set()
    paged |= {HYBRID_LATER_HIT, SNAPSHOT_CAP} if tier == "hybrid" else set()
    assert paged <= events, paged - events
    if any(run.preempt for run in runs):
        # preempt refused by its guards (but preemption_on); preemptions for a lane's
        # next block (in a storm: every lane at a block boundary, no block left) and for a
        # decode call's padding target (dynamic scratch: B >= 2 lanes share K = T + 1);
        # preempted requests admitted again and finished, and drained at the end of a run
        # (requeue_fits needs a lane at its table end while another waits
        # for a block: reached in most runs, not all; its mutant, preempt-requeue_fits, shows
        # the machine gets there)
        want |= {("preempt", g) for g in ("lane_computing", "a_lane_waits_for_a_block",
                                          "no_block_reusable")}
        preempted = {"preempt for a next block", "preempt storm: every lane at a block boundary",
                     "preempted request finished", "preempted requests drained",
                     "victim is a lane that waits"}
        if any(run.preempt and run.pd for run in runs):
            # PD with preemption: an import refused while another importing table grows,
            # imports that landed, an importing table that grew by preempting a computing lane,
            # and imported requests preempted later (they decode) that were admitted again
            # and finished
            want |= {("admit_import", "one_import_table_growing")}
            preempted |= {IMPORT_WITH_PREEMPTION, IMPORT_BLOCK_PREEMPTED, IMPORTED_PREEMPTED,
                          IMPORTED_PREEMPTED_FINISHED}
        assert preempted <= events, preempted - events
    if not all(run.preempt for run in runs):
        want |= {("preempt", "preemption_on")}
    assert want <= rejected, want - rejected
    if tier != "host":  # a slot index, there being no slot (`foreign_tier_calls`)
        assert NO_SLOT in events
    if tier == "hybrid":
        # a miss is not blocked by an entry that shares its first chunk but has no snapshot
        assert "miss beside an entry without a snapshot" in events
    if tier == "host":
        # the batcher's flow (spill the victim, hit the host copy), a slot is never evicted
        # while a store writes it or a load reads it, a copy's source is never spilled, and a
        # cancelled load leaves its slot a host entry
        host = {"policy spill", "policy host hit", "host_evict of a STORING slot rejected",
                "host_evict of a LOADING slot rejected", "spill of a pinned entry rejected",
                "load cancelled"}
        # paged tables: a hit past the first block loaded from the host (the policy's too),
        # refused by each of its guards but table_not_full (as grow_hit's), a load into a
        # later block that failed, a host entry of a later block refused to an admission
        host |= {"host hit past the first block", "policy host hit past the first block",
                 LATER_LOAD_FAILED}
        assert host <= events, host - events
        want = {("grow_host_hit", g) for g in (
            "no_copy_in_flight", "tail_full", "slot_stored", "slot_at_the_boundary",
            "n_whole_chunks", "n_within_block", "n_within_entry", "token_left_to_compute",
            "prefix_matches", "dst_reusable")}
        want |= {("admit_host_hit", "slot_first_block")}
        assert want <= rejected, want - rejected
    for run in runs:
        if run.pd:
            check_pd_coverage(run)


def check_pd_coverage(run: Tally) -> None:
    """PD: blocks drained (abort or failure of a transferring lane) and were released by
    transfer_end; partial or mismatched payloads were refused; late, duplicate and misdirected
    events were refused by each guard that exists for them. Paged tables (T = 1..3): imports
    into tables of several blocks (grown by import_grow) landed, tables of several blocks were
    exported, an importing lane of several blocks was cancelled and one transfer_end freed
    every block draining for its request, an import_done was refused while the table was
    short of the prompt, and import_grow was refused by each guard that can refuse it
    (table_not_full cannot: a table short of a prompt of fewer than T * S tokens has room)."""
    paged = {MULTI_IMPORT, MULTI_EXPORT, IMPORT_DRAINS, DRAINS_END_TOGETHER, IMPORT_SHORT}
    assert all(run.events[k] for k in paged), {k: run.events[k] for k in paged}
    grow = [("import_grow", g) for g in ("lane_importing", "table_short_of_prompt",
                                         "dst_reusable")]
    grow += [("import_done", "table_covers_prompt")]
    assert all(run.rejected[k] for k in grow), {k: run.rejected[k] for k in grow}
    assert run.events["drain released"] > 0
    assert run.events["abort_running drains"] > 0 and run.events["fail drains"] > 0
    assert run.events["prefix import rejected"] > 0
    assert run.rejected["import_done", "covers_prompt"] > run.events["prefix import rejected"]
    late = [("import_done", "request_importing"), ("transfer_fail", "request_transferring"),
            ("export_done", "request_exporting"), ("transfer_end", "block_draining"),
            ("transfer_end", "transfer_of_request"), ("export", "lane_prefilled")]
    assert all(run.rejected[k] for k in late), {k: run.rejected[k] for k in late}


@pytest.mark.parametrize("pd", [False, True], ids=["colocated", "pd"])
@pytest.mark.parametrize("prefix,scratch", FEATURES,
                         ids=[f"{'prefix' if p else 'noprefix'}-{s}" for p, s in FEATURES])
def test_core_machine(prefix: bool, scratch: str, pd: bool) -> None:
    """Invariants, transition invariants, progress, the lifecycle model (every guard
    predicted), policy refinement and the ghost-off mirror, over B in 1..3, K from the proved
    minimum to minimum + 2: the colocated workload, and (pd) the same with prefill/decode
    disaggregation mixed in."""
    check_coverage("plain", prefix, run_machine(configs(committed, prefix, scratch), pd))


@pytest.mark.parametrize("pd", [False, True], ids=["colocated", "pd"])
@pytest.mark.parametrize("prefix,scratch", FEATURES,
                         ids=[f"{'prefix' if p else 'noprefix'}-{s}" for p, s in FEATURES])
def test_core_machine_preempt(prefix: bool, scratch: str, pd: bool) -> None:
    """The same checks with PREEMPT (T in 2..3, K from the preemption rule's minimum, T + 1
    with several lanes, to below every lane's whole table): preemptions as the adapter takes
    them (the policy's victim when a lane waits for a block and none is reusable; refinement:
    never the oldest lane while another may go) and with drawn lanes (every guard predicted),
    preempt storms (`storm`), and runs that end with every request finished
    (`run_to_completion`). pd: the same with prefill/decode disaggregation mixed in (one
    importing table grows at a time, taking blocks from computing lanes; an imported request
    that is preempted later is recomputed here)."""
    config = configs(committed, prefix, scratch, preempt=True)
    check_coverage("plain", prefix, run_machine(config, pd, preempt=True))


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("tier", TIERS)
def test_core_machine_tier_preempt(tier: str, scratch: str) -> None:
    """PREEMPT with a tier of the prefix cache, every check of the two families (the tier's,
    preemption's) over the same runs. Hybrid: a preempted lane's snapshots go with it (its
    full blocks are freed, never cached), and its restart takes new ones or a hit's. Host: a
    lane loading from the host is never preempted (`lane_computing`), and entries are
    spilled and loaded back between preemptions."""
    config = configs(committed, True, scratch, tier=tier, preempt=True)
    check_coverage(tier, True, run_machine(config, False, preempt=True))


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("tier", TIERS)
def test_core_machine_tier(tier: str, scratch: str) -> None:
    """The same checks with a tier of the prefix cache, colocated and then with PD mixed in,
    T in 1..3: hybrid (snapshots of the sliding state at chunk boundaries, taken at the right
    and wrong times; hits, at an admission or past the first block, only as deep as the
    entry's snapshots; misses beside entries without one) and host (entries spilled into 1..2
    host slots and loaded back, into a first block or a later one; stores and loads that fail;
    evictions, spills and hits refused while a slot is busy, spills while a copy reads the
    entry). The tier's coverage is over both runs."""
    config = configs(committed, True, scratch, tier=tier)
    check_coverage(tier, True, run_machine(config, False), run_machine(config, True))


def test_preempt_when_tables_fill_every_block() -> None:
    """B = 3, T = 2, S = 2, dynamic scratch, K = 4 (above the rule's T + 1 = 3): two lanes fill
    whole tables, one token short of their end, lane 2 idle. The decode call needs a padding
    target and there is none. Found by this machine when `requeue_fits` refused a sequence of
    T * S tokens (neither lane could go: stuck, at a K above a safe one); a restart of T * S
    tokens prefills them all and finishes at the table's end, so a lane may go."""
    c = committed.Consts(B=3, K=4, C=1, S=2, T=2, PREFIX=False, RESERVED=False, SCRATCH=3,
                         HYBRID=False, HOST=False, H=0, PREEMPT=True)
    assert c.K >= min_blocks(c.B, False, "dynamic", c.T, preempt=True)
    s = committed.init(c, True)
    steps = []
    for r in (0, 1):
        steps += [("submit", r, seq([1, 2, 3])), ("admit_miss", r, r, r), ("prefill", r, 1),
                  ("prefill", r, 1), ("grow", r, r + 2), ("prefill", r, 1)]
    for name, *args in steps:
        out = committed.ACTIONS[name][0](s, *args)
        assert out.rejected is None, (name, args, out.rejected)
        s = out.state
    assert committed.decode_guard(s, 3, 0, (0, 0, 0)) is not None  # no padding target
    assert committed.preempt_guard(s, 1) is None
    assert committed.progress_violations(s) == []


def test_core_machine_below_capacity() -> None:
    """One block below the proved minimum the core may get stuck, but stays safe."""
    config = st.one_of(*(configs(committed, p, s, extra=(-1, -1)) for p, s in FEATURES),
                       *(configs(committed, True, s, extra=(-1, -1), tier=t)
                         for t in TIERS for s in ("reserved", "dynamic")),
                       *(configs(committed, p, s, extra=(-1, -1), preempt=True)
                         for p, s in FEATURES))
    run_state_machine_as_test(make_machine(config=config, preempt=True))


def test_mirror_catches_a_ghost_off_divergence() -> None:
    """The ghost-off comparison has teeth: a mirror core that forgets `finish`'s key update
    (a non-ghost field) is caught by the field comparison, not by an invariant."""
    forgetful = codegen.load(MODEL.without_update("finish", "key"), "atom_core_mirror_mutant")
    machine = make_machine(config=configs(committed, True, "dynamic"), mirror_core=forgetful)
    with pytest.raises(MirrorDivergence) as info:
        run_state_machine_as_test(machine, settings=_search_settings())
    assert info.value.what == "key"


def _search_settings() -> settings:
    """Stop at the first failure, without shrinking: the failure is the point, and the test
    inspects it. The example budget is generous so random profiles find it too. Runs are long
    on purpose (the deep profile's 200 steps trip `large_base_example` on focused machines).
    No example database: a failure saved by an earlier version of the machine (or of the spec)
    replays as a different step sequence, which may trip another check than the expected one
    (every mutant run ends in a failure, so each one would be saved)."""
    return settings(settings.default, max_examples=1000, report_multiple_bugs=False,
                    phases=[Phase.explicit, Phase.generate], database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])


class Mutant(NamedTuple):
    """A planted bug: the spec variant, the features it shows in, the check that must catch
    it (an invariant's name, or `lifecycle:<guard>`: the core did not refuse a step the
    lifecycle model predicts that guard refuses, `lifecycle:accepted`: it refused one the
    model predicts it accepts, `progress:<property>`, `refinement:<action>`: the policy's
    choice was refused, `model:<action>`: after that step the core's state differs from the
    lifecycle model's; several when either may come first), the rules the search needs
    (None: every rule), whether the machine takes PD actions, the tier ("plain",
    "hybrid", "host"), the range of T (blocks per lane table) and PREEMPT (`configs`' preempt:
    None is PREEMPT off with K as low as with it)."""

    build: Callable[[], Any]
    features: tuple[bool, str]
    expected: str | tuple[str, ...]
    focus: set[str] | None
    pd: bool = False
    tier: str = "plain"
    tables: tuple[int, int] = (1, 1)
    preempt: bool | None = False


# Each mutant removes or weakens one guard or update. focus keeps only the rules the bug
# needs, so the search stays within a few seconds; the rules and every check are the same
# machine's.
HIT_RULES = {"submit", "advance", "admit_arbitrary"}
PD_FLOW = {"pd_flow"}
HYBRID_FLOW = {"hybrid_flow"}
HOST_FLOW = {"host_flow"}
GROW_RULES = {"submit", "advance", "grow"}
GROW_HIT_RULES = {"submit", "advance", "grow_hit"}
# (the grow_hit rule draws grow_host_hit calls too with the host tier; paged_flow's turns go on
# from conversations whose later blocks were spilled to the host)
HOST_GROW_RULES = {"submit", "advance", "grow_hit", "paged_flow"}
PREEMPT_RULES = {"submit", "advance", "storm", "preempt"}
MUTANTS: dict[str, Mutant] = {
    # A hit copying into its own source (or, when the source is pinned by another lane's copy,
    # dst_reusable refuses it where the lifecycle model expects dst_not_src).
    "admit_hit-dst_not_src": Mutant(
        lambda: MODEL.without_guard("admit_hit", "dst_not_src"),
        (True, "dynamic"), ("copy_source_cached", "lifecycle:dst_not_src"), HIT_RULES),
    "decode-scratch_target_ok": Mutant(
        lambda: MODEL.without_guard("decode", "scratch_target_ok"),
        (False, "dynamic"), "lane_holds_its_tokens", None),
    "finish-key": Mutant(
        lambda: MODEL.without_update("finish", "key"),
        (True, "dynamic"), "cache_key_is_content", None),
    "admit_miss-dst_reusable": Mutant(
        lambda: MODEL.without_guard("admit_miss", "dst_reusable"),
        (False, "dynamic"), "no_block_in_two_tables",
        {"submit", "admit", "admit_arbitrary", "must_reject"}),
    "copy_done-copying": Mutant(
        lambda: MODEL.without_update("copy_done", "copying"),
        (True, "dynamic"), "copy_target_not_ready", None),
    "abort_running-copying": Mutant(
        lambda: MODEL.without_update("abort_running", "copying"),
        (True, "reserved"), "copy_only_while_prefilling",
        {"submit", "admit", "advance", "abort"}),
    "finish-keep_needs_prefix_cache": Mutant(
        lambda: MODEL.without_guard("finish", "keep_needs_prefix_cache"),
        (False, "reserved"), "cache_needs_prefix_cache", None),
    # A prompt that does not fit a table is accepted: past T * S tokens the invariant tells;
    # at exactly T * S (which waiting_prompt_fits allows: a preempted request's prompt may be
    # that long) only the lifecycle model does.
    "submit-prompt_fits": Mutant(
        lambda: MODEL.without_guard("submit", "prompt_fits"),
        (False, "dynamic"), ("waiting_prompt_fits", "lifecycle:prompt_fits"), None),
    # A hit of any n > 0 (not whole chunks) is accepted, and breaks the chunk boundary; the
    # lifecycle model, which predicts every guard, also notices when a later guard refuses it.
    "admit_hit-n_whole_chunks-weakened": Mutant(
        lambda: _weakened_chunk_guard(),
        (True, "dynamic"), ("prefill_on_chunk_boundary", "lifecycle:n_whole_chunks"),
        HIT_RULES),
    # PD (T = 1..3: imports and exports of one block or several). A partial or mismatched
    # payload is imported as if it were the prompt's KV.
    "import_done-covers_prompt": Mutant(
        lambda: MODEL.without_guard("import_done", "covers_prompt"),
        (False, "dynamic"), "lane_holds_its_tokens", PD_FLOW, pd=True, tables=(1, 3)),
    # covers_prompt off by one: the payload must hold the first token's KV too. The real
    # payload is refused (only the lifecycle model notices: a transfer may always fail, so no
    # progress property does), and an over-long one is imported.
    "import_done-covers_prompt-off-by-one": Mutant(
        lambda: _import_needs_first_token(),
        (False, "dynamic"), ("lane_holds_its_tokens", "lifecycle:accepted"), PD_FLOW, pd=True,
        tables=(1, 3)),
    # A late transfer_end naming another request frees a block whose transfer still runs: the
    # ghost says that transfer still uses the block (any block of its table, not only its
    # first), so the pin it lost breaks an invariant before the lifecycle model's check.
    "transfer_end-transfer_of_request": Mutant(
        lambda: MODEL.without_guard("transfer_end", "transfer_of_request"),
        (False, "reserved"), ("running_transfer_pins_its_block", "transfer_pins_what_it_uses",
                              "lifecycle:transfer_of_request"),
        PD_FLOW | {"late_pd_event"}, pd=True, tables=(1, 3)),
    # A transfer_end for a block that is not draining (named with its transfer's request) is
    # accepted: a running lane's block is freed (lane_block_owned); when the block is free or
    # cached the state stays consistent, and only the lifecycle model notices.
    "transfer_end-block_draining": Mutant(
        lambda: MODEL.without_guard("transfer_end", "block_draining"),
        (False, "dynamic"), ("lane_block_owned", "lifecycle:block_draining"),
        PD_FLOW | {"late_pd_event"}, pd=True, tables=(1, 3)),
    "admit_import-transfer": Mutant(
        lambda: MODEL.without_update("admit_import", "transfer"),
        (False, "dynamic"), "moving_lane_has_transfer", PD_FLOW, pd=True, tables=(1, 3)),
    "export_done-transfer": Mutant(
        lambda: MODEL.without_update("export_done", "transfer"),
        (True, "dynamic"), "transfer_block_held", PD_FLOW, pd=True, tables=(1, 3)),
    # Abort and failure free a transferring lane's blocks instead of draining them.
    "cancel-frees": Mutant(
        lambda: _cancel_frees(), (False, "reserved"), "transfer_block_held", PD_FLOW, pd=True,
        tables=(1, 3)),
    # export from any decoding lane, not only one that has just prefilled.
    "export-lane_prefilled-weakened": Mutant(
        lambda: _weakened_export_guard(),
        (False, "reserved"), "export_after_prefill", PD_FLOW | {"advance"}, pd=True, tables=(1, 3)),
    # An import may take a draining block (whose old transfer still writes into it). (As for
    # transfer_end-transfer_of_request: a draining block that is not its transfer's first one
    # is pinned by no invariant, and only the lifecycle model notices.)
    "admit_import-reuses-draining": Mutant(
        lambda: _import_reuses_draining(),
        (False, "dynamic"), ("running_transfer_pins_its_block", "lifecycle:dst_reusable"),
        PD_FLOW | {"admit_import", "must_reject"}, pd=True, tables=(1, 3)),
    # Hybrid prefix cache. A hit deeper than the entry's snapshots: the lane resumes with a
    # sliding state restored from no snapshot at its length.
    "admit_hit-hybrid_snapshot_at_n": Mutant(
        lambda: MODEL.without_guard("admit_hit", "hybrid_snapshot_at_n"),
        (True, "dynamic"), "hybrid_hit_has_snapshot", HYBRID_FLOW, tier="hybrid"),
    # A snapshot off the next boundary: one skipped (its state was never saved) or taken
    # where the lane is not (at the admission of a miss, mid-chunk while decoding).
    "snapshot-next_boundary": Mutant(
        lambda: MODEL.without_guard("snapshot", "next_boundary"),
        (True, "reserved"), ("lane_snapshots_are_its_own", "snapshots_on_chunk_boundaries"),
        HYBRID_FLOW, tier="hybrid"),
    # hit_ok without its hybrid clause: an entry without a snapshot at the first chunk blocks
    # a miss though no hit can use it, so a request may never be admitted (the policy's miss
    # is refused, or the lifecycle model's, or the state is stuck).
    "admit_miss-no_cache_hit-ignores-snapshots": Mutant(
        lambda: _miss_ignores_snapshots(),
        (True, "dynamic"),
        ("progress:idle_lane_admits", "refinement:admit_miss", "lifecycle:accepted"),
        HYBRID_FLOW, tier="hybrid"),
    # Host tier. A hit on a slot without an entry: one a store is writing (the spilling block
    # loses its store), one a load reads (the other lane's load loses its slot), an empty one.
    "admit_host_hit-slot_stored": Mutant(
        lambda: MODEL.without_guard("admit_host_hit", "slot_stored"),
        (True, "dynamic"),
        ("host_key_is_content", "spilling_block_has_its_store", "load_reads_a_loading_slot",
         "loading_slot_has_its_lane", "lifecycle:slot_stored"), HOST_FLOW, tier="host"),
    # Eviction of a slot a store writes or a load reads.
    "host_evict-slot_stored": Mutant(
        lambda: MODEL.without_guard("host_evict", "slot_stored"),
        (True, "reserved"),
        ("spilling_block_has_its_store", "load_reads_a_loading_slot", "lifecycle:slot_stored"),
        HOST_FLOW, tier="host"),
    # A spill of an entry a device copy reads: it leaves the cache under the copy (or, into a
    # busy slot, slot_empty refuses it where the lifecycle model expects entry_unpinned).
    "spill-entry_unpinned": Mutant(
        lambda: MODEL.without_guard("spill", "entry_unpinned"),
        (True, "dynamic"), ("copy_source_cached", "lifecycle:entry_unpinned"), HOST_FLOW,
        tier="host"),
    # A spill into a slot that holds an entry, a store or a load.
    "spill-slot_empty": Mutant(
        lambda: MODEL.without_guard("spill", "slot_empty"),
        (True, "reserved"),
        ("spilling_block_has_its_store", "load_reads_a_loading_slot",
         "loading_slot_has_its_lane", "lifecycle:slot_empty"), HOST_FLOW, tier="host"),
    # A failed load leaves its slot loading, read by no lane (never evictable again).
    "load_fail-slot_state": Mutant(
        lambda: MODEL.without_update("load_fail", "slot_state"),
        (True, "dynamic"), "loading_slot_has_its_lane", HOST_FLOW, tier="host"),
    # Paged tables. A grow of a lane whose tail is not full: the next block starts mid-block
    # (the runtime's table[p // S] then names the wrong block), overlapping the tail (or, into
    # a block it may not take, a later guard refuses it where the lifecycle model expects
    # tail_full).
    "grow-tail_full": Mutant(
        lambda: MODEL.without_guard("grow", "tail_full"),
        (False, "dynamic"),
        ("blocks_do_not_overlap", "owned_block_in_table", "tables_are_dense",
         "lifecycle:tail_full"), GROW_RULES, tables=(2, 3)),
    # A grow past T blocks: the table outgrows the runtime's block_tables row (or, with no
    # block left to take, dst_reusable refuses it where the lifecycle model expects
    # table_not_full).
    "grow-table_not_full": Mutant(
        lambda: MODEL.without_guard("grow", "table_not_full"),
        (True, "reserved"), ("table_within_T", "lifecycle:table_not_full"), GROW_RULES,
        tables=(2, 2)),
    # The next block keeps a stale start (of its last use, or 0): the lane's tokens are
    # placed where another of its blocks is.
    "grow-start": Mutant(
        lambda: MODEL.without_update("grow", "start"),
        (False, "reserved"),
        ("blocks_do_not_overlap", "owned_block_in_table", "tables_are_dense",
         "length_within_block"), GROW_RULES, tables=(2, 3)),
    # The full block gets no key when the lane grows: cached at finish, its key is stale.
    "grow-key": Mutant(
        lambda: MODEL.without_update("grow", "key"),
        (True, "dynamic"), ("full_block_holds_its_key", "cache_key_is_content"), GROW_RULES,
        tables=(2, 3)),
    # A prefill chunk past a full tail: written beyond the block's end.
    "prefill-chunk_within_block": Mutant(
        lambda: MODEL.without_guard("prefill", "chunk_within_block"),
        (False, "dynamic"), "length_within_block", {"submit", "admit", "prefill"},
        tables=(2, 3)),
    # A hit on an entry that starts later in its sequence (a full block of a cached table, or a
    # tail after one): it is copied into the lane's first block as if it held the prompt's
    # first tokens. The ghost content of a block is its whole prefix, so the copy's own
    # invariant tells as soon as the copy starts (lane_holds_its_tokens only once it lands);
    # where a later guard refuses it, the lifecycle model does.
    "admit_hit-src_first_block": Mutant(
        lambda: MODEL.without_guard("admit_hit", "src_first_block"),
        (True, "dynamic"), ("copy_at_its_position", "lifecycle:src_first_block"), HIT_RULES,
        tables=(2, 3)),
    # Hits past the first block (`grow_hit`). From an entry at another position: one that
    # ends before the boundary holds too few tokens (n_within_entry), so a later block of a
    # chain that shares the prompt's prefix (T = 3), copied into the wrong positions; or,
    # where a later guard refuses the call, the lifecycle model notices; or the spec now
    # accepts a hit the policy does not look for (it is no longer the longest). (With the
    # lifecycle model and the longest-hit check taken out, copy_at_its_position catches it.)
    "grow_hit-src_at_the_boundary": Mutant(
        lambda: MODEL.without_guard("grow_hit", "src_at_the_boundary"),
        (True, "dynamic"),
        ("copy_at_its_position", "lifecycle:src_at_the_boundary", "refinement:grow_hit"),
        GROW_HIT_RULES, tables=(3, 3)),
    # From an entry at the boundary whose key goes another way (before the boundary, or in
    # the copied tokens): the lane's next block gets KV of other tokens. The spec's longest
    # hit is then often one the policy rightly does not take (or the lifecycle model notices
    # first; without both, copy_source_holds_prefix catches it).
    "grow_hit-prefix_matches": Mutant(
        lambda: MODEL.without_guard("grow_hit", "prefix_matches"),
        (True, "reserved"),
        ("copy_source_holds_prefix", "lifecycle:prefix_matches", "refinement:grow_hit"),
        GROW_HIT_RULES, tables=(2, 3)),
    # More tokens than the entry holds (a cached tail, partly filled). The generated core stays
    # safe: `take` of more tokens than a key has is the whole key, shorter than the lane's
    # prefix, so prefix_matches refuses the call (the proofs, over an uninterpreted `take`,
    # need the guard); only the lifecycle model notices, by the guard the core names.
    "grow_hit-n_within_entry": Mutant(
        lambda: MODEL.without_guard("grow_hit", "n_within_entry"),
        (True, "dynamic"), "lifecycle:n_within_entry", GROW_HIT_RULES, tables=(2, 3)),
    # The copy is not marked in flight: the lane computes (or is cached) from a block that
    # holds nothing yet, and its source is not pinned.
    "grow_hit-copying": Mutant(
        lambda: MODEL.without_update("grow_hit", "copying"),
        (True, "reserved"), "lane_holds_its_tokens", GROW_HIT_RULES, tables=(2, 3)),
    # Hybrid: a hit past the first block deeper than the entry's snapshots: copy_done restores
    # the sliding state from no snapshot at the lane's length (the lane takes the entry's
    # snapshots only as far as they go); or, where a later guard refuses the call, the
    # lifecycle model notices; or the spec now accepts a hit the policy does not look for
    # (`Policy.next_hit` stops at the snapshots: no longer the longest).
    "grow_hit-hybrid_snapshot_at_n": Mutant(
        lambda: MODEL.without_guard("grow_hit", "hybrid_snapshot_at_n"),
        (True, "dynamic"),
        ("hybrid_hit_has_snapshot", "lifecycle:hybrid_snapshot_at_n", "refinement:grow_hit"),
        GROW_HIT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3)),
    # Hybrid: a full block keeps none of the lane's snapshots when it fills (`extend` as before
    # paged hybrid tables: snap_upto 0). No hit restores a wrong state, but once cached a full
    # block serves none: no admission hit on a full first block, no hit past the first block
    # from a middle block, and a lane prefills again what the cache holds. The ghost says the
    # host still holds the lane's snapshots (`entry_snapshots_were_taken`: the count is
    # exactly what was taken); the lifecycle model hands them over as the spec says, so the
    # core's full block differs from it as soon as the lane grows.
    "extend-keeps-no-snapshots": Mutant(
        lambda: _extend_keeps_no_snapshots(),
        (True, "reserved"), ("entry_snapshots_were_taken", "model:grow", "model:grow_hit"),
        GROW_HIT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3)),
    # Hybrid: a full block claims snapshots at every boundary up to its end, whichever the
    # lane took. A later hit into it restores the sliding state from a snapshot the host
    # never took; the ghost count of snapshots taken catches the claim when the block fills.
    "extend-claims-snapshots-to-its-end": Mutant(
        lambda: _extend_claims_snapshots_to_its_end(),
        (True, "reserved"), ("entry_snapshots_were_taken", "model:grow", "model:grow_hit"),
        GROW_HIT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3)),
    # Host hits past the first block (`grow_host_hit`). From a host entry at another position
    # (a first block's, or another later block's): its tokens land at the wrong positions; or,
    # where a later guard refuses the call, the lifecycle model notices; or the spec now
    # accepts a hit the policy does not look for (it is no longer the longest).
    "grow_host_hit-slot_at_the_boundary": Mutant(
        lambda: MODEL.without_guard("grow_host_hit", "slot_at_the_boundary"),
        (True, "dynamic"),
        ("copy_at_its_position", "lifecycle:slot_at_the_boundary",
         "refinement:grow_host_hit"), HOST_GROW_RULES, tier="host", tables=(2, 3)),
    # From a host entry at the boundary whose key goes another way: the lane's next block gets
    # KV of other tokens (the load reads a slot that does not hold the lane's prefix).
    "grow_host_hit-prefix_matches": Mutant(
        lambda: MODEL.without_guard("grow_host_hit", "prefix_matches"),
        (True, "reserved"),
        ("load_reads_a_loading_slot", "lifecycle:prefix_matches", "refinement:grow_host_hit"),
        HOST_GROW_RULES, tier="host", tables=(2, 3)),
    # More than a block's worth of tokens. The generated core stays safe: a host entry at the
    # boundary holds at most a block's worth past it, so n_within_entry refuses the call (the
    # proofs, which do not know that bound, need the guard); only the lifecycle model
    # notices, by the guard the core names.
    "grow_host_hit-n_within_block": Mutant(
        lambda: MODEL.without_guard("grow_host_hit", "n_within_block"),
        (True, "dynamic"), "lifecycle:n_within_block", HOST_GROW_RULES, tier="host",
        tables=(2, 3)),
    # A failed load into a later block recomputes the prompt from the start (as a failed load
    # at an admission does): the lane's length falls below its tail block's start, whose
    # earlier blocks it would write again.
    "load_fail-recomputes-the-prompt": Mutant(
        lambda: _load_fail_from_start(),
        (True, "reserved"), ("length_within_block", "tables_are_dense"), HOST_GROW_RULES,
        tier="host", tables=(2, 3)),
    # PD with paged tables. An importing lane's next block is not pinned for its transfer:
    # a cancel would free it under the transfer's writes.
    "import_grow-transfer": Mutant(
        lambda: MODEL.without_update("import_grow", "transfer"),
        (False, "dynamic"), "moving_lane_has_transfer", PD_FLOW, pd=True, tables=(2, 3)),
    # The next block is pinned for the request its last transfer was (a stale transfer_req):
    # its drain would end with the wrong transfer.
    "import_grow-transfer_req": Mutant(
        lambda: MODEL.without_update("import_grow", "transfer_req"),
        (True, "reserved"), ("transfer_names_lane_request", "model:import_grow"), PD_FLOW,
        pd=True, tables=(2, 3)),
    # The next block keeps a stale start (of its last use, or 0): the transfer writes the
    # prompt's next block's worth where another block of the table is.
    "import_grow-start": Mutant(
        lambda: MODEL.without_update("import_grow", "start"),
        (False, "reserved"),
        ("blocks_do_not_overlap", "owned_block_in_table", "tables_are_dense",
         "import_target_untouched"), PD_FLOW, pd=True, tables=(2, 3)),
    # An importing lane grows past its prompt's end (a block no token lands in, pinned).
    "import_grow-table_short_of_prompt": Mutant(
        lambda: MODEL.without_guard("import_grow", "table_short_of_prompt"),
        (False, "dynamic"), ("import_target_untouched", "lifecycle:table_short_of_prompt"),
        PD_FLOW | {"must_reject"}, pd=True, tables=(2, 3)),
    # An import lands before its table covers the prompt: the lane's length passes its tail.
    "import_done-table_covers_prompt": Mutant(
        lambda: MODEL.without_guard("import_done", "table_covers_prompt"),
        (False, "reserved"), ("length_within_block", "lifecycle:table_covers_prompt"),
        PD_FLOW, pd=True, tables=(2, 3)),
    # An export pins only its lane's tail: the blocks before it are freed under the send when
    # the lane is cancelled (or, cancelled, never drain).
    "export-pins-only-the-tail": Mutant(
        lambda: _export_pins_tail_only(),
        (True, "dynamic"), "moving_lane_has_transfer", PD_FLOW, pd=True, tables=(2, 3)),
    # transfer_end frees only the block it names: the request's other draining blocks stay
    # pinned by a transfer that has ended (never freed: no event names them again).
    "transfer_end-frees-only-b": Mutant(
        lambda: _transfer_end_frees_only_b(),
        (False, "dynamic"), ("pinned_block_transfer_running", "model:transfer_end"),
        PD_FLOW, pd=True, tables=(2, 3)),
    # finish frees (or caches) only the tail: the lane's other blocks stay owned by an idle
    # lane, lost to every later admission.
    "finish-frees-only-the-tail": Mutant(
        lambda: _finish_frees_tail_only(),
        (True, "dynamic"), ("owned_block_in_table", "lane_blocks_are_its_table"), GROW_RULES,
        tables=(2, 3)),
    # Preemption. Without PREEMPT (K as low as with it): a lane is preempted all the same (the
    # state stays consistent, but a running request waits again: requeued_only_by_preemption).
    "preempt-preemption_on": Mutant(
        lambda: MODEL.without_guard("preempt", "preemption_on"),
        (False, "dynamic"), ("requeued_only_by_preemption", "lifecycle:preemption_on"),
        PREEMPT_RULES, tables=(2, 3), preempt=None),
    # An idle lane is preempted (its last request, ended, is waiting again; or none) or a
    # copying one (its copy lands in a free block); or, where some other guard refuses, the
    # lifecycle model notices.
    "preempt-lane_computing": Mutant(
        lambda: MODEL.without_guard("preempt", "lane_computing"),
        (True, "reserved"),
        ("ended_is_final", "copy_only_while_prefilling", "copy_target_not_ready",
         "unsubmitted_request_has_no_prompt", "waiting_prompt_fits",
         "lifecycle:lane_computing"), PREEMPT_RULES, tables=(2, 3), preempt=True),
    # A preemption while a block is free (or no lane waits for one): safe, but work is thrown
    # away; a lane running alone may be preempted (lone_lane_is_never_preempted).
    "preempt-no_block_reusable": Mutant(
        lambda: MODEL.without_guard("preempt", "no_block_reusable"),
        (False, "dynamic"),
        ("lifecycle:no_block_reusable", "progress:lone_lane_is_never_preempted"),
        PREEMPT_RULES, tables=(2, 3), preempt=True),
    "preempt-a_lane_waits_for_a_block": Mutant(
        lambda: MODEL.without_guard("preempt", "a_lane_waits_for_a_block"),
        (True, "dynamic"),
        ("lifecycle:a_lane_waits_for_a_block", "progress:lone_lane_is_never_preempted"),
        PREEMPT_RULES, tables=(2, 3), preempt=True),
    # A lane at its table end (its sequence T * S + 1 tokens) is preempted: its new prompt
    # cannot fit.
    "preempt-requeue_fits": Mutant(
        lambda: MODEL.without_guard("preempt", "requeue_fits"),
        (False, "reserved"), ("waiting_prompt_fits", "lifecycle:requeue_fits",
                              "refinement:preempt"), PREEMPT_RULES,
        tables=(2, 3), preempt=True),
    # The preempted lane's blocks stay its own (lost to every later admission and growth).
    "preempt-owner": Mutant(
        lambda: MODEL.without_update("preempt", "owner"),
        (False, "dynamic"), ("owned_block_in_table", "lane_blocks_are_its_table"),
        PREEMPT_RULES - {"preempt"}, tables=(2, 3), preempt=True),
    # The preempted lane's blocks become cache entries: its tail has no key (its content is a
    # partial block), and without the prefix cache there is no cache at all.
    "preempt-caches": Mutant(
        lambda: _preempt_caches(),
        (True, "dynamic"),
        ("cache_key_is_content", "cache_head_is_first_chunk", "cache_needs_prefix_cache"),
        PREEMPT_RULES - {"preempt"}, tables=(2, 3), preempt=True),
    # The request stays running, with no lane.
    "preempt-phase": Mutant(
        lambda: MODEL.without_update("preempt", "phase"),
        (False, "reserved"), ("running_request_has_lane", "busy_lane_runs_its_request"),
        PREEMPT_RULES - {"preempt"}, tables=(2, 3), preempt=True),
    # Hybrid: the preempted lane keeps its snapshot count while idle; its next request would
    # claim snapshots of another sequence (a hit restores from them).
    "preempt-lane_snap": Mutant(
        lambda: MODEL.without_update("preempt", "lane_snap"),
        (True, "dynamic"), ("idle_lane_has_no_snapshots", "model:preempt"),
        PREEMPT_RULES | HYBRID_FLOW, tier="hybrid", tables=(2, 3), preempt=True),
}


def _weakened_chunk_guard() -> Any:
    """admit_hit accepts any positive n, not only whole chunks (with_guard)."""
    (n,) = [p for p in MODEL.get_action("admit_hit").params if p.name == "n"]
    return MODEL.with_guard("admit_hit", "n_whole_chunks", n > 0)


def _param(action: str, name: str) -> Any:
    (v,) = [p for p in MODEL.get_action(action).params if p.name == name]
    return v


def _import_needs_first_token() -> Any:
    """import_done's covers_prompt compares p with the prompt and the first token (with_guard)."""
    r, p, tok = (_param("import_done", x) for x in ("r", "p", "tok"))
    return MODEL.with_guard("import_done", "covers_prompt",
                            p == spec.push(spec.lane_seq(spec.req_lane(r)), tok))


def _weakened_export_guard() -> Any:
    """export accepts any decoding lane (with_guard)."""
    return MODEL.with_guard("export", "lane_prefilled", spec.decoding(_param("export", "l")))


def _import_reuses_draining() -> Any:
    """admit_import's dst may be a draining block too (with_guard)."""
    dst = _param("admit_import", "dst")
    return MODEL.with_guard("admit_import", "dst_reusable", lang.one_of(
        spec.owner(dst), spec.Owner.FREE, spec.Owner.CACHE, spec.Owner.DRAINING)
        & ~spec.pinned(dst))


def _export_pins_tail_only() -> Any:
    """`export` pins (transfer, transfer_req) only its lane's tail, not every block of its
    table: those updates over every block b are replaced on a copy of the model (see
    _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("export")
    l = _param("export", "l")
    a.updates = [lang.Update(u.fn, u.args, lang.ite(
        u.args[0] == spec.tail(l), {"transfer": lang.Lit(True, lang.BOOL),
                                    "transfer_req": spec.lane_req(l)}[u.fn.name],
        u.fn(u.args[0])), u.whole)
        if u.fn.name in ("transfer", "transfer_req") else u for u in a.updates]
    return m


def _transfer_end_frees_only_b() -> Any:
    """`transfer_end(r, b)` frees (owner, transfer, junk) only b, not every block draining for
    r: those updates over every block c are replaced on a copy of the model (see
    _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("transfer_end")
    b = _param("transfer_end", "b")
    value = {"owner": lambda c: lang.ite(c == b, spec.Owner.FREE, spec.owner(c)),
             "transfer": lambda c: lang.ite(c == b, lang.Lit(False, lang.BOOL),
                                            spec.transfer(c)),
             "junk": lambda c: spec.junk(c) | (c == b)}
    a.updates = [lang.Update(u.fn, u.args, value[u.fn.name](u.args[0]), u.whole)
                 if u.fn.name in value and u.whole else u for u in a.updates]
    return m


def _miss_ignores_snapshots() -> Any:
    """admit_miss's no_cache_hit refuses a miss beside any entry sharing the first chunk, with
    or without a snapshot there (hit_ok without its HYBRID clause; with_guard)."""
    r = _param("admit_miss", "r")
    return MODEL.with_guard("admit_miss", "no_cache_hit", lang.implies(spec.PREFIX, lang.forall(
        spec.Block, lambda b: ~(
            (spec.slen(spec.prompt(r)) > spec.C) & (spec.owner(b) == spec.Owner.CACHE)
            & (spec.head(b) == spec.take(spec.prompt(r), spec.C))
            & (spec.slen(spec.key(b)) >= spec.C)))))


def _cancel_frees() -> Any:
    """`cancel` (abort_running, fail) frees the lane's blocks even while a transfer uses one.
    The mutant API removes guards and updates or replaces a guard, not an update's value, so
    the owner update (over every block b) is replaced here on a copy of the model."""
    m = MODEL.copy()
    for name in ("abort_running", "fail"):
        a = m.get_action(name)
        (l,) = [p for p in a.params if p.name == "l"]
        a.updates = [lang.Update(u.fn, u.args, lang.ite(spec.lane_block(u.args[0], l),
                                                        spec.Owner.FREE, spec.owner(u.args[0])),
                                 u.whole)
                     if u.fn.name == "owner" else u for u in a.updates]
    return m


def _finish_frees_tail_only() -> Any:
    """`finish` caches (keep) or frees only the lane's tail, not its whole table: its owner
    update over every block b is replaced on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("finish")
    l, keep = (_param("finish", x) for x in ("l", "keep"))
    a.updates = [lang.Update(u.fn, u.args, lang.ite(
        u.args[0] == spec.tail(l), lang.ite(keep, spec.Owner.CACHE, spec.Owner.FREE),
        spec.owner(u.args[0])), u.whole) if u.fn.name == "owner" else u for u in a.updates]
    return m


def _load_fail_from_start() -> Any:
    """`load_fail` sets the lane's length (and its tail's content) to the prompt's start, 0,
    not its tail block's start: the length and holds updates are replaced on a copy of the
    model (see _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("load_fail")
    l = _param("load_fail", "l")
    zero = {"length": lang.Lit(0, lang.INT),
            "holds": spec.take(spec.lane_seq(l), lang.Lit(0, lang.INT))}
    a.updates = [lang.Update(u.fn, u.args, zero[u.fn.name], u.whole) if u.fn.name in zero
                 else u for u in a.updates]
    return m


def _extend_claims_snapshots_to_its_end() -> Any:
    """`extend` gives the full block snapshots up to its end (snap_upto := the lane's length)
    instead of the lane's: the update is replaced on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    for name in ("grow", "grow_hit", "grow_host_hit"):
        a = m.get_action(name)
        (l,) = [p for p in a.params if p.name == "l"]
        a.updates = [lang.Update(u.fn, u.args, lang.ite(spec.HYBRID, spec.length(l), 0), u.whole)
                     if u.fn.name == "snap_upto" else u for u in a.updates]
    return m


def _extend_keeps_no_snapshots() -> Any:
    """`extend` (the updates grow, grow_hit and grow_host_hit share) gives the full block no
    snapshots (snap_upto 0, snap_junk False) instead of the lane's: those updates are replaced
    on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    none = {"snap_upto": lang.Lit(0, lang.INT), "snap_junk": lang.Lit(False, lang.BOOL)}
    for name in ("grow", "grow_hit", "grow_host_hit"):
        a = m.get_action(name)
        a.updates = [lang.Update(u.fn, u.args, none[u.fn.name], u.whole)
                     if u.fn.name in none else u for u in a.updates]
    return m


def _preempt_caches() -> Any:
    """`preempt` makes its lane's blocks cache entries instead of freeing them: its owner update
    over every block b is replaced on a copy of the model (see _cancel_frees)."""
    m = MODEL.copy()
    a = m.get_action("preempt")
    l = _param("preempt", "l")
    a.updates = [lang.Update(u.fn, u.args, lang.ite(
        spec.lane_block(u.args[0], l), spec.Owner.CACHE, spec.owner(u.args[0])), u.whole)
        if u.fn.name == "owner" else u for u in a.updates]
    return m


def caught_by(exc: AssertionError) -> list[str]:
    """The checks that reported `exc`, as MUTANTS names them."""
    if isinstance(exc, LifecycleDivergence):
        return [f"lifecycle:{exc.expected or 'accepted'}"]
    if isinstance(exc, ProgressViolation):
        return [f"progress:{x}" for x in exc.names]
    if isinstance(exc, RefinementViolation):
        return [f"refinement:{exc.action}"]
    if isinstance(exc, ModelDivergence):
        return [f"model:{exc.action}"]
    assert isinstance(exc, InvariantViolation)
    assert exc.kind != "checker crash", str(exc)  # checkers report, never raise
    return exc.names


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_machine_catches_mutant(name: str) -> None:
    """The same machine over a mutant core reports the expected invariant (or lifecycle
    guard). Each search starts from fresh `Stats`, so what the machine does "once a run"
    (e.g. `storm_once`) does not depend on the tests that ran before it in the process; a
    failure in such a step is not replayed (the replay has it counted already), so hypothesis
    reports it as flaky: the failure it saw is the one checked."""
    m = MUTANTS[name]
    Stats.reset()
    mutant = codegen.load(m.build(), f"atom_core_mutant_{name.replace('-', '_')}")
    config = configs(mutant, *m.features, lanes=(2, 2), tier=m.tier, tables=m.tables,
                     preempt=m.preempt)
    if name == "admit_hit-n_whole_chunks-weakened":
        config = config.filter(lambda c: c.C == 2)
    machine = make_machine(mutant, config, mirror=False, focus=m.focus, pd=m.pd,
                           preempt=m.preempt is not False)
    kinds = (InvariantViolation, LifecycleDivergence, ProgressViolation, RefinementViolation,
             ModelDivergence)
    with pytest.raises((*kinds, FlakyFailure)) as info:
        run_state_machine_as_test(machine, settings=_search_settings())
    exc = info.value
    if isinstance(exc, FlakyFailure):
        (exc,) = exc.exceptions
        assert isinstance(exc, kinds), repr(exc)
    expected = {m.expected} if isinstance(m.expected, str) else set(m.expected)
    assert expected & set(caught_by(exc)), (caught_by(exc), str(exc))
