"""HFRuntime on Gemma3 (text), the hybrid sliding-window model: AtomBatcher over a tiny
Gemma3ForCausalLM held against transformers' own `generate(do_sample=False)` of the same model in
float64 (its own attention, its own sliding cache, no block tables, no local slots).

The window W is smaller than the prompts and than a prefill chunk, so the sliding layers' local
window slots decide the tokens (`test_window_decides_the_tokens`); the model's own attention
modules compute q, k, v (Gemma3's q/k norms, its query_pre_attn_scalar scaling, its separate
local and global rotary bases) and only the attention function is HFRuntime's. The margin rule
is the Llama tests' (`tests/test_runtime_hf.py`): at every compared step the oracle's top-1 /
top-2 logit gap exceeds MARGIN, far above the ~1e-14 the two paths' logits differ by.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from atom_core.batcher import AtomBatcher  # noqa: E402
from atom_core.config import Config  # noqa: E402
from atom_core.pd.transport import InProcessTransport  # noqa: E402
from atom_core.pd.workers import DecodeWorker, PrefillWorker  # noqa: E402
from atom_core.runtime import hf  # noqa: E402
from atom_core.runtime.hf import HFRuntime, UnsupportedModelError  # noqa: E402
from tests.test_runtime_hf import (  # noqa: E402
    F64,
    SEED,
    B,
    C,
    Oracle,
    S,
    assert_exact,
    prompt,
    run,
)
from tests.test_runtime_hf import config as hf_config  # noqa: E402

W = 40  # the sliding window: shorter than a chunk (64) and than most prompts


def gemma3(seed: int, dtype: torch.dtype, window: int = W) -> Any:
    return HFRuntime.tiny_gemma3_model(seed, sliding_window=window, max_position=S, dtype=dtype)


_ORACLES: dict[tuple[int, int], Oracle] = {}


def oracle(seed: int = SEED, window: int = W) -> Oracle:
    if (seed, window) not in _ORACLES:
        _ORACLES[seed, window] = Oracle(gemma3(seed, F64, window))
    return _ORACLES[seed, window]


def config(lanes: int, **kw: Any) -> Config:
    return hf_config(lanes, sliding_window=W, **kw)


def served(cfg: Config, tmp_path: Path, seed: int = SEED, dtype: torch.dtype = F64) -> HFRuntime:
    """The model saved with save_pretrained and loaded back (the real loading path). One
    thread: on a shared machine a tiny model's calls are many times faster without hand-offs."""
    d = tmp_path / f"gemma3-{seed}-{dtype}"
    if not d.exists():
        gemma3(seed, dtype).save_pretrained(d)
    return HFRuntime.from_pretrained(d, cfg, dtype=dtype, num_threads=1)


def i16(x: Any) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int16)


# --------------------------------------------------------------------------- the runtime
def test_layout(tmp_path: Path) -> None:
    cfg = config(3)
    rt = served(cfg, tmp_path)
    assert rt.uses_local_block_tables and rt.sliding_window == W
    assert rt.sliding_layers == (0, 2) and rt.global_layers == (1,)
    assert len(rt.k_cache) == 1 and rt.k_cache[0].shape == (cfg.kv_blocks, 2, B, 32)
    assert len(rt.k_local) == 2 and rt.k_local[0].shape == (3, 2, W, 32)
    assert rt.new_host_buffer().shape == (1, 2, 2, B, 32)
    assert rt.new_local_host_buffer().shape == (2, 2, 2, W, 32)
    assert rt.read_local(2).shape == (2, 2, 2, W, 32)
    with pytest.raises(hf.RuntimeInputError, match="local slot 3 is outside 0..2"):
        rt.fetch_local_cache(rt.new_local_host_buffer(), 3)
    with pytest.raises(hf.RuntimeInputError, match="new_local_host_buffer"):
        rt.update_local_cache(rt.new_host_buffer(), 0)
    with pytest.raises(hf.RuntimeInputError, match="needs local_block_tables"):
        rt.decode(torch.tensor([[1]] * 3), torch.tensor([[0]] * 3, dtype=torch.int32),
                  i16([[0, 0, 0, 0]] * 3), None)


def test_window_decides_the_tokens() -> None:
    """The check is not vacuous: the same weights with a full-length window continue the
    test prompts differently, so a runtime that ignored or misread the window would fail."""
    for p in (prompt(150, 1), prompt(140, 3) + prompt(8, 10)):
        assert oracle().generate(p, 8) != oracle(window=S).generate(p, 8)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (F64, 1e-9)],
                         ids=["float32", "float64"])
