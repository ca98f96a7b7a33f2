"""The model every server of a run computes with, and its oracle: the tiny reference model
(hybrid when the configuration has a window) or, `runtime=hf`, a tiny transformers model."""

from __future__ import annotations

import functools
from typing import Any

import torch

from atom_core.config import Config
from atom_core.runtime.reference import TorchReferenceRuntime
from atom_core.simulate.dimensions import SimConfig

VOCAB = 128
MODEL_SEED = 0  # one model for every seed: the oracle's memo is shared across seeds


def reference_runtime(cfg: SimConfig, conf: Config) -> TorchReferenceRuntime:
    """The tiny reference model for `conf`; its oracle is `demo.oracle_for` of it."""
    return TorchReferenceRuntime.tiny(conf, seed=MODEL_SEED, **_model(cfg))


def _model(cfg: SimConfig) -> dict[str, Any]:
    # hybrid: two sliding layers and one global one, as tests/test_hybrid.py
    if cfg.sliding_window is None:
        return {}
    return {"sliding_window": cfg.sliding_window, "layers": 3, "global_every": 3}


_HF_ORACLES: dict[tuple[int | None, int], Any] = {}


@functools.lru_cache(maxsize=4)
def _hf_model(window: int | None, max_seq_len: int) -> Any:
    """`runtime=hf`'s model, loaded once per shape (HFRuntimes share it: it holds no KV): float64,
    so transformers' generate and the paged attention differ far below any logit gap."""
    from atom_core.runtime import hf

    return hf.tiny_model(hf.TINY_LLAMA if window is None else hf.TINY_GEMMA3, max_seq_len,
                         window=window, seed=MODEL_SEED, dtype=torch.float64, vocab_size=VOCAB)


def hf_runtime(window: int | None, max_seq_len: int, conf: Config) -> tuple[Any, Any]:
    """An HFRuntime for `conf` and the model's oracle (transformers' generate, memoised across
    seeds like the reference oracle)."""
    from atom_core.runtime import hf

    rt = hf.HFRuntime.for_config(_hf_model(window, max_seq_len), conf)
    key = (window, max_seq_len)
    if key not in _HF_ORACLES:
        _HF_ORACLES[key] = hf.GenerateOracle(rt)
    return rt, _HF_ORACLES[key]
