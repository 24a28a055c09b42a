"""Process groups for a mesh: one per subset of mesh axes (degree > 1), created on every rank.

This is the only place that creates process groups. The mesh is a torch ``DeviceMesh`` with the
plan's axis names (``init_device_mesh``, or one the user passes whose names and shape are the
plan's), whose groups serve each single axis; a subset of several axes gets its own group from
``new_subgroups_by_enumeration``, which makes every rank take part in creating every group (as
torch.distributed requires) and returns the one this rank belongs to. Ranks map to coordinates
row-major, outermost axis first, as ``DeviceMesh`` lays them out.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from planner.mesh import Mesh

T = TypeVar("T")


class CollectiveBarred(ValueError):
    """A collective over an axis whose ranks cannot meet in one (MeshGroups.barred)."""


@dataclass
class MeshGroups:
    mesh: Mesh
    rank: int
    coords: dict[str, int]
    groups: dict[tuple[str, ...], dist.ProcessGroup] = field(default_factory=dict)
    device_mesh: Any = None  # the torch DeviceMesh over the plan's axes (None: groups built by hand, or one process)
    # axis -> why no collective may run over it (runtime.cdp: CDP's workers run their ops at different times)
    barred: dict[str, str] = field(default_factory=dict)

    def group(self, axes: tuple[str, ...]) -> dist.ProcessGroup:
        key = self.mesh.sort_axes(axes)
        barred = [a for a in key if a in self.barred]
        if barred:  # raised on every rank that reaches the collective, where joining it would hang
            raise CollectiveBarred(f"a collective over mesh axes {key} was issued, but {self.barred[barred[0]]}")
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


def build_groups(mesh: Mesh, device_type: str = "cpu", device_mesh: Any = None) -> MeshGroups:
    """The groups of ``mesh`` on this rank, over ``device_mesh`` (a torch DeviceMesh with the
    mesh's axis names and degrees) or one made here with ``init_device_mesh(device_type, ...)``."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: launch with torchrun (or call init_process_group) first")
    world = dist.get_world_size()
    if world != mesh.size:
        raise ValueError(f"the plan's mesh {mesh} has {mesh.size} devices but WORLD_SIZE is {world}; re-plan for {world} devices")
    if device_mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(device_type, mesh.degrees, mesh_dim_names=mesh.axes)
    else:
        check_device_mesh(device_mesh, mesh)
    rank = dist.get_rank()
    result = MeshGroups(mesh, rank, mesh.coords(rank), device_mesh=device_mesh)
    _release_at_exit(result)
    axes = [a for a in mesh.axes if mesh.degree(a) > 1]
    for r in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, r):
            if r == 1:
                result.groups[subset] = device_mesh.get_group(subset[0])
                continue
            mine, _ = dist.new_subgroups_by_enumeration(mesh.groups(subset))
            assert mine is not None
            result.groups[subset] = mine
    inherit_timeout(list(result.groups.values()))
    return result


_BUILT: list[weakref.ref[MeshGroups]] = []  # the groups built in this process (released at exit)


def _release_at_exit(groups: MeshGroups) -> None:
    """Let go of ``groups``' process groups when the interpreter exits, before it finalizes.

    A gloo worker thread drops its last reference to a finished collective (and to the tensors it
    ran on) just after the rank that waited on it moves on. When that rank's next step is to exit,
    the drop can land while Python finalizes: releasing a tensor then takes the GIL, which a
    finalizing interpreter refuses to other threads by ending them, and ending a C++ thread there
    aborts the process ("terminate called without an active exception"; measured: 3 of 42
    launches of examples/train_gpt_tiny.py on 2 ranks beside the test suite, a rank aborting after
    the final barrier, the core's aborting thread in ProcessGroupGloo::runLoop releasing an
    AsyncBarrierWork; 0 of 171 launches with this release). A
    process group's destructor joins its worker threads (with the GIL released), so a group
    freed while the interpreter is still whole ends them cleanly. After ``destroy_process_group``
    torch holds no group; a ParallelModule still does (through these MeshGroups), and it may
    live until finalization in a reference cycle or a global. So at exit, before finalizing, the
    cycles are collected and, once torch.distributed is destroyed, these references go too. (A
    script that never calls ``destroy_process_group`` keeps torch's own references, and its
    groups live to finalization; the groups stay usable for the exit handlers that run after.)"""
    if not _BUILT:
        atexit.register(_release_groups)
    _BUILT.append(weakref.ref(groups))


def _release_groups() -> None:
    if not dist.is_initialized():  # destroyed: nothing can run a collective on these groups again
        for ref in _BUILT:
            groups = ref()
            if groups is not None:
                groups.groups.clear()
                groups.device_mesh = None
    gc.collect()


def inherit_timeout(groups: list[dist.ProcessGroup]) -> None:
    """Give ``groups`` the default group's timeout (``init_process_group(timeout=)``): torch makes
    sub-groups (DeviceMesh's too) with its 30-minute default instead, so a stalled rank would hold
    a sub-group's collectives that long whatever the user set (runtime/faults.py)."""
    try:
        device = torch.device("cuda") if torch.device("cuda") in dist.group.WORLD._device_types else torch.device("cpu")  # type: ignore[union-attr]
        timeout = dist.group.WORLD._get_backend(device).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):  # another backend, or a torch without these internals: groups keep torch's default
        return
    for group in groups:
        if group is not dist.group.WORLD:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def check_device_mesh(device_mesh: Any, mesh: Mesh) -> None:
    """A user's DeviceMesh serves the plan's mesh when it has the same axis names, degrees and the
    row-major rank layout (``init_device_mesh``'s); otherwise a ValueError says what differs."""
    names = tuple(device_mesh.mesh_dim_names or ())
    shape = tuple(device_mesh.mesh.shape)
    if names != mesh.axes or shape != mesh.degrees:
        raise ValueError(f"the DeviceMesh has axes {names} of sizes {shape}; the plan's mesh is {mesh} (axes {mesh.axes}, sizes {mesh.degrees}): "
                         f"build it with init_device_mesh(device_type, {mesh.degrees}, mesh_dim_names={mesh.axes})")
    if not torch.equal(device_mesh.mesh.flatten().cpu(), torch.arange(mesh.size)):
        raise ValueError("the DeviceMesh lays ranks out in another order than row-major (init_device_mesh's); the plan's coordinates assume that order")
