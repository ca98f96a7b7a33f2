"""Binding of real `rebel.Runtime` graphs (an optimum-rbln compiled decoder) to `Runtime`.

An optimum-rbln decoder directory holds `prefill.rbln` and one `decoder_batch_{B}.rbln` per entry
of `decoder_batch_sizes` (older artifacts: a single `decoder.rbln`), plus `rbln_config.json`
(batch_size, max_seq_len, kvcache_block_size, kvcache_num_blocks, prefill_chunk_size,
decoder_batch_sizes, cache_impl) and the Hugging Face `config.json` (vocab_size). Each graph is
loaded as `rebel.Runtime(rebel.RBLNCompiledModel(file), tensor_type="pt", device=...)` and called
positionally with the tensors of DESIGN.md section 3.

KV block operations use the runtime's KV-cache methods (the ones vllm-rbln calls), on the
prefill runtime unless another is given (all graphs of one model share the device KV cache):
`_copy_kv_cache(src, dst, num_tokens)`, `_fetch_kv_cache(host, block, 0, block_size, None)` and
`_update_kv_cache(host, block, 0, block_size, None)` (layer None: every layer). Host buffers must
be 4 KiB aligned; `new_host_buffer()` allocates one with `rebel.kv_cache.aligned_tensor`.

`rebel` is imported only when needed (loading, host buffers): binding already-loaded runtime
objects needs nothing but this module.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from atom_core.runtime.protocol import (
    check_block,
    check_copy,
    check_decode_inputs,
    check_prefill_inputs,
    smallest_decode_batch,
)

__all__ = ["RblnRuntime", "RblnUnavailableError"]

INSTALL_HINT = (
    "RblnRuntime needs the Rebellions SDK Python package `rebel` (rebel-compiler), which is not "
    "installed. On a host with an RBLN NPU and driver, install it with an RBLN Portal account: "
    "`pip install --extra-index-url https://pypi.rbln.ai/simple rebel-compiler` (the version "
    "that compiled the artifact). Without a device, use atom_core.runtime.TorchReferenceRuntime.")


class RblnUnavailableError(ImportError):
    """The `rebel` package (RBLN SDK) is not importable."""


def import_rebel() -> Any:
    try:
        return importlib.import_module("rebel")
    except ImportError as e:
        raise RblnUnavailableError(INSTALL_HINT) from e


class RblnRuntime:
    """`Runtime` over loaded `rebel.Runtime` objects: one prefill graph, decode graphs by rows.

    `decoders` maps each compiled decode batch size to its runtime. `decode` dispatches on the
    row count of the tensors it is given, which must be one of `decoder_batch_sizes`, and every
    decode tensor (the block table included) must have exactly that many rows; pick the graph
    with `decode_batch_size(busy_rows)`, which allows a smaller graph only when every busy row is
    among its first rows. `hybrid=True` for models with sliding-window layers (their graphs take
    `local_block_tables`). `fingerprint` names the model for PD KV transfer
    (`atom_core.pd.model_fingerprint`); without one, PD falls back to layout facts alone.
    """

    def __init__(self, *, prefill: Any, decoders: Mapping[int, Any], num_blocks: int,
                 block_size: int, max_seq_len: int, prefill_chunk: int, vocab_size: int,
                 hybrid: bool = False, kv_runtime: Any = None,
                 host_block_bytes: int | None = None, fingerprint: str | None = None):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("max_seq_len", max_seq_len), ("prefill_chunk", prefill_chunk),
                        ("vocab_size", vocab_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if max_seq_len % block_size or max_seq_len % prefill_chunk:
            raise ValueError(f"max_seq_len={max_seq_len} must be a multiple of block_size="
                             f"{block_size} and of prefill_chunk={prefill_chunk}")
        if not decoders or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0
                               for b in decoders):
            raise ValueError(f"decoders must map positive batch sizes to runtimes, got "
                             f"{list(decoders)}")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise ValueError(f"fingerprint must be a non-empty str or None, got {fingerprint!r}")
        self.fingerprint = fingerprint
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.vocab_size = vocab_size
        self.uses_local_block_tables = bool(hybrid)
        self.decoder_batch_sizes = tuple(sorted(decoders, reverse=True))
        self.batch_size = self.decoder_batch_sizes[0]
        self._prefill = prefill
        self._decoders = dict(decoders)
        self._kv = prefill if kv_runtime is None else kv_runtime
        self._host_block_bytes = host_block_bytes

    # --- loading -----------------------------------------------------------------------------

    @classmethod
    def from_compiled(cls, path: str | Path, *, device: int | list[int] = 0,
                      decoder_batch_sizes: Iterable[int] | None = None,
                      num_blocks: int | None = None, block_size: int | None = None,
                      max_seq_len: int | None = None, prefill_chunk: int | None = None,
                      vocab_size: int | None = None, hybrid: bool | None = None,
                      fingerprint: str | None = None, **runtime_kwargs: Any) -> RblnRuntime:
        """Load an optimum-rbln compiled decoder directory; explicit arguments override
        rbln_config.json / config.json. `runtime_kwargs` go to every `rebel.Runtime(...)`."""
        rebel = import_rebel()
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a compiled model directory")
        cfg = _rbln_config(root)

        def pick(name: str, explicit: Any, key: str, default: Any = None) -> Any:
            value = explicit if explicit is not None else cfg.get(key, default)
            if value is None:
                raise ValueError(f"{name} was not given and {root}/rbln_config.json has no "
                                 f"'{key}'")
            return value

        for flag in ("use_attention_mask", "use_inputs_embeds", "use_position_ids"):
            if cfg.get(flag):
                raise ValueError(f"{root}: artifacts compiled with {flag}=True take extra graph "
                                 "inputs that RblnRuntime does not build")
        cache_impl = cfg.get("cache_impl", "static")
        if cache_impl == "sliding_window":
            raise ValueError(f"{root}: cache_impl='sliding_window' (no global block tables) is "
                             "not supported")
        seq_len = int(pick("max_seq_len", max_seq_len, "max_seq_len"))
        sizes = decoder_batch_sizes if decoder_batch_sizes is not None else \
            cfg.get("decoder_batch_sizes") or [pick("batch size", None, "batch_size")]
        sizes = sorted({int(b) for b in sizes}, reverse=True)
        vocab = vocab_size if vocab_size is not None else _vocab_size(root)

        def load(name: str) -> Any:
            compiled = rebel.RBLNCompiledModel(str(root / f"{name}.rbln"))
            return rebel.Runtime(compiled, tensor_type="pt", device=device, **runtime_kwargs)

        names = {b: f"decoder_batch_{b}" for b in sizes}
        if len(sizes) == 1 and not (root / f"{names[sizes[0]]}.rbln").exists() \
                and (root / "decoder.rbln").exists():
            names[sizes[0]] = "decoder"
        missing = [f"{n}.rbln" for n in ("prefill", *names.values())
                   if not (root / f"{n}.rbln").exists()]
        if missing:
            raise FileNotFoundError(f"{root} lacks compiled graphs {missing}")
        return cls(prefill=load("prefill"), decoders={b: load(n) for b, n in names.items()},
                   num_blocks=int(pick("num_blocks", num_blocks, "kvcache_num_blocks")),
                   block_size=int(pick("block_size", block_size, "kvcache_block_size", seq_len)),
                   max_seq_len=seq_len,
                   prefill_chunk=int(pick("prefill_chunk", prefill_chunk, "prefill_chunk_size",
                                          128)),
                   vocab_size=int(vocab),
                   hybrid=bool(hybrid) if hybrid is not None else cache_impl == "hybrid",
                   fingerprint=fingerprint)

    # --- graphs ------------------------------------------------------------------------------

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any) -> torch.Tensor:
        ids, pos, bt, lbt, qp = check_prefill_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables, query_position)
        args = (ids, pos, bt, *(() if lbt is None else (lbt,)), qp)
        return self._logits("prefill", self._prefill(*args), 1)

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> torch.Tensor:
        ids, pos, bt, lbt = check_decode_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables)
        b = ids.shape[0]
        args = (ids, pos, bt, *(() if lbt is None else (lbt,)))
        return self._logits(f"decoder_batch_{b}", self._decoders[b](*args), b)

    def decode_batch_size(self, busy_rows: Iterable[int]) -> int:
        return smallest_decode_batch(self.decoder_batch_sizes, busy_rows)

    def _logits(self, graph: str, out: Any, rows: int) -> torch.Tensor:
        if isinstance(out, (list, tuple)):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"{graph} returned {type(out).__name__}, not a torch tensor "
                               "(load runtimes with tensor_type='pt')")
        if tuple(out.shape) != (rows, 1, self.vocab_size):
            raise RuntimeError(f"{graph} returned logits of shape {list(out.shape)}, expected "
                               f"{[rows, 1, self.vocab_size]}")
        return out

    # --- block operations --------------------------------------------------------------------

    def _block(self, name: str, block: int) -> int:
        return check_block(name, block, self.num_blocks)

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        s, d, n = check_copy(src, dst, num_tokens, self.num_blocks, self.block_size)
        self._kv._copy_kv_cache(s, d, n)

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._kv._fetch_kv_cache(host_tensor, self._block("fetch", block), 0, self.block_size,
                                 None)

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._kv._update_kv_cache(host_tensor, self._block("update", block), 0, self.block_size,
                                  None)

    def new_host_buffer(self) -> torch.Tensor:
        """A 4 KiB-aligned host buffer (rebel requires the alignment) of `host_block_bytes`;
        by default the size the runtime reports for its KV cache, `_get_kv_cache_size(None)`,
        which holds at least one block of every layer."""
        import_rebel()
        kv_cache = importlib.import_module("rebel.kv_cache")
        np = importlib.import_module("numpy")  # a dependency of rebel
        nbytes = self._host_block_bytes or int(self._kv._get_kv_cache_size(None))
        return kv_cache.aligned_tensor((nbytes + 1) // 2, dtype=np.float16, alignment=0x1000,
                                       tensor_type="pt")


def _rbln_config(root: Path) -> dict[str, Any]:
    f = root / "rbln_config.json"
    if not f.exists():
        return {}
    data = json.loads(f.read_text())
    if "max_seq_len" in data:
        return data
    # a causal LM nested in a multimodal artifact (e.g. {"language_model": {...}})
    nested = [v for v in data.values() if isinstance(v, dict) and "max_seq_len" in v]
    return nested[0] if len(nested) == 1 else data


def _vocab_size(root: Path) -> int:
    f = root / "config.json"
    if f.exists():
        data = json.loads(f.read_text())
        for d in (data, data.get("text_config") or {}):
            if isinstance(d.get("vocab_size"), int):
                return d["vocab_size"]
    raise ValueError(f"vocab_size was not given and {root}/config.json has none")
