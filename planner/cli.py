"""The ``planner`` command line.

    planner calibrate --out FILE.json [--quick] [--world N]
    planner report MODEL --devices N [SEARCH OPTIONS] [--json | --markdown] [--plot FILE.png] [--save-plan FILE]
    planner explain MODEL --devices N [SEARCH OPTIONS] [--point K]
    planner models

SEARCH OPTIONS: [--batch B] [--config FILE] [--hardware NAME|FILE] [--memory BYTES] [--tp none,1d,2d,3d] [--dp N]
[--objective time|memory|knee] [--best-only] [--resolution 0.02] [--max-points 12] [--precision fp32|bf16-mixed|fp16-mixed]
[--optimizer adamw|sgd-momentum] [--time-limit S] [--progress] [-v], and each scheme's flags (its module's
``Scheme.flags``): [--zero 0,1,2,3] [--no-prefetch] [--cdp off,v1,v2] [--cdp-stages L] [--micro-batches 1,2,4]
[--recompute none,selective,full] [--recompute-layers 0.5,1]

``report`` prints the time/memory front (every plan no other beats on both, the knee and the
objective's choice marked), what happened to every configuration, and the chosen plan; ``explain``
says, for one front point (``--point K`` numbers the front table from 1; default: the objective's
choice), where its time and memory go and why the alternatives lost. Progress lines go to stderr
(when it is a terminal, or with ``--progress``/``-v``), so stdout stays clean for ``--json``. Exit
status 1 when no plan fits (the report says the least memory any plan needs and what to change),
2 for bad input.

MODEL is a bundled preset (``planner models`` lists them) or ``package.module:factory`` where
``factory(batch)`` returns ``(model, args, kwargs)``: the model (ideally on the ``meta`` device)
and one global batch such that ``model(*args, **kwargs)`` returns the training loss.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from planner.config import ALL_TP, SearchConfig
from planner.hardware import PRESETS, HardwareProfile
from planner.ir import IRGraph
from planner.schemes.base import Flag
from planner.schemes.registry import SCHEMES
from planner.search import SearchProgress, SearchResult
from planner.solve import SolverSettings
from planner.units import parse_bytes

SCHEME_FLAGS = [flag for scheme in SCHEMES for flag in scheme.flags]


def _bytes_arg(text: str) -> float:
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 bytes per device (e.g. 40GiB; leave --memory out for the device's memory)")
    return value


def _seconds(option: str) -> Any:
    def parse(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{option} {text} must be > 0 seconds")
        return value

    return parse


def _list(kind: type, allowed: tuple[Any, ...] | None = None) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        items = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing: give a comma list" + (f" of {', '.join(map(str, allowed))}" if allowed else ""))
        if allowed is not None:
            bad = [x for x in items if x not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not among {', '.join(map(str, allowed))}")
        return items

    return parse


def _resolution(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"--resolution {text} must be in [0, 1): the relative memory step between front points (0.02: one per 2 %)")
    return value


def _fraction(option: str, what: str) -> Any:
    def parse(text: str) -> float:
        value = float(text)
        if not 0 <= value < 1:
            raise argparse.ArgumentTypeError(f"{option} {text} must be in [0, 1): {what}")
        return value

    return parse


def _point(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--point {text}: front points are numbered from 1 (the fastest), as `planner report` prints them")
    return value


def _at_least(low: int, option: str, why: str = "") -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{option} {text} must be >= {low}" + (f": {why}" if why else ""))
        return value

    return parse


def _max_points(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"--max-points {text} must be >= 2 (the fastest and the smallest plan); use --best-only for one")
    return value


PRECISIONS = {"fp32": (torch.float32, None), "bf16-mixed": (torch.bfloat16, "float32"), "fp16-mixed": (torch.float16, "float32")}


def load_model(spec: str, batch: int, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """A preset name, or ``package.module:factory``; floating parameters and inputs in ``dtype``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load model factory {spec!r}: {exc}") from exc
        if not callable(factory):
            raise ValueError(f"{spec} is a {type(factory).__name__}, not a factory: give a function f(batch) -> (model, args, kwargs)")
        try:
            out = factory(batch)
        except Exception as exc:
            raise ValueError(f"the model factory {spec}({batch}) raised {type(exc).__name__}: {exc}") from exc
        if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], torch.nn.Module)):
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
            raise ValueError(f"{spec}(batch) must return (model, args, kwargs) with model a torch.nn.Module; got {got}")
        model, args, kwargs = out
        cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return model.to(dtype), tuple(cast), dict(kwargs), spec
    from planner.models import available_models, build_model, example_inputs

    if spec not in available_models():
        raise ValueError(f"unknown model {spec!r}: use one of {', '.join(available_models())} or package.module:factory")
    model = build_model(spec, device="meta", dtype=dtype)
    args, kwargs = example_inputs(spec, batch=batch, device="meta", dtype=dtype)
    return model, args, kwargs, spec


