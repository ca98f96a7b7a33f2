"""What crosses between the scheduler and whoever runs the model (`StepOutput`,
`StepResult`, the block work and the calls), and the records the scheduler keeps (`Request`,
`Stats`, `Event`). Plain data: ints, tuples, lists; no tensors."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from atom_core._generated import core

if TYPE_CHECKING:
    from atom_core.scheduler.loop import Scheduler


@attrs.frozen
class Event:
    # "token" | "finished" | "error" | "preempted" (back in the waiting queue, its tokens so far
    # kept: it resumes where it stopped); PD: "import" (a lane waits for this request's KV: ask a
    # prefill worker for it) | "export" (this request's KV is ready: `take_export`)
    kind: str
    request_id: int
    token: int | None = None
    error: str | None = None


@attrs.frozen
class Result:
    tokens: list[int]
    error: str | None = None


@attrs.define
class Stats:
    prefill_tokens: int = 0  # prompt tokens computed by prefill
    prefix_hit_tokens: int = 0  # prompt tokens reused from the prefix cache (copied or adopted)
    decode_steps: int = 0
    decode_rows_padding: int = 0
    generated_tokens: int = 0
    runtime_errors: int = 0
    imported_tokens: int = 0  # prompt tokens whose KV a prefill worker computed
    exports: int = 0
    transfer_failures: int = 0
    stale_events: int = 0  # transfer events for requests that had no transfer (late, duplicate)
    host_stores: int = 0  # evicted cache entries stored into the host tier
    host_store_failures: int = 0  # stores that failed (the entry was dropped)
    host_hit_tokens: int = 0  # prompt tokens loaded from the host tier instead of computed
    host_load_failures: int = 0  # loads that failed (the request recomputed its prompt)
    snapshots: int = 0  # hybrid prefix cache: sliding-state snapshots taken
    snapshot_failures: int = 0  # fetches that failed (the lane just has no later snapshots)
    table_grows: int = 0  # blocks appended to lanes' tables (paged tables: T > 1)
    preemptions: int = 0  # requests sent back to the waiting queue to free their blocks
    recomputed_tokens: int = 0  # tokens whose KV a preemption dropped (computed again)
    forgotten: int = 0  # ended requests dropped past `keep_ended` (the core's `forget`)


@attrs.define
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None
    remote: bool = False  # KV from a prefill worker
    export: bool = False  # prefill only, then hand the KV out
    tokens: list[int] = attrs.Factory(list)
    error: str | None = None
    # picks the request's next token from its logits [V]; None: greedy (argmax)
    sampler: Callable[[Any], int] | None = None
    # takes no prefix-cache hit: every position of its prompt is computed (prompt logprobs
    # need each position's logits, which a hit's copied positions never had)
    uncached: bool = False
    # takes (start, logits [n, V]) of each prompt chunk computed for the request, position
    # start + i's in row i (a runtime with `prompt_logits`: prompt logprobs; the request is
    # `uncached`); None: only each chunk's last position is computed
    prompt_logits: Callable[[int, Any], None] | None = None
    # the scheduler whose core state holds the request's phase (read, never copied here)
    _owner: Scheduler | None = attrs.field(default=None, repr=False, eq=False)

    @property
    def ended(self) -> bool:
        """Finished, aborted or failed (or forgotten since), as the core's phase says."""
        assert self._owner is not None
        return self._owner.phase(self.id) not in _LIVE


# the phases of a request that has not ended (waiting again after a preemption included)
_LIVE = frozenset((core.PHASE_WAITING, core.PHASE_PREFILL, core.PHASE_DECODE,
                   core.PHASE_IMPORTING, core.PHASE_EXPORTING))


def as_token(t: Any) -> int:
    """A token id: an integer (numpy and torch integer scalars included), never a bool."""
    if isinstance(t, bool):
        raise TypeError("bool")
    return operator.index(t)


def as_integer(value: Any) -> int | None:
    """`value` as an int if it is an integer (numpy and torch integer scalars included, as for
    token ids), else None: bool, float and str are not (1.0 or "1" must not pass as 1)."""
    try:
        return as_token(value)
    except TypeError:
        return None


class InvariantViolation(AssertionError):
    def __init__(self, names: list[str]) -> None:
        super().__init__(f"core state violates invariants: {', '.join(names)}")
        self.names = names


