"""The plan: frozen, versioned, JSON-serialisable data that the runtime executes.

Everything the runtime needs is here (mesh, one strategy per traced node with its input and
output Specs in machine form), with what the planner predicted (step time, peak memory per device
and their breakdowns, the collectives each rank issues per step). ``Plan.model_validate_json(
plan.model_dump_json()) == plan`` holds exactly. Never a pickle.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from planner.buckets import DEFAULT_BUCKET_BYTES
from planner.config import RecomputeSetting, SearchConfig
from planner.ir import InputRef, IRGraph
from planner.layout import Spec, parse_spec
from planner.mesh import AxisRole, Mesh, roles_from_names
from planner.trace import match_layer

PLAN_VERSION = 1
COST_MODEL_VERSION = "analytic-1"

TPFamily = Literal["none", "1d", "2d", "3d", "mixed"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NodePlan(_Frozen):
    name: str
    target: str
    algorithm: str
    kernel: str
    inputs: tuple[str | None, ...]  # encoded Specs (planner.layout.Spec.encode)
    outputs: tuple[str | None, ...]
    split_axes: tuple[str, ...] = ()
    raw_output: str | None = None  # the kernel's output Spec before the strategy's own conversion
    regather: tuple[tuple[int, str], ...] = ()  # inputs gathered by the kernel, again in backward
    module: str = Field(default="", description="the module that runs the node, by its path in the model ('' at the root)")
    recompute_segment: int | None = Field(default=None, description="the recomputed segment the node runs in (planner.schemes.recompute): its forward runs again in backward")
    ends_segment: bool = Field(default=False, description="the segment's last op: its kernel ends the segment (a reduction of its raw output runs after it)")

    def input_specs(self) -> list[Spec | None]:
        return [parse_spec(s) if s is not None else None for s in self.inputs]

    def output_specs(self) -> list[Spec | None]:
        return [parse_spec(s) if s is not None else None for s in self.outputs]


class CommRecord(_Frozen):
    kind: str
    axes: tuple[str, ...]
    nbytes: int
    phase: Literal["fwd", "bwd", "step"]
    count: int
    bucket_bytes: int = Field(default=0, description="a bucket's or ZeRO-3 unit's collective, priced as its members' shares (planner.buckets)")


class GradBucket(_Frozen):
    """One bucket of the gradient sync: the gradients of ``params`` (traced parameter nodes, in
    packing order), summed over ``axes`` by ``collectives`` ((kind, phase): an all-reduce, or
    ZeRO-1/2's reduce-scatter and all-gather of the updated slices; :mod:`planner.buckets`)."""

    axes: tuple[str, ...]
    dtype: str
    params: tuple[str, ...]
    nbytes: int
    collectives: tuple[tuple[str, str], ...] = (("all_reduce", "step"),)


class UnitGather(_Frozen):
    """One parameter gather of a ZeRO-3 unit: ``site`` is ``"param->spec"`` (an edge conversion of
    the traced parameter node to that encoded Spec) or ``"node:position"`` (a kernel's own gather
    of that input); ``nbytes`` gathered; ``regather``: gathered again for backward; ``reduced``: its
    gradient reduce-scattered in backward."""

    site: str
    param: str
    nbytes: int
    regather: bool = False
    reduced: bool = True


class ParamUnit(_Frozen):
    """ZeRO-3's unit (FSDP2's flat parameter of a block): ``gathers`` in forward order, run as one
    all-gather over ``axes`` in forward, one reduce-scatter of their gradients and one all-gather
    of the re-gathered ones in backward (:mod:`planner.overlap`)."""

    axes: tuple[str, ...]
    dtype: str
    block: str
    gathers: tuple[UnitGather, ...]


class MemoryBreakdown(_Frozen):
    """Bytes per device. The terms do not all peak at once: activations are freed during backward
    while gradients appear, and the optimizer step's temporaries come after both, so the peak is
    params + optimizer + max(activations + transient, grads + transient, grads + step_transient).
    ``transient`` is what the busiest moment of forward and backward (the op ``peak_at``, with the
    activations and gradients alive then and its working set: :mod:`planner.peak`) holds beyond
    the larger of all activations and all gradients."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    step_transient: int = 0
    peak_at: str = ""  # the op (and module) at whose forward or backward that moment is

    @property
    def total(self) -> int:
        return peak_of(self.params, self.grads, self.optimizer, self.activations, self.transient, self.step_transient)


def peak_of(params: float, grads: float, optimizer: float, activations: float, transient: float, step_transient: float) -> int:
    return int(params + optimizer + max(activations + transient, grads + transient, grads + step_transient))


class SolverInfo(_Frozen):
    status: Literal["optimal", "time_limit"]
    backend: str
    trace_s: float
    build_s: float
    solve_s: float
    num_variables: int
    num_constraints: int


class Plan(_Frozen):
    version: int = PLAN_VERSION
    cost_model: str = COST_MODEL_VERSION
    model: str
    model_fingerprint: str
    input_shapes: tuple[tuple[int, ...], ...]
    mesh: dict[str, int]
    mesh_roles: dict[str, AxisRole] = Field(description="each mesh axis's role (planner.mesh.AxisRole), axes in mesh order; a plan saved "
                                            "before plans stored roles gets the naming convention's (planner.mesh.roles_from_names)")
    hardware: str
    tp: TPFamily
    zero_stage: int = 0
    micro_batches: int = Field(default=1, ge=1, description="gradient accumulation: micro-batches per step (nodes and shapes are one micro-batch's)")
    cdp: Literal["off", "v1", "v2"] = "off"
    recompute: RecomputeSetting = Field(default="none", description="activation recomputation: full re-runs each repeated layer's forward in backward, selective its attention cores; with a share (full 1/2) only the first layers of each stack (planner.schemes.recompute)")
    cdp_stages: int = Field(default=0, description="CDP: stages the graph is cut into (planner.stages)")
    optimizer: str = "adamw"
    master_dtype: str | None = Field(default=None, description="mixed precision: the optimizer's master weights and states dtype")
    memory_budget_bytes: int
    zero_prefetch: bool = Field(default=False, description="ZeRO-3 parameter gathers started one ahead, overlapping compute")
    grad_bucket_bytes: int = Field(default=DEFAULT_BUCKET_BYTES, gt=0, description="the gradient sync's collectives packed into buckets of this size")
    grad_buckets: tuple[GradBucket, ...] = Field(default=(), description="the gradient sync's buckets, in the order they fill")
    param_units: tuple[ParamUnit, ...] = Field(default=(), description="ZeRO-3: the parameter gathers packed per block, in forward order")
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    overlap_time_s: float = Field(default=0.0, description="communication hidden behind compute (the gradient sync beside backward, ZeRO-3 prefetch, CDP); step = compute + comm - overlap")
    recompute_time_s: float = Field(default=0.0, description="of the step time, what activation recomputation adds (the forward compute and collectives again)")
    peak_memory_bytes: int
    memory_breakdown: MemoryBreakdown
    nodes: tuple[NodePlan, ...]
    comms: tuple[CommRecord, ...]
    fallbacks: tuple[str, ...] = Field(default=(), description="nodes replicated because no rule covers their op")
    solver: SolverInfo
    search_config: SearchConfig | None = Field(default=None, description="the search that made this plan, its hardware profile whole (planner.config): report --config PLAN.json repeats it")

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != PLAN_VERSION:
            raise ValueError(f"plan version {v}: this planner reads version {PLAN_VERSION} plans; re-plan with this planner "
                             "(planner report ... --save-plan FILE)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _roles_of_older_plans(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mesh_roles" not in data and isinstance(data.get("mesh"), dict):
            return {**data, "mesh_roles": dict(zip(data["mesh"], roles_from_names(data["mesh"]), strict=True))}
        return data

    @model_validator(mode="after")
    def _roles_name_the_mesh_axes(self) -> Plan:
        if list(self.mesh_roles) != list(self.mesh):
            raise ValueError(f"mesh_roles names axes {list(self.mesh_roles)}; the plan's mesh has axes {list(self.mesh)} (one role per axis, "
                             "in the same order)")
        return self

    @property
    def mesh_obj(self) -> Mesh:
        return Mesh.from_dict(self.mesh, self.mesh_roles)

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def strategies_by_module(self) -> dict[str, str]:
        """The chosen strategy of each module's ops, by module path, in graph order, the layers of
        a repeated stack once (``h.*.attn.q_proj: tp1d-col``; every instance gets the same
        strategy); a module whose ops run different strategies lists them (``a, b``). Parameters
        (their storage is in the layouts) and view-like ops that follow their input are left out;
        ops at the root are keyed by their node name."""
        layers = [match_layer(node.module) for node in self.nodes]
        indices: dict[str, set[int]] = {}
        for layer in layers:
            if layer is not None:
                indices.setdefault(layer[0], set()).add(layer[1])
        out: dict[str, list[str]] = {}
        for node, layer in zip(self.nodes, layers, strict=True):
            if node.target == "placeholder" or node.algorithm == "follow" or node.name.startswith("p_"):
                continue
            key = node.module or node.name
            if layer is not None and len(indices[layer[0]]) > 1:  # h.3.attn -> h.*.attn
                key = f"{layer[0]}.*" + key[len(f"{layer[0]}.{layer[1]}"):]
            algorithms = out.setdefault(key, [])
            if node.algorithm not in algorithms:
                algorithms.append(node.algorithm)
        return {key: ", ".join(algorithms) for key, algorithms in out.items()}

    @property
    def shards_nothing(self) -> bool:
        """More than one device, and every op and parameter whole on each: the same work N times."""
        return self.mesh_obj.size > 1 and all(not n.split_axes for n in self.nodes) and not any(
            parse_spec(n.outputs[0]).layout.shard_axes for n in self.nodes if n.target == "placeholder" and n.outputs and n.outputs[0]
        )

    def shards_nothing_note(self) -> str:
        """The one line that says so (empty when the plan splits something)."""
        if not self.shards_nothing:
            return ""
        n = self.mesh_obj.size
        return (f"this plan shards nothing: every op and parameter is whole on each of the {n} devices, which all compute the same "
                f"step (on {self.hardware} no split of this model pays for its communication: it is too small); plan it for 1 "
                "device, or for more work per step (a larger batch or model)")

    def priced_comms(self) -> Counter[tuple[str, tuple[str, ...], int, str]]:
        """Collectives per rank per step, as a multiset of (kind, axes, bytes, phase)."""
        out: Counter[tuple[str, tuple[str, ...], int, str]] = Counter()
        for c in self.comms:
            out[(c.kind, c.axes, c.nbytes, c.phase)] += c.count
        return out


CONTIGUOUS = "aten.contiguous.default"


def fingerprint(graph: IRGraph, *, exact: bool = False) -> str:
    """A hash of the traced structure (ops, shapes, parameter names): plans are tied to it.

    ``aten.contiguous`` nodes are left out, their consumers hashed as reading the node's input:
    whether export keeps one depends on the strides of the device traced on, not on the model (an
    attention output's transpose is contiguous on CPU, whose SDPA returns it so, and not on meta),
    and a plan made on the meta device must run on the model built for real. ``exact``: every
    node (the fingerprint plans carried before)."""
    skip = {} if exact else {name: node.inputs[0] for name, node in graph.nodes.items() if node.target == CONTIGUOUS and len(node.inputs) == 1}

    def source(ref: InputRef) -> tuple[str, int]:
        while ref.node in skip:
            ref = skip[ref.node]
        return ref.node, ref.index

    h = hashlib.sha256()
    for node in graph.nodes.values():
        if node.name in skip:
            continue
        h.update(f"{node.name}|{node.target}|{node.outputs}|{node.param_names}|{[source(i) for i in node.inputs]}\n".encode())
    return h.hexdigest()[:16]
