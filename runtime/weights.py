"""Weights in from the files users have, each rank reading only the slices it holds.

Every tensor a rank holds is a box of the full tensor (:func:`local_box`): a layout splits each
dim into equal chunks over its mesh axes, in the order the layout lists them (as
:func:`runtime.collectives.local_slice` cuts them), and ZeRO-1/2 cut the optimizer's slice from
that along one more dim (:func:`zero_box`). A source reads a box without reading the rest:

* Hugging Face ``safetensors``: one file, or a folder of shards with ``model.safetensors.index.json``
  (what ``save_pretrained`` writes), through ``safe_open(...).get_slice`` (a memory map: the
  slice's bytes only);
* this project's checkpoints (:mod:`runtime.checkpoint`, torch.distributed.checkpoint folders),
  through a load planner that asks DCP for the box's overlap with each stored chunk.

Tensors are matched by the model's own fully-qualified names (every name of a tied weight: a file
that stores it once, as ``save_pretrained`` does, serves all of them). :func:`load_weights` fills
a compiled module; ``compile_plan(..., weights=path)`` builds a meta model's shards straight from
the file (nothing of the full model is allocated, and only what the file lacks, such as buffers
the constructor computes, is materialised by replaying the initialisation).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner.layout import Layout, zero_dim
from planner.runtime.groups import MeshGroups

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) per dim, in the full tensor


def local_box(layout: Layout, shape: tuple[int, ...], mg: MeshGroups) -> Box:
    """The box of the full tensor (``shape``) this rank holds in ``layout``: along each dim, the
    chunk its coordinates pick over the dim's axes, row-major in the layout's order of them."""
    offsets, sizes = [], []
    for size, axes in zip(shape, layout.dims, strict=True):
        n = mg.size(axes)
        if size % n:
            raise ValueError(f"dim of size {size} cannot be split {n} ways by layout {layout}")
        index = 0
        for axis in axes:
            index = index * mg.mesh.degree(axis) + mg.coords[axis]
        offsets.append(index * (size // n))
        sizes.append(size // n)
    return tuple(offsets), tuple(sizes)


def zero_box(box: Box, axes: tuple[str, ...], mg: MeshGroups) -> Box:
    """ZeRO-1/2's slice of a local ``box`` over the data-parallel ``axes``: chunk ``mg.index(axes)``
    along the first dim their degree divides (:func:`planner.layout.zero_dim`)."""
    offsets, sizes = list(box[0]), list(box[1])
    n = mg.size(axes)
    d = zero_dim(tuple(sizes), n)
    if d is None:
        return box
    sizes[d] //= n
    offsets[d] += mg.index(axes) * sizes[d]
    return tuple(offsets), tuple(sizes)


def read_box(t: Any, box: Box) -> torch.Tensor:
    """``t[box]`` for anything indexable by slices (a tensor, a safetensors slice)."""
    return t[tuple(slice(o, o + s) for o, s in zip(*box, strict=True))]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- sources


class WeightSource:
    """Named tensors on disk, read a box at a time."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
        """Each named tensor's box, in the dtype it is stored in."""
        raise NotImplementedError


