"""Audit of HFRuntime by model family: every decoder-only transformers model the runtime claims
(Llama, Mistral, Qwen2, Gemma3 text) serves exactly the tokens of transformers' own greedy
`generate(do_sample=False)` through every scheduler path, and the families it does not claim
are refused before any weight is loaded, with a message naming what is unsupported.

Each model is a tiny random float64 config (weights by `hf.seed_weights`), saved with
`save_pretrained` and loaded back through `HFRuntime.from_pretrained` (the real loading path);
the oracle is the same checkpoint loaded with transformers' default attention and run one
request at a time (`tests.test_runtime_hf.Oracle`: every compared step's top-1/top-2 logit gap
above MARGIN, so rounding cannot flip a token).

One workload, `PATHS`, drives every scheduler path at once on two lanes with the fewest blocks
the preemption rule allows: a 150-token system prompt shared by three requests (prefix-cache
hits of two whole chunks / blocks), tables of several blocks (block 64, max_seq_len 256),
preemption and recomputation (long decodes at the minimum block count), lanes reused by later
requests, padding rows in decode, and one generation running to max_seq_len. Each test also
asserts the paths really ran (`check_paths`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from atom_core.batcher import AtomBatcher  # noqa: E402
from atom_core.config import Config, min_kv_blocks  # noqa: E402
from atom_core.runtime import hf  # noqa: E402
from atom_core.runtime.hf import HFRuntime, UnsupportedModelError  # noqa: E402
from tests.test_runtime_hf import F64  # noqa: E402
from tests.test_runtime_hf_audit import serve  # noqa: E402

S, C, BLOCK = 256, 64, 64  # max_seq_len, prefill chunk, block size: 4 blocks a table
V = 131                    # a vocabulary that is not a multiple of 8
WINDOW = 40                # the Gemma3 sliding window: below a chunk, not a multiple of it


def prompt(n: int, seed: int, vocab: int = V) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def config(lanes: int = 2, *, window: int | None = None, prefix: bool = True,
           preemption: bool = True, extra: int = 0) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, "dynamic", S // BLOCK,
                                                       preemption=preemption) + extra,
                  max_seq_len=S, block_size=BLOCK, prefill_chunk=C, prefix_cache=prefix,
                  sliding_window=window, preemption=preemption)


def paths_work(to_end: bool = False) -> list[tuple[list[int], int]]:
    """Three requests behind one 150-token system prompt (hits of two whole chunks) and one
    unrelated prompt: long decodes on two lanes at the preemption minimum, so lanes are
    preempted, recompute, and are reused. `to_end`: one more that generates to max_seq_len
    (its last step's query at position max_seq_len - 1 = max_position_embeddings - 1)."""
    system = prompt(150, 77)
    work = [(system + prompt(k, 300 + k), n) for k, n in [(3, 90), (10, 80), (1, 60)]]
    work.append((prompt(100, 5), 100))
    if to_end:
        work.append((prompt(S - 40, 6), S))
    return work


def save(model: Any, root: Path, name: str) -> Path:
    d = root / name
    if not d.exists():
        model.save_pretrained(d)
    return d


def check_paths(b: AtomBatcher) -> None:
    s = b.stats
    assert s.prefix_hit_tokens >= 2 * C, "no whole-chunk prefix hit"
    assert s.preemptions > 0 and s.recomputed_tokens > 0, "no preemption"
    assert s.table_grows > 0 and s.decode_rows_padding > 0


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


# --------------------------------------------------------------------------- model builders
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=S, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)


def build(cls: Any, cfg_cls: Any, **fields: Any) -> Any:
    return hf.seed_weights(cls(cfg_cls(**{**COMMON, **fields})), 0).to(F64)


def llama(**fields: Any) -> Any:
    return build(LlamaForCausalLM, LlamaConfig, **fields)


def qwen2(**fields: Any) -> Any:
    return build(Qwen2ForCausalLM, Qwen2Config, **fields)


def mistral(**fields: Any) -> Any:
    return build(MistralForCausalLM, MistralConfig, **fields)


