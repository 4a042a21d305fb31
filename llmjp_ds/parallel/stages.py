"""The pipeline-parallel model on this rank: the model's pipeline layers (``model/pipeline_layers.py``) as DeepSpeed's
``LayerSpec``s, seeded per layer so every layout starts from the same weights, partitioned into stages by
training FLOPs, in a ``PipelineModule`` (:func:`llmjp_ds.parallel.deepspeed_internals.pipeline_module_class`)."""

from __future__ import annotations

import torch

from llmjp_ds.config import model_options_of, seq_len_of
from llmjp_ds.model.hf_adapter import ep_local_name, pipeline_name_to_ours, tp_shard
from llmjp_ds.model.options import ModelOptions
from llmjp_ds.parallel.context import topology
from llmjp_ds.parallel.deepspeed_internals import partition_balanced, pipeline_module_class


def stage_bounds(weights: list[float], num_stages: int) -> list[int]:
    """Where the stages start in the layer specs (``num_stages + 1`` bounds): DeepSpeed's linear partition,
    which makes the stages' summed weights as even as the cuts allow."""
    return partition_balanced(weights, num_stages)


def layer_seed(seed: int, layer_index: int) -> int:
    return (seed << 20) + layer_index


def shard_of(name: str, tensor: torch.Tensor, tp) -> torch.Tensor:
    """This rank's TP shard of the whole ``tensor`` of our ``name`` (all of it without tensor parallelism)."""
    return tensor if tp is None else tp_shard(name, tensor, tp.rank, tp.size)


def local_weights(names: dict[str, str], whole: dict, tp=None, ep=None, num_experts: int = 0,
                  by_layer: bool = False) -> dict:
    """This rank's part of a layer's ``whole`` weights, under our names (``names``: the layer's name of each ->
    ours), or the layer's own (``by_layer``): the TP shard of each and, under expert parallelism (``ep``), only the
    experts this rank holds, under their local indices (``hf_adapter.ep_local_name``)."""
    out = {}
    for name, ours in names.items():
        key = name if by_layer else ours
        local = key if ep is None else ep_local_name(key, ep.rank, ep.local(num_experts))
        if local is not None:
            out[local] = shard_of(ours, whole[name], tp)
    return out


def our_names(index: int, num_layers: int, layer_state: dict) -> dict[str, str]:
    """Pipeline layer ``index``'s weight names (its FP8 state left out) -> ours."""
    return {name: pipeline_name_to_ours(index, num_layers, name) for name in layer_state
            if not name.endswith("_extra_state")}


def seeded_layer_specs(model_config, backend: str, seed: int, fp8_head: bool = False, tp=None,
                       options: ModelOptions = ModelOptions(), checkpoint_fn=None, ep=None) -> list:
    """The pipeline's layer specs, each built right after seeding torch with (seed, its index): a stage builds
    only its own layers, so without this its weights would depend on where the partition cuts (and differ
    from the single-process model built from the same seed). Under TP or expert parallelism (``ep``) a layer is
    built whole from its seed and this rank keeps its part (its TP shard, ``hf_adapter.tp_shard``; the experts it
    holds, :func:`local_weights`): every TP and EP size starts from the same weights."""
    from deepspeed.pipe import LayerSpec

    from llmjp_ds.model.pipeline_layers import pipeline_layers

    n = model_config.num_hidden_layers

    class SeededLayerSpec(LayerSpec):
        def __init__(self, layer, whole, index: int):
            super().__init__(layer.typename, *layer.args, **layer.kwargs)
            self.whole, self.index = whole, index

        def build(self, log=False):
            torch.manual_seed(layer_seed(seed, self.index))
            if tp is None and ep is None:
                return super().build(log)
            whole = self.whole.build().state_dict()
            layer = super().build(log)
            layer.load_state_dict(local_weights(our_names(self.index, n, whole), whole, tp, ep, experts, True),
                                  strict=False)
            return layer

    layers = pipeline_layers(model_config, backend, fp8_head=fp8_head, tp=tp, options=options, ep=ep,
                             checkpoint_fn=checkpoint_fn)
    experts = getattr(model_config, "num_experts", 0)
    parted = tp is not None or ep is not None
    wholes = pipeline_layers(model_config, backend, fp8_head=fp8_head, options=options) if parted else layers
    return [SeededLayerSpec(layer, whole, i) for i, (layer, whole) in enumerate(zip(layers, wholes))]


def pipeline_module(cfg, model_config, backend: str, checkpoint_fn, loss, tp=None, layout=None, ep=None):
    """This stage's ``PipelineModule`` of the run's layers (``loss``: the last stage's loss function; ``ep``: the
    expert-parallel group the MoE layers' experts are split over, or None)."""
    from llmjp_ds.model.pipeline_layers import flops_weights

    options = model_options_of(cfg)
    return pipeline_module_class()(
        layers=seeded_layer_specs(model_config, backend, cfg.train.seed, cfg.precision.fp8_lm_head, tp, options,
                                  checkpoint_fn, ep),
        num_stages=cfg.parallel.pipeline_stages,
        topology=None if tp is None else topology(layout),
        loss_fn=loss,
        partition_method=cfg.parallel.partition_method,
        partition_weights=flops_weights(model_config, seq_len_of(cfg, model_config)),
        activation_checkpoint_interval=1 if options.recompute_layers else 0,
        activation_checkpoint_func=checkpoint_fn,
        checkpointable_layers=["DecoderLayerPipe"])
