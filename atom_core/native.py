"""The compiled core: `atom_core/_generated/inplace.py` and `atom_core/seq.py` built with mypyc,
and the choice between it and the Python modules.

The generated in-place core declares its types (MState's fields, every parameter) and
type-checks clean, so mypyc compiles it as it is, with `seq.py` in the same group: a field read
is a C struct read, `take` a C call, and no interpreter loop runs in between. Nothing is copied
or rewritten: the extensions are the same two modules under their own names, and the Python
sources stay the reference and the fallback.

* `python atom_core/native.py build` (`make install` runs it, through `make native`):
  compiles both, moves each extension from beside its source into `atom_core/_native/` (where
  only `NativeFinder` looks) and records the SHA-256 of the sources it was built from in
  `atom_core/_native/built_from.json`. Needs mypy (the `native` extra) and a C compiler; it is
  run as a script, so that building never imports the package it builds.
* `NativeFinder` (installed by `atom_core/__init__.py`): `import atom_core.seq` and
  `import atom_core._generated.inplace` load the extensions when both were built from the
  sources as they are now and `ATOM_CORE_PURE` is unset; the Python modules otherwise, with one
  warning when a build exists but is stale (a regenerated core: run `make native`).
* `python atom_core/native.py status`: which core this checkout runs.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = Path(__file__).resolve().parent
NATIVE = PACKAGE / "_native"
# module (under atom_core) -> its source, relative to the package
SOURCES = {"seq": "seq.py", "_generated.inplace": "_generated/inplace.py"}
DIGESTS = NATIVE / "built_from.json"
# mypyc's shared library of the group: atom_core/_native/core__mypyc.*.so
GROUP = "atom_core._native.core"
# Set to any non-empty value: run the Python core even when the compiled one is current.
PURE_ENV = "ATOM_CORE_PURE"


def digest(module: str) -> str:
    """SHA-256 of the current source of `module` (a key of SOURCES)."""
    return hashlib.sha256((PACKAGE / SOURCES[module]).read_bytes()).hexdigest()


def extension(module: str) -> Path:
    """Where the compiled `module` lives."""
    return NATIVE / f"{module.rsplit('.', 1)[-1]}{EXTENSION_SUFFIXES[0]}"


def build() -> list[Path]:
    """Compile the current sources into atom_core/_native/; the extension files written.

    Raises RuntimeError with mypyc's output when it fails (the record is then empty, so the
    Python core runs and `make` does not retry until a source changes)."""
    import tempfile  # (build only: `import atom_core` imports this module)
    for old in NATIVE.glob("*.so"):
        old.unlink()
    DIGESTS.write_text("{}\n")
    root = PACKAGE.parent
    sources = [f"{PACKAGE.name}/{src}" for src in SOURCES.values()]
    digests = {m: digest(m) for m in SOURCES}
    beside = {m: PACKAGE / Path(src).with_suffix(EXTENSION_SUFFIXES[0])
              for m, src in SOURCES.items()}
    with tempfile.TemporaryDirectory(prefix="atom-core-native-") as tmp:
        # (mypyc's setuptools integration, run from the project root so that the modules keep
        # their names; --inplace writes each extension beside its source, moved below)
        script = Path(tmp) / "setup.py"
        script.write_text(
            "from setuptools import setup\nfrom mypyc.build import mypycify\n"
            "setup(name='atom-core-native', ext_modules=mypycify("
            f"{['--follow-imports=silent', *sources]!r}, group_name={GROUP!r}, "
            "opt_level='3'), script_args=['build_ext', '--inplace', '--build-temp', "
            f"{str(Path(tmp) / 'build')!r}, '--build-lib', {str(Path(tmp) / 'lib')!r}])\n")
        try:
            out = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True,
                                 text=True)
            if out.returncode != 0:
                raise RuntimeError(
                    "compiling the core with mypyc failed (it needs mypy, the `native` extra, "
                    "and a C compiler; atom-core runs its Python core without it):\n"
                    + (out.stdout + out.stderr)[-4000:])
            if digests != {m: digest(m) for m in SOURCES}:
                raise RuntimeError("a source changed while it was being compiled: build again")
            for m, path in beside.items():
                path.replace(extension(m))
        finally:
            for path in beside.values():
                path.unlink(missing_ok=True)
    DIGESTS.write_text(json.dumps(digests, indent=1) + "\n")
    return sorted(NATIVE.glob("*.so"))


def status(honour_pure: bool = True) -> str:
    """'compiled' (built from the current sources), 'stale' (built from older ones), 'python'
    (nothing built) or 'pure' (ATOM_CORE_PURE set, unless `honour_pure` is False)."""
    if honour_pure and os.environ.get(PURE_ENV):
        return "pure"
    try:
        built = json.loads(DIGESTS.read_text())
    except (OSError, ValueError):
        return "python"
    if not built or not all(extension(m).exists() for m in SOURCES):
        return "python"
    return "compiled" if built == {m: digest(m) for m in SOURCES} else "stale"


class NativeFinder(importlib.abc.MetaPathFinder):
    """Finds atom_core.seq and atom_core._generated.inplace in atom_core/_native/ when both are
    built from the current sources (never one without the other: they call each other)."""

    def __init__(self) -> None:
        self.names = {f"{PACKAGE.name}.{m}": m for m in SOURCES}
        self.state: str | None = None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        m = self.names.get(name)
        if m is None:
            return None
        if self.state is None:
            self.state = status()
            if self.state == "stale":
                warnings.warn(
                    "atom_core: the compiled core was built from older sources than "
                    "atom_core/seq.py and atom_core/_generated/inplace.py are now; running the "
                    "Python core (`make native` rebuilds it)", RuntimeWarning, stacklevel=2)
        if self.state != "compiled":
            return None
        return importlib.util.spec_from_file_location(name, extension(m))


def install() -> None:
    """Put a NativeFinder first on sys.meta_path (atom_core/__init__.py does, on import)."""
    if not any(isinstance(f, NativeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, NativeFinder())


def running() -> str:
    """'compiled' or 'python': the in-place core this process has imported (or would)."""
    mod = sys.modules.get(f"{PACKAGE.name}._generated.inplace")
    if mod is None:
        return "compiled" if status() == "compiled" else "python"
    return "python" if str(getattr(mod, "__file__", "")).endswith(".py") else "compiled"


def python_module(module: str) -> ModuleType:
    """The Python source of `module` (a key of SOURCES) as its own module, whichever core this
    process runs (named atom_core.<module>_python; for tests and benchmarks that compare the
    two). The in-place core's Python module still uses the running atom_core.seq."""
    name = f"{PACKAGE.name}.{module}_python"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PACKAGE / SOURCES[module])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python atom_core/native.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["build", "status"],
                        help="build: compile the core; status: which core this checkout runs")
    parser.add_argument("--force", action="store_true",
                        help="build even when the build is current")
    args = parser.parse_args(argv)
    if args.command == "build" and not args.force and status(honour_pure=False) == "compiled":
        DIGESTS.touch()  # (for make: a source rewritten with the same text needs no build)
        print("the compiled core is current (built from these sources); --force rebuilds it")
    elif args.command == "build":
        try:
            for path in build():
                print(f"built {path.relative_to(PACKAGE.parent)}")
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"core: {status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
