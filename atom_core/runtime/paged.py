"""The paged KV layout shared by every torch runtime: one K (or V) tensor per layer
`[num_blocks, kv_heads, block_size, head_dim]`, position p of a sequence at
(block_tables[p // block_size], p % block_size).

`block_coords` says where positions live, `write_blocks` stores K or V there and `gather_blocks`
reads a sequence's positions 0..length-1 back in order, so a runtime's attention sees the keys of
one sequence as one contiguous [kv_heads, length, head_dim] tensor whatever blocks hold them.

Sliding-window layers keep a sequence's KV in a local slot `[kv_heads, W, head_dim]` the way
the RBLN kernel does (optimum-rbln passes it only `cache_seq_len = min(position, W)`): a window
holding the last min(p, W) positions in order, oldest first, at indices 0..min(p, W) - 1.
`window_positions` says which position each index holds for a call at position p, and
`window_append` keeps the window after a call appends n positions: any call at a position that
is not the slot's own next one shifts or overwrites the window another sequence left there.
`window_key_positions` and `append_windows` are a call's reads and writes of its rows' slots,
and `visible` is the attention mask by position (causal, and the window for a sliding layer).

`check_host`, `copy_to_host`, `copy_from_host` and `stack_kv` move one block or one local slot
(every layer) between a runtime's per-layer K/V tensors and a host buffer
`[layers, 2 (K, V), kv_heads, n, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from atom_core.runtime.protocol import RuntimeInputError

__all__ = ["GatherIndex", "append_windows", "block_coords", "check_host", "copy_from_host",
           "copy_to_host", "gather_at", "gather_blocks", "gather_index", "stack_kv", "visible",
           "window_append", "window_key_positions", "window_positions", "write_blocks"]


def block_coords(tab: torch.Tensor, pos: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) [N] of positions pos [N], row r of pos read through table row tab[r]
    (tab [N, T]) or every position through one table (tab [T]). A position past the table's end
    has block -1, which `write_blocks` skips: the padding rows of an eager sequence's last chunk
    when max_seq_len is not a multiple of the chunk (optimum-rbln pads that chunk too)."""
    p = pos.long()
    t = tab.shape[-1]
    idx = p // block_size
    past = idx >= t
    idx = torch.clamp(idx, max=t - 1)
    blk = tab.long()[idx] if tab.dim() == 1 else tab.long()[torch.arange(p.shape[0]), idx]
    return torch.where(past, -1, blk), p % block_size


def write_blocks(cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                 x: torch.Tensor) -> None:
    """Store x [N, kv_heads, head_dim] at (blk[i], off[i]) of cache, cast to the cache dtype;
    an entry with block -1 (past its table, `block_coords`) is not stored. Two entries at one
    place: the later one wins (a scheduler bug, but deterministic)."""
    keep = blk >= 0
    if not bool(keep.all()):
        blk, off, x = blk[keep], off[keep], x[keep]
    cache[blk, :, off, :] = x.to(cache.dtype)


GatherIndex = tuple[torch.Tensor, torch.Tensor]


