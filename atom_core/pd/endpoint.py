"""The PD endpoint of a batcher: KV in (`import_kv`, `transfer_ended`) and out (`take_export`,
`export_done`), and the transfers' state as the core records it.

A mixin of `AtomBatcher` (`atom_core/batcher.py`): the checks a payload's KV must pass before
it reaches a block, and the runtime's host reads and writes, live here; the core transitions
(`import_done`, `transfer_fail`, `export_done`, `transfer_end`) are the scheduler's
(`atom_core/scheduler/`).

Transfers move positions, not blocks: `take_export` hands out the request's blocks as one host
tensor `[layers, 2, kv_heads, blocks * block_size, head_dim]`, and `import_kv` takes one with
at least the prompt's positions, written block by block (zeros past the prompt).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from atom_core._generated import core, inplace
from atom_core.config import Config
from atom_core.scheduler import Event, Request, Scheduler, as_token
from atom_core.seq import seq

if TYPE_CHECKING:
    from atom_core.runtime.protocol import Capabilities


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t` (an integer tensor holds none). The one test of KV before it is
    written anywhere it is read: once in a block nothing downstream tells bad KV from good
    (attention softmaxes over it and every later token of the lane is plausible garbage, and a
    prefix-cache entry hands it to the next request sharing the prefix). `import_kv` and the
    PD payload's validation (`atom_core.pd.payload`) both ask it."""
    if not (t.is_floating_point() or t.is_complex()):
        return True
    return bool(torch.isfinite(t).all())


@attrs.frozen(eq=False)
class Export:
    """What `take_export` hands out: the request's prompt, its first generated token, a host
    tensor holding its blocks in token order (`runtime.new_host_buffer()` for one block, the
    blocks' buffers joined along positions for several), and for a hybrid model its lane's
    local slot (`runtime.new_local_host_buffer()`: its sliding window), else None."""

    prompt: list[int]
    first_token: int
    host: Any
    local_host: Any = None


