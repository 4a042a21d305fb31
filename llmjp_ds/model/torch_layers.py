"""Pure-PyTorch twins of the Transformer Engine modules the model is built from.

Same parameter names, shapes, layout and math as TE's ``LayerNormLinear``, ``Linear``, ``LayerNormMLP``,
``DotProductAttention``, ``RMSNorm`` and ``GroupedLinear`` (with the MoE block's routing and permutation, TE's fused
kernels on the GPU) (RMSNorm, no bias, SwiGLU with ``fc1 = [gate; up]``), so a state dict
moves between the backends unchanged. Each module also carries TE's ``_extra_state`` entry: kept opaque when it
comes from TE, and used for the emulated-FP8 scaling state on machines without TE (see ``llmjp_ds.precision.schedule``).

Every matrix product goes through :func:`linear`, the one place FP8 emulation hooks in: a module given an
emulator (``module.fp8_emulator``, see ``llmjp_ds.precision.emulation``) routes its GEMMs through it.

Tensor parallelism as TE does it (``tp``, ``parallel_mode``): a ``column`` module holds its rows of the weight
(``[out / tp, in]``) and gathers its input from the sequence shards first (or takes the replicated input); a
``row`` module holds its columns (``[out, in / tp]``) and reduce-scatters (or all-reduces) its partial output.
The communication is :mod:`llmjp_ds.model.tensor_parallel`'s.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from llmjp_ds.model import moe
from llmjp_ds.model.tensor_parallel import TensorParallel, enter_column, leave_row, mark_sharded


def linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    emulator = module.fp8_emulator
    if emulator is not None:
        return emulator.linear(module, x, weight)
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, scaled by ``weight`` after casting back (as HF Llama and TE do)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class _ExtraState:
    """TE's ``_extra_state`` slot. A uint8 tensor is TE's own FP8 metadata (kept opaque, so a TE checkpoint
    survives a round trip through this backend); a float tensor is the emulated-FP8 amax history."""

    fp8_emulator = None  # an llmjp_ds.precision.emulation.FP8Emulator once the precision schedule attaches one

    def get_extra_state(self) -> torch.Tensor:
        emulated = getattr(self, "_fp8_emu_state", None)
        if emulated is not None:
            return emulated.clone()
        state = getattr(self, "_te_extra_state", None)
        return torch.empty(0, dtype=torch.uint8) if state is None else state

    def set_extra_state(self, state) -> None:
        self._te_extra_state = self._fp8_emu_state = None
        if isinstance(state, torch.Tensor) and state.numel():
            if state.dtype == torch.uint8:
                self._te_extra_state = state
            else:
                self._fp8_emu_state = state.detach().float().cpu().clone()


def _local(n: int, tp: TensorParallel | None) -> int:
    return n if tp is None else tp.split(n)


def _weight(out_features: int, in_features: int, std: float, dtype, tp, mode) -> nn.Parameter:
    """This rank's part of an ``[out, in]`` weight (rows for ``column``, columns for ``row``), ``N(0, std)``."""
    shape = (_local(out_features, tp) if mode == "column" else out_features,
             _local(in_features, tp) if mode == "row" else in_features)
    weight = nn.Parameter(torch.empty(shape, dtype=dtype))
    nn.init.normal_(weight, std=std)
    if tp is not None and mode is not None:
        mark_sharded(weight, 0 if mode == "column" else 1)
    return weight


def _norm_weight(size: int, dtype, tp: TensorParallel | None) -> nn.Parameter:
    weight = nn.Parameter(torch.ones(size, dtype=dtype))
    if tp is not None and tp.sequence_parallel:
        weight.sequence_parallel = True  # applied to a sequence shard: its gradient is partial (TE's attribute)
    return weight


class RMSNorm(_ExtraState, nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype=None, tp=None, **_):
        super().__init__()
        self.eps = eps
        self.weight = _norm_weight(hidden_size, params_dtype, tp)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LayerNormLinear(_ExtraState, nn.Module):
    """RMSNorm fused into the following projection (TE: ``layer_norm_weight``, ``weight``); column-parallel
    under tensor parallelism."""

    def __init__(self, in_features: int, out_features: int, eps: float, init_std: float, params_dtype=None,
                 tp=None, **_):
        super().__init__()
        self.eps, self.tp = eps, tp
        self.layer_norm_weight = _norm_weight(in_features, params_dtype, tp)
        self.weight = _weight(out_features, in_features, init_std, params_dtype, tp, "column")

    def forward(self, x):
        x = rms_norm(x, self.layer_norm_weight, self.eps)
        return linear(self, x if self.tp is None else enter_column(x, self.tp), self.weight)


