"""The analytic cost model: seconds for compute and collectives, bytes for memory.

Compute (roofline, Williams et al. 2009): an op's time is the larger of its FLOPs over achieved
FLOP/s and the bytes it touches over memory bandwidth,

    t_op = 3 o + max(F_local / (eff(dtype, F_fwd_local) * peak[dtype]), 3 * B_local / bw_mem)

with F_local its forward+backward FLOPs divided by the number of ways its work is split and
B_local the local bytes of its inputs and output (the factor 3: forward reads/writes them once,
backward about twice), and ``o`` the fixed launch cost of one op (``op_overhead``: one forward
and about two backward launches). The fixed cost is what makes high tensor-parallel degrees slow
on small shards: F_local shrinks with the degree, the launches do not. ``eff`` is the fraction of
peak one matmul of that size reaches beyond its launch cost (:meth:`HardwareProfile.efficiency`:
a constant in the presets, a curve measured by ``planner calibrate``), which also falls for small
shards: tiles too small to block well.

Collectives (alpha-beta, ring algorithms; Thakur, Rabenseifner & Gropp 2005), for a group of
``n`` ranks, payload ``S`` bytes per rank (all-reduce: the tensor; all-gather: the gathered
output; reduce-scatter: the full input), link bandwidth ``b`` and latency ``a`` of the slowest
tier the group spans:

    all_reduce:     2 (n-1) a + 2 (n-1)/n * S / b
    all_gather:       (n-1) a +   (n-1)/n * S / b
    reduce_scatter:   (n-1) a +   (n-1)/n * S / b
    broadcast, reduce: ceil(log2 n) a + S / b        (pipelined tree, large messages)
    send:                        a + S / b        (one point-to-point message, CDP's chain)
    all_to_all:       (n-1) a +   (n-1)/n * S / b    (pairwise exchange, S the local tensor)

Optimizer step (memory-bound): t = traffic * updated bytes / bw_mem + ops * o per parameter
tensor (:func:`optimizer_step_time`; AdamW touches 11 bytes per byte it updates).

Memory per device (bytes): parameters, gradients and optimizer states of the local parameter
shards (fp32 AdamW: 4 + 4 + 8 bytes per value; SGD with momentum 4 + 4 + 4; mixed precision
(Micikevicius et al. 2018), parameters and gradients in the compute dtype and a float32 master copy
with float32 states in the optimizer: bf16 AdamW 2 + 2 + (4 + 8) = 16, ZeRO's "K = 12"), tensors saved for
backward (taken from the traced graph, local shares), and the largest transient working set of
one op (its local inputs and output, and the buffers of the collectives the op runs itself: its
output reduction, its re-gathers, :func:`steps_working_set`).
"""

from __future__ import annotations

import functools
import math

from planner.hardware import HardwareProfile, ring_terms
from planner.ir import DTYPE_BYTES, Node
from planner.layout import Layout, Step, step_bytes
from planner.mesh import Mesh
from planner.strategy import Comm, Phase, Strategy

STATES_PER_VALUE = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-momentum": 1, "none": 0}  # exp_avg + exp_avg_sq; momentum


def dtype_itemsize(dtype: str) -> int:
    """Bytes per value of a floating dtype named as torch names it (``"float32"``)."""
    key = f"torch.{dtype}"
    if key not in DTYPE_BYTES or "float" not in key:
        raise ValueError(f"unknown floating dtype {dtype!r}; known: {sorted(k.removeprefix('torch.') for k in DTYPE_BYTES if 'float' in k)}")
    return DTYPE_BYTES[key]


# bytes read + written per updated byte and ops launched per parameter tensor by torch's
# single-tensor optimizers: AdamW reads p, g, m, v and writes p, m, v (7) plus sqrt(v) and its
# quotient as temporaries (written and read: 4); SGD with momentum reads p, g, buf and writes
# p, buf (5) plus the weight-decayed gradient (2)
STEP_TRAFFIC = {"adamw": (11, 10), "adam": (11, 9), "sgd": (7, 4), "sgd-momentum": (7, 4), "none": (0, 0)}


def optimizer_step_time(optimizer: str, updated_bytes: float, hw: HardwareProfile) -> float:
    """The optimizer's update of one parameter tensor (``updated_bytes``: what this rank updates):
    memory-bound, t = traffic * bytes / bw_mem + ops * o; on a calibrated profile the measured
    t = per_tensor + per_byte * bytes of torch's own step (``hw.optimizer_steps``)."""
    traffic, ops = STEP_TRAFFIC.get(optimizer, (0, 0))
    if not updated_bytes or not traffic:
        return 0.0
    if optimizer in hw.optimizer_steps:  # measured by planner calibrate: torch's own step, per tensor and per byte
        per_tensor, per_byte = hw.optimizer_steps[optimizer]
        return per_tensor + per_byte * updated_bytes
    return traffic * updated_bytes / hw.memory_bandwidth + ops * hw.op_overhead


