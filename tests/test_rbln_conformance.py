"""The RBLN binding against optimum-rbln 0.12.0 itself, without an NPU.

Artifacts are written by optimum-rbln's own config code (`_update_rbln_config`, which builds each
graph's input list with `get_input_info`, and `RBLNModelConfig.save`); the fake `rebel`
(tests/rbln_fake.py) gives every graph exactly the (dtype, shape) list optimum-rbln compiled it
with, minus the KV caches (bound to the runtime, never passed). For each artifact of the matrix:

- the binding loads it, or refuses it naming the setting it cannot build;
- `Config.from_rbln` reads the fields rbln_config.json holds;
- the batcher serves two requests through the binding, and every compiled decode graph is
  called once more directly, so every graph call atom-core makes meets the compiled signature
  (the fake graph asserts it);
- the tensors of one chunked prefill (two chunks, the last padded) and one padded decode (a row
  for an idle lane, rows out of length order) equal those optimum-rbln's own runtime models
  (`RBLNRuntimeModel`, Gemma3's `RBLNGemma3RuntimeModel`, set up by the model class's own
  `__post_init__`: embedding from torch_artifacts.pth, then `setup_runtime`) pass to the graphs
  for the same tokens, positions and block tables. Driven as a serving stack with its own
  tables drives them: the model class's batch sort is applied first, and Gemma3's decode mask
  is passed the way vllm-rbln builds it (the prefill's mask, plus each row's position).

What this cannot show without the SDK: what the compiled kernels compute from those tensors
(e.g. that a padding row's write lands only where its table points, or that host block transfers
move exactly one block).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rbln_fake import FakeGraph, installed

from atom_core.batcher import AtomBatcher
from atom_core.config import Config
from atom_core.runtime.rbln import RblnArtifactError, RblnRuntime

V, C = 96, 128
GRAPHS: dict[str, Any] = {}  # compiled file path -> graph, for the artifact under test


@pytest.fixture(scope="module")
def optimum() -> Iterator[dict[str, Any]]:
    """optimum-rbln's classes, imported under the fake `rebel` (installed by `make install`)."""
    with installed(lambda path, kwargs: GRAPHS[path]):
        try:
            from optimum.rbln.transformers.models.gemma3 import (
                RBLNGemma3ForCausalLM,
                RBLNGemma3ForCausalLMConfig,
                RBLNGemma3ForConditionalGenerationConfig,
            )
            from optimum.rbln.transformers.models.llama import (
                RBLNLlamaForCausalLM,
                RBLNLlamaForCausalLMConfig,
            )
            from optimum.rbln.transformers.models.qwen2 import (
                RBLNQwen2ForCausalLM,
                RBLNQwen2ForCausalLMConfig,
            )
            from optimum.rbln.transformers.models.siglip import RBLNSiglipVisionModelConfig
        except ImportError as exc:  # pragma: no cover - a setup error, not a skip
            raise RuntimeError("optimum-rbln==0.12.0 is not installed: run `make install` "
                               "(it installs it with --no-deps)") from exc
        yield {"llama": (RBLNLlamaForCausalLM, RBLNLlamaForCausalLMConfig),
               "qwen2": (RBLNQwen2ForCausalLM, RBLNQwen2ForCausalLMConfig),
               "gemma3": (RBLNGemma3ForCausalLM, RBLNGemma3ForCausalLMConfig),
               "gemma3-vl": (RBLNGemma3ForConditionalGenerationConfig,
                             RBLNSiglipVisionModelConfig)}


def model_config(family: str) -> Any:
    import transformers

    small = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    if family == "llama":
        return transformers.LlamaConfig(**small)
    if family == "qwen2":
        return transformers.Qwen2Config(**small, use_sliding_window=True, sliding_window=128,
                                        layer_types=["sliding_attention", "full_attention"])
    return transformers.Gemma3TextConfig(**small, head_dim=16, sliding_window=128,
                                         layer_types=["sliding_attention", "full_attention"])


EAGER = dict(batch_size=2, max_seq_len=512, prefill_chunk_size=C, kvcache_num_blocks=3,
             decoder_batch_sizes=[2, 1], attn_impl="eager")
