"""Peak memory of a training step, measured by the CPU allocator (no code shared with the planner).

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of torch's CPU
allocator as a ``[memory]`` event with a signed byte count. A step's peak is the bytes live when it
starts (the storages of the tensors given: parameters and optimizer states) plus the largest
running sum of those events while it runs. Gradients are set to None before a step, so what the
step allocates (activations, gradients, temporaries, collective buffers) is all in the events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def peak_over(step: Callable[[], None], live: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(peak bytes over ``step()``, bytes live at its start): ``live`` plus the allocator's largest
    running sum of allocations minus frees during the step."""
    start = storage_bytes(live)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start)
    running = peak = 0
    for e in events:
        running += e.cpu_memory_usage
        peak = max(peak, running)
    return start + peak, start
