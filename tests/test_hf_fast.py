"""HFRuntime's path for hardware without static shapes, held against transformers' own
`generate(do_sample=False)` (float64, token-exact, as tests/test_runtime_hf.py) and against the
RBLN-shaped path of the same runtime:

- live rows only (`static_batch` False): the batcher hands a decode call the live rows and
  maps the logits back to lanes; padding rows are never computed;
- mixed calls (`mixed_calls`): a decode and prompt chunks of several lanes in one forward,
  each part's logits those of its own call (within 1e-9 in float64);
- the RBLN-shaped path (`static_batch=True, mixed_calls=False`) still serves exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from atom_core.batcher import AtomBatcher  # noqa: E402
from atom_core.runtime.hf import HFRuntime  # noqa: E402
from tests.test_runtime_hf import F64, SEED, C, assert_exact, config, oracle, prompt, run  # noqa: E402
from tests.test_runtime_hf import MODELS as LLAMA_MODELS  # noqa: E402
from tests.test_runtime_hf_gemma3 import W, gemma3  # noqa: E402
from tests.test_runtime_hf_gemma3 import oracle as gemma3_oracle  # noqa: E402


class Recording:
    """The runtime itself, recording each decode call's row count and each mixed call's
    parts (a wrapper the batcher reads the capabilities through, as the simulator's)."""

    def __init__(self, inner: HFRuntime) -> None:
        self.inner = inner
        self.decode_rows: list[int] = []
        self.mixed_parts: list[tuple[int, int]] = []  # (decode rows, prefills)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, *args: Any) -> Any:
        self.decode_rows.append(len(args[0]))
        return self.inner.decode(*args)

    def mixed(self, decode: Any, prefills: Any) -> Any:
        self.mixed_parts.append((0 if decode is None else len(decode[0]), len(prefills)))
        return self.inner.mixed(decode, prefills)


def llama_rt(cfg: Any, tmp_path: Path, **kw: Any) -> HFRuntime:
    d = tmp_path / "llama"
    if not d.exists():
        LLAMA_MODELS["llama"](SEED, F64).save_pretrained(d)
    return HFRuntime.from_pretrained(d, cfg, dtype=F64, num_threads=1, **kw)


def gemma3_rt(cfg: Any, tmp_path: Path, **kw: Any) -> HFRuntime:
    d = tmp_path / "gemma3"
    if not d.exists():
        gemma3(SEED, F64).save_pretrained(d)
    return HFRuntime.from_pretrained(d, cfg, dtype=F64, num_threads=1, **kw)


WORK = [(prompt(150, 1), 10), (prompt(5, 2), 12), (prompt(70, 3), 9), (prompt(30, 4), 11)]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_live_rows_and_mixed_calls_are_exact(tmp_path: Path, kind: str) -> None:
    """Four requests on six lanes, prompt budget of three chunks a step: some steps run a
    decode beside several lanes' chunks in one forward, every decode computes the live rows
    only, and every token equals generate()'s (the hybrid model's sliding windows included)."""
    make, ref = (llama_rt, oracle()) if kind == "llama" else (gemma3_rt, gemma3_oracle())
    cfg = config(6, sliding_window=W) if kind == "gemma3" else config(6)
    rt = Recording(make(cfg, tmp_path, mixed_prefill_tokens=3 * C))
    b = AtomBatcher(cfg, rt)
    rids = run(b, WORK)
    assert_exact(b, rids, ref)
    assert b.stats.decode_rows_padding > 0  # the core planned padding rows: none were run
    assert rt.decode_rows and max(rt.decode_rows) < cfg.lanes
    assert any(d > 0 and p > 1 for d, p in rt.mixed_parts), rt.mixed_parts
    assert all(d + p <= cfg.lanes for d, p in rt.mixed_parts)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_rbln_shaped_path_is_exact(tmp_path: Path, kind: str) -> None:
    """`static_batch=True, mixed_calls=False`: every decode computes all B rows (padding rows
    included) and each prefill is a call of its own, with the same tokens."""
    make, ref = (llama_rt, oracle()) if kind == "llama" else (gemma3_rt, gemma3_oracle())
    cfg = config(4, sliding_window=W) if kind == "gemma3" else config(4)
    rt = Recording(make(cfg, tmp_path, static_batch=True, mixed_calls=False))
    b = AtomBatcher(cfg, rt)
    rids = run(b, WORK[:3])
    assert_exact(b, rids, ref)
    assert rt.decode_rows and set(rt.decode_rows) == {cfg.lanes}
    assert not rt.mixed_parts and rt.inner.calls["mixed"] == 0


def test_mixed_logits_equal_separate_calls(tmp_path: Path) -> None:
    """A mixed call (one lane's decode, two other lanes' chunks) gives each part the logits of
    its own call on a second runtime of the same model, within 1e-9 (float64), and leaves
    the same KV in the blocks it wrote."""
    cfg = config(4, extra=8)
    one, two = llama_rt(cfg, tmp_path), llama_rt(cfg, tmp_path)
    i16 = torch.int16
    tabs = [torch.tensor(t, dtype=i16) for t in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])]
    seq = prompt(70, 9)

    def chunk(ids: list[int], start: int, tab: torch.Tensor) -> tuple[Any, ...]:
        pad = ids + [0] * (C - len(ids))
        return (torch.tensor([pad]), torch.arange(start, start + C, dtype=torch.int32)[None],
                tab, None, torch.tensor(len(ids) - 1, dtype=i16))

    for rt in (one, two):  # lane 0's prompt, both chunks
        rt.prefill(*chunk(seq[:C], 0, tabs[0]))
        rt.prefill(*chunk(seq[C:], C, tabs[0]))
    dec = (torch.tensor([[5]]), torch.tensor([[len(seq)]], dtype=torch.int32), tabs[0][None],
           None)
    p1, p2 = chunk(prompt(40, 10), 0, tabs[1]), chunk(prompt(7, 11), 0, tabs[2])
    got_d, got_p = one.mixed(dec, [p1, p2])
    want_d = two.decode(*dec)
    want_p = torch.cat([two.prefill(*p1), two.prefill(*p2)])
    assert got_d is not None and got_d.shape == want_d.shape and got_p.shape == want_p.shape
    torch.testing.assert_close(got_d, want_d, atol=1e-9, rtol=0)
    torch.testing.assert_close(got_p, want_p, atol=1e-9, rtol=0)
    # the real positions' KV: lane 0's decode position and each chunk's real tokens
    for blk, n in ((1, C), (2, len(seq) - C + 1), (5, 40), (9, 7)):
        torch.testing.assert_close(one.read_block(blk)[:, :, :, :n],
                                   two.read_block(blk)[:, :, :, :n], atol=1e-9, rtol=0)
    assert one.calls["mixed"] == 1 and one.calls["prefill"] == 4 and one.calls["decode"] == 1


