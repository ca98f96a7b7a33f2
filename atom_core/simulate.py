"""`atom-core simulate`: a seeded, deterministic simulation of the batcher under faults.

One seed picks a configuration (colocated or PD, prefix cache, host cache tier, scratch
discipline, hybrid sliding window, lanes, blocks, ...; any of them can be fixed) and a workload
(with a host tier: more shared prefixes than the device cache holds), then drives the
batcher (colocated) or a PD prefill worker and decode worker (over `InProcessTransport.pair()`)
on the tiny torch reference runtime for `steps` ticks while injecting faults: runtime calls that
raise, transfer delays, drops, duplicates, late and corrupted messages, a lost prefill worker,
client aborts. Then it stops injecting and drains: every request must end.

What is checked, through public APIs only (the batcher's `state` is read, never written):

- after every tick: `core.check_invariants` on every batcher's core state (ghost state on), and
  no leak: every block is free, cached, the scratch block, held by a busy lane serving a request
  that has not ended, or draining for a recorded transfer of an ended request; every recorded
  transfer names a pinned block; every waiting request is queued; a decode worker holds
  prefetched KV only for requests that still wait; between ticks no host-tier store or load is
  in flight (no slot storing or loading, no block spilling: the adapter does them within a
  step), and every host slot's state and tokens in `describe()` are the core's; the hybrid
  prefix cache's snapshot buffers the adapter holds (`describe()["snapshots"]`) are exactly the
  core's: a busy lane's at every chunk boundary up to `lane_snap`, a cache entry's up to
  `snap_upto`, nothing for idle lanes or other blocks;
- when a request ends: it ends exactly once (finished, error or abort), a finished request's
  tokens are exactly the oracle's greedy tokens for its prompt, and an ended one emitted a prefix
  of them;
- after the drain (capped: hitting the cap is a failure): every request ended, every block is
  at rest (free, cached or scratch) and every host slot is empty or stored.

Every decision comes from `random.Random` seeded by the seed, and runs are replayed from their
recorded event list: `submit`, `step` (one tick: one step of each worker) and one event per
injected fault. The first failure stops a run; its shortest failing prefix is found by replaying
prefixes of the event list (each followed by the drain). The decode worker's clock (its
transfer timeout) is a simulated one (one second per tick, `DecodeWorker(clock=...)`), so a
timeout fires at the same tick in every replay; the workers' batchers keep ghost state
(`ghost=True`).

Extending: a new feature is one more entry in `DIMENSIONS` (and a field of `SimConfig` whose
default is "off"), a new fault one more entry in `FAULTS`, a new leak rule one more function in
`LEAK_CHECKS`. `run` is the programmatic entry point (it never prints); `render` formats a
report, `sweep` runs consecutive seeds.
"""

from __future__ import annotations

import functools
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from atom_core import pdlink, workers
from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, ConfigError, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime.reference import TorchReferenceRuntime
from atom_core.transport import InProcessTransport, TransportError

__all__ = ["DIMENSIONS", "FAULTS", "Report", "SimConfig", "SimEvent", "UsageError", "draw_config",
           "parse_fixed", "render", "replay", "run", "sweep"]

PREFILL_CHUNK = 64
VOCAB = 128
MODEL_SEED = 0  # one model for every seed: the oracle's memo is shared across seeds
# Simulated seconds (ticks) before the decode worker gives up on a transfer: long enough that
# a busy prefill worker answers in time, short enough that a drain after a lost message ends.
TRANSFER_TIMEOUT = 120.0
DRAIN_BASE, DRAIN_PER_REQUEST = 400, 40  # the drain's tick cap: base + per unfinished request
SHRINK_WALK = 4  # after bisection, how many shorter prefixes to try (failures need not be
# monotone in the prefix length)


class UsageError(ValueError):
    """A bad fault name, dimension name or fixed value: the CLI prints it and exits 2."""


class InjectedFault(RuntimeError):
    """Raised by a runtime call the simulation made fail."""


# --------------------------------------------------------------------------- configuration
@attrs.frozen
class SimConfig:
    """One simulated deployment. PD-only fields are None when colocated."""

    seed: int
    mode: str = "colocated"  # "colocated" | "pd"
    max_seq_len: int = 128
    sliding_window: int | None = None  # hybrid model when set
    prefix_cache: bool = False  # the serving batcher's (PD: the decode worker's)
    scratch: str = "dynamic"
    lanes: int = 2
    extra_blocks: int = 0  # KV blocks above the proved minimum
    prefill_lanes: int | None = None
    prefill_prefix_cache: bool | None = None
    prefill_scratch: str | None = None
    prefetch: int | None = None
    fallback_local: bool | None = None
    host_cache_blocks: int = 0  # host tier of the serving batcher (PD: the decode worker's)
    prefill_host_cache_blocks: int | None = None
    blocks_per_table: int = 1  # T: paged block tables when > 1 (colocated only, for now)
    preemption: bool | None = None  # paged tables: kv_blocks at the preemption rule
    # "reference": the tiny reference model; "hf": the same shapes as a transformers model
    # (tiny-llama, or tiny-gemma3 with the window) on HFRuntime, checked against generate()
    runtime: str = "reference"

    @property
    def pd(self) -> bool:
        return self.mode == "pd"

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if k != "seed" and v is not None}


Choices = Callable[[dict[str, Any]], tuple[Any, ...]]


@attrs.frozen
class Dimension:
    """A configuration axis. `choices(picked)` gives the values allowed next to what is already
    picked or fixed (empty: the axis does not apply, the field stays None); `weights` bias the
    seed's pick. `open`: a fixed value need not be one of the choices (Config validates it)."""

    name: str
    help: str
    choices: Choices
    weights: tuple[int, ...] | None = None
    open: bool = False


def _always(*values: Any) -> Choices:
    return lambda _c: values


def _pd_only(*values: Any) -> Choices:
    return lambda c: values if c.get("mode") == "pd" else ()


@functools.cache
def _accepts(prefix_cache: bool, sliding_window: int | None, host_cache_blocks: int) -> bool:
    """Whether Config accepts these features together (asked, not assumed, so that the
    simulation follows the spec's axioms when a rule changes)."""
    try:
        Config(lanes=1, kv_blocks=8, max_seq_len=128, prefill_chunk=PREFILL_CHUNK,
               prefix_cache=prefix_cache, sliding_window=sliding_window,
               host_cache_blocks=host_cache_blocks)
    except ConfigError:
        return False
    return True


def hybrid_prefix_cache_allowed() -> bool:
    """Whether the spec's axioms allow a prefix cache on a hybrid model."""
    return _accepts(True, 16, 0)


def host_cache_allowed(sliding_window: int | None) -> bool:
    """Whether a host cache tier (with its prefix cache) is allowed on this model."""
    return _accepts(True, sliding_window, 1)


HOST_CHOICES, HOST_WEIGHTS = (0, 1, 2, 3, 4), (4, 1, 1, 1, 1)  # off most of the time


def _prefix_choices(window_key: str, host_key: str) -> Choices:
    def choices(c: dict[str, Any]) -> tuple[Any, ...]:
        if c.get(host_key):  # a fixed host tier needs the prefix cache
            return (True,)
        return (False, True) if c.get(window_key) is None \
            or hybrid_prefix_cache_allowed() else (False,)
    return choices


def _prefill_prefix(c: dict[str, Any]) -> tuple[Any, ...]:
    return _prefix_choices("sliding_window", "prefill_host_cache_blocks")(c) \
        if c.get("mode") == "pd" else ()


def _window_choices(c: dict[str, Any]) -> tuple[Any, ...]:
    if (c.get("host_cache_blocks") or c.get("prefill_host_cache_blocks")) \
            and not host_cache_allowed(16):
        return (None,)  # a fixed host tier: a model it is allowed on
    if hybrid_prefix_cache_allowed() or not (c.get("prefix_cache")
                                             or c.get("prefill_prefix_cache")):
        return (None, 16, 64, 100)
    return (None,)


