"""The hypothesis strategies the state machine draws from: configurations at and around the
proved capacity (`min_blocks`), prompts over a small alphabet, and labelled draws."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st

from atom_core.config import min_kv_blocks
from atom_core.seq import TokSeq, seq
from atom_core.testing.lifecycle import ALPHABET, STEMS, TIERS

# (lanes, prefix, scratch, tables, preempt) -> the least K at which progress is claimed
Capacity = Callable[[int, bool, str, int, bool], int]


def min_blocks(lanes: int, prefix: bool, scratch: str, tables: int = 1,
               preempt: bool = False) -> int:
    """The proved capacity rule (`config.min_kv_blocks`, T = tables): every lane can hold a
    whole table, plus the features' blocks (scratch, a prefix hit's source); with preemption,
    one lane's whole table plus a scratch or padding block."""
    return min_kv_blocks(lanes, prefix, scratch, tables, preemption=preempt)


@st.composite
def configs(draw: Any, core: Any, prefix: bool, scratch: str, extra: tuple[int, int] = (0, 2),
            lanes: tuple[int, int] = (1, 3), tier: str = "plain",
            tables: tuple[int, int] = (1, 3), preempt: bool | None = False,
            capacity: Capacity = min_blocks) -> Any:
    """Small configurations: T blocks per lane table from tables[0] to tables[1] (every
    tier), K from min_blocks + extra[0] to min_blocks + extra[1]; tier "hybrid" turns on
    HYBRID, "host" HOST with H in 1..2 (both with the prefix cache). With T > 1 the block size
    S is small (2..8), so that tables fill within a run.
    preempt: PREEMPT on (any tier, T >= 2: axiom preemption_with_tables),
    K from the preemption rule's minimum + extra[0] up to below the rule without it (or to the
    minimum + extra[1]), so that lanes often wait for a block and preempt; None: the same
    K, with PREEMPT off (below capacity: for a mutant that preempts without PREEMPT).
    capacity: the rule K is drawn around (a mutant's table claims other minimums)."""
    assert tier == "plain" or (tier in TIERS and prefix), (tier, prefix)
    if preempt is not False:
        tables = (max(2, tables[0]), max(2, tables[1]))
    t = draw(st.integers(*tables))
    b = draw(st.integers(*lanes))
    lo = capacity(b, prefix, scratch, t, preempt is not False)
    hi = lo + extra[1]
    if preempt is not False and extra[1] >= 0:  # up to just below the rule without preemption
        hi = max(hi, capacity(b, prefix, scratch, t, False) - 1)
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
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


_BOOLS = st.booleans()


# Draw helpers with cached strategies: building a fresh strategy per draw (sampled_from over a
# new list) costs hypothesis a validation each time, a large share of a step.
def pick(data: Any, xs: Any, label: str | None = None) -> Any:
    """One of the (non-empty) sequence xs; shrinks towards xs[0]."""
    xs = tuple(xs)
    return xs[data.draw(ints(0, len(xs) - 1), label=label)]


@functools.cache
def token_lists(lo: int, hi: int) -> st.SearchStrategy[list[int]]:
    return st.lists(tokens, min_size=lo, max_size=hi)


def coin(data: Any, label: str | None = None) -> bool:
    return data.draw(_BOOLS, label=label)


def num(data: Any, lo: int, hi: int, label: str | None = None) -> int:
    return data.draw(ints(lo, hi), label=label)
