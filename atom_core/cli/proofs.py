"""The proofs and an artifact's configuration: `verify`, `check-config`, `min-blocks`,
`check-trace`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from atom_core._generated import capacity
from atom_core.cli.common import emit, fail, html_argument, table, write_html, z3_or_exit
from atom_core.config import SCRATCH_MODES, Config, ConfigError, features, min_kv_blocks, rule_for
from atom_core.options import count, integer, length, seconds, slots

# Past these a typo, not a request: --deep's cutoffs (5 lanes, 10 blocks) already take hours,
# and each job is a process.
MAX_CUTOFF = 64
MAX_JOBS = 1024


def verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--max-lanes", type=integer(1, MAX_CUTOFF), default=None,
                   help="cutoff for bounded proofs (default 4; 5 with --deep)")
    p.add_argument("--max-blocks", type=integer(1, MAX_CUTOFF), default=None,
                   help="cutoff for bounded proofs (default 8; 10 with --deep)")
    p.add_argument("--deep", action="store_true",
                   help="larger cutoffs (slow; CI runs the default)")
    p.add_argument("-j", "--jobs", type=integer(1, MAX_JOBS), default=os.cpu_count() or 1,
                   help="worker processes (default: one per CPU); the output is the same "
                        "for any number")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")


@contextlib.contextmanager
def task_progress(show: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress bar on stderr over verify's tasks (none when `show` is false)."""
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("verify {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        tid = bar.add_task("", total=None)

        def on_task(kind: str, done: int, total: int) -> None:
            bar.update(tid, completed=done, total=total, description=kind)

        yield on_task


@contextlib.contextmanager
def search_progress(show: bool) -> Iterator[Callable[[Any], None] | None]:
    """A progress bar on stderr over check-config's search for a stuck run (none when `show`
    is false), drawn from the search's first report on: a committed or lifted run, the usual
    case, needs no search and draws none."""
    if not show:
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # (rich comes with z3 in the verify extra; z3 alone needs no bar)
        yield None
        return
    bar = Progress(TextColumn("stuck-run search"), BarColumn(bar_width=20),
                   TextColumn("{task.completed:,}/{task.total:,} states, depth "
                              "{task.fields[depth]}"),
                   TimeElapsedColumn(), TextColumn("of {task.fields[seconds]:g} s"),
                   console=Console(stderr=True), transient=True)
    task: list[Any] = []

    def on_progress(budget: Any) -> None:
        if not task:
            bar.start()
            task.append(bar.add_task("", total=budget.max_states, depth=0,
                                     seconds=budget.max_seconds))
        bar.update(task[0], completed=budget.states, depth=budget.depth)

    try:
        yield on_progress
    finally:
        if task:
            bar.stop()


def cmd_verify(args: argparse.Namespace) -> int:
    z3_or_exit()
    from atom_core.proofs.run import DEEP_BLOCKS, DEEP_LANES, TaskFailed, verify
    from atom_core.spec.model import MODEL

    lanes = args.max_lanes or (DEEP_LANES if args.deep else 4)
    blocks = args.max_blocks or (DEEP_BLOCKS if args.deep else 8)
    show = not (args.json or args.quiet) and sys.stderr.isatty()
    with task_progress(show) as on_task:
        try:
            report = verify(MODEL, lanes, blocks, jobs=args.jobs, on_task=on_task)
        except TaskFailed as exc:  # (a task raised or its worker died: nothing to report on)
            if args.json:
                emit({"ok": False, "error": str(exc)})
            print(f"atom-core verify FAILED: {exc}; its obligations were not decided",
                  file=sys.stderr)
            return 1
    if args.json:
        emit(report.as_json())
        return 0 if report.ok else 1
    groups: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
    for c in report.checks:
        groups[(c.invariant, c.action, c.kind)].append(c)
    rows = []
    for (inv, act, kind), cs in groups.items():
        bad = [c for c in cs if c.status != "proved"]
        status = bad[0].status if bad else "proved"
        where = f" ({bad[0].size})" if bad and bad[0].size else ""
        rows.append([inv, act, kind, f"{status}{where}", str(len(cs)),
                     f"{sum(c.seconds for c in cs):.3f}", f"{max(c.seconds for c in cs):.3f}"])
    table("atom-core verify: invariant x action", ["invariant", "action", "kind", "status",
                                                     "queries", "seconds", "max"], rows)
    from atom_core.proofs import capacity as proved

    fitted, _wrong = proved.fit(report.rows)
    pfitted, _pwrong = proved.fit_preempt(report.rows)
    cap = []
    for r in report.rows:
        mins = ", ".join(f"B={b}: {k}" for b, k in r.minimum.items())
        tight = all(t is not None for t in r.traces.values())
        if r.features.preempt:
            rule = (f"{r.features.rule_name}: {proved.preempt_rule_text(*pfitted[r.key])}"
                    if r.key in pfitted else "no rule fits")
        else:
            rule = (f"{proved.RULE_NAMES[r.key]}: {proved.rule_text(*fitted[r.key])}"
                    if r.key in fitted else "no rule fits")
        cap.append([r.features.name, rule, mins, "yes" if tight else "NO"])
    table("capacity (proved sufficient; tight = stuck run one block below)",
           ["features", "rule", "minimum kv_blocks", "tight"], cap)
    sb = [[case.name, f"B={case.lanes}, K=1", "on" if case.prefix_cache else "off", case.role,
           "no stuck state" if tr is None else
           f"stuck ({tr.violated}): " + "; ".join(
               describe_step(st.as_json()).strip() for st in tr.steps)]
          for case, tr in report.single_block]
    table("single-block mode (block 0 serves the only lane)",
           ["case", "size", "prefix cache", "role", "result"], sb)
    table(f"where the time went ({report.jobs} jobs)",
           ["kind", "tasks", "CPU seconds"],
           [[k, str(report.tasks.get(k, "")), f"{v:.1f}"] for k, v in report.cpu.items()])
    table("z3 resource units (deterministic: the same on any machine; budgets in "
          "proofs/limits.py)", ["kind", "queries", "largest", "budget", "share"],
          [[k, str(n), f"{used:,}", f"{budget:,}", f"{used / budget:.1%}"]
           for k, (n, used, budget) in report.rlimits().items()])
    if report.stale:
        print("stale witnesses (run `make generate`): " + "; ".join(report.stale))
    n_bad = sum(1 for c in report.checks if c.status != "proved")
    print(f"{len(report.checks)} checks, {n_bad} not proved, {report.seconds:.1f} s wall, "
          f"{sum(report.cpu.values()):.1f} s CPU: "
          + ("OK" if report.ok else "FAILED"))
    return 0 if report.ok else 1


def describe_step(step: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={_short(v)}" for k, v in step["args"].items())
    return f"{step['step']:>3}. {step['action']}({args})"


def _short(v: Any) -> str:
    if isinstance(v, list) and len(v) > 12:
        return f"[{', '.join(map(str, v[:6]))}, ... {len(v)} items]"
    return str(v)


def _artifact_config(args: argparse.Namespace, kv_blocks: int) -> Config | str:
    """The artifact's Config with `kv_blocks` blocks (at least the rule's minimum), or what is
    wrong with its settings other than its number of KV blocks."""
    try:
        return Config(lanes=args.lanes, kv_blocks=kv_blocks, max_seq_len=args.max_seq_len,
                      block_size=args.block_size if args.block_size is not None
                      else args.max_seq_len,
                      prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache,
                      scratch=args.scratch, host_cache_blocks=args.host_cache_blocks,
                      preemption=args.preemption,
                      sliding_window=getattr(args, "sliding_window", None))
    except ConfigError as exc:
        return exc.in_terms(args.words)


def _rbln_strict(args: argparse.Namespace) -> bool:
    """Whether what optimum-rbln 0.12.0 would not compile (or atom-core's RBLN runtime would not
    serve) refuses the configuration: with
    --rbln, or for an artifact whose rbln_config.json records `attn_impl` (optimum-rbln writes
    it into every compiled decoder's); otherwise it is a note (the flags may describe a
    configuration for another runtime). check-config and min-blocks decide it alike."""
    return bool(args.rbln or "attn_impl" in _rbln_settings(args))


def _rbln_settings(args: argparse.Namespace) -> dict[str, Any]:
    return getattr(args, "rbln_settings", None) or {}


COMPILES = "optimum-rbln 0.12.0 would not compile this artifact"


def _rbln_problems(args: argparse.Namespace, cfg: Config,
                   kv_blocks: int) -> list[tuple[str, str]]:
    """(why, message): what optimum-rbln 0.12.0 would not compile at `kv_blocks` blocks
    (`rbln_compile_errors`), then what atom-core's RBLN runtime would not serve (a host tier,
    a hybrid model's prefix cache: `rbln_binding_errors`), so that a configuration --rbln
    accepts is one `serve --runtime rbln` takes. The latter only under `_rbln_strict`: they
    are what other runtimes serve, so as notes they would only be noise."""
    from atom_core.config import RBLN_SERVES, rbln_binding_errors, rbln_compile_errors

    compiled = rbln_compile_errors(cfg, _rbln_settings(args), kv_blocks=kv_blocks,
                                   v=args.words)
    served = rbln_binding_errors(cfg) if _rbln_strict(args) else []
    return [(COMPILES, e) for e in compiled] + [(RBLN_SERVES, e) for e in served]


def _rbln_refusal(problems: list[tuple[str, str]]) -> str:
    """One message: each reason once, then its problems."""
    reasons = dict.fromkeys(why for why, _ in problems)
    return "; ".join(f"{why}: " + "; ".join(e for w, e in problems if w == why)
                     for why in reasons)


def _rbln_notes(problems: list[tuple[str, str]]) -> None:
    for why, e in problems:
        print(f"note: {why} (--rbln refuses it): {e}")


def _rbln_minimum(args: argparse.Namespace, cfg: Config,
                  need: int) -> tuple[int, list[tuple[str, str]]]:
    """min-blocks under the RBLN checks: the least kv_blocks check-config accepts (the spec's
    `need`, raised to optimum-rbln's kvcache_num_blocks minimum when the checks refuse), and
    the RBLN problems at that count."""
    from atom_core.config import rbln_min_kv_blocks

    settings = _rbln_settings(args)
    least = max(need, rbln_min_kv_blocks(cfg, settings)) if _rbln_strict(args) else need
    return least, _rbln_problems(args, cfg, least)


def _invalid(args: argparse.Namespace, error: str, out: dict[str, Any]) -> int:
    """check-config (`out` has "safe"): an unsafe verdict, exit 1. min-blocks: no result, exit
    2, and its JSON is every command's failure object (`"ok": false`), not a verdict it has no
    field for."""
    verdict = "safe" in out
    if args.json:
        emit({**out, "safe": False, "error": error} if verdict
             else {**out, "ok": False, "error": error})
    else:
        print(f"INVALID: {error}", file=sys.stderr)
    return 1 if verdict else 2


def _tables(args: argparse.Namespace) -> int:
    """T, the blocks per lane's table (a block size that does not divide max_seq_len is
    reported by `_artifact_config`)."""
    block = args.block_size if args.block_size is not None else args.max_seq_len
    return max(1, args.max_seq_len // block)


# check-config searches for the stuck run at the artifact's size; with paged tables the search
# grows with lanes * T, so above this it reports the rule without a run.
TRACE_LANE_BLOCKS = 8
# Its bounds (--search-states, --search-seconds). Every size up to TRACE_LANE_BLOCKS answers
# well within them: a committed or lifted run needs no search, and the largest search keeps
# about 1,500 states (2 lanes of 4 blocks, preemption). A search that runs into them has kept
# at most about 170 MB (50,000 states of 4 lanes, breadth-first). Past MAX_SEARCH_STATES a
# value is a typo (a state takes about 2.5 kB).
SEARCH_STATES = 50_000
SEARCH_SECONDS = 10.0
MAX_SEARCH_STATES = 100_000_000


# flag -> (Config field, default without --rbln-config)
_ARTIFACT_FLAGS = {"lanes": ("lanes", None), "kv_blocks": ("kv_blocks", None),
                   "max_seq_len": ("max_seq_len", 4096), "block_size": ("block_size", None),
                   "prefill_chunk": ("prefill_chunk", 128),
                   "prefix_cache": ("prefix_cache", False)}
# where a default comes from, said beside it when a message names the value
_DEFAULT_ORIGINS = {"max_seq_len": "check-config's and min-blocks' default",
                    "block_size": "the default: max_seq_len, one block per lane",
                    "prefill_chunk": "check-config's and min-blocks' default"}
# the Config fields these commands have a flag for (min-blocks has no --kv-blocks)
_CONFIG_FLAGS = ("lanes", "kv_blocks", "max_seq_len", "block_size", "prefill_chunk",
                 "prefix_cache", "scratch", "host_cache_blocks", "preemption")


def _artifact_args(args: argparse.Namespace) -> int | None:
    """Fill the artifact's settings from --rbln-config where no flag gave them, then the
    defaults, and the words its messages use (`args.words`: the flags, and where a value no
    flag gave came from); 2 (a usage error, printed) when something required is missing."""
    from atom_core.config import RblnSettings, artifact_fields, flag_vocabulary, read_rbln

    flags = [f for f in _CONFIG_FLAGS if hasattr(args, f)]
    given = {field: getattr(args, flag) for flag, (field, _) in _ARTIFACT_FLAGS.items()
             if getattr(args, flag, None) is not None}
    args.words = flag_vocabulary(flags)
    fields: dict[str, Any] = {}
    settings: RblnSettings | None = None
    if args.rbln_config is not None:
        try:  # one read: the path may be a pipe (`--rbln-config <(...)`)
            settings = read_rbln(args.rbln_config)
            # 0 blocks is not a block count (the flag's type refuses it): the search for a
            # stuck run and the rule would run on a configuration no artifact has
            fields = artifact_fields(settings, given, args.words, need=("max_seq_len",),
                                     blocks="kv_blocks" in flags)
        except ConfigError as exc:
            msg = exc.in_terms(args.words)
            return _usage_error(args, f"INVALID: {msg}", msg)
        args.rbln_settings = dict(settings.data)
    origins = settings.origins(given) if settings is not None else {}
    # the model's window is no flag: it comes with the artifact (Config refuses, e.g., a
    # hybrid model with a host cache, and check-config must refuse the same artifact)
    args.sliding_window = fields.get("sliding_window")
    for flag, (field, default) in _ARTIFACT_FLAGS.items():
        if hasattr(args, flag) and getattr(args, flag) is None:
            setattr(args, flag, fields.get(field, default))
            if field not in fields and field in _DEFAULT_ORIGINS:
                origins[field] = _DEFAULT_ORIGINS[field]
    keys = {"sliding_window": settings.keys["sliding_window"]} \
        if settings is not None and "sliding_window" in settings.keys else {}
    args.words = flag_vocabulary(flags, origins, keys)
    missing = [f"--{flag.replace('_', '-')}" for flag in ("lanes", "kv_blocks")
               if hasattr(args, flag) and getattr(args, flag) is None]
    if missing:
        msg = (f"{' and '.join(missing)} required (or --rbln-config PATH with batch_size and "
               "kvcache_num_blocks)")
        _usage_error(args, f"{args.command}: {msg}", msg)
        raise SystemExit(2)  # a usage error, as argparse's own
    return None


def _usage_error(args: argparse.Namespace, text: str, error: str) -> int:
    """2, after saying why on stderr and, with --json, as one JSON object on stdout (a caller
    parsing stdout gets the reason, not an empty line)."""
    if args.json:
        emit({"safe": False, "error": error} if args.command == "check-config"
             else {"ok": False, "error": error})
    print(text, file=sys.stderr)
    return 2


def check_config_arguments(p: argparse.ArgumentParser) -> None:
    _artifact_arguments(p, kv_blocks=True)
    p.add_argument("--search-states", type=integer(1, MAX_SEARCH_STATES),
                   default=SEARCH_STATES,
                   help="below the minimum, the search for a stuck run to show keeps at most "
                        f"this many states (they bound its memory; default {SEARCH_STATES}); "
                        "past it the verdict is the rule's, without a run")
    p.add_argument("--search-seconds", type=seconds(), default=SEARCH_SECONDS,
                   help="the longest that search runs, in seconds (default "
                        f"{SEARCH_SECONDS:g}); past it the verdict is the rule's, without a run")
    p.add_argument("--rbln", action="store_true",
                   help="refuse what optimum-rbln 0.12.0 would not compile for an ATOM NPU "
                        "(eager/flash-attention sizes, kvcache_num_blocks' minimum, sliding "
                        "window) or atom-core's RBLN runtime would not serve (a host tier, a "
                        "hybrid model's prefix cache); on for an --rbln-config that records "
                        "attn_impl, else a note")
    html_argument(p, "the verdict and, below the minimum, the stuck run as a picture of block "
                     "ownership over its steps")


def min_blocks_arguments(p: argparse.ArgumentParser) -> None:
    _artifact_arguments(p, kv_blocks=False)
    p.add_argument("--rbln", action="store_true",
                   help="as check-config --rbln: refuse what optimum-rbln 0.12.0 would not "
                        "compile for an ATOM NPU or atom-core's RBLN runtime would not serve, "
                        "and give at least optimum-rbln's kvcache_num_blocks minimum; on for "
                        "an --rbln-config that records attn_impl, else a note")
    html_argument(p, "the capacity table as a picture: the fewest KV blocks per feature "
                     "combination against the lane count, proved cells marked")


def _artifact_arguments(p: argparse.ArgumentParser, kv_blocks: bool) -> None:
    p.add_argument("--rbln-config", default=None, metavar="PATH",
                   help="a compiled artifact's rbln_config.json (or its directory): its "
                        "batch_size, kvcache_num_blocks, kvcache_block_size, max_seq_len, "
                        "prefill_chunk_size, ...; flags given here win over it")
    p.add_argument("--lanes", type=count, default=None,
                   help="required unless --rbln-config gives batch_size")
    if kv_blocks:
        p.add_argument("--kv-blocks", type=count, default=None,
                       help="required unless --rbln-config gives kvcache_num_blocks")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="default: --rbln-config's enable_prefix_caching, else off")
    p.add_argument("--scratch", choices=SCRATCH_MODES, default="dynamic",
                   help="reserved: a fixed scratch block; dynamic: padding rows write into a "
                        "free block (default: dynamic)")
    p.add_argument("--max-seq-len", type=length, default=None,
                   help="default: --rbln-config's max_seq_len, else 4096")
    p.add_argument("--block-size", type=length, default=None,
                   help="KV block size; max_seq_len / block_size blocks per lane's table "
                        "(default: max_seq_len, the eager artifact: one block per lane)")
    p.add_argument("--prefill-chunk", type=count, default=None, help="default 128")
    p.add_argument("--host-cache-blocks", type=slots, default=0,
                   help="host cache slots below the prefix cache (default 0: none)")
    p.add_argument("--preemption", action=argparse.BooleanOptionalAction, default=False,
                   help="a lane waiting for a block preempts the most recently admitted one "
                        "(needs --block-size below --max-seq-len): one lane's whole table "
                        "and a block suffice")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def cmd_check_config(args: argparse.Namespace) -> int:
    if (bad := _artifact_args(args)) is not None:
        return bad
    t = _tables(args)
    need = min_kv_blocks(args.lanes, args.prefix_cache, args.scratch, t, args.preemption)
    rule = rule_for(args.prefix_cache, args.scratch, t, args.preemption)
    cfg = _artifact_config(args, max(need, args.kv_blocks))
    if isinstance(cfg, str):
        return _invalid(args, cfg, {"safe": False, "lanes": args.lanes,
                                    "kv_blocks": args.kv_blocks})
    problems = _rbln_problems(args, cfg, args.kv_blocks)
    if problems and _rbln_strict(args):
        return _invalid(args, _rbln_refusal(problems), {"safe": False, "lanes": args.lanes,
                                                        "kv_blocks": args.kv_blocks})
    out: dict[str, Any] = {"safe": args.kv_blocks >= need, "rule": rule, "trace": [],
                           "lanes": args.lanes, "kv_blocks": args.kv_blocks,
                           "min_kv_blocks": need, "proved_lanes": capacity.PROVED_LANES,
                           "blocks_per_table": t}
    if problems:
        out["rbln_notes"] = [e for _, e in problems]
    if not out["safe"] and args.lanes * t > TRACE_LANE_BLOCKS:
        out["violated"] = None
        out["note"] = (f"no stuck run shown: the search covers lanes * T <= {TRACE_LANE_BLOCKS} "
                       f"(here {args.lanes * t}); the rule is proved and shown tight there")
    elif not out["safe"]:
        z3_or_exit()
        from atom_core.proofs.search import Budget, SearchBound, check_config_run
        from atom_core.spec.model import MODEL

        with search_progress(not args.json and sys.stderr.isatty()) as on_progress:
            budget = Budget(args.search_states, args.search_seconds, on_progress)
            try:
                tr = check_config_run(MODEL, args.lanes, args.kv_blocks, args.prefix_cache,
                                      args.scratch == "reserved",
                                      host=args.host_cache_blocks > 0, tables=t,
                                      preempt=args.preemption, budget=budget)
            except SearchBound as exc:
                tr = exc
        if isinstance(tr, SearchBound):  # the verdict is the rule's all the same
            out["violated"] = None
            out["search"] = {"stopped_by": tr.bound, "states": tr.states,
                             "seconds": round(tr.seconds, 1)}
            flag = "--search-states" if tr.bound == "states" else "--search-seconds"
            out["note"] = (f"no stuck run shown: the search for one was stopped by its "
                           f"{tr.bound} bound after {tr.states:,} states and {tr.seconds:.1f} s, "
                           f"before it was complete; {flag} raises the bound, and the verdict is "
                           "the proved rule's")
        elif tr is None:  # the rule says unsafe, so this is a bug in the proofs: say so loudly
            print("internal error: no stuck run found below the proved minimum", file=sys.stderr)
            return 3
        else:
            out["trace"] = [s.as_json() for s in tr.steps]
            out["violated"] = tr.violated
            out["stuck_state"] = tr.final
    if args.html is not None:
        from atom_core.viz import check_config_page

        bad = write_html(args, lambda: check_config_page(
            out, _stuck_run_consts(args, t) if out["trace"] else None), key="safe")
        if bad is not None:
            return bad
    if args.json:
        emit(out)
        return 0 if out["safe"] else 1
    what = f"lanes={args.lanes}, kv_blocks={args.kv_blocks}, " + features(
        args.prefix_cache, args.scratch) + (
        f", host cache of {args.host_cache_blocks} blocks" if args.host_cache_blocks else "") + (
        ", preemption" if args.preemption else "")
    _rbln_notes(problems)
    if out["safe"]:
        note = ("" if args.lanes <= capacity.PROVED_LANES else
                f" (the rule is proved for lanes <= {capacity.PROVED_LANES} by `atom-core verify`)")
        print(f"SAFE: {what} satisfies '{rule}' (needs {need}){note}")
        return 0
    if "note" in out:
        print(f"UNSAFE: {what} breaks '{rule}': needs {need}, {need - args.kv_blocks} missing "
              f"({out['note']})")
        return 1
    print(f"UNSAFE: {what} breaks '{rule}': needs {need}, "
          f"{need - args.kv_blocks} missing. A run into a stuck state (chunk 2, block size 8; "
          "the shape is the same at any size):")
    for s in out["trace"]:
        print(describe_step(s))
    st = out["stuck_state"]
    print(f"  state: lanes {st['lanes']}; blocks {st['blocks']}; waiting {st['waiting']}")
    print(f"  -> stuck: progress property '{out['violated']}' fails "
          "(an idle lane and a waiting request that no admission can serve, even by evicting)"
          if out["violated"] == "idle_lane_admits" else
          f"  -> stuck: progress property '{out['violated']}' fails")
    return 1


def _stuck_run_consts(args: argparse.Namespace, t: int) -> Any:
    """The core's constants check-config's stuck run was found at (`check_config_run`'s: the
    artifact's lanes, blocks and features at chunk 2, block size 8), to replay it for the
    picture (which checks that it ends in the reported stuck state)."""
    from atom_core._generated import core
    from atom_core.proofs.search import SEARCH_SLOTS, TRACE_CHUNK, TRACE_SEQ_LEN

    host = args.host_cache_blocks > 0
    return core.Consts(B=args.lanes, K=args.kv_blocks, C=TRACE_CHUNK, S=TRACE_SEQ_LEN, T=t,
                       PREFIX=args.prefix_cache, RESERVED=args.scratch == "reserved",
                       SCRATCH=0, HYBRID=False, HOST=host, H=SEARCH_SLOTS if host else 0,
                       PREEMPT=args.preemption)


def cmd_min_blocks(args: argparse.Namespace) -> int:
    if (bad := _artifact_args(args)) is not None:
        return bad
    t = _tables(args)
    need = min_kv_blocks(args.lanes, args.prefix_cache, args.scratch, t, args.preemption)
    cfg = _artifact_config(args, need)
    if isinstance(cfg, str):
        return _invalid(args, cfg, {"lanes": args.lanes})
    least, problems = _rbln_minimum(args, cfg, need)
    strict = _rbln_strict(args)
    if problems and strict:
        return _invalid(args, _rbln_refusal(problems), {"lanes": args.lanes})
    out: dict[str, Any] = {"lanes": args.lanes, "min_kv_blocks": least, "blocks_per_table": t,
                           "rule": rule_for(args.prefix_cache, args.scratch, t,
                                            args.preemption)}
    if strict:
        out["spec_min_kv_blocks"] = need
    if problems:
        out["rbln_notes"] = [e for _, e in problems]
    if args.html is not None:
        from atom_core.viz import capacity_page

        bad = write_html(args, lambda: capacity_page(out, args.prefix_cache, args.scratch,
                                                     args.preemption))
        if bad is not None:
            return bad
    if args.json:
        emit(out)
        return 0
    _rbln_notes(problems)
    raised = (f"; optimum-rbln 0.12.0 compiles no fewer than {least}" if least > need else "")
    print(f"lanes={args.lanes}, {features(args.prefix_cache, args.scratch)}: "
          f"kv_blocks >= {least} ({out['rule']}{raised})")
    return 0


def check_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a batcher trace: JSON lines, the first {\"consts\": ...}")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    html_argument(p, "the verdict and the trace as a picture of block ownership over its steps "
                     "(a refused step marked)")


def cmd_check_trace(args: argparse.Namespace) -> int:
    from atom_core.replay import read_lines, replay

    try:
        with open(args.file, "rb") as f:
            # (with --html, read once and kept: the file may be a pipe)
            lines: Any = list(read_lines(f)) if args.html is not None else read_lines(f)
            v = replay(lines)
    except OSError as exc:
        return fail(args, f"cannot read {args.file}: {exc.strerror}")
    if args.html is not None:
        from atom_core.viz import check_trace_page

        bad = write_html(args, lambda: check_trace_page(os.path.basename(args.file),
                                                        attrs.asdict(v), lines))
        if bad is not None:
            return bad
    if args.json:
        emit(attrs.asdict(v))
    elif v.ok:
        counts = ", ".join(f"{k} {n}" for k, n in sorted(v.counts.items()))
        print(f"OK: {v.steps} steps, every one allowed by the spec ({counts})")
    else:
        print(f"line {v.line}: {v.error} (after {v.steps} good steps)")
    return 0 if v.ok else 1
