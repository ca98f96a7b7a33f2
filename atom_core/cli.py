"""`atom-core`: prove the model, and check an artifact's configuration before deploying it."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

import attrs

from atom_core._generated import capacity
from atom_core.config import SCRATCH_MODES, features, min_kv_blocks, rule_for

NEEDS_VERIFY = "this command needs z3: pip install 'atom-core[verify]'"


def _z3_or_exit() -> None:
    try:
        import z3  # noqa: F401
    except ImportError:
        print(NEEDS_VERIFY, file=sys.stderr)
        raise SystemExit(2) from None


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, indent=None, sort_keys=False))


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with the verify extra; plain text otherwise
        print(title)
        print("  ".join(columns))
        for r in rows:
            print("  ".join(r))
        return
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*r)
    Console().print(t)


# --------------------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace) -> int:
    _z3_or_exit()
    from atom_core.proofs.run import verify
    from atom_core.spec.model import MODEL

    report = verify(MODEL, args.max_lanes, args.max_blocks)
    if args.json:
        _emit(report.as_json())
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
    _table("atom-core verify: invariant x action", ["invariant", "action", "kind", "status",
                                                     "queries", "seconds", "max"], rows)
    cap = []
    for r in report.rows:
        mins = ", ".join(f"B={b}: {k}" for b, k in r.minimum.items())
        tight = all(t is not None for t in r.traces.values())
        cap.append([r.features.name, r.rule, mins, "yes" if tight else "NO"])
    _table("capacity (proved sufficient; tight = stuck run one block below)",
           ["features", "rule", "minimum kv_blocks", "tight"], cap)
    n_bad = sum(1 for c in report.checks if c.status != "proved")
    print(f"{len(report.checks)} checks, {n_bad} not proved, {report.seconds:.1f} s: "
          + ("OK" if report.ok else "FAILED"))
    return 0 if report.ok else 1


# --------------------------------------------------------------------------- check-config
def describe_step(step: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={_short(v)}" for k, v in step["args"].items())
    return f"{step['step']:>3}. {step['action']}({args})"


def _short(v: Any) -> str:
    if isinstance(v, list) and len(v) > 12:
        return f"[{', '.join(map(str, v[:6]))}, ... {len(v)} items]"
    return str(v)


def cmd_check_config(args: argparse.Namespace) -> int:
    need = min_kv_blocks(args.lanes, args.prefix_cache, args.scratch)
    rule = rule_for(args.prefix_cache, args.scratch)
    out: dict[str, Any] = {"safe": args.kv_blocks >= need, "rule": rule, "trace": [],
                           "lanes": args.lanes, "kv_blocks": args.kv_blocks,
                           "min_kv_blocks": need, "proved_lanes": capacity.PROVED_LANES}
    if not out["safe"]:
        _z3_or_exit()
        from atom_core.proofs.search import stuck_run
        from atom_core.spec.model import MODEL

        tr = stuck_run(MODEL, args.lanes, args.kv_blocks, args.prefix_cache,
                       args.scratch == "reserved")
        if tr is None:  # the rule says unsafe, so this is a bug in the proofs: say so loudly
            print("internal error: no stuck run found below the proved minimum", file=sys.stderr)
            return 3
        out["trace"] = [s.as_json() for s in tr.steps]
        out["violated"] = tr.violated
        out["stuck_state"] = tr.final
    if args.json:
        _emit(out)
        return 0 if out["safe"] else 1
    what = f"lanes={args.lanes}, kv_blocks={args.kv_blocks}, " + features(
        args.prefix_cache, args.scratch)
    if out["safe"]:
        note = ("" if args.lanes <= capacity.PROVED_LANES else
                f" (the rule is proved for lanes <= {capacity.PROVED_LANES} by `atom-core verify`)")
        print(f"SAFE: {what} satisfies '{rule}' (needs {need}){note}")
        return 0
    print(f"UNSAFE: {what} breaks '{rule}': needs {need}, "
          f"{need - args.kv_blocks} missing. A run into a stuck state (chunk 2, max_seq_len 8; "
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


def cmd_min_blocks(args: argparse.Namespace) -> int:
    need = min_kv_blocks(args.lanes, args.prefix_cache, args.scratch)
    out = {"lanes": args.lanes, "min_kv_blocks": need,
           "rule": rule_for(args.prefix_cache, args.scratch)}
    if args.json:
        _emit(out)
    else:
        print(f"lanes={args.lanes}, {features(args.prefix_cache, args.scratch)}: "
              f"kv_blocks >= {need} ({out['rule']})")
    return 0


def cmd_check_trace(args: argparse.Namespace) -> int:
    from atom_core.replay import replay

    try:
        with open(args.file) as f:
            v = replay(f)
    except OSError as exc:
        print(f"cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    if args.json:
        _emit(attrs.asdict(v))
    elif v.ok:
        counts = ", ".join(f"{k} {n}" for k, n in sorted(v.counts.items()))
        print(f"OK: {v.steps} steps, every one allowed by the spec ({counts})")
    else:
        print(f"line {v.line}: {v.error} (after {v.steps} good steps)")
    return 0 if v.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        from atom_core.demo import print_summary, run_demo
    except ImportError as exc:  # torch is an extra
        print(f"the demo needs torch: pip install 'atom-core[torch]' ({exc})", file=sys.stderr)
        return 2
    out = run_demo(lanes=args.lanes, requests=args.requests,
                   max_new_tokens=args.max_new_tokens, seed=args.seed,
                   prefix_cache=not args.no_prefix_cache, scratch=args.scratch,
                   progress=not args.json)
    if args.json:
        _emit(out)
    else:
        print_summary(out)
    return 0 if out["exact"] else 1


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="atom-core", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="prove every invariant, progress property and capacity rule")
    v.add_argument("--json", action="store_true", help="one JSON object on stdout")
    v.add_argument("--max-lanes", type=_positive, default=4, help="cutoff for bounded proofs")
    v.add_argument("--max-blocks", type=_positive, default=8, help="cutoff for bounded proofs")
    v.set_defaults(fn=cmd_verify)

    t = sub.add_parser("check-trace", help="replay a batcher trace (JSONL) through the spec")
    t.add_argument("file")
    t.add_argument("--json", action="store_true", help="one JSON object on stdout")
    t.set_defaults(fn=cmd_check_trace)

    d = sub.add_parser("demo", help="serve a built-in workload on the torch reference runtime "
                                     "and check every token against the oracle")
    d.add_argument("--lanes", type=_positive, default=4)
    d.add_argument("--requests", type=_positive, default=24)
    d.add_argument("--max-new-tokens", type=_positive, default=16)
    d.add_argument("--seed", type=int, default=0, help="seed of the workload")
    d.add_argument("--no-prefix-cache", action="store_true")
    d.add_argument("--scratch", choices=SCRATCH_MODES, default="dynamic",
                   help="reserved: a fixed scratch block; dynamic: padding rows write into a "
                        "free block (default)")
    d.add_argument("--json", action="store_true",
                   help="one JSON object on stdout (no progress bar)")
    d.set_defaults(fn=cmd_demo)

    for name, fn, help_ in (
            ("check-config", cmd_check_config, "is this configuration safe? if not, show why"),
            ("min-blocks", cmd_min_blocks, "the fewest KV blocks for a lane count")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--lanes", type=_positive, required=True)
        if name == "check-config":
            p.add_argument("--kv-blocks", type=_positive, required=True)
        p.add_argument("--prefix-cache", action="store_true")
        p.add_argument("--scratch", choices=SCRATCH_MODES, default="dynamic",
                       help="reserved: a fixed scratch block; dynamic: padding rows write into a "
                            "free block (default)")
        p.add_argument("--json", action="store_true", help="one JSON object on stdout")
        p.set_defaults(fn=fn)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
