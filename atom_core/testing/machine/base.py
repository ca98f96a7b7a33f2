"""The machine's base: setup, the checks of every step (`apply`), the natural workload,
single actions with arbitrary parameters, the calls that must be rejected and teardown.
The feature tiers' rules are mixins beside it (`atom_core.testing.machine`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from atom_core._generated import core as committed
from atom_core.policy import Policy, common_chunks, prefer_host
from atom_core.seq import seq
from atom_core.testing.lifecycle import (
    ALPHABET,
    CRASH,
    ENDED,
    IMPORT_SHORT,
    LATER_LOAD_FAILED,
    MOVING,
    NO_SLOT,
    SNAPSHOT_CAP,
    STEMS,
    Life,
    Stats,
)
from atom_core.testing.strategies import (
    Capacity,
    coin,
    ints,
    num,
    pick,
    prompts,
    token_lists,
    tokens,
)


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


# The rules that take PD actions (make_machine(pd=False) drops them).
PD_RULES = {"admit_import", "pd_flow", "late_pd_event"}
# The rules that preempt with drawn parameters or storm (make_machine(preempt=False) drops
# them: a machine without them draws its steps as before they existed).
PREEMPT_MACHINE_RULES = {"preempt", "storm"}


def to_committed(e: Any) -> Any:
    """An effect of a loaded variant core as the committed core's class (Policy.observe
    dispatches on the committed classes)."""
    cls = committed.EFFECTS.get(type(e).__name__.lower())
    return cls(*e) if cls is not None and cls._fields == e._fields else e


class MachineBase(RuleBasedStateMachine):
    """The rules and checks every configuration takes. `make_machine` sets the class
    attributes below and makes `setup` the initialize rule."""

    core: Any
    mcore: Any
    plain_fields: list[str]
    convert: Callable[[Any], Any]
    mirroring: bool
    check_progress: bool
    pd: bool
    capacity: Capacity

    def setup(self, c: Any) -> None:
        self.c = c
        self.s = self.core.init(c, True)
        self.s2 = (self.mcore.init(self.mcore.Consts(**attrs.asdict(c)), False)
                   if self.mirroring else None)
        self.policy = Policy()
        self.life = Life(c)
        self.diverged = False  # the core's state differs from the lifecycle model's
        self.next_id = 0
        scratch = "reserved" if c.RESERVED else "dynamic"
        self.at_capacity = c.K >= self.capacity(c.B, c.PREFIX, scratch, c.T, c.PREEMPT)
        assert self.core.check_axioms(c) == []
        assert self.core.check_invariants(self.s) == []

    # helpers ---------------------------------------------------------------
    def admission_room(self) -> bool:
        """The spec's `admission_room`: an idle lane can always admit (at capacity), with
        preemption only when no lane is busy (the others may hold every block)."""
        return not self.c.PREEMPT or not any(self.s.busy)

    def quiescent(self) -> bool:
        """The spec's `quiescent`: no copy or load in flight, no block draining and no
        store to the host tier in flight."""
        return (not any(self.s.copying) and self.core.OWNER_DRAINING not in self.s.owner
                and self.core.SLOTSTATE_STORING not in self.s.slot_state)

    def apply(self, name: str, *args: Any) -> Any:
        """Run one action on the core and check everything about the step."""
        act, guard, _, _ = self.core.ACTIONS[name]
        Stats.calls += 1
        pre = self.s
        expect = self.life.predict(name, args)
        out = act(pre, *args)
        if out.rejected is None:
            post = out.state
            try:
                bad = self.core.check_invariants(post)
            except Exception as exc:  # a checker must report, not crash
                raise InvariantViolation("checker crash", [f"{CRASH}: {exc!r}"], name, args,
                                         self.core, pre, post) from exc
            if bad:
                raise InvariantViolation("invariant", bad, name, args, self.core, pre, post)
            bad = self.core.check_transition(pre, post)
            if bad:
                raise InvariantViolation("transition invariant", bad, name, args, self.core,
                                         pre, post)
        assert guard(pre, *args) == out.rejected, (name, args)
        plan = getattr(self.core, f"{name}_plan", None)
        if plan is not None:  # the effects the action would have, or the guard
            assert plan(pre, *args) == (out.effects if out.rejected is None
                                        else out.rejected), (name, args)
        if out.rejected != expect:
            raise LifecycleDivergence(name, args, expect, out.rejected)
        if out.rejected is None:
            Stats.applied[name] += 1
            self.s = out.state
            self.policy.observe(self.convert(e) for e in out.effects)
            self.life.apply(name, args, out.effects, pre)
        else:
            Stats.rejected[name, out.rejected] += 1
            assert out.state is pre and out.effects == ()
            if (out.rejected == "no_block_overflow" and self.c.T > 1
                    and any(map(self.life.table_end, range(self.c.B)))):
                Stats.events["decode refused at a full table"] += 1
        try:
            self.life.compare(self.core, self.s)
        except AssertionError as exc:
            self.diverged = True
            raise ModelDivergence(name, args, str(exc)) from exc
        if self.mirroring:
            self.mirror(name, args, out)
        if self.check_progress and self.at_capacity and self.quiescent():
            stuck = self.core.progress_violations(self.s)
            if stuck:
                raise ProgressViolation(stuck, name, args, self.core, self.s)
        return out

    def mirror(self, name: str, args: tuple[Any, ...], out: Any) -> None:
        pre2 = self.s2
        out2 = self.mcore.ACTIONS[name][0](pre2, *args)
        if out2.rejected != out.rejected:
            raise MirrorDivergence("rejected", name, args, out.rejected, out2.rejected)
        if tuple(map(tuple, out2.effects)) != tuple(map(tuple, out.effects)):
            raise MirrorDivergence("effects", name, args, out.effects, out2.effects)
        if out2.rejected is not None:
            assert out2.state is pre2
            return
        s2 = self.s2 = out2.state
        assert all(getattr(s2, f) is None for f in self.mcore.GHOST_FIELDS)
        for f in self.plain_fields:
            if getattr(s2, f) != getattr(self.s, f):
                raise MirrorDivergence(f, name, args, getattr(self.s, f), getattr(s2, f))
        assert self.mcore.check_invariants(s2) == []
        assert self.mcore.check_transition(pre2, s2) == []

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
        return tuple(data.draw(token_lists(self.c.B, self.c.B),
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
                         if s.slot_state[h] != self.core.SLOTSTATE_EMPTY})
        if host and stored:
            base = pick(data, stored, "host key")
            k = num(data, min(c.C, len(base)), len(base), "keep")
            p = seq((base[:k] + tuple(data.draw(token_lists(1, m), label="tail")))[:m])
        else:
            cached = sorted(set(stored) | {tuple(s.key[b]) for b in range(c.K)
                                           if s.owner[b] == self.core.OWNER_CACHE})
            earlier = sorted({tuple(p) for p in self.life.prompt.values()})
            how = num(data, 0, 2, "fresh, extend a cache key, extend an earlier prompt")
            # (a uniform draw among the keys rarely picks one past a first block, and a
            # uniform cut rarely keeps more than its first block)
            later = sorted({tuple(s.key[b]) for b in range(c.K) if s.start[b] > 0
                            and s.owner[b] == self.core.OWNER_CACHE}) if how == 1 else []
            if later and coin(data, "a later block's key"):
                base = pick(data, later, "later block's key")
            else:
                base = pick(data, cached, "cache key") if how == 1 and cached else (
                    pick(data, earlier, "earlier prompt") if how and earlier else None)
            if base:
                whole = how == 1 and (c.HYBRID or c.T > 1) and coin(data, "next turn")
                k = len(base) if whole else num(data, 1, len(base), "keep")
                tail = data.draw(token_lists(0, m), label="tail")
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
                 if s.owner[b] == self.core.OWNER_CACHE and s.start[b] != 0]
        if not later or all(s.busy) or "discard" not in self.core.ACTIONS:
            return False
        head = tuple(s.key[later[0] if data is None else pick(data, later, "entry")][:c.C])
        firsts = [b for b in range(c.K) if s.owner[b] == self.core.OWNER_CACHE
                  and s.start[b] == 0 and tuple(s.head[b]) == head]
        if any(self.life.pinned(b) for b in firsts):
            return False
        for b in firsts:
            assert self.apply("discard", b).rejected is None
        tail = ((ALPHABET[0],) if data is None
                else data.draw(token_lists(1, c.T * c.S - 1 - c.C), label="tail"))
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
            if self.pd and (life.draining or life.in_phase(*MOVING) or moves and moves[0] == "admit"
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
        toks = self.decode_tokens(data)
        if coin(data, "policy pad"):
            self.decode_by_policy(toks)
        else:
            self.apply("decode", self.block(data, "pad"), self.policy.local_pad(self.s), toks)

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
                for fn in (self.core.spill, self.core.spill_guard, self.core.spill_plan):
                    with pytest.raises(IndexError, match="spill: h=0 is not a Slot"):
                        fn(self.s, b, 0)
            for l in range(c.B):
                assert life.load_slot[l] is None  # nothing to load from
                assert self.apply(("load_done", "load_fail")[l % 2], l).rejected == (
                    "load_in_flight")
                with pytest.raises(IndexError, match="grow_host_hit: h=0 is not a Slot"):
                    self.core.grow_host_hit(self.s, l, 0, 0, c.C)
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
        if self.pd:
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
        if "forget" not in self.core.ACTIONS:
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
                if "forget" in self.core.ACTIONS:  # its transfer's end will name it
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
                elif self.pd and life.prefilled(l) and r % 2:
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
