"""Microbenchmarks of the generated core's hot transitions: `python -m bench.core` (`make bench`).

Configuration: B=32 lanes, K=34 blocks, C=128, S=4096, prefix cache on, dynamic scratch, with
ghost state off (production) and on (verification). Every pre-state is built by running
transitions with the policy's choices, as a batcher would (never by writing a `State` by hand),
and every benchmarked call is checked once to be accepted, so no row times a rejection.

Method: `time.perf_counter_ns` around a round of `--calls` calls; a round's value is its mean
per-call time. The table reports the median over `--rounds` rounds and the interquartile range
(Q1-Q3) of the rounds, since the machine is shared and noisy; rounds are interleaved across all
rows and both modes, so a burst of load spreads over every row instead of skewing one. The
garbage collector is off while a round runs (as in `timeit`); one untimed warm-up round
precedes the timed ones. Repeating a call from one pre-state keeps the CPU caches warm.

* admit (miss): `admit_miss` from a state with 30 unrelated cache entries (so the
  `no_cache_hit` guard compares each one's first chunk) and every lane idle.
* admit (hit): `admit_hit` of a prompt sharing a 1024-token prefix with one of 30 cache
  entries (n=1024), then `copy_done` from the state after it; both alone and the pair.
* decode: one `decode` call over 32 busy decoding lanes, total and per lane. Unlike the other
  rows this one cannot reuse a fixed pre-state: `push` appends in place only at the end of a
  sequence's buffer and copies the prefix otherwise, so a second decode from the same pre-state
  would time that copy, which production never does. Each round therefore chains `--calls`
  decode steps (each from the state the previous one returned) from a freshly built pre-state.
* finish: `finish(keep=True)` of one lane of the 32-lane decoding state.

The rows time the in-place core (`atom_core/_generated/inplace.py`), the one the batcher runs
(compiled by mypyc when `make install` built it, see atom_core/native.py; `ATOM_CORE_PURE=1`
times its Python module; the report says which ran),
each call checked once against the pure core (`core.py`); the `pure_` rows time the same calls
on the pure core, and `batcher/pure` is the ratio of the medians. An in-place call changes its
state, so each call is timed alone (`perf_counter_ns` before and after it, as vLLM's driver in
../shared/peers/ times each of its calls) on one long-lived state, which is put back in place
(the same lists and dicts) outside the timed region before the next call: the state stays warm
in the CPU caches, as the batcher's, touched every step, is. Decode chains on one state, as the
pure row chains states.
* policy admission: `Policy.admission` on the admit pre-states (as MState, the batcher's);
  and an admission as the batcher makes it: the policy's choice, the transition (admit_hit with
  its copy_done), the policy's bookkeeping, timed like the in-place rows. vLLM's admission row
  includes its choice of blocks and its prefix-cache lookup, so these rows, not the bare
  transitions, are the like-for-like ones; they have no target of their own.

Targets are the issue's; the vLLM v1 KVCacheManager numbers are the issue's reference numbers
for this kind of machine, not measured here.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
from collections.abc import Callable
from itertools import repeat
from time import perf_counter_ns
from typing import Any

from atom_core import native
from atom_core._generated import core as g
from atom_core._generated import inplace as ip
from atom_core.config import Config
from atom_core.policy import Policy
from atom_core.seq import seq
from bench import emit

LANES, BLOCKS, CHUNK, MAX_SEQ = 32, 34, 128, 4096
CACHE_ENTRIES = 30  # cache entries in the admission pre-states
SHARED_PREFIX = 1024  # tokens the admit-hit prompt shares with a cache entry (8 chunks)
MAX_PROMPT = 1500  # decode lanes' prompts are 64..MAX_PROMPT tokens
WARM_DECODE = 16  # decode steps run before the decode pre-state is taken
VOCAB = 32000
SEED = 20240601

ROUNDS, CALLS = 15, 2000
QUICK_ROUNDS, QUICK_CALLS = 3, 20
MODES = {"ghost_off": False, "ghost_on": True}
Round = Callable[[], float]  # times one round; returns mean microseconds per call

# name -> (label, target in us or None, the vLLM v1 reference or "")
ROWS: dict[str, tuple[str, float | None, str]] = {
    "admit_miss": ("admit (miss): admit_miss", 15.0, "~15 (no prefix caching)"),
    "admit_hit": ("admit_hit alone", None, ""),
    "copy_done": ("copy_done alone", None, ""),
    "admit_hit_total": ("admit (hit): admit_hit + copy_done", 25.0, "~30 (prefix caching)"),
    "decode_step": (f"decode step, {LANES} lanes", 1.0 * LANES, "256-320 (8-10 per lane)"),
    "decode_per_lane": ("decode step, per lane", 1.0, "8-10"),
    "finish": ("finish (keep=True)", 8.0, "5-7 (free)"),
    "pure_admit_miss": ("pure core: admit (miss)", None, ""),
    "pure_admit_hit": ("pure core: admit_hit alone", None, ""),
    "pure_copy_done": ("pure core: copy_done alone", None, ""),
    "pure_admit_hit_total": ("pure core: admit_hit + copy_done", None, ""),
    "pure_decode_step": (f"pure core: decode step, {LANES} lanes", None, ""),
    "pure_decode_per_lane": ("pure core: decode, per lane", None, ""),
    "pure_finish": ("pure core: finish (keep=True)", None, ""),
    "policy_admission_miss": ("policy.admission, miss (not core)", None, ""),
    "policy_admission_hit": ("policy.admission, hit (not core)", None, ""),
    "batcher_admit_miss": ("admit (miss), policy + admit_miss", None, ""),
    "batcher_admit_hit": ("admit (hit), policy + admit_hit + copy_done", None, ""),
}


def config() -> Config:
    return Config(lanes=LANES, kv_blocks=BLOCKS, max_seq_len=MAX_SEQ, prefill_chunk=CHUNK,
                  prefix_cache=True, scratch="dynamic")


# --------------------------------------------------------------------------- building states
class Driver:
    """Runs transitions with the policy's choices, failing loudly on a rejected one."""

    def __init__(self, ghost: bool, seed: int = SEED) -> None:
        self.s = g.init(config().consts(), ghost)
        self.policy = Policy()
        self.rng = random.Random(seed)
        self.next_req = 0

    def step(self, action: str, **args: Any) -> g.Step:
        st = g.ACTIONS[action][0](self.s, **args)
        if st.rejected is not None:
            raise AssertionError(f"bench setup: {action}{args} rejected by {st.rejected}")
        self.policy.observe(st.effects)
        self.s = st.state
        return st

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def submit(self, prompt: list[int]) -> int:
        r = self.next_req
        self.next_req += 1
        self.step("submit", r=r, p=seq(prompt))
        return r

    def admit(self, r: int) -> int:
        choice = self.policy.admission(self.s, r)
        if choice is None:
            raise AssertionError(f"bench setup: no admission for request {r}")
        self.step(choice.action, **choice.args)
        lane = choice.args["l"]
        if choice.action == "admit_hit":
            self.step("copy_done", l=lane)
        return lane

    def serve(self, prompt: list[int]) -> int:
        """Submit, admit and prefill `prompt`; the lane it decodes on."""
        lane = self.admit(self.submit(prompt))
        s = self.s
        while s.phase.get(s.lane_req[lane]) == g.PHASE_PREFILL:
            self.step("prefill", l=lane, tok=self.rng.randrange(VOCAB))
            s = self.s
        return lane

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self.step("decode", pad=self.policy.pad(self.s), lpad=self.policy.local_pad(self.s),
                      tok=tuple(self.tokens(LANES)))

    def cache(self, prompt: list[int], steps: int = 8) -> None:
        """Serve `prompt`, decode `steps` tokens and keep the block as a cache entry."""
        lane = self.serve(prompt)
        self.decode(steps)
        self.step("finish", l=lane, keep=True)

    def check(self) -> None:
        bad = g.check_invariants(self.s)
        if bad:
            raise AssertionError(f"bench setup reached a state violating {bad}")


