"""Building the model on this rank: the HF model (no pipeline) or a ``PipelineModule`` of the same layer classes,
seeded per layer so every layout starts from the same weights, HF weights loaded into it, and DeepSpeed's
engine around it."""

from __future__ import annotations

from pathlib import Path

import torch

from llmjp_ds.config import RunConfig, seq_len_of
from llmjp_ds.model.hf_adapter import pipeline_name_to_ours
from llmjp_ds.parallel.layout import Layout


def build_model(cfg: RunConfig, model_config, backend: str, checkpoint_fn=None):
    """The HF model (no pipeline) or a ``PipelineModule`` of the same layer classes, and the pipeline's loss
    function (None without a pipeline). ``checkpoint_fn``: the activation-checkpoint function (default: the
    backend's; the precision schedule hands the emulator's)."""
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.backend import layers_module

    checkpoint_fn = checkpoint_fn or layers_module(backend).checkpoint
    loss_kwargs = {"z_loss_coeff": cfg.model.z_loss, "fused_loss": cfg.model.fused_loss and torch.cuda.is_available()}
    fp8_head = cfg.precision.fp8_lm_head
    if cfg.parallel.pipeline_stages == 1:
        if cfg.model.init_from_hf:
            model = LlamaForCausalLM.from_pretrained(cfg.model.init_from_hf, backend=backend,
                                                     dtype=torch.float32, fp8_lm_head=fp8_head, **loss_kwargs)
        else:
            model = LlamaForCausalLM(model_config, backend=backend, fp8_lm_head=fp8_head, **loss_kwargs)
            init_like_pipeline(model, model_config, backend, cfg.train.seed, fp8_head)
        model.activation_checkpointing = cfg.model.activation_checkpointing
        model.checkpoint_fn = checkpoint_fn
        return model, None
    from llmjp_ds.model.pipeline import PipelineLoss, flops_weights, pipeline_module_class

    loss = PipelineLoss(cfg.model.z_loss, loss_kwargs["fused_loss"])
    ckpt = cfg.model.activation_checkpointing
    module = pipeline_module_class()(
        layers=seeded_layer_specs(model_config, backend, cfg.train.seed, fp8_head),
        num_stages=cfg.parallel.pipeline_stages,
        loss_fn=loss,
        partition_method=cfg.parallel.partition_method,
        partition_weights=flops_weights(model_config, seq_len_of(cfg, model_config)),
        activation_checkpoint_interval=1 if ckpt else 0,
        activation_checkpoint_func=checkpoint_fn,
        checkpointable_layers=["DecoderLayerPipe"])
    if cfg.model.init_from_hf:
        load_hf_into_pipeline(module, cfg.model.init_from_hf, model_config)
    return module, loss


def _layer_seed(seed: int, layer_index: int) -> int:
    return (seed << 20) + layer_index


def seeded_layer_specs(model_config, backend: str, seed: int, fp8_head: bool = False) -> list:
    """The pipeline's layer specs, each built right after seeding torch with (seed, its index): a stage builds
    only its own layers, so without this its weights would depend on where the partition cuts (and differ
    from the single-process model built from the same seed)."""
    from deepspeed.pipe import LayerSpec

    from llmjp_ds.model.pipeline import layer_specs

    class SeededLayerSpec(LayerSpec):
        def __init__(self, spec, layer_seed: int):
            super().__init__(spec.typename, *spec.module_args, **spec.module_kwargs)
            self.layer_seed = layer_seed

        def build(self, log=False):
            torch.manual_seed(self.layer_seed)
            return super().build(log)

    return [SeededLayerSpec(spec, _layer_seed(seed, i))
            for i, spec in enumerate(layer_specs(model_config, backend, fp8_head=fp8_head))]


def init_like_pipeline(model, model_config, backend: str, seed: int, fp8_head: bool = False) -> None:
    """Give the single-model layout the weights any pipeline layout builds from the same seed (layer by layer,
    see :func:`seeded_layer_specs`), so runs on different layouts start from the same model."""
    n = model_config.num_hidden_layers
    for idx, spec in enumerate(seeded_layer_specs(model_config, backend, seed, fp8_head)):
        layer = spec.build()
        state = {pipeline_name_to_ours(idx, n, name): tensor for name, tensor in layer.state_dict().items()
                 if not name.endswith("_extra_state")}
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"pipeline layer {idx} does not map onto the model: {result.unexpected_keys[:3]}")
        del layer


def load_hf_into_pipeline(module, hf_dir: str, model_config) -> None:
    from llmjp_ds.model.hf_adapter import from_hf_state_dict
    from llmjp_ds.model.hf_io import read_hf_tensors

    ours = from_hf_state_dict(read_hf_tensors(Path(hf_dir)), model_config)
    n = model_config.num_hidden_layers
    for idx, layer in zip(range(module._local_start, module._local_stop), module.forward_funcs):
        state = {name: ours[pipeline_name_to_ours(idx, n, name)]
                 for name in layer.state_dict() if not name.endswith("_extra_state")}
        layer.load_state_dict(state, strict=False)


def initialize(cfg: RunConfig, model, layout: Layout):
    """DeepSpeed's engine around ``model`` with the LLM-jp AdamW groups and the run's DeepSpeed JSON."""
    import deepspeed

    from llmjp_ds.optim import build_optimizer
    from llmjp_ds.parallel.ds_config import build_ds_config
    from llmjp_ds.parallel.deepspeed_internals import fuse_grad_accumulation

    # fp32 + ZeRO-0 is the one layout where DeepSpeed steps our AdamW directly, with no overflow check: a
    # non-finite step must still be skipped (and reported through was_step_applied) there
    plain = cfg.parallel.zero_stage == 0 and cfg.precision.dtype == "fp32"
    optimizer = build_optimizer(model, cfg.optim, skip_nonfinite=plain)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=build_ds_config(cfg, layout))
    if cfg.parallel.fused_grad_accumulation:
        fuse_grad_accumulation(engine.optimizer, engine.module.modules())
    return engine
