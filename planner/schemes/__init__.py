"""Parallelism and memory schemes, one module each, behind one protocol (:mod:`planner.schemes.base`):

* :mod:`planner.schemes.zero`: data parallelism's gradient sync and ZeRO stages 0-3;
* :mod:`planner.schemes.cdp`: cyclic data parallelism;
* :mod:`planner.schemes.microbatch`: gradient accumulation over micro-batches;
* :mod:`planner.schemes.recompute`: activation recomputation of repeated layers;
* :mod:`planner.schemes.tp`: the tensor-parallel families and their meshes (their per-op
  strategies are the rules of :mod:`planner.rules`).

:data:`planner.schemes.registry.SCHEMES` is the order :func:`planner.problem.build_problem` runs their hooks in: a later
scheme sees what an earlier one set (CDP replaces the gradient sync ZeRO priced).
"""