def gemma3(**fields: Any) -> Any:
    base = dict(query_pre_attn_scalar=24, sliding_window=WINDOW,
                layer_types=[hf.SLIDING, hf.FULL, hf.SLIDING], num_hidden_layers=3)
    return build(Gemma3ForCausalLM, Gemma3TextConfig, **{**base, **fields})


# --------------------------------------------------------------------------- served exactly
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": C, "rope_theta": 10000.0}
SERVED: dict[str, Any] = {
    # RoPE scalings: each changes the rotary frequencies; ignored, the tokens change
    "llama-rope-llama3": lambda: llama(rope_scaling=LLAMA3),
    "llama-rope-linear": lambda: llama(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama-rope-dynamic": lambda: llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "llama-rope-yarn": lambda: llama(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": C}),
    # head_dim != hidden / heads, one KV head (GQA 4:1), biases, tied embeddings
    "llama-shapes": lambda: llama(head_dim=24, num_key_value_heads=1, attention_bias=True,
                                  mlp_bias=True, tie_word_embeddings=True),
    # attention bias (always), tied embeddings, one KV head
    "qwen2-tied": lambda: qwen2(tie_word_embeddings=True, num_key_value_heads=1),
    # use_sliding_window with every layer below max_window_layers: all layers full
    "qwen2-window-unused": lambda: qwen2(use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=2),
    # a window on every layer, as long as max_seq_len: never narrower than the sequence
    "mistral-window-S": lambda: mistral(sliding_window=S),
    # Gemma3: final logit soft-capping, query_pre_attn_scalar, another layer pattern, head_dim
    # != hidden / heads, one KV head, linear rope scaling on the global layers only (as the
    # 4B+ checkpoints)
    "gemma3-softcap-pattern": lambda: gemma3(
        final_logit_softcapping=3.0, num_hidden_layers=4, head_dim=16, num_key_value_heads=1,
        layer_types=[hf.FULL, hf.SLIDING, hf.SLIDING, hf.FULL]),
    "gemma3-global-rope-linear": lambda: gemma3(rope_parameters={
        hf.FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        hf.SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}}),
    # tied embeddings (Gemma3's default; see gemma3_tied) and a window wider than max_seq_len
    "gemma3-tied": lambda: gemma3_tied(),
    "gemma3-window-above-S": lambda: gemma3(sliding_window=S + 8),
}


def gemma3_tied() -> Any:
    """Gemma3 with the LM head tied to the embeddings, the embeddings scaled down: Gemma3
    multiplies them by sqrt(hidden), and at N(0, 1) a random tied model repeats its input
    token whatever it attends to, which would check nothing."""
    model = gemma3(tie_word_embeddings=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.125)
    return model


# the ones whose window or RoPE depends on how close a position is to max_position_embeddings
TO_END = {"llama-rope-dynamic", "llama-rope-yarn", "mistral-window-S", "gemma3-window-above-S"}


@pytest.mark.parametrize("name", list(SERVED))
def test_family_is_exact_on_every_path(root: Path, name: str) -> None:
    model = SERVED[name]()
    d = save(model, root, name)
    window = hf.model_window(str(d))
    b = serve(config(window=window), d, paths_work(to_end=name in TO_END))
    check_paths(b)
    served_model = b.runtime.model
    if served_model.config.tie_word_embeddings:  # the head is the embeddings, as saved
        assert served_model.get_output_embeddings().weight.data_ptr() == \
            served_model.get_input_embeddings().weight.data_ptr()


# --------------------------------------------------------------------------- refused up front
def config_only(root: Path, name: str, cfg: Any) -> Path:
    """A checkpoint directory holding config.json only: a refusal from it is made before any
    weight is read (loading weights would fail with another error)."""
    d = root / name
    d.mkdir(exist_ok=True)
    cfg.save_pretrained(d)
    return d


