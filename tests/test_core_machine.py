"""Stateful fuzzing of the generated core (hypothesis `RuleBasedStateMachine`).

The machine drives `atom_core._generated.core` (ghost state on) through every action, with
choices from the policy and with arbitrary drawn parameters, over small configurations that
exercise chunked prefill, prefix hits, padding rows and the block end. After every step it
checks the spec's invariants, transition invariants and (when no copy is in flight) progress,
and compares the core against a plain-Python model of the request lifecycle kept here.

It also checks:
* refinement: every choice `Policy` makes is accepted by the core's guard; the policy never
  declines an admission in a quiescent state with an idle lane (at or above capacity), and
  never misses a scratch target the spec would accept;
* ghost erasure: a ghost-off core fed the same steps has the same non-ghost fields;
* teeth: the same machine over mutant cores (`codegen.load(MODEL.without_guard(...))`)
  finds the expected invariant violation.

`bench/stateful.py` reuses `make_machine` to measure stateful steps per second.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from atom_core._generated import capacity
from atom_core._generated import core as committed
from atom_core.policy import Policy
from atom_core.seq import TokSeq, seq
from atom_core.spec import codegen
from atom_core.spec.model import MODEL

FEATURES = [(p, s) for p in (False, True) for s in ("reserved", "dynamic")]
ALPHABET = (1, 2, 3)
# Prompts start with a prefix of one of these stems, so prefix hits (first chunk equal) and
# long shared prefixes are common.
STEMS = ((1,) * 12, (1, 2) * 6, (2, 3, 3) * 4)
CRASH = "check_invariants crashed"
UNKNOWN = "?"  # the plain model cannot predict the guard (it depends on blocks)
RUNNING = ("prefill", "decode")
ENDED = ("finished", "aborted", "failed")
PHASE_OF = {"waiting": "WAITING", "prefill": "PREFILL", "decode": "DECODE",
            "finished": "FINISHED", "aborted": "ABORTED", "failed": "FAILED"}
# Guard conjuncts that read blocks (the lifecycle model predicts every other rejection).
BLOCK_GUARDS = {
    "admit_miss": {"dst_reusable", "no_cache_hit"},
    "admit_hit": {"src_cached", "n_whole_chunks", "n_within_entry", "token_left_to_compute",
                  "prefix_matches", "dst_not_src", "dst_reusable"},
    "decode": {"scratch_target_ok"},
    "discard": {"not_a_lane_block", "not_pinned"},
}


class Stats:
    """Counts over every machine run in the process (read by bench/stateful.py)."""

    steps = 0  # rule executions (hypothesis stateful steps)
    calls = 0  # core action calls (a rule may make several, or none)
    applied = Counter()  # successful transitions per action
    rejected = Counter()  # rejections per (action, guard)
    policy_idle = 0  # policy returned no admission (copy in flight or no idle lane)

    @classmethod
    def reset(cls) -> None:
        cls.steps, cls.calls, cls.policy_idle = 0, 0, 0
        cls.applied, cls.rejected = Counter(), Counter()


class InvariantViolation(AssertionError):
    """A step of the core led to a state (or transition) the spec's invariants forbid."""

    def __init__(self, kind: str, names: list[str], action: str, args: tuple[Any, ...],
                 core: Any, pre: Any, post: Any) -> None:
        self.kind, self.names, self.action, self.args = kind, names, action, args
        super().__init__(
            f"{kind} {names} violated by {action}{args}\n"
            f"pre:  {core.describe_state(pre)}\npost: {core.describe_state(post)}")


class MirrorDivergence(AssertionError):
    """The ghost-off core disagrees with the ghost-on core on a step."""

    def __init__(self, what: str, action: str, args: tuple[Any, ...], on: Any, off: Any) -> None:
        self.what = what
        super().__init__(f"ghost-off core differs in {what} after {action}{args}: "
                         f"on={on!r} off={off!r}")


def min_blocks(lanes: int, prefix: bool, scratch: str) -> int:
    return lanes + capacity.OFFSETS[(prefix, scratch)]


