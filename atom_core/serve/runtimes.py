"""Which runtime serves, and with which tokenizer: serve's steps of each runtime in the one
registry of runtimes (atom_core/runtime/registry.py), so a runtime added later plugs in by name
without touching the server.

A factory takes the parsed `ServeOptions` and returns (Config, runtime, tokenizer); the server
checks the runtime against the Config (`check_runtime`) when the batcher is built. A runtime's
`check` says, before anything loads, what is wrong with options it would refuse later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from atom_core.config import (
    Config,
    ConfigError,
    RblnSettings,
    artifact_fields,
    check_end_tokens,
    flag_vocabulary,
    min_kv_blocks,
    read_rbln,
)
from atom_core.runtime import registry
from atom_core.runtime.registry import RuntimeKind, RuntimeRequest
from atom_core.serve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, end_ids

TINY = "tiny"  # the built-in seeded reference model with the byte tokenizer


@attrs.frozen
class ServeOptions:
    model: str  # "tiny" or a model directory (its tokenizer; its weights for runtimes that can)
    runtime: str = "reference"
    compiled: str | None = None  # rbln: the compiled artifact's directory
    # a path, or the settings `check` read from it (read once: the path may be a pipe)
    rbln_config: str | RblnSettings | None = None
    # Config fields given on the command line (they win over --rbln-config)
    overrides: dict[str, Any] = attrs.Factory(dict)
    seed: int = 0
    tokenizer: str | None = None  # --tokenizer DIR (default: the model's)
    chat_template: str | None = None  # --chat-template: a file or the template's text


Factory = Callable[[ServeOptions], tuple[Config, Any, Tokenizer]]
# A runtime's checks of its options that need no model loaded (what --model and --compiled must
# be, the artifact's settings): run before the port is checked and before anything heavy (torch,
# transformers, the weights) is imported, so a mistake is said at once.
Check = Callable[[ServeOptions], ServeOptions]


def _served(kind: RuntimeKind) -> bool:
    return kind.serve is not None


def register_runtime(name: str, factory: Factory, check: Check | None = None) -> None:
    """Serve runtime `name` with `factory` (after `check`): its kind in the registry gets them,
    a new kind (serve only) if there is none."""
    kind = registry.KINDS.get(name) or RuntimeKind(name, "a runtime registered for serve")
    registry.register(attrs.evolve(kind, serve=factory, serve_check=check))


def check(opts: ServeOptions) -> ServeOptions:
    """`opts`, checked as far as it can be without loading a model (the runtime's
    `serve_check`), its --rbln-config read (once); ValueError / ConfigError naming the option
    and what to give."""
    kind = registry.get(opts.runtime, has=_served)
    if opts.rbln_config is not None:
        opts = attrs.evolve(opts, rbln_config=read_rbln(opts.rbln_config))
    return kind.serve_check(opts) if kind.serve_check is not None else opts


def build(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    opts = check(opts)
    factory = registry.get(opts.runtime).serve
    assert factory is not None  # (check refuses a runtime serve has no factory for)
    return factory(opts)  # type: ignore[no-any-return]


# what a model directory's tokenizer is saved as (save_pretrained writes one of these)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")
# what a checkpoint's weights are saved as
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
# HFRuntime's seeded tiny models (atom_core.runtime.hf.TINY_MODELS, named here without
# importing torch)
HF_TINY_MODELS = ("tiny-llama", "tiny-gemma3")


class ModelError(ValueError):
    """--model is not what the runtime can load; the message says what to give."""


def check_model_dir(model: str, weights: bool = False) -> None:
    """--model DIR: a directory with a tokenizer (and, with `weights`, config.json and
    weights), said before anything loads (transformers' own messages come late and point to
    the model hub, which serve never reaches)."""
    path = Path(model)
    what = ("a local checkpoint directory (config.json, its weights and its tokenizer, as "
            "save_pretrained writes them)" if weights else
            "a model directory with its tokenizer (tokenizer.json, ... as save_pretrained "
            f"writes them), or '{TINY}' for the built-in tiny model")
    if not path.exists():
        raise ModelError(f"--model {model}: no such directory; give {what}")
    if not path.is_dir():
        raise ModelError(f"--model {model}: not a directory; give {what}")
    missing = []
    if weights and not (path / "config.json").is_file():
        missing.append("config.json")
    if weights and not any(next(path.glob(g), None) for g in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if missing:
        raise ModelError(f"--model {model}: the directory has no {', no '.join(missing)}; "
                         f"give {what}")


def tokenizer_for(model: str, chat_template: str | None = None,
                  flag: str = "--model") -> Tokenizer:
    """The tokenizer of `model` ('tiny': the byte tokenizer), with `chat_template` (a file or
    the template's text, as --chat-template takes it) instead of its own."""
    if model == TINY:
        return ByteTokenizer()
    check_model_dir(model)
    try:
        tok = HFTokenizer(model)
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' or tokenizers' word for a broken one
        raise ModelError(f"{flag} {model}: cannot load its tokenizer ({type(exc).__name__}: "
                         f"{first_line(exc)}); give a model directory whose tokenizer "
                         "save_pretrained wrote") from None
    if chat_template is not None:
        tok.set_chat_template(read_template(chat_template))
    return tok


def read_template(given: str) -> str:
    """--chat-template's value: a file's text, or the template itself (vLLM takes both)."""
    path = Path(given)
    try:
        if len(given) < 4096 and "{" not in given and path.is_file():
            return path.read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template {given}: cannot read it ({exc})") from None
    if "{" not in given:
        raise ValueError(f"--chat-template {given[:80]}: no such file, and no Jinja template "
                         "(no '{{' or '{%'): give a template file or its text")
    return given


def opts_tokenizer(opts: ServeOptions) -> Tokenizer:
    """The tokenizer `opts` asks for: --tokenizer's directory, else the model's."""
    if opts.tokenizer is not None:
        return tokenizer_for(opts.tokenizer, opts.chat_template, "--tokenizer")
    return tokenizer_for(opts.model, opts.chat_template)


def check_tokenizer_options(opts: ServeOptions) -> None:
    """--tokenizer and --chat-template, said before anything loads."""
    if opts.tokenizer is not None:
        if opts.tokenizer == TINY:
            return
        try:
            check_model_dir(opts.tokenizer)
        except ModelError as exc:
            raise ModelError(str(exc).replace("--model", "--tokenizer", 1)) from None
    elif opts.chat_template is not None and (opts.model == TINY or
                                             opts.model in HF_TINY_MODELS):
        raise ValueError(f"--chat-template: --model {opts.model} has the byte tokenizer, "
                         "which takes no template; give a model directory (or --tokenizer "
                         "DIR) whose tokenizer the template is for")
    if opts.chat_template is not None:
        read_template(opts.chat_template)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (transformers' run to a paragraph)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# the built-in tiny model's artifact when nothing else is said: small enough for a laptop CPU
TINY_DEFAULTS = {"lanes": 4, "max_seq_len": 256, "block_size": 64, "prefill_chunk": 64,
                 "prefix_cache": True}
# the serve command's flags for Config fields (every field but scratch_block has one)
SERVE_FLAGS = ("lanes", "kv_blocks", "max_seq_len", "block_size", "prefill_chunk",
               "prefix_cache", "scratch", "sliding_window", "host_cache_blocks", "preemption")


def model_context(model: str) -> int | None:
    """A checkpoint directory's context: its config.json's `max_position_embeddings` (its text
    config's, for a multimodal model); None without one (the tiny models, a tokenizer-only
    directory)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        n = part.get("max_position_embeddings") if isinstance(part, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def default_max_seq_len(opts: ServeOptions, fields: dict[str, Any]) -> tuple[int, str] | None:
    """(max_seq_len, where it came from) when none was given: the checkpoint's context
    (vLLM's default max_model_len), rounded down to whole blocks and, when --kv-blocks is
    given, capped at the longest table those blocks can give every lane (the proved rule);
    None: no checkpoint context (the tiny default stays)."""
    context = model_context(opts.model)
    if context is None:
        return None
    block = fields.get("block_size", context)
    seq = max(block, context // block * block)
    where = f"the checkpoint's max_position_embeddings ({context})"
    blocks = fields.get("kv_blocks")
    if blocks is not None:
        def need(t: int) -> int:
            return min_kv_blocks(fields["lanes"], fields.get("prefix_cache", False),
                                 fields.get("scratch", "dynamic"), t,
                                 fields.get("preemption", False))
        t = seq // block
        if need(t) > blocks:
            lo, hi = 1, t  # the largest table the blocks allow (need grows with t)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(mid) <= blocks else (lo, mid - 1)
            seq, where = lo * block, f"{where}, capped by --kv-blocks {blocks}"
    return seq, where


def config_for(opts: ServeOptions, defaults: dict[str, Any] | None = None) -> Config:
    """--rbln-config (if any), then the command line's fields; kv_blocks defaults to the proved
    minimum for the rest, max_seq_len (without --rbln-config) to the checkpoint's context
    (`default_max_seq_len`). A refusal names the flags to give (and where a value no flag gave
    came from: the file's key, the tiny model's default, the checkpoint)."""
    given = dict(opts.overrides)
    settings = read_rbln(opts.rbln_config) if opts.rbln_config is not None else None
    origins = {f: "the built-in tiny model's default" for f in defaults or {} if f not in given}
    if defaults is not None and "max_seq_len" not in given:
        found = default_max_seq_len(opts, {**defaults, **given})
        if found is not None:
            defaults = {**defaults, "max_seq_len": found[0]}
            origins["max_seq_len"] = found[1]
    if settings is not None:
        origins.update(settings.origins(given))
    words = flag_vocabulary(SERVE_FLAGS, origins)
    fields = dict(defaults or {})
    try:
        if settings is not None:
            # (a file says its max_seq_len: Config's 4096 default would invent it)
            fields.update(artifact_fields(settings, given, words, need=("max_seq_len",)))
        fields.update(given)
        if "lanes" not in fields:
            raise ConfigError(lambda v: f"give {v.name('lanes')}"
                              + (f" ({settings.where} has no batch_size)" if settings else
                                 " (or --rbln-config with batch_size)"))
        if "kv_blocks" not in fields:
            seq = fields.get("max_seq_len", 4096)
            block = fields.get("block_size", seq)
            whole = all(isinstance(n, int) and n > 0 for n in (seq, block)) and seq % block == 0
            fields["kv_blocks"] = min_kv_blocks(
                fields["lanes"], fields.get("prefix_cache", False),
                fields.get("scratch", "dynamic"),
                seq // block if whole else 1,  # (else Config says what to give)
                fields.get("preemption", False))
            words = flag_vocabulary(SERVE_FLAGS, {
                **origins, "kv_blocks": "the proved minimum for the other settings"})
        return Config(**fields)
    except ConfigError as exc:
        raise exc.reworded(words) from None


def _check_reference(opts: ServeOptions) -> ServeOptions:
    if opts.model in HF_TINY_MODELS:
        raise ModelError(f"--model {opts.model} is --runtime hf's; the reference runtime takes "
                         f"'{TINY}' (its built-in model) or a model directory with its tokenizer")
    if opts.model != TINY:
        check_model_dir(opts.model)
    check_tokenizer_options(opts)
    config_for(opts, TINY_DEFAULTS if opts.rbln_config is None else None)
    return opts


def _reference(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    cfg = config_for(opts, TINY_DEFAULTS if opts.rbln_config is None else None)
    tok = opts_tokenizer(opts)
    load = registry.get("reference").load
    assert load is not None
    return cfg, load(cfg, RuntimeRequest(seed=opts.seed, vocab_size=tok.vocab_size)), tok


def _check_rbln(opts: ServeOptions) -> ServeOptions:
    if not opts.compiled:
        raise ValueError("--runtime rbln needs --compiled PATH (an optimum-rbln compiled "
                         "decoder directory; its rbln_config.json configures the server)")
    if not Path(opts.compiled).is_dir():
        raise ValueError(f"--compiled {opts.compiled}: not a directory; give an optimum-rbln "
                         "compiled decoder directory (with its rbln_config.json)")
    if opts.model != TINY:
        check_model_dir(opts.model)
    check_tokenizer_options(opts)
    opts = attrs.evolve(opts, rbln_config=read_rbln(opts.rbln_config or opts.compiled))
    config_for(opts)
    return opts


def _rbln(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    opts = _check_rbln(opts)
    load = registry.get("rbln").load
    assert load is not None and opts.compiled is not None  # (_check_rbln refuses its absence)
    cfg = config_for(opts)
    return cfg, load(cfg, RuntimeRequest(compiled=opts.compiled)), opts_tokenizer(opts)


def _check_hf(opts: ServeOptions) -> ServeOptions:
    if opts.model not in HF_TINY_MODELS:
        if opts.model == TINY:
            raise ModelError(f"--model {TINY} is the reference runtime's built-in model; "
                             f"--runtime hf takes {' or '.join(HF_TINY_MODELS)} (seeded random "
                             "weights) or a local checkpoint directory (config.json, its "
                             "weights and its tokenizer)")
        check_model_dir(opts.model, weights=True)
    check_tokenizer_options(opts)
    config_for(opts, TINY_DEFAULTS if opts.rbln_config is None else None)
    return opts


def _hf(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    """--model DIR (a local checkpoint with its tokenizer) or tiny-llama / tiny-gemma3 (seeded
    random weights, the byte tokenizer); see atom_core.runtime.hf."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never the network
    try:
        import atom_core.runtime.hf  # noqa: F401 - fails here when transformers is missing
    except ImportError as exc:
        raise ValueError(f"--runtime hf needs transformers and torch: pip install "
                         f"'atom-core[hf]' ({exc})") from None
    try:
        cfg, rt, tok = hf_factory(opts)
        if opts.tokenizer is not None or opts.chat_template is not None:
            # (hf_factory loads the model's own: --tokenizer's or the template's instead,
            # checked against the model as the model's own tokenizer is)
            tok = opts_tokenizer(opts)
            from atom_core.runtime.protocol import capabilities  # (torch is loaded by now)

            vocab = capabilities(rt).vocab_size
            if vocab is not None:
                check_end_tokens(end_ids(tok), int(vocab),
                                    f"--tokenizer {opts.tokenizer}: its end tokens")
        return cfg, rt, tok
    except (ConfigError, ModelError, ImportError):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers', safetensors', torch's: one line
        raise ModelError(f"--model {opts.model}: cannot load the checkpoint "
                         f"({type(exc).__name__}: {first_line(exc)}); give a local checkpoint "
                         "directory (config.json, its weights and its tokenizer, as "
                         "save_pretrained writes them)") from None


register_runtime("reference", _reference, _check_reference)
register_runtime("rbln", _rbln, _check_rbln)
register_runtime("hf", _hf, _check_hf)


def hf_factory(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    """`atom-core serve --runtime hf --model DIR|tiny-llama|tiny-gemma3`: (Config, runtime,
    tokenizer). A Gemma3 model's Config gets the model's window unless it names one."""
    from atom_core.runtime.hf import TINY_MODELS, HFRuntime, tiny_runtime, with_model_window

    cfg = with_model_window(config_for(opts, TINY_DEFAULTS if opts.rbln_config is None
                                       else None), opts.model)
    if opts.model in TINY_MODELS:
        tok: Any = ByteTokenizer()
        return cfg, tiny_runtime(opts.model, cfg, opts.seed, vocab_size=tok.vocab_size), tok
    tok = tokenizer_for(opts.model)
    check_hf_tokenizer(tok, opts.model)  # before the model is loaded and its KV allocated
    rt = HFRuntime.from_pretrained(opts.model, cfg)
    _end_where_generate_ends(tok, rt.model, opts.model)
    return cfg, rt, tok


def model_end_ids(model: Any) -> list[int]:
    """The ids transformers' generate() ends a sequence at: the loaded model's
    generation_config (generation_config.json, or config.json's eos_token_id when a checkpoint
    has no generation_config.json: transformers derives it from the model config)."""
    from atom_core.serve.tokenizer import id_list

    return id_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def _end_where_generate_ends(tok: Any, model: Any, where: str | os.PathLike[str]) -> None:
    """Make the served replies end at every id generate() ends at. The tokenizer reads
    generation_config.json only, so a checkpoint without it whose config.json lists several
    end ids (Llama 3's <|end_of_text|> and <|eot_id|>) would run past the second one to
    max_tokens. Ids outside the vocabulary are refused (`check_end_tokens`)."""
    ends = model_end_ids(model)
    check_end_tokens(ends, int(model.config.vocab_size), f"{where}: the model's eos_token_id")
    missing = frozenset(ends) - set(end_ids(tok))
    if missing and hasattr(tok, "end_token_ids"):
        tok.end_token_ids = frozenset(tok.end_token_ids) | missing


def check_hf_tokenizer(tok: Any, model: str | os.PathLike[str]) -> None:
    """Refuse a tokenizer whose end tokens the model directory's model cannot emit (ids at or
    past its config's vocab_size): generation would never stop on them."""
    from transformers import AutoConfig

    mcfg = AutoConfig.from_pretrained(model, local_files_only=True)
    vocab = getattr(mcfg, "vocab_size", None)
    if vocab is None and hasattr(mcfg, "get_text_config"):
        vocab = getattr(mcfg.get_text_config(), "vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        check_end_tokens(end_ids(tok), vocab, f"{model}: the tokenizer")
