"""Hardware profiles: typed, frozen data with the source of every number.

A profile gives per-device compute (peak FLOP/s per dtype), memory (capacity, bandwidth) and link
tiers: devices of one node talk over the intra-node tier, groups that span nodes pay the
inter-node tier. Efficiencies are the fraction of peak that large kernels and collectives reach,
and ``op_overhead`` the fixed cost of launching one op (what makes many small shards slow); they
are assumptions in the GPU presets and measured by ``planner calibrate`` on the user's machine
(``runtime/calibrate.py``), which writes a profile file ``--hardware FILE`` reads.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class LinkTier(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    bandwidth: float = Field(gt=0, description="bytes/s per device, one direction (alpha-beta 1/beta)")
    latency: float = Field(ge=0, description="seconds per message step (alpha)")


class CollectiveFit(BaseModel):
    """One collective kind as ``planner calibrate`` measured it on this host's tier: the alpha-beta
    fit of its own timings (``latency`` per ring step, ``bandwidth`` 1/beta, under the ring formula
    of :func:`planner.cost.comm_time` for that kind) and, by payload size, the measured time over
    the fitted one (``scale``: (payload bytes, ratio) points, interpolated in log bytes, flat past
    the ends), so the priced time is the measured one at every measured size. On gloo a
    reduce-scatter costs about what an all-reduce does and a 64 MiB all-gather runs at a third of a
    16 MiB one's bandwidth, which one fit for every kind and size cannot say."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    latency: float = Field(ge=0, description="seconds per ring step (alpha)")
    bandwidth: float = Field(gt=0, description="bytes/s (alpha-beta 1/beta)")
    scale: list[tuple[float, float]] = Field(default_factory=list, description="(payload bytes, measured / fitted seconds) points")

    def scale_at(self, nbytes: float) -> float:
        return interpolate_log(self.scale, nbytes, 1.0)


def interpolate_log(points: list[tuple[float, float]], x: float, default: float) -> float:
    """Piecewise linear in log x between the (x, y) ``points`` (sorted by x), flat outside them;
    ``default`` without points or for x <= 0."""
    if not points or x <= 0:
        return default
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    lx = math.log(x)
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            w = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]


def ring_terms(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, bytes a rank sends per payload byte) of collective ``kind`` on a group of
    ``n``: the ring and tree formulas :func:`planner.cost.comm_time` prices collectives by (see
    :mod:`planner.cost`), and by which :func:`fit_alpha_beta` fits ``planner calibrate``'s timings.
    Here, beside the fit, so the runtime's calibration imports the profile's module only."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    if kind in ("broadcast", "reduce"):  # pipelined binomial tree: log2(n) steps, S/b stream
        return math.ceil(math.log2(n)), 1.0
    if kind == "send":  # one point-to-point message between two ranks of the group
        return 1, 1.0
    raise ValueError(f"no cost formula for collective {kind}")


def fit_alpha_beta(rows: list[tuple[str, int, float]], world: int) -> tuple[float, float]:
    """Least squares of t = steps * alpha + volume * S / b over the measured collectives, with
    (steps, volume) = (2(n-1), 2(n-1)/n) for all-reduce and ((n-1), (n-1)/n) for all-gather
    (:func:`ring_terms`), in relative error: each row weighted by 1/t, so a 4 KiB message's
    milliseconds count as much as a 64 MiB one's (unweighted, the large messages decide
    alpha too, and latency-bound plans were priced several times too fast). Returns (alpha
    seconds, b bytes/s). When noise makes the fit unphysical (negative alpha or 1/b), latency
    comes from the smallest message and bandwidth from the largest instead."""
    xs = []
    for kind, nbytes, seconds in rows:
        steps, volume = ring_terms(kind, world)
        xs.append((steps, volume * nbytes, seconds))
    # normal equations for t/t = a * steps/t + c * bytes/t, c = 1/b
    w = [(x / t, y / t) for x, y, t in xs]
    s11 = sum(x * x for x, _ in w)
    s12 = sum(x * y for x, y in w)
    s22 = sum(y * y for _, y in w)
    r1 = sum(x for x, _ in w)
    r2 = sum(y for _, y in w)
    det = s11 * s22 - s12 * s12
    alpha = (r1 * s22 - r2 * s12) / det
    c = (s11 * r2 - s12 * r1) / det
    if c > 0 and alpha >= 0:
        return alpha, 1.0 / c
    # noisy timings (shared cores): latency from the smallest message, bandwidth from the largest
    small = min(xs, key=lambda x: x[1])
    large = max(xs, key=lambda x: x[1])
    alpha = small[2] / small[0]
    return alpha, large[1] / max(large[2] - large[0] * alpha, large[2] / 2)


