"""Configuration of a compiled artifact, validated against the proved capacity rules.

A `Config` that constructs is one the proofs cover: the spec's axioms hold for it, and it has at
least as many KV blocks as the capacity rule for its features requires (`atom-core verify`
proves the rule sufficient and shows, with a stuck trace, that one block fewer is not).

The words its messages are written over are `atom_core.config_words`'s; reading an RBLN
artifact's settings and optimum-rbln's own limits, `atom_core.rbln_config`'s. Both are
re-exported here, the import path every caller has used.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import attrs

from atom_core._generated import capacity
from atom_core._generated import core as g
from atom_core.config_words import (
    PYTHON,
    ConfigError,
    Term,
    Vocabulary,
    flag_vocabulary,
    not_int_hint,
    short,
)
from atom_core.rbln_config import (
    HOST_KV_REFUSAL,
    LOCAL_COPY_REFUSAL,
    RBLN_ALIASES,
    RBLN_BOOLS,
    RBLN_LIMITS,
    RBLN_NEAR_NAMES,
    RBLN_OTHER_KEYS,
    RBLN_REQUIRED,
    RBLN_SERVES,
    RBLN_TEXT_KEYS,
    RBLN_ZERO,
    RblnSettings,
    artifact_fields,
    estimate_message,
    rbln_artifact,
    rbln_binding_errors,
    rbln_compile_errors,
    rbln_fields,
    rbln_min_kv_blocks,
    rbln_settings,
    read_rbln,
)

__all__ = [
    "CONST_FIELDS", "HOST_KV_REFUSAL", "INT16_IDS", "INT32_POSITIONS", "LOCAL_COPY_REFUSAL",
    "PYTHON", "RBLN_ALIASES", "RBLN_BOOLS", "RBLN_LIMITS", "RBLN_NEAR_NAMES", "RBLN_OTHER_KEYS",
    "RBLN_REQUIRED", "RBLN_SERVES", "RBLN_TEXT_KEYS", "RBLN_ZERO", "SCRATCH_MODES", "Config",
    "ConfigError", "RblnSettings", "Term", "Vocabulary", "artifact_fields", "axiom_fields",
    "capacity_message", "check_end_tokens", "dead_prefix_cache_message", "estimate_message",
    "features", "flag_vocabulary", "from_rbln", "min_kv_blocks", "prefix_can_hit",
    "rbln_artifact", "rbln_binding_errors", "rbln_compile_errors", "rbln_fields",
    "rbln_min_kv_blocks", "rbln_settings", "read_rbln", "rule_for", "single_block_message",
]

SCRATCH_MODES = ("reserved", "dynamic")


# The runtime's id tensors (atom_core/runtime/protocol.py): block_tables, local_block_tables
# and query_position are int16, cache_position int32. Ids run from 0, so at most 2**15 of each.
INT16_IDS = 2**15
INT32_POSITIONS = 2**31


# The Config fields behind each spec constant (what `Config.consts` reads to set it): a failed
# axiom names them with their values, through the constants it reads (g.AXIOM_CONSTS).
CONST_FIELDS: dict[str, tuple[str, ...]] = {
    "B": ("lanes",),
    "K": ("kv_blocks",),
    "C": ("prefill_chunk",),
    "S": ("block_size",),
    "T": ("block_size", "max_seq_len"),
    "PREFIX": ("prefix_cache",),
    "RESERVED": ("scratch",),
    "SCRATCH": ("scratch_block", "kv_blocks"),
    "HYBRID": ("sliding_window",),
    "HOST": ("host_cache_blocks",),
    "H": ("host_cache_blocks",),
    "PREEMPT": ("preemption",),
}


def axiom_fields(axioms: list[str]) -> list[str]:
    """The Config fields behind the constants the named axioms read, in order, once each."""
    return list(dict.fromkeys(f for a in axioms for c in g.AXIOM_CONSTS.get(a, ())
                              for f in CONST_FIELDS[c]))


def _positive(name: str):
    def check(_inst: Any, _attr: Any, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(lambda v: f"{v.name(name)} must be a positive integer, got "
                              f"{short(value)}" + not_int_hint(value))
    return check


def _not_bool(name: str, value: Any) -> ConfigError:
    return ConfigError(lambda v: f"{v.name(name)} must be True or False, got {short(value)}")


@attrs.frozen(kw_only=True)
class Config:
    lanes: int = attrs.field(validator=_positive("lanes"))
    kv_blocks: int = attrs.field(validator=_positive("kv_blocks"))
    max_seq_len: int = attrs.field(default=4096, validator=_positive("max_seq_len"))
    block_size: int = attrs.field(
        default=attrs.Factory(lambda self: self.max_seq_len, takes_self=True),
        validator=_positive("block_size"))
    prefill_chunk: int = attrs.field(default=128, validator=_positive("prefill_chunk"))
    prefix_cache: bool = False
    # dynamic: padding rows write into any block with no live or cached content (one block
    # fewer); reserved: a fixed scratch block, for artifacts built that way.
    scratch: str = "dynamic"
    scratch_block: int | None = None  # reserved mode only; default: the last block
    # Hybrid (Gemma3-style) models: the sliding window W of their local layers, each lane's
    # sliding KV in its own local slot; None: every layer is global. W >= max_seq_len is
    # accepted and kept: the sliding layers then see the whole sequence (transformers' sliding
    # mask and the slot's last min(p, W) positions are full causal attention), but the model
    # is still hybrid (its runtime takes local_block_tables, and the window must equal the
    # model's, see `check_runtime`), so it is not turned into None.
    sliding_window: int | None = None
    # Host cache tier: evicted prefix-cache entries are stored into this many host slots (one
    # block's KV each) and loaded back on a hit; 0: off.
    host_cache_blocks: int = 0
    # Preemption: a lane that needs a block when none is free pushes the most recently admitted
    # lane's request back to the waiting queue (recomputed later). Lets kv_blocks go down to
    # one lane's whole table plus a block, instead of every lane's.
    preemption: bool = False

    def __attrs_post_init__(self) -> None:
        for flag in ("prefix_cache", "preemption"):
            if not isinstance(getattr(self, flag), bool):
                raise _not_bool(flag, getattr(self, flag))
        if self.scratch_block is not None and (
                isinstance(self.scratch_block, bool) or not isinstance(self.scratch_block, int)):
            raise ConfigError(lambda v: f"{v.name('scratch_block')} must be a block id (int) or "
                              f"None, got {short(self.scratch_block)}"
                              + not_int_hint(self.scratch_block))
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window <= 0):
            raise ConfigError(lambda v: f"{v.name('sliding_window')} must be a positive integer "
                              f"(the window of the model's sliding layers) or None, got "
                              f"{short(self.sliding_window)}" + not_int_hint(self.sliding_window))
        if (isinstance(self.host_cache_blocks, bool) or not isinstance(self.host_cache_blocks, int)
                or self.host_cache_blocks < 0):
            raise ConfigError(lambda v: f"{v.name('host_cache_blocks')} must be an integer >= 0 "
                              f"(0: no host tier), got {short(self.host_cache_blocks)}"
                              + not_int_hint(self.host_cache_blocks))
        too_big = [(name, value, limit) for name, value, limit in (
            ("kv_blocks", self.kv_blocks, INT16_IDS), ("lanes", self.lanes, INT16_IDS),
            ("host_cache_blocks", self.host_cache_blocks, INT16_IDS),
            ("prefill_chunk", self.prefill_chunk, INT16_IDS),
            ("max_seq_len", self.max_seq_len, INT32_POSITIONS)) if value > limit]
        if too_big:
            raise ConfigError(lambda v: (
                "rule 'int16-ids': the runtime addresses blocks, host slots and lanes (local "
                "block tables) with int16 ids, a position within a chunk with an int16 and a "
                "position with an int32; too large: "
                + ", ".join(f"{v.now(n, x)} (at most {lim})" for n, x, lim in too_big)
                + "; use fewer, larger blocks or a smaller artifact"))
        if self.scratch not in SCRATCH_MODES:
            raise ConfigError(lambda v: f"{v.name('scratch')} must be one of {SCRATCH_MODES}, "
                              f"got {short(self.scratch)}")
        if self.prefill_chunk % 64:
            raise ConfigError(self._chunk_message)
        if self.max_seq_len % self.block_size:
            raise ConfigError(self._divide_message)
        if self.scratch_block is not None and not (
                self.scratch == "reserved" and 0 <= self.scratch_block < self.kv_blocks):
            raise ConfigError(lambda v: (
                f"{v.now('scratch_block', self.scratch_block)} needs "
                f"{v.give('scratch', 'reserved')} and a block id in 0..{self.kv_blocks - 1}"))
        failed = g.check_axioms(self.consts())
        if failed:
            # the axioms' docs state the rule; the values here say which settings broke it
            given = axiom_fields(failed)

            def axioms(v: Vocabulary) -> str:
                here = ", ".join(v.now(f, getattr(self, f)) for f in given)
                return (f"configuration violates the spec's axioms {failed}: "
                        + "; ".join(g.AXIOM_DOCS.get(a, a) for a in failed)
                        + (f" (here {here})" if here else ""))
            raise ConfigError(axioms)
        if self.prefix_cache and not prefix_can_hit(self.max_seq_len, self.prefill_chunk):
            raise ConfigError(lambda v: dead_prefix_cache_message(self, v))
        if self.kv_blocks == 1 and (self.lanes > 1 or self.scratch == "reserved"):
            raise ConfigError(lambda v: single_block_message(self, v))
        need = min_kv_blocks(self.lanes, self.prefix_cache, self.scratch,
                             self.blocks_per_table, self.preemption)
        if self.kv_blocks < need:
            raise ConfigError(lambda v: capacity_message(self, need, v))

    def _chunk_message(self, v: Vocabulary) -> str:
        lower = self.prefill_chunk // 64 * 64
        fits = [n for n in (lower, lower + 64) if n > 0]
        return (f"{v.now('prefill_chunk', self.prefill_chunk)} is not a multiple of 64, which "
                "RBLN prefill graphs require; use "
                + " or ".join(v.give("prefill_chunk", n) for n in fits))

    def _divide_message(self, v: Vocabulary) -> str:
        seq, block = self.max_seq_len, self.block_size
        lower = seq // block * block
        fits = [n for n in (lower, lower + block) if n > 0]
        return (f"{v.now('max_seq_len', seq)} is not a multiple of "
                f"{v.now('block_size', block)}: a lane's block table holds max_seq_len / "
                f"block_size whole blocks; use a {v.name('block_size')} that divides {seq}, or "
                + " or ".join(v.give("max_seq_len", n) for n in fits)
                + f" (multiples of {block})")

    @classmethod
    def from_rbln(cls, rbln_config: Any, **overrides: Any) -> Config:
        """From optimum-rbln / vllm-rbln settings (see `from_rbln` below)."""
        return from_rbln(rbln_config, **overrides)

    def consts(self) -> g.Consts:
        """The spec's configuration constants for this artifact."""
        return g.Consts(B=self.lanes, K=self.kv_blocks, C=self.prefill_chunk,
                        S=self.block_size, T=self.blocks_per_table, PREFIX=self.prefix_cache,
                        RESERVED=self.scratch == "reserved", SCRATCH=self.scratch_id,
                        HYBRID=self.sliding_window is not None,
                        HOST=self.host_cache_blocks > 0, H=self.host_cache_blocks,
                        PREEMPT=self.preemption)

    @property
    def blocks_per_table(self) -> int:
        """T: the blocks a lane's table holds (1 for eager artifacts)."""
        return self.max_seq_len // self.block_size

    @property
    def scratch_id(self) -> int:
        return self.kv_blocks - 1 if self.scratch_block is None else self.scratch_block

    @property
    def rule(self) -> str:
        return rule_for(self.prefix_cache, self.scratch, self.blocks_per_table, self.preemption)


