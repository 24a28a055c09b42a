"""GPT: a decoder-only, pre-LayerNorm causal language model (GPT-2/3 style).

Shapes: ``idx: [B, T]`` int64 token ids with ``T <= block_size``;
``logits: [B, T, V_pad]`` where ``V_pad = padded_vocab_size``.

The loss is the mean token-level cross entropy
``L = -1/(B T) * sum_{b,t} log softmax(logits[b, t])[targets[b, t]]``.

Vocabulary padding: the embedding table and LM head have
``V_pad = ceil(vocab_size / vocab_multiple) * vocab_multiple`` rows, as in
Megatron-LM and nanoGPT, so that the vocabulary dimension shards evenly and
hits efficient matmul shapes; for GPT-2's 50257 tokens and a multiple of 128
this is 50304. The padded rows are never targets, so their logits only act
as extra (learned-to-be-unlikely) classes.

Presets (``GPT_PRESETS``):

* ``gpt-tiny``: 2 layers, 8 heads, width 64, context 16, vocab 256. For fast,
  multi-process float64 tests; heads and width divide by 8 for 3-D sharding.
* ``gpt2-small``: the 124M GPT-2 (12 layers, 12 heads, width 768, context
  1024, vocab 50257).
* ``gpt3-1.3b``, ``gpt3-13b``, ``gpt3-175b``: the published GPT-3 shapes
  (Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1),
  all with context 2048 and the 50257-token GPT-2 vocabulary, with two
  deviations so that ``n_embd`` is an exact multiple of ``n_head``:

  - GPT-3 XL (1.3B) lists d_model 2048 with 24 heads of 128 (24 * 128 =
    3072 != 2048); we use 16 heads of 128.
  - GPT-3 13B lists d_model 5140 with 40 heads (5140 / 40 = 128.5); we use
    d_model 5120, i.e. 40 heads of 128.

  GPT-3 175B is used as published: 96 layers, 96 heads, d_model 12288.
  GPT-3's alternating locally banded sparse attention is not modelled;
  every layer uses dense causal attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.inputs import Inputs, rand_int
from planner.models.transformer import Block, init_weights

__all__ = ["GPT", "GPT_PRESETS", "GPTConfig", "gpt_example_inputs", "num_params"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and regularisation hyper-parameters of a :class:`GPT`."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    """Maximum (and example-input) sequence length ``T``."""
    vocab_size: int
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    vocab_multiple: int = 128

    def __post_init__(self) -> None:
        for field in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head}); n_embd % n_head = {self.n_embd % self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {self.vocab_multiple}")

    @property
    def padded_vocab_size(self) -> int:
        """``ceil(vocab_size / vocab_multiple) * vocab_multiple``."""
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        """Per-head width ``n_embd // n_head``."""
        return self.n_embd // self.n_head


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``x_0 = Dropout(wte[idx] + wpe[0..T-1])``; ``x_l = Block_l(x_{l-1})``;
    ``logits = LN_f(x_L) W_head^T`` with ``W_head = wte.weight`` when tied.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.wte = nn.Embedding(c.padded_vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(
            Block(c.n_embd, c.n_head, causal=True, bias=c.bias, dropout=c.dropout)
            for _ in range(c.n_layer)
        )
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.padded_vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def reset_parameters(self, std: float = 0.02) -> None:
        """Re-initialise every submodule with :func:`init_weights`."""
        self.apply(lambda m: init_weights(m, std=std))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``idx: [B, T]`` -> ``logits: [B, T, V_pad]``, or the scalar mean
        cross-entropy loss when ``targets: [B, T]`` is given."""
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def num_params(model: nn.Module) -> int:
    """Number of scalar parameters, counting shared (tied) tensors once.

    ``nn.Module.parameters`` already de-duplicates parameters by identity, so
    a tied ``wte``/``lm_head`` weight contributes ``V_pad * n_embd`` once.
    Works on meta-device models.
    """
    return sum(p.numel() for p in model.parameters())


def gpt_example_inputs(
    config: GPTConfig,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> Inputs:
    """``((idx,), {"targets": targets})``, both int64 ``[batch, block_size]``
    in ``[0, vocab_size)``. ``dtype`` is unused (inputs are integer)."""
    del dtype
    shape = (batch, config.block_size)
    idx = rand_int(shape, config.vocab_size, device=device, generator=generator)
    targets = rand_int(shape, config.vocab_size, device=device, generator=generator)
    return (idx,), {"targets": targets}


GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(
        n_layer=2, n_head=8, n_embd=64, block_size=16, vocab_size=256
    ),
    # without biases (as Llama): no parameter whose true gradient is zero (the key bias is one),
    # so Adam's normalisation does not amplify rounding noise; used for AdamW same-math tests
    "gpt-tiny-nobias": GPTConfig(
        n_layer=2, n_head=8, n_embd=64, block_size=16, vocab_size=256, bias=False
    ),
    "gpt2-small": GPTConfig(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257
    ),
    "gpt3-1.3b": GPTConfig(
        n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50257
    ),
    "gpt3-13b": GPTConfig(
        n_layer=40, n_head=40, n_embd=5120, block_size=2048, vocab_size=50257
    ),
    "gpt3-175b": GPTConfig(
        n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=50257
    ),
}
