"""keep_freed_memory: a step's buffers stay mapped between steps (no page fault per step).

Each case runs in its own interpreter: the thresholds are process-wide and cannot be undone."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

GLIBC = sys.platform.startswith("linux") and ctypes.util.find_library("c") == "libc.so.6"
pytestmark = pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")

# What a model step does to the allocator, in a thread as the server's engine runs it: eight
# 1 MB buffers allocated, written, freed, fifty times; prints the thread's minor page faults.
STEPS = textwrap.dedent("""
    import ctypes, resource, sys, threading
    from atom_core.runtime.host_memory import keep_freed_memory
    print(keep_freed_memory() if sys.argv[1] == "keep" else "-")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)

    def step():
        bufs = [libc.malloc(1 << 20) for _ in range(8)]
        for p in bufs:
            ctypes.memset(p, 1, 1 << 20)
        for p in reversed(bufs):
            libc.free(p)

    def engine():
        step()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(50):
            step()
        print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    t = threading.Thread(target=engine)
    t.start()
    t.join()
""")


def run(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, **env}).stdout.split()
    return out[0], int(out[1])


def test_freed_step_buffers_are_not_faulted_in_again() -> None:
    # left alone, glibc trims the freed 8 MB at the heap's top each step and the next step
    # faults all 2,048 pages in again: the cost `atom-core serve` paid on every token
    _, faults_default = run("default")
    assert faults_default > 50 * 1000
    kept, faults_kept = run("keep")
    assert kept == "True"
    assert faults_kept < 100


def test_a_threshold_in_glibc_tunables_is_the_users_choice() -> None:
    kept, faults = run("keep", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert kept == "False"
    assert faults > 50 * 1000  # the user's 128 KB trim threshold, honoured