def test_logits_match_transformers(tmp_path: Path, dtype: torch.dtype, tol: float) -> None:
    """Prefill over three chunks (the last one partial) through a scrambled block table into
    local slot 1, then decode steps beside a padding row aimed at idle slot 0 at position 0:
    logits equal a full forward of transformers' own attention (its sliding mask) up to
    `tol`, and the slot holds the last W positions' keys in order."""
    cfg = config(2, extra=3)
    rt = served(cfg, tmp_path, dtype=dtype)
    ref = gemma3(SEED, dtype)
    table = i16([5, 2, 6, 1])
    seq = prompt(170, 80)
    for s in range(0, len(seq), C):
        chunk = seq[s:s + C]
        got = rt.prefill(torch.tensor([chunk + [0] * (C - len(chunk))]),
                         torch.arange(s, s + C, dtype=torch.int32)[None], table, i16([1]),
                         i16(len(chunk) - 1))[0, 0]
    for _ in range(3):
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        seq.append(int(torch.argmax(want)))
        p = len(seq) - 1
        got = rt.decode(torch.tensor([[seq[-1]], [7]]), torch.tensor([[p], [0]], dtype=torch.int32),
                        torch.stack([table, i16([0, 0, 0, 0])]), i16([[1], [0]]))[0, 0]
    # the window after the last decode: positions len(seq) - W .. len(seq) - 1, oldest first;
    # recompute layer 0's keys of those positions with the model's own modules
    captured: dict[str, torch.Tensor] = {}
    attn = ref.model.layers[0].self_attn
    hook = attn.k_norm.register_forward_hook(lambda _m, _i, out: captured.update(k=out))
    with torch.no_grad():
        ids = torch.tensor([seq])
        ref(ids)
        hook.remove()
        pos = torch.arange(len(seq))[None]
        cos, sin = ref.model.rotary_emb(captured["k"], pos, "sliding_attention")
        k = captured["k"]                                               # [1, kvh, L, d]
        k = k * cos[:, None] + hf_rotate_half(k) * sin[:, None]
    torch.testing.assert_close(rt.k_local[0][1], k[0, :, -W:].to(dtype), atol=tol, rtol=0)


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    from transformers.models.gemma3.modeling_gemma3 import rotate_half

    return rotate_half(x)


# --------------------------------------------------------------------------- through the batcher
def test_chunked_paged_with_idle_padding_rows(tmp_path: Path) -> None:
    """Prompts over 1..3 chunks and 1..3 blocks, each longer than the window but one, two
    requests on four lanes: every decode step has padding rows aimed at an idle lane's slot."""
    cfg = config(4)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    rids = run(b, [(prompt(150, 1), 12), (prompt(5, 2), 10), (prompt(70, 4), 8)])
    assert_exact(b, rids, oracle())
    assert b.stats.decode_rows_padding > 0 and b.stats.table_grows > 0
    assert b.runtime.calls["prefill"] == 3 + 1 + 2


def test_prefix_hits_restored_from_snapshots(tmp_path: Path) -> None:
    """A 140-token system prompt shared by later requests: hybrid prefix hits of one and two
    blocks, each resuming the sliding layers from the snapshot of the lane's local slot taken
    at that chunk boundary (update_local_cache), not from the slot's leftovers."""
    cfg = config(2, prefix=True)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    system = prompt(140, 3)
    work = [(system + prompt(8, 10 + i), 6) for i in range(3)]
    work += [(system[:100] + prompt(4, 30), 6)]
    rids = run(b, work)
    assert_exact(b, rids, oracle())
    assert b.stats.prefix_hit_tokens >= 2 * B + B and b.stats.snapshots > 0
    assert b.runtime.calls["update_local"] >= 3


def test_pd_over_the_in_process_link(tmp_path: Path) -> None:
    """A prefill worker and a decode worker, each with its own HFRuntime of the same checkpoint
    (sized differently): the decode side continues from imported global KV and local window."""
    dcfg, pcfg = config(2), config(1, prefix=True, extra=2)
    td, tp = InProcessTransport.pair()
    pw = PrefillWorker(pcfg, served(pcfg, tmp_path), tp, insecure=True)
    dw = DecodeWorker(dcfg, served(dcfg, tmp_path), td, insecure=True)
    ps = [prompt(90, 50), prompt(7, 51), prompt(130, 52)]
    wids = [dw.submit(p, 6) for p in ps]
    for _ in range(5000):
        if not dw.busy():
            break
        dw.step()
        pw.step_once()
    res = dw.results()
    for w, p in zip(wids, ps, strict=True):
        assert res[w].error is None, res[w].error
        assert res[w].tokens == oracle().generate(p, 6)
    assert dw.summary()["imported_tokens"] == sum(map(len, ps))
    assert dw.batcher.runtime.calls["update_local"] == len(ps)


