"""Peak memory of a training step, measured by the CPU allocator (no code shared with the planner).

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of torch's CPU
allocator as a ``[memory]`` event with a signed byte count (read from the profiler's raw event
list: its per-op view attributes the allocations made inside an op to the op). A step's peak is the bytes live when it
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
    # the raw events: the function-event view folds allocations made inside an op into that op
    raw = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    running = peak = 0
    for e in sorted((e for e in raw if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return start + peak, start