def _host_choices(prefix_key: str, pd_only: bool) -> Choices:
    """A host tier where Config accepts one (prefix cache on, a model it is allowed on); 0
    (off) elsewhere, so `--set ...=0` always works."""
    def choices(c: dict[str, Any]) -> tuple[Any, ...]:
        if pd_only and c.get("mode") != "pd":
            return ()
        if c.get(prefix_key) and host_cache_allowed(c.get("sliding_window")):
            return HOST_CHOICES
        return (0,)
    return choices


def _table_choices(c: dict[str, Any]) -> tuple[Any, ...]:
    """T up to a block of one prefill chunk, where the workload fits."""
    most = (c.get("max_seq_len") or 128) // PREFILL_CHUNK
    return tuple(t for t in (1, 2, 4) if t <= most)


def _preempt_choices(c: dict[str, Any]) -> tuple[Any, ...]:
    """Preemption where Config accepts it: paged tables; and colocated (the batcher refuses
    PD requests with it)."""
    if (c.get("blocks_per_table") or 1) == 1 or c.get("mode") == "pd":
        return ()
    return (False, True)


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("mode", "colocated batcher, or a PD prefill worker feeding a decode worker",
              _always("colocated", "pd")),
    Dimension("max_seq_len", "tokens per sequence", _always(128, 256),
              weights=(3, 1), open=True),
    Dimension("sliding_window", "hybrid model's window (none: every layer global)",
              _window_choices, weights=(3, 1, 1, 1), open=True),
    Dimension("prefix_cache", "prefix cache of the serving batcher (PD: decode worker)",
              _prefix_choices("sliding_window", "host_cache_blocks")),
    Dimension("scratch", "scratch discipline", _always("reserved", "dynamic")),
    Dimension("lanes", "lanes of the serving batcher", _always(1, 2, 3), open=True),
    Dimension("extra_blocks", "KV blocks above the proved minimum", _always(0, 1, 2),
              weights=(2, 2, 1), open=True),
    Dimension("prefill_lanes", "PD: lanes of the prefill worker", _pd_only(1, 2), open=True),
    Dimension("prefill_prefix_cache", "PD: prefix cache of the prefill worker", _prefill_prefix),
    Dimension("prefill_scratch", "PD: scratch discipline of the prefill worker",
              _pd_only("reserved", "dynamic")),
    Dimension("prefetch", "PD: KV asked for ahead, per waiting request", _pd_only(0, 1, 2),
              open=True),
    Dimension("fallback_local", "PD: prefill locally once the prefill worker is lost",
              _pd_only(True, False)),
    # last, so that adding them left every earlier dimension's draw as it was
    Dimension("host_cache_blocks", "host cache tier (slots) of the serving batcher (PD: decode "
              "worker); needs its prefix cache", _host_choices("prefix_cache", False),
              weights=HOST_WEIGHTS, open=True),
    Dimension("prefill_host_cache_blocks", "PD: host cache tier of the prefill worker",
              _host_choices("prefill_prefix_cache", True), weights=HOST_WEIGHTS, open=True),
    Dimension("blocks_per_table", "blocks per lane's table (T = max_seq_len / block_size; 1: "
              "eager); paged tables are colocated",
              _table_choices, open=True),
    Dimension("preemption", "paged tables: a lane waiting for a block preempts the youngest, "
              "with kv_blocks at the (much lower) preemption rule", _preempt_choices),
    # never drawn (weight 0: a seed's configuration stays what it was before this dimension,
    # and hf needs the hf extra and is slower); fixed by `--runtime hf` or `--set runtime=hf`
    Dimension("runtime", "the model: reference (the tiny reference model) or hf (tiny-llama, "
              "or tiny-gemma3 with the window, on HFRuntime; oracle: transformers' generate)",
              _always("reference", "hf"), weights=(1, 0)),
)
_DIMS = {d.name: d for d in DIMENSIONS}


def draw_config(seed: int, fixed: dict[str, Any] | None = None) -> SimConfig:
    """The configuration of `seed`: every dimension not in `fixed` drawn from its own stream
    (so fixing one dimension does not change the others' draws more than their rules need)."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(_DIMS))
    if unknown:
        raise UsageError(f"unknown configuration dimension(s) {unknown}; known: "
                         f"{', '.join(_DIMS)}")
    rng = random.Random(f"atom-core-simulate-config-{seed}")
    picked: dict[str, Any] = dict(fixed)  # fixed values constrain earlier dimensions too
    for dim in DIMENSIONS:
        allowed = dim.choices(picked)
        if dim.name in fixed:
            rng.random()  # the draw it would have had: the other dimensions' draws stay put
            value = fixed[dim.name]
            if not allowed:
                raise UsageError(f"{dim.name} does not apply here ({dim.help})")
            open_ok = dim.open and value is not None and any(v is not None for v in allowed)
            if value not in allowed and not open_ok:
                raise UsageError(f"{dim.name}={value!r} is not possible with "
                                 f"{ {k: v for k, v in picked.items() if k != dim.name} }: "
                                 f"choose one of {list(allowed)}")
        elif not allowed:
            rng.random()
            picked[dim.name] = None
        else:
            weights = dim.weights if dim.weights and len(dim.weights) == len(allowed) else None
            picked[dim.name] = rng.choices(allowed, weights)[0]  # one random() per pick
    try:
        cfg = SimConfig(seed=seed, **picked)
        _configs(cfg)  # Config validates what fixed values left open
    except ValueError as exc:
        raise UsageError(f"configuration not servable: {exc}") from exc
    return cfg


def parse_fixed(items: Iterable[str]) -> dict[str, Any]:
    """`NAME=VALUE` strings (CLI `--set`) into typed dimension values."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in _DIMS:
            raise UsageError(f"--set takes NAME=VALUE with NAME one of {', '.join(_DIMS)}; "
                             f"got {item!r}")
        out[name] = _parse_value(_DIMS[name], text.strip())
    return out


def _parse_value(dim: Dimension, text: str) -> Any:
    low = text.lower()
    samples = [v for v in dim.choices({"mode": "pd"}) if v is not None]
    if low in ("none", "off") and dim.name == "sliding_window":
        return None
    kind = type(samples[0]) if samples else str
    if kind is bool:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
    elif kind is int:
        try:
            return int(text)
        except ValueError:
            pass
    elif text in samples:
        return text
    raise UsageError(f"bad value {text!r} for {dim.name}: e.g. {samples}")


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


def _hf(window: int | None, max_seq_len: int, conf: Config) -> tuple[Any, Any]:
    """An HFRuntime for `conf` and the model's oracle (transformers' generate, memoised across
    seeds like the reference oracle)."""
    from atom_core.runtime import hf

    rt = hf.HFRuntime.for_config(_hf_model(window, max_seq_len), conf)
    key = (window, max_seq_len)
    if key not in _HF_ORACLES:
        _HF_ORACLES[key] = hf.GenerateOracle(rt)
    return rt, _HF_ORACLES[key]


def _configs(cfg: SimConfig) -> dict[str, Config]:
    """The batcher configurations by side: "local" (colocated) or "decode" and "prefill"."""
    t = cfg.blocks_per_table or 1

    def one(lanes: int, prefix: bool, scratch: str, host: int) -> Config:
        pre = bool(cfg.preemption)
        return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, t, pre)
                      + cfg.extra_blocks, max_seq_len=cfg.max_seq_len,
                      block_size=cfg.max_seq_len // t,
                      prefill_chunk=PREFILL_CHUNK, prefix_cache=prefix, scratch=scratch,
                      sliding_window=cfg.sliding_window, host_cache_blocks=host,
                      preemption=pre)

    serving = one(cfg.lanes, cfg.prefix_cache, cfg.scratch, cfg.host_cache_blocks)
    if not cfg.pd:
        return {"local": serving}
    assert cfg.prefill_lanes is not None and cfg.prefill_scratch is not None
    return {"decode": serving, "prefill": one(cfg.prefill_lanes, bool(cfg.prefill_prefix_cache),
                                              cfg.prefill_scratch,
                                              cfg.prefill_host_cache_blocks or 0)}


# --------------------------------------------------------------------------- events
@attrs.frozen
class SimEvent:
    """One recorded decision: `submit`, `step` (a tick) or a fault kind's event."""

    kind: str
    args: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kind: str, **args: Any) -> SimEvent:
        return cls(kind, tuple(args.items()))

    def arg(self, name: str) -> Any:
        return dict(self.args)[name]

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **dict(self.args)}

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.args)})"