FLASH = dict(batch_size=2, max_seq_len=8192, kvcache_block_size=4096, attn_impl="flash_attn",
             kvcache_partition_len=4096, prefill_chunk_size=C, kvcache_num_blocks=5,
             decoder_batch_sizes=[2, 1], _requires_batch_sort=True)
# name: (model family, rbln settings, lora_adapter, the setting a refusal names or None)
MATRIX: dict[str, tuple[str, dict[str, Any], Any, str | None]] = {
    "llama-eager": ("llama", EAGER, None, None),
    "llama-flash-sorted": ("llama", FLASH, None, None),
    # optimum-rbln allows an eager max_seq_len that is not a multiple of the chunk (it pads)
    "llama-eager-unaligned": ("llama", {**EAGER, "max_seq_len": 480}, None, None),
    "llama-logits-to-keep-0": ("llama", {**EAGER, "logits_to_keep": 0}, None, None),
    "llama-logits-to-keep-1": ("llama", {**EAGER, "logits_to_keep": 1}, None, None),
    "llama-attention-mask": ("llama", {**EAGER, "use_attention_mask": True}, None, None),
    "qwen2-hybrid": ("qwen2", EAGER, None, None),
    # a text-only Gemma3 (mask and position ids, no image_prefill phase): optimum-rbln compiles
    # its prefill bidirectional within a chunk (`use_bidirectional_prefill`), so it is refused
    "gemma3": ("gemma3", EAGER, None, "use_position_ids"),
    # the same model compiled with an image_prefill phase: its text prefill graph is causal
    # (embeddings: optimum-rbln's own image-phase prefill pads token ids along the wrong axis)
    "gemma3-image-phase": ("gemma3", {**EAGER, "phases": ["prefill", "image_prefill", "decode"],
                                      "image_prefill_chunk_size": C, "use_inputs_embeds": True,
                                      "embedding": True}, None, None),
    "llama-lora": ("llama", {**EAGER, "lora": True}, "math", None),
    "llama-lora-no-adapter": ("llama", {**EAGER, "lora": True}, None, "lora_config"),
    "llama-inputs-embeds": ("llama", {**EAGER, "use_inputs_embeds": True, "embedding": True},
                            None, None),
    "llama-inputs-embeds-no-table": ("llama", {**EAGER, "use_inputs_embeds": True}, None,
                                     "use_inputs_embeds"),
    # a Gemma3 vision-language artifact: the language model (inputs_embeds, an image prefill
    # graph) in its language_model/ sub-folder
    "gemma3-multimodal": ("gemma3", {**EAGER, "use_inputs_embeds": True, "embedding": True,
                                     "phases": ["prefill", "image_prefill", "decode"],
                                     "image_prefill_chunk_size": C, "multimodal": True},
                          None, None),
}


def compile_artifact(optimum: dict, root: Path, family: str, settings: dict[str, Any]) -> Any:
    """An artifact directory as optimum-rbln saves one (graph files empty): `root` itself, or
    with `multimodal` its language_model/ sub-folder, whose config is returned."""
    model_cls, config_cls = optimum[family]
    settings = dict(settings)
    embedding, multimodal = settings.pop("embedding", False), settings.pop("multimodal", False)
    top = root
    if multimodal:
        root = root / "language_model"
    if settings.pop("lora", False):
        adapter = root.parent / f"{root.name}-adapter"
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
        (adapter / "adapter_model.safetensors").write_bytes(b"")
        settings["lora_config"] = {"adapters": [
            {"lora_int_id": 1, "lora_name": "math", "lora_path": str(adapter)}]}
    mc = model_config(family)
    cfg = model_cls._update_rbln_config(model_config=mc, rbln_config=config_cls(**settings))
    root.mkdir(parents=True)
    cfg.save(root)
    mc.save_pretrained(root)
    for cc in cfg.compile_cfgs:
        (root / f"{cc.compiled_model_name}.rbln").write_bytes(b"")
    if embedding:  # optimum-rbln's own save of the input embedding (torch_artifacts.pth)
        model_cls.save_torch_artifacts(model=EmbeddingHolder(family, mc), save_dir_path=root.parent,
                                       subfolder=root.name, rbln_config=cfg)
    if multimodal:
        parent_cls, vision_cls = optimum["gemma3-vl"]
        parent_cls(batch_size=cfg.batch_size, language_model=cfg,
                   vision_tower=vision_cls(batch_size=1)).save(top)
    return cfg