class SafetensorsSource(WeightSource):
    """A ``.safetensors`` file, or a folder with one (``model.safetensors``) or with the shards an
    index names (``model.safetensors.index.json``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self._open = safe_open
        path = Path(path)
        files: list[Path]
        self.file_of: dict[str, Path] = {}
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                self.file_of = {name: path / file for name, file in weight_map.items()}
                files = sorted(set(self.file_of.values()))
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise ValueError(f"{path} holds no .safetensors file and no model.safetensors.index.json")
        else:
            files = [path]
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    self.file_of.setdefault(name, file)
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def names(self) -> set[str]:
        return set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for name in boxes:
            by_file.setdefault(self.file_of[name], []).append(name)
        for file, names in by_file.items():
            with self._open(str(file), framework="pt") as f:
                for name in names:
                    if self.shapes[name] == ():
                        out[name] = f.get_tensor(name)
                    else:
                        out[name] = read_box(f.get_slice(name), boxes[name]).clone()
        return out


class CheckpointSource(WeightSource):
    """The parameters of a checkpoint :mod:`runtime.checkpoint` wrote (keys ``model/<name>``)."""

    def __init__(self, path: str | os.PathLike[str], prefix: str = "model/") -> None:
        from planner.runtime.checkpoint import Stored

        self.stored = Stored(path)
        self.prefix = prefix
        self.shapes = {key[len(prefix):]: size for key, size in self.stored.tensor_keys().items() if key.startswith(prefix)}

    def names(self) -> set[str]:
        return set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
        from planner.runtime.checkpoint import read_boxes

        got = read_boxes(self.stored, {self.prefix + n: b for n, b in boxes.items()})
        return {k[len(self.prefix):]: v for k, v in got.items()}


def open_weights(path: str | os.PathLike[str]) -> WeightSource:
    """The source at ``path``: a project checkpoint (a DCP folder or the link to one) or safetensors."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"no weights at {p}")
    if p.is_dir() and ((p.resolve() / "manifest.json").exists() or (p.resolve() / ".metadata").exists()):
        return CheckpointSource(p)
    if p.is_dir() or p.suffix == ".safetensors":
        return SafetensorsSource(p)
    raise ValueError(f"{p} is neither a checkpoint folder (with manifest.json) nor safetensors (a .safetensors file or a folder of them)")


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_weights` did: the parameters and buffers it loaded (first names), and the
    file's tensors no parameter or buffer of the model took."""

    loaded: tuple[str, ...]
    unexpected: tuple[str, ...]


def pick_name(names: Iterable[str], available: set[str]) -> str | None:
    """The first of a tensor's names (tied weights have several) that the file holds."""
    return next((n for n in names if n in available), None)


@dataclass(frozen=True)
class Wanted:
    """A tensor to read: every name it has (tied weights: several), its full shape, and the layout
    this rank holds it in (None: whole)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    layout: Layout | None


def box_requests(wanted: Iterable[Wanted], source: WeightSource, mg: MeshGroups, where: object) -> tuple[dict[str, tuple[Wanted, Box]], list[Wanted]]:
    """For each tensor ``source`` holds under one of its names: that name -> (it, this rank's box);
    and the tensors it lacks. A shape other than the model's is an error naming both (``where``:
    the weights, for the message)."""
    available = source.names()
    found: dict[str, tuple[Wanted, Box]] = {}
    lacking: list[Wanted] = []
    for w in wanted:
        name = pick_name(w.names, available)
        if name is None:
            lacking.append(w)
            continue
        if source.shape(name) != w.shape:
            raise ValueError(f"{name} is {list(source.shape(name))} in {where}, {list(w.shape)} in the model: the weights are of another model")
        found[name] = (w, local_box(w.layout, w.shape, mg) if w.layout is not None else ((0,) * len(w.shape), w.shape))
    return found, lacking


def full_shape(layout: Layout, local_shape: tuple[int, ...], mg: MeshGroups) -> tuple[int, ...]:
    """The full shape of a tensor this rank holds ``local_shape`` of in ``layout``."""
    return tuple(size * mg.size(axes) for size, axes in zip(local_shape, layout.dims, strict=True))


def load_weights(pm: Any, path: str | os.PathLike[str] | WeightSource, *, strict: bool = True) -> LoadReport:
    """Fill ``pm``'s parameters (this rank's shards) and buffers from the weights at ``path``,
    reading only this rank's boxes. ``strict``: a parameter the file lacks is an error (naming it);
    otherwise it keeps its value. Call it before ``make_optimizer`` (master weights copy the
    parameters there). Every rank calls it; no collectives run."""
    source = path if isinstance(path, WeightSource) else open_weights(path)
    available = source.names()
    targets: dict[tuple[str, ...], torch.Tensor] = {pm.param_names[attr]: p for attr, p in pm.local_parameters().items()}
    params = [Wanted(pm.param_names[attr], full_shape(pm.param_specs[attr].layout, tuple(p.shape), pm.mesh_groups), pm.param_specs[attr].layout)
              for attr, p in pm.local_parameters().items()]
    found, lacking = box_requests(params, source, pm.mesh_groups, path)
    for name, buf in pm.named_original_buffers().items():
        if name in available and source.shape(name) == tuple(buf.shape):
            found[name] = (Wanted((name,), tuple(buf.shape), None), ((0,) * buf.dim(), tuple(buf.shape)))
            targets[(name,)] = buf
    missing = [w.names[0] for w in lacking]
    if missing and strict:
        raise ValueError(f"{path} has no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} of the model's parameters); pass strict=False to keep their values")
    boxes = {name: box for name, (_, box) in found.items()}
    values = source.read(boxes)
    with torch.no_grad():
        for name, (w, _) in found.items():
            t = targets[w.names]
            t.copy_(values[name].to(t.dtype))
    used = {n for attr in pm.param_specs for n in pm.param_names[attr]} | set(pm.named_original_buffers())
    return LoadReport(tuple(sorted(found)), tuple(sorted(available - used)))
