"""``auto_parallelize`` under a process group: rank 0 plans, every rank runs that plan."""

from __future__ import annotations

from typing import Any

import torch

from tests.harness import run_world


def plan_and_run(rank: int, world: int) -> dict[str, Any]:
    from models import build_model, example_inputs
    from planner import auto_parallelize

    model = build_model("gpt-tiny", dtype=torch.float64)
    args, kwargs = example_inputs("gpt-tiny", batch=4, dtype=torch.float64)
    pm = auto_parallelize(model, world, args, example_kwargs=kwargs, objective="memory")
    local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
    loss = pm(*local_args, **local_kwargs)
    return {"plan": pm.plan.model_dump_json(), "loss": loss.item(), "ref": model(*args, **kwargs).item()}


def test_every_rank_runs_rank_0s_plan_and_gets_the_single_device_loss() -> None:
    results = run_world(2, plan_and_run, timeout=300)
    assert len({r["plan"] for r in results}) == 1
    for r in results:
        assert abs(r["loss"] - r["ref"]) <= 1e-9 * abs(r["ref"])
