"""Transformer Engine backend: the model's building blocks as TE modules (CUDA only).

Why these modules and not ``te.TransformerLayer``: the decoder layer (``llama.py``) composes
``LayerNormLinear`` (RMSNorm + fused QKV), ``DotProductAttention`` (fused/flash attention), ``Linear`` (output
projection) and ``LayerNormMLP`` (RMSNorm + SwiGLU) itself. These are exactly the modules ``TransformerLayer``
is made of, under the same attribute names, so the parameter names, shapes and FP8 behaviour are TE's; but the
decoder layer keeps RoPE, the KV cache for ``generate()`` and the padding-mask path in one place for both
backends, where ``TransformerLayer`` would hide them behind its own inference API.
"""

from __future__ import annotations

import torch
from torch import nn

import transformer_engine.pytorch as te
from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb

from llmjp_ds.model.torch_layers import apply_rope as torch_apply_rope
from llmjp_ds.model.torch_layers import split_qkv
from llmjp_ds.model.torch_layers import sdpa  # noqa: F401  (the masked / KV-cache path, shared by both backends)
from llmjp_ds.model.weight_reuse import ReusesFP8Weights


# MAIN_GRAD_WEIGHTS: the weights whose gradient TE's GEMM accumulates into ``main_grad``
# (llmjp_ds.parallel.deepspeed_internals)
class _LayerNormLinear(ReusesFP8Weights, te.LayerNormLinear):
    MAIN_GRAD_WEIGHTS = ("weight",)


class _Linear(ReusesFP8Weights, te.Linear):
    MAIN_GRAD_WEIGHTS = ("weight",)


class _LayerNormMLP(ReusesFP8Weights, te.LayerNormMLP):
    MAIN_GRAD_WEIGHTS = ("fc1_weight", "fc2_weight")


def _normal(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def _device_kwargs(params_dtype):
    return {"params_dtype": params_dtype or torch.get_default_dtype(), "device": "cuda"}


def _tp_kwargs(tp, parallel_mode=None) -> dict:
    """TE's own tensor parallelism (no userbuffers overlap: it needs NVLink multicast)."""
    if tp is None:
        return {}
    kwargs = {"tp_group": tp.group, "tp_size": tp.size, "sequence_parallel": tp.sequence_parallel}
    return kwargs if parallel_mode is None else {**kwargs, "parallel_mode": parallel_mode}


def RMSNorm(hidden_size: int, eps: float, params_dtype=None, tp=None):
    sp = {"sequence_parallel": True} if tp is not None and tp.sequence_parallel else {}
    return te.RMSNorm(hidden_size, eps=eps, **sp, **_device_kwargs(params_dtype))


def LayerNormLinear(in_features, out_features, eps, init_std, params_dtype=None, tp=None):
    return _LayerNormLinear(
        in_features, out_features, eps=eps, bias=False, normalization="RMSNorm",
        init_method=_normal(init_std), **_tp_kwargs(tp, "column"), **_device_kwargs(params_dtype),
    )


def Linear(in_features, out_features, init_std, params_dtype=None, tp=None, parallel_mode=None):
    return _Linear(in_features, out_features, bias=False, init_method=_normal(init_std),
                   **_tp_kwargs(tp, parallel_mode), **_device_kwargs(params_dtype))


def LayerNormMLP(hidden_size, ffn_hidden_size, eps, init_std, output_std, params_dtype=None, tp=None):
    return _LayerNormMLP(
        hidden_size, ffn_hidden_size, eps=eps, bias=False, normalization="RMSNorm", activation="swiglu",
        init_method=_normal(init_std), output_layer_init_method=_normal(output_std),
        # set_parallel_mode: fc1 column- and fc2 row-parallel (without it TE would split fc1 and never reduce)
        **({} if tp is None else {**_tp_kwargs(tp), "set_parallel_mode": True}), **_device_kwargs(params_dtype),
    )


def DotProductAttention(num_attention_heads, head_dim, num_gqa_groups, qkv_format="bshd", **_):
    """``num_attention_heads`` and ``num_gqa_groups`` are this rank's (the heads are split by the QKV GEMM)."""
    return te.DotProductAttention(
        num_attention_heads, head_dim, num_gqa_groups=num_gqa_groups, attention_dropout=0.0,
        qkv_format=qkv_format, attn_mask_type="causal",
    )


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, qkv_format: str = "bshd") -> torch.Tensor:
    """TE's fused RoPE kernel when every sequence shares positions (training); else the torch formula."""
    if freqs.dim() == 2:
        return apply_rotary_pos_emb(t, freqs[:, None, None, :], tensor_format=qkv_format, fused=True)
    return torch_apply_rope(t, freqs, qkv_format)


def split_qkv_rope(qkv: torch.Tensor, freqs: torch.Tensor, group: int, head_dim: int, qkv_format: str = "bshd",
                   fused: bool | str = True):
    """As :func:`llmjp_ds.model.torch_layers.split_qkv_rope`. ``fused`` (``model.fused_qkv_rope``), when every
    sequence shares positions: ``True`` / ``"te"``, TE's one kernel reads the QKV output once and writes Q and K
    rotated and V contiguous, and its backward writes the QKV gradient in one pass; ``"triton"``, our kernel
    rotates Q and K in place in the QKV output and leaves V where it is (:mod:`llmjp_ds.model.kernels.rope`;
    TE's kernel where ours has no case). Either way no strided copies, no concatenation."""
    if fused == "triton":
        from llmjp_ds.model.kernels import rope

        if rope.supported(qkv, freqs, head_dim):
            return rope.rope_qkv(qkv, freqs, group, head_dim, qkv_format)
    if fused and freqs.dim() == 2 and qkv.is_contiguous():
        f = freqs[:, None, None, :]
        return apply_fused_qkv_rotary_pos_emb(qkv, f, f, [group * head_dim, head_dim, head_dim],
                                              tensor_format=qkv_format)
    q, k, v = split_qkv(qkv, group, head_dim)
    return apply_rope(q, freqs, qkv_format), apply_rope(k, freqs, qkv_format), v


def checkpoint(function, *args):
    """TE's checkpoint: the recompute runs under the same FP8 context (amax/scales) as the forward."""
    return te.checkpoint(function, *args, use_reentrant=False)