def admission_state(ghost: bool, hit: bool) -> tuple[Driver, int]:
    """CACHE_ENTRIES cache entries and a waiting request (sharing SHARED_PREFIX tokens with one
    entry when `hit`); every lane idle."""
    d = Driver(ghost)
    shared = d.tokens(SHARED_PREFIX)
    for i in range(CACHE_ENTRIES):
        if hit and i == CACHE_ENTRIES // 2:
            d.cache(shared + d.tokens(300))
        else:
            d.cache(d.tokens(d.rng.randint(200, MAX_PROMPT)))
    r = d.submit(shared + d.tokens(400) if hit else d.tokens(700))
    d.check()
    return d, r


def decode_state(ghost: bool) -> tuple[Driver, int]:
    """Two cache entries and every lane decoding, WARM_DECODE steps in; and the padding target
    the policy picks (unused, since no row pads)."""
    d = Driver(ghost)
    for _ in range(BLOCKS - LANES):
        d.cache(d.tokens(d.rng.randint(200, MAX_PROMPT)))
    for _ in range(LANES):
        d.serve(d.tokens(d.rng.randint(64, MAX_PROMPT)))
    d.decode(WARM_DECODE)
    d.check()
    return d, d.policy.pad(d.s)


# --------------------------------------------------------------------------- timing
def _accepted(st: g.Step, what: str) -> g.Step:
    if st.rejected is not None:
        raise AssertionError(f"benchmarked {what} is rejected by {st.rejected}")
    return st