@attrs.frozen
class Item:
    """A request of the workload."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    eos: int | None


def make_workload(cfg: SimConfig, n: int) -> list[Item]:
    """`n` requests: many share one of two system prompts longer than a chunk (prefix hits),
    some repeat an earlier prompt exactly, some sit on chunk, window and length edges. With a
    host tier, more system prompts (3 + its slots) and more requests sharing them: more shared
    prefixes than the device cache holds, so that entries are stored and hit on the host."""
    rng = random.Random(f"atom-core-simulate-workload-{cfg.seed}")
    s, c = cfg.max_seq_len, PREFILL_CHUNK
    host = max(cfg.host_cache_blocks, cfg.prefill_host_cache_blocks or 0)
    n_systems, shared = (3 + host, 0.6) if host else (2, 0.4)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(c, c + 40))]
               for _ in range(n_systems)]
    edges = [1, 2, c - 1, c, c + 1, s - 1]
    if cfg.sliding_window is not None:
        w = cfg.sliding_window
        edges += [w - 1, w, w + 1]
    edges = [e for e in edges if 1 <= e < s]
    items: list[Item] = []
    for _ in range(n):
        r = rng.random()
        if r < shared:
            sysp = systems[rng.randrange(n_systems)]
            prompt = (sysp + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))])[:s - 1]
        elif r < shared + 0.1 and items:
            prompt = list(items[rng.randrange(len(items))].prompt)
        else:
            length = rng.choice(edges) if r < shared + 0.3 else rng.randint(1, s - 1)
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
        eos = rng.randrange(VOCAB) if rng.random() < 0.15 else None
        items.append(Item(tuple(prompt), rng.choice((1, 1, 2, 3, 5, 8, 12)), eos))
    return items


# --------------------------------------------------------------------------- runtime faults
# runtime call -> fault kind
_CALL_KIND = {"prefill": "prefill", "decode": "decode", "copy_kv_cache": "copy",
              "fetch_kv_cache": "fetch", "fetch_local_cache": "fetch",
              "update_kv_cache": "update", "update_local_cache": "update",
              "new_host_buffer": "alloc", "new_local_host_buffer": "alloc"}


class FaultyRuntime:
    """Delegates to `inner`; an armed call first scribbles junk over everything it would have
    written (the worst a half-finished device call can do), then raises `InjectedFault`."""

    def __init__(self, inner: Any, junk: torch.Generator,
                 on_fire: Callable[[str], None]) -> None:
        self.inner, self._junk, self._on_fire = inner, junk, on_fire
        self._armed: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, call: str) -> bool:
        if call in self._armed:
            return False
        self._armed.add(call)
        return True

    def disarm(self) -> None:
        self._armed.clear()

    def _fire(self, call: str, scribble: Callable[[], None]) -> None:
        if call not in self._armed:
            return
        self._armed.discard(call)
        scribble()
        self._on_fire(_CALL_KIND[call])
        raise InjectedFault(f"injected {call} fault")

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        return (torch.randn(like.shape, generator=self._junk) * 50).to(like.dtype)

    def _scribble_block(self, block: int) -> None:
        host = self.inner.new_host_buffer()
        self.inner.update_kv_cache(self._noise(host), block)

    def _scribble_slot(self, slot: int, ring_index: int | None = None) -> None:
        host = self.inner.new_local_host_buffer()
        if ring_index is None:
            host = self._noise(host)
        else:  # one ring entry: a decode row writes its own position only
            self.inner.fetch_local_cache(host, slot)
            host[:, :, :, ring_index] = self._noise(host[:, :, :, ring_index])
        self.inner.update_local_cache(host, slot)

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any) -> Any:
        def scribble() -> None:
            self._scribble_block(int(block_tables[0]))
            if local_block_tables is not None:  # the lane fails: its whole slot is fair game
                self._scribble_slot(int(local_block_tables[0]))
        self._fire("prefill", scribble)
        return self.inner.prefill(input_ids, cache_position, block_tables, local_block_tables,
                                  query_position)

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> Any:
        def scribble() -> None:
            for b in sorted({int(x) for x in block_tables[:, 0]}):
                self._scribble_block(b)
            if local_block_tables is not None:
                w = self.inner.sliding_window
                for row in range(len(local_block_tables)):
                    self._scribble_slot(int(local_block_tables[row, 0]),
                                        int(cache_position[row, 0]) % w)
        self._fire("decode", scribble)
        return self.inner.decode(input_ids, cache_position, block_tables, local_block_tables)

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        self._fire("copy_kv_cache", lambda: self._scribble_block(int(dst)))
        self.inner.copy_kv_cache(src, dst, num_tokens)

    # host memory running out: the allocation raises before anything is written
    def new_host_buffer(self) -> Any:
        self._fire("new_host_buffer", lambda: None)
        return self.inner.new_host_buffer()

    def new_local_host_buffer(self) -> Any:
        self._fire("new_local_host_buffer", lambda: None)
        return self.inner.new_local_host_buffer()

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._fire("fetch_kv_cache", lambda: host_tensor.copy_(self._noise(host_tensor)))
        self.inner.fetch_kv_cache(host_tensor, block)

    def fetch_local_cache(self, host_tensor: Any, slot: int) -> None:
        self._fire("fetch_local_cache", lambda: host_tensor.copy_(self._noise(host_tensor)))
        self.inner.fetch_local_cache(host_tensor, slot)

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._fire("update_kv_cache", lambda: self._scribble_block(int(block)))
        self.inner.update_kv_cache(host_tensor, block)

    def update_local_cache(self, host_tensor: Any, slot: int) -> None:
        self._fire("update_local_cache", lambda: self._scribble_slot(int(slot)))
        self.inner.update_local_cache(host_tensor, slot)


# --------------------------------------------------------------------------- transport faults
class SimLink:
    """One end of the in-process pair as its worker sees it. Armed faults act on the next
    message this end sends ("corrupt" on the next KV payload); every message sent is kept so
    that a copy can arrive again later ("late"). hold/release/kill are the transport's own
    hooks, on `inner`."""

    def __init__(self, inner: InProcessTransport, on_fault: Callable[[str], None]) -> None:
        self.inner, self._on_fault = inner, on_fault
        self.history: list[tuple[dict[str, Any], torch.Tensor | None]] = []
        self.armed: list[str] = []
        self.held = False

    def __getattr__(self, name: str) -> Any:  # poll, wait, close, stats
        return getattr(self.inner, name)

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        # a KV payload travels sealed (kind "sealed", "k": "kv") over the workers' SecureLink
        is_kv = header.get("kind") == "kv" or header.get("k") == "kv"
        fault = next((f for f in self.armed if f != "corrupt" or is_kv), None)
        if fault is not None:
            self.armed.remove(fault)
        self.history.append((dict(header), None if tensor is None else tensor.clone()))
        if fault == "corrupt" and tensor is not None:
            tensor = tensor.clone()
            tensor.reshape(-1).view(torch.uint8)[7] ^= 0x10  # the AEAD tag must catch it
        if fault == "drop":
            self.inner.drop_next(1)
        self.inner.send(header, tensor)
        if fault == "duplicate":
            self.inner.send(header, tensor)
        if fault is not None:
            self._on_fault(fault)

    def resend(self, index: int) -> bool:
        header, tensor = self.history[index]
        try:
            self.inner.send(header, tensor)
        except TransportError:
            return False
        return True


# The simulation's PD key (its links are authenticated and encrypted, as in production).
SIM_KEY = b"atom-core simulation pd key 0001"


class SimClock:
    """Simulated seconds, one per tick: the decode worker's clock (`DecodeWorker(clock=...)`),
    which drives its transfer timeout, so that replays time out at the same tick."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --------------------------------------------------------------------------- servers
