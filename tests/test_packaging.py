"""The package list in pyproject.toml is hand-written (the spec/ and proofs/ mapping defeats
auto-discovery), and an editable install hides a missing entry. Catch it here."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_dir_is_listed() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    assert mapping == {"atom_core": "atom_core", "atom_core.spec": "spec",
                       "atom_core.proofs": "proofs"}
    found = set()
    for pkg, d in mapping.items():
        for init in (ROOT / d).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / d).parts
            found.add(".".join((pkg, *rel)))
    assert found == listed
