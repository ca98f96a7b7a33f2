"""Binding of real `rebel.Runtime` graphs (an optimum-rbln 0.12.0 compiled decoder) to `Runtime`.

An optimum-rbln causal-LM directory holds `prefill.rbln` and one `decoder_batch_{B}.rbln` per
entry of `decoder_batch_sizes`, `rbln_config.json` (what was compiled) and the Hugging Face
`config.json` (vocab_size). A multimodal artifact (e.g. Gemma3 with a vision tower) keeps the
language model's graphs, config.json and rbln_config.json in a sub-folder named after the
submodule (`language_model/`); the binding loads from there and serves text only. Each graph is
loaded as `rebel.Runtime(rebel.RBLNCompiledModel(file), tensor_type="pt", device=...)`.

Graph inputs. rbln_config.json says which inputs each graph was compiled with, in this order
(the KV caches are bound to the runtime, not passed):

    input_ids (inputs_embeds with use_inputs_embeds: looked up on the host in the input embedding
    optimum-rbln saves as torch_artifacts.pth), cache_position, block_tables,
    [local_block_tables] (cache_impl 'hybrid'),
    [query_position] (prefill only, when hybrid or logits_to_keep == 1),
    [attention_mask] (use_attention_mask: [rows, 1, q, max_seq_len], or [rows, max_seq_len] with
    use_position_ids), [position_ids] (use_position_ids), [lora_int_ids] (lora_config)

`GraphInputs` reads those settings and builds every optional tensor with the values optimum-rbln's
own runtime model passes for the same tables; an artifact whose inputs it cannot build is refused
at load time with `RblnArtifactError` naming the setting (inputs_embeds without an embedding
the binding can compute, sliding-window-only caches, linear-attention caches, LoRA without a
chosen adapter, logits_to_keep > 1, and an attention mask with position ids but no
image_prefill phase, which optimum-rbln compiles as a bidirectional prefix-LM prefill). Gemma3 is
always compiled with an attention mask and position ids (prefill 7 inputs, decode 6), so only
its artifacts with an image_prefill phase (a multimodal model's language model) prefill causally
and are served; decode position ids equal cache positions because atom-core's text prefill never
pads the cache (see `GraphInputs.decode_args`). At load, the input lists the binding builds are
checked against the ones rbln_config.json records for every graph (`check_compiled_inputs`), so
an input a model class adds (Qwen2-VL's `position_emb`) or an explicit size that disagrees with
the compiled one is refused before anything runs.

KV block operations use the runtime's KV-cache methods (`_copy_kv_cache(src, dst, num_tokens)`
on device). Host transfers (`_fetch_kv_cache` / `_update_kv_cache` of one block, used by the host
cache tier and PD) are off unless `host_kv_transfers=True`: neither optimum-rbln nor vllm-rbln
calls them per block, so nothing yet shows that fetching block X and updating block Y moves
exactly X's content. Host buffers hold one block of every full-attention layer, sized from the
artifact's `cache_metas`, never from the whole KV cache.

`rebel` is imported only when needed (loading, host buffers): binding already-loaded runtime
objects needs nothing but this module.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from atom_core.config import HOST_KV_REFUSAL  # (config: torch-free, for check-config)
from atom_core.runtime.protocol import (
    RuntimeInputError,
    check_block,
    check_copy,
    check_decode_inputs,
    check_prefill_inputs,
    sizes_error,
    smallest_decode_batch,
)

__all__ = ["GraphInputs", "RblnArtifactError", "RblnCapabilityError", "RblnRuntime",
           "RblnUnavailableError", "check_compiled_inputs", "graph_inputs", "host_block_bytes",
           "input_embedding", "read_artifact"]

INSTALL_HINT = (
    "RblnRuntime needs the Rebellions SDK Python package `rebel` (rebel-compiler), which is not "
    "installed. On a host with an RBLN NPU and driver, install it with an RBLN Portal account: "
    "`pip install --extra-index-url https://pypi.rbln.ai/simple rebel-compiler` (the version "
    "that compiled the artifact). Without a device, use atom_core.runtime.TorchReferenceRuntime.")



class RblnUnavailableError(ImportError):
    """The `rebel` package (RBLN SDK) is not importable."""


class RblnArtifactError(ValueError):
    """A compiled artifact whose graphs the binding cannot call; the message names the setting."""


class RblnCapabilityError(RuntimeError):
    """A binding capability that is off (host KV transfers); the message says how to turn it on."""


def import_rebel() -> Any:
    try:
        return importlib.import_module("rebel")
    except ImportError as e:
        raise RblnUnavailableError(INSTALL_HINT) from e


# rbln_config.json's `dtype` names (optimum-rbln writes torch dtype names)
_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
# the cache kinds of `cache_metas` the binding addresses: paged blocks and per-lane local slots
_KV_LAYERS = {"full_attention", "sliding_attention"}
i64, i32, i16 = torch.int64, torch.int32, torch.int16

Signature = list[tuple[str, torch.dtype, tuple[int, ...]]]


@attrs.frozen(kw_only=True)
class GraphInputs:
    """The graph inputs an artifact was compiled with, and how to build them.

    `attention_mask`: None (no mask input), "4d" (`[rows, 1, q, max_seq_len]`, the causal mask
    of each query over the whole cache) or "2d" (`[rows, max_seq_len]`, which positions hold the
    sequence; compiled together with position ids). `logits_to_keep` 1: the prefill graph returns
    the logits of `query_position` only; 0: of every position of the chunk (`[1, C, V]`) unless
    the graph takes `query_position` anyway (hybrid). `batch_sort`: decode rows must be sorted
    by position, longest first (`_requires_batch_sort`).
    """

    max_seq_len: int
    block_size: int
    prefill_chunk: int
    local_tables: bool = False
    logits_to_keep: int = 1
    attention_mask: str | None = None
    position_ids: bool = False
    mask_dtype: torch.dtype = torch.float32
    lora_int_id: int | None = None
    batch_sort: bool = False
    # use_inputs_embeds: the graphs take embeddings [rows, q, hidden] instead of token ids; the
    # host looks tokens up in this table (the model's input embedding, already scaled as the
    # model scales it), as optimum-rbln's runtime model does with its embed_tokens
    embedding: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def prefill_query_position(self) -> bool:
        return self.local_tables or self.logits_to_keep == 1

    @property
    def blocks_per_table(self) -> int:
        return self.max_seq_len // self.block_size

    # --- signatures (name, dtype, shape) -------------------------------------------------------

    def _tokens(self, rows: int, q: int) -> tuple[str, torch.dtype, tuple[int, ...]]:
        if self.embedding is None:
            return ("input_ids", i64, (rows, q))
        return ("inputs_embeds", self.embedding.dtype, (rows, q, self.embedding.shape[1]))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embedding is None:
            return ids
        if int(ids.min()) < 0 or int(ids.max()) >= self.embedding.shape[0]:
            raise RuntimeInputError(f"input_ids {ids.tolist()} are outside the embedding's "
                                    f"vocabulary 0..{self.embedding.shape[0] - 1}")
        return self.embedding[ids]

    def prefill_signature(self) -> Signature:
        c, s = self.prefill_chunk, self.max_seq_len
        sig: Signature = [self._tokens(1, c), ("cache_position", i32, (1, c)),
                          ("block_tables", i16, (self.blocks_per_table,))]
        if self.local_tables:
            sig.append(("local_block_tables", i16, (1,)))
        if self.prefill_query_position:
            sig.append(("query_position", i16, ()))
        if self.attention_mask == "4d":
            sig.append(("attention_mask", self.mask_dtype, (1, 1, c, s)))
        elif self.attention_mask == "2d":
            sig.append(("attention_mask", self.mask_dtype, (1, s)))
        if self.position_ids:
            sig.append(("position_ids", i32, (1, c)))
        if self.lora_int_id is not None:
            sig.append(("lora_int_ids", i32, (1,)))
        return sig

    def decode_signature(self, rows: int) -> Signature:
        s = self.max_seq_len
        sig: Signature = [self._tokens(rows, 1), ("cache_position", i32, (rows, 1)),
                          ("block_tables", i16, (rows, self.blocks_per_table))]
        if self.local_tables:
            sig.append(("local_block_tables", i16, (rows, 1)))
        if self.attention_mask == "4d":
            sig.append(("attention_mask", self.mask_dtype, (rows, 1, 1, s)))
        elif self.attention_mask == "2d":
            sig.append(("attention_mask", self.mask_dtype, (rows, s)))
        if self.position_ids:
            sig.append(("position_ids", i32, (rows, 1)))
        if self.lora_int_id is not None:
            sig.append(("lora_int_ids", i32, (rows,)))
        return sig

    # --- arguments -----------------------------------------------------------------------------

    def prefill_args(self, ids: torch.Tensor, pos: torch.Tensor, bt: torch.Tensor,
                     lbt: torch.Tensor | None, qp: torch.Tensor) -> list[torch.Tensor]:
        """The prefill graph's arguments for one checked chunk (`check_prefill_inputs`): the
        chunk's real tokens are its first `qp + 1`, the rest padding."""
        c, s = self.prefill_chunk, self.max_seq_len
        start, real = int(pos[0, 0]), int(qp) + 1
        # optimum-rbln pads a short last chunk's positions with zeros; the kernel takes the
        # chunk's start from the first position, the rest only place the padding tokens' rotary
        # embedding, whose outputs nobody reads
        pos = pos.clone()
        pos[0, real:] = 0
        tokens = self._embed(ids)
        if self.embedding is not None:
            # optimum-rbln embeds the real tokens and pads the chunk with zero vectors
            tokens[0, real:] = 0
        args = [tokens, pos, bt]
        if self.local_tables:
            assert lbt is not None
            args.append(lbt)
        if self.prefill_query_position:
            args.append(qp)
        if self.attention_mask == "4d":
            # every earlier position visible, causal within the chunk (padding rows included)
            mask = torch.zeros(1, 1, c, s, dtype=self.mask_dtype)
            mask[..., :start] = 1
            w = min(c, s - start)  # (an eager last chunk may be padded past max_seq_len)
            mask[0, 0, :, start:start + w] = torch.tril(
                torch.ones(c, c, dtype=self.mask_dtype))[:, :w]
            args.append(mask)
        elif self.attention_mask == "2d":
            mask = torch.zeros(1, s, dtype=self.mask_dtype)
            mask[0, :start + real] = 1  # the positions the sequence holds after this chunk
            args.append(mask)
        if self.position_ids:
            args.append(pos.clone())
        if self.lora_int_id is not None:
            args.append(torch.tensor([self.lora_int_id], dtype=i32))
        return args

    def decode_args(self, ids: torch.Tensor, pos: torch.Tensor, bt: torch.Tensor,
                    lbt: torch.Tensor | None) -> list[torch.Tensor]:
        """The decode graph's arguments for checked rows (`check_decode_inputs`)."""
        rows, s = ids.shape[0], self.max_seq_len
        args = [self._embed(ids), pos, bt]
        if self.local_tables:
            assert lbt is not None
            args.append(lbt)
        if self.attention_mask is not None:
            # row r sees positions 0..pos[r] (the token it writes included), as optimum-rbln
            # builds it for caller-given tables and vllm-rbln for Gemma3
            seen = (torch.arange(s)[None, :] <= pos[:, :1].to(i64)).to(self.mask_dtype)
            args.append(seen.view(rows, 1, 1, s) if self.attention_mask == "4d" else seen)
        if self.position_ids:
            # position ids are cache positions minus the cache padding a prefill left (vllm-rbln:
            # `padded_cache_lengths`). Only image prefill and partition alignment pad; atom-core
            # prefills text in chunks that start at multiples of prefill_chunk, which divides a
            # paged table's block (= flash-attention partition) size (Config's
            # chunk_divides_block) and pads only a prompt's last chunk at its end, so the cache
            # padding is 0 and they are equal
            args.append(pos.clone())
        if self.lora_int_id is not None:
            args.append(torch.full((rows,), self.lora_int_id, dtype=i32))
        return args


