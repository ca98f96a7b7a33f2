"""HFRuntime's attention: the `atom_paged` function transformers' modules call, over the paged KV.

A runtime call runs the model once over a packed row of tokens (input_ids [1, N]) made of
groups: a group is R rows of Q positions each (a decode: R rows of one position; a prefill
chunk: one row of Q positions), its tokens row by row at N offsets `start .. start + R * Q`.
`CallGraph` is built once per call: where each token's KV goes (block, offset), and per group
the blocks its rows read, the key positions those hold and the masks by position (causal; a
sliding layer's window). Every layer then writes the call's keys and values with one indexed
store, reads each group's blocks with one indexed copy (whole blocks: a block-granular gather,
never one index per position) and attends with `torch.nn.functional.scaled_dot_product_attention`
(grouped-query heads through `enable_gqa`, no copy of the KV per query head).

Several groups in one call are a mixed step (a decode beside prompt chunks of other lanes):
their rows read and write disjoint lanes' blocks and slots, so each group attends over its own
keys exactly as it would in a call of its own.

Gemma3's sliding layers keep a lane's last W positions in a local slot (`atom_core.runtime.
paged`): a group's rows read their slots' windows, attend to them and their own keys under
transformers' sliding mask (position q sees q - W + 1 .. q) and append their real positions
(`real` per row: a padded prefill chunk's up to start + query_position, else all of them).
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F  # noqa: N812
from transformers import AttentionInterface

from atom_core.runtime.paged import (
    append_windows,
    block_coords,
    visible,
    window_key_positions,
    write_blocks,
)

if TYPE_CHECKING:
    from atom_core.runtime.hf import HFRuntime

__all__ = ["ATTENTION", "CallGraph", "Group", "UnsupportedModelError", "current", "row_blocks"]

ATTENTION = "atom_paged"


class UnsupportedModelError(ValueError):
    """A model (architecture, attention type, window, dtype) this runtime cannot serve."""


@attrs.frozen(eq=False)
class Group:
    """R rows of Q positions each in a call: pos [R, Q] the positions, tab [R, T] each row's
    block table, slots [R] each row's local slot (hybrid models, else None), real: how many of
    a row's Q positions its sliding layers append to the slot's window."""

    pos: torch.Tensor
    tab: torch.Tensor
    slots: torch.Tensor | None = None
    real: int = 0


def row_blocks(tab: torch.Tensor, nb: int, num_blocks: int) -> torch.Tensor:
    """[R, nb]: the first nb blocks of each row's table tab [R, T], the blocks holding its
    positions 0..nb * block_size - 1. Entries past the positions a caller validated may hold
    anything: clamped to a valid block id (the mask hides their keys)."""
    return torch.clamp(tab.long()[:, :nb], 0, num_blocks - 1)


class _Plan:
    """A group as the layers read it: its token span, the blocks its rows gather, the masks."""

    def __init__(self, rt: HFRuntime, g: Group, offset: int) -> None:
        r, q = g.pos.shape
        self.rows, self.q, self.span = r, q, slice(offset, offset + r * q)
        bs = rt.block_size
        # keys 0..length-1 are read (a padded last chunk may reach past max_seq_len: not
        # stored, not read; `block_coords`): [R * length] indices into a layer's storage
        # viewed as [kv_heads, num_blocks * block_size, d], each row's positions in order
        self.length = length = min(int(g.pos.max()) + 1, rt.max_seq_len)
        kpos = torch.arange(length)
        blocks = row_blocks(g.tab, -(-length // bs), rt.num_blocks)               # [R, nb]
        self.index = (blocks[:, kpos // bs] * bs + kpos % bs).reshape(-1)
        # [R, 1, Q, L]: key k visible from a query at q iff k <= q (by position, never by where
        # the key is stored, so junk in a block past a sequence's end is masked)
        self.valid = visible(g.pos.reshape(-1), kpos, None).view(r, 1, q, length)
        self.slots = None if g.slots is None else g.slots.long()
        if self.slots is not None:
            w = rt.sliding_window
            assert w is not None
            self.start = g.pos[:, 0].long()
            self.real = g.real
            # a row's keys: its slot's window as read at its first position, then its own Q
            # positions; [R, 1, Q, W + Q] by position (the window's own mask, the chunk's
            # causal one: a chunk longer than the window masks its own oldest positions)
            lpos = window_key_positions(self.start, g.pos, w).repeat_interleave(q, dim=0)
            self.local_valid = visible(g.pos.reshape(-1), lpos, w).view(r, 1, q, w + q)

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [heads, N, d] of the packed call -> this group's [R, heads, Q, d] (a view)."""
        h, _, d = x.shape
        return x[:, self.span].view(h, self.rows, self.q, d).transpose(0, 1)

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """[R, kv_heads, L, d]: the group's keys (or values) of one layer's cache in position
        order, in one `index_select` of its head-major storage (HFRuntime keeps each cache as
        a [num_blocks, kv_heads, ...] view of a [kv_heads, num_blocks, ...] tensor, so each
        head's positions are rows of one [num_blocks * block_size, d] matrix: no transposing
        copy, and only the positions read, not whole blocks: in a micro-benchmark of 12 such
        gathers at 16 rows x 201 positions on a loaded 2-core machine, 1.3 to 5 times cheaper
        than gathering whole blocks). Junk past a sequence's end is masked, but NaN * 0 is
        NaN: made finite (in place: the copy is ours)."""
        store = cache.transpose(0, 1)                                # [KVH, blocks, bs, d]
        h, nb, bs, d = store.shape
        k = store.reshape(h, nb * bs, d).index_select(1, self.index)  # [KVH, R * L, d]
        return torch.nan_to_num_(k.view(h, self.rows, self.length, d).transpose(0, 1))


