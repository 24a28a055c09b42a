"""A plain multi-layer perceptron classifier.

Shapes: ``x: [B, in_features] -> logits: [B, out_features]``.

``h_0 = x``; ``h_i = GELU(h_{i-1} W_i + b_i)`` for ``i = 1..n_layers`` with
``W_1: [in_features, hidden]`` and ``W_i: [hidden, hidden]`` for ``i > 1``;
``logits = h_n W_head + b_head`` with ``W_head: [hidden, out_features]``.
The loss is the mean cross entropy of ``logits`` against integer class
targets ``[B]``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.inputs import Inputs, rand_int, rand_normal
from planner.models.transformer import init_weights

__all__ = ["MLP", "MLP_PRESETS", "MLPConfig", "mlp_example_inputs"]


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Widths and depth of an :class:`MLP`."""

    in_features: int
    hidden: int
    out_features: int
    """Number of classes."""
    n_layers: int
    """Number of hidden ``Linear + GELU`` layers (the head is extra)."""
    bias: bool = True

    def __post_init__(self) -> None:
        for field in ("in_features", "hidden", "out_features", "n_layers"):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")


class DenseGELU(nn.Module):
    """``y = GELU(x W + b)`` (exact GELU); ``[..., d_in] -> [..., d_out]``."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, bias=bias)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., d_in] -> [..., d_out]``."""
        return self.act(self.fc(x))


class MLP(nn.Module):
    """``n_layers`` :class:`DenseGELU` layers followed by a linear head."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        widths = [c.in_features] + [c.hidden] * c.n_layers
        self.layers = nn.ModuleList(
            DenseGELU(d_in, d_out, bias=c.bias)
            for d_in, d_out in itertools.pairwise(widths)
        )
        self.head = nn.Linear(c.hidden, c.out_features, bias=c.bias)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Re-initialise every submodule with :func:`init_weights`."""
        self.apply(lambda m: init_weights(m, std=std))

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x: [B, in_features]`` -> ``logits: [B, out_features]``, or the
        scalar mean cross-entropy loss when ``targets: [B]`` is given."""
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)


def mlp_example_inputs(
    config: MLPConfig,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> Inputs:
    """``((x,), {"targets": targets})`` with ``x: [batch, in_features]`` of
    ``dtype`` ~ N(0, 1) and int64 ``targets: [batch]`` in ``[0, out_features)``."""
    x = rand_normal(
        (batch, config.in_features), dtype=dtype, device=device, generator=generator
    )
    targets = rand_int(
        (batch,), config.out_features, device=device, generator=generator
    )
    return (x,), {"targets": targets}


MLP_PRESETS: dict[str, MLPConfig] = {
    "mlp-tiny": MLPConfig(in_features=16, hidden=32, out_features=8, n_layers=2),
    "mlp-large": MLPConfig(
        in_features=1024, hidden=4096, out_features=1000, n_layers=4
    ),
}
