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
"""

from __future__ import annotations

import torch

__all__ = ["block_coords", "gather_blocks", "window_append", "window_positions", "write_blocks"]


def block_coords(tab: torch.Tensor, pos: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) [N] of positions pos [N], row r of pos read through table row tab[r]
    (tab [N, T]) or every position through one table (tab [T])."""
    p = pos.long()
    idx = p // block_size
    blk = tab.long()[idx] if tab.dim() == 1 else tab.long()[torch.arange(p.shape[0]), idx]
    return blk, p % block_size


def write_blocks(cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                 x: torch.Tensor) -> None:
    """Store x [N, kv_heads, head_dim] at (blk[i], off[i]) of cache, cast to the cache dtype. Two
    entries at one place: the later one wins (a scheduler bug, but deterministic)."""
    cache[blk, :, off, :] = x.to(cache.dtype)


def gather_blocks(cache: torch.Tensor, tab: torch.Tensor, length: int,
                  block_size: int) -> torch.Tensor:
    """[R, kv_heads, length, head_dim]: positions 0..length-1 of each of R sequences whose block
    tables are tab [R, T], in position order. Entries past the positions a caller validated may
    hold anything: they are clamped to a valid block id, and the caller masks those keys."""
    kpos = torch.arange(length)
    blk = torch.clamp(tab.long()[:, kpos // block_size], 0, cache.shape[0] - 1)      # [R, L]
    off = (kpos % block_size)[None, :].expand_as(blk)
    return cache[blk, :, off, :].permute(0, 2, 1, 3)


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