def _refused_configs() -> dict[str, tuple[Any, str]]:
    from transformers import Gemma2Config, Gemma3Config, GemmaConfig, Phi3Config, Qwen3Config

    return {
        "gemma": (GemmaConfig(**COMMON), r"model_type 'gemma'\) is not supported"),
        # attention and final logit soft-capping, alternating sliding layers
        "gemma2": (Gemma2Config(**COMMON), r"model_type 'gemma2'\) is not supported"),
        "phi3": (Phi3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"}),
                 r"model_type 'phi3'\) is not supported"),
        "qwen3": (Qwen3Config(**COMMON), r"model_type 'qwen3'\) is not supported"),
        "gemma3-multimodal": (Gemma3Config(),
                              r"model_type 'gemma3'\) is not supported.*text model"),
        # a window on every layer one short of max_seq_len: the last position must not see 0
        "mistral-window-S-1": (MistralConfig(**{**COMMON, "sliding_window": S - 1}),
                               r"sliding_window=255 < max_seq_len=256"),
        "qwen2-sliding-layers": (Qwen2Config(**{**COMMON, "use_sliding_window": True,
                                                "sliding_window": WINDOW,
                                                "max_window_layers": 1}),
                                 r"qwen2 config has attention layer types.*sliding"),
        "llama-short-positions": (LlamaConfig(**{**COMMON, "max_position_embeddings": S - 1}),
                                  r"max_seq_len=256 exceeds the model's "
                                  r"max_position_embeddings=255"),
        "gemma3-attn-softcap": (Gemma3TextConfig(**{**COMMON, "attn_logit_softcapping": 50.0,
                                                    "sliding_window": WINDOW,
                                                    "layer_types": [hf.SLIDING, hf.FULL]}),
                                r"attn_logit_softcapping"),
    }


@pytest.mark.parametrize("name", list(_refused_configs()))
def test_unsupported_is_refused_before_loading(root: Path, name: str) -> None:
    cfg, message = _refused_configs()[name]
    d = config_only(root, f"refused-{name}", cfg)
    with pytest.raises(UnsupportedModelError, match=message):
        HFRuntime.from_pretrained(d, config(), dtype=F64)


# --------------------------------------------------------------------------- incomplete weights
@pytest.mark.parametrize("cls_name", ["LlamaModel", "LlamaForSequenceClassification"])
def test_checkpoint_without_an_lm_head_is_refused(root: Path, cls_name: str) -> None:
    """A Llama checkpoint with no LM head (the bare decoder, a classifier) has model_type
    'llama', so AutoModelForCausalLM loads it as a LlamaForCausalLM with `lm_head` initialized
    at random: every token would be noise, and a check against generate() on a copy of the
    loaded model (`hf.GenerateOracle`) would agree with it. Refused, naming the weight."""
    import transformers

    model = getattr(transformers, cls_name)(LlamaConfig(**COMMON))
    d = save(model, root, f"headless-{cls_name}")
    with pytest.raises(UnsupportedModelError, match=r"lm_head\.weight.*at random"):
        HFRuntime.from_pretrained(d, config(), dtype=F64)


def test_checkpoint_missing_a_layer_weight_is_refused(root: Path) -> None:
    """Any weight the checkpoint lacks, not only the head (here one layer's q_proj)."""
    from safetensors.torch import load_file, save_file

    d = save(llama(), root, "llama-missing-q")
    f = d / "model.safetensors"
    weights = load_file(f)
    del weights["model.layers.1.self_attn.q_proj.weight"]
    save_file(weights, f, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"layers\.1\.self_attn\.q_proj\.weight"):
        HFRuntime.from_pretrained(d, config(), dtype=F64)


def test_a_model_that_is_not_the_causal_lm_is_refused(root: Path) -> None:
    """`for_config` over a model of the right model_type but another head (a sequence
    classifier loaded with the paged attention) is refused up front rather than failing every
    call on the shape of its logits."""
    import transformers

    d = save(transformers.LlamaForSequenceClassification(LlamaConfig(**COMMON)), root,
             "llama-classifier")
    model = transformers.LlamaForSequenceClassification.from_pretrained(
        d, local_files_only=True, dtype=F64, attn_implementation=hf.ATTENTION)
    with pytest.raises(UnsupportedModelError, match=r"LlamaForSequenceClassification.*"
                                                    r"LlamaForCausalLM"):
        HFRuntime.for_config(model, config())
