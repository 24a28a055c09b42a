"""Tracing: the IR carries shapes, FLOPs, saved bytes and module paths; big models stay on meta."""

from __future__ import annotations

import torch

from planner.models import build_model, example_inputs
from planner.trace import trace


def _tiny():  # type: ignore[no-untyped-def]
    model = build_model("gpt-tiny")
    args, kwargs = example_inputs("gpt-tiny", batch=2)
    return trace(model, args, kwargs)


def test_linear_flops_are_2_n_k_m_forward_and_twice_that_backward() -> None:
    graph = _tiny()
    fc = next(n for n in graph.nodes.values() if n.module_path == "h.0.mlp.fc")
    tokens, h = 2 * 16, 64
    assert fc.flops_fwd == 2 * tokens * h * 4 * h
    assert fc.flops_bwd == 2 * fc.flops_fwd


def test_linear_saves_its_input_and_weight_for_backward() -> None:
    graph = _tiny()
    fc = next(n for n in graph.nodes.values() if n.module_path == "h.0.mlp.fc")
    saved = {(s.source, s.index): s.nbytes for s in fc.saved}
    assert saved[("input", 0)] == 2 * 16 * 64 * 4  # float32 activations [2, 16, 64]
    assert saved[("input", 1)] == 4 * 64 * 64 * 4  # the weight [256, 64]


def test_views_are_marked_as_aliases_of_their_input() -> None:
    graph = _tiny()
    views = [n for n in graph.nodes.values() if n.target in ("aten.view.default", "aten.transpose.int")]
    assert views and all(n.alias_input == 0 for n in views)


def test_every_node_knows_its_module_path() -> None:
    graph = _tiny()
    linears = [n for n in graph.nodes.values() if n.target == "aten.linear.default"]
    assert {n.module_path for n in linears} >= {"h.0.attn.q_proj", "h.1.mlp.proj", "lm_head"}


def test_tied_embedding_is_one_parameter_with_both_names() -> None:
    graph = _tiny()
    tied = [n for n in graph.params if "lm_head.weight" in n.param_names]
    assert len(tied) == 1 and set(tied[0].param_names) == {"wte.weight", "lm_head.weight"}
    model = build_model("gpt-tiny")
    assert graph.num_params() == sum(p.numel() for p in model.parameters())


def test_gpt3_175b_traces_on_meta_and_all_96_blocks_are_one_repeated_layer() -> None:
    model = build_model("gpt3-175b", device="meta")
    args, kwargs = example_inputs("gpt3-175b", batch=8, device="meta")
    graph = trace(model, args, kwargs)
    assert all(p.is_meta for p in model.parameters())
    assert len(graph.repeated) == 1
    layers = graph.repeated[0]
    assert (layers.prefix, layers.count) == ("h", 96)
    templates = {n.template for n in graph.nodes.values() if n.layer is not None}
    assert len(templates) == layers.nodes_per_layer
    assert 170e9 < graph.num_params() < 180e9
    # forward+backward FLOPs of the matmuls ~ 6 * params * tokens (+ attention)
    assert 0.95 < graph.total_flops() / (6 * graph.num_params() * 8 * 2048) < 1.25


def test_float64_model_traces_with_float64_metadata() -> None:
    model = build_model("mlp-tiny", dtype=torch.float64)
    args, kwargs = example_inputs("mlp-tiny", batch=4, dtype=torch.float64)
    graph = trace(model, args, kwargs)
    assert {n.out.dtype for n in graph.params} == {"torch.float64"}
