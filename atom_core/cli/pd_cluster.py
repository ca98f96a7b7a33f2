"""`atom-core pd-cluster`: N prefill and M decode workers behind a router (`atom_core.pd.router`),
one process each over gloo, launched here or under torchrun (`atom_core.pd.cluster_run`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from atom_core import options as opt
from atom_core.cli.common import emit, fail, free_port, table
from atom_core.cli.pd import (
    PREFETCH,
    UsageError,
    config_json,
    pd_common_arguments,
    pd_oracle,
    pd_setup,
    workload_arguments,
)

# Each worker is a process (and a model): past this a typo.
MAX_WORKERS = 256


def pd_cluster_arguments(p: argparse.ArgumentParser) -> None:
    pd_common_arguments(p, decode=True, cluster=True)
    workload_arguments(p)
    p.set_defaults(argv=None)
    p.add_argument("--prefill", type=opt.integer(0, MAX_WORKERS), default=1,
                   help="prefill workers (default 1)")
    p.add_argument("--decode", type=opt.integer(1, MAX_WORKERS), default=1,
                   help="decode workers (default 1)")
    p.add_argument("--backend", default="gloo",
                   help="torch.distributed backend of the links (default gloo, the one that "
                        "carries host tensors point to point)")
    p.add_argument("--rank", type=opt.integer(0, 2 * MAX_WORKERS), default=None,
                   help="run only this rank (0: the frontend and router, 1..N prefill, "
                        "N+1..N+M decode) instead of launching all; under torchrun the rank "
                        "comes from the environment")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="check every output against the oracle (default: on for reference "
                        "and hf)")
    p.add_argument("--prefetch", type=PREFETCH, default=None,
                   help="each decode worker asks for the KV of up to this many waiting "
                        "requests early (default: --lanes)")
    p.add_argument("--restart", type=_kill_spec, action="append", default=[],
                   metavar="ROLE:I@N",
                   help="as --kill, then start the worker again (a new generation: it is "
                        "used once it reports ready); repeatable")
    p.add_argument("--waves", type=opt.integer(1, opt.MAX_REQUESTS), default=1,
                   help="submit the workload in this many waves, each once the previous one "
                        "ended and every worker is ready (default 1)")
    p.add_argument("--link-timeout", type=opt.seconds(), default=LINK_TIMEOUT,
                   help="seconds start-up waits for the links: a worker for the store and its "
                        "link with the frontend, each link for its peer's rendezvous and key "
                        "handshake, the frontend for every worker to report ready (default: "
                        f"{LINK_TIMEOUT:g}; a loaded machine starts the processes slowly; "
                        "--timeout still bounds each send and close)")
    p.add_argument("--transfer-timeout", type=opt.seconds(), default=30.0,
                   help="seconds a prefill worker has to answer each attempt of a KV "
                        "transfer; past them the request is asked of another prefill worker "
                        "or prefilled locally, and that worker is asked nothing until it "
                        "answers again (default: 30)")
    p.add_argument("--kill", type=_kill_spec, action="append", default=[],
                   metavar="ROLE:I@N",
                   help="fault injection (launcher only): SIGKILL worker I of ROLE once N "
                        "requests ended; repeatable")


# Start-up may take long on a loaded machine (5 processes importing torch, deriving the key and
# linking on 2 busy cores took over 40 s): a generous default, since a wait that is too short
# aborts the whole cluster while one too long only delays the error of a worker that never
# comes.
LINK_TIMEOUT = 300.0


def _kill_spec(text: str) -> tuple[str, int, int]:
    role, _, rest = text.partition(":")
    index, _, after = rest.partition("@")
    try:
        if role not in ("prefill", "decode") or int(index) < 0 or int(after) < 0:
            raise ValueError
        return role, int(index), int(after)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected prefill:I@N or decode:I@N (kill worker I "
                                         f"once N requests ended), got {text!r}") from None


def _check_faults(args: argparse.Namespace, launch: bool) -> None:
    """--kill and --restart name a worker this launcher starts (else they would be ignored)."""
    faults = [("--kill", k) for k in args.kill] + [("--restart", k) for k in args.restart]
    if faults and not launch:
        raise UsageError("--kill and --restart are for the launcher (it kills the workers it "
                         "started): drop them with --rank or under torchrun")
    sizes = {"prefill": args.prefill, "decode": args.decode}
    for flag, (role, index, after) in faults:
        if not 0 <= index < sizes[role]:
            which = f"workers 0..{sizes[role] - 1}" if sizes[role] else "none"
            raise UsageError(f"{flag} {role}:{index}@{after}: there is no {role} worker {index} "
                             f"(--{role} {sizes[role]}: {which})")


# the launcher's own options, which its workers do not take
_LAUNCHER_ONLY = ("--kill", "--restart")


def _worker_argv(argv: list[str]) -> list[str]:
    """The launcher's command line without --kill and --restart (its workers refuse them)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _LAUNCHER_ONLY:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in _LAUNCHER_ONLY)):
            out.append(a)
    return out


