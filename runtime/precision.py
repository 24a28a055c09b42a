"""Mixed precision (Micikevicius et al. 2018): compute in a low dtype, update in a high one.

The compiled module's parameters and gradients stay in the traced (compute) dtype, e.g. bfloat16;
:class:`MasterWeights` keeps a master copy of each parameter it is given in ``master_dtype``
(float32) and runs the torch optimizer on those copies, so its states are in ``master_dtype`` too.
A step casts each gradient up into a transient master gradient, steps, frees the master gradients,
and casts the updated masters back into the parameters. Under ZeRO-1/2 it is given the
data-parallel slices, so masters and states are held 1/D, as the planner prices them
(:func:`planner.cost.optimizer_bytes_per_value`).

Loss scaling for float16 is the caller's (``torch.amp.GradScaler`` semantics); bfloat16 needs none.
"""

from __future__ import annotations

from typing import Any

import torch


class OptimizerWrapper:
    """What the runtime's optimizer wrappers share: the torch optimizer (or wrapper) they drive,
    ``inner``, whose state and param groups they expose, and the model parameters whose gradients
    ``zero_grad`` drops besides the inner optimizer's (``wrapped_params``)."""

    inner: Any

    def wrapped_params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.wrapped_params():
            p.grad = None

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups  # type: ignore[no-any-return]


def find_master_weights(optimizer: Any) -> MasterWeights | None:
    """The MasterWeights inside a chain of wrappers (``.inner``), if any."""
    while optimizer is not None:
        if isinstance(optimizer, MasterWeights):
            return optimizer
        optimizer = getattr(optimizer, "inner", None)
    return None


class MasterWeights(OptimizerWrapper):
    """A torch optimizer over ``master_dtype`` copies of ``params``; ``step`` writes them back."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer_class: type[torch.optim.Optimizer], master_dtype: torch.dtype, **kwargs: Any) -> None:
        self.params = list(params)
        self.masters = [torch.nn.Parameter(p.detach().to(master_dtype, copy=True)) for p in self.params]
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        self.inner = optimizer_class(self.masters, **kwargs)

    def master_of(self, param: torch.Tensor) -> torch.nn.Parameter:
        return self._master_of[id(param)]

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().to(m.dtype)
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)
                m.grad = None  # master gradients live only during the step

    def wrapped_params(self) -> list[torch.Tensor]:
        return list(self.params)
