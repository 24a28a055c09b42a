"""Per-layer communication of the planned algorithms equals their closed forms.

The per-layer volume is measured as the difference between the plans of a 3-layer and a 2-layer
GPT (same shapes otherwise): everything outside the blocks cancels. Volume = bytes each device
sends and receives by ring algorithms: all-reduce 2(n-1)/n*S, all-gather and reduce-scatter
(n-1)/n*S (S the payload each rank records). Closed forms, per layer, N tokens, hidden h, in
elements:

* 1-D Megatron, p devices: 8(p-1)/p * N*h (design.md section 5).
* 3-D, q^3 devices, keeping gathered inputs for backward: (q-1)/q^3 * (32*N*h + 24*h^2)
  (design.md section 5; per linear X[N,a] W[a,b]: all-gather X over j, W over i, reduce-scatter
  Y over k forward; all-gather dY, reduce-scatter dX and dW backward: (q-1)/q^3 (2Na + 2Nb + 2ab);
  summed over q/k/v/out/fc/proj), plus what the formula leaves out: each of the two LayerNorms
  all-reduces two row statistics forward and two backward over the q devices sharing a row,
  4 * 2(q-1)/q * N/q^2 each, 16(q-1)/q^3 * N per layer.
* 2-D in all-gather form (our derivation), q^2 devices: per linear, all-gather X over col and W
  over row forward, reduce-scatter dX over col and dW over row backward:
  (q-1)/q^2 * (2*N*a + 2*a*b); per layer (q-1)/q^2 * (14*N*h + 24*h^2), plus the LayerNorm
  statistics over the q devices of a row, 16(q-1)/q^2 * N.
"""

from __future__ import annotations

import torch

from planner.config import SearchConfig
from planner.cost import ring_volume
from planner.ir import Node
from planner.models.gpt import GPT, GPTConfig
from planner.plan import Plan
from planner.search import search
from planner.strategy import Comm, Strategy
from planner.trace import trace

H, HEADS, T, B, V = 64, 8, 16, 8, 256
N = B * T
ITEM = 4  # float32


def _plan(layers: int, devices: int, family: str, allow, bias: bool = True) -> Plan:  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=layers, n_head=HEADS, n_embd=H, block_size=T, vocab_size=V, bias=bias))
    idx = torch.zeros(B, T, dtype=torch.long, device="meta")
    graph = trace(model, (idx,), {"targets": idx.clone()})
    result = search(graph, SearchConfig(devices=devices, dp=1, tp=(family,), memory_budget=1e12, front=False), model_name="gpt", allow=allow)
    assert result.best is not None
    return result.best


def _volume(plan: Plan) -> float:
    mesh = plan.mesh_obj
    return sum(c.count * ring_volume(Comm(c.kind, c.axes, c.nbytes, c.phase), mesh) for c in plan.comms)


def _per_layer(devices: int, family: str, allow, bias: bool = True) -> float:  # type: ignore[no-untyped-def]
    return _volume(_plan(3, devices, family, allow, bias)) - _volume(_plan(2, devices, family, allow, bias))


def megatron(node: Node, s: Strategy) -> bool:
    last = node.module_path.rsplit(".", 1)[-1]
    if node.target == "aten.linear.default" and node.module_path.startswith("h."):
        want = "tp1d-col" if last in ("q_proj", "k_proj", "v_proj", "fc") else "tp1d-row/all-reduce"
        return s.algorithm == want
    if node.module_path.startswith("h.") and node.target in ("aten.layer_norm.default", "aten.add.Tensor"):
        return not s.split_axes
    if node.target == "aten.scaled_dot_product_attention.default":
        return s.algorithm == "tp1d-heads"
    return True


def test_1d_megatron_moves_8_p_minus_1_over_p_n_h_per_layer() -> None:
    p = 4
    assert _per_layer(p, "1d", megatron) == 8 * (p - 1) / p * N * H * ITEM


ROWS_IJ_HIDDEN_K = (("i", "j"), (), ("k",))  # [B, T, C]: batch over (i, j), hidden over k


def paper_3d(node: Node, s: Strategy) -> bool:
    """Bian et al.'s layout inside the blocks: activations [(i,j), -, (k)]; q/k/v and fc compute
    with batch on i, contraction on k, output on j, reduce-scattering onto the batch over k; out
    and proj swap j and k, so the residual stream returns to [(i,j), -, (k)]."""
    if node.kind == "param" and ".ln_" in node.param_names[0]:
        return s.outputs[0] is not None and s.outputs[0].layout.dims == (("k",),)  # weight [h/q], as the paper
    if not node.module_path.startswith("h."):
        return True
    last = node.module_path.rsplit(".", 1)[-1]
    if node.target == "aten.linear.default":
        want = "tp3d[batch=i in=k out=j]" if last in ("q_proj", "k_proj", "v_proj", "fc") else "tp3d[batch=i in=j out=k]"
        return s.algorithm == f"{want}/reduce-scatter" and s.outputs[0] is not None and s.outputs[0].layout.dims[1] == ()
    if node.target in ("aten.layer_norm.default", "aten.add.Tensor"):
        return s.inputs[0].layout.dims == ROWS_IJ_HIDDEN_K
    if node.target == "aten.scaled_dot_product_attention.default":
        return s.inputs[0].layout.dims == (("i", "k"), ("j",), (), ())
    return True


def test_3d_keep_gathered_moves_the_papers_volume_per_layer() -> None:
    """Without biases; the LayerNorm weights' gradients are all-reduced over the batch plane (i, j)
    (2 LayerNorms x 2(q^2-1)/q^2 x h/q), which the formula leaves out too."""
    q = 2
    expected = (q - 1) / q**3 * (32 * N * H + 24 * H * H + 16 * N) + 2 * 2 * (q * q - 1) / (q * q) * H / q
    assert _per_layer(q**3, "3d", paper_3d, bias=False) == expected * ITEM


def summa_allgather(node: Node, s: Strategy) -> bool:
    """Activations [(row), -, (col)]; every linear computes rows over row, outputs over col."""
    if node.kind == "param" and ".ln_" in node.param_names[0]:
        return s.outputs[0] is not None and s.outputs[0].layout.dims == (("col",),)
    if not node.module_path.startswith("h."):
        return True
    if node.target == "aten.linear.default":
        return s.algorithm == "tp2d[batch=row out=col]" and s.inputs[0].layout.dims[0] == ("row",)
    if node.target in ("aten.layer_norm.default", "aten.add.Tensor"):
        return s.inputs[0].layout.dims == (("row",), (), ("col",))
    if node.target == "aten.scaled_dot_product_attention.default":
        return s.inputs[0].layout.dims == (("row",), ("col",), (), ())
    return True


def test_2d_allgather_moves_the_derived_volume_per_layer() -> None:
    """Without biases; plus the LayerNorm weights' gradients all-reduced over the row axis."""
    q = 2
    expected = (q - 1) / q**2 * (14 * N * H + 24 * H * H + 16 * N) + 2 * 2 * (q - 1) / q * H / q
    assert _per_layer(q**2, "2d", summa_allgather, bias=False) == expected * ITEM
