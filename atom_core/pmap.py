"""A small persistent (immutable) mapping for request-indexed state.

A transition that changes a few requests must not copy a dict of every request ever seen.
`PMap` keeps a frozen `base` dict, shared between versions and never mutated, plus a small
`delta` dict that is copied on write. When the delta grows past max(32, len(base) // 8)
entries it is merged into a new base, so a write costs O(len(delta)) and merges amortize.

Keys whose value equals the default are not stored: `get` returns the default for them (or,
like `dict.get`, its second argument when given) and `set(k, default)` removes `k`.
Iteration order is deterministic for a given history but not a function of the content;
compare with `==` or `to_dict()`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any

_GONE = object()  # delta marker: key removed from base
_OWN = object()  # get's default: the map's own


class PMap:
    __slots__ = ("_base", "_delta", "_default", "_len")

    def __init__(self, mapping: Mapping[Any, Any] | Iterable[tuple[Any, Any]] | None = None,
                 default: Any = None) -> None:
        if isinstance(mapping, PMap):
            mapping = mapping.to_dict()
        items = dict(mapping or ()).items()
        self._base = {k: v for k, v in items if not _is(v, default)}
        self._delta: dict[Any, Any] = {}
        self._default = default
        self._len = len(self._base)

    def get(self, key: Hashable, default: Any = _OWN) -> Any:
        """The value at `key`; for an absent key (one at the map's default), `default` when
        given, as `dict.get`, else the map's default. The generated core passes the map's own
        default (`_D_<field>`), so that its reads are the in-place core's plain-dict reads."""
        d = self._delta
        if key in d:
            v = d[key]
            if v is not _GONE:
                return v
        elif key in self._base:
            return self._base[key]
        return self._default if default is _OWN else default

    def set(self, key: Hashable, value: Any) -> PMap:
        # The one-key case of set_many, inlined: it is on every transition's hot path.
        base, delta, default = self._base, self._delta, self._default
        cur = delta[key] if key in delta else base.get(key, _GONE)
        if value is default or value == default:
            value = _GONE
        if cur is value:
            return self
        n = self._len + (cur is _GONE) - (value is _GONE)
        if (base[key] is value) if key in base else (value is _GONE):
            delta = delta.copy()
            del delta[key]  # back to the base state: drop the delta entry
        else:
            delta = delta.copy()
            delta[key] = value
            if len(delta) > 32 and len(delta) > len(base) // 8:  # max(32, ...) without a call
                base, delta = _merge(base, delta), {}
        out = object.__new__(PMap)
        out._base, out._delta, out._default, out._len = base, delta, default, n
        return out

    def set_many(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> PMap:
        if isinstance(items, Mapping):
            items = items.items()
        base, default, n = self._base, self._default, self._len
        delta = self._delta
        copied = False
        for k, v in items:
            cur = delta[k] if k in delta else base.get(k, _GONE)
            if _is(v, default):
                v = _GONE
            if cur is v:
                continue
            n += (cur is _GONE) - (v is _GONE)
            if not copied:
                delta, copied = dict(delta), True
            if (base[k] is v) if k in base else (v is _GONE):
                del delta[k]  # back to the base state: drop the delta entry
            else:
                delta[k] = v
        if not copied:
            return self
        if len(delta) > max(32, len(base) // 8):
            base, delta = _merge(base, delta), {}
        out = object.__new__(PMap)
        out._base, out._delta, out._default, out._len = base, delta, default, n
        return out

    def __contains__(self, key: Hashable) -> bool:
        d = self._delta
        return d[key] is not _GONE if key in d else key in self._base

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        return (k for k, _ in self.items())

    def keys(self) -> Iterator[Any]:
        return iter(self)

    def items(self) -> Iterator[tuple[Any, Any]]:
        d = self._delta
        yield from ((k, v) for k, v in self._base.items() if k not in d)
        yield from ((k, v) for k, v in d.items() if v is not _GONE)

    def to_dict(self) -> dict[Any, Any]:
        return dict(self.items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PMap):
            return NotImplemented
        if self is other:
            return True
        if self._len != other._len or not _is(self._default, other._default):
            return False
        return all(k in other and _is(other.get(k), v) for k, v in self.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PMap({self.to_dict()!r}, default={self._default!r})"


def _merge(base: dict[Any, Any], delta: dict[Any, Any]) -> dict[Any, Any]:
    """A new base: `base` with `delta` applied (neither is mutated)."""
    out = {**base, **delta}
    for k in [k for k, v in delta.items() if v is _GONE]:
        del out[k]
    return out


def _is(a: Any, b: Any) -> bool:
    return a is b or a == b
