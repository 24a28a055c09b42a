"""Checkpoints that move between plans, written and read shard by shard, under the model's own names.

``save_checkpoint(pm, optimizer, path, step=, extra=)``: every rank writes only the boxes of the
full tensors it holds (:func:`runtime.weights.local_box`: its tensor-parallel or ZeRO-3 shard of
each parameter, its ZeRO-1/2 slice of each optimizer state), as torch.distributed.checkpoint
(DCP) chunks of the full tensor, under flat keys ``model/<name>`` (each name of a tied weight) and
``optimizer/<first name>/<state>``, plus ``version``, ``plan`` (the JSON of the plan that wrote
it) and ``progress`` (the training step and whatever the caller passes, e.g. its data loader's
position). A box several ranks hold (replicas over data parallelism) is one chunk, written by one
of them (DCP's de-duplication). No rank gathers anything: a rank's memory while saving is its
own state plus DCP's buffer for the chunk it writes. The folder is DCP's standard format
(``.metadata`` plus ``*.distcp`` files), readable with DCP's own tools (``dcp_to_torch_save``).

**Atomic.** ``path`` is a symbolic link to a hidden folder ``.<name>.<id>`` beside it. A save
writes a new folder, fsyncs it (``sync_files``), then rank 0 points a fresh link at it and renames
that link over ``path`` (``os.replace``, atomic on POSIX) before deleting the previous folder: a
crash at any moment leaves ``path`` naming a whole checkpoint.

``load_checkpoint(pm, optimizer, path)`` reads, on every rank alone, only the boxes that rank
holds under its own plan (DCP's resharding reads: each box's overlap with each stored chunk),
whatever plan, mesh, ZeRO stage or world size wrote it, and returns the saved progress.
Checkpoints of version 2 (full tensors, before this) load the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from runtime.collectives import CommRecorder, all_gather
from runtime.module import ParallelModule
from runtime.precision import find_master_weights
from runtime.weights import Box, full_shape, local_box, pick_name, zero_box

CHECKPOINT_VERSION = 3
READABLE_VERSIONS = (2, 3)  # 2: every tensor written whole (a single chunk), read the same way


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_state(state: dict[str, Any], path: str | os.PathLike[str], boxes: dict[str, Box] | None = None) -> None:
    """DCP-save ``state`` (flat keys) into a new folder, then swap the link ``path`` to it.
    ``boxes``: keys whose value is one box of a larger tensor, (its offsets, the full shape).

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
            dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), planner=_BoxSavePlanner(boxes or {}), no_dist=not distributed)
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


class _BoxSavePlanner(dcp.DefaultSavePlanner):
    """Writes each boxed key as one chunk of its full tensor (DCP then de-duplicates a chunk several
    ranks hold, and records every chunk in the metadata of the full tensor), the rest as usual."""

    def __init__(self, boxes: dict[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        rest = {k: v for k, v in self.state_dict.items() if k not in self.boxes}
        items = list(create_default_local_save_plan(rest, self.is_coordinator).items)
        for key, (offsets, size) in self.boxes.items():
            local = self.state_dict[key]
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), local.size()),
                                            properties=TensorProperties.create_from_tensor(local), size=torch.Size(size)),
            ))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.boxes:
            return self.state_dict[index.fqn]  # the box itself (DCP's lookup wants a whole tensor at offset 0)
        return super().lookup_object(index)


class _BoxLoadPlanner(dcp.DefaultLoadPlanner):
    """Reads, for each key, only a box of the stored tensor: the overlap of the box with each chunk
    the writers stored (DCP's own resharding reads), into a tensor shaped like the box."""

    def __init__(self, boxes: dict[str, Box]) -> None:
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


