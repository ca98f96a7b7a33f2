"""The in-place core (atom_core/_generated/inplace.py) against the pure one (core.py).

Both are generated from the same spec; the pure core is the reference (proofs and the other
tests use it). Random action sequences run on both, on several configurations (prefix cache,
reserved/dynamic scratch, T > 1 tables, hybrid, host cache, PD, preemption) with ghost state on
and off: after every step `freeze(m)` equals the pure state, the Step's state is the very object
passed in, effects and rejections are equal, the dicts hold no default value, the maintained
indexes equal a rebuild from the fields, and the read-only
functions (every guard over the candidate arguments, check_invariants, progress_violations,
the definitions) agree on MState. Most steps pick among the arguments the guard accepts, so
runs go deep; one in eight takes any candidate, so rejections are compared too.

The planted-bug tests generate broken in-place emitters in memory (`codegen.load_inplace`): one
that drops an update, one that writes each function as soon as it is computed (so later
right-hand sides read the post-state), one that never updates its indexes; the same
differential run must catch each.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core._generated import core
from atom_core._generated import inplace as ip
from atom_core.config import min_kv_blocks
from atom_core.seq import TokSeq, seq
from atom_core.spec import codegen
from atom_core.spec.model import MODEL

ALPHABET = (1, 2, 3)
STEMS = ((1,) * 12, (1, 2) * 6, (2, 3, 3) * 4)
STEPS = 80
# actions that end or undo work are drawn less often, so that runs reach finish, hits, exports
WEIGHT = {n: 1 for n in ("abort_running", "abort_waiting", "fail", "forget", "discard",
                         "transfer_fail", "load_fail", "store_fail", "preempt", "submit",
                         "host_evict", "decode")}
COMBO_CAP = 400

# name -> (prefix, scratch, tier, tables, preempt)
SCENARIOS = {
    "plain-reserved": (False, "reserved", "plain", (1, 1), False),
    "prefix-dynamic": (True, "dynamic", "plain", (1, 1), False),
    "paged-prefix": (True, "reserved", "plain", (2, 3), False),
    "hybrid": (True, "dynamic", "hybrid", (1, 2), False),
    "host": (True, "reserved", "host", (1, 2), False),
    "preempt": (True, "dynamic", "plain", (2, 3), True),
    "preempt-host": (True, "reserved", "host", (2, 3), True),
}


@st.composite
def consts(draw: Any, prefix: bool, scratch: str, tier: str, tables: tuple[int, int],
           preempt: bool) -> core.Consts:
    t = draw(st.integers(*tables))
    b = draw(st.integers(1, 3))
    lo = min_kv_blocks(b, prefix, scratch, t, preemption=preempt)
    k = draw(st.integers(lo, lo + 2))
    c = draw(st.sampled_from((1, 2)))
    sizes = range(6, 13) if t == 1 else range(2, 9)
    s = draw(st.sampled_from([x for x in sizes if x % c == 0]))
    h = draw(st.integers(1, 2)) if tier == "host" else 0
    out = core.Consts(B=b, K=k, C=c, S=s, T=t, PREFIX=prefix, RESERVED=scratch == "reserved",
                      SCRATCH=k - 1, HYBRID=tier == "hybrid", HOST=tier == "host", H=h,
                      PREEMPT=preempt)
    assert not core.check_axioms(out), core.check_axioms(out)
    return out


def prompt(rnd: random.Random, max_len: int) -> TokSeq:
    """A prefix of a stem then a random tail (stems make prefix-cache hits likely)."""
    stem = rnd.choice(STEMS)
    toks = list(stem[:rnd.randint(0, max_len)])
    toks += [rnd.choice(ALPHABET) for _ in range(rnd.randint(0, 3))]
    return seq(toks[:max_len] or [1])


def candidates(s: Any, name: str, rnd: random.Random) -> list[tuple[Any, ...]]:
    """Argument tuples for action `name` in pure state `s`: every value of the small sorts,
    known requests plus a fresh one, and one drawn sequence / token vector."""
    c = s.consts
    _, _, pnames, psorts = core.ACTIONS[name]
    reqs = sorted(k for k, _ in s.phase.items())
    fresh = max(reqs, default=-1) + 1
    doms: list[list[Any]] = []
    for p, sort in zip(pnames, psorts, strict=True):
        if sort in core.INDEX_SORTS:
            doms.append(list(range(getattr(c, core.INDEX_SORTS[sort]))))
        elif sort == "Bool":
            doms.append([False, True])
        elif sort == "Req":
            doms.append([*reqs, fresh])
        elif sort == "Seq":
            doms.append([prompt(rnd, c.S * c.T - 1)])
        elif sort == "Int" and p == "n":
            doms.append(list(range(1, c.S * c.T + 1)))
        elif sort == "Int":
            doms.append([rnd.choice(ALPHABET)])
        elif sort.startswith("("):  # a token per lane
            doms.append([tuple(rnd.choice(ALPHABET) for _ in range(c.B))])
        else:
            raise AssertionError(f"no candidates for {name}.{p}: {sort}")
    if "n" in pnames:  # a hit's length: only for arguments the other guard conjuncts accept
        i = pnames.index("n")
        rest = [pn for pn in pnames if pn != "n"]
        ready = getattr(core, f"ready_{name}")
        base = [a for a in itertools.product(*(d for j, d in enumerate(doms) if j != i))
                if ready(s, **dict(zip(rest, a, strict=True)))]
        out = [(*a[:i], n, *a[i:]) for a in base for n in doms[i]]
        if not out:
            out = [(*a[:i], 1, *a[i:]) for a in itertools.product(
                *(d for j, d in enumerate(doms) if j != i))]
    else:
        out = list(itertools.product(*doms))
    return out if len(out) <= COMBO_CAP else rnd.sample(out, COMBO_CAP)


def _maps_hold_no_default(m: Any) -> None:
    for f, d in ip.MAP_DEFAULTS.items():
        v = getattr(m, f)
        if v is None:
            continue
        bad = [k for k, x in v.items() if x is d or x == d]
        assert not bad, f"{f}: keys {bad} store the default {d!r}"


def _same_reads(ps: Any, m: Any, variant: Any) -> None:
    assert variant.check_invariants(m) == core.check_invariants(ps)
    assert variant.progress_violations(m) == core.progress_violations(ps)
    assert variant.describe_state(m) == core.describe_state(ps)


def run(draw: Any, c: core.Consts, ghost: bool, variant: Any) -> None:
    ps = core.init(c, ghost)
    m = variant.init(c, ghost)
    assert variant.freeze(m) == ps
    names = list(core.ACTIONS)
    # hypothesis draws the seed only: its own draws favour small values (the first action,
    # rejections), and runs would stay shallow
    rnd = random.Random(draw(st.integers(0, 2**32 - 1), label="seed"))
    for i in range(STEPS):
        # the first action (in a random order) with accepted arguments, every guard compared
        # over its candidates on the way; one step in eight takes any candidate of the first
        order = sorted(names, key=lambda n: -rnd.random() ** (1 / WEIGHT.get(n, 4)))
        first = None
        for name in order:
            combos = candidates(ps, name, rnd)
            if not combos:  # e.g. a slot action without the host tier
                continue
            guard, vguard = getattr(core, f"{name}_guard"), getattr(variant, f"{name}_guard")
            verdicts = [guard(ps, *a) for a in combos]
            assert [vguard(m, *a) for a in combos] == verdicts, name
            if first is None:
                first = (name, combos)
                if rnd.random() < 0.125:
                    args = rnd.choice(combos)
                    break
            ok = [a for a, v in zip(combos, verdicts, strict=True) if v is None]
            if ok:
                args = rnd.choice(ok)
                break
        else:
            assert first is not None
            name, combos = first
            args = rnd.choice(combos)
        plan = getattr(core, f"{name}_plan", None)
        if plan is not None:
            assert getattr(variant, f"{name}_plan")(m, *args) == plan(ps, *args)
        p_step = getattr(core, name)(ps, *args)
        v_step = getattr(variant, name)(m, *args)
        where = f"step {i}: {name}{args}"
        assert v_step.state is m, where
        assert v_step.rejected == p_step.rejected, where
        assert v_step.effects == p_step.effects, where
        assert variant.freeze(m) == p_step.state, where
        _maps_hold_no_default(m)
        assert not variant.check_indexes(m), (where, variant.check_indexes(m))
        ps = p_step.state
        if p_step.rejected is None:
            _same_reads(ps, m, variant)
    # the definitions, on every lane / block
    for dname in DEFINITIONS:
        fn, vfn = getattr(core, dname), getattr(variant, dname)
        for args in definition_args(ps, dname):
            assert vfn(m, *args) == fn(ps, *args), (dname, args)
    # the lookups (`where_<f>`, an index in the variant), on every value f holds and one it
    # does not: exactly the x with f(x) == v, ascending
    for f in MODEL.lookups:
        col = getattr(ps, f.name)
        for v in {*col, seq([-1])}:
            want = [x for x, w in enumerate(col) if w == v]
            assert getattr(core, f"where_{f.name}")(ps, v) == want, (f.name, v)
            assert getattr(variant, f"where_{f.name}")(m, v) == want, (f.name, v)


def _definitions() -> dict[str, list[str]]:
    return {d.name: [p.sort.name for p in d.params] for d in MODEL.definitions}


DEFINITIONS = _definitions()


def definition_args(s: Any, name: str) -> list[tuple[Any, ...]]:
    doms = []
    for sort in DEFINITIONS[name]:
        if sort in core.INDEX_SORTS:
            doms.append(range(getattr(s.consts, core.INDEX_SORTS[sort])))
        elif sort == "Bool":
            doms.append((False, True))
        else:
            return []
    return list(itertools.product(*doms))


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "noghost"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_inplace_matches_pure(scenario: str, ghost: bool, data: Any) -> None:
    c = data.draw(consts(*SCENARIOS[scenario]), label="consts")
    run(data.draw, c, ghost, ip)


def test_step_returns_the_same_object_and_rejection_leaves_it() -> None:
    c = core.Consts(B=2, K=4, C=1, S=8, T=1, PREFIX=True, RESERVED=False, SCRATCH=3)
    m = ip.init(c)
    before = ip.freeze(m)
    step = ip.finish(m, 0, False)  # lane 0 serves nothing
    assert step.state is m and step.rejected == "lane_decoding" and step.effects == ()
    assert ip.freeze(m) == before
    step = ip.submit(m, 7, seq([1, 2, 3]))
    assert step.state is m and step.rejected is None
    assert ip.freeze(m) == core.submit(before, 7, seq([1, 2, 3])).state
    assert ip.thaw(ip.freeze(m)).phase == m.phase


# ------------------------------------------------------------------------ shared functions


def test_read_only_functions_identical_in_both_cores_are_shared() -> None:
    """inplace.py imports from core.py each read-only function whose generated text would be
    the same in both (`InplaceGenerator.shared`) and defines the others; an `enabled_` whose
    guard is the in-place core's own (it reads a maintained index) is its own too."""
    gen = codegen.InplaceGenerator(MODEL)
    gen.source()
    readonly = set(gen.readonly())
    assert gen.shared and gen.shared < readonly
    for name in readonly:
        assert (getattr(ip, name) is getattr(core, name)) == (name in gen.shared), name
    for name in gen.shared:
        if name.startswith("enabled_"):
            assert f"{name.removeprefix('enabled_')}_guard" in gen.shared, name
    assert {"copy_done_guard", "enabled_copy_done", "submit_guard"} <= gen.shared
    assert not {"grow_guard", "enabled_grow", "reusable"} & gen.shared


