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

A setting can recompute only the first part of each stack: ``recompute="full 1/2"`` recomputes
the first half of every repeated stack's layers (``h.0`` .. ``h.5`` of 12; rounded half up), the
rest keep their activations, so a front gains the points between no recomputation and all
(Megatron-LM's ``--recompute-num-layers``; the search tries the shares ``recompute_layers`` lists).
Every term above is per instance, so the sums count the recomputed instances only: a repeated
layer's template prices ``k`` of its ``L`` instances recomputed (``Problem.recomputed_instances``), a
conversion term is split by whether its producers' first consumer recomputes, and a hold
recomputed in a segment is not held in ``k / L`` of its instances (``HoldTerm.recomputed``). The
peak's instants are per instance already (:mod:`planner.peak`).

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

import math
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from planner.config import Recompute, SearchConfig
from planner.cost import comm_time, steps_comms
from planner.ir import IRGraph, Node
from planner.layout import spec_conversion
from planner.mesh import Mesh
from planner.schemes.base import Flag, NodePrice, Scheme, Settings
from planner.schemes.microbatch import activations_dominate
from planner.strategy import Comm, Strategy
from planner.trace import match_layer
from planner.units import format_seconds

if TYPE_CHECKING:
    from planner.plan import Plan
    from planner.terms import Evaluation, Problem, Segment

MODES: tuple[Recompute, ...] = ("none", "selective", "full")


def setting(mode: str, share: float | Fraction = 1) -> str:
    """The setting that recomputes ``share`` of each stack's layers in ``mode`` (``full``, ``full 1/2``)."""
    share = Fraction(share).limit_denominator(1024)
    if mode == "none" or share >= 1:
        return mode
    return f"{mode} {share.numerator}/{share.denominator}"


def parse(value: str) -> tuple[str, Fraction]:
    """(mode, share of each stack's layers) of a setting (:data:`planner.config.RecomputeSetting`):
    ``full 1/2`` -> ("full", 1/2)."""
    mode, _, share = value.partition(" ")
    return mode, Fraction(share) if share else Fraction(1)


def layers_recomputed(count: int, share: Fraction) -> int:
    """Of a stack of ``count`` layers, how many a share recomputes (its first ones; rounded half up)."""
    return min(count, math.floor(count * share + Fraction(1, 2)))


_MATMULS = ("aten.matmul.", "aten.bmm.", "aten.baddbmm.", "aten.einsum.")
_WALK = 8  # ops between an attention core's matmuls and its softmax, at most (scale, mask, dtype, dropout)


def segments(graph: IRGraph, mode: str = "full") -> dict[str, Segment]:
    """The ops that run inside a recomputed segment, and the segment each runs in; ``mode`` is a
    setting (:data:`planner.config.RecomputeSetting`: with a share, only the first instances of
    each stack are in one).

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
        indices: dict[str, list[int]] = {}
        for prefix, index in by_instance:
            indices.setdefault(prefix, []).append(index)
        first = {prefix: set(sorted(idx)[:layers_recomputed(len(idx), share)]) for prefix, idx in indices.items()}
        out: dict[str, Segment] = {}
        for (prefix, index), ops in by_instance.items():
            if index not in first[prefix]:
                continue
            parts = _attention_cores(graph, ops) if kind == "selective" else [ops]
            for k, part in enumerate(parts):
                last = max((j for j, n in enumerate(part) if n.saved), default=-1)
                out.update((n.name, (prefix, index, k)) for n in part[: last + 1])
        return out

    kind, share = parse(mode)
    if kind not in ("selective", "full"):
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
    if parse(recompute)[0] == "none":
        return ""
    if zero == 3:
        return "recomputation runs with ZeRO 0-2: ZeRO-3's units gather parameters through hooks a recomputed forward would fire again"
    if cdp != "off":
        return "recomputation runs with CDP off: CDP's stages run their own segments"
    return ""


def check(modes: tuple[str, ...]) -> None:
    """Raise on an unknown mode, naming the ones there are."""
    unknown = [m for m in modes if parse(m)[0] not in MODES]
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


def segment_numbers(graph: IRGraph, mode: str) -> dict[Segment, int]:
    """Each recomputed segment's number in the plan (graph order, from 0)."""
    return graph.memo(("recompute_numbers", mode), lambda: {key: k for k, key in enumerate(dict.fromkeys(segments(graph, mode).values()))})


def recomputed_layers(plan: Plan) -> str:
    """The repeated layers a plan recomputes, e.g. ``h.* (12 layers)``, or the first ones of a
    stack, ``h.0-h.5 (6 of 12 layers)``."""
    every = {m for n in plan.nodes if (m := match_layer(n.module)) is not None}
    redone = {m for n in plan.nodes if n.recompute_segment is not None and (m := match_layer(n.module)) is not None}
    parts = []
    for stack in sorted({prefix for prefix, _ in redone}):
        mine = sorted(i for p, i in redone if p == stack)
        total = sum(1 for p, _ in every if p == stack)
        span = f"{stack}.{mine[0]}" + (f"-{stack}.{mine[-1]}" if len(mine) > 1 else "")
        parts.append(f"{stack}.* ({total} layers)" if len(mine) == total else f"{span} ({len(mine)} of {total} layers)")
    return ", ".join(parts) or "the repeated layers"


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


class Recomputation(Scheme):
    """Activation recomputation of repeated layers (module docstring): what its segments run again."""

    name = "recompute"
    setting = "recompute"
    searched = "recompute"
    off = "none"
    flags = (Flag("--recompute", "recompute", "activation recomputation to search (comma list of none,selective,full; full re-runs each "
                  "repeated layer's forward in backward and keeps only its inputs, selective its attention cores; default none)", str, MODES),
             Flag("--recompute-layers", "recompute_layers", "with --recompute: the shares of each repeated stack's layers recomputed, its "
                  "first ones (comma list, e.g. 0.25,0.5,1: a quarter, half and all of them; default 1)", float))
    column = "recompute"
    title = "recompute"

    def values(self, config: SearchConfig, mesh: Mesh) -> tuple[str, ...]:
        """Each mode searched, and each share of the stacks' layers (``recompute_layers``) for a mode that recomputes."""
        return tuple(dict.fromkeys(setting(m, share) for m in config.recompute for share in (config.recompute_layers if m != "none" else (1,))))

    def unsupported(self, mesh: Mesh, settings: Settings, graph: IRGraph | None = None) -> str:
        value = settings["recompute"]
        why = unsupported(value, settings["zero_stage"], settings["cdp"])
        mode, share = parse(value)
        if why or graph is None or mode == "none":
            return why
        if not graph.repeated:
            return ("recomputation: this model has no repeated layers to recompute (a stack of identical numbered modules, "
                    "h.0, h.1, ...)")
        if mode == "selective" and not segments(graph, "selective"):
            return ("selective recomputation: no repeated layer of this model has an attention core (a softmax between "
                    "two matmuls of activations, or a fused scaled-dot-product attention)")
        if share < 1:
            counts = [r.count for r in graph.repeated]
            parts = [layers_recomputed(c, share) for c in counts]
            if not any(parts):
                return f"{share} of {' and '.join(map(str, counts))} layers rounds to none: recompute a larger share"
            if parts == counts:
                return f"{share} of {' and '.join(map(str, counts))} layers rounds to all of them: the same plans as recompute {mode}"
        return ""

    def label(self, settings: Settings) -> str:
        return f"recompute {settings['recompute']}" if settings["recompute"] != "none" else ""

    def describe(self, plan: Plan) -> list[str]:
        if plan.recompute == "none":
            return []
        share = f", {_percent(plan.recompute_time_s, plan.step_time_s)} of the step" if plan.step_time_s > 0 else ""
        return [f"  recompute {plan.recompute}: each instance of {recomputed_layers(plan)} keeps only its inputs in forward and runs its "
                f"forward again in backward: {format_seconds(plan.recompute_time_s)} more per step (that compute and its forward "
                f"collectives{share}); its saved tensors are held only while its backward runs"]

    def time_lines(self, plan: Plan) -> list[str]:
        if plan.recompute == "none":
            return []
        return [f"  recompute      {format_seconds(plan.recompute_time_s)} ({_percent(plan.recompute_time_s, plan.step_time_s)} of the step) "
                f"of the above: the forward of {recomputed_layers(plan)} again in backward, to hold their saved tensors only while "
                "their backward runs"]

    def advice(self, config: SearchConfig, graph: IRGraph, memory: Mapping[str, float]) -> str:
        if config.recompute != ("none",) or not graph.repeated or not activations_dominate(memory):
            return ""
        return ("activation recomputation (--recompute none,full --recompute-layers 0.5,1: each repeated layer recomputed, all of them "
                "or the first half, keeps only its input and runs its forward again in backward)")

    def node_fields(self, problem: Problem, name: str) -> dict[str, Any]:
        segment = problem.segment_of.get(name)
        if segment is None:
            return {}
        mode = problem.settings["recompute"]
        return {"recompute_segment": segment_numbers(problem.graph, mode)[segment], "ends_segment": name in last_savers(problem.graph, mode)}

    def plan_fields(self, problem: Problem, evaluation: Evaluation) -> dict[str, Any]:
        return {"recompute_time_s": evaluation.recompute_time}

    def configure(self, problem: Problem) -> None:
        mode = problem.settings["recompute"]
        check((mode,))
        why = self.unsupported(problem.mesh, problem.settings)
        if why:
            raise ValueError(f"recompute={mode!r} with ZeRO-{problem.zero_stage}, CDP {problem.cdp}: {why}")
        problem.segment_of = segments(problem.graph, mode) if mode != "none" else {}

    def price_op(self, problem: Problem, node: Node, strategy: Strategy, price: NodePrice) -> None:
        if not problem.recomputes(node):
            return
        # the forward runs again in backward, in each recomputed instance: its compute and its forward collectives
        mesh = problem.mesh
        flops = node.flops_fwd + node.flops_bwd
        again = rerun_comms(node, strategy, mesh, node.name in last_savers(problem.graph, problem.settings["recompute"]))
        rerun = price.compute * (node.flops_fwd / flops if flops else 1 / 3)
        price.rerun_instances = problem.recomputed_instances(node.name)
        price.rerun_comms = again
        price.rerun = (rerun + sum(comm_time(c, mesh, problem.hardware) * problem.repeats(c) for c in again)) * price.rerun_instances
