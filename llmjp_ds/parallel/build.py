"""Building the model on this rank: the HF model (no pipeline) or a ``PipelineModule`` of the same layer classes,
seeded per layer so every layout starts from the same weights, HF weights loaded into it, and DeepSpeed's
engine around it."""

from __future__ import annotations

from pathlib import Path

import torch

from llmjp_ds.config import RunConfig, seq_len_of
from llmjp_ds.model.hf_adapter import pipeline_name_to_ours
from llmjp_ds.model.tensor_parallel import sum_sequence_parallel_grads
from llmjp_ds.parallel.context import topology
from llmjp_ds.parallel.layout import Layout


def build_model(cfg: RunConfig, model_config, backend: str, checkpoint_fn=None, tp=None, layout: Layout | None = None):
    """The HF model (no pipeline) or a ``PipelineModule`` of the same layer classes, and the pipeline's loss
    function (None without a pipeline). ``checkpoint_fn``: the activation-checkpoint function (default: the
    backend's; the precision schedule hands the emulator's). ``tp``: this rank's tensor-parallel group
    (:class:`~llmjp_ds.model.tensor_parallel.TensorParallel`), or None."""
    from llmjp_ds.model import LlamaForCausalLM
    from llmjp_ds.model.backend import layers_module

    checkpoint_fn = checkpoint_fn or layers_module(backend).checkpoint
    loss_kwargs = {"z_loss_coeff": cfg.model.z_loss, "fused_loss": cfg.model.fused_loss and torch.cuda.is_available()}
    fp8_head = cfg.precision.fp8_lm_head
    full, selective = cfg.model.recompute == "full", cfg.model.recompute == "selective"
    if cfg.parallel.pipeline_stages == 1:
        if cfg.model.init_from_hf and tp is None:
            model = LlamaForCausalLM.from_pretrained(cfg.model.init_from_hf, backend=backend,
                                                     dtype=torch.float32, fp8_lm_head=fp8_head, **loss_kwargs)
            for layer in model.model.layers:
                layer.self_attention.recompute_core = selective
        else:
            model = LlamaForCausalLM(model_config, backend=backend, fp8_lm_head=fp8_head, tp=tp,
                                     recompute_core=selective, **loss_kwargs)
            if cfg.model.init_from_hf:
                load_hf_into_layers([(i, m) for i, m in enumerate(_layers_of(model))], cfg.model.init_from_hf,
                                    model_config, tp)
            else:
                init_like_pipeline(model, model_config, backend, cfg.train.seed, fp8_head, tp)
        model.activation_checkpointing = full
        model.checkpoint_fn = checkpoint_fn
        sum_sequence_parallel_grads(model, tp)
        return model, None
    from llmjp_ds.model.pipeline import PipelineLoss, flops_weights, pipeline_module_class

    loss = PipelineLoss(cfg.model.z_loss, loss_kwargs["fused_loss"], tp)
    module = pipeline_module_class()(
        layers=seeded_layer_specs(model_config, backend, cfg.train.seed, fp8_head, tp, selective),
        num_stages=cfg.parallel.pipeline_stages,
        topology=None if tp is None else topology(layout),
        loss_fn=loss,
        partition_method=cfg.parallel.partition_method,
        partition_weights=flops_weights(model_config, seq_len_of(cfg, model_config)),
        activation_checkpoint_interval=1 if full else 0,
        activation_checkpoint_func=checkpoint_fn,
        checkpointable_layers=["DecoderLayerPipe"])
    if cfg.model.init_from_hf:
        load_hf_into_layers(list(zip(range(module._local_start, module._local_stop), module.forward_funcs)),
                            cfg.model.init_from_hf, model_config, tp)
    sum_sequence_parallel_grads(module, tp)
    return module, loss


def _share(name: str, tensor: torch.Tensor, tp) -> torch.Tensor:
    """This rank's TP shard of the whole ``tensor`` of our ``name`` (all of it without tensor parallelism)."""
    from llmjp_ds.model.hf_adapter import tp_shard

    return tensor if tp is None else tp_shard(name, tensor, tp.rank, tp.size)


def _our_names(index: int, num_layers: int, layer_state: dict) -> dict[str, str]:
    """Pipeline layer ``index``'s weight names (its FP8 state left out) -> ours."""
    return {name: pipeline_name_to_ours(index, num_layers, name) for name in layer_state
            if not name.endswith("_extra_state")}


