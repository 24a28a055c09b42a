"""Host memory for training on CPUs: freed memory stays in the process, as a caching allocator keeps it.

glibc's malloc serves a request above its mmap threshold (128 KiB, rising with the blocks freed,
to at most 32 MiB) with fresh pages from the kernel and hands them back on free, and trims the top
of its heap past 128 KiB of free space. Training allocates and frees the same large tensors every
step (activations, gradients, gradient buckets, optimizer temporaries), so every step faults every
page of them in again. Measured on the 2-core host (4 gloo ranks, mlp-large, data parallelism,
ZeRO-0): 206,000 minor page faults per rank per step (808 MiB), 600 ms of each rank's 1 s of CPU
in the kernel, a 1.93 s step; with the threshold raised and trimming off (:func:`keep_freed_memory`):
a few hundred faults, 0.15 s in the kernel, a 1.24 s step, which is what the planner predicts
(1.21 s). Small models (gpt-tiny) fault nothing either way.

This is what the allocators PyTorch recommends for CPU training do by default (jemalloc or
tcmalloc, which torch's own CPU launcher, ``torch.backends.xeon.run_cpu``, preloads). GPUs need
none of it: CUDA's caching allocator already keeps its blocks. The cost: the process keeps its
peak heap (which the next step reaches again) instead of returning it between steps.

``compile_plan`` calls :func:`keep_freed_memory` for a module on the CPU; ``planner calibrate``
calls it in its CPU workers, so what it measures is what training pays. Set
``PLANNER_HOST_MALLOC=system`` to leave malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 30  # requests below 1 GiB come from the heap, whose freed blocks are reused
TRIM_THRESHOLD = (1 << 31) - 1  # never give the top of the heap back (the largest value mallopt takes)

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep freed memory (once; later calls return the first answer).
    True if it did: glibc on Linux, and ``PLANNER_HOST_MALLOC`` is not ``system``."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("PLANNER_HOST_MALLOC", "").lower() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, 0)))
    if not ok:
        log.warning("malloc refused the settings that keep freed memory (mallopt); CPU steps fault their large tensors in every step")
    _done = ok
    return ok
