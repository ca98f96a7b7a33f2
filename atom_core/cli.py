"""`atom-core`: prove the model, and check an artifact's configuration before deploying it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from atom_core._generated import capacity
from atom_core.config import SCRATCH_MODES, Config, ConfigError, features, min_kv_blocks, rule_for

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
@contextlib.contextmanager
def _task_progress(show: bool) -> Iterator[Callable[[str, int, int], None] | None]:
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


def cmd_verify(args: argparse.Namespace) -> int:
    _z3_or_exit()
    from atom_core.proofs.run import DEEP_BLOCKS, DEEP_LANES, verify
    from atom_core.spec.model import MODEL

    lanes = args.max_lanes or (DEEP_LANES if args.deep else 4)
    blocks = args.max_blocks or (DEEP_BLOCKS if args.deep else 8)
    show = not (args.json or args.quiet) and sys.stderr.isatty()
    with _task_progress(show) as on_task:
        report = verify(MODEL, lanes, blocks, jobs=args.jobs, on_task=on_task)
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
    _table("capacity (proved sufficient; tight = stuck run one block below)",
           ["features", "rule", "minimum kv_blocks", "tight"], cap)
    sb = [[case.name, f"B={case.lanes}, K=1", "on" if case.prefix_cache else "off", case.role,
           "no stuck state" if tr is None else
           f"stuck ({tr.violated}): " + "; ".join(
               describe_step(st.as_json()).strip() for st in tr.steps)]
          for case, tr in report.single_block]
    _table("single-block mode (block 0 serves the only lane)",
           ["case", "size", "prefix cache", "role", "result"], sb)
    _table(f"where the time went ({report.jobs} jobs)",
           ["kind", "tasks", "CPU seconds"],
           [[k, str(report.tasks.get(k, "")), f"{v:.1f}"] for k, v in report.cpu.items()])
    if report.stale:
        print("stale witnesses (run `make generate`): " + "; ".join(report.stale))
    n_bad = sum(1 for c in report.checks if c.status != "proved")
    print(f"{len(report.checks)} checks, {n_bad} not proved, {report.seconds:.1f} s wall, "
          f"{sum(report.cpu.values()):.1f} s CPU: "
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


def _artifact_error(args: argparse.Namespace, kv_blocks: int) -> str | None:
    """What is wrong with the artifact's settings other than its number of KV blocks (checked
    with `kv_blocks` blocks, at least the rule's minimum), or None."""
    try:
        Config(lanes=args.lanes, kv_blocks=kv_blocks, max_seq_len=args.max_seq_len,
               block_size=args.block_size if args.block_size is not None else args.max_seq_len,
               prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache,
               scratch=args.scratch, host_cache_blocks=args.host_cache_blocks,
               preemption=args.preemption)
    except ConfigError as exc:
        return str(exc)
    return None


def _invalid(args: argparse.Namespace, error: str, out: dict[str, Any]) -> int:
    if args.json:
        _emit({**out, "safe": False, "error": error})
    else:
        print(f"INVALID: {error}", file=sys.stderr)
    return 1 if "safe" in out else 2


def _tables(args: argparse.Namespace) -> int:
    """T, the blocks per lane's table (a block size that does not divide max_seq_len is
    reported by `_artifact_error`)."""
    block = args.block_size if args.block_size is not None else args.max_seq_len
    return max(1, args.max_seq_len // block)


# check-config searches for the stuck run at the artifact's size; with paged tables the search
# grows with lanes * T, so above this it reports the rule without a run.
TRACE_LANE_BLOCKS = 8


# flag -> (Config field, default without --rbln-config)
_ARTIFACT_FLAGS = {"lanes": ("lanes", None), "kv_blocks": ("kv_blocks", None),
                   "max_seq_len": ("max_seq_len", 4096), "block_size": ("block_size", None),
                   "prefill_chunk": ("prefill_chunk", 128),
                   "prefix_cache": ("prefix_cache", False)}


def _artifact_args(args: argparse.Namespace) -> int | None:
    """Fill the artifact's settings from --rbln-config where no flag gave them, then the
    defaults; 2 (a usage error, printed) when something required is missing."""
    fields: dict[str, Any] = {}
    if args.rbln_config is not None:
        from atom_core.config import rbln_fields

        try:
            fields = rbln_fields(args.rbln_config)
        except ConfigError as exc:
            print(f"INVALID: {exc}", file=sys.stderr)
            return 2
    for flag, (field, default) in _ARTIFACT_FLAGS.items():
        if hasattr(args, flag) and getattr(args, flag) is None:
            setattr(args, flag, fields.get(field, default))
    missing = [f"--{flag.replace('_', '-')}" for flag in ("lanes", "kv_blocks")
               if hasattr(args, flag) and getattr(args, flag) is None]
    if missing:
        print(f"{args.command}: {' and '.join(missing)} required (or --rbln-config PATH with "
              "batch_size and kvcache_num_blocks)", file=sys.stderr)
        raise SystemExit(2)  # a usage error, as argparse's own
    return None


def cmd_check_config(args: argparse.Namespace) -> int:
    if (bad := _artifact_args(args)) is not None:
        return bad
    t = _tables(args)
    need = min_kv_blocks(args.lanes, args.prefix_cache, args.scratch, t, args.preemption)
    rule = rule_for(args.prefix_cache, args.scratch, t, args.preemption)
    error = _artifact_error(args, max(need, args.kv_blocks))
    if error is not None:
        return _invalid(args, error, {"safe": False, "lanes": args.lanes,
                                      "kv_blocks": args.kv_blocks})
    out: dict[str, Any] = {"safe": args.kv_blocks >= need, "rule": rule, "trace": [],
                           "lanes": args.lanes, "kv_blocks": args.kv_blocks,
                           "min_kv_blocks": need, "proved_lanes": capacity.PROVED_LANES,
                           "blocks_per_table": t}
    if not out["safe"] and args.lanes * t > TRACE_LANE_BLOCKS:
        out["violated"] = None
        out["note"] = (f"no stuck run shown: the search covers lanes * T <= {TRACE_LANE_BLOCKS} "
                       f"(here {args.lanes * t}); the rule is proved and shown tight there")
    elif not out["safe"]:
        _z3_or_exit()
        from atom_core.proofs.search import stuck_run
        from atom_core.spec.model import MODEL

        tr = stuck_run(MODEL, args.lanes, args.kv_blocks, args.prefix_cache,
                       args.scratch == "reserved", host=args.host_cache_blocks > 0, tables=t,
                       preempt=args.preemption)
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
        args.prefix_cache, args.scratch) + (
        f", host cache of {args.host_cache_blocks} blocks" if args.host_cache_blocks else "") + (
        ", preemption" if args.preemption else "")
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