def gather_index(tab: torch.Tensor, length: int, block_size: int,
                 num_blocks: int) -> GatherIndex:
    """(block, offset) [R, length] of positions 0..length-1 of each of R sequences whose block
    tables are tab [R, T]: computed once per call, read by every layer (`gather_at`). Entries
    past the positions a caller validated may hold anything: they are clamped to a valid block
    id, and the caller masks those keys."""
    kpos = torch.arange(length)
    blk = torch.clamp(tab.long()[:, kpos // block_size], 0, num_blocks - 1)         # [R, L]
    return blk, (kpos % block_size)[None, :].expand_as(blk)


def gather_at(cache: torch.Tensor, index: GatherIndex) -> torch.Tensor:
    """[R, kv_heads, length, head_dim]: the positions `index` names, in position order."""
    blk, off = index
    return cache[blk, :, off, :].permute(0, 2, 1, 3)


def gather_blocks(cache: torch.Tensor, tab: torch.Tensor, length: int,
                  block_size: int) -> torch.Tensor:
    """`gather_at` through a `gather_index` of its own (a caller reading one layer)."""
    return gather_at(cache, gather_index(tab, length, block_size, cache.shape[0]))


def window_positions(pos: torch.Tensor, window: int) -> torch.Tensor:
    """[R, window]: the position index i of a window holds for a call at position pos[r] (the
    slot then holds positions pos - min(pos, W) .. pos - 1 at indices 0 ..), -1 past them."""
    p = pos.long()[:, None]
    n = torch.clamp(p, max=window)
    i = torch.arange(window)[None, :]
    return torch.where(i < n, p - n + i, torch.full_like(i, -1))


def window_append(slot: torch.Tensor, pos: int, new: torch.Tensor) -> None:
    """Append new [kv_heads, n, head_dim] (positions pos .. pos + n - 1) to the window of slot
    [kv_heads, W, head_dim], read as holding positions pos - min(pos, W) .. pos - 1: keep the
    last min(pos + n, W) positions at indices 0 .., in order. Indices past them keep whatever
    they held (no call reads them)."""
    w = slot.shape[1]
    have = min(pos, w)
    both = torch.cat([slot[:, :have], new.to(slot.dtype)], dim=1)
    keep = both[:, max(0, both.shape[1] - w):]
    slot[:, :keep.shape[1]] = keep


def window_key_positions(pos: torch.Tensor, new_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[R, window + n]: the positions of the keys a sliding layer's row r sees, its slot's
    window (read for a call at pos[r], `window_positions`) then its own n new positions
    new_pos [R, n]; -1 where a slot index holds no position."""
    return torch.cat([window_positions(pos, window), new_pos.long()], dim=1)


def append_windows(slots: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                   new: torch.Tensor) -> None:
    """Row r appends new[r] [kv_heads, n, head_dim] (positions pos[r] ..) to the window of
    slot ids[r] of slots [slots, kv_heads, W, head_dim], rows in order: whatever the row is (a
    padding row aimed at a live window shifts it); rows sharing a slot: the later row's
    append lands on the window the earlier one left (callers read every row's window first)."""
    for r in range(ids.shape[0]):
        window_append(slots[int(ids[r])], int(pos[r]), new[r])


def visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """valid [Q, L]: which keys each query attends to. Query positions qpos [Q]; key positions
    kpos [L] (shared) or [Q, L], negative where a slot holds no position. A key is visible when
    0 <= k <= q and, for a sliding layer, q - k < window (Gemma3, as transformers'
    `sliding_window_overlay`: the last `window` positions, the query's own included). The mask
    is by position only, never by where a key is stored, so a cache and a full recompute select
    the same keys."""
    kp = kpos if kpos.dim() == 2 else kpos[None, :]
    q = qpos[:, None]
    valid = (kp >= 0) & (kp <= q)
    if window is not None:
        valid &= kp > q - window
    return valid


def check_host(host: Any, shape: tuple[int, ...], dtype: torch.dtype, maker: str) -> torch.Tensor:
    """host if it is a `dtype` tensor of `shape` (made by the runtime's `maker()`), else
    RuntimeInputError saying what it was."""
    if not isinstance(host, torch.Tensor) or tuple(host.shape) != shape or host.dtype != dtype:
        got = (list(host.shape), host.dtype) if isinstance(host, torch.Tensor) \
            else type(host).__name__
        raise RuntimeInputError(f"host tensor must be {dtype} {list(shape)} ({maker}()), "
                                f"got {got}")
    return host


def copy_to_host(host: torch.Tensor, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor],
                 index: int) -> None:
    """host[j] = (k[j][index], v[j][index]) for every layer store j (a block or a slot)."""
    for j in range(len(k)):
        host[j, 0].copy_(k[j][index])
        host[j, 1].copy_(v[j][index])


def copy_from_host(host: torch.Tensor, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor],
                   index: int) -> None:
    """(k[j][index], v[j][index]) = host[j] for every layer store j (a block or a slot)."""
    for j in range(len(k)):
        k[j][index].copy_(host[j, 0])
        v[j][index].copy_(host[j, 1])


def stack_kv(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], index: int) -> torch.Tensor:
    """A copy of entry `index` of every layer store: [layers, 2 (K, V), kv_heads, n, head_dim]."""
    return torch.stack([torch.stack([k[j][index], v[j][index]]) for j in range(len(k))])