def fit_collective(rows: list[tuple[str, int, float]], world: int) -> CollectiveFit:
    """One kind's fit: the alpha-beta of :func:`fit_alpha_beta` over its rows, and at each
    measured payload the measured time over the fitted one (so the priced time is the measured
    one at every measured size on ``world`` ranks)."""
    alpha, b = fit_alpha_beta(rows, world)
    points = []
    for kind, nbytes, seconds in sorted(rows, key=lambda r: r[1]):
        steps, volume = ring_terms(kind, world)
        points.append((float(nbytes), seconds / (steps * alpha + volume * nbytes / b)))
    return CollectiveFit(latency=alpha, bandwidth=b, scale=points)


class HardwareProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    device_memory: int = Field(gt=0, description="bytes of device memory")
    peak_flops: dict[str, float] = Field(min_length=1, description="dense FLOP/s by dtype name, e.g. 'torch.bfloat16'")
    memory_bandwidth: float = Field(gt=0, description="bytes/s")
    devices_per_node: int = Field(ge=1)
    intra_node: LinkTier
    inter_node: LinkTier
    compute_efficiency: float = Field(0.6, gt=0, le=1, description="fraction of peak FLOP/s large matmuls reach")
    bandwidth_efficiency: float = Field(0.8, gt=0, le=1, description="fraction of link bandwidth collectives reach")
    op_overhead: float = Field(5e-6, ge=0, description="seconds per op launch (forward + backward counted as 3 launches)")
    matmul_efficiency: dict[str, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="by dtype, (FLOPs of one matmul, fraction of peak it reaches beyond the launch cost) points, "
        "interpolated in log FLOPs and held flat past the ends; measured by planner calibrate. "
        "A dtype without points uses compute_efficiency at every size",
    )
    matmul_thin: dict[str, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="by dtype, (thinnest dimension of a matmul, fraction of the square curve's efficiency it reaches) "
        "points, interpolated in log size; measured by planner calibrate (a [16, 4096] x [4096, 4096] matmul runs at "
        "about half a square one's FLOP/s on a CPU). A dtype without points: 1",
    )
    collectives: dict[str, CollectiveFit] = Field(
        default_factory=dict,
        description="by collective kind ('all_reduce', 'all_gather', 'reduce_scatter', 'broadcast'), its own fit on the "
        "intra-node tier, measured by planner calibrate; a kind without one, and every group that spans nodes, uses its tier",
    )
    optimizer_steps: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="by optimizer ('adamw', 'sgd-momentum'), (seconds per parameter tensor, seconds per updated byte) of "
        "torch's own optimizer step, measured by planner calibrate; one without uses the memory-bandwidth estimate",
    )
    overlap_efficiency: float = Field(
        1.0,
        ge=0,
        le=1,
        description="fraction of an asynchronous collective's time that hides behind compute running beside it "
        "(1: NCCL on its own stream, as DDP's buckets run; measured by planner calibrate: on a CPU host gloo's thread "
        "shares the cores with compute)",
    )
    sources: dict[str, str] = Field(default_factory=dict, description="where each number comes from")

    def flops(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("torch.float32", min(self.peak_flops.values()))

    def efficiency(self, dtype: str, flops: float) -> float:
        """Fraction of ``peak_flops[dtype]`` one matmul of ``flops`` FLOPs reaches, its launch cost
        apart. Small matmuls run below peak for two reasons: the fixed launch cost (``op_overhead``,
        priced separately: Hockney's half-performance model t = (F + F_half) / r_inf is exactly a
        fixed start-up cost) and poorer blocking/caching of small tiles, which the calibrated points
        carry. Piecewise linear in log F between measured points, flat outside them."""
        points = self.matmul_efficiency.get(dtype) or self.matmul_efficiency.get("torch.float32")
        return interpolate_log(points or [], flops, self.compute_efficiency)

    def thin_factor(self, dtype: str, thinnest: float) -> float:
        """The share of :meth:`efficiency` a matmul keeps whose thinnest dimension (rows, inner
        or output columns) is ``thinnest``: what a square matmul of the same FLOPs reaches is not
        what a skinny one does (its weight streams from memory once per few rows)."""
        points = self.matmul_thin.get(dtype) or self.matmul_thin.get("torch.float32")
        return interpolate_log(points or [], thinnest, 1.0)

    def tier(self, spans_nodes: bool) -> LinkTier:
        return self.inter_node if spans_nodes else self.intra_node


GB = 1e9
GiB = 1024**3

A100_80G = HardwareProfile(
    name="a100-80g",
    device_memory=80 * GiB,
    peak_flops={
        "torch.bfloat16": 312e12,
        "torch.float16": 312e12,
        "torch.float32": 156e12,  # TF32 tensor cores
        "torch.float64": 19.5e12,
    },
    memory_bandwidth=2039 * GB,
    devices_per_node=8,
    intra_node=LinkTier(name="nvlink3-nvswitch", bandwidth=300 * GB, latency=5e-6),
    inter_node=LinkTier(name="ib-hdr-200g", bandwidth=25 * GB, latency=10e-6),
    sources={
        "peak_flops": "NVIDIA A100 datasheet (dense, SXM4 80GB): BF16/FP16 312 TFLOPS, TF32 156, FP64 TC 19.5",
        "memory_bandwidth": "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e",
        "intra_node": "NVLink 3 via NVSwitch: 600 GB/s bidirectional per GPU = 300 GB/s each way (DGX A100)",
        "inter_node": "DGX A100: one 200 Gb/s HDR InfiniBand HCA per GPU = 25 GB/s each way",
        "latency": "assumed: ~5 us NVLink, ~10 us InfiniBand per ring step (NCCL-tests small-message order)",
        "compute_efficiency": "assumed 0.6 of peak for large matmuls until calibrated",
        "bandwidth_efficiency": "assumed 0.8 of link bandwidth (NCCL bus bandwidth) until calibrated",
    },
)

V100_16G = HardwareProfile(
    name="v100-16g",
    device_memory=16 * GiB,
    peak_flops={
        "torch.float16": 125e12,
        "torch.bfloat16": 125e12 / 8,  # no bf16 tensor cores on Volta: CUDA-core rate, counted as fp32
        "torch.float32": 15.7e12,
        "torch.float64": 7.8e12,
    },
    memory_bandwidth=900 * GB,
    devices_per_node=4,
    intra_node=LinkTier(name="nvlink2", bandwidth=75 * GB, latency=5e-6),
    inter_node=LinkTier(name="ib-edr-100g", bandwidth=12.5 * GB, latency=10e-6),
    sources={
        "peak_flops": "NVIDIA V100 SXM2 datasheet: FP16 tensor 125 TFLOPS, FP32 15.7, FP64 7.8",
        "memory_bandwidth": "NVIDIA V100 SXM2 16GB datasheet: 900 GB/s HBM2",
        "intra_node": "4 x V100 with NVLink 2 (the 64-GPU cluster class of Bian et al. 2021): 3 links x 25 GB/s each way between a pair, about 75 GB/s",
        "inter_node": "one 100 Gb/s EDR InfiniBand HCA per node shared by 4 GPUs: 12.5 GB/s each way per node",
        "latency": "assumed: ~5 us NVLink, ~10 us InfiniBand per ring step",
        "compute_efficiency": "assumed 0.6 of peak for large matmuls until calibrated",
        "bandwidth_efficiency": "assumed 0.8 of link bandwidth until calibrated",
        "op_overhead": "assumed 5 us per CUDA kernel launch (typical eager-mode launch latency) until calibrated",
    },
)

H100_80G = HardwareProfile(
    name="h100-80g",
    device_memory=80 * GiB,
    peak_flops={
        "torch.bfloat16": 989e12,
        "torch.float16": 989e12,
        "torch.float32": 494.7e12,  # TF32 tensor cores
        "torch.float64": 66.9e12,
    },
    memory_bandwidth=3350 * GB,
    devices_per_node=8,
    intra_node=LinkTier(name="nvlink4-nvswitch", bandwidth=450 * GB, latency=5e-6),
    inter_node=LinkTier(name="ib-ndr-400g", bandwidth=50 * GB, latency=10e-6),
    sources={
        "peak_flops": "NVIDIA H100 SXM5 datasheet (dense): BF16/FP16 989 TFLOPS, TF32 494.7, FP64 TC 66.9",
        "memory_bandwidth": "NVIDIA H100 SXM5 80GB datasheet: 3.35 TB/s HBM3",
        "intra_node": "NVLink 4 via NVSwitch: 900 GB/s bidirectional per GPU = 450 GB/s each way (DGX H100)",
        "inter_node": "DGX H100: one 400 Gb/s NDR InfiniBand port per GPU = 50 GB/s each way",
        "latency": "assumed: ~5 us NVLink, ~10 us InfiniBand per ring step",
        "compute_efficiency": "assumed 0.6 of peak for large matmuls until calibrated",
        "bandwidth_efficiency": "assumed 0.8 of link bandwidth until calibrated",
        "op_overhead": "assumed 5 us per CUDA kernel launch (typical eager-mode launch latency) until calibrated",
    },
)

H200_141G = H100_80G.model_copy(
    update={
        "name": "h200-141g",
        "device_memory": 141 * 10**9,
        "memory_bandwidth": 4800 * GB,
        "sources": {
            **H100_80G.sources,
            "device_memory": "NVIDIA H200 SXM datasheet: 141 GB HBM3e (compute as H100 SXM)",
            "memory_bandwidth": "NVIDIA H200 SXM datasheet: 4.8 TB/s",
        },
    }
)

A100_40G = A100_80G.model_copy(
    update={
        "name": "a100-40g",
        "device_memory": 40 * GiB,
        "memory_bandwidth": 1555 * GB,
        "sources": {
            **A100_80G.sources,
            "device_memory": "NVIDIA A100 SXM4 40GB datasheet: 40 GB HBM2 (compute and links as the 80 GB SXM4)",
            "memory_bandwidth": "NVIDIA A100 SXM4 40GB datasheet: 1,555 GB/s",
        },
    }
)

CPU_GLOO = HardwareProfile(
    name="cpu-gloo",
    device_memory=6 * GiB,
    peak_flops={"torch.float32": 50e9, "torch.float64": 28e9, "torch.bfloat16": 5e9, "torch.float16": 2e9},
    memory_bandwidth=11.5 * GB,
    devices_per_node=4,
    intra_node=LinkTier(name="gloo-tcp-loopback", bandwidth=1.2 * GB, latency=800e-6),
    inter_node=LinkTier(name="gloo-tcp-1gbe", bandwidth=0.125 * GB, latency=100e-6),
    compute_efficiency=1.0,
    bandwidth_efficiency=1.0,
    op_overhead=4e-6,
    sources={
        "what": "4 processes sharing a 2-core CPU host (24 GB) and talking gloo over TCP: the CI/test machines; "
        "rounded from `planner calibrate --quick --world 4` there on 2026-11-30; calibrate your own machine for real use",
        "peak_flops": "measured per process with 4 running at once: float32 matmul 53.5 GFLOP/s (n=256), float64 28.5 (n=512); "
        "bf16/fp16 have no fast CPU kernels there (assumed 5 and 2 GFLOP/s)",
        "device_memory": "24 GB host RAM / 4 processes, rounded down",
        "memory_bandwidth": "measured: 64 MiB copy per process with 4 at once, 11.5 GB/s",
        "intra_node": "measured: alpha-beta fit (relative error) of gloo all-reduce/all-gather timings, 4 processes, 4 KiB-64 MiB: 1.29 GB/s",
        "latency": "measured with the fit above: 0.79 ms per ring step (loopback TCP, oversubscribed cores); 1 GbE assumed 100 us",
        "inter_node": "assumed: gloo across hosts over 1 Gb Ethernet, 125 MB/s",
        "compute_efficiency": "1.0: peak_flops is what the matmuls reached",
        "bandwidth_efficiency": "1.0: the link bandwidth is what the collectives reached",
        "op_overhead": "measured: average one-element add, 3.6 us per process with 4 at once",
    },
)

PRESETS: dict[str, HardwareProfile] = {p.name: p for p in (A100_80G, A100_40G, V100_16G, H100_80G, H200_141G, CPU_GLOO)}


def load_profile(name_or_path: str) -> HardwareProfile:
    """A preset by name, or a JSON profile file (as written by ``planner calibrate``)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ValueError(f"hardware profile file {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"hardware profile file {path} is not JSON ({exc}); write one with planner calibrate --out FILE.json") from exc
        try:
            return HardwareProfile.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()[:4])
            more = f" (and {exc.error_count() - 4} more)" if exc.error_count() > 4 else ""
            raise ValueError(f"hardware profile file {path} is not a profile: {problems}{more}; write one with planner calibrate "
                             f"--out FILE.json, or start from a preset's fields (planner.hardware.PRESETS)") from None
    raise ValueError(f"unknown hardware {name_or_path!r}: use one of {sorted(PRESETS)} or a JSON profile file")