class _NoGC:
    """The garbage collector off while a round runs (as in `timeit`)."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


def fixed_round(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> Round:
    """One round of `calls` calls of `fn(*args)` from a fixed pre-state."""

    def run() -> float:
        with _NoGC():
            t0 = perf_counter_ns()
            for _ in repeat(None, calls):
                fn(*args)
            dt = perf_counter_ns() - t0
        return dt / calls / 1000

    return run


class _Restore:
    """Puts a mutable state back as it is now, in place: the same list and dict objects (and
    index sets rebuilt from the saved ones), so it stays warm in the CPU caches."""

    def __init__(self, m: ip.MState) -> None:
        self.m = m
        self.lists = [(f, list(v)) for f in ip._FIELDS if isinstance(v := getattr(m, f), list)]
        self.dicts = [(f, dict(v)) for f in ip._FIELDS if isinstance(v := getattr(m, f), dict)]
        self.indexes = [(k, {x: set(xs) for x, xs in getattr(m, k).items()})
                        for k in ip.INDEXES]
        if any(isinstance(x, list) for _, v in self.lists for x in v):
            raise AssertionError("a field of lists: restore them element by element")

    def __call__(self) -> None:
        m = self.m
        for f, v in self.lists:
            getattr(m, f)[:] = v
        for f, d in self.dicts:
            cur = getattr(m, f)
            cur.clear()
            cur.update(d)
        for k, ix in self.indexes:
            cur = getattr(m, k)
            cur.clear()
            cur.update({x: set(xs) for x, xs in ix.items()})


def hot_round(fn: Callable[..., Any], pre: g.State, args: tuple[Any, ...], calls: int) -> Round:
    """One round of `calls` calls of the in-place `fn(m, *args)` on one long-lived mutable
    copy of `pre`, each call timed alone and followed, untimed, by putting the state back."""

    def run() -> float:
        m = ip.thaw(pre)
        restore = _Restore(m)
        dt = 0
        with _NoGC():
            for _ in repeat(None, calls):
                t0 = perf_counter_ns()
                fn(m, *args)
                dt += perf_counter_ns() - t0
                restore()
        if ip.freeze(m) != pre or ip.check_indexes(m):
            raise AssertionError("the benchmark's restore did not put the state back")
        return dt / calls / 1000

    return run


def ip_decode_round(ghost: bool, calls: int) -> Round:
    """decode_round for the in-place core: `calls` chained decode steps on one MState."""
    tok = tuple(random.Random(SEED).randrange(VOCAB) for _ in range(LANES))
    decode = ip.decode

    def run() -> float:
        d, pad = decode_state(ghost)
        m = ip.thaw(d.s)
        length0 = list(m.length)
        with _NoGC():
            t0 = perf_counter_ns()
            for _ in repeat(None, calls):
                decode(m, pad, 0, tok)
            dt = perf_counter_ns() - t0
        if m.length != [n + calls for n in length0]:
            raise AssertionError("a chained in-place decode step was rejected")
        return dt / calls / 1000

    return run


def _ip_accepted(fn: Callable[..., Any], pre: g.State, args: tuple[Any, ...],
                 what: str) -> None:
    """The in-place call is accepted and agrees with the pure one (state and effects)."""
    m = ip.thaw(pre)
    st = fn(m, *args)
    _accepted(st, what)
    ref = getattr(g, what)(pre, *args)
    if ip.freeze(m) != ref.state or st.effects != ref.effects:
        raise AssertionError(f"in-place {what} differs from the pure core")


def decode_round(ghost: bool, calls: int) -> Round:
    """One round of `calls` chained decode steps from a freshly built pre-state (see the module
    docstring); the state is built outside the timed region."""
    tok = tuple(random.Random(SEED).randrange(VOCAB) for _ in range(LANES))
    decode = g.decode

    def run() -> float:
        d, pad = decode_state(ghost)
        s0 = s = d.s
        bad = g.decode_guard(s0, pad, 0, tok)
        if bad is not None:
            raise AssertionError(f"benchmarked decode is rejected by {bad}")
        with _NoGC():
            t0 = perf_counter_ns()
            for _ in repeat(None, calls):
                s = decode(s, pad, 0, tok).state
            dt = perf_counter_ns() - t0
        if s.length != tuple(n + calls for n in s0.length):
            raise AssertionError("a chained decode step was rejected")
        return dt / calls / 1000

    return run


def decode_calls(calls: int) -> int:
    """Chained decode steps per round: no lane may reach S tokens."""
    return min(calls, MAX_SEQ - 1 - MAX_PROMPT - WARM_DECODE)


def _admission(policy: Policy) -> Callable[[ip.MState, int], None]:
    """The core's share of an admission as the scheduler makes it (`Scheduler._admit`): the
    policy's choice on the MState, the transition (and the copy's completion for a hit), the
    policy's bookkeeping of the effects; without the scheduler's own bookkeeping (its queue,
    its block tables, its step records)."""
    actions, copy_done = ip.ACTIONS, ip.copy_done

    def admit(m: ip.MState, r: int) -> None:
        choice = policy.admission(m, r)
        if choice is None:
            raise AssertionError("benchmarked admission declined")
        policy.observe(actions[choice.action][0](m, **choice.args).effects)
        if choice.action == "admit_hit":
            policy.observe(copy_done(m, choice.args["l"]).effects)

    return admit


def rounds_for(ghost: bool, calls: int) -> dict[str, Round]:
    """Every measurement of one mode, as a function timing one round; each checks once that the
    benchmarked call is accepted."""
    res: dict[str, Round] = {}

    d, r = admission_state(ghost, hit=False)
    choice = d.policy.admission(d.s, r)
    assert choice is not None and choice.action == "admit_miss", choice
    a = choice.args
    args = (d.s, a["l"], a["r"], a["dst"])
    _accepted(g.admit_miss(*args), "admit_miss")
    res["pure_admit_miss"] = fixed_round(g.admit_miss, args, calls)
    _ip_accepted(ip.admit_miss, args[0], args[1:], "admit_miss")
    res["admit_miss"] = hot_round(ip.admit_miss, args[0], args[1:], calls)
    res["policy_admission_miss"] = fixed_round(d.policy.admission, (ip.thaw(d.s), r), calls)
    res["batcher_admit_miss"] = hot_round(_admission(d.policy), d.s, (r,), calls)

    d, r = admission_state(ghost, hit=True)
    choice = d.policy.admission(d.s, r)
    assert choice is not None and choice.action == "admit_hit", choice
    a = choice.args
    assert a["n"] == SHARED_PREFIX, a
    hit_args = (d.s, a["l"], a["r"], a["src"], a["dst"], a["n"])
    post = _accepted(g.admit_hit(*hit_args), "admit_hit").state
    lane = a["l"]
    _accepted(g.copy_done(post, lane), "copy_done")
    res["pure_admit_hit"] = fixed_round(g.admit_hit, hit_args, calls)
    res["pure_copy_done"] = fixed_round(g.copy_done, (post, lane), calls)
    admit_hit, copy_done = g.admit_hit, g.copy_done

    def hit_then_copy() -> None:
        copy_done(admit_hit(*hit_args).state, lane)

    res["pure_admit_hit_total"] = fixed_round(hit_then_copy, (), calls)
    _ip_accepted(ip.admit_hit, hit_args[0], hit_args[1:], "admit_hit")
    _ip_accepted(ip.copy_done, post, (lane,), "copy_done")
    res["admit_hit"] = hot_round(ip.admit_hit, hit_args[0], hit_args[1:], calls)
    res["copy_done"] = hot_round(ip.copy_done, post, (lane,), calls)
    ip_admit_hit, ip_copy_done = ip.admit_hit, ip.copy_done

    def ip_hit_then_copy(m: ip.MState, *a: Any) -> None:
        ip_copy_done(ip_admit_hit(m, *a).state, lane)

    res["admit_hit_total"] = hot_round(ip_hit_then_copy, hit_args[0], hit_args[1:], calls)
    res["policy_admission_hit"] = fixed_round(d.policy.admission, (ip.thaw(d.s), r), calls)
    res["batcher_admit_hit"] = hot_round(_admission(d.policy), d.s, (r,), calls)

    res["pure_decode_step"] = decode_round(ghost, decode_calls(calls))
    res["decode_step"] = ip_decode_round(ghost, decode_calls(calls))

    d, _ = decode_state(ghost)
    _accepted(g.finish(d.s, 0, True), "finish")
    res["pure_finish"] = fixed_round(g.finish, (d.s, 0, True), calls)
    _ip_accepted(ip.finish, d.s, (0, True), "finish")
    res["finish"] = hot_round(ip.finish, d.s, (0, True), calls)
    return res


def measure(calls: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """mode -> measurement -> per-call microseconds of each round. Rounds are interleaved (round
    i of every measurement in both modes, then round i + 1), so a burst of load on the shared
    machine spreads over all rows instead of skewing one; one untimed warm-up round first."""
    runs = {mode: rounds_for(ghost, calls) for mode, ghost in MODES.items()}
    out: dict[str, dict[str, list[float]]] = {mode: {name: [] for name in rs}
                                              for mode, rs in runs.items()}
    for i in range(rounds + 1):
        for mode, rs in runs.items():
            for name, run in rs.items():
                t = run()
                if i:
                    out[mode][name].append(t)
    for res in out.values():
        res["decode_per_lane"] = [t / LANES for t in res["decode_step"]]
        res["pure_decode_per_lane"] = [t / LANES for t in res["pure_decode_step"]]
    return out


# --------------------------------------------------------------------------- reporting
def summarize(xs: list[float]) -> dict[str, float]:
    if len(xs) >= 2:
        q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = med = q3 = xs[0]
    return {"median_us": med, "q1_us": q1, "q3_us": q3, "iqr_us": q3 - q1,
            "min_us": min(xs), "max_us": max(xs)}


def run(calls: int, rounds: int) -> dict[str, Any]:
    raw = measure(calls, rounds)
    rows = {}
    for name, (label, target, ref) in ROWS.items():
        row: dict[str, Any] = {"label": label, "target_us": target,
                               "vllm_v1_reference_us": ref or None}
        for mode in raw:
            row[mode] = summarize(raw[mode][name])
            row[f"ratio_{mode}"] = (row[mode]["median_us"] / target) if target else None
            if f"pure_{name}" in raw[mode]:  # in-place / pure, medians of the same mode
                pure = summarize(raw[mode][f"pure_{name}"])["median_us"]
                row[f"inplace_over_pure_{mode}"] = row[mode]["median_us"] / pure
        rows[name] = row
    c = config()
    return {
        "benchmark": "bench.core",
        "config": {"lanes": c.lanes, "kv_blocks": c.kv_blocks, "prefill_chunk": c.prefill_chunk,
                   "max_seq_len": c.max_seq_len, "prefix_cache": c.prefix_cache,
                   "scratch": c.scratch},
        "rounds": rounds,
        "calls_per_round": calls,
        "decode_calls_per_round": decode_calls(calls),
        "statistic": "median and quartiles over rounds of the mean per-call time in a round",
        "reference_note": "vLLM v1 KVCacheManager numbers are the issue's reference numbers "
                          "for this kind of machine, not measured here",
        "python": platform.python_version(),
        "platform": platform.platform(),
        # the in-place core the rows ran: "compiled" (mypyc, atom_core/native.py) or "python"
        # (ATOM_CORE_PURE=1, or not built); the pure_ rows are always the Python pure core
        "inplace_core": native.running(),
        "measurements": rows,
    }


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(report: dict[str, Any]) -> None:
    cols = ["measurement", "ghost off us", "IQR", "min", "ghost on us", "IQR", "min",
            "target us", "off/target", "on/target", "batcher/pure off", "batcher/pure on",
            "vLLM v1 ref us (issue)"]
    rows = []
    for m in report["measurements"].values():
        off, on = m["ghost_off"], m["ghost_on"]
        rows.append([m["label"], _fmt(off["median_us"]),
                     f"{_fmt(off['q1_us'])}-{_fmt(off['q3_us'])}", _fmt(off["min_us"]),
                     _fmt(on["median_us"]), f"{_fmt(on['q1_us'])}-{_fmt(on['q3_us'])}",
                     _fmt(on["min_us"]),
                     _fmt(m["target_us"], 0), _fmt(m["ratio_ghost_off"]),
                     _fmt(m["ratio_ghost_on"]), _fmt(m.get("inplace_over_pure_ghost_off")),
                     _fmt(m.get("inplace_over_pure_ghost_on")), m["vllm_v1_reference_us"] or "-"])
    c = report["config"]
    title = (f"atom-core core transitions: B={c['lanes']} K={c['kv_blocks']} "
             f"C={c['prefill_chunk']} S={c['max_seq_len']}, prefix cache, {c['scratch']} "
             f"scratch; median of {report['rounds']} rounds x {report['calls_per_round']} calls "
             f"(decode: {report['decode_calls_per_round']} chained steps), Python "
             f"{report['python']}, {report['inplace_core']} in-place core")
    note = ("us = microseconds per call: median over rounds, IQR = Q1-Q3 of the rounds, min = "
            "fastest round. Ratios use the median; targets apply to production (ghost off).\n"
            "vLLM v1 KVCacheManager column: the issue's reference numbers for this kind of "
            "machine, not measured here.")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
        print(title)
        for r in [cols, ["-" * w for w in widths], *rows]:
            print("  ".join(x.ljust(w) if i == 0 else x.rjust(w)
                            for i, (x, w) in enumerate(zip(r, widths, strict=True))))
        print(note)
        return
    t = Table(title=title, caption=note)
    for i, col in enumerate(cols):
        t.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.core", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_ROUNDS} rounds of {QUICK_CALLS} calls (a smoke test)")
    ap.add_argument("--rounds", type=int, help=f"timed rounds (default {ROUNDS})")
    ap.add_argument("--calls", type=int, help=f"calls per round (default {CALLS})")
    args = ap.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    calls = args.calls or (QUICK_CALLS if args.quick else CALLS)
    if rounds < 1 or calls < 1:
        ap.error("--rounds and --calls must be positive")
    report = run(calls, rounds)
    return emit(report, args.json, print_table)


if __name__ == "__main__":
    sys.exit(main())
