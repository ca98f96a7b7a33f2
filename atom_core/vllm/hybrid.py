"""vLLM's KV cache groups as atom-core serves them: one group of any attention, or a hybrid
sliding-window model (Gemma3-style: full-attention groups beside sliding-window groups).

A hybrid model runs on a hybrid `Config` (`sliding_window` W; one lane more than
max_num_seqs, kept idle for the decode's padding: `config_from_vllm`): the core gives each lane
one local slot for its sliding layers' KV and pages only the full-attention layers. Under vLLM:

* every full-attention group gets the lane's block table from the core, as a one-group model;
* every sliding group gets, per lane, a ring of `config.ring_blocks(...)` blocks reserved from
  vLLM's pool at construction (the lane's local slot), and the lane's table for that group maps
  table entry i to ring block i mod R. vLLM's runner computes a token's slot from the table
  (entry position // block_size), so position p lands in ring block (p // block_size) mod R;
  `ring_blocks` says why R is large enough that every key a call reads is its own position's.
  Entries wholly below the window hold ring blocks too: vLLM's CPU kernel reads only the
  window (its own manager frees those blocks and hands them to other requests while the
  runner's table still names them), and a table sent never changes (the runner appends).

The rings are vLLM ids `first_ring`.. (the top of the pool), the core's blocks the ids below
(core block b is vLLM's b + 1; block 0 is vLLM's null block). A vLLM block id belongs to one
group at a time (vLLM's own rule: its groups may share one tensor per layer position), so each
sliding group has rings of its own. A lane's ring is rewritten from position 0 whenever a
request enters the lane (an admission, a preempted request's recompute) before any of it is
read.
"""

from __future__ import annotations

from typing import Any

import attrs
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

FULL, SLIDING = "full", "sliding"


@attrs.frozen
class Groups:
    """The kind of each of vLLM's KV cache groups, in its order, and their common window."""

    kinds: tuple[str, ...]
    sliding_window: int | None

    @property
    def sliding(self) -> int:
        return self.kinds.count(SLIDING)


def read_groups(kv_cache_config: Any, block_size: int) -> Groups | str:
    """The groups, or why atom-core cannot serve them (a refusal's words)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:  # (any one attention group: its table is the core's)
        return Groups((FULL,), None)
    if not groups:
        return "an attention-free model (no KV cache group)"
    kinds: list[str] = []
    windows: set[int] = set()
    other: list[str] = []
    for g in groups:
        spec = g.kv_cache_spec
        # exact classes: a subclass (MLA, sinks, ...) changes what a block holds
        if type(spec) is FullAttentionSpec and spec.sliding_window is None:
            kinds.append(FULL)
        elif type(spec) is SlidingWindowSpec and spec.extra_retained_tokens == 0:
            kinds.append(SLIDING)
            windows.add(spec.sliding_window)
        else:
            other.append(type(spec).__name__)
        if spec.block_size != block_size:
            other.append(f"a group of block size {spec.block_size} beside {block_size}")
    why = []
    if other:
        why.append("KV cache groups of kind " + ", ".join(sorted(set(other))))
    if FULL not in kinds:
        why.append("no full-attention group")
    if len(windows) > 1:
        why.append(f"sliding windows of different sizes {sorted(windows)}")
    if why:
        return (f"a model with {len(groups)} KV cache groups with " + "; ".join(why)
                + " (hybrid models: full-attention groups and sliding-window groups of one "
                "window and one block size)")
    return Groups(tuple(kinds), windows.pop() if windows else None)


@attrs.frozen
class Rings:
    """Each lane's ring in each sliding group (vLLM ids), and the block ids of a lane's table
    for every group."""

    kinds: tuple[str, ...]
    lanes: int
    ring: int  # blocks per ring
    first: int  # vLLM id of the first ring block

    def of(self, lane: int, sliding_index: int) -> range:
        start = self.first + (sliding_index * self.lanes + lane) * self.ring
        return range(start, start + self.ring)

    def all_ids(self) -> range:
        return range(self.first, self.first + self.kinds.count(SLIDING) * self.lanes * self.ring)

    def block_ids(self, lane: int, table: list[int], start: int) -> tuple[list[int], ...]:
        """Entries `start`.. of the lane's table (vLLM ids, the full-attention groups') for
        every group: a sliding group's entry i is the lane's ring block i mod R."""
        out: list[list[int]] = []
        k = 0
        for kind in self.kinds:
            if kind == FULL:
                out.append(table[start:])
            else:
                ring = self.of(lane, k)
                out.append([ring[i % self.ring] for i in range(start, len(table))])
                k += 1
        return tuple(out)
