"""Checkpoints that move between plans: the full state under the model's own parameter names.

``save_checkpoint(pm, optimizer, path)`` gathers every parameter and every optimizer state to its
full shape (undoing tensor-parallel sharding and ZeRO slicing) and rank 0 writes one file with
``torch.save``: ``{"version", "model": {name: tensor}, "optimizer": {name: {state}}, "plan"}``.
The write goes to a temporary file in the same folder, is flushed to disk, then renamed over the
old one (``os.replace`` is atomic on POSIX): a crash mid-write leaves the previous checkpoint
whole. ``load_checkpoint(pm, optimizer, path)`` reads it on every rank and keeps this rank's
slices, whatever plan, mesh, ZeRO stage or world size wrote it.

Gathering on rank 0 bounds the model by one host's memory; torch.distributed.checkpoint's sharded
writes are the way past that (noted for a later issue).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from planner.layout import Layout
from runtime.collectives import CommRecorder, all_gather, relayout
from runtime.module import ParallelModule

CHECKPOINT_VERSION = 1


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _state_key(pm: ParallelModule, attr: str) -> torch.nn.Parameter:
    if pm.zero is not None and attr in pm.zero.shards:
        return pm.zero.shards[attr]
    return pm.graph_module.get_parameter(attr)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "inner", optimizer)


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
    out: dict[str, dict[str, Any]] = {}
    for attr in pm.param_specs:
        entry = state.get(_state_key(pm, attr), {})
        out[pm.param_names[attr][0]] = {
            k: (_full(pm, attr, v) if v.dim() > 0 else v.clone()) if isinstance(v, torch.Tensor) else v for k, v in sorted(entry.items())
        }
    return out


def save_checkpoint(pm: ParallelModule, optimizer: Any, path: str | os.PathLike[str]) -> None:
    """Gather and write (rank 0) a checkpoint every plan can load. Every rank must call it."""
    import torch.distributed as dist

    model = pm.full_state_dict()
    opt_state = full_optimizer_state(pm, optimizer)
    if pm.mesh_groups.rank == 0:
        atomic_save({"version": CHECKPOINT_VERSION, "model": model, "optimizer": opt_state, "plan": pm.plan.model_dump_json()}, path)
    dist.barrier()


def load_checkpoint(pm: ParallelModule, optimizer: Any, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint written under any plan into this rank's parameters and optimizer state."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if data.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path} has version {data.get('version')}; this runtime reads version {CHECKPOINT_VERSION}")
    state = _inner(optimizer).state
    with torch.no_grad():
        for attr, p in pm.local_parameters().items():
            names = pm.param_names[attr]
            missing = [n for n in names if n not in data["model"]]
            if missing:
                raise ValueError(f"checkpoint {path} has no parameter {missing[0]!r}; it was saved from another model")
            p.copy_(_local(pm, attr, data["model"][names[0]], zero_slice=False).to(p.dtype))
            saved = data["optimizer"].get(names[0])
            if saved:
                key = _state_key(pm, attr)
                state[key] = {
                    k: _local(pm, attr, v, zero_slice=True).to(key.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in saved.items()
                }
