"""The PD workers: `pd-prefill` and `pd-decode` (their configuration, key, runtime and link),
and `run_pd_decode`, which `pd-demo` drives too."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from atom_core import options as opt
from atom_core.cli.common import emit, fail, table
from atom_core.config import SCRATCH_MODES, flag_vocabulary, min_kv_blocks

PD_KEY_ENV = "ATOM_CORE_PD_KEY"

T = TypeVar("T")


class UsageError(Exception):
    """A bad option or configuration: printed, exit 2."""


def _hf() -> Any:
    """atom_core.runtime.hf, or a usage error naming the extra."""
    try:
        from atom_core.runtime import hf
    except ImportError as exc:  # transformers is an extra
        raise UsageError(f"--runtime hf needs transformers: pip install 'atom-core[hf]' ({exc})"
                         ) from None
    return hf


def _loadable() -> tuple[str, ...]:
    """The runtimes a PD worker can be given by name (the registry's loadable ones)."""
    from atom_core.runtime.registry import names

    return names(lambda kind: kind.load is not None)


def _has_oracle(runtime: str) -> bool:
    """Whether --runtime's tokens have something to be checked against (--check)."""
    from atom_core.runtime.registry import get

    return get(runtime).oracle is not None


def _pd_model_window(args: argparse.Namespace) -> int | None:
    """--runtime hf: the model's sliding window (a Gemma3 model's batcher needs it), else None;
    checks that --model goes with --runtime hf."""
    if args.runtime != "hf":
        if args.model is not None:
            raise UsageError("--model is for --runtime hf (the reference model is built in; rbln "
                             "takes --compiled)")
        return None
    if args.model is None:
        raise UsageError("--runtime hf needs --model DIR|tiny-llama|tiny-gemma3 (a local "
                         "checkpoint directory, or a seeded tiny model)")
    try:
        return _hf().model_window(args.model)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the config of {args.model}: {exc}") from None


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
    origins = {"kv_blocks": "the proved minimum" + (" plus one" if decode else "")} \
        if args.kv_blocks is None else {}
    if args.block_size is None:
        origins["block_size"] = "the default: max_seq_len, one block per lane"
    if window is not None:
        origins["sliding_window"] = f"--model {args.model}'s"
    try:
        return Config(lanes=args.lanes, kv_blocks=kv, max_seq_len=args.max_seq_len,
                      block_size=block, prefill_chunk=args.prefill_chunk,
                      prefix_cache=args.prefix_cache, scratch=args.scratch,
                      sliding_window=window)
    except ConfigError as exc:
        words = flag_vocabulary(PD_CONFIG_FLAGS, origins)
        raise UsageError(f"invalid configuration: {exc.in_terms(words)}") from None


# the Config fields the PD commands have a flag for
PD_CONFIG_FLAGS = ("lanes", "kv_blocks", "max_seq_len", "block_size", "prefill_chunk",
                   "prefix_cache", "scratch")


def _pd_key(args: argparse.Namespace) -> bytes | None:
    from atom_core.pd import payload as pd

    if args.key == "":
        raise UsageError("--key is empty: give a key of at least 16 bytes (literal, env:NAME or "
                         f"file:PATH), or leave --key out and set ${PD_KEY_ENV}")
    value = args.key if args.key is not None else (
        f"env:{PD_KEY_ENV}" if os.environ.get(PD_KEY_ENV) else None)
    try:
        key = pd.load_key(value)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if key is None and not args.insecure:
        raise UsageError(f"no PD key: pass --key (env:NAME or file:PATH) or set ${PD_KEY_ENV} on "
                         "both workers; without one anyone who reaches the port, loopback included "
                         "(any local user), can read prompts and KV or inject KV. --insecure runs "
                         "without authentication")
    if key is not None and args.insecure:
        raise UsageError("--insecure and a PD key exclude each other: drop one")
    if args.link_label:
        from atom_core.pd.secure_link import MAX_LABEL_CHARS, label_ok

        if key is None:
            raise UsageError("--link-label names a keyed link (the handshake binds it): give a "
                             "--key, or drop --link-label")
        if not label_ok(args.link_label):
            raise UsageError(f"--link-label must be printable text of at most {MAX_LABEL_CHARS} "
                             "characters, the same for both workers")
    if key is None:
        print(f"warning: --insecure: the PD link with {args.host} is neither authenticated nor "
              "encrypted", file=sys.stderr)
    return key


def _pd_options(args: argparse.Namespace, decode: bool) -> None:
    """Option values argparse cannot check by type (the numbers' types refuse nan, inf and
    what is out of range), before anything connects."""
    check_host(args.host, args.port)
    from atom_core.runtime.registry import get

    refusal = get(args.runtime).pd_refusal
    if refusal is not None:  # (RBLN: a KV payload cannot be read out of its host buffer)
        raise UsageError(f"PD does not support --runtime {args.runtime} yet: {refusal}")


def check_host(host: str, port: int | None) -> None:
    """UsageError unless `host` names an address a link can use: said at once, before any
    "waiting" line, rather than by the rendezvous after it (exit 1, a timeout later)."""
    from atom_core.pd.transport import TransportError, resolve_address

    try:
        resolve_address(host, port or 0)
    except TransportError as exc:
        cause = exc.__cause__ or exc
        raise UsageError(f"--host {host!r} does not resolve to an address ({cause}): give a "
                         "host name or IP address this machine can look up (127.0.0.1 when "
                         "every worker runs here)") from None
    except ValueError as exc:  # the wildcard address: nothing to connect to
        raise UsageError(f"--host: {exc}") from None


def _pd_runtime(args: argparse.Namespace, cfg: Any) -> Any:
    """--runtime's runtime (the registry's), checked against the config before connecting: a
    mismatch found after the rendezvous would strand the peer. hf: --model in float64 (as
    `atom-core demo --runtime hf`: its tokens are checked against transformers' generate, and
    float64 keeps the two paths' rounding far below any logit gap); both workers must load the
    same model, or the decode worker refuses the KV (the fingerprint covers the config, the
    weights and the dtype)."""
    from atom_core.batcher import check_runtime
    from atom_core.runtime.registry import RuntimeRequest, get

    kind = get(args.runtime)
    assert kind.load is not None  # (--runtime's choices are the loadable kinds)
    if kind.name == "hf":
        _hf()  # transformers is an extra: a usage error naming it
    if kind.name == "rbln" and not args.compiled:
        raise UsageError("--runtime rbln needs --compiled PATH (an optimum-rbln compiled decoder "
                         "directory)")
    req = RuntimeRequest(model=args.model, compiled=args.compiled, seed=args.seed,
                         dtype="float64" if kind.name == "hf" else None,
                         fingerprint=args.fingerprint)
    # what a refusal names: the model a checkpoint runtime serves, the artifact rbln loads
    failed = (f"cannot serve {args.model}" if args.model is not None
              else f"cannot load {args.compiled}")
    try:
        rt = kind.load(cfg, req)
    except ImportError as exc:  # a runtime's SDK (RBLN's `rebel`) is not installed
        raise UsageError(str(exc)) from None
    except (OSError, ValueError) as exc:  # UnsupportedModelError is a ValueError
        raise UsageError(f"{failed}: {exc}") from None
    try:
        check_runtime(cfg, rt)
    except ValueError as exc:
        raise UsageError(f"cannot serve {args.model}: {exc}" if args.model is not None
                         else str(exc)) from None
    return rt


def pd_oracle(args: argparse.Namespace, rt: Any) -> Any:
    """The runtime's oracle: the reference model's cache-free generate, or for --runtime hf
    transformers' own greedy generate() of the same weights."""
    from atom_core.runtime.registry import get

    oracle = get(args.runtime).oracle
    assert oracle is not None  # (pd_setup refuses --check without one)
    return oracle(rt)


def pd_setup(args: argparse.Namespace, decode: bool) -> tuple[Any, Any, bytes | None]:
    cfg = _pd_config(args, decode)
    _pd_options(args, decode)
    key = _pd_key(args)
    if decode and args.check and not _has_oracle(args.runtime):
        raise UsageError("--check needs an oracle: the reference runtime's or, for --runtime hf, "
                         "transformers' generate(); an RBLN model has none here, pass --no-check")
    return cfg, _pd_runtime(args, cfg), key


def connect(args: argparse.Namespace, rank: int, cfg: Any, rt: Any,
             key: bytes | None) -> Any:
    """The worker's transport: gloo with this config's frame limits, and with a key a
    SecureLink whose handshake has completed (LinkError, a TransportError, if the peer
    fails it)."""
    from atom_core.pd.transport import GlooTransport

    role = "decode worker: waiting for the prefill worker on" if rank == 0 else \
        "prefill worker: connecting to the decode worker at"
    print(f"{role} {args.host}:{args.port}", file=sys.stderr, flush=True)
    limits = _wire_limits(cfg, rt)
    transport = interruptible(lambda: GlooTransport(rank, host=args.host, port=args.port,
                                                    timeout=args.timeout, **limits))
    if key is None:
        return transport
    from atom_core.pd.secure_link import LinkError, SecureLink

    # the key handshake, before either worker handles anything
    link = SecureLink(transport, key, "decode" if rank == 0 else "prefill",
                      label=args.link_label, max_box_bytes=limits["max_tensor_bytes"])
    try:
        link.establish(args.timeout)
    except LinkError as exc:
        link.close()
        raise LinkError(f"PD link refused: {exc}") from None
    return link


def interruptible(make: Callable[[], T]) -> T:
    """`make()`, run in a helper thread so that Ctrl-C reaches this one: torch.distributed's
    rendezvous blocks in C++, where Python sees no signal until it returns (--timeout later).
    On Ctrl-C the helper is left blocked (a daemon thread: it does not hold the exit up)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = make()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    helper = threading.Thread(target=run, name="pd-rendezvous", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _wire_limits(cfg: Any, rt: Any) -> dict[str, int]:
    """The transport's frame limits from this worker's config (`pd.frame_limits`), room for a
    sealed box's overhead included."""
    from atom_core.pd import payload as pd
    from atom_core.pd.secure_link import box_limit

    lim = pd.frame_limits(cfg, rt)
    return {"max_header_bytes": lim.header_bytes,
            "max_tensor_bytes": box_limit(lim.header_bytes, lim.tensor_bytes)}


def _pd_start(args: argparse.Namespace, decode: bool) -> tuple[Any, ...] | int:
    """(config, runtime, key, transport), or the exit code: 2 for a bad setting (before any
    connection is tried), 1 when the peer cannot be reached."""
    from atom_core.pd.transport import TransportError

    try:
        cfg, rt, key = pd_setup(args, decode=decode)
        return cfg, rt, key, connect(args, 0 if decode else 1, cfg, rt, key)
    except UsageError as exc:
        return fail(args, str(exc), 2)
    except TransportError as exc:
        return fail(args, str(exc), 1)


def cmd_pd_prefill(args: argparse.Namespace) -> int:
    from atom_core.pd.workers import PrefillWorker

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
        emit(out)
    else:
        print(f"prefill worker: {out['exports']} exports, {out['failures']} failures, "
              f"{out['bytes_sent']} bytes sent; ended by {out['ended_by']}", file=sys.stderr)
    return 0 if worker.ended_by == "shutdown" else 1


def run_pd_decode(args: argparse.Namespace, cfg: Any, rt: Any, key: bytes | None,
                  transport: Any) -> dict[str, Any]:
    """Serve the demo workload through a DecodeWorker on `transport`; its summary, checked
    against the oracle when `args.check`."""
    from atom_core.demo import workload
    from atom_core.pd.workers import DecodeWorker

    items = workload(args.requests, args.max_new_tokens, args.workload_seed, rt.vocab_size,
                     cfg.max_seq_len)
    prefetch = cfg.lanes if args.prefetch is None else args.prefetch
    with DecodeWorker(cfg, rt, transport, key=key, insecure=key is None,
                      fallback_local=args.fallback_local,
                      transfer_timeout=args.transfer_timeout, prefetch=prefetch) as worker:
        ids = [worker.submit(it.prompt, it.max_new_tokens) for it in items]
        results = worker.run_until_done()
        out = {"config": config_json(cfg), **worker.summary()}
    out["failed_ids"] = [w for w in ids if results[w].error is not None]
    out["errors"] = {str(w): results[w].error for w in out["failed_ids"][:10]}
    mismatches = []
    if args.check:
        oracle = pd_oracle(args, rt)
        mismatches = [w for w, it in zip(ids, items, strict=True) if results[w].error is None
                      and results[w].tokens != oracle.generate(it.prompt, it.max_new_tokens)]
    out["checked"], out["mismatches"] = bool(args.check), mismatches
    out["exact"] = not mismatches and not out["failed_ids"] if args.check else None
    return out


def config_json(cfg: Any) -> dict[str, Any]:
    return {"lanes": cfg.lanes, "kv_blocks": cfg.kv_blocks, "max_seq_len": cfg.max_seq_len,
            "prefill_chunk": cfg.prefill_chunk, "prefix_cache": cfg.prefix_cache,
            "scratch": cfg.scratch}


def cmd_pd_decode(args: argparse.Namespace) -> int:
    if args.check is None:
        args.check = _has_oracle(args.runtime)
    started = _pd_start(args, decode=True)
    if isinstance(started, int):
        return started
    cfg, rt, key, transport = started
    out = run_pd_decode(args, cfg, rt, key, transport)
    if args.json:
        emit(out)
    else:
        table("atom-core pd-decode", ["metric", "value"],
               [[k, json.dumps(v)] for k, v in out.items() if k != "config"])
        for w, err in out["errors"].items():
            print(f"request {w}: {err}", file=sys.stderr)
    return 1 if out["failed_ids"] or out["mismatches"] else 0



def pd_prefill_arguments(p: argparse.ArgumentParser) -> None:
    pd_common_arguments(p, decode=False)


def pd_decode_arguments(p: argparse.ArgumentParser) -> None:
    pd_common_arguments(p, decode=True)
    workload_arguments(p)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="check every output against the oracle (default: on for the "
                        "reference runtime and for hf, against transformers' generate)")
    p.add_argument("--fallback-local", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill here the requests not yet sent when the prefill worker is "
                        "lost (default: on)")
    p.add_argument("--transfer-timeout", type=opt.seconds(), default=30.0,
                   help="seconds before an unanswered KV transfer fails its request "
                        "(default: 30)")
    p.add_argument("--prefetch", type=PREFETCH, default=None,
                   help="ask for the KV of up to this many waiting requests before they get "
                        "a lane (default: --lanes; 0: only once a lane waits for it)")