def test_any_row_count_only_without_static_batch(tmp_path: Path) -> None:
    """A runtime without static shapes takes any row count up to batch_size; the RBLN-shaped
    one refuses a count no graph has, saying what to do."""
    from atom_core.runtime.protocol import RuntimeInputError

    cfg = config(4)
    args = (torch.tensor([[1], [2], [3]]), torch.tensor([[0]] * 3, dtype=torch.int32),
            torch.tensor([[1, 1, 1, 1]] * 3, dtype=torch.int16), None)
    assert llama_rt(cfg, tmp_path).decode(*args).shape == (3, 1, 128)
    with pytest.raises(RuntimeInputError, match="no decode graph has 3 rows"):
        llama_rt(cfg, tmp_path, static_batch=True).decode(*args)
    too_many = [torch.cat([a] * 2) for a in args[:3]]
    with pytest.raises(RuntimeInputError, match="no decode graph has 6 rows"):
        llama_rt(cfg, tmp_path).decode(*too_many, None)


class NaNFirstMixedPrefill(Recording):
    """A runtime fault: the first mixed call with two or more prefills returns NaN logits for
    its first prefill."""

    def __init__(self, inner: HFRuntime) -> None:
        super().__init__(inner)
        self.hit: list[int] = []  # the block table's first block of the faulted chunk

    def mixed(self, decode: Any, prefills: Any) -> Any:
        d, p = super().mixed(decode, prefills)
        if not self.hit and len(prefills) >= 2:
            self.hit.append(int(prefills[0][2][0]))
            p = p.clone()
            p[0] = float("nan")
        return d, p


def test_a_mixed_calls_bad_prefill_fails_its_request_alone(tmp_path: Path) -> None:
    cfg = config(6)
    rt = NaNFirstMixedPrefill(llama_rt(cfg, tmp_path, mixed_prefill_tokens=3 * C))
    b = AtomBatcher(cfg, rt)
    rids = run(b, WORK)
    assert rt.hit
    failed = [r for r in rids if b.requests[r].error is not None]
    assert len(failed) == 1 and "not finite" in (b.requests[failed[0]].error or "")
    assert_exact(b, [r for r in rids if r not in failed], oracle())


def test_bench_hf_call_smoke(capsys: Any) -> None:
    """`python -m bench.hf_call` at small sizes: every setting measured, the runtime without
    static shapes. No timing assertions: performance is measured by `make bench`."""
    import json
    import math

    from bench import hf_call

    assert hf_call.main(["--context", "20", "--rounds", "1", "--calls", "1", "--threads", "1",
                         "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["static_batch"] is False and r["context"] == 20
    assert set(r["decode_ms"]) == {f"threads_1_rows_{n}" for n in hf_call.ROWS}
    assert all(math.isfinite(v["median"]) and v["median"] > 0 for v in r["decode_ms"].values())


def test_the_simulators_faults_reach_mixed_calls(tmp_path: Path) -> None:
    """The simulator's FaultyRuntime fails a mixed call when a fault is armed for either kind
    of its parts (before, `mixed` passed through unwrapped and faults on this runtime fired
    only on steps that were not mixed): the call's requests fail alone, the others are served
    exactly, and no block is left held."""
    from atom_core.simulate.faulty_runtime import FaultyRuntime

    fired: list[str] = []
    cfg = config(4)
    rt = FaultyRuntime(llama_rt(cfg, tmp_path), torch.Generator().manual_seed(0), fired.append)
    b = AtomBatcher(cfg, rt)
    first = b.submit(prompt(30, 1), 20)
    while not b.requests[first].tokens:  # decoding
        b.step()
    late = b.submit(prompt(70, 2), 5)  # its first chunk goes beside the decode
    rt.arm("decode")
    events = b.step()
    assert fired == ["decode"], fired
    failed = {e.request_id for e in events if e.kind == "error"}
    assert failed == {first, late} and all("injected" in b.requests[r].error for r in failed)
    ok = b.submit(prompt(40, 3), 6)
    b.run_until_done()
    assert_exact(b, [ok], oracle())
    assert all(own in ("free", "cache") for own in b.describe()["blocks"])