@st.composite
def configs(draw: Any, core: Any, prefix: bool, scratch: str, extra: tuple[int, int] = (0, 2),
            lanes: tuple[int, int] = (1, 3)) -> Any:
    """Small configurations: K from min_blocks + extra[0] to min_blocks + extra[1]."""
    b = draw(st.integers(*lanes))
    lo = min_blocks(b, prefix, scratch)
    k = draw(st.integers(max(1, lo + extra[0]), max(1, lo + extra[1])))
    c = draw(st.sampled_from((1, 2)))
    s = draw(st.sampled_from([x for x in range(6, 13) if x % c == 0]))
    return core.Consts(B=b, K=k, C=c, S=s, PREFIX=prefix, RESERVED=scratch == "reserved",
                       SCRATCH=k - 1)


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


class Life:
    """The request lifecycle in plain Python: what the core must agree with."""

    def __init__(self, c: Any) -> None:
        self.c = c
        self.status: dict[int, str] = {}
        self.prompt: dict[int, tuple[int, ...]] = {}
        self.ends: Counter[int] = Counter()
        self.lane: list[int | None] = [None] * c.B
        self.length = [0] * c.B
        self.seq: list[tuple[int, ...]] = [()] * c.B
        self.copying = [False] * c.B

    def decoding(self, l: int) -> bool:
        r = self.lane[l]
        return r is not None and self.status[r] == "decode"

    def predict(self, name: str, args: tuple[Any, ...]) -> str | None:
        """The guard the core must report, None (must apply) or UNKNOWN (block-level)."""
        c = self.c
        if name == "submit":
            r, p = args
            if r in self.status:
                return "request_is_new"
            if len(p) <= 0:
                return "prompt_not_empty"
            return "prompt_fits" if len(p) >= c.S else None
        if name in ("admit_miss", "admit_hit"):
            l, r = args[:2]
            if self.lane[l] is not None:
                return "lane_idle"
            return "request_waiting" if self.status.get(r) != "waiting" else UNKNOWN
        if name == "copy_done":
            return None if self.copying[args[0]] else "copy_in_flight"
        if name == "prefill":
            l = args[0]
            r = self.lane[l]
            if r is None or self.status[r] != "prefill":
                return "lane_prefilling"
            return "no_copy_in_flight" if self.copying[l] else None
        if name == "decode":
            if any(self.decoding(l) and self.length[l] >= c.S for l in range(c.B)):
                return "no_block_overflow"
            return None if all(self.decoding(l) for l in range(c.B)) else UNKNOWN
        if name == "finish":
            l, keep = args
            if not self.decoding(l):
                return "lane_decoding"
            return "keep_needs_prefix_cache" if keep and not c.PREFIX else None
        if name == "abort_waiting":
            return None if self.status.get(args[0]) == "waiting" else "request_waiting"
        if name in ("abort_running", "fail"):
            return None if self.lane[args[0]] is not None else "lane_busy"
        if name == "discard":
            return UNKNOWN
        raise KeyError(name)

    def _end(self, r: int, how: str) -> None:
        assert self.status[r] not in ENDED, f"request {r} ends twice"
        self.status[r] = how
        self.ends[r] += 1

    def apply(self, name: str, args: tuple[Any, ...], effects: tuple[Any, ...],
              pre: Any) -> None:
        """Advance the model by a step the core applied; check its effects on the way."""
        c = self.c
        kinds = [type(e).__name__ for e in effects]
        if name == "submit":
            r, p = args
            self.status[r], self.prompt[r] = "waiting", tuple(p)
            assert kinds == []
        elif name in ("admit_miss", "admit_hit"):
            l, r = args[:2]
            n = args[4] if name == "admit_hit" else 0
            if name == "admit_hit":
                assert c.C <= n < len(self.prompt[r]) and n % c.C == 0, args
            assert self.lane[l] is None and self.status[r] == "waiting"
            self.lane[l], self.status[r] = r, "prefill"
            self.length[l], self.seq[l] = n, self.prompt[r]
            self.copying[l] = name == "admit_hit"
            dst = args[-2] if name == "admit_hit" else args[2]
            assert effects[0] == (l, r, dst) and kinds[0] == "Admit"
            if name == "admit_hit":
                assert kinds == ["Admit", "Copy"] and effects[1] == (l, args[2], dst, n)
            else:
                assert kinds == ["Admit"]
        elif name == "copy_done":
            self.copying[args[0]] = False
            assert kinds == []
        elif name == "prefill":
            l, tok = args
            start = self.length[l]
            plen = len(self.prompt[self.lane[l]])
            end = min(start + c.C, plen)
            self.length[l] = end
            if end == plen:
                self.seq[l] += (tok,)
                self.status[self.lane[l]] = "decode"
            assert kinds == ["Prefill"] and effects[0] == (l, pre.table[l], start, end)
        elif name == "decode":
            pad, toks = args
            live = tuple(self.decoding(l) for l in range(c.B))
            rows = tuple(pre.table[l] if live[l] else pad for l in range(c.B))
            positions = tuple(self.length[l] if live[l] else 0 for l in range(c.B))
            (e,) = effects
            assert kinds == ["Decode"] and (e.rows, e.positions) == (rows, positions), (
                effects, rows, positions)
            assert getattr(e, "live", live) == live, (effects, live)
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
            self._end(r, how)
            self.lane[l], self.copying[l] = None, False
            assert kinds == ["Release"] and effects[0] == (l, pre.table[l])
        elif name == "abort_waiting":
            self._end(args[0], "aborted")
            assert kinds == []
        elif name == "discard":
            assert kinds == []  # no lifecycle change
        else:
            raise KeyError(name)

    def compare(self, core: Any, s: Any) -> None:
        """The core state agrees with the model."""
        names = core.PHASE_NAMES
        for r, st_ in self.status.items():
            assert names[s.phase.get(r)] == PHASE_OF[st_], (r, st_, names[s.phase.get(r)])
            assert tuple(s.prompt.get(r)) == self.prompt[r]
            assert self.ends[r] == (1 if st_ in ENDED else 0), (r, st_, self.ends[r])
        assert len(s.phase) == len(self.status)  # nothing else was ever submitted
        for l in range(self.c.B):
            r = self.lane[l]
            assert s.busy[l] == (r is not None), l
            if r is None:
                continue
            assert self.status[r] in RUNNING  # ended requests hold no lane
            assert s.lane_req[l] == r and s.req_lane.get(r) == l
            assert s.length[l] == self.length[l]
            assert tuple(s.lane_seq[l]) == self.seq[l]
            assert s.lane_plen[l] == len(self.prompt[r])
            assert s.copying[l] == self.copying[l]
        held = [r for r in self.lane if r is not None]
        assert len(held) == len(set(held))


