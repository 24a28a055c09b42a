"""Training quality under CDP, 4 gloo ranks: DP, CDP-v1 and CDP-v2 from the same weights on the same batches.

    pip install -e ".[bench]"   # scikit-learn, for the digits
    python benchmarks/cdp_digits.py [--task digits|sequence] [--epochs N] [--stages L] [--lr LR]

Data parallelism (the compiled module, gradients all-reduced), CDP-v1 and CDP-v2 (runtime/cdp.py,
gradients summed along the point-to-point chain, one-step delay) train the same model from the
same initial weights on the same batches, float32. Two tasks:

* ``digits``: an MLP classifier (64-128-128-10) on scikit-learn's digits, global batch 64 (16
  per worker), 30 epochs, SGD with momentum; test accuracy on 360 held-out images.
* ``sequence``: a small GPT (2 layers, 2 heads, width 64) on a synthetic in-context task: each
  sequence of 16 tokens over a vocabulary of 16 steps by a stride k of its own (token i = a + i k
  mod 16, a and k random), so the next token is known once two are seen; global batch 64, 4,096
  training sequences, 40 epochs, AdamW at 1e-3; test accuracy: the next token predicted right at positions 2-14
  of 512 held-out sequences.

Prints per mode the final training loss (mean of the last 20 steps), the test accuracy, the wall
time and each mode's time over DP's in the same run.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
BATCH = 64
HEAVY = ("aten.linear.default", "aten.layer_norm.default", "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default")


@dataclass(frozen=True)
class Task:
    title: str
    data: Callable[[], tuple[torch.Tensor, ...]]  # x, y, x_test, y_test
    model: Callable[[], torch.nn.Module]  # the same initial weights every call
    accuracy: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], float]
    epochs: int
    optimizer: type[torch.optim.Optimizer]
    options: dict[str, Any]


def _digits() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def _mlp() -> torch.nn.Module:
    from planner.models.mlp import MLP, MLPConfig

    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=64, hidden=128, out_features=10, n_layers=2))
    model.reset_parameters(std=0.1)
    return model


def _classified(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(-1) == y).float().mean())


VOCAB, SEQ = 16, 16


def _strides() -> tuple[torch.Tensor, ...]:
    """Sequences a + i k (mod VOCAB), i = 0..SEQ: inputs the first SEQ tokens, targets the next."""
    g = torch.Generator().manual_seed(0)
    n = 4096 + 512
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, VOCAB, (n, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return x[:4096], y[:4096], x[4096:], y[4096:]


def _gpt() -> torch.nn.Module:
    from planner.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=SEQ, vocab_size=VOCAB))
    model.reset_parameters()
    return model


def _next_token(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    predicted = model(x)[..., :VOCAB].argmax(-1)
    return float((predicted[:, 1:-1] == y[:, 1:-1]).float().mean())  # positions 2..SEQ-2: two tokens seen


TASKS = {
    "digits": Task("digits, MLP 64-128-128-10", _digits, _mlp, _classified, 30, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "sequence": Task(f"strided sequences, GPT 2 layers x width 64, {SEQ} tokens over {VOCAB}", _strides, _gpt, _next_token, 40,
                     torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0}),
}


def _plan(task: Task, cdp: str, stages: int) -> str:
    """Every heavy op splits the batch over the data-parallel axis, as CDP's workers need (its
    filter); ``cdp`` "v1" plans for CDP (CDPTrainer's ``rule`` then picks v1 or v2): batch-independent
    ops keep their gradients partial over the workers (GPT's position embedding), where a plan for
    DP all-reduces them in backward, a collective CDP's staggered workers cannot join."""
    from planner.config import SearchConfig
    from planner.schemes.cdp import cdp_filter
    from planner.schemes.tp import DP_AXIS
    from planner.search import search
    from planner.trace import trace

    x, y, _, _ = task.data()
    graph = trace(task.model(), (x[:BATCH],), {"targets": y[:BATCH]})
    config = SearchConfig(devices=WORLD, dp=WORLD, zero=(0,), tp=("none",), cdp=(cdp,), cdp_stages=stages, optimizer="sgd-momentum")
    light = cdp_filter(graph, (DP_AXIS,), base=lambda node, s: node.target not in HEAVY or DP_AXIS in s.split_axes)
    result = search(graph, config, model_name="cdp-convergence", allow=light)
    assert result.best is not None
    return result.best.model_dump_json()


def _worker(rank: int, port: int, plan_json: str, task: Task, mode: str, epochs: int, stages: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from planner.runtime.compile import compile_plan

    x, y, x_test, y_test = task.data()
    plan = Plan.model_validate_json(plan_json)
    example = ((x[:BATCH],), {"targets": y[:BATCH]})
    dp_axes = frozenset(plan.mesh_obj.dp_axes) if mode != "dp" else frozenset()
    pm = compile_plan(plan, task.model(), *example, loss_partial_over=dp_axes)
    trainer = CDPTrainer(pm, num_stages=stages, rule=mode, optimizer_class=task.optimizer, **task.options) if mode != "dp" else None  # type: ignore[arg-type]
    opt = task.optimizer(pm.parameters(), **task.options) if trainer is None else None
    t0 = time.perf_counter()
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(x) - BATCH + 1, BATCH):
            idx = order[start : start + BATCH]
            args, kwargs = pm.shard_batch(x[idx], targets=y[idx])
            if trainer is not None:  # this worker's share; summed after finish() (no collective between CDP's steps)
                losses.append(trainer.step(*args, **kwargs))
            else:
                assert opt is not None
                loss = pm(*args, **kwargs)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
    if trainer is not None:
        trainer.finish()
        summed = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(summed)
        losses = summed.tolist()
    seconds = time.perf_counter() - t0
    state = pm.full_state_dict()
    if rank == 0:
        model = task.model()
        model.load_state_dict(state)
        with torch.no_grad():
            accuracy = task.accuracy(model, x_test, y_test)
        out.put({"mode": mode, "loss": sum(losses[-20:]) / 20, "accuracy": accuracy, "seconds": seconds, "steps": len(losses)})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=tuple(TASKS), default="digits")
    parser.add_argument("--epochs", type=int, default=None, help="default: the task's (digits 30, sequence 40)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--lr", type=float, default=None, help="default: the task's (digits 0.05, sequence 1e-3)")
    args = parser.parse_args()
    task = TASKS[args.task]
    if args.lr is not None:
        task = replace(task, options={**task.options, "lr": args.lr})
    epochs = args.epochs or task.epochs
    plans = {"dp": _plan(task, "off", args.stages), "cdp": _plan(task, "v1", args.stages)}
    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("dp", "v1", "v2"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, port, plans["dp" if mode == "dp" else "cdp"], task, mode, epochs, args.stages, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        rows.append(queue.get())
    base = rows[0]["seconds"]
    print(f"{task.title}, {WORLD} workers x {BATCH // WORLD} examples, {epochs} epochs ({rows[0]['steps']} steps), L = {args.stages} stages, "
          f"{task.optimizer.__name__} {task.options}")
    print(f"{'mode':<6}{'train loss (last 20 steps)':>28}{'test accuracy':>16}{'time':>10}{'vs DP':>8}")
    for r in rows:
        print(f"{r['mode']:<6}{r['loss']:>28.4f}{r['accuracy']:>16.2%}{r['seconds']:>9.1f}s{r['seconds'] / base:>8.2f}")


if __name__ == "__main__":
    main()
