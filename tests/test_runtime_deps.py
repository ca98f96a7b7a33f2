"""Serving code embeds atom_core without z3 or hypothesis, and the core without torch."""

import subprocess
import sys


def _imported_after(code: str) -> set[str]:
    code += "\nimport sys; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return set(out.split())


def test_core_policy_config_need_only_attrs():
    mods = _imported_after("import atom_core, atom_core.policy, atom_core.replay\n"
                           "from atom_core._generated import core")
    assert not {"z3", "hypothesis", "torch"} & mods


def test_batcher_needs_no_z3_or_hypothesis():
    mods = _imported_after("from atom_core import AtomBatcher\n"
                           "from atom_core.runtime import TorchReferenceRuntime")
    assert "torch" in mods
    assert not {"z3", "hypothesis"} & mods


def test_batcher_and_runtimes_need_no_transformers():
    """Only atom_core.runtime.hf imports transformers (the `hf` extra)."""
    mods = _imported_after("from atom_core import AtomBatcher\n"
                           "import atom_core.runtime, atom_core.pd.workers, atom_core.demo")
    assert "transformers" not in mods
    assert "transformers" in _imported_after("import atom_core.runtime.hf")


def test_only_tests_import_the_test_support():
    """atom_core.testing needs hypothesis (the dev extra): the runtime package, the CLI and the
    proofs (the mutants tool too, until its hypothesis layer runs) never import it."""
    mods = _imported_after("import atom_core, atom_core.batcher, atom_core.cli, atom_core.serve\n"
                           "import atom_core.proofs.run, atom_core.proofs.generate\n"
                           "import atom_core.proofs.mutants")
    assert not {m for m in mods if m.startswith("atom_core.testing")}
    assert "hypothesis" not in mods
