"""HFRuntime: AtomBatcher over a real transformers model, held against transformers' own
`generate(do_sample=False)` of the same model (its own attention, its own cache, no block tables).

The cached paged attention and transformers' attention agree up to floating-point rounding, not
bit for bit, so a token comparison is only meaningful where the oracle's choice is clear: at every
compared step the oracle's top-1 / top-2 logit gap must exceed MARGIN (the seeds below were
picked so that it does). In float64 the two paths' logits differ by ~1e-13
(`test_logits_match_transformers` bounds it by 1e-9), so a gap of MARGIN cannot be crossed by
rounding, and a scheduler or runtime bug that feeds the model the wrong KV changes the tokens
(`test_planted_lane_confusion_is_caught`). One float32 test compares logits with a tolerance.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from atom_core.batcher import AtomBatcher  # noqa: E402
from atom_core.config import Config, min_kv_blocks  # noqa: E402
from atom_core.pd.transport import InProcessTransport  # noqa: E402
from atom_core.pd.workers import DecodeWorker, PrefillWorker  # noqa: E402
from atom_core.runtime import hf  # noqa: E402
from atom_core.runtime.hf import HFRuntime, UnsupportedModelError  # noqa: E402

S, C, B = 256, 64, 64  # max_seq_len, prefill chunk, block size (paged: 4 blocks a table)
SEED = 0  # the model's weights
MARGIN = 1e-6  # least top-1/top-2 logit gap of the float64 oracle at any compared step
F64 = torch.float64


class Oracle:
    """transformers' greedy `generate` on the same weights (default attention), memoised."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def generate(self, prompt: list[int], n: int) -> list[int]:
        key = tuple(prompt)
        have = self._memo.get(key, [])
        if len(have) < n:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)
            for step, logits in enumerate(out.logits):
                top = torch.topk(logits[0].to(F64), 2).values
                gap = float(top[0] - top[1])
                assert gap > MARGIN, (f"oracle step {step} of a {len(prompt)}-token prompt: "
                                      f"top-1/top-2 gap {gap:.2e} <= {MARGIN}: pick another seed")
            have = out.sequences[0, len(prompt):].tolist()
            self._memo[key] = have
        return have[:n]


_ORACLES: dict[tuple[str, int], Oracle] = {}


def oracle(seed: int = SEED, kind: str = "llama") -> Oracle:
    if (kind, seed) not in _ORACLES:
        _ORACLES[kind, seed] = Oracle(MODELS[kind](seed, F64))
    return _ORACLES[kind, seed]


def llama(seed: int, dtype: torch.dtype) -> Any:
    return HFRuntime.tiny_llama_model(seed, max_position=S, dtype=dtype)


def qwen2(seed: int, dtype: torch.dtype) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=S, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf.seed_weights(Qwen2ForCausalLM(cfg), seed).to(dtype)


def mistral(seed: int, dtype: torch.dtype) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, max_position_embeddings=S, sliding_window=None,
                        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None)
    return hf.seed_weights(MistralForCausalLM(cfg), seed).to(dtype)


MODELS = {"llama": llama, "qwen2": qwen2, "mistral": mistral}


def served(cfg: Config, tmp_path: Path, kind: str = "llama", seed: int = SEED,
           dtype: torch.dtype = F64) -> HFRuntime:
    """The model saved with save_pretrained and loaded back (the real loading path)."""
    d = tmp_path / f"{kind}-{seed}"
    if not d.exists():
        MODELS[kind](seed, dtype).save_pretrained(d)
    return HFRuntime.from_pretrained(d, cfg, dtype=dtype)


def config(lanes: int, *, prefix: bool = False, extra: int = 1, **kw: Any) -> Config:
    t = S // kw.get("block_size", B)
    pre = kw.get("preemption", False)
    kw.setdefault("block_size", B)
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, "dynamic", t,
                                                       preemption=pre) + extra,
                  max_seq_len=S, prefill_chunk=C, prefix_cache=prefix, **kw)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


def run(b: AtomBatcher, work: list[tuple[list[int], int]], max_steps: int = 5000) -> list[int]:
    rids = [b.submit(p, n) for p, n in work]
    for _ in range(max_steps):
        if not b.busy():
            break
        b.step()
    assert not b.busy(), "not done"
    return rids


def assert_exact(b: AtomBatcher, rids: list[int], orc: Oracle) -> None:
    for r in rids:
        req = b.requests[r]
        assert req.error is None, req.error
        assert req.tokens == orc.generate(req.prompt, req.max_new_tokens), f"request {r}"


# --------------------------------------------------------------------------- exactness
def test_chunked_paged_with_idle_padding_rows(tmp_path: Path) -> None:
    """Prompts over 1..3 chunks and 1..3 blocks, two requests on four lanes: every decode step
    has idle padding rows aimed at the scratch block."""
    cfg = config(4)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    rids = run(b, [(prompt(150, 1), 12), (prompt(5, 2), 10)])
    assert_exact(b, rids, oracle())
    assert b.stats.decode_rows_padding > 0 and b.stats.table_grows > 0
    assert b.runtime.calls["prefill"] == 3 + 1


