"""The ``planner`` command line.

    planner calibrate --out FILE.json [--quick] [--world N]
    planner report MODEL --devices N [--batch B] [--hardware NAME|FILE] [--memory BYTES]
                   [--tp none,1d] [--zero 0] [--cdp off,v1,v2] [--cdp-stages L] [--dp N] [--objective time|memory]
                   [--precision fp32|bf16-mixed|fp16-mixed] [--optimizer adamw|sgd-momentum]
                   [--json] [--save-plan FILE]

MODEL is a bundled preset (``planner models`` lists them) or ``package.module:factory`` where
``factory(batch)`` returns ``(model, args, kwargs)``: the model (ideally on the ``meta`` device)
and one global batch such that ``model(*args, **kwargs)`` returns the training loss.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any

import torch

from planner.api import plan_model
from planner.hardware import PRESETS, load_profile
from planner.report import search_json
from planner.search import ALL_TP
from planner.units import parse_bytes


def _bytes_arg(text: str) -> float:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _list(kind: type, allowed: tuple[Any, ...] | None = None) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        items = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        if allowed is not None:
            bad = [x for x in items if x not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not among {', '.join(map(str, allowed))}")
        return items

    return parse


PRECISIONS = {"fp32": (torch.float32, None), "bf16-mixed": (torch.bfloat16, "float32"), "fp16-mixed": (torch.float16, "float32")}


def load_model(spec: str, batch: int, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """A preset name, or ``package.module:factory``; floating parameters and inputs in ``dtype``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise SystemExit(f"cannot load model factory {spec!r}: {exc}") from exc
        out = factory(batch)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise SystemExit(f"{spec}(batch) must return (model, args, kwargs); got {type(out).__name__}")
        model, args, kwargs = out
        cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return model.to(dtype), tuple(cast), dict(kwargs), spec
    from models import available_models, build_model, example_inputs

    if spec not in available_models():
        raise SystemExit(f"unknown model {spec!r}: use one of {', '.join(available_models())} or package.module:factory")
    model = build_model(spec, device="meta", dtype=dtype)
    args, kwargs = example_inputs(spec, batch=batch, device="meta", dtype=dtype)
    return model, args, kwargs, spec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="planner", description="Automatic parallelization planner for PyTorch training.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="plan a model and print where time and memory go")
    r.add_argument("model", help="preset name (see `planner models`) or package.module:factory")
    r.add_argument("--devices", type=int, required=True)
    r.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    r.add_argument("--hardware", default="a100-80g", help=f"preset ({', '.join(PRESETS)}) or a JSON profile file")
    r.add_argument("--memory", type=_bytes_arg, default=None, help="memory budget per device (default: the device's memory), e.g. 40GiB")
    r.add_argument("--tp", type=_list(str, ALL_TP), default=ALL_TP, help="tensor-parallel families to search (comma list of none,1d,2d,3d)")
    r.add_argument("--zero", type=_list(int, (0, 1, 2, 3)), default=(0,), help="ZeRO stages to search (comma list)")
    r.add_argument("--cdp", type=_list(str, ("off", "v1", "v2")), default=("off",), help="CDP modes to search (comma list)")
    r.add_argument("--cdp-stages", type=int, default=4, help="CDP: stages the model is cut into (default 4)")
    r.add_argument("--dp", type=int, default=None, help="fix the data-parallel degree")
    r.add_argument("--objective", choices=("time", "memory"), default="time")
    r.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                   help="fp32, or mixed: compute in bf16/fp16 with float32 master weights and optimizer states (default fp32)")
    r.add_argument("--no-prefetch", action="store_true", help="ZeRO-3: gather each parameter when used, not one ahead")
    r.add_argument("--optimizer", choices=("adamw", "sgd-momentum"), default="adamw", help="optimizer whose states are priced (default adamw)")
    r.add_argument("--json", action="store_true", help="print one JSON document instead of the text report")
    r.add_argument("--save-plan", metavar="FILE", help="write the best plan as JSON (runtime.compile_plan loads it)")
    r.add_argument("--time-limit", type=float, default=120.0, help="ILP time limit per configuration, seconds")
    r.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("models", help="list bundled model presets")
    c = sub.add_parser("calibrate", help="measure this machine (matmuls, op overhead, memory, collectives) and write a profile")
    c.add_argument("--out", required=True, metavar="FILE.json", help="where to write the profile (use it with report --hardware FILE.json)")
    c.add_argument("--quick", action="store_true", help="small sizes and few repeats (under a minute)")
    c.add_argument("--world", type=int, default=2, help="processes for the collective benchmarks (default 2)")
    c.add_argument("--name", default=None, help="profile name (default calibrated-cpu / calibrated-gpu)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "models":
        from models import available_models

        print("\n".join(available_models()))
        return 0
    if args.command == "calibrate":
        from runtime.calibrate import calibrate  # measuring needs processes: runtime, imported here

        profile = calibrate(quick=args.quick, world=args.world, name=args.name)
        with open(args.out, "w") as f:
            f.write(profile.model_dump_json(indent=1))
        peaks = ", ".join(f"{k.removeprefix('torch.')} {v / 1e9:.1f} GFLOP/s" for k, v in profile.peak_flops.items())
        print(f"wrote {args.out}: {profile.name}, peak {peaks}, op overhead {profile.op_overhead * 1e6:.1f} us, "
              f"memory {profile.memory_bandwidth / 1e9:.2f} GB/s, link {profile.intra_node.bandwidth / 1e9:.3f} GB/s + {profile.intra_node.latency * 1e6:.0f} us")
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from planner.solve import SolverSettings

    dtype, master_dtype = PRECISIONS[args.precision]
    model, m_args, m_kwargs, name = load_model(args.model, args.batch, dtype)
    hw = load_profile(args.hardware)
    try:
        result = plan_model(
            model, devices=args.devices, example_inputs=m_args, example_kwargs=m_kwargs, hardware=hw,
            memory_budget=args.memory, tp=args.tp, zero=args.zero, cdp=args.cdp, cdp_stages=args.cdp_stages, dp=args.dp,
            objective=args.objective, optimizer=args.optimizer, master_dtype=master_dtype, prefetch=not args.no_prefetch, model_name=name, solver=SolverSettings(time_limit_s=args.time_limit),
        )
    except ValueError as exc:
        print(f"planner: error: {exc}", file=sys.stderr)
        return 2
    if args.save_plan and result.plan is not None:
        with open(args.save_plan, "w") as f:
            f.write(result.plan.model_dump_json(indent=1))
    if args.json:
        print(json.dumps(search_json(result.search, model_name=name, devices=args.devices, hardware=hw), indent=1))
    else:
        print(result.report)
    return 0 if result.plan is not None else 1


if __name__ == "__main__":
    sys.exit(main())
