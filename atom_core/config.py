"""Configuration of a compiled artifact, validated against the proved capacity rules.

A `Config` that constructs is one the proofs cover: the spec's axioms hold for it, and it has at
least as many KV blocks as the capacity rule for its features requires (`atom-core verify`
proves the rule sufficient and shows, with a stuck trace, that one block fewer is not).
"""

from __future__ import annotations

import difflib
import json
import os
import reprlib
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from atom_core._generated import capacity
from atom_core._generated import core as g

SCRATCH_MODES = ("reserved", "dynamic")


# The runtime's id tensors (atom_core/runtime/protocol.py): block_tables, local_block_tables
# and query_position are int16, cache_position int32. Ids run from 0, so at most 2**15 of each.
INT16_IDS = 2**15
INT32_POSITIONS = 2**31


@attrs.frozen
class Term:
    """How one interface names a Config field: its `name` there, in its `style`'s syntax."""
    name: str
    # field: the Python API (kv_blocks=16); flag: the command line (--kv-blocks 16, --preemption,
    # --no-prefix-cache); key: an artifact's rbln_config.json (kvcache_num_blocks=16)
    style: str = "field"

    def give(self, value: Any) -> str:
        """What to write to set the field to `value`."""
        if self.style == "flag":
            if isinstance(value, bool):
                return self.name if value else "--no-" + self.name.removeprefix("--")
            return f"{self.name} {value}"
        if self.style == "key":
            return f"{self.name}=" + (json.dumps(value) if isinstance(value, (bool, str))
                                      else _short(value))
        return f"{self.name}={_short(value)}"

    def bound(self, op: str, n: int) -> str:
        """`op` (">=" or "<=") `n`, as this interface would say it."""
        if self.style == "flag":
            return f"{self.name} {n} or {'more' if op == '>=' else 'less'}"
        return f"{self.name} {op} {n}"

    def option(self) -> str:
        """The name to give a value to (`kv_blocks=`, `--kv-blocks`, `kvcache_num_blocks`)."""
        return f"{self.name}=" if self.style == "field" else self.name


@attrs.frozen
class Vocabulary:
    """The words a message about a Config uses for its fields: each message is written once,
    over a Vocabulary, and says what to change in the terms of the interface the user set it
    through (Config field names from the Python API, flags on the command line, rbln_config
    keys for an artifact), and where a value the user did not give came from."""
    terms: Mapping[str, Term] = attrs.field(factory=dict)
    # field -> where its value came from when the user did not give it here (a default, a key
    # of a file), said beside the value
    origins: Mapping[str, str] = attrs.field(factory=dict)

    def term(self, field: str) -> Term:
        return self.terms.get(field) or Term(field)

    def name(self, field: str) -> str:
        return self.term(field).name

    def option(self, field: str) -> str:
        return self.term(field).option()

    def give(self, field: str, value: Any) -> str:
        return self.term(field).give(value)

    def at_least(self, field: str, n: int) -> str:
        return self.term(field).bound(">=", n)

    def at_most(self, field: str, n: int) -> str:
        return self.term(field).bound("<=", n)

    def now(self, field: str, value: Any) -> str:
        """The field's value as it stands, with where it came from if the user did not give
        it (`block_size=64 (the built-in tiny model's default; --block-size sets it)`)."""
        origin = self.origins.get(field)
        if origin is None:
            return self.give(field, value)
        term = self.term(field)
        sets = f"; {term.name} sets it" if term.style == "flag" else ""
        return f"{field}={_short(value)} ({origin}{sets})"


# The Python API's words: Config's own field names.
PYTHON = Vocabulary()


def flag_vocabulary(fields: Iterable[str], origins: Mapping[str, str] | None = None,
                    keys: Mapping[str, str] | None = None) -> Vocabulary:
    """The command line's words: `--field-name` for each of `fields` (the Config fields the
    command has a flag for), an rbln_config key for a field set by a file with no flag here
    (`keys`, field -> key), field names for the rest."""
    terms = {f: Term(k, "key") for f, k in (keys or {}).items()}
    terms.update({f: Term("--" + f.replace("_", "-"), "flag") for f in fields})
    return Vocabulary(terms, dict(origins or {}))