def features(prefix_cache: bool, scratch: str) -> str:
    return f"{'prefix cache' if prefix_cache else 'no prefix cache'}, {scratch} scratch"


def rule_for(prefix_cache: bool, scratch: str, blocks_per_table: int = 1,
             preemption: bool = False) -> str:
    """The capacity rule by name, in its general form and for this table size T."""
    key = (prefix_cache, scratch)
    t = blocks_per_table
    if preemption:
        lone, shared = capacity.PREEMPT_BLOCKS[key]
        body = (f"{t + lone}" if lone == shared
                else f"{t + lone} with one lane, {t + shared} with more")
        return f"{capacity.PREEMPT_RULES[key]}; with T = {t}: kv_blocks >= {body}"
    s, c = capacity.SCRATCH_BLOCKS[key], capacity.COPY_BLOCKS[key]
    if t == 1:
        body = "lanes" + (f" + {s + c}" if s + c else "")
    elif 1 + c <= t:  # the hit's pinned source fits beside a lane's first block
        body = f"lanes * {t}" + (f" + {s}" if s else "")
    else:
        body = f"max(lanes * {t}, (lanes - 1) * {t} + {1 + c})" + (f" + {s}" if s else "")
    return f"{capacity.RULES[key]}; with T = {t}: kv_blocks >= {body}"


