"""The search space: which configurations (mesh, ZeRO stage, CDP mode, micro-batch count,
recomputation) a search considers, and why the ones that cannot run are pruned before any solve.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from planner.config import ALL_TP
from planner.ir import IRGraph
from planner.mesh import Mesh
from planner.plan import Plan
from planner.schemes import recompute as recompute_scheme
from planner.schemes.base import Settings
from planner.schemes.registry import SCHEMES
from planner.schemes.tp import family_meshes


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    devices: int
    tp: tuple[str, ...] = ALL_TP
    zero: tuple[int, ...] = (0,)
    cdp: tuple[str, ...] = ("off",)
    cdp_stages: int = 4
    dp: int | None = None
    micro_batches: tuple[int, ...] = (1,)  # gradient accumulation: micro-batches per step
    recompute: tuple[str, ...] = ("none",)  # activation recomputation of repeated layers (planner.schemes.recompute)

    def __post_init__(self) -> None:
        recompute_scheme.check(self.recompute)
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        unknown = [t for t in self.tp if t not in ALL_TP]
        if unknown:
            raise ValueError(f"unknown tensor-parallel family {unknown}; choose from {', '.join(ALL_TP)}")
        if any(z not in (0, 1, 2, 3) for z in self.zero):
            raise ValueError(f"ZeRO stages are 0-3, got {self.zero}")
        if any(c not in ("off", "v1", "v2") for c in self.cdp):
            raise ValueError(f"CDP modes are off, v1, v2; got {self.cdp}")
        if self.cdp_stages < 1:
            raise ValueError(f"cdp_stages must be >= 1, got {self.cdp_stages}")
        if not self.micro_batches or any(m < 1 for m in self.micro_batches):
            raise ValueError(f"micro-batch counts must be >= 1, got {self.micro_batches}")
        if self.dp is not None and (self.dp < 1 or self.devices % self.dp):
            raise ValueError(f"--dp {self.dp} does not divide the device count {self.devices}")
        for what, values in (("tensor-parallel family", self.tp), ("ZeRO stage", self.zero), ("CDP mode", self.cdp)):
            if not values:
                raise ValueError(f"the search space names no {what}: give at least one (tp: {', '.join(ALL_TP)}; zero: 0-3; cdp: off, v1, v2)")
        if not any(self.dp is None or m.group_size(m.dp_axes) == self.dp for f in self.tp for m in family_meshes(self.devices, f)):
            raise ValueError(self._no_mesh())
        if min(self.zero) > 0 and (self.dp == 1 or self.devices == 1):
            stages = ",".join(map(str, self.zero))
            raise ValueError(f"ZeRO {stages} shards over the data-parallel axis, and dp = 1 leaves none to shard over (every stage is "
                             "ZeRO 0 there): search --zero 0 for the same plans, or let dp be > 1")

    def _no_mesh(self) -> str:
        """Why no mesh of the families asked for tiles the devices (with ``dp`` fixed, if it is)."""
        needs = {"none": f"dp = {self.devices}", "1d": "dp x tp with tp >= 2 dividing the device count",
                 "2d": "dp x q x q with q >= 2, q*q dividing the device count (4, 8, 9, 12, 16, ...)",
                 "3d": "dp x q x q x q with q >= 2, q^3 dividing the device count (8, 16, 24, 27, 32, ...)"}
        fixed = f" with dp = {self.dp}" if self.dp is not None else ""
        return (f"no mesh of --tp {','.join(self.tp)} tiles {self.devices} devices{fixed} ("
                + "; ".join(f"{f}: {needs[f]}" for f in self.tp)
                + "): search another family (e.g. --tp none,1d) or a device count these tile")


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    family: str
    zero: int = 0
    cdp: str = "off"
    micro_batches: int = 1
    recompute: str = "none"
    plan: Plan | None = None  # the configuration's fastest plan within the budget
    reason: str = ""  # why pruned or infeasible
    least_memory: float | None = None
    least_is_bound: bool = False  # least_memory is a lower bound (no ILP was run), not the exact least
    least_terms: tuple[tuple[str, float], ...] = ()  # the exact least-memory plan's terms (params, grads, ...)
    front: tuple[Plan, ...] = ()  # the configuration's Pareto plans within the budget, fastest first
    seconds: float = 0.0  # building and solving this configuration

    @property
    def settings(self) -> Settings:
        """The schemes' settings of this configuration, as :func:`planner.problem.build_problem` takes them."""
        return {"zero_stage": self.zero, "cdp": self.cdp, "micro_batches": self.micro_batches, "recompute": self.recompute}


def candidate_meshes(space: SearchSpace, batch: int, graph: IRGraph | None = None) -> list[Candidate]:
    """Every configuration of ``space`` for a global batch of ``batch`` rows, each pruned with its
    reason where it cannot run (the batch does not split; a scheme refuses the combination or, given
    the model's ``graph``, has nothing to act on: :meth:`planner.schemes.base.Scheme.unsupported`)."""
    out = []
    for family in ALL_TP:
        if family not in space.tp:
            continue
        for mesh in family_meshes(space.devices, family):
            dp = mesh.group_size(mesh.dp_axes)
            if space.dp is not None and dp != space.dp:
                continue
            for m in space.micro_batches:
                if batch % (dp * m):
                    what = f"batch {batch} does not split {dp} ways" if m == 1 else f"batch {batch} does not split into {m} micro-batches x {dp} ways"
                    out.append(Candidate(mesh, family, micro_batches=m, reason=what))
                    continue
                stages = [z for z in space.zero if z == 0 or dp > 1]
                if not stages:  # ZeRO shards over data-parallel axes: with dp = 1 every stage is stage 0
                    stages = [0]
                for cdp, zero, recompute in itertools.product(space.cdp, stages, space.recompute):
                    cand = Candidate(mesh, family, zero, cdp, micro_batches=m, recompute=recompute)
                    reason = next((why for why in (scheme.unsupported(mesh, cand.settings, graph) for scheme in SCHEMES) if why), "")
                    out.append(replace(cand, reason=reason))
    return out


def batch_rows(graph: IRGraph) -> int:
    """The traced batch: dim 0 of the first input (1 without inputs)."""
    return graph.nodes[graph.input_names[0]].out.shape[0] if graph.input_names else 1
