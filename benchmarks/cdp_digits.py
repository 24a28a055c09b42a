"""Training quality under CDP: an MLP classifier on scikit-learn's digits, 4 gloo ranks.

    pip install -e ".[bench]"   # scikit-learn, for the dataset
    python benchmarks/cdp_digits.py [--epochs 30] [--stages 2]

Data parallelism (the compiled module, gradients all-reduced), CDP-v1 and CDP-v2 (runtime/cdp.py,
gradients summed along the point-to-point chain, one-step delay) train the same MLP (64-128-128-10,
float32) from the same initial weights on the same batches (global batch 64, 16 per worker), SGD
with momentum. Prints per mode the final training loss, the test accuracy (360 held-out images)
and the wall time, and the ratio of each mode's time to DP's in the same run.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
BATCH = 64
SGD = {"lr": 0.05, "momentum": 0.9}


def _data() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def _model() -> torch.nn.Module:
    from planner.models.mlp import MLP, MLPConfig

    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=64, hidden=128, out_features=10, n_layers=2))
    model.reset_parameters(std=0.1)
    return model


def _plan() -> str:
    from planner.hardware import A100_80G
    from planner.schemes.cdp import cdp_filter
    from planner.schemes.tp import DP_AXIS
    from planner.search import search
    from planner.space import SearchSpace
    from planner.trace import trace

    heavy = {"aten.linear.default", "aten.cross_entropy_loss.default"}
    graph = trace(_model(), (torch.zeros(BATCH, 64),), {"targets": torch.zeros(BATCH, dtype=torch.int64)})
    result = search(graph, SearchSpace(devices=WORLD, dp=WORLD, zero=(0,), tp=("none",)), A100_80G, model_name="mlp-digits", optimizer="sgd",
                    allow=cdp_filter(graph, (DP_AXIS,), base=lambda node, s: node.target not in heavy or DP_AXIS in s.split_axes))
    assert result.best is not None
    return result.best.model_dump_json()


def _worker(rank: int, port: int, plan_json: str, mode: str, epochs: int, stages: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from planner.runtime.compile import compile_plan

    x, y, x_test, y_test = _data()
    plan = Plan.model_validate_json(plan_json)
    example = ((x[:BATCH],), {"targets": y[:BATCH]})
    dp_axes = frozenset(plan.mesh_obj.dp_axes) if mode != "dp" else frozenset()
    pm = compile_plan(plan, _model(), *example, loss_partial_over=dp_axes)
    trainer = CDPTrainer(pm, num_stages=stages, rule=mode, optimizer_class=torch.optim.SGD, **SGD) if mode != "dp" else None  # type: ignore[arg-type]
    opt = torch.optim.SGD(pm.parameters(), **SGD) if trainer is None else None
    t0 = time.perf_counter()
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(x) - BATCH + 1, BATCH):
            idx = order[start : start + BATCH]
            args, kwargs = pm.shard_batch(x[idx], targets=y[idx])
            if trainer is not None:
                loss = torch.tensor(trainer.step(*args, **kwargs))
                dist.all_reduce(loss)  # for the report only
            else:
                assert opt is not None
                loss = pm(*args, **kwargs)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    if trainer is not None:
        trainer.finish()
    seconds = time.perf_counter() - t0
    state = pm.full_state_dict()
    if rank == 0:
        model = _model()
        model.load_state_dict(state)
        with torch.no_grad():
            accuracy = (model(x_test).argmax(-1) == y_test).float().mean().item()
        out.put({"mode": mode, "loss": sum(losses[-20:]) / 20, "accuracy": accuracy, "seconds": seconds})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()
    plan = _plan()
    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("dp", "v1", "v2"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, port, plan, mode, args.epochs, args.stages, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        rows.append(queue.get())
    base = rows[0]["seconds"]
    print(f"digits, MLP 64-128-128-10, {WORLD} workers x {BATCH // WORLD} images, {args.epochs} epochs, L = {args.stages} stages, SGD {SGD}")
    print(f"{'mode':<6}{'train loss (last 20 steps)':>28}{'test accuracy':>16}{'time':>10}{'vs DP':>8}")
    for r in rows:
        print(f"{r['mode']:<6}{r['loss']:>28.4f}{r['accuracy']:>16.2%}{r['seconds']:>9.1f}s{r['seconds'] / base:>8.2f}")


if __name__ == "__main__":
    main()
