"""runtime: everything with side effects — process groups, the rank-local module, collectives.

``compile_plan(plan, model, args, kwargs)`` builds this rank's module (see runtime.compile).
"""

from planner.runtime.compile import compile_plan
from planner.runtime.module import ParallelModule

__all__ = ["ParallelModule", "compile_plan"]