def read_boxes(folder: Path, metadata: Any, boxes: dict[str, Box],
               into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each key's box of the checkpoint in ``folder``, reading only the stored chunks it overlaps
    (every rank alone: no collectives), into ``into[key]`` where given (cast to its dtype; a
    parameter loads in place), else into a new tensor of the stored dtype."""
    state: dict[str, Any] = {}
    for key, (_, sizes) in boxes.items():
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, dcp.metadata.TensorStorageMetadata):
            raise ValueError(f"checkpoint {folder} has no tensor {key!r}")
        dest = (into or {}).get(key)
        state[key] = dest if dest is not None else torch.empty(sizes, dtype=md.properties.dtype)
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


def _boxes(pm: ParallelModule, attr: str) -> tuple[Box, Box, tuple[int, ...]]:
    """(the box of ``attr`` this rank holds, the box of its optimizer states, the full shape)."""
    layout = pm.param_specs[attr].layout
    full = full_shape(layout, tuple(pm.graph_module.get_parameter(attr).shape), pm.mesh_groups)
    box = local_box(layout, full, pm.mesh_groups)
    sliced = zero_box(box, pm.zero.axes[attr], pm.mesh_groups) if pm.zero is not None and attr in pm.zero.shards else box
    return box, sliced, full


def save_checkpoint(pm: ParallelModule, optimizer: Any, path: str | os.PathLike[str], *, step: int | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    """Write (DCP, atomically) this rank's shards of the parameters and optimizer states: a
    checkpoint every plan can load (module docstring). ``step`` and ``extra`` (JSON values: a data
    loader's position, say) come back from :func:`load_checkpoint`. Every rank calls it."""
    progress = json.dumps({"step": step, "extra": extra or {}})  # raises on what JSON cannot hold, before anything is written
    state: dict[str, Any] = {"version": CHECKPOINT_VERSION, "plan": pm.plan.model_dump_json(), "progress": progress}
    boxes: dict[str, Box] = {}
    states = _inner(optimizer).state
    with_master = find_master_weights(optimizer) is not None
    for attr, p in pm.local_parameters().items():
        names = pm.param_names[attr]
        box, sliced, full = _boxes(pm, attr)
        for name in names:  # each name the model has for it
            state[f"model/{name}"] = p.detach()
            boxes[f"model/{name}"] = (box[0], full)
        key = _state_key(pm, optimizer, attr)
        entry = dict(states.get(key, {}))
        if with_master:
            entry["master"] = key.detach()  # mixed precision: the master weights are optimizer state
        for k, v in entry.items():
            state[f"optimizer/{names[0]}/{k}"] = v
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                boxes[f"optimizer/{names[0]}/{k}"] = (sliced[0], full)
    write_state(state, path, boxes)


def load_checkpoint(pm: ParallelModule, optimizer: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read this rank's boxes of a checkpoint written under any plan into its parameters and
    optimizer state; returns the saved progress, ``{"step": ..., "extra": {...}}``."""
    folder, metadata = checkpoint_metadata(path)
    header = _read_objects(folder, [k for k in ("version", "progress") if k in metadata.state_dict_metadata])
    if header.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"checkpoint {path} has version {header.get('version')}; this runtime reads versions {READABLE_VERSIONS}")
    stored = metadata.state_dict_metadata
    saved_states: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith("optimizer/"):
            name, _, k = key[len("optimizer/"):].rpartition("/")
            saved_states.setdefault(name, []).append(k)
    boxes: dict[str, Box] = {}
    plans: list[tuple[str, str, str]] = []  # (attribute, the name it was saved under, its model key)
    for attr in pm.param_specs:
        names = pm.param_names[attr]
        name = pick_name(names, {key[len("model/"):] for key in stored if key.startswith("model/")})
        if name is None:
            raise ValueError(f"checkpoint {path} has no parameter {names[0]!r}; it was saved from another model")
        box, sliced, full = _boxes(pm, attr)
        if tuple(stored[f"model/{name}"].size) != full:  # type: ignore[union-attr]
            raise ValueError(f"checkpoint {path} holds {name} as {list(stored[f'model/{name}'].size)}, the model as {list(full)}")  # type: ignore[union-attr]
        boxes[f"model/{name}"] = (box[0], box[1])
        owner = name if name in saved_states else names[0]
        for k in saved_states.get(owner, []):
            md = stored[f"optimizer/{owner}/{k}"]
            if isinstance(md, dcp.metadata.TensorStorageMetadata):
                boxes[f"optimizer/{owner}/{k}"] = (sliced[0], sliced[1]) if len(md.size) else ((), ())
        plans.append((attr, owner, f"model/{name}"))
    scalars = [key for key in stored if key.startswith("optimizer/") and not isinstance(stored[key], dcp.metadata.TensorStorageMetadata)]
    with_master = find_master_weights(optimizer) is not None
    into: dict[str, torch.Tensor] = {}  # straight into the parameters (and master weights): no second copy of them
    for attr, owner, model_key in plans:
        into[model_key] = pm.graph_module.get_parameter(attr).detach()
        if with_master and f"optimizer/{owner}/master" in boxes:
            into[f"optimizer/{owner}/master"] = _state_key(pm, optimizer, attr).detach()
    state = _inner(optimizer).state
    with torch.no_grad():
        data = read_boxes(folder, metadata, boxes, into) | _read_objects(folder, scalars)
        for attr, owner, model_key in plans:
            saved = {k: data[f"optimizer/{owner}/{k}"] for k in saved_states.get(owner, [])}
            key = _state_key(pm, optimizer, attr)
            master = saved.pop("master", None)
            if with_master and master is None:  # saved without master weights: start them from the parameters
                key.copy_(_zero_slice(pm, attr, data[model_key]).to(key.dtype))
            if saved:
                state[key] = {k: v.to(key.device) if isinstance(v, torch.Tensor) else v for k, v in sorted(saved.items())}
    progress = json.loads(header["progress"]) if "progress" in header else {"step": None, "extra": {}}
    return progress  # type: ignore[no-any-return]


def _zero_slice(pm: ParallelModule, attr: str, local: torch.Tensor) -> torch.Tensor:
    """ZeRO-1/2's slice of a tensor shaped like this rank's part of ``attr`` (itself without ZeRO)."""
    return pm.zero.slice_of(local, attr) if pm.zero is not None and attr in pm.zero.shards else local


def _read_objects(folder: Path, keys: list[str]) -> dict[str, Any]:
    """The non-tensor entries ``keys`` (and any scalar tensors among them) of a checkpoint, whole."""
    if not keys:
        return {}
    state: dict[str, Any] = dict.fromkeys(keys)
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return state
