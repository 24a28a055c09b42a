"""Process groups for a mesh: one per subset of mesh axes (degree > 1), created on every rank.

This is the only place that creates process groups. ``new_subgroups_by_enumeration`` makes every
rank take part in creating every group (as torch.distributed requires) and returns the one this
rank belongs to.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch.distributed as dist

from planner.mesh import Mesh

T = TypeVar("T")


@dataclass
class MeshGroups:
    mesh: Mesh
    rank: int
    coords: dict[str, int]
    groups: dict[tuple[str, ...], dist.ProcessGroup] = field(default_factory=dict)

    def group(self, axes: tuple[str, ...]) -> dist.ProcessGroup:
        key = self.mesh.sort_axes(axes)
        try:
            return self.groups[key]
        except KeyError:
            raise ValueError(f"no process group for mesh axes {key} of mesh {self.mesh}") from None

    def index(self, axes: tuple[str, ...]) -> int:
        """This rank's position in the group over ``axes`` (row-major over those axes)."""
        idx = 0
        for a in self.mesh.sort_axes(axes):
            idx = idx * self.mesh.degree(a) + self.coords[a]
        return idx

    def peer(self, axis: str, coord: int) -> int:
        """Global rank of the rank whose coordinates equal this one's except ``axis = coord``."""
        return self.rank + (coord - self.coords[axis]) * self.mesh.stride(axis)

    def size(self, axes: tuple[str, ...]) -> int:
        return self.mesh.group_size(axes)


def agree_on_rank0(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0 only; every rank returns rank 0's (picklable) result, or raises the
    exception rank 0 raised (the others would otherwise wait for rank 0 until the timeout)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, compute())]
        except Exception as exc:
            box = [(False, exc)]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def build_groups(mesh: Mesh) -> MeshGroups:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: launch with torchrun (or call init_process_group) first")
    world = dist.get_world_size()
    if world != mesh.size:
        raise ValueError(f"the plan's mesh {mesh} has {mesh.size} devices but WORLD_SIZE is {world}; re-plan for {world} devices")
    rank = dist.get_rank()
    result = MeshGroups(mesh, rank, mesh.coords(rank))
    axes = [a for a in mesh.axes if mesh.degree(a) > 1]
    for r in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, r):
            mine, _ = dist.new_subgroups_by_enumeration(mesh.groups(subset))
            assert mine is not None
            result.groups[subset] = mine
    return result
