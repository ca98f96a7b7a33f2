"""Tests of `AtomScheduler` in vLLM's own engine (CPU). They run in the vLLM venv that
`make vllm-venv` builds (`make test-vllm`), not in the project's: vLLM pins its own torch and
transformers. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a test's
scheduler class can be a subclass defined here."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

VOCAB = 512
GEMMA_WINDOW = 16  # the tiny Gemma3's sliding window


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer whose token i reads "t{i}", saved offline."""
    import transformers as hf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                               unk_token="t0").save_pretrained(path)


def save_tiny_llama(path: Path) -> Path:
    """A small random Llama (head_dim 32: vLLM's CPU attention takes 32 and up) with a
    word-level tokenizer whose token i reads "t{i}", saved offline."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    cfg = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    hf.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    save_tokenizer(path)
    return path


def save_tiny_gemma3(path: Path) -> Path:
    """A small random Gemma3 (hybrid: three sliding-window layers of window 16, then one
    full-attention layer; head_dim 32) with the same tokenizer as `save_tiny_llama`. vLLM
    gives it four KV cache groups: three sliding-window ones and one full-attention one."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    cfg = hf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        sliding_window=GEMMA_WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf.Gemma3ForCausalLM(cfg).eval().save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