# ------------------------------------------------------------------------------- machine


def _to_committed(e: Any) -> Any:
    """An effect of a loaded variant core as the committed core's class (Policy.observe
    dispatches on the committed classes)."""
    cls = committed.EFFECTS.get(type(e).__name__.lower())
    return cls(*e) if cls is not None and cls._fields == e._fields else e


def make_machine(core: Any = committed, config: st.SearchStrategy[Any] | None = None, *,
                 mirror: bool = True, mirror_core: Any = None, check_progress: bool = True,
                 focus: set[str] | None = None) -> type[RuleBasedStateMachine]:
    """A state machine over `core` (ghost on), configurations drawn from `config`.

    mirror: apply each step to a ghost-off state too (of `mirror_core`, default `core`) and
    compare non-ghost fields. check_progress: assert progress whenever no copy is in flight
    and K is at least the proved minimum. focus: keep only these rules (a focused search
    with the same rules and checks).
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
            self.next_id = 0
            scratch = "reserved" if c.RESERVED else "dynamic"
            self.at_capacity = c.K >= min_blocks(c.B, c.PREFIX, scratch)
            assert core.check_axioms(c) == []
            assert core.check_invariants(self.s) == []

        # helpers ---------------------------------------------------------------
        def quiescent(self) -> bool:
            return not any(self.s.copying)

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
            if expect == UNKNOWN:
                assert out.rejected in BLOCK_GUARDS[name] | {None}, (name, out.rejected)
            else:
                assert out.rejected == expect, (name, args, out.rejected, expect)
            if out.rejected is None:
                Stats.applied[name] += 1
                self.s = out.state
                self.policy.observe(convert(e) for e in out.effects)
                self.life.apply(name, args, out.effects, pre)
            else:
                Stats.rejected[name, out.rejected] += 1
                assert out.state is pre and out.effects == ()
            self.life.compare(core, self.s)
            if mirror:
                self.mirror(name, args, out)
            if check_progress and self.at_capacity and self.quiescent():
                assert core.progress_violations(self.s) == [], core.describe_state(self.s)
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
            assert s2.holds is None and s2.junk is None
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
            """A fresh prompt, or (multi-turn) a prefix of an earlier prompt or cache key
            with a new tail, so deep prefix hits happen."""
            s, m = self.s, self.c.S - 1
            cached = sorted({tuple(s.key[b]) for b in range(self.c.K)
                             if s.owner[b] == core.OWNER_CACHE})
            earlier = sorted({tuple(p) for p in self.life.prompt.values()})
            how = num(data, 0, 2, "fresh, extend a cache key, extend an earlier prompt")
            base = pick(data, cached, "cache key") if how == 1 and cached else (
                pick(data, earlier, "earlier prompt") if how and earlier else None)
            if base:
                k = num(data, 1, len(base), "keep")
                tail = data.draw(_token_lists(0, m), label="tail")
                p = seq((base[:k] + tuple(tail))[:m])
            else:
                p = data.draw(prompts(m), label="prompt")
            r = self.next_id
            self.next_id += 1
            assert self.apply("submit", r, p).rejected is None

        def admit_by_policy(self, r: int) -> bool:
            """Admit r as the policy chooses; False if the policy declines."""
            choice = self.policy.admission(self.s, r)
            if choice is None:
                Stats.policy_idle += 1
                idle = [l for l in range(self.c.B) if not self.s.busy[l]]
                if idle and self.quiescent() and self.at_capacity:
                    raise AssertionError(f"policy refuses a quiescent admission of {r}: "
                                         f"{core.describe_state(self.s)}")
                return False
            # Refinement: the policy picks only what the spec allows.
            assert core.ACTIONS[choice.action][1](self.s, **choice.args) is None, choice
            names = core.ACTIONS[choice.action][2]
            assert self.apply(choice.action, *(choice.args[k] for k in names)).rejected is None
            return True

        def decode_by_policy(self, toks: tuple[int, ...]) -> Any:
            pad = self.policy.pad(self.s)
            if core.decode_guard(self.s, pad, toks) == "scratch_target_ok":
                # Refinement the other way: the policy found no target, so none exists
                # (every block is a lane's or pinned by a copy).
                assert all(core.decode_guard(self.s, b, toks) is not None
                           for b in range(self.c.K)), "policy missed a scratch target"
            return self.apply("decode", pad, toks)

        @precondition(lambda self: self.waiting())
        @rule(data=st.data())
        def admit(self, data: Any) -> None:
            self.admit_by_policy(pick(data, self.waiting(), "request"))

        @rule(data=st.data(), k=st.integers(1, 16))
        def advance(self, data: Any, k: int) -> None:
            """Up to k productive steps, as a scheduler would take them: admit, complete a
            copy, prefill, decode (policy pad) or finish, whichever the draw picks."""
            for _ in range(k):
                life, c = self.life, self.c
                moves = []
                if self.waiting() and None in life.lane:
                    moves.append("admit")
                if any(life.copying):
                    moves.append("copy_done")
                prefilling = [l for l in range(c.B) if life.lane[l] is not None
                              and life.status[life.lane[l]] == "prefill" and not life.copying[l]]
                if prefilling:
                    moves.append("prefill")
                decoding = [l for l in range(c.B) if life.decoding(l)]
                if decoding:
                    moves += ["decode", "decode", "finish"]
                if not moves:
                    return
                move = pick(data, moves, "move")
                if move == "admit":
                    r = pick(data, self.waiting(), "request")
                    if not self.admit_by_policy(r):
                        return
                elif move == "copy_done":
                    self.apply("copy_done", life.copying.index(True))
                elif move == "prefill":
                    l = pick(data, prefilling, "lane")
                    self.apply("prefill", l, data.draw(tokens, label="tok"))
                elif move == "decode":
                    if self.decode_by_policy(self.decode_tokens(data)).rejected is not None:
                        full = [l for l in decoding if life.length[l] >= c.S]
                        if not full:
                            return  # no scratch target until a prefill or copy completes
                        self.apply("finish", full[0], coin(data, "keep"))
                else:
                    l = pick(data, decoding, "lane")
                    self.apply("finish", l, coin(data, "keep"))

        # rules: single actions, arbitrary parameters ----------------------------------
        def block(self, data: Any, label: str, *prefer: int) -> int:
            """Any block, often an interesting one: `prefer`, a copy source, a lane's block,
            a cache entry or the reserved scratch block."""
            s, c = self.s, self.c
            special = set(prefer) | {s.table[l] for l in range(c.B) if s.busy[l]}
            special |= {s.copy_src[l] for l in range(c.B) if s.copying[l]}
            special |= {b for b in range(c.K) if s.owner[b] == core.OWNER_CACHE}
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
                n = num(data, 0, c.S, "n")
                self.apply("admit_hit", l, r, src, dst, n)
            else:
                self.apply("admit_miss", l, r, self.block(data, "dst"))

        @rule(data=st.data())
        def copy_done(self, data: Any) -> None:
            self.apply("copy_done", self.lanes(data, lambda l: self.s.copying[l]))

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
                self.apply("decode", self.block(data, "pad"), toks)

        @rule(data=st.data(), keep=st.booleans())
        def finish(self, data: Any, keep: bool) -> None:
            self.apply("finish", self.lanes(data, self.life.decoding), keep)

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
            elif kind == "discard":
                self.apply("discard", self.block(data, "block"))
            else:
                copying = any(self.s.copying) and coin(data, "copying")
                self.apply(kind, self.lanes(data, lambda l: self.s.copying[l] if copying
                                            else self.s.busy[l]))

        # rules: calls that must be rejected ------------------------------------------
        @rule(data=st.data())
        def must_reject(self, data: Any) -> None:
            """Unknown or ended ids, idle or busy lanes, blocks the action may not use, bad
            prompts: the core must refuse, naming the guard the lifecycle says."""
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
                n = pick(data, (0, c.S, c.S + 1), "prompt length")
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
            elif kind == "owned_dst":
                l, r = pick(data, idle), pick(data, waiting)
                dst = s.table[pick(data, busy)]
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
                b = s.table[pick(data, busy)]
                call, args, expect = "discard", (b,), "not_a_lane_block"
            else:  # owned_pad: a padding row must not write a lane's block
                pad = s.table[pick(data, busy)]
                call, args = "decode", (pad, self.decode_tokens(data))
                overflow = any(life.decoding(l) and life.length[l] >= c.S for l in range(c.B))
                if not overflow and all(life.decoding(l) for l in range(c.B)):
                    return  # every row decodes: any pad is fine, nothing to reject
                expect = "no_block_overflow" if overflow else "scratch_target_ok"
            out = self.apply(call, *args)
            assert out.rejected == expect, (kind, call, args, out.rejected, expect)

        def teardown(self) -> None:
            """Drain: end every request (admitting each waiting one as the policy chooses,
            then finishing or aborting it), and check each ended exactly once."""
            if not hasattr(self, "life"):
                return
            life = self.life
            while True:
                if any(life.copying):
                    self.apply("copy_done", life.copying.index(True))
                elif any(life.decoding(l) for l in range(self.c.B)):
                    l = next(l for l in range(self.c.B) if life.decoding(l))
                    self.apply("finish", l, self.c.PREFIX)
                elif any(r is not None for r in life.lane):
                    self.apply("abort_running", next(
                        l for l in range(self.c.B) if life.lane[l] is not None))
                elif self.waiting():
                    r = self.waiting()[0]
                    if not self.admit_by_policy(r):  # only below capacity
                        self.apply("abort_waiting", r)
                else:
                    break
            assert all(x in ENDED and life.ends[r] == 1 for r, x in life.status.items())
            assert not any(self.s.busy) and self.quiescent()

        @invariant()
        def count_step(self) -> None:
            Stats.steps += 1

    CoreMachine.__name__ = CoreMachine.__qualname__ = f"CoreMachine_{core.__name__}"
    if focus is None:
        return CoreMachine
    rules = {k for k, v in vars(CoreMachine).items() if hasattr(v, "hypothesis_stateful_rule")}
    assert focus <= rules, focus - rules
    # A rule attribute shadowed by None is no rule (hypothesis collects marked members).
    return type(f"Focused{CoreMachine.__name__}", (CoreMachine,),
                dict.fromkeys(rules - focus))


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("prefix,scratch", FEATURES,
                         ids=[f"{'prefix' if p else 'noprefix'}-{s}" for p, s in FEATURES])
def test_core_machine(prefix: bool, scratch: str) -> None:
    """Invariants, transition invariants, progress, the lifecycle model, policy refinement
    and the ghost-off mirror, over B in 1..3, K from the proved minimum to minimum + 2."""
    Stats.reset()
    run_state_machine_as_test(make_machine(config=configs(committed, prefix, scratch)))
    # Not vacuous: every action applied (hits only with the prefix cache), and some lane
    # reached the block end (decode refused until it finishes).
    expected = set(committed.ACTIONS) - (set() if prefix else {"admit_hit", "copy_done"})
    assert expected <= set(Stats.applied), expected - set(Stats.applied)
    assert Stats.rejected["decode", "no_block_overflow"] > 0


def test_core_machine_below_capacity() -> None:
    """One block below the proved minimum the core may get stuck, but stays safe."""
    config = st.one_of(*(configs(committed, p, s, extra=(-1, -1)) for p, s in FEATURES))
    run_state_machine_as_test(make_machine(config=config))


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
    inspects it. The example budget is generous so random profiles find it too."""
    return settings(settings.default, max_examples=1000, report_multiple_bugs=False,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow])


