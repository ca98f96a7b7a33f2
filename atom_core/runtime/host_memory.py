"""Keep the host allocator from returning memory a model step allocates again at once.

A decode or prefill step on a torch CPU runtime allocates and frees the same activation buffers
(hundreds of KB to a few MB) every step. glibc's malloc returns freed memory at the top of a heap
to the kernel once it exceeds the trim threshold (`madvise(MADV_DONTNEED)`, or `sbrk` for the
main arena), and the next step touches it again: a page fault per 4 KB page. Its thresholds move
with what the process freed before: a process that built a model in memory ends up with high
thresholds and never trims, one that loaded the weights from disk (mmap, as `atom-core serve`
does) keeps them low and trims every step. Measured with the 8-layer `small-llama` of
`bench/serve.py` on one thread: 50-60 ms of CPU per token, a third of it in the kernel, against
34 ms with the thresholds below, the same work.

`keep_freed_memory()` fixes the thresholds (glibc `mallopt`): allocations up to `mmap_threshold`
come from the heap, and up to `trim_threshold` of free memory at a heap's top stays mapped. The
cost is that much resident memory per malloc arena (one per thread that allocates, at most 8 per
core), kept instead of returned. It changes the whole process, so it is called by the programs
atom-core owns (`atom-core serve`, the benchmarks), not by a runtime's constructor; code that
embeds a runtime calls it itself if it wants it. A `GLIBC_TUNABLES` that names a malloc
threshold, or either threshold's environment alias (`MALLOC_TRIM_THRESHOLD_`,
`MALLOC_MMAP_THRESHOLD_`), is the user's choice and is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# glibc's environment aliases of the malloc.mmap_threshold and malloc.trim_threshold tunables
_ENV_ALIASES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it (half its 64 MB heap size)
TRIM_THRESHOLD = 128 << 20


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD,
                      trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds; False (and nothing changed) where the C library is
    not glibc or the user set the thresholds (GLIBC_TUNABLES or their environment aliases)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables:
        return False
    # glibc also reads the thresholds from their older environment variables (the tunables'
    # aliases): a user who set one of those chose them as much as through GLIBC_TUNABLES
    if any(os.environ.get(var) for var in _ENV_ALIASES):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold is refused above glibc's ceiling
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
