"""A torch reference runtime: a small deterministic decoder with RBLN graph semantics.

`TorchReferenceRuntime` emulates the device: KV lives in per-layer K and V tensors
`[num_blocks, kv_heads, block_size, head_dim]`; prefill and decode write KV through the block
tables for every computed position (padding positions of a chunk and padding rows of a decode
included) and attend causally by position. A hybrid model (`RuntimeSpec.sliding_window`) has
sliding-window layers whose KV lives instead in per-lane local window slots
`[batch_size, kv_heads, sliding_window, head_dim]` (see `TorchReferenceRuntime`). `generate`
is an independent oracle: greedy decoding by full recompute over the whole sequence, with no
block table and no cache.

Exact arithmetic, so the cached path and the oracle agree bit for bit. The model is a fixed-point
transformer evaluated in float64: weights and activations are multiples of 2**-8 (activations
saturate at +-1024), rotary tables multiples of 2**-14, attention weights multiples of 2**-16.
With those grids and bounds every product and every partial sum of every matrix product and
reduction is exactly representable in float64, so a sum has one value whatever the order, the
blocking, the batch or the thread count (plain float matmul differs in the last bits with the row
count). The non-linear steps are elementwise and deterministic: RMSNorm uses IEEE sqrt and
division (correctly rounded), SiLU and the softmax exponential are table look-ups on grid values,
and every step's result is rounded back to its grid. Consequences:

- prefill/decode logits through the block tables equal `oracle_logits` exactly (`torch.equal`),
  so greedy tokens agree with `generate`, for any chunking, lane, block or batch composition;
- masked keys (positions after the query, junk in a block past a sequence's length) get weight
  exactly 0 and cannot change a sum; cached K/V is read through `_sane` (NaN -> 0, saturated at
  +-1024), which leaves every value the model wrote unchanged and keeps rows that attend to junk
  (padding rows) finite;
- K/V values fit float32 exactly, so the float32 cache (the default) loses nothing; `dtype`
  selects the cache and logits dtype, and float32 and float64 give the same logits up to that
  final cast.

Computation runs single-threaded by default (`num_threads=1`, restored after each call): the
model is tiny and thread hand-offs cost more than they save.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch

from atom_core.runtime.paged import (
    GatherIndex,
    append_windows,
    block_coords,
    check_host,
    copy_from_host,
    copy_to_host,
    gather_at,
    gather_index,
    stack_kv,
    window_append,
    window_key_positions,
    write_blocks,
)
from atom_core.runtime.paged import visible as _visible
from atom_core.runtime.protocol import (
    RuntimeInputError,
    check_block,
    check_copy,
    check_decode_inputs,
    check_prefill_inputs,
    check_slot,
    sizes_error,
    smallest_decode_batch,
)

if TYPE_CHECKING:
    from atom_core.config import Config

__all__ = ["RuntimeSpec", "TorchReferenceRuntime"]

# attend(store index, q [N, heads, d], k [N, kv_heads, d], v [N, kv_heads, d]) -> [N, heads, d]
_Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _positive(_inst: Any, attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attr.name} must be a positive integer, got {value!r}")


def _sizes(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in value}, reverse=True))


@attrs.frozen(kw_only=True)
class RuntimeSpec:
    """Sizes of a reference model and of its compiled artifact (KV cache and graphs)."""

    # artifact
    num_blocks: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(validator=_positive)
    max_seq_len: int = attrs.field(validator=_positive)
    prefill_chunk: int = attrs.field(validator=_positive)
    batch_size: int = attrs.field(validator=_positive)
    # row counts of the compiled decode graphs, largest first (optimum-rbln decoder_batch_sizes)
    decoder_batch_sizes: tuple[int, ...] = attrs.field(
        default=attrs.Factory(lambda self: (self.batch_size,), takes_self=True),
        converter=_sizes)
    # model
    vocab_size: int = attrs.field(default=128, validator=_positive)
    hidden: int = attrs.field(default=64, validator=_positive)
    layers: int = attrs.field(default=2, validator=_positive)
    heads: int = attrs.field(default=4, validator=_positive)
    kv_heads: int = attrs.field(default=2, validator=_positive)
    head_dim: int = attrs.field(default=16, validator=_positive)
    intermediate: int = attrs.field(default=128, validator=_positive)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # hybrid attention (Gemma3-style): with a window W, layer i is global when
    # (i + 1) % global_every == 0 and sliding (attends to the last W positions, KV in a local
    # window per lane) otherwise; None = every layer global, no local KV.
    sliding_window: int | None = attrs.field(default=None,
                                             validator=attrs.validators.optional(_positive))
    global_every: int = attrs.field(default=6, validator=_positive)

    def __attrs_post_init__(self) -> None:
        bad = sizes_error(self.max_seq_len, self.block_size, self.prefill_chunk)
        if bad:
            raise ValueError(bad)
        if self.num_blocks > 2**15 - 1:
            raise ValueError(f"num_blocks={self.num_blocks} does not fit int16 block tables")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding)")
        # exactness bounds of the fixed-point arithmetic (module docstring)
        if max(self.hidden, self.intermediate, self.heads * self.head_dim) > 4096 \
                or self.head_dim > 256 or self.max_seq_len > 65536:
            raise ValueError("the reference model is exact only for hidden, intermediate and "
                             "heads*head_dim <= 4096, head_dim <= 256, max_seq_len <= 65536")
        sizes = self.decoder_batch_sizes
        if not sizes or sizes[0] != self.batch_size or sizes[-1] <= 0:
            raise ValueError(f"decoder_batch_sizes={sizes} must be positive with the largest "
                             f"equal to batch_size={self.batch_size}")
        if self.sliding_window is not None:
            # both kinds of layer, so that both KV stores (blocks and local slots) exist and a
            # hybrid artifact is never a plain one in disguise
            if not 2 <= self.global_every <= self.layers:
                raise ValueError(
                    f"a hybrid model needs sliding and global layers: global_every="
                    f"{self.global_every} must be in 2..layers={self.layers}")
            if self.sliding_window > 65536:
                raise ValueError(f"sliding_window={self.sliding_window} must be <= 65536 "
                                 "(exactness bound, like max_seq_len)")

    @property
    def blocks_per_seq(self) -> int:
        """T: block-table entries per sequence."""
        return self.max_seq_len // self.block_size

    @property
    def hybrid(self) -> bool:
        """Whether the model has sliding-window layers (and the graphs local block tables)."""
        return self.sliding_window is not None

    def is_sliding(self, layer: int) -> bool:
        return self.hybrid and (layer + 1) % self.global_every != 0

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Layers with full causal attention, KV in the blocks (every layer unless hybrid)."""
        return tuple(i for i in range(self.layers) if not self.is_sliding(i))

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Layers with window attention, KV in the local slots (none unless hybrid)."""
        return tuple(i for i in range(self.layers) if self.is_sliding(i))


# The artifact's sizes: they shape the cache and the graphs, not the KV a position gets, and PD
# workers are sized differently on purpose, so the model fingerprint leaves them out.
_ARTIFACT_FIELDS = frozenset({"num_blocks", "block_size", "max_seq_len", "prefill_chunk",
                              "batch_size", "decoder_batch_sizes"})
# Model fields that mean nothing without a window: left out of a plain model's fingerprint, so
# plain models keep the fingerprint they had before hybrid models existed.
_HYBRID_FIELDS = frozenset({"sliding_window", "global_every"})


# --- fixed-point arithmetic (float64, exact) -------------------------------------------------

_F = torch.float64
_ACT = 256.0          # activations and weights: multiples of 1/256
_ACT_MAX = 1024.0     # activation saturation
_ROPE = 2.0**14       # rotary cos/sin: multiples of 2**-14
_PROB = 2.0**16       # attention weights: multiples of 2**-16
_SILU_SPAN = 16.0     # SiLU table covers [-16, 16]; outside, silu(x) = x (x > 0) or 0
_SILU_GRID = 2.0**12  # SiLU values: multiples of 2**-12
_EXP_SPAN = 16.0      # exp(-d) table covers d in [0, 16]; beyond, the weight rounds to 0


def _grid(x: torch.Tensor, scale: float = _ACT, bound: float = _ACT_MAX) -> torch.Tensor:
    """Round to the nearest multiple of 1/scale (half to even), saturate at +-bound; NaN -> 0
    (only rows computed from junk, e.g. padding rows, can produce one)."""
    return torch.nan_to_num(torch.clamp(torch.round(x * scale) / scale, -bound, bound), nan=0.0)


def _sane(kv: torch.Tensor) -> torch.Tensor:
    """Cached K/V as float64, with junk made finite and bounded (NaN -> 0, saturate at +-1024).
    Values the model wrote are grid values within the bound and pass unchanged; this keeps
    masked keys at weight 0 and rows that attend to junk (padding rows) finite."""
    return torch.clamp(torch.nan_to_num(kv.to(_F), nan=0.0), -_ACT_MAX, _ACT_MAX)


def _exp_table() -> torch.Tensor:
    d = torch.arange(int(_EXP_SPAN * _ACT) + 1, dtype=_F) / _ACT
    return torch.round(torch.exp(-d) * _PROB) / _PROB


def _silu_table() -> torch.Tensor:
    x = torch.arange(-int(_SILU_SPAN * _ACT), int(_SILU_SPAN * _ACT) + 1, dtype=_F) / _ACT
    return torch.round(x * torch.sigmoid(x) * _SILU_GRID) / _SILU_GRID


_EXP = _exp_table()
_SILU = _silu_table()


def _silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of grid values by table look-up (exact and elementwise)."""
    idx = (torch.clamp(x, -_SILU_SPAN, _SILU_SPAN) * _ACT).long() + int(_SILU_SPAN * _ACT)
    return torch.where(x > _SILU_SPAN, x, torch.where(x < -_SILU_SPAN, 0.0, _SILU[idx]))


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return _grid(x / torch.sqrt(ms + eps) * w)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class TorchReferenceRuntime:
    """A tiny seeded decoder-only transformer behind the RBLN runtime interface.

    Token embedding; `layers` x (RMSNorm, rotary grouped-query attention with `heads` query and
    `kv_heads` KV heads, RMSNorm, SiLU-gated MLP); final RMSNorm; LM head. Weights are drawn from
    `torch.Generator().manual_seed(seed)` and rounded to the fixed-point grid, so a seed is one
    model in float32 and float64 alike.

    Plain (`spec.sliding_window is None`): every layer is global, KV in the blocks; pass
    `local_block_tables=None`. Hybrid (a window W): the layers in `spec.sliding_layers` attend
    to the last W positions only and keep their KV not in the blocks but in `batch_size` local
    slots `k_local[j]`, `v_local[j]` [batch_size, kv_heads, W, head_dim] (one per lane), each a
    window as the RBLN kernel keeps it (`atom_core.runtime.paged`); `k_cache`/`v_cache` then
    hold the global layers only. The graphs take `local_block_tables` (prefill [1], decode
    [B,1]: the slot of the sequence, of each row), `uses_local_block_tables` is True, and the
    local-slot operations (`new_local_host_buffer`, `fetch_local_cache`, `update_local_cache`,
    `read_local`) work.
    """

    uses_local_block_tables = False
    # RBLN's graph semantics (protocol.py): every decode row computed, one prefill per call
    static_batch = True
    mixed_calls = False
    # a prefill can return every real position's logits (`all_logits`: prompt logprobs)
    prompt_logits = True

    def __init__(self, spec: RuntimeSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                 num_threads: int | None = 1):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.spec = spec
        self.seed = seed
        self.dtype = dtype
        self.num_threads = num_threads
        self.num_blocks = spec.num_blocks
        self.block_size = spec.block_size
        self.max_seq_len = spec.max_seq_len
        self.prefill_chunk = spec.prefill_chunk
        self.batch_size = spec.batch_size
        self.decoder_batch_sizes = spec.decoder_batch_sizes
        self.vocab_size = spec.vocab_size
        self._w = _init_weights(spec, seed)
        half = spec.head_dim // 2
        inv = spec.rope_theta ** (-torch.arange(half, dtype=_F) / half)
        # (through the padding rows of a last chunk that reaches past max_seq_len)
        rows = -(-spec.max_seq_len // spec.prefill_chunk) * spec.prefill_chunk
        ang = torch.arange(rows, dtype=_F)[:, None] * inv[None, :]
        self._cos = _grid(torch.cos(ang), _ROPE, 1.0)
        self._sin = _grid(torch.sin(ang), _ROPE, 1.0)
        self.uses_local_block_tables = spec.hybrid
        self.sliding_window = spec.sliding_window
        # layer -> its index in k_cache/v_cache (global) or k_local/v_local (sliding)
        self._store = {layer: j for group in (spec.global_layers, spec.sliding_layers)
                       for j, layer in enumerate(group)}
        shape = (spec.num_blocks, spec.kv_heads, spec.block_size, spec.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype) for _ in spec.global_layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype) for _ in spec.global_layers]
        local = (spec.batch_size, spec.kv_heads, spec.sliding_window or 0, spec.head_dim)
        self.k_local = [torch.zeros(local, dtype=dtype) for _ in spec.sliding_layers]
        self.v_local = [torch.zeros(local, dtype=dtype) for _ in spec.sliding_layers]
        self.calls = {"prefill": 0, "decode": 0, "copy": 0, "fetch": 0, "update": 0,
                      "fetch_local": 0, "update_local": 0}

    @classmethod
    def tiny(cls, config: Config, seed: int = 0, dtype: torch.dtype = torch.float32,
             **model: Any) -> TorchReferenceRuntime:
        """A tiny model (2 layers, hidden 64, vocab 128 unless overridden by `model`, e.g.
        `decoder_batch_sizes=(4, 2, 1)`, or `sliding_window=16, layers=3, global_every=3` for a
        hybrid one) for an `atom_core.config.Config`: its lanes, kv_blocks, block_size,
        max_seq_len and prefill_chunk."""
        spec = RuntimeSpec(num_blocks=config.kv_blocks, block_size=config.block_size,
                           max_seq_len=config.max_seq_len, prefill_chunk=config.prefill_chunk,
                           batch_size=config.lanes, **model)
        return cls(spec, seed=seed, dtype=dtype)

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex of the model (the spec's model fields), the seed and the cache dtype, for
        `atom_core.pd.payload`: the same in every process for the same three, whatever the
        artifact's sizes (blocks, lanes, chunk), which do not change the KV a position gets."""
        skip = _ARTIFACT_FIELDS | (frozenset() if self.spec.hybrid else _HYBRID_FIELDS)
        model = {k: v for k, v in attrs.asdict(self.spec).items() if k not in skip}
        facts = {"runtime": "atom_core.TorchReferenceRuntime", "model": model,
                 "seed": self.seed, "dtype": str(self.dtype)}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()

    # --- the model ---------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self._cos[pos][:, None, :], self._sin[pos][:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return _grid(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor,
                 attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, V] (float64, exact) for tokens `ids` at positions `pos`.

        `attend(layer, q, k, v)` gets this call's q [N, heads, d], k and v [N, kv_heads, d],
        stores k and v where it keeps keys, and returns the attention output [N, heads, d]."""
        s, w = self.spec, self._w
        n = ids.shape[0]
        x = w["embed"][ids]
        for i in range(s.layers):
            h = _rmsnorm(x, w["attn_norm"][i], s.norm_eps)
            q = self._rope(_grid(h @ w["wq"][i].T).view(n, s.heads, s.head_dim), pos)
            k = self._rope(_grid(h @ w["wk"][i].T).view(n, s.kv_heads, s.head_dim), pos)
            v = _grid(h @ w["wv"][i].T).view(n, s.kv_heads, s.head_dim)
            a = attend(i, q, k, v).reshape(n, s.heads * s.head_dim)
            x = _grid(x + a @ w["wo"][i].T)
            h = _rmsnorm(x, w["mlp_norm"][i], s.norm_eps)
            gated = _grid(_silu(_grid(h @ w["wg"][i].T)) * _grid(h @ w["wu"][i].T))
            x = _grid(x + gated @ w["wd"][i].T)
        if rows is not None:
            x = x[rows]
        return _rmsnorm(x, w["final_norm"], s.norm_eps) @ w["lm_head"].T

    def _attend(self, q: torch.Tensor, valid: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Masked attention, exact. q [Q, heads, d]; k, v [R, kv_heads, L, d] with R = 1 (shared
        by every query) or Q (one key row per query); valid [Q, L] (`_visible`) says which keys
        each query sees. Other keys get weight exactly 0, and since every sum is exact, neither
        the order of the keys nor masked junk among them changes the result."""
        s = self.spec
        nq, rep, length = q.shape[0], s.heads // s.kv_heads, k.shape[2]
        qg = q.reshape(nq, s.kv_heads, rep, s.head_dim)
        if k.shape[0] == 1:   # shared keys: [kv_heads, Q*rep, d] @ [kv_heads, d, L]
            dots = (qg.permute(1, 0, 2, 3).reshape(s.kv_heads, nq * rep, s.head_dim)
                    @ k[0].transpose(1, 2)).reshape(s.kv_heads, nq, rep, length)
            dots = dots.permute(1, 0, 2, 3)
        else:                 # per-query keys: [Q, kv_heads, rep, d] @ [Q, kv_heads, d, L]
            dots = qg @ k.transpose(2, 3)
        valid = valid[:, None, None, :]
        sc = torch.where(valid, _grid(dots * (1.0 / math.sqrt(s.head_dim)), _ACT, math.inf),
                         -math.inf)                                   # [Q, kv_heads, rep, L]
        gap = sc.amax(-1, keepdim=True) - sc
        idx = torch.clamp(torch.where(valid, gap, 0.0) * _ACT, max=_EXP_SPAN * _ACT).long()
        p = torch.where(valid, _EXP[idx], 0.0)
        if k.shape[0] == 1:
            num = (p.permute(1, 0, 2, 3).reshape(s.kv_heads, nq * rep, length) @ v[0])
            num = num.reshape(s.kv_heads, nq, rep, s.head_dim).permute(1, 0, 2, 3)
        else:
            num = p @ v
        out = _grid(num / p.sum(-1, keepdim=True))
        return out.reshape(nq, s.heads, s.head_dim)

    # --- the device graphs -------------------------------------------------------------------

    def _gather(self, j: int, index: GatherIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [R, kv_heads, length, d] (float64) of global layer store j at the positions
        `index` names (`gather_index`: 0..length-1 through each row's block table; entries past
        the validated positions are clamped, and masked)."""
        return _sane(gather_at(self.k_cache[j], index)), _sane(gather_at(self.v_cache[j], index))

    def _write(self, j: int, blk: torch.Tensor, off: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        write_blocks(self.k_cache[j], blk, off, k)
        write_blocks(self.v_cache[j], blk, off, v)

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any, *,
                all_logits: bool = False) -> torch.Tensor:
        """Logits [1, 1, V] of the chunk's last real token; `all_logits`: [1, qp + 1, V], of
        each real token (the `prompt_logits` capability), from this one forward."""
        ids, pos, bt, lbt, qp = check_prefill_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables, query_position)
        self.calls["prefill"] += 1
        p = pos[0].long()
        tab = bt.long()[None, :]                                             # [1, T]
        blk, off = block_coords(tab[0], p, self.block_size)
        # (a padded last chunk may reach past max_seq_len: those rows are neither stored nor
        # read back; `block_coords`)
        length = min(int(p[-1]) + 1, self.max_seq_len)
        index = gather_index(tab, length, self.block_size, self.num_blocks)
        causal = _visible(p, torch.arange(length), None)
        local = None if lbt is None else self._prefill_local(p, int(qp), int(lbt[0]))
        attend = self._attender(blk, off, causal, index, local)
        rows = torch.arange(int(qp) + 1) if all_logits else qp.long().view(1)
        with torch_threads(self.num_threads):
            out = self._forward(ids[0], p, attend, rows=rows)
        return out.to(self.dtype).view(1, rows.numel(), self.vocab_size)

    def _attender(self, blk: torch.Tensor, off: torch.Tensor, causal: torch.Tensor,
                  index: torch.Tensor, local: _Attend | None) -> _Attend:
        """One call's attention per layer: a sliding layer of a hybrid model through its local
        slot (`local`), any other writes the new K/V into the paged blocks at (blk, off) and
        attends over the positions `index` gathers, under the `causal` mask."""
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            j = self._store[layer]
            if local is not None and self.spec.is_sliding(layer):
                return local(j, q, k, v)
            self._write(j, blk, off, k, v)
            return self._attend(q, causal, *self._gather(j, index))

        return attend

    def _prefill_local(self, p: torch.Tensor, qp: int, slot: int) -> _Attend:
        """Sliding-layer attention of a prefill chunk at positions p [C] in local slot `slot`.

        A query sees the window's positions before the chunk and the chunk's own positions,
        both by position (`_visible`), so a chunk longer than the window masks its own old
        positions. Then the chunk's real positions (up to start + query_position, as the
        kernel's cache_offset) are appended to the window (`window_append`)."""
        w = self.spec.sliding_window
        assert w is not None
        start = int(p[0])
        kpos = window_key_positions(p[:1], p[None], w)[0]                      # [W + C]
        valid = _visible(p, kpos, w)
        real = qp + 1

        def attend(j: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kr, vr = self.k_local[j][slot], self.v_local[j][slot]          # [kv_heads, W, d]
            keys = torch.cat([_sane(kr), k.permute(1, 0, 2)], dim=1)[None]
            vals = torch.cat([_sane(vr), v.permute(1, 0, 2)], dim=1)[None]
            out = self._attend(q, valid, keys, vals)
            window_append(kr, start, k[:real].permute(1, 0, 2))
            window_append(vr, start, v[:real].permute(1, 0, 2))
            return out

        return attend

    def _decode_local(self, p: torch.Tensor, slots: torch.Tensor) -> _Attend:
        """Sliding-layer attention of decode rows at positions p [B] in local slots [B].

        Each row reads its slot's window as holding positions p - min(p, W) .. p - 1, attends
        to those and its own key, then appends its key (`window_append`: a full window drops
        its oldest position). Whatever the row is: a padding row aimed at a live window
        shifts it, which is why the scheduler aims padding rows at an idle lane's slot. Rows
        sharing a slot all read it before any writes; the later row's write wins."""
        w = self.spec.sliding_window
        assert w is not None
        valid = _visible(p, window_key_positions(p, p[:, None], w), w)        # [B, W + 1]

        def attend(j: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kl, vl = self.k_local[j], self.v_local[j]
            keys = torch.cat([_sane(kl[slots]), k[:, :, None, :]], dim=2)   # [B, kv, W + 1, d]
            vals = torch.cat([_sane(vl[slots]), v[:, :, None, :]], dim=2)
            out = self._attend(q, valid, keys, vals)
            append_windows(kl, slots, p, k[:, :, None, :])
            append_windows(vl, slots, p, v[:, :, None, :])
            return out

        return attend

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> torch.Tensor:
        ids, pos, bt, lbt = check_decode_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables)
        self.calls["decode"] += 1
        b = ids.shape[0]
        p = pos[:, 0].long()
        tab = bt.long()
        blk, off = block_coords(tab, p, self.block_size)
        length = int(p.max()) + 1
        index = gather_index(tab, length, self.block_size, self.num_blocks)
        causal = _visible(p, torch.arange(length), None)
        local = None if lbt is None else self._decode_local(p, lbt[:, 0].long())
        attend = self._attender(blk, off, causal, index, local)
        with torch_threads(self.num_threads):
            out = self._forward(ids[:, 0], p, attend)
        return out.to(self.dtype).view(b, 1, self.vocab_size)

    def decode_batch_size(self, busy_rows: Iterable[int]) -> int:
        return smallest_decode_batch(self.decoder_batch_sizes, busy_rows)

    # --- block operations --------------------------------------------------------------------

    def _block(self, name: str, block: int) -> int:
        return check_block(name, block, self.num_blocks)

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        s, d, n = check_copy(src, dst, num_tokens, self.num_blocks, self.block_size)
        self.calls["copy"] += 1
        for cache in (*self.k_cache, *self.v_cache):
            cache[d, :, :n] = cache[s, :, :n]

    def _block_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (len(s.global_layers), 2, s.kv_heads, s.block_size, s.head_dim)

    def new_host_buffer(self) -> torch.Tensor:
        """[global layers, 2 (K, V), kv_heads, block_size, head_dim] in the cache dtype (every
        layer is global unless the model is hybrid)."""
        return torch.zeros(self._block_shape(), dtype=self.dtype)

    def _host(self, host_tensor: Any, shape: tuple[int, ...], maker: str) -> torch.Tensor:
        return check_host(host_tensor, shape, self.dtype, maker)

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        host = self._host(host_tensor, self._block_shape(), "new_host_buffer")
        b = self._block("fetch", block)
        self.calls["fetch"] += 1
        copy_to_host(host, self.k_cache, self.v_cache, b)

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        host = self._host(host_tensor, self._block_shape(), "new_host_buffer")
        b = self._block("update", block)
        self.calls["update"] += 1
        copy_from_host(host, self.k_cache, self.v_cache, b)

    def read_block(self, block: int) -> torch.Tensor:
        """A copy of block `block`: [global layers, 2 (K, V), kv_heads, block_size, head_dim]."""
        b = self._block("read_block", block)
        return stack_kv(self.k_cache, self.v_cache, b)

    # --- local-slot operations (hybrid models) -----------------------------------------------

    def _hybrid_only(self, name: str) -> None:
        if not self.spec.hybrid:
            raise RuntimeInputError(f"{name}: this model has no sliding-window layers, so no "
                                    "local slots")

    def _slot(self, name: str, slot: int) -> int:
        self._hybrid_only(name)
        return check_slot(name, slot, self.batch_size)

    def _local_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (len(s.sliding_layers), 2, s.kv_heads, s.sliding_window or 0, s.head_dim)

    def new_local_host_buffer(self) -> torch.Tensor:
        """[sliding layers, 2 (K, V), kv_heads, sliding_window, head_dim] in the cache dtype:
        one local slot (a window: the last min(p, W) positions in order)."""
        self._hybrid_only("new_local_host_buffer")
        return torch.zeros(self._local_shape(), dtype=self.dtype)

    def fetch_local_cache(self, host_tensor: Any, slot: int) -> None:
        """Copy local slot `slot` (every sliding layer) from the device into `host_tensor`."""
        t = self._slot("fetch_local", slot)
        host = self._host(host_tensor, self._local_shape(), "new_local_host_buffer")
        self.calls["fetch_local"] += 1
        copy_to_host(host, self.k_local, self.v_local, t)

    def update_local_cache(self, host_tensor: Any, slot: int) -> None:
        """Copy `host_tensor` (from `fetch_local_cache`) into local slot `slot` on the device."""
        t = self._slot("update_local", slot)
        host = self._host(host_tensor, self._local_shape(), "new_local_host_buffer")
        self.calls["update_local"] += 1
        copy_from_host(host, self.k_local, self.v_local, t)

    def read_local(self, slot: int) -> torch.Tensor:
        """A copy of local slot `slot`: [sliding layers, 2 (K, V), kv_heads, W, head_dim]."""
        t = self._slot("read_local", slot)
        return stack_kv(self.k_local, self.v_local, t)

    # --- the oracle --------------------------------------------------------------------------

    def oracle_logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [V] after `tokens` by full recompute: no block table, no KV cache; global
        layers attend causally, sliding layers to the last `sliding_window` positions."""
        n = len(tokens)
        if not 1 <= n <= self.max_seq_len:
            raise ValueError(f"sequence length {n} must be in 1..{self.max_seq_len}")
        ids = torch.tensor(tokens, dtype=torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.vocab_size - 1}")
        pos = torch.arange(n)
        causal = _visible(pos, pos, None)
        window = _visible(pos, pos, self.spec.sliding_window) if self.spec.hybrid else causal

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            valid = window if self.spec.is_sliding(layer) else causal
            return self._attend(q, valid, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None])

        with torch_threads(self.num_threads):
            out = self._forward(ids, pos, attend, rows=torch.tensor([n - 1]))
        return out[0].to(self.dtype)

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[int]:
        """Greedy continuation of `prompt_ids` by full recompute each step (the oracle).

        Returns up to `max_new_tokens` new tokens; stops after emitting `eos_token_id` (which is
        included) or once the sequence's KV is full: the last token is generated from position
        max_seq_len - 1, so prompt + output is at most max_seq_len + 1 tokens (the device can do
        the same: that token's own KV is never needed). Ties go to the lowest id.
        """
        seq = list(prompt_ids)
        if not 1 <= len(seq) <= self.max_seq_len:
            raise ValueError(f"prompt length {len(seq)} must be in 1..{self.max_seq_len}")
        if eos_token_id is not None:
            from atom_core.config import check_end_tokens

            check_end_tokens(eos_token_id, self.vocab_size, "generate")
        out: list[int] = []
        while len(out) < max_new_tokens and len(seq) <= self.max_seq_len:
            tok = int(torch.argmax(self.oracle_logits(seq)))
            out.append(tok)
            seq.append(tok)
            if tok == eos_token_id:
                break
        return out


def _init_weights(spec: RuntimeSpec, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return _grid(mean + torch.randn(shape, generator=gen, dtype=_F) * std, _ACT, 127.0)

    def lin(out: int, inp: int) -> torch.Tensor:
        return normal(out, inp, std=1.0 / math.sqrt(inp))

    h, f = spec.hidden, spec.intermediate
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    w: dict[str, Any] = {"embed": normal(spec.vocab_size, h, std=1.0)}
    for name in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "wg", "wu", "wd"):
        w[name] = []
    for _ in range(spec.layers):
        w["attn_norm"].append(normal(h, std=0.1, mean=1.0))
        w["wq"].append(lin(q, h))
        w["wk"].append(lin(kv, h))
        w["wv"].append(lin(kv, h))
        w["wo"].append(lin(h, q))
        w["mlp_norm"].append(normal(h, std=0.1, mean=1.0))
        w["wg"].append(lin(f, h))
        w["wu"].append(lin(f, h))
        w["wd"].append(lin(h, f))
    w["final_norm"] = normal(h, std=0.1, mean=1.0)
    w["lm_head"] = normal(spec.vocab_size, h, std=2.0 / math.sqrt(h))
    return w