def _add_search_options(r: argparse.ArgumentParser) -> None:
    """The model, the device count and what to search: shared by ``report`` and ``explain``."""
    r.add_argument("model", help="preset name (see `planner models`) or package.module:factory")
    r.add_argument("--devices", type=int, default=None, help="device count (required unless --config names it)")
    r.add_argument("--config", metavar="FILE", default=None,
                   help="a search configuration (TOML or JSON of planner.config.SearchConfig's keys, or a saved plan, whose search it repeats); flags given beside it win")
    r.add_argument("--batch", type=int, default=8, help="global batch size of one step (default 8; --micro-batches splits it for gradient accumulation)")
    r.add_argument("--hardware", default="a100-80g", help=f"preset ({', '.join(PRESETS)}) or a JSON profile file")
    r.add_argument("--memory", type=_bytes_arg, default=None, help="memory budget per device (default: the device's memory), e.g. 40GiB")
    r.add_argument("--tp", type=_list(str, ALL_TP), default=ALL_TP, help="tensor-parallel families to search (comma list of none,1d,2d,3d)")
    for flag in SCHEME_FLAGS:  # each scheme's own (planner.schemes.base.Flag), defaults from SearchConfig
        if flag.switch_off:
            r.add_argument(flag.name, action="store_true", help=flag.help)
        else:
            kind = _list(flag.item, flag.choices) if flag.many else flag.item
            r.add_argument(flag.name, type=kind, default=SearchConfig.model_fields[flag.field].default, help=flag.help)
    r.add_argument("--dp", type=int, default=None, help="fix the data-parallel degree")
    r.add_argument("--objective", choices=("time", "memory", "knee"), default="time",
                   help="which front point is chosen: the fastest, the smallest, or the knee (best balance); default time")
    r.add_argument("--best-only", action="store_true", help="only each configuration's fastest plan (no front sweep): a quicker answer")
    r.add_argument("--resolution", type=_resolution, default=0.05,
                   help="relative memory step between front points, within and across configurations (default 0.05; 0 for every point)")
    r.add_argument("--max-points", type=_max_points, default=8, help="front points per configuration at most (default 8)")
    r.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                   help="fp32, or mixed: compute in bf16/fp16 with float32 master weights and optimizer states (default fp32)")
    r.add_argument("--optimizer", choices=("adamw", "sgd-momentum"), default="adamw", help="optimizer whose states are priced (default adamw)")
    r.add_argument("--gap", type=_fraction("--gap", "the relative MIP gap"), default=1e-6, help="relative MIP gap at which a solve stops as optimal (default 1e-6; a front of resolution r stops its weighted and budgeted MIPs at "
                        f"{SolverSettings.front_gap:g} r if larger: --resolution 0 for the exact front)")
    r.add_argument("--time-limit", type=_seconds("--time-limit"), default=120.0, help="time limit of each ILP solve, seconds (a solve stopped by it is reported as time_limit, not optimal)")
    r.add_argument("--workers", type=_at_least(1, "--workers"), default=1,
                   help="processes solving configurations of a front at once (default 1; 2 on 2 cores: GPT-3 175B's front on 64 devices 20 s -> 14 s; "
                        "--best-only runs serially, which is faster)")
    r.add_argument("--progress", action="store_true",
                   help="show the search's progress on stderr: configurations done, solved/dismissed/infeasible, ETA (a bar when "
                        "stderr is a terminal, which is the default there; a line per configuration otherwise)")
    r.add_argument("-v", "--verbose", action="store_true",
                   help="the whole report (every configuration, the chosen plan's strategies and collectives); log each phase to stderr")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("planner")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake told in two lines: the error, and where the options are (not the
    whole usage block above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="planner", description="Automatic parallelization planner for PyTorch training.")
    p.add_argument("--version", action="version", version=f"planner {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="plan a model: the time/memory front, every configuration, the chosen plan",
                       allow_abbrev=False)  # (--config: a flag given beside it wins, so each must be written whole)
    _add_search_options(r)
    out = r.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON document instead of the text report")
    out.add_argument("--markdown", action="store_true", help="print the report with GitHub markdown tables")
    r.add_argument("--plot", metavar="FILE.png", help="draw the front (every configuration's points, the knee, the choice) into FILE.png")
    r.add_argument("--save-plan", metavar="FILE", help="write the chosen plan as JSON (runtime.compile_plan loads it)")
    e = sub.add_parser("explain", help="why one front point: where its time and memory go, why the alternatives lost", allow_abbrev=False)
    _add_search_options(e)
    e.add_argument("--point", type=_point, default=None, metavar="K",
                   help="the front point to explain, numbered from 1 as in `planner report` (default: the objective's choice)")
    sub.add_parser("models", help="list bundled model presets")
    c = sub.add_parser("calibrate", help="measure this machine (matmuls, op overhead, memory, collectives) and write a profile")
    c.add_argument("--out", required=True, metavar="FILE.json", help="where to write the profile (use it with report --hardware FILE.json)")
    c.add_argument("--quick", action="store_true", help="small sizes and few repeats (under a minute)")
    c.add_argument("--world", type=_at_least(2, "--world", "collectives are timed between at least 2 processes"), default=2,
                   help="processes for the collective benchmarks (default 2)")
    c.add_argument("--name", default=None, help="profile name (default calibrated-cpu / calibrated-gpu)")
    return p


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _SearchBar:
    """The search's progress on stderr: a tqdm bar (configurations done, solved / dismissed /
    infeasible, elapsed and ETA) when stderr is a terminal, a line per configuration otherwise
    (``--progress`` into a log file: no carriage returns); ``-v`` adds the lines above the bar."""

    def __init__(self, *, lines: bool) -> None:
        self.tty = sys.stderr.isatty()
        self.lines = lines or not self.tty
        self.bar: Any = None

    def note(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            _stderr_line(line)

    def __call__(self, p: SearchProgress) -> None:
        if self.tty and self.bar is None:
            from tqdm import tqdm

            # the search's own estimate of the time left (planner.search.SearchProgress.eta_s), not tqdm's
            # rate per configuration: the large configurations come last and take longest
            self.bar = tqdm(total=p.total, desc="configurations", unit="cfg", file=sys.stderr, dynamic_ncols=True, leave=False,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        if self.bar is not None:
            eta = {"ETA": f"{p.eta_s:.0f} s"} if p.eta_s is not None and p.done < p.total else {}
            self.bar.set_postfix({"solved": p.solved, "dismissed": p.dismissed, "infeasible": p.infeasible, **eta}, refresh=False)
            self.bar.update(p.done - self.bar.n)
        if self.lines and p.done:
            self.note(str(p))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _progress(args: argparse.Namespace) -> _SearchBar | None:
    """Progress to stderr when someone watches it (a terminal) or asked (``--progress``, ``-v``)."""
    return _SearchBar(lines=args.verbose) if args.progress or args.verbose or sys.stderr.isatty() else None


@dataclass(frozen=True)
class Searched:
    """A finished search with what the printers need: the traced graph (repeated layers are
    listed once) and the hardware profile (collectives are priced again by ``explain``)."""

    name: str
    graph: IRGraph
    hardware: HardwareProfile
    result: SearchResult
    trace_seconds: float
    config: SearchConfig


def _reader(flag: Flag) -> Callable[[argparse.Namespace], Any]:
    """How a scheme's flag's value is read off the parsed flags."""
    if flag.switch_off:
        return lambda a: not getattr(a, flag.dest)
    return lambda a: getattr(a, flag.dest)


# SearchConfig's fields the CLI sets: the flag that sets each (given flags win over --config FILE)
# and how the field's value is read off the parsed flags
_FLAGS: dict[str, tuple[str, Callable[[argparse.Namespace], Any]]] = {
    "devices": ("--devices", lambda a: a.devices),
    "hardware": ("--hardware", lambda a: a.hardware),
    "memory_budget": ("--memory", lambda a: a.memory),
    "tp": ("--tp", lambda a: a.tp),
    "dp": ("--dp", lambda a: a.dp),
    "objective": ("--objective", lambda a: a.objective),
    "optimizer": ("--optimizer", lambda a: a.optimizer),
    "master_dtype": ("--precision", lambda a: PRECISIONS[a.precision][1]),
    "front": ("--best-only", lambda a: not a.best_only),
    "resolution": ("--resolution", lambda a: a.resolution),
    "max_points": ("--max-points", lambda a: a.max_points),
    "time_limit_s": ("--time-limit", lambda a: a.time_limit),
    "relative_gap": ("--gap", lambda a: a.gap),
} | {flag.field: (flag.name, _reader(flag)) for flag in SCHEME_FLAGS}


def search_config(args: argparse.Namespace) -> SearchConfig:
    """The flags as a :class:`SearchConfig`: over ``--config FILE`` when given (the flags written on
    the command line win; the others come from the file)."""
    values = {key: read(args) for key, (_flag, read) in _FLAGS.items()}
    if args.config is None:
        if args.devices is None:
            raise ValueError("--devices is required (or --config FILE that names devices)")
        return SearchConfig.build("the options", **values)
    words = getattr(args, "argv", [])
    given = {key for key, (flag, _read) in _FLAGS.items() if any(w == flag or w.startswith(flag + "=") for w in words)}
    config = SearchConfig.load(args.config, **{key: values[key] for key in given})
    if config.master_dtype is not None and "master_dtype" not in given:
        raise ValueError(f"{args.config} plans mixed precision (master_dtype = {config.master_dtype!r}): give --precision bf16-mixed or "
                         "fp16-mixed for the dtype the model computes in")
    return config


def run_search(args: argparse.Namespace) -> Searched:
    """Load and trace the model, then search as the options say (``ValueError`` on bad input)."""
    from planner.search import search
    from planner.trace import micro_batch_inputs, trace

    config = search_config(args)
    dtype, _ = PRECISIONS[args.precision]
    model, m_args, m_kwargs, name = load_model(args.model, args.batch, dtype)
    progress = _progress(args)
    t0 = time.perf_counter()
    graph = trace(model, m_args, m_kwargs)
    trace_s = time.perf_counter() - t0
    if progress:
        progress.note(f"traced {name} in {trace_s:.1f} s: {graph.summary()}; searching {config.devices} devices")
    try:
        result = search(graph, config, model_name=name, progress=progress, workers=args.workers,
                        micro_graph=lambda m: trace(model, *micro_batch_inputs(m_args, m_kwargs, m)))
    finally:
        if progress:
            progress.close()
    if progress:
        progress.note(f"searched {len(result.candidates)} configurations in {result.seconds:.1f} s: {len(result.front)} front points")
    return Searched(name, graph, config.hardware, result, trace_s, config)


_NOT_REPEATED = {"--json": 0, "--markdown": 0, "-v": 0, "--verbose": 0, "--progress": 0, "--save-plan": 1, "--plot": 1}


def how_to_run(args: argparse.Namespace, s: Searched) -> list[str]:
    """Two lines: the command that saves this plan (this one's options) and the code that runs it."""
    words: list[str] = []
    skip = 0
    for word in args.argv:
        if skip:
            skip -= 1
            continue
        flag = word.split("=", 1)[0]
        if flag in _NOT_REPEATED:
            skip = _NOT_REPEATED[flag] if "=" not in word else 0
            continue
        words.append(word)
    saved = args.save_plan or "plan.json"
    first = f"Run it: the plan is in {saved}" if args.save_plan else f"Run it: {shlex.join(['planner', *words, '--save-plan', saved])}"
    return [first,
            f"  then in train.py under torchrun --nproc-per-node {s.config.devices}: pm = compile_plan(Plan.model_validate_json(open({saved!r}).read()), model, *batch)",
            f"  (or pm = auto_parallelize(model, devices={s.config.devices}, example_inputs=batch): plans and compiles in one call)"]


def report(args: argparse.Namespace, s: Searched) -> int:
    """Print the report (text, markdown or JSON); write the plot and the chosen plan if asked."""
    from planner.report import format_search, save_front_plot, search_json

    result = s.result
    if args.plot:
        if not result.front:
            _stderr_line(f"planner: no plan fits, so there is no front to plot; {args.plot} not written")
        else:
            try:
                save_front_plot(result, args.plot, title=f"{s.name} on {s.config.devices} devices ({s.hardware.name})")
            except ImportError as exc:
                _stderr_line(f"planner: error: --plot needs matplotlib ({exc}): pip install matplotlib, or the dev extra")
                return 2
            _stderr_line(f"planner: wrote the front plot to {args.plot}")
    if args.save_plan and result.best is not None:
        with open(args.save_plan, "w") as f:
            f.write(result.best.model_dump_json(indent=1))
    if args.json:
        print(json.dumps(search_json(result, model_name=s.name, devices=s.config.devices, hardware=s.hardware), indent=1))
    else:
        print(format_search(result, model_name=s.name, devices=s.config.devices, hardware=s.hardware, trace_seconds=s.trace_seconds,
                            graph=s.graph, markdown=args.markdown, verbose=args.verbose,
                            how_to_run=how_to_run(args, s) if result.best is not None else ()))
    return 0 if result.best is not None else 1


def explain(args: argparse.Namespace, s: Searched) -> int:
    """Print why the chosen (or ``--point``) front point; the search's message when nothing fits."""
    from planner.explain import explain as explain_point

    if s.result.best is None:
        print(s.result.infeasible or "No configuration fits the memory budget.")
        return 1
    print(explain_point(s.result, s.hardware, point=args.point, graph=s.graph))
    return 0


def _writable(path: str, option: str) -> None:
    """``ValueError`` unless ``path`` can be written: checked before a search or a calibration,
    not after it (its answer would be lost)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path}: the folder {folder} does not exist; create it or write elsewhere")
    if os.path.isdir(path) or not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{option} {path} cannot be written (a folder, or no write permission); give a file path you can write")


def _check_outputs(args: argparse.Namespace) -> None:
    """What the report writes at the end, checked before the search starts."""
    if args.save_plan:
        _writable(args.save_plan, "--save-plan")
    if args.plot:
        _writable(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"--plot needs matplotlib ({exc}): pip install matplotlib, or leave --plot out") from exc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "models":
        from planner.models import available_models

        print("\n".join(available_models()))
        return 0
    if args.command == "calibrate":
        from planner.runtime.calibrate import calibrate  # measuring needs processes: runtime, imported here

        try:
            _writable(args.out, "--out")
        except ValueError as exc:
            print(f"planner: error: {exc}", file=sys.stderr)
            return 2

        profile = calibrate(quick=args.quick, world=args.world, name=args.name)
        with open(args.out, "w") as f:
            f.write(profile.model_dump_json(indent=1))
        peaks = ", ".join(f"{k.removeprefix('torch.')} {v / 1e9:.1f} GFLOP/s" for k, v in profile.peak_flops.items())
        print(f"wrote {args.out}: {profile.name}, peak {peaks}, op overhead {profile.op_overhead * 1e6:.1f} us, "
              f"memory {profile.memory_bandwidth / 1e9:.2f} GB/s, link {profile.intra_node.bandwidth / 1e9:.3f} GB/s + {profile.intra_node.latency * 1e6:.0f} us")
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "report":
            _check_outputs(args)
        searched = run_search(args)
        return report(args, searched) if args.command == "report" else explain(args, searched)
    except ValueError as exc:
        print(f"planner: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
