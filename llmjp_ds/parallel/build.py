"""Building the model on this rank: the HF model (no pipeline) or a ``PipelineModule`` of the same layer classes
(``parallel/stages.py``), seeded per layer so every layout starts from the same weights, HF weights loaded into
it, and DeepSpeed's engine around it."""

from __future__ import annotations

from pathlib import Path

import torch

from llmjp_ds.config import RunConfig, model_config_of, model_options_of
from llmjp_ds.errors import fail
from llmjp_ds.model import LlamaForCausalLM
from llmjp_ds.model.backend import layers_module
from llmjp_ds.model.hf_adapter import ep_global_name, from_hf_state_dict
from llmjp_ds.model.hf_io import read_hf_tensors
from llmjp_ds.model.tensor_parallel import sum_sequence_parallel_grads
from llmjp_ds.optim.adamw import build_optimizer
from llmjp_ds.parallel.deepspeed_internals import (expert_parallel_module, fuse_grad_accumulation, fuse_optimizer_step,
                                                   local_layers)
from llmjp_ds.parallel.ds_config import build_ds_config
from llmjp_ds.parallel.layout import Layout
from llmjp_ds.parallel.stages import local_weights, our_names, pipeline_module, seeded_layer_specs, shard_of


def build_model(cfg: RunConfig, model_config, backend: str, checkpoint_fn=None, tp=None, layout: Layout | None = None,
                ep=None, weights: dict | None = None):
    """The HF model (no pipeline) or a ``PipelineModule`` of the same layer classes, and the pipeline's loss
    function (None without a pipeline). ``checkpoint_fn``: the activation-checkpoint function (default: the
    backend's; the precision schedule hands the emulator's). ``tp``: this rank's tensor-parallel group
    (:class:`~llmjp_ds.model.tensor_parallel.TensorParallel`), or None; ``ep``: its expert-parallel group
    (:class:`~llmjp_ds.model.expert_parallel.ExpertParallel`), or None. ``weights``: the whole model's first
    weights (our names; a fine-tune start), else ``model.init_from_hf``'s or the seeded initialisation."""
    checkpoint_fn = checkpoint_fn or layers_module(backend).checkpoint
    loss_kwargs = {"z_loss_coeff": cfg.model.z_loss, "fused_loss": cfg.model.fused_loss and torch.cuda.is_available()}
    fp8_head = cfg.precision.fp8_lm_head
    built = {"fp8_lm_head": fp8_head, "options": model_options_of(cfg), "checkpoint_fn": checkpoint_fn, **loss_kwargs}
    if cfg.parallel.pipeline_stages == 1:
        if cfg.model.init_from_hf and tp is None and ep is None:
            model = LlamaForCausalLM.from_pretrained(cfg.model.init_from_hf, backend=backend, dtype=torch.float32,
                                                     **built)
        else:
            model = LlamaForCausalLM(model_config, backend=backend, tp=tp, ep=ep, **built)
            if cfg.model.init_from_hf:
                load_hf_into_layers([(i, m) for i, m in enumerate(_layers_of(model))], cfg.model.init_from_hf,
                                    model_config, tp, ep)
            elif weights is not None:
                load_into_layers(list(enumerate(_layers_of(model))), weights, model_config, tp, ep)
            else:
                init_like_pipeline(model, model_config, backend, cfg.train.seed, fp8_head, tp, ep)
        sum_sequence_parallel_grads(model, tp)
        return model, None
    from llmjp_ds.model.pipeline_layers import PipelineLoss

    loss = PipelineLoss(cfg.model.z_loss, loss_kwargs["fused_loss"], tp)
    module = pipeline_module(cfg, model_config, backend, checkpoint_fn, loss, tp, layout, ep)
    if cfg.model.init_from_hf:
        load_hf_into_layers(local_layers(module), cfg.model.init_from_hf, model_config, tp, ep)
    elif weights is not None:
        load_into_layers(local_layers(module), weights, model_config, tp, ep)
    sum_sequence_parallel_grads(module, tp)
    return module, loss


