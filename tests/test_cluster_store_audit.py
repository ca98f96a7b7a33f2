"""The PD cluster's rendezvous store against a local process without the cluster key
(`atom_core.pd.cluster_store`), each finding pinned by a test that failed before its fix:

- a TCPStore has no access control, and the linkers trusted it: `gen/1 = "not-a-number"`
  killed every linker's scan thread (a bare `except Exception: return`), and a worker's `add`
  on it dropped that worker's store connection; a bumped `gen/<rank>` made the linkers close
  the real process's link as stale and wait for a generation that never comes; a value
  written before a worker registered did the same from the start. Every variant aborted the
  whole cluster, with tracebacks and `terminate called without an active exception`.
  Now what a peer trusts is the record each process seals under a key derived from the
  cluster key (`node/<rank>`, its generation), gloo's rendezvous values are sealed too, and
  anything that fails is ignored (logged once, naming the key): the cluster comes up and
  serves exactly;
- a linker thread that failed died silently; a build left inside gloo at the interpreter's exit
  aborted the process with a C++ terminate. Now a failed store ends the scan with a one-line
  reason the process exits with, and stopping ends every build waiting on the store.

The process tests start rank 0 (the store's host) alone, tamper with its store from a plain
`TCPStore` client (no key), then start the workers (`--rank`), and tamper again while they
run.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_cluster_procs import SHAPE, load_factor

from atom_core.cli.pd import PD_KEY_ENV
from atom_core.pd.cluster_store import (
    StoreSeal,
    TamperLog,
    allocate_generation,
    link_store,
    parse_record,
    peek,
    read_generation,
    record,
)

dist = pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parents[1]
KEY = b"cluster-store-test-key-0123456789"
OTHER_KEY = b"cluster-store-other-key-987654321"
GARBAGE = b"not-a-number"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=30),
                         wait_for_workers=False)


def client(port: int, timeout: float = 30.0) -> Any:
    """A keyless process's connection (retries until the store is up)."""
    return dist.TCPStore("127.0.0.1", port, None, False,
                         timeout=datetime.timedelta(seconds=timeout))


# --------------------------------------------------------------------------- the pieces
def test_a_sealed_value_opens_only_under_its_key_name_and_cluster_key() -> None:
    seal, other = StoreSeal(KEY), StoreSeal(OTHER_KEY)
    v = seal.seal("node/1", record(1, 3))
    assert seal.open("node/1", v) == record(1, 3)
    assert seal.open("node/2", v) is None  # moved to another key
    assert other.open("node/1", v) is None  # sealed under another key
    assert seal.open("node/1", other.seal("node/1", record(1, 3))) is None
    assert seal.open("node/1", v[:-1] + bytes([v[-1] ^ 1])) is None  # altered
    for raw in (b"", GARBAGE, record(1, 3), b"\0" * 40, b"x" * (1 << 20)):
        assert seal.open("node/1", raw) is None
    # insecure: nothing to check, but the record is still parsed totally
    assert StoreSeal(None).open("node/1", GARBAGE) == GARBAGE


@pytest.mark.parametrize("value", [GARBAGE, b"{}", b"[1]", b'{"gen": 0, "rank": 1}',
                                   b'{"gen": true, "rank": 1}', b'{"gen": 2, "rank": 2}',
                                   b'{"gen": 1e3, "rank": 1}', b'{"gen": 2, "rank": 1, "x": 0}',
                                   b"\xff\xfe", b"[" * 100_000, b'{"gen": 9007199254740992, '
                                                                 b'"rank": 1}'])
def test_a_record_is_parsed_totally(value: bytes) -> None:
    assert parse_record(value, 1) is None
    assert parse_record(record(1, 7), 1) == 7


@pytest.mark.parametrize("counter", [None, GARBAGE, b"5", b"-3", b"99999999999999999999",
                                     b"\0atom-core: absent\0"])
