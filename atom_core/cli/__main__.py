"""`python -m atom_core.cli`: the `atom-core` command."""

from atom_core.cli import main

raise SystemExit(main())
