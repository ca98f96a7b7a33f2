"""Audit of the `atom-core` command line: every mistake is one clear message and a non-zero
exit code, never a traceback; Ctrl-C too; `--json` keeps stdout to one JSON object, errors
included; `--help` states the defaults the code uses."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from atom_core import cli
from atom_core.cli.common import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATOM_CORE_PD_KEY", "TORCH_CPP_LOG_LEVEL")}
    return {**env, **extra}


def _atom(*argv: str, timeout: float = 60, **popen) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "atom_core.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=_env(), **popen)


def _one_json(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    return json.loads(lines[0])


# ---------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    """A KeyboardInterrupt anywhere in a command: one line on stderr, exit 130, no traceback
    (with --json, the reason as the one JSON object on stdout)."""
    import atom_core.demo

    def interrupted(**_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(atom_core.demo, "run_demo", interrupted)

    def main(argv: list[str]) -> int:
        try:
            return cli.main(argv)
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt escaped main(): a traceback at Ctrl-C")

    assert main(["demo"]) == 130
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.strip() == "atom-core demo: interrupted"
    assert main(["demo", "--json"]) == 130
    cap = capsys.readouterr()
    assert _one_json(cap.out) == {"ok": False, "error": "interrupted"}


def test_ctrl_c_while_waiting_for_the_pd_peer():
    """The decode worker waiting for its prefill worker (the rendezvous blocks in C++) stops at
    Ctrl-C at once, with one line and exit 130, instead of waiting out --timeout."""
    port = free_port("127.0.0.1")
    p = subprocess.Popen([sys.executable, "-m", "atom_core.cli", "pd-decode", "--insecure",
                          "--port", str(port), "--timeout", "60", "--requests", "1"],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stderr is not None
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            seen.append(line)
            if "waiting for the prefill worker" in line or not line:
                break
        assert "waiting for the prefill worker" in seen[-1], seen
        time.sleep(1.0)  # inside the rendezvous
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, (p.returncode, err)
    assert took < 10
    assert "Traceback" not in err and "interrupted" in err and out == ""


# ------------------------------------------------------------------- PD connection errors
def test_pd_prefill_without_a_peer_is_one_message_not_a_cpp_trace():
    port = free_port("127.0.0.1")
    r = _atom("pd-prefill", "--insecure", "--port", str(port), "--timeout", "1")
    assert r.returncode == 1
    assert "could not reach the decode worker's rendezvous" in r.stderr
    assert "frame #" not in r.stderr and "Exception raised from" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------- argument types
@pytest.mark.parametrize("argv,expected", [
    (["pd-prefill", "--port", "abc"], "argument --port: expected a port in 1..65535, got 'abc'"),
    (["simulate", "--minutes", "soon"],
     "argument --minutes: expected minutes > 0, finite and at most 16667, got 'soon'"),
    (["min-blocks", "--lanes", "four"],
     "argument --lanes: expected an integer in 1..32768 (rule 'int16-ids': the runtime's "
     "block, lane and chunk ids are int16), got 'four'"),
])
def test_bad_values_name_what_is_expected(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "_port" not in err and "_minutes" not in err


# -------------------------------------------------------------------------- pd-demo
def test_pd_demo_bad_configuration_is_a_usage_error():
    """Refused before the prefill worker is started: exit 2, one line, no empty dump of the
    worker's stderr."""
    r = _atom("pd-demo", "--lanes", "40000")
    assert r.returncode == 2, r.stderr
    assert "prefill worker stderr" not in r.stderr and "int16-ids" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _atom("pd-demo", "--lanes", "40000", "--json")
    assert r.returncode == 2 and "int16-ids" in _one_json(r.stdout)["error"]


# ------------------------------------------------------------------------ pd-cluster
@pytest.mark.parametrize("argv,why", [
    (["--kill", "prefill:1@3"], "--kill prefill:1@3: there is no prefill worker 1"),
    (["--restart", "decode:2@0", "--decode", "2"],
     "--restart decode:2@0: there is no decode worker 2"),
    (["--kill", "prefill:0@3", "--rank", "0", "--port", "29999"],
     "--kill and --restart are for the launcher"),
])
def test_pd_cluster_refuses_a_fault_it_would_ignore(capsys, argv, why):
    assert cli.main(["pd-cluster", "--insecure", *argv]) == 2
    err = capsys.readouterr().err
    assert why in err, err


# ------------------------------------------------------------ --json errors on stdout
@pytest.mark.parametrize("argv,why", [
    (["check-trace", "/nonexistent/trace.jsonl"], "cannot read /nonexistent/trace.jsonl"),
    (["demo", "--model", "tiny-llama"], "--model is for --runtime hf"),
    (["simulate", "--faults", "bogus"], "unknown fault kind"),
    (["pd-prefill"], "no PD key"),
    (["pd-cluster", "--insecure", "--backend", "nccl"], "--backend nccl"),
])
def test_json_errors_are_one_object_on_stdout(capsys, monkeypatch, argv, why):
    """With --json a caller parsing stdout gets the reason (as check-config and verify do),
    and stderr still says it for a human."""
    monkeypatch.delenv("ATOM_CORE_PD_KEY", raising=False)
    code = cli.main([*argv, "--json"])
    cap = capsys.readouterr()
    assert code == 2
    out = _one_json(cap.out)
    assert out["ok"] is False and why in out["error"]
    assert why in cap.err


