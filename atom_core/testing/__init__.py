"""Test support that imports hypothesis: needs the dev extra (hypothesis and pytest:
`pip install -e '.[dev]'`).

The core state machine (`atom_core.testing.machine`: `make_machine`, a hypothesis
`RuleBasedStateMachine` over the generated core), the request-lifecycle model it compares the
core against (`atom_core.testing.lifecycle`) and its strategies (`atom_core.testing.strategies`).
The tests, `proofs/mutants` (its hypothesis layer) and `bench/stateful.py` import it; nothing in
the runtime package or the proofs imports it at module import time (serving needs no
hypothesis).
"""
