"""Hugging Face ``transformers`` models built from a config (no download) trace and plan (CPU, ~10 s)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner.hardware import A100_80G  # noqa: E402
from planner.ir import IRGraph  # noqa: E402
from planner.search import SearchResult, SearchSpace, search  # noqa: E402
from planner.trace import TraceError, trace  # noqa: E402

transformers.logging.set_verbosity_error()  # tiny configs warn about bos/eos ids outside the vocabulary

BATCH, SEQ, VOCAB = 8, 16, 256

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=32,
        )
    ),
    "bert": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=VOCAB, max_position_embeddings=32,
        )
    ),
}
LAYERS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _batch() -> dict[str, torch.Tensor]:
    """Keyword inputs; labels is its own tensor (export merges one tensor passed twice into one input)."""
    ids = _ids()
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module", params=sorted(MODELS))
def traced(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, IRGraph]:
    name = request.param
    torch.manual_seed(0)
    model = MODELS[name]()
    return name, model, trace(model, (), _batch())


@pytest.fixture(scope="module")
def planned(traced: tuple[str, torch.nn.Module, IRGraph]) -> tuple[IRGraph, SearchResult]:
    name, _, graph = traced
    return graph, search(graph, SearchSpace(devices=8), A100_80G, model_name=name, front=False)


def test_one_scalar_loss_output(traced: tuple[str, torch.nn.Module, IRGraph]) -> None:
    _, _, graph = traced
    assert graph.input_names == ("input_ids", "labels")
    outputs = [n for n in graph.nodes.values() if n.kind == "output"]
    assert len(outputs) == 1 and [r.node for r in outputs[0].inputs] == [graph.output_name]
    loss = graph.nodes[graph.output_name]
    assert loss.out.shape == () and loss.out.is_float
    assert loss.target == "aten.cross_entropy_loss.default"


def test_repeated_layers_detected(traced: tuple[str, torch.nn.Module, IRGraph]) -> None:
    name, _, graph = traced
    assert [(r.prefix, r.count) for r in graph.repeated] == [(LAYERS[name], 2)]


def test_parameter_names_are_the_models_own(traced: tuple[str, torch.nn.Module, IRGraph]) -> None:
    _, model, graph = traced
    ir_names = sorted(n for node in graph.params for n in node.param_names)
    assert ir_names == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    # one IR node per distinct tensor: tied weights (embedding / LM head) are one node with several names
    assert sorted(node.param_names[0] for node in graph.params) == sorted(n for n, _ in model.named_parameters())
    assert all(not node.module_path.startswith(("model.model.", "module.")) for node in graph.nodes.values())


def test_use_cache_is_restored(traced: tuple[str, torch.nn.Module, IRGraph]) -> None:
    _, model, _ = traced
    assert model.config.use_cache is True  # traced with use_cache=False, then put back


def test_search_plans_every_node(planned: tuple[IRGraph, SearchResult]) -> None:
    graph, result = planned
    plan = result.best
    assert plan is not None, [c.reason for c in result.candidates]
    ops = {name for name, n in graph.nodes.items() if n.kind == "op"}
    planned_names = [n.name for n in plan.nodes]
    assert len(planned_names) == len(set(planned_names))
    assert len([n for n in planned_names if n in ops]) == len(ops)
    # every IR node but the output (parameters, inputs, buffers and ops) has a strategy
    assert set(planned_names) == {name for name, n in graph.nodes.items() if n.kind != "output"}
    assert plan.step_time_s > 0 and plan.peak_memory_bytes > 0


def test_tuple_output_takes_the_first_element() -> None:
    """``return_dict=False``: the loss is the first element of the tuple."""
    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    as_dict = trace(model, (), _batch())
    as_tuple = trace(model, (), {**_batch(), "return_dict": False, "use_cache": False})
    assert as_tuple.nodes[as_tuple.output_name].out.shape == ()
    # the Python constants are baked into the graph, not inputs: the IR is the same
    assert as_tuple.input_names == as_dict.input_names == ("input_ids", "labels")
    assert [(n.name, n.target) for n in as_tuple.nodes.values()] == [(n.name, n.target) for n in as_dict.nodes.values()]


def test_missing_labels_is_explained() -> None:
    model = MODELS["bert"]()
    with pytest.raises(TraceError, match=r"labels=\.\.\."):
        trace(model, (_ids(),))


class DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent Python branch: cannot be traced
            return y.square().mean()
        return y.mean()


def test_untraceable_model_names_file_line_and_advice() -> None:
    lines, start = inspect.getsourcelines(DataDependent.forward)
    line = start + next(i for i, text in enumerate(lines) if "if y.sum() > 0" in text)
    with pytest.raises(TraceError) as info:
        trace(DataDependent(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert f"{Path(__file__).name}:{line} in forward" in msg
    assert "if y.sum() > 0" in msg
    assert "DataDependent" in msg
    assert "What to do" in msg and "torch.where" in msg
