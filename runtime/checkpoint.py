"""Checkpoints that move between plans: the full state under the model's own parameter names.

``save_checkpoint(pm, optimizer, path)`` gathers every parameter and every optimizer state to its
full shape (undoing tensor-parallel sharding and ZeRO slicing) and writes them with
torch.distributed.checkpoint (DCP) under flat keys ``model/<name>``,
``optimizer/<name>/<state>``, plus ``version`` and ``plan`` (the JSON of the plan that wrote it).
DCP de-duplicates the replicated entries across ranks, so each tensor is written once and the
writes are spread over the ranks; the folder is DCP's standard format (``.metadata`` plus
``*.distcp`` files), readable with DCP's own tools (``dcp_to_torch_save``).

**Atomic.** ``path`` is a symbolic link to a hidden folder ``.<name>.<id>`` beside it. A save
writes a new folder, fsyncs it (``sync_files``), then rank 0 points a fresh link at it and renames
that link over ``path`` (``os.replace``, atomic on POSIX) before deleting the previous folder: a
crash at any moment leaves ``path`` naming a whole checkpoint.

``load_checkpoint(pm, optimizer, path)`` reads the full tensors on every rank (shapes from DCP's
metadata) and keeps this rank's slices, whatever plan, mesh, ZeRO stage or world size wrote it.

Every rank gathering full tensors bounds the model by one host's memory; writing each rank's own
shards as DCP chunks (no gather) is the step past that.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from planner.layout import Layout
from runtime.collectives import CommRecorder, all_gather, relayout
from runtime.module import ParallelModule
from runtime.precision import find_master_weights

CHECKPOINT_VERSION = 2


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_state(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """DCP-save ``state`` (flat keys) into a new folder, then swap the link ``path`` to it.

    Every rank of the default process group calls it (or one process, with none initialised)."""
    target = Path(path)
    if target.exists() and not target.is_symlink():
        raise ValueError(f"{target} exists and is not a checkpoint link written by save_checkpoint; choose another path or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    distributed = dist.is_available() and dist.is_initialized()
    box: list[Any] = [f".{target.name}.{uuid.uuid4().hex[:12]}"]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    name: str = box[0]
    folder = target.parent / name
    leader = not distributed or dist.get_rank() == 0
    try:
        with warnings.catch_warnings():  # DCP warns that one process saves alone even when told so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=not distributed)
    except BaseException:
        if leader:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if distributed:
        dist.barrier()
    if leader:
        old = os.readlink(target) if target.is_symlink() else None
        link = target.parent / f"{name}.link"
        os.symlink(name, link)
        os.replace(link, target)
        _fsync_dir(target.parent)
        if old is not None and old != name:
            shutil.rmtree(target.parent / old, ignore_errors=True)
    if distributed:
        dist.barrier()


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every entry of a checkpoint written by ``write_state``, full tensors (no collectives)."""
    folder = Path(path).resolve()
    if not (folder / ".metadata").exists():
        raise ValueError(f"{path} is not a checkpoint (no DCP .metadata in {folder})")
    metadata = dcp.FileSystemReader(folder).read_metadata()
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, dcp.metadata.TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[key] = None
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return state


def checkpoint_metadata(path: str | os.PathLike[str]) -> tuple[Path, Any]:
    """(the folder behind ``path``, DCP's metadata of it)."""
    folder = Path(path).resolve()
    if not (folder / ".metadata").exists():
        raise ValueError(f"{path} is not a checkpoint (no DCP .metadata in {folder})")
    return folder, dcp.FileSystemReader(folder).read_metadata()


