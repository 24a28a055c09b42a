"""``planner calibrate``: measure this machine and write the hardware profile the planner prices with.

Micro-benchmarks, with every process measuring at once; the compute ones (matmuls to the
optimizer step) run in interleaved passes, each figure the median over the passes and then over
the processes:
* matmul throughput by size and dtype: ``C = A @ B`` for square n x n, 2 n^3 FLOPs, averaged
  over a fixed time with every process measuring at once; the best FLOP/s over the sizes becomes
  ``peak_flops[dtype]`` with ``compute_efficiency = 1`` (the peak is what was reached), and each
  size's fraction of it, launch cost taken out, becomes ``matmul_efficiency[dtype]`` (the planner
  prices small tensor-parallel shards with it);
* thin matmuls (d rows, or an inner dimension of d, against 2048 x 2048): the share of the
  square curve's efficiency they reach, by d (``matmul_thin``);
* op overhead: a chain of one-element matmuls and multiplies through autograd, forward and
  backward, per op over its 3 launches (what every op pays however small);
* memory bandwidth: a 64 MiB copy (read + write), averaged;
* the optimizer step (AdamW, SGD with momentum) as torch runs it by default: seconds per
  parameter tensor and per updated byte (:func:`measure_optimizer_steps`);
* collectives over ``world`` processes on this host (NCCL on GPUs, gloo on CPUs), in the forms
  the runtime issues (in-place all-reduce, list all-gather and reduce-scatter, broadcast), by
  size: a least-squares fit of the alpha-beta ring formulas of :mod:`planner.cost` over the
  all-reduces and all-gathers gives the link tier's latency (alpha) and bandwidth (1/beta), with
  ``bandwidth_efficiency = 1``, and each kind gets its own fit and measured / fitted ratio by payload
  (``HardwareProfile.collectives``: on gloo a reduce-scatter is no cheaper than an all-reduce).
  On a CPU each is issued after a burst of compute, as training issues it (ranks sharing cores
  wait for peers the scheduler has not run yet), and timed from its call to its return.
  One host cannot measure an inter-node link: the profile copies the measured tier and says so
  in ``sources``.

``quick`` keeps sizes and repeats small (well under a minute on a 2-core CPU).
"""

from __future__ import annotations

import functools
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from planner.hardware import HardwareProfile, LinkTier, fit_alpha_beta, fit_collective, interpolate_log
from planner.runtime.host_memory import keep_freed_memory


def _progress(text: str) -> None:
    print(f"calibrate: {text}", file=sys.stderr, flush=True)