class CoreRejected(RuntimeError):
    """The adapter asked the core for a transition its guard forbids: a bug in the adapter or
    the policy, never in the request."""


# --------------------------------------------------------------- what crosses the boundary
@attrs.frozen
class CopyWork:
    """A prefix hit: copy `n` positions of cache entry `src` into block `dst` (slot j to slot
    j), and, for a hybrid model, restore lane's sliding state from the entry's snapshot at
    `length` (the spec's `copy_done` restores it)."""

    lane: int
    src: int
    dst: int
    n: int
    length: int


@attrs.frozen
class StoreWork:
    """A spill: store device block `block` into host slot `slot`."""

    block: int
    slot: int


@attrs.frozen
class LoadWork:
    """A host hit: load host slot `slot` (n tokens) into lane's block `dst`."""

    lane: int
    slot: int
    dst: int
    n: int


@attrs.frozen
class SnapshotWork:
    """Hybrid prefix cache: keep a host copy of lane's local slot (its sliding state) as it is
    now, after the call; the executor keeps the buffer."""

    lane: int


Work = CopyWork | StoreWork | LoadWork | SnapshotWork


@attrs.frozen
class PrefillCall:
    """One prompt chunk of `lane` (request `request`): tokens `ids` (unpadded: the chunk's
    real ones) at positions `start`.. (padded to the chunk size by the executor), the lane's
    block table `table` (T blocks, padded with its tail), its local slot `local` (hybrid, else
    None). `emits`: the prompt's last chunk, whose last token's logits give a token."""

    lane: int
    request: int
    ids: tuple[int, ...]
    start: int
    end: int
    table: tuple[int, ...]
    local: int | None
    emits: bool
    effect: Any = attrs.field(eq=False, repr=False)  # the core's `Prefill` plan


@attrs.frozen
class DecodeCall:
    """One decode call over every row: `ids` and `positions` per row, `tables` the [B][T] block
    tables (a padding row at its padding target `pad` everywhere), `local` each row's local
    slot (hybrid, else None; padding rows `lpad`'s). `lanes` are the live rows, `requests` each
    live row's request (None for padding rows), `padding` the padding rows."""

    ids: tuple[int, ...]
    positions: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]
    local: tuple[int, ...] | None
    lanes: tuple[int, ...]
    requests: tuple[int | None, ...]
    padding: tuple[int, ...]
    pad: int
    lpad: int
    effect: Any = attrs.field(eq=False, repr=False)  # the core's `Decode` plan


@attrs.frozen
class MixedCall:
    """One forward call that computes a decode over the decoding lanes (if any) and a prompt
    chunk of each of `prefills`' lanes together, for a runtime without a static batch shape
    (`Scheduler(mixed=True)`: vLLM's runner; not RBLN's graphs). The core applies the decode's
    action and then each prefill's, exactly as separate calls' outcomes; computing them in one
    call changes nothing because their rows read and write disjoint lanes' blocks. Its
    `StepResult`: `tokens` and `row_errors` the decode's B rows (when there is a decode)
    followed by one per prefill, in order; `error` fails every row."""

    decode: DecodeCall | None
    prefills: tuple[PrefillCall, ...]


Call = PrefillCall | DecodeCall | MixedCall


@attrs.frozen
class StepOutput:
    """What the step asks now: `work` (block work, in order; report each item's outcome) or
    `call` (the forward call; report its tokens or failure), never both; `done` when the step
    has ended (`events` are then all of its events; before, those so far)."""

    work: tuple[Work, ...] = ()
    call: Call | None = None
    events: tuple[Event, ...] = ()
    done: bool = False


@attrs.frozen
class StepResult:
    """What happened: for work, one outcome per item (None: done; else why it failed, which
    the request that needed it carries); for a call, `error` (it raised or gave unusable
    outputs: every row fails) or `tokens` (one per row: a prefill's one, decode's B, padding
    rows' ignored) with `row_errors` (a row's own failure: a sampler, a token outside the
    vocabulary, logits that are not finite; None for the others)."""

    work: tuple[str | None, ...] = ()
    error: str | None = None
    tokens: tuple[int, ...] = ()
    row_errors: tuple[str | None, ...] = ()
