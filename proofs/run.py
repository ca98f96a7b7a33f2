"""Every proof `atom-core verify` runs, as one report.

The obligations are independent tasks (`plan`): relational base, step and transition
obligations per action, arithmetic invariants per block size, bounded invariants per size,
progress per size (every feature combination), a replay per committed witness, the
single-block cases. They run over a process pool (`jobs`), each task in a fresh z3 context, and
the report lists their checks in plan order, whatever the number of jobs and whichever task
finishes first. Tight capacity rows are
certified by replaying the committed witnesses (proofs/witness.py); only a witness that does
not replay is searched for again, and `witnesses-current` then fails.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

import attrs
import z3

from atom_core.proofs import (
    capacity,
    checks,
    counting,
    encode,
    limits,
    nonvacuity,
    search,
    witness,
)
from atom_core.proofs.bmc import Trace
from atom_core.proofs.checks import Check
from atom_core.proofs.witness import Witness
from atom_core.spec import lang as L

MAX_LANES, MAX_BLOCKS = 4, 8  # the cutoff for bounded invariants and capacity
DEEP_LANES, DEEP_BLOCKS = 5, 10  # `verify --deep`
MODEL_REF = "atom_core.spec.model:MODEL"
# kinds of tasks, for the CPU seconds spent on each
KINDS = ("nonvacuity", "relational", "arithmetic", "bounded", "capacity", "capacity-tight",
         "capacity-tight-search", "capacity-single-block", "counting")


@attrs.frozen
class Report:
    ok: bool
    seconds: float  # wall
    checks: list[Check]
    rows: list[capacity.Row]
    single_block: list[tuple[capacity.SingleBlockCase, Any]] = attrs.field(factory=list)
    jobs: int = 1
    cpu: dict[str, float] = attrs.field(factory=dict)  # CPU seconds by kind of task
    tasks: dict[str, int] = attrs.field(factory=dict)  # tasks by kind
    stale: list[str] = attrs.field(factory=list)  # witnesses that did not replay
    found: dict[str, dict[Any, Witness]] = attrs.field(factory=dict)  # searched this run

    def rlimits(self) -> dict[str, tuple[int, int, int]]:
        """Per kind of check: (queries, the most z3 resource units one used, the budget of a
        query of that kind), so the margin to the budget is visible."""
        out: dict[str, tuple[int, int, int]] = {}
        for c in self.checks:
            kind = limits.kind_of(c.kind, c.size)
            if kind not in limits.BUDGETS or not c.rlimit:  # (a replay, a rule: no query)
                continue
            n, most, budget = out.get(kind, (0, 0, limits.BUDGETS[kind]))
            out[kind] = (n + 1, max(most, c.rlimit), budget)
        return out

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "seconds": round(self.seconds, 3), "jobs": self.jobs,
                "rlimit_by_kind": {k: {"queries": n, "largest": used, "budget": budget}
                                   for k, (n, used, budget) in self.rlimits().items()},
                "cpu_seconds_by_kind": {k: round(v, 3) for k, v in self.cpu.items()},
                "tasks_by_kind": dict(self.tasks),
                "stale_witnesses": list(self.stale),
                "checks": [c.as_json() for c in self.checks],
                "capacity": [row_json(r) for r in self.rows],
                "single_block": [
                    {"case": c.name, "lanes": c.lanes, "prefix_cache": c.prefix_cache,
                     "role": c.role, "stuck": tr is not None,
                     **({"violated": tr.violated, "trace": [s.as_json() for s in tr.steps],
                         "stuck_state": tr.final} if tr else {})}
                    for c, tr in self.single_block]}


def table_matches(rows: list[capacity.Row]) -> Check:
    """The committed capacity table (which Config validates against) is the proved one, and
    its rule gives every row's minimum (hybrid, host tier, T = 2 included)."""
    from atom_core._generated import capacity as committed

    found, wrong = capacity.fit(rows)
    pfound, pwrong = capacity.fit_preempt(rows)
    wrong += pwrong
    want = {k: (committed.SCRATCH_BLOCKS[k], committed.COPY_BLOCKS[k])
            for k in committed.SCRATCH_BLOCKS}
    pwant = {k: tuple(v) for k, v in getattr(committed, "PREEMPT_BLOCKS", {}).items()}
    # (a one-lane cutoff leaves the preemption rule's second term open: None matches any)
    pok = pfound.keys() == pwant.keys() and all(
        x is None or x == y for k in pfound for x, y in zip(pfound[k], pwant[k], strict=True))
    ok = found == want and pok and not wrong
    detail = "" if ok else ("; ".join(wrong) if wrong else
                            f"committed {want}, {pwant} != proved {found}, {pfound}: run "
                            "`make generate`")
    return Check("capacity-table-matches-proofs", "*", "capacity", "proved" if ok else
                 "counterexample", 0.0, detail=detail)


