"""The compiled core (atom_core/native.py): which core a process runs, and that both agree.

The compiled modules are the generated in-place core and seq.py built by mypyc, loaded under
their own names only when built from the sources as they are now. tests/test_inplace.py checks
whichever in-place core this process runs against the pure core (the compiled one when it is
built, as in CI); here the other one, the Python module, is checked the same way, so that
neither goes untested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core import native, seq
from atom_core._generated import core
from atom_core._generated import inplace as ip
from tests.test_inplace import SCENARIOS, consts, run


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """native's build folder and record moved to tmp_path (the real build is untouched)."""
    monkeypatch.setattr(native, "NATIVE", tmp_path)
    monkeypatch.setattr(native, "DIGESTS", tmp_path / "built_from.json")
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    return tmp_path / "built_from.json"


def _built(record: Path, digests: dict[str, str]) -> None:
    for m in native.SOURCES:
        native.extension(m).write_bytes(b"")
    record.write_text(json.dumps(digests))


def test_status_follows_the_record_of_the_sources_built(record: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    current = {m: native.digest(m) for m in native.SOURCES}
    assert native.status() == "python"  # nothing built
    record.write_text("{}\n")  # a failed build
    assert native.status() == "python"
    record.write_text(json.dumps(current))  # a record without its extensions
    assert native.status() == "python"
    _built(record, current)
    assert native.status() == "compiled"
    _built(record, {**current, "seq": "0" * 64})  # seq.py changed since the build
    assert native.status() == "stale"
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native.status() == "pure"
    assert native.status(honour_pure=False) == "stale"  # (what `build` asks)


def test_a_stale_build_runs_the_python_core_with_one_warning(record: Path) -> None:
    _built(record, {m: "0" * 64 for m in native.SOURCES})
    finder = native.NativeFinder()
    with pytest.warns(RuntimeWarning, match="older sources.*make native"):
        assert finder.find_spec("atom_core.seq") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert finder.find_spec("atom_core._generated.inplace") is None
        assert finder.find_spec("atom_core.config") is None


def test_a_current_build_is_found_under_the_modules_own_names(record: Path) -> None:
    _built(record, {m: native.digest(m) for m in native.SOURCES})
    finder = native.NativeFinder()
    for m in native.SOURCES:
        spec = finder.find_spec(f"atom_core.{m}")
        assert spec is not None and spec.name == f"atom_core.{m}"
        assert spec.origin == str(native.extension(m))
    assert finder.find_spec("atom_core._generated.core") is None  # never compiled


def test_a_failed_build_says_why_and_leaves_the_python_core(
        record: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", "error: command 'gcc' failed")

    monkeypatch.setattr(native.subprocess, "run", no_compiler)
    with pytest.raises(RuntimeError, match="(?s)mypyc failed.*C compiler.*Python core.*gcc"):
        native.build()
    assert json.loads(record.read_text()) == {} and native.status() == "python"


def test_the_pure_switch_runs_the_python_modules() -> None:
    code = ("import atom_core._generated.inplace as i, atom_core.seq as s, atom_core.native as n;"
            "print(i.__file__, s.COMPILED, n.running())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, native.PURE_ENV: "1"}, check=True)
    path, compiled, running = out.stdout.split()
    assert path.endswith("inplace.py") and compiled == "False" and running == "python"


def test_ci_runs_the_compiled_core() -> None:
    """In CI (`make install` builds it) the tests run the compiled core; elsewhere they run
    whichever is current, and this says which."""
    state = native.status()
    if state != "compiled":
        if os.environ.get("CI"):
            pytest.fail(f"CI must test the compiled core, but it is {state!r} "
                        "(see `make native`)")
        pytest.skip(f"the compiled core is {state!r} here: the tests run the Python core")
    assert native.running() == "compiled"
    assert Path(ip.__file__) == native.extension("_generated.inplace")
    assert seq.COMPILED and type(seq.take).__name__ == "builtin_function_or_method"
    # one TokSeq class for every core: the pure core's sequences are the compiled ones
    assert core.TokSeq is seq.TokSeq is ip.TokSeq


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "noghost"])
@pytest.mark.parametrize("scenario", ["prefix-dynamic", "paged-prefix", "hybrid", "host",
                                      "preempt-host"])
@settings(max_examples=8, suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_the_python_in_place_core_matches_pure(scenario: str, ghost: bool, data: Any) -> None:
    """The Python module of the in-place core, loaded beside whichever this process runs,
    against the pure core (the differential run of tests/test_inplace.py)."""
    c = data.draw(consts(*SCENARIOS[scenario]), label="consts")
    run(data.draw, c, ghost, native.python_module("_generated.inplace"))


def test_python_module_is_the_source_not_the_extension() -> None:
    mod = native.python_module("_generated.inplace")
    assert mod.__file__ is not None and mod.__file__.endswith("inplace.py")
    assert type(mod.finish).__name__ == "function"  # interpreted, whichever core runs
    assert native.python_module("_generated.inplace") is mod  # loaded once


def test_the_generated_core_type_checks_clean() -> None:
    """mypyc compiles only code that type-checks, and compiled code enforces the declared
    types at run time: the generated in-place core (and seq.py) must pass mypy as generated."""
    mypy_api = pytest.importorskip("mypy.api")
    root = Path(native.PACKAGE)
    out, err, rc = mypy_api.run(["--follow-imports=silent", "--no-incremental",
                                 *(str(root / src) for src in native.SOURCES.values())])
    assert rc == 0, out + err
