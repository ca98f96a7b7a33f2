"""A PD link end whose messages the simulation can drop, duplicate, corrupt or send again
late (`SimLink`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from atom_core.pd.transport import InProcessTransport, TransportError


class SimLink:
    """One end of the in-process pair as its worker sees it. Armed faults act on the next
    message this end sends ("corrupt" on the next KV payload); every message sent is kept so
    that a copy can arrive again later ("late"). hold/release/kill are the transport's own
    hooks, on `inner`."""

    def __init__(self, inner: InProcessTransport, on_fault: Callable[[str], None]) -> None:
        self.inner, self._on_fault = inner, on_fault
        self.history: list[tuple[dict[str, Any], torch.Tensor | None]] = []
        self.armed: list[str] = []
        self.held = False

    def __getattr__(self, name: str) -> Any:  # poll, wait, close, stats
        return getattr(self.inner, name)

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        # a KV payload travels sealed (kind "sealed", "k": "kv") over the workers' SecureLink
        is_kv = header.get("kind") == "kv" or header.get("k") == "kv"
        fault = next((f for f in self.armed if f != "corrupt" or is_kv), None)
        if fault is not None:
            self.armed.remove(fault)
        self.history.append((dict(header), None if tensor is None else tensor.clone()))
        if fault == "corrupt" and tensor is not None:
            tensor = tensor.clone()
            tensor.reshape(-1).view(torch.uint8)[7] ^= 0x10  # the AEAD tag must catch it
        if fault == "drop":
            self.inner.drop_next(1)
        self.inner.send(header, tensor)
        if fault == "duplicate":
            self.inner.send(header, tensor)
        if fault is not None:
            self._on_fault(fault)

    def resend(self, index: int) -> bool:
        header, tensor = self.history[index]
        try:
            self.inner.send(header, tensor)
        except TransportError:
            return False
        return True
