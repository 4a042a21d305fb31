"""Pure-PyTorch twins of the Transformer Engine modules the model is built from.

Same parameter names, shapes, layout and math as TE's ``LayerNormLinear``, ``Linear``, ``LayerNormMLP``,
``DotProductAttention`` and ``RMSNorm`` (RMSNorm, no bias, SwiGLU with ``fc1 = [gate; up]``), so a state dict
moves between the backends unchanged. Each module also carries TE's ``_extra_state`` entry: kept opaque when it
comes from TE, and used for the emulated-FP8 scaling state on machines without TE (see ``llmjp_ds.precision``).

Every matrix product goes through :func:`linear`, the one place FP8 emulation hooks in: a module given an
emulator (``module.fp8_emulator``, see ``llmjp_ds.fp8_emulation``) routes its GEMMs through it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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

    fp8_emulator = None  # an llmjp_ds.fp8_emulation.FP8Emulator once the precision schedule attaches one

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


class RMSNorm(_ExtraState, nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype=None, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LayerNormLinear(_ExtraState, nn.Module):
    """RMSNorm fused into the following projection (TE: ``layer_norm_weight``, ``weight``)."""

    def __init__(self, in_features: int, out_features: int, eps: float, init_std: float, params_dtype=None, **_):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=params_dtype))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, x):
        return linear(self, rms_norm(x, self.layer_norm_weight, self.eps), self.weight)


class Linear(_ExtraState, nn.Module):
    def __init__(self, in_features: int, out_features: int, init_std: float, params_dtype=None, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, x):
        return linear(self, x, self.weight)


class LayerNormMLP(_ExtraState, nn.Module):
    """RMSNorm + SwiGLU MLP (TE: ``layer_norm_weight``, ``fc1_weight`` = [gate; up], ``fc2_weight``)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float, init_std: float, output_std: float,
                 params_dtype=None, **_):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))
        self.fc1_weight = nn.Parameter(torch.empty(2 * ffn_hidden_size, hidden_size, dtype=params_dtype))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, dtype=params_dtype))
        nn.init.normal_(self.fc1_weight, std=init_std)
        nn.init.normal_(self.fc2_weight, std=output_std)

    def forward(self, x):
        h = linear(self, rms_norm(x, self.layer_norm_weight, self.eps), self.fc1_weight)
        gate, up = h.chunk(2, dim=-1)
        return linear(self, F.silu(gate) * up, self.fc2_weight)


class DotProductAttention(_ExtraState, nn.Module):
    """Causal scaled dot-product attention on ``[batch, seq, heads, head_dim]`` (TE's ``bshd``), GQA-aware."""

    def __init__(self, num_attention_heads: int, head_dim: int, num_gqa_groups: int, **_):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, q, k, v):
        return sdpa(q, k, v, mask=None, scale=self.scale)


def sdpa(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention on ``bshd`` tensors; ``mask`` is a boolean ``[b, 1, s_q, s_kv]`` (True = attend) or None = causal."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> b h s d
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (non-interleaved halves, as HF Llama and TE). ``t``: ``[b, s, h, d]``;
    ``freqs``: angles ``[s, d]`` or ``[b, s, d]`` in fp32; cos/sin are cast to ``t``'s dtype first, as HF does."""
    if freqs.dim() == 2:
        freqs = freqs.unsqueeze(0)
    cos = freqs.cos().to(t.dtype).unsqueeze(2)
    sin = freqs.sin().to(t.dtype).unsqueeze(2)
    return t * cos + rotate_half(t) * sin


def checkpoint(function, *args):
    """Activation checkpointing (non-reentrant). Under emulated FP8 the schedule's emulator provides its own
    (:meth:`llmjp_ds.fp8_emulation.FP8Emulator.checkpoint`), whose recompute runs in the forward's region."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
