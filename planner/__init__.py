"""planner: an automatic parallelization planner/compiler for PyTorch training.

    from planner import auto_parallelize
    result = auto_parallelize(model, devices=64, example_inputs=batch)   # outside torchrun: the plan
    pm = auto_parallelize(model, devices=4, example_inputs=batch)        # under torchrun: a sharded module

The names below load on first use, so ``import planner.runtime`` (every rank of a training job)
loads the plan's types without the search and its solvers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.api import PlanningResult, auto_parallelize, plan_model
    from planner.plan import Plan
    from planner.trace import TraceError, trace

_WHERE = {"PlanningResult": "planner.api", "auto_parallelize": "planner.api", "plan_model": "planner.api", "Plan": "planner.plan",
          "TraceError": "planner.trace", "trace": "planner.trace"}

__all__ = ["Plan", "PlanningResult", "TraceError", "auto_parallelize", "plan_model", "trace"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