def _cluster_rank(args: argparse.Namespace) -> tuple[int | None, str, int | None]:
    """(this process's rank or None for the launcher, the store's host, its port), from
    --rank or from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from atom_core.pd.cluster_run import Layout

    world = Layout(args.prefill, args.decode).world
    if args.rank is None and "TORCHELASTIC_RUN_ID" in os.environ:
        if int(os.environ.get("WORLD_SIZE", "0")) != world:
            raise UsageError(f"torchrun started {os.environ.get('WORLD_SIZE')} processes; a "
                             f"cluster of {args.prefill} prefill and {args.decode} decode "
                             f"workers needs {world} (one more for the frontend): "
                             f"--nproc-per-node {world}")
        return (int(os.environ["RANK"]), os.environ.get("MASTER_ADDR", args.host),
                int(os.environ["MASTER_PORT"]))
    if args.rank is not None and not 0 <= args.rank < world:
        raise UsageError(f"--rank {args.rank} is outside the cluster (ranks 0..{world - 1})")
    if args.rank is not None and args.port is None:
        raise UsageError("--rank needs --port: every process of the cluster must name the "
                         "same store (rank 0 hosts it on --host:--port)")
    return args.rank, args.host, args.port


def cmd_pd_cluster(args: argparse.Namespace) -> int:
    """Launch (or, with --rank / under torchrun, be one process of) a PD cluster."""
    from atom_core.pd.cluster_run import BACKENDS, Layout

    if args.check is None:
        args.check = args.runtime in ("reference", "hf")
    try:
        if args.backend not in BACKENDS:
            raise UsageError(f"--backend {args.backend}: PD links move host (CPU) tensors, "
                             f"which only {', '.join(BACKENDS)} carries point to point here; "
                             "use gloo")
        if args.prefill < 0 or args.decode < 1:
            raise UsageError("a cluster needs --decode >= 1 and --prefill >= 0")
        rank, host, port = _cluster_rank(args)
        # (under torchrun the store's host is MASTER_ADDR: the one pd_setup checks and names)
        args.host = host
        layout = Layout(args.prefill, args.decode)
        _check_faults(args, launch=rank is None)
        role = "frontend" if not rank else layout.role(rank)[0]
        cfg, rt, key = pd_setup(args, decode=role != "prefill")
    except UsageError as exc:
        return fail(args, str(exc), 2)
    if role != "frontend":
        from atom_core.pd.cluster_run import run_worker
        from atom_core.pd.transport import TransportError

        prefetch = cfg.lanes if args.prefetch is None else args.prefetch
        try:
            out = run_worker(layout, rank, host=host, port=port,  # type: ignore[arg-type]
                             timeout=args.timeout, cfg=cfg, rt=rt, key=key, prefetch=prefetch,
                             transfer_timeout=args.transfer_timeout,
                             link_timeout=args.link_timeout)
        except (TransportError, TimeoutError, OSError, RuntimeError) as exc:
            # one line, not a traceback: the launcher and the operator read the reason
            return _leave(args, fail(args, f"pd-cluster {role} worker (rank {rank}): "
                                           f"{_one_line(exc)}", 1))
        if args.json:
            emit(out)
        return _leave(args, 0)
    return _leave(args, _cluster_frontend(args, layout, host, port, cfg, rt, key,
                                          launch=rank is None))


def _one_line(exc: BaseException) -> str:
    """An error's first line (torch's store errors append native stack traces)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _leave(args: argparse.Namespace, code: int) -> int:
    """`code`, or, in a process of its own (the command line is this one's) that still has a
    thread inside gloo or the store's C++ (a link build waiting on a peer, a transport whose
    peer did not answer its close), the same exit code at once (`os._exit`, output flushed):
    the interpreter's normal exit under such a thread ends in a C++ `terminate` (an abort, a
    core), which would hide the one-line error."""
    from atom_core.pd.cluster_run import threads_left

    if args.argv != sys.argv[1:] or not threads_left():
        return code  # (called in-process, a test: never end the caller's process)
    # (threads still running once the links were closed and their builds given time)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cluster_frontend(args: argparse.Namespace, layout: Any, host: str, port: int | None,
                      cfg: Any, rt: Any, key: bytes | None, launch: bool) -> int:
    """Rank 0: start the workers (`launch`), serve the demo workload through the router, check
    it against the oracle, print the summary."""
    import subprocess

    from atom_core.demo import workload
    from atom_core.pd.cluster_run import FrontendProcess
    from atom_core.pd.transport import TransportError

    if port is None:
        port = free_port(host)
    procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}

    def spawn(r: int) -> None:
        # the children get this command line and environment (so the same key, however it was
        # given), each with its rank and the store's address
        procs[layout.role(r)] = subprocess.Popen(
            [sys.executable, "-m", "atom_core.cli", *_worker_argv(args.argv), "--rank", str(r),
             "--host", host, "--port", str(port)], stdout=subprocess.DEVNULL)

    if launch:
        for r in range(1, layout.world):
            spawn(r)
    fp = None
    try:
        fp = FrontendProcess(layout, host=host, port=port, timeout=args.timeout, cfg=cfg,
                             rt=rt, key=key, link_timeout=args.link_timeout)
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
                               "config": config_json(cfg), **fe.summary()}
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
            oracle = pd_oracle(args, rt)
            mismatches = [c for c, it in zip(ids, items, strict=True)
                          if results[c].error is None
                          and results[c].tokens != oracle.generate(it.prompt, it.max_new_tokens)]
        # a failure is expected only for a request of a decode worker killed on purpose
        unexpected = [c for c in failed if ("decode", results[c].decode) not in killed]
        out["checked"], out["mismatches"] = bool(args.check), mismatches
        out["exact"] = (not mismatches and not unexpected) if args.check else None
    except (TransportError, TimeoutError, OSError, RuntimeError) as exc:
        return fail(args, f"pd-cluster failed: {_one_line(exc)}", 1)
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
        emit(out)
    else:
        table(f"atom-core pd-cluster: {layout.prefill} prefill x {layout.decode} decode",
               ["metric", "value"], [[k, json.dumps(v)] for k, v in out.items()
                                     if k not in ("config", "workers")])
    return 0 if out["exact"] is not False else 1
