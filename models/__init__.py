"""Model zoo and registry: GPT language models, MLP and ViT classifiers.

Every registered model's ``forward(*args, **kwargs)`` with the inputs from
:func:`example_inputs` returns the scalar training loss, so the planner can
treat all models uniformly::

    model = build_model("gpt-tiny", dtype=torch.float64)
    args, kwargs = example_inputs("gpt-tiny", batch=4, dtype=torch.float64)
    loss = model(*args, **kwargs)

``build_model(name, device="meta")`` allocates no storage, which is how the
large presets (up to ``gpt3-175b``) are inspected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import nn

from planner.models.gpt import GPT, GPT_PRESETS, GPTConfig, gpt_example_inputs, num_params
from planner.models.hf import HF_PRESETS, build_hf_model, hf_example_inputs
from planner.models.inputs import InputFactory, Inputs
from planner.models.mlp import MLP, MLP_PRESETS, MLPConfig, mlp_example_inputs
from planner.models.transformer import Attention, Block, MLPBlock, init_weights
from planner.models.vit import VIT_PRESETS, ViT, ViTConfig, vit_example_inputs

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "MLP",
    "MLP_PRESETS",
    "VIT_PRESETS",
    "Attention",
    "Block",
    "Family",
    "GPTConfig",
    "Inputs",
    "MLPBlock",
    "MLPConfig",
    "ModelSpec",
    "ViT",
    "ViTConfig",
    "available_models",
    "build_model",
    "example_inputs",
    "get_spec",
    "init_weights",
    "num_params",
]

Family = Literal["gpt", "mlp", "vit"]
ModelConfig = GPTConfig | MLPConfig | ViTConfig


@dataclass(frozen=True)
class ModelSpec:
    """A named model preset.

    ``build()`` constructs the module on the current default device (with
    PyTorch's default initialisation); ``example_inputs(batch, device, dtype,
    generator)`` returns ``(args, kwargs)`` for ``forward`` yielding the loss.
    """

    name: str
    family: Family
    config: ModelConfig
    build: Callable[..., nn.Module]
    example_inputs: InputFactory


def _specs() -> dict[str, ModelSpec]:
    specs: list[ModelSpec] = []
    for name, gpt_cfg in GPT_PRESETS.items():
        specs.append(
            ModelSpec(
                name=name,
                family="gpt",
                config=gpt_cfg,
                build=partial(GPT, gpt_cfg),
                example_inputs=partial(gpt_example_inputs, gpt_cfg),
            )
        )
    for name, mlp_cfg in MLP_PRESETS.items():
        specs.append(
            ModelSpec(
                name=name,
                family="mlp",
                config=mlp_cfg,
                build=partial(MLP, mlp_cfg),
                example_inputs=partial(mlp_example_inputs, mlp_cfg),
            )
        )
    for name, vit_cfg in VIT_PRESETS.items():
        specs.append(
            ModelSpec(
                name=name,
                family="vit",
                config=vit_cfg,
                build=partial(ViT, vit_cfg),
                example_inputs=partial(vit_example_inputs, vit_cfg),
            )
        )
    registry = {spec.name: spec for spec in specs}
    if len(registry) != len(specs):
        raise RuntimeError("duplicate model preset names")
    return registry


_REGISTRY: dict[str, ModelSpec] = _specs()


def available_models() -> list[str]:
    """Names of all registered presets, sorted: ours, then the ``hf-*`` Hugging Face ones
    (:mod:`models.hf`, built by ``transformers`` from tiny configs) where it is installed."""
    return sorted(_REGISTRY) + (sorted(HF_PRESETS) if _has_transformers() else [])


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def get_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` for ``name``; ``ValueError`` if unknown."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; available: {', '.join(available_models())}"
        ) from None


def build_model(
    name: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> nn.Module:
    """Construct and initialise preset ``name`` on ``device``.

    Construction runs under ``with torch.device(device)``, so ``"meta"``
    allocates no storage. Unless ``device`` is meta, ``torch.manual_seed(seed)``
    is called first when ``seed`` is not None (this reseeds the global RNG),
    making the weights reproducible. Weights are then (re)initialised with
    :func:`~models.transformer.init_weights` (``N(0, 0.02^2)`` weights, zero
    biases, unit LayerNorm gains) and finally cast to ``dtype`` if given;
    tied parameters stay tied through the cast.
    """
    if name in HF_PRESETS:
        return build_hf_model(name, device=device, dtype=dtype, seed=seed)
    spec = get_spec(name)
    device = torch.device(device)
    if seed is not None and device.type != "meta":
        torch.manual_seed(seed)
    with device:
        model = spec.build()
        model.reset_parameters()  # type: ignore[operator]
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def example_inputs(
    name: str,
    *,
    batch: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Inputs:
    """``(args, kwargs)`` such that ``model(*args, **kwargs)`` is the scalar loss.

    * GPT: ``(idx,), {"targets": targets}``, int64 ``[batch, block_size]``.
    * MLP: ``(x,), {"targets": targets}``, ``x: [batch, in_features]``.
    * ViT: ``(images,), {"targets": targets}``,
      ``images: [batch, in_channels, image_size, image_size]``.

    Targets are int64 class / token ids; floating inputs use ``dtype``.
    Values come from a private CPU generator seeded with ``seed`` (the global
    RNG is untouched); on the meta device only shapes are produced.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if name in HF_PRESETS:
        return hf_example_inputs(name, batch=batch, device=device, dtype=dtype, seed=seed)
    spec = get_spec(name)
    generator = torch.Generator().manual_seed(seed)
    return spec.example_inputs(batch, torch.device(device), dtype, generator)