def row_json(r: capacity.Row) -> dict[str, Any]:
    return {"prefix_cache": r.features.prefix_cache, "scratch": r.features.scratch,
            "hybrid": r.features.hybrid, "host_cache": r.features.host,
            "blocks_per_table": r.features.tables, "preemption": r.features.preempt,
            "offset": r.offset,
            "min_kv_blocks": {str(b): k for b, k in r.minimum.items()},
            "tight": {str(b): (t is not None) for b, t in r.traces.items()}}


# --------------------------------------------------------------------------- tasks
# Each task is a module-level function of the model and plain arguments, so that a worker
# process runs it from its name; it returns plain data (checks, traces, witnesses).

def t_relational(model: L.Model, part: str, action: str) -> list[Check]:
    if part == "base":
        return list(checks.relational(model, steps=(), transition=()))
    if part == "step":
        return list(checks.relational(model, base=False, steps=(action,), transition=()))
    return list(checks.relational(model, base=False, steps=(), transition=(action,)))


def t_nonvacuity(model: L.Model, features: tuple[capacity.Features, ...],
                 chunk: int = checks.CHUNK, seq_len: int = checks.SEQ_LEN) -> list[Check]:
    return nonvacuity.check(model, features, chunk, seq_len)


# Non-vacuity tasks per chunk and block size: each translates its universe once for the
# combinations it checks.
NONVACUITY_TASKS = 2


def nonvacuity_settings() -> list[tuple[int, int, tuple[capacity.Features, ...]]]:
    """(chunk, block size, combinations) of every hypothesis set an obligation assumes: the
    artifact's sizes (relational, arithmetic, bounded), the capacity table's (capacity.TABLE_*:
    progress and arithmetic are proved there too), and the unaligned eager block's."""
    eager = tuple(f for f in capacity.COMBINATIONS if f.tables == 1)
    return [(checks.CHUNK, checks.SEQ_LEN, capacity.COMBINATIONS),
            (capacity.TABLE_CHUNK, capacity.TABLE_SEQ_LEN, capacity.COMBINATIONS),
            (checks.CHUNK, checks.UNALIGNED_SEQ_LEN, eager)]


