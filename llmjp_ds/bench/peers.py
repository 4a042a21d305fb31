"""What ``llmjp-ds bench`` measures ours against, each behind the same step function ``step(i, batches) ->
[lm_loss, z_loss]`` over the same micro-batches, and our own stage model for the decoder-only shapes.

* ``peer-bf16``: transformers' ``LlamaForCausalLM`` (sdpa) under the same DeepSpeed config and optimizer, called
  as HF users call it, with ``labels``: what an HF user would write.
* ``peer-mcore-*``: Megatron-Core (``pip install -e ".[bench]"``), the stack LLM-jp trained the 172B model with,
  at its best single-GPU settings: ``GPTModel`` with the TE layer spec, its ``DistributedDataParallel`` (fp32
  main grads, ``grad_reduce_in_fp32``) with the distributed optimizer (TE's FusedAdam), gradient-accumulation,
  RoPE (with ``fused_single_qkv_rope``: the QKV split and RoPE in one TE kernel, as ``model.fused_qkv_rope:
  te`` does for ours), bias-activation and TE cross-entropy fusions, TE's op fuser for the MLP
  (``use_transformer_engine_op_fuser``: measured faster at llmjp3-1.8b in BF16 and FP8, run Z of
  docs/performance.md), ``forward_backward_no_pipelining`` over the micro-batches. ``llmjp-ds bench
  --peer-set KEY=VALUE`` changes one of its switches (:data:`MCORE_SWITCHES`).
  FP8 is ``hybrid`` delayed scaling with amax history 1 (most_recent); ``-fp8-param`` adds FP8 primary weights.
* ``ref-te-layer-*``: plain ``te.TransformerLayer`` forward + backward (no optimizer) at a decoder-only shape:
  the floor our full step at that shape must reach.

A decoder-only shape (``172b-tp4-stage``) is what one GPU of the 172B's TP4 x PP16 layout runs in a middle
stage: its share of six decoder layers, no embedding, no head, no collectives. :func:`stage_model` is ours at it:
our decoder layers on a fixed random input, the mean square of the output as the loss.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.functional as F

from llmjp_ds.config import model_config_of
from llmjp_ds.optim.lr_schedule import schedule_lr
from llmjp_ds.model.main_grad import accumulate_wgrad
from llmjp_ds.model.shapes import has_qk_norm, is_moe_layer, rope_theta
from llmjp_ds.model.torch_layers import attention_backends
from llmjp_ds.optim.adamw import build_optimizer, set_lr
from llmjp_ds.parallel.context import ParallelContext
from llmjp_ds.parallel.ds_config import build_ds_config
from llmjp_ds.parallel.runners import EngineRunner
from llmjp_ds.precision.schedule import PrecisionSchedule

MCORE_VARIANTS = {  # variant: (fp8 recipe or None, FP8 primary weights)
    "peer-mcore-bf16": (None, False),
    "peer-mcore-fp8-delayed": ("delayed", False),
    "peer-mcore-fp8-param": ("delayed", True),
}
TE_LAYER_VARIANTS = ("ref-te-layer-bf16", "ref-te-layer-fp8-delayed", "ref-te-layer-fp8-current")


def _outputs(loss):
    return types.SimpleNamespace(loss=loss, lm_loss=loss, z_loss=torch.zeros_like(loss))


def _stage_input(config, micro: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(micro, seq, config.hidden_size, generator=g).to(device=device, dtype=torch.bfloat16)


def stage_model(config, backend: str, micro: int, seq: int, device):
    """Our decoder layers alone (a middle pipeline stage's share), behind the trainer's call signature."""
    from llmjp_ds.model.llama import DecoderLayer, head_dim_of, rope_freqs

    class StageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(DecoderLayer(config, i, backend)
                                              for i in range(config.num_hidden_layers))
            self.register_buffer("x", _stage_input(config, micro, seq, device), persistent=False)
            # fp32 RoPE angles, as the whole model computes them: an attribute, not a buffer, so that the engine's
            # cast of the module to bf16 leaves them alone
            self.freqs = rope_freqs(torch.arange(seq, device=device), head_dim_of(config), rope_theta(config))

        def forward(self, input_ids, shift_labels):
            h = self.x
            for layer in self.layers:
                h = layer(h, self.freqs)
            return _outputs(h.float().square().mean())

    return StageModel()


def hf_peer(cfg, layout):
    """(step, model config) of transformers + DeepSpeed, wired as a user would (the same JSON and optimizer,
    none of our engine code) under our step runner."""
    import deepspeed
    import transformers


    ctx = ParallelContext.start(layout)
    torch.manual_seed(cfg.train.seed)
    config = model_config_of(cfg)
    config._attn_implementation = "sdpa"

    class PeerLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = transformers.LlamaForCausalLM(config)

        def forward(self, input_ids, shift_labels):
            with attention_backends(input_ids.device, self.lm.dtype):  # transformers' sdpa: our model's backends
                return _outputs(self.lm(input_ids=input_ids, labels=input_ids).loss)

    with ctx.device:
        model = PeerLM()
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg.optim),
                                      config=build_ds_config(cfg, layout))
    runner = EngineRunner(engine, PrecisionSchedule(cfg.precision, "torch", 1), ctx)  # BF16: no FP8 context

    def step(i, batches):
        set_lr(engine.optimizer, schedule_lr(i, cfg.optim, cfg.train.steps))
        return runner.train_step(batches).losses

    return step, config


def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad) -> None:
    """apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``: ``main_grad += grad_output^T @ input`` as
    one GEMM with an fp32 accumulator (what our head does: ``model/main_grad.accumulate_wgrad``)."""
    accumulate_wgrad(main_grad, grad_output, total_input)


def _apex_wgrad_stand_in() -> None:
    """Megatron's own linear layers (the LM head) fuse the weight-gradient accumulation with apex's
    ``fused_weight_gradient_mlp_cuda``; without apex, the same accumulation stands in for it. Another process
    (``pretrain_gpt.py``) imports it from benchmarks/parity/apex/."""
    if "fused_weight_gradient_mlp_cuda" in sys.modules:
        return
    module = types.ModuleType("fused_weight_gradient_mlp_cuda")
    module.wgrad_gemm_accum_fp32 = module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32
    sys.modules[module.__name__] = module


# Megatron-Core switches a bench run may add to the peer (``llmjp-ds bench --peer-set KEY=VALUE``): fields of its
# TransformerConfig; ``use_transformer_engine_op_fuser`` also builds the layer spec with TE's op fuser
MCORE_SWITCHES = ("fused_residual_rmsnorm", "use_transformer_engine_op_fuser", "use_te_activation_func",
                  "persist_layer_norm", "apply_rope_fusion", "fused_single_qkv_rope", "cross_entropy_loss_fusion",
                  "cross_entropy_fusion_impl", "bias_activation_fusion", "masked_softmax_fusion",
                  "gradient_accumulation_fusion")


def mcore_layer_shape(config) -> dict:
    """The fields of Megatron-Core's ``TransformerConfig`` that give a model config's layer shape: GQA as query
    groups, the head width as KV channels, RMSNorm's eps, the per-head query and key norms of a Qwen3 model."""
    return dict(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                num_attention_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
                ffn_hidden_size=config.intermediate_size, kv_channels=config.head_dim,
                layernorm_epsilon=config.rms_norm_eps, init_method_std=config.initializer_range,
                qk_layernorm=has_qk_norm(config))


def mcore_model_args(config, seq: int) -> dict:
    """``GPTModel``'s arguments for a model config: RoPE's base, the head untied, and the vocabulary as it is.
    Megatron-LM's training pads the vocabulary to a multiple of 128 x TP before GPTModel sees it; our shapes hold
    it padded already, so both models have the same rows."""
    return dict(vocab_size=config.vocab_size, max_sequence_length=seq, position_embedding_type="rope",
                rotary_base=int(rope_theta(config)), share_embeddings_and_output_weights=False)


def mcore_moe_args(config, cfg) -> dict:
    """Megatron-Core's MoE fields for an MoE model config at its best single-GPU settings (LLM-jp's MoE
    arguments): grouped GEMM, permute and router fusion, the alltoall dispatcher (at EP 1), the router in fp32,
    the run config ``cfg``'s router losses, the dense layers as ``moe_layer_freq``; nothing for a dense model."""
    if not getattr(config, "num_experts", 0):
        return {}
    m = cfg.model
    layers = range(config.num_hidden_layers)
    return dict(num_moe_experts=config.num_experts, moe_router_topk=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.moe_intermediate_size, moe_grouped_gemm=True, moe_permute_fusion=True,
                moe_router_fusion=True, moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
                moe_router_load_balancing_type=m.moe_aux_loss, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                moe_z_loss_coeff=m.moe_z_loss_coeff, moe_layer_freq=[int(is_moe_layer(config, i)) for i in layers])


def _mcore_config(config, variant: str, switches: dict | None = None, moe: dict | None = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    recipe, fp8_param = MCORE_VARIANTS[variant]
    fp8 = dict(fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent",
               fp8_param=fp8_param) if recipe else {}
    return TransformerConfig(
        **mcore_layer_shape(config), normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, gradient_accumulation_fusion=True,
        # one kernel for the QKV split and RoPE, which Megatron-Core refuses under qk-layernorm (the norm comes
        # between them)
        **{"apply_rope_fusion": True, "fused_single_qkv_rope": not has_qk_norm(config),
           "bias_activation_fusion": True, "cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te",
           # TE's op fuser for the dense MLP; Megatron-Core's grouped MLP asserts under it (Blackwell only)
           "use_transformer_engine_op_fuser": not moe, **(switches or {})}, **fp8, **(moe or {}))


def mcore_loss(per_token: torch.Tensor):
    """Megatron-Core's loss function for the peer: the mean per-token loss, and the value to log. The logged value
    is a copy: Megatron-Core 0.19.2's schedule divides the returned loss by the micro-batch count in place
    (``output_tensor /= num_microbatches``), which a view would follow."""
    mean = per_token.float().mean()
    return mean, {"lm loss": mean.detach().clone()}


def mcore_peer(cfg, layout, variant: str, switches: dict | None = None):
    """(step, model config) of Megatron-Core at its best single-GPU settings (the module docstring), with
    ``switches`` (``{field: value}`` of :data:`MCORE_SWITCHES`) set in its TransformerConfig."""
    _apex_wgrad_stand_in()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func


    ParallelContext.start(layout)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    config = model_config_of(cfg)
    seq = cfg.data.seq_len or config.max_position_embeddings
    moe = mcore_moe_args(config, cfg)
    tcfg = _mcore_config(config, variant, switches, moe)
    spec = get_gpt_layer_with_transformer_engine_spec(
        use_te_op_fuser=tcfg.use_transformer_engine_op_fuser, num_experts=moe.get("num_moe_experts"),
        moe_grouped_gemm=bool(moe), qk_layernorm=has_qk_norm(config))
    gpt = GPTModel(tcfg, spec, **mcore_model_args(config, seq)).cuda()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = DistributedDataParallel(config=tcfg, ddp_config=ddp, module=gpt)
    tcfg.no_sync_func, tcfg.finalize_model_grads_func = model.no_sync, finalize_model_grads
    o = cfg.optim
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.beta1, adam_beta2=o.beta2,
        adam_eps=o.eps, clip_grad=o.clip_grad, bf16=True, use_distributed_optimizer=True), [model])
    positions = torch.arange(seq, device="cuda")[None]
    run = get_forward_backward_func()

    def forward_step(data, module):
        tokens, labels = next(data)
        out = module(tokens, positions.expand_as(tokens), None, labels=labels)  # per-token loss
        return out, mcore_loss

    def step(i, batches):
        set_lr(optimizer, schedule_lr(i, o, cfg.train.steps))  # the schedule ours and the HF peer step with
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = run(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                     num_microbatches=len(batches), seq_length=seq, micro_batch_size=batches[0][0].shape[0],
                     forward_only=False)
        optimizer.step()
        mean = torch.stack([x["lm loss"] for x in losses]).mean()
        return torch.stack([mean, torch.zeros_like(mean)])

    return step, config


