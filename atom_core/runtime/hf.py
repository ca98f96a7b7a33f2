"""A runtime over a Hugging Face transformers causal LM, behind the RBLN runtime interface.

`HFRuntime` drives a real `transformers` model (Llama, Mistral, Qwen2: decoder-only models whose
attention goes through transformers' attention-function registry; Gemma3 text, the hybrid
sliding-window model) behind the same interface as `TorchReferenceRuntime`: chunked prefill
and decode through the batcher's int16 block tables, KV per global layer in
`[num_blocks, kv_heads, block_size, head_dim]` (stored head-major, `__init__`) and, for Gemma3's
sliding layers, in lane-local window slots `[batch_size, kv_heads, W, head_dim]` addressed by
`local_block_tables` (`atom_core.runtime.paged`, shared with the reference runtime).

It has no static shapes, and says so (the capabilities of `protocol.py`): `static_batch` is
False (a decode call computes the rows it is given, any count up to batch_size: the batcher
gives it the live rows only) and `mixed_calls` True (`mixed`: a decode and prompt chunks of
several lanes in one forward, the real tokens of each chunk only). `HFRuntime(...,
static_batch=True, mixed_calls=False)` keeps RBLN's shapes instead: every decode row computed,
padding rows included (aimed at the scratch block), one chunk per prefill call, every position
of a padded chunk written, like the device.

How: the model is loaded with `attn_implementation="atom_paged"`, an attention function
registered through transformers' public `AttentionInterface` (`atom_core.runtime.hf_attention`).
Each call runs the model once over its tokens packed in one row, with their positions. The model
computes q, k, v (projections, its norms, rotary embedding at the given `position_ids`:
Gemma3's separate local and global rotary bases included) as it always does and hands them to
that function with its own scaling (Gemma3's `query_pre_attn_scalar`), which writes k and v
through the block tables and attends with `scaled_dot_product_attention` over each row's keys
(gathered with one index per call, built once), masked by position (causal: a key is visible
when its position is <= the query's). A sliding layer instead reads the row's local window,
attends to it and the call's own keys under transformers' Gemma3 sliding mask (position q sees
q - W + 1 .. q) and appends the row's real positions to the window. The model is called without a
transformers cache (`use_cache=False`), so the paged cache and the slots are the only KV there
is. No model source is patched; the registry lookup happens at every attention call, so a model
built with another attention implementation is not affected.

Attention runs in the model's dtype (float32 or float64): the result equals transformers' own
attention up to floating-point rounding (not bit for bit; the tests compare greedy tokens at
steps whose top-1 / top-2 logit gap is far above that rounding, and float32 logits with a
tolerance).

Refused, each with a message: architectures other than the supported ones (the multimodal
Gemma3 among them), sliding-window layers in a model other than Gemma3 whose window is shorter
than `max_seq_len` (Qwen2's sliding layers, a Mistral window; one at least as long is full
attention for every sequence served, and is served so), a Gemma3 config with no global layer, a
non-positive window, bidirectional attention or attention soft-capping, dtypes other than
float32/float64, a `max_seq_len` beyond the model's `max_position_embeddings`, LongRoPE with an
original length below `max_seq_len` (its frequencies change per call), a checkpoint lacking any
weight of the causal LM (a bare decoder's or a classifier's: transformers would initialize the
LM head at random) and a model of another class than the supported causal LM (the checks:
`atom_core.runtime.hf_checks`).

Nothing touches the network: loading is `from_pretrained(path, local_files_only=True)` and the
hub is set offline (`HF_HUB_OFFLINE=1`) when this module is imported.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from atom_core.config import check_end_tokens
from atom_core.runtime.paged import (
    check_host,
    copy_from_host,
    copy_to_host,
    stack_kv,
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
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from atom_core.runtime.hf_attention import (  # noqa: E402
    ATTENTION,
    CallGraph,
    Group,
    UnsupportedModelError,
    current,
)
from atom_core.runtime.hf_checks import (  # noqa: E402
    FULL,
    HYBRID_MODEL_TYPES,
    SLIDING,
    SUPPORTED_MODEL_TYPES,
    _check_complete,
    _check_dtype,
    _check_model_class,
    check_model_config,
)

if TYPE_CHECKING:
    from atom_core.config import Config

__all__ = ["ATTENTION", "DEFAULT_THREADS", "SMALL_MODEL_PARAMETERS", "SUPPORTED_MODEL_TYPES",
           "TINY_MODELS", "GenerateOracle", "HFRuntime", "UnsupportedModelError", "seed_weights",
           "threads_for", "tiny_model", "tiny_runtime", "with_model_window"]

# torch intra-op threads during a prefill/decode call (None: torch's own setting). "auto": one
# for a model below SMALL_MODEL_PARAMETERS; above, one core fewer than the machine has (at least
# one, at most torch's setting), leaving a core to the server's event loop and its clients.
# Measured on a shared 2-core machine: the tiny test models (~0.1M parameters) ran 7 to 20 times
# slower with torch's default of 2 threads (`bench.hf`: a hand-off costs more than a [B, 64]
# matmul saves); the 26M-parameter Llama of `bench.hf_call` (issue 50) took 21 ms per 1-row and
# 44 ms per 16-row decode call with one thread, 300 ms and 1.9 s with two beside other jobs (the
# second thread waits for a core another process holds), and a server beside its clients keeps
# one core busy with HTTP. Larger machines: not measured here; pass num_threads to choose.
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
    if size < SMALL_MODEL_PARAMETERS:
        return 1
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - 1))


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
    `DEFAULT_THREADS` ("auto": one for a model under a million parameters, one core fewer than
    the machine's above, measured by `bench.hf` and `bench.hf_call`), None leaves torch's
    setting. `static_batch`, `mixed_calls`: the capabilities (module docstring; default: no
    static shapes). `mixed_prefill_tokens`: a mixed step's prompt tokens at most (default one
    chunk).
    """

    uses_local_block_tables = False
    sliding_window: int | None = None
    # the capabilities of a runtime without static shapes (protocol.py): a decode call
    # computes the rows it is given (the batcher gives it the live rows only), and a step with
    # prompt chunks runs them beside the decode in one forward (`mixed`)
    static_batch = False
    mixed_calls = True
    # a prefill (or a mixed call's prefill) can return every real token's logits from the
    # forward that writes its KV (`all_logits`: prompt logprobs)
    prompt_logits = True

    def __init__(self, model: Any, *, num_blocks: int, block_size: int, max_seq_len: int,
                 prefill_chunk: int, batch_size: int,
                 decoder_batch_sizes: Iterable[int] | None = None,
                 num_threads: int | str | None = DEFAULT_THREADS,
                 static_batch: bool = False, mixed_calls: bool = True,
                 mixed_prefill_tokens: int | None = None) -> None:
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
        self.static_batch, self.mixed_calls = bool(static_batch), bool(mixed_calls)
        # a mixed step's prompt tokens at most (the scheduler's `prefill_tokens`; at least one
        # chunk always runs): one chunk by default (`bench.hf_serve` measured the choice)
        self.mixed_prefill_tokens = prefill_chunk if mixed_prefill_tokens is None \
            else int(mixed_prefill_tokens)
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
        # each global layer's cache is stored head-major [kv_heads, num_blocks, block_size,
        # head_dim] and kept as its [num_blocks, kv_heads, ...] view, the layout of the block
        # operations and host buffers: a call gathers its rows' blocks with one index_select of
        # the storage, already in the order attention reads (`hf_attention`; a gather of the
        # block-major layout needs a transposing copy, which cost 5-8 times more)
        store = (self.kv_heads, num_blocks, block_size, self.head_dim)
        self.k_cache = [torch.zeros(store, dtype=dtype).transpose(0, 1)
                        for _ in self.global_layers]
        self.v_cache = [torch.zeros(store, dtype=dtype).transpose(0, 1)
                        for _ in self.global_layers]
        local = (batch_size, self.kv_heads, self.sliding_window or 0, self.head_dim)
        self.k_local = [torch.zeros(local, dtype=dtype) for _ in self.sliding_layers]
        self.v_local = [torch.zeros(local, dtype=dtype) for _ in self.sliding_layers]
        self.calls = {"prefill": 0, "decode": 0, "mixed": 0, "copy": 0, "fetch": 0,
                      "update": 0,
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

    # --- the calls -------------------------------------------------------------------------

    def _run(self, groups: list[Group], ids: torch.Tensor,
             keep: int | torch.Tensor) -> torch.Tensor:
        """One forward over the groups' tokens packed in one row (ids: the groups' tokens in
        order, `hf_attention`); logits [K, V] of the packed positions `keep` (0: all)."""
        pos = torch.cat([g.pos.reshape(-1) for g in groups])
        # The model sees position ids no larger than max_seq_len - 1. Only the padding of an
        # eager table's last chunk (max_seq_len not a multiple of the chunk) lies past it: those
        # positions store nothing and their outputs are dropped, but transformers' dynamic RoPE
        # (NTK "dynamic", LongRoPE) picks the rotary frequencies of the whole call from its
        # largest position id, so unclamped they would rotate the chunk's real tokens (and,
        # dynamic NTK keeping its state, later calls) differently from generate(). The call
        # graph keeps the true positions for the masks and the writes.
        position_ids = pos.long().clamp(max=self.max_seq_len - 1)[None, :]
        var = current()
        token = var.set(CallGraph(self, groups))
        try:
            with torch_threads(self.num_threads), torch.inference_mode():
                out = self.model(input_ids=ids.reshape(1, -1), position_ids=position_ids,
                                 use_cache=False, logits_to_keep=keep)
        finally:
            var.reset(token)
        return out.logits[0].to(self.dtype)

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any, *,
                all_logits: bool = False) -> torch.Tensor:
        """Logits [1, 1, V] of the chunk's last real token; `all_logits`: [1, qp + 1, V], of
        each real token (the `prompt_logits` capability), from this one forward."""
        ids, pos, bt, lbt, qp = check_prefill_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables, query_position)
        self.calls["prefill"] += 1
        # the sliding layers append the chunk's real positions only (start .. start + qp), as
        # the kernel's cache_offset says; the global layers write every position like the device
        keep = torch.arange(int(qp) + 1) if all_logits else qp.long().view(1)
        logits = self._run([Group(pos, bt[None, :], lbt, int(qp) + 1)], ids, keep)
        return logits.reshape(1, keep.numel(), self.vocab_size)

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> torch.Tensor:
        """Every row given is computed. Not `static_batch`: any row count 1..batch_size (the
        batcher gives the live rows only); else one of `decoder_batch_sizes`."""
        ids, pos, bt, lbt = check_decode_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables,
            any_rows=not self.static_batch)
        self.calls["decode"] += 1
        b = ids.shape[0]
        slots = None if lbt is None else lbt[:, 0]
        return self._run([Group(pos, bt, slots, 1)], ids, 0).reshape(b, 1, self.vocab_size)

    def mixed(self, decode: Sequence[Any] | None, prefills: Sequence[Sequence[Any]], *,
              all_logits: Sequence[bool] | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | list[torch.Tensor]]:
        """A decode and prompt chunks of other lanes in one forward (`mixed_calls`; the
        batcher's `MixedCall`). `decode`: `decode`'s arguments (R rows, any R from 1 to
        batch_size) or None; each prefill: `prefill`'s arguments (the chunk padded to
        prefill_chunk, its last real token at query_position), of which only the real tokens
        are computed (a padding position's KV is junk past the sequence's end either way).
        Returns (the decode's logits [R, 1, V] or None, the chunks' last real tokens' logits
        [P, 1, V]). The rows read and write disjoint lanes' blocks and slots (the scheduler's
        `MixedCall` guarantees it), so each part's logits and writes are those of its own call.
        `all_logits` (one flag per prefill): a flagged prefill's logits are those of each of its
        real tokens, and the prefills' logits a list of P tensors ([1, real tokens, V] flagged,
        [1, 1, V] the others) instead of [P, 1, V].
        """
        flags = list(all_logits) if all_logits is not None else [False] * len(prefills)
        if len(flags) != len(prefills):
            raise RuntimeInputError(f"all_logits has {len(flags)} flags for {len(prefills)} "
                                    "prefills: give one per prefill")
        groups: list[Group] = []
        ids: list[torch.Tensor] = []
        keep: list[int] = []
        rows = 0
        if decode is not None:
            d_ids, pos, bt, lbt = check_decode_inputs(self, *decode, any_rows=True)
            rows = d_ids.shape[0]
            groups.append(Group(pos, bt, None if lbt is None else lbt[:, 0], 1))
            ids.append(d_ids.reshape(-1))
            keep += range(rows)
        n = rows
        kept: list[int] = []  # each prefill's logits rows among those kept
        for args, every in zip(prefills, flags, strict=True):
            p_ids, pos, bt, lbt, qp = check_prefill_inputs(self, *args)
            real = int(qp) + 1
            groups.append(Group(pos[:, :real], bt[None, :], lbt, real))
            ids.append(p_ids[0, :real])
            keep += range(n, n + real) if every else [n + real - 1]
            kept.append(real if every else 1)
            n += real
        if not groups:
            raise RuntimeInputError("mixed() with neither a decode nor a prefill: nothing to run")
        # `calls` counts the work by kind (a chunk is a "prefill" and a decode a "decode"
        # whichever call runs it) and the forwards that ran several parts as "mixed"
        self.calls["mixed"] += 1
        self.calls["prefill"] += len(prefills)
        self.calls["decode"] += decode is not None
        logits = self._run(groups, torch.cat(ids), torch.tensor(keep))
        v = self.vocab_size
        head = logits[:rows].reshape(rows, 1, v) if decode is not None else None
        if not any(flags):
            return head, logits[rows:].reshape(len(prefills), 1, v)
        return head, [x[None] for x in torch.split(logits[rows:], kept)]

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
