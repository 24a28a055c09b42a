"""Vision Transformer (ViT, Dosovitskiy et al. 2021) image classifier.

Shapes, with ``p = patch_size``, ``N = (image_size // p) ** 2`` patches and
``C = n_embd``:

* ``images: [B, in_channels, H, W]`` with ``H = W = image_size``;
* patchify (view/permute only, no convolution):
  ``[B, c, H, W] -> [B, c, H/p, p, W/p, p] -> [B, H/p, W/p, c, p, p]
  -> [B, N, c p p]``;
* tokens ``x_0 = Dropout(concat(cls, patches W_e + b_e) + pos_embed)``:
  ``[B, N + 1, C]``;
* ``n_layer`` bidirectional pre-LN :class:`~models.transformer.Block` s;
* ``logits = LN_f(x_L)[:, 0] W_head + b_head``: ``[B, num_classes]``.

A linear patch embedding on flattened ``c p p`` patches is the same map as
the paper's stride-``p`` convolution, with the same parameter count.

Presets: ``vit-tiny`` (16x16 images, 4x4 patches, 2 layers, 8 heads, width
64, 10 classes) for tests; ``vit-base`` is ViT-B/16 (224x224, 16x16 patches,
12 layers, 12 heads, width 768, 1000 classes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.inputs import Inputs, rand_int, rand_normal
from planner.models.transformer import Block, init_weights

__all__ = ["VIT_PRESETS", "ViT", "ViTConfig", "vit_example_inputs"]


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    """Image geometry and transformer shape of a :class:`ViT`."""

    image_size: int
    patch_size: int
    in_channels: int = 3
    n_layer: int
    n_head: int
    n_embd: int
    num_classes: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for field in (
            "image_size",
            "patch_size",
            "in_channels",
            "n_layer",
            "n_head",
            "n_embd",
            "num_classes",
        ):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if self.image_size % self.patch_size != 0:
            raise ValueError(
                f"image_size ({self.image_size}) must be divisible by patch_size "
                f"({self.patch_size}); remainder {self.image_size % self.patch_size}"
            )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head}); n_embd % n_head = {self.n_embd % self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def num_patches(self) -> int:
        """``(image_size // patch_size) ** 2``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        """Flattened patch length ``in_channels * patch_size ** 2``."""
        return self.in_channels * self.patch_size**2


class ViT(nn.Module):
    """Vision Transformer classifier reading out the ``[CLS]`` token."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = nn.Linear(c.patch_dim, c.n_embd)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.n_embd))
        self.pos_embed = nn.Parameter(torch.zeros(1, c.num_patches + 1, c.n_embd))
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(
            Block(c.n_embd, c.n_head, causal=False, bias=c.bias, dropout=c.dropout)
            for _ in range(c.n_layer)
        )
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.head = nn.Linear(c.n_embd, c.num_classes)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """:func:`init_weights` on submodules; ``cls_token``, ``pos_embed``
        ~ ``N(0, std^2)``."""
        self.apply(lambda m: init_weights(m, std=std))
        nn.init.normal_(self.cls_token, std=std)
        nn.init.normal_(self.pos_embed, std=std)

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, c, H, W] -> [B, N, c p p]``; each row is one patch, row-major
        over the patch grid, flattened in ``(channel, row, col)`` order."""
        B, C, H, W = images.shape
        p = self.config.patch_size
        n_patches = (H // p) * (W // p)
        x = images.view(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, n_patches, C * p * p)

    def forward(
        self, images: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``images: [B, c, H, W]`` -> ``logits: [B, num_classes]``, or the
        scalar mean cross-entropy loss when ``targets: [B]`` is given."""
        x = self.patch_embed(self.patchify(images))
        cls = self.cls_token.expand(x.size(0), -1, -1)
        x = self.drop(torch.cat((cls, x), dim=1) + self.pos_embed)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = self.head(x[:, 0])
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)


def vit_example_inputs(
    config: ViTConfig,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> Inputs:
    """``((images,), {"targets": targets})`` with ``images`` of ``dtype``
    ``[batch, in_channels, image_size, image_size]`` ~ N(0, 1) and int64
    ``targets: [batch]`` in ``[0, num_classes)``."""
    s = config.image_size
    images = rand_normal(
        (batch, config.in_channels, s, s),
        dtype=dtype,
        device=device,
        generator=generator,
    )
    targets = rand_int((batch,), config.num_classes, device=device, generator=generator)
    return (images,), {"targets": targets}


VIT_PRESETS: dict[str, ViTConfig] = {
    "vit-tiny": ViTConfig(
        image_size=16, patch_size=4, n_layer=2, n_head=8, n_embd=64, num_classes=10
    ),
    "vit-base": ViTConfig(
        image_size=224,
        patch_size=16,
        n_layer=12,
        n_head=12,
        n_embd=768,
        num_classes=1000,
    ),
}