class Linear(_ExtraState, nn.Module):
    def __init__(self, in_features: int, out_features: int, init_std: float, params_dtype=None, tp=None,
                 parallel_mode=None, **_):
        super().__init__()
        self.tp, self.parallel_mode = tp, parallel_mode if tp is not None else None
        self.weight = _weight(out_features, in_features, init_std, params_dtype, tp, self.parallel_mode)

    def forward(self, x):
        if self.parallel_mode == "column":
            x = enter_column(x, self.tp)
        out = linear(self, x, self.weight)
        return leave_row(out, self.tp) if self.parallel_mode == "row" else out


class LayerNormMLP(_ExtraState, nn.Module):
    """RMSNorm + SwiGLU MLP (TE: ``layer_norm_weight``, ``fc1_weight`` = [gate; up], ``fc2_weight``). Under
    tensor parallelism fc1 is column- and fc2 row-parallel; each rank's fc1 is [its gate rows; its up rows]."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float, init_std: float, output_std: float,
                 params_dtype=None, tp=None, **_):
        super().__init__()
        self.eps, self.tp = eps, tp
        self.layer_norm_weight = _norm_weight(hidden_size, params_dtype, tp)
        self.fc1_weight = _weight(2 * ffn_hidden_size, hidden_size, init_std, params_dtype, tp, "column")
        self.fc2_weight = _weight(hidden_size, ffn_hidden_size, output_std, params_dtype, tp, "row")

    def forward(self, x):
        x = rms_norm(x, self.layer_norm_weight, self.eps)
        h = linear(self, x if self.tp is None else enter_column(x, self.tp), self.fc1_weight)
        gate, up = h.chunk(2, dim=-1)
        out = linear(self, F.silu(gate) * up, self.fc2_weight)
        return out if self.tp is None else leave_row(out, self.tp)


class GroupedLinear(_ExtraState, nn.Module):
    """``num_gemms`` linear maps of the same shape, one per expert (TE's: ``weight0 .. weight{n-1}``, each ``[out,
    in]``); ``forward(x, m_splits)`` maps the first ``m_splits[0]`` rows of ``x`` by the first, and so on."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, init_std: float, params_dtype=None,
                 **_):
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", _weight(out_features, in_features, init_std, params_dtype, None,
                                                          None))

    def forward(self, x, m_splits):
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        parts = x.split(splits, dim=0)
        return torch.cat([linear(self, part, getattr(self, f"weight{i}")) for i, part in enumerate(parts)], dim=0)


class GroupedMLP(nn.Module):
    """The SwiGLU MLPs of ``num_experts`` experts over their rows (expert-major): ``linear_fc1`` (``[gate; up]``
    of each) and ``linear_fc2``; each row's activation is scaled by its routing weight before ``fc2``, as
    Megatron's weighted SwiGLU."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, init_std: float,
                 output_std: float, params_dtype=None):
        super().__init__()
        self.linear_fc1 = GroupedLinear(num_experts, hidden_size, 2 * ffn_hidden_size, init_std, params_dtype)
        self.linear_fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, output_std, params_dtype)

    def forward(self, rows, tokens_per_expert, weights):
        gate, up = self.linear_fc1(rows, tokens_per_expert).chunk(2, dim=-1)
        return self.linear_fc2(((F.silu(gate) * up) * weights).to(rows.dtype), tokens_per_expert)


route = moe.route
load_balancing_loss = moe.load_balancing_loss


def permute_tokens(hidden, probs, routing_map, count: int | None = None) -> moe.Rows:
    """The rows of ``hidden``'s tokens in expert order (:func:`llmjp_ds.model.moe.permute`)."""
    rows, token_ids, tokens_per_expert = moe.permute(hidden, routing_map)
    weights = probs.t()[routing_map.t()].unsqueeze(-1)  # each row's weight, in the rows' (expert-major) order
    return moe.Rows(rows, weights, tokens_per_expert, (token_ids, hidden.shape[0]))


