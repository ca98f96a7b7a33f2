"""The command line's validated options layer: the parser every `atom-core` command uses (no
abbreviated flags, a mistake said in one line) and the argument types that refuse, while the
arguments are parsed and before anything heavy is imported (torch, transformers, a model), each
value that cannot mean anything: not a number, nan or inf, negative or zero where that has no
meaning, or past what the command can use. Each message names the option and what to give.

(Its own module, below `atom_core.cli`: `atom_core.serve.main` builds the serve command's
options with it and is imported by `atom_core.cli` in turn.)"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from atom_core.config import INT16_IDS, INT32_POSITIONS

# The longest a command waits (seconds): about 11.6 days. Past it a timeout is a typo, and
# threads, asyncio and torch.distributed refuse or overflow on larger ones.
MAX_SECONDS = 1_000_000
# Seeds: what every generator the commands seed takes (torch's is 64-bit).
MAX_SEED = 2**63 - 1
# A workload past these is a typo (each request and its tokens are held in memory).
MAX_REQUESTS = 1_000_000
MAX_NEW_TOKENS = 1_000_000


def _quote(text: str) -> str:
    """`text` as a message quotes it, cut short (a value may be a thousand digits long)."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def integer(least: int = 1, most: int | None = None, zero: str = "",
            why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in least..most. `zero`: what 0 means, when it is allowed
    and means something of its own; `why`: why `most` (both said in the message)."""
    if least == 1 and most is None:
        what = "a positive integer"
    elif most is None:
        what = f"an integer >= {least}"
    else:
        what = f"an integer in {least}..{most}"
    notes = [f"0: {zero}"] * bool(zero) + [why] * bool(why)
    if notes:
        what += f" ({'; '.join(notes)})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {_quote(text)}") from None
        if value < least or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"must be {what}, got {_quote(text)}")
        return value

    parse.__name__ = "integer"  # (argparse names the type in some messages)
    return parse


def seconds(zero: str = "", most: float = MAX_SECONDS, unit: str = "seconds",
            scale: float = 1.0) -> Callable[[str], float]:
    """An argparse type: a finite duration > 0 (>= 0 when `zero` says what 0 means), at most
    `most` seconds; `unit` and `scale` for one given in other units (minutes: 60)."""
    what = f"{unit} > 0" + (f" (0: {zero})" if zero else "") + \
        f", finite and at most {most / scale:.0f}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {_quote(text)}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero) \
                or value * scale > most:
            raise argparse.ArgumentTypeError(f"must be {what}, got {_quote(text)}")
        return value

    parse.__name__ = "seconds"
    return parse


def port(zero: str = "") -> Callable[[str], int]:
    """An argparse type: a TCP port, 1..65535 (0..65535 when `zero` says what 0 means)."""
    what = "a port in " + ("0..65535 (0: " + zero + ")" if zero else "1..65535")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {_quote(text)}") from None
        if not (0 if zero else 1) <= value <= 65535:
            raise argparse.ArgumentTypeError(f"must be {what}, got {_quote(text)}")
        return value

    parse.__name__ = "port"
    return parse


positive = integer()
non_negative = integer(0)
seed = integer(0, MAX_SEED)

# An artifact's sizes, as Config bounds them (rule 'int16-ids'): said while parsing, in the
# option's words, before any command does arithmetic on them.
_IDS = "rule 'int16-ids': the runtime's block, lane and chunk ids are int16"
count = integer(1, INT16_IDS, why=_IDS)  # lanes, KV blocks, a prefill chunk
slots = integer(0, INT16_IDS, zero="none", why=_IDS)  # host cache slots
length = integer(1, INT32_POSITIONS, why="positions are int32")  # tokens


class OptionError(SystemExit):
    """A usage error, said already (one line on stderr): exit 2, as argparse's own. `message`
    for a caller that also reports it elsewhere (`--json`'s object on stdout)."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse, with no abbreviated flags (`--max-se 512` is not `--max-seq-len`: a flag
    added later would silently change what an abbreviation means) and every mistake in one
    line that names the option and what to give (the usage is `--help`'s)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            message += self._did_you_mean(message.split(":", 1)[1].split())
        text = f"{self.prog}: error: {message} (see `{self.prog} --help`)"
        print(text, file=sys.stderr)
        raise OptionError(message)

    def _did_you_mean(self, unknown: list[str]) -> str:
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        hints = []
        for arg in unknown:
            name = arg.split("=", 1)[0]
            if not name.startswith("--"):
                continue
            close = [f for f in flags if f.startswith(name)] or \
                difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
            if close:
                hints.append(f"{name}: did you mean {' or '.join(close[:3])}?")
        return f" ({'; '.join(hints)})" if hints else ""
