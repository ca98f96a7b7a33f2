"""What HFRuntime serves: the checks of a transformers config, checkpoint, model class and dtype
(each refusal an `UnsupportedModelError` saying what was wrong and what to do). See
`atom_core.runtime.hf` for the list of refusals and why each exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from atom_core.runtime.hf_attention import UnsupportedModelError

__all__ = ["DTYPES", "FULL", "HYBRID_MODEL_TYPES", "SLIDING", "SUPPORTED_MODEL_TYPES",
           "check_model_config"]

# model_type -> what it is; each uses the standard attention interface like Llama
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# the hybrid ones: 'sliding_attention' layers (config.layer_types) keep their KV in local slots
HYBRID_MODEL_TYPES = frozenset({"gemma3_text"})
SLIDING, FULL = "sliding_attention", "full_attention"
DTYPES = (torch.float32, torch.float64)


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
    exceeds max_seq_len - 1, so W >= max_seq_len hides no key (`CallGraph.attend` checks each
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