def _layer_seed(seed: int, layer_index: int) -> int:
    return (seed << 20) + layer_index


def seeded_layer_specs(model_config, backend: str, seed: int, fp8_head: bool = False, tp=None,
                       recompute_core: bool = False) -> list:
    """The pipeline's layer specs, each built right after seeding torch with (seed, its index): a stage builds
    only its own layers, so without this its weights would depend on where the partition cuts (and differ
    from the single-process model built from the same seed). Under TP a layer is built whole from its seed
    and this rank keeps its shard (``hf_adapter.tp_shard``): every TP size starts from the same weights."""
    from deepspeed.pipe import LayerSpec

    from llmjp_ds.model.pipeline import layer_specs

    n = model_config.num_hidden_layers

    class SeededLayerSpec(LayerSpec):
        def __init__(self, spec, whole, index: int):
            super().__init__(spec.typename, *spec.module_args, **spec.module_kwargs)
            self.whole, self.index = whole, index

        def build(self, log=False):
            torch.manual_seed(_layer_seed(seed, self.index))
            if tp is None:
                return super().build(log)
            whole = self.whole.build().state_dict()
            layer = super().build(log)
            layer.load_state_dict({name: _share(ours, whole[name], tp)
                                   for name, ours in _our_names(self.index, n, whole).items()}, strict=False)
            return layer

    specs = layer_specs(model_config, backend, fp8_head=fp8_head, tp=tp, recompute_core=recompute_core)
    wholes = layer_specs(model_config, backend, fp8_head=fp8_head) if tp is not None else specs
    return [SeededLayerSpec(spec, whole, i) for i, (spec, whole) in enumerate(zip(specs, wholes))]


def _layers_of(model) -> list:
    """The single model's modules in pipeline order (embedding, decoder layers, final norm + head)."""
    return [model.model.embed_tokens, *model.model.layers, _NormHead(model.model.norm, model.lm_head)]


class _NormHead(torch.nn.Module):
    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head


def init_like_pipeline(model, model_config, backend: str, seed: int, fp8_head: bool = False, tp=None) -> None:
    """Give the single-model layout the weights any pipeline layout builds from the same seed (layer by layer,
    see :func:`seeded_layer_specs`), so runs on different layouts start from the same model."""
    n = model_config.num_hidden_layers
    for idx, spec in enumerate(seeded_layer_specs(model_config, backend, seed, fp8_head)):
        state = spec.build().state_dict()
        result = model.load_state_dict({ours: _share(ours, state[name], tp)
                                        for name, ours in _our_names(idx, n, state).items()}, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"pipeline layer {idx} does not map onto the model: {result.unexpected_keys[:3]}")


def load_hf_into_layers(layers, hf_dir: str, model_config, tp=None) -> None:
    """HF weights into ``layers`` (pairs of pipeline layer index and module), this rank's TP shard of each."""
    from llmjp_ds.model.hf_adapter import from_hf_state_dict
    from llmjp_ds.model.hf_io import read_hf_tensors

    whole = from_hf_state_dict(read_hf_tensors(Path(hf_dir)), model_config)
    n = model_config.num_hidden_layers
    for idx, layer in layers:
        layer.load_state_dict({name: _share(ours, whole[ours], tp)
                               for name, ours in _our_names(idx, n, layer.state_dict()).items()}, strict=False)


def initialize(cfg: RunConfig, model, layout: Layout, mpu=None):
    """DeepSpeed's engine around ``model`` with the LLM-jp AdamW groups and the run's DeepSpeed JSON; ``mpu``:
    the layout's grid under TP without a pipeline (a pipeline module brings its own)."""
    import deepspeed

    from llmjp_ds.optim import build_optimizer
    from llmjp_ds.parallel.ds_config import build_ds_config
    from llmjp_ds.parallel.deepspeed_internals import fuse_grad_accumulation

    # fp32 + ZeRO-0 is the one layout where DeepSpeed steps our AdamW directly, with no overflow check: a
    # non-finite step must still be skipped (and reported through was_step_applied) there
    plain = cfg.parallel.zero_stage == 0 and cfg.precision.dtype == "fp32"
    optimizer = build_optimizer(model, cfg.optim, skip_nonfinite=plain)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=build_ds_config(cfg, layout),
                                           mpu=mpu)
    if cfg.parallel.fused_grad_accumulation:
        fuse_grad_accumulation(engine.optimizer, engine.module.modules())
    return engine