def test_prefix_hits_and_host_tier(tmp_path: Path) -> None:
    """A 140-token system prompt (two whole blocks) shared by later requests: prefix hits of
    one and several blocks, entries spilled to the host tier and loaded back."""
    cfg = config(2, prefix=True, host_cache_blocks=6)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    system = prompt(140, 3)
    work = [(system + prompt(8, 10 + i), 6) for i in range(3)]
    work += [(prompt(70, 20 + i), 5) for i in range(3)]      # evict the system prompt's blocks
    work += [(system[:100] + prompt(4, 30), 6), (system + prompt(9, 31), 6)]
    rids = run(b, work)
    assert_exact(b, rids, oracle())
    assert b.stats.prefix_hit_tokens >= 2 * B
    assert b.stats.host_stores > 0


def test_preemption(tmp_path: Path) -> None:
    """Three long decodes at the preemption rule's minimum: lanes are preempted and resume by
    prefilling their prompt and tokens so far."""
    cfg = config(3, extra=0, preemption=True)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    rids = run(b, [(prompt(100 + 20 * i, 40 + i), 60) for i in range(3)])
    assert_exact(b, rids, oracle())
    assert b.stats.preemptions > 0 and b.stats.recomputed_tokens > 0


def test_pd_over_the_in_process_link(tmp_path: Path) -> None:
    """A prefill worker and a decode worker, each with its own HFRuntime of the same checkpoint
    (sized differently): the decode side continues from imported KV."""
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


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_architectures(tmp_path: Path, kind: str) -> None:
    cfg = config(2)
    b = AtomBatcher(cfg, served(cfg, tmp_path, kind))
    rids = run(b, [(prompt(80, 60), 8), (prompt(3, 61), 8)])
    assert_exact(b, rids, oracle(kind=kind))


def test_planted_lane_confusion_is_caught(tmp_path: Path, monkeypatch: Any) -> None:
    """A runtime whose gather reads every row through row 0's block table: the check fails."""
    from atom_core.runtime import hf_attention

    real = hf_attention.row_blocks
    monkeypatch.setattr(hf_attention, "row_blocks", lambda tab, n, nb: real(
        tab[:1].expand_as(tab), n, nb))
    cfg = config(2)
    b = AtomBatcher(cfg, served(cfg, tmp_path))
    rids = run(b, [(prompt(80, 70), 8), (prompt(40, 71), 8)])
    assert any(b.requests[r].tokens != oracle().generate(b.requests[r].prompt, 8) for r in rids)


# --------------------------------------------------------------------------- logits
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (F64, 1e-9)],
                         ids=["float32", "float64"])
def test_logits_match_transformers(tmp_path: Path, dtype: torch.dtype, tol: float) -> None:
    """Prefill over three chunks through a scrambled block table, then decode steps on a
    two-row graph beside a padding row: logits equal a full forward of transformers' own
    attention up to `tol`."""
    cfg = config(2, extra=3)
    rt = served(cfg, tmp_path, dtype=dtype)
    ref = llama(SEED, dtype)
    table = torch.tensor([5, 2, 6, 1], dtype=torch.int16)
    seq = prompt(170, 80)
    for s in range(0, len(seq), C):
        chunk = seq[s:s + C]
        got = rt.prefill(torch.tensor([chunk + [0] * (C - len(chunk))]),
                         torch.arange(s, s + C, dtype=torch.int32)[None], table, None,
                         torch.tensor(len(chunk) - 1, dtype=torch.int16))[0, 0]
    for _ in range(3):
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        seq.append(int(torch.argmax(want)))
        p = len(seq) - 1
        ids = torch.tensor([[seq[-1]], [7]])
        pos = torch.tensor([[p], [3]], dtype=torch.int32)
        tabs = torch.stack([table, torch.tensor([0, 0, 0, 0], dtype=torch.int16)])
        got = rt.decode(ids, pos, tabs, None)[0, 0]


# --------------------------------------------------------------------------- loading, refusals
def test_fingerprint_covers_config_and_weights(tmp_path: Path) -> None:
    cfg, other = config(2), config(1, extra=4)
    a = served(cfg, tmp_path)
    assert a.fingerprint == served(other, tmp_path).fingerprint  # artifact sizes do not count
    assert a.fingerprint != served(cfg, tmp_path, seed=SEED + 1).fingerprint
    assert a.fingerprint != served(cfg, tmp_path, kind="qwen2").fingerprint
    assert a.fingerprint == HFRuntime.tiny_llama(cfg, seed=SEED, dtype=F64).fingerprint


def _save_config(tmp_path: Path, name: str, cfg: Any) -> Path:
    d = tmp_path / name
    cfg.save_pretrained(d)
    return d


