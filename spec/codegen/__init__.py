"""Translate the spec model into the executable core, `atom_core/_generated/core.py`, its
in-place variant `atom_core/_generated/inplace.py` (`InplaceGenerator`, documented there) and
the actions as typed records, `atom_core/_generated/choices.py` (`ChoicesGenerator`).

    python -m atom_core.spec.codegen          # (re)write atom_core/_generated/
    python -m atom_core.spec.codegen --check  # exit 1 and print a diff if it is stale

The translation is mechanical: it walks the `atom_core.spec.lang` expression tree and knows no
names from the model (owners, lanes, caches); the only thing it maps by convention is an index
sort's size, the config constant named by `sort.size`. The generated module's contract:

* Sorts: index sorts are ints 0..N-1, ident sorts are ints, value sorts are `atom_core.seq`
  sequences, enums are ints with constants `<ENUM>_<MEMBER>` and a `<ENUM>_NAMES` tuple.
* `Consts` (one field per model constant) and `State` (`consts`, `ghost`, then one field per
  state function: a tuple per index-sorted argument, a `PMap` for an ident-sorted one, a scalar
  for a 0-ary one). Ghost functions are None, and never updated, when `ghost` is False. An
  ident-keyed function's default is a module constant `_D_<name>` that its reads pass
  (`s.f.get(k, _D_f)`), so that a read works alike on a PMap and on a plain dict.
* The read-only functions (definitions, guards, plans, `enabled_*`, `ready_*`) whose text is
  the same in the in-place core are emitted once, here, annotated `StateView` (State or the
  in-place MState); inplace.py imports them (`InplaceGenerator.shared`).
* `init(consts, ghost=True)`; per action `a`: `a_guard(s, *params)` (name of the first failing
  guard conjunct, or None) and `a(s, *params) -> Step(state, effects, rejected)`. A rejected
  action returns the same state object. Updates and effects are evaluated in the pre-state
  (parallel assignment); later point updates to the same location win.
* Checkers: `check_invariants`, `check_transition`, `check_axioms`, `progress_violations`.

For speed (the core is on the serving hot path) the generator
* binds fields and constants read more than once (or inside a loop) to locals;
* compiles each guard conjunct into statements: conjunctions become consecutive checks,
  implications and conditionals `if`s, a universal quantifier a `for` loop with an early
  return (faster than all(...)); the evaluation order is the expression's;
* computes shared subterms once ("memos"): a subterm with no bound variable, or with one bound
  variable of an index sort (then it is tabulated over the sort), that reads an ident-keyed
  function, contains a quantifier or is not tiny, and occurs twice or sits inside a loop it
  does not depend on. A memo that may raise (sequence ops, `%`) is only taken when every
  occurrence is evaluated unconditionally by its statement, so evaluating it just before the
  statement is invisible; a tabulated one must be total.

The package: `printer` (the pretty printer of the generated code), `analysis` (expression
walking, `Analysis`, the sharing key of subterms), `body` (`Body`: one generated function's
statements and expressions), `base` (`GeneratorBase`: validation, layouts, shared helpers),
`guards` (the read-only functions and guard compilation), `actions` (the pure actions),
`checkers` (the checkers and `describe_state`), `pure` (`Generator`, core.py, built on those),
`indexes` and `writes` (the in-place core's maintained indexes and actions), `inplace`
(`InplaceGenerator`, inplace.py) and `choices` (`ChoicesGenerator`, choices.py); this module
holds the entry points.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from types import ModuleType

from atom_core.spec.codegen.analysis import GenerationError, modifies, reads_param
from atom_core.spec.codegen.base import HEADER
from atom_core.spec.codegen.choices import ChoicesGenerator
from atom_core.spec.codegen.inplace import InplaceGenerator
from atom_core.spec.codegen.pure import Generator
from atom_core.spec.lang import TRUE, Model, show

__all__ = ["ChoicesGenerator", "GenerationError", "Generator", "InplaceGenerator", "check",
           "generate", "load", "load_inplace", "main", "output_dir", "reads_param", "write"]


# --------------------------------------------------------------------------- entry points


def _default_model() -> Model:
    from atom_core.spec.model import MODEL

    return MODEL


def output_dir() -> Path:
    import atom_core

    return Path(atom_core.__file__).resolve().parent / "_generated"


INIT_SOURCE = HEADER + (
    '"""Code generated from the spec model by atom_core.spec.codegen (see core.py)."""\n')


def generate(model: Model | None = None) -> dict[str, str]:
    """File name (inside atom_core/_generated/) -> content, for `model` (default: the spec)."""
    model = model if model is not None else _default_model()
    inplace = InplaceGenerator(model)
    inplace_source = inplace.source()
    return {"__init__.py": INIT_SOURCE, "core.py": Generator(model, inplace.shared).source(),
            "inplace.py": inplace_source, "choices.py": ChoicesGenerator(model).source()}


def action_table(model: Model | None = None) -> str:
    """docs/ACTIONS.md: each action's parameters, guards, what it modifies and its effects."""
    m = model if model is not None else _default_model()
    out = [HEADER.replace("# ", "<!-- ", 1).rstrip("\n") + " -->\n\n# Actions\n\n"
           "Every transition of the spec (`spec/model.py`), in declaration order: its "
           "parameters, its guards (conjuncts, in the order the generated `<action>_guard` "
           "checks them), the state functions it updates (ghost ones apart: proofs and checks "
           "only, never read by a guard) and the runtime effects the adapter performs; an "
           "action that exists only with some feature says where it can fire (`live_when`, "
           "checked both ways by `verify`).\n"]
    for a in m.actions:
        params = ", ".join(f"{p.name}: {p.sort.name}" for p in a.params)
        plain, ghost = modifies(a)
        out.append(f"\n## `{a.name}({params})`\n\n{' '.join((a.doc or '').split())}\n\n")
        if a.live_when is not TRUE:
            out.append(f"- live when: `{show(a.live_when)}`\n")
        out.append("- guards: " + (", ".join(f"`{g}`" for g, _ in a.guards) or "none") + "\n")
        out.append("- modifies: " + (", ".join(f"`{n}`" for n in plain) or "nothing") + "\n")
        if ghost:
            out.append("- ghost: " + ", ".join(f"`{n}`" for n in ghost) + "\n")
        if a.effects:
            out.append("- effects: " + ", ".join(f"`{e.name}`" for e in a.effects) + "\n")
    return "".join(out)