class Colocated:
    """One batcher serving requests end to end."""

    def __init__(self, sim: Sim) -> None:
        conf = sim.configs["local"]
        self.runtimes = {"local": sim.runtime("local", conf)}
        self.b = AtomBatcher(conf, self.runtimes["local"], ghost=True)
        self.links: dict[str, SimLink] = {}

    def batchers(self) -> dict[str, AtomBatcher]:
        return {"local": self.b}

    def submit(self, it: Item) -> int:
        return self.b.submit(it.prompt, it.max_new_tokens, it.eos)

    def abort(self, rid: int) -> bool:
        return self.b.abort(rid)

    def tick(self) -> list[tuple[int, str]]:
        return [(e.request_id, e.kind) for e in self.b.step() if e.kind in ("finished", "error")]

    def result(self, rid: int) -> tuple[list[int], str | None]:
        r = self.b.requests[rid]
        return list(r.tokens), r.error

    def idle(self) -> bool:
        return not self.b.busy()

    def at_rest(self) -> dict[str, AtomBatcher]:
        return self.batchers()

    def host_leaks(self) -> list[str]:
        return []

    @property
    def alive(self) -> bool:
        return False  # no link to fault


class Disaggregated:
    """A PD prefill worker feeding a decode worker, stepped alternately, one tick each."""

    def __init__(self, sim: Sim) -> None:
        cfg = sim.cfg
        td, tp = InProcessTransport.pair()
        self.links = {"decode": SimLink(td, sim.count), "prefill": SimLink(tp, sim.count)}
        self.runtimes = {side: sim.runtime(side, sim.configs[side])
                         for side in ("decode", "prefill")}
        dconf, pconf = sim.configs["decode"], sim.configs["prefill"]
        # ghost batchers: the checks cover the ghost invariants too
        # the workers' links are SecureLinks over the SimLinks (faults act on the sealed boxes),
        # their handshake done here, before any fault can be armed
        dlink = pdlink.SecureLink(self.links["decode"], SIM_KEY, "decode", clock=sim.clock)
        plink = pdlink.SecureLink(self.links["prefill"], SIM_KEY, "prefill", clock=sim.clock)
        pdlink.establish_pair(dlink, plink)
        self.pw = workers.PrefillWorker(pconf, self.runtimes["prefill"], plink, key=SIM_KEY,
                                        ghost=True)
        self.dw = workers.DecodeWorker(dconf, self.runtimes["decode"], dlink, key=SIM_KEY,
                                       fallback_local=bool(cfg.fallback_local),
                                       transfer_timeout=TRANSFER_TIMEOUT,
                                       prefetch=cfg.prefetch or 0, ghost=True, clock=sim.clock)

    def batchers(self) -> dict[str, AtomBatcher]:
        return {"decode": self.dw.batcher, "prefill": self.pw.batcher}

    def submit(self, it: Item) -> int:
        return self.dw.submit(it.prompt, it.max_new_tokens, it.eos)

    def abort(self, wid: int) -> bool:
        return self.dw.abort(wid)

    def tick(self) -> list[tuple[int, str]]:
        out = [(e.request_id, e.kind) for e in self.dw.step() if e.kind in ("finished", "error")]
        if not self.pw.done:
            self.pw.step_once()
        return out

    def result(self, wid: int) -> tuple[list[int], str | None]:
        r = self.dw.results()[wid]
        return list(r.tokens), r.error

    def idle(self) -> bool:
        return not self.dw.busy() and (self.pw.done or not self.pw.batcher.busy())

    def at_rest(self) -> dict[str, AtomBatcher]:
        # a prefill worker that was lost keeps what it held: it will never step again
        return self.batchers() if not self.pw.done else {"decode": self.dw.batcher}

    def host_leaks(self) -> list[str]:
        """Prefetched KV is held in host memory only while its request waits for a lane, or
        for the rest of its table (an import whose table still grows)."""
        out = []
        b = self.dw.batcher
        for wid, req in self.dw.requests.items():
            if req.payload is None:
                continue
            ph = None if req.brid is None else b.state.phase.get(req.brid)
            growing = ph == core.PHASE_IMPORTING and not b.awaits_kv(req.brid)
            if ph != core.PHASE_WAITING and not growing:
                out.append(f"decode worker holds prefetched KV of request {wid}, which no "
                           "longer waits")
        return out

    @property
    def alive(self) -> bool:
        return self.links["prefill"].alive


Server = Colocated | Disaggregated


# --------------------------------------------------------------------------- leak checks
def block_leaks(side: str, b: AtomBatcher) -> list[str]:
    """Every block is free, cached, scratch, held by a busy lane whose request has not ended,
    or draining for a recorded transfer of an ended request; every recorded transfer pins its
    block; every request the core has waiting is in the batcher's queue."""
    s, out = b.state, []
    transfers = b.transfers()  # request -> its first block: a transfer may pin several
    tables = [ln["blocks"] for ln in b.describe()["lanes"]]
    for blk in range(s.consts.K):
        own = s.owner[blk]
        if own in (core.OWNER_FREE, core.OWNER_CACHE, core.OWNER_SCRATCH):
            continue
        if own == core.OWNER_LANE:
            ln = s.owner_lane[blk]
            if not (s.busy[ln] and blk in tables[ln]):
                out.append(f"{side}: block {blk} is owned by lane {ln}, which does not hold it")
            elif b.requests[s.lane_req[ln]].ended:
                out.append(f"{side}: block {blk} is held by lane {ln} for request "
                           f"{s.lane_req[ln]}, which has ended")
        elif own == core.OWNER_DRAINING:
            r = s.transfer_req[blk]
            if r not in transfers:
                out.append(f"{side}: block {blk} drains with no recorded transfer")
            elif not b.requests[r].ended:
                out.append(f"{side}: block {blk} drains for request {r}, which has not ended")
        elif own == core.OWNER_SPILLING:  # the adapter stores a block within a step
            out.append(f"{side}: block {blk} is still spilling into host slot "
                       f"{s.spill_slot[blk]} between ticks")
        else:
            out.append(f"{side}: block {blk} has unknown owner {own}")
    for r, blk in transfers.items():
        if s.owner[blk] not in (core.OWNER_LANE, core.OWNER_DRAINING):
            out.append(f"{side}: the transfer of request {r} names block {blk}, which is "
                       f"{core.OWNER_NAMES[s.owner[blk]]}")
    core_waiting = sorted(r for r, ph in s.phase.items() if ph == core.PHASE_WAITING)
    if core_waiting != sorted(b.waiting):
        out.append(f"{side}: the core has requests {core_waiting} waiting, the queue "
                   f"{sorted(b.waiting)}")
    return out


def batcher_leaks(server: Server) -> list[str]:
    return [m for side, b in server.batchers().items() for m in block_leaks(side, b)]


def host_leaks(server: Server) -> list[str]:
    """Host memory the server holds for requests (PD: prefetched KV)."""
    return server.host_leaks()


def host_tier_leaks(server: Server) -> list[str]:
    """The host cache tier, by side: the adapter stores and loads within a step, so between
    ticks no slot is storing or loading (a spilling block is `block_leaks`' concern); and every
    slot's state and tokens in `describe()["host_cache"]` are the core's."""
    out = []
    for side, b in server.batchers().items():
        s = b.state
        if not s.consts.H:
            continue
        for h, st in enumerate(s.slot_state):
            if st in (core.SLOTSTATE_STORING, core.SLOTSTATE_LOADING):
                what = f"block {s.slot_block[h]}" if st == core.SLOTSTATE_STORING \
                    else f"into lane {s.load_lane[h]}'s block"
                out.append(f"{side}: host slot {h} is still {core.SLOTSTATE_NAMES[st].lower()} "
                           f"({what}) between ticks")
        described = b.describe()["host_cache"]
        want = [{"slot": h, "state": core.SLOTSTATE_NAMES[st].lower(),
                 "tokens": len(s.slot_key[h])} for h, st in enumerate(s.slot_state)]
        if described != want:
            got = {d.get("slot"): d for d in described}
            for w in want:
                d = got.pop(w["slot"], None)
                if d != w:
                    out.append(f"{side}: describe() reports host slot {w['slot']} as {d}, the "
                               f"core has {w}")
            out += [f"{side}: describe() reports a host slot {h} the core does not have"
                    for h in got]
    return out


