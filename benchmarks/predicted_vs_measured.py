"""Predicted vs measured, on this machine: memory per rank and step time for several plans.

    python benchmarks/predicted_vs_measured.py [--hardware FILE.json] [--steps 5]

Without ``--hardware`` it first runs ``planner calibrate --quick`` (matmuls, op overhead, memory
bandwidth, gloo collectives) and plans with that profile. For ``gpt-tiny`` and a small MLP, on 4
gloo ranks (float32, AdamW), each plan (data parallelism with ZeRO 0/1/3, Megatron 1-D, pure
1-D, 2-D, data x tensor parallelism with ZeRO-2) is compiled and trained, and four CDP plans of
the MLP (v1 and v2, ZeRO 0 and 1, trained by ``runtime.cdp.CDPTrainer``: step time only, in a
table of their own); per rank it measures the peak of live tensor bytes over a step (runtime/memory.py: every storage alive, parameters,
gradients, optimizer states, activations, buffers) and the median step time. Prints a table
(predicted, measured, error) and, across plans, the Spearman rank correlation of step times and
the median absolute error of each quantity.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
MODELS = {"gpt-tiny": 16, "mlp-large": 64}  # model -> global batch
CONFIGS = [  # (label, tp families, dp, zero)
    ("dp=4 zero0", ("none",), 4, 0),
    ("dp=4 zero1", ("none",), 4, 1),
    ("dp=4 zero3", ("none",), 4, 3),
    ("dp=2 x tp=2 zero0", ("1d",), 2, 0),
    ("dp=2 x tp=2 zero2", ("1d",), 2, 2),
    ("tp=4", ("1d",), 1, 0),
    ("2-D 2x2", ("2d",), 1, 0),
]


CDP_MODEL = "mlp-large"
CDP_CONFIGS = [  # (label, zero, CDP rule): CDP over dp=4, 4 stages, trained by runtime.cdp.CDPTrainer
    ("dp=4 cdp v1", 0, "v1"),
    ("dp=4 cdp v2", 0, "v2"),
    ("dp=4 zero1 cdp v1", 1, "v1"),
    ("dp=4 zero1 cdp v2", 1, "v2"),
]


def _plans(hardware: Any) -> list[tuple[str, str, str]]:
    from planner.config import SearchConfig
    from planner.models import build_model, example_inputs
    from planner.search import search
    from planner.trace import trace

    out = []
    for name, batch in MODELS.items():
        graph = trace(build_model(name, seed=0), *example_inputs(name, batch=batch, seed=1))  # as the ranks will
        for label, tp, dp, zero in CONFIGS:
            result = search(graph, SearchConfig(devices=WORLD, tp=tp, dp=dp, zero=(zero,), hardware=hardware), model_name=name)
            if result.best is not None:
                out.append((name, label, result.best.model_dump_json()))
    graph = trace(build_model(CDP_MODEL, seed=0), *example_inputs(CDP_MODEL, batch=MODELS[CDP_MODEL], seed=1))
    for label, zero, rule in CDP_CONFIGS:
        config = SearchConfig(devices=WORLD, tp=("none",), dp=WORLD, zero=(zero,), cdp=(rule,), cdp_stages=4, hardware=hardware)
        result = search(graph, config, model_name=CDP_MODEL)
        if result.best is not None:
            out.append((CDP_MODEL, label, result.best.model_dump_json()))
    return out


def _worker(rank: int, port: int, plans: list[tuple[str, str, str]], steps: int, out: Any) -> None:
    try:
        _measure(rank, port, plans, steps, out)
    except BaseException as exc:
        out.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def _median_step(step: Callable[[], Any], *, warmup: int, steps: int) -> float:
    """The median of ``steps`` timed calls after ``warmup`` untimed ones, all ranks starting each together."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_cdp_step(step: Callable[[], Any], *, warmup: int, steps: int) -> float:
    """The median of ``steps`` timed CDP steps after ``warmup``, back to back: on CDP's clock the
    workers are at different steps at once (a rank's step may wait for its predecessor's next), so
    no barrier may start them together; the table takes the slowest rank's median."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(rank: int, port: int, plans: list[tuple[str, str, str]], steps: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from planner.models import build_model, example_inputs
    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from planner.runtime.compile import compile_plan
    from planner.runtime.memory import LiveMemory

    rows = []
    for name, label, text in plans:
        plan = Plan.model_validate_json(text)
        batch = MODELS[name]
        model = build_model(name, seed=0)
        args, kwargs = example_inputs(name, batch=batch, seed=1)
        pm = compile_plan(plan, model, args, kwargs)
        del model
        local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
        if plan.cdp != "off":  # step time only: CDP's memory is tested against its prediction in tests/test_cdp.py
            trainer = CDPTrainer(pm, torch.optim.AdamW, lr=1e-3)
            seconds = _median_cdp_step(functools.partial(trainer.step, *local_args, **local_kwargs), warmup=2, steps=steps)
            trainer.finish()
            rows.append({"model": name, "plan": label, "mesh": plan.mesh, "rank": rank, "seconds": seconds, "peak": None,
                         "predicted_seconds": plan.step_time_s, "predicted_peak": plan.peak_memory_bytes})
            dist.barrier()
            continue
        opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)

        def step(pm: Any = pm, opt: Any = opt, local_args: Any = local_args, local_kwargs: Any = local_kwargs) -> None:
            loss = pm(*local_args, **local_kwargs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds = _median_step(step, warmup=1, steps=steps)  # optimizer states exist after the warm-up
        mem = LiveMemory()
        with mem:
            mem.track([list(pm.parameters()), [t for st in opt.state.values() for t in st.values()], local_args, local_kwargs])
            if pm.zero is not None:
                mem.track(list(pm.zero.shards.values()))
            mem.reset_peak()
            step()
        rows.append({"model": name, "plan": label, "mesh": plan.mesh, "rank": rank, "seconds": seconds, "peak": mem.peak,
                     "predicted_seconds": plan.step_time_s, "predicted_peak": plan.peak_memory_bytes})
        dist.barrier()
    out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default=None, help="a profile JSON (default: calibrate --quick now)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from planner.hardware import load_profile

    if args.hardware:
        hardware = load_profile(args.hardware)
    else:
        from planner.runtime.calibrate import calibrate

        hardware = calibrate(quick=True, world=WORLD)  # the ranks share the host as the plans will
        print(f"calibrated: {json.dumps({k: v for k, v in hardware.sources.items() if k in ('peak_flops', 'op_overhead', 'memory_bandwidth')})}", file=sys.stderr)
    plans = _plans(hardware)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, plans, args.steps, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        got = queue.get()
        if isinstance(got, str):
            for p in procs:
                p.terminate()
            raise SystemExit(f"a rank failed: {got}")
        rows += got
    for p in procs:
        p.join()
    print(f"{'model':<10} {'plan':<20} {'mem predicted':>14} {'measured (max rank)':>20} {'error':>7} {'step predicted':>15} {'measured':>10} {'error':>7}")
    pred_t, meas_t, mem_err, t_err = [], [], [], []
    cdp = {label for label, _, _ in CDP_CONFIGS}
    for name, label, _ in [p for p in plans if p[1] not in cdp]:
        mine = [r for r in rows if r["model"] == name and r["plan"] == label]
        peak = max(r["peak"] for r in mine)
        secs = max(r["seconds"] for r in mine)
        p_peak, p_secs = mine[0]["predicted_peak"], mine[0]["predicted_seconds"]
        e_mem = (p_peak - peak) / peak
        e_t = (p_secs - secs) / secs
        mem_err.append(abs(e_mem))
        t_err.append(abs(e_t))
        pred_t.append(p_secs)
        meas_t.append(secs)
        print(f"{name:<10} {label:<20} {p_peak / 2**20:>11.2f} MiB {peak / 2**20:>17.2f} MiB {e_mem:>+7.1%} {p_secs * 1e3:>12.2f} ms {secs * 1e3:>7.2f} ms {e_t:>+7.1%}")
    for name in MODELS:
        idx = [i for i, (n, label, _) in enumerate(plans) if n == name and label not in cdp]
        rho = _spearman([pred_t[i] for i in idx], [meas_t[i] for i in idx])
        print(f"{name}: step-time rank correlation (Spearman) {rho:.2f} over {len(idx)} plans")
    print(f"all: step-time rank correlation {_spearman(pred_t, meas_t):.2f}; median |error| memory {statistics.median(mem_err):.1%}, "
          f"step time {statistics.median(t_err):.1%}; plans within 10% memory: {sum(e <= 0.10 for e in mem_err)}/{len(mem_err)}")
    cdp_err = []
    print(f"\nCDP (runtime.cdp.CDPTrainer, {CDP_MODEL}, 4 stages): step time as planner.schemes.cdp.cdp_overlap prices it")
    for name, label, _ in [p for p in plans if p[1] in cdp]:
        mine = [r for r in rows if r["model"] == name and r["plan"] == label]
        secs, p_secs = max(r["seconds"] for r in mine), mine[0]["predicted_seconds"]
        cdp_err.append(abs((p_secs - secs) / secs))
        print(f"{name:<10} {label:<20} {'':>14} {'':>20} {'':>7} {p_secs * 1e3:>12.2f} ms {secs * 1e3:>7.2f} ms {(p_secs - secs) / secs:>+7.1%}")
    if cdp_err:
        print(f"cdp: median |error| step time {statistics.median(cdp_err):.1%} over {len(cdp_err)} plans")


if __name__ == "__main__":
    main()
