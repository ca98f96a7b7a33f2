"""A runtime over a Hugging Face transformers causal LM, with RBLN graph semantics.

`HFRuntime` drives a real `transformers` model (Llama, Mistral, Qwen2: decoder-only models whose
attention goes through transformers' attention-function registry) behind the same interface as
`TorchReferenceRuntime`: B=1 chunked prefill and B-row decode through the batcher's int16 block
tables, KV per layer in `[num_blocks, kv_heads, block_size, head_dim]` (`atom_core.runtime.paged`,
shared with the reference runtime).

How: the model is loaded with `attn_implementation="atom_paged"`, an attention function registered
through transformers' public `AttentionInterface`. The model computes q, k, v (projections, rotary
embedding at the given `position_ids`) as it always does and hands them to that function, which
writes k and v through the block tables and attends over the gathered keys, masked by position
(causal: a key is visible when its position is <= the query's). The model is called without a
transformers cache (`use_cache=False`), so the paged cache is the only KV there is. No model
source is patched; the registry lookup happens at every attention call, so a model built with
another attention implementation is not affected.

Like the device, every computed position writes its KV: the padding positions of a prefill chunk
and the padding rows of a decode (which the batcher aims at the scratch block). Attention runs in
the model's dtype (float32 or float64): the result equals transformers' own attention up to
floating-point rounding (not bit for bit; the tests compare greedy tokens at steps whose top-1 /
top-2 logit gap is far above that rounding, and float32 logits with a tolerance).

Refused, each with a message: architectures other than the supported ones (notably Gemma3: its
sliding-window layers need the local-slot state, not built here yet), configs with
sliding-window layers or a window shorter than `max_seq_len`, dtypes other than float32/float64,
and a `max_seq_len` beyond the model's `max_position_embeddings`.

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

import torch

from atom_core.runtime.paged import block_coords, gather_blocks, write_blocks
from atom_core.runtime.protocol import (
    RuntimeInputError,
    check_block,
    check_copy,
    check_decode_inputs,
    check_prefill_inputs,
    smallest_decode_batch,
)
from atom_core.runtime.reference import _threads

# offline before transformers is imported (it reads the variable at import time)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.utils import logging as hf_logging  # noqa: E402

if TYPE_CHECKING:
    from atom_core.config import Config
    from atom_core.serve.runtimes import ServeOptions

__all__ = ["ATTENTION", "SUPPORTED_MODEL_TYPES", "GenerateOracle", "HFRuntime",
           "UnsupportedModelError", "seed_weights", "serve_factory"]

ATTENTION = "atom_paged"
# model_type -> what it is; each uses the standard attention interface like Llama
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM"}
DTYPES = (torch.float32, torch.float64)


class UnsupportedModelError(ValueError):
    """A model (architecture, attention type, window, dtype) this runtime cannot serve."""


# --- the attention function --------------------------------------------------------------------

class _Graph:
    """One prefill or decode call: where each computed position's KV goes and what it sees.

    pos [B, Q] positions of the B*Q computed tokens; tab [B, T] each row's block table (a
    prefill has B = 1); length: keys 0..length-1 are gathered for every row."""

    def __init__(self, rt: HFRuntime, pos: torch.Tensor, tab: torch.Tensor) -> None:
        self.rt = rt
        b, q = pos.shape
        self.shape = (b, q)
        rows = tab.long()[torch.arange(b).repeat_interleave(q)]              # [B*Q, T]
        self.blk, self.off = block_coords(rows, pos.reshape(-1), rt.block_size)
        self.tab = tab.long()
        self.length = int(pos.max()) + 1
        kpos = torch.arange(self.length)
        # [B, 1, Q, L]: key k visible from a query at q iff k <= q (by position, never by where
        # the key is stored, so junk in a block past a sequence's end is masked)
        self.valid = (kpos[None, None, :] <= pos.long()[:, :, None])[:, None]

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float, kwargs: dict[str, Any]) -> torch.Tensor:
        """query [B, H, Q, d], key/value [B, KVH, Q, d] of this call's tokens; [B, Q, H, d]."""
        window = kwargs.get("sliding_window")
        if window is not None and window < self.rt.max_seq_len:
            raise UnsupportedModelError(
                f"layer {module.layer_idx} asks for sliding-window attention (window {window}), "
                "which HFRuntime does not implement")
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            raise UnsupportedModelError(
                f"layer {module.layer_idx} asks for attention logit soft-capping or sinks, which "
                "HFRuntime does not implement")
        j = module.layer_idx
        b, q = self.shape
        kvh, d = key.shape[1], key.shape[3]
        k_new = key.transpose(1, 2).reshape(b * q, kvh, d)
        v_new = value.transpose(1, 2).reshape(b * q, kvh, d)
        kc, vc = self.rt.k_cache[j], self.rt.v_cache[j]
        write_blocks(kc, self.blk, self.off, k_new)
        write_blocks(vc, self.blk, self.off, v_new)
        # junk past a sequence's end is masked, but NaN * 0 is NaN: make it finite
        k = torch.nan_to_num(gather_blocks(kc, self.tab, self.length, self.rt.block_size))
        v = torch.nan_to_num(gather_blocks(vc, self.tab, self.length, self.rt.block_size))
        rep = query.shape[1] // kvh
        k = k.to(query.dtype).repeat_interleave(rep, dim=1)                   # [B, H, L, d]
        v = v.to(query.dtype).repeat_interleave(rep, dim=1)
        scores = (query @ k.transpose(2, 3)) * scaling                       # [B, H, Q, L]
        scores = scores.masked_fill(~self.valid, -math.inf)
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
        extra = (" Gemma3's sliding-window layers need the local-slot state, which this runtime "
                 "does not implement yet." if mt and mt.startswith("gemma") else "")
        raise UnsupportedModelError(
            f"model architecture {archs} (model_type '{mt}') is not supported by HFRuntime: "
            f"supported are {sorted(SUPPORTED_MODEL_TYPES.values())}.{extra}")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UnsupportedModelError(
            f"this {mt} config has attention layer types {sorted(kinds)}: HFRuntime serves only "
            "models whose every layer is 'full_attention' (sliding-window layers need the "
            "local-slot state, not implemented here)")
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
    """A transformers causal LM behind the RBLN runtime interface (plain models: no local slots).

    Build with `from_pretrained(path, config)` (a local checkpoint directory) or
    `tiny_llama(config, seed)` (seeded random weights, saved and loaded back through
    `from_pretrained`); `config` is the `atom_core.config.Config` whose artifact sizes (lanes,
    kv_blocks, block_size, max_seq_len, prefill_chunk) the runtime takes.
    """

    uses_local_block_tables = False

    def __init__(self, model: Any, *, num_blocks: int, block_size: int, max_seq_len: int,
                 prefill_chunk: int, batch_size: int,
                 decoder_batch_sizes: Iterable[int] | None = None,
                 num_threads: int | None = None) -> None:
        cfg = model.config
        check_model_config(cfg, max_seq_len)
        dtype = next(model.parameters()).dtype
        _check_dtype(dtype)
        if getattr(cfg, "_attn_implementation", None) != ATTENTION:
            raise UnsupportedModelError(
                f"the model uses attn_implementation={cfg._attn_implementation!r}: load it with "
                f"attn_implementation='{ATTENTION}' (HFRuntime.from_pretrained does)")
        if max_seq_len % block_size or max_seq_len % prefill_chunk:
            raise ValueError(f"max_seq_len={max_seq_len} must be a multiple of block_size="
                             f"{block_size} and prefill_chunk={prefill_chunk}")
        self.model = model.eval()
        self.dtype = dtype
        self.num_threads = num_threads
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
        shape = (num_blocks, self.kv_heads, block_size, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype) for _ in range(self.layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype) for _ in range(self.layers)]
        self.calls = {"prefill": 0, "decode": 0, "copy": 0, "fetch": 0, "update": 0}
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
        model = AutoModelForCausalLM.from_pretrained(
            p, local_files_only=True, dtype=dtype, attn_implementation=ATTENTION)
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
        with tempfile.TemporaryDirectory(prefix="atom-tiny-llama-") as tmp, _quiet():
            model.save_pretrained(tmp)
            return cls.from_pretrained(tmp, config, dtype=dtype)

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex of the model config (less bookkeeping fields), the weights and the dtype,
        for `atom_core.pd`: a decode worker refuses KV computed by another model."""
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
             keep: int | torch.Tensor) -> torch.Tensor:
        token = _CURRENT.set(_Graph(self, pos, tab))
        try:
            with _threads(self.num_threads), torch.inference_mode():
                out = self.model(input_ids=ids, position_ids=pos.long(), use_cache=False,
                                 logits_to_keep=keep)
        finally:
            _CURRENT.reset(token)
        return out.logits.to(self.dtype)

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any) -> torch.Tensor:
        ids, pos, bt, _lbt, qp = check_prefill_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables, query_position)
        self.calls["prefill"] += 1
        logits = self._run(ids, pos, bt[None, :], qp.long().view(1))
        return logits.reshape(1, 1, self.vocab_size)

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> torch.Tensor:
        ids, pos, bt, _lbt = check_decode_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables)
        self.calls["decode"] += 1
        b = ids.shape[0]
        return self._run(ids, pos, bt, 0).reshape(b, 1, self.vocab_size)

    def decode_batch_size(self, busy_rows: Iterable[int]) -> int:
        return smallest_decode_batch(self.decoder_batch_sizes, busy_rows)

    # --- block operations ------------------------------------------------------------------

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        s, d, n = check_copy(src, dst, num_tokens, self.num_blocks, self.block_size)
        self.calls["copy"] += 1
        for cache in (*self.k_cache, *self.v_cache):
            cache[d, :, :n] = cache[s, :, :n]

    def _block_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    def new_host_buffer(self) -> torch.Tensor:
        """[layers, 2 (K, V), kv_heads, block_size, head_dim] in the model dtype."""
        return torch.zeros(self._block_shape(), dtype=self.dtype)

    def _host(self, host_tensor: Any) -> torch.Tensor:
        shape = self._block_shape()
        if not isinstance(host_tensor, torch.Tensor) or tuple(host_tensor.shape) != shape \
                or host_tensor.dtype != self.dtype:
            got = (list(host_tensor.shape), host_tensor.dtype) \
                if isinstance(host_tensor, torch.Tensor) else type(host_tensor).__name__
            raise RuntimeInputError(f"host tensor must be {self.dtype} {list(shape)} "
                                    f"(new_host_buffer()), got {got}")
        return host_tensor

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        host = self._host(host_tensor)
        b = check_block("fetch", block, self.num_blocks)
        self.calls["fetch"] += 1
        for j in range(self.layers):
            host[j, 0].copy_(self.k_cache[j][b])
            host[j, 1].copy_(self.v_cache[j][b])

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        host = self._host(host_tensor)
        b = check_block("update", block, self.num_blocks)
        self.calls["update"] += 1
        for j in range(self.layers):
            self.k_cache[j][b].copy_(host[j, 0])
            self.v_cache[j][b].copy_(host[j, 1])

    def read_block(self, block: int) -> torch.Tensor:
        """A copy of block `block`: [layers, 2 (K, V), kv_heads, block_size, head_dim]."""
        b = check_block("read_block", block, self.num_blocks)
        return torch.stack([torch.stack([self.k_cache[j][b], self.v_cache[j][b]])
                            for j in range(self.layers)])


# --- serving -----------------------------------------------------------------------------------

TINY_LLAMA = "tiny-llama"


def serve_factory(opts: ServeOptions) -> tuple[Config, HFRuntime, Any]:
    """`atom-core serve --runtime hf --model DIR|tiny-llama`: (Config, runtime, tokenizer)."""
    from atom_core.serve.runtimes import TINY_DEFAULTS, config_for, tokenizer_for
    from atom_core.serve.tokenizer import ByteTokenizer

    cfg = config_for(opts, TINY_DEFAULTS if opts.rbln_config is None else None)
    if opts.model == TINY_LLAMA:
        tok: Any = ByteTokenizer()
        return cfg, HFRuntime.tiny_llama(cfg, seed=opts.seed, vocab_size=tok.vocab_size), tok
    return cfg, HFRuntime.from_pretrained(opts.model, cfg), tokenizer_for(opts.model)


class GenerateOracle:
    """transformers' own greedy `generate(do_sample=False)` on a copy of a runtime's model with
    transformers' default attention (no block tables, its own cache), memoised by prompt; the
    same `generate(prompt, n, eos)` as `atom_core.demo.Oracle`."""

    def __init__(self, rt: HFRuntime, attn_implementation: str = "sdpa") -> None:
        self.model = copy.deepcopy(rt.model)
        self.model.set_attn_implementation(attn_implementation)
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def generate(self, prompt: Iterable[int], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[int]:
        key = tuple(int(t) for t in prompt)
        have = self._memo.get(key, [])
        if len(have) < max_new_tokens:
            ids = torch.tensor([key])
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=max_new_tokens,
                                          min_new_tokens=max_new_tokens, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
            have = out[0, len(key):].tolist()
            self._memo[key] = have
        cut = have[:max_new_tokens]
        if eos_token_id is not None and eos_token_id in cut:
            cut = cut[:cut.index(eos_token_id) + 1]
        return cut
