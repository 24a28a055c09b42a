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

Megatron-LM calls this full, uniform recomputation; Korthikanti et al. 2022's selective kind
(the attention core only) saves little where attention is one fused op that already keeps only
q, k, v, its output and the log-sum-exp (:func:`planner.trace._flash_saved`), as here.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Literal

from planner.cost import steps_comms
from planner.layout import spec_conversion
from planner.trace import match_layer

if TYPE_CHECKING:
    from planner.ir import IRGraph, Node
    from planner.mesh import Mesh
    from planner.strategy import Comm, Strategy

Recompute = Literal["none", "full"]
MODES: tuple[Recompute, ...] = ("none", "full")

Segment = tuple[str, int]  # (the stack's module prefix, the instance), e.g. ("h", 3)


def segments(graph: IRGraph) -> dict[str, Segment]:
    """The ops that run inside a recomputed segment, and the segment each runs in: per instance of
    a repeated layer, its ops up to the last one that saves a tensor for backward. The ops after
    it save nothing, so they run outside the checkpoint (once; a recomputed forward would stop
    before them anyway: torch's checkpoint stops once the last saved tensor is made again). Of
    that last op, only what runs up to its kernel is inside: a reduction of its raw output (a
    row-parallel all-reduce) runs after the segment. Parameters, inputs and ops outside
    repeated layers are in none."""

    def make() -> dict[str, Segment]:
        by_instance: dict[Segment, list[Node]] = {}
        for node in graph.nodes.values():
            if node.kind == "op" and node.layer is not None:
                key = match_layer(node.module_path)
                if key is not None:
                    by_instance.setdefault(key, []).append(node)
        out: dict[str, Segment] = {}
        for key, ops in by_instance.items():
            last = max((k for k, n in enumerate(ops) if n.saved), default=-1)
            out.update((n.name, key) for n in ops[: last + 1])
        return out

    return graph.memo("recompute_segments", make)


def last_savers(graph: IRGraph) -> frozenset[str]:
    """The last op of each recomputed segment (:func:`segments`): its kernel ends the segment."""

    def make() -> frozenset[str]:
        last: dict[Segment, str] = {}
        for name, key in segments(graph).items():
            last[key] = name  # graph order: the last one of each segment stays
        return frozenset(last.values())

    return graph.memo("recompute_last_savers", make)


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
