"""`python -m atom_core.spec.codegen [--check]`: see the package docstring."""

import sys

from atom_core.spec.codegen import main

sys.exit(main())
