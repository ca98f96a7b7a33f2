"""Which runtime serves, and with which tokenizer: a registry, so a runtime added later (e.g.
one over Hugging Face transformers models) plugs in by name without touching the server.

A factory takes the parsed `ServeOptions` and returns (Config, runtime, tokenizer); the server
checks the runtime against the Config (`check_runtime`) when the batcher is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from atom_core.config import Config, ConfigError, min_kv_blocks
from atom_core.serve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TINY = "tiny"  # the built-in seeded reference model with the byte tokenizer


@attrs.frozen
class ServeOptions:
    model: str  # "tiny" or a model directory (its tokenizer; its weights for runtimes that can)
    runtime: str = "reference"
    compiled: str | None = None  # rbln: the compiled artifact's directory
    rbln_config: str | None = None
    # Config fields given on the command line (they win over --rbln-config)
    overrides: dict[str, Any] = attrs.Factory(dict)
    seed: int = 0


Factory = Callable[[ServeOptions], tuple[Config, Any, Tokenizer]]
RUNTIMES: dict[str, Factory] = {}


def register_runtime(name: str, factory: Factory) -> None:
    RUNTIMES[name] = factory


def build(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    if opts.runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime '{opts.runtime}': one of {sorted(RUNTIMES)}")
    return RUNTIMES[opts.runtime](opts)


def tokenizer_for(model: str) -> Tokenizer:
    if model == TINY:
        return ByteTokenizer()
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"--model {model}: not a directory (give a model directory with a "
                         f"tokenizer, or '{TINY}' for the built-in tiny model)")
    return HFTokenizer(path)


# the built-in tiny model's artifact when nothing else is said: small enough for a laptop CPU
TINY_DEFAULTS = {"lanes": 4, "max_seq_len": 256, "block_size": 64, "prefill_chunk": 64,
                 "prefix_cache": True}


def config_for(opts: ServeOptions, defaults: dict[str, Any] | None = None) -> Config:
    """--rbln-config (if any), then the command line's fields; kv_blocks defaults to the proved
    minimum for the rest."""
    from atom_core.config import rbln_fields

    fields = dict(defaults or {})
    if opts.rbln_config is not None:
        fields.update(rbln_fields(opts.rbln_config))
    fields.update(opts.overrides)
    if "lanes" not in fields:
        raise ConfigError("give --lanes (or --rbln-config with batch_size)")
    if "kv_blocks" not in fields:
        seq = fields.get("max_seq_len", 4096)
        fields["kv_blocks"] = min_kv_blocks(
            fields["lanes"], fields.get("prefix_cache", False), fields.get("scratch", "dynamic"),
            seq // fields.get("block_size", seq), fields.get("preemption", False))
    return Config(**fields)


def _reference(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    from atom_core.runtime.reference import TorchReferenceRuntime

    cfg = config_for(opts, TINY_DEFAULTS if opts.rbln_config is None else None)
    tok = tokenizer_for(opts.model)
    model: dict[str, Any] = {"vocab_size": tok.vocab_size}
    if cfg.sliding_window is not None:
        model.update(sliding_window=cfg.sliding_window, layers=3, global_every=3)
    return cfg, TorchReferenceRuntime.tiny(cfg, seed=opts.seed, **model), tok


def _rbln(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    if not opts.compiled:
        raise ValueError("--runtime rbln needs --compiled PATH (an optimum-rbln compiled "
                         "decoder directory; its rbln_config.json configures the server)")
    from atom_core.runtime.rbln import RblnRuntime

    cfg = config_for(attrs.evolve(opts, rbln_config=opts.rbln_config or opts.compiled))
    return cfg, RblnRuntime.from_compiled(opts.compiled), tokenizer_for(opts.model)


def _hf(opts: ServeOptions) -> tuple[Config, Any, Tokenizer]:
    """--model DIR (a local checkpoint with its tokenizer) or tiny-llama / tiny-gemma3 (seeded
    random weights, the byte tokenizer); see atom_core.runtime.hf."""
    try:
        from atom_core.runtime import hf
    except ImportError as exc:
        raise ValueError(f"--runtime hf needs transformers and torch: pip install "
                         f"'atom-core[hf]' ({exc})") from None
    return hf.serve_factory(opts)


register_runtime("reference", _reference)
register_runtime("rbln", _rbln)
register_runtime("hf", _hf)