def test_a_generation_is_allocated_whatever_a_keyless_writer_left(counter: bytes | None
                                                                  ) -> None:
    """`add` on a counter that is not a number drops the caller's store connection; a
    reset counter or a deleted record alone never hands out a generation a peer has seen."""
    port = free_port()
    st = host_store(port)
    seal, tamper = StoreSeal(KEY), TamperLog("test")
    if counter is not None:
        st.set("gen/1", counter)
    g1 = allocate_generation(st, 1, seal, tamper)
    assert g1 == (6 if counter == b"5" else 1)
    st.set("node/1", seal.seal("node/1", record(1, g1)))
    st.set("gen/1", b"0")  # reset: the record still counts
    g2 = allocate_generation(st, 1, seal, tamper)
    assert g2 == g1 + 1
    st.set("node/1", seal.seal("node/1", record(1, g2)))
    st.delete_key("node/1")  # deleted record: the counter still counts
    assert allocate_generation(st, 1, seal, tamper) == g2 + 1
    # the connection survived all of it
    assert peek(st, "gen/1") == str(g2 + 1).encode()
    assert peek(st, "missing") is None


def test_forged_records_are_ignored_and_logged_once_naming_the_key(
        caplog: pytest.LogCaptureFixture) -> None:
    st = host_store(free_port())
    seal, tamper = StoreSeal(KEY), TamperLog("rank 0")
    for raw in (GARBAGE, record(1, 9), StoreSeal(OTHER_KEY).seal("node/1", record(1, 9)),
                seal.seal("node/2", record(1, 9))):
        st.set("node/1", raw)
        assert read_generation(st, 1, seal, tamper) is None
    st.set("node/1", seal.seal("node/1", record(1, 4)))
    assert read_generation(st, 1, seal, tamper) == 4
    said = [r.getMessage() for r in caplog.records if "'node/1'" in r.getMessage()]
    assert len(said) == 1 and "ignored" in said[0] and tamper.ignored["node/1"] == 4


def test_a_link_rendezvous_waits_past_forged_values_and_stops_on_request() -> None:
    """gloo reads its peer's address through the link store: a forged value is not handed
    to gloo; the real peer's write replaces it. A stop ends the wait at once (no thread left
    inside gloo), and a deadline names the key it waited for."""
    st = host_store(free_port())
    seal, tamper, stop = StoreSeal(KEY), TamperLog("test"), threading.Event()
    a = link_store(st, "link/x/", seal, tamper, stop, 10.0)
    b = link_store(st, "link/x/", seal, tamper, stop, 10.0)
    st.set("link/x/0/1", StoreSeal(OTHER_KEY).seal("link/x/0/1", b"forged address"))
    threading.Timer(0.3, lambda: b.set("0/1", b"real address")).start()
    t0 = time.monotonic()
    assert a.get("0/1") == b"real address" and time.monotonic() - t0 >= 0.25
    assert tamper.ignored["link/x/0/1"] == 1
    waiting = link_store(st, "link/y/", seal, tamper, stop, 30.0)
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped"):
        waiting.get("0/0")
    assert time.monotonic() - t0 < 5
    short = link_store(st, "link/z/", seal, tamper, threading.Event(), 0.3)
    st.set("link/z/0/0", GARBAGE)
    with pytest.raises(TimeoutError, match="'link/z/0/0'.*fail authentication"):
        short.get("0/0")


# --------------------------------------------------------------------------- processes
N_PREFILL, N_DECODE = 1, 2
WORLD = 1 + N_PREFILL + N_DECODE
# every link's name as both ends make it when every process is at generation 1 (ranks and
# generations of both ends), and the gloo keys under it: each end's address
PREFIXES = [f"link/0.1/{r}.1/" for r in range(1, WORLD)] + [
    f"link/{d}.1/{p}.1/" for d in range(1 + N_PREFILL, WORLD) for p in range(1, 1 + N_PREFILL)]
GLOO_KEYS = [f"{p}0/{i}" for p in PREFIXES for i in (0, 1)]


def cluster_argv(port: int, rank: int) -> list[str]:
    return [sys.executable, "-m", "atom_core.cli", "pd-cluster", "--prefill", str(N_PREFILL),
            "--decode", str(N_DECODE), *SHAPE, "--json", "--rank", str(rank), "--port",
            str(port)]


