"""The one reader of JSON that comes from outside: a request body, an artifact's rbln_config.json.

Such text is whatever a client or a file holds, so reading it must be total: any bytes give a
value or a `JsonFlaw` saying what is wrong and where, never an exception from deeper down (a
codec's, a recursion's, int()'s digit limit) that a caller would have to know of to catch, nor
a value a later step cannot handle (a lone surrogate no encoder takes, NaN, a number with
thousands of digits). Written once, here, so that every such input is held to the same rules
and a fix reaches every reader; each caller words the flaws for its own users (the server's
400s, the CLI's ConfigErrors) and sets the bounds its input calls for (`Reader`).

Stdlib only: atom_core.config imports it, and config must stay cheap to import (no torch, no
pydantic). The byte size is bounded by the caller, before the bytes are read.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

__all__ = ["JsonFlaw", "LoneSurrogate", "NotFinite", "NotJson", "NotUtf8", "Reader", "TooDeep",
           "TooManyDigits"]


class JsonFlaw(ValueError):
    """Bytes that are no JSON value within a `Reader`'s bounds. `where`: the place of the flaw
    in the value, outermost first (object keys and array indexes as text; a key that is the
    flaw itself JSON-escaped), empty when it is the whole input or has no place."""

    def __init__(self, message: str, where: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.where = where


class NotUtf8(JsonFlaw):
    """Not UTF-8 text (strict: an encoded surrogate is refused too): the codec's `reason`, at
    byte offset `start`, which holds `byte`."""

    def __init__(self, reason: str, start: int, byte: int) -> None:
        super().__init__(f"not UTF-8 text: {reason} (byte 0x{byte:02x} at offset {start})")
        self.reason, self.start, self.byte = reason, start, byte


class NotJson(JsonFlaw):
    """Not JSON: str() is the decoder's message (with line and column), `msg` and `pos` (a
    character offset) its parts."""

    def __init__(self, error: json.JSONDecodeError) -> None:
        super().__init__(str(error))
        self.msg, self.pos = error.msg, error.pos


class TooDeep(JsonFlaw):
    """Arrays and objects nested past `limit` (None: past what the decoder itself takes)."""

    def __init__(self, limit: int | None) -> None:
        super().__init__(f"nested more than {limit} deep" if limit is not None else
                         "nested too deeply to read")
        self.limit = limit


class TooManyDigits(JsonFlaw):
    """An integer literal of `digits` digits (None: not counted), more than `limit`."""

    def __init__(self, digits: int | None, limit: int, where: tuple[str, ...] = ()) -> None:
        super().__init__(f"an integer of more than {limit} digits", where)
        self.digits, self.limit = digits, limit


class NotFinite(JsonFlaw):
    """`literal` (NaN, Infinity, -Infinity: Python's json takes them, JSON has no such values),
    or None: a number too large for a float (it overflows to infinity)."""

    def __init__(self, literal: str | None, where: tuple[str, ...] = ()) -> None:
        super().__init__(f"{literal} is not a JSON number" if literal is not None else
                         "a number too large for a 64-bit float", where)
        self.literal = literal


class LoneSurrogate(JsonFlaw):
    """A string (a key when `in_key`) holding a lone surrogate (a "\\ud800" escape decodes to
    one), which is no Unicode character: `codepoint` at character `index`."""

    def __init__(self, codepoint: int, index: int, in_key: bool,
                 where: tuple[str, ...] = ()) -> None:
        super().__init__(f"a lone surrogate \\u{codepoint:04x} at character {index}", where)
        self.codepoint, self.index, self.in_key = codepoint, index, in_key


class _Marked:
    """What a parse hook returns for a literal that is no value: the walk after the parse
    reports it with its place in the value (a hook does not know the place)."""

    __slots__ = ("flaw",)

    def __init__(self, flaw: JsonFlaw) -> None:
        self.flaw = flaw


class _Deep(Exception):
    pass


_SURROGATE = re.compile("[\ud800-\udfff]")
# the types a list of plain values holds; such a list needs no look at each item (a prompt of
# token ids is a long one)
_PLAIN = frozenset({int, bool, type(None)})


class Reader:
    """Reads JSON within bounds. `max_depth`: the deepest nesting taken (None: the decoder's
    own bound, its recursion); `max_digits`: the longest integer literal (None: int()'s own
    limit, `sys.get_int_max_str_digits`); `finite`: refuse NaN, Infinity and numbers that
    overflow a float; `text`: refuse lone surrogates in strings and keys; `bom`: drop a leading
    UTF-8 byte order mark (as json.loads of bytes does) rather than refuse it."""

    def __init__(self, *, max_depth: int | None, max_digits: int | None, finite: bool = True,
                 text: bool = True, bom: bool = True) -> None:
        self.max_depth, self.max_digits = max_depth, max_digits
        self.finite, self.text, self.bom = finite, text, bom
        # a digit run longer than any integer taken: only then are integers parsed by a hook
        # (a Python call per integer)
        self._long = None if max_digits is None else \
            re.compile(rb"[0-9]{%d,}" % (max_digits + 1))
        self._walks = finite or text or max_depth is not None

    def read(self, raw: bytes) -> Any:
        """The JSON value of `raw`; a `JsonFlaw` (one of its kinds above) if it is none within
        the bounds: the first in the text's order, after the syntax."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise NotUtf8(exc.reason, exc.start, raw[exc.start]) from None
        hooks: dict[str, Any] = {}
        if self.finite:
            hooks["parse_constant"] = _constant
        if self._long is not None and self._long.search(raw):
            hooks["parse_int"] = self._integer
        try:
            value = json.loads(text.removeprefix("\ufeff") if self.bom else text, **hooks)
        except json.JSONDecodeError as exc:
            raise NotJson(exc) from None
        except RecursionError:  # (the decoder's own bound, far past any max_depth)
            raise TooDeep(self.max_depth) from None
        except ValueError:  # (JSONDecodeError is one too) a literal past int()'s digit limit
            raise TooManyDigits(None, sys.get_int_max_str_digits()) from None
        if not self._walks:
            return value
        try:
            found = self._flaw(value, 0)
        except (_Deep, RecursionError):
            raise TooDeep(self.max_depth) from None
        if found is None:
            return value
        where, flaw = found
        where.reverse()
        flaw.where = tuple(where)
        raise flaw

    def _integer(self, literal: str) -> int | _Marked:
        digits = len(literal) - literal.startswith("-")
        assert self.max_digits is not None
        if digits > self.max_digits:
            return _Marked(TooManyDigits(digits, self.max_digits))
        return int(literal)

    def _flaw(self, value: Any, depth: int) -> tuple[list[str], JsonFlaw] | None:
        """The first thing in `value` that is no value within the bounds, as (its location,
        innermost name first; the flaw), or None."""
        kind = type(value)
        if kind is str:
            found = _SURROGATE.search(value) if self.text else None
            return None if found is None else \
                ([], LoneSurrogate(ord(found.group()), found.start(), False))
        if kind is float:
            return None if not self.finite or math.isfinite(value) else ([], NotFinite(None))
        if kind is _Marked:
            return [], value.flaw
        if kind is list:
            if self.max_depth is not None and depth >= self.max_depth:
                raise _Deep
            if set(map(type, value)) <= _PLAIN:
                return None
            for i, item in enumerate(value):
                if (flaw := self._flaw(item, depth + 1)) is not None:
                    flaw[0].append(str(i))
                    return flaw
        elif kind is dict:
            if self.max_depth is not None and depth >= self.max_depth:
                raise _Deep
            for key, item in value.items():
                if self.text and (found := _SURROGATE.search(key)) is not None:
                    return [json.dumps(key)], LoneSurrogate(ord(found.group()), found.start(),
                                                            True)
                if (flaw := self._flaw(item, depth + 1)) is not None:
                    flaw[0].append(key)
                    return flaw
        return None


def _constant(name: str) -> _Marked:
    return _Marked(NotFinite(name))
