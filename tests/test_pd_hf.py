"""`atom-core pd-prefill` / `pd-decode --runtime hf`: two processes over gloo on loopback, each
loading the same checkpoint directory (saved with `save_pretrained`: the real loading path),
the decode worker's tokens checked by `--check` against transformers' own `generate()`; a
decode worker loading other weights refuses the KV (the fingerprint covers config and weights).

The comparison is not luck: the test's own oracle asserts that at every compared step the
float64 oracle's top-1/top-2 logit gap exceeds MARGIN (far above the ~1e-13 the two attention
paths differ by, tests/test_runtime_hf.py), and a planted wrong oracle makes `--check` fail.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import cli  # noqa: E402
from atom_core.demo import workload  # noqa: E402
from atom_core.runtime.hf import GenerateOracle, HFRuntime  # noqa: E402

KEY = "pd-hf-test-key-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--lanes", "2", "--max-seq-len", "256", "--prefill-chunk", "64"]
REQUESTS, NEW = 4, 4
MARGIN = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _checkpoint(tmp_path: Path, seed: int) -> Path:
    d = tmp_path / f"llama-{seed}"
    if not d.exists():
        HFRuntime.tiny_llama_model(seed, max_position=256, dtype=torch.float64).save_pretrained(d)
    return d


@pytest.fixture
def prefill_proc() -> Iterator[Callable[[list[str]], tuple[subprocess.Popen[str], int]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(argv: list[str]) -> tuple[subprocess.Popen[str], int]:
        port = _free_port()
        p = subprocess.Popen([sys.executable, "-m", "atom_core.cli", "pd-prefill", *SHAPE,
                              "--port", str(port), "--timeout", "60", "--json", *argv],
                             cwd=ROOT, env={**os.environ, "ATOM_CORE_PD_KEY": KEY},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p, port

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


def _decode(port: int, model: Path, capsys: Any, *extra: str) -> tuple[int, dict[str, Any]]:
    code = cli.main(["pd-decode", *SHAPE, "--port", str(port), "--timeout", "60",
                     "--key", KEY, "--runtime", "hf", "--model", str(model),
                     "--requests", str(REQUESTS), "--max-new-tokens", str(NEW), "--json",
                     *extra])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _prefill_done(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_pd_hf_two_processes_equal_generate(tmp_path: Path, prefill_proc: Any,
                                            capsys: Any) -> None:
    model = _checkpoint(tmp_path, 0)
    proc, port = prefill_proc(["--runtime", "hf", "--model", str(model), "--prefix-cache"])
    code, out = _decode(port, model, capsys)  # --check is on by default for hf
    assert code == 0, out
    assert out["checked"] is True and out["exact"] is True and out["mismatches"] == []
    assert out["completed"] == REQUESTS and out["generated_tokens"] == REQUESTS * NEW
    assert out["imported_tokens"] > 0 and out["local_prefill_tokens"] == 0
    assert _prefill_done(proc)["exports"] == REQUESTS
    # the oracle's choices are clear at every compared step (so `exact` is not luck)
    gen = HFRuntime.tiny_llama_model(0, max_position=256, dtype=torch.float64)  # the same weights
    gen.set_attn_implementation("sdpa")
    for it in workload(REQUESTS, NEW, 0, 128, 256):
        ids = torch.tensor([it.prompt])
        with torch.inference_mode():
            res = gen.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                               min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        for step, logits in enumerate(res.logits):
            top = torch.topk(logits[0], 2).values
            assert float(top[0] - top[1]) > MARGIN, (len(it.prompt), step)


def test_pd_hf_check_fails_on_a_planted_wrong_oracle(tmp_path: Path, prefill_proc: Any,
                                                     capsys: Any, monkeypatch: Any) -> None:
    """`--check` compares with generate(): an oracle that answers one wrong token fails it."""
    real = GenerateOracle.generate

    def off_by_one(self: GenerateOracle, prompt: Any, n: int, eos: int | None = None
                   ) -> list[int]:
        toks = real(self, prompt, n, eos)
        return [(toks[0] + 1) % 128, *toks[1:]]

    monkeypatch.setattr(GenerateOracle, "generate", off_by_one)
    model = _checkpoint(tmp_path, 0)
    proc, port = prefill_proc(["--runtime", "hf", "--model", str(model)])
    code, out = _decode(port, model, capsys)
    assert code == 1 and out["exact"] is False and len(out["mismatches"]) == REQUESTS
    _prefill_done(proc)


def test_pd_hf_decode_worker_refuses_kv_of_other_weights(tmp_path: Path, prefill_proc: Any,
                                                         capsys: Any) -> None:
    """Same architecture and config, other weights (seed 1): every payload is refused by its
    fingerprint, nothing is decoded from it."""
    proc, port = prefill_proc(["--runtime", "hf", "--model", str(_checkpoint(tmp_path, 1))])
    code, out = _decode(port, _checkpoint(tmp_path, 0), capsys, "--no-check")
    assert code == 1
    assert out["errors_by_kind"] == {"payload:fingerprint": REQUESTS}
    assert out["completed"] == 0 and out["generated_tokens"] == 0
    assert all("different model" in e for e in out["errors"].values())
    _prefill_done(proc)


@pytest.mark.parametrize(("argv", "message"), [
    (["pd-decode", "--runtime", "hf"], "--runtime hf needs --model"),
    (["pd-prefill", "--model", "tiny-llama"], "--model is for --runtime hf"),
    (["pd-prefill", "--runtime", "hf", "--model", "/nonexistent/dir"], "cannot serve"),
])
def test_pd_hf_usage_errors_exit_2(capsys: Any, argv: list[str], message: str) -> None:
    """Exit 2 and the reason, before any connection is tried."""
    assert cli.main([*argv, "--port", str(_free_port()), "--timeout", "1", "--key", KEY]) == 2
    assert message in capsys.readouterr().err


def test_pd_hf_refuses_a_model_shorter_than_max_seq_len(tmp_path: Path, capsys: Any) -> None:
    model = _checkpoint(tmp_path, 0)  # max_position_embeddings 256
    assert cli.main(["pd-prefill", "--runtime", "hf", "--model", str(model), "--max-seq-len",
                     "512", "--port", str(_free_port()), "--timeout", "1", "--key", KEY]) == 2
    assert "max_position_embeddings=256" in capsys.readouterr().err
