"""Transformer Engine backend: the model's building blocks as TE modules (CUDA only).

Why these modules and not ``te.TransformerLayer``: the decoder layer (``llama.py``) composes
``LayerNormLinear`` (RMSNorm + fused QKV), ``DotProductAttention`` (fused/flash attention), ``Linear`` (output
projection) and ``LayerNormMLP`` (RMSNorm + SwiGLU) itself. These are exactly the modules ``TransformerLayer``
is made of, under the same attribute names, so the parameter names, shapes and FP8 behaviour are TE's; but the
decoder layer keeps RoPE, the KV cache for ``generate()`` and the padding-mask path in one place for both
backends, where ``TransformerLayer`` would hide them behind its own inference API.
"""

from __future__ import annotations

import contextlib

import torch
import transformer_engine.pytorch as te
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb
from transformer_engine.pytorch.module import layernorm_linear as _te_layernorm_linear
from transformer_engine.pytorch.module import layernorm_mlp as _te_layernorm_mlp
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from transformer_engine.pytorch.router import (fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss,
                                                fused_topk_with_score_function)

from llmjp_ds.model import moe, residual_grad
from llmjp_ds.model.kernels import rope
from llmjp_ds.model.torch_layers import apply_rope as torch_apply_rope
from llmjp_ds.model.torch_layers import sdpa  # noqa: F401  (the masked / KV-cache path, shared by both backends)
from llmjp_ds.model.torch_layers import split_qkv
from llmjp_ds.model.weight_reuse import ReusesFP8Weights


class _NormBackwardTakesResidual:
    """TE's extension module as ``LayerNormLinear`` and ``LayerNormMLP`` call it, but whose ``rmsnorm_bwd`` adds
    the residual gradient :func:`llmjp_ds.model.residual_grad.residual_add` left for the norm's input, in the same
    kernel (TE's ``rmsnorm_bwd_add``, the kernel of its ``BackwardAddRMSNorm`` op). With nothing left for it, the
    call is TE's own. Every other name is TE's."""

    def __init__(self, tex):
        self._tex = tex

    def __getattr__(self, name):
        return getattr(self._tex, name)

    def rmsnorm_bwd(self, dy, x, rsigma, gamma, sm_margin, zero_centered_gamma):
        add = residual_grad.take(x)
        if add is None:
            return self._tex.rmsnorm_bwd(dy, x, rsigma, gamma, sm_margin, zero_centered_gamma)
        return self._tex.rmsnorm_bwd_add(dy, x, add.to(dy.dtype), rsigma, gamma, sm_margin, zero_centered_gamma)


for _module in (_te_layernorm_linear, _te_layernorm_mlp):
    if not isinstance(_module.tex, _NormBackwardTakesResidual):
        _module.tex = _NormBackwardTakesResidual(_module.tex)


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


class _DotProductAttention(te.DotProductAttention):
    """TE's attention module (its name and ``_extra_state`` stay in checkpoints), whose causal core runs through
    torch's ``scaled_dot_product_attention`` on the cuDNN backend when ``via_torch`` (``model.attention_core:
    cudnn``). Both run cuDNN's fused attention kernels. TE's module spends ~0.3 ms of host time
    per call choosing them, torch ~0.1 ms; but torch's backward returns the Q, K and V gradients as three tensors,
    where TE's writes them into one buffer in the QKV layout. TE runs the call instead for a recomputed core
    (``checkpoint_core_attention``), and from the first call torch cannot place on cuDNN (its reason is kept in
    ``torch_refused``). No recipe of ours runs attention itself in FP8."""

    torch_refused: str | None = None

    def __init__(self, *args, via_torch: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.via_torch = via_torch

    def forward(self, query_layer, key_layer, value_layer, checkpoint_core_attention: bool = False):
        if self.via_torch and self.torch_refused is None and not checkpoint_core_attention:
            try:
                return cudnn_attention(query_layer, key_layer, value_layer, self.qkv_format)
            except RuntimeError as e:  # torch's backend checks run before any kernel is launched
                self.torch_refused = str(e).splitlines()[0]
        return super().forward(query_layer, key_layer, value_layer,
                               checkpoint_core_attention=checkpoint_core_attention)


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str = "bshd") -> torch.Tensor:
    """Causal attention of ``[b, s, heads, d]`` (``bshd``) or ``[s, b, heads, d]`` (``sbhd``) tensors, strided views
    of the QKV buffer included, on torch's cuDNN backend only (it raises where cuDNN cannot run the case); the
    output in the same format, ``[*lead, heads, d]``. Grouped KV heads go to cuDNN as they are."""
    to_bhsd, back = ((1, 2, 0, 3), (2, 0, 1, 3)) if qkv_format == "sbhd" else ((0, 2, 1, 3), (0, 2, 1, 3))
    q, k, v = (t.permute(*to_bhsd) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=q.shape[1] != k.shape[1])
    return out.permute(*back)


def DotProductAttention(num_attention_heads, head_dim, num_gqa_groups, qkv_format="bshd", via_torch=False):
    """``num_attention_heads`` and ``num_gqa_groups`` are this rank's (the heads are split by the QKV GEMM)."""
    return _DotProductAttention(
        num_attention_heads, head_dim, num_gqa_groups=num_gqa_groups, attention_dropout=0.0,
        qkv_format=qkv_format, attn_mask_type="causal", via_torch=via_torch,
    )


