"""Bounded model checking: the shortest run from the initial state to a stuck state.

A stuck state violates a progress property (an idle lane and a waiting request that cannot be
admitted even by evicting; or running requests none of which can advance). The search unrolls
the transition relation one step at a time (iterative deepening), so the first trace found is a
shortest one. Token sequences use z3's sequence theory here, so the trace is realizable: the
prompts in it are real token lists.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import attrs
import z3

from atom_core.proofs import limits
from atom_core.proofs.encode import Env, Universe
from atom_core.spec import lang as L


@attrs.frozen
class Step:
    step: int
    action: str
    args: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "action": self.action, "args": self.args}


@attrs.frozen
class Trace:
    steps: tuple[Step, ...]
    violated: str  # the progress property the last state breaks
    final: dict[str, Any]  # a summary of the stuck state
    seconds: float


class Unrolling:
    def __init__(self, model: L.Model, u: Universe) -> None:
        self.model, self.u = model, u
        self.states: list[Env] = [u.init_state("s0")]
        self.choice: list[Any] = []
        self.params: list[dict[str, dict[L.Var, Any]]] = []
        self.facts: list[Any] = list(u.axioms())

    def live_state(self) -> list[L.StateFn]:
        """Ghost state decides no guard (codegen checks this), so it cannot make a state stuck:
        leaving it out of the unrolling keeps the search small."""
        return [f for f in self.model.state if not f.ghost]

    def _points(self, f: L.StateFn) -> list[tuple[Any, ...]]:
        return list(itertools.product(*[self.u.domain[a.name] for a in f.args]))

    def extend(self) -> None:
        u, i = self.u, len(self.states) - 1
        pre = self.states[-1]
        nxt = u.fresh_state(f"s{i + 1}")
        sel = z3.Int(f"act@{i}{u.tag}")
        self.choice.append(sel)
        acts = self.model.actions
        self.facts.append(z3.And(sel >= 0, sel < len(acts)))
        bounds, posts, enabled = {}, [], []
        for k, a in enumerate(acts):
            b = u.params(a, f"{i}")
            bounds[a.name] = b
            enabled.append(z3.Implies(sel == k, u.guard(a, pre, b)))
            posts.append(u.post_state(a, pre, b))
        self.params.append(bounds)
        self.facts.extend(enabled)
        for f in self.live_state():
            for pt in self._points(f):
                val = posts[-1][f.name](*pt)
                for k in range(len(acts) - 2, -1, -1):
                    val = z3.If(sel == k, posts[k][f.name](*pt), val)
                self.facts.append(nxt[f.name](*pt) == val)
        self.states.append(nxt)

    def stuck(self) -> list[tuple[str, Any]]:
        st = self.states[-1]
        return [(p.name, z3.Not(self.u.tr(p.expr, st, {}))) for p in self.model.progress]


def shortest_stuck_trace(model: L.Model, u: Universe, max_depth: int = 30,
                         rlimit: int = limits.BMC,
                         prefer: list[Any] | None = None,
                         hard: list[Any] | None = None) -> Trace | None:
    """The shortest run to a stuck state, or None if there is none within max_depth. `hard`
    constraint builders restrict the runs (e.g. `avoiding(*PD_ACTIONS)`), `prefer` ones pick
    among the shortest."""
    t0 = time.perf_counter()
    un = Unrolling(model, u)
    for depth in range(max_depth + 1):
        if depth:
            un.extend()
        for name, bad in un.stuck():
            s = limits.new_solver(rlimit)
            s.add(*un.facts, *u.seq_facts, *prefer_constraints(un, hard or []), bad)
            r = s.check()
            if r == z3.unknown:
                raise RuntimeError(f"z3 gave up at depth {depth}: "
                                   f"{limits.why_unknown(s, rlimit)}")
            if r == z3.sat:
                model_ = s.model()
                if prefer:  # a nicer trace of the same length, if there is one
                    s.push()
                    s.add(*prefer_constraints(un, prefer))
                    if s.check() == z3.sat:
                        model_ = s.model()
                    s.pop()
                return decode_trace(model, un, model_, name, time.perf_counter() - t0)
    return None


def prefer_constraints(un: Unrolling, prefer: list[Any]) -> list[Any]:
    return [c for p in prefer for c in p(un)]


def same_prompts(un: Unrolling) -> list[Any]:
    """Every submitted prompt is the same one (the seeds' "same prompt twice")."""
    common = z3.Const(f"same_prompt{un.u.tag}", un.u.zsort(_param(un.model, "submit", "p").sort))
    return [bound[_param(un.model, "submit", "p")] == common
            for step in un.params for name, bound in step.items() if name == "submit"]


def avoiding(*names: str):
    """A constraint builder: no step takes one of the named actions (e.g. a colocated run, no
    PD transfers)."""
    def hard(un: Unrolling) -> list[Any]:
        idx = [k for k, a in enumerate(un.model.actions) if a.name in names]
        return [sel != k for sel in un.choice for k in idx]
    return hard


def _param(model: L.Model, action: str, name: str) -> L.Var:
    return next(p for p in model.get_action(action).params if p.name == name)


def _py(u: Universe, sort: L.Sort, v: Any, zm: Any) -> Any:
    if sort.kind == "bool":
        return z3.is_true(v)
    if sort.kind == "int":
        return v.as_long()
    if sort.kind == "value":
        assert u.tokens is not None
        return u.tokens.tokens(v, zm)
    if sort.kind in ("enum", "index", "ident"):
        dom = u.domain[sort.name]
        for i, d in enumerate(dom):
            if z3.eq(d, v):
                return sort.values[i] if sort.kind == "enum" else i
    raise TypeError(sort.name)


def decode_trace(model: L.Model, un: Unrolling, zm: Any, violated: str,
                 seconds: float) -> Trace:
    u = un.u
    steps = []
    for i, sel in enumerate(un.choice):
        a = model.actions[zm.eval(sel, model_completion=True).as_long()]
        args: dict[str, Any] = {}
        for p in a.params:
            zv = un.params[i][a.name][p]
            if p.sort.kind == "fn":
                dom = list(itertools.product(*[u.domain[s.name] for s in p.sort.args]))
                args[p.name] = [_py(u, p.sort.ret, zm.eval(zv(*pt), model_completion=True), zm)
                                for pt in dom]
            else:
                args[p.name] = _py(u, p.sort, zm.eval(zv, model_completion=True), zm)
        steps.append(Step(i + 1, a.name, args))
    final = summarize(model, u, un.states[-1], zm, un.live_state())
    return Trace(tuple(steps), violated, final, seconds)


def summarize(model: L.Model, u: Universe, st: Env, zm: Any,
              fns: list[L.StateFn]) -> dict[str, Any]:
    """The state functions' values in a state, as Python data (for reports and replays)."""
    out: dict[str, Any] = {}
    for f in fns:
        pts = list(itertools.product(*[u.domain[a.name] for a in f.args]))
        vals = [_py(u, f.ret, zm.eval(st[f.name](*pt), model_completion=True), zm) for pt in pts]
        out[f.name] = vals if f.args else vals[0]
    return out
