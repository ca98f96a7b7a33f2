"""Layer simulation: atom_core.simulate over the mutant core, in a fresh subprocess."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import types
from typing import Any

from atom_core.proofs.mutants.enumeration import (
    CONTROL,
    Mutant,
    catalogue,
    load_inplace_core,
    patched_table,
)
from atom_core.proofs.mutants.options import SIM_RUNS, Options
from atom_core.proofs.mutants.reporting import LayerResult


def simulation_available() -> bool:
    return importlib.util.find_spec("atom_core.simulate") is not None


def install_core(inplace: types.ModuleType, offsets: dict[tuple[bool, str], int] | None) -> None:
    """Make the in-place core `inplace` and the pure core it was generated with (its `_core`),
    and a capacity table, the project's generated modules: in sys.modules, and in every
    already-imported atom_core module that bound the committed ones (`config`, `policy` and
    `replay` import the pure core at import time, `batcher` and `policy` the in-place one)."""
    import atom_core._generated as pkg
    from atom_core._generated import capacity
    from atom_core._generated import core as committed
    from atom_core._generated import inplace as committed_inplace

    core = inplace._core
    swap = {id(committed): core, id(committed_inplace): inplace}
    if offsets is not None:
        swap[id(capacity)] = patched_table(offsets)
    sys.modules["atom_core._generated.core"] = core
    sys.modules["atom_core._generated.inplace"] = inplace
    pkg.core, pkg.inplace = core, inplace
    if offsets is not None:
        sys.modules["atom_core._generated.capacity"] = swap[id(capacity)]
        pkg.capacity = swap[id(capacity)]
    for name, mod in list(sys.modules.items()):
        if not name.startswith("atom_core") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in swap:
                setattr(mod, attr, swap[id(value)])


def simulate_one(mutant_id: str, runs: int, steps: int) -> dict[str, Any]:
    """In a fresh process: install the mutant core, then import and run the simulator."""
    m = catalogue()[mutant_id]
    install_core(load_inplace_core(mutant_id), m.offsets)
    import inspect

    from atom_core import simulate  # only now: it must bind the mutant core

    # no shrinking when the simulator offers it: the first failure is the kill
    quick = {"shrink": False} if "shrink" in inspect.signature(simulate.run).parameters else {}
    for seed, fixed in enumerate(SIM_RUNS[:runs]):
        try:
            report = simulate.run(seed, steps, **quick, **fixed)
        except Exception as exc:  # the mutant core or the adapter crashed: a failure seen
            return {"ok": False, "seed": seed, "detail": f"{type(exc).__name__}: {exc}"[:200]}
        if not report.ok:
            failures = getattr(report, "failures", ())
            detail = str(failures[0]) if failures else str(report)
            return {"ok": False, "seed": seed, "fixed": fixed, "detail": detail[:200]}
    return {"ok": True, "runs": runs, "steps": steps}


def run_simulation(mutant_id: str, opts: Options) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "atom_core.proofs.mutants", "--simulate-one", mutant_id,
           "--sim-runs", str(opts.sim_runs), "--sim-steps", str(opts.sim_steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.sim_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {opts.sim_timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


@functools.cache
def simulation_control(opts: Options) -> dict[str, Any]:
    return run_simulation(CONTROL, opts)


def simulation_layer(m: Mutant, opts: Options) -> LayerResult:
    if not simulation_available():
        return LayerResult("simulation", "unavailable", "atom_core/simulate.py does not exist")
    control = simulation_control(opts)
    if not control.get("ok"):
        return LayerResult("simulation", "error", f"the control fails: {control}")
    out = run_simulation(m.id, opts)
    if "error" in out:
        return LayerResult("simulation", "error", out["error"])
    if out["ok"]:
        return LayerResult("simulation", "survived")
    return LayerResult("simulation", "killed", f"seed {out['seed']}: {out['detail']}")