def cmd_min_blocks(args: argparse.Namespace) -> int:
    if (bad := _artifact_args(args)) is not None:
        return bad
    t = _tables(args)
    need = min_kv_blocks(args.lanes, args.prefix_cache, args.scratch, t, args.preemption)
    error = _artifact_error(args, need)
    if error is not None:
        return _invalid(args, error, {"lanes": args.lanes})
    out = {"lanes": args.lanes, "min_kv_blocks": need, "blocks_per_table": t,
           "rule": rule_for(args.prefix_cache, args.scratch, t, args.preemption)}
    if args.json:
        _emit(out)
    else:
        print(f"lanes={args.lanes}, {features(args.prefix_cache, args.scratch)}: "
              f"kv_blocks >= {need} ({out['rule']})")
    return 0


def cmd_check_trace(args: argparse.Namespace) -> int:
    from atom_core.replay import read_lines, replay

    try:
        with open(args.file, "rb") as f:
            v = replay(read_lines(f))
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
    try:
        out = run_demo(lanes=args.lanes, requests=args.requests,
                       max_new_tokens=args.max_new_tokens, seed=args.seed,
                       prefix_cache=not args.no_prefix_cache, scratch=args.scratch,
                       progress=not args.json, runtime=args.runtime, model=args.model)
    except ImportError as exc:  # transformers is an extra
        print(f"--runtime hf needs transformers: pip install 'atom-core[hf]' ({exc})",
              file=sys.stderr)
        return 2
    except ValueError as exc:  # a bad --model (not a directory, an unsupported model)
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _emit(out)
    else:
        print_summary(out)
    return 0 if out["exact"] else 1


# --------------------------------------------------------------------------- PD workers
PD_KEY_ENV = "ATOM_CORE_PD_KEY"


class _Usage(Exception):
    """A bad option or configuration: printed, exit 2."""


def _hf() -> Any:
    """atom_core.runtime.hf, or a usage error naming the extra."""
    try:
        from atom_core.runtime import hf
    except ImportError as exc:  # transformers is an extra
        raise _Usage(f"--runtime hf needs transformers: pip install 'atom-core[hf]' ({exc})"
                     ) from None
    return hf


def _pd_model_window(args: argparse.Namespace) -> int | None:
    """--runtime hf: the model's sliding window (a Gemma3 model's batcher needs it), else None;
    checks that --model goes with --runtime hf."""
    if args.runtime != "hf":
        if args.model is not None:
            raise _Usage("--model is for --runtime hf (the reference model is built in; rbln "
                         "takes --compiled)")
        return None
    if args.model is None:
        raise _Usage("--runtime hf needs --model DIR|tiny-llama|tiny-gemma3 (a local "
                     "checkpoint directory, or a seeded tiny model)")
    try:
        return _hf().model_window(args.model)
    except (OSError, ValueError) as exc:
        raise _Usage(f"cannot read the config of {args.model}: {exc}") from None