def pd_common_arguments(p: argparse.ArgumentParser, decode: bool,
                        cluster: bool = False) -> None:
    if cluster:
        p.add_argument("--host", default="127.0.0.1",
                       help="the store's address: rank 0 hosts it there, every other rank "
                            "connects to it (default: 127.0.0.1, loopback only)")
        p.add_argument("--port", type=_port, default=None,
                       help="the store's port (default: a free port when launching; --rank "
                            "needs it)")
    else:
        p.add_argument("--host", default="127.0.0.1",
                       help="the decode worker's address (default: 127.0.0.1, loopback only)")
        p.add_argument("--port", type=_port, default=29500,
                       help="the decode worker's rendezvous port (default: 29500)")
    p.add_argument("--timeout", type=opt.seconds(), default=60.0,
                   help=("seconds each send and close waits for a peer (start-up: "
                         "--link-timeout; default: 60)" if cluster else
                         "seconds to wait for the other worker to connect (default: 60)"))
    p.add_argument("--key", default=None,
                   help=f"shared PD key: literal, env:NAME or file:PATH (default: ${PD_KEY_ENV} "
                        "if set); a literal is visible in the process list, prefer env: or file:")
    p.add_argument("--link-label", default="", metavar="NAME",
                   help="the pair's name, the same for both workers: the key handshake binds it, "
                        "so where several pairs share a key no worker can be wired to another "
                        "pair's peer (default: none)")
    p.add_argument("--insecure", action="store_true",
                   help="run without a key: the link is neither authenticated nor encrypted "
                        "(anyone who reaches the port, loopback included, can read and inject "
                        "KV); for tests on a machine you alone use")
    p.add_argument("--lanes", type=opt.count, default=4, help="default: 4")
    p.add_argument("--kv-blocks", type=opt.count, default=None,
                   help="default: the proved minimum" + (
                       " (plus one with dynamic scratch, so decode runs while imports are in "
                       "flight)" if decode else ""))
    p.add_argument("--max-seq-len", type=opt.length, default=256, help="default: 256")
    p.add_argument("--block-size", type=opt.length, default=None,
                   help="KV block size; max_seq_len / block_size blocks per lane's table "
                        "(default: max_seq_len, one block per lane); the two workers' may "
                        "differ (a payload is the prompt's positions)")
    p.add_argument("--prefill-chunk", type=opt.count, default=64, help="default: 64")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--scratch", choices=SCRATCH_MODES, default="dynamic",
                   help="reserved: a fixed scratch block; dynamic: padding rows write into a "
                        "free block (default: dynamic)")
    p.add_argument("--runtime", choices=_loadable(), default="reference",
                   help="hf: a transformers model (--model) on HFRuntime, float64; both workers "
                        "must give the same model (default: reference)")
    p.add_argument("--model", default=None, metavar="DIR|tiny-llama|tiny-gemma3",
                   help="hf: a local checkpoint directory, or tiny-llama / tiny-gemma3 (seeded "
                        "random weights from --seed, saved and loaded back)")
    p.add_argument("--compiled", default=None, help="rbln: the compiled model directory")
    p.add_argument("--fingerprint", default=None,
                   help="rbln: the model's id for PD (e.g. a hash of the artifact); both "
                        "workers must give the same")
    p.add_argument("--seed", type=opt.seed, default=0,
                   help="reference runtime and hf tiny models: the model's seed (default: 0)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


_port = opt.port()
# --prefetch: KV transfers asked ahead, at most a block table's worth of ids
PREFETCH = opt.integer(0, 2**15, zero="ask for KV only once a lane waits")


def workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=opt.integer(1, opt.MAX_REQUESTS), default=24,
                   help="default: 24")
    p.add_argument("--max-new-tokens", type=opt.integer(1, opt.MAX_NEW_TOKENS), default=16,
                   help="default: 16")
    p.add_argument("--workload-seed", type=opt.seed, default=0,
                   help="seed of the workload (default: 0)")
