"""Replay a recorded batcher trace (JSONL) through the generated core.

The first line holds the configuration constants; each following line one applied transition
(`{"action", "args", "effects"}`). Replaying checks that the spec allows every step, that the
recorded effects are the ones the spec produces, and that every invariant holds after it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import IO, Any

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


# A trace is input from outside: bound what one line and the constants may make us allocate
# (the core's state has arrays of B, K, H and B x T entries) before parsing or building them.
MAX_LINE_BYTES = 1 << 24
MAX_IDS = 1 << 15  # as Config's rule 'int16-ids'
MAX_TABLE_ENTRIES = 1 << 20  # B x T


def _ints(name: str, v: Any) -> list[int]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ValueError(f"{name} must be a list of integers")
    return v


def _consts(raw: Any) -> core.Consts:
    if not isinstance(raw, dict):
        raise ValueError("\"consts\" must be an object")
    fields = {f.name: f for f in attrs.fields(core.Consts)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"unknown constants {unknown}")
    for name, v in raw.items():
        if fields[name].type in (bool, "bool"):
            if not isinstance(v, bool):
                raise ValueError(f"{name}={v!r} is not a boolean")
        elif isinstance(v, bool) or not isinstance(v, int) or v < (name not in ("H", "SCRATCH")):
            raise ValueError(f"{name}={v!r} is not an integer >= "
                             f"{int(name not in ('H', 'SCRATCH'))}")
    try:
        consts = core.Consts(**raw)
    except TypeError as exc:  # a missing constant
        raise ValueError(str(exc)) from None
    big = [n for n in ("B", "K", "H", "T") if getattr(consts, n) > MAX_IDS]
    if big or consts.B * consts.T > MAX_TABLE_ENTRIES:
        raise ValueError(f"constants too large to replay ({', '.join(big) or 'B x T'}): at most "
                         f"{MAX_IDS} lanes, blocks, host slots and table blocks")
    failed = core.check_axioms(consts)
    if failed:
        raise ValueError(f"the constants violate the spec's axioms {failed}")
    return consts


def _args(action: str, raw: Any, consts: core.Consts) -> dict[str, Any]:
    sorts = dict(zip(core.ACTIONS[action][2], core.ACTIONS[action][3], strict=True))
    if not isinstance(raw, dict):
        raise ValueError("\"args\" must be an object")
    if set(raw) != set(sorts):
        raise ValueError(f"{action} takes {sorted(sorts)}, got {sorted(raw)}")
    out = {}
    for k, v in raw.items():
        s = sorts[k]
        if s == "Seq":
            out[k] = seq(_ints(k, v))
        elif s.startswith("("):  # one value per lane
            if len(_ints(k, v)) != consts.B:
                raise ValueError(f"{k} must have one entry per lane ({consts.B}), got {len(v)}")
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


def _load(line: str | bytes) -> Any:
    """One line's JSON, or ValueError saying why not (never another exception)."""
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_lines(f: IO[bytes]) -> Iterator[bytes]:
    """The lines of a binary file, none read past MAX_LINE_BYTES (a longer one is cut there, and
    `replay` rejects it by its length)."""
    while line := f.readline(MAX_LINE_BYTES + 1):
        yield line
        while len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            line = f.readline(MAX_LINE_BYTES + 1)  # skip the rest of the long line


def replay(lines: Iterable[str | bytes]) -> Verdict:
    """Replay a trace; any input, however malformed, gives a Verdict naming the bad line."""
    it = enumerate(lines, start=1)
    counts: Counter[str] = Counter()
    try:
        _, head = next(it)
        first = _load(head)
        if not isinstance(first, dict) or "consts" not in first:
            raise ValueError("no \"consts\" object")
        consts = _consts(first["consts"])
    except StopIteration:
        return Verdict(False, 0, {}, "empty trace: the first line must be {\"consts\": ...}", 1)
    except ValueError as exc:
        return Verdict(False, 0, {}, f"first line must be {{\"consts\": ...}}: {exc}", 1)
    s = core.init(consts, ghost=True)
    steps = 0
    for no, line in it:
        if not line.strip():
            continue
        try:
            rec = _load(line)
            if not isinstance(rec, dict):
                raise ValueError("a step must be an object")
            action = rec["action"]
            if not isinstance(action, str) or action not in core.ACTIONS:
                raise ValueError(f"unknown action {action!r}")
            args = _args(action, rec.get("args"), consts)
        except KeyError as exc:
            return Verdict(False, steps, dict(counts), f"unreadable step: no {exc}", no)
        except ValueError as exc:
            return Verdict(False, steps, dict(counts), f"unreadable step: {exc}", no)
        try:
            step = core.ACTIONS[action][0](s, **args)
        except Exception as exc:  # noqa: BLE001 - args of the right sorts the core cannot take
            return Verdict(False, steps, dict(counts),
                           f"{action}{rec['args']} cannot be applied: {exc!r}", no)
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
