"""planner: an automatic parallelization planner/compiler for PyTorch training.

    from planner import auto_parallelize
    result = auto_parallelize(model, devices=64, example_inputs=batch)   # outside torchrun: the plan
    pm = auto_parallelize(model, devices=4, example_inputs=batch)        # under torchrun: a sharded module
"""

from planner.api import PlanningResult, auto_parallelize, plan_model
from planner.plan import Plan
from planner.trace import TraceError, trace

__all__ = ["Plan", "PlanningResult", "TraceError", "auto_parallelize", "plan_model", "trace"]