def _nonvacuity_tasks() -> list[Task]:
    out = []
    for chunk, seq_len, fs in nonvacuity_settings():
        per = -(-len(fs) // NONVACUITY_TASKS)  # (in order, so the report lists them in order)
        out += [Task("nonvacuity", t_nonvacuity, (fs[i:i + per], chunk, seq_len), per)
                for i in range(0, len(fs), per)]
    return out


def t_arithmetic(model: L.Model, seq_len: int = checks.SEQ_LEN,
                 chunk: int = checks.CHUNK) -> list[Check]:
    return list(checks.arithmetic(model, seq_len, chunk=chunk))


def t_bounded(model: L.Model, lanes: int, blocks: int, seq_len: int | None = None,
              chunk: int | None = None) -> list[Check]:
    """The bounded invariants at one size; for every chunk and block size the axioms allow
    when `seq_len` and `chunk` are None (as `verify` runs them: see its bounded tasks)."""
    bnd = [i for i in model.invariants if i.kind == "bounded"]
    fixed = {} if seq_len is None or chunk is None else {"C": chunk, "S": seq_len}
    u = checks.bounded_universe(model, lanes, blocks, fixed)
    return list(checks.induction(model, bnd, u, model.invariants,
                                 size=checks.bounded_label(lanes, blocks, seq_len, chunk),
                                 rlimit=checks.BOUNDED_RLIMIT))


def t_progress(model: L.Model, lanes: int, blocks: int, cutoff: int,
               seq_len: int = checks.SEQ_LEN, chunk: int = checks.CHUNK,
               only: tuple[capacity.Features, ...] | None = None
               ) -> dict[capacity.Features, list[Check]]:
    return capacity.progress_by_features(model, lanes, blocks, cutoff, seq_len, chunk, only)


def unaligned_rule(f: capacity.Features, aligned: capacity.Row, unaligned: capacity.Row,
                   max_blocks: int = checks.UNALIGNED_BLOCKS) -> Check:
    """An eager block that is not a multiple of the chunk needs the blocks an aligned one does
    (the capacity rule does not depend on the padded last chunk), within the smaller cutoff."""
    def within(k: int | None) -> int | None:
        return k if k is not None and k <= max_blocks else None
    want = {b: within(aligned.minimum.get(b)) for b in unaligned.minimum}
    ok = want == unaligned.minimum
    return Check(f"unaligned-rule:{f.rule_name}", "*", "capacity",
                 "proved" if ok else "counterexample", 0.0,
                 f"{f.name},S={checks.UNALIGNED_SEQ_LEN}",
                 "" if ok else f"K_min {unaligned.minimum} at S={checks.UNALIGNED_SEQ_LEN}, "
                               f"{want} at S={checks.SEQ_LEN}")


def t_replay_tight(model: L.Model, f: capacity.Features, lanes: int,
                   w: Witness) -> Trace | str:
    return witness.replay(model, w, capacity.expect(f, lanes, w.consts.get("K")))


def t_search_tight(model: L.Model, f: capacity.Features, lanes: int,
                   blocks: int) -> tuple[Trace | None, Witness | None]:
    w = capacity.find_witness(f, lanes, blocks)
    if w is None:
        return None, None
    tr = witness.replay(model, w, capacity.expect(f, lanes, blocks))
    if isinstance(tr, str):
        raise RuntimeError(f"the stuck run for {f.name}, B={lanes}, K={blocks} does not "
                           f"replay: {tr}")
    return tr, w


def t_single(model: L.Model, case: capacity.SingleBlockCase,
             w: Witness | None) -> tuple[Trace | str | None, Witness | None]:
    """With a witness: its replay. Without: the search (for a case without a stuck run, the
    breadth-first search over every reachable state is the proof)."""
    if w is not None:
        return case.replay(model, w), w
    try:
        found = case.find_witness()
    except search.SearchCutOff as e:  # not a "safe" verdict (`single_check` fails it)
        return f"{CUT_OFF}: {e}", None
    if found is None:
        return None, None
    tr = case.replay(model, found)
    if isinstance(tr, str):
        raise RuntimeError(f"the stuck run of {case.name} does not replay: {tr}")
    return tr, found


CUT_OFF = "search cut off"


def single_check(case: capacity.SingleBlockCase, tr: Trace | str | None, how: str) -> Check:
    """The check of a single-block case from `t_single`'s result. A search the depth cap cut
    off is no verdict: it fails whatever the case expects."""
    if isinstance(tr, str) and tr.startswith(CUT_OFF):
        return attrs.evolve(case.result(None, 0.0), status="counterexample", detail=tr)
    trace = tr if isinstance(tr, Trace) else None
    return case.result(trace, trace.seconds if trace else 0.0, how)


COMPLETE = "obligations-complete"
ASSUMED = "invariants-proved-where-assumed"


def _at(task: Task) -> tuple[int, int, int | None, int | None]:
    """(lanes, blocks, seq_len, chunk) of a bounded or progress task, their defaults filled:
    None for a bounded task over every chunk and block size."""
    lanes, blocks, *rest = task.args
    default: int | None = None
    if task.kind == "capacity":  # (t_progress: lanes, blocks, cutoff, seq_len, chunk, only)
        rest, default = rest[1:], checks.SEQ_LEN
    seq_len = rest[0] if len(rest) > 0 else default
    chunk = rest[1] if len(rest) > 1 else (checks.CHUNK if default else None)
    return lanes, blocks, seq_len, chunk


def _arith_at(task: Task) -> tuple[int, int]:
    """(seq_len, chunk) of an arithmetic task."""
    seq_len = task.args[0] if len(task.args) > 0 else checks.SEQ_LEN
    chunk = task.args[1] if len(task.args) > 1 else checks.CHUNK
    return seq_len, chunk


def assumed_where_proved(progress_tasks: list[Task], tasks: list[Task]) -> Check:
    """Every progress query assumes every invariant: the bounded ones must be proved in this
    run at the same size, chunk and block size, the arithmetic ones at the same chunk and block
    size (their own checks say whether they were). A progress proof over invariants proved
    elsewhere (another chunk, another block size) assumes what nothing showed."""
    bounded = {_at(t) for t in tasks if t.kind == "bounded"}
    arith = {_arith_at(t) for t in tasks if t.kind == "arithmetic"}
    gaps = []
    for t in progress_tasks:
        b, k, seq_len, chunk = _at(t)
        if not bounded & {(b, k, seq_len, chunk), (b, k, None, None)}:
            gaps.append(f"bounded invariants at B={b},K={k},C={chunk},S={seq_len}")
        if (seq_len, chunk) not in arith:
            gaps.append(f"arithmetic invariants at C={chunk},S={seq_len}")
    gaps = sorted(set(gaps))
    return Check(ASSUMED, "*", "capacity", "counterexample" if gaps else "proved", 0.0,
                 detail=(f"progress assumes, unproved in this run: {'; '.join(gaps[:8])}"
                         + (f" (and {len(gaps) - 8} more)" if len(gaps) > 8 else ""))
                 if gaps else "")


Key = tuple[str, str, str, str]  # (invariant, action, kind, size)


def expected_obligations(model: L.Model, task: Task) -> list[Key] | None:
    """The checks a task must report, computed from the model and the task's arguments alone
    (not from what ran), or None for a task whose checks `verify` builds itself (replays,
    searches). A check missing from a task's result is an obligation nobody decided."""
    rel = [i.name for i in model.invariants if i.kind == "relational"]
    acts = [a.name for a in model.actions]

    def induction(invs: list[str], size: str) -> list[Key]:
        return ([(i, "init", "base", size) for i in invs]
                + [(i, a, "step", size) for a in acts for i in invs])

    if task.kind == "relational":
        part, action = task.args
        if part == "base":
            return [(i, "init", "base", "") for i in rel]
        if part == "step":
            return [(i, action, "step", "") for i in rel]
        return [(t.name, action, "transition", "") for t in model.transition_invariants]
    if task.kind == "arithmetic":
        seq_len, chunk = _arith_at(task)
        return induction([i.name for i in model.invariants if i.kind == "arithmetic"],
                         checks.arithmetic_label(chunk, seq_len))
    if task.kind == "bounded":
        size = checks.bounded_label(*_at(task))
        return ([(checks.INHABITED, "*", checks.NONVACUITY, size)]
                + induction([i.name for i in model.invariants if i.kind == "bounded"], size))
    if task.kind == "nonvacuity":
        features, chunk, seq_len = task.args
        props = [p.name for p in model.progress if nonvacuity.antecedent(p) is not None]
        return [k for f in features for at in [nonvacuity.label(f, chunk, seq_len)] for k in
                [(nonvacuity.CONSISTENT, "*", nonvacuity.KIND, at)]
                + [(nonvacuity.GUARD, a, nonvacuity.KIND, at) for a in acts]
                + [(nonvacuity.ANTECEDENT, p, nonvacuity.KIND, at) for p in props]]
    if task.kind == "counting":
        return counting.expected(model, task.fn, task.args)
    return None


def incomplete_result(model: L.Model, task: Task, result: Any) -> list[str]:
    """What a task's result lacks (or has twice) of the obligations it was given."""
    if task.kind == "capacity" and isinstance(result, dict):  # (t_progress, per combination)
        lanes, blocks, seq_len, chunk = _at(task)
        cutoff = task.args[2]
        only = task.args[5] if len(task.args) > 5 else None
        want_f = [f for f in only or capacity.COMBINATIONS
                  if lanes <= f.max_lanes(cutoff) and (seq_len % chunk == 0 or f.tables == 1)]
        props = sorted([checks.INHABITED] + [p.name for p in model.progress])
        where = f"B={lanes},K={blocks},C={chunk},S={seq_len}"
        out = [f"progress of {f.name} at {where}" for f in want_f if f not in result]
        out += [f"progress of {f.name} at {where}: {sorted(c.invariant for c in cs)}"
                for f, cs in result.items() if sorted(c.invariant for c in cs) != props]
        return out
    want = expected_obligations(model, task)
    if want is None:
        return []
    got = Counter((c.invariant, c.action, c.kind, c.size) for c in result)
    missing = Counter(want) - got
    extra = got - Counter(want)
    return ([f"{task.describe()}: missing {k}" for k in missing]
            + [f"{task.describe()}: unexpected or repeated {k}" for k in extra])


@attrs.frozen
class Task:
    kind: str  # what `Report.cpu` sums it under
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    weight: float = 1.0  # a guess of its cost: heavier tasks start first

    def describe(self) -> str:
        """The task for a message: its function and its plain arguments."""
        args = ", ".join(repr(a) if isinstance(a, (int, str)) else
                         getattr(a, "name", type(a).__name__) for a in self.args)
        return f"{self.kind} task {getattr(self.fn, '__name__', self.fn)}({args})"


class TaskFailed(RuntimeError):
    """A task raised, or its worker process died: its obligations were not decided, so the
    run cannot report on them (never read as proved)."""


def _result(task: Task, get: Callable[[], Any]) -> Any:
    """`get()`, the task's (result, cpu, ...), or `TaskFailed` naming the task."""
    try:
        return get()
    except Exception as exc:  # (BrokenProcessPool when a worker died)
        raise TaskFailed(f"{task.describe()} failed: {exc!r}") from exc


_MODEL: Any = None


def _init_worker(ref: Any) -> None:
    global _MODEL
    if isinstance(ref, str):
        mod, _, attr = ref.partition(":")
        _MODEL = getattr(importlib.import_module(mod), attr)
    else:
        _MODEL = ref


def _run(task: Task) -> tuple[Any, float, float]:
    """(result, CPU seconds, wall seconds). z3's search depends on every declaration its context
    has seen: a query that proves in 0.3 s in a fresh process can time out after unrelated
    queries in the same process (see tests/test_proofs.py), so each task starts afresh."""
    z3.z3._main_ctx = None
    encode.reset_names()
    c0, w0 = time.process_time(), time.perf_counter()
    out = task.fn(_MODEL, *task.args)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    z3.z3._main_ctx = None
    return out, cpu, wall


class Runner:
    """Runs tasks in this process (jobs = 1) or over a process pool; `run` returns results in
    the order given."""

    def __init__(self, model: L.Model, jobs: int,
                 on_task: Callable[[str, int, int], None] | None = None) -> None:
        self.model, self.jobs, self.on_task = model, jobs, on_task
        self.cpu: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.done = self.total = 0
        self.pool: ProcessPoolExecutor | None = None
        ref: Any = MODEL_REF if model is _registered() else model
        if jobs > 1 and not isinstance(ref, str):
            try:
                pickle.dumps(ref)
            except Exception:  # (a model with lambdas: run here rather than fail)
                self.jobs = 1
        if self.jobs > 1:
            ctx = multiprocessing.get_context("forkserver")
            # (z3 keeps native state that a plain fork would share with the parent)
            ctx.set_forkserver_preload(["atom_core.proofs.run", MODEL_REF.partition(":")[0]])
            # One process per task, forked from the fork server, whose memory never changes:
            # z3's search (and so the resource units a query uses, and its verdict under its
            # budget) depends on where its allocations land, which in a reused worker depends
            # on the tasks it ran before (measured: 5-10% apart for the same query), and in a
            # fresh fork from one unchanging process does not (the same units every time).
            self.pool = ProcessPoolExecutor(self.jobs, mp_context=ctx, max_tasks_per_child=1,
                                            initializer=_init_worker, initargs=(ref,))
        else:
            _init_worker(model)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def _account(self, task: Task, cpu: float) -> None:
        self.cpu[task.kind] += cpu
        self.count[task.kind] += 1
        self.done += 1
        if self.on_task:
            self.on_task(task.kind, self.done, self.total)

    def run(self, tasks: list[Task]) -> list[Any]:
        """Every task's result, in order. A task that raises (or whose worker dies: z3 can
        abort the process) is a `TaskFailed` naming it: every task either gives its result or
        stops the run, so none can go missing and be mistaken for a task with nothing to say."""
        self.total += len(tasks)
        results: list[Any] = [None] * len(tasks)
        if self.pool is None:
            for i, t in enumerate(tasks):
                results[i], cpu, _ = _result(t, lambda t=t: _run(t))
                self._account(t, cpu)
        else:
            order = sorted(range(len(tasks)), key=lambda i: -tasks[i].weight)
            futures: dict[Future, int] = {self.pool.submit(_run, tasks[i]): i for i in order}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = futures[fut]
                    results[i], cpu, _ = _result(tasks[i], fut.result)
                    self._account(tasks[i], cpu)
        return results


def _registered() -> L.Model:
    mod, _, attr = MODEL_REF.partition(":")
    return getattr(importlib.import_module(mod), attr)


def default_jobs() -> int:
    return os.cpu_count() or 1


# --------------------------------------------------------------------------- the plan
def _relational_tasks(model: L.Model) -> list[Task]:
    out = [Task("relational", t_relational, ("base", ""))]
    out += [Task("relational", t_relational, ("step", a.name), 2.0) for a in model.actions]
    if model.transition_invariants:
        out += [Task("relational", t_relational, ("transition", a.name))
                for a in model.actions]
    return out


def _bounded_tasks(max_lanes: int, max_blocks: int) -> list[Task]:
    """The arithmetic invariants at the artifact's and the table's chunk and block size, the
    bounded ones at every size up to the cutoff."""
    return ([Task("arithmetic", t_arithmetic, (seq_len, chunk), 8.0)
             for seq_len, chunk in ((checks.SEQ_LEN, checks.CHUNK),
                                    (capacity.TABLE_SEQ_LEN, capacity.TABLE_CHUNK))]
            + [Task("bounded", t_bounded, (b, k), b * k / 4)
               for b, k in checks.sizes(max_lanes, max_blocks)])


def _unaligned_tasks() -> list[Task]:
    return [Task("arithmetic", t_arithmetic, (checks.UNALIGNED_SEQ_LEN, checks.CHUNK), 8.0)]


def invariant_tasks(model: L.Model, max_lanes: int = MAX_LANES,
                    max_blocks: int = MAX_BLOCKS) -> list[Task]:
    """The tasks of `verify` that decide the (invariant, action) obligations: relational,
    arithmetic and bounded, as `verify` plans them. The planted-bug tests run a mutant through
    these very tasks (`run_here`), so a bug is shown to fail what `verify` runs."""
    return _relational_tasks(model) + _bounded_tasks(max_lanes, max_blocks) + _unaligned_tasks()


def progress_task(lanes: int, blocks: int, max_lanes: int = MAX_LANES) -> Task:
    """`verify`'s progress task at one size (the capacity table's chunk and block size)."""
    return Task("capacity", t_progress, (lanes, blocks, max_lanes, capacity.TABLE_SEQ_LEN,
                                         capacity.TABLE_CHUNK), lanes * blocks)


def counting_tasks() -> list[Task]:
    """The capacity rules for every size (proofs/counting.py)."""
    return ([Task("counting", counting.t_rules, (), 2.0),
             Task("counting", counting.t_scope, (), 0.0)]
            + [Task("counting", counting.t_progress, (c,), 20.0) for c in counting.CASES])


def _at_minimum(feats: list[capacity.Features], max_lanes: int, max_blocks: int
                ) -> dict[tuple[int, int], tuple[capacity.Features, ...]]:
    """The committed table's minimum of each row within the cutoff: (lanes, K_min) -> the
    combinations with that minimum, as `verify`'s phase two would find them from proved rows
    that match the table."""
    from atom_core._generated import capacity as committed

    out: dict[tuple[int, int], list[capacity.Features]] = {}
    for f in feats:
        for b in range(1, f.max_lanes(max_lanes) + 1):
            k = committed.min_kv_blocks(b, f.tables, f.key, f.preempt)
            if k <= max_blocks:
                out.setdefault((b, k), []).append(f)
    return {bk: tuple(fs) for bk, fs in out.items()}


def _at_min_task(lanes: int, blocks: int, max_lanes: int,
                 fs: tuple[capacity.Features, ...]) -> Task:
    """Progress of the combinations `fs` at one size, at the artifact's chunk and block size."""
    return Task("capacity", t_progress, (lanes, blocks, max_lanes, checks.SEQ_LEN, checks.CHUNK,
                                         fs), lanes * blocks)


def run_here(model: L.Model, task: Task) -> Any:
    """`task`'s result on `model`, computed in this process as a worker computes it (a fresh
    z3 context)."""
    _init_worker(model)
    return _run(task)[0]


def verify(model: L.Model, max_lanes: int = MAX_LANES, max_blocks: int = MAX_BLOCKS,
           on_check: Callable[[Check], None] | None = None, *, jobs: int = 1,
           on_task: Callable[[str, int, int], None] | None = None,
           witnesses: tuple[dict[tuple[str, int], Witness], dict[str, Witness]] | None = None,
           parts: tuple[str, ...] = ("nonvacuity", "relational", "bounded",
                                     "capacity", "unaligned", "counting")) -> Report:
    """`witnesses`: (tight, single-block) to replay, default the committed ones; an empty pair
    searches every run (`make generate`). `parts`: what to run (generate needs only capacity)."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    tight_w, single_w = witnesses if witnesses is not None else witness.committed()
    with Runner(model, jobs, on_task) as runner:
        # Phase one: everything that needs no other result.
        nv = _nonvacuity_tasks() if "nonvacuity" in parts else []
        rel = _relational_tasks(model) if "relational" in parts else []
        # (arithmetic invariants are proved for all sizes: their tasks come with "bounded")
        # Every progress query assumes every invariant, so each is proved at each chunk and
        # block size progress is asked at: the artifact's and the table's (capacity.TABLE_CHUNK,
        # where the tight runs are searched; proved at 128 / 4096 alone, they were assumed
        # unproved by the whole table at 2 / 8). The arithmetic ones per chunk and block size
        # (linear only then); the bounded ones once per size for every chunk and block size
        # (C and S left to the axioms: as fast as fixed, measured 1.27 s against 1.17 s at
        # B = 4, K = 8), which holds wherever the arithmetic ones they assume are proved.
        bnd = _bounded_tasks(max_lanes, max_blocks) if "bounded" in parts else []
        sizes = [(b, k) for b in range(1, max_lanes + 1) for k in range(1, max_blocks + 1)]
        feats = [f for f in capacity.COMBINATIONS if capacity.in_table(f, max_blocks)]
        cap = "capacity" in parts
        # (the table at the tight runs' sizes: capacity.TABLE_CHUNK)
        prog = [progress_task(b, k, max_lanes) for b, k in sizes] if cap else []
        replays = [(f, b, tight_w[(f.name, b)]) for f in feats
                   for b in range(1, f.max_lanes(max_lanes) + 1)
                   if (f.name, b) in tight_w] if cap else []
        rep = [Task("capacity-tight", t_replay_tight, (f, b, w), 0.5) for f, b, w in replays]
        cases = capacity.SINGLE_BLOCK if cap else ()
        sb = [Task("capacity-single-block", t_single, (c, single_w.get(c.name) if c.stuck
                                                        else None), 0.5) for c in cases]
        # An eager block that is not a multiple of the chunk (checks.UNALIGNED_SEQ_LEN).
        # (its own cutoff, never above the run's)
        ua = "unaligned" in parts
        ua_lanes = min(checks.UNALIGNED_LANES, max_lanes)
        ua_blocks = min(checks.UNALIGNED_BLOCKS, max_blocks)
        ua_sizes = list(checks.sizes(ua_lanes, ua_blocks)) if ua else []
        # (the bounded invariants at these sizes are proved for every block size above, when
        # "bounded" runs; `assumed_where_proved` says so when it does not)
        ua_bnd = _unaligned_tasks() if ua else []
        ua_prog = [Task("capacity", t_progress, (b, k, ua_lanes, checks.UNALIGNED_SEQ_LEN,
                                                 checks.CHUNK), b * k / 2) for b, k in ua_sizes]
        # The capacity rules for every size (proofs/counting.py), at the default cutoff and
        # above (they do not depend on it: a smaller cutoff is a quick look, and skips them).
        cnt = counting_tasks() if "counting" in parts and max_lanes >= MAX_LANES else []
        # Each row's minimum again at the typical eager artifact's sizes (checks.CHUNK), where
        # the committed table puts it: planned now, not after the rows are assembled, so no
        # worker waits for them (phase two asks only for what the proved rows want beyond it).
        early_min = _at_minimum(feats, max_lanes, max_blocks) if cap else {}
        early = [_at_min_task(b, k, max_lanes, fs) for (b, k), fs in early_min.items()]
        first = nv + rel + bnd + prog + rep + sb + ua_bnd + ua_prog + cnt + early
        res = runner.run(first)
        it = iter(res)
        nv_r = [next(it) for _ in nv]
        rel_r = [next(it) for _ in rel]
        bnd_r = [next(it) for _ in bnd]
        prog_r = [next(it) for _ in prog]
        rep_r = {(f.name, b): next(it) for f, b, _w in replays}
        sb_r = [next(it) for _ in sb]
        ua_bnd_r = [next(it) for _ in ua_bnd]
        ua_prog_r = dict(zip(ua_sizes, (next(it) for _ in ua_prog), strict=True))
        cnt_r = [next(it) for _ in cnt]
        early_r = dict(zip(early_min, (next(it) for _ in early), strict=True))

        # Phase two: rows from the progress results; a search for every tight run whose
        # witness is missing or does not replay, and for every stuck single-block case alike.
        rows = []
        stale: list[str] = []
        results = dict(zip(sizes if cap else [], prog_r, strict=True))
        want: list[tuple[capacity.Row, int, int]] = []  # (row, lanes, blocks) to search
        needed = set()
        for f in feats if cap else []:
            row = capacity.assemble(f, results, max_lanes, max_blocks)
            rows.append(row)
            for b, k_min in row.minimum.items():
                if k_min is None or k_min <= 1:
                    continue
                needed.add((f.name, b))
                tr = rep_r.get((f.name, b))
                w = tight_w.get((f.name, b))
                if isinstance(tr, Trace) and w is not None and w.consts["K"] == k_min - 1:
                    row.traces[b] = tr
                else:
                    why = (tr if isinstance(tr, str) else "missing" if w is None
                           else f"it is for K={w.consts['K']}, one below the minimum is "
                                f"K={k_min - 1}")
                    # (beyond the default cutoff, e.g. with --deep, nothing is committed)
                    if w is not None or (b <= MAX_LANES and k_min - 1 <= MAX_BLOCKS):
                        stale.append(f"tight {f.name}, B={b}: {why}")
                    want.append((row, b, k_min - 1))
        # A witness for a row that is no longer tight where this run decided it (a smaller
        # cutoff leaves the rest undecided) or for features no longer in the table.
        decided = {(r.features.name, b) for r in rows for b, k in r.minimum.items()
                   if k is not None}
        names = {f.name for f in capacity.COMBINATIONS}
        stale += [f"tight {n}, B={b}: no longer needed" for n, b in tight_w
                  if cap and (n not in names or ((n, b) in decided and (n, b) not in needed))]
        # (a stuck case without a witness was searched in phase one already)
        redo = [i for i, (c, (tr, _w)) in enumerate(zip(cases, sb_r, strict=True))
                if c.stuck and c.name in single_w and not isinstance(tr, Trace)]
        stale += [f"single-block {c.name}: " + (str(sb_r[i][0]) if i in redo else "missing")
                  for i, c in enumerate(cases)
                  if c.stuck and (i in redo or c.name not in single_w)]
        stale += [f"single-block {n}: no longer needed" for n in single_w
                  if cap and n not in {c.name for c in cases if c.stuck}]
        # Each row's minimum again at the typical eager artifact's sizes (checks.CHUNK): from
        # phase one where it was planned there, the rest (a table that is not the proved one)
        # now.
        at_min: dict[tuple[int, int], list[capacity.Features]] = {}
        for row in rows:
            for b, k_min in row.minimum.items():
                if k_min is not None:
                    at_min.setdefault((b, k_min), []).append(row.features)
        late = {bk: tuple(f for f in fs if f not in early_r.get(bk, {}))
                for bk, fs in at_min.items()}
        late = {bk: fs for bk, fs in late.items() if fs}
        second = ([Task("capacity-tight-search", t_search_tight, (row.features, b, k), 2.0)
                   for row, b, k in want]
                  + [Task("capacity-single-block", t_single, (cases[i], None), 1.0)
                     for i in redo]
                  + [_at_min_task(b, k, max_lanes, fs) for (b, k), fs in late.items()])
        searched = runner.run(second)
        incomplete = [p for t, r in zip(first + second, res + searched, strict=True)
                      for p in incomplete_result(model, t, r)]
        late_r = dict(zip(late, searched[len(want) + len(redo):], strict=True))
        # (in the rows' order, as one task per size would give them; a size or combination
        # planned from the committed table that the proved rows do not ask for is left out)
        at_min_r = [{f: (late_r[bk] if f in late.get(bk, ()) else early_r[bk])[f] for f in fs}
                    for bk, fs in at_min.items()]
        searched = searched[:len(want) + len(redo)]
        found_tight: dict[Any, Witness] = {}
        for (row, b, _k), (tr, w) in zip(want, searched[:len(want)], strict=True):
            row.traces[b] = tr
            if w is not None:
                found_tight[(row.features.name, b)] = w
        found_single: dict[Any, Witness] = {}
        for i, (tr, w) in zip(redo, searched[len(want):], strict=True):
            sb_r[i] = (tr, w)
        for c, (tr, w) in zip(cases, sb_r, strict=True):
            if isinstance(tr, Trace) and w is not None:
                found_single[c.name] = w
        # (in plan order, whichever finished first)
        cpu = {k: runner.cpu[k] for k in KINDS if k in runner.cpu}
        count = {k: runner.count[k] for k in KINDS if k in runner.count}
        jobs = runner.jobs
        in_here = sum(cpu.values()) if runner.pool is None else 0.0  # (tasks ran here)

    out: list[Check] = [c for cs in nv_r for c in cs]
    if nv:
        out += nonvacuity.live_somewhere(model, out, capacity.COMBINATIONS)
    out += [c for cs in rel_r for c in cs] + [c for cs in bnd_r for c in cs]
    out += [c for cs in ua_bnd_r for c in cs]
    if ua:
        aligned_rows = {r.features: r for r in rows}
        for f in capacity.COMBINATIONS:
            if f.tables != 1 or f.preempt:
                continue
            urow = capacity.assemble(f, ua_prog_r, ua_lanes, ua_blocks)
            out += urow.checks
            if f in aligned_rows:
                out.append(unaligned_rule(f, aligned_rows[f], urow, ua_blocks))
    out += [c for by_f in at_min_r for cs in by_f.values() for c in cs]
    out += [c for cs in cnt_r for c in cs]
    searched_keys = {(row.features.name, b) for row, b, _k in want}
    for row in rows:
        out += row.checks
        f = row.features
        for b, k_min in row.minimum.items():
            if k_min is not None and k_min > 1:
                how = "searched" if (f.name, b) in searched_keys else "witness replayed"
                tr = row.traces.get(b)
                out.append(capacity.tight_check(f, b, k_min - 1, tr,
                                                tr.seconds if tr else 0.0, how))
        if row.offset is None and not f.preempt:  # (preemption: fit_preempt)
            out.append(Check(f"rule:{f.name}", "*", "capacity", "counterexample", 0.0,
                             detail=f"no single rule kv_blocks >= lanes * T + c fits "
                                    f"{row.minimum}"))
    single = []
    if cap:
        out.append(table_matches(rows))
        out.append(Check("witnesses-current", "*", "capacity-tight",
                         "counterexample" if stale else "proved", 0.0,
                         detail=("stale: " + "; ".join(stale) + ". Run `make generate` and "
                                 "commit atom_core/_generated/witnesses.py") if stale else ""))
        for i, (c, (tr, _w)) in enumerate(zip(cases, sb_r, strict=True)):
            trace = tr if isinstance(tr, Trace) else None
            how = ("witness replayed" if c.stuck and c.name in single_w and i not in redo
                   else "searched")
            out.append(single_check(c, tr, how))
            single.append((c, trace))
    progress_tasks = [t for t in first + second if t.kind == "capacity"]
    if progress_tasks:
        out.append(assumed_where_proved(progress_tasks, first))
    if incomplete:  # (only then: a complete run's report lists what it did)
        out.append(Check(COMPLETE, "*", "plan", "counterexample", 0.0,
                         detail=f"{len(incomplete)} obligation(s) planned but not reported, or "
                                "reported twice: " + "; ".join(incomplete[:8])))
    for c in out:
        if on_check:
            on_check(c)
    cpu["main"] = max(0.0, time.process_time() - c0 - in_here)  # planning, merging
    # (a run that decided nothing proved nothing)
    ok = bool(out) and all(c.status == "proved" for c in out)
    return Report(ok, time.perf_counter() - t0, out, rows, single, jobs, cpu, count, stale,
                  {"tight": found_tight, "single": found_single})


# --------------------------------------------------------------------------- make generate
def generate(model: L.Model, max_lanes: int, max_blocks: int, jobs: int,
             on_task: Callable[[str, int, int], None] | None = None) -> tuple[str, str]:
    """(capacity.py, witnesses.py): the capacity table from the progress proofs, and every
    stuck run searched afresh (ignoring the committed ones)."""
    report = verify(model, max_lanes, max_blocks, jobs=jobs, on_task=on_task,
                    witnesses=({}, {}), parts=("capacity",))
    missing = [c for c in report.checks if c.kind == "capacity-tight" and c.status != "proved"
               and c.invariant != "witnesses-current"]
    if missing:
        raise RuntimeError("a capacity row is not tight: " + "; ".join(
            f"{c.invariant} ({c.size})" for c in missing))
    order = {(f.name, b): i for i, (f, b) in enumerate(
        (r.features, b) for r in report.rows for b in r.minimum)}
    tight = dict(sorted(report.found["tight"].items(), key=lambda kv: order[kv[0]]))
    return capacity.render(report.rows, max_lanes), witness.render(tight,
                                                                   report.found["single"])
