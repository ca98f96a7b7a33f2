"""`python -m atom_core.proofs.mutants`: the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from atom_core.cli.common import positive
from atom_core.proofs.mutants.enumeration import select
from atom_core.proofs.mutants.layer_simulation import simulate_one
from atom_core.proofs.mutants.options import LAYERS, Options
from atom_core.proofs.mutants.reporting import (
    print_progress,
    print_source_report,
    render,
    source_report,
)
from atom_core.proofs.mutants.run import report

# the package docstring's first paragraph
DESCRIPTION = ("Mutation testing of the spec: plant systematic bugs, report which layer catches "
               "each one.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atom_core.proofs.mutants",
                                 description=DESCRIPTION)
    ap.add_argument("--all-layers", action="store_true",
                    help="run every layer on every mutant (per-layer kill rates)")
    ap.add_argument("--layers", default=",".join(LAYERS),
                    help=f"comma-separated subset of {','.join(LAYERS)}")
    ap.add_argument("--only", metavar="PATTERN",
                    help="mutant ids matching this glob (or containing this text)")
    ap.add_argument("--sample", type=positive, metavar="N",
                    help="only N mutants, spread evenly over the selection (a quick estimate)")
    ap.add_argument("--jobs", type=positive, default=1, help="worker processes")
    ap.add_argument("--json", metavar="PATH", type=Path, help="write the results as JSON")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="a row per mutant")
    defaults = Options()
    ap.add_argument("--examples", type=positive, default=defaults.examples,
                    help="hypothesis examples per mutant")
    ap.add_argument("--sim-runs", type=positive, default=defaults.sim_runs,
                    help="simulated runs per mutant (SIM_RUNS)")
    ap.add_argument("--sim-steps", type=positive, default=defaults.sim_steps,
                    help="simulated ticks per seed")
    ap.add_argument("--source-report", action="store_true",
                    help="print mutmut's results under mutants/ per file (`make mutants-source`)")
    ap.add_argument("--simulate-one", metavar="ID", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json {args.json}: no directory {args.json.parent} to write it in")

    if args.source_report:
        rows = source_report()
        print_source_report(rows)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")
        return 0

    if args.simulate_one:  # the simulation layer's subprocess
        print(json.dumps(simulate_one(args.simulate_one, args.sim_runs, args.sim_steps)))
        return 0
    layers = tuple(x for x in args.layers.split(",") if x)
    unknown = set(layers) - set(LAYERS)
    if unknown:
        ap.error(f"unknown layer(s): {', '.join(sorted(unknown))}")
    mutants = select(args.only, args.sample)
    if args.list:
        for m in mutants:
            print(f"{m.id:<60} {m.family:<9} {m.description}")
        return 0
    if not mutants:
        ap.error(f"no mutant matches {args.only!r}")
    opts = Options(layers=layers, all_layers=args.all_layers, examples=args.examples,
                   sim_runs=args.sim_runs, sim_steps=args.sim_steps)
    rep = report([m.id for m in mutants], opts, args.jobs, print_progress)
    if args.json:
        args.json.write_text(json.dumps(rep.as_json(), indent=2) + "\n")
    render(rep, args.verbose)
    return 1 if rep.unexplained or rep.errors else 0
