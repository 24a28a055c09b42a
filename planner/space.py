"""The search space: which configurations (mesh, ZeRO stage, CDP mode, micro-batch count,
recomputation) a search's :class:`planner.config.SearchConfig` asks for, and why the ones that
cannot run are pruned before any solve.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from planner.config import ALL_TP, SearchConfig
from planner.ir import IRGraph
from planner.mesh import Mesh
from planner.plan import Plan
from planner.schemes.base import OFF, Settings
from planner.schemes.registry import SCHEMES
from planner.schemes.tp import family_meshes


@dataclass(frozen=True)
class Candidate:
    """One configuration of a search: a mesh and a value of each scheme's setting (``settings``,
    by :attr:`planner.schemes.base.Scheme.setting`), and, once searched, what it gave."""

    mesh: Mesh
    family: str
    settings: Settings = field(default_factory=lambda: dict(OFF))
    plan: Plan | None = None  # the configuration's fastest plan within the budget
    reason: str = ""  # why pruned or infeasible
    least_memory: float | None = None
    least_is_bound: bool = False  # least_memory is a lower bound (no ILP was run), not the exact least
    least_terms: tuple[tuple[str, float], ...] = ()  # the exact least-memory plan's terms (params, grads, ...)
    front: tuple[Plan, ...] = ()  # the configuration's Pareto plans within the budget, fastest first
    seconds: float = 0.0  # building and solving this configuration

    # shorthands for three schemes' settings (every scheme's is in ``settings``, by its setting)
    @property
    def zero(self) -> int:
        return int(self.settings["zero_stage"])

    @property
    def cdp(self) -> str:
        return str(self.settings["cdp"])

    @property
    def micro_batches(self) -> int:
        return int(self.settings["micro_batches"])


def candidate_meshes(config: SearchConfig, batch: int, graph: IRGraph | None = None) -> list[Candidate]:
    """Every configuration of ``config`` for a global batch of ``batch`` rows: each mesh of the
    families asked for, with every combination of the values each scheme's setting takes there
    (:meth:`planner.schemes.base.Scheme.values`), each pruned with its reason where it cannot run
    (the batch does not split; a scheme refuses the combination or, given the model's ``graph``,
    has nothing to act on: :meth:`planner.schemes.base.Scheme.unsupported`)."""
    out = []
    for family in ALL_TP:
        if family not in config.tp:
            continue
        for mesh in family_meshes(config.devices, family):
            dp = mesh.group_size(mesh.dp_axes)
            if config.dp is not None and dp != config.dp:
                continue
            for values in itertools.product(*(scheme.values(config, mesh) for scheme in SCHEMES)):
                settings = {scheme.setting: value for scheme, value in zip(SCHEMES, values, strict=True)}
                m = settings["micro_batches"]
                if batch % (dp * m):
                    what = f"batch {batch} does not split {dp} ways" if m == 1 else f"batch {batch} does not split into {m} micro-batches x {dp} ways"
                    reason = what
                else:
                    reason = next((why for why in (scheme.unsupported(mesh, settings, graph) for scheme in SCHEMES) if why), "")
                out.append(Candidate(mesh, family, settings, reason=reason))
    return _once_per_split(out)


def _once_per_split(candidates: list[Candidate]) -> list[Candidate]:
    """A batch that does not split is one reason per mesh and micro-batch count, not one per
    combination of the other settings."""
    seen: set[tuple[str, int]] = set()
    out = []
    for c in candidates:
        if c.reason.startswith("batch ") and "does not split" in c.reason:
            key = (str(c.mesh), c.micro_batches)
            if key in seen:
                continue
            seen.add(key)
        out.append(c)
    return out
