"""Hugging Face ``transformers`` models built from a config (no download) trace and plan (CPU, ~10 s)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner.config import SearchConfig  # noqa: E402
from planner.ir import IRGraph  # noqa: E402
from planner.search import SearchResult, search  # noqa: E402
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
    return graph, search(graph, SearchConfig(devices=8, zero=(0,), front=False), model_name=name)


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


# ------------------------------------------------------------- the hf-* presets (models/hf.py)

from planner.models.hf import HF_PRESETS, build_hf_model, hf_example_inputs, keep_loss_dtype  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.report import format_plan  # noqa: E402


@pytest.mark.parametrize("name", sorted(HF_PRESETS))
def test_every_preset_plans_on_8_devices_with_no_op_replicated_for_want_of_a_rule(name: str) -> None:
    """GPT-2, Llama/Qwen2/Mistral (grouped-query attention, rotary tables, RMSNorm, SwiGLU), BERT,
    ViT, T5, BART and the top-k mixtures of experts (Mixtral, Qwen2-MoE): traced, planned, every op
    covered by a sharding rule."""
    model = build_hf_model(name, dtype=torch.float32)
    graph = trace(model, *hf_example_inputs(name, batch=8))
    result = search(graph, SearchConfig(devices=8, tp=("1d", "3d"), front=False), model_name=name)
    assert result.best is not None, [c.reason for c in result.candidates]
    assert result.best.fallbacks == ()
    # the blocks share their variables: the first repeated prefix is the model's list of 2 blocks
    # (its name varies with the transformers version: ViT's is vit.encoder.layer, later vit.layers)
    found = [(r.prefix, r.count) for r in graph.repeated][:1]
    if HF_PRESETS[name].repeats:
        assert len(found) == 1 and found[0][1] == 2, found
        blocks = model.get_submodule(found[0][0])
        assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == 2
    else:
        assert found == []


def test_a_float64_causal_lm_computes_the_same_loss_as_transformers_in_its_own_dtype() -> None:
    """keep_loss_dtype: on float32 logits it equals transformers' ForCausalLMLoss; on float64 it
    stays float64 (transformers' own casts to float32)."""
    name = "hf-llama"
    model = build_hf_model(name, dtype=torch.float32)
    _, kwargs = hf_example_inputs(name, batch=4)
    want = model(**kwargs).loss
    keep_loss_dtype(model)
    assert torch.equal(model(**kwargs).loss, want)
    model64 = build_hf_model(name, dtype=torch.float64)
    assert model64(**kwargs).loss.dtype == torch.float64
    assert abs(model64(**kwargs).loss.item() - want.item()) < 1e-5


def test_a_data_dependent_mixture_of_experts_gets_the_planners_error_not_torchs_graph_dump(capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' "eager" experts loop over the experts a batch hits (nonzero): shapes depend on
    values. The TraceError names the file, line and module and says what to use instead; torch's
    dump of the partial graph (hundreds of lines) is held back."""
    preset = HF_PRESETS["hf-mixtral"]
    config = transformers.MixtralConfig(**preset.kwargs, experts_implementation="eager")
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(TraceError) as info:
        trace(model, *hf_example_inputs("hf-mixtral", batch=4))
    msg = str(info.value)
    assert "modeling_mixtral.py" in msg and "MixtralExperts" in msg and "model.layers.0.mlp.experts" in msg
    assert "depends on tensor values" in msg and "experts_implementation='grouped_mm'" in msg
    assert "def forward(" not in capsys.readouterr().err


def test_a_plan_that_shards_nothing_says_so() -> None:
    """A 1-D mesh of 4 for a model this small: the fastest plan replicates every op; the plan and
    the report say so in one line, with the reason."""
    name = "hf-gpt2"
    graph = trace(build_hf_model(name, dtype=torch.float32), *hf_example_inputs(name, batch=8))
    plan = search(graph, SearchConfig(devices=4, dp=1, tp=("1d",), front=False), model_name=name).best
    assert plan is not None and plan.mesh == {"dp": 1, "tp": 4}
    assert plan.shards_nothing and plan.tp == "none"
    note = plan.shards_nothing_note()
    assert "shards nothing" in note and "4 devices" in note and "too small" in note
    assert note in format_plan(Plan.model_validate_json(plan.model_dump_json()), graph=graph)
    sharded = search(graph, SearchConfig(devices=4, dp=1, tp=("1d",), front=False, objective="memory"), model_name=name).best
    assert sharded is not None and not sharded.shards_nothing and sharded.shards_nothing_note() == ""