def min_kv_blocks(lanes: int, prefix_cache: bool, scratch: str,
                  blocks_per_table: int = 1, preemption: bool = False) -> int:
    """The proved capacity rule (see atom_core/_generated/capacity.py): every lane can hold a
    whole table of T blocks, plus the scratch block when it is reserved. The prefix cache costs
    no block, also with T = 1 (no pinned source block beyond the lanes'): a hit whose cache
    entry is the only reusable block is taken over by the lane (`admit_adopt`, `grow_adopt`)
    instead of copied. With preemption: one lane's whole table, plus a scratch or padding
    block. `atom-core verify` proves it sufficient for every lane count, every kv_blocks at or
    above it and every T (proofs/counting.py), except for hybrid models (proved for up to 4
    lanes); it is shown tight (one block fewer reaches a stuck state) for up to 4 lanes."""
    if scratch not in SCRATCH_MODES:
        raise ConfigError(f"scratch must be one of {SCRATCH_MODES}, got {scratch!r}")
    return capacity.min_kv_blocks(lanes, blocks_per_table, (prefix_cache, scratch), preemption)


def prefix_can_hit(max_seq_len: int, prefill_chunk: int) -> bool:
    """Whether any prompt can take a prefix hit: a hit reuses whole chunks (n >= prefill_chunk)
    and leaves a token to compute (n < len(prompt)), and the batcher takes prompts of at most
    max_seq_len - 1 tokens (room for the first generated one); so some prompt can hit iff
    prefill_chunk <= max_seq_len - 2."""
    return prefill_chunk <= max_seq_len - 2


