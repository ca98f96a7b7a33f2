"""`InplaceGenerator`: the in-place variant of the core, `atom_core/_generated/inplace.py`
(documented in the class docstring)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

from atom_core.spec import lang
from atom_core.spec.codegen.analysis import GenerationError, walk
from atom_core.spec.codegen.body import TERN, Body, base_name
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
from atom_core.spec.codegen.pure import HEADER, SEQ_MODULE, Generator, py_type
from atom_core.spec.lang import (
    And,
    App,
    Eq,
    Expr,
    Implies,
    Ite,
    Lit,
    Model,
    Not,
    Or,
    Quant,
    StateFn,
    Var,
)

# --------------------------------------------------------------------------- in-place variant


INPLACE_CORE = "atom_core._generated.core"


class InplaceGenerator(Generator):
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
    elements that can matter; see `__init__`.

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
        # Maintained indexes (derived from the model's shapes, no spec change), in order:
        # ("sel", f, E, g): g-value -> {x | f(x) == E and g(x) == that value}, for whole
        #   updates whose condition has the conjuncts f(v) == E, g(v) == w (w free of v);
        # ("val", h): h-value -> {x | h(x) == that value}, for guards scanning every x for
        #   h(x) == e (e free of x). Each is a slot `_ix<i>` of MState, built by thaw and kept
        #   up to date by every write of the functions it reads.
        self.indexes: list[tuple[Any, ...]] = []
        for a in model.actions:
            for u in a.updates:
                if u.whole and len(u.args) == 1 and type(u.value) is Ite:
                    sel = self._sel_match(u.value.cond, u.args[0])
                    if sel is not None and sel[0] not in self.indexes:
                        self.indexes.append(sel[0])
            for _, g in a.guards:
                for x in walk(g):
                    if type(x) is Quant:
                        val = self._val_match(x, x.kind == "forall")
                        if val is not None and val[0] not in self.indexes:
                            self.indexes.append(val[0])
        for f in model.lookups:  # `where_<f>` reads an index of f
            if self.layout(f) == "tuple" and ("val", f.name) not in self.indexes:
                self.indexes.append(("val", f.name))

    # -- maintained indexes --------------------------------------------------------------
    def _indexable(self, fn: Any, v: Var) -> bool:
        return (isinstance(fn, StateFn) and not fn.ghost and len(fn.args) == 1
                and fn.args[0] is v.sort and self.layout(fn) == "tuple")

    def _at_var(self, e: Expr, v: Var) -> StateFn | None:
        """f when `e` is f(v) (pre-state) for an indexable f."""
        if type(e) is App and not e.post and len(e.args) == 1 and e.args[0] is v \
                and self._indexable(e.fn, v):
            return e.fn
        return None

    def _eqs_at(self, cond: Expr, v: Var) -> list[tuple[StateFn, Expr]]:
        """(f, w) per top-level conjunct f(v) == w of `cond` with w free of v."""
        out = []
        for c in _conjuncts(cond):
            if type(c) is not Eq:
                continue
            for lhs, rhs in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
                f = self._at_var(lhs, v)
                if f is not None and not any(x is v for x in self.an.free(rhs)) \
                        and self.an.total(rhs):
                    out.append((f, rhs))
                    break
        return out

    def _sel_match(self, cond: Expr, v: Var) -> tuple[tuple[Any, ...], Expr] | None:
        eqs = self._eqs_at(cond, v)
        for f, e in eqs:
            if type(e) is not Lit or f.ret.kind != "enum":
                continue
            for g, w in eqs:
                if g is not f and g.ret.kind == "index":
                    return ("sel", f.name, e.value, g.name), w
        return None

    def _val_match(self, q: Quant, pos: bool = True) -> tuple[tuple[Any, ...], Expr] | None:
        """For a quantifier a guard requires to be `pos` whose failing instances all satisfy
        h(x) == e (a conjunct of the failing condition), ("val", h) and e."""
        if q.var.sort.kind != "index":
            return None
        body = q.body
        if q.kind == "exists" and not pos:
            fails = body  # fails where the body holds
        elif q.kind == "forall" and pos and type(body) is Not:
            fails = body.arg
        elif q.kind == "forall" and pos and type(body) is Implies and type(body.concl) is Not:
            fails = And(body.hyp, body.concl.arg)
        else:
            return None
        for h, e in self._eqs_at(fails, q.var):
            if type(e) is not Lit:  # a literal (an enum member) selects too little to pay
                return ("val", h.name), e
        return None

    def _ix_key(self, key: tuple[Any, ...], value: str) -> str:
        """The key a value index files `value` under: the value itself, or for a sequence
        its signature (length, first and last token), so that filing a new sequence never
        hashes all its tokens; equal values have equal keys, so a lookup finds a superset of
        the matches and the loop still checks the whole condition."""
        if key[0] == "val" and self.model_fn(key[1]).ret.kind == "value":
            return f"_sig({value})"
        return value

    def _ix_slot(self, key: tuple[Any, ...]) -> str:
        return f"_ix{self.indexes.index(key)}"

    def _ix_build(self, key: tuple[Any, ...], m: str) -> str:
        """An expression building index `key` from MState `m`."""
        if key[0] == "sel":
            _, f, e, g = key
            enum = self.model_fn(f).ret
            return (f"_select({m}.{f}, {self.enum_const(enum, e)}, {m}.{g})")
        sig = "_sig" if self.model_fn(key[1]).ret.kind == "value" else "None"
        return f"_by_value({m}.{key[1]}, {sig})"

    def model_fn(self, name: str) -> StateFn:
        return next(f for f in self.model.state if f.name == name)

    def _ix_pre_post(self, fname: str, x: str,
                     skip: tuple[Any, ...] | None = None) -> tuple[list[str], list[str]]:
        """Lines around a write of `fname` at `x` keeping the indexes that read it (but
        `skip`, which the caller keeps)."""
        pre: list[str] = []
        post: list[str] = []
        for key in self.indexes:
            if key == skip:
                continue
            slot = f"s.{self._ix_slot(key)}"
            if key[0] == "sel" and fname in (key[1], key[3]):
                _, f, e, g = key
                c = self.enum_const(self.model_fn(f).ret, e)
                pre.append(f"if s.{f}[{x}] == {c}:")
                pre.append(f"    {slot}[s.{g}[{x}]].discard({x})")
                post.append(f"if s.{f}[{x}] == {c}:")
                post.append(f"    {slot}.setdefault(s.{g}[{x}], set()).add({x})")
            elif key[0] == "val" and fname == key[1]:
                # refiled only when the key changes: a write that keeps it (the same
                # first chunk, say) costs two key computations and no set work
                k = self._ix_key(key, f"s.{fname}[{x}]")
                pre.append(f"_ixk = {k}")
                post.append(f"if (_ixn := {k}) != _ixk:")
                post.append(f"    _refile({slot}, _ixk, _ixn, {x})")
        return pre, post

    def _ix_rebuild(self, fname: str) -> list[str]:
        return [f"s.{self._ix_slot(k)} = {self._ix_build(k, 's')}" for k in self.indexes
                if fname in (k[1], k[3] if k[0] == "sel" else None)]

    def _where_fn(self, f: StateFn) -> str:
        """`where_<f>(s, v)` from f's value index: the x filed under v's key, checked."""
        key = ("val", f.name)
        if key not in self.indexes:
            return super()._where_fn(f)
        self.used_ix.add(key)
        # (a miss, the common case, returns before the comprehension; a list comprehension
        # sorted in place is a third cheaper than sorted() over a generator)
        return (self._where_head(f)
                + f"    xs = s.{self._ix_slot(key)}.get({self._ix_key(key, 'v')})\n"
                f"    if not xs:\n"
                f"        return []\n"
                f"    {f.name} = s.{f.name}\n"
                f"    out = [x for x in xs if {f.name}[x] == v]\n"
                f"    out.sort()\n"
                f"    return out\n")

    def _guard_nodes(self, b: Body, g: Expr, pos: bool, env: dict[int, str]) -> list[Any]:
        """A universal quantifier whose body fails only where h(x) == e loops over the x the
        value index of h gives for e (the other x cannot fail it)."""
        if type(g) is Quant and (g.kind == "forall") == pos and id(g) not in b.memo_occ \
                and not self._whole(b, g) and self.an.total(g.body):
            hit = self._val_match(g, pos)
            if hit is not None and hit[0] in self.indexes:
                self.used_ix.add(hit[0])
                name = b.fresh(base_name(g.var), env)
                e = render(b.expr(hit[1], env)[0])
                dom = f"{b.states[False]}.{self._ix_slot(hit[0])}.get(" \
                    f"{self._ix_key(hit[0], e)}, ())"
                inner = dict(env)
                inner[id(g.var)] = name
                b.loop_depth += 1
                body = self._guard_nodes(b, g.body, pos, inner)
                b.loop_depth -= 1
                return [("for", name, dom, body)] if body else []
        return super()._guard_nodes(b, g, pos, env)

    # -- module --------------------------------------------------------------------------
    def source(self) -> str:
        """The module; an index no loop ended up using (e.g. its quantifier is a memo) is
        dropped and the module generated again without its upkeep."""
        self.used_ix: set[tuple[Any, ...]] = set()
        text = self._module()
        if any(k not in self.used_ix for k in self.indexes):
            self.indexes = [k for k in self.indexes if k in self.used_ix]
            text = self._module()
        return text

    # -- functions shared with core.py ---------------------------------------------------
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

    def reject(self, guard: str) -> str:
        # (the Step itself, as an accepted action builds it: MState is not core.State)
        return f'return _new(Step, (s, (), "{guard}"))'

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

    # -- actions -------------------------------------------------------------------------
    def _action_body(self, a: Any, counts: dict[tuple[Any, ...], int] | None) -> Body:
        b, per_fn, fns, plain, ghost = self._action_head(a, counts)
        updated = set(per_fn)
        # compute phase: every new value from the pre-state; writes are deferred (closures)
        direct: dict[bool, list[Callable[[], None]]] = {False: [], True: []}
        writes: dict[bool, list[Callable[[], None]]] = {False: [], True: []}
        for n in plain:
            self._compute(b, fns[n], per_fn[n], updated, direct[False], writes[False])
        effects = []
        for eff in a.effects:
            cls = self.effects[eff.name][0]
            effects.append(call_doc("_new", [cls, tuple_doc(
                [b._at(v, b.env0, TERN) for v in eff.args.values()])]))
        if effects:
            b.stmt(["effects = ", tuple_doc(effects)])
        if ghost:
            n_lines = len(b.lines)
            with b.block("if s.ghost:"):
                for n in ghost:
                    self._compute(b, fns[n], per_fn[n], updated, direct[True], writes[True])
            if len(b.lines) == n_lines + 1:  # only literals or parameters: no block at all
                b.lines.pop()
        # write phase: direct loops first (they read the pre-state of what they read)
        for w in direct[False]:
            w()
        if direct[True] or writes[True]:
            with b.block("if s.ghost:"):
                for w in direct[True] + writes[True]:
                    w()
        for w in writes[False]:
            w()
        b.stmt(f"return _new(Step, (s, {'effects' if effects else '()'}, None))")
        return b

    def _temp(self, b: Body, name: str, e: Expr) -> Any:
        """`e`'s value in the pre-state: a literal or parameter as is, else a local."""
        if type(e) is Lit or (type(e) is Var and id(e) in b.param_ids):
            return b.top(e)[0]
        b.stmt(self._assign(name, b.top(e)))
        return name

    def _chain_of(self, f: StateFn, vs: list[Var], e: Expr) -> list[tuple[Any, Expr | None]] | None:
        """`e` as [(cond, value), ...] ending in f(vs) (first true cond wins, else unchanged);
        a cond is ("pos"|"neg", expr) or ("or"|"nor", [exprs]); value None: True/False."""
        def is_self(x: Expr) -> bool:
            return (type(x) is App and x.fn is f and not x.post and len(x.args) == len(vs)
                    and all(a is v for a, v in zip(x.args, vs, strict=True)))

        out: list[tuple[Any, Any]] = []
        while not is_self(e):
            t = type(e)
            if t is Ite:
                if is_self(e.other) or not is_self(e.then):
                    out.append((("pos", e.cond), e.then))
                    e = e.other
                else:
                    out.append((("neg", e.cond), e.other))
                    e = e.then
            elif t in (Or, And) and sum(1 for x in e.args if is_self(x)) == 1 \
                    and f.ret.kind == "bool":
                rest = [x for x in e.args if not is_self(x)]
                out.append((("or", rest), Lit(True, lang.BOOL)) if t is Or
                           else (("nor", rest), Lit(False, lang.BOOL)))
                return out
            else:
                return None
        return out

    def _cond_doc(self, b: Body, cond: Any, env: dict[int, str]) -> tuple[Any, int]:
        kind, x = cond
        if kind == "pos":
            return b.expr(x, env)
        if kind == "neg":
            return b.neg(x, env)
        if kind == "or":
            return b._chain("or", [b.expr(y, env) for y in x])
        return b._chain("or", [b.neg(y, env) for y in x])

    def _direct_ok(self, f: StateFn, vs: list[Var], e: Expr, updated: set[str]) -> bool:
        if not self.an.total(e):
            return False
        for x in walk(e):
            if type(x) is App and isinstance(x.fn, StateFn) and x.fn.name in updated:
                if not (x.fn is f and not x.post and len(x.args) == len(vs)
                        and all(a is v for a, v in zip(x.args, vs, strict=True))):
                    return False
        return True

    def _compute(self, b: Body, f: StateFn, ups: list[Any], updated: set[str],
                 direct: list[Callable[[], None]], writes: list[Callable[[], None]]) -> None:
        lay = self.layout(f)
        new = f"new_{f.name}"
        if lay == "scalar":
            b.stmt(self._assign(new, b.top(ups[-1].value)))
            writes.append(lambda: [b.stmt(x) for x in [f"s.{f.name} = {new}",
                                                       *self._ix_rebuild(f.name)]])
            return
        whole = ups[0] if ups and ups[0].whole else None
        points = [u for u in ups if not u.whole]
        if lay == "map":
            self._compute_map(b, f, points, writes)
            return
        if whole is not None:
            vs = list(whole.args)
            chain = self._chain_of(f, vs, whole.value)
            if chain is None:  # a fresh list (of lists), replacing the field
                b.stmt([f"{new} = ", self._tabulate(b, whole.value, vs, b.env0, as_list=True)])
                for u in points:
                    idx = [["[", b.top(x)[0], "]"] for x in u.args]
                    b.stmt([new, *idx, " = ", self._breakable(b.top(u.value))])
                writes.append(lambda: [b.stmt(x) for x in [f"s.{f.name} = {new}",
                                                       *self._ix_rebuild(f.name)]])
                return
            if self._direct_ok(f, vs, whole.value, updated):
                direct.append(lambda: self._chain_loop(b, f, vs, chain, None))
            else:
                b.stmt(f"{new}: list[Any] = []")
                self._chain_loop(b, f, vs, chain, new)
                writes.append(lambda: self._apply_changes(b, f, vs, new))
        temps = []
        for i, u in enumerate(points):
            idx = [self._temp(b, f"{new}_i{i}{j}", x) for j, x in enumerate(u.args)]
            val = self._temp(b, f"{new}_v{i}", u.value)
            temps.append((idx, val))
        if temps:
            def write_points() -> None:
                arr = b.field(f, False)
                for idx, val in temps:
                    pre, post = self._ix_pre_post(f.name, idx[0]) if len(idx) == 1 \
                        else ([], [])
                    for x in pre:
                        b.stmt(x) if not x.startswith(" ") else b.line(x)
                    b.stmt([arr, *(["[", x, "]"] for x in idx), " = ", val])
                    for x in post:
                        b.stmt(x) if not x.startswith(" ") else b.line(x)
            writes.append(write_points)

    def _chain_loop(self, b: Body, f: StateFn, vs: list[Var],
                    chain: list[tuple[Any, Expr]], collect: str | None) -> None:
        """for v in range(N): if c1: f[v] = x1 (elif ...); or append (v, x1) to `collect`."""
        env = dict(b.env0)
        names = []
        for v in vs:
            name = b.fresh(base_name(v), env)
            env[id(v)] = name
            names.append(name)
        doms = [f"range({b.size(v.sort)})" for v in vs]
        leaves_out: tuple[Any, ...] | None = None  # the sel index every write leaves
        drop: str | None = None  # how a leaving x is taken out of that index's set
        if len(vs) == 1 and len(chain) == 1 and chain[0][0][0] == "pos":
            sel = self._sel_match(chain[0][0][1], vs[0])
            if sel is not None and sel[0] in self.indexes:  # only the blocks it selects
                self.used_ix.add(sel[0])
                w = render(b.expr(sel[1], b.env0)[0])
                doms = [f"tuple(s.{self._ix_slot(sel[0])}.get({w}, ()))"]
                leaves = _leaves(chain[0][1])
                if f.name == sel[0][1] and all(type(x) is Lit and x.value != sel[0][2]
                                               for x in leaves):
                    # the condition put x in the set, the new value takes it out
                    leaves_out = sel[0]
                    drop = f"s.{self._ix_slot(sel[0])}[{w}].discard"
                    if len(_conjuncts(chain[0][0][1])) == 2:
                        # the condition is the selection itself: every x in the set meets
                        # it and leaves, so the set goes whole
                        doms = [f"s.{self._ix_slot(sel[0])}.pop({w}, ())"]
                        drop = None
        b.loop_depth += 1
        arms = [(self._cond_doc(b, c, env), b._at(x, env, TERN))
                for c, x in chain]
        arr = b.field(f, False) if collect is None else None
        b.loop_depth -= 1
        b.flush()  # prerequisites before the loop, never inside it
        for name, dom in zip(names, doms, strict=True):
            b.line(f"for {name} in {dom}:")
            b.indent += 4
        target = [arr, *(f"[{n}]" for n in names)] if collect is None else None
        pre, post = self._ix_pre_post(f.name, names[0], skip=leaves_out) if len(vs) == 1 \
            else ([], [])
        if leaves_out is not None and drop is not None:
            pre = [f"{drop}({names[0]})", *pre]
        for i, (cond, val) in enumerate(arms):
            b.line([("if " if i == 0 else "elif "), self._breakable(cond), ":"])
            b.indent += 4
            if collect is None:
                for x in pre:
                    b.line(x)
                b.line([*target, " = ", val])
                for x in post:
                    b.line(x)
            else:
                key = names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"
                b.line([f"{collect}.append(({key}, ", val, "))"])
            b.indent -= 4
        b.indent -= 4 * len(names)

    def _apply_changes(self, b: Body, f: StateFn, vs: list[Var], new: str) -> None:
        arr = b.field(f, False)
        b.flush()
        if len(vs) == 1:
            pre, post = self._ix_pre_post(f.name, "_k")
            b.line(f"for _k, _v in {new}:")
            for x in [*pre, f"{arr}[_k] = _v", *post]:
                b.line(f"    {x}")
        else:
            b.line(f"for (_k, _j), _v in {new}:")
            b.line(f"    {arr}[_k][_j] = _v")

    def _compute_map(self, b: Body, f: StateFn, points: list[Any],
                     writes: list[Callable[[], None]]) -> None:
        new = f"new_{f.name}"
        dflt = self.defaults.get(f.name)
        init = self._init_value(f)[0]
        temps = []
        for i, u in enumerate(points):
            k = self._temp(b, f"{new}_k{i}", u.args[0])
            v = self._temp(b, f"{new}_v{i}", u.value)
            if type(u.value) is Lit and type(init) is Lit:
                how = "pop" if u.value.value == init.value else "set"
            elif type(u.value) is Lit and init is None:
                how = "pop" if u.value.value is None else "set"
            elif type(u.value) is Var and id(u.value) in b.param_ids \
                    and u.value.sort.kind == "index" and init is None:
                how = "set"  # an index parameter is range-checked: never None
            else:
                how = "test"
            temps.append((k, v, how))

        def write() -> None:
            d = b.field(f, False)
            for k, v, how in temps:
                if how == "set":
                    b.stmt([d, "[", k, "] = ", v])
                elif how == "pop":
                    b.stmt([d, ".pop(", k, ", None)"])
                else:
                    test = f"{v} is None" if dflt is None else f"{v} == {dflt}"
                    b.stmt(f"if {test}:")
                    b.indent += 4
                    b.line([d, ".pop(", k, ", None)"])
                    b.indent -= 4
                    b.line("else:")
                    b.indent += 4
                    b.line([d, "[", k, "] = ", v])
                    b.indent -= 4
        writes.append(write)


def _leaves(e: Expr) -> list[Expr]:
    """The values a (nested) conditional may take."""
    if type(e) is Ite:
        return _leaves(e.then) + _leaves(e.other)
    return [e]


def _conjuncts(e: Expr) -> list[Expr]:
    if type(e) is And:
        return [c for x in e.args for c in _conjuncts(x)]
    return [e]


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
