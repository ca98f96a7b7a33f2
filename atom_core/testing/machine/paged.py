"""Paged block tables (T > 1): a full tail's next block (`grow`), and with the prefix
cache hits past the first block, device (`grow_hit`) and host (`grow_host_hit`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from atom_core.policy import common_chunks
from atom_core.seq import seq
from atom_core.testing.lifecycle import ALPHABET, Stats
from atom_core.testing.strategies import coin, num, pick, token_lists

# The scene (at an example's start) in which the policy takes a hit's source over (`adopt_scene`)
ADOPT_SCENE = "scene: a hit's source, the only reusable block, grown into"


class PagedRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

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

    def lane_to_grow(self, data: Any, lane: int | None,
                     next_hit: Callable[[Any, int], Any]) -> tuple[int, Any]:
        """A grow's lane: `lane` when given (no hit then: the caller aims at a guard), else a
        drawn one (often one that prefills and needs its next block, or one that prefills),
        with `next_hit(state, lane)`, the policy's hit for it, when it needs a block."""
        if lane is not None:
            return lane, None
        life = self.life
        pred = pick(data, (lambda l: life.prefilling(l) and life.needs_block(l),
                           life.prefilling, lambda l: life.lane[l] is not None),
                    "lane: needs a block, prefills, busy")
        lane = self.lanes(data, pred)
        return lane, (next_hit(self.s, lane)
                      if life.prefilling(lane) and life.needs_block(lane) else None)

    def drawn_grow_hit(self, data: Any, lane: int | None = None) -> None:
        """grow_hit with drawn parameters: a lane (often one that prefills and needs its
        next block, or one that prefills) and, often, the policy's hit for it
        (`Policy.next_hit`, into the block `Policy.reusable` picks besides its source:
        accepted, refinement); else (always for a given `lane`, which the caller grows as
        the policy does next) a call aimed at one guard: the calls `grow_hit_calls` makes
        are grouped by the guard the lifecycle model says refuses them (or none: a legal
        hit), and the group is drawn first, so that each guard that can refuse the lane
        now is as likely as any other."""
        s = self.s
        l, hit = self.lane_to_grow(data, lane, self.policy.next_hit)
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
        s = self.s
        l, hit = self.lane_to_grow(data, lane, self.policy.next_host_hit)
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
        several blocks. It is served by the real scheduler (`prefill_request`: admitted as
        the policy chooses, a hit copying the first block's part; its next block grown
        before each prefill, a hit past the first block when the entry at that position
        goes on as the prompt does, hybrid: as far as the entry's snapshots reach; its
        chunks prefilled, hybrid: a snapshot at each boundary as the policy takes them;
        copies and loads sometimes left in flight, then ended here); then it decodes a few
        steps and the client finishes it into the cache (`decode_request`), so the next
        turn has a longer conversation to go on from. On the way, drawn grow_hit calls
        (`drawn_grow_hit`, refused by the guard the lifecycle model names, or a legal hit):
        while its copy is in flight, mid-block, and at each boundary (often one call for
        each guard that refuses some call there).
        Often the other entries are dropped first (`discard`, unpinned ones, until a
        table's worth of blocks is free): the policy evicts the entries past a first block
        first (the conversation's own, its middle blocks before its end: they have no use
        time), so with few blocks the hit would often find its next block gone. False if
        no turn could start (no idle lane), or it did not reach its decode (the scheduler
        admitted it no lane, a step found no block, it was preempted or ended)."""
        life, c, s = self.life, self.c, self.s
        if None not in life.lane:
            return False
        later = [tuple(s.key[b]) for b in range(c.K)
                 if s.owner[b] == self.core.OWNER_CACHE and s.start[b] > 0]
        # (host tier: a conversation whose later block is a host entry goes on too)
        later += [tuple(s.slot_key[h]) for h in range(c.H)
                  if s.slot_state[h] == self.core.SLOTSTATE_STORED and s.slot_start[h] > 0]
        m = c.T * c.S - 1
        if later and num(data, 0, 3, "a fresh conversation (0)"):
            key = pick(data, later, "conversation")
            ours = [b for b, (k, _) in sorted(life.entries.items())
                    if len(k) <= len(key) and k == key[:len(k)]]
            if coin(data, "room for it") and "discard" in self.core.ACTIONS:
                others = [b for b in sorted(life.entries)
                          if b not in ours and not life.pinned(b)]
                for b in others[:max(0, c.T - life.owner.count("FREE"))]:
                    assert self.apply("discard", b).rejected is None
            if c.HOST and coin(data, "its later blocks to the host"):
                # evicted from the device since (the batcher spills an entry it evicts):
                # the turn's next blocks are then loaded from the host (`grow_host_hit`)
                for b in ours:
                    if life.start[b] > 0 and not life.pinned(b):
                        self.spill_entry(None, b)
            tail = data.draw(token_lists(1, c.S), label="next turn")
            if coin(data, "a cut past the first block"):  # then it goes another way
                whole, key = key, key[:num(data, min(c.S + 1, len(key)), len(key), "keep")]
                if len(key) < len(whole) and tail[0] == whole[len(key)]:
                    tail[0] = ALPHABET[(ALPHABET.index(tail[0]) + 1) % len(ALPHABET)]
            p = seq((key + tuple(tail))[:m])
        else:
            p = seq(data.draw(token_lists(c.S + 1, m), label="prompt"))
        r = self.next_id
        self.next_id += 1
        assert self.apply("submit", r, p).rejected is None
        self.local(r, first=True)
        if c.HOST and num(data, 0, 2, "a later block's host entry first (0)") == 0:
            self.refuse_later_host_hit(data, r)

        def drawn_calls(l: int) -> None:
            """Drawn hits past the first block at lane l's state, before each step."""
            if not life.prefilling(l):
                return
            if life.copying[l]:
                if num(data, 0, 3, "a drawn grow_hit first (0)") == 0:
                    self.drawn_hit_past_first_block(data, l)  # no_copy_in_flight, ...
            elif life.needs_block(l):
                # (a boundary with entries about is the rare state a refusal needs: each
                # guard that refuses some call here, and has refused none yet this run, its
                # first such call, without draws: a refused call changes nothing, so the
                # examples replay alike; and often one call for each such guard, drawn)
                for action, calls in self.hit_calls(l):
                    for guard in sorted(g for g in calls
                                        if g is not None and not Stats.rejected[action, g]):
                        assert self.apply(action, *calls[guard][0]).rejected == guard
                if coin(data, "each refusal first"):
                    for action, calls in self.hit_calls(l):
                        for guard in sorted(g for g in calls if g is not None):
                            args = pick(data, calls[guard], "src, dst, n")
                            assert self.apply(action, *args).rejected == guard, args
                # (once an example, the lane takes the entry over itself, as the policy does
                # only when the entry is the last reusable block: a state the flows seldom
                # reach; more often would leave later turns fewer entries to hit)
                adopt = [] if self.adopted else self.grow_adopt_calls(l).get(None)
                if adopt and num(data, 0, 3, "take the entry over (0)") == 0:
                    self.adopted = True
                    assert self.apply("grow_adopt", *pick(data, adopt, "src, n")).rejected is None
                for _ in range(num(data, 0, 2, "drawn grow_hit calls first")):
                    if life.needs_block(l):  # (until one is accepted)
                        self.drawn_hit_past_first_block(data, l)
            elif num(data, 0, 3, "a drawn grow_hit mid-block (0)") == 0:
                self.drawn_hit_past_first_block(data, l)  # tail_full

        l = self.prefill_request(data, r, drawn_calls)
        if l is None:
            return False
        return self.decode_request(data, r, l, pick(data, (0, 1, c.S, c.T * c.S), "tokens"))

    # a fixed scene at an example's start --------------------------------------------
    def adopt_scene_depth(self) -> int | None:
        """The boundary (in blocks, j) at which `adopt_scene` can leave a lane's hit source
        the only reusable block, or None where it cannot: the lane holds j blocks, the
        other lanes at most T each, so j >= K' - 1 - (B - 1) * T (K' the blocks but the
        reserved scratch); j < T; and the lane's prompt (j * S + C + 1 tokens) fits."""
        c = self.c
        if not c.PREFIX or c.HYBRID or c.T < 2:
            return None
        j = max(1, c.K - c.RESERVED - 1 - (c.B - 1) * c.T)
        return j if j < c.T and j * c.S + c.C + 1 < c.T * c.S else None

    def adopt_scene(self) -> None:
        """From the initial state, where the configuration allows it (`adopt_scene_depth`,
        else `admit_adopt_scene`; `setup` draws whether to): the policy takes a hit's
        source over (`grow_adopt`), a
        situation the flows seldom reach (the scheduler's steps run every lane, so lanes
        finish and free blocks, and the conversations' later entries are evicted, before a
        turn's lane needs its source). A conversation of j blocks and a chunk is served
        into the cache; the same prompt and a token more is computed up to its j-th
        boundary, in the conversation's own first blocks (the entry there dropped, the
        next ones grown into, so that only the entry at the boundary is left); the other
        lanes take every other block (decoding, room left in their tails); then one step
        of the real scheduler, whose only choice is to take that entry over. The example
        goes on from there."""
        life, c = self.life, self.c
        j = self.adopt_scene_depth()
        if j is None:
            self.admit_adopt_scene()
            return
        assert self.next_id == 0, "from the initial state only"
        Stats.events[ADOPT_SCENE] += 1
        p = tuple(ALPHABET[i % len(ALPHABET)] for i in range(j * c.S + c.C))
        conversation = self.scene_request(0, p, len(p))
        assert self.apply("finish", 0, True).rejected is None
        assert self.apply("discard", conversation[0]).rejected is None
        self.scene_request(0, (*p, ALPHABET[0]), j * c.S, conversation[:j])
        self.scene_fillers()
        src = conversation[j]
        assert [b for b in range(c.K) if life.reusable(b)] == [src], life.owner
        before = Stats.applied["grow_adopt"]
        self.scheduler_step()
        assert Stats.applied["grow_adopt"] == before + 1 and src in life.tables[0], (
            life.tables)

    def admit_adopt_scene(self) -> None:
        """`adopt_scene` at admission, where the lanes but one can hold every block but
        one (K' - 1 <= (B - 1) * T; with T = 1 at the capacity rule): the conversation is
        one chunk, cached; the other lanes take every other block; a request
        with its first chunk waits; one step of the real scheduler, whose only choice is to
        admit it by taking the entry over (`admit_adopt`)."""
        life, c = self.life, self.c
        # (not with preemption: there the step may preempt a lane for a decode call's
        # padding target, none being reusable, before it admits)
        if (not c.PREFIX or c.HYBRID or c.PREEMPT or c.K - c.RESERVED - 1 > (c.B - 1) * c.T
                or c.C + 1 >= c.T * c.S):
            return
        assert self.next_id == 0, "from the initial state only"
        Stats.events[ADOPT_SCENE] += 1
        p = tuple(ALPHABET[i % len(ALPHABET)] for i in range(c.C))
        (src,) = self.scene_request(0, p, len(p))
        assert self.apply("finish", 0, True).rejected is None
        self.scene_fillers()
        assert self.apply("submit", self.next_id, seq((*p[:c.C], ALPHABET[2]))).rejected is None
        self.next_id += 1
        assert [b for b in range(c.K) if life.reusable(b)] == [src], life.owner
        before = Stats.applied["admit_adopt"]
        self.scheduler_step()
        assert Stats.applied["admit_adopt"] == before + 1 and life.tables[0][:1] == [src], (
            life.tables)

    def scene_fillers(self) -> None:
        """Lanes 1.. take every free block, T at most each, decoding with room left in
        their tails (none needs a block; a prompt no entry's first chunk matches)."""
        life, c = self.life, self.c
        free = [b for b in range(c.K) if life.owner[b] == "FREE"]
        for l in range(1, c.B):
            m = min(c.T, len(free))
            if m:
                self.scene_request(l, (ALPHABET[1],) * ((m - 1) * c.S + 1), (m - 1) * c.S + 1,
                                   free[:m])
                free = free[m:]

    def scene_request(self, l: int, p: tuple[int, ...], upto: int,
                      blocks: list[int] | None = None) -> list[int]:
        """A new request with prompt p admitted (a miss) into idle lane l and computed up
        to `upto` tokens, into `blocks` (else free ones) in order: lane l's table."""
        life, c = self.life, self.c
        r = self.next_id
        self.next_id += 1
        todo = list(blocks) if blocks is not None else [
            b for b in range(c.K) if life.owner[b] == "FREE"]
        assert self.apply("submit", r, seq(p)).rejected is None
        assert self.apply("admit_miss", l, r, todo.pop(0)).rejected is None
        while life.length[l] < upto:
            if life.tail_full(l):
                assert self.apply("grow", l, todo.pop(0)).rejected is None
            assert self.apply("prefill", l, ALPHABET[0]).rejected is None
        return list(life.tables[l])

    def drawn_hit_past_first_block(self, data: Any, lane: int | None = None) -> None:
        """A drawn grow_hit (`drawn_grow_hit`), with the host tier often a drawn
        grow_host_hit (`drawn_grow_host_hit`), and sometimes a drawn grow_adopt
        (`drawn_grow_adopt`), for `lane` if given."""
        if num(data, 0, 3, "take an entry over (0)") == 0:
            self.drawn_grow_adopt(data, lane)
        elif self.c.HOST and coin(data, "from the host"):
            self.drawn_grow_host_hit(data, lane)
        else:
            self.drawn_grow_hit(data, lane)

    def drawn_grow_adopt(self, data: Any, lane: int | None = None) -> None:
        """grow_adopt with drawn parameters, as `drawn_grow_hit` draws them: a call aimed
        at one guard (or none: the lane takes the entry over), each guard that can refuse
        the lane now as likely as any other."""
        l, _ = self.lane_to_grow(data, lane, self.policy.next_hit)
        calls = self.grow_adopt_calls(l)
        guard = pick(data, sorted(calls, key=lambda g: g or ""), "guard (None: accepted)")
        args = pick(data, calls[guard], "src, n")
        assert self.apply("grow_adopt", *args).rejected == guard, (args, guard)

    def grow_adopt_calls(self, l: int) -> dict[str | None, list[tuple[int, int, int]]]:
        """grow_adopt calls for lane l over every source and n (whole chunks up to past the
        block, 0, and 1), by the guard the lifecycle model says refuses them (None: the
        lane may take the entry over)."""
        life, c = self.life, self.c
        calls: dict[str | None, list[tuple[int, int, int]]] = {}
        for src in range(c.K):
            for n in sorted({0, 1, *range(c.C, c.S + c.C + 1, c.C)}):
                calls.setdefault(life.predict("grow_adopt", (l, src, n)), []).append(
                    (l, src, n))
        return calls

    def hit_calls(self, l: int) -> list[tuple[str, dict[str | None, list[Any]]]]:
        """(action, its calls by guard) for lane l's hits past the first block: grow_hit's
        (`grow_hit_calls`) and grow_adopt's (`grow_adopt_calls`), with the host tier
        grow_host_hit's too."""
        out: list[tuple[str, dict[str | None, list[Any]]]] = [
            ("grow_hit", self.grow_hit_calls(l)), ("grow_adopt", self.grow_adopt_calls(l))]
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
