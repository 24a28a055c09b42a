"""Micro-batching (gradient accumulation): a step runs the forward and backward of ``micro_batches``
micro-batches one after another and syncs gradients and steps the optimizer once.

The graph is traced on one micro-batch (the global batch / ``micro_batches``): activations are one
micro-batch's, held once; every forward and backward term (compute, an op's collectives, layout
conversions) repeats ``micro_batches`` times (:meth:`planner.terms.Problem.repeats`), the step
phase's (gradient sync, optimizer) once. ZeRO-2's reduce-scatter runs in backward, so once per
micro-batch (:mod:`planner.schemes.zero`).
"""

from __future__ import annotations

from planner.ir import IRGraph
from planner.mesh import Mesh
from planner.schemes.base import Scheme, Settings, settings_of
from planner.terms import Problem


class MicroBatching(Scheme):
    name = "micro_batches"
    setting = "micro_batches"
    searched = "micro_batches"
    off = 1

    def unsupported(self, mesh: Mesh, settings: Settings, graph: IRGraph | None = None) -> str:
        m = settings["micro_batches"]
        return "" if m >= 1 else f"micro_batches must be >= 1, got {m}"

    def label(self, settings: Settings) -> str:
        return f"x{settings['micro_batches']} micro-batches" if settings["micro_batches"] > 1 else ""

    def configure(self, problem: Problem) -> None:
        why = self.unsupported(problem.mesh, settings_of(problem))
        if why:
            raise ValueError(why)