def run_tampered(before: Callable[[Any], None], during: Callable[[Any], None] | None = None
                 ) -> tuple[dict[str, Any], str]:
    """Rank 0 alone; `before(store)` from a keyless client; then the workers; `during(store)`
    every 50 ms while they run. The frontend's JSON and every process's stderr."""
    port = free_port()
    env = {**os.environ, PD_KEY_ENV: secrets.token_hex(32), "OMP_NUM_THREADS": "1"}
    deadline = 300 * load_factor()
    procs = [subprocess.Popen(cluster_argv(port, 0), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)]
    done = threading.Event()
    try:
        rogue = client(port, timeout=deadline)
        while peek(rogue, "node/0") is None:  # (rank 0 registered: the workers are next)
            time.sleep(0.01)
        before(rogue)
        procs += [subprocess.Popen(cluster_argv(port, r), cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                  for r in range(1, WORLD)]
        if during is not None:
            def keep_tampering() -> None:
                while not done.wait(0.05):
                    try:
                        during(rogue)
                    except Exception:  # noqa: BLE001 - the store ended with the cluster
                        return

            threading.Thread(target=keep_tampering, daemon=True).start()
        outs = [p.communicate(timeout=deadline) for p in procs]
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errors = "\n".join(f"--- rank {r} (exit {p.returncode})\n{err}"
                       for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)))
    assert "terminate called" not in errors, errors[-4000:]
    assert [p.returncode for p in procs] == [0] * WORLD, errors[-4000:]
    return json.loads(outs[0][0].strip().splitlines()[-1]), errors


def served_exactly(out: dict[str, Any]) -> None:
    assert out["exact"] is True and out["failed"] == 0 and out["requests"] == 14, out
    assert all(w["generated_tokens"] > 0 for k, w in out["workers"].items()
               if k.startswith("decode")), out["workers"]


def test_garbage_in_every_key_the_cluster_reads_is_ignored() -> None:
    def before(st: Any) -> None:
        for r in range(WORLD):
            st.set(f"gen/{r}", GARBAGE)
            st.set(f"node/{r}", GARBAGE)
        for k in GLOO_KEYS:
            st.set(k, GARBAGE)

    def during(st: Any) -> None:
        for r in range(1, WORLD):
            st.set(f"gen/{r}", GARBAGE)

    out, errors = run_tampered(before, during)
    served_exactly(out)
    assert "ignored the cluster store's 'node/1'" in errors
    assert "ignored the cluster store's 'gen/2'" in errors  # (its `add` would have cut it off)


def test_bumped_generations_make_no_real_link_stale() -> None:
    def before(st: Any) -> None:
        for r in range(WORLD):
            st.add(f"gen/{r}", 7)

    def during(st: Any) -> None:
        for r in range(WORLD):
            st.add(f"gen/{r}", 1)

    out, errors = run_tampered(before, during)
    served_exactly(out)
    assert "no link with" not in errors, errors[-3000:]


def test_records_written_before_the_workers_register_are_ignored() -> None:
    """A keyless writer claims every worker's record (plain JSON, plausible generations) and
    sets the counters before any worker starts."""
    def before(st: Any) -> None:
        for r in range(1, WORLD):
            st.set(f"gen/{r}", b"2")
            st.set(f"node/{r}", record(r, 3))

    out, errors = run_tampered(before)
    served_exactly(out)
    assert "ignored the cluster store's 'node/3'" in errors


def test_values_sealed_under_another_key_are_ignored() -> None:
    """Records and gloo's rendezvous addresses sealed with a wrong key before the workers
    start, and every record forged again once all of them registered (each process writes
    its own back)."""
    forge = StoreSeal(OTHER_KEY)
    forged = {r: forge.seal(f"node/{r}", record(r, 9)) for r in range(WORLD)}
    again = threading.Event()

    def before(st: Any) -> None:
        for r in range(WORLD):
            st.set(f"node/{r}", forged[r])
        for k in GLOO_KEYS:
            st.set(k, forge.seal(k, os.urandom(170)))

    def during(st: Any) -> None:
        if not again.is_set() and all(peek(st, f"node/{r}") not in (None, forged[r])
                                      for r in range(WORLD)):
            again.set()
            for r in range(WORLD):
                st.set(f"node/{r}", forged[r])

    out, errors = run_tampered(before, during)
    served_exactly(out)
    assert again.is_set()
    assert "ignored the cluster store's 'node/2'" in errors
    assert "wrote back the cluster store's 'node/0'" in errors  # (rank 0 registered first)
    assert any(f"ignored the cluster store's '{k}'" in errors for k in GLOO_KEYS), \
        errors[-3000:]
