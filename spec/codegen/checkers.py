"""`CheckerEmitter`: the checkers of the core (invariants, transition invariants, axioms,
progress), the ident sorts' quantifier domains, and `describe_state` for debugging."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from atom_core.spec import lang
from atom_core.spec.codegen.analysis import GenerationError, reads_ghost, walk
from atom_core.spec.codegen.base import GeneratorBase
from atom_core.spec.codegen.body import Body
from atom_core.spec.codegen.printer import (
    SOFT,
    SPACE,
    WIDTH,
    Group,
    IfBreak,
    Nest,
    bracket,
    chunks,
    dict_doc,
    join,
    render,
    tuple_doc,
)
from atom_core.spec.lang import App, Expr, Sort, StateFn


def _consts_read(e: Expr) -> list[str]:
    """The configuration constants `e` reads, in order of first appearance."""
    return list(dict.fromkeys(x.name for x in walk(e) if type(x) is lang.Const))


class CheckerEmitter(GeneratorBase):
    """Emits the checkers and debugging sections (the in-place core imports the axioms'
    from core.py: `imported_checkers`)."""

    def _checkers(self) -> str:
        m = self.model
        st = self.state_cls
        parts = [self._rule("checkers")]
        for s in m.sorts:
            if s.kind == "ident":
                parts.append(self._ids_fn(s))
                parts.append("\n\n")
        invs = [n for n in m.invariants if n.kind == "relational"] + \
            [n for n in m.invariants if n.kind != "relational"]
        specs = [
            ("INVARIANTS", invs, "check_invariants", f"s: {st}",
             "The names of the invariants `s` violates (ghost ones only when `s.ghost`).",
             {False: "s"}, "s.consts", "checker"),
            ("TRANSITION_INVARIANTS", m.transition_invariants, "check_transition",
             f"pre: {st}, post: {st}",
             "The names of the transition invariants the step `pre` -> `post` violates.",
             {False: "pre", True: "post"}, "pre.consts", "checker post"),
            ("AXIOMS", m.axioms, "check_axioms", "c: Consts",
             "The names of the config axioms `c` violates.", {}, "c", "axiom"),
            ("PROGRESS", m.progress, "progress_violations", f"s: {st}",
             "The names of the progress properties that fail in `s`.", {False: "s"},
             "s.consts", "checker progress"),
        ]
        for const, named, fn, sig, doc, states, consts, mode in specs:
            if const in self.imported_checkers:
                continue
            parts.append(render([f"{const} = ", tuple_doc([f'"{n.name}"' for n in named])]))
            if const == "INVARIANTS":
                parts.append("\n# The invariants that are the point (`m.safety`); the rest help "
                             "prove them.\n")
                parts.append(render(["SAFETY = ", tuple_doc(
                    [f'"{n}"' for n in m.safety_properties])]) + "\n")
            if const == "AXIOMS":  # what to do about a violated one, for config errors
                parts.append("\n# What each axiom asks of a configuration, in its words.\n")
                parts.append(render(["AXIOM_DOCS = ", dict_doc(
                    [[json.dumps(n.name), ": ", bracket("(", join(
                        [json.dumps(c) for c in chunks(n.doc)], [SPACE]), ")")]
                     for n in named if n.doc])]) + "\n")
                parts.append("\n# The constants each axiom reads, in order: a config error "
                             "names the settings behind\n# them (Config.CONST_FIELDS) with "
                             "their values.\n")
                parts.append(render(["AXIOM_CONSTS = ", dict_doc(
                    [[json.dumps(n.name), ": ", tuple_doc(
                        [json.dumps(c) for c in _consts_read(n.expr)])]
                     for n in named if _consts_read(n.expr)])]) + "\n")
            parts.append(f"\n\n\ndef {fn}({sig}) -> list[str]:\n")
            parts.append(self._docstring(doc))
            parts.append(self._two_pass(
                lambda counts, named=named, states=states, consts=consts, mode=mode:
                self._checker_body(named, states, consts, mode, counts)))
            parts.append("\n\n")
        return "".join(parts)

    def _checker_body(self, named: list[Any], states: dict[bool, str], consts: str, mode: str,
                      counts: dict[tuple[Any, ...], int] | None) -> Body:
        names = " ".join(["bad", consts.split(".")[0], *states.values()])
        b = Body(self, params=[], consts=consts, states=states, mode=mode, counts=counts,
                 local_names=names)
        plain = [(n.expr, ()) for n in named if not reads_ghost(n.expr)]
        ghost = [(n.expr, ()) for n in named if reads_ghost(n.expr)]
        b.select_memos(plain, ghost)
        if mode == "axiom":
            for n in named:
                for x in walk(n.expr):
                    if type(x) is App and isinstance(x.fn, StateFn):
                        raise GenerationError(f"axiom {n.name} reads state ({x.fn.name})")
        b.stmt("bad = []")
        cond = " and ".join(f"{st}.ghost" for _, st in sorted(states.items()))
        i = 0
        while i < len(named):
            if not reads_ghost(named[i].expr):
                self._check_stmt(b, named[i])
                i += 1
                continue
            with b.block(f"if {cond}:"):
                while i < len(named) and reads_ghost(named[i].expr):
                    self._check_stmt(b, named[i])
                    i += 1
        b.stmt("return bad")
        return b

    def _check_stmt(self, b: Body, n: Any) -> None:
        b.stmt(self._if(b.neg(n.expr, b.env0)), comment=n.name)
        b.indent += 4
        b.line(f'bad.append("{n.name}")')
        b.indent -= 4

    def _ids_fn(self, sort: Sort) -> str:
        name = f"_{sort.name.lower()}_ids"
        lines = [
            f"def {name}(*states: {self.state_cls}) -> list[int]:\n",
            f'    """The {sort.name} values a quantifier over {sort.name} visits: every key and\n'
            f"    value of type {sort.name} in the states' fields, plus one fresh {sort.name} "
            '(all its fields\n    at their defaults), which stands for all the others."""\n',
            "    ids: set[Any] = set()\n",
            "    for s in states:\n",
        ]
        body: list[str] = []
        for f in self.model.state:
            lay = self.layout(f)
            stmts: list[str] = []
            if lay == "map" and f.args[0] is sort:
                stmts.append(f"ids.update(s.{f.name}.keys())")
            if f.ret is sort:
                if lay == "map":
                    stmts.append(f"ids.update(v for _, v in s.{f.name}.items())")
                elif lay == "scalar":
                    stmts.append(f"ids.add(s.{f.name})")
                elif len(f.args) == 2:
                    stmts.append(f"ids.update(x for row in s.{f.name} for x in row)")
                else:
                    stmts.append(f"ids.update(s.{f.name})")
            if f.ghost and stmts:
                body.append("        if s.ghost:\n")
                body.extend(f"            {x}\n" for x in stmts)
            else:
                body.extend(f"        {x}\n" for x in stmts)
        lines += body or ["        pass\n"]
        lines += ["    ids.discard(None)\n",
                  "    ids.add(max(ids, default=-1) + 1)\n",
                  "    return sorted(ids)\n"]
        return "".join(lines)

    def _describe(self) -> str:
        lines = [
            self._rule("debugging"),
            "def _tokens(x: Any) -> list[int] | None:\n",
            "    return None if x is None else list(x)\n\n\n",
            "def _name(names: tuple[str, ...], x: Any) -> str | None:\n",
            "    return None if x is None else names[x]\n\n\n",
            f"def describe_state(s: {self.state_cls}) -> dict[str, Any]:\n",
            '    """A JSON-able view of `s`: enums by member name, sequences as token lists."""\n',
            "    out: dict[str, Any] = {\"consts\": attrs.asdict(s.consts), \"ghost\": s.ghost}\n",
        ]
        for f in self.model.state:
            conv = self._conv(f.ret)
            lay = self.layout(f)
            src = f"s.{f.name}"
            if lay == "scalar":
                val = conv(src)
            elif lay == "map":
                val = f"{{k: {conv('v')} for k, v in sorted({src}.items())}}" \
                    if conv("v") != "v" else f"dict(sorted({src}.items()))"
            elif len(f.args) == 2:
                val = f"[[{conv('x')} for x in row] for row in {src}]" if conv("x") != "x" \
                    else f"[list(row) for row in {src}]"
            else:
                val = f"[{conv('x')} for x in {src}]" if conv("x") != "x" else f"list({src})"
            if f.ghost and lay != "scalar":
                val = f"None if {src} is None else {val}"
            doc = render([f'    out["{f.name}"] = ', val], 4)
            if len(doc) > WIDTH:
                doc = render([f'    out["{f.name}"] = ',
                              Group([IfBreak("(", ""), Nest(4, [SOFT, val]), SOFT,
                                     IfBreak(")", "")])], 4)
                if len(doc.splitlines()[0]) > WIDTH:
                    raise GenerationError(f"describe_state: line too long for {f.name}")
            lines.append(doc + "\n")
        lines.append("    return out\n")
        return "".join(lines)

    def _conv(self, sort: Sort) -> Callable[[str], str]:
        if sort.kind == "enum":
            return lambda x: f"_name({sort.name.upper()}_NAMES, {x})"
        if sort.kind == "value":
            return lambda x: f"_tokens({x})"
        return lambda x: x
