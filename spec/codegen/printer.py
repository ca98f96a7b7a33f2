"""The pretty printer of the generated code: a small Wadler-style document (`Group`, `Nest`,
`Line`, `IfBreak`), `render`, and the builders of the brackets, calls, comprehensions and
literals the generators emit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

WIDTH = 100


# --------------------------------------------------------------------------- pretty printer
# A small Wadler-style document: str | list | Group | Nest | Line | IfBreak. A Group is laid
# out flat when it fits in the line, else its Lines become newlines. Every Line the printer
# emits sits inside brackets, so a broken line is always valid Python.


class Group:
    __slots__ = ("doc",)

    def __init__(self, doc: Any) -> None:
        self.doc = doc


class Nest:
    __slots__ = ("indent", "doc")

    def __init__(self, indent: int, doc: Any) -> None:
        self.indent, self.doc = indent, doc


class Line:
    __slots__ = ("flat",)

    def __init__(self, flat: str) -> None:
        self.flat = flat


class IfBreak:
    __slots__ = ("broken", "flat")

    def __init__(self, broken: str, flat: str) -> None:
        self.broken, self.flat = broken, flat


SOFT = Line("")
SPACE = Line(" ")
_FLAT, _BREAK = 0, 1


def _fits(width: int, head: list[tuple[int, int, Any]], rest: list[tuple[int, int, Any]]) -> bool:
    stack = list(head)
    ri = len(rest)
    while width >= 0:
        if not stack:
            if ri == 0:
                return True
            ri -= 1
            stack.append(rest[ri])
        ind, mode, d = stack.pop()
        if isinstance(d, str):
            width -= len(d)
        elif isinstance(d, list):
            stack.extend((ind, mode, x) for x in reversed(d))
        elif isinstance(d, Group):
            stack.append((ind, mode, d.doc))
        elif isinstance(d, Nest):
            stack.append((ind + d.indent, mode, d.doc))
        elif isinstance(d, Line):
            if mode == _BREAK:
                return True
            width -= len(d.flat)
        else:
            width -= len(d.broken if mode == _BREAK else d.flat)
    return False


def render(doc: Any, indent: int = 0, width: int = WIDTH) -> str:
    """Lay out `doc` starting at column `indent` (the caller writes the indentation)."""
    out: list[str] = []
    col = indent
    stack: list[tuple[int, int, Any]] = [(indent, _BREAK, doc)]
    while stack:
        ind, mode, d = stack.pop()
        if isinstance(d, str):
            out.append(d)
            col += len(d)
        elif isinstance(d, list):
            stack.extend((ind, mode, x) for x in reversed(d))
        elif isinstance(d, Group):
            if mode == _FLAT or _fits(width - col, [(ind, _FLAT, d.doc)], stack):
                stack.append((ind, _FLAT, d.doc))
            else:
                stack.append((ind, _BREAK, d.doc))
        elif isinstance(d, Nest):
            stack.append((ind + d.indent, mode, d.doc))
        elif isinstance(d, Line):
            if mode == _FLAT:
                out.append(d.flat)
                col += len(d.flat)
            else:
                out.append("\n" + " " * ind)
                col = ind
        else:
            text = d.broken if mode == _BREAK else d.flat
            out.append(text)
            col += len(text)
    return "".join(out)


def join(items: Iterable[Any], sep: Any) -> list[Any]:
    out: list[Any] = []
    for i, x in enumerate(items):
        if i:
            out.append(sep)
        out.append(x)
    return out


def bracket(open_: str, inner: Any, close: str) -> Group:
    return Group([open_, Nest(4, [SOFT, inner]), SOFT, close])


def call_doc(fn: str, args: list[Any]) -> Group:
    """A call; broken one argument per line with a trailing comma."""
    return bracket(fn + "(", [join(args, [",", SPACE]), IfBreak(",", "")], ")")


def genexpr(fn: str, body: Any, clauses: list[str]) -> Group:
    """fn(body for ... [if ...]): no trailing comma after a generator."""
    return bracket(fn + "(", [body, *([SPACE, c] for c in clauses)], ")")


def tabulate_doc(body: Any, clauses: list[str]) -> Group:
    """tuple([body for ...]): a list comprehension runs faster than a generator."""
    return bracket("tuple([", [body, *([SPACE, c] for c in clauses)], "])")


def chunks(text: str, width: int = 72) -> list[str]:
    """`text` cut after spaces into pieces of about `width` characters that concatenate to it."""
    out = [""]
    for word in text.split(" "):
        if out[-1] and len(out[-1]) + len(word) >= width:
            out[-1] += " "
            out.append(word)
        else:
            out[-1] += (" " if out[-1] else "") + word
    return out


def tuple_doc(items: list[Any]) -> Any:
    if not items:
        return "()"
    if len(items) == 1:
        return bracket("(", [items[0], ","], ")")
    return bracket("(", [join(items, [",", SPACE]), IfBreak(",", "")], ")")


def dict_doc(items: list[Any]) -> Any:
    return bracket("{", [join(items, [",", SPACE]), IfBreak(",", "")], "}")
