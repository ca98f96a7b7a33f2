"""What a cluster's control links carry as the frontend reads it: the bound on a control
message, and a worker's report (`parse_report`), checked whole before anything of it is taken.

Apart from the nodes and the frontend (atom_core/pd/cluster.py, cluster_frontend.py) because it
is the one place a worker's message from the wire is judged: every field of every kind, a
`ReportError` naming the first bad one, never another exception (cluster.py's docstring lists
the messages).
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

import attrs

from atom_core.pd.payload import is_int
from atom_core.pd.router import Load
from atom_core.pd.transport import PEER_LOST

# The largest control message a link takes (a request carries its prompt, a step's events one
# token per lane): far above either, far below anything that could exhaust memory.
CONTROL_BYTES = 1 << 20

# The most prefill workers a report, or a ready list, names as not answering: a longer list is
# malformed (no cluster has that many prefill workers).
MAX_UNRESPONSIVE = 4096


def rank_gens(obj: Any) -> dict[int, int | None]:
    """[[rank, generation or None], ...] from a peer's message, as rank -> generation;
    ValueError if it is not one (it comes from the wire: checked, never trusted blindly)."""
    if not isinstance(obj, list) or len(obj) > MAX_UNRESPONSIVE or not all(
            isinstance(e, list) and len(e) == 2 and is_int(e[0]) and 0 <= e[0] < 2 ** 31
            and (e[1] is None or is_int(e[1])) for e in obj):
        raise ValueError(f"a list of [rank, generation] pairs, got {obj!r}"[:200])
    return {e[0]: e[1] for e in obj}


class ReportError(ValueError):
    """A worker's control message is not a report the frontend takes from it (the message
    says which field was wrong and how): nothing of it is taken, and the frontend takes that
    worker for faulty (`Frontend`)."""


# What a decode node reports of a request: a token, its end, or a preemption (it resumes where
# it stopped: nothing to do here).
EVENT_KINDS = frozenset(("token", "finished", "error", "preempted"))
# The most rows one events report holds: a decode worker's step yields a token per lane and
# an end per request it ends, far fewer; a longer list is malformed.
MAX_EVENTS = 1 << 16
# The most counters a load report's stats hold, and the longest name of one (ours: about 20
# names of about 25 characters).
MAX_STATS = 256
MAX_STAT_NAME = 128
# Token ids when the vocabulary is not known: what `Frontend.submit` takes in a prompt.
TOKEN_LIMIT = 2 ** 31


@attrs.frozen
class LoadReport:
    """`{"kind": "load", "load", "stats", "gen"?, "unresponsive"?}`: `hung` is a decode
    node's prefill workers taken for hung (rank -> generation; none when it names none), None
    for a prefill node (its message has no such field)."""

    load: Load
    stats: dict[str, Any]
    gen: int | None
    hung: dict[int, int | None] | None


@attrs.frozen
class EventRow:
    """One row `[cid, kind, token, error]` of an events report: `token` is set exactly for
    a "token" row, `error` exactly for an "error" row."""

    cid: int
    kind: str
    token: int | None
    error: str | None


@attrs.frozen
class EventsReport:
    """`{"kind": "events", "events": [[cid, kind, token, error], ...]}` (decode nodes only)."""

    events: tuple[EventRow, ...]


@attrs.frozen
class LostReport:
    """The control link's own report that the worker is gone (`PEER_LOST`)."""

    why: str


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


def _shown(v: Any) -> str:
    """`v` for a message: bounded in length and depth whatever the peer sent, on one line."""
    try:
        return _repr.repr(v)
    except Exception:  # noqa: BLE001 - (an int past str's digit limit)
        return f"<{type(v).__name__}>"