# ----------------------------------------------------------------------------- --help
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# options whose default is stated in other words than its value
_IN_WORDS = {("verify", "jobs"): "one per CPU"}


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS if c.name != "serve"])
def test_help_states_every_default_the_code_uses(command):
    """Every option with a default value (not a flag) says it in --help, and a number a help
    text gives as the default is the code's."""
    parser = _subparsers()[command]
    missing, wrong = [], []
    for a in parser._actions:
        if not a.option_strings or a.help == argparse.SUPPRESS or a.dest == "help":
            continue
        text = " ".join((a.help or "").split())
        if (command, a.dest) in _IN_WORDS:
            if _IN_WORDS[(command, a.dest)] not in text:
                missing.append(a.dest)
            continue
        stated = re.findall(r"default:? (-?[0-9.]+)\b", text)
        if a.default in (None, False, [], True) or isinstance(a, argparse._StoreTrueAction):
            continue
        if not stated and not re.search(rf"default:? {re.escape(str(a.default))}\b", text) \
                and f"{a.default} (default)" not in text:
            missing.append(a.dest)
        for v in stated:
            if isinstance(a.default, (int, float)) and float(v) != float(a.default):
                wrong.append((a.dest, v, a.default))
    assert (missing, wrong) == ([], [])


def test_demo_help_says_which_model_hf_runs_without_model():
    text = " ".join(_subparsers()["demo"].format_help().split())
    assert "default with --runtime hf: tiny-llama" in text


def test_pd_cluster_help_says_what_host_and_port_are():
    text = " ".join(_subparsers()["pd-cluster"].format_help().split())
    assert "the store's address" in text and "default: a free port" in text


def test_pd_cluster_workers_get_the_command_line_without_the_launchers_faults():
    """The launcher starts its workers with its own command line and --rank: without --kill
    and --restart (which a worker refuses), whichever way they were spelt."""
    from atom_core.cli.pd_cluster import _check_faults, _worker_argv

    argv = ["pd-cluster", "--kill", "prefill:0@2", "--insecure", "--restart=prefill:1@4",
            "--prefill", "2"]
    worker = _worker_argv(argv)
    assert worker == ["pd-cluster", "--insecure", "--prefill", "2"]
    args = cli.build_parser().parse_args([*worker, "--rank", "1", "--port", "29999"])
    _check_faults(args, launch=False)  # accepted: no fault options left


# ------------------------------------------------------------------ serve and mutants options
@pytest.mark.parametrize("argv,why", [
    (["--max-queue", "-1"], "argument --max-queue: must be an integer in 0..1000000"),
    (["--port", "-1"], "argument --port: must be a port in 0..65535"),
    (["--port", "70000"], "argument --port: must be a port in 0..65535"),
])
def test_serve_refuses_values_it_cannot_use(capsys, argv, why):
    with pytest.raises(SystemExit) as e:  # (the option's type: a usage error, as argparse's)
        cli.main(["serve", "--api-key", "k", *argv])
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_serve_on_a_port_in_use_says_so_before_loading_the_model(capsys, monkeypatch):
    import socket

    from atom_core.serve import main as serve_main

    def never(*_a, **_k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(serve_main, "build", never)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--api-key", "k", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "pick another --port" in err


@pytest.mark.parametrize("argv,why", [
    (["--sample", "0"], "must be a positive"),
    (["--jobs", "0"], "must be a positive"),
    (["--sim-runs", "x"], "expected a positive integer"),
])
def test_mutants_refuse_counts_that_are_not_positive(capsys, argv, why):
    from atom_core.proofs.mutants.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and why in capsys.readouterr().err


def test_mutants_refuse_a_json_path_in_no_directory_before_running(capsys, tmp_path):
    from atom_core.proofs.mutants.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--json", str(tmp_path / "missing" / "out.json")])
    assert exc.value.code == 2 and "no directory" in capsys.readouterr().err


def test_a_piped_table_keeps_every_name_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: `verify`'s table, piped or redirected (80 columns), cut names to a few characters
    ('no_cache…'), so a failing check did not say which invariant and action it was."""
    from atom_core.cli.common import table

    names = [("an_invariant_whose_name_is_long_enough_to_matter", "admit_host_hit_after_spill",
              "counterexample: found with B=1, K=2, T=2, C=2, PREFIX")] * 3
    table("checks", ["invariant", "action", "detail"], [list(r) for r in names])
    out = capsys.readouterr().out
    for inv, action, detail in names:
        assert inv in out and action in out and detail in out
    assert "…" not in out