class ConfigError(ValueError):
    """A configuration the proofs do not cover; the message says what to change. Raised with
    a function of a `Vocabulary`, it says so in any interface's words (`in_terms`); str() gives
    the Python API's."""

    def __init__(self, message: str | Callable[[Vocabulary], str]) -> None:
        self._say: Callable[[Vocabulary], str] = \
            message if callable(message) else (lambda _v: message)
        super().__init__(self._say(PYTHON))

    def in_terms(self, vocab: Vocabulary) -> str:
        """The message in `vocab`'s words."""
        return self._say(vocab)

    def reworded(self, vocab: Vocabulary) -> ConfigError:
        """This error as `vocab` says it (for a caller that only reads str())."""
        return ConfigError(self.in_terms(vocab))

    def __reduce__(self) -> tuple[Any, ...]:
        # (the message function may not pickle: a process pool gets the words)
        return ConfigError, (str(self),)


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


def _not_int_hint(value: Any) -> str:
    """Why an integer-looking value is refused: a numpy integer (np.int64(128)) reads as a
    positive integer in the message, so say it is not a Python int and how to convert it."""
    if isinstance(value, bool) or isinstance(value, int) or not hasattr(value, "__index__"):
        return ""
    kind = f"{type(value).__module__}.{type(value).__name__}"
    return f" (a {kind}, not a Python int: pass int(value))"


def _positive(name: str):
    def check(_inst: Any, _attr: Any, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(lambda v: f"{v.name(name)} must be a positive integer, got "
                              f"{_short(value)}" + _not_int_hint(value))
    return check


def _not_bool(name: str, value: Any) -> ConfigError:
    return ConfigError(lambda v: f"{v.name(name)} must be True or False, got {_short(value)}")


def _short(value: Any) -> str:
    """repr(value), cut short: a message quotes what it refuses, and a value read from a file
    may be a list of a million items or a thousand-digit number."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<an integer of {value.bit_length()} bits>"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60


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
                              f"None, got {_short(self.scratch_block)}"
                              + _not_int_hint(self.scratch_block))
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window <= 0):
            raise ConfigError(lambda v: f"{v.name('sliding_window')} must be a positive integer "
                              f"(the window of the model's sliding layers) or None, got "
                              f"{_short(self.sliding_window)}" + _not_int_hint(self.sliding_window))
        if (isinstance(self.host_cache_blocks, bool) or not isinstance(self.host_cache_blocks, int)
                or self.host_cache_blocks < 0):
            raise ConfigError(lambda v: f"{v.name('host_cache_blocks')} must be an integer >= 0 "
                              f"(0: no host tier), got {_short(self.host_cache_blocks)}"
                              + _not_int_hint(self.host_cache_blocks))
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
                              f"got {_short(self.scratch)}")
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
    no block: a hit whose cache entry is the only reusable block is taken over by the lane
    (`admit_adopt`, `grow_adopt`) instead of copied. With preemption: one lane's whole table,
    plus a scratch or padding block."""
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


# --------------------------------------------------------------------------- rbln_config.json
# The names optimum-rbln writes into a compiled artifact's rbln_config.json, and the ones
# vllm-rbln users pass on its command line, for each Config field: (field, aliases).
RBLN_ALIASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lanes", ("batch_size", "max_num_seqs")),
    ("kv_blocks", ("kvcache_num_blocks", "num_gpu_blocks_override")),
    ("block_size", ("kvcache_block_size", "block_size")),
    ("max_seq_len", ("max_seq_len", "max_model_len")),
    ("prefill_chunk", ("prefill_chunk_size",)),
    ("prefix_cache", ("enable_prefix_caching",)),
    ("sliding_window", ("sliding_window",)),
)


# The largest rbln_config.json read: optimum-rbln writes a few kilobytes; past this it is not
# one (and a device or an endless pipe would be read forever).
MAX_RBLN_BYTES = 16 * 2**20


