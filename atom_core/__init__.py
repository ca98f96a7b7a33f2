"""atom-core: a formally verified KV-cache scheduler for LLM serving on static-shape NPUs.

The core, policy and config need only attrs; `AtomBatcher` (the adapter) also needs torch
(`pip install 'atom-core[torch]'`), and is imported on first use.
"""

from typing import Any

from atom_core import native

native.install()  # (before anything imports the core: the compiled one when it is current)

__all__ = ["AtomBatcher", "Config", "ConfigError", "Event", "Result"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not here: the spec (atom_core.spec, the generator's input) is a
    # subpackage, and importing it must not import the core generated from it (Config reads
    # the generated constants), or a spec the core no longer matches could not be generated.
    if name in ("Config", "ConfigError"):
        from atom_core import config

        return getattr(config, name)
    if name in ("AtomBatcher", "Event", "Result"):
        from atom_core import batcher

        return getattr(batcher, name)
    raise AttributeError(f"module 'atom_core' has no attribute {name!r}")