def parse_report(role: str, header: Any, *, vocab_size: int | None = None,
                 issued: int = 2 ** 63) -> LoadReport | EventsReport | LostReport:
    """A `role` worker's control message as the record of its kind; ReportError naming the
    first bad field otherwise (never anything else, whatever the message holds: it comes
    from the wire). Every field the frontend reads is checked here, before anything is taken
    from the message, so a report is taken whole or not at all. `vocab_size`: the workers'
    vocabulary, which a token must be in (None: unknown, any id below 2**31); `issued`: the
    request ids issued so far (an event's id must be one of them). Fields the frontend does not
    read are ignored (a newer node may send more)."""
    if not isinstance(header, dict):
        raise ReportError(f"a report is an object, got {_shown(header)}")
    kind = header.get("kind")
    if kind == PEER_LOST:
        why = header.get("error")
        return LostReport(why if isinstance(why, str) else "its link was lost")
    if kind == "load":
        return _parse_load(role, header)
    if kind == "events" and role == "decode":
        return EventsReport(_parse_events(header.get("events"), vocab_size, issued))
    raise ReportError(f"a {role} worker sends no report of kind {_shown(kind)}")


def _parse_load(role: str, h: dict[str, Any]) -> LoadReport:
    try:
        load = Load.from_json(h.get("load"))
        hung = rank_gens(h.get("unresponsive", [])) if role == "decode" else None
    except ValueError as exc:
        raise ReportError(f"load report: {exc}") from None
    gen = h.get("gen")
    if gen is not None and not (is_int(gen) and 0 <= gen < 2 ** 63):
        raise ReportError(f"load report: gen is {_shown(gen)}, not a generation (an integer)")
    stats = h.get("stats")
    if not isinstance(stats, dict) or len(stats) > MAX_STATS:
        raise ReportError(f"load report: stats is {_shown(stats)}, not an object of at most "
                          f"{MAX_STATS} counters")
    for name, v in stats.items():
        if not (isinstance(name, str) and len(name) <= MAX_STAT_NAME and _stat_value(v)):
            raise ReportError(f"load report: stat {_shown(name)} is {_shown(v)}, not a count, "
                              "a finite measure or a list of ranks")
    return LoadReport(load, dict(stats), gen, hung)


def _stat_value(v: Any) -> bool:
    """A counter, a finite measure, or a list of ranks (`unresponsive_prefill_ranks`)."""
    if is_int(v):
        return 0 <= v < 2 ** 63
    if isinstance(v, float):
        return math.isfinite(v)  # (Infinity would reach the CLI's JSON output as is)
    return isinstance(v, list) and len(v) <= MAX_UNRESPONSIVE and all(
        is_int(r) and 0 <= r < 2 ** 31 for r in v)


def _parse_events(rows: Any, vocab_size: int | None, issued: int) -> tuple[EventRow, ...]:
    if not isinstance(rows, list) or len(rows) > MAX_EVENTS:
        raise ReportError(f"events report: events is {_shown(rows)}, not a list of at most "
                          f"{MAX_EVENTS} rows")
    limit = TOKEN_LIMIT if vocab_size is None else vocab_size
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 4:
            raise ReportError(f"events report: row {i} is {_shown(row)}, not [request id, "
                              "kind, token, error]")
        cid, kind, token, error = row
        if not (is_int(cid) and 0 <= cid < issued):
            raise ReportError(f"events report: row {i} names request {_shown(cid)}, which was "
                              "never issued")
        if not (isinstance(kind, str) and kind in EVENT_KINDS):
            raise ReportError(f"events report: row {i} is of kind {_shown(kind)}, not one of "
                              f"{sorted(EVENT_KINDS)}")
        if kind == "token":
            if not (is_int(token) and 0 <= token < limit):
                raise ReportError(f"events report: row {i} (request {cid}) has token "
                                  f"{_shown(token)}, not a token id in 0..{limit - 1}")
        elif token is not None:
            raise ReportError(f"events report: row {i} (request {cid}, {kind}) carries token "
                              f"{_shown(token)}; only a token row does")
        if kind == "error" and not isinstance(error, str) or kind != "error" and \
                error is not None:
            raise ReportError(f"events report: row {i} (request {cid}, {kind}) has error "
                              f"{_shown(error)}; an error row carries a message, no other does")
        out.append(EventRow(cid, kind, token, error))
    return tuple(out)