class EmbeddingHolder:
    """The one thing `save_torch_artifacts` asks of a torch model: its input embedding."""

    def __init__(self, family: str, mc: Any) -> None:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

        torch.manual_seed(1)
        self.embedding = (
            Gemma3TextScaledWordEmbedding(V, mc.hidden_size, 0, embed_scale=mc.hidden_size**0.5)
            if family == "gemma3" else torch.nn.Embedding(V, mc.hidden_size))

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embedding


def graphs_of(cfg: Any, root: Path) -> dict[str, FakeGraph]:
    """One fake graph per compiled file, with optimum-rbln's input list for it."""
    caches = {m.name for m in cfg.cache_metas}
    out = {}
    for cc in cfg.compile_cfgs:
        info = [(getattr(torch, dtype), tuple(shape)) for name, shape, dtype in cc.input_info
                if name not in caches]
        out[str(root / f"{cc.compiled_model_name}.rbln")] = FakeGraph(
            cc.compiled_model_name, info, logit_rows(cfg, cc), V)
    return out


def logit_rows(cfg: Any, cc: Any) -> tuple[int, int]:
    """The leading shape of a graph's logits: a prefill graph that takes query_position keeps
    that position's hidden state only (decoderonly_architecture), else every position of the
    chunk; a decode graph one per row."""
    if cc.compiled_model_name != "prefill":
        return (cc.input_info[0][1][0], 1)
    names = [name for name, _, _ in cc.input_info]
    return (1, 1) if "query_position" in names else (1, cfg.prefill_chunk_size)


