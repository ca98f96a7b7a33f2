"""`atom-core`: the command line. This module is the dispatch table (`COMMANDS`: one row per
subcommand, its arguments and the function that runs it); the commands live by group:

    proofs    verify, check-config, min-blocks, check-trace
    demo      demo, simulate
    pd        pd-prefill, pd-decode (the PD workers)
    pd_demo   pd-demo (both workers on loopback, compared with colocated)
    pd_cluster pd-cluster (N prefill and M decode workers behind a router)
    serve     serve (the HTTP server's own options and body)
    common    JSON and table output, z3 as an extra, argument types

A new command is one function that fills its parser and one that runs it, in its group's
module, and one row here."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import attrs

from atom_core.cli import demo, pd, pd_cluster, pd_demo, proofs, serve
from atom_core.cli.common import emit

# `atom-core --help`'s description.
DESCRIPTION = "`atom-core`: prove the model, and check an artifact's configuration before " \
    "deploying it."


@attrs.frozen
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# In `atom-core --help`'s order.
COMMANDS: tuple[Command, ...] = (
    Command("verify", "prove every invariant, progress property and capacity rule",
            proofs.verify_arguments, proofs.cmd_verify),
    Command("check-trace", "replay a batcher trace (JSONL) through the spec",
            proofs.check_trace_arguments, proofs.cmd_check_trace),
    Command("demo", "serve a built-in workload on the torch reference runtime and check every "
            "token against the oracle", demo.demo_arguments, demo.cmd_demo),
    Command("check-config", "is this configuration safe? if not, show why",
            proofs.check_config_arguments, proofs.cmd_check_config),
    Command("min-blocks", "the fewest KV blocks for a lane count",
            proofs.min_blocks_arguments, proofs.cmd_min_blocks),
    Command("pd-prefill", "PD prefill worker: prefill what the decode worker asks for and send "
            "it the KV", pd.pd_prefill_arguments, pd.cmd_pd_prefill),
    Command("pd-decode", "PD decode worker: serve the demo workload with KV from a pd-prefill "
            "worker", pd.pd_decode_arguments, pd.cmd_pd_decode),
    Command("pd-demo", "pd-prefill (subprocess) + pd-decode over gloo on loopback, compared "
            "with the colocated demo", pd_demo.pd_demo_arguments, pd_demo.cmd_pd_demo),
    Command("pd-cluster", "N prefill and M decode workers behind a router, one process each "
            "over gloo (launched here, or under torchrun)", pd_cluster.pd_cluster_arguments,
            pd_cluster.cmd_pd_cluster),
    Command("simulate", "seeded simulation of the batcher and PD workers under injected "
            "faults, checked against the spec and the oracle",
            demo.simulate_arguments, demo.cmd_simulate),
    Command("serve", "an OpenAI-compatible HTTP server (needs the serve extra)",
            serve.serve_arguments, serve.cmd_serve),
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="atom-core", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="command", required=True)
    for c in COMMANDS:
        p = sub.add_parser(c.name, help=c.help)
        c.arguments(p)
        p.set_defaults(func=c.run)
    return ap


# Exit code after Ctrl-C (128 + SIGINT, as a shell reports a process SIGINT ended).
INTERRUPTED = 130

# The PD commands rendezvous through torch.distributed, whose C++ logger prints a native stack
# trace with every failed connection attempt; the commands say what failed in one line of
# their own. `TORCH_CPP_LOG_LEVEL=INFO atom-core ...` brings the native log back.
_QUIET_TORCH_LOG = ("TORCH_CPP_LOG_LEVEL", "FATAL")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "argv", False) is None:  # pd-cluster starts its workers with it
        args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command.startswith("pd-") and "torch" not in sys.modules:
        # (read once, when torch loads; the workers pd-demo and pd-cluster start inherit it)
        os.environ.setdefault(*_QUIET_TORCH_LOG)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback (and with --json, the reason on stdout)
        if getattr(args, "json", False):
            emit({"ok": False, "error": "interrupted"})
        print(f"atom-core {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
