"""Block ownership over time, read off a run's records: each step of a trace (the batcher's
`trace=` JSONL, check-config's stuck run, a simulation's batchers) is applied to the generated
core again, and after every step each block, host slot and lane is given its owner. The
picture is drawn from what the core says, never from a second model of it: a run the core
refuses is an error here, not a picture.

Stdlib and the generated core only (no torch, no z3): `check-trace` draws without extras."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from atom_core._generated import core
from atom_core.replay import _args as core_args  # (the trace reader's own argument decoding)
from atom_core.replay import _consts, _load

# The kinds of marks above the grid, in the order their rows are drawn.
MARK_KINDS = ("admit", "hit", "evict", "spill", "preempt", "fail", "fault", "check", "stuck",
              "bad")
MARK_NAMES = {"admit": "admission", "hit": "prefix hit", "evict": "eviction", "spill": "spill",
              "preempt": "preemption", "fail": "failure", "fault": "fault event",
              "check": "failed check", "stuck": "stuck", "bad": "refused step"}

_ADOPT = frozenset(("admit_adopt", "grow_adopt"))
_HITS = {"admit_hit": "copies", "grow_hit": "copies", "admit_adopt": "takes over",
         "grow_adopt": "takes over", "admit_host_hit": "loads", "grow_host_hit": "loads"}
_FAILS = frozenset(("fail", "load_fail", "store_fail", "transfer_fail"))


@attrs.frozen
class Mark:
    """Something that happened at a step: `step` 0 is the initial state, i the state after
    the trace's i-th step (a mark belongs to the state its step produced)."""

    step: int
    kind: str  # one of MARK_KINDS
    text: str


@attrs.frozen
class Timeline:
    """One batcher's run, state by state. Cells are owner keys (see `cell_owner`): rows of
    `blocks` are device blocks, of `slots` host slots, of `lanes` lanes; each row has one
    entry per state (steps + 1: the initial state first)."""

    name: str
    consts: dict[str, Any]
    actions: tuple[str, ...]  # what produced each state ("start" for the first)
    blocks: tuple[tuple[str, ...], ...]
    slots: tuple[tuple[str, ...], ...]
    lanes: tuple[tuple[str, ...], ...]
    marks: tuple[Mark, ...]
    # the final state as check-config's `stuck_state` describes one (lanes, blocks, waiting)
    final: dict[str, Any]

    @property
    def steps(self) -> int:
        return len(self.actions) - 1

    def with_marks(self, extra: Iterable[Mark]) -> Timeline:
        return attrs.evolve(self, marks=self.marks + tuple(extra))


def _short(v: Any) -> str:
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"[{', '.join(map(str, v[:4]))}, ... {len(v)} items]"
    return str(list(v) if isinstance(v, tuple) else v)


def describe_action(step: int, action: str, raw: Mapping[str, Any]) -> str:
    """`7. admit_miss(l=0, r=0, dst=0)`, long token lists cut (as check-config prints them)."""
    return f"{step}. {action}(" + ", ".join(f"{k}={_short(v)}" for k, v in raw.items()) + ")"


def cell_owner(s: core.State, b: int, pinned: frozenset[int]) -> str:
    """Block b's owner as a cell key: free, scratch, cache, pinned (a cache entry an in-flight
    copy reads), `transfer:R` (request R's PD transfer uses it), draining, spilling, or
    `lane:L:R` (lane L, serving request R)."""
    if s.transfer[b]:
        return f"transfer:{s.transfer_req[b]}"
    own = s.owner[b]
    if own == core.OWNER_LANE:
        ln = s.owner_lane[b]
        return f"lane:{ln}:{s.lane_req[ln]}"
    if own == core.OWNER_CACHE:
        return "pinned" if b in pinned else "cache"
    return core.OWNER_NAMES[own].lower()


def slot_owner(s: core.State, h: int) -> str:
    return "host-" + core.SLOTSTATE_NAMES[s.slot_state[h]].lower()


def lane_cell(s: core.State, ln: int) -> str:
    """`R:phase` for a busy lane (its request and the request's phase), "" for an idle one."""
    if not s.busy[ln]:
        return ""
    r = s.lane_req[ln]
    return f"{r}:{core.PHASE_NAMES[s.phase.get(r, core.PHASE_NONE)].lower()}"


def stuck_summary(s: core.State) -> dict[str, Any]:
    """The state as check-config's JSON says its stuck state (`stuck_state`): lanes, blocks and
    waiting requests, so that a replayed run can be checked to end where the data says."""
    blocks = []
    for b in range(s.consts.K):
        own = s.owner[b]
        if own == core.OWNER_CACHE:
            blocks.append(f"cache{list(s.key[b])}")
        elif own == core.OWNER_LANE:
            blocks.append(f"lane {s.owner_lane[b]}")
        else:
            blocks.append(core.OWNER_NAMES[own].lower())
    lanes = [f"r{s.lane_req[ln]}" if s.busy[ln] else "idle" for ln in range(s.consts.B)]
    waiting = {f"r{r}": list(s.prompt.get(r, ())) for r, ph in sorted(s.phase.items())
               if ph == core.PHASE_WAITING}
    return {"lanes": lanes, "blocks": blocks, "waiting": waiting}


