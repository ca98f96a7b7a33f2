"""The request lifecycle in plain Python (`Life`): what the generated core must agree with
after every step of the state machine (`atom_core.testing.machine`), and the guard that
must refuse each call (the spec's, as the committed generated core evaluates it on a reference
state: `Life.predict`); the event names the machine counts (`Stats`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from atom_core._generated import core as committed

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
# ... and a hit whose source was the only reusable block taken over by the lane: at admission
# (`admit_adopt`, instead of waiting for a running request to end), and past the first block
# (`grow_adopt`, instead of computing its tokens again).
HIT_SOURCE_ADOPTED = "hit's source, the only reusable block, taken over"
# ... and a hybrid model's miss that evicted its own hit's entry, the only reusable block.
HYBRID_HIT_EVICTED = "hybrid miss evicted its own hit's entry, the only reusable block"
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
# by preempting a computing lane (the scheduler's growth), and an imported request (decoding
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
    events = Counter()  # situations worth reaching (PD: drains, stale events, ...)

    @classmethod
    def reset(cls) -> None:
        cls.steps, cls.calls = 0, 0
        cls.applied, cls.rejected, cls.events = Counter(), Counter(), Counter()




class Life:
    """The request lifecycle, the blocks' owners and the host slots in plain Python: what the
    core must agree with; and the spec's state after the same steps (`ref`), on which the
    guard that must refuse each call is the spec's own (`predict`).

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
        # the spec's state (the committed generated core's, ghost on) after every step the core
        # under test applied: what `predict` evaluates the spec's guards on
        self.ref = committed.init(committed.Consts(**attrs.asdict(c)), True)
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

    def evicts_its_hit(self, dst: int, b: int) -> bool:
        """A hybrid model's miss may take its hit's entry b when b is the only block it could
        take (the hit's copy would need a second one, and a hybrid lane cannot take b over)."""
        return (self.c.HYBRID and b == dst
                and all(o == b or not self.reusable(o) for o in range(self.c.K)))

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
        """The guard the core must report, or None (it must apply the step): the spec's guard,
        as the committed generated core evaluates it, on the reference state (`ref`: the
        spec's state after the steps the core under test applied). Derived from the spec, not
        restated here: a mutant core that accepts a step the spec refuses (or refuses one it
        accepts) differs from it, whatever its own state has become."""
        return committed.ACTIONS[name][1](self.ref, *args)

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
              pre: Any, post: Any = None) -> None:
        """Advance the model by a step the core applied; check its effects on the way.
        `post`: the core's state after it, when the core under test is the committed one
        (then it is the spec's state: the reference need not be computed twice)."""
        c = self.c
        kinds = [type(e).__name__ for e in effects]
        if post is not None:
            self.ref = post
        else:
            ref = committed.ACTIONS[name][0](self.ref, *args)
            # (the core under test applied it as `predict` said the spec does)
            assert ref.rejected is None, (name, args, ref.rejected)
            self.ref = ref.state
        if name == "submit":
            r, p = args
            self.status[r], self.prompt[r] = "waiting", tuple(p)
            assert kinds == []
        elif name in ("admit_miss", "admit_hit", "admit_adopt", "admit_host_hit",
                      "admit_import"):
            l, r = args[:2]
            hit = name in ("admit_hit", "admit_host_hit")
            dst, n = ((args[3], args[4]) if hit else (args[2], args[3])
                      if name == "admit_adopt" else (args[2], 0))
            if name == "admit_adopt":
                assert c.C <= n < len(self.prompt[r]) and n % c.C == 0, args
                assert dst in self.entries and self.entries[dst][0][:n] == self.prompt[r][:n]
                if not any(self.reusable(b) for b in range(c.K) if b != dst):
                    Stats.events[HIT_SOURCE_ADOPTED] += 1
            if hit:
                assert c.C <= n < len(self.prompt[r]) and n % c.C == 0, args
            assert self.lane[l] is None and self.status[r] == "waiting"
            assert self.reusable(dst) and dst not in self.draining, (name, args, self.owner)
            if name == "admit_miss" and c.PREFIX and self.hit_ok(self.prompt[r], dst):
                assert self.evicts_its_hit(dst, dst), (args, self.owner)
                Stats.events[HYBRID_HIT_EVICTED] += 1
            elif name == "admit_miss" and c.HYBRID and self.shares_first_chunk(self.prompt[r]):
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
        elif name == "grow_adopt":
            # like grow_hit, with the entry itself as the lane's next block: nothing copied
            l, src, n = args
            assert self.prefilling(l) and self.needs_block(l), (args, self.tables[l])
            assert src in self.entries and self.start[src] == self.length[l], (args, self.start)
            assert self.reusable(src) and not c.HYBRID, (args, self.owner)
            assert kinds == ["Grow"] and effects[0] == (l, src, len(self.tables[l])), effects
            if not any(self.reusable(b) for b in range(c.K) if b != src):
                Stats.events[HIT_SOURCE_ADOPTED] += 1
            self._extend(l, src)
            self.length[l] += n
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
