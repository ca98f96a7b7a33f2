"""An RBLN artifact's settings: reading its rbln_config.json (`read_rbln`, the one reader of
that file), and what optimum-rbln compiles and atom-core's RBLN binding serves for a Config.

Apart from `atom_core.config` because none of it is the Config or its proved capacity rules:
it is the file format and the limits of another project's compiler, read before any Config
exists (`config.from_rbln` builds one from what is read here).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from atom_core import jsonvalue
from atom_core.config_words import PYTHON, ConfigError, Vocabulary, not_int_hint, short

if TYPE_CHECKING:
    from atom_core.config import Config

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
                          f"directory or its rbln_config.json, got {short(rbln_config)}")
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


# Laxer than a request body's reading, as rbln_config.json always was read: a file written by
# Python's json.dump may hold NaN or Infinity for a float setting, and a key atom-core does not
# read must not make the file unreadable (one it reads is refused by its type check, naming the
# key); the decoder's own bounds (its recursion, int()'s digit limit) suffice for a file read
# once; a BOM is refused with the decoder's own hint (decode using utf-8-sig).
_RBLN_JSON = jsonvalue.Reader(max_depth=None, max_digits=None, finite=False, text=False,
                              bom=False)


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
        return _RBLN_JSON.read(raw)
    except jsonvalue.NotUtf8 as exc:
        raise ConfigError(f"{path} is not a UTF-8 text file ({exc.reason} at byte "
                          f"{exc.start}): give the artifact's rbln_config.json") from None
    except jsonvalue.NotJson as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    except jsonvalue.TooDeep:
        raise ConfigError(f"{path} nests its JSON too deeply to read (an rbln_config.json is "
                          "a flat object of settings): give the artifact's "
                          "rbln_config.json") from None
    except jsonvalue.TooManyDigits as exc:
        raise ConfigError(f"{path} holds a number of more than {exc.limit} digits, which no "
                          "setting is: give the artifact's rbln_config.json") from None


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
            raise ConfigError(f"{where}: {key}={short(value)} must be a string (or null); "
                              "write it as optimum-rbln does")
    part = data.get("kvcache_partition_len")
    if part is not None and (isinstance(part, bool) or not isinstance(part, int) or part <= 0):
        raise ConfigError(f"{where}: kvcache_partition_len={short(part)} must be a positive "
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
        raise ConfigError(f"{where}: cache_impl={short(cache_impl)} is not one optimum-rbln "
                          "writes; give 'static' (every layer global) or 'hybrid' (sliding "
                          "and global layers)")
    sizes = data.get("decoder_batch_sizes")
    if sizes is not None and (not isinstance(sizes, list) or not sizes or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)):
        raise ConfigError(f"{where}: decoder_batch_sizes={short(sizes)} must be a non-empty "
                          "list of positive integers (the decode graphs' batch sizes); "
                          "recompile, or remove it to use batch_size")
    if sizes and "lanes" in fields and max(sizes) != fields["lanes"]:
        raise ConfigError(f"{where}: decoder_batch_sizes={short(sizes)} must have its largest "
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
            raise ConfigError(f"{where}: {alias}={short(value)} must be true or false (it "
                              f"sets {field}); write it as a JSON boolean")
        return
    least = 0 if field in RBLN_ZERO else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a non-negative integer" if least == 0 else "a positive integer"
        raise ConfigError(f"{where}: {alias}={short(value)} must be {kind} (it sets {field}); "
                          "write it as a JSON integer" + not_int_hint(value))


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