def unpermute_tokens(out, rows: moe.Rows):
    return moe.unpermute(out, *rows.back)


class DotProductAttention(_ExtraState, nn.Module):
    """Causal scaled dot-product attention on ``bshd`` or (under tensor parallelism) ``sbhd`` tensors, GQA-aware;
    the heads are this rank's. ``checkpoint_core_attention`` recomputes it in backward (TE's argument)."""

    def __init__(self, num_attention_heads: int, head_dim: int, num_gqa_groups: int, qkv_format: str = "bshd",
                 **_):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.qkv_format = qkv_format
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, q, k, v, checkpoint_core_attention: bool = False):
        if checkpoint_core_attention:
            return torch.utils.checkpoint.checkpoint(self._attend, q, k, v, use_reentrant=False)
        return self._attend(q, k, v)

    def _attend(self, q, k, v):
        if self.qkv_format == "sbhd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            return sdpa(q, k, v, mask=None, scale=self.scale).transpose(0, 1)
        return sdpa(q, k, v, mask=None, scale=self.scale)


def sdpa(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention on ``bshd`` tensors; ``mask`` is a boolean ``[b, 1, s_q, s_kv]`` (True = attend) or None = causal."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> b h s d
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    with attention_backends(q.device, q.dtype):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2)


def attention_backends(device: torch.device, dtype: torch.dtype):
    """``F.scaled_dot_product_attention``'s backends: every one, except on a CPU under an ATen capability below
    AVX512 (``ATEN_CPU_CAPABILITY=default`` or ``avx2``) in 16 bits, where torch's (2.13) flash attention still
    packs its operands for the processor's AVX512 and fails (``pack_vnni2 is only supported when avx512 is
    supported``): there the math backend runs."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and \
            torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, qkv_format: str = "bshd") -> torch.Tensor:
    """Rotary embedding (non-interleaved halves, as HF Llama and TE). ``t``: ``[b, s, h, d]`` (or ``sbhd``);
    ``freqs``: angles ``[s, d]`` or ``[b, s, d]`` in fp32; cos/sin are cast to ``t``'s dtype first, as HF does."""
    if freqs.dim() == 2:
        freqs = freqs.unsqueeze(1 if qkv_format == "sbhd" else 0)
    elif qkv_format == "sbhd":
        freqs = freqs.transpose(0, 1)  # [b, s, d] -> [s, b, d], as t
    cos = freqs.cos().to(t.dtype).unsqueeze(2)
    sin = freqs.sin().to(t.dtype).unsqueeze(2)
    return t * cos + rotate_half(t) * sin


def split_qkv(qkv: torch.Tensor, group: int, head_dim: int):
    """Q, K and V of the fused QKV output ``[*lead, kv groups, (group + 2) * head_dim]`` (TE's layout: each KV
    group's ``group`` query heads, then its key, then its value): ``q`` ``[*lead, kv * group, head_dim]``, ``k``
    and ``v`` ``[*lead, kv, head_dim]``."""
    *lead, kv, _ = qkv.shape
    q, k, v = qkv.view(*lead, kv, group + 2, head_dim).split([group, 1, 1], dim=-2)
    return q.reshape(*lead, kv * group, head_dim), k.reshape(*lead, kv, head_dim), v.reshape(*lead, kv, head_dim)


def split_qkv_rope(qkv: torch.Tensor, freqs: torch.Tensor, group: int, head_dim: int, qkv_format: str = "bshd",
                   fused: bool = True):
    """:func:`split_qkv`, then RoPE on Q and K. ``fused`` is the TE backend's switch (``model.fused_qkv_rope``);
    here the split is views and the rotations :func:`apply_rope`, either way."""
    q, k, v = split_qkv(qkv, group, head_dim)
    return apply_rope(q, freqs, qkv_format), apply_rope(k, freqs, qkv_format), v


def checkpoint(function, *args):
    """Activation checkpointing (non-reentrant). Under emulated FP8 the schedule's emulator provides its own
    (:meth:`llmjp_ds.precision.emulation.FP8Emulator.checkpoint`), whose recompute runs in the forward's region."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
