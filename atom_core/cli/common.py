"""What every command group shares: JSON and table output (errors included), z3 as an extra,
a free port (the argument types are `atom_core.options`')."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Callable
from typing import Any

from atom_core.options import positive

__all__ = ["NEEDS_VERIFY", "emit", "fail", "free_port", "html_argument", "positive", "table",
           "write_html", "z3_or_exit"]

NEEDS_VERIFY = "this command needs z3: pip install 'atom-core[verify]'"


def z3_or_exit() -> None:
    try:
        import z3  # noqa: F401
    except ImportError:
        print(NEEDS_VERIFY, file=sys.stderr)
        raise SystemExit(2) from None


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, indent=None, sort_keys=False))


def fail(args: argparse.Namespace, message: str, code: int = 2) -> int:
    """`code`, after saying `message` on stderr and, with --json, as the one JSON object on
    stdout (`{"ok": false, "error": ...}`: a caller parsing stdout gets the reason, not an
    empty line)."""
    if getattr(args, "json", False):
        emit({"ok": False, "error": message})
    print(message, file=sys.stderr)
    return code


def table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with the verify extra; plain text otherwise
        print(title)
        print("  ".join(columns))
        for r in rows:
            print("  ".join(r))
        return
    console = Console()
    if not console.is_terminal:
        # piped or redirected (80 columns by default): rows as wide as they need, so every
        # invariant and action name stays whole and a grep finds it
        console = Console(width=10_000)
    t = Table(title=title)
    for c in columns:
        t.add_column(c, overflow="fold")  # (a narrow terminal folds a name, never cuts it)
    for r in rows:
        t.add_row(*r)
    console.print(t)


def free_port(host: str) -> int:
    """A port free on `host` now (the OS picks it), for a store or worker to bind."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def html_argument(p: argparse.ArgumentParser, what: str) -> None:
    """--html FILE: the command's picture (`atom_core.viz`), beside its usual output."""
    p.add_argument("--html", default=None, metavar="FILE",
                   help=f"also write {what} to FILE: one standalone HTML page (inline SVG, "
                        "nothing fetched), drawn from the --json output, which it carries")


def write_html(args: argparse.Namespace, draw: Callable[[], str], key: str = "ok") -> int | None:
    """Write the page `draw()` makes to --html's FILE; None when written (said on stderr), else
    the exit code after saying why (with --json, as its one object, `key` false). A page
    whose records do not replay (ValueError) is a bug: no picture rather than a wrong one."""
    from atom_core.viz import write_page

    try:
        text = draw()
    except ValueError as exc:
        message, code = f"--html: the picture was not drawn: {exc}", 3
    else:
        try:
            write_page(args.html, text)
        except OSError as exc:
            message, code = f"--html: cannot write {args.html}: {exc.strerror}", 2
        else:
            print(f"wrote {args.html}", file=sys.stderr)
            return None
    if getattr(args, "json", False):
        emit({key: False, "error": message})
    print(message, file=sys.stderr)
    return code