def snapshot_leaks(server: Server) -> list[str]:
    """Hybrid prefix cache: the snapshot buffers the adapter holds (`describe()["snapshots"]`)
    are exactly the core's: a busy lane l's at the chunk boundaries C, 2C, .., lane_snap[l], a
    cache entry b's at C, .., snap_upto[b]; none for an idle lane or a block that is not a
    cache entry (each buffer is a local slot's worth of host memory)."""
    out = []
    for side, b in server.batchers().items():
        s = b.state
        if not (s.consts.HYBRID and s.consts.PREFIX):
            continue
        snaps = b.describe()["snapshots"]
        if snaps is None:
            out.append(f"{side}: a hybrid prefix cache, but describe() reports no snapshots")
            continue
        c = s.consts.C
        for kind, held, upto, live in (
                ("lane", snaps["lanes"], s.lane_snap, s.busy),
                # cache entries, and full lane blocks (they keep their lane's snapshots)
                ("block", snaps["entries"], s.snap_upto,
                 [o == core.OWNER_CACHE or (o == core.OWNER_LANE and s.tail[s.owner_lane[b]] != b)
                  for b, o in enumerate(s.owner)])):
            for i in sorted(set(held) | set(range(len(upto)))):
                ok = 0 <= i < len(upto) and live[i]
                want = list(range(c, upto[i] + 1, c)) if ok else []
                got = list(held.get(i, []))
                if got != want:
                    why = "" if ok else (" (idle)" if kind == "lane" else
                                         " (neither a cache entry nor a full lane block)")
                    out.append(f"{side}: the adapter holds snapshots of {kind} {i}{why} at "
                               f"{got}, the core {want}")
    return out


# One function per rule, each (server) -> problems.
LEAK_CHECKS: tuple[Callable[[Server], list[str]], ...] = (batcher_leaks, host_leaks,
                                                          host_tier_leaks, snapshot_leaks)


def at_rest(side: str, b: AtomBatcher) -> list[str]:
    s = b.state
    out = []
    if b.busy() or b.transfers():
        out.append(f"{side}: still busy after the drain (waiting {list(b.waiting)}, "
                   f"transfers {b.transfers()})")
    owners = [core.OWNER_NAMES[o] for o in s.owner]
    if not set(owners) <= {"FREE", "CACHE", "SCRATCH"}:
        out.append(f"{side}: blocks not at rest after the drain: {owners}")
    slots = [core.SLOTSTATE_NAMES[st] for st in s.slot_state]
    if not set(slots) <= {"EMPTY", "STORED"}:
        out.append(f"{side}: host slots not at rest after the drain: {slots}")
    return out


# --------------------------------------------------------------------------- fault kinds
@attrs.frozen
class FaultKind:
    """A kind of fault. Each tick it is considered with probability `rate`; `draw` then picks
    its event's arguments from the current state (None: nothing to do now) and `apply` carries
    an event out. It counts as injected when it takes effect (`Sim.count`)."""

    name: str
    help: str
    applies: Callable[[SimConfig], bool]
    draw: Callable[[Sim, random.Random], dict[str, Any] | None]
    apply: Callable[[Sim, SimEvent], None]
    rate: float = 0.03


Options = Callable[[SimConfig], list[tuple[str, str]]]  # (side, runtime call) pairs


