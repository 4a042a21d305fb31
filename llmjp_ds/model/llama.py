"""LLM-jp-style Llama as a transformers ``PreTrainedModel`` built from Transformer Engine layers.

Read top to bottom: ``rope_freqs`` -> ``SelfAttention`` -> ``DecoderLayer`` -> ``Embedding`` / ``FinalNormHead``
-> ``LlamaForCausalLM``. The layer modules come from a backend (``te_layers`` on a CUDA GPU with TE,
``torch_layers`` elsewhere) with identical parameter names; the pipeline-parallel split (``pipeline_layers.py``) reuses
``Embedding``, ``DecoderLayer`` and ``FinalNormHead`` unchanged.

Parameter names (TE's, inside each decoder layer)::

    model.embed_tokens.weight                                   [V, h]
    model.layers.N.self_attention.layernorm_qkv.layer_norm_weight  [h]
    model.layers.N.self_attention.layernorm_qkv.weight          [(heads + 2 kv) * d, h]  per-KV-group interleaved
    model.layers.N.self_attention.proj.weight                   [h, heads * d]
    model.layers.N.layernorm_mlp.layer_norm_weight              [h]
    model.layers.N.layernorm_mlp.fc1_weight                     [2 ffn, h]   = [gate; up]
    model.layers.N.layernorm_mlp.fc2_weight                     [h, ffn]
    model.norm.weight                                           [h]
    lm_head.weight                                              [V, h]
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, LlamaConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from llmjp_ds.model.backend import layers_module, resolve_backend
from llmjp_ds.model.expert_parallel import ExpertParallel
from llmjp_ds.model.hf_io import load_hf_checkpoint, save_hf_checkpoint
from llmjp_ds.model.loss import CausalLMLoss, LossParts
from llmjp_ds.model.loss import shift_labels as shift_labels_of
from llmjp_ds.model.main_grad import HeadLinear, TokenEmbedding
from llmjp_ds.model.moe import MoEBlock
from llmjp_ds.model.options import ModelOptions
from llmjp_ds.model.residual_grad import residual_add
from llmjp_ds.model.shapes import check_supported, has_qk_norm, is_moe_layer, rope_theta
from llmjp_ds.model.tensor_parallel import TensorParallel, leave_row, mark_sharded


@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_freqs(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """RoPE angles for ``positions`` (``[s]`` or ``[b, s]``) as ``[..., head_dim]`` fp32: ``cat(f, f)``."""
    freqs = positions.float()[..., None] * _inv_freq(head_dim, theta, positions.device)
    return torch.cat((freqs, freqs), dim=-1)


def head_dim_of(config) -> int:
    """The width of one attention head: the config's ``head_dim``, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads




