"""A runtime whose calls the simulation can make fail (`FaultyRuntime`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class InjectedFault(RuntimeError):
    """Raised by a runtime call the simulation made fail."""


# runtime call -> fault kind
_CALL_KIND = {"prefill": "prefill", "decode": "decode", "copy_kv_cache": "copy",
              "fetch_kv_cache": "fetch", "fetch_local_cache": "fetch",
              "update_kv_cache": "update", "update_local_cache": "update",
              "new_host_buffer": "alloc", "new_local_host_buffer": "alloc"}


class FaultyRuntime:
    """Delegates to `inner`; an armed call first scribbles junk over everything it would have
    written (the worst a half-finished device call can do), then raises `InjectedFault`."""

    def __init__(self, inner: Any, junk: torch.Generator,
                 on_fire: Callable[[str], None]) -> None:
        self.inner, self._junk, self._on_fire = inner, junk, on_fire
        self._armed: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arm(self, call: str) -> bool:
        if call in self._armed:
            return False
        self._armed.add(call)
        return True

    def disarm(self) -> None:
        self._armed.clear()

    def _fire(self, call: str, scribble: Callable[[], None]) -> None:
        if call not in self._armed:
            return
        self._armed.discard(call)
        scribble()
        self._on_fire(_CALL_KIND[call])
        raise InjectedFault(f"injected {call} fault")

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        return (torch.randn(like.shape, generator=self._junk) * 50).to(like.dtype)

    def _scribble_block(self, block: int) -> None:
        host = self.inner.new_host_buffer()
        self.inner.update_kv_cache(self._noise(host), block)

    def _scribble_slot(self, slot: int, ring_index: int | None = None) -> None:
        host = self.inner.new_local_host_buffer()
        if ring_index is None:
            host = self._noise(host)
        else:  # one ring entry: a decode row writes its own position only
            self.inner.fetch_local_cache(host, slot)
            host[:, :, :, ring_index] = self._noise(host[:, :, :, ring_index])
        self.inner.update_local_cache(host, slot)

    def _prefill_writes(self, input_ids: Any, cache_position: Any, block_tables: Any,
                        local_block_tables: Any, query_position: Any) -> None:
        self._scribble_block(int(block_tables[0]))
        if local_block_tables is not None:  # the lane fails: its whole slot is fair game
            self._scribble_slot(int(local_block_tables[0]))

    def _decode_writes(self, input_ids: Any, cache_position: Any, block_tables: Any,
                       local_block_tables: Any) -> None:
        for b in sorted({int(x) for x in block_tables[:, 0]}):
            self._scribble_block(b)
        if local_block_tables is not None:
            w = self.inner.sliding_window
            for row in range(len(local_block_tables)):
                self._scribble_slot(int(local_block_tables[row, 0]),
                                    int(cache_position[row, 0]) % w)

    def prefill(self, input_ids: Any, cache_position: Any, block_tables: Any,
                local_block_tables: Any, query_position: Any) -> Any:
        args = (input_ids, cache_position, block_tables, local_block_tables, query_position)
        self._fire("prefill", lambda: self._prefill_writes(*args))
        return self.inner.prefill(*args)

    def decode(self, input_ids: Any, cache_position: Any, block_tables: Any,
               local_block_tables: Any) -> Any:
        args = (input_ids, cache_position, block_tables, local_block_tables)
        self._fire("decode", lambda: self._decode_writes(*args))
        return self.inner.decode(*args)

    def mixed(self, decode: Any, prefills: Any) -> Any:
        """A runtime with `mixed_calls` runs a decode and prompt chunks in one forward: a fault
        armed for either kind of part fails the whole call, after scribbling over everything
        any of its parts would have written (the batcher fails every row of it)."""
        def scribble() -> None:
            if decode is not None:
                self._decode_writes(*decode)
            for args in prefills:
                self._prefill_writes(*args)
        for call in ("decode",) * (decode is not None) + ("prefill",) * bool(prefills):
            self._fire(call, scribble)
        return self.inner.mixed(decode, prefills)

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        self._fire("copy_kv_cache", lambda: self._scribble_block(int(dst)))
        self.inner.copy_kv_cache(src, dst, num_tokens)

    # host memory running out: the allocation raises before anything is written
    def new_host_buffer(self) -> Any:
        self._fire("new_host_buffer", lambda: None)
        return self.inner.new_host_buffer()

    def new_local_host_buffer(self) -> Any:
        self._fire("new_local_host_buffer", lambda: None)
        return self.inner.new_local_host_buffer()

    def fetch_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._fire("fetch_kv_cache", lambda: host_tensor.copy_(self._noise(host_tensor)))
        self.inner.fetch_kv_cache(host_tensor, block)

    def fetch_local_cache(self, host_tensor: Any, slot: int) -> None:
        self._fire("fetch_local_cache", lambda: host_tensor.copy_(self._noise(host_tensor)))
        self.inner.fetch_local_cache(host_tensor, slot)

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        self._fire("update_kv_cache", lambda: self._scribble_block(int(block)))
        self.inner.update_kv_cache(host_tensor, block)

    def update_local_cache(self, host_tensor: Any, slot: int) -> None:
        self._fire("update_local_cache", lambda: self._scribble_slot(int(slot)))
        self.inner.update_local_cache(host_tensor, slot)
