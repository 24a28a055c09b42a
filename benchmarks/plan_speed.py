"""Planning speed at every size: the zoo x device counts, the default search, the whole front and one plan.

    python benchmarks/plan_speed.py                      # every cell (about 30-60 min on 2 cores)
    python benchmarks/plan_speed.py --models gpt-tiny,gpt2-small --devices 8,64 --modes front
    python benchmarks/plan_speed.py --markdown           # the table as GitHub markdown

Each cell runs in its own process, one after another (serial, as a user runs a report): the model
is built on the meta device and traced, then :func:`planner.search.search` runs the default search
space (every TP family, ZeRO 0-3, every mesh) for ``devices`` devices, either the whole front
(``front``: resolution 5 %, at most 8 points per configuration, the CLI's defaults) or one plan
(``best``: ``--best-only``). The global batch is the device count (at least 8), so data
parallelism can reach every device; ``hf-llama3-8b`` is Hugging Face's ``LlamaForCausalLM`` with
Llama-3-8B's shapes (hidden 4096, 32 layers, 32 heads, 8 key/value heads, vocab 128256) at
sequence 8192. Printed per cell: search seconds (trace not included; it is its own column), the
process's peak RSS, configurations solved / dismissed / infeasible, front points, the chosen
plan's mesh, and whether the cell meets the targets of issue 18 on a 2-core host: the front
<= 15 s and one plan <= 3 s up to 512 devices, <= 60 s and <= 20 s at 4096, peak RSS <= 4 GiB.
A cell past its timeout is killed and shown as ``> T s``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ZOO = ("gpt-tiny", "gpt2-small", "gpt3-1.3b", "gpt3-13b", "gpt3-175b", "vit-base", "mlp-large", "hf-llama3-8b")
DEVICES = (8, 64, 512)
LARGE = {"gpt3-13b", "gpt3-175b"}  # also planned for 4096 devices
GIB = 2**30


@dataclass(frozen=True)
class Target:
    front_s: float
    best_s: float
    rss_gib: float = 4.0

    def limit(self, mode: str) -> float:
        return self.front_s if mode == "front" else self.best_s


def target(devices: int) -> Target:
    return Target(60.0, 20.0) if devices > 512 else Target(15.0, 3.0)


def llama3_8b(batch: int, seq: int = 8192) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Hugging Face Llama with Llama-3-8B's shapes on the meta device, token ids and labels."""
    import torch

    from planner.models.hf import _transformers

    transformers = _transformers()
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=seq, use_cache=False,
                                      rope_theta=500000.0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (), {"input_ids": ids, "labels": ids}


def run_cell(model_name: str, devices: int, mode: str) -> dict[str, Any]:
    """One cell in this process: trace, search, what the table needs."""
    from planner.cli import load_model
    from planner.config import SearchConfig
    from planner.hardware import load_profile
    from planner.search import SearchProgress, search
    from planner.trace import trace

    batch = max(8, devices)
    if model_name == "hf-llama3-8b":
        model, args, kwargs = llama3_8b(batch)
    else:
        model, args, kwargs, _ = load_model(model_name, batch)
    t0 = time.perf_counter()
    graph = trace(model, args, kwargs)
    trace_s = time.perf_counter() - t0
    events: list[SearchProgress] = []  # the search's own counts, after its last configuration
    config = SearchConfig(devices=devices, zero=(0, 1, 2, 3), hardware=load_profile("a100-80g"), front=mode == "front")
    result = search(graph, config, model_name=model_name, progress=events.append)
    last = events[-1]
    return {
        "model": model_name, "devices": devices, "mode": mode, "batch": batch,
        "trace_s": trace_s, "search_s": result.seconds,
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "configurations": last.done, "solved": last.solved, "dismissed": last.dismissed, "infeasible": last.infeasible,
        "points": len(result.front),
        "best": (f"{'x'.join(f'{a}={d}' for a, d in result.best.mesh.items() if d > 1) or 'one device'} ZeRO-{result.best.zero_stage} "
                 f"{result.best.step_time_s * 1e3:.1f} ms") if result.best else "nothing fits",
    }


def spawn(model_name: str, devices: int, mode: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", model_name, str(devices), mode]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})
    except subprocess.TimeoutExpired:
        return {"model": model_name, "devices": devices, "mode": mode, "timeout": timeout, "wall_s": time.perf_counter() - t0}
    if done.returncode:
        return {"model": model_name, "devices": devices, "mode": mode, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:100]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(cell: dict[str, Any]) -> list[str]:
    t = target(cell["devices"])
    head = [cell["model"], str(cell["devices"]), cell["mode"]]
    if "timeout" in cell:
        return [*head, "-", f"> {cell['timeout']:.0f}", "-", "-", "-", "-", f"misses ({t.limit(cell['mode']):.0f} s)"]
    if "error" in cell:
        return [*head, "-", "error", "-", "-", "-", cell["error"], "error"]
    misses = []
    if cell["search_s"] > t.limit(cell["mode"]):
        misses.append(f"{t.limit(cell['mode']):.0f} s")
    if cell["rss_gib"] > t.rss_gib:
        misses.append(f"{t.rss_gib:.0f} GiB")
    verdict = "meets" if not misses else "misses (" + ", ".join(misses) + ")"
    return [*head, f"{cell['trace_s']:.1f}", f"{cell['search_s']:.1f}", f"{cell['rss_gib']:.2f}",
            f"{cell['solved']}/{cell['dismissed']}/{cell['infeasible']}", str(cell["points"]), cell["best"], verdict]


HEADER = ["model", "devices", "mode", "trace s", "search s", "peak RSS GiB", "solved/dismissed/infeasible", "points", "chosen plan", "target"]


def print_table(rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "|".join("---" for _ in HEADER) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(HEADER)]
    for r in [HEADER, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(ZOO))
    p.add_argument("--devices", default=None, help="comma list (default 8,64,512, and 4096 for gpt3-13b and gpt3-175b)")
    p.add_argument("--modes", default="front,best")
    p.add_argument("--timeout", type=float, default=None, help="seconds per cell before it is killed (default: 2x its target, at least 20)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--cell", nargs=3, metavar=("MODEL", "DEVICES", "MODE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.cell:
        print(json.dumps(run_cell(a.cell[0], int(a.cell[1]), a.cell[2])))
        return
    rows = []
    for model_name in a.models.split(","):
        counts = [int(d) for d in a.devices.split(",")] if a.devices else [*DEVICES, *((4096,) if model_name in LARGE else ())]
        for devices in counts:
            for mode in a.modes.split(","):
                timeout = a.timeout or max(20.0, 2 * target(devices).limit(mode))
                cell = spawn(model_name, devices, mode, timeout)
                rows.append(row(cell))
                print("  ".join(rows[-1]), file=sys.stderr, flush=True)
    print_table(rows, a.markdown)
    met = sum(1 for r in rows if r[-1] == "meets")
    print(f"\n{met} of {len(rows)} cells meet their targets")


if __name__ == "__main__":
    main()
