"""The runtimes by name: the one place `--runtime NAME` becomes a runtime, for every command
(serve, pd-prefill/pd-decode, demo) and for the simulation (its `runtime` dimension).

A `RuntimeKind` says how to load the runtime for a Config (`load`, given a `RuntimeRequest`:
what the command was told besides the Config), what its tokens are checked against (`oracle`,
None if nothing), and why it cannot be a PD worker (`pd_refusal`, None if it can). `serve`
adds its own per-runtime steps to the same record (`serve`, `serve_check`: the tokenizer and
the options it reads; atom_core/serve/runtimes.py). A new runtime is one `register` call.

Importing this module imports no torch (the commands read it to parse their options); each
kind imports its runtime's module when it loads one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from atom_core.config import Config

__all__ = ["KINDS", "RuntimeKind", "RuntimeRequest", "UnknownRuntimeError", "get", "names",
           "register"]


class UnknownRuntimeError(ValueError):
    """A runtime name nothing registered."""


@attrs.frozen
class RuntimeRequest:
    """What a command gives a runtime besides the Config; each kind reads what it needs."""

    model: str | None = None  # hf: a local checkpoint directory or a tiny model's name
    compiled: str | None = None  # rbln: the compiled artifact's directory
    seed: int = 0  # the seeded models' weights
    # the weights' torch dtype by name ("float64": hf checked against transformers' generate,
    # far below any logit gap); None: the runtime's own default
    dtype: str | None = None
    fingerprint: str | None = None  # rbln: the PD fingerprint the artifact is known by
    # reference and hf's tiny models: the tokenizer's vocabulary (default: 128)
    vocab_size: int | None = None


@attrs.frozen
class RuntimeKind:
    name: str
    summary: str  # one line, for help texts
    # the runtime for a Config; None: only `serve` can make one (a runtime registered there)
    load: Callable[[Config, RuntimeRequest], Any] | None = None
    # the runtime's tokens checked against (demo, pd-decode --check): runtime -> oracle with
    # generate(prompt, max_new_tokens); None: nothing to check them against
    oracle: Callable[[Any], Any] | None = None
    pd_refusal: str | None = None  # why it cannot run a PD worker; None: it can
    # serve's steps (atom_core/serve/runtimes.py): ServeOptions -> (Config, runtime, tokenizer),
    # and the options checked before anything loads
    serve: Callable[[Any], Any] | None = None
    serve_check: Callable[[Any], Any] | None = None


KINDS: dict[str, RuntimeKind] = {}


def register(kind: RuntimeKind) -> RuntimeKind:
    """Make `kind` reachable by its name (replacing one of the same name)."""
    KINDS[kind.name] = kind
    return kind


def names(has: Callable[[RuntimeKind], object] | None = None) -> tuple[str, ...]:
    """The registered names, in registration order (those for which `has(kind)` holds)."""
    return tuple(n for n, k in KINDS.items() if has is None or has(k))


def get(name: str, flag: str = "--runtime",
        has: Callable[[RuntimeKind], object] | None = None) -> RuntimeKind:
    """The kind named `name` (among those with `has`), else UnknownRuntimeError naming the
    ones there are."""
    kind = KINDS.get(name)
    if kind is None or (has is not None and not has(kind)):
        raise UnknownRuntimeError(f"{flag} {name}: unknown; give one of {sorted(names(has))}")
    return kind


def _dtype(req: RuntimeRequest, default: Any) -> Any:
    import torch

    return default if req.dtype is None else getattr(torch, req.dtype)


def _load_reference(cfg: Config, req: RuntimeRequest) -> Any:
    import torch

    from atom_core.runtime.reference import TorchReferenceRuntime

    model: dict[str, Any] = {}
    if req.vocab_size is not None:
        model["vocab_size"] = req.vocab_size
    if cfg.sliding_window is not None:  # hybrid: two sliding layers and one global one
        model.update(sliding_window=cfg.sliding_window, layers=3, global_every=3)
    return TorchReferenceRuntime.tiny(cfg, seed=req.seed, dtype=_dtype(req, torch.float32),
                                      **model)


def _reference_oracle(rt: Any) -> Any:
    from atom_core.demo import oracle_for

    return oracle_for(rt)


def _load_hf(cfg: Config, req: RuntimeRequest) -> Any:
    import torch

    from atom_core.runtime import hf

    if req.model is None:
        raise ValueError("--runtime hf needs --model DIR|tiny-llama|tiny-gemma3 (a local "
                         "checkpoint directory, or a seeded tiny model)")
    dtype = _dtype(req, torch.float32)
    if req.model in hf.TINY_MODELS:
        vocab = 128 if req.vocab_size is None else req.vocab_size
        model = _tiny_hf_model(req.model, cfg.max_seq_len, cfg.sliding_window, req.seed, dtype,
                               vocab)
        return hf.HFRuntime.for_config(model, cfg)
    return hf.HFRuntime.from_pretrained(req.model, cfg, dtype=dtype)


@functools.lru_cache(maxsize=4)
def _tiny_hf_model(name: str, max_seq_len: int, window: int | None, seed: int, dtype: Any,
                   vocab_size: int) -> Any:
    """A tiny model, loaded once per shape: the runtimes of one process (both sides of an
    in-process PD pair, a simulated cluster's restarted workers) share it, as it holds no KV,
    rather than each saving and loading its own."""
    from atom_core.runtime import hf

    return hf.tiny_model(name, max_seq_len, window=window, seed=seed, dtype=dtype,
                         vocab_size=vocab_size)


def _hf_oracle(rt: Any) -> Any:
    from atom_core.runtime import hf

    return hf.GenerateOracle(rt)


def _load_rbln(cfg: Config, req: RuntimeRequest) -> Any:
    from atom_core.runtime.rbln import RblnRuntime

    if not req.compiled:
        raise ValueError("--runtime rbln needs --compiled PATH (an optimum-rbln compiled decoder "
                         "directory)")
    return RblnRuntime.from_compiled(req.compiled, fingerprint=req.fingerprint)


register(RuntimeKind("reference", "the tiny seeded torch reference model (built in)",
                     _load_reference, _reference_oracle))
register(RuntimeKind("hf", "a transformers model (--model) on HFRuntime", _load_hf, _hf_oracle))
register(RuntimeKind(
    "rbln", "an optimum-rbln compiled artifact (--compiled) on RBLN NPUs", _load_rbln,
    pd_refusal="its host KV buffer is a flat aligned buffer, not the [layers, 2, kv_heads, "
               "block_size, head_dim] layout a KV payload ships; run PD on --runtime reference, "
               "or serve an RBLN model colocated"))
