"""The paged KV layout shared by every torch runtime: one K (or V) tensor per layer
`[num_blocks, kv_heads, block_size, head_dim]`, position p of a sequence at
(block_tables[p // block_size], p % block_size).

`block_coords` says where positions live, `write_blocks` stores K or V there and `gather_blocks`
reads a sequence's positions 0..length-1 back in order, so a runtime's attention sees the keys of
one sequence as one contiguous [kv_heads, length, head_dim] tensor whatever blocks hold them.
"""

from __future__ import annotations

import torch

__all__ = ["block_coords", "gather_blocks", "write_blocks"]


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
