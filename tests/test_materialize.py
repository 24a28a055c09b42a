"""runtime.materialize: a model built on the meta device gets, tensor by tensor, the values its CPU
twin (built after the same torch.manual_seed) holds, one parameter alive at a time.

The sharded case (each rank keeps its shards, then trains as its CPU twin does) runs in
tests/test_same_math.py's 4-rank world ("... from meta")."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from planner.models import build_model
from planner.models.gpt import GPT, GPTConfig
from planner.runtime.materialize import MaterializeError, materialize
from tests.memory_probe import allocator_count, counting_every_thread, peak_count


def _meta_twin(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(name, device="meta", seed=None)
    torch.manual_seed(0)  # as before the CPU build: the replay draws what it drew
    return model


@pytest.mark.parametrize("name", ["gpt-tiny", "vit-tiny", "mlp-tiny", "gpt-tiny-nobias"])
def test_every_tensor_equals_the_cpu_build_bit_for_bit(name: str) -> None:
    want = dict(build_model(name, seed=0).named_parameters())
    got: dict[str, torch.Tensor] = {}
    materialize(_meta_twin(name), lambda n, t: got.__setitem__(n, t.clone()))
    assert set(got) == set(want), set(got) ^ set(want)  # tied weights once, under their first name
    for n, p in want.items():
        assert torch.equal(got[n], p), n


def test_peak_while_materialising_is_the_kept_shards_plus_the_largest_parameter() -> None:
    """Each parameter's quarter kept (what a rank of 4 keeps under ZeRO-3 or 1-D): the allocator's
    peak is the quarters plus one whole parameter at a time (and the replay's bookkeeping, < 64 KiB)."""
    config = GPTConfig(n_layer=3, n_head=4, n_embd=256, block_size=64, vocab_size=2048)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    kept: dict[str, torch.Tensor] = {}

    def keep(name: str, full: torch.Tensor) -> None:
        kept[name] = full.chunk(4)[1].clone()

    with counting_every_thread():
        before = allocator_count()
        peak = peak_count(lambda: materialize(model, keep)) - before
    shards = sum(t.numel() * t.element_size() for t in kept.values())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert shards < total / 3  # the point of it
    assert peak <= shards + largest + 64 * 1024, (peak, shards, largest)


class _MadeInConstructor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))  # a value no reset_parameters() writes


def test_a_parameter_the_constructor_made_is_named_with_the_remedy() -> None:
    with torch.device("meta"):
        model = _MadeInConstructor()
    with pytest.raises(MaterializeError, match=r"no initialisation writes scale .*reset_parameters\(\).*init=.*load weights"):
        materialize(model, lambda n, t: None)


def test_an_init_of_ones_own_sets_what_the_constructor_made() -> None:
    def init(model: nn.Module) -> None:
        model.lin.reset_parameters()
        nn.init.normal_(model.scale, std=0.5)
        model.scale.data.mul_(2)  # reads what it wrote: replayed on the real tensor

    torch.manual_seed(3)
    cpu = _MadeInConstructor()
    state = torch.get_rng_state()  # where init starts drawing on the CPU
    init(cpu)
    with torch.device("meta"):
        meta = _MadeInConstructor()
    torch.set_rng_state(state)
    got: dict[str, torch.Tensor] = {}
    materialize(meta, lambda n, t: got.__setitem__(n, t.clone()), init=init)
    for n, p in cpu.named_parameters():
        assert torch.equal(got[n], p), n


def test_an_init_that_reads_values_says_it_cannot_run_on_meta() -> None:
    def init(model: nn.Module) -> None:
        nn.init.normal_(model.weight)
        if model.weight.sum().item() > 0:  # a value: meta tensors have none
            model.weight.data.neg_()

    with torch.device("meta"):
        model = nn.Linear(3, 3)
    with pytest.raises(MaterializeError, match="reads tensor values"):
        materialize(model, lambda n, t: None, init=init)


def test_a_tied_weight_is_materialised_once_with_its_last_writers_values() -> None:
    """GPT ties its head to the embedding: the head's init writes the shared tensor last."""
    config = dataclasses.replace(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32), tie_embeddings=True)
    torch.manual_seed(1)
    cpu = GPT(config)
    cpu.reset_parameters()
    torch.manual_seed(1)
    with torch.device("meta"):
        meta = GPT(config)
    torch.manual_seed(1)
    got: dict[str, torch.Tensor] = {}
    materialize(meta, lambda n, t: got.__setitem__(n, t.clone()))
    assert "lm_head.weight" not in got and torch.equal(got["wte.weight"], cpu.lm_head.weight)
