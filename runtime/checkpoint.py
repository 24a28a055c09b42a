"""Checkpoints that move between plans, written and read shard by shard, under the model's own names.

``save_checkpoint(pm, optimizer, path, step=, extra=)``: every rank writes only the boxes of the
full tensors it holds (:func:`runtime.weights.local_box`: its tensor-parallel or ZeRO-3 shard of
each parameter, its ZeRO-1/2 slice of each optimizer state), as torch.distributed.checkpoint
(DCP) chunks of the full tensor, under flat keys ``model/<name>`` (each name of a tied weight) and
``optimizer/<first name>/<state>``. A box several ranks hold (replicas over data parallelism) is
one chunk, written by one of them (DCP's de-duplication). No rank gathers anything: a rank's
memory while saving is its own state plus DCP's buffer for the chunk it writes.

**Files are data.** Rank 0 then writes ``manifest.json``: the format version, the plan that
wrote it, the progress (step and the caller's ``extra``), every other non-tensor value (JSON), and
for every tensor its dtype, full shape and chunks, each chunk's file, byte range, and every file's
size. Loading reads only the manifest (checked: known version, plain file names inside the
folder, sizes on disk equal to the recorded ones, chunks inside their tensor and file) and hands
DCP the metadata built from it: DCP's own ``.metadata`` is a pickle and is never opened on load.
The tensor payloads are DCP's ``torch.save`` records, read with ``torch.load(weights_only=True)``,
torch's restricted unpickler that builds tensors and plain containers only. So the trust boundary
is: a checkpoint from anyone can at worst fail to load (:class:`CheckpointError`), never run code.
Checkpoints of versions 2 and 3 (before the manifest) hold their metadata and header only as
pickles: they load with ``trust_pickle=True``, for files you wrote yourself; save again to convert.
The folder stays DCP's standard format (``.metadata`` plus ``*.distcp``), readable with DCP's
tools (``dcp_to_torch_save``).

**Atomic.** ``path`` is a symbolic link to a hidden folder ``.<name>.<id>`` beside it. A save
writes a new folder and its manifest, fsyncs them (``sync_files``), then rank 0 points a fresh
link at it and renames that link over ``path`` (``os.replace``, atomic on POSIX) before deleting
the previous folder: a crash at any moment leaves ``path`` naming a whole checkpoint. The folders a
crash left half-written are deleted by the next save to the same path.

``load_checkpoint(pm, optimizer, path)`` reads, on every rank alone, only the boxes that rank
holds under its own plan (DCP's resharding reads: each box's overlap with each stored chunk),
whatever plan, mesh, ZeRO stage or world size wrote it, and returns the saved progress. A
checkpoint of another model is refused with the first name or shape that differs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from planner.runtime.collectives import CommRecorder, all_gather
from planner.runtime.module import ParallelModule
from planner.runtime.precision import find_master_weights
from planner.runtime.weights import Box, full_shape, local_box, pick_name, zero_box

CHECKPOINT_VERSION = 4  # 4: manifest.json; 3: DCP chunks with a pickled header; 2: every tensor whole
PICKLED_VERSIONS = (2, 3)  # read only with trust_pickle=True
MANIFEST = "manifest.json"
_FOLDER = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}(\.link)?")
_FILE = re.compile(r"[A-Za-z0-9_.-]+\.distcp")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here: missing, truncated, tampered with, written by a
    newer runtime, or for another model. The message names the file or the first difference."""


