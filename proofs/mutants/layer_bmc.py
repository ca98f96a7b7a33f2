"""Layer bmc: explicit-state search over the mutant core (proofs/search.py's moves and
stuck-run search, given the mutant core), and capacity tightness."""

from __future__ import annotations

import functools
import types
from collections import deque
from typing import Any

import attrs

from atom_core.proofs.mutants.enumeration import (
    CONTROL,
    Mutant,
    base_model,
    catalogue,
    load_core,
    offsets_of,
)
from atom_core.proofs.mutants.layer_z3 import fresh_z3
from atom_core.proofs.mutants.options import BMC_CHUNK, BMC_SEQ_LEN, Options
from atom_core.proofs.mutants.reporting import LayerResult


@attrs.frozen
class Config:
    label: str
    consts: Any
    progress: bool  # check progress too (not for hybrid: it changes no admission rule)


def bmc_configs(core: types.ModuleType, offsets: dict[tuple[bool, str], int],
                lanes: int, below: int = 0) -> list[Config]:
    """Each feature combination at `lanes` lanes and its capacity (minus `below`), and on top
    of each (not below) the hybrid (sliding-window) variant, and with the prefix cache the host
    tier with one slot: the proved rules hold for those too (capacity.COMBINATIONS)."""
    fields = attrs.fields_dict(core.Consts)
    out = []
    for (prefix, scratch), off in sorted(offsets.items()):
        k = lanes + off - below
        if k < 1:
            continue
        variants: list[dict[str, Any]] = [{}]
        if not below and "HYBRID" in fields:
            variants.append({"HYBRID": True})
        if not below and prefix and "HOST" in fields:
            variants.append({"HOST": True, "H": 1})
        for extra in variants:
            cs = {"B": lanes, "K": k, "C": BMC_CHUNK, "S": BMC_SEQ_LEN, "PREFIX": prefix,
                  "RESERVED": scratch == "reserved", "SCRATCH": 0, **extra}
            label = (f"B={lanes},K={k},{'prefix cache' if prefix else 'no cache'},{scratch}"
                     + (",hybrid" if "HYBRID" in extra else "")
                     + (",host tier" if "HOST" in extra else ""))
            out.append(Config(label, core.Consts(**cs), "HYBRID" not in extra))
    return out


def violations(core: types.ModuleType, pre: Any, post: Any, progress: bool) -> list[str]:
    try:
        bad = [f"invariant {n}" for n in core.check_invariants(post)]
        bad += [f"transition {n}" for n in core.check_transition(pre, post)]
        if progress:
            bad += [f"stuck {n}" for n in core.progress_violations(post)]
    except Exception as exc:  # a checker that crashes on a reachable state is a finding too
        bad = [f"crash in a checker: {type(exc).__name__}"]
    return bad


def explore(core: types.ModuleType, cfg: Config, max_states: int,
            ignore: frozenset[str] | None) -> tuple[dict[str, tuple], bool]:
    """Breadth-first over every state reachable with B + 1 requests (search.moves: every action,
    PD included, with its symmetry reduction). Returns the first run to each finding and
    whether the space was exhausted. With `ignore` (the control's findings) it stops at the
    first finding not in it; without, it collects all (the control itself)."""
    from atom_core.proofs import search

    c = cfg.consts
    requests, prompts = c.B + 1, search.menu(c.C)
    start = core.init(c, ghost=True)
    seen = {search.state_key(start, core)}
    frontier: deque[tuple[Any, tuple]] = deque([(start, ())])
    found: dict[str, tuple] = {}
    while frontier:
        s, path = frontier.popleft()
        try:
            succ = [(n, a, core.ACTIONS[n][0](s, **a).state)
                    for n, a in search.moves(s, requests, prompts, skip=(), core=core)]
        except Exception as exc:  # the mutant core crashes in a reachable state: a finding
            found.setdefault(f"crash: {type(exc).__name__}", path)
            if ignore is not None:
                return found, False
            continue
        for name, args, nxt in succ:
            step = (path, (name, args))
            try:
                key = search.state_key(nxt, core)
            except Exception as exc:  # a state the core should never build (e.g. a None key)
                found.setdefault(f"crash: {type(exc).__name__} in a state {name} built", step)
                if ignore is not None:
                    return found, False
                continue
            if key in seen:
                continue
            seen.add(key)
            new = [b for b in violations(core, s, nxt, cfg.progress)
                   if b not in found and (ignore is None or b not in ignore)]
            for b in new:
                found[b] = step
            if new and ignore is not None:
                return found, False
            if len(seen) >= max_states:
                return found, False
            frontier.append((nxt, step))
    return found, True


