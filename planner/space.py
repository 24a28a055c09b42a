"""The search space: which configurations (mesh, ZeRO stage, CDP mode, micro-batch count,
recomputation) a search's :class:`planner.config.SearchConfig` asks for, and why the ones that
cannot run are pruned before any solve.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from planner.config import ALL_TP, SearchConfig
from planner.ir import IRGraph
from planner.mesh import Mesh
from planner.plan import Plan
from planner.schemes.base import Settings
from planner.schemes.registry import SCHEMES
from planner.schemes.tp import family_meshes


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


def candidate_meshes(config: SearchConfig, batch: int, graph: IRGraph | None = None) -> list[Candidate]:
    """Every configuration of ``config`` for a global batch of ``batch`` rows, each pruned with its
    reason where it cannot run (the batch does not split; a scheme refuses the combination or, given
    the model's ``graph``, has nothing to act on: :meth:`planner.schemes.base.Scheme.unsupported`)."""
    out = []
    for family in ALL_TP:
        if family not in config.tp:
            continue
        for mesh in family_meshes(config.devices, family):
            dp = mesh.group_size(mesh.dp_axes)
            if config.dp is not None and dp != config.dp:
                continue
            for m in config.micro_batches:
                if batch % (dp * m):
                    what = f"batch {batch} does not split {dp} ways" if m == 1 else f"batch {batch} does not split into {m} micro-batches x {dp} ways"
                    out.append(Candidate(mesh, family, micro_batches=m, reason=what))
                    continue
                stages = [z for z in config.zero if z == 0 or dp > 1]
                if not stages:  # ZeRO shards over data-parallel axes: with dp = 1 every stage is stage 0
                    stages = [0]
                for cdp, zero, recompute in itertools.product(config.cdp, stages, config.recompute):
                    cand = Candidate(mesh, family, zero, cdp, micro_batches=m, recompute=recompute)
                    reason = next((why for why in (scheme.unsupported(mesh, cand.settings, graph) for scheme in SCHEMES) if why), "")
                    out.append(replace(cand, reason=reason))
    return out


def batch_rows(graph: IRGraph) -> int:
    """The traced batch: dim 0 of the first input (1 without inputs)."""
    return graph.nodes[graph.input_names[0]].out.shape[0] if graph.input_names else 1
