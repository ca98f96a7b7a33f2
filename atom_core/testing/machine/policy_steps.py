"""The policy's choices taken one at a time (an admission, a lane's next block, a decode call
with its padding target, a victim), each checked against the spec (refinement), with refused
calls before them; for the flows that interleave them with the core's actions directly.
The scheduler's own steps, its loop unchanged, are scheduled.py's."""

from __future__ import annotations

from typing import Any

from atom_core.policy import prefer_host
from atom_core.seq import seq
from atom_core.testing.lifecycle import (
    ALPHABET,
    IMPORT_SHORT,
    LATER_LOAD_FAILED,
    SNAPSHOT_CAP,
    Stats,
)
from atom_core.testing.machine.errors import (
    RefinementViolation,
)
from atom_core.testing.strategies import (
    coin,
    num,
    pick,
    tokens,
)


class PolicySteps:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

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
                                          f"of {r}", self.core, self.s)
            return False
        # Refinement: the policy picks only what the spec allows.
        self.refine(choice.action, choice.args)
        dst = choice.args.get("dst")  # (admit_adopt has none: the lane takes its source)
        if (data is not None and self.c.HOST and dst is not None
                and self.s.owner[dst] == self.core.OWNER_CACHE
                and num(data, 0, 3, "spill the victim (>0)")
                and self.spill_by_policy(data, dst)):
            return self.admit_by_policy(r, data)
        names = self.core.ACTIONS[choice.action][2]
        assert self.apply(choice.action, *(choice.args[k] for k in names)).rejected is None
        if choice.action == "admit_host_hit":
            Stats.events["policy host hit"] += 1
        if choice.action == "admit_adopt":
            Stats.events["policy adopts a hit's source"] += 1
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
        why = self.core.ACTIONS[action][1](self.s, **args)
        if why is not None:
            raise RefinementViolation(action, f"chose {args}, refused by {why}", self.core,
                                      self.s)

    def decode_by_policy(self, toks: tuple[int, ...], data: Any = None,
                         preempt: bool = True) -> Any:
        """A decode call with the policy's padding target. With preemption (and
        `preempt`), as the adapter does: when there is no padding target (every block
        held), the policy's victim is preempted (`preempt_by_policy`) and the call is made
        again, while some lane decodes."""
        pad, lpad = self.policy.pad(self.s), self.policy.local_pad(self.s)
        why = self.core.decode_guard(self.s, pad, lpad, toks)
        if why == "scratch_target_ok":
            # Refinement the other way: the policy found no target, so none exists
            # (every block is a lane's, pinned by a copy, draining or spilling).
            ok = [b for b in range(self.c.K)
                  if self.core.decode_guard(self.s, b, lpad, toks) in (None, "local_pad_ok")]
            if ok:
                raise RefinementViolation("decode", f"missed the scratch targets {ok}",
                                          self.core, self.s)
        if why == "local_pad_ok":
            # ... and no local slot may take the padding rows (every lane is busy)
            ok = [x for x in range(self.c.B)
                  if self.core.decode_guard(self.s, pad, x, toks) is None]
            if ok:
                raise RefinementViolation("decode", f"missed the idle local slots {ok}",
                                          self.core, self.s)
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
        ok = [l for l in range(c.B) if self.core.preempt_guard(self.s, l) is None]
        if victim is None:
            if ok:
                raise RefinementViolation("preempt", f"no victim, the spec accepts {ok}",
                                          self.core, self.s)
            return None
        self.refine("preempt", {"l": victim})
        busy = [l for l in range(c.B) if life.lane[l] is not None]
        if len(busy) > 1 and victim == life.oldest():
            if ok != [victim]:
                raise RefinementViolation("preempt", f"preempts the oldest lane {victim} "
                                          f"(the spec accepts {ok})", self.core, self.s)
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
                                      f"says {need} (oldest first)", self.core, self.s)
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
                    ok = [b for b in range(c.K) if self.core.grow_guard(self.s, l, b) is None]
                    if ok or (self.quiescent() and self.at_capacity
                              and (preempt or not c.PREEMPT)):
                        raise RefinementViolation("grow", f"no block for lane {l} (the "
                                                  f"spec accepts {ok})", self.core, self.s)
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
                ok = [b for b in range(c.K) if self.core.import_grow_guard(self.s, l, b) is None]
                if ok or (self.quiescent() and self.at_capacity and (preempt or not c.PREEMPT)
                          and not self.import_may_wait(l)):
                    raise RefinementViolation("import_grow", f"no block for lane {l} (the "
                                              f"spec accepts {ok})", self.core, self.s)
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
        snapshots, where `Policy.next_hit` caps it). When the hit's source is the only
        block, the lane takes it over (`grow_adopt`), as the adapter does. False if the lane
        is to take a plain block: no hit, or a hybrid lane with no block but the hit's
        source (the adapter then grows into whatever `reusable` picks, evicting it)."""
        hit = self.policy.next_hit(self.s, l)
        longest = self.longest_hits(l)
        if (hit is None) != (not longest) or hit is not None and hit not in longest:
            raise RefinementViolation("grow_hit", f"lane {l}'s next hit is {hit}, the "
                                      f"longest the spec accepts {longest}", self.core, self.s)
        if self.c.HYBRID and any(x == l for x, _, _ in self.later_hits_past_snapshot()):
            # an entry goes on as the prompt does further than its snapshots reach: the
            # policy's hit (checked above) stops at them, or there is none
            Stats.events[SNAPSHOT_CAP] += 1
        if hit is None:
            return False
        src, n = hit
        dst = self.policy.reusable(self.s, exclude=src)
        if dst is None and self.core.grow_adopt_guard(self.s, l, src, n) is None:
            self.refine("grow_adopt", {"l": l, "src": src, "n": n})
            assert self.apply("grow_adopt", l, src, n).rejected is None
            Stats.events["policy grows into its hit's source"] += 1
            return True
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
        (`longest_host_hits`). False if the lane is to take the device hit (copied, or taken
        over when its source is the only block) or a plain block (or there is no block: the
        caller finds none either)."""
        hit = self.policy.next_hit(self.s, l)
        while True:
            dst = self.policy.reusable(self.s, exclude=None if hit is None else hit[0])
            if dst is None and hit is not None:  # the hit's source is the only block left
                if self.core.grow_adopt_guard(self.s, l, *hit) is None:
                    return False  # the lane takes it over (`grow_hit_by_policy`)
                hit = None
                continue
            if (dst is None or self.s.owner[dst] != self.core.OWNER_CACHE
                    or data is not None and num(data, 0, 3, "spill it first (>0)") == 0
                    or not self.spill_by_policy(data, dst)):
                break
        host = self.policy.next_host_hit(self.s, l)
        longest = self.longest_host_hits(l)
        if (host is None) != (not longest) or host is not None and host not in longest:
            raise RefinementViolation("grow_host_hit", f"lane {l}'s next host hit is "
                                      f"{host}, the longest the spec accepts {longest}",
                                      self.core, self.s)
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
              if self.core.grow_host_hit_guard(self.s, l, h, self.s.tail[l], n) == "dst_reusable"]
        top = max((n for _, n in ok), default=0)
        return [(h, n) for h, n in ok if n == top]

    def longest_hits(self, l: int) -> list[tuple[int, int]]:
        """The (src, n) of the longest hits past the first block the spec accepts for lane
        l (any dst: `grow_hit`'s guard reports dst_not_src, its second to last, for
        dst == src exactly when every guard before it holds, hybrid_snapshot_at_n too)."""
        c = self.c
        ok = [(src, n) for src in range(c.K) for n in range(c.C, c.S + 1, c.C)
              if self.core.grow_hit_guard(self.s, l, src, src, n) == "dst_not_src"]
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
