"""Hugging Face ``transformers`` models built from tiny configs (no download): the models nobody here
wrote, that the planner and the runtime are tested on.

``build_hf_model("hf-llama", dtype=torch.float64)`` builds one (seeded, dropout 0, the key/value
cache off); ``hf_example_inputs("hf-llama", batch=8)`` gives ``(args, kwargs)`` with labels, so that
``model(*args, **kwargs).loss`` is the training loss. ``transformers`` is imported here only (it
is in the ``dev`` extras).

Every config is small enough for float64 gloo tests on 8 ranks and shaped for them: hidden 32
over 4 attention heads (2 key/value heads where the architecture has grouped-query attention),
2 layers, sequences of 8, a batch that the 2 x 2 x 2 cube divides.

**Loss precision.** Hugging Face's causal-LM loss upcasts the logits (``logits.float()``,
so that bfloat16 training computes its loss in float32); on a float64 model that makes the loss
float32 and a float64 comparison with one device meaningless below ~1e-7. :func:`keep_loss_dtype`
(applied by :func:`build_hf_model` to float64 causal LMs) gives the model the same loss computed in
the logits' own dtype when that is at least float32: the same shift, flattening, ignored labels and
mean as ``transformers.loss.loss_utils.ForCausalLMLoss`` (``tests/test_hf_models.py`` checks that
on a float32 model both give the same value). :func:`keep_router_dtype` does the same for the
float32 softmax of a mixture of experts' router.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from planner.models.inputs import Inputs

VOCAB, SEQ, CLASSES, IMAGE = 64, 8, 8, 16


@dataclass(frozen=True)
class HFPreset:
    """``model`` and ``config`` are class names in ``transformers``; ``task`` picks the inputs."""

    model: str
    config: str
    kwargs: dict[str, Any]
    task: str  # "causal-lm", "masked-lm", "seq2seq", "image"
    repeats: bool = True  # its blocks are structurally identical (T5's first block alone holds the position bias)


_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=VOCAB, max_position_embeddings=2 * SEQ)
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

HF_PRESETS: dict[str, HFPreset] = {
    "hf-gpt2": HFPreset("GPT2LMHeadModel", "GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=2 * SEQ,
                                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "causal-lm"),
    # the same with eager attention (q k^T, mask, softmax, dropout, p v as separate ops): what
    # selective recomputation recomputes (planner.schemes.recompute)
    "hf-gpt2-eager": HFPreset("GPT2LMHeadModel", "GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=2 * SEQ,
                                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"),
                              "causal-lm"),
    "hf-llama": HFPreset("LlamaForCausalLM", "LlamaConfig", _DECODER, "causal-lm"),
    "hf-qwen2": HFPreset("Qwen2ForCausalLM", "Qwen2Config", _DECODER, "causal-lm"),
    "hf-mistral": HFPreset("MistralForCausalLM", "MistralConfig", _DECODER | dict(sliding_window=4), "causal-lm"),
    "hf-mixtral": HFPreset("MixtralForCausalLM", "MixtralConfig", _DECODER | dict(num_local_experts=4, num_experts_per_tok=2),
                           "causal-lm"),
    "hf-qwen2-moe": HFPreset("Qwen2MoeForCausalLM", "Qwen2MoeConfig", _DECODER | dict(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                                                    num_experts=4, num_experts_per_tok=2), "causal-lm"),
    "hf-bert": HFPreset("BertForMaskedLM", "BertConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                                              vocab_size=VOCAB, max_position_embeddings=2 * SEQ, **_NO_DROPOUT),
                        "masked-lm"),
    "hf-vit": HFPreset("ViTForImageClassification", "ViTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                                      intermediate_size=64, image_size=IMAGE, patch_size=4, num_labels=CLASSES,
                                                                      **_NO_DROPOUT), "image"),
    "hf-t5": HFPreset("T5ForConditionalGeneration", "T5Config", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB,
                                                                     dropout_rate=0.0, decoder_start_token_id=0), "seq2seq", repeats=False),
    "hf-bart": HFPreset("BartForConditionalGeneration", "BartConfig", dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                                                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                                                                         max_position_embeddings=2 * SEQ, dropout=0.0, attention_dropout=0.0,
                                                                         activation_dropout=0.0), "seq2seq"),
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - a dev extra
        raise ImportError("the hf-* models need transformers: pip install -e '.[dev]' (or pip install transformers)") from exc
    transformers.logging.set_verbosity_error()  # tiny configs warn about special token ids outside the vocabulary
    return transformers


def _preset(name: str) -> HFPreset:
    try:
        return HF_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown Hugging Face preset {name!r}; available: {', '.join(sorted(HF_PRESETS))}") from None


def build_hf_model(name: str, *, dtype: torch.dtype | None = None, seed: int | None = 0, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The preset's model, initialised by ``transformers`` under ``torch.manual_seed(seed)``. Float64
    causal LMs get :func:`keep_loss_dtype` (and :func:`keep_router_dtype`); float64 mixtures of experts run their experts as batched
    matmuls (``experts_implementation="batched_mm"``: torch's CPU ``grouped_mm`` has no float64
    kernel), in other dtypes ``transformers``' default (grouped matmuls over expert-sorted rows)."""
    transformers = _transformers()
    preset = _preset(name)
    kwargs = dict(preset.kwargs)
    if dtype == torch.float64 and "num_experts_per_tok" in kwargs:
        kwargs["experts_implementation"] = "batched_mm"  # torch's CPU grouped_mm has no float64 kernel
    config = getattr(transformers, preset.config)(**kwargs)
    if seed is not None and torch.device(device).type != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, preset.model)(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    if dtype == torch.float64 and preset.task == "causal-lm":
        keep_loss_dtype(model)
        keep_router_dtype(model)
    return model.train()


def hf_example_inputs(name: str, *, batch: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Inputs:
    """``((), kwargs)``: token ids and labels (masked LM: every other label ignored, -100); images and
    class labels for the image model; labels of its own for encoder-decoders."""
    preset = _preset(name)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    kwargs: dict[str, torch.Tensor]
    if preset.task == "image":
        kwargs = {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=g).to(dtype), "labels": torch.randint(0, CLASSES, (batch,), generator=g)}
    elif preset.task == "seq2seq":
        kwargs = {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, SEQ), generator=g)}
    elif preset.task == "masked-lm":
        labels = ids.clone()
        labels[:, ::2] = -100
        kwargs = {"input_ids": ids, "labels": labels}
    else:
        kwargs = {"input_ids": ids, "labels": ids.clone()}
    return (), {k: v.to(device) for k, v in kwargs.items()}


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch: torch.Tensor | None = None,
                    ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if shift_labels is None:  # tokens < n predict token n
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    flat, target = logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is not None:
        return F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
    return F.cross_entropy(flat, target, ignore_index=ignore_index)


def _router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = F.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always normalises
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return logits, top_value.to(logits.dtype), top_index


def keep_router_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """Give a mixture of experts' top-k routers (Mixtral, Qwen2-MoE) their softmax in the logits'
    own dtype when that is float64 (transformers computes it in float32: a float64 router logit
    that sharding sums in another order, by one unit in the last place, can round to another
    float32 and move the gates by 1e-7). Same routing otherwise. Returns the model."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_forward, module)  # type: ignore[method-assign]
    return model


def keep_loss_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """Give a causal-LM ``model`` its Hugging Face loss computed in the logits' own dtype (float32 or
    float64; lower precisions are still upcast to float32). Returns the model."""
    model.loss_function = _causal_lm_loss  # type: ignore[assignment]
    return model
