"""Stateful fuzzing of the generated core (hypothesis `RuleBasedStateMachine`).

The machine drives `atom_core._generated.core` (ghost state on) through every action, with
choices from the policy and with arbitrary drawn parameters, over small configurations that
exercise chunked prefill, prefix hits, padding rows and the block end. After every step it
checks the spec's invariants, transition invariants and (when quiescent: no copy in flight,
no block draining) progress, and compares the core against a plain-Python model of the
request lifecycle kept here.
With `pd`, requests may also take the prefill/decode disaggregation path: import their KV by
transfer (decode side) or export it after prefill (prefill side), with transfers that fail,
get cancelled (the block drains until the transfer ends) and events that arrive late, twice
or for the wrong request (refused, changing nothing).

It also checks:
* refinement: every choice `Policy` makes is accepted by the core's guard; the policy never
  declines an admission in a quiescent state with an idle lane (at or above capacity), and
  never misses a scratch target the spec would accept;
* ghost erasure: a ghost-off core fed the same steps has the same non-ghost fields;
* teeth: the same machine over mutant cores (`codegen.load(MODEL.without_guard(...))`)
  finds the expected invariant violation (or lifecycle divergence).

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
from atom_core.spec import codegen, lang
from atom_core.spec import model as spec
from atom_core.spec.model import MODEL, PD_ACTIONS

FEATURES = [(p, s) for p in (False, True) for s in ("reserved", "dynamic")]
ALPHABET = (1, 2, 3)
# Prompts start with a prefix of one of these stems, so prefix hits (first chunk equal) and
# long shared prefixes are common.
STEMS = ((1,) * 12, (1, 2) * 6, (2, 3, 3) * 4)
CRASH = "check_invariants crashed"
UNKNOWN = "?"  # the plain model cannot predict the guard (it depends on blocks)
MOVING = ("importing", "exporting")  # PD: the lane's block is in a transfer
RUNNING = ("prefill", "decode", *MOVING)
ENDED = ("finished", "aborted", "failed")
PHASE_OF = {"waiting": "WAITING", "prefill": "PREFILL", "decode": "DECODE",
            "importing": "IMPORTING", "exporting": "EXPORTING",
            "finished": "FINISHED", "aborted": "ABORTED", "failed": "FAILED"}
# Guard conjuncts that read blocks (the lifecycle model predicts every other rejection).
BLOCK_GUARDS = {
    "admit_miss": {"dst_reusable", "no_cache_hit"},
    "admit_import": {"dst_reusable"},
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
    """The request lifecycle in plain Python: what the core must agree with.

    With PD a request runs importing (decode side: its KV arrives by transfer) or exporting
    (prefill side: its KV is being sent), and a transferring lane that is aborted or fails
    leaves its block draining until the transfer ends (`draining`, block -> request).
    """

    def __init__(self, c: Any) -> None:
        self.c = c
        self.status: dict[int, str] = {}
        self.prompt: dict[int, tuple[int, ...]] = {}
        self.ends: Counter[int] = Counter()
        self.lane: list[int | None] = [None] * c.B
        self.length = [0] * c.B
        self.seq: list[tuple[int, ...]] = [()] * c.B
        self.copying = [False] * c.B
        self.draining: dict[int, int] = {}
        self.drained: list[tuple[int, int]] = []  # (request, block) drains that ended

    def decoding(self, l: int) -> bool:
        r = self.lane[l]
        return r is not None and self.status[r] == "decode"

    def prefilled(self, l: int) -> bool:
        """Lane l has just computed its prompt (and sampled the first token): it may export."""
        r = self.lane[l]
        return self.decoding(l) and r is not None and self.length[l] == len(self.prompt[r])

    def in_phase(self, *phases: str) -> list[int]:
        return sorted(r for r, x in self.status.items() if x in phases)

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
        if name in ("admit_miss", "admit_hit", "admit_import"):
            l, r = args[:2]
            if self.lane[l] is not None:
                return "lane_idle"
            if self.status.get(r) != "waiting":
                return "request_waiting"
            # A draining block is never reusable (admit_hit checks it after its src guards).
            if name != "admit_hit" and args[2] in self.draining:
                return "dst_reusable"
            return UNKNOWN
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
            if args[0] in self.draining and not all(self.decoding(l) for l in range(c.B)):
                return "scratch_target_ok"
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
            return "not_a_lane_block" if args[0] in self.draining else UNKNOWN
        if name == "import_done":
            r, p, _ = args
            if self.status.get(r) != "importing":
                return "request_importing"
            return None if tuple(p) == self.prompt[r] else "covers_prompt"
        if name == "export":
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
        elif name in ("admit_miss", "admit_hit", "admit_import"):
            l, r = args[:2]
            n = args[4] if name == "admit_hit" else 0
            if name == "admit_hit":
                assert c.C <= n < len(self.prompt[r]) and n % c.C == 0, args
            assert self.lane[l] is None and self.status[r] == "waiting"
            self.lane[l] = r
            self.status[r] = "importing" if name == "admit_import" else "prefill"
            self.length[l], self.seq[l] = n, self.prompt[r]
            self.copying[l] = name == "admit_hit"
            dst = args[-2] if name == "admit_hit" else args[2]
            assert dst not in self.draining, (name, args, self.draining)
            if name == "admit_hit":
                assert kinds == ["Admit", "Copy"] and effects[1] == (l, args[2], dst, n)
            else:
                assert kinds == ["Inbound" if name == "admit_import" else "Admit"], kinds
            assert effects[0] == (l, r, dst), effects
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
            # a busy lane's row computes at its next position (an importing lane's is past its
            # prompt), so that a hybrid model's padding write into its own ring is harmless
            positions = tuple(
                0 if self.lane[l] is None
                else len(self.prompt[self.lane[l]]) if self.status[self.lane[l]] == "importing"
                else self.length[l] for l in range(c.B))
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
            if self.status[r] in MOVING:  # the transfer still uses the block: it drains
                self.draining[pre.table[l]] = r
            self._end(r, how)
            self.lane[l], self.copying[l] = None, False
            assert kinds == ["Release"] and effects[0] == (l, pre.table[l])
        elif name == "abort_waiting":
            self._end(args[0], "aborted")
            assert kinds == []
        elif name == "discard":
            assert kinds == []  # no lifecycle change
        elif name == "import_done":
            r, p, tok = args
            l = self.lane.index(r)
            assert self.seq[l] == self.prompt[r] == tuple(p) and self.length[l] == 0
            self.length[l], self.seq[l] = len(p), self.seq[l] + (tok,)
            self.status[r] = "decode"
            assert kinds == ["Imported"] and effects[0] == (l, r, pre.table[l]), effects
        elif name == "export":
            l = args[0]
            r = self.lane[l]
            assert r is not None and self.prefilled(l)
            self.status[r] = "exporting"
            assert kinds == ["Outbound"] and effects[0] == (l, r, pre.table[l], self.length[l])
        elif name in ("export_done", "transfer_fail"):
            r = args[0]
            l = self.lane.index(r)
            self._end(r, "finished" if name == "export_done" else "failed")
            self.lane[l] = None
            assert kinds == ["Release"] and effects[0] == (l, pre.table[l]), effects
        elif name == "transfer_end":
            r, b = args
            assert self.draining.pop(b) == r
            self.drained.append((r, b))
            assert kinds == []
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
        # PD: exactly the transferring lanes' blocks and the draining ones are in a transfer,
        # each for its own request; a block drains exactly while its ended request's transfer
        # has not ended.
        moving = {s.table[l]: r for l, r in enumerate(self.lane)
                  if r is not None and self.status[r] in MOVING}
        for b in range(self.c.K):
            drains = s.owner[b] == core.OWNER_DRAINING
            assert drains == (b in self.draining), (b, core.OWNER_NAMES[s.owner[b]],
                                                    self.draining)
            assert s.transfer[b] == (b in moving or drains), (b, moving, self.draining)
            if s.transfer[b]:
                assert s.transfer_req[b] == (self.draining[b] if drains else moving[b]), b


# ------------------------------------------------------------------------------- machine

# The rules that take PD actions (make_machine(pd=False) drops them).
PD_RULES = {"admit_import", "pd_flow", "late_pd_event"}


def _to_committed(e: Any) -> Any:
    """An effect of a loaded variant core as the committed core's class (Policy.observe
    dispatches on the committed classes)."""
    cls = committed.EFFECTS.get(type(e).__name__.lower())
    return cls(*e) if cls is not None and cls._fields == e._fields else e


def make_machine(core: Any = committed, config: st.SearchStrategy[Any] | None = None, *,
                 mirror: bool = True, mirror_core: Any = None, check_progress: bool = True,
                 focus: set[str] | None = None, pd: bool = True) -> type[RuleBasedStateMachine]:
    """A state machine over `core` (ghost on), configurations drawn from `config`.

    mirror: apply each step to a ghost-off state too (of `mirror_core`, default `core`) and
    compare non-ghost fields. check_progress: assert progress whenever the state is
    quiescent (no copy in flight, no block draining) and K is at least the proved minimum.
    focus: keep only these rules (a focused search with the same rules and checks). pd: take
    the PD actions too (colocated serving never does): the PD rules (PD_RULES), and PD steps
    among `advance`'s moves.
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
            """The spec's `quiescent`: no copy in flight and no block draining."""
            return not any(self.s.copying) and core.OWNER_DRAINING not in self.s.owner

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
            elif out.rejected != expect:
                raise LifecycleDivergence(name, args, expect, out.rejected)
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

        def new_request(self, data: Any) -> None:
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
                # (every block is a lane's, pinned by a copy or draining).
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
            copy, prefill, decode (policy pad) or finish, whichever the draw picks; with pd,
            also a PD step (`pd_step`: import, export, end a transfer or a drain)."""
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
                if pd and (life.draining or life.in_phase(*MOVING) or moves and moves[0] == "admit"
                           or any(map(life.prefilled, range(c.B)))):
                    moves.append("pd")
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
                elif move == "pd":
                    if not self.pd_step(data, feed=False):
                        return
                else:
                    l = pick(data, decoding, "lane")
                    self.apply("finish", l, coin(data, "keep"))

        # rules: single actions, arbitrary parameters ----------------------------------
        def block(self, data: Any, label: str, *prefer: int) -> int:
            """Any block, often an interesting one: `prefer`, a copy source, a lane's block,
            a cache entry, the reserved scratch block or a draining one."""
            s, c = self.s, self.c
            special = set(prefer) | {s.table[l] for l in range(c.B) if s.busy[l]}
            special |= {s.copy_src[l] for l in range(c.B) if s.copying[l]}
            special |= {b for b in range(c.K) if s.owner[b] == core.OWNER_CACHE}
            special |= {c.SCRATCH} if c.RESERVED else set()
            special |= {b for b in range(c.K) if s.owner[b] == core.OWNER_DRAINING}
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
                # Often a lane with a copy or a PD transfer in flight: its block must drain.
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
                b = self.s.table[l]
                if self.apply(kind, l).rejected is None and l in moving:
                    assert self.s.owner[b] == core.OWNER_DRAINING and self.s.transfer[b], b
                    Stats.events[f"{kind} drains"] += 1

        # rules: prefill/decode disaggregation -----------------------------------------
        @precondition(lambda self: self.waiting())
        @rule(data=st.data())
        def admit_import(self, data: Any) -> None:
            """Decode side: a waiting request takes an idle lane and a block the policy would
            reuse, to receive its KV by transfer (accepted); or drawn parameters (rejected
            unless legal)."""
            s, c = self.s, self.c
            idle = [l for l in range(c.B) if not s.busy[l]]
            dst = self.policy.reusable(s)
            if idle and dst is not None and num(data, 0, 3, "drawn (0)"):
                r = pick(data, self.waiting(), "request")
                assert self.apply("admit_import", pick(data, idle), r, dst).rejected is None
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
            request (the policy's lane and block), export a prefilled lane, deliver an import
            (the whole prompt, or a payload `covers_prompt` rejects), end an export, fail a
            transfer, cancel one (abort or failure of its lane: the block drains) or end a
            drain. feed: also submit, complete a copy or prefill. False if none is possible."""
            life, c, s = self.life, self.c, self.s
            prefilled = [l for l in range(c.B) if life.prefilled(l)]
            prefilling = [l for l, r in enumerate(life.lane)
                          if r is not None and life.status[r] == "prefill"]
            importing, exporting = life.in_phase("importing"), life.in_phase("exporting")
            moving = importing + exporting
            moves = ["import"] if self.waiting() and not all(s.busy) else []
            moves += ["export"] * 2 if prefilled else []
            # An export of a lane that has decoded past its prompt is refused.
            decoded = [l for l in range(c.B) if life.decoding(l) and not life.prefilled(l)]
            moves += ["late_export"] if decoded else []
            moves += ["import_done"] * 2 if importing else []
            moves += ["export_done"] if exporting else []
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
                    assert not (self.quiescent() and self.at_capacity), "no block to import to"
                    return False
                r, l = pick(data, self.waiting(), "request"), self.policy.idle_lane(s)
                if life.draining and coin(data, "a draining block first"):  # refused
                    b = pick(data, sorted(life.draining), "draining")
                    assert self.apply("admit_import", l, r, b).rejected == "dst_reusable"
                assert self.apply("admit_import", l, r, dst).rejected is None
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
                b = s.table[life.lane.index(r)]
                assert self.apply("transfer_fail", r).rejected is None
                assert self.s.owner[b] == core.OWNER_FREE and not self.s.transfer[b], b
            elif move == "cancel":
                l = life.lane.index(pick(data, moving, "request"))
                kind, b = pick(data, ("abort_running", "fail"), "how"), s.table[l]
                assert self.apply(kind, l).rejected is None
                assert self.s.owner[b] == core.OWNER_DRAINING and self.s.transfer[b], b
                Stats.events[f"{kind} drains"] += 1
            elif move == "transfer_end":
                b = pick(data, sorted(life.draining), "block")
                assert self.apply("transfer_end", life.draining[b], b).rejected is None
                assert self.s.owner[b] == core.OWNER_FREE and not self.s.transfer[b], b
                Stats.events["drain released"] += 1
            elif move == "late":  # e.g. a duplicate of the event that just ended a drain
                self.late_event(data)
            elif move == "submit":
                self.new_request(data)
            elif any(self.s.copying[l] for l in prefilling):
                self.apply("copy_done", next(l for l in prefilling if self.s.copying[l]))
            else:
                self.apply("prefill", pick(data, prefilling, "lane"), data.draw(tokens))
            return True

        def deliver(self, data: Any, r: int) -> None:
            """r's import ends: the whole prompt (accepted), or a partial, mismatched or
            over-long payload, which `covers_prompt` rejects, changing nothing (the adapter
            then fails the request: transfer_fail)."""
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
            if kind != "whole":
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
            options += ["not_prefilled"] if pd and not all(map(life.prefilled, range(c.B))) else []
            options += ["draining_block"] if life.draining else []
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
            elif kind == "not_prefilled":  # idle, prefilling, transferring or decoded on
                l = pick(data, [l for l in range(c.B) if not life.prefilled(l)])
                call, args, expect = "export", (l,), "lane_prefilled"
            elif kind == "draining_block":  # no admission, padding row or discard uses it
                b = pick(data, sorted(life.draining))
                toks = self.decode_tokens(data)
                l, r = (idle or [0])[0], (waiting or [self.next_id])[0]
                calls = [("discard", (b,), "not_a_lane_block")]
                calls += [("admit_miss", (l, r, b), "dst_reusable"),
                          ("admit_import", (l, r, b), "dst_reusable")] if idle and waiting else []
                calls += [("decode", (b, toks), "scratch_target_ok")] if not all(
                    map(life.decoding, range(c.B))) and not any(
                    life.decoding(l) and life.length[l] >= c.S for l in range(c.B)) else []
                call, args, expect = pick(data, calls)
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
            then finishing or aborting it; an import completes, an export is sent) and every
            transfer, and check each request ended exactly once."""
            if not hasattr(self, "life"):
                return
            life = self.life
            while True:
                if life.draining:
                    b = min(life.draining)
                    self.apply("transfer_end", life.draining[b], b)
                elif any(life.copying):
                    self.apply("copy_done", life.copying.index(True))
                elif life.in_phase("importing"):
                    r = life.in_phase("importing")[0]
                    self.apply("import_done", r, seq(life.prompt[r]), ALPHABET[0])
                elif life.in_phase("exporting"):
                    self.apply("export_done", life.in_phase("exporting")[0], self.c.PREFIX)
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
            assert not any(self.s.busy) and self.quiescent() and not any(self.s.transfer)

        @invariant()
        def count_step(self) -> None:
            Stats.steps += 1

    CoreMachine.__name__ = CoreMachine.__qualname__ = f"CoreMachine_{core.__name__}"
    rules = {k for k, v in vars(CoreMachine).items() if hasattr(v, "hypothesis_stateful_rule")}
    assert PD_RULES <= rules, PD_RULES - rules
    if focus is None and pd:
        return CoreMachine
    focus = (rules if focus is None else focus) - (set() if pd else PD_RULES)
    assert focus <= rules, focus - rules
    # A rule attribute shadowed by None is no rule (hypothesis collects marked members).
    return type(f"Focused{CoreMachine.__name__}", (CoreMachine,),
                dict.fromkeys(rules - focus))


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("pd", [False, True], ids=["colocated", "pd"])
@pytest.mark.parametrize("prefix,scratch", FEATURES,
                         ids=[f"{'prefix' if p else 'noprefix'}-{s}" for p, s in FEATURES])
def test_core_machine(prefix: bool, scratch: str, pd: bool) -> None:
    """Invariants, transition invariants, progress, the lifecycle model, policy refinement
    and the ghost-off mirror, over B in 1..3, K from the proved minimum to minimum + 2: the
    colocated workload, and (pd) the same with prefill/decode disaggregation mixed in."""
    Stats.reset()
    run_state_machine_as_test(make_machine(config=configs(committed, prefix, scratch), pd=pd))
    # Not vacuous: every action applied (hits only with the prefix cache; PD actions only
    # with pd), and some lane reached the block end (decode refused until it finishes).
    expected = set(committed.ACTIONS) - (set() if prefix else {"admit_hit", "copy_done"})
    expected -= set() if pd else set(PD_ACTIONS)
    # the machine's configurations are plain models (HYBRID off): no sliding-state snapshots;
    # hybrid prefix caching is fuzzed by tests/test_hybrid_prefix.py
    expected -= {"snapshot"}
    assert expected <= set(Stats.applied), expected - set(Stats.applied)
    assert Stats.rejected["decode", "no_block_overflow"] > 0
    if not pd:
        assert not set(PD_ACTIONS) & set(Stats.applied)
        return
    # PD: blocks drained (abort or failure of a transferring lane) and were released by
    # transfer_end; partial or mismatched payloads were refused; late, duplicate and
    # misdirected events were refused by each guard that exists for them.
    assert Stats.events["drain released"] > 0
    assert Stats.events["abort_running drains"] > 0 and Stats.events["fail drains"] > 0
    assert Stats.events["prefix import rejected"] > 0
    assert Stats.rejected["import_done", "covers_prompt"] > Stats.events["prefix import rejected"]
    late = [("import_done", "request_importing"), ("transfer_fail", "request_transferring"),
            ("export_done", "request_exporting"), ("transfer_end", "block_draining"),
            ("transfer_end", "transfer_of_request"), ("export", "lane_prefilled")]
    assert all(Stats.rejected[k] for k in late), {k: Stats.rejected[k] for k in late}


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
    inspects it. The example budget is generous so random profiles find it too. Runs are long
    on purpose (the deep profile's 200 steps trip `large_base_example` on focused machines)."""
    return settings(settings.default, max_examples=1000, report_multiple_bugs=False,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])


