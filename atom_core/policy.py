"""Policy: which of the choices the spec allows to take.

The spec's guards say which lanes, blocks, victims and hits are legal; every proof covers every
legal choice, so this module can only make the scheduler slower or faster, never unsafe. Its
choices are still checked: the core rejects an illegal one (and the tests check that it never
has to). The rules are the plain ones: the lowest idle lane, the lowest free block, the least
recently used cache entry as victim, the longest prefix hit.

It reads either core's state: a `core.State` (tests, tools) or the in-place core's `MState` (the
batcher's). Both have the same fields (tuples and maps, or lists and dicts) and are read the
same way; the few definitions it calls are each core's own (`_core`), since the in-place
core's read its indexes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Sequence
from itertools import compress, repeat
from operator import eq
from typing import Any, TypeAlias

from atom_core._generated import core as g
from atom_core._generated import inplace
from atom_core._generated.choices import (
    AdmitAdopt,
    AdmitHit,
    AdmitHostHit,
    AdmitImport,
    AdmitMiss,
    Grow,
    GrowAdopt,
    GrowHit,
    GrowHostHit,
    ImportGrow,
    Preempt,
)
from atom_core.seq import TokSeq, prefix_eq, range_eq, take


def _core(s: Any) -> Any:
    """The generated core whose definitions read `s`."""
    return inplace if type(s) is inplace.MState else g


def busy_lanes(s: g.State) -> list[int]:
    """The busy lanes, in order, found at C speed. Every per-lane choice the scheduler makes
    each step (`prefill`, `grow`, `import_grow`, a decoding lane) has a guard that requires
    its lane busy (tests/test_policy_lanes.py checks it on the spec's guards), so asking only
    these costs what the running requests cost, not B: at one request of 16 lanes, the scans
    over every lane were most of a step's scheduling time."""
    return list(compress(range(s.consts.B), s.busy))


# The policy's choices are the generated records of the actions it picks (one class per action,
# its fields the action's parameters: atom_core/_generated/choices.py); each still reads as the
# old pair through `choice.action` and `choice.args`.
Admission: TypeAlias = AdmitMiss | AdmitHit | AdmitAdopt | AdmitHostHit | AdmitImport
Growth: TypeAlias = Grow | GrowHit | GrowAdopt | GrowHostHit | ImportGrow | Preempt
Choice: TypeAlias = Admission | Growth


def common_chunks(a: Sequence[int], b: Sequence[int], chunk: int, limit: int, at: int = 0) -> int:
    """The longest n <= limit, a multiple of chunk, with a[at:at + n] == b[at:at + n]."""
    # Bisection over the number of chunks (agreement on a range implies it on its prefixes):
    # a whole hit is one comparison, a partial one a few, instead of one per chunk.
    lo, hi = 0, max(limit, 0) // chunk  # a[at:at + lo * chunk] agrees; more than hi does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if range_eq(a, b, at + lo * chunk, at + mid * chunk):
            lo = mid
        else:
            hi = mid - 1
    return lo * chunk


def prefer_host(hit: tuple[int, int] | None, host: tuple[int, int] | None) -> bool:
    """Take the host tier's hit over the device's: only when it is longer (a load costs a host
    transfer, a device copy does not)."""
    return host is not None and (hit is None or host[1] > hit[1])


class Policy:
    """The scheduler's choices among what the spec allows.

    `spare_local_slot` (hybrid models): never admit into the last idle lane while another lane
    is busy, so that padding rows always have an idle lane's local slot (`local_pad_ok`) and
    decode never waits for a prefilling or importing lane: B lanes then run at most B - 1
    requests. Off (the default): every lane runs, and while all are busy and one of them is
    not decoding, decode waits for it (see `local_pad`)."""

    def __init__(self, spare_local_slot: bool = False,
                 max_decode_wait: int | None = None) -> None:
        self.spare_local_slot = spare_local_slot
        # How many prefill calls in a row may run while some lane could decode (`prefill_first`);
        # None: as many as the longest prompt has chunks, so one prompt's prefill is never
        # interrupted, but a stream of them is.
        if max_decode_wait is not None and (isinstance(max_decode_wait, bool)
                                            or not isinstance(max_decode_wait, int)
                                            or max_decode_wait < 1):
            # (0 would starve prefill instead: no new request would start while a lane decodes)
            raise ValueError(f"max_decode_wait must be an integer >= 1 or None, got "
                             f"{max_decode_wait!r}")
        self.max_decode_wait = max_decode_wait
        self.decode_waits = 0  # prefill calls since the last decode call
        self.clock = 0
        # block -> time its cache entry was made or hit (0: never)
        self.last_use: defaultdict[int, int] = defaultdict(int)
        self.slot_use: dict[int, int] = {}  # host slot -> time its entry was stored or hit
        self.admitted: dict[int, int] = {}  # lane -> time its request was admitted
        # requests that take no prefix hit from the host tier and, once admitted, none past
        # their first block (`grow`): every position of their prompt is computed (the
        # Scheduler's `Request.uncached`: those that want their prompt's logits)
        self.uncached: Container[int] = frozenset()

    # bookkeeping -------------------------------------------------------------------
    def observe(self, effects: Iterable[Any]) -> None:
        """Keep LRU order from the effects of applied transitions."""
        for e in effects:
            if isinstance(e, g.Decode):  # (first: a decode step's only effect)
                self.decode_waits = 0
            elif isinstance(e, (g.Admit, g.Inbound)):  # an import is an admission too
                self.clock += 1
                self.admitted[e.lane] = self.clock
            elif isinstance(e, g.Copy):
                self._touch(e.src)
            elif isinstance(e, g.Release):
                self._touch(e.block)
            elif isinstance(e, (g.Store, g.Load)):
                self.clock += 1
                self.slot_use[e.slot] = self.clock

    def _admitted_at(self, lane: int) -> int:
        """When lane's request was admitted (0: never): the order of `growth` and
        `prefill_lanes`."""
        return self.admitted.get(lane, 0)

    def _touch(self, block: int) -> None:
        self.clock += 1
        self.last_use[block] = self.clock

    # choices -----------------------------------------------------------------------
    def idle_lane(self, s: g.State) -> int | None:
        """The lowest idle lane (found at C speed: with B - 1 lanes busy, as in steady state,
        a Python loop over the lanes cost a microsecond at B = 32)."""
        try:
            return s.busy.index(False)
        except ValueError:
            return None

    def prefill_lane(self, s: g.State) -> int | None:
        """The lane whose next prompt chunk this step computes (one prefill per step): the
        earliest admitted of those that can prefill, first come first served as admission is.
        The lowest-numbered lane instead let requests that end at their prefill
        (max_new_tokens=1, an end token first, an export), admitted one per step into a lower
        lane, hold a long prompt in a higher lane at length 0 for as long as they came; and
        with preemption a younger lane's prefill took the blocks the older one then had to
        preempt it for, throwing its chunks away."""
        return next(iter(self.prefill_lanes(s)), None)

    def prefill_lanes(self, s: g.State) -> list[int]:
        """Every lane that can prefill, earliest admitted first (ties: the lower lane):
        `prefill_lane`'s order, and, for a runtime that takes several prompt chunks in one call
        (`MixedCall`), the order deciding whose chunk fits a token budget."""
        enabled = _core(s).enabled_prefill
        # The guard is asked only of the busy lanes whose request prefills: it requires that
        # (`lane_prefilling`; proved on the spec: tests/test_policy_lanes.py), and it runs as
        # interpreted Python, half a microsecond a lane, where most lanes decode.
        phase, lane_req, want = s.phase, s.lane_req, g.PHASE_PREFILL
        # (for some token: the guard reads none; sorted is stable, so ties keep lane order)
        lanes = [ln for ln in busy_lanes(s)
                 if phase.get(lane_req[ln]) == want and enabled(s, l=ln)]
        return sorted(lanes, key=self._admitted_at) if len(lanes) > 1 else lanes

    def prefill_first(self, s: g.State, can_decode: Callable[[], bool]) -> bool:
        """A lane can prefill: run its chunk this step rather than a decode call? Prefill first
        (a new request's first token soon), but not for ever: requests that end at their
        prefill (max_new_tokens=1, an end token first, an export), arriving one per step, kept
        every decoding lane at its token for as long as they came. So once decoding lanes have
        waited `max_decode_wait` prefill calls (since the last decode call), one decode call
        goes first if `can_decode()` (a decode call with a live row is possible now: asked only
        then, as it costs a plan, where the wait counts any decoding lane)."""
        decoding = _core(s).decoding
        if not any(decoding(s, ln) for ln in busy_lanes(s)):
            return True  # no lane waits for this prefill
        limit = self.max_decode_wait
        if limit is None:  # the chunks of the longest prompt: ceil(max_seq_len / chunk)
            limit = -(-s.consts.T * s.consts.S // s.consts.C)
        if self.decode_waits >= limit and can_decode():
            return False  # (the decode call's effect resets the count: `observe`)
        self.decode_waits += 1
        return True

    def pinned(self, s: g.State) -> set[int]:
        """The blocks an in-flight copy reads (the spec's `pinned`; a host load reads a slot,
        not a block), in one pass over the lanes: `g.pinned(s, b)` per block scans every lane
        for each block, 6x slower for a cache of 512 entries (measured). Tested equal to the
        spec's definition (tests/test_codegen.py)."""
        if not any(s.copying):  # (the common case, at C speed)
            return set()
        return {src for src, copying, host in zip(s.copy_src, s.copying, s.copy_host,
                                                  strict=True) if copying and not host}

    def reusable(self, s: g.State, exclude: int | None = None) -> int | None:
        """The lowest free block, else the least recently used unpinned cache entry: the
        blocks the spec's `reusable` allows, in the order of this policy's preference."""
        owner, k = s.owner, s.consts.K
        pins = self.pinned(s)
        b = -1
        while True:  # the free blocks in order, each found at C speed (`index`)
            try:
                b = owner.index(g.OWNER_FREE, b + 1)
            except ValueError:
                break
            if b != exclude and b not in pins:
                return b
        # The cache entries, found at C speed (`compress`): a Python loop over the blocks with
        # a key function per entry took 270 us at K = 1,024, on every block an eviction gives.
        cached = list(compress(range(k), map(eq, owner, repeat(g.OWNER_CACHE))))
        if exclude is not None or pins:
            cached = [b for b in cached if b != exclude and b not in pins]
        if not cached:
            return None
        # Entries a prefilling lane will copy next (`grow_hit`) last, then entries past a
        # table's first block: an admission hits only entries that start a sequence, and a
        # later block is hit only by a lane that got that far; the least recently used first,
        # the lowest among equals. (A `Release` names only the tail, so use times order blocks
        # of one position, not a chain's blocks.)
        ahead = self._ahead(s, cached)
        pool = [b for b in cached if b not in ahead] if ahead else cached
        use = self.last_use.__getitem__  # (a defaultdict: an entry never touched is time 0)
        if pool:
            later = list(compress(pool, map(s.start.__getitem__, pool)))  # start != 0
            return min(later or pool, key=use)
        return min(cached, key=lambda b: (s.start[b] == 0, use(b)))

    @staticmethod
    def _ahead(s: g.State, cached: list[int]) -> set[int]:
        """The cached entries past some prefilling lane's length whose key agrees with its prompt
        through their first chunk: the blocks its next `grow_hit`s would copy."""
        lanes = [ln for ln in range(s.consts.B) if s.busy[ln]
                 and s.phase.get(s.lane_req[ln]) == g.PHASE_PREFILL]
        if not lanes:
            return set()
        c = s.consts.C
        return {b for b in cached for ln in lanes if s.start[b] >= s.length[ln]
                and prefix_eq(s.key[b], s.lane_seq[ln], s.start[b] + c)}

    def best_hit(self, s: g.State, prompt: TokSeq) -> tuple[int, int] | None:
        """(src, n) of the longest device hit (most recently used among equals), or None."""
        # a hybrid hit also restores the sliding state: only where the entry has a snapshot
        return self._longest(s, prompt, _core(s).where_head, s.owner, g.OWNER_CACHE, s.start,
                             s.key, s.snap_upto if s.consts.HYBRID else None, self.last_use)

    def next_hit(self, s: g.State, lane: int) -> tuple[int, int] | None:
        """(src, n) of the longest cached continuation of a prefilling lane whose tail block is
        full (`grow_hit`): an entry that starts where the lane's next block does and whose key
        agrees with the lane's prompt up to there and n tokens on (most recently used among
        equals), or None."""
        if not s.consts.PREFIX or s.lane_req[lane] in self.uncached:
            return None
        entries = [b for b in range(s.consts.K)
                   if s.owner[b] == g.OWNER_CACHE and s.start[b] == s.length[lane]]
        # a hybrid hit also restores the sliding state: only as far as the entry has snapshots
        upto = (lambda b: s.snap_upto[b]) if s.consts.HYBRID else None
        return self._continuation(s, lane, entries, s.key, self.last_use, upto)

    def next_host_hit(self, s: g.State, lane: int) -> tuple[int, int] | None:
        """(slot, n): `next_hit` from the host tier (`grow_host_hit`)."""
        if s.lane_req[lane] in self.uncached:
            return None
        slots = [h for h in range(s.consts.H) if s.slot_state[h] == g.SLOTSTATE_STORED
                 and s.slot_start[h] == s.length[lane]]
        return self._continuation(s, lane, slots, s.slot_key, self.slot_use)

    @staticmethod
    def _continuation(s: g.State, lane: int, entries: list[int], key: Any,
                      use: dict[int, int], upto: Any = None) -> tuple[int, int] | None:
        c, at, seq_ = s.consts.C, s.length[lane], s.lane_seq[lane]
        # whole chunks, within one block, and at least one prompt token left to compute
        limit = min(s.consts.S, (s.lane_plen[lane] - 1) // c * c - at)
        if limit < c:
            return None
        best: tuple[int, int] | None = None
        for b in entries:
            k = key[b]
            if len(k) < at + c or not prefix_eq(k, seq_, at):
                continue
            most = min(limit, (len(k) - at) // c * c)
            if upto is not None:
                most = min(most, upto(b) - at)
            n = common_chunks(k, seq_, c, most, at)
            if n and (best is None or (n, use.get(b, 0)) > (best[1], use.get(best[0], 0))):
                best = (b, n)
        return best

    def best_host_hit(self, s: g.State, prompt: TokSeq) -> tuple[int, int] | None:
        """(slot, n) of the longest host-tier hit into a first block, or None."""
        return self._longest(s, prompt, _core(s).where_slot_head, s.slot_state,
                             g.SLOTSTATE_STORED, s.slot_start, s.slot_key, None, self.slot_use)

    @staticmethod
    def _longest(s: g.State, prompt: TokSeq, where: Any, state: Sequence[int], usable: int,
                 start: Sequence[int], key: Sequence[TokSeq], upto: Sequence[int] | None,
                 use: dict[int, int]) -> tuple[int, int] | None:
        """The longest hit among the entries x that `where(s, head)` gives for the prompt's
        first chunk (the lookup of their heads) with state[x] == usable and start[x] == 0 (an
        admission copies into the lane's first block: entries that start a sequence), at most
        upto[x] tokens deep when upto is given. (Arrays, not predicates: two closures per call
        were a fifth of a miss's search.)"""
        c = s.consts.C
        limit = (len(prompt) - 1) // c * c  # at least one prompt token is recomputed
        if limit < c:  # too short to hit: a hit is whole chunks and leaves a token to compute
            return None
        best: tuple[int, int] | None = None
        for b in where(s, take(prompt, c)):
            if state[b] != usable or start[b] != 0:
                continue
            k = key[b]
            most = min(limit, len(k) // c * c)
            if upto is not None and upto[b] < most:
                most = upto[b]
            n = common_chunks(k, prompt, c, most)
            if n and (best is None or (n, use.get(b, 0)) > (best[1], use.get(best[0], 0))):
                best = (b, n)
        return best

    def admission(self, s: g.State, r: int, remote: bool = False) -> Admission | None:
        """How to admit waiting request r now, or None if no lane or block is available.
        `remote`: r's KV comes from a prefill worker, into a fresh block (never a cache hit)."""
        lane = self.idle_lane(s)
        if lane is None:
            return None
        if self.spare_local_slot and s.consts.HYBRID and any(s.busy) \
                and sum(not x for x in s.busy) == 1:
            return None
        prompt = s.prompt.get(r)
        if s.consts.PREEMPT and any(s.busy) and self._room(s) < self._blocks_for(s, prompt):
            return None
        if remote:
            # (with preemption one importing table grows at a time: `one_import_table_growing`)
            if not _core(s).ready_admit_import(s, l=lane, r=r):
                return None
            dst = self.reusable(s)
            return None if dst is None else AdmitImport(l=lane, r=r, dst=dst)
        hit = self.best_hit(s, prompt) if s.consts.PREFIX else None
        # (a device hit is never skipped: a miss beside one is no move (`no_cache_hit`); the
        # scheduler drops the entries an uncached request would hit before it is admitted)
        host = self.best_host_hit(s, prompt) if s.consts.HOST and r not in self.uncached \
            else None
        if prefer_host(hit, host):
            assert host is not None
            dst = self.reusable(s)
            if dst is None:
                return None
            return AdmitHostHit(l=lane, r=r, h=host[0], dst=dst, n=host[1])
        if hit is not None:
            src, n = hit
            dst = self.reusable(s, exclude=src)
            if dst is not None:
                return AdmitHit(l=lane, r=r, src=src, dst=dst, n=n)
            # the hit's source is the only reusable block: take the entry over rather than
            # wait for a running request (which, with every other lane idle, never comes)
            adopt = AdmitAdopt(l=lane, r=r, src=src, n=n)
            if _core(s).admit_adopt_guard(s, *adopt.values) is None:
                return adopt
            # a hybrid model's lane cannot take it over (the sliding state is restored with a
            # copy): it evicts the entry and computes the prefix again
            miss = AdmitMiss(l=lane, r=r, dst=src)
            if _core(s).admit_miss_guard(s, *miss.values) is None:
                return miss
            return None
        dst = self.reusable(s)
        if dst is None:
            return None
        return AdmitMiss(l=lane, r=r, dst=dst)

    @staticmethod
    def _blocks_for(s: g.State, prompt: TokSeq) -> int:
        """With preemption, a request is admitted beside running ones only when its whole
        prompt fits in the blocks left (and, with dynamic scratch, a padding block besides):
        else its prefill would preempt it again as soon as it needs a block, and the lanes it
        displaced, which cannot run while a prefill takes every step, would never finish. An
        import (never preempted) would take the blocks it lacks from the lanes it joins."""
        blocks = -(-len(prompt) // s.consts.S)
        return blocks + (0 if s.consts.RESERVED else 1)

    def _room(self, s: g.State) -> int:
        pins = self.pinned(s)
        if not pins:  # (the common case, counted at C speed)
            return s.owner.count(g.OWNER_FREE) + s.owner.count(g.OWNER_CACHE)
        return sum(1 for b in range(s.consts.K) if b not in pins
                   and s.owner[b] in (g.OWNER_FREE, g.OWNER_CACHE))

    def growth(self, s: g.State) -> list[int]:
        """Lanes whose tail block is full and that have more to compute: each needs its next
        block (`grow`) before the next prefill or decode call; and importing lanes whose table
        does not cover the prompt yet (`import_grow`). The core decides (`ready_grow`: every
        conjunct of the guard but the ones on the block, which is left open)."""
        c = _core(s)
        # Each guard is asked only of the busy lanes that can pass it, found with plain reads:
        # `grow` requires its lane's tail full (`tail_full`), `import_grow` its lane importing
        # (`lane_importing`; both proved on the spec: tests/test_policy_lanes.py). A decoding
        # lane's tail fills once per block_size tokens, so most steps ask no guard at all.
        length, start, tail, full = s.length, s.start, s.tail, s.consts.S
        phase, lane_req, importing = s.phase, s.lane_req, g.PHASE_IMPORTING
        lanes = [ln for ln in busy_lanes(s)
                 if (length[ln] == start[tail[ln]] + full and c.ready_grow(s, l=ln))
                 or (phase.get(lane_req[ln]) == importing and c.ready_import_grow(s, l=ln))]
        # the oldest first (most steps: no lane, or one)
        return sorted(lanes, key=self._admitted_at) if len(lanes) > 1 else lanes

    def grow(self, s: g.State, lane: int) -> Growth | None:
        """How lane (one of `growth`'s) gets its next block: an importing lane the reusable
        block (`import_grow`); a prefilling lane a block besides its cached continuation's
        source, loaded from the host tier when that hit is longer (`grow_host_hit`), else
        copied (`grow_hit`); the source itself when it is the only block left (`grow_adopt`;
        a hybrid lane grows into it as a plain block); else a plain block (`grow`). With no
        block: None while a transfer or a store is in flight (a
        block frees when it ends: wait, as admission does), else the victim to preempt
        (`preempt`), else None (no victim: K below the capacity rule, or preemption off)."""
        if _core(s).importing(s, lane):
            dst = self.reusable(s)
            return self._no_block(s) if dst is None else ImportGrow(l=lane, dst=dst)
        hit = self.next_hit(s, lane)
        dst = self.reusable(s, exclude=None if hit is None else hit[0])
        if dst is None and hit is not None:  # the hit's source is the only block left
            adopt = GrowAdopt(l=lane, src=hit[0], n=hit[1])
            if _core(s).grow_adopt_guard(s, *adopt.values) is None:
                return adopt
            hit, dst = None, self.reusable(s)
        if dst is None:
            return self._no_block(s)
        host = self.next_host_hit(s, lane) if s.consts.HOST else None
        if prefer_host(hit, host):
            assert host is not None
            return GrowHostHit(l=lane, h=host[0], dst=dst, n=host[1])
        if hit is not None:
            return GrowHit(l=lane, src=hit[0], dst=dst, n=hit[1])
        return Grow(l=lane, dst=dst)

    def _no_block(self, s: g.State) -> Preempt | None:
        if self.in_flight(s) or not s.consts.PREEMPT:
            return None
        lane = self.victim(s)  # (never an importing lane: it computes nothing)
        return None if lane is None else Preempt(l=lane)

    @staticmethod
    def in_flight(s: g.State) -> bool:
        """A transfer or a store is running, and frees or unpins blocks when it ends: a lane's
        transfer (an import whose table is complete, an export), a block draining for one, a
        block being stored to the host tier. An import still waiting for its table has not
        started its transfer."""
        c = _core(s)
        return (any(c.moving(s, n) and not c.import_waits(s, n) for n in range(s.consts.B))
                or any(o in (g.OWNER_DRAINING, g.OWNER_SPILLING) for o in s.owner))

    def victim(self, s: g.State) -> int | None:
        """The lane to preempt when a lane waits for a block and none is reusable: the most
        recently admitted one the core allows (possibly the waiting lane itself), as vLLM does.
        The oldest lane is preempted only when it is the only choice, and a lane running alone
        never is (proved: `lone_lane_is_never_preempted`), so the oldest lane finishes."""
        lanes = sorted(range(s.consts.B), key=lambda ln: -self.admitted.get(ln, 0))
        enabled = _core(s).enabled_preempt
        return next((ln for ln in lanes if enabled(s, l=ln)), None)

    def spill_slot(self, s: g.State, block: int) -> tuple[int, bool] | None:
        """Where evicted device entry `block` goes in the host tier: (an empty slot, False), else
        (the least recently used host entry, True: evict it first), else None; also None when a
        host entry at the same position already offers every hit it could (hits are whole
        chunks: the same whole chunks of its key)."""
        key = s.key[block]
        m = len(key) // s.consts.C * s.consts.C
        if any(s.slot_state[h] != g.SLOTSTATE_EMPTY and s.slot_start[h] == s.start[block]
               and len(s.slot_key[h]) >= m and take(s.slot_key[h], m) == take(key, m)
               for h in range(s.consts.H)):
            return None
        stored = []
        for h in range(s.consts.H):
            if s.slot_state[h] == g.SLOTSTATE_EMPTY:
                return h, False
            if s.slot_state[h] == g.SLOTSTATE_STORED:
                stored.append(h)
        if not stored:
            return None
        return min(stored, key=lambda h: self.slot_use.get(h, 0)), True

    def snapshot(self, s: g.State, lane: int) -> bool:
        """Hybrid prefix cache: save the lane's sliding state now? At every chunk boundary of
        the prompt (the spec allows more: generated tokens too), which is where a later prompt
        that shares a prefix can hit. Each snapshot costs one local slot of host memory."""
        return (_core(s).enabled_snapshot(s, l=lane)
                and s.length[lane] <= s.lane_plen[lane])

    def local_pad(self, s: g.State) -> int:
        """Hybrid: whose local slot the padding rows of the next decode call write. Only an
        idle lane's holds no live window; with none idle, decode waits for the lane that is
        not decoding (0 is then refused by the guard, never written)."""
        lane = self.idle_lane(s)
        return 0 if lane is None else lane

    def pad(self, s: g.State) -> int:
        """Where padding rows of the next decode call write."""
        if s.consts.RESERVED:
            return s.consts.SCRATCH
        b = self.reusable(s)
        return 0 if b is None else b  # None: every row decodes, the pad is never written


# The policies by name: one registration makes a policy reachable by name and tested (the core
# state machine, `atom_core.testing.machine`, draws every registered policy for its runs and
# checks each of its choices against the spec). A policy is a `Policy` subclass overriding the
# choices it changes (`reusable` for the device cache's eviction order, `spill_slot` for the host
# tier's, `victim` for preemption's); see docs/ARCHITECTURE.md, "How to add an eviction policy".
POLICIES: dict[str, Callable[[], Policy]] = {"lru": Policy}