def _pd_config(args: argparse.Namespace, decode: bool) -> Any:
    from atom_core.config import Config, ConfigError

    window = _pd_model_window(args)
    block = args.block_size if args.block_size is not None else args.max_seq_len
    kv = args.kv_blocks
    if kv is None:
        # (a block size that does not divide max_seq_len: Config says so below)
        kv = min_kv_blocks(args.lanes, args.prefix_cache, args.scratch,
                           max(1, args.max_seq_len // block))
        if decode and args.scratch == "dynamic":
            # At the minimum every block can be held by a lane, importing ones included, so
            # padding rows have nowhere to write and decode stalls until the imports land.
            kv += 1
    try:
        return Config(lanes=args.lanes, kv_blocks=kv, max_seq_len=args.max_seq_len,
                      block_size=block, prefill_chunk=args.prefill_chunk,
                      prefix_cache=args.prefix_cache, scratch=args.scratch,
                      sliding_window=window)
    except ConfigError as exc:
        raise _Usage(f"invalid configuration: {exc}") from None


def _pd_key(args: argparse.Namespace) -> bytes | None:
    from atom_core import pd

    if args.key == "":
        raise _Usage("--key is empty: give a key of at least 16 bytes (literal, env:NAME or "
                     f"file:PATH), or leave --key out and set ${PD_KEY_ENV}")
    value = args.key if args.key is not None else (
        f"env:{PD_KEY_ENV}" if os.environ.get(PD_KEY_ENV) else None)
    try:
        key = pd.load_key(value)
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    if key is None and not args.insecure:
        raise _Usage(f"no PD key: pass --key (env:NAME or file:PATH) or set ${PD_KEY_ENV} on "
                     "both workers; without one anyone who reaches the port, loopback included "
                     "(any local user), can read prompts and KV or inject KV. --insecure runs "
                     "without authentication")
    if key is not None and args.insecure:
        raise _Usage("--insecure and a PD key exclude each other: drop one")
    if key is None:
        print(f"warning: --insecure: the PD link with {args.host} is neither authenticated nor "
              "encrypted", file=sys.stderr)
    return key


def _pd_options(args: argparse.Namespace, decode: bool) -> None:
    """Option values argparse cannot check by type, before anything connects."""
    import math

    checks = [("--timeout", args.timeout)]
    if decode:
        checks.append(("--transfer-timeout", args.transfer_timeout))
    for flag, v in checks:
        if not math.isfinite(v) or v <= 0:
            raise _Usage(f"{flag} must be finite positive seconds, got {v:g}")
    if decode and args.prefetch is not None and args.prefetch < 0:
        raise _Usage(f"--prefetch must be >= 0 (0: ask for KV only once a lane waits), got "
                     f"{args.prefetch}")
    if args.runtime == "rbln":
        # the RBLN host buffer is a flat aligned byte buffer; the KV payload ships the
        # [layers, 2, kv_heads, positions, head_dim] layout, which it does not expose
        raise _Usage("PD does not support --runtime rbln yet: its host KV buffer is a flat "
                     "aligned buffer, not the [layers, 2, kv_heads, block_size, head_dim] "
                     "layout a KV payload ships; run PD on --runtime reference, or serve an "
                     "RBLN model colocated")


def _pd_runtime(args: argparse.Namespace, cfg: Any) -> Any:
    from atom_core.batcher import check_runtime

    if args.runtime == "reference":
        from atom_core.runtime.reference import TorchReferenceRuntime

        return TorchReferenceRuntime.tiny(cfg, seed=args.seed)
    if args.runtime == "hf":
        return _pd_hf_runtime(args, cfg)
    if not args.compiled:
        raise _Usage("--runtime rbln needs --compiled PATH (an optimum-rbln compiled decoder "
                     "directory)")
    from atom_core.runtime.rbln import RblnRuntime, RblnUnavailableError

    try:
        rt = RblnRuntime.from_compiled(args.compiled, fingerprint=args.fingerprint)
    except RblnUnavailableError as exc:
        raise _Usage(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise _Usage(f"cannot load {args.compiled}: {exc}") from None
    try:  # before connecting: a mismatch found after the rendezvous would strand the peer
        check_runtime(cfg, rt)
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    return rt


def _pd_hf_runtime(args: argparse.Namespace, cfg: Any) -> Any:
    """HFRuntime of --model in float64 (as `atom-core demo --runtime hf`: its tokens are
    checked against transformers' generate, and float64 keeps the two paths' rounding far
    below any logit gap); both workers must load the same model, or the decode worker refuses
    the KV (the fingerprint covers the config, the weights and the dtype)."""
    import torch

    from atom_core.batcher import check_runtime

    hf = _hf()
    try:
        rt = (hf.tiny_runtime(args.model, cfg, seed=args.seed, dtype=torch.float64)
              if args.model in hf.TINY_MODELS else
              hf.HFRuntime.from_pretrained(args.model, cfg, dtype=torch.float64))
        check_runtime(cfg, rt)  # before connecting, as for rbln
    except (OSError, ValueError) as exc:  # UnsupportedModelError is a ValueError
        raise _Usage(f"cannot serve {args.model}: {exc}") from None
    return rt


def _pd_oracle(args: argparse.Namespace, rt: Any) -> Any:
    """The runtime's oracle: the reference model's cache-free generate, or for --runtime hf
    transformers' own greedy generate() of the same weights."""
    if args.runtime == "hf":
        return _hf().GenerateOracle(rt)
    from atom_core.demo import oracle_for

    return oracle_for(rt)


def _pd_setup(args: argparse.Namespace, decode: bool) -> tuple[Any, Any, bytes | None]:
    cfg = _pd_config(args, decode)
    _pd_options(args, decode)
    key = _pd_key(args)
    if decode and args.check and args.runtime not in ("reference", "hf"):
        raise _Usage("--check needs an oracle: the reference runtime's or, for --runtime hf, "
                     "transformers' generate(); an RBLN model has none here, pass --no-check")
    return cfg, _pd_runtime(args, cfg), key


def _connect(args: argparse.Namespace, rank: int, cfg: Any, rt: Any,
             key: bytes | None) -> Any:
    """The worker's transport: gloo with this config's frame limits, and with a key a
    SecureLink whose handshake has completed (LinkError, a TransportError, if the peer
    fails it)."""
    from atom_core.transport import GlooTransport

    role = "decode worker: waiting for the prefill worker on" if rank == 0 else \
        "prefill worker: connecting to the decode worker at"
    print(f"{role} {args.host}:{args.port}", file=sys.stderr, flush=True)
    limits = _wire_limits(cfg, rt)
    transport = GlooTransport(rank, host=args.host, port=args.port, timeout=args.timeout,
                              **limits)
    if key is None:
        return transport
    from atom_core.pdlink import LinkError, SecureLink

    # the key handshake, before either worker handles anything
    link = SecureLink(transport, key, "decode" if rank == 0 else "prefill",
                      max_box_bytes=limits["max_tensor_bytes"])
    try:
        link.establish(args.timeout)
    except LinkError as exc:
        link.close()
        raise LinkError(f"PD link refused: {exc}") from None
    return link


def _wire_limits(cfg: Any, rt: Any) -> dict[str, int]:
    """The transport's frame limits from this worker's config (`pd.frame_limits`), room for a
    sealed box's overhead included."""
    from atom_core import pd
    from atom_core.pdlink import box_limit

    lim = pd.frame_limits(cfg, rt)
    return {"max_header_bytes": lim.header_bytes,
            "max_tensor_bytes": box_limit(lim.header_bytes, lim.tensor_bytes)}


def _pd_start(args: argparse.Namespace, decode: bool) -> tuple[Any, ...] | int:
    """(config, runtime, key, transport), or the exit code: 2 for a bad setting (before any
    connection is tried), 1 when the peer cannot be reached."""
    from atom_core.transport import TransportError

    try:
        cfg, rt, key = _pd_setup(args, decode=decode)
        return cfg, rt, key, _connect(args, 0 if decode else 1, cfg, rt, key)
    except _Usage as exc:
        print(exc, file=sys.stderr)
        return 2
    except TransportError as exc:
        print(exc, file=sys.stderr)
        return 1


def cmd_pd_prefill(args: argparse.Namespace) -> int:
    from atom_core.workers import PrefillWorker

    started = _pd_start(args, decode=False)
    if isinstance(started, int):
        return started
    cfg, rt, key, transport = started
    with transport:
        worker = PrefillWorker(cfg, rt, transport, key=key, insecure=args.insecure)
        worker.serve()
    out = {**attrs.asdict(worker.stats), "ended_by": worker.ended_by,
           **{k: transport.stats[k] for k in ("bytes_sent", "bytes_received")}}
    if args.json:
        _emit(out)
    else:
        print(f"prefill worker: {out['exports']} exports, {out['failures']} failures, "
              f"{out['bytes_sent']} bytes sent; ended by {out['ended_by']}", file=sys.stderr)
    return 0 if worker.ended_by == "shutdown" else 1


def run_pd_decode(args: argparse.Namespace, cfg: Any, rt: Any, key: bytes | None,
                  transport: Any) -> dict[str, Any]:
    """Serve the demo workload through a DecodeWorker on `transport`; its summary, checked
    against the oracle when `args.check`."""
    from atom_core.demo import workload
    from atom_core.workers import DecodeWorker

    items = workload(args.requests, args.max_new_tokens, args.workload_seed, rt.vocab_size,
                     cfg.max_seq_len)
    prefetch = cfg.lanes if args.prefetch is None else args.prefetch
    with DecodeWorker(cfg, rt, transport, key=key, insecure=key is None,
                      fallback_local=args.fallback_local,
                      transfer_timeout=args.transfer_timeout, prefetch=prefetch) as worker:
        ids = [worker.submit(it.prompt, it.max_new_tokens) for it in items]
        results = worker.run_until_done()
        out = {"config": _config_json(cfg), **worker.summary()}
    out["failed_ids"] = [w for w in ids if results[w].error is not None]
    out["errors"] = {str(w): results[w].error for w in out["failed_ids"][:10]}
    mismatches = []
    if args.check:
        oracle = _pd_oracle(args, rt)
        mismatches = [w for w, it in zip(ids, items, strict=True) if results[w].error is None
                      and results[w].tokens != oracle.generate(it.prompt, it.max_new_tokens)]
    out["checked"], out["mismatches"] = bool(args.check), mismatches
    out["exact"] = not mismatches and not out["failed_ids"] if args.check else None
    return out


def _config_json(cfg: Any) -> dict[str, Any]:
    return {"lanes": cfg.lanes, "kv_blocks": cfg.kv_blocks, "max_seq_len": cfg.max_seq_len,
            "prefill_chunk": cfg.prefill_chunk, "prefix_cache": cfg.prefix_cache,
            "scratch": cfg.scratch}


def cmd_pd_decode(args: argparse.Namespace) -> int:
    if args.check is None:
        args.check = args.runtime in ("reference", "hf")
    started = _pd_start(args, decode=True)
    if isinstance(started, int):
        return started
    cfg, rt, key, transport = started
    out = run_pd_decode(args, cfg, rt, key, transport)
    if args.json:
        _emit(out)
    else:
        _table("atom-core pd-decode", ["metric", "value"],
               [[k, json.dumps(v)] for k, v in out.items() if k != "config"])
        for w, err in out["errors"].items():
            print(f"request {w}: {err}", file=sys.stderr)
    return 1 if out["failed_ids"] or out["mismatches"] else 0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _colocated(args: argparse.Namespace) -> dict[str, Any]:
    """The same workload on one batcher (the `atom-core demo` path), timed the same way."""
    from atom_core.batcher import AtomBatcher
    from atom_core.demo import MODEL_SEED, demo_config, oracle_for, workload
    from atom_core.runtime.reference import TorchReferenceRuntime
    from atom_core.workers import _quantile

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
    return {"config": _config_json(cfg), "wall_s": round(wall, 3),
            "tokens_per_s": round(b.stats.generated_tokens / wall, 1),
            "latency_median_s": _quantile(sorted(t - t0 for t in done.values()), 0.5),
            "latency_p90_s": _quantile(sorted(t - t0 for t in done.values()), 0.9),
            "ttft_median_s": _quantile(sorted(t - t0 for t in first.values()), 0.5),
            "generated_tokens": b.stats.generated_tokens, "decode_steps": b.stats.decode_steps,
            "exact": exact}


def _pd_session(args: argparse.Namespace, prefetch: int) -> dict[str, Any]:
    """One PD run: pd-prefill in a subprocess, pd-decode here, over gloo on loopback."""
    import secrets
    import subprocess
    import tempfile

    from atom_core.demo import MODEL_SEED

    host, port = "127.0.0.1", _free_port("127.0.0.1")
    key = secrets.token_hex(32)  # through the environment: argv is visible to other users
    shape = ["--lanes", str(args.lanes), "--max-seq-len", "256", "--prefill-chunk", "64",
             "--seed", str(MODEL_SEED), "--host", host, "--port", str(port),
             "--timeout", "30"]
    child_argv = [sys.executable, "-m", "atom_core.cli", "pd-prefill", *shape,
                  "--prefix-cache", "--key", f"env:{PD_KEY_ENV}", "--json"]
    dec = build_parser().parse_args(["pd-decode", *shape, "--requests", str(args.requests),
                                     "--max-new-tokens", str(args.max_new_tokens),
                                     "--workload-seed", str(args.workload_seed), "--check",
                                     "--prefetch", str(prefetch)])
    dec.key = key  # in-process: a literal key is seen by no one
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(child_argv, env={**os.environ, PD_KEY_ENV: key},
                                 stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            cfg, rt, k = _pd_setup(dec, decode=True)
            out = run_pd_decode(dec, cfg, rt, k, _connect(dec, 0, cfg, rt, k))
            child_out, _ = child.communicate(timeout=30)
        except BaseException:
            child.kill()
            child.wait()
            err.seek(0)
            print(f"prefill worker stderr:\n{err.read()}", file=sys.stderr)
            raise
    lines = child_out.strip().splitlines()
    out["prefill_worker"] = json.loads(lines[-1]) if lines else {}
    out["prefill_exit_code"] = child.returncode
    return out


def cmd_pd_demo(args: argparse.Namespace) -> int:
    """The workload over PD (on-demand and prefetching), then colocated; a comparison."""
    import subprocess

    from atom_core.transport import TransportError

    try:
        runs = {"pd_on_demand": _pd_session(args, prefetch=0),
                "pd_prefetch": _pd_session(args, prefetch=args.lanes)}
    except (TransportError, _Usage, OSError, subprocess.TimeoutExpired) as exc:
        print(f"pd-demo failed: {exc}", file=sys.stderr)
        return 1
    runs["colocated"] = _colocated(args)
    if args.json:
        _emit(runs)
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
    _table("atom-core pd-demo: PD over gloo (2 processes, loopback) vs colocated",
           ["", "PD, KV on admission", f"PD, prefetch {runs['pd_prefetch']['prefetch']}",
            "colocated"], rows)


# --------------------------------------------------------------------------- pd-cluster
def _kill_spec(text: str) -> tuple[str, int, int]:
    role, _, rest = text.partition(":")
    index, _, after = rest.partition("@")
    try:
        if role not in ("prefill", "decode"):
            raise ValueError
        return role, int(index), int(after)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected prefill:I@N or decode:I@N (kill worker I "
                                         f"once N requests ended), got {text!r}") from None


def _cluster_rank(args: argparse.Namespace) -> tuple[int | None, str, int | None]:
    """(this process's rank or None for the launcher, the store's host, its port), from
    --rank or from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from atom_core.cluster_run import Layout

    world = Layout(args.prefill, args.decode).world
    if args.rank is None and "TORCHELASTIC_RUN_ID" in os.environ:
        if int(os.environ.get("WORLD_SIZE", "0")) != world:
            raise _Usage(f"torchrun started {os.environ.get('WORLD_SIZE')} processes; a cluster "
                         f"of {args.prefill} prefill and {args.decode} decode workers needs "
                         f"{world} (one more for the frontend): --nproc-per-node {world}")
        return (int(os.environ["RANK"]), os.environ.get("MASTER_ADDR", args.host),
                int(os.environ["MASTER_PORT"]))
    if args.rank is not None and not 0 <= args.rank < world:
        raise _Usage(f"--rank {args.rank} is outside the cluster (ranks 0..{world - 1})")
    if args.rank is not None and args.port is None:
        raise _Usage("--rank needs --port: every process of the cluster must name the same "
                     "store (rank 0 hosts it on --host:--port)")
    return args.rank, args.host, args.port


def cmd_pd_cluster(args: argparse.Namespace) -> int:
    """Launch (or, with --rank / under torchrun, be one process of) a PD cluster."""
    from atom_core.cluster_run import BACKENDS, Layout

    if args.check is None:
        args.check = args.runtime in ("reference", "hf")
    try:
        if args.backend not in BACKENDS:
            raise _Usage(f"--backend {args.backend}: PD links move host (CPU) tensors, which "
                         f"only {', '.join(BACKENDS)} carries point to point here; use gloo")
        if args.prefill < 0 or args.decode < 1:
            raise _Usage("a cluster needs --decode >= 1 and --prefill >= 0")
        rank, host, port = _cluster_rank(args)
        layout = Layout(args.prefill, args.decode)
        role = "frontend" if not rank else layout.role(rank)[0]
        cfg, rt, key = _pd_setup(args, decode=role != "prefill")
    except _Usage as exc:
        print(exc, file=sys.stderr)
        return 2
    if role != "frontend":
        from atom_core.cluster_run import run_worker

        prefetch = cfg.lanes if args.prefetch is None else args.prefetch
        out = run_worker(layout, rank, host=host, port=port, timeout=args.timeout,  # type: ignore[arg-type]
                         cfg=cfg, rt=rt, key=key, prefetch=prefetch,
                         transfer_timeout=args.transfer_timeout)
        if args.json:
            _emit(out)
        return 0
    return _cluster_frontend(args, layout, host, port, cfg, rt, key, launch=rank is None)


def _cluster_frontend(args: argparse.Namespace, layout: Any, host: str, port: int | None,
                      cfg: Any, rt: Any, key: bytes | None, launch: bool) -> int:
    """Rank 0: start the workers (`launch`), serve the demo workload through the router, check
    it against the oracle, print the summary."""
    import subprocess

    from atom_core.cluster_run import FrontendProcess
    from atom_core.demo import workload
    from atom_core.transport import TransportError

    if port is None:
        port = _free_port(host)
    procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}

    def spawn(r: int) -> None:
        # the children get this command line and environment (so the same key, however it was
        # given), each with its rank and the store's address
        procs[layout.role(r)] = subprocess.Popen(
            [sys.executable, "-m", "atom_core.cli", *args.argv, "--rank", str(r), "--host",
             host, "--port", str(port)], stdout=subprocess.DEVNULL)

    if launch:
        for r in range(1, layout.world):
            spawn(r)
    fp = None
    try:
        fp = FrontendProcess(layout, host=host, port=port, timeout=args.timeout, cfg=cfg,
                             rt=rt, key=key)
        killed: set[tuple[str, int]] = set()

        def started() -> None:
            for (role, index), p in procs.items():
                if p.poll() is not None and (role, index) not in killed:
                    raise TransportError(f"{role} worker {index} exited (code {p.returncode}) "
                                         "before it reported ready: see its error above")

        fp.wait_ready(started)
        items = workload(args.requests, args.max_new_tokens, args.workload_seed, rt.vocab_size,
                         cfg.max_seq_len)
        fe = fp.frontend
        done: set[tuple[str, str, int]] = set()
        plan = [("kill", *k) for k in args.kill] + [("restart", *k) for k in args.restart]

        def faults() -> None:
            ended = sum(r.ended for r in fe.results.values())
            for action, role, index, after in plan:
                if (action, role, index) in done or ended < after or (role, index) not in procs:
                    continue
                done.add((action, role, index))
                killed.add((role, index))
                procs[(role, index)].kill()
                if action == "restart":
                    procs[(role, index)].wait()
                    spawn(layout.rank(role, index))  # a new generation: linked again

        # waves: each submitted once the previous one ended and every worker is ready (again)
        ids: list[int] = []
        n = len(items)
        for w in range(args.waves):
            if w:
                fp.wait_ready(started)
            chunk = items[w * n // args.waves:(w + 1) * n // args.waves]
            ids += [fe.submit(it.prompt, it.max_new_tokens) for it in chunk]
            fp.run(each=faults if plan else None, timeout=10 * args.timeout)
        out: dict[str, Any] = {"prefill": layout.prefill, "decode": layout.decode,
                               "config": _config_json(cfg), **fe.summary()}
        out["killed"] = sorted(f"{r}:{i}" for r, i in killed)
        for _ in range(20):  # the workers' last load reports (their final counters)
            fp.pump()
            time.sleep(0.005)
        out["workers"] = {f"{r}:{i}": s for (r, i), s in sorted(fe.worker_stats.items())}
        results = fe.results
        failed = [c for c in ids if results[c].error is not None]
        out["errors"] = {str(c): results[c].error for c in failed[:10]}
        mismatches: list[int] = []
        if args.check:
            oracle = _pd_oracle(args, rt)
            mismatches = [c for c, it in zip(ids, items, strict=True)
                          if results[c].error is None
                          and results[c].tokens != oracle.generate(it.prompt, it.max_new_tokens)]
        # a failure is expected only for a request of a decode worker killed on purpose
        unexpected = [c for c in failed if ("decode", results[c].decode) not in killed]
        out["checked"], out["mismatches"] = bool(args.check), mismatches
        out["exact"] = (not mismatches and not unexpected) if args.check else None
    except (TransportError, TimeoutError, OSError) as exc:
        print(f"pd-cluster failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if fp is not None:
            fp.close()
        for p in procs.values():
            try:
                p.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if args.json:
        _emit(out)
    else:
        _table(f"atom-core pd-cluster: {layout.prefill} prefill x {layout.decode} decode",
               ["metric", "value"], [[k, json.dumps(v)] for k, v in out.items()
                                     if k not in ("config", "workers")])
    return 0 if out["exact"] is not False else 1


# --------------------------------------------------------------------------- simulate
def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        from atom_core import simulate
    except ImportError as exc:  # torch is an extra
        print(f"simulate needs torch: pip install 'atom-core[torch]' ({exc})", file=sys.stderr)
        return 2
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
                print(f"--runtime hf needs transformers: pip install 'atom-core[hf]' ({exc})",
                      file=sys.stderr)
                return 2
        simulate.draw_config(args.seed, fixed)  # a bad combination is a usage error, now
        if args.minutes is None and args.seeds is None:
            report = simulate.run(args.seed, args.steps, faults, shrink=True, **fixed)
            print(json.dumps(report.as_json()) if args.json else simulate.render(report))
            return 0 if report.ok else 1
        first, last = args.seeds if args.seeds is not None else (args.seed, None)
        result = simulate.sweep_with_progress(
            first, args.steps, last_seed=last, faults=faults, show=not args.json,
            seconds=None if args.minutes is None else args.minutes * 60, **fixed)
    except simulate.UsageError as exc:
        print(f"atom-core simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _emit(result.as_json())
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
    return lo, hi


def _minutes(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _simulate_parser(sub: Any) -> None:
    sim = sub.add_parser("simulate", help="seeded simulation of the batcher and PD workers under "
                                          "injected faults, checked against the spec and the "
                                          "oracle")
    sim.add_argument("--seed", type=int, default=0,
                     help="picks the configuration, the workload and the faults (deep mode: "
                          "the first seed)")
    sim.add_argument("--steps", type=int, default=200,
                     help="ticks with fault injection before the drain (default 200)")
    sim.add_argument("--faults", default=None,
                     help="comma-separated fault kinds (prefill, decode, copy, fetch, update, "
                          "alloc, delay, drop, corrupt, duplicate, late, kill, abort), all "
                          "(default) or none")
    sim.add_argument("--mode", choices=("colocated", "pd"), default=None,
                     help="fix the serving mode (default: the seed picks)")
    sim.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                     help="fix the prefix cache on or off (default: the seed picks)")
    sim.add_argument("--scratch", choices=SCRATCH_MODES, default=None,
                     help="fix the scratch discipline (default: the seed picks)")
    sim.add_argument("--sliding-window", default=None, metavar="W|none",
                     help="fix the hybrid model's window, or none for a plain model")
    sim.add_argument("--lanes", type=_positive, default=None)
    sim.add_argument("--runtime", choices=("reference", "hf"), default=None,
                     help="hf: the same shapes as a transformers model (tiny-llama, or "
                          "tiny-gemma3 with the seed's window) on HFRuntime, every finished "
                          "request checked against transformers' generate() (default: "
                          "reference)")
    sim.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="fix any configuration dimension (e.g. prefetch=2, "
                          "fallback_local=false, host_cache_blocks=2); repeatable")
    deep = sim.add_mutually_exclusive_group()
    deep.add_argument("--minutes", type=_minutes, default=None,
                      help="deep mode: consecutive seeds from --seed until the time is up; "
                           "stops at the first failing seed")
    deep.add_argument("--seeds", type=_seed_range, default=None, metavar="A..B",
                      help="deep mode over the seeds A..B (inclusive)")
    sim.add_argument("--json", action="store_true", help="one JSON object on stdout")
    sim.set_defaults(fn=cmd_simulate)


def _pd_common(p: argparse.ArgumentParser, decode: bool) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="the decode worker's address (default: loopback only)")
    p.add_argument("--port", type=_port, default=29500)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the other worker to connect")
    p.add_argument("--key", default=None,
                   help=f"shared PD key: literal, env:NAME or file:PATH (default: ${PD_KEY_ENV} "
                        "if set); a literal is visible in the process list, prefer env: or file:")
    p.add_argument("--insecure", action="store_true",
                   help="run without a key: the link is neither authenticated nor encrypted "
                        "(anyone who reaches the port, loopback included, can read and inject "
                        "KV); for tests on a machine you alone use")
    p.add_argument("--lanes", type=_positive, default=4)
    p.add_argument("--kv-blocks", type=_positive, default=None,
                   help="default: the proved minimum" + (
                       " (plus one with dynamic scratch, so decode runs while imports are in "
                       "flight)" if decode else ""))
    p.add_argument("--max-seq-len", type=_positive, default=256)
    p.add_argument("--block-size", type=_positive, default=None,
                   help="KV block size; max_seq_len / block_size blocks per lane's table "
                        "(default: max_seq_len, one block per lane); the two workers' may "
                        "differ (a payload is the prompt's positions)")
    p.add_argument("--prefill-chunk", type=_positive, default=64)
    p.add_argument("--prefix-cache", action="store_true")
    p.add_argument("--scratch", choices=SCRATCH_MODES, default="dynamic")
    p.add_argument("--runtime", choices=("reference", "hf", "rbln"), default="reference",
                   help="hf: a transformers model (--model) on HFRuntime, float64; both workers "
                        "must give the same model")
    p.add_argument("--model", default=None, metavar="DIR|tiny-llama|tiny-gemma3",
                   help="hf: a local checkpoint directory, or tiny-llama / tiny-gemma3 (seeded "
                        "random weights from --seed, saved and loaded back)")
    p.add_argument("--compiled", default=None, help="rbln: the compiled model directory")
    p.add_argument("--fingerprint", default=None,
                   help="rbln: the model's id for PD (e.g. a hash of the artifact); both "
                        "workers must give the same")
    p.add_argument("--seed", type=int, default=0,
                   help="reference runtime and hf tiny models: the model's seed")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="atom-core", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="prove every invariant, progress property and capacity rule")
    v.add_argument("--json", action="store_true", help="one JSON object on stdout")
    v.add_argument("--max-lanes", type=_positive, default=None,
                   help="cutoff for bounded proofs (default 4; 5 with --deep)")
    v.add_argument("--max-blocks", type=_positive, default=None,
                   help="cutoff for bounded proofs (default 8; 10 with --deep)")
    v.add_argument("--deep", action="store_true",
                   help="larger cutoffs (slow; CI runs the default)")
    v.add_argument("-j", "--jobs", type=_positive, default=os.cpu_count() or 1,
                   help="worker processes (default: one per CPU); the output is the same "
                        "for any number")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
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
    d.add_argument("--runtime", choices=("reference", "hf"), default="reference",
                   help="hf: a transformers model (--model) checked against its own generate()")
    d.add_argument("--model", default=None, metavar="DIR|tiny-llama|tiny-gemma3",
                   help="hf: a local checkpoint directory, or tiny-llama / tiny-gemma3 (seeded "
                        "random weights, saved to a temporary directory and loaded back)")
    d.add_argument("--json", action="store_true",
                   help="one JSON object on stdout (no progress bar)")
    d.set_defaults(fn=cmd_demo)

    for name, fn, help_ in (
            ("check-config", cmd_check_config, "is this configuration safe? if not, show why"),
            ("min-blocks", cmd_min_blocks, "the fewest KV blocks for a lane count")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--rbln-config", default=None, metavar="PATH",
                       help="a compiled artifact's rbln_config.json (or its directory): its "
                            "batch_size, kvcache_num_blocks, kvcache_block_size, max_seq_len, "
                            "prefill_chunk_size, ...; flags given here win over it")
        p.add_argument("--lanes", type=_positive, default=None,
                       help="required unless --rbln-config gives batch_size")
        if name == "check-config":
            p.add_argument("--kv-blocks", type=_positive, default=None,
                           help="required unless --rbln-config gives kvcache_num_blocks")
        p.add_argument("--prefix-cache", action="store_true", default=None)
        p.add_argument("--scratch", choices=SCRATCH_MODES, default="dynamic",
                       help="reserved: a fixed scratch block; dynamic: padding rows write into a "
                            "free block (default)")
        p.add_argument("--max-seq-len", type=_positive, default=None, help="default 4096")
        p.add_argument("--block-size", type=_positive, default=None,
                       help="KV block size; max_seq_len / block_size blocks per lane's table "
                            "(default: max_seq_len, the eager artifact: one block per lane)")
        p.add_argument("--prefill-chunk", type=_positive, default=None, help="default 128")
        p.add_argument("--host-cache-blocks", type=int, default=0,
                       help="host cache slots below the prefix cache (default 0: none)")
        p.add_argument("--preemption", action="store_true",
                       help="a lane waiting for a block preempts the most recently admitted one "
                            "(needs --block-size below --max-seq-len): one lane's whole table "
                            "and a block suffice")
        p.add_argument("--json", action="store_true", help="one JSON object on stdout")
        p.set_defaults(fn=fn)

    pf = sub.add_parser("pd-prefill", help="PD prefill worker: prefill what the decode worker "
                                            "asks for and send it the KV")
    _pd_common(pf, decode=False)
    pf.set_defaults(fn=cmd_pd_prefill)

    pdec = sub.add_parser("pd-decode", help="PD decode worker: serve the demo workload with KV "
                                             "from a pd-prefill worker")
    _pd_common(pdec, decode=True)
    _workload_args(pdec)
    pdec.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                      help="check every output against the oracle (default: on for the "
                           "reference runtime and for hf, against transformers' generate)")
    pdec.add_argument("--fallback-local", action=argparse.BooleanOptionalAction, default=True,
                      help="prefill here the requests not yet sent when the prefill worker is "
                           "lost (default: on)")
    pdec.add_argument("--transfer-timeout", type=float, default=30.0,
                      help="seconds before an unanswered KV transfer fails its request")
    pdec.add_argument("--prefetch", type=int, default=None,
                      help="ask for the KV of up to this many waiting requests before they get "
                           "a lane (default: --lanes; 0: only once a lane waits for it)")
    pdec.set_defaults(fn=cmd_pd_decode)

    pdemo = sub.add_parser("pd-demo", help="pd-prefill (subprocess) + pd-decode over gloo on "
                                            "loopback, compared with the colocated demo")
    pdemo.add_argument("--lanes", type=_positive, default=4)
    _workload_args(pdemo)
    pdemo.add_argument("--json", action="store_true", help="one JSON object on stdout")
    pdemo.set_defaults(fn=cmd_pd_demo)

    pc = sub.add_parser("pd-cluster", help="N prefill and M decode workers behind a router, "
                                           "one process each over gloo (launched here, or "
                                           "under torchrun)")
    _pd_common(pc, decode=True)
    _workload_args(pc)
    pc.set_defaults(port=None, fn=cmd_pd_cluster, argv=None)
    pc.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    pc.add_argument("--decode", type=_positive, default=1, help="decode workers (default 1)")
    pc.add_argument("--backend", default="gloo",
                    help="torch.distributed backend of the links (default gloo, the one that "
                         "carries host tensors point to point)")
    pc.add_argument("--rank", type=int, default=None,
                    help="run only this rank (0: the frontend and router, 1..N prefill, "
                         "N+1..N+M decode) instead of launching all; under torchrun the rank "
                         "comes from the environment")
    pc.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                    help="check every output against the oracle (default: on for reference "
                         "and hf)")
    pc.add_argument("--prefetch", type=int, default=None,
                    help="each decode worker asks for the KV of up to this many waiting "
                         "requests early (default: --lanes)")
    pc.add_argument("--restart", type=_kill_spec, action="append", default=[],
                    metavar="ROLE:I@N",
                    help="as --kill, then start the worker again (a new generation: it is "
                         "used once it reports ready); repeatable")
    pc.add_argument("--waves", type=_positive, default=1,
                    help="submit the workload in this many waves, each once the previous one "
                         "ended and every worker is ready (default 1)")
    pc.add_argument("--transfer-timeout", type=float, default=30.0,
                    help="seconds before an unanswered KV transfer fails its request")
    pc.add_argument("--kill", type=_kill_spec, action="append", default=[],
                    metavar="ROLE:I@N",
                    help="fault injection (launcher only): SIGKILL worker I of ROLE once N "
                         "requests ended; repeatable")

    _simulate_parser(sub)

    from atom_core.serve.main import add_arguments, cmd_serve  # (no web stack imported here)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    add_arguments(srv)
    srv.set_defaults(fn=cmd_serve)
    return ap


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=_positive, default=24)
    p.add_argument("--max-new-tokens", type=_positive, default=16)
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the workload")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "argv", False) is None:  # pd-cluster starts its workers with it
        args.argv = list(sys.argv[1:] if argv is None else argv)
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
