"""Faults: a stalled or dead rank is named by the others, and a world killed mid-step restarts
under ``torchrun --max-restarts`` from the newest complete checkpoint with the uninterrupted run's
step counter and losses."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from models import build_model, example_inputs
from planner.hardware import A100_80G
from planner.search import SearchSpace, search
from planner.trace import trace
from tests.harness import run_world

ROOT = Path(__file__).resolve().parents[1]
PG_TIMEOUT = 4.0  # the process group's timeout in these worlds (s)
GRACE = 2.0  # PLANNER_FAULT_GRACE_S
WORLD = 3
VICTIM = 2


def _dp_plan() -> str:
    args, kwargs = example_inputs("mlp-tiny", batch=6, dtype=torch.float64)
    result = search(trace(build_model("mlp-tiny", dtype=torch.float64), args, kwargs), SearchSpace(devices=WORLD, dp=WORLD, tp=("none",)),
                    A100_80G, model_name="mlp-tiny", front=False)
    assert result.best is not None
    return result.best.model_dump_json()


def _fault(rank: int, world: int, plan: str, mode: str) -> dict[str, Any]:
    """One healthy step on every rank; then the victim stalls (sleeps past the timeout) or leaves
    (its connections close, as a killed process's do) while the others take the next step."""
    import torch.distributed as dist

    from planner.plan import Plan
    from runtime.compile import compile_plan

    args, kwargs = example_inputs("mlp-tiny", batch=6, dtype=torch.float64)
    pm = compile_plan(Plan.model_validate_json(plan), build_model("mlp-tiny", dtype=torch.float64), args, kwargs)
    opt = pm.make_optimizer(torch.optim.SGD, lr=0.1)

    def step() -> None:
        local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
        pm(*local_args, **local_kwargs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if rank == VICTIM:
        if mode == "dead":
            dist.destroy_process_group()
            return {"left": True}
        time.sleep(PG_TIMEOUT + GRACE + 3)
    start = time.monotonic()
    try:
        step()
        return {"error": None}
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc), "seconds": time.monotonic() - start}


@pytest.fixture(scope="module")
def plan() -> str:
    return _dp_plan()


@pytest.mark.parametrize("mode", ["stall", "dead"])
def test_the_others_name_the_stalled_or_dead_rank_and_the_collective(plan: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dp=3 on 3 gloo ranks, rank 2 stalls (or dies) before a step: ranks 0 and 1 raise
    CollectiveError naming rank 2 and the collective over dp they were in, within the process group's
    timeout plus the grace for a stall (at once plus the grace for a death)."""
    monkeypatch.setenv("PLANNER_FAULT_GRACE_S", str(GRACE))
    results = run_world(WORLD, _fault, plan, mode, timeout=120, pg_timeout=PG_TIMEOUT, settle=False)
    bound = (PG_TIMEOUT if mode == "stall" else 0) + GRACE + 3.0  # 3 s of slack for 3 processes on 2 cores
    for rank in range(WORLD):
        if rank == VICTIM:
            continue
        got = results[rank]
        assert got["type"] == "CollectiveError", got
        assert re.match(rf"rank {rank}: (all_reduce|all_gather|reduce_scatter) over mesh axes \('dp',\) in \w+ over ranks 0, 1, 2 failed", got["error"]), got
        assert "Rank 0" not in got["error"] and "Rank 1 " not in got["error"], got["error"]
        assert f"Rank {VICTIM} did not report within {GRACE:g} s: stalled or dead" in got["error"], got["error"]
        assert got["seconds"] <= bound, got
        if mode == "stall":
            assert got["seconds"] >= PG_TIMEOUT - 0.5, got  # it waited for the timeout, not less
