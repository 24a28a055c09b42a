"""ZeRO-3's parameter units (the plan's ``param_units``), run as FSDP2 runs its per-block flat
parameters.

A ZeRO-3 plan stores every parameter split over the data-parallel axes and gathers it before
use (an edge :class:`runtime.collectives.Convert`, or a kernel that gathers its own input and
again in backward, :class:`runtime.kernels.RegatherKernel`). The planner packs those gathers per
block (:mod:`planner.overlap`); here each unit is:

* **forward**: one all-gather of the unit's shards, concatenated (this rank's shard of every
  member, rank-major in the result), copied out into one full tensor per member when it
  arrives. With prefetch, unit k+1's all-gather starts (asynchronously) as soon as unit k's has
  arrived, so it travels while unit k's ops compute. A member's full tensor leaves the unit when
  its gather site takes it: the graph holds it from then on (and autograd, where the consumer
  saves it and the plan keeps it).
* **backward**: each member's gradient (of its full tensor) is handed to the unit instead of
  being reduced on its own; when the last has arrived, the unit packs its chunks rank-major and
  starts one reduce-scatter, asynchronously, while backward goes on; the previous unit's, whose result
  becomes its shards' ``.grad`` (summed into it across micro-batches) first, so that one
  reduce-scatter's buffers are alive at a time (the packed gradients, and gloo's copies of the
  other ranks' chunks). The members a kernel
  re-gathers for backward are gathered again together, at the first saved tensor backward asks
  for, and the next unit in backward order is prefetched then.

:meth:`ParamUnits.finish` (at the end of every backward, also inside ``no_sync``: ZeRO-3 reduces
each micro-batch) waits for what is in flight and resets. Every rank runs the same graph, so the
collectives start in the same order everywhere, as gloo and NCCL need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.plan import ParamUnit
from planner.runtime.collectives import CommRecorder, Convert, Issued, _nbytes
from planner.runtime.groups import MeshGroups


@dataclass
class Member:
    conv: Convert  # the gather site (its one step is the all-gather)
    shard: torch.nn.Parameter  # this rank's stored slice of the parameter
    regather: bool
    reduced: bool

    @property
    def dim(self) -> int:
        d = self.conv.forward_steps[0].dim
        assert d is not None
        return d


class _Flight:
    """An all-gather in flight: the flat shards sent, the result, the work."""

    def __init__(self, work: Any, sent: torch.Tensor, out: torch.Tensor, members: list[int]) -> None:
        self.work, self.sent, self.out, self.members = work, sent, out, members


class ParamUnits:
    def __init__(self, units: tuple[ParamUnit, ...], members: list[list[Member]], mg: MeshGroups, rec: CommRecorder, prefetch: bool) -> None:
        self.units = units
        self.members = members
        self.mg, self.rec, self.prefetch = mg, rec, prefetch
        self.where: dict[int, tuple[int, int]] = {}  # id(conv) -> (unit, member)
        for k, unit_members in enumerate(members):
            for i, m in enumerate(unit_members):
                self.where[id(m.conv)] = (k, i)
                m.conv.unit = self
        self.gathering: dict[int, _Flight] = {}  # forward all-gathers in flight
        self.ready: dict[int, dict[int, torch.Tensor]] = {}  # forward: full tensors not taken yet
        self.regathering: dict[int, _Flight] = {}
        self.regathered: dict[int, dict[int, torch.Tensor]] = {}
        self.grads: dict[int, dict[int, torch.Tensor]] = {}
        self.reducing: list[tuple[int, list[int], Any, torch.Tensor]] = []  # (unit, members, work, result) in start order
        self.prefetched = 0  # all-gathers started ahead of use in the last forward and backward

    def _group(self, k: int) -> tuple[int, Any]:
        axes = self.units[k].axes
        return self.mg.size(axes), self.mg.group(axes)

    # ----------------------------------------------------------------- gathers

    def _start_gather(self, k: int, which: list[int], phase: str) -> _Flight:
        n, group = self._group(k)
        members = self.members[k]
        sent = torch.cat([members[i].shard.detach().reshape(-1) for i in which])
        out = sent.new_empty(sent.numel() * n)
        self.rec.add("all_gather", self.mg.mesh.sort_axes(self.units[k].axes), _nbytes(out), phase)
        work = Issued(dist.all_gather_single(out, sent, group=group, async_op=True), "all_gather", self.units[k].axes, self.mg, phase)
        return _Flight(work, sent, out, which)

    def _arrived(self, k: int, flight: _Flight) -> dict[int, torch.Tensor]:
        """Wait for ``flight`` and copy each member's full tensor out of the rank-major result."""
        flight.work.wait()
        n, _ = self._group(k)
        parts = flight.out.view(n, -1)
        full: dict[int, torch.Tensor] = {}
        offset = 0
        for i in flight.members:
            m = self.members[k][i]
            size = m.shard.numel()
            full[i] = torch.cat([parts[r, offset:offset + size].view(m.shard.shape) for r in range(n)], dim=m.dim)
            offset += size
        return full

    def begin(self) -> None:
        """A forward starts: what an earlier forward left behind (not taken) is dropped."""
        for flight in self.gathering.values():
            flight.work.wait()
        self.gathering.clear()
        self.ready.clear()
        self.prefetched = 0

    def take(self, conv: Convert) -> torch.Tensor:
        """The full tensor of gather site ``conv`` in forward (the unit gathered on first use)."""
        k, i = self.where[id(conv)]
        if k not in self.ready:
            flight = self.gathering.pop(k, None) or self._start_gather(k, list(range(len(self.members[k]))), "fwd")
            self.ready[k] = self._arrived(k, flight)
            del flight  # its result, copied out, goes before the next gather allocates its own
            if self.prefetch and k + 1 < len(self.units) and k + 1 not in self.gathering and k + 1 not in self.ready:
                self.gathering[k + 1] = self._start_gather(k + 1, list(range(len(self.members[k + 1]))), "fwd")
                self.prefetched += 1
        full = self.ready[k].pop(i)
        if not self.ready[k]:
            del self.ready[k]
        return full

    def _regather_members(self, k: int) -> list[int]:
        return [i for i, m in enumerate(self.members[k]) if m.regather]

    def regather(self, conv: Convert) -> torch.Tensor:
        """The full tensor of ``conv``'s parameter again, for backward (the unit's re-gathered
        members gathered together on first use; the previous such unit prefetched then)."""
        k, i = self.where[id(conv)]
        if k not in self.regathered:
            flight = self.regathering.pop(k, None) or self._start_gather(k, self._regather_members(k), "bwd")
            self.regathered[k] = self._arrived(k, flight)
            del flight
            if self.prefetch:
                j = next((j for j in range(k - 1, -1, -1) if self._regather_members(j)), None)
                if j is not None and j not in self.regathering and j not in self.regathered:
                    self.regathering[j] = self._start_gather(j, self._regather_members(j), "bwd")
                    self.prefetched += 1
        return self.regathered[k][i]

    # ----------------------------------------------------------------- gradients

    def reduce(self, conv: Convert, grad: torch.Tensor) -> None:
        """Backward of gather site ``conv``: its full gradient joins the unit's; the unit's
        reduce-scatter starts when every member's has arrived."""
        k, i = self.where[id(conv)]
        got = self.grads.setdefault(k, {})
        got[i] = grad if i not in got else got[i] + grad
        if len(got) == sum(1 for m in self.members[k] if m.reduced):
            self._start_reduce(k)

    def _start_reduce(self, k: int) -> None:
        while self.reducing:  # the previous unit's lands first: one reduce-scatter's buffers at a time
            self._deliver(*self.reducing.pop(0))
        n, group = self._group(k)
        got = self.grads.pop(k)
        self.regathered.pop(k, None)  # the unit's backward is over: its re-gathered tensors go
        members = self.members[k]
        order = [i for i in range(len(members)) if i in got]
        chunks = {i: got[i].chunk(n, members[i].dim) for i in order}
        flat = torch.cat([chunks[i][r].reshape(-1) for r in range(n) for i in order])
        del got, chunks
        out = flat.new_empty(flat.numel() // n)
        self.rec.add("reduce_scatter", self.mg.mesh.sort_axes(self.units[k].axes), _nbytes(flat), "bwd")
        work = Issued(dist.reduce_scatter(out, list(flat.chunk(n)), group=group, async_op=True), "reduce_scatter", self.units[k].axes, self.mg, "bwd")
        self.reducing.append((k, order, work, out))

    def _deliver(self, k: int, order: list[int], work: Any, out: torch.Tensor) -> None:
        """The unit's reduced chunks become its shards' gradients: views of the result, or, where
        a shard has a gradient already (a weight gathered in two units: tied, or a second
        micro-batch), summed into it; then every piece is copied out, so that the summed ones'
        part of the result does not stay alive through the others' views."""
        work.wait()
        shards = [self.members[k][i].shard for i in order]
        copy = any(p.grad is not None for p in shards) or len({id(p) for p in shards}) < len(shards)
        offset = 0
        for shard in shards:
            size = shard.numel()
            piece = out[offset:offset + size].view(shard.shape)
            offset += size
            if shard.grad is None:
                shard.grad = piece.clone() if copy else piece
            else:
                shard.grad.add_(piece)

    def finish(self) -> None:
        """When a backward ends: the units still collecting gradients reduce what they have (a
        member that got none this backward goes without), everything in flight lands, and the
        backward state resets."""
        for k in sorted(self.grads, reverse=True):
            self._start_reduce(k)
        while self.reducing:
            self._deliver(*self.reducing.pop(0))
        for flight in self.regathering.values():
            flight.work.wait()
        self.regathering.clear()
        self.regathered.clear()
