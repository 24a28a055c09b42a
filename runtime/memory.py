"""Live-tensor accounting on any device: the bytes of every tensor storage alive, and their peak.

``LiveMemory`` is a TorchDispatchMode: each op's outputs register their storages (weak references
with finalizers, so a storage counts until the last tensor or autograd-saved variable using it is
gone), and the running total's peak is kept. Call ``track`` on what existed before (parameters,
gradients, optimizer states) so the total starts right. This is how the benchmarks measure the
memory a plan really holds on CPU, where there is no allocator to ask.

``SavedTensorMeter`` counts a narrower set: the live bytes of what autograd saved for backward
(through a saved-tensors hook), plus tensors handed to it; runtime.cdp's ``simulate_schedule``
measures a schedule's activation memory with it.
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


class SavedTensorMeter:
    """Live bytes of the tensors autograd saved for backward (parameters and the micro-batches'
    own input tensors excluded, ``exclude``): a pack hook
    keeps a weak reference to each saved tensor; a storage counts while any of them is alive."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.saved: list[tuple[weakref.ref[torch.Tensor], int, int]] = []

    def track_all(self, tensors: list[torch.Tensor]) -> None:
        """Count ``tensors`` as held too (a stage's outputs kept for the stages after it)."""
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.excluded:
                self.saved.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            # a detached alias: keeping the tensor itself would tie a saved output to its own
            # grad_fn in a reference cycle that only the garbage collector breaks
            alias = t.detach()
            storage = alias.untyped_storage()
            if storage.data_ptr() not in self.excluded:
                self.saved.append((weakref.ref(alias), storage.data_ptr(), storage.nbytes()))
            return alias

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def live_bytes(self) -> int:
        self.saved = [entry for entry in self.saved if entry[0]() is not None]
        return sum({ptr: nbytes for _, ptr, nbytes in self.saved}.values())