def _step_marks(i: int, action: str, raw: Mapping[str, Any], before: core.State,
                after: core.State) -> Iterator[Mark]:
    """What step i did that a reader looks for: admissions, hits, evictions, spills,
    preemptions, failures."""
    if action.startswith("admit_"):
        yield Mark(i, "admit", f"step {i}: lane {raw['l']} admits r{raw['r']} ({action})")
    if action in _HITS:
        src = f"host slot {raw['h']}" if "h" in raw else f"cache entry in block {raw['src']}"
        yield Mark(i, "hit", f"step {i}: lane {raw['l']} {_HITS[action]} {raw['n']} tokens "
                             f"from {src}")
    adopted = raw.get("src") if action in _ADOPT else None
    for b in range(after.consts.K):
        if before.owner[b] == core.OWNER_CACHE and after.owner[b] != core.OWNER_CACHE \
                and b != adopted and after.owner[b] != core.OWNER_SPILLING:
            yield Mark(i, "evict", f"step {i}: block {b}'s cache entry evicted ({action})")
    if action == "spill":
        yield Mark(i, "spill", f"step {i}: block {raw['b']} spilled to host slot {raw['h']}")
    elif action == "host_evict":
        yield Mark(i, "evict", f"step {i}: host slot {raw['h']}'s entry evicted")
    elif action == "preempt":
        yield Mark(i, "preempt", f"step {i}: lane {raw['l']} preempted "
                                 f"(r{before.lane_req[raw['l']]} waits again)")
    elif action in _FAILS:
        what = ", ".join(f"{k}={v}" for k, v in raw.items())
        yield Mark(i, "fail", f"step {i}: {action}({what})")


def replay_steps(consts: core.Consts, steps: Iterable[tuple[str, Mapping[str, Any]]],
                 name: str = "", labels: Mapping[int, str] | None = None) -> Timeline:
    """The timeline of `steps` ((action, JSON args) pairs, as a trace or check-config's `trace`
    records them) from the initial state of `consts`. A step the core refuses raises
    ValueError naming it. `labels`: text added to a step's action (a simulation's tick)."""
    s = core.init(consts, ghost=False)  # (the guards never read ghost state; faster without)
    labels = labels or {}
    actions = ["start"]
    columns: list[tuple[list[str], list[str], list[str]]] = [_column(s)]
    marks: list[Mark] = []
    for i, (action, raw) in enumerate(steps, start=1):
        if action not in core.ACTIONS:
            raise ValueError(f"step {i}: unknown action {action!r}")
        apply: Any = core.ACTIONS[action][0]
        step = apply(s, **core_args(action, raw, consts))
        if step.rejected is not None:
            raise ValueError(f"step {i}: {action}{dict(raw)} is not allowed: guard "
                             f"{step.rejected} fails")
        text = describe_action(i, action, raw)
        actions.append(text + (f" [{labels[i]}]" if i in labels else ""))
        marks.extend(_step_marks(i, action, raw, s, step.state))
        s = step.state
        columns.append(_column(s))
    return Timeline(
        name=name, consts=attrs.asdict(consts), actions=tuple(actions),
        blocks=tuple(tuple(c[0][b] for c in columns) for b in range(consts.K)),
        slots=tuple(tuple(c[1][h] for c in columns) for h in range(consts.H)),
        lanes=tuple(tuple(c[2][ln] for c in columns) for ln in range(consts.B)),
        marks=tuple(marks), final=stuck_summary(s))


def _column(s: core.State) -> tuple[list[str], list[str], list[str]]:
    pinned = frozenset(s.copy_src[ln] for ln in range(s.consts.B)
                       if s.copying[ln] and not s.copy_host[ln])
    return ([cell_owner(s, b, pinned) for b in range(s.consts.K)],
            [slot_owner(s, h) for h in range(s.consts.H)],
            [lane_cell(s, ln) for ln in range(s.consts.B)])


def trace_steps(lines: Iterable[str | bytes], limit: int | None = None
                ) -> tuple[core.Consts, list[tuple[str, dict[str, Any]]]]:
    """A batcher trace's constants and its first `limit` steps (all: None). The trace must
    have been read by `replay` first: its verdict says how many steps are good, and only those
    are asked for here (a malformed line raises ValueError)."""
    it = iter(lines)
    consts = _consts(_load(next(it))["consts"])
    out: list[tuple[str, dict[str, Any]]] = []
    for line in it:
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        rec = _load(line)
        out.append((rec["action"], rec["args"]))
    return consts, out


def timeline_of_trace(lines: Iterable[str | bytes], name: str = "",
                      limit: int | None = None,
                      labels: Mapping[int, str] | None = None) -> Timeline:
    consts, steps = trace_steps(lines, limit)
    return replay_steps(consts, steps, name, labels)
