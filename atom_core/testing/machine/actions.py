"""Single actions with arbitrary parameters, and the calls that must be rejected (naming the
guard the lifecycle model says)."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from atom_core.policy import common_chunks
from atom_core.seq import seq
from atom_core.testing.lifecycle import (
    ALPHABET,
    ENDED,
    IMPORT_SHORT,
    MOVING,
    Stats,
)
from atom_core.testing.strategies import (
    coin,
    ints,
    num,
    pick,
    tokens,
)


class ActionRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    # rules: single actions, arbitrary parameters ----------------------------------
    def block(self, data: Any, label: str, *prefer: int) -> int:
        """Any block, often an interesting one: `prefer`, a copy source, a lane's block,
        a cache entry, the reserved scratch block, a draining or a spilling one."""
        s, c = self.s, self.c
        special = set(prefer) | {s.copy_src[l] for l in range(c.B) if s.copying[l]}
        special |= {b for b in range(c.K)
                    if s.owner[b] in (self.core.OWNER_LANE, self.core.OWNER_CACHE,
                                      self.core.OWNER_DRAINING, self.core.OWNER_SPILLING)}
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
        hits = self.hits_of(w) if c.PREFIX else []
        if hits and num(data, 0, 3, "near a hit (>0)"):
            # The policy's (src, n) for a hit, with any lane and dst and a nearby n; or a miss
            # beside it (refused by no_cache_hit but where a hybrid model's miss may take the
            # hit's entry, the only reusable block).
            r, (src, n) = pick(data, hits, "request, hit")
            n = pick(data, (n, n - 1, n + 1, c.C, n + c.C), "n")
            l = self.lanes(data, lambda l: not self.s.busy[l])
            how = pick(data, ("copy", "take the entry over", "miss"), "how")
            if how == "take the entry over":  # (admit_adopt: not for hybrid models)
                self.apply("admit_adopt", l, r, src, n)
            elif how == "miss":
                self.apply("admit_miss", l, r, self.block(data, "dst", src))
            else:
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

    def hits_of(self, rs: list[int]) -> list[tuple[int, tuple[int, int]]]:
        """(request, the policy's (entry, n)) for each of `rs` with a prefix hit."""
        return [(r, h) for r in rs if (h := self.policy.best_hit(self.s, self.s.prompt.get(r)))]

    @precondition(lambda self: self.c.PREFIX and not self.c.HYBRID)
    @rule(data=st.data())
    def adopt(self, data: Any) -> None:
        """A waiting request with a prefix hit takes its entry over (`admit_adopt`) with the
        policy's (entry, n) or a nearby n, into a drawn lane: applied, or refused by the guard
        the lifecycle model names (a busy lane, an entry a copy still reads, n past the entry
        or the block)."""
        c, life = self.c, self.life
        hits = self.hits_of(self.waiting())
        firsts = [b for b, (key, _) in life.entries.items()
                  if life.start[b] == 0 and len(key) >= c.C]
        if not hits and firsts and None in life.lane:
            # a new request that hits an entry: its first chunk and one token of its own
            key = life.entries[pick(data, sorted(firsts), "entry")][0]
            assert self.apply("submit", self.next_id, seq((*key[:c.C], ALPHABET[0]))
                              ).rejected is None
            self.next_id += 1
            hits = self.hits_of(self.waiting()[-1:])
        if not hits:
            return
        r, (src, n) = pick(data, hits, "request, hit")
        n = pick(data, (n, n - c.C, n + c.C, c.S + c.C), "n")
        self.apply("admit_adopt", self.lanes(data, lambda l: not self.s.busy[l]), r, src, n)

    @rule(data=st.data())
    def copy_done(self, data: Any) -> None:
        """copy_done (or, host tier, load_done / load_fail) for a lane, often one copying:
        each is refused for the other kind of copy."""
        name = pick(data, ("copy_done", "load_done", "load_fail") if self.c.HOST
                    else ("copy_done",), "action")
        self.apply(name, self.lanes(data, lambda l: self.s.copying[l]))

    @rule(data=st.data(), tok=tokens)
    def prefill(self, data: Any, tok: int) -> None:
        l = self.lanes(data, lambda l: self.life.lane[l] is not None
                       and self.life.status[self.life.lane[l]] == "prefill")
        self.apply("prefill", l, tok)

    @rule(data=st.data())
    def decode(self, data: Any) -> None:
        """decode with drawn tokens, and the policy's padding targets or a drawn one."""
        toks = self.decode_tokens(data)
        s = self.s
        pad = self.policy.pad(s) if coin(data, "policy pad") else None
        self.apply("decode", self.block(data, "pad") if pad is None else pad,
                   self.policy.local_pad(s), toks)

    @rule(data=st.data(), keep=st.booleans())
    def finish(self, data: Any, keep: bool) -> None:
        self.apply("finish", self.lanes(data, self.life.decoding), keep)

    @rule(data=st.data())
    def abort(self, data: Any) -> None:
        """The client aborts (waiting or running) or the runtime fails a lane or, when
        the spec has `discard`, scribbles on a block no lane owns."""
        kinds = ["abort_waiting", "abort_running", "fail"]
        kinds += ["discard"] if "discard" in self.core.ACTIONS else []
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
                assert all(self.s.owner[b] == self.core.OWNER_DRAINING and self.s.transfer[b]
                           for b in table), table
                Stats.events[f"{kind} drains"] += 1

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
        uncached = [b for b in range(c.K) if s.owner[b] != self.core.OWNER_CACHE]
        options += ["known_id"] if life.status else []
        options += ["ended_id"] if ended else []
        options += ["idle_lane"] if idle else []
        options += ["busy_lane"] if busy and waiting else []
        options += ["owned_dst"] if busy and idle and waiting else []
        options += ["scratch_dst"] if c.RESERVED and idle and waiting else []
        options += ["uncached_src"] if idle and waiting and uncached else []
        options += ["owned_pad"] if busy else []
        options += ["discard_lane_block"] if busy and "discard" in self.core.ACTIONS else []
        options += ["not_prefilled"] if self.pd and not all(map(life.prefilled, range(c.B))) else []
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
        options += ["import_grow_not_needed"] if self.pd else []
        short = [l for l in range(c.B) if life.needs_import_block(l)]
        options += ["short_import_done"] * 2 if self.pd and short else []
        options += ["second_import"] if (self.pd and idle and waiting
                                         and life.import_table_grows()) else []
        kind = pick(data, options, "kind")
        block = ints(0, c.K - 1)
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
                if s.owner[b] != self.core.OWNER_CACHE or s.start[b] == 0:
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
                if s.owner[b] != self.core.OWNER_CACHE:
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
                if (s.owner[b] != self.core.OWNER_CACHE or s.start[b] != at
                        or tuple(key[:at]) != p[:at]):
                    continue
                limit = min(c.S, len(key) - at, len(p) - 1 - at)
                n = common_chunks(key, p, c.C, limit, at)
                if n and at + n > s.snap_upto[b]:
                    out.append((l, b, n))
        return out