def test_a_mutant_guard_reaches_both_cores() -> None:
    """`load_inplace` of a mutated spec takes the shared functions from the pure core
    generated for the same mutant (the variant's `_core`), never from the committed core.py."""
    c = core.Consts(B=2, K=4, C=1, S=8, T=1, PREFIX=True, RESERVED=False, SCRATCH=3)
    p = seq([1, 2, 3])
    ps = core.submit(core.init(c), 7, p).state
    assert core.submit_guard(ps, 7, p) == "request_is_new"
    variant = codegen.load_inplace(MODEL.without_guard("submit", "request_is_new"),
                                   "atom_core._generated.inplace_mutant")
    assert variant._core is not core and variant.State is variant._core.State
    assert variant.submit_guard is variant._core.submit_guard
    m = variant.thaw(ps)
    assert variant.submit_guard(m, 7, p) is None and variant.enabled_submit(m, r=7, p=p)
    assert variant._core.submit(ps, 7, p).rejected is None
    assert variant.submit(m, 7, p).rejected is None
    assert ip.submit_guard(ip.thaw(ps), 7, p) == "request_is_new"  # the committed cores


# ------------------------------------------------------------------------ planted bugs


class _DropsAnUpdate(codegen.InplaceGenerator):
    """Forgets `busy(l) := False` in finish (the lane never frees)."""

    def _action_body(self, a: Any, counts: Any) -> Any:
        self._action = a.name
        return super()._action_body(a, counts)

    def _compute(self, b: Any, f: Any, ups: Any, updated: Any, direct: Any, writes: Any) -> None:
        if self._action == "finish" and f.name == "busy":
            return
        super()._compute(b, f, ups, updated, direct, writes)


