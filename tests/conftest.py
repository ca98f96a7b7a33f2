import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=50, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile("deep", max_examples=5000, deadline=None, stateful_step_count=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _without_local_constants() -> None:
    """Hypothesis also draws literals it finds in the project's loaded modules, and which
    modules are loaded depends on the tests that ran earlier in the process (one importing
    atom_core.demo changed what a derandomized state machine drew, and its coverage checks
    with it). The CI profile must draw the same examples whatever the order, so there it
    draws none (a private hook: if hypothesis renames it, this does nothing)."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        return
    empty = getattr(providers, "_local_constants", None)
    if empty is not None and hasattr(providers, "_get_local_constants"):
        providers._get_local_constants = lambda: empty


if settings().derandomize:
    _without_local_constants()


@pytest.fixture
def fresh_z3():
    """A fresh z3 context per test, so no test depends on what earlier tests declared (a query's
    symbol names steer z3's search). Seen while writing tests/test_proofs.py (on an intermediate
    model version): late in a run, refutations that take ~30 ms in a fresh process
    (`lane_holds_its_tokens`/decode without decode's lane_seq update;
    `busy_lane_runs_its_request`/abort_waiting without its guard) hit the 10 s timeout. Nothing
    in the proofs keeps z3 terms across calls, so this is safe. Modules of proof tests use it
    for every test (`pytestmark = pytest.mark.usefixtures("fresh_z3")`)."""
    import z3

    from atom_core.proofs import encode

    z3.z3._main_ctx = None
    encode.reset_names()
    yield


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """The runtime registry's registrations made by a test are undone after it."""
    from atom_core.runtime import registry

    before = dict(registry.KINDS)
    yield
    registry.KINDS.clear()
    registry.KINDS.update(before)
