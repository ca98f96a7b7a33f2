"""Runs on the torch reference runtime (or HFRuntime): `demo` (a built-in workload, checked
against the oracle) and `simulate` (seeded runs under injected faults)."""

from __future__ import annotations

import argparse
import io
import json

from atom_core import options as opt
from atom_core.cli.common import emit, fail, html_argument, write_html
from atom_core.config import SCRATCH_MODES

# simulate: ticks past this are a typo (the workload is drawn for every tick up front)
MAX_STEPS = 1_000_000


def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lanes", type=opt.count, default=4, help="default: 4")
    p.add_argument("--requests", type=opt.integer(1, opt.MAX_REQUESTS), default=24,
                   help="default: 24")
    p.add_argument("--max-new-tokens", type=opt.integer(1, opt.MAX_NEW_TOKENS), default=16,
                   help="default: 16")
    p.add_argument("--seed", type=opt.seed, default=0, help="seed of the workload (default: 0)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--scratch", choices=SCRATCH_MODES, default="dynamic",
                   help="reserved: a fixed scratch block; dynamic: padding rows write into a "
                        "free block (default: dynamic)")
    p.add_argument("--runtime", choices=("reference", "hf"), default="reference",
                   help="hf: a transformers model (--model) checked against its own generate() "
                        "(default: reference)")
    p.add_argument("--model", default=None, metavar="DIR|tiny-llama|tiny-gemma3",
                   help="hf: a local checkpoint directory, or tiny-llama / tiny-gemma3 (seeded "
                        "random weights, saved to a temporary directory and loaded back; "
                        "default with --runtime hf: tiny-llama)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout (no progress bar)")
    html_argument(p, "the summary and the run as a picture of block ownership over the "
                     "batcher's steps")


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        from atom_core.demo import print_summary, run_demo
    except ImportError as exc:  # torch is an extra
        return fail(args, f"the demo needs torch: pip install 'atom-core[torch]' ({exc})")
    trace = io.StringIO() if args.html is not None else None
    try:
        out = run_demo(lanes=args.lanes, requests=args.requests,
                       max_new_tokens=args.max_new_tokens, seed=args.seed,
                       prefix_cache=not args.no_prefix_cache, scratch=args.scratch,
                       progress=not args.json, runtime=args.runtime, model=args.model,
                       trace=trace)
    except ImportError as exc:  # transformers is an extra
        return fail(args, f"--runtime hf needs transformers: pip install 'atom-core[hf]' "
                          f"({exc})")
    except ValueError as exc:  # a bad --model (not a directory, an unsupported model)
        return fail(args, f"demo: {exc}")
    if trace is not None:
        from atom_core.viz import demo_page

        bad = write_html(args, lambda: demo_page(out, trace.getvalue().splitlines()))
        if bad is not None:
            return bad
    if args.json:
        emit(out)
    else:
        print_summary(out)
    return 0 if out["exact"] else 1


def simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=opt.seed, default=0,
                   help="picks the configuration, the workload and the faults (deep mode: "
                        "the first seed; default: 0)")
    p.add_argument("--steps", type=opt.integer(0, MAX_STEPS), default=200,
                   help="ticks with fault injection before the drain (default 200)")
    p.add_argument("--faults", default=None,
                   help="comma-separated fault kinds (prefill, decode, copy, fetch, update, "
                        "alloc, delay, drop, corrupt, duplicate, late, kill, abort; cluster: "
                        "worker_kill, worker_start, worker_ready), all "
                        "(default) or none")
    p.add_argument("--mode", choices=("colocated", "pd", "cluster"), default=None,
                   help="fix the serving mode (default: the seed picks colocated or pd; "
                        "cluster: prefill and decode workers behind the router, with worker "
                        "kills, restarts and late joins)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="fix the prefix cache on or off (default: the seed picks)")
    p.add_argument("--scratch", choices=SCRATCH_MODES, default=None,
                   help="fix the scratch discipline (default: the seed picks)")
    p.add_argument("--sliding-window", default=None, metavar="W|none",
                   help="fix the hybrid model's window, or none for a plain model")
    p.add_argument("--lanes", type=opt.count, default=None)
    p.add_argument("--runtime", choices=("reference", "hf"), default=None,
                   help="hf: the same shapes as a transformers model (tiny-llama, or "
                        "tiny-gemma3 with the seed's window) on HFRuntime, every finished "
                        "request checked against transformers' generate() (default: "
                        "reference)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="fix any configuration dimension (e.g. prefetch=2, "
                        "fallback_local=false, host_cache_blocks=2); repeatable")
    deep = p.add_mutually_exclusive_group()
    deep.add_argument("--minutes", type=opt.seconds(unit="minutes", scale=60), default=None,
                      help="deep mode: consecutive seeds from --seed until the time is up; "
                           "stops at the first failing seed")
    deep.add_argument("--seeds", type=_seed_range, default=None, metavar="A..B",
                      help="deep mode over the seeds A..B (inclusive)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    html_argument(p, "the report and the seed's run as a picture of block ownership over each "
                     "batcher's steps, faults and failed checks marked (one seed: not with "
                     "--seeds or --minutes; colocated and pd runs)")


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        from atom_core import simulate
    except ImportError as exc:  # torch is an extra
        return fail(args, f"simulate needs torch: pip install 'atom-core[torch]' ({exc})")
    try:
        faults = simulate.parse_faults(args.faults)
        fixed = simulate.parse_fixed(args.set)
        if args.mode is not None:
            fixed["mode"] = args.mode
        if args.prefix_cache is not None:
            fixed["prefix_cache"] = args.prefix_cache
        if args.scratch is not None:
            fixed["scratch"] = args.scratch
        if args.sliding_window is not None:
            fixed.update(simulate.parse_fixed([f"sliding_window={args.sliding_window}"]))
        if args.lanes is not None:
            fixed["lanes"] = args.lanes
        if args.runtime is not None:
            fixed["runtime"] = args.runtime
        if fixed.get("runtime") == "hf":
            try:
                import atom_core.runtime.hf  # noqa: F401
            except ImportError as exc:  # transformers is an extra
                return fail(args, f"--runtime hf needs transformers: pip install "
                                  f"'atom-core[hf]' ({exc})")
        cfg = simulate.draw_config(args.seed, fixed)  # a bad combination: a usage error, now
        if args.html is not None and (args.minutes is not None or args.seeds is not None
                                      or cfg.cluster):
            raise simulate.UsageError("--html draws one seed's colocated or pd run: not with "
                                      "--seeds, --minutes or --mode cluster")
        if args.minutes is None and args.seeds is None:
            report = simulate.run(args.seed, args.steps, faults, shrink=True, **fixed)
            if args.html is not None:
                from atom_core.simulate.traced import timelines
                from atom_core.viz import simulate_page

                bad = write_html(args, lambda: simulate_page(report.as_json(),
                                                             timelines(report)))
                if bad is not None:
                    return bad
            print(json.dumps(report.as_json()) if args.json else simulate.render(report))
            return 0 if report.ok else 1
        first, last = args.seeds if args.seeds is not None else (args.seed, None)
        result = simulate.sweep_with_progress(
            first, args.steps, last_seed=last, faults=faults, show=not args.json,
            seconds=None if args.minutes is None else args.minutes * 60, **fixed)
    except simulate.UsageError as exc:
        return fail(args, f"atom-core simulate: error: {exc}")
    if args.json:
        emit(result.as_json())
    elif result.failing is None:
        print(f"OK: seeds {first}..{first + result.seeds_run - 1} ({result.seeds_run} seeds, "
              f"{result.ticks} ticks, {result.seconds:.0f} s)")
    else:
        print(simulate.render(result.failing))
    return 0 if result.ok else 1


def _seed_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("..")
    try:
        lo, hi = int(first), int(last) if sep else int(first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A..B (e.g. 0..99), got {text!r}") from None
    if hi < lo:
        raise argparse.ArgumentTypeError(f"empty seed range {text!r}")
    if lo < 0 or hi > opt.MAX_SEED:
        raise argparse.ArgumentTypeError(f"seeds must be in 0..{opt.MAX_SEED}, got {text!r}")
    return lo, hi
