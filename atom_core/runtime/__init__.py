"""Runtimes the batcher drives: the RBLN graph interface, a torch reference, the RBLN binding;
`registry` names them for the commands.

The names below are imported on first use (PEP 562), so that `atom_core.runtime.registry`, which
the commands read to parse `--runtime`, imports no torch."""

from importlib import import_module
from typing import Any

_WHERE = {
    "RblnRuntime": "atom_core.runtime.rbln",
    "RblnUnavailableError": "atom_core.runtime.rbln",
    "Runtime": "atom_core.runtime.protocol",
    "RuntimeInputError": "atom_core.runtime.protocol",
    "RuntimeSpec": "atom_core.runtime.reference",
    "TorchReferenceRuntime": "atom_core.runtime.reference",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