class CallGraph:
    """One runtime call: its groups in packed order (see the module docstring)."""

    def __init__(self, rt: HFRuntime, groups: list[Group]) -> None:
        self.rt = rt
        self.plans: list[_Plan] = []
        blks, offs, n = [], [], 0
        for g in groups:
            r, q = g.pos.shape
            rows = g.tab.long()[torch.arange(r).repeat_interleave(q)]       # [R*Q, T]
            blk, off = block_coords(rows, g.pos.reshape(-1), rt.block_size)
            blks.append(blk)
            offs.append(off)
            self.plans.append(_Plan(rt, g, n))
            n += r * q
        self.blk, self.off = torch.cat(blks), torch.cat(offs)
        self.tokens = n

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float, kwargs: dict[str, Any]) -> torch.Tensor:
        """query [1, H, N, d], key/value [1, KVH, N, d] of this call's tokens; [1, N, H, d]."""
        rt = self.rt
        layer = module.layer_idx
        window = kwargs.get("sliding_window")
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            raise UnsupportedModelError(
                f"layer {layer} asks for attention logit soft-capping or sinks, which "
                "HFRuntime does not implement")
        if query.shape[0] != 1 or query.shape[2] != self.tokens:
            raise RuntimeError(f"the '{ATTENTION}' attention expects the call's packed row of "
                               f"{self.tokens} tokens, got query {list(query.shape)}")
        j = rt._store[layer]
        q, k_new, v_new = query[0], key[0], value[0]                       # [heads, N, d]
        if layer in rt._sliding:
            if window != rt.sliding_window or any(p.slots is None for p in self.plans):
                raise UnsupportedModelError(
                    f"sliding layer {layer} asks for window {window}, the runtime keeps "
                    f"{rt.sliding_window}")
            outs = [self._local(p, j, q, k_new, v_new, scaling) for p in self.plans]
        else:
            if window is not None and window < rt.max_seq_len:
                raise UnsupportedModelError(
                    f"layer {layer} asks for sliding-window attention (window {window}), "
                    "which HFRuntime does not implement for this model")
            kc, vc = rt.k_cache[j], rt.v_cache[j]
            write_blocks(kc, self.blk, self.off, k_new.transpose(0, 1))
            write_blocks(vc, self.blk, self.off, v_new.transpose(0, 1))
            outs = [_sdpa(p.rows_of(q), p.gather(kc), p.gather(vc), p.valid, scaling)
                    for p in self.plans]
        return torch.cat(outs, dim=0).unsqueeze(0)

    def _local(self, p: _Plan, j: int, q: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor, scaling: float) -> torch.Tensor:
        """A sliding layer (store j) for group p: each row reads its slot's window, attends to
        it and its own keys, then appends its real keys (`append_windows`)."""
        assert p.slots is not None
        rt_k, rt_v = self.rt.k_local[j], self.rt.v_local[j]
        key, value = p.rows_of(k_new), p.rows_of(v_new)                    # [R, KVH, Q, d]
        k = torch.cat([torch.nan_to_num_(rt_k[p.slots]), key.to(rt_k.dtype)], dim=2)
        v = torch.cat([torch.nan_to_num_(rt_v[p.slots]), value.to(rt_v.dtype)], dim=2)
        out = _sdpa(p.rows_of(q), k, v, p.local_valid, scaling)
        append_windows(rt_k, p.slots, p.start, key[:, :, :p.real])
        append_windows(rt_v, p.slots, p.start, value[:, :, :p.real])
        return out


def _sdpa(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
          scaling: float) -> torch.Tensor:
    """query [R, H, Q, d] over keys/values [R, KVH, L, d] where valid [R, 1, Q, L] (grouped
    query: each KV head serves H / KVH query heads); [R * Q, H, d] in packed order."""
    out = F.scaled_dot_product_attention(query, k.to(query.dtype), v.to(query.dtype),
                                         attn_mask=valid, scale=scaling,
                                         enable_gqa=query.shape[1] != k.shape[1])
    r, h, q, d = out.shape
    return out.transpose(1, 2).reshape(r * q, h, d)


_CURRENT: contextvars.ContextVar[CallGraph | None] = contextvars.ContextVar("atom_hf_graph",
                                                                           default=None)


def current() -> contextvars.ContextVar[CallGraph | None]:
    """The call graph of the call running now (set by `HFRuntime` around its forward)."""
    return _CURRENT


def _paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    graph = _CURRENT.get()
    if graph is None:
        raise RuntimeError(f"the '{ATTENTION}' attention runs only inside HFRuntime.prefill/"
                           "decode; build other models with another attn_implementation")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return graph.attend(module, query, key, value, scaling, kwargs), None


AttentionInterface.register(ATTENTION, _paged_attention)
