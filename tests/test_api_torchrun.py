"""``auto_parallelize`` under a process group: rank 0 plans, every rank runs that plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.harness import run_world
from tests.test_multi_node import _launch, _wait


def plan_and_run(rank: int, world: int) -> dict[str, Any]:
    from planner import auto_parallelize
    from planner.models import build_model, example_inputs

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


def test_the_example_plans_for_the_cpu_it_runs_on_and_shards(tmp_path: Path) -> None:
    """examples/train_gpt_tiny.py under torchrun with gloo: planned for cpu-gloo (not an A100's
    prices), and the plan it trains really splits the work (no "shards nothing" note)."""
    _wait([_launch(["--standalone", "--nproc-per-node", "2", "examples/train_gpt_tiny.py", "--steps", "2"], tmp_path, "tiny")], tmp_path)
    log = (tmp_path / "tiny.log").read_text(errors="replace")
    plan_line = next(line for line in log.splitlines() if line.startswith("plan for "))
    assert plan_line.startswith("plan for cpu-gloo: mesh {'dp': 2") and "shards nothing" not in log, log[-2000:]
    assert "step 0: loss" in log
