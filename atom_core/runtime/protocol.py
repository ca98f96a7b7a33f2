"""The runtime interface the batcher drives, shaped like the RBLN compiled graphs.

One prefill graph (batch 1, a chunk of C tokens) and one or more decode graphs (B rows, one token
each), called with positional tensors of fixed dtypes and shapes (DESIGN.md section 3):

    prefill(input_ids i64 [1,C], cache_position i32 [1,C], block_tables i16 [T],
            local_block_tables i16 [1] | None, query_position i16 []) -> logits [1,1,V]
    decode(input_ids i64 [B,1], cache_position i32 [B,1], block_tables i16 [B,T],
           local_block_tables i16 [B,1] | None) -> logits [B,1,V]

A decode graph computes every one of its rows and writes each row's KV at
(block_tables[row, pos // block_size], pos % block_size), so the caller must aim rows it does not
care about at a block whose content does not matter (the scratch block).

Hybrid models (`uses_local_block_tables`, Gemma3-style: sliding-window layers beside global ones)
keep the sliding layers' KV outside the blocks, in `batch_size` local slots of `sliding_window`
(W) positions each, named by `local_block_tables` (prefill: the sequence's slot; decode: each
row's slot). A slot is a window, as the RBLN kernel keeps it (optimum-rbln passes the kernel only
`cache_seq_len = min(position, W)`): it holds the last min(p, W) positions in order, oldest
first. A call at position q reads the slot's first min(q, W) entries as positions
q - min(q, W) .. q - 1, attends to those within q - W + 1 .. q, and appends its own real
positions (a prefill chunk: those up to start + query_position), dropping the oldest once the
window is full. So every row writes its slot whatever the row is, and a write at any position
but the slot's own sequence's next one shifts or overwrites the window there: a padding row must
be aimed at a slot no live sequence uses (the batcher uses an idle lane's; the spec's
`local_pad_ok`), never at a busy lane's own slot.

Both runtimes accept any integer tensor (or nested list) of the right shape and convert it to the
graph's dtype; a wrong shape, a non-integer dtype, a value that does not fit the dtype, or a
position/block id out of range raises `RuntimeInputError` before anything runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

__all__ = [
    "Capabilities",
    "Runtime",
    "RuntimeProtocolError",
    "RuntimeInputError",
    "as_int_tensor",
    "capabilities",
    "check_decode_inputs",
    "own_fingerprint",
    "check_prefill_inputs",
    "sizes_error",
    "smallest_decode_batch",
]


class RuntimeInputError(ValueError):
    """A runtime call whose tensors do not match the compiled graph; nothing was run."""


@runtime_checkable
class Runtime(Protocol):
    """A KV-cache model runtime with RBLN graph semantics.

    Attributes: `num_blocks` (K), `block_size`, `max_seq_len` (S), `prefill_chunk` (C),
    `batch_size` (rows of the largest decode graph), `decoder_batch_sizes` (the compiled decode
    graphs' row counts, largest first; `decoder_batch_sizes[0] == batch_size`), `vocab_size` (V),
    `uses_local_block_tables` (hybrid models: pass `local_block_tables`, else pass None).

    Capabilities (optional; a runtime without them has RBLN's static shapes):
    `static_batch` (default True): a decode call must be given every row of one of the
    compiled graphs, padding rows included (aimed at the padding target). False: the runtime
    computes the rows it is given, any count from 1 to batch_size, and the batcher gives it the
    live rows only (the core still lets padding rows write the padding target: not writing it
    is safe). `mixed_calls` (default False): the runtime has `mixed(decode, prefills)`, a
    decode and prompt chunks of several lanes in one call (the scheduler's `MixedCall`),
    prompt tokens per call up to `mixed_prefill_tokens` (default: one chunk).
    `prompt_logits` (default False): `prefill(..., all_logits=True)` returns the logits of
    every real token of the chunk, [1, query_position + 1, V] (position start + i's logits are
    the distribution of the token after it), from the same call that writes the chunk's KV;
    with `mixed_calls`, `mixed(decode, prefills, all_logits=flags)` (one flag per prefill)
    returns the prefills' logits as a list of P tensors, [1, real tokens, V] for a flagged one
    and [1, 1, V] for the others. The batcher asks for them only for a request that wants its
    prompt's logits (prompt logprobs); RBLN's compiled prefill graph outputs its last
    position's logits only, so there it is False and such a request is refused.

    Hybrid runtimes only (optional, like the local tables themselves): `sliding_window` (W),
    `new_local_host_buffer()` (a host buffer for one local slot, every sliding layer),
    `fetch_local_cache(host, slot)` (device slot -> host) and `update_local_cache(host, slot)`
    (host -> device slot). A sequence's KV is its global blocks plus its local slot: moving it
    (PD import, swap, snapshot) moves both.

    PD workers only (optional): `fingerprint`, a non-empty str naming the model and KV layout
    (`own_fingerprint`, below; without it `pd.payload.model_fingerprint` hashes the layout).

    The batcher reads all of this once, when it is built (`capabilities`, below: a
    `Capabilities` record, or RuntimeProtocolError naming what a runtime lacks), never by
    probing the runtime again.
    """

    num_blocks: int
    block_size: int
    max_seq_len: int
    prefill_chunk: int
    batch_size: int
    decoder_batch_sizes: tuple[int, ...]
    vocab_size: int
    uses_local_block_tables: bool

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any) -> torch.Tensor:
        """Run one prefill chunk; logits [1,1,V] of the token at `query_position` in the chunk."""
        ...

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> torch.Tensor:
        """Run the decode graph whose row count is `input_ids.shape[0]`; logits [B,1,V]."""
        ...

    def decode_batch_size(self, busy_rows: Iterable[int]) -> int:
        """Rows of the smallest decode graph whose first rows include every busy row."""
        ...

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy positions [0, num_tokens) of block `src` to block `dst`, all layers, on device."""
        ...

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        """Copy block `block` (all layers) from the device into `host_tensor`."""
        ...

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        """Copy `host_tensor` (from `fetch_kv_cache`) into block `block` on the device."""
        ...

    def new_host_buffer(self) -> torch.Tensor:
        """A host buffer that holds one block for `fetch_kv_cache` / `update_kv_cache`."""
        ...


class RuntimeProtocolError(TypeError, ValueError):
    """A runtime lacks what the `Runtime` protocol requires (said once, at construction). A
    ValueError too: the commands that print a bad runtime's ValueError print this one."""


# What every runtime has (the `Runtime` protocol's members, the host transfers apart: a
# runtime without them serves without a host tier), with what each is for in the message.
REQUIRED_ATTRIBUTES = {
    "num_blocks": "the KV blocks it holds (K)", "block_size": "tokens per block",
    "max_seq_len": "tokens per sequence", "prefill_chunk": "tokens per prefill call (C)",
    "batch_size": "rows of its largest decode graph",
    "decoder_batch_sizes": "its decode graphs' row counts, largest first",
    "vocab_size": "its vocabulary's size (None if unknown)",
    "uses_local_block_tables": "whether it has sliding-window layers (hybrid)",
}
REQUIRED_METHODS = ("prefill", "decode", "decode_batch_size", "copy_kv_cache")
# the host tier's block transfers, and a hybrid model's local-slot transfers (each all or none)
HOST_OPS = ("new_host_buffer", "fetch_kv_cache", "update_kv_cache")
LOCAL_OPS = ("new_local_host_buffer", "fetch_local_cache", "update_local_cache")


@attrs.frozen
class Capabilities:
    """What a runtime is and can do, read once from it (`capabilities`): the batcher, the PD
    endpoint and the server read this record, never the runtime's attributes again. The
    optional members (`static_batch`, `mixed_calls`, `mixed_prefill_tokens`, `prompt_logits`,
    `host_kv_transfers`, `sliding_window`, the transfer methods) have the defaults of RBLN's
    static shapes when a runtime does not define them (see `Runtime`)."""

    name: str  # the runtime's class name, for messages
    qualname: str  # its class's module and qualified name (the PD layout fingerprint's)
    num_blocks: int
    block_size: int
    max_seq_len: int
    prefill_chunk: int
    batch_size: int
    decoder_batch_sizes: tuple[int, ...]
    vocab_size: int | None
    hybrid: bool  # uses_local_block_tables
    sliding_window: int | None = None
    static_batch: bool = True
    mixed_calls: bool = False
    mixed_prefill_tokens: int | None = None
    prompt_logits: bool = False
    host_ops: bool = False  # has HOST_OPS: can store and load host-tier blocks
    host_kv_trusted: bool = True  # `host_kv_transfers` is not False (RBLN: not yet trusted)
    local_ops: bool = False  # has LOCAL_OPS: can move a hybrid lane's local slot


def capabilities(rt: Any) -> Capabilities:
    """`rt`'s `Capabilities`, or RuntimeProtocolError naming every required member it lacks.
    Optional flags count only when they are exactly True or False (a stray attribute of
    another meaning, say a method named `static_batch`, does not switch a capability on)."""
    kind = type(rt).__name__
    missing = [f"{n} ({what})" for n, what in REQUIRED_ATTRIBUTES.items() if not hasattr(rt, n)]
    missing += [f"{n}()" for n in REQUIRED_METHODS if not callable(getattr(rt, n, None))]
    if missing:
        raise RuntimeProtocolError(
            f"{kind} is not a runtime atom-core can drive: it lacks {', '.join(missing)}; "
            "implement the Runtime protocol (atom_core/runtime/protocol.py), or wrap a runtime "
            "that does")
    for what, ops in (("host-tier transfers", HOST_OPS), ("local-slot transfers", LOCAL_OPS)):
        have = [op for op in ops if callable(getattr(rt, op, None))]
        if have and len(have) < len(ops):
            lacking = ", ".join(f"{op}()" for op in ops if op not in have)
            raise RuntimeProtocolError(
                f"{kind} has some {what} ({', '.join(have)}) but lacks {lacking}: implement "
                "all of them, or none (then it serves without them)")
    mixed = getattr(rt, "mixed_calls", False) is True
    if mixed and not callable(getattr(rt, "mixed", None)):
        raise RuntimeProtocolError(f"{kind} says mixed_calls but lacks mixed(decode, "
                                   "prefills): implement it, or set mixed_calls = False")
    hybrid = bool(rt.uses_local_block_tables)
    sizes = tuple(rt.decoder_batch_sizes or (rt.batch_size,))
    cls = type(rt)
    return Capabilities(
        name=kind, qualname=f"{cls.__module__}.{cls.__qualname__}", num_blocks=rt.num_blocks,
        block_size=rt.block_size,
        max_seq_len=rt.max_seq_len, prefill_chunk=rt.prefill_chunk, batch_size=rt.batch_size,
        decoder_batch_sizes=sizes, vocab_size=rt.vocab_size, hybrid=hybrid,
        sliding_window=getattr(rt, "sliding_window", None) if hybrid else None,
        static_batch=getattr(rt, "static_batch", True) is not False,
        mixed_calls=mixed,
        mixed_prefill_tokens=getattr(rt, "mixed_prefill_tokens", None) if mixed else None,
        prompt_logits=getattr(rt, "prompt_logits", False) is True,
        host_ops=all(callable(getattr(rt, op, None)) for op in HOST_OPS),
        host_kv_trusted=getattr(rt, "host_kv_transfers", True) is not False,
        local_ops=all(callable(getattr(rt, op, None)) for op in LOCAL_OPS))


def own_fingerprint(rt: Any) -> str | None:
    """`rt`'s own `fingerprint` (a non-empty str), None when it has none, else
    RuntimeProtocolError. Not in `Capabilities`: a runtime may compute it (HFRuntime hashes
    its weights) and only a PD worker needs it, which reads it once, when it is built."""
    own = getattr(rt, "fingerprint", None)
    if own is not None and (not isinstance(own, str) or not own):
        raise RuntimeProtocolError(f"{type(rt).__name__}.fingerprint must be a non-empty str "
                                   f"or None, got {own!r}")
    return own


def smallest_decode_batch(sizes: Sequence[int], busy_rows: Iterable[int]) -> int:
    """The smallest of `sizes` whose first rows contain every row in `busy_rows`.

    A smaller decode graph computes only its first rows, so it may serve a step only when every
    busy row is below its row count; the tensors passed to it must then have exactly that many
    rows. With no busy rows the smallest graph is returned (the caller usually skips the step).
    """
    rows = [int(r) for r in busy_rows]
    if any(r < 0 for r in rows):
        raise RuntimeInputError(f"busy rows must be >= 0, got {sorted(rows)}")
    need = max(rows, default=-1) + 1
    fits = [b for b in sizes if b >= need]
    if not fits:
        raise RuntimeInputError(
            f"busy row {need - 1} is beyond the largest decode graph ({max(sizes)} rows)")
    return min(fits)


_RANGES = {
    torch.int16: (-(2**15), 2**15 - 1),
    torch.int32: (-(2**31), 2**31 - 1),
    torch.int64: (-(2**63), 2**63 - 1),
}


def as_int_tensor(name: str, value: Any, dtype: torch.dtype,
                  shape: tuple[int, ...]) -> torch.Tensor:
    """`value` as a contiguous CPU tensor of exactly `dtype` and `shape`, or RuntimeInputError."""
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise RuntimeInputError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise RuntimeInputError(
            f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype and t.numel():
        lo, hi = _RANGES[dtype]
        if int(t.min()) < lo or int(t.max()) > hi:
            raise RuntimeInputError(f"{name} has values outside {dtype}: "
                                    f"[{int(t.min())}, {int(t.max())}]")
    return t.detach().to(device="cpu", dtype=dtype).contiguous()


def check_block(name: str, block: int, num_blocks: int) -> int:
    """A block id of a block operation, or RuntimeInputError."""
    b = int(block)
    if not 0 <= b < num_blocks:
        raise RuntimeInputError(f"{name}: block {b} is outside 0..{num_blocks - 1}")
    return b


def check_slot(name: str, slot: int, batch_size: int) -> int:
    """A local slot id of a local-slot operation (hybrid models), or RuntimeInputError."""
    b = int(slot)
    if not 0 <= b < batch_size:
        raise RuntimeInputError(f"{name}: local slot {b} is outside 0..{batch_size - 1}")
    return b


def check_copy(src: int, dst: int, num_tokens: int, num_blocks: int,
               block_size: int) -> tuple[int, int, int]:
    """The arguments of `copy_kv_cache` as ints, or RuntimeInputError."""
    s, d = check_block("copy src", src, num_blocks), check_block("copy dst", dst, num_blocks)
    n = int(num_tokens)
    if s == d:
        raise RuntimeInputError(f"copy_kv_cache from block {s} to itself")
    if not 0 <= n <= block_size:
        raise RuntimeInputError(f"copy of {n} tokens: must be in 0..{block_size}")
    return s, d, n


def _check_table(name: str, entries: torch.Tensor, num_blocks: int) -> None:
    """Every entry of a table row the graph sees must be a block id, not only those up to the
    row's position: a compiled graph is given the whole table and nothing says it ignores the
    entries past a row's position (optimum-rbln itself never passes -1: it replaces empty
    entries with a free block before every call). An entry past a sequence's end names a block
    the row never reads or writes there (the batcher repeats the row's last block, or the
    padding target), never a placeholder."""
    if entries.numel() and (int(entries.min()) < 0 or int(entries.max()) >= num_blocks):
        raise RuntimeInputError(
            f"{name} {entries.tolist()} has a block id outside 0..{num_blocks - 1}: every entry "
            "of a block table row must be a valid block id (past a sequence's end, repeat one "
            "of its blocks)")


def sizes_error(max_seq_len: int, block_size: int, prefill_chunk: int) -> str | None:
    """Why a runtime with these sizes cannot serve atom-core's tables, or None. A table holds
    max_seq_len / block_size whole blocks, and a chunk never straddles two blocks of a paged
    table (the spec's `chunk_divides_block`); an eager table (block_size == max_seq_len) may have
    any max_seq_len, its last chunk padded."""
    if max_seq_len % block_size:
        return (f"max_seq_len={max_seq_len} is not a multiple of block_size={block_size}: a "
                "table holds whole blocks")
    if block_size < max_seq_len and block_size % prefill_chunk:
        return (f"block_size={block_size} of a paged table is not a multiple of prefill_chunk="
                f"{prefill_chunk} (the spec's rule chunk_divides_block: a chunk never straddles "
                "two blocks)")
    return None


def check_prefill_inputs(
    rt: Runtime, input_ids: Any, cache_position: Any, block_tables: Any,
    local_block_tables: Any, query_position: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Validate and convert prefill arguments to the graph's exact dtypes and shapes.

    Besides shapes and dtypes: cache positions must be one chunk start..start+C-1 with start a
    multiple of C, query_position must be inside the chunk, the chunk's real tokens (through
    start + query_position) inside max_seq_len, and every entry of the block table must be a
    valid block id (`_check_table`). The padding rows of an eager sequence's last chunk may reach
    past max_seq_len when it is not a multiple of C: a runtime stores nothing for them.
    """
    c, t = rt.prefill_chunk, rt.max_seq_len // rt.block_size
    ids = as_int_tensor("input_ids", input_ids, torch.int64, (1, c))
    pos = as_int_tensor("cache_position", cache_position, torch.int32, (1, c))
    bt = as_int_tensor("block_tables", block_tables, torch.int16, (t,))
    lbt = _check_local("prefill", rt, local_block_tables, (1,))
    qp = as_int_tensor("query_position", query_position, torch.int16, ())
    start = int(pos[0, 0])
    if start % c or not 0 <= start < rt.max_seq_len:
        raise RuntimeInputError(
            f"prefill chunk starts at cache position {start}, which must be a multiple of the "
            f"chunk size {c} in 0..{rt.max_seq_len - 1}")
    expect = torch.arange(start, start + c, dtype=torch.int32)
    if not torch.equal(pos[0], expect):
        raise RuntimeInputError(
            f"cache_position must be {start}..{start + c - 1} in order, got {pos[0].tolist()}")
    if not 0 <= int(qp) < c:
        raise RuntimeInputError(f"query_position {int(qp)} is outside the chunk 0..{c - 1}")
    if start + int(qp) >= rt.max_seq_len:
        raise RuntimeInputError(
            f"query_position {int(qp)} puts the chunk's last real token at position "
            f"{start + int(qp)}, past max_seq_len={rt.max_seq_len}")
    _check_table("block_tables", bt, rt.num_blocks)
    return ids, pos, bt, lbt, qp


def check_decode_inputs(
    rt: Runtime, input_ids: Any, cache_position: Any, block_tables: Any,
    local_block_tables: Any, *, any_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate and convert decode arguments for the graph with `input_ids.shape[0]` rows
    (`any_rows`: a runtime without static shapes, `static_batch` False, takes any count from 1
    to batch_size).

    Every row is a computed row: its position must be in 0..max_seq_len-1, and every entry of its
    block table must be a valid block id (padding rows included; `_check_table`).
    """
    ids0 = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids)
    b = int(ids0.shape[0]) if ids0.dim() else -1
    if b not in rt.decoder_batch_sizes and not (any_rows and 1 <= b <= rt.batch_size):
        raise RuntimeInputError(
            f"no decode graph has {b} rows (compiled: {list(rt.decoder_batch_sizes)}); build "
            "every decode tensor with the row count of the graph chosen by decode_batch_size()")
    t = rt.max_seq_len // rt.block_size
    ids = as_int_tensor("input_ids", ids0, torch.int64, (b, 1))
    pos = as_int_tensor("cache_position", cache_position, torch.int32, (b, 1))
    bt = as_int_tensor("block_tables", block_tables, torch.int16, (b, t))
    lbt = _check_local("decode", rt, local_block_tables, (b, 1))
    bad = [(r, int(p)) for r, p in enumerate(pos[:, 0]) if not 0 <= int(p) < rt.max_seq_len]
    if bad:
        raise RuntimeInputError(
            f"decode cache positions (row, pos) {bad} are outside 0..{rt.max_seq_len - 1}")
    for r in range(b):
        _check_table(f"block_tables[{r}]", bt[r], rt.num_blocks)
    return ids, pos, bt, lbt


def _check_local(graph: str, rt: Runtime, lbt: Any,
                 shape: tuple[int, ...]) -> torch.Tensor | None:
    if not rt.uses_local_block_tables:
        if lbt is not None:
            raise RuntimeInputError(
                f"this model has no sliding-window layers: pass local_block_tables=None to "
                f"{graph}")
        return None
    if lbt is None:
        raise RuntimeInputError(f"this hybrid model's {graph} graph needs local_block_tables")
    t = as_int_tensor("local_block_tables", lbt, torch.int16, shape)
    if int(t.min()) < 0 or int(t.max()) >= rt.batch_size:
        raise RuntimeInputError(
            f"local_block_tables {t.tolist()} must be lane ids in 0..{rt.batch_size - 1}")
    return t
