"""A fake `rebel` (the private RBLN SDK) for tests: enough of its surface for optimum-rbln 0.12.0
to import (its config classes, graph signatures and runtime models are pure Python) and for
`RblnRuntime.from_compiled` to load graphs.

Never shipped in atom_core: tests put it into `sys.modules` (`install`) for their duration.
A graph (`FakeGraph`) checks every call against the (dtype, shape) list it was given, which the
conformance test takes from optimum-rbln's own `get_input_info`, records the call, and returns
logits of the shape the compiled graph would.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

Signature = list[tuple[torch.dtype, tuple[int, ...]]]


class FakeGraph:
    """One compiled graph: `signature` is its input list; `rows` the leading shape of its
    logits (`vocab` wide)."""

    def __init__(self, name: str, signature: Signature, rows: tuple[int, ...], vocab: int,
                 **kwargs: Any) -> None:
        self.name, self.signature, self.rows, self.vocab = name, signature, rows, vocab
        self.kwargs = kwargs
        self.calls: list[list[torch.Tensor]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert not kwargs, f"{self.name}: graphs are called positionally, got {sorted(kwargs)}"
        got = [(a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else type(a)
               for a in args]
        assert got == self.signature, (
            f"{self.name}: called with {got}, compiled for {self.signature}")
        self.calls.append([a.clone() for a in args])
        return torch.zeros(*self.rows, self.vocab)

    def _copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        self.calls.append([torch.tensor([src, dst, num_tokens])])


@contextmanager
def installed(make_graph: Callable[[str, dict[str, Any]], Any]) -> Iterator[types.ModuleType]:
    """`rebel` (and the submodules optimum-rbln imports) in `sys.modules` while the context
    lasts. `make_graph(path, runtime_kwargs)` builds what `rebel.Runtime(compiled, ...)`
    returns for the compiled file at `path`."""
    rebel = types.ModuleType("rebel")

    class RBLNCompiledModel:
        def __init__(self, path: str) -> None:
            assert Path(path).exists(), f"no compiled file {path}"
            self.path = path

    class Runtime:  # a class: optimum-rbln uses it in annotations (`rebel.Runtime | None`)
        def __new__(cls, compiled: RBLNCompiledModel, **kwargs: Any) -> Any:
            return make_graph(compiled.path, kwargs)

    def unavailable(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("the fake rebel cannot compile or query an NPU")

    rebel.RBLNCompiledModel = RBLNCompiledModel
    rebel.Runtime = Runtime
    rebel.__version__ = "0.0.0+fake"
    for name in ("compile", "compile_from_torch", "device_count"):
        setattr(rebel, name, unavailable)
    rebel.get_npu_name = lambda *_a, **_k: None  # no NPU: optimum-rbln's defaults apply
    rebel.npu_is_available = lambda *_a, **_k: False
    compile_context = types.ModuleType("rebel.compile_context")
    compile_context.CompileContext = type("CompileContext", (), {})
    rebel.compile_context = compile_context
    kv_cache = types.ModuleType("rebel.kv_cache")
    kv_cache.aligned_tensor = lambda n, dtype, alignment, tensor_type: torch.zeros(
        n, dtype=torch.float16)
    rebel.kv_cache = kv_cache
    mods = {"rebel": rebel, "rebel.compile_context": compile_context, "rebel.kv_cache": kv_cache}
    saved = {k: sys.modules.get(k) for k in mods}
    sys.modules.update(mods)
    try:
        yield rebel
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
