"""Activation recomputation (checkpointing) of repeated layers: what it keeps, what it re-runs.

A plan with ``recompute="full"`` runs each instance of a repeated layer (a transformer block,
``h.3``) as one segment under ``torch.utils.checkpoint`` (non-reentrant): forward saves only the
segment's inputs (the residual stream from the layer before, parameters, tensors from outside the
stack such as rotary tables), and backward re-runs the segment's forward once, when it first needs
a saved tensor, before the segment's own backward. What that costs and saves, as priced by
:mod:`planner.problem` and :mod:`planner.peak`, per instance of the layer:

* **time**: each op's forward again, ``compute x flops_fwd / (flops_fwd + flops_bwd)``, and every
  forward collective the segment runs again: the op's own (a row-parallel all-reduce, a re-gather)
  and the forward steps of the conversions placed inside the segment (those into its ops). A
  segment ends at the kernel of the instance's last op that saves a tensor (:func:`segments`);
* **memory held**: the tensors its ops save for backward drop out of the activations, except those
  made outside the instance (the segment's inputs, which the checkpoint keeps);
* **transient**: during the instance's backward its recomputed saves are alive again: at the op
  ``v`` of the instance, the saves of its ops up to ``v`` (the ones after ``v`` were freed by their
  own backward), an in-flight term of that instant (:mod:`planner.peak`).

Recomputation runs with ZeRO 0-2 and without CDP: ZeRO-3's units gather parameters through module
hooks a recomputed forward would fire again, and CDP's stages run their own segments.

Megatron-LM calls this full, uniform recomputation. ``recompute="selective"`` (Korthikanti et
al. 2022) makes the attention cores the segments instead: the same rules, per core. Where
attention is one fused op (as in this project's models, whose SDPA keeps only q, k, v, its output
and the log-sum-exp, :func:`planner.trace._flash_saved`) it saves next to nothing and the search
finds it dominated; on eager attention (``q k^T``, mask, softmax, dropout, ``p v``, as Hugging
Face models run with ``attn_implementation="eager"``) it drops the ``s^2``-per-head scores and
probabilities for a few percent more compute. A model without an attention core in a repeated
layer has no selective configuration (the search prunes it, saying so).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Literal

from planner.cost import comm_time, steps_comms
from planner.ir import IRGraph, Node
from planner.layout import spec_conversion
from planner.mesh import Mesh
from planner.schemes.base import NodePrice, Scheme, Settings, settings_of
from planner.strategy import Comm, Strategy
from planner.trace import match_layer

if TYPE_CHECKING:
    from planner.terms import Problem, Segment

Recompute = Literal["none", "selective", "full"]
MODES: tuple[Recompute, ...] = ("none", "selective", "full")


_MATMULS = ("aten.matmul.", "aten.bmm.", "aten.baddbmm.", "aten.einsum.")
_WALK = 8  # ops between an attention core's matmuls and its softmax, at most (scale, mask, dtype, dropout)


def segments(graph: IRGraph, mode: str = "full") -> dict[str, Segment]:
    """The ops that run inside a recomputed segment, and the segment each runs in.

    ``full``: per instance of a repeated layer, its ops up to the last one that saves a tensor
    for backward. The ops after it save nothing, so they run outside the checkpoint (once; a
    recomputed forward would stop before them anyway: torch's checkpoint stops once the last
    saved tensor is made again). Of that last op, only what runs up to its kernel is inside: a
    reduction of its raw output (a row-parallel all-reduce) runs after the segment.

    ``selective`` (Korthikanti et al. 2022): per instance, each attention core: a fused
    scaled-dot-product attention, or the ops from the matmul of two activations that feeds a
    softmax (``q k^T``) to the matmul that reads the softmax's probabilities (``p v``), with the
    scaling, masking and dropout between. Its inputs (q, k, v) stay saved; what it makes (the
    scores, the probabilities, the dropout mask: ``s^2`` per head) is made again in backward.

    Parameters, inputs and ops outside repeated layers are in none."""

    def make() -> dict[str, Segment]:
        by_instance: dict[tuple[str, int], list[Node]] = {}
        for node in graph.nodes.values():
            if node.kind == "op" and node.layer is not None:
                key = match_layer(node.module_path)
                if key is not None:
                    by_instance.setdefault(key, []).append(node)
        out: dict[str, Segment] = {}
        for (prefix, index), ops in by_instance.items():
            parts = _attention_cores(graph, ops) if mode == "selective" else [ops]
            for k, part in enumerate(parts):
                last = max((j for j, n in enumerate(part) if n.saved), default=-1)
                out.update((n.name, (prefix, index, k)) for n in part[: last + 1])
        return out

    if mode not in ("selective", "full"):
        return {}
    return graph.memo(("recompute_segments", mode), make)


def _attention_cores(graph: IRGraph, ops: list[Node]) -> list[list[Node]]:
    """The attention cores of one layer instance (``ops`` in graph order), each a run of ``ops``."""
    where = {n.name: k for k, n in enumerate(ops)}
    consumers = graph.consumers()

    def activation_matmul(n: Node) -> bool:  # q k^T or p v: both operands made by ops, no weight
        return n.target.startswith(_MATMULS) and all(graph.nodes[i.node].kind == "op" for i in n.inputs)

    cores: list[list[Node]] = []
    for k, n in enumerate(ops):
        if "scaled_dot_product" in n.target:
            cores.append([n])
            continue
        if "softmax" not in n.target:
            continue
        start = end = None
        back = n
        for _ in range(_WALK):  # up the first operand to q k^T
            back = graph.nodes[back.inputs[0].node]
            if back.name not in where:
                break
            if activation_matmul(back):
                start = where[back.name]
                break
        ahead = n
        for _ in range(_WALK):  # down the first reader inside the instance to p v
            readers = sorted(where[c] for c, _ in consumers[ahead.name] if c in where)
            if not readers:
                break
            ahead = ops[readers[0]]
            if activation_matmul(ahead):
                end = readers[0]
                break
        if start is not None and end is not None and start < k < end:
            cores.append(ops[start:end + 1])
    return cores


def last_savers(graph: IRGraph, mode: str = "full") -> frozenset[str]:
    """The last op of each recomputed segment (:func:`segments`): its kernel ends the segment."""

    def make() -> frozenset[str]:
        last: dict[Segment, str] = {}
        for name, key in segments(graph, mode).items():
            last[key] = name  # graph order: the last one of each segment stays
        return frozenset(last.values())

    return graph.memo(("recompute_last_savers", mode), make)


def unsupported(recompute: str, zero: int, cdp: str) -> str:
    """Why a configuration cannot recompute ("" when it can)."""
    if recompute == "none":
        return ""
    if zero == 3:
        return "recomputation runs with ZeRO 0-2: ZeRO-3's units gather parameters through hooks a recomputed forward would fire again"
    if cdp != "off":
        return "recomputation runs with CDP off: CDP's stages run their own segments"
    return ""


def check(modes: tuple[str, ...]) -> None:
    """Raise on an unknown mode, naming the ones there are."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"recompute modes are {', '.join(MODES)}; got {', '.join(modes) or 'none at all'}")


