"""Replay a recorded batcher trace (JSONL) through the generated core.

The first line holds the configuration constants; each following line one applied transition
(`{"action", "args", "effects"}`). Replaying checks that the spec allows every step, that the
recorded effects are the ones the spec produces, and that every invariant holds after it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

import attrs

from atom_core._generated import core
from atom_core.seq import TokSeq, seq


@attrs.frozen
class Verdict:
    ok: bool
    steps: int
    counts: dict[str, int]
    error: str | None = None  # what the first bad step did wrong
    line: int | None = None  # its line number in the file


def _args(action: str, raw: dict[str, Any], consts: core.Consts) -> dict[str, Any]:
    sorts = dict(zip(core.ACTIONS[action][2], core.ACTIONS[action][3], strict=True))
    if set(raw) != set(sorts):
        raise ValueError(f"{action} takes {sorted(sorts)}, got {sorted(raw)}")
    out = {}
    for k, v in raw.items():
        s = sorts[k]
        if s == "Seq":
            out[k] = seq(v)
        elif s.startswith("("):
            out[k] = tuple(v)
        elif s == "Bool":
            if not isinstance(v, bool):
                raise ValueError(f"{k}={v!r} is not a boolean")
            out[k] = v
        else:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{k}={v!r} is not an integer")
            size = core.INDEX_SORTS.get(s)
            if size is not None and not 0 <= v < getattr(consts, size):
                raise ValueError(f"{k}={v} is not a {s} (0..{getattr(consts, size) - 1})")
            out[k] = v
    return out


def plain(v: Any) -> Any:
    """A core value as JSON data: token sequences and per-lane tuples become lists."""
    return list(v) if isinstance(v, (tuple, TokSeq)) else v


def record(action: str, args: dict[str, Any], effects: Iterable[Any]) -> dict[str, Any]:
    """One applied transition as a trace line (what the batcher writes, replay reads)."""
    return {"action": action, "args": {k: plain(v) for k, v in args.items()},
            "effects": [[type(e).__name__, [plain(x) for x in e]] for e in effects]}


def replay(lines: Iterable[str]) -> Verdict:
    it = enumerate(lines, start=1)
    counts: Counter[str] = Counter()
    try:
        _, head = next(it)
        consts = core.Consts(**json.loads(head)["consts"])
    except (StopIteration, KeyError, TypeError, ValueError) as exc:
        return Verdict(False, 0, {}, f"first line must be {{\"consts\": ...}}: {exc}", 1)
    s = core.init(consts, ghost=True)
    steps = 0
    for no, line in it:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            action = rec["action"]
            if action not in core.ACTIONS:
                raise ValueError(f"unknown action {action!r}")
            args = _args(action, rec["args"], consts)
        except (KeyError, TypeError, ValueError) as exc:
            return Verdict(False, steps, dict(counts), f"unreadable step: {exc}", no)
        step = core.ACTIONS[action][0](s, **args)
        if step.rejected is not None:
            return Verdict(False, steps, dict(counts),
                           f"{action}{rec['args']} is not allowed: guard {step.rejected} fails",
                           no)
        if "effects" in rec:
            mine = record(action, {}, step.effects)["effects"]
            if mine != rec["effects"]:
                return Verdict(False, steps, dict(counts),
                               f"{action}: recorded effects {rec['effects']} differ from the "
                               f"spec's {mine}", no)
        bad = core.check_invariants(step.state) + core.check_transition(s, step.state)
        if bad:
            return Verdict(False, steps, dict(counts),
                           f"{action}: invariants {bad} fail after this step", no)
        s = step.state
        steps += 1
        counts[action] += 1
    return Verdict(True, steps, dict(counts))
