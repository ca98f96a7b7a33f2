"""Runtimes the batcher drives: the RBLN graph interface, a torch reference, the RBLN binding."""

from atom_core.runtime.protocol import Runtime, RuntimeInputError
from atom_core.runtime.rbln import RblnRuntime, RblnUnavailableError
from atom_core.runtime.reference import RuntimeSpec, TorchReferenceRuntime

__all__ = [
    "RblnRuntime",
    "RblnUnavailableError",
    "Runtime",
    "RuntimeInputError",
    "RuntimeSpec",
    "TorchReferenceRuntime",
]
