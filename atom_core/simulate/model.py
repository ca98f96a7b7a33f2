"""The model every server of a run computes with, and its oracle, both from the runtime
registry (`atom_core.runtime.registry`, the run's `runtime` dimension by name): the tiny
reference model (hybrid when the configuration has a window) or, `runtime=hf`, a tiny
transformers model (tiny-llama, or tiny-gemma3 with the window)."""

from __future__ import annotations

from typing import Any

from atom_core.config import Config
from atom_core.runtime import registry
from atom_core.runtime.registry import RuntimeKind, RuntimeRequest
from atom_core.simulate.dimensions import SimConfig

VOCAB = 128
MODEL_SEED = 0  # one model for every seed: the oracle's memo is shared across seeds
# (tiny-llama and tiny-gemma3: runtime/hf.py's names, not imported here, which needs
# transformers)
TINY_LLAMA, TINY_GEMMA3 = "tiny-llama", "tiny-gemma3"

# the oracle of each model, memoised across seeds: (kind, window, max_seq_len) -> oracle
_ORACLES: dict[tuple[RuntimeKind, int | None, int], Any] = {}


def kind(cfg: SimConfig) -> RuntimeKind:
    """The registered runtime `cfg.runtime` names, among those the simulation can run (it loads
    one and has an oracle); UnknownRuntimeError naming those otherwise."""
    return registry.get(cfg.runtime, flag="runtime",
                        has=lambda k: k.load is not None and k.oracle is not None)


def request(cfg: SimConfig) -> RuntimeRequest:
    """What the run asks of its runtime besides each server's Config: the seeded model, and for
    hf float64, so transformers' generate and the paged attention differ far below any logit
    gap."""
    if cfg.runtime == "hf":
        model = TINY_LLAMA if cfg.sliding_window is None else TINY_GEMMA3
        return RuntimeRequest(model=model, seed=MODEL_SEED, dtype="float64", vocab_size=VOCAB)
    return RuntimeRequest(seed=MODEL_SEED, vocab_size=VOCAB)


def load(cfg: SimConfig, conf: Config) -> tuple[Any, Any]:
    """A runtime for `conf` (one server of the run) and the model's oracle (the cache-free
    reference, never wrapped)."""
    k = kind(cfg)
    assert k.load is not None and k.oracle is not None  # (kind() chose such a one)
    rt = k.load(conf, request(cfg))
    key = (k, cfg.sliding_window, cfg.max_seq_len)
    if key not in _ORACLES:
        _ORACLES[key] = k.oracle(rt)
    return rt, _ORACLES[key]