@pytest.mark.parametrize("name", list(MATRIX))
def test_artifact_conformance(optimum: dict, tmp_path: Path, name: str) -> None:
    family, settings, adapter, refused = MATRIX[name]
    root = tmp_path / name
    cfg = compile_artifact(optimum, root, family, settings)
    lm = root / "language_model" if settings.get("multimodal") else root
    GRAPHS.clear()
    GRAPHS.update(graphs_of(cfg, lm))
    saved = json.loads((root / "rbln_config.json").read_text())
    saved = saved.get("language_model", saved)
    with installed(lambda path, kwargs: GRAPHS[path]):
        if refused is not None:
            with pytest.raises(RblnArtifactError, match=refused):
                RblnRuntime.from_compiled(root, lora_adapter=adapter)
            return
        rt = RblnRuntime.from_compiled(root, lora_adapter=adapter)
    config = Config.from_rbln(root)
    assert config == Config(
        lanes=saved["batch_size"], kv_blocks=saved["kvcache_num_blocks"],
        max_seq_len=saved["max_seq_len"], block_size=saved["kvcache_block_size"],
        prefill_chunk=saved["prefill_chunk_size"],
        sliding_window=saved["sliding_window"] if saved["cache_impl"] == "hybrid" else None)
    assert rt.decoder_batch_sizes == tuple(saved["decoder_batch_sizes"])

    # serve two requests: a one-token one in lane 0, done at its prefill, and one in lane 1 with
    # two prefill chunks (the second padded), then decodes with lane 0 idle (a padding row, and
    # rows out of length order for an artifact that needs them sorted)
    calls: dict[str, list[tuple]] = {"prefill": [], "decode": []}
    for kind in calls:
        inner = getattr(rt, kind)

        def spy(*args: Any, _inner: Any = inner, _kind: str = kind) -> torch.Tensor:
            calls[_kind].append(tuple(None if a is None else torch.as_tensor(a).clone()
                                      for a in args))
            return _inner(*args)

        setattr(rt, kind, spy)
    gen = torch.Generator().manual_seed(0)
    short, prompt = (torch.randint(1, V, (n,), generator=gen).tolist() for n in (5, C + 37))
    batcher = AtomBatcher(config, rt)
    first, rid = batcher.submit(short, 1), batcher.submit(prompt, 3)
    results = batcher.run_until_done(max_steps=50)
    assert results[first].error is None and results[rid].error is None
    assert len(results[rid].tokens) == 3
    by_name = {g.name: g for g in GRAPHS.values()}
    assert len(calls["prefill"]) == 3 == len(by_name["prefill"].calls)
    decoder = by_name[f"decoder_batch_{config.lanes}"]
    assert len(calls["decode"]) == 2 == len(decoder.calls)
    ids, pos, bt, lbt = calls["decode"][0]
    live = [r for r in range(ids.shape[0]) if int(pos[r, 0]) > 0]
    assert live == [1], "the long request decodes in lane 1 beside an idle lane 0"
    mine = [i for i, c in enumerate(calls["prefill"])
            if c[0][0, :5].tolist() != short]  # the long request's chunks
    assert len(mine) == 2
    table = calls["prefill"][mine[0]][2]
    assert all(torch.equal(calls["prefill"][i][2], table) for i in mine)

    lora_id = cfg.lora_config.get_adapter_by_name(adapter).lora_int_id if cfg.use_lora else None
    reference = OptimumReference(optimum[family][0], cfg, family, lm, lora_id)
    out = reference.prefill(prompt, live[0], table, rt.uses_local_block_tables)
    assert_same_calls(reference.calls("prefill"), [by_name["prefill"].calls[i] for i in mine])
    reference.decode(ids, pos, bt, lbt, prefill_mask=getattr(out, "attention_mask", None),
                     live=live)
    assert_same_calls(reference.calls(f"decoder_batch_{config.lanes}"), decoder.calls[:1])

    # every smaller decode graph too (the batcher fills all lanes' rows; other callers pick
    # the smallest graph that holds their busy rows): the fake graph checks the signature
    for b in rt.decoder_batch_sizes:
        graph = by_name[f"decoder_batch_{b}"]
        before = len(graph.calls)
        rt.decode([[1]] * b, [[r] for r in range(b)], [[0] * config.blocks_per_table] * b,
                  [[r] for r in range(b)] if rt.uses_local_block_tables else None)
        assert len(graph.calls) == before + 1