@attrs.frozen
class RblnSettings:
    """An artifact's settings, read and checked once (`read_rbln`): a path may be readable only
    once (a pipe, `--rbln-config <(ssh host cat rbln_config.json)`), and two reads of a file
    being rewritten could disagree."""
    data: Mapping[str, Any]  # the raw settings (a multimodal artifact's: its language model's)
    where: str  # where they came from, named in every message
    fields: Mapping[str, Any]  # the Config fields they give, by field name
    keys: Mapping[str, str]  # field -> the key that gave it

    def origins(self, given: Iterable[str] = ()) -> dict[str, str]:
        """field -> where its value came from, for the fields the file gives and `given` not."""
        return {f: f"{k} in {self.where}" for f, k in self.keys.items() if f not in given}


def read_rbln(rbln_config: Any) -> RblnSettings:
    """The one way atom-core reads optimum-rbln / vllm-rbln settings (a dict, a compiled
    artifact's directory or its rbln_config.json): every way the file or a key read from it
    can be wrong is a ConfigError naming the file, the key and what to give."""
    if isinstance(rbln_config, RblnSettings):
        return rbln_config
    data, where = _load_rbln(rbln_config)
    fields, keys = _fields_of(data, where)
    return RblnSettings(data=data, where=where, fields=fields, keys=keys)


def _load_rbln(rbln_config: Any) -> tuple[dict[str, Any], str]:
    """The settings dict and where it came from (for messages)."""
    if isinstance(rbln_config, dict):
        data, where = rbln_config, "rbln_config"
    elif not isinstance(rbln_config, (str, os.PathLike)):
        raise ConfigError(f"rbln_config must be a dict of settings, a compiled artifact's "
                          f"directory or its rbln_config.json, got {_short(rbln_config)}")
    else:
        path = Path(rbln_config)
        data = _parse(path / "rbln_config.json" if path.is_dir() else path)
        where = str(path / "rbln_config.json" if path.is_dir() else path)
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(data).__name__}")
    if "max_seq_len" not in data and "max_model_len" not in data:
        # a causal LM nested in a multimodal artifact (e.g. {"language_model": {...}})
        nested = [v for v in data.values()
                  if isinstance(v, dict) and ("max_seq_len" in v or "max_model_len" in v)]
        if len(nested) == 1:
            data = nested[0]
    return data, where