class _GroupedLinear(ReusesFP8Weights, te.GroupedLinear):
    @property
    def MAIN_GRAD_WEIGHTS(self) -> tuple[str, ...]:  # noqa: N802  (the name the engine reads on every GEMM module)
        """Every expert's weight accumulates its gradient into its fp32 ``main_grad`` in the grouped GEMM."""
        return tuple(f"weight{i}" for i in range(self.num_gemms))


def GroupedLinear(num_gemms, in_features, out_features, init_std, params_dtype=None):
    """TE's grouped GEMM: ``num_gemms`` weights ``weight0 .. weight{n-1}`` ``[out, in]`` in one kernel launch."""
    return _GroupedLinear(num_gemms, in_features, out_features, bias=False, init_method=_normal(init_std),
                          **_device_kwargs(params_dtype))


class GroupedMLP(nn.Module):
    """As :class:`llmjp_ds.model.torch_layers.GroupedMLP`, each projection one TE grouped GEMM. Inside an FP8
    region every expert's rows are padded to the recipe's alignment first (TE's ``Fp8Padding``), as the FP8 GEMMs
    need, and unpadded after. In the calibration steps before a flip the experts compute without calibrating:
    TE 2.20's ``GroupedLinear`` has no input quantizers outside FP8 to record amax with (it raises), so the
    experts' FP8 scales start from their first FP8 step, as every GEMM's do after Megatron-LM's FP8 restart."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, init_std: float,
                 output_std: float, params_dtype=None):
        super().__init__()
        self.linear_fc1 = GroupedLinear(num_experts, hidden_size, 2 * ffn_hidden_size, init_std, params_dtype)
        self.linear_fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, output_std, params_dtype)
        self.pad, self.unpad = te.Fp8Padding(num_experts), te.Fp8Unpadding(num_experts)

    def forward(self, rows, tokens_per_expert, weights):
        splits = tokens_per_expert.tolist()  # the grouped GEMM's split sizes, on the host (as Megatron's)
        padded = FP8GlobalStateManager.is_fp8_enabled()
        m_splits = splits
        if padded:
            rows, m_splits = self.pad(rows, splits)
            weights = _padded_rows(weights, splits, m_splits)
        calibrating = not padded and FP8GlobalStateManager.is_fp8_calibration()
        with te.autocast(enabled=False, calibrating=False) if calibrating else contextlib.nullcontext():
            # by keyword: the FP8 weight cache's forward takes a second positional argument as is_first_microbatch
            gate, up = self.linear_fc1(rows, m_splits=m_splits).chunk(2, dim=-1)
            out = self.linear_fc2(((torch.nn.functional.silu(gate) * up) * weights).to(rows.dtype),
                                  m_splits=m_splits)
        return self.unpad(out, splits) if padded else out


def _padded_rows(t: torch.Tensor, splits: list[int], padded: list[int]) -> torch.Tensor:
    """``t``'s rows placed as ``Fp8Padding`` places the rows of each expert (zeros in the padding)."""
    before = [p - s for p, s in zip(padded, splits)]
    shifts = [sum(before[:i]) for i in range(len(before))]
    shift = torch.repeat_interleave(torch.tensor(shifts, device=t.device), torch.tensor(splits, device=t.device),
                                    output_size=t.shape[0])  # the size given: no wait for the device
    out = t.new_zeros(sum(padded), *t.shape[1:])
    return out.index_copy(0, torch.arange(t.shape[0], device=t.device) + shift, t)


def route(logits, top_k: int):
    """TE's fused top-k + softmax over the chosen (``fused_topk_with_score_function``), as the torch formula."""
    return fused_topk_with_score_function(logits, top_k, use_pre_softmax=False, num_groups=None, group_topk=None,
                                          scaling_factor=None, score_function="softmax", expert_bias=None)


def load_balancing_loss(logits, top_k: int, sequences: int = 1):
    """TE's fused scores and switch loss (``fused_compute_score_for_moe_aux_loss``, ``fused_moe_aux_loss``), as
    Megatron-Core's router fusion computes ``aux_loss``; ``seq_aux_loss`` by the torch formula."""
    if sequences > 1:
        return moe.load_balancing_loss(logits, top_k, sequences)
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits, top_k, "softmax")
    return fused_moe_aux_loss(scores, routing_map.sum(0), logits.shape[0], logits.shape[1], top_k, 1.0)


def permute_tokens(hidden, probs, routing_map, count: int | None = None) -> moe.Rows:
    """TE's fused permutation (``moe_permute_with_probs``), expert-major as the torch formula; ``count``: the rows
    (known without asking the device when no token is dropped)."""
    tokens_per_expert = routing_map.sum(0)
    count = int(tokens_per_expert.sum()) if count is None else count
    rows, weights, row_map = te.moe_permute_with_probs(hidden, probs, routing_map, num_out_tokens=count)
    return moe.Rows(rows, weights.unsqueeze(-1), tokens_per_expert, (row_map, hidden.shape))


def unpermute_tokens(out, rows: moe.Rows):
    row_map, shape = rows.back
    return te.moe_unpermute(out, row_map, restore_shape=shape)


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