def check_stages_hold_experts(cfg: RunConfig, module, ctx) -> None:
    """Under expert parallelism with a pipeline, every stage holds experts (the stages agree, one all-reduce):
    DeepSpeed's ZeRO reduces the gradient norm of each optimizer group over the stages, and a stage's experts are a
    group of their own."""
    from deepspeed.moe.utils import is_moe_param

    if ctx.ep is None or cfg.parallel.pipeline_stages == 1:
        return
    if ctx.any_rank(not any(is_moe_param(p) for p in module.parameters())):
        fail(f"parallel.expert_parallel={ctx.ep.size} with parallel.pipeline_stages={cfg.parallel.pipeline_stages}: "
             f"a stage of parallel.partition_method={cfg.parallel.partition_method} holds no MoE layer, and "
             "DeepSpeed's ZeRO needs the experts' optimizer group on every stage; use "
             "parallel.partition_method=type:DecoderLayerPipe (decoder layers split evenly) or fewer stages")


def _layers_of(model) -> list:
    """The single model's modules in pipeline order (embedding, decoder layers, final norm + head)."""
    return [model.model.embed_tokens, *model.model.layers, _NormHead(model.model.norm, model.lm_head)]


class _NormHead(torch.nn.Module):
    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head


def init_like_pipeline(model, model_config, backend: str, seed: int, fp8_head: bool = False, tp=None,
                       ep=None) -> None:
    """Give the single-model layout the weights any pipeline layout builds from the same seed (layer by layer,
    see :func:`seeded_layer_specs`), so runs on different layouts start from the same model; under tensor or
    expert parallelism this rank's part of each layer built whole."""
    n, experts = model_config.num_hidden_layers, getattr(model_config, "num_experts", 0)
    for idx, spec in enumerate(seeded_layer_specs(model_config, backend, seed, fp8_head)):
        state = spec.build().state_dict()
        result = model.load_state_dict(local_weights(our_names(idx, n, state), state, tp, ep, experts), strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"pipeline layer {idx} does not map onto the model: {result.unexpected_keys[:3]}")


def load_hf_into_layers(layers, hf_dir: str, model_config, tp=None, ep=None) -> None:
    """HF weights into ``layers`` (pairs of pipeline layer index and module), this rank's TP shard of each and,
    under expert parallelism, the experts it holds."""
    load_into_layers(layers, from_hf_state_dict(read_hf_tensors(Path(hf_dir)), model_config), model_config, tp, ep)


def load_into_layers(layers, whole: dict, model_config, tp=None, ep=None) -> None:
    """The whole model's state dict ``whole`` (our names) into ``layers`` (pairs of pipeline layer index and
    module), this rank's TP shard of each and, under expert parallelism, the experts it holds."""
    n = model_config.num_hidden_layers
    local = 0 if ep is None else ep.local(model_config.num_experts)

    def whole_name(ours: str) -> str:
        return ours if ep is None else ep_global_name(ours, ep.rank, local)

    for idx, layer in layers:
        layer.load_state_dict({name: shard_of(ours, whole[whole_name(ours)], tp)
                               for name, ours in our_names(idx, n, layer.state_dict()).items()}, strict=False)


def initialize(cfg: RunConfig, model, layout: Layout, mpu=None, ep=None):
    """DeepSpeed's engine around ``model`` with the LLM-jp AdamW groups and the run's DeepSpeed JSON; ``mpu``:
    the layout's grid under TP without a pipeline (a pipeline module brings its own). ``ep``: the expert-parallel
    group ``model``'s experts are split over: the engine then takes ``model`` as DeepSpeed's MoE
    (:func:`~llmjp_ds.parallel.deepspeed_internals.expert_parallel_module`; the parameters keep their names), with
    the expert parameters in optimizer groups of their own."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    split = None
    if ep is not None:
        model = expert_parallel_module(model, ep, model_config_of(cfg).num_experts)
        split = split_params_into_different_moe_groups_for_optimizer
    # fp32 + ZeRO-0 is the one layout where DeepSpeed steps our AdamW directly, with no overflow check: a
    # non-finite step must still be skipped (and reported through was_step_applied) there
    plain = cfg.parallel.zero_stage == 0 and cfg.precision.dtype == "fp32"
    optimizer = build_optimizer(model, cfg.optim, skip_nonfinite=plain, split_groups=split)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=build_ds_config(cfg, layout),
                                           mpu=mpu)
    if cfg.parallel.fused_grad_accumulation:
        fuse_grad_accumulation(engine.optimizer, engine.module.modules())
    if cfg.optim.fused_step and torch.cuda.is_available():
        fuse_optimizer_step(engine.optimizer)
    return engine
