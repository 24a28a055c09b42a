"""Deterministic random example inputs that also work on the meta device.

Values are drawn on the CPU from an explicit ``torch.Generator`` (so the
global RNG is never touched and results do not depend on the target device)
and then moved to ``device``. On the meta device only shapes and dtypes
exist, so an uninitialised meta tensor is returned instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["InputFactory", "Inputs", "rand_int", "rand_normal"]

Inputs = tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]
"""``(args, kwargs)`` such that ``model(*args, **kwargs)`` is the scalar loss."""

InputFactory = Callable[[int, torch.device, torch.dtype, torch.Generator], Inputs]
"""``(batch, device, float_dtype, generator) -> (args, kwargs)``."""


def rand_int(
    shape: Sequence[int],
    high: int,
    *,
    device: torch.device,
    generator: torch.Generator,
) -> torch.Tensor:
    """int64 tensor of ``shape`` with entries uniform in ``[0, high)``."""
    if device.type == "meta":
        return torch.empty(tuple(shape), dtype=torch.long, device=device)
    t = torch.randint(0, high, tuple(shape), dtype=torch.long, generator=generator)
    return t.to(device)


def rand_normal(
    shape: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
) -> torch.Tensor:
    """Tensor of ``shape`` and ``dtype`` with entries ~ ``N(0, 1)``."""
    if device.type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    t = torch.randn(tuple(shape), dtype=torch.float32, generator=generator)
    return t.to(device=device, dtype=dtype)
