"""Live-tensor accounting on any device: the bytes of every tensor storage alive, and their peak.

``LiveMemory`` is a TorchDispatchMode: each op's outputs register their storages (weak references
with finalizers, so a storage counts until the last tensor or autograd-saved variable using it is
gone), and the running total's peak is kept. Call ``track`` on what existed before (parameters,
gradients, optimizer states) so the total starts right. This is how the benchmarks measure the
memory a plan really holds on CPU, where there is no allocator to ask.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)

    def track(self, tensors: Any) -> None:
        flat, _ = tree_flatten(tensors)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in self.live:
                continue
            self.live[ptr] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, ptr)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out