def _read_json(f: Path) -> dict[str, Any]:
    """A JSON object file of the artifact, or `RblnArtifactError` naming the file (a truncated
    copy or an editor's stray comma otherwise surfaces as a bare JSONDecodeError)."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise RblnArtifactError(f"{f} is not a UTF-8 text file ({exc.reason} at byte "
                                f"{exc.start}): restore the file optimum-rbln saved") from None
    except json.JSONDecodeError as exc:
        raise RblnArtifactError(f"{f} is not valid JSON ({exc}): restore the file "
                                "optimum-rbln saved, or recompile") from None
    if not isinstance(data, dict):
        raise RblnArtifactError(f"{f} must hold a JSON object, got {type(data).__name__}: "
                                "restore the file optimum-rbln saved, or recompile")
    return data


def read_artifact(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The directory holding the causal LM's graphs and its rbln_config.json settings.

    A multimodal artifact's top-level rbln_config.json nests the language model's settings under
    its submodule name, and its graphs are in the sub-folder of that name."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a compiled model directory")
    f = root / "rbln_config.json"
    if not f.exists():
        raise RblnArtifactError(f"{root} has no rbln_config.json: give an optimum-rbln compiled "
                                "model directory (`save_pretrained` of an RBLN...ForCausalLM)")
    data = _read_json(f)
    if "max_seq_len" in data:
        return root, data
    nested = [k for k, v in data.items() if isinstance(v, dict) and "max_seq_len" in v]
    if len(nested) != 1:
        raise RblnArtifactError(
            f"{f} has no max_seq_len and {len(nested)} submodule settings with one "
            f"({nested}): expected a causal LM, or a multimodal model with one language model")
    sub = root / nested[0]
    if not (sub / "rbln_config.json").exists():
        raise RblnArtifactError(
            f"{f} nests the language model under '{nested[0]}', but {sub}/rbln_config.json does "
            "not exist (optimum-rbln 0.12.0 saves a submodule's graphs in that sub-folder); "
            f"give the directory that holds its prefill.rbln")
    return sub, _read_json(sub / "rbln_config.json")


def graph_inputs(cfg: Mapping[str, Any], where: str = "rbln_config",
                 lora_adapter: str | int | None = None,
                 embedding: torch.Tensor | None = None) -> GraphInputs:
    """The graph inputs of an artifact's settings, or `RblnArtifactError` naming the setting
    whose inputs the binding cannot build. `embedding`: the input embedding table of a
    use_inputs_embeds artifact (`input_embedding`)."""

    def refuse(setting: str, why: str) -> RblnArtifactError:
        return RblnArtifactError(f"{where}: {setting}: {why}")

    phases = cfg.get("phases") or ["prefill", "decode"]
    if "prefill" not in phases or "decode" not in phases:
        raise refuse(f"phases={phases}", "atom-core needs a prefill and a decode graph; "
                     "compile the model for generation (phases ['prefill', 'decode'])")
    if cfg.get("use_inputs_embeds") and embedding is None:
        raise refuse("use_inputs_embeds=True", "the graphs take embeddings and the artifact has "
                     "no input embedding the binding can compute them with (torch_artifacts.pth "
                     "of a model whose embedding optimum-rbln builds as a plain or Gemma3 "
                     "lookup); compile with use_inputs_embeds=False")
    if embedding is not None and not cfg.get("use_inputs_embeds"):
        raise refuse("use_inputs_embeds=False", "an embedding table was given, but the graphs "
                     "take token ids")
    cache_impl = cfg.get("cache_impl") or "static"
    if cache_impl not in ("static", "hybrid"):
        raise refuse(f"cache_impl={cache_impl!r}", "only 'static' and 'hybrid' artifacts have the "
                     "global block tables atom-core schedules; compile with cache_impl 'static' "
                     "or 'hybrid'")
    keep = cfg.get("logits_to_keep", 1)
    if keep not in (0, 1):
        raise refuse(f"logits_to_keep={keep!r}", "must be 0 or 1 (optimum-rbln compiles "
                     "nothing else)")
    mask, ids = bool(cfg.get("use_attention_mask")), bool(cfg.get("use_position_ids"))
    if ids and not mask:
        raise refuse("use_position_ids=True", "needs use_attention_mask=True (optimum-rbln "
                     "compiles position ids only with a mask)")
    if mask and ids and "image_prefill" not in phases:
        # optimum-rbln 0.12.0 (`use_bidirectional_prefill`; the attention ops' is_bidirectional)
        # compiles such a prefill graph as a prefix-LM one: each chunk attends both ways within
        # itself, so a token's KV depends on the tokens after it in its chunk. Served as a
        # causal LM in chunks, its outputs and cached prefixes would be wrong on the device.
        raise refuse("use_attention_mask=True with use_position_ids=True and no image_prefill "
                     "phase", "optimum-rbln compiles this prefill graph with bidirectional "
                     "attention within a chunk (a prefix-LM prefill, as PaliGemma's); atom-core "
                     "prefills causally, chunk by chunk. A Gemma3 text model is causal only when "
                     "compiled with an image_prefill phase (as the language model of "
                     "RBLNGemma3ForConditionalGeneration, or phases ['prefill', "
                     "'image_prefill', 'decode'] with image_prefill_chunk_size equal to "
                     "prefill_chunk_size); otherwise compile without use_position_ids")
    dtype_name = cfg.get("dtype", "float32")
    if (mask or embedding is not None) and dtype_name not in _FLOAT_DTYPES:
        raise refuse(f"dtype={dtype_name!r}", f"the attention mask's and embeddings' dtype must "
                     f"be one of {sorted(_FLOAT_DTYPES)}")
    metas = cfg.get("cache_metas") or []
    kinds = sorted({m.get("layer_type") for m in metas} - _KV_LAYERS, key=str)
    if kinds:
        raise refuse(f"cache_metas layer_type {kinds}", "caches other than paged full-attention "
                     "KV and sliding-window slots (e.g. linear attention state) are not "
                     "scheduled by atom-core")
    if cache_impl == "static" and any(m.get("layer_type") == "sliding_attention" for m in metas):
        raise refuse("cache_metas", "sliding-window caches in a cache_impl='static' artifact")
    lora = cfg.get("lora_config")
    lora_id = None
    if lora:
        named = {a["lora_name"]: int(a["lora_int_id"]) for a in lora.get("adapters", [])}
        named.setdefault("base", 0)  # optimum-rbln's reserved base adapter (no LoRA delta)
        if lora_adapter is None:
            raise refuse("lora_config", f"the graphs take one LoRA adapter id per row; pick the "
                         f"adapter every request is served with: lora_adapter=<name or id> "
                         f"(compiled: {named}); per-request adapters are not supported")
        lora_id = named.get(lora_adapter) if isinstance(lora_adapter, str) else lora_adapter
        if lora_id not in named.values():
            raise refuse("lora_config", f"lora_adapter={lora_adapter!r} is not a compiled "
                         f"adapter (compiled: {named})")
    elif lora_adapter is not None:
        raise refuse("lora_config", f"lora_adapter={lora_adapter!r} given, but the artifact was "
                     "compiled without LoRA")
    seq = int(cfg["max_seq_len"])
    return GraphInputs(
        max_seq_len=seq, block_size=int(cfg.get("kvcache_block_size") or seq),
        prefill_chunk=int(cfg.get("prefill_chunk_size") or 128),
        local_tables=cache_impl == "hybrid", logits_to_keep=int(keep),
        attention_mask=None if not mask else "2d" if ids else "4d", position_ids=ids,
        mask_dtype=_FLOAT_DTYPES.get(dtype_name, torch.float32), lora_int_id=lora_id,
        batch_sort=bool(cfg.get("_requires_batch_sort")),
        embedding=None if embedding is None else embedding.to(
            _FLOAT_DTYPES.get(dtype_name, torch.float32)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_compiled_inputs(cfg: Mapping[str, Any], inputs: GraphInputs, sizes: Iterable[int],
                          where: str = "rbln_config") -> None:
    """Refuse an artifact whose graphs were compiled with other inputs than the binding builds.

    optimum-rbln records every compiled graph's input list (name, shape, dtype, in call order) in
    rbln_config.json's `_compile_cfgs`; the KV caches (`cache_metas`) are bound to the runtime
    and not passed. A model class may add inputs the settings do not show (Qwen2-VL's
    `position_emb`, ...), and an explicit size given to `from_compiled` may disagree with the
    compiled one: either would reach the device as a wrong argument list. Artifacts without
    `_compile_cfgs` (not written by optimum-rbln's save) are not checked."""
    compiled = cfg.get("_compile_cfgs")
    if not compiled:
        return
    caches = {m.get("name") for m in cfg.get("cache_metas") or []}
    recorded: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for cc in compiled:
        recorded[str(cc.get("compiled_model_name"))] = [
            (str(name), str(dtype), tuple(int(d) for d in shape))
            for name, shape, dtype in cc.get("input_info") or []
            if name not in caches and not str(name).startswith("past_key_values")]
    graphs = [("prefill", inputs.prefill_signature())]
    graphs += [(f"decoder_batch_{b}", inputs.decode_signature(b)) for b in sizes]
    for graph, sig in graphs:
        built = [(name, _dtype_name(dtype), shape) for name, dtype, shape in sig]
        want = recorded.get(graph)
        if want is None:
            raise RblnArtifactError(f"{where}: _compile_cfgs records no '{graph}' graph "
                                    f"(compiled: {sorted(recorded)})")
        if want != built:
            # lists of different lengths differ at the shorter one's end at the latest
            diff = next((i for i, (a, b) in enumerate(zip(want, built, strict=False))
                         if a != b), min(len(want), len(built)))
            raise RblnArtifactError(
                f"{where}: the '{graph}' graph was compiled with inputs {want}, the binding "
                f"would pass {built} (first difference at input {diff}: compiled "
                f"{want[diff] if diff < len(want) else None}, built "
                f"{built[diff] if diff < len(built) else None}); the model class adds inputs "
                "the binding does not build, or an explicit size disagrees with the artifact")


# optimum-rbln config classes whose model embeds tokens as Gemma3's scaled lookup (the table
# times sqrt(hidden_size), in the table's dtype); every other decoder-only class without its own
# `_create_embedding_layer` uses a plain lookup
_SCALED_EMBEDDING = ("RBLNGemma3ForCausalLMConfig",)
# classes whose language model prepares its inputs in ways the binding does not reproduce
# (Gemma4's per-layer inputs, the Qwen VL models' position embeddings, PaliGemma's bidirectional
# prefill, ...): their inputs_embeds artifacts are refused
_OWN_INPUTS = ("RBLNGemma4", "RBLNPaliGemma", "RBLNQwen2VL", "RBLNQwen2_5_VL", "RBLNQwen3VL",
               "RBLNQwen3_5", "RBLNPixtral", "RBLNColQwen2")


def input_embedding(root: Path, cfg: Mapping[str, Any]) -> torch.Tensor | None:
    """The input embedding table of a use_inputs_embeds artifact: optimum-rbln saves the
    model's embedding state in `torch_artifacts.pth` (`embed_tokens`) beside the graphs. None
    when the artifact has none or builds its embeddings some other way."""
    f = root / "torch_artifacts.pth"
    name = str(cfg.get("cls_name", ""))
    if not cfg.get("use_inputs_embeds") or not f.exists() or name.startswith(_OWN_INPUTS):
        return None
    state = torch.load(f, map_location="cpu", weights_only=True).get("embed_tokens") or {}
    weight = state.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if name in _SCALED_EMBEDDING:
        # the same product per element as scaling each looked-up row
        return weight * torch.tensor(weight.shape[1] ** 0.5).to(weight.dtype)
    return weight


def host_block_bytes(cfg: Mapping[str, Any]) -> int | None:
    """Bytes of one KV block of every full-attention layer (`cache_metas`: each meta is one K or
    V cache `[num_blocks, kv_heads, block_size, head_dim]`), or None if the artifact has none."""
    total = 0
    for m in cfg.get("cache_metas") or []:
        if m.get("layer_type") == "full_attention":
            dtype = _FLOAT_DTYPES.get(m.get("dtype"))
            if dtype is None:
                raise RblnArtifactError(f"cache_metas {m.get('name')}: unknown dtype "
                                        f"{m.get('dtype')!r}")
            total += math.prod(int(d) for d in m["shape"][1:]) * dtype.itemsize
    return total or None


class RblnRuntime:
    """`Runtime` over loaded `rebel.Runtime` objects: one prefill graph, decode graphs by rows.

    `decoders` maps each compiled decode batch size to its runtime. `decode` dispatches on the
    row count of the tensors it is given, which must be one of `decoder_batch_sizes`, and every
    decode tensor (the block table included) must have exactly that many rows; pick the graph
    with `decode_batch_size(busy_rows)`, which allows a smaller graph only when every busy row is
    among its first rows. `inputs` says which inputs the graphs take (`graph_inputs` of the
    artifact; default: the plain Llama-style signature). `hybrid=True` for models with
    sliding-window layers (their graphs take `local_block_tables`). `fingerprint` names the
    model for PD KV transfer (`atom_core.pd.payload.model_fingerprint`). `host_kv_transfers`
    turns on `fetch_kv_cache`/`update_kv_cache`/`new_host_buffer` (module docstring).
    """

    # compiled graphs of static shapes (protocol.py): a decode graph computes all its rows,
    # padding rows included, and a prefill graph one chunk of one sequence
    static_batch = True
    mixed_calls = False

    def __init__(self, *, prefill: Any, decoders: Mapping[int, Any], num_blocks: int,
                 block_size: int, max_seq_len: int, prefill_chunk: int, vocab_size: int,
                 hybrid: bool = False, sliding_window: int | None = None,
                 inputs: GraphInputs | None = None, kv_runtime: Any = None,
                 host_block_bytes: int | None = None, host_kv_transfers: bool = False,
                 fingerprint: str | None = None):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("max_seq_len", max_seq_len), ("prefill_chunk", prefill_chunk),
                        ("vocab_size", vocab_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        bad = sizes_error(max_seq_len, block_size, prefill_chunk)
        if bad:  # atom-core's rule, not optimum-rbln's
            raise ValueError(f"{bad}; recompile with such sizes")
        if not decoders or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0
                               for b in decoders):
            raise ValueError(f"decoders must map positive batch sizes to runtimes, got "
                             f"{list(decoders)}")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise ValueError(f"fingerprint must be a non-empty str or None, got {fingerprint!r}")
        if host_block_bytes is not None and (isinstance(host_block_bytes, bool) or not isinstance(
                host_block_bytes, int) or host_block_bytes <= 0):
            raise ValueError(f"host_block_bytes must be a positive integer or None, got "
                             f"{host_block_bytes!r}")
        if inputs is None:
            inputs = GraphInputs(max_seq_len=max_seq_len, block_size=block_size,
                                 prefill_chunk=prefill_chunk, local_tables=bool(hybrid))
        elif (inputs.max_seq_len, inputs.block_size, inputs.prefill_chunk,
              inputs.local_tables) != (max_seq_len, block_size, prefill_chunk, bool(hybrid)):
            raise ValueError(f"inputs {inputs} disagree with max_seq_len={max_seq_len}, "
                             f"block_size={block_size}, prefill_chunk={prefill_chunk}, "
                             f"hybrid={hybrid}")
        self.fingerprint = fingerprint
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.vocab_size = vocab_size
        self.uses_local_block_tables = bool(hybrid)
        if hybrid and sliding_window is not None:
            self.sliding_window = sliding_window
        self.inputs = inputs
        self.decoder_batch_sizes = tuple(sorted(decoders, reverse=True))
        self.batch_size = self.decoder_batch_sizes[0]
        self.host_kv_transfers = bool(host_kv_transfers)
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
                      vocab_size: int | None = None, lora_adapter: str | int | None = None,
                      host_kv_transfers: bool = False, fingerprint: str | None = None,
                      **runtime_kwargs: Any) -> RblnRuntime:
        """Load an optimum-rbln compiled causal LM directory (or a multimodal one: its language
        model); explicit sizes override rbln_config.json / config.json. `lora_adapter`: the
        adapter (name or id) a LoRA artifact serves every request with. `runtime_kwargs` go to
        every `rebel.Runtime(...)`."""
        rebel = import_rebel()
        root, cfg = read_artifact(path)
        where = str(root / "rbln_config.json")
        seq = int(max_seq_len if max_seq_len is not None else cfg["max_seq_len"])
        blocks = num_blocks if num_blocks is not None else cfg.get("kvcache_num_blocks")
        if not blocks:
            raise RblnArtifactError(f"{where}: kvcache_num_blocks={blocks!r}: the artifact does "
                                    "not say how many KV blocks it has; give num_blocks=")
        inputs = graph_inputs({**cfg, "max_seq_len": seq,
                               **({"kvcache_block_size": block_size} if block_size else {}),
                               **({"prefill_chunk_size": prefill_chunk} if prefill_chunk
                                  else {})}, where, lora_adapter, input_embedding(root, cfg))
        sizes = decoder_batch_sizes if decoder_batch_sizes is not None else \
            cfg.get("decoder_batch_sizes") or [cfg.get("batch_size", 1)]
        sizes = sorted({int(b) for b in sizes}, reverse=True)
        check_compiled_inputs(cfg, inputs, sizes, where)
        recorded = int(cfg.get("kvcache_num_blocks") or 0)
        if recorded and int(blocks) > recorded:
            # block ids past the compiled cache would be addressed on the device
            raise RblnArtifactError(f"{where}: num_blocks={blocks} exceeds the "
                                    f"kvcache_num_blocks={recorded} the artifact was compiled "
                                    "with")
        vocab = vocab_size if vocab_size is not None else _vocab_size(root)
        names = {b: f"decoder_batch_{b}" for b in sizes}
        missing = [f"{n}.rbln" for n in ("prefill", *names.values())
                   if not (root / f"{n}.rbln").exists()]
        if missing:
            legacy = " (decoder.rbln is the layout of optimum-rbln before 0.12.0: recompile)" \
                if (root / "decoder.rbln").exists() else ""
            raise FileNotFoundError(f"{root} lacks compiled graphs {missing}{legacy}")

        def load(name: str) -> Any:
            compiled = rebel.RBLNCompiledModel(str(root / f"{name}.rbln"))
            return rebel.Runtime(compiled, tensor_type="pt", device=device, **runtime_kwargs)

        return cls(prefill=load("prefill"), decoders={b: load(n) for b, n in names.items()},
                   num_blocks=int(blocks), block_size=inputs.block_size, max_seq_len=seq,
                   prefill_chunk=inputs.prefill_chunk, vocab_size=int(vocab),
                   hybrid=inputs.local_tables, sliding_window=cfg.get("sliding_window"),
                   inputs=inputs, host_block_bytes=host_block_bytes(cfg),
                   host_kv_transfers=host_kv_transfers, fingerprint=fingerprint)

    # --- graphs ------------------------------------------------------------------------------

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any) -> torch.Tensor:
        ids, pos, bt, lbt, qp = check_prefill_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables, query_position)
        out = self._prefill(*self.inputs.prefill_args(ids, pos, bt, lbt, qp))
        rows = 1 if self.inputs.prefill_query_position else self.prefill_chunk
        logits = self._logits("prefill", out, (1, rows))
        return logits if rows == 1 else logits[:, int(qp):int(qp) + 1]

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> torch.Tensor:
        ids, pos, bt, lbt = check_decode_inputs(
            self, input_ids, cache_position, block_tables, local_block_tables)
        b = ids.shape[0]
        order = None
        if self.inputs.batch_sort and b > 1:
            # the in-memory decode kernel takes rows longest first; each row carries its own
            # tables, so a permutation of rows computes the same rows
            order = torch.argsort(pos[:, 0], descending=True, stable=True)
            ids, pos, bt = ids[order], pos[order], bt[order]
            lbt = None if lbt is None else lbt[order]
        out = self._decoders[b](*self.inputs.decode_args(ids, pos, bt, lbt))
        logits = self._logits(f"decoder_batch_{b}", out, (b, 1))
        return logits if order is None else logits[torch.argsort(order)]

    def decode_batch_size(self, busy_rows: Iterable[int]) -> int:
        return smallest_decode_batch(self.decoder_batch_sizes, busy_rows)

    def _logits(self, graph: str, out: Any, rows: Sequence[int]) -> torch.Tensor:
        if isinstance(out, (list, tuple)):  # output_hidden_states: logits first
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"{graph} returned {type(out).__name__}, not a torch tensor "
                               "(load runtimes with tensor_type='pt')")
        if tuple(out.shape) != (*rows, self.vocab_size):
            raise RuntimeError(f"{graph} returned logits of shape {list(out.shape)}, expected "
                               f"{[*rows, self.vocab_size]}")
        return out

    # --- block operations --------------------------------------------------------------------

    def _block(self, name: str, block: int) -> int:
        return check_block(name, block, self.num_blocks)

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        s, d, n = check_copy(src, dst, num_tokens, self.num_blocks, self.block_size)
        self._kv._copy_kv_cache(s, d, n)

    def _host_transfers(self) -> None:
        if not self.host_kv_transfers:
            raise RblnCapabilityError(HOST_KV_REFUSAL)

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._host_transfers()
        self._kv._fetch_kv_cache(host_tensor, self._block("fetch", block), 0, self.block_size,
                                 None)

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._host_transfers()
        self._kv._update_kv_cache(host_tensor, self._block("update", block), 0, self.block_size,
                                  None)

    def new_host_buffer(self) -> torch.Tensor:
        """A 4 KiB-aligned host buffer (rebel requires the alignment) of one block of every
        full-attention layer (`host_block_bytes`, from the artifact's cache_metas)."""
        self._host_transfers()
        if self._host_block_bytes is None:
            raise RblnCapabilityError(
                "the host buffer size of one KV block is unknown: the artifact's rbln_config.json "
                "has no cache_metas (compiled before optimum-rbln 0.12.0?); give "
                "host_block_bytes= (bytes of one block of every layer's K and V)")
        import_rebel()
        kv_cache = importlib.import_module("rebel.kv_cache")
        np = importlib.import_module("numpy")  # a dependency of rebel
        return kv_cache.aligned_tensor((self._host_block_bytes + 1) // 2, dtype=np.float16,
                                       alignment=0x1000, tensor_type="pt")


def _vocab_size(root: Path) -> int:
    f = root / "config.json"
    if f.exists():
        data = _read_json(f)
        for d in (data, data.get("text_config") or {}):
            if isinstance(d.get("vocab_size"), int):
                return d["vocab_size"]
    raise ValueError(f"vocab_size was not given and {root}/config.json has none")
