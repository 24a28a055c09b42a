"""Faults: a stalled or dead rank is named by the others, and a world killed mid-step restarts
under ``torchrun --max-restarts`` from the newest complete checkpoint with the uninterrupted run's
step counter and losses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.config import SearchConfig
from planner.models import build_model, example_inputs
from planner.search import search
from planner.trace import trace
from tests.harness import run_world

ROOT = Path(__file__).resolve().parents[1]
PG_TIMEOUT = 4.0  # the process group's timeout in these worlds (s)
GRACE = 2.0  # PLANNER_FAULT_GRACE_S
WORLD = 3
VICTIM = 2


def _dp_plan(cdp: str = "off") -> str:
    args, kwargs = example_inputs("mlp-tiny", batch=6, dtype=torch.float64)
    space = SearchConfig(devices=WORLD, dp=WORLD, tp=("none",), cdp=(cdp,), cdp_stages=2, front=False)
    result = search(trace(build_model("mlp-tiny", dtype=torch.float64), args, kwargs), space, model_name="mlp-tiny")
    assert result.best is not None
    return result.best.model_dump_json()


def _fault(rank: int, world: int, plan: str, mode: str) -> dict[str, Any]:
    """One healthy step on every rank; then the victim stalls (sleeps past the timeout) or leaves
    (its connections close, as a killed process's do) while the others take the next step ("late":
    it leaves, and rank 1 starts that step later than rank 0)."""
    import torch.distributed as dist

    from planner.plan import Plan
    from planner.runtime.compile import compile_plan

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
        if mode in ("dead", "late"):
            dist.destroy_process_group()
            return {"left": True}
        time.sleep(PG_TIMEOUT + GRACE + 3)
    if mode == "late" and rank == 1:  # rank 1 fails well after rank 0, still comparing when rank 0's grace ends
        time.sleep(0.6 * GRACE)
    start = time.monotonic()
    try:
        step()
        return {"error": None}
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc), "seconds": time.monotonic() - start}


def _cdp_fault(rank: int, world: int, plan: str) -> dict[str, Any]:
    """CDP v1 over dp=3 of mlp-tiny (2 stages): one step on every rank, then rank 2 leaves and
    the others step again: the gradient chain's point-to-point messages fail, named."""
    import torch.distributed as dist

    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from planner.runtime.compile import compile_plan

    args, kwargs = example_inputs("mlp-tiny", batch=6, dtype=torch.float64)
    pm = compile_plan(Plan.model_validate_json(plan), build_model("mlp-tiny", dtype=torch.float64), args, kwargs,
                      loss_partial_over=frozenset({"dp"}))
    trainer = CDPTrainer(pm, torch.optim.SGD, lr=0.1)  # the plan's CDP v1, 2 stages
    local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
    trainer.step(*local_args, **local_kwargs)
    # no barrier here: on CDP's clock the workers are at different steps at once (a rank's step may
    # wait for its predecessor's next one), so only the clock's own messages may order them
    if rank == VICTIM:
        dist.destroy_process_group()
        return {"left": True}
    try:
        trainer.step(*local_args, **local_kwargs)
        trainer.finish()
        return {"error": None}
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc)}


def test_a_dead_rank_in_cdps_chain_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANNER_FAULT_GRACE_S", str(GRACE))
    results = run_world(WORLD, _cdp_fault, _dp_plan("v1"), timeout=120, pg_timeout=PG_TIMEOUT, settle=False)
    named = [r for rank, r in enumerate(results) if rank != VICTIM and r.get("type") == "CollectiveError"]
    assert len(named) == WORLD - 1, results
    for got in named:  # each names the CDP message and, itself or through the rank it waited for, rank 2
        assert got["error"].startswith(f"rank {results.index(got)}: CDP ") and "rank 2" in got["error"], got
    assert any("Rank 2 did not report" in got["error"] for got in named), named


@pytest.fixture(scope="module")
def plan() -> str:
    return _dp_plan()


@pytest.mark.parametrize("mode", ["stall", "dead", "late"])
def test_the_others_name_the_stalled_or_dead_rank_and_the_collective(plan: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dp=3 on 3 gloo ranks, rank 2 stalls (or dies) before a step: ranks 0 and 1 raise
    CollectiveError naming rank 2 and the collective over dp they were in, within the process group's
    timeout plus the grace for a stall (at once plus the grace for a death); rank 0, which hosts the
    store, one grace more at most, waiting until rank 1 has read the reports (CI once saw rank 0
    leave first and rank 1 find the store gone)."""
    monkeypatch.setenv("PLANNER_FAULT_GRACE_S", str(GRACE))
    results = run_world(WORLD, _fault, plan, mode, timeout=120, pg_timeout=PG_TIMEOUT, settle=False)
    for rank in range(WORLD):
        if rank == VICTIM:
            continue
        bound = (PG_TIMEOUT if mode == "stall" else 0) + (2 if rank == 0 else 1) * GRACE + 3.0  # 3 s of slack: 3 processes, 2 cores
        got = results[rank]
        assert got["type"] == "CollectiveError", got
        assert re.match(rf"rank {rank}: (all_reduce|all_gather|reduce_scatter) over mesh axes \('dp',\) in \w+ over ranks 0, 1, 2 failed", got["error"]), got
        assert f"Rank {1 - rank} failed too" in got["error"], got["error"]  # the other survivor is not the one named
        assert f"Rank {VICTIM} did not report within {GRACE:g} s: stalled or dead" in got["error"], got["error"]
        assert got["seconds"] <= bound, got
        if mode == "stall":
            assert got["seconds"] >= PG_TIMEOUT - 0.5, got  # it waited for the timeout, not less


TRAIN = ["examples/train_large.py", "--model", "gpt-tiny", "--steps", "6", "--save-every", "2", "--batch", "8", "--dtype", "float64",
         "--tp", "none", "--dp", "2", "--zero", "1"]


def _torchrun(args: list[str], log: Path, timeout: float = 300) -> int:
    torchrun = Path(sys.executable).with_name("torchrun")
    # a fresh store per attempt: torchrun shares its rendezvous store with the workers by default, and a restarted
    # gloo group can read the previous attempt's addresses from it (pytorch#135712; seen here: connectFullMesh refused)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PLANNER_FAULT_GRACE_S="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_crash_mid_step_restarts_from_the_newest_checkpoint_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    """``torchrun --max-restarts 1``: rank 1 dies between forward and backward of step 3 (of 6,
    a checkpoint every 2); torchrun stops rank 0 and restarts both (with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see ``_torchrun``), they resume at step 2 from the newest complete checkpoint, and every step's loss (the
    ones before the crash come back from the checkpoint) equals the uninterrupted run's."""
    assert _torchrun([*TRAIN, "--out", str(tmp_path / "one"), "--losses", str(tmp_path / "one.json")], tmp_path / "one.log") == 0, \
        (tmp_path / "one.log").read_text()[-3000:]
    code = _torchrun(["--max-restarts", "1", *TRAIN, "--out", str(tmp_path / "two"), "--losses", str(tmp_path / "two.json"), "--crash-at", "3"],
                     tmp_path / "two.log")
    log = (tmp_path / "two.log").read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert "starting at step 0 (attempt 0)" in log and "starting at step 2 (attempt 1)" in log, log[-3000:]
    want = json.loads((tmp_path / "one.json").read_text())
    got = json.loads((tmp_path / "two.json").read_text())
    assert sorted(got, key=int) == sorted(want, key=int) == [str(k) for k in range(6)]
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-12 * abs(loss), (step, got[step], loss)