# name -> (mutant spec, features, expected invariant, focus). Each mutant removes or weakens
# one guard or update. focus (None: every rule) keeps only the rules the bug needs, so the
# search stays within a few seconds; the rules and every check are the same machine's.
HIT_RULES = {"submit", "advance", "admit_arbitrary"}
MUTANTS: dict[str, tuple[Any, tuple[bool, str], str, set[str] | None]] = {
    "admit_hit-dst_not_src": (
        lambda: MODEL.without_guard("admit_hit", "dst_not_src"),
        (True, "dynamic"), "copy_source_cached", HIT_RULES),
    "decode-scratch_target_ok": (
        lambda: MODEL.without_guard("decode", "scratch_target_ok"),
        (False, "dynamic"), "lane_holds_its_tokens", None),
    "finish-key": (
        lambda: MODEL.without_update("finish", "key"),
        (True, "dynamic"), "cache_key_is_content", None),
    "admit_miss-dst_reusable": (
        lambda: MODEL.without_guard("admit_miss", "dst_reusable"),
        (False, "dynamic"), "no_block_in_two_tables",
        {"submit", "admit", "admit_arbitrary", "must_reject"}),
    "copy_done-copying": (
        lambda: MODEL.without_update("copy_done", "copying"),
        (True, "dynamic"), "copy_target_not_ready", None),
    "abort_running-copying": (
        lambda: MODEL.without_update("abort_running", "copying"),
        (True, "reserved"), "copy_only_while_prefilling",
        {"submit", "admit", "advance", "abort"}),
    "finish-keep_needs_prefix_cache": (
        lambda: MODEL.without_guard("finish", "keep_needs_prefix_cache"),
        (False, "reserved"), "cache_needs_prefix_cache", None),
    "submit-prompt_fits": (
        lambda: MODEL.without_guard("submit", "prompt_fits"),
        (False, "dynamic"), "waiting_prompt_fits", None),
    "admit_hit-n_whole_chunks-weakened": (
        lambda: _weakened_chunk_guard(),
        (True, "dynamic"), "prefill_on_chunk_boundary", HIT_RULES),
}


def _weakened_chunk_guard() -> Any:
    """admit_hit accepts any positive n, not only whole chunks (with_guard)."""
    (n,) = [p for p in MODEL.get_action("admit_hit").params if p.name == "n"]
    return MODEL.with_guard("admit_hit", "n_whole_chunks", n > 0)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_machine_catches_mutant(name: str) -> None:
    """The same machine over a mutant core reports the expected invariant."""
    build, (prefix, scratch), expected, focus = MUTANTS[name]
    mutant = codegen.load(build(), f"atom_core_mutant_{name.replace('-', '_')}")
    config = configs(mutant, prefix, scratch, lanes=(2, 2))
    if name == "admit_hit-n_whole_chunks-weakened":
        config = config.filter(lambda c: c.C == 2)
    machine = make_machine(mutant, config, mirror=False, focus=focus)
    with pytest.raises(InvariantViolation) as info:
        run_state_machine_as_test(machine, settings=_search_settings())
    assert info.value.kind != "checker crash", str(info.value)  # checkers report, never raise
    assert expected in info.value.names, (info.value.names, str(info.value))
