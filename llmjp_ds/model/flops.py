"""Model FLOPs per token and parameter counts of a Llama (LLM-jp-3) model: pure arithmetic, no torch.

Convention: *training* FLOPs per token = forward + backward = 3 x forward, where every matrix multiply of an
(m x k) by (k x n) operand costs 2mkn in the forward pass and twice that in the backward pass (one GEMM for the
input gradient, one for the weight gradient). Only matrix multiplies count: norms, RoPE, SwiGLU's elementwise
product, softmax and the loss are ignored, and so is activation recomputation (this is *model* FLOPs, the
numerator of MFU, not hardware FLOPs).

The formula is Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py), per token:

    12 * L * h^2 * [ (1 + g/n + s/(2h)) * (n*d/h)      attention: Q,O (1) + K,V (g/n) + QK^T and AV (s/2h)
                     + 3/2 * ffn/h ]                    SwiGLU MLP: gate, up, down = 3 matrices of h x ffn
    + 6 * h * V                                         logits layer (the embedding lookup is free)

with L layers, hidden h, n query heads of size d, g key/value heads (GQA), ffn the MLP width, V the (padded)
vocabulary and s the sequence length. The attention-score term is *halved* for a causal mask: only the lower
triangle of QK^T is needed and multiplied with V. Newer Megatron-LM versions halve it; older ones did not,
which reads 2.7% higher for the 172B model at s=4096, so say which convention a TFLOP/s figure used.
"""

from __future__ import annotations

from typing import Any

from llmjp_ds.model.shapes import has_qk_norm, is_moe_layer

__all__ = ["model_flops_per_token", "flops_per_token_for", "layer_and_logits_flops_for", "parameter_count",
           "parameter_count_for"]