class Mutant(NamedTuple):
    """A planted bug: the spec variant, the features it shows in, the check that must catch
    it (an invariant's name, or `lifecycle:<guard>`: the core did not refuse a step the
    lifecycle model predicts that guard refuses, `lifecycle:accepted`: it refused one the
    model predicts it accepts; several when either may come first), the
    rules the search needs (None: every rule) and whether the machine takes PD actions."""

    build: Callable[[], Any]
    features: tuple[bool, str]
    expected: str | tuple[str, ...]
    focus: set[str] | None
    pd: bool = False


# Each mutant removes or weakens one guard or update. focus keeps only the rules the bug
# needs, so the search stays within a few seconds; the rules and every check are the same
# machine's.
HIT_RULES = {"submit", "advance", "admit_arbitrary"}
PD_FLOW = {"pd_flow"}
MUTANTS: dict[str, Mutant] = {
    "admit_hit-dst_not_src": Mutant(
        lambda: MODEL.without_guard("admit_hit", "dst_not_src"),
        (True, "dynamic"), "copy_source_cached", HIT_RULES),
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
    "submit-prompt_fits": Mutant(
        lambda: MODEL.without_guard("submit", "prompt_fits"),
        (False, "dynamic"), "waiting_prompt_fits", None),
    "admit_hit-n_whole_chunks-weakened": Mutant(
        lambda: _weakened_chunk_guard(),
        (True, "dynamic"), "prefill_on_chunk_boundary", HIT_RULES),
    # PD. A partial or mismatched payload is imported as if it were the prompt's KV.
    "import_done-covers_prompt": Mutant(
        lambda: MODEL.without_guard("import_done", "covers_prompt"),
        (False, "dynamic"), "lane_holds_its_tokens", PD_FLOW, pd=True),
    # covers_prompt off by one: the payload must hold the first token's KV too. The real
    # payload is refused (only the lifecycle model notices: a transfer may always fail, so no
    # progress property does), and an over-long one is imported.
    "import_done-covers_prompt-off-by-one": Mutant(
        lambda: _import_needs_first_token(),
        (False, "dynamic"), ("lane_holds_its_tokens", "lifecycle:accepted"), PD_FLOW, pd=True),
    # A late transfer_end naming another request frees a block whose transfer still runs.
    "transfer_end-transfer_of_request": Mutant(
        lambda: MODEL.without_guard("transfer_end", "transfer_of_request"),
        (False, "reserved"), "running_transfer_pins_its_block",
        PD_FLOW | {"late_pd_event"}, pd=True),
    # A transfer_end for a block that is not draining (named with its transfer's request) is
    # accepted: a running lane's block is freed (lane_block_owned); when the block is free or
    # cached the state stays consistent, and only the lifecycle model notices.
    "transfer_end-block_draining": Mutant(
        lambda: MODEL.without_guard("transfer_end", "block_draining"),
        (False, "dynamic"), ("lane_block_owned", "lifecycle:block_draining"),
        PD_FLOW | {"late_pd_event"}, pd=True),
    "admit_import-transfer": Mutant(
        lambda: MODEL.without_update("admit_import", "transfer"),
        (False, "dynamic"), "moving_lane_has_transfer", PD_FLOW, pd=True),
    "export_done-transfer": Mutant(
        lambda: MODEL.without_update("export_done", "transfer"),
        (True, "dynamic"), "transfer_block_held", PD_FLOW, pd=True),
    # Abort and failure free a transferring lane's block instead of draining it.
    "cancel-frees": Mutant(
        lambda: _cancel_frees(), (False, "reserved"), "transfer_block_held", PD_FLOW, pd=True),
    # export from any decoding lane, not only one that has just prefilled.
    "export-lane_prefilled-weakened": Mutant(
        lambda: _weakened_export_guard(),
        (False, "reserved"), "export_after_prefill", PD_FLOW | {"advance"}, pd=True),
    # An import may take a draining block (whose old transfer still writes into it).
    "admit_import-reuses-draining": Mutant(
        lambda: _import_reuses_draining(),
        (False, "dynamic"), "running_transfer_pins_its_block",
        PD_FLOW | {"admit_import", "must_reject"}, pd=True),
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


def _cancel_frees() -> Any:
    """`cancel` (abort_running, fail) frees the block even while a transfer uses it. The
    mutant API removes guards and updates or replaces a guard, not an update's value, so the
    owner update is replaced here on a copy of the model."""
    m = MODEL.copy()
    for name in ("abort_running", "fail"):
        a = m.get_action(name)
        a.updates = [lang.Update(u.fn, u.args, spec.Owner.FREE, u.whole)
                     if u.fn.name == "owner" else u for u in a.updates]
    return m


def caught_by(exc: AssertionError) -> list[str]:
    """The checks that reported `exc`, as MUTANTS names them."""
    if isinstance(exc, LifecycleDivergence):
        return [f"lifecycle:{exc.expected or 'accepted'}"]
    assert isinstance(exc, InvariantViolation)
    assert exc.kind != "checker crash", str(exc)  # checkers report, never raise
    return exc.names


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_machine_catches_mutant(name: str) -> None:
    """The same machine over a mutant core reports the expected invariant (or lifecycle
    guard)."""
    m = MUTANTS[name]
    mutant = codegen.load(m.build(), f"atom_core_mutant_{name.replace('-', '_')}")
    config = configs(mutant, *m.features, lanes=(2, 2))
    if name == "admit_hit-n_whole_chunks-weakened":
        config = config.filter(lambda c: c.C == 2)
    machine = make_machine(mutant, config, mirror=False, focus=m.focus, pd=m.pd)
    with pytest.raises((InvariantViolation, LifecycleDivergence)) as info:
        run_state_machine_as_test(machine, settings=_search_settings())
    expected = {m.expected} if isinstance(m.expected, str) else set(m.expected)
    assert expected & set(caught_by(info.value)), (caught_by(info.value), str(info.value))