class PDEndpoint:
    """The batcher's PD calls (see the module doc); mixed into `AtomBatcher`."""

    config: Config
    runtime: Any
    capabilities: Capabilities  # the runtime's, read once (runtime/protocol.py)
    scheduler: Scheduler
    requests: dict[int, Request]
    _hybrid: bool
    # (host buffer shape, dtype, (local slot shape, dtype) or None): import_kv's layout,
    # asked of the runtime on the first import
    _import_ref: tuple[Any, ...] | None

    def _no_pending_plan(self, call: str) -> None:
        raise NotImplementedError

    def make_local(self, request_id: int) -> bool:
        """A waiting remote request is prefilled here instead (e.g. its prefill worker is gone);
        it keeps its id and queue position. False if it is not waiting or not remote."""
        req = self.requests.get(request_id)
        if (req is None or not req.remote
                or self.scheduler.phase(request_id) != core.PHASE_WAITING):
            return False
        req.remote = False
        return True

    def import_kv(self, request_id: int, prompt_ids: Iterable[int], first_token: int,
                  host_kv: Any, local_kv: Any = None) -> list[Event]:
        """The transfer for `request_id` delivered KV for `prompt_ids` and the first generated
        token. `host_kv` is `[layers, 2, kv_heads, n, head_dim]` in the runtime's host layout
        with n >= the prompt's length (`runtime.new_host_buffer()` when it fits one block);
        positions from the prompt's length on are not read (except that a buffer of exactly
        one block, into a one-block table, is written as it is, so they must be finite there).
        Accepted only if it covers the request's whole prompt, the request's table is in place
        (after its "import" event) and every value written is finite (`all_finite`); otherwise
        the request fails, and nothing is written or cached. Events for requests without a
        transfer change nothing.

        Hybrid models: `local_kv` is the prompt's sliding window (a local host buffer,
        `runtime.new_local_host_buffer()` layout), written into the request's lane's local slot;
        without it the request fails like a partial import. A plain model takes none."""
        self._no_pending_plan("import_kv")
        sched = self.scheduler
        events: list[Event] = []
        if sched.phase(request_id) != core.PHASE_IMPORTING:
            sched.stale_or_drained(request_id)
            return events
        try:  # integers only, as in submit: int() would turn 1.9 into 1
            ids = [as_token(t) for t in prompt_ids]
            first_token = as_token(first_token)
        except TypeError:
            sched.transfer_failed(request_id, "import rejected: token ids must be integers",
                                  events)
            return events
        vocab = self.capabilities.vocab_size
        if vocab is not None and not 0 <= first_token < vocab:
            # a token the model cannot embed would fail the next decode call for every lane
            sched.transfer_failed(request_id, f"import rejected: first token {first_token} is "
                                  f"outside the vocabulary 0..{vocab - 1}", events)
            return events
        p = seq(ids)
        s = sched.view
        if not inplace.table_covers_prompt(s, s.req_lane.get(request_id)):
            sched.transfer_failed(request_id, "import rejected (table_covers_prompt): the "
                                  "request's table does not cover its prompt yet; call "
                                  "import_kv after its import event (`awaits_kv`)", events)
            return events
        if not inplace.enabled_import_done(s, r=request_id, p=p, tok=first_token):
            bad = inplace.import_done_guard(s, request_id, p, first_token)  # (for the message)
            sched.transfer_failed(request_id, f"import rejected ({bad}): the KV covers "
                                  f"{len(p)} tokens, not this request's prompt", events)
            return events
        if self._hybrid and local_kv is None:
            # The spec's import_done delivers the sliding state too (local_holds := p): without
            # it the lane's sliding layers would attend to its slot's stale content.
            sched.transfer_failed(request_id, "import rejected (local_kv): this model is hybrid "
                                  "and the transfer delivered no sliding-window state for the "
                                  "lane's local slot; ship the prefill lane's local window "
                                  "(take_export(...).local_host)", events)
            return events
        if not self._hybrid and local_kv is not None:
            sched.transfer_failed(request_id, "import rejected (local_kv): the transfer "
                                  "delivered sliding-window state, but this model has no "
                                  "sliding-window layers: the prefill side runs another model",
                                  events)
            return events
        try:
            bad_kv = self._import_mismatch(host_kv, local_kv, len(ids))
        except Exception as exc:  # noqa: BLE001 - the runtime could not say its layout
            bad_kv = f"the runtime's host buffer layout is unavailable ({exc!r})"
        lane = s.req_lane.get(request_id)
        table = sched.tables[lane]
        if bad_kv is None:
            try:
                bad_kv = self._non_finite(host_kv, local_kv, len(ids), table)
            except Exception as exc:  # noqa: BLE001 - values that cannot be read (a meta tensor)
                bad_kv = f"host_kv or local_kv values cannot be read ({exc!r})"
        if bad_kv is not None:
            field = "local_kv" if bad_kv.startswith("local_kv") else "host_kv"
            sched.transfer_failed(request_id, f"import rejected ({field}): {bad_kv}", events)
            return events
        try:
            self._write_blocks(host_kv, len(ids), table)
        except Exception as exc:  # noqa: BLE001 - this request's import failed, nothing else
            sched.transfer_failed(request_id, f"update_kv_cache failed: {exc!r}", events)
            return events
        if self._hybrid:
            # the whole slot: the window holds the last min(plen, W) positions in order, as
            # the prefill lane's did, so it is valid as-is at the same length
            try:
                self.runtime.update_local_cache(local_kv, lane)
            except Exception as exc:  # noqa: BLE001 - this request's import failed
                sched.transfer_failed(request_id, f"update_local_cache failed: {exc!r}", events)
                return events
        sched.import_done(request_id, ids, first_token, events)
        return events

    def transfer_ended(self, request_id: int, error: str) -> list[Event]:
        """The transfer for `request_id` ended without usable KV (an error, a bad payload, a lost
        peer): a request still waiting for it fails; a drained block is freed. Unknown or
        already-ended requests: nothing changes."""
        self._no_pending_plan("transfer_ended")
        events: list[Event] = []
        if self.scheduler.phase(request_id) in (core.PHASE_IMPORTING, core.PHASE_EXPORTING):
            self.scheduler.transfer_failed(request_id, error, events)
        else:
            self.scheduler.stale_or_drained(request_id)
        return events

    def take_export(self, request_id: int) -> Export:
        """The prompt, first token and host KV buffer of an exported request, read from its
        pinned block, and for a hybrid model its lane's local slot (the lane stays the request's
        until `export_done`). Call `export_done` once the KV is handed to the transport, or
        `export_done(request_id, error)` if this raises (a runtime read or allocation failed)."""
        s = self.scheduler.view
        if s.phase.get(request_id) != core.PHASE_EXPORTING:
            raise KeyError(f"request {request_id} has no export pending")
        lane = s.req_lane.get(request_id)
        host = self._read_blocks(self.scheduler.tables[lane])
        local = None
        if self._hybrid:
            local = self.runtime.new_local_host_buffer()
            self.runtime.fetch_local_cache(local, lane)
        # the first token is the one the core's sequence holds past the prompt
        return Export(self.requests[request_id].prompt, s.lane_seq[lane][s.lane_plen[lane]],
                      host, local)

    def export_done(self, request_id: int, error: str | None = None) -> list[Event]:
        """The export of `request_id` was sent (error None) or could not be: its block is
        released (into the prefix cache when on)."""
        self._no_pending_plan("export_done")
        events: list[Event] = []
        if self.scheduler.phase(request_id) != core.PHASE_EXPORTING:
            self.scheduler.stale_or_drained(request_id)
        elif error is not None:
            self.scheduler.transfer_failed(request_id, error, events)
        else:
            self.scheduler.export_done(request_id, events)
        return events

    def awaits_kv(self, request_id: int) -> bool:
        """The request's lane has its whole table and its "import" event went out: `import_kv`
        can write its KV now (before that, keep the KV until the event). The event goes out
        exactly when an importing lane's table comes to cover the prompt, so the core's state
        says whether it has."""
        return self.scheduler.awaits_kv(request_id)

    def transfers(self) -> dict[int, int]:
        """Unfinished transfers, as the core records them (`transfer`, `transfer_req`):
        request -> the lowest-numbered block its transfer uses (including requests whose blocks
        drain after an abort)."""
        return self.scheduler.transfers()

    def new_import_buffer(self) -> torch.Tensor:
        """A host tensor for `import_kv` as long as a lane's table (max_seq_len positions) in
        the runtime's host layout: `pd.write_into(payload, buffer)` fits any prompt."""
        one = self.runtime.new_host_buffer()
        if self.config.blocks_per_table == 1:
            return one
        return one.new_zeros((*one.shape[:3], self.config.max_seq_len, one.shape[4]))

    def _import_mismatch(self, host_kv: Any, local_kv: Any, n: int) -> str | None:
        """Why `host_kv` (and `local_kv`) is not exactly what import_kv takes, naming the field;
        None if it is. `host_kv` has the layout and dtype of `runtime.new_host_buffer()` with n
        to max_seq_len positions, `local_kv` exactly those of `new_local_host_buffer()`: no
        broadcasting (a [1, ...] tensor would fill every layer), no silent casting."""
        if self._import_ref is None:
            one = self.runtime.new_host_buffer()
            local = self.runtime.new_local_host_buffer() if self._hybrid else None
            self._import_ref = (tuple(one.shape), one.dtype,
                                None if local is None else (tuple(local.shape), local.dtype))
        (layers, kv, heads, _, dim), dtype, local_ref = self._import_ref
        if not isinstance(host_kv, torch.Tensor):
            return f"host_kv must be a torch.Tensor, got {type(host_kv).__name__}"
        shape = tuple(host_kv.shape)
        if len(shape) != 5:
            return (f"host_kv must be [layers, 2, kv_heads, positions, head_dim], got shape "
                    f"{list(shape)}; write the payload into new_import_buffer()")
        for name, got, want in (("layers", shape[0], layers), ("K/V", shape[1], kv),
                                ("kv_heads", shape[2], heads), ("head_dim", shape[4], dim)):
            if got != want:
                return (f"host_kv {name} is {got}, this runtime's host buffer has {want} "
                        f"(shape {list(shape)}); write the payload into new_import_buffer()")
        if not n <= shape[3] <= self.config.max_seq_len:
            return (f"host_kv positions is {shape[3]} (shape {list(shape)}), it must cover the "
                    f"prompt's {n} tokens and at most max_seq_len={self.config.max_seq_len}")
        if host_kv.dtype != dtype:
            return (f"host_kv dtype is {host_kv.dtype}, this runtime's cache is {dtype}: no "
                    "silent casting; ship KV in the cache dtype")
        if local_kv is not None and local_ref is not None:
            if not isinstance(local_kv, torch.Tensor):
                return f"local_kv must be a torch.Tensor, got {type(local_kv).__name__}"
            if tuple(local_kv.shape) != local_ref[0]:
                return (f"local_kv shape is {list(local_kv.shape)}, this runtime's local slot "
                        f"is {list(local_ref[0])}")
            if local_kv.dtype != local_ref[1]:
                return (f"local_kv dtype is {local_kv.dtype}, this runtime's cache is "
                        f"{local_ref[1]}: no silent casting")
        return None

    def _non_finite(self, host_kv: torch.Tensor, local_kv: torch.Tensor | None, n: int,
                    table: list[int]) -> str | None:
        """Why the KV import_kv would write is not all finite, naming the field; None if it
        is. Only what reaches the device is read: the prompt's positions of `host_kv`, or all
        of it when it goes as given (`_as_given`), and the whole local slot."""
        written = host_kv if self._as_given(host_kv, table) else host_kv[:, :, :, :n]
        for name, t in (("host_kv", written), ("local_kv", local_kv)):
            if t is not None and not all_finite(t):
                return (f"{name} holds non-finite values (NaN or inf): its producer diverged or "
                        "the buffer is damaged, and decode would attend to it; nothing was "
                        "written")
        return None

    def _as_given(self, host_kv: torch.Tensor, table: list[int]) -> bool:
        """`_write_blocks` writes `host_kv` into the lane's one block as it is (past the
        prompt too), not position by position."""
        return len(table) == 1 and host_kv.shape[3] == self.config.block_size

    def _write_blocks(self, host_kv: Any, n: int, table: list[int]) -> None:
        """Positions [0, n) of `host_kv` into `table`'s blocks, zeros past n: a block then holds
        nothing of an earlier request, and its content is a function of the payload alone."""
        size = self.config.block_size
        if self._as_given(host_kv, table):  # one whole block: as given
            self.runtime.update_kv_cache(host_kv, table[0])
            return
        buf = self.runtime.new_host_buffer()
        for i, block in enumerate(table):
            part = host_kv[:, :, :, i * size:min((i + 1) * size, n)]
            buf.zero_()
            buf[:, :, :, :part.shape[3]].copy_(part)
            self.runtime.update_kv_cache(buf, block)

    def _read_blocks(self, table: list[int]) -> Any:
        bufs = []
        for block in table:
            buf = self.runtime.new_host_buffer()
            self.runtime.fetch_kv_cache(buf, block)
            bufs.append(buf)
        return bufs[0] if len(bufs) == 1 else torch.cat(bufs, dim=3)
