"""The gradient sync in buckets, overlapped with backward (the plan's ``grad_buckets``).

Each parameter of a bucket has a post-accumulate-grad hook: when backward has accumulated the last
gradient of a bucket, the bucket's collective starts asynchronously on its process group while
backward goes on:

* an **all-reduce** bucket (ZeRO-0, ZeRO-3's and ZeRO-1/2's unsplittable parameters, partial sums
  over tensor-parallel axes): the gradients are copied into one flat buffer, the parameters'
  ``.grad`` become views of it (their own tensors are freed), and the buffer is summed in place;
* a **reduce-scatter** bucket (ZeRO-1/2, :mod:`runtime.zero`): the buffer holds each rank's chunks
  of every gradient in turn (rank 0's chunks of all the bucket's gradients, then rank 1's, ...),
  so one reduce-scatter leaves this rank the sums of its chunks, which become its slices'
  gradients (ZeRO-2 frees the full gradients as soon as they are packed);
* a ZeRO-1 bucket the plan sums by **all-reduce** (where that is faster, as on gloo:
  :func:`planner.schemes.zero.zero1_reduce`): summed in place as above, its slices' gradients are then
  views of this rank's chunks of the sums.

When backward ends, :meth:`GradBuckets.finish` starts any bucket that is not complete (a parameter
that got no gradient this step: the others go without it), waits for all of them, and hands the
reduce-scatters' results to the slices. ``all_gather_updated`` is ZeRO-1/2's other half, after the
optimizer step: each reduce-scatter bucket's updated slices gathered back into the parameters in
one all-gather.

Inside ``ParallelModule.no_sync`` the step-phase buckets wait (gradients accumulate locally and the
next synced backward packs the sums); ZeRO-2's backward-phase buckets run in every backward (each
micro-batch's reduced chunks are summed into the slices). Buckets start in the order they
complete, which is the same on every rank (every rank runs the same backward), as gloo and NCCL
need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from planner.layout import zero_dim
from planner.plan import GradBucket
from planner.runtime.collectives import CommRecorder, Issued, _nbytes, named_failure
from planner.runtime.groups import MeshGroups


class GradBuckets:
    def __init__(self, buckets: tuple[GradBucket, ...], params: dict[str, torch.nn.Parameter], mg: MeshGroups, rec: CommRecorder,
                 syncing: Callable[[], bool], shards: dict[str, torch.nn.Parameter] | None = None, stage: int = 0) -> None:
        """``params``: traced parameter node name -> this rank's parameter; ``syncing()``: whether
        this backward syncs (False inside no_sync); ``shards``: ZeRO-1/2's slices (name -> the
        optimizer's parameter, a view of this rank's chunk), ``stage`` their ZeRO stage."""
        self.buckets = buckets
        self.params = params
        self.shards = shards or {}
        self.stage = stage
        self.mg, self.rec, self.syncing = mg, rec, syncing
        self.axes = {name: b.axes for b in buckets for name in b.params}
        self.arrived: list[set[str]] = [set() for _ in buckets]
        self.in_flight: dict[int, tuple[Any, torch.Tensor, list[str]]] = {}  # bucket -> (work or None, result buffer, parameters in it)
        self.started_in_backward = 0  # of the last synced step: buckets started by a hook, while backward ran
        self._early = 0
        self._handles = [params[name].register_post_accumulate_grad_hook(self._hook(k, name)) for k, bucket in enumerate(buckets) for name in bucket.params]

    def remove(self) -> None:
        """Take the hooks off the parameters: backward starts no bucket any more."""
        if self.in_flight:
            raise RuntimeError(f"{len(self.in_flight)} gradient bucket(s) still in flight: finish() them before removing the hooks")
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _scatters(self, k: int) -> bool:
        return self.buckets[k].collectives[0][0] == "reduce_scatter"

    @staticmethod
    def _gathers(bucket: GradBucket) -> bool:
        """ZeRO-1/2: the bucket's updated slices are all-gathered after the step."""
        return any(kind == "all_gather" for kind, _ in bucket.collectives)

    def _runs_now(self, k: int) -> bool:
        """A bucket reduced in backward (ZeRO-2) runs in every backward; the others when syncing."""
        return self.buckets[k].collectives[0][1] == "bwd" or self.syncing()

    def _hook(self, k: int, name: str) -> Callable[[torch.Tensor], None]:
        def ready(p: torch.Tensor) -> None:
            if not self._runs_now(k) or k in self.in_flight:
                return
            self.arrived[k].add(name)
            if len(self.arrived[k]) == len(self.buckets[k].params):
                self._start(k)
                self._early += 1
        return ready

    @staticmethod
    def _chunks(t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """``t``'s ZeRO chunks over ``n`` ranks (along runtime.zero's dim: the first ``n`` divides)."""
        return t.chunk(n, zero_dim(tuple(t.shape), n))  # type: ignore[arg-type]

    def _start(self, k: int) -> None:
        bucket = self.buckets[k]
        names = [n for n in bucket.params if self.params[n].grad is not None]
        n = self.mg.size(bucket.axes)
        group = self.mg.group(bucket.axes) if n > 1 else None
        if not self._scatters(k):
            flat = torch.cat([self.params[m].grad.reshape(-1) for m in names]) if names else torch.empty(0)  # type: ignore[union-attr]
            offset = 0
            for m in names:
                p = self.params[m]
                size = p.numel()
                p.grad = flat[offset:offset + size].view_as(p)
                offset += size
            work = None
            if group is not None and names:
                self.rec.add("all_reduce", bucket.axes, _nbytes(flat), bucket.collectives[0][1])
                work = Issued(dist.all_reduce(flat, group=group, async_op=True), "all_reduce", bucket.axes, self.mg, bucket.collectives[0][1])
            self.in_flight[k] = (work, flat, names)
            return
        grads = {m: self.params[m].grad for m in names}
        chunks = {m: self._chunks(grads[m], n) for m in names}  # type: ignore[arg-type]
        flat = torch.cat([chunks[m][r].reshape(-1) for r in range(n) for m in names]) if names else torch.empty(0)
        if self.stage == 2:
            for m in names:
                self.params[m].grad = None  # packed: the full gradient is freed
        del grads, chunks
        out = flat.new_empty(flat.numel() // n)
        work = None
        if names:
            self.rec.add("reduce_scatter", bucket.axes, _nbytes(flat), bucket.collectives[0][1])
            work = Issued(dist.reduce_scatter(out, list(flat.chunk(n)), group=group, async_op=True), "reduce_scatter", bucket.axes, self.mg,
                          bucket.collectives[0][1])
        self.in_flight[k] = (work, out, names)

    def finish(self) -> None:
        """When a backward ends: start what is due and not started, wait for everything started,
        hand reduced chunks to the slices, and reset. Step-phase buckets are due when syncing."""
        syncing = self.syncing()
        for k in range(len(self.buckets)):
            if k not in self.in_flight and self._runs_now(k):
                self._start(k)
        for k, (work, out, names) in self.in_flight.items():
            if work is not None:
                work.wait()
            if self._scatters(k):
                self._to_slices(out, names)
            elif self._gathers(self.buckets[k]):
                self._reduced_to_slices(names)
        self.in_flight.clear()
        for arrived in self.arrived:
            arrived.clear()
        if syncing:
            self.started_in_backward, self._early = self._early, 0

    def _to_slices(self, out: torch.Tensor, names: list[str]) -> None:
        offset = 0
        for m in names:
            shard = self.shards[m]
            size = shard.numel()
            piece = out[offset:offset + size].view(shard.shape)
            offset += size
            if self.stage == 2:  # the slice's gradient lives in the bucket's result (and sums micro-batches)
                shard.grad = piece if shard.grad is None else shard.grad.add_(piece)
            else:  # stage 1 keeps the full gradient and its own slice of it holds the sum
                grad = self.params[m].grad
                assert grad is not None
                view = self._chunks(grad, self.mg.size(self.axes[m]))[self.mg.index(self.axes[m])]
                view.copy_(piece)
                shard.grad = view

    def _reduced_to_slices(self, names: list[str]) -> None:
        """ZeRO-1 summed by all-reduce: each slice's gradient is its chunk of the summed gradient."""
        for m in names:
            grad = self.params[m].grad
            assert grad is not None
            self.shards[m].grad = self._chunks(grad, self.mg.size(self.axes[m]))[self.mg.index(self.axes[m])]

    def all_gather_updated(self) -> None:
        """ZeRO-1/2 after the optimizer step: each reduce-scatter bucket's updated slices gathered
        into the parameters, one all-gather per bucket."""
        with torch.no_grad():
            for bucket in self.buckets:
                if not self._gathers(bucket):
                    continue
                n = self.mg.size(bucket.axes)
                mine = torch.cat([self.shards[m].detach().reshape(-1) for m in bucket.params])
                out = mine.new_empty(mine.numel() * n)
                self.rec.add("all_gather", bucket.axes, _nbytes(out), "step")
                try:
                    dist.all_gather(list(out.chunk(n)), mine, group=self.mg.group(bucket.axes))
                except RuntimeError as exc:
                    raise named_failure("all_gather", bucket.axes, self.mg, "step", exc) from exc
                for r, part in enumerate(out.chunk(n)):
                    offset = 0
                    for m in bucket.params:
                        p = self.params[m]
                        chunk = self._chunks(p.detach(), n)[r]
                        size = chunk.numel()
                        chunk.copy_(part[offset:offset + size].view(chunk.shape))
                        offset += size
