"""`pd-demo`: a pd-prefill worker in a subprocess and a pd-decode worker here, over gloo on
loopback, then the same workload colocated; a comparison."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from atom_core.cli.common import emit, fail, free_port, table
from atom_core.cli.pd import (
    PD_KEY_ENV,
    UsageError,
    config_json,
    connect,
    pd_decode_arguments,
    pd_setup,
    run_pd_decode,
    workload_arguments,
)
from atom_core.options import Parser, count


def pd_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lanes", type=count, default=4, help="default: 4")
    workload_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _colocated(args: argparse.Namespace) -> dict[str, Any]:
    """The same workload on one batcher (the `atom-core demo` path), timed the same way."""
    from atom_core.batcher import AtomBatcher
    from atom_core.demo import MODEL_SEED, demo_config, oracle_for, workload
    from atom_core.pd.workers import quantile
    from atom_core.runtime.reference import TorchReferenceRuntime

    cfg = demo_config(args.lanes)
    rt = TorchReferenceRuntime.tiny(cfg, seed=MODEL_SEED)
    items = workload(args.requests, args.max_new_tokens, args.workload_seed, rt.vocab_size,
                     cfg.max_seq_len)
    b = AtomBatcher(cfg, rt)
    t0 = time.perf_counter()
    rids = [b.submit(it.prompt, it.max_new_tokens) for it in items]
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    while b.busy():
        for ev in b.step():
            now = time.perf_counter()
            if ev.kind == "token":
                first.setdefault(ev.request_id, now)
            elif ev.kind in ("finished", "error"):
                done[ev.request_id] = now
    wall = max(done.values()) - t0
    oracle = oracle_for(rt)
    exact = all(b.requests[r].error is None and b.requests[r].tokens
                == oracle.generate(it.prompt, it.max_new_tokens)
                for r, it in zip(rids, items, strict=True))
    return {"config": config_json(cfg), "wall_s": round(wall, 3),
            "tokens_per_s": round(b.stats.generated_tokens / wall, 1),
            "latency_median_s": quantile(sorted(t - t0 for t in done.values()), 0.5),
            "latency_p90_s": quantile(sorted(t - t0 for t in done.values()), 0.9),
            "ttft_median_s": quantile(sorted(t - t0 for t in first.values()), 0.5),
            "generated_tokens": b.stats.generated_tokens, "decode_steps": b.stats.decode_steps,
            "exact": exact}


def _pd_session(args: argparse.Namespace, prefetch: int) -> dict[str, Any]:
    """One PD run: pd-prefill in a subprocess, pd-decode here, over gloo on loopback."""
    import secrets
    import subprocess
    import tempfile

    from atom_core.demo import MODEL_SEED

    host, port = "127.0.0.1", free_port("127.0.0.1")
    key = secrets.token_hex(32)  # through the environment: argv is visible to other users
    shape = ["--lanes", str(args.lanes), "--max-seq-len", "256", "--prefill-chunk", "64",
             "--seed", str(MODEL_SEED), "--host", host, "--port", str(port),
             "--timeout", "30"]
    child_argv = [sys.executable, "-m", "atom_core.cli", "pd-prefill", *shape,
                  "--prefix-cache", "--key", f"env:{PD_KEY_ENV}", "--json"]
    decode_parser = Parser(prog="atom-core pd-decode")
    pd_decode_arguments(decode_parser)
    dec = decode_parser.parse_args([*shape, "--requests", str(args.requests),
                                    "--max-new-tokens", str(args.max_new_tokens),
                                    "--workload-seed", str(args.workload_seed), "--check",
                                    "--prefetch", str(prefetch)])
    dec.key = key  # in-process: a literal key is seen by no one
    # the decode side's settings first: a bad one is a usage error before any process starts
    cfg, rt, k = pd_setup(dec, decode=True)
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(child_argv, env={**os.environ, PD_KEY_ENV: key},
                                 stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            out = run_pd_decode(dec, cfg, rt, k, connect(dec, 0, cfg, rt, k))
            child_out, _ = child.communicate(timeout=30)
        except BaseException:
            child.kill()
            child.wait()
            err.seek(0)
            if text := err.read().strip():
                print(f"prefill worker stderr:\n{text}", file=sys.stderr)
            raise
    lines = child_out.strip().splitlines()
    out["prefill_worker"] = json.loads(lines[-1]) if lines else {}
    out["prefill_exit_code"] = child.returncode
    return out


def cmd_pd_demo(args: argparse.Namespace) -> int:
    """The workload over PD (on-demand and prefetching), then colocated; a comparison."""
    import subprocess

    from atom_core.pd.transport import TransportError

    try:
        runs = {"pd_on_demand": _pd_session(args, prefetch=0),
                "pd_prefetch": _pd_session(args, prefetch=args.lanes)}
    except UsageError as exc:  # refused before any worker started
        return fail(args, f"pd-demo: {exc}", 2)
    except (TransportError, OSError, subprocess.TimeoutExpired) as exc:
        return fail(args, f"pd-demo failed: {exc}", 1)
    runs["colocated"] = _colocated(args)
    if args.json:
        emit(runs)
    else:
        _pd_demo_table(runs)
    ok = all(r["exact"] for r in runs.values()) and all(
        runs[m]["prefill_exit_code"] == 0 for m in ("pd_on_demand", "pd_prefetch"))
    return 0 if ok else 1


def _pd_demo_table(runs: dict[str, dict[str, Any]]) -> None:
    def row(label: str, key: str, unit: str = "") -> list[str]:
        return [label, *("-" if r.get(key) is None else f"{r[key]}{unit}"
                         for r in runs.values())]

    rows = [
        row("end-to-end wall time", "wall_s", " s"),
        row("tokens/s", "tokens_per_s"),
        row("latency median", "latency_median_s", " s"),
        row("latency p90", "latency_p90_s", " s"),
        row("time to first token, median", "ttft_median_s", " s"),
        ["bytes transferred", *(str(r.get("bytes_received", 0) + r.get("bytes_sent", 0))
                                for r in runs.values())],
        ["decode steps (overlapped with transfers)",
         *(f"{r['decode_steps']} ({r['decode_steps_overlapped']})"
           if "decode_steps_overlapped" in r else str(r["decode_steps"])
           for r in runs.values())],
        ["token-exact vs oracle", *("yes" if r["exact"] else "NO" for r in runs.values())],
    ]
    table("atom-core pd-demo: PD over gloo (2 processes, loopback) vs colocated",
           ["", "PD, KV on admission", f"PD, prefetch {runs['pd_prefetch']['prefetch']}",
            "colocated"], rows)