def dead_prefix_cache_message(cfg: Config, v: Vocabulary = PYTHON) -> str:
    longest = cfg.max_seq_len - 1
    chunk = (cfg.max_seq_len - 2) // 64 * 64  # prefill chunks are multiples of 64
    fixes = [f"turn the prefix cache off ({v.give('prefix_cache', False)}: it does nothing here"
             + (" but take the host tier's slots" if cfg.host_cache_blocks else "") + ")",
             f"use {v.at_least('max_seq_len', cfg.prefill_chunk + 2)}"]
    if chunk >= 64:
        fixes.append(f"use {v.at_most('prefill_chunk', chunk)}")
    return (f"{v.give('prefix_cache', True)} can never hit with "
            f"{v.now('prefill_chunk', cfg.prefill_chunk)} and "
            f"{v.now('max_seq_len', cfg.max_seq_len)}: a hit reuses whole chunks and must leave "
            f"at least one prompt token to compute, but a prompt holds at most max_seq_len - 1 "
            f"= {longest} tokens, fewer than the {cfg.prefill_chunk + 1} a one-chunk hit needs. "
            "Fix: "
            + "; or ".join(fixes) + ".")


def single_block_message(cfg: Config, v: Vocabulary = PYTHON) -> str:
    why = []
    if cfg.lanes > 1:
        why.append(f"{v.now('lanes', cfg.lanes)}: a second lane never gets a block, and while "
                   "lane 0 decodes the idle row's padding has no block to write into")
    if cfg.scratch == "reserved":
        why.append(f"{v.now('scratch', 'reserved')}: the only block would be the scratch block")
    need = min_kv_blocks(cfg.lanes, cfg.prefix_cache, cfg.scratch, cfg.blocks_per_table,
                         cfg.preemption)
    return (f"rule 'single-block': {v.give('kv_blocks', 1)} serves exactly one lane, with "
            f"dynamic scratch (block 0 is that lane's block; a single-block PD decode worker is "
            f"{v.give('lanes', 1)}). Here "
            + "; ".join(why) + " (`atom-core verify` shows the stuck runs). "
            "In general: " + capacity_message(cfg, need, v))


