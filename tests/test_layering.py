"""Data flows one way: spec -> generated core -> policy -> adapter -> runtime. The spec (the
generator's input) and the generator import nothing built from their output: with the
generated core refused by an import hook, `atom_core.spec` and its code generator import, and
the generator renders the core. (It may use `atom_core.seq`, the hand-written token sequence
the generated core is written against.) (Before, `atom_core/__init__.py` imported `Config`,
which reads the generated constants, so any import of the spec loaded the core generated from
it.)"""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("atom_core._generated", "atom_core.config", "atom_core.policy")):
            raise ImportError(name + " is refused here")
        return None
sys.meta_path.insert(0, Refuse())
from atom_core.spec.model import MODEL
from atom_core.spec import codegen
sources = codegen.generate(MODEL)
assert "def admit_miss" in sources["core.py"] and "def admit_miss" in sources["inplace.py"]
print(sorted(m for m in sys.modules if m.startswith("atom_core._generated")))
"""


def test_the_spec_and_its_generator_import_nothing_generated_from_them() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_package_still_offers_config_on_first_use() -> None:
    done = subprocess.run([sys.executable, "-c",
                           "import atom_core; print(atom_core.Config(lanes=2, kv_blocks=4)"
                           ".lanes, atom_core.ConfigError.__name__)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["2", "ConfigError"], done.stderr