def _runtime_fault(options: Options) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """draw and apply of a runtime fault: arm one of `options` to raise on its next call."""
    def draw(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
        choices = options(sim.cfg)
        if not choices:
            return None
        side, call = choices[rng.randrange(len(choices))]
        return {"side": side, "call": call}

    def apply(sim: Sim, ev: SimEvent) -> None:
        sim.server.runtimes[ev.arg("side")].arm(ev.arg("call"))

    return draw, apply


def _serving(cfg: SimConfig) -> list[str]:
    return ["decode", "prefill"] if cfg.pd else ["local"]


def _with_cache(cfg: SimConfig) -> list[str]:
    if not cfg.pd:
        return ["local"] if cfg.prefix_cache else []
    return [side for side, on in (("decode", cfg.prefix_cache),
                                  ("prefill", cfg.prefill_prefix_cache)) if on]


def _with_host(cfg: SimConfig) -> list[str]:
    """The sides whose batcher has a host cache tier."""
    if not cfg.pd:
        return ["local"] if cfg.host_cache_blocks else []
    return [side for side, h in (("decode", cfg.host_cache_blocks),
                                 ("prefill", cfg.prefill_host_cache_blocks)) if h]


def _moves(cfg: SimConfig, pd_side: str, what: str) -> list[tuple[str, str]]:
    """Who calls `{what}_kv_cache` / `{what}_local_cache`: a PD export (fetch, prefill side)
    or import (update, decode side), a batcher with a host tier (fetch: a store, update: a
    load) and a hybrid batcher with a prefix cache (its sliding-window snapshots)."""
    out = [(side, f"{what}_kv_cache")
           for side in dict.fromkeys(([pd_side] if cfg.pd else []) + _with_host(cfg))]
    if cfg.sliding_window is not None:
        sides = ([pd_side] if cfg.pd else []) + _with_cache(cfg)
        out += [(side, f"{what}_local_cache") for side in dict.fromkeys(sides)]
    return out


def _allocs(cfg: SimConfig) -> list[tuple[str, str]]:
    """Who allocates host buffers while serving: a PD export (every table block, and the local
    slot of a hybrid model) and a paged import, a host tier's store, a hybrid snapshot."""
    out = [(side, "new_host_buffer")
           for side in dict.fromkeys((["prefill", "decode"] if cfg.pd else []) + _with_host(cfg))]
    if cfg.sliding_window is not None:
        sides = (["prefill"] if cfg.pd else []) + _with_cache(cfg)
        out += [(side, "new_local_host_buffer") for side in dict.fromkeys(sides)]
    return out


def _draw_abort(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
    if not sim.submitted:
        return None
    live = [i for i in sim.submitted if not sim.outcomes[i]]
    # mostly a live request; sometimes an ended one (abort must then change nothing)
    pool = live if live and rng.random() < 0.9 else sim.submitted
    return {"request": pool[rng.randrange(len(pool))]}


def _apply_abort(sim: Sim, ev: SimEvent) -> None:
    i = ev.arg("request")
    if sim.server.abort(sim.ids[i]):
        sim.count("abort")
        sim.ended(i, "abort")


def _draw_link(ends: tuple[str, ...]) -> Callable[..., Any]:
    def draw(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
        if not sim.server.alive:
            return None
        return {"end": ends[rng.randrange(len(ends))]}
    return draw


def _apply_arm_link(sim: Sim, ev: SimEvent) -> None:
    sim.server.links[ev.arg("end")].armed.append(ev.kind)


def _draw_delay(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
    if not sim.server.alive:
        return None
    held = [end for end, link in sim.server.links.items() if link.held]
    if held:  # a delay ends after a few ticks on average
        return {"end": held[0], "op": "release"}
    if rng.random() < 0.3:
        return {"end": ("decode", "prefill")[rng.randrange(2)], "op": "hold"}
    return None


def _apply_delay(sim: Sim, ev: SimEvent) -> None:
    link = sim.server.links[ev.arg("end")]
    if ev.arg("op") == "hold" and not link.held:
        link.inner.hold()
        link.held = True
        sim.count("delay")
    elif ev.arg("op") == "release" and link.held:
        link.inner.release()
        link.held = False


def _draw_late(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
    if not sim.server.alive:
        return None
    ends = [end for end, link in sim.server.links.items() if link.history]
    if not ends:
        return None
    end = ends[rng.randrange(len(ends))]
    return {"end": end, "message": rng.randrange(len(sim.server.links[end].history))}


def _apply_late(sim: Sim, ev: SimEvent) -> None:
    if sim.server.links[ev.arg("end")].resend(ev.arg("message")):
        sim.count("late")


def _draw_kill(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
    # the prefill worker dies at most once, in the second half (PD serves the first half)
    if not sim.server.alive or sim.tick_no < sim.steps // 2:
        return None
    return {"end": "prefill"}


def _apply_kill(sim: Sim, ev: SimEvent) -> None:
    link = sim.server.links[ev.arg("end")]
    if link.alive:
        link.inner.kill()
        sim.count("kill")


def _pd(cfg: SimConfig) -> bool:
    return cfg.pd


_prefill = _runtime_fault(lambda c: [(side, "prefill") for side in _serving(c)])
_decode = _runtime_fault(lambda c: [("decode" if c.pd else "local", "decode")])
_copy = _runtime_fault(lambda c: [(side, "copy_kv_cache") for side in _with_cache(c)])
_fetch = _runtime_fault(lambda c: _moves(c, "prefill", "fetch"))
_update = _runtime_fault(lambda c: _moves(c, "decode", "update"))
_alloc = _runtime_fault(_allocs)

FAULTS: dict[str, FaultKind] = {f.name: f for f in (
    FaultKind("prefill", "a prefill call raises (after scribbling its block)",
              lambda c: True, *_prefill),
    FaultKind("decode", "a decode call raises (after scribbling every row's target)",
              lambda c: True, *_decode),
    FaultKind("copy", "copy_kv_cache (a prefix hit) raises", lambda c: bool(_with_cache(c)),
              *_copy, rate=0.05),
    FaultKind("fetch", "fetch_kv_cache / fetch_local_cache (PD export, host store, hybrid "
              "snapshot) raises",
              lambda c: bool(_moves(c, "prefill", "fetch")), *_fetch),
    FaultKind("update", "update_kv_cache / update_local_cache (PD import, host load, hybrid "
              "hit) raises",
              lambda c: bool(_moves(c, "decode", "update")), *_update),
    FaultKind("alloc", "new_host_buffer / new_local_host_buffer (PD export and import, host "
              "store, hybrid snapshot) raises: host memory ran out",
              lambda c: bool(_allocs(c)), *_alloc),
    FaultKind("delay", "PD: an end's messages are held, then released in order", _pd,
              _draw_delay, _apply_delay, rate=0.15),
    FaultKind("drop", "PD: the next message an end sends is lost", _pd,
              _draw_link(("decode", "prefill")), _apply_arm_link, rate=0.015),
    FaultKind("corrupt", "PD: the next KV payload has a byte flipped in flight", _pd,
              _draw_link(("prefill",)), _apply_arm_link),
    FaultKind("duplicate", "PD: the next message an end sends arrives twice", _pd,
              _draw_link(("decode", "prefill")), _apply_arm_link),
    FaultKind("late", "PD: an earlier message arrives again, late", _pd,
              _draw_late, _apply_late),
    FaultKind("kill", "PD: the prefill worker dies (its end of the link is killed)", _pd,
              _draw_kill, _apply_kill, rate=0.004),
    FaultKind("abort", "a client aborts a request, at any moment", lambda c: True,
              _draw_abort, _apply_abort, rate=0.04),
)}


def parse_faults(text: str | None) -> frozenset[str] | None:
    """CLI `--faults`: comma-separated kinds, "all" (None) or "none"."""
    if text is None or text.strip() == "all":
        return None
    if text.strip() == "none":
        return frozenset()
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise UsageError(f"unknown fault kind(s) {unknown}; known: {', '.join(FAULTS)}, "
                         "or all / none")
    return names


# --------------------------------------------------------------------------- the simulation
@attrs.frozen
class Failure:
    kind: str  # "invariant" | "leak" | "token" | "lifecycle" | "drain" | "crash"
    tick: int
    detail: str

    def __str__(self) -> str:
        return f"tick {self.tick}: {self.kind}: {self.detail}"


class Sim:
    """One run: builds the server for `cfg`, applies events, checks after each tick."""

    def __init__(self, cfg: SimConfig, faults: frozenset[str], steps: int,
                 wrap_runtime: Callable[[Any, str], Any] | None = None) -> None:
        self.cfg, self.faults, self.steps = cfg, faults, steps
        self.configs = _configs(cfg)
        self.wrap_runtime = wrap_runtime
        torch.manual_seed(cfg.seed)
        self.junk = torch.Generator().manual_seed(cfg.seed)
        self.workload = make_workload(cfg, steps + 8)
        self.clock = SimClock()
        self.injected: Counter[str] = Counter()
        self.events: list[SimEvent] = []
        self.submitted: list[int] = []  # workload indices, in submission order
        self.ids: dict[int, int] = {}  # workload index -> server request id
        self.outcomes: dict[int, list[str]] = {}
        self.failures: list[Failure] = []
        self.tick_no = 0
        self.drain_ticks = 0
        self.oracle: Any = None
        self.server: Server = Disaggregated(self) if cfg.pd else Colocated(self)

    # ------------------------------------------------------------------ plumbing
    def runtime(self, side: str, conf: Config) -> FaultyRuntime:
        inner: Any
        if self.cfg.runtime == "hf":
            inner, oracle = _hf(self.cfg.sliding_window, self.cfg.max_seq_len, conf)
            self.oracle = self.oracle or oracle
        else:
            inner = TorchReferenceRuntime.tiny(conf, seed=MODEL_SEED, **_model(self.cfg))
        if self.oracle is None:
            self.oracle = oracle_for(inner)  # the cache-free reference, never wrapped
        rt = inner if self.wrap_runtime is None else self.wrap_runtime(inner, side)
        return FaultyRuntime(rt, self.junk, self.count)

    def count(self, kind: str) -> None:
        self.injected[kind] += 1

    def fail(self, kind: str, detail: str) -> None:
        self.failures.append(Failure(kind, self.tick_no, detail))

    # ------------------------------------------------------------------ events
    def play(self, source: Iterable[SimEvent]) -> None:
        """Apply events until the source ends or something fails, then drain."""
        for ev in source:
            self.events.append(ev)
            self._guarded(lambda ev=ev: self.apply(ev))
            if self.failures:
                return
        self._guarded(self.drain)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - any escape from the batcher is a finding
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.fail("crash", f"{type(exc).__name__}: {exc} (in {where.name}, "
                      f"{Path(where.filename).name}:{where.lineno})")

    def apply(self, ev: SimEvent) -> None:
        if ev.kind == "step":
            self.tick()
            return
        if ev.kind == "submit":
            self.submit(ev.arg("request"))
        else:
            FAULTS[ev.kind].apply(self, ev)
        self.check()  # submit and abort are core transitions too

    def submit(self, i: int) -> None:
        sid = self.server.submit(self.workload[i])
        self.submitted.append(i)
        self.ids[i] = sid
        self.outcomes[i] = []
        _, error = self.server.result(sid)
        if error is not None:  # refused at once (PD: prefill worker lost, no local fallback)
            self.ended(i, "error")

    def tick(self) -> None:
        self.tick_no += 1
        self.clock.now += 1.0
        by_id = {sid: i for i, sid in self.ids.items()}
        for sid, kind in self.server.tick():
            self.ended(by_id[sid], kind)
        self.check()

    def ended(self, i: int, kind: str) -> None:
        """Request `i` ended (`kind`: finished, error, abort): once, and with the oracle's
        tokens (all of them if it finished, a prefix of them otherwise)."""
        self.outcomes[i].append(kind)
        if len(self.outcomes[i]) > 1:
            self.fail("lifecycle", f"request {i} ended {len(self.outcomes[i])} times: "
                      f"{self.outcomes[i]}")
        tokens, error = self.server.result(self.ids[i])
        it = self.workload[i]
        want = self.oracle.generate(list(it.prompt), it.max_new_tokens, it.eos)
        if kind == "finished":
            if error is not None:
                self.fail("lifecycle", f"request {i} finished with error {error!r}")
            if tokens != want:
                self.fail("token", f"request {i} (prompt of {len(it.prompt)} tokens) produced "
                          f"{_short(tokens)}, the oracle {_short(want)}")
        else:
            if error is None:
                self.fail("lifecycle", f"request {i} ended ({kind}) without an error")
            if tokens != want[:len(tokens)]:
                self.fail("token", f"request {i} ({kind}) emitted {_short(tokens)} before it "
                          f"ended, not a prefix of the oracle's {_short(want)}")

    def check(self) -> None:
        for side, b in self.server.batchers().items():
            bad = core.check_invariants(b.state)
            if bad:
                self.fail("invariant", f"{side}: {', '.join(bad)}")
        for rule in LEAK_CHECKS:
            for problem in rule(self.server):
                self.fail("leak", problem)

    # ------------------------------------------------------------------ the end
    def drain(self) -> None:
        """Stop injecting, let everything finish (capped), then check every request ended and
        every block is at rest."""
        for rt in self.server.runtimes.values():
            rt.disarm()
        for link in self.server.links.values():
            link.armed.clear()
            if link.held:
                link.inner.release()
                link.held = False
        live = sum(1 for i in self.submitted if not self.outcomes[i])
        cap = DRAIN_BASE + DRAIN_PER_REQUEST * live
        quiet = 0
        while quiet < 2:  # idle twice in a row: nothing arrived in between
            if self.drain_ticks >= cap:
                self.fail("drain", f"not idle after {cap} drain ticks; unfinished requests "
                          f"{[i for i in self.submitted if not self.outcomes[i]]}")
                return
            self.drain_ticks += 1
            self.tick()
            if self.failures:
                return
            quiet = quiet + 1 if self.server.idle() else 0
        for i in self.submitted:
            if not self.outcomes[i]:
                self.fail("lifecycle", f"request {i} never ended")
        for side, b in self.server.at_rest().items():
            for problem in at_rest(side, b):
                self.fail("leak", problem)


def _short(tokens: list[int]) -> str:
    return str(tokens) if len(tokens) <= 12 else f"[{', '.join(map(str, tokens[:12]))}, ...]"


def _draw_events(sim: Sim, seed: int) -> Iterator[SimEvent]:
    """The seed's events, drawn lazily: each draw sees the state the previous events left."""
    rng = random.Random(seed)
    kinds = [FAULTS[name] for name in sorted(sim.faults)]
    pending = iter(range(len(sim.workload)))
    for tick in range(sim.steps):
        burst = 3 if rng.random() < 0.05 else 1 if rng.random() < 0.35 else 0
        for _ in range(burst if tick else 2):  # two requests right away
            i = next(pending, None)
            if i is not None:
                yield SimEvent.of("submit", request=i)
        for kind in kinds:
            if rng.random() < kind.rate:
                args = kind.draw(sim, rng)
                if args is not None:
                    yield SimEvent.of(kind.name, **args)
        yield SimEvent("step")


# --------------------------------------------------------------------------- reports
@attrs.frozen
class Report:
    """The outcome of one run. Equality ignores timings: a replay must compare equal."""

    seed: int
    steps: int
    config: dict[str, Any]
    faults: tuple[str, ...]  # the kinds enabled
    requests: int
    completed: int
    errors: int
    aborted: int
    faults_injected: int
    faults_by_kind: dict[str, int]
    invariant_violations: int
    leaks: int
    token_mismatches: int
    lifecycle_errors: int
    drain_cap_hit: bool
    crash: str | None
    ticks: int
    events: tuple[SimEvent, ...]
    failures: tuple[Failure, ...]
    failing_prefix: tuple[SimEvent, ...] | None = None
    prefix_failures: tuple[Failure, ...] = ()
    fixed: dict[str, Any] = attrs.Factory(dict)
    batcher_stats: dict[str, dict[str, int]] = attrs.Factory(dict)  # by side: what was covered
    seconds: float = attrs.field(default=0.0, eq=False)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        head = f"seed {self.seed}, {self.steps} steps"
        if self.ok:
            return f"{head}: ok"
        more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        return f"{head}: FAILED {self.failures[0]}{more}; replay: {self.replay_command()}"

    @property
    def steps_per_second(self) -> float:
        return round(self.ticks / self.seconds, 1) if self.seconds > 0 else 0.0

    def replay_command(self) -> str:
        argv = ["atom-core", "simulate", "--seed", str(self.seed), "--steps", str(self.steps)]
        if set(self.faults) != _applicable(self.config_obj(), None):
            argv += ["--faults", ",".join(self.faults) or "none"]
        for name, value in self.fixed.items():
            argv += ["--set", f"{name}={'none' if value is None else value}"]
        return " ".join(argv)

    def config_obj(self) -> SimConfig:
        return SimConfig(seed=self.seed, **{d.name: self.config.get(d.name)
                                            for d in DIMENSIONS if d.name in self.config})

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "steps": self.steps, "ok": self.ok, "config": self.config,
            "requests": self.requests, "completed": self.completed, "errors": self.errors,
            "aborted": self.aborted, "faults_injected": self.faults_injected,
            "faults_by_kind": self.faults_by_kind,
            "invariant_violations": self.invariant_violations, "leaks": self.leaks,
            "token_mismatches": self.token_mismatches, "lifecycle_errors": self.lifecycle_errors,
            "drain_cap_hit": self.drain_cap_hit, "crash": self.crash, "ticks": self.ticks,
            "events": len(self.events), "failures": [str(f) for f in self.failures[:20]],
            "failing_prefix": None if self.failing_prefix is None
            else [e.as_json() for e in self.failing_prefix],
            "failing_prefix_events": None if self.failing_prefix is None
            else len(self.failing_prefix),
            "prefix_failures": [str(f) for f in self.prefix_failures[:20]],
            "replay": self.replay_command(), "batcher_stats": self.batcher_stats,
            "seconds": round(self.seconds, 3), "steps_per_second": self.steps_per_second,
        }


def _applicable(cfg: SimConfig, faults: frozenset[str] | None) -> set[str]:
    names = set(FAULTS) if faults is None else set(faults)
    return {n for n in names if FAULTS[n].applies(cfg)}


def _report(sim: Sim, seed: int, steps: int, fixed: dict[str, Any], seconds: float) -> Report:
    kinds = Counter(f.kind for f in sim.failures)
    ends = Counter(o[0] for o in sim.outcomes.values() if o)
    crash = next((f.detail for f in sim.failures if f.kind == "crash"), None)
    return Report(
        seed=seed, steps=steps, config=sim.cfg.as_json(), faults=tuple(sorted(sim.faults)),
        requests=len(sim.submitted), completed=ends["finished"], errors=ends["error"],
        aborted=ends["abort"], faults_injected=sum(sim.injected.values()),
        faults_by_kind={k: sim.injected[k] for k in sorted(sim.faults)},
        invariant_violations=kinds["invariant"], leaks=kinds["leak"],
        token_mismatches=kinds["token"], lifecycle_errors=kinds["lifecycle"],
        drain_cap_hit=bool(kinds["drain"]), crash=crash, ticks=sim.tick_no,
        events=tuple(sim.events), failures=tuple(sim.failures), fixed=dict(fixed),
        batcher_stats={side: attrs.asdict(b.stats) for side, b in sim.server.batchers().items()},
        seconds=seconds)


def _simulate(cfg: SimConfig, faults: frozenset[str], steps: int,
              events: Iterable[SimEvent] | None,
              wrap_runtime: Callable[[Any, str], Any] | None) -> Sim:
    sim = Sim(cfg, faults, steps, wrap_runtime)
    sim.play(_draw_events(sim, cfg.seed) if events is None else events)
    return sim


def run(seed: int, steps: int, faults: frozenset[str] | None = None, *, shrink: bool = False,
        wrap_runtime: Callable[[Any, str], Any] | None = None, **fixed: Any) -> Report:
    """Simulate `seed` for `steps` ticks, then drain; never prints.

    `faults`: the kinds to inject (None: every kind that applies to the configuration; see
    `FAULTS`). `fixed`: configuration dimensions to fix (see `DIMENSIONS`), e.g. `mode="pd"`.
    `shrink`: on failure, also find the shortest failing prefix of the event list
    (`Report.failing_prefix`; it replays the run a few dozen times at most).
    `wrap_runtime(runtime, side)`: wraps each reference runtime (tests plant bugs with it);
    the oracle always uses the unwrapped model. `str(report)` is a one-line summary.
    Raises `UsageError` for unknown fault kinds or dimensions, or impossible fixed values."""
    if steps < 0:
        raise UsageError(f"steps must be >= 0, got {steps}")
    if faults is not None and set(faults) - set(FAULTS):
        raise UsageError(f"unknown fault kind(s) {sorted(set(faults) - set(FAULTS))}")
    cfg = draw_config(seed, fixed)
    enabled = frozenset(_applicable(cfg, faults))
    t0 = time.perf_counter()
    sim = _simulate(cfg, enabled, steps, None, wrap_runtime)
    report = _report(sim, seed, steps, fixed, time.perf_counter() - t0)
    if shrink and not report.ok:
        prefix, failures = shortest_failing_prefix(cfg, enabled, steps, report.events,
                                                   wrap_runtime)
        report = attrs.evolve(report, failing_prefix=prefix, prefix_failures=failures)
    return report


def replay(seed: int, steps: int, events: Iterable[SimEvent],
           faults: frozenset[str] | None = None,
           wrap_runtime: Callable[[Any, str], Any] | None = None, **fixed: Any) -> Report:
    """Run exactly `events` (a recorded list, or a prefix of one), then drain."""
    cfg = draw_config(seed, fixed)
    enabled = frozenset(_applicable(cfg, faults))
    t0 = time.perf_counter()
    sim = _simulate(cfg, enabled, steps, list(events), wrap_runtime)
    return _report(sim, seed, steps, fixed, time.perf_counter() - t0)


def shortest_failing_prefix(cfg: SimConfig, faults: frozenset[str], steps: int,
                            events: tuple[SimEvent, ...],
                            wrap_runtime: Callable[[Any, str], Any] | None = None
                            ) -> tuple[tuple[SimEvent, ...], tuple[Failure, ...]]:
    """The shortest prefix of `events` that still fails when replayed and drained: bisection
    between a passing and a failing length, then a short walk below the passing one (a
    failure need not be monotone in the prefix length: an abort can hide a bug)."""
    def failures(n: int) -> tuple[Failure, ...]:
        return tuple(_simulate(cfg, faults, steps, events[:n], wrap_runtime).failures)

    hi, hi_failures = len(events), failures(len(events))
    if not hi_failures:  # cannot happen for a deterministic run; say so rather than guess
        raise RuntimeError("the recorded events did not fail on replay: nondeterminism")
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = failures(mid)
        if got:
            hi, hi_failures = mid, got
        else:
            lo = mid
    for n in range(lo - 1, max(-1, lo - 1 - SHRINK_WALK), -1):
        got = failures(n)
        if got:
            hi, hi_failures = n, got
    return events[:hi], hi_failures


# --------------------------------------------------------------------------- output
def render(report: Report) -> str:
    """A report as text for the terminal."""
    c = report.config
    lines = [f"atom-core simulate: seed {report.seed}, {report.steps} steps "
             f"({report.ticks} ticks with the drain, {report.steps_per_second} ticks/s)",
             "  config: " + ", ".join(f"{k}={v}" for k, v in c.items()),
             f"  requests: {report.requests} ({report.completed} finished, {report.errors} "
             f"failed, {report.aborted} aborted)",
             f"  faults injected: {report.faults_injected} ("
             + (", ".join(f"{k} {n}" for k, n in report.faults_by_kind.items()) or "none")
             + ")",
             f"  checks: {report.invariant_violations} invariant violations, {report.leaks} "
             f"leaks, {report.token_mismatches} token mismatches, {report.lifecycle_errors} "
             f"lifecycle errors" + (", drain cap hit" if report.drain_cap_hit else "")
             + (f", crash: {report.crash}" if report.crash else "")]
    if c.get("host_cache_blocks") or c.get("prefill_host_cache_blocks"):
        st = {k: sum(v.get(k, 0) for v in report.batcher_stats.values()) for k in
              ("host_stores", "host_store_failures", "host_hit_tokens", "host_load_failures")}
        lines.insert(3, f"  host tier: {st['host_stores']} stores ({st['host_store_failures']} "
                     f"failed), {st['host_hit_tokens']} tokens loaded "
                     f"({st['host_load_failures']} loads failed)")
    if report.ok:
        lines.append("OK")
        return "\n".join(lines)
    lines.append("FAILED:")
    lines += [f"  {f}" for f in report.failures[:10]]
    if report.failing_prefix is not None:
        p = report.failing_prefix
        ticks = sum(1 for e in p if e.kind == "step")
        lines.append(f"shortest failing prefix: {len(p)} of {len(report.events)} events "
                     f"({ticks} ticks), then the drain:")
        lines += [f"  {e}" for e in _compact(p)]
        lines += [f"  -> {f}" for f in report.prefix_failures[:5]]
    lines.append(f"replay: {report.replay_command()}")
    return "\n".join(lines)


def _compact(events: Iterable[SimEvent]) -> list[str]:
    """Events as lines, consecutive steps folded into one ("step x5")."""
    out: list[str] = []
    run_len = 0
    for e in events:
        if e.kind == "step":
            run_len += 1
            continue
        if run_len:
            out.append("step" if run_len == 1 else f"step x{run_len}")
            run_len = 0
        out.append(str(e))
    if run_len:
        out.append("step" if run_len == 1 else f"step x{run_len}")
    return out


# --------------------------------------------------------------------------- deep mode
@attrs.frozen
class SweepResult:
    seeds_run: int
    first_seed: int
    ticks: int
    seconds: float
    failing: Report | None

    @property
    def ok(self) -> bool:
        return self.failing is None

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "seeds_run": self.seeds_run, "first_seed": self.first_seed,
                "last_seed": self.first_seed + self.seeds_run - 1, "ticks": self.ticks,
                "seconds": round(self.seconds, 1),
                "steps_per_second": round(self.ticks / self.seconds, 1) if self.seconds else 0,
                "failing_seed": None if self.failing is None else self.failing.seed,
                "replay": None if self.failing is None else self.failing.replay_command(),
                "report": None if self.failing is None else self.failing.as_json()}


def sweep(first_seed: int, steps: int, *, last_seed: int | None = None,
          seconds: float | None = None, faults: frozenset[str] | None = None,
          on_seed: Callable[[Report, float], None] | None = None,
          **fixed: Any) -> SweepResult:
    """Consecutive seeds from `first_seed` until `last_seed` (inclusive) or until `seconds` of
    wall time are used, stopping at the first failing seed (shrunk). The wall clock decides
    only how many seeds run, never what a seed does. `on_seed(report, elapsed)` after each."""
    t0 = time.monotonic()
    seed, ticks, n = first_seed, 0, 0
    while (last_seed is None or seed <= last_seed) and (
            seconds is None or time.monotonic() - t0 < seconds):
        rep = run(seed, steps, faults, shrink=False, **fixed)
        n += 1
        ticks += rep.ticks
        if on_seed is not None:
            on_seed(rep, time.monotonic() - t0)
        if not rep.ok:
            rep = run(seed, steps, faults, shrink=True, **fixed)
            return SweepResult(n, first_seed, ticks, time.monotonic() - t0, rep)
        seed += 1
    return SweepResult(n, first_seed, ticks, time.monotonic() - t0, None)


def sweep_with_progress(first_seed: int, steps: int, *, last_seed: int | None = None,
                        seconds: float | None = None, faults: frozenset[str] | None = None,
                        show: bool = True, **fixed: Any) -> SweepResult:
    """`sweep` with a progress bar on stderr (rich; plain lines without it)."""
    total = (last_seed - first_seed + 1) if last_seed is not None else seconds
    failures = 0
    bar: Any = None
    if show:
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            pass
        else:
            bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                           console=Console(stderr=True))
    task = None

    def on_seed(rep: Report, elapsed: float) -> None:
        nonlocal failures
        failures += not rep.ok
        what = (f"seed {rep.seed}: {'ok' if rep.ok else 'FAILED'} "
                f"({rep.steps_per_second} ticks/s, {rep.faults_injected} faults)")
        if bar is not None:
            done = rep.seed - first_seed + 1 if last_seed is not None else elapsed
            bar.update(task, completed=done, description=what)
        elif show:
            print(what, file=sys.stderr, flush=True)

    if bar is None:
        return sweep(first_seed, steps, last_seed=last_seed, seconds=seconds, faults=faults,
                     on_seed=on_seed, **fixed)
    with bar:
        task = bar.add_task(f"seeds from {first_seed}", total=total)
        return sweep(first_seed, steps, last_seed=last_seed, seconds=seconds, faults=faults,
                     on_seed=on_seed, **fixed)
