"""`atom-core`: the command line. This module is the dispatch table (`COMMANDS`: one row per
subcommand, its arguments and the function that runs it); the commands live by group:

    proofs    verify, check-config, min-blocks, check-trace
    demo      demo, simulate
    pd        pd-prefill, pd-decode (the PD workers)
    pd_demo   pd-demo (both workers on loopback, compared with colocated)
    pd_cluster pd-cluster (N prefill and M decode workers behind a router)
    serve     serve (the HTTP server's own options and body)
    common    JSON and table output, z3 as an extra

and every command's options are parsed by `atom_core.options` (its parser and argument types).

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
from atom_core.options import OptionError, Parser

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
    # (Parser: no abbreviated flags, one-line errors; its subcommands' parsers are Parsers too)
    ap = Parser(prog="atom-core", description=DESCRIPTION)
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    for c in COMMANDS:
        p = sub.add_parser(c.name, help=c.help)
        c.arguments(p)
        p.set_defaults(func=c.run, parser=p)
    return ap


def _options(parser: argparse.ArgumentParser, command: list[str]) -> list[str]:
    """The flags the subcommand `command` (a list of its name, or empty) takes."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices.get(command[0]) if command else None
    return [s for a in chosen._actions for s in a.option_strings] if chosen else []


def _version() -> str:
    """The installed package's version (its metadata: what pip installed, not a constant to
    keep in step)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("atom-core")
    except PackageNotFoundError:
        return "(not installed: no package metadata)"


# Exit code after Ctrl-C (128 + SIGINT, as a shell reports a process SIGINT ended).
INTERRUPTED = 130

# The PD commands rendezvous through torch.distributed, whose C++ logger prints a native stack
# trace with every failed connection attempt; the commands say what failed in one line of
# their own. `TORCH_CPP_LOG_LEVEL=INFO atom-core ...` brings the native log back.
_QUIET_TORCH_LOG = ("TORCH_CPP_LOG_LEVEL", "FATAL")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the command's parser: its flags are the ones to suggest
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except OptionError as exc:
        # said on stderr already; with --json (a command that takes it), also the one JSON
        # object on stdout
        if "--json" in argv and "--json" in _options(parser, argv[:1]):
            key = "safe" if argv[:1] == ["check-config"] else "ok"
            emit({key: False, "error": exc.message})
        raise
    if getattr(args, "argv", False) is None:  # pd-cluster starts its workers with it
        args.argv = argv
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
