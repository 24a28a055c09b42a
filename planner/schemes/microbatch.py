"""Micro-batching (gradient accumulation): a step runs the forward and backward of ``micro_batches``
micro-batches one after another and syncs gradients and steps the optimizer once.

The graph is traced on one micro-batch (the global batch / ``micro_batches``): activations are one
micro-batch's, held once; every forward and backward term (compute, an op's collectives, layout
conversions) repeats ``micro_batches`` times (:meth:`planner.terms.Problem.repeats`), the step
phase's (gradient sync, optimizer) once. ZeRO-2's reduce-scatter runs in backward, so once per
micro-batch (:mod:`planner.schemes.zero`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from planner.ir import IRGraph
from planner.mesh import Mesh
from planner.schemes.base import Flag, Scheme, Settings
from planner.terms import Problem

if TYPE_CHECKING:
    from planner.config import SearchConfig
    from planner.plan import Plan


class MicroBatching(Scheme):
    name = "micro_batches"
    setting = "micro_batches"
    searched = "micro_batches"
    off = 1
    flags = (Flag("--micro-batches", "micro_batches", "gradient accumulation: micro-batch counts to search (comma list, e.g. 1,2,4; default 1)", int),)
    column = "micro-batches"
    title = "micro-batches"

    def unsupported(self, mesh: Mesh, settings: Settings, graph: IRGraph | None = None) -> str:
        m = settings["micro_batches"]
        return "" if m >= 1 else f"micro_batches must be >= 1, got {m}"

    def label(self, settings: Settings) -> str:
        return f"x{settings['micro_batches']} micro-batches" if settings["micro_batches"] > 1 else ""

    def summary(self, plan: Plan) -> str:
        return f"{plan.micro_batches} micro-batches" if plan.micro_batches > 1 else ""

    def describe(self, plan: Plan) -> list[str]:
        if plan.micro_batches == 1:
            return []
        rows = plan.input_shapes[0][0] if plan.input_shapes else "?"
        return [f"  gradient accumulation: {plan.micro_batches} micro-batches of {rows} rows per step, one after another, gradients synced "
                "and the optimizer stepped once (run a step with ParallelModule.forward_backward)"]

    def advice(self, config: SearchConfig, graph: IRGraph, memory: Mapping[str, float]) -> str:
        more = max(config.micro_batches) * 2
        if not activations_dominate(memory) or graph.batch_rows() % more:
            return ""
        return f"gradient accumulation (--micro-batches {more}: each micro-batch holds a share of the activations)"


def activations_dominate(memory: Mapping[str, float]) -> bool:
    """Whether a plan's activations are at least half its parameter, gradient and optimizer
    bytes (``memory``: its terms): where a smaller share of the batch is worth advising."""
    return memory["activations"] >= (memory["params"] + memory["grads"] + memory["optimizer"]) / 2

    def configure(self, problem: Problem) -> None:
        why = self.unsupported(problem.mesh, problem.settings)
        if why:
            raise ValueError(why)
