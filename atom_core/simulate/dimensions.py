"""Configuration dimensions: what a seed picks (`SimConfig`, one `Dimension` per axis in
`DIMENSIONS`), how `draw_config` draws it, how `--set NAME=VALUE` is parsed, and the batcher
configurations (`batcher_configs`) a drawn configuration stands for."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from atom_core.config import Config, ConfigError, min_kv_blocks

PREFILL_CHUNK = 64  # every simulated batcher's; the workload puts prompts on its edges


class UsageError(ValueError):
    """A bad fault name, dimension name or fixed value: the CLI prints it and exits 2."""


@attrs.frozen
class SimConfig:
    """One simulated deployment. PD-only fields are None when colocated."""

    seed: int
    mode: str = "colocated"  # "colocated" | "pd" | "cluster"
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
    # cluster: prefill and decode workers (LocalCluster); how many requests a prefill worker
    # holds before it refuses more (backpressure; None: the worker's default)
    prefill_workers: int | None = None
    decode_workers: int | None = None
    prefill_max_queued: int | None = None

    @property
    def pd(self) -> bool:
        """Prefill and decode batchers: the PD pair, or a cluster of each."""
        return self.mode in ("pd", "cluster")

    @property
    def cluster(self) -> bool:
        return self.mode == "cluster"

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
    return lambda c: values if c.get("mode") in ("pd", "cluster") else ()


def _cluster_only(*values: Any) -> Choices:
    return lambda c: values if c.get("mode") == "cluster" else ()


def _fallback_choices(c: dict[str, Any]) -> tuple[Any, ...]:
    # a cluster's decode workers always prefill locally what no prefill worker serves
    return {"pd": (True, False), "cluster": (True,)}.get(c.get("mode") or "", ())


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
        if c.get("mode") in ("pd", "cluster") else ()


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
        if pd_only and c.get("mode") not in ("pd", "cluster"):
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
    """Preemption where Config accepts it: paged tables (colocated, and both PD workers)."""
    if (c.get("blocks_per_table") or 1) == 1:
        return ()
    return (False, True)


DIMENSIONS: tuple[Dimension, ...] = (
    # cluster is never drawn (weight 0: every seed's mode stays what it was); fixed by
    # `--mode cluster` or `--set mode=cluster`
    Dimension("mode", "colocated batcher, a PD prefill worker feeding a decode worker, or a "
              "cluster of prefill and decode workers behind the router, with worker kills, "
              "restarts and late joins", _always("colocated", "pd", "cluster"),
              weights=(1, 1, 0)),
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
    Dimension("fallback_local", "PD: prefill locally once the prefill worker is lost "
              "(cluster: always)", _fallback_choices),
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
    Dimension("prefill_workers", "cluster: prefill workers (ranks; some may join late)",
              _cluster_only(1, 2, 3), open=True),
    Dimension("decode_workers", "cluster: decode workers (ranks; some may join late)",
              _cluster_only(1, 2, 3), open=True),
    Dimension("prefill_max_queued", "cluster: requests a prefill worker holds before it "
              "refuses more for backpressure (they are retried elsewhere or prefilled locally)",
              _cluster_only(1, 2, 4, 64), weights=(2, 1, 1, 1), open=True),
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
        batcher_configs(cfg)  # Config validates what fixed values left open
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
    # (a value's type from some configuration that offers the dimension: preemption, e.g.,
    # only with paged tables)
    contexts = ({"mode": "pd"}, {"mode": "pd", "blocks_per_table": 2}, {"mode": "cluster"})
    samples = list(dict.fromkeys(v for ctx in contexts for v in dim.choices(ctx)
                                 if v is not None))
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


def batcher_configs(cfg: SimConfig) -> dict[str, Config]:
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

    if cfg.cluster:
        for name, most in (("prefill_workers", 16), ("decode_workers", 16),
                           ("prefill_max_queued", 1024)):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= most:
                raise ValueError(f"{name} must be an integer in 1..{most}, got {v!r}")
    serving = one(cfg.lanes, cfg.prefix_cache, cfg.scratch, cfg.host_cache_blocks)
    if not cfg.pd:
        return {"local": serving}
    assert cfg.prefill_lanes is not None and cfg.prefill_scratch is not None
    return {"decode": serving, "prefill": one(cfg.prefill_lanes, bool(cfg.prefill_prefix_cache),
                                              cfg.prefill_scratch,
                                              cfg.prefill_host_cache_blocks or 0)}