def _parse(path: Path) -> Any:
    """The JSON value of the file at `path`, read once."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RBLN_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: give a compiled artifact's directory or "
                          "its rbln_config.json") from None
    except OSError as exc:  # a directory named rbln_config.json, no read permission, ...
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}; give a readable "
                          "rbln_config.json (or the compiled artifact's directory)") from None
    if len(raw) > MAX_RBLN_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_RBLN_BYTES // 2**20} MiB, which no "
                          "rbln_config.json is: give the artifact's rbln_config.json")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a UTF-8 text file ({exc.reason} at byte "
                          f"{exc.start}): give the artifact's rbln_config.json") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests its JSON too deeply to read (an rbln_config.json is "
                          "a flat object of settings): give the artifact's "
                          "rbln_config.json") from None
    except ValueError:  # a number past Python's digit limit for int()
        raise ConfigError(f"{path} holds a number of more than {sys.get_int_max_str_digits()} "
                          "digits, which no setting is: give the artifact's "
                          "rbln_config.json") from None


# The other keys the files hold that atom-core reads, by the Config field they set.
RBLN_OTHER_KEYS = {"decoder_batch_sizes": "lanes", "cache_impl": "sliding_window"}
# Keys optimum-rbln 0.12.0 / vllm-rbln write whose names are close to one above but mean
# something else (an encoder-decoder's lengths, a vision tower's patch, Gemma3's image prefill
# chunk, which layers slide, vllm's token budget): not typos.
RBLN_NEAR_NAMES = frozenset({"dec_max_seq_len", "enc_max_seq_len", "image_prefill_chunk_size",
                             "patch_size", "sliding_window_layers", "max_num_batched_tokens"})


def _misspelt_key(data: Mapping[str, Any], fields: Mapping[str, Any], where: str) -> None:
    """A key that is not one atom-core reads but is spelt like one (`max_seq_length`,
    `kv_cache_block_size`) would be ignored, and its field silently take its default: refuse it
    while that field is not set by a correctly spelt key."""
    names = {a: f for f, aliases in RBLN_ALIASES for a in aliases} | RBLN_OTHER_KEYS
    for key in data:
        if not isinstance(key, str) or key in names or key in RBLN_NEAR_NAMES:
            continue
        close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.8)
        if close and names[close[0]] not in fields and close[0] not in data:
            raise ConfigError(f"{where}: unknown setting {key!r}: did you mean {close[0]!r}? "
                              f"(a misspelt key is not read, so {names[close[0]]} would "
                              "silently take its default); rename it")


def rbln_settings(rbln_config: Any) -> dict[str, Any]:
    """The raw settings of a dict, a compiled artifact's directory or its rbln_config.json
    (a multimodal artifact's language model's), e.g. for `rbln_compile_errors`."""
    return dict(read_rbln(rbln_config).data)


def rbln_fields(rbln_config: Any) -> dict[str, Any]:
    """The Config fields that optimum-rbln / vllm-rbln settings give (a dict, a compiled
    artifact's directory or its rbln_config.json), by Config field name; each is checked for
    its type, nothing else (the CLI's check-config reports an unsafe artifact instead of
    raising)."""
    return dict(read_rbln(rbln_config).fields)


def rbln_artifact(rbln_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`rbln_fields`, `rbln_settings`) of one read of the file (see `RblnSettings`)."""
    read = read_rbln(rbln_config)
    return dict(read.fields), dict(read.data)


def _fields_of(data: Mapping[str, Any],
               where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The Config fields settings already read from `where` (named in every message) give,
    and the key that gave each."""
    fields: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for field, aliases in RBLN_ALIASES:
        given = [(a, data[a]) for a in aliases if data.get(a) is not None]
        for alias, value in given:
            _check_rbln_type(where, alias, field, value)
        if len({(type(v), v) for _, v in given}) > 1:
            (a, va), (b, vb) = given[0], given[1]
            raise ConfigError(f"{where}: {a}={va!r} and {b}={vb!r} conflict (both set "
                              f"{field}); keep one of them")
        if given:
            fields[field], keys[field] = given[0][1], given[0][0]
    for key in RBLN_TEXT_KEYS:
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}: {key}={_short(value)} must be a string (or null); "
                              "write it as optimum-rbln does")
    part = data.get("kvcache_partition_len")
    if part is not None and (isinstance(part, bool) or not isinstance(part, int) or part <= 0):
        raise ConfigError(f"{where}: kvcache_partition_len={_short(part)} must be a positive "
                          "integer (flash attention's partition, the paged block size) or null; "
                          "write it as a JSON integer")
    cache_impl = data.get("cache_impl")
    if cache_impl == "static":  # every layer global: a window elsewhere in the file is not ours
        fields.pop("sliding_window", None)
        keys.pop("sliding_window", None)
    elif cache_impl == "sliding_window":
        raise ConfigError(f"{where}: cache_impl='sliding_window' (every layer sliding, no global "
                          "block tables) is not supported; atom-core serves 'static' and "
                          "'hybrid' artifacts")
    elif cache_impl not in (None, "hybrid"):
        raise ConfigError(f"{where}: cache_impl={_short(cache_impl)} is not one optimum-rbln "
                          "writes; give 'static' (every layer global) or 'hybrid' (sliding "
                          "and global layers)")
    sizes = data.get("decoder_batch_sizes")
    if sizes is not None and (not isinstance(sizes, list) or not sizes or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)):
        raise ConfigError(f"{where}: decoder_batch_sizes={_short(sizes)} must be a non-empty "
                          "list of positive integers (the decode graphs' batch sizes); "
                          "recompile, or remove it to use batch_size")
    if sizes and "lanes" in fields and max(sizes) != fields["lanes"]:
        raise ConfigError(f"{where}: decoder_batch_sizes={_short(sizes)} must have its largest "
                          f"equal to the batch size {fields['lanes']} (the lanes the scheduler "
                          f"fills); recompile, or set batch_size={max(sizes)}")
    if sizes and "lanes" not in fields:
        fields["lanes"], keys["lanes"] = max(sizes), "decoder_batch_sizes"
    _misspelt_key(data, fields, where)
    return fields, keys


# Config fields that are booleans in rbln_config.json; every other aliased field is an integer.
RBLN_BOOLS = ("prefix_cache",)
# ... of which 0 means something (optimum-rbln's "estimate the block count when compiling",
# `estimate_message`); every other one is positive.
RBLN_ZERO = ("kv_blocks",)
# Other settings atom-core reads (`rbln_compile_errors`, `cache_impl` above): text when given.
RBLN_TEXT_KEYS = ("attn_impl", "npu", "cache_impl")


def _check_rbln_type(where: str, alias: str, field: str, value: Any) -> None:
    """A setting of the wrong JSON type names the file's key, not only the Config field (the
    CLI does arithmetic on these before Config sees them)."""
    if field in RBLN_BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {alias}={_short(value)} must be true or false (it "
                              f"sets {field}); write it as a JSON boolean")
        return
    least = 0 if field in RBLN_ZERO else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a non-negative integer" if least == 0 else "a positive integer"
        raise ConfigError(f"{where}: {alias}={_short(value)} must be {kind} (it sets {field}); "
                          "write it as a JSON integer" + _not_int_hint(value))


def estimate_message(where: Any, v: Vocabulary = PYTHON) -> str:
    """kvcache_num_blocks=0: optimum-rbln's "estimate when compiling", not a block count."""
    return (f"{where}: kvcache_num_blocks=0 asks optimum-rbln to estimate the block count when "
            "compiling; read the settings of the compiled artifact (its rbln_config.json holds "
            f"the estimate), or give {v.option('kv_blocks')}")


# The fields an artifact's settings must give (or the caller), and the keys that give them.
RBLN_REQUIRED = {"lanes": "batch_size (or max_num_seqs)",
                 "kv_blocks": "kvcache_num_blocks (or num_gpu_blocks_override)",
                 "max_seq_len": "max_seq_len (or max_model_len)"}


def artifact_fields(settings: RblnSettings, given: Mapping[str, Any], vocab: Vocabulary,
                    need: Iterable[str] = tuple(RBLN_REQUIRED),
                    blocks: bool = True) -> dict[str, Any]:
    """The Config fields of an artifact's `settings` under the ones `given` (which win), as
    every interface reads a file: kvcache_num_blocks=0 (optimum-rbln's estimate) is refused,
    and so is a field of `need` that neither gives (max_seq_len too: Config's 4096 default
    would invent the table size and the longest prompt of settings that never said them),
    each saying what to give in `vocab`'s words. `blocks=False`: the caller does not take
    the block count (`min-blocks` answers it), so an estimate is no error."""
    fields = {**settings.fields, **given}
    if not blocks:
        fields.pop("kv_blocks", None)
    elif fields.get("kv_blocks") == 0:
        raise ConfigError(estimate_message(settings.where, vocab))
    for field in need:
        if field not in fields:
            raise ConfigError(f"{settings.where} has no {RBLN_REQUIRED[field]}: give it in the "
                              f"file or as {vocab.option(field)}")
    return fields


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


# ----------------------------------------------------------------- what optimum-rbln compiles
# optimum-rbln 0.12.0's limits on the KV cache's dynamic axis (modeling_attention_utils:
# `AttentionLimits`), for ATOM (RBLN-CA*, and any host without an NPU named) and REBEL
# (RBLN-CR*): eager max_seq_len, flash-attention partition length, sliding window.
RBLN_LIMITS = {"ATOM": (32_768, 1_024, 32_768, 32_768),
               "REBEL": (16_384, 1_024, 16_384, 32_767)}


def _rbln_attn(cfg: Config, settings: Mapping[str, Any]) -> Any:
    """The attention optimum-rbln compiles `cfg` with: the artifact's `attn_impl` as written
    (`rbln_compile_errors` names one it does not know), else the one its sizes need (flash
    attention for paged tables or a given partition length)."""
    given = settings.get("attn_impl")
    if given:
        return given
    paged = settings.get("kvcache_partition_len") is not None or cfg.block_size < cfg.max_seq_len
    return "flash_attn" if paged else "eager"


def _rbln_min_blocks(attn: str, blocks_per_table: int, lanes: int) -> int:
    """optimum-rbln 0.12.0's least kvcache_num_blocks: a block per sequence (eager), or the
    flash-attention minimum min(max(T, batch_size) + 1, T * batch_size)."""
    t, b = blocks_per_table, lanes
    return min(max(t, b) + 1, t * b) if attn == "flash_attn" else b


def rbln_min_kv_blocks(cfg: Config, settings: Mapping[str, Any] | None = None) -> int:
    """The fewest KV blocks optimum-rbln 0.12.0 compiles for `cfg`'s sizes (`settings` as for
    `rbln_compile_errors`); `min-blocks --rbln` answers the larger of this and the spec's
    rule, so that `check-config --rbln` accepts the block count it gives."""
    return _rbln_min_blocks(_rbln_attn(cfg, settings or {}), cfg.blocks_per_table, cfg.lanes)


def rbln_compile_errors(cfg: Config, settings: Mapping[str, Any] | None = None,
                        kv_blocks: int | None = None, v: Vocabulary = PYTHON) -> list[str]:
    """What optimum-rbln 0.12.0 refuses to compile (or compiles into other graphs) for `cfg`'s
    sizes, one message per setting, each naming the fix; [] when it compiles. `settings`: the
    artifact's other rbln_config settings (`attn_impl`, `kvcache_partition_len`, `npu`); without
    `attn_impl` the one `cfg` needs is assumed (eager for one block per sequence, flash attention
    with kvcache_partition_len = block_size for paged tables). `kv_blocks`: the artifact's block
    count when it differs from `cfg`'s (check-config checks a Config of at least the minimum).
    `v`: the words for cfg's fields (the CLI's flags)."""
    settings = settings or {}
    npu = settings.get("npu")
    family = "REBEL" if isinstance(npu, str) and npu.startswith("RBLN-CR") else "ATOM"
    max_eager, min_part, max_part, max_window = RBLN_LIMITS[family]
    seq, block, b = cfg.max_seq_len, cfg.block_size, cfg.lanes
    k = cfg.kv_blocks if kv_blocks is None else kv_blocks
    part = settings.get("kvcache_partition_len")
    attn = _rbln_attn(cfg, settings)
    errors: list[str] = []
    if attn not in ("eager", "flash_attn"):
        return [f"attn_impl={attn!r} is not one optimum-rbln compiles ('eager' or "
                "'flash_attn'); recompile with one of them"]
    if attn == "eager":
        if block != seq:
            errors.append(
                f"attn_impl='eager' keeps one block per sequence (kvcache_block_size = "
                f"max_seq_len), but {v.now('block_size', block)} and "
                f"{v.now('max_seq_len', seq)}; compile paged tables with attn_impl='flash_attn' "
                f"and kvcache_partition_len={block}, or use {v.give('block_size', seq)}")
        if seq > max_eager:
            errors.append(
                f"{v.now('max_seq_len', seq)} exceeds optimum-rbln's {family} limit of "
                f"{max_eager} for 'eager' attention; use {v.at_most('max_seq_len', max_eager)}, "
                f"or flash attention (paged tables: {v.name('block_size')} = "
                f"kvcache_partition_len in {min_part}..{max_part}, dividing max_seq_len)")
    else:
        part = block if part is None else part
        if part != block:
            errors.append(
                f"attn_impl='flash_attn' needs kvcache_block_size equal to "
                f"kvcache_partition_len={part}, got {v.now('block_size', block)}; use "
                f"{v.give('block_size', part)}")
        if seq % part or seq // part < 2:
            errors.append(
                f"attn_impl='flash_attn' needs {v.now('max_seq_len', seq)} to be a multiple of "
                f"at least two partitions of kvcache_partition_len={part}; use a partition (and "
                f"{v.name('block_size')}) that divides max_seq_len at least twice, or eager "
                f"attention ({v.name('block_size')} = max_seq_len)")
        if not min_part <= part <= max_part:
            errors.append(
                f"kvcache_partition_len={part} (the paged block_size) is outside optimum-rbln's "
                f"{family} range {min_part}..{max_part} for 'flash_attn'; use a "
                f"{v.name('block_size')} in that range, or eager attention "
                f"({v.name('block_size')} = max_seq_len <= {max_eager})")
        if seq < 2 * min_part:
            errors.append(
                f"{v.now('max_seq_len', seq)} is below optimum-rbln's minimum {2 * min_part} "
                f"for 'flash_attn' (two partitions of at least {min_part}); use eager attention "
                f"({v.name('block_size')} = max_seq_len) or "
                f"{v.at_least('max_seq_len', 2 * min_part)}")
    if cfg.sliding_window is not None and cfg.sliding_window > max_window - cfg.prefill_chunk:
        errors.append(
            f"{v.now('sliding_window', cfg.sliding_window)} exceeds optimum-rbln's {family} "
            f"limit of {max_window} - prefill_chunk ({cfg.prefill_chunk}) = "
            f"{max_window - cfg.prefill_chunk}; a model with that window cannot be compiled "
            f"for this NPU with this chunk (use a smaller {v.name('prefill_chunk')})")
    t = seq // block
    need = _rbln_min_blocks(attn, t, b)
    rule = ("min(max(T, batch_size) + 1, T * batch_size)" if attn == "flash_attn"
            else "batch_size")
    if k < need:
        errors.append(
            f"{v.now('kv_blocks', k)} is below optimum-rbln's minimum kvcache_num_blocks="
            f"{need} for batch_size={b} with T = {t} block{'s' if t > 1 else ''} per sequence "
            f"({rule}); compile with kvcache_num_blocks >= {need}")
    return errors


# Why the RBLN binding refuses a host tier (and PD), and why a runtime without local-slot
# host copies (RBLN's) refuses a hybrid model's prefix cache: `batcher.check_runtime` and
# `rbln_binding_errors` give the same words.
HOST_KV_REFUSAL = (
    "host KV transfers (fetch_kv_cache/update_kv_cache of one block, used by the host cache tier "
    "and by PD) are off for RBLN: neither optimum-rbln nor vllm-rbln moves single blocks to and "
    "from the host, and no device run has shown yet that fetching block X then updating block Y "
    "moves exactly X's content. Serve without them (host_cache_blocks=0, no PD), or, to test "
    "them on a device, load with RblnRuntime.from_compiled(..., host_kv_transfers=True)")
LOCAL_COPY_REFUSAL = (
    "a hybrid model's hits restore sliding-window snapshots, and this runtime cannot move a "
    "local slot to and from the host (fetch_local_cache/update_local_cache); set "
    "prefix_cache=False")

RBLN_SERVES = "atom-core's RBLN runtime would not serve it"


def rbln_binding_errors(cfg: Config) -> list[str]:
    """What `AtomBatcher` refuses over `RblnRuntime.from_compiled` (its defaults: no host KV
    transfers, no local-slot host copies) for `cfg`, as `check_runtime` words it; [] when it
    serves. (tests/test_config_edge_audit.py builds the batcher over an RblnRuntime to check
    both refuse the same.)"""
    errors = []
    if cfg.host_cache_blocks:
        errors.append(f"host_cache_blocks: {HOST_KV_REFUSAL}")
    if cfg.sliding_window is not None and cfg.prefix_cache:
        errors.append(f"prefix_cache: {LOCAL_COPY_REFUSAL}")
    return errors


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