def capacity_message(cfg: Config, need: int, v: Vocabulary = PYTHON) -> str:
    missing = need - cfg.kv_blocks
    # (Python's and an artifact's words name what to compile; flags are given as they are)
    verb = "give" if v.term("kv_blocks").style == "flag" else "compile the artifact with"
    fixes = [f"{verb} {v.at_least('kv_blocks', need)}"]
    if cfg.scratch == "reserved":
        alt = min_kv_blocks(cfg.lanes, cfg.prefix_cache, "dynamic", cfg.blocks_per_table,
                            cfg.preemption)
        if alt <= cfg.kv_blocks:
            fixes.append(f"use {v.give('scratch', 'dynamic')} (padding rows write into a free "
                         f"block), which needs {alt}")
    if cfg.lanes > 1:
        fit = max((n for n in range(1, cfg.lanes) if min_kv_blocks(
            n, cfg.prefix_cache, cfg.scratch, cfg.blocks_per_table, cfg.preemption)
            <= cfg.kv_blocks), default=0)
        if fit >= 1:
            fixes.append(f"serve with {v.at_most('lanes', fit)}")
    rule = rule_for(cfg.prefix_cache, cfg.scratch, cfg.blocks_per_table, cfg.preemption)
    if not cfg.preemption and cfg.blocks_per_table > 1:
        alt = min_kv_blocks(cfg.lanes, cfg.prefix_cache, cfg.scratch, cfg.blocks_per_table, True)
        if alt <= cfg.kv_blocks:
            fixes.append(f"turn preemption on ({v.give('preemption', True)}: a lane waiting for "
                         f"a block preempts the most recently admitted one), which needs {alt}")
    return (f"{v.now('kv_blocks', cfg.kv_blocks)} is too few for {v.now('lanes', cfg.lanes)} "
            f"with {features(cfg.prefix_cache, cfg.scratch)}: rule '{rule}' "
            f"needs {need}, {missing} block{'s' if missing > 1 else ''} missing "
            f"(`atom-core check-config` shows the stuck run). Fix: " + "; or ".join(fixes) + ".")


def from_rbln(rbln_config: Any, **overrides: Any) -> Config:
    """A Config from optimum-rbln / vllm-rbln settings (see `rbln_fields`). `overrides` are
    Config field names and win over the file (e.g. `prefix_cache=True`, `preemption=True`).
    Keys the scheduler does not use (the model's id, tensor_parallel_size, ...) are ignored.
    A message names a setting by the key the file gave it with, an override by its name."""
    known = [f.name for f in attrs.fields(Config)]
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
            raise ConfigError(f"from_rbln: {name!r} is not a Config field"
                              + (f"; did you mean {close[0]!r}?" if close else "")
                              + f" (the fields: {', '.join(known)})")
    settings = read_rbln(rbln_config)
    if isinstance(rbln_config, (str, os.PathLike)):
        settings = attrs.evolve(settings, where=str(rbln_config))
    vocab = Vocabulary({f: Term("batch_size" if k == "decoder_batch_sizes" else k, "key")
                        for f, k in settings.keys.items() if f not in overrides})
    fields = artifact_fields(settings, overrides, vocab)
    try:
        return Config(**fields)
    except ConfigError as exc:
        raise exc.reworded(vocab) from None


def check_end_tokens(ids: Any, vocab_size: int, where: str) -> None:
    """Refuse end-of-sequence ids the model can never emit: a token id outside 0..vocab_size-1
    is never sampled, so generation would never stop on it (and indexing with it fails)."""
    ids = [] if ids is None else list(ids) if isinstance(ids, (list, tuple, set, frozenset)) \
        else [ids]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{where}: end-of-sequence token id{'s' if len(bad) > 1 else ''} "
                          f"{', '.join(map(repr, sorted(bad, key=repr)))} outside the model's "
                          f"vocabulary 0..{vocab_size - 1}: generation could never stop on "
                          "it; use the tokenizer that belongs to this model (or fix its "
                          "eos_token_id)")
