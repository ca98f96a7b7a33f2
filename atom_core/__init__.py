"""atom-core: a formally verified KV-cache scheduler for LLM serving on static-shape NPUs.

The core, policy and config need only attrs; `AtomBatcher` (the adapter) also needs torch
(`pip install 'atom-core[torch]'`), and is imported on first use.
"""

from typing import Any

from atom_core import native

native.install()  # (before anything imports the core: the compiled one when it is current)

from atom_core.config import Config, ConfigError  # noqa: E402

__all__ = ["AtomBatcher", "Config", "ConfigError", "Event", "Result"]


def __getattr__(name: str) -> Any:
    if name in ("AtomBatcher", "Event", "Result"):
        from atom_core import batcher

        return getattr(batcher, name)
    raise AttributeError(f"module 'atom_core' has no attribute {name!r}")