def test_refusals(tmp_path: Path) -> None:
    from transformers import Gemma3Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    cfg = config(2)
    multimodal = _save_config(tmp_path, "gemma3", Gemma3Config())
    with pytest.raises(UnsupportedModelError, match="'gemma3'.*not supported.*text model"):
        HFRuntime.from_pretrained(multimodal, cfg)
    # Gemma3's default pattern makes both of two layers sliding: no global layer
    only_sliding = _save_config(tmp_path, "g3-sliding", Gemma3TextConfig(num_hidden_layers=2))
    with pytest.raises(UnsupportedModelError, match="only sliding_attention.*full_attention"):
        HFRuntime.from_pretrained(only_sliding, cfg)
    for name, bad, match in (("g3-bidi", dict(use_bidirectional_attention=True), "causal"),
                             ("g3-cap", dict(attn_logit_softcapping=50.0),
                              "attn_logit_softcapping")):
        g = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention",
                                                               "full_attention"], **bad)
        with pytest.raises(UnsupportedModelError, match=match):
            HFRuntime.from_pretrained(_save_config(tmp_path, name, g), cfg)
    q = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=32,
                    max_window_layers=1)
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        HFRuntime.from_pretrained(_save_config(tmp_path, "qwen2-sw", q), cfg)
    m = MistralConfig(num_hidden_layers=2, sliding_window=128)
    with pytest.raises(UnsupportedModelError, match="sliding_window=128 < max_seq_len=256"):
        HFRuntime.from_pretrained(_save_config(tmp_path, "mistral-sw", m), cfg)
    short = hf.LlamaConfig(num_hidden_layers=2, max_position_embeddings=128)
    with pytest.raises(UnsupportedModelError, match="max_position_embeddings=128"):
        HFRuntime.from_pretrained(_save_config(tmp_path, "short", short), cfg)
    with pytest.raises(UnsupportedModelError, match="float32 or torch.float64"):
        HFRuntime.from_pretrained(tmp_path, cfg, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a directory"):
        HFRuntime.from_pretrained(tmp_path / "missing", cfg)
    plain = llama(SEED, torch.float32)  # built with transformers' own attention
    with pytest.raises(UnsupportedModelError, match="attn_implementation"):
        HFRuntime(plain, num_blocks=4, block_size=B, max_seq_len=S, prefill_chunk=C,
                  batch_size=2)


# --------------------------------------------------------------------------- CLI and serve
def test_demo_runtime_hf_tiny_llama_is_exact(capsys: Any) -> None:
    from atom_core import cli

    code = cli.main(["demo", "--runtime", "hf", "--model", "tiny-llama", "--lanes", "2",
                     "--requests", "3", "--max-new-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["exact"] is True and out["completed"] == 3
    assert out["runtime"] == "hf (tiny-llama)" and out["generated_tokens"] == 9


def test_demo_refuses_a_bad_model(tmp_path: Path, capsys: Any) -> None:
    from atom_core import cli

    assert cli.main(["demo", "--runtime", "hf", "--model", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_serve_builds_hf_from_a_checkpoint_directory(tmp_path: Path) -> None:
    """`serve --runtime hf --model DIR`: the directory's tokenizer and weights."""
    from atom_core.cli import build_parser
    from atom_core.serve.main import build
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    d = build_tiny_tokenizer(tmp_path / "model")
    HFRuntime.tiny_llama_model(SEED, vocab_size=320, max_position=S).save_pretrained(d)
    args = build_parser().parse_args(["serve", "--runtime", "hf", "--model", str(d),
                                      "--api-key", "k" * 32, "--lanes", "2"])
    _app, engine, _settings = build(args)
    rt = engine.batcher.runtime
    assert isinstance(rt, HFRuntime) and rt.vocab_size == 320 and rt.batch_size == 2
    args = build_parser().parse_args(["serve", "--runtime", "hf", "--model", "tiny-llama",
                                      "--api-key", "k" * 32, "--lanes", "2"])
    _app, engine, _settings = build(args)
    assert engine.batcher.runtime.vocab_size == 257  # the byte tokenizer's


def test_threads_auto_is_one_for_a_tiny_model_and_a_spare_core_above(monkeypatch: Any) -> None:
    """The "auto" default (measured by bench.hf and bench.hf_call): one thread below a million
    parameters; above, one core fewer than the machine has, at least one and at most torch's
    setting; an explicit count or None is kept, anything else refused."""
    import os

    from atom_core.runtime.hf import SMALL_MODEL_PARAMETERS, threads_for
    tiny = HFRuntime.tiny_llama_model(0)
    big = HFRuntime.tiny_llama_model(0, hidden_size=512, intermediate_size=1408,
                                     num_hidden_layers=2, num_attention_heads=8,
                                     num_key_value_heads=4, head_dim=64, vocab_size=1024)
    assert sum(p.numel() for p in tiny.parameters()) < SMALL_MODEL_PARAMETERS
    assert sum(p.numel() for p in big.parameters()) >= SMALL_MODEL_PARAMETERS
    for cores, want in ((1, 1), (2, 1), (64, torch.get_num_threads())):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert (threads_for(tiny, "auto"), threads_for(big, "auto")) == (1, max(1, want))
    assert (threads_for(big, 2), threads_for(tiny, None)) == (2, None)
    for bad in (0, True, "many", 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            threads_for(tiny, bad)