class _WritesEarly(codegen.InplaceGenerator):
    """Writes each function right after computing it: later right-hand sides (and effects)
    read the post-state, a sequential instead of a simultaneous assignment."""

    def _compute(self, b: Any, f: Any, ups: Any, updated: Any, direct: Any, writes: Any) -> None:
        mine_d: list[Any] = []
        mine_w: list[Any] = []
        super()._compute(b, f, ups, updated, mine_d, mine_w)
        for w in mine_d + mine_w:
            w()


class _StaleIndex(codegen.InplaceGenerator):
    """Never updates the maintained indexes after thaw (a write without its hooks)."""

    def _ix_pre_post(self, fname: str, x: str,
                     skip: tuple[Any, ...] | None = None) -> tuple[list[str], list[str]]:
        return [], []


def _caught(variant: Any) -> bool:
    seen: list[BaseException] = []

    @settings(max_examples=200, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data(), scenario=st.sampled_from(list(SCENARIOS)))
    def probe(data: Any, scenario: str) -> None:
        c = data.draw(consts(*SCENARIOS[scenario]))
        try:
            run(data.draw, c, True, variant)
        except AssertionError as e:
            seen.append(e)
            raise

    try:
        probe()
    except AssertionError:
        return True
    return bool(seen)


@pytest.mark.parametrize("emitter", [_DropsAnUpdate, _WritesEarly, _StaleIndex])
def test_planted_bug_is_caught(emitter: type[codegen.InplaceGenerator]) -> None:
    variant = codegen.load_inplace(generator=emitter)
    assert _caught(variant), f"{emitter.__name__}: the differential run found no difference"


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])
@given(data=st.data(), scenario=st.sampled_from(["prefix-dynamic", "paged-prefix", "host"]))
def test_value_index_buckets_are_only_a_superset(data: Any, scenario: str) -> None:
    """A sequence is filed under its signature, so a bucket may hold blocks whose value differs
    (never in the runs above: their chunks are 1-2 tokens, where the signature is the value).
    With every sequence in one bucket the loops must still agree with the pure core."""
    variant = codegen.load_inplace()
    variant._sig = lambda v: 0
    c = data.draw(consts(*SCENARIOS[scenario]), label="consts")
    run(data.draw, c, True, variant)
