"""The runtimes by name (atom_core/runtime/registry.py): one registry the commands choose from."""

from __future__ import annotations

import subprocess
import sys

import pytest

from atom_core.batcher import AtomBatcher
from atom_core.cli import pd as cli_pd
from atom_core.config import Config
from atom_core.runtime import registry
from atom_core.runtime.registry import RuntimeKind, RuntimeRequest, UnknownRuntimeError
from atom_core.serve import runtimes as serve_runtimes

CFG = Config(lanes=2, kv_blocks=4, max_seq_len=128, block_size=128, prefill_chunk=64)


def test_the_registry_imports_no_torch() -> None:
    code = ("import sys; import atom_core.runtime.registry, atom_core.serve.runtimes; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_built_in_runtimes_in_order() -> None:
    assert registry.names()[:3] == ("reference", "hf", "rbln")
    assert cli_pd._loadable()[:3] == ("reference", "hf", "rbln")
    with pytest.raises(UnknownRuntimeError,
                       match=r"^--runtime nope: unknown; give one of \['hf', 'rbln', 'reference'"):
        registry.get("nope")


def test_a_loaded_reference_runtime_serves_and_matches_its_oracle() -> None:
    kind = registry.get("reference")
    assert kind.load is not None and kind.oracle is not None and kind.pd_refusal is None
    rt = kind.load(CFG, RuntimeRequest(seed=3, vocab_size=100))
    assert (rt.vocab_size, rt.num_blocks, rt.prefill_chunk) == (100, 4, 64)
    b = AtomBatcher(CFG, rt)
    prompt = [5, 6, 7, 8, 9] * 7
    rid = b.submit(prompt, 6)
    assert b.run_until_done()[rid].tokens == kind.oracle(rt).generate(prompt, 6)


def test_what_cannot_run_where_is_said_by_the_registry() -> None:
    rbln = registry.get("rbln")
    assert rbln.oracle is None and rbln.pd_refusal is not None
    assert not cli_pd._has_oracle("rbln") and cli_pd._has_oracle("hf")
    assert rbln.load is not None
    with pytest.raises(ValueError, match="--runtime rbln needs --compiled PATH"):
        rbln.load(CFG, RuntimeRequest())


def test_serve_adds_its_steps_to_the_same_kinds(scratch_registry: None) -> None:
    assert registry.get("reference").serve is serve_runtimes._reference
    assert registry.get("rbln").serve_check is serve_runtimes._check_rbln

    def factory(opts: object) -> object:
        raise AssertionError("not loaded here")

    serve_runtimes.register_runtime("served-only", factory)  # type: ignore[arg-type]
    kind = registry.get("served-only")
    assert (kind.serve, kind.load, kind.oracle) == (factory, None, None)
    # a runtime only serve can build is no choice of the commands that load runtimes
    assert "served-only" not in cli_pd._loadable()
    opts = serve_runtimes.ServeOptions(model="tiny", runtime="served-only")
    assert serve_runtimes.check(opts) is opts
    # registering serve's steps keeps what the kind had
    serve_runtimes.register_runtime("reference", factory)  # type: ignore[arg-type]
    ref = registry.get("reference")
    assert ref.serve is factory and ref.load is not None and ref.oracle is not None
    registry.register(RuntimeKind("bare", "no serve factory"))
    with pytest.raises(ValueError, match="--runtime bare: unknown; give one of"):
        serve_runtimes.check(serve_runtimes.ServeOptions(model="tiny", runtime="bare"))


def test_tiny_hf_runtimes_of_one_model_share_it_and_keep_their_own_kv() -> None:
    pytest.importorskip("transformers")
    kind = registry.get("hf")
    assert kind.load is not None and kind.oracle is not None
    req = RuntimeRequest(model="tiny-llama", seed=0, dtype="float64")
    a, b = kind.load(CFG, req), kind.load(CFG, req)
    # loaded once (a model holds no KV): a simulated PD pair or cluster loads it once
    assert a.model is b.model and a is not b
    other = kind.load(CFG, RuntimeRequest(model="tiny-llama", seed=1, dtype="float64"))
    assert other.model is not a.model and other.fingerprint != a.fingerprint
    assert kind.load(CFG, RuntimeRequest(model="tiny-llama", vocab_size=100)).vocab_size == 100
    oracle = kind.oracle(a)
    prompts = {a: [5, 6, 7, 8, 9] * 7, b: [11, 3, 2] * 9}
    batchers = {rt: AtomBatcher(CFG, rt) for rt in prompts}
    rids = {rt: batchers[rt].submit(p, 6) for rt, p in prompts.items()}
    for _ in range(4):  # interleaved: each writes its own KV, the other's untouched
        for batcher in batchers.values():
            batcher.step()
    for rt, p in prompts.items():
        assert batchers[rt].run_until_done()[rids[rt]].tokens == oracle.generate(p, 6)
