"""Gradient buckets: the data-parallel gradient all-reduces packed as DDP packs them.

A step's gradient sync is one collective per bucket, not per parameter: the gradients of
consecutive parameters (in the order backward produces them) that are reduced over the same mesh
axes, by the same collectives, and have one dtype are packed, up to ``bucket_bytes`` per bucket
(DDP's default, 25 MiB), and a bucket's collective starts as soon as backward has accumulated all
of its gradients (``runtime.buckets``), while the rest of backward runs. ZeRO-1/2 buckets are a
reduce-scatter of the gradients and, after the optimizer step, an all-gather of the updated
slices (FSDP's flat buffers, one per bucket).

The planner writes the buckets into the plan (:func:`pack`), so the runtime issues exactly the
collectives the plan lists. Pricing is per parameter, linear in the ILP's choices: each
parameter's share of its bucket, the bandwidth term of its own bytes and ``bytes / bucket_bytes``
of one bucket's latency (a parameter larger than a bucket is a bucket of its own:
:func:`planner.cost.comm_time`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Gradient:
    """A parameter's gradient as the sync sees it: local bytes, the mesh axes it is summed over,
    its dtype, ``ready``: when backward has it (larger is earlier: the index of the parameter's
    first use in forward, whose backward runs last), and the (kind, phase) of the collectives that
    sync it."""

    param: str
    nbytes: int
    axes: tuple[str, ...]
    dtype: str
    ready: int
    collectives: tuple[tuple[str, str], ...] = (("all_reduce", "step"),)


@dataclass(frozen=True)
class Bucket:
    axes: tuple[str, ...]
    dtype: str
    params: tuple[str, ...]  # in the order their gradients are packed
    nbytes: int
    collectives: tuple[tuple[str, str], ...] = (("all_reduce", "step"),)


def pack(gradients: Iterable[Gradient], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Buckets in the order they fill: gradients taken in the order backward produces them, each
    appended to the open bucket of its (axes, dtype, collectives), which closes when the next gradient would
    take it over ``bucket_bytes`` (a gradient larger than that is a bucket alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    done: list[Bucket] = []
    open_: dict[tuple[tuple[str, ...], str, tuple[tuple[str, str], ...]], list[Gradient]] = {}
    for g in sorted(gradients, key=lambda g: -g.ready):
        key = (g.axes, g.dtype, g.collectives)
        members = open_.setdefault(key, [])
        if members and sum(m.nbytes for m in members) + g.nbytes > bucket_bytes:
            done.append(_bucket(key, members))
            members = open_[key] = []
        members.append(g)
    done.extend(_bucket(key, members) for key, members in open_.items() if members)
    return tuple(done)


def _bucket(key: tuple[tuple[str, ...], str, tuple[tuple[str, str], ...]], members: list[Gradient]) -> Bucket:
    return Bucket(key[0], key[1], tuple(m.param for m in members), sum(m.nbytes for m in members), key[2])


# --------------------------------------------------------------------------- ZeRO-3 parameter units


@dataclass(frozen=True)
class Gather:
    """One ZeRO-3 parameter gather, as the runtime runs it: a parameter converted by one
    all-gather over the data-parallel axes straight from its stored layout, on an edge (``site``
    ``"param->spec"``, shared by every consumer that wants that Spec) or inside a kernel that
    gathers it itself (``"node:position"``). ``block``: the layer instance of its first consumer
    ("" outside the repeated layers); ``nbytes``: the gathered bytes; ``regather``: gathered again
    for backward (the kernel saves the input and frees it); ``reduced``: its gradient is
    reduce-scattered in backward."""

    site: str
    param: str
    block: str
    axes: tuple[str, ...]
    dtype: str
    nbytes: int
    regather: bool = False
    reduced: bool = True


@dataclass(frozen=True)
class Unit:
    """ZeRO-3's unit of communication (FSDP2's per-block flat parameter): the gathers of one
    block, in forward order, run as one all-gather in forward, one reduce-scatter of their
    gradients in backward and one all-gather again in backward for those re-gathered."""

    axes: tuple[str, ...]
    dtype: str
    gathers: tuple[Gather, ...]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gathers)

    @property
    def regather_nbytes(self) -> int:
        return sum(g.nbytes for g in self.gathers if g.regather)

    @property
    def reduce_nbytes(self) -> int:
        return sum(g.nbytes for g in self.gathers if g.reduced)

    def collectives(self) -> tuple[tuple[str, str, int], ...]:
        """(kind, phase, bytes) of each collective the unit runs in a micro-batch."""
        out = [("all_gather", "fwd", self.nbytes)]
        if self.regather_nbytes:
            out.append(("all_gather", "bwd", self.regather_nbytes))
        if self.reduce_nbytes:
            out.append(("reduce_scatter", "bwd", self.reduce_nbytes))
        return tuple(out)


def pack_units(gathers: Iterable[Gather], bucket_bytes: int) -> tuple[Unit, ...]:
    """Units in forward order: runs of consecutive gathers of one block, mesh axes and dtype, a
    run cut where the next gather would take it over ``bucket_bytes`` (a gather larger than that
    is a unit alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    units: list[Unit] = []
    run: list[Gather] = []
    for g in gathers:
        if run and ((g.block, g.axes, g.dtype) != (run[0].block, run[0].axes, run[0].dtype) or sum(m.nbytes for m in run) + g.nbytes > bucket_bytes):
            units.append(Unit(run[0].axes, run[0].dtype, tuple(run)))
            run = []
        run.append(g)
    if run:
        units.append(Unit(run[0].axes, run[0].dtype, tuple(run)))
    return tuple(units)
