"""`python -m atom_core.proofs.mutants` (see the package docstring)."""

from atom_core.proofs.mutants.cli import main

raise SystemExit(main())