@functools.cache
def bmc_control(opts: Options) -> dict[str, Any]:
    """What the unmutated model's core shows in the same searches: its findings per config
    (excluded from kills) and whether a stuck run exists one block below each minimum."""
    core = load_core(CONTROL)
    offsets = offsets_of(catalogue()[CONTROL])
    out: dict[str, Any] = {}
    for lanes, cap in ((1, opts.bmc_states), (2, opts.bmc_wide_states)):
        for cfg in bmc_configs(core, offsets, lanes):
            out[cfg.label] = frozenset(explore(core, cfg, cap, None)[0])
    for cfg in tight_configs(core, offsets):
        out[f"tight {cfg.label}"] = stuck_below(core, cfg, opts) is True
    return out


def tight_configs(core: types.ModuleType, offsets: dict[tuple[bool, str], int]) -> list[Config]:
    """One block below each combination's minimum, at the fewest lanes where that is a block."""
    out = []
    for key in sorted(offsets):
        for lanes in (1, 2):
            cfgs = bmc_configs(core, {key: offsets[key]}, lanes, below=1)
            if cfgs:
                out += cfgs
                break
    return out


def stuck_below(core: types.ModuleType, cfg: Config, opts: Options) -> bool | None:
    """A colocated stuck run exists (True), provably none within the search (False), or the
    search hit its bound (None)."""
    from atom_core.proofs import search

    try:
        run = search.shortest_stuck_run(cfg.consts, max_states=opts.bmc_states, core=core)
    except RuntimeError:
        return None
    return run is not None


def confirmed(m: Mutant, cfg: Config, run: list[tuple[str, dict]], finding: str) -> bool | None:
    """A stuck run replayed in z3 against the mutant spec (as verify does for its runs), so the
    kill does not rest on the generator."""
    from atom_core.proofs import search

    fresh_z3()
    prop = finding.removeprefix("stuck ")
    try:
        return search.confirm(m.change(base_model()), cfg.consts, run, prop, cfg.consts.B + 1)
    except Exception:
        return None


def bmc_layer(m: Mutant, opts: Options) -> LayerResult:
    core = load_core(m.id)
    control = bmc_control(opts)
    offsets = offsets_of(m)
    # cheapest first: one lane (exhaustive), tightness, then two lanes (bounded)
    for cfg in bmc_configs(core, offsets, 1):
        found = explore(core, cfg, opts.bmc_states, control.get(cfg.label, frozenset()))[0]
        if found:
            return bmc_finding(m, cfg, found)
    for cfg in tight_configs(core, offsets):
        if not control.get(f"tight {cfg.label}"):
            continue  # the control has no stuck run here either: nothing to compare
        stuck = stuck_below(core, cfg, opts)
        if stuck is None:
            return LayerResult("bmc", "unknown", f"stuck-run search at {cfg.label} hit "
                               f"its bound of {opts.bmc_states} states")
        if not stuck:
            return LayerResult("bmc", "killed", f"not tight: no stuck run at {cfg.label}, "
                               "one block below the capacity rule")
    for cfg in bmc_configs(core, offsets, 2):
        found = explore(core, cfg, opts.bmc_wide_states,
                        control.get(cfg.label, frozenset()))[0]
        if found:
            return bmc_finding(m, cfg, found)
    return LayerResult("bmc", "survived")


def bmc_finding(m: Mutant, cfg: Config, found: dict[str, tuple]) -> LayerResult:
    from atom_core.proofs import search

    finding, path = next(iter(found.items()))
    run = search.unwind(path)
    detail = f"{finding} at {cfg.label} after {len(run)} steps"
    if finding.startswith("stuck "):
        ok = confirmed(m, cfg, run, finding)
        if ok is None:
            return LayerResult("bmc", "unknown", f"{detail}; the z3 replay did not answer")
        if not ok:
            return LayerResult("bmc", "error", f"{detail}; the run does not replay in z3")
        detail += " (replayed in z3)"
    return LayerResult("bmc", "killed", detail)
