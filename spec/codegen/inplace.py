"""`InplaceGenerator`: the in-place variant of the core, `atom_core/_generated/inplace.py`
(documented in the class docstring): the module's assembly, the read-only functions it
shares with core.py, MState, thaw/freeze and init. Its maintained indexes are indexes.py's
(`IndexEmitter`), its actions writes.py's (`WriteEmitter`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

from atom_core.spec import lang
from atom_core.spec.codegen.analysis import GenerationError
from atom_core.spec.codegen.base import HEADER, SEQ_MODULE, py_type
from atom_core.spec.codegen.printer import (
    SOFT,
    SPACE,
    Group,
    IfBreak,
    Nest,
    call_doc,
    dict_doc,
    join,
    render,
    tuple_doc,
)
from atom_core.spec.codegen.pure import Generator
from atom_core.spec.codegen.writes import WriteEmitter
from atom_core.spec.lang import Model

INPLACE_CORE = "atom_core._generated.core"


class InplaceGenerator(WriteEmitter):
    """The in-place transition variant, `atom_core/_generated/inplace.py`.

    Same model, same guards, effects and read-only functions (emitted by the same methods), over
    a mutable `MState`: a list per function of one index sort, a list of lists for two, a plain
    dict for an ident-keyed function (a key whose value is the default is absent, as in a PMap),
    an attribute for a 0-ary one. `thaw`/`freeze` convert from/to the pure `State`. An action
    mutates its argument and returns `Step(s, effects, rejected)` with the same object `s`; a
    rejected one leaves it untouched. Updates stay simultaneous: every new value (and effect) is
    computed from the pre-state first, then written. A whole-function update of the shape
    `ite(c, x, f(v))` (or `f(v) | c`, `f(v) & c`, nested) writes only where `c` holds: straight
    from the loop when its expression is total and reads no function the action updates (except
    `f` at `v` itself), else through a list of changes collected before the first write.
    Maintained indexes (`self.indexes`, slots `_ix<i>`) narrow two kinds of loops to the
    elements that can matter; see indexes.py.

    A read-only function (definition, guard, plan, `enabled_`, `ready_`) whose text would be
    the pure core's, the state parameter's annotation apart, and that reads no name this module
    defines itself is not emitted but imported from `core_module` (the set `shared`, decided in
    `_shared_body`); the others loop over a maintained index or call a function that does.

    The module is typed so that mypyc compiles it as it is (atom_core/native.py): MState
    declares its fields (`mstate_type`), a refusal builds its Step as an acceptance does
    (`reject`), and the enum members and map defaults are Final names of its own; it must
    type-check clean (a wrong declared type is a run-time TypeError in compiled code).
    """

    def __init__(self, model: Model, core_module: str = INPLACE_CORE) -> None:
        super().__init__(model)
        self.state_cls = "MState"
        self.core_module = core_module
        # the axioms read only the constants, never a state: core.py's, re-exported
        self.imported_checkers = frozenset({"AXIOMS"})
        for f in model.state:  # a plain dict's reads need the default as a module constant
            if self.layout(f) == "map" and f.init is not None and f.name not in self.defaults:
                raise GenerationError(f"in-place: the default of {f.name} reads a constant")
        self._pure: dict[str, str] | None = None
        self._texts: dict[str, str] = {}
        # derived from the model's shapes, no spec change (indexes.py)
        self.indexes = self._find_indexes()

    def source(self) -> str:
        """The module; an index no loop ended up using (e.g. its quantifier is a memo) is
        dropped and the module generated again without its upkeep."""
        self.used_ix = set()
        text = self._module()
        if any(k not in self.used_ix for k in self.indexes):
            self.indexes = [k for k in self.indexes if k in self.used_ix]
            text = self._module()
        return text

    def _emit_fn(self, name: str, build: Callable[[], str]) -> str:
        if name in self.shared:
            return ""
        text = self._texts.get(name)
        if text is None:
            text = self._texts[name] = build()
        return text

    def _pure_texts(self) -> dict[str, str]:
        """The pure core's text of each read-only function."""
        if self._pure is None:
            pure = Generator(self.model)
            self._pure = {name: build() for name, build in pure.readonly().items()}
        return self._pure

    def _body(self) -> str:
        return "\n\n".join([self._mstate(), self._init(), self._definitions(), self._actions(),
                             self._checkers(), self._describe()])

    def _shared_body(self) -> str:
        """The module's body without the read-only functions it shares with core.py (set as
        `self.shared`): those whose text would be the pure core's, the state parameter's
        annotation apart, and that read no name this module defines itself (an `enabled_`
        calls its guard: when the guard is this module's own, so is the `enabled_`)."""
        self.shared = frozenset()
        self._texts = {}
        mine = {name: self._emit_fn(name, build) for name, build in self.readonly().items()}
        pure = self._pure_texts()
        same = {name for name, text in mine.items()
                if re.sub(r"\bMState\b", "State", text) == pure[name]}
        self.shared = frozenset(same)
        body = self._body()
        own = _defined(body)
        shared = set(same)
        while True:
            bad = {name for name in shared if (_names_used(pure[name]) - {name}) & own}
            if not bad:
                break
            shared -= bad
            own |= bad
        if shared != same:
            self.shared = frozenset(shared)
            body = self._body()
        return body

    def _module(self) -> str:
        body = self._shared_body()
        used = _names_used(body)
        m = self.model
        core_names = {"Consts", "State", "Step", "EFFECTS", "INDEX_SORTS", "ENUMS",
                      "STATE_FIELDS", "GHOST_FIELDS", "_bad_index", *self.defaults.values()}
        # The enum members and the map defaults are this module's own Final names (the values
        # core.py gives them): a compiled core reads a Final as a C constant, an imported name
        # from the module's dict on every use.
        finals = []
        for s in m.sorts:
            if s.kind == "enum":
                for i, v in enumerate(s.values):
                    if self.enum_const(s, v) in used:
                        finals.append(f"{self.enum_const(s, v)}: Final = {i}\n")
                core_names.add(f"{s.name.upper()}_NAMES")
        for d in sorted(self.defaults.values()):
            if d in used:
                finals.append(f"{d}: Final = _core.{d}\n")
        core_names -= set(self.defaults.values())
        core_names |= {cls for cls, _, _ in self.effects.values()}
        names = sorted(core_names & used, key=_isort_key)
        seq_names = sorted(({o.name for o in m.ops} | {"TokSeq"}) & used, key=_isort_key)
        doc = (f'"""The in-place executable core of the spec model {m.name!r}.\n\n'
               "Generated by atom_core.spec.codegen (InplaceGenerator) from spec/model.py, "
               "beside core.py:\nthe same guards, effects and read-only functions over a "
               "mutable MState; each action\nmutates its state argument and returns "
               "Step(s, effects, rejected) with that same object.\n"
               "A read-only function whose generated text is the same in both cores is "
               "core.py's, imported\n(re-exported) here, as are the axioms (they read no "
               "state); the others read the\nmaintained indexes (or call one that does).\n"
               "`thaw(core.State) -> MState`, `freeze(MState) -> core.State`. core.py stays the "
               "reference\n(proofs, tests); tests/test_inplace.py checks the two agree step by "
               'step.\n"""\n')
        out = [HEADER, "# ruff: noqa: E741\n", doc, "\n"]
        # (Final always: `_new` is one)
        out.append(f"from typing import {'Any, ' if 'Any' in used else ''}Final\n\n")
        if "attrs" in used:
            out.append("import attrs\n\n")
        out.append(f"import {self.core_module} as _core\n")
        # (one statement per re-export, ordered among the others by its first name, as ruff's
        # isort orders them)
        imports = []
        if names:
            imports.append((_isort_key(names[0]), render(
                [f"from {self.core_module} import ",
                 Group([IfBreak("(", ""), Nest(4, [SOFT, *join(names, [",", SPACE])]),
                        IfBreak(",", ""), SOFT, IfBreak(")", "")])]) + "\n"))
        # re-exported (`x as x`): the read-only functions shared with core.py, and the axioms
        axioms = {"AXIOMS", "AXIOM_DOCS", "AXIOM_CONSTS", "check_axioms"} \
            if "AXIOMS" in self.imported_checkers else set()
        for name in self.shared | axioms:
            imports.append((_isort_key(name), render(
                [f"from {self.core_module} import ",
                 Group([IfBreak("(", ""), Nest(4, [SOFT, f"{name} as {name}"]),
                        IfBreak(",", ""), SOFT, IfBreak(")", "")])]) + "\n"))
        out.extend(text for _, text in sorted(imports))
        if "PMap" in used:
            out.append("from atom_core.pmap import PMap\n")
        if seq_names:
            out.append(f"from {SEQ_MODULE} import {', '.join(seq_names)}\n")
        out.append("\n")  # isort: one blank line after imports
        if finals:
            out.append("# The enum members and the map defaults, as core.py's (Final: see "
                       "InplaceGenerator._module).\n")
            out.extend(finals)
            out.append("\n\n")
        out.append(body)
        text = "".join(out)
        text = re.sub(r"\n{4,}", "\n\n\n", text)
        return text.rstrip("\n") + "\n"

    def mstate_type(self, f: lang.StateFn) -> str:
        """The annotation of MState field `f`: lists (of lists) and dicts of core.State's
        element types; Any for an element that may be unset (None)."""
        if f.ghost:
            return "Any"
        lay = self.layout(f)
        ret = py_type(f.ret)
        if self.may_be_unset(f):
            ret = "Any"  # (None where unset: only the guards know when it is read set)
        if lay == "scalar":
            return ret
        if lay == "map":  # (a read of one without a default may be None)
            return f"dict[{py_type(f.args[0])}, {ret}]" if f.name in self.defaults else "Any"
        for _ in f.args:
            ret = f"list[{ret}]"
        return ret

    def _mstate(self) -> str:
        m = self.model
        lines = [self._rule("state")]
        items = [f'"{f.name}": {self.defaults.get(f.name, "None")}' for f in m.state
                 if self.layout(f) == "map"]
        lines.append("# name -> default, per ident-keyed function (absent keys read it; the "
                     "_D_ constants are\n# core.py's)\n")
        lines.append(render(["MAP_DEFAULTS = ", dict_doc(items)]) + "\n\n\n")
        fields = ['"consts"', '"ghost"'] + [f'"{f.name}"' for f in m.state]
        lines.append(render(["_FIELDS = ", tuple_doc(fields)]) + "\n")
        lines.append("# The maintained indexes (MState slots; see InplaceGenerator):\n")
        for i, key in enumerate(self.indexes):
            if key[0] == "sel":
                what = f"{key[3]} value -> the x with {key[1]}(x) == {key[2]} and {key[3]}(x) " \
                    "== it"
            else:
                what = f"{key[1]} value -> the x with {key[1]}(x) == it"
            lines.append(f"#   _ix{i}: {what}\n")
            if key[0] == "val" and self.model_fn(key[1]).ret.kind == "value":
                lines.append("#     (filed by _sig(value), a superset of the matches)\n")
        ix = [f'"_ix{i}"' for i in range(len(self.indexes))]
        lines.append(render(["INDEXES = ", tuple_doc(ix)]) + "\n\n\n")
        lines.append("class MState:\n")
        lines.append('    """One mutable state: the fields of core.State, functions as lists (of '
                     'lists) and\n    dicts. Ghost fields are None when `ghost` is False."""\n\n')
        lines.append("    __slots__ = (*_FIELDS, *INDEXES)\n\n")
        # Declared types: what a compiler of typed Python (mypyc) needs to read a field without
        # a dictionary lookup; ghost fields stay Any (None when ghost is off).
        lines.append("    consts: Consts\n    ghost: bool\n")
        for f in m.state:
            lines.append(f"    {f.name}: {self.mstate_type(f)}\n")
        for i in range(len(self.indexes)):
            lines.append(f"    _ix{i}: dict[Any, set[int]]\n")
        lines.append("\n")
        lines.append("    def __init__(self, *fields: Any) -> None:\n"
                     "        for k, v in zip(_FIELDS, fields, strict=True):\n"
                     "            setattr(self, k, v)\n")
        lines.append("\n\n")
        lines.append(
            "def _select(f: list[Any], e: Any, g: list[Any]) -> dict[Any, set[int]]:\n"
            "    out: dict[Any, set[int]] = {}\n"
            "    for x, fx in enumerate(f):\n"
            "        if fx == e:\n"
            "            out.setdefault(g[x], set()).add(x)\n"
            "    return out\n\n\n"
            "def _by_value(h: list[Any], sig: Any) -> dict[Any, set[int]]:\n"
            "    out: dict[Any, set[int]] = {}\n"
            "    for x, v in enumerate(h):\n"
            "        out.setdefault(v if sig is None else sig(v), set()).add(x)\n"
            "    return out\n\n\n"
            "def _sig(v: Any) -> Any:\n"
            '    """A sequence\'s index key: equal sequences have equal keys. Its last token: '
            'the\n    sequences filed are first chunks, of one length and often one first token '
            '(BOS),\n    and one int is cheaper to build and hash than any combination; '
            'sequences that share\n    a key share a bucket, which only narrows a scan."""\n'
            "    if v is None:\n"
            "        return None\n"
            "    n: int = v.n\n"
            "    return v.buf[n - 1] if n else 0\n\n\n"
            "# An accepted action builds its effects and its Step as `_new(Cls, (fields))`: the\n"
            "# NamedTuple itself, without the Python-level __new__ call a constructor costs.\n"
            "_new: Final = tuple.__new__\n\n\n"
            "def _unindex(ix: dict[Any, set[int]], v: Any, x: int) -> None:\n"
            "    xs = ix[v]\n"
            "    xs.discard(x)\n"
            "    if not xs:\n"
            "        del ix[v]\n\n\n"
            "def _refile(ix: dict[Any, set[int]], old: Any, new: Any, x: int) -> None:\n"
            "    \"\"\"x moves from key `old` to key `new` of value index `ix`.\"\"\"\n"
            "    xs = ix[old]\n"
            "    xs.discard(x)\n"
            "    if not xs:\n"
            "        del ix[old]\n"
            "    ys = ix.get(new)\n"
            "    if ys is None:\n"
            "        ix[new] = {x}\n"
            "    else:\n"
            "        ys.add(x)\n\n\n"
            "def _index(m: MState) -> MState:\n"
            '    """`m` with its indexes (re)built from its fields."""\n')
        for i, key in enumerate(self.indexes):
            lines.append(f"    m._ix{i} = {self._ix_build(key, 'm')}\n")
        lines.append("    return m\n\n\n")
        lines.append(
            "def check_indexes(m: MState) -> list[str]:\n"
            '    """The indexes of `m` that differ from a rebuild (empty sets aside)."""\n'
            "    fresh = _index(MState(*(getattr(m, k) for k in _FIELDS)))\n"
            "    return [k for k in INDEXES\n"
            "            if {v: xs for v, xs in getattr(m, k).items() if xs}\n"
            "            != {v: xs for v, xs in getattr(fresh, k).items() if xs}]\n\n\n")
        thaw, freeze = [], []
        for f in m.state:
            lay = self.layout(f)
            src, ms = f"s.{f.name}", f"m.{f.name}"
            if lay == "scalar":
                t, fr = src, ms
            elif lay == "map":
                t = f"dict({src}.items())"
                d = self.defaults.get(f.name)
                fr = f"PMap({ms}, default={d})" if d else f"PMap({ms})"
            elif len(f.args) == 2:
                t, fr = f"[list(row) for row in {src}]", f"tuple(map(tuple, {ms}))"
            else:
                t, fr = f"list({src})", f"tuple({ms})"
            if f.ghost and lay != "scalar":
                t = f"None if {src} is None else {t}"
                fr = f"None if {ms} is None else {fr}"
            thaw.append(t)
            freeze.append(fr)
        lines.append("def thaw(s: State) -> MState:\n"
                     '    """A mutable copy of `s` (shares no mutable part with it)."""\n')
        lines.append(render(["    return ", call_doc("_index", [call_doc("MState", [
            "s.consts", "s.ghost", *thaw])])], 4))
        lines.append("\n\n\n")
        lines.append("def freeze(m: MState) -> State:\n"
                     '    """The pure State equal to `m` (shares no mutable part with it)."""\n')
        lines.append(render(["    return ", call_doc("State", ["m.consts", "m.ghost", *freeze])],
                            4))
        lines.append("\n")
        return "".join(lines)

    def _init(self) -> str:
        return (self._rule("init")
                + "def init(consts: Consts, ghost: bool = True) -> MState:\n"
                + '    """The initial state for `consts` (ghost fields only when `ghost`)."""\n'
                + "    return thaw(_core.init(consts, ghost))\n")


def _defined(source: str) -> set[str]:
    """The names `source`'s top-level statements define."""
    out: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name))
    return out


def _names_used(source: str) -> set[str]:
    """The names `source` reads as variables (not attributes, strings or comments)."""
    import io
    import tokenize

    out: set[str] = set()
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and not (prev is not None and prev.string == "."):
            out.add(tok.string)
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            prev = tok
    return out


def _isort_key(name: str) -> tuple[Any, ...]:
    """ruff's isort order inside one `from` import: CONSTANTS, Classes, then the rest, each
    case-insensitively in natural order."""
    kind = 0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2
    parts = re.split(r"(\d+)", name.lower())
    return (kind, [int(p) if p.isdigit() else p for p in parts], name)