def optimizer_bytes_per_value(optimizer: str, itemsize: int, master_itemsize: int | None) -> int:
    """Optimizer bytes per parameter value: its states in the parameter's dtype, or, with master
    weights (mixed precision), a master copy plus the states in the master dtype."""
    if optimizer not in STATES_PER_VALUE:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(STATES_PER_VALUE)}")
    k = STATES_PER_VALUE[optimizer]
    return master_itemsize * (1 + k) if master_itemsize is not None else itemsize * k


def spans_nodes(axes: tuple[str, ...], mesh: Mesh, hw: HardwareProfile) -> bool:
    """Whether the group over ``axes`` containing rank 0 crosses a node boundary."""
    return _spans_nodes(tuple(axes), mesh, hw.devices_per_node)


@functools.lru_cache(maxsize=4096)
def _spans_nodes(axes: tuple[str, ...], mesh: Mesh, devices_per_node: int) -> bool:
    ranks = [0]
    for axis in axes:
        ranks = [r + c * mesh.stride(axis) for r in ranks for c in range(mesh.degree(axis))]
    return len({r // devices_per_node for r in ranks}) > 1


_TIMES: dict[int, tuple[HardwareProfile, dict[tuple[Comm, Mesh], float]]] = {}  # by the profile's id (the profile kept: the id stays its own)
_TIMES_KEPT = 200_000  # entries over all profiles before the memo starts again


def comm_time(comm: Comm, mesh: Mesh, hw: HardwareProfile) -> float:
    """:func:`collective_time`, memoised: a search prices the same few thousand collectives
    hundreds of thousands of times (measured, gpt2-small on 512 devices, one plan: 807,634 calls,
    5,113 distinct)."""
    entry = _TIMES.get(id(hw))
    if entry is None or entry[0] is not hw:
        if len(_TIMES) > 16 or sum(len(memo) for _, memo in _TIMES.values()) > _TIMES_KEPT:
            _TIMES.clear()
        entry = _TIMES[id(hw)] = (hw, {})
    memo = entry[1]
    t = memo.get((comm, mesh))
    if t is None:
        t = memo[(comm, mesh)] = collective_time(comm, mesh, hw)
    return t


def collective_time(comm: Comm, mesh: Mesh, hw: HardwareProfile) -> float:
    """Alpha-beta time of ``comm`` on its group's tier: ``steps`` latencies plus the bytes each
    rank sends over the bandwidth. A calibrated profile's fit of that collective kind
    (``hw.collectives``: its own latency and bandwidth, times its measured / fitted ratio at this
    payload, the comm's own bytes for a bucket member) replaces the tier inside a node. A bucketed gradient all-reduce (``bucket_bytes``) pays its
    share of one bucket's latency, ``nbytes / bucket_bytes`` of it (all of it when it is a bucket
    alone); its bytes travel as they would alone."""
    n = mesh.group_size(comm.axes)
    if n <= 1 or comm.nbytes == 0:
        return 0.0
    spans = spans_nodes(comm.axes, mesh, hw)
    tier = hw.tier(spans)
    fit = None if spans else hw.collectives.get(comm.kind)
    latency = fit.latency if fit is not None else tier.latency
    bw = fit.bandwidth if fit is not None else tier.bandwidth * hw.bandwidth_efficiency
    scale = fit.scale_at(comm.nbytes) if fit is not None else 1.0  # measured / fitted at this payload
    steps, factor = ring_terms(comm.kind, n)
    share = min(1.0, comm.nbytes / comm.bucket_bytes) if comm.bucket_bytes else 1.0
    return (steps * latency * share + factor * comm.nbytes / bw) * scale


def ring_volume(comm: Comm, mesh: Mesh) -> float:
    """Bytes a rank sends (and receives) in ``comm`` under ring algorithms: all-reduce
    2(n-1)/n * S, all-gather and reduce-scatter (n-1)/n * S, a tree or a message S."""
    n = mesh.group_size(comm.axes)
    return ring_terms(comm.kind, n)[1] * comm.nbytes if n > 1 else 0.0


def compute_time(node: Node, strategy: Strategy, mesh: Mesh, hw: HardwareProfile, in_bytes: int) -> float:
    """Roofline time of ``node`` run with ``strategy`` (``in_bytes``: its local input bytes)."""
    split = mesh.group_size(strategy.split_axes)
    flops = (node.flops_fwd + node.flops_bwd) / split
    out_bytes = 0
    for meta, spec in zip(node.outputs, strategy.outputs, strict=False):
        if meta is not None and spec is not None:
            out_bytes += meta.nbytes // max(spec.layout.shard_factor(mesh), 1)
    dtype = next((m.dtype for m in node.outputs if m is not None), "torch.float32")
    # efficiency by the size of one launch: the forward matmul (backward runs two of that size),
    # and by how thin it is (the backward's two have the same three dimensions)
    eff = hw.efficiency(dtype, node.flops_fwd / split)
    if hw.matmul_thin and node.target in MATMULS:
        thinnest = _thinnest_dim(node, strategy, mesh, split)
        eff *= hw.thin_factor(dtype, thinnest) if thinnest else 1.0
    t_flops = flops / (eff * hw.flops(dtype))
    t_bytes = 3 * (in_bytes + out_bytes) / hw.memory_bandwidth
    return 3 * hw.op_overhead + max(t_flops, t_bytes)


MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default", "aten.linear.default"})


def _thinnest_dim(node: Node, strategy: Strategy, mesh: Mesh, split: int) -> float:
    """The smallest of a matmul's local M, K, N: M and N from its local output (a bmm's M its
    second-last dim, otherwise every leading dim flattened), K from its local forward FLOPs
    (2 M K N); 0 when the output's layout is unknown."""
    meta, spec = node.outputs[0], strategy.outputs[0] if strategy.outputs else None
    if meta is None or spec is None or not meta.shape:
        return 0.0
    try:
        local = spec.layout.local_shape(tuple(meta.shape), mesh)
    except ValueError:
        return 0.0
    n = local[-1]
    m = local[-2] if node.target == "aten.bmm.default" and len(local) >= 2 else math.prod(local[:-1])
    batches = math.prod(local[:-2]) if node.target == "aten.bmm.default" else 1
    if not m or not n:
        return 0.0
    k = node.flops_fwd / split / (2 * m * n * batches)
    return float(min(m, n, k))


def steps_comms(steps: tuple[Step, ...], local_bytes: int, mesh: Mesh, phase: Phase) -> tuple[Comm, ...]:
    """The collectives a conversion issues, with their payloads (see :func:`planner.layout.step_bytes`)."""
    comms = []
    size = local_bytes
    for step in steps:
        payload, size = step_bytes(step, size, mesh)
        if step.is_collective and mesh.group_size(step.axes) > 1:
            comms.append(Comm(step.kind, step.axes, payload, phase))
    return tuple(comms)


def step_peak(step: Step, local_bytes_before: int, mesh: Mesh, contiguous: bool = True) -> int:
    """Bytes live while the runtime (:mod:`runtime.collectives`, on gloo) runs ``step`` on a
    tensor of ``s = local_bytes_before``, counting that tensor; ``o`` its output, ``n`` the group:

        all_reduce      s + o          (a copy, reduced in place)
        all_gather      s + 2 o        (gathered into the result; gloo stages the o bytes in a flat
                                        buffer of its own while the collective runs; where the
                                        result's chunks are not contiguous, into one [n, shard]
                                        buffer, then concatenated once the staging is freed)
        reduce_scatter  s + s          (chunks passed as views; gloo copies this rank's chunk into
                                        the output and clones the other n - 1)
                        s + 2 s        (``contiguous=False``: the chunks along the dim are not
                                        contiguous, a dim of more than one element before it, so
                                        they are copied first; measured, HF ViT 1-D: a
                                        [4, 17, 32] reduce-scatter along dim 2 held 3 x 8,704 B)
        slice           s + o          (a copy, so that the whole tensor can be freed)
        zero            s + o          (the value times 1 or 0)

    An all-gather, reduce-scatter or slice over a group of one returns its input (s)."""
    n = mesh.group_size(step.axes)
    _, after = step_bytes(step, local_bytes_before, mesh)
    if n == 1 and step.kind in ("all_gather", "reduce_scatter", "slice"):
        return local_bytes_before
    if step.kind == "all_gather":
        return local_bytes_before + 2 * after
    if step.kind == "reduce_scatter":
        return (2 if contiguous else 3) * local_bytes_before
    return local_bytes_before + after


def steps_working_set(steps: tuple[Step, ...], local_bytes_before: int, mesh: Mesh, local_shape: tuple[int, ...] | None = None) -> int:
    """Peak bytes live while a conversion's ``steps`` run on a tensor of ``s0`` local bytes: the
    largest, over its steps k, of the step's own peak (:func:`step_peak`, on the tensor the steps
    before made of it) plus ``s0`` from the second step on (the conversion's input stays alive: its
    producer or autograd holds it; the intermediates before step k are freed). 0 with no steps.
    ``local_shape`` (the tensor's local shape before the steps) tells where a step's chunks are
    not contiguous; without it they are taken to be."""
    peak, size = 0, local_bytes_before
    shape = list(local_shape) if local_shape is not None else None
    for k, step in enumerate(steps):
        contiguous = shape is None or step.dim is None or math.prod(shape[: step.dim]) == 1
        peak = max(peak, (local_bytes_before if k else 0) + step_peak(step, size, mesh, contiguous))
        _, size = step_bytes(step, size, mesh)
        if shape is not None and step.dim is not None:
            n = mesh.group_size(step.axes)
            if step.kind == "all_gather":
                shape[step.dim] *= n
            elif step.kind in ("reduce_scatter", "slice"):
                shape[step.dim] //= n
    return peak


def local_bytes(nbytes: int, layout: Layout, mesh: Mesh) -> int:
    return nbytes // layout.shard_factor(mesh)