class SelfAttention(nn.Module):
    """QKV (column-parallel under TP: this rank's KV groups and their query heads), RoPE, the attention core on
    those heads, and the output projection (row-parallel). ``options``: the fused QKV split + RoPE, the attention
    core's kernel, and whether the core is recomputed in backward (``recompute: selective``)."""

    def __init__(self, config, layer_idx: int, L, params_dtype=None, tp: TensorParallel | None = None,
                 options: ModelOptions = ModelOptions()):
        super().__init__()
        self.layer_idx = layer_idx
        split = 1 if tp is None else tp.size
        self.num_heads = config.num_attention_heads // split
        self.num_kv = config.num_key_value_heads // split
        self.head_dim = head_dim_of(config)
        self.qkv_format = "bshd" if tp is None else "sbhd"
        self.recompute_core = options.recompute_core
        self.fused_qkv_rope = options.fused_qkv_rope
        std = config.initializer_range
        self.layernorm_qkv = L.LayerNormLinear(
            config.hidden_size, (config.num_attention_heads + 2 * config.num_key_value_heads) * self.head_dim,
            eps=config.rms_norm_eps, init_std=std, params_dtype=params_dtype, tp=tp)
        self.core_attention = L.DotProductAttention(self.num_heads, self.head_dim, self.num_kv,
                                                    qkv_format=self.qkv_format,
                                                    via_torch=options.attention_core == "cudnn")
        if has_qk_norm(config):  # per head, before RoPE (so the fused split + RoPE kernels do not apply)
            self.q_norm = L.RMSNorm(self.head_dim, eps=config.rms_norm_eps, params_dtype=params_dtype)
            self.k_norm = L.RMSNorm(self.head_dim, eps=config.rms_norm_eps, params_dtype=params_dtype)
        self.proj = L.Linear(config.num_attention_heads * self.head_dim, config.hidden_size,
                             init_std=std / math.sqrt(2.0 * config.num_hidden_layers), params_dtype=params_dtype,
                             tp=tp, parallel_mode="row")
        self._L = L

    def forward(self, x, freqs, mask=None, cache=None):
        qkv = self.layernorm_qkv(x)
        lead = qkv.shape[:2]  # (b, s), or (s, b) under tensor parallelism (the whole sequence: gathered)
        group = self.num_heads // self.num_kv
        # TE's fused QKV layout: [kv groups, (q heads of the group, k, v) * head_dim]. The fused split + RoPE only
        # where the fused attention core runs (training, evaluation); the KV-cache and masked paths split as before
        core = cache is None and mask is None
        grouped = qkv.view(*lead, self.num_kv, (group + 2) * self.head_dim)
        if hasattr(self, "q_norm"):
            q, k, v = self._L.split_qkv(grouped, group, self.head_dim)
            q, k = (self._L.apply_rope(norm(t), freqs, self.qkv_format) for norm, t in ((self.q_norm, q),
                                                                                       (self.k_norm, k)))
        else:
            q, k, v = self._L.split_qkv_rope(grouped, freqs, group, self.head_dim, self.qkv_format,
                                             fused=self.fused_qkv_rope if core else False)
        if core:
            out = self.core_attention(q, k, v, checkpoint_core_attention=self.recompute_core and self.training)
        else:
            if cache is not None:
                k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            out = self._L.sdpa(q, k, v, mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.proj(out.reshape(*lead, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; the norms live inside TE's fused modules.
    The MLP is a dense SwiGLU (``layernorm_mlp``) or, in an MoE layer (:func:`is_moe_layer`), a mixture of experts
    (``moe``, :class:`~llmjp_ds.model.moe.MoEBlock`; ``ep``: its expert-parallel group). Under tensor parallelism
    ``x`` is ``[s, b, h]``, sequence-sharded ``[s / tp, b, h]`` with sequence parallelism. Under ``recompute: moe``
    the MoE block is recomputed in backward by ``checkpoint_fn`` (default the backend's)."""

    def __init__(self, config, layer_idx: int, backend: str, params_dtype=None, tp: TensorParallel | None = None,
                 options: ModelOptions = ModelOptions(), ep: ExpertParallel | None = None, checkpoint_fn=None):
        super().__init__()
        L = layers_module(backend)
        self.tp = tp
        self.self_attention = SelfAttention(config, layer_idx, L, params_dtype, tp, options)
        moe = is_moe_layer(config, layer_idx)
        if moe:
            self.moe = MoEBlock(config, L, options, params_dtype, ep, _device_for(backend))
        else:
            self.layernorm_mlp = L.LayerNormMLP(
                config.hidden_size, config.intermediate_size, eps=config.rms_norm_eps,
                init_std=config.initializer_range,
                output_std=config.initializer_range / math.sqrt(2.0 * config.num_hidden_layers),
                params_dtype=params_dtype, tp=tp)
        # each residual's gradient added inside the backward of the norm that reads the residual (TE backend; the
        # MoE block's norm is TE's plain RMSNorm, which takes none)
        self.fused_residual_norm = options.residual_in_norm(backend) and not moe
        self.moe_checkpoint = (checkpoint_fn or L.checkpoint) if moe and options.recompute_moe else None

    def forward(self, x, freqs, mask=None, cache=None):
        add = residual_add if self.fused_residual_norm else torch.add
        x = add(x, self.self_attention(x, freqs, mask, cache))
        if not hasattr(self, "moe"):
            return add(x, self.layernorm_mlp(x))
        if self.moe_checkpoint is not None and self.training and torch.is_grad_enabled():
            return add(x, self.moe_checkpoint(self.moe, x))
        return add(x, self.moe(x))


def _device_for(backend: str):
    return "cuda" if backend == "te" else None


def sequence_length(x: torch.Tensor, tp: TensorParallel | None) -> int:
    """The whole sequence's length of hidden states ``x`` (``[b, s, h]``; under TP ``[s, b, h]``, sharded by SP)."""
    if tp is None:
        return x.shape[1]
    return x.shape[0] * (tp.size if tp.sequence_parallel else 1)


class Embedding(TokenEmbedding):
    """The token embedding; vocabulary-parallel under TP: this rank's rows, ids outside them give zeros, and the
    sum over ranks is reduce-scattered to the sequence shards (SP) or all-reduced. Output ``[s, b, h]`` then."""

    def __init__(self, config, backend: str, params_dtype=None, tp: TensorParallel | None = None):
        rows = config.vocab_size if tp is None else tp.split(config.vocab_size)
        super().__init__(rows, config.hidden_size, device=_device_for(backend), dtype=params_dtype)
        nn.init.normal_(self.weight, std=config.initializer_range)
        self.tp = tp
        if tp is not None:
            mark_sharded(self.weight, 0)

    def forward(self, input_ids):
        if self.tp is None:
            return super().forward(input_ids)
        local = input_ids.t() - self.tp.rank * self.num_embeddings  # sequence-first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_row(x, self.tp)


class FinalNormHead(nn.Module):
    """Final RMSNorm and the output projection. By default the head is an ``nn.Linear`` (``HeadLinear``), not a
    TE module: it stays in BF16 in FP8 phases, as in Megatron-LM and LLM-jp's FP8 runs. ``fp8_head`` makes it the
    backend's ``Linear`` (TE's on a GPU), which FP8 phases run in FP8 like the decoder layers; it then carries
    FP8 scaling state (``lm_head._extra_state``) in checkpoints. The parameter name is ``lm_head.weight`` either
    way. Under TP the head is column-parallel over the vocabulary: each rank's logits are its vocabulary slice
    (``[s, b, V / tp]``), which the loss reads as they are (``model.loss``)."""

    def __init__(self, config, backend: str, params_dtype=None, fp8_head: bool = False,
                 tp: TensorParallel | None = None):
        super().__init__()
        L = layers_module(backend)
        self.norm = L.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, params_dtype=params_dtype, tp=tp)
        if fp8_head:
            self.lm_head = L.Linear(config.hidden_size, config.vocab_size, init_std=config.initializer_range,
                                    params_dtype=params_dtype, tp=tp, parallel_mode="column")
        else:
            self.lm_head = HeadLinear(config.hidden_size, config.vocab_size, init_std=config.initializer_range,
                                      device=_device_for(backend), dtype=params_dtype, tp=tp)

    def forward(self, x):
        return self.lm_head(self.norm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, backend: str, params_dtype=None, tp: TensorParallel | None = None,
                 options: ModelOptions = ModelOptions(), ep: ExpertParallel | None = None, checkpoint_fn=None):
        super().__init__()
        self.embed_tokens = Embedding(config, backend, params_dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend, params_dtype, tp, options, ep, checkpoint_fn)
                                    for i in range(config.num_hidden_layers))
        self.norm: nn.Module | None = None  # set by LlamaForCausalLM from its FinalNormHead


def _attention_mask(attention_mask, q_len: int, past: int, device) -> torch.Tensor | None:
    """Boolean ``[b, 1, q, past + q]`` mask (causal, bottom-right aligned, and padding), or None when plain
    causal attention over the whole sequence is exact."""
    if past == 0 and (attention_mask is None or bool(attention_mask.all())):
        return None
    q_pos = torch.arange(past, past + q_len, device=device)[:, None]
    kv_pos = torch.arange(past + q_len, device=device)[None, :]
    mask = (kv_pos <= q_pos)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -(past + q_len):].to(torch.bool)
        # a padding query sees no key at all, which would give NaN: let it attend to itself
        mask = mask | (~mask.any(-1, keepdim=True) & (kv_pos == q_pos))
    return mask


def _output(**fields) -> CausalLMOutputWithPast:
    cache = fields.pop("cache")
    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    return CausalLMOutputWithPast(**fields, **{name: cache})


class LlamaForCausalLM(PreTrainedModel, GenerationMixin):
    """HF-compatible causal LM. ``backend``: ``"auto"`` (TE on CUDA if installed), ``"te"`` or ``"torch"``.

    ``forward`` follows transformers' contract (``input_ids``, ``attention_mask``, ``labels`` -> ``.loss``,
    ``.logits``, plus ``.lm_loss`` / ``.z_loss`` when ``z_loss_coeff`` is set); ``generate()`` works with a KV
    cache on both backends. ``training_loss`` computes the loss on pre-shifted targets without the HF output.
    ``options``: fused kernels and recompute (:class:`~llmjp_ds.model.options.ModelOptions`);
    ``checkpoint_fn``: the function that recomputes a decoder layer under ``recompute: full``, an MoE block under
    ``moe`` (default the backend's; the precision schedule's emulator has its own). ``ep``: the expert-parallel
    group an MoE model's experts are split over (:class:`~llmjp_ds.model.expert_parallel.ExpertParallel`; None:
    every expert here).
    """

    config_class = LlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: LlamaConfig, backend: str | None = None, params_dtype: torch.dtype | None = None,
                 z_loss_coeff: float = 0.0, fused_loss: bool = False, fp8_lm_head: bool = False,
                 tp: TensorParallel | None = None, options: ModelOptions = ModelOptions(), checkpoint_fn=None,
                 ep: ExpertParallel | None = None):
        check_supported(config)
        super().__init__(config)
        self.backend = resolve_backend(backend)
        self.tp = tp
        self._rope = (head_dim_of(config), rope_theta(config))  # RoPE's width and base, as the pipeline's layers
        self.loss_fn = CausalLMLoss(z_loss_coeff, fused_loss, tp)  # see llmjp_ds.model.loss
        self.activation_checkpointing = options.recompute_layers
        self.checkpoint_fn = checkpoint_fn or layers_module(self.backend).checkpoint
        self.model = LlamaModel(config, self.backend, params_dtype, tp, options, ep, self.checkpoint_fn)
        head = FinalNormHead(config, self.backend, params_dtype, fp8_head=fp8_lm_head, tp=tp)
        self.model.norm, self.lm_head = head.norm, head.lm_head  # HF's names for the same two modules
        self.post_init()

    # transformers calls this from post_init; every module above initialised itself already
    def _init_weights(self, module):
        pass

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def hidden_states(self, input_ids, position_ids=None, attention_mask=None, cache=None, inputs_embeds=None):
        if self.tp is not None and (cache is not None or inputs_embeds is not None or (
                attention_mask is not None and not bool(attention_mask.all()))):
            raise ValueError("a tensor-parallel model trains and evaluates only: generate with its export "
                             "(llmjp-ds export merges the shards)")
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        s = sequence_length(x, self.tp)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            freqs = rope_freqs(torch.arange(past, past + s, device=x.device), *self._rope)
        else:
            freqs = rope_freqs(position_ids, *self._rope)
            if freqs.dim() == 3 and freqs.shape[0] == 1:
                freqs = freqs[0]
        mask = _attention_mask(attention_mask, s, past, x.device)
        checkpointing = self.activation_checkpointing and self.training and cache is None and mask is None
        for layer in self.model.layers:
            if checkpointing:
                x = self.checkpoint_fn(layer, x, freqs)
            else:
                x = layer(x, freqs, mask, cache)
        return self.model.norm(x)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, shift_labels=None, **kwargs):
        """``labels`` align with ``input_ids`` (shifted here, as in transformers); ``shift_labels`` are already
        shifted (transformers' name for it), which is how the trainer calls the model."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        use_cache = use_cache and self.tp is None  # a tensor-parallel model does not generate
        if use_cache and cache is None and not self.training:
            cache = DynamicCache(config=self.config)
        hidden = self.hidden_states(input_ids, position_ids, attention_mask, cache, inputs_embeds)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        parts = LossParts(None, None, None)
        targets = shift_labels if shift_labels is not None else (
            shift_labels_of(labels) if labels is not None else None)
        routing = {}
        if targets is not None:
            overwritten = self.loss_fn.overwrites(logits)  # its backward writes the gradient over the logits
            parts, routing = self._with_router_losses(self.loss_fn(logits, targets))
            logits = None if overwritten else logits
        out = _output(loss=parts.loss, logits=logits, cache=cache if use_cache else None)
        if targets is not None:
            out["lm_loss"], out["z_loss"] = parts.lm_loss, parts.z_loss
            for key, value in routing.items():
                out[key] = value
        return out

    def training_loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> LossParts:
        """Loss of ``input_ids [b, s]`` against ``targets [b, s]`` (already shifted), z-loss and an MoE model's
        router losses included."""
        return self._with_router_losses(self.loss_fn(self.lm_head(self.hidden_states(input_ids)), targets))[0]

    def _with_router_losses(self, parts: LossParts) -> tuple[LossParts, dict]:
        """``parts`` with the MoE layers' router losses of the forward just run added to the loss, and what they
        routed: ``router_aux_loss`` and ``router_z_loss`` (coefficient-free, the mean over the MoE layers, as
        Megatron-LM logs them), ``expert_load`` ``[MoE layers, E]`` (the tokens that chose each expert) and
        ``dropped_tokens`` (over capacity). A dense model's are ``parts`` and nothing."""
        routed = [layer.moe.routed for layer in self.model.layers if hasattr(layer, "moe")]
        if not routed:
            return parts, {}
        extra = sum(r.loss for r in routed)
        return parts._replace(loss=parts.loss + extra), {
            "router_aux_loss": torch.stack([r.aux_loss for r in routed]).mean(),
            "router_z_loss": torch.stack([r.z_loss for r in routed]).mean(),
            "expert_load": torch.stack([r.tokens_per_expert for r in routed]),
            "dropped_tokens": sum(r.dropped for r in routed)}

    # --- Hugging Face checkpoints -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, backend: str | None = None, dtype: torch.dtype | None = None,
                        **kwargs) -> "LlamaForCausalLM":
        """Load any HF ``LlamaForCausalLM`` safetensors checkpoint directory (sharded or not)."""
        return load_hf_checkpoint(cls, Path(path), backend=backend, dtype=dtype, **kwargs)

    def save_pretrained(self, path, dtype: torch.dtype | None = None, max_shard_size: int = 5 * 2**30,
                        **_) -> None:
        """Write a plain ``model_type: llama`` checkpoint (safetensors + config.json + generation_config.json)."""
        save_hf_checkpoint(self, Path(path), dtype=dtype, max_shard_size=max_shard_size)