def _time(fn: Callable[[], Any], repeats: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def _rate(fn: Callable[[], Any], min_seconds: float, device: torch.device) -> float:
    """Calls per second of ``fn`` over at least ``min_seconds`` (an average: when processes share
    cores, each one's fair share, not the luckiest moment)."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return calls / elapsed


def measure_matmul(dtype: torch.dtype, sizes: list[int], device: torch.device, min_seconds: float,
                   sync: Callable[[], Any] | None = None) -> list[tuple[int, float]]:
    """(n, FLOP/s) of n x n x n matmuls, averaged over ``min_seconds`` per size. ``sync`` (a
    barrier) before each size: processes sharing cores measure each size together, or the
    last ones to run a size get the cores the others have left (the best size's figure was
    then up to 1.5x the fair share: 45.5 to 68.8 GFLOP/s between runs here)."""
    out = []
    for n in sizes:
        if sync is not None:
            sync()
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)

        def mm(a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
            return torch.matmul(a, b)

        out.append((n, 2 * n**3 * _rate(mm, min_seconds, device)))
    return out


def measure_thin_matmul(dtype: torch.dtype, thin: list[int], device: torch.device, min_seconds: float, wide: int = 2048,
                        sync: Callable[[], Any] | None = None) -> list[tuple[int, float, float]]:
    """(d, FLOPs, FLOP/s) of matmuls whose thinnest dimension is d, by the mean time of the two
    shapes training runs: d rows times a [wide, wide] weight (forward, the input's gradient) and
    an inner dimension of d (the weight's gradient). ``sync`` (a barrier) before each shape."""
    out = []
    for d in thin:
        rates = []
        for shape_a, shape_b in (((d, wide), (wide, wide)), ((wide, d), (d, wide))):
            a = torch.randn(*shape_a, dtype=dtype, device=device)
            b = torch.randn(*shape_b, dtype=dtype, device=device)

            def mm(a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
                return torch.matmul(a, b)

            if sync is not None:
                sync()
            rates.append(_rate(mm, min_seconds, device))
        flops = 2.0 * d * wide * wide
        seconds = sum(1 / r for r in rates) / len(rates)
        out.append((d, flops, flops / seconds))
    return out


def thin_factors(points: list[tuple[int, float, float]], curve: list[tuple[float, float]], peak: float, overhead: float) -> list[tuple[float, float]]:
    """(d, share of the square curve's efficiency) of each thin matmul measured: its own
    efficiency beyond the launch cost, F / ((t - o) peak), over the curve's at its FLOPs; at most 1."""
    out = []
    for d, flops, rate in points:
        own = flops / (max(flops / rate - overhead, flops / peak) * peak)
        out.append((float(d), min(1.0, own / interpolate_log(curve, flops, 1.0))))
    return out


def measure_op_overhead(device: torch.device, min_seconds: float = 0.05, ops: int = 64) -> float:
    """The fixed cost of one op launch as training pays it: a chain of ``ops`` one-element ops
    through autograd, forward and backward, half of them matmuls with a parameter of their own
    (backward: two matmuls and a gradient accumulation) and half elementwise (one launch back),
    per op, over the 3 launches :func:`planner.cost.compute_time` charges an op. A bare
    ``x.add_(1)`` (what this measured before) costs about a quarter of that: it has no autograd
    node, no saved tensor and no gradient to accumulate."""
    weights = [torch.ones(1, 1, device=device, requires_grad=True) for _ in range(ops // 2)]
    x = torch.ones(1, 1, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for w in weights:
            y = (y @ w) * 1.0
        y.sum().backward()

    return 1.0 / _rate(chain, min_seconds, device) / (len(weights) * 2) / 3


def measure_memory_bandwidth(device: torch.device, min_seconds: float) -> float:
    src = torch.ones(64 * 2**20 // 4, dtype=torch.float32, device=device)  # pages touched: no zero-page shortcut
    dst = torch.zeros_like(src)
    return 2 * src.numel() * 4 * _rate(lambda: dst.copy_(src), min_seconds, device)


OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}


def measure_optimizer_steps(device: torch.device, min_seconds: float, large: int = 2**22) -> dict[str, tuple[float, float]]:
    """(seconds per parameter tensor, seconds per updated byte) of each optimizer's ``step()`` as
    torch runs it by default on ``device``: solved from two float32 parameter lists, 64 tensors of
    4 KiB (the per-tensor cost) and 4 of ``large`` values (the per-byte cost)."""
    out = {}
    for name, make in OPTIMIZERS.items():
        timings = []
        for count, numel in ((64, 1024), (4, large)):
            params = [torch.ones(numel, device=device, requires_grad=True) for _ in range(count)]
            for q in params:
                q.grad = torch.full_like(q, 1e-3)
            opt = make(params)
            timings.append((count, count * numel * 4, 1.0 / _rate(opt.step, min_seconds, device)))
            del opt, params
        (n1, b1, t1), (n2, b2, t2) = timings
        per_byte = max((t2 - t1 * n2 / n1) / (b2 - b1 * n2 / n1), 0.0)
        out[name] = (max((t1 - per_byte * b1) / n1, 0.0), per_byte)
    return out


# the collectives the runtime issues, in the form it issues them (list all-gather and
# reduce-scatter: runtime.collectives, runtime.buckets), with the payload planner.cost counts:
# all-reduce and broadcast the tensor, all-gather its output, reduce-scatter its input
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _collective_call(kind: str, payload: int, world: int, device: torch.device) -> Callable[[], Any]:
    import torch.distributed as dist

    if kind in ("all_reduce", "broadcast"):
        t = torch.ones(payload // 4, dtype=torch.float32, device=device)
        return (lambda: dist.all_reduce(t)) if kind == "all_reduce" else (lambda: dist.broadcast(t, src=0))
    full = torch.ones(payload // 4 // world * world, dtype=torch.float32, device=device)
    chunk = torch.empty(full.numel() // world, dtype=torch.float32, device=device)
    if kind == "all_gather":
        parts = list(full.chunk(world))
        return lambda: dist.all_gather(parts, chunk)
    inputs = list(full.chunk(world))
    return lambda: dist.reduce_scatter(chunk, inputs)


def _compute_pass(device: torch.device, compute: dict[str, Any], sync: Callable[[], Any]) -> dict[str, Any]:
    """One pass of the compute measurements, each started together on every process (``sync``)."""
    seconds = compute["seconds"]
    curves = {str(dt): measure_matmul(dt, compute["sizes"], device, seconds, sync) for dt in compute["dtypes"]}
    thin = {str(dt): measure_thin_matmul(dt, compute["thin"], device, seconds / 2, sync=sync) for dt in compute["dtypes"]}
    sync()
    overhead = measure_op_overhead(device, seconds)
    sync()
    bandwidth = measure_memory_bandwidth(device, seconds)
    sync()
    return {"matmul": curves, "thin": thin, "op_overhead": overhead, "memory_bandwidth": bandwidth,
            "optimizers": measure_optimizer_steps(device, seconds)}


def median_of(samples: list[Any]) -> Any:
    """The element-wise median of measurements of one structure (dicts, lists and tuples of numbers;
    the sizes they carry are the same in every sample and stay as they are)."""
    first = samples[0]
    if isinstance(first, dict):
        return {k: median_of([s[k] for s in samples]) for k in first}
    if isinstance(first, list | tuple):
        return type(first)(median_of([s[i] for s in samples]) for i in range(len(first)))
    return statistics.median(samples)


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, backend: str, compute: dict[str, Any], out: Any) -> None:
    try:
        _benchmark(rank, world, port, sizes, repeats, backend, compute, out)
    except BaseException as exc:  # tell the parent instead of leaving it waiting on the queue
        out.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def _benchmark(rank: int, world: int, port: int, sizes: list[int], repeats: int, backend: str, compute: dict[str, Any], out: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # all_gather_object's buffers on this process's own GPU
    else:  # the malloc settings training runs with (compile_plan sets them)
        keep_freed_memory()
    # compute, measured on every process at once: what one "device" gets while all of them work;
    # in interleaved passes, each quantity the median over the passes and then over the ranks (on
    # shared cores one short window can catch a rank with a core to itself: the op overhead read
    # 6.4 and 16.5 us in two calibrations of this host, a size's matmuls up to 1.4x the others')
    passes = []
    for _ in range(compute["rounds"]):
        dist.barrier()
        passes.append(_compute_pass(device, compute, dist.barrier))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, median_of(passes))
    measured = median_of(gathered)
    rows: list[Any] = []
    for kind in COLLECTIVE_KINDS:  # connections and buffers set up before anything is timed
        warm = _collective_call(kind, 4096 * world, world, device)
        for _ in range(3):
            warm()
    # on a CPU host the ranks share cores: a collective issued after compute waits for peers the
    # scheduler has not run yet, which one issued straight after a barrier does not see (on 4
    # ranks of 2 cores, a 4 KiB all-reduce after 15 ms of matmuls costs 7-11 ms, after a barrier
    # 5 ms). So each collective is issued as training issues it, after a burst of compute, and
    # timed from its call to its return. (It was timed with the burst, less the burst's median
    # alone: a difference of two noisy figures, whose all-reduce latency fit read 1.1 and 3.0 ms
    # in two calibrations of this host.)
    burst_a = torch.randn(256, 256, device=device)

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.matmul(burst_a, burst_a)

    def burst() -> None:
        matmuls(compute["burst"])

    busy = device.type == "cpu" and compute["burst"] > 0
    for nbytes in sizes:
        for kind in COLLECTIVE_KINDS:
            fn = _collective_call(kind, nbytes, world, device)
            fn()
            times = []
            for _ in range(repeats):
                dist.barrier()
                if busy:
                    burst()
                times.append(min(_time(fn, 1, device)))
            rows.append((kind, nbytes, max(statistics.median(times), 1e-6)))
            del fn
    overlap = measure_overlap(compute["overlap_sizes"], repeats, device, dist.barrier, matmuls, burst)
    if rank == 0:
        out.put(dict(measured, overlap=overlap, collectives=rows))
    dist.barrier()
    dist.destroy_process_group()


def measure_overlap(sizes: list[int], repeats: int, device: torch.device, sync: Callable[[], Any], matmuls: Callable[[int], None],
                    burst: Callable[[], None]) -> list[tuple[int, float, float, float]]:
    """(payload, compute seconds, all-reduce seconds, both seconds) per payload: an all-reduce
    alone, ``matmuls(n)`` alone with n sized to take about as long, and the all-reduce started
    asynchronously with the matmuls running beside it until both are done (as a gradient bucket
    runs beside backward); each timed after a ``burst`` of compute, as the other collectives.
    Medians over ``repeats``, every rank at once."""
    import torch.distributed as dist

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        burst()  # as training issues it: after compute (see the collectives above)
        return min(_time(fn, 1, device))

    one = statistics.median(timed(lambda: matmuls(1)) for _ in range(repeats))
    out = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(t)

        def reduce(t: torch.Tensor = t) -> None:
            dist.all_reduce(t)

        comm = statistics.median(timed(reduce) for _ in range(repeats))
        n = max(1, round(comm / max(one, 1e-9)))
        held = torch.tensor([float(n)], device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)  # one burst size on every rank
        n = int(held.item())
        alone = statistics.median(timed(functools.partial(matmuls, n)) for _ in range(repeats))

        def both(t: torch.Tensor = t, n: int = n) -> None:
            work = dist.all_reduce(t, async_op=True)
            matmuls(n)
            assert work is not None
            work.wait()

        together = statistics.median(timed(both) for _ in range(repeats))
        out.append((nbytes, alone, comm, together))
    return out


def overlap_efficiency(points: list[tuple[int, float, float, float]]) -> float:
    """The share of the shorter of compute and communication that running them together hides,
    (c + m - both) / min(c, m), the median over the payloads, within [0, 1]."""
    if not points:
        return 1.0
    shares = [(c + m - both) / max(min(c, m), 1e-12) for _, c, m, both in points]
    return min(1.0, max(0.0, statistics.median(shares)))


def measure_on_world(world: int, sizes: list[int], repeats: int, backend: str, compute: dict[str, Any]) -> dict[str, Any]:
    """Start ``world`` processes; each measures compute (all at once), then the collectives."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_collective_worker, args=(r, world, port, sizes, repeats, backend, compute, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    if isinstance(result, str):
        for p in procs:
            p.terminate()
            p.join()
        raise RuntimeError(f"a calibration process failed: {result}")
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a benchmark process exited with code {p.exitcode}")
    return result  # type: ignore[no-any-return]


def matmul_efficiency(curve: list[tuple[int, float]], peak: float, overhead: float) -> list[tuple[float, float]]:
    """(FLOPs, fraction of peak) of each measured n x n x n matmul, its launch cost taken out (the
    planner prices t = o + F / (eff * peak), :func:`planner.cost.compute_time`): eff = F / ((t - o)
    peak) with t = F / measured FLOP/s, at most 1."""
    points = []
    for n, rate in sorted(curve):
        flops = 2.0 * n**3
        busy = max(flops / rate - overhead, flops / peak)
        points.append((flops, min(1.0, flops / (busy * peak))))
    return points


def calibrate(*, quick: bool = False, world: int = 2, name: str | None = None) -> HardwareProfile:
    """Measure with ``world`` processes running at once (as the plans will run: on a CPU host they
    share its cores, so each gets its share of the compute; GPUs are measured one per process)."""
    gpu = torch.cuda.is_available()
    world = max(1, min(world, torch.cuda.device_count()) if gpu else world)
    repeats = 5 if quick else 10
    sizes = [64, 128, 256, 512] if quick else [64, 128, 256, 512, 1024, 2048] + ([4096, 8192] if gpu else [])
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if gpu else [torch.float32, torch.float64]
    coll_sizes = [2**12, 2**18, 2**22] if quick else [2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26]
    backend = "nccl" if gpu else "gloo"
    _progress(f"{world} {backend} processes: matmul {[str(d).removeprefix('torch.') for d in dtypes]} n={sizes}, op overhead, "
              f"memory bandwidth, optimizer steps, then {', '.join(COLLECTIVE_KINDS)} of {coll_sizes} B")
    thin = [16, 128] if quick else [8, 16, 32, 64, 128, 256, 512]
    compute = {"sizes": sizes, "thin": thin, "dtypes": dtypes, "seconds": 0.1 if quick else 0.3, "rounds": 2 if quick else 3, "burst": 20,
               "overlap_sizes": [2**20] if quick else [2**20, 2**22, 2**24]}
    measured = measure_on_world(world, coll_sizes, repeats, backend, compute)
    peak = {dt: max(f for _, f in curve) for dt, curve in measured["matmul"].items()}
    curves = {f"matmul {dt}": ", ".join(f"n={n}: {f / 1e9:.1f} GFLOP/s" for n, f in curve) for dt, curve in measured["matmul"].items()}
    rows = [tuple(r) for r in measured["collectives"]]
    tier_rows = [r for r in rows if r[0] in ("all_reduce", "all_gather")]
    alpha, link_bw = fit_alpha_beta(tier_rows, world) if world >= 2 else (0.0, measured["memory_bandwidth"])  # type: ignore[arg-type]
    fits = {kind: fit_collective([r for r in rows if r[0] == kind], world) for kind in COLLECTIVE_KINDS} if world >= 2 else {}  # type: ignore[misc]
    optimizers = {name: (float(a), float(c)) for name, (a, c) in measured["optimizers"].items()}
    overlap_points = [tuple(p) for p in measured["overlap"]] if world >= 2 else []
    overlap = overlap_efficiency(overlap_points)  # type: ignore[arg-type]
    overhead, bandwidth = measured["op_overhead"], measured["memory_bandwidth"]
    efficiency = {dt: matmul_efficiency(curve, peak[dt], overhead) for dt, curve in measured["matmul"].items()}
    thin_points = {dt: thin_factors([tuple(p) for p in points], efficiency[dt], peak[dt], overhead) for dt, points in measured["thin"].items()}  # type: ignore[misc]
    _progress(f"fitted link: {link_bw / 1e9:.3f} GB/s, latency {alpha * 1e6:.0f} us")
    memory = torch.cuda.get_device_properties(0).total_memory if gpu else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world
    tier = LinkTier(name=f"{backend}-measured", bandwidth=link_bw, latency=alpha)
    when = time.strftime("%Y-%m-%d")
    host = torch.cuda.get_device_name(0) if gpu else f"{os.cpu_count()}-core CPU"
    note = f"measured by planner calibrate{' --quick' if quick else ''} on {when}, {host}, {world} processes at once"
    return HardwareProfile(
        name=name or ("calibrated-" + ("gpu" if gpu else "cpu")),
        device_memory=int(memory),
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        devices_per_node=world,
        intra_node=tier,
        inter_node=tier,
        compute_efficiency=1.0,
        bandwidth_efficiency=1.0,
        op_overhead=overhead,
        matmul_efficiency=efficiency,
        matmul_thin=thin_points,
        collectives=fits,
        optimizer_steps=optimizers,
        overlap_efficiency=overlap,
        sources={
            "peak_flops": f"{note}: best matmul FLOP/s over the sizes",
            **curves,
            "matmul_efficiency": f"{note}: per size, FLOPs / ((t - op_overhead) * peak) of the matmul timings above",
            "matmul_thin": f"{note}: d x 2048 by 2048 x 2048 and 2048 x d by d x 2048 matmuls, their efficiency over the square curve's: "
            + "; ".join(f"{dt} " + ", ".join(f"d={int(d)}: {f:.2f}" for d, f in pts) for dt, pts in thin_points.items()),
            "op_overhead": f"{note}: one-element matmul and multiply chain through autograd, forward and backward, per op / 3 launches, {overhead * 1e6:.1f} us",
            "optimizer_steps": f"{note}: torch's default step, 64 x 4 KiB and 4 x 16 MiB float32 tensors: "
            + ", ".join(f"{k} {a * 1e6:.1f} us per tensor + {1 / c / 1e9 if c else float('inf'):.2f} GB/s" for k, (a, c) in optimizers.items()),
            "collectives": f"{note}: per kind, alpha-beta fit of its own timings and its measured / fitted ratio by payload: "
            + "; ".join(f"{k} {f.bandwidth / 1e9:.3f} GB/s + {f.latency * 1e6:.0f} us" for k, f in fits.items()),
            "overlap_efficiency": f"{note}: an asynchronous all-reduce beside as many 256 x 256 matmuls as take about as long, "
            "(compute + all-reduce - both) / min(compute, all-reduce), median over payloads: "
            + (", ".join(f"{b >> 10} KiB: {c * 1e3:.1f} + {m * 1e3:.1f} ms alone, {both * 1e3:.1f} ms together" for b, c, m, both in overlap_points)  # type: ignore[misc]
               or "one process: not measured, 1"),
            "memory_bandwidth": f"{note}: 64 MiB copy, {bandwidth / 1e9:.2f} GB/s",
            "intra_node": f"{note}: alpha-beta fit of {len(tier_rows)} {backend} all-reduce/all-gather timings"
            + "".join(f"; {k} {b} B {t * 1e3:.3f} ms" for k, b, t in rows),
            "inter_node": "not measured (one host): a copy of the measured tier",
            "device_memory": "GPU total memory" if gpu else f"host RAM / {world} processes",
        },
    )