def rerun_comms(node: Node, strategy: Strategy, mesh: Mesh, last: bool) -> list[Comm]:
    """The forward collectives of ``node``'s own (under ``strategy``) that its segment runs again:
    all of them, except, for the segment's last op (``last``), the reduction of its raw output,
    which runs after the segment (:func:`segments`)."""
    again = [c for c in strategy.comms if c.phase == "fwd"]
    if last and strategy.raw_output is not None and strategy.outputs[0] is not None:
        conv = spec_conversion(strategy.raw_output, strategy.outputs[0], mesh)
        after = Counter(steps_comms(conv.forward, node.out.nbytes // strategy.raw_output.layout.shard_factor(mesh), mesh, "fwd"))
        kept = []
        for c in again:
            if after[c] > 0:
                after[c] -= 1
            else:
                kept.append(c)
        again = kept
    return again


class Recomputation(Scheme):
    """Activation recomputation of repeated layers (module docstring): what its segments run again."""

    name = "recompute"
    setting = "recompute"
    searched = "recompute"
    off = "none"

    def unsupported(self, mesh: Mesh, settings: Settings, graph: IRGraph | None = None) -> str:
        why = unsupported(settings["recompute"], settings["zero_stage"], settings["cdp"])
        if not why and settings["recompute"] == "selective" and graph is not None and not segments(graph, "selective"):
            why = ("selective recomputation: no repeated layer of this model has an attention core (a softmax between "
                   "two matmuls of activations, or a fused scaled-dot-product attention)")
        return why

    def label(self, settings: Settings) -> str:
        return f"recompute {settings['recompute']}" if settings["recompute"] != "none" else ""

    def configure(self, problem: Problem) -> None:
        check((problem.recompute,))
        why = self.unsupported(problem.mesh, settings_of(problem))
        if why:
            raise ValueError(f"recompute={problem.recompute!r} with ZeRO-{problem.zero_stage}, CDP {problem.cdp}: {why}")
        problem.segment_of = segments(problem.graph, problem.recompute) if problem.recompute != "none" else {}

    def price_op(self, problem: Problem, node: Node, strategy: Strategy, price: NodePrice) -> None:
        if not problem.recomputes(node):
            return
        # the forward runs again in backward: its compute and its forward collectives
        mesh = problem.mesh
        flops = node.flops_fwd + node.flops_bwd
        again = rerun_comms(node, strategy, mesh, node.name in last_savers(problem.graph, problem.recompute))
        rerun = price.compute * (node.flops_fwd / flops if flops else 1 / 3)
        price.seconds += rerun
        price.comms += again
        price.rerun = (rerun + sum(comm_time(c, mesh, problem.hardware) * problem.repeats(c) for c in again)) * price.count
