"""Tests for the ``models`` package (CPU only, a few seconds in total)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from planner.models import (
    GPT,
    GPT_PRESETS,
    MLP_PRESETS,
    VIT_PRESETS,
    Attention,
    GPTConfig,
    MLPConfig,
    ViT,
    ViTConfig,
    available_models,
    build_model,
    example_inputs,
    get_spec,
    num_params,
)
from planner.models.hf import HF_PRESETS

TINY = ["gpt-tiny", "mlp-tiny", "vit-tiny"]


def _block_params(h: int, bias: bool = True) -> int:
    """Parameters of one pre-LN transformer block of width ``h``."""
    weights = 4 * h * h + 8 * h * h  # q, k, v, out + fc, proj
    biases = (4 * h + 4 * h + h) if bias else 0
    layer_norms = 2 * (2 * h if bias else h)
    return weights + biases + layer_norms


def _expected_params(name: str) -> int:
    spec = get_spec(name)
    c = spec.config
    if isinstance(c, GPTConfig):
        embeddings = c.padded_vocab_size * c.n_embd + c.block_size * c.n_embd
        head = 0 if c.tie_embeddings else c.padded_vocab_size * c.n_embd
        ln_f = 2 * c.n_embd if c.bias else c.n_embd
        return embeddings + c.n_layer * _block_params(c.n_embd, c.bias) + ln_f + head
    if isinstance(c, MLPConfig):
        widths = [c.in_features] + [c.hidden] * c.n_layers + [c.out_features]
        return sum(a * b + (b if c.bias else 0) for a, b in itertools.pairwise(widths))
    assert isinstance(c, ViTConfig)
    h = c.n_embd
    return (
        c.patch_dim * h
        + h  # patch embedding
        + h  # cls token
        + (c.num_patches + 1) * h  # position embedding
        + c.n_layer * _block_params(h, c.bias)
        + (2 * h if c.bias else h)  # ln_f
        + h * c.num_classes
        + c.num_classes  # head
    )


# --------------------------------------------------------------------- registry


def test_registry_lists_all_presets() -> None:
    expected = {*GPT_PRESETS, *MLP_PRESETS, *VIT_PRESETS}
    assert set(available_models()) == expected | set(HF_PRESETS)  # transformers is a dev dependency
    assert {get_spec(n).family for n in expected} == {"gpt", "mlp", "vit"}


def test_unknown_model_lists_available() -> None:
    with pytest.raises(ValueError, match="gpt-tiny"):
        build_model("no-such-model")
    with pytest.raises(ValueError, match="available"):
        example_inputs("no-such-model", batch=1)


@pytest.mark.parametrize("name", sorted({*GPT_PRESETS, *MLP_PRESETS, *VIT_PRESETS}))
def test_preset_builds_on_meta(name: str) -> None:
    model = build_model(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert num_params(model) == _expected_params(name)


def test_published_parameter_counts() -> None:
    n_175b = num_params(build_model("gpt3-175b", device="meta"))
    assert 170e9 < n_175b < 180e9
    # GPT-2 small: 124,439,808 with vocab 50257; padding adds 47 rows of 768.
    assert GPT_PRESETS["gpt2-small"].padded_vocab_size == 50304
    assert num_params(build_model("gpt2-small", device="meta")) == (
        124_439_808 + (50304 - 50257) * 768
    )
    # ViT-B/16 with a 1000-class head.
    assert num_params(build_model("vit-base", device="meta")) == 86_567_656


# ------------------------------------------------------------------ validation


def test_configs_validate_with_numbers() -> None:
    with pytest.raises(ValueError, match=r"n_embd \(100\).*n_head \(3\)"):
        GPTConfig(n_layer=1, n_head=3, n_embd=100, block_size=4, vocab_size=10)
    with pytest.raises(ValueError, match="n_layers"):
        MLPConfig(in_features=2, hidden=2, out_features=2, n_layers=0)
    with pytest.raises(ValueError, match=r"image_size \(30\).*patch_size \(4\)"):
        ViTConfig(
            image_size=30, patch_size=4, n_layer=1, n_head=1, n_embd=8, num_classes=2
        )


def test_configs_are_frozen_and_keyword_only() -> None:
    cfg = GPT_PRESETS["gpt-tiny"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPTConfig(1, 1, 8, 4, 10)  # type: ignore[misc]


def test_padded_vocab_size() -> None:
    cfg = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=129)
    assert cfg.padded_vocab_size == 256
    assert dataclasses.replace(cfg, vocab_multiple=1).padded_vocab_size == 129


# ----------------------------------------------------------- numerics (float64)


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_float64(name: str) -> None:
    model = build_model(name, dtype=torch.float64)
    args, kwargs = example_inputs(name, batch=3, dtype=torch.float64)
    loss = model(*args, **kwargs)
    assert loss.dim() == 0 and loss.dtype == torch.float64
    assert torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", TINY)
def test_build_is_reproducible(name: str) -> None:
    a = build_model(name, seed=1).state_dict()
    b = build_model(name, seed=1).state_dict()
    c = build_model(name, seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_tied_weights_are_tied() -> None:
    for device, dtype in [("cpu", torch.float64), ("meta", None)]:
        model = build_model("gpt-tiny", device=device, dtype=dtype)
        assert isinstance(model, GPT)
        assert model.lm_head.weight is model.wte.weight
    model = build_model("gpt-tiny", dtype=torch.float64)
    assert isinstance(model, GPT)
    args, kwargs = example_inputs("gpt-tiny", batch=2)
    model(*args, **kwargs).backward()
    assert model.wte.weight.grad is model.lm_head.weight.grad
    untied = GPT(dataclasses.replace(GPT_PRESETS["gpt-tiny"], tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight


def test_gpt_dropout_zero_is_deterministic() -> None:
    cfg = GPT_PRESETS["gpt-tiny"]
    (idx,), _ = example_inputs("gpt-tiny", batch=2)
    torch.manual_seed(0)
    model = GPT(cfg).double()
    train_out = model.train()(idx)
    eval_out = model.eval()(idx)
    torch.testing.assert_close(train_out, eval_out, rtol=0, atol=0)
    assert train_out.shape == (2, cfg.block_size, cfg.padded_vocab_size)
    # A dropout model in eval mode computes the same function.
    with_dropout = GPT(dataclasses.replace(cfg, dropout=0.5)).double()
    with_dropout.load_state_dict(model.state_dict())
    torch.testing.assert_close(with_dropout.eval()(idx), eval_out, rtol=0, atol=0)
    assert not torch.equal(with_dropout.train()(idx), eval_out)


def test_gpt_is_causal() -> None:
    model = build_model("gpt-tiny", dtype=torch.float64)
    (idx,), _ = example_inputs("gpt-tiny", batch=2)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % GPT_PRESETS["gpt-tiny"].vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_reference(causal: bool) -> None:
    torch.manual_seed(0)
    B, T, C, H = 2, 5, 16, 4
    attn = Attention(C, H, causal=causal, bias=True, dropout=0.0).double()
    x = torch.randn(B, T, C, dtype=torch.float64)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, T, H, C // H).transpose(1, 2)

    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x))
    scores = q @ k.transpose(-2, -1) / math.sqrt(C // H)
    if causal:
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    torch.testing.assert_close(attn(x), attn.out_proj(y))


def test_vit_patchify_matches_unfold() -> None:
    model = build_model("vit-tiny")
    assert isinstance(model, ViT)
    p = model.config.patch_size
    (images,), _ = example_inputs("vit-tiny", batch=2)
    expected = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)
    torch.testing.assert_close(model.patchify(images), expected, rtol=0, atol=0)


# -------------------------------------------------------------- example inputs


def test_example_input_shapes() -> None:
    gpt = GPT_PRESETS["gpt-tiny"]
    (idx,), kw = example_inputs("gpt-tiny", batch=4)
    assert idx.shape == kw["targets"].shape == (4, gpt.block_size)
    assert idx.dtype == kw["targets"].dtype == torch.long
    assert int(idx.min()) >= 0 and int(idx.max()) < gpt.vocab_size

    mlp = MLP_PRESETS["mlp-tiny"]
    (x,), kw = example_inputs("mlp-tiny", batch=4, dtype=torch.float64)
    assert x.shape == (4, mlp.in_features) and x.dtype == torch.float64
    assert kw["targets"].shape == (4,) and int(kw["targets"].max()) < mlp.out_features

    vit = VIT_PRESETS["vit-tiny"]
    (images,), kw = example_inputs("vit-tiny", batch=4)
    size = (4, vit.in_channels, vit.image_size, vit.image_size)
    assert images.shape == size and images.dtype == torch.float32
    assert kw["targets"].shape == (4,) and int(kw["targets"].max()) < vit.num_classes


def test_example_inputs_are_seeded_and_meta_capable() -> None:
    a, _ = example_inputs("mlp-tiny", batch=2, seed=3)
    b, _ = example_inputs("mlp-tiny", batch=2, seed=3)
    assert torch.equal(a[0], b[0])
    (idx,), _ = example_inputs("gpt3-175b", batch=8, device="meta")
    assert idx.device.type == "meta" and idx.shape == (8, 2048)
    model = build_model("gpt2-small", device="meta")
    args, kwargs = example_inputs("gpt2-small", batch=2, device="meta")
    loss = model(*args, **kwargs)
    assert loss.device.type == "meta" and loss.dim() == 0


# ---------------------------------------------------------------------- export


@pytest.mark.parametrize("name", TINY)
def test_torch_export(name: str) -> None:
    model = build_model(name)
    args, kwargs = example_inputs(name, batch=2)
    exported = torch.export.export(model, args, kwargs, strict=False)
    torch.testing.assert_close(
        exported.module()(*args, **kwargs), model(*args, **kwargs)
    )