def docs_path() -> Path | None:
    """docs/ACTIONS.md of a source checkout (None in an installed package)."""
    docs = output_dir().parent.parent / "docs"
    return docs / "ACTIONS.md" if docs.is_dir() else None


def check(model: Model | None = None, directory: Path | None = None) -> str:
    """A unified diff between the committed files and a fresh generation ('' when equal)."""
    directory = directory or output_dir()
    diffs: list[str] = []
    files = {directory / name: text for name, text in generate(model).items()}
    if model is None and directory == output_dir() and docs_path() is not None:
        files[docs_path()] = action_table()
    for path, fresh in files.items():
        old = path.read_text() if path.exists() else ""
        if old != fresh:
            diffs.extend(difflib.unified_diff(
                old.splitlines(keepends=True), fresh.splitlines(keepends=True),
                fromfile=f"{path} (committed)", tofile=f"{path} (generated)"))
    return "".join(diffs)


def write(model: Model | None = None, directory: Path | None = None) -> list[Path]:
    """Write the generated files; returns those whose content changed."""
    directory = directory or output_dir()
    directory.mkdir(parents=True, exist_ok=True)
    changed = []
    files = {directory / name: text for name, text in generate(model).items()}
    if model is None and directory == output_dir() and docs_path() is not None:
        files[docs_path()] = action_table()
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


def load(model: Model, name: str = "atom_core._generated.variant") -> ModuleType:
    """Generate the core for `model` (e.g. a mutant) and import it as a fresh module."""
    return _module(name, Generator(model).source())


def load_inplace(model: Model | None = None, name: str = "atom_core._generated.inplace_variant",
                 generator: type[InplaceGenerator] = InplaceGenerator) -> ModuleType:
    """Generate the in-place core for `model` (default: the spec) with `generator` (e.g. a
    deliberately broken emitter, for the differential test's teeth) and import it as a fresh
    module. It imports State, the effects and the read-only functions it shares from the pure
    core generated for the same model (module `<name>_core`, its `_core`), never from the
    committed one: a mutant's guard reaches both."""
    model = model if model is not None else _default_model()
    core_name = f"{name}_core"
    gen = generator(model, core_module=core_name)
    source = gen.source()
    core = _module(core_name, Generator(model, gen.shared).source())
    return _module(name, source, {core_name: core})


def _module(name: str, source: str, imports: dict[str, ModuleType] | None = None) -> ModuleType:
    """`source` run as a fresh module `name` (registered while it runs: attrs and dataclasses
    look their module up; so are the modules in `imports`, for it to import), not left in
    sys.modules."""
    mod = ModuleType(name)
    mod.__file__ = f"<{name}>"
    deps = {**(imports or {}), name: mod}
    sys.modules.update(deps)
    try:
        exec(compile(source, mod.__file__, "exec"), mod.__dict__)
    finally:
        for k in deps:
            sys.modules.pop(k, None)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m atom_core.spec.codegen",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 (printing a diff) if the committed output is stale")
    opts = ap.parse_args(argv)
    if opts.check:
        diff = check()
        if diff:
            sys.stdout.write(diff)
            print("atom_core/_generated is stale: run `make generate`", file=sys.stderr)
            return 1
        return 0
    for path in write():
        print(f"wrote {path}")
    return 0
