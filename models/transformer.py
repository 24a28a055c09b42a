"""Transformer building blocks shared by the GPT and ViT models.

Notation: ``B`` batch, ``T`` sequence length, ``C = n_embd`` model width,
``H = n_head`` attention heads and ``D = C // H`` head width.

Every ``forward`` here is written to trace cleanly with ``torch.export``: no
shape asserts, no Python branching on tensor values and no mask slicing
(causality is requested from ``scaled_dot_product_attention`` via
``is_causal``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "Block", "MLPBlock", "init_weights"]


class Attention(nn.Module):
    """Multi-head (optionally causal) self-attention with separate projections.

    For ``x`` of shape ``[B, T, C]`` and each head ``i``::

        Q_i = x W_q[i],  K_i = x W_k[i],  V_i = x W_v[i]        # [B, T, D]
        A_i = softmax(Q_i K_i^T / sqrt(D) + M) V_i              # [B, T, D]
        y   = concat_i(A_i) W_o                                 # [B, T, C]

    where ``M`` is ``-inf`` above the diagonal when ``causal`` and zero
    otherwise. Dropout is applied to the attention probabilities (training
    only) and to the output projection.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        causal: bool,
        bias: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(
                f"n_embd ({n_embd}) must be divisible by n_head ({n_head}); "
                f"n_embd % n_head = {n_embd % n_head}"
            )
        self.n_embd = n_embd
        self.n_head = n_head
        self.causal = causal
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout_p = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def _split_heads(self, t: torch.Tensor, B: int, T: int, C: int) -> torch.Tensor:
        """``[B, T, C] -> [B, H, T, D]``. The head count follows the width (``-1``), so a
        projection sharded by output columns (PyTorch's ``ColwiseParallel``) leaves whole heads."""
        return t.view(B, T, -1, C // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, C] -> [B, T, C]``."""
        B, T, C = x.shape
        q = self._split_heads(self.q_proj(x), B, T, C)
        k = self._split_heads(self.k_proj(x), B, T, C)
        v = self._split_heads(self.v_proj(x), B, T, C)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.attn_dropout_p if self.training else 0.0,
            is_causal=self.causal,
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.out_proj(y))


class MLPBlock(nn.Module):
    """Position-wise feed-forward network.

    ``y = Dropout(GELU(x W_fc + b_fc) W_proj + b_proj)`` with
    ``W_fc: [C, m C]`` and ``W_proj: [m C, C]`` (``m = hidden_mult``), using
    the exact (erf) GELU. Shapes: ``[..., C] -> [..., C]``.
    """

    def __init__(
        self,
        n_embd: int,
        *,
        hidden_mult: int = 4,
        bias: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden_mult * n_embd, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden_mult * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., C] -> [..., C]``."""
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block.

    ``x = x + Attention(LN_1(x)); x = x + MLP(LN_2(x))``.
    Shapes: ``[B, T, C] -> [B, T, C]``.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        causal: bool,
        bias: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = Attention(n_embd, n_head, causal=causal, bias=bias, dropout=dropout)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLPBlock(n_embd, bias=bias, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, C] -> [B, T, C]``."""
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@torch.no_grad()
def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Initialise one module in place (use with ``model.apply``).

    * ``nn.Linear`` / ``nn.Embedding`` weights ~ ``N(0, std^2)``;
    * ``nn.Linear`` biases = 0;
    * ``nn.LayerNorm`` weight = 1, bias = 0.

    Other modules are left untouched. On the meta device the ``nn.init``
    calls only record shapes, so this is a cheap no-op there.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
