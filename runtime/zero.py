"""ZeRO stages 1 and 2 over the data-parallel axes (stage 3 needs no code here: its plans store
parameters split over the data-parallel axes and gather them through ordinary conversions).

Stage 1: when backward ends, each parameter's gradient (a partial sum over the data-parallel
ranks) is reduce-scattered along its first dim that the data-parallel degree divides; the
optimizer updates only this rank's slice, whose states are all it keeps; the updated slices are
all-gathered back into the parameter. Stage 2 does the same but reduce-scatters each gradient as
soon as backward has accumulated it and frees the full gradient, so gradients are held 1/D too.
Parameters no dim of which splits D ways stay as in stage 0 (gradient all-reduced).
"""

from __future__ import annotations

from typing import Any

import torch

from planner.layout import zero_dim
from planner.runtime.collectives import CommRecorder, all_gather, all_gather_into, all_reduce, reduce_scatter
from planner.runtime.groups import MeshGroups
from planner.runtime.precision import OptimizerWrapper


class ZeroShards:
    """The data-parallel slices of a module's parameters and the gradients reduced into them."""

    def __init__(self, params: dict[str, torch.nn.Parameter], dp_axes: dict[str, tuple[str, ...]], stage: int, mg: MeshGroups, rec: CommRecorder,
                 bucketed: set[str] | None = None) -> None:
        """``bucketed``: parameters the plan's gradient buckets reduce and gather
        (runtime.buckets, set as ``buckets``); the others one collective each, here."""
        self.stage, self.mg, self.rec = stage, mg, rec
        self.bucketed = bucketed or set()
        self.buckets: Any = None
        self.params = params
        self.axes = dp_axes
        self.dims: dict[str, int] = {}
        self.shards: dict[str, torch.nn.Parameter] = {}
        for name, p in params.items():
            axes = dp_axes.get(name, ())
            d = zero_dim(tuple(p.shape), mg.size(axes)) if axes else None
            if d is None:
                continue
            self.dims[name] = d
            # a view of this rank's slice of the parameter: updated in place, no extra memory
            self.shards[name] = torch.nn.Parameter(self.slice_of(p.data, name))
            if stage == 2 and name not in self.bucketed:
                p.register_post_accumulate_grad_hook(self._reduce_now(name))

    def _reduce_now(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            self._reduce(name, "bwd")
        return hook

    def slice_of(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's data-parallel slice of ``t`` (shaped like parameter ``name``): a view."""
        axes = self.axes[name]
        return t.chunk(self.mg.size(axes), self.dims[name])[self.mg.index(axes)]

    def _reduce(self, name: str, phase: str) -> None:
        p, shard = self.params[name], self.shards[name]
        if p.grad is None:
            return
        g = reduce_scatter(p.grad, self.axes[name], self.dims[name], self.mg, self.rec, phase)
        if self.stage == 2:  # the full gradient is freed; only the reduced slice stays (and sums micro-batches)
            shard.grad = g if shard.grad is None else shard.grad.add_(g)
            p.grad = None
        else:  # stage 1 keeps the gradient buffer and reduces into its own slice of it
            view = self.slice_of(p.grad, name)
            view.copy_(g)
            shard.grad = view

    def reduce_at_backward_end(self) -> None:
        """Stage 1 reduce-scatters here; parameters that cannot be split are all-reduced."""
        for name, p in self.params.items():
            axes = self.axes.get(name, ())
            if not axes or p.grad is None or name in self.bucketed:
                continue
            if name in self.shards:
                if self.stage == 1:
                    self._reduce(name, "step")
            else:
                p.grad.copy_(all_reduce(p.grad, axes, self.mg, self.rec, "step"))

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        return [self.shards.get(name, p) for name, p in self.params.items()]

    def gather_updated(self) -> None:
        """Each parameter's slices gathered back into it (its own slice is a view of it already)."""
        if self.buckets is not None:
            self.buckets.all_gather_updated()
        with torch.no_grad():
            for name, shard in self.shards.items():
                if name in self.bucketed:
                    continue
                all_gather_into(self.params[name].detach(), shard.detach(), self.axes[name], self.dims[name], self.mg, self.rec, "step")

    def full_grad(self, name: str) -> torch.Tensor | None:
        """This rank's (tensor-parallel) gradient, reduced over the data-parallel axes."""
        if name not in self.shards:
            return self.params[name].grad
        g = self.shards[name].grad
        if g is None:
            return None
        return all_gather(g.detach(), self.axes[name], self.dims[name], self.mg, CommRecorder(), "step")


class ZeroOptimizer(OptimizerWrapper):
    """An optimizer over this rank's slices (``inner``, built on ``shards.optimizer_params()``);
    ``step`` updates them and gathers the parameters."""

    def __init__(self, shards: ZeroShards, inner: Any) -> None:
        self.shards = shards
        self.inner = inner

    def step(self) -> None:
        self.inner.step()
        self.shards.gather_updated()

    def wrapped_params(self) -> list[torch.Tensor]:
        return list(self.shards.params.values())
