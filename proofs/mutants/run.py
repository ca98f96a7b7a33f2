"""Running: mutants through the layers (cheapest first, or all), the control, the report."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from collections.abc import Callable

import attrs

from atom_core.proofs.mutants.enumeration import CONTROL, Mutant, catalogue, load_core
from atom_core.proofs.mutants.layer_bmc import bmc_control, bmc_layer
from atom_core.proofs.mutants.layer_hypothesis import (
    core_machine_module,
    hypothesis_layer,
    machine_control,
)
from atom_core.proofs.mutants.layer_simulation import (
    simulation_available,
    simulation_control,
    simulation_layer,
)
from atom_core.proofs.mutants.layer_z3 import z3_control, z3_layer
from atom_core.proofs.mutants.options import LAYERS, Options
from atom_core.proofs.mutants.reporting import LayerResult, MutantResult, Report

LAYER_FNS: dict[str, Callable[[Mutant, Options], LayerResult]] = {
    "z3": z3_layer, "bmc": bmc_layer, "hypothesis": hypothesis_layer,
    "simulation": simulation_layer}


def run_layer(name: str, m: Mutant, opts: Options) -> LayerResult:
    t0 = time.perf_counter()
    try:
        r = LAYER_FNS[name](m, opts)
    except Exception as exc:  # a harness or generator failure is reported, never a verdict
        r = LayerResult(name, "error", f"{type(exc).__name__}: {exc}"[:300])
    return attrs.evolve(r, seconds=time.perf_counter() - t0)


def run_mutant(mutant_id: str, opts: Options) -> MutantResult:
    m = catalogue().get(mutant_id)
    if m is None:  # a worker imported a different spec than the one the run enumerated
        return MutantResult(mutant_id, "?", "", (LayerResult(
            "z3", "error", "the spec changed during the run: re-run"),), 0.0)
    t0 = time.perf_counter()
    out: list[LayerResult] = []
    for name in (x for x in LAYERS if x in opts.layers):
        if not opts.all_layers and any(r.status == "killed" for r in out):
            out.append(LayerResult(name, "skipped", "killed by an earlier layer"))
        else:
            out.append(run_layer(name, m, opts))
    load_core.cache_clear()  # one mutant's core in memory at a time
    return MutantResult(m.id, m.family, m.description, tuple(out), time.perf_counter() - t0)


def run_control(actions: tuple[str, ...], opts: Options) -> MutantResult:
    """The unmutated model through every layer: a layer that flags it ("killed") is looking at
    a spec that fails its own checks (mid-edit); z3 and bmc then discount those findings, and
    hypothesis and simulation report an error rather than kills."""
    t0 = time.perf_counter()
    out = []
    for name in (x for x in LAYERS if x in opts.layers):
        t1 = time.perf_counter()
        try:
            r = CONTROL_FNS[name](actions, opts)
        except Exception as exc:
            r = LayerResult(name, "error", f"{type(exc).__name__}: {exc}"[:300])
        out.append(attrs.evolve(r, seconds=time.perf_counter() - t1))
    return MutantResult(CONTROL, "control", "the unmutated model", tuple(out),
                        time.perf_counter() - t0)


def z3_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    bad = {k: v for a in actions for k, v in z3_control((a,)).items() if v != "proved"}
    if not bad:
        return LayerResult("z3", "survived", f"every obligation of {len(actions)} action(s) "
                           "proved")
    shown = "; ".join(f"{st} {k[2]} {k[0]} @ {k[1]}" for k, st in list(bad.items())[:4])
    status = "killed" if "counterexample" in bad.values() else "unknown"
    return LayerResult("z3", status, f"{len(bad)} obligation(s) not proved: {shown}")


def bmc_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    ctl = bmc_control(opts)
    bad = [f"{k}: {', '.join(sorted(v))}" for k, v in ctl.items()
           if isinstance(v, frozenset) and v]
    bad += [f"{k}: no stuck run" for k, v in ctl.items() if v is False]
    return LayerResult("bmc", "killed" if bad else "survived", "; ".join(bad)[:300])


def hypothesis_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    if core_machine_module() is None:
        return LayerResult("hypothesis", "unavailable",
                           "atom_core.testing needs hypothesis (the dev extra)")
    failure = machine_control(opts.examples)
    return LayerResult("hypothesis", "killed" if failure else "survived", failure or "")


def simulation_control_layer(actions: tuple[str, ...], opts: Options) -> LayerResult:
    if not simulation_available():
        return LayerResult("simulation", "unavailable", "atom_core/simulate.py does not exist")
    out = simulation_control(opts)
    if "error" in out:
        return LayerResult("simulation", "error", out["error"])
    return LayerResult("simulation", "survived" if out["ok"] else "killed",
                       "" if out["ok"] else f"seed {out['seed']}: {out['detail']}")


CONTROL_FNS: dict[str, Callable[[tuple[str, ...], Options], LayerResult]] = {
    "z3": z3_control_layer, "bmc": bmc_control_layer, "hypothesis": hypothesis_control_layer,
    "simulation": simulation_control_layer}


def run_all(ids: list[str], opts: Options, jobs: int,
            progress: Callable[[MutantResult, int, int], None] | None = None
            ) -> list[MutantResult]:
    results: dict[str, MutantResult] = {}

    def done(r: MutantResult) -> None:
        results[r.id] = r
        if progress:
            progress(r, len(results), len(ids))

    if jobs <= 1:
        for i in ids:
            done(run_mutant(i, opts))
    else:
        # spawn: z3 and hypothesis state must not be shared through fork
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(run_mutant, i, opts) for i in ids]
            for f in concurrent.futures.as_completed(futures):
                done(f.result())
    return [results[i] for i in ids]


def report(ids: list[str], opts: Options, jobs: int,
           progress: Callable[[MutantResult, int, int], None] | None = None) -> Report:
    t0 = time.perf_counter()
    actions = tuple(sorted({a for i in ids for a in catalogue()[i].actions}))
    control = run_control(actions, opts)
    results = run_all(ids, opts, jobs, progress)
    return Report("all-layers" if opts.all_layers else "cheap-first", opts.layers, control,
                  results, time.perf_counter() - t0)
