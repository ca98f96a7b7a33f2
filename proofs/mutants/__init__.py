"""Mutation testing of the spec: plant systematic bugs, report which layer catches each one.

    python -m atom_core.proofs.mutants                 # every mutant, layers cheapest-first
    python -m atom_core.proofs.mutants --all-layers    # every layer on every mutant
    python -m atom_core.proofs.mutants --only 'drop-guard:admit_hit.*' --json out.json

Mutants are enumerated from the model, so a new action, guard or update gets its mutants
without a change here. Families:

  guard     drop one named guard conjunct of an action
  update    drop one assignment of an action
  swap      give one assignment of a flag, lane, block, request, slot or enum another value the
            action can name (the negation, another parameter or state term, another member)
  pin       skip a pin or an unpin (`copying`, `copy_src`, `transfer`, `transfer_req`): drop
            the assignment or give it a wrong value (the negation, or another term of the sort)
  free      free twice: an action that frees a block also frees another block it can name
  capacity  a capacity rule one block short (the proved table with one offset lowered)

Layers, cheapest first; a mutant stops at the first layer that kills it unless `--all-layers`:

  z3          the induction proofs (relational, arithmetic and bounded invariants, transition
              invariants)
              restricted to the mutated action: the other actions' obligations do not change
  bmc         explicit-state bounded model checking over the generated mutant core: every state
              reachable at one lane (two lanes up to a state bound), each feature combination at
              the mutant's capacity, checked against the invariants, transition invariants and
              progress (a stuck run is replayed in z3 against the mutant spec); and capacity
              tightness: a stuck run must exist one block below the minimum
  hypothesis  the core state machine (atom_core.testing.machine) over the mutant core, with
              a bounded, derandomized settings object (a mutant of a host-tier action over
              configurations with the host tier, paged tables included: only they take it; a
              mutant of hybrid state or guards over the hybrid tier too)
  simulation  atom_core.simulate over the mutant core, in a fresh subprocess that installs the
              mutant as atom_core._generated.core before importing it

A kill counts only where the unmutated model passes the same check (the control), so a spec
that is itself mid-edit does not inflate the kill rate. z3 `unknown` is never a kill and never a
pass: the layer reports `unknown`. Every mutant no layer kills needs an entry in EXPLAINED
("equivalent: ..." or "gap: ..."); one without is flagged and fails the run.

`--source-report` prints instead what mutmut (`make mutants-source`) left under mutants/: the
generic source mutants of the generated core, the policy and the adapter, per file.
"""

from __future__ import annotations

from atom_core.proofs.mutants.cli import main
from atom_core.proofs.mutants.enumeration import (
    CONTROL,
    FAMILIES,
    Mutant,
    base_model,
    catalogue,
    load_core,
    load_inplace_core,
    select,
    update_name,
)
from atom_core.proofs.mutants.layer_bmc import bmc_layer
from atom_core.proofs.mutants.layer_hypothesis import hypothesis_layer
from atom_core.proofs.mutants.layer_simulation import simulation_layer
from atom_core.proofs.mutants.layer_z3 import z3_control, z3_layer
from atom_core.proofs.mutants.options import LAYERS, SIM_RUNS, Options
from atom_core.proofs.mutants.reporting import (
    EXPLAINED,
    LayerResult,
    MutantResult,
    Report,
    render,
    source_report,
)
from atom_core.proofs.mutants.run import report, run_all, run_mutant

__all__ = [
    "CONTROL", "EXPLAINED", "FAMILIES", "LAYERS", "LayerResult", "Mutant", "MutantResult",
    "Options", "Report", "SIM_RUNS", "base_model", "bmc_layer", "catalogue", "hypothesis_layer",
    "load_core", "load_inplace_core", "main", "render", "report", "run_all", "run_mutant", "select",
    "simulation_layer", "source_report", "update_name", "z3_control", "z3_layer",
]