class _Chunk(BaseModel):
    """One stored box of a tensor and where its bytes are."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


class _Tensor(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[_Chunk, ...]


class Manifest(BaseModel):
    """``manifest.json``: everything a load needs, as data."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")  # a diverged run's NaN loss survives
    format: Literal["planner-checkpoint"] = "planner-checkpoint"
    version: int
    objects: dict[str, JsonValue]  # the non-tensor entries (plan, progress, optimizer scalars that are not tensors)
    tensors: dict[str, _Tensor]
    files: dict[str, int]  # file name -> its size in bytes


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(target: Path, keep: set[str]) -> None:
    """Delete the hidden folders (and links) of saves to ``target`` that a crash left behind."""
    for entry in target.parent.iterdir():
        match = _FOLDER.fullmatch(entry.name)
        if match is None or match["name"] != target.name or entry.name in keep:
            continue
        if entry.is_symlink() or entry.is_file():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _json_objects(objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` as JSON holds them (dict keys become strings, tuples lists), or a TypeError
    naming the first entry JSON cannot hold."""
    out = {}
    for key, value in objects.items():
        try:
            out[key] = json.loads(json.dumps(value, allow_nan=True))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"checkpoint entry {key!r} is a {type(value).__name__}, which a checkpoint cannot hold: "
                            f"store tensors or JSON values (numbers, strings, lists, dicts, None) ({exc})") from None
    return out


def _manifest(folder: Path, metadata: Metadata, objects: dict[str, Any]) -> Manifest:
    """The manifest of the folder DCP just wrote, from the metadata DCP returned."""
    where = {(index.fqn, tuple(index.offset or ())): info for index, info in metadata.storage_data.items()}
    tensors = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise AssertionError(f"{key}: only tensors are written through DCP")
        chunks = []
        for c in md.chunks:
            info = where[(key, tuple(c.offsets))]
            if info.transform_descriptors:
                raise AssertionError(f"{key}: DCP transformed the chunk ({info.transform_descriptors}); the manifest cannot describe it")
            chunks.append(_Chunk(offsets=tuple(c.offsets), sizes=tuple(c.sizes), file=info.relative_path, start=info.offset, length=info.length))
        tensors[key] = _Tensor(dtype=str(md.properties.dtype).removeprefix("torch."), size=tuple(md.size), chunks=tuple(chunks))
    files = {c.file for t in tensors.values() for c in t.chunks}
    return Manifest(version=CHECKPOINT_VERSION, objects=objects, tensors=tensors, files={f: (folder / f).stat().st_size for f in sorted(files)})


def write_state(state: dict[str, Any], path: str | os.PathLike[str], boxes: dict[str, Box] | None = None) -> None:
    """Save ``state`` (flat keys: tensors through DCP, every other value as JSON in the manifest)
    into a new folder, then swap the link ``path`` to it. ``boxes``: keys whose value is one box of
    a larger tensor, (its offsets, the full shape).

    Every rank of the default process group calls it (or one process, with none initialised)."""
    target = Path(path)
    if target.exists() and not target.is_symlink():
        raise ValueError(f"{target} exists and is not a checkpoint link written by save_checkpoint; choose another path or remove it")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    objects = _json_objects({k: v for k, v in state.items() if not isinstance(v, torch.Tensor)})
    target.parent.mkdir(parents=True, exist_ok=True)
    distributed = dist.is_available() and dist.is_initialized()
    box: list[Any] = [f".{target.name}.{uuid.uuid4().hex[:12]}"]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    name: str = box[0]
    folder = target.parent / name
    leader = not distributed or dist.get_rank() == 0
    old = os.readlink(target) if target.is_symlink() else None
    if leader:
        _remove_stale(target, {name} | ({old} if old else set()))
    try:
        with warnings.catch_warnings():  # DCP warns that one process saves alone even when told so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            metadata = dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), planner=_BoxSavePlanner(boxes or {}),
                                no_dist=not distributed)
        if leader:
            manifest = folder / MANIFEST
            with open(manifest, "w") as f:
                f.write(_manifest(folder, metadata, objects).model_dump_json())
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(folder)
    except BaseException as exc:
        if leader:
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, CheckpointException):
            raise CheckpointError(f"saving {target} failed, the previous checkpoint is kept: {_first_failure(exc)}") from exc
        raise
    if distributed:
        dist.barrier()
    if leader:
        link = target.parent / f"{name}.link"
        os.symlink(name, link)
        os.replace(link, target)
        _fsync_dir(target.parent)
        if old is not None and old != name:
            shutil.rmtree(target.parent / old, ignore_errors=True)
    if distributed:
        dist.barrier()


def _first_failure(exc: CheckpointException) -> str:
    failures = getattr(exc, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        return f"rank {rank}: {type(failure).__name__}: {failure}"
    return str(exc)


class Stored:
    """A checkpoint folder opened for reading: its manifest's objects and DCP metadata built from
    the manifest (module docstring), or, for versions 2-3 with ``trust_pickle``, from DCP's pickle."""

    def __init__(self, path: str | os.PathLike[str], *, trust_pickle: bool = False) -> None:
        self.path = path
        self.folder = Path(path).resolve()
        if not self.folder.is_dir():
            raise CheckpointError(f"no checkpoint at {path}" + (" (a link to a folder that is gone)" if Path(path).is_symlink() else ""))
        manifest = self.folder / MANIFEST
        if manifest.exists():
            self.objects, self.metadata = _from_manifest(self.folder, manifest)
        elif (self.folder / ".metadata").exists():
            if not trust_pickle:
                raise CheckpointError(f"{path} is a checkpoint without {MANIFEST} (version 2-3, or not written by this runtime): its metadata "
                                      "is a pickle, which can run code when read; if you wrote it yourself, load it with trust_pickle=True "
                                      "and save it again to convert it")
            self.metadata = dcp.FileSystemReader(self.folder).read_metadata()
            self.objects = _read_pickled_objects(self.folder, self.metadata)
            if self.objects.get("version", 2) not in PICKLED_VERSIONS:
                raise CheckpointError(f"checkpoint {path} has version {self.objects.get('version')}; this runtime reads 2-{CHECKPOINT_VERSION}")
        else:
            raise CheckpointError(f"{path} is not a checkpoint (no {MANIFEST} in {self.folder}): a save that did not finish, or another folder")

    def reader(self) -> dcp.FileSystemReader:
        return _Reader(self.folder, self.metadata)

    def tensor_keys(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(md.size) for k, md in self.metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}

    def load(self, state: dict[str, Any], planner: Any = None) -> None:
        """DCP's load into ``state`` (this process alone), errors as :class:`CheckpointError`."""
        try:
            with warnings.catch_warnings():  # DCP warns that one process loads alone even when told so
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, storage_reader=self.reader(), planner=planner, no_dist=True)
        except CheckpointException as exc:
            raise CheckpointError(f"checkpoint {self.path} could not be read: {_first_failure(exc)}") from exc
        except (RuntimeError, OSError, EOFError, AssertionError) as exc:
            raise CheckpointError(f"checkpoint {self.path} could not be read: {type(exc).__name__}: {exc}") from exc


class _Reader(dcp.FileSystemReader):
    """DCP's file reader with the metadata given, not unpickled from ``.metadata``."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._given = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._given


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return dtype


def _from_manifest(folder: Path, file: Path) -> tuple[dict[str, Any], Metadata]:
    """The objects and DCP metadata of a manifest, after checking it against the folder."""
    try:
        manifest = Manifest.model_validate_json(file.read_bytes())
    except (ValidationError, ValueError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else {"loc": (), "msg": str(exc)}
        raise CheckpointError(f"{file} is not a valid manifest: {'.'.join(map(str, first['loc'])) or 'the file'}: {first['msg']}") from None
    if manifest.version > CHECKPOINT_VERSION:
        raise CheckpointError(f"{file}: checkpoint version {manifest.version} is newer than this runtime's {CHECKPOINT_VERSION}; upgrade planner")
    for name, size in manifest.files.items():
        if _FILE.fullmatch(name) is None:
            raise CheckpointError(f"{file}: file name {name!r} is not a plain .distcp name inside the folder")
        on_disk = (folder / name).stat().st_size if (folder / name).is_file() else None
        if on_disk != size:
            state = "missing" if on_disk is None else f"{on_disk} bytes"
            raise CheckpointError(f"checkpoint {folder}: {name} is {state}, the manifest says {size} bytes (truncated or partial); "
                                  "load an earlier checkpoint")
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for key, t in manifest.tensors.items():
        where = f"{file}: {key}"
        chunks = []
        for c in t.chunks:
            if len(c.offsets) != len(t.size) or len(c.sizes) != len(t.size) or any(
                    o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, t.size)):
                raise CheckpointError(f"{where}: chunk at {list(c.offsets)} of shape {list(c.sizes)} is outside the tensor's {list(t.size)}")
            if c.file not in manifest.files or c.start < 0 or c.length < 0 or c.start + c.length > manifest.files[c.file]:
                raise CheckpointError(f"{where}: chunk bytes {c.start}+{c.length} are outside {c.file}")
            chunks.append(ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)))
            storage[MetadataIndex(key, torch.Size(c.offsets))] = _StorageInfo(c.file, c.start, c.length)
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=_dtype(t.dtype, where)), torch.Size(t.size), chunks)
    return dict(manifest.objects), Metadata(entries, storage_data=storage, storage_meta=StorageMeta())


def _read_pickled_objects(folder: Path, metadata: Metadata) -> dict[str, Any]:
    """The non-tensor entries (and scalar tensors) of a version 2-3 checkpoint (pickles; trusted)."""
    keys = [k for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)]
    if not keys:
        return {}
    state: dict[str, Any] = dict.fromkeys(keys)
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    if isinstance(state.get("progress"), str):
        state["progress"] = json.loads(state["progress"])
    return state


def read_state(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> dict[str, Any]:
    """Every entry of a checkpoint written by ``write_state``, full tensors (no collectives)."""
    stored = Stored(path, trust_pickle=trust_pickle)
    state: dict[str, Any] = {key: torch.empty(size, dtype=stored.metadata.state_dict_metadata[key].properties.dtype)  # type: ignore[union-attr]
                             for key, size in stored.tensor_keys().items()}
    stored.load(state)
    return {k: v for k, v in stored.objects.items() if k not in state} | state


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


def read_boxes(stored: Stored, boxes: dict[str, Box], into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each key's box of the checkpoint, reading only the stored chunks it overlaps (every rank
    alone: no collectives), into ``into[key]`` where given (cast to its dtype; a parameter loads
    in place), else into a new tensor of the stored dtype."""
    state: dict[str, Any] = {}
    for key, (_, sizes) in boxes.items():
        md = stored.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {stored.path} has no tensor {key!r}")
        dest = (into or {}).get(key)
        state[key] = dest if dest is not None else torch.empty(sizes, dtype=md.properties.dtype)
    if state:
        stored.load(state, _BoxLoadPlanner(boxes))
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
    state: dict[str, Any] = {"plan": pm.plan.model_dump_json(), "progress": {"step": step, "extra": extra or {}}}  # write_state checks it is JSON first
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


def _check_same_model(pm: ParallelModule, stored: Stored, strict: bool) -> dict[str, str]:
    """Each parameter's name in the checkpoint; refuses another model at its first difference."""
    held = {key[len("model/"):]: size for key, size in stored.tensor_keys().items() if key.startswith("model/")}
    chosen: dict[str, str] = {}
    for attr in pm.param_specs:
        names = pm.param_names[attr]
        name = pick_name(names, set(held))
        if name is None:
            raise CheckpointError(f"checkpoint {stored.path} has no parameter {names[0]!r}: it was saved from another model")
        full = _boxes(pm, attr)[2]
        if held[name] != full:
            raise CheckpointError(f"checkpoint {stored.path} holds {name} as {list(held[name])}, the model as {list(full)}: "
                                  "it was saved from another model (or another configuration of it)")
        chosen[attr] = name
    if strict:
        known = {n for attr in pm.param_specs for n in pm.param_names[attr]}
        unknown = sorted(set(held) - known)
        if unknown:
            raise CheckpointError(f"checkpoint {stored.path} holds {len(unknown)} parameter(s) the model does not have, first {unknown[0]!r}: "
                                  "it was saved from another model (more layers?); load_checkpoint(..., strict=False) loads the rest")
    return chosen


def load_checkpoint(pm: ParallelModule, optimizer: Any, path: str | os.PathLike[str], *, strict: bool = True,
                    trust_pickle: bool = False) -> dict[str, Any]:
    """Read this rank's boxes of a checkpoint written under any plan into its parameters and
    optimizer state; returns the saved progress, ``{"step": ..., "extra": {...}}``.

    ``strict``: refuse a checkpoint holding parameters the model lacks (another model); a
    parameter of the model the checkpoint lacks, or of another shape, is always refused.
    ``trust_pickle``: read a version 2-3 checkpoint, whose metadata is a pickle (only your own)."""
    stored = Stored(path, trust_pickle=trust_pickle)
    chosen = _check_same_model(pm, stored, strict)
    tensors = stored.metadata.state_dict_metadata
    saved_states: dict[str, list[str]] = {}
    for entry in list(tensors) + list(stored.objects):
        if entry.startswith("optimizer/"):
            name, _, k = entry[len("optimizer/"):].rpartition("/")
            saved_states.setdefault(name, []).append(k)
    boxes: dict[str, Box] = {}
    plans: list[tuple[str, str, str]] = []  # (attribute, the name its states were saved under, its model key)
    for attr, name in chosen.items():
        box, sliced, _ = _boxes(pm, attr)
        boxes[f"model/{name}"] = (box[0], box[1])
        owner = name if name in saved_states else pm.param_names[attr][0]
        for k in saved_states.get(owner, []):
            md = tensors.get(f"optimizer/{owner}/{k}")
            if isinstance(md, TensorStorageMetadata):
                boxes[f"optimizer/{owner}/{k}"] = (sliced[0], sliced[1]) if len(md.size) else ((), ())
        plans.append((attr, owner, f"model/{name}"))
    with_master = find_master_weights(optimizer) is not None
    into: dict[str, torch.Tensor] = {}  # straight into the parameters (and master weights): no second copy of them
    for attr, owner, model_key in plans:
        into[model_key] = pm.graph_module.get_parameter(attr).detach()
        if with_master and f"optimizer/{owner}/master" in boxes:
            into[f"optimizer/{owner}/master"] = _state_key(pm, optimizer, attr).detach()
    state = _inner(optimizer).state
    with torch.no_grad():
        data = stored.objects | read_boxes(stored, boxes, into)
        for attr, owner, model_key in plans:
            saved = {k: data[f"optimizer/{owner}/{k}"] for k in saved_states.get(owner, [])}
            key = _state_key(pm, optimizer, attr)
            master = saved.pop("master", None)
            if with_master and master is None:  # saved without master weights: start them from the parameters
                key.copy_(_zero_slice(pm, attr, data[model_key]).to(key.dtype))
            if saved:
                state[key] = {k: v.to(key.device) if isinstance(v, torch.Tensor) else v for k, v in sorted(saved.items())}
    progress = stored.objects.get("progress", {"step": None, "extra": {}})
    return progress  # type: ignore[no-any-return]


def _zero_slice(pm: ParallelModule, attr: str, local: torch.Tensor) -> torch.Tensor:
    """ZeRO-1/2's slice of a tensor shaped like this rank's part of ``attr`` (itself without ZeRO)."""
    return pm.zero.slice_of(local, attr) if pm.zero is not None and attr in pm.zero.shards else local
