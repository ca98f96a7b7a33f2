"""The fault kinds (`FAULTS`): when each applies, how a seed draws its events and how an
event is carried out on the running server; `--faults` parsing."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from atom_core.simulate.dimensions import SimConfig, UsageError
from atom_core.simulate.events import SimEvent

if TYPE_CHECKING:
    from atom_core.simulate.driver import Sim


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
    return cfg.mode == "pd"  # the pair's link (a cluster's faults are its workers)


def _not_cluster(cfg: SimConfig) -> bool:
    # runtime faults stay with the pair and colocated: in a cluster every failure must be
    # explained by a killed decode worker or an abort (checks/cluster.py)
    return not cfg.cluster


def _cluster(cfg: SimConfig) -> bool:
    return cfg.cluster


ROLES = ("decode", "prefill")


def _draw_worker_kill(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
    """A running worker dies; a decode worker only while another one is running and ready
    (with none, requests fail at once: a run without any is not worth its ticks)."""
    server = sim.server
    options = [("prefill", r) for r in server.running("prefill")]
    ready = [r for r in server.running("decode") if server.c.decodes[r].ready]
    if len(ready) > 1:
        options += [("decode", r) for r in ready]
    if not options:
        return None
    role, rank = options[rng.randrange(len(options))]
    return {"role": role, "rank": rank}


def _apply_worker_kill(sim: Sim, ev: SimEvent) -> None:
    if sim.server.kill(ev.arg("role"), ev.arg("rank")):
        sim.count("worker_kill")


def _draw_worker_start(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
    """A stopped rank starts: a late joiner (never started) or a restart; half the time it
    is not ready yet (still linking) until a worker_ready event."""
    options = [(role, r) for role in ROLES for r in sim.server.stopped(role)]
    if not options:
        return None
    role, rank = options[rng.randrange(len(options))]
    return {"role": role, "rank": rank, "ready": rng.random() < 0.5}


def _apply_worker_start(sim: Sim, ev: SimEvent) -> None:
    if sim.server.start(ev.arg("role"), ev.arg("rank"), ready=ev.arg("ready")):
        sim.count("worker_start")


def _draw_worker_ready(sim: Sim, rng: random.Random) -> dict[str, Any] | None:
    options = [(role, r) for role in ROLES for r in sim.server.not_ready(role)]
    if not options:
        return None
    role, rank = options[rng.randrange(len(options))]
    return {"role": role, "rank": rank}


def _apply_worker_ready(sim: Sim, ev: SimEvent) -> None:
    if sim.server.make_ready(ev.arg("role"), ev.arg("rank")):
        sim.count("worker_ready")


_prefill = _runtime_fault(lambda c: [(side, "prefill") for side in _serving(c)])
_decode = _runtime_fault(lambda c: [("decode" if c.pd else "local", "decode")])
_copy = _runtime_fault(lambda c: [(side, "copy_kv_cache") for side in _with_cache(c)])
_fetch = _runtime_fault(lambda c: _moves(c, "prefill", "fetch"))
_update = _runtime_fault(lambda c: _moves(c, "decode", "update"))
_alloc = _runtime_fault(_allocs)

FAULTS: dict[str, FaultKind] = {f.name: f for f in (
    FaultKind("prefill", "a prefill call raises (after scribbling its block)",
              _not_cluster, *_prefill),
    FaultKind("decode", "a decode call raises (after scribbling every row's target)",
              _not_cluster, *_decode),
    FaultKind("copy", "copy_kv_cache (a prefix hit) raises",
              lambda c: _not_cluster(c) and bool(_with_cache(c)), *_copy, rate=0.05),
    FaultKind("fetch", "fetch_kv_cache / fetch_local_cache (PD export, host store, hybrid "
              "snapshot) raises",
              lambda c: _not_cluster(c) and bool(_moves(c, "prefill", "fetch")), *_fetch),
    FaultKind("update", "update_kv_cache / update_local_cache (PD import, host load, hybrid "
              "hit) raises",
              lambda c: _not_cluster(c) and bool(_moves(c, "decode", "update")), *_update),
    FaultKind("alloc", "new_host_buffer / new_local_host_buffer (PD export and import, host "
              "store, hybrid snapshot) raises: host memory ran out",
              lambda c: _not_cluster(c) and bool(_allocs(c)), *_alloc),
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
    FaultKind("worker_kill", "cluster: a prefill or decode worker dies (every link it has "
              "ends at once)", _cluster, _draw_worker_kill, _apply_worker_kill, rate=0.02),
    FaultKind("worker_start", "cluster: a stopped worker starts (a late join, or a restart "
              "of a killed one), sometimes not ready at first", _cluster, _draw_worker_start,
              _apply_worker_start, rate=0.03),
    FaultKind("worker_ready", "cluster: a started worker reports ready", _cluster,
              _draw_worker_ready, _apply_worker_ready, rate=0.1),
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


def applicable(cfg: SimConfig, faults: frozenset[str] | None) -> set[str]:
    """The kinds of `faults` (None: all) that apply to `cfg`."""
    names = set(FAULTS) if faults is None else set(faults)
    return {n for n in names if FAULTS[n].applies(cfg)}
