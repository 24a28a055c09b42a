"""The GPU-only checks of the runtime and cost model, in one run (figures, not a test).

    python benchmarks/gpu_check.py [--out DIR] [--model gpt2-small] [--batch 8] [--steps 10] [--quick | --profile gpu.json]

Meant for one call on a lent GPU machine (well under 8 minutes on one H200); nothing else depends on
it. On the first CUDA device it:

1. runs ``planner calibrate`` (matmul curves in bf16/fp16/fp32, op overhead, memory bandwidth,
   optimizer steps; NCCL collectives when the machine has several GPUs) and writes ``DIR/gpu.json``;
2. trains ``--model`` (default gpt2-small, 124 M parameters, seq 1024) on one device in bf16
   autocast with fp32 weights and fused AdamW, and prints its MFU: the traced graph's forward +
   backward FLOPs per step over the median step time and the profile's bf16 peak (the preset's
   datasheet peak, and the calibrated best matmul, both printed);
3. for the single-device plan (float32, as planned), the same with each attention core and with
   every block recomputed in backward (activation checkpointing), and the sharded plans that run on one GPU
   (2 gloo ranks sharing it: data parallelism and Megatron 1-D, whose collectives gloo runs on
   CUDA tensors; a plan whose collectives gloo cannot run on CUDA is reported, not hidden),
   compares the plan's predicted step time and peak memory with the median measured step and
   ``torch.cuda.max_memory_allocated`` (less what was allocated before the model was built);
4. the same three recomputation modes on GPT-2 124M in ``transformers`` with eager attention
   (seq 1024), where selective recomputation drops the attention scores and probabilities.

Everything it prints also goes to ``DIR/gpu_check.json``. Under NCCL the runtime's collectives are
asynchronous work on NCCL's own CUDA stream, so they overlap the compute stream. ``--device cpu``
runs the same steps on the CPU with a tiny model (a smoke test of the script, no figures worth
reading).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: dict[str, Any] = {}


def say(key: str, value: Any) -> None:
    RESULTS[key] = value
    print(f"{key}: {json.dumps(value) if not isinstance(value, str) else value}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_step(step: Any, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate_profile(out: Path, quick: bool) -> Any:
    from planner.runtime.calibrate import calibrate

    t0 = time.perf_counter()
    profile = calibrate(quick=quick, world=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    (out / "gpu.json").write_text(profile.model_dump_json(indent=2))
    say("calibrate", {"seconds": round(time.perf_counter() - t0, 1), "peak_flops_tflops": {k: round(v / 1e12, 1) for k, v in profile.peak_flops.items()},
                      "op_overhead_us": round(profile.op_overhead * 1e6, 2), "memory_bandwidth_gbs": round(profile.memory_bandwidth / 1e9, 1),
                      "overlap_efficiency": round(profile.overlap_efficiency, 3)})
    return profile


def mfu(model_name: str, batch: int, steps: int, device: torch.device, profile: Any) -> None:
    """bf16 autocast over fp32 weights, fused AdamW where the device has it."""
    from planner.hardware import H200_141G
    from planner.models import build_model, example_inputs
    from planner.trace import trace

    graph = trace(build_model(model_name, device="meta"), *example_inputs(model_name, batch=batch, device="meta"))
    flops = sum(n.flops_fwd + n.flops_bwd for n in graph.nodes.values() if n.kind == "op")
    model = build_model(model_name, device=device)
    args, kwargs = example_inputs(model_name, batch=batch, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = torch.bfloat16

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype):
            loss = model(*args, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = _median_step(step, steps, 3, device)
    datasheet = H200_141G.peak_flops["torch.bfloat16"]
    measured_peak = profile.peak_flops.get("torch.bfloat16", 0.0) if profile is not None else 0.0
    say("mfu", {"model": model_name, "batch": batch, "step_ms": round(seconds * 1e3, 2), "tflops_per_step": round(flops / 1e12, 2),
                "achieved_tflops": round(flops / seconds / 1e12, 1), "mfu_vs_h200_datasheet": round(flops / seconds / datasheet, 3),
                "mfu_vs_calibrated_matmul": round(flops / seconds / measured_peak, 3) if measured_peak else None})


EAGER_GPT2 = "hf-gpt2-124m-eager"  # GPT-2 small's shapes (12 x 768, 12 heads, seq 1024) in transformers, eager attention


def _build(model_name: str, seed: int) -> torch.nn.Module:
    """A preset, or :data:`EAGER_GPT2` (the attention whose scores selective recomputation drops)."""
    if model_name != EAGER_GPT2:
        from planner.models import build_model

        return build_model(model_name, seed=seed)
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50304, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def _inputs(model_name: str, batch: int, seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if model_name != EAGER_GPT2:
        from planner.models import example_inputs

        return example_inputs(model_name, batch=batch, seed=seed)
    ids = torch.randint(0, 50304, (batch, 1024), generator=torch.Generator().manual_seed(seed))
    return (), {"input_ids": ids, "labels": ids}


RECOMPUTE_LABELS = {"none": "1 device", "selective": "1 device, attention cores recomputed", "full": "1 device, every block recomputed",
                    "full 1/2": "1 device, the first half of the blocks recomputed"}


def _plans(model_name: str, batch: int, profile: Any, world: int) -> list[tuple[str, str]]:
    from planner.config import SearchConfig
    from planner.schemes.recompute import parse
    from planner.search import search
    from planner.trace import trace

    graph = trace(_build(model_name, 0), *_inputs(model_name, batch, 1))
    same = {"hardware": profile, "front": False}
    modes = {label: parse(setting) for setting, label in RECOMPUTE_LABELS.items()}  # (mode, share of the blocks)
    spaces = {label: SearchConfig(devices=1, tp=("none",), recompute=(mode,), recompute_layers=(float(share),), **same)
              for label, (mode, share) in modes.items()} if world == 1 else {
        f"dp={world}": SearchConfig(devices=world, dp=world, tp=("none",), zero=(0,), **same),
        f"dp={world} zero1": SearchConfig(devices=world, dp=world, tp=("none",), zero=(1,), **same),
        f"tp={world} (1-D)": SearchConfig(devices=world, dp=1, tp=("1d",), zero=(0,), **same),
    }
    out = []
    for label, space in spaces.items():
        result = search(graph, space, model_name=model_name)
        if result.best is not None:
            out.append((label, result.best.model_dump_json()))
        else:
            say(f"plan {label}", "no plan: " + "; ".join(c.reason for c in result.candidates if c.reason))
    return out


def _run_plans(rank: int, world: int, port: int, model_name: str, batch: int, steps: int, plans: list[tuple[str, str]], use_cuda: bool, out: Any) -> None:
    import torch.distributed as dist

    from planner.plan import Plan
    from planner.runtime.compile import compile_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for label, text in plans:
        plan = Plan.model_validate_json(text)
        row: dict[str, Any] = {"plan": label, "rank": rank, "predicted_ms": round(plan.step_time_s * 1e3, 2),
                               "predicted_peak_mib": round(plan.peak_memory_bytes / 2**20, 1)}
        try:
            if use_cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            model = _build(model_name, 0)
            args, kwargs = _inputs(model_name, batch, 1)
            pm = compile_plan(plan, model, args, kwargs, device=device)
            del model
            opt = pm.make_optimizer(torch.optim.AdamW, lr=1e-4)
            local_args, local_kwargs = pm.shard_batch(*args, **kwargs)

            def step(pm: Any = pm, opt: Any = opt, a: Any = local_args, k: Any = local_kwargs) -> None:
                loss = pm(*a, **k)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            seconds = _median_step(step, steps, 2, device)
            row["measured_ms"] = round(seconds * 1e3, 2)
            row["step_error"] = round(plan.step_time_s / seconds - 1, 3)
            if use_cuda:
                peak = torch.cuda.max_memory_allocated(device) - before
                row["measured_peak_mib"] = round(peak / 2**20, 1)
                row["memory_error"] = round(plan.peak_memory_bytes / peak - 1, 3)
            del pm, opt, step
        except Exception as exc:  # a plan whose collectives gloo cannot run on CUDA tensors, say
            cause = f" (from {type(exc.__cause__).__name__}: {str(exc.__cause__).splitlines()[0][:300]})" if exc.__cause__ is not None else ""
            row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}{cause}"
        rows.append(row)
        dist.barrier()
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def predicted_vs_measured(model_name: str, batch: int, steps: int, profile: Any, use_cuda: bool, world: int) -> None:
    import torch.multiprocessing as mp

    plans = _plans(model_name, batch, profile, world)
    if not plans:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_run_plans, args=(r, world, port, model_name, batch, steps, plans, use_cuda, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.time() + 300
        while queue.empty() and any(p.is_alive() for p in procs) and time.time() < deadline:
            time.sleep(0.5)
        rows = queue.get() if not queue.empty() else [{"failed": "the ranks exited or timed out without a result"}]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    for row in rows:
        say(f"plan {row.get('plan', '?')} on {world} rank(s)", row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--plan-batch", type=int, default=4, help="global batch of the float32 plans (predicted vs measured)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="planner calibrate --quick")
    p.add_argument("--profile", help="a profile calibrate wrote on this machine before (gpu.json): used instead of calibrating again")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--sections", default=None, help="comma list of calibrate, mfu, one device, two ranks sharing the device, recompute (default all)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    use_cuda = a.device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script is for a GPU machine (--device cpu smoke-tests it)")
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        say("device", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    t0 = time.perf_counter()
    from planner.hardware import H200_141G, HardwareProfile

    profile: Any = HardwareProfile.model_validate_json(Path(a.profile).read_text()) if a.profile else None
    sections = [
        ("calibrate", lambda: calibrate_profile(out, a.quick) if a.profile is None else profile),
        ("mfu", lambda: mfu(a.model, a.batch, a.steps, device, profile)),
        ("one device", lambda: predicted_vs_measured(a.model, a.plan_batch, a.steps, profile or H200_141G, use_cuda, 1)),
        ("two ranks sharing the device", lambda: predicted_vs_measured(a.model, a.plan_batch, a.steps, profile or H200_141G, use_cuda, 2)),
        ("recompute", lambda: predicted_vs_measured(EAGER_GPT2 if use_cuda else "hf-gpt2-eager", a.plan_batch, a.steps, profile or H200_141G, use_cuda, 1)),
    ]
    sections = [(name, run) for name, run in sections if a.sections is None or name in a.sections.split(",")]
    for name, run in sections:
        try:
            value = run()
            if name == "calibrate":
                profile = value
        except Exception:
            say(f"{name} failed", traceback.format_exc(limit=3))
        (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2))
    say("seconds", round(time.perf_counter() - t0, 1))
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2))


if __name__ == "__main__":
    main()
