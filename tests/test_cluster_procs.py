"""`atom-core pd-cluster`: 2 prefill + 2 decode worker processes and the frontend over gloo on
loopback, authenticated, token-exact against the oracle; the same with a prefill worker and
with a decode worker killed (SIGKILL) mid-run; and the launcher's argument errors."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from atom_core import cli
from atom_core.cli.pd import PD_KEY_ENV

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--lanes", "2", "--max-seq-len", "128", "--prefill-chunk", "64", "--prefix-cache",
         "--requests", "14", "--max-new-tokens", "6", "--timeout", "40"]


def load_factor() -> float:
    """How much slower than an idle machine this one may run now (runnable processes per
    core, at least 1): a backstop deadline is scaled by it, so a loaded machine (make test
    beside other work) makes a test slower, never failed."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def run(*extra: str) -> dict[str, Any]:
    env = {**os.environ, PD_KEY_ENV: secrets.token_hex(32), "OMP_NUM_THREADS": "1"}
    # the cluster's own deadlines (linking: --link-timeout's generous default) say what went
    # wrong; this one only keeps a hung cluster from hanging the suite
    p = subprocess.run([sys.executable, "-m", "atom_core.cli", "pd-cluster", "--prefill", "2",
                        "--decode", "2", *SHAPE, "--json", *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400 * load_factor())
    assert "terminate called" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_two_by_two_processes_serve_exactly() -> None:
    out = run()
    assert out["exact"] is True and out["failed"] == 0 and out["requests"] == 14
    w = out["workers"]
    assert w["prefill:0"]["exports"] > 0 and w["prefill:1"]["exports"] > 0
    assert w["decode:0"]["generated_tokens"] > 0 and w["decode:1"]["generated_tokens"] > 0
    # the shared system prompt hits the prefix cache of the prefill worker it was sent to
    assert sum(w[f"prefill:{i}"]["prefix_hit_tokens"] for i in (0, 1)) > 0
    assert out["affinity_hits"]["prefill"] > 0


def test_a_killed_prefill_process_loses_no_request() -> None:
    out = run("--kill", "prefill:0@2")
    assert out["killed"] == ["prefill:0"]
    assert out["exact"] is True and out["failed"] == 0


def test_a_killed_decode_process_fails_its_own_requests_only() -> None:
    out = run("--kill", "decode:1@2")
    assert out["killed"] == ["decode:1"] and out["exact"] is True
    assert all("decode worker 1 was lost" in e for e in out["errors"].values())


@pytest.mark.parametrize("argv,msg", [
    (["--backend", "nccl"], "use gloo"),
    (["--rank", "9"], "outside the cluster"),
    (["--rank", "1"], "--rank needs --port"),
])
def test_launcher_argument_errors(argv: list[str], msg: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pd-cluster", "--insecure", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_torchrun_world_size_must_match(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli.main(["pd-cluster", "--insecure", "--prefill", "2", "--decode", "2"]) == 2
    assert "--nproc-per-node 5" in capsys.readouterr().err


def test_torchrun_starts_a_cluster() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this python")
    env = {**os.environ, PD_KEY_ENV: secrets.token_hex(32), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(torchrun), "--nproc-per-node", "3", "-m", "atom_core.cli",
                        "pd-cluster", "--prefill", "1", "--decode", "1", *SHAPE, "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400 * load_factor())
    assert p.returncode == 0, p.stderr[-3000:]
    outs = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    front = next(o for o in outs if "exact" in o)
    assert front["exact"] is True and front["failed"] == 0
    assert {o.get("role") for o in outs} >= {"prefill", "decode"}


def test_restarted_processes_are_used_once_ready() -> None:
    # wave 1: a prefill and a decode worker are killed and started again (new generations);
    # wave 2 starts once every worker reports ready, and both new ones serve in it
    out = run("--restart", "prefill:0@2", "--restart", "decode:1@3", "--waves", "2")
    assert out["exact"] is True and out["killed"] == ["decode:1", "prefill:0"]
    w = out["workers"]  # the latest report of each worker: the new processes' counters
    assert w["prefill:0"]["exports"] > 0 and w["decode:1"]["generated_tokens"] > 0
    assert all("decode worker 1 was lost" in e for e in out["errors"].values())
