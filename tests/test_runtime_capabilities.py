"""A runtime is checked once, at construction (`protocol.capabilities`): what it lacks is
refused by name, and what it can do is a record the batcher reads instead of the runtime."""

from __future__ import annotations

from typing import Any

import pytest

from atom_core.batcher import AtomBatcher, check_runtime
from atom_core.config import Config, min_kv_blocks
from atom_core.runtime import TorchReferenceRuntime
from atom_core.runtime.protocol import (
    HOST_OPS,
    REQUIRED_ATTRIBUTES,
    REQUIRED_METHODS,
    Capabilities,
    RuntimeProtocolError,
    capabilities,
)

CFG = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic", 2), max_seq_len=256,
             block_size=128, prefill_chunk=64, prefix_cache=True, host_cache_blocks=2)
# what a capability is read as (the attributes the batcher used to probe on every use)
CAPABILITY_NAMES = {*REQUIRED_ATTRIBUTES, "static_batch", "mixed_calls", "mixed_prefill_tokens",
                    "prompt_logits", "host_kv_transfers", "sliding_window"}


class Proxy:
    """`inner` with some members hidden (or replaced), recording every member read."""

    def __init__(self, inner: Any, hide: tuple[str, ...] = (), **extra: Any) -> None:
        self.__dict__.update(_inner=inner, _hide=set(hide), _extra=extra, reads=[])

    def __getattr__(self, name: str) -> Any:
        if name in self._hide:
            raise AttributeError(name)
        self.reads.append(name)
        return self._extra[name] if name in self._extra else getattr(self._inner, name)


def _runtime() -> TorchReferenceRuntime:
    return TorchReferenceRuntime.tiny(CFG, seed=0)


def test_the_reference_runtime_reads_as_its_capabilities() -> None:
    rt = _runtime()
    caps = capabilities(rt)
    assert caps == Capabilities(
        name="TorchReferenceRuntime",
        qualname="atom_core.runtime.reference.TorchReferenceRuntime", num_blocks=CFG.kv_blocks,
        block_size=128,
        max_seq_len=256, prefill_chunk=64, batch_size=2, decoder_batch_sizes=(2,),
        vocab_size=rt.vocab_size, hybrid=False, sliding_window=None,
        static_batch=rt.static_batch is not False, mixed_calls=False,
        mixed_prefill_tokens=None, prompt_logits=getattr(rt, "prompt_logits", False) is True,
        host_ops=True, host_kv_trusted=True, local_ops=caps.local_ops)
    assert check_runtime(CFG, rt) == caps


@pytest.mark.parametrize("missing", [*REQUIRED_METHODS, *REQUIRED_ATTRIBUTES])
def test_a_runtime_missing_a_member_is_refused_by_name(missing: str) -> None:
    rt = Proxy(_runtime(), hide=(missing,))
    with pytest.raises(RuntimeProtocolError) as err:
        AtomBatcher(CFG, rt)
    msg = str(err.value)
    assert msg.startswith("Proxy is not a runtime atom-core can drive: it lacks ")
    # the one missing member is the only one named, with what it is for
    listed = msg.removeprefix("Proxy is not a runtime atom-core can drive: it lacks ")
    listed = listed.split("; implement the Runtime protocol (atom_core/runtime/protocol.py)")[0]
    assert listed == (f"{missing}()" if missing in REQUIRED_METHODS
                      else f"{missing} ({REQUIRED_ATTRIBUTES[missing]})")
    assert isinstance(err.value, ValueError)  # the commands print a bad runtime's ValueError


def test_a_method_that_is_not_callable_is_refused() -> None:
    rt = Proxy(_runtime(), decode_batch_size=2)
    with pytest.raises(RuntimeProtocolError, match=r"lacks decode_batch_size\(\)"):
        capabilities(rt)


def test_some_host_transfers_but_not_all_are_refused() -> None:
    rt = Proxy(_runtime(), hide=(HOST_OPS[2],))
    with pytest.raises(RuntimeProtocolError,
                       match=r"has some host-tier transfers \(new_host_buffer, fetch_kv_cache\) "
                             r"but lacks update_kv_cache\(\)"):
        capabilities(rt)


def test_none_of_the_host_transfers_serves_without_a_host_tier() -> None:
    rt = Proxy(_runtime(), hide=HOST_OPS)
    assert capabilities(rt).host_ops is False
    with pytest.raises(ValueError, match="host_cache_blocks: the host tier stores and loads"):
        AtomBatcher(CFG, rt)
    no_host = Config(**{**{f: getattr(CFG, f) for f in ("lanes", "kv_blocks", "max_seq_len",
                                                         "block_size", "prefill_chunk",
                                                         "prefix_cache")}})
    AtomBatcher(no_host, rt)


def test_mixed_calls_without_mixed_is_refused() -> None:
    rt = Proxy(_runtime(), hide=("mixed",), mixed_calls=True)
    with pytest.raises(RuntimeProtocolError, match=r"says mixed_calls but lacks mixed\("):
        capabilities(rt)


def test_the_capabilities_are_read_once_at_construction() -> None:
    rt = Proxy(_runtime())
    b = AtomBatcher(CFG, rt)
    assert CAPABILITY_NAMES & set(rt.reads)  # read at construction...
    rt.reads.clear()
    for i in range(3):
        b.submit([1 + i, 2, 3, 4] * 20, 8)
    results = b.run_until_done()
    assert all(r.error is None and len(r.tokens) == 8 for r in results.values())
    assert "prefill" in rt.reads and "decode" in rt.reads
    assert not CAPABILITY_NAMES & set(rt.reads)  # ...and never again
