"""Audit of the RBLN binding against what optimum-rbln 0.12.0 compiles: artifacts whose graphs the
binding would call wrongly on a device are refused when loaded.

Artifacts are written by optimum-rbln's own config code (as in test_rbln_conformance.py) and
loaded under the fake `rebel` (tests/rbln_fake.py), whose graphs take exactly the input list
optimum-rbln compiled them with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rbln_fake import installed
from test_rbln_conformance import EAGER, GRAPHS, V, compile_artifact, graphs_of, optimum

from atom_core.runtime.rbln import (
    RblnArtifactError,
    RblnRuntime,
    check_compiled_inputs,
    graph_inputs,
)

__all__ = ["optimum"]  # the fixture, imported for pytest


def load(root: Path, cfg: Any, **kwargs: Any) -> RblnRuntime:
    GRAPHS.clear()
    GRAPHS.update(graphs_of(cfg, root))
    with installed(lambda path, _kwargs: GRAPHS[path]):
        return RblnRuntime.from_compiled(root, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_bidirectional_prefill_artifact_is_refused(optimum: dict, tmp_path: Path,
                                                      family: str) -> None:
    """With an attention mask and position ids but no image_prefill phase, optimum-rbln compiles
    the prefill graph's attention bidirectional within a chunk (a prefix-LM prefill); the
    binding prefills causally in chunks, so such an artifact is refused, not served."""
    settings = {**EAGER, "use_attention_mask": True, "use_position_ids": True}
    cfg = compile_artifact(optimum, tmp_path / family, family, settings)
    # optimum-rbln's own reading of what it compiled
    assert cfg.use_bidirectional_prefill and not cfg.use_image_prefill
    with pytest.raises(RblnArtifactError, match="bidirectional attention within a chunk"):
        load(tmp_path / family, cfg)


def test_gemma3_with_an_image_prefill_phase_is_causal_and_served(optimum: dict,
                                                                 tmp_path: Path) -> None:
    settings = {**EAGER, "phases": ["prefill", "image_prefill", "decode"],
                "image_prefill_chunk_size": EAGER["prefill_chunk_size"],
                "use_inputs_embeds": True, "embedding": True}
    cfg = compile_artifact(optimum, tmp_path / "g", "gemma3", settings)
    assert not cfg.use_bidirectional_prefill
    rt = load(tmp_path / "g", cfg)
    assert rt.inputs.position_ids and rt.inputs.attention_mask == "2d"


def qwen2_vl_artifact(root: Path) -> dict[str, Any]:
    """A Qwen2-VL causal LM as optimum-rbln 0.12.0 saves it: its graphs take `position_emb`
    (mRoPE cos/sin computed on the host) after the block tables, and torch_artifacts.pth holds
    a plain embedding table."""
    import transformers

    with installed(lambda path, kwargs: None):
        from optimum.rbln import (
            RBLNQwen2VLForConditionalGeneration,
            RBLNQwen2VLForConditionalGenerationConfig,
        )

        text = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        mc = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(
            depth=1, embed_dim=32, num_heads=2, hidden_size=64))
        settings = {k: v for k, v in EAGER.items() if k != "attn_impl"}
        cfg = RBLNQwen2VLForConditionalGeneration._update_rbln_config(
            model_config=mc, rbln_config=RBLNQwen2VLForConditionalGenerationConfig(**settings))
        root.mkdir(parents=True)
        cfg.save(root)
        mc.save_pretrained(root)
        for cc in cfg.compile_cfgs:
            (root / f"{cc.compiled_model_name}.rbln").write_bytes(b"")
        torch.save({"embed_tokens": torch.nn.Embedding(V, 64).state_dict()},
                   root / "torch_artifacts.pth")
        assert any(name == "position_emb" for name, _, _ in cfg.compile_cfgs[0].input_info)
        return json.loads((root / "rbln_config.json").read_text())


def test_a_qwen2_vl_artifact_with_position_embeddings_is_refused(tmp_path: Path) -> None:
    """Its rbln_config.json shows only settings the binding builds (inputs_embeds with a plain
    embedding); the extra `position_emb` input is visible only in the recorded input lists."""
    saved = qwen2_vl_artifact(tmp_path / "q")
    with installed(lambda path, kwargs: None), pytest.raises(RblnArtifactError):
        RblnRuntime.from_compiled(tmp_path / "q")
    # the recorded input lists alone refuse it, naming the input the binding does not build
    inputs = graph_inputs(saved, embedding=torch.zeros(V, 64))
    with pytest.raises(RblnArtifactError, match="position_emb"):
        check_compiled_inputs(saved, inputs, saved["decoder_batch_sizes"])


@pytest.mark.parametrize("override", [{"prefill_chunk": 64}, {"block_size": 256},
                                      {"num_blocks": 4}])
def test_explicit_sizes_that_disagree_with_the_compiled_graphs_are_refused(
        optimum: dict, tmp_path: Path, override: dict[str, Any]) -> None:
    """from_compiled's explicit sizes may only restate what was compiled: a chunk or block size
    other than the compiled one would pass tensors of other shapes, and more blocks than
    compiled would address blocks the device cache does not have."""
    cfg = compile_artifact(optimum, tmp_path / "l", "llama", EAGER)
    assert load(tmp_path / "l", cfg, prefill_chunk=cfg.prefill_chunk_size,
                num_blocks=cfg.kvcache_num_blocks).prefill_chunk == cfg.prefill_chunk_size
    assert load(tmp_path / "l", cfg, num_blocks=2).num_blocks == 2  # fewer: a subset, safe
    with pytest.raises(RblnArtifactError):
        load(tmp_path / "l", cfg, **override)