def te_layer_reference(cfg, variant: str):
    """(step, model config) of plain ``te.TransformerLayer`` forward + backward at a decoder-only shape, on
    the stage model's input and loss; no optimizer (weight gradients accumulate in ``.grad``)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format


    config = model_config_of(cfg)
    micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len or config.max_position_embeddings
    torch.manual_seed(cfg.train.seed)
    layers = torch.nn.ModuleList(te.TransformerLayer(
        config.hidden_size, config.intermediate_size, config.num_attention_heads,
        num_gqa_groups=config.num_key_value_heads, kv_channels=config.head_dim, layernorm_epsilon=config.rms_norm_eps,
        hidden_dropout=0.0, attention_dropout=0.0, layer_number=i + 1, self_attn_mask_type="causal",
        normalization="RMSNorm", activation="swiglu", bias=False, attn_input_format="bshd", fuse_qkv_params=True,
        params_dtype=torch.bfloat16, device="cuda") for i in range(config.num_hidden_layers))
    rope = te.attention.RotaryPositionEmbedding(config.head_dim, rotary_base=rope_theta(config))(seq).cuda()
    x = _stage_input(config, micro, seq, "cuda")
    recipe = variant.removeprefix("ref-te-layer-")
    fp8 = {"fp8-delayed": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1,
                                                 amax_compute_algo="most_recent"),
           "fp8-current": lambda: Float8CurrentScaling(fp8_format=Format.HYBRID)}.get(recipe)

    def step(i, batches):
        total = torch.zeros((), device="cuda")
        for _ in batches:
            ctx = te.fp8_autocast(enabled=True, fp8_recipe=fp8()) if fp8 else contextlib.nullcontext()
            with ctx:
                h = x
                for layer in layers:
                    h = layer(h, rotary_pos_emb=rope)
            loss = h.float().square().mean()
            loss.backward()
            total += loss.detach()
        mean = total / len(batches)
        return torch.stack([mean, torch.zeros_like(mean)])

    return step, config
