"""The compiled core (built by `python -m atom_core.native build`; see atom_core.native)."""