def model_flops_per_token(
    *,
    hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    vocab_size: int,
    seq_len: int,
    causal: bool = True,
    head_dim: int | None = None,
    moe_layers: int = 0,
    num_experts: int = 0,
    experts_per_token: int = 0,
    moe_ffn_hidden_size: int = 0,
) -> float:
    """Training (forward + backward = 3 x forward) model FLOPs per token; see the module docstring.

    ``causal=True`` halves the attention-score term (QK^T and AV), as newer Megatron-LM does; pass
    ``causal=False`` to count the full s x s attention matrix. ``head_dim`` defaults to hidden / heads. With
    ``moe_layers`` of the layers a mixture of ``num_experts`` experts, each such layer's MLP is the router
    (``h x E``) and the SwiGLU MLPs of the ``experts_per_token`` experts a token goes to, of width
    ``moe_ffn_hidden_size`` (Megatron-LM's count: the FLOPs a token's computation takes, not the parameters').
    """
    h, L, n, g = hidden_size, num_layers, num_attention_heads, num_key_value_heads
    d = head_dim if head_dim is not None else h // n
    for name, value in (("hidden_size", h), ("num_layers", L), ("num_attention_heads", n),
                        ("num_key_value_heads", g), ("intermediate_size", intermediate_size),
                        ("vocab_size", vocab_size), ("seq_len", seq_len), ("head_dim", d)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if n % g:
        raise ValueError(f"num_attention_heads ({n}) must be a multiple of num_key_value_heads ({g})")

    # Forward FLOPs per token, one term per GEMM (2 x rows x cols of each weight the token passes through).
    qkv_o = 2 * h * (n * d) + 2 * 2 * h * (g * d) + 2 * (n * d) * h  # Q; K and V (GQA: g heads); O
    scores = 2 * 2 * (n * d) * seq_len  # QK^T and AV against seq_len keys
    if causal:
        scores /= 2  # only the lower triangle of the attention matrix is computed
    mlp = 3 * 2 * h * intermediate_size  # SwiGLU: gate, up (h -> ffn) and down (ffn -> h)
    moe = 2 * h * num_experts + experts_per_token * 3 * 2 * h * moe_ffn_hidden_size
    logits = 2 * h * vocab_size
    forward = L * (qkv_o + scores) + (L - moe_layers) * mlp + moe_layers * moe + logits
    return float(3 * forward)


def _shape(config: Any) -> dict[str, Any]:
    """The fields both functions need from a transformers ``LlamaConfig``-like object (or ``Qwen3MoeConfig``)."""
    experts = getattr(config, "num_experts", 0) or 0
    return dict(
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        # missing or None: plain multi-head attention
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        head_dim=getattr(config, "head_dim", None),
        moe_layers=sum(is_moe_layer(config, i) for i in range(config.num_hidden_layers)),
        num_experts=experts,
        experts_per_token=getattr(config, "num_experts_per_tok", 0) if experts else 0,
        moe_ffn_hidden_size=getattr(config, "moe_intermediate_size", 0) if experts else 0,
    )


def flops_per_token_for(config: Any, seq_len: int | None = None, *, causal: bool = True) -> float:
    """:func:`model_flops_per_token` for a transformers ``LlamaConfig``-like object (attributes
    ``hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size``,
    optionally ``head_dim``); ``seq_len`` defaults to ``config.max_position_embeddings``."""
    if seq_len is None:
        seq_len = getattr(config, "max_position_embeddings", None)
        if seq_len is None:
            raise ValueError("seq_len is required when the config has no max_position_embeddings")
    return model_flops_per_token(**_shape(config), seq_len=seq_len, causal=causal)


def layer_and_logits_flops_for(config: Any, seq_len: int) -> tuple[float, float]:
    """The two parts of :func:`flops_per_token_for`: (one decoder layer, the logits layer), training FLOPs per
    token each (what the pipeline's ``flops`` partition balances)."""
    logits = 3.0 * 2 * config.hidden_size * config.vocab_size
    return (flops_per_token_for(config, seq_len) - logits) / config.num_hidden_layers, logits


def parameter_count_for(config: Any) -> dict[str, int]:
    """:func:`parameter_count` for a transformers ``LlamaConfig``-like object (its ``vocab_size``, i.e. padded);
    qk-norm weights included where the config has them (``qwen3``, ``qwen3_moe``)."""
    return parameter_count(**_shape(config), qk_norm=has_qk_norm(config))


def parameter_count(
    *,
    hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    vocab_size: int,
    head_dim: int | None = None,
    qk_norm: bool = False,
    moe_layers: int = 0,
    num_experts: int = 0,
    experts_per_token: int = 0,
    moe_ffn_hidden_size: int = 0,
) -> dict[str, int]:
    """Parameters of the Llama model: ``{"total", "embedding", "non_embedding", "active"}``.

    Untied embeddings (input embedding and output head, ``2 * V * h``), no biases, RMSNorm weights (two per
    layer and a final one, counted as non-embedding). LLM-jp's published 172B figures (169,947,181,056
    non-embedding + 2,444,992,512 embedding) count the embeddings at the tokenizer's 99,487 live ids
    (2 x 99,487 x 12,288); the checkpoint itself holds the vocabulary padded to 99,840 (2,453,667,840).
    Pass whichever ``vocab_size`` you mean. With ``qk_norm`` each layer has two ``head_dim`` norms more; with
    ``moe_layers`` MoE layers each has a router (``E x h``) and ``num_experts`` SwiGLU MLPs of width
    ``moe_ffn_hidden_size`` instead of the dense MLP. ``active``: what one token's forward uses, the embedding and
    head included (the experts it does not go to left out), as model cards count "activated" parameters.
    """
    h, n, g = hidden_size, num_attention_heads, num_key_value_heads
    d = head_dim if head_dim is not None else h // n
    attention = h * (n * d) + 2 * h * (g * d) + (n * d) * h + (2 * d if qk_norm else 0)  # q, k, v, o (+ qk norms)
    mlp = 3 * h * intermediate_size  # gate, up, down
    expert = 3 * h * moe_ffn_hidden_size
    norms = 2 * h  # input and post-attention RMSNorm
    non_embedding = num_layers * (attention + norms) + (num_layers - moe_layers) * mlp + h  # + final RMSNorm
    non_embedding += moe_layers * (num_experts * h + num_experts * expert)
    embedding = 2 * vocab_size * h  # embed_tokens + lm_head (untied)
    total = non_embedding + embedding
    return {"total": total, "embedding": embedding, "non_embedding": non_embedding,
            "active": total - moe_layers * (num_experts - experts_per_token) * expert}