class _BoxLoadPlanner(dcp.DefaultLoadPlanner):
    """Reads, for each key, only a box of the stored tensor: the overlap of the box with each chunk
    the writers stored (DCP's own resharding reads), into a tensor shaped like the box."""

    def __init__(self, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for key, (offsets, sizes) in self.boxes.items():
            md = self.metadata.state_dict_metadata[key]  # type: ignore[union-attr]
            assert isinstance(md, dcp.metadata.TensorStorageMetadata)
            requests += create_read_items_for_chunk_list(key, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # type: ignore[no-any-return]  # the box itself (DCP's lookup wants a whole tensor at offset 0)


def read_boxes(folder: Path, metadata: Any, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Each key's box of the checkpoint in ``folder``, reading only the bytes of the box (every rank
    alone: no collectives)."""
    state: dict[str, Any] = {}
    for key, (_, sizes) in boxes.items():
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, dcp.metadata.TensorStorageMetadata):
            raise ValueError(f"checkpoint {folder} has no tensor {key!r}")
        state[key] = torch.empty(sizes, dtype=md.properties.dtype)
    if state:
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=_BoxLoadPlanner(boxes), no_dist=True)
    return state


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under the ZeRO and master-weight wrappers."""
    while hasattr(optimizer, "inner"):
        optimizer = optimizer.inner
    return optimizer  # type: ignore[no-any-return]


def _state_key(pm: ParallelModule, optimizer: Any, attr: str) -> torch.nn.Parameter:
    """The tensor the torch optimizer keys ``attr``'s state by: the parameter, its ZeRO slice, or
    the master copy of either."""
    key = pm.zero.shards[attr] if pm.zero is not None and attr in pm.zero.shards else pm.graph_module.get_parameter(attr)
    masters = find_master_weights(optimizer)
    return masters.master_of(key) if masters is not None else key


def _full(pm: ParallelModule, attr: str, t: torch.Tensor) -> torch.Tensor:
    """A state tensor shaped like this rank's slice of ``attr``, gathered to the full shape."""
    if pm.zero is not None and attr in pm.zero.shards:
        t = all_gather(t.detach(), pm.zero.axes[attr], pm.zero.dims[attr], pm.mesh_groups, CommRecorder(), "step")
    return pm.gather(attr, t)


def _local(pm: ParallelModule, attr: str, full: torch.Tensor, *, zero_slice: bool) -> torch.Tensor:
    """This rank's part of a full tensor shaped like ``attr``: its tensor-parallel shard, and for
    optimizer states under ZeRO-1/2 (``zero_slice``) its data-parallel slice of that."""
    layout = pm.param_specs[attr].layout
    local = relayout(full, Layout.replicated(layout.ndim), layout, pm.mesh_groups)
    if zero_slice and pm.zero is not None and attr in pm.zero.shards:
        local = pm.zero.slice_of(local, attr).clone()
    return local


def full_optimizer_state(pm: ParallelModule, optimizer: Any) -> dict[str, dict[str, Any]]:
    """Every parameter's optimizer state at full shape, keyed by its first name (all ranks call)."""
    state = _inner(optimizer).state
    with_master = find_master_weights(optimizer) is not None
    out: dict[str, dict[str, Any]] = {}
    for attr in pm.param_specs:
        key = _state_key(pm, optimizer, attr)
        entry = dict(state.get(key, {}))
        if with_master:
            entry["master"] = key.detach()  # mixed precision: the master weights are optimizer state
        out[pm.param_names[attr][0]] = {
            k: (_full(pm, attr, v) if v.dim() > 0 else v.clone()) if isinstance(v, torch.Tensor) else v for k, v in sorted(entry.items())
        }
    return out


def save_checkpoint(pm: ParallelModule, optimizer: Any, path: str | os.PathLike[str]) -> None:
    """Gather and write (DCP, atomically) a checkpoint every plan can load. Every rank calls it."""
    state: dict[str, Any] = {"version": CHECKPOINT_VERSION, "plan": pm.plan.model_dump_json()}
    state |= {f"model/{name}": t for name, t in pm.full_state_dict().items()}
    for name, entry in full_optimizer_state(pm, optimizer).items():
        state |= {f"optimizer/{name}/{k}": v for k, v in entry.items()}
    write_state(state, path)


def load_checkpoint(pm: ParallelModule, optimizer: Any, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint written under any plan into this rank's parameters and optimizer state."""
    data = read_state(path)
    if data.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path} has version {data.get('version')}; this runtime reads version {CHECKPOINT_VERSION}")
    saved_states: dict[str, dict[str, Any]] = {}
    for entry, value in data.items():
        if entry.startswith("optimizer/"):
            name, _, k = entry[len("optimizer/"):].rpartition("/")
            saved_states.setdefault(name, {})[k] = value
    state = _inner(optimizer).state
    with_master = find_master_weights(optimizer) is not None
    with torch.no_grad():
        for attr, p in pm.local_parameters().items():
            names = pm.param_names[attr]
            missing = [n for n in names if f"model/{n}" not in data]
            if missing:
                raise ValueError(f"checkpoint {path} has no parameter {missing[0]!r}; it was saved from another model")
            p.copy_(_local(pm, attr, data[f"model/{names[0]}"], zero_slice=False).to(p.dtype))
            saved = dict(saved_states.get(names[0], {}))
            key = _state_key(pm, optimizer, attr)
            master = saved.pop("master", None)
            if with_master:  # saved without master weights: start them from the parameters
                source = master if master is not None else data[f"model/{names[0]}"]
                key.copy_(_local(pm, attr, source, zero_slice=True).to(key.dtype))
            if saved:
                state[key] = {
                    k: _local(pm, attr, v, zero_slice=True).to(key.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in sorted(saved.items())
                }
