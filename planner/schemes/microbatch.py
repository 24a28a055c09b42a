"""Micro-batching (gradient accumulation): a step runs the forward and backward of ``micro_batches``
micro-batches one after another and syncs gradients and steps the optimizer once.

The graph is traced on one micro-batch (the global batch / ``micro_batches``): activations are one
micro-batch's, held once; every forward and backward term (compute, an op's collectives, layout
conversions) repeats ``micro_batches`` times (:meth:`planner.terms.Problem.repeats`), the step
phase's (gradient sync, optimizer) once. ZeRO-2's reduce-scatter runs in backward, so once per
micro-batch (:mod:`planner.schemes.zero`).
"""

from __future__ import annotations

from planner.schemes.base import Scheme
from planner.terms import Problem


class MicroBatching(Scheme):
    name = "micro_batches"

    def configure(self, problem: Problem) -> None:
        if problem.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {problem.micro_batches}")