def assert_same_calls(expected: list[list[torch.Tensor]], got: list[list[torch.Tensor]]) -> None:
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert len(e) == len(g), f"call {i}: {len(e)} inputs expected, {len(g)} passed"
        for j, (a, b) in enumerate(zip(e, g, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), (
                f"call {i} input {j}: optimum-rbln passes {a.dtype} {a.tolist()}, the binding "
                f"{b.dtype} {b.tolist()}")


class OptimumReference:
    """optimum-rbln's runtime models over recording graphs, set up by the model class's own
    `setup_runtime`, driven the way a serving stack with its own block tables drives them."""

    def __init__(self, model_cls: Any, cfg: Any, family: str, root: Path,
                 lora_id: int | None) -> None:
        self.cfg, self.family = cfg, family
        self.recorded: dict[str, list[list[torch.Tensor]]] = {}
        model = object.__new__(model_cls)
        model.rbln_config, model.config = cfg, model_config(family)
        model.dtype = cfg.dtype  # what RBLNBaseModel.__init__ sets
        model.model = [self._recorder(cc.compiled_model_name, cc) for cc in cfg.compile_cfgs]
        # the model's own loading step: its embedding from torch_artifacts.pth (inputs_embeds),
        # then setup_runtime
        model.model_save_dir, model.subfolder = root.parent, root.name
        model_cls.__post_init__(model)
        self.model = model
        if lora_id is not None:  # every row with the adapter the binding was loaded with
            ids = torch.full((cfg.batch_size,), lora_id, dtype=torch.int32)
            model.prefill_decoder.lora_int_ids = ids
            for d in model.decoders.values():
                d.lora_int_ids = ids[: d.batch_size]

    def _recorder(self, name: str, cc: Any) -> Any:
        calls = self.recorded.setdefault(name, [])
        graph = FakeGraph(name, [], logit_rows(self.cfg, cc), V)

        def run(*args: Any, out: Any = None) -> torch.Tensor:  # out: optimum's output buffers
            calls.append([a.clone() for a in args])
            return torch.zeros(*graph.rows, V)

        return run

    def calls(self, name: str) -> list[list[torch.Tensor]]:
        return self.recorded[name]

    def prefill(self, prompt: list[int], lane: int, table: torch.Tensor, local: bool) -> Any:
        n = len(prompt)
        return self.model.prefill_decoder(
            input_ids=torch.tensor([prompt]),
            cache_position=torch.arange(n, dtype=torch.int32)[None], batch_idx=lane,
            block_tables=table,
            local_block_tables=torch.tensor([lane], dtype=torch.int16) if local else None)

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, bt: torch.Tensor,
               lbt: torch.Tensor | None, prefill_mask: torch.Tensor | None,
               live: list[int]) -> None:
        b, cfg = ids.shape[0], self.cfg
        kwargs: dict[str, Any] = {}
        if cfg.use_position_ids:
            # vllm-rbln (Gemma3): each live row's mask is the one its prefill returned, a padding
            # row's is empty; then every row's own position is switched on; positions are given
            mask = torch.zeros(b, cfg.max_seq_len, dtype=cfg.dtype)
            for r in live:
                mask[r] = prefill_mask[0]
            mask[torch.arange(b), pos[:, 0].long()] = 1
            kwargs.update(attention_mask=mask, position_ids=pos.to(torch.int32))
        if cfg.requires_batch_sort:
            # the model class sorts a decode batch longest first before the runtime model
            order = torch.argsort(pos[:, 0], descending=True, stable=True)
            ids, pos, bt = ids[order], pos[order], bt[order]
            lbt = None if lbt is None else lbt[order]
            kwargs = {k: v[order] for k, v in kwargs.items()}
        self.model.decoders[b](input_ids=ids, cache_position=pos, block_tables=bt,
                               local_block_tables=lbt, **kwargs)


def test_the_matrix_covers_what_it_names(optimum: dict, tmp_path: Path) -> None:
    """The artifacts are what their names say, by optimum-rbln's own settings and signatures."""
    def compiled(name: str) -> tuple[Any, dict[str, list[str]]]:
        family, settings, _, _ = MATRIX[name]
        cfg = compile_artifact(optimum, tmp_path / name, family, settings)
        caches = {m.name for m in cfg.cache_metas}
        return cfg, {cc.compiled_model_name: [n for n, _, _ in cc.input_info if n not in caches]
                     for cc in cfg.compile_cfgs}

    cfg, sig = compiled("gemma3")   # always a mask and position ids: prefill 7, decode 6
    assert (cfg.cache_impl, len(sig["prefill"]), len(sig["decoder_batch_2"])) == ("hybrid", 7, 6)
    cfg, sig = compiled("qwen2-hybrid")
    assert cfg.cache_impl == "hybrid" and not cfg.use_attention_mask
    assert "local_block_tables" in sig["prefill"]
    cfg, _ = compiled("llama-eager-unaligned")
    assert cfg.attn_impl == "eager" and cfg.max_seq_len % cfg.prefill_chunk_size
    cfg, _ = compiled("llama-flash-sorted")
    assert cfg.attn_impl == "flash_attn" and cfg.requires_batch_sort
    assert cfg.max_seq_len // cfg.kvcache_block_size == 2
    _, sig = compiled("llama-logits-to-keep-0")
    assert "query_position" not in sig["prefill"]
    _, sig = compiled("llama-logits-to-keep-1")
    assert "query_position" in sig["prefill"]
    _, sig = compiled("llama-attention-mask")
    assert "attention_mask" in sig["prefill"] and "position_ids" not in sig["prefill"]
    _, sig = compiled("llama-lora")
    assert sig["prefill"][-1] == sig["decoder_batch_1"][-1] == "lora_int_ids"