def test_planted_slot_confusion_is_caught(tmp_path: Path, monkeypatch: Any) -> None:
    """A runtime whose decode rows all append into row 0's local slot: the check fails."""
    from atom_core.runtime import hf_attention

    real = hf_attention.append_windows
    monkeypatch.setattr(hf_attention, "append_windows",
                        lambda slots, ids, pos, new: real(slots, ids[:1].expand_as(ids), pos, new))
    cfg = config(3)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    rids = run(b, [(prompt(80, 70), 8), (prompt(60, 71), 8)])
    assert any(b.requests[r].tokens != oracle().generate(b.requests[r].prompt, 8) for r in rids)


# --------------------------------------------------------------------------- refusals, CLI
def test_config_window_must_match_the_model(tmp_path: Path) -> None:
    cfg = config(2)
    rt = served(cfg, tmp_path)
    other = hf_config(2, sliding_window=W + 8)
    with pytest.raises(ValueError, match=f"sliding_window: config {W + 8}, runtime {W}"):
        AtomBatcher(other, rt)
    with pytest.raises(ValueError, match="give a Config with sliding_window"):
        HFRuntime.tiny_gemma3(hf_config(2), seed=SEED)
    with pytest.raises(UnsupportedModelError, match="sliding_window=0"):
        hf.check_model_config(hf.Gemma3TextConfig(
            num_hidden_layers=2, sliding_window=0,
            layer_types=["sliding_attention", "full_attention"]), S)


def test_fingerprint_covers_the_window(tmp_path: Path) -> None:
    cfg = config(2)
    a = served(cfg, tmp_path)
    assert a.fingerprint == HFRuntime.tiny_gemma3(cfg, seed=SEED, dtype=F64).fingerprint
    d = tmp_path / "other-window"
    gemma3(SEED, F64, window=W + 8).save_pretrained(d)
    assert a.fingerprint != HFRuntime.from_pretrained(d, hf_config(2, sliding_window=W + 8),
                                                      dtype=F64).fingerprint


def test_demo_runtime_hf_tiny_gemma3_is_exact(capsys: Any) -> None:
    from atom_core import cli

    code = cli.main(["demo", "--runtime", "hf", "--model", "tiny-gemma3", "--lanes", "2",
                     "--requests", "3", "--max-new-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["exact"] is True and out["completed"] == 3
    assert out["runtime"] == "hf (tiny-gemma3)" and out["generated_tokens"] == 9


def test_serve_builds_tiny_gemma3_and_a_gemma3_directory(tmp_path: Path) -> None:
    """`serve --runtime hf --model tiny-gemma3|DIR`: the Config gets the model's window."""
    from atom_core.cli import build_parser
    from atom_core.serve.main import build
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    args = build_parser().parse_args(["serve", "--runtime", "hf", "--model", "tiny-gemma3",
                                      "--api-key", "k" * 32, "--lanes", "2"])
    _app, engine, _settings = build(args)
    rt = engine.batcher.runtime
    assert isinstance(rt, HFRuntime) and rt.uses_local_block_tables
    assert rt.sliding_window == hf.TINY_GEMMA3_WINDOW == engine.batcher.config.sliding_window
    d = build_tiny_tokenizer(tmp_path / "model")
    HFRuntime.tiny_gemma3_model(SEED, sliding_window=W, vocab_size=320,
                                max_position=S).save_pretrained(d)
    args = build_parser().parse_args(["serve", "--runtime", "hf", "--model", str(d),
                                      "--api-key", "k" * 32, "--lanes", "2"])
    _app, engine, _settings = build(args)
    assert engine.batcher.config.sliding_window == W == engine.batcher.runtime.sliding_window


def test_preemption(tmp_path: Path) -> None:
    """Three long decodes at the preemption rule's minimum: lanes are preempted and resume by
    prefilling their prompt and tokens so far, which rebuilds the local window from scratch."""
    cfg = config(3, extra=0, preemption=True)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    rids = run(b, [(prompt(180 + 4 * i, 40 + i), 16) for i in range(3)])
    assert_exact(b, rids, oracle())
    assert b.stats.preemptions > 0 and b.stats.recomputed_tokens > 0
