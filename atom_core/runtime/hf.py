"""A runtime over a Hugging Face transformers causal LM, with RBLN graph semantics.

`HFRuntime` drives a real `transformers` model (Llama, Mistral, Qwen2: decoder-only models whose
attention goes through transformers' attention-function registry; Gemma3 text, the hybrid
sliding-window model) behind the same interface as `TorchReferenceRuntime`: B=1 chunked prefill
and B-row decode through the batcher's int16 block tables, KV per global layer in
`[num_blocks, kv_heads, block_size, head_dim]` and, for Gemma3's sliding layers, in lane-local
window slots `[batch_size, kv_heads, W, head_dim]` addressed by `local_block_tables`
(`atom_core.runtime.paged`, shared with the reference runtime).

How: the model is loaded with `attn_implementation="atom_paged"`, an attention function registered
through transformers' public `AttentionInterface`. The model computes q, k, v (projections, its
norms, rotary embedding at the given `position_ids`: Gemma3's separate local and global rotary
bases included) as it always does and hands them to that function with its own scaling (Gemma3's
`query_pre_attn_scalar`), which writes k and v through the block tables and attends over the
gathered keys, masked by position (causal: a key is visible when its position is <= the
query's). A sliding layer instead reads the row's local window, attends to it and the call's own
keys under transformers' Gemma3 sliding mask (position q sees q - W + 1 .. q) and appends the
call's real positions to the window. The model is called without a transformers cache
(`use_cache=False`), so the paged cache and the slots are the only KV there is. No model source
is patched; the registry lookup happens at every attention call, so a model built with another
attention implementation is not affected.

Like the device, every computed position writes its KV: the padding positions of a prefill chunk
and the padding rows of a decode (which the batcher aims at the scratch block). Attention runs in
the model's dtype (float32 or float64): the result equals transformers' own attention up to
floating-point rounding (not bit for bit; the tests compare greedy tokens at steps whose top-1 /
top-2 logit gap is far above that rounding, and float32 logits with a tolerance).

Refused, each with a message: architectures other than the supported ones (the multimodal
Gemma3 among them), sliding-window layers in a model other than Gemma3 whose window is shorter
than `max_seq_len` (Qwen2's sliding layers, a Mistral window; one at least as long is full
attention for every sequence served, and is served so), a Gemma3 config with no global layer, a
non-positive window, bidirectional attention or attention soft-capping, dtypes other than
float32/float64, a `max_seq_len` beyond the model's `max_position_embeddings`, LongRoPE with an
original length below `max_seq_len` (its frequencies change per call, `_check_rope`), a
checkpoint lacking any weight of the causal LM (a bare decoder's or a classifier's:
transformers would initialize the LM head at random, `_check_complete`) and a model of another
class than the supported causal LM (`_check_model_class`).

Nothing touches the network: loading is `from_pretrained(path, local_files_only=True)` and the
hub is set offline (`HF_HUB_OFFLINE=1`) when this module is imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from atom_core.config import check_end_tokens
from atom_core.runtime.paged import (
    append_windows,
    block_coords,
    check_host,
    copy_from_host,
    copy_to_host,
    gather_at,
    gather_index,
    stack_kv,
    visible,
    window_key_positions,
    write_blocks,
)
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
from atom_core.runtime.reference import torch_threads

# offline before transformers is imported (it reads the variable at import time)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.utils import logging as hf_logging  # noqa: E402

if TYPE_CHECKING:
    from atom_core.config import Config
    from atom_core.serve.runtimes import ServeOptions

__all__ = ["ATTENTION", "DEFAULT_THREADS", "SMALL_MODEL_PARAMETERS", "SUPPORTED_MODEL_TYPES",
           "TINY_MODELS", "GenerateOracle", "HFRuntime", "UnsupportedModelError", "seed_weights",
           "serve_factory", "threads_for", "tiny_model", "tiny_runtime", "with_model_window"]

ATTENTION = "atom_paged"
# model_type -> what it is; each uses the standard attention interface like Llama
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# the hybrid ones: 'sliding_attention' layers (config.layer_types) keep their KV in local slots
HYBRID_MODEL_TYPES = frozenset({"gemma3_text"})
SLIDING, FULL = "sliding_attention", "full_attention"
DTYPES = (torch.float32, torch.float64)
# torch intra-op threads during a prefill/decode call (None: torch's own setting). "auto": one
# for a model below SMALL_MODEL_PARAMETERS, torch's setting above. Measured with `python -m
# bench.hf` on a shared 2-core machine (README): the tiny test models (~0.1M parameters) ran 7
# to 20 times slower with torch's default of 2 threads (a hand-off costs more than a [B, 64]
# matmul saves), an 18M-parameter Llama (`--model small-llama`) 1.2-1.4 times faster.
DEFAULT_THREADS = "auto"
SMALL_MODEL_PARAMETERS = 1_000_000


def threads_for(model: Any, num_threads: int | str | None) -> int | None:
    """The thread count a runtime of `model` uses for `num_threads` ("auto", a count, None)."""
    if num_threads != "auto":
        if num_threads is not None and (isinstance(num_threads, bool)
                                        or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads must be 'auto', a positive count or None, got "
                             f"{num_threads!r}")
        return num_threads  # type: ignore[return-value]
    size = sum(p.numel() for p in model.parameters())
    return 1 if size < SMALL_MODEL_PARAMETERS else None


class UnsupportedModelError(ValueError):
    """A model (architecture, attention type, window, dtype) this runtime cannot serve."""


# --- the attention function --------------------------------------------------------------------

class _Graph:
    """One prefill or decode call: where each computed position's KV goes and what it sees.

    pos [B, Q] positions of the B*Q computed tokens; tab [B, T] each row's block table (a
    prefill has B = 1); length: keys 0..length-1 are gathered for every row. A hybrid model's
    call also has slots [B] (each row's local slot) and real (how many of a row's Q positions
    its sliding layers append to the slot's window: a prefill chunk's real positions up to
    start + query_position, a decode row's one position)."""

    def __init__(self, rt: HFRuntime, pos: torch.Tensor, tab: torch.Tensor,
                 slots: torch.Tensor | None = None, real: int = 0) -> None:
        self.rt = rt
        b, q = pos.shape
        self.shape = (b, q)
        rows = tab.long()[torch.arange(b).repeat_interleave(q)]              # [B*Q, T]
        self.blk, self.off = block_coords(rows, pos.reshape(-1), rt.block_size)
        self.tab = tab.long()
        # (a padded last chunk may reach past max_seq_len: not stored, not read; block_coords)
        self.length = min(int(pos.max()) + 1, rt.max_seq_len)
        self.kv_index = gather_index(self.tab, self.length, rt.block_size, rt.num_blocks)
        kpos = torch.arange(self.length)
        # [B, 1, Q, L]: key k visible from a query at q iff k <= q (by position, never by where
        # the key is stored, so junk in a block past a sequence's end is masked)
        self.valid = visible(pos.reshape(-1), kpos, None).view(b, 1, q, self.length)
        self.slots = None if slots is None else slots.long()
        if self.slots is not None:
            w = rt.sliding_window
            assert w is not None
            self.start = pos[:, 0].long()
            self.real = real
            # a row's keys: its slot's window as read at its first position, then its own Q
            # positions; [B, 1, Q, W + Q] by position (the window's own mask, the chunk's
            # causal one: a chunk longer than the window masks its own oldest positions)
            lpos = window_key_positions(self.start, pos, w).repeat_interleave(q, dim=0)
            self.local_valid = visible(pos.reshape(-1), lpos, w).view(b, 1, q, w + q)

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float, kwargs: dict[str, Any]) -> torch.Tensor:
        """query [B, H, Q, d], key/value [B, KVH, Q, d] of this call's tokens; [B, Q, H, d]."""
        layer = module.layer_idx
        window = kwargs.get("sliding_window")
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            raise UnsupportedModelError(
                f"layer {layer} asks for attention logit soft-capping or sinks, which "
                "HFRuntime does not implement")
        j = self.rt._store[layer]
        if layer in self.rt._sliding:
            if window != self.rt.sliding_window or self.slots is None:
                raise UnsupportedModelError(
                    f"sliding layer {layer} asks for window {window}, the runtime keeps "
                    f"{self.rt.sliding_window}")
            return self._local(j, query, key, value, scaling)
        if window is not None and window < self.rt.max_seq_len:
            raise UnsupportedModelError(
                f"layer {layer} asks for sliding-window attention (window {window}), "
                "which HFRuntime does not implement for this model")
        b, q = self.shape
        kvh, d = key.shape[1], key.shape[3]
        k_new = key.transpose(1, 2).reshape(b * q, kvh, d)
        v_new = value.transpose(1, 2).reshape(b * q, kvh, d)
        kc, vc = self.rt.k_cache[j], self.rt.v_cache[j]
        write_blocks(kc, self.blk, self.off, k_new)
        write_blocks(vc, self.blk, self.off, v_new)
        # junk past a sequence's end is masked, but NaN * 0 is NaN: make it finite
        k = torch.nan_to_num(gather_at(kc, self.kv_index))
        v = torch.nan_to_num(gather_at(vc, self.kv_index))
        return _softmax_attend(query, k, v, self.valid, scaling)

    def _local(self, j: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """A sliding layer (store j): each row reads its slot's window, attends to it and its
        own keys, then appends its real keys (`append_windows`, every row alike: a padding row
        writes the slot it is aimed at, which the batcher makes an idle lane's)."""
        assert self.slots is not None
        kl, vl = self.rt.k_local[j], self.rt.v_local[j]
        k = torch.cat([torch.nan_to_num(kl[self.slots]), key.to(kl.dtype)], dim=2)
        v = torch.cat([torch.nan_to_num(vl[self.slots]), value.to(vl.dtype)], dim=2)
        out = _softmax_attend(query, k, v, self.local_valid, scaling)
        append_windows(kl, self.slots, self.start, key[:, :, :self.real])
        append_windows(vl, self.slots, self.start, value[:, :, :self.real])
        return out


def _softmax_attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """query [B, H, Q, d] over keys/values [B, KVH, L, d] (grouped-query: each KV head serves
    H / KVH query heads) where valid [B, 1, Q, L]; [B, Q, H, d]."""
    rep = query.shape[1] // k.shape[1]
    k = k.to(query.dtype).repeat_interleave(rep, dim=1)                       # [B, H, L, d]
    v = v.to(query.dtype).repeat_interleave(rep, dim=1)
    scores = (query @ k.transpose(2, 3)) * scaling                           # [B, H, Q, L]
    scores = scores.masked_fill(~valid, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2).contiguous()


_CURRENT: contextvars.ContextVar[_Graph | None] = contextvars.ContextVar("atom_hf_graph",
                                                                        default=None)


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


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No transformers progress bars (a tiny model's save and load take milliseconds)."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


# --- checks ------------------------------------------------------------------------------------

def check_model_config(config: Any, max_seq_len: int) -> None:
    """Raise UnsupportedModelError unless HFRuntime can serve this transformers config."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None) or [mt]
        extra = (" For Gemma3 serve the text model (Gemma3ForCausalLM, a Gemma3TextConfig with "
                 "model_type 'gemma3_text'); the multimodal one is not supported."
                 if mt == "gemma3" else "")
        raise UnsupportedModelError(
            f"model architecture {archs} (model_type '{mt}') is not supported by HFRuntime: "
            f"supported are {sorted(SUPPORTED_MODEL_TYPES.values())}.{extra}")
    kinds = set(getattr(config, "layer_types", None) or [FULL])
    if mt not in HYBRID_MODEL_TYPES and SLIDING in kinds:
        _check_unslid_window(config, mt, sorted(kinds), max_seq_len)
        kinds = (kinds - {SLIDING}) | {FULL}
    allowed = {FULL, SLIDING} if mt in HYBRID_MODEL_TYPES else {FULL}
    if not kinds <= allowed:
        raise UnsupportedModelError(
            f"this {mt} config has attention layer types {sorted(kinds)}: HFRuntime serves "
            f"{mt} models whose layers are {sorted(allowed)} only"
            + ("" if mt in HYBRID_MODEL_TYPES else " (sliding-window layers have local slots "
                                                    "for Gemma3 only)"))
    if mt in HYBRID_MODEL_TYPES:
        _check_hybrid(config, kinds)
    window = getattr(config, "sliding_window", None) if mt == "mistral" else None
    if window is not None and window < max_seq_len:
        raise UnsupportedModelError(
            f"this mistral config has sliding_window={window} < max_seq_len={max_seq_len}: the "
            "paged layout here keeps full attention only; use max_seq_len <= the window or a "
            "config with sliding_window=null")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_seq_len > limit:
        raise UnsupportedModelError(
            f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings={limit}")
    _check_rope(config, max_seq_len)


def _check_unslid_window(config: Any, mt: str, kinds: list[str], max_seq_len: int) -> None:
    """Sliding layers of a model without local slots (Qwen2's, `layer_types`) are served as
    full attention, which they are when the window covers every sequence the server accepts:
    transformers' sliding mask lets the query at q see keys q - W + 1 .. q, and q never
    exceeds max_seq_len - 1, so W >= max_seq_len hides no key (`_Graph.attend` checks each
    call's window against the same bound). A shorter window would need local slots."""
    window = getattr(config, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise UnsupportedModelError(
            f"this {mt} config has attention layer types {kinds} but "
            f"sliding_window={window!r}: "
            "give a positive integer window, or a config without sliding layers "
            "(use_sliding_window=false)")
    if window < max_seq_len:
        raise UnsupportedModelError(
            f"this {mt} config has attention layer types {kinds} with sliding_window="
            f"{window} < max_seq_len={max_seq_len}: HFRuntime keeps local slots (a window "
            f"that slides) for Gemma3 only and serves {mt}'s sliding layers as full attention, "
            f"which they are only while the window covers the sequence; use max_seq_len <= "
            f"{window}, or "
            "a config without sliding layers (use_sliding_window=false)")


def _rope_parameter_sets(config: Any) -> list[dict[str, Any]]:
    """The model's RoPE parameter dicts: one, or (Gemma3) one per layer type. transformers 5
    keeps them in `rope_parameters`; older configs in `rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return []
    if all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [params]


def _check_rope(config: Any, max_seq_len: int) -> None:
    """Refuse a RoPE whose frequencies depend on the call rather than on the position alone.

    transformers' `dynamic_rope_update` picks LongRoPE's frequencies per forward call: the long
    factors when the call's largest position id reaches past `original_max_position_embeddings`,
    else the short ones. Here a prompt is prefilled one chunk per call and every lane decodes in
    one call, so a chunk's keys would be rotated by the short factors while the rest of the
    prompt (and `generate()`, which prefills the prompt in one call) uses the long ones, and a
    lane's rotary frequencies would depend on how long the *other* lanes in its decode batch
    are. Both change tokens (seen on a tiny Llama). With max_seq_len <= the original length
    every call takes the short factors, which is position-only and fine. ("dynamic" NTK grows
    its frequencies only past max_position_embeddings, which max_seq_len never exceeds.)"""
    for params in _rope_parameter_sets(config):
        if params.get("rope_type", params.get("type")) != "longrope":
            continue
        original = params.get("original_max_position_embeddings",
                              getattr(config, "original_max_position_embeddings", None))
        if original is None or int(original) < max_seq_len:
            raise UnsupportedModelError(
                f"this config uses LongRoPE with original_max_position_embeddings={original} < "
                f"max_seq_len={max_seq_len}: transformers switches its rotary frequencies per "
                "forward call on the call's longest position, which chunked prefill and batched "
                "decode cannot reproduce (a chunk, or a lane beside a longer one, would be "
                "rotated differently from generate()); use max_seq_len <= "
                f"{original if original is not None else 'the original length'}")


def _check_hybrid(config: Any, kinds: set[str]) -> None:
    """A Gemma3 text config the local-slot layout can express: causal, both kinds of layer
    (the sliding ones' window in the local slots, the global ones' KV in the blocks)."""
    if SLIDING in kinds and FULL not in kinds:
        raise UnsupportedModelError(
            "this gemma3_text config has only sliding_attention layers: the RBLN layout keeps a "
            "hybrid model's global layers in the blocks and needs at least one full_attention "
            "layer (set layer_types)")
    window = getattr(config, "sliding_window", None)
    if SLIDING in kinds and (isinstance(window, bool) or not isinstance(window, int)
                             or window <= 0):
        raise UnsupportedModelError(
            f"this gemma3_text config has sliding layers but sliding_window={window!r}: give "
            "a positive integer window")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "this gemma3_text config has use_bidirectional_attention=True: HFRuntime serves "
            "causal decoders only")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        # transformers' Gemma3 attention does not pass it to the attention function, so what it
        # should mean here is not defined by the model: refuse rather than guess
        raise UnsupportedModelError(
            "this gemma3_text config sets attn_logit_softcapping, which HFRuntime does not "
            "implement; use a config with attn_logit_softcapping=null")


def _check_complete(path: Path, config: Any, info: dict[str, Any]) -> None:
    """Refuse a checkpoint that lacks weights of the causal LM (`from_pretrained`'s
    `missing_keys`): transformers initializes those at random and only logs it, so a bare
    decoder or a classifier checkpoint of a supported model_type (no `lm_head`) would be served
    as noise, and an oracle built from a copy of the loaded model would agree with it."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        archs = getattr(config, "architectures", None) or [getattr(config, "model_type", None)]
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                          if len(missing) > 5 else "")
        want = SUPPORTED_MODEL_TYPES.get(getattr(config, "model_type", None), "a causal LM")
        raise UnsupportedModelError(
            f"{path}: the checkpoint ({archs}) has no weights for {shown}: transformers would "
            f"initialize them at random; HFRuntime serves complete {want} checkpoints only")


def _check_model_class(model: Any) -> None:
    """Refuse a model of a supported model_type but another class (a classifier, the bare
    decoder): HFRuntime reads a causal LM's next-token logits."""
    want = SUPPORTED_MODEL_TYPES.get(getattr(model.config, "model_type", None))
    got = type(model).__name__
    if got != want:
        raise UnsupportedModelError(
            f"the model is a {got}: HFRuntime serves {want} for model_type "
            f"'{model.config.model_type}' (load it with AutoModelForCausalLM)")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every state-dict entry (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def seed_weights(model: Any, seed: int) -> Any:
    """Overwrite every parameter of `model` from `torch.Generator().manual_seed(seed)`, in name
    order (independent of transformers' own init): norms ~ 1 + N(0, 0.1^2), embeddings ~ N(0, 1),
    other weights and biases ~ N(0, 1/fan_in), so the logits are spread out enough for greedy
    decoding to be a stable check. Returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in sorted(model.named_parameters()):
            x = torch.randn(prm.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                x = 1.0 + 0.1 * x
            elif "embed" not in name:
                x = x / math.sqrt(prm.shape[-1])
            prm.copy_(x)
    return model


# --- the runtime -------------------------------------------------------------------------------

class HFRuntime:
    """A transformers causal LM behind the RBLN runtime interface.

    Build with `from_pretrained(path, config)` (a local checkpoint directory) or
    `tiny_llama(config, seed)` / `tiny_gemma3(config, seed)` (seeded random weights, saved and
    loaded back through `from_pretrained`); `config` is the `atom_core.config.Config` whose
    artifact sizes (lanes, kv_blocks, block_size, max_seq_len, prefill_chunk) the runtime takes.

    Plain models: every layer global, KV in `k_cache`/`v_cache`, `local_block_tables=None`.
    Gemma3 (hybrid): the config's 'sliding_attention' layers keep their KV in `batch_size`
    local slots `k_local[j]`/`v_local[j]` [batch_size, kv_heads, W, head_dim] (one per lane; a
    window as the RBLN kernel keeps it, `atom_core.runtime.paged`, the same code as
    `TorchReferenceRuntime`), `k_cache`/`v_cache` hold the global layers only;
    `uses_local_block_tables` is True, `sliding_window` is W, and the local-slot operations
    (`new_local_host_buffer`, `fetch_local_cache`, `update_local_cache`, `read_local`) work.

    `num_threads`: torch's intra-op threads during each call (restored after it); default
    `DEFAULT_THREADS` ("auto": one for a model under a million parameters, torch's setting
    above, measured by `bench.hf`), None leaves torch's setting.
    """

    uses_local_block_tables = False
    sliding_window: int | None = None

    def __init__(self, model: Any, *, num_blocks: int, block_size: int, max_seq_len: int,
                 prefill_chunk: int, batch_size: int,
                 decoder_batch_sizes: Iterable[int] | None = None,
                 num_threads: int | str | None = DEFAULT_THREADS) -> None:
        cfg = model.config
        check_model_config(cfg, max_seq_len)
        _check_model_class(model)
        dtype = next(model.parameters()).dtype
        _check_dtype(dtype)
        if getattr(cfg, "_attn_implementation", None) != ATTENTION:
            raise UnsupportedModelError(
                f"the model uses attn_implementation={cfg._attn_implementation!r}: load it with "
                f"attn_implementation='{ATTENTION}' (HFRuntime.from_pretrained does)")
        bad = sizes_error(max_seq_len, block_size, prefill_chunk)
        if bad:
            raise ValueError(bad)
        self.model = model.eval()
        self.dtype = dtype
        self.num_threads = threads_for(model, num_threads)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_seq_len, self.prefill_chunk = max_seq_len, prefill_chunk
        self.batch_size = batch_size
        self.decoder_batch_sizes = tuple(sorted({int(b) for b in decoder_batch_sizes or
                                                 (batch_size,)}, reverse=True))
        if self.decoder_batch_sizes[0] != batch_size:
            raise ValueError(f"decoder_batch_sizes={self.decoder_batch_sizes} must have "
                             f"batch_size={batch_size} as the largest")
        self.vocab_size = int(cfg.vocab_size)
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None)
                            or cfg.hidden_size // cfg.num_attention_heads)
        types = list(getattr(cfg, "layer_types", None) or [FULL] * self.layers)
        hybrid = cfg.model_type in HYBRID_MODEL_TYPES and SLIDING in types
        self.sliding_layers = tuple(i for i, t in enumerate(types) if hybrid and t == SLIDING)
        self.global_layers = tuple(i for i in range(self.layers) if i not in self.sliding_layers)
        self._sliding = frozenset(self.sliding_layers)
        self.uses_local_block_tables = hybrid
        self.sliding_window = int(cfg.sliding_window) if hybrid else None
        # layer -> its index in k_cache/v_cache (global) or k_local/v_local (sliding)
        self._store = {layer: j for group in (self.global_layers, self.sliding_layers)
                       for j, layer in enumerate(group)}
        shape = (num_blocks, self.kv_heads, block_size, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype) for _ in self.global_layers]
        self.v_cache = [torch.zeros(shape, dtype=dtype) for _ in self.global_layers]
        local = (batch_size, self.kv_heads, self.sliding_window or 0, self.head_dim)
        self.k_local = [torch.zeros(local, dtype=dtype) for _ in self.sliding_layers]
        self.v_local = [torch.zeros(local, dtype=dtype) for _ in self.sliding_layers]
        self.calls = {"prefill": 0, "decode": 0, "copy": 0, "fetch": 0, "update": 0,
                      "fetch_local": 0, "update_local": 0}
        self._fingerprint: str | None = None

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], config: Config,
                        dtype: torch.dtype = torch.float32, **kw: Any) -> HFRuntime:
        """Load a local checkpoint directory (never the network) for `config`'s artifact."""
        _check_dtype(dtype)
        p = Path(path)
        if not p.is_dir():
            raise ValueError(f"{path}: not a directory (give a local checkpoint directory with "
                             "config.json and the weights)")
        mcfg = AutoConfig.from_pretrained(p, local_files_only=True)
        check_model_config(mcfg, config.max_seq_len)
        model, info = AutoModelForCausalLM.from_pretrained(
            p, local_files_only=True, dtype=dtype, attn_implementation=ATTENTION,
            output_loading_info=True)
        _check_complete(p, mcfg, info)
        return cls.for_config(model, config, **kw)

    @classmethod
    def for_config(cls, model: Any, config: Config, **kw: Any) -> HFRuntime:
        """A runtime of `config`'s artifact sizes over `model` (loaded with
        attn_implementation='atom_paged'). Runtimes may share one model: it holds no KV."""
        return cls(model, num_blocks=config.kv_blocks, block_size=config.block_size,
                   max_seq_len=config.max_seq_len, prefill_chunk=config.prefill_chunk,
                   batch_size=config.lanes, **kw)

    @staticmethod
    def tiny_llama_model(seed: int = 0, *, vocab_size: int = 128, max_position: int = 256,
                         dtype: torch.dtype = torch.float32, **fields: Any) -> Any:
        """A tiny LlamaForCausalLM with weights drawn from `torch.Generator().manual_seed(seed)`
        (2 layers, hidden 64, 4 query and 2 KV heads of head_dim 32 unless `fields` override;
        weights by `seed_weights`)."""
        base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, max_position_embeddings=max_position, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)
        base.update(fields)
        model = seed_weights(LlamaForCausalLM(LlamaConfig(**base)), seed)
        return model.to(dtype)

    @classmethod
    def tiny_llama(cls, config: Config, seed: int = 0, dtype: torch.dtype = torch.float32,
                   vocab_size: int = 128, **fields: Any) -> HFRuntime:
        """`tiny_llama_model(seed)` saved with `save_pretrained` to a temporary directory and
        served from there through `from_pretrained` (the real loading path)."""
        model = cls.tiny_llama_model(seed, vocab_size=vocab_size,
                                     max_position=config.max_seq_len, dtype=dtype, **fields)
        return cls._through_disk(model, config, dtype, "llama")

    @staticmethod
    def tiny_gemma3_model(seed: int = 0, *, sliding_window: int, vocab_size: int = 128,
                          max_position: int = 256, dtype: torch.dtype = torch.float32,
                          **fields: Any) -> Any:
        """A tiny Gemma3ForCausalLM (text) with weights by `seed_weights(seed)`: 3 layers
        (sliding, global, sliding), hidden 64, 4 query and 2 KV heads of head_dim 32,
        query_pre_attn_scalar 24 (not head_dim, so the query scaling is exercised), Gemma3's
        own local and global rotary bases, unless `fields` override. The LM head is not tied
        to the embeddings: tied, Gemma3's embedding scale makes a random model repeat one
        token whatever it attends to, which would check nothing."""
        base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, query_pre_attn_scalar=24, sliding_window=sliding_window,
                    layer_types=[SLIDING, FULL, SLIDING], max_position_embeddings=max_position,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                    eos_token_id=None, pad_token_id=None)
        base.update(fields)
        model = seed_weights(Gemma3ForCausalLM(Gemma3TextConfig(**base)), seed)
        return model.to(dtype)

    @classmethod
    def tiny_gemma3(cls, config: Config, seed: int = 0, dtype: torch.dtype = torch.float32,
                    vocab_size: int = 128, **fields: Any) -> HFRuntime:
        """`tiny_gemma3_model(seed)` with `config.sliding_window` as its window, saved with
        `save_pretrained` to a temporary directory and served from there."""
        if config.sliding_window is None:
            raise ValueError("tiny-gemma3 is a hybrid model: give a Config with sliding_window "
                             "(its sliding layers' window)")
        model = cls.tiny_gemma3_model(seed, sliding_window=config.sliding_window,
                                      vocab_size=vocab_size, max_position=config.max_seq_len,
                                      dtype=dtype, **fields)
        return cls._through_disk(model, config, dtype, "gemma3")

    @classmethod
    def _through_disk(cls, model: Any, config: Config, dtype: torch.dtype,
                      name: str) -> HFRuntime:
        """`model` saved with `save_pretrained` to a temporary directory and served from there
        through `from_pretrained` (the real loading path)."""
        with tempfile.TemporaryDirectory(prefix=f"atom-tiny-{name}-") as tmp, _quiet():
            model.save_pretrained(tmp)
            return cls.from_pretrained(tmp, config, dtype=dtype)

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex of the model config (less bookkeeping fields), the weights and the dtype,
        for `atom_core.pd.payload`: a decode worker refuses KV computed by another model."""
        if self._fingerprint is None:
            cfg = {k: v for k, v in self.model.config.to_dict().items()
                   if not k.startswith("_") and k not in ("transformers_version", "dtype",
                                                          "torch_dtype", "name_or_path")}
            facts = {"runtime": "atom_core.HFRuntime", "config": cfg,
                     "weights": weights_sha256(self.model), "dtype": str(self.dtype)}
            blob = json.dumps(facts, sort_keys=True, default=str).encode()
            self._fingerprint = hashlib.sha256(blob).hexdigest()
        return self._fingerprint

    # --- the device graphs -----------------------------------------------------------------

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, tab: torch.Tensor,
             keep: int | torch.Tensor, slots: torch.Tensor | None = None,
             real: int = 0) -> torch.Tensor:
        # The model sees position ids no larger than max_seq_len - 1. Only the padding of an
        # eager table's last chunk (max_seq_len not a multiple of the chunk) lies past it: those
        # positions store nothing and their outputs are dropped, but transformers' dynamic RoPE
        # (NTK "dynamic", LongRoPE) picks the rotary frequencies of the whole call from its
        # largest position id, so unclamped they would rotate the chunk's real tokens (and,
        # dynamic NTK keeping its state, later calls) differently from generate(). The graph
        # (`_Graph`) keeps the true positions for the masks and the writes.
        position_ids = pos.long().clamp(max=self.max_seq_len - 1)
        token = _CURRENT.set(_Graph(self, pos, tab, slots, real))
        try:
            with torch_threads(self.num_threads), torch.inference_mode():
                out = self.model(input_ids=ids, position_ids=position_ids, use_cache=False,
                                 logits_to_keep=keep)
        finally:
            _CURRENT.reset(token)
        return out.logits.to(self.dtype)

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any) -> torch.Tensor:
        ids, pos, bt, lbt, qp = check_prefill_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables, query_position)
        self.calls["prefill"] += 1
        # the sliding layers append the chunk's real positions only (start .. start + qp), as
        # the kernel's cache_offset says; the global layers write every position like the device
        logits = self._run(ids, pos, bt[None, :], qp.long().view(1), lbt, int(qp) + 1)
        return logits.reshape(1, 1, self.vocab_size)

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> torch.Tensor:
        ids, pos, bt, lbt = check_decode_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables)
        self.calls["decode"] += 1
        b = ids.shape[0]
        slots = None if lbt is None else lbt[:, 0]
        return self._run(ids, pos, bt, 0, slots, 1).reshape(b, 1, self.vocab_size)

    def decode_batch_size(self, busy_rows: Iterable[int]) -> int:
        return smallest_decode_batch(self.decoder_batch_sizes, busy_rows)

    # --- block operations ------------------------------------------------------------------

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        s, d, n = check_copy(src, dst, num_tokens, self.num_blocks, self.block_size)
        self.calls["copy"] += 1
        for cache in (*self.k_cache, *self.v_cache):
            cache[d, :, :n] = cache[s, :, :n]

    def _block_shape(self) -> tuple[int, ...]:
        return (len(self.global_layers), 2, self.kv_heads, self.block_size, self.head_dim)

    def new_host_buffer(self) -> torch.Tensor:
        """[global layers, 2 (K, V), kv_heads, block_size, head_dim] in the model dtype (every
        layer is global unless the model is hybrid)."""
        return torch.zeros(self._block_shape(), dtype=self.dtype)

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        host = check_host(host_tensor, self._block_shape(), self.dtype, "new_host_buffer")
        b = check_block("fetch", block, self.num_blocks)
        self.calls["fetch"] += 1
        copy_to_host(host, self.k_cache, self.v_cache, b)

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        host = check_host(host_tensor, self._block_shape(), self.dtype, "new_host_buffer")
        b = check_block("update", block, self.num_blocks)
        self.calls["update"] += 1
        copy_from_host(host, self.k_cache, self.v_cache, b)

    def read_block(self, block: int) -> torch.Tensor:
        """A copy of block `block`: [global layers, 2 (K, V), kv_heads, block_size, head_dim]."""
        return stack_kv(self.k_cache, self.v_cache,
                        check_block("read_block", block, self.num_blocks))

    # --- local-slot operations (hybrid models) ---------------------------------------------

    def _slot(self, name: str, slot: int) -> int:
        if not self.uses_local_block_tables:
            raise RuntimeInputError(f"{name}: this model has no sliding-window layers, so no "
                                    "local slots")
        return check_slot(name, slot, self.batch_size)

    def _local_shape(self) -> tuple[int, ...]:
        return (len(self.sliding_layers), 2, self.kv_heads, self.sliding_window or 0,
                self.head_dim)

    def new_local_host_buffer(self) -> torch.Tensor:
        """[sliding layers, 2 (K, V), kv_heads, sliding_window, head_dim] in the model dtype:
        one local slot (a window: the last min(p, W) positions in order)."""
        if not self.uses_local_block_tables:
            raise RuntimeInputError("new_local_host_buffer: this model has no sliding-window "
                                    "layers, so no local slots")
        return torch.zeros(self._local_shape(), dtype=self.dtype)

    def fetch_local_cache(self, host_tensor: Any, slot: int) -> None:
        """Copy local slot `slot` (every sliding layer) from the device into `host_tensor`."""
        t = self._slot("fetch_local", slot)
        host = check_host(host_tensor, self._local_shape(), self.dtype, "new_local_host_buffer")
        self.calls["fetch_local"] += 1
        copy_to_host(host, self.k_local, self.v_local, t)

    def update_local_cache(self, host_tensor: Any, slot: int) -> None:
        """Copy `host_tensor` (from `fetch_local_cache`) into local slot `slot` on the device."""
        t = self._slot("update_local", slot)
        host = check_host(host_tensor, self._local_shape(), self.dtype, "new_local_host_buffer")
        self.calls["update_local"] += 1
        copy_from_host(host, self.k_local, self.v_local, t)

    def read_local(self, slot: int) -> torch.Tensor:
        """A copy of local slot `slot`: [sliding layers, 2 (K, V), kv_heads, W, head_dim]."""
        return stack_kv(self.k_local, self.v_local, self._slot("read_local", slot))


# --- serving -----------------------------------------------------------------------------------

TINY_LLAMA = "tiny-llama"
TINY_GEMMA3 = "tiny-gemma3"
TINY_MODELS = (TINY_LLAMA, TINY_GEMMA3)
# tiny-gemma3's window when the configuration names none: shorter than a prefill chunk (64), so
# the local slots decide the tokens of any but the shortest prompts
TINY_GEMMA3_WINDOW = 32


def model_window(model: str) -> int | None:
    """The sliding window a model's Config must carry: tiny-gemma3's default, a local Gemma3
    checkpoint's `sliding_window` (when it has sliding layers), else None."""
    if model == TINY_GEMMA3:
        return TINY_GEMMA3_WINDOW
    if model == TINY_LLAMA or not Path(model, "config.json").is_file():
        return None
    mcfg = AutoConfig.from_pretrained(model, local_files_only=True)
    hybrid = getattr(mcfg, "model_type", None) in HYBRID_MODEL_TYPES \
        and SLIDING in (getattr(mcfg, "layer_types", None) or ())
    return int(mcfg.sliding_window) if hybrid else None


def with_model_window(cfg: Config, model: str) -> Config:
    """`cfg` with the model's sliding window when it names none (a hybrid model's batcher
    needs it); a window it names is kept, and the batcher refuses one that differs."""
    window = model_window(model)
    if window is None or cfg.sliding_window is not None:
        return cfg
    return attrs.evolve(cfg, sliding_window=window)


def tiny_model(model: str, max_seq_len: int, *, window: int | None = None, seed: int = 0,
               dtype: torch.dtype = torch.float32, vocab_size: int = 128) -> Any:
    """The model of `tiny-llama` (window None) or `tiny-gemma3` (its sliding window), saved with
    `save_pretrained` and loaded back with the paged attention, for `HFRuntime.for_config`
    (several runtimes of one model, e.g. both sides of a simulated PD pair)."""
    if model == TINY_GEMMA3:
        if window is None:
            raise ValueError("tiny-gemma3 is a hybrid model: give its sliding window")
        m = HFRuntime.tiny_gemma3_model(seed, sliding_window=window, vocab_size=vocab_size,
                                        max_position=max_seq_len, dtype=dtype)
    elif model == TINY_LLAMA:
        m = HFRuntime.tiny_llama_model(seed, vocab_size=vocab_size, max_position=max_seq_len,
                                       dtype=dtype)
    else:
        raise ValueError(f"unknown tiny model {model!r}: one of {TINY_MODELS}")
    with tempfile.TemporaryDirectory(prefix=f"atom-{model}-") as tmp, _quiet():
        m.save_pretrained(tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True, dtype=dtype,
                                                    attn_implementation=ATTENTION)


def tiny_runtime(model: str, cfg: Config, seed: int, dtype: torch.dtype = torch.float32,
                 vocab_size: int = 128) -> HFRuntime:
    """`tiny-llama` or `tiny-gemma3` for `cfg` (give a hybrid one `with_model_window`)."""
    if model == TINY_GEMMA3:
        return HFRuntime.tiny_gemma3(cfg, seed=seed, dtype=dtype, vocab_size=vocab_size)
    if model == TINY_LLAMA:
        return HFRuntime.tiny_llama(cfg, seed=seed, dtype=dtype, vocab_size=vocab_size)
    raise ValueError(f"unknown tiny model {model!r}: one of {TINY_MODELS}")


def serve_factory(opts: ServeOptions) -> tuple[Config, HFRuntime, Any]:
    """`atom-core serve --runtime hf --model DIR|tiny-llama|tiny-gemma3`: (Config, runtime,
    tokenizer). A Gemma3 model's Config gets the model's window unless it names one."""
    from atom_core.serve.runtimes import TINY_DEFAULTS, config_for, tokenizer_for
    from atom_core.serve.tokenizer import ByteTokenizer

    cfg = with_model_window(config_for(opts, TINY_DEFAULTS if opts.rbln_config is None
                                       else None), opts.model)
    if opts.model in TINY_MODELS:
        tok: Any = ByteTokenizer()
        return cfg, tiny_runtime(opts.model, cfg, opts.seed, vocab_size=tok.vocab_size), tok
    tok = tokenizer_for(opts.model)
    check_tokenizer(tok, opts.model)  # before the model is loaded and its KV allocated
    rt = HFRuntime.from_pretrained(opts.model, cfg)
    _end_where_generate_ends(tok, rt.model, opts.model)
    return cfg, rt, tok


def model_end_ids(model: Any) -> list[int]:
    """The ids transformers' generate() ends a sequence at: the loaded model's
    generation_config (generation_config.json, or config.json's eos_token_id when a checkpoint
    has no generation_config.json: transformers derives it from the model config)."""
    from atom_core.serve.tokenizer import id_list

    return id_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def _end_where_generate_ends(tok: Any, model: Any, where: str | os.PathLike[str]) -> None:
    """Make the served replies end at every id generate() ends at. The tokenizer reads
    generation_config.json only, so a checkpoint without it whose config.json lists several
    end ids (Llama 3's <|end_of_text|> and <|eot_id|>) would run past the second one to
    max_tokens. Ids outside the vocabulary are refused (`check_end_tokens`)."""
    ends = model_end_ids(model)
    check_end_tokens(ends, int(model.config.vocab_size), f"{where}: the model's eos_token_id")
    from atom_core.serve.tokenizer import end_ids

    missing = frozenset(ends) - set(end_ids(tok))
    if missing and hasattr(tok, "end_token_ids"):
        tok.end_token_ids = frozenset(tok.end_token_ids) | missing


def check_tokenizer(tok: Any, model: str | os.PathLike[str]) -> None:
    """Refuse a tokenizer whose end tokens the model directory's model cannot emit (ids at or
    past its config's vocab_size): generation would never stop on them."""
    mcfg = AutoConfig.from_pretrained(model, local_files_only=True)
    vocab = getattr(mcfg, "vocab_size", None)
    if vocab is None and hasattr(mcfg, "get_text_config"):
        vocab = getattr(mcfg.get_text_config(), "vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        from atom_core.serve.tokenizer import end_ids

        check_end_tokens(end_ids(tok), vocab, f"{model}: the tokenizer")


class GenerateOracle:
    """transformers' own greedy `generate(do_sample=False)` on a copy of a runtime's model with
    transformers' default attention (no block tables, its own cache), memoised by prompt; the
    same `generate(prompt, n, eos)` as `atom_core.demo.Oracle`."""

    def __init__(self, rt: HFRuntime, attn_implementation: str = "sdpa") -> None:
        self.model = copy.deepcopy(rt.model)
        self.model.set_attn_implementation(attn_implementation)
        self.max_seq_len = rt.max_seq_len
        self.num_threads = rt.num_threads  # the runtime's: the same cost per call
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def generate(self, prompt: Iterable[int], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[int]:
        key = tuple(int(t) for t in prompt)
        if eos_token_id is not None:
            check_end_tokens(eos_token_id, int(self.model.config.vocab_size), "generate")
        # the batcher ends a sequence whose last token's KV would not fit: at most
        # max_seq_len - len(prompt) + 1 tokens (as `atom_core.demo.Oracle`)
        need = min(max_new_tokens, self.max_seq_len - len(key) + 1)
        have = self._memo.get(key, [])
        if len(have) < need:
            ids = torch.tensor([key])
            with torch_threads(self.num_threads), torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=need, min_new_tokens=need,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
            have = out[0, len(key):].tolist()
            self._memo[key] = have
        cut = have[:max_new_tokens]
        if eos_token_id is not None and eos_token_id in cut:
            cut = cut[:cut.index(eos_token_id) + 1]
        return cut
