"""A small language model made of the multi-output and indexing ops a plan must run sharded.

``ROUTED`` (used as ``"tests.ops_models:ROUTED"`` by tests/dist_checks.py): token embedding, a
norm from ``var_mean``, attention from one fused projection cut by ``split`` and re-joined by
``chunk``/``cat``, a top-k mixture of experts written by hand (``topk`` of the router's
probabilities, the gates ``scatter``-ed into a dense [tokens, experts] matrix and read back with
``gather``, experts as batched matmuls, gate and up projections cut by ``split_with_sizes``), torch's ``nn.RMSNorm`` (``aten.rms_norm``) and
a loss with extra terms from ``max.dim``, ``sort`` and ``unbind`` of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, EXPERTS, TOP_K, FFN, SEQ = 64, 32, 4, 4, 2, 16, 8


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * FFN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) * 0.1)
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.emb(ids)
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
        h = (x - mean) * torch.rsqrt(var + 1e-5)
        q, k, v = self.qkv(h).split(HIDDEN, dim=-1)
        q, k, v = (z.view(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, HIDDEN)
        left, right = self.proj(y).chunk(2, dim=-1)
        x = x + torch.cat([left, right], dim=-1)
        flat = x.reshape(b * t, HIDDEN)
        probs = F.softmax(self.router(flat), dim=-1)
        _, chosen = probs.topk(TOP_K, dim=-1)
        gates = torch.zeros_like(probs).scatter(1, chosen, probs.gather(1, chosen))
        up = torch.bmm(flat.unsqueeze(0).expand(EXPERTS, -1, -1), self.w_in)
        gate, lin = up.split_with_sizes([FFN, FFN], dim=-1)
        expert = torch.bmm(F.silu(gate) * lin, self.w_out)
        x = x + (expert * gates.t().unsqueeze(-1)).sum(0).view(b, t, HIDDEN)
        logits = self.head(self.norm(x))
        best, _ = logits.max(dim=-1)
        ranked, _ = logits.sort(dim=-1, descending=True)
        first, second = ranked[..., :2].unbind(-1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        return loss + 0.01 * (best.mean() + (first - second).mean())


@dataclass(frozen=True)
class _Spec:
    def build(self, *, dtype: torch.dtype, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return Routed().to(dtype)

    def inputs(self, *, batch: int, dtype: torch.dtype, seed: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, VOCAB, (batch, SEQ), generator=g),), {"targets": torch.randint(0, VOCAB, (batch, SEQ), generator=g)}


ROUTED = _Spec()
