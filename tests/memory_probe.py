"""Peak memory of a training step, measured by the CPU allocator (no code shared with the planner).

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of torch's CPU
allocator as an allocation event, with the allocator's count of live bytes after it. A step's peak
is the bytes live when it starts (the storages of the tensors given: parameters and optimizer
states) plus the largest rise of that count while it runs. Gradients are set to None before a
step, so what the step allocates (activations, gradients, temporaries, collective buffers) is all
counted.

**Why the count, not the events' sizes.** The profiler records events on the threads it profiles
only. A gloo collective runs on the process group's worker thread, and that thread often drops the
last reference to a finished collective's tensors (its inputs, outputs and buffers, once the
caller has dropped its own): the free is real (microseconds after the collective) but no event
says so, and a running sum of the events' sizes keeps those bytes live for the rest of the step
(measured, HF Llama under 1-D tensor parallelism on 4 ranks: 61-81 KB over the step's start on
ranks running identical work, by chance; 61,480 B on every rank by the count). The allocator keeps
its count under a lock from every thread when ``caffe2_report_cpu_memory_usage`` is set (c10's flag
for exactly this bookkeeping; without it, only profiled threads update the count), so the probe
sets it while it measures.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@contextmanager
def counting_every_thread() -> Iterator[None]:
    """c10's ``caffe2_report_cpu_memory_usage`` on (the CPU allocator counts live bytes on every
    thread, not only on profiled ones), restored after."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    saved, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = saved


def _allocations(tree: Iterable[Any]) -> list[tuple[int, int, int]]:
    """(time, bytes allocated (negative: freed), live bytes counted after) of every allocation event."""
    out, stack = [], list(tree)
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            ex = node.extra_fields
            out.append((node.start_time_ns, ex.alloc_size, ex.total_allocated))
        stack.extend(node.children)
    return sorted(out)


def peak_over(step: Callable[[], None], live: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(peak bytes over ``step()``, bytes live at its start): ``live`` plus the largest rise of
    the allocator's count of live bytes during the step over the count before it."""
    start = storage_bytes(live)
    with counting_every_thread():
        events = _counts(step)
    if not events:
        return start, start
    _, size, total = events[0]
    before = total - size
    return start + max(0, max(t for _, _, t in events) - before), start


def _counts(fn: Callable[[], Any]) -> list[tuple[int, int, int]]:
    """The allocation events of ``fn()`` (:func:`_allocations`), profiled."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _allocations(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]


def allocator_count() -> int:
    """The CPU allocator's count of live bytes in this process now (read off one small allocation's
    event). Inside :func:`counting_every_thread`, so that the count keeps up with every thread."""
    events = _counts(lambda: torch.empty(64, dtype=torch.uint8))
    _, size, total = events[0]
    return total - size


def peak_count(fn: Callable[[], Any]) -> int:
    """The largest count of live bytes while ``fn()`` runs (inside :func:`counting_every_thread`)."""
    events = _counts(fn)
    return max((t for _, _, t in events), default=allocator_count())


MARK_BYTES = 1_000_003  # a step boundary's marker allocation (a prime: no tensor here has that size)


def peaks_over_steps(steps: Sequence[Callable[[], object]], live: Callable[[], Iterable[torch.Tensor]], after: Callable[[], None]) -> list[tuple[int, int]]:
    """:func:`peak_over` for several steps in one profiling session, ``after()`` (which must
    complete every message the steps began) inside it too: (peak bytes, bytes live at its start)
    per step, ``live()`` read before each.

    Why one session: a process group's work records a profiler range when it begins inside a
    session and closes it when it completes; a point-to-point message that begins in one step's
    session and completes in the next one's (or after the last, CDP's ring) closes a range of a
    session already gone, and the process dies of heap corruption (measured: runtime.cdp's
    CDPTrainer under one session per step, 3 ranks of 4 aborted with 'free(): invalid size' or
    'double free or corruption'). The steps, and ``after()`` (not counted in any step), are told
    apart by a marker allocation of MARK_BYTES before each."""
    starts: list[int] = []

    def mark() -> None:
        torch.empty(MARK_BYTES, dtype=torch.uint8)

    def run() -> None:
        for step in steps:
            starts.append(storage_bytes(live()))
            mark()
            step()
        mark()
        after()

    with counting_every_thread():
        events = _counts(run)
    marks = [k for k, (_, size, _) in enumerate(events) if size == MARK_BYTES]
    assert len(marks) == len(steps) + 1, f"{len(marks)} markers of {MARK_BYTES} B for {len(steps)} steps and after()"
    out = []
    for k, (at, end) in enumerate(itertools.pairwise(marks)):
        before = events[at][2] - MARK_BYTES
        # the step's events: after the marker's free, up to the next marker
        during = [t for _, size, t in events[at + 1 : end] if abs(size) != MARK_BYTES]
        out.append((starts[k] + max(0, max(during, default=before) - before), starts[k]))
    return out
